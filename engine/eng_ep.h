/*
 * eng_ep.h - expert parallelism: the routed experts of every MoE layer
 * spread over the ranks of a job (eng_comm.h), everything else replicated,
 * the sequences' attention data-parallel (docs/expert-parallel.md).
 *
 * Rank 0 runs the program (a command, the REPL, the service) with a
 * context made with eng_ctx_params.comm; every other rank runs
 * eng_ep_worker_run, which does what rank 0's context asks:
 *   open   load the same model (its share of the experts only: the
 *          placement, eng.h) and make a context of the same parameters;
 *          the models' digests are compared, a mismatch refuses the job;
 *   pass   run its sequences' rows of a forward pass: per MoE layer the
 *          rows routed to another rank's experts go there (counts
 *          exchange, then an all-to-all of the rows), come back as that
 *          expert's output, and are summed on the token's own rank in
 *          selection order, as one rank sums them; a rank with no rows
 *          still takes part in every exchange;
 *   state  take a sequence's state (it owns the sequence from then on),
 *          hand it back to rank 0 (a save), drop it;
 *   close, exit.
 * Each expert's products are cut as one rank would cut the whole batch
 * (eng_moe_args.sched_rows), so N ranks give one rank's logits bit for bit
 * at the same thread count.
 *
 * Faults: every collective has a deadline (eng_comm.h); a dead or hung
 * rank makes the running call fail with KDS_COMM on rank 0, and so does
 * every later one; states that lived on other ranks cannot be read any
 * more (a save fails instead of writing stale bytes). The job then ends
 * (eng_comm_abort after the service has answered its clients).
 *
 * Threading: rank 0's context is used by one thread at a time, like any
 * context; a worker is its process's main loop.
 */
#ifndef ENG_EP_H
#define ENG_EP_H

#include <stdbool.h>
#include <stdint.h>

#include "eng.h"
#include "eng_comm.h"
#include "eng_config.h"
#include "kern.h"

/* "block", "cyclic" (static); NULL for an unknown value. */
const char *eng_ep_placement_name(eng_ep_placement p);
/* false for an unknown name. */
bool eng_ep_placement_from_name(const char *name, eng_ep_placement *out);
/* The rank holding expert e (0 <= e < E) of E over n ranks. */
int eng_ep_owner(eng_ep_placement p, int e, int E, int n);
/* Experts rank r holds of E over n. */
int eng_ep_count(eng_ep_placement p, int r, int E, int n);

/* mp's ep_rank / ep_ranks / ep_placement for this process's rank of comm
 * (nothing when comm is NULL: the whole model). */
void eng_ep_model_params(eng_model_params *mp, const eng_comm *comm, eng_ep_placement placement);

/* Can config c run on n ranks? MoE layers with at least n routed experts
 * each. Errors: KDS_INVALID_ARG naming the numbers. */
kds_status eng_ep_check_config(const eng_config *c, int n, kds_err *err);

/*
 * A rank other than 0: serve rank 0's requests (above) until it says exit,
 * then return KDS_OK. Errors: KDS_COMM when the job broke (rank 0 or
 * another rank failed; the process should end with a non-zero status);
 * a failure to load the model or make the context is reported to rank 0
 * (which refuses its context, naming this rank) and the worker goes on
 * waiting. Prints nothing; `progress` mirrors eng_model_params.progress.
 */
kds_status eng_ep_worker_run(eng_comm *comm, kds_err *err);

/* Rank 0, before eng_comm_free: every worker leaves eng_ep_worker_run.
 * Contexts made with comm must be freed first. Nothing to do on one rank
 * or a broken communicator. */
kds_status eng_ep_shutdown(eng_comm *comm, kds_err *err);

/* What a context's exchanges cost so far (rank 0's view: a collective's
 * time includes waiting for the slowest rank). */
typedef struct eng_ep_stats {
    int ranks;
    int64_t passes;         /* forward passes */
    int64_t moe_layers;     /* MoE layers run (passes x MoE layers) */
    double dispatch_s;      /* counts exchange + rows to the experts' ranks */
    double counts_s;        /* of which the counts exchange: also the wait for the
                             * slowest rank to reach the layer */
    double experts_s;       /* this rank's experts (and shared experts) */
    double combine_s;       /* rows back to their tokens' ranks */
    double pass_s;          /* whole passes, with the logits' way back */
    int64_t rows_sent;      /* rows this rank sent (each way counted once) */
    int64_t rows_received;
    int64_t bytes_sent;     /* both ways */
    int64_t state_bytes_fetched; /* rank 0: sequence states brought back (saves) */
} eng_ep_stats;

