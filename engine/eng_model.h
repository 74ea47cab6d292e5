/*
 * eng_model.h - engine-internal view of a loaded model: the config, and the
 * layer plan (engine/eng_plan.h): for every layer its kinds and the weights
 * the forward pass reads.
 *
 * Large matrices stay where they are (an mmap of the safetensors shards, in
 * their stored format: kern.h's element formats, or a block format with its
 * scales). Small per-channel vectors (norm weights, A_log, dt_bias, conv
 * taps, router bias) are converted once to float32 into `small_f32`, an
 * arena owned by the model, because the hot path reads them for every token.
 * Every matrix is also listed in `weights` by its id, and every vector lies
 * in the arena, so a backend copies all of them without knowing the layer
 * kinds (engine/eng_cuda.c).
 *
 * Not part of the public API (engine/eng.h is); included by the engine sources and
 * by tests that poke at internals.
 */
#ifndef ENG_MODEL_H
#define ENG_MODEL_H

#include "eng.h"
#include "eng_config.h"
#include "eng_safetensors.h"
#include "eng_util.h"
#include "kern.h"

/* A 2-D weight [rows, cols] (PyTorch Linear: out, in) read in place. An
 * absent optional weight has rows == 0, data NULL and id 0. */
typedef struct eng_weight {
    kern_dtype dt;      /* element or block format (kern.h) */
    const void *data;   /* borrowed from the mapping; NULL in a generated model */
    const void *scales; /* a block format's scales, borrowed; NULL for element formats */
    int rows, cols;
    int id;             /* index in eng_model.weights, from 1 (0: no weight) */
    uint64_t gen_key;   /* generated model (data NULL): element i is */
    float gen_sd;       /* kern_gen_normal(gen_key, i, gen_sd), made on the device */
} eng_weight;

/* The kernels' view of a weight (kern.h). */
static inline kern_weight eng__kern_weight(const eng_weight *w) {
    return (kern_weight){
        .dt = w->dt, .data = w->data, .scales = w->scales, .rows = w->rows, .cols = w->cols};
}

typedef struct eng_kda_weights {
    eng_weight q_proj, k_proj, v_proj;      /* [H*K, hidden], [H*K, hidden], [HV*V, hidden] */
    /* [C, W] f32 (taps contiguous, last = current): q, k, v one after the
     * other in the arena, so q_conv is also the whole [conv_ch, W] */
    const float *q_conv, *k_conv, *v_conv;
    eng_weight f_a_proj, f_b_proj;          /* [K, hidden], [HV*K, K] */
    const float *A_log;                     /* [HV] */
    const float *dt_bias;                   /* [HV*K] */
    eng_weight b_proj;                      /* [HV, hidden] */
    eng_weight g_a_proj, g_b_proj;          /* [V, hidden], [HV*V, V] (the low-rank output gate) */
    eng_weight g_proj;                      /* [HV*V, hidden]: the full-rank one (K3) */
    const float *o_norm;                    /* [V] */
    eng_weight o_proj;                      /* [hidden, HV*V] */
} eng_kda_weights;

typedef struct eng_mla_weights {
    eng_weight q_proj;                 /* [nh*(dn+dr), hidden] (q_lora_rank == 0) */
    eng_weight q_a_proj, q_b_proj;     /* when q_lora_rank > 0 */
    const float *q_a_layernorm;        /* [q_lora_rank] or NULL */
    eng_weight kv_a_proj_with_mqa;     /* [kv_lora_rank + dr, hidden] */
    const float *kv_a_layernorm;       /* [kv_lora_rank] */
    eng_weight kv_b_proj;              /* [nh*(dn+dv), kv_lora_rank] */
    eng_weight g_proj;                 /* [nh*dv, hidden]: the sigmoid output gate (K3), or none */
    eng_weight o_proj;                 /* [hidden, nh*dv] */
} eng_mla_weights;

