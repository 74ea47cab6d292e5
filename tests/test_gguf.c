/*
 * `kdaserve export-gguf` (eng_model_export_gguf): a generated model written
 * as GGUF and read back by a small GGUF reader of this file's own (written
 * from ggml's docs/gguf.md, not from the writer): magic, version, every
 * key/value pair, tensor infos, alignment, and every tensor's bytes against
 * the safetensors checkpoint (the same bytes, or the stated transform:
 * widened to f32, -exp(A_log), experts stacked, kv_b_proj split per head);
 * the vocabulary of a tiktoken model with its merges rebuilt from the
 * ranks; models llama.cpp cannot run and bad arguments refused naming why.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "eng.h"
#include "eng_genmodel.h"
#include "eng_model.h"
#include "eng_safetensors.h"
#include "kern.h"
#include "test_helpers.h"
#include "test_model_util.h"

#define KDASERVE KDS_BINARY_DIR "/kdaserve"

/* ---- a GGUF reader: the whole file in memory, every read bounds-checked ---- */

typedef struct gkv {
    char key[128];
    uint32_t type;     /* value type */
    uint32_t arr_type; /* for arrays */
    uint64_t arr_n;
    uint64_t u;    /* integer / bool scalar */
    float f;       /* f32 scalar */
    const char *s; /* string scalar (not NUL-terminated) */
    uint64_t s_len;
    const unsigned char *arr; /* array payload */
} gkv;

typedef struct gti {
    char name[128];
    uint32_t n_dims;
    uint64_t ne[4];
    uint32_t type;
    uint64_t offset;
} gti;

typedef struct gfile {
    unsigned char *p;
    size_t len, pos;
    uint32_t version;
    uint64_t n_tensors, n_kv;
    gkv *kv;
    gti *ti;
    size_t data_start, alignment;
    bool ok;
} gfile;

static bool need(gfile *g, size_t n) {
    if (g->pos + n > g->len || g->pos + n < g->pos) g->ok = false;
    return g->ok;
}

static uint64_t rd(gfile *g, int bytes) {
    uint64_t v = 0;
    if (!need(g, (size_t)bytes)) return 0;
    for (int i = 0; i < bytes; i++)
        v |= (uint64_t)g->p[g->pos + (size_t)i] << (8 * i);
    g->pos += (size_t)bytes;
    return v;
}

static const char *rd_str(gfile *g, uint64_t *n) {
    *n = rd(g, 8);
    if (!need(g, (size_t)*n)) return NULL;
    const char *s = (const char *)g->p + g->pos;
    g->pos += (size_t)*n;
    return s;
}

