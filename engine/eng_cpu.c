/*
 * eng_cpu.c - the CPU backend (eng_backend.h): every op on host memory, with
 * the context's fork-join pool and the kernels of kernels/cpu. It is the
 * exact reference the other backends are checked against.
 *
 * Parallelism: every matrix product is cut into row blocks of roughly equal
 * work (several products of one call go out in one dispatch); the KDA core
 * and MLA attention are split by head, the KDA per-token work by token,
 * a long pass's element-wise ops by rows or runs of 64 values.
 * OpenBLAS is pinned to one thread so that it never competes with the pool.
 * The cuts depend only on the shapes and the thread count, so a pass gives
 * the same bits every time.
 *
 * Memory: activations are host buffers (ops->alloc); the backend's own
 * scratch (per-thread widening and KDA / MLA workspaces, the accumulate
 * buffer, the batched logits, the sampler's candidates) is made at create,
 * so a pass allocates nothing.
 */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "eng_backend.h"
#include "eng_pool.h"
#include "kds_clock.h"

#define MAX_MM_JOBS 8
/* The job table's size: routed experts go out up to this many products
 * per dispatch (cpu_moe_experts); every other call (cpu_matmul) up to
 * MAX_MM_JOBS. */
#define MAX_MM_TABLE 64
#define MAX_MM_TASKS 1024
/* Largest short-conv width eng_config accepts (short_conv_kernel_size). */
#define MAX_CONV_W 64

typedef struct mm_task {
    int job, r0, r1;
} mm_task;

typedef struct thread_scratch {
    float *mm;     /* widened weight rows for BLAS */
    float *kda_ws; /* chunked KDA workspace */
    float *mla_w;  /* one head's kv_b rows, widened: [(dn+dv), dc] */
    float *mla_ws; /* kern_mla_attend_head workspace for B queries */
    float *mla_dec_ws; /* kern_mla_decode_rows workspace for mla_dec_rows rows */
} thread_scratch;

typedef struct eng_cpu {
    eng_backend base;
    const eng_model *m;
    eng_dims d;
    eng_pool *pool;
    int n_threads, kda_chunk, max_rows, max_seqs;
    int mla_dec_rows; /* the most rows one MLA decode task takes (mla_dec_split) */
    int64_t *mla_dec_pos;        /* [max_rows]: a decode pass's rows' positions (cpu_mla) */
    const float **mla_dec_cache; /* [max_rows]: and their latent caches of the layer */
    /* The pass being run is a prefill (eng_pass.chunked: one sequence's
     * tokens), whose products need not equal one-token products row for
     * row: they take kern_matmul_w_prefill's GEMM from fewer tokens. Taken
     * from the flag, not from n_seqs, so that an expert-parallel rank
     * holding none of the pass's rows computes its experts' products as
     * the owner would. */
    bool prefill;
    bool bf16_act;       /* eng_ctx_params.bf16_act: a prefill's bf16 products round x */
    /* A decoded token reads more weight bytes than half the last-level
     * cache, so every product's matrix comes from memory (kern_weight's
     * `streamed`: how the one-token product reads it; results unchanged).
     * Half, not all: the cache also holds the state, the activations and,
     * on a shared machine, other tenants' lines. llamacpp-tiny's token
     * (30.9 MB of weights against a 32 MiB L3, Zen 4 VM) decoded at
     * 742-828 tok/s with the from-cache loops, 1,350-1,628 taken as
     * streamed (docs/benchmarks.md, "A Zen 4 with AVX-512, side by side,
     * and short rows"). Models of 10 MB a token (models/default, tiny)
     * ran the same either way. */
    bool streamed;
    /* kern_weight's stream_prefetch for every product: this CPU's
     * (kern_stream_prefetch_bytes) */
    int stream_prefetch;
    /* kern_weight's prefetch_rows_ahead: this CPU's (kern_prefetch_rows_ahead) */
    bool prefetch_rows_ahead;
    /* A product profile (eng_ctx_profile_start .. stop), or NULL: seconds
     * in each matrix's product tasks, [n_threads, n_weights], each thread
     * adding to its own row; and the products and their token rows
     * dispatched, [n_weights], counted by the dispatching thread. */
    double *prof_busy;
    int64_t *prof_products, *prof_tokens;
    thread_scratch *ts;  /* [n_threads] */
    eng_matmul jobs[MAX_MM_TABLE];
    mm_task tasks[MAX_MM_TASKS];
    float *acc;          /* [max_rows, hidden]: an accumulating product's rows before the add */
    float *logits;       /* [max_seqs, vocab]: a batched pass's logits before they go to the seqs */
    float *cand_p;       /* [vocab]: the sampler's candidates */
    int32_t *cand_id;    /* [vocab] */
    void **allocs;       /* activation buffers */
    int n_allocs, cap_allocs;
} eng_cpu;

static eng_cpu *cpu_of(eng_backend *b) { return (eng_cpu *)b; }

/* Under bf16_act, a decode step's products of this many tokens and more
 * (a batched step's projections and lm_head, and routed experts that
 * several sequences chose) round x to bf16 (kern_matmul_w_bf16act):
 * there the exact f32 FMAs bound the step, while a product of one to
 * three tokens is bound by reading its matrix and stays exact. So a lone
 * decode is exact in either mode, and under bf16_act a sequence's
 * results in a batched step depend on how many share its experts (as
 * the GPU's products above 8 rows). */
#define BF16_DECODE_MIN_T 4

/* An op's contract was broken (a caller bug): recorded like any failure. */
static void internal(eng_cpu *c, const char *what) {
    if (c->base.rc != KDS_OK) return;
    eng__backend_note(&c->base, kds_err_set(&c->base.err, KDS_INTERNAL, "cpu backend: %s", what));
}

/* ------------------------------------------------------------------------ */
/* Matrix products on the pool                                               */

/* Ends a profile: its tables freed, the tasks untimed again. */
static void profile_end(eng_cpu *c) {
    free(c->prof_busy);
    free(c->prof_products);
    free(c->prof_tokens);
    c->prof_busy = NULL, c->prof_products = NULL, c->prof_tokens = NULL;
}

static void mm_task_run(eng_cpu *c, const mm_task *task, int thread);

static void mm_task_fn(void *arg, int t, int thread) {
    eng_cpu *c = arg;
    const mm_task *task = &c->tasks[t];
    if (!c->prof_busy) {
        mm_task_run(c, task, thread);
        return;
    }
    /* Two clock reads a task, against tasks of tens of microseconds and
     * more (a decode step's smallest products). */
    const double t0 = kds_now_s();
    mm_task_run(c, task, thread);
    const int id = c->jobs[task->job].w->id;
    if (id > 0 && id < c->m->n_weights)
        c->prof_busy[(size_t)thread * (size_t)c->m->n_weights + (size_t)id] += kds_now_s() - t0;
}

static void mm_task_run(eng_cpu *c, const mm_task *task, int thread) {
    const eng_matmul *j = &c->jobs[task->job];
    kern_weight w = eng__kern_weight(j->w);
    w.streamed = c->streamed;
    w.stream_prefetch = c->stream_prefetch;
    w.prefetch_rows_ahead = c->prefetch_rows_ahead;
    w.exact_tiles = !j->routed;
    if (c->prefill)
        kern_matmul_w_prefill(&w, j->x, j->T, j->y, j->ldy, task->r0, task->r1, c->ts[thread].mm,
                              c->bf16_act);
    else if (c->bf16_act && j->T >= BF16_DECODE_MIN_T)
        kern_matmul_w_bf16act(&w, j->x, j->T, j->y, j->ldy, task->r0, task->r1, c->ts[thread].mm);
    else
        kern_matmul_w(&w, j->x, j->T, j->y, j->ldy, task->r0, task->r1, c->ts[thread].mm);
}

