/*
 * kern_cuda_impl.cuh - host-side internals shared by the .cu files of
 * kernels/cuda/: the C headers with C linkage, the CUDA-error-to-kds_status
 * helper and the cross-file (kern_cuda__) declarations.
 *
 * Host code only; the device code lives in kda_kernels.cuh.
 */
#ifndef KERN_CUDA_IMPL_CUH
#define KERN_CUDA_IMPL_CUH

#include <stdarg.h>
#include <stdio.h>

#include <cuda_runtime.h>

#include "kern_cuda.h" /* pulls kds_status.h and kern.h with C linkage */

/* kds_err_set without linking kds_status.c: this library stays free of
 * link-time dependencies on kds_kernels (which itself links this one). */
static inline kds_status kern_cuda__err(kds_err *err, kds_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static inline kds_status kern_cuda__err(kds_err *err, kds_status s, const char *fmt, ...) {
    if (!err) return s;
    err->status = s;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return s;
}

/* Map a CUDA runtime error to a kds_status, filling `err` with
 * "<what>: <cudaGetErrorString> (<cudaGetErrorName>)". cudaSuccess -> KDS_OK
 * (err untouched). Out-of-memory maps to KDS_NOMEM, everything else to
 * KDS_CUDA. */
static inline kds_status kern_cuda__status(cudaError_t e, kds_err *err, const char *what) {
    if (e == cudaSuccess) return KDS_OK;
    kds_status s = e == cudaErrorMemoryAllocation ? KDS_NOMEM : KDS_CUDA;
    return kern_cuda__err(err, s, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

/* The opaque stream handle of kern_cuda.h. */
static inline cudaStream_t kern_cuda__stream(void *stream) {
    return (cudaStream_t)stream;
}

/* cudaFuncGetAttributes on one decode kernel instantiation: fails with
 * cudaErrorNoKernelImageForDevice (or similar) when this build has no image
 * the current device can run. Defined in kern_cuda_kda.cu. */
cudaError_t kern_cuda__probe_kernels(void);

/* The 16 x 16 shared-memory tiled product (kern_cuda_model.cu): the
 * fallback of kern_cuda_matmul for T > 8 without a GEMM context. Arguments
 * already checked, T >= 1, rows >= 1. */
kds_status kern_cuda__matmul_tiled(const kern_cuda_matmul_args *a, cudaStream_t st, kds_err *err);

#endif /* KERN_CUDA_IMPL_CUH */
