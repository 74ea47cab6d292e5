/*
 * kda.c - CPU reference of the KDA (Kimi Delta Attention) core: the decay
 * gate, the token-by-token delta rule (decode) and its chunked WY/UT form
 * (prefill). Contracts in kernels/kern.h; math in
 * shared/reference/kda-model-spec.md §3.3-3.5 and §4.1.
 *
 * Layouts (one sequence, row-major):
 *   q, k: [T, H, K]   v, o: [T, HV, V]   g: [T, HV, K]   beta: [T, HV]
 *   state: [HV, K, V] (fla's default: row = key dim d, column = value dim j)
 * Value head hv reads q/k head hv / (HV / H) (GVA).
 *
 * Numerics. Every exponential here has an argument <= 0: a log-decay, or a
 * difference Gamma_r - Gamma_j of chunk-local cumulative log-decays with
 * j <= r. Nothing is ever scaled by exp(+Gamma), which overflows float as
 * soon as a chunk decays by more than e^-88 (one token of a strong head
 * can decay by e^-1000). The cumulative sums are kept in double: with strong
 * decay Gamma reaches -1e5 inside a chunk, where a float has an ulp of 1e-2,
 * and exp(Gamma_r - Gamma_j) of two such floats would be off by percent even
 * when the true difference is tiny. Each difference is formed in double and
 * only then rounded to float, so every decay factor is within a few ulp of
 * what the token-by-token recurrence applies. The intra-chunk matrices use
 * running products of per-token decays instead (see intra_chunk), which
 * round like the recurrence itself.
 *
 * Vectorisation. The build is ISO C11 without -ffast-math, so the compiler
 * neither contracts a*b+c into an FMA nor reorders a float sum: hot loops
 * call fmaf() explicitly and accumulate in LANES independent partial sums
 * that the vectoriser maps onto SIMD registers. exp() goes through vexp(),
 * a branch-free polynomial that vectorises (libm's expf does not, here).
 */
#include "kern.h"
#include "kern_gemm.h"
#include "kern_math.h"

#include <cblas.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Inlined into every caller even when large: the callers pass constant
 * tile widths that turn the inner loops into whole registers. */
#define FORCE_INLINE inline __attribute__((always_inline))

/* Partial sums per dot product: one AVX-512 register of floats. */
#define LANES 16

/* Value-dim tile of the recurrent step: 128 columns (8 AVX-512 registers
 * of accumulators per pass) measured fastest for K = V = 128, about 25%
 * ahead of 64 columns and 2x ahead of 32. */
#define RT_V 128
/* Key rows whose decay factors are computed in one vectorised batch. */
#define RT_K 64

/* Below this many multiply-adds a product runs in plain loops: a GEMM or
 * BLAS call's overhead would dominate (tiny heads of the test files). */
#define BLAS_MIN_MACS (32 * 32 * 32)

/* ------------------------------------------------------------------------ */
/* Vectorisable math                                                         */

/*
 * log(1 + y) for y in [0, 1], branch-free. u = 1 + y is in [1, 2]; written
 * m 2^e with m in [sqrt(1/2), sqrt(2)), Cephes' logf polynomial gives
 * log(m), and (y - (u - 1)) / u adds back what rounding 1 + y lost (exact
 * for tiny y, where u == 1). Within 1.2 ulp of log1p on [0, 1]; the
 * softplus below is within 2 ulp of log1p(e^x), the sigmoid within 2.5 ulp.
 */
static inline float log1p_unit(float y) {
    float u = 1.0f + y;
    float e = u > 1.41421356f ? 1.0f : 0.0f;
    float f = (e > 0.0f ? 0.5f * u : u) - 1.0f;
    float z = f * f;
    float p = 7.0376836292e-2f;
    p = fmaf(p, f, -1.1514610310e-1f);
    p = fmaf(p, f, 1.1676998740e-1f);
    p = fmaf(p, f, -1.2420140846e-1f);
    p = fmaf(p, f, 1.4249322787e-1f);
    p = fmaf(p, f, -1.6668057665e-1f);
    p = fmaf(p, f, 2.0000714765e-1f);
    p = fmaf(p, f, -2.4999993993e-1f);
    p = fmaf(p, f, 3.3333331174e-1f);
    float r = f * z * p;
    r = fmaf(e, -2.12194440e-4f, r);
    r = fmaf(-0.5f, z, r);
    r = fmaf(e, 0.693359375f, f + r);
    return r + (y - (u - 1.0f)) / u;
}