/* Run the n_jobs products in c->jobs in one dispatch, cut into row blocks
 * of roughly equal work. Small totals run inline: a dispatch costs more
 * than a few thousand multiply-adds. The cuts are those of the products
 * with work_T[i] tokens (NULL: their own T): expert parallelism cuts a
 * rank's share of a batch as the whole batch would be cut, and runs only
 * the blocks of products it has tokens for (eng_moe_args.sched_rows). A
 * block's bits depend on its rows and tokens only, so equal cuts give equal
 * results wherever a block runs. */
/* The cut: tasks of about total / (n_threads * per_thread) multiply-adds,
 * each job's blocks starting on multiples of `align` rows. With 8 (element
 * formats: the direct path's eight-row groups) or 32 (block formats) every
 * row lands in the same row group whatever the cut, so a row's bits depend
 * neither on the thread count nor on the other products and tokens of the
 * dispatch: a batched decode step gives each sequence its lone decode's
 * bits. With 1, rows at a cut could fall to the single-row tail, whose sum
 * is reduced in another order. */
static void run_mm_cut(eng_cpu *c, int n_jobs, const int *work_T, int per_thread, int align) {
    if (c->prof_busy)
        for (int i = 0; i < n_jobs; i++) {
            const int id = c->jobs[i].w->id;
            if (c->jobs[i].T <= 0 || id <= 0 || id >= c->m->n_weights) continue;
            c->prof_products[id]++;
            c->prof_tokens[id] += c->jobs[i].T;
        }
    double total = 0;
    for (int i = 0; i < n_jobs; i++)
        total += (double)c->jobs[i].w->rows * c->jobs[i].w->cols * (work_T ? work_T[i] : c->jobs[i].T);
    int n_tasks = 0;
    if (c->n_threads == 1 || total < 65536.0) {
        for (int i = 0; i < n_jobs; i++)
            if (c->jobs[i].T > 0) c->tasks[n_tasks++] = (mm_task){i, 0, c->jobs[i].w->rows};
        for (int t = 0; t < n_tasks; t++) mm_task_fn(c, t, 0);
        return;
    }
    double target = total / (c->n_threads * (double)per_thread);
    if (target < 32768.0) target = 32768.0;
    int planned = 0; /* tasks of the whole batch's cut, run here or not */
    for (int i = 0; i < n_jobs; i++) {
        const eng_matmul *j = &c->jobs[i];
        int rows = j->w->rows;
        double work = (double)rows * j->w->cols * (work_T ? work_T[i] : j->T);
        int nb = (int)ceil(work / target);
        if (nb > rows) nb = rows;
        if (nb < 1) nb = 1;
        int room = MAX_MM_TASKS - planned - (n_jobs - i - 1);
        if (nb > room) nb = room;
        for (int b = 0; b < nb; b++) {
            int r0 = (int)((int64_t)rows * b / nb), r1 = (int)((int64_t)rows * (b + 1) / nb);
            if (align > 1) {
                r0 -= r0 % align;
                if (b + 1 < nb) r1 -= r1 % align;
            }
            if (r1 <= r0) continue;
            planned++;
            if (j->T > 0) c->tasks[n_tasks++] = (mm_task){i, r0, r1};
        }
    }
    if (n_tasks) eng_pool_run(c->pool, mm_task_fn, c, n_tasks);
}

/* Tasks a thread for a dispatch's products: four, so that a thread that
 * comes free early takes up the slack; two in a prefill, where each task
 * packs its tokens' x anew for every block of columns (kern__gemm's
 * pack_tokens: 2% of perf's samples in wide's prefill of 512 at four) and
 * the tasks are long enough to even out. wide, prefill of 512, best of
 * three, alternating (Zen 5): medians of five rounds 467 -> 478 tok/s,
 * of six 465 -> 477; full27 and llamacpp-tiny the same either way. */
static void run_mm_as(eng_cpu *c, int n_jobs, const int *work_T) {
    run_mm_cut(c, n_jobs, work_T, c->prefill ? 2 : 4, 8);
}

static void run_mm(eng_cpu *c, int n_jobs) { run_mm_as(c, n_jobs, NULL); }

/* An accumulating product runs into c->acc ([T, rows]) and is then added
 * to its destination: the same sums as a product followed by y += it. */
static void cpu_matmul(eng_backend *b, const eng_matmul *jobs, int n_jobs) {
    eng_cpu *c = cpu_of(b);
    if (b->rc != KDS_OK) return;
    if (n_jobs > MAX_MM_JOBS) {
        internal(c, "more than 8 products in one call");
        return;
    }
    int acc = -1;
    for (int i = 0; i < n_jobs; i++) {
        c->jobs[i] = jobs[i];
        if (!jobs[i].accumulate) continue;
        if (acc >= 0 || (size_t)jobs[i].T * jobs[i].w->rows > (size_t)c->max_rows * c->d.hidden) {
            internal(c, "an accumulating product it has no room for");
            return;
        }
        acc = i;
        c->jobs[i].y = c->acc;
        c->jobs[i].ldy = jobs[i].w->rows;
    }
    run_mm(c, n_jobs);
    if (acc < 0) return;
    const eng_matmul *j = &jobs[acc];
    const int rows = j->w->rows;
    for (int t = 0; t < j->T; t++) {
        float *y = j->y + (size_t)t * j->ldy;
        const float *a = c->acc + (size_t)t * rows;
        for (int r = 0; r < rows; r++) y[r] += a[r];
    }
}

/* ------------------------------------------------------------------------ */
/* Element-wise ops                                                          */

/* A prefill's element-wise ops touch millions of values (wide's SwiGLU
 * over 512 tokens: 4.7 M; its routed experts' gather and weighted sum:
 * 9.4 M each), and on one thread the other threads wait at the next join.
 * So from EW_SPLIT_MIN values on they go out on the pool as ranges of
 * whole rows, or of EW_GRAIN values (a multiple of every vector width, so
 * the last range ends on the same tail a single call would), each value
 * computed as one thread would: the bits do not depend on the cut. Below
 * that, a dispatch costs more than it saves (a decode step's ops). */
#define EW_SPLIT_MIN 65536
#define EW_GRAIN 64

typedef struct ew_split ew_split;
/* The op over items [i0, i1) (rows, tokens or values). */
typedef void (*ew_range_fn)(const ew_split *s, size_t i0, size_t i1);

struct ew_split {
    ew_range_fn range;
    size_t n, grain; /* items, and the ranges' multiple (1: whole rows) */
    int n_tasks;
    /* the op's operands, as each range function reads them */
    const eng_cpu *c;
    float *y;
    const float *x, *w;
    size_t width; /* values a row */
    float eps;
    const eng_moe_args *moe;
    const eng_attn_res_args *res;
};

static void ew_task(void *arg, int t, int thread) {
    (void)thread;
    const ew_split *s = arg;
    const size_t units = (s->n + s->grain - 1) / s->grain;
    const size_t u0 = units * (size_t)t / (size_t)s->n_tasks;
    const size_t u1 = units * (size_t)(t + 1) / (size_t)s->n_tasks;
    const size_t i0 = u0 * s->grain, i1 = u1 * s->grain < s->n ? u1 * s->grain : s->n;
    if (i1 > i0) s->range(s, i0, i1);
}

/* Runs s over its n items: on the pool when the op touches `values`
 * values or more, else on this thread. */
