/*
 * kern_cuda_gemm.cu - the matrix products of the whole-model GPU pass
 * (contracts in kern_cuda.h, design and expected speed in README.md):
 *
 *   kern_cuda_matmul     T <= 8: gemv_kernel, a bandwidth-bound GEMV that
 *                        streams each weight byte once for all T rows;
 *                        T > 8 with a context: cuBLAS GemmEx on tensor cores
 *                        (bf16 x bf16 -> fp32; x split hi + lo in EXACT mode)
 *                        or in fp32 for f32 weights; otherwise the tiled
 *                        fallback of kern_cuda_model.cu.
 *   kern_cuda_gemm_ctx   the cuBLAS handle, its workspace, the bf16 scratch.
 *   kern_cuda_moe_experts  the routed experts grouped by exp_off, read on the
 *                        device: moe_gemv_kernel (chunks of <= 8 rows per
 *                        expert, CUDA cores; moe_gemv_fp4_kernel for MXFP4
 *                        codes, dequantised in registers) or moe_tc_kernel
 *                        (WMMA tiles of 64 x 64, bf16 operands, fp32
 *                        accumulation; MXFP4 dequantised to bf16 on the way
 *                        into shared memory), both with a device-side tile
 *                        schedule (find_tile); the fused gate/up form ends
 *                        in SwiGLU or K3's SiTU.
 *
 * CPU reference: kern_matmul / kern_matmul_w (MXFP4), and kern_swiglu or
 * kern_situ for the fused gate/up form.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include <cublas_v2.h>

#include "kern_cuda_dev.cuh"
#include "kern_cuda_impl.cuh"

#ifndef KDS_EMU_CUBLAS_V2_H
#include <dlfcn.h>
#endif

/* cuBLAS's recommended workspace for Hopper (cuBLAS docs, cublasSetWorkspace). */
#define KDS_CUBLAS_WORKSPACE ((size_t)32 << 20)

/* The cuBLAS entry points used here. cuBLAS is opened with dlopen when the
 * first GEMM context is made rather than linked: its libraries are ~700 MB,
 * and mapping them cost every run of kdaserve, --help and CPU runs
 * included, ~0.3 s and 220 MB resident (issue 16). Under the CPU emulation
 * (kernels/cuda/emu) the stand-ins are called directly. */
struct cublas_api {
    void *lib; /* dlopen handle; NULL under the emulation */
    decltype(&cublasCreate) create;
    decltype(&cublasDestroy) destroy;
    decltype(&cublasSetStream) set_stream;
    decltype(&cublasSetWorkspace) set_workspace;
    decltype(&cublasSetMathMode) set_math_mode;
    decltype(&cublasGetStatusString) status_string;
    /* spelled out: C++ sees cublasGemmEx overloaded (a cudaDataType wrapper) */
    cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int m, int n, int k,
                              const void *alpha, const void *A, cudaDataType, int lda, const void *B,
                              cudaDataType, int ldb, const void *beta, void *C, cudaDataType, int ldc,
                              cublasComputeType_t, cublasGemmAlgo_t);
};

struct kern_cuda_gemm_ctx {
    cublas_api api;
    cublasHandle_t h;
    void *ws;            /* cuBLAS workspace, KDS_CUBLAS_WORKSPACE bytes */
    uint16_t *scratch;   /* [2, max_elems] bf16: x's hi then lo halves */
    size_t max_elems;
    cudaStream_t bound;  /* stream the handle (and workspace) is bound to */
};

namespace {

constexpr unsigned kFull = 0xffffffffu;

/* ---- GEMV geometry (README: "kern_cuda_matmul, T <= 8") -------------------- */
constexpr int kGemvWarps = 4; /* warps per CTA */
constexpr int kGemvRows = 4;  /* weight rows per warp: each x load serves 4 rows */
constexpr int kGemvDepth = 4; /* 16-byte chunks per row and lane in flight: 16 loads */
constexpr int kGemvMaxT = KERN_CUDA_GEMV_MAX_T;

/* ---- WMMA grouped GEMM geometry -------------------------------------------- */
constexpr int kTcM = 64;           /* rows of x (tokens) per tile */
constexpr int kTcN = 64;           /* weight rows per tile */
constexpr int kTcK = 32;           /* columns per k step */
constexpr int kTcLd = kTcK + 8;    /* bf16 smem row stride: 80 B, rows in different banks */
constexpr int kTcOutLd = kTcN + 4; /* fp32 staging row stride */
constexpr int kTcThreads = 128;    /* 4 warps, 2 x 2, each 32 x 32 of the tile */

__host__ __device__ constexpr int ilog2(int n) {
    return n <= 1 ? 0 : 1 + ilog2(n / 2);
}

/* bf16 bits of f, round to nearest even (kern_f32_to_bf16's rule). */
__device__ __forceinline__ unsigned bf16_bits(float f) {
    const unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ float bf16_val(unsigned b) {
    return __uint_as_float(b << 16);
}

/* sigmoid as the CPU's: 1 / (1 + expf(-x)) */
__device__ __forceinline__ float sigm(float x) {
    return 1.0f / (1.0f + expf(-x));
}

/* kern_situ's expression, in its order of operations */
__device__ __forceinline__ float situ1(float g, float u, float beta, float beta_l) {
    const float gate = beta * tanhf(g / beta) * sigm(g);
    return gate * (beta_l * tanhf(u / beta_l));
}

/* 16 bytes of weights, streamed: not kept in L1 (x is, and is reused). */
__device__ __forceinline__ uint4 ld_stream16(const void *p) {
#ifdef KDS_EMU
    return *static_cast<const uint4 *>(p);
#else
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
#endif
}

/* 8 bytes, streamed (the tensor-core MXFP4 tile: 16 codes per thread). */
__device__ __forceinline__ uint2 ld_stream8(const void *p) {
#ifdef KDS_EMU
    return *static_cast<const uint2 *>(p);
#else
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
#endif
}

/* ---- MXFP4 (kern.h: E2M1 codes, E8M0 scales per 32 columns) ------------------ */

/*
 * The 8 E2M1 codes of a 32-bit word (code k in bits 4k..4k+3: bit 3 the
 * sign, bits 0-2 [e1 e0 m]) as fp32 values times 2^-126, exactly: with the
 * sign in bit 31 and [e1 e0 m] in bits 24..22 (the exponent's two low bits
 * and the mantissa's top bit) a code reads 2^(e - 127) (1 + m/2) = value *
 * 2^-126 for e >= 1 and, as a denormal, m * 2^-127 = value * 2^-126 for
 * e = 0. No table; ~2.9 integer operations per code: u (one per r < 4)
 * holds code r + 4 in place (22..24, 31) and code r 16 bits lower (6..8,
 * 15), so code r + 4 is one AND away and code r a shift and an AND (the
 * other bits of u are don't-care).
 */
__device__ __forceinline__ void e2m1x8_tiny(unsigned w, float (&v)[8]) {
    constexpr unsigned kMag = 0x01c001c0u;  /* bits 6..8, 22..24: from a[r] */
    constexpr unsigned kVal = 0x81c00000u;  /* sign and [e1 e0 m] of an fp32 */
    const unsigned a[4] = {w << 6, w << 2, w >> 2, w >> 6};  /* magnitudes of codes r + 4, r */
    const unsigned b[4] = {w << 12, w << 8, w << 4, w};      /* their signs to 31, 15 */
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const unsigned u = (a[r] & kMag) | (b[r] & ~kMag);
        v[r + 4] = __uint_as_float(u & kVal);
        v[r] = __uint_as_float((u << 16) & kVal);
    }
}

/* E8M0 scale 2^(s - 127) as kern_e8m0_to_f32: 255 NaN, 0 the denormal 2^-127. */
__device__ __forceinline__ float e8m0(unsigned s) {
    return __uint_as_float(s == 255u ? 0x7fc00000u : s ? s << 23 : 0x00400000u);
}

/* Powers of two as bit patterns (exact): 2^64 scales x in the MXFP4 GEMV
 * so the products of the 2^-126-scaled codes stay normal; 2^62 and the
 * block's scale undo it; 2^126 undoes the codes' factor in the tile. */
__device__ __forceinline__ float pow2_64() { return __uint_as_float(0x5f800000u); }
__device__ __forceinline__ float pow2_62() { return __uint_as_float(0x5e800000u); }
__device__ __forceinline__ float pow2_126() { return __uint_as_float(0x7e800000u); }

/* Chunk j (16 bytes: 8 bf16 or 4 fp32 elements) of a weight row, as raw
 * bits; VEC = false loads element by element with bounds (any cols). */
template <bool BF16, bool VEC>
__device__ __forceinline__ uint4 fetch_w(const void *row, int j, int cols) {
    if constexpr (VEC) {
        return ld_stream16(static_cast<const char *>(row) + (size_t)j * 16);
    } else {
        unsigned w[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            if (BF16) {
                const uint16_t *p = static_cast<const uint16_t *>(row);
                const int c = j * 8 + 2 * q;
                const unsigned lo = c < cols ? p[c] : 0u, hi = c + 1 < cols ? p[c + 1] : 0u;
                w[q] = lo | hi << 16;
            } else {
                const int c = j * 4 + q;
                w[q] = c < cols ? static_cast<const unsigned *>(row)[c] : 0u;
            }
        }
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
}

template <bool BF16>
__device__ __forceinline__ void unpack(uint4 v, float (&f)[BF16 ? 8 : 4]) {
    if constexpr (BF16) {
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int q = 0; q < 4; q++) {
            f[2 * q] = __uint_as_float(w[q] << 16);
            f[2 * q + 1] = __uint_as_float(w[q] & 0xffff0000u);
        }
    } else {
        f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z), f[3] = __uint_as_float(v.w);
    }
}