/* PyTorch's softplus (beta 1, threshold 20): x > 20 ? x : log1p(e^x),
 * evaluated as max(x, 0) + log1p(e^-|x|) so that e^x never overflows. */
static inline float softplus(float x) {
    float sp = (x > 0.0f ? x : 0.0f) + log1p_unit(vexp(-fabsf(x)));
    return x > 20.0f ? x : sp;
}


/* ------------------------------------------------------------------------ */
/* Gate                                                                      */

/* One [K] row of the gate; b is dt_bias's row (NULL: none). The softplus and
 * sigmoid are the vectorisable ones above: libm's log1pf and expf made this
 * cost twice the recurrent step per decode token. */
static void gate_row(const float *x, const float *b, int K, float a, float lower_bound, float *g) {
    if (lower_bound >= 0.0f) {
        /* Kimi-Linear's unbounded gate: g = -e^A softplus(f + b) */
        if (b)
            for (int d = 0; d < K; d++)
                g[d] = -a * softplus(x[d] + b[d]);
        else
            for (int d = 0; d < K; d++)
                g[d] = -a * softplus(x[d]);
    } else {
        /* fla's lower-bound gate: g = lb sigmoid(e^A (f + b)), in (lb, 0) */
        if (b)
            for (int d = 0; d < K; d++)
                g[d] = lower_bound * vsigmoid(a * (x[d] + b[d]));
        else
            for (int d = 0; d < K; d++)
                g[d] = lower_bound * vsigmoid(a * x[d]);
    }
}

void kern_kda_gate(const float *g_raw, const float *A_log, const float *dt_bias, int T, int HV,
                   int K, float lower_bound, float *g) {
    for (int t = 0; t < T; t++)
        for (int hv = 0; hv < HV; hv++) {
            size_t off = ((size_t)t * HV + hv) * K;
            gate_row(g_raw + off, dt_bias ? dt_bias + (size_t)hv * K : NULL, K, expf(A_log[hv]),
                     lower_bound, g + off);
        }
}

/* ------------------------------------------------------------------------ */
/* Recurrent (decode) path                                                   */

/*
 * One token of one value head, spec §3.5, on state S [K, V]:
 *   S = diag(e^g) S;  u = beta (v - S^T k);  S += k u^T;  o = S^T (scale q).
 * Columns of S are independent, so the work goes by tiles of nj <= RT_V
 * columns, each touched twice: pass 1 decays the rows and accumulates S^T k,
 * pass 2 applies the rank-1 update and accumulates the read-out from the
 * updated rows. Inner loops run over the value dim (contiguous) and
 * vectorise; called with the constant nj = RT_V the accumulators stay in
 * registers, so a pass loads and stores each state element once and nothing
 * else. (Reading o from the decayed state, o = S'^T q + u (k.q), would save
 * one store pass, but measured slower here: the step is bound by FMA issue,
 * not by the state's memory traffic, once the tile is in L1/L2.)
 */
static FORCE_INLINE void recurrent_tile(int K, int V, int nj, float scale, const float *q,
                                        const float *k, const float *v, const float *g, float beta,
                                        float *S, float *o) {
    float ea[RT_K];  /* e^g for a batch of key rows */
    float acc[RT_V]; /* pass 1: S^T k, then u */
    float out[RT_V]; /* pass 2: S^T (scale q) */
    for (int j = 0; j < nj; j++)
        acc[j] = 0.0f;
    for (int d0 = 0; d0 < K; d0 += RT_K) {
        int nd = K - d0 < RT_K ? K - d0 : RT_K;
        for (int i = 0; i < nd; i++)
            ea[i] = vexp(g[d0 + i]);
        for (int i = 0; i < nd; i++) {
            float a = ea[i], kd = k[d0 + i];
            float *row = S + (size_t)(d0 + i) * V;
            for (int j = 0; j < nj; j++) {
                float s = row[j] * a;
                row[j] = s;
                acc[j] = fmaf(kd, s, acc[j]);
            }
        }
    }
    for (int j = 0; j < nj; j++) {
        acc[j] = beta * (v[j] - acc[j]);
        out[j] = 0.0f;
    }
    for (int d = 0; d < K; d++) {
        float kd = k[d], qd = scale * q[d];
        float *row = S + (size_t)d * V;
        for (int j = 0; j < nj; j++) {
            float s = fmaf(kd, acc[j], row[j]);
            row[j] = s;
            out[j] = fmaf(qd, s, out[j]);
        }
    }
    for (int j = 0; j < nj; j++)
        o[j] = out[j];
}

