/*
 * test_profile.c - a CPU context's product profile (eng_ctx_profile_start /
 * eng_ctx_profile_stop, `kdaserve bench --profile`): the products it counts
 * are those the pass runs, it changes no result, and misuse is refused
 * with a message.
 *
 * On micro-hybrid (../shared/golden/model: 4 layers, the first dense, then
 * MoE layers of 8 experts top-2, one MLA layer, f32 weights).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "eng.h"
#include "eng_config.h"
#include "test_model_util.h"
#include "kds_clock.h"

#define ROWS 64

typedef struct fixture {
    eng_model *m;
    eng_ctx *c;
    eng_seq *s;
} fixture;

static fixture open_micro(int threads) {
    fixture f = {0};
    kds_err err = {0};
    eng_model_params mp = eng_model_default_params();
    cr_assert_eq(eng_model_load(TMU_MICRO_HYBRID, &mp, &f.m, &err), KDS_OK, "%s", err.msg);
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = threads;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &f.c, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_seq_create(f.m, 0, &f.s, &err), KDS_OK, "%s", err.msg);
    return f;
}

static void close_micro(fixture *f) {
    eng_seq_free(f->s);
    eng_ctx_free(f->c);
    eng_model_free(f->m);
}

static const int32_t PROMPT[] = {5, 17, 42, 99, 7, 300, 12, 64, 250, 3, 77, 480};
#define N_PROMPT (int)(sizeof PROMPT / sizeof PROMPT[0])
#define N_DECODE 6

/* Prefill the prompt and decode N_DECODE greedy tokens from a fresh state;
 * the last logits into `logits` [vocab]. With `profile`, the prefill and
 * the decode are profiled apart into pre / dec. */
