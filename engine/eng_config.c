/*
 * eng_config.c - parse, check and write the Kimi-Linear config.json
 * (kda-model-spec.md §1), and the tensor/parameter counts it implies (§2).
 *
 * Two kinds of refusal: a field of the wrong JSON type or a missing required
 * field is KDS_BAD_FORMAT; a well-typed value that makes no sense (sizes <= 0,
 * top-k > experts, layer lists out of range, ...) is KDS_INVALID_ARG; a valid
 * value this engine does not run (a softmax router, RoPE'd MLA, a non-SiLU
 * activation) is KDS_UNSUPPORTED. Every message names the file and the field.
 */
#include "eng_config.h"
#include "eng_util.h"

#include <cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A config.json larger than this is not a config. */
#define CFG_MAX_FILE_BYTES ((size_t)16 << 20)

/* Largest single dimension (rows or columns of any weight) we accept: keeps
 * every shape inside an int and every byte count far from overflow. */
#define CFG_MAX_DIM ((int64_t)1 << 28)

/* Largest total parameter count we accept (a 1000x larger model than 48B). */
#define CFG_MAX_PARAMS 5.0e13

/* ------------------------------------------------------------------------ */
/* Typed field readers and checks. They share a sticky status: once one has
 * failed, the others do nothing, so the first problem is the one reported
 * and callers test `r->rc` only where a value read so far is needed.
 * `path` is the field's name as the user sees it
 * ("linear_attn_config.num_heads"); `origin` names the file.               */

typedef struct reader {
    const char *origin;
    kds_err *err;
    kds_status rc;
} reader;

static void fail(reader *r, kds_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void fail(reader *r, kds_status s, const char *fmt, ...) {
    if (r->rc != KDS_OK) return;
    r->rc = s;
    char msg[sizeof r->err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    kds_err_set(r->err, s, "%s: %s", r->origin, msg);
}

static void missing(reader *r, const char *path) {
    fail(r, KDS_BAD_FORMAT, "missing required field '%s'", path);
}

static void bad_type(reader *r, const char *path, const char *want) {
    fail(r, KDS_BAD_FORMAT, "field '%s' must be %s", path, want);
}

/* True when the item is absent or JSON null (optional fields). */
static bool absent(const cJSON *it) {
    return !it || cJSON_IsNull(it);
}

static bool as_int64(const cJSON *it, int64_t *out) {
    if (!cJSON_IsNumber(it)) return false;
    double d = it->valuedouble;
    if (!isfinite(d) || d != floor(d) || d < -9.0e15 || d > 9.0e15) return false;
    *out = (int64_t)d;
    return true;
}

/* Integer field. Absent/null: `dflt` unless `required`. */
static void read_int(reader *r, const cJSON *obj, const char *key, const char *path, bool required,
                     int dflt, int *out) {
    *out = dflt;
    if (r->rc != KDS_OK) return;
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (absent(it)) {
        if (required) missing(r, path);
        return;
    }
    int64_t v;
    if (!as_int64(it, &v) || v < INT_MIN || v > INT_MAX) {
        bad_type(r, path, "an integer");
        return;
    }
    *out = (int)v;
}

static void read_int64(reader *r, const cJSON *obj, const char *key, int64_t dflt, int64_t *out) {
    *out = dflt;
    if (r->rc != KDS_OK) return;
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (absent(it)) return;
    if (!as_int64(it, out)) {
        *out = dflt;
        bad_type(r, key, "an integer");
    }
}

static void read_float(reader *r, const cJSON *obj, const char *key, const char *path, float dflt,
                       float *out, bool *present) {
    *out = dflt;
    if (present) *present = false;
    if (r->rc != KDS_OK) return;
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (absent(it)) return;
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble) || fabs(it->valuedouble) > 3.0e38) {
        bad_type(r, path, "a finite number");
        return;
    }
    *out = (float)it->valuedouble;
    if (present) *present = true;
}

static void read_bool(reader *r, const cJSON *obj, const char *key, const char *path, bool dflt,
                      bool *out) {
    *out = dflt;
    if (r->rc != KDS_OK) return;
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (absent(it)) return;
    if (!cJSON_IsBool(it)) {
        bad_type(r, path, "true or false");
        return;
    }
    *out = cJSON_IsTrue(it);
}

/* String field into a fixed buffer; absent/null gives `dflt`. */
static void read_str(reader *r, const cJSON *obj, const char *key, const char *dflt, char *out,
                     size_t cap) {
    snprintf(out, cap, "%s", dflt);
    if (r->rc != KDS_OK) return;
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (absent(it)) return;
    if (!cJSON_IsString(it)) {
        bad_type(r, key, "a string");
        return;
    }
    if (strlen(it->valuestring) >= cap) {
        fail(r, KDS_BAD_FORMAT, "field '%s' is too long ('%.40s')", key, it->valuestring);
        return;
    }
    snprintf(out, cap, "%s", it->valuestring);
}

/* Token id: integer, null/absent (-1), or a list whose first entry counts
 * (HF allows eos_token_id to be a list). */
static void read_token_id(reader *r, const cJSON *obj, const char *key, int *out) {
    *out = -1;
    if (r->rc != KDS_OK) return;
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (absent(it)) return;
    if (cJSON_IsArray(it)) {
        it = cJSON_GetArrayItem(it, 0);
        if (!it) return;
    }
    int64_t v;
    if (!as_int64(it, &v) || v < -1 || v > INT_MAX) {
        bad_type(r, key, "a token id (an integer >= 0) or null");
        return;
    }
    *out = (int)v;
}

/* Mark the 1-based layers of linear_attn_config.<key> in `seen` (0-based)
 * with `bit`. */
