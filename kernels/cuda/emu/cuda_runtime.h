/*
 * cuda_runtime.h (emulation) - a stand-in for the CUDA runtime and device
 * built-ins that lets the kernels/cuda .cu files compile with a host C++ compiler and
 * run on the CPU, one coroutine per GPU thread. Development aid only: it
 * checks the logic of the kernels (indexing, barriers, shuffles, reductions,
 * shared-memory use) on machines without a GPU, not their speed and not the
 * GPU memory model. See README.md beside it.
 *
 * What is emulated:
 *   - launches (the build script rewrites `k<<<g, b, s, st>>>(args)` into
 *     emu_launch(...)), blocks run one after the other, the threads of a
 *     block as cooperative coroutines;
 *   - __syncthreads (+ _count/_or/_and), __syncwarp, warp shuffles, ballot,
 *     any/all, match_any: barriers over the participating threads, checked
 *     (a barrier that not all threads reach aborts with a message);
 *   - __shared__ variables (static storage: blocks never run concurrently),
 *     dynamic shared memory through KDS_EXTERN_SMEM (kda_kernels.cuh);
 *   - atomics (trivially: coroutines never interleave inside one);
 *   - nvcuda::wmma fragments for bf16 x bf16 -> fp32, 16x16x16: every thread
 *     holds the whole tile (the element layout of a real fragment is
 *     unspecified, so kernels must not index fragment elements);
 *   - cudaMalloc & co on host memory, streams and events as no-ops.
 */
#ifndef KDS_EMU_CUDA_RUNTIME_H
#define KDS_EMU_CUDA_RUNTIME_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <functional>
#include <type_traits>

#define KDS_EMU 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __shared__ static
#define __constant__ static
#define __restrict__ __restrict
#define __grid_constant__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __CUDA_ARCH__ 900

/* ---- vector types -------------------------------------------------------- */

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
typedef dim3 uint3;

struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) float2 { float x, y; };
struct __attribute__((aligned(16))) uint4 { unsigned x, y, z, w; };
struct __attribute__((aligned(8))) uint2 { unsigned x, y; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
struct __attribute__((aligned(8))) int2 { int x, y; };
struct __attribute__((aligned(16))) double2 { double x, y; };

static inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
static inline float2 make_float2(float a, float b) { return float2{a, b}; }
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) {
    return uint4{a, b, c, d};
}
static inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }
static inline int2 make_int2(int a, int b) { return int2{a, b}; }

/* ---- the emulator's thread context --------------------------------------- */

namespace emu {
struct thread_ctx {
    dim3 tid, bid, bdim, gdim;
};
extern thread_local thread_ctx *cur; /* the coroutine now running */
void block_barrier(int op, int pred, int *result);
uint64_t warp_collective(int op, unsigned mask, uint64_t val, int param, int width);
unsigned char *dyn_smem(void);
void launch(dim3 grid, dim3 block, size_t smem, std::function<void()> body, const char *name);
[[noreturn]] void fail(const char *fmt, ...);
enum { OP_SHFL = 1, OP_SHFL_XOR, OP_SHFL_DOWN, OP_SHFL_UP, OP_BALLOT, OP_MATCH_ANY, OP_SYNCWARP };
enum { BOP_SYNC = 0, BOP_COUNT, BOP_OR, BOP_AND };
} // namespace emu

#define threadIdx (emu::cur->tid)
#define blockIdx (emu::cur->bid)
#define blockDim (emu::cur->bdim)
#define gridDim (emu::cur->gdim)

static inline void __syncthreads(void) { emu::block_barrier(emu::BOP_SYNC, 0, nullptr); }
static inline int __syncthreads_count(int p) {
    int r;
    emu::block_barrier(emu::BOP_COUNT, p != 0, &r);
    return r;
}
static inline int __syncthreads_or(int p) {
    int r;
    emu::block_barrier(emu::BOP_OR, p != 0, &r);
    return r;
}
static inline int __syncthreads_and(int p) {
    int r;
    emu::block_barrier(emu::BOP_AND, p != 0, &r);
    return r;
}
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
    emu::warp_collective(emu::OP_SYNCWARP, mask, 0, 0, 32);
}
static inline void __threadfence(void) {}
static inline void __threadfence_block(void) {}

template <typename T> static inline uint64_t emu_bits(T v) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof v);
    return b;
}
template <typename T> static inline T emu_from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof v);
    return v;
}
template <typename T> static inline T __shfl_sync(unsigned m, T v, int src, int w = 32) {
    return emu_from_bits<T>(emu::warp_collective(emu::OP_SHFL, m, emu_bits(v), src, w));
}
template <typename T> static inline T __shfl_xor_sync(unsigned m, T v, int x, int w = 32) {
    return emu_from_bits<T>(emu::warp_collective(emu::OP_SHFL_XOR, m, emu_bits(v), x, w));
}
template <typename T> static inline T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32) {
    return emu_from_bits<T>(emu::warp_collective(emu::OP_SHFL_DOWN, m, emu_bits(v), (int)d, w));
}
template <typename T> static inline T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32) {
    return emu_from_bits<T>(emu::warp_collective(emu::OP_SHFL_UP, m, emu_bits(v), (int)d, w));
}
static inline unsigned __ballot_sync(unsigned m, int p) {
    return (unsigned)emu::warp_collective(emu::OP_BALLOT, m, p != 0, 0, 32);
}
static inline int __any_sync(unsigned m, int p) { return __ballot_sync(m, p) != 0; }
static inline int __all_sync(unsigned m, int p) { return (__ballot_sync(m, p) & m) == m; }
template <typename T> static inline unsigned __match_any_sync(unsigned m, T v) {
    return (unsigned)emu::warp_collective(emu::OP_MATCH_ANY, m, emu_bits(v), 0, 32);
}
static inline unsigned __activemask(void) { return 0xffffffffu; }

