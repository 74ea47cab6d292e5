/*
 * test_sample_ref.c - kern_sample (kernels/cpu/sample.c), the CPU reference
 * of the GPU sampler, draws exactly what the engine's eng_sample draws: the
 * same tokens from the same xoshiro256** stream, over greedy, temperature,
 * top-k, top-p, min-p, repetition penalty and their mixes, on logits with
 * many ties. eng_sample now calls kern_sample itself, so what this checks
 * is the engine's side: the penalty window it passes (most recent first,
 * repeat_last_n of the ring) and the sequence's RNG advancing exactly once
 * per draw. (eng_sample reads the sequence's last logits; the test writes
 * its own logits into the sequence through the engine-internal eng_seq.h.)
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "eng.h"
#include "eng_seq.h"
#include "kern.h"
#include "test_helpers.h"

#define PURE GOLDEN_ROOT "/model/micro-kda"

static uint64_t mix(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The ids eng_sample penalises, most recent first (its own loop). */
static int recent_list(const eng_seq *s, int repeat_last_n, int32_t *out) {
    int n = s->n_recent < ENG_RECENT_TOKENS ? s->n_recent : ENG_RECENT_TOKENS;
    if (repeat_last_n < n) n = repeat_last_n > 0 ? repeat_last_n : 0;
    for (int i = 0; i < n; i++)
        out[i] = s->recent[((uint32_t)s->n_recent - 1 - (uint32_t)i) % ENG_RECENT_TOKENS];
    return n;
}

Test(sample_ref, kern_sample_draws_what_eng_sample_draws, .timeout = 60) {
    kds_err err = {0};
    eng_model_params mp = eng_model_default_params();
    mp.no_fingerprint_cache = true;
    eng_model *m = NULL;
    cr_assert_eq(eng_model_load(PURE, &mp, &m, &err), KDS_OK, "%s", err.msg);
    eng_ctx *c = NULL;
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cr_assert_eq(eng_ctx_create(m, &cp, &c, &err), KDS_OK, "%s", err.msg);
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(m, 1234, &s, &err), KDS_OK, "%s", err.msg);
    const int V = eng_model_config(m)->vocab_size;

    float *scratch_p = malloc((size_t)V * sizeof(float));
    int32_t *scratch_id = malloc((size_t)V * sizeof(int32_t));
    cr_assert(scratch_p && scratch_id);

    /* a recent-token ring with repeats (the penalty's dedup) */
    uint64_t rs = 99;
    for (int i = 0; i < 80; i++) eng__seq_push_recent(s, (int32_t)(mix(&rs) % 24));

    static const eng_sampler_params cases[] = {
        {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .repeat_penalty = 1.0f},
        {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .repeat_penalty = 1.5f, .repeat_last_n = 64},
        {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f, .repeat_penalty = 1.0f},
        {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .repeat_penalty = 1.0f},
        {.temperature = 1.3f, .top_k = 7, .top_p = 1.0f, .min_p = 0.0f, .repeat_penalty = 1.0f},
        {.temperature = 0.6f, .top_k = 0, .top_p = 0.5f, .min_p = 0.0f, .repeat_penalty = 1.0f},
        {.temperature = 0.9f, .top_k = 100, .top_p = 1.0f, .min_p = 0.2f, .repeat_penalty = 1.0f},
        {.temperature = 0.7f, .top_k = 20, .top_p = 0.9f, .min_p = 0.0f, .repeat_penalty = 1.2f,
         .repeat_last_n = 16},
        {.temperature = 2.0f, .top_k = 1, .top_p = 1.0f, .min_p = 0.0f, .repeat_penalty = 1.0f},
    };
    int draws = 0;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const eng_sampler_params *p = &cases[ci];
        const kern_sample_params kp = {.temperature = p->temperature, .top_k = p->top_k,
                                       .top_p = p->top_p, .min_p = p->min_p,
                                       .repeat_penalty = p->repeat_penalty};
        for (int round = 0; round < 40; round++) {
            /* logits on a grid of 1/8 (many exact ties), some rounds spiky */
            for (int i = 0; i < V; i++)
                s->logits[i] = (float)((int)(mix(&rs) % 97) - 48) / 8.0f * (round % 3 == 0 ? 3 : 1);
            s->has_logits = 1;
            int32_t pen[ENG_RECENT_TOKENS];
            int n_pen = recent_list(s, p->repeat_last_n, pen);
            uint64_t rng[4];
            memcpy(rng, s->rng, sizeof rng);
            int32_t want = -1;
            cr_assert_eq(eng_sample(c, s, p, &want, &err), KDS_OK, "%s", err.msg);
            int32_t got = kern_sample(s->logits, V, &kp, pen, n_pen, rng, scratch_p, scratch_id);
            cr_assert_eq(got, want, "case %zu round %d: kern_sample %d, eng_sample %d", ci, round,
                         got, want);
            cr_assert(memcmp(rng, s->rng, sizeof rng) == 0, "case %zu round %d: RNG streams differ",
                      ci, round);
            draws++;
        }
    }
    cr_assert_eq(draws, 9 * 40);
    free(scratch_p);
    free(scratch_id);
    eng_seq_free(s);
    eng_ctx_free(c);
    eng_model_free(m);
}

/* Stated properties: greedy takes the lowest id among equal maxima and does
 * not advance the RNG; a penalty applies once per distinct id. */
Test(sample_ref, greedy_ties_and_penalty_once) {
    float logits[6] = {1.0f, 3.0f, -2.0f, 3.0f, 2.9f, -1.0f};
    float sp_[6];
    int32_t si[6];
    uint64_t rng[4] = {1, 2, 3, 4}, rng0[4] = {1, 2, 3, 4};
    kern_sample_params p = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f,
                            .repeat_penalty = 1.0f};
    cr_assert_eq(kern_sample(logits, 6, &p, NULL, 0, rng, sp_, si), 1);
    cr_assert(memcmp(rng, rng0, sizeof rng) == 0, "greedy advanced the RNG");
    /* penalise 1 and 3 (3 listed twice): 3 / 1.1 = 2.727 < 2.9 -> token 4 */
    const int32_t pen[4] = {3, 1, 3, 99};
    p.repeat_penalty = 1.1f;
    cr_assert_eq(kern_sample(logits, 6, &p, pen, 4, rng, sp_, si), 4);
    /* top_k = 1 with a temperature: always the best, one RNG step */
    p.repeat_penalty = 1.0f;
    p.temperature = 1.0f;
    p.top_k = 1;
    cr_assert_eq(kern_sample(logits, 6, &p, NULL, 0, rng, sp_, si), 1);
    kern_rng_next(rng0);
    cr_assert(memcmp(rng, rng0, sizeof rng) == 0, "one draw must advance the RNG once");
}
