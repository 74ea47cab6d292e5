/*
 * eng_decode_batch (continuous batching): sequences decoded together in one
 * forward pass end as the same sequences decoded one at a time with
 * eng_decode, bit for bit (logits, greedy tokens, saved state), whatever
 * subset and order of sequences makes up each step and however many threads
 * run it; a batch of one is eng_decode exactly; bad batches are refused with
 * a clear message and leave every sequence as it was. Models are the
 * generated "tiny" (pure KDA), "tiny-hybrid" (one MLA layer) and, for the
 * thread counts, "k3-micro" (Kimi K3's layout, MXFP4 experts) presets.
 */
#include <criterion/criterion.h>
#include <math.h>

#include "cpu/kern_gemm.h"
#include "eng.h"
#include "eng_config.h"
#include "eng_safetensors.h"
#include "kern.h"
#include "test_helpers.h"
#include "test_model_util.h"
#include "test_sess_util.h"

/* Up to how many rows a decode step's products stay on the direct path,
 * where a token's row is its lone product bit for bit (kernels/kern.h), in
 * every build (AVX-512, AVX2 and the generic loops); from 64 they run as a
 * GEMM, which adds in another order: there logits agree up to LOGIT_TOL of
 * the largest, the saved states' floats up to STATE_TOL. */
#define EXACT_ROWS 63
#define LOGIT_TOL 1e-5
#define STATE_TOL 2e-5

typedef struct fixture {
    char *dir;
    eng_model *m;
    eng_ctx *c;
    int vocab;
} fixture;

/* hidden, dense_inner: the preset's hidden_size and dense intermediate_size
 * replaced (0: its own) */
static fixture open_sized(const char *preset, int hidden, int dense_inner, int n_threads,
                          int max_batch, int max_seqs) {
    fixture f = {0};
    kds_err err = {0};
    f.m = tmu_gen_load_sized(preset, hidden, dense_inner, 11, &f.dir, &err);
    cr_assert(f.m, "%s", err.msg);
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = n_threads;
    cp.max_batch = max_batch;
    cp.max_seqs = max_seqs;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &f.c, &err), KDS_OK, "%s", err.msg);
    f.vocab = eng_model_config(f.m)->vocab_size;
    return f;
}

static fixture open_hidden(const char *preset, int hidden, int n_threads, int max_batch,
                           int max_seqs) {
    return open_sized(preset, hidden, 0, n_threads, max_batch, max_seqs);
}

static fixture open_preset(const char *preset, int n_threads, int max_batch, int max_seqs) {
    return open_hidden(preset, 0, n_threads, max_batch, max_seqs);
}

static void close_fixture(fixture *f) {
    eng_ctx_free(f->c);
    eng_model_free(f->m);
    tmu_rmtree(f->dir);
    free(f->dir);
}

static void prompt(int32_t *ids, int n, int vocab, uint32_t seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        ids[i] = (int32_t)((seed >> 8) % (uint32_t)vocab);
    }
}

/* n_seqs sequences with prompts of different lengths (1 .. 50 tokens). */
static void make_seqs(fixture *f, eng_seq **seqs, int n_seqs) {
    kds_err err = {0};
    int32_t ids[64];
    for (int i = 0; i < n_seqs; i++) {
        int len = 1 + (i * 17 + 5) % 50;
        prompt(ids, len, f->vocab, 100u + (uint32_t)i);
        cr_assert_eq(eng_seq_create(f->m, (uint64_t)i, &seqs[i], &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_prefill(f->c, seqs[i], ids, len, NULL, NULL, NULL, &err), KDS_OK, "%s",
                     err.msg);
    }
}

static int argmax(const float *x, int n, float *margin) {
    int best = 0, second = -1;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) {
            second = best;
            best = i;
        } else if (second < 0 || x[i] > x[second]) {
            second = i;
        }
    *margin = x[best] - x[second];
    return best;
}

static void *save(const eng_seq *s, size_t *n) {
    kds_err err = {0};
    *n = eng_seq_state_bytes(s);
    void *buf = malloc(*n);
    cr_assert(buf);
    cr_assert_eq(eng_seq_state_save(s, buf, *n, &err), KDS_OK, "%s", err.msg);
    return buf;
}

/* Saved states of a (batched) and b (one at a time): the same bytes, or,
 * when the batch left the direct path (!exact), the same header and recent
 * tokens and floats (KDA states, conv tails, logits; MLA rows) within
 * STATE_TOL of their largest magnitude. */
static void expect_states_match(const fixture *f, const eng_seq *a, const eng_seq *b, int which,
                                bool exact) {
    size_t na, nb;
    unsigned char *sa = save(a, &na), *sb = save(b, &nb);
    cr_assert_eq(na, nb, "sequence %d: state sizes %zu and %zu", which, na, nb);
    if (exact) {
        size_t first = 0;
        while (first < na && sa[first] == sb[first]) first++;
        cr_expect_eq(first, na, "sequence %d: saved states differ from byte %zu of %zu", which,
                     first, na);
        free(sa);
        free(sb);
        return;
    }
    eng_state_size z = eng_config_state_size(eng_model_config(f->m));
    const size_t head = 128, recent = 64 * sizeof(int32_t);
    cr_assert_eq(memcmp(sa, sb, head), 0, "sequence %d: state headers differ (position, RNG, ...)",
                 which);
    cr_assert_eq(memcmp(sa + z.fixed - recent, sb + z.fixed - recent, recent), 0,
                 "sequence %d: recent tokens differ", which);
    struct {
        size_t off, n;
        const char *what;
    } sec[2] = {{head, (z.fixed - head - recent) / 4, "KDA states, conv tails and logits"},
                {z.fixed, (na - z.fixed) / 4, "MLA rows"}};
    for (int i = 0; i < 2; i++) {
        if (sec[i].n == 0) continue;
        float *fa = malloc(sec[i].n * sizeof(float)), *fb = malloc(sec[i].n * sizeof(float));
        memcpy(fa, sa + sec[i].off, sec[i].n * sizeof(float));
        memcpy(fb, sb + sec[i].off, sec[i].n * sizeof(float));
        double ref, diff = th_max_abs_diff(fa, fb, sec[i].n, &ref);
        cr_expect_leq(diff, STATE_TOL * (ref > 1.0 ? ref : 1.0),
                      "sequence %d: %s differ by %g (largest %g)", which, sec[i].what, diff, ref);
        free(fa);
        free(fb);
    }
    free(sa);
    free(sb);
}