static void read_layer_list(reader *r, const cJSON *lac, const char *key, int L,
                            unsigned char *seen, unsigned char bit) {
    if (r->rc != KDS_OK) return;
    char path[64];
    snprintf(path, sizeof path, "linear_attn_config.%s", key);
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(lac, key);
    if (!arr) {
        missing(r, path);
        return;
    }
    if (!cJSON_IsArray(arr)) {
        bad_type(r, path, "a list of 1-based layer numbers");
        return;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, arr) {
        int64_t v;
        if (!as_int64(it, &v)) {
            bad_type(r, path, "a list of 1-based layer numbers");
            return;
        }
        if (v < 1 || v > L) {
            fail(r, KDS_INVALID_ARG, "%s names layer %lld, outside 1..num_hidden_layers (%d)", path,
                 (long long)v, L);
            return;
        }
        if (seen[v - 1] & bit) {
            fail(r, KDS_INVALID_ARG, "%s lists layer %lld twice", path, (long long)v);
            return;
        }
        seen[v - 1] |= bit;
    }
}

static void need_pos(reader *r, const char *field, int64_t v) {
    if (v <= 0)
        fail(r, KDS_INVALID_ARG, "%s must be positive (got %lld)", field, (long long)v);
    else if (v > CFG_MAX_DIM)
        fail(r, KDS_INVALID_ARG, "%s = %lld is too large (max %lld)", field, (long long)v,
             (long long)CFG_MAX_DIM);
}

static void need_nonneg(reader *r, const char *field, int64_t v) {
    if (v < 0)
        fail(r, KDS_INVALID_ARG, "%s must not be negative (got %lld)", field, (long long)v);
    else if (v > CFG_MAX_DIM)
        fail(r, KDS_INVALID_ARG, "%s = %lld is too large (max %lld)", field, (long long)v,
             (long long)CFG_MAX_DIM);
}

/* A derived weight dimension (a product of fields) must fit as well. */
static void need_dim(reader *r, const char *what, int64_t v) {
    if (v > CFG_MAX_DIM)
        fail(r, KDS_INVALID_ARG, "%s = %lld is too large (max %lld)", what, (long long)v,
             (long long)CFG_MAX_DIM);
}

/* ------------------------------------------------------------------------ */
/* Consistency                                                               */

static void validate_kda(reader *r, const eng_config *c) {
    need_pos(r, "linear_attn_config.num_heads", c->kda_num_heads);
    need_pos(r, "linear_attn_config.num_v_heads", c->kda_num_v_heads);
    need_pos(r, "linear_attn_config.head_dim", c->kda_head_dim);
    need_pos(r, "linear_attn_config.short_conv_kernel_size", c->short_conv_kernel_size);
    if (r->rc != KDS_OK) return;
    if (c->short_conv_kernel_size > 64)
        fail(r, KDS_INVALID_ARG,
             "linear_attn_config.short_conv_kernel_size %d is too large "
             "(max 64)",
             c->short_conv_kernel_size);
    else if (c->kda_num_v_heads % c->kda_num_heads != 0)
        fail(r, KDS_INVALID_ARG,
             "linear_attn_config.num_v_heads (%d) must be a multiple of "
             "linear_attn_config.num_heads (%d)",
             c->kda_num_v_heads, c->kda_num_heads);
    need_dim(r, "linear_attn_config.num_heads * head_dim",
             (int64_t)c->kda_num_heads * c->kda_head_dim);
    need_dim(r, "linear_attn_config.num_v_heads * head_dim",
             (int64_t)c->kda_num_v_heads * c->kda_v_head_dim);
    if (c->has_gate_lower_bound && !(c->gate_lower_bound < 0.0f))
        fail(r, KDS_INVALID_ARG, "linear_attn_config.gate_lower_bound must be negative (got %g)",
             (double)c->gate_lower_bound);
}

static void validate_mla(reader *r, const eng_config *c) {
    if (!c->mla_use_nope) {
        fail(r, KDS_UNSUPPORTED,
             "mla_use_nope is false: MLA layers with RoPE are not supported "
             "(Kimi-Linear's MLA uses no positional encoding)");
        return;
    }
    need_nonneg(r, "q_lora_rank", c->q_lora_rank);
    need_pos(r, "kv_lora_rank", c->kv_lora_rank);
    need_pos(r, "qk_nope_head_dim", c->qk_nope_head_dim);
    need_nonneg(r, "qk_rope_head_dim", c->qk_rope_head_dim);
    need_pos(r, "v_head_dim", c->v_head_dim);
    if (r->rc != KDS_OK) return;
    int64_t nh = c->num_attention_heads;
    need_dim(r, "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)",
             nh * (c->qk_nope_head_dim + (int64_t)c->qk_rope_head_dim));
    need_dim(r, "num_attention_heads * (qk_nope_head_dim + v_head_dim)",
             nh * (c->qk_nope_head_dim + (int64_t)c->v_head_dim));
    need_dim(r, "num_attention_heads * v_head_dim", nh * c->v_head_dim);
    need_dim(r, "kv_lora_rank + qk_rope_head_dim", (int64_t)c->kv_lora_rank + c->qk_rope_head_dim);
}

