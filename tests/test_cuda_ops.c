/*
 * test_cuda_ops.c - the GPU norm, MoE routing and sampling kernels against
 * their CPU references (kern.h):
 *   kern_cuda_rmsnorm        kern_rmsnorm / kern_rmsnorm_gated, fp32 and bf16
 *                            weights, gates and outputs, in place;
 *   kern_cuda_moe_route      kern_moe_route + kern_moe_permute, exactly
 *                            (selection, weights, offsets, rows), with and
 *                            without groups, with ties, with the sigmoid;
 *   kern_cuda_moe_gather /_combine  the engine's gather and combine loops,
 *                            bit for bit;
 *   kern_cuda_sample         kern_sample (= eng_sample, test_sample_ref.c):
 *                            the same tokens and RNG states over many draws,
 *                            greedy, top-k, top-p, min-p, penalty, ties,
 *                            Kimi's vocabulary size.
 * Plus a check of kern_moe_route against an independent sort-based
 * formulation of the same rule (no GPU needed). GPU tests skip with
 * "no CUDA device: <reason>".
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kern.h"

/* ---- kern_moe_route against a sort-based statement of the rule ---------- */

typedef struct cand {
    float v;
    int e;
} cand;

static int by_value_then_index(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->v != y->v) return x->v > y->v ? -1 : 1;
    return x->e - y->e;
}

/* Groups ranked by the sum of their two best biased scores (ties: lower
 * group), the best topk_group kept; experts of kept groups ranked by biased
 * score (ties: lower index), the first k taken; weights s / sum(s) * scale. */
static void route_by_sorting(const kern_moe_route_params *p, const float *s, const float *bias,
                             int32_t *sel, float *w) {
    const int E = p->n_experts, G = p->n_group > 1 ? p->n_group : 1, pg = E / G;
    cand c[1024], g[256];
    bool keep[256];
    for (int gi = 0; gi < G; gi++) {
        cand m[1024];
        for (int e = 0; e < pg; e++) {
            m[e].v = s[gi * pg + e] + (bias ? bias[gi * pg + e] : 0.0f);
            m[e].e = e;
        }
        qsort(m, (size_t)pg, sizeof m[0], by_value_then_index);
        g[gi].v = m[0].v + (pg > 1 ? m[1].v : 0.0f);
        g[gi].e = gi;
        keep[gi] = G == 1;
    }
    if (G > 1) {
        qsort(g, (size_t)G, sizeof g[0], by_value_then_index);
        for (int i = 0; i < p->topk_group && i < G; i++) keep[g[i].e] = true;
    }
    int n = 0;
    for (int e = 0; e < E; e++)
        if (keep[e / pg]) c[n++] = (cand){s[e] + (bias ? bias[e] : 0.0f), e};
    qsort(c, (size_t)n, sizeof c[0], by_value_then_index);
    double sum = 0.0;
    for (int i = 0; i < p->top_k; i++) {
        sel[i] = c[i].e;
        sum += s[c[i].e];
    }
    for (int i = 0; i < p->top_k; i++) {
        float x = s[sel[i]];
        if (p->renormalize && sum > 0.0) x = (float)(x / sum);
        w[i] = x * p->routed_scaling_factor;
    }
}

static uint64_t sm64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

Test(moe_ref, route_matches_the_sorting_statement) {
    const kern_moe_route_params ps[] = {
        {.n_experts = 256, .top_k = 8, .n_group = 1, .topk_group = 1, .renormalize = 1,
         .routed_scaling_factor = 2.446f},
        {.n_experts = 64, .top_k = 6, .n_group = 8, .topk_group = 3, .renormalize = 1,
         .routed_scaling_factor = 1.0f},
        {.n_experts = 12, .top_k = 3, .n_group = 4, .topk_group = 2, .renormalize = 0,
         .routed_scaling_factor = 0.5f},
    };
    uint64_t rs = 5;
    for (size_t pi = 0; pi < sizeof ps / sizeof ps[0]; pi++) {
        const kern_moe_route_params *p = &ps[pi];
        float s[256], bias[256], w[8], w2[8];
        int32_t sel[8], sel2[8];
        for (int t = 0; t < 200; t++) {
            /* coarse grids: many exact ties among scores and group sums */
            for (int e = 0; e < p->n_experts; e++) {
                s[e] = (float)(sm64(&rs) % 16) / 16.0f;
                bias[e] = (float)((int)(sm64(&rs) % 5) - 2) / 32.0f;
            }
            const float *b = t % 3 == 0 ? NULL : bias;
            kern_moe_route(p, 1, s, b, sel, w);
            route_by_sorting(p, s, b, sel2, w2);
            for (int i = 0; i < p->top_k; i++) {
                cr_assert_eq(sel[i], sel2[i], "params %zu token %d slot %d: %d vs %d", pi, t, i,
                             sel[i], sel2[i]);
                cr_assert_eq(w[i], w2[i], "params %zu token %d slot %d: weight", pi, t, i);
            }
        }
    }
}

