/*
 * The whole-model GPU forward pass (eng_ctx_params.device = "cuda",
 * engine/eng_cuda.c) against the CPU engine on the generated "tiny" model
 * (pure KDA + MoE, bf16 weights on both sides): logits of a prefill and of
 * batched decode steps within 1e-4 of the largest logit, the same greedy
 * tokens, the same states in host memory afterwards; the state hand-over
 * to and from the device; residency; a hybrid (MLA) model; the model
 * generated on the device; and the refusals (no device, unknown device
 * name). The GPU tests skip without a device; they also
 * run under the CPU emulation (kernels/cuda/emu/build.sh), slowly.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "eng.h"
#include "eng_config.h"
#include "eng_genmodel.h"
#include "eng_seq.h"
#include "test_helpers.h"
#include "test_model_util.h"
#ifdef KDS_HAVE_CUDA
#include "eng_cuda.h"
#include "kern_cuda.h"
#endif

/* Decode passes run as CUDA graphs unless KDS_CUDA_GRAPHS=0 (gpu_check.sh
 * runs these tests both ways); the emulation records and replays graphs
 * too, so a value baked into a graph at capture fails the logits there. */
static void expect_graphs(eng_ctx *gc, const char *what) {
    const char *env = getenv("KDS_CUDA_GRAPHS");
    int n = eng__cuda_graph_count(eng__ctx_gpu(gc));
    cr_log_info("%s: %d decode graphs captured", what, n);
    if (env && strcmp(env, "0") == 0)
        cr_expect_eq(n, -1, "%s: KDS_CUDA_GRAPHS=0 but graphs were used", what);
    else
        cr_expect_gt(n, 0, "%s: no decode graph was captured (capture failed; passes ran without "
                     "graphs)", what);
}

/* fp32 accumulation in another order through 4 layers and an lm_head */
#define LOGIT_TOL 1e-4
#define STATE_TOL 1e-4

typedef struct fixture {
    char *dir;
    eng_model *m;
    int vocab;
} fixture;

static fixture open_preset(const char *preset) {
    fixture f = {0};
    kds_err err = {0};
    f.m = tmu_gen_load(preset, 7, &f.dir, &err);
    cr_assert(f.m, "%s", err.msg);
    f.vocab = eng_model_config(f.m)->vocab_size;
    return f;
}

static void close_fixture(fixture *f) {
    eng_model_free(f->m);
    tmu_rmtree(f->dir);
    free(f->dir);
}

static eng_ctx *make_ctx(const eng_model *m, const char *device, kds_status *rc, kds_err *err) {
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cp.max_batch = 64;
    cp.max_seqs = 4;
    cp.device = device;
    eng_ctx *c = NULL;
    *rc = eng_ctx_create(m, &cp, &c, err);
    return c;
}

/* Without a usable device (or without CUDA compiled in) a "cuda" context is
 * refused with KDS_UNSUPPORTED and a message that says why. */
Test(cuda_model, no_device_is_unsupported) {
#ifdef KDS_HAVE_CUDA
    kds_err probe = {0};
    if (kern_cuda_available(&probe)) cr_skip_test("a CUDA device is present: nothing to refuse");
#endif
    fixture f = open_preset("tiny");
    kds_err err = {0};
    kds_status rc;
    eng_ctx *c = make_ctx(f.m, "cuda", &rc, &err);
    cr_expect_eq(rc, KDS_UNSUPPORTED, "status %d: %s", (int)rc, err.msg);
    cr_expect_null(c);
    cr_expect(strstr(err.msg, "cuda") != NULL, "message does not name the device: '%s'", err.msg);
    eng_ctx_free(c);
    close_fixture(&f);
}

/* An unknown device name is a caller error; "cpu" is the CPU engine. */
Test(cuda_model, device_names) {
    fixture f = open_preset("tiny");
    kds_err err = {0};
    kds_status rc;
    eng_ctx *c = make_ctx(f.m, "tpu", &rc, &err);
    cr_expect_eq(rc, KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "tpu") != NULL, "message: '%s'", err.msg);
    cr_expect_null(c);
    c = make_ctx(f.m, "cpu", &rc, &err);
    cr_assert_eq(rc, KDS_OK, "%s", err.msg);
    cr_expect_str_eq(eng_ctx_device(c), "cpu");
    eng_ctx_free(c);
    close_fixture(&f);
}

