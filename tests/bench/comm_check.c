/*
 * comm_check.c - the communicator's collectives (engine/eng_comm.h) checked
 * in a real job, and timed. Built by CMake as `kds_comm_check` with MPI;
 * run by tests/test_ep.c through mpirun (and on a GPU machine for NCCL):
 *
 *   mpirun -np N kds_comm_check [--comm mpi|nccl]
 *       every collective with contents that name their source, destination
 *       and position (broadcast from every root, the all-gather, an
 *       all-to-all whose row counts differ per pair and include zeros),
 *       through device buffers for nccl; prints "comm check ok: ..." on
 *       rank 0 and exits 0, or names the first wrong byte and exits 1;
 *   mpirun -np N kds_comm_check --stall-rank R --timeout-ms T
 *       rank R sleeps 3 T before a barrier: every other rank must fail it
 *       with KDS_COMM after about T ms (prints "rank r: timed out as
 *       expected after X ms"), then the job is ended with eng_comm_abort;
 *   mpirun -np N kds_comm_check --bench ROWS [--row-bytes B]
 *       all-to-all of ROWS rows of B bytes (default 9216: a 2304-wide f32
 *       hidden row) from every rank to every rank: median time, GB/s.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "eng_comm.h"
#include "kds_clock.h"
#ifdef KDS_HAVE_CUDA
#include "kern_cuda.h"
#endif

/* Buffers in the communicator's memory (the GPU's for nccl). */
typedef struct mem {
    bool device;
} mem;

static void *mem_alloc(const mem *m, size_t bytes) {
#ifdef KDS_HAVE_CUDA
    if (m->device) {
        void *p = NULL;
        kds_err err = {0};
        if (kern_cuda_malloc(&p, bytes ? bytes : 1, &err) != KDS_OK) {
            fprintf(stderr, "comm check: %s\n", err.msg);
            exit(1);
        }
        return p;
    }
#endif
    (void)m;
    void *p = calloc(bytes ? bytes : 1, 1);
    if (!p) exit(1);
    return p;
}

static void mem_free(const mem *m, void *p) {
#ifdef KDS_HAVE_CUDA
    if (m->device) {
        kern_cuda_free(p);
        return;
    }
#endif
    (void)m;
    free(p);
}

static void to_mem(const mem *m, void *dst, const void *src, size_t n) {
#ifdef KDS_HAVE_CUDA
    if (m->device) {
        kern_cuda_memcpy_h2d(dst, src, n, NULL, NULL);
        kern_cuda_sync(NULL, NULL);
        return;
    }
#endif
    (void)m;
    memcpy(dst, src, n);
}

static void from_mem(const mem *m, void *dst, const void *src, size_t n) {
#ifdef KDS_HAVE_CUDA
    if (m->device) {
        kern_cuda_memcpy_d2h(dst, src, n, NULL, NULL);
        kern_cuda_sync(NULL, NULL);
        return;
    }
#endif
    (void)m;
    memcpy(dst, src, n);
}

static int fail(eng_comm *c, const char *what, const kds_err *err) {
    fprintf(stderr, "comm check: rank %d: %s%s%s\n", eng_comm_rank(c), what, err ? ": " : "",
            err ? err->msg : "");
    return 1;
}

/* Rows rank s sends rank d in the check: differs per pair, zero for some. */
static int64_t rows_of(int s, int d) { return (s * 7 + d * 3) % 5; }
static unsigned char byte_of(int s, int d, int64_t row, size_t i) {
    return (unsigned char)(s * 31 + d * 17 + row * 5 + i);
}