Test(moe_ref, permute_is_a_stable_counting_sort) {
    enum { E = 9, T = 50, K = 3 };
    int32_t sel[T * K], off[E + 1], row_of[T * K], tok_of[T * K];
    uint64_t rs = 8;
    for (int i = 0; i < T * K; i++) sel[i] = (int32_t)(sm64(&rs) % E);
    kern_moe_permute(E, T, K, sel, off, row_of, tok_of);
    cr_assert_eq(off[0], 0);
    cr_assert_eq(off[E], T * K);
    int last_row[E];
    for (int e = 0; e < E; e++) last_row[e] = off[e] - 1;
    for (int i = 0; i < T * K; i++) {
        const int e = sel[i], r = row_of[i];
        cr_assert(r >= off[e] && r < off[e + 1], "pair %d (expert %d) at row %d", i, e, r);
        cr_assert(r == last_row[e] + 1, "pair %d: rows of expert %d not in pair order", i, e);
        last_row[e] = r;
        cr_assert_eq(tok_of[r], i / K);
    }
}

#ifdef KDS_HAVE_CUDA

#include "test_cuda_util.h"

/* ---- norms ------------------------------------------------------------------ */

static void norm_case(int rows, int n, bool gated, kern_dtype wdt, kern_dtype zdt, kern_dtype ydt,
                      bool with_w, bool in_place, uint64_t seed) {
    const size_t N = (size_t)rows * n;
    uint64_t rs = seed;
    float *x = tcu_malloc(N * 4), *z = tcu_malloc(N * 4), *w = tcu_malloc((size_t)n * 4);
    float *ref = tcu_malloc(N * 4), *got = tcu_malloc(N * 4);
    tcu_fill(&rs, x, N, -3.0f, 3.0f);
    tcu_fill(&rs, z, N, -6.0f, 6.0f);
    tcu_fill(&rs, w, n, 0.5f, 1.5f);
    for (int i = 0; i < n; i++) x[3 % rows * n + i] = 0.0f; /* a zero row stays zero */
    if (wdt == KERN_BF16) tcu_round_bf16(w, n);
    if (zdt == KERN_BF16) tcu_round_bf16(z, N);
    if (gated)
        kern_rmsnorm_gated(x, z, with_w ? w : NULL, KERN_F32, rows, n, 1e-5f, ref);
    else
        for (int r = 0; r < rows; r++)
            kern_rmsnorm(x + (size_t)r * n, with_w ? w : NULL, KERN_F32, n, 1e-5f, ref + (size_t)r * n);
    float *d_x = tcu_upload(x, N);
    void *d_z = tcu_upload_as(z, N, zdt), *d_w = tcu_upload_as(w, n, wdt);
    void *d_y = in_place ? (void *)d_x : tcu_dev_alloc(N * (ydt == KERN_F32 ? 4 : 2));
    kern_cuda_norm_args a = {.rows = rows, .n = n, .eps = 1e-5f, .x = d_x,
                             .z = gated ? d_z : NULL, .z_dtype = zdt,
                             .w = with_w ? d_w : NULL, .w_dtype = wdt, .y = d_y, .y_dtype = ydt};
    kds_err err;
    cr_assert_eq(kern_cuda_rmsnorm(&a, NULL, &err), KDS_OK, "%s", err.msg);
    tcu_sync();
    if (ydt == KERN_F32) {
        tcu_d2h(got, d_y, N * 4);
    } else {
        uint16_t *h = tcu_malloc(N * 2);
        tcu_d2h(h, d_y, N * 2);
        for (size_t i = 0; i < N; i++) got[i] = kern_bf16_to_f32(h[i]);
        tcu_round_bf16(ref, N);
        free(h);
    }
    char what[128];
    snprintf(what, sizeof what, "rmsnorm%s rows=%d n=%d w=%d z=%d y=%d%s", gated ? " gated" : "",
             rows, n, with_w ? (int)wdt : -1, (int)zdt, (int)ydt, in_place ? " in place" : "");
    /* fp32: sum order and expf only; bf16 output: one rounding step apart */
    tcu_assert_close(got, ref, N, ydt == KERN_F32 ? 2e-6 : 8e-3, what);
    kern_cuda_free(d_x);
    kern_cuda_free(d_z);
    kern_cuda_free(d_w);
    if (!in_place) kern_cuda_free(d_y);
    free(x);
    free(z);
    free(w);
    free(ref);
    free(got);
}