/* ---- bit and math intrinsics --------------------------------------------- */

static inline float __uint_as_float(unsigned u) { return emu_from_bits<float>(u); }
static inline unsigned __float_as_uint(float f) { return (unsigned)emu_bits(f); }
static inline int __float_as_int(float f) { return (int)(unsigned)emu_bits(f); }
static inline float __int_as_float(int i) { return emu_from_bits<float>((unsigned)i); }
static inline double __longlong_as_double(long long i) { return emu_from_bits<double>((uint64_t)i); }
static inline long long __double_as_longlong(double d) { return (long long)emu_bits(d); }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; i++) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __double2float_rn(double d) { return (float)d; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
template <typename T> static inline T min(T a, T b) { return a < b ? a : b; }
template <typename T> static inline T max(T a, T b) { return a > b ? a : b; }

/* Cache-hinted loads and stores: plain accesses here. */
template <typename T> static inline T __ldcs(const T *p) { return *p; }
template <typename T> static inline T __ldg(const T *p) { return *p; }
template <typename T> static inline T __ldcg(const T *p) { return *p; }
template <typename T> static inline T __ldlu(const T *p) { return *p; }
template <typename T> static inline void __stcs(T *p, T v) { *p = v; }
template <typename T> static inline void __stcg(T *p, T v) { *p = v; }

/* ---- atomics (coroutines never interleave inside one) --------------------- */

template <typename T> static inline T atomicAdd(T *p, T v) {
    T o = *p;
    *p = o + v;
    return o;
}
template <typename T> static inline T atomicMax(T *p, T v) {
    T o = *p;
    if (v > o) *p = v;
    return o;
}
template <typename T> static inline T atomicMin(T *p, T v) {
    T o = *p;
    if (v < o) *p = v;
    return o;
}
template <typename T> static inline T atomicExch(T *p, T v) {
    T o = *p;
    *p = v;
    return o;
}
template <typename T> static inline T atomicOr(T *p, T v) {
    T o = *p;
    *p = o | v;
    return o;
}
template <typename T> static inline T atomicCAS(T *p, T cmp, T v) {
    T o = *p;
    if (o == cmp) *p = v;
    return o;
}

/* ---- bf16 (cuda_bf16.h subset) --------------------------------------------- */

struct __nv_bfloat16 {
    unsigned short x;
};
static inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float((unsigned)h.x << 16); }
static inline __nv_bfloat16 __float2bfloat16(float f) { /* round to nearest even */
    unsigned u = __float_as_uint(f);
    __nv_bfloat16 h;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        h.x = (unsigned short)((u >> 16) | 0x40u);
        return h;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    h.x = (unsigned short)(u >> 16);
    return h;
}
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }

/* ---- wmma (mma.h subset): bf16 x bf16 -> fp32, m16n16k16 ------------------ */

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
namespace precision {}

template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment;
/* Each thread holds the whole tile; num_elements is the real per-thread count
 * so that loops over x[] (element-wise ops that need no layout) still work. */
template <typename Layout> struct fragment<matrix_a, 16, 16, 16, __nv_bfloat16, Layout> {
    static constexpr int num_elements = 8;
    float t[16][16]; /* [row][k] */
};
template <typename Layout> struct fragment<matrix_b, 16, 16, 16, __nv_bfloat16, Layout> {
    static constexpr int num_elements = 8;
    float t[16][16]; /* [k][col] */
};
template <> struct fragment<accumulator, 16, 16, 16, float, void> {
    static constexpr int num_elements = 8;
    float t[16][16];
};