static size_t scalar_size(uint32_t t) {
    static const size_t sz[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return t < 13 ? sz[t] : 0;
}

/* Step over one value of type t (arrays of arrays included). */
static void skip_value(gfile *g, uint32_t t) {
    if (t == 8) {
        uint64_t n;
        rd_str(g, &n);
    } else if (t == 9) {
        const uint32_t et = (uint32_t)rd(g, 4);
        const uint64_t n = rd(g, 8);
        for (uint64_t i = 0; i < n && g->ok; i++)
            skip_value(g, et);
    } else if (scalar_size(t)) {
        if (need(g, scalar_size(t))) g->pos += scalar_size(t);
    } else {
        g->ok = false;
    }
}

static void gguf_parse(gfile *g, const char *path) {
    memset(g, 0, sizeof *g);
    g->p = (unsigned char *)tmu_read(path, &g->len);
    cr_assert(g->p, "cannot read %s", path);
    g->ok = true;
    cr_assert(g->len >= 24 && memcmp(g->p, "GGUF", 4) == 0, "magic");
    g->pos = 4;
    g->version = (uint32_t)rd(g, 4);
    g->n_tensors = rd(g, 8);
    g->n_kv = rd(g, 8);
    cr_assert(g->n_kv < 100000 && g->n_tensors < 1000000);
    g->kv = calloc(g->n_kv + 1, sizeof *g->kv);
    g->ti = calloc(g->n_tensors + 1, sizeof *g->ti);
    g->alignment = 32;
    for (uint64_t i = 0; i < g->n_kv && g->ok; i++) {
        gkv *kv = &g->kv[i];
        uint64_t kn;
        const char *k = rd_str(g, &kn);
        cr_assert(g->ok && kn > 0 && kn < sizeof kv->key, "key %llu", (unsigned long long)i);
        memcpy(kv->key, k, kn);
        kv->type = (uint32_t)rd(g, 4);
        const size_t at = g->pos;
        if (kv->type == 8) {
            kv->s = rd_str(g, &kv->s_len);
        } else if (kv->type == 9) {
            kv->arr_type = (uint32_t)rd(g, 4);
            kv->arr_n = rd(g, 8);
            kv->arr = g->p + g->pos;
            for (uint64_t j = 0; j < kv->arr_n && g->ok; j++)
                skip_value(g, kv->arr_type);
        } else if (kv->type == 6) {
            uint32_t u = (uint32_t)rd(g, 4);
            memcpy(&kv->f, &u, 4);
        } else {
            cr_assert(scalar_size(kv->type), "%s: value type %u", kv->key, kv->type);
            kv->u = rd(g, (int)scalar_size(kv->type));
        }
        (void)at;
        if (!strcmp(kv->key, "general.alignment")) g->alignment = (size_t)kv->u;
    }
    for (uint64_t i = 0; i < g->n_tensors && g->ok; i++) {
        gti *t = &g->ti[i];
        uint64_t nn;
        const char *n = rd_str(g, &nn);
        cr_assert(g->ok && nn > 0 && nn < sizeof t->name);
        memcpy(t->name, n, nn);
        t->n_dims = (uint32_t)rd(g, 4);
        cr_assert(t->n_dims >= 1 && t->n_dims <= 4, "%s: %u dims", t->name, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++)
            t->ne[d] = rd(g, 8);
        t->type = (uint32_t)rd(g, 4);
        t->offset = rd(g, 8);
    }
    cr_assert(g->ok, "%s: truncated header", path);
    g->data_start = (g->pos + g->alignment - 1) / g->alignment * g->alignment;
    for (size_t i = g->pos; i < g->data_start; i++)
        cr_assert_eq(g->p[i], 0, "padding byte %zu", i);
}

static void gguf_free(gfile *g) {
    free(g->p);
    free(g->kv);
    free(g->ti);
}

static const gkv *kv_get(const gfile *g, const char *key) {
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (!strcmp(g->kv[i].key, key)) return &g->kv[i];
    return NULL;
}

static uint64_t kv_u(const gfile *g, const char *key) {
    const gkv *kv = kv_get(g, key);
    cr_assert(kv, "no key %s", key);
    cr_assert(kv->type == 4 || kv->type == 7, "%s: type %u", key, kv->type);
    return kv->u;
}

static const gti *ti_get(const gfile *g, const char *name) {
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (!strcmp(g->ti[i].name, name)) return &g->ti[i];
    return NULL;
}

static size_t ti_bytes(const gti *t) {
    size_t n = t->type == 0 ? 4 : 2;
    for (uint32_t d = 0; d < t->n_dims; d++)
        n *= (size_t)t->ne[d];
    return n;
}

static const unsigned char *ti_data(const gfile *g, const gti *t) {
    cr_assert_eq(t->offset % g->alignment, 0, "%s: offset %llu unaligned", t->name,
                 (unsigned long long)t->offset);
    cr_assert_leq(g->data_start + t->offset + ti_bytes(t), g->len, "%s: past the end", t->name);
    return g->p + g->data_start + t->offset;
}

/* The i-th string of a string array. */
static const char *arr_str(const gkv *kv, uint64_t i, uint64_t *n) {
    const unsigned char *p = kv->arr;
    for (uint64_t j = 0;; j++) {
        uint64_t len = 0;
        for (int b = 0; b < 8; b++)
            len |= (uint64_t)p[b] << (8 * b);
        if (j == i) {
            *n = len;
            return (const char *)p + 8;
        }
        p += 8 + len;
    }
}

static float st_f32(const eng_st_tensor *t, size_t i) {
    uint16_t u;
    if (t->dtype == ENG_ST_F32) {
        float f;
        memcpy(&f, (const char *)t->data + 4 * i, 4);
        return f;
    }
    memcpy(&u, (const char *)t->data + 2 * i, 2);
    uint32_t w = (uint32_t)u << 16;
    float f;
    memcpy(&f, &w, 4);
    cr_assert_eq(t->dtype, ENG_ST_BF16);
    return f;
}

static const eng_st_tensor *st(const eng_model *m, const char *fmt, int l) {
    char name[256];
    snprintf(name, sizeof name, fmt, l);
    for (int s = 0; s < m->n_shards; s++) {
        const eng_st_tensor *t = eng_st_find(m->shards[s], name);
        if (t) return t;
    }
    cr_assert_fail("no %s in the checkpoint", name);
    return NULL;
}

/* GGUF tensor `name` (formatted with l) holds src's bytes, with ne = its
 * shape reversed. */
static void expect_same(const gfile *g, const eng_model *m, const char *gname, const char *sname,
                        int l) {
    char n[128];
    snprintf(n, sizeof n, gname, l);
    const gti *t = ti_get(g, n);
    cr_assert(t, "no GGUF tensor %s", n);
    const eng_st_tensor *s = st(m, sname, l);
    cr_assert_eq(t->type, 30, "%s: type %u, want BF16", n, t->type);
    cr_assert_eq(t->n_dims, (uint32_t)s->n_dims, "%s", n);
    for (int d = 0; d < s->n_dims; d++)
        cr_assert_eq(t->ne[d], (uint64_t)s->shape[s->n_dims - 1 - d], "%s ne[%d]", n, d);
    cr_assert_eq(ti_bytes(t), s->n_bytes, "%s", n);
    cr_assert_eq(memcmp(ti_data(g, t), s->data, s->n_bytes), 0, "%s: bytes differ", n);
}

/* GGUF tensor holds src's elements as F32 (exactly: bf16 widens exactly). */
static void expect_f32(const gfile *g, const eng_model *m, const char *gname, const char *sname,
                       int l, bool neg_exp) {
    char n[128];
    snprintf(n, sizeof n, gname, l);
    const gti *t = ti_get(g, n);
    cr_assert(t, "no GGUF tensor %s", n);
    cr_assert_eq(t->type, 0, "%s: type %u, want F32", n, t->type);
    const eng_st_tensor *s = st(m, sname, l);
    cr_assert_eq(ti_bytes(t), 4 * s->n_elems, "%s", n);
    const unsigned char *p = ti_data(g, t);
    for (size_t i = 0; i < s->n_elems; i++) {
        float v;
        memcpy(&v, p + 4 * i, 4);
        const float want = neg_exp ? -expf(st_f32(s, i)) : st_f32(s, i);
        cr_assert_eq(v, want, "%s[%zu]: %g, want %g", n, i, v, want);
    }
}

static char *export(const char *dir) {
    char *out = tmu_path(dir, "model.gguf");
    kds_err err = {0};
    cr_assert_eq(eng_model_export_gguf(dir, out, false, &err), KDS_OK, "%s", err.msg);
    return out;
}

Test(gguf, hybrid_model_reads_back) {
    char *dir = NULL;
    kds_err err = {0};
    eng_model *m = tmu_gen_load("tiny-hybrid", 7, &dir, &err);
    cr_assert(m, "%s", err.msg);
    const eng_config *c = &m->cfg;
    char *path = export(dir);
    gfile g;
    gguf_parse(&g, path);
    cr_expect_eq(g.version, 3);
    cr_assert_eq(g.alignment, 32);

    /* keys: the ones llama.cpp's kimi-linear loader reads */
    const gkv *arch = kv_get(&g, "general.architecture");
    cr_assert(arch && arch->type == 8 && arch->s_len == 11 && !memcmp(arch->s, "kimi-linear", 11));
    cr_expect_eq(kv_u(&g, "kimi-linear.block_count"), (uint64_t)c->num_hidden_layers);
    cr_expect_eq(kv_u(&g, "kimi-linear.embedding_length"), (uint64_t)c->hidden_size);
    cr_expect_eq(kv_u(&g, "kimi-linear.attention.head_count"), (uint64_t)c->kda_num_heads);
    cr_expect_eq(kv_u(&g, "kimi-linear.kda.head_dim"), (uint64_t)c->kda_head_dim);
    cr_expect_eq(kv_u(&g, "kimi-linear.ssm.conv_kernel"), (uint64_t)c->short_conv_kernel_size);
    cr_expect_eq(kv_u(&g, "kimi-linear.expert_count"), (uint64_t)c->num_experts);
    cr_expect_eq(kv_u(&g, "kimi-linear.expert_used_count"), (uint64_t)c->num_experts_per_token);
    cr_expect_eq(kv_u(&g, "kimi-linear.expert_feed_forward_length"),
                 (uint64_t)c->moe_intermediate_size);
    cr_expect_eq(kv_u(&g, "kimi-linear.leading_dense_block_count"),
                 (uint64_t)c->first_k_dense_replace);
    cr_expect_eq(kv_u(&g, "kimi-linear.expert_gating_func"), 2, "sigmoid");
    cr_expect_eq(kv_u(&g, "kimi-linear.attention.kv_lora_rank"), (uint64_t)c->kv_lora_rank);
    cr_expect_eq(kv_u(&g, "kimi-linear.attention.key_length_mla"),
                 (uint64_t)(c->qk_nope_head_dim + c->qk_rope_head_dim));
    cr_expect_eq(kv_u(&g, "kimi-linear.attention.value_length_mla"), (uint64_t)c->v_head_dim);
    cr_expect_eq(kv_u(&g, "kimi-linear.rope.dimension_count"), (uint64_t)c->qk_rope_head_dim);
    cr_expect_eq(kv_u(&g, "general.file_type"), 32, "mostly bf16");
    const gkv *eps = kv_get(&g, "kimi-linear.attention.layer_norm_rms_epsilon");
    cr_assert(eps && eps->type == 6);
    cr_expect_eq(eps->f, c->rms_norm_eps);
    const gkv *scale = kv_get(&g, "kimi-linear.expert_weights_scale");
    cr_assert(scale && scale->type == 6);
    cr_expect_eq(scale->f, c->routed_scaling_factor);
    /* head_count_kv: 1 on MLA layers, 0 (recurrent) on KDA layers */
    const gkv *hkv = kv_get(&g, "kimi-linear.attention.head_count_kv");
    cr_assert(hkv && hkv->type == 9 && hkv->arr_type == 5 &&
              hkv->arr_n == (uint64_t)c->num_hidden_layers);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        int32_t v;
        memcpy(&v, hkv->arr + 4 * l, 4);
        cr_expect_eq(v, c->layer_kind[l] == ENG_LAYER_MLA ? 1 : 0, "layer %d", l);
    }
    /* the byte vocabulary: 256 byte tokens spelt GPT-2's way, specials
     * CONTROL, no merges */
    const gkv *model = kv_get(&g, "tokenizer.ggml.model"), *pre = kv_get(&g, "tokenizer.ggml.pre");
    cr_assert(model && model->s_len == 4 && !memcmp(model->s, "gpt2", 4));
    cr_assert(pre && pre->s_len == 7 && !memcmp(pre->s, "kimi-k2", 7));
    const gkv *toks = kv_get(&g, "tokenizer.ggml.tokens"),
              *types = kv_get(&g, "tokenizer.ggml.token_type"),
              *merges = kv_get(&g, "tokenizer.ggml.merges");
    cr_assert(toks && toks->arr_type == 8 && toks->arr_n == (uint64_t)c->vocab_size);
    cr_assert(types && types->arr_type == 5 && types->arr_n == (uint64_t)c->vocab_size);
    cr_assert(merges && merges->arr_type == 8);
    cr_expect_eq(merges->arr_n, 0);
    uint64_t n;
    const char *s = arr_str(toks, 'a', &n);
    cr_expect(n == 1 && s[0] == 'a');
    s = arr_str(toks, ' ', &n);
    cr_expect(n == 2 && !memcmp(s, "\xc4\xa0", 2), "space is U+0120");
    s = arr_str(toks, 0, &n);
    cr_expect(n == 2 && !memcmp(s, "\xc4\x80", 2), "byte 0 is U+0100");
    s = arr_str(toks, 255, &n);
    cr_expect(n == 2 && !memcmp(s, "\xc3\xbf", 2), "byte 255 is itself (U+00FF)");
    int32_t ty;
    memcpy(&ty, types->arr + 4 * 'a', 4);
    cr_expect_eq(ty, 1);
    memcpy(&ty, types->arr + 4 * 300, 4);
    cr_expect_eq(ty, 3, "a special is CONTROL");
    cr_expect_eq(kv_u(&g, "tokenizer.ggml.add_bos_token"), 0);

    /* every tensor: aligned, inside the file, not overlapping the next */
    for (uint64_t i = 0; i < g.n_tensors; i++) {
        (void)ti_data(&g, &g.ti[i]);
        if (i + 1 < g.n_tensors)
            cr_assert_leq(g.ti[i].offset + ti_bytes(&g.ti[i]), g.ti[i + 1].offset, "%s",
                          g.ti[i].name);
    }
    const gti *last = &g.ti[g.n_tensors - 1];
    cr_expect_leq(g.len - (g.data_start + last->offset + ti_bytes(last)), g.alignment - 1);

    /* tensors: same bytes, or the stated transform */
    expect_same(&g, m, "token_embd.weight", "model.embed_tokens.weight", 0);
    expect_same(&g, m, "output.weight", "lm_head.weight", 0);
    expect_f32(&g, m, "output_norm.weight", "model.norm.weight", 0, false);
    size_t expected = 3;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        expect_f32(&g, m, "blk.%d.attn_norm.weight", "model.layers.%d.input_layernorm.weight", l,
                   false);
        expect_f32(&g, m, "blk.%d.ffn_norm.weight",
                   "model.layers.%d.post_attention_layernorm.weight", l, false);
        expected += 2;
        if (c->layer_kind[l] == ENG_LAYER_KDA) {
            expect_same(&g, m, "blk.%d.attn_q.weight", "model.layers.%d.self_attn.q_proj.weight",
                        l);
            expect_same(&g, m, "blk.%d.attn_k.weight", "model.layers.%d.self_attn.k_proj.weight",
                        l);
            expect_same(&g, m, "blk.%d.attn_v.weight", "model.layers.%d.self_attn.v_proj.weight",
                        l);
            expect_same(&g, m, "blk.%d.ssm_f_a.weight", "model.layers.%d.self_attn.f_a_proj.weight",
                        l);
            expect_same(&g, m, "blk.%d.ssm_f_b.weight", "model.layers.%d.self_attn.f_b_proj.weight",
                        l);
            expect_same(&g, m, "blk.%d.ssm_beta.weight", "model.layers.%d.self_attn.b_proj.weight",
                        l);
            expect_same(&g, m, "blk.%d.ssm_g_a.weight", "model.layers.%d.self_attn.g_a_proj.weight",
                        l);
            expect_same(&g, m, "blk.%d.ssm_g_b.weight", "model.layers.%d.self_attn.g_b_proj.weight",
                        l);
            expect_same(&g, m, "blk.%d.attn_output.weight",
                        "model.layers.%d.self_attn.o_proj.weight", l);
            expect_f32(&g, m, "blk.%d.ssm_dt.bias", "model.layers.%d.self_attn.dt_bias", l, false);
            expect_f32(&g, m, "blk.%d.ssm_norm.weight", "model.layers.%d.self_attn.o_norm.weight",
                       l, false);
            expect_f32(&g, m, "blk.%d.ssm_a", "model.layers.%d.self_attn.A_log", l, true);
            char n[64];
            snprintf(n, sizeof n, "blk.%d.ssm_a", l);
            const gti *a = ti_get(&g, n);
            cr_expect(a->n_dims == 4 && a->ne[0] == 1 && a->ne[1] == (uint64_t)c->kda_num_heads);
            expect_f32(&g, m, "blk.%d.ssm_conv1d_q.weight",
                       "model.layers.%d.self_attn.q_conv1d.weight", l, false);
            expect_f32(&g, m, "blk.%d.ssm_conv1d_k.weight",
                       "model.layers.%d.self_attn.k_conv1d.weight", l, false);
            expect_f32(&g, m, "blk.%d.ssm_conv1d_v.weight",
                       "model.layers.%d.self_attn.v_conv1d.weight", l, false);
            snprintf(n, sizeof n, "blk.%d.ssm_conv1d_q.weight", l);
            const gti *cv = ti_get(&g, n);
            cr_expect(cv->n_dims == 4 && cv->ne[0] == (uint64_t)c->short_conv_kernel_size &&
                          cv->ne[1] == 1 &&
                          cv->ne[2] == (uint64_t)(c->kda_num_heads * c->kda_head_dim) &&
                          cv->ne[3] == 1,
                      "conv taps ne [W, 1, C, 1]");
            expected += 15;
        } else {
            expect_same(&g, m, "blk.%d.attn_q.weight", "model.layers.%d.self_attn.q_proj.weight",
                        l);
            expect_same(&g, m, "blk.%d.attn_kv_a_mqa.weight",
                        "model.layers.%d.self_attn.kv_a_proj_with_mqa.weight", l);
            expect_same(&g, m, "blk.%d.attn_output.weight",
                        "model.layers.%d.self_attn.o_proj.weight", l);
            expect_f32(&g, m, "blk.%d.attn_kv_a_norm.weight",
                       "model.layers.%d.self_attn.kv_a_layernorm.weight", l, false);
            /* k_b [H, r, nope] = kv_b rows (h, nope part) transposed; v_b [H, v, r] */
            const eng_st_tensor *kvb = st(m, "model.layers.%d.self_attn.kv_b_proj.weight", l);
            const int h = c->num_attention_heads, nope = c->qk_nope_head_dim, v = c->v_head_dim,
                      r = c->kv_lora_rank;
            char n[64];
            snprintf(n, sizeof n, "blk.%d.attn_k_b.weight", l);
            const gti *kb = ti_get(&g, n);
            snprintf(n, sizeof n, "blk.%d.attn_v_b.weight", l);
            const gti *vb = ti_get(&g, n);
            cr_assert(kb && vb);
            cr_assert(kb->n_dims == 3 && kb->ne[0] == (uint64_t)nope && kb->ne[1] == (uint64_t)r &&
                      kb->ne[2] == (uint64_t)h);
            cr_assert(vb->n_dims == 3 && vb->ne[0] == (uint64_t)r && vb->ne[1] == (uint64_t)v &&
                      vb->ne[2] == (uint64_t)h);
            const uint16_t *src = kvb->data, *pk = (const uint16_t *)ti_data(&g, kb),
                           *pv = (const uint16_t *)ti_data(&g, vb);
            for (int hh = 0; hh < h; hh++)
                for (int j = 0; j < r; j++) {
                    for (int x = 0; x < nope; x++)
                        cr_assert_eq(pk[((size_t)hh * r + j) * nope + x],
                                     src[((size_t)hh * (nope + v) + x) * r + j]);
                    for (int x = 0; x < v; x++)
                        cr_assert_eq(pv[((size_t)hh * v + x) * r + j],
                                     src[((size_t)hh * (nope + v) + nope + x) * r + j]);
                }
            expected += 6;
        }
        if (!c->layer_is_moe[l]) {
            expect_same(&g, m, "blk.%d.ffn_gate.weight", "model.layers.%d.mlp.gate_proj.weight", l);
            expect_same(&g, m, "blk.%d.ffn_up.weight", "model.layers.%d.mlp.up_proj.weight", l);
            expect_same(&g, m, "blk.%d.ffn_down.weight", "model.layers.%d.mlp.down_proj.weight", l);
            expected += 3;
            continue;
        }
        expect_f32(&g, m, "blk.%d.ffn_gate_inp.weight",
                   "model.layers.%d.block_sparse_moe.gate.weight", l, false);
        expect_f32(&g, m, "blk.%d.exp_probs_b.bias",
                   "model.layers.%d.block_sparse_moe.gate.e_score_correction_bias", l, false);
        expect_same(&g, m, "blk.%d.ffn_gate_shexp.weight",
                    "model.layers.%d.block_sparse_moe.shared_experts.gate_proj.weight", l);
        expect_same(&g, m, "blk.%d.ffn_up_shexp.weight",
                    "model.layers.%d.block_sparse_moe.shared_experts.up_proj.weight", l);
        expect_same(&g, m, "blk.%d.ffn_down_shexp.weight",
                    "model.layers.%d.block_sparse_moe.shared_experts.down_proj.weight", l);
        /* experts stacked [E, rows, cols] in expert order */
        static const char *const kinds[][2] = {{"gate", "w1"}, {"down", "w2"}, {"up", "w3"}};
        for (int k = 0; k < 3; k++) {
            char n[64];
            snprintf(n, sizeof n, "blk.%d.ffn_%s_exps.weight", l, kinds[k][0]);
            const gti *t = ti_get(&g, n);
            cr_assert(t, "no %s", n);
            cr_assert(t->n_dims == 3 && t->ne[2] == (uint64_t)c->num_experts && t->type == 30);
            const unsigned char *p = ti_data(&g, t);
            size_t at = 0;
            for (int e = 0; e < c->num_experts; e++) {
                char sn[128];
                snprintf(sn, sizeof sn, "model.layers.%%d.block_sparse_moe.experts.%d.%s.weight", e,
                         kinds[k][1]);
                const eng_st_tensor *s = st(m, sn, l);
                cr_assert(t->ne[0] == (uint64_t)s->shape[1] && t->ne[1] == (uint64_t)s->shape[0]);
                cr_assert_eq(memcmp(p + at, s->data, s->n_bytes), 0, "%s expert %d", n, e);
                at += s->n_bytes;
            }
            cr_assert_eq(at, ti_bytes(t));
        }
        expected += 8;
    }
    cr_expect_eq(g.n_tensors, expected, "every tensor llama.cpp loads, and no other");
    gguf_free(&g);
    eng_model_free(m);
    free(path);
    tmu_rmtree(dir);
    free(dir);
}

