/*
 * Engine behaviour beyond the golden logits: the sequence state's byte form
 * (exact round trip, refusals that leave the sequence untouched), token-id
 * checks, the sampler's determinism and its RNG living in the state, and
 * forks being independent. Uses the golden micro checkpoints as small real
 * models.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <unistd.h>

#include "eng.h"
#include "eng_config.h"
#include "test_helpers.h"

#define HYBRID GOLDEN_ROOT "/model/micro-hybrid"
#define PURE GOLDEN_ROOT "/model/micro-kda"

typedef struct fixture {
    eng_model *m;
    eng_ctx *c;
    int vocab;
} fixture;

static fixture open_model(const char *dir) {
    fixture f = {0};
    kds_err err = {0};
    eng_model_params mp = eng_model_default_params();
    mp.no_fingerprint_cache = true;
    cr_assert_eq(eng_model_load(dir, &mp, &f.m, &err), KDS_OK, "%s", err.msg);
    eng_ctx_params cp = eng_ctx_default_params();
    cp.max_batch = 32;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &f.c, &err), KDS_OK, "%s", err.msg);
    f.vocab = eng_model_config(f.m)->vocab_size;
    return f;
}

static void close_model(fixture *f) {
    eng_ctx_free(f->c);
    eng_model_free(f->m);
}

static void prompt(int32_t *ids, int n, int vocab, uint32_t seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        ids[i] = (int32_t)(seed >> 8) % vocab;
    }
}

/* Feed `n` sampled tokens; record tokens and last logits. */
static void run_tokens(fixture *f, eng_seq *s, const eng_sampler_params *sp, int n, int32_t *toks,
                       float *last_logits) {
    kds_err err = {0};
    for (int i = 0; i < n; i++) {
        cr_assert_eq(eng_sample(f->c, s, sp, &toks[i], &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_decode(f->c, s, toks[i], &err), KDS_OK, "%s", err.msg);
    }
    if (last_logits) memcpy(last_logits, eng_seq_logits(s), (size_t)f->vocab * sizeof(float));
}

static void resume_is_exact(const char *dir, float temperature) {
    fixture f = open_model(dir);
    kds_err err = {0};
    int32_t ids[40];
    prompt(ids, 40, f.vocab, 7);
    eng_sampler_params sp = eng_sampler_default_params();
    sp.temperature = temperature;
    /* One go: prompt, then 12 tokens. */
    eng_seq *a = NULL;
    cr_assert_eq(eng_seq_create(f.m, 42, &a, &err), KDS_OK);
    cr_assert_eq(eng_prefill(f.c, a, ids, 40, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    int32_t one[12], two[12];
    float *la = malloc((size_t)f.vocab * sizeof(float)), *lb = malloc((size_t)f.vocab * sizeof(float));
    run_tokens(&f, a, &sp, 12, one, la);
    /* Split: prompt, 5 tokens, save, load into a fresh sequence, 7 more. */
    eng_seq *b = NULL, *r = NULL;
    cr_assert_eq(eng_seq_create(f.m, 42, &b, &err), KDS_OK);
    cr_assert_eq(eng_prefill(f.c, b, ids, 40, NULL, NULL, NULL, &err), KDS_OK);
    run_tokens(&f, b, &sp, 5, two, NULL);
    size_t n = eng_seq_state_bytes(b);
    eng_state_size z = eng_config_state_size(eng_model_config(f.m));
    cr_assert_eq(n, z.fixed + z.per_token * (size_t)eng_seq_pos(b));
    void *buf = malloc(n);
    cr_assert_eq(eng_seq_state_save(b, buf, n, &err), KDS_OK, "%s", err.msg);
    eng_seq_free(b);
    cr_assert_eq(eng_seq_create(f.m, 999, &r, &err), KDS_OK); /* seed is overwritten by load */
    cr_assert_eq(eng_seq_state_load(r, buf, n, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_seq_pos(r), 45);
    run_tokens(&f, r, &sp, 7, two + 5, lb);
    cr_assert_arr_eq(one, two, sizeof one, "tokens differ after resume");
    cr_assert_arr_eq(la, lb, (size_t)f.vocab * sizeof(float), "logits differ after resume");
    free(buf);
    free(la);
    free(lb);
    eng_seq_free(a);
    eng_seq_free(r);
    close_model(&f);
}

Test(engine, resume_exact_greedy_hybrid) { resume_is_exact(HYBRID, 0.0f); }
Test(engine, resume_exact_sampled_hybrid) { resume_is_exact(HYBRID, 1.0f); }
Test(engine, resume_exact_greedy_pure) { resume_is_exact(PURE, 0.0f); }
Test(engine, resume_exact_sampled_pure) { resume_is_exact(PURE, 0.9f); }

Test(engine, state_refusals_leave_sequence_alone) {
    fixture f = open_model(HYBRID), g = open_model(PURE);
    kds_err err = {0};
    int32_t ids[10];
    prompt(ids, 10, f.vocab, 3);
    eng_seq *s = NULL, *t = NULL;
    cr_assert_eq(eng_seq_create(f.m, 1, &s, &err), KDS_OK);
    cr_assert_eq(eng_prefill(f.c, s, ids, 10, NULL, NULL, NULL, &err), KDS_OK);
    size_t n = eng_seq_state_bytes(s);
    unsigned char *good = malloc(n), *bad = malloc(n);
    cr_assert_eq(eng_seq_state_save(s, good, n, &err), KDS_OK);
    cr_assert_eq(eng_seq_create(f.m, 1, &t, &err), KDS_OK);

    memcpy(bad, good, n);
    bad[0] ^= 0xff;
    cr_expect_eq(eng_seq_state_load(t, bad, n, &err), KDS_BAD_FORMAT);
    cr_expect(strstr(err.msg, "magic"), "message: %s", err.msg);
    memcpy(bad, good, n);
    bad[8] = 99; /* version */
    cr_expect_eq(eng_seq_state_load(t, bad, n, &err), KDS_UNSUPPORTED);
    cr_expect(strstr(err.msg, "version 99"), "message: %s", err.msg);
    cr_expect_eq(eng_seq_state_load(t, good, n - 1, &err), KDS_BAD_FORMAT, "truncated");
    cr_expect_eq(eng_seq_state_load(t, good, 20, &err), KDS_BAD_FORMAT, "header cut");
    memcpy(bad, good, n);
    bad[16] ^= 1; /* position no longer matches the length */
    cr_expect_eq(eng_seq_state_load(t, bad, n, &err), KDS_BAD_FORMAT);
    cr_expect_eq(eng_seq_pos(t), 0, "a refused load must not change the sequence");

    /* A state of another model is refused by the receiving model. */
    eng_seq *u = NULL;
    cr_assert_eq(eng_seq_create(g.m, 1, &u, &err), KDS_OK);
    cr_expect_eq(eng_seq_state_load(u, good, n, &err), KDS_MISMATCH);
    cr_expect(strstr(err.msg, "another model"), "message: %s", err.msg);
    cr_expect_eq(eng_seq_pos(u), 0);

    cr_expect_eq(eng_seq_state_load(t, good, n, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(eng_seq_pos(t), 10);
    free(good);
    free(bad);
    eng_seq_free(s);
    eng_seq_free(t);
    eng_seq_free(u);
    close_model(&f);
    close_model(&g);
}

Test(engine, token_ids_out_of_range_are_refused) {
    fixture f = open_model(PURE);
    kds_err err = {0};
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 1, &s, &err), KDS_OK);
    int32_t ids[3] = {1, f.vocab, 2};
    cr_expect_eq(eng_prefill(f.c, s, ids, 3, NULL, NULL, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "outside the vocabulary"), "message: %s", err.msg);
    cr_expect_eq(eng_seq_pos(s), 0);
    cr_expect_eq(eng_decode(f.c, s, -5, &err), KDS_INVALID_ARG);
    cr_expect_eq(eng_seq_pos(s), 0);
    int32_t tok;
    cr_expect_eq(eng_sample(f.c, s, &(eng_sampler_params){.temperature = 0}, &tok, &err),
                 KDS_INVALID_ARG, "sampling an empty sequence");
    eng_seq_free(s);
    close_model(&f);
}

Test(engine, sampler_seeds_and_filters) {
    fixture f = open_model(HYBRID);
    kds_err err = {0};
    int32_t ids[8];
    prompt(ids, 8, f.vocab, 11);
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 5, &s, &err), KDS_OK);
    cr_assert_eq(eng_prefill(f.c, s, ids, 8, NULL, NULL, NULL, &err), KDS_OK);
    const float *lg = eng_seq_logits(s);
    int best = 0;
    for (int i = 1; i < f.vocab; i++)
        if (lg[i] > lg[best]) best = i;
    int32_t tok;
    eng_sampler_params sp = eng_sampler_default_params();
    sp.temperature = 0.0f;
    cr_assert_eq(eng_sample(f.c, s, &sp, &tok, &err), KDS_OK);
    cr_expect_eq(tok, best, "temperature 0 is argmax");
    sp.temperature = 1.5f;
    sp.top_k = 1;
    cr_assert_eq(eng_sample(f.c, s, &sp, &tok, &err), KDS_OK);
    cr_expect_eq(tok, best, "top-k 1 is argmax");
    /* min-p 1 keeps only the best token too. */
    sp.top_k = 0;
    sp.top_p = 1.0f;
    sp.min_p = 1.0f;
    cr_assert_eq(eng_sample(f.c, s, &sp, &tok, &err), KDS_OK);
    cr_expect_eq(tok, best, "min-p 1 is argmax");
    /* Same seed, same draws; the draws spread over several tokens. */
    sp = eng_sampler_default_params();
    sp.temperature = 2.0f;
    sp.top_k = 0;
    sp.top_p = 1.0f;
    sp.min_p = 0.0f;
    int32_t a[64], b[64];
    eng_seq_reset(s, 77);
    cr_assert_eq(eng_prefill(f.c, s, ids, 8, NULL, NULL, NULL, &err), KDS_OK);
    for (int i = 0; i < 64; i++) eng_sample(f.c, s, &sp, &a[i], &err);
    eng_seq_reset(s, 77);
    cr_assert_eq(eng_prefill(f.c, s, ids, 8, NULL, NULL, NULL, &err), KDS_OK);
    for (int i = 0; i < 64; i++) eng_sample(f.c, s, &sp, &b[i], &err);
    cr_expect_arr_eq(a, b, sizeof a, "same seed must give the same draws");
    int distinct = 0;
    for (int i = 0; i < 64; i++) {
        int seen = 0;
        for (int j = 0; j < i; j++) seen |= a[j] == a[i];
        distinct += !seen;
    }
    cr_expect_gt(distinct, 3, "hot sampling should not be stuck on one token");
    eng_seq_free(s);
    close_model(&f);
}

Test(engine, forks_are_independent) {
    fixture f = open_model(HYBRID);
    kds_err err = {0};
    int32_t ids[12];
    prompt(ids, 12, f.vocab, 5);
    eng_seq *p = NULL, *a = NULL, *b = NULL;
    cr_assert_eq(eng_seq_create(f.m, 3, &p, &err), KDS_OK);
    cr_assert_eq(eng_prefill(f.c, p, ids, 12, NULL, NULL, NULL, &err), KDS_OK);
    size_t n = eng_seq_state_bytes(p);
    void *before = malloc(n), *after = malloc(n);
    eng_seq_state_save(p, before, n, &err);
    cr_assert_eq(eng_seq_clone(p, &a, &err), KDS_OK);
    cr_assert_eq(eng_seq_clone(p, &b, &err), KDS_OK);
    cr_assert_eq(eng_decode(f.c, a, 1, &err), KDS_OK);
    cr_assert_eq(eng_decode(f.c, b, 2, &err), KDS_OK);
    cr_expect_neq(memcmp(eng_seq_logits(a), eng_seq_logits(b), (size_t)f.vocab * sizeof(float)), 0,
                  "forks fed different tokens must diverge");
    eng_seq_state_save(p, after, n, &err);
    cr_expect_eq(memcmp(before, after, n), 0, "the parent must not change");
    free(before);
    free(after);
    eng_seq_free(p);
    eng_seq_free(a);
    eng_seq_free(b);
    close_model(&f);
}

Test(engine, one_thread_matches_many) {
    fixture f = open_model(HYBRID);
    kds_err err = {0};
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    eng_ctx *c1 = NULL;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &c1, &err), KDS_OK);
    int32_t ids[30];
    prompt(ids, 30, f.vocab, 9);
    float *x = malloc(30 * (size_t)f.vocab * sizeof(float)), *y = malloc(30 * (size_t)f.vocab * sizeof(float));
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 0, &s, &err), KDS_OK);
    cr_assert_eq(eng_prefill(c1, s, ids, 30, x, NULL, NULL, &err), KDS_OK);
    eng_seq_reset(s, 0);
    cr_assert_eq(eng_prefill(f.c, s, ids, 30, y, NULL, NULL, &err), KDS_OK);
    double ref, d = th_max_abs_diff(x, y, 30 * (size_t)f.vocab, &ref);
    cr_expect_leq(d, 1e-5 * ref, "threads change logits by %g", d);
    free(x);
    free(y);
    eng_seq_free(s);
    eng_ctx_free(c1);
    close_model(&f);
}

