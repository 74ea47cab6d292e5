/* eng_pool.c - fork-join pool: atomic task counter, spin-then-sleep workers. */
#include "eng_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* Spin this many rounds for the next run before sleeping (~100 µs). */
#define POOL_SPIN_ROUNDS 20000

typedef struct worker {
    eng_pool *pool;
    int index;
    pthread_t thread;
} worker;

struct eng_pool {
    int n_threads;
    worker *workers;            /* n_threads - 1 */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_uint generation;     /* bumped once per run */
    atomic_int sleepers;
    atomic_bool stop;
    /* the current run */
    eng_pool_fn fn;
    void *arg;
    atomic_int n_tasks;
    /* (generation << 32) | next task index: a worker takes a task only while
     * the generation it woke for is current, so a late worker can never run
     * a task of the next run with the previous run's fn. */
    _Atomic uint64_t ticket;
    atomic_int done_tasks;
};

/* Take and run tasks of run `gen` until none is left. A task is claimed by
 * the compare-exchange on the whole ticket, so a worker holding a stale
 * ticket value (an older run, or a run being set up: the ticket is closed
 * with index UINT32_MAX before fn/arg/n_tasks change) can never claim one. */
static void drain(eng_pool *p, unsigned gen, int thread) {
    uint64_t cur = atomic_load_explicit(&p->ticket, memory_order_acquire);
    for (;;) {
        if ((unsigned)(cur >> 32) != gen) return;
        uint32_t t = (uint32_t)cur;
        if (t >= (uint32_t)atomic_load_explicit(&p->n_tasks, memory_order_relaxed)) return;
        if (!atomic_compare_exchange_weak_explicit(&p->ticket, &cur, cur + 1,
                                                   memory_order_acq_rel, memory_order_acquire))
            continue;
        p->fn(p->arg, (int)t, thread);
        atomic_fetch_add_explicit(&p->done_tasks, 1, memory_order_release);
        cur = atomic_load_explicit(&p->ticket, memory_order_acquire);
    }
}

static void *worker_main(void *opaque) {
    worker *w = opaque;
    eng_pool *p = w->pool;
    unsigned seen = atomic_load_explicit(&p->generation, memory_order_acquire);
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&p->generation, memory_order_acquire)) == seen &&
               !atomic_load_explicit(&p->stop, memory_order_relaxed)) {
            if (++spins < POOL_SPIN_ROUNDS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&p->lock);
            atomic_fetch_add(&p->sleepers, 1);
            while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->wake, &p->lock);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->lock);
        }
        if (atomic_load(&p->stop)) return NULL;
        seen = g;
        drain(p, g, w->index);
    }
}

kds_status eng_pool_create(int n_threads, eng_pool **out, kds_err *err) {
    *out = NULL;
    if (n_threads < 1) n_threads = 1;
    eng_pool *p = calloc(1, sizeof *p);
    if (!p) return kds_err_set(err, KDS_NOMEM, "out of memory creating a thread pool");
    p->n_threads = n_threads;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    p->workers = calloc((size_t)n_threads, sizeof *p->workers);
    if (!p->workers) goto nomem;
    for (int i = 1; i < n_threads; i++) {
        p->workers[i - 1] = (worker){.pool = p, .index = i};
        if (pthread_create(&p->workers[i - 1].thread, NULL, worker_main, &p->workers[i - 1]) !=
            0) {
            p->n_threads = i; /* join only the ones that started */
            eng_pool_free(p);
            return kds_err_set(err, KDS_INTERNAL, "cannot start thread %d of %d", i, n_threads);
        }
    }
    *out = p;
    return KDS_OK;
nomem:
    eng_pool_free(p);
    return kds_err_set(err, KDS_NOMEM, "out of memory creating a thread pool");
}

void eng_pool_free(eng_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    atomic_store(&p->stop, true);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (int i = 1; i < p->n_threads; i++) pthread_join(p->workers[i - 1].thread, NULL);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->lock);
    free(p->workers);
    free(p);
}

int eng_pool_size(const eng_pool *p) { return p->n_threads; }

void eng_pool_run(eng_pool *p, eng_pool_fn fn, void *arg, int n_tasks) {
    if (n_tasks <= 0) return;
    if (p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(arg, t, 0);
        return;
    }
    /* Close the previous run's ticket before touching the run's fields: a
     * late worker may still hold that run's ticket value and try to claim
     * with it (see drain). */
    unsigned gen = atomic_load_explicit(&p->generation, memory_order_relaxed) + 1;
    atomic_store_explicit(&p->ticket, ((uint64_t)(gen - 1) << 32) | UINT32_MAX,
                          memory_order_seq_cst);
    p->fn = fn;
    p->arg = arg;
    atomic_store_explicit(&p->n_tasks, n_tasks, memory_order_relaxed);
    atomic_store_explicit(&p->done_tasks, 0, memory_order_relaxed);
    atomic_store_explicit(&p->ticket, (uint64_t)gen << 32, memory_order_release);
    atomic_store_explicit(&p->generation, gen, memory_order_release);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->lock);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->lock);
    }
    drain(p, gen, 0);
    while (atomic_load_explicit(&p->done_tasks, memory_order_acquire) < n_tasks) cpu_relax();
}

int eng_cpus_online(int cap) {
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    const int n = online < 1 ? 1 : (int)online;
    return cap > 0 && n > cap ? cap : n;
}
