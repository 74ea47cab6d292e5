/*
 * kern_cuda_runtime.cu - device discovery, memory and stream helpers of
 * kern_cuda.h: thin wrappers over the CUDA runtime that turn its errors into
 * kds_status + a message.
 */
#include "kern_cuda_impl.cuh"

extern "C" bool kern_cuda_available(kds_err *err) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        /* No driver, driver too old, no device: not sticky, but clear it so
         * a later unrelated cudaGetLastError does not report it. */
        (void)cudaGetLastError();
        kern_cuda__status(e, err, "CUDA runtime");
        return false;
    }
    if (count < 1) {
        kern_cuda__err(err, KDS_CUDA, "no CUDA device found");
        return false;
    }
    int dev = 0, major = 0, minor = 0;
    e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        kern_cuda__status(e, err, "querying the CUDA device");
        return false;
    }
    if (major < 8) {
        kern_cuda__err(err, KDS_UNSUPPORTED,
                       "CUDA device %d is sm_%d%d; kdaserve's kernels need sm_80 or newer", dev,
                       major, minor);
        return false;
    }
    /* Create the primary context (fails on a busy/exclusive or broken device). */
    e = cudaFree(0);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        kern_cuda__status(e, err, "initialising the CUDA device");
        return false;
    }
    /* Does this build carry an image (SASS or PTX) the device can run? */
    e = kern_cuda__probe_kernels();
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        char what[96];
        snprintf(what, sizeof what, "kernels for sm_%d%d (built for 90a and 80)", major, minor);
        kern_cuda__status(e, err, what);
        return false;
    }
    if (err) {
        err->status = KDS_OK;
        err->msg[0] = '\0';
    }
    return true;
}

extern "C" kds_status kern_cuda_malloc(void **dptr, size_t bytes, kds_err *err) {
    if (!dptr) return kern_cuda__err(err, KDS_INVALID_ARG, "cuda malloc: NULL result pointer");
    *dptr = NULL;
    if (bytes == 0) return KDS_OK;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* out-of-memory is not sticky: clear it */
        char what[64];
        snprintf(what, sizeof what, "cuda malloc of %zu bytes", bytes);
        return kern_cuda__status(e, err, what);
    }
    *dptr = p;
    return KDS_OK;
}

extern "C" void kern_cuda_free(void *dptr) {
    if (dptr) (void)cudaFree(dptr);
}

static kds_status copy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                       void *stream, kds_err *err, const char *what) {
    if (bytes == 0) return KDS_OK;
    if (!dst || !src) return kern_cuda__err(err, KDS_INVALID_ARG, "%s: NULL pointer", what);
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, kern_cuda__stream(stream));
    return kern_cuda__status(e, err, what);
}

extern "C" kds_status kern_cuda_memcpy_h2d(void *dst_dev, const void *src_host, size_t bytes,
                                          void *stream, kds_err *err) {
    return copy(dst_dev, src_host, bytes, cudaMemcpyHostToDevice, stream, err, "cuda memcpy h2d");
}

extern "C" kds_status kern_cuda_memcpy_d2h(void *dst_host, const void *src_dev, size_t bytes,
                                          void *stream, kds_err *err) {
    return copy(dst_host, src_dev, bytes, cudaMemcpyDeviceToHost, stream, err, "cuda memcpy d2h");
}

extern "C" kds_status kern_cuda_memcpy_d2d(void *dst_dev, const void *src_dev, size_t bytes,
                                          void *stream, kds_err *err) {
    return copy(dst_dev, src_dev, bytes, cudaMemcpyDeviceToDevice, stream, err, "cuda memcpy d2d");
}

extern "C" kds_status kern_cuda_memset(void *dst_dev, int byte, size_t bytes, void *stream,
                                       kds_err *err) {
    if (bytes == 0) return KDS_OK;
    if (!dst_dev) return kern_cuda__err(err, KDS_INVALID_ARG, "cuda memset: NULL pointer");
    cudaError_t e = cudaMemsetAsync(dst_dev, byte, bytes, kern_cuda__stream(stream));
    return kern_cuda__status(e, err, "cuda memset");
}

extern "C" kds_status kern_cuda_sync(void *stream, kds_err *err) {
    cudaError_t e = stream ? cudaStreamSynchronize(kern_cuda__stream(stream)) : cudaDeviceSynchronize();
    return kern_cuda__status(e, err, "cuda sync");
}

extern "C" kds_status kern_cuda_stream_create(void **stream, kds_err *err) {
    /* non-blocking: no implicit ordering with the legacy default stream, which
     * a graph capture on this stream must never depend on */
    cudaStream_t s = nullptr;
    cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    *stream = e == cudaSuccess ? (void *)s : nullptr;
    return kern_cuda__status(e, err, "cuda stream create");
}

extern "C" void kern_cuda_stream_free(void *stream) {
    if (stream) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

extern "C" kds_status kern_cuda_graph_begin(void *stream, kds_err *err) {
    cudaError_t e = cudaStreamBeginCapture(kern_cuda__stream(stream), cudaStreamCaptureModeRelaxed);
    if (e == cudaErrorNotSupported) {
        (void)cudaGetLastError();
        return kern_cuda__err(err, KDS_UNSUPPORTED, "cuda graphs: capture not supported here");
    }
    return kern_cuda__status(e, err, "cuda graph capture begin");
}

extern "C" kds_status kern_cuda_graph_end(void *stream, void **exec, kds_err *err) {
    *exec = nullptr;
    cudaGraph_t graph = nullptr;
    cudaError_t e = cudaStreamEndCapture(kern_cuda__stream(stream), &graph);
    if (e != cudaSuccess) {
        if (graph) cudaGraphDestroy(graph);
        return kern_cuda__status(e, err, "cuda graph capture end");
    }
    cudaGraphExec_t ge = nullptr;
    e = cudaGraphInstantiate(&ge, graph, 0);
    cudaGraphDestroy(graph);
    if (e != cudaSuccess) return kern_cuda__status(e, err, "cuda graph instantiate");
    *exec = (void *)ge;
    return KDS_OK;
}

extern "C" kds_status kern_cuda_graph_launch(void *exec, void *stream, kds_err *err) {
    return kern_cuda__status(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec),
                                             kern_cuda__stream(stream)),
                             err, "cuda graph launch");
}

extern "C" void kern_cuda_graph_free(void *exec) {
    if (exec) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec));
}