static void run_passes(fixture *f, bool profile, float *logits, eng_product_time *pre,
                       int *n_pre, eng_product_time *dec, int *n_dec, double *dec_wall) {
    kds_err err = {0};
    eng_seq_reset(f->s, 0);
    if (profile) cr_assert_eq(eng_ctx_profile_start(f->c, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_prefill(f->c, f->s, PROMPT, N_PROMPT, NULL, NULL, NULL, &err), KDS_OK, "%s",
                 err.msg);
    if (profile) {
        cr_assert_eq(eng_ctx_profile_stop(f->c, pre, ROWS, n_pre, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_ctx_profile_start(f->c, &err), KDS_OK, "%s", err.msg);
    }
    eng_sampler_params greedy = eng_sampler_default_params();
    greedy.temperature = 0.0f;
    const double t0 = kds_now_s();
    for (int i = 0; i < N_DECODE; i++) {
        int32_t next;
        cr_assert_eq(eng_sample(f->c, f->s, &greedy, &next, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_decode(f->c, f->s, next, &err), KDS_OK, "%s", err.msg);
    }
    const double t1 = kds_now_s();
    if (profile) {
        cr_assert_eq(eng_ctx_profile_stop(f->c, dec, ROWS, n_dec, &err), KDS_OK, "%s", err.msg);
        *dec_wall = t1 - t0;
    }
    const int vocab = eng_model_config(f->m)->vocab_size;
    const float *last = eng_seq_logits(f->s);
    cr_assert(last);
    memcpy(logits, last, (size_t)vocab * sizeof *logits);
}

static const eng_product_time *find_role(const eng_product_time *r, int n, const char *role) {
    for (int i = 0; i < n; i++)
        if (!strcmp(r[i].role, role)) return &r[i];
    return NULL;
}

/* The profile counts what the passes run and leaves their bits alone. */
Test(profile, counts_the_products_and_changes_no_bit) {
    fixture f = open_micro(2);
    const eng_config *cfg = eng_model_config(f.m);
    const int vocab = cfg->vocab_size;
    float *plain = malloc((size_t)vocab * sizeof *plain);
    float *timed = malloc((size_t)vocab * sizeof *timed);
    cr_assert(plain && timed);
    eng_product_time pre[ROWS], dec[ROWS];
    int n_pre = 0, n_dec = 0;
    double wall = 0.0;
    run_passes(&f, false, plain, NULL, NULL, NULL, NULL, NULL);
    run_passes(&f, true, timed, pre, &n_pre, dec, &n_dec, &wall);
    cr_expect_eq(memcmp(plain, timed, (size_t)vocab * sizeof *plain), 0,
                 "a profiled pass gives other logits");

    /* the prefill's logits are its last token's: one lm_head product of one row */
    const eng_product_time *head = find_role(pre, n_pre, "lm_head");
    cr_assert(head, "no lm_head row in the prefill's profile");
    cr_expect_eq(head->products, 1);
    cr_expect_eq(head->tokens, 1);
    /* the dense layer's products take the whole prompt at once */
    const eng_product_time *up = find_role(pre, n_pre, "mlp up_proj");
    cr_assert(up, "no dense up_proj row");
    cr_expect_eq(up->products, 1);
    cr_expect_eq(up->tokens, N_PROMPT);

    /* decode: one lm_head a token, top-k routed experts a MoE layer a token */
    int moe_layers = 0;
    for (int l = 0; l < cfg->num_hidden_layers; l++) moe_layers += cfg->layer_is_moe[l];
    head = find_role(dec, n_dec, "lm_head");
    cr_assert(head, "no lm_head row in the decode's profile");
    cr_expect_eq(head->products, N_DECODE);
    cr_expect_eq(head->rows, vocab);
    cr_expect_eq(head->cols, cfg->hidden_size);
    cr_expect_str_eq(head->dtype, "f32");
    cr_expect_eq(head->bytes, (double)N_DECODE * vocab * cfg->hidden_size * 4.0);
    for (int w = 0; w < 3; w++) {
        const char *role[3] = {"experts w1 (gate)", "experts w3 (up)", "experts w2 (down)"};
        const eng_product_time *e = find_role(dec, n_dec, role[w]);
        cr_assert(e, "no %s row", role[w]);
        cr_expect_eq(e->products, (int64_t)N_DECODE * moe_layers * cfg->num_experts_per_token,
                     "%s: %lld products", role[w], (long long)e->products);
        cr_expect_eq(e->tokens, e->products, "one token a routed product in a lone decode");
    }
    /* the time: something in every row, and no more than the threads had,
     * in order, most first */
    double busy = 0.0;
    for (int i = 0; i < n_dec; i++) {
        cr_expect(dec[i].busy_s >= 0.0, "%s: negative time", dec[i].role);
        cr_expect(i == 0 || dec[i - 1].busy_s >= dec[i].busy_s, "rows out of order at %d", i);
        busy += dec[i].busy_s;
    }
    cr_expect(busy > 0.0 && busy <= 2.0 * wall * 1.01 + 1e-4,
              "%.6f s busy in %.6f s of two threads", busy, wall);
    free(plain);
    free(timed);
    close_micro(&f);
}

/* A second start restarts; a stop ends the profile. */
Test(profile, start_restarts_and_stop_ends) {
    fixture f = open_micro(1);
    kds_err err = {0};
    eng_product_time r[ROWS];
    int n = -1;
    cr_assert_eq(eng_prefill(f.c, f.s, PROMPT, 4, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_ctx_profile_start(f.c, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_decode(f.c, f.s, 9, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_decode(f.c, f.s, 10, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_ctx_profile_start(f.c, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_decode(f.c, f.s, 11, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_ctx_profile_stop(f.c, r, ROWS, &n, &err), KDS_OK, "%s", err.msg);
    const eng_product_time *head = find_role(r, n, "lm_head");
    cr_assert(head);
    cr_expect_eq(head->products, 1, "the restart kept %lld lm_head products",
                 (long long)head->products);
    cr_expect_eq(eng_ctx_profile_stop(f.c, r, ROWS, &n, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "no product profile is running"), "%s", err.msg);
    cr_expect_eq(n, 0);
    close_micro(&f);
}

/* Too small an output: refused, saying how many rows it had room for, and
 * the profile is over. */
Test(profile, too_few_rows_is_refused) {
    fixture f = open_micro(1);
    kds_err err = {0};
    eng_product_time r[2];
    int n = -1;
    cr_assert_eq(eng_ctx_profile_start(f.c, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_prefill(f.c, f.s, PROMPT, N_PROMPT, NULL, NULL, NULL, &err), KDS_OK, "%s",
                 err.msg);
    cr_expect_eq(eng_ctx_profile_stop(f.c, r, 2, &n, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "more than 2 kinds of matrix"), "%s", err.msg);
    cr_expect_eq(n, 0);
    cr_expect_eq(eng_ctx_profile_stop(f.c, r, 2, &n, &err), KDS_INVALID_ARG);
    close_micro(&f);
}
