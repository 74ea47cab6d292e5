/*
 * eng_gguf.c - a model directory written as one GGUF file for llama.cpp's
 * Kimi-Linear support (eng_genmodel.h: eng_model_export_gguf, `kdaserve
 * export-gguf`), so that the two engines can run the same weights.
 *
 * GGUF (ggml's docs/gguf.md), version 3, little-endian: magic "GGUF", u32
 * version, u64 tensor count, u64 key/value count; the key/value pairs (a
 * string key, a u32 value type, the value); the tensor infos (name, u32
 * n_dims, u64 ne[n_dims] fastest dimension first, u32 ggml type, u64 offset
 * into the data section); zero padding to general.alignment; the tensor
 * data, each tensor starting at a multiple of the alignment. A string is a
 * u64 byte count and the bytes (no NUL).
 *
 * What llama.cpp's loader expects of a kimi-linear file (its names, shapes
 * and metadata keys, learnt from its loader and converter; nothing here is
 * its code):
 *   - tensor names token_embd, output_norm, output, blk.N.attn_norm, ...; a
 *     HF matrix [rows, cols] is ggml ne [cols, rows] with the same bytes;
 *   - routed experts stacked into one [E, rows, cols] tensor per kind;
 *   - MLA kv_b_proj [H * (nope + v), rank] split per head into attn_k_b
 *     (transposed: [H, rank, nope]) and attn_v_b ([H, v, rank]);
 *   - conv taps [C, 1, W] as ne [W, 1, C, 1] (same bytes), A_log stored as
 *     -exp(A_log) ("ssm_a"), dt_bias as ssm_dt.bias;
 *   - vectors, norms, the router, conv taps and A_log in F32 (its CPU ops
 *     want them so; widening bf16 / f16 is exact); every other matrix in its
 *     stored dtype (BF16 stays BF16);
 *   - head_count_kv per layer: 1 for MLA layers (MLA runs as MQA over the
 *     latent), 0 for KDA layers (which marks them recurrent);
 *   - a GPT-2-style BPE vocabulary ("gpt2", pre-tokeniser "kimi-k2"): every
 *     rank's bytes in GPT-2's byte-to-unicode spelling, the merges rebuilt
 *     from the ranks, specials as CONTROL tokens. A byte-level model (no
 *     tiktoken.model) has 256 byte tokens and no merges, which tokenises
 *     text exactly as our byte tokenizer does.
 *
 * The file is written under a temporary name, fsync'd and renamed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "eng_genmodel.h"
#include "eng_model.h"
#include "eng_progress.h"
#include "eng_safetensors.h"
#include "eng_tokenizer.h"
#include "kds_buf.h"

#define GG_ALIGN 32
#define GG_MAX_NAME 96

/* ggml's tensor types, GGUF's value types and llama.cpp's token types */
enum { GGML_F32 = 0, GGML_F16 = 1, GGML_BF16 = 30 };
enum { GV_U32 = 4, GV_I32 = 5, GV_F32 = 6, GV_BOOL = 7, GV_STRING = 8, GV_ARRAY = 9 };
enum { TT_NORMAL = 1, TT_CONTROL = 3, TT_UNUSED = 5 };

/* How an output tensor's bytes come from the checkpoint. */
typedef enum gg_src {
    GG_COPY,    /* the source's bytes */
    GG_WIDEN,   /* the source's elements as f32 */
    GG_NEG_EXP, /* -exp(element) as f32 (A_log -> ssm_a) */
    GG_STACK,   /* the sources' bytes one after another (routed experts) */
    GG_K_B,     /* kv_b_proj's k rows per head, transposed */
    GG_V_B,     /* kv_b_proj's v rows per head */
} gg_src;

typedef struct gg_tensor {
    char name[GG_MAX_NAME];
    uint32_t type;
    uint32_t n_dims;
    uint64_t ne[4];
    uint64_t bytes, offset;
    gg_src src;
    const eng_st_tensor *t; /* the source (GG_STACK: the first) */
    size_t first_part;      /* GG_STACK: parts[first_part .. + n_parts) */
    int n_parts;
    int heads, nope, vdim; /* GG_K_B / GG_V_B */
} gg_tensor;

typedef struct exporter {
    const eng_model *m;
    gg_tensor *t;
    size_t n, cap;
    const eng_st_tensor **parts;
    size_t n_parts, cap_parts;
    kds_err *err;
} exporter;

static const eng_st_tensor *find(const eng_model *m, const char *name) {
    for (int s = 0; s < m->n_shards; s++) {
        const eng_st_tensor *t = eng_st_find(m->shards[s], name);
        if (t) return t;
    }
    return NULL;
}

static uint32_t elem_type(eng_st_dtype d, bool *ok) {
    *ok = true;
    if (d == ENG_ST_F32) return GGML_F32;
    if (d == ENG_ST_BF16) return GGML_BF16;
    if (d == ENG_ST_F16) return GGML_F16;
    *ok = false;
    return GGML_F32;
}

static uint64_t type_size(uint32_t type) {
    return type == GGML_F32 ? 4 : 2;
}

/* Append a tensor made from checkpoint tensor `src_name` (formatted with
 * the layer) as GGUF tensor `gg_name`. The ne are the source's dims
 * reversed unless `ne` is given; f32 forces GGML_F32. */
