/*
 * fuzz_state.c - libFuzzer target: a sequence's state bytes (KDSSTATE,
 * docs/formats.md; eng_seq_state_load, eng_seq_load_fixed and
 * eng_seq_load_mla in engine/eng.h). The first input byte chooses:
 *   bit 0      the model: 0 the pure-KDA nano model, 1 the hybrid one
 *              (fuzz_util.h; written and loaded once per process);
 *   bits 1-2   0 eng_seq_state_load, 1 eng_seq_load_fixed,
 *              2 eng_seq_load_mla of rows [b1 % 8, b2 % 8) into a sequence
 *              that has consumed 6 tokens (b1, b2: the next two bytes).
 * The rest is the state.
 *
 * Properties: a refused state leaves the sequence as it was (its saved
 * bytes do not change); a state that loads saves back as the same bytes
 * (but for the zero fields of the header, which the reader ignores), and
 * the sequence then samples, and (when its MLA rows fit CLONE_BUDGET_BYTES)
 * clones and decodes like any other.
 */
#include "fuzz_util.h"

/* the MLA rows a state may claim and still be cloned here: far below
 * libFuzzer's -rss_limit_mb (scripts/fuzz.sh) */
#define CLONE_BUDGET_BYTES ((uint64_t)256 << 20)

enum { HDR_ZERO0 = 72, HDR_ZERO0_END = 80, HDR_ZERO1 = 112, HDR_ZERO1_END = 128 };

static eng_model *models[2];
static eng_ctx *ctxs[2];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    models[0] = fz_nano_load(FZ_NANO_KDA, "nano-kda");
    models[1] = fz_nano_load(FZ_NANO_HYBRID, "nano-hybrid");
    ctxs[0] = fz_ctx(models[0]);
    ctxs[1] = fz_ctx(models[1]);
    return 0;
}

/* The bytes eng_seq_state_save writes now (caller frees). */
static unsigned char *saved(const eng_seq *s, size_t *n, bool fixed) {
    *n = fixed ? eng_seq_fixed_bytes(s) : eng_seq_state_bytes(s);
    unsigned char *b = malloc(*n ? *n : 1);
    kds_err e = {0};
    if (!b) abort();
    kds_status rc = fixed ? eng_seq_save_fixed(s, b, *n, &e) : eng_seq_state_save(s, b, *n, &e);
    if (rc != KDS_OK) fz_fail("saving a sequence: %s", e.msg);
    return b;
}

static void same_as_before(const eng_seq *s, const unsigned char *before, size_t n,
                           const char *what) {
    size_t m;
    unsigned char *now = saved(s, &m, false);
    if (m != n || memcmp(now, before, n) != 0) fz_fail("a refused %s changed the sequence", what);
    free(now);
}

/* A loaded state must save back as the input, but for the ignored zeros. */
static void same_as_input(const eng_seq *s, const uint8_t *in, size_t n, bool fixed) {
    size_t m;
    unsigned char *out = saved(s, &m, fixed);
    if (m != n) fz_fail("a state of %zu bytes saves back as %zu", n, m);
    unsigned char *want = malloc(n);
    if (!want) abort();
    memcpy(want, in, n);
    memset(want + HDR_ZERO0, 0, HDR_ZERO0_END - HDR_ZERO0);
    memset(want + HDR_ZERO1, 0, HDR_ZERO1_END - HDR_ZERO1);
    if (memcmp(out, want, n) != 0) {
        size_t off = 0;
        while (out[off] == want[off]) off++;
        fz_fail("a loaded state saves back differently (first at byte %zu of %zu)", off, n);
    }
    free(want);
    free(out);
}

/* Use a loaded sequence the way a server would. */
static void exercise(eng_ctx *ctx, eng_seq *s) {
    kds_err e = {0};
    int32_t tok;
    eng_sampler_params sp = eng_sampler_default_params();
    if (eng_seq_pos(s) > 0) {
        if (eng_sample(ctx, s, &sp, &tok, &e) != KDS_OK) fz_fail("greedy sample: %s", e.msg);
        sp.temperature = 0.8f;
        sp.top_k = 5;
        sp.top_p = 0.9f;
        sp.repeat_penalty = 1.3f;
        if (eng_sample(ctx, s, &sp, &tok, &e) != KDS_OK) fz_fail("sample: %s", e.msg);
    }
    /* A clone copies every row the state claims, and a fixed part may claim
     * gigabytes of rows it does not carry (eng_seq_load_fixed bounds the
     * claim only by the machine's memory): cloning such a state really
     * needs that memory, which is no bug, so only states whose rows fit the
     * fuzz run's budget are cloned and decoded. */
    if ((uint64_t)eng_seq_pos(s) * eng_seq_mla_token_bytes(s) > CLONE_BUDGET_BYTES) return;
    eng_seq *c = NULL;
    if (eng_seq_clone(s, &c, &e) == KDS_OK) {
        /* NaN or huge states make garbage logits, never a crash */
        (void)eng_decode(ctx, c, 3, &e);
        size_t n;
        free(saved(c, &n, false));
        eng_seq_free(c);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const int which = data[0] & 1, op = (data[0] >> 1) & 3;
    eng_seq *s = NULL;
    kds_err e = {0};
    if (eng_seq_create(models[which], 11, &s, &e) != KDS_OK) abort();
    eng_ctx *ctx = ctxs[which];
    size_t nb;
    unsigned char *before = NULL;
    if (op == 0 || op == 1) {
        const uint8_t *p = data + 1;
        size_t n = size - 1;
        before = saved(s, &nb, false);
        kds_status rc = op == 0 ? eng_seq_state_load(s, p, n, &e) : eng_seq_load_fixed(s, p, n, &e);
        if (rc != KDS_OK) {
            if (!e.msg[0]) fz_fail("state refused without a message");
            same_as_before(s, before, nb, "state");
        } else {
            same_as_input(s, p, n, op == 1);
            exercise(ctx, s);
        }
    } else if (op == 2 && size >= 3) {
        const int32_t ids[6] = {1, 5, 9, 2, 7, 3};
        if (eng_prefill(ctx, s, ids, 6, NULL, NULL, NULL, &e) != KDS_OK) fz_fail("%s", e.msg);
        before = saved(s, &nb, false);
        int64_t t0 = data[1] % 8, t1 = data[2] % 8;
        if (eng_seq_load_mla(s, t0, t1, data + 3, size - 3, &e) != KDS_OK) {
            if (!e.msg[0]) fz_fail("MLA rows refused without a message");
            same_as_before(s, before, nb, "MLA row set");
        } else {
            exercise(ctx, s);
        }
    }
    free(before);
    eng_seq_free(s);
    return 0;
}
