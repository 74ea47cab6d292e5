/*
 * eng_config.h - the Kimi-Linear model configuration (config.json), parsed
 * and checked. See ../shared/reference/kda-model-spec.md §1 for the fields.
 *
 * Parsing keeps every field of the Kimi-Linear family; fields that the math
 * needs are checked for presence, type and consistency (head counts that
 * divide, layer lists inside range, top-k <= experts, ...), and the first
 * problem is reported with the field's name. Optional fields get the
 * defaults of HF's configuration_kimi.py.
 *
 * Ownership: plain data, no pointers; copy freely. Thread-safety: immutable
 * once parsed.
 */
#ifndef ENG_CONFIG_H
#define ENG_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kds_status.h"

#define ENG_MAX_LAYERS 256

/* A layer's token mixer (the layer plan, engine/eng_plan.h, gives every
 * layer one; which one is this config's layer_kind[]). */
typedef enum eng_layer_kind {
    ENG_LAYER_KDA = 0,
    ENG_LAYER_MLA = 1,
} eng_layer_kind;

/* "KDA", "MLA": a mixer's name for messages and `info`. */
const char *eng_layer_kind_name(eng_layer_kind k);

/* A layer's feed-forward sublayer (layer_is_moe[] below decides). */
typedef enum eng_ffn_kind {
    ENG_FFN_DENSE = 0, /* SwiGLU MLP */
    ENG_FFN_MOE = 1,   /* routed experts + shared experts */
} eng_ffn_kind;

/* How a layer forms the input of each sublayer: Kimi-Linear adds every
 * sublayer's output to one running residual stream, x += f(norm(x)). */
typedef enum eng_input_kind {
    ENG_INPUT_RESIDUAL = 0,
} eng_input_kind;

typedef struct eng_config {
    /* global */
    int vocab_size;
    int hidden_size;
    int num_hidden_layers;
    int num_attention_heads;      /* MLA heads */
    int num_key_value_heads;      /* informational */
    int head_dim;                 /* legacy, unused by the math */
    int intermediate_size;        /* dense MLP width */
    float rms_norm_eps;
    bool tie_word_embeddings;
    int bos_token_id, eos_token_id, pad_token_id; /* -1 when absent */
    int64_t model_max_length;
    char torch_dtype[16];         /* "bfloat16", "float32", ... ("" if absent) */

    /* KDA (linear_attn_config) */
    int kda_num_heads;            /* H  (q/k heads) */
    int kda_num_v_heads;          /* HV (value heads; = H unless num_v_heads given) */
    int kda_head_dim;             /* K  (= V for Kimi-Linear) */
    int kda_v_head_dim;           /* V  */
    int short_conv_kernel_size;   /* W, 4 */
    float gate_lower_bound;       /* < 0: lower-bound gate; 0: softplus gate */
    bool has_gate_lower_bound;

    /* MLA */
    bool mla_use_nope;
    int q_lora_rank;              /* 0 = none (plain q_proj) */
    int kv_lora_rank;
    int qk_nope_head_dim;
    int qk_rope_head_dim;
    int v_head_dim;

    /* MoE */
    int num_experts;              /* 0 = dense everywhere */
    int num_experts_per_token;
    int num_shared_experts;
    int moe_intermediate_size;
    int first_k_dense_replace;
    int moe_layer_freq;
    bool moe_renormalize;
    float routed_scaling_factor;
    bool use_grouped_topk;
    int num_expert_group;
    int topk_group;
    char moe_router_activation_func[16]; /* "sigmoid" */

    /* per layer (0-based) */
    eng_layer_kind layer_kind[ENG_MAX_LAYERS];
    bool layer_is_moe[ENG_MAX_LAYERS];
    int n_kda_layers, n_mla_layers;
} eng_config;

/* Parse config.json text. `origin` names the file in messages. */
kds_status eng_config_parse(const char *json_text, size_t len, const char *origin,
                            eng_config *out, kds_err *err);

/* Read and parse a config.json file. */
kds_status eng_config_load(const char *path, eng_config *out, kds_err *err);

/* Serialise as a complete Kimi-Linear config.json (every field the real
 * Kimi-Linear-48B config has). Caller owns the string: free(). */
char *eng_config_to_json(const eng_config *c);

/* Derived sizes. Per-sequence state layout: see docs/formats.md. */
size_t eng_config_param_count(const eng_config *c);
size_t eng_config_tensor_count(const eng_config *c);

#endif /* ENG_CONFIG_H */
