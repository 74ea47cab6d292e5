/*
 * kda_prefill.cuh - device code of the chunked (WY / UT) KDA prefill
 * (kern_cuda_kda_prefill in kern_cuda.h; math of kda-model-spec.md §4.1 and
 * of kern_kda_chunked in kernels/cpu/kda.c). Included by kern_cuda_prefill.cu
 * only; README.md beside it has the design.
 *
 * Two kernels per pass over a run of chunks (C = 64 tokens each):
 *   intra (parallel, one CTA per (chunk, value head)): everything that does
 *     not depend on the state entering the chunk, written to a workspace:
 *       A_qk [C, C]  scale sum_d q_r k_j e^{Gamma_r - Gamma_j}, j <= r
 *       Qt   [C, K]  scale q_r e^{Gamma_r}                (reads S0)
 *       Kb   [C, K]  k_r e^{Gamma_last - Gamma_r}         (writes the state)
 *       W    [C, K]  (I + A_kk)^-1 diag(beta) K~,  K~ = k e^{Gamma}
 *       U    [C, V]  (I + A_kk)^-1 diag(beta) V
 *       eG   [K]     e^{Gamma_last}
 *   state (sequential over the chunks, one CTA per (value head, 32-column
 *     V tile)), the state tile in shared memory:
 *       nu = U - W S ;  O = Qt S + A_qk nu ;  S = diag(eG) S + Kb^T nu
 * (nu = (I + A_kk)^-1 diag(beta) (V - K~ S) is the CPU's nu, factored so
 * that only two products per chunk touch the state.)
 *
 * Numerics, as the CPU kernel: every exponent is <= 0 (a difference
 * Gamma_r - Gamma_j with j <= r, or Gamma_r itself); the cumulative sums
 * Gamma are kept in double and each difference is rounded to float only
 * after it is formed; a log-decay below -1e6 is raised to -1e6 (so -inf
 * gives -inf differences, never NaN). A_qk / A_kk off the 16 x 16 diagonal
 * blocks are computed through the first row n of the row block:
 *   e^{Gamma_r - Gamma_j} = e^{Gamma_r - Gamma_n} e^{Gamma_n - Gamma_j},
 * both factors <= 1 for j < n <= r, so a block is a plain product of two
 * decayed matrices (a tensor-core shape); inside the diagonal blocks every
 * factor is formed directly. fp32 arithmetic throughout (FFMA), IEEE expf.
 *
 * Padding: rows past the end of the sequence (last chunk) are loaded as
 * q = k = v = 0, g = 0, beta = 0, so every product runs over full chunks and
 * their rows of W, U, Qt, Kb, A come out exactly 0.
 */
#ifndef KDA_PREFILL_CUH
#define KDA_PREFILL_CUH

#include "kda_kernels.cuh"
#include "kern_cuda_dev.cuh"

