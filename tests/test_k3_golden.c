/*
 * Kimi K3 golden checkpoints: every folder under ../shared/golden/model-k3
 * (and under $K3_MODEL_GOLDEN_DIR when set) must reproduce its expected
 * logits, computed by an independent fp32 reference (golden/README.md),
 * through the prefill path at several batch and chunk sizes, token-by-token
 * decode, and batched decode. Tolerance: 1e-4 of the largest |logit|, the
 * README's (a float32 forward of K3 differs from a float64 one by ~1.5e-5
 * of it: the AttnRes softmaxes, SiTU and the latent norm). The checkpoints
 * are K3's layout unmodified: a kimi_k3 config with text_config, tensors
 * under language_model., a vision tower to skip, MXFP4 routed experts.
 * Also: a damaged checkpoint (a scale tensor of the wrong shape, a packed
 * tensor of the wrong width, a scale dropped) is refused naming the tensor.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include "eng.h"
#include "eng_config.h"
#include "eng_model.h"
#include "eng_safetensors.h"
#include "test_helpers.h"
#include "test_model_util.h"

#define K3_TOL 1e-4
#define K3_ROOT GOLDEN_ROOT "/model-k3"

static double worst_seen;

static void expect_logits(const char *dir, const char *what, const float *got, const float *want,
                          size_t n) {
    double ref_max, d = th_max_abs_diff(got, want, n, &ref_max);
    cr_log_info("%s %s: max |err| %.3g = %.3g of max |logit| %.3g", dir, what, d, d / ref_max,
                ref_max);
    fprintf(stderr, "golden k3 %s %s: rel err %.3g\n", dir, what, d / ref_max);
    if (d / ref_max > worst_seen) worst_seen = d / ref_max;
    cr_expect_leq(d, K3_TOL * ref_max, "%s %s: max err %g > %g", dir, what, d, K3_TOL * ref_max);
}

static void check_dir(const char *dir) {
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
    const eng_config *cfg = eng_model_config(m);
    cr_expect_eq(cfg->family, ENG_FAMILY_KIMI_K3, "%s does not load as a K3 checkpoint", dir);
    const int V = cfg->vocab_size;
    cr_assert_eq(lg_t->shape[1], V, "%s: expected logits have vocab %lld, model %d", dir,
                 (long long)lg_t->shape[1], V);
    float *got = malloc((size_t)T * V * sizeof(float));
    cr_assert(got);

    /* prefill: everything in one batch with 16-token chunks, 7-token
     * batches (state carried between calls), one token per call */
    const int batches[3] = {256, 7, 1}, chunks[3] = {16, 64, 64};
    for (int g = 0; g < 3; g++) {
        eng_ctx_params cp = eng_ctx_default_params();
        cp.max_batch = batches[g];
        cp.kda_chunk = chunks[g];
        cp.max_seqs = 2;
        eng_ctx *c = NULL;
        cr_assert_eq(eng_ctx_create(m, &cp, &c, &err), KDS_OK, "%s", err.msg);
        eng_seq *s = NULL;
        cr_assert_eq(eng_seq_create(m, 0, &s, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_prefill(c, s, ids, T, got, NULL, NULL, &err), KDS_OK, "%s", err.msg);
        char what[64];
        snprintf(what, sizeof what, "prefill (batch %d, chunk %d)", batches[g], chunks[g]);
        expect_logits(dir, what, got, want, (size_t)T * V);
        if (g == 0) {
            /* token by token, and two sequences decoded side by side */
            eng_seq *pair[2] = {s, NULL};
            cr_assert_eq(eng_seq_create(m, 1, &pair[1], &err), KDS_OK, "%s", err.msg);
            eng_seq_reset(s, 0);
            float *got2 = malloc((size_t)T * V * sizeof(float));
            cr_assert(got2);
            for (int64_t t = 0; t < T; t++) {
                const int32_t two[2] = {ids[t], ids[t]};
                cr_assert_eq(eng_decode_batch(c, pair, two, 2, &err), KDS_OK, "%s", err.msg);
                memcpy(got + (size_t)t * V, eng_seq_logits(pair[0]), (size_t)V * sizeof(float));
                memcpy(got2 + (size_t)t * V, eng_seq_logits(pair[1]), (size_t)V * sizeof(float));
            }
            expect_logits(dir, "batched decode (sequence 0)", got, want, (size_t)T * V);
            expect_logits(dir, "batched decode (sequence 1)", got2, want, (size_t)T * V);
            free(got2);
            eng_seq_free(pair[1]);
            eng_seq_reset(s, 0);
            for (int64_t t = 0; t < T; t++) {
                cr_assert_eq(eng_decode(c, s, ids[t], &err), KDS_OK, "%s", err.msg);
                memcpy(got + (size_t)t * V, eng_seq_logits(s), (size_t)V * sizeof(float));
            }
            expect_logits(dir, "decode", got, want, (size_t)T * V);
        }
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
    cr_assert_geq(n, 0, "cannot read the K3 golden folder %s", root);
    for (int i = 0; i < n; i++) {
        check_dir(dirs[i]);
        free(dirs[i]);
    }
    return n;
}

Test(k3_golden, shared_checkpoints, .timeout = 300) {
    worst_seen = 0;
    int n = check_root(K3_ROOT);
    cr_assert_gt(n, 0, "no K3 golden checkpoints found under " K3_ROOT);
    cr_log_info("k3 golden: largest error %.3g of the largest logit (limit %g)", worst_seen, K3_TOL);
}

Test(k3_golden, env_checkpoints, .timeout = 600) {
    const char *extra = getenv("K3_MODEL_GOLDEN_DIR");
    if (!extra || !*extra) cr_skip_test("K3_MODEL_GOLDEN_DIR not set");
    int n = check_root(extra);
    cr_assert_gt(n, 0, "no checkpoints found under K3_MODEL_GOLDEN_DIR=%s", extra);
}

/* The checkpoint's text config is read from text_config, its tensors from
 * under language_model., its experts as MXFP4; the vision tower is there
 * and is not loaded. */
Test(k3_golden, loads_as_k3) {
    eng_model_params mp = eng_model_default_params();
    mp.no_fingerprint_cache = true;
    eng_model *m = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_model_load(K3_ROOT "/micro-k3", &mp, &m, &err), KDS_OK, "%s", err.msg);
    const eng_config *c = eng_model_config(m);
    cr_expect(c->has_vision, "the vision tower is noticed");
    cr_expect(c->experts_mxfp4);
    cr_expect_eq(c->hidden_act, ENG_ACT_SITU);
    cr_expect_eq(c->attn_res_block_size, 2);
    cr_expect(c->use_full_rank_gate && c->mla_use_output_gate);
    cr_expect_eq(m->layers[1].ffn_kind, ENG_FFN_LATENT_MOE);
    cr_expect_eq(m->layers[0].ffn_kind, ENG_FFN_DENSE);
    cr_expect_eq(m->layers[3].kind, ENG_LAYER_MLA);
    cr_expect_eq(m->layers[2].input_kind, ENG_INPUT_ATTN_RES);
    cr_expect_eq(m->layers[1].ffn.w1[0].dt, KERN_MXFP4);
    cr_expect_eq(m->layers[1].ffn.w1[0].cols, c->latent_size, "experts live in the latent");
    cr_expect_eq(m->layers[1].ffn.router.cols, c->hidden_size, "the router reads the full width");
    cr_expect(m->layers[1].kda.g_proj.rows > 0 && m->layers[3].mla.g_proj.rows > 0);
    eng_model_free(m);
}