Test(cuda_ops, rmsnorm_matches_cpu) {
    tcu_require_device();
    norm_case(37, 2304, false, KERN_F32, KERN_F32, KERN_F32, true, false, 1);
    norm_case(37, 2304, false, KERN_BF16, KERN_F32, KERN_F32, true, false, 2);
    norm_case(5, 2304, false, KERN_BF16, KERN_F32, KERN_BF16, true, false, 3);
    norm_case(9, 100, false, KERN_F32, KERN_F32, KERN_F32, false, true, 4);
}

Test(cuda_ops, gated_rmsnorm_matches_cpu) {
    tcu_require_device();
    norm_case(5 * 32, 128, true, KERN_F32, KERN_F32, KERN_F32, true, false, 5);
    norm_case(3 * 32, 128, true, KERN_BF16, KERN_BF16, KERN_F32, true, true, 6);
    norm_case(7, 64, true, KERN_F32, KERN_BF16, KERN_BF16, false, false, 7);
    /* rows of 512 and more take the CTA-per-row kernel: its gate, in place */
    norm_case(3, 1000, true, KERN_BF16, KERN_BF16, KERN_F32, true, true, 8);
    norm_case(2, 512, true, KERN_F32, KERN_F32, KERN_BF16, false, false, 9);
}

/* ---- MoE ---------------------------------------------------------------------- */

