/*
 * eng_cuda.c - the whole-model forward pass on a CUDA GPU (eng_cuda.h):
 * the layer sequence of forward() in eng_forward.c, op for op, on the
 * kernels of kernels/kern_cuda.h, for KDA and hybrid (MLA) models.
 *
 * Per KDA layer (x, xn, mix: [rows, hidden] fp32 on the device):
 *   xn = rmsnorm(x)                                   kern_cuda_rmsnorm
 *   ext[taps..] = [q | k | v]_proj(xn)                kern_cuda_matmul (ldy = conv_ch)
 *   q, k, v = silu(conv(tail ++ ext))                 kern_cuda_short_conv
 *   g_raw = f_b(f_a(xn)), beta_raw = b(xn), gz = g_b(g_a(xn))
 *   o = KDA core (raw inputs)      prefill: kern_cuda_kda_prefill, decode: kern_cuda_kda_decode
 *   o = rmsnorm(o) * o_norm * sigmoid(gz)             kern_cuda_rmsnorm (gated)
 *   x += o_proj(o)                                    kern_cuda_matmul (accumulate)
 * per MLA layer: q and kv_a products, kern_cuda_mla_cache_append,
 * kern_cuda_mla_attention, x += o_proj(o); then for both
 *   xn = rmsnorm(x); x += FFN(xn)                     dense: matmul + kern_cuda_swiglu;
 *                                                     MoE: kern_cuda_moe_route, _gather,
 *                                                     kern_cuda_moe_experts (grouped, offsets
 *                                                     read on the device), _combine
 * then the final norm and lm_head: logits copied back (prefill), or left
 * on the device in each sequence's slot row (decode; fetched when read,
 * sampled there by eng_sample / eng_decode_batch_sample).
 *
 * Products of more than 8 rows run on cuBLAS (the context's GEMM context),
 * decode passes replay CUDA graphs, states stay resident in slots
 * (eng_cuda.h). The embedding table lives on the device (kern_cuda_embed).
 * A generated model (eng_model_generate) has its matrices made here by
 * kern_cuda_gen_normal.
 */
#include <stdlib.h>
#include <string.h>

#include "eng_cuda.h"

#ifndef KDS_HAVE_CUDA

kds_status eng__cuda_create(const eng_model *m, int max_batch, int max_seqs, bool bf16,
                            eng_cuda **out, kds_err *err) {
    (void)m, (void)max_batch, (void)max_seqs, (void)bf16;
    *out = NULL;
    return kds_err_set(err, KDS_UNSUPPORTED,
                       "device 'cuda': this kdaserve was built without CUDA (configure with "
                       "nvcc on the PATH or CUDACXX set, and -DKDS_CUDA=ON)");
}

void eng__cuda_free(eng_cuda *g) { (void)g; }

kds_status eng__cuda_forward(eng_cuda *g, eng_seq *const *seqs, int n_seqs, const int32_t *ids,
                             int T, int chunked, float *logits, int want_last, kds_err *err) {
    (void)g, (void)seqs, (void)n_seqs, (void)ids, (void)T, (void)chunked, (void)logits,
        (void)want_last;
    return kds_err_set(err, KDS_UNSUPPORTED, "this kdaserve was built without CUDA");
}

kds_status eng__cuda_attach(eng_cuda *g, eng_seq *s, kds_err *err) {
    (void)g, (void)s;
    return kds_err_set(err, KDS_UNSUPPORTED, "this kdaserve was built without CUDA");
}

kds_status eng__cuda_state_upload(eng_cuda *g, int slot, const eng_seq *s, kds_err *err) {
    (void)g, (void)slot, (void)s;
    return kds_err_set(err, KDS_UNSUPPORTED, "this kdaserve was built without CUDA");
}

kds_status eng__cuda_state_download(eng_cuda *g, int slot, eng_seq *s, kds_err *err) {
    (void)g, (void)slot, (void)s;
    return kds_err_set(err, KDS_UNSUPPORTED, "this kdaserve was built without CUDA");
}

int eng__cuda_graph_count(const eng_cuda *g) {
    (void)g;
    return -1;
}

kds_status eng__cuda_decode_sample(eng_cuda *g, eng_seq *const *seqs, int n, const int32_t *ids,
                                   const eng_sampler_params *p, int32_t *next, kds_err *err) {
    (void)g, (void)seqs, (void)n, (void)ids, (void)p, (void)next;
    return kds_err_set(err, KDS_UNSUPPORTED, "this kdaserve was built without CUDA");
}

bool eng__cuda_sampler_takes(const eng_cuda *g, const eng_sampler_params *p) {
    (void)g, (void)p;
    return false;
}

kds_status eng__cuda_sample_one(eng_cuda *g, eng_seq *s, const eng_sampler_params *p, int32_t *token,
                                kds_err *err) {
    (void)g, (void)s, (void)p, (void)token;
    return kds_err_set(err, KDS_UNSUPPORTED, "this kdaserve was built without CUDA");
}

/* No sequence is ever resident without CUDA. */
kds_status eng__seq_fetch_slow(const eng_seq *s, kds_err *err) {
    (void)s, (void)err;
    return KDS_OK;
}

kds_status eng__seq_fetch_logits_slow(const eng_seq *s, kds_err *err) {
    (void)s, (void)err;
    return KDS_OK;
}

void eng__seq_detach(eng_seq *s) { (void)s; }

#else /* KDS_HAVE_CUDA */

#include <math.h>

#include "kern_cuda.h"


/* Decode graphs per power of two of the longest context (MLA models). */
#define ENG_CUDA_CTX_BUCKETS 32

/* A matrix on the device, in its stored dtype. */
typedef struct dweight {
    const void *p;
    kern_dtype dt;
    int rows, cols;
} dweight;

typedef struct dlayer {
    const float *in_norm, *post_norm; /* [hidden] */
    /* KDA */
    dweight q_proj, k_proj, v_proj, f_a, f_b, b_proj, g_a, g_b, o_proj;
    const float *conv_w;             /* [conv_ch, W]: q, k, v taps stacked */
    const float *A_log, *dt_bias, *o_norm;
    /* MLA */
    int is_mla;
    dweight mq_proj, q_a, q_b, kv_a, kv_b;  /* q_proj, or q_a + q_b (q_lora_rank > 0) */
    const float *q_a_norm, *kv_a_norm;
    /* FFN */
    int is_moe;
    dweight gate, up, down;          /* dense */
    dweight router, sh_gate, sh_up, sh_down;
    const float *router_bias;
    dweight *w1, *w3, *w2;           /* [E] each (host array of device matrices) */
    const void *experts;             /* one buffer: expert e's [w1 | w3 | w2] at e * expert_stride */
    size_t expert_stride;
} dlayer;

struct eng_cuda {
    const eng_model *m;
    eng_dims d;
    int B, max_batch, max_seqs, top_k, E, ffn_width, rank;
    void **allocs;                   /* every device buffer, freed with the context */
    int n_allocs, cap_allocs;
    const void *embed;               /* [vocab, hidden] as stored (or generated) */
    int32_t *ids, *h_ids;            /* [B] token ids: device, pinned staging */
    dweight lm_head;
    const float *final_norm;
    dlayer *layers;                  /* [num_hidden_layers] */
    /* per-sequence state slots, per KDA layer: [max_seqs, HV, K, V], [max_seqs, taps, C] */
    float **state, **tail;
    int32_t *slots;                  /* [max_seqs]: the slot of each row of a batched pass */
    /* residency: which sequence holds each slot, and when it last ran */
    eng_seq **owner;                 /* [max_seqs] */
    uint64_t *last_use;              /* [max_seqs] */
    uint64_t clock;                  /* forward calls so far */
    int32_t *h_slots;                /* pinned [max_seqs]: staged slot ids */
    /* activations */
    float *x, *xn, *ext, *q, *k, *v, *fa, *ga, *g, *beta, *gz, *o, *mix;
    float *fa_buf, *fb_buf, *shared_out, *router, *selw, *xg, *yg, *logits;
    int32_t *sel, *exp_off, *row_of, *tok_of;
    void *ws;                        /* prefill workspace */
    size_t ws_bytes;
    kern_cuda_gemm_ctx *gemm;        /* cuBLAS for products of more than 8 rows */
    kern_cuda_gemm_mode mode;        /* their activations: EXACT (hi + lo) or BF16 */
    void *stream;                    /* every copy and kernel of the context runs here */
    void **graphs;                   /* [2][max_seqs][ENG_CUDA_CTX_BUCKETS] decode graphs (logits
                                      * to the host or left on the device), or NULL */
    /* eng_decode_batch_sample: each slot's logits row, and the sampler's inputs and outputs */
    float *slot_logits;              /* [max_seqs, vocab] */
    int32_t *d_pen, *d_tok;          /* [max_seqs, ENG_RECENT_TOKENS], [max_seqs] */
    uint64_t *d_rng;                 /* [max_seqs, 4] */
    unsigned char *h_samp;           /* pinned staging of the three */
    int graphs_off;                  /* capture unavailable, or KDS_CUDA_GRAPHS=0 */
    int prefill_fp32;                /* the tensor-core prefill does not fit this GPU */
    /* MLA: per MLA layer and slot a latent cache [cap, dc + dr] (grown
     * geometrically), its device pointer table, and the pass's positions */
    float ***mla_cache;              /* [n_mla][max_seqs] device pointers (host array) */
    float ***mla_table;              /* [n_mla] device arrays [max_seqs] of the same */
    int64_t *mla_cap;                /* [max_seqs] rows each slot's caches hold */
    int32_t *pos, *h_pos;            /* [max_seqs] positions of a pass: device, pinned */
    float *mq, *kva;                 /* [B, nh*(dn+dr)], [B, dc+dr] */
    void *mla_ws;                    /* kern_cuda_mla_attention workspace */
    size_t mla_ws_bytes;
    /* host side */
    float *h_stage;                  /* pinned: one sequence's KDA states and conv tails */
    size_t stage_floats;
    float *h_logits;                 /* pinned [max_seqs, vocab]: logits before they go to the seqs */
};

