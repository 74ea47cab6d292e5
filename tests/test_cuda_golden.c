/*
 * test_cuda_golden.c - the CUDA KDA kernels against fla's float32 reference
 * outputs in shared/golden/kda/ (*.safetensors; format in
 * shared/golden/README.md), the same files test_kda_golden.c checks the CPU
 * kernels with.
 *
 * Every *.safetensors file of the golden dir is checked (env KDA_GOLDEN_DIR,
 * else KDS_SOURCE_DIR/../shared/golden/kda); a missing or empty dir, an
 * unreadable file or a missing tensor fails the test. Per file, from h0:
 *   prefill      kern_cuda_kda_prefill on the golden q, k, g, beta -> o, hT
 *   prefill raw  the same from q_raw, k_raw, g_raw, beta_raw (L2 norm, gate,
 *                sigmoid in the kernel)
 *   prefill tc   raw, with the intra-chunk kernel and the state pass on
 *                tensor cores (bf16 hi + lo products), held to 1e-4 instead
 *                of 1e-5
 *   decode       kern_cuda_kda_decode one token at a time from the raw
 *                inputs (files whose K, V the decode kernel compiles)
 *   split        prefill raw over the first 2T/3 tokens, decode the rest
 * Tolerance as the CPU golden test: max |gpu - ref| <= 1e-5 * max |ref| per
 * tensor; the measured ratio is printed. GPU tests skip without a device.
 */
#include <criterion/criterion.h>

#ifdef KDS_HAVE_CUDA

#include "test_cuda_util.h"
#include "test_kda_golden_util.h"

#define REL_TOL 1e-5
#define REL_TOL_TC 1e-4

/* The golden tensors on the device. */
typedef struct gdev {
    float *q_raw, *k_raw, *v, *g_raw, *beta_raw, *A_log, *dt_bias;
    float *q, *k, *g, *beta, *state, *o, *ws;
    size_t ws_bytes, nq, nv, ng, nb, ns;
} gdev;

static void gdev_upload(const golden *gd, gdev *x) {
    const size_t T = gd->T, H = gd->H, HV = gd->HV, K = gd->K, V = gd->V;
    x->nq = T * H * K;
    x->nv = T * HV * V;
    x->ng = T * HV * K;
    x->nb = T * HV;
    x->ns = HV * K * V;
    x->q_raw = tcu_upload(gd->q_raw, x->nq);
    x->k_raw = tcu_upload(gd->k_raw, x->nq);
    x->v = tcu_upload(gd->v, x->nv);
    x->g_raw = tcu_upload(gd->g_raw, x->ng);
    x->beta_raw = tcu_upload(gd->beta_raw, x->nb);
    x->A_log = tcu_upload(gd->A_log, HV);
    x->dt_bias = tcu_upload(gd->dt_bias, HV * K);
    x->q = tcu_upload(gd->q, x->nq);
    x->k = tcu_upload(gd->k, x->nq);
    x->g = tcu_upload(gd->g, x->ng);
    x->beta = tcu_upload(gd->beta, x->nb);
    x->state = tcu_dev_alloc(x->ns * 4);
    x->o = tcu_dev_alloc((x->nv ? x->nv : 1) * 4);
    const kern_kda_shape sh = {gd->H, gd->HV, gd->K, gd->V, gd->scale};
    x->ws_bytes = kern_cuda_kda_prefill_workspace_bytes(&sh, 4); /* several passes */
    x->ws = tcu_dev_alloc(x->ws_bytes);
}

static void gdev_free(gdev *x) {
    float *p[] = {x->q_raw, x->k_raw, x->v, x->g_raw, x->beta_raw, x->A_log, x->dt_bias,
                  x->q,     x->k,     x->g, x->beta,  x->state,    x->o,     x->ws};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) kern_cuda_free(p[i]);
}

/* Reset the device state to h0 and poison o. */
static void gdev_reset(const golden *gd, gdev *x) {
    tcu_h2d(x->state, gd->h0, x->ns * 4);
    tcu_poison(x->o, (x->nv ? x->nv : 1) * 4);
}

/* Prefill tokens [t0, t0 + n), raw or pre-processed inputs. */
static void gpu_prefill(const golden *gd, gdev *x, bool raw, bool tc, int t0, int n) {
    const kern_kda_shape sh = {gd->H, gd->HV, gd->K, gd->V, gd->scale};
    const size_t HK = (size_t)gd->H * gd->K, HVK = (size_t)gd->HV * gd->K;
    const size_t HVV = (size_t)gd->HV * gd->V;
    kern_cuda_kda_prefill_args a = {
        .shape = sh, .T = n, .in_dtype = KERN_F32, .raw = raw,
        .q = (raw ? x->q_raw : x->q) + t0 * HK, .k = (raw ? x->k_raw : x->k) + t0 * HK,
        .v = x->v + t0 * HVV, .g = (raw ? x->g_raw : x->g) + t0 * HVK,
        .beta = (raw ? x->beta_raw : x->beta) + (size_t)t0 * gd->HV,
        .A_log = x->A_log, .dt_bias = x->dt_bias, .lower_bound = 0.0f,
        .state = x->state, .o = x->o + t0 * HVV, .workspace = x->ws, .workspace_bytes = x->ws_bytes,
        .tensor_cores = tc,
    };
    kds_err err;
    kds_err_clear(&err);
    cr_assert_eq(kern_cuda_kda_prefill(&a, NULL, &err), KDS_OK, "%s: prefill: %s", gd->name,
                 err.msg);
}

