/*
 * eng_forward.c - compute contexts and the forward pass (spec §3-§7),
 * written once for every backend (eng_backend.h) and layer kind
 * (eng_plan.h).
 *
 * One function, layers(), runs T rows through every layer of the plan,
 * layer by layer over the whole batch, so each weight matrix is read once
 * per batch. The rows are either T tokens of one sequence (prefill, decode)
 * or one new token of each of T different sequences (eng_decode_batch:
 * continuous batching). Embedding, norms, projections and FFNs do not care
 * which; the ops that read per-sequence state (the KDA mixer, MLA) take the
 * pass. KDA layers take the chunked WY path when prefill is asked for and
 * the token-by-token recurrence otherwise; everything else is the same code
 * for both, so prefill and decode differ only in the KDA core and in the
 * summation order of the products.
 *
 * layers() is a list of op calls and pointer arithmetic on the context's
 * activation buffers, a pure function of the plan and the pass's shape:
 * the CUDA backend captures it into a graph and replays it, and the
 * context's creation walks it once with every op put to the backend's
 * supports() (check_plan).
 *
 * Memory: every activation buffer lives in the backend (sized at
 * eng_ctx_create for max(max_batch, max_seqs) rows); the only allocation
 * on the hot path is the MLA cache growing geometrically (eng__seq_reserve).
 */
#include <stdlib.h>
#include <string.h>

#include "eng_backend.h"
#include "eng_cuda.h"
#include "eng_pool.h"
#include "eng_seq.h"

struct eng_ctx {
    const eng_model *m;
    eng_dims d;
    eng_backend *b;
    int max_batch, max_seqs;
    int n_threads;        /* the CPU threads the context uses */
    int top_k;            /* experts per token (1 for dense models) */
    /* activations in the backend's memory, [rows, ...] */
    float *x, *xn, *mix;                 /* [B, hidden] residual, normed, FFN out */
    float *ext;                          /* [W-1+B, conv_ch] conv input incl. tail */
    float *q, *k, *v;                    /* [B, H*K], [B, H*K], [B, HV*V] */
    float *fa, *ga, *g, *beta, *gz, *o;  /* gate/beta/output-gate inputs, mixer output */
    float *mq, *kva;                     /* MLA: [B, nh*(dn+dr)], [B, dc+dr] */
    /* FFN: gate and up products (alloc_activations), [B, hidden] */
    float *fa_buf, *fb_buf, *shared_out;
    float *router, *selw;                /* [B, E], [B, top_k] */
    int32_t *sel, *exp_off, *row_of, *tok_of; /* [B, top_k], [E+1], [B, top_k], [B*top_k] */
    float *xg, *yg;                      /* [B*top_k, max(hidden, L)] gathered in / expert out */
    float *lat_in, *lat_out;             /* latent MoE: [B, L] the input's projection, the
                                          * experts' combined output */
    /* Block Attention Residuals: the slabs of the stream, [n_slabs, B, hidden]
     * (the snapshots, then the current partial; stream in layers()), and a
     * mix's output [B, hidden] */
    float *blocks, *mixed;
    size_t block_stride;                 /* B * hidden */
    /* host sampling (logits on the host, or settings the backend's sampler lacks) */
    float *cand_p;                       /* [vocab] */
    int32_t *cand_id;                    /* [vocab] */
    /* batched sampling: the settings of each row, and the rows the backend
     * samples where their logits are (eng_sample_batch), [max_seqs] each */
    eng_sampler_params *samp_p, *samp_dev_p;
    eng_seq **samp_dev_seqs;
    int *samp_dev_idx;
    int32_t *samp_dev_tok;
};

/* Prefill steps of 512 tokens: a routed expert's product gets twice the
 * tokens of 256 for each panel of its weights unpacked (wide, top-8 of 32:
 * about 128 a product), and the weights come from memory half as often.
 * Measured on an Intel Xeon, two threads, 512-token prompts (docs/
 * benchmarks.md, "Prefill steps of 512 tokens"): wide +5-8% exact, +10%
 * under --bf16, full27 +4-9%. A server keeps 256-token slices
 * (SRV_PREFILL_SLICE), which bound how long a prefill holds up the other
 * streams' decode. */
eng_ctx_params eng_ctx_default_params(void) {
    return (eng_ctx_params){.n_threads = 0, .max_batch = 512, .kda_chunk = 64, .max_seqs = 64};
}

eng_sampler_params eng_sampler_default_params(void) {
    return (eng_sampler_params){.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f,
                                .repeat_penalty = 1.0f, .repeat_last_n = 64};
}

bool eng_device_from_name(const char *name, eng_device *out) {
    if (!name || strcmp(name, "cpu") == 0) {
        *out = ENG_DEVICE_CPU;
        return true;
    }
    if (strcmp(name, "cuda") == 0) {
        *out = ENG_DEVICE_CUDA;
        return true;
    }
    return false;
}

const char *eng_device_name(eng_device d) { return d == ENG_DEVICE_CUDA ? "cuda" : "cpu"; }

/* ------------------------------------------------------------------------ */
/* The layer sequence                                                        */

/* One product y = x W^T. */
static eng_matmul mm(const eng_weight *w, const float *x, int T, float *y, int ldy) {
    return (eng_matmul){w, x, T, y, ldy, false, false};
}

