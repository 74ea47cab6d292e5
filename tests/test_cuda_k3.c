/*
 * test_cuda_k3.c - the CUDA kernels of Kimi K3's operators against their CPU
 * references (kern.h, kernels/cpu/k3.c):
 *   kern_cuda_situ, kern_cuda_sigmoid_mul   kern_situ, kern_sigmoid_mul, per
 *                        element: |gpu - cpu| <= 4e-6 |cpu| + 1e-6 max|cpu|
 *                        (tanhf / expf against the CPU's tanhf and its own
 *                        exp: a few ulp), both load paths, saturation;
 *   kern_cuda_attn_res_mix   kern_attn_res_mix: 1, 2, 9 (K3) and 64
 *                        candidates, with and without the partial, D from 1
 *                        to 8192 (K3: 7168), vector and element loads,
 *                        padded snapshot strides (NaN in the gaps), peaked
 *                        and flat softmaxes: 1e-5 of the largest |out|;
 * GPU tests skip with "no CUDA device: <reason>".
 */
#include <criterion/criterion.h>

#ifdef KDS_HAVE_CUDA

#include "test_cuda_util.h"

/* ---- element kernels ---------------------------------------------------------- */

/* Per-element check: |got - want| <= rel |want| + floor * max|want|. */
static void assert_elems(const float *got, const float *want, size_t n, double rel, double floor,
                         const char *what) {
    double mag = 0.0, worst = 0.0;
    size_t wi = 0;
    for (size_t i = 0; i < n; i++)
        if (fabs((double)want[i]) > mag) mag = fabs((double)want[i]);
    bool ok = true;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - (double)want[i]);
        if (isnan(e)) e = INFINITY;
        const double lim = rel * fabs((double)want[i]) + floor * mag;
        if (!(e <= lim) && ok) ok = false, wi = i;
        if (mag > 0 && e / mag > worst) worst = e / mag;
    }
    printf("cuda check %-52s max err / max|ref| = %.2e (tol %.0e rel + %.0e)\n", what, worst, rel,
           floor);
    fflush(stdout);
    cr_assert(ok, "%s: [%zu] gpu %.9g cpu %.9g", what, wi, (double)got[wi], (double)want[wi]);
}

/* n values a, b from [-lo, hi) with specials planted (0, tiny, the
 * sigmoid's and tanh's saturation). */
static void fill_act(uint64_t *s, float *a, float *b, size_t n) {
    tcu_fill(s, a, n, -30.0f, 30.0f);
    tcu_fill(s, b, n, -120.0f, 120.0f);
    const float sp[] = {0.0f,    -0.0f,  1e-8f, -1e-8f, 1e-30f, 100.0f,
                        -100.0f, -89.0f, 89.0f, 4.0f,   -4.0f,  25.0f};
    for (size_t i = 0; i < sizeof sp / sizeof sp[0] && i < n; i++)
        a[i] = sp[i], b[n - 1 - i] = sp[i];
    for (size_t i = 12; i + 1 < n; i += 97)
        a[i] *= 0.01f, b[i + 1] *= 0.01f; /* the small-argument range */
}

typedef enum { OP_SITU, OP_SIGMUL } elem_op;

/* One call on n values at offset off (0: 16-byte aligned, vector loads;
 * 1: element loads) against the CPU. */