static kds_status dalloc(eng_cuda *g, void **p, size_t bytes, kds_err *err) {
    *p = NULL;
    if (g->n_allocs == g->cap_allocs) {
        int cap = g->cap_allocs ? 2 * g->cap_allocs : 256;
        void **a = realloc(g->allocs, (size_t)cap * sizeof *a);
        if (!a) return kds_err_set(err, KDS_NOMEM, "out of memory creating a CUDA context");
        g->allocs = a;
        g->cap_allocs = cap;
    }
    kds_status rc = kern_cuda_malloc(p, bytes ? bytes : 16, err);
    if (rc == KDS_OK) g->allocs[g->n_allocs++] = *p;
    return rc;
}

static kds_status up_bytes(eng_cuda *g, const void **dst, const void *src, size_t bytes,
                           kds_err *err) {
    void *p;
    kds_status rc = dalloc(g, &p, bytes, err);
    if (rc == KDS_OK && bytes) rc = kern_cuda_memcpy_h2d(p, src, bytes, g->stream, err);
    *dst = p;
    return rc;
}

/* A matrix onto the device, at `at` (a slice of a bigger buffer) or in a
 * buffer of its own: copied as stored, or made there for a generated
 * model (w->data NULL: kern_cuda_gen_normal, the values gen-model writes). */
static kds_status put_w(eng_cuda *g, dweight *dw, const eng_weight *w, void *at, kds_err *err) {
    *dw = (dweight){NULL, w->dt, w->rows, w->cols};
    if (w->rows == 0) return KDS_OK;
    if (w->dt != KERN_F32 && w->dt != KERN_BF16)
        return kds_err_set(err, KDS_UNSUPPORTED,
                           "device 'cuda': f16 weights are not supported yet (bf16 or f32 only)");
    const size_t n = (size_t)w->rows * w->cols, bytes = n * kern_dtype_size(w->dt);
    kds_status rc = KDS_OK;
    if (!at && (rc = dalloc(g, &at, bytes, err)) != KDS_OK) return rc;
    dw->p = at;
    if (!w->data) return kern_cuda_gen_normal(at, w->dt, n, w->gen_key, w->gen_sd, g->stream, err);
    return kern_cuda_memcpy_h2d(at, w->data, bytes, g->stream, err);
}

static kds_status up_w(eng_cuda *g, dweight *dw, const eng_weight *w, kds_err *err) {
    return put_w(g, dw, w, NULL, err);
}

static kds_status up_f(eng_cuda *g, const float **dst, const float *src, size_t n, kds_err *err) {
    *dst = NULL;
    if (!src) return KDS_OK;
    return up_bytes(g, (const void **)dst, src, n * sizeof(float), err);
}

#define DALLOC(ptr, count)                                                                   \
    do {                                                                                     \
        void *p_;                                                                            \
        if ((rc = dalloc(g, &p_, (size_t)(count) * sizeof *(ptr), err)) != KDS_OK) goto fail; \
        (ptr) = p_;                                                                          \
    } while (0)