static void recurrent_step(int K, int V, float scale, const float *q, const float *k,
                           const float *v, const float *g, float beta, float *S, float *o) {
    int j0 = 0;
    for (; j0 + RT_V <= V; j0 += RT_V)
        recurrent_tile(K, V, RT_V, scale, q, k, v + j0, g, beta, S + j0, o + j0);
    if (j0 < V) recurrent_tile(K, V, V - j0, scale, q, k, v + j0, g, beta, S + j0, o + j0);
}

void kern_kda_recurrent(const kern_kda_shape *sh, int T, const float *q, const float *k,
                        const float *v, const float *g, const float *beta, float *state, float *o,
                        int hv0, int hv1) {
    const int H = sh->H, HV = sh->HV, K = sh->K, V = sh->V, group = sh->HV / sh->H;
    for (int hv = hv0; hv < hv1; hv++) {
        int h = hv / group;
        float *S = state + (size_t)hv * K * V;
        for (int t = 0; t < T; t++) {
            size_t qk = ((size_t)t * H + h) * K, tv = (size_t)t * HV + hv;
            recurrent_step(K, V, sh->scale, q + qk, k + qk, v + tv * V, g + tv * K, beta[tv], S,
                           o + tv * V);
        }
    }
}

/* ------------------------------------------------------------------------ */
/* Chunked (prefill) path                                                    */

/* Sum of a[i] * b[i], LANES partial sums (see the file comment). */
static float dot(const float *a, const float *b, int n) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++)
            acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
    for (int l = 0; i < n; i++, l++)
        acc[l] = fmaf(a[i], b[i], acc[l]);
    float s = 0.0f;
    for (int l = 0; l < LANES; l++)
        s += acc[l];
    return s;
}

/*
 * C[M, N] (+)= A B, A [M, P], B [P, N], row-major with leading dims;
 * without `accumulate` C's old contents are ignored (may be garbage). Real
 * sizes go to the GEMM of kern_gemm.h (B as a column-major W, x = A read in
 * place; panel: kern__gemm_panel_floats(P) floats): every output one fma chain
 * in column order, so the same bits on every CPU that has the GEMM
 * (OpenBLAS's sums depend on the kernel it picks), and faster than
 * Debian's OpenBLAS 0.3.21, which runs its AVX2 kernels on a Zen 5: the
 * chunked core at 32 heads of 128, chunks of 64 (kds_cpu_bench --only f,
 * one thread) 56-65 -> 40-48 us a token there. Without the GEMM, BLAS.
 * Plain loops (vectorised over N) for the tiny heads where either call
 * costs more than the arithmetic.
 */
static void mm(int M, int N, int P, const float *A, int lda, const float *B, int ldb,
               bool accumulate, float *C, int ldc, float *panel) {
    if (M <= 0 || N <= 0) return;
    if ((long)M * N * P >= BLAS_MIN_MACS) {
#if KERN_GEMM_SIMD
        const kern_gemm_w gw = {KERN_F32, B, ldb, true};
        kern__gemm(&gw, P, A, lda, M, C, ldc, 0, N, accumulate, panel, 0);
#else
        (void)panel;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, P, 1.0f, A, lda, B, ldb,
                    accumulate ? 1.0f : 0.0f, C, ldc);
#endif
        return;
    }
    for (int i = 0; i < M; i++) {
        float *c = C + (size_t)i * ldc;
        if (!accumulate)
            for (int j = 0; j < N; j++)
                c[j] = 0.0f;
        for (int p = 0; p < P; p++) {
            float a = A[(size_t)i * lda + p];
            const float *b = B + (size_t)p * ldb;
            for (int j = 0; j < N; j++)
                c[j] = fmaf(a, b[j], c[j]);
        }
    }
}

/* Solve (I + L) X = B in place (X holds B on entry), L [n, n] strictly lower
 * (its diagonal and upper part are never read), X [n, N]: forward
 * substitution, row r minus sum_{j<r} L[r, j] X[j]. */
static void unit_lower_solve(int n, int N, const float *L, int ldl, float *X, int ldx) {
    if ((long)n * n * N >= 2 * BLAS_MIN_MACS) {
        cblas_strsm(CblasRowMajor, CblasLeft, CblasLower, CblasNoTrans, CblasUnit, n, N, 1.0f, L,
                    ldl, X, ldx);
        return;
    }
    for (int r = 1; r < n; r++) {
        float *x = X + (size_t)r * ldx;
        for (int j = 0; j < r; j++) {
            float a = -L[(size_t)r * ldl + j];
            const float *y = X + (size_t)j * ldx;
            for (int c = 0; c < N; c++)
                x[c] = fmaf(a, y[c], x[c]);
        }
    }
}