static void route_case(const kern_moe_route_params *p, int T, bool with_bias, bool sigmoid,
                       bool ties, uint64_t seed) {
    const int E = p->n_experts, k = p->top_k;
    uint64_t rs = seed;
    float *logits = tcu_malloc((size_t)T * E * 4), *scores = tcu_malloc((size_t)T * E * 4);
    float *bias = tcu_malloc((size_t)E * 4);
    for (size_t i = 0; i < (size_t)T * E; i++)
        logits[i] = ties ? (float)((int)(tcu_next(&rs) % 9) - 4) / 2.0f : tcu_uniform(&rs, -4, 4);
    for (int e = 0; e < E; e++)
        bias[e] = ties ? (float)((int)(tcu_next(&rs) % 3) - 1) / 8.0f : tcu_uniform(&rs, -0.1f, 0.1f);
    /* the scores both sides route: the GPU's own sigmoid when asked, here
     * the same formula (1 / (1 + expf(-x))) on the CPU */
    for (size_t i = 0; i < (size_t)T * E; i++)
        scores[i] = sigmoid ? 1.0f / (1.0f + expf(-logits[i])) : logits[i] / 8.0f + 0.5f;
    int32_t *sel = tcu_malloc((size_t)T * k * 4), *row_of = tcu_malloc((size_t)T * k * 4);
    int32_t *tok_of = tcu_malloc((size_t)T * k * 4), *off = tcu_malloc((size_t)(E + 1) * 4);
    float *w = tcu_malloc((size_t)T * k * 4);
    kern_moe_route(p, T, scores, with_bias ? bias : NULL, sel, w);
    kern_moe_permute(E, T, k, sel, off, row_of, tok_of);

    float *d_in = tcu_upload(sigmoid ? logits : scores, (size_t)T * E);
    float *d_bias = tcu_upload(bias, E);
    int32_t *d_sel = tcu_dev_alloc((size_t)T * k * 4), *d_row = tcu_dev_alloc((size_t)T * k * 4);
    int32_t *d_tok = tcu_dev_alloc((size_t)T * k * 4), *d_off = tcu_dev_alloc((size_t)(E + 1) * 4);
    float *d_w = tcu_dev_alloc((size_t)T * k * 4);
    tcu_poison(d_row, (size_t)T * k * 4);
    tcu_poison(d_tok, (size_t)T * k * 4);
    kern_cuda_moe_route_args a = {.p = *p, .T = T, .logits = d_in, .apply_sigmoid = sigmoid,
                                  .bias = with_bias ? d_bias : NULL, .sel = d_sel, .w = d_w,
                                  .exp_off = d_off, .row_of = d_row, .tok_of = d_tok};
    kds_err err;
    cr_assert_eq(kern_cuda_moe_route(&a, NULL, &err), KDS_OK, "%s", err.msg);
    tcu_sync();
    int32_t *g_sel = tcu_malloc((size_t)T * k * 4), *g_row = tcu_malloc((size_t)T * k * 4);
    int32_t *g_tok = tcu_malloc((size_t)T * k * 4), *g_off = tcu_malloc((size_t)(E + 1) * 4);
    float *g_w = tcu_malloc((size_t)T * k * 4);
    tcu_d2h(g_sel, d_sel, (size_t)T * k * 4);
    tcu_d2h(g_row, d_row, (size_t)T * k * 4);
    tcu_d2h(g_tok, d_tok, (size_t)T * k * 4);
    tcu_d2h(g_off, d_off, (size_t)(E + 1) * 4);
    tcu_d2h(g_w, d_w, (size_t)T * k * 4);
    for (size_t i = 0; i < (size_t)T * k; i++) {
        cr_assert_eq(g_sel[i], sel[i], "token %zu slot %zu: gpu expert %d, cpu %d", i / k, i % k,
                     g_sel[i], sel[i]);
        if (sigmoid) /* the two expf may differ by an ulp */
            cr_assert(fabsf(g_w[i] - w[i]) <= 1e-6f * fabsf(w[i]) + 1e-30f, "weight %zu", i);
        else
            cr_assert_eq(g_w[i], w[i], "weight %zu: %.9g vs %.9g", i, (double)g_w[i], (double)w[i]);
        cr_assert_eq(g_row[i], row_of[i], "row_of[%zu]", i);
        cr_assert_eq(g_tok[i], tok_of[i], "tok_of[%zu]", i);
    }
    for (int e = 0; e <= E; e++) cr_assert_eq(g_off[e], off[e], "exp_off[%d]", e);
    printf("cuda check moe route E=%d k=%d groups=%d T=%d: %d selections identical\n", E, k,
           p->n_group, T, T * k);
    void *fr[] = {d_in, d_bias, d_sel, d_row, d_tok, d_off, d_w};
    for (size_t i = 0; i < sizeof fr / sizeof fr[0]; i++) kern_cuda_free(fr[i]);
    void *hf[] = {logits, scores, bias, sel, row_of, tok_of, off, w, g_sel, g_row, g_tok, g_off, g_w};
    for (size_t i = 0; i < sizeof hf / sizeof hf[0]; i++) free(hf[i]);
}

static const kern_moe_route_params kimi_router = {
    .n_experts = 256, .top_k = 8, .n_group = 1, .topk_group = 1, .renormalize = 1,
    .routed_scaling_factor = 2.446f};

Test(cuda_ops, moe_route_kimi_router) {
    tcu_require_device();
    route_case(&kimi_router, 300, true, false, false, 1);
    route_case(&kimi_router, 64, true, true, false, 2);
    route_case(&kimi_router, 40, false, false, true, 3);
}

