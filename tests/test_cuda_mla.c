/*
 * test_cuda_mla.c - MLA attention (absorbed form, kda-model-spec.md §5.2):
 *   mla_ref   (CPU only) kern_mla_attend, the engine's attention, against
 *             plain-loop softmax attention in the expanded form of §5.1
 *             (per-head keys [W_UK_h c | k_pe] and values W_UV_h c, softmax
 *             in double), so the reference itself is checked;
 *   cuda_mla  kern_cuda_mla_attention against kern_mla_attend for prefill
 *             (one sequence, T rows at pos 0 and pos 300, several context
 *             splits) and batched decode (sequences with contexts 1, 257,
 *             600 in permuted slots, a padding row), bf16 and f32 kv_b, small
 *             heads and Kimi's widths with few heads; kern_cuda_mla_cache_append
 *             against kern_rmsnorm; argument checks.
 * GPU tests skip with "no CUDA device: <reason>".
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kern.h"

/* ---- the CPU reference against the expanded form ------------------------- */

static uint64_t mla_rng(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void mla_fill(uint64_t *s, float *x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++)
        x[i] = lo + (hi - lo) * (float)((mla_rng(s) >> 40) * (1.0 / 16777216.0));
}

static void *mla_alloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    cr_assert_not_null(p, "out of host memory (%zu bytes)", bytes);
    return p;
}

/* Spec §5.1 with plain loops in double: per head h and query t (position
 * pos + t), k_nope = W_UK_h c_tau, v = W_UV_h c_tau, score = (q_nope . k_nope
 * + q_pe . k_pe) / sqrt(dn + dr) over tau <= pos + t, o = sum softmax * v.
 * kvb fp32 [nh*(dn+dv), dc]. */
static void naive_mla(const kern_mla_shape *sh, const float *kvb, const float *q, int T,
                      int64_t pos, const float *cache, float *o) {
    const int nh = sh->nh, dc = sh->dc, dr = sh->dr, dn = sh->dn, dv = sh->dv, row = dc + dr;
    const int64_t n = pos + T;
    double *kn = mla_alloc((size_t)n * dn * sizeof(double));
    double *vv = mla_alloc((size_t)n * dv * sizeof(double));
    double *sc = mla_alloc((size_t)n * sizeof(double));
    for (int h = 0; h < nh; h++) {
        const float *wuk = kvb + (size_t)h * (dn + dv) * dc, *wuv = wuk + (size_t)dn * dc;
        for (int64_t tau = 0; tau < n; tau++) {
            const float *c = cache + (size_t)tau * row;
            for (int i = 0; i < dn; i++) {
                double s = 0;
                for (int j = 0; j < dc; j++) s += (double)wuk[(size_t)i * dc + j] * c[j];
                kn[tau * dn + i] = s;
            }
            for (int i = 0; i < dv; i++) {
                double s = 0;
                for (int j = 0; j < dc; j++) s += (double)wuv[(size_t)i * dc + j] * c[j];
                vv[tau * dv + i] = s;
            }
        }
        for (int t = 0; t < T; t++) {
            const float *qh = q + ((size_t)t * nh + h) * (dn + dr);
            const int64_t ctx = pos + t + 1;
            double mx = -INFINITY, den = 0;
            for (int64_t tau = 0; tau < ctx; tau++) {
                double s = 0;
                for (int i = 0; i < dn; i++) s += (double)qh[i] * kn[tau * dn + i];
                for (int i = 0; i < dr; i++) s += (double)qh[dn + i] * cache[(size_t)tau * row + dc + i];
                sc[tau] = s / sqrt((double)(dn + dr));
                if (sc[tau] > mx) mx = sc[tau];
            }
            for (int64_t tau = 0; tau < ctx; tau++) den += exp(sc[tau] - mx);
            for (int i = 0; i < dv; i++) {
                double s = 0;
                for (int64_t tau = 0; tau < ctx; tau++) s += exp(sc[tau] - mx) * vv[tau * dv + i];
                o[((size_t)t * nh + h) * dv + i] = (float)(s / den);
            }
        }
    }
    free(kn);
    free(vv);
    free(sc);
}

