/*
 * eng_plan.c - the layer plan (eng_plan.h): each layer's kinds, and the one
 * list of every kind's tensors (names, shapes, accepted alternatives, the
 * generator's initialisation) that the loader, the generator and the
 * counts share. Tensor names and shapes: kda-model-spec.md §2.
 */
#include "eng_plan.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng_model.h"

void eng__plan_layer(const eng_config *c, int l, eng_layer_plan *out) {
    out->mixer = c->layer_kind[l];
    out->ffn = !c->layer_is_moe[l] ? ENG_FFN_DENSE : c->latent_size > 0 ? ENG_FFN_LATENT_MOE
                                                                        : ENG_FFN_MOE;
    out->input = c->attn_res_block_size > 0 ? ENG_INPUT_ATTN_RES : ENG_INPUT_RESIDUAL;
    out->slot = 0;
    for (int i = 0; i < l; i++) out->slot += c->layer_kind[i] == out->mixer;
}

/* ------------------------------------------------------------------------ */
/* The tensor lists. One function per kind; each tensor once.               */

typedef struct lister {
    const eng_config *c;
    eng_tensor_fn fn;
    void *user;
    float res;          /* the extra scale of output projections: 1/sqrt(layers) */
    const char *prefix; /* of every name: "language_model." for K3's text tower */
} lister;

/* Standard deviation of a generated weight with `in` inputs (output
 * projections get `res` on top, so the residual stream stays O(1)). */
static float sd(int64_t in, float res) { return res / sqrtf((float)in); }

static void emit(lister *ls, eng_tensor_spec *t, const char *fmt, va_list ap) {
    char name[sizeof t->name];
    vsnprintf(name, sizeof name, fmt, ap);
    snprintf(t->name, sizeof t->name, "%s%s", ls->prefix, name);
    ls->fn(ls->user, t);
}

