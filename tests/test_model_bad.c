/*
 * Model loading refuses bad input with the right status and a message that
 * names the offending file, tensor or field: damaged safetensors, bad
 * config.json, missing or misshapen tensors, inconsistent configs, broken
 * shard indexes. Random damage must never crash the loader.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "eng.h"
#include "eng_model.h"
#include "eng_safetensors.h"
#include "test_model_util.h"

typedef struct case_dir {
    char *dir;
    char *st;  /* dir/model.safetensors */
    char *cfg; /* dir/config.json */
} case_dir;

/* A temp dir holding a copy of the golden micro-hybrid. */
static case_dir make_case(void) {
    case_dir c;
    c.dir = tmu_mkdtemp();
    cr_assert(c.dir);
    cr_assert(tmu_copy_model(TMU_MICRO_HYBRID, c.dir));
    c.st = tmu_path(c.dir, "model.safetensors");
    c.cfg = tmu_path(c.dir, "config.json");
    return c;
}

static void drop_case(case_dir *c) {
    tmu_rmtree(c->dir);
    free(c->dir);
    free(c->st);
    free(c->cfg);
}

/* Load must fail with `status`, a message containing every needle (up to
 * 3, NULL-terminated early), and no model. */
static void expect_refusal(const char *dir, kds_status status, const char *n1, const char *n2,
                           const char *n3) {
    eng_model_params p = eng_model_default_params();
    p.no_fingerprint_cache = true;
    eng_model *m = (eng_model *)0x1;
    kds_err err = {0};
    kds_status rc = eng_model_load(dir, &p, &m, &err);
    cr_assert_eq(rc, status, "got %s (%s), want %s", kds_status_str(rc), err.msg,
                 kds_status_str(status));
    cr_assert_eq(err.status, status);
    cr_assert_null(m);
    const char *needles[3] = {n1, n2, n3};
    for (int i = 0; i < 3 && needles[i]; i++)
        cr_assert(strstr(err.msg, needles[i]), "message '%s' lacks '%s'", err.msg, needles[i]);
}

/* Replace model.safetensors with a hand-made file. */
static void bad_header_case(const char *header, size_t data_len, kds_status status,
                            const char *needle) {
    case_dir c = make_case();
    cr_assert(tmu_write_st(c.st, header, data_len));
    expect_refusal(c.dir, status, needle, "model.safetensors", NULL);
    drop_case(&c);
}

Test(model_bad, truncated_safetensors) {
    case_dir c = make_case();
    size_t n = 0;
    char *buf = tmu_read(c.st, &n);
    cr_assert(tmu_write(c.st, buf, n - 100));
    expect_refusal(c.dir, KDS_BAD_FORMAT, "truncated", "model.safetensors", NULL);
    cr_assert(tmu_write(c.st, buf, 5));
    expect_refusal(c.dir, KDS_BAD_FORMAT, "too short", NULL, NULL);
    free(buf);
    drop_case(&c);
}

Test(model_bad, header_length_past_end) {
    case_dir c = make_case();
    unsigned char buf[64] = {0};
    uint64_t hlen = (uint64_t)1 << 40;
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(hlen >> (8 * i));
    memcpy(buf + 8, "{}", 2);
    cr_assert(tmu_write(c.st, buf, sizeof buf));
    expect_refusal(c.dir, KDS_BAD_FORMAT, "header length", "past the end", NULL);
    drop_case(&c);
}