static double max_rel(const float *got, const float *want, size_t n) {
    double err = 0, mag = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - want[i]);
        if (isnan(e)) e = INFINITY;
        if (!(e <= err)) err = e;
        if (fabs((double)want[i]) > mag) mag = fabs((double)want[i]);
    }
    return err == 0 ? 0 : err / (mag > 0 ? mag : 1e-30);
}

/* Random kv_b (bf16-exact when dt is BF16), q and cache for a layer. */
typedef struct mla_case {
    kern_mla_shape sh;
    kern_dtype dt;
    float *kvb;   /* fp32 values [nh*(dn+dv), dc] */
    void *kvb_st; /* as stored: dt */
    float *q;     /* [T, nh*(dn+dr)] */
    int T;
} mla_case;

static void case_make(mla_case *c, const kern_mla_shape *sh, kern_dtype dt, int T, uint64_t seed) {
    c->sh = *sh;
    c->dt = dt;
    c->T = T;
    const size_t nw = (size_t)sh->nh * (sh->dn + sh->dv) * sh->dc;
    const size_t nq = (size_t)T * sh->nh * (sh->dn + sh->dr);
    c->kvb = mla_alloc(nw * 4);
    c->q = mla_alloc(nq * 4);
    uint64_t s = seed;
    /* scores of a few units: a softmax that is neither flat nor one-hot */
    mla_fill(&s, c->kvb, nw, -0.4f, 0.4f);
    mla_fill(&s, c->q, nq, -1.5f, 1.5f);
    if (dt == KERN_BF16) {
        uint16_t *b = mla_alloc(nw * 2);
        for (size_t i = 0; i < nw; i++) {
            b[i] = kern_f32_to_bf16(c->kvb[i]);
            c->kvb[i] = kern_bf16_to_f32(b[i]);
        }
        c->kvb_st = b;
    } else {
        c->kvb_st = c->kvb;
    }
}

static void case_free(mla_case *c) {
    if (c->kvb_st != c->kvb) free(c->kvb_st);
    free(c->kvb);
    free(c->q);
}

/* a cache of n rows [c | k_pe]: c roughly unit RMS as after the norm */
static float *cache_make(const kern_mla_shape *sh, int64_t n, uint64_t seed) {
    float *c = mla_alloc((size_t)n * (sh->dc + sh->dr) * 4);
    uint64_t s = seed;
    mla_fill(&s, c, (size_t)n * (sh->dc + sh->dr), -1.7f, 1.7f);
    return c;
}

static void ref_case(const kern_mla_shape *sh, kern_dtype dt, int T, int64_t pos, int h0, int h1,
                     uint64_t seed) {
    mla_case c;
    case_make(&c, sh, dt, T, seed);
    float *cache = cache_make(sh, pos + T, seed + 1);
    const size_t no = (size_t)T * sh->nh * sh->dv;
    float *want = mla_alloc(no * 4), *got = mla_alloc(no * 4);
    float *ws = mla_alloc(kern_mla_attend_workspace_floats(sh, T) * 4);
    naive_mla(sh, c.kvb, c.q, T, pos, cache, want);
    for (size_t i = 0; i < no; i++) got[i] = NAN;
    kern_mla_attend(sh, dt, c.kvb_st, c.q, T, pos, cache, got, h0, h1, ws);
    /* only the asked heads' columns are written */
    for (size_t i = 0; i < no; i++) {
        int h = (int)(i / sh->dv % sh->nh);
        if (h < h0 || h >= h1) {
            cr_assert(isnan(got[i]), "T=%d pos=%lld: head %d written", T, (long long)pos, h);
            got[i] = want[i];
        }
    }
    double r = max_rel(got, want, no);
    printf("mla_ref nh=%d dc=%d T=%d pos=%lld heads [%d,%d) dt=%d: max err / max|ref| = %.2e\n",
           sh->nh, sh->dc, T, (long long)pos, h0, h1, (int)dt, r);
    cr_assert(r <= 2e-5, "kern_mla_attend vs naive, T=%d pos=%lld: %.3e", T, (long long)pos, r);
    free(want);
    free(got);
    free(ws);
    free(cache);
    case_free(&c);
}