static void check_elem(elem_op op, size_t n, size_t off, float beta, float beta_l, uint64_t seed) {
    uint64_t s = seed;
    float *a = tcu_malloc((n + off) * sizeof(float)), *b = tcu_malloc((n + off) * sizeof(float));
    fill_act(&s, a + off, b + off, n);
    float *da = tcu_upload(a, n + off), *db = tcu_upload(b, n + off);
    kds_err err = {0};
    kds_status st = op == OP_SITU ? kern_cuda_situ(da + off, db + off, n, beta, beta_l, NULL, &err)
                                  : kern_cuda_sigmoid_mul(da + off, db + off, n, NULL, &err);
    cr_assert_eq(st, KDS_OK, "%s", err.msg);
    float *got = tcu_malloc((n + off) * sizeof(float));
    tcu_d2h(got, da, (n + off) * sizeof(float));
    float *ref = tcu_malloc((n + off) * sizeof(float));
    memcpy(ref, a, (n + off) * sizeof(float));
    if (op == OP_SITU)
        kern_situ(ref + off, b + off, n, beta, beta_l);
    else
        kern_sigmoid_mul(ref + off, b + off, n);
    char what[96];
    snprintf(what, sizeof what, "%s n=%zu%s beta %g/%g", op == OP_SITU ? "situ" : "sigmoid_mul", n,
             off ? " misaligned" : "", (double)beta, (double)beta_l);
    assert_elems(got + off, ref + off, n, 4e-6, 1e-6, what);
    for (size_t i = 0; i < off; i++)
        cr_assert_eq(got[i], a[i], "value before the range was written");
    kern_cuda_free(da), kern_cuda_free(db);
    free(a), free(b), free(got), free(ref);
}

Test(cuda_k3, situ_matches_cpu) {
    tcu_require_device();
    check_elem(OP_SITU, 1027, 0, 4.0f, 25.0f, 1); /* K3's betas; a float4 tail of 3 */
    check_elem(OP_SITU, 1027, 1, 4.0f, 25.0f, 2); /* element loads */
    check_elem(OP_SITU, 64, 0, 1.0f, 2.5f, 3);    /* other caps */
    check_elem(OP_SITU, 3, 0, 4.0f, 25.0f, 4);    /* tail only */
}

Test(cuda_k3, sigmoid_mul_matches_cpu) {
    tcu_require_device();
    check_elem(OP_SIGMUL, 1027, 0, 0, 0, 5);
    check_elem(OP_SIGMUL, 1027, 1, 0, 0, 6);
    check_elem(OP_SIGMUL, 1, 0, 0, 0, 7);
}

/* More values than one pass of the capped grid (8192 CTAs x 256 threads x
 * 4): the grid-stride loop. */
Test(cuda_k3, situ_grid_stride, .timeout = 600) {
    tcu_require_device();
    check_elem(OP_SITU, (size_t)8192 * 256 * 4 + 5, 0, 4.0f, 25.0f, 8);
}

Test(cuda_k3, element_kernels_refuse_bad_arguments) {
    kds_err err = {0};
    static float d[4] __attribute__((aligned(16)));
    cr_expect_eq(kern_cuda_situ(d, d, 4, 0.0f, 25.0f, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "beta"), "message: %s", err.msg);
    cr_expect_eq(kern_cuda_situ(d, d, 4, 4.0f, NAN, NULL, &err), KDS_INVALID_ARG);
    cr_expect_eq(kern_cuda_situ(d, d, 4, INFINITY, 25.0f, NULL, &err), KDS_INVALID_ARG);
    cr_expect_eq(kern_cuda_situ(NULL, d, 4, 4.0f, 25.0f, NULL, &err), KDS_INVALID_ARG);
    cr_expect_eq(kern_cuda_situ(NULL, NULL, 0, 4.0f, 25.0f, NULL, &err), KDS_OK,
                 "n = 0: nothing to do");
    cr_expect_eq(kern_cuda_sigmoid_mul(d, NULL, 4, NULL, &err), KDS_INVALID_ARG);
    cr_expect_eq(kern_cuda_sigmoid_mul(NULL, NULL, 0, NULL, &err), KDS_OK);
}

/* ---- Block Attention Residuals' mix -------------------------------------------- */

typedef struct ar_case {
    int T, D, n_blocks;
    bool partial;
    size_t pad;    /* block_stride = T * D + pad (NaN in the gaps) */
    float u_scale; /* z's spread is about u_scale * 3 */
    size_t off;    /* floats by which every buffer is offset (1: element loads) */
    uint64_t seed;
} ar_case;

