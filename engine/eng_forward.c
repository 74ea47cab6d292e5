/*
 * eng_forward.c - compute contexts and the forward pass (spec §3-§7).
 *
 * One function, forward(), runs T rows through every layer, layer by layer
 * over the whole batch, so each weight matrix is streamed once per batch.
 * The rows are either T tokens of one sequence (prefill, decode) or one new
 * token of each of T different sequences (eng_decode_batch: continuous
 * batching). Embedding, norms, projections and FFNs do not care which; only
 * the short conv, the KDA core and MLA attention read per-sequence state.
 * KDA layers take the chunked WY path when prefill is asked for and the
 * token-by-token recurrence otherwise; everything else is the same code for
 * both, so prefill and decode differ only in the KDA core and in the
 * summation order inside BLAS.
 *
 * Parallelism: every matrix product is cut into row blocks and run on the
 * context's pool (several products that read the same input go out in one
 * dispatch); the KDA core and MLA attention are split by head. OpenBLAS is
 * pinned to one thread so that it never competes with the pool.
 *
 * Memory: all activations live in scratch buffers sized at eng_ctx_create
 * for max(max_batch, max_seqs) rows; the only allocation on the hot path is
 * the MLA cache growing geometrically (eng__seq_reserve).
 */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "eng_cuda.h"
#include "eng_pool.h"
#include "eng_seq.h"

#define MAX_MM_JOBS 8
#define MAX_MM_TASKS 1024
/* Largest short-conv width eng_config accepts (short_conv_kernel_size). */
#define MAX_CONV_W 64

typedef struct mm_job {
    const eng_weight *w;
    const float *x;    /* [T, w->cols] */
    int T;
    float *y;          /* [T, ldy], columns [0, w->rows) written */
    int ldy;
} mm_job;

typedef struct mm_task {
    int job, r0, r1;
} mm_task;

typedef struct thread_scratch {
    float *mm;          /* widened weight rows for BLAS */
    float *kda_ws;      /* chunked KDA workspace */
    float *mla_w;       /* one head's kv_b rows, widened: [(dn+dv), dc] */
    float *mla_ws;      /* kern_mla_attend_head workspace for B queries */
} thread_scratch;

struct eng_ctx {
    const eng_model *m;
    eng_dims d;
    eng_pool *pool;
    int n_threads, max_batch, kda_chunk;
    int max_seqs;         /* sequences one eng_decode_batch may carry */
    int ffn_width;        /* widest FFN hidden width (dense, shared or routed) */
    int top_k, n_experts;
    /* activations, [max_batch, ...] */
    float *x, *xn, *mix;                 /* [B, hidden] residual, normed, mixer/ffn out */
    float *ext;                          /* [W-1+B, conv_ch] conv input incl. tail */
    float *q, *k, *v;                    /* [B, H*K], [B, H*K], [B, HV*V] */
    float *fa, *ga, *g, *beta, *gz, *o;  /* gate/beta/output-gate inputs, core output */
    float *mq, *kva;                     /* MLA: [B, nh*(dn+dr)], [B, dc+dr] */
    float *fa_buf, *fb_buf, *shared_out; /* FFN: [B*top_k, width] x2, [B, hidden] */
    float *router;                       /* [B, E] */
    int32_t *sel;                        /* [B, top_k] chosen experts */
    float *selw;                         /* [B, top_k] their weights */
    int32_t *exp_off;                    /* [E+1] first gathered row of each expert */
    int32_t *exp_fill;                   /* [E] next free row while gathering */
    int32_t *row_of;                     /* [B, top_k] -> row in gathered buffers */
    float *xg, *yg;                      /* [B*top_k, hidden] gathered in / expert out */
    float *logits;                       /* [max_seqs, vocab] lm_head out of a batched decode */
    /* sampler */
    float *cand_p;                       /* [vocab] */
    int32_t *cand_id;                    /* [vocab] */
    thread_scratch *ts;                  /* [n_threads] */
    mm_job jobs[MAX_MM_JOBS];
    mm_task tasks[MAX_MM_TASKS];
    int n_tasks;
    eng_cuda *gpu;                       /* device "cuda": the forward pass runs there */
};

eng_ctx_params eng_ctx_default_params(void) {
    return (eng_ctx_params){.n_threads = 0, .max_batch = 256, .kda_chunk = 64, .max_seqs = 64};
}

eng_sampler_params eng_sampler_default_params(void) {
    return (eng_sampler_params){.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f,
                                .repeat_penalty = 1.0f, .repeat_last_n = 64};
}

/* ------------------------------------------------------------------------ */
/* Matrix products on the pool                                               */

static void mm_task_fn(void *arg, int t, int thread) {
    eng_ctx *c = arg;
    const mm_task *task = &c->tasks[t];
    const mm_job *j = &c->jobs[task->job];
    kern_matmul(j->w->dt, j->w->data, j->w->cols, j->x, j->T, j->y, j->ldy, task->r0, task->r1,
                c->ts[thread].mm);
}

/* Run up to MAX_MM_JOBS products in one dispatch, cut into row blocks of
 * roughly equal work. Small totals run inline: a dispatch costs more than a
 * few thousand multiply-adds. */
