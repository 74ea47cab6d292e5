/*
 * eng_membw.c - the machine's memory read bandwidth, measured the way
 * decode reads its weights (contract in eng.h): a streaming read of a
 * buffer several times the last-level cache, on as many threads as a
 * context uses, each thread reading its own contiguous share, in 2 MiB
 * pages where the kernel gives them (as the weights are held: see
 * eng_weights_mode), since 4 KiB pages read 15-20% slower in this
 * machine's fast minutes and the read is the best the memory can do.
 * And the machine's multiply-add peak, what a prefill is measured
 * against the same way (eng_madd_peak).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <unistd.h>

#include "eng.h"
#include "eng_pool.h"
#include "kern.h"
#include "kds_clock.h"

typedef struct read_job {
    const unsigned char *p;
    size_t share; /* bytes per task, a multiple of 256 */
    uint64_t sum[256]; /* a task's sum: up to four tasks on each of 64 threads */
} read_job;

static void read_task(void *arg, int task, int thread) {
    read_job *j = arg;
    (void)thread;
    j->sum[task] = kern_read_sum(j->p + j->share * (size_t)task, j->share);
}

size_t eng_llc_bytes(void) {
    size_t best = 0;
    for (int i = 0; i < 8; i++) {
        char path[96];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        unsigned long v = 0;
        char unit = 0;
        if (fscanf(f, "%lu%c", &v, &unit) < 1) v = 0;
        fclose(f);
        size_t b = unit == 'K' ? (size_t)v << 10 : unit == 'M' ? (size_t)v << 20 : (size_t)v;
        if (b > best) best = b;
    }
    return best;
}

size_t eng_read_bandwidth_default_bytes(void) {
    const size_t gib = (size_t)1 << 30, four_llc = 4 * eng_llc_bytes();
    return four_llc > gib ? four_llc : gib;
}

struct eng_membw {
    eng_pool *pool; /* NULL on one thread */
    unsigned char *buf;
    int n_threads, n_tasks;
    size_t share, total;
};

kds_status eng_membw_create(int n_threads, size_t bytes, eng_membw **out, kds_err *err) {
    kds_status rc = KDS_OK;
    eng_membw *b = NULL;
    if (!out) return kds_err_set(err, KDS_INVALID_ARG, "eng_membw_create: no output");
    *out = NULL;
    if (n_threads < 1 || n_threads > 64)
        return kds_err_set(err, KDS_INVALID_ARG, "eng_membw_create: %d threads (want 1..64)",
                           n_threads);
    /* four tasks per thread, as the forward pass cuts its products */
    const int n_tasks = n_threads == 1 ? 1 : 4 * n_threads;
    const size_t share = bytes / (size_t)n_tasks / 256 * 256;
    if (share == 0)
        return kds_err_set(err, KDS_INVALID_ARG, "eng_membw_create: %zu bytes is too few", bytes);
    if (!(b = calloc(1, sizeof *b))) return kds_err_set(err, KDS_NOMEM, "out of memory");
    b->n_threads = n_threads;
    b->n_tasks = n_tasks;
    b->share = share;
    b->total = share * (size_t)n_tasks;
    const size_t huge = (size_t)2 << 20, span = (b->total + huge - 1) / huge * huge;
    if (!(b->buf = aligned_alloc(huge, span))) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory for a %zu MiB read buffer",
                         b->total >> 20);
        goto fail;
    }
    (void)madvise(b->buf, span, MADV_HUGEPAGE); /* a hint: 4 KiB pages where THP is off */
    /* written once, so that every page is real memory, not the zero page */
    for (size_t i = 0; i < b->total; i += 8) {
        uint64_t v = i * 0x9e3779b97f4a7c15ull;
        memcpy(b->buf + i, &v, 8);
    }
    if (n_threads > 1 && (rc = eng_pool_create(n_threads, &b->pool, err)) != KDS_OK) goto fail;
    *out = b;
    return KDS_OK;
fail:
    eng_membw_free(b);
    return rc;
}

/* One read of the buffer: its seconds. */
static double read_once(eng_membw *b) {
    read_job j = {.p = b->buf, .share = b->share};
    const double t0 = kds_now_s();
    if (b->pool)
        eng_pool_run(b->pool, read_task, &j, b->n_tasks);
    else
        read_task(&j, 0, 0);
    const double dt = kds_now_s() - t0;
    uint64_t sum = 0;
    for (int t = 0; t < b->n_tasks; t++) sum += j.sum[t];
    /* the sum is used (never 1 for these bytes), so no read is dead */
    return sum != 1 ? dt : 0.0;
}