/*
 * The residual stream of a pass, as the plan's input kind forms it:
 *   ENG_INPUT_RESIDUAL  p is the whole stream (c->x); every sublayer reads
 *                       norm(p) and adds its output into p;
 *   ENG_INPUT_ATTN_RES  p is the current block's partial sum, one slab of
 *                       c->blocks; the n_blocks slabs before it are the
 *                       frozen snapshots (the first is the embedding); a
 *                       sublayer reads norm(mix(snapshots, p)) and adds its
 *                       output into p; a new block starts with p empty.
 * A sublayer's last product writes its output there (eng_matmul.accumulate
 * = !fresh): adding into an empty partial is writing it.
 */
typedef struct stream {
    float *p;
    bool fresh;   /* p is empty: the next output writes it instead of adding */
    int n_blocks; /* frozen snapshots (ENG_INPUT_ATTN_RES) */
} stream;

/* The product that ends a sublayer: its output into the stream. */
static eng_matmul mm_out(stream *s, const eng_weight *w, const float *x, int T, int hidden) {
    const eng_matmul j = {w, x, T, s->p, hidden, !s->fresh, false};
    s->fresh = false;
    return j;
}

/* The input of a sublayer whose mix query is u (NULL: the plain residual),
 * for rows [first, first + n): the stream itself, or the AttnRes mix over
 * the snapshots and the partial into c->mixed. */
static const float *sublayer_input(const eng_ctx *c, eng_backend *b, const stream *s,
                                   const float *u, int first, int n) {
    const size_t hid = (size_t)c->d.hidden, off = (size_t)first * hid;
    if (!u || s->n_blocks == 0) return s->p + off; /* layer 0: the embedding alone */
    const eng_attn_res_args a = {.T = n, .blocks = c->blocks + off, .block_stride = c->block_stride,
                                 .n_blocks = s->n_blocks, .partial = s->p + off, .u = u,
                                 .out = c->mixed + off};
    b->ops->attn_res(b, &a);
    return c->mixed + off;
}

/* KDA mixer (spec §3): one dispatch computes q, k, v, the decay-gate
 * down-projection, beta and the output gate's (low-rank down, or K3's full
 * rank) from the same normed input, a second the up-projections; the op
 * does the conv, the delta rule and the gated norm; o_proj ends it. */
static void kda_mixer(const eng_ctx *c, eng_backend *b, const eng_pass *p,
                      const eng_layer_weights *L, stream *s) {
    const eng_dims *d = &c->d;
    const eng_kda_weights *w = &L->kda;
    const int T = p->T, C = d->conv_ch;
    const bool full_rank = w->g_proj.rows > 0;
    float *in = c->ext + (size_t)(d->W - 1) * C; /* the projections land after the tail rows */
    const eng_matmul proj[6] = {
        mm(&w->q_proj, c->xn, T, in, C),
        mm(&w->k_proj, c->xn, T, in + d->kda_qk, C),
        mm(&w->v_proj, c->xn, T, in + 2 * d->kda_qk, C),
        mm(&w->f_a_proj, c->xn, T, c->fa, w->f_a_proj.rows),
        mm(&w->b_proj, c->xn, T, c->beta, d->HV),
        full_rank ? mm(&w->g_proj, c->xn, T, c->gz, d->kda_v)
                  : mm(&w->g_a_proj, c->xn, T, c->ga, w->g_a_proj.rows),
    };
    b->ops->matmul(b, proj, 6);
    const eng_matmul up[2] = {
        mm(&w->f_b_proj, c->fa, T, c->g, d->HV * d->K),
        mm(&w->g_b_proj, c->ga, T, c->gz, d->kda_v),
    };
    b->ops->matmul(b, up, full_rank ? 1 : 2);
    const eng_config *cfg = &c->m->cfg;
    const eng_kda_args a = {.layer = L->slot, .w = w,
                            .lower_bound = cfg->has_gate_lower_bound ? cfg->gate_lower_bound : 0.0f,
                            .eps = cfg->rms_norm_eps, .ext = c->ext, .q = c->q, .k = c->k,
                            .v = c->v, .g = c->g, .beta = c->beta, .gz = c->gz, .o = c->o};
    b->ops->kda(b, p, &a);
    const eng_matmul out = mm_out(s, &w->o_proj, c->o, T, d->hidden);
    b->ops->matmul(b, &out, 1);
}

/* MLA mixer (spec §5, absorbed, no RoPE): the queries (through the q LoRA
 * when the config has one), the joint latent and, in K3, the output gate;
 * the op appends the latents and attends; the gate, then o_proj ends it. */
static void mla_mixer(const eng_ctx *c, eng_backend *b, const eng_pass *p,
                      const eng_layer_weights *L, stream *s) {
    const eng_dims *d = &c->d;
    const eng_mla_weights *w = &L->mla;
    const eng_config *cfg = &c->m->cfg;
    const int T = p->T, qw = d->mla_heads * (d->dn + d->dr), qr = cfg->q_lora_rank;
    const int gated = w->g_proj.rows > 0, ow = d->mla_heads * d->dv;
    const eng_matmul gate = mm(&w->g_proj, c->xn, T, c->gz, ow);
    if (qr > 0) {
        const eng_matmul down[3] = {mm(&w->q_a_proj, c->xn, T, c->fa, qr),
                                    mm(&w->kv_a_proj_with_mqa, c->xn, T, c->kva, d->mla_row), gate};
        b->ops->matmul(b, down, 2 + gated);
        b->ops->rmsnorm(b, c->fa, w->q_a_layernorm, T, qr, cfg->mla_lora_norm_eps, c->fa);
        const eng_matmul q = mm(&w->q_b_proj, c->fa, T, c->mq, qw);
        b->ops->matmul(b, &q, 1);
    } else {
        const eng_matmul qkv[3] = {mm(&w->q_proj, c->xn, T, c->mq, qw),
                                   mm(&w->kv_a_proj_with_mqa, c->xn, T, c->kva, d->mla_row), gate};
        b->ops->matmul(b, qkv, 2 + gated);
    }
    const eng_mla_args a = {.layer = L->slot, .w = w, .eps = cfg->mla_lora_norm_eps, .kva = c->kva,
                            .q = c->mq, .o = c->o};
    b->ops->mla(b, p, &a);
    if (gated) b->ops->sigmoid_mul(b, c->o, c->gz, (size_t)T * ow);
    const eng_matmul out = mm_out(s, &w->o_proj, c->o, T, d->hidden);
    b->ops->matmul(b, &out, 1);
}