static void run_mm(eng_ctx *c, int n_jobs) {
    double total = 0;
    for (int i = 0; i < n_jobs; i++)
        total += (double)c->jobs[i].w->rows * c->jobs[i].w->cols * c->jobs[i].T;
    int n_tasks = 0;
    if (c->n_threads == 1 || total < 65536.0) {
        for (int i = 0; i < n_jobs; i++)
            c->tasks[n_tasks++] = (mm_task){i, 0, c->jobs[i].w->rows};
        for (int t = 0; t < n_tasks; t++) mm_task_fn(c, t, 0);
        return;
    }
    double target = total / (c->n_threads * 4.0);
    if (target < 32768.0) target = 32768.0;
    for (int i = 0; i < n_jobs; i++) {
        const mm_job *j = &c->jobs[i];
        int rows = j->w->rows;
        double work = (double)rows * j->w->cols * j->T;
        int nb = (int)ceil(work / target);
        if (nb > rows) nb = rows;
        if (nb < 1) nb = 1;
        int room = MAX_MM_TASKS - n_tasks - (n_jobs - i - 1);
        if (nb > room) nb = room;
        for (int b = 0; b < nb; b++) {
            int r0 = (int)((int64_t)rows * b / nb), r1 = (int)((int64_t)rows * (b + 1) / nb);
            if (r1 > r0) c->tasks[n_tasks++] = (mm_task){i, r0, r1};
        }
    }
    c->n_tasks = n_tasks;
    eng_pool_run(c->pool, mm_task_fn, c, n_tasks);
}

static void job(eng_ctx *c, int i, const eng_weight *w, const float *x, int T, float *y, int ldy) {
    c->jobs[i] = (mm_job){w, x, T, y, ldy};
}

/* ------------------------------------------------------------------------ */
/* KDA layer                                                                 */

typedef struct kda_run {
    eng_ctx *c;
    const eng_kda_weights *w;
    float *state;       /* [HV, K, V] of this layer (one sequence; NULL across sequences) */
    eng_seq *const *seqs; /* row t belongs to seqs[t] when n_seqs > 1 */
    int n_seqs, slot;   /* slot: this layer's index among the KDA layers */
    int T, chunked, n_parts;
} kda_run;

/*
 * Per-token work between the projections and the core, for tokens of part
 * `part` of n_parts: depthwise causal conv + SiLU, L2 norm of q and k, the
 * decay gate and beta's sigmoid. Tokens are independent here, so parts run
 * in parallel. out_t[ch] = sum_j w[ch, j] * tap_j[ch], j = 0..taps, where
 *   one sequence:   tap_j = ext row t+j (ext holds the tail, then the batch);
 *   across n_seqs:  tap_j = row j of seqs[t]'s tail (j < taps), tap_taps =
 *                   the new row ext[taps+t]; that tail then moves on by one
 *                   row (safe in parallel: each sequence owns one row).
 */
static void kda_pre_fn(void *arg, int part, int thread) {
    (void)thread;
    kda_run *r = arg;
    eng_ctx *c = r->c;
    const eng_dims *d = &c->d;
    const eng_kda_weights *w = r->w;
    const eng_config *cfg = &c->m->cfg;
    const int C = d->conv_ch, taps = d->W - 1;
    int t0 = (int)((int64_t)r->T * part / r->n_parts), t1 = (int)((int64_t)r->T * (part + 1) / r->n_parts);
    for (int t = t0; t < t1; t++) {
        const float *tap[MAX_CONV_W];
        float *tail = NULL; /* [taps, C] of seqs[t], oldest first */
        if (r->n_seqs > 1) {
            tail = r->seqs[t]->conv_tail + (size_t)r->slot * taps * C;
            for (int j = 0; j < taps; j++) tap[j] = tail + (size_t)j * C;
            tap[taps] = c->ext + (size_t)(taps + t) * C;
        } else {
            for (int j = 0; j <= taps; j++) tap[j] = c->ext + (size_t)(t + j) * C;
        }
        for (int which = 0; which < 3; which++) {
            int base = which == 0 ? 0 : which == 1 ? d->kda_qk : 2 * d->kda_qk;
            int n = which == 2 ? d->kda_v : d->kda_qk;
            const float *wc = which == 0 ? w->q_conv : which == 1 ? w->k_conv : w->v_conv;
            float *out = (which == 0 ? c->q : which == 1 ? c->k : c->v) + (size_t)t * n;
            for (int ch = 0; ch < n; ch++) {
                float acc = 0.0f;
                for (int j = 0; j <= taps; j++) acc += wc[(size_t)ch * d->W + j] * tap[j][base + ch];
                out[ch] = acc;
            }
            kern_silu(out, (size_t)n);
        }
        if (tail && taps > 0) {
            memmove(tail, tail + C, (size_t)(taps - 1) * C * sizeof(float));
            memcpy(tail + (size_t)(taps - 1) * C, tap[taps], (size_t)C * sizeof(float));
        }
    }
    int n = t1 - t0;
    if (n <= 0) return;
    kern_l2norm(c->q + (size_t)t0 * d->kda_qk, n * d->H, d->K, 1e-6f);
    kern_l2norm(c->k + (size_t)t0 * d->kda_qk, n * d->H, d->K, 1e-6f);
    float *g = c->g + (size_t)t0 * d->HV * d->K;
    kern_kda_gate(g, w->A_log, w->dt_bias, n, d->HV, d->K,
                  cfg->has_gate_lower_bound ? cfg->gate_lower_bound : 0.0f, g);
    kern_sigmoid_inplace(c->beta + (size_t)t0 * d->HV, (size_t)n * d->HV);
}

/* Gated output norm of rows [t0, t1), value head hv:
 * o * rsqrt(mean(o^2) + eps) * w * sigmoid(z). */