/* x[c .. c + EPC) of one row (cached: every warp of the SM reads it). */
template <int EPC, bool VEC>
__device__ __forceinline__ void fetch_x(const float *xr, int j, int cols, float (&f)[EPC]) {
    if (VEC) {
#pragma unroll
        for (int q = 0; q < EPC / 4; q++) {
            const float4 v = __ldg(reinterpret_cast<const float4 *>(xr + (size_t)j * EPC) + q);
            f[4 * q] = v.x, f[4 * q + 1] = v.y, f[4 * q + 2] = v.z, f[4 * q + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int e = 0; e < EPC; e++) {
            const int c = j * EPC + e;
            f[e] = c < cols ? xr[c] : 0.0f;
        }
    }
}

/*
 * One warp: acc[i * NT + t] += sum_c W_i[c] * x[t, c] for its kGemvRows
 * weight rows (wrow[i]; NULL = absent, contributes 0) and the first nt <= NT
 * rows of x, over the lane's columns: lane l takes 16-byte chunks l, l + 32,
 * ... in batches of kGemvDepth, all kGemvRows x kGemvDepth weight loads of a
 * batch issued before the first is used.
 */
template <int NT, bool BF16, bool VEC, int R = kGemvRows, int D = kGemvDepth>
__device__ __forceinline__ void gemv_accumulate(const void *const (&wrow)[R], int cols,
                                                const float *x, int ldx, int nt,
                                                float (&acc)[R * NT]) {
    constexpr int EPC = BF16 ? 8 : 4;
    const int lane = threadIdx.x & 31;
    const int nchunk = (cols + EPC - 1) / EPC;
    for (int base = 0; base < nchunk; base += 32 * D) {
        uint4 w[D][R];
#pragma unroll
        for (int u = 0; u < D; u++) {
            const int j = base + u * 32 + lane;
#pragma unroll
            for (int i = 0; i < R; i++)
                w[u][i] = j < nchunk && wrow[i] ? fetch_w<BF16, VEC>(wrow[i], j, cols)
                                                : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < D; u++) {
            const int j = base + u * 32 + lane;
            if (j >= nchunk) break;
            float wf[R][EPC];
#pragma unroll
            for (int i = 0; i < R; i++) unpack<BF16>(w[u][i], wf[i]);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t >= nt) break;
                float xf[EPC];
                fetch_x<EPC, VEC>(x + (size_t)t * ldx, j, cols, xf);
#pragma unroll
                for (int i = 0; i < R; i++)
#pragma unroll
                    for (int e = 0; e < EPC; e++)
                        acc[i * NT + t] = fmaf(wf[i][e], xf[e], acc[i * NT + t]);
            }
        }
    }
}

/*
 * Warp reduce-scatter of N = 2^m values per lane (N <= 32): afterwards v[0]
 * of lane l holds the warp's sum of value index l >> (5 - m). Each step
 * halves the values a lane keeps (it sends the half its partner keeps), so
 * N = 32 costs 31 shuffles instead of the 160 of N butterflies.
 */
template <int N, int O> struct rscat {
    static __device__ __forceinline__ void run(float *v, int lane) {
        if constexpr (N > 1) {
            const bool up = (lane & O) != 0;
#pragma unroll
            for (int i = 0; i < N / 2; i++) {
                const float send = up ? v[i] : v[i + N / 2];
                const float keep = up ? v[i + N / 2] : v[i];
                v[i] = keep + __shfl_xor_sync(kFull, send, O);
            }
        } else {
            v[0] += __shfl_xor_sync(kFull, v[0], O);
        }
        rscat<(N > 1 ? N / 2 : 1), O / 2>::run(v, lane);
    }
};
template <int N> struct rscat<N, 0> {
    static __device__ __forceinline__ void run(float *, int) {}
};

/*
 * y[t, r] (+)= x[t] . W[r] for t < T <= NT: warp w of CTA b owns weight rows
 * (b * WARPS + w) * R + [0, R), D 16-byte chunks per row and lane in flight
 * (the defaults kGemvWarps, kGemvRows, kGemvDepth; kds_cuda_bench times
 * other geometries through kern_cuda_matmul_args.gemv_variant). No shared
 * memory, no block barrier: x comes through L1 (the weights bypass it).
 */
template <int NT, bool BF16, bool VEC, int R = kGemvRows, int D = kGemvDepth, int WARPS = kGemvWarps>
__global__ void __launch_bounds__(WARPS * 32)
gemv_kernel(const void *W, int rows, int cols, const float *x, int ldx, int T, float *y, int ldy,
            int accumulate) {
    const int lane = threadIdx.x & 31;
    const int r0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * R;
    if (r0 >= rows) return; /* whole warps */
    const size_t rb = (size_t)cols * (BF16 ? 2 : 4);
    const void *wrow[R];
#pragma unroll
    for (int i = 0; i < R; i++)
        wrow[i] = r0 + i < rows ? static_cast<const char *>(W) + (size_t)(r0 + i) * rb : nullptr;
    float acc[R * NT];
#pragma unroll
    for (int i = 0; i < R * NT; i++) acc[i] = 0.0f;
    gemv_accumulate<NT, BF16, VEC, R, D>(wrow, cols, x, ldx, T, acc);
    constexpr int N = R * NT, S = 5 - ilog2(N);
    rscat<N, 16>::run(acc, lane);
    if (lane & ((1 << S) - 1)) return;
    const int k = lane >> S, i = k / NT, t = k % NT;
    if (t < T && r0 + i < rows) {
        float *d = y + (size_t)t * ldy + r0 + i;
        *d = accumulate ? *d + acc[0] : acc[0];
    }
}

/* ---- grouped experts -------------------------------------------------------- */

struct moe_params {
    const void *const *W, *const *W3; /* pointer tables, or NULL: */
    const char *base1, *base3;        /* expert e at base + e * stride */
    size_t stride;
    const int32_t *exp_off;
    int E, rows, cols, n_rows;
    const float *x;
    int ldx;
    float *y;
    int ldy;
};

/* What the MXFP4 weights and the K3 activation add, as a second kernel
 * argument: growing moe_params changed ptxas's register allocation of the
 * bf16 kernels (the w2 GEMV's spill doubled), a separate struct does not. */
struct moe_ext {
    const void *const *S, *const *S3; /* MXFP4 scales: tables, or NULL: */
    const char *sbase1, *sbase3;      /* expert e's at sbase + e * sstride */
    size_t sstride;
    int situ;                         /* fused form: SiTU (else SwiGLU) */
    float beta, beta_l;
};

/* The fused form's activation of gate a and up b. SwiGLU is the expression
 * this file always had (the default stays bit for bit what it was). */
__device__ __forceinline__ float gate_act(const moe_ext &q, float a, float b) {
    if (q.situ) return situ1(a, b, q.beta, q.beta_l);
    return a * sigm(a) * b;
}