/* A 2-D weight [rows, cols]; generated as N(0, sd^2). */
static void matrix(lister *ls, eng_weight *w, int64_t rows, int64_t cols, float sdev,
                   const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static void matrix(lister *ls, eng_weight *w, int64_t rows, int64_t cols, float sdev,
                   const char *fmt, ...) {
    eng_tensor_spec t = {.matrix = true, .n_dims = 2, .shape = {rows, cols},
                         .init = ENG_INIT_NORMAL, .a = sdev, .weight = w, .expert = -1,
                         .quant = KERN_F32};
    va_list ap;
    va_start(ap, fmt);
    emit(ls, &t, fmt, ap);
    va_end(ap);
}

/* A routed expert's matrix: marked with its index, and written in the
 * config's expert format by the generator. */
static void expert_matrix(lister *ls, eng_weight *w, int e, int64_t rows, int64_t cols, float sdev,
                          const char *fmt, ...) __attribute__((format(printf, 7, 8)));
static void expert_matrix(lister *ls, eng_weight *w, int e, int64_t rows, int64_t cols, float sdev,
                          const char *fmt, ...) {
    eng_tensor_spec t = {.matrix = true, .n_dims = 2, .shape = {rows, cols},
                         .init = ENG_INIT_NORMAL, .a = sdev, .weight = w, .expert = e,
                         .quant = ls->c->experts_mxfp4 ? KERN_MXFP4 : KERN_F32};
    va_list ap;
    va_start(ap, fmt);
    emit(ls, &t, fmt, ap);
    va_end(ap);
}

/* A small vector of shape `shape` (n_dims dims), or `alt` when alt_dims > 0. */
typedef struct vshape {
    int n_dims;
    int64_t d[4];
} vshape;

static void vector(lister *ls, const float **v, vshape shape, vshape alt, bool optional,
                   eng_init init, float a, float b, const char *fmt, ...)
    __attribute__((format(printf, 9, 10)));
static void vector(lister *ls, const float **v, vshape shape, vshape alt, bool optional,
                   eng_init init, float a, float b, const char *fmt, ...) {
    eng_tensor_spec t = {.matrix = false, .n_dims = shape.n_dims, .n_dims_alt = alt.n_dims,
                         .optional = optional, .init = init, .a = a, .b = b, .vector = v,
                         .expert = -1, .quant = KERN_F32};
    memcpy(t.shape, shape.d, sizeof t.shape);
    memcpy(t.shape_alt, alt.d, sizeof t.shape_alt);
    va_list ap;
    va_start(ap, fmt);
    emit(ls, &t, fmt, ap);
    va_end(ap);
}

static vshape v1(int64_t n) { return (vshape){1, {n, 0, 0, 0}}; }
static const vshape NO_ALT = {0, {0, 0, 0, 0}};

/* A norm weight: U(0.8, 1.2) when generated. */
static void norm(lister *ls, const float **v, int64_t n, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void norm(lister *ls, const float **v, int64_t n, const char *fmt, ...) {
    eng_tensor_spec t = {.matrix = false, .n_dims = 1, .shape = {n}, .init = ENG_INIT_UNIFORM,
                         .a = 0.8f, .b = 1.2f, .vector = v, .expert = -1, .quant = KERN_F32};
    va_list ap;
    va_start(ap, fmt);
    emit(ls, &t, fmt, ap);
    va_end(ap);
}

#define SELF_ATTN "model.layers.%d.self_attn.%s"
#define MOE "model.layers.%d.block_sparse_moe.%s"

/* KDA (spec §3): projections, short convs, gate and beta, output gate and
 * norm. The q, k, v conv taps come one after the other (the arena keeps
 * them contiguous: the forward reads them as one [conv_ch, W]). */
static void kda_tensors(lister *ls, int l, eng_kda_weights *w) {
    const eng_config *c = ls->c;
    const int64_t D = c->hidden_size, H = c->kda_num_heads, HV = c->kda_num_v_heads;
    const int64_t K = c->kda_head_dim, V = c->kda_v_head_dim, W = c->short_conv_kernel_size;
    eng_kda_weights none;
    if (!w) w = memset(&none, 0, sizeof none);
    const float x = sd(D, 1);
    /* depthwise conv taps: HF [C, 1, W]; llama.cpp's converter writes [C, W] */
    const vshape qk_conv = {3, {H * K, 1, W, 0}}, qk_conv_alt = {2, {H * K, W, 0, 0}};
    const vshape v_conv = {3, {HV * V, 1, W, 0}}, v_conv_alt = {2, {HV * V, W, 0, 0}};
    matrix(ls, &w->q_proj, H * K, D, x, SELF_ATTN, l, "q_proj.weight");
    vector(ls, &w->q_conv, qk_conv, qk_conv_alt, false, ENG_INIT_UNIFORM, -0.5f, 0.5f, SELF_ATTN, l,
           "q_conv1d.weight");
    matrix(ls, &w->k_proj, H * K, D, x, SELF_ATTN, l, "k_proj.weight");
    vector(ls, &w->k_conv, qk_conv, qk_conv_alt, false, ENG_INIT_UNIFORM, -0.5f, 0.5f, SELF_ATTN, l,
           "k_conv1d.weight");
    matrix(ls, &w->v_proj, HV * V, D, x, SELF_ATTN, l, "v_proj.weight");
    vector(ls, &w->v_conv, v_conv, v_conv_alt, false, ENG_INIT_UNIFORM, -0.5f, 0.5f, SELF_ATTN, l,
           "v_conv1d.weight");
    matrix(ls, &w->f_a_proj, K, D, x, SELF_ATTN, l, "f_a_proj.weight");
    matrix(ls, &w->f_b_proj, HV * K, K, sd(K, 1), SELF_ATTN, l, "f_b_proj.weight");
    /* A_log: HF [1, 1, HV, 1]; fla [HV]; K3 [head_dim], zero-padded past HV
     * (kimi-k3.md §3, §12 K1: the first HV entries are the heads') */
    if (c->family == ENG_FAMILY_KIMI_K3 && K > HV)
        vector(ls, &w->A_log, v1(K), v1(HV), false, ENG_INIT_A_LOG, 0, 0, SELF_ATTN, l, "A_log");
    else
        vector(ls, &w->A_log, (vshape){4, {1, 1, HV, 1}}, v1(HV), false, ENG_INIT_A_LOG, 0, 0,
               SELF_ATTN, l, "A_log");
    vector(ls, &w->dt_bias, v1(HV * K), NO_ALT, false, ENG_INIT_DT_BIAS, 0, 0, SELF_ATTN, l,
           "dt_bias"); /* index hv*K + d */
    matrix(ls, &w->b_proj, HV, D, x, SELF_ATTN, l, "b_proj.weight");
    if (c->use_full_rank_gate) { /* K3: one [HV*V, D] product (kimi-k3.md §4.3) */
        matrix(ls, &w->g_proj, HV * V, D, x, SELF_ATTN, l, "g_proj.weight");
    } else {
        matrix(ls, &w->g_a_proj, V, D, x, SELF_ATTN, l, "g_a_proj.weight");
        matrix(ls, &w->g_b_proj, HV * V, V, sd(V, 1), SELF_ATTN, l, "g_b_proj.weight");
    }
    norm(ls, &w->o_norm, V, SELF_ATTN, l, "o_norm.weight"); /* shared by all heads */
    matrix(ls, &w->o_proj, D, HV * V, sd(HV * V, ls->res), SELF_ATTN, l, "o_proj.weight");
}

/* MLA (spec §5): q (plain or through the q LoRA), the joint latent and its
 * norm, the up projection of the latent, the output projection. */
static void mla_tensors(lister *ls, int l, eng_mla_weights *w) {
    const eng_config *c = ls->c;
    const int64_t D = c->hidden_size, nh = c->num_attention_heads;
    const int64_t dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim;
    const int64_t R = c->kv_lora_rank, qr = c->q_lora_rank;
    eng_mla_weights none;
    if (!w) w = memset(&none, 0, sizeof none);
    if (qr > 0) {
        matrix(ls, &w->q_a_proj, qr, D, sd(D, 1), SELF_ATTN, l, "q_a_proj.weight");
        norm(ls, &w->q_a_layernorm, qr, SELF_ATTN, l, "q_a_layernorm.weight");
        /* [nh*(dn+dr), qr] */
        matrix(ls, &w->q_b_proj, nh * (dn + dr), qr, sd(qr, 1), SELF_ATTN, l, "q_b_proj.weight");
    } else {
        /* [nh*(dn+dr), D]: per head dn "nope" rows then dr "rope" rows */
        matrix(ls, &w->q_proj, nh * (dn + dr), D, sd(D, 1), SELF_ATTN, l, "q_proj.weight");
    }
    /* [R+dr, D]: rows 0..R-1 -> latent c, rows R..R+dr-1 -> shared k_pe */
    matrix(ls, &w->kv_a_proj_with_mqa, R + dr, D, sd(D, 1), SELF_ATTN, l,
           "kv_a_proj_with_mqa.weight");
    norm(ls, &w->kv_a_layernorm, R, SELF_ATTN, l, "kv_a_layernorm.weight");
    /* [nh*(dn+dv), R]: per head dn rows of W_UK then dv rows of W_UV */
    matrix(ls, &w->kv_b_proj, nh * (dn + dv), R, sd(R, 1), SELF_ATTN, l, "kv_b_proj.weight");
    /* K3: o *= sigmoid(g_proj(x)) before o_proj (kimi-k3.md §4.4) */
    if (c->mla_use_output_gate)
        matrix(ls, &w->g_proj, nh * dv, D, sd(D, 1), SELF_ATTN, l, "g_proj.weight");
    matrix(ls, &w->o_proj, D, nh * dv, sd(nh * dv, ls->res), SELF_ATTN, l, "o_proj.weight");
}

/* Dense SwiGLU MLP (spec §6.1). */
static void dense_tensors(lister *ls, int l, eng_ffn_weights *w) {
    const eng_config *c = ls->c;
    const int64_t D = c->hidden_size, F = c->intermediate_size;
    eng_ffn_weights none;
    if (!w) w = memset(&none, 0, sizeof none);
    matrix(ls, &w->gate_proj, F, D, sd(D, 1), "model.layers.%d.mlp.gate_proj.weight", l);
    matrix(ls, &w->up_proj, F, D, sd(D, 1), "model.layers.%d.mlp.up_proj.weight", l);
    matrix(ls, &w->down_proj, D, F, sd(F, ls->res), "model.layers.%d.mlp.down_proj.weight", l);
}

/* MoE (spec §6.2): router and its correction bias (optional: HF creates it
 * only with the grouped sigmoid router, some checkpoints drop it), the
 * routed experts (w1 gate, w2 down, w3 up), the shared experts. */
static void moe_tensors(lister *ls, int l, eng_ffn_weights *w, bool latent) {
    const eng_config *c = ls->c;
    const int64_t D = c->hidden_size, E = c->num_experts, I = c->moe_intermediate_size;
    const int64_t Is = I * c->num_shared_experts;
    /* the routed experts' width: the latent's in a latent MoE */
    const int64_t X = latent ? c->latent_size : D;
    eng_ffn_weights none;
    eng_weight scratch;
    if (!w) w = memset(&none, 0, sizeof none);
    matrix(ls, &w->router, E, D, sd(D, 1), MOE, l, "gate.weight");
    vector(ls, &w->router_bias, v1(E), NO_ALT, true, ENG_INIT_UNIFORM, -0.1f, 0.1f, MOE, l,
           "gate.e_score_correction_bias");
    if (latent) { /* K3 (kimi-k3.md §4.5): down into the latent, norm, up out of it */
        matrix(ls, &w->latent_down, X, D, sd(D, 1), MOE, l, "routed_expert_down_proj.weight");
        matrix(ls, &w->latent_up, D, X, sd(X, ls->res), MOE, l, "routed_expert_up_proj.weight");
        if (c->latent_moe_use_norm) norm(ls, &w->latent_norm, X, MOE, l, "routed_expert_norm.weight");
    }
    for (int64_t e = 0; e < E; e++) {
        /* without a model the expert arrays do not exist: list into scratch */
        eng_weight *w1 = w->w1 ? &w->w1[e] : &scratch, *w2 = w->w2 ? &w->w2[e] : &scratch;
        eng_weight *w3 = w->w3 ? &w->w3[e] : &scratch;
        expert_matrix(ls, w1, (int)e, I, X, sd(X, 1),
                      "model.layers.%d.block_sparse_moe.experts.%d.w1.weight", l,
                      (int)e); /* gate [I, X] */
        expert_matrix(ls, w2, (int)e, X, I, sd(I, ls->res),
                      "model.layers.%d.block_sparse_moe.experts.%d.w2.weight", l,
                      (int)e); /* down [X, I] */
        expert_matrix(ls, w3, (int)e, I, X, sd(X, 1),
                      "model.layers.%d.block_sparse_moe.experts.%d.w3.weight", l,
                      (int)e); /* up [I, X] */
    }
    if (Is > 0) {
        matrix(ls, &w->sh_gate, Is, D, sd(D, 1), MOE, l, "shared_experts.gate_proj.weight");
        matrix(ls, &w->sh_up, Is, D, sd(D, 1), MOE, l, "shared_experts.up_proj.weight");
        matrix(ls, &w->sh_down, D, Is, sd(Is, ls->res), MOE, l, "shared_experts.down_proj.weight");
    }
}

/* Block Attention Residuals' weights of one mix (kimi-k3.md §3): the key
 * norm [D] and the pseudo-query [1, D] (the fused u is derived from them at
 * load). Generated queries are small: the mixes start near uniform. */
static void attn_res_tensors(lister *ls, const float **norm_w, const float **proj, const char *fmt,
                             int l) {
    const int64_t D = ls->c->hidden_size;
    const float q = 1.0f / sqrtf((float)D);
    char nf[96], pf[96];
    snprintf(nf, sizeof nf, fmt, "norm");
    snprintf(pf, sizeof pf, fmt, "proj");
    norm(ls, norm_w, D, nf, l);
    vector(ls, proj, (vshape){2, {1, D, 0, 0}}, v1(D), false, ENG_INIT_UNIFORM, -q, q, pf, l);
}

void eng__plan_tensors(const eng_config *c, eng_model *m, eng_tensor_fn fn, void *user) {
    lister ls = {c, fn, user, 1.0f / sqrtf((float)c->num_hidden_layers),
                 c->family == ENG_FAMILY_KIMI_K3 ? "language_model." : ""};
    const int64_t D = c->hidden_size, Vb = c->vocab_size;
    eng_weight embed_none, head_none;
    const float *final_none, *vec_none[2];
    matrix(&ls, m ? &m->embed_tokens : &embed_none, Vb, D, 1.0f, "model.embed_tokens.weight");
    for (int l = 0; l < c->num_hidden_layers; l++) {
        eng_layer_weights *L = m ? &m->layers[l] : NULL;
        eng_layer_plan p;
        eng__plan_layer(c, l, &p);
        const float *in_none, *post_none;
        norm(&ls, L ? &L->input_layernorm : &in_none, D, "model.layers.%d.input_layernorm.weight",
             l);
        switch (p.input) {
        case ENG_INPUT_RESIDUAL: break;
        case ENG_INPUT_ATTN_RES:
            attn_res_tensors(&ls, L ? &L->attn_res_norm : &vec_none[0],
                             L ? &L->attn_res_proj : &vec_none[1],
                             "model.layers.%%d.self_attention_res_%s.weight", l);
            break;
        }
        switch (p.mixer) {
        case ENG_LAYER_KDA: kda_tensors(&ls, l, L ? &L->kda : NULL); break;
        case ENG_LAYER_MLA: mla_tensors(&ls, l, L ? &L->mla : NULL); break;
        }
        norm(&ls, L ? &L->post_attention_layernorm : &post_none, D,
             "model.layers.%d.post_attention_layernorm.weight", l);
        switch (p.input) {
        case ENG_INPUT_RESIDUAL: break;
        case ENG_INPUT_ATTN_RES:
            attn_res_tensors(&ls, L ? &L->mlp_res_norm : &vec_none[0],
                             L ? &L->mlp_res_proj : &vec_none[1],
                             "model.layers.%%d.mlp_res_%s.weight", l);
            break;
        }
        switch (p.ffn) {
        case ENG_FFN_DENSE: dense_tensors(&ls, l, L ? &L->ffn : NULL); break;
        case ENG_FFN_MOE: moe_tensors(&ls, l, L ? &L->ffn : NULL, false); break;
        case ENG_FFN_LATENT_MOE: moe_tensors(&ls, l, L ? &L->ffn : NULL, true); break;
        }
    }
    norm(&ls, m ? &m->final_norm : &final_none, D, "model.norm.weight");
    if (c->attn_res_block_size > 0)
        attn_res_tensors(&ls, m ? &m->out_res_norm : &vec_none[0], m ? &m->out_res_proj : &vec_none[1],
                         "model.output_attn_res_%s.weight", 0);
    if (!c->tie_word_embeddings)
        matrix(&ls, m ? &m->lm_head : &head_none, Vb, D, sd(D, 1), "lm_head.weight");
    else if (m)
        m->lm_head = m->embed_tokens; /* HF ties: any stored lm_head is ignored */
}

/* ------------------------------------------------------------------------ */
/* Counts                                                                    */

typedef struct counts {
    size_t tensors, params, matrices, vector_floats;
} counts;

static void count_fn(void *user, const eng_tensor_spec *t) {
    counts *k = user;
    size_t n = 1, alt = 1;
    for (int i = 0; i < t->n_dims; i++) n *= (size_t)t->shape[i];
    for (int i = 0; i < t->n_dims_alt; i++) alt *= (size_t)t->shape_alt[i];
    k->tensors++;
    k->params += n;
    if (t->matrix)
        k->matrices++;
    else /* room for whichever shape the file has */
        k->vector_floats += n > alt || !t->n_dims_alt ? n : alt;
}

static counts count_all(const eng_config *c) {
    counts k = {0, 0, 0, 0};
    eng__plan_tensors(c, NULL, count_fn, &k);
    return k;
}

typedef struct sizer {
    const eng_config *c;
    kern_dtype dt;
    eng_plan_sizes s;
} sizer;

static void size_fn(void *user, const eng_tensor_spec *t) {
    sizer *z = user;
    size_t n = 1;
    for (int i = 0; i < t->n_dims; i++) n *= (size_t)t->shape[i];
    z->s.params += n;
    const size_t bytes = t->matrix && kern_dtype_is_block(t->quant)
                             ? kern_weight_layout(t->quant, t->shape[0], t->shape[1]).bytes
                             : n * kern_dtype_size(z->dt);
    z->s.bytes += bytes;
    if (t->expert >= 0) {
        z->s.expert_bytes += bytes;
        /* a token runs top_k of the E experts of each MoE layer */
        z->s.active += n * (size_t)z->c->num_experts_per_token / (size_t)z->c->num_experts;
    } else if (!strstr(t->name, "embed_tokens")) {
        z->s.active += n;
    }
}

eng_plan_sizes eng__plan_sizes(const eng_config *c, kern_dtype dt) {
    sizer z = {c, dt, {0, 0, 0, 0}};
    eng__plan_tensors(c, NULL, size_fn, &z);
    return z.s;
}

size_t eng__plan_min_tensors(const eng_config *c) {
    size_t n = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        eng_layer_plan p;
        eng__plan_layer(c, l, &p);
        if (p.ffn != ENG_FFN_DENSE) n += (size_t)c->num_experts;
    }
    return n;
}

size_t eng_config_param_count(const eng_config *c) { return count_all(c).params; }

size_t eng_config_tensor_count(const eng_config *c) { return count_all(c).tensors; }

/* ------------------------------------------------------------------------ */

kds_status eng__plan_alloc(eng_model *m, kds_err *err) {
    const eng_config *c = &m->cfg;
    const int L = c->num_hidden_layers;
    const counts k = count_all(c);
    /* and the fused AttnRes queries, derived at load (eng__plan_check) */
    const size_t fused = c->attn_res_block_size > 0 ? (2 * (size_t)L + 1) * c->hidden_size : 0;
    m->small_f32_cap = k.vector_floats + fused;
    m->small_f32 = malloc((m->small_f32_cap ? m->small_f32_cap : 1) * sizeof(float));
    m->layers = calloc((size_t)L, sizeof *m->layers);
    m->cap_weights = (int)k.matrices + 1;
    m->weights = calloc((size_t)m->cap_weights, sizeof *m->weights);
    m->n_weights = 1; /* id 0: no weight */
    m->n_moe = 0;
    for (int l = 0; l < L; l++) m->n_moe += c->layer_is_moe[l];
    const size_t n_exp = (size_t)m->n_moe * 3 * (size_t)c->num_experts;
    m->expert_arena = calloc(n_exp ? n_exp : 1, sizeof *m->expert_arena);
    m->banks = calloc((size_t)m->n_moe + 1, sizeof *m->banks);
    if (!m->small_f32 || !m->layers || !m->weights || !m->expert_arena || !m->banks)
        return kds_err_set(err, KDS_NOMEM, "out of memory loading %s", m->dir);
    int bank = 0;
    for (int l = 0; l < L; l++) {
        eng_layer_weights *lw = &m->layers[l];
        eng_layer_plan p;
        eng__plan_layer(c, l, &p);
        lw->kind = p.mixer;
        lw->ffn_kind = p.ffn;
        lw->input_kind = p.input;
        lw->slot = p.slot;
        if (p.ffn == ENG_FFN_MOE || p.ffn == ENG_FFN_LATENT_MOE) {
            eng_weight *experts = m->expert_arena + (size_t)bank * 3 * (size_t)c->num_experts;
            lw->ffn.w1 = experts;
            lw->ffn.w3 = experts + c->num_experts;
            lw->ffn.w2 = experts + 2 * (size_t)c->num_experts;
            m->banks[bank] = &lw->ffn;
            lw->ffn.bank = bank++;
        }
    }
    return KDS_OK;
}

void eng__plan_register(eng_model *m, eng_weight *w) {
    if (m->n_weights >= m->cap_weights) return; /* sized by the same list: cannot happen */
    w->id = m->n_weights++;
    m->weights[w->id] = w;
}

/* u = norm * proj into the arena: the one query vector a mix reads. */
static const float *fuse(eng_model *m, const float *norm_w, const float *proj) {
    const size_t D = (size_t)m->cfg.hidden_size;
    if (!norm_w || !proj || m->small_f32_cap - m->small_f32_used < D) return NULL;
    float *u = m->small_f32 + m->small_f32_used;
    m->small_f32_used += D;
    for (size_t d = 0; d < D; d++) u[d] = norm_w[d] * proj[d];
    return u;
}

kds_status eng__plan_check(eng_model *m, kds_err *err) {
    const eng_config *c = &m->cfg;
    if (c->attn_res_block_size > 0) {
        for (int l = 0; l < c->num_hidden_layers; l++) {
            eng_layer_weights *L = &m->layers[l];
            L->attn_res_u = fuse(m, L->attn_res_norm, L->attn_res_proj);
            L->mlp_res_u = fuse(m, L->mlp_res_norm, L->mlp_res_proj);
            if (!L->attn_res_u || !L->mlp_res_u)
                return kds_err_set(err, KDS_INTERNAL, "layer %d: no room for the AttnRes queries", l);
        }
        if (!(m->out_res_u = fuse(m, m->out_res_norm, m->out_res_proj)))
            return kds_err_set(err, KDS_INTERNAL, "no room for the output AttnRes query");
    }
    const size_t qk = (size_t)c->kda_num_heads * c->kda_head_dim * c->short_conv_kernel_size;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const eng_kda_weights *k = &m->layers[l].kda;
        if (m->layers[l].kind == ENG_LAYER_KDA &&
            (k->k_conv != k->q_conv + qk || k->v_conv != k->k_conv + qk))
            return kds_err_set(err, KDS_INTERNAL,
                               "layer %d: the q, k and v conv taps are not contiguous", l);
    }
    return KDS_OK;
}