Test(mla_ref, attend_matches_naive_softmax_attention) {
    const kern_mla_shape sh = {3, 64, 16, 32, 24};
    ref_case(&sh, KERN_F32, 1, 0, 0, 3, 1);
    ref_case(&sh, KERN_F32, 5, 0, 0, 3, 2);
    ref_case(&sh, KERN_BF16, 70, 0, 0, 3, 3);
    ref_case(&sh, KERN_F32, 1, 300, 0, 3, 4);   /* decode over two key blocks */
    ref_case(&sh, KERN_BF16, 70, 300, 1, 3, 5); /* heads [1, 3) only */
    ref_case(&sh, KERN_F32, 300, 200, 0, 2, 6); /* queries spanning blocks */
}

/* kern_mla_decode_heads (one decode token, heads together) against the
 * naive loops, and a head's output the same bits whichever heads share the
 * call; heads outside [h0, h1) untouched. */
static void decode_heads_case(const kern_mla_shape *sh, kern_dtype dt, int64_t pos, uint64_t seed) {
    mla_case c;
    case_make(&c, sh, dt, 1, seed);
    float *cache = cache_make(sh, pos + 1, seed + 1);
    const size_t no = (size_t)sh->nh * sh->dv;
    float *want = mla_alloc(no * 4), *all = mla_alloc(no * 4), *one = mla_alloc(no * 4);
    float *ws = mla_alloc(kern_mla_decode_heads_workspace_floats(sh) * 4);
    const kern_weight kw = {
        .dt = dt, .data = c.kvb_st, .rows = sh->nh * (sh->dn + sh->dv), .cols = sh->dc};
    naive_mla(sh, c.kvb, c.q, 1, pos, cache, want);
    for (size_t i = 0; i < no; i++) all[i] = one[i] = NAN;
    kern_mla_decode_heads(sh, &kw, c.q, 0, sh->nh, pos, cache, all, ws);
    double r = max_rel(all, want, no);
    printf("mla_ref decode_heads nh=%d dc=%d pos=%lld dt=%d: max err / max|ref| = %.2e\n", sh->nh,
           sh->dc, (long long)pos, (int)dt, r);
    cr_assert(r <= 2e-5, "kern_mla_decode_heads vs naive, pos=%lld: %.3e", (long long)pos, r);
    /* head by head, then the upper half alone: the same bits */
    for (int h = 0; h < sh->nh; h++) kern_mla_decode_heads(sh, &kw, c.q, h, h + 1, pos, cache, one, ws);
    cr_assert(!memcmp(all, one, no * 4), "pos=%lld: a head's output depends on its neighbours",
              (long long)pos);
    for (size_t i = 0; i < no; i++) one[i] = NAN;
    const int h0 = sh->nh / 2;
    kern_mla_decode_heads(sh, &kw, c.q, h0, sh->nh, pos, cache, one, ws);
    for (size_t i = 0; i < no; i++) {
        if ((int)(i / sh->dv) < h0)
            cr_assert(isnan(one[i]), "pos=%lld: head %zu written", (long long)pos, i / sh->dv);
        else
            cr_assert(one[i] == all[i], "pos=%lld: heads [%d, nh) differ", (long long)pos, h0);
    }
    free(want), free(all), free(one), free(ws), free(cache);
    case_free(&c);
}

/* kern_mla_decode_rows (a batched step: n rows, each its own cache and
 * position) against kern_mla_decode_heads row by row: the same bits, and
 * heads outside [h0, h1) of every row untouched. */