/* micro-k3 as K3 itself ships: its tensors dealt round-robin into three
 * shards, so an expert's weight_packed and its weight_scale, and a layer's
 * tensors, live in different files, with model.safetensors.index.json
 * mapping every name (the vision tower's too). The logits must be those of
 * the single file's expected.safetensors, on every path. */
Test(k3_golden, sharded_checkpoint_reproduces_the_logits, .timeout = 300) {
    char *dir = tmu_mkdtemp();
    cr_assert(dir);
    eng_st_file *f = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_st_open(K3_ROOT "/micro-k3/model.safetensors", &f, &err), KDS_OK, "%s",
                 err.msg);
    const size_t n = eng_st_count(f), parts = 3;
    eng_st_out_tensor *out = calloc(n, sizeof *out);
    size_t cap = 64 * 1024 + n * 160, o = 0;
    char *index = malloc(cap);
    cr_assert(out && index);
    o += (size_t)snprintf(index, cap, "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {");
    size_t listed = 0;
    for (size_t s = 0; s < parts; s++) {
        char name[64];
        snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, parts);
        size_t m = 0;
        for (size_t i = s; i < n; i += parts) {
            const eng_st_tensor *t = eng_st_at(f, i);
            out[m] = (eng_st_out_tensor){
                .name = t->name, .dtype = t->dtype, .n_dims = t->n_dims, .data = t->data};
            memcpy(out[m].shape, t->shape, sizeof t->shape);
            m++;
            o += (size_t)snprintf(index + o, cap - o, "%s\"%s\": \"%s\"", listed++ ? ", " : "",
                                  t->name, name);
        }
        char *path = tmu_path(dir, name);
        cr_assert_eq(eng_st_write(path, out, m, NULL, &err), KDS_OK, "%s", err.msg);
        free(path);
    }
    snprintf(index + o, cap - o, "}}");
    char *ip = tmu_path(dir, "model.safetensors.index.json");
    cr_assert(tmu_write(ip, index, strlen(index)));
    const char *copies[2] = {"config.json", "expected.safetensors"};
    for (int i = 0; i < 2; i++) {
        char src[512];
        snprintf(src, sizeof src, "%s/micro-k3/%s", K3_ROOT, copies[i]);
        char *dst = tmu_path(dir, copies[i]);
        cr_assert(tmu_copy(src, dst), "copying %s", src);
        free(dst);
    }
    eng_model_params mp = eng_model_default_params();
    mp.no_fingerprint_cache = true;
    eng_model *m = NULL;
    cr_assert_eq(eng_model_load(dir, &mp, &m, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(m->n_shards, (int)parts, "loaded from %d files, not %zu", m->n_shards, parts);
    eng_model_free(m);
    check_dir(dir);
    free(ip);
    free(index);
    free(out);
    eng_st_close(f);
    tmu_rmtree(dir);
    free(dir);
}

/* A damaged copy of micro-k3: `edit` renames, retypes or reshapes one
 * tensor (the data bytes as they were), then the load must fail with
 * `want`, naming `needle`. */
typedef struct k3_edit {
    const char *suffix;
    int what; /* 0 drop, 1 dtype, 2 shape[1] */
    eng_st_dtype dtype;
    int64_t cols;
} k3_edit;

static bool edit_one(void *user, eng_st_out_tensor *t) {
    const k3_edit *e = user;
    size_t n = strlen(t->name), k = strlen(e->suffix);
    if (n < k || strcmp(t->name + n - k, e->suffix) != 0) return true;
    if (e->what == 0) return false;
    if (e->what == 1) t->dtype = e->dtype;
    if (e->what == 2) t->shape[1] = e->cols;
    return true;
}

Test(k3_golden, damaged_checkpoints_are_refused) {
    const struct {
        k3_edit e;
        kds_status want;
        const char *needle;
    } cases[] = {
        {{"layers.2.block_sparse_moe.experts.5.w3.weight_scale", 2, 0, 1}, KDS_MISMATCH,
         "experts.5.w3.weight_scale"},
        {{"layers.4.block_sparse_moe.experts.0.w2.weight_packed", 2, 0, 8}, KDS_MISMATCH,
         "experts.0.w2.weight_packed"},
        {{"layers.1.block_sparse_moe.experts.7.w1.weight_scale", 0, 0, 0}, KDS_NOT_FOUND,
         "experts.7.w1.weight_scale"},
        {{"layers.1.block_sparse_moe.experts.7.w1.weight_scale", 1, ENG_ST_I8, 0}, KDS_MISMATCH,
         "weight_scale"},
        {{"layers.0.self_attention_res_proj.weight", 0, 0, 0}, KDS_NOT_FOUND,
         "self_attention_res_proj"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *bad = tmu_mkdtemp();
        cr_assert(bad);
        k3_edit e = cases[i].e;
        cr_assert(tmu_rewrite(K3_ROOT "/micro-k3", bad, "model.safetensors", edit_one, &e));
        eng_model_params p = eng_model_default_params();
        p.no_fingerprint_cache = true;
        eng_model *m = NULL;
        kds_err err = {0};
        kds_status rc = eng_model_load(bad, &p, &m, &err);
        cr_expect_eq(rc, cases[i].want, "case %zu: got %s (%s)", i, kds_status_str(rc), err.msg);
        cr_expect(strstr(err.msg, cases[i].needle), "case %zu: '%s' does not name '%s'", i, err.msg,
                  cases[i].needle);
        cr_expect_null(m);
        eng_model_free(m);
        tmu_rmtree(bad);
        free(bad);
    }
}
