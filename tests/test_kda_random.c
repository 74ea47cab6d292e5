/*
 * test_kda_random.c - the KDA core (kernels/cpu/kda.c) on generated data:
 * the decode and chunked paths against a double-precision transcription of
 * the recurrence (kda-model-spec.md §3.5), at Kimi's head size K = V = 128
 * and at odd sizes, with decay up to e^-1920 per token (A_log = log 64,
 * g_raw up to +30), GVA, both gate forms, and the [hv0, hv1) head-range
 * contract (split calls give bit-identical results and touch nothing else).
 *
 * Tolerance: max |ours - ref| <= 1e-5 * max |ref| per output tensor, as for
 * the golden files (the double reference is closer to the truth than fla's
 * float32 one). Measured errors are printed.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kern.h"

#define REL_TOL 1e-5

/* ------------------------------------------------------------------------ */
/* Data                                                                      */

static uint64_t rng_state;

static void rng_seed(uint64_t s) {
    rng_state = s * 0x9E3779B97F4A7C15ull + 1;
}

static float uniform(float lo, float hi) { /* xorshift64*, 24 random bits */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    uint64_t x = rng_state * 0x2545F4914F6CDD1Dull;
    return lo + (hi - lo) * (float)((x >> 40) * (1.0 / 16777216.0));
}

static float *alloc_f(size_t n) {
    float *p = calloc(n ? n : 1, sizeof *p);
    cr_assert_not_null(p);
    return p;
}

/* One generated KDA problem; inputs already activated (q, k normalised, g
 * gated, beta in (0, 1)). */
typedef struct kda_case {
    kern_kda_shape sh;
    int T;
    float *q, *k, *v, *g, *beta, *h0;
} kda_case;

/* Per value head, the decay regime: A_log and the range of g_raw. */
typedef struct decay {
    float A_log, lo, hi;
} decay;

static void case_make(kda_case *c, int H, int HV, int K, int V, int T, const decay *dec, int n_dec,
                      float lower_bound, uint64_t seed) {
    rng_seed(seed);
    c->sh = (kern_kda_shape){H, HV, K, V, 1.0f / sqrtf((float)K)};
    c->T = T;
    size_t nqk = (size_t)T * H * K, ng = (size_t)T * HV * K;
    c->q = alloc_f(nqk);
    c->k = alloc_f(nqk);
    c->v = alloc_f((size_t)T * HV * V);
    c->g = alloc_f(ng);
    c->beta = alloc_f((size_t)T * HV);
    c->h0 = alloc_f((size_t)HV * K * V);
    for (size_t i = 0; i < nqk; i++) {
        c->q[i] = uniform(-1, 1);
        c->k[i] = uniform(-1, 1);
    }
    kern_l2norm(c->q, T * H, K, 1e-6f);
    kern_l2norm(c->k, T * H, K, 1e-6f);
    for (size_t i = 0; i < (size_t)T * HV * V; i++)
        c->v[i] = uniform(-1, 1);
    for (size_t i = 0; i < (size_t)T * HV; i++)
        c->beta[i] = kern_sigmoid(uniform(-4, 4));
    for (size_t i = 0; i < (size_t)HV * K * V; i++)
        c->h0[i] = uniform(-0.5f, 0.5f);
    float *A_log = alloc_f(HV), *dt_bias = alloc_f((size_t)HV * K);
    for (int hv = 0; hv < HV; hv++) {
        const decay *d = &dec[hv % n_dec];
        A_log[hv] = d->A_log;
        for (int i = 0; i < K; i++)
            dt_bias[(size_t)hv * K + i] = uniform(-1, 1);
        for (int t = 0; t < T; t++)
            for (int i = 0; i < K; i++)
                c->g[((size_t)t * HV + hv) * K + i] = uniform(d->lo, d->hi);
    }
    kern_kda_gate(c->g, A_log, dt_bias, T, HV, K, lower_bound, c->g);
    free(A_log);
    free(dt_bias);
}

static void case_free(kda_case *c) {
    free(c->q);
    free(c->k);
    free(c->v);
    free(c->g);
    free(c->beta);
    free(c->h0);
}

