/*
 * test_cuda_kda.c - the CUDA KDA kernels (kern_cuda.h) against the CPU
 * reference of kern.h.
 *
 *   - argument checking and kern_cuda_available: run wherever the CUDA
 *     kernels are built, GPU or not (no device is touched);
 *   - the fused decode (kern_cuda_kda_decode) against kern_l2norm +
 *     kern_kda_gate + kern_sigmoid + kern_kda_recurrent on random inputs,
 *     over several steps, with a state pool indexed by permuted slot ids,
 *     padding slots, GVA, K = 64 and 128, fp32 and bf16 inputs, both gates;
 *   - the element kernels (kern_cuda_l2norm, kern_cuda_kda_gate) alone.
 * The GPU tests skip with "no CUDA device: <reason>" on machines without one.
 *
 * Tolerance: max |gpu - cpu| <= 1e-4 * max(|cpu|) (+1e-6 absolute) over each
 * compared array. Both sides compute in fp32 from identical inputs (bf16
 * inputs are rounded before the CPU sees them), so the only difference is
 * summation order (~1e-6 relative); 1e-4 leaves room for several steps.
 */
#include <criterion/criterion.h>

#ifdef KDS_HAVE_CUDA

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kern.h"
#include "kern_cuda.h"

#define REL_TOL 1e-4f
#define ABS_TOL 1e-6f

static void require_device(void) {
    kds_err err;
    kds_err_clear(&err);
    if (!kern_cuda_available(&err)) cr_skip_test("no CUDA device: %s", err.msg);
}

/* ---- deterministic random numbers (splitmix64) -------------------------- */

static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* uniform in [lo, hi) */
static float rng_uniform(uint64_t *s, float lo, float hi) {
    return lo + (hi - lo) * (float)((rng_next(s) >> 40) * (1.0 / 16777216.0));
}

static void fill_uniform(uint64_t *s, float *x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++) x[i] = rng_uniform(s, lo, hi);
}

/* Round fp32 values to what bf16 can hold (so CPU and GPU see the same). */
static void round_bf16(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = kern_bf16_to_f32(kern_f32_to_bf16(x[i]));
}

/* ---- device helpers ------------------------------------------------------ */

static void *dev_alloc(size_t bytes) {
    kds_err err;
    void *p = NULL;
    kds_status st = kern_cuda_malloc(&p, bytes, &err);
    cr_assert_eq(st, KDS_OK, "kern_cuda_malloc(%zu): %s", bytes, err.msg);
    return p;
}

static void h2d(void *dst, const void *src, size_t bytes) {
    kds_err err;
    kds_status st = kern_cuda_memcpy_h2d(dst, src, bytes, NULL, &err);
    cr_assert_eq(st, KDS_OK, "h2d: %s", err.msg);
}

static void d2h(void *dst, const void *src, size_t bytes) {
    kds_err err;
    kds_status st = kern_cuda_memcpy_d2h(dst, src, bytes, NULL, &err);
    cr_assert_eq(st, KDS_OK, "d2h: %s", err.msg);
}

static void dev_sync(void) {
    kds_err err;
    kds_status st = kern_cuda_sync(NULL, &err);
    cr_assert_eq(st, KDS_OK, "sync: %s", err.msg);
}

/* Upload fp32 host values as `dt` (F32 or BF16) into device buffer dst. */
static void h2d_as(void *dst, const float *src, size_t n, kern_dtype dt) {
    if (dt == KERN_F32) {
        h2d(dst, src, n * sizeof(float));
        return;
    }
    uint16_t *tmp = malloc(n * sizeof *tmp);
    cr_assert_not_null(tmp);
    for (size_t i = 0; i < n; i++) tmp[i] = kern_f32_to_bf16(src[i]);
    h2d(dst, tmp, n * sizeof *tmp);
    free(tmp);
}

/* max |a - b| <= REL_TOL * max|b| + ABS_TOL, reporting the worst element. */
static void assert_close(const float *got, const float *want, size_t n, const char *what) {
    float maxref = 0.0f, maxerr = 0.0f;
    size_t worst = 0;
    for (size_t i = 0; i < n; i++) {
        if (fabsf(want[i]) > maxref) maxref = fabsf(want[i]);
        float e = fabsf(got[i] - want[i]);
        if (!(e <= maxerr)) { /* also catches NaN */
            maxerr = e;
            worst = i;
        }
    }
    float tol = REL_TOL * maxref + ABS_TOL;
    cr_assert(maxerr <= tol, "%s: max error %g at [%zu] (gpu %g, cpu %g) > tol %g (max|cpu| %g)",
              what, (double)maxerr, worst, (double)got[worst], (double)want[worst], (double)tol,
              (double)maxref);
}