static gg_tensor *add(exporter *x, const char *gg_name, const char *src_name, gg_src how,
                      bool f32) {
    const eng_st_tensor *t = find(x->m, src_name);
    if (!t) {
        kds_err_set(x->err, KDS_NOT_FOUND, "%s: no tensor '%s' in the checkpoint",
                    eng_model_dir(x->m), src_name);
        return NULL;
    }
    bool ok;
    const uint32_t et = elem_type(t->dtype, &ok);
    if (!ok) {
        kds_err_set(x->err, KDS_UNSUPPORTED,
                    "%s: tensor '%s' is %s; GGUF export takes f32, bf16 and f16 tensors "
                    "(export the model before quantising it)",
                    eng_model_dir(x->m), src_name, eng_st_dtype_name(t->dtype));
        return NULL;
    }
    if (t->n_dims < 1 || t->n_dims > 4) {
        kds_err_set(x->err, KDS_UNSUPPORTED, "%s: tensor '%s' has %d dimensions (1 to 4 export)",
                    eng_model_dir(x->m), src_name, t->n_dims);
        return NULL;
    }
    if (x->n == x->cap) {
        size_t cap = x->cap ? 2 * x->cap : 256;
        gg_tensor *nt = realloc(x->t, cap * sizeof *nt);
        if (!nt) {
            kds_err_set(x->err, KDS_NOMEM, "out of memory listing tensors");
            return NULL;
        }
        x->t = nt;
        x->cap = cap;
    }
    gg_tensor *g = &x->t[x->n++];
    memset(g, 0, sizeof *g);
    snprintf(g->name, sizeof g->name, "%s", gg_name);
    g->src = how;
    g->t = t;
    g->type = (f32 || how == GG_WIDEN || how == GG_NEG_EXP) ? GGML_F32 : et;
    if (g->type == GGML_F32 && et != GGML_F32 && how == GG_COPY) g->src = GG_WIDEN;
    g->n_dims = (uint32_t)t->n_dims;
    for (int d = 0; d < t->n_dims; d++)
        g->ne[d] = (uint64_t)t->shape[t->n_dims - 1 - d];
    g->bytes = (uint64_t)t->n_elems * type_size(g->type);
    return g;
}

/* Layer tensor names: "model.layers.L.SUFFIX" and "blk.L.NAME". */
static gg_tensor *add_l(exporter *x, int l, const char *gg, const char *src, gg_src how, bool f32) {
    char a[GG_MAX_NAME], b[320];
    snprintf(a, sizeof a, "blk.%d.%s", l, gg);
    snprintf(b, sizeof b, "model.layers.%d.%s", l, src);
    return add(x, a, b, how, f32);
}

static kds_status add_kda(exporter *x, int l) {
    const eng_config *c = &x->m->cfg;
    static const char *const mats[][2] = {
        {"attn_q.weight", "self_attn.q_proj.weight"},
        {"attn_k.weight", "self_attn.k_proj.weight"},
        {"attn_v.weight", "self_attn.v_proj.weight"},
        {"ssm_f_a.weight", "self_attn.f_a_proj.weight"},
        {"ssm_f_b.weight", "self_attn.f_b_proj.weight"},
        {"ssm_beta.weight", "self_attn.b_proj.weight"},
        {"ssm_g_a.weight", "self_attn.g_a_proj.weight"},
        {"ssm_g_b.weight", "self_attn.g_b_proj.weight"},
        {"attn_output.weight", "self_attn.o_proj.weight"},
    };
    static const char *const convs[][2] = {{"ssm_conv1d_q.weight", "self_attn.q_conv1d.weight"},
                                           {"ssm_conv1d_k.weight", "self_attn.k_conv1d.weight"},
                                           {"ssm_conv1d_v.weight", "self_attn.v_conv1d.weight"}};
    for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++)
        if (!add_l(x, l, mats[i][0], mats[i][1], GG_COPY, false)) return x->err->status;
    for (size_t i = 0; i < 3; i++) {
        gg_tensor *g = add_l(x, l, convs[i][0], convs[i][1], GG_COPY, true);
        if (!g) return x->err->status;
        /* [C, 1, W] (or [C, W]) -> ne [W, 1, C, 1], the same bytes */
        const uint64_t ch = (uint64_t)g->t->shape[0], w = (uint64_t)c->short_conv_kernel_size;
        if (ch * w != g->t->n_elems)
            return kds_err_set(x->err, KDS_BAD_FORMAT, "%s: '%s' is not [channels, 1, %d]",
                               eng_model_dir(x->m), convs[i][1], c->short_conv_kernel_size);
        g->n_dims = 4;
        g->ne[0] = w;
        g->ne[1] = 1;
        g->ne[2] = ch;
        g->ne[3] = 1;
    }
    gg_tensor *a = add_l(x, l, "ssm_a", "self_attn.A_log", GG_NEG_EXP, true);
    if (!a) return x->err->status;
    a->n_dims = 4; /* [1, 1, H, 1] -> ne [1, H, 1, 1] */
    a->ne[0] = 1;
    a->ne[1] = a->t->n_elems;
    a->ne[2] = a->ne[3] = 1;
    if (!add_l(x, l, "ssm_dt.bias", "self_attn.dt_bias", GG_COPY, true)) return x->err->status;
    if (!add_l(x, l, "ssm_norm.weight", "self_attn.o_norm.weight", GG_COPY, true))
        return x->err->status;
    return KDS_OK;
}

