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
