/*
 * kern_cuda_util.cu - device-side utilities of kern_cuda.h that tests and
 * benchmarks need at sizes where the host cannot keep up: filling a buffer
 * with reproducible uniform random values.
 */
#include <stdint.h>

#include "kern_cuda_impl.cuh"

namespace {

/* splitmix64 of (seed, index): a counter-based stream, so the value of an
 * element depends only on the seed and its index. */
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__global__ void fill_kernel(void *dst, int bf16, size_t n, float lo, float hi, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const uint64_t r = mix64(seed + 0x9E3779B97F4A7C15ull * (i + 1));
        const float x = lo + (hi - lo) * (float)((r >> 40) * (1.0 / 16777216.0));
        if (bf16) {
            uint32_t u = __float_as_uint(x);
            u += 0x7fffu + ((u >> 16) & 1u);
            static_cast<uint16_t *>(dst)[i] = (uint16_t)(u >> 16);
        } else {
            static_cast<float *>(dst)[i] = x;
        }
    }
}

} /* namespace */

extern "C" kds_status kern_cuda_fill_uniform(void *dst, kern_dtype dt, size_t n, float lo, float hi,
                                             uint64_t seed, void *stream, kds_err *err) {
    if (dt != KERN_F32 && dt != KERN_BF16)
        return kern_cuda__err(err, KDS_INVALID_ARG, "fill: dtype %d (need F32 or BF16)", (int)dt);
    if (n == 0) return KDS_OK;
    if (!dst) return kern_cuda__err(err, KDS_INVALID_ARG, "fill: NULL device pointer");
    const int threads = 256;
    const size_t want = (n + threads - 1) / threads;
    const unsigned blocks = (unsigned)(want < 65536 ? want : 65536);
    fill_kernel<<<blocks, threads, 0, kern_cuda__stream(stream)>>>(dst, dt == KERN_BF16, n, lo, hi,
                                                                  seed);
    return kern_cuda__status(cudaGetLastError(), err, "fill launch");
}

/* ------------------------------------------------------------------------ */
/* Generated-model weights and the embedding lookup                          */

namespace {

/* kern_gen_normal (kernels/cpu/ops.c), step for step; the double
 * operations use explicit round-to-nearest intrinsics so nvcc cannot fuse
 * them into FMAs the CPU does not do. */
__device__ __forceinline__ float gen_normal(uint64_t key, uint64_t i, float sd) {
    const uint64_t z = mix64(key + (i + 1) * 0x9E3779B97F4A7C15ull);
    double s = __dadd_rn(__dadd_rn(__dadd_rn((double)(z & 0xffff), (double)((z >> 16) & 0xffff)),
                                   (double)((z >> 32) & 0xffff)),
                         (double)(z >> 48));
    double v = __dadd_rn(__dmul_rn(s, 1.0 / 65536.0), -2.0);
    v = __dmul_rn(__dmul_rn(v, 1.7320508075688772), (double)sd);
    return (float)v;
}

__device__ __forceinline__ uint16_t to_bf16(float x) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

__global__ void gen_normal_kernel(void *dst, int bf16, size_t n, uint64_t key, float sd) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float x = gen_normal(key, i, sd);
        if (bf16)
            static_cast<uint16_t *>(dst)[i] = to_bf16(x);
        else
            static_cast<float *>(dst)[i] = x;
    }
}

/* one CTA per row; 8 bf16 (or 4 f32) per 16-byte load when aligned */
__global__ void embed_kernel(const void *table, int bf16, int vocab, int hidden,
                             const int32_t *ids, float *x) {
    const int t = blockIdx.x;
    const int32_t id = ids[t];
    float *dst = x + (size_t)t * hidden;
    if (id < 0 || id >= vocab) {
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = 0.0f;
        return;
    }
    if (bf16) {
        const uint16_t *src = static_cast<const uint16_t *>(table) + (size_t)id * hidden;
        for (int c = threadIdx.x; c < hidden; c += blockDim.x)
            dst[c] = __uint_as_float((uint32_t)src[c] << 16);
    } else {
        const float *src = static_cast<const float *>(table) + (size_t)id * hidden;
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = src[c];
    }
}

} /* namespace */

extern "C" kds_status kern_cuda_gen_normal(void *dst, kern_dtype dt, size_t n, uint64_t key,
                                           float sd, void *stream, kds_err *err) {
    if (dt != KERN_F32 && dt != KERN_BF16)
        return kern_cuda__err(err, KDS_INVALID_ARG, "gen_normal: dtype %d (need F32 or BF16)",
                              (int)dt);
    if (n == 0) return KDS_OK;
    if (!dst) return kern_cuda__err(err, KDS_INVALID_ARG, "gen_normal: NULL device pointer");
    const int threads = 256;
    const size_t want = (n + threads - 1) / threads;
    const unsigned blocks = (unsigned)(want < 65536 ? want : 65536);
    gen_normal_kernel<<<blocks, threads, 0, kern_cuda__stream(stream)>>>(dst, dt == KERN_BF16, n, key, sd);
    return kern_cuda__status(cudaGetLastError(), err, "gen_normal launch");
}

extern "C" kds_status kern_cuda_embed(const void *table, kern_dtype dt, int vocab, int hidden,
                                      const int32_t *ids, int T, float *x, void *stream,
                                      kds_err *err) {
    if (dt != KERN_F32 && dt != KERN_BF16)
        return kern_cuda__err(err, KDS_INVALID_ARG, "embed: dtype %d (need F32 or BF16)", (int)dt);
    if (T < 0 || vocab < 1 || hidden < 1)
        return kern_cuda__err(err, KDS_INVALID_ARG, "embed: T %d, vocab %d, hidden %d", T, vocab,
                              hidden);
    if (T == 0) return KDS_OK;
    if (!table || !ids || !x) return kern_cuda__err(err, KDS_INVALID_ARG, "embed: NULL pointer");
    embed_kernel<<<T, 256, 0, kern_cuda__stream(stream)>>>(table, dt == KERN_BF16, vocab, hidden, ids, x);
    return kern_cuda__status(cudaGetLastError(), err, "embed launch");
}

namespace {

/* one CTA per row, 16-byte words */
__global__ void rows_scatter_kernel(const uint4 *src, size_t words, const int32_t *idx, uint4 *dst) {
    const int r = blockIdx.x;
    const int32_t to = idx[r];
    if (to < 0) return;
    const uint4 *s = src + (size_t)r * words;
    uint4 *d = dst + (size_t)to * words;
    for (size_t w = threadIdx.x; w < words; w += blockDim.x) d[w] = s[w];
}

} /* namespace */

extern "C" kds_status kern_cuda_rows_scatter(const void *src, size_t row_bytes, const int32_t *idx,
                                             int n, void *dst, void *stream, kds_err *err) {
    if (n < 0 || row_bytes == 0 || row_bytes % 16 || ((uintptr_t)src | (uintptr_t)dst) % 16)
        return kern_cuda__err(err, KDS_INVALID_ARG,
                              "rows scatter: n %d, row_bytes %zu (a multiple of 16, 16-byte aligned "
                              "rows)", n, row_bytes);
    if (n == 0) return KDS_OK;
    if (!src || !idx || !dst) return kern_cuda__err(err, KDS_INVALID_ARG, "rows scatter: NULL pointer");
    rows_scatter_kernel<<<n, 256, 0, kern_cuda__stream(stream)>>>(static_cast<const uint4 *>(src), row_bytes / 16, idx, static_cast<uint4 *>(dst));
    return kern_cuda__status(cudaGetLastError(), err, "rows scatter launch");
}
