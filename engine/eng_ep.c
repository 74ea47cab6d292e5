/*
 * eng_ep.c - expert parallelism (eng_ep.h, docs/expert-parallel.md): the
 * placement of the routed experts, the expert-parallel backend
 * (eng__ep_ops: the CPU backend whose MoE ops exchange rows with the other
 * ranks), rank 0's driving of passes and sequence states, and the loop of
 * the other ranks.
 *
 * A pass (rank 0, ep_run): every sequence gets an owner rank and its state
 * there (upload); one broadcast names the sequences, their owners and the
 * token ids; each rank runs the layer sequence over its own rows (a rank
 * owning none runs it over zero rows). In every MoE layer:
 *   route     (the CPU's) the rank's tokens chosen experts, gathered per
 *             expert into xg [T*k, X], expert-major;
 *   dispatch  counts exchange: every rank's rows per expert and its token
 *             count, all-gathered ([N, E+2] int32); then all-to-all of the
 *             rows: to rank d go its experts' rows in expert order; they
 *             arrive source-major and are reordered expert-major, source
 *             rank, token order (xr) - one rank's own gathered order when
 *             the ranks' tokens are taken in rank order;
 *   experts   (the CPU's) this rank's experts over xr, its shared experts
 *             over its own tokens, the products cut as one rank would cut
 *             the whole batch (eng_moe_args.sched_rows, the counts summed);
 *   combine   the outputs go back to the tokens' ranks, landing where the
 *             local gathered rows were (yg), and the CPU's combine sums
 *             them per token in selection order: one rank's sum, one
 *             rank's bits.
 * Then every rank's status is all-gathered (a failure anywhere fails the
 * pass everywhere, naming the rank), and the logits rows the owners
 * computed go to rank 0, where the sampler and the sequences' host fields
 * (position, logits, RNG, recent tokens) live.
 *
 * A rank that failed still takes part in every exchange (zero rows, a
 * failure flag in its counts), so the others never wait for it: the flag
 * makes every rank skip the rows of that layer and of the rest of the
 * pass. A rank that died or hangs is found by the communicator's
 * deadlines (eng_comm.h).
 *
 * Sequence states (rank 0) use the residency fields a GPU backend uses
 * (eng_seq.gpu: this backend; gpu_slot: the registry slot, which is also
 * the sequence's name on its owner; gpu_newer: the owner is ahead of the
 * shell rank 0 holds; host_newer: rank 0 wrote the shell: the next pass
 * uploads it). Only the recurrent part travels ([KDA states | conv tails |
 * MLA rows [0, pos)]); the rest of the snapshot format is rank 0's.
 *
 * Memory: every exchange buffer is made at creation for the worst batch
 * (N ranks of max(max_batch, max_seqs) rows, each to at most
 * min(top_k, experts here) of this rank's experts); a pass allocates
 * nothing. States on the move use a buffer that grows to the largest.
 */
#define _XOPEN_SOURCE 700 /* realpath */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "eng_backend.h"
#include "eng_comm.h"
#include "eng_ep.h"
#include "eng_seq.h"
#include "kds_clock.h"

#define EP_MAGIC 0x5045444bu /* "KDEP" */
#define EP_STATE_ROW 4096u   /* states travel in rows of 4 KiB: counts stay in an int */
#define EP_PATH_MAX 4096

/* ------------------------------------------------------------------------ */
/* Placement                                                                 */

const char *eng_ep_placement_name(eng_ep_placement p) {
    switch (p) {
    case ENG_EP_BLOCK: return "block";
    case ENG_EP_CYCLIC: return "cyclic";
    }
    return NULL;
}

bool eng_ep_placement_from_name(const char *name, eng_ep_placement *out) {
    if (!name) return false;
    if (!strcmp(name, "block")) *out = ENG_EP_BLOCK;
    else if (!strcmp(name, "cyclic")) *out = ENG_EP_CYCLIC;
    else return false;
    return true;
}

/* block: rank r holds [ceil(r E / n), ceil((r+1) E / n)), so e belongs to
 * the rank r with r E / n <= e < (r+1) E / n, i.e. floor(e n / E)... up to
 * the ceiling: the largest r with ceil(r E / n) <= e. */
static int block_first(int r, int E, int n) { return (int)(((int64_t)r * E + n - 1) / n); }

int eng_ep_owner(eng_ep_placement p, int e, int E, int n) {
    if (n <= 1) return 0;
    if (p == ENG_EP_CYCLIC) return e % n;
    int r = (int)((int64_t)e * n / E); /* a first guess within one of the answer */
    while (r + 1 < n && block_first(r + 1, E, n) <= e) r++;
    while (r > 0 && block_first(r, E, n) > e) r--;
    return r;
}

int eng_ep_count(eng_ep_placement p, int r, int E, int n) {
    if (n <= 1) return E;
    if (p == ENG_EP_CYCLIC) return E / n + (r < E % n);
    return block_first(r + 1, E, n) - block_first(r, E, n);
}

void eng_ep_model_params(eng_model_params *mp, const eng_comm *comm, eng_ep_placement placement) {
    if (!comm) return;
    mp->ep_rank = eng_comm_rank(comm);
    mp->ep_ranks = eng_comm_size(comm);
    mp->ep_placement = placement;
}

kds_status eng_ep_check_config(const eng_config *c, int n, kds_err *err) {
    int moe = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) moe += c->layer_is_moe[l];
    if (moe == 0 || c->num_experts <= 0)
        return kds_err_set(err, KDS_INVALID_ARG,
                           "expert parallelism over %d ranks: the model has no routed experts "
                           "(run it on one rank)", n);
    if (c->num_experts < n)
        return kds_err_set(err, KDS_INVALID_ARG,
                           "expert parallelism over %d ranks: the model has %d routed experts per "
                           "MoE layer, and every rank must hold at least one (use at most %d "
                           "ranks)", n, c->num_experts, c->num_experts);
    return KDS_OK;
}

/* ------------------------------------------------------------------------ */
/* The protocol                                                              */

enum { EP_OPEN = 1, EP_PASS, EP_UPLOAD, EP_FETCH, EP_DROP, EP_CLOSE, EP_EXIT, EP_STATS };

/* A request of rank 0, broadcast; a body of `body` bytes may follow. */
typedef struct ep_cmd {
    uint32_t magic, op;
    int32_t n_seqs, T, chunked, first, want_all; /* PASS */
    int32_t slot, owner;                         /* UPLOAD, FETCH, DROP; STATS: owner 1 = reset */
    int32_t pad0;
    int64_t pos;                                 /* UPLOAD, FETCH */
    int64_t from;                                /* FETCH: MLA rows [from, pos) */
    int64_t body;
    int32_t n_threads, max_batch, kda_chunk, max_seqs, placement; /* OPEN */
    int32_t bf16_act;                                             /* OPEN */
    char fingerprint[40];
} ep_cmd;

/* A rank's answer, all-gathered. */
typedef struct ep_status {
    int32_t rc;
    int32_t primary; /* the failure is this rank's own, not one learned from another rank */
    unsigned char digest[16];
    char msg[232];
} ep_status;

/*
 * All-gather every rank's answer; KDS_OK when all succeeded, else the
 * first failure of a rank's own (else the first) as err, its message
 * naming the rank. all: [size].
 */
static kds_status gather_status(eng_comm *comm, kds_status rc, bool primary, const char *msg,
                                const unsigned char *digest, ep_status *all, kds_err *err) {
    ep_status mine;
    memset(&mine, 0, sizeof mine);
    mine.rc = (int32_t)rc;
    mine.primary = primary;
    if (digest) memcpy(mine.digest, digest, 16);
    if (rc != KDS_OK) snprintf(mine.msg, sizeof mine.msg, "%s", msg && *msg ? msg : kds_status_str(rc));
    kds_status g = eng_comm_allgather(comm, &mine, sizeof mine, all, err);
    if (g != KDS_OK) return g;
    int pick = -1;
    for (int r = 0; r < eng_comm_size(comm); r++)
        if (all[r].rc != KDS_OK && (pick < 0 || (all[r].primary && !all[pick].primary))) pick = r;
    if (pick < 0) return KDS_OK;
    all[pick].msg[sizeof all[pick].msg - 1] = '\0';
    const kds_status st = (kds_status)all[pick].rc;
    if (pick == eng_comm_rank(comm) && err && msg && *msg) return kds_err_set(err, st, "%s", msg);
    return kds_err_set(err, st, "rank %d: %s", pick, all[pick].msg);
}

