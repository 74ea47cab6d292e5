/*
 * eng_comm_impl.h - engine-internal: what an implementation of eng_comm.h
 * provides (eng_comm.c holds the single-rank one and the dispatch;
 * eng_comm_mpi.c, eng_comm_nccl.c the others).
 *
 * Each op does one collective on its own buffers and returns KDS_OK or an
 * error with a message naming the collective; eng_comm.c marks the
 * communicator broken after a KDS_COMM and refuses every later call.
 */
#ifndef ENG_COMM_IMPL_H
#define ENG_COMM_IMPL_H

#include <stdatomic.h>

#include "eng_comm.h"

typedef struct eng_comm_ops {
    eng_comm_kind kind;
    bool device_memory;
    void (*free)(eng_comm *c);      /* the implementation's part; finalises MPI unless broken */
    void (*abort)(eng_comm *c, int code);
    kds_status (*barrier)(eng_comm *c, kds_err *err);
    kds_status (*bcast)(eng_comm *c, void *buf, size_t bytes, int root, bool deadline,
                        kds_err *err);
    kds_status (*allgather)(eng_comm *c, const void *mine, size_t bytes, void *all, kds_err *err);
    kds_status (*alltoallv)(eng_comm *c, const void *send, const int64_t *send_rows,
                            const int64_t *send_off, void *recv, const int64_t *recv_rows,
                            const int64_t *recv_off, size_t row_bytes, kds_err *err);
} eng_comm_ops;

struct eng_comm {
    const eng_comm_ops *ops;
    int rank, size, timeout_ms;
    /* Set once, after `why` is written, by the thread using the
     * communicator; eng_comm_broken may read it from any thread (a
     * service's watchdog). */
    atomic_bool broken;
    char why[512];   /* the failure that broke it */
    void *impl;      /* the implementation's state */
};

/* Implementations: fill c (rank, size, impl, ops) or fail. */
kds_status eng__comm_mpi_create(eng_comm *c, int *argc, char ***argv, kds_err *err);
kds_status eng__comm_nccl_create(eng_comm *c, int *argc, char ***argv, kds_err *err);

/* Polling with a deadline (eng_comm.c): call done(arg) until it says yes
 * (> 0), fails (< 0) or timeout_ms pass (timeout_ms <= 0: no deadline).
 * Between polls it yields, then sleeps up to a millisecond, so a waiting
 * rank leaves the cores to ranks that compute. Returns 1 done, 0 timed
 * out, -1 failed. */
int eng__comm_poll(int (*done)(void *arg), void *arg, int timeout_ms);

#endif /* ENG_COMM_IMPL_H */