/* Dense gated MLP (spec §6.1; SiTU in K3). */
static void dense_ffn(const eng_ctx *c, eng_backend *b, const eng_pass *p,
                      const eng_layer_weights *L, stream *s) {
    const eng_ffn_weights *f = &L->ffn;
    const int T = p->T, inner = f->gate_proj.rows;
    const eng_matmul gate_up[2] = {mm(&f->gate_proj, c->xn, T, c->fa_buf, inner),
                                   mm(&f->up_proj, c->xn, T, c->fb_buf, inner)};
    b->ops->matmul(b, gate_up, 2);
    b->ops->glu(b, c->fa_buf, c->fb_buf, (size_t)T * inner);
    const eng_matmul down = mm_out(s, &f->down_proj, c->fa_buf, T, c->d.hidden);
    b->ops->matmul(b, &down, 1);
}

/* MoE (spec §6.2): router, route, experts, combine, into the stream. The
 * latent MoE (K3, kimi-k3.md §4.5) routes on the full input but runs the
 * routed experts on its projection into the latent, combines there, norms
 * and projects back; the shared experts read the full input. */
static void moe_ffn(const eng_ctx *c, eng_backend *b, const eng_pass *p,
                    const eng_layer_weights *L, stream *s, bool latent) {
    const eng_ffn_weights *f = &L->ffn;
    const eng_config *cfg = &c->m->cfg;
    const int T = p->T, hid = c->d.hidden, X = latent ? cfg->latent_size : hid;
    const eng_matmul router = mm(&f->router, c->xn, T, c->router, cfg->num_experts);
    b->ops->matmul(b, &router, 1);
    if (latent) {
        const eng_matmul down = mm(&f->latent_down, c->xn, T, c->lat_in, X);
        b->ops->matmul(b, &down, 1);
    }
    const bool shared = f->sh_gate.rows > 0;
    const eng_moe_args a = {.f = f, .T = T, .x = c->xn, .xs = latent ? c->lat_in : c->xn, .X = X,
                            .router = c->router, .sel = c->sel, .selw = c->selw,
                            .exp_off = c->exp_off, .row_of = c->row_of, .tok_of = c->tok_of,
                            .xg = c->xg, .yg = c->yg, .act_a = c->fa_buf, .act_b = c->fb_buf,
                            .shared_out = c->shared_out, .out = latent ? c->lat_out : c->mix,
                            .add_shared = shared && !latent};
    b->ops->moe_route(b, &a);
    b->ops->moe_experts(b, &a);
    b->ops->moe_combine(b, &a);
    if (!latent) {
        /* s is never fresh here: a block starts before its layer's mixer */
        b->ops->add(b, s->p, c->mix, (size_t)T * hid);
        return;
    }
    if (f->latent_norm) b->ops->rmsnorm(b, c->lat_out, f->latent_norm, T, X, cfg->rms_norm_eps, c->lat_out);
    const eng_matmul up = mm_out(s, &f->latent_up, c->lat_out, T, hid);
    b->ops->matmul(b, &up, 1);
    if (shared) b->ops->add(b, s->p, c->shared_out, (size_t)T * hid);
}

/*
 * Run pass p's rows through the model on backend b: the embedding, every
 * layer of the plan (each sublayer's input formed as the input kind says,
 * its mixer and FFN by kind), then the final norm and lm_head for rows
 * [first, T). A prefill skips the lm_head of all but its final batch: on
 * small models that matrix is most of the bytes a batch reads.
 */
static void layers(const eng_ctx *c, eng_backend *b, const eng_pass *p) {
    const eng_model *m = c->m;
    const eng_config *cfg = &m->cfg;
    const int T = p->T, hid = c->d.hidden, bs = cfg->attn_res_block_size;
    const float eps = cfg->rms_norm_eps;
    /* the embedding is the stream's start: the residual, or the first
     * block's partial (banked as snapshot 0 by layer 0) */
    stream s = {.p = bs > 0 ? c->blocks : c->x, .fresh = false, .n_blocks = 0};
    b->ops->embed(b, p, &m->embed_tokens, s.p);
    for (int l = 0; l < cfg->num_hidden_layers; l++) {
        const eng_layer_weights *L = &m->layers[l];
        const float *in = sublayer_input(c, b, &s, L->attn_res_u, 0, T);
        if (L->input_kind == ENG_INPUT_ATTN_RES && l % bs == 0) {
            /* a block starts (after its first mix: kimi-k3.md §4.2): the
             * partial becomes a snapshot, the next slab the new partial */
            s.n_blocks++;
            s.p += c->block_stride;
            s.fresh = true;
        }
        b->ops->rmsnorm(b, in, L->input_layernorm, T, hid, eps, c->xn);
        /* T == 0: an expert-parallel rank without rows this step, which
         * still takes part in every MoE layer's exchange (eng_ep.c); its
         * mixers have no sequence to read */
        if (T > 0) switch (L->kind) {
        case ENG_LAYER_KDA: kda_mixer(c, b, p, L, &s); break;
        case ENG_LAYER_MLA: mla_mixer(c, b, p, L, &s); break;
        }
        in = sublayer_input(c, b, &s, L->mlp_res_u, 0, T);
        b->ops->rmsnorm(b, in, L->post_attention_layernorm, T, hid, eps, c->xn);
        switch (L->ffn_kind) {
        case ENG_FFN_DENSE: dense_ffn(c, b, p, L, &s); break;
        case ENG_FFN_MOE: moe_ffn(c, b, p, L, &s, false); break;
        case ENG_FFN_LATENT_MOE: moe_ffn(c, b, p, L, &s, true); break;
        }
    }
    if (p->first >= T) return;
    const int n = T - p->first;
    const float *h = sublayer_input(c, b, &s, m->out_res_u, p->first, n);
    b->ops->rmsnorm(b, h, m->final_norm, n, hid, eps, c->xn);
    const eng_matmul head = mm(&m->lm_head, c->xn, n, b->ops->logits_rows(b, p), c->d.vocab);
    b->ops->matmul(b, &head, 1);
}