static void ew_run(const eng_cpu *c, ew_split *s, size_t values) {
    if (c->n_threads == 1 || values < EW_SPLIT_MIN || s->n < 2) {
        s->range(s, 0, s->n);
        return;
    }
    s->n_tasks = c->n_threads;
    eng_pool_run(c->pool, ew_task, s, s->n_tasks);
}

static void cpu_embed(eng_backend *b, const eng_pass *p, const eng_weight *table, float *x) {
    if (b->rc != KDS_OK) return;
    const kern_weight w = eng__kern_weight(table);
    for (int t = 0; t < p->T; t++)
        kern_weight_row_f32(&w, p->ids[t], 0, w.cols, x + (size_t)t * w.cols);
}

static void rmsnorm_rows(const ew_split *s, size_t r0, size_t r1) {
    for (size_t r = r0; r < r1; r++)
        kern_rmsnorm(s->x + r * s->width, s->w, KERN_F32, (int)s->width, s->eps,
                     s->y + r * s->width);
}

static void cpu_rmsnorm(eng_backend *b, const float *x, const float *w, int rows, int n, float eps,
                        float *y) {
    if (b->rc != KDS_OK) return;
    ew_split s = {.range = rmsnorm_rows, .n = (size_t)rows, .grain = 1, .y = y, .x = x, .w = w,
                  .width = (size_t)n, .eps = eps};
    ew_run(cpu_of(b), &s, (size_t)rows * (size_t)n);
}

/* The model's gated activation: SwiGLU, or K3's SiTU. */
static void act(const eng_config *cfg, float *a, const float *x, size_t n) {
    if (cfg->hidden_act == ENG_ACT_SITU)
        kern_situ(a, x, n, cfg->situ_beta, cfg->situ_linear_beta);
    else
        kern_swiglu(a, x, n);
}

static void act_values(const ew_split *s, size_t i0, size_t i1) {
    act(&s->c->m->cfg, s->y + i0, s->x + i0, i1 - i0);
}

/* act over n values, split as the element-wise ops are. */
static void act_split(const eng_cpu *c, float *a, const float *x, size_t n) {
    ew_split s = {.range = act_values, .n = n, .grain = EW_GRAIN, .c = c, .y = a, .x = x};
    ew_run(c, &s, n);
}

static void cpu_glu(eng_backend *b, float *a, const float *x, size_t n) {
    if (b->rc == KDS_OK) act_split(cpu_of(b), a, x, n);
}

static void sigmoid_mul_values(const ew_split *s, size_t i0, size_t i1) {
    kern_sigmoid_mul(s->y + i0, s->x + i0, i1 - i0);
}

static void cpu_sigmoid_mul(eng_backend *b, float *x, const float *g, size_t n) {
    if (b->rc != KDS_OK) return;
    ew_split s = {.range = sigmoid_mul_values, .n = n, .grain = EW_GRAIN, .y = x, .x = g};
    ew_run(cpu_of(b), &s, n);
}

/* Tokens [t0, t1) of the mix: each token's row is its own. */
static void attn_res_tokens(const ew_split *s, size_t t0, size_t t1) {
    const eng_attn_res_args *a = s->res;
    const size_t D = s->width;
    kern_attn_res_mix((int)(t1 - t0), (int)D, a->blocks + t0 * D, a->block_stride, a->n_blocks,
                      a->partial ? a->partial + t0 * D : NULL, a->u, s->eps, a->out + t0 * D);
}

static void cpu_attn_res(eng_backend *b, const eng_attn_res_args *a) {
    eng_cpu *c = cpu_of(b);
    if (b->rc != KDS_OK) return;
    ew_split s = {.range = attn_res_tokens, .n = (size_t)a->T, .grain = 1, .res = a,
                  .width = (size_t)c->d.hidden, .eps = c->m->cfg.rms_norm_eps};
    ew_run(c, &s, (size_t)a->T * (size_t)(a->n_blocks + 1) * (size_t)c->d.hidden);
}

static void add_values(const ew_split *s, size_t i0, size_t i1) {
    for (size_t i = i0; i < i1; i++) s->y[i] += s->x[i];
}

static void cpu_add(eng_backend *b, float *y, const float *x, size_t n) {
    if (b->rc != KDS_OK) return;
    ew_split s = {.range = add_values, .n = n, .grain = EW_GRAIN, .y = y, .x = x};
    ew_run(cpu_of(b), &s, n);
}

/* ------------------------------------------------------------------------ */
/* KDA                                                                       */