/* Workspace of one chunk (C tokens at most), carved from the caller's floats.
 * The first piece is moved up to a 64-byte boundary (the size reserves 16
 * floats for that), so the doubles are aligned whatever float offset the
 * caller hands in; every piece is a multiple of 64 bytes long. */
typedef struct chunk_ws {
    double *G;  /* [C, K] chunk-local cumulative log-decay Gamma_r (double: see top) */
    float *QK;  /* [2C, K] rows 0..L-1: q~ = scale q_r e^{Gamma_r} (reads S0);
                 * rows L..2L-1: k~ = k_r e^{Gamma_r} (predicts v from S0) */
    float *Kb;  /* [K, C] k-bar^T: column r is k_r e^{Gamma_last - Gamma_r} (writes
                 * the state; transposed, so that the update is a plain product) */
    float *P;   /* [K, pad16(C)] column j: k_j e^{Gamma_r - Gamma_j} while row r is built */
    float *Ea;  /* [C, K] e^{g_r}, the per-token decay */
    float *Aqk; /* [C, C] scale sum_d q_r k_j e^{Gamma_r - Gamma_j}, j <= r, 0 above */
    float *Akk; /* [C, C] beta_r sum_d k_r k_j e^{Gamma_r - Gamma_j}, j < r (rest unread) */
    float *PS;  /* [2C, V] [q~; k~] S0; then rows 0..L-1 become O, rows L..2L-1
                 * beta (v - k~ S0), then nu = (I + Akk)^-1 of that */
    float *GP;  /* the GEMM's panel for mm: kern__gemm_panel_floats(max(K, C)) */
} chunk_ws;

static size_t pad16(size_t n) {
    return (n + 15) & ~(size_t)15;
}

static size_t ws_layout(int C, int K, int V, float *base, chunk_ws *w) {
    size_t ck = pad16((size_t)C * K), cc = pad16((size_t)C * C), cv = pad16((size_t)C * V);
    /* floats to the next 64-byte boundary; the size query (base NULL) counts
     * the worst case */
    size_t off = base ? ((64 - ((uintptr_t)base & 63)) & 63) / sizeof(float) : 0;
    if (w) w->G = (double *)(void *)(base + off);
    off += 2 * ck;
    if (w) w->QK = base + off;
    off += 2 * ck;
    if (w) w->Kb = base + off;
    off += ck;
    if (w) w->P = base + off;
    off += (size_t)K * pad16((size_t)C);
    if (w) w->Ea = base + off;
    off += ck;
    if (w) w->Aqk = base + off;
    off += cc;
    if (w) w->Akk = base + off;
    off += cc;
    if (w) w->PS = base + off;
    off += 2 * cv;
    if (w) w->GP = base + off;
    off += pad16(kern__gemm_panel_floats(K > C ? K : C));
    return base ? off : off + 16;
}

size_t kern_kda_chunked_workspace_floats(const kern_kda_shape *sh, int chunk) {
    return ws_layout(chunk, sh->K, sh->V, NULL, NULL);
}

/* Lowest log-decay per token the chunked path uses (see chunk_step). */
#define G_FLOOR (-1e6f)

/* Column tile of the intra-chunk recurrence: 4 AVX-512 registers of
 * running sums per matrix. Must stay a multiple of 16 (see intra_chunk). */
#define IB 64

/*
 * One j-tile of row r of the intra-chunk matrices: for the nj columns of P
 * at p (row stride ldp), P[d, j] *= a[d] and
 *   sq[j] = sum_d q[d] P[d, j],  sk[j] = sum_d k[d] P[d, j].
 * Called with a constant nj (16, 32, 48 or 64) so the loop over j is a fixed
 * number of whole vectors and sq, sk stay in registers across d.
 */
static FORCE_INLINE void intra_tile(int K, int nj, const float *a, const float *q, const float *k,
                                    float *p, int ldp, float *sq, float *sk) {
    float aq[IB], ak[IB];
    for (int j = 0; j < nj; j++)
        aq[j] = ak[j] = 0.0f;
    for (int d = 0; d < K; d++) {
        float ad = a[d], qd = q[d], kd = k[d];
        float *pd = p + (size_t)d * ldp;
        for (int j = 0; j < nj; j++) {
            float x = pd[j] * ad;
            x = fabsf(x) < 1e-30f ? 0.0f : x; /* flush would-be denormals */
            pd[j] = x;
            aq[j] = fmaf(qd, x, aq[j]);
            ak[j] = fmaf(kd, x, ak[j]);
        }
    }
    for (int j = 0; j < nj; j++) {
        sq[j] = aq[j];
        sk[j] = ak[j];
    }
}