/*
 * n_seqs prefilled sequences, each cloned; `steps` steps in which a rotating
 * subset of the clones (in a shuffled order) goes through one
 * eng_decode_batch while the originals take eng_decode one at a time, fed
 * the same greedy tokens. Every step: the same logits, bit for bit, and at
 * the end the same saved states, while a step's rows stay on the direct
 * path (EXACT_ROWS); beyond it, logits close and greedy picks equal where
 * the best two logits are further apart than that rounding.
 */
static void batch_matches_sized(const char *preset, int hidden, int dense_inner, int n_seqs,
                                int n_threads, int steps) {
    fixture f = open_sized(preset, hidden, dense_inner, n_threads, 16, n_seqs);
    kds_err err = {0};
    eng_seq *ref[64], *bat[64], *in[64];
    int32_t ids[64];
    cr_assert_leq(n_seqs, 64);
    make_seqs(&f, ref, n_seqs);
    for (int i = 0; i < n_seqs; i++)
        cr_assert_eq(eng_seq_clone(ref[i], &bat[i], &err), KDS_OK, "%s", err.msg);
    int64_t pos0[64];
    for (int i = 0; i < n_seqs; i++)
        pos0[i] = eng_seq_pos(ref[i]);
    int64_t fed[64] = {0};
    const bool exact = n_seqs <= EXACT_ROWS;
    for (int step = 0; step < steps; step++) {
        /* Every fourth sequence sits this step out (a different one each
         * step), and the batch order is a rotation of the creation order. */
        int n = 0;
        for (int j = 0; j < n_seqs; j++) {
            int i = (j + step * 3) % n_seqs;
            if ((i + step) % 4 == 3 && n_seqs > 1) continue;
            float margin, margin_b;
            int tr = argmax(eng_seq_logits(ref[i]), f.vocab, &margin);
            int tb = argmax(eng_seq_logits(bat[i]), f.vocab, &margin_b);
            if (exact || margin > 1e-3f)
                cr_assert_eq(tb, tr, "step %d, sequence %d: batched picks %d, one at a time %d",
                             step, i, tb, tr);
            cr_assert_eq(eng_decode(f.c, ref[i], tr, &err), KDS_OK, "%s", err.msg);
            in[n] = bat[i];
            ids[n++] = tr;
            fed[i]++;
        }
        cr_assert_eq(eng_decode_batch(f.c, in, ids, n, &err), KDS_OK, "%s", err.msg);
        for (int i = 0; i < n_seqs; i++) {
            cr_assert_eq(eng_seq_pos(bat[i]), pos0[i] + fed[i]);
            cr_assert_eq(eng_seq_pos(ref[i]), pos0[i] + fed[i]);
            double mx, d = th_max_abs_diff(eng_seq_logits(bat[i]), eng_seq_logits(ref[i]),
                                           (size_t)f.vocab, &mx);
            if (exact)
                cr_assert(memcmp(eng_seq_logits(bat[i]), eng_seq_logits(ref[i]),
                                 (size_t)f.vocab * sizeof(float)) == 0,
                          "step %d, sequence %d: logits differ by up to %g (largest %g)", step, i,
                          d, mx);
            else
                cr_assert_leq(d, LOGIT_TOL * mx,
                              "step %d, sequence %d: logits differ by %g (largest %g)", step, i, d,
                              mx);
        }
    }
    for (int i = 0; i < n_seqs; i++) {
        cr_assert_gt(fed[i], 0);
        expect_states_match(&f, bat[i], ref[i], i, exact);
        eng_seq_free(ref[i]);
        eng_seq_free(bat[i]);
    }
    close_fixture(&f);
}

static void batch_matches_hidden(const char *preset, int hidden, int n_seqs, int n_threads,
                                 int steps) {
    batch_matches_sized(preset, hidden, 0, n_seqs, n_threads, steps);
}

static void batch_matches_one_at_a_time(const char *preset, int n_seqs, int n_threads, int steps) {
    batch_matches_hidden(preset, 0, n_seqs, n_threads, steps);
}

Test(decode_batch, matches_one_at_a_time_tiny, .timeout = 120) {
    batch_matches_one_at_a_time("tiny", 5, 0, 12);
}
Test(decode_batch, matches_one_at_a_time_tiny_hybrid, .timeout = 120) {
    batch_matches_one_at_a_time("tiny-hybrid", 5, 0, 12);
}
/* 48 sequences, 36 rows a step: the products' column blocks, the per-row
 * conv split into parts, and MLA heads cut into groups of rows. */