Test(cuda_ops, moe_route_grouped_with_ties) {
    tcu_require_device();
    const kern_moe_route_params p = {.n_experts = 64, .top_k = 6, .n_group = 8, .topk_group = 3,
                                     .renormalize = 1, .routed_scaling_factor = 1.5f};
    route_case(&p, 100, true, false, true, 4);
    const kern_moe_route_params q = {.n_experts = 40, .top_k = 3, .n_group = 1, .topk_group = 1,
                                     .renormalize = 0, .routed_scaling_factor = 1.0f};
    route_case(&q, 33, false, true, false, 5);
}

Test(cuda_ops, moe_gather_and_combine_match_the_engine_loops) {
    tcu_require_device();
    const int T = 21, k = 3, E = 5, hidden = 136;
    uint64_t rs = 9;
    int32_t sel[21 * 3], off[6], row_of[21 * 3], tok_of[21 * 3];
    for (int i = 0; i < T * k; i++) sel[i] = (int32_t)(tcu_next(&rs) % E);
    kern_moe_permute(E, T, k, sel, off, row_of, tok_of);
    float *x = tcu_malloc((size_t)T * hidden * 4), *yg = tcu_malloc((size_t)T * k * hidden * 4);
    float *w = tcu_malloc((size_t)T * k * 4), *sh = tcu_malloc((size_t)T * hidden * 4);
    float *ref = tcu_malloc((size_t)T * hidden * 4), *got = tcu_malloc((size_t)T * k * hidden * 4);
    tcu_fill(&rs, x, (size_t)T * hidden, -1, 1);
    tcu_fill(&rs, yg, (size_t)T * k * hidden, -1, 1);
    tcu_fill(&rs, w, (size_t)T * k, 0, 1);
    tcu_fill(&rs, sh, (size_t)T * hidden, -1, 1);
    float *d_x = tcu_upload(x, (size_t)T * hidden), *d_yg = tcu_upload(yg, (size_t)T * k * hidden);
    float *d_w = tcu_upload(w, (size_t)T * k), *d_sh = tcu_upload(sh, (size_t)T * hidden);
    int32_t *d_row = tcu_dev_alloc(sizeof row_of), *d_tok = tcu_dev_alloc(sizeof tok_of);
    tcu_h2d(d_row, row_of, sizeof row_of);
    tcu_h2d(d_tok, tok_of, sizeof tok_of);
    float *d_xg = tcu_dev_alloc((size_t)T * k * hidden * 4), *d_out = tcu_dev_alloc((size_t)T * hidden * 4);
    kds_err err;
    cr_assert_eq(kern_cuda_moe_gather(d_x, (size_t)hidden * 4, d_tok, T * k, d_xg, NULL, &err),
                 KDS_OK, "%s", err.msg);
    cr_assert_eq(kern_cuda_moe_combine(d_yg, d_row, d_w, T, k, hidden, d_sh, d_out, NULL, &err),
                 KDS_OK, "%s", err.msg);
    tcu_sync();
    tcu_d2h(got, d_xg, (size_t)T * k * hidden * 4);
    for (int r = 0; r < T * k; r++)
        cr_assert(memcmp(got + (size_t)r * hidden, x + (size_t)tok_of[r] * hidden, (size_t)hidden * 4) == 0,
                  "gathered row %d is not token %d", r, tok_of[r]);
    for (int t = 0; t < T; t++) { /* the engine's loop */
        float *o = ref + (size_t)t * hidden;
        memset(o, 0, (size_t)hidden * 4);
        for (int n = 0; n < k; n++) {
            const float wg = w[t * k + n];
            const float *y = yg + (size_t)row_of[t * k + n] * hidden;
            for (int i = 0; i < hidden; i++) o[i] += wg * y[i];
        }
        for (int i = 0; i < hidden; i++) o[i] += sh[(size_t)t * hidden + i];
    }
    tcu_d2h(got, d_out, (size_t)T * hidden * 4);
    cr_assert(memcmp(got, ref, (size_t)T * hidden * 4) == 0, "combine differs from the CPU loop");
    void *fr[] = {d_x, d_yg, d_w, d_sh, d_row, d_tok, d_xg, d_out};
    for (size_t i = 0; i < sizeof fr / sizeof fr[0]; i++) kern_cuda_free(fr[i]);
    free(x);
    free(yg);
    free(w);
    free(sh);
    free(ref);
    free(got);
}