static void run_layers(void *arg, const eng_pass *p) {
    const eng_ctx *c = arg;
    layers(c, c->b, p);
}

/* ------------------------------------------------------------------------ */
/* The plan checked against a backend: layers() walked with every op put to */
/* ops->supports instead of run.                                             */

typedef struct checker {
    eng_backend base;            /* ops: CHECK_OPS */
    const eng_backend_ops *real; /* the backend being asked */
    const eng_model *m;
    kds_status rc;               /* the first op it lacks */
    kds_err why;
} checker;

static void ask(eng_backend *b, eng_op op, const eng_weight *w, bool chunked) {
    checker *k = (checker *)b;
    if (k->rc != KDS_OK) return;
    const eng_op_query q = {.op = op, .w = w, .chunked = chunked};
    if (!k->real->supports(k->m, &q, &k->why)) k->rc = k->why.status ? k->why.status : KDS_UNSUPPORTED;
}

static void ck_embed(eng_backend *b, const eng_pass *p, const eng_weight *t, float *x) {
    (void)p, (void)x;
    ask(b, ENG_OP_EMBED, t, false);
}
static void ck_rmsnorm(eng_backend *b, const float *x, const float *w, int r, int n, float e,
                       float *y) {
    (void)x, (void)w, (void)r, (void)n, (void)e, (void)y;
    ask(b, ENG_OP_RMSNORM, NULL, false);
}
static void ck_matmul(eng_backend *b, const eng_matmul *j, int n) {
    for (int i = 0; i < n; i++) ask(b, ENG_OP_MATMUL, j[i].w, false);
}
static void ck_glu(eng_backend *b, float *a, const float *x, size_t n) {
    (void)a, (void)x, (void)n;
    ask(b, ENG_OP_GLU, NULL, false);
}
static void ck_sigmoid_mul(eng_backend *b, float *x, const float *g, size_t n) {
    (void)x, (void)g, (void)n;
    ask(b, ENG_OP_SIGMOID_MUL, NULL, false);
}
static void ck_attn_res(eng_backend *b, const eng_attn_res_args *a) {
    (void)a;
    ask(b, ENG_OP_ATTN_RES, NULL, false);
}
static void ck_add(eng_backend *b, float *y, const float *x, size_t n) {
    (void)y, (void)x, (void)n;
    ask(b, ENG_OP_ADD, NULL, false);
}
static void ck_kda(eng_backend *b, const eng_pass *p, const eng_kda_args *a) {
    (void)a;
    ask(b, ENG_OP_KDA, NULL, p->chunked && p->n_seqs == 1);
}
static void ck_mla(eng_backend *b, const eng_pass *p, const eng_mla_args *a) {
    (void)p;
    ask(b, ENG_OP_MLA, &a->w->kv_b_proj, false);
}
static void ck_route(eng_backend *b, const eng_moe_args *a) {
    (void)a;
    ask(b, ENG_OP_MOE_ROUTE, NULL, false);
}
static void ck_experts(eng_backend *b, const eng_moe_args *a) {
    const eng_ffn_weights *f = a->f;
    const int E = ((checker *)b)->m->cfg.num_experts;
    for (int e = 0; e < E; e++) {
        ask(b, ENG_OP_MOE_EXPERTS, &f->w1[e], false);
        ask(b, ENG_OP_MOE_EXPERTS, &f->w3[e], false);
        ask(b, ENG_OP_MOE_EXPERTS, &f->w2[e], false);
    }
    const eng_weight *sh[3] = {&f->sh_gate, &f->sh_up, &f->sh_down};
    for (int i = 0; i < 3; i++)
        if (sh[i]->rows > 0) ask(b, ENG_OP_MATMUL, sh[i], false);
}
static void ck_combine(eng_backend *b, const eng_moe_args *a) {
    (void)a;
    ask(b, ENG_OP_MOE_COMBINE, NULL, false);
}
static float *ck_logits_rows(eng_backend *b, const eng_pass *p) {
    (void)b, (void)p;
    return NULL; /* only handed to the lm_head's product, which is asked, not run */
}

static const eng_backend_ops CHECK_OPS = {
    .name = "check",
    .logits_rows = ck_logits_rows,
    .embed = ck_embed,
    .rmsnorm = ck_rmsnorm,
    .matmul = ck_matmul,
    .glu = ck_glu,
    .sigmoid_mul = ck_sigmoid_mul,
    .attn_res = ck_attn_res,
    .add = ck_add,
    .kda = ck_kda,
    .mla = ck_mla,
    .moe_route = ck_route,
    .moe_experts = ck_experts,
    .moe_combine = ck_combine,
};