kds_status eng__cuda_create(const eng_model *m, int max_batch, int max_seqs, bool bf16,
                            eng_cuda **out, kds_err *err) {
    *out = NULL;
    kds_err why;
    kds_err_clear(&why);
    if (!kern_cuda_available(&why))
        return kds_err_set(err, KDS_UNSUPPORTED, "device 'cuda': no usable CUDA device (%s)",
                           why.msg);
    eng_dims dm;
    eng__dims(&m->cfg, &dm);
    if (dm.n_mla > 0 && kern_cuda_mla_attention_smem_bytes(&(kern_mla_shape){
                            dm.mla_heads, dm.dc, dm.dr, dm.dn, dm.dv}) == 0)
        return kds_err_set(err, KDS_UNSUPPORTED,
                           "device 'cuda': MLA with kv_lora_rank %d is not supported on the GPU "
                           "(64, 128, 256 or 512; use --device cpu)", dm.dc);
    eng_cuda *g = calloc(1, sizeof *g);
    if (!g) return kds_err_set(err, KDS_NOMEM, "out of memory creating a CUDA context");
    kds_status rc = KDS_OK;
    const eng_config *cfg = &m->cfg;
    g->m = m;
    g->d = dm;
    g->mode = bf16 ? KERN_CUDA_GEMM_BF16 : KERN_CUDA_GEMM_EXACT;
    if ((rc = kern_cuda_stream_create(&g->stream, err)) != KDS_OK) goto fail;
    g->graphs = calloc((size_t)2 * max_seqs * ENG_CUDA_CTX_BUCKETS, sizeof *g->graphs);
    if (!g->graphs) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory creating a CUDA context");
        goto fail;
    }
    const char *graphs_env = getenv("KDS_CUDA_GRAPHS");
    g->graphs_off = graphs_env && strcmp(graphs_env, "0") == 0;
    const eng_dims *d = &g->d;
    g->max_batch = max_batch;
    g->max_seqs = max_seqs;
    g->B = max_batch > max_seqs ? max_batch : max_seqs;
    g->E = cfg->num_experts;
    g->top_k = cfg->num_experts > 0 ? cfg->num_experts_per_token : 1;
    int width = cfg->intermediate_size;
    if (cfg->num_experts > 0) {
        if (cfg->moe_intermediate_size > width) width = cfg->moe_intermediate_size;
        if (cfg->moe_intermediate_size * cfg->num_shared_experts > width)
            width = cfg->moe_intermediate_size * cfg->num_shared_experts;
    }
    g->ffn_width = width;
    const int L = cfg->num_hidden_layers, taps = d->W - 1, C = d->conv_ch;
    int rank = 1;
    g->layers = calloc((size_t)L, sizeof *g->layers);
    g->state = calloc((size_t)d->n_kda + 1, sizeof *g->state);
    g->tail = calloc((size_t)d->n_kda + 1, sizeof *g->tail);
    if (!g->layers || !g->state || !g->tail) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory creating a CUDA context");
        goto fail;
    }
    /* weights, as stored (a tied lm_head is the embedding, uploaded once) */
    dweight emb;
    if ((rc = up_w(g, &emb, &m->embed_tokens, err)) != KDS_OK) goto fail;
    g->embed = emb.p;
    if (m->lm_head.data == m->embed_tokens.data && m->lm_head.gen_key == m->embed_tokens.gen_key)
        g->lm_head = emb;
    else if ((rc = up_w(g, &g->lm_head, &m->lm_head, err)) != KDS_OK)
        goto fail;
    if ((rc = up_f(g, &g->final_norm, m->final_norm, d->hidden, err)) != KDS_OK) goto fail;
    float *conv_host = malloc((size_t)C * d->W * sizeof(float));
    if (!conv_host) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory creating a CUDA context");
        goto fail;
    }
    for (int l = 0; l < L && rc == KDS_OK; l++) {
        const eng_layer_weights *hw = &m->layers[l];
        dlayer *dl = &g->layers[l];
        const eng_kda_weights *k = &hw->kda;
        const eng_ffn_weights *f = &hw->ffn;
        if ((rc = up_f(g, &dl->in_norm, hw->input_layernorm, d->hidden, err)) ||
            (rc = up_f(g, &dl->post_norm, hw->post_attention_layernorm, d->hidden, err)))
            break;
        dl->is_mla = hw->kind != ENG_LAYER_KDA;
        if (dl->is_mla) {
            const eng_mla_weights *a = &hw->mla;
            if (cfg->q_lora_rank > rank) rank = cfg->q_lora_rank;
            if ((rc = up_w(g, &dl->mq_proj, &a->q_proj, err)) ||
                (rc = up_w(g, &dl->q_a, &a->q_a_proj, err)) ||
                (rc = up_w(g, &dl->q_b, &a->q_b_proj, err)) ||
                (rc = up_f(g, &dl->q_a_norm, a->q_a_layernorm, (size_t)cfg->q_lora_rank, err)) ||
                (rc = up_w(g, &dl->kv_a, &a->kv_a_proj_with_mqa, err)) ||
                (rc = up_f(g, &dl->kv_a_norm, a->kv_a_layernorm, (size_t)d->dc, err)) ||
                (rc = up_w(g, &dl->kv_b, &a->kv_b_proj, err)) ||
                (rc = up_w(g, &dl->o_proj, &a->o_proj, err)))
                break;
            goto ffn;
        }
        if (k->f_a_proj.rows > rank) rank = k->f_a_proj.rows;
        if (k->g_a_proj.rows > rank) rank = k->g_a_proj.rows;
        memcpy(conv_host, k->q_conv, (size_t)d->kda_qk * d->W * sizeof(float));
        memcpy(conv_host + (size_t)d->kda_qk * d->W, k->k_conv,
               (size_t)d->kda_qk * d->W * sizeof(float));
        memcpy(conv_host + (size_t)2 * d->kda_qk * d->W, k->v_conv,
               (size_t)d->kda_v * d->W * sizeof(float));
        if ((rc = up_w(g, &dl->q_proj, &k->q_proj, err)) ||
            (rc = up_w(g, &dl->k_proj, &k->k_proj, err)) ||
            (rc = up_w(g, &dl->v_proj, &k->v_proj, err)) ||
            (rc = up_w(g, &dl->f_a, &k->f_a_proj, err)) ||
            (rc = up_w(g, &dl->f_b, &k->f_b_proj, err)) ||
            (rc = up_w(g, &dl->b_proj, &k->b_proj, err)) ||
            (rc = up_w(g, &dl->g_a, &k->g_a_proj, err)) ||
            (rc = up_w(g, &dl->g_b, &k->g_b_proj, err)) ||
            (rc = up_w(g, &dl->o_proj, &k->o_proj, err)) ||
            (rc = up_f(g, &dl->conv_w, conv_host, (size_t)C * d->W, err)) ||
            (rc = up_f(g, &dl->A_log, k->A_log, d->HV, err)) ||
            (rc = up_f(g, &dl->dt_bias, k->dt_bias, (size_t)d->HV * d->K, err)) ||
            (rc = up_f(g, &dl->o_norm, k->o_norm, d->V, err)))
            break;
    ffn:
        dl->is_moe = hw->ffn_kind == ENG_FFN_MOE;
        if (!dl->is_moe) {
            if ((rc = up_w(g, &dl->gate, &f->gate_proj, err)) ||
                (rc = up_w(g, &dl->up, &f->up_proj, err)) ||
                (rc = up_w(g, &dl->down, &f->down_proj, err)))
                break;
            continue;
        }
        if ((rc = up_w(g, &dl->router, &f->router, err)) ||
            (rc = up_f(g, &dl->router_bias, f->router_bias, g->E, err)) ||
            (rc = up_w(g, &dl->sh_gate, &f->sh_gate, err)) ||
            (rc = up_w(g, &dl->sh_up, &f->sh_up, err)) ||
            (rc = up_w(g, &dl->sh_down, &f->sh_down, err)))
            break;
        dl->w1 = calloc((size_t)3 * g->E, sizeof *dl->w1);
        if (!dl->w1) {
            rc = kds_err_set(err, KDS_NOMEM, "out of memory creating a CUDA context");
            break;
        }
        dl->w3 = dl->w1 + g->E;
        dl->w2 = dl->w3 + g->E;
        /* one buffer per layer for all its experts, [E][w1 | w3 | w2]: few
         * allocations for the 48B's 20,736 expert matrices, and one base +
         * stride for grouped products */
        const size_t b1 = (size_t)f->w1[0].rows * f->w1[0].cols * kern_dtype_size(f->w1[0].dt),
                     b3 = (size_t)f->w3[0].rows * f->w3[0].cols * kern_dtype_size(f->w3[0].dt),
                     b2 = (size_t)f->w2[0].rows * f->w2[0].cols * kern_dtype_size(f->w2[0].dt);
        void *arena;
        if ((rc = dalloc(g, &arena, (size_t)g->E * (b1 + b3 + b2), err)) != KDS_OK) break;
        dl->experts = arena;
        dl->expert_stride = b1 + b3 + b2;
        for (int e = 0; e < g->E && rc == KDS_OK; e++) {
            char *at = (char *)arena + (size_t)e * (b1 + b3 + b2);
            if (f->w1[e].dt != f->w1[0].dt || f->w3[e].dt != f->w3[0].dt ||
                f->w2[e].dt != f->w2[0].dt) {
                rc = kds_err_set(err, KDS_UNSUPPORTED,
                                 "device 'cuda': the experts of layer %d are stored in different "
                                 "dtypes", l);
                break;
            }
            if ((rc = put_w(g, &dl->w1[e], &f->w1[e], at, err)) == KDS_OK &&
                (rc = put_w(g, &dl->w3[e], &f->w3[e], at + b1, err)) == KDS_OK)
                rc = put_w(g, &dl->w2[e], &f->w2[e], at + b1 + b3, err);
        }
    }
    free(conv_host);
    if (rc != KDS_OK) goto fail;
    g->rank = rank;
    /* state slots */
    for (int s = 0; s < d->n_kda; s++) {
        DALLOC(g->state[s], (size_t)max_seqs * d->HV * d->K * d->V);
        DALLOC(g->tail[s], (size_t)max_seqs * (taps > 0 ? taps : 1) * C);
    }
    DALLOC(g->slots, max_seqs);
    DALLOC(g->ids, g->B);
    /* activations */
    const size_t B = (size_t)g->B, Bk = B * (size_t)g->top_k;
    DALLOC(g->x, B * d->hidden);
    DALLOC(g->xn, B * d->hidden);
    DALLOC(g->mix, B * d->hidden);
    DALLOC(g->ext, (B + taps) * C);
    DALLOC(g->q, B * d->kda_qk);
    DALLOC(g->k, B * d->kda_qk);
    DALLOC(g->v, B * d->kda_v);
    DALLOC(g->fa, B * rank);
    DALLOC(g->ga, B * rank);
    DALLOC(g->g, B * d->HV * d->K);
    DALLOC(g->beta, B * d->HV);
    DALLOC(g->gz, B * d->kda_v);
    size_t o_width = (size_t)d->kda_v;
    if (d->n_mla && (size_t)d->mla_heads * d->dv > o_width) o_width = (size_t)d->mla_heads * d->dv;
    DALLOC(g->o, B * o_width);
    DALLOC(g->fa_buf, (Bk + B) * width);
    DALLOC(g->fb_buf, (Bk + B) * width);
    DALLOC(g->shared_out, B * d->hidden);
    if (g->E > 0) {
        DALLOC(g->router, B * g->E);
        DALLOC(g->sel, Bk);
        DALLOC(g->selw, Bk);
        DALLOC(g->exp_off, g->E + 1);
        DALLOC(g->row_of, Bk);
        DALLOC(g->tok_of, Bk);
        DALLOC(g->xg, Bk * d->hidden);
        DALLOC(g->yg, Bk * d->hidden);
    }
    DALLOC(g->logits, B * d->vocab);
    DALLOC(g->pos, max_seqs);
    DALLOC(g->slot_logits, (size_t)max_seqs * d->vocab);
    DALLOC(g->d_pen, (size_t)max_seqs * ENG_RECENT_TOKENS);
    DALLOC(g->d_tok, max_seqs);
    DALLOC(g->d_rng, (size_t)max_seqs * 4);
    if (d->n_mla) {
        const kern_mla_shape msh = {d->mla_heads, d->dc, d->dr, d->dn, d->dv};
        DALLOC(g->mq, B * d->mla_heads * (d->dn + d->dr));
        DALLOC(g->kva, B * d->mla_row);
        /* context splits for parallelism when there are few rows */
        int splits = (int)(2048 / B);
        splits = splits < 1 ? 1 : splits > 32 ? 32 : splits;
        g->mla_ws_bytes = kern_cuda_mla_workspace_bytes(&msh, (int)B, splits);
        if ((rc = dalloc(g, &g->mla_ws, g->mla_ws_bytes, err)) != KDS_OK) goto fail;
        g->mla_cache = calloc((size_t)d->n_mla, sizeof *g->mla_cache);
        g->mla_table = calloc((size_t)d->n_mla, sizeof *g->mla_table);
        g->mla_cap = calloc((size_t)max_seqs, sizeof *g->mla_cap);
        if (!g->mla_cache || !g->mla_table || !g->mla_cap) {
            rc = kds_err_set(err, KDS_NOMEM, "out of memory creating a CUDA context");
            goto fail;
        }
        for (int i = 0; i < d->n_mla; i++) {
            if (!(g->mla_cache[i] = calloc((size_t)max_seqs, sizeof **g->mla_cache))) {
                rc = kds_err_set(err, KDS_NOMEM, "out of memory creating a CUDA context");
                goto fail;
            }
            DALLOC(g->mla_table[i], max_seqs);
            if ((rc = kern_cuda_memset(g->mla_table[i], 0, (size_t)max_seqs * sizeof(float *), g->stream,
                                       err)))
                goto fail;
        }
    }
    {
        /* cuBLAS for products of more than 8 rows: scratch for the widest */
        size_t cols = (size_t)d->hidden;
        if ((size_t)width > cols) cols = (size_t)width;
        if (o_width > cols) cols = o_width;
        if ((size_t)d->kda_v > cols) cols = (size_t)d->kda_v;
        if ((rc = kern_cuda_gemm_ctx_create(B * cols, &g->gemm, err)) != KDS_OK) goto fail;
    }
    kern_kda_shape sh = {d->H, d->HV, d->K, d->V, 1.0f};
    int chunks = (max_batch + 63) / 64;
    if (chunks > 64) chunks = 64;
    g->ws_bytes = kern_cuda_kda_prefill_workspace_bytes(&sh, chunks);
    if ((rc = dalloc(g, &g->ws, g->ws_bytes, err)) != KDS_OK) goto fail;
    /* host staging */
    g->stage_floats = (size_t)d->n_kda * ((size_t)d->HV * d->K * d->V + (size_t)taps * C);
    if ((rc = kern_cuda_host_alloc((void **)&g->h_stage, g->stage_floats * sizeof(float), err)))
        goto fail;
    if ((rc = kern_cuda_host_alloc((void **)&g->h_logits,
                                   (size_t)max_seqs * d->vocab * sizeof(float), err)))
        goto fail;
    g->owner = calloc((size_t)max_seqs, sizeof *g->owner);
    g->last_use = calloc((size_t)max_seqs, sizeof *g->last_use);
    if (!g->owner || !g->last_use) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory creating a CUDA context");
        goto fail;
    }
    if ((rc = kern_cuda_host_alloc((void **)&g->h_slots, (size_t)max_seqs * sizeof(int32_t), err)) ||
        (rc = kern_cuda_host_alloc((void **)&g->h_ids, (size_t)g->B * sizeof(int32_t), err)) ||
        (rc = kern_cuda_host_alloc((void **)&g->h_pos, (size_t)max_seqs * sizeof(int32_t), err)) ||
        (rc = kern_cuda_host_alloc((void **)&g->h_samp,
                                   (size_t)max_seqs * (ENG_RECENT_TOKENS * 4 + 4 + 32), err)))
        goto fail;
    /* everything the set-up queued (generated weights, uploads, any library
     * initialisation on the default stream): a device-wide sync */
    if ((rc = kern_cuda_sync(NULL, err))) goto fail;
    *out = g;
    return KDS_OK;