Test(decode_batch, matches_one_at_a_time_many_seqs_tiny, .timeout = 120) {
    batch_matches_one_at_a_time("tiny", 48, 3, 5);
}
Test(decode_batch, matches_one_at_a_time_many_seqs_tiny_hybrid, .timeout = 120) {
    batch_matches_one_at_a_time("tiny-hybrid", 48, 3, 5);
}
Test(decode_batch, matches_one_at_a_time_single_thread, .timeout = 120) {
    batch_matches_one_at_a_time("tiny-hybrid", 9, 1, 4);
}
/* The context's FFN buffers hold a dense layer's rows or the MoE's routed
 * and shared rows, whichever is larger (eng_forward.c, alloc_activations):
 * here the dense layer (64 wide) is the narrower, so full prefill steps of
 * 16 tokens and batched steps of up to 24 rows run on the MoE's side of
 * that size (2 x 128 routed + 128 shared a token); under the sanitizers
 * a buffer one row short is an error, and every sequence keeps its lone
 * decode's bits. */
Test(decode_batch, moe_rows_wider_than_the_dense_layer, .timeout = 120) {
    batch_matches_sized("tiny-hybrid", 0, 64, 24, 0, 5);
}

/* Rows of 2048 columns: where the CPU has AMX tiles, the dense products
 * (lm_head, shared and dense MLPs, router) take them (kern_weight's
 * exact_tiles) while the routed experts keep the FMA loops, and a batched
 * step still gives each sequence its lone decode's bits. */
Test(decode_batch, matches_one_at_a_time_wide_rows, .timeout = 120) {
    if (!kern_bf16_tiles()) cr_log_info("no AMX tiles here: every product takes the FMA loops");
    batch_matches_hidden("tiny-hybrid", 2048, 9, 0, 4);
}

/* Four sequences prefilled (1 to 50 tokens: passes on the direct path and
 * on the GEMM) and decoded together for four greedy steps, on a context of
 * n_threads threads, and a long prompt prefilled alone: the final saved
 * states, concatenated. */
