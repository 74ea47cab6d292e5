/*
 * kern_cuda_dev.cuh - small device-side helpers shared by the .cu files of
 * kernels/cuda/ that the CPU emulation (emu/) must be able to replace.
 */
#ifndef KERN_CUDA_DEV_CUH
#define KERN_CUDA_DEV_CUH

#include <cuda_runtime.h> /* (or the emulation's, which defines KDS_EMU) */
#ifndef KDS_EMU
#include <cuda_bf16.h>
#include <mma.h>
#endif

/* Dynamic shared memory of a kernel as `unsigned char name[]`, 128-byte
 * aligned (WMMA tiles need 32). The emulation has no `extern __shared__`,
 * hence the macro. */
#ifdef KDS_EMU
#define KDS_DYN_SMEM(name) unsigned char *name = emu::dyn_smem()
#else
#define KDS_DYN_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif

#endif /* KERN_CUDA_DEV_CUH */