typedef struct eng_ffn_weights {
    /* dense MLP (ENG_FFN_DENSE) */
    eng_weight gate_proj, up_proj, down_proj;
    /* MoE (ENG_FFN_MOE, ENG_FFN_LATENT_MOE) */
    eng_weight router;                    /* [E, hidden] */
    const float *router_bias;             /* [E] e_score_correction_bias, or NULL */
    eng_weight *w1, *w3, *w2;             /* E each: [I, in], [I, in], [in, I]; in = hidden, or
                                           * the latent width L (ENG_FFN_LATENT_MOE) */
    int bank;                             /* index among the model's MoE layers (a backend
                                           * keeps each layer's experts together by it) */
    eng_weight sh_gate, sh_up, sh_down;   /* shared experts (rows 0 when none), on the full width */
    /* latent MoE (K3): x -> latent_down -> experts -> combine -> norm -> latent_up */
    eng_weight latent_down, latent_up;    /* [L, hidden], [hidden, L] */
    const float *latent_norm;             /* [L] routed_expert_norm, or NULL (no norm) */
} eng_ffn_weights;

/* One entry of the layer plan: what the layer is made of, and its
 * weights. The kinds come from the config (eng__plan_layer). */
typedef struct eng_layer_weights {
    eng_layer_kind kind;                   /* the token mixer */
    eng_ffn_kind ffn_kind;                 /* the feed-forward sublayer */
    eng_input_kind input_kind;             /* how the sublayers' inputs are formed */
    int slot;                              /* index among the layers of its mixer kind */
    const float *input_layernorm;          /* [hidden] */
    const float *post_attention_layernorm; /* [hidden] */
    /* Block Attention Residuals (ENG_INPUT_ATTN_RES): each sublayer's key
     * norm weight [hidden] and pseudo-query [1, hidden] as stored, and
     * their product, the fused query u = norm * proj the mix reads */
    const float *attn_res_norm, *attn_res_proj, *attn_res_u;
    const float *mlp_res_norm, *mlp_res_proj, *mlp_res_u;
    eng_kda_weights kda;                   /* kind ENG_LAYER_KDA */
    eng_mla_weights mla;                   /* kind ENG_LAYER_MLA */
    eng_ffn_weights ffn;
} eng_layer_weights;

#define ENG_MAX_SHARDS 256

struct eng_model {
    char *dir;
    eng_config cfg;
    char fingerprint[33];            /* 32 hex digits + NUL */
    eng_st_file *shards[ENG_MAX_SHARDS];
    int n_shards;
    eng_weight embed_tokens;         /* [vocab, hidden] */
    const float *final_norm;         /* [hidden] */
    const float *out_res_norm, *out_res_proj, *out_res_u; /* the output mix (ENG_INPUT_ATTN_RES) */
    eng_weight lm_head;              /* [vocab, hidden]; the embedding's twin when tied */
    eng_layer_weights *layers;       /* [num_hidden_layers]: the layer plan */
    int n_moe;                       /* MoE layers (expert banks) */
    const eng_ffn_weights **banks;   /* [n_moe]: each MoE layer's FFN, by eng_ffn_weights.bank */
    eng_weight *expert_arena;        /* backing store of the w1/w3/w2 arrays */
    const eng_weight **weights;      /* [n_weights]: every bound matrix by id ([0] NULL) */
    int n_weights, cap_weights;
    float *small_f32;                /* arena of converted small vectors */
    size_t small_f32_used, small_f32_cap;
    eng_tokenizer *tokenizer;        /* owned */
    bool generated;                  /* eng_model_generate: matrices exist only on a device */
    /* Expert parallelism (eng_model_params.ep_*, engine/eng_ep.h): this
     * process is rank ep_rank of ep_ranks and holds the routed experts
     * ep_placement gives it; the others' eng_weight data is NULL. ep_ranks
     * 1: every expert. ep_digest: XXH3-128 of the config, every tensor's
     * header and every tensor but the routed experts (ep_ranks > 1), which
     * every rank of a job must agree on. */
    int ep_rank, ep_ranks;
    eng_ep_placement ep_placement;
    unsigned char ep_digest[16];
};

#endif /* ENG_MODEL_H */