/* The recurrence of spec §3.5 in double, token by token, from h0. */
static void reference(const kda_case *c, float *o, float *state) {
    const int H = c->sh.H, HV = c->sh.HV, K = c->sh.K, V = c->sh.V, G = HV / H;
    double *S = malloc((size_t)K * V * sizeof *S), *u = malloc((size_t)V * sizeof *u);
    cr_assert(S && u);
    for (int hv = 0; hv < HV; hv++) {
        int h = hv / G;
        for (size_t i = 0; i < (size_t)K * V; i++)
            S[i] = c->h0[(size_t)hv * K * V + i];
        for (int t = 0; t < c->T; t++) {
            const float *q = c->q + ((size_t)t * H + h) * K, *k = c->k + ((size_t)t * H + h) * K;
            const float *v = c->v + ((size_t)t * HV + hv) * V;
            const float *g = c->g + ((size_t)t * HV + hv) * K;
            double b = c->beta[(size_t)t * HV + hv];
            for (int d = 0; d < K; d++)
                for (int j = 0; j < V; j++)
                    S[(size_t)d * V + j] *= exp((double)g[d]);
            for (int j = 0; j < V; j++) {
                double p = 0.0;
                for (int d = 0; d < K; d++)
                    p += (double)k[d] * S[(size_t)d * V + j];
                u[j] = b * (v[j] - p);
            }
            for (int d = 0; d < K; d++)
                for (int j = 0; j < V; j++)
                    S[(size_t)d * V + j] += (double)k[d] * u[j];
            for (int j = 0; j < V; j++) {
                double y = 0.0;
                for (int d = 0; d < K; d++)
                    y += (double)q[d] * S[(size_t)d * V + j];
                o[((size_t)t * HV + hv) * V + j] = (float)(c->sh.scale * y);
            }
        }
        for (size_t i = 0; i < (size_t)K * V; i++)
            state[(size_t)hv * K * V + i] = (float)S[i];
    }
    free(S);
    free(u);
}

/* ------------------------------------------------------------------------ */
/* Paths                                                                     */

static void run_recurrent(const kda_case *c, int per_token, float *o, float *state) {
    const kern_kda_shape *sh = &c->sh;
    memcpy(state, c->h0, (size_t)sh->HV * sh->K * sh->V * sizeof *state);
    if (!per_token) {
        kern_kda_recurrent(sh, c->T, c->q, c->k, c->v, c->g, c->beta, state, o, 0, sh->HV);
        return;
    }
    size_t HK = (size_t)sh->H * sh->K, HVK = (size_t)sh->HV * sh->K, HVV = (size_t)sh->HV * sh->V;
    for (size_t t = 0; t < (size_t)c->T; t++)
        kern_kda_recurrent(sh, 1, c->q + t * HK, c->k + t * HK, c->v + t * HVV, c->g + t * HVK,
                           c->beta + t * sh->HV, state, o + t * HVV, 0, sh->HV);
}

static void run_chunked(const kda_case *c, int chunk, float *o, float *state, int hv0, int hv1) {
    const kern_kda_shape *sh = &c->sh;
    float *ws = alloc_f(kern_kda_chunked_workspace_floats(sh, chunk));
    kern_kda_chunked(sh, c->T, chunk, c->q, c->k, c->v, c->g, c->beta, state, o, hv0, hv1, ws);
    free(ws);
}

static double rel_err(const float *x, const float *ref, size_t n) {
    double err = 0.0, mag = 0.0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)x[i] - ref[i]);
        if (!(e <= err)) err = isnan(e) ? INFINITY : e;
        if (fabs(ref[i]) > mag) mag = fabs(ref[i]);
    }
    return err == 0.0 ? 0.0 : err / (mag > 0.0 ? mag : 1e-30);
}

static void check(const char *name, const char *path, const float *o, const float *state,
                  const float *o_ref, const float *s_ref, const kda_case *c) {
    size_t no = (size_t)c->T * c->sh.HV * c->sh.V, ns = (size_t)c->sh.HV * c->sh.K * c->sh.V;
    double eo = rel_err(o, o_ref, no), es = rel_err(state, s_ref, ns);
    printf("kda random %-22s %-14s o %.2e  hT %.2e (max err / max|ref|)\n", name, path, eo, es);
    fflush(stdout);
    cr_expect(eo <= REL_TOL, "%s %s: o max err / max|ref| = %.3e", name, path, eo);
    cr_expect(es <= REL_TOL, "%s %s: hT max err / max|ref| = %.3e", name, path, es);
}