static void kda_out_norm(const kda_run *r, int hv, int t0, int t1) {
    eng_ctx *c = r->c;
    const eng_dims *d = &c->d;
    const float eps = c->m->cfg.rms_norm_eps;
    for (int t = t0; t < t1; t++) {
        size_t at = ((size_t)t * d->HV + hv) * d->V;
        float *oh = c->o + at, *z = c->gz + at;
        kern_rmsnorm(oh, r->w->o_norm, KERN_F32, d->V, eps, oh);
        kern_sigmoid_inplace(z, (size_t)d->V);
        for (int e = 0; e < d->V; e++) oh[e] *= z[e];
    }
}

/* One sequence: the core for value head `task` over all T tokens, then that
 * head's output norm. Across sequences: task = t * HV + hv, one decode step
 * of row t's sequence for head hv (the same call eng_decode makes). */
static void kda_core_fn(void *arg, int task, int thread) {
    kda_run *r = arg;
    eng_ctx *c = r->c;
    const eng_dims *d = &c->d;
    kern_kda_shape sh = {d->H, d->HV, d->K, d->V, 1.0f / sqrtf((float)d->K)};
    if (r->n_seqs > 1) {
        const int t = task / d->HV, hv = task % d->HV;
        float *state = r->seqs[t]->kda_state + (size_t)r->slot * d->HV * d->K * d->V;
        kern_kda_recurrent(&sh, 1, c->q + (size_t)t * d->kda_qk, c->k + (size_t)t * d->kda_qk,
                           c->v + (size_t)t * d->kda_v, c->g + (size_t)t * d->HV * d->K,
                           c->beta + (size_t)t * d->HV, state, c->o + (size_t)t * d->kda_v, hv,
                           hv + 1);
        kda_out_norm(r, hv, t, t + 1);
        return;
    }
    const int hv = task;
    if (r->chunked)
        kern_kda_chunked(&sh, r->T, c->kda_chunk, c->q, c->k, c->v, c->g, c->beta, r->state, c->o,
                         hv, hv + 1, c->ts[thread].kda_ws);
    else
        kern_kda_recurrent(&sh, r->T, c->q, c->k, c->v, c->g, c->beta, r->state, c->o, hv, hv + 1);
    kda_out_norm(r, hv, 0, r->T);
}

/* seqs[0..n_seqs): one sequence with T tokens, or T sequences with one each
 * (then chunked is 0). */
static void kda_layer(eng_ctx *c, eng_seq *const *seqs, int n_seqs, const eng_layer_weights *L,
                      int slot, int T, int chunked) {
    const eng_dims *d = &c->d;
    const eng_kda_weights *w = &L->kda;
    const int C = d->conv_ch, taps = d->W - 1;
    const int multi = n_seqs > 1;
    float *conv_tail = multi ? NULL : seqs[0]->conv_tail + (size_t)slot * taps * C;
    float *in = c->ext + (size_t)taps * C; /* projections land after the tail rows */
    if (!multi) memcpy(c->ext, conv_tail, (size_t)taps * C * sizeof(float));

    job(c, 0, &w->q_proj, c->xn, T, in, C);
    job(c, 1, &w->k_proj, c->xn, T, in + d->kda_qk, C);
    job(c, 2, &w->v_proj, c->xn, T, in + 2 * d->kda_qk, C);
    job(c, 3, &w->f_a_proj, c->xn, T, c->fa, w->f_a_proj.rows);
    job(c, 4, &w->b_proj, c->xn, T, c->beta, d->HV);
    job(c, 5, &w->g_a_proj, c->xn, T, c->ga, w->g_a_proj.rows);
    run_mm(c, 6);
    job(c, 0, &w->f_b_proj, c->fa, T, c->g, d->HV * d->K);
    job(c, 1, &w->g_b_proj, c->ga, T, c->gz, d->kda_v);
    run_mm(c, 2);

    float *state = multi ? NULL : seqs[0]->kda_state + (size_t)slot * d->HV * d->K * d->V;
    kda_run r = {c, w, state, seqs, n_seqs, slot, T, chunked, 1};
    /* A part per thread once there is enough per-token work to pay for it. */
    if (c->n_threads > 1 && (double)T * C >= 16384.0) {
        r.n_parts = T < c->n_threads * 4 ? T : c->n_threads * 4;
        eng_pool_run(c->pool, kda_pre_fn, &r, r.n_parts);
    } else {
        kda_pre_fn(&r, 0, 0);
    }
    if (!multi) memcpy(conv_tail, c->ext + (size_t)T * C, (size_t)taps * C * sizeof(float));

    int n_tasks = multi ? T * d->HV : d->HV;
    if ((double)T * d->HV * d->K * d->V < 65536.0 || c->n_threads == 1)
        for (int i = 0; i < n_tasks; i++) kda_core_fn(&r, i, 0);
    else
        eng_pool_run(c->pool, kda_core_fn, &r, n_tasks);
    job(c, 0, &w->o_proj, c->o, T, c->mix, d->hidden);
    run_mm(c, 1);
}

/* ------------------------------------------------------------------------ */
/* MLA layer (absorbed form, spec §5.2; no RoPE)                             */

typedef struct mla_run {
    eng_ctx *c;
    eng_seq *const *seqs;   /* row t belongs to seqs[t] when n_seqs > 1, else to seqs[0] */
    int n_seqs, slot;       /* slot: this layer's index among the MLA layers */
    const eng_mla_weights *w;
    int T, n_groups;        /* task = group * heads + head; groups split the rows */
} mla_run;

/* One head for one group of rows: widen the head's kv_b rows once, then
 * attend the whole batch of one sequence, or each row of the group against
 * its own sequence's cache and position. */