typedef struct kda_run {
    eng_cpu *c;
    const eng_kda_args *a;
    float *state;         /* [HV, K, V] of this layer (one sequence; NULL across sequences) */
    eng_seq *const *seqs; /* row t belongs to seqs[t] when n_seqs > 1 */
    int n_seqs, T, chunked, n_parts;
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
/* The taps of token t's short convolution: taps + 1 rows of conv_ch
 * values, oldest first (a batch of sequences: t's own tail, then its input
 * row in a->ext; one sequence: rows t .. t + taps of a->ext). */
static void conv_taps(const kda_run *r, int t, const float **tap) {
    const eng_dims *d = &r->c->d;
    const int C = d->conv_ch, taps = d->W - 1;
    if (r->n_seqs > 1) {
        const float *tail = r->seqs[t]->conv_tail + (size_t)r->a->layer * taps * C;
        for (int j = 0; j < taps; j++) tap[j] = tail + (size_t)j * C;
        tap[taps] = r->a->ext + (size_t)(taps + t) * C;
    } else {
        for (int j = 0; j <= taps; j++) tap[j] = r->a->ext + (size_t)(t + j) * C;
    }
}

/* Channels per block of kda_pre_fn's convolution: the block's weights,
 * transposed to [W, CONV_BLOCK], stay in L1 over the part's tokens. */
#define CONV_BLOCK 64

static void kda_pre_fn(void *arg, int part, int thread) {
    (void)thread;
    kda_run *r = arg;
    const eng_dims *d = &r->c->d;
    const eng_kda_args *a = r->a;
    const eng_kda_weights *w = a->w;
    const int C = d->conv_ch, taps = d->W - 1, W = d->W;
    int t0 = (int)((int64_t)r->T * part / r->n_parts), t1 = (int)((int64_t)r->T * (part + 1) / r->n_parts);
    /* q, k and v through their depthwise convolutions. Each channel's sum
     * is 0 + w_0 x_0 + w_1 x_1 + ... in tap order, a product then a sum
     * each rounded (C11: no contraction), as one channel at a time gave
     * it; here sixteen and more channels go at once, the weights of a
     * block of channels transposed so that a tap's are contiguous. */
    for (int which = 0; which < 3; which++) {
        const int base = which == 0 ? 0 : which == 1 ? d->kda_qk : 2 * d->kda_qk;
        const int n = which == 2 ? d->kda_v : d->kda_qk;
        const float *wc = which == 0 ? w->q_conv : which == 1 ? w->k_conv : w->v_conv;
        float *out = which == 0 ? a->q : which == 1 ? a->k : a->v;
        for (int c0 = 0; c0 < n; c0 += CONV_BLOCK) {
            const int nc = n - c0 < CONV_BLOCK ? n - c0 : CONV_BLOCK;
            float wt[MAX_CONV_W][CONV_BLOCK];
            for (int j = 0; j < W; j++)
                for (int c = 0; c < nc; c++) wt[j][c] = wc[(size_t)(c0 + c) * W + j];
            for (int t = t0; t < t1; t++) {
                const float *tap[MAX_CONV_W];
                conv_taps(r, t, tap);
                float acc[CONV_BLOCK];
                for (int c = 0; c < nc; c++) acc[c] = 0.0f;
                for (int j = 0; j < W; j++) {
                    const float *x = tap[j] + base + c0;
                    for (int c = 0; c < nc; c++) acc[c] += wt[j][c] * x[c];
                }
                memcpy(out + (size_t)t * n + c0, acc, (size_t)nc * sizeof(float));
            }
        }
        for (int t = t0; t < t1; t++) kern_silu(out + (size_t)t * n, (size_t)n);
    }
    if (r->n_seqs > 1 && taps > 0)
        for (int t = t0; t < t1; t++) {
            float *tail = r->seqs[t]->conv_tail + (size_t)a->layer * taps * C;
            memmove(tail, tail + C, (size_t)(taps - 1) * C * sizeof(float));
            memcpy(tail + (size_t)(taps - 1) * C, a->ext + (size_t)(taps + t) * C,
                   (size_t)C * sizeof(float));
        }
    int n = t1 - t0;
    if (n <= 0) return;
    kern_l2norm(a->q + (size_t)t0 * d->kda_qk, n * d->H, d->K, 1e-6f);
    kern_l2norm(a->k + (size_t)t0 * d->kda_qk, n * d->H, d->K, 1e-6f);
    float *g = a->g + (size_t)t0 * d->HV * d->K;
    kern_kda_gate(g, w->A_log, w->dt_bias, n, d->HV, d->K, a->lower_bound, g);
    kern_sigmoid_inplace(a->beta + (size_t)t0 * d->HV, (size_t)n * d->HV);
}

/* Gated output norm of rows [t0, t1), value head hv:
 * o * rsqrt(mean(o^2) + eps) * w * sigmoid(z). */
static void kda_out_norm(const kda_run *r, int hv, int t0, int t1) {
    const eng_dims *d = &r->c->d;
    const eng_kda_args *a = r->a;
    for (int t = t0; t < t1; t++) {
        size_t at = ((size_t)t * d->HV + hv) * d->V;
        float *oh = a->o + at, *z = a->gz + at;
        kern_rmsnorm(oh, a->w->o_norm, KERN_F32, d->V, a->eps, oh);
        kern_sigmoid_inplace(z, (size_t)d->V);
        for (int e = 0; e < d->V; e++) oh[e] *= z[e];
    }
}

/* One sequence: the core for value head `task` over all T tokens, then that
 * head's output norm. Across sequences: task = t * HV + hv, one decode step
 * of row t's sequence for head hv (the same call eng_decode makes). */
static void kda_core_fn(void *arg, int task, int thread) {
    kda_run *r = arg;
    eng_cpu *c = r->c;
    const eng_dims *d = &c->d;
    const eng_kda_args *a = r->a;
    kern_kda_shape sh = {d->H, d->HV, d->K, d->V, 1.0f / sqrtf((float)d->K)};
    if (r->n_seqs > 1) {
        const int t = task / d->HV, hv = task % d->HV;
        float *state = r->seqs[t]->kda_state + (size_t)a->layer * d->HV * d->K * d->V;
        kern_kda_recurrent(&sh, 1, a->q + (size_t)t * d->kda_qk, a->k + (size_t)t * d->kda_qk,
                           a->v + (size_t)t * d->kda_v, a->g + (size_t)t * d->HV * d->K,
                           a->beta + (size_t)t * d->HV, state, a->o + (size_t)t * d->kda_v, hv,
                           hv + 1);
        kda_out_norm(r, hv, t, t + 1);
        return;
    }
    const int hv = task;
    if (r->chunked)
        kern_kda_chunked(&sh, r->T, c->kda_chunk, a->q, a->k, a->v, a->g, a->beta, r->state, a->o,
                         hv, hv + 1, c->ts[thread].kda_ws);
    else
        kern_kda_recurrent(&sh, r->T, a->q, a->k, a->v, a->g, a->beta, r->state, a->o, hv, hv + 1);
    kda_out_norm(r, hv, 0, r->T);
}

/* p->seqs: one sequence with T tokens, or T sequences with one each (then
 * the recurrence). */
static void cpu_kda(eng_backend *b, const eng_pass *p, const eng_kda_args *a) {
    eng_cpu *c = cpu_of(b);
    if (b->rc != KDS_OK) return;
    const eng_dims *d = &c->d;
    const int C = d->conv_ch, taps = d->W - 1, T = p->T;
    const int multi = p->n_seqs > 1;
    float *conv_tail = multi ? NULL : p->seqs[0]->conv_tail + (size_t)a->layer * taps * C;
    if (!multi) memcpy(a->ext, conv_tail, (size_t)taps * C * sizeof(float));
    float *state = multi ? NULL : p->seqs[0]->kda_state + (size_t)a->layer * d->HV * d->K * d->V;
    kda_run r = {c, a, state, p->seqs, p->n_seqs, T, p->chunked && !multi, 1};
    /* A part per thread once there is enough per-token work to pay for it. */
    if (c->n_threads > 1 && (double)T * C >= 16384.0) {
        r.n_parts = T < c->n_threads * 4 ? T : c->n_threads * 4;
        eng_pool_run(c->pool, kda_pre_fn, &r, r.n_parts);
    } else {
        kda_pre_fn(&r, 0, 0);
    }
    if (!multi) memcpy(conv_tail, a->ext + (size_t)T * C, (size_t)taps * C * sizeof(float));
    int n_tasks = multi ? T * d->HV : d->HV;
    if ((double)T * d->HV * d->K * d->V < 65536.0 || c->n_threads == 1)
        for (int i = 0; i < n_tasks; i++) kda_core_fn(&r, i, 0);
    else
        eng_pool_run(c->pool, kda_core_fn, &r, n_tasks);
}

/* ------------------------------------------------------------------------ */
/* MLA (absorbed form, spec §5.2; no RoPE)                                   */

typedef struct mla_run {
    eng_cpu *c;
    const eng_pass *p;
    const eng_mla_args *a;
} mla_run;

/* One head of a prefill slice (T rows of one sequence; decode steps go to
 * mla_decode_fn): widen the head's kv_b rows once, then attend the slice. */
static void mla_head_fn(void *arg, int h, int thread) {
    mla_run *r = arg;
    eng_cpu *c = r->c;
    const eng_dims *d = &c->d;
    const eng_mla_args *a = r->a;
    thread_scratch *ts = &c->ts[thread];
    const int dc = d->dc, dn = d->dn, dr = d->dr, dv = d->dv;
    const kern_mla_shape sh = {d->mla_heads, dc, dr, dn, dv};
    /* W_UK_h = rows [h*(dn+dv), +dn) of kv_b_proj [nh*(dn+dv), dc], W_UV_h the next dv rows */
    const kern_weight kvb = eng__kern_weight(&a->w->kv_b_proj);
    for (int i = 0; i < dn + dv; i++)
        kern_weight_row_f32(&kvb, h * (dn + dv) + i, 0, dc, ts->mla_w + (size_t)i * dc);
    const float *wuk = ts->mla_w, *wuv = ts->mla_w + (size_t)dn * dc;
    const size_t qstride = (size_t)d->mla_heads * (dn + dr), ostride = (size_t)d->mla_heads * dv;
    const eng_seq *s = r->p->seqs[0];
    kern_mla_attend_head(&sh, wuk, wuv, a->q + (size_t)h * (dn + dr), (int)qstride, r->p->T,
                         s->pos, s->mla_cache[a->layer], a->o + (size_t)h * dv, (int)ostride,
                         c->bf16_act && c->prefill, ts->mla_ws);
}

/* Decode (one row per sequence): task = block * n_groups + head group,
 * a block being consecutive rows. A task widens each kv_b row of its heads
 * once for all its rows (kv_b is 8 MB in bf16 at Kimi-Linear's shape, so a
 * task per row read it once per sequence), and each group's heads attend
 * together, so a row's cache is read once per group. */
typedef struct mla_dec_run {
    eng_cpu *c;
    const eng_pass *p;
    const eng_mla_args *a;
    int T, n_blocks, n_groups;
} mla_dec_run;

/* The split of T decode rows: as many blocks as threads, so kv_b is read
 * once a thread (blocks differ by a row at most: with T not a multiple of
 * the threads one waits on a row's attention, not on another read of kv_b);
 * with fewer rows than threads a block per row and the heads in groups, the
 * fewest that split the tasks evenly among the threads or give each four. */
static void mla_dec_split(const eng_cpu *c, int T, int *n_blocks, int *n_groups) {
    *n_blocks = T < c->n_threads ? T : c->n_threads;
    while ((T + *n_blocks - 1) / *n_blocks > c->mla_dec_rows) (*n_blocks)++; /* the workspace's */
    *n_groups = 1;
    if (c->n_threads > 1)
        while (*n_groups < c->d.mla_heads && (*n_blocks * *n_groups) % c->n_threads != 0 &&
               *n_blocks * *n_groups < 4 * c->n_threads)
            (*n_groups)++;
}

static void mla_decode_fn(void *arg, int task, int thread) {
    mla_dec_run *r = arg;
    eng_cpu *c = r->c;
    const eng_dims *d = &c->d;
    const eng_mla_args *a = r->a;
    const int nh = d->mla_heads, b = task / r->n_groups, g = task % r->n_groups;
    const int h0 = nh * g / r->n_groups, h1 = nh * (g + 1) / r->n_groups;
    const int t0 = r->T * b / r->n_blocks, t1 = r->T * (b + 1) / r->n_blocks;
    const kern_mla_shape sh = {nh, d->dc, d->dr, d->dn, d->dv};
    const kern_weight kvb = eng__kern_weight(&a->w->kv_b_proj);
    kern_mla_decode_rows(&sh, &kvb, t1 - t0, a->q + (size_t)t0 * nh * (d->dn + d->dr), h0, h1,
                         c->mla_dec_pos + t0, c->mla_dec_cache + t0,
                         a->o + (size_t)t0 * nh * d->dv, c->ts[thread].mla_dec_ws);
}

static void cpu_mla(eng_backend *b, const eng_pass *p, const eng_mla_args *a) {
    eng_cpu *c = cpu_of(b);
    if (b->rc != KDS_OK) return;
    const eng_dims *d = &c->d;
    const int T = p->T, multi = p->n_seqs > 1;
    /* Each row's latent [norm(c) | k_pe] goes to its sequence's cache at
     * that sequence's position (row t of one sequence: position pos + t). */
    for (int t = 0; t < T; t++) {
        const eng_seq *s = p->seqs[multi ? t : 0];
        const float *kva = a->kva + (size_t)t * d->mla_row;
        float *dst = s->mla_cache[a->layer] + (size_t)(s->pos + (multi ? 0 : t)) * d->mla_row;
        kern_rmsnorm(kva, a->w->kv_a_layernorm, KERN_F32, d->dc, a->eps, dst);
        memcpy(dst + d->dc, kva + d->dc, (size_t)d->dr * sizeof(float));
    }
    if (multi || T == 1) {
        /* one query per sequence: a task per (block of rows, head group) */
        for (int t = 0; t < T; t++) {
            const eng_seq *s = p->seqs[multi ? t : 0];
            c->mla_dec_pos[t] = s->pos;
            c->mla_dec_cache[t] = s->mla_cache[a->layer];
        }
        mla_dec_run r = {c, p, a, T, 1, 1};
        mla_dec_split(c, T, &r.n_blocks, &r.n_groups);
        const int n_tasks = r.n_blocks * r.n_groups;
        if (c->n_threads == 1 || n_tasks == 1)
            for (int i = 0; i < n_tasks; i++) mla_decode_fn(&r, i, 0);
        else
            eng_pool_run(c->pool, mla_decode_fn, &r, n_tasks);
        return;
    }
    /* a prefill slice of one sequence: a task per head */
    mla_run r = {c, p, a};
    if (c->n_threads == 1)
        for (int h = 0; h < d->mla_heads; h++) mla_head_fn(&r, h, 0);
    else
        eng_pool_run(c->pool, mla_head_fn, &r, d->mla_heads);
}

/* ------------------------------------------------------------------------ */
/* MoE (spec §6.2)                                                           */

/* Gathered rows [r0, r1): the token each comes from. */
static void gather_rows(const ew_split *s, size_t r0, size_t r1) {
    const eng_moe_args *a = s->moe;
    for (size_t r = r0; r < r1; r++)
        memcpy(a->xg + r * s->width, a->xs + (size_t)a->tok_of[r] * s->width,
               s->width * sizeof(float));
}

/* Selection uses score + bias (and the group limit); weights use the score
 * alone (project decision, spec §10 Q1). kern_moe_route and
 * kern_moe_permute are also the references of the CUDA routing kernels. */
static void cpu_moe_route(eng_backend *b, const eng_moe_args *a) {
    eng_cpu *c = cpu_of(b);
    if (b->rc != KDS_OK) return;
    const eng_config *cfg = &c->m->cfg;
    const int E = cfg->num_experts, k = cfg->num_experts_per_token, T = a->T, X = a->X;
    for (size_t i = 0; i < (size_t)T * E; i++) a->router[i] = kern_sigmoid(a->router[i]);
    const kern_moe_route_params rp = {
        .n_experts = E,
        .top_k = k,
        .n_group = cfg->use_grouped_topk && cfg->num_expert_group > 1 ? cfg->num_expert_group : 1,
        .topk_group = cfg->topk_group,
        .renormalize = cfg->moe_renormalize,
        .routed_scaling_factor = cfg->routed_scaling_factor};
    kern_moe_route(&rp, T, a->router, a->f->router_bias, a->sel, a->selw);
    kern_moe_permute(E, T, k, a->sel, a->exp_off, a->row_of, a->tok_of);
    /* each expert's tokens into a contiguous block of xg */
    ew_split s = {.range = gather_rows, .n = (size_t)T * k, .grain = 1, .moe = a, .width = X};
    ew_run(c, &s, (size_t)T * k * X);
}

/* A product for the next dispatch; work_T: the tokens its cut is planned
 * for (eng_moe_args.sched_rows), T: the tokens it has here (0: none, the
 * product is only planned). */
static void add_job(eng_cpu *c, int *nj, int *work_T, const eng_weight *w, const float *x, int T,
                    int plan_T, float *y, int ldy, bool routed) {
    work_T[*nj] = plan_T;
    c->jobs[(*nj)++] = (eng_matmul){w, x, T, y, ldy, false, routed};
}

/* The routed experts over their gathered rows and the shared expert over
 * the tokens. The shared expert's rows live after the routed ones in the
 * scratch, so its products join the routed experts' dispatches and one
 * SwiGLU covers both; each expert's weights stream once per call. Under
 * expert parallelism the dispatches are those of the whole batch
 * (a->sched_rows): an expert another rank holds is planned, not run. */
static void cpu_moe_experts(eng_backend *b, const eng_moe_args *a) {
    eng_cpu *c = cpu_of(b);
    if (b->rc != KDS_OK) return;
    const eng_config *cfg = &c->m->cfg;
    const eng_ffn_weights *f = a->f;
    const int E = cfg->num_experts, hid = c->d.hidden, T = a->T;
    const int inner = cfg->moe_intermediate_size, X = a->X;
    const int sh_inner = f->sh_gate.rows; /* 0 without shared experts */
    const int plan_T = a->sched_rows ? a->sched_T : T;
    const size_t routed = (size_t)a->exp_off[E]; /* T * k on one rank */
    float *sh_a = a->act_a + routed * inner, *sh_b = a->act_b + routed * inner;
    /* Block-format experts (MXFP4, Q8_0): all of a projection's products in
     * one dispatch, cut 16 tasks a thread on 32-row boundaries. Their
     * decode product is bound by decoding codes, not by memory, so a thread
     * that waits at one of eight joins per layer (top-16 in dispatches of
     * at most 8 products) is time the other cannot make up; one join per
     * projection and small tasks leave the threads at most a small task
     * apart. Each row's sums do not depend on the cut (32-row boundaries:
     * every block of rows is whole eight-row groups and prefill panels).
     * Element formats keep run_mm_as's cut on eight-row boundaries, and
     * go in one dispatch per projection too: each expert's product is then
     * a task or a few, taken as threads come free, where dispatches of
     * eight left a thread waiting at each of nine joins a layer for the
     * other's last expert (the GEMM's sums do not depend on the cut, nor
     * do the decode's row loops on eight-row boundaries). Prefill: wide
     * --bf16 374-379 -> 386-395 tok/s. Decode, two joins a MoE layer
     * instead of five (a Zen 5, wide): the threads' waits at joins 4.8-5.7%
     * -> 3.5-4.4% of perf's samples, tok/s within the machine's noise
     * (medians of four runs alternating 25.1-28.2 -> 25.6-28.6). */
    const bool block = E > 0 && kern_dtype_is_block(f->w1[0].dt);
    const int per_thread = block ? 16 : 4, align = block ? 32 : 8;
    int work_T[MAX_MM_TABLE];
    /* Up projections of all active experts and the shared expert, in as few
     * dispatches as the job table allows. */
    int nj = 0;
    if (sh_inner > 0) {
        add_job(c, &nj, work_T, &f->sh_gate, a->x, T, plan_T, sh_a, sh_inner, false);
        add_job(c, &nj, work_T, &f->sh_up, a->x, T, plan_T, sh_b, sh_inner, false);
    }
    for (int e = 0; e < E; e++) {
        int n_e = a->exp_off[e + 1] - a->exp_off[e];
        int plan_e = a->sched_rows ? a->sched_rows[e] : n_e;
        if (plan_e == 0) continue;
        if (nj + 2 > MAX_MM_TABLE) {
            run_mm_cut(c, nj, work_T, per_thread, align);
            nj = 0;
        }
        size_t off = (size_t)a->exp_off[e];
        add_job(c, &nj, work_T, &f->w1[e], a->xg + off * X, n_e, plan_e, a->act_a + off * inner,
                inner, true);
        add_job(c, &nj, work_T, &f->w3[e], a->xg + off * X, n_e, plan_e, a->act_b + off * inner,
                inner, true);
    }
    if (nj) run_mm_cut(c, nj, work_T, per_thread, align);
    act_split(c, a->act_a, a->act_b, routed * inner + (size_t)T * sh_inner);
    nj = 0;
    if (sh_inner > 0)
        add_job(c, &nj, work_T, &f->sh_down, sh_a, T, plan_T, a->shared_out, hid, false);
    for (int e = 0; e < E; e++) {
        int n_e = a->exp_off[e + 1] - a->exp_off[e];
        int plan_e = a->sched_rows ? a->sched_rows[e] : n_e;
        if (plan_e == 0) continue;
        if (nj + 1 > MAX_MM_TABLE) {
            run_mm_cut(c, nj, work_T, per_thread, align);
            nj = 0;
        }
        size_t off = (size_t)a->exp_off[e];
        add_job(c, &nj, work_T, &f->w2[e], a->act_a + off * inner, n_e, plan_e, a->yg + off * X, X,
                true);
    }
    if (nj) run_mm_cut(c, nj, work_T, per_thread, align);
}

/* Routed sum in selection order (the same order for prefill and decode),
 * then the shared expert's output. */
static void combine_tokens(const ew_split *s, size_t t0, size_t t1) {
    const eng_moe_args *a = s->moe;
    const int k = s->c->m->cfg.num_experts_per_token;
    const size_t X = s->width;
    for (size_t t = t0; t < t1; t++) {
        float *out = a->out + t * X;
        memset(out, 0, X * sizeof(float));
        for (int n = 0; n < k; n++) {
            const float wgt = a->selw[t * k + n];
            const float *y = a->yg + (size_t)a->row_of[t * k + n] * X;
            for (size_t i = 0; i < X; i++) out[i] += wgt * y[i];
        }
        if (a->add_shared)
            for (size_t i = 0; i < X; i++) out[i] += a->shared_out[t * X + i];
    }
}

static void cpu_moe_combine(eng_backend *b, const eng_moe_args *a) {
    eng_cpu *c = cpu_of(b);
    if (b->rc != KDS_OK) return;
    const size_t k = (size_t)c->m->cfg.num_experts_per_token;
    ew_split s = {.range = combine_tokens, .n = (size_t)a->T, .grain = 1, .c = c, .moe = a,
                  .width = (size_t)a->X};
    ew_run(c, &s, (size_t)a->T * (k + 1) * (size_t)a->X);
}

/* ------------------------------------------------------------------------ */
/* Passes, logits, sampling, residency                                       */

/* A sequence last run on a device continues here from its state: its host
 * copy is brought up to date first, and marked written after. */
static kds_status cpu_run(eng_backend *b, const eng_pass *p, eng_pass_fn fn, void *arg,
                          kds_err *err) {
    eng_cpu *c = cpu_of(b);
    for (int i = 0; i < p->n_seqs; i++) {
        kds_status rc = eng__seq_fetch(p->seqs[i], err);
        if (rc != KDS_OK) return rc;
    }
    b->rc = KDS_OK;
    c->prefill = p->chunked;
    fn(arg, p);
    c->prefill = false;
    if (b->rc != KDS_OK) {
        if (err) *err = b->err;
        return b->rc;
    }
    const size_t row = (size_t)c->d.vocab * sizeof(float);
    if (p->first < p->T) {
        if (p->n_seqs > 1)
            for (int t = 0; t < p->T; t++) memcpy(p->seqs[t]->logits, c->logits + (size_t)t * c->d.vocab, row);
        else if (p->logits)
            memcpy(p->seqs[0]->logits, p->logits + (size_t)(p->T - 1) * c->d.vocab, row);
    }
    for (int i = 0; i < p->n_seqs; i++) eng__seq_host_written(p->seqs[i]);
    return KDS_OK;
}

/* Straight into the caller's buffer, else the sequence's own row (one
 * sequence), else the batched rows (copied to the sequences after). */
static float *cpu_logits_rows(eng_backend *b, const eng_pass *p) {
    eng_cpu *c = cpu_of(b);
    if (p->logits) return p->logits;
    return p->n_seqs > 1 ? c->logits : p->seqs[0]->logits;
}

static kds_status cpu_sample(eng_backend *b, eng_seq *const *seqs, int n,
                             const eng_sampler_params *p, int32_t *tokens, kds_err *err) {
    eng_cpu *c = cpu_of(b);
    for (int i = 0; i < n; i++) {
        if (!seqs[i]->has_logits)
            return kds_err_set(err, KDS_INVALID_ARG, "nothing to sample from: the sequence is empty");
        tokens[i] = eng__sample_host(seqs[i], &p[i], c->cand_p, c->cand_id);
    }
    return KDS_OK;
}

static kds_status cpu_attach(eng_backend *b, eng_seq *s, kds_err *err) {
    (void)b;
    return eng__seq_fetch(s, err);
}

/* The CPU never holds a sequence's state: its host buffers are the state. */
static kds_status cpu_fetch(eng_backend *b, eng_seq *s, bool logits_only, kds_err *err) {
    (void)b, (void)s, (void)logits_only, (void)err;
    return KDS_OK;
}

static void cpu_detach(eng_backend *b, eng_seq *s) { (void)b, (void)s; }

/* ------------------------------------------------------------------------ */
/* Lifecycle                                                                 */

/* The CPU runs every op on every format; only a model generated for a
 * device (its matrices exist only there) cannot run here. */
static bool cpu_supports(const eng_model *m, const eng_op_query *q, kds_err *why) {
    if (q->w && q->w->rows > 0 && !q->w->data) {
        kds_err_set(why, KDS_UNSUPPORTED,
                    "model %s was generated for the GPU: its weights exist only there "
                    "(use device cuda)", m->dir);
        return false;
    }
    return true;
}

static void *cpu_alloc(eng_backend *b, size_t bytes) {
    eng_cpu *c = cpu_of(b);
    if (c->n_allocs == c->cap_allocs) {
        int cap = c->cap_allocs ? 2 * c->cap_allocs : 64;
        void **a = realloc(c->allocs, (size_t)cap * sizeof *a);
        if (!a) return NULL;
        c->allocs = a;
        c->cap_allocs = cap;
    }
    /* On a cache line, so the vector kernels' loads of a row never straddle
     * two (a buffer's placement would otherwise vary with the heap), and
     * cleared; the extra line: ops may read a vector's last lane whole. */
    const size_t n = (bytes + 64 + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, n);
    if (!p) return NULL;
    memset(p, 0, n);
    c->allocs[c->n_allocs++] = p;
    return p;
}

static void cpu_free(eng_backend *b) {
    eng_cpu *c = cpu_of(b);
    if (!c) return;
    eng_pool_free(c->pool);
    if (c->ts)
        for (int i = 0; i < c->n_threads; i++) {
            free(c->ts[i].mm);
            free(c->ts[i].kda_ws);
            free(c->ts[i].mla_w);
            free(c->ts[i].mla_ws);
            free(c->ts[i].mla_dec_ws);
        }
    free(c->ts);
    profile_end(c);
    for (int i = 0; i < c->n_allocs; i++) free(c->allocs[i]);
    free(c->allocs);
    free(c->acc);
    free(c->logits);
    free(c->mla_dec_pos);
    free(c->mla_dec_cache);
    free(c->cand_p);
    free(c->cand_id);
    free(c);
}

static kds_status cpu_create(const eng_model *m, const eng_ctx_params *p, eng_backend **out,
                             kds_err *err) {
    *out = NULL;
    eng_cpu *c = calloc(1, sizeof *c);
    if (!c) return kds_err_set(err, KDS_NOMEM, "out of memory creating a context");
    c->base.ops = &eng__cpu_ops;
    c->m = m;
    eng__dims(&m->cfg, &c->d);
    const eng_dims *d = &c->d;
    c->n_threads = p->n_threads > 0 ? p->n_threads : eng_cpus_online(0);
    c->kda_chunk = p->kda_chunk;
    c->bf16_act = p->bf16_act;
    c->max_seqs = p->max_seqs;
    c->max_rows = p->max_batch > p->max_seqs ? p->max_batch : p->max_seqs;
    c->mla_dec_rows =
        c->max_seqs > c->n_threads ? (c->max_seqs + c->n_threads - 1) / c->n_threads : 1;
    const size_t llc = eng_llc_bytes();
    c->streamed =
        eng_model_decode_bytes(m, 0).weights > 0.5 * (double)(llc ? llc : (size_t)32 << 20);
    c->stream_prefetch = kern_stream_prefetch_bytes();
    c->prefetch_rows_ahead = kern_prefetch_rows_ahead();
    int widest = 1; /* the most inputs of any matrix: the widening scratch */
    for (int i = 1; i < m->n_weights; i++)
        if (m->weights[i]->cols > widest) widest = m->weights[i]->cols;
    c->acc = calloc((size_t)c->max_rows * d->hidden + 1, sizeof *c->acc);
    c->logits = calloc((size_t)c->max_seqs * d->vocab + 1, sizeof *c->logits);
    c->mla_dec_pos = calloc((size_t)c->max_rows + 1, sizeof *c->mla_dec_pos);
    c->mla_dec_cache = calloc((size_t)c->max_rows + 1, sizeof *c->mla_dec_cache);
    c->cand_p = calloc((size_t)d->vocab + 1, sizeof *c->cand_p);
    c->cand_id = calloc((size_t)d->vocab + 1, sizeof *c->cand_id);
    c->ts = calloc((size_t)c->n_threads, sizeof *c->ts);
    if (!c->acc || !c->logits || !c->cand_p || !c->cand_id || !c->ts || !c->mla_dec_pos ||
        !c->mla_dec_cache)
        goto nomem;
    const kern_kda_shape sh = {d->H, d->HV, d->K, d->V, 1.0f};
    const kern_mla_shape msh = {d->mla_heads, d->dc, d->dr, d->dn, d->dv};
    const size_t mla_dec_floats = kern_mla_decode_rows_workspace_floats(&msh, c->mla_dec_rows);
    for (int i = 0; i < c->n_threads; i++) {
        thread_scratch *ts = &c->ts[i];
        if (!(ts->mm = calloc(kern_matmul_scratch_floats(widest) + 1, sizeof(float)))) goto nomem;
        if (d->n_kda &&
            !(ts->kda_ws = calloc(kern_kda_chunked_workspace_floats(&sh, c->kda_chunk) + 1, sizeof(float))))
            goto nomem;
        if (d->n_mla &&
            (!(ts->mla_w = calloc((size_t)(d->dn + d->dv) * d->dc + 1, sizeof(float))) ||
             !(ts->mla_ws = calloc(kern_mla_attend_head_workspace_floats(&msh, c->max_rows) + 1,
                                   sizeof(float))) ||
             !(ts->mla_dec_ws = calloc(mla_dec_floats + 1, sizeof(float)))))
            goto nomem;
    }
    kds_status rc = eng_pool_create(c->n_threads, &c->pool, err);
    if (rc != KDS_OK) {
        cpu_free(&c->base);
        return rc;
    }
    /* The pool parallelises over row blocks; BLAS threads would only fight it. */
    openblas_set_num_threads(1);
    *out = &c->base;
    return KDS_OK;
nomem:
    cpu_free(&c->base);
    return kds_err_set(err, KDS_NOMEM,
                       "out of memory creating a context for %d tokens and %d sequences",
                       p->max_batch, p->max_seqs);
}

static kds_status cpu_load(eng_backend *b, kds_err *err) {
    (void)b, (void)err;
    return KDS_OK; /* the weights are read in place from the mapping */
}

const eng_backend_ops eng__cpu_ops = {
    .name = "cpu",
    .device = ENG_DEVICE_CPU,
    .create = cpu_create,
    .load = cpu_load,
    .free = cpu_free,
    .supports = cpu_supports,
    .alloc = cpu_alloc,
    .run = cpu_run,
    .logits_rows = cpu_logits_rows,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .matmul = cpu_matmul,
    .glu = cpu_glu,
    .sigmoid_mul = cpu_sigmoid_mul,
    .attn_res = cpu_attn_res,
    .add = cpu_add,
    .kda = cpu_kda,
    .mla = cpu_mla,
    .moe_route = cpu_moe_route,
    .moe_experts = cpu_moe_experts,
    .moe_combine = cpu_moe_combine,
    .sample = cpu_sample,
    .attach = cpu_attach,
    .fetch = cpu_fetch,
    .detach = cpu_detach,
};

/* ------------------------------------------------------------------------ */
/* Product profiles (eng.h: eng_ctx_profile_start, eng_ctx_profile_stop)     */

static eng_cpu *profile_cpu(eng_ctx *ctx, kds_err *err) {
    eng_backend *b = eng__ctx_backend(ctx);
    if (b->ops != &eng__cpu_ops) {
        kds_err_set(err, KDS_UNSUPPORTED,
                    "product profiles time the CPU backend's tasks; this context runs on %s",
                    b->ops == &eng__ep_ops ? "expert-parallel ranks" : b->ops->name);
        return NULL;
    }
    return cpu_of(b);
}

kds_status eng_ctx_profile_start(eng_ctx *ctx, kds_err *err) {
    eng_cpu *c = profile_cpu(ctx, err);
    if (!c) return KDS_UNSUPPORTED;
    const size_t nw = (size_t)c->m->n_weights;
    profile_end(c);
    c->prof_busy = calloc((size_t)c->n_threads * nw, sizeof *c->prof_busy);
    c->prof_products = calloc(nw, sizeof *c->prof_products);
    c->prof_tokens = calloc(nw, sizeof *c->prof_tokens);
    if (c->prof_busy && c->prof_products && c->prof_tokens) return KDS_OK;
    profile_end(c);
    return kds_err_set(err, KDS_NOMEM, "out of memory for a profile of %zu matrices", nw);
}

typedef struct named_weight {
    const eng_weight *w;
    const char *role;
} named_weight;

static void name_all(const eng_model *m, const char **role, const named_weight *nw, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (nw[i].w->id > 0 && nw[i].w->id < m->n_weights) role[nw[i].w->id] = nw[i].role;
}

/* role[id]: what each bound matrix is, by the checkpoint's names (layer
 * and expert indices left out, so that the layers' and experts' matrices
 * of one role add up); NULL where no product reads it. */
static void name_roles(const eng_model *m, const char **role) {
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        const eng_layer_weights *L = &m->layers[l];
        const eng_kda_weights *k = &L->kda;
        const eng_mla_weights *a = &L->mla;
        const eng_ffn_weights *f = &L->ffn;
        const named_weight kda[] = {
            {&k->q_proj, "kda q_proj"},     {&k->k_proj, "kda k_proj"},
            {&k->v_proj, "kda v_proj"},     {&k->f_a_proj, "kda f_a_proj"},
            {&k->f_b_proj, "kda f_b_proj"}, {&k->b_proj, "kda b_proj"},
            {&k->g_a_proj, "kda g_a_proj"}, {&k->g_b_proj, "kda g_b_proj"},
            {&k->g_proj, "kda g_proj"},     {&k->o_proj, "kda o_proj"}};
        const named_weight mla[] = {
            {&a->q_proj, "mla q_proj"},
            {&a->q_a_proj, "mla q_a_proj"},
            {&a->q_b_proj, "mla q_b_proj"},
            {&a->kv_a_proj_with_mqa, "mla kv_a_proj_with_mqa"},
            {&a->kv_b_proj, "mla kv_b_proj"},
            {&a->g_proj, "mla g_proj"},
            {&a->o_proj, "mla o_proj"}};
        const named_weight dense[] = {{&f->gate_proj, "mlp gate_proj"},
                                      {&f->up_proj, "mlp up_proj"},
                                      {&f->down_proj, "mlp down_proj"}};
        const named_weight moe[] = {{&f->router, "moe router"},
                                    {&f->sh_gate, "shared_experts gate_proj"},
                                    {&f->sh_up, "shared_experts up_proj"},
                                    {&f->sh_down, "shared_experts down_proj"},
                                    {&f->latent_down, "moe latent_down"},
                                    {&f->latent_up, "moe latent_up"}};
        if (L->kind == ENG_LAYER_KDA)
            name_all(m, role, kda, sizeof kda / sizeof kda[0]);
        else
            name_all(m, role, mla, sizeof mla / sizeof mla[0]);
        if (L->ffn_kind == ENG_FFN_DENSE) {
            name_all(m, role, dense, sizeof dense / sizeof dense[0]);
            continue;
        }
        name_all(m, role, moe, sizeof moe / sizeof moe[0]);
        for (int e = 0; e < m->cfg.num_experts; e++) {
            const named_weight ex[] = {{&f->w1[e], "experts w1 (gate)"},
                                       {&f->w3[e], "experts w3 (up)"},
                                       {&f->w2[e], "experts w2 (down)"}};
            name_all(m, role, ex, sizeof ex / sizeof ex[0]);
        }
    }
    const named_weight head[] = {{&m->lm_head, "lm_head"}};
    name_all(m, role, head, 1);
}

