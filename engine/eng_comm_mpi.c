/*
 * eng_comm_mpi.c - eng_comm.h over MPI (Open MPI), host memory: the CPU
 * ranks of an expert-parallel job, and the NCCL implementation's bootstrap.
 *
 * Every collective is MPI's nonblocking form (MPI_Ibcast, MPI_Iallgather,
 * MPI_Ialltoallv, MPI_Ibarrier) polled with MPI_Test until it completes or
 * its deadline passes (eng__comm_poll), so a dead or stopped rank is an
 * error, not a hang. The communicator is a duplicate of MPI_COMM_WORLD with
 * MPI_ERRORS_RETURN, so MPI's own failures come back as codes.
 *
 * Rows travel as a contiguous datatype of row_bytes (counts then are rows,
 * so a transfer is limited to 2^31 rows, not bytes); the few row sizes a
 * job uses (a hidden row, a logits row, a 4 KiB state block) are kept in a
 * small table, and the count arrays are made once, so a collective
 * allocates nothing.
 */
#include <mpi.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng_comm_impl.h"

#define ROW_TYPES 8

typedef struct mpi_state {
    MPI_Comm comm;
    bool initialised_here; /* MPI_Init was ours: MPI_Finalize is too */
    int *scounts, *sdispls, *rcounts, *rdispls; /* [size] */
    struct {
        size_t bytes;
        MPI_Datatype type;
    } rows[ROW_TYPES];
    int n_rows;
    MPI_Request req;
} mpi_state;

static mpi_state *st_of(eng_comm *c) { return c->impl; }

static kds_status mpi_fail(eng_comm *c, int code, const char *what, kds_err *err) {
    char msg[MPI_MAX_ERROR_STRING] = "";
    int len = 0;
    MPI_Error_string(code, msg, &len);
    return kds_err_set(err, KDS_COMM, "rank %d: MPI %s failed: %s", c->rank, what, msg);
}

static int test_req(void *arg) {
    mpi_state *s = arg;
    int flag = 0;
    int rc = MPI_Test(&s->req, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return -1;
    return flag ? 1 : 0;
}

/* Wait for s->req: done, an MPI error, or the deadline. */
static kds_status wait_req(eng_comm *c, const char *what, bool deadline, kds_err *err) {
    mpi_state *s = st_of(c);
    int r = eng__comm_poll(test_req, s, deadline ? c->timeout_ms : 0);
    if (r > 0) return KDS_OK;
    if (r < 0) return kds_err_set(err, KDS_COMM, "rank %d: MPI %s failed (a rank left the job)",
                                  c->rank, what);
    return kds_err_set(err, KDS_COMM,
                       "rank %d: MPI %s did not complete within %d ms: another rank died or "
                       "hangs (KDASERVE_EP_TIMEOUT sets the deadline)",
                       c->rank, what, c->timeout_ms);
}

static kds_status row_type(eng_comm *c, size_t bytes, MPI_Datatype *out, kds_err *err) {
    mpi_state *s = st_of(c);
    for (int i = 0; i < s->n_rows; i++)
        if (s->rows[i].bytes == bytes) {
            *out = s->rows[i].type;
            return KDS_OK;
        }
    if (bytes > INT_MAX) return kds_err_set(err, KDS_INVALID_ARG, "rows of %zu bytes", bytes);
    MPI_Datatype t;
    int rc = MPI_Type_contiguous((int)bytes, MPI_BYTE, &t);
    if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&t);
    if (rc != MPI_SUCCESS) return mpi_fail(c, rc, "row type", err);
    if (s->n_rows == ROW_TYPES) { /* a job uses a handful: recycle the oldest */
        MPI_Type_free(&s->rows[0].type);
        memmove(&s->rows[0], &s->rows[1], (ROW_TYPES - 1) * sizeof s->rows[0]);
        s->n_rows--;
    }
    s->rows[s->n_rows].bytes = bytes;
    s->rows[s->n_rows].type = t;
    s->n_rows++;
    *out = t;
    return KDS_OK;
}

static void mpi_free(eng_comm *c) {
    mpi_state *s = st_of(c);
    if (!s) return;
    if (!c->broken) {
        for (int i = 0; i < s->n_rows; i++) MPI_Type_free(&s->rows[i].type);
        if (s->comm != MPI_COMM_NULL) MPI_Comm_free(&s->comm);
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (s->initialised_here && !finalized) MPI_Finalize();
    }
    free(s->scounts);
    free(s->sdispls);
    free(s->rcounts);
    free(s->rdispls);
    free(s);
    c->impl = NULL;
}

static void mpi_abort(eng_comm *c, int code) {
    (void)c;
    MPI_Abort(MPI_COMM_WORLD, code);
}

static kds_status mpi_barrier(eng_comm *c, kds_err *err) {
    mpi_state *s = st_of(c);
    int rc = MPI_Ibarrier(s->comm, &s->req);
    if (rc != MPI_SUCCESS) return mpi_fail(c, rc, "barrier", err);
    return wait_req(c, "barrier", true, err);
}