/* Every path against the double reference. */
static void check_all_paths(const char *name, const kda_case *c, const int *chunks, int n_chunks) {
    size_t no = (size_t)c->T * c->sh.HV * c->sh.V, ns = (size_t)c->sh.HV * c->sh.K * c->sh.V;
    float *o_ref = alloc_f(no), *s_ref = alloc_f(ns), *o = alloc_f(no), *s = alloc_f(ns);
    reference(c, o_ref, s_ref);
    run_recurrent(c, 1, o, s);
    check(name, "recurrent/tok", o, s, o_ref, s_ref, c);
    run_recurrent(c, 0, o, s);
    check(name, "recurrent/all", o, s, o_ref, s_ref, c);
    for (int i = 0; i < n_chunks; i++) {
        char path[32];
        snprintf(path, sizeof path, "chunked C=%d", chunks[i]);
        memcpy(s, c->h0, ns * sizeof *s);
        memset(o, 0, no * sizeof *o);
        run_chunked(c, chunks[i], o, s, 0, c->sh.HV);
        check(name, path, o, s, o_ref, s_ref, c);
    }
    free(o_ref);
    free(s_ref);
    free(o);
    free(s);
}

/* ------------------------------------------------------------------------ */
/* Tests                                                                     */

/* Kimi's shape (K = V = 128), one regime per head from mild to extreme:
 * A_log = log 64 with g_raw up to +30 gives g down to -64 * 31 per token. */
static const decay MIXED[] = {
    {-0.6931472f, -6.0f, 6.0f},  /* A = 0.5 */
    {0.0f, -10.0f, 10.0f},       /* A = 1 */
    {2.7725887f, -5.0f, 30.0f},  /* A = 16 */
    {4.1588831f, -30.0f, 30.0f}, /* A = 64, some dims barely decay, others vanish */
};

Test(kda_random, chunked_matches_recurrent_extreme_decay) {
    kda_case c;
    case_make(&c, 4, 4, 128, 128, 300, MIXED, 4, 0.0f, 1);
    static const int chunks[] = {64, 16, 7, 1, 300, 512};
    check_all_paths("K=V=128 H=4", &c, chunks, 6);
    case_free(&c);
}

Test(kda_random, gva) {
    kda_case c;
    case_make(&c, 2, 8, 128, 128, 300, MIXED, 4, 0.0f, 2);
    static const int chunks[] = {64, 7};
    check_all_paths("GVA H=2 HV=8", &c, chunks, 2);
    case_free(&c);
}

Test(kda_random, odd_sizes) {
    static const int chunks[] = {64, 13};
    kda_case c;
    /* below the BLAS threshold, nothing a multiple of 16 */
    case_make(&c, 3, 6, 40, 72, 131, MIXED, 4, 0.0f, 3);
    check_all_paths("H=3 HV=6 K=40 V=72", &c, chunks, 2);
    case_free(&c);
    /* V past one recurrent tile (128) with a remainder, K not a multiple of 16 */
    case_make(&c, 1, 1, 136, 200, 77, MIXED + 2, 1, 0.0f, 4);
    check_all_paths("K=136 V=200", &c, chunks, 2);
    case_free(&c);
}

Test(kda_random, lower_bound_gate) {
    static const decay lb[] = {{0.0f, -8.0f, 8.0f}, {1.5f, -3.0f, 3.0f}};
    static const int chunks[] = {64, 16};
    kda_case c;
    case_make(&c, 2, 2, 64, 64, 150, lb, 2, -5.0f, 5);
    check_all_paths("lower bound -5", &c, chunks, 2);
    case_free(&c);
}

/* A decay of exactly 0 (g = -inf, e.g. from an infinite gate input) wipes
 * the affected key rows; both paths must give the reference, not NaN. */
Test(kda_random, infinite_decay) {
    static const int chunks[] = {64, 5};
    kda_case c;
    case_make(&c, 1, 2, 32, 32, 70, MIXED, 2, 0.0f, 10);
    for (int t = 3; t < 70; t += 11)
        for (int d = 0; d < 32; d += 3)
            c.g[((size_t)t * 2 + (t & 1)) * 32 + d] = -INFINITY;
    check_all_paths("g = -inf in places", &c, chunks, 2);
    case_free(&c);
}

