/*
 * kern_cuda_norm.cu - RMSNorm and the sigmoid-gated output RMSNorm of the
 * KDA layer on the GPU (kern_cuda_rmsnorm in kern_cuda.h): one warp per row,
 * or one CTA per row for rows of kNormRowMin or more.
 * CPU references: kern_rmsnorm and kern_rmsnorm_gated (kern.h).
 *
 * Numerics as the CPU: the sum of squares in double (per lane, then a warp
 * tree), r = (float)(1 / sqrt(ss / n + eps)) in double, y = x * r * w,
 * then * sigmoid(z) = 1 / (1 + expf(-z)); products rounded one by one
 * (no FMA contraction) so the only differences are the summation order of
 * ss and the expf implementation.
 */
#include <stdint.h>

#include "kern_cuda_impl.cuh"

namespace {

constexpr int kNormThreads = 256; /* 8 rows per CTA, or one wide row */

__device__ __forceinline__ float ld_any(const void *p, int bf16, size_t i) {
    if (bf16) return __uint_as_float((uint32_t)static_cast<const uint16_t *>(p)[i] << 16);
    return static_cast<const float *>(p)[i];
}

/* kern_f32_to_bf16: round to nearest even, NaN stays a (quiet) NaN. */
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

struct norm_params {
    const float *x;
    const void *z, *w;
    void *y;
    int z_bf16, w_bf16, y_bf16;
    int rows, n;
    float eps;
};

/* Row `off / n` from its sum of squares ss: y[i] = x[i] * r (* w[i])
 * (* sigmoid(z[i])) for i = first, first + step, ... (the row's threads). */
__device__ __forceinline__ void scale_row(const norm_params &p, size_t off, double ss, int first, int step) {
    const float *x = p.x + off;
    const float r = (float)(1.0 / sqrt(ss / p.n + (double)p.eps));
#pragma unroll 4
    for (int i = first; i < p.n; i += step) {
        float y = __fmul_rn(x[i], r);
        if (p.w) y = __fmul_rn(y, ld_any(p.w, p.w_bf16, i));
        if (p.z) {
            const float s = 1.0f / (1.0f + expf(-ld_any(p.z, p.z_bf16, off + i)));
            y = __fmul_rn(y, s);
        }
        if (p.y_bf16)
            static_cast<uint16_t *>(p.y)[off + i] = f32_to_bf16(y);
        else
            static_cast<float *>(p.y)[off + i] = y;
    }
}

__global__ void __launch_bounds__(kNormThreads) rmsnorm_kernel(const norm_params p) {
    const int row = (int)((blockIdx.x * (unsigned)blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= p.rows) return; /* whole warps: no barrier below */
    const size_t off = (size_t)row * p.n;
    const float *x = p.x + off;
    double ss = 0.0;
    for (int i = lane; i < p.n; i += 32) ss += (double)x[i] * x[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    scale_row(p, off, ss, lane, 32);
}

/*
 * One CTA per row, for wide rows (the hidden-size norms of a decode step:
 * a few rows of 2304): a warp walking 2304 floats alone waits on 72 loads
 * in turn (~25 µs on an H200); 256 threads issue them at once. Same
 * numerics: per-thread double partials, a warp tree, then the warps' sums.
 */
__global__ void __launch_bounds__(kNormThreads) rmsnorm_row_kernel(const norm_params p) {
    __shared__ double s_ss[kNormThreads / 32];
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const size_t off = (size_t)row * p.n;
    const float *x = p.x + off;
    double ss = 0.0;
#pragma unroll 4
    for (int i = tid; i < p.n; i += kNormThreads) ss += (double)x[i] * x[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) s_ss[warp] = ss;
    __syncthreads();
    ss = 0.0;
#pragma unroll
    for (int w = 0; w < kNormThreads / 32; w++) ss += s_ss[w];
    scale_row(p, off, ss, tid, kNormThreads);
}

/* Rows this wide or wider get a CTA each (rmsnorm_row_kernel). */
constexpr int kNormRowMin = 512;

bool dtype_ok(kern_dtype d) {
    return d == KERN_F32 || d == KERN_BF16;
}

} /* namespace */

extern "C" kds_status kern_cuda_rmsnorm(const kern_cuda_norm_args *a, void *stream, kds_err *err) {
    if (!a) return kern_cuda__err(err, KDS_INVALID_ARG, "rmsnorm: NULL arguments");
    if (a->rows < 0 || (a->rows > 0 && a->n < 1))
        return kern_cuda__err(err, KDS_INVALID_ARG, "rmsnorm: rows=%d n=%d", a->rows, a->n);
    if (!dtype_ok(a->y_dtype) || (a->w && !dtype_ok(a->w_dtype)) || (a->z && !dtype_ok(a->z_dtype)))
        return kern_cuda__err(err, KDS_INVALID_ARG,
                              "rmsnorm: dtypes y=%d w=%d z=%d (need F32 or BF16)", (int)a->y_dtype,
                              (int)a->w_dtype, (int)a->z_dtype);
    if (a->rows == 0) return KDS_OK;
    if (!a->x || !a->y)
        return kern_cuda__err(err, KDS_INVALID_ARG, "rmsnorm: NULL x or y device pointer");
    if (a->y_dtype == KERN_BF16 && (const void *)a->y == (const void *)a->x)
        return kern_cuda__err(err, KDS_INVALID_ARG, "rmsnorm: a bf16 y cannot alias the fp32 x");
    if (a->z && (const void *)a->z == a->y)
        return kern_cuda__err(err, KDS_INVALID_ARG, "rmsnorm: y may alias x, not z");
    norm_params p;
    p.x = a->x;
    p.z = a->z;
    p.w = a->w;
    p.y = a->y;
    p.z_bf16 = a->z_dtype == KERN_BF16;
    p.w_bf16 = a->w_dtype == KERN_BF16;
    p.y_bf16 = a->y_dtype == KERN_BF16;
    p.rows = a->rows;
    p.n = a->n;
    p.eps = a->eps;
    if (a->n >= kNormRowMin) {
        rmsnorm_row_kernel<<<(unsigned)a->rows, kNormThreads, 0, kern_cuda__stream(stream)>>>(p);
    } else {
        const unsigned blocks = (unsigned)((a->rows + kNormThreads / 32 - 1) / (kNormThreads / 32));
        rmsnorm_kernel<<<blocks, kNormThreads, 0, kern_cuda__stream(stream)>>>(p);
    }
    return kern_cuda__status(cudaGetLastError(), err, "rmsnorm launch");
}