static kds_status mpi_bcast(eng_comm *c, void *buf, size_t bytes, int root, bool deadline,
                            kds_err *err) {
    mpi_state *s = st_of(c);
    /* in pieces of at most 1 GiB: MPI counts are ints (every rank has the
     * same byte count, so all skip an empty broadcast alike) */
    for (size_t off = 0; off < bytes;) {
        size_t n = bytes - off > ((size_t)1 << 30) ? (size_t)1 << 30 : bytes - off;
        int rc = MPI_Ibcast((char *)buf + off, (int)n, MPI_BYTE, root, s->comm, &s->req);
        if (rc != MPI_SUCCESS) return mpi_fail(c, rc, "broadcast", err);
        kds_status st = wait_req(c, "broadcast", deadline, err);
        if (st != KDS_OK) return st;
        off += n;
    }
    return KDS_OK;
}

static kds_status mpi_allgather(eng_comm *c, const void *mine, size_t bytes, void *all,
                                kds_err *err) {
    mpi_state *s = st_of(c);
    if (bytes > INT_MAX) return kds_err_set(err, KDS_INVALID_ARG, "allgather of %zu bytes", bytes);
    int rc = MPI_Iallgather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, s->comm, &s->req);
    if (rc != MPI_SUCCESS) return mpi_fail(c, rc, "allgather", err);
    return wait_req(c, "allgather (counts exchange)", true, err);
}

static kds_status mpi_alltoallv(eng_comm *c, const void *send, const int64_t *send_rows,
                                const int64_t *send_off, void *recv, const int64_t *recv_rows,
                                const int64_t *recv_off, size_t row_bytes, kds_err *err) {
    mpi_state *s = st_of(c);
    MPI_Datatype t = MPI_DATATYPE_NULL;
    kds_status st = row_type(c, row_bytes, &t, err);
    if (st != KDS_OK) return st;
    for (int r = 0; r < c->size; r++) { /* ranges checked by eng_comm_alltoallv */
        s->scounts[r] = (int)send_rows[r];
        s->sdispls[r] = (int)send_off[r];
        s->rcounts[r] = (int)recv_rows[r];
        s->rdispls[r] = (int)recv_off[r];
    }
    int rc = MPI_Ialltoallv(send, s->scounts, s->sdispls, t, recv, s->rcounts, s->rdispls, t,
                            s->comm, &s->req);
    if (rc != MPI_SUCCESS) return mpi_fail(c, rc, "alltoallv", err);
    return wait_req(c, "alltoallv (rows to and from the experts' ranks)", true, err);
}

static const eng_comm_ops MPI_OPS = {
    .kind = ENG_COMM_MPI,
    .device_memory = false,
    .free = mpi_free,
    .abort = mpi_abort,
    .barrier = mpi_barrier,
    .bcast = mpi_bcast,
    .allgather = mpi_allgather,
    .alltoallv = mpi_alltoallv,
};

kds_status eng__comm_mpi_create(eng_comm *c, int *argc, char ***argv, kds_err *err) {
    mpi_state *s = calloc(1, sizeof *s);
    if (!s) return kds_err_set(err, KDS_NOMEM, "out of memory creating an MPI communicator");
    s->comm = MPI_COMM_NULL;
    c->impl = s;
    c->ops = &MPI_OPS;
    int inited = 0, provided = 0, rc;
    MPI_Initialized(&inited);
    if (!inited) {
        rc = MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided);
        if (rc != MPI_SUCCESS) {
            mpi_free(c);
            c->ops = NULL;
            return kds_err_set(err, KDS_COMM, "MPI_Init_thread failed (code %d)", rc);
        }
        s->initialised_here = true;
    } else {
        MPI_Query_thread(&provided);
    }
    if (provided < MPI_THREAD_SERIALIZED) {
        mpi_free(c);
        c->ops = NULL;
        return kds_err_set(err, KDS_UNSUPPORTED,
                           "this MPI gives thread level %d; kdaserve needs MPI_THREAD_SERIALIZED "
                           "(its service calls MPI from its engine thread)", provided);
    }
    rc = MPI_Comm_dup(MPI_COMM_WORLD, &s->comm);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(s->comm, MPI_ERRORS_RETURN);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(s->comm, &c->rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(s->comm, &c->size);
    if (rc != MPI_SUCCESS) {
        kds_status st = mpi_fail(c, rc, "communicator setup", err);
        mpi_free(c);
        c->ops = NULL;
        return st;
    }
    const size_t n = (size_t)c->size;
    s->scounts = calloc(n, sizeof(int));
    s->sdispls = calloc(n, sizeof(int));
    s->rcounts = calloc(n, sizeof(int));
    s->rdispls = calloc(n, sizeof(int));
    if (!s->scounts || !s->sdispls || !s->rcounts || !s->rdispls) {
        mpi_free(c);
        c->ops = NULL;
        return kds_err_set(err, KDS_NOMEM, "out of memory creating an MPI communicator");
    }
    return KDS_OK;
}
