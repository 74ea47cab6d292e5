/*
 * kda_kernels.cuh - device code of the KDA CUDA kernels: the fused batched
 * decode step and the element kernels (L2 norm, gate). Included by
 * kern_cuda_kda.cu only; see README.md beside it for the design.
 *
 * Kept free of host-side API calls (no launches, no cudaXxx) and of CUDA
 * features beyond thread/block indices, __syncthreads, shuffles and
 * __ldcs/__stcs, so that the same source compiles with a host C++ compiler
 * over a small SIMT emulation (README.md, "Checking without a GPU").
 *
 * Numerics: the formulas of the CPU kernels in kern.h, in fp32, with IEEE
 * expf/log1pf/sqrtf (no fast-math) and softplus threshold 20; results differ
 * from the CPU only by summation order and FMA contraction.
 */
#ifndef KDA_KERNELS_CUH
#define KDA_KERNELS_CUH

#include <stdint.h>

namespace kda {

/* Threads per CTA of the decode kernel: 4 warps. */
constexpr int kDecodeThreads = 128;
/* Value columns per CTA (the V tile). 32 fp32 columns = one 128-byte line
 * per state row; 8 lanes x float4 cover it. */
constexpr int kDecodeBV = 32;

/* ---- scalar math shared with the CPU reference's definitions ---------- */

__device__ __forceinline__ float sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

/* PyTorch softplus, beta 1, threshold 20. */
__device__ __forceinline__ float softplus(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

/* kern_kda_gate for one element; x = g_raw + dt_bias already summed. */
__device__ __forceinline__ float gate(float x, float A_log, float lower_bound) {
    if (lower_bound < 0.0f) return lower_bound * sigmoid(expf(A_log) * x);
    return -expf(A_log) * softplus(x);
}

/* ---- input element types ---------------------------------------------- */

/* bf16 stored as its 16 raw bits: widening to fp32 is a shift (exact). */
struct in_f32 {
    typedef float T;
    static __device__ __forceinline__ float ld(const float *p, size_t i) { return p[i]; }
    /* Four consecutive elements; p + i must be 16-byte aligned. */
    static __device__ __forceinline__ float4 ld4(const float *p, size_t i) {
        return *reinterpret_cast<const float4 *>(p + i);
    }
};

struct in_bf16 {
    typedef uint16_t T;
    static __device__ __forceinline__ float cvt(uint32_t bits16) {
        return __uint_as_float(bits16 << 16);
    }
    static __device__ __forceinline__ float ld(const uint16_t *p, size_t i) { return cvt(p[i]); }
    /* Four consecutive elements; p + i must be 8-byte aligned. */
    static __device__ __forceinline__ float4 ld4(const uint16_t *p, size_t i) {
        uint2 w = *reinterpret_cast<const uint2 *>(p + i);
        return make_float4(cvt(w.x & 0xffffu), cvt(w.x >> 16), cvt(w.y & 0xffffu), cvt(w.y >> 16));
    }
};

/* ---- small helpers ----------------------------------------------------- */

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

/* Sum over the lanes that share (lane % LPR), i.e. over the row groups of a
 * warp: xor offsets LPR, 2 LPR, ... 16. */
template <int LPR>
__device__ __forceinline__ float4 warp_sum_rows(float4 p) {
#pragma unroll
    for (int off = LPR; off < 32; off <<= 1) {
        p.x += __shfl_xor_sync(0xffffffffu, p.x, off);
        p.y += __shfl_xor_sync(0xffffffffu, p.y, off);
        p.z += __shfl_xor_sync(0xffffffffu, p.z, off);
        p.w += __shfl_xor_sync(0xffffffffu, p.w, off);
    }
    return p;
}

__device__ __forceinline__ float4 f4_zero() {
    return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

/* ---- fused batched decode ---------------------------------------------- */

struct decode_params {
    const void *q, *k, *v, *g_raw, *beta_raw; /* element type: the template's In */
    const float *A_log, *dt_bias;             /* dt_bias may be NULL */
    float lower_bound, scale;
    float *pool;
    const int32_t *slots;
    float *o;
    int pool_slots, H, HV, V, n_vtiles;
};

/*
 * One CTA per (sequence n, value head hv, V tile vt of BV columns);
 * blockIdx.x = (n * HV + hv) * n_vtiles + vt.
 *
 * Thread layout inside the K x BV state tile (BV = 32, 128 threads):
 *   LPR = BV / 4 = 8 lanes cover one row's 32 columns with one float4 each;
 *   a warp covers RPW = 32 / LPR = 4 rows at once, the CTA NRG = 16 "row
 *   groups"; thread (warp w, lane l) owns columns c0 = vt*BV + 4*(l % LPR)
 *   .. c0+3 of rows rg + i*NRG, i < R = K / NRG, rg = w*RPW + l / LPR.
 *   Each warp-wide float4 load thus reads RPW full 128-byte row segments.
 *
 * The step, with S' = diag(e^g) S and the identity (as in the CPU kernel)
 *   o = S_new^T (s qn) = S'^T (s qn) + u (kn . s qn),   u = beta (v - S'^T kn)
 * so that both column reductions come from one pass and one barrier:
 *   load   : slot id; the thread's R rows of raw q, k, g_raw (+dt_bias), its
 *            4 columns of v, beta; then its R float4 of the state tile
 *            (all independent, all in flight together)
 *   gate   : e^g for R rows, computed once per row: each of the LPR lanes
 *            sharing a row set computes R / LPR of them, shuffles share them
 *   pass 1 : S *= e^g; per column partials of k.S', q.S' (raw k, q), plus
 *            |q|^2, |k|^2, q.k over the thread's rows
 *   reduce : shuffles over the warp's row groups, smem over the warps,
 *            ONE __syncthreads; every thread then knows the L2 norms, its
 *            columns of u, and warp 0 also o (written out)
 *   pass 2 : S += kn u^T, streamed back with 128-bit stores
 * HBM traffic per CTA: K*BV*4 bytes of state in and out (once each); the
 * q, k, g_raw rows are shared by the head's n_vtiles CTAs through L2.
 */
template <int K, typename In>
__global__ void __launch_bounds__(kDecodeThreads)
decode_kernel(const decode_params p) {
    constexpr int NT = kDecodeThreads;
    constexpr int BV = kDecodeBV;
    constexpr int NWARPS = NT / 32;
    constexpr int LPR = BV / 4;
    constexpr int RPW = 32 / LPR;
    constexpr int NRG = NWARPS * RPW;
    constexpr int R = K / NRG;
    constexpr int GPL = (R + LPR - 1) / LPR; /* gate values computed per lane */
    static_assert(BV % 4 == 0 && 32 % LPR == 0, "V tile must map onto whole warps");
    static_assert(K % NRG == 0 && R >= 1, "K must be a multiple of the row groups");
    typedef typename In::T T;

    __shared__ float4 s_pk[NWARPS][LPR]; /* per-warp column partials of k.S' */
    __shared__ float4 s_pq[NWARPS][LPR]; /* ... of q.S' */
    __shared__ float s_nrm[NWARPS][3];   /* ... |q|^2, |k|^2, q.k */

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int vt = blockIdx.x % p.n_vtiles;
    const int nh = blockIdx.x / p.n_vtiles; /* n * HV + hv */
    const int hv = nh % p.HV;
    const int n = nh / p.HV;
    const int h = hv / (p.HV / p.H);
    const int V = p.V;
    const int col = vt * BV + (lane % LPR) * 4;
    const int rg = warp * RPW + lane / LPR;

    /* Issue every independent load first: slot id, then the inputs. */
    const int slot = p.slots[n];
    const T *qh = static_cast<const T *>(p.q) + ((size_t)n * p.H + h) * K;
    const T *kh = static_cast<const T *>(p.k) + ((size_t)n * p.H + h) * K;
    const T *gh = static_cast<const T *>(p.g_raw) + (size_t)nh * K;
    float qr[R], kr[R];
#pragma unroll
    for (int i = 0; i < R; i++) {
        qr[i] = In::ld(qh, rg + i * NRG);
        kr[i] = In::ld(kh, rg + i * NRG);
    }
    float gx[GPL];
#pragma unroll
    for (int j = 0; j < GPL; j++) {
        const int i = j * LPR + lane % LPR;
        const int r = rg + (i < R ? i : 0) * NRG;
        gx[j] = In::ld(gh, r);
        if (p.dt_bias) gx[j] += p.dt_bias[(size_t)hv * K + r];
    }
    const float A_log = p.A_log[hv];
    const float beta_raw = In::ld(static_cast<const T *>(p.beta_raw), (size_t)nh);
    const float4 vv = In::ld4(static_cast<const T *>(p.v), (size_t)nh * V + col);
    float *orow = p.o + (size_t)nh * V + col;

    /* A slot outside the pool is padding: o = 0, state untouched. Uniform
     * over the CTA, so returning before the barrier is safe. */
    if (slot < 0 || slot >= p.pool_slots) {
        if (warp == 0 && lane < LPR) *reinterpret_cast<float4 *>(orow) = f4_zero();
        return;
    }

    /* The state tile: R independent 128-bit streaming loads per thread. */
    float *Sp = p.pool + ((size_t)slot * p.HV + hv) * (size_t)K * V + col;
    float4 s[R];
#pragma unroll
    for (int i = 0; i < R; i++)
        s[i] = __ldcs(reinterpret_cast<const float4 *>(Sp + (size_t)(rg + i * NRG) * V));

    /* Gate (while the state is in flight): lane l of a row set computes the
     * rows i = j*LPR + l % LPR, then all LPR lanes fetch each other's. */
#pragma unroll
    for (int j = 0; j < GPL; j++) gx[j] = expf(gate(gx[j], A_log, p.lower_bound));
    float a[R];
    const int src0 = lane & ~(LPR - 1);
#pragma unroll
    for (int i = 0; i < R; i++)
        a[i] = __shfl_sync(0xffffffffu, gx[i / LPR], src0 + i % LPR);
    const float beta = sigmoid(beta_raw);

    /* Pass 1: decay rows; partial k.S', q.S' per column and the norms. */
    float4 pk = f4_zero(), pq = f4_zero();
    float nq = 0.0f, nk = 0.0f, nqk = 0.0f;
#pragma unroll
    for (int i = 0; i < R; i++) {
        s[i].x *= a[i];
        s[i].y *= a[i];
        s[i].z *= a[i];
        s[i].w *= a[i];
        pk.x += kr[i] * s[i].x;
        pk.y += kr[i] * s[i].y;
        pk.z += kr[i] * s[i].z;
        pk.w += kr[i] * s[i].w;
        pq.x += qr[i] * s[i].x;
        pq.y += qr[i] * s[i].y;
        pq.z += qr[i] * s[i].z;
        pq.w += qr[i] * s[i].w;
        nq += qr[i] * qr[i];
        nk += kr[i] * kr[i];
        nqk += qr[i] * kr[i];
    }
    /* Over the warp's row groups (lanes with equal lane % LPR hold the same
     * columns; lanes with equal lane / LPR the same rows, so after this lane 0
     * holds the warp's |q|^2 etc. exactly once per row). */
    pk = warp_sum_rows<LPR>(pk);
    pq = warp_sum_rows<LPR>(pq);
#pragma unroll
    for (int off = LPR; off < 32; off <<= 1) {
        nq += __shfl_xor_sync(0xffffffffu, nq, off);
        nk += __shfl_xor_sync(0xffffffffu, nk, off);
        nqk += __shfl_xor_sync(0xffffffffu, nqk, off);
    }
    if (lane < LPR) {
        s_pk[warp][lane] = pk;
        s_pq[warp][lane] = pq;
    }
    if (lane == 0) {
        s_nrm[warp][0] = nq;
        s_nrm[warp][1] = nk;
        s_nrm[warp][2] = nqk;
    }
    __syncthreads();
    float4 ks = f4_zero();
    float tq = 0.0f, tk = 0.0f, tqk = 0.0f;
#pragma unroll
    for (int w = 0; w < NWARPS; w++) {
        const float4 t = s_pk[w][lane % LPR];
        ks.x += t.x;
        ks.y += t.y;
        ks.z += t.z;
        ks.w += t.w;
        tq += s_nrm[w][0];
        tk += s_nrm[w][1];
        tqk += s_nrm[w][2];
    }
    const float qn = 1.0f / sqrtf(tq + 1e-6f); /* kern_l2norm, eps 1e-6 */
    const float kn = 1.0f / sqrtf(tk + 1e-6f);
    float4 u; /* beta (v - S'^T kn) */
    u.x = beta * (vv.x - ks.x * kn);
    u.y = beta * (vv.y - ks.y * kn);
    u.z = beta * (vv.z - ks.z * kn);
    u.w = beta * (vv.w - ks.w * kn);

    if (warp == 0 && lane < LPR) {
        /* o = S'^T (s qn) + u (kn . s qn) */
        const float sq = p.scale * qn;
        const float kq = tqk * kn * sq;
        float4 qs = f4_zero();
#pragma unroll
        for (int w = 0; w < NWARPS; w++) {
            const float4 t = s_pq[w][lane];
            qs.x += t.x;
            qs.y += t.y;
            qs.z += t.z;
            qs.w += t.w;
        }
        float4 o;
        o.x = qs.x * sq + u.x * kq;
        o.y = qs.y * sq + u.y * kq;
        o.z = qs.z * sq + u.z * kq;
        o.w = qs.w * sq + u.w * kq;
        *reinterpret_cast<float4 *>(orow) = o;
    }

    /* Pass 2: S = S' + kn u^T, streamed out. */
#pragma unroll
    for (int i = 0; i < R; i++) {
        const float kk = kr[i] * kn;
        s[i].x += kk * u.x;
        s[i].y += kk * u.y;
        s[i].z += kk * u.z;
        s[i].w += kk * u.w;
        __stcs(reinterpret_cast<float4 *>(Sp + (size_t)(rg + i * NRG) * V), s[i]);
    }
}

/* ---- element kernels ---------------------------------------------------- */

/* One warp per vector: x /= sqrt(sum(x^2) + eps). blockDim.x % 32 == 0.
 * (static, like gate_kernel: this header is included by several .cu files) */
static __global__ void l2norm_kernel(float *x, int n_vecs, int dim, float eps) {
    const int vec = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (vec >= n_vecs) return; /* whole warps only: no barrier below */
    float *xv = x + (size_t)vec * dim;
    float ss = 0.0f;
    for (int i = lane; i < dim; i += 32) ss += xv[i] * xv[i];
    ss = warp_sum(ss);
    const float d = sqrtf(ss + eps);
    for (int i = lane; i < dim; i += 32) xv[i] /= d;
}

/* kern_kda_gate over n = T*HV*K elements, grid-stride. */
static __global__ void gate_kernel(const float *g_raw, const float *A_log, const float *dt_bias,
                            size_t n, int HV, int K, float lower_bound, float *g) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const int d = (int)(i % (size_t)K);
        const int hv = (int)((i / (size_t)K) % (size_t)HV);
        float x = g_raw[i];
        if (dt_bias) x += dt_bias[(size_t)hv * K + d];
        g[i] = gate(x, A_log[hv], lower_bound);
    }
}

} /* namespace kda */

#endif /* KDA_KERNELS_CUH */