/* Every op a prefill pass and a decode pass would issue, asked of `ops`. */
static kds_status check_plan(const eng_ctx *c, const eng_backend_ops *ops, kds_err *err) {
    checker k = {.base = {.ops = &CHECK_OPS}, .real = ops, .m = c->m, .rc = KDS_OK};
    kds_err_clear(&k.why);
    const int32_t id = 0;
    const eng_pass prefill = {.n_seqs = 1, .ids = &id, .T = 1, .chunked = true, .first = 0};
    const eng_pass decode = {.n_seqs = 1, .ids = &id, .T = 1, .chunked = false, .first = 0};
    layers(c, &k.base, &prefill);
    layers(c, &k.base, &decode);
    if (k.rc == KDS_OK) return KDS_OK;
    if (err) *err = k.why;
    return k.rc;
}

/* ------------------------------------------------------------------------ */
/* Passes                                                                    */

static kds_status check_ids(const eng_ctx *c, const int32_t *ids, int64_t n, kds_err *err) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= c->d.vocab)
            return kds_err_set(err, KDS_INVALID_ARG,
                               "token id %d at position %lld is outside the vocabulary [0, %d)",
                               ids[i], (long long)i, c->d.vocab);
    return KDS_OK;
}

/*
 * Run T rows: T <= max_batch tokens of seqs[0] (n_seqs == 1), or one token
 * of each of seqs[0..T) (n_seqs == T, chunked 0, logits NULL). logits:
 * NULL (only each sequence's last logits, computed when want_last) or
 * [T, vocab] (one sequence). Inputs are validated and the MLA caches
 * reserved by the callers. On success the sequences advance: positions,
 * recent tokens, logits (the backend put them in place).
 */
static kds_status forward(eng_ctx *c, eng_seq *const *seqs, int n_seqs, const int32_t *ids, int T,
                          bool chunked, float *logits, bool want_last, kds_err *err) {
    const bool multi = n_seqs > 1;
    eng_pass p = {.seqs = seqs, .n_seqs = n_seqs, .ids = ids, .T = T, .chunked = chunked,
                  .logits = logits};
    /* the final norm and lm_head: every row when asked or across sequences,
     * else the last row, or none before the last batch of a prefill */
    p.first = logits || multi ? 0 : T - 1;
    if (!logits && !want_last) p.first = T;
    kds_status rc = c->b->ops->run(c->b, &p, run_layers, c, err);
    if (rc != KDS_OK) return rc;
    for (int t = 0; t < T; t++) eng__seq_push_recent(seqs[multi ? t : 0], ids[t]);
    if (multi)
        for (int t = 0; t < T; t++) seqs[t]->pos++;
    else if (n_seqs == 1) /* 0: an expert-parallel rank's pass without rows */
        seqs[0]->pos += T;
    const int has = p.first < T; /* stale until the batch that ends the prefill */
    for (int i = 0; i < n_seqs; i++) seqs[i]->has_logits = has;
    return KDS_OK;
}

kds_status eng__forward(eng_ctx *c, eng_seq *const *seqs, int n_seqs, const int32_t *ids, int T,
                        bool chunked, float *logits, bool want_last, kds_err *err) {
    return forward(c, seqs, n_seqs, ids, T, chunked, logits, want_last, err);
}

eng_backend *eng__ctx_backend(const eng_ctx *c) { return c->b; }

kds_status eng_prefill(eng_ctx *c, eng_seq *s, const int32_t *ids, int64_t n, float *logits_all,
                       eng_progress_fn progress, void *user, kds_err *err) {
    if (s->model != c->m)
        return kds_err_set(err, KDS_INVALID_ARG, "sequence and context belong to different models");
    if (n <= 0) return KDS_OK;
    kds_status rc = check_ids(c, ids, n, err);
    if (rc != KDS_OK) return rc;
    if ((rc = eng__seq_reserve(s, s->pos + n, err)) != KDS_OK) return rc;
    for (int64_t done = 0; done < n;) {
        int T = n - done < c->max_batch ? (int)(n - done) : c->max_batch;
        rc = forward(c, &s, 1, ids + done, T, true,
                     logits_all ? logits_all + (size_t)done * c->d.vocab : NULL, done + T == n, err);
        if (rc != KDS_OK) return rc;
        done += T;
        if (progress) progress(user, done, n);
    }
    return KDS_OK;
}

kds_status eng_decode(eng_ctx *c, eng_seq *s, int32_t id, kds_err *err) {
    if (s->model != c->m)
        return kds_err_set(err, KDS_INVALID_ARG, "sequence and context belong to different models");
    kds_status rc = check_ids(c, &id, 1, err);
    if (rc != KDS_OK) return rc;
    if ((rc = eng__seq_reserve(s, s->pos + 1, err)) != KDS_OK) return rc;
    return forward(c, &s, 1, &id, 1, false, NULL, true, err);
}

/* Sequence i of a batch (`what`: "of the batch", "to sample"): there, of
 * this context's model, and not one of seqs[0, i). n <= max_seqs, so the
 * quadratic scan is a few thousand compares at most. */
static kds_status check_seq(const eng_ctx *c, eng_seq *const *seqs, int i, const char *what,
                            kds_err *err) {
    if (!seqs[i]) return kds_err_set(err, KDS_INVALID_ARG, "sequence %d %s is NULL", i, what);
    if (seqs[i]->model != c->m)
        return kds_err_set(err, KDS_INVALID_ARG,
                           "sequence %d %s and the context belong to different models", i, what);
    for (int j = 0; j < i; j++)
        if (seqs[j] == seqs[i])
            return kds_err_set(err, KDS_INVALID_ARG,
                               "sequence %d %s is the same as sequence %d (each sequence may "
                               "appear once)", i, what, j);
    return KDS_OK;
}