/* Expert e's matrix: from the table, or base + e * stride. */
__device__ __forceinline__ const char *expert_w(const void *const *tab, const char *base, size_t stride,
                                                int e) {
    return tab ? static_cast<const char *>(tab[e]) : base + (size_t)e * stride;
}

struct tile_t {
    int e, m0, cnt;
};

/*
 * The CTA's work in a grouped product: tile blockIdx.x of the list
 * (expert 0's rows in pieces of BM, then expert 1's, ...), as expert e,
 * first row m0 and row count cnt (1..BM); e = -1 past the last tile.
 * Warp 0 scans exp_off 32 experts at a time (a warp prefix sum of the tile
 * counts, a ballot for the hit); offsets are clamped to [0, n_rows] so bad
 * ones can never index out of bounds. One block barrier: every thread of
 * the CTA must call it.
 */
__device__ tile_t find_tile(const int32_t *exp_off, int E, int n_rows, int BM) {
    __shared__ int s_tile[3];
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x, b = blockIdx.x;
        int base = 0, e_hit = -1, m0 = 0, cnt = 0;
        for (int e0 = 0; e0 < E; e0 += 32) {
            const int e = e0 + lane;
            int lo = 0, hi = 0;
            if (e < E) {
                lo = min(max(exp_off[e], 0), n_rows);
                hi = min(max(exp_off[e + 1], lo), n_rows);
            }
            const int tiles = (hi - lo + BM - 1) / BM;
            int incl = tiles;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(kFull, incl, o);
                if (lane >= o) incl += v;
            }
            const int excl = incl - tiles;
            const bool hit = tiles > 0 && b >= base + excl && b < base + incl;
            const unsigned m = __ballot_sync(kFull, hit);
            if (m) {
                const int src = __ffs((int)m) - 1;
                const int my_m0 = lo + (b - base - excl) * BM;
                const int my_cnt = min(BM, hi - my_m0);
                e_hit = __shfl_sync(kFull, e, src);
                m0 = __shfl_sync(kFull, my_m0, src);
                cnt = __shfl_sync(kFull, my_cnt, src);
                break;
            }
            base += __shfl_sync(kFull, incl, 31);
        }
        if (lane == 0) s_tile[0] = e_hit, s_tile[1] = m0, s_tile[2] = cnt;
    }
    __syncthreads();
    tile_t t = {s_tile[0], s_tile[1], s_tile[2]};
    return t;
}

/* One warp's part of a grouped GEMV chunk with NT >= nt rows of x. Plain:
 * kGemvRows rows of W_e from r0. FUSED: rows r0, r0 + 1 of W_e (slots 0, 1)
 * and of W3_e (slots 2, 3); after the reduce-scatter the W3 sum of a value
 * sits 16 lanes above its W sum. */
/* The end of a grouped GEMV chunk: reduce-scatter the warp's partial sums,
 * apply the fused activation, store. */
template <int NT, bool FUSED>
__device__ __forceinline__ void moe_gemv_store(const moe_params &p, const moe_ext &q,
                                               float (&acc)[kGemvRows * NT], int r0, float *y, int nt) {
    const int lane = threadIdx.x & 31;
    constexpr int N = kGemvRows * NT, S = 5 - ilog2(N);
    rscat<N, 16>::run(acc, lane);
    float v = acc[0];
    if (FUSED) {
        const float b = __shfl_down_sync(kFull, v, 16);
        if (lane >= 16) return;
        v = gate_act(q, v, b);
    }
    if (lane & ((1 << S) - 1)) return;
    const int k = lane >> S, i = k / NT, t = k % NT;
    if (t < nt && r0 + i < p.rows) y[(size_t)t * p.ldy + r0 + i] = v;
}

template <int NT, bool BF16, bool VEC, bool FUSED>
__device__ __forceinline__ void moe_gemv_body(const moe_params &p, const moe_ext &q,
                                              const void *const (&wrow)[kGemvRows], int r0, const float *x,
                                              float *y, int nt) {
    float acc[kGemvRows * NT];
#pragma unroll
    for (int i = 0; i < kGemvRows * NT; i++) acc[i] = 0.0f;
    gemv_accumulate<NT, BF16, VEC>(wrow, p.cols, x, p.ldx, nt, acc);
    moe_gemv_store<NT, FUSED>(p, q, acc, r0, y, nt);
}

/* Grid (chunk tiles, weight-row blocks); block kGemvWarps warps. A chunk is
 * up to kGemvMaxT rows of one expert; its weights are streamed once. */
template <bool BF16, bool VEC, bool FUSED>
__global__ void __launch_bounds__(kGemvWarps * 32) moe_gemv_kernel(const moe_params p, const moe_ext q) {
    const tile_t tl = find_tile(p.exp_off, p.E, p.n_rows, kGemvMaxT);
    if (tl.e < 0) return;
    constexpr int RPW = FUSED ? kGemvRows / 2 : kGemvRows; /* output rows per warp */
    const int r0 = (blockIdx.y * kGemvWarps + (threadIdx.x >> 5)) * RPW;
    if (r0 >= p.rows) return;
    const size_t rb = (size_t)p.cols * (BF16 ? 2 : 4);
    const char *w1 = expert_w(p.W, p.base1, p.stride, tl.e);
    const char *w3 = FUSED ? expert_w(p.W3, p.base3, p.stride, tl.e) : nullptr;
    const void *wrow[kGemvRows];
#pragma unroll
    for (int i = 0; i < kGemvRows; i++) {
        const int r = r0 + (FUSED ? i % 2 : i);
        const char *w = FUSED && i >= 2 ? w3 : w1;
        wrow[i] = r < p.rows ? w + (size_t)r * rb : nullptr;
    }
    const float *x = p.x + (size_t)tl.m0 * p.ldx;
    float *y = p.y + (size_t)tl.m0 * p.ldy;
    if (tl.cnt == 1)
        moe_gemv_body<1, BF16, VEC, FUSED>(p, q, wrow, r0, x, y, 1);
    else if (tl.cnt == 2)
        moe_gemv_body<2, BF16, VEC, FUSED>(p, q, wrow, r0, x, y, 2);
    else if (tl.cnt <= 4)
        moe_gemv_body<4, BF16, VEC, FUSED>(p, q, wrow, r0, x, y, tl.cnt);
    else
        moe_gemv_body<8, BF16, VEC, FUSED>(p, q, wrow, r0, x, y, tl.cnt);
}

/*
 * The MXFP4 grouped GEMV's inner loop: as gemv_accumulate, lane l takes
 * 16-byte chunks l, l + 32, ... of each of its kGemvRows rows (a chunk is
 * 32 codes: exactly one scale block, whose E8M0 byte is the lane's too),
 * kGemvDepth chunks per row in flight. Per chunk and row the 32 codes are
 * decoded once (e2m1x8_tiny, value * 2^-126) for all nt rows of x, which
 * are read scaled by 2^64 so every product stays a normal fp32; the
 * block's sum is then multiplied by 2^62 and by the scale, both exact: the
 * dequantised matrix's product up to summation order.
 */