static int same_bits(const float *a, const float *b, size_t n) {
    return memcmp(a, b, n * sizeof *a) == 0;
}

/* Splitting [0, HV) among callers gives bit-identical results, and a range
 * writes only its own heads' o and state. */
Test(kda_random, head_ranges) {
    kda_case c;
    case_make(&c, 2, 4, 64, 48, 100, MIXED, 4, 0.0f, 6);
    const int HV = 4, K = 64, V = 48, T = 100;
    size_t no = (size_t)T * HV * V, ns = (size_t)HV * K * V, hs = (size_t)K * V;
    float *o1 = alloc_f(no), *s1 = alloc_f(ns), *o2 = alloc_f(no), *s2 = alloc_f(ns);
    for (int path = 0; path < 2; path++) {
        const char *name = path ? "chunked" : "recurrent";
        memcpy(s1, c.h0, ns * sizeof *s1);
        memcpy(s2, c.h0, ns * sizeof *s2);
        if (path) {
            run_chunked(&c, 16, o1, s1, 0, HV);
            run_chunked(&c, 16, o2, s2, 0, 2);
            run_chunked(&c, 16, o2, s2, 2, HV);
        } else {
            kern_kda_recurrent(&c.sh, T, c.q, c.k, c.v, c.g, c.beta, s1, o1, 0, HV);
            kern_kda_recurrent(&c.sh, T, c.q, c.k, c.v, c.g, c.beta, s2, o2, 2, HV);
            kern_kda_recurrent(&c.sh, T, c.q, c.k, c.v, c.g, c.beta, s2, o2, 0, 2);
        }
        cr_expect(same_bits(o1, o2, no), "%s: o differs when heads are split", name);
        cr_expect(same_bits(s1, s2, ns), "%s: state differs when heads are split", name);

        /* heads 1..2 only: heads 0 and 3 keep their sentinel bits */
        for (size_t i = 0; i < no; i++)
            o2[i] = 12345.0f;
        for (size_t i = 0; i < ns; i++)
            s2[i] = 12345.0f;
        memcpy(s2 + hs, c.h0 + hs, 2 * hs * sizeof *s2);
        if (path)
            run_chunked(&c, 16, o2, s2, 1, 3);
        else
            kern_kda_recurrent(&c.sh, T, c.q, c.k, c.v, c.g, c.beta, s2, o2, 1, 3);
        int outside_ok = 1, inside_ok = 1;
        for (int t = 0; t < T; t++)
            for (int hv = 0; hv < HV; hv++)
                for (int j = 0; j < V; j++) {
                    size_t i = ((size_t)t * HV + hv) * V + j;
                    if (hv == 0 || hv == 3)
                        outside_ok &= o2[i] == 12345.0f;
                    else
                        inside_ok &= o2[i] == o1[i];
                }
        for (size_t i = 0; i < hs; i++) {
            outside_ok &= s2[i] == 12345.0f && s2[3 * hs + i] == 12345.0f;
            inside_ok &= s2[hs + i] == s1[hs + i] && s2[2 * hs + i] == s1[2 * hs + i];
        }
        cr_expect(outside_ok, "%s: range [1, 3) wrote outside its heads", name);
        cr_expect(inside_ok, "%s: range [1, 3) differs from the full call", name);
    }
    free(o1);
    free(s1);
    free(o2);
    free(s2);
    case_free(&c);
}

/* The workspace may start at any float offset (the kernel aligns inside
 * it), and chunked prefill continues a state like repeated calls would. */