static void validate_moe(reader *r, const eng_config *c) {
    need_pos(r, "num_experts_per_token", c->num_experts_per_token);
    need_pos(r, "moe_intermediate_size", c->moe_intermediate_size);
    need_nonneg(r, "num_shared_experts", c->num_shared_experts);
    need_nonneg(r, "first_k_dense_replace", c->first_k_dense_replace);
    need_pos(r, "moe_layer_freq", c->moe_layer_freq);
    need_pos(r, "num_expert_group", c->num_expert_group);
    need_pos(r, "topk_group", c->topk_group);
    if (r->rc != KDS_OK) return;
    need_dim(r, "moe_intermediate_size * num_shared_experts",
             (int64_t)c->moe_intermediate_size * c->num_shared_experts);
    if (c->num_experts > 65536)
        fail(r, KDS_INVALID_ARG, "num_experts %d is too large (max 65536)", c->num_experts);
    if (c->num_experts_per_token > c->num_experts)
        fail(r, KDS_INVALID_ARG, "num_experts_per_token (%d) is larger than num_experts (%d)",
             c->num_experts_per_token, c->num_experts);
    if (c->num_experts % c->num_expert_group != 0)
        fail(r, KDS_INVALID_ARG, "num_experts (%d) must be a multiple of num_expert_group (%d)",
             c->num_experts, c->num_expert_group);
    if (c->topk_group > c->num_expert_group)
        fail(r, KDS_INVALID_ARG, "topk_group (%d) is larger than num_expert_group (%d)",
             c->topk_group, c->num_expert_group);
    if (r->rc != KDS_OK) return;
    int64_t reachable = (int64_t)c->topk_group * (c->num_experts / c->num_expert_group);
    if (c->num_experts_per_token > reachable)
        fail(r, KDS_INVALID_ARG,
             "num_experts_per_token (%d) exceeds the %lld experts that "
             "topk_group (%d) of num_expert_group (%d) groups offer",
             c->num_experts_per_token, (long long)reachable, c->topk_group, c->num_expert_group);
    if (!(c->routed_scaling_factor > 0.0f))
        fail(r, KDS_INVALID_ARG, "routed_scaling_factor must be positive (got %g)",
             (double)c->routed_scaling_factor);
    if (strcmp(c->moe_router_activation_func, "sigmoid") != 0)
        fail(r, KDS_UNSUPPORTED,
             "moe_router_activation_func '%s' is not supported (only "
             "'sigmoid')",
             c->moe_router_activation_func);
}

static void validate(reader *r, const eng_config *c) {
    need_pos(r, "vocab_size", c->vocab_size);
    need_pos(r, "hidden_size", c->hidden_size);
    need_pos(r, "num_attention_heads", c->num_attention_heads);
    need_pos(r, "num_key_value_heads", c->num_key_value_heads);
    need_nonneg(r, "head_dim", c->head_dim);
    if (r->rc != KDS_OK) return;
    if (!(c->rms_norm_eps > 0.0f) || c->rms_norm_eps > 1.0f)
        fail(r, KDS_INVALID_ARG, "rms_norm_eps must be in (0, 1] (got %g)",
             (double)c->rms_norm_eps);
    const char *id_names[3] = {"bos_token_id", "eos_token_id", "pad_token_id"};
    int ids[3] = {c->bos_token_id, c->eos_token_id, c->pad_token_id};
    for (int i = 0; i < 3; i++)
        if (ids[i] >= c->vocab_size)
            fail(r, KDS_INVALID_ARG, "%s %d is outside the vocabulary (vocab_size %d)", id_names[i],
                 ids[i], c->vocab_size);
    if (c->model_max_length < 0) fail(r, KDS_INVALID_ARG, "model_max_length must not be negative");

    bool any_dense = false;
    for (int l = 0; l < c->num_hidden_layers; l++)
        any_dense |= !c->layer_is_moe[l];
    if (c->n_kda_layers > 0) validate_kda(r, c);
    if (c->n_mla_layers > 0) validate_mla(r, c);
    if (any_dense) need_pos(r, "intermediate_size", c->intermediate_size);
    if (c->num_experts < 0)
        fail(r, KDS_INVALID_ARG, "num_experts must not be negative (got %d)", c->num_experts);
    if (c->num_experts > 0) validate_moe(r, c);
    /* the kernels divide by them (CPU and GPU): finite and positive */
    if (c->hidden_act == ENG_ACT_SITU &&
        (!(c->situ_beta > 0.0f && isfinite(c->situ_beta)) ||
         !(c->situ_linear_beta > 0.0f && isfinite(c->situ_linear_beta))))
        fail(r, KDS_INVALID_ARG,
             "activation_situ_beta and activation_situ_linear_beta must be positive and finite "
             "(got %g, %g)",
             (double)c->situ_beta, (double)c->situ_linear_beta);
    need_nonneg(r, "attn_res_block_size", c->attn_res_block_size);
    /* the mix takes at most 64 candidates: 63 snapshots and the partial */
    if (r->rc == KDS_OK && c->attn_res_block_size > 0 &&
        (c->num_hidden_layers + c->attn_res_block_size - 1) / c->attn_res_block_size > 63)
        fail(r, KDS_UNSUPPORTED,
             "attn_res_block_size %d makes %d blocks of num_hidden_layers %d (at most 63 supported)",
             c->attn_res_block_size,
             (c->num_hidden_layers + c->attn_res_block_size - 1) / c->attn_res_block_size,
             c->num_hidden_layers);
    need_nonneg(r, "routed_expert_hidden_size", c->latent_size);
    if (r->rc == KDS_OK && c->latent_size > 0 && c->num_experts == 0)
        fail(r, KDS_INVALID_ARG, "routed_expert_hidden_size %d without routed experts (num_experts)",
             c->latent_size);
    if (r->rc == KDS_OK && c->latent_moe_use_norm && c->latent_size == 0)
        fail(r, KDS_INVALID_ARG, "latent_moe_use_norm without routed_expert_hidden_size");
    if (r->rc != KDS_OK) return;

    /* Keep every later size computation (size_t) far from overflow. */
    double D = c->hidden_size;
    double per_layer =
        3.0 * c->kda_num_v_heads * c->kda_head_dim * D +
        3.0 * c->num_attention_heads *
            ((double)c->qk_nope_head_dim + c->qk_rope_head_dim + c->v_head_dim) * D +
        3.0 * c->intermediate_size * D +
        3.0 * c->moe_intermediate_size * D * ((double)c->num_experts + c->num_shared_experts);
    double params = 2.0 * c->vocab_size * D + c->num_hidden_layers * per_layer;
    if (params > CFG_MAX_PARAMS)
        fail(r, KDS_INVALID_ARG, "the model would have about %.3g parameters (max %.3g)", params,
             CFG_MAX_PARAMS);
}