static void mla_head_fn(void *arg, int task, int thread) {
    mla_run *r = arg;
    eng_ctx *c = r->c;
    const eng_dims *d = &c->d;
    thread_scratch *ts = &c->ts[thread];
    const int dc = d->dc, dn = d->dn, dr = d->dr, dv = d->dv;
    const kern_mla_shape sh = {d->mla_heads, dc, dr, dn, dv};
    const int h = task % d->mla_heads, group = task / d->mla_heads;
    const eng_weight *kvb = &r->w->kv_b_proj; /* [nh*(dn+dv), dc] */
    size_t esz = kern_dtype_size(kvb->dt);
    /* W_UK_h = rows [h*(dn+dv), +dn), W_UV_h = the next dv rows. */
    kern_to_f32(kvb->dt, (const char *)kvb->data + (size_t)h * (dn + dv) * dc * esz, ts->mla_w,
                (size_t)(dn + dv) * dc);
    const float *wuk = ts->mla_w, *wuv = ts->mla_w + (size_t)dn * dc;
    const size_t qstride = (size_t)d->mla_heads * (dn + dr), ostride = (size_t)d->mla_heads * dv;
    const float *qh = c->mq + (size_t)h * (dn + dr);
    float *oh = c->o + (size_t)h * dv;
    if (r->n_seqs == 1) {
        const eng_seq *s = r->seqs[0];
        kern_mla_attend_head(&sh, wuk, wuv, qh, (int)qstride, r->T, s->pos, s->mla_cache[r->slot],
                             oh, (int)ostride, ts->mla_ws);
        return;
    }
    int t0 = (int)((int64_t)r->T * group / r->n_groups);
    int t1 = (int)((int64_t)r->T * (group + 1) / r->n_groups);
    for (int t = t0; t < t1; t++) {
        const eng_seq *s = r->seqs[t];
        kern_mla_attend_head(&sh, wuk, wuv, qh + (size_t)t * qstride, (int)qstride, 1, s->pos,
                             s->mla_cache[r->slot], oh + (size_t)t * ostride, (int)ostride,
                             ts->mla_ws);
    }
}

/* seqs[0..n_seqs): one sequence with T tokens, or T sequences with one each. */
static void mla_layer(eng_ctx *c, eng_seq *const *seqs, int n_seqs, const eng_layer_weights *L,
                      int slot, int T) {
    const eng_dims *d = &c->d;
    const eng_mla_weights *w = &L->mla;
    const eng_config *cfg = &c->m->cfg;
    if (cfg->q_lora_rank > 0) {
        job(c, 0, &w->q_a_proj, c->xn, T, c->fa, cfg->q_lora_rank);
        job(c, 1, &w->kv_a_proj_with_mqa, c->xn, T, c->kva, d->mla_row);
        run_mm(c, 2);
        for (int t = 0; t < T; t++) {
            float *qa = c->fa + (size_t)t * cfg->q_lora_rank;
            kern_rmsnorm(qa, w->q_a_layernorm, KERN_F32, cfg->q_lora_rank, cfg->rms_norm_eps, qa);
        }
        job(c, 0, &w->q_b_proj, c->fa, T, c->mq, d->mla_heads * (d->dn + d->dr));
        run_mm(c, 1);
    } else {
        job(c, 0, &w->q_proj, c->xn, T, c->mq, d->mla_heads * (d->dn + d->dr));
        job(c, 1, &w->kv_a_proj_with_mqa, c->xn, T, c->kva, d->mla_row);
        run_mm(c, 2);
    }
    /* Each row's latent [norm(c) | k_pe] goes to its sequence's cache at
     * that sequence's position (row t of one sequence: position pos + t). */
    for (int t = 0; t < T; t++) {
        const eng_seq *s = seqs[n_seqs > 1 ? t : 0];
        const float *a = c->kva + (size_t)t * d->mla_row;
        float *dst = s->mla_cache[slot] + (size_t)(s->pos + (n_seqs > 1 ? 0 : t)) * d->mla_row;
        kern_rmsnorm(a, w->kv_a_layernorm, KERN_F32, d->dc, cfg->rms_norm_eps, dst);
        memcpy(dst + d->dc, a + d->dc, (size_t)d->dr * sizeof(float));
    }
    mla_run r = {c, seqs, n_seqs, slot, w, T, 1};
    /* Across sequences, cut the rows into groups until there are a few
     * tasks per thread; each task widens its head's weights once. */
    if (n_seqs > 1) {
        int want = (c->n_threads * 4 + d->mla_heads - 1) / d->mla_heads;
        r.n_groups = c->n_threads == 1 ? 1 : want < T ? want : T;
    }
    int n_tasks = d->mla_heads * r.n_groups;
    if (c->n_threads == 1)
        for (int i = 0; i < n_tasks; i++) mla_head_fn(&r, i, 0);
    else
        eng_pool_run(c->pool, mla_head_fn, &r, n_tasks);
    job(c, 0, &w->o_proj, c->o, T, c->mix, d->hidden);
    run_mm(c, 1);
}

/* ------------------------------------------------------------------------ */
/* FFN: dense MLP and MoE (spec §6)                                          */

static void dense_ffn(eng_ctx *c, const eng_weight *gate, const eng_weight *up,
                      const eng_weight *down, const float *x, int T, float *out) {
    int inner = gate->rows;
    job(c, 0, gate, x, T, c->fa_buf, inner);
    job(c, 1, up, x, T, c->fb_buf, inner);
    run_mm(c, 2);
    kern_swiglu(c->fa_buf, c->fb_buf, (size_t)T * inner);
    job(c, 0, down, c->fa_buf, T, out, c->d.hidden);
    run_mm(c, 1);
}

