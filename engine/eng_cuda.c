/*
 * eng_cuda.c - the CUDA backend (eng_backend.h; built only with the CUDA
 * kernels): device memory, one stream, per-sequence state slots, CUDA
 * graphs for decode passes, and each op of the forward pass as the kernels
 * of kernels/kern_cuda.h. The layer sequence itself is eng_forward.c's.
 *
 * The ops (x, xn: [rows, hidden] fp32 on the device):
 *   embed          kern_cuda_embed (the table on the device)
 *   rmsnorm        kern_cuda_rmsnorm
 *   matmul         kern_cuda_matmul per product: a GEMV for up to 8 rows,
 *                  cuBLAS (the context's GEMM context) above; accumulate
 *                  is cuBLAS's beta = 1
 *   kda            [tail copy,] kern_cuda_short_conv, the chunked prefill
 *                  (kern_cuda_kda_prefill, raw inputs) or the decode step
 *                  (kern_cuda_kda_decode), the gated kern_cuda_rmsnorm
 *   mla            kern_cuda_mla_cache_append, kern_cuda_mla_attention
 *   moe_route      kern_cuda_moe_route, kern_cuda_moe_gather
 *   moe_experts    the shared expert's products, kern_cuda_moe_experts
 *                  (grouped, the offsets read on the device: no host sync)
 *   moe_combine    kern_cuda_moe_combine
 *   sample         kern_cuda_sample on the rows a decode left on the device
 *
 * Weights (ops->load): every matrix of the model's weight table, as stored,
 * in a buffer of its own, except each MoE layer's routed experts, which
 * share one buffer [E][w1 | w3 | w2] (one base and stride for the grouped
 * products); the small-vector arena in one buffer, so a vector's copy is at
 * its offset in the arena. A generated model (eng_model_generate) has its
 * matrices made here by kern_cuda_gen_normal.
 *
 * Residency: a sequence keeps its slot between calls; its host buffers are
 * brought up to date only when read (snapshots, clones: ops->fetch) and
 * uploaded again only after they were written (load, reset). A pass over
 * more sequences than free slots evicts the least recently used one not in
 * the pass (its state goes back to its host buffers first).
 *
 * Decode passes (one token per sequence, also of one sequence) run through
 * the slot table: slots, positions and ids are read on the device, so each
 * (batch size, context bucket) is captured into a CUDA graph once and
 * replayed after, with this step's values in pinned buffers.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "eng_backend.h"
#include "eng_cuda.h"
#include "eng_pool.h"
#include "kern_cuda.h"

/* Decode graphs per power of two of the longest context (MLA models). */
#define ENG_CUDA_CTX_BUCKETS 32

/* An MoE layer's routed experts on the device: expert e's w1 at
 * base + e * stride, its w3 at + w3_off, its w2 at + w2_off. Block formats
 * (MXFP4) keep their scales apart, likewise: expert e's w1 scales at
 * sbase + e * s_stride, w3's at + s3_off, w2's at + s2_off (sbase NULL for
 * element formats). */
typedef struct dbank {
    const void *base;
    size_t stride, w3_off, w2_off;
    const void *sbase;
    size_t s_stride, s3_off, s2_off;
} dbank;

struct eng_cuda {
    eng_backend base;
    const eng_model *m;
    eng_dims d;
    int B, max_batch, max_seqs;
    void **allocs;                   /* every device buffer, freed with the backend */
    int n_allocs, cap_allocs;
    /* the weights (ops->load) */
    const void **dev_w;              /* [m->n_weights] by eng_weight.id */
    dbank *banks;                    /* [m->n_moe] */
    float *dev_small;                /* the small-vector arena */
    int loaded;
    /* per-sequence state slots, per KDA layer: [max_seqs, HV, K, V], [max_seqs, taps, C] */
    float **state, **tail;
    /* residency: which sequence holds each slot, and when it last ran */
    eng_seq **owner;                 /* [max_seqs] */
    uint64_t *last_use;              /* [max_seqs] */
    uint64_t clock;                  /* passes so far */
    /* a pass's inputs: device copies and their pinned staging */
    int32_t *ids, *h_ids;            /* [B] token ids */
    int32_t *slots, *h_slots;        /* [max_seqs]: the slot of each row of a pass */
    int32_t *pos, *h_pos;            /* [max_seqs]: positions of a pass (MLA) */
    int pass_slot;                   /* one sequence's pass: its slot, */
    int64_t pass_pos0;               /* its position, */
    int pass_max_ctx;                /* and the longest context of the pass (MLA splits) */
    float *logits;                   /* [B, vocab]: the lm_head's rows */
    eng_seq **rows_seqs;             /* [max_seqs]: whose rows `logits` holds after a decode */
    int rows_n;                      /* left them there (0: stale) */
    void *ws;                        /* prefill workspace */
    size_t ws_bytes;
    kern_cuda_gemm_ctx *gemm;        /* cuBLAS for products of more than 8 rows */
    kern_cuda_gemm_mode mode;        /* their activations: EXACT (hi + lo) or BF16 */
    void *stream;                    /* every copy and kernel of the backend runs here */
    void **graphs;                   /* [2][max_seqs][ENG_CUDA_CTX_BUCKETS] decode graphs (logits
                                      * to the host or left on the device), or NULL */
    int graphs_off;                  /* capture unavailable, or KDS_CUDA_GRAPHS=0 */
    int prefill_fp32;                /* the tensor-core prefill does not fit this GPU */
    /* sampling: each slot's logits row, the sampler's inputs and outputs */
    float *slot_logits;              /* [max_seqs, vocab] */
    int32_t *d_pen, *d_tok;          /* [max_seqs, ENG_RECENT_TOKENS], [max_seqs] */
    uint64_t *d_rng;                 /* [max_seqs, 4] */
    kern_sample_params *d_sp;        /* [max_seqs]: each row's settings, when they differ */
    unsigned char *h_samp;           /* pinned staging of the four */
    /* MLA: per MLA layer and slot a latent cache [cap, dc + dr] (grown
     * geometrically), and its device pointer table */
    float ***mla_cache;              /* [n_mla][max_seqs] device pointers (host array) */
    float ***mla_table;              /* [n_mla] device arrays [max_seqs] of the same */
    int64_t *mla_cap;                /* [max_seqs] rows each slot's caches hold */
    void *mla_ws;                    /* kern_cuda_mla_attention workspace */
    size_t mla_ws_bytes;
    /* host side */
    float *h_stage;                  /* pinned: one sequence's KDA states and conv tails */
    eng_pool *stage_pool;            /* copies between h_stage and a sequence (NULL: one thread) */
    float *h_logits;                 /* pinned [max_seqs, vocab]: logits before they go to the seqs */
};

static eng_cuda *cuda_of(eng_backend *b) { return (eng_cuda *)b; }

/* The sticky error: an op runs only while the pass has none. */
static bool live(const eng_cuda *g) { return g->base.rc == KDS_OK; }
static void note(eng_cuda *g, kds_status rc) { eng__backend_note(&g->base, rc); }

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

/* Device copies of the model's weights. */
static const void *dev_weight(const eng_cuda *g, const eng_weight *w) {
    return w->id > 0 ? g->dev_w[w->id] : NULL;
}

static const float *dev_vector(const eng_cuda *g, const float *host) {
    return host ? g->dev_small + (host - g->m->small_f32) : NULL;
}

/* ------------------------------------------------------------------------ */
/* What the kernels can do                                                   */

/* Decode passes leave their logits on the device (fetched when read, or
 * sampled there) where rows can be scattered in 16-byte words. */
static int lazy_logits(const eng_model *m) { return m->cfg.vocab_size % 4 == 0; }