/* The checks of eng_decode_batch, and room in the MLA caches. */
static kds_status decode_batch_prepare(eng_ctx *c, eng_seq *const *seqs, const int32_t *ids, int n,
                                       kds_err *err) {
    if (n < 0 || n > c->max_seqs)
        return kds_err_set(err, KDS_INVALID_ARG,
                           "batch of %d sequences: this context takes 0 to %d (max_seqs)", n,
                           c->max_seqs);
    if (n == 0) return KDS_OK;
    if (!seqs || !ids) return kds_err_set(err, KDS_INVALID_ARG, "batch of %d sequences without %s", n,
                                          !seqs ? "sequences" : "token ids");
    for (int i = 0; i < n; i++) {
        kds_status rc = check_seq(c, seqs, i, "of the batch", err);
        if (rc != KDS_OK) return rc;
        if (ids[i] < 0 || ids[i] >= c->d.vocab)
            return kds_err_set(err, KDS_INVALID_ARG,
                               "token id %d for sequence %d of the batch is outside the "
                               "vocabulary [0, %d)", ids[i], i, c->d.vocab);
    }
    /* Growing a cache changes only its capacity, so a failure part way
     * still leaves every sequence as it was. */
    for (int i = 0; i < n; i++) {
        kds_status rc = eng__seq_reserve(seqs[i], seqs[i]->pos + 1, err);
        if (rc != KDS_OK) return rc;
    }
    return KDS_OK;
}

kds_status eng_decode_batch(eng_ctx *c, eng_seq *const *seqs, const int32_t *ids, int n,
                            kds_err *err) {
    kds_status rc = decode_batch_prepare(c, seqs, ids, n, err);
    if (rc != KDS_OK || n == 0) return rc;
    return forward(c, seqs, n, ids, n, false, NULL, true, err);
}

/* ------------------------------------------------------------------------ */
/* Sampling                                                                  */

/* Does the context's backend sample with p where its logits are? */
static bool backend_samples(const eng_ctx *c, const eng_sampler_params *p) {
    const eng_op_query q = {.op = ENG_OP_SAMPLE, .sampler = p};
    return c->b->ops->supports(c->m, &q, NULL);
}

kds_status eng_decode_batch_sample(eng_ctx *c, eng_seq *const *seqs, const int32_t *ids, int n,
                                   const eng_sampler_params *p, int32_t *next, kds_err *err) {
    if (!p || (!next && n > 0))
        return kds_err_set(err, KDS_INVALID_ARG, "eng_decode_batch_sample without %s",
                           !p ? "sampler settings" : "an output array");
    kds_status rc = decode_batch_prepare(c, seqs, ids, n, err);
    if (rc != KDS_OK || n == 0) return rc;
    if ((rc = forward(c, seqs, n, ids, n, false, NULL, true, err)) != KDS_OK) return rc;
    /* on a device only the tokens cross the bus; else the host samples */
    if (backend_samples(c, p)) {
        for (int i = 0; i < n; i++) c->samp_p[i] = *p;
        return c->b->ops->sample(c->b, seqs, n, c->samp_p, next, err);
    }
    for (int i = 0; i < n && rc == KDS_OK; i++) rc = eng_sample(c, seqs[i], p, &next[i], err);
    return rc;
}

kds_status eng_sample_batch(eng_ctx *c, eng_seq *const *seqs, int n, const eng_sampler_params *p,
                            int32_t *tokens, kds_err *err) {
    if (n < 0 || n > c->max_seqs)
        return kds_err_set(err, KDS_INVALID_ARG,
                           "sampling %d sequences: this context takes 0 to %d (max_seqs)", n,
                           c->max_seqs);
    if (n == 0) return KDS_OK;
    if (!seqs || !p || !tokens)
        return kds_err_set(err, KDS_INVALID_ARG, "eng_sample_batch without %s",
                           !seqs ? "sequences" : !p ? "sampler settings" : "an output array");
    /* every check before any draw: a refusal moves no RNG */
    for (int i = 0; i < n; i++) {
        kds_status rc = check_seq(c, seqs, i, "to sample", err);
        if (rc != KDS_OK) return rc;
        if (!seqs[i]->has_logits)
            return kds_err_set(err, KDS_INVALID_ARG,
                               "sequence %d has nothing to sample from: it is empty", i);
    }
    /* the rows whose logits a device decode left there, with settings the
     * device sampler has: one call; the rest on the host, in order */
    int m = 0;
    kds_status rc = KDS_OK;
    for (int i = 0; i < n && rc == KDS_OK; i++) {
        eng_seq *s = seqs[i];
        if (s->gpu && s->gpu == c->b && s->logits_on_gpu && backend_samples(c, &p[i])) {
            c->samp_dev_seqs[m] = s;
            c->samp_dev_p[m] = p[i];
            c->samp_dev_idx[m++] = i;
        } else {
            rc = eng_sample(c, s, &p[i], &tokens[i], err);
        }
    }
    if (rc != KDS_OK || m == 0) return rc;
    rc = c->b->ops->sample(c->b, c->samp_dev_seqs, m, c->samp_dev_p, c->samp_dev_tok, err);
    for (int j = 0; j < m && rc == KDS_OK; j++) tokens[c->samp_dev_idx[j]] = c->samp_dev_tok[j];
    return rc;
}