template <int NT>
__device__ __forceinline__ void gemv_fp4_accumulate(const char *const (&wrow)[kGemvRows],
                                                    const unsigned char *const (&srow)[kGemvRows], int cols,
                                                    const float *x, int ldx, int nt,
                                                    float (&acc)[kGemvRows * NT]) {
    const int lane = threadIdx.x & 31;
    const int nchunk = cols / KERN_BLOCK;
    const float xs = pow2_64(), ps = pow2_62();
    for (int base = 0; base < nchunk; base += 32 * kGemvDepth) {
        uint4 w[kGemvDepth][kGemvRows];
        unsigned sc[kGemvDepth][kGemvRows];
#pragma unroll
        for (int u = 0; u < kGemvDepth; u++) {
            const int j = base + u * 32 + lane;
#pragma unroll
            for (int i = 0; i < kGemvRows; i++) {
                const bool ok = j < nchunk && wrow[i];
                w[u][i] = ok ? ld_stream16(wrow[i] + (size_t)j * 16) : make_uint4(0u, 0u, 0u, 0u);
                sc[u][i] = ok ? (unsigned)__ldg(srow[i] + j) : 0u;
            }
        }
#pragma unroll
        for (int u = 0; u < kGemvDepth; u++) {
            const int j = base + u * 32 + lane;
            if (j >= nchunk) break;
            float part[kGemvRows * NT];
#pragma unroll
            for (int i = 0; i < kGemvRows * NT; i++) part[i] = 0.0f;
#pragma unroll
            for (int q = 0; q < 4; q++) { /* word q: columns 32 j + 8 q .. + 8 */
                float v[kGemvRows][8];
#pragma unroll
                for (int i = 0; i < kGemvRows; i++) {
                    const uint4 c = w[u][i];
                    e2m1x8_tiny(q == 0 ? c.x : q == 1 ? c.y : q == 2 ? c.z : c.w, v[i]);
                }
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    if (t >= nt) break;
                    const float4 *xp = reinterpret_cast<const float4 *>(x + (size_t)t * ldx + (size_t)j * 32 + 8 * q);
                    const float4 x0 = __ldg(xp), x1 = __ldg(xp + 1);
                    const float xf[8] = {x0.x * xs, x0.y * xs, x0.z * xs, x0.w * xs,
                                         x1.x * xs, x1.y * xs, x1.z * xs, x1.w * xs};
#pragma unroll
                    for (int i = 0; i < kGemvRows; i++)
#pragma unroll
                        for (int e = 0; e < 8; e++) part[i * NT + t] = fmaf(v[i][e], xf[e], part[i * NT + t]);
                }
            }
#pragma unroll
            for (int i = 0; i < kGemvRows; i++) {
                const float f = e8m0(sc[u][i]);
#pragma unroll
                for (int t = 0; t < NT; t++) acc[i * NT + t] = fmaf(part[i * NT + t] * ps, f, acc[i * NT + t]);
            }
        }
    }
}

template <int NT, bool FUSED>
__device__ __forceinline__ void moe_gemv_fp4_body(const moe_params &p, const moe_ext &q,
                                                  const char *const (&wrow)[kGemvRows],
                                                  const unsigned char *const (&srow)[kGemvRows], int r0,
                                                  const float *x, float *y, int nt) {
    float acc[kGemvRows * NT];
#pragma unroll
    for (int i = 0; i < kGemvRows * NT; i++) acc[i] = 0.0f;
    gemv_fp4_accumulate<NT>(wrow, srow, p.cols, x, p.ldx, nt, acc);
    moe_gemv_store<NT, FUSED>(p, q, acc, r0, y, nt);
}

/* moe_gemv_kernel for MXFP4 codes [rows, cols / 2] and scales [rows,
 * cols / 32] (cols % 32 == 0, codes and x 16-byte aligned: host-checked). */
template <bool FUSED>
__global__ void __launch_bounds__(kGemvWarps * 32) moe_gemv_fp4_kernel(const moe_params p, const moe_ext q) {
    const tile_t tl = find_tile(p.exp_off, p.E, p.n_rows, kGemvMaxT);
    if (tl.e < 0) return;
    constexpr int RPW = FUSED ? kGemvRows / 2 : kGemvRows;
    const int r0 = (blockIdx.y * kGemvWarps + (threadIdx.x >> 5)) * RPW;
    if (r0 >= p.rows) return;
    const size_t rb = (size_t)p.cols / 2, srb = (size_t)p.cols / KERN_BLOCK;
    const char *w1 = expert_w(p.W, p.base1, p.stride, tl.e);
    const char *w3 = FUSED ? expert_w(p.W3, p.base3, p.stride, tl.e) : nullptr;
    const char *s1 = expert_w(q.S, q.sbase1, q.sstride, tl.e);
    const char *s3 = FUSED ? expert_w(q.S3, q.sbase3, q.sstride, tl.e) : nullptr;
    const char *wrow[kGemvRows];
    const unsigned char *srow[kGemvRows];
#pragma unroll
    for (int i = 0; i < kGemvRows; i++) {
        const int r = r0 + (FUSED ? i % 2 : i);
        const bool up = FUSED && i >= 2;
        wrow[i] = r < p.rows ? (up ? w3 : w1) + (size_t)r * rb : nullptr;
        srow[i] = reinterpret_cast<const unsigned char *>((up ? s3 : s1) + (size_t)(r < p.rows ? r : 0) * srb);
    }
    const float *x = p.x + (size_t)tl.m0 * p.ldx;
    float *y = p.y + (size_t)tl.m0 * p.ldy;
    if (tl.cnt == 1)
        moe_gemv_fp4_body<1, FUSED>(p, q, wrow, srow, r0, x, y, 1);
    else if (tl.cnt == 2)
        moe_gemv_fp4_body<2, FUSED>(p, q, wrow, srow, r0, x, y, 2);
    else if (tl.cnt <= 4)
        moe_gemv_fp4_body<4, FUSED>(p, q, wrow, srow, r0, x, y, tl.cnt);
    else
        moe_gemv_fp4_body<8, FUSED>(p, q, wrow, srow, r0, x, y, tl.cnt);
}

/* 16 MXFP4 codes (8 bytes) and their block's E8M0 scale as 16 bf16 values
 * at dst (16-byte aligned): (value * 2^-126) * 2^126 * scale is the
 * CPU's e2m1 * e8m0 product bit for bit, and has at most two significant
 * bits, so its top 16 bits are its bf16 value exactly. */
__device__ __forceinline__ void fp4_to_bf16x16(uint2 q, unsigned s, uint16_t *dst) {
    const float sc = e8m0(s), k = pow2_126();
    unsigned o[8];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float v[8];
        e2m1x8_tiny(h ? q.y : q.x, v);
#pragma unroll
        for (int e = 0; e < 4; e++)
            o[4 * h + e] = __float_as_uint(v[2 * e] * k * sc) >> 16 |
                           (__float_as_uint(v[2 * e + 1] * k * sc) & 0xffff0000u);
    }
    *reinterpret_cast<uint4 *>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
    *reinterpret_cast<uint4 *>(dst + 8) = make_uint4(o[4], o[5], o[6], o[7]);
}

/*
 * Grouped GEMM on tensor cores: CTA (tile, n-block) computes rows
 * [m0, m0 + cnt) of x (cnt <= 64, one expert) against weight rows
 * [n0, n0 + 64) of W_e (and W3_e when FUSED), k steps of 32. Per step the
 * next step's global loads are in registers while the warps run the
 * current one from shared memory (x converted to bf16 hi (+ lo) on the way
 * in). Warp w owns the 32 x 32 quarter (w / 2, w % 2): 2 x 2 WMMA 16x16x16
 * accumulators per weight matrix. Needs cols % 8 == 0, ldx % 4 == 0, x and
 * every W_e 16-byte aligned (checked on the host, W_e by contract).
 * FP4: the weights are MXFP4 codes (cols % 32 == 0, so a k step is one
 * scale block): thread tid fetches 8 bytes (16 codes) of row tid / 2 and
 * that row's scale byte, and dequantises them exactly to bf16 on the way
 * into shared memory; the rest is the bf16 kernel.
 */