static kds_status add_mla(exporter *x, int l) {
    const eng_config *c = &x->m->cfg;
    if (!add_l(x, l, "attn_q.weight", "self_attn.q_proj.weight", GG_COPY, false) ||
        !add_l(x, l, "attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight", GG_COPY,
               false) ||
        !add_l(x, l, "attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight", GG_COPY, true))
        return x->err->status;
    const int h = c->num_attention_heads, nope = c->qk_nope_head_dim, v = c->v_head_dim,
              r = c->kv_lora_rank;
    for (int part = 0; part < 2; part++) {
        gg_tensor *g = add_l(x, l, part ? "attn_v_b.weight" : "attn_k_b.weight",
                             "self_attn.kv_b_proj.weight", part ? GG_V_B : GG_K_B, false);
        if (!g) return x->err->status;
        if (g->t->n_dims != 2 || g->t->shape[0] != (int64_t)h * (nope + v) || g->t->shape[1] != r)
            return kds_err_set(x->err, KDS_BAD_FORMAT, "%s: layer %d kv_b_proj is not [%d, %d]",
                               eng_model_dir(x->m), l, h * (nope + v), r);
        g->heads = h;
        g->nope = nope;
        g->vdim = v;
        g->n_dims = 3;
        g->ne[0] = part ? (uint64_t)r : (uint64_t)nope; /* k_b [H, r, nope]; v_b [H, v, r] */
        g->ne[1] = part ? (uint64_t)v : (uint64_t)r;
        g->ne[2] = (uint64_t)h;
        g->bytes = g->ne[0] * g->ne[1] * g->ne[2] * type_size(g->type);
    }
    return add_l(x, l, "attn_output.weight", "self_attn.o_proj.weight", GG_COPY, false)
               ? KDS_OK
               : x->err->status;
}

static kds_status add_ffn(exporter *x, int l) {
    const eng_config *c = &x->m->cfg;
    if (!c->layer_is_moe[l]) {
        if (!add_l(x, l, "ffn_gate.weight", "mlp.gate_proj.weight", GG_COPY, false) ||
            !add_l(x, l, "ffn_up.weight", "mlp.up_proj.weight", GG_COPY, false) ||
            !add_l(x, l, "ffn_down.weight", "mlp.down_proj.weight", GG_COPY, false))
            return x->err->status;
        return KDS_OK;
    }
    if (!add_l(x, l, "ffn_gate_inp.weight", "block_sparse_moe.gate.weight", GG_COPY, true) ||
        !add_l(x, l, "exp_probs_b.bias", "block_sparse_moe.gate.e_score_correction_bias", GG_COPY,
               true))
        return x->err->status;
    static const char *const kinds[][2] = {{"ffn_gate_exps.weight", "w1"},
                                           {"ffn_down_exps.weight", "w2"},
                                           {"ffn_up_exps.weight", "w3"}};
    const int e_n = c->num_experts;
    for (int k = 0; k < 3; k++) {
        char src[256];
        snprintf(src, sizeof src, "block_sparse_moe.experts.0.%s.weight", kinds[k][1]);
        gg_tensor *g = add_l(x, l, kinds[k][0], src, GG_STACK, false);
        if (!g) return x->err->status;
        if (x->n_parts + (size_t)e_n > x->cap_parts) {
            size_t cap = x->cap_parts ? 2 * x->cap_parts : 1024;
            while (cap < x->n_parts + (size_t)e_n)
                cap *= 2;
            const eng_st_tensor **np = realloc(x->parts, cap * sizeof *np);
            if (!np) return kds_err_set(x->err, KDS_NOMEM, "out of memory listing experts");
            x->parts = np;
            x->cap_parts = cap;
        }
        g->first_part = x->n_parts;
        g->n_parts = e_n;
        for (int e = 0; e < e_n; e++) {
            char name[256];
            snprintf(name, sizeof name, "model.layers.%d.block_sparse_moe.experts.%d.%s.weight", l,
                     e, kinds[k][1]);
            const eng_st_tensor *t = find(x->m, name);
            if (!t)
                return kds_err_set(x->err, KDS_NOT_FOUND, "%s: no tensor '%s' in the checkpoint",
                                   eng_model_dir(x->m), name);
            if (t->dtype != g->t->dtype || t->n_elems != g->t->n_elems || t->n_dims != 2 ||
                t->shape[0] != g->t->shape[0])
                return kds_err_set(x->err, KDS_BAD_FORMAT,
                                   "%s: '%s' differs in dtype or shape from expert 0's",
                                   eng_model_dir(x->m), name);
            x->parts[x->n_parts++] = t;
        }
        g->n_dims = 3;
        g->ne[2] = (uint64_t)e_n;
        g->bytes *= (uint64_t)e_n;
    }
    if (c->num_shared_experts > 0 &&
        (!add_l(x, l, "ffn_gate_shexp.weight", "block_sparse_moe.shared_experts.gate_proj.weight",
                GG_COPY, false) ||
         !add_l(x, l, "ffn_up_shexp.weight", "block_sparse_moe.shared_experts.up_proj.weight",
                GG_COPY, false) ||
         !add_l(x, l, "ffn_down_shexp.weight", "block_sparse_moe.shared_experts.down_proj.weight",
                GG_COPY, false)))
        return x->err->status;
    return KDS_OK;
}

/* What llama.cpp's kimi-linear graph can express; the first thing it
 * cannot, named. */