static void put(const char *dir, const char *name, const char *text) {
    char *p = tmu_path(dir, name);
    cr_assert(tmu_write(p, text, strlen(text)));
    free(p);
}

/* base64 of a short byte string */
static void b64(const unsigned char *p, size_t n, char *out) {
    static const char A[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0) |
                     (i + 2 < n ? p[i + 2] : 0);
        out[o++] = A[v >> 18];
        out[o++] = A[(v >> 12) & 63];
        out[o++] = i + 1 < n ? A[(v >> 6) & 63] : '=';
        out[o++] = i + 2 < n ? A[v & 63] : '=';
    }
    out[o] = 0;
}

Test(gguf, tiktoken_vocab_and_merges) {
    char *dir = NULL;
    kds_err err = {0};
    eng_model *m0 = tmu_gen_load("tiny", 1, &dir, &err);
    cr_assert(m0, "%s", err.msg);
    eng_model_free(m0);
    /* ranks: the 256 bytes, then "ab" 256, "cd" 257, "abcd" 258, "abc" 259,
     * " x" 260: tiktoken makes abcd from ab + cd, abc from ab + c */
    static char ranks[256 * 12 + 256];
    size_t o = 0;
    for (int b = 0; b < 256; b++) {
        unsigned char c = (unsigned char)b;
        char e[8];
        b64(&c, 1, e);
        o += (size_t)sprintf(ranks + o, "%s %d\n", e, b);
    }
    const char *more[] = {"ab", "cd", "abcd", "abc", " x"};
    for (int i = 0; i < 5; i++) {
        char e[16];
        b64((const unsigned char *)more[i], strlen(more[i]), e);
        o += (size_t)sprintf(ranks + o, "%s %d\n", e, 256 + i);
    }
    put(dir, "tiktoken.model", ranks);
    put(dir, "tokenizer_config.json",
        "{\"bos_token\": \"[BOS]\", \"eos_token\": \"[EOS]\", \"added_tokens_decoder\": {"
        "\"300\": {\"content\": \"[BOS]\", \"special\": true},"
        "\"301\": {\"content\": \"[EOS]\", \"special\": true}}}");
    char *path = export(dir);
    gfile g;
    gguf_parse(&g, path);
    const gkv *toks = kv_get(&g, "tokenizer.ggml.tokens"),
              *types = kv_get(&g, "tokenizer.ggml.token_type"),
              *merges = kv_get(&g, "tokenizer.ggml.merges");
    cr_assert(toks && types && merges);
    uint64_t n;
    const char *s = arr_str(toks, 258, &n);
    cr_expect(n == 4 && !memcmp(s, "abcd", 4));
    s = arr_str(toks, 260, &n);
    cr_expect(n == 3 && !memcmp(s, "\xc4\xa0x", 3), "' x' spelt with U+0120");
    s = arr_str(toks, 300, &n);
    cr_expect(n == 5 && !memcmp(s, "[BOS]", 5));
    int32_t ty;
    memcpy(&ty, types->arr + 4 * 300, 4);
    cr_expect_eq(ty, 3);
    memcpy(&ty, types->arr + 4 * 258, 4);
    cr_expect_eq(ty, 1);
    const char *want[] = {"a b", "c d", "ab cd", "ab c", "\xc4\xa0 x"};
    cr_assert_eq(merges->arr_n, 5);
    for (int i = 0; i < 5; i++) {
        s = arr_str(merges, (uint64_t)i, &n);
        cr_expect(n == strlen(want[i]) && !memcmp(s, want[i], n), "merge %d: '%.*s', want '%s'", i,
                  (int)n, s, want[i]);
    }
    gguf_free(&g);
    free(path);
    tmu_rmtree(dir);
    free(dir);
}