static unsigned char *run_on_threads(eng_model *m, int n_threads, size_t *len) {
    kds_err err = {0};
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = n_threads;
    cp.max_seqs = 4;
    fixture f = {.m = m, .vocab = eng_model_config(m)->vocab_size};
    cr_assert_eq(eng_ctx_create(m, &cp, &f.c, &err), KDS_OK, "%s", err.msg);
    eng_seq *seqs[4];
    int32_t ids[4];
    make_seqs(&f, seqs, 4);
    for (int step = 0; step < 4; step++) {
        float margin;
        for (int i = 0; i < 4; i++)
            ids[i] = argmax(eng_seq_logits(seqs[i]), f.vocab, &margin);
        cr_assert_eq(eng_decode_batch(f.c, seqs, ids, 4, &err), KDS_OK, "%s", err.msg);
    }
    /* and a long prompt: a prefill's element-wise ops go out on the pool
     * from 65,536 values (eng_cpu.c), which the prompts above never reach */
    enum { LONG_PROMPT = 700 };
    int32_t *long_ids = malloc(LONG_PROMPT * sizeof *long_ids);
    cr_assert(long_ids);
    prompt(long_ids, LONG_PROMPT, f.vocab, 777u);
    eng_seq *lone = NULL;
    cr_assert_eq(eng_seq_create(m, 9, &lone, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_prefill(f.c, lone, long_ids, LONG_PROMPT, NULL, NULL, NULL, &err), KDS_OK,
                 "%s", err.msg);
    free(long_ids);
    size_t total = 0, n[5];
    void *st[5];
    for (int i = 0; i < 5; i++) {
        st[i] = save(i < 4 ? seqs[i] : lone, &n[i]);
        total += n[i];
    }
    unsigned char *all = malloc(total);
    cr_assert(all);
    for (int i = 0, at = 0; i < 5; at += (int)n[i], i++) {
        memcpy(all + at, st[i], n[i]);
        free(st[i]);
        eng_seq_free(i < 4 ? seqs[i] : lone);
    }
    eng_ctx_free(f.c);
    *len = total;
    return all;
}

/* The thread count changes no bit: every product is cut among the threads
 * on eight-row boundaries (32 for block formats), and a row's sums do not
 * depend on the rows beside it (the kernels' own tests), and a long
 * prefill's element-wise ops are cut on whole rows or 64 values, so
 * prefill, decode and batched decode on 2 and 3 threads give the states
 * (logits included) of 1. k3-micro: Kimi K3's layout with MXFP4 routed
 * experts. */
Test(decode_batch, same_bits_on_any_thread_count, .timeout = 120) {
#if !KERN_GEMM_SIMD
    /* decode and batched decode keep their bits there too (the tests
     * above), but without the GEMM (AVX-512 or AVX2) a prefill's products
     * go to BLAS from 8 tokens, and its sums depend on where the rows are
     * cut */
    cr_skip_test("built without AVX-512 or AVX2: a prefill's products are BLAS's, whose sums "
                 "depend on the thread cut");
#endif
    const char *presets[] = {"tiny", "tiny-hybrid", "k3-micro"};
    for (int p = 0; p < 3; p++) {
        kds_err err = {0};
        char *dir;
        eng_model *m = tmu_gen_load(presets[p], 11, &dir, &err);
        cr_assert(m, "%s", err.msg);
        size_t n1;
        unsigned char *one = run_on_threads(m, 1, &n1);
        for (int th = 2; th <= 3; th++) {
            size_t n;
            unsigned char *more = run_on_threads(m, th, &n);
            cr_assert_eq(n, n1);
            size_t first = 0;
            while (first < n && more[first] == one[first]) first++;
            cr_expect_eq(first, n, "%s: %d threads differ from 1 from byte %zu of %zu",
                         presets[p], th, first, n);
            free(more);
        }
        free(one);
        eng_model_free(m);
        tmu_rmtree(dir);
        free(dir);
    }
}

/* A batch of one takes eng_decode's path: bit-identical. */
Test(decode_batch, batch_of_one_is_decode, .timeout = 120) {
    const char *presets[] = {"tiny", "tiny-hybrid"};
    for (int p = 0; p < 2; p++) {
        fixture f = open_preset(presets[p], 0, 16, 4);
        kds_err err = {0};
        eng_seq *a, *b;
        make_seqs(&f, &a, 1);
        cr_assert_eq(eng_seq_clone(a, &b, &err), KDS_OK);
        for (int step = 0; step < 5; step++) {
            int32_t id = (int32_t)((step * 37 + 3) % f.vocab);
            cr_assert_eq(eng_decode(f.c, a, id, &err), KDS_OK, "%s", err.msg);
            cr_assert_eq(eng_decode_batch(f.c, &b, &id, 1, &err), KDS_OK, "%s", err.msg);
        }
        size_t na, nb;
        void *sa = save(a, &na), *sb = save(b, &nb);
        cr_assert_eq(na, nb);
        cr_assert_eq(memcmp(sa, sb, na), 0, "%s: batch of one differs from eng_decode", presets[p]);
        free(sa);
        free(sb);
        eng_seq_free(a);
        eng_seq_free(b);
        close_fixture(&f);
    }
}

Test(decode_batch, default_max_seqs) {
    fixture f = open_preset("tiny", 1, 0, 0);
    cr_expect_eq(eng_ctx_max_seqs(f.c), 64);
    close_fixture(&f);
    f = open_preset("tiny", 1, 4, 9);
    cr_expect_eq(eng_ctx_max_seqs(f.c), 9);
    close_fixture(&f);
}

/* Every refusal names the problem and leaves all sequences byte-identical. */
Test(decode_batch, refusals_change_nothing, .timeout = 120) {
    fixture f = open_preset("tiny-hybrid", 0, 16, 4);
    fixture g = open_preset("tiny", 1, 16, 4);
    kds_err err = {0};
    eng_seq *s[5], *other;
    make_seqs(&f, s, 5);
    make_seqs(&g, &other, 1);
    void *before[5];
    size_t len[5];
    for (int i = 0; i < 5; i++)
        before[i] = save(s[i], &len[i]);
    int32_t ids[5] = {1, 2, 3, 4, 5};

    struct {
        eng_seq *seqs[5];
        int32_t ids[5];
        int n;
        const char *says;
    } bad[] = {
        {{s[0], s[1], s[2], s[3], s[4]}, {1, 2, 3, 4, 5}, 5, "max_seqs"}, /* 5 > 4 */
        {{s[0], s[1]}, {1, 2}, -1, "max_seqs"},
        {{s[0], s[1], s[0]}, {1, 2, 3}, 3, "same as sequence 0"},
        {{s[0], s[1], s[2]}, {1, -1, 3}, 3, "token id -1"},
        {{s[0], s[1], s[2]}, {1, 2, f.vocab}, 3, "outside the vocabulary"},
        {{s[0], other, s[2]}, {1, 2, 3}, 3, "different models"},
        {{s[0], NULL, s[2]}, {1, 2, 3}, 3, "NULL"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        err.msg[0] = '\0';
        cr_expect_eq(eng_decode_batch(f.c, bad[k].seqs, bad[k].ids, bad[k].n, &err),
                     KDS_INVALID_ARG, "case %zu accepted", k);
        cr_expect(strstr(err.msg, bad[k].says), "case %zu: message '%s' lacks '%s'", k, err.msg,
                  bad[k].says);
        cr_expect(!strchr(err.msg, '\n'), "case %zu: message is not one line", k);
    }
    cr_expect_eq(eng_decode_batch(f.c, s, ids, 0, &err), KDS_OK, "an empty batch is refused");
    /* a release (the server's hand-over to its saver) checks the model and,
     * on a CPU context, moves nothing: the bytes compared below stay */
    cr_expect_eq(eng_ctx_release(f.c, other, &err), KDS_INVALID_ARG, "another model's sequence released");
    cr_expect(strstr(err.msg, "different models"), "release: '%s'", err.msg);
    cr_expect_eq(eng_ctx_release(f.c, s[0], &err), KDS_OK, "%s", err.msg);
    for (int i = 0; i < 5; i++) {
        size_t n;
        void *after = save(s[i], &n);
        cr_expect_eq(n, len[i]);
        cr_expect(n == len[i] && memcmp(before[i], after, n) == 0,
                  "sequence %d changed by a refused batch", i);
        free(after);
        free(before[i]);
        eng_seq_free(s[i]);
    }
    /* and the context still works afterwards */
    eng_seq *ok[2];
    make_seqs(&f, ok, 2);
    cr_expect_eq(eng_decode_batch(f.c, ok, ids, 2, &err), KDS_OK, "%s", err.msg);
    eng_seq_free(ok[0]);
    eng_seq_free(ok[1]);
    eng_seq_free(other);
    close_fixture(&g);
    close_fixture(&f);
}

/* eng_sample_batch: each sequence with its own settings gives what
 * eng_sample of that sequence with those settings gives (tokens and the
 * RNG, so the saved state), over several decode steps; refusals name the
 * problem and move no RNG. */
Test(decode_batch, sample_batch_each_its_own_settings, .timeout = 120) {
    fixture f = open_preset("tiny", 1, 16, 4);
    kds_err err = {0};
    eng_seq *a[4], *b[4];
    make_seqs(&f, a, 4);
    make_seqs(&f, b, 4);
    eng_sampler_params sp[4] = {eng_sampler_default_params(), eng_sampler_default_params(),
                                eng_sampler_default_params(), eng_sampler_default_params()};
    sp[0].temperature = 0.0f;
    sp[1].repeat_penalty = 1.3f;
    sp[2].temperature = 1.4f;
    sp[2].top_k = 0;
    sp[2].top_p = 0.8f;
    sp[3].temperature = 0.5f;
    sp[3].min_p = 0.2f;
    int32_t ta[4], tb[4];
    for (int step = 0; step < 5; step++) {
        cr_assert_eq(eng_sample_batch(f.c, a, 4, sp, ta, &err), KDS_OK, "%s", err.msg);
        for (int i = 0; i < 4; i++) {
            cr_assert_eq(eng_sample(f.c, b[i], &sp[i], &tb[i], &err), KDS_OK, "%s", err.msg);
            cr_expect_eq(ta[i], tb[i], "step %d sequence %d: batch %d, alone %d", step, i, ta[i], tb[i]);
        }
        cr_assert_eq(eng_decode_batch(f.c, a, ta, 4, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_decode_batch(f.c, b, tb, 4, &err), KDS_OK, "%s", err.msg);
    }
    for (int i = 0; i < 4; i++) {
        size_t na, nb;
        void *xa = save(a[i], &na), *xb = save(b[i], &nb);
        cr_expect(na == nb && memcmp(xa, xb, na) == 0, "sequence %d: state bytes differ", i);
        free(xa);
        free(xb);
    }
    /* refusals */
    eng_seq *empty;
    cr_assert_eq(eng_seq_create(f.m, 5, &empty, &err), KDS_OK, "%s", err.msg);
    size_t n0;
    void *before = save(a[1], &n0);
    struct {
        eng_seq *seqs[5];
        int n;
        const char *says;
    } bad[] = {
        {{a[0], a[1], a[2], a[3], b[0]}, 5, "max_seqs"},
        {{a[0], a[1]}, -1, "max_seqs"},
        {{a[1], a[2], a[1]}, 3, "same as sequence 0"},
        {{a[1], empty}, 2, "empty"},
        {{a[1], NULL}, 2, "NULL"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        err.msg[0] = '\0';
        cr_expect_eq(eng_sample_batch(f.c, bad[k].seqs, bad[k].n, sp, ta, &err), KDS_INVALID_ARG,
                     "case %zu accepted", k);
        cr_expect(strstr(err.msg, bad[k].says), "case %zu: '%s' lacks '%s'", k, err.msg, bad[k].says);
    }
    size_t n1;
    void *after = save(a[1], &n1);
    cr_expect(n0 == n1 && memcmp(before, after, n0) == 0, "a refused sample moved an RNG");
    cr_expect_eq(eng_sample_batch(f.c, a, 0, sp, ta, &err), KDS_OK, "an empty batch is refused");
    free(before);
    free(after);
    eng_seq_free(empty);
    for (int i = 0; i < 4; i++) {
        eng_seq_free(a[i]);
        eng_seq_free(b[i]);
    }
    close_fixture(&f);
}

/* `kdaserve bench --seqs` runs both ways for each count and refuses bad
 * counts with one line. */
Test(decode_batch, bench_seqs_cli, .timeout = 120) {
    fixture f = open_preset("tiny-hybrid", 1, 16, 4);
    char out[8192];
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " bench --model %s --threads 1 --repeats 1 --prompt-tokens 5 "
                                      "--gen-tokens 3 --seqs 1,3,70 2>&1",
                         f.dir),
                 0, "%s", out);
    const char *want[] = {"N=1 ", "N=3 ", "N=70 "}; /* 70 > the default 64: a bigger context */
    for (int i = 0; i < 3; i++) {
        const char *line = strstr(out, want[i]);
        cr_assert(line, "no '%s' line in:\n%s", want[i], out);
        double a = 0, b = 0;
        cr_assert_eq(sscanf(strstr(line, "together") + 8, "%lf", &a), 1);
        cr_assert_eq(sscanf(strstr(line, "another") + 7, "%lf", &b), 1);
        cr_expect(a > 0 && b > 0, "line: %.80s", line);
    }
    const char *bad[] = {"--seqs 0", "--seqs 2,,3", "--seqs 5000", "--seqs 2 --gen-tokens 0"};
    for (int i = 0; i < 4; i++) {
        size_t n = 0;
        int rc = tsu_run(out, sizeof out, &n, TSU_KDASERVE " bench --model %s %s 2>&1", f.dir,
                         bad[i]);
        cr_expect(rc != 0, "'%s' accepted", bad[i]);
        cr_expect(strstr(out, "--seqs") && strchr(out, '\n') == out + n - 1,
                  "'%s': not one line naming --seqs: %s", bad[i], out);
    }
    close_fixture(&f);
}

/* The fixture's model file, read by the safetensors reader alone (close
 * with eng_st_close): what the counts below are checked against. */
static eng_st_file *open_model_file(const fixture *f) {
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", f->dir);
    eng_st_file *st = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_st_open(path, &st, &err), KDS_OK, "%s", err.msg);
    return st;
}

/* A matrix: a 2-D tensor of more than one row and column. */
static bool is_matrix(const eng_st_tensor *t) {
    return t->n_dims == 2 && t->shape[0] >= 2 && t->shape[1] >= 2;
}

/* What a decoded token reads (eng_model_decode_bytes), counted here from
 * the model file itself: every matrix (2-D tensor of more than one row and
 * column), one embedding row, top-k of E of the routed experts; the state:
 * KDA states and conv tails twice (read, written), MLA rows of pos tokens. */
Test(decode_batch, decode_bytes_from_the_file) {
    fixture f = open_preset("tiny-hybrid", 1, 16, 4);
    const eng_config *cfg = eng_model_config(f.m);
    eng_st_file *st = open_model_file(&f);
    double want = 0.0, experts = 0.0;
    for (size_t i = 0; i < eng_st_count(st); i++) {
        const eng_st_tensor *t = eng_st_at(st, i);
        if (!is_matrix(t)) continue;
        if (strstr(t->name, "embed_tokens")) {
            want += (double)t->n_bytes / (double)t->shape[0];
            continue;
        }
        if (strstr(t->name, ".experts.")) experts += (double)t->n_bytes;
        else want += (double)t->n_bytes;
    }
    cr_assert(experts > 0, "tiny-hybrid has routed experts");
    want += experts * cfg->num_experts_per_token / cfg->num_experts;
    eng_st_close(st);
    const eng_state_size z = eng_config_state_size(cfg);
    for (int64_t pos = 0; pos <= 100; pos += 100) {
        const eng_decode_bytes b = eng_model_decode_bytes(f.m, pos);
        cr_expect(fabs(b.weights - want) < 1e-6 * want, "weights %.1f, the file says %.1f",
                  b.weights, want);
        const double state = 2.0 * (double)(z.kda_state + z.conv_state) + (double)z.per_token * pos;
        cr_expect(fabs(b.state - state) < 0.5, "state %.1f, want %.1f", b.state, state);
    }
    cr_expect(z.per_token > 0, "tiny-hybrid has an MLA layer");
    close_fixture(&f);
}

/* A prefill's multiply-adds (eng_model_prefill_madds), counted here from
 * the model file itself: rows x columns of every matrix (2-D tensor of
 * more than one row and column) for each token, of the routed experts
 * top-k of E, none of the embedding table, the lm_head once (or, tied,
 * the embedding table once). */
Test(decode_batch, prefill_madds_from_the_file) {
    const char *presets[] = {"tiny-hybrid", "tiny"};
    for (size_t p = 0; p < sizeof presets / sizeof presets[0]; p++) {
        fixture f = open_preset(presets[p], 1, 16, 4);
        const eng_config *cfg = eng_model_config(f.m);
        eng_st_file *st = open_model_file(&f);
        double per_token = 0.0, experts = 0.0, embed = 0.0, head = 0.0;
        for (size_t i = 0; i < eng_st_count(st); i++) {
            const eng_st_tensor *t = eng_st_at(st, i);
            if (!is_matrix(t)) continue;
            const double madds = (double)t->shape[0] * (double)t->shape[1];
            if (strstr(t->name, "embed_tokens")) embed = madds;
            else if (strstr(t->name, "lm_head")) head = madds;
            else if (strstr(t->name, ".experts.")) experts += madds;
            else per_token += madds;
        }
        eng_st_close(st);
        cr_assert(experts > 0 && embed > 0, "%s has routed experts and an embedding", presets[p]);
        per_token += experts * cfg->num_experts_per_token / cfg->num_experts;
        const double once = head > 0 ? head : embed; /* tied: the embedding is the lm_head */
        for (int64_t tokens = 1; tokens <= 512; tokens *= 8) {
            const double want = per_token * (double)tokens + once;
            const double got = eng_model_prefill_madds(f.m, tokens);
            cr_expect(fabs(got - want) < 1e-9 * want, "%s, %lld tokens: %.0f, the file says %.0f",
                      presets[p], (long long)tokens, got, want);
        }
        close_fixture(&f);
    }
}

/* The multiply-add peak: a positive figure where the build has the loop,
 * KDS_UNSUPPORTED where it does not, and arguments checked. */
Test(decode_batch, madd_peak_measures_or_says_why_not) {
    kds_err err = {0};
    double g = -1.0;
    cr_expect_eq(eng_madd_peak(0, false, 1, &g, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "threads"), "%s", err.msg);
    cr_expect_eq(eng_madd_peak(1, false, 0, &g, &err), KDS_INVALID_ARG);
    cr_expect_eq(eng_madd_peak(1, false, 1, NULL, &err), KDS_INVALID_ARG);
    for (int bf16 = 0; bf16 <= 1; bf16++) {
        err = (kds_err){0};
        g = -1.0;
        const kds_status rc = eng_madd_peak(2, bf16, 1, &g, &err);
        if (kern_madd_per_round(bf16) == 0) {
            cr_expect_eq(rc, KDS_UNSUPPORTED, "bf16 %d: %s", bf16, err.msg);
            cr_expect(g == 0.0 && strstr(err.msg, "this build has no"), "%s", err.msg);
        } else {
            cr_expect_eq(rc, KDS_OK, "bf16 %d: %s", bf16, err.msg);
            cr_expect(g > 1.0 && g < 1e6, "bf16 %d: %.1f GFLOP/s", bf16, g);
        }
    }
    cr_expect(eng_cpu_bf16_products() == (kern_madd_per_round(true) > 0),
              "the bf16 peak's loop is there exactly where the bf16 products are");
}

/* bench prints that figure against a streaming read measured in the run. */
Test(decode_batch, bench_prints_bandwidth, .timeout = 120) {
    fixture f = open_preset("tiny", 1, 16, 4);
    char out[8192];
    const char *args = "--threads 1 --repeats 1 --prompt-tokens 5 --gen-tokens 3";
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " bench --model %s %s --bandwidth-mib 64 2>&1", f.dir, args),
                 0, "%s", out);
    const char *line = strstr(out, "a decoded token reads ");
    cr_assert(line, "no memory line in:\n%s", out);
    double mb = 0, w = 0, st = 0, gbs = 0, bw = 0;
    cr_assert_eq(sscanf(line, "a decoded token reads %lf MB (weights %lf, state %lf): %lf GB/s",
                        &mb, &w, &st, &gbs), 4, "%s", line);
    cr_expect(mb > 0 && fabs(mb - w - st) < 0.11 && gbs > 0, "%.120s", line);
    line = strstr(out, "streaming read of 64 MiB on 1 threads, this run: ");
    cr_assert(line, "no bandwidth line in:\n%s", out);
    cr_assert_eq(sscanf(line, "streaming read of 64 MiB on 1 threads, this run: %lf", &bw), 1);
    cr_expect(bw > 0.1, "%.120s", line);
    /* and the prefill against the multiply-add peak */
    line = strstr(out, "arithmetic   a prefill token multiply-adds ");
    cr_assert(line, "no arithmetic line in:\n%s", out);
    double mm = 0, gflops = 0, peak = 0;
    cr_assert_eq(sscanf(line, "arithmetic   a prefill token multiply-adds %lf M in products (the "
                              "lm_head once): %lf GFLOP/s", &mm, &gflops), 2, "%.160s", line);
    const double want_mm = eng_model_prefill_madds(f.m, 5) / 5 / 1e6;
    cr_expect(fabs(mm - want_mm) < 0.051 && gflops > 0, "%.1f M, want %.2f: %.160s", mm, want_mm,
              line);
    if (kern_madd_per_round(false) > 0) {
        line = strstr(out, "f32 FMA peak on 1 threads, this run: ");
        cr_assert(line, "no peak line in:\n%s", out);
        cr_assert_eq(sscanf(line, "f32 FMA peak on 1 threads, this run: %lf", &peak), 1);
        cr_expect(peak > 1.0 && strstr(line, "-> prefill at "), "%.120s", line);
    } else {
        cr_expect(strstr(out, "no multiply-add peak this run: this build has no"), "%s", out);
    }
    cr_expect(!strstr(out, "vdpbf16ps"), "no bf16 peak without --bf16:\n%s", out);
    cr_expect(strstr(out, "(best of 3)") && !strstr(out, "each decode run"),
              "tiny fits in the cache: one read after the runs, no pairs:\n%s", out);
    /* a read buffer the machine cannot give: said, and the bench stands */
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " bench --model %s %s --bandwidth-mib 1048576 2>&1", f.dir,
                         args),
                 0, "%s", out);
    cr_expect(strstr(out, "a decoded token reads ") &&
                  strstr(out, "no streaming read this run: out of memory"),
              "%s", out);
    /* --bandwidth-mib 0 leaves it out */
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " bench --model %s %s --bandwidth-mib 0 2>&1", f.dir, args),
                 0, "%s", out);
    cr_expect(!strstr(out, "streaming read"), "%s", out);
    close_fixture(&f);
}