kds_status eng_sample(eng_ctx *c, eng_seq *s, const eng_sampler_params *p, int32_t *token,
                      kds_err *err) {
    /* logits a device decode left on the device are sampled there */
    if (s->gpu && s->gpu == c->b && s->logits_on_gpu && s->has_logits && backend_samples(c, p))
        return c->b->ops->sample(c->b, &s, 1, p, token, err);
    kds_status rc = eng__seq_fetch_logits(s, err);
    if (rc != KDS_OK) return rc;
    if (!s->has_logits)
        return kds_err_set(err, KDS_INVALID_ARG, "nothing to sample from: the sequence is empty");
    *token = eng__sample_host(s, p, c->cand_p, c->cand_id);
    return KDS_OK;
}

/* ------------------------------------------------------------------------ */
/* Context lifecycle                                                         */

/* The activation buffers of a context, in the backend's memory. */
static kds_status alloc_activations(eng_ctx *c, kds_err *err) {
    const eng_model *m = c->m;
    const eng_config *cfg = &m->cfg;
    const eng_dims *d = &c->d;
    eng_backend *b = c->b;
    /* a batched decode runs max_seqs rows through the same buffers */
    const size_t B = (size_t)(c->max_batch > c->max_seqs ? c->max_batch : c->max_seqs);
    const size_t Bk = B * (size_t)c->top_k;
    /* The FFN's gate and up products (each): a dense layer's [B,
     * intermediate_size], or the MoE's routed rows [B*top_k,
     * moe_intermediate_size] followed by the shared experts' [B,
     * moe_intermediate_size * num_shared_experts] (eng_moe_args.act_a);
     * the larger. Sizing all B*top_k + B rows for the widest FFN would
     * take nine times this on wide (its dense layer's 9,216 columns for
     * each routed row's 1,024): 295 MB more in a 512-token context. */
    size_t ffn = B * (size_t)cfg->intermediate_size;
    if (cfg->num_experts > 0) {
        const size_t moe = Bk * (size_t)cfg->moe_intermediate_size +
                           B * (size_t)cfg->moe_intermediate_size * (size_t)cfg->num_shared_experts;
        if (moe > ffn) ffn = moe;
    }
    int rank = d->K > d->V ? d->K : d->V; /* the gates' and q LoRA's inner widths */
    for (int l = 0; l < cfg->num_hidden_layers; l++) {
        if (m->layers[l].kda.f_a_proj.rows > rank) rank = m->layers[l].kda.f_a_proj.rows;
        if (m->layers[l].kda.g_a_proj.rows > rank) rank = m->layers[l].kda.g_a_proj.rows;
    }
    if (cfg->q_lora_rank > rank) rank = cfg->q_lora_rank;
    size_t o_width = (size_t)d->kda_v;
    if ((size_t)d->mla_heads * d->dv > o_width && d->n_mla) o_width = (size_t)d->mla_heads * d->dv;
    const int taps = d->W > 1 ? d->W - 1 : 0;
    const size_t E = (size_t)(cfg->num_experts > 0 ? cfg->num_experts : 0);
    const size_t L = (size_t)cfg->latent_size;
    const size_t X = L > (size_t)d->hidden ? L : (size_t)d->hidden; /* the routed experts' width */
    /* AttnRes: the snapshots (a block starts at every bs-th layer) and the partial */
    const size_t bs = (size_t)cfg->attn_res_block_size;
    const size_t n_slabs = bs ? ((size_t)cfg->num_hidden_layers + bs - 1) / bs + 1 : 0;
    c->block_stride = B * d->hidden;
    struct {
        void **p;
        size_t bytes;
    } want[] = {
        {(void **)&c->x, B * d->hidden * 4},
        {(void **)&c->xn, B * d->hidden * 4},
        {(void **)&c->mix, B * d->hidden * 4},
        {(void **)&c->ext, (B + taps) * d->conv_ch * 4},
        {(void **)&c->q, B * d->kda_qk * 4},
        {(void **)&c->k, B * d->kda_qk * 4},
        {(void **)&c->v, B * d->kda_v * 4},
        {(void **)&c->fa, B * rank * 4},
        {(void **)&c->ga, B * rank * 4},
        {(void **)&c->g, B * d->HV * d->K * 4},
        {(void **)&c->beta, B * d->HV * 4},
        {(void **)&c->gz, B * o_width * 4}, /* KDA's output gate, or MLA's */
        {(void **)&c->o, B * o_width * 4},
        {(void **)&c->mq, d->n_mla ? B * d->mla_heads * (d->dn + d->dr) * 4 : 0},
        {(void **)&c->kva, d->n_mla ? B * d->mla_row * 4 : 0},
        {(void **)&c->fa_buf, ffn * 4},
        {(void **)&c->fb_buf, ffn * 4},
        {(void **)&c->shared_out, B * d->hidden * 4},
        {(void **)&c->router, B * E * 4},
        {(void **)&c->sel, E ? Bk * 4 : 0},
        {(void **)&c->selw, E ? Bk * 4 : 0},
        {(void **)&c->exp_off, E ? (E + 1) * 4 : 0},
        {(void **)&c->row_of, E ? Bk * 4 : 0},
        {(void **)&c->tok_of, E ? Bk * 4 : 0},
        {(void **)&c->xg, E ? Bk * X * 4 : 0},
        {(void **)&c->yg, E ? Bk * X * 4 : 0},
        {(void **)&c->lat_in, B * L * 4},
        {(void **)&c->lat_out, B * L * 4},
        {(void **)&c->blocks, n_slabs * B * d->hidden * 4},
        {(void **)&c->mixed, n_slabs ? B * d->hidden * 4 : 0},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        if (want[i].bytes == 0) continue;
        if (!(*want[i].p = b->ops->alloc(b, want[i].bytes)))
            return kds_err_set(err, KDS_NOMEM,
                               "out of %s memory for a context of %d tokens and %d sequences",
                               b->ops->name, c->max_batch, c->max_seqs);
    }
    c->cand_p = calloc((size_t)d->vocab + 1, sizeof *c->cand_p);
    c->cand_id = calloc((size_t)d->vocab + 1, sizeof *c->cand_id);
    const size_t S = (size_t)c->max_seqs;
    c->samp_p = calloc(S, sizeof *c->samp_p);
    c->samp_dev_p = calloc(S, sizeof *c->samp_dev_p);
    c->samp_dev_seqs = calloc(S, sizeof *c->samp_dev_seqs);
    c->samp_dev_idx = calloc(S, sizeof *c->samp_dev_idx);
    c->samp_dev_tok = calloc(S, sizeof *c->samp_dev_tok);
    if (!c->cand_p || !c->cand_id || !c->samp_p || !c->samp_dev_p || !c->samp_dev_seqs ||
        !c->samp_dev_idx || !c->samp_dev_tok)
        return kds_err_set(err, KDS_NOMEM, "out of memory creating a context");
    return KDS_OK;
}