template <typename L> static inline void load_matrix_sync(fragment<matrix_a, 16, 16, 16, __nv_bfloat16, L> &f,
                                                          const __nv_bfloat16 *p, unsigned ld) {
    __syncwarp();
    const bool row = std::is_same<L, row_major>::value;
    for (int i = 0; i < 16; i++)
        for (int k = 0; k < 16; k++)
            f.t[i][k] = __bfloat162float(row ? p[i * ld + k] : p[k * ld + i]);
    __syncwarp();
}
template <typename L> static inline void load_matrix_sync(fragment<matrix_b, 16, 16, 16, __nv_bfloat16, L> &f,
                                                          const __nv_bfloat16 *p, unsigned ld) {
    __syncwarp();
    const bool row = std::is_same<L, row_major>::value;
    for (int k = 0; k < 16; k++)
        for (int j = 0; j < 16; j++)
            f.t[k][j] = __bfloat162float(row ? p[k * ld + j] : p[j * ld + k]);
    __syncwarp();
}
static inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float, void> &f, const float *p,
                                    unsigned ld, layout_t l) {
    __syncwarp();
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) f.t[i][j] = l == mem_row_major ? p[i * ld + j] : p[j * ld + i];
    __syncwarp();
}
static inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float, void> &f,
                                     unsigned ld, layout_t l) {
    __syncwarp();
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) {
            float *d = l == mem_row_major ? &p[i * ld + j] : &p[j * ld + i];
            *d = f.t[i][j];
        }
    __syncwarp();
}
static inline void fill_fragment(fragment<accumulator, 16, 16, 16, float, void> &f, float v) {
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) f.t[i][j] = v;
}
template <typename LA, typename LB>
static inline void mma_sync(fragment<accumulator, 16, 16, 16, float, void> &d,
                            const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA> &a,
                            const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB> &b,
                            const fragment<accumulator, 16, 16, 16, float, void> &c) {
    float r[16][16];
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) {
            float s = c.t[i][j];
            for (int k = 0; k < 16; k++) s = fmaf(a.t[i][k], b.t[k][j], s);
            r[i][j] = s;
        }
    memcpy(d.t, r, sizeof r);
}
} // namespace wmma
} // namespace nvcuda

/* ---- runtime API -------------------------------------------------------- */

typedef int cudaError_t;
enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorNotSupported = 801,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorNoDevice = 100,
    cudaErrorNoKernelImageForDevice = 209,
};
typedef struct emu_stream *cudaStream_t;
typedef struct emu_event *cudaEvent_t;
/* CUDA graphs (emu.cpp): while a stream is captured, the kernels, async
 * copies and memsets queued on it (and cuBLAS calls bound to it) are
 * recorded with their arguments as they were at launch, and a graph
 * launch replays them in order, so code that would bake a stale host
 * value into a graph fails its tests here too. Synchronous calls during a
 * capture invalidate it, as CUDA does. */
typedef struct emu_graph *cudaGraph_t;
typedef struct emu_graph_exec *cudaGraphExec_t;
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal,
                             cudaStreamCaptureModeRelaxed };
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s);
cudaError_t cudaGraphDestroy(cudaGraph_t g);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e);
enum cudaMemcpyKind {
    cudaMemcpyHostToDevice,
    cudaMemcpyDeviceToHost,
    cudaMemcpyDeviceToDevice,
    cudaMemcpyDefault
};
enum cudaDeviceAttr {
    cudaDevAttrComputeCapabilityMajor,
    cudaDevAttrComputeCapabilityMinor,
    cudaDevAttrMultiProcessorCount,
    cudaDevAttrMaxSharedMemoryPerBlockOptin,
    cudaDevAttrL2CacheSize,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
struct cudaFuncAttributes {
    int numRegs, maxThreadsPerBlock;
    size_t sharedSizeBytes, localSizeBytes;
};
struct cudaDeviceProp {
    char name[256];
    int major, minor, multiProcessorCount, l2CacheSize;
    size_t sharedMemPerBlockOptin, totalGlobalMem;
};
#define cudaStreamNonBlocking 1
#define cudaEventDefault 0

cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaGetDevice(int *d);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int dev);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev);
cudaError_t cudaMalloc(void **p, size_t n);
template <typename T> static inline cudaError_t cudaMalloc(T **p, size_t n) {
    return cudaMalloc((void **)p, n);
}
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind k, cudaStream_t st = 0);
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind k);
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st = 0);
cudaError_t cudaMemset(void *d, int v, size_t n);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);
cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = 0);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b);
cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaRuntimeGetVersion(int *v);
cudaError_t cudaDriverGetVersion(int *v);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaFuncGetAttributes_(cudaFuncAttributes *a);
template <typename F> static inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *a, F) {
    return cudaFuncGetAttributes_(a);
}
template <typename F> static inline cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) {
    return cudaSuccess;
}

/* The build script rewrites every `kernel<<<g, b, s, st>>>(args);` into
 * EMU_LAUNCH(g, b, s, st, kernel, args). */
namespace emu {
/* Run `op` now, or record it when `s` is being captured into a graph. */
void enqueue(cudaStream_t s, std::function<void()> op, const char *what = "a copy");
static inline cudaStream_t stream_of(cudaStream_t s) { return s; }
static inline cudaStream_t stream_of(long) { return nullptr; }
/* A kernel launch: the arguments are copied now, as a GPU launch copies
 * them, and the grid runs now or at the graph's replay. */
template <class K, class... A>
void launch_k(dim3 g, dim3 b, size_t smem, cudaStream_t st, const char *name, K k, A... a) {
    enqueue(st, [=]() { launch(g, b, smem, [=]() { k(a...); }, name); }, name);
}
} // namespace emu

#define EMU_LAUNCH(g, b, s, st, k, ...)                                                        \
    emu::launch_k(dim3(g), dim3(b), (size_t)(s), emu::stream_of(st), #k, k, ##__VA_ARGS__)

#endif