static void moe_ffn(eng_ctx *c, const eng_ffn_weights *f, int T) {
    const eng_config *cfg = &c->m->cfg;
    const int E = cfg->num_experts, k = cfg->num_experts_per_token, hid = c->d.hidden;
    job(c, 0, &f->router, c->xn, T, c->router, E);
    run_mm(c, 1);
    memset(c->exp_off, 0, (size_t)(E + 1) * sizeof(int32_t));
    /* Selection uses score + bias (and the group limit); weights use the
     * score alone (project decision, spec §10 Q1). kern_moe_route is also
     * the reference of the CUDA routing kernel. */
    for (size_t i = 0; i < (size_t)T * E; i++) c->router[i] = kern_sigmoid(c->router[i]);
    const kern_moe_route_params rp = {
        .n_experts = E,
        .top_k = k,
        .n_group = cfg->use_grouped_topk && cfg->num_expert_group > 1 ? cfg->num_expert_group : 1,
        .topk_group = cfg->topk_group,
        .renormalize = cfg->moe_renormalize,
        .routed_scaling_factor = cfg->routed_scaling_factor};
    kern_moe_route(&rp, T, c->router, f->router_bias, c->sel, c->selw);
    for (int i = 0; i < T * k; i++) c->exp_off[c->sel[i] + 1]++;
    for (int e = 0; e < E; e++) c->exp_off[e + 1] += c->exp_off[e];
    /* Gather each expert's tokens into a contiguous block of xg. */
    int32_t *fill = c->exp_fill;
    memcpy(fill, c->exp_off, (size_t)E * sizeof(int32_t));
    for (int t = 0; t < T; t++)
        for (int n = 0; n < k; n++) {
            int row = fill[c->sel[t * k + n]]++;
            c->row_of[t * k + n] = row;
            memcpy(c->xg + (size_t)row * hid, c->xn + (size_t)t * hid, (size_t)hid * sizeof(float));
        }
    const int inner = cfg->moe_intermediate_size;
    const int sh_inner = f->sh_gate.rows; /* 0 without shared experts */
    /* The shared expert's rows live after the routed ones in the FFN
     * buffers, so its products join the routed experts' dispatches. */
    float *sh_a = c->fa_buf + (size_t)T * k * inner, *sh_b = c->fb_buf + (size_t)T * k * inner;
    /* Up projections of all active experts and the shared expert, in as few
     * dispatches as the job table allows. */
    int nj = 0;
    if (sh_inner > 0) {
        job(c, nj++, &f->sh_gate, c->xn, T, sh_a, sh_inner);
        job(c, nj++, &f->sh_up, c->xn, T, sh_b, sh_inner);
    }
    for (int e = 0; e < E; e++) {
        int n_e = c->exp_off[e + 1] - c->exp_off[e];
        if (n_e == 0) continue;
        if (nj + 2 > MAX_MM_JOBS) {
            run_mm(c, nj);
            nj = 0;
        }
        size_t off = (size_t)c->exp_off[e];
        job(c, nj++, &f->w1[e], c->xg + off * hid, n_e, c->fa_buf + off * inner, inner);
        job(c, nj++, &f->w3[e], c->xg + off * hid, n_e, c->fb_buf + off * inner, inner);
    }
    if (nj) run_mm(c, nj);
    kern_swiglu(c->fa_buf, c->fb_buf, (size_t)T * k * inner + (size_t)T * sh_inner);
    nj = 0;
    if (sh_inner > 0) job(c, nj++, &f->sh_down, sh_a, T, c->shared_out, hid);
    for (int e = 0; e < E; e++) {
        int n_e = c->exp_off[e + 1] - c->exp_off[e];
        if (n_e == 0) continue;
        if (nj + 1 > MAX_MM_JOBS) {
            run_mm(c, nj);
            nj = 0;
        }
        size_t off = (size_t)c->exp_off[e];
        job(c, nj++, &f->w2[e], c->fa_buf + off * inner, n_e, c->yg + off * hid, hid);
    }
    if (nj) run_mm(c, nj);
    /* Routed sum in selection order (the same order for prefill and decode). */
    for (int t = 0; t < T; t++) {
        float *out = c->mix + (size_t)t * hid;
        memset(out, 0, (size_t)hid * sizeof(float));
        for (int n = 0; n < k; n++) {
            const float wgt = c->selw[t * k + n];
            const float *y = c->yg + (size_t)c->row_of[t * k + n] * hid;
            for (int i = 0; i < hid; i++) out[i] += wgt * y[i];
        }
    }
    if (sh_inner > 0)
        for (size_t i = 0; i < (size_t)T * hid; i++) c->mix[i] += c->shared_out[i];
}

/* ------------------------------------------------------------------------ */
/* Whole model                                                               */

static kds_status check_ids(const eng_ctx *c, const int32_t *ids, int64_t n, kds_err *err) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= c->d.vocab)
            return kds_err_set(err, KDS_INVALID_ARG,
                               "token id %d at position %lld is outside the vocabulary [0, %d)",
                               ids[i], (long long)i, c->d.vocab);
    return KDS_OK;
}

/* Run T rows: T <= max_batch tokens of seqs[0] (n_seqs == 1), or one token
 * of each of seqs[0..T) (n_seqs == T, chunked == 0, logits NULL). logits:
 * NULL (only each sequence's last logits, computed when want_last) or
 * [T, vocab] (one sequence). Inputs are validated and the MLA caches
 * reserved by the callers. A prefill skips the lm_head of all but its final
 * batch: on small models that matrix is most of the bytes a batch reads. */