/* ------------------------------------------------------------------------ */

/* Everything but the layer table and the checks. */
static void read_fields(reader *r, const cJSON *root, eng_config *c) {
    /* global */
    read_int(r, root, "vocab_size", "vocab_size", true, 0, &c->vocab_size);
    read_int(r, root, "hidden_size", "hidden_size", true, 0, &c->hidden_size);
    read_int(r, root, "num_hidden_layers", "num_hidden_layers", true, 0, &c->num_hidden_layers);
    /* HF defaults: 32 attention heads, kv heads = attention heads, legacy
     * head_dim = hidden / heads. */
    read_int(r, root, "num_attention_heads", "num_attention_heads", false, 32,
             &c->num_attention_heads);
    read_int(r, root, "num_key_value_heads", "num_key_value_heads", false, c->num_attention_heads,
             &c->num_key_value_heads);
    read_int(r, root, "head_dim", "head_dim", false,
             c->num_attention_heads > 0 ? c->hidden_size / c->num_attention_heads : 0,
             &c->head_dim);
    read_int(r, root, "intermediate_size", "intermediate_size", false, 0, &c->intermediate_size);
    read_float(r, root, "rms_norm_eps", "rms_norm_eps", 1e-6f, &c->rms_norm_eps, NULL);
    read_bool(r, root, "tie_word_embeddings", "tie_word_embeddings", false,
              &c->tie_word_embeddings);
    read_token_id(r, root, "bos_token_id", &c->bos_token_id);
    read_token_id(r, root, "eos_token_id", &c->eos_token_id);
    read_token_id(r, root, "pad_token_id", &c->pad_token_id);
    read_int64(r, root, "model_max_length", 0, &c->model_max_length);
    /* Newer transformers write "dtype", older "torch_dtype". */
    read_str(r, root, "torch_dtype", "", c->torch_dtype, sizeof c->torch_dtype);
    if (!c->torch_dtype[0]) read_str(r, root, "dtype", "", c->torch_dtype, sizeof c->torch_dtype);

    /* MLA (HF leaves these None when there is no MLA) */
    read_bool(r, root, "mla_use_nope", "mla_use_nope", false, &c->mla_use_nope);
    read_int(r, root, "q_lora_rank", "q_lora_rank", false, 0, &c->q_lora_rank);
    read_int(r, root, "kv_lora_rank", "kv_lora_rank", false, 0, &c->kv_lora_rank);
    read_int(r, root, "qk_nope_head_dim", "qk_nope_head_dim", false, 0, &c->qk_nope_head_dim);
    read_int(r, root, "qk_rope_head_dim", "qk_rope_head_dim", false, 0, &c->qk_rope_head_dim);
    read_int(r, root, "v_head_dim", "v_head_dim", false, 0, &c->v_head_dim);

    /* MoE (num_experts null/absent: dense everywhere, HF's is_moe false) */
    read_int(r, root, "num_experts", "num_experts", false, 0, &c->num_experts);
    bool moe = c->num_experts > 0;
    read_int(r, root, "num_experts_per_token", "num_experts_per_token", moe, 0,
             &c->num_experts_per_token);
    read_int(r, root, "num_shared_experts", "num_shared_experts", false, 0, &c->num_shared_experts);
    read_int(r, root, "moe_intermediate_size", "moe_intermediate_size", moe, 0,
             &c->moe_intermediate_size);
    read_int(r, root, "first_k_dense_replace", "first_k_dense_replace", false, 0,
             &c->first_k_dense_replace);
    read_int(r, root, "moe_layer_freq", "moe_layer_freq", false, 1, &c->moe_layer_freq);
    read_bool(r, root, "moe_renormalize", "moe_renormalize", true, &c->moe_renormalize);
    read_float(r, root, "routed_scaling_factor", "routed_scaling_factor", 1.0f,
               &c->routed_scaling_factor, NULL);
    read_bool(r, root, "use_grouped_topk", "use_grouped_topk", true, &c->use_grouped_topk);
    read_int(r, root, "num_expert_group", "num_expert_group", false, 1, &c->num_expert_group);
    read_int(r, root, "topk_group", "topk_group", false, 1, &c->topk_group);
    read_str(r, root, "moe_router_activation_func", "sigmoid", c->moe_router_activation_func,
             sizeof c->moe_router_activation_func);
}

