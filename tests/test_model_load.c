/*
 * Model loading: the golden checkpoints load with every weight bound at the
 * right shape; small vectors are converted exactly; the fingerprint is
 * stable, cached, and changes with any weight byte or the config; sharded
 * checkpoints load (and fingerprint the same as unsharded ones); layout
 * variants (A_log [HV], conv [C, W], tied embeddings) are accepted.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "eng.h"
#include "eng_model.h"
#include "test_model_util.h"

static eng_model_params no_cache(void) {
    eng_model_params p = eng_model_default_params();
    p.no_fingerprint_cache = true;
    return p;
}

static eng_model *load_ok(const char *dir, const eng_model_params *p) {
    eng_model *m = NULL;
    kds_err err = {0};
    kds_status rc = eng_model_load(dir, p, &m, &err);
    cr_assert_eq(rc, KDS_OK, "loading %s: %s", dir, err.msg);
    cr_assert(m);
    return m;
}

static void check_weight(const eng_weight *w, int rows, int cols, const char *what) {
    cr_assert(w->data, "%s not bound", what);
    cr_assert_eq(w->rows, rows, "%s rows %d, want %d", what, w->rows, rows);
    cr_assert_eq(w->cols, cols, "%s cols %d, want %d", what, w->cols, cols);
}

/* The float32 values of a tensor straight from the file. */
static const float *file_floats(const eng_model *m, const char *name) {
    const eng_st_tensor *t = eng_st_find(m->shards[0], name);
    cr_assert(t, "%s not in file", name);
    cr_assert_eq(t->dtype, ENG_ST_F32);
    return t->data;
}

static bool is_hex32(const char *s) {
    if (strlen(s) != 32) return false;
    for (int i = 0; i < 32; i++)
        if (!strchr("0123456789abcdef", s[i])) return false;
    return true;
}

Test(model_load, golden_micro_kda) {
    eng_model_params p = no_cache();
    eng_model *m = load_ok(TMU_MICRO_KDA, &p);
    const eng_config *c = eng_model_config(m);
    cr_assert_eq(c->vocab_size, 384);
    cr_assert_eq(c->num_hidden_layers, 3);
    cr_assert_str_eq(eng_model_dir(m), TMU_MICRO_KDA);
    cr_assert(is_hex32(eng_model_fingerprint(m)), "%s", eng_model_fingerprint(m));
    cr_assert(eng_model_tokenizer(m));
    cr_assert_eq(eng_tok_vocab(eng_model_tokenizer(m)), 384);
    cr_assert_eq(m->n_shards, 1);
    check_weight(&m->embed_tokens, 384, 96, "embed");
    check_weight(&m->lm_head, 384, 96, "lm_head");
    cr_assert_neq(m->lm_head.data, m->embed_tokens.data);
    for (int l = 0; l < 3; l++) {
        const eng_layer_weights *lw = &m->layers[l];
        cr_assert_eq(lw->kind, ENG_LAYER_KDA);
        check_weight(&lw->kda.q_proj, 96, 96, "q_proj");
        check_weight(&lw->kda.v_proj, 96, 96, "v_proj");
        check_weight(&lw->kda.f_a_proj, 32, 96, "f_a_proj");
        check_weight(&lw->kda.f_b_proj, 96, 32, "f_b_proj");
        check_weight(&lw->kda.b_proj, 3, 96, "b_proj");
        check_weight(&lw->kda.g_b_proj, 96, 32, "g_b_proj");
        check_weight(&lw->kda.o_proj, 96, 96, "o_proj");
        cr_assert_eq(lw->kda.q_proj.dt, KERN_F32);
        cr_assert_eq(lw->ffn_kind == ENG_FFN_MOE, l > 0);
        if (l == 0) {
            check_weight(&lw->ffn.gate_proj, 192, 96, "gate_proj");
            check_weight(&lw->ffn.down_proj, 96, 192, "down_proj");
        } else {
            check_weight(&lw->ffn.router, 6, 96, "router");
            cr_assert(lw->ffn.router_bias);
            for (int e = 0; e < 6; e++) {
                check_weight(&lw->ffn.w1[e], 48, 96, "w1");
                check_weight(&lw->ffn.w3[e], 48, 96, "w3");
                check_weight(&lw->ffn.w2[e], 96, 48, "w2");
            }
            check_weight(&lw->ffn.sh_gate, 48, 96, "sh_gate");
            check_weight(&lw->ffn.sh_down, 96, 48, "sh_down");
        }
    }
    /* small vectors are exact float32 copies, A_log [1,1,3,1] -> [3] and
     * conv [96,1,4] -> [96,4] keep their order */
    const float *a = file_floats(m, "model.layers.1.self_attn.A_log");
    cr_assert_eq(memcmp(m->layers[1].kda.A_log, a, 3 * sizeof(float)), 0);
    const float *conv = file_floats(m, "model.layers.2.self_attn.v_conv1d.weight");
    cr_assert_eq(memcmp(m->layers[2].kda.v_conv, conv, 96 * 4 * sizeof(float)), 0);
    const float *bias =
        file_floats(m, "model.layers.2.block_sparse_moe.gate.e_score_correction_bias");
    cr_assert_eq(memcmp(m->layers[2].ffn.router_bias, bias, 6 * sizeof(float)), 0);
    const float *nw = file_floats(m, "model.norm.weight");
    cr_assert_eq(memcmp(m->final_norm, nw, 96 * sizeof(float)), 0);
    /* the weight views point into the mapping, not into copies */
    cr_assert_eq(m->layers[0].kda.q_proj.data,
                 eng_st_find(m->shards[0], "model.layers.0.self_attn.q_proj.weight")->data);
    eng_model_free(m);
}