/* The recurrent part of a state on its way between ranks: [KDA states |
 * conv tails | per MLA layer its rows [from, pos)]. A save brings back only
 * the MLA rows rank 0 lacks (a long hybrid session's cache grows by a turn,
 * not by its whole length); a state rank 0 wrote goes out whole (from 0). */
static size_t state_bytes(const eng_seq *s, int64_t from, int64_t pos) {
    const eng_dims *d = &s->d;
    const size_t taps = (size_t)(d->W > 1 ? d->W - 1 : 0);
    return ((size_t)d->n_kda * d->HV * d->K * d->V + (size_t)d->n_kda * taps * d->conv_ch +
            (size_t)d->n_mla * (size_t)(pos - from) * d->mla_row) * sizeof(float);
}

static size_t state_rows(size_t bytes) { return (bytes + EP_STATE_ROW - 1) / EP_STATE_ROW; }

static void state_pack(const eng_seq *s, int64_t from, int64_t pos, unsigned char *buf) {
    const eng_dims *d = &s->d;
    const size_t taps = (size_t)(d->W > 1 ? d->W - 1 : 0);
    size_t n = (size_t)d->n_kda * d->HV * d->K * d->V * sizeof(float);
    memcpy(buf, s->kda_state, n);
    buf += n;
    n = (size_t)d->n_kda * taps * d->conv_ch * sizeof(float);
    memcpy(buf, s->conv_tail, n);
    buf += n;
    n = (size_t)(pos - from) * d->mla_row * sizeof(float);
    for (int i = 0; i < d->n_mla && n; i++, buf += n)
        memcpy(buf, s->mla_cache[i] + (size_t)from * d->mla_row, n);
}

/* Into s, which then is at `pos` (its MLA caches reserved by the caller or
 * here). */
static kds_status state_unpack(eng_seq *s, int64_t from, int64_t pos, const unsigned char *buf,
                               kds_err *err) {
    const eng_dims *d = &s->d;
    kds_status rc = eng__seq_reserve(s, pos, err);
    if (rc != KDS_OK) return rc;
    const size_t taps = (size_t)(d->W > 1 ? d->W - 1 : 0);
    size_t n = (size_t)d->n_kda * d->HV * d->K * d->V * sizeof(float);
    memcpy(s->kda_state, buf, n);
    buf += n;
    n = (size_t)d->n_kda * taps * d->conv_ch * sizeof(float);
    memcpy(s->conv_tail, buf, n);
    buf += n;
    n = (size_t)(pos - from) * d->mla_row * sizeof(float);
    for (int i = 0; i < d->n_mla && n; i++, buf += n)
        memcpy(s->mla_cache[i] + (size_t)from * d->mla_row, buf, n);
    s->pos = pos;
    return KDS_OK;
}

static kds_status grow(unsigned char **buf, size_t *cap, size_t want, kds_err *err) {
    if (want <= *cap) return KDS_OK;
    unsigned char *p = realloc(*buf, want);
    if (!p) return kds_err_set(err, KDS_NOMEM, "out of memory for %zu bytes of sequence state", want);
    *buf = p;
    *cap = want;
    return KDS_OK;
}

/* One state between rank 0 and `owner`: rows of EP_STATE_ROW from `from`
 * to `to`; every rank takes part. */
static kds_status move_state(eng_comm *comm, int from, int to, const void *send, void *recv,
                             size_t rows, int64_t *s_rows, int64_t *s_off, int64_t *r_rows,
                             int64_t *r_off, kds_err *err) {
    const int N = eng_comm_size(comm), me = eng_comm_rank(comm);
    for (int r = 0; r < N; r++) s_rows[r] = s_off[r] = r_rows[r] = r_off[r] = 0;
    if (me == from) s_rows[to] = (int64_t)rows;
    if (me == to) r_rows[from] = (int64_t)rows;
    return eng_comm_alltoallv(comm, send, s_rows, s_off, recv, r_rows, r_off, EP_STATE_ROW, err);
}

/* ------------------------------------------------------------------------ */
/* The backend                                                               */

typedef struct ep_slot {
    eng_seq *s; /* rank 0's shell; NULL: free */
    int owner;
} ep_slot;

typedef struct eng_ep {
    eng_backend base;
    eng_backend *inner;       /* the CPU backend */
    const eng_model *m;
    eng_comm *comm;
    eng_ctx_params params;    /* with defaults (what the workers' contexts get) */
    int rank, N, E, k, X, B, vocab;
    bool block;               /* block placement: a rank's experts are contiguous */
    int *first_e;             /* [N + 1]: block placement: rank r holds [first_e[r], first_e[r+1]) */
    uint8_t *mine_e;          /* [E]: this rank holds expert e */
    /* one MoE layer's exchange */
    int32_t *mine, *all;      /* [E + 2], [N, E + 2]: rows per expert, tokens, failed */
    int32_t *sched_rows;      /* [E] the whole batch's rows per expert */
    int32_t *r_exp_off;       /* [E + 1] this rank's experts' rows in xr */
    int64_t *s_rows, *s_off, *r_rows, *r_off, *cur; /* [N] */
    int32_t *perm;            /* [B * k] cyclic: send row -> local gathered row */
    float *xsend;             /* [B * k, X] cyclic: rows packed by destination */
    float *xbuf;              /* [rmax, X] rows as received (source-major), outputs going back */
    float *xr, *yr;           /* [rmax, X] this rank's experts' rows and outputs, expert-major */
    float *act_a, *act_b;     /* [rmax + B, width] */
    int64_t rmax;
    eng_moe_args ra;          /* this rank's experts' call of the layer in flight */
    bool layer_ok;            /* the layer's rows were exchanged (every rank knows alike) */
    int layer_i;              /* MoE layers exchanged in this pass */
    kds_status pass_rc;       /* this rank failed before its pass: take part as failed */
    bool learned;             /* this pass failed because another rank did */
    /* rank 0 */
    ep_slot *slots;
    int n_slots, cap_slots;
    int *load;                /* [N] sequences per rank */
    bool opened;              /* the workers made their contexts */
    unsigned char *body;      /* a command's body: [3 * B] int32, or a path */
    size_t body_cap;
    eng_seq **lseqs;          /* [B] this rank's sequences of a pass */
    int32_t *lids;            /* [B] */
    int32_t *owners;          /* [B] owner of each sequence of a pass */
    float *lbuf;              /* [B, vocab] logits rows on their way */
    ep_status *st_all;        /* [N] */
    unsigned char *sbuf;      /* a state on its way */
    size_t sbuf_cap;
    eng_ep_stats stats;
} eng_ep;

static eng_ep *ep_of(eng_backend *b) { return (eng_ep *)b; }

/* A sequence whose state was on a rank that failed: reading it fails, so
 * a save never writes a stale state. Never written to. */
static kds_status dead_fetch(eng_backend *b, eng_seq *s, bool logits_only, kds_err *err) {
    (void)b, (void)s;
    if (logits_only) return KDS_OK; /* the logits are rank 0's */
    return kds_err_set(err, KDS_COMM, "this sequence's state was on a rank of a job that failed: "
                       "it is lost (resume its session from the last snapshot)");
}
static void dead_detach(eng_backend *b, eng_seq *s) {
    (void)b;
    s->gpu = NULL;
    s->gpu_newer = s->host_newer = 0;
}
static const eng_backend_ops DEAD_OPS = {.name = "failed rank", .fetch = dead_fetch,
                                         .detach = dead_detach};
static eng_backend ep_dead = {.ops = &DEAD_OPS, .rc = KDS_OK};

static void note(eng_ep *e, const kds_err *err) {
    if (e->base.rc != KDS_OK) return;
    e->base.err = *err;
    eng__backend_note(&e->base, err->status ? err->status : KDS_COMM);
}

/* ------------------------------------------------------------------------ */
/* The MoE exchange                                                          */

/*
 * Dispatch of one MoE layer: a is this rank's routed layer, or NULL (the
 * rank failed before the layer: it takes part with no rows and its failure
 * flag set).
 */