#ifdef KDS_HAVE_CUDA

static void require_device(void) {
    kds_err err = {0};
    if (!kern_cuda_available(&err)) cr_skip_test("no CUDA device: %s", err.msg);
}

static void prompt(int32_t *ids, int n, int vocab, uint32_t seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        ids[i] = (int32_t)((seed >> 8) % (uint32_t)vocab);
    }
}

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* the largest error / largest magnitude seen by expect_close, for the log */
static double worst_ratio;

static void expect_close(const float *gpu, const float *cpu, size_t n, double tol, const char *what,
                         int step) {
    double ref, diff = th_max_abs_diff(gpu, cpu, n, &ref);
    double ratio = diff / (ref > 1.0 ? ref : 1.0);
    if (ratio > worst_ratio || isnan(ratio)) worst_ratio = ratio;
    cr_expect_leq(diff, tol * (ref > 1.0 ? ref : 1.0), "%s (step %d): GPU-CPU max error %g, largest %g",
                  what, step, diff, ref);
}

/* A prefill (every position's logits), then 8 batched decode steps of 3
 * sequences and one single decode: the GPU follows the CPU. */
Test(cuda_model, logits_match_cpu, .timeout = 3600) {
    require_device();
    fixture f = open_preset("tiny");
    kds_err err = {0};
    kds_status rc;
    eng_ctx *cc = make_ctx(f.m, NULL, &rc, &err);
    cr_assert_eq(rc, KDS_OK, "%s", err.msg);
    eng_ctx *gc = make_ctx(f.m, "cuda", &rc, &err);
    cr_assert_eq(rc, KDS_OK, "%s", err.msg);
    cr_expect_str_eq(eng_ctx_device(gc), "cuda");
    const int V = f.vocab, n_seqs = 3, lens[3] = {40, 9, 1};
    eng_seq *cs[3], *gs[3];
    int32_t ids[40];
    float *la_c = malloc((size_t)40 * V * sizeof(float)), *la_g = malloc((size_t)40 * V * sizeof(float));
    cr_assert(la_c && la_g);
    for (int i = 0; i < n_seqs; i++) {
        cr_assert_eq(eng_seq_create(f.m, (uint64_t)i, &cs[i], &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_seq_create(f.m, (uint64_t)i, &gs[i], &err), KDS_OK, "%s", err.msg);
        prompt(ids, lens[i], V, 40u + (uint32_t)i);
        cr_assert_eq(eng_prefill(cc, cs[i], ids, lens[i], i == 0 ? la_c : NULL, NULL, NULL, &err),
                     KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_prefill(gc, gs[i], ids, lens[i], i == 0 ? la_g : NULL, NULL, NULL, &err),
                     KDS_OK, "%s", err.msg);
        if (i == 0) expect_close(la_g, la_c, (size_t)40 * V, LOGIT_TOL, "prefill, every position", 0);
        expect_close(eng_seq_logits(gs[i]), eng_seq_logits(cs[i]), V, LOGIT_TOL, "prefill", i);
        cr_expect_eq(argmax(eng_seq_logits(gs[i]), V), argmax(eng_seq_logits(cs[i]), V),
                     "sequence %d: greedy token after the prefill differs", i);
    }
    for (int step = 0; step < 8; step++) {
        int32_t next[3];
        for (int i = 0; i < n_seqs; i++) {
            next[i] = argmax(eng_seq_logits(cs[i]), V);
            cr_expect_eq(argmax(eng_seq_logits(gs[i]), V), next[i],
                         "step %d, sequence %d: greedy tokens differ", step, i);
        }
        cr_assert_eq(eng_decode_batch(cc, cs, next, n_seqs, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_decode_batch(gc, gs, next, n_seqs, &err), KDS_OK, "%s", err.msg);
        for (int i = 0; i < n_seqs; i++)
            expect_close(eng_seq_logits(gs[i]), eng_seq_logits(cs[i]), V, LOGIT_TOL, "batched decode",
                         step);
    }
    int32_t id = argmax(eng_seq_logits(cs[1]), V);
    cr_assert_eq(eng_decode(cc, cs[1], id, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_decode(gc, gs[1], id, &err), KDS_OK, "%s", err.msg);
    expect_close(eng_seq_logits(gs[1]), eng_seq_logits(cs[1]), V, LOGIT_TOL, "single decode", 8);
    cr_log_info("cuda_model: largest GPU-CPU error / largest magnitude %g (limit %g)", worst_ratio,
                LOGIT_TOL);
    expect_graphs(gc, "tiny");
    /* the states stay on the device; a fetch brings them to host memory */
    const eng_dims *d = &cs[0]->d;
    for (int i = 0; i < n_seqs; i++) {
        cr_expect(gs[i]->gpu != NULL && gs[i]->gpu_newer, "sequence %d is not resident", i);
        cr_assert_eq(eng_ctx_attach(cc, gs[i], &err), KDS_OK, "%s", err.msg); /* = a fetch */
        cr_expect(!gs[i]->gpu_newer, "sequence %d: fetch left the host copy stale", i);
        cr_expect_eq(gs[i]->pos, cs[i]->pos, "sequence %d: positions differ", i);
        cr_expect_eq(gs[i]->n_recent, cs[i]->n_recent);
        expect_close(gs[i]->kda_state, cs[i]->kda_state, (size_t)d->n_kda * d->HV * d->K * d->V,
                     STATE_TOL, "KDA states", i);
        expect_close(gs[i]->conv_tail, cs[i]->conv_tail, (size_t)d->n_kda * (d->W - 1) * d->conv_ch,
                     STATE_TOL, "conv tails", i);
        eng_seq_free(cs[i]);
        eng_seq_free(gs[i]);
    }
    free(la_c);
    free(la_g);
    eng_ctx_free(gc);
    eng_ctx_free(cc);
    close_fixture(&f);
}

/* A sequence's state goes to a device slot and back unchanged, bit for bit;
 * bad slots are refused. */
Test(cuda_model, state_hand_over_round_trip) {
    require_device();
    fixture f = open_preset("tiny");
    kds_err err = {0};
    kds_status rc;
    eng_ctx *cc = make_ctx(f.m, NULL, &rc, &err);
    cr_assert_eq(rc, KDS_OK, "%s", err.msg);
    eng_seq *a, *b;
    cr_assert_eq(eng_seq_create(f.m, 1, &a, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_seq_create(f.m, 2, &b, &err), KDS_OK, "%s", err.msg);
    int32_t ids[12];
    prompt(ids, 12, f.vocab, 5);
    cr_assert_eq(eng_prefill(cc, a, ids, 12, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    eng_cuda *g = NULL;
    cr_assert_eq(eng__cuda_create(f.m, 16, 4, false, &g, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng__cuda_state_upload(g, 2, a, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng__cuda_state_download(g, 2, b, &err), KDS_OK, "%s", err.msg);
    const eng_dims *d = &a->d;
    cr_expect_eq(memcmp(a->kda_state, b->kda_state, (size_t)d->n_kda * d->HV * d->K * d->V * 4), 0,
                 "KDA states changed on the way");
    cr_expect_eq(memcmp(a->conv_tail, b->conv_tail, (size_t)d->n_kda * (d->W - 1) * d->conv_ch * 4),
                 0, "conv tails changed on the way");
    cr_expect_eq(eng__cuda_state_upload(g, 4, a, &err), KDS_INVALID_ARG);
    cr_expect_eq(eng__cuda_state_download(g, -1, b, &err), KDS_INVALID_ARG);
    eng__cuda_free(g);
    eng_seq_free(a);
    eng_seq_free(b);
    eng_ctx_free(cc);
    close_fixture(&f);
}

/* The largest error of two sequences' KDA states and conv tails. */
static void expect_same_state(const eng_seq *g, const eng_seq *c, const char *what) {
    const eng_dims *d = &c->d;
    cr_expect_eq(g->pos, c->pos, "%s: positions %lld and %lld", what, (long long)g->pos,
                 (long long)c->pos);
    expect_close(g->kda_state, c->kda_state, (size_t)d->n_kda * d->HV * d->K * d->V, STATE_TOL,
                 what, 0);
    expect_close(g->conv_tail, c->conv_tail, (size_t)d->n_kda * (d->W - 1) * d->conv_ch, STATE_TOL,
                 what, 0);
}

/* Residency: three sequences through a context with two state slots (so
 * passes evict), a snapshot save of a resident sequence, a restore into a
 * resident sequence, a clone, and the context freed while sequences are
 * resident: every step agrees with the CPU engine doing the same. */
Test(cuda_model, resident_states_follow_the_cpu, .timeout = 3600) {
    require_device();
    fixture f = open_preset("tiny");
    kds_err err = {0};
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cp.max_batch = 8;
    cp.max_seqs = 2;
    eng_ctx *cc = NULL, *gc = NULL;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &cc, &err), KDS_OK, "%s", err.msg);
    cp.device = "cuda";
    cr_assert_eq(eng_ctx_create(f.m, &cp, &gc, &err), KDS_OK, "%s", err.msg);
    const int V = f.vocab;
    eng_seq *cs[3], *gs[3];
    int32_t ids[5];
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(eng_seq_create(f.m, 9, &cs[i], &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_seq_create(f.m, 9, &gs[i], &err), KDS_OK, "%s", err.msg);
        prompt(ids, 5, V, 70u + (uint32_t)i);
        cr_assert_eq(eng_prefill(cc, cs[i], ids, 5, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_prefill(gc, gs[i], ids, 5, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
        expect_close(eng_seq_logits(gs[i]), eng_seq_logits(cs[i]), V, LOGIT_TOL, "prefill", i);
    }
    /* two slots: the third prefill evicted the least recently used one */
    cr_expect_null(gs[0]->gpu, "sequence 0 should have been evicted");
    cr_expect(gs[1]->gpu && gs[2]->gpu, "sequences 1 and 2 should be resident");
    expect_same_state(gs[0], cs[0], "evicted state in host memory");
    /* a batch of the evicted 0 and the resident 2 evicts 1 */
    eng_seq *cb[2] = {cs[0], cs[2]}, *gb[2] = {gs[0], gs[2]};
    int32_t next[2] = {argmax(eng_seq_logits(cs[0]), V), argmax(eng_seq_logits(cs[2]), V)};
    cr_assert_eq(eng_decode_batch(cc, cb, next, 2, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_decode_batch(gc, gb, next, 2, &err), KDS_OK, "%s", err.msg);
    for (int i = 0; i < 2; i++)
        expect_close(eng_seq_logits(gb[i]), eng_seq_logits(cb[i]), V, LOGIT_TOL, "batched decode", i);
    cr_expect_null(gs[1]->gpu, "sequence 1 should have been evicted");
    /* a snapshot of a resident sequence carries its device state */
    size_t n = eng_seq_state_bytes(gs[2]);
    unsigned char *snap_g = malloc(n), *snap_c = malloc(n);
    cr_assert(snap_g && snap_c);
    cr_assert_eq(eng_seq_state_save(gs[2], snap_g, n, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_seq_state_save(cs[2], snap_c, n, &err), KDS_OK, "%s", err.msg);
    expect_same_state(gs[2], cs[2], "saved resident state");
    /* a restore into a resident sequence replaces its device state: load
     * sequence 1's snapshot into gs[2] and continue as cs[1] */
    size_t n1 = eng_seq_state_bytes(cs[1]);
    unsigned char *snap1 = malloc(n1);
    cr_assert(snap1);
    cr_assert_eq(eng_seq_state_save(cs[1], snap1, n1, &err), KDS_OK, "%s", err.msg);
    cr_assert(gs[2]->gpu != NULL);
    cr_assert_eq(eng_seq_state_load(gs[2], snap1, n1, &err), KDS_OK, "%s", err.msg);
    int32_t id = argmax(eng_seq_logits(cs[1]), V);
    cr_assert_eq(eng_decode(cc, cs[1], id, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_decode(gc, gs[2], id, &err), KDS_OK, "%s", err.msg);
    expect_close(eng_seq_logits(gs[2]), eng_seq_logits(cs[1]), V, LOGIT_TOL, "decode after restore", 0);
    /* a clone of a resident sequence starts from its device state */
    eng_seq *clone = NULL;
    cr_assert(gs[0]->gpu && gs[0]->gpu_newer);
    cr_assert_eq(eng_seq_clone(gs[0], &clone, &err), KDS_OK, "%s", err.msg);
    expect_same_state(clone, cs[0], "clone of a resident sequence");
    eng_seq_free(clone);
    /* freeing the context hands the resident states back */
    eng_ctx_free(gc);
    cr_expect(!gs[0]->gpu && !gs[2]->gpu, "sequences still point at a freed context");
    expect_same_state(gs[0], cs[0], "state after the context was freed");
    expect_same_state(gs[2], cs[1], "restored state after the context was freed");
    cr_log_info("cuda_model residency: largest GPU-CPU error / largest magnitude %g", worst_ratio);
    for (int i = 0; i < 3; i++) {
        eng_seq_free(cs[i]);
        eng_seq_free(gs[i]);
    }
    free(snap_g);
    free(snap_c);
    free(snap1);
    eng_ctx_free(cc);
    close_fixture(&f);
}

/* The model generated on the device (eng_model_generate: matrices made by
 * kern_cuda_gen_normal) is the written model: the same logits, bit for bit. */
Test(cuda_model, generated_on_the_device_equals_the_file, .timeout = 3600) {
    require_device();
    fixture f = open_preset("tiny"); /* seed 7, bf16 */
    kds_err err = {0};
    eng_config cfg;
    cr_assert_eq(eng_genmodel_preset("tiny", &cfg, &err), KDS_OK, "%s", err.msg);
    eng_model *gm = NULL;
    cr_assert_eq(eng_model_generate(&cfg, 7, "tiny", &gm, &err), KDS_OK, "%s", err.msg);
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cp.max_batch = 8;
    cp.max_seqs = 2;
    cp.device = "cuda";
    eng_ctx *fc = NULL, *gc = NULL;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &fc, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_ctx_create(gm, &cp, &gc, &err), KDS_OK, "%s", err.msg);
    eng_seq *a = NULL, *b = NULL;
    cr_assert_eq(eng_seq_create(f.m, 1, &a, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_seq_create(gm, 1, &b, &err), KDS_OK, "%s", err.msg);
    int32_t ids[6];
    prompt(ids, 6, f.vocab, 3);
    cr_assert_eq(eng_prefill(fc, a, ids, 6, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_prefill(gc, b, ids, 6, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(memcmp(eng_seq_logits(a), eng_seq_logits(b), (size_t)f.vocab * sizeof(float)), 0,
                 "prefill logits differ");
    int32_t id = argmax(eng_seq_logits(a), f.vocab);
    cr_assert_eq(eng_decode(fc, a, id, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_decode(gc, b, id, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(memcmp(eng_seq_logits(a), eng_seq_logits(b), (size_t)f.vocab * sizeof(float)), 0,
                 "decode logits differ");
    eng_seq_free(a);
    eng_seq_free(b);
    eng_ctx_free(fc);
    eng_ctx_free(gc);
    eng_model_free(gm);
    close_fixture(&f);
}

/* A hybrid model (KDA and MLA layers, tiny-hybrid) follows the CPU: prefill
 * logits at every position, batched decode of sequences with different
 * contexts, then a single decode; the latent caches come back to host
 * memory with a fetch, and a restore into a resident sequence re-uploads
 * them. */
Test(cuda_model, hybrid_follows_the_cpu, .timeout = 3600) {
    require_device();
    fixture f = open_preset("tiny-hybrid");
    kds_err err = {0};
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cp.max_batch = 16;
    cp.max_seqs = 2;
    eng_ctx *cc = NULL, *gc = NULL;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &cc, &err), KDS_OK, "%s", err.msg);
    cp.device = "cuda";
    cr_assert_eq(eng_ctx_create(f.m, &cp, &gc, &err), KDS_OK, "%s", err.msg);
    const int V = f.vocab, lens[2] = {9, 3};
    eng_seq *cs[2], *gs[2];
    int32_t ids[9];
    float *la_c = malloc((size_t)9 * V * sizeof(float)), *la_g = malloc((size_t)9 * V * sizeof(float));
    cr_assert(la_c && la_g);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(eng_seq_create(f.m, 5, &cs[i], &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_seq_create(f.m, 5, &gs[i], &err), KDS_OK, "%s", err.msg);
        prompt(ids, lens[i], V, 90u + (uint32_t)i);
        cr_assert_eq(eng_prefill(cc, cs[i], ids, lens[i], i ? NULL : la_c, NULL, NULL, &err), KDS_OK,
                     "%s", err.msg);
        cr_assert_eq(eng_prefill(gc, gs[i], ids, lens[i], i ? NULL : la_g, NULL, NULL, &err), KDS_OK,
                     "%s", err.msg);
        if (i == 0) expect_close(la_g, la_c, (size_t)9 * V, LOGIT_TOL, "hybrid prefill, every position", 0);
        expect_close(eng_seq_logits(gs[i]), eng_seq_logits(cs[i]), V, LOGIT_TOL, "hybrid prefill", i);
    }
    for (int step = 0; step < 3; step++) {
        int32_t next[2] = {argmax(eng_seq_logits(cs[0]), V), argmax(eng_seq_logits(cs[1]), V)};
        cr_assert_eq(eng_decode_batch(cc, cs, next, 2, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_decode_batch(gc, gs, next, 2, &err), KDS_OK, "%s", err.msg);
        for (int i = 0; i < 2; i++)
            expect_close(eng_seq_logits(gs[i]), eng_seq_logits(cs[i]), V, LOGIT_TOL,
                         "hybrid batched decode", step);
    }
    int32_t id = argmax(eng_seq_logits(cs[1]), V);
    cr_assert_eq(eng_decode(cc, cs[1], id, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_decode(gc, gs[1], id, &err), KDS_OK, "%s", err.msg);
    expect_close(eng_seq_logits(gs[1]), eng_seq_logits(cs[1]), V, LOGIT_TOL, "hybrid single decode", 0);
    /* the latent rows made on the device come back with a fetch */
    const eng_dims *d = &cs[0]->d;
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(eng_ctx_attach(cc, gs[i], &err), KDS_OK, "%s", err.msg);
        expect_same_state(gs[i], cs[i], "hybrid KDA state");
        for (int l = 0; l < d->n_mla; l++)
            expect_close(gs[i]->mla_cache[l], cs[i]->mla_cache[l], (size_t)cs[i]->pos * d->mla_row,
                         STATE_TOL, "latent cache", l);
    }
    /* restore sequence 1's snapshot into the resident sequence 0: its
     * latent cache is replaced on the device too */
    size_t n1 = eng_seq_state_bytes(cs[1]);
    unsigned char *snap1 = malloc(n1);
    cr_assert(snap1);
    cr_assert_eq(eng_seq_state_save(cs[1], snap1, n1, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_seq_state_load(gs[0], snap1, n1, &err), KDS_OK, "%s", err.msg);
    id = argmax(eng_seq_logits(cs[1]), V);
    cr_assert_eq(eng_decode(cc, cs[1], id, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_decode(gc, gs[0], id, &err), KDS_OK, "%s", err.msg);
    expect_close(eng_seq_logits(gs[0]), eng_seq_logits(cs[1]), V, LOGIT_TOL,
                 "hybrid decode after a restore", 0);
    cr_log_info("cuda_model hybrid: largest GPU-CPU error / largest magnitude %g", worst_ratio);
    expect_graphs(gc, "tiny-hybrid");
    free(snap1);
    free(la_c);
    free(la_g);
    for (int i = 0; i < 2; i++) {
        eng_seq_free(cs[i]);
        eng_seq_free(gs[i]);
    }
    eng_ctx_free(gc);
    eng_ctx_free(cc);
    close_fixture(&f);
}

/* gpu_bf16: the prefill's products (20 rows: cuBLAS) with bf16 activations
 * stay within a bf16-sized tolerance of the CPU, and the exact default is
 * much closer (so the mode really changes the products). */
Test(cuda_model, bf16_activations_within_bf16_error, .timeout = 3600) {
    require_device();
    fixture f = open_preset("tiny");
    kds_err err = {0};
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cp.max_batch = 32;
    cp.max_seqs = 1;
    eng_ctx *cc = NULL, *ge = NULL, *gb = NULL;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &cc, &err), KDS_OK, "%s", err.msg);
    cp.device = "cuda";
    cr_assert_eq(eng_ctx_create(f.m, &cp, &ge, &err), KDS_OK, "%s", err.msg);
    cp.gpu_bf16 = true;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &gb, &err), KDS_OK, "%s", err.msg);
    const int V = f.vocab, T = 20;
    int32_t ids[20];
    prompt(ids, T, V, 77);
    eng_seq *s[3];
    double ratio[3] = {0};
    eng_ctx *ctx[3] = {cc, ge, gb};
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(eng_seq_create(f.m, 1, &s[i], &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_prefill(ctx[i], s[i], ids, T, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    }
    for (int i = 1; i < 3; i++) {
        double ref, diff = th_max_abs_diff(eng_seq_logits(s[i]), eng_seq_logits(s[0]), (size_t)V, &ref);
        ratio[i] = diff / (ref > 1.0 ? ref : 1.0);
    }
    cr_log_info("cuda_model: prefill logits error / largest, exact %g, bf16 activations %g", ratio[1],
                ratio[2]);
    cr_expect_leq(ratio[1], LOGIT_TOL, "exact products: %g", ratio[1]);
    cr_expect_leq(ratio[2], 3e-2, "bf16 activations: %g (limit 3e-2)", ratio[2]);
    cr_expect_gt(ratio[2], 3.0 * ratio[1], "bf16 activations (%g) not worse than exact (%g): the "
                 "mode did not reach the products", ratio[2], ratio[1]);
    for (int i = 0; i < 3; i++) eng_seq_free(s[i]);
    eng_ctx_free(gb);
    eng_ctx_free(ge);
    eng_ctx_free(cc);
    close_fixture(&f);
}

/* Kimi-Linear-48B's widths (the "wide" preset: hidden 2304, 32 KDA heads
 * of 128, MLA with kv_lora_rank 512, 32 experts top-8, vocab 163840; 4
 * layers, 3.3 GB of bf16): GPU logits against the CPU's after a 40-token
 * prefill (products above 8 rows on cuBLAS and the tensor-core experts)
 * and batched decode steps (GEMV paths, decode graphs). Big: only when
 * KDS_GPU_BIG_TESTS=1 (scripts/gpu_check.sh sets it on the GPU machine). */
#define WIDE_TOL 1e-3 /* bf16 hi + lo products (~1e-5 each) through 4 layers and the lm_head */

Test(cuda_model, wide_follows_the_cpu, .timeout = 900) {
    require_device();
    const char *big = getenv("KDS_GPU_BIG_TESTS");
    if (!big || strcmp(big, "1") != 0)
        cr_skip_test("needs KDS_GPU_BIG_TESTS=1 (writes a 3.3 GB model; run by gpu_check.sh)");
    fixture f = open_preset("wide");
    kds_err err = {0};
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 0;
    cp.max_batch = 64;
    cp.max_seqs = 2;
    eng_ctx *cc = NULL, *gc = NULL;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &cc, &err), KDS_OK, "%s", err.msg);
    cp.device = "cuda";
    cr_assert_eq(eng_ctx_create(f.m, &cp, &gc, &err), KDS_OK, "%s", err.msg);
    const int V = f.vocab, lens[2] = {40, 5};
    eng_seq *cs[2], *gs[2];
    int32_t ids[40];
    worst_ratio = 0;
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(eng_seq_create(f.m, 3, &cs[i], &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_seq_create(f.m, 3, &gs[i], &err), KDS_OK, "%s", err.msg);
        prompt(ids, lens[i], V, 500u + (uint32_t)i);
        cr_assert_eq(eng_prefill(cc, cs[i], ids, lens[i], NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_prefill(gc, gs[i], ids, lens[i], NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
        expect_close(eng_seq_logits(gs[i]), eng_seq_logits(cs[i]), V, WIDE_TOL, "wide prefill", i);
    }
    for (int step = 0; step < 3; step++) {
        int32_t next[2] = {argmax(eng_seq_logits(cs[0]), V), argmax(eng_seq_logits(cs[1]), V)};
        cr_assert_eq(eng_decode_batch(cc, cs, next, 2, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_decode_batch(gc, gs, next, 2, &err), KDS_OK, "%s", err.msg);
        for (int i = 0; i < 2; i++)
            expect_close(eng_seq_logits(gs[i]), eng_seq_logits(cs[i]), V, WIDE_TOL, "wide batched decode",
                         step);
    }
    cr_log_info("cuda_model wide (48B widths): largest GPU-CPU error / largest magnitude %g (limit %g)",
                worst_ratio, WIDE_TOL);
    expect_graphs(gc, "wide");
    for (int i = 0; i < 2; i++) {
        eng_seq_free(cs[i]);
        eng_seq_free(gs[i]);
    }
    eng_ctx_free(gc);
    eng_ctx_free(cc);
    close_fixture(&f);
}

#endif /* KDS_HAVE_CUDA */