/* linear_attn_config: the layer table and the KDA sizes. */
static void read_layers(reader *r, const cJSON *root, eng_config *c) {
    if (r->rc != KDS_OK) return;
    int L = c->num_hidden_layers;
    if (L <= 0) {
        fail(r, KDS_INVALID_ARG, "num_hidden_layers must be positive (got %d)", L);
        return;
    }
    if (L > ENG_MAX_LAYERS) {
        fail(r, KDS_INVALID_ARG, "num_hidden_layers %d is more than the %d supported", L,
             ENG_MAX_LAYERS);
        return;
    }
    const cJSON *lac = cJSON_GetObjectItemCaseSensitive(root, "linear_attn_config");
    if (!lac) {
        missing(r, "linear_attn_config");
        return;
    }
    if (!cJSON_IsObject(lac)) {
        bad_type(r, "linear_attn_config", "an object");
        return;
    }
    unsigned char seen[ENG_MAX_LAYERS] = {0};
    read_layer_list(r, lac, "kda_layers", L, seen, 1);
    read_layer_list(r, lac, "full_attn_layers", L, seen, 2);
    if (r->rc != KDS_OK) return;
    for (int l = 0; l < L; l++) {
        if (seen[l] == 0 || seen[l] == 3) {
            fail(r, KDS_INVALID_ARG,
                 "layer %d (1-based) must be in exactly one of "
                 "linear_attn_config.kda_layers and linear_attn_config.full_attn_layers "
                 "(it is in %s)",
                 l + 1, seen[l] ? "both" : "neither");
            return;
        }
        c->layer_kind[l] = seen[l] == 1 ? ENG_LAYER_KDA : ENG_LAYER_MLA;
        if (seen[l] == 1)
            c->n_kda_layers++;
        else
            c->n_mla_layers++;
        /* is_moe(l) as HF's KimiDecoderLayer decides it */
        c->layer_is_moe[l] = c->num_experts > 0 && l >= c->first_k_dense_replace &&
                             c->moe_layer_freq > 0 && l % c->moe_layer_freq == 0;
    }
    bool kda = c->n_kda_layers > 0;
    read_int(r, lac, "num_heads", "linear_attn_config.num_heads", kda, 0, &c->kda_num_heads);
    read_int(r, lac, "num_v_heads", "linear_attn_config.num_v_heads", false, c->kda_num_heads,
             &c->kda_num_v_heads);
    read_int(r, lac, "head_dim", "linear_attn_config.head_dim", kda, 0, &c->kda_head_dim);
    c->kda_v_head_dim = c->kda_head_dim; /* Kimi-Linear: V = K (there is no expand_v field) */
    read_int(r, lac, "short_conv_kernel_size", "linear_attn_config.short_conv_kernel_size", false,
             4, &c->short_conv_kernel_size);
    read_float(r, lac, "gate_lower_bound", "linear_attn_config.gate_lower_bound", 0.0f,
               &c->gate_lower_bound, &c->has_gate_lower_bound);
    read_bool(r, lac, "use_full_rank_gate", "linear_attn_config.use_full_rank_gate", false,
              &c->use_full_rank_gate);
    if (c->n_mla_layers > 0) {
        const char *need[] = {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"};
        for (size_t i = 0; i < sizeof need / sizeof need[0]; i++)
            if (absent(cJSON_GetObjectItemCaseSensitive(root, need[i]))) missing(r, need[i]);
    }
}

/* quantization_config (compressed-tensors, kimi-k3.md §2, §4.9): only
 * MXFP4 weights in groups of 32 with E8M0 scales and no activation
 * quantization; which tensors it covers the checkpoint's tensors say (a
 * quantised weight is a NAME_packed + NAME_scale pair), so `ignore` is read
 * for its type only. */
static void read_quantization(reader *r, const cJSON *q, eng_config *c) {
    if (r->rc != KDS_OK || absent(q)) return;
    if (!cJSON_IsObject(q)) {
        bad_type(r, "quantization_config", "an object");
        return;
    }
    char s[64];
    read_str(r, q, "quant_method", "", s, sizeof s);
    if (r->rc == KDS_OK && strcmp(s, "compressed-tensors") != 0) {
        fail(r, KDS_UNSUPPORTED,
             "quantization_config.quant_method '%s' is not supported (only compressed-tensors)", s);
        return;
    }
    read_str(r, q, "format", "", s, sizeof s);
    if (r->rc == KDS_OK && strcmp(s, "mxfp4-pack-quantized") != 0) {
        fail(r, KDS_UNSUPPORTED,
             "quantization_config.format '%s' is not supported (only mxfp4-pack-quantized)", s);
        return;
    }
    const cJSON *ign = cJSON_GetObjectItemCaseSensitive(q, "ignore");
    if (!absent(ign) && !cJSON_IsArray(ign)) bad_type(r, "quantization_config.ignore", "a list");
    const cJSON *groups = cJSON_GetObjectItemCaseSensitive(q, "config_groups");
    if (absent(groups)) {
        missing(r, "quantization_config.config_groups");
        return;
    }
    if (!cJSON_IsObject(groups)) {
        bad_type(r, "quantization_config.config_groups", "an object");
        return;
    }
    const cJSON *g;
    cJSON_ArrayForEach(g, groups) {
        char path[160];
        snprintf(path, sizeof path, "quantization_config.config_groups.%.40s", g->string);
        if (!cJSON_IsObject(g)) {
            bad_type(r, path, "an object");
            return;
        }
        read_str(r, g, "format", "mxfp4-pack-quantized", s, sizeof s);
        if (r->rc == KDS_OK && strcmp(s, "mxfp4-pack-quantized") != 0)
            fail(r, KDS_UNSUPPORTED, "%s.format '%s' is not supported (only mxfp4-pack-quantized)",
                 path, s);
        const char *acts[2] = {"input_activations", "output_activations"};
        for (int i = 0; i < 2; i++)
            if (!absent(cJSON_GetObjectItemCaseSensitive(g, acts[i])))
                fail(r, KDS_UNSUPPORTED, "%s.%s: quantised activations are not supported", path,
                     acts[i]);
        const cJSON *w = cJSON_GetObjectItemCaseSensitive(g, "weights");
        char wp[192];
        snprintf(wp, sizeof wp, "%s.weights", path);
        if (absent(w)) {
            missing(r, wp);
            return;
        }
        if (!cJSON_IsObject(w)) {
            bad_type(r, wp, "an object");
            return;
        }
        int bits = 0, group = 0;
        bool sym = true;
        char type[32], strategy[32], scale[32];
        read_int(r, w, "num_bits", "num_bits", true, 0, &bits);
        read_int(r, w, "group_size", "group_size", true, 0, &group);
        read_str(r, w, "type", "float", type, sizeof type);
        read_str(r, w, "strategy", "group", strategy, sizeof strategy);
        read_bool(r, w, "symmetric", "symmetric", true, &sym);
        read_str(r, w, "scale_dtype", "torch.uint8", scale, sizeof scale);
        if (r->rc != KDS_OK) return;
        if (bits != 4 || strcmp(type, "float") != 0 || group != 32 || strcmp(strategy, "group") != 0 ||
            !sym || strcmp(scale, "torch.uint8") != 0)
            fail(r, KDS_UNSUPPORTED,
                 "%s: only MXFP4 is supported (num_bits 4, type float, strategy group, group_size "
                 "32, symmetric, scale_dtype torch.uint8); got num_bits %d, type %s, strategy %s, "
                 "group_size %d, %s, scale_dtype %s",
                 wp, bits, type, strategy, group, sym ? "symmetric" : "asymmetric", scale);
    }
    c->experts_mxfp4 = r->rc == KDS_OK;
}

/* The fields Kimi K3 added (kimi-k3.md §2); absent in a Kimi-Linear config,
 * which then keeps its meaning. */
static void read_k3_fields(reader *r, const cJSON *root, eng_config *c) {
    read_bool(r, root, "mla_use_output_gate", "mla_use_output_gate", false, &c->mla_use_output_gate);
    read_int(r, root, "attn_res_block_size", "attn_res_block_size", false, 0,
             &c->attn_res_block_size);
    read_int(r, root, "routed_expert_hidden_size", "routed_expert_hidden_size", false, 0,
             &c->latent_size);
    read_bool(r, root, "latent_moe_use_norm", "latent_moe_use_norm", false,
              &c->latent_moe_use_norm);
    int mtp = 0;
    read_int(r, root, "num_nextn_predict_layers", "num_nextn_predict_layers", false, 0, &mtp);
    if (mtp != 0)
        fail(r, KDS_UNSUPPORTED,
             "num_nextn_predict_layers %d: multi-token prediction layers are not supported", mtp);
    char method[32];
    read_str(r, root, "topk_method", "noaux_tc", method, sizeof method);
    if (r->rc == KDS_OK && strcmp(method, "noaux_tc") != 0)
        fail(r, KDS_UNSUPPORTED, "topk_method '%s' is not supported (only noaux_tc)", method);
    read_quantization(r, cJSON_GetObjectItemCaseSensitive(root, "quantization_config"), c);
    c->mla_lora_norm_eps = c->family == ENG_FAMILY_KIMI_K3 ? 1e-6f : c->rms_norm_eps;
}

/* hidden_act: SwiGLU's silu, or K3's situ with its two caps. */
static void read_act(reader *r, const cJSON *root, eng_config *c) {
    char act[32];
    read_str(r, root, "hidden_act", "silu", act, sizeof act);
    if (r->rc != KDS_OK) return;
    if (strcmp(act, "silu") == 0) {
        c->hidden_act = ENG_ACT_SILU;
    } else if (strcmp(act, "situ") == 0) {
        c->hidden_act = ENG_ACT_SITU;
        read_float(r, root, "activation_situ_beta", "activation_situ_beta", 4.0f, &c->situ_beta, NULL);
        read_float(r, root, "activation_situ_linear_beta", "activation_situ_linear_beta", 25.0f,
                   &c->situ_linear_beta, NULL);
    } else {
        fail(r, KDS_UNSUPPORTED, "hidden_act '%s' is not supported (silu or situ)", act);
    }
}

const char *eng_layer_kind_name(eng_layer_kind k) {
    switch (k) {
    case ENG_LAYER_KDA: return "KDA";
    case ENG_LAYER_MLA: return "MLA";
    }
    return "?";
}

kds_status eng_config_parse(const char *json_text, size_t len, const char *origin, eng_config *out,
                            kds_err *err) {
    reader r = {origin ? origin : "config.json", err, KDS_OK};
    eng_config c;
    memset(&c, 0, sizeof c);
    if (!json_text || !out)
        return kds_err_set(err, KDS_INVALID_ARG, "%s: no JSON text or no output", r.origin);
    cJSON *root = cJSON_ParseWithLength(json_text, len);
    if (!root) return kds_err_set(err, KDS_BAD_FORMAT, "%s: not valid JSON", r.origin);
    if (!cJSON_IsObject(root)) {
        fail(&r, KDS_BAD_FORMAT, "not a JSON object");
        goto out;
    }
    /* Other architectures name their tensors differently: refuse early. A
     * kimi_k3 config holds the text model (a kimi_linear config) in
     * text_config, beside a vision tower this engine does not load. */
    char model_type[64], origin_k3[600];
    const cJSON *text = root;
    read_str(&r, root, "model_type", "kimi_linear", model_type, sizeof model_type);
    if (r.rc == KDS_OK && strcmp(model_type, "kimi_k3") == 0) {
        c.family = ENG_FAMILY_KIMI_K3;
        text = cJSON_GetObjectItemCaseSensitive(root, "text_config");
        if (absent(text))
            missing(&r, "text_config");
        else if (!cJSON_IsObject(text))
            bad_type(&r, "text_config", "an object");
        c.has_vision = cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(root, "vision_config"));
        if (r.rc != KDS_OK) goto out;
        snprintf(origin_k3, sizeof origin_k3, "%s (text_config)", r.origin);
        r.origin = origin_k3;
        read_str(&r, text, "model_type", "kimi_linear", model_type, sizeof model_type);
        if (r.rc == KDS_OK && strcmp(model_type, "kimi_linear") != 0)
            fail(&r, KDS_UNSUPPORTED, "model_type '%s' is not 'kimi_linear'", model_type);
    } else if (r.rc == KDS_OK && strcmp(model_type, "kimi_linear") != 0) {
        fail(&r, KDS_UNSUPPORTED, "model_type '%s' is not 'kimi_linear' or 'kimi_k3'", model_type);
    }
    read_act(&r, text, &c);
    read_fields(&r, text, &c);
    read_layers(&r, text, &c);
    read_k3_fields(&r, text, &c);
    if (r.rc == KDS_OK) validate(&r, &c);
    if (r.rc == KDS_OK) *out = c;
out:
    cJSON_Delete(root);
    return r.rc;
}

