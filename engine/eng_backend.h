/*
 * eng_backend.h - engine-internal: the interface between the forward pass and
 * the machines it runs on.
 *
 * The layer sequence is written once (eng_forward.c), as calls of the ops
 * below; a backend implements them on its own memory:
 *   cpu   eng_cpu.c: host memory, the context's thread pool, OpenBLAS; the
 *         exact reference (kernels/cpu);
 *   cuda  eng_cuda.c: device memory, one stream, state slots, CUDA graphs
 *         for decode passes (kernels/cuda).
 * The model is ggml's backend interface (an ops table, a "does this backend
 * support this op" query, buffers owned by the backend), at the grain of
 * this model family's fused kernels: an op is what one kernel (or a short,
 * fixed sequence of them) does, e.g. "the KDA token mixer from its
 * projections to its gated, normed output".
 *
 * Memory. Activation buffers come from ops->alloc and belong to the backend
 * (freed with it). The forward pass computes offsets into them and hands
 * them to ops but never reads or writes them itself: on the CUDA backend
 * they are device pointers. Weights are named by their host descriptors
 * (an eng_weight, or a small vector by its pointer into the model's
 * small-vector arena); a backend maps them to its own copy (eng_weight.id,
 * the vector's offset in the arena): ops->load makes that copy once.
 *
 * A pass. ops->run runs the layer sequence (a callback) over one eng_pass:
 * T tokens of one sequence, or one token of each of n sequences. The
 * backend first gives every sequence's state a home (the CUDA backend's
 * slots, uploading what is not resident there), then calls the callback
 * (the CUDA backend captures decode passes into graphs and replays them),
 * then leaves the logits where the sequences find them. Ops that read
 * per-sequence state (the KDA mixer, MLA) take the pass and the layer's
 * state slot.
 *
 * Errors are sticky, like cudaGetLastError or the loader's binders: the
 * first op that fails records its error in the backend (eng_backend.rc and
 * .err) and every later op of the pass does nothing; ops->run returns it. So
 * the layer sequence reads as the list of its ops. What can be checked before
 * anything runs is checked when a context is made: the forward pass is
 * walked once with every op asked through ops->supports, and the first one
 * a backend lacks refuses the context, naming it.
 *
 * Threading: a backend belongs to one thread at a time, with its context.
 */
#ifndef ENG_BACKEND_H
#define ENG_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "eng_model.h"
#include "eng_seq.h"

typedef struct eng_backend eng_backend;

/* The ops, for ops->supports. */
typedef enum eng_op {
    ENG_OP_EMBED,
    ENG_OP_RMSNORM,
    ENG_OP_MATMUL,
    ENG_OP_GLU,
    ENG_OP_ADD,
    ENG_OP_SIGMOID_MUL,
    ENG_OP_ATTN_RES,
    ENG_OP_KDA,
    ENG_OP_MLA,
    ENG_OP_MOE_ROUTE,
    ENG_OP_MOE_EXPERTS,
    ENG_OP_MOE_COMBINE,
    ENG_OP_SAMPLE,
} eng_op;

/* A question for ops->supports: can this backend run `op` on these
 * weights (their formats and shapes), for this model's sizes? */
typedef struct eng_op_query {
    eng_op op;
    const eng_weight *w;              /* the weight the op reads, or NULL */
    bool chunked;                     /* ENG_OP_KDA: the chunked prefill (else the recurrence) */
    const eng_sampler_params *sampler; /* ENG_OP_SAMPLE */
} eng_op_query;

/* The rows of one forward pass. */
typedef struct eng_pass {
    eng_seq *const *seqs; /* the sequences, distinct */
    int n_seqs;           /* 1: T tokens of seqs[0]; > 1: one token of each, T == n_seqs */
    const int32_t *ids;   /* [T] token ids, checked by the caller */
    int T;
    bool chunked;         /* a prefill: one sequence through the KDA chunked (WY) form,
                           * its products free to differ from one-token products row
                           * for row (the CPU's GEMM from fewer tokens); else the
                           * recurrence. Also set on a rank holding none of a
                           * prefill's rows (n_seqs 0) under expert parallelism */
    float *logits;        /* NULL, or host [T, vocab]: every row's logits (one sequence) */
    int first;            /* logits are computed for rows [first, T); T: none this pass */
} eng_pass;