template <bool EXACT, bool FUSED, bool FP4>
__global__ void __launch_bounds__(kTcThreads) moe_tc_kernel(const moe_params p, const moe_ext q) {
    using namespace nvcuda;
    const tile_t tl = find_tile(p.exp_off, p.E, p.n_rows, kTcM);
    if (tl.e < 0) return; /* CTA-uniform */
    constexpr int kTile = kTcM * kTcLd;                     /* bf16 elements */
    constexpr int kTileBytes = (2 + (FUSED ? 2 : 1)) * kTile * 2;
    constexpr int kOutBytes = (FUSED ? 2 : 1) * kTcM * kTcOutLd * 4;
    __shared__ __align__(128) unsigned char smem[kTileBytes > kOutBytes ? kTileBytes : kOutBytes];
    uint16_t *xh = reinterpret_cast<uint16_t *>(smem), *xl = xh + kTile;
    uint16_t *w1s = xl + kTile, *w3s = w1s + kTile;
    const int tid = threadIdx.x, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;
    const int n0 = blockIdx.y * kTcN;
    const size_t rb = FP4 ? (size_t)p.cols / 2 : (size_t)p.cols * 2;
    const char *W1 = expert_w(p.W, p.base1, p.stride, tl.e);
    const char *W3 = FUSED ? expert_w(p.W3, p.base3, p.stride, tl.e) : nullptr;
    const char *S1 = FP4 ? expert_w(q.S, q.sbase1, q.sstride, tl.e) : nullptr;
    const char *S3 = FP4 && FUSED ? expert_w(q.S3, q.sbase3, q.sstride, tl.e) : nullptr;
    const size_t srb = (size_t)p.cols / KERN_BLOCK;

    /* per thread: 4 float4 of x (row idx / 8, column 4 (idx % 8)) and 2
     * 16-byte chunks of each weight (row idx / 4, column 8 (idx % 4)); FP4:
     * 8 bytes of codes (row tid / 2, columns 16 (tid % 2)) and a scale */
    float4 xr[4];
    uint4 w1r[2], w3r[2];
    uint2 q1r, q3r;
    unsigned s1r = 0, s3r = 0;
    auto fetch = [&](int k0) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int idx = tid + q * kTcThreads, r = idx >> 3, c = k0 + 4 * (idx & 7);
            xr[q] = r < tl.cnt && c < p.cols
                        ? __ldg(reinterpret_cast<const float4 *>(p.x + (size_t)(tl.m0 + r) * p.ldx + c))
                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        if constexpr (FP4) {
            const int r = tid >> 1;
            const bool ok = n0 + r < p.rows; /* k0 < cols and cols % 32 == 0 */
            const size_t off = (size_t)(n0 + r) * rb + (size_t)k0 / 2 + 8 * (tid & 1);
            const size_t soff = (size_t)(n0 + r) * srb + (size_t)k0 / KERN_BLOCK;
            q1r = ok ? ld_stream8(W1 + off) : make_uint2(0u, 0u);
            s1r = ok ? (unsigned)__ldg(reinterpret_cast<const unsigned char *>(S1) + soff) : 0u;
            if (FUSED) {
                q3r = ok ? ld_stream8(W3 + off) : make_uint2(0u, 0u);
                s3r = ok ? (unsigned)__ldg(reinterpret_cast<const unsigned char *>(S3) + soff) : 0u;
            }
        } else {
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const int idx = tid + q * kTcThreads, r = idx >> 2, c = k0 + 8 * (idx & 3);
                const bool ok = n0 + r < p.rows && c < p.cols;
                const size_t off = (size_t)(n0 + r) * rb + (size_t)c * 2;
                w1r[q] = ok ? ld_stream16(W1 + off) : make_uint4(0u, 0u, 0u, 0u);
                if (FUSED) w3r[q] = ok ? ld_stream16(W3 + off) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
    };
    auto stash = [&]() {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int idx = tid + q * kTcThreads, r = idx >> 3, c = 4 * (idx & 7);
            const float v[4] = {xr[q].x, xr[q].y, xr[q].z, xr[q].w};
            unsigned h[4], l[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                h[e] = bf16_bits(v[e]);
                l[e] = EXACT ? bf16_bits(v[e] - bf16_val(h[e])) : 0u;
            }
            *reinterpret_cast<uint2 *>(xh + r * kTcLd + c) = make_uint2(h[0] | h[1] << 16, h[2] | h[3] << 16);
            if (EXACT)
                *reinterpret_cast<uint2 *>(xl + r * kTcLd + c) = make_uint2(l[0] | l[1] << 16, l[2] | l[3] << 16);
        }
        if constexpr (FP4) {
            const int off = (tid >> 1) * kTcLd + 16 * (tid & 1);
            fp4_to_bf16x16(q1r, s1r, w1s + off);
            if (FUSED) fp4_to_bf16x16(q3r, s3r, w3s + off);
        } else {
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const int idx = tid + q * kTcThreads, r = idx >> 2, c = 8 * (idx & 3);
                *reinterpret_cast<uint4 *>(w1s + r * kTcLd + c) = w1r[q];
                if (FUSED) *reinterpret_cast<uint4 *>(w3s + r * kTcLd + c) = w3r[q];
            }
        }
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc1[2][2], acc3[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            wmma::fill_fragment(acc1[i][j], 0.0f);
            if (FUSED) wmma::fill_fragment(acc3[i][j], 0.0f);
        }
    fetch(0);
    for (int k0 = 0; k0 < p.cols; k0 += kTcK) {
        __syncthreads(); /* the previous step's fragments are loaded */
        stash();
        __syncthreads();
        if (k0 + kTcK < p.cols) fetch(k0 + kTcK); /* in flight during the MMAs */
#pragma unroll
        for (int kk = 0; kk < kTcK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> ah[2], al[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b1[2], b3[2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int off = (wm * 32 + i * 16) * kTcLd + kk;
                wmma::load_matrix_sync(ah[i], reinterpret_cast<const __nv_bfloat16 *>(xh + off), kTcLd);
                if (EXACT)
                    wmma::load_matrix_sync(al[i], reinterpret_cast<const __nv_bfloat16 *>(xl + off), kTcLd);
            }
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int off = (wn * 32 + j * 16) * kTcLd + kk; /* W rows: B col-major */
                wmma::load_matrix_sync(b1[j], reinterpret_cast<const __nv_bfloat16 *>(w1s + off), kTcLd);
                if (FUSED)
                    wmma::load_matrix_sync(b3[j], reinterpret_cast<const __nv_bfloat16 *>(w3s + off), kTcLd);
            }
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    wmma::mma_sync(acc1[i][j], ah[i], b1[j], acc1[i][j]);
                    if (EXACT) wmma::mma_sync(acc1[i][j], al[i], b1[j], acc1[i][j]);
                    if (FUSED) {
                        wmma::mma_sync(acc3[i][j], ah[i], b3[j], acc3[i][j]);
                        if (EXACT) wmma::mma_sync(acc3[i][j], al[i], b3[j], acc3[i][j]);
                    }
                }
        }
    }
    __syncthreads(); /* the tiles' shared memory becomes the output staging */
    float *o1 = reinterpret_cast<float *>(smem), *o3 = o1 + kTcM * kTcOutLd;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int off = (wm * 32 + i * 16) * kTcOutLd + wn * 32 + j * 16;
            wmma::store_matrix_sync(o1 + off, acc1[i][j], kTcOutLd, wmma::mem_row_major);
            if (FUSED) wmma::store_matrix_sync(o3 + off, acc3[i][j], kTcOutLd, wmma::mem_row_major);
        }
    __syncthreads();
    for (int idx = tid; idx < kTcM * kTcN; idx += kTcThreads) {
        const int m = idx / kTcN, n = idx % kTcN;
        if (m >= tl.cnt || n0 + n >= p.rows) continue;
        float v = o1[m * kTcOutLd + n];
        if (FUSED) v = gate_act(q, v, o3[m * kTcOutLd + n]);
        p.y[(size_t)(tl.m0 + m) * p.ldy + n0 + n] = v;
    }
}

/* x [T, ldx] fp32 -> hi [T, cols] = bf16(x), lo = bf16(x - hi) (lo NULL:
 * hi only), grid-stride. */
__global__ void split_kernel(const float *x, int ldx, int T, int cols, uint16_t *hi, uint16_t *lo) {
    const size_t n = (size_t)T * cols;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float v = x[(i / cols) * ldx + i % cols];
        const unsigned h = bf16_bits(v);
        hi[i] = (uint16_t)h;
        if (lo) lo[i] = (uint16_t)bf16_bits(v - bf16_val(h));
    }
}

/* ---- host helpers ----------------------------------------------------------- */

bool aligned16(const void *p) {
    return ((uintptr_t)p & 15u) == 0;
}

/* One geometry of the T = 1 bf16 GEMV (rows per warp, depth, warps per CTA). */
template <int R, int D, int WARPS>
void launch_gemv_geometry(const kern_cuda_matmul_args *a, cudaStream_t st) {
    const unsigned grid = (unsigned)((a->rows + WARPS * R - 1) / (WARPS * R));
    gemv_kernel<1, true, true, R, D, WARPS><<<grid, WARPS * 32, 0, st>>>(a->W, a->rows, a->cols, a->x, a->ldx, a->T, a->y, a->ldy, a->accumulate ? 1 : 0);
}