Test(model_bad, malformed_headers) {
    bad_header_case("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
                    " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}",
                    12, KDS_BAD_FORMAT, "overlap");
    bad_header_case("{\"a\": {\"dtype\": \"Q4_K\", \"shape\": [2], \"data_offsets\": [0, 8]}}", 8,
                    KDS_BAD_FORMAT, "unknown dtype 'Q4_K'");
    bad_header_case("{\"a\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 8]}}", 8,
                    KDS_BAD_FORMAT, "shape needs 12 bytes");
    bad_header_case("{\"a\": {\"dtype\": \"F32\", \"shape\": [2, -1], \"data_offsets\": [0, 8]}}",
                    8, KDS_BAD_FORMAT, "bad shape");
    bad_header_case("{not json at all", 8, KDS_BAD_FORMAT, "not a JSON object");
    bad_header_case("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}", 4,
                    KDS_BAD_FORMAT, "past the");
    /* the same tensor twice (cJSON keeps duplicate keys) */
    bad_header_case("{\"model.norm.weight\": {\"dtype\": \"F32\", \"shape\": [1], "
                    "\"data_offsets\": [0, 4]}, \"model.norm.weight\": {\"dtype\": \"F32\", "
                    "\"shape\": [1], \"data_offsets\": [4, 8]}}",
                    8, KDS_BAD_FORMAT, "appears twice");
    /* a BF16 tensor after 3 bytes of U8: it would be read through
     * misaligned loads in place (the fuzz target's UBSan finding) */
    bad_header_case("{\"s\": {\"dtype\": \"U8\", \"shape\": [3], \"data_offsets\": [0, 3]}, "
                    "\"model.norm.weight\": {\"dtype\": \"BF16\", \"shape\": [2], "
                    "\"data_offsets\": [3, 7]}}",
                    7, KDS_BAD_FORMAT, "not a multiple of its 2-byte element");
    /* a valid file that lacks the model's tensors */
    bad_header_case("{\"x\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}", 8,
                    KDS_NOT_FOUND, "model.embed_tokens.weight");
}

Test(model_bad, bad_config) {
    case_dir c = make_case();
    cr_assert(tmu_write(c.cfg, "{\"vocab_size\": 512,", 19));
    expect_refusal(c.dir, KDS_BAD_FORMAT, "config.json", "JSON", NULL);
    cr_assert(tmu_copy(TMU_MICRO_HYBRID "/config.json", c.cfg));
    cr_assert(
        tmu_replace_in_file(c.cfg, "\"num_experts_per_token\": 2", "\"num_experts_per_token\": 9"));
    expect_refusal(c.dir, KDS_INVALID_ARG, "num_experts_per_token", "config.json", NULL);
    cr_assert(tmu_copy(TMU_MICRO_HYBRID "/config.json", c.cfg));
    cr_assert(tmu_replace_in_file(c.cfg, "\"num_heads\": 4", "\"num_heads\": 3"));
    cr_assert(tmu_replace_in_file(c.cfg, "\"linear_attn_config\": {",
                                  "\"linear_attn_config\": {\"num_v_heads\": 4, "));
    expect_refusal(c.dir, KDS_INVALID_ARG, "num_v_heads", NULL, NULL);
    cr_assert(tmu_copy(TMU_MICRO_HYBRID "/config.json", c.cfg));
    cr_assert(tmu_replace_in_file(c.cfg, "\"full_attn_layers\": [\n      3\n    ]",
                                  "\"full_attn_layers\": []"));
    expect_refusal(c.dir, KDS_INVALID_ARG, "layer 3", "neither", NULL);
    cr_assert(tmu_copy(TMU_MICRO_HYBRID "/config.json", c.cfg));
    cr_assert(tmu_replace_in_file(c.cfg, "\"hidden_size\": 64", "\"hidden_size\": \"64\""));
    expect_refusal(c.dir, KDS_BAD_FORMAT, "hidden_size", NULL, NULL);
    unlink(c.cfg);
    expect_refusal(c.dir, KDS_NOT_FOUND, "config.json", NULL, NULL);
    drop_case(&c);
}

/* A config asking for far more experts than the checkpoint has tensors is
 * refused before the plan (which would list every expert's tensors, tens
 * of millions for a 3 KB config) is walked; the fuzz target for configs led
 * here, with a config that kept eng_model_load busy for 50 seconds. */
Test(model_bad, more_experts_than_tensors) {
    case_dir c = make_case();
    cr_assert(tmu_replace_in_file(c.cfg, "\"num_experts\": 8", "\"num_experts\": 65536"));
    expect_refusal(c.dir, KDS_NOT_FOUND, "implies at least 196608 tensors", "config.json", NULL);
    drop_case(&c);
}

/* Tensor edits: drop one, reshape one, retype one. */
typedef struct edit {
    const char *name;
    int mode; /* 0 drop, 1 reshape, 2 dtype I32 */
    int n_dims;
    int64_t shape[4];
} edit;