/* A model whose token reads more than the last-level cache holds: each
 * decode run is put between two reads, and the run's own ratio is printed
 * (median and range over the runs); "tiny" fits in the cache and gets the
 * one read after the runs, no pairs. */
Test(decode_batch, bench_pairs_reads_with_runs_beyond_the_cache, .timeout = 180) {
    const size_t llc = eng_llc_bytes();
    if (llc > ((size_t)256 << 20))
        cr_skip_test("a %zu MiB last-level cache: the model that outgrows it would be over 1 GiB",
                     llc >> 20);
    char *dir = tmu_mkdtemp();
    cr_assert(dir);
    char out[8192];
    /* tiny's layout (hidden 256) with a vocabulary whose lm_head alone is
     * twice the cache (32 MiB or unknown: 131,072 rows, 64 MiB) */
    const size_t cache = llc ? llc : (size_t)32 << 20;
    const long vocab = (long)(2 * cache / (256 * 2));
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " gen-model --preset tiny --out %s/tiny 2>&1", dir),
                 0, "%s", out);
    char *cfg = tmu_path(dir, "tiny/config.json");
    char big_vocab[64];
    snprintf(big_vocab, sizeof big_vocab, "\"vocab_size\":\t%ld,", vocab);
    cr_assert(tmu_replace_in_file(cfg, "\"vocab_size\":\t512,", big_vocab), "%s", cfg);
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " gen-model --config %s --out %s/big 2>&1", cfg, dir),
                 0, "%s", out);
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " bench --model %s/big --threads 1 --repeats 3 "
                                      "--prompt-tokens 2 --gen-tokens 2 --bandwidth-mib 64 2>&1",
                         dir),
                 0, "%s", out);
    double mb = 0;
    const char *line = strstr(out, "a decoded token reads ");
    cr_assert(line && sscanf(line, "a decoded token reads %lf MB", &mb) == 1, "%s", out);
    cr_expect(mb * 1e6 > (double)cache, "%.1f MB a token against a %zu-byte cache", mb, cache);
    /* a quarter of a second of reads on each side of each of 3 runs, one
     * read at least each */
    line = strstr(out, "streaming read of 64 MiB on 1 threads, this run: ");
    int reads = 0;
    cr_assert(line && (line = strstr(line, "(best of ")), "%s", out);
    cr_assert_eq(sscanf(line, "(best of %d)", &reads), 1, "%.80s", line);
    cr_expect(reads >= 6, "%d reads beside 3 runs:\n%s", reads, out);
    line = strstr(out, "each decode run against the reads beside and inside it: ");
    cr_assert(line, "no paired line in:\n%s", out);
    double med = 0, lo = 0, hi = 0;
    int runs = 0;
    cr_assert_eq(sscanf(line,
                        "each decode run against the reads beside and inside it: %lf%% "
                        "(median of %d runs; %lf-%lf%%; each side reads back to back for 0.25 s",
                        &med, &runs, &lo, &hi),
                 4, "%s", line);
    cr_expect(runs == 3 && med > 0 && lo <= med && med <= hi, "%.160s", line);
    cr_expect(strstr(line, "each side reads back to back for 0.25 s"), "%.200s", line);
    free(cfg);
    tmu_rmtree(dir);
    free(dir);
}