static void dispatch(eng_ep *e, const eng_moe_args *a) {
    const int N = e->N, E = e->E, W = E + 2, me = e->rank;
    e->layer_i++;
    e->layer_ok = false;
    kds_err cerr = {0};
    const char *why = NULL;
    if (eng_comm_broken(e->comm, &why)) {
        kds_err_set(&cerr, KDS_COMM, "%s", why);
        note(e, &cerr);
        return;
    }
    const bool failed = !a || e->pass_rc != KDS_OK || e->base.rc != KDS_OK || e->inner->rc != KDS_OK;
    for (int x = 0; x < E; x++) e->mine[x] = failed ? 0 : a->exp_off[x + 1] - a->exp_off[x];
    e->mine[E] = failed ? 0 : a->T;
    e->mine[E + 1] = failed;
    const double t0 = kds_now_s();
    if (eng_comm_allgather(e->comm, e->mine, (size_t)W * sizeof(int32_t), e->all, &cerr) != KDS_OK) {
        note(e, &cerr);
        return;
    }
    e->stats.counts_s += kds_now_s() - t0;
    for (int r = 0; r < N; r++)
        if (e->all[(size_t)r * W + E + 1]) {
            if (!failed) {
                kds_err_set(&cerr, KDS_ABORTED, "rank %d failed in this pass", r);
                note(e, &cerr);
                e->learned = true;
            }
            return;
        }
    if (failed) return; /* cannot be: this rank's own flag is in `all` */
    /* the whole batch: what one rank would have had */
    int sched_T = 0;
    for (int x = 0; x < E; x++) e->sched_rows[x] = 0;
    for (int r = 0; r < N; r++) {
        const int32_t *c = e->all + (size_t)r * W;
        for (int x = 0; x < E; x++) e->sched_rows[x] += c[x];
        sched_T += c[E];
    }
    const size_t X = (size_t)a->X, row = X * sizeof(float);
    /* to rank d go its experts' rows, expert order */
    const float *send = a->xg;
    if (e->block) {
        for (int d = 0; d < N; d++) {
            e->s_off[d] = a->exp_off[e->first_e[d]];
            e->s_rows[d] = a->exp_off[e->first_e[d + 1]] - e->s_off[d];
        }
    } else {
        int64_t n = 0;
        for (int d = 0; d < N; d++) {
            e->s_off[d] = n;
            for (int x = d; x < E; x += N) /* cyclic: d's experts */
                for (int32_t r = a->exp_off[x]; r < a->exp_off[x + 1]; r++, n++) {
                    e->perm[n] = r;
                    memcpy(e->xsend + (size_t)n * X, a->xg + (size_t)r * X, row);
                }
            e->s_rows[d] = n - e->s_off[d];
        }
        send = e->xsend;
    }
    /* from rank s come its rows of this rank's experts, expert order */
    int64_t R = 0;
    for (int s = 0; s < N; s++) {
        const int32_t *c = e->all + (size_t)s * W;
        e->r_off[s] = R;
        int64_t n = 0;
        for (int x = 0; x < E; x++)
            if (e->mine_e[x]) n += c[x];
        e->r_rows[s] = n;
        R += n;
    }
    if (R > e->rmax) {
        kds_err_set(&cerr, KDS_INTERNAL, "rank %d: %lld expert rows, room for %lld", me,
                    (long long)R, (long long)e->rmax);
        note(e, &cerr);
        return; /* cannot be (rmax is the worst case): the others time out */
    }
    if (eng_comm_alltoallv(e->comm, send, e->s_rows, e->s_off, e->xbuf, e->r_rows, e->r_off, row,
                           &cerr) != KDS_OK) {
        note(e, &cerr);
        return;
    }
    /* expert-major: for each of this rank's experts, rank 0's rows, then rank 1's, ... */
    for (int s = 0; s < N; s++) e->cur[s] = e->r_off[s];
    int32_t dst = 0;
    for (int x = 0; x < E; x++) {
        e->r_exp_off[x] = dst;
        if (!e->mine_e[x]) continue;
        for (int s = 0; s < N; s++) {
            const int32_t n = e->all[(size_t)s * W + x];
            memcpy(e->xr + (size_t)dst * X, e->xbuf + (size_t)e->cur[s] * X, (size_t)n * row);
            e->cur[s] += n;
            dst += n;
        }
    }
    e->r_exp_off[E] = dst;
    e->ra = *a;
    e->ra.exp_off = e->r_exp_off;
    e->ra.xg = e->xr;
    e->ra.yg = e->yr;
    e->ra.act_a = e->act_a;
    e->ra.act_b = e->act_b;
    e->ra.sched_rows = e->sched_rows;
    e->ra.sched_T = sched_T;
    e->layer_ok = true;
    for (int d = 0; d < N; d++) e->stats.rows_sent += e->s_rows[d];
    e->stats.rows_received += R;
    e->stats.bytes_sent += (int64_t)a->exp_off[E] * (int64_t)row;
}

/* The outputs back to their tokens' ranks, where the gathered rows were. */
static void combine_back(eng_ep *e, const eng_moe_args *a) {
    const int N = e->N, E = e->E, W = E + 2;
    const size_t X = (size_t)a->X, row = X * sizeof(float);
    for (int s = 0; s < N; s++) e->cur[s] = e->r_off[s];
    int32_t src = 0;
    for (int x = 0; x < E; x++) {
        if (!e->mine_e[x]) continue;
        for (int s = 0; s < N; s++) {
            const int32_t n = e->all[(size_t)s * W + x];
            memcpy(e->xbuf + (size_t)e->cur[s] * X, e->yr + (size_t)src * X, (size_t)n * row);
            e->cur[s] += n;
            src += n;
        }
    }
    kds_err cerr = {0};
    float *recv = e->block ? a->yg : e->xsend;
    if (eng_comm_alltoallv(e->comm, e->xbuf, e->r_rows, e->r_off, recv, e->s_rows, e->s_off, row,
                           &cerr) != KDS_OK) {
        note(e, &cerr);
        return;
    }
    if (!e->block)
        for (int32_t n = 0; n < a->exp_off[E]; n++)
            memcpy(a->yg + (size_t)e->perm[n] * X, e->xsend + (size_t)n * X, row);
    e->stats.bytes_sent += (int64_t)src * (int64_t)row;
}

/* A pass that ended early on this rank (an error before its MoE layers ran)
 * still owes the others its part of every remaining exchange. */
static void finish_layers(eng_ep *e) {
    while (e->layer_i < e->m->n_moe) dispatch(e, NULL);
}

static void ep_moe_route(eng_backend *b, const eng_moe_args *a) {
    eng_ep *e = ep_of(b);
    const double t0 = kds_now_s();
    e->inner->ops->moe_route(e->inner, a);
    dispatch(e, a);
    e->stats.dispatch_s += kds_now_s() - t0;
    e->stats.moe_layers++;
}

static void ep_moe_experts(eng_backend *b, const eng_moe_args *a) {
    eng_ep *e = ep_of(b);
    if (!e->layer_ok) return; /* every rank skips this layer's rows alike */
    const double t0 = kds_now_s();
    e->inner->ops->moe_experts(e->inner, &e->ra);
    const double t1 = kds_now_s();
    combine_back(e, a);
    e->stats.experts_s += t1 - t0;
    e->stats.combine_s += kds_now_s() - t1;
}

static void ep_moe_combine(eng_backend *b, const eng_moe_args *a) {
    eng_ep *e = ep_of(b);
    e->inner->ops->moe_combine(e->inner, a);
}

/* ------------------------------------------------------------------------ */
/* Every other op is the CPU's                                               */

