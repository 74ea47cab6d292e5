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

/* eng_decode_batch_sample on the CPU is eng_decode_batch + eng_sample. */
Test(cuda_model, decode_batch_sample_on_the_cpu) {
    fixture f = open_preset("tiny");
    kds_err err = {0};
    kds_status rc;
    eng_ctx *c = make_ctx(f.m, NULL, &rc, &err);
    cr_assert_eq(rc, KDS_OK, "%s", err.msg);
    eng_seq *a[2], *b[2];
    int32_t ids[4] = {5, 9, 11, 3}, in[2] = {7, 8}, out[2], want;
    eng_sampler_params sp = eng_sampler_default_params();
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(eng_seq_create(f.m, 4, &a[i], &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_seq_create(f.m, 4, &b[i], &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_prefill(c, a[i], ids + i, 3, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_prefill(c, b[i], ids + i, 3, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    }
    cr_assert_eq(eng_decode_batch_sample(c, a, in, 2, &sp, out, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_decode_batch(c, b, in, 2, &err), KDS_OK, "%s", err.msg);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(eng_sample(c, b[i], &sp, &want, &err), KDS_OK, "%s", err.msg);
        cr_expect_eq(out[i], want, "sequence %d", i);
    }
    cr_expect_eq(eng_decode_batch_sample(c, a, in, 2, NULL, out, &err), KDS_INVALID_ARG);
    in[1] = -1;
    cr_expect_eq(eng_decode_batch_sample(c, a, in, 2, &sp, out, &err), KDS_INVALID_ARG);
    for (int i = 0; i < 2; i++) {
        eng_seq_free(a[i]);
        eng_seq_free(b[i]);
    }
    eng_ctx_free(c);
    close_fixture(&f);
}

#ifdef KDS_HAVE_CUDA

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

/*
 * The same sequences on a CPU context and a GPU context: pair_open makes
 * both contexts (sizes as given) and n pairs of sequences (same seed);
 * pair_prefill feeds sequence i a prompt of lens[i] tokens on both sides
 * and compares the last logits (and, with every_position, every
 * position's logits of sequence 0); pair_decode runs greedy batched decode
 * steps of sequences [0, n_batch) on both sides, comparing every row.
 */
#define PAIR_MAX 4
typedef struct pair {
    eng_ctx *cc, *gc;
    eng_seq *cs[PAIR_MAX], *gs[PAIR_MAX];
    int n, vocab;
} pair;

static pair pair_open(const fixture *f, int threads, int max_batch, int max_seqs, int n) {
    pair p = {.n = n, .vocab = f->vocab};
    kds_err err = {0};
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = threads;
    cp.max_batch = max_batch;
    cp.max_seqs = max_seqs;
    cr_assert_eq(eng_ctx_create(f->m, &cp, &p.cc, &err), KDS_OK, "%s", err.msg);
    cp.device = "cuda";
    cr_assert_eq(eng_ctx_create(f->m, &cp, &p.gc, &err), KDS_OK, "%s", err.msg);
    cr_assert_leq(n, PAIR_MAX);
    for (int i = 0; i < n; i++) {
        cr_assert_eq(eng_seq_create(f->m, 9, &p.cs[i], &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_seq_create(f->m, 9, &p.gs[i], &err), KDS_OK, "%s", err.msg);
    }
    return p;
}

static void pair_close(pair *p) {
    for (int i = 0; i < p->n; i++) {
        eng_seq_free(p->cs[i]);
        eng_seq_free(p->gs[i]);
    }
    eng_ctx_free(p->gc); /* also hands resident states back */
    eng_ctx_free(p->cc);
}

static void pair_prefill(pair *p, const int *lens, uint32_t salt, double tol, bool every_position,
                         const char *what) {
    const int V = p->vocab;
    kds_err err = {0};
    for (int i = 0; i < p->n; i++) {
        int32_t *ids = malloc((size_t)lens[i] * sizeof *ids);
        const bool all = every_position && i == 0;
        float *lc = all ? malloc((size_t)lens[i] * V * sizeof(float)) : NULL;
        float *lg = all ? malloc((size_t)lens[i] * V * sizeof(float)) : NULL;
        cr_assert(ids && (!all || (lc && lg)));
        prompt(ids, lens[i], V, salt + (uint32_t)i);
        cr_assert_eq(eng_prefill(p->cc, p->cs[i], ids, lens[i], lc, NULL, NULL, &err), KDS_OK, "%s",
                     err.msg);
        cr_assert_eq(eng_prefill(p->gc, p->gs[i], ids, lens[i], lg, NULL, NULL, &err), KDS_OK, "%s",
                     err.msg);
        if (all) expect_close(lg, lc, (size_t)lens[i] * V, tol, what, -1);
        expect_close(eng_seq_logits(p->gs[i]), eng_seq_logits(p->cs[i]), V, tol, what, i);
        cr_expect_eq(argmax(eng_seq_logits(p->gs[i]), V), argmax(eng_seq_logits(p->cs[i]), V),
                     "%s, sequence %d: greedy tokens differ", what, i);
        free(ids);
        free(lc);
        free(lg);
    }
}

static void pair_decode(pair *p, int n_batch, int steps, double tol, const char *what) {
    const int V = p->vocab;
    kds_err err = {0};
    int32_t next[PAIR_MAX];
    for (int step = 0; step < steps; step++) {
        for (int i = 0; i < n_batch; i++) {
            next[i] = argmax(eng_seq_logits(p->cs[i]), V);
            cr_expect_eq(argmax(eng_seq_logits(p->gs[i]), V), next[i],
                         "%s, step %d, sequence %d: greedy tokens differ", what, step, i);
        }
        cr_assert_eq(eng_decode_batch(p->cc, p->cs, next, n_batch, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_decode_batch(p->gc, p->gs, next, n_batch, &err), KDS_OK, "%s", err.msg);
        for (int i = 0; i < n_batch; i++)
            expect_close(eng_seq_logits(p->gs[i]), eng_seq_logits(p->cs[i]), V, tol, what, step);
    }
}

/* One greedy eng_decode of CPU sequence c and GPU sequence g (the same token). */
static void pair_decode_one(pair *p, eng_seq *c, eng_seq *g, double tol, const char *what) {
    kds_err err = {0};
    int32_t id = argmax(eng_seq_logits(c), p->vocab);
    cr_assert_eq(eng_decode(p->cc, c, id, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_decode(p->gc, g, id, &err), KDS_OK, "%s", err.msg);
    expect_close(eng_seq_logits(g), eng_seq_logits(c), p->vocab, tol, what, 0);
}

/* A prefill (every position's logits), then 8 batched decode steps of 3
 * sequences and one single decode: the GPU follows the CPU. */
Test(cuda_model, logits_match_cpu, .timeout = 3600) {
    require_device();
    fixture f = open_preset("tiny");
    pair p = pair_open(&f, 1, 64, 4, 3);
    cr_expect_str_eq(eng_ctx_device(p.gc), "cuda");
    const int lens[3] = {40, 9, 1};
    worst_ratio = 0;
    pair_prefill(&p, lens, 40u, LOGIT_TOL, true, "prefill");
    pair_decode(&p, 3, 8, LOGIT_TOL, "batched decode");
    pair_decode_one(&p, p.cs[1], p.gs[1], LOGIT_TOL, "single decode");
    cr_log_info("cuda_model: largest GPU-CPU error / largest magnitude %g (limit %g)", worst_ratio,
                LOGIT_TOL);
    expect_graphs(p.gc, "tiny");
    /* the states stay on the device; a fetch brings them to host memory */
    const eng_dims *d = &p.cs[0]->d;
    kds_err err = {0};
    for (int i = 0; i < 3; i++) {
        eng_seq *g = p.gs[i], *c = p.cs[i];
        cr_expect(g->gpu != NULL && g->gpu_newer, "sequence %d is not resident", i);
        cr_assert_eq(eng_ctx_attach(p.cc, g, &err), KDS_OK, "%s", err.msg); /* = a fetch */
        cr_expect(!g->gpu_newer, "sequence %d: fetch left the host copy stale", i);
        cr_expect_eq(g->pos, c->pos, "sequence %d: positions differ", i);
        cr_expect_eq(g->n_recent, c->n_recent);
        expect_close(g->kda_state, c->kda_state, (size_t)d->n_kda * d->HV * d->K * d->V, STATE_TOL,
                     "KDA states", i);
        expect_close(g->conv_tail, c->conv_tail, (size_t)d->n_kda * (d->W - 1) * d->conv_ch,
                     STATE_TOL, "conv tails", i);
    }
    pair_close(&p);
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
 * resident: every step agrees with the CPU engine doing the same. Three
 * threads: the states move through the staging copies split over the
 * context's threads (a piece lost there fails this test). */
Test(cuda_model, resident_states_follow_the_cpu, .timeout = 3600) {
    require_device();
    fixture f = open_preset("tiny");
    kds_err err = {0};
    pair p = pair_open(&f, 3, 8, 2, 3); /* two device slots for three sequences */
    eng_ctx *cc = p.cc, *gc = p.gc;
    eng_seq **cs = p.cs, **gs = p.gs;
    const int V = f.vocab, lens[3] = {5, 5, 5};
    pair_prefill(&p, lens, 70u, LOGIT_TOL, false, "prefill");
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
    pair_decode_one(&p, cs[1], gs[2], LOGIT_TOL, "decode after restore");
    /* a clone of a resident sequence starts from its device state */
    eng_seq *clone = NULL;
    cr_assert(gs[0]->gpu && gs[0]->gpu_newer);
    cr_assert_eq(eng_seq_clone(gs[0], &clone, &err), KDS_OK, "%s", err.msg);
    expect_same_state(clone, cs[0], "clone of a resident sequence");
    eng_seq_free(clone);
    /* freeing the context hands the resident states back */
    eng_ctx_free(gc);
    p.gc = NULL;
    cr_expect(!gs[0]->gpu && !gs[2]->gpu, "sequences still point at a freed context");
    expect_same_state(gs[0], cs[0], "state after the context was freed");
    expect_same_state(gs[2], cs[1], "restored state after the context was freed");
    cr_log_info("cuda_model residency: largest GPU-CPU error / largest magnitude %g", worst_ratio);
    free(snap_g);
    free(snap_c);
    free(snap1);
    pair_close(&p);
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

/* Kimi K3 generated on the device (k3-micro: MXFP4 routed experts made by
 * kern_cuda_gen_quant, eng_cuda.c gen_block_weight) is the written model:
 * the same logits, bit for bit. Skips while the CUDA backend cannot run
 * the written K3 model itself (its refusal is the reason given). */
Test(cuda_model, generated_k3_on_the_device_equals_the_file, .timeout = 3600) {
    require_device();
    fixture f = open_preset("k3-micro"); /* seed 7, bf16 + MXFP4 experts */
    kds_err err = {0};
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cp.max_batch = 8;
    cp.max_seqs = 2;
    cp.device = "cuda";
    eng_ctx *fc = NULL, *gc = NULL;
    kds_status rc = eng_ctx_create(f.m, &cp, &fc, &err);
    if (rc == KDS_UNSUPPORTED) {
        close_fixture(&f);
        cr_skip_test("the written k3-micro does not run on the GPU yet: %s", err.msg);
    }
    cr_assert_eq(rc, KDS_OK, "%s", err.msg);
    eng_config cfg;
    cr_assert_eq(eng_genmodel_preset("k3-micro", &cfg, &err), KDS_OK, "%s", err.msg);
    eng_model *gm = NULL;
    cr_assert_eq(eng_model_generate(&cfg, 7, "k3-micro", &gm, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_ctx_create(gm, &cp, &gc, &err), KDS_OK, "%s", err.msg);
    eng_seq *a = NULL, *b = NULL;
    cr_assert_eq(eng_seq_create(f.m, 1, &a, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_seq_create(gm, 1, &b, &err), KDS_OK, "%s", err.msg);
    int32_t ids[6];
    prompt(ids, 6, f.vocab, 5);
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
    pair p = pair_open(&f, 1, 16, 2, 2);
    eng_seq **cs = p.cs, **gs = p.gs;
    const int lens[2] = {9, 3};
    pair_prefill(&p, lens, 90u, LOGIT_TOL, true, "hybrid prefill");
    pair_decode(&p, 2, 3, LOGIT_TOL, "hybrid batched decode");
    pair_decode_one(&p, cs[1], gs[1], LOGIT_TOL, "hybrid single decode");
    /* the latent rows made on the device come back with a fetch */
    const eng_dims *d = &cs[0]->d;
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(eng_ctx_attach(p.cc, gs[i], &err), KDS_OK, "%s", err.msg);
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
    pair_decode_one(&p, cs[1], gs[0], LOGIT_TOL, "hybrid decode after a restore");
    cr_log_info("cuda_model hybrid: largest GPU-CPU error / largest magnitude %g", worst_ratio);
    expect_graphs(p.gc, "tiny-hybrid");
    free(snap1);
    pair_close(&p);
    close_fixture(&f);
}

/* A sequence released from the device (eng_ctx_release: what the server
 * does before its saver thread reads a finished turn) has its state, its
 * latent rows and its logits in host memory and no device slot; its next
 * pass uploads it again, and the GPU still follows the CPU. */
Test(cuda_model, released_sequence_is_on_the_host, .timeout = 3600) {
    require_device();
    fixture f = open_preset("tiny-hybrid");
    kds_err err = {0};
    pair p = pair_open(&f, 1, 16, 2, 2);
    const int lens[2] = {11, 4};
    pair_prefill(&p, lens, 70u, LOGIT_TOL, false, "prefill before a release");
    pair_decode(&p, 2, 2, LOGIT_TOL, "decode before a release");
    eng_seq *g = p.gs[0], *c = p.cs[0];
    cr_expect(g->gpu != NULL && g->gpu_newer, "the sequence is not resident before the release");
    cr_assert_eq(eng_ctx_release(p.gc, g, &err), KDS_OK, "%s", err.msg);
    cr_expect(g->gpu == NULL && !g->gpu_newer && !g->logits_on_gpu,
              "a released sequence is still on the device");
    expect_same_state(g, c, "released KDA state");
    for (int l = 0; l < c->d.n_mla; l++)
        expect_close(g->mla_cache[l], c->mla_cache[l], (size_t)c->pos * c->d.mla_row, STATE_TOL,
                     "released latent cache", l);
    expect_close(eng_seq_logits(g), eng_seq_logits(c), p.vocab, LOGIT_TOL, "released logits", 0);
    /* releasing a host sequence does nothing */
    cr_assert_eq(eng_ctx_release(p.gc, g, &err), KDS_OK, "%s", err.msg);
    pair_decode(&p, 2, 3, LOGIT_TOL, "decode after a release");
    cr_expect(g->gpu != NULL, "the next pass did not take the sequence back to the device");
    pair_close(&p);
    close_fixture(&f);
}

/* Kimi K3's parts on the GPU (k3-micro: SiTU, Block AttnRes with blocks
 * of 2 layers, latent MoE with MXFP4 routed experts and 2 shared experts,
 * the bounded and full-rank KDA gates, an MLA layer with q-LoRA and the
 * output gate): prefill, batched and single decode follow the CPU. */
Test(cuda_model, k3_follows_the_cpu, .timeout = 3600) {
    require_device();
    fixture f = open_preset("k3-micro");
    pair p = pair_open(&f, 1, 16, 2, 2);
    const int lens[2] = {11, 2};
    worst_ratio = 0;
    pair_prefill(&p, lens, 130u, LOGIT_TOL, true, "k3 prefill");
    pair_decode(&p, 2, 3, LOGIT_TOL, "k3 batched decode");
    pair_decode_one(&p, p.cs[0], p.gs[0], LOGIT_TOL, "k3 single decode");
    cr_log_info("cuda_model k3-micro: largest GPU-CPU error / largest magnitude %g", worst_ratio);
    expect_graphs(p.gc, "k3-micro");
    kds_err err = {0};
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(eng_ctx_attach(p.cc, p.gs[i], &err), KDS_OK, "%s", err.msg);
        expect_same_state(p.gs[i], p.cs[i], "k3 KDA state");
    }
    pair_close(&p);
    close_fixture(&f);
}

/* What the GPU cannot run is refused when the context is made, by name. */
Test(cuda_model, q8_0_experts_refused_by_name) {
    require_device();
    char *dir = NULL, *qdir = NULL;
    kds_err err = {0};
    eng_model *m = tmu_gen_load("tiny", 7, &dir, &err);
    cr_assert(m, "%s", err.msg);
    qdir = tmu_mkdtemp();
    eng_quantize_params qp = eng_quantize_default_params();
    qp.experts = KERN_Q8_0;
    cr_assert_eq(eng_model_quantize(dir, &qp, qdir, NULL, &err), KDS_OK, "%s", err.msg);
    eng_model *q = NULL;
    eng_model_params mp = eng_model_default_params();
    mp.no_fingerprint_cache = true;
    cr_assert_eq(eng_model_load(qdir, &mp, &q, &err), KDS_OK, "%s", err.msg);
    eng_ctx_params cp = eng_ctx_default_params();
    cp.device = "cuda";
    eng_ctx *ctx = NULL;
    cr_expect_eq(eng_ctx_create(q, &cp, &ctx, &err), KDS_UNSUPPORTED);
    cr_expect(strstr(err.msg, "q8_0") && strstr(err.msg, "routed experts"), "%s", err.msg);
    cr_expect_null(ctx);
    eng_model_free(q);
    eng_model_free(m);
    tmu_rmtree(dir);
    tmu_rmtree(qdir);
    free(dir);
    free(qdir);
}

/* eng_decode_batch_sample on the GPU (sampler on the device, logits left
 * there) against eng_decode_batch + eng_sample on a second GPU context (the
 * same device logits, fetched and sampled on the host): the same tokens and RNG
 * states, sampled (temperature, top-k, top-p, min-p, repetition penalty)
 * and greedy, through batches that evict (3 sequences, 2 slots); then the
 * logits and the whole state bytes read back equal, bit for bit. */
Test(cuda_model, device_sampling_equals_host_sampling, .timeout = 3600) {
    require_device();
    fixture f = open_preset("tiny");
    kds_err err = {0};
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cp.max_batch = 16;
    cp.max_seqs = 2;
    cp.device = "cuda";
    eng_ctx *ga = NULL, *gb = NULL;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &ga, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_ctx_create(f.m, &cp, &gb, &err), KDS_OK, "%s", err.msg);
    const int V = f.vocab, lens[3] = {6, 3, 9};
    eng_seq *a[3], *b[3];
    int32_t ids[9], tok[3];
    eng_sampler_params sp = eng_sampler_default_params(); /* T 0.8, top-k 40, top-p, min-p */
    sp.repeat_penalty = 1.3f;
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(eng_seq_create(f.m, 21 + (uint64_t)i, &a[i], &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_seq_create(f.m, 21 + (uint64_t)i, &b[i], &err), KDS_OK, "%s", err.msg);
        prompt(ids, lens[i], V, 300u + (uint32_t)i);
        cr_assert_eq(eng_prefill(ga, a[i], ids, lens[i], NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_prefill(gb, b[i], ids, lens[i], NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
        int32_t tb;
        cr_assert_eq(eng_sample(ga, a[i], &sp, &tok[i], &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_sample(gb, b[i], &sp, &tb, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(tok[i], tb);
    }
    for (int step = 0; step < 6; step++) {
        const int pick[2][2] = {{0, 1}, {2, 0}};
        const int *pk = pick[step % 2];
        eng_seq *sa[2] = {a[pk[0]], a[pk[1]]}, *sb[2] = {b[pk[0]], b[pk[1]]};
        int32_t in[2] = {tok[pk[0]], tok[pk[1]]}, out_a[2], out_b[2];
        eng_sampler_params use = sp;
        if (step >= 4) use.temperature = 0.0f; /* greedy too */
        cr_assert_eq(eng_decode_batch_sample(ga, sa, in, 2, &use, out_a, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_decode_batch(gb, sb, in, 2, &err), KDS_OK, "%s", err.msg);
        for (int i = 0; i < 2; i++) {
            /* the logits to the host, so eng_sample samples there */
            cr_assert_not_null(eng_seq_logits(sb[i]));
            cr_assert(!sb[i]->logits_on_gpu);
            cr_assert_eq(eng_sample(gb, sb[i], &use, &out_b[i], &err), KDS_OK, "%s", err.msg);
            cr_expect_eq(out_a[i], out_b[i], "step %d, sequence %d: device sampled %d, host %d", step,
                         pk[i], out_a[i], out_b[i]);
            cr_expect_eq(memcmp(sa[i]->rng, sb[i]->rng, sizeof sa[i]->rng), 0,
                         "step %d, sequence %d: RNG states differ", step, pk[i]);
            tok[pk[i]] = out_b[i];
        }
    }
    /* eng_sample of logits left on the device samples there: the same
     * (sequence 1 was evicted by the last batch: its logits came back with
     * its state, and it samples on the host) */
    for (int i = 0; i < 3; i++) {
        int32_t ta, tb;
        const bool resident = a[i]->gpu != NULL;
        cr_assert_eq(resident, i != 1, "sequence %d: resident %d", i, resident);
        cr_assert_eq(a[i]->logits_on_gpu, resident, "sequence %d: logits on the device %d", i,
                     a[i]->logits_on_gpu);
        cr_assert_not_null(eng_seq_logits(b[i]));
        cr_assert_eq(eng_sample(ga, a[i], &sp, &ta, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_sample(gb, b[i], &sp, &tb, &err), KDS_OK, "%s", err.msg);
        cr_expect_eq(ta, tb, "sequence %d: eng_sample on the device %d, host %d", i, ta, tb);
        cr_expect_eq(a[i]->logits_on_gpu, resident, "sequence %d: sampling fetched the logits", i);
    }
    /* the logits and every state byte read back as the host path has them */
    for (int i = 0; i < 3; i++) {
        const float *la = eng_seq_logits(a[i]), *lb = eng_seq_logits(b[i]);
        cr_assert(la && lb, "sequence %d: no logits", i);
        cr_expect_eq(memcmp(la, lb, (size_t)V * sizeof(float)), 0, "sequence %d: logits differ", i);
        size_t n = eng_seq_state_bytes(b[i]);
        unsigned char *xa = malloc(n), *xb = malloc(n);
        cr_assert(xa && xb);
        cr_assert_eq(eng_seq_state_save(a[i], xa, n, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_seq_state_save(b[i], xb, n, &err), KDS_OK, "%s", err.msg);
        cr_expect_eq(memcmp(xa, xb, n), 0, "sequence %d: state bytes differ", i);
        free(xa);
        free(xb);
    }
    for (int i = 0; i < 3; i++) {
        eng_seq_free(a[i]);
        eng_seq_free(b[i]);
    }
    eng_ctx_free(ga);
    eng_ctx_free(gb);
    close_fixture(&f);
}

/* eng_sample_batch on a GPU context: three sequences, each with its own
 * settings (greedy; the defaults with a repetition penalty; a hot
 * temperature with top-k off and top-p), sampled where a batched decode
 * left their logits, in one device call, give the tokens and RNG states
 * that host sampling of the same logits gives, step after step; a
 * refusal (a repeated sequence) moves no RNG. */
Test(cuda_model, per_sequence_settings_in_one_batched_sample, .timeout = 3600) {
    require_device();
    fixture f = open_preset("tiny");
    kds_err err = {0};
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cp.max_batch = 16;
    cp.max_seqs = 4;
    cp.device = "cuda";
    eng_ctx *ga = NULL, *gb = NULL;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &ga, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_ctx_create(f.m, &cp, &gb, &err), KDS_OK, "%s", err.msg);
    const int V = f.vocab, lens[3] = {5, 8, 2};
    eng_sampler_params sp[3] = {eng_sampler_default_params(), eng_sampler_default_params(),
                                eng_sampler_default_params()};
    sp[0].temperature = 0.0f;
    sp[1].repeat_penalty = 1.3f;
    sp[2].temperature = 1.3f;
    sp[2].top_k = 0;
    sp[2].top_p = 0.9f;
    sp[2].min_p = 0.0f;
    eng_seq *a[3], *b[3];
    int32_t ids[8], tok[3];
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(eng_seq_create(f.m, 40 + (uint64_t)i, &a[i], &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_seq_create(f.m, 40 + (uint64_t)i, &b[i], &err), KDS_OK, "%s", err.msg);
        prompt(ids, lens[i], V, 500u + (uint32_t)i);
        cr_assert_eq(eng_prefill(ga, a[i], ids, lens[i], NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_prefill(gb, b[i], ids, lens[i], NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
        tok[i] = (int32_t)(i + 1);
    }
    int on_device = 0;
    for (int step = 0; step < 6; step++) {
        int32_t out_a[3], out_b[3];
        cr_assert_eq(eng_decode_batch(ga, a, tok, 3, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_decode_batch(gb, b, tok, 3, &err), KDS_OK, "%s", err.msg);
        for (int i = 0; i < 3; i++) on_device += a[i]->logits_on_gpu;
        if (step == 2) { /* a refusal first: nothing drawn */
            eng_seq *dup[2] = {a[0], a[0]};
            uint64_t rng0[4];
            memcpy(rng0, a[0]->rng, sizeof rng0);
            cr_assert_eq(eng_sample_batch(ga, dup, 2, sp, out_a, &err), KDS_INVALID_ARG);
            cr_expect(strstr(err.msg, "same as sequence 0"), "%s", err.msg);
            cr_expect_eq(memcmp(rng0, a[0]->rng, sizeof rng0), 0, "a refused batch moved an RNG");
        }
        cr_assert_eq(eng_sample_batch(ga, a, 3, sp, out_a, &err), KDS_OK, "%s", err.msg);
        for (int i = 0; i < 3; i++) {
            cr_assert_not_null(eng_seq_logits(b[i])); /* to the host: eng_sample samples there */
            cr_assert_eq(eng_sample(gb, b[i], &sp[i], &out_b[i], &err), KDS_OK, "%s", err.msg);
            cr_expect_eq(out_a[i], out_b[i], "step %d, sequence %d: batched device sample %d, host %d",
                         step, i, out_a[i], out_b[i]);
            cr_expect_eq(memcmp(a[i]->rng, b[i]->rng, sizeof a[i]->rng), 0,
                         "step %d, sequence %d: RNG states differ", step, i);
            tok[i] = out_b[i];
        }
    }
    cr_expect_eq(on_device, 18, "only %d of 18 rows had their logits on the device", on_device);
    for (int i = 0; i < 3; i++) {
        eng_seq_free(a[i]);
        eng_seq_free(b[i]);
    }
    eng_ctx_free(ga);
    eng_ctx_free(gb);
    close_fixture(&f);
}

/* bf16_act: the prefill's products (20 rows: cuBLAS) with bf16 activations
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
    cp.bf16_act = true;
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
    pair p = pair_open(&f, 0, 64, 2, 2);
    const int lens[2] = {40, 5};
    worst_ratio = 0;
    pair_prefill(&p, lens, 500u, WIDE_TOL, false, "wide prefill");
    pair_decode(&p, 2, 3, WIDE_TOL, "wide batched decode");
    cr_log_info("cuda_model wide (48B widths): largest GPU-CPU error / largest magnitude %g (limit %g)",
                worst_ratio, WIDE_TOL);
    expect_graphs(p.gc, "wide");
    pair_close(&p);
    close_fixture(&f);
}

#endif /* KDS_HAVE_CUDA */