/* eng_ctx_params.bf16_act on the CPU: a prefill's bf16 products round
 * their activations, so the logits move by about bf16's error, no more;
 * without it a second context gives the same logits bit for bit. */
Test(decode_batch, cpu_bf16_activations_within_bf16_error) {
    fixture f = open_preset("tiny", 1, 32, 1);
    kds_err err = {0};
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cp.max_batch = 32;
    cp.max_seqs = 1;
    cp.bf16_act = true;
    eng_ctx *cb = NULL;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &cb, &err), KDS_OK, "%s", err.msg);
    const int T = 24;
    int32_t ids[24];
    prompt(ids, T, f.vocab, 31);
    eng_seq *a = NULL, *b = NULL;
    cr_assert_eq(eng_seq_create(f.m, 1, &a, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_seq_create(f.m, 1, &b, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_prefill(f.c, a, ids, T, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_prefill(cb, b, ids, T, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    const float *la = eng_seq_logits(a), *lb = eng_seq_logits(b);
    double big = 0.0, diff = 0.0;
    for (int i = 0; i < f.vocab; i++) {
        if (fabs(la[i]) > big) big = fabs(la[i]);
        if (fabs(la[i] - lb[i]) > diff) diff = fabs(la[i] - lb[i]);
    }
    const double ratio = diff / (big > 1.0 ? big : 1.0);
    cr_log_info("cpu bf16 activations: prefill logits error / largest %g", ratio);
    cr_expect_leq(ratio, 3e-2, "bf16 activations: %g (limit 3e-2)", ratio);
    if (eng_cpu_bf16_products())
        cr_expect_gt(ratio, 1e-7, "bf16 activations changed nothing (%g): the mode did not reach "
                     "the products", ratio);
    else /* a build without AVX-512 BF16: the products stay exact */
        cr_expect(!memcmp(la, lb, (size_t)f.vocab * sizeof *la),
                  "without bf16 dot products the mode moved the logits (%g)", ratio);
    eng_seq_free(a);
    eng_seq_free(b);
    eng_ctx_free(cb);
    close_fixture(&f);
}

/* bf16_act in a batched decode step: the step's products of 4 tokens and
 * more round x to bf16 (kern_matmul_w_bf16act), so each sequence's logits
 * move from the exact step's by about bf16's error and no more; a lone
 * decode stays exact in that mode, bit for bit. */
Test(decode_batch, cpu_bf16_activations_in_a_batched_step) {
    enum { N = 8, P = 12 };
    fixture f = open_preset("tiny", 1, 32, N);
    kds_err err = {0};
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 2;
    cp.max_batch = 32;
    cp.max_seqs = N;
    cp.bf16_act = true;
    eng_ctx *cb = NULL;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &cb, &err), KDS_OK, "%s", err.msg);
    eng_seq *a[N], *b[N];
    int32_t next[N];
    for (int i = 0; i < N; i++) {
        int32_t ids[P];
        prompt(ids, P, f.vocab, 100u + (uint32_t)i);
        cr_assert_eq(eng_seq_create(f.m, 1, &a[i], &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_seq_create(f.m, 1, &b[i], &err), KDS_OK, "%s", err.msg);
        /* both from the same exact prefill */
        cr_assert_eq(eng_prefill(f.c, a[i], ids, P, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_prefill(f.c, b[i], ids, P, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
        next[i] = (int32_t)((7u + 13u * (unsigned)i) % (unsigned)f.vocab);
    }
    cr_assert_eq(eng_decode_batch(f.c, a, next, N, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_decode_batch(cb, b, next, N, &err), KDS_OK, "%s", err.msg);
    double worst = 0.0;
    bool moved = false;
    for (int i = 0; i < N; i++) {
        const float *la = eng_seq_logits(a[i]), *lb = eng_seq_logits(b[i]);
        double big = 0.0, diff = 0.0;
        for (int v = 0; v < f.vocab; v++) {
            if (fabs(la[v]) > big) big = fabs(la[v]);
            if (fabs(la[v] - lb[v]) > diff) diff = fabs(la[v] - lb[v]);
        }
        const double ratio = diff / (big > 1.0 ? big : 1.0);
        if (ratio > worst) worst = ratio;
        if (memcmp(la, lb, (size_t)f.vocab * sizeof *la) != 0) moved = true;
    }
    cr_log_info("cpu bf16 activations, batched step of %d: logits error / largest %g", N, worst);
    cr_expect_leq(worst, 3e-2, "bf16 activations in a batched step: %g (limit 3e-2)", worst);
    if (eng_cpu_bf16_products())
        cr_expect(moved, "bf16 activations changed nothing in a batched step of %d", N);
    else
        cr_expect(!moved, "without bf16 dot products the mode moved a batched step's logits");
    /* a lone decode: exact in either mode */
    eng_seq *c0 = NULL;
    int32_t ids[P];
    prompt(ids, P, f.vocab, 300u);
    cr_assert_eq(eng_seq_create(f.m, 1, &c0, &err), KDS_OK, "%s", err.msg);
    eng_seq *d0 = NULL;
    cr_assert_eq(eng_seq_create(f.m, 1, &d0, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_prefill(f.c, c0, ids, P, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_prefill(f.c, d0, ids, P, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_decode(f.c, c0, 9, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_decode(cb, d0, 9, &err), KDS_OK, "%s", err.msg);
    cr_expect(!memcmp(eng_seq_logits(c0), eng_seq_logits(d0), (size_t)f.vocab * sizeof(float)),
              "a lone decode under bf16_act is not the exact one");
    eng_seq_free(c0);
    eng_seq_free(d0);
    for (int i = 0; i < N; i++) {
        eng_seq_free(a[i]);
        eng_seq_free(b[i]);
    }
    eng_ctx_free(cb);
    close_fixture(&f);
}