fail:
    eng__cuda_free(g);
    return rc;
}

void eng__cuda_free(eng_cuda *g) {
    if (!g) return;
    /* Resident sequences outlive the context: hand their state back. A
     * failed copy (a broken device) leaves a sequence at its last fetch. */
    if (g->owner)
        for (int i = 0; i < g->max_seqs; i++) {
            eng_seq *s = g->owner[i];
            if (!s) continue;
            kds_err ignored;
            (void)eng__seq_fetch(s, &ignored);
            eng__seq_detach(s);
        }
    free(g->owner);
    free(g->last_use);
    kern_cuda_host_free(g->h_slots);
    kern_cuda_host_free(g->h_pos);
    kern_cuda_host_free(g->h_samp);
    kern_cuda_gemm_ctx_free(g->gemm);
    if (g->mla_cache)
        for (int i = 0; i < g->d.n_mla; i++) {
            for (int j = 0; g->mla_cache[i] && j < g->max_seqs; j++) kern_cuda_free(g->mla_cache[i][j]);
            free(g->mla_cache[i]);
        }
    free(g->mla_cache);
    free(g->mla_table);
    free(g->mla_cap);
    for (int i = 0; i < g->n_allocs; i++) kern_cuda_free(g->allocs[i]);
    free(g->allocs);
    if (g->graphs)
        for (size_t i = 0; i < (size_t)2 * g->max_seqs * ENG_CUDA_CTX_BUCKETS; i++)
            kern_cuda_graph_free(g->graphs[i]);
    free(g->graphs);
    kern_cuda_stream_free(g->stream);
    kern_cuda_host_free(g->h_ids);
    if (g->layers)
        for (int l = 0; l < g->m->cfg.num_hidden_layers; l++) free(g->layers[l].w1);
    free(g->layers);
    free(g->state);
    free(g->tail);
    kern_cuda_host_free(g->h_stage);
    kern_cuda_host_free(g->h_logits);
    free(g);
}

/* ------------------------------------------------------------------------ */
/* State hand-over                                                           */

static kds_status check_slot(const eng_cuda *g, int slot, const eng_seq *s, kds_err *err) {
    if (slot < 0 || slot >= g->max_seqs)
        return kds_err_set(err, KDS_INVALID_ARG, "state slot %d outside [0, %d)", slot, g->max_seqs);
    if (s->model != g->m)
        return kds_err_set(err, KDS_INVALID_ARG, "sequence and CUDA context belong to different models");
    return KDS_OK;
}

kds_status eng__cuda_state_upload(eng_cuda *g, int slot, const eng_seq *s, kds_err *err) {
    kds_status rc = check_slot(g, slot, s, err);
    if (rc != KDS_OK) return rc;
    const eng_dims *d = &g->d;
    const size_t sn = (size_t)d->HV * d->K * d->V, tn = (size_t)(d->W - 1) * d->conv_ch;
    /* Layer by layer: stage one layer's state (a host memcpy), then queue
     * its DMA; the copy engine moves layer l while the CPU stages l + 1, so
     * an upload costs about one pass over the bytes, not two. The staging
     * buffer holds the whole state, so no region is reused before the
     * final sync. */
    float *st = g->h_stage, *tl = g->h_stage + (size_t)d->n_kda * sn;
    for (int l = 0; l < d->n_kda && rc == KDS_OK; l++) {
        memcpy(st + (size_t)l * sn, s->kda_state + (size_t)l * sn, sn * sizeof(float));
        rc = kern_cuda_memcpy_h2d(g->state[l] + (size_t)slot * sn, st + (size_t)l * sn,
                                  sn * sizeof(float), g->stream, err);
        if (rc == KDS_OK && tn) {
            memcpy(tl + (size_t)l * tn, s->conv_tail + (size_t)l * tn, tn * sizeof(float));
            rc = kern_cuda_memcpy_h2d(g->tail[l] + (size_t)slot * tn, tl + (size_t)l * tn,
                                      tn * sizeof(float), g->stream, err);
        }
    }
    /* the staging buffer is reused by the next call: wait for the copies */
    kds_status rs = kern_cuda_sync(g->stream, err);
    return rc != KDS_OK ? rc : rs;
}

kds_status eng__cuda_state_download(eng_cuda *g, int slot, eng_seq *s, kds_err *err) {
    kds_status rc = check_slot(g, slot, s, err);
    if (rc != KDS_OK) return rc;
    const eng_dims *d = &g->d;
    const size_t sn = (size_t)d->HV * d->K * d->V, tn = (size_t)(d->W - 1) * d->conv_ch;
    for (int l = 0; l < d->n_kda && rc == KDS_OK; l++) {
        rc = kern_cuda_memcpy_d2h(g->h_stage + (size_t)l * sn, g->state[l] + (size_t)slot * sn,
                                  sn * sizeof(float), g->stream, err);
        if (rc == KDS_OK && tn)
            rc = kern_cuda_memcpy_d2h(g->h_stage + (size_t)d->n_kda * sn + (size_t)l * tn,
                                      g->tail[l] + (size_t)slot * tn, tn * sizeof(float), g->stream, err);
    }
    kds_status rs = kern_cuda_sync(g->stream, err);
    if (rc == KDS_OK) rc = rs;
    if (rc != KDS_OK) return rc;
    memcpy(s->kda_state, g->h_stage, (size_t)d->n_kda * sn * sizeof(float));
    memcpy(s->conv_tail, g->h_stage + (size_t)d->n_kda * sn, (size_t)d->n_kda * tn * sizeof(float));
    return KDS_OK;
}