kds_status eng_config_load(const char *path, eng_config *out, kds_err *err) {
    char *buf = NULL;
    size_t n = 0;
    /* eng__read_file refuses a FIFO or directory without blocking on it */
    kds_status rc = eng__read_file(path, CFG_MAX_FILE_BYTES, &buf, &n, err);
    if (rc != KDS_OK) return rc;
    rc = eng_config_parse(buf, n, path, out, err);
    free(buf);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Writing                                                                   */

/* The shortest decimal that reads back as the same float, as a double, so
 * that 1e-5f is written "1e-05" rather than "9.99999974737875e-06". */
static double short_float(float f) {
    char buf[32];
    for (int p = 1; p <= 9; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, (double)f);
        double d = strtod(buf, NULL);
        if ((float)d == f) return d;
    }
    return (double)f;
}

static void add_num(cJSON *o, const char *k, double v) {
    cJSON_AddNumberToObject(o, k, v);
}

/* Number when `set`, else null. */
static void add_opt(cJSON *o, const char *k, bool set, double v) {
    if (set)
        cJSON_AddNumberToObject(o, k, v);
    else
        cJSON_AddNullToObject(o, k);
}

static cJSON *layer_list(const eng_config *c, eng_layer_kind kind) {
    cJSON *a = cJSON_CreateArray();
    for (int l = 0; a && l < c->num_hidden_layers; l++)
        if (c->layer_kind[l] == kind) cJSON_AddItemToArray(a, cJSON_CreateNumber(l + 1));
    return a;
}