static kds_status check_supported(const eng_model *m, kds_err *err) {
    const eng_config *c = &m->cfg;
    const char *dir = eng_model_dir(m);
    const char *why = NULL;
    if (c->family != ENG_FAMILY_KIMI_LINEAR)
        why = "it is not a Kimi-Linear model (llama.cpp's kimi-linear architecture)";
    else if (c->kda_num_v_heads != c->kda_num_heads || c->kda_v_head_dim != c->kda_head_dim)
        why = "its KDA value heads differ from its q/k heads";
    else if (c->n_mla_layers > 0 && c->kda_num_heads != c->num_attention_heads)
        why = "its KDA and MLA head counts differ (llama.cpp has one head count for both)";
    else if (c->has_gate_lower_bound || c->use_full_rank_gate)
        why = "it uses the lower-bound or full-rank KDA gate";
    else if (c->q_lora_rank > 0 || c->mla_use_output_gate || !c->mla_use_nope)
        why = "its MLA layers use q compression, an output gate or RoPE";
    else if (c->hidden_act != ENG_ACT_SILU)
        why = "its FFN activation is not SiLU";
    else if (c->latent_size > 0 || c->attn_res_block_size > 0)
        why = "it uses latent MoE or attention residuals";
    else if (c->num_experts > 0 &&
             (!c->moe_renormalize || c->moe_layer_freq != 1 || c->num_expert_group > 1 ||
              strcmp(c->moe_router_activation_func, "sigmoid") != 0))
        why = "its router is not Kimi-Linear's (sigmoid, renormalised, one group, every layer)";
    if (why) return kds_err_set(err, KDS_UNSUPPORTED, "%s: cannot export to GGUF: %s", dir, why);
    return KDS_OK;
}

/* ---- the header ---- */

static kds_status put(kds_buf *b, const void *p, size_t n, kds_err *err) {
    return kds_buf_append(b, p, n, err);
}

static kds_status put_u32(kds_buf *b, uint32_t v, kds_err *err) {
    unsigned char le[4];
    for (int i = 0; i < 4; i++)
        le[i] = (unsigned char)(v >> (8 * i));
    return put(b, le, 4, err);
}

static kds_status put_u64(kds_buf *b, uint64_t v, kds_err *err) {
    unsigned char le[8];
    for (int i = 0; i < 8; i++)
        le[i] = (unsigned char)(v >> (8 * i));
    return put(b, le, 8, err);
}

static kds_status put_str(kds_buf *b, const char *s, size_t n, kds_err *err) {
    kds_status rc = put_u64(b, n, err);
    return rc == KDS_OK ? put(b, s, n, err) : rc;
}

static kds_status put_key(kds_buf *b, const char *key, uint32_t type, kds_err *err) {
    kds_status rc = put_str(b, key, strlen(key), err);
    return rc == KDS_OK ? put_u32(b, type, err) : rc;
}

/* The header under construction and its key count. */
typedef struct header {
    kds_buf b;
    uint64_t n_kv;
    char arch_key[160];
    kds_err *err;
    kds_status rc;
} header;

/* "{arch}.NAME" keys of kimi-linear */
static const char *ak(header *h, const char *name) {
    snprintf(h->arch_key, sizeof h->arch_key, "kimi-linear.%s", name);
    return h->arch_key;
}

static void kv_u32(header *h, const char *key, uint32_t v) {
    if (h->rc != KDS_OK) return;
    if ((h->rc = put_key(&h->b, key, GV_U32, h->err)) == KDS_OK) h->rc = put_u32(&h->b, v, h->err);
    h->n_kv++;
}

static void kv_f32(header *h, const char *key, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if (h->rc != KDS_OK) return;
    if ((h->rc = put_key(&h->b, key, GV_F32, h->err)) == KDS_OK) h->rc = put_u32(&h->b, u, h->err);
    h->n_kv++;
}

static void kv_bool(header *h, const char *key, bool v) {
    const unsigned char byte = v ? 1 : 0;
    if (h->rc != KDS_OK) return;
    if ((h->rc = put_key(&h->b, key, GV_BOOL, h->err)) == KDS_OK)
        h->rc = put(&h->b, &byte, 1, h->err);
    h->n_kv++;
}

static void kv_str(header *h, const char *key, const char *s) {
    if (h->rc != KDS_OK) return;
    if ((h->rc = put_key(&h->b, key, GV_STRING, h->err)) == KDS_OK)
        h->rc = put_str(&h->b, s, strlen(s), h->err);
    h->n_kv++;
}

/* Start an array of n elements of `type`; the caller appends them. */
static void kv_array(header *h, const char *key, uint32_t type, uint64_t n) {
    if (h->rc != KDS_OK) return;
    if ((h->rc = put_key(&h->b, key, GV_ARRAY, h->err)) == KDS_OK &&
        (h->rc = put_u32(&h->b, type, h->err)) == KDS_OK)
        h->rc = put_u64(&h->b, n, h->err);
    h->n_kv++;
}