static int check(eng_comm *c, const mem *m) {
    const int N = eng_comm_size(c), me = eng_comm_rank(c);
    kds_err err = {0};
    if (eng_comm_barrier(c, &err) != KDS_OK) return fail(c, "barrier", &err);
    /* broadcast from every root */
    const size_t nb = 1000;
    unsigned char *host = malloc(nb), *dev = mem_alloc(m, nb);
    for (int root = 0; root < N; root++) {
        for (size_t i = 0; i < nb; i++) host[i] = me == root ? (unsigned char)(root + i) : 0xee;
        to_mem(m, dev, host, nb);
        if (eng_comm_bcast(c, dev, nb, root, &err) != KDS_OK) return fail(c, "broadcast", &err);
        from_mem(m, host, dev, nb);
        for (size_t i = 0; i < nb; i++)
            if (host[i] != (unsigned char)(root + i)) return fail(c, "broadcast: wrong byte", NULL);
    }
    mem_free(m, dev);
    free(host);
    /* all-gather (host memory always) */
    int32_t mine[4] = {me, me * 2, -me, 7}, *all = calloc((size_t)N * 4, sizeof *all);
    if (eng_comm_allgather(c, mine, sizeof mine, all, &err) != KDS_OK)
        return fail(c, "allgather", &err);
    for (int r = 0; r < N; r++)
        if (all[4 * r] != r || all[4 * r + 1] != 2 * r || all[4 * r + 2] != -r || all[4 * r + 3] != 7)
            return fail(c, "allgather: wrong value", NULL);
    free(all);
    /* all-to-all of rows: 12-byte rows, counts exchanged first */
    const size_t rb = 12;
    int64_t *sr = calloc((size_t)N, 8), *so = calloc((size_t)N, 8), *rr = calloc((size_t)N, 8),
            *ro = calloc((size_t)N, 8), *counts = calloc((size_t)N * N, 8);
    int64_t ns = 0, nr = 0;
    for (int d = 0; d < N; d++) {
        so[d] = ns;
        sr[d] = rows_of(me, d);
        ns += sr[d];
    }
    if (eng_comm_allgather(c, sr, (size_t)N * 8, counts, &err) != KDS_OK)
        return fail(c, "allgather of counts", &err);
    for (int s = 0; s < N; s++) {
        ro[s] = nr;
        rr[s] = counts[(size_t)s * N + me];
        nr += rr[s];
    }
    unsigned char *sh = malloc((size_t)ns * rb + 1), *rh = malloc((size_t)nr * rb + 1);
    for (int d = 0; d < N; d++)
        for (int64_t r = 0; r < sr[d]; r++)
            for (size_t i = 0; i < rb; i++) sh[(size_t)(so[d] + r) * rb + i] = byte_of(me, d, r, i);
    void *sd = mem_alloc(m, (size_t)ns * rb), *rd = mem_alloc(m, (size_t)nr * rb);
    to_mem(m, sd, sh, (size_t)ns * rb);
    if (eng_comm_alltoallv(c, sd, sr, so, rd, rr, ro, rb, &err) != KDS_OK)
        return fail(c, "alltoallv", &err);
    from_mem(m, rh, rd, (size_t)nr * rb);
    for (int s = 0; s < N; s++)
        for (int64_t r = 0; r < rr[s]; r++)
            for (size_t i = 0; i < rb; i++)
                if (rh[(size_t)(ro[s] + r) * rb + i] != byte_of(s, me, r, i)) {
                    fprintf(stderr, "comm check: rank %d: row %lld from rank %d, byte %zu wrong\n",
                            me, (long long)r, s, i);
                    return 1;
                }
    mem_free(m, sd);
    mem_free(m, rd);
    free(sh), free(rh), free(sr), free(so), free(rr), free(ro), free(counts);
    /* a refused argument leaves the communicator working */
    int64_t bad[64] = {-1};
    if (N <= 64 && eng_comm_alltoallv(c, NULL, bad, bad, NULL, bad, bad, rb, &err) != KDS_INVALID_ARG)
        return fail(c, "alltoallv with a negative count was not refused", NULL);
    if (eng_comm_barrier(c, &err) != KDS_OK) return fail(c, "barrier after a refusal", &err);
    if (me == 0)
        printf("comm check ok: %d ranks (%s%s)\n", N, eng_comm_kind_name(eng_comm_kind_of(c)),
               m->device ? ", device buffers" : "");
    return 0;
}