static void decode_rows_case(const kern_mla_shape *sh, kern_dtype dt, int h0, int h1,
                             uint64_t seed) {
    enum { N = 3 };
    const int64_t pos[N] = {0, 300, 17}; /* one key, two key blocks, one */
    mla_case c;
    case_make(&c, sh, dt, N, seed);
    const float *caches[N];
    float *own[N];
    for (int s = 0; s < N; s++) caches[s] = own[s] = cache_make(sh, pos[s] + 1, seed + 1 + s);
    const size_t no = (size_t)sh->nh * sh->dv, qw = (size_t)sh->nh * (sh->dn + sh->dr);
    float *want = mla_alloc(N * no * 4), *got = mla_alloc(N * no * 4);
    float *ws_one = mla_alloc(kern_mla_decode_heads_workspace_floats(sh) * 4);
    float *ws = mla_alloc(kern_mla_decode_rows_workspace_floats(sh, N) * 4);
    const kern_weight kw = {
        .dt = dt, .data = c.kvb_st, .rows = sh->nh * (sh->dn + sh->dv), .cols = sh->dc};
    for (size_t i = 0; i < N * no; i++) want[i] = got[i] = NAN;
    for (int s = 0; s < N; s++)
        kern_mla_decode_heads(sh, &kw, c.q + s * qw, h0, h1, pos[s], caches[s], want + s * no,
                              ws_one);
    kern_mla_decode_rows(sh, &kw, N, c.q, h0, h1, pos, caches, got, ws);
    for (size_t i = 0; i < N * no; i++) {
        const int h = (int)(i % no / sh->dv), s = (int)(i / no);
        if (h < h0 || h >= h1)
            cr_assert(isnan(got[i]), "row %d: head %d written", s, h);
        else
            cr_assert(!memcmp(&got[i], &want[i], 4), "row %d head %d: %g, alone %g", s, h,
                      got[i], want[i]);
    }
    free(want), free(got), free(ws_one), free(ws);
    for (int s = 0; s < N; s++) free(own[s]);
    case_free(&c);
}

Test(mla_ref, decode_rows_are_each_row_alone) {
    const kern_mla_shape sh = {3, 64, 16, 32, 24};
    decode_rows_case(&sh, KERN_F32, 0, 3, 21);
    decode_rows_case(&sh, KERN_BF16, 0, 3, 22);
    decode_rows_case(&sh, KERN_BF16, 1, 3, 23); /* heads [1, 3) only */
}

Test(mla_ref, decode_heads_match_naive_and_each_other) {
    const kern_mla_shape sh = {3, 64, 16, 32, 24};
    decode_heads_case(&sh, KERN_F32, 0, 11);
    decode_heads_case(&sh, KERN_BF16, 1, 12);
    decode_heads_case(&sh, KERN_F32, 300, 13); /* two key blocks */
    const kern_mla_shape wide = {16, 64, 16, 32, 32}; /* more heads than a GEMM tile */
    decode_heads_case(&wide, KERN_BF16, 700, 14);
}

#ifdef KDS_HAVE_CUDA

#include "test_cuda_util.h"

/* ---- prefill: T rows of one sequence -------------------------------------- */