static void ep_embed(eng_backend *b, const eng_pass *p, const eng_weight *t, float *x) {
    eng_backend *in = ep_of(b)->inner;
    in->ops->embed(in, p, t, x);
}
static void ep_rmsnorm(eng_backend *b, const float *x, const float *w, int rows, int n, float eps,
                       float *y) {
    eng_backend *in = ep_of(b)->inner;
    in->ops->rmsnorm(in, x, w, rows, n, eps, y);
}
static void ep_matmul(eng_backend *b, const eng_matmul *jobs, int n_jobs) {
    eng_backend *in = ep_of(b)->inner;
    in->ops->matmul(in, jobs, n_jobs);
}
static void ep_glu(eng_backend *b, float *a, const float *x, size_t n) {
    eng_backend *in = ep_of(b)->inner;
    in->ops->glu(in, a, x, n);
}
static void ep_add(eng_backend *b, float *y, const float *x, size_t n) {
    eng_backend *in = ep_of(b)->inner;
    in->ops->add(in, y, x, n);
}
static void ep_sigmoid_mul(eng_backend *b, float *x, const float *g, size_t n) {
    eng_backend *in = ep_of(b)->inner;
    in->ops->sigmoid_mul(in, x, g, n);
}
static void ep_attn_res(eng_backend *b, const eng_attn_res_args *a) {
    eng_backend *in = ep_of(b)->inner;
    in->ops->attn_res(in, a);
}
static void ep_kda(eng_backend *b, const eng_pass *p, const eng_kda_args *a) {
    eng_backend *in = ep_of(b)->inner;
    in->ops->kda(in, p, a);
}
static void ep_mla(eng_backend *b, const eng_pass *p, const eng_mla_args *a) {
    eng_backend *in = ep_of(b)->inner;
    in->ops->mla(in, p, a);
}
static float *ep_logits_rows(eng_backend *b, const eng_pass *p) {
    eng_backend *in = ep_of(b)->inner;
    return in->ops->logits_rows(in, p);
}
static void *ep_alloc(eng_backend *b, size_t bytes) {
    eng_backend *in = ep_of(b)->inner;
    return in->ops->alloc(in, bytes);
}
static kds_status ep_sample(eng_backend *b, eng_seq *const *seqs, int n,
                            const eng_sampler_params *p, int32_t *tokens, kds_err *err) {
    eng_backend *in = ep_of(b)->inner;
    return in->ops->sample(in, seqs, n, p, tokens, err);
}

/* Another rank's expert is that rank's business; the rest the CPU's. */
static bool ep_supports(const eng_model *m, const eng_op_query *q, kds_err *why) {
    if (q->op == ENG_OP_MOE_EXPERTS && q->w && !q->w->data && m->ep_ranks > 1 && !m->generated)
        return true;
    return eng__cpu_ops.supports(m, q, why);
}

/* ------------------------------------------------------------------------ */
/* Rank 0: sequences                                                         */

static kds_status broadcast_cmd(eng_ep *e, ep_cmd *cmd, const void *body, kds_err *err) {
    cmd->magic = EP_MAGIC;
    kds_status rc = eng_comm_bcast(e->comm, cmd, sizeof *cmd, 0, err);
    if (rc == KDS_OK && cmd->body > 0)
        rc = eng_comm_bcast(e->comm, (void *)body, (size_t)cmd->body, 0, err);
    return rc;
}

/* After a failed collective, every sequence living on another rank is
 * lost: reading it fails from now on (ep_dead). */
static void bury(eng_ep *e) {
    for (int i = 0; i < e->n_slots; i++) {
        ep_slot *sl = &e->slots[i];
        if (!sl->s) continue;
        if (sl->owner != 0) {
            sl->s->gpu = &ep_dead;
            sl->s->gpu_newer = 1;
        } else {
            sl->s->gpu = NULL;
        }
        sl->s = NULL;
    }
    e->n_slots = 0;
}

/* The least loaded rank; ties go to the highest (rank 0 also serves). */
static int pick_owner(const eng_ep *e) {
    int best = e->N - 1;
    for (int r = e->N - 2; r >= 0; r--)
        if (e->load[r] < e->load[best]) best = r;
    return best;
}

static void unregister(eng_ep *e, eng_seq *s) {
    ep_slot *sl = &e->slots[s->gpu_slot];
    e->load[sl->owner]--;
    sl->s = NULL;
    s->gpu = NULL;
    s->gpu_slot = 0;
    s->gpu_newer = s->host_newer = s->logits_on_gpu = 0;
}

/* s's recurrent state to its owner, which then holds it. */
static kds_status upload(eng_ep *e, eng_seq *s, kds_err *err) {
    const ep_slot *sl = &e->slots[s->gpu_slot];
    const size_t bytes = state_bytes(s, 0, s->pos), rows = state_rows(bytes);
    kds_status rc = grow(&e->sbuf, &e->sbuf_cap, rows * EP_STATE_ROW, err);
    if (rc != KDS_OK) return rc;
    state_pack(s, 0, s->pos, e->sbuf);
    ep_cmd cmd = {.op = EP_UPLOAD, .slot = s->gpu_slot, .owner = sl->owner, .pos = s->pos};
    rc = broadcast_cmd(e, &cmd, NULL, err);
    /* the owner says first whether it has room, then takes the rows */
    if (rc == KDS_OK) rc = gather_status(e->comm, KDS_OK, false, NULL, NULL, e->st_all, err);
    if (rc == KDS_OK)
        rc = move_state(e->comm, 0, sl->owner, e->sbuf, NULL, rows, e->s_rows, e->s_off, e->r_rows,
                        e->r_off, err);
    if (rc != KDS_OK) return rc;
    s->host_newer = 0;
    s->gpu_newer = 0;
    s->gpu_host_rows = s->pos; /* both hold every MLA row now */
    return KDS_OK;
}

static void drop_remote(eng_ep *e, eng_seq *s) {
    const ep_slot *sl = &e->slots[s->gpu_slot];
    if (sl->owner == 0 || eng_comm_broken(e->comm, NULL)) return;
    ep_cmd cmd = {.op = EP_DROP, .slot = s->gpu_slot, .owner = sl->owner};
    broadcast_cmd(e, &cmd, NULL, NULL);
}

/* A sequence this context runs: registered, with its state current on its
 * owner. */
static kds_status make_resident(eng_ep *e, eng_seq *s, kds_err *err) {
    kds_status rc;
    if (s->gpu == &e->base) {
        if (e->slots[s->gpu_slot].owner != 0 && s->host_newer) return upload(e, s, err);
        return KDS_OK;
    }
    if (s->gpu) { /* another context's: bring it home, then take it */
        if ((rc = eng__seq_fetch(s, err)) != KDS_OK) return rc;
        eng__seq_detach(s);
    }
    int slot = -1;
    for (int i = 0; i < e->n_slots && slot < 0; i++)
        if (!e->slots[i].s) slot = i;
    if (slot < 0) {
        if (e->n_slots == e->cap_slots) {
            int cap = e->cap_slots ? 2 * e->cap_slots : 64;
            ep_slot *p = realloc(e->slots, (size_t)cap * sizeof *p);
            if (!p) return kds_err_set(err, KDS_NOMEM, "out of memory registering a sequence");
            e->slots = p;
            e->cap_slots = cap;
        }
        slot = e->n_slots++;
    }
    const int owner = pick_owner(e);
    e->slots[slot] = (ep_slot){s, owner};
    e->load[owner]++;
    s->gpu = &e->base;
    s->gpu_slot = slot;
    s->gpu_newer = s->host_newer = s->logits_on_gpu = 0;
    s->gpu_host_rows = s->pos;
    if (owner == 0) return KDS_OK;
    rc = upload(e, s, err);
    if (rc != KDS_OK) {
        drop_remote(e, s);
        unregister(e, s);
    }
    return rc;
}

static kds_status ep_attach(eng_backend *b, eng_seq *s, kds_err *err) {
    eng_ep *e = ep_of(b);
    if (e->rank != 0) return KDS_OK;
    kds_status rc = make_resident(e, s, err);
    if (rc == KDS_COMM) bury(e);
    return rc;
}

static kds_status ep_fetch(eng_backend *b, eng_seq *s, bool logits_only, kds_err *err) {
    eng_ep *e = ep_of(b);
    if (logits_only || !s->gpu_newer || e->rank != 0) return KDS_OK; /* logits live on rank 0 */
    const ep_slot *sl = &e->slots[s->gpu_slot];
    /* the MLA rows rank 0 has are the ones of its last fetch or upload */
    const int64_t from = s->gpu_host_rows >= 0 && s->gpu_host_rows <= s->pos ? s->gpu_host_rows : 0;
    const size_t bytes = state_bytes(s, from, s->pos), rows = state_rows(bytes);
    kds_status rc = grow(&e->sbuf, &e->sbuf_cap, rows * EP_STATE_ROW, err);
    if (rc != KDS_OK) return rc;
    ep_cmd cmd = {.op = EP_FETCH, .slot = s->gpu_slot, .owner = sl->owner, .pos = s->pos,
                  .from = from};
    rc = broadcast_cmd(e, &cmd, NULL, err);
    /* the owner says first whether it has the state, then sends it */
    if (rc == KDS_OK) rc = gather_status(e->comm, KDS_OK, false, NULL, NULL, e->st_all, err);
    if (rc == KDS_OK)
        rc = move_state(e->comm, sl->owner, 0, NULL, e->sbuf, rows, e->s_rows, e->s_off, e->r_rows,
                        e->r_off, err);
    if (rc == KDS_OK) rc = state_unpack(s, from, s->pos, e->sbuf, err);
    if (rc == KDS_COMM) bury(e);
    if (rc != KDS_OK) return rc;
    s->gpu_newer = 0;
    s->gpu_host_rows = s->pos;
    e->stats.state_bytes_fetched += (int64_t)bytes;
    return KDS_OK;
}

