/*
 * cublas_v2.h (emulation) - a CPU stand-in for the few cuBLAS calls that
 * kernels/cuda/kern_cuda_gemm.cu makes, so that its calling convention
 * (transposes, leading dimensions, alpha/beta, data and compute types, math
 * mode, stream and workspace binding) runs under the emulation and the CUDA
 * tests compare its results with the CPU reference. Header-only (one .cu
 * includes it). Semantics follow the cuBLAS documentation:
 *   - column-major C [m, n] = alpha op(A) op(B) + beta C, op(A) [m, k];
 *     beta == 0 means C is not read (it may hold NaNs);
 *   - argument checks as cuBLAS's: m, n, k >= 0, lda >= max(1, rows of A as
 *     stored), ldb likewise, ldc >= max(1, m), a handle, supported types;
 *     failures return CUBLAS_STATUS_INVALID_VALUE / NOT_SUPPORTED and touch
 *     nothing;
 *   - types: A and B both CUDA_R_16BF or both CUDA_R_32F, C CUDA_R_32F,
 *     compute CUBLAS_COMPUTE_32F (what the kernels use); products are summed
 *     in double here (cuBLAS sums in fp32: the tests' tolerances cover both);
 *   - fp32 inputs under CUBLAS_TF32_TENSOR_OP_MATH are rounded to TF32 (10
 *     mantissa bits), so a product that should stay fp32 but runs with TF32
 *     on fails the 1e-5 tests.
 */
#ifndef KDS_EMU_CUBLAS_V2_H
#define KDS_EMU_CUBLAS_V2_H

#include "cuda_runtime.h"

typedef enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_ARCH_MISMATCH = 8,
    CUBLAS_STATUS_MAPPING_ERROR = 11,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_INTERNAL_ERROR = 14,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
} cublasStatus_t;

typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 } cublasOperation_t;
typedef enum {
    CUBLAS_DEFAULT_MATH = 0,
    CUBLAS_TENSOR_OP_MATH = 1,
    CUBLAS_PEDANTIC_MATH = 2,
    CUBLAS_TF32_TENSOR_OP_MATH = 3,
} cublasMath_t;
typedef enum { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_FAST_TF32 = 77 } cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_16BF = 14 } cudaDataType;

struct emu_cublas {
    cudaStream_t stream;
    void *ws;
    size_t ws_bytes;
    cublasMath_t math;
};
typedef struct emu_cublas *cublasHandle_t;

static inline cublasStatus_t cublasCreate(cublasHandle_t *h) {
    if (!h) return CUBLAS_STATUS_INVALID_VALUE;
    *h = new emu_cublas{nullptr, nullptr, 0, CUBLAS_DEFAULT_MATH};
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasDestroy(cublasHandle_t h) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
/* As cuBLAS: setting the stream resets the workspace to the library's own. */
static inline cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->stream = s;
    h->ws = nullptr;
    h->ws_bytes = 0;
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void *ws, size_t bytes) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (bytes && (!ws || ((uintptr_t)ws & 255u))) return CUBLAS_STATUS_INVALID_VALUE;
    h->ws = ws;
    h->ws_bytes = bytes;
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t m) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->math = m;
    return CUBLAS_STATUS_SUCCESS;
}
static inline const char *cublasGetStatusString(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_UNKNOWN (emulation)";
    }
}

static inline double emu_cublas_elem(const void *p, cudaDataType t, size_t i, bool tf32) {
    if (t == CUDA_R_16BF) return __uint_as_float((unsigned)static_cast<const uint16_t *>(p)[i] << 16);
    float v = static_cast<const float *>(p)[i];
    if (tf32) { /* round to nearest, 10 mantissa bits */
        unsigned u = __float_as_uint(v);
        u = (u + 0xfffu + ((u >> 13) & 1u)) & ~0x1fffu;
        v = __uint_as_float(u);
    }
    return v;
}

static inline cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                          int n, int k, const void *alpha, const void *A, cudaDataType at,
                                          int lda, const void *B, cudaDataType bt, int ldb, const void *beta,
                                          void *C, cudaDataType ct, int ldc, cublasComputeType_t comp,
                                          cublasGemmAlgo_t algo) {
    (void)algo;
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if ((ta != CUBLAS_OP_N && ta != CUBLAS_OP_T) || (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (m < 0 || n < 0 || k < 0 || !alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
    const int a_rows = ta == CUBLAS_OP_N ? m : k, b_rows = tb == CUBLAS_OP_N ? k : n;
    if (lda < (a_rows > 1 ? a_rows : 1) || ldb < (b_rows > 1 ? b_rows : 1) || ldc < (m > 1 ? m : 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (at != bt || (at != CUDA_R_16BF && at != CUDA_R_32F) || ct != CUDA_R_32F)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (comp != CUBLAS_COMPUTE_32F && comp != CUBLAS_COMPUTE_32F_FAST_TF32) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    if ((k > 0 && (!A || !B)) || !C) return CUBLAS_STATUS_INVALID_VALUE;
    const bool tf32 = at == CUDA_R_32F && (h->math == CUBLAS_TF32_TENSOR_OP_MATH || comp == CUBLAS_COMPUTE_32F_FAST_TF32);
    /* host scalars are read at the call (pointer mode host), the product
     * runs on the handle's stream: now, or when a captured graph replays */
    const float al = *static_cast<const float *>(alpha), be = *static_cast<const float *>(beta);
    float *c = static_cast<float *>(C);
    emu::enqueue(h->stream, [=]() {
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                double s = 0.0;
                for (int l = 0; l < k; l++) {
                    const size_t ai = ta == CUBLAS_OP_N ? (size_t)l * lda + i : (size_t)i * lda + l;
                    const size_t bi = tb == CUBLAS_OP_N ? (size_t)j * ldb + l : (size_t)l * ldb + j;
                    s += emu_cublas_elem(A, at, ai, tf32) * emu_cublas_elem(B, bt, bi, tf32);
                }
                float *d = &c[(size_t)j * ldc + i];
                *d = be == 0.0f ? (float)(al * s) : (float)(al * s + (double)be * *d);
            }
    }, "cublasGemmEx");
    return CUBLAS_STATUS_SUCCESS;
}

#endif