static void prefill_case(const kern_mla_shape *sh, kern_dtype dt, int T, int64_t pos, int n_split,
                         uint64_t seed) {
    mla_case c;
    case_make(&c, sh, dt, T, seed);
    const int row = sh->dc + sh->dr;
    const int64_t n = pos + T, cap = n + 40;
    float *cache = cache_make(sh, n, seed + 1);
    const size_t no = (size_t)T * sh->nh * sh->dv, nq = (size_t)T * sh->nh * (sh->dn + sh->dr);
    float *want = tcu_malloc(no * 4), *got = tcu_malloc(no * 4);
    float *ws = tcu_malloc(kern_mla_attend_workspace_floats(sh, T) * 4);
    kern_mla_attend(sh, dt, c.kvb_st, c.q, T, pos, cache, want, 0, sh->nh, ws);

    /* rows past the context are NaN: reading one would show */
    float *d_cache = tcu_dev_alloc((size_t)cap * row * 4);
    tcu_poison(d_cache, (size_t)cap * row * 4);
    tcu_h2d(d_cache, cache, (size_t)n * row * 4);
    float *d_q = tcu_upload(c.q, nq);
    void *d_w = tcu_upload_as(c.kvb, (size_t)sh->nh * (sh->dn + sh->dv) * sh->dc, dt);
    float *d_o = tcu_dev_alloc(no * 4);
    tcu_poison(d_o, no * 4);
    const size_t wsb = kern_cuda_mla_workspace_bytes(sh, T, 16);
    cr_assert(wsb > 0);
    void *d_ws = tcu_dev_alloc(wsb);
    tcu_poison(d_ws, wsb);
    kern_cuda_mla_args a = {.shape = *sh,
                            .map = {.rows = T, .cache = d_cache, .pos0 = pos},
                            .q = d_q, .kv_b = d_w, .kv_b_dtype = dt, .o = d_o,
                            .max_ctx = (int)n, .n_split = n_split,
                            .workspace = d_ws, .workspace_bytes = wsb};
    kds_err err;
    kds_err_clear(&err);
    cr_assert_eq(kern_cuda_mla_attention(&a, NULL, &err), KDS_OK, "%s", err.msg);
    tcu_sync();
    tcu_d2h(got, d_o, no * 4);
    char what[128];
    snprintf(what, sizeof what, "mla prefill nh=%d dc=%d T=%d pos=%lld split=%d kv_b=%s", sh->nh,
             sh->dc, T, (long long)pos, n_split, dt == KERN_BF16 ? "bf16" : "f32");
    tcu_assert_close(got, want, no, 1e-5, what);
    kern_cuda_free(d_cache);
    kern_cuda_free(d_q);
    kern_cuda_free(d_w);
    kern_cuda_free(d_o);
    kern_cuda_free(d_ws);
    free(cache);
    free(want);
    free(got);
    free(ws);
    case_free(&c);
}

static const kern_mla_shape small = {3, 64, 16, 32, 32};

Test(cuda_mla, prefill_pos0_matches_cpu) {
    tcu_require_device();
    prefill_case(&small, KERN_F32, 1, 0, 0, 11);
    prefill_case(&small, KERN_BF16, 5, 0, 0, 12);
    prefill_case(&small, KERN_F32, 70, 0, 0, 13);
    prefill_case(&small, KERN_BF16, 70, 0, 2, 14);
}

Test(cuda_mla, prefill_pos300_matches_cpu) {
    tcu_require_device();
    prefill_case(&small, KERN_F32, 1, 300, 0, 21);
    prefill_case(&small, KERN_BF16, 5, 300, 0, 22);
    prefill_case(&small, KERN_F32, 70, 300, 0, 23);
    prefill_case(&small, KERN_BF16, 70, 300, 5, 24); /* 5 splits of 96 keys */
    prefill_case(&small, KERN_F32, 5, 300, 1, 25);   /* one split, 10 tiles */
}

Test(cuda_mla, prefill_more_heads_than_a_cta) {
    tcu_require_device();
    /* 40 heads: two head groups (32 + 8), one row per CTA */
    const kern_mla_shape sh = {40, 64, 8, 16, 16};
    prefill_case(&sh, KERN_BF16, 3, 40, 0, 31);
}

Test(cuda_mla, prefill_kimi_widths_matches_cpu) {
    tcu_require_device();
    /* Kimi's dc, dr, dn, dv with 4 heads (the emulation's speed) */
    const kern_mla_shape kimi = {4, 512, 64, 128, 128};
    prefill_case(&kimi, KERN_BF16, 5, 300, 0, 41);
    prefill_case(&kimi, KERN_F32, 9, 0, 0, 42);
}

/* ---- batched decode: one row per sequence ---------------------------------- */

