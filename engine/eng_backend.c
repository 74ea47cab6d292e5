/*
 * eng_backend.c - the backends this build has (eng_backend.h): the CPU
 * always, CUDA when nvcc was found (engine/eng_cuda.c is built only then).
 */
#include "eng_backend.h"

const eng_backend_ops *eng__backend_ops(eng_device d) {
    switch (d) {
    case ENG_DEVICE_CPU: return &eng__cpu_ops;
    case ENG_DEVICE_CUDA:
#ifdef KDS_HAVE_CUDA
        return &eng__cuda_ops;
#else
        return NULL;
#endif
    }
    return NULL;
}