static void model_keys(header *h, const eng_model *m, uint32_t file_type) {
    const eng_config *c = &m->cfg;
    const char *dir = eng_model_dir(m), *base = strrchr(dir, '/');
    char name[256];
    snprintf(name, sizeof name, "%s", base && base[1] ? base + 1 : dir);
    kv_str(h, "general.architecture", "kimi-linear");
    kv_str(h, "general.name", name);
    kv_u32(h, "general.file_type", file_type);
    kv_u32(h, "general.quantization_version", 2);
    kv_u32(h, "general.alignment", GG_ALIGN);
    kv_u32(h, ak(h, "block_count"), (uint32_t)c->num_hidden_layers);
    kv_u32(h, ak(h, "context_length"),
           (uint32_t)(c->model_max_length > 0 && c->model_max_length < UINT32_MAX
                          ? c->model_max_length
                          : 1048576));
    kv_u32(h, ak(h, "embedding_length"), (uint32_t)c->hidden_size);
    kv_u32(h, ak(h, "feed_forward_length"), (uint32_t)c->intermediate_size);
    kv_u32(h, ak(h, "attention.head_count"), (uint32_t)c->kda_num_heads);
    kv_array(h, ak(h, "attention.head_count_kv"), GV_I32, (uint64_t)c->num_hidden_layers);
    for (int l = 0; l < c->num_hidden_layers && h->rc == KDS_OK; l++)
        h->rc = put_u32(&h->b, c->layer_kind[l] == ENG_LAYER_MLA ? 1u : 0u, h->err);
    kv_f32(h, ak(h, "rope.freq_base"), 10000.0f);
    kv_f32(h, ak(h, "attention.layer_norm_rms_epsilon"), c->rms_norm_eps);
    if (c->num_experts > 0) {
        kv_u32(h, ak(h, "expert_count"), (uint32_t)c->num_experts);
        kv_u32(h, ak(h, "expert_used_count"), (uint32_t)c->num_experts_per_token);
        kv_u32(h, ak(h, "expert_gating_func"), 2); /* sigmoid */
        kv_u32(h, ak(h, "expert_feed_forward_length"), (uint32_t)c->moe_intermediate_size);
        kv_u32(h, ak(h, "expert_shared_count"), (uint32_t)c->num_shared_experts);
        kv_f32(h, ak(h, "expert_weights_scale"), c->routed_scaling_factor);
    } else {
        kv_u32(h, ak(h, "expert_gating_func"), 2);
    }
    kv_u32(h, ak(h, "leading_dense_block_count"),
           (uint32_t)(c->num_experts > 0 ? c->first_k_dense_replace : c->num_hidden_layers));
    kv_u32(h, ak(h, "vocab_size"), (uint32_t)c->vocab_size);
    kv_u32(h, ak(h, "ssm.conv_kernel"), (uint32_t)c->short_conv_kernel_size);
    kv_u32(h, ak(h, "kda.head_dim"), (uint32_t)c->kda_head_dim);
    /* MLA: the latent cache row is the "key", its rope part n_rot */
    kv_u32(h, ak(h, "attention.kv_lora_rank"), (uint32_t)c->kv_lora_rank);
    kv_u32(h, ak(h, "rope.dimension_count"), (uint32_t)c->qk_rope_head_dim);
    kv_u32(h, ak(h, "attention.key_length"), (uint32_t)(c->kv_lora_rank + c->qk_rope_head_dim));
    kv_u32(h, ak(h, "attention.value_length"), (uint32_t)c->kv_lora_rank);
    kv_u32(h, ak(h, "attention.key_length_mla"),
           (uint32_t)(c->qk_nope_head_dim + c->qk_rope_head_dim));
    kv_u32(h, ak(h, "attention.value_length_mla"), (uint32_t)c->v_head_dim);
}

/* ---- the vocabulary ---- */

/* GPT-2's byte-to-unicode table: the printable bytes stand for themselves,
 * the others for U+0100 onwards in byte order; as UTF-8 (1 or 2 bytes). */
static void byte_spellings(char sp[256][3]) {
    int next = 256;
    for (int b = 0; b < 256; b++) {
        const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
        const int cp = printable ? b : next++;
        if (cp < 0x80) {
            sp[b][0] = (char)cp;
            sp[b][1] = sp[b][2] = 0;
        } else {
            sp[b][0] = (char)(0xC0 | (cp >> 6));
            sp[b][1] = (char)(0x80 | (cp & 0x3F));
            sp[b][2] = 0;
        }
    }
}

static kds_status spell(kds_buf *out, const char sp[256][3], const unsigned char *p, size_t n,
                        kds_err *err) {
    kds_status rc = KDS_OK;
    for (size_t i = 0; i < n && rc == KDS_OK; i++)
        rc = kds_buf_append(out, sp[p[i]], sp[p[i]][1] ? 2 : 1, err);
    return rc;
}

/* A byte string -> rank map of our own (open addressing, FNV-1a). */
typedef struct rank_map {
    uint32_t *slot; /* token id + 1; 0 empty */
    uint64_t mask;
    const eng_tokenizer *tok;
} rank_map;