/* ---- the decode comparison ----------------------------------------------- */

typedef struct decode_case {
    int N, H, HV, K, V;
    int pool_slots;   /* > N: some slots are never addressed */
    int steps;        /* decode steps run back to back on the same slots */
    kern_dtype dt;    /* input dtype */
    float lower_bound;
    int n_padding;    /* how many of the N rows get an out-of-pool slot */
    uint64_t seed;
} decode_case;

static void run_decode_case(const decode_case *c) {
    require_device();
    const int N = c->N, H = c->H, HV = c->HV, K = c->K, V = c->V, P = c->pool_slots;
    cr_assert(P >= N && c->n_padding < N, "bad test case");
    uint64_t rs = c->seed;
    const size_t head = (size_t)K * V;
    const size_t pool_n = (size_t)P * HV * head;
    const size_t nq = (size_t)N * H * K, nv = (size_t)N * HV * V, ng = (size_t)N * HV * K;
    const size_t nb = (size_t)N * HV;

    /* host: initial pool, reference pool, inputs, reference outputs */
    float *pool0 = malloc(pool_n * sizeof(float));
    float *pool_ref = malloc(pool_n * sizeof(float));
    float *pool_gpu = malloc(pool_n * sizeof(float));
    float *q = malloc(nq * sizeof(float)), *k = malloc(nq * sizeof(float));
    float *qn = malloc(nq * sizeof(float)), *kn = malloc(nq * sizeof(float));
    float *v = malloc(nv * sizeof(float)), *g_raw = malloc(ng * sizeof(float));
    float *g = malloc(ng * sizeof(float)), *beta_raw = malloc(nb * sizeof(float));
    float *beta = malloc(nb * sizeof(float));
    float *o_ref = malloc(nv * sizeof(float)), *o_gpu = malloc(nv * sizeof(float));
    float *A_log = malloc(HV * sizeof(float)), *dt_bias = malloc((size_t)HV * K * sizeof(float));
    int32_t *slots = malloc(N * sizeof(int32_t));
    bool *used = calloc(P, sizeof(bool));
    cr_assert(pool0 && pool_ref && pool_gpu && q && k && qn && kn && v && g_raw && g && beta_raw &&
              beta && o_ref && o_gpu && A_log && dt_bias && slots && used);

    fill_uniform(&rs, pool0, pool_n, -1.0f, 1.0f);
    memcpy(pool_ref, pool0, pool_n * sizeof(float));
    fill_uniform(&rs, A_log, HV, -1.0f, 2.0f); /* decay rates exp(A) in [0.37, 7.4] */
    fill_uniform(&rs, dt_bias, (size_t)HV * K, -1.0f, 1.0f);

    /* slots: a random choice of N distinct pool slots in random order, the
     * first n_padding rows (at random positions) marked as padding */
    int32_t *perm = malloc(P * sizeof(int32_t));
    cr_assert_not_null(perm);
    for (int i = 0; i < P; i++) perm[i] = i;
    for (int i = P - 1; i > 0; i--) {
        int j = (int)(rng_next(&rs) % (uint64_t)(i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int n = 0; n < N; n++) slots[n] = perm[n];
    for (int i = 0; i < c->n_padding; i++) {
        int n = (int)(rng_next(&rs) % (uint64_t)N);
        slots[n] = (i % 2 == 0) ? -1 : P + 7; /* negative and past-the-end */
    }
    for (int n = 0; n < N; n++)
        if (slots[n] >= 0 && slots[n] < P) used[slots[n]] = true;
    free(perm);

    /* device buffers */
    const size_t es = c->dt == KERN_F32 ? 4 : 2;
    float *d_pool = dev_alloc(pool_n * sizeof(float));
    void *d_q = dev_alloc(nq * es), *d_k = dev_alloc(nq * es), *d_v = dev_alloc(nv * es);
    void *d_g = dev_alloc(ng * es), *d_b = dev_alloc(nb * es);
    float *d_A = dev_alloc(HV * sizeof(float)), *d_dt = dev_alloc((size_t)HV * K * sizeof(float));
    int32_t *d_slots = dev_alloc(N * sizeof(int32_t));
    float *d_o = dev_alloc(nv * sizeof(float));
    h2d(d_pool, pool0, pool_n * sizeof(float));
    h2d(d_A, A_log, HV * sizeof(float));
    h2d(d_dt, dt_bias, (size_t)HV * K * sizeof(float));
    h2d(d_slots, slots, N * sizeof(int32_t));

    const kern_kda_shape sh = {.H = H, .HV = HV, .K = K, .V = V, .scale = 1.0f / sqrtf((float)K)};
    kern_cuda_kda_decode_args a = {
        .shape = sh, .N = N, .in_dtype = c->dt,
        .q = d_q, .k = d_k, .v = d_v, .g_raw = d_g, .beta_raw = d_b,
        .A_log = d_A, .dt_bias = d_dt, .lower_bound = c->lower_bound,
        .state_pool = d_pool, .pool_slots = P, .slots = d_slots, .o = d_o,
    };

    for (int step = 0; step < c->steps; step++) {
        fill_uniform(&rs, q, nq, -1.0f, 1.0f);
        fill_uniform(&rs, k, nq, -1.0f, 1.0f);
        fill_uniform(&rs, v, nv, -2.0f, 2.0f);
        fill_uniform(&rs, g_raw, ng, -4.0f, 4.0f);
        fill_uniform(&rs, beta_raw, nb, -3.0f, 3.0f);
        if (c->dt == KERN_BF16) {
            round_bf16(q, nq);
            round_bf16(k, nq);
            round_bf16(v, nv);
            round_bf16(g_raw, ng);
            round_bf16(beta_raw, nb);
        }
        h2d_as(d_q, q, nq, c->dt);
        h2d_as(d_k, k, nq, c->dt);
        h2d_as(d_v, v, nv, c->dt);
        h2d_as(d_g, g_raw, ng, c->dt);
        h2d_as(d_b, beta_raw, nb, c->dt);
        /* poison o so unwritten rows show up */
        kds_err err;
        cr_assert_eq(kern_cuda_memset(d_o, 0xff, nv * sizeof(float), NULL, &err), KDS_OK, "%s",
                     err.msg);

        /* GPU */
        kds_status st = kern_cuda_kda_decode(&a, NULL, &err);
        cr_assert_eq(st, KDS_OK, "kern_cuda_kda_decode: %s", err.msg);
        dev_sync();
        d2h(o_gpu, d_o, nv * sizeof(float));

        /* CPU reference */
        memcpy(qn, q, nq * sizeof(float));
        memcpy(kn, k, nq * sizeof(float));
        kern_l2norm(qn, N * H, K, 1e-6f);
        kern_l2norm(kn, N * H, K, 1e-6f);
        kern_kda_gate(g_raw, A_log, dt_bias, N, HV, K, c->lower_bound, g);
        for (size_t i = 0; i < nb; i++) beta[i] = kern_sigmoid(beta_raw[i]);
        for (int n = 0; n < N; n++) {
            float *orow = o_ref + (size_t)n * HV * V;
            if (slots[n] < 0 || slots[n] >= P) {
                memset(orow, 0, (size_t)HV * V * sizeof(float));
                continue;
            }
            kern_kda_recurrent(&sh, 1, qn + (size_t)n * H * K, kn + (size_t)n * H * K,
                               v + (size_t)n * HV * V, g + (size_t)n * HV * K,
                               beta + (size_t)n * HV, pool_ref + (size_t)slots[n] * HV * head,
                               orow, 0, HV);
        }

        char what[96];
        snprintf(what, sizeof what, "o, step %d", step);
        assert_close(o_gpu, o_ref, nv, what);
        for (int n = 0; n < N; n++) {
            if (slots[n] >= 0 && slots[n] < P) continue;
            for (size_t i = 0; i < (size_t)HV * V; i++)
                cr_assert(o_gpu[(size_t)n * HV * V + i] == 0.0f,
                          "padding row %d (slot %d): o[%zu] = %g, want 0", n, slots[n], i,
                          (double)o_gpu[(size_t)n * HV * V + i]);
        }
    }

    /* the pool: addressed slots match the reference, the others are
     * bit-for-bit what was uploaded */
    d2h(pool_gpu, d_pool, pool_n * sizeof(float));
    for (int s = 0; s < P; s++) {
        const size_t off = (size_t)s * HV * head;
        if (used[s]) {
            char what[64];
            snprintf(what, sizeof what, "state slot %d", s);
            assert_close(pool_gpu + off, pool_ref + off, HV * head, what);
        } else {
            cr_assert(memcmp(pool_gpu + off, pool0 + off, HV * head * sizeof(float)) == 0,
                      "pool slot %d was not addressed but changed", s);
        }
    }

    kern_cuda_free(d_pool);
    kern_cuda_free(d_q);
    kern_cuda_free(d_k);
    kern_cuda_free(d_v);
    kern_cuda_free(d_g);
    kern_cuda_free(d_b);
    kern_cuda_free(d_A);
    kern_cuda_free(d_dt);
    kern_cuda_free(d_slots);
    kern_cuda_free(d_o);
    free(pool0);
    free(pool_ref);
    free(pool_gpu);
    free(q);
    free(k);
    free(qn);
    free(kn);
    free(v);
    free(g_raw);
    free(g);
    free(beta_raw);
    free(beta);
    free(o_ref);
    free(o_gpu);
    free(A_log);
    free(dt_bias);
    free(slots);
    free(used);
}

/* Kimi-Linear-48B's layer shape: H = HV = 32, K = V = 128, softplus gate. */
Test(cuda_kda, decode_b1_h32_bf16) {
    decode_case c = {.N = 1, .H = 32, .HV = 32, .K = 128, .V = 128, .pool_slots = 3, .steps = 3,
                     .dt = KERN_BF16, .lower_bound = 0.0f, .seed = 1};
    run_decode_case(&c);
}

Test(cuda_kda, decode_b1_h4_f32) {
    decode_case c = {.N = 1, .H = 4, .HV = 4, .K = 128, .V = 128, .pool_slots = 2, .steps = 3,
                     .dt = KERN_F32, .lower_bound = 0.0f, .seed = 2};
    run_decode_case(&c);
}

Test(cuda_kda, decode_b3_h4_f32) {
    decode_case c = {.N = 3, .H = 4, .HV = 4, .K = 128, .V = 128, .pool_slots = 7, .steps = 3,
                     .dt = KERN_F32, .lower_bound = 0.0f, .seed = 3};
    run_decode_case(&c);
}

Test(cuda_kda, decode_b3_h32_bf16_padding) {
    decode_case c = {.N = 3, .H = 32, .HV = 32, .K = 128, .V = 128, .pool_slots = 5, .steps = 2,
                     .dt = KERN_BF16, .lower_bound = 0.0f, .n_padding = 1, .seed = 4};
    run_decode_case(&c);
}

Test(cuda_kda, decode_b64_h4_bf16) {
    decode_case c = {.N = 64, .H = 4, .HV = 4, .K = 128, .V = 128, .pool_slots = 80, .steps = 3,
                     .dt = KERN_BF16, .lower_bound = 0.0f, .n_padding = 2, .seed = 5};
    run_decode_case(&c);
}

/* 64 sequences x 2 MiB of state: the batched Kimi shape. */
Test(cuda_kda, decode_b64_h32_f32, .timeout = 120) {
    decode_case c = {.N = 64, .H = 32, .HV = 32, .K = 128, .V = 128, .pool_slots = 67, .steps = 2,
                     .dt = KERN_F32, .lower_bound = 0.0f, .seed = 6};
    run_decode_case(&c);
}

/* GVA (HV = 4 H), K = 64, V = 96 (three V tiles), lower-bound gate. */
Test(cuda_kda, decode_gva_k64_lower_bound) {
    decode_case c = {.N = 3, .H = 2, .HV = 8, .K = 64, .V = 96, .pool_slots = 4, .steps = 3,
                     .dt = KERN_F32, .lower_bound = -5.0f, .seed = 7};
    run_decode_case(&c);
}

Test(cuda_kda, decode_gva_k128_bf16) {
    decode_case c = {.N = 3, .H = 4, .HV = 8, .K = 128, .V = 64, .pool_slots = 6, .steps = 2,
                     .dt = KERN_BF16, .lower_bound = 0.0f, .n_padding = 1, .seed = 8};
    run_decode_case(&c);
}

/* ---- element kernels ------------------------------------------------------ */

Test(cuda_kda, l2norm_matches_cpu) {
    require_device();
    const int n_vecs = 67, dim = 128;
    const size_t n = (size_t)n_vecs * dim;
    uint64_t rs = 11;
    float *x = malloc(n * sizeof(float)), *ref = malloc(n * sizeof(float));
    float *got = malloc(n * sizeof(float));
    cr_assert(x && ref && got);
    fill_uniform(&rs, x, n, -3.0f, 3.0f);
    for (int i = 0; i < dim; i++) x[5 * dim + i] = 0.0f; /* a zero vector stays zero */
    memcpy(ref, x, n * sizeof(float));
    kern_l2norm(ref, n_vecs, dim, 1e-6f);
    float *d = dev_alloc(n * sizeof(float));
    h2d(d, x, n * sizeof(float));
    kds_err err;
    cr_assert_eq(kern_cuda_l2norm(d, n_vecs, dim, 1e-6f, NULL, &err), KDS_OK, "%s", err.msg);
    dev_sync();
    d2h(got, d, n * sizeof(float));
    assert_close(got, ref, n, "l2norm");
    kern_cuda_free(d);
    free(x);
    free(ref);
    free(got);
}

static void gate_case(float lower_bound, bool with_bias) {
    require_device();
    const int T = 5, HV = 6, K = 64;
    const size_t n = (size_t)T * HV * K;
    uint64_t rs = 12;
    float *g_raw = malloc(n * sizeof(float)), *ref = malloc(n * sizeof(float));
    float *got = malloc(n * sizeof(float)), *A_log = malloc(HV * sizeof(float));
    float *bias = malloc((size_t)HV * K * sizeof(float));
    cr_assert(g_raw && ref && got && A_log && bias);
    fill_uniform(&rs, g_raw, n, -30.0f, 30.0f); /* both sides of the threshold 20 */
    fill_uniform(&rs, A_log, HV, -2.0f, 3.0f);
    fill_uniform(&rs, bias, (size_t)HV * K, -1.0f, 1.0f);
    kern_kda_gate(g_raw, A_log, with_bias ? bias : NULL, T, HV, K, lower_bound, ref);
    float *d_g = dev_alloc(n * sizeof(float)), *d_out = dev_alloc(n * sizeof(float));
    float *d_A = dev_alloc(HV * sizeof(float)), *d_bias = dev_alloc((size_t)HV * K * sizeof(float));
    h2d(d_g, g_raw, n * sizeof(float));
    h2d(d_A, A_log, HV * sizeof(float));
    h2d(d_bias, bias, (size_t)HV * K * sizeof(float));
    kds_err err;
    cr_assert_eq(kern_cuda_kda_gate(d_g, d_A, with_bias ? d_bias : NULL, T, HV, K, lower_bound,
                                    d_out, NULL, &err),
                 KDS_OK, "%s", err.msg);
    dev_sync();
    d2h(got, d_out, n * sizeof(float));
    /* element-wise relative check: g spans many magnitudes */
    for (size_t i = 0; i < n; i++)
        cr_assert(fabsf(got[i] - ref[i]) <= 1e-5f * fabsf(ref[i]) + 1e-30f,
                  "gate[%zu] (lb %g, bias %d): gpu %g cpu %g", i, (double)lower_bound,
                  (int)with_bias, (double)got[i], (double)ref[i]);
    /* in place (g aliases g_raw) gives the same */
    cr_assert_eq(kern_cuda_kda_gate(d_g, d_A, with_bias ? d_bias : NULL, T, HV, K, lower_bound,
                                    d_g, NULL, &err),
                 KDS_OK, "%s", err.msg);
    dev_sync();
    d2h(g_raw, d_g, n * sizeof(float));
    cr_assert(memcmp(g_raw, got, n * sizeof(float)) == 0, "in-place gate differs");
    kern_cuda_free(d_g);
    kern_cuda_free(d_out);
    kern_cuda_free(d_A);
    kern_cuda_free(d_bias);
    free(g_raw);
    free(ref);
    free(got);
    free(A_log);
    free(bias);
}

Test(cuda_kda, gate_softplus_matches_cpu) { gate_case(0.0f, true); }
Test(cuda_kda, gate_softplus_no_bias_matches_cpu) { gate_case(0.0f, false); }
Test(cuda_kda, gate_lower_bound_matches_cpu) { gate_case(-5.0f, true); }

/* ---- no device needed ------------------------------------------------------ */

/* On a machine without a GPU or driver this must return false with a reason,
 * not crash; with one it must return true. */
Test(cuda_kda, available_reports_a_reason) {
    kds_err err;
    kds_err_clear(&err);
    bool ok = kern_cuda_available(&err);
    if (ok)
        cr_assert_eq(err.status, KDS_OK);
    else
        cr_assert(err.status != KDS_OK && err.msg[0] != '\0', "false without a reason");
}

/* Shape and pointer checks happen on the host before any CUDA call. */
Test(cuda_kda, decode_rejects_bad_arguments) {
    static float dummy[64] __attribute__((aligned(16)));
    static int32_t slot0;
    kern_cuda_kda_decode_args a = {
        .shape = {.H = 4, .HV = 4, .K = 128, .V = 128, .scale = 1.0f}, .N = 1,
        .in_dtype = KERN_F32, .q = dummy, .k = dummy, .v = dummy, .g_raw = dummy,
        .beta_raw = dummy, .A_log = dummy, .dt_bias = NULL, .lower_bound = 0.0f,
        .state_pool = dummy, .pool_slots = 1, .slots = &slot0, .o = dummy,
    };
    kds_err err;
    kern_cuda_kda_decode_args b;

    cr_assert_eq(kern_cuda_kda_decode(NULL, NULL, &err), KDS_INVALID_ARG);
    b = a;
    b.shape.K = 96;
    cr_assert_eq(kern_cuda_kda_decode(&b, NULL, &err), KDS_UNSUPPORTED);
    cr_assert(strstr(err.msg, "K=96") != NULL, "message: %s", err.msg);
    b = a;
    b.shape.V = 100;
    cr_assert_eq(kern_cuda_kda_decode(&b, NULL, &err), KDS_UNSUPPORTED);
    b = a;
    b.shape.HV = 6;
    cr_assert_eq(kern_cuda_kda_decode(&b, NULL, &err), KDS_INVALID_ARG);
    b = a;
    b.N = -1;
    cr_assert_eq(kern_cuda_kda_decode(&b, NULL, &err), KDS_INVALID_ARG);
    b = a;
    b.q = NULL;
    cr_assert_eq(kern_cuda_kda_decode(&b, NULL, &err), KDS_INVALID_ARG);
    b = a;
    b.in_dtype = KERN_F16;
    cr_assert_eq(kern_cuda_kda_decode(&b, NULL, &err), KDS_INVALID_ARG);
    b = a;
    b.o = dummy + 1; /* 4-byte aligned only */
    cr_assert_eq(kern_cuda_kda_decode(&b, NULL, &err), KDS_INVALID_ARG);
    b = a;
    b.N = 0; /* empty batch: nothing to do, nothing touched */
    cr_assert_eq(kern_cuda_kda_decode(&b, NULL, &err), KDS_OK);

    cr_assert_eq(kern_cuda_l2norm(NULL, 3, 128, 1e-6f, NULL, &err), KDS_INVALID_ARG);
    cr_assert_eq(kern_cuda_l2norm(NULL, 0, 128, 1e-6f, NULL, &err), KDS_OK);
    cr_assert_eq(kern_cuda_kda_gate(dummy, dummy, NULL, 1, 0, 64, 0.0f, dummy, NULL, &err),
                 KDS_INVALID_ARG);
    cr_assert_eq(kern_cuda_kda_gate(NULL, NULL, NULL, 0, 4, 64, 0.0f, NULL, NULL, &err), KDS_OK);

    void *p = &slot0;
    cr_assert_eq(kern_cuda_malloc(&p, 0, &err), KDS_OK);
    cr_assert_null(p);
    cr_assert_eq(kern_cuda_malloc(NULL, 16, &err), KDS_INVALID_ARG);
    kern_cuda_free(NULL);
}

#else /* !KDS_HAVE_CUDA */

Test(cuda_kda, skipped) {
    cr_skip_test("built without CUDA");
}

#endif