static void ep_detach(eng_backend *b, eng_seq *s) {
    eng_ep *e = ep_of(b);
    if (e->rank != 0) return;
    drop_remote(e, s);
    unregister(e, s);
}

/* ------------------------------------------------------------------------ */
/* Passes                                                                    */

/* Rows of logits rank r computes in a pass (cmd), into rank 0's hands. */
static int logit_rows_of(const ep_cmd *cmd, const int32_t *owners, int r) {
    if (cmd->n_seqs == 1) {
        if (owners[0] != r || cmd->first >= cmd->T) return 0;
        return cmd->want_all ? cmd->T - cmd->first : 1;
    }
    int n = 0;
    for (int i = 0; i < cmd->n_seqs; i++) n += owners[i] == r;
    return n;
}

static bool logits_travel(const ep_cmd *cmd, const int32_t *owners, int N) {
    for (int r = 1; r < N; r++)
        if (logit_rows_of(cmd, owners, r) > 0) return true;
    return false;
}

/* This rank's rows of a pass, and the exchanges it owes the others. */
static kds_status run_local(eng_ep *e, const eng_pass *p, eng_pass_fn fn, void *arg,
                            kds_err *err) {
    e->layer_i = 0;
    e->learned = false;
    e->base.rc = KDS_OK;
    kds_err_clear(&e->base.err);
    kds_status rc = e->inner->ops->run(e->inner, p, fn, arg, err);
    finish_layers(e);
    if (e->base.rc != KDS_OK && (rc == KDS_OK || e->base.rc == KDS_COMM)) {
        if (err) *err = e->base.err;
        rc = e->base.rc;
    }
    return rc;
}

/* Rank 0's pass: see the top of this file. */
static kds_status drive(eng_ep *e, const eng_pass *p, eng_pass_fn fn, void *arg, kds_err *err) {
    const double t0 = kds_now_s();
    const int N = e->N;
    kds_status rc = KDS_OK;
    for (int i = 0; i < p->n_seqs && rc == KDS_OK; i++) rc = make_resident(e, p->seqs[i], err);
    if (rc != KDS_OK) goto out;
    int32_t *slots = (int32_t *)e->body, *owners = slots + p->n_seqs, *ids = owners + p->n_seqs;
    for (int i = 0; i < p->n_seqs; i++) {
        slots[i] = p->seqs[i]->gpu_slot;
        owners[i] = e->slots[slots[i]].owner;
    }
    memcpy(ids, p->ids, (size_t)p->T * sizeof *ids);
    ep_cmd cmd = {.op = EP_PASS, .n_seqs = p->n_seqs, .T = p->T, .chunked = p->chunked,
                  .first = p->first, .want_all = p->logits != NULL,
                  .body = (int64_t)(2 * p->n_seqs + p->T) * (int64_t)sizeof(int32_t)};
    if ((rc = broadcast_cmd(e, &cmd, e->body, err)) != KDS_OK) goto out;
    /* rank 0's own rows; a prefill stays one without them, as on the
     * other ranks (the products of its experts take the prefill path) */
    eng_pass local = {.seqs = e->lseqs, .n_seqs = 0, .ids = e->lids, .T = 0,
                      .chunked = p->chunked && p->n_seqs == 1, .logits = NULL, .first = 0};
    if (p->n_seqs == 1) {
        if (owners[0] == 0) local = *p;
    } else {
        for (int i = 0; i < p->n_seqs; i++)
            if (owners[i] == 0) {
                e->lseqs[local.n_seqs] = p->seqs[i];
                e->lids[local.n_seqs++] = p->ids[i];
            }
        local.T = local.n_seqs;
    }
    e->pass_rc = KDS_OK;
    kds_err lerr = {0};
    kds_status lrc = run_local(e, &local, fn, arg, &lerr);
    rc = gather_status(e->comm, lrc, !e->learned, lerr.msg, NULL, e->st_all, err);
    if (rc != KDS_OK) goto out;
    if (logits_travel(&cmd, owners, N)) {
        const size_t row = (size_t)e->vocab * sizeof(float);
        int64_t n = 0;
        for (int r = 0; r < N; r++) {
            e->s_rows[r] = e->s_off[r] = 0;
            e->r_off[r] = n;
            e->r_rows[r] = r == 0 ? 0 : logit_rows_of(&cmd, owners, r);
            n += e->r_rows[r];
        }
        float *recv = e->lbuf;
        if (p->n_seqs == 1)
            recv = p->logits ? p->logits + (size_t)p->first * e->vocab : p->seqs[0]->logits;
        rc = eng_comm_alltoallv(e->comm, NULL, e->s_rows, e->s_off, recv, e->r_rows, e->r_off, row,
                                err);
        if (rc != KDS_OK) goto out;
        if (p->n_seqs == 1 && p->logits) /* the sequence's own row, as one rank leaves it */
            memcpy(p->seqs[0]->logits, p->logits + (size_t)(p->T - 1) * e->vocab, row);
        if (p->n_seqs > 1) /* rank 1's sequences in pass order, then rank 2's, ... */
            for (int r = 1, j = 0; r < N; r++)
                for (int i = 0; i < p->n_seqs; i++)
                    if (owners[i] == r) memcpy(p->seqs[i]->logits, e->lbuf + (size_t)j++ * e->vocab, row);
    }
    for (int i = 0; i < p->n_seqs; i++)
        if (owners[i] != 0) {
            p->seqs[i]->gpu_newer = 1;
            p->seqs[i]->host_newer = 0;
        }
out:
    if (rc == KDS_COMM && eng_comm_broken(e->comm, NULL)) bury(e);
    e->stats.passes++;
    e->stats.pass_s += kds_now_s() - t0;
    return rc;
}

static kds_status ep_run(eng_backend *b, const eng_pass *p, eng_pass_fn fn, void *arg,
                         kds_err *err) {
    eng_ep *e = ep_of(b);
    if (e->rank == 0) return drive(e, p, fn, arg, err);
    return run_local(e, p, fn, arg, err); /* a worker's share (worker_pass) */
}

/* ------------------------------------------------------------------------ */
/* Lifecycle                                                                 */

static void ep_free(eng_backend *b) {
    eng_ep *e = ep_of(b);
    if (!e) return;
    if (e->rank == 0) {
        /* every state goes back to its shell, as a GPU context's do */
        for (int i = 0; i < e->n_slots; i++) {
            eng_seq *s = e->slots[i].s;
            if (!s) continue;
            kds_status rc = ep_fetch(b, s, false, NULL);
            if (!e->slots[i].s) continue; /* a failed fetch buried them all */
            if (rc != KDS_OK) {
                s->gpu = &ep_dead;
                e->slots[i].s = NULL;
                continue;
            }
            unregister(e, s); /* the workers drop theirs at CLOSE */
        }
        if (e->opened && !eng_comm_broken(e->comm, NULL)) {
            ep_cmd cmd = {.op = EP_CLOSE};
            broadcast_cmd(e, &cmd, NULL, NULL);
        }
    }
    if (e->inner) e->inner->ops->free(e->inner); /* with the buffers it allocated */
    free(e->first_e);
    free(e->mine_e);
    free(e->mine);
    free(e->all);
    free(e->sched_rows);
    free(e->r_exp_off);
    free(e->s_rows);
    free(e->s_off);
    free(e->r_rows);
    free(e->r_off);
    free(e->cur);
    free(e->perm);
    free(e->slots);
    free(e->load);
    free(e->body);
    free(e->lseqs);
    free(e->lids);
    free(e->owners);
    free(e->lbuf);
    free(e->st_all);
    free(e->sbuf);
    free(e);
}