Test(model_load, golden_micro_hybrid) {
    eng_model_params p = no_cache();
    eng_model *m = load_ok(TMU_MICRO_HYBRID, &p);
    const eng_config *c = eng_model_config(m);
    cr_assert_eq(c->n_mla_layers, 1);
    const eng_layer_weights *lw = &m->layers[2];
    cr_assert_eq(lw->kind, ENG_LAYER_MLA);
    check_weight(&lw->mla.q_proj, 96, 64, "q_proj");
    cr_assert_null(lw->mla.q_a_proj.data);
    cr_assert_null(lw->mla.q_a_layernorm);
    check_weight(&lw->mla.kv_a_proj_with_mqa, 40, 64, "kv_a_proj_with_mqa");
    check_weight(&lw->mla.kv_b_proj, 128, 32, "kv_b_proj");
    check_weight(&lw->mla.o_proj, 64, 64, "o_proj");
    cr_assert(lw->mla.kv_a_layernorm);
    const float *kvn = file_floats(m, "model.layers.2.self_attn.kv_a_layernorm.weight");
    cr_assert_eq(memcmp(lw->mla.kv_a_layernorm, kvn, 32 * sizeof(float)), 0);
    cr_assert_eq(m->layers[3].kind, ENG_LAYER_KDA);
    cr_assert_eq(m->small_f32_used, m->small_f32_cap);
    eng_model_free(m);
}

Test(model_load, free_null_and_bad_arguments) {
    eng_model_free(NULL);
    eng_model *m = (eng_model *)0x1;
    kds_err err = {0};
    cr_assert_eq(eng_model_load(NULL, NULL, &m, &err), KDS_INVALID_ARG);
    cr_assert_null(m);
    cr_assert_eq(eng_model_load("/nonexistent/kds-model", NULL, &m, &err), KDS_NOT_FOUND);
    cr_assert(strstr(err.msg, "/nonexistent/kds-model/config.json"), "%s", err.msg);
    cr_assert_null(m);
}

