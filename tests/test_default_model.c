/*
 * The shipped default model (models/default, trained by training/): the
 * engine's logits on held-out text must match the PyTorch model it was
 * trained as. training/export.py wrote models/default/expected_heldout.
 * safetensors once, from the stored weights (BF16 matrices, F32 vectors)
 * widened to float32 and run in float32 with the token-by-token KDA
 * recurrence (training/model.py, itself checked against the golden
 * micro-kda checkpoint by training/check_golden.py). This is the project's
 * own reference: the engine is checked against independent goldens in
 * test_forward_golden.c; here the trained weights (real decay gates, router
 * biases and expert loads instead of random ones) exercise it once more.
 *
 * Tolerance: 1e-5 x the largest |logit|, both for the prefill path (two
 * batch / chunk geometries) and token-by-token decode; both sides compute in
 * float32 from identical weights, so only summation order differs.
 *
 * Also checked: the model is what docs promise (pure KDA + MoE, first layer
 * dense, no MLA, weights at most 16 MB), and, when the model directory's
 * tokenizer loads as tiktoken, the reference text encodes to exactly the
 * reference ids and decodes back to the text.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <sys/stat.h>

#include "eng.h"
#include "eng_config.h"
#include "eng_safetensors.h"
#include "test_helpers.h"

#define DEFAULT_MODEL KDS_SOURCE_DIR "/models/default"
#define EXPECTED DEFAULT_MODEL "/expected_heldout.safetensors"
#define LOGIT_TOL 1e-5
#define MAX_WEIGHT_BYTES (16u * 1000u * 1000u)

static eng_model *load_default(void) {
    kds_err err = {0};
    eng_model_params mp = eng_model_default_params();
    mp.no_fingerprint_cache = true;
    eng_model *m = NULL;
    cr_assert_eq(eng_model_load(DEFAULT_MODEL, &mp, &m, &err), KDS_OK, "%s", err.msg);
    return m;
}

static eng_st_file *open_expected(const eng_st_tensor **ids, const eng_st_tensor **logits) {
    kds_err err = {0};
    eng_st_file *ex = NULL;
    cr_assert_eq(eng_st_open(EXPECTED, &ex, &err), KDS_OK, "%s", err.msg);
    *ids = eng_st_find(ex, "ids");
    *logits = eng_st_find(ex, "logits");
    cr_assert(*ids && *logits && (*ids)->dtype == ENG_ST_I32 && (*logits)->dtype == ENG_ST_F32 &&
                  (*ids)->n_dims == 1 && (*logits)->n_dims == 2 &&
                  (*logits)->shape[0] == (*ids)->shape[0],
              EXPECTED " lacks ids I32 [T] or logits F32 [T, vocab]");
    return ex;
}

Test(default_model, is_pure_kda_moe_and_small) {
    eng_model *m = load_default();
    const eng_config *c = eng_model_config(m);
    cr_expect_eq(c->n_mla_layers, 0, "the default model must have no MLA layers");
    cr_expect_eq(c->n_kda_layers, c->num_hidden_layers);
    cr_expect_gt(c->num_experts, 0, "the default model must be MoE");
    cr_expect_eq(c->first_k_dense_replace, 1);
    cr_expect_eq(c->vocab_size, 8192 + 256, "8,192 cl100k ranks + 256 Kimi-style specials");
    for (int l = 0; l < c->num_hidden_layers; l++)
        cr_expect_eq(c->layer_is_moe[l], l >= 1, "layer %d", l);
    struct stat sb;
    cr_assert_eq(stat(DEFAULT_MODEL "/model.safetensors", &sb), 0);
    cr_expect_leq((size_t)sb.st_size, MAX_WEIGHT_BYTES, "weights are %lld bytes",
                  (long long)sb.st_size);
    eng_model_free(m);
}

Test(default_model, engine_matches_pytorch_on_heldout_text) {
    kds_err err = {0};
    const eng_st_tensor *ids_t, *lg_t;
    eng_st_file *ex = open_expected(&ids_t, &lg_t);
    const int64_t T = ids_t->shape[0];
    const int32_t *ids = ids_t->data;
    const float *want = lg_t->data;
    eng_model *m = load_default();
    const int V = eng_model_config(m)->vocab_size;
    cr_assert_eq(lg_t->shape[1], V, "expected logits have vocab %lld, model %d",
                 (long long)lg_t->shape[1], V);
    float *got = malloc((size_t)T * V * sizeof(float));
    cr_assert(got);

    /* prefill: everything in one batch with 16-token KDA chunks, then
     * 7-token batches with 64-token chunks (state carried across calls) */
    const int batches[2] = {256, 7}, chunks[2] = {16, 64};
    for (int geo = 0; geo < 2; geo++) {
        eng_ctx_params cp = eng_ctx_default_params();
        cp.max_batch = batches[geo];
        cp.kda_chunk = chunks[geo];
        eng_ctx *c = NULL;
        cr_assert_eq(eng_ctx_create(m, &cp, &c, &err), KDS_OK, "%s", err.msg);
        eng_seq *s = NULL;
        cr_assert_eq(eng_seq_create(m, 0, &s, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_prefill(c, s, ids, T, got, NULL, NULL, &err), KDS_OK, "%s", err.msg);
        double ref_max, d = th_max_abs_diff(got, want, (size_t)T * V, &ref_max);
        fprintf(stderr, "default model prefill batch=%d chunk=%d: max |err| %.3g = %.3g of max "
                "|logit| %.3g\n", batches[geo], chunks[geo], d, d / ref_max, ref_max);
        cr_expect_leq(d, LOGIT_TOL * ref_max, "prefill (batch %d, chunk %d): max err %g > %g",
                      batches[geo], chunks[geo], d, LOGIT_TOL * ref_max);

        if (geo == 0) {
            eng_seq_reset(s, 0);
            for (int64_t t = 0; t < T; t++) {
                cr_assert_eq(eng_decode(c, s, ids[t], &err), KDS_OK, "%s", err.msg);
                memcpy(got + (size_t)t * V, eng_seq_logits(s), (size_t)V * sizeof(float));
            }
            d = th_max_abs_diff(got, want, (size_t)T * V, &ref_max);
            fprintf(stderr, "default model decode: max |err| %.3g = %.3g of max |logit|\n", d,
                    d / ref_max);
            cr_expect_leq(d, LOGIT_TOL * ref_max, "decode: max err %g > %g", d,
                          LOGIT_TOL * ref_max);
        }
        eng_seq_free(s);
        eng_ctx_free(c);
    }
    free(got);
    eng_model_free(m);
    eng_st_close(ex);
}