Test(kda_random, workspace_offset_and_continuation) {
    kda_case c;
    case_make(&c, 2, 2, 64, 64, 90, MIXED + 1, 3, 0.0f, 7);
    const int HV = 2, K = 64, V = 64, T = 90, chunk = 32;
    size_t no = (size_t)T * HV * V, ns = (size_t)HV * K * V;
    size_t nws = kern_kda_chunked_workspace_floats(&c.sh, chunk);
    float *ws = alloc_f(nws + 3), *o1 = alloc_f(no), *s1 = alloc_f(ns), *o2 = alloc_f(no),
          *s2 = alloc_f(ns);
    memcpy(s1, c.h0, ns * sizeof *s1);
    memcpy(s2, c.h0, ns * sizeof *s2);
    kern_kda_chunked(&c.sh, T, chunk, c.q, c.k, c.v, c.g, c.beta, s1, o1, 0, HV, ws);
    kern_kda_chunked(&c.sh, T, chunk, c.q, c.k, c.v, c.g, c.beta, s2, o2, 0, HV, ws + 3);
    cr_expect(same_bits(o1, o2, no) && same_bits(s1, s2, ns),
              "chunked result depends on the workspace's alignment");
    /* two calls of 64 + 26 tokens == one call of 90 at chunk 32? Only up to
     * rounding (the chunk boundaries differ), so compare to the reference */
    float *o_ref = alloc_f(no), *s_ref = alloc_f(ns);
    reference(&c, o_ref, s_ref);
    memcpy(s2, c.h0, ns * sizeof *s2);
    size_t t1 = 64;
    kern_kda_chunked(&c.sh, (int)t1, chunk, c.q, c.k, c.v, c.g, c.beta, s2, o2, 0, HV, ws);
    kern_kda_chunked(&c.sh, T - (int)t1, chunk, c.q + t1 * 2 * K, c.k + t1 * 2 * K,
                     c.v + t1 * HV * V, c.g + t1 * HV * K, c.beta + t1 * HV, s2, o2 + t1 * HV * V,
                     0, HV, ws + 1);
    check("64+26 tokens", "chunked C=32", o2, s2, o_ref, s_ref, &c);
    free(ws);
    free(o1);
    free(s1);
    free(o2);
    free(s2);
    free(o_ref);
    free(s_ref);
    case_free(&c);
}

/* T = 0 is a no-op for both paths. */
Test(kda_random, zero_tokens) {
    kda_case c;
    case_make(&c, 1, 1, 32, 32, 1, MIXED, 1, 0.0f, 8);
    size_t ns = 32 * 32;
    float *s = alloc_f(ns), o = 7.0f;
    memcpy(s, c.h0, ns * sizeof *s);
    float *ws = alloc_f(kern_kda_chunked_workspace_floats(&c.sh, 64));
    kern_kda_recurrent(&c.sh, 0, c.q, c.k, c.v, c.g, c.beta, s, &o, 0, 1);
    kern_kda_chunked(&c.sh, 0, 64, c.q, c.k, c.v, c.g, c.beta, s, &o, 0, 1, ws);
    free(ws);
    cr_expect(same_bits(s, c.h0, ns) && o == 7.0f, "T = 0 changed the state or o");
    free(s);
    case_free(&c);
}

/* Both gate forms against double precision, over arguments that cross the
 * softplus threshold (20) and saturate the sigmoid; dt_bias NULL; in place. */
Test(kda_random, gate_formula) {
    enum { T = 7, HV = 3, K = 24 };
    rng_seed(9);
    float raw[T * HV * K], g[T * HV * K], A_log[HV] = {-1.0f, 0.5f, 4.1588831f};
    float bias[HV * K];
    for (int i = 0; i < T * HV * K; i++)
        raw[i] = uniform(-40, 40);
    for (int i = 0; i < HV * K; i++)
        bias[i] = uniform(-2, 2);
    for (int form = 0; form < 4; form++) {
        float lb = form & 1 ? -5.0f : 0.0f;
        const float *b = form & 2 ? NULL : bias;
        memcpy(g, raw, sizeof g);
        kern_kda_gate(g, A_log, b, T, HV, K, lb, g); /* in place */
        double worst = 0.0;
        for (int t = 0; t < T; t++)
            for (int hv = 0; hv < HV; hv++)
                for (int d = 0; d < K; d++) {
                    size_t i = ((size_t)t * HV + hv) * K + d;
                    double x = (double)raw[i] + (b ? b[hv * K + d] : 0.0), a = exp(A_log[hv]);
                    double ref =
                        lb < 0 ? lb / (1.0 + exp(-a * x)) : -a * (x > 20.0 ? x : log1p(exp(x)));
                    /* relative, with a floor far below any decay that matters */
                    double e = fabs(g[i] - ref) / (fabs(ref) + 1e-30);
                    if (fabs(ref) > 1e-30 && e > worst) worst = e;
                }
        printf("kda random gate form %d (lb %g, bias %s): max rel err %.2e\n", form, lb,
               b ? "yes" : "NULL", worst);
        cr_expect(worst <= 2e-5, "gate form %d: max rel err %.3e", form, worst);
    }
}
