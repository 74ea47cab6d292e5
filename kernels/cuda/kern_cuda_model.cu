/*
 * kern_cuda_model.cu - the small kernels the whole-model GPU forward pass
 * (engine/eng_cuda.c) needs besides the KDA, norm, MoE and sampling ones:
 * the bf16/f32-weight matrix product, the KDA short convolution + SiLU,
 * SwiGLU, the residual add, and pinned host memory for the state hand-over.
 * Contracts in kern_cuda.h; CPU references kern_matmul, kern_silu,
 * kern_swiglu (kern.h) and the conv loop of engine/eng_forward.c.
 *
 * The tiled matrix product here is the plain fallback of kern_cuda_matmul:
 * 16 x 16 tiles through shared memory on CUDA cores, fp32 accumulation. The
 * GEMV, cuBLAS and grouped expert paths are in kern_cuda_gemm.cu.
 */
#include <stdint.h>

#include "kern_cuda_impl.cuh"

namespace {

constexpr int kTile = 16;

__device__ __forceinline__ float ld_w(const void *p, int bf16, size_t i) {
    if (bf16) return __uint_as_float((uint32_t)static_cast<const uint16_t *>(p)[i] << 16);
    return static_cast<const float *>(p)[i];
}

/* sigmoid as the CPU's: 1 / (1 + expf(-x)) */
__device__ __forceinline__ float sigm(float x) {
    return 1.0f / (1.0f + expf(-x));
}

/* y[t, r] (+)= sum_c x[t, c] * W[r, c]; block (16, 16): threadIdx.x walks r
 * (coalesced stores), threadIdx.y walks t; grid (ceil(rows/16), ceil(T/16)). */
__global__ void __launch_bounds__(kTile * kTile)
matmul_kernel(const void *W, int bf16, int rows, int cols, const float *x, int ldx, int T,
              float *y, int ldy, int accumulate) {
    __shared__ float ws[kTile][kTile + 1]; /* [r][c] */
    __shared__ float xs[kTile][kTile + 1]; /* [t][c] */
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int r0 = blockIdx.x * kTile, t0 = blockIdx.y * kTile;
    float acc = 0.0f;
    for (int c0 = 0; c0 < cols; c0 += kTile) {
        const int c = c0 + tx;
        /* thread (tx, ty) loads W[r0 + ty, c] and x[t0 + ty, c]: coalesced along c */
        ws[ty][tx] = (r0 + ty < rows && c < cols) ? ld_w(W, bf16, (size_t)(r0 + ty) * cols + c) : 0.0f;
        xs[ty][tx] = (t0 + ty < T && c < cols) ? x[(size_t)(t0 + ty) * ldx + c] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < kTile; j++) acc += xs[ty][j] * ws[tx][j];
        __syncthreads();
    }
    const int r = r0 + tx, t = t0 + ty;
    if (r < rows && t < T) {
        float *dst = y + (size_t)t * ldy + r;
        *dst = accumulate ? *dst + acc : acc;
    }
}

/* One thread per (t, ch): out = silu(sum_j w[ch, j] * tap_j[ch]). Single
 * sequence (slots == NULL): tap_j = ext row t + j. Across sequences: tap_j =
 * row j of tails[slots[t]] (j < taps), tap_taps = ext row taps + t; the
 * thread then moves its column of that tail on by one row (each sequence
 * owns its tail, each thread its column: no race). */
__global__ void conv_kernel(const float *ext, const float *w, int C, int W, int T,
                            float *tails, const int32_t *slots, int n_qk, int n_v, float *q,
                            float *k, float *v) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)T * C) return;
    const int t = (int)(i / C), ch = (int)(i % C);
    const int taps = W - 1;
    float acc = 0.0f;
    if (!slots) {
        for (int j = 0; j <= taps; j++) acc += w[(size_t)ch * W + j] * ext[(size_t)(t + j) * C + ch];
    } else {
        float *tail = tails + (size_t)slots[t] * taps * C;
        const float cur = ext[(size_t)(taps + t) * C + ch];
        for (int j = 0; j < taps; j++) acc += w[(size_t)ch * W + j] * tail[(size_t)j * C + ch];
        acc += w[(size_t)ch * W + taps] * cur;
        for (int j = 0; j + 1 < taps; j++) tail[(size_t)j * C + ch] = tail[(size_t)(j + 1) * C + ch];
        if (taps > 0) tail[(size_t)(taps - 1) * C + ch] = cur;
    }
    acc = acc * sigm(acc);
    if (ch < n_qk)
        q[(size_t)t * n_qk + ch] = acc;
    else if (ch < 2 * n_qk)
        k[(size_t)t * n_qk + ch - n_qk] = acc;
    else
        v[(size_t)t * n_v + ch - 2 * n_qk] = acc;
}