namespace kda {

constexpr int kChunk = 64;        /* tokens per chunk (fla's default) */
constexpr int kSub = 16;          /* row blocks of the intra-chunk matrices */
constexpr int kPrefillMaxK = 128; /* head dims the shared-memory layout holds */
constexpr int kPrefillMaxV = 128;
constexpr int kIntraThreads = 256;
constexpr int kStateThreads = 256;
constexpr int kStateBV = 32; /* value columns per state CTA */
constexpr float kGFloor = -1e6f;

struct prefill_params {
    const void *q, *k, *v, *g, *beta; /* In::T, except g, beta fp32 when !raw */
    const float *A_log, *dt_bias;
    float lower_bound, scale;
    int raw; /* q, k raw (L2-normalised here), g = g_raw, beta = logits */
    int T, H, HV, K, V;
    int c0, n_chunks; /* this pass: chunks [c0, c0 + n_chunks) of the sequence */
    float *ws;        /* [n_chunks, HV, ws_stride] */
    size_t ws_stride; /* floats per (chunk, head) block */
    float *state;     /* [HV, K, V] */
    float *o;         /* [T, HV, V] */
};

/* Offsets (floats) of the pieces of one (chunk, head) workspace block. Every
 * piece is a multiple of 4 floats (K, V multiples of 4), so float4 loads of
 * any piece are aligned when the workspace is. */
struct ws_layout {
    size_t aqk, qt, kb, w, u, eg, stride;
};
__host__ __device__ inline ws_layout prefill_ws_layout(int K, int V) {
    const size_t C = kChunk;
    ws_layout l;
    l.aqk = 0;
    l.qt = l.aqk + C * C;
    l.kb = l.qt + C * (size_t)K;
    l.w = l.kb + C * (size_t)K;
    l.u = l.w + C * (size_t)K;
    l.eg = l.u + C * (size_t)V;
    l.stride = (l.eg + (size_t)K + 3) & ~(size_t)3;
    return l;
}

/* Dynamic shared memory of the intra kernel (byte offsets). Rows are padded
 * by one element so that threads walking different rows at the same column
 * hit different banks. The anchored factors (qa, kq, ka) are dead before v
 * is loaded, so the two share one region. */
struct intra_smem {
    size_t g, q, k, a, b, qa, kq, ka, v, total;
};
__host__ __device__ inline intra_smem intra_smem_layout(int K, int V) {
    const size_t C = kChunk, KP = (size_t)K + 1, VP = (size_t)V + 1, CP = C + 1;
    intra_smem s;
    s.g = 0;                         /* double [C][KP]: Gamma */
    s.q = s.g + C * KP * 8;          /* float [C][KP]: q (normalised) */
    s.k = s.q + C * KP * 4;          /* float [C][KP]: k, later beta K~, then W */
    s.a = s.k + C * KP * 4;          /* float [C][CP]: A_kk (beta-scaled) */
    s.b = s.a + C * CP * 4;          /* float [C]: beta */
    s.qa = s.b + C * 4;              /* float [kSub][KP] */
    s.kq = s.qa + (size_t)kSub * KP * 4;
    s.ka = s.kq + (size_t)kSub * KP * 4; /* float [C - kSub][KP] */
    s.v = s.qa;                      /* float [C][VP]: beta v, then U */
    const size_t anchors = (size_t)(kSub + kSub + (C - kSub)) * KP * 4;
    const size_t vbytes = C * VP * 4;
    s.total = s.qa + (anchors > vbytes ? anchors : vbytes);
    return s;
}

/* Dynamic shared memory of the state kernel (floats). */
struct state_smem {
    size_t w, qt, kb, aqk, u, nu, s, eg, total_bytes;
};
__host__ __device__ inline state_smem state_smem_layout(int K) {
    const size_t C = kChunk, BV = kStateBV;
    state_smem s;
    s.w = 0;                   /* [C][K] */
    s.qt = s.w + C * K;        /* [C][K] */
    s.kb = s.qt + C * K;       /* [C][K] */
    s.aqk = s.kb + C * K;      /* [C][C] */
    s.u = s.aqk + C * C;       /* [C][BV] */
    s.nu = s.u + C * BV;       /* [C][BV] */
    s.s = s.nu + C * BV;       /* [K][BV]: the state tile */
    s.eg = s.s + (size_t)K * BV; /* [K] */
    s.total_bytes = (s.eg + (size_t)K) * 4;
    return s;
}

/* ---- intra-chunk kernel ---------------------------------------------------- */

/*
 * grid (n_chunks, HV), kIntraThreads threads, intra_smem_layout(K, V).total
 * bytes of dynamic shared memory. Any K, V in [4, 128] that are multiples
 * of 4 (the loops run over the actual sizes).
 */
template <typename In>
__global__ void __launch_bounds__(kIntraThreads) prefill_intra_kernel(const prefill_params p) {
    KDS_DYN_SMEM(smem);
    typedef typename In::T T;
    constexpr int C = kChunk, NT = kIntraThreads, NW = NT / 32;
    const int K = p.K, V = p.V, H = p.H, HV = p.HV;
    const int KP = K + 1, VP = V + 1, CP = C + 1;
    const intra_smem lay = intra_smem_layout(K, V);
    double *sG = reinterpret_cast<double *>(smem + lay.g);
    float *sQ = reinterpret_cast<float *>(smem + lay.q);
    float *sK = reinterpret_cast<float *>(smem + lay.k);
    float *sA = reinterpret_cast<float *>(smem + lay.a);
    float *sB = reinterpret_cast<float *>(smem + lay.b);
    float *sQa = reinterpret_cast<float *>(smem + lay.qa);
    float *sKq = reinterpret_cast<float *>(smem + lay.kq);
    float *sKa = reinterpret_cast<float *>(smem + lay.ka);
    float *sV = reinterpret_cast<float *>(smem + lay.v);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ci = blockIdx.x, hv = blockIdx.y;
    const int h = hv / (HV / H);
    const int t0 = (p.c0 + ci) * C;
    const int L = p.T - t0 < C ? p.T - t0 : C;
    const ws_layout wl = prefill_ws_layout(K, V);
    float *ws = p.ws + ((size_t)ci * HV + hv) * p.ws_stride;
    const T *q = static_cast<const T *>(p.q), *k = static_cast<const T *>(p.k);
    const T *v = static_cast<const T *>(p.v);

    /* 1. q, k, log-decay g (gated here in raw mode) and beta of the chunk;
     *    rows past the sequence are zeros */
    const float A_log = p.raw ? p.A_log[hv] : 0.0f;
    for (int i = tid; i < C * K; i += NT) {
        const int r = i / K, d = i - r * K;
        float qv = 0.0f, kv = 0.0f, gv = 0.0f;
        if (r < L) {
            const size_t qk = ((size_t)(t0 + r) * H + h) * K + d;
            qv = In::ld(q, qk);
            kv = In::ld(k, qk);
            const size_t gi = ((size_t)(t0 + r) * HV + hv) * K + d;
            if (p.raw) {
                float x = In::ld(static_cast<const T *>(p.g), gi);
                if (p.dt_bias) x += p.dt_bias[(size_t)hv * K + d];
                gv = gate(x, A_log, p.lower_bound);
            } else {
                gv = static_cast<const float *>(p.g)[gi];
            }
            gv = gv < kGFloor ? kGFloor : gv;
        }
        sQ[r * KP + d] = qv;
        sK[r * KP + d] = kv;
        sG[r * KP + d] = (double)gv;
    }
    for (int r = tid; r < C; r += NT) {
        float b = 0.0f;
        if (r < L) {
            const size_t bi = (size_t)(t0 + r) * HV + hv;
            b = p.raw ? sigmoid(In::ld(static_cast<const T *>(p.beta), bi))
                      : static_cast<const float *>(p.beta)[bi];
        }
        sB[r] = b;
    }
    __syncthreads();

    /* 2. raw mode: q, k /= sqrt(|x|^2 + 1e-6) (kern_l2norm), a warp per row;
     * 3. Gamma_r = sum_{i <= r} g_i per key channel, in double */
    if (p.raw) {
        for (int row = warp; row < 2 * C; row += NW) {
            float *x = (row < C ? sQ : sK) + (row % C) * KP;
            float ss = 0.0f;
            for (int d = lane; d < K; d += 32) ss = fmaf(x[d], x[d], ss);
            ss = warp_sum(ss);
            const float rn = (float)(1.0 / sqrt((double)ss + 1e-6));
            for (int d = lane; d < K; d += 32) x[d] *= rn;
        }
    }
    for (int d = tid; d < K; d += NT) {
        double acc = 0.0;
        for (int r = 0; r < C; r++) {
            acc += sG[r * KP + d];
            sG[r * KP + d] = acc;
        }
    }
    __syncthreads();

    /* 4. Qt = scale q e^{Gamma}, Kb = k e^{Gamma_last - Gamma}, eG (padding
     *    rows have g = 0, so row C-1 holds Gamma_last) */
    const double *Gl = sG + (C - 1) * KP;
    for (int i = tid; i < C * K; i += NT) {
        const int r = i / K, d = i - r * K;
        const double G = sG[r * KP + d];
        ws[wl.qt + i] = p.scale * sQ[r * KP + d] * expf((float)G);
        ws[wl.kb + i] = sK[r * KP + d] * expf((float)(Gl[d] - G));
    }
    for (int d = tid; d < K; d += NT) ws[wl.eg + d] = expf((float)Gl[d]);
    for (int i = tid; i < C * C; i += NT)
        if (i % C > i / C) ws[wl.aqk + i] = 0.0f; /* above the diagonal */

    /* 5. A_qk (to the workspace) and A_kk (shared, rows scaled by beta), by
     *    row blocks of kSub rows starting at n0 */
    for (int n0 = 0; n0 < C; n0 += kSub) {
        /* the block's rows decayed from n0, earlier keys decayed up to n0 */
        for (int i = tid; i < kSub * K; i += NT) {
            const int r = i / K, d = i - r * K;
            const float e = expf((float)(sG[(n0 + r) * KP + d] - sG[n0 * KP + d]));
            sQa[r * KP + d] = sQ[(n0 + r) * KP + d] * e;
            sKq[r * KP + d] = sK[(n0 + r) * KP + d] * e;
        }
        for (int i = tid; i < n0 * K; i += NT) {
            const int j = i / K, d = i - j * K;
            sKa[j * KP + d] = sK[j * KP + d] * expf((float)(sG[n0 * KP + d] - sG[j * KP + d]));
        }
        __syncthreads();
        /* off the diagonal block: rows n0 + i, columns j < n0 */
        for (int pi = tid; pi < kSub * n0; pi += NT) {
            const int i = pi / n0, j = pi - i * n0;
            const float *qa = sQa + i * KP, *kq = sKq + i * KP, *ka = sKa + j * KP;
            float aq = 0.0f, ak = 0.0f;
            for (int d = 0; d < K; d++) {
                aq = fmaf(qa[d], ka[d], aq);
                ak = fmaf(kq[d], ka[d], ak);
            }
            const int r = n0 + i;
            ws[wl.aqk + r * C + j] = p.scale * aq;
            sA[r * CP + j] = sB[r] * ak;
        }
        /* the diagonal block, one warp per pair (r, c), c <= r */
        for (int pi = warp; pi < kSub * (kSub + 1) / 2; pi += NW) {
            int i = 0;
            while ((i + 1) * (i + 2) / 2 <= pi) i++;
            const int j = pi - i * (i + 1) / 2;
            const int r = n0 + i, c = n0 + j;
            float aq = 0.0f, ak = 0.0f;
            for (int d = lane; d < K; d += 32) {
                const float e = r == c ? 1.0f : expf((float)(sG[r * KP + d] - sG[c * KP + d]));
                const float kc = sK[c * KP + d] * e;
                aq = fmaf(sQ[r * KP + d], kc, aq);
                ak = fmaf(sK[r * KP + d], kc, ak);
            }
            aq = warp_sum(aq);
            ak = warp_sum(ak);
            if (lane == 0) {
                ws[wl.aqk + r * C + c] = p.scale * aq;
                if (c < r) sA[r * CP + c] = sB[r] * ak;
            }
        }
        __syncthreads();
    }

    /* 6. right-hand sides: beta K~ over k, beta v over the anchored factors */
    for (int i = tid; i < C * K; i += NT) {
        const int r = i / K, d = i - r * K;
        sK[r * KP + d] = sB[r] * (sK[r * KP + d] * expf((float)sG[r * KP + d]));
    }
    for (int i = tid; i < C * V; i += NT) {
        const int r = i / V, c = i - r * V;
        const float x = r < L ? In::ld(v, ((size_t)(t0 + r) * HV + hv) * V + c) : 0.0f;
        sV[r * VP + c] = sB[r] * x;
    }
    __syncthreads();

    /* 7. (I + A_kk) X = [beta K~ | beta V] by forward substitution, one
     *    thread per column (A_kk is strictly lower; rows >= L are 0) */
    for (int col = tid; col < K + V; col += NT) {
        float *x = col < K ? sK + col : sV + (col - K);
        const int ld = col < K ? KP : VP;
        for (int r = 1; r < L; r++) {
            /* four independent partial sums: the chain of dependent FMAs,
             * not their number, bounds this loop */
            const float *a = sA + r * CP;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            int j = 0;
            for (; j + 3 < r; j += 4) {
                s0 = fmaf(a[j], x[j * ld], s0);
                s1 = fmaf(a[j + 1], x[(j + 1) * ld], s1);
                s2 = fmaf(a[j + 2], x[(j + 2) * ld], s2);
                s3 = fmaf(a[j + 3], x[(j + 3) * ld], s3);
            }
            for (; j < r; j++) s0 = fmaf(a[j], x[j * ld], s0);
            x[r * ld] -= (s0 + s1) + (s2 + s3);
        }
    }
    __syncthreads();

    /* 8. W and U to the workspace */
    for (int i = tid; i < C * K; i += NT) {
        const int r = i / K, d = i - r * K;
        ws[wl.w + i] = sK[r * KP + d];
    }
    for (int i = tid; i < C * V; i += NT) {
        const int r = i / V, c = i - r * V;
        ws[wl.u + i] = sV[r * VP + c];
    }
}

/* ---- intra-chunk kernel on tensor cores ------------------------------------- */

/*
 * prefill_intra_tc_kernel<In, K>: the same workspace as prefill_intra_kernel
 * (tensor_cores = true), with the big products on tensor cores (WMMA
 * 16x16x16, bf16 hi + lo operands, hi*hi + hi*lo + lo*hi, fp32 accumulators:
 * see prefill_state_tc_kernel) and ~110 KiB of shared memory at K = V = 128
 * (two CTAs per SM on H100/H200). K a multiple of 16, V any multiple of 4 up
 * to 128 (padded to 16 columns in shared memory).
 *
 * The chunk's rows fall in NB = 4 blocks of S = 16 rows; B_b = Gamma just
 * before block b (B_0 = 0, B_4 = Gamma_last) comes first, from per-block sums
 * of the log-decay (double), so that every block can be worked on alone:
 *   delta_r = Gamma_r - B_b   (running sum inside the block, double)
 * and e^{Gamma_r - Gamma_j} for j in an earlier block m < b factors as
 *   e^{delta_r} * e^{B_b - Gamma_j},   both exponents <= 0,
 * i.e. the off-diagonal block (b, m) of A_qk / A_kk is the product of
 * Qa_b = q e^{delta} (Kq_b = k e^{delta}) with R_bm = k_j e^{B_b - Gamma_j}^T,
 * R_bm formed while block m is walked (every exponent a difference of
 * doubles, rounded once). Diagonal blocks: every factor formed directly from
 * the deltas (CUDA cores, as the fp32 kernel).
 *
 * Per block b (sequential; one barrier after the walk, one after the
 * products):
 *   walk (thread per key channel and part of the rows): delta, Qt, Kb and
 *     beta K~ (to the workspace; beta K~ in W's place as scratch), Qa_b, Kq_b
 *     and the right operands R_{b'b}, b' > b (bf16 hi + lo);
 *   diagonal block (warp per row) and off-diagonal blocks (b, m < b) on
 *     tensor cores (warp m): A_qk to the workspace, beta A_kk to shared.
 * Then the solve, (I + A_kk)^-1 as a whole (fp32): the 16 x 16 diagonal
 * blocks by forward substitution, a thread per column; the blocks below by
 * levels, T_ij = -T_ii sum_{j <= l < i} A_il T_lj; then W = T (beta K~) and
 * U = T (beta V) on tensor cores, 16 x 16 output tiles over the 8 warps.
 */
struct intra_tc_smem {
    size_t beta, rn, anc, a;                       /* live throughout */
    size_t part, stg_a, kb, delta, qah, qal, kqh, kql, slot; /* the blocks */
    size_t t, z, th, tl, rh, rl, stg;              /* the solve (aliases the above) */
    size_t total;
    int ldk, lda, ldt, ldr; /* bf16 [*, K], fp32 [*, C], bf16 [*, C], bf16 [*, max(K, V16)] */
};
constexpr int kIntraTcSlots = 5; /* right operands R_{b'm} alive at once (see slot_of) */
__host__ __device__ inline intra_tc_smem intra_tc_smem_layout(int K, int V) {
    const size_t C = kChunk, S = kSub, V16 = ((size_t)V + 15) & ~(size_t)15;
    intra_tc_smem s;
    s.ldk = K + 8;
    s.lda = kChunk + 4;
    s.ldt = kChunk + 8;
    s.ldr = (int)(((size_t)K > V16 ? (size_t)K : V16) + 8);
    size_t off = 0;
#define KDS_TC_ALLOC(field, bytes)                                                             \
    s.field = off;                                                                             \
    off = (off + (size_t)(bytes) + 127) & ~(size_t)127
    KDS_TC_ALLOC(beta, C * 4);
    KDS_TC_ALLOC(rn, 2 * C * 4);
    KDS_TC_ALLOC(anc, 5 * (size_t)K * 8);
    KDS_TC_ALLOC(a, C * s.lda * 4);
    const size_t base = off;
    /* the walk's partial sums are written while the previous block's A_qk
     * tiles may still be staged: separate arrays */
    KDS_TC_ALLOC(part, (size_t)kIntraThreads * 8);
    KDS_TC_ALLOC(stg_a, 3 * 256 * 4);
    KDS_TC_ALLOC(kb, S * (size_t)K * 4);
    KDS_TC_ALLOC(delta, S * (size_t)K * 8);
    KDS_TC_ALLOC(qah, S * s.ldk * 2);
    KDS_TC_ALLOC(qal, S * s.ldk * 2);
    KDS_TC_ALLOC(kqh, S * s.ldk * 2);
    KDS_TC_ALLOC(kql, S * s.ldk * 2);
    KDS_TC_ALLOC(slot, kIntraTcSlots * 2 * S * s.ldk * 2);
    const size_t end_blocks = off;
    off = base;
    KDS_TC_ALLOC(t, C * s.lda * 4);
    KDS_TC_ALLOC(z, 3 * 256 * 4);
    KDS_TC_ALLOC(th, C * s.ldt * 2);
    KDS_TC_ALLOC(tl, C * s.ldt * 2);
    KDS_TC_ALLOC(rh, C * s.ldr * 2);
    KDS_TC_ALLOC(rl, C * s.ldr * 2);
    KDS_TC_ALLOC(stg, (kIntraThreads / 32) * 256 * 4);
#undef KDS_TC_ALLOC
    s.total = off > end_blocks ? off : end_blocks;
    return s;
}

/* Slot of the right operand R_{b m} (b > m): (1,0) 0, (2,0) 1, (3,0) 2,
 * (2,1) 3, (3,1) 4, (3,2) 0 (formed in step 2, after (1,0) was used). */
__device__ __forceinline__ int intra_tc_slot(int b, int m) {
    return m == 0 ? b - 1 : m == 1 ? b + 1 : 0;
}

/* Log-decay of row r (chunk-local), channel d, clamped; 0 past the sequence. */
template <typename In>
__device__ __forceinline__ float prefill_g(const prefill_params &p, int t0, int L, int hv, int r, int d,
                                           float A_log) {
    if (r >= L) return 0.0f;
    const size_t gi = ((size_t)(t0 + r) * p.HV + hv) * p.K + d;
    float gv;
    if (p.raw) {
        float x = In::ld(static_cast<const typename In::T *>(p.g), gi);
        if (p.dt_bias) x += p.dt_bias[(size_t)hv * p.K + d];
        gv = gate(x, A_log, p.lower_bound);
    } else {
        gv = static_cast<const float *>(p.g)[gi];
    }
    return gv < kGFloor ? kGFloor : gv;
}

/* x = hi + lo, both bf16 (also used by the state pass below) */
__device__ __forceinline__ void split_bf16(float x, __nv_bfloat16 *hi, __nv_bfloat16 *lo) {
    const __nv_bfloat16 h = __float2bfloat16_rn(x);
    *hi = h;
    *lo = __float2bfloat16_rn(x - __bfloat162float(h));
}

/*
 * grid (n_chunks, HV), kIntraThreads threads, intra_tc_smem_layout(K, V)
 * .total bytes of dynamic shared memory.
 */
template <typename In, int K>
__global__ void __launch_bounds__(kIntraThreads, 2) prefill_intra_tc_kernel(const prefill_params p) {
    namespace wm = nvcuda::wmma;
    typedef __nv_bfloat16 bf;
    typedef wm::fragment<wm::matrix_a, 16, 16, 16, bf, wm::row_major> frag_a;
    typedef wm::fragment<wm::matrix_b, 16, 16, 16, bf, wm::row_major> frag_b;
    typedef wm::fragment<wm::matrix_b, 16, 16, 16, bf, wm::col_major> frag_bt;
    typedef wm::fragment<wm::accumulator, 16, 16, 16, float> frag_c;
    typedef typename In::T T;
    KDS_DYN_SMEM(smem);
    constexpr int C = kChunk, S = kSub, NB = C / S, NT = kIntraThreads, NW = NT / 32;
    constexpr int NP = NT / K; /* walk: threads per key channel */
    constexpr int RP = S / NP; /* walk: rows of a block per thread */
    constexpr int KU = (K + 31) / 32;
    static_assert(K % 16 == 0 && K <= kPrefillMaxK && NP * K == NT && NP * RP == S, "intra tc K");
    static_assert(NB == 4 && NW == 8 && S == 16, "intra tc geometry (diagonal rows w, 15 - w)");
    const int V = p.V, H = p.H, HV = p.HV;
    const intra_tc_smem lay = intra_tc_smem_layout(K, V);
    const int ldk = lay.ldk, lda = lay.lda, ldt = lay.ldt, ldr = lay.ldr;
    float *sBeta = reinterpret_cast<float *>(smem + lay.beta);
    float *sRn = reinterpret_cast<float *>(smem + lay.rn); /* [2][C]: q, k row scales */
    double *sAnc = reinterpret_cast<double *>(smem + lay.anc); /* [5][K]: B_0 .. B_4 */
    float *sA = reinterpret_cast<float *>(smem + lay.a);  /* [C][lda]: beta A_kk, strictly lower */
    double *sPart = reinterpret_cast<double *>(smem + lay.part);
    float *sStgA = reinterpret_cast<float *>(smem + lay.stg_a);
    float *sKb = reinterpret_cast<float *>(smem + lay.kb);     /* [S][K]: k of the block */
    double *sDelta = reinterpret_cast<double *>(smem + lay.delta); /* [S][K] */
    bf *sQah = reinterpret_cast<bf *>(smem + lay.qah), *sQal = reinterpret_cast<bf *>(smem + lay.qal);
    bf *sKqh = reinterpret_cast<bf *>(smem + lay.kqh), *sKql = reinterpret_cast<bf *>(smem + lay.kql);
    bf *sSlot = reinterpret_cast<bf *>(smem + lay.slot);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ci = blockIdx.x, hv = blockIdx.y;
    const int h = hv / (HV / H);
    const int t0 = (p.c0 + ci) * C;
    const int L = p.T - t0 < C ? p.T - t0 : C;
    const ws_layout wl = prefill_ws_layout(K, V);
    float *ws = p.ws + ((size_t)ci * HV + hv) * p.ws_stride;
    const T *q = static_cast<const T *>(p.q), *k = static_cast<const T *>(p.k);
    const T *v = static_cast<const T *>(p.v);
    const float A_log = p.raw ? p.A_log[hv] : 0.0f;

    /* 1. beta; row scales of q, k (raw: 1 / sqrt(|x|^2 + 1e-6), as the fp32
     *    kernel); A_qk above the diagonal; per-block sums of g */
    for (int r = tid; r < C; r += NT) {
        float b = 0.0f;
        if (r < L) {
            const size_t bi = (size_t)(t0 + r) * HV + hv;
            b = p.raw ? sigmoid(In::ld(static_cast<const T *>(p.beta), bi))
                      : static_cast<const float *>(p.beta)[bi];
        }
        sBeta[r] = b;
    }
    if (p.raw) {
        for (int row = warp; row < 2 * C; row += NW) {
            const int r = row % C;
            const T *x = row < C ? q : k;
            float ss = 0.0f;
            if (r < L)
                for (int d = lane; d < K; d += 32) {
                    const float xv = In::ld(x, ((size_t)(t0 + r) * H + h) * K + d);
                    ss = fmaf(xv, xv, ss);
                }
            ss = warp_sum(ss);
            if (lane == 0) sRn[row] = (float)(1.0 / sqrt((double)ss + 1e-6));
        }
    } else {
        for (int i = tid; i < 2 * C; i += NT) sRn[i] = 1.0f;
    }
    for (int i = tid; i < C * C; i += NT)
        if (i % C > i / C) ws[wl.aqk + i] = 0.0f;
    for (int j = tid; j < NB * K; j += NT) {
        const int b = j / K, d = j - b * K;
        double s = 0.0;
        for (int i = 0; i < S; i++) s += (double)prefill_g<In>(p, t0, L, hv, b * S + i, d, A_log);
        sAnc[(b + 1) * K + d] = s;
    }
    __syncthreads();
    /* 2. anchors B_b (double) and e^{Gamma_last} */
    for (int d = tid; d < K; d += NT) {
        double acc = 0.0;
        sAnc[d] = 0.0;
        for (int b = 1; b <= NB; b++) {
            acc += sAnc[b * K + d];
            sAnc[b * K + d] = acc;
        }
        ws[wl.eg + d] = expf((float)acc);
    }
    __syncthreads();

    /* 3. block by block */
    const int wd = tid % K, wp = tid / K; /* walk: channel, part of the rows */
    for (int b = 0; b < NB; b++) {
        const int n0 = b * S;
        float gr[RP];
        double ps = 0.0;
#pragma unroll
        for (int i = 0; i < RP; i++) {
            gr[i] = prefill_g<In>(p, t0, L, hv, n0 + wp * RP + i, wd, A_log);
            ps += (double)gr[i];
        }
        sPart[tid] = ps;
        __syncthreads(); /* also: the previous block's products are done */
        double dl = 0.0;
        for (int pp = 0; pp < wp; pp++) dl += sPart[pp * K + wd];
        const double Bb = sAnc[b * K + wd], Bl = sAnc[NB * K + wd];
#pragma unroll
        for (int i = 0; i < RP; i++) {
            const int ri = wp * RP + i, r = n0 + ri;
            dl += (double)gr[i];
            float qv = 0.0f, kv = 0.0f;
            if (r < L) {
                const size_t qi = ((size_t)(t0 + r) * H + h) * K + wd;
                qv = In::ld(q, qi) * sRn[r];
                kv = In::ld(k, qi) * sRn[C + r];
            }
            sDelta[ri * K + wd] = dl;
            sKb[ri * K + wd] = kv;
            const float e = expf((float)dl);
            split_bf16(qv * e, &sQah[ri * ldk + wd], &sQal[ri * ldk + wd]);
            split_bf16(kv * e, &sKqh[ri * ldk + wd], &sKql[ri * ldk + wd]);
            const float eg = expf((float)(Bb + dl));
            const size_t o = (size_t)r * K + wd;
            ws[wl.qt + o] = p.scale * qv * eg;
            ws[wl.w + o] = sBeta[r] * (kv * eg); /* beta K~, until W replaces it */
            ws[wl.kb + o] = kv * expf((float)((Bl - Bb) - dl));
            for (int b2 = b + 1; b2 < NB; b2++) {
                const float x = kv * expf((float)((sAnc[b2 * K + wd] - Bb) - dl));
                bf *rh = sSlot + (size_t)intra_tc_slot(b2, b) * 2 * S * ldk;
                split_bf16(x, &rh[ri * ldk + wd], &rh[S * ldk + ri * ldk + wd]);
            }
        }
        __syncthreads();

        /* diagonal block: warp w does rows w and 15 - w (17 pairs) */
        for (int half = 0; half < 2; half++) {
            const int i = half == 0 ? warp : S - 1 - warp, r = n0 + i;
            float qr[KU], kr[KU];
            double dr[KU];
#pragma unroll
            for (int u = 0; u < KU; u++) {
                const int d = lane + 32 * u;
                const bool ok = d < K;
                qr[u] = ok && r < L ? In::ld(q, ((size_t)(t0 + r) * H + h) * K + d) * sRn[r] : 0.0f;
                kr[u] = ok ? sKb[i * K + d] : 0.0f;
                dr[u] = ok ? sDelta[i * K + d] : 0.0;
            }
            for (int j = 0; j <= i; j++) {
                float aq = 0.0f, ak = 0.0f;
#pragma unroll
                for (int u = 0; u < KU; u++) {
                    const int d = lane + 32 * u;
                    if (d < K) {
                        const float e = j == i ? 1.0f : expf((float)(dr[u] - sDelta[j * K + d]));
                        const float kc = sKb[j * K + d] * e;
                        aq = fmaf(qr[u], kc, aq);
                        ak = fmaf(kr[u], kc, ak);
                    }
                }
                aq = warp_sum(aq);
                ak = warp_sum(ak);
                if (lane == 0) {
                    ws[wl.aqk + (size_t)r * C + n0 + j] = p.scale * aq;
                    if (j < i) sA[r * lda + n0 + j] = sBeta[r] * ak;
                }
            }
        }
        /* off the diagonal: block (b, m), m < b, on tensor cores (warp m) */
        if (warp < b) {
            const int m = warp;
            const bf *rh = sSlot + (size_t)intra_tc_slot(b, m) * 2 * S * ldk, *rl = rh + S * ldk;
            frag_c aq, ak;
            wm::fill_fragment(aq, 0.0f);
            wm::fill_fragment(ak, 0.0f);
#pragma unroll 2
            for (int kk = 0; kk < K; kk += 16) {
                frag_bt bh, bl; /* R^T: element (d, j) is R[j][d] */
                frag_a ah, al;
                wm::load_matrix_sync(bh, rh + kk, ldk);
                wm::load_matrix_sync(bl, rl + kk, ldk);
                wm::load_matrix_sync(ah, sQah + kk, ldk);
                wm::load_matrix_sync(al, sQal + kk, ldk);
                wm::mma_sync(aq, ah, bh, aq);
                wm::mma_sync(aq, ah, bl, aq);
                wm::mma_sync(aq, al, bh, aq);
                wm::load_matrix_sync(ah, sKqh + kk, ldk);
                wm::load_matrix_sync(al, sKql + kk, ldk);
                wm::mma_sync(ak, ah, bh, ak);
                wm::mma_sync(ak, ah, bl, ak);
                wm::mma_sync(ak, al, bh, ak);
            }
            float *sa_t = sA + n0 * lda + S * m;
            float *stg = sStgA + warp * 256;
            wm::store_matrix_sync(sa_t, ak, lda, wm::mem_row_major);
            wm::store_matrix_sync(stg, aq, 16, wm::mem_row_major);
            __syncwarp();
            for (int e = lane; e < 256; e += 32) {
                const int i = e >> 4, j = e & 15, r = n0 + i;
                sa_t[i * lda + j] *= sBeta[r];
                ws[wl.aqk + (size_t)r * C + S * m + j] = p.scale * stg[e];
            }
        }
    }
    __syncthreads(); /* the blocks' arrays are dead from here: the solve's alias them */

    /* 4. T = (I + A_kk)^-1, fp32; diagonal blocks first, a thread per column */
    float *sT = reinterpret_cast<float *>(smem + lay.t); /* [C][lda], lower blocks */
    float *sZ = reinterpret_cast<float *>(smem + lay.z);
    bf *sTh = reinterpret_cast<bf *>(smem + lay.th), *sTl = reinterpret_cast<bf *>(smem + lay.tl);
    bf *sRh = reinterpret_cast<bf *>(smem + lay.rh), *sRl = reinterpret_cast<bf *>(smem + lay.rl);
    float *sStg = reinterpret_cast<float *>(smem + lay.stg);
    if (tid < C) {
        const int n0 = (tid / S) * S, j = tid % S;
        for (int i = 0; i < S; i++) {
            float t = i == j ? 1.0f : 0.0f;
            if (i > j) {
                float s = 0.0f;
                for (int l = j; l < i; l++) s = fmaf(sA[(n0 + i) * lda + n0 + l], sT[(n0 + l) * lda + n0 + j], s);
                t = -s;
            }
            sT[(n0 + i) * lda + n0 + j] = t;
        }
    }
    __syncthreads();
    /* the blocks below the diagonal, by distance: T_ij = -T_ii Z,
     * Z = sum_{j <= l < i} A_il T_lj (T_jj lower triangular) */
    for (int lev = 1; lev < NB; lev++) {
        const int np = NB - lev;
        for (int e = tid; e < np * 256; e += NT) {
            const int bj = e >> 8, bi = bj + lev, x = (e >> 4) & 15, y = e & 15;
            const float *arow = sA + (bi * S + x) * lda;
            float s = 0.0f;
            for (int c = bj * S + y; c < bi * S; c++) s = fmaf(arow[c], sT[c * lda + bj * S + y], s);
            sZ[e] = s;
        }
        __syncthreads();
        for (int e = tid; e < np * 256; e += NT) {
            const int bj = e >> 8, bi = bj + lev, x = (e >> 4) & 15, y = e & 15;
            const float *trow = sT + (bi * S + x) * lda + bi * S;
            float s = 0.0f;
            for (int z = 0; z <= x; z++) s = fmaf(trow[z], sZ[(bj << 8) + z * 16 + y], s);
            sT[(bi * S + x) * lda + bj * S + y] = -s;
        }
        __syncthreads();
    }
    for (int e = tid; e < C * C; e += NT) {
        const int r = e / C, c = e - r * C;
        if (c / S <= r / S) split_bf16(sT[r * lda + c], &sTh[r * ldt + c], &sTl[r * ldt + c]);
    }

    /* 5. W = T (beta K~), then U = T (beta V): right-hand sides split into
     *    shared memory, 16 x 16 output tiles over the warps */
    for (int pass = 0; pass < 2; pass++) {
        const int N = pass == 0 ? K : V, N16 = (N + 15) & ~15, nc = N16 / 16;
        for (int e = tid; e < C * N16; e += NT) {
            const int r = e / N16, c = e - r * N16;
            float x = 0.0f;
            if (c < N) {
                if (pass == 0)
                    x = ws[wl.w + (size_t)r * K + c];
                else if (r < L)
                    x = sBeta[r] * In::ld(v, ((size_t)(t0 + r) * HV + hv) * V + c);
            }
            split_bf16(x, &sRh[r * ldr + c], &sRl[r * ldr + c]);
        }
        __syncthreads(); /* the right-hand sides (and T's split) */
        float *dst = ws + (pass == 0 ? wl.w : wl.u);
        float *stg = sStg + warp * 256;
        for (int tile = warp; tile < NB * nc; tile += NW) {
            const int bi = tile / nc, c = tile - bi * nc;
            frag_c acc;
            wm::fill_fragment(acc, 0.0f);
            for (int bj = 0; bj <= bi; bj++) {
                frag_a ah, al;
                frag_b bh, bl;
                wm::load_matrix_sync(ah, sTh + bi * S * ldt + bj * S, ldt);
                wm::load_matrix_sync(al, sTl + bi * S * ldt + bj * S, ldt);
                wm::load_matrix_sync(bh, sRh + bj * S * ldr + 16 * c, ldr);
                wm::load_matrix_sync(bl, sRl + bj * S * ldr + 16 * c, ldr);
                wm::mma_sync(acc, ah, bh, acc);
                wm::mma_sync(acc, ah, bl, acc);
                wm::mma_sync(acc, al, bh, acc);
            }
            wm::store_matrix_sync(stg, acc, 16, wm::mem_row_major);
            __syncwarp();
            for (int e = lane; e < 256; e += 32) {
                const int x = e >> 4, col = 16 * c + (e & 15);
                if (col < N) dst[(size_t)(bi * S + x) * N + col] = stg[e];
            }
            __syncwarp(); /* before the next tile's store */
        }
        __syncthreads(); /* before the right-hand sides are replaced */
    }
}

/* ---- state pass ------------------------------------------------------------ */

/* n floats from global to shared memory, float4 at a time (both 16-byte
 * aligned, n % 4 == 0), by all NT threads. */
template <int NT>
__device__ __forceinline__ void copy_f4(float *dst, const float *src, int n, int tid) {
    const float4 *s4 = reinterpret_cast<const float4 *>(src);
    float4 *d4 = reinterpret_cast<float4 *>(dst);
#pragma unroll 8
    for (int i = tid; i < n / 4; i += NT) d4[i] = s4[i];
}

/*
 * Ask L2 for the next chunk's workspace block [p, p + bytes) while this
 * chunk computes: the state pass is one CTA per SM walking the chunks in
 * turn, so each chunk's ~110 KiB of loads from HBM (the intra kernel wrote
 * them a pass ago, long out of L2) would otherwise wait on DRAM latency a
 * few loads at a time (ncu on an H200: ~16 µs a chunk, 7% of DRAM
 * bandwidth). A hint only: no result depends on it; nothing under the
 * emulation.
 */
template <int NT>
__device__ __forceinline__ void prefetch_l2(const float *p, size_t bytes, int tid) {
#ifndef KDS_EMU
    const char *c = reinterpret_cast<const char *>(p);
    for (size_t o = (size_t)tid * 128; o < bytes; o += (size_t)NT * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(c + o));
#else
    (void)p, (void)bytes, (void)tid;
#endif
}

/*
 * grid (ceil(V / 32), HV), kStateThreads threads, state_smem_layout(K)
 * .total_bytes of dynamic shared memory. Sequential over the pass's chunks.
 * Thread (warp w, lane l) works on value column vt*32 + l:
 *   nu, O: rows w*8 .. w*8+7 of the chunk (8 warps x 8 rows = C);
 *   S:     key rows w*KR .. w*KR+KR-1, KR = K / 8.
 * The state tile lives in shared memory for the whole pass and is read from
 * and written to `state` once.
 */
template <int K>
__global__ void __launch_bounds__(kStateThreads) prefill_state_kernel(const prefill_params p) {
    KDS_DYN_SMEM(smem);
    constexpr int C = kChunk, BV = kStateBV, NT = kStateThreads, NW = NT / 32;
    constexpr int RPW = C / NW; /* nu / O rows per warp */
    constexpr int KR = K / NW;  /* state rows per warp */
    static_assert(C % NW == 0 && K % NW == 0 && K % 4 == 0, "state kernel shape");
    const int V = p.V, HV = p.HV;
    const int vt = blockIdx.x, hv = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int col = vt * BV + lane;
    const bool col_ok = col < V;
    const state_smem lay = state_smem_layout(K);
    float *fs = reinterpret_cast<float *>(smem);
    float *sW = fs + lay.w, *sQt = fs + lay.qt, *sKb = fs + lay.kb, *sAqk = fs + lay.aqk;
    float *sU = fs + lay.u, *sNu = fs + lay.nu, *sS = fs + lay.s, *sEg = fs + lay.eg;
    const ws_layout wl = prefill_ws_layout(K, V);
    float *state = p.state + (size_t)hv * K * V;

    for (int d = warp; d < K; d += NW) sS[d * BV + lane] = col_ok ? state[(size_t)d * V + col] : 0.0f;

    for (int ci = 0; ci < p.n_chunks; ci++) {
        const float *ws = p.ws + ((size_t)ci * HV + hv) * p.ws_stride;
        const int t0 = (p.c0 + ci) * C;
        const int L = p.T - t0 < C ? p.T - t0 : C;
        copy_f4<NT>(sAqk, ws + wl.aqk, C * C, tid);
        copy_f4<NT>(sQt, ws + wl.qt, C * K, tid);
        copy_f4<NT>(sKb, ws + wl.kb, C * K, tid);
        copy_f4<NT>(sW, ws + wl.w, C * K, tid);
        for (int i = tid; i < C * BV; i += NT) {
            const int r = i / BV, c = vt * BV + (i - r * BV);
            sU[i] = c < V ? ws[wl.u + (size_t)r * V + c] : 0.0f;
        }
        for (int d = tid; d < K; d += NT) sEg[d] = ws[wl.eg + d];
        __syncthreads(); /* also: the state tile of the previous chunk is written */
        if (ci + 1 < p.n_chunks) prefetch_l2<NT>(ws + (size_t)HV * p.ws_stride, p.ws_stride * 4, tid);

        /* nu = U - W S and O' = Qt S over the warp's RPW rows */
        float nu[RPW], oo[RPW];
#pragma unroll
        for (int i = 0; i < RPW; i++) nu[i] = oo[i] = 0.0f;
        const int r0 = warp * RPW;
#pragma unroll 2
        for (int d = 0; d < K; d += 4) {
            const float s0 = sS[(d + 0) * BV + lane], s1 = sS[(d + 1) * BV + lane];
            const float s2 = sS[(d + 2) * BV + lane], s3 = sS[(d + 3) * BV + lane];
#pragma unroll
            for (int i = 0; i < RPW; i++) {
                const float4 w = *reinterpret_cast<const float4 *>(sW + (r0 + i) * K + d);
                const float4 qt = *reinterpret_cast<const float4 *>(sQt + (r0 + i) * K + d);
                nu[i] = fmaf(w.x, s0, nu[i]);
                nu[i] = fmaf(w.y, s1, nu[i]);
                nu[i] = fmaf(w.z, s2, nu[i]);
                nu[i] = fmaf(w.w, s3, nu[i]);
                oo[i] = fmaf(qt.x, s0, oo[i]);
                oo[i] = fmaf(qt.y, s1, oo[i]);
                oo[i] = fmaf(qt.z, s2, oo[i]);
                oo[i] = fmaf(qt.w, s3, oo[i]);
            }
        }
#pragma unroll
        for (int i = 0; i < RPW; i++) sNu[(r0 + i) * BV + lane] = sU[(r0 + i) * BV + lane] - nu[i];
        __syncthreads();

        /* O = O' + A_qk nu (A_qk is 0 above the diagonal: j <= r0 + RPW - 1) */
        for (int j = 0; j < r0 + RPW; j++) {
            const float n = sNu[j * BV + lane];
#pragma unroll
            for (int i = 0; i < RPW; i++) oo[i] = fmaf(sAqk[(r0 + i) * C + j], n, oo[i]);
        }
        if (col_ok) {
#pragma unroll
            for (int i = 0; i < RPW; i++)
                if (r0 + i < L) p.o[((size_t)(t0 + r0 + i) * HV + hv) * V + col] = oo[i];
        }

        /* S = diag(eG) S + Kb^T nu over the warp's KR key rows */
        float acc[KR];
        const int d0 = warp * KR;
#pragma unroll
        for (int i = 0; i < KR; i++) acc[i] = sEg[d0 + i] * sS[(d0 + i) * BV + lane];
#pragma unroll 4
        for (int r = 0; r < C; r++) {
            const float n = sNu[r * BV + lane];
#pragma unroll
            for (int i = 0; i < KR; i++) acc[i] = fmaf(sKb[r * K + d0 + i], n, acc[i]);
        }
#pragma unroll
        for (int i = 0; i < KR; i++) sS[(d0 + i) * BV + lane] = acc[i];
        __syncthreads(); /* before the next chunk overwrites the chunk buffers */
    }

    if (col_ok)
        for (int d = warp; d < K; d += NW) state[(size_t)d * V + col] = sS[d * BV + lane];
}

/* ---- state pass on tensor cores ------------------------------------------------ */

/*
 * The state pass with its four products on tensor cores (WMMA 16x16x16,
 * bf16 operands, fp32 accumulation), each operand split as x = hi + lo with
 * hi = bf16(x), lo = bf16(x - hi), and each product formed as
 * hi*hi + hi*lo + lo*hi: about 16 bits of mantissa per operand, so the
 * result stays within ~1e-5 of the fp32 one (the lo*lo term and the
 * residuals are below 2^-16 relative). Same grid and results as
 * prefill_state_kernel; K a multiple of 16.
 *
 * Warp w (8 warps) owns output tile (rows 16 (w / 2), columns 16 (w % 2)) of
 * nu [C, 32] and O [C, 32], and the state tiles w, w + 8, ... of the
 * K/16 x 2 tiles of S [K, 32]. Shared arrays are padded (bf16 rows by 8,
 * fp32 rows by 4) so that a tile's 16 rows fall in different banks.
 */
struct state_tc_smem {
    size_t wh, wl, qh, ql, kh, kl, ah, al, sh, sl, nh, nl; /* bf16 arrays */
    size_t u, s, nu, o, eg;                                /* fp32 arrays */
    size_t total_bytes;
    int ldk, ldc, ldv, ldf; /* leading dims: [*, K], [*, C], bf16 [*, 32], fp32 [*, 32] */
};
__host__ __device__ inline state_tc_smem state_tc_smem_layout(int K) {
    const size_t C = kChunk;
    state_tc_smem s;
    s.ldk = K + 8;
    s.ldc = kChunk + 8;
    s.ldv = kStateBV + 8;
    s.ldf = kStateBV + 4;
    size_t off = 0;
    /* every array starts on 128 bytes (WMMA needs 32-byte aligned tiles) */
#define KDS_TC_ALLOC(field, bytes)                                                             \
    s.field = off;                                                                             \
    off = (off + (size_t)(bytes) + 127) & ~(size_t)127
    KDS_TC_ALLOC(wh, C * s.ldk * 2);
    KDS_TC_ALLOC(wl, C * s.ldk * 2);
    KDS_TC_ALLOC(qh, C * s.ldk * 2);
    KDS_TC_ALLOC(ql, C * s.ldk * 2);
    KDS_TC_ALLOC(kh, C * s.ldk * 2);
    KDS_TC_ALLOC(kl, C * s.ldk * 2);
    KDS_TC_ALLOC(ah, C * s.ldc * 2);
    KDS_TC_ALLOC(al, C * s.ldc * 2);
    KDS_TC_ALLOC(sh, (size_t)K * s.ldv * 2);
    KDS_TC_ALLOC(sl, (size_t)K * s.ldv * 2);
    KDS_TC_ALLOC(nh, C * s.ldv * 2);
    KDS_TC_ALLOC(nl, C * s.ldv * 2);
    KDS_TC_ALLOC(u, C * s.ldf * 4);
    KDS_TC_ALLOC(s, (size_t)K * s.ldf * 4);
    KDS_TC_ALLOC(nu, C * s.ldf * 4);
    KDS_TC_ALLOC(o, C * s.ldf * 4);
    KDS_TC_ALLOC(eg, (size_t)K * 4);
#undef KDS_TC_ALLOC
    s.total_bytes = off;
    return s;
}

template <int K>
__global__ void __launch_bounds__(kStateThreads) prefill_state_tc_kernel(const prefill_params p) {
    namespace wm = nvcuda::wmma;
    typedef __nv_bfloat16 bf;
    typedef wm::fragment<wm::matrix_a, 16, 16, 16, bf, wm::row_major> frag_a;
    typedef wm::fragment<wm::matrix_a, 16, 16, 16, bf, wm::col_major> frag_at;
    typedef wm::fragment<wm::matrix_b, 16, 16, 16, bf, wm::row_major> frag_b;
    typedef wm::fragment<wm::accumulator, 16, 16, 16, float> frag_c;
    KDS_DYN_SMEM(smem);
    constexpr int C = kChunk, BV = kStateBV, NT = kStateThreads, NW = NT / 32;
    static_assert(K % 16 == 0 && BV == 32 && C == 64 && NW == 8, "tensor-core state pass shape");
    const int V = p.V, HV = p.HV;
    const int vt = blockIdx.x, hv = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const state_tc_smem lay = state_tc_smem_layout(K);
    const int ldk = lay.ldk, ldc = lay.ldc, ldv = lay.ldv, ldf = lay.ldf;
    bf *sWh = reinterpret_cast<bf *>(smem + lay.wh), *sWl = reinterpret_cast<bf *>(smem + lay.wl);
    bf *sQh = reinterpret_cast<bf *>(smem + lay.qh), *sQl = reinterpret_cast<bf *>(smem + lay.ql);
    bf *sKh = reinterpret_cast<bf *>(smem + lay.kh), *sKl = reinterpret_cast<bf *>(smem + lay.kl);
    bf *sAh = reinterpret_cast<bf *>(smem + lay.ah), *sAl = reinterpret_cast<bf *>(smem + lay.al);
    bf *sSh = reinterpret_cast<bf *>(smem + lay.sh), *sSl = reinterpret_cast<bf *>(smem + lay.sl);
    bf *sNh = reinterpret_cast<bf *>(smem + lay.nh), *sNl = reinterpret_cast<bf *>(smem + lay.nl);
    float *sU = reinterpret_cast<float *>(smem + lay.u), *sS = reinterpret_cast<float *>(smem + lay.s);
    float *sNu = reinterpret_cast<float *>(smem + lay.nu), *sO = reinterpret_cast<float *>(smem + lay.o);
    float *sEg = reinterpret_cast<float *>(smem + lay.eg);
    const ws_layout wl = prefill_ws_layout(K, V);
    float *state = p.state + (size_t)hv * K * V;

    for (int i = tid; i < K * BV; i += NT) {
        const int d = i / BV, c = i - d * BV, col = vt * BV + c;
        sS[d * ldf + c] = col < V ? state[(size_t)d * V + col] : 0.0f;
    }
    const int rt = warp >> 1, ct = warp & 1; /* this warp's nu / O tile */

    for (int ci = 0; ci < p.n_chunks; ci++) {
        const float *ws = p.ws + ((size_t)ci * HV + hv) * p.ws_stride;
        const int t0 = (p.c0 + ci) * C;
        const int L = p.T - t0 < C ? p.T - t0 : C;
        /* the chunk's blocks, split into bf16 hi + lo */
        for (int i = tid; i < C * K; i += NT) {
            const int r = i / K, d = i - r * K, o = r * ldk + d;
            split_bf16(ws[wl.w + i], &sWh[o], &sWl[o]);
            split_bf16(ws[wl.qt + i], &sQh[o], &sQl[o]);
            split_bf16(ws[wl.kb + i], &sKh[o], &sKl[o]);
        }
        for (int i = tid; i < C * C; i += NT) {
            const int r = i / C, j = i - r * C;
            split_bf16(ws[wl.aqk + i], &sAh[r * ldc + j], &sAl[r * ldc + j]);
        }
        for (int i = tid; i < C * BV; i += NT) {
            const int r = i / BV, c = i - r * BV, col = vt * BV + c;
            sU[r * ldf + c] = col < V ? ws[wl.u + (size_t)r * V + col] : 0.0f;
        }
        for (int d = tid; d < K; d += NT) sEg[d] = ws[wl.eg + d];
        __syncthreads(); /* sEg, and the previous chunk's state tiles */
        if (ci + 1 < p.n_chunks) prefetch_l2<NT>(ws + (size_t)HV * p.ws_stride, p.ws_stride * 4, tid);
        /* the state entering the chunk, split; then S <- diag(eG) S in place
         * (the accumulator start of the update) */
        for (int i = tid; i < K * BV; i += NT) {
            const int d = i / BV, c = i - d * BV;
            const float x = sS[d * ldf + c];
            split_bf16(x, &sSh[d * ldv + c], &sSl[d * ldv + c]);
            sS[d * ldf + c] = sEg[d] * x;
        }
        __syncthreads();

        /* nu' = W S and O' = Qt S for this warp's tile */
        frag_c acc_nu, acc_o;
        wm::fill_fragment(acc_nu, 0.0f);
        wm::fill_fragment(acc_o, 0.0f);
#pragma unroll 2
        for (int kk = 0; kk < K; kk += 16) {
            frag_a ah, al;
            frag_b bh, bl;
            wm::load_matrix_sync(bh, sSh + kk * ldv + 16 * ct, ldv);
            wm::load_matrix_sync(bl, sSl + kk * ldv + 16 * ct, ldv);
            wm::load_matrix_sync(ah, sWh + 16 * rt * ldk + kk, ldk);
            wm::load_matrix_sync(al, sWl + 16 * rt * ldk + kk, ldk);
            wm::mma_sync(acc_nu, ah, bh, acc_nu);
            wm::mma_sync(acc_nu, ah, bl, acc_nu);
            wm::mma_sync(acc_nu, al, bh, acc_nu);
            wm::load_matrix_sync(ah, sQh + 16 * rt * ldk + kk, ldk);
            wm::load_matrix_sync(al, sQl + 16 * rt * ldk + kk, ldk);
            wm::mma_sync(acc_o, ah, bh, acc_o);
            wm::mma_sync(acc_o, ah, bl, acc_o);
            wm::mma_sync(acc_o, al, bh, acc_o);
        }
        /* nu = U - nu', split for the next products */
        float *nu_t = sNu + 16 * rt * ldf + 16 * ct;
        wm::store_matrix_sync(nu_t, acc_nu, ldf, wm::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 256; e += 32) {
            const int r = 16 * rt + e / 16, c = 16 * ct + e % 16;
            const float n = sU[r * ldf + c] - sNu[r * ldf + c];
            sNu[r * ldf + c] = n;
            split_bf16(n, &sNh[r * ldv + c], &sNl[r * ldv + c]);
        }
        __syncthreads(); /* all of nu */

        /* O = O' + A_qk nu (A_qk's blocks above the diagonal are 0) */
        for (int jb = 0; jb <= rt; jb++) {
            frag_a ah, al;
            frag_b bh, bl;
            wm::load_matrix_sync(ah, sAh + 16 * rt * ldc + 16 * jb, ldc);
            wm::load_matrix_sync(al, sAl + 16 * rt * ldc + 16 * jb, ldc);
            wm::load_matrix_sync(bh, sNh + 16 * jb * ldv + 16 * ct, ldv);
            wm::load_matrix_sync(bl, sNl + 16 * jb * ldv + 16 * ct, ldv);
            wm::mma_sync(acc_o, ah, bh, acc_o);
            wm::mma_sync(acc_o, ah, bl, acc_o);
            wm::mma_sync(acc_o, al, bh, acc_o);
        }
        float *o_t = sO + 16 * rt * ldf + 16 * ct;
        wm::store_matrix_sync(o_t, acc_o, ldf, wm::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 256; e += 32) {
            const int r = 16 * rt + e / 16, c = 16 * ct + e % 16, col = vt * BV + c;
            if (r < L && col < V) p.o[((size_t)(t0 + r) * HV + hv) * V + col] = sO[r * ldf + c];
        }

        /* S = diag(eG) S + Kb^T nu, tile by tile */
        for (int tile = warp; tile < (K / 16) * 2; tile += NW) {
            const int dt = tile >> 1, sc = tile & 1;
            float *s_t = sS + 16 * dt * ldf + 16 * sc;
            frag_c acc;
            wm::load_matrix_sync(acc, s_t, ldf, wm::mem_row_major);
#pragma unroll
            for (int jb = 0; jb < C; jb += 16) {
                frag_at ah, al;
                frag_b bh, bl;
                /* Kb^T [K, C]: element (d, r) is Kb[r][d], a column-major view */
                wm::load_matrix_sync(ah, sKh + jb * ldk + 16 * dt, ldk);
                wm::load_matrix_sync(al, sKl + jb * ldk + 16 * dt, ldk);
                wm::load_matrix_sync(bh, sNh + jb * ldv + 16 * sc, ldv);
                wm::load_matrix_sync(bl, sNl + jb * ldv + 16 * sc, ldv);
                wm::mma_sync(acc, ah, bh, acc);
                wm::mma_sync(acc, ah, bl, acc);
                wm::mma_sync(acc, al, bh, acc);
            }
            wm::store_matrix_sync(s_t, acc, ldf, wm::mem_row_major);
        }
        __syncthreads(); /* before the next chunk overwrites the blocks */
    }

    for (int i = tid; i < K * BV; i += NT) {
        const int d = i / BV, c = i - d * BV, col = vt * BV + c;
        if (col < V) state[(size_t)d * V + col] = sS[d * ldf + c];
    }
}

} /* namespace kda */

#endif /* KDA_PREFILL_CUH */