/* The stats of a context made with comm; false for another context. */
bool eng_ctx_ep_stats(const eng_ctx *c, eng_ep_stats *out);
void eng_ctx_ep_stats_reset(eng_ctx *c);
/* Rank 0: every rank's stats into all[rank] (size entries; each rank's
 * own clock), then every rank's reset to zero when `reset`. Errors:
 * KDS_INVALID_ARG (not an expert-parallel context, or not rank 0),
 * KDS_COMM. */
kds_status eng_ctx_ep_stats_all(eng_ctx *c, eng_ep_stats *all, bool reset, kds_err *err);

/* ------------------------------------------------------------------------ */
/* Sizing (`kdaserve plan`, eng_ep_plan.c)                                   */

/* A rank's machine: one GPU (or CPU socket) and its links. Bandwidths in
 * GB/s (1e9 bytes), one direction. */
typedef struct eng_ep_hw {
    char name[16];
    double mem_gb;       /* memory per rank */
    double hbm_gbs;      /* its bandwidth */
    double nvlink_gbs;   /* to a rank of the same node */
    double net_gbs;      /* to a rank of another node (InfiniBand) */
    double latency_us;   /* a collective's fixed cost */
    int ranks_per_node;
} eng_ep_hw;

/* "h200", "h100", "b200" (vendor figures: HBM, NVLink per direction, one
 * 400 Gb/s NIC per GPU); false for another name. */
bool eng_ep_hw_preset(const char *name, eng_ep_hw *out);

typedef struct eng_ep_plan_in {
    int ranks;
    eng_ep_placement placement;
    kern_dtype dtype;   /* the non-block weights' element format (experts: the config's) */
    int64_t context;    /* tokens of a session, for its state */
    int batch;          /* sessions decoding together on each rank */
    eng_ep_hw hw;
} eng_ep_plan_in;

/* Bytes are bytes (not GiB), times seconds. */
typedef struct eng_ep_plan_out {
    int n_moe;                   /* MoE layers */
    int experts_rank_max;        /* routed experts per MoE layer on the fullest rank */
    double replicated_bytes;     /* every rank: all but the routed experts */
    double embed_bytes;          /* of which the embedding (a decode reads B rows of it) */
    double expert_bytes;         /* all routed experts */
    double one_expert_bytes;     /* w1 + w3 + w2 of one expert */
    double rank_weight_bytes;    /* the fullest rank: replicated + its experts */
    double state_fixed, state_per_token, state_session; /* a session at `context` */
    /* all-to-all per token per MoE layer: k rows of X f32 out, k back */
    double a2a_token_layer;      /* 2 k X 4 */
    double a2a_cross_token_layer;/* of which crosses between ranks: x (N-1)/N, uniform routing */
    double counts_layer;         /* the counts exchange per rank per layer: N (E+2) 4 */
    /* one decode step of `batch` sessions per rank */
    double active_experts_rank;  /* expected experts per MoE layer a step reads on a rank */
    double hbm_step_bytes;       /* weights and states a rank reads in a step */
    double net_step_bytes;       /* bytes a rank sends in a step (all-to-alls, counts) */
    double t_hbm, t_comm, t_step;
    double tok_s_session, tok_s_rank, tok_s_job;
    double mem_rank_bytes;       /* weights + batch sessions at context */
    bool fits;
} eng_ep_plan_out;

/* The figures of config c on in->ranks ranks. Decode is taken as
 * bandwidth-bound (weights and states streamed from memory once per step,
 * the all-to-alls at link speed plus a latency per collective, no overlap
 * of the two): an estimate for planning, not a measurement. Errors:
 * KDS_INVALID_ARG (ranks vs experts, bad figures). */
kds_status eng_ep_plan(const eng_config *c, const eng_ep_plan_in *in, eng_ep_plan_out *out,
                       kds_err *err);

#endif /* ENG_EP_H */