/*
 * The intra-chunk matrices, spec §4.1, for tokens 0..L-1:
 *   A_qk[r, j] = scale sum_d q_r[d] k_j[d] e^{Gamma_r[d] - Gamma_j[d]}  (j <= r)
 *   A_kk[r, j] = beta_r sum_d k_r[d] k_j[d] e^{Gamma_r[d] - Gamma_j[d]} (j < r)
 * Instead of one exponential per (r, j, d) -- C^2 K / 2 of them, which
 * dominated the whole chunk -- this runs the decay forward like the
 * recurrence itself: P[d, j] = k_j[d] e^{Gamma_r[d] - Gamma_j[d]} is
 * multiplied by e^{g_r[d]} (Ea, row r) at each new row r, and row r of both
 * matrices is then q_r^T P and k_r^T P. Every factor is <= 1, so strong
 * decay can only underflow, towards the 0 it really is; values that reach
 * the denormal range are flushed to 0 (denormal arithmetic is slow and they
 * are far below the rounding of any result). Rounding is that of the
 * recurrence: one multiply per token per entry.
 * P is [K, ldp] with ldp a multiple of 16 and starts at 0; column r is set to
 * k_r after row r. Columns at or past r stay 0 until then, so rounding the
 * tile widths up to whole vectors only multiplies zeros.
 */
static void intra_chunk(int K, int L, int C, float scale, const float *q, const float *k,
                        size_t ldqk, const float *Ea, const float *beta, size_t ldb, float *P,
                        int ldp, float *Aqk, float *Akk) {
    float sq[IB], sk[IB];
    memset(P, 0, (size_t)K * ldp * sizeof *P);
    for (int r = 0; r < L; r++) {
        const float *qr = q + r * ldqk, *kr = k + r * ldqk, *ar = Ea + (size_t)r * K;
        float *aqk = Aqk + (size_t)r * C, *akk = Akk + (size_t)r * C;
        float br = beta[r * ldb];
        for (int j0 = 0; j0 < r; j0 += IB) {
            int nj = r - j0 < IB ? r - j0 : IB;
            float *p = P + j0;
            switch ((nj + 15) / 16) {
            case 1: intra_tile(K, 16, ar, qr, kr, p, ldp, sq, sk); break;
            case 2: intra_tile(K, 32, ar, qr, kr, p, ldp, sq, sk); break;
            case 3: intra_tile(K, 48, ar, qr, kr, p, ldp, sq, sk); break;
            default: intra_tile(K, 64, ar, qr, kr, p, ldp, sq, sk); break;
            }
            for (int j = 0; j < nj; j++) {
                aqk[j0 + j] = scale * sq[j];
                akk[j0 + j] = br * sk[j];
            }
        }
        aqk[r] = scale * dot(qr, kr, K);
        for (int j = r + 1; j < L; j++)
            aqk[j] = 0.0f;
        for (int d = 0; d < K; d++)
            P[(size_t)d * ldp + r] = kr[d];
    }
}

/*
 * One chunk of L tokens of one value head (spec §4.1), state S [K, V] in/out.
 * q, k point at the chunk's first token with row stride ldqk (= H K); v, o
 * with stride ldv (= HV V); g with stride ldg (= HV K); beta with stride ldb.
 *   [O'; R'] = [q~; k~] S0;   R = beta (V - R');   (I + A_kk) nu = R;
 *   O = O' + A_qk nu;         S = diag(e^{Gamma_last}) S0 + k-bar^T nu.
 */