static bool cuda_supports(const eng_model *m, const eng_op_query *q, kds_err *why) {
    eng_dims d;
    eng__dims(&m->cfg, &d);
    /* bf16 and f32 everywhere; MXFP4 for the routed experts (the grouped
     * products read its codes and scales) */
    const bool mxfp4_experts = q->op == ENG_OP_MOE_EXPERTS && q->w && q->w->dt == KERN_MXFP4;
    if (q->w && q->w->rows > 0 && q->w->dt != KERN_F32 && q->w->dt != KERN_BF16 && !mxfp4_experts) {
        kds_err_set(why, KDS_UNSUPPORTED,
                    "device 'cuda': %s weights (%s) are not supported on the GPU (bf16 or f32, "
                    "and MXFP4 for routed experts; use --device cpu, or `kdaserve quantize "
                    "--experts mxfp4`)", kern_dtype_name(q->w->dt),
                    q->op == ENG_OP_MOE_EXPERTS ? "routed experts" : "a dense product");
        return false;
    }
    switch (q->op) {
    case ENG_OP_KDA: {
        /* the kernels' compiled shapes (kern_cuda.h) */
        const bool k_ok = q->chunked ? d.K == 8 || d.K == 16 || d.K == 32 || d.K == 64 || d.K == 128
                                     : d.K == 64 || d.K == 128;
        const bool v_ok = q->chunked ? d.V % 4 == 0 && d.V <= 128 : d.V % 32 == 0;
        if (k_ok && v_ok) return true;
        kds_err_set(why, KDS_UNSUPPORTED,
                    "device 'cuda': KDA heads of key dim %d and value dim %d are not supported by "
                    "the GPU's %s kernel (use --device cpu)", d.K, d.V,
                    q->chunked ? "prefill" : "decode");
        return false;
    }
    case ENG_OP_MLA:
        if (kern_cuda_mla_attention_smem_bytes(&(kern_mla_shape){d.mla_heads, d.dc, d.dr, d.dn, d.dv}))
            return true;
        kds_err_set(why, KDS_UNSUPPORTED,
                    "device 'cuda': MLA with kv_lora_rank %d is not supported on the GPU "
                    "(64, 128, 256 or 512; use --device cpu)", d.dc);
        return false;
    case ENG_OP_MOE_ROUTE: {
        const eng_config *c = &m->cfg;
        const int E = c->num_experts, k = c->num_experts_per_token;
        if (E <= 1024 && k <= 32 && (!c->use_grouped_topk || c->num_expert_group <= 256)) return true;
        kds_err_set(why, KDS_UNSUPPORTED,
                    "device 'cuda': routing %d of %d experts is beyond the GPU router "
                    "(at most 32 of 1024; use --device cpu)", k, E);
        return false;
    }
    case ENG_OP_ATTN_RES: {
        /* the mix's candidates: every block's snapshot and the partial */
        const int bs = m->cfg.attn_res_block_size, L = m->cfg.num_hidden_layers;
        const int slabs = bs > 0 ? (L + bs - 1) / bs + 1 : 0;
        if (d.hidden <= KERN_CUDA_ATTN_RES_MAX_D && slabs <= 64) return true;
        kds_err_set(why, KDS_UNSUPPORTED,
                    "device 'cuda': Block Attention Residuals over %d candidates of width %d are "
                    "beyond the GPU kernel (at most 64 of width %d; use --device cpu)", slabs,
                    d.hidden, KERN_CUDA_ATTN_RES_MAX_D);
        return false;
    }
    case ENG_OP_SAMPLE: {
        const eng_sampler_params *p = q->sampler;
        const int V = m->cfg.vocab_size;
        const int k = p->top_k <= 0 || p->top_k >= V ? V : p->top_k; /* top-k off: every id */
        return lazy_logits(m) && (p->temperature <= 0.0f || k <= KERN_CUDA_SAMPLE_MAX_K);
    }
    default: return true;
    }
}

/* ------------------------------------------------------------------------ */
/* Lifecycle                                                                 */

kds_status eng__cuda_create(const eng_model *m, int max_batch, int max_seqs, bool bf16,
                            eng_cuda **out, kds_err *err) {
    *out = NULL;
    kds_err why;
    kds_err_clear(&why);
    if (!kern_cuda_available(&why))
        return kds_err_set(err, KDS_UNSUPPORTED, "device 'cuda': no usable CUDA device (%s)",
                           why.msg);
    eng_cuda *g = calloc(1, sizeof *g);
    if (!g) return kds_err_set(err, KDS_NOMEM, "out of memory creating a CUDA context");
    kds_status rc = KDS_OK;
    const eng_config *cfg = &m->cfg;
    g->base.ops = &eng__cuda_ops;
    g->m = m;
    eng__dims(cfg, &g->d);
    const eng_dims *d = &g->d;
    g->mode = bf16 ? KERN_CUDA_GEMM_BF16 : KERN_CUDA_GEMM_EXACT;
    g->max_batch = max_batch;
    g->max_seqs = max_seqs;
    g->B = max_batch > max_seqs ? max_batch : max_seqs;
    const char *graphs_env = getenv("KDS_CUDA_GRAPHS");
    g->graphs_off = graphs_env && strcmp(graphs_env, "0") == 0;
    const int taps = d->W - 1, C = d->conv_ch;
    const size_t B = (size_t)g->B;
    g->graphs = calloc((size_t)2 * max_seqs * ENG_CUDA_CTX_BUCKETS, sizeof *g->graphs);
    g->state = calloc((size_t)d->n_kda + 1, sizeof *g->state);
    g->tail = calloc((size_t)d->n_kda + 1, sizeof *g->tail);
    g->owner = calloc((size_t)max_seqs, sizeof *g->owner);
    g->last_use = calloc((size_t)max_seqs, sizeof *g->last_use);
    g->rows_seqs = calloc((size_t)max_seqs, sizeof *g->rows_seqs);
    if (!g->graphs || !g->state || !g->tail || !g->owner || !g->last_use || !g->rows_seqs) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory creating a CUDA context");
        goto fail;
    }
    if ((rc = kern_cuda_stream_create(&g->stream, err)) != KDS_OK) goto fail;
    /* state slots */
    for (int s = 0; s < d->n_kda; s++) {
        if ((rc = dalloc(g, (void **)&g->state[s], (size_t)max_seqs * d->HV * d->K * d->V * 4, err)) ||
            (rc = dalloc(g, (void **)&g->tail[s], (size_t)max_seqs * (taps > 0 ? taps : 1) * C * 4, err)))
            goto fail;
    }
    if ((rc = dalloc(g, (void **)&g->slots, (size_t)max_seqs * 4, err)) ||
        (rc = dalloc(g, (void **)&g->ids, B * 4, err)) ||
        (rc = dalloc(g, (void **)&g->pos, (size_t)max_seqs * 4, err)) ||
        (rc = dalloc(g, (void **)&g->logits, B * d->vocab * 4, err)) ||
        (rc = dalloc(g, (void **)&g->slot_logits, (size_t)max_seqs * d->vocab * 4, err)) ||
        (rc = dalloc(g, (void **)&g->d_pen, (size_t)max_seqs * ENG_RECENT_TOKENS * 4, err)) ||
        (rc = dalloc(g, (void **)&g->d_tok, (size_t)max_seqs * 4, err)) ||
        (rc = dalloc(g, (void **)&g->d_rng, (size_t)max_seqs * 32, err)) ||
        (rc = dalloc(g, (void **)&g->d_sp, (size_t)max_seqs * sizeof(kern_sample_params), err)))
        goto fail;
    if (d->n_mla) {
        const kern_mla_shape msh = {d->mla_heads, d->dc, d->dr, d->dn, d->dv};
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
            if ((rc = dalloc(g, (void **)&g->mla_table[i], (size_t)max_seqs * sizeof(float *), err)) ||
                (rc = kern_cuda_memset(g->mla_table[i], 0, (size_t)max_seqs * sizeof(float *),
                                       g->stream, err)))
                goto fail;
        }
    }
    {
        /* cuBLAS for products of more than 8 rows: scratch for the widest input */
        int width = cfg->intermediate_size;
        if (cfg->num_experts > 0) {
            if (cfg->moe_intermediate_size > width) width = cfg->moe_intermediate_size;
            if (cfg->moe_intermediate_size * cfg->num_shared_experts > width)
                width = cfg->moe_intermediate_size * cfg->num_shared_experts;
        }
        size_t cols = (size_t)d->hidden;
        if ((size_t)width > cols) cols = (size_t)width;
        if (d->n_mla && (size_t)d->mla_heads * d->dv > cols) cols = (size_t)d->mla_heads * d->dv;
        if ((size_t)d->kda_v > cols) cols = (size_t)d->kda_v;
        if ((rc = kern_cuda_gemm_ctx_create(B * cols, &g->gemm, err)) != KDS_OK) goto fail;
    }
    if (d->n_kda) {
        kern_kda_shape sh = {d->H, d->HV, d->K, d->V, 1.0f};
        int chunks = (max_batch + 63) / 64;
        if (chunks > 64) chunks = 64;
        g->ws_bytes = kern_cuda_kda_prefill_workspace_bytes(&sh, chunks);
        if ((rc = dalloc(g, &g->ws, g->ws_bytes, err)) != KDS_OK) goto fail;
    }
    /* host staging */
    const size_t stage_floats = (size_t)d->n_kda * ((size_t)d->HV * d->K * d->V + (size_t)taps * C);
    if ((rc = kern_cuda_host_alloc((void **)&g->h_stage, stage_floats * sizeof(float), err)) ||
        (rc = kern_cuda_host_alloc((void **)&g->h_logits, (size_t)max_seqs * d->vocab * sizeof(float),
                                   err)) ||
        (rc = kern_cuda_host_alloc((void **)&g->h_slots, (size_t)max_seqs * sizeof(int32_t), err)) ||
        (rc = kern_cuda_host_alloc((void **)&g->h_ids, B * sizeof(int32_t), err)) ||
        (rc = kern_cuda_host_alloc((void **)&g->h_pos, (size_t)max_seqs * sizeof(int32_t), err)) ||
        (rc = kern_cuda_host_alloc((void **)&g->h_samp,
                                   (size_t)max_seqs * (ENG_RECENT_TOKENS * 4 + 4 + 32 +
                                                       sizeof(kern_sample_params)),
                                   err)))
        goto fail;
    /* everything the set-up queued (any library initialisation on the
     * default stream too): a device-wide sync */
    if ((rc = kern_cuda_sync(NULL, err))) goto fail;
    *out = g;
    return KDS_OK;