/* ---- sampling ------------------------------------------------------------------ */

/* N rows sampled on the device against kern_sample on the CPU, `steps`
 * times. sp: one set of settings for every row (n_sp 1) or each row's own
 * (n_sp N: kern_cuda_sample_args.row_params). */
static void sample_case_rows(int N, int V, const kern_sample_params *sp, int n_sp, int n_pen,
                             int steps, bool ties, uint64_t seed) {
    uint64_t rs = seed;
    float *logits = tcu_malloc((size_t)N * V * 4);
    int32_t *pen = tcu_malloc((size_t)N * (n_pen ? n_pen : 1) * 4);
    uint64_t *rng = tcu_malloc((size_t)N * 4 * 8), *g_rng = tcu_malloc((size_t)N * 4 * 8);
    float *sp_ = tcu_malloc((size_t)V * 4);
    int32_t *si = tcu_malloc((size_t)V * 4), *tok = tcu_malloc((size_t)N * 4);
    for (int i = 0; i < N * 4; i++) rng[i] = tcu_next(&rs);
    float *d_logits = tcu_dev_alloc((size_t)N * V * 4);
    int32_t *d_pen = tcu_dev_alloc((size_t)N * (n_pen ? n_pen : 1) * 4);
    uint64_t *d_rng = tcu_dev_alloc((size_t)N * 4 * 8);
    int32_t *d_tok = tcu_dev_alloc((size_t)N * 4);
    kern_sample_params *d_sp = NULL;
    if (n_sp > 1) {
        d_sp = tcu_dev_alloc((size_t)N * sizeof *d_sp);
        tcu_h2d(d_sp, sp, (size_t)N * sizeof *d_sp);
    }
    tcu_h2d(d_rng, rng, (size_t)N * 4 * 8);
    int matches = 0;
    for (int step = 0; step < steps; step++) {
        for (size_t i = 0; i < (size_t)N * V; i++)
            logits[i] = ties ? (float)((int)(tcu_next(&rs) % 41) - 20) / 4.0f
                             : tcu_uniform(&rs, -8.0f, 8.0f) * (step % 2 ? 1.0f : 3.0f);
        for (int i = 0; i < N * n_pen; i++) /* some repeats and some out of range */
            pen[i] = (int32_t)(tcu_next(&rs) % (uint64_t)(V + V / 8)) - (i % 7 == 0 ? V : 0);
        tcu_h2d(d_logits, logits, (size_t)N * V * 4);
        if (n_pen) tcu_h2d(d_pen, pen, (size_t)N * n_pen * 4);
        kern_cuda_sample_args a = {.N = N, .V = V, .logits = d_logits, .params = *sp,
                                   .row_params = d_sp,
                                   .penalty_ids = n_pen ? d_pen : NULL, .n_penalty = n_pen,
                                   .rng = d_rng, .tokens = d_tok};
        kds_err err;
        cr_assert_eq(kern_cuda_sample(&a, NULL, &err), KDS_OK, "%s", err.msg);
        tcu_sync();
        tcu_d2h(tok, d_tok, (size_t)N * 4);
        tcu_d2h(g_rng, d_rng, (size_t)N * 4 * 8);
        for (int n = 0; n < N; n++) {
            const kern_sample_params *rp = n_sp > 1 ? &sp[n] : sp;
            int32_t want = kern_sample(logits + (size_t)n * V, V, rp, pen + (size_t)n * n_pen, n_pen,
                                       rng + 4 * n, sp_, si);
            cr_assert_eq(tok[n], want, "step %d row %d: gpu token %d, cpu %d (T=%g k=%d p=%g "
                         "min_p=%g)", step, n, tok[n], want, (double)rp->temperature, rp->top_k,
                         (double)rp->top_p, (double)rp->min_p);
            cr_assert(memcmp(g_rng + 4 * n, rng + 4 * n, 32) == 0, "step %d row %d: RNG state",
                      step, n);
            matches++;
        }
    }
    printf("cuda check sample N=%d V=%d T=%g k=%d p=%g min_p=%g pen=%d%s: %d draws identical\n", N,
           V, (double)sp->temperature, sp->top_k, (double)sp->top_p, (double)sp->min_p, n_pen,
           n_sp > 1 ? " (settings per row)" : "", matches);
    if (d_sp) kern_cuda_free(d_sp);
    kern_cuda_free(d_logits);
    kern_cuda_free(d_pen);
    kern_cuda_free(d_rng);
    kern_cuda_free(d_tok);
    free(logits);
    free(pen);
    free(rng);
    free(g_rng);
    free(sp_);
    free(si);
    free(tok);
}

