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

/* A layer's feed-forward sublayer (layer_is_moe[] and latent_size below
 * decide). */
typedef enum eng_ffn_kind {
    ENG_FFN_DENSE = 0,      /* gated MLP (SwiGLU, or SiTU) */
    ENG_FFN_MOE = 1,        /* routed experts + shared experts */
    ENG_FFN_LATENT_MOE = 2, /* Kimi K3's: the routed experts in a narrower latent space behind
                             * shared down/up projections (kimi-k3.md §4.5) */
} eng_ffn_kind;

/* How a layer forms the input of each sublayer. */
typedef enum eng_input_kind {
    /* Kimi-Linear: every sublayer's output is added to one running
     * residual stream, x += f(norm(x)). */
    ENG_INPUT_RESIDUAL = 0,
    /* Kimi K3's Block Attention Residuals (kimi-k3.md §4.2): a sublayer's
     * input is a softmax mix over the block snapshots and the current
     * block's partial sum, per token along depth. */
    ENG_INPUT_ATTN_RES = 1,
} eng_input_kind;

/* Which checkpoint layout: a Kimi-Linear config.json, or Kimi K3's (a
 * kimi_k3 config whose text_config is the text model, its tensors under
 * language_model., a vision tower beside it). */
typedef enum eng_family {
    ENG_FAMILY_KIMI_LINEAR = 0,
    ENG_FAMILY_KIMI_K3 = 1,
} eng_family;

/* The FFNs' gated activation (hidden_act). */
typedef enum eng_act {
    ENG_ACT_SILU = 0, /* SwiGLU: silu(gate) * up */
    ENG_ACT_SITU = 1, /* SiTU (kimi-k3.md §4.6) */
} eng_act;

typedef struct eng_config {
    eng_family family;
    bool has_vision;              /* a vision tower is in the checkpoint (not loaded: text only) */
    /* global */
    int vocab_size;
    int hidden_size;
    int num_hidden_layers;
    int num_attention_heads;      /* MLA heads */
    int num_key_value_heads;      /* informational */
    int head_dim;                 /* legacy, unused by the math */
    int intermediate_size;        /* dense MLP width */
    eng_act hidden_act;
    float situ_beta, situ_linear_beta; /* SiTU's soft caps (activation_situ_[linear_]beta) */
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
    bool use_full_rank_gate;      /* output gate g_proj [HV*V, hidden] instead of g_a, g_b */

    /* MLA */
    bool mla_use_nope;
    int q_lora_rank;              /* 0 = none (plain q_proj) */
    int kv_lora_rank;
    int qk_nope_head_dim;
    int qk_rope_head_dim;
    int v_head_dim;
    bool mla_use_output_gate;     /* o *= sigmoid(g_proj(x)) before o_proj */
    float mla_lora_norm_eps;      /* q_a_layernorm's and kv_a_layernorm's eps: rms_norm_eps for
                                   * Kimi-Linear, 1e-6 for K3 (its HF code; kimi-k3.md §12) */

    /* Block Attention Residuals (K3): decoder layers per block; 0 = off */
    int attn_res_block_size;

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
    int latent_size;              /* routed_expert_hidden_size (K3's latent MoE); 0 = none */
    bool latent_moe_use_norm;     /* RMSNorm on the combined latent output */
    bool experts_mxfp4;           /* quantization_config: compressed-tensors mxfp4-pack-quantized
                                   * routed experts (the tensors say which format they are) */

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

/* Serialise as a complete config.json (every field the real Kimi-Linear-48B
 * config has; for K3 a kimi_k3 config with the text model in text_config,
 * as the real K3 has it). Caller owns the string: free(). */
char *eng_config_to_json(const eng_config *c);

/* Engine-internal: add K3's compressed-tensors MXFP4 quantization_config
 * to a config's text object (a cJSON *): the routed experts only, or with
 * dense every Linear but the embedding, the routers and a vision tower. */
void eng__config_add_mxfp4(void *text_object, bool dense);

/* Derived sizes. Per-sequence state layout: see docs/formats.md. */
size_t eng_config_param_count(const eng_config *c);
size_t eng_config_tensor_count(const eng_config *c);

#endif /* ENG_CONFIG_H */
