/*
 * eng_comm.c - the communicator's front (eng_comm.h): argument checks, the
 * broken state, the single-rank implementation, and the wait with a
 * deadline that the MPI and NCCL implementations poll with.
 */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "eng_comm_impl.h"
#include "kds_clock.h"

eng_comm_params eng_comm_default_params(void) {
    return (eng_comm_params){.kind = ENG_COMM_AUTO, .timeout_ms = ENG_COMM_DEFAULT_TIMEOUT_MS};
}

bool eng_comm_launched(void) {
    /* Open MPI's mpirun; PMIx and PMI launchers (srun, MPICH's hydra) */
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return true;
    }
    return false;
}

bool eng_comm_available(eng_comm_kind kind) {
    switch (kind) {
    case ENG_COMM_AUTO:
    case ENG_COMM_SINGLE: return true;
    case ENG_COMM_MPI:
#ifdef KDS_HAVE_MPI
        return true;
#else
        return false;
#endif
    case ENG_COMM_NCCL:
#ifdef KDS_HAVE_NCCL
        return true;
#else
        return false;
#endif
    }
    return false;
}

const char *eng_comm_kind_name(eng_comm_kind kind) {
    switch (kind) {
    case ENG_COMM_AUTO: return "auto";
    case ENG_COMM_SINGLE: return "single";
    case ENG_COMM_MPI: return "mpi";
    case ENG_COMM_NCCL: return "nccl";
    }
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* Waiting                                                                   */

int eng__comm_poll(int (*done)(void *arg), void *arg, int timeout_ms) {
    const double t0 = 1e3 * kds_now_s();
    long sleep_ns = 10000;
    for (;;) {
        int r = done(arg);
        if (r != 0) return r > 0 ? 1 : -1;
        const double waited = 1e3 * kds_now_s() - t0;
        if (timeout_ms > 0 && waited > timeout_ms) return 0;
        /* Within a pass a rank waits for the others' compute of a layer
         * (tens of microseconds to milliseconds): yield for the first 2 ms
         * (another rank may need this core), then sleep in short steps,
         * since only MPI calls move a nonblocking collective on (a rank
         * that sleeps long delays the others' part too). A rank waiting
         * between requests (no deadline) backs off to 1 ms. */
        if (waited < 2.0) {
            sched_yield();
            continue;
        }
        struct timespec ts = {0, sleep_ns};
        nanosleep(&ts, NULL);
        const long cap = timeout_ms > 0 ? 50000 : 1000000;
        if (sleep_ns < cap) sleep_ns = sleep_ns * 2 < cap ? sleep_ns * 2 : cap;
    }
}

/* ------------------------------------------------------------------------ */
/* One rank                                                                  */

static void single_free(eng_comm *c) { (void)c; }

static void single_abort(eng_comm *c, int code) {
    (void)c;
    exit(code);
}

static kds_status single_barrier(eng_comm *c, kds_err *err) {
    (void)c, (void)err;
    return KDS_OK;
}

static kds_status single_bcast(eng_comm *c, void *buf, size_t bytes, int root, bool deadline,
                               kds_err *err) {
    (void)c, (void)buf, (void)bytes, (void)root, (void)deadline, (void)err;
    return KDS_OK;
}

static kds_status single_allgather(eng_comm *c, const void *mine, size_t bytes, void *all,
                                   kds_err *err) {
    (void)c, (void)err;
    if (bytes) memmove(all, mine, bytes);
    return KDS_OK;
}

static kds_status single_alltoallv(eng_comm *c, const void *send, const int64_t *send_rows,
                                   const int64_t *send_off, void *recv, const int64_t *recv_rows,
                                   const int64_t *recv_off, size_t row_bytes, kds_err *err) {
    (void)c, (void)recv_rows, (void)err;
    if (send_rows[0])
        memmove((char *)recv + (size_t)recv_off[0] * row_bytes,
                (const char *)send + (size_t)send_off[0] * row_bytes,
                (size_t)send_rows[0] * row_bytes);
    return KDS_OK;
}

static const eng_comm_ops SINGLE_OPS = {
    .kind = ENG_COMM_SINGLE,
    .device_memory = false,
    .free = single_free,
    .abort = single_abort,
    .barrier = single_barrier,
    .bcast = single_bcast,
    .allgather = single_allgather,
    .alltoallv = single_alltoallv,
};

/* ------------------------------------------------------------------------ */
/* The front                                                                 */

kds_status eng_comm_create(const eng_comm_params *p, int *argc, char ***argv, eng_comm **out,
                           kds_err *err) {
    *out = NULL;
    eng_comm_params q = p ? *p : eng_comm_default_params();
    if (q.timeout_ms <= 0) q.timeout_ms = ENG_COMM_DEFAULT_TIMEOUT_MS;
    eng_comm_kind kind = q.kind;
    if (kind == ENG_COMM_AUTO) kind = eng_comm_launched() ? ENG_COMM_MPI : ENG_COMM_SINGLE;
    if (!eng_comm_kind_name(kind))
        return kds_err_set(err, KDS_INVALID_ARG, "unknown communicator kind %d", (int)kind);
    if (!eng_comm_available(kind))
        return kds_err_set(err, KDS_UNSUPPORTED,
                           "this kdaserve was built without %s (%s)", eng_comm_kind_name(kind),
                           kind == ENG_COMM_MPI
                               ? "install libopenmpi-dev and openmpi-bin, then reconfigure"
                               : "needs CUDA, NCCL and MPI at configure time");
    eng_comm *c = calloc(1, sizeof *c);
    if (!c) return kds_err_set(err, KDS_NOMEM, "out of memory creating a communicator");
    c->timeout_ms = q.timeout_ms;
    c->size = 1;
    kds_status rc = KDS_OK;
    switch (kind) {
    case ENG_COMM_AUTO:
    case ENG_COMM_SINGLE: c->ops = &SINGLE_OPS; break;
    case ENG_COMM_MPI:
#ifdef KDS_HAVE_MPI
        rc = eng__comm_mpi_create(c, argc, argv, err);
#endif
        break;
    case ENG_COMM_NCCL:
#ifdef KDS_HAVE_NCCL
        rc = eng__comm_nccl_create(c, argc, argv, err);
#endif
        break;
    }
    (void)argc, (void)argv;
    if (rc != KDS_OK || !c->ops) {
        free(c);
        return rc != KDS_OK ? rc : kds_err_set(err, KDS_INTERNAL, "no communicator made");
    }
    *out = c;
    return KDS_OK;
}

void eng_comm_free(eng_comm *c) {
    if (!c) return;
    c->ops->free(c);
    free(c);
}

void eng_comm_abort(eng_comm *c, int code) {
    fflush(stdout);
    fflush(stderr);
    if (!c) exit(code);
    c->ops->abort(c, code);
    exit(code); /* an implementation's abort returned: end this rank at least */
}

int eng_comm_rank(const eng_comm *c) { return c->rank; }
int eng_comm_size(const eng_comm *c) { return c->size; }
eng_comm_kind eng_comm_kind_of(const eng_comm *c) { return c->ops->kind; }
bool eng_comm_device_memory(const eng_comm *c) { return c->ops->device_memory; }
int eng_comm_timeout_ms(const eng_comm *c) { return c->timeout_ms; }

bool eng_comm_broken(const eng_comm *c, const char **why) {
    const bool b = atomic_load(&c->broken); /* `why` was written before */
    if (why) *why = b ? c->why : "";
    return b;
}

/* Refuse calls on a broken communicator; after a call, a KDS_COMM breaks it. */
static kds_status refuse_broken(const eng_comm *c, kds_err *err) {
    if (!c->broken) return KDS_OK;
    return kds_err_set(err, KDS_COMM, "%s", c->why);
}

static kds_status after(eng_comm *c, kds_status rc, kds_err *err) {
    if (rc == KDS_COMM && !atomic_load(&c->broken)) {
        snprintf(c->why, sizeof c->why, "%s", err && err->msg[0] ? err->msg : "a collective failed");
        atomic_store(&c->broken, true);
    }
    return rc;
}

kds_status eng_comm_barrier(eng_comm *c, kds_err *err) {
    kds_status rc = refuse_broken(c, err);
    if (rc != KDS_OK) return rc;
    return after(c, c->ops->barrier(c, err), err);
}

static kds_status check_root(const eng_comm *c, int root, kds_err *err) {
    if (root < 0 || root >= c->size)
        return kds_err_set(err, KDS_INVALID_ARG, "broadcast root %d outside [0, %d)", root, c->size);
    return KDS_OK;
}

kds_status eng_comm_bcast(eng_comm *c, void *buf, size_t bytes, int root, kds_err *err) {
    kds_status rc = refuse_broken(c, err);
    if (rc == KDS_OK) rc = check_root(c, root, err);
    if (rc != KDS_OK) return rc;
    return after(c, c->ops->bcast(c, buf, bytes, root, true, err), err);
}

kds_status eng_comm_bcast_wait(eng_comm *c, void *buf, size_t bytes, int root, kds_err *err) {
    kds_status rc = refuse_broken(c, err);
    if (rc == KDS_OK) rc = check_root(c, root, err);
    if (rc != KDS_OK) return rc;
    return after(c, c->ops->bcast(c, buf, bytes, root, false, err), err);
}

kds_status eng_comm_allgather(eng_comm *c, const void *mine, size_t bytes, void *all,
                              kds_err *err) {
    kds_status rc = refuse_broken(c, err);
    if (rc != KDS_OK) return rc;
    return after(c, c->ops->allgather(c, mine, bytes, all, err), err);
}

kds_status eng_comm_alltoallv(eng_comm *c, const void *send, const int64_t *send_rows,
                              const int64_t *send_off, void *recv, const int64_t *recv_rows,
                              const int64_t *recv_off, size_t row_bytes, kds_err *err) {
    kds_status rc = refuse_broken(c, err);
    if (rc != KDS_OK) return rc;
    if (row_bytes == 0) return kds_err_set(err, KDS_INVALID_ARG, "alltoallv of 0-byte rows");
    for (int r = 0; r < c->size; r++)
        if (send_rows[r] < 0 || recv_rows[r] < 0 || send_off[r] < 0 || recv_off[r] < 0 ||
            send_rows[r] > INT32_MAX || recv_rows[r] > INT32_MAX ||
            send_off[r] > INT32_MAX || recv_off[r] > INT32_MAX)
            return kds_err_set(err, KDS_INVALID_ARG,
                               "alltoallv: rows or offsets for rank %d outside [0, 2^31)", r);
    return after(c, c->ops->alltoallv(c, send, send_rows, send_off, recv, recv_rows, recv_off,
                                      row_bytes, err), err);
}