static void sample_case(int N, int V, const kern_sample_params *sp, int n_pen, int steps, bool ties,
                        uint64_t seed) {
    sample_case_rows(N, V, sp, 1, n_pen, steps, ties, seed);
}

Test(cuda_ops, sample_greedy) {
    tcu_require_device();
    const kern_sample_params g = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f,
                                  .repeat_penalty = 1.0f};
    sample_case(6, 5000, &g, 0, 4, true, 1);
    const kern_sample_params gp = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f,
                                   .repeat_penalty = 1.3f};
    sample_case(4, 3001, &gp, 24, 4, true, 2);
}

Test(cuda_ops, sample_temperature_top_k) {
    tcu_require_device();
    const kern_sample_params a = {.temperature = 0.8f, .top_k = 40, .top_p = 1.0f, .min_p = 0.0f,
                                  .repeat_penalty = 1.0f};
    sample_case(5, 5000, &a, 0, 6, false, 3);
    sample_case(3, 4000, &a, 0, 4, true, 4); /* ties at the k-th value */
    const kern_sample_params b = {.temperature = 1.7f, .top_k = 1000, .top_p = 1.0f,
                                  .min_p = 0.0f, .repeat_penalty = 1.0f};
    sample_case(2, 3000, &b, 0, 3, false, 5);
}

Test(cuda_ops, sample_top_p_min_p_penalty) {
    tcu_require_device();
    const kern_sample_params d = {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f,
                                  .repeat_penalty = 1.0f}; /* the engine's defaults */
    sample_case(4, 5000, &d, 0, 6, false, 6);
    const kern_sample_params e = {.temperature = 0.7f, .top_k = 0, .top_p = 0.6f, .min_p = 0.0f,
                                  .repeat_penalty = 1.2f}; /* top_k off: all V = 900 */
    sample_case(3, 900, &e, 16, 5, true, 7);
    const kern_sample_params f = {.temperature = 1.0f, .top_k = 200, .top_p = 1.0f, .min_p = 0.3f,
                                  .repeat_penalty = 1.0f};
    sample_case(3, 2000, &f, 0, 4, false, 8);
}

/* One launch, each row with its own settings (streams of one batched
 * decode step that sample differently): greedy, the defaults, a hot
 * temperature with a small top-k, top-k off with top-p, min-p, penalties. */
Test(cuda_ops, sample_settings_per_row) {
    tcu_require_device();
    const kern_sample_params rows[6] = {
        {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .repeat_penalty = 1.0f},
        {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f, .repeat_penalty = 1.0f},
        {.temperature = 1.7f, .top_k = 5, .top_p = 1.0f, .min_p = 0.0f, .repeat_penalty = 1.3f},
        {.temperature = 0.7f, .top_k = 0, .top_p = 0.6f, .min_p = 0.0f, .repeat_penalty = 1.2f},
        {.temperature = 1.0f, .top_k = 200, .top_p = 1.0f, .min_p = 0.3f, .repeat_penalty = 1.0f},
        {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .repeat_penalty = 1.5f},
    };
    sample_case_rows(6, 900, rows, 6, 16, 4, false, 11); /* top_k off keeps V = 900 <= 1024 */
    sample_case_rows(6, 900, rows, 6, 0, 3, true, 12);
}

/* Kimi-Linear's vocabulary: 163,840 logits per row. */
Test(cuda_ops, sample_kimi_vocabulary, .timeout = 120) {
    tcu_require_device();
    const kern_sample_params d = {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f,
                                  .repeat_penalty = 1.1f};
    sample_case(2, 163840, &d, 64, 2, false, 9);
    const kern_sample_params g = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f,
                                  .repeat_penalty = 1.0f};
    sample_case(2, 163840, &g, 0, 2, false, 10);
}