Test(model_load, fingerprint_stable_and_cached) {
    char *tmp = tmu_mkdtemp();
    cr_assert(tmp);
    eng_model_params p = no_cache();
    eng_model *a = load_ok(TMU_MICRO_HYBRID, &p), *b = load_ok(TMU_MICRO_HYBRID, &p);
    cr_assert_str_eq(eng_model_fingerprint(a), eng_model_fingerprint(b));
    eng_model *k = load_ok(TMU_MICRO_KDA, &p);
    cr_assert_str_neq(eng_model_fingerprint(a), eng_model_fingerprint(k));
    eng_model_free(k);

    /* with a cache: the first load writes it, the second reads it */
    eng_model_params pc = eng_model_default_params();
    pc.cache_dir = tmp;
    eng_model *c1 = load_ok(TMU_MICRO_HYBRID, &pc);
    cr_assert_str_eq(eng_model_fingerprint(c1), eng_model_fingerprint(a));
    char *fpdir = tmu_path(tmp, "fingerprints");
    struct stat st;
    cr_assert_eq(stat(fpdir, &st), 0, "no cache directory %s", fpdir);
    eng_model *c2 = load_ok(TMU_MICRO_HYBRID, &pc);
    cr_assert_str_eq(eng_model_fingerprint(c2), eng_model_fingerprint(a));
    eng_model_free(c1);
    eng_model_free(c2);

    /* a damaged cache entry is ignored, not believed */
    char cmd[512];
    snprintf(cmd, sizeof cmd, "for f in %s/*; do echo 'zz not a fingerprint' > $f; done", fpdir);
    cr_assert_eq(system(cmd), 0);
    eng_model *c3 = load_ok(TMU_MICRO_HYBRID, &pc);
    cr_assert_str_eq(eng_model_fingerprint(c3), eng_model_fingerprint(a));
    eng_model_free(c3);

    /* an unwritable cache directory is not an error */
    eng_model_params pr = eng_model_default_params();
    pr.cache_dir = "/proc/kdaserve-cannot-write-here";
    eng_model *c4 = load_ok(TMU_MICRO_HYBRID, &pr);
    cr_assert_str_eq(eng_model_fingerprint(c4), eng_model_fingerprint(a));
    eng_model_free(c4);

    eng_model_free(a);
    eng_model_free(b);
    free(fpdir);
    tmu_rmtree(tmp);
    free(tmp);
}

/* Flip one byte of a file in place and move its mtime on, as an edit would. */
static void flip_byte(const char *path, long offset_from_end) {
    size_t n = 0;
    char *buf = tmu_read(path, &n);
    cr_assert(buf && (size_t)offset_from_end <= n);
    buf[n - (size_t)offset_from_end] ^= 0x01;
    cr_assert(tmu_write(path, buf, n));
    free(buf);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    struct timespec ts[2] = {st.st_atim, st.st_mtim};
    ts[1].tv_sec += 2;
    cr_assert_eq(utimensat(AT_FDCWD, path, ts, 0), 0);
}

Test(model_load, fingerprint_follows_weights_and_config) {
    char *tmp = tmu_mkdtemp(), *cache = tmu_mkdtemp();
    cr_assert(tmp && cache);
    cr_assert(tmu_copy_model(TMU_MICRO_KDA, tmp));
    eng_model_params pn = no_cache(), pc = eng_model_default_params();
    pc.cache_dir = cache;
    for (int cached = 0; cached < 2; cached++) {
        const eng_model_params *p = cached ? &pc : &pn;
        eng_model *m0 = load_ok(TMU_MICRO_KDA, &pn);
        eng_model *m1 = load_ok(tmp, p);
        /* same bytes in another directory: same fingerprint */
        cr_assert_str_eq(eng_model_fingerprint(m0), eng_model_fingerprint(m1));
        char *st = tmu_path(tmp, "model.safetensors");
        flip_byte(st, 1 + cached); /* one of the last data bytes */
        eng_model *m2 = load_ok(tmp, p);
        cr_assert_str_neq(eng_model_fingerprint(m1), eng_model_fingerprint(m2),
                          "a flipped weight byte kept the fingerprint (cached=%d)", cached);
        /* config: a change that parses the same still changes the hash */
        char *cfg = tmu_path(tmp, "config.json");
        cr_assert(tmu_replace_in_file(cfg, "\"use_cache\": true", "\"use_cache\": false"));
        struct stat sb;
        cr_assert_eq(stat(cfg, &sb), 0);
        struct timespec ts[2] = {sb.st_atim, sb.st_mtim};
        ts[1].tv_sec += 2;
        utimensat(AT_FDCWD, cfg, ts, 0);
        eng_model *m3 = load_ok(tmp, p);
        cr_assert_str_neq(eng_model_fingerprint(m2), eng_model_fingerprint(m3));
        cr_assert(tmu_replace_in_file(cfg, "\"use_cache\": false", "\"use_cache\": true"));
        flip_byte(st, 1 + cached); /* restore */
        eng_model *m4 = load_ok(tmp, p);
        cr_assert_str_eq(eng_model_fingerprint(m4), eng_model_fingerprint(m0));
        eng_model_free(m0);
        eng_model_free(m1);
        eng_model_free(m2);
        eng_model_free(m3);
        eng_model_free(m4);
        free(st);
        free(cfg);
    }
    tmu_rmtree(tmp);
    tmu_rmtree(cache);
    free(tmp);
    free(cache);
}

