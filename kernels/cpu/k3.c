/*
 * k3.c - CPU references of the operators Kimi K3 adds to Kimi-Linear
 * (kern.h; reference/kimi-k3.md §4): the SiTU activation, MLA's sigmoid
 * output gate, and Block Attention Residuals' depth mix. The CUDA kernels
 * of the same contracts are checked against these.
 */
#include "kern.h"
#include "kern_math.h"

#include <math.h>

void kern_situ(float *a, const float *b, size_t n, float beta, float beta_l) {
    for (size_t i = 0; i < n; i++) {
        const float g = a[i], u = b[i];
        const float gate = beta * vtanh(g / beta) * vsigmoid(g);
        a[i] = gate * (beta_l * vtanh(u / beta_l));
    }
}

void kern_sigmoid_mul(float *x, const float *g, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] *= vsigmoid(g[i]);
}

/* Candidate j's row t. */
static const float *cand(const float *blocks, size_t block_stride, int n_blocks,
                         const float *partial, int j, int t, int D) {
    return j < n_blocks ? blocks + (size_t)j * block_stride + (size_t)t * D
                        : partial + (size_t)t * D;
}

void kern_attn_res_mix(int T, int D, const float *blocks, size_t block_stride, int n_blocks,
                       const float *partial, const float *u, float eps, float *out) {
    const int n = n_blocks + (partial != NULL);
    /* at most 9 candidates for K3 (8 snapshots and the partial) */
    double z[64];
    float w[64];
    for (int t = 0; t < T; t++) {
        double zmax = -INFINITY;
        for (int j = 0; j < n && j < 64; j++) {
            const float *c = cand(blocks, block_stride, n_blocks, partial, j, t, D);
            double ss = 0.0, dot = 0.0;
            for (int d = 0; d < D; d++) {
                ss += (double)c[d] * c[d];
                dot += (double)c[d] * u[d];
            }
            z[j] = dot / sqrt(ss / D + eps);
            if (z[j] > zmax) zmax = z[j];
        }
        double sum = 0.0;
        for (int j = 0; j < n && j < 64; j++) sum += exp(z[j] - zmax);
        for (int j = 0; j < n && j < 64; j++) w[j] = (float)(exp(z[j] - zmax) / sum);
        float *o = out + (size_t)t * D;
        for (int d = 0; d < D; d++) o[d] = 0.0f;
        for (int j = 0; j < n && j < 64; j++) {
            const float *c = cand(blocks, block_stride, n_blocks, partial, j, t, D);
            for (int d = 0; d < D; d++) o[d] += w[j] * c[d];
        }
    }
}
