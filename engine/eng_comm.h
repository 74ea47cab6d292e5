/*
 * eng_comm.h - the ranks of a kdaserve job and the few collectives that
 * expert parallelism needs between them (docs/expert-parallel.md).
 *
 * A job is N processes (ranks) started by `mpirun -np N kdaserve ...`;
 * without mpirun it is one rank. One interface, three implementations:
 *   single  one rank, no library: every collective is a copy to itself
 *           (a kdaserve started without mpirun, and the tests);
 *   mpi     Open MPI on host memory: the CPU ranks (eng_comm_mpi.c, built
 *           when CMake finds MPI: KDS_HAVE_MPI);
 *   nccl    NCCL on device memory, one GPU per rank, bootstrapped over MPI
 *           (rank 0's ncclUniqueId is broadcast with MPI); NCCL is opened
 *           with dlopen at creation, so nothing of it is mapped otherwise
 *           (eng_comm_nccl.c, built with CUDA and MPI: KDS_HAVE_NCCL).
 * The collectives:
 *   barrier    every rank arrives;
 *   bcast      bytes from a root to every rank;
 *   allgather  every rank contributes the same number of bytes and every
 *              rank receives all of them, rank order (the counts exchange:
 *              how many rows each rank will send to each expert);
 *   alltoallv  rows of one size, a variable number from every rank to
 *              every rank (tokens to the ranks of their experts and back).
 * Buffers are host memory for single and mpi, device memory for nccl
 * (eng_comm_device_memory), except allgather's, which are always host
 * memory (counts are decided on the host).
 *
 * Timeouts. Every collective has a deadline (eng_comm_params.timeout_ms):
 * a rank that died or hangs makes it fail with KDS_COMM naming the
 * collective, instead of waiting forever. After such a failure the
 * communicator is broken: an unfinished collective cannot be taken back,
 * so every later call fails at once with the first failure's message,
 * and the job can only end (eng_comm_abort). The one collective without a
 * deadline is eng_comm_bcast_wait, for a rank waiting between requests (a
 * service may be idle for hours); it still fails when MPI reports one.
 *
 * Threading: a communicator belongs to one thread at a time (MPI is
 * initialised with MPI_THREAD_SERIALIZED: the thread may change, calls
 * never overlap). Every rank must make the same collectives in the same
 * order.
 *
 * Ownership: eng_comm_create's caller owns the communicator (free with
 * eng_comm_free, which finalises MPI). Buffers are borrowed for the call.
 */
#ifndef ENG_COMM_H
#define ENG_COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kds_status.h"

typedef struct eng_comm eng_comm;

typedef enum eng_comm_kind {
    ENG_COMM_AUTO = 0, /* mpi when started by mpirun (eng_comm_launched), else single */
    ENG_COMM_SINGLE,
    ENG_COMM_MPI,
    ENG_COMM_NCCL,
} eng_comm_kind;

/* Default deadline of a collective. */
#define ENG_COMM_DEFAULT_TIMEOUT_MS 60000

typedef struct eng_comm_params {
    eng_comm_kind kind;
    int timeout_ms; /* each collective's deadline; <= 0: ENG_COMM_DEFAULT_TIMEOUT_MS */
} eng_comm_params;

eng_comm_params eng_comm_default_params(void);

/* True when this process was started by an MPI launcher (Open MPI's
 * mpirun, or a PMI/PMIx launcher such as srun: the environment says). */
bool eng_comm_launched(void);
/* True when this build has the implementation (single always). */
bool eng_comm_available(eng_comm_kind kind);
/* "single", "mpi", "nccl"; NULL for an unknown kind. */
const char *eng_comm_kind_name(eng_comm_kind kind);

/*
 * Join the job. mpi and nccl initialise MPI (argc/argv may be NULL); nccl
 * then picks GPU (local rank mod visible GPUs) and builds the NCCL
 * communicator. Errors: KDS_UNSUPPORTED (not in this build, NCCL library
 * or GPU missing), KDS_COMM (MPI or NCCL failed, or the bootstrap timed
 * out), KDS_NOMEM. Caller owns *out: free with eng_comm_free.
 */
kds_status eng_comm_create(const eng_comm_params *p, int *argc, char ***argv, eng_comm **out,
                           kds_err *err);
/* Leave the job: MPI_Finalize (every rank calls it), or, when the
 * communicator is broken, nothing (a finalize would wait for the rank that
 * failed: end the job with eng_comm_abort). NULL is a no-op. */
void eng_comm_free(eng_comm *c);
/* End every rank of the job now with exit status `code` (MPI_Abort); a
 * single rank exits. Does not return. */
void eng_comm_abort(eng_comm *c, int code);

int eng_comm_rank(const eng_comm *c);
int eng_comm_size(const eng_comm *c);
eng_comm_kind eng_comm_kind_of(const eng_comm *c);
/* Collective buffers (all but allgather's) are device memory. */
bool eng_comm_device_memory(const eng_comm *c);
int eng_comm_timeout_ms(const eng_comm *c);
/* A collective failed: the job cannot go on. *why (if not NULL) is its
 * message, borrowed until eng_comm_free. The one call any thread may make
 * while another uses the communicator (a service's watchdog). */
bool eng_comm_broken(const eng_comm *c, const char **why);

kds_status eng_comm_barrier(eng_comm *c, kds_err *err);
/* `bytes` of buf from rank `root` to buf on every rank. */
kds_status eng_comm_bcast(eng_comm *c, void *buf, size_t bytes, int root, kds_err *err);
/* eng_comm_bcast without a deadline (host memory). */
kds_status eng_comm_bcast_wait(eng_comm *c, void *buf, size_t bytes, int root, kds_err *err);
/* `bytes` from every rank: all[r * bytes ...] holds rank r's (host memory,
 * size * bytes). */
kds_status eng_comm_allgather(eng_comm *c, const void *mine, size_t bytes, void *all,
                              kds_err *err);
/*
 * Rows of row_bytes: send_rows[r] rows from send + send_off[r] rows go to
 * rank r, which receives them at its recv + recv_off[me] rows, and
 * recv_rows[r] rows come from rank r into recv + recv_off[r] rows. The
 * counts must agree pairwise (what r sends me is what I expect from r):
 * exchange them first (allgather). Arrays of size entries; a row count
 * fits an int (MPI's counts; rows of row_bytes each). Regions must not
 * overlap between send and recv.
 */
kds_status eng_comm_alltoallv(eng_comm *c, const void *send, const int64_t *send_rows,
                              const int64_t *send_off, void *recv, const int64_t *recv_rows,
                              const int64_t *recv_off, size_t row_bytes, kds_err *err);

#endif /* ENG_COMM_H */