/* Split the golden micro-hybrid into `parts` shards with an index. */
static void write_sharded(const char *dst, int parts, const char *index_text_override) {
    eng_st_file *f = NULL;
    cr_assert_eq(eng_st_open(TMU_MICRO_HYBRID "/model.safetensors", &f, NULL), KDS_OK);
    size_t n = eng_st_count(f);
    eng_st_out_tensor *out = calloc(n, sizeof *out);
    char *index = malloc(64 * 1024);
    size_t o = (size_t)snprintf(index, 64 * 1024, "{\"metadata\": {}, \"weight_map\": {");
    for (int s = 0; s < parts; s++) {
        size_t b = n * (size_t)s / (size_t)parts, e = n * (size_t)(s + 1) / (size_t)parts;
        char name[64];
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, parts);
        for (size_t i = b; i < e; i++) {
            const eng_st_tensor *t = eng_st_at(f, i);
            out[i - b] = (eng_st_out_tensor){
                .name = t->name, .dtype = t->dtype, .n_dims = t->n_dims, .data = t->data};
            memcpy(out[i - b].shape, t->shape, sizeof t->shape);
            o += (size_t)snprintf(index + o, 64 * 1024 - o, "%s\"%s\": \"%s\"", i ? ", " : "",
                                  t->name, name);
        }
        char *path = tmu_path(dst, name);
        cr_assert_eq(eng_st_write(path, out, e - b, NULL, NULL), KDS_OK);
        free(path);
    }
    snprintf(index + o, 64 * 1024 - o, "}}");
    char *ip = tmu_path(dst, "model.safetensors.index.json");
    const char *text = index_text_override ? index_text_override : index;
    cr_assert(tmu_write(ip, text, strlen(text)));
    char *cfg = tmu_path(dst, "config.json");
    cr_assert(tmu_copy(TMU_MICRO_HYBRID "/config.json", cfg));
    free(cfg);
    free(ip);
    free(index);
    free(out);
    eng_st_close(f);
}

Test(model_load, sharded_matches_single_file) {
    char *tmp = tmu_mkdtemp();
    write_sharded(tmp, 3, NULL);
    eng_model_params p = no_cache();
    eng_model *s = load_ok(tmp, &p), *one = load_ok(TMU_MICRO_HYBRID, &p);
    cr_assert_eq(s->n_shards, 3);
    cr_assert_str_eq(eng_model_fingerprint(s), eng_model_fingerprint(one));
    cr_assert_eq(memcmp(s->layers[3].kda.A_log, one->layers[3].kda.A_log, 4 * sizeof(float)), 0);
    eng_model_free(s);
    eng_model_free(one);
    tmu_rmtree(tmp);
    free(tmp);
}