fail:
    eng__cuda_free(g);
    return rc;
}

/* ---- generated block-format weights (cuda-gen-mxfp4) ---------------------
 * A generated model's block-format weight (w->data and w->scales NULL, dt
 * MXFP4 or Q8_0: K3's routed experts) made on the device, codes at
 * `codes_at` (kern_weight_layout's data_bytes) and scales at `scales_at`
 * (its scale_bytes), byte for byte what gen-model writes (NAME_packed and
 * NAME_scale). Queued on the backend's stream, like the uploads. */
static kds_status gen_block_weight(eng_cuda *g, const eng_weight *w, void *codes_at,
                                   void *scales_at, kds_err *err) {
    if (!scales_at)
        return kds_err_set(err, KDS_INTERNAL,
                           "device 'cuda': a generated %s weight [%d, %d] was given no place for "
                           "its scales", kern_dtype_name(w->dt), w->rows, w->cols);
    return kern_cuda_gen_quant(codes_at, scales_at, w->dt, w->rows, w->cols, w->gen_key, w->gen_sd,
                               g->stream, err);
}
/* ------------------------------------------------------------------------ */

/* A matrix onto the device at `at`: copied as stored, or made there for a
 * generated model (w->data NULL: kern_cuda_gen_normal, the values gen-model
 * writes). */
static kds_status put_w(eng_cuda *g, const eng_weight *w, void *at, void *scales_at,
                        kds_err *err) {
    const kern_layout l = kern_weight_layout(w->dt, w->rows, w->cols);
    if (!w->data) {
        if (kern_dtype_is_block(w->dt)) /* codes at `at`, scales at `scales_at` */
            return gen_block_weight(g, w, at, scales_at, err);
        return kern_cuda_gen_normal(at, w->dt, (size_t)w->rows * w->cols, w->gen_key, w->gen_sd,
                                    g->stream, err);
    }
    kds_status rc = kern_cuda_memcpy_h2d(at, w->data, l.data_bytes, g->stream, err);
    if (rc == KDS_OK && l.scale_bytes)
        rc = kern_cuda_memcpy_h2d(scales_at, w->scales, l.scale_bytes, g->stream, err);
    return rc;
}

/* Bytes rounded up to 16: block-format codes are read 16 bytes at a time. */
static size_t align16(size_t n) { return (n + 15) & ~(size_t)15; }

/* The routed experts of one MoE layer, [E][w1 | w3 | w2] in one buffer:
 * few allocations for the 48B's 20,736 expert matrices, and one base +
 * stride for the grouped products. */
static kds_status load_bank(eng_cuda *g, const eng_ffn_weights *f, kds_err *err) {
    const int E = g->m->cfg.num_experts;
    const kern_dtype dt = f->w1[0].dt;
    for (int e = 0; e < E; e++)
        if (f->w1[e].dt != dt || f->w3[e].dt != dt || f->w2[e].dt != dt)
            return kds_err_set(err, KDS_UNSUPPORTED,
                               "device 'cuda': the experts of MoE layer %d are stored in "
                               "different formats", f->bank);
    const kern_layout l1 = kern_weight_layout(dt, f->w1[0].rows, f->w1[0].cols);
    const kern_layout l3 = kern_weight_layout(dt, f->w3[0].rows, f->w3[0].cols);
    const kern_layout l2 = kern_weight_layout(dt, f->w2[0].rows, f->w2[0].cols);
    const bool block = kern_dtype_is_block(dt);
    /* element formats keep their packed layout of before (bit-identical
     * banks); block codes start on 16 bytes */
    const size_t b1 = block ? align16(l1.data_bytes) : l1.data_bytes;
    const size_t b3 = block ? align16(l3.data_bytes) : l3.data_bytes;
    const size_t b2 = block ? align16(l2.data_bytes) : l2.data_bytes;
    const size_t s1 = l1.scale_bytes, s3 = l3.scale_bytes, s2 = l2.scale_bytes;
    void *arena, *sarena = NULL;
    kds_status rc = dalloc(g, &arena, (size_t)E * (b1 + b3 + b2), err);
    if (rc == KDS_OK && block) rc = dalloc(g, &sarena, (size_t)E * (s1 + s3 + s2), err);
    if (rc != KDS_OK) return rc;
    g->banks[f->bank] = (dbank){arena, b1 + b3 + b2, b1, b1 + b3,
                                sarena, s1 + s3 + s2, s1, s1 + s3};
    for (int e = 0; e < E && rc == KDS_OK; e++) {
        char *at = (char *)arena + (size_t)e * (b1 + b3 + b2);
        char *sat = sarena ? (char *)sarena + (size_t)e * (s1 + s3 + s2) : NULL;
        g->dev_w[f->w1[e].id] = at;
        g->dev_w[f->w3[e].id] = at + b1;
        g->dev_w[f->w2[e].id] = at + b1 + b3;
        if ((rc = put_w(g, &f->w1[e], at, sat, err)) == KDS_OK &&
            (rc = put_w(g, &f->w3[e], at + b1, sat ? sat + s1 : NULL, err)) == KDS_OK)
            rc = put_w(g, &f->w2[e], at + b1 + b3, sat ? sat + s1 + s3 : NULL, err);
    }
    return rc;
}

