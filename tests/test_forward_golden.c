/*
 * Whole-model golden tests: every checkpoint under ../shared/golden/model
 * (and under $KDA_MODEL_GOLDEN_DIR when set) must reproduce its expected
 * logits through the prefill path and through token-by-token decode.
 * The expected logits come from an independent fp32 PyTorch forward
 * (golden/README.md). Tolerance: 1e-5 x the largest |logit|, as the README
 * expects of a float32 implementation.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <sys/wait.h>

#include "eng.h"
#include "eng_config.h"
#include "eng_safetensors.h"
#include "test_helpers.h"

#define LOGIT_TOL 1e-5

static void check_model_dir(const char *dir) {
    kds_err err = {0};
    char path[4200];
    snprintf(path, sizeof path, "%s/expected.safetensors", dir);
    eng_st_file *ex = NULL;
    cr_assert_eq(eng_st_open(path, &ex, &err), KDS_OK, "%s: %s", path, err.msg);
    const eng_st_tensor *ids_t = eng_st_find(ex, "ids"), *lg_t = eng_st_find(ex, "logits");
    cr_assert(ids_t && lg_t && ids_t->dtype == ENG_ST_I32 && lg_t->dtype == ENG_ST_F32,
              "%s lacks ids (I32) or logits (F32)", path);
    const int64_t T = ids_t->shape[0];
    const int32_t *ids = ids_t->data;
    const float *want = lg_t->data;

    eng_model_params mp = eng_model_default_params();
    mp.no_fingerprint_cache = true;
    eng_model *m = NULL;
    cr_assert_eq(eng_model_load(dir, &mp, &m, &err), KDS_OK, "%s: %s", dir, err.msg);
    const int V = eng_model_config(m)->vocab_size;
    cr_assert_eq(lg_t->shape[1], V, "%s: expected logits have vocab %lld, model %d", dir,
                 (long long)lg_t->shape[1], V);
    float *got = malloc((size_t)T * V * sizeof(float));
    cr_assert(got);

    /* Two chunk/batch geometries for prefill: one batch of everything with
     * 16-token KDA chunks (boundaries inside the sequence), and 7-token batches
     * (state carried across prefill calls). */
    const int batches[2] = {256, 7}, chunks[2] = {16, 64};
    for (int g = 0; g < 2; g++) {
        eng_ctx_params cp = eng_ctx_default_params();
        cp.max_batch = batches[g];
        cp.kda_chunk = chunks[g];
        eng_ctx *c = NULL;
        cr_assert_eq(eng_ctx_create(m, &cp, &c, &err), KDS_OK, "%s", err.msg);
        eng_seq *s = NULL;
        cr_assert_eq(eng_seq_create(m, 0, &s, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_prefill(c, s, ids, T, got, NULL, NULL, &err), KDS_OK, "%s", err.msg);
        double ref_max, d = th_max_abs_diff(got, want, (size_t)T * V, &ref_max);
        cr_log_info("%s: prefill (batch %d, chunk %d): max |err| %.3g = %.3g of max |logit| %.3g",
                    dir, batches[g], chunks[g], d, d / ref_max, ref_max);
        fprintf(stderr, "golden model %s prefill batch=%d chunk=%d: rel err %.3g\n", dir,
                batches[g], chunks[g], d / ref_max);
        cr_expect_leq(d, LOGIT_TOL * ref_max, "%s prefill: max err %g > %g", dir, d,
                      LOGIT_TOL * ref_max);

        eng_seq_reset(s, 0);
        for (int64_t t = 0; t < T; t++) {
            cr_assert_eq(eng_decode(c, s, ids[t], &err), KDS_OK, "%s", err.msg);
            memcpy(got + (size_t)t * V, eng_seq_logits(s), (size_t)V * sizeof(float));
        }
        d = th_max_abs_diff(got, want, (size_t)T * V, &ref_max);
        fprintf(stderr, "golden model %s decode: rel err %.3g\n", dir, d / ref_max);
        cr_expect_leq(d, LOGIT_TOL * ref_max, "%s decode: max err %g > %g", dir, d,
                      LOGIT_TOL * ref_max);
        eng_seq_free(s);
        eng_ctx_free(c);
    }
    free(got);
    eng_model_free(m);
    eng_st_close(ex);
}

static int check_root(const char *root) {
    char *dirs[64];
    int n = th_list(root, NULL, 1, dirs, 64);
    cr_assert_geq(n, 0, "cannot read golden model folder %s", root);
    for (int i = 0; i < n; i++) {
        check_model_dir(dirs[i]);
        free(dirs[i]);
    }
    return n;
}

Test(forward_golden, shared_checkpoints) {
    int n = check_root(GOLDEN_ROOT "/model");
    cr_assert_gt(n, 0, "no golden checkpoints found under " GOLDEN_ROOT "/model");
}

Test(forward_golden, env_checkpoints) {
    const char *extra = getenv("KDA_MODEL_GOLDEN_DIR");
    if (!extra || !*extra) cr_skip_test("KDA_MODEL_GOLDEN_DIR not set");
    int n = check_root(extra);
    cr_assert_gt(n, 0, "no checkpoints found under KDA_MODEL_GOLDEN_DIR=%s", extra);
}