template <bool BF16, bool VEC>
void launch_gemv(const kern_cuda_matmul_args *a, cudaStream_t st) {
    if (BF16 && VEC && a->T == 1 && a->gemv_variant > 0) {
        switch (a->gemv_variant) { /* KERN_CUDA_GEMV_VARIANTS of them */
        case 1: launch_gemv_geometry<2, 8, 4>(a, st); return;
        case 2: launch_gemv_geometry<1, 8, 8>(a, st); return;
        case 3: launch_gemv_geometry<1, 16, 4>(a, st); return;
        case 4: launch_gemv_geometry<4, 8, 4>(a, st); return;
        case 5: launch_gemv_geometry<2, 4, 8>(a, st); return;
        default: break;
        }
    }
    const unsigned grid = (unsigned)((a->rows + kGemvWarps * kGemvRows - 1) / (kGemvWarps * kGemvRows));
    const int acc = a->accumulate ? 1 : 0;
    if (a->T == 1)
        gemv_kernel<1, BF16, VEC><<<grid, kGemvWarps * 32, 0, st>>>(a->W, a->rows, a->cols, a->x, a->ldx, a->T, a->y, a->ldy, acc);
    else if (a->T == 2)
        gemv_kernel<2, BF16, VEC><<<grid, kGemvWarps * 32, 0, st>>>(a->W, a->rows, a->cols, a->x, a->ldx, a->T, a->y, a->ldy, acc);
    else if (a->T <= 4)
        gemv_kernel<4, BF16, VEC><<<grid, kGemvWarps * 32, 0, st>>>(a->W, a->rows, a->cols, a->x, a->ldx, a->T, a->y, a->ldy, acc);
    else
        gemv_kernel<8, BF16, VEC><<<grid, kGemvWarps * 32, 0, st>>>(a->W, a->rows, a->cols, a->x, a->ldx, a->T, a->y, a->ldy, acc);
}

kds_status blas_status(const cublas_api *api, cublasStatus_t s, kds_err *err, const char *what) {
    if (s == CUBLAS_STATUS_SUCCESS) return KDS_OK;
    return kern_cuda__err(err, s == CUBLAS_STATUS_ALLOC_FAILED ? KDS_NOMEM : KDS_CUDA, "%s: %s (cuBLAS status %d)",
                          what, api->status_string(s), (int)s);
}

#define KDS_STR2(x) #x
#define KDS_STR(x) KDS_STR2(x) /* expands cublas_v2.h's macros: cublasCreate -> "cublasCreate_v2" */

/* Fill *api: the emulation's functions, or the symbols of the cuBLAS of
 * the CUDA major version this was compiled against. */
kds_status cublas_api_open(cublas_api *api, kds_err *err) {
    *api = cublas_api{};
#ifdef KDS_EMU_CUBLAS_V2_H
    api->create = cublasCreate;
    api->destroy = cublasDestroy;
    api->set_stream = cublasSetStream;
    api->set_workspace = cublasSetWorkspace;
    api->set_math_mode = cublasSetMathMode;
    api->status_string = cublasGetStatusString;
    api->gemm_ex = cublasGemmEx;
    (void)err;
    return KDS_OK;
#else
    const char *soname = "libcublas.so." KDS_STR(CUBLAS_VER_MAJOR);
    api->lib = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (!api->lib)
        return kern_cuda__err(err, KDS_CUDA,
                              "gemm ctx: cannot load cuBLAS (%s): %s; install CUDA %d's cuBLAS "
                              "(or put it on LD_LIBRARY_PATH), or run with --device cpu",
                              soname, dlerror(), CUBLAS_VER_MAJOR);
    struct {
        void **slot;
        const char *name;
    } syms[] = {
        {(void **)&api->create, KDS_STR(cublasCreate)},
        {(void **)&api->destroy, KDS_STR(cublasDestroy)},
        {(void **)&api->set_stream, KDS_STR(cublasSetStream)},
        {(void **)&api->set_workspace, KDS_STR(cublasSetWorkspace)},
        {(void **)&api->set_math_mode, KDS_STR(cublasSetMathMode)},
        {(void **)&api->status_string, KDS_STR(cublasGetStatusString)},
        {(void **)&api->gemm_ex, KDS_STR(cublasGemmEx)},
    };
    for (auto &sym : syms) {
        *sym.slot = dlsym(api->lib, sym.name);
        if (!*sym.slot) {
            kds_status rc = kern_cuda__err(err, KDS_CUDA, "gemm ctx: %s has no %s (a cuBLAS older than CUDA %d?)",
                                           soname, sym.name, CUBLAS_VER_MAJOR);
            dlclose(api->lib);
            *api = cublas_api{};
            return rc;
        }
    }
    return KDS_OK;
#endif
}

void cublas_api_close(cublas_api *api) {
#ifndef KDS_EMU_CUBLAS_V2_H
    if (api->lib) dlclose(api->lib);
#endif
    *api = cublas_api{};
}

/* Bind the handle to `st` (cublasSetStream resets the workspace to cuBLAS's
 * own pool, so ours is set again after it). */
kds_status bind_stream(kern_cuda_gemm_ctx *c, cudaStream_t st, kds_err *err) {
    if (st == c->bound) return KDS_OK;
    kds_status rc = blas_status(&c->api, c->api.set_stream(c->h, st), err, "cublasSetStream");
    if (rc == KDS_OK)
        rc = blas_status(&c->api, c->api.set_workspace(c->h, c->ws, KDS_CUBLAS_WORKSPACE), err,
                         "cublasSetWorkspace");
    if (rc == KDS_OK) c->bound = st;
    return rc;
}

/* y [T, ldy] (+)= x W^T through cuBLAS (column-major view: y^T [rows, T] =
 * op_T(W as [cols, rows], lda cols) * x^T [cols, T]). */