/* Every weight of the model's weight table and its small-vector arena. */
static kds_status cuda_load(eng_backend *b, kds_err *err) {
    eng_cuda *g = cuda_of(b);
    const eng_model *m = g->m;
    if (g->loaded) return KDS_OK;
    g->dev_w = calloc((size_t)m->n_weights + 1, sizeof *g->dev_w);
    g->banks = calloc((size_t)m->n_moe + 1, sizeof *g->banks);
    if (!g->dev_w || !g->banks) return kds_err_set(err, KDS_NOMEM, "out of memory creating a CUDA context");
    kds_status rc = KDS_OK;
    for (int i = 0; i < m->n_moe && rc == KDS_OK; i++) rc = load_bank(g, m->banks[i], err);
    for (int id = 1; id < m->n_weights && rc == KDS_OK; id++) {
        if (g->dev_w[id]) continue; /* an expert */
        const eng_weight *w = m->weights[id];
        void *p;
        if ((rc = dalloc(g, &p, kern_weight_layout(w->dt, w->rows, w->cols).data_bytes, err)) == KDS_OK &&
            (rc = put_w(g, w, p, NULL, err)) == KDS_OK)
            g->dev_w[id] = p;
    }
    if (rc == KDS_OK && (rc = dalloc(g, (void **)&g->dev_small, m->small_f32_used * sizeof(float), err)) == KDS_OK)
        rc = kern_cuda_memcpy_h2d(g->dev_small, m->small_f32, m->small_f32_used * sizeof(float),
                                  g->stream, err);
    /* the uploads and the generated matrices are queued: wait for them */
    if (rc == KDS_OK) rc = kern_cuda_sync(NULL, err);
    if (rc == KDS_OK) g->loaded = 1;
    return rc;
}