Test(gguf, refuses_what_llama_cpp_cannot_run) {
    char *dir = NULL;
    kds_err err = {0};
    eng_model *m = tmu_gen_load("tiny", 2, &dir, &err);
    cr_assert(m, "%s", err.msg);
    eng_model_free(m);
    char *q = tmu_mkdtemp(), *out = tmu_path(q, "x.gguf");
    eng_quantize_params qp = eng_quantize_default_params();
    qp.experts = KERN_Q8_0;
    cr_assert_eq(eng_model_quantize(dir, &qp, q, NULL, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(eng_model_export_gguf(q, out, false, &err), KDS_UNSUPPORTED);
    cr_expect(strstr(err.msg, "I8") && strstr(err.msg, "experts.0.w1"), "%s", err.msg);
    FILE *f = fopen(out, "rb");
    cr_expect_null(f, "nothing written");
    if (f) fclose(f);
    /* not a model directory */
    cr_expect_neq(eng_model_export_gguf("/nonexistent/model", out, false, &err), KDS_OK);
    cr_expect(strstr(err.msg, "/nonexistent/model"), "%s", err.msg);
    /* an unwritable destination: the error names it */
    cr_expect_eq(eng_model_export_gguf(dir, "/nonexistent/dir/x.gguf", false, &err), KDS_IO);
    cr_expect(strstr(err.msg, "/nonexistent/dir/x.gguf"), "%s", err.msg);
    /* the command: --out required, a directory refused, --help */
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s export-gguf --model %s 2>/dev/null", KDASERVE, dir);
    cr_expect_eq(th_system(cmd), 2);
    snprintf(cmd, sizeof cmd, "%s export-gguf --model %s --out %s 2>&1 | grep -q 'is a directory'",
             KDASERVE, dir, q);
    cr_expect_eq(th_system(cmd), 0);
    snprintf(cmd, sizeof cmd, "%s export-gguf --help | grep -q 'FILE.gguf'", KDASERVE);
    cr_expect_eq(th_system(cmd), 0);
    snprintf(cmd, sizeof cmd, "%s export-gguf --quiet --model %s --out %s", KDASERVE, dir, out);
    cr_expect_eq(th_system(cmd), 0);
    f = fopen(out, "rb");
    char magic[4] = {0};
    cr_expect(f && fread(magic, 1, 4, f) == 4 && !memcmp(magic, "GGUF", 4));
    if (f) fclose(f);
    free(out);
    tmu_rmtree(q);
    free(q);
    tmu_rmtree(dir);
    free(dir);
}

/* scripts/bench_vs.sh, one repeat of a 16-token prompt and 4 tokens on one
 * thread, with `extra` options, its output into `log`; it must succeed. */
static void run_bench_vs(const char *llama, const char *model, const char *gguf, const char *log,
                         const char *extra) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "%s/scripts/bench_vs.sh --kdaserve %s --llama-bench %s --model %s --gguf %s "
             "--repeats 1 --prompt 16 --gen 4 --threads 1 %s > %s 2>&1",
             KDS_SOURCE_DIR, KDASERVE, llama, model, gguf, extra, log);
    cr_assert_eq(th_system(cmd), 0, "%s", cmd);
}