static void forward(eng_ctx *c, eng_seq *const *seqs, int n_seqs, const int32_t *ids, int T,
                    int chunked, float *logits, int want_last) {
    const eng_model *m = c->m;
    const eng_config *cfg = &m->cfg;
    const int hid = c->d.hidden;
    const size_t esz = kern_dtype_size(m->embed_tokens.dt);
    const int multi = n_seqs > 1;
    for (int t = 0; t < T; t++)
        kern_to_f32(m->embed_tokens.dt, (const char *)m->embed_tokens.data + (size_t)ids[t] * hid * esz,
                    c->x + (size_t)t * hid, (size_t)hid);
    for (int l = 0; l < cfg->num_hidden_layers; l++) {
        const eng_layer_weights *L = &m->layers[l];
        for (int t = 0; t < T; t++)
            kern_rmsnorm(c->x + (size_t)t * hid, L->input_layernorm, KERN_F32, hid,
                         cfg->rms_norm_eps, c->xn + (size_t)t * hid);
        if (L->kind == ENG_LAYER_KDA)
            kda_layer(c, seqs, n_seqs, L, c->d.layer_slot[l], T, chunked);
        else
            mla_layer(c, seqs, n_seqs, L, c->d.layer_slot[l], T);
        for (size_t i = 0; i < (size_t)T * hid; i++) c->x[i] += c->mix[i];
        for (int t = 0; t < T; t++)
            kern_rmsnorm(c->x + (size_t)t * hid, L->post_attention_layernorm, KERN_F32, hid,
                         cfg->rms_norm_eps, c->xn + (size_t)t * hid);
        if (L->ffn_kind == ENG_FFN_MOE)
            moe_ffn(c, &L->ffn, T);
        else
            dense_ffn(c, &L->ffn.gate_proj, &L->ffn.up_proj, &L->ffn.down_proj, c->xn, T, c->mix);
        for (size_t i = 0; i < (size_t)T * hid; i++) c->x[i] += c->mix[i];
    }
    for (int t = 0; t < T; t++) eng__seq_push_recent(seqs[multi ? t : 0], ids[t]);
    if (multi)
        for (int t = 0; t < T; t++) seqs[t]->pos++;
    else
        seqs[0]->pos += T;
    eng_seq *s = seqs[0];
    if (!logits && !want_last) {
        s->has_logits = 0; /* stale until the batch that ends the prefill */
        return;
    }
    /* Final norm and lm_head: every row when asked or across sequences,
     * else the last row only. */
    int first = logits || multi ? 0 : T - 1, n = T - first;
    for (int t = first; t < T; t++)
        kern_rmsnorm(c->x + (size_t)t * hid, m->final_norm, KERN_F32, hid, cfg->rms_norm_eps,
                     c->xn + (size_t)(t - first) * hid);
    float *dst = logits ? logits : multi ? c->logits : s->logits;
    job(c, 0, &m->lm_head, c->xn, n, dst, c->d.vocab);
    run_mm(c, 1);
    if (multi) {
        for (int t = 0; t < T; t++) {
            memcpy(seqs[t]->logits, c->logits + (size_t)t * c->d.vocab,
                   (size_t)c->d.vocab * sizeof(float));
            seqs[t]->has_logits = 1;
        }
        return;
    }
    if (logits) memcpy(s->logits, logits + (size_t)(T - 1) * c->d.vocab, (size_t)c->d.vocab * sizeof(float));
    s->has_logits = 1;
}

/* forward() where the context runs it: the host, or the GPU (eng_cuda.c). */
static kds_status run_forward(eng_ctx *c, eng_seq *const *seqs, int n_seqs, const int32_t *ids,
                              int T, int chunked, float *logits, int want_last, kds_err *err) {
    if (c->gpu) return eng__cuda_forward(c->gpu, seqs, n_seqs, ids, T, chunked, logits, want_last, err);
    /* a sequence last run on a GPU context continues here from its state */
    for (int i = 0; i < n_seqs; i++) {
        kds_status rc = eng__seq_fetch(seqs[i], err);
        if (rc != KDS_OK) return rc;
    }
    forward(c, seqs, n_seqs, ids, T, chunked, logits, want_last);
    for (int i = 0; i < n_seqs; i++) eng__seq_host_written(seqs[i]);
    return KDS_OK;
}

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
        rc = run_forward(c, &s, 1, ids + done, T, 1,
                         logits_all ? logits_all + (size_t)done * c->d.vocab : NULL, done + T == n,
                         err);
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
    return run_forward(c, &s, 1, &id, 1, 0, NULL, 1, err);
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
        if (!seqs[i]) return kds_err_set(err, KDS_INVALID_ARG, "sequence %d of the batch is NULL", i);
        if (seqs[i]->model != c->m)
            return kds_err_set(err, KDS_INVALID_ARG,
                               "sequence %d of the batch and the context belong to different models", i);
        /* n <= max_seqs, so the quadratic scan is a few thousand compares at most */
        for (int j = 0; j < i; j++)
            if (seqs[j] == seqs[i])
                return kds_err_set(err, KDS_INVALID_ARG,
                                   "sequence %d of the batch is the same as sequence %d "
                                   "(each sequence may appear once)", i, j);
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
    return run_forward(c, seqs, n, ids, n, 0, NULL, 1, err);
}