/* Decode tokens [t0, t0 + n) one at a time from the raw inputs (one
 * sequence in a one-slot pool). */
static void gpu_decode(const golden *gd, gdev *x, int32_t *d_slot, int t0, int n) {
    const kern_kda_shape sh = {gd->H, gd->HV, gd->K, gd->V, gd->scale};
    const size_t HK = (size_t)gd->H * gd->K, HVK = (size_t)gd->HV * gd->K;
    const size_t HVV = (size_t)gd->HV * gd->V;
    for (size_t t = t0; t < (size_t)(t0 + n); t++) {
        kern_cuda_kda_decode_args a = {
            .shape = sh, .N = 1, .in_dtype = KERN_F32,
            .q = x->q_raw + t * HK, .k = x->k_raw + t * HK, .v = x->v + t * HVV,
            .g_raw = x->g_raw + t * HVK, .beta_raw = x->beta_raw + t * gd->HV,
            .A_log = x->A_log, .dt_bias = x->dt_bias, .lower_bound = 0.0f,
            .state_pool = x->state, .pool_slots = 1, .slots = d_slot, .o = x->o + t * HVV,
        };
        kds_err err;
        kds_err_clear(&err);
        cr_assert_eq(kern_cuda_kda_decode(&a, NULL, &err), KDS_OK, "%s: decode: %s", gd->name,
                     err.msg);
    }
}

static bool decode_supports(const golden *gd) {
    return (gd->K == 64 || gd->K == 128) && gd->V % 32 == 0;
}

static void check_tol(const golden *gd, gdev *x, const char *path, double tol) {
    tcu_sync();
    float *o = tcu_malloc((x->nv ? x->nv : 1) * 4), *s = tcu_malloc(x->ns * 4);
    tcu_d2h(o, x->o, x->nv * 4);
    tcu_d2h(s, x->state, x->ns * 4);
    char what[160];
    snprintf(what, sizeof what, "golden %s %s o", gd->name, path);
    tcu_assert_close(o, gd->o, x->nv, tol, what);
    snprintf(what, sizeof what, "golden %s %s hT", gd->name, path);
    tcu_assert_close(s, gd->hT, x->ns, tol, what);
    free(o);
    free(s);
}

static void check(const golden *gd, gdev *x, const char *path) {
    check_tol(gd, x, path, REL_TOL);
}

static void for_each_golden(void (*fn)(const golden *gd, gdev *x)) {
    int n = 0;
    char **files = golden_files(&n);
    for (int i = 0; i < n; i++) {
        golden gd;
        golden_open(files[i], &gd);
        gdev x;
        gdev_upload(&gd, &x);
        fn(&gd, &x);
        gdev_free(&x);
        eng_st_close(gd.f);
        free(files[i]);
    }
    free(files);
}

static void prefill_one(const golden *gd, gdev *x) {
    gdev_reset(gd, x);
    gpu_prefill(gd, x, false, false, 0, gd->T);
    check(gd, x, "prefill");
}

static void prefill_raw_one(const golden *gd, gdev *x) {
    gdev_reset(gd, x);
    gpu_prefill(gd, x, true, false, 0, gd->T);
    check(gd, x, "prefill raw");
}

static void prefill_tc_one(const golden *gd, gdev *x) {
    if (gd->K % 16 != 0) {
        printf("cuda check golden %s prefill tc: skipped (K=%d is not a multiple of 16)\n",
               gd->name, gd->K);
        return;
    }
    gdev_reset(gd, x);
    gpu_prefill(gd, x, true, true, 0, gd->T);
    check_tol(gd, x, "prefill tc", REL_TOL_TC);
}

static void decode_one(const golden *gd, gdev *x) {
    if (!decode_supports(gd)) {
        printf("cuda check golden %s decode: skipped (K=%d V=%d not compiled)\n", gd->name, gd->K,
               gd->V);
        return;
    }
    int32_t zero = 0;
    int32_t *d_slot = tcu_dev_alloc(sizeof zero);
    tcu_h2d(d_slot, &zero, sizeof zero);
    gdev_reset(gd, x);
    gpu_decode(gd, x, d_slot, 0, gd->T);
    check(gd, x, "decode");
    kern_cuda_free(d_slot);
}

static void split_one(const golden *gd, gdev *x) {
    if (!decode_supports(gd)) return;
    int32_t zero = 0;
    int32_t *d_slot = tcu_dev_alloc(sizeof zero);
    tcu_h2d(d_slot, &zero, sizeof zero);
    const int p = 2 * gd->T / 3;
    gdev_reset(gd, x);
    gpu_prefill(gd, x, true, false, 0, p);
    gpu_decode(gd, x, d_slot, p, gd->T - p);
    check(gd, x, "prefill+decode");
    kern_cuda_free(d_slot);
}

Test(cuda_golden, prefill) {
    tcu_require_device();
    for_each_golden(prefill_one);
}

Test(cuda_golden, prefill_from_raw_inputs) {
    tcu_require_device();
    for_each_golden(prefill_raw_one);
}

Test(cuda_golden, prefill_tensor_cores) {
    tcu_require_device();
    for_each_golden(prefill_tc_one);
}

Test(cuda_golden, decode_token_by_token) {
    tcu_require_device();
    for_each_golden(decode_one);
}

Test(cuda_golden, prefill_then_decode) {
    tcu_require_device();
    for_each_golden(split_one);
}

#else /* !KDS_HAVE_CUDA */

Test(cuda_golden, skipped) {
    cr_skip_test("built without CUDA");
}

#endif