kds_status eng_ctx_create(const eng_model *m, const eng_ctx_params *p, eng_ctx **out,
                          kds_err *err) {
    *out = NULL;
    eng_ctx_params def = eng_ctx_default_params();
    if (!p) p = &def;
    eng_device device;
    if (!eng_device_from_name(p->device, &device))
        return kds_err_set(err, KDS_INVALID_ARG, "unknown device '%s' (cpu or cuda)", p->device);
    const eng_backend_ops *ops = eng__backend_ops(device);
    if (!ops)
        return kds_err_set(err, KDS_UNSUPPORTED,
                           "device '%s': this kdaserve was built without it (CUDA: configure with "
                           "nvcc on the PATH or CUDACXX set, and -DKDS_CUDA=ON)",
                           eng_device_name(device));
    if (p->comm) {
        /* expert parallelism wraps the CPU backend (eng_ep.c) */
        if (device != ENG_DEVICE_CPU)
            return kds_err_set(err, KDS_UNSUPPORTED,
                               "expert parallelism runs on the CPU ranks only so far (the NCCL "
                               "communicator exists, the GPU backend's dispatch does not): use "
                               "--device cpu, or one rank for --device %s",
                               eng_device_name(device));
        ops = &eng__ep_ops;
    }
    /* the parameters with their defaults, as the backend sees them */
    eng_ctx_params q = *p;
    q.max_batch = p->max_batch > 0 ? p->max_batch : def.max_batch;
    q.kda_chunk = p->kda_chunk > 0 ? p->kda_chunk : def.kda_chunk;
    q.max_seqs = p->max_seqs > 0 ? p->max_seqs : def.max_seqs;
    q.n_threads = p->n_threads > 0 ? p->n_threads : eng_cpus_online(0);
    eng_ctx *c = calloc(1, sizeof *c);
    if (!c) return kds_err_set(err, KDS_NOMEM, "out of memory creating a context");
    c->m = m;
    eng__dims(&m->cfg, &c->d);
    c->max_batch = q.max_batch;
    c->max_seqs = q.max_seqs;
    c->n_threads = q.n_threads;
    c->top_k = m->cfg.num_experts > 0 ? m->cfg.num_experts_per_token : 1;
    /* the weights are copied (ops->load: gigabytes on a GPU) only once the
     * plan is known to run there */
    kds_status rc = ops->create(m, &q, &c->b, err);
    if (rc == KDS_OK) rc = alloc_activations(c, err);
    if (rc == KDS_OK) rc = check_plan(c, ops, err);
    if (rc == KDS_OK) rc = c->b->ops->load(c->b, err);
    if (rc != KDS_OK) {
        eng_ctx_free(c);
        return rc;
    }
    *out = c;
    return KDS_OK;
}

void eng_ctx_free(eng_ctx *c) {
    if (!c) return;
    if (c->b) c->b->ops->free(c->b); /* the activations with it */
    free(c->cand_p);
    free(c->cand_id);
    free(c->samp_p);
    free(c->samp_dev_p);
    free(c->samp_dev_seqs);
    free(c->samp_dev_idx);
    free(c->samp_dev_tok);
    free(c);
}

int eng_ctx_threads(const eng_ctx *c) { return c->n_threads; }

eng_device eng_ctx_device_kind(const eng_ctx *c) { return c->b->ops->device; }

const char *eng_ctx_device(const eng_ctx *c) { return c->b->ops->name; }

eng_cuda *eng__ctx_gpu(const eng_ctx *c) {
    return c->b->ops->device == ENG_DEVICE_CUDA ? (eng_cuda *)c->b : NULL;
}

int eng_ctx_max_seqs(const eng_ctx *c) { return c->max_seqs; }

kds_status eng_ctx_attach(eng_ctx *c, eng_seq *s, kds_err *err) {
    if (s->model != c->m)
        return kds_err_set(err, KDS_INVALID_ARG, "sequence and context belong to different models");
    return c->b->ops->attach(c->b, s, err);
}

kds_status eng_ctx_release(eng_ctx *c, eng_seq *s, kds_err *err) {
    if (s->model != c->m)
        return kds_err_set(err, KDS_INVALID_ARG, "sequence and context belong to different models");
    if (!s->gpu) return KDS_OK;
    kds_status rc = eng__seq_fetch(s, err);
    if (rc == KDS_OK) rc = eng__seq_fetch_logits(s, err);
    if (rc == KDS_OK) eng__seq_detach(s);
    return rc;
}