static bool apply_edit(void *user, eng_st_out_tensor *t) {
    const edit *e = user;
    if (strcmp(t->name, e->name) != 0) return true;
    if (e->mode == 0) return false;
    if (e->mode == 1) {
        t->n_dims = e->n_dims;
        memcpy(t->shape, e->shape, sizeof e->shape);
    } else {
        t->dtype = ENG_ST_I32; /* same size as F32 */
    }
    return true;
}

static void tensor_case(edit e, kds_status status, const char *n1, const char *n2, const char *n3) {
    case_dir c = make_case();
    cr_assert(tmu_rewrite(TMU_MICRO_HYBRID, c.dir, "model.safetensors", apply_edit, &e));
    expect_refusal(c.dir, status, n1, n2, n3);
    drop_case(&c);
}

Test(model_bad, missing_tensors) {
    const char *names[] = {"model.layers.1.self_attn.b_proj.weight",
                           "model.layers.3.self_attn.A_log",
                           "model.layers.2.self_attn.kv_a_layernorm.weight",
                           "model.layers.2.block_sparse_moe.experts.7.w2.weight",
                           "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight",
                           "model.layers.0.mlp.down_proj.weight",
                           "lm_head.weight",
                           "model.norm.weight"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        tensor_case((edit){names[i], 0, 0, {0}}, KDS_NOT_FOUND, names[i], "not found", NULL);
}

Test(model_bad, router_bias_is_optional) {
    case_dir c = make_case();
    edit e = {"model.layers.1.block_sparse_moe.gate.e_score_correction_bias", 0, 0, {0}};
    cr_assert(tmu_rewrite(TMU_MICRO_HYBRID, c.dir, "model.safetensors", apply_edit, &e));
    eng_model *m = NULL;
    kds_err err = {0};
    eng_model_params p = eng_model_default_params();
    p.no_fingerprint_cache = true;
    cr_assert_eq(eng_model_load(c.dir, &p, &m, &err), KDS_OK, "%s", err.msg);
    cr_assert_null(m->layers[1].ffn.router_bias);
    cr_assert(m->layers[2].ffn.router_bias);
    eng_model_free(m);
    drop_case(&c);
}

Test(model_bad, wrong_shapes_and_dtypes) {
    tensor_case((edit){"model.layers.0.self_attn.q_proj.weight", 1, 2, {32, 128}}, KDS_MISMATCH,
                "model.layers.0.self_attn.q_proj.weight", "[32, 128]", "expected [64, 64]");
    tensor_case((edit){"model.layers.0.self_attn.q_proj.weight", 1, 1, {4096}}, KDS_MISMATCH,
                "q_proj", "[4096]", "expected [64, 64]");
    tensor_case((edit){"model.layers.1.self_attn.dt_bias", 1, 2, {8, 8}}, KDS_MISMATCH, "dt_bias",
                "[8, 8]", "expected [64]");
    tensor_case((edit){"model.layers.1.self_attn.A_log", 1, 2, {2, 2}}, KDS_MISMATCH, "A_log",
                "expected [1, 1, 4, 1] or [4]", NULL);
    tensor_case((edit){"model.layers.3.self_attn.q_conv1d.weight", 1, 3, {64, 2, 2}}, KDS_MISMATCH,
                "q_conv1d", "expected [64, 1, 4] or [64, 4]", NULL);
    tensor_case((edit){"model.layers.2.self_attn.kv_b_proj.weight", 1, 2, {32, 128}}, KDS_MISMATCH,
                "kv_b_proj", "expected [128, 32]", NULL);
    tensor_case((edit){"model.layers.2.block_sparse_moe.experts.3.w1.weight", 1, 2, {64, 32}},
                KDS_MISMATCH, "experts.3.w1", "expected [32, 64]", NULL);
    tensor_case((edit){"model.embed_tokens.weight", 1, 2, {256, 128}}, KDS_MISMATCH, "embed_tokens",
                "expected [512, 64]", NULL);
    tensor_case((edit){"model.layers.0.self_attn.o_norm.weight", 2, 0, {0}}, KDS_MISMATCH, "o_norm",
                "dtype I32", NULL);
    tensor_case((edit){"model.layers.0.self_attn.v_proj.weight", 2, 0, {0}}, KDS_MISMATCH, "v_proj",
                "dtype I32", NULL);
}

/* Shard a copy of micro-hybrid into two files and an index; `index` is the
 * index text to write (NULL: the right one). Returns the case dir. */
static case_dir sharded_case(const char *index) {
    case_dir c = make_case();
    unlink(c.st);
    eng_st_file *f = NULL;
    cr_assert_eq(eng_st_open(TMU_MICRO_HYBRID "/model.safetensors", &f, NULL), KDS_OK);
    size_t n = eng_st_count(f), half = n / 2;
    eng_st_out_tensor *out = calloc(n, sizeof *out);
    size_t cap = 64 * 1024, o = 0;
    char *text = malloc(cap);
    o += (size_t)snprintf(text, cap, "{\"weight_map\": {");
    for (size_t i = 0; i < n; i++) {
        const eng_st_tensor *t = eng_st_at(f, i);
        out[i] = (eng_st_out_tensor){
            .name = t->name, .dtype = t->dtype, .n_dims = t->n_dims, .data = t->data};
        memcpy(out[i].shape, t->shape, sizeof t->shape);
        o += (size_t)snprintf(text + o, cap - o, "%s\"%s\": \"part-%d.safetensors\"", i ? ", " : "",
                              t->name, i < half ? 1 : 2);
    }
    snprintf(text + o, cap - o, "}}");
    char *p1 = tmu_path(c.dir, "part-1.safetensors"), *p2 = tmu_path(c.dir, "part-2.safetensors");
    cr_assert_eq(eng_st_write(p1, out, half, NULL, NULL), KDS_OK);
    cr_assert_eq(eng_st_write(p2, out + half, n - half, NULL, NULL), KDS_OK);
    char *ip = tmu_path(c.dir, "model.safetensors.index.json");
    cr_assert(tmu_write(ip, index ? index : text, strlen(index ? index : text)));
    free(ip);
    free(p1);
    free(p2);
    free(text);
    free(out);
    eng_st_close(f);
    return c;
}

Test(model_bad, sharded_index_problems) {
    /* the right index loads */
    case_dir c = sharded_case(NULL);
    eng_model *m = NULL;
    kds_err err = {0};
    eng_model_params p = eng_model_default_params();
    p.no_fingerprint_cache = true;
    cr_assert_eq(eng_model_load(c.dir, &p, &m, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(m->n_shards, 2);
    eng_model_free(m);
    /* a missing shard */
    char *p2 = tmu_path(c.dir, "part-2.safetensors");
    unlink(p2);
    expect_refusal(c.dir, KDS_NOT_FOUND, "part-2.safetensors", "index.json", NULL);
    free(p2);
    drop_case(&c);

    /* an entry naming a tensor its shard does not have (the embedding is
     * the first tensor of the golden file, so it went to part 1) */
    c = sharded_case("{\"weight_map\": {\"model.norm.weight\": \"part-1.safetensors\","
                     " \"model.embed_tokens.weight\": \"part-2.safetensors\"}}");
    expect_refusal(c.dir, KDS_NOT_FOUND, "no such tensor", "model.embed_tokens.weight",
                   "part-2.safetensors");
    drop_case(&c);

    /* malformed indexes */
    const char *bad[][2] = {{"[1, 2]", "not a JSON object"},
                            {"{\"metadata\": {}}", "weight_map"},
                            {"{\"weight_map\": {\"a\": 7}}", "shard file name"},
                            {"{\"weight_map\": {\"a\": \"../x.safetensors\"}}", "shard file name"},
                            {"{\"weight_map\": {\"a\": \"\"}}", "shard file name"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        c = sharded_case(bad[i][0]);
        expect_refusal(c.dir, KDS_BAD_FORMAT, bad[i][1], "index.json", NULL);
        drop_case(&c);
    }
}

Test(model_bad, no_weights) {
    case_dir c = make_case();
    unlink(c.st);
    expect_refusal(c.dir, KDS_NOT_FOUND, "no model.safetensors", NULL, NULL);
    drop_case(&c);
}

/* What is in a checkpoint file's place is not always a file: a FIFO (which
 * an open for reading would wait on forever), a directory, a symlink loop.
 * Each is refused at once, naming the path and what is wrong with it. */
Test(model_bad, not_regular_files, .timeout = 20) {
    case_dir c = make_case();
    unlink(c.cfg);
    cr_assert_eq(mkfifo(c.cfg, 0600), 0);
    expect_refusal(c.dir, KDS_IO, "config.json", "a FIFO", "not a regular file");
    unlink(c.cfg);
    cr_assert_eq(mkdir(c.cfg, 0700), 0);
    expect_refusal(c.dir, KDS_IO, "config.json", "a directory", NULL);
    rmdir(c.cfg);
    cr_assert_eq(symlink("config.json", c.cfg), 0); /* points at itself */
    expect_refusal(c.dir, KDS_IO, "config.json", "symbolic links", NULL);
    unlink(c.cfg);
    drop_case(&c);

    c = make_case();
    unlink(c.st);
    cr_assert_eq(mkfifo(c.st, 0600), 0);
    expect_refusal(c.dir, KDS_IO, "model.safetensors", "a FIFO", NULL);
    unlink(c.st);
    cr_assert_eq(mkdir(c.st, 0700), 0);
    expect_refusal(c.dir, KDS_IO, "model.safetensors", "a directory", NULL);
    rmdir(c.st);
    /* a loop is an error, not "no weights" */
    cr_assert_eq(symlink("model.safetensors", c.st), 0);
    expect_refusal(c.dir, KDS_IO, "model.safetensors", "symbolic links", NULL);
    unlink(c.st);
    drop_case(&c);

    /* a tokenizer that cannot be reached is not a model without one */
    c = make_case();
    char *tok = tmu_path(c.dir, "tiktoken.model");
    cr_assert_eq(symlink("tiktoken.model", tok), 0);
    expect_refusal(c.dir, KDS_IO, "tiktoken.model", "symbolic links", NULL);
    unlink(tok);
    cr_assert_eq(mkfifo(tok, 0600), 0);
    char *tcfg = tmu_path(c.dir, "tokenizer_config.json");
    cr_assert_eq(mkfifo(tcfg, 0600), 0);
    expect_refusal(c.dir, KDS_IO, "tokenizer_config.json", "a FIFO", NULL);
    unlink(tcfg);
    cr_assert(tmu_write(tcfg, "{}", 2));
    expect_refusal(c.dir, KDS_IO, "tiktoken.model", "a FIFO", NULL);
    free(tok);
    free(tcfg);
    drop_case(&c);
}

/* A header longer than safetensors allows is named as such, not as a
 * truncated file (a sparse file: no 100 MiB written). */
Test(model_bad, header_larger_than_the_format_allows) {
    case_dir c = make_case();
    unsigned char buf[8];
    uint64_t hlen = (uint64_t)101 << 20;
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(hlen >> (8 * i));
    cr_assert(tmu_write(c.st, buf, sizeof buf));
    cr_assert_eq(truncate(c.st, (off_t)102 << 20), 0);
    expect_refusal(c.dir, KDS_TOO_LARGE, "header of", "MiB", "model.safetensors");
    drop_case(&c);
}

Test(model_bad, random_damage_never_crashes) {
    case_dir c = make_case();
    size_t n = 0;
    unsigned char *orig = (unsigned char *)tmu_read(TMU_MICRO_HYBRID "/model.safetensors", &n);
    unsigned char *buf = malloc(n);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | orig[i];
    uint32_t seed = 12345;
    eng_model_params p = eng_model_default_params();
    p.no_fingerprint_cache = true;
    int refused = 0;
    for (int it = 0; it < 60; it++) {
        memcpy(buf, orig, n);
        size_t len = n;
        for (int k = 0; k < 4; k++) {
            seed = seed * 1664525u + 1013904223u;
            size_t at = (size_t)(seed >> 8) % (size_t)(8 + hlen); /* header bytes */
            seed = seed * 1664525u + 1013904223u;
            buf[at] = (unsigned char)(seed >> 24);
        }
        if (it % 3 == 0) {
            seed = seed * 1664525u + 1013904223u;
            len = (size_t)(seed >> 4) % n;
        }
        cr_assert(tmu_write(c.st, buf, len));
        eng_model *m = NULL;
        kds_err err = {0};
        kds_status rc = eng_model_load(c.dir, &p, &m, &err);
        if (rc != KDS_OK) {
            refused++;
            cr_assert_null(m);
            cr_assert(err.msg[0], "refusal %s without a message", kds_status_str(rc));
        }
        eng_model_free(m);
    }
    cr_assert_gt(refused, 0);
    free(buf);
    free(orig);
    drop_case(&c);
}

/* eng_st_write keeps every tensor aligned to its element size whatever
 * order it is given them in (widest first, as the safetensors library
 * does), so what it writes loads back in place; and every tensor whose
 * size is a multiple of 64 bytes (a weight matrix) starts on a 64-byte
 * line, however many odd-sized ones come before it in the caller's order
 * and however long the header. */
Test(model_bad, writer_aligns_mixed_dtypes) {
    char *dir = tmu_mkdtemp();
    cr_assert(dir);
    char *path = tmu_path(dir, "mixed.safetensors");
    const unsigned char u8[3] = {1, 2, 3};
    const uint16_t bf[3] = {0x3f80, 0x4000, 0x4040};
    const float f32[2] = {1.5f, -2.0f};
    uint16_t mat[3 * 32], mat2[64];
    for (int i = 0; i < 3 * 32; i++) mat[i] = (uint16_t)(0x3c00 + i);
    for (int i = 0; i < 64; i++) mat2[i] = (uint16_t)(0x4100 + i);
    const eng_st_out_tensor t[5] = {
        {.name = "codes", .dtype = ENG_ST_U8, .n_dims = 1, .shape = {3}, .data = u8},
        {.name = "norm", .dtype = ENG_ST_BF16, .n_dims = 1, .shape = {3}, .data = bf},
        {.name = "w", .dtype = ENG_ST_BF16, .n_dims = 2, .shape = {3, 32}, .data = mat},
        {.name = "bias", .dtype = ENG_ST_F32, .n_dims = 1, .shape = {2}, .data = f32},
        {.name = "w2", .dtype = ENG_ST_BF16, .n_dims = 2, .shape = {2, 32}, .data = mat2},
    };
    const char *const meta[] = {"note", "a header of an odd length", NULL};
    kds_err err = {0};
    cr_assert_eq(eng_st_write(path, t, 5, meta, &err), KDS_OK, "%s", err.msg);
    eng_st_file *f = NULL;
    cr_assert_eq(eng_st_open(path, &f, &err), KDS_OK, "%s", err.msg);
    for (size_t i = 0; i < eng_st_count(f); i++) {
        const eng_st_tensor *x = eng_st_at(f, i);
        cr_expect_eq((uintptr_t)x->data % eng_st_dtype_size(x->dtype), 0, "%s misaligned", x->name);
    }
    const eng_st_tensor *n = eng_st_find(f, "norm"), *b = eng_st_find(f, "bias"),
                        *c = eng_st_find(f, "codes"), *w = eng_st_find(f, "w"),
                        *w2 = eng_st_find(f, "w2");
    cr_assert(n && b && c && w && w2);
    /* the mapping starts on a page, so a pointer's offset is the file's */
    cr_expect_eq((uintptr_t)w->data % 64, 0, "w at %zu mod 64", (size_t)((uintptr_t)w->data % 64));
    cr_expect_eq((uintptr_t)w2->data % 64, 0, "w2 at %zu mod 64",
                 (size_t)((uintptr_t)w2->data % 64));
    cr_expect_eq(memcmp(w->data, mat, sizeof mat), 0);
    cr_expect_eq(memcmp(w2->data, mat2, sizeof mat2), 0);
    cr_expect_eq(memcmp(n->data, bf, sizeof bf), 0);
    cr_expect_eq(memcmp(b->data, f32, sizeof f32), 0);
    cr_expect_eq(memcmp(c->data, u8, sizeof u8), 0);
    eng_st_close(f);
    tmu_rmtree(dir);
    free(path);
    free(dir);
}