static void decode_case(const kern_mla_shape *sh, kern_dtype dt, int n_split, uint64_t seed) {
    enum { N = 4, SLOTS = 5 };
    const int ctx[N] = {1, 257, 600, 0};  /* row 3 is padding */
    const int32_t slots[N] = {3, 0, 4, -1}; /* permuted; slots 1, 2 unused */
    const int row = sh->dc + sh->dr, cap = 640;
    mla_case c;
    case_make(&c, sh, dt, N, seed);
    const size_t no = (size_t)N * sh->nh * sh->dv, nq = (size_t)N * sh->nh * (sh->dn + sh->dr);
    const size_t oh = (size_t)sh->nh * sh->dv, qh = (size_t)sh->nh * (sh->dn + sh->dr);
    float *want = tcu_malloc(no * 4), *got = tcu_malloc(no * 4);
    float *ws = tcu_malloc(kern_mla_attend_workspace_floats(sh, 1) * 4);
    float *caches[SLOTS] = {0}, *d_caches[SLOTS] = {0};
    int32_t pos[N];
    for (int s = 0; s < SLOTS; s++) {
        d_caches[s] = tcu_dev_alloc((size_t)cap * row * 4);
        tcu_poison(d_caches[s], (size_t)cap * row * 4);
    }
    memset(want, 0, no * 4);
    for (int r = 0; r < N; r++) {
        pos[r] = ctx[r] - 1;
        if (slots[r] < 0) {
            pos[r] = 5;
            continue;
        }
        caches[r] = cache_make(sh, ctx[r], seed + 10 + r);
        tcu_h2d(d_caches[slots[r]], caches[r], (size_t)ctx[r] * row * 4);
        kern_mla_attend(sh, dt, c.kvb_st, c.q + r * qh, 1, pos[r], caches[r], want + r * oh, 0,
                        sh->nh, ws);
    }
    float **d_table = tcu_dev_alloc(sizeof d_caches);
    tcu_h2d(d_table, d_caches, sizeof d_caches);
    int32_t *d_slots = tcu_dev_alloc(sizeof slots), *d_pos = tcu_dev_alloc(sizeof pos);
    tcu_h2d(d_slots, slots, sizeof slots);
    tcu_h2d(d_pos, pos, sizeof pos);
    float *d_q = tcu_upload(c.q, nq);
    void *d_w = tcu_upload_as(c.kvb, (size_t)sh->nh * (sh->dn + sh->dv) * sh->dc, dt);
    float *d_o = tcu_dev_alloc(no * 4);
    tcu_poison(d_o, no * 4);
    const size_t wsb = kern_cuda_mla_workspace_bytes(sh, N, 8);
    void *d_ws = tcu_dev_alloc(wsb);
    tcu_poison(d_ws, wsb);
    kern_cuda_mla_args a = {.shape = *sh,
                            .map = {.rows = N, .caches = d_table, .n_caches = SLOTS,
                                    .slots = d_slots, .pos = d_pos},
                            .q = d_q, .kv_b = d_w, .kv_b_dtype = dt, .o = d_o,
                            .max_ctx = 600, .n_split = n_split,
                            .workspace = d_ws, .workspace_bytes = wsb};
    kds_err err;
    kds_err_clear(&err);
    cr_assert_eq(kern_cuda_mla_attention(&a, NULL, &err), KDS_OK, "%s", err.msg);
    tcu_sync();
    tcu_d2h(got, d_o, no * 4);
    char what[128];
    snprintf(what, sizeof what, "mla decode nh=%d dc=%d ctx 1/257/600+pad split=%d kv_b=%s",
             sh->nh, sh->dc, n_split, dt == KERN_BF16 ? "bf16" : "f32");
    tcu_assert_close(got, want, no, 1e-5, what);
    for (size_t i = 3 * oh; i < 4 * oh; i++) cr_assert_eq(got[i], 0.0f, "padding row not zero");
    for (int s = 0; s < SLOTS; s++) kern_cuda_free(d_caches[s]);
    for (int r = 0; r < N; r++) free(caches[r]);
    kern_cuda_free(d_table);
    kern_cuda_free(d_slots);
    kern_cuda_free(d_pos);
    kern_cuda_free(d_q);
    kern_cuda_free(d_w);
    kern_cuda_free(d_o);
    kern_cuda_free(d_ws);
    free(want);
    free(got);
    free(ws);
    case_free(&c);
}

