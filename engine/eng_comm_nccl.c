/*
 * eng_comm_nccl.c - eng_comm.h over NCCL, device memory: one GPU per rank.
 *
 * Bootstrap over MPI (eng_comm_mpi.c, kept inside for the host-side
 * collectives): rank 0 makes the ncclUniqueId and broadcasts it, each rank
 * takes GPU (node-local rank mod visible GPUs) and joins a non-blocking
 * NCCL communicator. Collectives run on one non-blocking stream of ours and
 * are polled (ncclCommGetAsyncError, cudaStreamQuery) until done or the
 * deadline, then aborted (ncclCommAbort), so a dead peer is an error, not a
 * hang. allgather (the counts), the barrier and eng_comm_bcast_wait (a
 * waiting rank's commands) are host collectives and go over MPI.
 *
 * NCCL is opened with dlopen at creation (libnccl.so.2, or $KDS_NCCL_LIB):
 * like cuBLAS, nothing of it is mapped by a run that does not use it. Its
 * header is compiled in for the types only. The CUDA runtime is the static
 * one the kernels link.
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng_comm_impl.h"

typedef struct nccl_api {
    void *lib;
    ncclResult_t (*get_unique_id)(ncclUniqueId *);
    ncclResult_t (*init_rank_config)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
    ncclResult_t (*get_async_error)(ncclComm_t, ncclResult_t *);
    ncclResult_t (*abort)(ncclComm_t);
    ncclResult_t (*destroy)(ncclComm_t);
    ncclResult_t (*finalize)(ncclComm_t);
    ncclResult_t (*group_start)(void);
    ncclResult_t (*group_end)(void);
    ncclResult_t (*send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t,
                              cudaStream_t);
    const char *(*error_string)(ncclResult_t);
} nccl_api;

typedef struct nccl_state {
    eng_comm host;   /* the MPI communicator underneath (host collectives) */
    nccl_api api;
    ncclComm_t comm;
    cudaStream_t stream;
    int device;
} nccl_state;

static nccl_state *st_of(eng_comm *c) { return c->impl; }

static kds_status open_api(nccl_api *a, kds_err *err) {
    const char *env = getenv("KDS_NCCL_LIB");
    const char *soname = env && *env ? env : "libnccl.so.2";
    a->lib = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (!a->lib)
        return kds_err_set(err, KDS_UNSUPPORTED, "cannot open NCCL (%s): %s", soname, dlerror());
    struct {
        void **slot;
        const char *name;
    } syms[] = {
        {(void **)&a->get_unique_id, "ncclGetUniqueId"},
        {(void **)&a->init_rank_config, "ncclCommInitRankConfig"},
        {(void **)&a->get_async_error, "ncclCommGetAsyncError"},
        {(void **)&a->abort, "ncclCommAbort"},
        {(void **)&a->destroy, "ncclCommDestroy"},
        {(void **)&a->finalize, "ncclCommFinalize"},
        {(void **)&a->group_start, "ncclGroupStart"},
        {(void **)&a->group_end, "ncclGroupEnd"},
        {(void **)&a->send, "ncclSend"},
        {(void **)&a->recv, "ncclRecv"},
        {(void **)&a->broadcast, "ncclBroadcast"},
        {(void **)&a->error_string, "ncclGetErrorString"},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        *syms[i].slot = dlsym(a->lib, syms[i].name);
        if (!*syms[i].slot) {
            kds_status rc = kds_err_set(err, KDS_UNSUPPORTED, "%s lacks %s (NCCL 2.14 or newer "
                                        "needed)", soname, syms[i].name);
            dlclose(a->lib);
            a->lib = NULL;
            return rc;
        }
    }
    return KDS_OK;
}

/* ------------------------------------------------------------------------ */
/* Waiting on the stream with a deadline                                     */

typedef struct wait_arg {
    nccl_state *s;
    ncclResult_t nccl;   /* an asynchronous NCCL error */
    cudaError_t cuda;    /* a stream error */
} wait_arg;

static int stream_done(void *p) {
    wait_arg *w = p;
    ncclResult_t st = ncclSuccess;
    if (w->s->api.get_async_error(w->s->comm, &st) != ncclSuccess || 
        (st != ncclSuccess && st != ncclInProgress)) {
        w->nccl = st == ncclSuccess ? ncclInternalError : st;
        return -1;
    }
    if (st == ncclInProgress) return 0; /* the group's launch is still being set up */
    cudaError_t q = cudaStreamQuery(w->s->stream);
    if (q == cudaSuccess) return 1;
    if (q == cudaErrorNotReady) return 0;
    w->cuda = q;
    return -1;
}