double eng_membw_read(eng_membw *b, int reps) {
    double best = 0.0;
    for (int r = 0; r < reps; r++) {
        const double dt = read_once(b);
        if (dt > 0 && b->total / dt / 1e9 > best) best = b->total / dt / 1e9;
    }
    return best;
}

double eng_membw_read_for(eng_membw *b, double seconds, double *best, int *reads) {
    double spent = 0.0, top = 0.0;
    int n = 0;
    do {
        const double dt = read_once(b);
        if (dt > 0 && b->total / dt / 1e9 > top) top = b->total / dt / 1e9;
        spent += dt;
        n++;
    } while (spent < seconds);
    if (best) *best = top;
    if (reads) *reads = n;
    return spent > 0 ? (double)b->total * n / spent / 1e9 : 0.0;
}

void eng_membw_free(eng_membw *b) {
    if (!b) return;
    eng_pool_free(b->pool);
    free(b->buf);
    free(b);
}

kds_status eng_read_bandwidth(int n_threads, size_t bytes, int reps, double *gbs, kds_err *err) {
    if (!gbs) return kds_err_set(err, KDS_INVALID_ARG, "eng_read_bandwidth: no output");
    *gbs = 0.0;
    if (reps < 1)
        return kds_err_set(err, KDS_INVALID_ARG, "eng_read_bandwidth: %d repeats (want >= 1)",
                           reps);
    eng_membw *b = NULL;
    const kds_status rc = eng_membw_create(n_threads, bytes, &b, err);
    if (rc != KDS_OK) return rc;
    *gbs = eng_membw_read(b, reps);
    eng_membw_free(b);
    return KDS_OK;
}

bool eng_cpu_bf16_products(void) { return kern_bf16_products(); }

bool eng_cpu_bf16_tiles(void) { return kern_bf16_tiles(); }

/* ------------------------------------------------------------------------ */
/* The multiply-add peak                                                     */

/* Tasks of `iters` rounds each: many small ones, so that a thread the pool
 * wakes late still gets its share. */
#define PEAK_TASKS 64

typedef struct peak_job {
    bool bf16;
    long iters;
    float sink[PEAK_TASKS]; /* a sum per task, so that no chain is dead */
} peak_job;

static void peak_task(void *arg, int task, int thread) {
    peak_job *j = arg;
    (void)thread;
    j->sink[task] = kern_madd_chains(j->bf16, j->iters);
}

kds_status eng_madd_peak(int n_threads, bool bf16, int reps, double *gflops, kds_err *err) {
    if (!gflops) return kds_err_set(err, KDS_INVALID_ARG, "eng_madd_peak: no output");
    *gflops = 0.0;
    if (n_threads < 1 || n_threads > 64 || reps < 1)
        return kds_err_set(err, KDS_INVALID_ARG,
                           "eng_madd_peak: %d threads, %d repeats (want 1..64, >= 1)", n_threads,
                           reps);
    const int per_round = kern_madd_per_round(bf16);
    if (per_round == 0)
        return kds_err_set(err, KDS_UNSUPPORTED,
                           bf16 ? "this build has no AVX-512 BF16 dot products"
                                : "this build has no vector FMAs (AVX-512, or AVX2 with FMA)");
    eng_pool *pool = NULL;
    if (n_threads > 1) {
        const kds_status rc = eng_pool_create(n_threads, &pool, err);
        if (rc != KDS_OK) return rc;
    }
    /* about 50 ms a run at 100 GFLOP/s a thread; a faster core is done sooner */
    peak_job j = {.bf16 = bf16, .iters = (long)(5e9 * n_threads / PEAK_TASKS / per_round / 2)};
    if (j.iters < 1) j.iters = 1;
    for (int r = 0; r <= reps; r++) { /* the first run wakes the cores: not counted */
        const double t0 = kds_now_s();
        if (pool)
            eng_pool_run(pool, peak_task, &j, PEAK_TASKS);
        else
            for (int t = 0; t < PEAK_TASKS; t++) peak_task(&j, t, 0);
        const double dt = kds_now_s() - t0;
        const double g = 2.0 * per_round * (double)j.iters * PEAK_TASKS / dt / 1e9;
        if (r > 0 && dt > 0 && j.sink[0] == j.sink[0] && g > *gflops) *gflops = g;
    }
    eng_pool_free(pool);
    return KDS_OK;
}
