/*
 * norm.c - the gated RMSNorm of the KDA output (kern_rmsnorm_gated in
 * kern.h), the CPU reference of kern_cuda_rmsnorm_gated: the engine's
 * per-head output norm (kern_rmsnorm, then times sigmoid(z)) over rows.
 */
#include "kern.h"

void kern_rmsnorm_gated(const float *x, const float *z, const void *w, kern_dtype dt, int rows,
                        int n, float eps, float *y) {
    for (int r = 0; r < rows; r++) {
        const size_t off = (size_t)r * n;
        kern_rmsnorm(x + off, w, dt, n, eps, y + off);
        for (int i = 0; i < n; i++) y[off + i] *= kern_sigmoid(z[off + i]);
    }
}