kds_status matmul_cublas(const kern_cuda_matmul_args *a, cudaStream_t st, kds_err *err) {
    kern_cuda_gemm_ctx *c = a->gemm;
    kds_status rc = bind_stream(c, st, err);
    if (rc != KDS_OK) return rc;
    const float one = 1.0f, zero = 0.0f;
    const float *beta = a->accumulate ? &one : &zero;
    if (a->w_dtype == KERN_F32) /* fp32 on CUDA cores: math mode DEFAULT_MATH (no TF32) */
        return blas_status(&c->api, c->api.gemm_ex(c->h, CUBLAS_OP_T, CUBLAS_OP_N, a->rows, a->T, a->cols, &one, a->W,
                                        CUDA_R_32F, a->cols, a->x, CUDA_R_32F, a->ldx, beta, a->y, CUDA_R_32F,
                                        a->ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                           err, "matmul: cublasGemmEx (fp32)");
    const bool exact = a->mode == KERN_CUDA_GEMM_EXACT;
    const int piece = (int)(c->max_elems / (size_t)a->cols < (size_t)a->T ? c->max_elems / (size_t)a->cols
                                                                           : (size_t)a->T);
    if (piece < 1)
        return kern_cuda__err(err, KDS_INVALID_ARG,
                              "matmul: GEMM context scratch holds %zu elements, fewer than one row of %d",
                              c->max_elems, a->cols);
    uint16_t *hi = c->scratch, *lo = c->scratch + c->max_elems;
    for (int t0 = 0; t0 < a->T; t0 += piece) {
        const int n = a->T - t0 < piece ? a->T - t0 : piece;
        const size_t elems = (size_t)n * a->cols;
        const unsigned blocks = (unsigned)((elems + 255) / 256 < 4096 ? (elems + 255) / 256 : 4096);
        split_kernel<<<blocks, 256, 0, st>>>(a->x + (size_t)t0 * a->ldx, a->ldx, n, a->cols, hi, exact ? lo : nullptr);
        rc = kern_cuda__status(cudaGetLastError(), err, "matmul: bf16 split launch");
        if (rc != KDS_OK) return rc;
        float *y = a->y + (size_t)t0 * a->ldy;
        rc = blas_status(&c->api, c->api.gemm_ex(c->h, CUBLAS_OP_T, CUBLAS_OP_N, a->rows, n, a->cols, &one, a->W, CUDA_R_16BF,
                                      a->cols, hi, CUDA_R_16BF, a->cols, beta, y, CUDA_R_32F, a->ldy,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                         err, "matmul: cublasGemmEx (bf16, hi)");
        if (rc == KDS_OK && exact)
            rc = blas_status(&c->api, c->api.gemm_ex(c->h, CUBLAS_OP_T, CUBLAS_OP_N, a->rows, n, a->cols, &one, a->W,
                                          CUDA_R_16BF, a->cols, lo, CUDA_R_16BF, a->cols, &one, y, CUDA_R_32F,
                                          a->ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                             err, "matmul: cublasGemmEx (bf16, lo)");
        if (rc != KDS_OK) return rc;
    }
    return KDS_OK;
}

} /* namespace */

/* ---- the GEMM context --------------------------------------------------------- */

extern "C" kds_status kern_cuda_gemm_ctx_create(size_t max_act_elems, kern_cuda_gemm_ctx **out,
                                                kds_err *err) {
    if (!out) return kern_cuda__err(err, KDS_INVALID_ARG, "gemm ctx: NULL out pointer");
    *out = NULL;
    if (max_act_elems < 1 || max_act_elems > ((size_t)1 << 40))
        return kern_cuda__err(err, KDS_INVALID_ARG, "gemm ctx: max_act_elems=%zu (need 1 .. 2^40)",
                              max_act_elems);
    kern_cuda_gemm_ctx *c = static_cast<kern_cuda_gemm_ctx *>(calloc(1, sizeof *c));
    if (!c) return kern_cuda__err(err, KDS_NOMEM, "gemm ctx: out of host memory");
    kds_status rc = cublas_api_open(&c->api, err);
    if (rc != KDS_OK) goto fail;
    rc = blas_status(&c->api, c->api.create(&c->h), err, "gemm ctx: cublasCreate");
    if (rc != KDS_OK) {
        c->h = NULL;
        goto fail;
    }
    /* DEFAULT_MATH: fp32 products stay fp32 (no TF32 tensor ops) */
    if ((rc = blas_status(&c->api, c->api.set_math_mode(c->h, CUBLAS_DEFAULT_MATH), err,
                          "gemm ctx: cublasSetMathMode")) !=
        KDS_OK)
        goto fail;
    if ((rc = kern_cuda__status(cudaMalloc(&c->ws, KDS_CUBLAS_WORKSPACE), err, "gemm ctx: workspace")) != KDS_OK) {
        c->ws = NULL;
        goto fail;
    }
    if ((rc = kern_cuda__status(cudaMalloc(&c->scratch, 2 * max_act_elems * sizeof(uint16_t)), err,
                                "gemm ctx: activation scratch")) != KDS_OK) {
        c->scratch = NULL;
        goto fail;
    }
    c->max_elems = max_act_elems;
    c->bound = (cudaStream_t)1; /* nothing bound yet: force the first bind */
    if ((rc = bind_stream(c, NULL, err)) != KDS_OK) goto fail;
    *out = c;
    return KDS_OK;
fail:
    (void)cudaGetLastError();
    kern_cuda_gemm_ctx_free(c);
    return rc;
}

extern "C" void kern_cuda_gemm_ctx_free(kern_cuda_gemm_ctx *c) {
    if (!c) return;
    if (c->h) (void)c->api.destroy(c->h);
    if (c->ws) (void)cudaFree(c->ws);
    if (c->scratch) (void)cudaFree(c->scratch);
    cublas_api_close(&c->api);
    free(c);
}

extern "C" kds_status kern_cuda_gemm_ctx_set_stream(kern_cuda_gemm_ctx *c, void *stream, kds_err *err) {
    if (!c) return kern_cuda__err(err, KDS_INVALID_ARG, "gemm ctx: NULL context");
    return bind_stream(c, kern_cuda__stream(stream), err);
}

/* ---- kern_cuda_matmul ------------------------------------------------------------ */

extern "C" const char *kern_cuda_gemv_variant_name(int v) {
    static const char *const names[KERN_CUDA_GEMV_VARIANTS + 1] = {
        "rows/warp 4, depth 4, warps 4", "rows/warp 2, depth 8, warps 4", "rows/warp 1, depth 8, warps 8",
        "rows/warp 1, depth 16, warps 4", "rows/warp 4, depth 8, warps 4", "rows/warp 2, depth 4, warps 8"};
    return v >= 0 && v <= KERN_CUDA_GEMV_VARIANTS ? names[v] : "no such variant";
}

extern "C" kds_status kern_cuda_matmul(const kern_cuda_matmul_args *a, void *stream, kds_err *err) {
    if (!a) return kern_cuda__err(err, KDS_INVALID_ARG, "matmul: NULL arguments");
    if (a->rows < 0 || a->cols < 1 || a->T < 0 || a->ldx < a->cols || a->ldy < a->rows)
        return kern_cuda__err(err, KDS_INVALID_ARG, "matmul: rows=%d cols=%d T=%d ldx=%d ldy=%d",
                              a->rows, a->cols, a->T, a->ldx, a->ldy);
    if (a->w_dtype != KERN_F32 && a->w_dtype != KERN_BF16)
        return kern_cuda__err(err, KDS_INVALID_ARG, "matmul: weight dtype %d (need F32 or BF16)",
                              (int)a->w_dtype);
    if (a->mode != KERN_CUDA_GEMM_EXACT && a->mode != KERN_CUDA_GEMM_BF16)
        return kern_cuda__err(err, KDS_INVALID_ARG, "matmul: mode %d (need EXACT or BF16)", (int)a->mode);
    if (a->rows == 0 || a->T == 0) return KDS_OK;
    if (!a->W || !a->x || !a->y)
        return kern_cuda__err(err, KDS_INVALID_ARG, "matmul: NULL W, x or y device pointer");
    const cudaStream_t st = kern_cuda__stream(stream);
    if (a->T <= kGemvMaxT) {
        const bool bf16 = a->w_dtype == KERN_BF16;
        const bool vec = aligned16(a->W) && aligned16(a->x) && a->ldx % 4 == 0 && a->cols % (bf16 ? 8 : 4) == 0;
        if (bf16 && vec)
            launch_gemv<true, true>(a, st);
        else if (bf16)
            launch_gemv<true, false>(a, st);
        else if (vec)
            launch_gemv<false, true>(a, st);
        else
            launch_gemv<false, false>(a, st);
        return kern_cuda__status(cudaGetLastError(), err, "matmul: GEMV launch");
    }
    if (a->gemm) return matmul_cublas(a, st, err);
    return kern_cuda__matmul_tiled(a, st, err);
}

/* ---- kern_cuda_moe_experts ---------------------------------------------------------- */

extern "C" kds_status kern_cuda_moe_experts(const kern_cuda_moe_experts_args *a, void *stream, kds_err *err) {
    if (!a) return kern_cuda__err(err, KDS_INVALID_ARG, "moe experts: NULL arguments");
    if (a->E < 1 || a->rows < 1 || a->cols < 1 || a->n_rows < 0 || a->ldx < a->cols || a->ldy < a->rows)
        return kern_cuda__err(err, KDS_INVALID_ARG, "moe experts: E=%d rows=%d cols=%d n_rows=%d ldx=%d ldy=%d",
                              a->E, a->rows, a->cols, a->n_rows, a->ldx, a->ldy);
    if (a->w_dtype != KERN_F32 && a->w_dtype != KERN_BF16 && a->w_dtype != KERN_MXFP4)
        return kern_cuda__err(err, KDS_INVALID_ARG, "moe experts: weight dtype %d (need F32, BF16 or MXFP4)",
                              (int)a->w_dtype);
    if (a->mode != KERN_CUDA_GEMM_EXACT && a->mode != KERN_CUDA_GEMM_BF16)
        return kern_cuda__err(err, KDS_INVALID_ARG, "moe experts: mode %d (need EXACT or BF16)", (int)a->mode);
    if (a->algo != KERN_CUDA_MOE_AUTO && a->algo != KERN_CUDA_MOE_GEMV && a->algo != KERN_CUDA_MOE_TENSOR)
        return kern_cuda__err(err, KDS_INVALID_ARG, "moe experts: algo %d", (int)a->algo);
    if (a->act != KERN_CUDA_MOE_SWIGLU && a->act != KERN_CUDA_MOE_SITU)
        return kern_cuda__err(err, KDS_INVALID_ARG, "moe experts: act %d (need SWIGLU or SITU)", (int)a->act);
    const bool fp4 = a->w_dtype == KERN_MXFP4;
    if (fp4 && a->cols % KERN_BLOCK)
        return kern_cuda__err(err, KDS_INVALID_ARG, "moe experts: MXFP4 needs cols %% %d == 0 (cols %d)",
                              KERN_BLOCK, a->cols);
    const bool table = a->W != NULL;
    const bool fused = table ? a->W3 != NULL : a->W3_base != NULL;
    if (a->act == KERN_CUDA_MOE_SITU) {
        if (!fused)
            return kern_cuda__err(err, KDS_INVALID_ARG, "moe experts: act SITU needs the fused form (W3 or W3_base)");
        if (!(a->situ_beta > 0.0f && a->situ_beta < INFINITY) || !(a->situ_beta_l > 0.0f && a->situ_beta_l < INFINITY))
            return kern_cuda__err(err, KDS_INVALID_ARG, "moe experts: situ_beta=%g situ_beta_l=%g (need positive, finite)",
                                  (double)a->situ_beta, (double)a->situ_beta_l);
    }
    if (a->n_rows == 0) return KDS_OK;
    if ((!a->W && !a->W_base) || !a->exp_off || !a->x || !a->y)
        return kern_cuda__err(err, KDS_INVALID_ARG, "moe experts: NULL W (and W_base), exp_off, x or y device pointer");
    const size_t scale_bytes = (size_t)a->rows * (size_t)(a->cols / KERN_BLOCK);
    if (fp4 && (table ? !a->S || (fused && !a->S3) : !a->S_base || (fused && !a->S3_base)))
        return kern_cuda__err(err, KDS_INVALID_ARG, "moe experts: MXFP4 without its scales (%s)",
                              table ? "S / S3 tables for W / W3" : "S_base / S3_base for W_base / W3_base");
    if (fp4 && !table && a->s_stride < scale_bytes)
        return kern_cuda__err(err, KDS_INVALID_ARG, "moe experts: s_stride %zu below one matrix's scales (%zu bytes)",
                              a->s_stride, scale_bytes);
    const size_t mat_bytes = fp4 ? (size_t)a->rows * (a->cols / 2)
                                 : (size_t)a->rows * a->cols * (a->w_dtype == KERN_BF16 ? 2 : 4);
    if (!table && a->w_stride < mat_bytes)
        return kern_cuda__err(err, KDS_INVALID_ARG, "moe experts: w_stride %zu below one matrix (%zu bytes)",
                              a->w_stride, mat_bytes);
    const bool bf16 = a->w_dtype == KERN_BF16;
    const bool vec = aligned16(a->x) && a->ldx % 4 == 0 && a->cols % (fp4 ? KERN_BLOCK : bf16 ? 8 : 4) == 0 &&
                     (table || (aligned16(a->W_base) && aligned16(a->W3_base) && a->w_stride % 16 == 0));
    if (fp4 && !vec)
        return kern_cuda__err(err, KDS_UNSUPPORTED,
                              "moe experts: MXFP4 needs 16-byte aligned x (ldx %% 4 == 0), code bases and w_stride "
                              "(ldx %d, w_stride %zu)",
                              a->ldx, a->w_stride);
    const bool tc_ok = (bf16 || fp4) && vec;
    bool tc = a->algo == KERN_CUDA_MOE_TENSOR;
    if (tc && !tc_ok)
        return kern_cuda__err(err, KDS_UNSUPPORTED,
                              "moe experts: tensor-core path needs bf16 or MXFP4 weights, cols %% 8 == 0, ldx %% 4 == 0 "
                              "and 16-byte aligned x, bases and stride (dtype %d, cols %d, ldx %d, stride %zu)",
                              (int)a->w_dtype, a->cols, a->ldx, a->w_stride);
    if (a->algo == KERN_CUDA_MOE_AUTO) tc = tc_ok && a->n_rows > 2 * a->E;
    const moe_params p = {table ? a->W : nullptr, table ? a->W3 : nullptr,
                          static_cast<const char *>(a->W_base), static_cast<const char *>(a->W3_base),
                          a->w_stride, a->exp_off, a->E, a->rows, a->cols, a->n_rows, a->x, a->ldx, a->y, a->ldy};
    moe_ext q = {nullptr, nullptr, nullptr, nullptr, 0, a->act == KERN_CUDA_MOE_SITU ? 1 : 0, a->situ_beta,
                 a->situ_beta_l};
    if (fp4) {
        q.S = table ? a->S : nullptr, q.S3 = table ? a->S3 : nullptr;
        q.sbase1 = static_cast<const char *>(a->S_base), q.sbase3 = static_cast<const char *>(a->S3_base);
        q.sstride = a->s_stride;
    }
    const cudaStream_t st = kern_cuda__stream(stream);
    /* tiles: sum_e ceil(n_e / BM) <= n_rows / BM + (experts with rows), and <= n_rows */
    const int active = a->E < a->n_rows ? a->E : a->n_rows;
    if (tc) {
        const long tiles = (long)a->n_rows / kTcM + active;
        const dim3 grid((unsigned)(tiles < a->n_rows ? tiles : a->n_rows), (unsigned)((a->rows + kTcN - 1) / kTcN));
        if (grid.y > 65535)
            return kern_cuda__err(err, KDS_UNSUPPORTED, "moe experts: rows=%d exceed one launch", a->rows);
        const bool exact = a->mode == KERN_CUDA_GEMM_EXACT;
        if (fp4) {
            if (exact && fused)
                moe_tc_kernel<true, true, true><<<grid, kTcThreads, 0, st>>>(p, q);
            else if (exact)
                moe_tc_kernel<true, false, true><<<grid, kTcThreads, 0, st>>>(p, q);
            else if (fused)
                moe_tc_kernel<false, true, true><<<grid, kTcThreads, 0, st>>>(p, q);
            else
                moe_tc_kernel<false, false, true><<<grid, kTcThreads, 0, st>>>(p, q);
        } else {
            if (exact && fused)
                moe_tc_kernel<true, true, false><<<grid, kTcThreads, 0, st>>>(p, q);
            else if (exact)
                moe_tc_kernel<true, false, false><<<grid, kTcThreads, 0, st>>>(p, q);
            else if (fused)
                moe_tc_kernel<false, true, false><<<grid, kTcThreads, 0, st>>>(p, q);
            else
                moe_tc_kernel<false, false, false><<<grid, kTcThreads, 0, st>>>(p, q);
        }
        return kern_cuda__status(cudaGetLastError(), err, "moe experts: tensor-core launch");
    }
    const int rpw = fused ? kGemvRows / 2 : kGemvRows;
    const long tiles = (long)a->n_rows / kGemvMaxT + active;
    const dim3 grid((unsigned)(tiles < a->n_rows ? tiles : a->n_rows),
                    (unsigned)((a->rows + kGemvWarps * rpw - 1) / (kGemvWarps * rpw)));
    if (grid.y > 65535)
        return kern_cuda__err(err, KDS_UNSUPPORTED, "moe experts: rows=%d exceed one launch", a->rows);
    if (fp4 && fused)
        moe_gemv_fp4_kernel<true><<<grid, kGemvWarps * 32, 0, st>>>(p, q);
    else if (fp4)
        moe_gemv_fp4_kernel<false><<<grid, kGemvWarps * 32, 0, st>>>(p, q);
    else if (bf16 && vec && fused)
        moe_gemv_kernel<true, true, true><<<grid, kGemvWarps * 32, 0, st>>>(p, q);
    else if (bf16 && vec)
        moe_gemv_kernel<true, true, false><<<grid, kGemvWarps * 32, 0, st>>>(p, q);
    else if (bf16 && fused)
        moe_gemv_kernel<true, false, true><<<grid, kGemvWarps * 32, 0, st>>>(p, q);
    else if (bf16)
        moe_gemv_kernel<true, false, false><<<grid, kGemvWarps * 32, 0, st>>>(p, q);
    else if (vec && fused)
        moe_gemv_kernel<false, true, true><<<grid, kGemvWarps * 32, 0, st>>>(p, q);
    else if (vec)
        moe_gemv_kernel<false, true, false><<<grid, kGemvWarps * 32, 0, st>>>(p, q);
    else if (fused)
        moe_gemv_kernel<false, false, true><<<grid, kGemvWarps * 32, 0, st>>>(p, q);
    else
        moe_gemv_kernel<false, false, false><<<grid, kGemvWarps * 32, 0, st>>>(p, q);
    return kern_cuda__status(cudaGetLastError(), err, "moe experts: GEMV launch");
}