/* Room for `rows` latent rows in every MLA cache of `slot`: geometric
 * growth (a new buffer, the old rows copied over), so a long decode
 * allocates O(log n) times; the device pointer tables follow. */
static kds_status mla_reserve(eng_cuda *g, int slot, int64_t rows, kds_err *err) {
    const eng_dims *d = &g->d;
    if (d->n_mla == 0 || rows <= g->mla_cap[slot]) return KDS_OK;
    int64_t cap = g->mla_cap[slot] ? g->mla_cap[slot] : 256;
    while (cap < rows) cap *= 2;
    const size_t row = (size_t)d->mla_row * sizeof(float);
    kds_status rc = KDS_OK;
    for (int i = 0; i < d->n_mla && rc == KDS_OK; i++) {
        void *p = NULL;
        if ((rc = kern_cuda_malloc(&p, (size_t)cap * row, err)) != KDS_OK) break;
        float *old = g->mla_cache[i][slot];
        if (old && g->mla_cap[slot])
            rc = kern_cuda_memcpy_d2d(p, old, (size_t)g->mla_cap[slot] * row, g->stream, err);
        /* the table entry: a synchronous copy of one pointer */
        if (rc == KDS_OK)
            rc = kern_cuda_memcpy_h2d(g->mla_table[i] + slot, &p, sizeof p, g->stream, err);
        if (rc == KDS_OK) rc = kern_cuda_sync(g->stream, err);
        if (rc != KDS_OK) {
            kern_cuda_free(p);
            break;
        }
        kern_cuda_free(old);
        g->mla_cache[i][slot] = p;
    }
    /* every layer grew, or the capacity stays the smallest one known */
    if (rc == KDS_OK) g->mla_cap[slot] = cap;
    return rc;
}