kds_status eng_decode_batch_sample(eng_ctx *c, eng_seq *const *seqs, const int32_t *ids, int n,
                                   const eng_sampler_params *p, int32_t *next, kds_err *err) {
    if (!p || (!next && n > 0))
        return kds_err_set(err, KDS_INVALID_ARG, "eng_decode_batch_sample without %s",
                           !p ? "sampler settings" : "an output array");
    kds_status rc = decode_batch_prepare(c, seqs, ids, n, err);
    if (rc != KDS_OK || n == 0) return rc;
    if (c->gpu && eng__cuda_sampler_takes(c->gpu, p))
        return eng__cuda_decode_sample(c->gpu, seqs, n, ids, p, next, err);
    if ((rc = run_forward(c, seqs, n, ids, n, 0, NULL, 1, err)) != KDS_OK) return rc;
    for (int i = 0; i < n && rc == KDS_OK; i++) rc = eng_sample(c, seqs[i], p, &next[i], err);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Context lifecycle                                                         */

static int max_cols(const eng_model *m) {
    int best = m->lm_head.cols;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        const eng_layer_weights *L = &m->layers[l];
        const eng_weight *ws[] = {&L->kda.o_proj,   &L->kda.f_b_proj,  &L->kda.g_b_proj,
                                  &L->mla.o_proj,   &L->mla.q_b_proj,  &L->ffn.down_proj,
                                  &L->ffn.sh_down,  &L->kda.q_proj};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
            if (ws[i]->cols > best) best = ws[i]->cols;
        if (L->ffn_kind == ENG_FFN_MOE && L->ffn.w2 && L->ffn.w2[0].cols > best) best = L->ffn.w2[0].cols;
    }
    return best;
}

kds_status eng_ctx_create(const eng_model *m, const eng_ctx_params *p, eng_ctx **out,
                          kds_err *err) {
    *out = NULL;
    eng_ctx_params def = eng_ctx_default_params();
    if (!p) p = &def;
    if (m->generated && !(p->device && strcmp(p->device, "cuda") == 0))
        return kds_err_set(err, KDS_UNSUPPORTED,
                           "model %s was generated for the GPU: its weights exist only there "
                           "(use device cuda)", m->dir);
    eng_ctx *c = calloc(1, sizeof *c);
    if (!c) return kds_err_set(err, KDS_NOMEM, "out of memory creating a context");
    c->m = m;
    eng__dims(&m->cfg, &c->d);
    const eng_dims *d = &c->d;
    const eng_config *cfg = &m->cfg;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    c->n_threads = p->n_threads > 0 ? p->n_threads : (online > 0 ? (int)online : 1);
    c->max_batch = p->max_batch > 0 ? p->max_batch : def.max_batch;
    c->kda_chunk = p->kda_chunk > 0 ? p->kda_chunk : def.kda_chunk;
    c->max_seqs = p->max_seqs > 0 ? p->max_seqs : def.max_seqs;
    c->top_k = cfg->num_experts > 0 ? cfg->num_experts_per_token : 1;
    c->n_experts = cfg->num_experts;
    int width = cfg->intermediate_size;
    if (cfg->num_experts > 0) {
        if (cfg->moe_intermediate_size > width) width = cfg->moe_intermediate_size;
        if (cfg->moe_intermediate_size * cfg->num_shared_experts > width)
            width = cfg->moe_intermediate_size * cfg->num_shared_experts;
    }
    c->ffn_width = width;
    /* a batched decode runs max_seqs rows through the same buffers */
    const size_t B = (size_t)(c->max_batch > c->max_seqs ? c->max_batch : c->max_seqs);
    const size_t Bk = B * (size_t)c->top_k;
    int rank = d->K > d->V ? d->K : d->V;
    for (int l = 0; l < cfg->num_hidden_layers; l++) {
        if (m->layers[l].kda.f_a_proj.rows > rank) rank = m->layers[l].kda.f_a_proj.rows;
        if (m->layers[l].kda.g_a_proj.rows > rank) rank = m->layers[l].kda.g_a_proj.rows;
    }
    if (cfg->q_lora_rank > rank) rank = cfg->q_lora_rank;
    size_t o_width = (size_t)d->kda_v;
    if ((size_t)d->mla_heads * d->dv > o_width && d->n_mla) o_width = (size_t)d->mla_heads * d->dv;
    int taps = d->W > 1 ? d->W - 1 : 0;
#define ALLOC(ptr, count)                                             \
    do {                                                              \
        (ptr) = calloc((size_t)(count) + 1, sizeof *(ptr));           \
        if (!(ptr)) goto nomem;                                       \
    } while (0)
    ALLOC(c->x, B * d->hidden);
    ALLOC(c->xn, B * d->hidden);
    ALLOC(c->mix, B * d->hidden);
    ALLOC(c->ext, (B + taps) * d->conv_ch);
    ALLOC(c->q, B * d->kda_qk);
    ALLOC(c->k, B * d->kda_qk);
    ALLOC(c->v, B * d->kda_v);
    ALLOC(c->fa, B * rank);
    ALLOC(c->ga, B * rank);
    ALLOC(c->g, B * d->HV * d->K);
    ALLOC(c->beta, B * d->HV);
    ALLOC(c->gz, B * d->kda_v);
    ALLOC(c->o, B * o_width);
    if (d->n_mla) {
        ALLOC(c->mq, B * d->mla_heads * (d->dn + d->dr));
        ALLOC(c->kva, B * d->mla_row);
    }
    /* routed rows [B*top_k, width] followed by the shared expert's [B, width] */
    ALLOC(c->fa_buf, (Bk + B) * width);
    ALLOC(c->fb_buf, (Bk + B) * width);
    ALLOC(c->shared_out, B * d->hidden);
    if (cfg->num_experts > 0) {
        ALLOC(c->router, B * cfg->num_experts);
        ALLOC(c->sel, Bk);
        ALLOC(c->selw, Bk);
        ALLOC(c->exp_off, cfg->num_experts + 1);
        ALLOC(c->exp_fill, cfg->num_experts);
        ALLOC(c->row_of, Bk);
        ALLOC(c->xg, Bk * d->hidden);
        ALLOC(c->yg, Bk * d->hidden);
    }
    ALLOC(c->logits, (size_t)c->max_seqs * d->vocab);
    ALLOC(c->cand_p, d->vocab);
    ALLOC(c->cand_id, d->vocab);
    ALLOC(c->ts, c->n_threads);
    kern_kda_shape sh = {d->H, d->HV, d->K, d->V, 1.0f};
    for (int i = 0; i < c->n_threads; i++) {
        ALLOC(c->ts[i].mm, kern_matmul_scratch_floats(max_cols(m)));
        if (d->n_kda) ALLOC(c->ts[i].kda_ws, kern_kda_chunked_workspace_floats(&sh, c->kda_chunk));
        if (d->n_mla) {
            ALLOC(c->ts[i].mla_w, (size_t)(d->dn + d->dv) * d->dc);
            kern_mla_shape msh = {d->mla_heads, d->dc, d->dr, d->dn, d->dv};
            ALLOC(c->ts[i].mla_ws, kern_mla_attend_head_workspace_floats(&msh, (int)B));
        }
    }
#undef ALLOC
    kds_status rc = eng_pool_create(c->n_threads, &c->pool, err);
    if (rc == KDS_OK && p->device && strcmp(p->device, "cpu") != 0) {
        if (strcmp(p->device, "cuda") == 0)
            rc = eng__cuda_create(m, c->max_batch, c->max_seqs, p->gpu_bf16, &c->gpu, err);
        else
            rc = kds_err_set(err, KDS_INVALID_ARG, "unknown device '%s' (cpu or cuda)", p->device);
    }
    if (rc != KDS_OK) {
        eng_ctx_free(c);
        return rc;
    }
    /* The pool parallelises over row blocks; BLAS threads would only fight it. */
    openblas_set_num_threads(1);
    *out = c;
    return KDS_OK;
nomem:
    eng_ctx_free(c);
    return kds_err_set(err, KDS_NOMEM,
                       "out of memory creating a context for %d tokens and %d sequences",
                       p->max_batch > 0 ? p->max_batch : def.max_batch,
                       p->max_seqs > 0 ? p->max_seqs : def.max_seqs);
}