static uint64_t fnv(const unsigned char *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static const unsigned char *piece(const eng_tokenizer *t, int id, size_t *n) {
    *n = t->piece[id].len;
    return (const unsigned char *)t->arena + t->piece[id].off;
}

static int64_t rank_of(const rank_map *rm, const unsigned char *p, size_t n) {
    for (uint64_t i = fnv(p, n) & rm->mask;; i = (i + 1) & rm->mask) {
        const uint32_t s = rm->slot[i];
        if (!s) return -1;
        size_t len;
        const unsigned char *q = piece(rm->tok, (int)(s - 1), &len);
        if (len == n && memcmp(p, q, n) == 0) return (int64_t)(s - 1);
    }
}

static kds_status rank_map_build(rank_map *rm, const eng_tokenizer *t, kds_err *err) {
    uint64_t cap = 1024;
    while (cap < 2 * (uint64_t)t->vocab)
        cap *= 2;
    rm->slot = calloc(cap, sizeof *rm->slot);
    if (!rm->slot) return kds_err_set(err, KDS_NOMEM, "out of memory building the merges");
    rm->mask = cap - 1;
    rm->tok = t;
    for (int id = 0; id < t->vocab; id++) {
        if (t->kind[id] != TOK_RANK) continue;
        size_t n;
        const unsigned char *p = piece(t, id, &n);
        uint64_t i = fnv(p, n) & rm->mask;
        while (rm->slot[i])
            i = (i + 1) & rm->mask;
        rm->slot[i] = (uint32_t)id + 1;
    }
    return KDS_OK;
}

/* tiktoken's merge that makes rank `id`: BPE over its bytes with only the
 * ranks below it; when that ends in two parts, they are the merge. Returns
 * the first part's length, or 0 when the token is not made by one merge.
 * cut[] holds part boundaries (n + 1 entries). */
static size_t merge_of(const rank_map *rm, const unsigned char *p, size_t n, int64_t id,
                       size_t *cut) {
    size_t parts = n;
    for (size_t i = 0; i <= n; i++)
        cut[i] = i;
    while (parts > 1) {
        int64_t best = -1;
        size_t at = 0;
        for (size_t i = 0; i + 1 < parts; i++) {
            const int64_t r = rank_of(rm, p + cut[i], cut[i + 2] - cut[i]);
            if (r >= 0 && (best < 0 || r < best)) {
                best = r;
                at = i;
            }
        }
        if (best < 0 || best >= id) break;
        memmove(&cut[at + 1], &cut[at + 2], (parts - at - 1) * sizeof *cut);
        parts--;
    }
    return parts == 2 ? cut[1] : 0;
}

static void vocab_keys(header *h, const eng_model *m) {
    const eng_tokenizer *t = m->tokenizer;
    const int vocab = m->cfg.vocab_size;
    char sp[256][3];
    kds_buf s = {0};
    rank_map rm = {0};
    size_t *cut = NULL;
    byte_spellings(sp);
    kv_str(h, "tokenizer.ggml.model", "gpt2");
    kv_str(h, "tokenizer.ggml.pre", "kimi-k2");
    kv_array(h, "tokenizer.ggml.tokens", GV_STRING, (uint64_t)vocab);
    for (int id = 0; id < vocab && h->rc == KDS_OK; id++) {
        kds_buf_reset(&s);
        size_t n = 0;
        const unsigned char *p = id < t->vocab ? piece(t, id, &n) : NULL;
        const int kind = id < t->vocab ? t->kind[id] : TOK_UNUSED;
        if (kind == TOK_RANK)
            h->rc = spell(&s, sp, p, n, h->err);
        else if (kind == TOK_SPECIAL)
            h->rc = kds_buf_append(&s, p, n, h->err);
        else
            h->rc = kds_buf_printf(&s, h->err, "[PAD%d]", id);
        if (h->rc == KDS_OK) h->rc = put_str(&h->b, (const char *)s.p, s.len, h->err);
    }
    kv_array(h, "tokenizer.ggml.token_type", GV_I32, (uint64_t)vocab);
    for (int id = 0; id < vocab && h->rc == KDS_OK; id++) {
        const int kind = id < t->vocab ? t->kind[id] : TOK_UNUSED;
        h->rc = put_u32(&h->b,
                        kind == TOK_RANK      ? TT_NORMAL
                        : kind == TOK_SPECIAL ? TT_CONTROL
                                              : TT_UNUSED,
                        h->err);
    }
    /* the merges, in rank order (llama.cpp ranks a merge by its index) */
    kds_buf merges = {0};
    uint64_t n_merges = 0;
    if (h->rc == KDS_OK && !t->bytes_only) {
        if ((h->rc = rank_map_build(&rm, t, h->err)) != KDS_OK) goto out;
        if (!(cut = malloc((t->max_piece + 2) * sizeof *cut))) {
            h->rc = kds_err_set(h->err, KDS_NOMEM, "out of memory building the merges");
            goto out;
        }
        for (int id = 0; id < t->vocab && h->rc == KDS_OK; id++) {
            size_t n;
            const unsigned char *p = piece(t, id, &n);
            if (t->kind[id] != TOK_RANK || n < 2) continue;
            const size_t a = merge_of(&rm, p, n, id, cut);
            if (!a) continue;
            kds_buf_reset(&s);
            if ((h->rc = spell(&s, sp, p, a, h->err)) != KDS_OK ||
                (h->rc = kds_buf_append(&s, " ", 1, h->err)) != KDS_OK ||
                (h->rc = spell(&s, sp, p + a, n - a, h->err)) != KDS_OK)
                goto out;
            h->rc = put_str(&merges, (const char *)s.p, s.len, h->err);
            n_merges++;
        }
    }
    kv_array(h, "tokenizer.ggml.merges", GV_STRING, n_merges);
    if (h->rc == KDS_OK && merges.len) h->rc = put(&h->b, merges.p, merges.len, h->err);
    if (t->bos >= 0 && t->bos < vocab) kv_u32(h, "tokenizer.ggml.bos_token_id", (uint32_t)t->bos);
    if (t->eos >= 0 && t->eos < vocab) kv_u32(h, "tokenizer.ggml.eos_token_id", (uint32_t)t->eos);
    if (m->cfg.pad_token_id >= 0 && m->cfg.pad_token_id < vocab)
        kv_u32(h, "tokenizer.ggml.padding_token_id", (uint32_t)m->cfg.pad_token_id);
    /* kdaserve starts a non-empty prompt without BOS */
    kv_bool(h, "tokenizer.ggml.add_bos_token", false);
out:
    kds_buf_free(&merges);
    kds_buf_free(&s);
    free(rm.slot);
    free(cut);
}

/* ---- the data ---- */

static float elem_f32(const eng_st_tensor *t, size_t i) {
    const unsigned char *p = t->data;
    if (t->dtype == ENG_ST_F32) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    uint16_t u;
    memcpy(&u, p + 2 * i, 2);
    return t->dtype == ENG_ST_BF16 ? kern_bf16_to_f32(u) : kern_f16_to_f32(u);
}

typedef struct writer {
    FILE *f;
    const char *path;
    uint64_t total;
    eng_progress line; /* bytes written of total */
    kds_err *err;
} writer;

static kds_status out_bytes(writer *w, const void *p, size_t n) {
    if (n == 0) return KDS_OK;
    if (fwrite(p, 1, n, w->f) != n)
        return kds_err_set(w->err, KDS_IO, "%s: %s", w->path, strerror(errno));
    eng_progress_add(&w->line, n);
    return KDS_OK;
}

/* One tensor's bytes; buf holds at least 64 KiB. */
static kds_status write_tensor(writer *w, const exporter *x, const gg_tensor *g, unsigned char *buf,
                               size_t buf_bytes) {
    const eng_st_tensor *t = g->t;
    kds_status rc = KDS_OK;
    if (g->src == GG_COPY) return out_bytes(w, t->data, t->n_bytes);
    if (g->src == GG_STACK) {
        for (int e = 0; e < g->n_parts && rc == KDS_OK; e++) {
            const eng_st_tensor *pt = x->parts[g->first_part + (size_t)e];
            rc = out_bytes(w, pt->data, pt->n_bytes);
        }
        return rc;
    }
    if (g->src == GG_WIDEN || g->src == GG_NEG_EXP) {
        const size_t per = buf_bytes / 4;
        for (size_t i0 = 0; i0 < t->n_elems && rc == KDS_OK; i0 += per) {
            const size_t n = t->n_elems - i0 < per ? t->n_elems - i0 : per;
            for (size_t i = 0; i < n; i++) {
                float v = elem_f32(t, i0 + i);
                if (g->src == GG_NEG_EXP) v = -expf(v);
                memcpy(buf + 4 * i, &v, 4);
            }
            rc = out_bytes(w, buf, 4 * n);
        }
        return rc;
    }
    /* kv_b_proj [H * (nope + v), r]: head h's rows nope first, then v */
    const size_t es = eng_st_dtype_size(t->dtype), r = (size_t)t->shape[1];
    const size_t per_head = (size_t)(g->nope + g->vdim);
    const unsigned char *src = t->data;
    for (int h = 0; h < g->heads && rc == KDS_OK; h++) {
        const unsigned char *head = src + (size_t)h * per_head * r * es;
        if (g->src == GG_V_B) {
            /* v_b [H, v, r]: the head's v rows as they are */
            rc = out_bytes(w, head + (size_t)g->nope * r * es, (size_t)g->vdim * r * es);
            continue;
        }
        /* k_b [H, r, nope]: element (j, n) = kv_b row n, column j */
        size_t used = 0;
        for (size_t j = 0; j < r && rc == KDS_OK; j++) {
            if (used + (size_t)g->nope * es > buf_bytes) {
                rc = out_bytes(w, buf, used);
                used = 0;
            }
            for (int n = 0; n < g->nope; n++)
                memcpy(buf + used + (size_t)n * es, head + ((size_t)n * r + j) * es, es);
            used += (size_t)g->nope * es;
        }
        if (rc == KDS_OK) rc = out_bytes(w, buf, used);
    }
    return rc;
}

kds_status eng_model_export_gguf(const char *model_dir, const char *out_path, bool progress,
                                 kds_err *err) {
    kds_err local = {0};
    if (!err) err = &local; /* the tensor list reads the status back from it */
    eng_model *m = NULL;
    eng_model_params mp = eng_model_default_params();
    mp.progress = progress;
    exporter x = {.err = err};
    header h = {.err = err, .rc = KDS_OK};
    char *tmp = NULL;
    unsigned char *buf = NULL;
    const size_t buf_bytes = (size_t)1 << 20;
    writer w = {.err = err}; /* its progress line off until the writing starts */
    kds_status rc = eng_model_load(model_dir, &mp, &m, err);
    if (rc != KDS_OK) goto out;
    if ((rc = check_supported(m, err)) != KDS_OK) goto out;
    if (!m->tokenizer) {
        rc = kds_err_set(err, KDS_UNSUPPORTED, "%s: the model has no tokenizer", model_dir);
        goto out;
    }
    x.m = m;
    const eng_config *c = &m->cfg;
    if (!add(&x, "token_embd.weight", "model.embed_tokens.weight", GG_COPY, false)) goto fail;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        if (!add_l(&x, l, "attn_norm.weight", "input_layernorm.weight", GG_COPY, true)) goto fail;
        rc = c->layer_kind[l] == ENG_LAYER_KDA ? add_kda(&x, l) : add_mla(&x, l);
        if (rc != KDS_OK) goto out;
        if (!add_l(&x, l, "ffn_norm.weight", "post_attention_layernorm.weight", GG_COPY, true))
            goto fail;
        if ((rc = add_ffn(&x, l)) != KDS_OK) goto out;
    }
    if (!add(&x, "output_norm.weight", "model.norm.weight", GG_COPY, true)) goto fail;
    /* a tied lm_head: llama.cpp wants output.weight all the same (the embedding) */
    if (!add(&x, "output.weight",
             find(m, "lm_head.weight") ? "lm_head.weight" : "model.embed_tokens.weight", GG_COPY,
             false))
        goto fail;

    /* file type: the matrices' dtype (llama.cpp's MOSTLY_BF16 = 32, MOSTLY_F16 = 1) */
    uint32_t file_type = 0;
    uint64_t off = 0;
    for (size_t i = 0; i < x.n; i++) {
        if (x.t[i].n_dims >= 2 && x.t[i].type == GGML_BF16) file_type = 32;
        if (x.t[i].n_dims >= 2 && x.t[i].type == GGML_F16 && file_type == 0) file_type = 1;
        x.t[i].offset = off;
        off += (x.t[i].bytes + GG_ALIGN - 1) / GG_ALIGN * GG_ALIGN;
    }
    w.total = off;

    /* header: magic, version, counts (the key count is patched in below) */
    if ((rc = put(&h.b, "GGUF", 4, err)) != KDS_OK || (rc = put_u32(&h.b, 3, err)) != KDS_OK ||
        (rc = put_u64(&h.b, x.n, err)) != KDS_OK || (rc = put_u64(&h.b, 0, err)) != KDS_OK)
        goto out;
    model_keys(&h, m, file_type);
    vocab_keys(&h, m);
    if ((rc = h.rc) != KDS_OK) goto out;
    for (size_t i = 0; i < x.n && rc == KDS_OK; i++) {
        const gg_tensor *g = &x.t[i];
        rc = put_str(&h.b, g->name, strlen(g->name), err);
        if (rc == KDS_OK) rc = put_u32(&h.b, g->n_dims, err);
        for (uint32_t d = 0; d < g->n_dims && rc == KDS_OK; d++)
            rc = put_u64(&h.b, g->ne[d], err);
        if (rc == KDS_OK) rc = put_u32(&h.b, g->type, err);
        if (rc == KDS_OK) rc = put_u64(&h.b, g->offset, err);
    }
    if (rc != KDS_OK) goto out;
    for (int i = 0; i < 8; i++)
        h.b.p[16 + i] = (unsigned char)(h.n_kv >> (8 * i));
    static const unsigned char zeros[GG_ALIGN] = {0};
    const size_t pad = (GG_ALIGN - h.b.len % GG_ALIGN) % GG_ALIGN;
    if ((rc = put(&h.b, zeros, pad, err)) != KDS_OK) goto out;

    if (asprintf(&tmp, "%s.tmp.%d", out_path, (int)getpid()) < 0) {
        tmp = NULL;
        rc = kds_err_set(err, KDS_NOMEM, "out of memory writing %s", out_path);
        goto out;
    }
    if (!(buf = malloc(buf_bytes))) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory writing %s", out_path);
        goto out;
    }
    if (!(w.f = fopen(tmp, "wb"))) {
        rc = kds_err_set(err, KDS_IO, "%s: %s", tmp, strerror(errno));
        goto out;
    }
    w.path = tmp;
    w.total += h.b.len;
    eng_progress_start(&w.line, progress ? stderr : NULL, w.total, "writing %s", out_path);
    if ((rc = out_bytes(&w, h.b.p, h.b.len)) != KDS_OK) goto out;
    for (size_t i = 0; i < x.n && rc == KDS_OK; i++) {
        rc = write_tensor(&w, &x, &x.t[i], buf, buf_bytes);
        const uint64_t tail = (GG_ALIGN - x.t[i].bytes % GG_ALIGN) % GG_ALIGN;
        if (rc == KDS_OK) rc = out_bytes(&w, zeros, tail);
    }
    if (rc != KDS_OK) goto out;
    eng_progress_finish(&w.line);
    if (fflush(w.f) != 0 || fsync(fileno(w.f)) != 0) {
        rc = kds_err_set(err, KDS_IO, "%s: %s", tmp, strerror(errno));
        goto out;
    }
    const int closed = fclose(w.f);
    w.f = NULL;
    if (closed != 0) {
        rc = kds_err_set(err, KDS_IO, "%s: %s", tmp, strerror(errno));
        goto out;
    }
    if (rename(tmp, out_path) != 0) {
        rc = kds_err_set(err, KDS_IO, "rename %s -> %s: %s", tmp, out_path, strerror(errno));
        goto out;
    }
    goto out;
fail:
    rc = err->status != KDS_OK ? err->status : KDS_INTERNAL;
out:
    eng_progress_abandon(&w.line);
    if (w.f) fclose(w.f);
    if (rc != KDS_OK && tmp) unlink(tmp);
    free(tmp);
    free(buf);
    kds_buf_free(&h.b);
    free(x.t);
    free(x.parts);
    eng_model_free(m);
    return rc;
}
