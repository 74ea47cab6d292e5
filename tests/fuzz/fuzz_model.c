/*
 * fuzz_model.c - libFuzzer target: a model directory (eng_model_load,
 * engine/eng.h). The input is config.json, FZ_SEP, then model.safetensors;
 * both are written into a scratch directory that the loader reads. The
 * seeds are the nano models of fuzz_util.h (a few KiB each), so mutations
 * of a loadable model stay small and fast.
 *
 * A model that loads must also run: a CPU context is made for it, a few
 * tokens are prefilled and one decoded, a token sampled, and the state
 * saved and loaded back. The loader promises that every tensor the config
 * implies was checked for presence, format and shape, so nothing the
 * forward pass does with a loaded model may read outside its weights.
 */
#include "fuzz_util.h"

/* The forward pass on a loaded model: everything must succeed (the inputs
 * are valid ids) or fail with a message, and never touch memory it does
 * not own. */
static void run_model(const eng_model *m) {
    eng_ctx *ctx = NULL;
    eng_seq *s = NULL;
    unsigned char *state = NULL;
    kds_err e = {0};
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cp.max_batch = 4;
    cp.max_seqs = 1;
    if (eng_ctx_create(m, &cp, &ctx, &e) != KDS_OK) {
        /* a model the CPU cannot run is refused by name, not crashed on */
        if (!e.msg[0]) fz_fail("eng_ctx_create failed without a message");
        return;
    }
    if (eng_seq_create(m, 1, &s, &e) != KDS_OK) goto out;
    const int vocab = eng_model_config(m)->vocab_size;
    int32_t ids[5];
    for (int i = 0; i < 5; i++) ids[i] = (int32_t)((i * 7 + 1) % vocab);
    if (eng_prefill(ctx, s, ids, 5, NULL, NULL, NULL, &e) != KDS_OK) goto out;
    if (eng_decode(ctx, s, ids[0], &e) != KDS_OK) goto out;
    eng_sampler_params sp = eng_sampler_default_params();
    int32_t tok = -1;
    if (eng_sample(ctx, s, &sp, &tok, &e) != KDS_OK) goto out;
    if (tok < 0 || tok >= vocab) fz_fail("sampled token %d outside [0, %d)", tok, vocab);
    size_t n = eng_seq_state_bytes(s);
    if (!(state = malloc(n))) goto out;
    if (eng_seq_state_save(s, state, n, &e) != KDS_OK ||
        eng_seq_state_load(s, state, n, &e) != KDS_OK)
        fz_fail("a model's own state does not load back: %s", e.msg);
out:
    free(state);
    eng_seq_free(s);
    eng_ctx_free(ctx);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz_part parts[2];
    if (fz_split(data, size, parts, 2) != 2) return 0;
    const char *dir = fz_subdir(0, "model");
    fz_write_file(fz_path(1, "model/config.json"), parts[0].p, parts[0].n);
    fz_write_file(fz_path(1, "model/model.safetensors"), parts[1].p, parts[1].n);
    eng_model_params mp = fz_model_params();
    eng_model *m = NULL;
    kds_err e = {0};
    if (eng_model_load(dir, &mp, &m, &e) != KDS_OK) {
        if (e.status == KDS_OK || !e.msg[0]) fz_fail("eng_model_load failed without a message");
        return 0;
    }
    const char *fp = eng_model_fingerprint(m);
    if (!fp || strlen(fp) != 32) fz_fail("fingerprint '%s' is not 32 hex digits", fp ? fp : "");
    if (!eng_model_tokenizer(m)) fz_fail("a loaded model without a tokenizer");
    run_model(m);
    eng_model_free(m);
    return 0;
}