static void chunk_step(int K, int V, int L, int C, float scale, const float *q, const float *k,
                       size_t ldqk, const float *v, const float *g, size_t ldg, const float *beta,
                       size_t ldb, size_t ldv, float *S, float *o, const chunk_ws *w) {
    double *G = w->G;
    /* Gamma_r = sum_{i <= r} g_i, restarting at the chunk start, and the
     * per-token decay e^{g_r}. A g below G_FLOOR (a decay to exactly 0 in
     * float anyway) is raised to it first, so that g = -inf gives
     * differences of -inf, never -inf - -inf = NaN. (The clamp goes through
     * the float row Ea: GCC vectorises a float select, not one feeding a
     * double.) */
    for (int r = 0; r < L; r++) {
        const float *gr = g + (size_t)r * ldg;
        float *ea = w->Ea + (size_t)r * K;
        double *Gr = G + (size_t)r * K;
        for (int d = 0; d < K; d++) {
            float x = gr[d];
            ea[d] = x < G_FLOOR ? G_FLOOR : x;
        }
        if (r == 0)
            for (int d = 0; d < K; d++)
                Gr[d] = ea[d];
        else
            for (int d = 0; d < K; d++)
                Gr[d] = Gr[d - K] + ea[d]; /* row r-1 plus g_r */
        for (int d = 0; d < K; d++)
            ea[d] = vexp(ea[d]);
    }
    /* decayed copies of q and k; every exponent is <= 0 */
    const double *Gl = G + (size_t)(L - 1) * K;
    float *Qt = w->QK, *Kt = w->QK + (size_t)L * K;
    for (int r = 0; r < L; r++) {
        const double *Gr = G + (size_t)r * K;
        const float *qr = q + r * ldqk, *kr = k + r * ldqk;
        float *qt = Qt + (size_t)r * K, *kt = Kt + (size_t)r * K;
        for (int d = 0; d < K; d++) {
            float e = vexp((float)Gr[d]);
            qt[d] = scale * qr[d] * e;
            kt[d] = kr[d] * e;
            w->Kb[(size_t)d * C + r] = kr[d] * vexp((float)(Gl[d] - Gr[d]));
        }
    }
    intra_chunk(K, L, C, scale, q, k, ldqk, w->Ea, beta, ldb, w->P, (int)pad16((size_t)C), w->Aqk,
                w->Akk);
    /* [O'; R'] = [q~; k~] S0 in one product of 2L rows */
    float *O = w->PS, *R = w->PS + (size_t)L * V;
    mm(2 * L, V, K, w->QK, K, S, V, false, w->PS, V, w->GP);
    /* R = beta (v - k~ S0), then nu = (I + A_kk)^-1 R */
    for (int r = 0; r < L; r++) {
        float br = beta[r * ldb];
        const float *vr = v + r * ldv;
        float *x = R + (size_t)r * V;
        for (int c = 0; c < V; c++)
            x[c] = br * (vr[c] - x[c]);
    }
    unit_lower_solve(L, V, w->Akk, C, R, V);
    /* O = q~ S0 + A_qk nu */
    mm(L, V, L, w->Aqk, C, R, V, true, O, V, w->GP);
    for (int r = 0; r < L; r++)
        memcpy(o + r * ldv, O + (size_t)r * V, (size_t)V * sizeof *o);
    /* S = diag(e^{Gamma_last}) S0 + k-bar^T nu */
    for (int d = 0; d < K; d++) {
        float e = vexp((float)Gl[d]);
        float *row = S + (size_t)d * V;
        for (int c = 0; c < V; c++)
            row[c] *= e;
    }
    mm(K, V, L, w->Kb, C, R, V, true, S, V, w->GP);
}

void kern_kda_chunked(const kern_kda_shape *sh, int T, int chunk, const float *q, const float *k,
                      const float *v, const float *g, const float *beta, float *state, float *o,
                      int hv0, int hv1, float *workspace) {
    const int H = sh->H, HV = sh->HV, K = sh->K, V = sh->V, group = sh->HV / sh->H;
    chunk_ws w;
    ws_layout(chunk, K, V, workspace, &w);
    /* chunk-major: the chunk's q, k, v, g rows of all heads in the range are
     * contiguous in memory (streamed once), while the heads' states (64 KiB
     * each at K = V = 128) are re-read from cache; measured about 10% ahead
     * of head-major for a call over all 32 heads */
    for (int t0 = 0; t0 < T; t0 += chunk) {
        int L = T - t0 < chunk ? T - t0 : chunk;
        for (int hv = hv0; hv < hv1; hv++) {
            int h = hv / group;
            float *S = state + (size_t)hv * K * V;
            size_t qk = ((size_t)t0 * H + h) * K, tv = (size_t)t0 * HV + hv;
            chunk_step(K, V, L, chunk, sh->scale, q + qk, k + qk, (size_t)H * K, v + tv * V,
                       g + tv * K, (size_t)HV * K, beta + tv, (size_t)HV, (size_t)HV * V, S,
                       o + tv * V, &w);
        }
    }
}