/* compressed-tensors' MXFP4 for the routed experts, as K3 ships it
 * (kimi-k3.md §2): everything but the experts in `ignore`; dense: every
 * Linear but the embedding, the routers, MLA's kv_b_proj and the vision
 * tower (`kdaserve quantize --dense mxfp4`). */
void eng__config_add_mxfp4(void *text_object, bool dense) {
    cJSON *o = text_object;
    cJSON *q = cJSON_AddObjectToObject(o, "quantization_config");
    if (!q) return;
    cJSON_AddStringToObject(q, "quant_method", "compressed-tensors");
    cJSON_AddStringToObject(q, "format", "mxfp4-pack-quantized");
    cJSON_AddStringToObject(q, "quantization_status", "compressed");
    cJSON *g = cJSON_AddObjectToObject(cJSON_AddObjectToObject(q, "config_groups"), "group_0");
    if (g) {
        cJSON_AddStringToObject(g, "format", "mxfp4-pack-quantized");
        cJSON_AddNullToObject(g, "input_activations");
        cJSON_AddNullToObject(g, "output_activations");
        cJSON_AddItemToObject(g, "targets", cJSON_CreateStringArray((const char *[]){"Linear"}, 1));
        cJSON *w = cJSON_AddObjectToObject(g, "weights");
        if (w) {
            add_num(w, "num_bits", 4);
            cJSON_AddStringToObject(w, "type", "float");
            cJSON_AddStringToObject(w, "strategy", "group");
            add_num(w, "group_size", 32);
            cJSON_AddBoolToObject(w, "symmetric", true);
            cJSON_AddBoolToObject(w, "dynamic", false);
            cJSON_AddStringToObject(w, "scale_dtype", "torch.uint8");
        }
    }
    const char *ignore[] = {"re:.*self_attn.*", "re:.*shared_experts.*",
                            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
                            "re:.*vision_tower.*", "re:.*mm_projector.*"};
    const char *ignore_dense[] = {"re:.*embed_tokens.*", "re:.*\\.gate$", "re:.*kv_b_proj.*",
                                  "re:.*vision_tower.*", "re:.*mm_projector.*"};
    cJSON_AddItemToObject(q, "ignore", dense ? cJSON_CreateStringArray(ignore_dense, 5)
                                             : cJSON_CreateStringArray(ignore, 6));
}

/* A K3 checkpoint's config: the text model in text_config (no vision
 * config: a generated model has no vision tower). Takes `text`. */
static cJSON *wrap_k3(const eng_config *c, cJSON *text) {
    cJSON *o = cJSON_CreateObject();
    if (!o) {
        cJSON_Delete(text);
        return NULL;
    }
    cJSON *arch = cJSON_AddArrayToObject(o, "architectures");
    if (arch) cJSON_AddItemToArray(arch, cJSON_CreateString("KimiK3ForConditionalGeneration"));
    cJSON_AddStringToObject(o, "model_type", "kimi_k3");
    add_opt(o, "bos_token_id", c->bos_token_id >= 0, c->bos_token_id);
    add_opt(o, "eos_token_id", c->eos_token_id >= 0, c->eos_token_id);
    add_opt(o, "pad_token_id", c->pad_token_id >= 0, c->pad_token_id);
    if (c->torch_dtype[0]) cJSON_AddStringToObject(o, "dtype", c->torch_dtype);
    cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_word_embeddings);
    cJSON_AddItemToObject(o, "text_config", text);
    return o;
}