static int stall(eng_comm *c, int rank, int timeout_ms) {
    kds_err err = {0};
    if (eng_comm_rank(c) == rank) {
        struct timespec ts = {(time_t)(timeout_ms * 3 / 1000), (long)(timeout_ms * 3 % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    double t0 = 1e3 * kds_now_s();
    kds_status rc = eng_comm_barrier(c, &err);
    double dt = 1e3 * kds_now_s() - t0;
    if (eng_comm_rank(c) == rank) return 0;
    if (rc != KDS_COMM) return fail(c, "the barrier did not time out", NULL);
    printf("rank %d: timed out as expected after %.0f ms: %s\n", eng_comm_rank(c), dt, err.msg);
    fflush(stdout);
    if (!eng_comm_broken(c, NULL)) return fail(c, "a timed-out communicator is not broken", NULL);
    if (eng_comm_barrier(c, &err) != KDS_COMM) return fail(c, "a broken communicator worked", NULL);
    eng_comm_abort(c, 0);
    return 0;
}

static int bench(eng_comm *c, const mem *m, int64_t rows, size_t rb, int reps) {
    const int N = eng_comm_size(c);
    int64_t *sr = calloc((size_t)N, 8), *so = calloc((size_t)N, 8);
    for (int d = 0; d < N; d++) sr[d] = rows, so[d] = rows * d;
    void *s = mem_alloc(m, (size_t)(rows * N) * rb), *r = mem_alloc(m, (size_t)(rows * N) * rb);
    kds_err err = {0};
    double *t = calloc((size_t)reps, sizeof *t);
    for (int i = -2; i < reps; i++) {
        eng_comm_barrier(c, NULL);
        double t0 = 1e3 * kds_now_s();
        if (eng_comm_alltoallv(c, s, sr, so, r, sr, so, rb, &err) != KDS_OK)
            return fail(c, "alltoallv", &err);
        if (i >= 0) t[i] = 1e3 * kds_now_s() - t0;
    }
    for (int i = 1; i < reps; i++) /* insertion sort: a few values */
        for (int j = i; j > 0 && t[j - 1] > t[j]; j--) {
            double x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
    if (eng_comm_rank(c) == 0)
        printf("alltoallv %d ranks, %lld rows of %zu B per pair: median %.3f ms, %.2f GB/s out of "
               "each rank\n", N, (long long)rows, rb, t[reps / 2],
               (double)rows * (N - 1) * rb / (t[reps / 2] * 1e6));
    mem_free(m, s);
    mem_free(m, r);
    free(sr), free(so), free(t);
    return 0;
}

int main(int argc, char **argv) {
    eng_comm_params p = eng_comm_default_params();
    p.kind = ENG_COMM_MPI;
    int stall_rank = -1, reps = 20;
    int64_t bench_rows = 0;
    size_t rb = 9216;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--comm") && i + 1 < argc) {
            i++;
            p.kind = !strcmp(argv[i], "nccl") ? ENG_COMM_NCCL
                     : !strcmp(argv[i], "single") ? ENG_COMM_SINGLE : ENG_COMM_MPI;
        } else if (!strcmp(argv[i], "--stall-rank") && i + 1 < argc) {
            stall_rank = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--timeout-ms") && i + 1 < argc) {
            p.timeout_ms = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--bench") && i + 1 < argc) {
            bench_rows = atoll(argv[++i]);
        } else if (!strcmp(argv[i], "--row-bytes") && i + 1 < argc) {
            rb = (size_t)atoll(argv[++i]);
        } else {
            fprintf(stderr, "usage: kds_comm_check [--comm mpi|nccl|single] [--timeout-ms T] "
                            "[--stall-rank R] [--bench ROWS [--row-bytes B]]\n");
            return 2;
        }
    }
    eng_comm *c = NULL;
    kds_err err = {0};
    if (eng_comm_create(&p, &argc, &argv, &c, &err) != KDS_OK) {
        fprintf(stderr, "comm check: %s\n", err.msg);
        return err.status == KDS_UNSUPPORTED ? 77 : 1; /* 77: the setup lacks it (a skip) */
    }
    const mem m = {eng_comm_device_memory(c)};
    int rc = stall_rank >= 0 ? stall(c, stall_rank, p.timeout_ms)
             : bench_rows > 0 ? bench(c, &m, bench_rows, rb, reps)
                              : check(c, &m);
    if (rc != 0) eng_comm_abort(c, rc);
    eng_comm_free(c);
    return 0;
}
