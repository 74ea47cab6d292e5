/*
 * kern_cuda_dev.cuh - small device-side helpers shared by the .cu files of
 * kernels/cuda/: those the CPU emulation (emu/) must be able to replace,
 * and block-wide collectives more than one kernel uses.
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

/* Exclusive prefix sum of one int per thread over a block of NT threads
 * (NT a multiple of 32, at most 1024); *total gets the block's sum.
 * s: NT / 32 + 1 ints of shared scratch. Contains barriers: every thread
 * of the block calls it. */
template <int NT>
__device__ __forceinline__ int block_exclusive_scan(int x, int *s, int *total) {
    static_assert(NT % 32 == 0 && NT <= 1024, "block_exclusive_scan: whole warps, at most 32 of them");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) s[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = lane < NT / 32 ? s[lane] : 0;
        int wi = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, wi, o);
            if (lane >= o) wi += y;
        }
        if (lane < NT / 32) s[lane] = wi - w; /* exclusive warp offsets */
        if (lane == 31) s[NT / 32] = wi;
    }
    __syncthreads();
    const int r = s[warp] + incl - x;
    *total = s[NT / 32];
    __syncthreads(); /* s reusable */
    return r;
}

#endif /* KERN_CUDA_DEV_CUH */