static kds_status wait_stream(eng_comm *c, const char *what, kds_err *err) {
    nccl_state *s = st_of(c);
    wait_arg w = {s, ncclSuccess, cudaSuccess};
    int r = eng__comm_poll(stream_done, &w, c->timeout_ms);
    if (r > 0) return KDS_OK;
    /* an operation that cannot finish: abort the communicator so the GPU is freed */
    s->api.abort(s->comm);
    s->comm = NULL;
    if (r == 0)
        return kds_err_set(err, KDS_COMM,
                           "rank %d: NCCL %s did not complete within %d ms: another rank died or "
                           "hangs (KDASERVE_EP_TIMEOUT sets the deadline)", c->rank, what,
                           c->timeout_ms);
    if (w.cuda != cudaSuccess)
        return kds_err_set(err, KDS_COMM, "rank %d: NCCL %s: CUDA error %s", c->rank, what,
                           cudaGetErrorString(w.cuda));
    return kds_err_set(err, KDS_COMM, "rank %d: NCCL %s: %s", c->rank, what,
                       s->api.error_string(w.nccl));
}

static kds_status nccl_call(eng_comm *c, ncclResult_t r, const char *what, kds_err *err) {
    if (r == ncclSuccess || r == ncclInProgress) return KDS_OK;
    return kds_err_set(err, KDS_COMM, "rank %d: NCCL %s: %s", c->rank, what,
                       st_of(c)->api.error_string(r));
}

/* ------------------------------------------------------------------------ */
/* The ops                                                                   */

static void nccl_free(eng_comm *c) {
    nccl_state *s = st_of(c);
    if (!s) return;
    if (s->comm) {
        if (!c->broken && s->api.finalize(s->comm) == ncclSuccess) {
            wait_arg w = {s, ncclSuccess, cudaSuccess};
            eng__comm_poll(stream_done, &w, c->timeout_ms);
            s->api.destroy(s->comm);
        } else {
            s->api.abort(s->comm);
        }
    }
    if (s->stream) cudaStreamDestroy(s->stream);
    if (s->api.lib) dlclose(s->api.lib);
    s->host.broken = c->broken;
    if (s->host.ops) s->host.ops->free(&s->host);
    free(s);
    c->impl = NULL;
}

static void nccl_abort(eng_comm *c, int code) {
    nccl_state *s = st_of(c);
    if (s && s->comm) s->api.abort(s->comm);
    s->host.ops->abort(&s->host, code);
}

static kds_status nccl_barrier(eng_comm *c, kds_err *err) {
    nccl_state *s = st_of(c);
    return s->host.ops->barrier(&s->host, err);
}

static kds_status nccl_bcast(eng_comm *c, void *buf, size_t bytes, int root, bool deadline,
                             kds_err *err) {
    nccl_state *s = st_of(c);
    if (!deadline) return s->host.ops->bcast(&s->host, buf, bytes, root, false, err);
    if (bytes == 0) return KDS_OK;
    kds_status rc = nccl_call(c, s->api.broadcast(buf, buf, bytes, ncclUint8, root, s->comm,
                                                  s->stream), "broadcast", err);
    if (rc != KDS_OK) return rc;
    return wait_stream(c, "broadcast", err);
}

static kds_status nccl_allgather(eng_comm *c, const void *mine, size_t bytes, void *all,
                                 kds_err *err) {
    nccl_state *s = st_of(c);
    return s->host.ops->allgather(&s->host, mine, bytes, all, err);
}

static kds_status nccl_alltoallv(eng_comm *c, const void *send, const int64_t *send_rows,
                                 const int64_t *send_off, void *recv, const int64_t *recv_rows,
                                 const int64_t *recv_off, size_t row_bytes, kds_err *err) {
    nccl_state *s = st_of(c);
    kds_status rc = nccl_call(c, s->api.group_start(), "group start", err);
    for (int r = 0; r < c->size && rc == KDS_OK; r++) {
        if (send_rows[r] > 0)
            rc = nccl_call(c, s->api.send((const char *)send + (size_t)send_off[r] * row_bytes,
                                          (size_t)send_rows[r] * row_bytes, ncclUint8, r, s->comm,
                                          s->stream), "send", err);
        if (rc == KDS_OK && recv_rows[r] > 0)
            rc = nccl_call(c, s->api.recv((char *)recv + (size_t)recv_off[r] * row_bytes,
                                          (size_t)recv_rows[r] * row_bytes, ncclUint8, r, s->comm,
                                          s->stream), "recv", err);
    }
    /* the group is closed even after a failed enqueue: NCCL wants its end */
    kds_status end = nccl_call(c, s->api.group_end(), "group end", err);
    if (rc == KDS_OK) rc = end;
    if (rc != KDS_OK) return rc;
    return wait_stream(c, "alltoallv (rows to and from the experts' ranks)", err);
}