/* scripts/bench_vs.sh against a stand-in llama-bench (the tests never use
 * llama.cpp): the GGUF is written when missing, both engines' best figures
 * are read and the ratio table printed. */
Test(gguf, bench_vs_script_with_a_stand_in) {
    char *dir = NULL;
    kds_err err = {0};
    eng_model *m = tmu_gen_load("tiny-hybrid", 4, &dir, &err);
    cr_assert(m, "%s", err.msg);
    eng_model_free(m);
    char *fake = tmu_path(dir, "llama-bench"), *gguf = tmu_path(dir, "m.gguf"),
         *log = tmu_path(dir, "vs.txt"), *args = tmu_path(dir, "args.txt");
    /* answers the tests it is asked for (pp with -n 0, tg at a depth with
     * -d, both otherwise) and notes its arguments */
    char script[1024];
    snprintf(script, sizeof script,
             "#!/bin/sh\n"
             "echo \"$*\" >> %s\n"
             "pp='{\"n_prompt\": 16, \"n_gen\": 0, \"avg_ts\": 90, \"samples_ts\": [ 80.5, 100 ]}'\n"
             "tg='{\"n_prompt\": 0, \"n_gen\": 4, \"avg_ts\": 9, \"samples_ts\": [ 10, 8 ]}'\n"
             "case \" $* \" in\n"
             "*' -d '*) echo \"$tg\" ;;\n"
             "*' -n 0 '*) echo \"$pp\" ;;\n"
             "*) echo \"$pp\"; echo \"$tg\" ;;\n"
             "esac\n",
             args);
    put(dir, "llama-bench", script);
    cr_assert_eq(chmod(fake, 0755), 0);
    run_bench_vs(fake, dir, gguf, log, "--rounds 2");
    char *out = tmu_read(log, NULL);
    cr_assert(out);
    cr_expect(strstr(out, "| prefill, 16 tokens (kdaserve exact) |") && strstr(out, "| 100.0 |"),
              "%s", out);
    /* kdaserve's --bf16 run where the build has bf16 dot products; where
     * it has none that run would be exact too, and is left out with a
     * line that says so */
    if (kern_bf16_products()) {
        cr_expect(strstr(out, "| prefill, 16 tokens (kdaserve --bf16: llama.cpp's precision) |"),
                  "%s", out);
        cr_expect(!strstr(out, "--bf16 left out"), "%s", out);
    } else {
        cr_expect(!strstr(out, "(kdaserve --bf16") &&
                      strstr(out, "kdaserve's --bf16 left out: this build has no bf16 dot products"),
                  "%s", out);
    }
    cr_expect(strstr(out, "| decode, 4 tokens after the prompt |") && strstr(out, "| 10.00 |"),
              "%s", out);
    cr_expect(strstr(out, "load average at end"), "%s", out);
    free(out);
    /* llama.cpp decodes at the prompt's depth, as kdaserve does */
    out = tmu_read(args, NULL);
    cr_assert(out);
    cr_expect(strstr(out, "-p 16 -n 0") && strstr(out, "-p 0 -n 4 -d 16"), "%s", out);
    free(out);
    cr_assert_eq(unlink(args), 0);
    /* --no-bf16: kdaserve's prefill once a round, exact */
    run_bench_vs(fake, dir, gguf, log, "--rounds 1 --no-bf16");
    out = tmu_read(log, NULL);
    cr_assert(out);
    cr_expect(strstr(out, "(kdaserve exact)") && !strstr(out, "--bf16: llama.cpp"), "%s", out);
    /* and its round line shows the run left out as "-", not as 0 tok/s
     * (" 0.000x" with its space: a real ratio such as 140.000x, from a
     * decode that timed at 1400.00 tok/s, ends in "0.000x" too) */
    cr_expect(!strstr(out, " 0.0 ") && !strstr(out, " 0.000x"), "%s", out);
    free(out);
    /* --no-depth: one llama-bench run a round, no -d */
    cr_assert_eq(unlink(args), 0);
    run_bench_vs(fake, dir, gguf, log, "--rounds 1 --no-bf16 --no-depth");
    out = tmu_read(args, NULL);
    cr_assert(out);
    cr_expect(strstr(out, "-p 16 -n 4") && !strstr(out, "-d "), "%s", out);
    free(out);
    out = tmu_read(log, NULL);
    cr_assert(out);
    cr_expect(strstr(out, "from an empty context (--no-depth)"), "%s", out);
    FILE *f = fopen(gguf, "rb");
    cr_expect(f, "the GGUF was written");
    if (f) fclose(f);
    free(out);
    /* a missing llama-bench is named */
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "%s/scripts/bench_vs.sh --kdaserve %s --llama-bench /nonexistent/llama-bench "
             "--model %s 2>&1 | grep -q '/nonexistent/llama-bench is not an executable'",
             KDS_SOURCE_DIR, KDASERVE, dir);
    cr_expect_eq(th_system(cmd), 0);
    free(fake);
    free(gguf);
    free(log);
    free(args);
    tmu_rmtree(dir);
    free(dir);
}