static kds_status ep_create(const eng_model *m, const eng_ctx_params *p, eng_backend **out,
                            kds_err *err) {
    *out = NULL;
    eng_comm *comm = p->comm;
    if (!comm) return kds_err_set(err, KDS_INVALID_ARG, "expert parallelism without a communicator");
    const int N = eng_comm_size(comm), rank = eng_comm_rank(comm);
    if (eng_comm_device_memory(comm))
        return kds_err_set(err, KDS_UNSUPPORTED,
                           "the %s communicator moves device memory; the CPU ranks need mpi",
                           eng_comm_kind_name(eng_comm_kind_of(comm)));
    if (m->generated)
        return kds_err_set(err, KDS_UNSUPPORTED, "model %s exists only on a GPU: expert "
                           "parallelism loads checkpoints", m->dir);
    if ((N > 1 || m->ep_ranks > 1) && (m->ep_ranks != N || m->ep_rank != rank))
        return kds_err_set(err, KDS_INVALID_ARG,
                           "model %s was loaded as rank %d of %d, the communicator is rank %d of "
                           "%d", m->dir, m->ep_rank, m->ep_ranks, rank, N);
    kds_status rc = eng_ep_check_config(&m->cfg, N, err);
    if (rc != KDS_OK) return rc;
    eng_ep *e = calloc(1, sizeof *e);
    if (!e) return kds_err_set(err, KDS_NOMEM, "out of memory creating an expert-parallel context");
    e->base.ops = &eng__ep_ops;
    e->m = m;
    e->comm = comm;
    e->params = *p;
    e->rank = rank;
    e->N = N;
    const eng_config *cfg = &m->cfg;
    e->E = cfg->num_experts;
    e->k = cfg->num_experts_per_token;
    e->X = cfg->latent_size > cfg->hidden_size ? cfg->latent_size : cfg->hidden_size;
    e->B = p->max_batch > p->max_seqs ? p->max_batch : p->max_seqs;
    e->vocab = cfg->vocab_size;
    e->block = m->ep_placement == ENG_EP_BLOCK || N == 1;
    if ((rc = eng__cpu_ops.create(m, p, &e->inner, err)) != KDS_OK) goto fail;
    const int E = e->E, B = e->B;
    int here = 0;
    e->first_e = calloc((size_t)N + 1, sizeof *e->first_e);
    e->mine_e = calloc((size_t)E, 1);
    if (!e->first_e || !e->mine_e) goto nomem;
    for (int r = 0; r <= N; r++) e->first_e[r] = r == N ? E : block_first(r, E, N);
    for (int x = 0; x < E; x++) {
        e->mine_e[x] = eng_ep_owner(m->ep_placement, x, E, N) == rank;
        here += e->mine_e[x];
    }
    const int per_token = here < e->k ? here : e->k; /* rows a token sends to this rank, at most */
    e->rmax = (int64_t)N * B * per_token;
    int width = cfg->moe_intermediate_size;
    if (cfg->moe_intermediate_size * cfg->num_shared_experts > width)
        width = cfg->moe_intermediate_size * cfg->num_shared_experts;
    const size_t X = (size_t)e->X, Bk = (size_t)B * e->k, rmax = (size_t)e->rmax;
    e->mine = calloc((size_t)E + 2, sizeof *e->mine);
    e->all = calloc((size_t)N * (E + 2), sizeof *e->all);
    e->sched_rows = calloc((size_t)E, sizeof *e->sched_rows);
    e->r_exp_off = calloc((size_t)E + 1, sizeof *e->r_exp_off);
    e->s_rows = calloc((size_t)N, sizeof(int64_t));
    e->s_off = calloc((size_t)N, sizeof(int64_t));
    e->r_rows = calloc((size_t)N, sizeof(int64_t));
    e->r_off = calloc((size_t)N, sizeof(int64_t));
    e->cur = calloc((size_t)N, sizeof(int64_t));
    e->load = calloc((size_t)N, sizeof *e->load);
    e->body_cap = (size_t)3 * B * sizeof(int32_t) + EP_PATH_MAX + 64;
    e->body = calloc(e->body_cap, 1);
    e->lseqs = calloc((size_t)B, sizeof *e->lseqs);
    e->lids = calloc((size_t)B, sizeof *e->lids);
    e->owners = calloc((size_t)B, sizeof *e->owners);
    e->lbuf = calloc((size_t)(p->max_seqs > 0 ? p->max_seqs : 1) * e->vocab, sizeof *e->lbuf);
    e->st_all = calloc((size_t)N, sizeof *e->st_all);
    if (!e->mine || !e->all || !e->sched_rows || !e->r_exp_off || !e->s_rows || !e->s_off ||
        !e->r_rows || !e->r_off || !e->cur || !e->load || !e->body || !e->lseqs || !e->lids ||
        !e->owners || !e->lbuf || !e->st_all)
        goto nomem;
    eng_backend *in = e->inner;
    e->xbuf = in->ops->alloc(in, rmax * X * sizeof(float));
    e->xr = in->ops->alloc(in, rmax * X * sizeof(float));
    e->yr = in->ops->alloc(in, rmax * X * sizeof(float));
    e->act_a = in->ops->alloc(in, (rmax + B) * width * sizeof(float));
    e->act_b = in->ops->alloc(in, (rmax + B) * width * sizeof(float));
    if (!e->xbuf || !e->xr || !e->yr || !e->act_a || !e->act_b) goto nomem;
    if (!e->block) {
        e->perm = calloc(Bk, sizeof *e->perm);
        e->xsend = in->ops->alloc(in, Bk * X * sizeof(float));
        if (!e->perm || !e->xsend) goto nomem;
    }
    *out = &e->base;
    return KDS_OK;
nomem:
    rc = kds_err_set(err, KDS_NOMEM,
                     "out of memory for the expert exchange of %d ranks x %d rows (%lld rows of "
                     "%d floats)", N, B, (long long)e->rmax, e->X);
fail:
    ep_free(&e->base);
    return rc;
}

/* Rank 0: have every worker load the model and make its context, and
 * compare what they loaded. */
static kds_status ep_load(eng_backend *b, kds_err *err) {
    eng_ep *e = ep_of(b);
    kds_status rc = e->inner->ops->load(e->inner, err);
    if (rc != KDS_OK || e->rank != 0) return rc;
    char *path = (char *)e->body;
    if (!realpath(e->m->dir, path)) snprintf(path, EP_PATH_MAX, "%s", e->m->dir);
    ep_cmd cmd = {.op = EP_OPEN, .n_threads = e->params.n_threads,
                  .max_batch = e->params.max_batch, .kda_chunk = e->params.kda_chunk,
                  .max_seqs = e->params.max_seqs, .placement = (int32_t)e->m->ep_placement,
                  .bf16_act = e->params.bf16_act,
                  .body = (int64_t)strlen(path) + 1};
    snprintf(cmd.fingerprint, sizeof cmd.fingerprint, "%s", e->m->fingerprint);
    if ((rc = broadcast_cmd(e, &cmd, path, err)) != KDS_OK) return rc;
    rc = gather_status(e->comm, KDS_OK, false, NULL, e->m->ep_digest, e->st_all, err);
    e->opened = rc != KDS_COMM; /* the workers that made contexts get a CLOSE at ep_free */
    if (rc != KDS_OK) return kds_err_prefix(err, "starting %d ranks", e->N);
    for (int r = 1; r < e->N; r++)
        if (memcmp(e->st_all[r].digest, e->m->ep_digest, 16) != 0)
            return kds_err_set(err, KDS_MISMATCH,
                               "rank %d loaded a different model from %s than rank 0 (their "
                               "digests of the config and the shared tensors differ): every "
                               "rank must read the same checkpoint", r, path);
    return KDS_OK;
}

const eng_backend_ops eng__ep_ops = {
    .name = "cpu",
    .device = ENG_DEVICE_CPU,
    .create = ep_create,
    .load = ep_load,
    .free = ep_free,
    .supports = ep_supports,
    .alloc = ep_alloc,
    .run = ep_run,
    .logits_rows = ep_logits_rows,
    .embed = ep_embed,
    .rmsnorm = ep_rmsnorm,
    .matmul = ep_matmul,
    .glu = ep_glu,
    .sigmoid_mul = ep_sigmoid_mul,
    .attn_res = ep_attn_res,
    .add = ep_add,
    .kda = ep_kda,
    .mla = ep_mla,
    .moe_route = ep_moe_route,
    .moe_experts = ep_moe_experts,
    .moe_combine = ep_moe_combine,
    .sample = ep_sample,
    .attach = ep_attach,
    .fetch = ep_fetch,
    .detach = ep_detach,
};