/* The layer sequence, as ops->run calls it. */
typedef void (*eng_pass_fn)(void *arg, const eng_pass *p);

/* One product y (+)= x W^T. Several in one call may run side by side. */
typedef struct eng_matmul {
    const eng_weight *w; /* [rows, cols] */
    const float *x;      /* [T, cols] */
    int T;
    float *y;            /* [T, ldy]: columns [0, rows) written */
    int ldy;
    bool accumulate;     /* y += x W^T: the residual add fused into the product (at most
                          * one accumulating product per call) */
    bool routed;         /* a routed expert's product (the CPU leaves these off its AMX
                          * tiles: kern_weight's exact_tiles) */
} eng_matmul;

/* The KDA token mixer after its projections (spec §3): the causal short
 * conv + SiLU over q|k|v (reading and moving on each sequence's conv tail),
 * L2 norm of q and k, the decay gate, beta's sigmoid, the delta rule
 * (chunked for a one-sequence prefill, else the recurrence) on each
 * sequence's state, then o = rmsnorm(o) * o_norm * sigmoid(gz) per head.
 * Shapes from the model: H, HV, K, V, W, C = conv_ch. */
typedef struct eng_kda_args {
    int layer;                /* the layer's state slot (index among the KDA layers) */
    const eng_kda_weights *w; /* conv taps (q_conv: [C, W]), A_log, dt_bias, o_norm */
    float lower_bound;        /* < 0: the lower-bound gate; else the softplus gate */
    float eps;                /* the output norm's */
    float *ext;               /* [W-1+T, C]: rows W-1.. hold the q|k|v projections; rows
                               * 0..W-2 are the backend's (one sequence's conv tail) */
    float *q, *k, *v;         /* [T, H*K], [T, H*K], [T, HV*V]: scratch */
    float *g;                 /* [T, HV*K]: the raw gate (f_b_proj's output); scratch after */
    float *beta;              /* [T, HV]: raw (b_proj's output); scratch after */
    float *gz;                /* [T, HV*V]: the raw output gate (g_b_proj's); scratch after */
    float *o;                 /* [T, HV*V] out */
} eng_kda_args;

/* MLA attention in the absorbed form (spec §5.2, no RoPE): each row's
 * latent [rmsnorm(c) * kv_a_layernorm | k_pe] appended to its sequence's
 * cache at its position, then every head attends over the cache. */
typedef struct eng_mla_args {
    int layer;                /* the layer's state slot (index among the MLA layers) */
    const eng_mla_weights *w; /* kv_a_layernorm, kv_b_proj */
    float eps;
    const float *kva;         /* [T, dc + dr]: kv_a_proj_with_mqa's output */
    const float *q;           /* [T, nh * (dn + dr)] */
    float *o;                 /* [T, nh * dv] out */
} eng_mla_args;

/* The MoE FFN (spec §6.2) in three ops: route (sigmoid scores, choice by
 * score + bias within the group limit, weights from the scores, the tokens
 * gathered per expert), experts (the routed experts' SwiGLU products over
 * the gathered rows, and the shared experts' over the tokens), combine (the
 * weighted sum back per token in selection order, plus the shared output).
 * Expert parallelism exchanges rows between route and experts and back
 * before combine. Settings (k, groups, scaling) from the model's config. */
