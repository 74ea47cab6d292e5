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

/* ---- a generated block-format weight: kern_quantize_row of the stream ---- */

/* e2m1_code of kernels/cpu/quantize.c, step for step: the nearest E2M1
 * magnitude by the same rounded differences, ties to the even code. */
__device__ __forceinline__ unsigned gen_e2m1_code(float a) {
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const unsigned sign = a < 0.0f || (a == 0.0f && signbit(a)) ? 8u : 0u;
    float m = fabsf(a);
    if (!(m < 6.0f)) m = 6.0f;
    unsigned best = 0;
#pragma unroll
    for (unsigned c = 1; c < 8; c++) {
        const float dc = fabsf(__fsub_rn(mag[c], m)), db = fabsf(__fsub_rn(mag[best], m));
        if (dc < db || (dc == db && (c & 1u) == 0)) best = c;
    }
    return sign | best;
}

/* floor(log2(a)) of a finite a > 0, subnormals included (frexpf's ex - 1) */
__device__ __forceinline__ int gen_floor_log2(float a) {
    const unsigned u = __float_as_uint(a), ex = (u >> 23) & 0xffu;
    if (ex) return (int)ex - 127;
    return (31 - __clz((int)(u & 0x7fffffu))) - 149;
}

/* 2^k for k in [-127, 127], exactly (2^-127 is subnormal): ldexpf(1, k) */
__device__ __forceinline__ float gen_pow2(int k) {
    return k >= -126 ? __uint_as_float((unsigned)(k + 127) << 23) : __uint_as_float(0x00400000u);
}