static const eng_comm_ops NCCL_OPS = {
    .kind = ENG_COMM_NCCL,
    .device_memory = true,
    .free = nccl_free,
    .abort = nccl_abort,
    .barrier = nccl_barrier,
    .bcast = nccl_bcast,
    .allgather = nccl_allgather,
    .alltoallv = nccl_alltoallv,
};

/* The rank's index among the ranks on its node (Open MPI says; else 0). */
static int local_rank(void) {
    const char *v = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    if (!v) v = getenv("MPI_LOCALRANKID");
    if (!v) v = getenv("SLURM_LOCALID");
    return v ? atoi(v) : 0;
}

kds_status eng__comm_nccl_create(eng_comm *c, int *argc, char ***argv, kds_err *err) {
    nccl_state *s = calloc(1, sizeof *s);
    if (!s) return kds_err_set(err, KDS_NOMEM, "out of memory creating an NCCL communicator");
    s->host.timeout_ms = c->timeout_ms;
    kds_status rc = eng__comm_mpi_create(&s->host, argc, argv, err);
    if (rc != KDS_OK) {
        free(s);
        return rc;
    }
    c->impl = s;
    c->ops = &NCCL_OPS;
    c->rank = s->host.rank;
    c->size = s->host.size;
    /* Every rank learns whether every other one got this far, so a rank
     * without NCCL or a GPU fails the job at once instead of leaving the
     * others in the id broadcast. */
    kds_err local = {0};
    int n_dev = 0;
    rc = open_api(&s->api, &local);
    if (rc == KDS_OK) {
        cudaError_t e = cudaGetDeviceCount(&n_dev);
        if (e != cudaSuccess || n_dev == 0)
            rc = kds_err_set(&local, KDS_UNSUPPORTED, "rank %d: no usable GPU (%s)", c->rank,
                             e != cudaSuccess ? cudaGetErrorString(e) : "none visible");
    }
    if (rc == KDS_OK) {
        s->device = local_rank() % n_dev;
        cudaError_t e = cudaSetDevice(s->device);
        if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking);
        if (e != cudaSuccess)
            rc = kds_err_set(&local, KDS_CUDA, "rank %d: GPU %d: %s", c->rank, s->device,
                             cudaGetErrorString(e));
    }
    int *ok = calloc((size_t)c->size, sizeof *ok);
    const int mine = rc == KDS_OK;
    kds_status ag = ok ? s->host.ops->allgather(&s->host, &mine, sizeof mine, ok, err)
                       : kds_err_set(err, KDS_NOMEM, "out of memory");
    int bad = -1;
    for (int r = 0; ag == KDS_OK && r < c->size && bad < 0; r++)
        if (!ok[r]) bad = r;
    free(ok);
    if (ag != KDS_OK || rc != KDS_OK || bad >= 0) {
        if (rc != KDS_OK && err) *err = local;
        else if (ag == KDS_OK)
            kds_err_set(err, KDS_UNSUPPORTED, "rank %d could not set up NCCL or its GPU", bad);
        rc = rc != KDS_OK ? rc : ag != KDS_OK ? ag : KDS_UNSUPPORTED;
        nccl_free(c);
        c->ops = NULL;
        return rc;
    }
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (c->rank == 0 && (rc = nccl_call(c, s->api.get_unique_id(&id), "unique id", err)) != KDS_OK) {
        /* the others wait in the broadcast below until their deadline */
        nccl_free(c);
        c->ops = NULL;
        return rc;
    }
    rc = s->host.ops->bcast(&s->host, &id, sizeof id, 0, true, err);
    if (rc == KDS_OK) {
        ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
        cfg.blocking = 0; /* so the join itself can time out */
        rc = nccl_call(c, s->api.init_rank_config(&s->comm, c->size, id, c->rank, &cfg),
                       "communicator init", err);
    }
    if (rc == KDS_OK) {
        wait_arg w = {s, ncclSuccess, cudaSuccess};
        ncclResult_t st = ncclInProgress;
        for (int r; st == ncclInProgress;) {
            r = eng__comm_poll(stream_done, &w, c->timeout_ms);
            if (r <= 0) break;
            s->api.get_async_error(s->comm, &st);
        }
        if (st != ncclSuccess)
            rc = kds_err_set(err, KDS_COMM, "rank %d: NCCL communicator init: %s", c->rank,
                             st == ncclInProgress ? "timed out" : s->api.error_string(st));
    }
    if (rc != KDS_OK) {
        c->broken = true;
        nccl_free(c);
        c->ops = NULL;
        return rc;
    }
    return KDS_OK;
}