static void check_ar(const ar_case *c) {
    const int T = c->T, D = c->D, nb = c->n_blocks;
    const size_t rowsz = (size_t)T * D, stride = rowsz + c->pad, off = c->off;
    uint64_t s = c->seed;
    const size_t nblk = nb > 0 ? (size_t)nb * stride : 1;
    float *blocks = tcu_malloc((nblk + off) * sizeof(float));
    for (size_t i = 0; i < nblk + off; i++)
        blocks[i] = NAN; /* the gaps between snapshots */
    for (int j = 0; j < nb; j++) {
        /* candidates of different sizes, so the rms matters */
        const float amp = 0.2f + 3.0f * (float)((j * 7) % 5);
        tcu_fill(&s, blocks + off + (size_t)j * stride, rowsz, -amp, amp);
    }
    float *partial = tcu_malloc((rowsz + off) * sizeof(float));
    tcu_fill(&s, partial, rowsz + off, -1.5f, 1.5f);
    float *u = tcu_malloc((D + off) * sizeof(float));
    const float ua = c->u_scale * 3.0f * sqrtf(3.0f) / sqrtf((float)D);
    tcu_fill(&s, u, D + off, -ua, ua);
    float *ref = tcu_malloc(rowsz * sizeof(float));
    kern_attn_res_mix(T, D, nb ? blocks + off : NULL, stride, nb, c->partial ? partial + off : NULL,
                      u + off, 1e-5f, ref);
    float *dblocks = tcu_upload(blocks, nblk + off), *dpartial = tcu_upload(partial, rowsz + off);
    float *du = tcu_upload(u, D + off);
    float *dout = tcu_dev_alloc((rowsz + off) * sizeof(float));
    tcu_poison(dout, (rowsz + off) * sizeof(float));
    kern_cuda_attn_res_args a = {.T = T,
                                 .D = D,
                                 .blocks = nb ? dblocks + off : NULL,
                                 .block_stride = stride,
                                 .n_blocks = nb,
                                 .partial = c->partial ? dpartial + off : NULL,
                                 .u = du + off,
                                 .eps = 1e-5f,
                                 .out = dout + off};
    kds_err err = {0};
    cr_assert_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_OK, "%s", err.msg);
    float *got = tcu_malloc(rowsz * sizeof(float));
    tcu_d2h(got, dout + off, rowsz * sizeof(float));
    char what[96];
    snprintf(what, sizeof what, "attn_res T=%d D=%d %d blocks%s%s%s u x%g", T, D, nb,
             c->partial ? " + partial" : "", c->pad ? " padded" : "", off ? " misaligned" : "",
             (double)c->u_scale);
    tcu_assert_close(got, ref, rowsz, 1e-5, what);
    kern_cuda_free(dblocks), kern_cuda_free(dpartial), kern_cuda_free(du), kern_cuda_free(dout);
    free(blocks), free(partial), free(u), free(ref), free(got);
}

Test(cuda_k3, attn_res_small_shapes) {
    tcu_require_device();
    check_ar(&(ar_case){.T = 3, .D = 64, .n_blocks = 2, .partial = true, .u_scale = 1, .seed = 11});
    check_ar(&(ar_case){
        .T = 2, .D = 64, .n_blocks = 5, .partial = false, .pad = 12, .u_scale = 1, .seed = 12});
    check_ar(&(ar_case){
        .T = 2, .D = 100, .n_blocks = 0, .partial = true, .u_scale = 1, .seed = 13}); /* one */
    check_ar(&(ar_case){.T = 1, .D = 1, .n_blocks = 1, .partial = true, .u_scale = 1, .seed = 14});
    check_ar(&(ar_case){
        .T = 4, .D = 50, .n_blocks = 3, .partial = true, .pad = 1, .u_scale = 1, .seed = 15});
    check_ar(&(ar_case){
        .T = 2, .D = 64, .n_blocks = 3, .partial = true, .u_scale = 1, .off = 1, .seed = 16});
    check_ar(&(ar_case){
        .T = 2, .D = 96, .n_blocks = 4, .partial = true, .u_scale = 0, .seed = 17}); /* mean */
    check_ar(&(ar_case){
        .T = 2, .D = 96, .n_blocks = 4, .partial = true, .u_scale = 15, .seed = 18}); /* peaked */
}