void eng_ctx_free(eng_ctx *c) {
    if (!c) return;
    eng__cuda_free(c->gpu);
    eng_pool_free(c->pool);
    if (c->ts)
        for (int i = 0; i < c->n_threads; i++) {
            free(c->ts[i].mm);
            free(c->ts[i].kda_ws);
            free(c->ts[i].mla_w);
            free(c->ts[i].mla_ws);
        }
    float *bufs[] = {c->x,  c->xn, c->mix, c->ext, c->q,  c->k,      c->v,      c->fa,
                     c->ga, c->g,  c->beta, c->gz, c->o,  c->mq,     c->kva,    c->fa_buf,
                     c->fb_buf, c->shared_out, c->router, c->selw, c->xg, c->yg, c->cand_p,
                     c->logits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    free(c->sel);
    free(c->exp_off);
    free(c->exp_fill);
    free(c->row_of);
    free(c->cand_id);
    free(c->ts);
    free(c);
}

int eng_ctx_threads(const eng_ctx *c) { return c->n_threads; }

const char *eng_ctx_device(const eng_ctx *c) { return c->gpu ? "cuda" : "cpu"; }

eng_cuda *eng__ctx_gpu(const eng_ctx *c) { return c->gpu; }

int eng_ctx_max_seqs(const eng_ctx *c) { return c->max_seqs; }

kds_status eng_ctx_attach(eng_ctx *c, eng_seq *s, kds_err *err) {
    if (s->model != c->m)
        return kds_err_set(err, KDS_INVALID_ARG, "sequence and context belong to different models");
    return c->gpu ? eng__cuda_attach(c->gpu, s, err) : eng__seq_fetch(s, err);
}

/* ------------------------------------------------------------------------ */
/* Sampling                                                                  */

kds_status eng_sample(eng_ctx *c, eng_seq *s, const eng_sampler_params *p, int32_t *token,
                      kds_err *err) {
    /* logits a GPU decode left on the device are sampled there */
    if (c->gpu && s->gpu == c->gpu && s->logits_on_gpu && s->has_logits &&
        eng__cuda_sampler_takes(c->gpu, p))
        return eng__cuda_sample_one(c->gpu, s, p, token, err);
    kds_status rc = eng__seq_fetch_logits(s, err);
    if (rc != KDS_OK) return rc;
    if (!s->has_logits)
        return kds_err_set(err, KDS_INVALID_ARG, "nothing to sample from: the sequence is empty");
    /* the recent tokens, newest first, that the repetition penalty looks at */
    int32_t recent[ENG_RECENT_TOKENS];
    const int n = eng__seq_penalty_ids(s, p, recent);
    const kern_sample_params sp = {.temperature = p->temperature, .top_k = p->top_k,
                                   .top_p = p->top_p, .min_p = p->min_p,
                                   .repeat_penalty = p->repeat_penalty};
    /* kern_sample is also the reference of the CUDA sampler */
    *token = kern_sample(s->logits, c->d.vocab, &sp, recent, n, s->rng, c->cand_p, c->cand_id);
    return KDS_OK;
}