typedef struct eng_moe_args {
    const eng_ffn_weights *f; /* router_bias, experts (w1, w3, w2, bank), shared experts */
    int T;
    const float *x;           /* [T, hidden]: the FFN's input (the shared experts read it) */
    const float *xs;          /* [T, X]: the rows the routed experts read: x, or its
                               * projection into the latent (ENG_FFN_LATENT_MOE, X = L) */
    int X;                    /* their width; the experts' outputs are as wide */
    float *router;            /* [T, E]: the router's logits in, scores after */
    int32_t *sel;             /* [T, k] chosen experts, selection order */
    float *selw;              /* [T, k] their weights */
    int32_t *exp_off;         /* [E + 1]: expert e's gathered rows [exp_off[e], exp_off[e+1]) */
    int32_t *row_of;          /* [T, k]: the gathered row of each choice */
    int32_t *tok_of;          /* [T * k]: the token of each gathered row */
    float *xg, *yg;           /* [T * k, X]: gathered inputs, expert outputs */
    /* the gate and up products: routed rows [exp_off[E], moe_intermediate_size], then
     * the shared experts' [T, moe_intermediate_size * num_shared_experts] */
    float *act_a, *act_b;
    float *shared_out;        /* [T, hidden]: the shared experts' output (when there are some) */
    float *out;               /* [T, X]: the weighted sum of the routed experts' outputs per
                               * token, plus shared_out when add_shared */
    bool add_shared;          /* combine adds shared_out (X == hidden) */
    /* Expert parallelism (eng_ep.c) hands moe_experts this rank's share of
     * a batch spread over ranks: exp_off then lists the rows of the experts
     * this rank holds (the others have none; exp_off[E] rows in all, the
     * shared experts' T rows after them in act_a / act_b), and
     * sched_rows[e] is expert e's rows in the whole batch (every rank's),
     * sched_T that batch's tokens. The backend then cuts and groups its
     * products as it would for the whole batch on one rank and runs only
     * the pieces it has rows for, so every expert's output has the bits one
     * rank would give. NULL / 0 outside expert parallelism. */
    const int32_t *sched_rows; /* [E] or NULL */
    int sched_T;
} eng_moe_args;

/* Block Attention Residuals' mix (kern_attn_res_mix): per token, a softmax
 * over the n_blocks snapshots (snapshot j's rows at blocks + j *
 * block_stride) and the partial (NULL: none), scored by the fused query u. */
typedef struct eng_attn_res_args {
    int T;
    const float *blocks;
    size_t block_stride;      /* floats from one snapshot to the next */
    int n_blocks;
    const float *partial;     /* [T, hidden] or NULL */
    const float *u;           /* [hidden]: a model vector (the fused query) */
    float *out;               /* [T, hidden] */
} eng_attn_res_args;