__global__ void swiglu_kernel(float *a, const float *b, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] = a[i] * sigm(a[i]) * b[i];
}

__global__ void add_kernel(float *y, const float *x, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i];
}

unsigned blocks_for(size_t n, int threads) {
    return (unsigned)((n + threads - 1) / threads);
}

} /* namespace */

/* The tiled fallback of kern_cuda_matmul (kern_cuda_gemm.cu checks the
 * arguments and dispatches; T >= 1, rows >= 1 here). */
kds_status kern_cuda__matmul_tiled(const kern_cuda_matmul_args *a, cudaStream_t st, kds_err *err) {
    if (a->T > 65535 * kTile)
        return kern_cuda__err(err, KDS_UNSUPPORTED, "matmul: T=%d rows exceed one launch", a->T);
    dim3 grid((unsigned)((a->rows + kTile - 1) / kTile), (unsigned)((a->T + kTile - 1) / kTile));
    dim3 block(kTile, kTile);
    matmul_kernel<<<grid, block, 0, st>>>(a->W, a->w_dtype == KERN_BF16, a->rows, a->cols, a->x, a->ldx, a->T, a->y, a->ldy, a->accumulate ? 1 : 0);
    return kern_cuda__status(cudaGetLastError(), err, "matmul launch");
}

extern "C" kds_status kern_cuda_short_conv(const kern_cuda_conv_args *a, void *stream, kds_err *err) {
    if (!a) return kern_cuda__err(err, KDS_INVALID_ARG, "short conv: NULL arguments");
    if (a->T < 0 || a->W < 1 || a->n_qk < 1 || a->n_v < 1)
        return kern_cuda__err(err, KDS_INVALID_ARG, "short conv: T=%d W=%d n_qk=%d n_v=%d", a->T,
                              a->W, a->n_qk, a->n_v);
    if (a->T == 0) return KDS_OK;
    if (!a->ext || !a->w || !a->q || !a->k || !a->v || (a->slots && !a->tails))
        return kern_cuda__err(err, KDS_INVALID_ARG, "short conv: NULL device pointer");
    const int C = 2 * a->n_qk + a->n_v;
    const size_t n = (size_t)a->T * C;
    conv_kernel<<<blocks_for(n, 256), 256, 0, kern_cuda__stream(stream)>>>(a->ext, a->w, C, a->W, a->T, a->tails, a->slots, a->n_qk, a->n_v, a->q, a->k, a->v);
    return kern_cuda__status(cudaGetLastError(), err, "short conv launch");
}

extern "C" kds_status kern_cuda_swiglu(float *a, const float *b, size_t n, void *stream, kds_err *err) {
    if (n == 0) return KDS_OK;
    if (!a || !b) return kern_cuda__err(err, KDS_INVALID_ARG, "swiglu: NULL device pointer");
    swiglu_kernel<<<blocks_for(n, 256), 256, 0, kern_cuda__stream(stream)>>>(a, b, n);
    return kern_cuda__status(cudaGetLastError(), err, "swiglu launch");
}

extern "C" kds_status kern_cuda_add(float *y, const float *x, size_t n, void *stream, kds_err *err) {
    if (n == 0) return KDS_OK;
    if (!y || !x) return kern_cuda__err(err, KDS_INVALID_ARG, "add: NULL device pointer");
    add_kernel<<<blocks_for(n, 256), 256, 0, kern_cuda__stream(stream)>>>(y, x, n);
    return kern_cuda__status(cudaGetLastError(), err, "add launch");
}

extern "C" kds_status kern_cuda_host_alloc(void **ptr, size_t bytes, kds_err *err) {
    if (!ptr) return kern_cuda__err(err, KDS_INVALID_ARG, "host alloc: NULL pointer");
    *ptr = NULL;
    if (bytes == 0) return KDS_OK;
    cudaError_t e = cudaMallocHost(ptr, bytes);
    if (e != cudaSuccess) {
        *ptr = NULL;
        (void)cudaGetLastError();
        return kern_cuda__status(e, err, "pinned host allocation");
    }
    return KDS_OK;
}

extern "C" void kern_cuda_host_free(void *ptr) {
    if (ptr) (void)cudaFreeHost(ptr);
}