bool eng_ctx_ep_stats(const eng_ctx *c, eng_ep_stats *out) {
    const eng_backend *b = eng__ctx_backend(c);
    if (b->ops != &eng__ep_ops) return false;
    const eng_ep *e = (const eng_ep *)b;
    *out = e->stats;
    out->ranks = e->N;
    return true;
}

void eng_ctx_ep_stats_reset(eng_ctx *c) {
    eng_backend *b = eng__ctx_backend(c);
    if (b->ops == &eng__ep_ops) memset(&ep_of(b)->stats, 0, sizeof ep_of(b)->stats);
}

/* Every rank's stats, all-gathered; then reset when asked. */
static kds_status gather_stats(eng_ep *e, bool reset, eng_ep_stats *all, kds_err *err) {
    e->stats.ranks = e->N;
    kds_status rc = eng_comm_allgather(e->comm, &e->stats, sizeof e->stats, all, err);
    if (rc == KDS_OK && reset) memset(&e->stats, 0, sizeof e->stats);
    return rc;
}

kds_status eng_ctx_ep_stats_all(eng_ctx *c, eng_ep_stats *all, bool reset, kds_err *err) {
    eng_backend *b = eng__ctx_backend(c);
    if (b->ops != &eng__ep_ops || ep_of(b)->rank != 0)
        return kds_err_set(err, KDS_INVALID_ARG, "not rank 0 of an expert-parallel context");
    eng_ep *e = ep_of(b);
    ep_cmd cmd = {.op = EP_STATS, .owner = reset};
    kds_status rc = broadcast_cmd(e, &cmd, NULL, err);
    if (rc == KDS_OK) rc = gather_stats(e, reset, all, err);
    return rc;
}

kds_status eng_ep_shutdown(eng_comm *comm, kds_err *err) {
    if (eng_comm_size(comm) <= 1 || eng_comm_rank(comm) != 0 || eng_comm_broken(comm, NULL))
        return KDS_OK;
    ep_cmd cmd = {.magic = EP_MAGIC, .op = EP_EXIT};
    return eng_comm_bcast(comm, &cmd, sizeof cmd, 0, err);
}

/* ------------------------------------------------------------------------ */
/* The other ranks                                                           */

typedef struct worker {
    eng_comm *comm;
    int rank, N;
    eng_model *m;
    eng_ctx *c;
    eng_ep *ep;               /* c's backend */
    eng_seq **seqs;           /* by rank 0's slot */
    int cap;
    float *logits;            /* [T, vocab]: every row of a pass (kdaserve logits) */
    size_t logits_cap;        /* floats */
    ep_status *st_all;        /* [N] */
    unsigned char *body;      /* a request's body */
    size_t body_cap;
    unsigned char *sbuf;      /* a state on its way */
    size_t sbuf_cap;
    int64_t *s_rows, *s_off, *r_rows, *r_off; /* [N] */
} worker;

static void worker_close(worker *w) {
    for (int i = 0; i < w->cap; i++) {
        eng_seq_free(w->seqs[i]);
        w->seqs[i] = NULL;
    }
    eng_ctx_free(w->c);
    eng_model_free(w->m);
    w->c = NULL;
    w->m = NULL;
    w->ep = NULL;
}

static kds_status worker_body(worker *w, const ep_cmd *cmd, kds_err *err) {
    if (cmd->body < 0 || cmd->body > (int64_t)1 << 30)
        return kds_err_set(err, KDS_BAD_FORMAT, "rank %d: a request body of %lld bytes", w->rank,
                           (long long)cmd->body);
    if (cmd->body == 0) return KDS_OK;
    kds_status rc = grow(&w->body, &w->body_cap, (size_t)cmd->body + 1, err);
    if (rc != KDS_OK) return rc;
    rc = eng_comm_bcast(w->comm, w->body, (size_t)cmd->body, 0, err);
    if (rc == KDS_OK) w->body[cmd->body] = 0;
    return rc;
}

static kds_status worker_open(worker *w, const ep_cmd *cmd, kds_err *err) {
    kds_status rc = worker_body(w, cmd, err);
    if (rc != KDS_OK) return rc;
    if (w->c) worker_close(w);
    kds_err lerr = {0};
    eng_model_params mp = eng_model_default_params();
    mp.ep_rank = w->rank;
    mp.ep_ranks = w->N;
    mp.ep_placement = (eng_ep_placement)cmd->placement;
    kds_status lrc = eng_model_load((const char *)w->body, &mp, &w->m, &lerr);
    if (lrc == KDS_OK) {
        /* rank 0's fingerprint of every byte (this rank read only its share) */
        memcpy(w->m->fingerprint, cmd->fingerprint, sizeof w->m->fingerprint - 1);
        w->m->fingerprint[sizeof w->m->fingerprint - 1] = '\0';
        eng_ctx_params cp = eng_ctx_default_params();
        cp.n_threads = cmd->n_threads;
        cp.max_batch = cmd->max_batch;
        cp.kda_chunk = cmd->kda_chunk;
        cp.max_seqs = cmd->max_seqs;
        cp.bf16_act = cmd->bf16_act != 0; /* every rank's experts as rank 0's */
        cp.comm = w->comm;
        lrc = eng_ctx_create(w->m, &cp, &w->c, &lerr);
    }
    if (lrc == KDS_OK) w->ep = ep_of(eng__ctx_backend(w->c));
    rc = gather_status(w->comm, lrc, true, lerr.msg, lrc == KDS_OK ? w->m->ep_digest : NULL,
                       w->st_all, err);
    if (lrc != KDS_OK) worker_close(w); /* rank 0 gives up; it sends CLOSE to the others */
    return rc == KDS_COMM ? rc : KDS_OK;
}

static eng_seq *worker_seq(const worker *w, int slot) {
    return slot >= 0 && slot < w->cap ? w->seqs[slot] : NULL;
}

static kds_status worker_pass(worker *w, const ep_cmd *cmd, kds_err *err) {
    kds_status rc = worker_body(w, cmd, err);
    if (rc != KDS_OK) return rc;
    eng_ep *e = w->ep;
    if (!e) /* rank 0 refuses contexts a rank could not make: cannot be */
        return kds_err_set(err, KDS_COMM, "rank %d: a pass without a context", w->rank);
    kds_err lerr = {0};
    kds_status lrc = KDS_OK;
    const int n = cmd->n_seqs, T = cmd->T;
    if (n < 0 || T < 0 || n > e->B || T > e->B || cmd->body != (int64_t)(2 * n + T) * 4)
        lrc = kds_err_set(&lerr, KDS_INTERNAL, "rank %d: a pass of %d sequences and %d rows "
                          "it cannot take", w->rank, n, T);
    const int32_t *slots = (const int32_t *)w->body, *owners = slots + n, *ids = owners + n;
    /* this rank's rows */
    int n_local = 0, T_local = 0;
    float *logits = NULL;
    if (lrc == KDS_OK) {
        for (int i = 0; i < n && lrc == KDS_OK; i++) {
            if (owners[i] != w->rank) continue;
            eng_seq *s = worker_seq(w, slots[i]);
            if (!s) {
                lrc = kds_err_set(&lerr, KDS_INTERNAL, "rank %d does not hold sequence slot %d",
                                  w->rank, slots[i]);
                break;
            }
            e->lseqs[n_local] = s;
            e->lids[n_local++] = ids[i];
        }
        T_local = n == 1 ? (n_local ? T : 0) : n_local;
        if (n == 1 && n_local) memcpy(e->lids, ids, (size_t)T * sizeof *ids);
        for (int i = 0; i < n_local && lrc == KDS_OK; i++)
            lrc = eng__seq_reserve(e->lseqs[i], e->lseqs[i]->pos + (n == 1 ? T : 1), &lerr);
        if (lrc == KDS_OK && n == 1 && n_local && cmd->want_all) {
            const size_t want = (size_t)T * e->vocab;
            if (want > w->logits_cap) {
                float *p = realloc(w->logits, want * sizeof *p);
                if (!p) lrc = kds_err_set(&lerr, KDS_NOMEM, "rank %d: out of memory for %d rows "
                                          "of logits", w->rank, T);
                else w->logits = p, w->logits_cap = want;
            }
            logits = w->logits;
        }
    }
    if (lrc != KDS_OK) n_local = T_local = 0;
    {
        e->pass_rc = lrc;
        const bool chunked = cmd->chunked && n == 1;
        /* no rows: no lm_head either (forward's first = T) */
        kds_status prc = eng__forward(w->c, n_local ? e->lseqs : NULL, n_local, e->lids, T_local,
                                      chunked, logits, n_local > 0 && cmd->first < T, &lerr);
        if (lrc == KDS_OK) lrc = prc;
    }
    rc = gather_status(w->comm, lrc, !e->learned, lerr.msg, NULL, w->st_all, err);
    if (rc != KDS_OK) return rc == KDS_COMM ? rc : KDS_OK; /* rank 0 reports it */
    if (!logits_travel(cmd, owners, w->N)) return KDS_OK;
    const int rows = logit_rows_of(cmd, owners, w->rank);
    const float *send = NULL;
    if (rows > 0 && n == 1)
        send = cmd->want_all ? w->logits + (size_t)cmd->first * e->vocab : e->lseqs[0]->logits;
    if (rows > 0 && n > 1) {
        for (int i = 0; i < n_local; i++)
            memcpy(e->lbuf + (size_t)i * e->vocab, e->lseqs[i]->logits,
                   (size_t)e->vocab * sizeof(float));
        send = e->lbuf;
    }
    for (int r = 0; r < w->N; r++) w->s_rows[r] = w->s_off[r] = w->r_rows[r] = w->r_off[r] = 0;
    w->s_rows[0] = rows;
    return eng_comm_alltoallv(w->comm, send, w->s_rows, w->s_off, NULL, w->r_rows, w->r_off,
                              (size_t)e->vocab * sizeof(float), err);
}