/* Rewrite edits used by the layout tests. */
static bool flatten_a_log(void *user, eng_st_out_tensor *t) {
    (void)user;
    if (strstr(t->name, "A_log")) {
        t->n_dims = 1;
        t->shape[0] = t->shape[2]; /* [1, 1, HV, 1] -> [HV] */
    }
    if (strstr(t->name, "conv1d")) {
        t->n_dims = 2;
        t->shape[1] = t->shape[2]; /* [C, 1, W] -> [C, W] */
    }
    return true;
}

static bool drop_lm_head(void *user, eng_st_out_tensor *t) {
    (void)user;
    return strcmp(t->name, "lm_head.weight") != 0;
}

Test(model_load, layout_variants) {
    char *tmp = tmu_mkdtemp();
    eng_model_params p = no_cache();
    cr_assert(tmu_rewrite(TMU_MICRO_HYBRID, tmp, "model.safetensors", flatten_a_log, NULL));
    eng_model *m = load_ok(tmp, &p), *ref = load_ok(TMU_MICRO_HYBRID, &p);
    cr_assert_eq(memcmp(m->layers[0].kda.A_log, ref->layers[0].kda.A_log, 4 * sizeof(float)), 0);
    cr_assert_eq(memcmp(m->layers[3].kda.k_conv, ref->layers[3].kda.k_conv, 64 * 4 * sizeof(float)),
                 0);
    eng_model_free(m);

    /* tied embeddings: no lm_head tensor, the embedding serves */
    cr_assert(tmu_rewrite(TMU_MICRO_HYBRID, tmp, "model.safetensors", drop_lm_head, NULL));
    char *cfg = tmu_path(tmp, "config.json");
    cr_assert(tmu_replace_in_file(cfg, "\"tie_word_embeddings\": false",
                                  "\"tie_word_embeddings\": true"));
    m = load_ok(tmp, &p);
    cr_assert_eq(m->lm_head.data, m->embed_tokens.data);
    eng_model_free(m);
    eng_model_free(ref);
    free(cfg);
    tmu_rmtree(tmp);
    free(tmp);
}

/* The logits of one prefill of micro-hybrid loaded with `mode`, into out
 * [vocab]; *resident gets eng_model_resident_bytes. */