/* ---- no device needed ------------------------------------------------------------ */

Test(cuda_ops, rejects_bad_arguments) {
    static float dummy[64] __attribute__((aligned(16)));
    kds_err err;
    kern_cuda_norm_args n = {.rows = 2, .n = 8, .eps = 1e-5f, .x = dummy, .y = dummy,
                             .y_dtype = KERN_F32};
    kern_cuda_norm_args m = n;
    m.n = 0;
    cr_assert_eq(kern_cuda_rmsnorm(&m, NULL, &err), KDS_INVALID_ARG);
    m = n;
    m.y_dtype = KERN_F16;
    cr_assert_eq(kern_cuda_rmsnorm(&m, NULL, &err), KDS_INVALID_ARG);
    m = n;
    m.y_dtype = KERN_BF16; /* bf16 y over the fp32 x */
    cr_assert_eq(kern_cuda_rmsnorm(&m, NULL, &err), KDS_INVALID_ARG);
    m = n;
    m.rows = 0;
    cr_assert_eq(kern_cuda_rmsnorm(&m, NULL, &err), KDS_OK);

    kern_cuda_moe_route_args r = {.p = kimi_router, .T = 1, .logits = dummy, .sel = (int32_t *)dummy,
                                  .w = dummy, .exp_off = (int32_t *)dummy,
                                  .row_of = (int32_t *)dummy, .tok_of = (int32_t *)dummy};
    kern_cuda_moe_route_args q = r;
    q.p.top_k = 300;
    cr_assert_eq(kern_cuda_moe_route(&q, NULL, &err), KDS_INVALID_ARG);
    q = r;
    q.p.n_experts = 2048;
    q.p.top_k = 8;
    cr_assert_eq(kern_cuda_moe_route(&q, NULL, &err), KDS_UNSUPPORTED);
    q = r;
    q.p.n_group = 3; /* 256 % 3 != 0 */
    cr_assert_eq(kern_cuda_moe_route(&q, NULL, &err), KDS_INVALID_ARG);
    q = r;
    q.p.n_group = 32;
    q.p.topk_group = 1; /* one group of 8 cannot give 9 */
    q.p.top_k = 9;
    cr_assert_eq(kern_cuda_moe_route(&q, NULL, &err), KDS_INVALID_ARG);
    q = r;
    q.logits = NULL;
    cr_assert_eq(kern_cuda_moe_route(&q, NULL, &err), KDS_INVALID_ARG);
    cr_assert_eq(kern_cuda_moe_gather(dummy, 12, (int32_t *)dummy, 1, dummy, NULL, &err),
                 KDS_INVALID_ARG);
    cr_assert_eq(kern_cuda_moe_combine(NULL, NULL, NULL, 1, 1, 8, NULL, dummy, NULL, &err),
                 KDS_INVALID_ARG);

    kern_cuda_sample_args s = {.N = 1, .V = 163840, .logits = dummy, .rng = (uint64_t *)dummy,
                               .tokens = (int32_t *)dummy,
                               .params = {.temperature = 1.0f, .top_k = 0, .top_p = 0.9f,
                                          .repeat_penalty = 1.0f}};
    cr_assert_eq(kern_cuda_sample(&s, NULL, &err), KDS_UNSUPPORTED);
    cr_assert(strstr(err.msg, "CPU") != NULL, "message: %s", err.msg);
    s.params.top_k = 2000;
    cr_assert_eq(kern_cuda_sample(&s, NULL, &err), KDS_UNSUPPORTED);
    s.params.top_k = 40;
    s.logits = NULL;
    cr_assert_eq(kern_cuda_sample(&s, NULL, &err), KDS_INVALID_ARG);
    s.N = -1;
    cr_assert_eq(kern_cuda_sample(&s, NULL, &err), KDS_INVALID_ARG);
}

#else /* !KDS_HAVE_CUDA */

Test(cuda_ops, skipped) {
    cr_skip_test("built without CUDA");
}

#endif