Test(default_model, tokenizer_encodes_reference_text) {
    const eng_st_tensor *ids_t, *lg_t;
    eng_st_file *ex = open_expected(&ids_t, &lg_t);
    const eng_st_tensor *text_t = eng_st_find(ex, "text");
    cr_assert(text_t && text_t->dtype == ENG_ST_U8, EXPECTED " lacks text U8 [n]");
    eng_model *m = load_default();
    const eng_tokenizer *tok = eng_model_tokenizer(m);
    if (strncmp(eng_tok_kind(tok), "tiktoken", 8) != 0) {
        eng_model_free(m);
        eng_st_close(ex);
        cr_skip_test("models/default loads a %s tokenizer, not tiktoken", eng_tok_kind(tok));
    }
    const char *text = text_t->data;
    const size_t len = text_t->n_bytes;
    const int64_t T = ids_t->shape[0];
    const int32_t *want = ids_t->data;
    int32_t *got = malloc((len + 1) * sizeof *got);
    cr_assert(got);
    int64_t n = eng_tok_encode(tok, text, len, got, (int64_t)len);
    cr_assert_eq(n, T, "reference text encodes to %lld ids, expected %lld", (long long)n,
                 (long long)T);
    for (int64_t i = 0; i < T; i++)
        cr_expect_eq(got[i], want[i], "id %lld: %d, expected %d", (long long)i, got[i], want[i]);
    char *back = malloc(len + 1);
    cr_assert(back);
    cr_expect_eq(eng_tok_decode(tok, want, T, 0, back, len + 1), (int64_t)len);
    cr_expect(memcmp(back, text, len) == 0, "decode(ids) differs from the reference text");
    cr_expect_eq(eng_tok_eos(tok), eng_model_config(m)->eos_token_id);
    cr_expect(eng_tok_is_stop(tok, eng_tok_special_id(tok, "[EOS]")), "[EOS] must stop");
    free(back);
    free(got);
    eng_model_free(m);
    eng_st_close(ex);
}