/* 64 candidates: eight groups of the online softmax (D <= 2048: G = 8),
 * and sixteen at D = 4099 (element loads, G = 4). */
Test(cuda_k3, attn_res_64_candidates) {
    tcu_require_device();
    check_ar(
        &(ar_case){.T = 2, .D = 128, .n_blocks = 63, .partial = true, .u_scale = 2, .seed = 21});
    check_ar(
        &(ar_case){.T = 1, .D = 4099, .n_blocks = 64, .partial = false, .u_scale = 2, .seed = 22});
}

/* Every instantiation: float4 units per thread 1, 2, 4 (D 96, 2304, 4096)
 * and element units 1, 2, 4, 8, 16 (D 50, 1001, 2001, 3999, 8191). */
Test(cuda_k3, attn_res_every_width_class) {
    tcu_require_device();
    const int Ds[] = {96, 2304, 4096, 50, 1001, 2001, 3999, 8191};
    for (int i = 0; i < 8; i++)
        check_ar(&(ar_case){.T = 2,
                            .D = Ds[i],
                            .n_blocks = 4,
                            .partial = true,
                            .pad = 4 * (size_t)(i % 2),
                            .u_scale = 1.5f,
                            .seed = 25 + (uint64_t)i});
}

/* K3: 8 snapshots + the partial of width 7168; and the largest width. */
Test(cuda_k3, attn_res_k3_shape) {
    tcu_require_device();
    check_ar(
        &(ar_case){.T = 3, .D = 7168, .n_blocks = 8, .partial = true, .u_scale = 1, .seed = 31});
    check_ar(
        &(ar_case){.T = 2, .D = 7168, .n_blocks = 8, .partial = true, .u_scale = 8, .seed = 32});
    check_ar(&(ar_case){
        .T = 1, .D = 8192, .n_blocks = 5, .partial = true, .pad = 4, .u_scale = 1, .seed = 33});
    check_ar(
        &(ar_case){.T = 1, .D = 8191, .n_blocks = 2, .partial = true, .u_scale = 1, .seed = 34});
}

Test(cuda_k3, attn_res_refuses_bad_arguments) {
    static float d[64] __attribute__((aligned(16)));
    kds_err err = {0};
    const kern_cuda_attn_res_args ok = {.T = 1,
                                        .D = 16,
                                        .blocks = d,
                                        .block_stride = 16,
                                        .n_blocks = 2,
                                        .partial = d,
                                        .u = d,
                                        .eps = 1e-5f,
                                        .out = d + 32};
    kern_cuda_attn_res_args a = ok;
    cr_expect_eq(kern_cuda_attn_res_mix(NULL, NULL, &err), KDS_INVALID_ARG);
    a.n_blocks = 0, a.partial = NULL; /* no candidate */
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "candidates"), "message: %s", err.msg);
    a = ok, a.n_blocks = 64; /* 65 with the partial */
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_INVALID_ARG);
    a = ok, a.T = -1;
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_INVALID_ARG);
    a = ok, a.D = KERN_CUDA_ATTN_RES_MAX_D + 1;
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_UNSUPPORTED);
    cr_expect(strstr(err.msg, "D=8193"), "message: %s", err.msg);
    a = ok, a.D = 0;
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_UNSUPPORTED);
    a = ok, a.u = NULL;
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_INVALID_ARG);
    a = ok, a.blocks = NULL;
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_INVALID_ARG);
    a = ok, a.T = 0, a.u = NULL; /* nothing to do */
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_OK);
}

#else

Test(cuda_k3, skipped_without_cuda) {
    cr_skip_test("built without CUDA (KDS_HAVE_CUDA unset)");
}

#endif