void eng__cuda_free(eng_cuda *g) {
    if (!g) return;
    /* Resident sequences outlive the backend: hand their state back. A
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
    free(g->rows_seqs);
    kern_cuda_host_free(g->h_slots);
    kern_cuda_host_free(g->h_pos);
    kern_cuda_host_free(g->h_samp);
    kern_cuda_host_free(g->h_ids);
    kern_cuda_host_free(g->h_stage);
    eng_pool_free(g->stage_pool);
    kern_cuda_host_free(g->h_logits);
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
    free(g->dev_w);
    free(g->banks);
    free(g->state);
    free(g->tail);
    free(g);
}

/* Threads for the staging copies: a few saturate a host's memory bus. */
enum { STAGE_THREADS_MAX = 8 };

static kds_status cuda_create(const eng_model *m, const eng_ctx_params *p, eng_backend **out,
                              kds_err *err) {
    eng_cuda *g = NULL;
    kds_status rc = eng__cuda_create(m, p->max_batch, p->max_seqs, p->bf16_act, &g, err);
    const int nt = p->n_threads < STAGE_THREADS_MAX ? p->n_threads : STAGE_THREADS_MAX;
    if (rc == KDS_OK && nt > 1) rc = eng_pool_create(nt, &g->stage_pool, err);
    if (rc != KDS_OK && g) {
        eng__cuda_free(g);
        g = NULL;
    }
    *out = g ? &g->base : NULL;
    return rc;
}

static void cuda_free(eng_backend *b) { eng__cuda_free(cuda_of(b)); }

/* Not cleared: no op reads an activation it has not written (the CPU
 * emulation fills new device memory with NaN bytes, so a read of unwritten
 * memory shows in its tests). */
static void *cuda_alloc(eng_backend *b, size_t bytes) {
    void *p = NULL;
    kds_err ignored;
    return dalloc(cuda_of(b), &p, bytes, &ignored) == KDS_OK ? p : NULL;
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

/*
 * dst <- src (n bytes, host memory), split over the staging pool. One
 * thread copies a few GB/s: on the H200's host the 42.8 MiB state of a
 * 48B session took 12 ms to stage where its DMA takes 1 ms
 * (docs/benchmarks.md, "Restore onto the GPU").
 */
typedef struct {
    char *dst;
    const char *src;
    size_t n, piece;
} stage_copy;

static void stage_copy_task(void *arg, int task, int thread) {
    (void)thread;
    const stage_copy *c = arg;
    const size_t o = (size_t)task * c->piece;
    if (o < c->n) memcpy(c->dst + o, c->src + o, c->n - o < c->piece ? c->n - o : c->piece);
}

/* Pieces of at least this many bytes (so the small states of the test
 * models take this path too, in a few pieces). */
enum { STAGE_PIECE_MIN = 4096 };

static void stage_memcpy(eng_cuda *g, void *dst, const void *src, size_t n) {
    const int nt = g->stage_pool ? eng_pool_size(g->stage_pool) : 1;
    if (nt <= 1 || n < 2 * STAGE_PIECE_MIN) {
        memcpy(dst, src, n);
        return;
    }
    size_t piece = ((n + (size_t)nt - 1) / (size_t)nt + 63) & ~(size_t)63;
    if (piece < STAGE_PIECE_MIN) piece = STAGE_PIECE_MIN;
    stage_copy c = {dst, src, n, piece};
    eng_pool_run(g->stage_pool, stage_copy_task, &c, (int)((n + piece - 1) / piece));
}

kds_status eng__cuda_state_upload(eng_cuda *g, int slot, const eng_seq *s, kds_err *err) {
    kds_status rc = check_slot(g, slot, s, err);
    if (rc != KDS_OK) return rc;
    const eng_dims *d = &g->d;
    const size_t sn = (size_t)d->HV * d->K * d->V, tn = (size_t)(d->W - 1) * d->conv_ch;
    /* Layer by layer: stage one layer's state (a host copy on the staging
     * pool's threads), then queue its DMA; the copy engine moves layer l
     * while the CPU stages l + 1, so an upload costs about one pass over
     * the bytes, not two. The staging buffer holds the whole state, so no
     * region is reused before the final sync. */
    float *st = g->h_stage, *tl = g->h_stage + (size_t)d->n_kda * sn;
    for (int l = 0; l < d->n_kda && rc == KDS_OK; l++) {
        stage_memcpy(g, st + (size_t)l * sn, s->kda_state + (size_t)l * sn, sn * sizeof(float));
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
    stage_memcpy(g, s->kda_state, g->h_stage, (size_t)d->n_kda * sn * sizeof(float));
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
 * brought up to date only when read, and uploaded again only after they
 * were written.                                                           */

static kds_status fetch_logits(eng_cuda *g, eng_seq *s, kds_err *err) {
    if (!s->logits_on_gpu) return KDS_OK;
    kds_status rc = kern_cuda_memcpy_d2h(s->logits, g->slot_logits + (size_t)s->gpu_slot * g->d.vocab,
                                         (size_t)g->d.vocab * sizeof(float), g->stream, err);
    if (rc == KDS_OK) rc = kern_cuda_sync(g->stream, err);
    if (rc == KDS_OK) s->logits_on_gpu = 0;
    return rc;
}

static kds_status cuda_fetch(eng_backend *b, eng_seq *s, bool logits_only, kds_err *err) {
    eng_cuda *g = cuda_of(b);
    kds_status rc = fetch_logits(g, s, err);
    if (rc != KDS_OK || logits_only || !s->gpu_newer) return rc;
    rc = eng__cuda_state_download(g, s->gpu_slot, s, err);
    /* MLA caches are append-only: only the rows made on the device */
    if (rc == KDS_OK) rc = mla_rows_copy(g, s->gpu_slot, s, s->gpu_host_rows, 0, err);
    if (rc == KDS_OK) {
        s->gpu_newer = 0;
        s->gpu_host_rows = s->pos;
    }
    return rc;
}

static void cuda_detach(eng_backend *b, eng_seq *s) {
    eng_cuda *g = cuda_of(b);
    g->owner[s->gpu_slot] = NULL;
    for (int i = 0; i < g->rows_n; i++)
        if (g->rows_seqs[i] == s) g->rows_n = 0; /* its row may be reused */
    s->gpu = NULL;
    s->gpu_slot = -1;
    s->gpu_newer = s->host_newer = s->logits_on_gpu = 0;
}

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

/* Give `s` a slot for a pass at g->clock: its own, else a free one, else
 * the least recently used one that is not part of this pass (whose state
 * goes back to its host buffers first). */
static kds_status make_resident(eng_cuda *g, eng_seq *s, int *slot, kds_err *err) {
    kds_status rc;
    if (s->gpu == &g->base) {
        if (s->host_newer && (rc = upload_seq(g, s->gpu_slot, s, err)) != KDS_OK) return rc;
        g->last_use[s->gpu_slot] = g->clock;
        *slot = s->gpu_slot;
        return KDS_OK;
    }
    if (s->gpu) { /* resident on another backend of the same model */
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
    s->gpu = &g->base;
    s->gpu_slot = pick;
    s->gpu_newer = 0;
    *slot = pick;
    return KDS_OK;
}

static kds_status cuda_attach(eng_backend *b, eng_seq *s, kds_err *err) {
    eng_cuda *g = cuda_of(b);
    if (s->model != g->m)
        return kds_err_set(err, KDS_INVALID_ARG, "sequence and CUDA context belong to different models");
    int slot;
    g->clock++;
    return make_resident(g, s, &slot, err);
}

kds_status eng__cuda_attach(eng_cuda *g, eng_seq *s, kds_err *err) { return cuda_attach(&g->base, s, err); }

/* ------------------------------------------------------------------------ */
/* The ops                                                                   */

/* A decode pass (one token per sequence, also of one sequence) reads its
 * rows' slots and positions on the device. */
static int pass_multi(const eng_pass *p) { return p->n_seqs > 1 || !p->chunked; }

static kds_status norm_rows(eng_cuda *g, const float *x, const float *w, int rows, int n, float eps,
                            float *y, kds_err *err) {
    kern_cuda_norm_args a = {.rows = rows, .n = n, .eps = eps, .x = x, .z = NULL,
                             .z_dtype = KERN_F32, .w = w, .w_dtype = KERN_F32, .y = y,
                             .y_dtype = KERN_F32};
    return kern_cuda_rmsnorm(&a, g->stream, err);
}

/* y [T, ldy] (+)= x [T, cols] W^T */
static kds_status product(eng_cuda *g, const eng_matmul *j, kds_err *err) {
    const eng_weight *w = j->w;
    kern_cuda_matmul_args a = {.W = dev_weight(g, w), .w_dtype = w->dt, .rows = w->rows,
                               .cols = w->cols, .x = j->x, .ldx = w->cols, .T = j->T, .y = j->y,
                               .ldy = j->ldy, .accumulate = j->accumulate, .gemm = g->gemm,
                               .mode = g->mode};
    return kern_cuda_matmul(&a, g->stream, err);
}

static void cuda_embed(eng_backend *b, const eng_pass *p, const eng_weight *table, float *x) {
    eng_cuda *g = cuda_of(b);
    if (!live(g)) return;
    note(g, kern_cuda_embed(dev_weight(g, table), table->dt, g->d.vocab, g->d.hidden, g->ids, p->T,
                            x, g->stream, &b->err));
}

static void cuda_rmsnorm(eng_backend *b, const float *x, const float *w, int rows, int n, float eps,
                         float *y) {
    eng_cuda *g = cuda_of(b);
    if (live(g)) note(g, norm_rows(g, x, dev_vector(g, w), rows, n, eps, y, &b->err));
}

static void cuda_matmul(eng_backend *b, const eng_matmul *jobs, int n_jobs) {
    eng_cuda *g = cuda_of(b);
    for (int i = 0; i < n_jobs && live(g); i++) note(g, product(g, &jobs[i], &b->err));
}

/* a = act(a, x): SwiGLU, or SiTU with the model's two soft caps (K3) */
static kds_status glu_rows(eng_cuda *g, float *a, const float *x, size_t n, kds_err *err) {
    const eng_config *cfg = &g->m->cfg;
    if (cfg->hidden_act == ENG_ACT_SITU)
        return kern_cuda_situ(a, x, n, cfg->situ_beta, cfg->situ_linear_beta, g->stream, err);
    return kern_cuda_swiglu(a, x, n, g->stream, err);
}

static void cuda_glu(eng_backend *b, float *a, const float *x, size_t n) {
    eng_cuda *g = cuda_of(b);
    if (live(g)) note(g, glu_rows(g, a, x, n, &b->err));
}

/* MLA's output gate (K3): x *= sigmoid(g) */
static void cuda_sigmoid_mul(eng_backend *b, float *x, const float *gt, size_t n) {
    eng_cuda *g = cuda_of(b);
    if (live(g)) note(g, kern_cuda_sigmoid_mul(x, gt, n, g->stream, &b->err));
}

/* Block Attention Residuals' depth mix, the eps the CPU's uses */
static void cuda_attn_res(eng_backend *b, const eng_attn_res_args *a) {
    eng_cuda *g = cuda_of(b);
    if (!live(g)) return;
    const kern_cuda_attn_res_args ra = {.T = a->T, .D = g->d.hidden, .blocks = a->blocks,
                                        .block_stride = a->block_stride, .n_blocks = a->n_blocks,
                                        .partial = a->partial, .u = dev_vector(g, a->u),
                                        .eps = g->m->cfg.rms_norm_eps, .out = a->out};
    note(g, kern_cuda_attn_res_mix(&ra, g->stream, &b->err));
}

static void cuda_add(eng_backend *b, float *y, const float *x, size_t n) {
    eng_cuda *g = cuda_of(b);
    if (live(g)) note(g, kern_cuda_add(y, x, n, g->stream, &b->err));
}

/* The KDA mixer after its projections: one sequence (T tokens in the
 * pass's slot) or a decode pass (row t in slot slots[t]). */
static kds_status kda_mixer(eng_cuda *g, const eng_pass *p, const eng_kda_args *a, kds_err *err) {
    kds_status rc;
    const eng_dims *d = &g->d;
    const int C = d->conv_ch, taps = d->W - 1, T = p->T, kl = a->layer;
    const int multi = pass_multi(p);
    float *tail0 = g->tail[kl] + (size_t)g->pass_slot * taps * C;
    if (!multi && taps > 0 &&
        (rc = kern_cuda_memcpy_d2d(a->ext, tail0, (size_t)taps * C * sizeof(float), g->stream, err)))
        return rc;
    kern_cuda_conv_args ca = {.T = T, .W = d->W, .n_qk = d->kda_qk, .n_v = d->kda_v, .ext = a->ext,
                              .w = dev_vector(g, a->w->q_conv), .tails = multi ? g->tail[kl] : NULL,
                              .slots = multi ? g->slots : NULL, .q = a->q, .k = a->k, .v = a->v};
    if ((rc = kern_cuda_short_conv(&ca, g->stream, err))) return rc;
    if (!multi && taps > 0 &&
        (rc = kern_cuda_memcpy_d2d(tail0, a->ext + (size_t)T * C, (size_t)taps * C * sizeof(float),
                                   g->stream, err)))
        return rc;
    const kern_kda_shape sh = {d->H, d->HV, d->K, d->V, 1.0f / sqrtf((float)d->K)};
    if (!multi) {
        kern_cuda_kda_prefill_args pa = {.shape = sh, .T = T, .in_dtype = KERN_F32, .raw = true,
                                         .q = a->q, .k = a->k, .v = a->v, .g = a->g,
                                         .beta = a->beta, .A_log = dev_vector(g, a->w->A_log),
                                         .dt_bias = dev_vector(g, a->w->dt_bias),
                                         .lower_bound = a->lower_bound,
                                         .state = g->state[kl] + (size_t)g->pass_slot * d->HV * d->K * d->V,
                                         .o = a->o, .workspace = g->ws, .workspace_bytes = g->ws_bytes,
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
        kern_cuda_kda_decode_args da = {.shape = sh, .N = T, .in_dtype = KERN_F32, .q = a->q,
                                        .k = a->k, .v = a->v, .g_raw = a->g, .beta_raw = a->beta,
                                        .A_log = dev_vector(g, a->w->A_log),
                                        .dt_bias = dev_vector(g, a->w->dt_bias),
                                        .lower_bound = a->lower_bound, .state_pool = g->state[kl],
                                        .pool_slots = g->max_seqs, .slots = g->slots, .o = a->o};
        if ((rc = kern_cuda_kda_decode(&da, g->stream, err))) return rc;
    }
    kern_cuda_norm_args na = {.rows = T * d->HV, .n = d->V, .eps = a->eps, .x = a->o, .z = a->gz,
                              .z_dtype = KERN_F32, .w = dev_vector(g, a->w->o_norm),
                              .w_dtype = KERN_F32, .y = a->o, .y_dtype = KERN_F32};
    return kern_cuda_rmsnorm(&na, g->stream, err);
}

static void cuda_kda(eng_backend *b, const eng_pass *p, const eng_kda_args *a) {
    eng_cuda *g = cuda_of(b);
    if (live(g)) note(g, kda_mixer(g, p, a, &b->err));
}

/* MLA (spec §5, absorbed, no RoPE): a decode pass maps row r to slot
 * slots[r] at position pos[r] (the tables on the device); one sequence's
 * T tokens go to the pass's slot from its position. */
static kds_status mla_attend(eng_cuda *g, const eng_pass *p, const eng_mla_args *a, kds_err *err) {
    const eng_dims *d = &g->d;
    kern_cuda_mla_rows map = {.rows = p->T};
    if (pass_multi(p)) {
        map.caches = g->mla_table[a->layer];
        map.n_caches = g->max_seqs;
        map.slots = g->slots;
        map.pos = g->pos;
    } else {
        map.cache = g->mla_cache[a->layer][g->pass_slot];
        map.pos0 = g->pass_pos0;
    }
    kern_cuda_mla_append_args aa = {.map = map, .dc = d->dc, .dr = d->dr, .eps = a->eps,
                                    .kva = a->kva, .norm_w = dev_vector(g, a->w->kv_a_layernorm),
                                    .norm_w_dtype = KERN_F32};
    kds_status rc = kern_cuda_mla_cache_append(&aa, g->stream, err);
    if (rc != KDS_OK) return rc;
    const eng_weight *kvb = &a->w->kv_b_proj;
    kern_cuda_mla_args ma = {.shape = {d->mla_heads, d->dc, d->dr, d->dn, d->dv}, .map = map,
                             .q = a->q, .kv_b = dev_weight(g, kvb), .kv_b_dtype = kvb->dt,
                             .o = a->o, .max_ctx = g->pass_max_ctx, .n_split = 0,
                             .workspace = g->mla_ws, .workspace_bytes = g->mla_ws_bytes};
    return kern_cuda_mla_attention(&ma, g->stream, err);
}

static void cuda_mla(eng_backend *b, const eng_pass *p, const eng_mla_args *a) {
    eng_cuda *g = cuda_of(b);
    if (live(g)) note(g, mla_attend(g, p, a, &b->err));
}

static void cuda_moe_route(eng_backend *b, const eng_moe_args *a) {
    eng_cuda *g = cuda_of(b);
    if (!live(g)) return;
    const eng_config *cfg = &g->m->cfg;
    const int k = cfg->num_experts_per_token;
    kern_cuda_moe_route_args ra = {
        .p = {.n_experts = cfg->num_experts,
              .top_k = k,
              .n_group = cfg->use_grouped_topk && cfg->num_expert_group > 1 ? cfg->num_expert_group : 1,
              .topk_group = cfg->topk_group,
              .renormalize = cfg->moe_renormalize,
              .routed_scaling_factor = cfg->routed_scaling_factor},
        .T = a->T, .logits = a->router, .apply_sigmoid = true,
        .bias = dev_vector(g, a->f->router_bias), .sel = a->sel, .w = a->selw,
        .exp_off = a->exp_off, .row_of = a->row_of, .tok_of = a->tok_of};
    note(g, kern_cuda_moe_route(&ra, g->stream, &b->err));
    if (live(g))
        note(g, kern_cuda_moe_gather(a->xs, (size_t)a->X * sizeof(float), a->tok_of, a->T * k,
                                     a->xg, g->stream, &b->err));
}

/* The shared expert (its own products), then the routed experts, grouped
 * by kern_cuda_moe_experts reading the offsets on the device (no host
 * sync): gate and up fused into act(x W1^T, x W3^T) (SwiGLU or SiTU), then W2. */
static kds_status moe_experts(eng_cuda *g, const eng_moe_args *a, kds_err *err) {
    kds_status rc;
    const eng_config *cfg = &g->m->cfg;
    const eng_ffn_weights *f = a->f;
    const int E = cfg->num_experts, k = cfg->num_experts_per_token, hid = g->d.hidden, T = a->T;
    const int inner = cfg->moe_intermediate_size, sh_inner = f->sh_gate.rows;
    float *sh_a = a->act_a + (size_t)T * k * inner, *sh_b = a->act_b + (size_t)T * k * inner;
    if (sh_inner > 0) {
        const eng_matmul gate = {&f->sh_gate, a->x, T, sh_a, sh_inner, false, false};
        const eng_matmul up = {&f->sh_up, a->x, T, sh_b, sh_inner, false, false};
        const eng_matmul down = {&f->sh_down, sh_a, T, a->shared_out, hid, false, false};
        if ((rc = product(g, &gate, err)) || (rc = product(g, &up, err)) ||
            (rc = glu_rows(g, sh_a, sh_b, (size_t)T * sh_inner, err)) ||
            (rc = product(g, &down, err)))
            return rc;
    }
    const dbank *bk = &g->banks[f->bank];
    const bool situ = cfg->hidden_act == ENG_ACT_SITU;
    const char *sb = bk->sbase; /* MXFP4 scales, or NULL */
    kern_cuda_moe_experts_args ea = {.E = E, .rows = inner, .cols = a->X, .w_dtype = f->w1[0].dt,
                                     .W_base = bk->base, .W3_base = (const char *)bk->base + bk->w3_off,
                                     .w_stride = bk->stride, .exp_off = a->exp_off,
                                     .n_rows = T * k, .x = a->xg, .ldx = a->X, .y = a->act_a,
                                     .ldy = inner, .mode = g->mode,
                                     .S_base = sb, .S3_base = sb ? sb + bk->s3_off : NULL,
                                     .s_stride = bk->s_stride,
                                     .act = situ ? KERN_CUDA_MOE_SITU : KERN_CUDA_MOE_SWIGLU,
                                     .situ_beta = situ ? cfg->situ_beta : 0.0f,
                                     .situ_beta_l = situ ? cfg->situ_linear_beta : 0.0f};
    if ((rc = kern_cuda_moe_experts(&ea, g->stream, err))) return rc;
    kern_cuda_moe_experts_args da = {.E = E, .rows = a->X, .cols = inner, .w_dtype = f->w2[0].dt,
                                     .W_base = (const char *)bk->base + bk->w2_off,
                                     .w_stride = bk->stride, .exp_off = a->exp_off,
                                     .n_rows = T * k, .x = a->act_a, .ldx = inner, .y = a->yg,
                                     .ldy = a->X, .mode = g->mode,
                                     .S_base = sb ? sb + bk->s2_off : NULL,
                                     .s_stride = bk->s_stride};
    return kern_cuda_moe_experts(&da, g->stream, err);
}

static void cuda_moe_experts(eng_backend *b, const eng_moe_args *a) {
    eng_cuda *g = cuda_of(b);
    if (live(g)) note(g, moe_experts(g, a, &b->err));
}

static void cuda_moe_combine(eng_backend *b, const eng_moe_args *a) {
    eng_cuda *g = cuda_of(b);
    if (!live(g)) return;
    note(g, kern_cuda_moe_combine(a->yg, a->row_of, a->selw, a->T, g->m->cfg.num_experts_per_token,
                                  a->X, a->add_shared ? a->shared_out : NULL, a->out, g->stream,
                                  &b->err));
}

static float *cuda_logits_rows(eng_backend *b, const eng_pass *p) {
    (void)p;
    return cuda_of(b)->logits;
}

/* ------------------------------------------------------------------------ */
/* Passes                                                                    */

/* The pass's ids, slots and positions from their pinned buffers to the
 * device (read when the pass runs, so a graph replays with this step's). */
static void pass_inputs(eng_cuda *g, int T, int n_rows_seqs) {
    kds_err *e = &g->base.err;
    note(g, kern_cuda_memcpy_h2d(g->ids, g->h_ids, (size_t)T * sizeof(int32_t), g->stream, e));
    /* the decode kernel reads slots on the device, also for one sequence */
    if (live(g))
        note(g, kern_cuda_memcpy_h2d(g->slots, g->h_slots, (size_t)n_rows_seqs * sizeof(int32_t),
                                     g->stream, e));
    if (live(g) && g->d.n_mla)
        note(g, kern_cuda_memcpy_h2d(g->pos, g->h_pos, (size_t)n_rows_seqs * sizeof(int32_t),
                                     g->stream, e));
}

/* After the layers: the logits rows to `dst` on the host, or (lazy: a
 * decode leaving them on the device) each row to its slot's row of
 * slot_logits. */
static void logits_out(eng_cuda *g, const eng_pass *p, int lazy, float *dst) {
    const int n = p->T - p->first;
    if (n <= 0 || !live(g)) return;
    const size_t row = (size_t)g->d.vocab * sizeof(float);
    if (lazy)
        note(g, kern_cuda_rows_scatter(g->logits, row, g->slots, n, g->slot_logits, g->stream,
                                       &g->base.err));
    else
        note(g, kern_cuda_memcpy_d2h(dst, g->logits, (size_t)n * row, g->stream, &g->base.err));
}

/* One run of the queued part of a pass (no sync, so it can be captured). */
static void pass_body(eng_cuda *g, const eng_pass *p, eng_pass_fn fn, void *arg, int lazy,
                      float *dst) {
    pass_inputs(g, p->T, pass_multi(p) ? p->T : 1);
    if (live(g)) fn(arg, p);
    logits_out(g, p, lazy, dst);
}

int eng__cuda_graph_count(const eng_cuda *g) {
    if (g->graphs_off) return -1;
    int n = 0;
    for (size_t i = 0; i < (size_t)2 * g->max_seqs * ENG_CUDA_CTX_BUCKETS; i++) n += g->graphs[i] != NULL;
    return n;
}

/* ceil(log2(n)) for n >= 1: the context bucket of a decode graph */
static int ctx_bucket(int n) {
    int b = 0;
    while (b < 31 && (1 << b) < n) b++;
    return b;
}

/*
 * A decode pass of T sequences (one token each) through a CUDA graph: one
 * per (T, context bucket, lazy), captured the first time and replayed after
 * (each replay reads this step's ids, slots and positions from the pinned
 * buffers). The MLA split choice depends on the longest context, so MLA
 * models get a graph per power of two of it (captured for the bucket's
 * top; shorter rows are still attended exactly). If capture is not
 * available or fails, graphs are switched off for the backend and passes
 * run with plain launches.
 */
static void decode_pass(eng_cuda *g, const eng_pass *p, eng_pass_fn fn, void *arg, int max_ctx,
                        int lazy, float *dst) {
    const int T = p->T, b = g->d.n_mla ? ctx_bucket(max_ctx) : 0;
    void **slot = &g->graphs[((size_t)lazy * g->max_seqs + (size_t)(T - 1)) * ENG_CUDA_CTX_BUCKETS + b];
    if (!g->graphs_off && !*slot) {
        kds_err cap_err;
        kds_err_clear(&cap_err);
        if (kern_cuda_graph_begin(g->stream, &cap_err) == KDS_OK) {
            g->pass_max_ctx = g->d.n_mla ? 1 << b : 0;
            pass_body(g, p, fn, arg, lazy, dst);
            void *exec = NULL;
            kds_status end = kern_cuda_graph_end(g->stream, &exec, &cap_err);
            if (live(g) && end == KDS_OK)
                *slot = exec;
            else
                kern_cuda_graph_free(exec);
        }
        if (!*slot) {
            /* an op refused during capture runs (and fails, if it really
             * fails) again below, without graphs */
            g->graphs_off = 1;
            g->base.rc = KDS_OK;
        }
    }
    if (*slot) {
        note(g, kern_cuda_graph_launch(*slot, g->stream, &g->base.err));
    } else {
        g->pass_max_ctx = max_ctx;
        pass_body(g, p, fn, arg, lazy, dst);
    }
}

static kds_status cuda_run(eng_backend *b, const eng_pass *p, eng_pass_fn fn, void *arg,
                           kds_err *err) {
    eng_cuda *g = cuda_of(b);
    const int multi = pass_multi(p), T = p->T, vocab = g->d.vocab;
    if (T < 1 || T > (multi ? g->max_seqs : g->max_batch))
        return kds_err_set(err, KDS_INVALID_ARG, "CUDA forward of %d rows (limit %d)", T,
                           multi ? g->max_seqs : g->max_batch);
    if (!g->loaded) return kds_err_set(err, KDS_INTERNAL, "CUDA backend: the weights are not loaded");
    /* every sequence of the pass gets a slot (uploading its state only if
     * it was not resident or its host copy was written since) */
    kds_status rc = KDS_OK;
    g->clock++;
    for (int i = 0; i < p->n_seqs && rc == KDS_OK; i++) rc = make_resident(g, p->seqs[i], &g->h_slots[i], err);
    /* room for this pass's latent rows, and the rows' positions */
    int max_ctx = 0;
    for (int i = 0; i < p->n_seqs && rc == KDS_OK; i++) {
        const int64_t end = p->seqs[i]->pos + (multi ? 1 : T);
        if (end > INT32_MAX) {
            rc = kds_err_set(err, KDS_UNSUPPORTED, "device 'cuda': contexts above 2^31 tokens");
            break;
        }
        g->h_pos[i] = (int32_t)p->seqs[i]->pos;
        if (end > max_ctx) max_ctx = (int)end;
        rc = mla_reserve(g, g->h_slots[i], end, err);
    }
    if (rc != KDS_OK) return rc;
    /* the ids were checked by the caller */
    memcpy(g->h_ids, p->ids, (size_t)T * sizeof(int32_t));
    /* Logits land in a host buffer first so a failure leaves the
     * sequences untouched: the caller's (one sequence), else h_logits. A
     * decode leaves them on the device (fetched when read, or sampled
     * there) where rows can be scattered in 16-byte words. */
    const int need = p->first < T;
    const int lazy = multi && need && !p->logits && lazy_logits(g->m);
    float *dst = p->logits ? p->logits : g->h_logits;
    g->rows_n = 0; /* g->logits is this pass's now */
    g->pass_slot = g->h_slots[0];
    g->pass_pos0 = p->seqs[0]->pos;
    b->rc = KDS_OK;
    kds_err_clear(&b->err);
    if (multi) {
        decode_pass(g, p, fn, arg, max_ctx, lazy, dst);
    } else {
        g->pass_max_ctx = max_ctx;
        pass_body(g, p, fn, arg, 0, dst);
    }
    if (live(g)) note(g, kern_cuda_sync(g->stream, &b->err));
    if (!live(g)) {
        if (err) *err = b->err;
        return b->rc;
    }
    /* the device copies are now ahead of the host buffers */
    for (int i = 0; i < p->n_seqs; i++) p->seqs[i]->gpu_newer = 1;
    if (!need) return KDS_OK;
    const size_t row = (size_t)vocab * sizeof(float);
    if (multi) {
        for (int t = 0; t < T; t++) {
            if (!lazy) memcpy(p->seqs[t]->logits, dst + (size_t)t * vocab, row);
            p->seqs[t]->logits_on_gpu = lazy;
        }
        if (lazy) {
            memcpy(g->rows_seqs, p->seqs, (size_t)T * sizeof *g->rows_seqs);
            g->rows_n = T;
        }
    } else {
        memcpy(p->seqs[0]->logits, dst + (size_t)(T - 1 - p->first) * vocab, row);
    }
    return KDS_OK;
}

/* ------------------------------------------------------------------------ */
/* Sampling                                                                  */

/* Sample the n rows now in g->logits (rows of seqs, in order) on the
 * device, row i with p[i]: the repetition penalty from each sequence's
 * recent tokens, its RNG state up and back; next[i] out. One launch for
 * all rows; when the settings differ they go up as one array. g->logits is
 * scratch (the sampler rewrites penalised entries in place; the slot rows
 * keep the logits). */
static kds_status sample_rows(eng_cuda *g, eng_seq *const *seqs, int n, const eng_sampler_params *p,
                              int32_t *next, kds_err *err) {
    kds_status rc;
    const int V = g->d.vocab;
    int32_t *h_pen = (int32_t *)g->h_samp;
    uint64_t *h_rng = (uint64_t *)(g->h_samp + (size_t)g->max_seqs * ENG_RECENT_TOKENS * 4);
    int32_t *h_tok = (int32_t *)((unsigned char *)h_rng + (size_t)g->max_seqs * 32);
    kern_sample_params *h_sp = (kern_sample_params *)(h_tok + g->max_seqs);
    /* each row's penalised ids as eng_sample picks them, padded with -1
     * (ignored by the sampler) to one width */
    int any = 0;
    for (int i = 0; i < n; i++) {
        int32_t *row = h_pen + (size_t)i * ENG_RECENT_TOKENS;
        int k = eng__seq_penalty_ids(seqs[i], &p[i], row);
        for (int j = k; j < ENG_RECENT_TOKENS; j++) row[j] = -1;
        any |= k;
        memcpy(h_rng + (size_t)i * 4, seqs[i]->rng, 32);
    }
    const int n_pen = any ? ENG_RECENT_TOKENS : 0;
    if (n_pen &&
        (rc = kern_cuda_memcpy_h2d(g->d_pen, h_pen, (size_t)n * n_pen * sizeof(int32_t), g->stream, err)))
        return rc;
    if ((rc = kern_cuda_memcpy_h2d(g->d_rng, h_rng, (size_t)n * 32, g->stream, err))) return rc;
    bool same = true;
    for (int i = 0; i < n; i++) {
        h_sp[i] = (kern_sample_params){.temperature = p[i].temperature, .top_k = p[i].top_k,
                                       .top_p = p[i].top_p, .min_p = p[i].min_p,
                                       .repeat_penalty = p[i].repeat_penalty};
        same = same && memcmp(&h_sp[i], &h_sp[0], sizeof h_sp[0]) == 0;
    }
    if (!same && (rc = kern_cuda_memcpy_h2d(g->d_sp, h_sp, (size_t)n * sizeof *h_sp, g->stream, err)))
        return rc;
    kern_cuda_sample_args sa = {.N = n, .V = V, .logits = g->logits,
                                .params = h_sp[0],
                                .row_params = same ? NULL : g->d_sp,
                                .penalty_ids = n_pen ? g->d_pen : NULL, .n_penalty = n_pen,
                                .rng = g->d_rng, .tokens = g->d_tok};
    if ((rc = kern_cuda_sample(&sa, g->stream, err)) ||
        (rc = kern_cuda_memcpy_d2h(h_tok, g->d_tok, (size_t)n * sizeof(int32_t), g->stream, err)) ||
        (rc = kern_cuda_memcpy_d2h(h_rng, g->d_rng, (size_t)n * 32, g->stream, err)) ||
        (rc = kern_cuda_sync(g->stream, err)))
        return rc;
    for (int i = 0; i < n; i++) {
        next[i] = h_tok[i];
        memcpy(seqs[i]->rng, h_rng + (size_t)i * 4, 32);
    }
    return KDS_OK;
}

/* The rows a decode pass of exactly these sequences left in g->logits are
 * sampled as they are (only the tokens cross the bus); otherwise each
 * sequence's slot row is copied there first. */
static kds_status cuda_sample(eng_backend *b, eng_seq *const *seqs, int n,
                              const eng_sampler_params *p, int32_t *tokens, kds_err *err) {
    eng_cuda *g = cuda_of(b);
    const size_t row = (size_t)g->d.vocab * sizeof(float);
    const int fresh = g->rows_n == n && memcmp(g->rows_seqs, seqs, (size_t)n * sizeof *seqs) == 0;
    kds_status rc = KDS_OK;
    for (int i = 0; i < n && !fresh && rc == KDS_OK; i++) {
        if (seqs[i]->gpu != b || !seqs[i]->logits_on_gpu || !seqs[i]->has_logits)
            return kds_err_set(err, KDS_INTERNAL, "CUDA sampler: sequence %d has no logits on the device", i);
        rc = kern_cuda_memcpy_d2d(g->logits + (size_t)i * g->d.vocab,
                                  g->slot_logits + (size_t)seqs[i]->gpu_slot * g->d.vocab, row,
                                  g->stream, err);
    }
    g->rows_n = 0; /* sampling rewrites the scratch rows */
    return rc != KDS_OK ? rc : sample_rows(g, seqs, n, p, tokens, err);
}

const eng_backend_ops eng__cuda_ops = {
    .name = "cuda",
    .device = ENG_DEVICE_CUDA,
    .create = cuda_create,
    .load = cuda_load,
    .free = cuda_free,
    .supports = cuda_supports,
    .alloc = cuda_alloc,
    .run = cuda_run,
    .logits_rows = cuda_logits_rows,
    .embed = cuda_embed,
    .rmsnorm = cuda_rmsnorm,
    .matmul = cuda_matmul,
    .glu = cuda_glu,
    .sigmoid_mul = cuda_sigmoid_mul,
    .attn_res = cuda_attn_res,
    .add = cuda_add,
    .kda = cuda_kda,
    .mla = cuda_mla,
    .moe_route = cuda_moe_route,
    .moe_experts = cuda_moe_experts,
    .moe_combine = cuda_moe_combine,
    .sample = cuda_sample,
    .attach = cuda_attach,
    .fetch = cuda_fetch,
    .detach = cuda_detach,
};