/* out's rows by the time they took, most first */
static int by_busy_desc(const void *a, const void *b) {
    const double x = ((const eng_product_time *)a)->busy_s, y = ((const eng_product_time *)b)->busy_s;
    return x < y ? 1 : x > y ? -1 : 0;
}

kds_status eng_ctx_profile_stop(eng_ctx *ctx, eng_product_time *out, int cap, int *n,
                                kds_err *err) {
    *n = 0;
    eng_cpu *c = profile_cpu(ctx, err);
    if (!c) return KDS_UNSUPPORTED;
    if (!c->prof_busy)
        return kds_err_set(err, KDS_INVALID_ARG,
                           "no product profile is running (eng_ctx_profile_start first)");
    const eng_model *m = c->m;
    const char **role = calloc((size_t)m->n_weights, sizeof *role);
    kds_status rc = KDS_OK;
    if (!role) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory naming %d matrices", m->n_weights);
        goto done;
    }
    name_roles(m, role);
    for (int id = 1; id < m->n_weights; id++) {
        if (!c->prof_products[id]) continue;
        const eng_weight *w = m->weights[id];
        double busy = 0.0;
        for (int t = 0; t < c->n_threads; t++)
            busy += c->prof_busy[(size_t)t * (size_t)m->n_weights + (size_t)id];
        const char *name = role[id] ? role[id] : "other";
        const char *dt = kern_dtype_name(w->dt);
        int k = 0;
        while (k < *n && !(out[k].rows == w->rows && out[k].cols == w->cols &&
                           !strcmp(out[k].role, name) && !strcmp(out[k].dtype, dt)))
            k++;
        if (k == *n) {
            if (*n == cap) {
                rc = kds_err_set(err, KDS_INVALID_ARG,
                                 "more than %d kinds of matrix in the profile", cap);
                goto done;
            }
            out[(*n)++] = (eng_product_time){.role = name, .dtype = dt, .rows = w->rows,
                                             .cols = w->cols};
        }
        out[k].products += c->prof_products[id];
        out[k].tokens += c->prof_tokens[id];
        out[k].bytes += (double)c->prof_products[id] *
                        (double)kern_weight_layout(w->dt, w->rows, w->cols).bytes;
        out[k].busy_s += busy;
    }
    qsort(out, (size_t)*n, sizeof *out, by_busy_desc);
done:
    free(role);
    profile_end(c);
    if (rc != KDS_OK) *n = 0;
    return rc;
}