/* Room for a state rank 0 hands this rank: the sequence of the slot (made
 * if new), its MLA caches, the transfer buffer. */
static kds_status worker_take(worker *w, const ep_cmd *cmd, eng_seq **out, size_t *rows,
                              kds_err *err) {
    if (!w->m || cmd->slot < 0 || cmd->slot >= (1 << 24) || cmd->pos < 0)
        return kds_err_set(err, KDS_INTERNAL, "rank %d: a state for slot %d it cannot take",
                           w->rank, cmd->slot);
    if (cmd->slot >= w->cap) {
        int cap = w->cap ? w->cap : 64;
        while (cap <= cmd->slot) cap *= 2;
        eng_seq **p = realloc(w->seqs, (size_t)cap * sizeof *p);
        if (!p) return kds_err_set(err, KDS_NOMEM, "rank %d: out of memory", w->rank);
        memset(p + w->cap, 0, (size_t)(cap - w->cap) * sizeof *p);
        w->seqs = p;
        w->cap = cap;
    }
    kds_status rc = KDS_OK;
    if (!w->seqs[cmd->slot] && (rc = eng_seq_create(w->m, 0, &w->seqs[cmd->slot], err)) != KDS_OK)
        return rc;
    eng_seq *s = w->seqs[cmd->slot];
    if ((rc = eng__seq_reserve(s, cmd->pos, err)) != KDS_OK) return rc;
    *rows = state_rows(state_bytes(s, 0, cmd->pos));
    if ((rc = grow(&w->sbuf, &w->sbuf_cap, *rows * EP_STATE_ROW, err)) != KDS_OK) return rc;
    *out = s;
    return KDS_OK;
}

static kds_status worker_upload(worker *w, const ep_cmd *cmd, kds_err *err) {
    kds_err lerr = {0};
    kds_status lrc = KDS_OK;
    const bool mine = cmd->owner == w->rank;
    eng_seq *s = NULL;
    size_t rows = 0;
    if (mine) lrc = worker_take(w, cmd, &s, &rows, &lerr);
    kds_status rc = gather_status(w->comm, lrc, true, lerr.msg, NULL, w->st_all, err);
    if (rc != KDS_OK) return rc == KDS_COMM ? rc : KDS_OK; /* all skip the transfer */
    rc = move_state(w->comm, 0, cmd->owner, NULL, mine ? w->sbuf : NULL, rows, w->s_rows,
                    w->s_off, w->r_rows, w->r_off, err);
    /* the caches are reserved: unpacking cannot fail now */
    if (rc == KDS_OK && mine) rc = state_unpack(s, 0, cmd->pos, w->sbuf, err);
    return rc;
}

static kds_status worker_fetch(worker *w, const ep_cmd *cmd, kds_err *err) {
    kds_err lerr = {0};
    kds_status lrc = KDS_OK;
    const bool mine = cmd->owner == w->rank;
    eng_seq *s = mine ? worker_seq(w, cmd->slot) : NULL;
    size_t rows = 0;
    if (mine && (!s || s->pos != cmd->pos || cmd->from < 0 || cmd->from > cmd->pos))
        lrc = kds_err_set(&lerr, KDS_INTERNAL, "rank %d does not hold sequence slot %d at "
                          "position %lld", w->rank, cmd->slot, (long long)cmd->pos);
    if (mine && lrc == KDS_OK) {
        rows = state_rows(state_bytes(s, cmd->from, cmd->pos));
        lrc = grow(&w->sbuf, &w->sbuf_cap, rows * EP_STATE_ROW, &lerr);
        if (lrc == KDS_OK) state_pack(s, cmd->from, cmd->pos, w->sbuf);
    }
    kds_status rc = gather_status(w->comm, lrc, true, lerr.msg, NULL, w->st_all, err);
    if (rc != KDS_OK) return rc == KDS_COMM ? rc : KDS_OK; /* all skip the transfer */
    return move_state(w->comm, cmd->owner, 0, mine ? w->sbuf : NULL, NULL, rows, w->s_rows,
                      w->s_off, w->r_rows, w->r_off, err);
}

kds_status eng_ep_worker_run(eng_comm *comm, kds_err *err) {
    worker w = {.comm = comm, .rank = eng_comm_rank(comm), .N = eng_comm_size(comm)};
    kds_status rc = KDS_OK;
    const size_t N = (size_t)w.N;
    w.st_all = calloc(N, sizeof *w.st_all);
    w.s_rows = calloc(N, sizeof(int64_t));
    w.s_off = calloc(N, sizeof(int64_t));
    w.r_rows = calloc(N, sizeof(int64_t));
    w.r_off = calloc(N, sizeof(int64_t));
    if (!w.st_all || !w.s_rows || !w.s_off || !w.r_rows || !w.r_off) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory");
        goto out;
    }
    for (;;) {
        ep_cmd cmd;
        /* between requests a rank waits as long as rank 0 is idle */
        if ((rc = eng_comm_bcast_wait(comm, &cmd, sizeof cmd, 0, err)) != KDS_OK) break;
        if (cmd.magic != EP_MAGIC) {
            rc = kds_err_set(err, KDS_COMM, "rank %d: a request without the protocol's magic "
                             "(ranks of different kdaserve builds?)", w.rank);
            break;
        }
        if (cmd.op == EP_EXIT) break;
        switch (cmd.op) {
        case EP_OPEN: rc = worker_open(&w, &cmd, err); break;
        case EP_PASS: rc = worker_pass(&w, &cmd, err); break;
        case EP_UPLOAD: rc = worker_upload(&w, &cmd, err); break;
        case EP_FETCH: rc = worker_fetch(&w, &cmd, err); break;
        case EP_DROP:
            if (cmd.owner == w.rank && worker_seq(&w, cmd.slot)) {
                eng_seq_free(w.seqs[cmd.slot]);
                w.seqs[cmd.slot] = NULL;
            }
            break;
        case EP_CLOSE: worker_close(&w); break;
        case EP_STATS: {
            eng_ep_stats *all = calloc(N, sizeof *all);
            if (!all) {
                rc = kds_err_set(err, KDS_COMM, "rank %d: out of memory", w.rank);
                break;
            }
            eng_ep_stats none = {0};
            if (w.ep)
                rc = gather_stats(w.ep, cmd.owner != 0, all, err);
            else /* no context: nothing counted */
                rc = eng_comm_allgather(comm, &none, sizeof none, all, err);
            free(all);
            break;
        }
        default:
            rc = kds_err_set(err, KDS_COMM, "rank %d: unknown request %u", w.rank, cmd.op);
            break;
        }
        if (rc != KDS_OK) break;
    }
out:
    worker_close(&w);
    free(w.seqs);
    free(w.logits);
    free(w.st_all);
    free(w.body);
    free(w.sbuf);
    free(w.s_rows);
    free(w.s_off);
    free(w.r_rows);
    free(w.r_off);
    return rc;
}