static void prefill_logits(eng_weights_mode mode, float *out, int vocab, size_t *resident) {
    eng_model_params p = no_cache();
    p.weights = mode;
    eng_model *m = load_ok(TMU_MICRO_HYBRID, &p);
    *resident = eng_model_resident_bytes(m);
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    eng_ctx *c = NULL;
    eng_seq *s = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_ctx_create(m, &cp, &c, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_seq_create(m, 1, &s, &err), KDS_OK, "%s", err.msg);
    const int32_t ids[] = {1, 7, 42, 3, 99, 5, 64, 2};
    cr_assert_eq(eng_prefill(c, s, ids, 8, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    memcpy(out, eng_seq_logits(s), (size_t)vocab * sizeof(float));
    eng_seq_free(s);
    eng_ctx_free(c);
    eng_model_free(m);
}

/* Weights read into memory (ENG_WEIGHTS_RESIDENT) are the mapped file's
 * bytes at the same offsets from a 64-byte line (the loops that read rows
 * off the lines must take the same path), and give the mapped model's
 * logits, bit for bit. */
Test(model_load, resident_weights_match_the_mapping) {
    const char *path = TMU_MICRO_HYBRID "/model.safetensors";
    eng_st_file *mf = NULL, *rf = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_st_open(path, &mf, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_st_open_resident(path, false, &rf, &err), KDS_OK, "%s", err.msg);
    cr_assert(eng_st_resident(rf) && !eng_st_resident(mf));
    cr_assert_eq(eng_st_bytes(rf), eng_st_bytes(mf));
    cr_assert_eq(eng_st_count(rf), eng_st_count(mf));
    for (size_t i = 0; i < eng_st_count(mf); i++) {
        const eng_st_tensor *a = eng_st_at(mf, i), *b = eng_st_at(rf, i);
        cr_assert_str_eq(a->name, b->name);
        cr_assert_eq(a->n_bytes, b->n_bytes);
        cr_assert_neq(a->data, b->data, "%s: the resident copy points into the mapping", a->name);
        cr_assert_eq((uintptr_t)a->data % 64, (uintptr_t)b->data % 64, "%s: off its line", a->name);
        cr_assert_eq(memcmp(a->data, b->data, a->n_bytes), 0, "%s: bytes differ", a->name);
    }
    eng_st_close(rf);
    eng_st_close(mf);

    eng_model_params p = no_cache();
    eng_model *m = load_ok(TMU_MICRO_HYBRID, &p);
    const int vocab = eng_model_config(m)->vocab_size;
    eng_model_free(m);
    float *lm = malloc((size_t)vocab * sizeof(float)), *lr = malloc((size_t)vocab * sizeof(float));
    cr_assert(lm && lr);
    size_t res_m = 1, res_r = 0;
    prefill_logits(ENG_WEIGHTS_MAPPED, lm, vocab, &res_m);
    prefill_logits(ENG_WEIGHTS_RESIDENT, lr, vocab, &res_r);
    cr_assert_eq(res_m, 0, "mapped, yet %zu bytes read into memory", res_m);
    cr_assert_gt(res_r, 0, "resident, yet nothing read into memory");
    cr_assert_eq(memcmp(lm, lr, (size_t)vocab * sizeof(float)), 0, "logits differ");
    free(lm);
    free(lr);
}

/* A file whose read ends before the size it gave (truncated while being
 * read) is refused naming the byte, with nothing left behind. A sysfs
 * attribute is such a file: it reports 4096 bytes and reads a few. */
Test(model_load, resident_read_that_ends_early_is_refused) {
    const char *path = "/sys/kernel/mm/transparent_hugepage/enabled";
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size != 4096)
        cr_skip_test("%s: no sysfs attribute of 4096 bytes here", path);
    eng_st_file *f = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_st_open_resident(path, false, &f, &err), KDS_IO, "%s", err.msg);
    cr_assert_null(f);
    cr_assert(strstr(err.msg, path) && strstr(err.msg, "the file ended at byte ") &&
                  strstr(err.msg, " of 4096 while being read"),
              "%s", err.msg);
}

/* A damaged file read into memory is refused as the mapped one is, and
 * KDS_WEIGHTS takes only auto, mapped or resident (AUTO reads it). */
Test(model_load, resident_refuses_what_the_mapping_refuses) {
    char *tmp = tmu_mkdtemp();
    char *path = tmu_path(tmp, "model.safetensors");
    size_t len = 0;
    char *bytes = tmu_read(TMU_MICRO_HYBRID "/model.safetensors", &len);
    cr_assert(bytes && len > 4096);
    cr_assert(tmu_write(path, bytes, len / 2)); /* truncated: the data runs past the end */
    eng_st_file *f = NULL;
    kds_err em = {0}, er = {0};
    const kds_status sm = eng_st_open(path, &f, &em);
    const kds_status sr = eng_st_open_resident(path, false, &f, &er);
    cr_assert_neq(sm, KDS_OK);
    cr_assert_eq(sr, sm, "resident: %s; mapped: %s", er.msg, em.msg);
    cr_assert_str_eq(er.msg, em.msg);
    cr_assert_null(f);
    free(bytes);

    cr_assert_eq(setenv("KDS_WEIGHTS", "in-ram", 1), 0);
    eng_model_params p = no_cache();
    eng_model *m = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_model_load(TMU_MICRO_HYBRID, &p, &m, &err), KDS_INVALID_ARG);
    cr_assert_null(m);
    cr_assert(strstr(err.msg, "KDS_WEIGHTS=in-ram") && strstr(err.msg, "resident"), "%s",
              err.msg);
    cr_assert_eq(setenv("KDS_WEIGHTS", "resident", 1), 0);
    m = load_ok(TMU_MICRO_HYBRID, &p);
    cr_assert_gt(eng_model_resident_bytes(m), 0, "KDS_WEIGHTS=resident not taken");
    eng_model_free(m);
    unsetenv("KDS_WEIGHTS");
    tmu_rmtree(tmp);
    free(tmp);
    free(path);
}