/* kern_f32_to_f16 / kern_f16_to_f32 (kernels/cpu/ops.c), step for step */
__device__ __forceinline__ uint16_t gen_f32_to_f16(float f) {
    const uint32_t u = __float_as_uint(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const int32_t exp = (int32_t)((u >> 23) & 0xff) - 127 + 15;
    uint32_t man = u & 0x7fffffu;
    if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00u | (man ? 0x200u : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00u);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000u;
        const uint32_t shift = (uint32_t)(14 - exp), half = 1u << (shift - 1);
        uint32_t r = man >> shift;
        const uint32_t rem = man & ((1u << shift) - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = (uint32_t)exp << 10 | (man >> 13);
    const uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return (uint16_t)(sign | r);
}

__device__ __forceinline__ float gen_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    return __uint_as_float(u);
}

/* One thread per block of 32 values (elements b*32 .. b*32+31 of the plain
 * weight, row-major; blocks never straddle rows since cols % 32 == 0):
 * mxfp4_block / q8_0_block of kernels/cpu/quantize.c on kern_gen_normal's
 * values. MXFP4 writes the block's 16 code bytes as one 16-byte store when
 * the codes are 16-byte aligned. */
__global__ void gen_quant_kernel(unsigned char *codes, unsigned char *scales, int q8, int aligned,
                                 size_t n_blocks, uint64_t key, float sd) {
    for (size_t b = blockIdx.x * (size_t)blockDim.x + threadIdx.x; b < n_blocks;
         b += (size_t)gridDim.x * blockDim.x) {
        float x[32];
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            x[i] = gen_normal(key, b * 32 + (size_t)i, sd);
            amax = fmaxf(amax, fabsf(x[i]));
        }
        if (!q8) {
            int e = -127;
            if (amax > 0.0f && isfinite(amax)) {
                e = gen_floor_log2(amax) - 2;
                if (e < -127) e = -127;
                if (e > 127) e = 127;
            }
            scales[b] = (unsigned char)(e + 127);
            const float inv = gen_pow2(-e);
            uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
            for (int i = 0; i < 32; i++)
                w[i / 8] |= gen_e2m1_code(__fmul_rn(x[i], inv)) << (4 * (i % 8));
            unsigned char *dst = codes + b * 16;
            if (aligned) {
                *reinterpret_cast<uint4 *>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
            } else {
                for (int k = 0; k < 16; k++) dst[k] = (unsigned char)(w[k / 4] >> (8 * (k % 4)));
            }
        } else {
            const uint16_t h = gen_f32_to_f16(amax > 0.0f ? __fdiv_rn(amax, 127.0f) : 1.0f);
            scales[2 * b] = (unsigned char)(h & 0xffu);
            scales[2 * b + 1] = (unsigned char)(h >> 8);
            const float s = gen_f16_to_f32(h);
            unsigned char *dst = codes + b * 32;
#pragma unroll
            for (int i = 0; i < 32; i++) {
                float q = rintf(__fdiv_rn(x[i], s));
                q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
                /* a NaN (0 / 0 under a zero f16 scale) is 0, as x86's
                 * conversion leaves the low byte */
                dst[i] = (unsigned char)(signed char)(q == q ? (int)q : 0);
            }
        }
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

extern "C" kds_status kern_cuda_gen_quant(void *codes, void *scales, kern_dtype dt, int64_t rows,
                                          int64_t cols, uint64_t key, float sd, void *stream,
                                          kds_err *err) {
    if (dt != KERN_MXFP4 && dt != KERN_Q8_0)
        return kern_cuda__err(err, KDS_INVALID_ARG, "gen_quant: dtype %d (need MXFP4 or Q8_0)",
                              (int)dt);
    if (rows < 0 || cols < 0 || cols % 32)
        return kern_cuda__err(err, KDS_INVALID_ARG,
                              "gen_quant: [%lld, %lld] (cols a multiple of 32)", (long long)rows,
                              (long long)cols);
    const size_t n_blocks = (size_t)rows * (size_t)(cols / 32);
    if (n_blocks == 0) return KDS_OK;
    if (!codes || !scales) return kern_cuda__err(err, KDS_INVALID_ARG, "gen_quant: NULL device pointer");
    const int threads = 128;
    const size_t want = (n_blocks + threads - 1) / threads;
    const unsigned blocks = (unsigned)(want < 65536 ? want : 65536);
    const int aligned = ((uintptr_t)codes & 15u) == 0;
    gen_quant_kernel<<<blocks, threads, 0, kern_cuda__stream(stream)>>>(static_cast<unsigned char *>(codes), static_cast<unsigned char *>(scales), dt == KERN_Q8_0, aligned, n_blocks, key, sd);
    return kern_cuda__status(cudaGetLastError(), err, "gen_quant launch");
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

/* grid (pieces of a row, rows), 16-byte words: a piece of kScatterWords per
 * CTA, so that one 640 KiB row of logits (a decode step of one sequence) is
 * copied by 40 CTAs, not walked by one (~65 µs on an H200) */
constexpr int kScatterThreads = 256;
constexpr size_t kScatterWords = 4 * kScatterThreads;

__global__ void rows_scatter_kernel(const uint4 *src, size_t words, const int32_t *idx, uint4 *dst) {
    const int r = blockIdx.y;
    const int32_t to = idx[r];
    if (to < 0) return;
    const uint4 *s = src + (size_t)r * words;
    uint4 *d = dst + (size_t)to * words;
    const size_t end = min(words, (blockIdx.x + 1) * kScatterWords);
#pragma unroll 4
    for (size_t w = blockIdx.x * kScatterWords + threadIdx.x; w < end; w += kScatterThreads) d[w] = s[w];
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
    const size_t words = row_bytes / 16, pieces = (words + kScatterWords - 1) / kScatterWords;
    if (n > 65535 || pieces > 0x7fffffffu)
        return kern_cuda__err(err, KDS_UNSUPPORTED, "rows scatter: %d rows of %zu bytes", n, row_bytes);
    const dim3 grid((unsigned)pieces, (unsigned)n);
    rows_scatter_kernel<<<grid, kScatterThreads, 0, kern_cuda__stream(stream)>>>(static_cast<const uint4 *>(src), words, idx, static_cast<uint4 *>(dst));
    return kern_cuda__status(cudaGetLastError(), err, "rows scatter launch");
}