typedef struct eng_backend_ops {
    const char *name;   /* "cpu", "cuda": as eng_ctx_params.device names it */
    eng_device device;

    /* Lifecycle. create: a backend for contexts of model m with params p
     * (defaults filled in; max_batch and max_seqs size its buffers); no
     * weights copied yet. load: copy m's weights where the ops read them
     * (nothing for the CPU: the mapping is read in place). free: also hands
     * every resident sequence's state back to its host buffers. */
    kds_status (*create)(const eng_model *m, const eng_ctx_params *p, eng_backend **out,
                         kds_err *err);
    kds_status (*load)(eng_backend *b, kds_err *err);
    void (*free)(eng_backend *b);
    /* Can this backend run q for model m? No instance needed: asked before
     * a context is made. On false, why (if not NULL) says what, with
     * KDS_UNSUPPORTED. */
    bool (*supports)(const eng_model *m, const eng_op_query *q, kds_err *why);
    /* An activation buffer of `bytes` in the backend's memory, 16-byte
     * aligned at least, its contents unspecified (an op never reads what
     * no op wrote); NULL when out of memory. Freed with b. */
    void *(*alloc)(eng_backend *b, size_t bytes);

    /* Run fn over pass p (see the top of this file). Errors: the sticky one,
     * or residency (KDS_NOMEM, KDS_CUDA) before fn ran; then no sequence
     * changed. The caller advances positions and recent tokens. */
    kds_status (*run)(eng_backend *b, const eng_pass *p, eng_pass_fn fn, void *arg, kds_err *err);
    /* Where the lm_head writes the pass's logits rows [first, T): backend
     * memory of [T - first, vocab]. Called inside fn. */
    float *(*logits_rows)(eng_backend *b, const eng_pass *p);

    /* The ops (void: errors are sticky). */
    void (*embed)(eng_backend *b, const eng_pass *p, const eng_weight *table, float *x);
    /* y = x * rsqrt(mean(x^2) + eps) * w per row of n; y may be x. */
    void (*rmsnorm)(eng_backend *b, const float *x, const float *w, int rows, int n, float eps,
                    float *y);
    void (*matmul)(eng_backend *b, const eng_matmul *jobs, int n_jobs);
    /* The model's gated activation, a[i] = act(a[i], x[i]) for i < n:
     * SwiGLU silu(a) * x (kern_swiglu), or SiTU (kern_situ, the config's
     * betas). */
    void (*glu)(eng_backend *b, float *a, const float *x, size_t n);
    /* y[i] += x[i] for i < n. */
    void (*add)(eng_backend *b, float *y, const float *x, size_t n);
    /* x[i] *= sigmoid(g[i]) (MLA's output gate). */
    void (*sigmoid_mul)(eng_backend *b, float *x, const float *g, size_t n);
    /* The AttnRes mix (eps: rms_norm_eps). */
    void (*attn_res)(eng_backend *b, const eng_attn_res_args *a);
    void (*kda)(eng_backend *b, const eng_pass *p, const eng_kda_args *a);
    void (*mla)(eng_backend *b, const eng_pass *p, const eng_mla_args *a);
    void (*moe_route)(eng_backend *b, const eng_moe_args *a);
    void (*moe_experts)(eng_backend *b, const eng_moe_args *a);
    void (*moe_combine)(eng_backend *b, const eng_moe_args *a);

    /* Sampling where the logits are: tokens[i] for seqs[i] with its own
     * settings p[i] (p has n entries), exactly eng_sample's algorithm; only
     * when supports says so for every p[i]. */
    kds_status (*sample)(eng_backend *b, eng_seq *const *seqs, int n, const eng_sampler_params *p,
                         int32_t *tokens, kds_err *err);

    /* State residency (eng_seq.gpu: the backend holding a sequence's state;
     * the CPU backend never holds one). attach: make s resident now (the
     * CPU: bring its host copy up to date). fetch: bring s's host buffers
     * (logits_only: only its logits) up to date from b. detach: give up
     * s's slot without copying. */
    kds_status (*attach)(eng_backend *b, eng_seq *s, kds_err *err);
    kds_status (*fetch)(eng_backend *b, eng_seq *s, bool logits_only, kds_err *err);
    void (*detach)(eng_backend *b, eng_seq *s);
} eng_backend_ops;

/* Every backend starts with this. */
struct eng_backend {
    const eng_backend_ops *ops;
    kds_status rc; /* the first error of the running pass (sticky) */
    kds_err err;   /* its message */
};

/* The backend of a device; NULL when this build lacks it (no CUDA). */
const eng_backend_ops *eng__backend_ops(eng_device d);

/* The sticky error: record rc (and keep the first). */
static inline void eng__backend_note(eng_backend *b, kds_status rc) {
    if (rc != KDS_OK && b->rc == KDS_OK) b->rc = rc;
}

/* The backends (eng_cpu.c; eng_cuda.c, built with CUDA only). */
extern const eng_backend_ops eng__cpu_ops;
extern const eng_backend_ops eng__cuda_ops;
/* Expert parallelism (eng_ep.c): the CPU backend wrapped so that the MoE
 * ops exchange rows with the other ranks and a pass runs on every rank;
 * chosen by eng_ctx_create when eng_ctx_params.comm is given. */
extern const eng_backend_ops eng__ep_ops;

/* eng_forward.c, for eng_ep.c: a context's backend, and one forward pass
 * of T rows as eng_prefill / eng_decode / eng_decode_batch run it
 * (inputs checked and MLA caches reserved by the caller; n_seqs 0 with T
 * 0 is a pass without rows, an expert-parallel rank's share of a step it
 * has no sequence in). */
eng_backend *eng__ctx_backend(const eng_ctx *c);
kds_status eng__forward(eng_ctx *c, eng_seq *const *seqs, int n_seqs, const int32_t *ids, int T,
                        bool chunked, float *logits, bool want_last, kds_err *err);

#endif /* ENG_BACKEND_H */