/* MLA rows [r0, s->pos) of every layer: host -> slot, or slot -> host. */
static kds_status mla_rows_copy(eng_cuda *g, int slot, eng_seq *s, int64_t r0, int up,
                                kds_err *err) {
    const eng_dims *d = &g->d;
    if (d->n_mla == 0 || r0 >= s->pos) return KDS_OK;
    kds_status rc = up ? mla_reserve(g, slot, s->pos, err) : KDS_OK;
    const size_t row = (size_t)d->mla_row, n = (size_t)(s->pos - r0) * row * sizeof(float);
    for (int i = 0; i < d->n_mla && rc == KDS_OK; i++) {
        float *dev = g->mla_cache[i][slot] + (size_t)r0 * row, *host = s->mla_cache[i] + (size_t)r0 * row;
        rc = up ? kern_cuda_memcpy_h2d(dev, host, n, g->stream, err) : kern_cuda_memcpy_d2h(host, dev, n, g->stream, err);
    }
    if (rc == KDS_OK) rc = kern_cuda_sync(g->stream, err);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Residency: a sequence keeps its slot between calls; its host buffers are
 * brought up to date only when read (snapshots, clones: eng__seq_fetch),
 * and uploaded again only after they were written (load, reset).          */

kds_status eng__seq_fetch_slow(const eng_seq *cs, kds_err *err) {
    /* Logically const: the host buffers get the state the sequence already
     * has (on the device). */
    eng_seq *s = (eng_seq *)cs;
    kds_status rc = eng__seq_fetch_logits(s, err);
    if (rc != KDS_OK || !s->gpu_newer) return rc;
    rc = eng__cuda_state_download(s->gpu, s->gpu_slot, s, err);
    /* MLA caches are append-only: only the rows made on the device */
    if (rc == KDS_OK) rc = mla_rows_copy(s->gpu, s->gpu_slot, s, s->gpu_host_rows, 0, err);
    if (rc == KDS_OK) {
        s->gpu_newer = 0;
        s->gpu_host_rows = s->pos;
    }
    return rc;
}

kds_status eng__seq_fetch_logits_slow(const eng_seq *cs, kds_err *err) {
    eng_seq *s = (eng_seq *)cs; /* logically const, as above */
    eng_cuda *g = s->gpu;
    kds_status rc = kern_cuda_memcpy_d2h(s->logits, g->slot_logits + (size_t)s->gpu_slot * g->d.vocab,
                                         (size_t)g->d.vocab * sizeof(float), g->stream, err);
    if (rc == KDS_OK) rc = kern_cuda_sync(g->stream, err);
    if (rc == KDS_OK) s->logits_on_gpu = 0;
    return rc;
}

void eng__seq_detach(eng_seq *s) {
    if (!s->gpu) return;
    s->gpu->owner[s->gpu_slot] = NULL;
    s->gpu = NULL;
    s->gpu_slot = -1;
    s->gpu_newer = s->host_newer = s->logits_on_gpu = 0;
}

/* Give `s` a slot of g with its current state, for a pass at g->clock:
 * its own, else a free one, else the least recently used one that is not
 * part of this pass (whose state goes back to its host buffers first). */
/* The host copy of s (states, tails, latent rows) into `slot`. */
static kds_status upload_seq(eng_cuda *g, int slot, eng_seq *s, kds_err *err) {
    kds_status rc = eng__cuda_state_upload(g, slot, s, err);
    if (rc == KDS_OK) rc = mla_rows_copy(g, slot, s, 0, 1, err);
    if (rc == KDS_OK) {
        s->host_newer = 0;
        s->gpu_host_rows = s->pos;
    }
    return rc;
}

static kds_status make_resident(eng_cuda *g, eng_seq *s, int *slot, kds_err *err) {
    kds_status rc;
    if (s->gpu == g) {
        if (s->host_newer && (rc = upload_seq(g, s->gpu_slot, s, err)) != KDS_OK) return rc;
        g->last_use[s->gpu_slot] = g->clock;
        *slot = s->gpu_slot;
        return KDS_OK;
    }
    if (s->gpu) { /* resident on another context of the same model */
        if ((rc = eng__seq_fetch(s, err)) != KDS_OK) return rc;
        eng__seq_detach(s);
    }
    int pick = -1;
    for (int i = 0; i < g->max_seqs && pick < 0; i++)
        if (!g->owner[i]) pick = i;
    if (pick < 0)
        for (int i = 0; i < g->max_seqs; i++)
            if (g->last_use[i] != g->clock && (pick < 0 || g->last_use[i] < g->last_use[pick]))
                pick = i;
    if (pick < 0)
        return kds_err_set(err, KDS_INTERNAL, "no free GPU state slot (%d in use)", g->max_seqs);
    if (g->owner[pick]) {
        eng_seq *old = g->owner[pick];
        if ((rc = eng__seq_fetch(old, err)) != KDS_OK) return rc;
        eng__seq_detach(old);
    }
    if ((rc = upload_seq(g, pick, s, err)) != KDS_OK) return rc;
    g->owner[pick] = s;
    g->last_use[pick] = g->clock;
    s->gpu = g;
    s->gpu_slot = pick;
    s->gpu_newer = 0;
    *slot = pick;
    return KDS_OK;
}

kds_status eng__cuda_attach(eng_cuda *g, eng_seq *s, kds_err *err) {
    if (s->model != g->m)
        return kds_err_set(err, KDS_INVALID_ARG, "sequence and CUDA context belong to different models");
    int slot;
    g->clock++;
    return make_resident(g, s, &slot, err);
}

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */

/* y [T, ldy] (+)= x [T, ldx] W^T */
static kds_status mm(eng_cuda *g, const dweight *w, const float *x, int ldx, int T, float *y,
                      int ldy, bool acc, kds_err *err) {
    kern_cuda_matmul_args a = {.W = w->p, .w_dtype = w->dt, .rows = w->rows, .cols = w->cols,
                               .x = x, .ldx = ldx, .T = T, .y = y, .ldy = ldy, .accumulate = acc,
                               .gemm = g->gemm, .mode = g->mode};
    return kern_cuda_matmul(&a, g->stream, err);
}

static kds_status norm_rows(eng_cuda *g, const float *x, const float *w, int rows, int n,
                            float eps, float *y, kds_err *err) {
    kern_cuda_norm_args a = {.rows = rows, .n = n, .eps = eps, .x = x, .z = NULL,
                             .z_dtype = KERN_F32, .w = w, .w_dtype = KERN_F32, .y = y,
                             .y_dtype = KERN_F32};
    return kern_cuda_rmsnorm(&a, g->stream, err);
}

#define TRY(call)                                   \
    do {                                            \
        if ((rc = (call)) != KDS_OK) return rc;     \
    } while (0)

/* One KDA mixer: rows of xn -> x += mixer(xn). multi: one token of each of
 * T sequences in slots g->slots[0..T); else T tokens of the sequence in
 * slot `slot`. */
static kds_status kda_layer(eng_cuda *g, const dlayer *L, int kl, int T, int multi, int chunked,
                            int slot, kds_err *err) {
    kds_status rc;
    const eng_dims *d = &g->d;
    const eng_config *cfg = &g->m->cfg;
    const int C = d->conv_ch, taps = d->W - 1, hid = d->hidden;
    float *in = g->ext + (size_t)taps * C;
    /* kl: this layer's index among the KDA layers */
    float *tail0 = g->tail[kl] + (size_t)slot * taps * C;
    if (!multi && taps > 0)
        TRY(kern_cuda_memcpy_d2d(g->ext, tail0, (size_t)taps * C * sizeof(float), g->stream, err));
    TRY(mm(g, &L->q_proj, g->xn, hid, T, in, C, false, err));
    TRY(mm(g, &L->k_proj, g->xn, hid, T, in + d->kda_qk, C, false, err));
    TRY(mm(g, &L->v_proj, g->xn, hid, T, in + 2 * d->kda_qk, C, false, err));
    TRY(mm(g, &L->f_a, g->xn, hid, T, g->fa, L->f_a.rows, false, err));
    TRY(mm(g, &L->b_proj, g->xn, hid, T, g->beta, d->HV, false, err));
    TRY(mm(g, &L->g_a, g->xn, hid, T, g->ga, L->g_a.rows, false, err));
    TRY(mm(g, &L->f_b, g->fa, L->f_a.rows, T, g->g, d->HV * d->K, false, err));
    TRY(mm(g, &L->g_b, g->ga, L->g_a.rows, T, g->gz, d->kda_v, false, err));
    kern_cuda_conv_args ca = {.T = T, .W = d->W, .n_qk = d->kda_qk, .n_v = d->kda_v,
                              .ext = g->ext, .w = L->conv_w, .tails = multi ? g->tail[kl] : NULL,
                              .slots = multi ? g->slots : NULL, .q = g->q, .k = g->k, .v = g->v};
    TRY(kern_cuda_short_conv(&ca, g->stream, err));
    if (!multi && taps > 0)
        TRY(kern_cuda_memcpy_d2d(tail0, g->ext + (size_t)T * C, (size_t)taps * C * sizeof(float),
                                 g->stream, err));
    const kern_kda_shape sh = {d->H, d->HV, d->K, d->V, 1.0f / sqrtf((float)d->K)};
    const float lb = cfg->has_gate_lower_bound ? cfg->gate_lower_bound : 0.0f;
    if (chunked && !multi) {
        kern_cuda_kda_prefill_args pa = {.shape = sh, .T = T, .in_dtype = KERN_F32, .raw = true,
                                         .q = g->q, .k = g->k, .v = g->v, .g = g->g,
                                         .beta = g->beta, .A_log = L->A_log,
                                         .dt_bias = L->dt_bias, .lower_bound = lb,
                                         .state = g->state[kl] + (size_t)slot * d->HV * d->K * d->V,
                                         .o = g->o,
                                         .workspace = g->ws, .workspace_bytes = g->ws_bytes,
                                         /* bf16 x 3 products: ~1e-5, as the GEMMs */
                                         .tensor_cores = d->K % 16 == 0 && !g->prefill_fp32};
        rc = kern_cuda_kda_prefill(&pa, g->stream, err);
        if (rc == KDS_UNSUPPORTED && pa.tensor_cores) {
            /* the tensor-core kernels' shared memory is more than this GPU
             * has (A100): the fp32 kernels from now on */
            g->prefill_fp32 = 1;
            pa.tensor_cores = false;
            rc = kern_cuda_kda_prefill(&pa, g->stream, err);
        }
        if (rc != KDS_OK) return rc;
    } else {
        kern_cuda_kda_decode_args da = {.shape = sh, .N = T, .in_dtype = KERN_F32, .q = g->q,
                                        .k = g->k, .v = g->v, .g_raw = g->g, .beta_raw = g->beta,
                                        .A_log = L->A_log, .dt_bias = L->dt_bias,
                                        .lower_bound = lb, .state_pool = g->state[kl],
                                        .pool_slots = g->max_seqs, .slots = g->slots, .o = g->o};
        TRY(kern_cuda_kda_decode(&da, g->stream, err));
    }
    kern_cuda_norm_args na = {.rows = T * d->HV, .n = d->V, .eps = cfg->rms_norm_eps, .x = g->o,
                              .z = g->gz, .z_dtype = KERN_F32, .w = L->o_norm,
                              .w_dtype = KERN_F32, .y = g->o, .y_dtype = KERN_F32};
    TRY(kern_cuda_rmsnorm(&na, g->stream, err));
    return mm(g, &L->o_proj, g->o, d->kda_v, T, g->x, hid, true, err);
}

static kds_status moe_ffn(eng_cuda *g, const dlayer *L, int T, kds_err *err) {
    kds_status rc;
    const eng_config *cfg = &g->m->cfg;
    const int E = g->E, k = g->top_k, hid = g->d.hidden;
    const int inner = cfg->moe_intermediate_size, sh_inner = L->sh_gate.rows;
    TRY(mm(g, &L->router, g->xn, hid, T, g->router, E, false, err));
    kern_cuda_moe_route_args ra = {
        .p = {.n_experts = E,
              .top_k = k,
              .n_group = cfg->use_grouped_topk && cfg->num_expert_group > 1 ? cfg->num_expert_group : 1,
              .topk_group = cfg->topk_group,
              .renormalize = cfg->moe_renormalize,
              .routed_scaling_factor = cfg->routed_scaling_factor},
        .T = T, .logits = g->router, .apply_sigmoid = true, .bias = L->router_bias,
        .sel = g->sel, .w = g->selw, .exp_off = g->exp_off, .row_of = g->row_of,
        .tok_of = g->tok_of};
    TRY(kern_cuda_moe_route(&ra, g->stream, err));
    TRY(kern_cuda_moe_gather(g->xn, (size_t)hid * sizeof(float), g->tok_of, T * k, g->xg, g->stream,
                             err));
    float *sh_a = g->fa_buf + (size_t)T * k * inner, *sh_b = g->fb_buf + (size_t)T * k * inner;
    if (sh_inner > 0) {
        TRY(mm(g, &L->sh_gate, g->xn, hid, T, sh_a, sh_inner, false, err));
        TRY(mm(g, &L->sh_up, g->xn, hid, T, sh_b, sh_inner, false, err));
        TRY(kern_cuda_swiglu(sh_a, sh_b, (size_t)T * sh_inner, g->stream, err));
        TRY(mm(g, &L->sh_down, sh_a, sh_inner, T, g->shared_out, hid, false, err));
    }
    /* The routed experts, grouped by kern_cuda_moe_experts reading the
     * offsets on the device (no host sync): gate and up fused into
     * silu(x W1^T) * (x W3^T), then W2. Each expert's [w1 | w3 | w2] sits
     * at L->experts + e * expert_stride. */
    const size_t b1 = (size_t)L->w1[0].rows * L->w1[0].cols * kern_dtype_size(L->w1[0].dt),
                 b3 = (size_t)L->w3[0].rows * L->w3[0].cols * kern_dtype_size(L->w3[0].dt);
    kern_cuda_moe_experts_args ea = {.E = E, .rows = inner, .cols = hid, .w_dtype = L->w1[0].dt,
                                     .W_base = L->experts, .W3_base = (const char *)L->experts + b1,
                                     .w_stride = L->expert_stride, .exp_off = g->exp_off,
                                     .n_rows = T * k, .x = g->xg, .ldx = hid, .y = g->fa_buf,
                                     .ldy = inner, .mode = g->mode};
    TRY(kern_cuda_moe_experts(&ea, g->stream, err));
    kern_cuda_moe_experts_args da = {.E = E, .rows = hid, .cols = inner, .w_dtype = L->w2[0].dt,
                                     .W_base = (const char *)L->experts + b1 + b3,
                                     .w_stride = L->expert_stride, .exp_off = g->exp_off,
                                     .n_rows = T * k, .x = g->fa_buf, .ldx = inner, .y = g->yg,
                                     .ldy = hid, .mode = g->mode};
    TRY(kern_cuda_moe_experts(&da, g->stream, err));
    TRY(kern_cuda_moe_combine(g->yg, g->row_of, g->selw, T, k, hid,
                              sh_inner > 0 ? g->shared_out : NULL, g->mix, g->stream, err));
    return kern_cuda_add(g->x, g->mix, (size_t)T * hid, g->stream, err);
}

/* One MLA mixer (spec §5, absorbed, no RoPE): rows of xn -> x += mixer(xn).
 * multi: one token of each of T sequences (slots g->slots, positions
 * g->pos); else T tokens of the sequence in `slot` from position pos0. */
static kds_status mla_layer(eng_cuda *g, const dlayer *L, int ml, int T, int multi, int slot,
                            int64_t pos0, int max_ctx, kds_err *err) {
    kds_status rc;
    const eng_dims *d = &g->d;
    const eng_config *cfg = &g->m->cfg;
    const int hid = d->hidden, qw = d->mla_heads * (d->dn + d->dr);
    if (cfg->q_lora_rank > 0) {
        TRY(mm(g, &L->q_a, g->xn, hid, T, g->fa, cfg->q_lora_rank, false, err));
        TRY(norm_rows(g, g->fa, L->q_a_norm, T, cfg->q_lora_rank, cfg->rms_norm_eps, g->fa, err));
        TRY(mm(g, &L->q_b, g->fa, cfg->q_lora_rank, T, g->mq, qw, false, err));
    } else {
        TRY(mm(g, &L->mq_proj, g->xn, hid, T, g->mq, qw, false, err));
    }
    TRY(mm(g, &L->kv_a, g->xn, hid, T, g->kva, d->mla_row, false, err));
    kern_cuda_mla_rows map = {.rows = T};
    if (multi) {
        map.caches = g->mla_table[ml];
        map.n_caches = g->max_seqs;
        map.slots = g->slots;
        map.pos = g->pos;
    } else {
        map.cache = g->mla_cache[ml][slot];
        map.pos0 = pos0;
    }
    kern_cuda_mla_append_args aa = {.map = map, .dc = d->dc, .dr = d->dr, .eps = cfg->rms_norm_eps,
                                    .kva = g->kva, .norm_w = L->kv_a_norm, .norm_w_dtype = KERN_F32};
    TRY(kern_cuda_mla_cache_append(&aa, g->stream, err));
    kern_cuda_mla_args ma = {.shape = {d->mla_heads, d->dc, d->dr, d->dn, d->dv}, .map = map,
                             .q = g->mq, .kv_b = L->kv_b.p, .kv_b_dtype = L->kv_b.dt, .o = g->o,
                             .max_ctx = max_ctx, .n_split = 0, .workspace = g->mla_ws,
                             .workspace_bytes = g->mla_ws_bytes};
    TRY(kern_cuda_mla_attention(&ma, g->stream, err));
    return mm(g, &L->o_proj, g->o, d->mla_heads * d->dv, T, g->x, hid, true, err);
}

static kds_status dense_ffn(eng_cuda *g, const dlayer *L, int T, kds_err *err) {
    kds_status rc;
    const int hid = g->d.hidden, inner = L->gate.rows;
    TRY(mm(g, &L->gate, g->xn, hid, T, g->fa_buf, inner, false, err));
    TRY(mm(g, &L->up, g->xn, hid, T, g->fb_buf, inner, false, err));
    TRY(kern_cuda_swiglu(g->fa_buf, g->fb_buf, (size_t)T * inner, g->stream, err));
    return mm(g, &L->down, g->fa_buf, inner, T, g->x, hid, true, err);
}

/* The device part of a pass over T rows whose states sit in slots 0.. */
/* The queued part of a pass (no sync, so it can be captured into a graph):
 * ids, slots and positions from their pinned buffers (h_ids, h_slots,
 * h_pos: read when the pass runs), the layers, and the logits of rows
 * [first, T) into `dst` (NULL: none for one sequence; for a decode pass,
 * left in g->logits and copied to each row's slot in g->slot_logits). */
static kds_status run_layers(eng_cuda *g, int T, int multi, int chunked, int slot, int64_t pos0,
                             int max_ctx, float *dst, int first, kds_err *err) {
    kds_status rc;
    const eng_model *m = g->m;
    const eng_config *cfg = &m->cfg;
    const int hid = g->d.hidden;
    const float eps = cfg->rms_norm_eps;
    const int n_rows_seqs = multi ? T : 1;
    TRY(kern_cuda_memcpy_h2d(g->ids, g->h_ids, (size_t)T * sizeof(int32_t), g->stream, err));
    /* the decode kernel reads slots on the device, also for one sequence */
    TRY(kern_cuda_memcpy_h2d(g->slots, g->h_slots, (size_t)n_rows_seqs * sizeof(int32_t), g->stream,
                             err));
    if (g->d.n_mla)
        TRY(kern_cuda_memcpy_h2d(g->pos, g->h_pos, (size_t)n_rows_seqs * sizeof(int32_t), g->stream,
                                 err));
    TRY(kern_cuda_embed(g->embed, m->embed_tokens.dt, g->d.vocab, hid, g->ids, T, g->x, g->stream, err));
    for (int l = 0; l < cfg->num_hidden_layers; l++) {
        const dlayer *L = &g->layers[l];
        TRY(norm_rows(g, g->x, L->in_norm, T, hid, eps, g->xn, err));
        if (L->is_mla)
            TRY(mla_layer(g, L, g->d.layer_slot[l], T, multi, slot, pos0, max_ctx, err));
        else
            TRY(kda_layer(g, L, g->d.layer_slot[l], T, multi, chunked, slot, err));
        TRY(norm_rows(g, g->x, L->post_norm, T, hid, eps, g->xn, err));
        TRY(L->is_moe ? moe_ffn(g, L, T, err) : dense_ffn(g, L, T, err));
    }
    if (!dst && !multi) return KDS_OK; /* a prefill step before the last: no logits */
    const int n = T - first;
    TRY(norm_rows(g, g->x + (size_t)first * hid, g->final_norm, n, hid, eps, g->xn, err));
    TRY(mm(g, &g->lm_head, g->xn, hid, n, g->logits, g->d.vocab, false, err));
    if (!dst) /* decode with the logits left on the device: each row to its slot's row */
        return kern_cuda_rows_scatter(g->logits, (size_t)g->d.vocab * sizeof(float), g->slots, n,
                                      g->slot_logits, g->stream, err);
    return kern_cuda_memcpy_d2h(dst, g->logits, (size_t)n * g->d.vocab * sizeof(float), g->stream,
                                err);
}

int eng__cuda_graph_count(const eng_cuda *g) {
    if (g->graphs_off) return -1;
    int n = 0;
    for (size_t i = 0; i < (size_t)2 * g->max_seqs * ENG_CUDA_CTX_BUCKETS; i++)
        n += g->graphs[i] != NULL;
    return n;
}

/* Decode passes leave their logits on the device (fetched when read, or
 * sampled there by eng_sample / eng_decode_batch_sample) where rows can be
 * scattered in 16-byte words. */
static int lazy_logits(const eng_cuda *g) { return g->d.vocab % 4 == 0; }

bool eng__cuda_sampler_takes(const eng_cuda *g, const eng_sampler_params *p) {
    const int V = g->d.vocab;
    if (!lazy_logits(g)) return false;
    const int k = p->top_k <= 0 || p->top_k >= V ? V : p->top_k; /* top-k off: every id */
    return V % 4 == 0 && (p->temperature <= 0.0f || k <= KERN_CUDA_SAMPLE_MAX_K);
}

/* ceil(log2(n)) for n >= 1: the context bucket of a decode graph */
static int ctx_bucket(int n) {
    int b = 0;
    while (b < 31 && (1 << b) < n) b++;
    return b;
}

/*
 * A decode pass of T sequences (one token each) through a CUDA graph: one
 * per (T, context bucket), captured the first time and replayed after
 * (each replay reads this step's ids, slots and positions from the pinned
 * buffers). The MLA split choice depends on the longest context, so MLA
 * models get a graph per power of two of it (captured for the bucket's
 * top; shorter rows are still attended exactly). If capture is not
 * available or fails, graphs are switched off for the context and passes
 * run with plain launches.
 */
static kds_status decode_pass(eng_cuda *g, int T, int max_ctx, int lazy, kds_err *err) {
    kds_status rc;
    const int b = g->d.n_mla ? ctx_bucket(max_ctx) : 0;
    float *dst = lazy ? NULL : g->h_logits;
    void **slot = &g->graphs[((size_t)lazy * g->max_seqs + (size_t)(T - 1)) * ENG_CUDA_CTX_BUCKETS + b];
    if (!g->graphs_off && !*slot) {
        kds_err cap_err;
        kds_err_clear(&cap_err);
        if (kern_cuda_graph_begin(g->stream, &cap_err) == KDS_OK) {
            rc = run_layers(g, T, 1, 0, 0, 0, g->d.n_mla ? 1 << b : 0, dst, 0, &cap_err);
            void *exec = NULL;
            kds_status end = kern_cuda_graph_end(g->stream, &exec, &cap_err);
            if (rc == KDS_OK && end == KDS_OK)
                *slot = exec;
            else
                kern_cuda_graph_free(exec);
        }
        if (!*slot) g->graphs_off = 1;
    }
    if (*slot)
        TRY(kern_cuda_graph_launch(*slot, g->stream, err));
    else
        TRY(run_layers(g, T, 1, 0, 0, 0, max_ctx, dst, 0, err));
    return kern_cuda_sync(g->stream, err);
}

/* eng__cuda_forward; lazy (decode only): the logits stay in g->logits. */
static kds_status forward_impl(eng_cuda *g, eng_seq *const *seqs, int n_seqs, const int32_t *ids,
                               int T, int chunked, float *logits, int want_last, int lazy,
                               kds_err *err) {
    kds_status rc = KDS_OK;
    /* one token per sequence (every decode, also of one sequence) takes the
     * batched path: slots and positions on the device, graphs */
    const int multi = n_seqs > 1 || !chunked;
    const int vocab = g->d.vocab;
    if (T < 1 || T > (multi ? g->max_seqs : g->max_batch))
        return kds_err_set(err, KDS_INVALID_ARG, "CUDA forward of %d rows (limit %d)", T,
                           multi ? g->max_seqs : g->max_batch);
    /* every sequence of the pass gets a slot (uploading its state only if
     * it was not resident or its host copy was written since) */
    g->clock++;
    for (int i = 0; i < n_seqs && rc == KDS_OK; i++) rc = make_resident(g, seqs[i], &g->h_slots[i], err);
    /* room for this pass's latent rows; the positions and slots of the rows
     * go to the device (the decode kernel reads slots there, also for one
     * sequence) */
    int max_ctx = 0;
    for (int i = 0; i < n_seqs && rc == KDS_OK; i++) {
        const int64_t end = seqs[i]->pos + (multi ? 1 : T);
        if (end > INT32_MAX) {
            rc = kds_err_set(err, KDS_UNSUPPORTED, "device 'cuda': contexts above 2^31 tokens");
            break;
        }
        g->h_pos[i] = (int32_t)seqs[i]->pos;
        if (end > max_ctx) max_ctx = (int)end;
        rc = mla_reserve(g, g->h_slots[i], end, err);
    }
    if (rc != KDS_OK) return rc;
    /* the ids were checked by the caller (eng_prefill / eng_decode*) */
    memcpy(g->h_ids, ids, (size_t)T * sizeof(int32_t));
    /* Logits land in a host buffer first so a failure leaves the
     * sequences untouched: the caller's logits_all (one sequence), else
     * h_logits (the last row of one sequence, or one row per sequence). */
    const int need = logits || want_last || multi;
    const int first = logits || multi ? 0 : T - 1;
    float *dst = !need ? NULL : logits ? logits : g->h_logits;
    if (multi) {
        rc = decode_pass(g, T, max_ctx, lazy, err);
    } else {
        rc = run_layers(g, T, 0, chunked, g->h_slots[0], seqs[0]->pos, max_ctx, dst, first, err);
        if (rc == KDS_OK) rc = kern_cuda_sync(g->stream, err);
    }
    if (rc != KDS_OK) return rc;
    /* the device copies are now ahead of the host buffers */
    for (int i = 0; i < n_seqs; i++) seqs[i]->gpu_newer = 1;
    /* the host bookkeeping of forward() */
    for (int t = 0; t < T; t++) eng__seq_push_recent(seqs[multi ? t : 0], ids[t]);
    if (multi)
        for (int t = 0; t < T; t++) seqs[t]->pos++;
    else
        seqs[0]->pos += T;
    if (!need) {
        seqs[0]->has_logits = 0;
    } else if (multi) {
        for (int t = 0; t < T; t++) {
            if (!lazy) memcpy(seqs[t]->logits, dst + (size_t)t * vocab, (size_t)vocab * sizeof(float));
            seqs[t]->logits_on_gpu = lazy;
            seqs[t]->has_logits = 1;
        }
    } else {
        memcpy(seqs[0]->logits, dst + (size_t)(T - 1 - first) * vocab, (size_t)vocab * sizeof(float));
        seqs[0]->has_logits = 1;
    }
    return KDS_OK;
}

kds_status eng__cuda_forward(eng_cuda *g, eng_seq *const *seqs, int n_seqs, const int32_t *ids,
                             int T, int chunked, float *logits, int want_last, kds_err *err) {
    const int decode = n_seqs > 1 || !chunked;
    return forward_impl(g, seqs, n_seqs, ids, T, chunked, logits, want_last,
                        decode && !logits && lazy_logits(g), err);
}

/* Sample the n rows now in g->logits (rows of seqs, in order) with p on the
 * device: the repetition penalty from each sequence's recent tokens, its
 * RNG state up and back; next[i] out. g->logits is the pass's scratch
 * copy (the sampler rewrites penalised entries in place). */
static kds_status sample_rows(eng_cuda *g, eng_seq *const *seqs, int n, const eng_sampler_params *p,
                              int32_t *next, kds_err *err) {
    kds_status rc;
    const int V = g->d.vocab;
    int32_t *h_pen = (int32_t *)g->h_samp;
    uint64_t *h_rng = (uint64_t *)(g->h_samp + (size_t)g->max_seqs * ENG_RECENT_TOKENS * 4);
    int32_t *h_tok = (int32_t *)((unsigned char *)h_rng + (size_t)g->max_seqs * 32);
    /* each row's penalised ids as eng_sample picks them, padded with -1
     * (ignored by the sampler) to one width */
    int any = 0;
    for (int i = 0; i < n; i++) {
        int32_t *row = h_pen + (size_t)i * ENG_RECENT_TOKENS;
        int k = eng__seq_penalty_ids(seqs[i], p, row);
        for (int j = k; j < ENG_RECENT_TOKENS; j++) row[j] = -1;
        any |= k;
        memcpy(h_rng + (size_t)i * 4, seqs[i]->rng, 32);
    }
    const int n_pen = any ? ENG_RECENT_TOKENS : 0;
    if (n_pen)
        TRY(kern_cuda_memcpy_h2d(g->d_pen, h_pen, (size_t)n * n_pen * sizeof(int32_t), g->stream, err));
    TRY(kern_cuda_memcpy_h2d(g->d_rng, h_rng, (size_t)n * 32, g->stream, err));
    kern_cuda_sample_args sa = {.N = n, .V = V, .logits = g->logits,
                                .params = {.temperature = p->temperature, .top_k = p->top_k,
                                           .top_p = p->top_p, .min_p = p->min_p,
                                           .repeat_penalty = p->repeat_penalty},
                                .penalty_ids = n_pen ? g->d_pen : NULL, .n_penalty = n_pen,
                                .rng = g->d_rng, .tokens = g->d_tok};
    TRY(kern_cuda_sample(&sa, g->stream, err));
    TRY(kern_cuda_memcpy_d2h(h_tok, g->d_tok, (size_t)n * sizeof(int32_t), g->stream, err));
    TRY(kern_cuda_memcpy_d2h(h_rng, g->d_rng, (size_t)n * 32, g->stream, err));
    TRY(kern_cuda_sync(g->stream, err));
    for (int i = 0; i < n; i++) {
        next[i] = h_tok[i];
        memcpy(seqs[i]->rng, h_rng + (size_t)i * 4, 32);
    }
    return KDS_OK;
}

kds_status eng__cuda_sample_one(eng_cuda *g, eng_seq *s, const eng_sampler_params *p, int32_t *token,
                                kds_err *err) {
    kds_status rc;
    /* the slot's row into the scratch the sampler may rewrite */
    TRY(kern_cuda_memcpy_d2d(g->logits, g->slot_logits + (size_t)s->gpu_slot * g->d.vocab,
                             (size_t)g->d.vocab * sizeof(float), g->stream, err));
    return sample_rows(g, &s, 1, p, token, err);
}

/*
 * The decode pass with its logits left on the device (copied to the slots'
 * rows, where eng__seq_fetch_logits finds them), then the sampler on the
 * pass's copy: only the tokens and the advanced RNG states come back. The
 * caller checked eng__cuda_sampler_takes(g, p).
 */
kds_status eng__cuda_decode_sample(eng_cuda *g, eng_seq *const *seqs, int n, const int32_t *ids,
                                   const eng_sampler_params *p, int32_t *next, kds_err *err) {
    /* the pass leaves its rows in g->logits (and copies them to the slots) */
    kds_status rc = forward_impl(g, seqs, n, ids, n, 0, NULL, 1, 1, err);
    return rc != KDS_OK ? rc : sample_rows(g, seqs, n, p, next, err);
}

#endif /* KDS_HAVE_CUDA */