/* Long enough for several MLA key blocks (256 keys each) and several prefill
 * batches: the chunked prefill and the online-softmax attention must agree
 * with token-by-token decode at every position. */
Test(engine, long_prefill_matches_decode_hybrid, .timeout = 120) {
    fixture f = open_model(HYBRID);
    kds_err err = {0};
    enum { N = 700 };
    static int32_t ids[N];
    prompt(ids, N, f.vocab, 21);
    float *pre = malloc((size_t)N * f.vocab * sizeof(float));
    float *dec = malloc((size_t)N * f.vocab * sizeof(float));
    eng_ctx_params cp = eng_ctx_default_params();
    cp.max_batch = 96; /* batches straddle key-block boundaries */
    eng_ctx *c = NULL;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &c, &err), KDS_OK);
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 0, &s, &err), KDS_OK);
    cr_assert_eq(eng_prefill(c, s, ids, N, pre, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    eng_seq_reset(s, 0);
    for (int t = 0; t < N; t++) {
        cr_assert_eq(eng_decode(c, s, ids[t], &err), KDS_OK);
        memcpy(dec + (size_t)t * f.vocab, eng_seq_logits(s), (size_t)f.vocab * sizeof(float));
    }
    double ref, d = th_max_abs_diff(dec, pre, (size_t)N * f.vocab, &ref);
    fprintf(stderr, "engine long hybrid prefill vs decode (%d tokens): rel err %.3g\n", N, d / ref);
    cr_expect_leq(d, 1e-4 * ref, "prefill vs decode differ by %g of %g", d, ref);
    free(pre);
    free(dec);
    eng_seq_free(s);
    eng_ctx_free(c);
    close_model(&f);
}

/* Resident bytes of this process (/proc/self/statm). */
static size_t rss_bytes(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long size = 0, res = 0;
    if (f) {
        if (fscanf(f, "%lu %lu", &size, &res) != 2) res = 0;
        fclose(f);
    }
    return (size_t)res * (size_t)sysconf(_SC_PAGESIZE);
}

/* A fixed part claims the MLA rows that eng_seq_load_mla brings later;
 * until then they are zeros that cost no memory, so the position in a
 * header nobody checked cannot make the process touch gigabytes (the
 * fuzz target tests/fuzz/fuzz_state.c found the memset that did). */
Test(engine, fixed_part_claims_cost_no_memory) {
    fixture f = open_model(HYBRID);
    kds_err err = {0};
    int32_t ids[3];
    prompt(ids, 3, f.vocab, 5);
    eng_seq *s = NULL, *r = NULL;
    cr_assert_eq(eng_seq_create(f.m, 4, &s, &err), KDS_OK);
    cr_assert_eq(eng_prefill(f.c, s, ids, 3, NULL, NULL, NULL, &err), KDS_OK);
    const size_t fb = eng_seq_fixed_bytes(s), tb = eng_seq_mla_token_bytes(s);
    unsigned char *fixed = malloc(fb), *row = malloc(tb), *back = malloc(tb);
    cr_assert(fixed && row && back);
    cr_assert_eq(eng_seq_save_fixed(s, fixed, fb, &err), KDS_OK);
    const uint64_t claim = (uint64_t)1 << 20; /* 160 MiB of rows for micro-hybrid */
    for (int i = 0; i < 8; i++) fixed[16 + i] = (unsigned char)(claim >> (8 * i));
    cr_assert_eq(eng_seq_create(f.m, 0, &r, &err), KDS_OK);
    const size_t before = rss_bytes();
    cr_assert_eq(eng_seq_load_fixed(r, fixed, fb, &err), KDS_OK, "%s", err.msg);
    const size_t grew = rss_bytes() - before;
    cr_expect_lt(grew, claim * tb / 4, "claiming %llu rows of %zu bytes made %zu bytes resident",
                 (unsigned long long)claim, tb, grew);
    cr_assert_eq(eng_seq_pos(r), (int64_t)claim);
    cr_assert_eq(eng_seq_save_mla(r, (int64_t)claim - 1, (int64_t)claim, back, tb, &err), KDS_OK);
    for (size_t i = 0; i < tb; i++) cr_assert_eq(back[i], 0, "an unloaded row is not zero");
    for (size_t i = 0; i < tb; i++) row[i] = (unsigned char)(i * 7 + 1);
    cr_assert_eq(eng_seq_load_mla(r, (int64_t)claim - 1, (int64_t)claim, row, tb, &err), KDS_OK);
    cr_assert_eq(eng_seq_save_mla(r, (int64_t)claim - 1, (int64_t)claim, back, tb, &err), KDS_OK);
    cr_expect_eq(memcmp(row, back, tb), 0);
    free(fixed);
    free(row);
    free(back);
    eng_seq_free(s);
    eng_seq_free(r);
    close_model(&f);
}

/* A claim no machine of this size could hold is refused by name at load,
 * not left to fail at the first clone (which copies every claimed row). */
Test(engine, fixed_part_claim_beyond_memory_refused) {
    fixture f = open_model(HYBRID);
    kds_err err = {0};
    eng_seq *s = NULL, *r = NULL;
    cr_assert_eq(eng_seq_create(f.m, 4, &s, &err), KDS_OK);
    int32_t ids[3];
    prompt(ids, 3, f.vocab, 5);
    cr_assert_eq(eng_prefill(f.c, s, ids, 3, NULL, NULL, NULL, &err), KDS_OK);
    const size_t fb = eng_seq_fixed_bytes(s), tb = eng_seq_mla_token_bytes(s);
    unsigned char *fixed = malloc(fb);
    cr_assert(fixed);
    cr_assert_eq(eng_seq_save_fixed(s, fixed, fb, &err), KDS_OK);
    const uint64_t phys = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
    const uint64_t claim = phys / tb + 1;
    for (int i = 0; i < 8; i++) fixed[16 + i] = (unsigned char)(claim >> (8 * i));
    cr_assert_eq(eng_seq_create(f.m, 0, &r, &err), KDS_OK);
    cr_expect_eq(eng_seq_load_fixed(r, fixed, fb, &err), KDS_TOO_LARGE, "%s", err.msg);
    cr_expect(strstr(err.msg, "more than this machine's memory") != NULL, "%s", err.msg);
    cr_expect_eq(eng_seq_pos(r), 0, "a refused claim changed the sequence");
    /* a claim that fits still loads */
    for (int i = 0; i < 8; i++) fixed[16 + i] = (unsigned char)((claim / 64) >> (8 * i));
    cr_expect_eq(eng_seq_load_fixed(r, fixed, fb, &err), KDS_OK, "%s", err.msg);
    free(fixed);
    eng_seq_free(s);
    eng_seq_free(r);
    close_model(&f);
}

/* The split form (fixed part + token-major MLA row chunks) restores exactly
 * what the whole-state form does. */
Test(engine, split_state_roundtrip_hybrid) {
    fixture f = open_model(HYBRID);
    kds_err err = {0};
    int32_t ids[50];
    prompt(ids, 50, f.vocab, 13);
    eng_seq *s = NULL, *r = NULL;
    cr_assert_eq(eng_seq_create(f.m, 4, &s, &err), KDS_OK);
    cr_assert_eq(eng_prefill(f.c, s, ids, 30, NULL, NULL, NULL, &err), KDS_OK);
    size_t tb = eng_seq_mla_token_bytes(s), fb = eng_seq_fixed_bytes(s);
    cr_assert_gt(tb, 0);
    cr_assert_eq(fb + 30 * tb, eng_seq_state_bytes(s));
    unsigned char *chunk1 = malloc(30 * tb);
    cr_assert_eq(eng_seq_save_mla(s, 0, 30, chunk1, 30 * tb, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_prefill(f.c, s, ids + 30, 20, NULL, NULL, NULL, &err), KDS_OK);
    unsigned char *chunk2 = malloc(20 * tb), *fixed = malloc(fb);
    cr_assert_eq(eng_seq_save_mla(s, 30, 50, chunk2, 20 * tb, &err), KDS_OK);
    cr_assert_eq(eng_seq_save_fixed(s, fixed, fb, &err), KDS_OK);
    cr_expect_eq(eng_seq_save_mla(s, 40, 60, chunk2, 20 * tb, &err), KDS_INVALID_ARG);

    cr_assert_eq(eng_seq_create(f.m, 0, &r, &err), KDS_OK);
    cr_assert_eq(eng_seq_load_fixed(r, fixed, fb, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(eng_seq_load_mla(r, 0, 30, chunk1, 30 * tb - 1, &err), KDS_BAD_FORMAT);
    cr_assert_eq(eng_seq_load_mla(r, 0, 30, chunk1, 30 * tb, &err), KDS_OK);
    cr_assert_eq(eng_seq_load_mla(r, 30, 50, chunk2, 20 * tb, &err), KDS_OK);
    size_t n = eng_seq_state_bytes(s);
    unsigned char *a = malloc(n), *b = malloc(n);
    eng_seq_state_save(s, a, n, &err);
    eng_seq_state_save(r, b, n, &err);
    cr_expect_eq(memcmp(a, b, n), 0, "split restore differs from the original");
    /* the whole form is refused by the fixed loader and vice versa */
    cr_expect_eq(eng_seq_load_fixed(r, a, n, &err), KDS_BAD_FORMAT);
    cr_expect_eq(eng_seq_state_load(r, fixed, fb, &err), KDS_BAD_FORMAT);
    free(a);
    free(b);
    free(chunk1);
    free(chunk2);
    free(fixed);
    eng_seq_free(s);
    eng_seq_free(r);
    close_model(&f);
}