char *eng_config_to_json(const eng_config *c) {
    char *text = NULL;
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    /* Field order follows the real Kimi-Linear-48B config.json. */
    cJSON *arch = cJSON_AddArrayToObject(o, "architectures");
    if (arch) cJSON_AddItemToArray(arch, cJSON_CreateString("KimiLinearForCausalLM"));
    cJSON *am = cJSON_AddObjectToObject(o, "auto_map");
    if (am) {
        cJSON_AddStringToObject(am, "AutoConfig", "configuration_kimi.KimiLinearConfig");
        cJSON_AddStringToObject(am, "AutoModel", "modeling_kimi.KimiLinearModel");
        cJSON_AddStringToObject(am, "AutoModelForCausalLM", "modeling_kimi.KimiLinearForCausalLM");
    }
    cJSON_AddStringToObject(o, "model_type", "kimi_linear");
    add_num(o, "vocab_size", c->vocab_size);
    add_num(o, "hidden_size", c->hidden_size);
    add_num(o, "num_hidden_layers", c->num_hidden_layers);
    add_num(o, "num_attention_heads", c->num_attention_heads);
    add_num(o, "num_key_value_heads", c->num_key_value_heads);
    add_num(o, "head_dim", c->head_dim);
    add_opt(o, "intermediate_size", c->intermediate_size > 0, c->intermediate_size);
    cJSON_AddStringToObject(o, "hidden_act", c->hidden_act == ENG_ACT_SITU ? "situ" : "silu");
    if (c->hidden_act == ENG_ACT_SITU) {
        add_num(o, "activation_situ_beta", short_float(c->situ_beta));
        add_num(o, "activation_situ_linear_beta", short_float(c->situ_linear_beta));
    }
    add_num(o, "rms_norm_eps", short_float(c->rms_norm_eps));
    add_num(o, "rope_theta", 10000.0);
    cJSON_AddNullToObject(o, "rope_scaling");
    cJSON_AddBoolToObject(o, "mla_use_nope", c->mla_use_nope);
    /* HF's Optional[int] fields: null when unset (0 here) */
    add_opt(o, "q_lora_rank", c->q_lora_rank > 0, c->q_lora_rank);
    add_opt(o, "kv_lora_rank", c->kv_lora_rank > 0, c->kv_lora_rank);
    /* with MLA layers these are required, and 0 is a valid width (no rope
     * or no nope part): written as 0 then, not null, so they read back */
    const bool mla = c->n_mla_layers > 0;
    add_opt(o, "qk_nope_head_dim", mla || c->qk_nope_head_dim > 0, c->qk_nope_head_dim);
    add_opt(o, "qk_rope_head_dim", mla || c->qk_rope_head_dim > 0, c->qk_rope_head_dim);
    add_opt(o, "v_head_dim", c->v_head_dim > 0, c->v_head_dim);
    cJSON *lac = cJSON_AddObjectToObject(o, "linear_attn_config");
    if (lac) {
        cJSON_AddItemToObject(lac, "kda_layers", layer_list(c, ENG_LAYER_KDA));
        cJSON_AddItemToObject(lac, "full_attn_layers", layer_list(c, ENG_LAYER_MLA));
        add_num(lac, "num_heads", c->kda_num_heads);
        add_num(lac, "head_dim", c->kda_head_dim);
        add_num(lac, "short_conv_kernel_size", c->short_conv_kernel_size);
        if (c->kda_num_v_heads != c->kda_num_heads) add_num(lac, "num_v_heads", c->kda_num_v_heads);
        if (c->has_gate_lower_bound)
            add_num(lac, "gate_lower_bound", short_float(c->gate_lower_bound));
        if (c->use_full_rank_gate) cJSON_AddBoolToObject(lac, "use_full_rank_gate", true);
    }
    /* K3's fields, only where they are set (a Kimi-Linear config is written
     * as before, byte for byte) */
    if (c->mla_use_output_gate) cJSON_AddBoolToObject(o, "mla_use_output_gate", true);
    if (c->attn_res_block_size > 0) add_num(o, "attn_res_block_size", c->attn_res_block_size);
    if (c->latent_size > 0) {
        add_num(o, "routed_expert_hidden_size", c->latent_size);
        cJSON_AddBoolToObject(o, "latent_moe_use_norm", c->latent_moe_use_norm);
    }
    if (c->experts_mxfp4) eng__config_add_mxfp4(o, false);
    add_opt(o, "num_experts", c->num_experts > 0, c->num_experts);
    add_opt(o, "num_experts_per_token", c->num_experts_per_token > 0, c->num_experts_per_token);
    add_num(o, "num_shared_experts", c->num_shared_experts);
    add_opt(o, "moe_intermediate_size", c->moe_intermediate_size > 0, c->moe_intermediate_size);
    add_num(o, "first_k_dense_replace", c->first_k_dense_replace);
    add_num(o, "moe_layer_freq", c->moe_layer_freq);
    cJSON_AddStringToObject(o, "moe_router_activation_func",
                            c->moe_router_activation_func[0] ? c->moe_router_activation_func
                                                             : "sigmoid");
    cJSON_AddBoolToObject(o, "moe_renormalize", c->moe_renormalize);
    add_num(o, "routed_scaling_factor", short_float(c->routed_scaling_factor));
    cJSON_AddBoolToObject(o, "use_grouped_topk", c->use_grouped_topk);
    add_num(o, "num_expert_group", c->num_expert_group);
    add_num(o, "topk_group", c->topk_group);
    add_num(o, "num_nextn_predict_layers", 0);
    cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_word_embeddings);
    if (c->torch_dtype[0]) {
        cJSON_AddStringToObject(o, "torch_dtype", c->torch_dtype);
        cJSON_AddStringToObject(o, "dtype", c->torch_dtype);
    }
    if (c->model_max_length > 0) add_num(o, "model_max_length", (double)c->model_max_length);
    add_opt(o, "bos_token_id", c->bos_token_id >= 0, c->bos_token_id);
    add_opt(o, "eos_token_id", c->eos_token_id >= 0, c->eos_token_id);
    add_opt(o, "pad_token_id", c->pad_token_id >= 0, c->pad_token_id);
    add_num(o, "initializer_range", 0.02);
    cJSON_AddBoolToObject(o, "use_cache", true);
    if (c->family == ENG_FAMILY_KIMI_K3) o = wrap_k3(c, o);
    text = o ? cJSON_Print(o) : NULL;
    cJSON_Delete(o);
    return text;
}