Test(cuda_mla, decode_batch_matches_cpu) {
    tcu_require_device();
    decode_case(&small, KERN_F32, 0, 51);
    decode_case(&small, KERN_BF16, 0, 52);
    decode_case(&small, KERN_F32, 1, 53);
    decode_case(&small, KERN_BF16, 7, 54);
}

Test(cuda_mla, decode_kimi_widths_matches_cpu) {
    tcu_require_device();
    const kern_mla_shape kimi = {2, 512, 64, 128, 128};
    decode_case(&kimi, KERN_BF16, 0, 61);
}

/* ---- cache append ------------------------------------------------------------ */

static void append_case(int dc, int dr, kern_dtype wdt, bool with_w, bool table, uint64_t seed) {
    enum { R = 4, CAP = 12, SLOTS = 3 };
    const int row = dc + dr;
    uint64_t rs = seed;
    float *kva = tcu_malloc((size_t)R * row * 4), *w = tcu_malloc((size_t)dc * 4);
    tcu_fill(&rs, kva, (size_t)R * row, -3.0f, 3.0f);
    tcu_fill(&rs, w, dc, 0.5f, 1.5f);
    if (wdt == KERN_BF16) tcu_round_bf16(w, dc);
    /* where each row goes: one sequence at positions 7..10, or slots */
    const int32_t slots[R] = {2, 0, -1, 1}, pos[R] = {5, 0, 3, 11};
    float *d_cache[SLOTS];
    for (int s = 0; s < SLOTS; s++) {
        d_cache[s] = tcu_dev_alloc((size_t)CAP * row * 4);
        tcu_poison(d_cache[s], (size_t)CAP * row * 4);
    }
    float **d_table = tcu_dev_alloc(sizeof d_cache);
    tcu_h2d(d_table, d_cache, sizeof d_cache);
    int32_t *d_slots = tcu_dev_alloc(sizeof slots), *d_pos = tcu_dev_alloc(sizeof pos);
    tcu_h2d(d_slots, slots, sizeof slots);
    tcu_h2d(d_pos, pos, sizeof pos);
    float *d_kva = tcu_upload(kva, (size_t)R * row);
    void *d_w = tcu_upload_as(w, dc, wdt);
    kern_cuda_mla_append_args a = {.dc = dc, .dr = dr, .eps = 1e-5f, .kva = d_kva,
                                   .norm_w = with_w ? d_w : NULL, .norm_w_dtype = wdt};
    a.map.rows = R;
    if (table) {
        a.map.caches = d_table;
        a.map.n_caches = SLOTS;
        a.map.slots = d_slots;
        a.map.pos = d_pos;
    } else {
        a.map.cache = d_cache[1];
        a.map.pos0 = 7;
    }
    kds_err err;
    kds_err_clear(&err);
    cr_assert_eq(kern_cuda_mla_cache_append(&a, NULL, &err), KDS_OK, "%s", err.msg);
    tcu_sync();
    float *got = tcu_malloc((size_t)CAP * row * 4), *want = tcu_malloc((size_t)row * 4);
    int written[SLOTS][CAP];
    memset(written, 0, sizeof written);
    for (int r = 0; r < R; r++) {
        const int s = table ? slots[r] : 1, p = table ? pos[r] : 7 + r;
        if (s < 0) continue;
        written[s][p] = 1;
        kern_rmsnorm(kva + (size_t)r * row, with_w ? w : NULL, KERN_F32, dc, 1e-5f, want);
        memcpy(want + dc, kva + (size_t)r * row + dc, (size_t)dr * 4);
        tcu_d2h(got, d_cache[s] + (size_t)p * row, (size_t)row * 4);
        char what[96];
        snprintf(what, sizeof what, "mla append dc=%d dr=%d w=%d row %d%s", dc, dr,
                 with_w ? (int)wdt : -1, r, table ? " (table)" : "");
        tcu_assert_close(got, want, row, 2e-6, what);
    }
    /* every other cache row keeps its poison */
    for (int s = 0; s < SLOTS; s++) {
        tcu_d2h(got, d_cache[s], (size_t)CAP * row * 4);
        for (int p = 0; p < CAP; p++)
            if (!written[s][p])
                for (int i = 0; i < row; i++)
                    cr_assert(isnan(got[(size_t)p * row + i]), "slot %d row %d touched", s, p);
    }
    for (int s = 0; s < SLOTS; s++) kern_cuda_free(d_cache[s]);
    kern_cuda_free(d_table);
    kern_cuda_free(d_slots);
    kern_cuda_free(d_pos);
    kern_cuda_free(d_kva);
    kern_cuda_free(d_w);
    free(kva);
    free(w);
    free(got);
    free(want);
}

Test(cuda_mla, cache_append_matches_rmsnorm) {
    tcu_require_device();
    append_case(512, 64, KERN_BF16, true, false, 71);
    append_case(512, 64, KERN_F32, true, true, 72);
    append_case(64, 16, KERN_F32, false, true, 73);
}

/* ---- argument checks (before any CUDA call: no device needed) ----------------- */

Test(cuda_mla, refuses_bad_arguments) {
    kds_err err;
    kds_err_clear(&err);
    cr_assert_eq(kern_cuda_mla_attention(NULL, NULL, &err), KDS_INVALID_ARG);
    cr_assert_eq(kern_cuda_mla_cache_append(NULL, NULL, &err), KDS_INVALID_ARG);
    float dummy[64] __attribute__((aligned(16)));
    kern_cuda_mla_args a = {.shape = {4, 100, 16, 32, 32},
                            .map = {.rows = 2, .cache = dummy, .pos0 = 0},
                            .q = dummy, .kv_b = dummy, .kv_b_dtype = KERN_F32, .o = dummy,
                            .max_ctx = 2, .workspace = dummy, .workspace_bytes = 1 << 20};
    cr_assert_eq(kern_cuda_mla_attention(&a, NULL, &err), KDS_UNSUPPORTED);
    cr_assert(strstr(err.msg, "dc") != NULL, "message: %s", err.msg);
    a.shape.dc = 64;
    a.workspace_bytes = 64;
    cr_assert_eq(kern_cuda_mla_attention(&a, NULL, &err), KDS_INVALID_ARG);
    cr_assert(strstr(err.msg, "workspace") != NULL, "message: %s", err.msg);
    a.workspace_bytes = 1 << 20;
    a.kv_b_dtype = KERN_F16;
    cr_assert_eq(kern_cuda_mla_attention(&a, NULL, &err), KDS_INVALID_ARG);
    a.kv_b_dtype = KERN_F32;
    a.map.cache = NULL;
    cr_assert_eq(kern_cuda_mla_attention(&a, NULL, &err), KDS_INVALID_ARG);
    a.map.cache = dummy;
    a.map.pos0 = -1;
    cr_assert_eq(kern_cuda_mla_attention(&a, NULL, &err), KDS_INVALID_ARG);
    cr_assert_eq(kern_cuda_mla_workspace_bytes(&a.shape, 0, 1), 0);
    a.shape.dr = 6;
    cr_assert_eq(kern_cuda_mla_workspace_bytes(&a.shape, 2, 1), 0);
    kern_cuda_mla_append_args b = {.map = {.rows = 1, .cache = dummy}, .dc = 64, .dr = 0,
                                   .kva = NULL};
    cr_assert_eq(kern_cuda_mla_cache_append(&b, NULL, &err), KDS_INVALID_ARG);
    b.map.rows = 0; /* nothing to do */
    cr_assert_eq(kern_cuda_mla_cache_append(&b, NULL, &err), KDS_OK);
}

#else /* !KDS_HAVE_CUDA */

Test(cuda_mla, skipped) {
    cr_skip_test("built without CUDA");
}

#endif
