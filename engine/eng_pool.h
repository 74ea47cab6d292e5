/*
 * eng_pool.h - a small fork-join thread pool for the forward pass.
 *
 * eng_pool_run(fn, arg, n_tasks) runs fn(arg, task, thread) for task in
 * [0, n_tasks) on the pool's threads *and the caller's*, and returns when all
 * are done. Tasks are handed out through an atomic counter. Workers spin
 * briefly between runs (a decode step issues dozens of runs back to back, and
 * a sleeping thread takes tens of microseconds to wake), then sleep on a
 * condition variable so an idle server burns no CPU.
 *
 * Thread-safety: one run at a time per pool (the owning eng_ctx guarantees
 * it). `thread` is in [0, eng_pool_size) and identifies per-thread scratch.
 */
#ifndef ENG_POOL_H
#define ENG_POOL_H

#include "kds_status.h"

typedef struct eng_pool eng_pool;
typedef void (*eng_pool_fn)(void *arg, int task, int thread);

/* n_threads counts the caller: 1 means no worker threads. */
kds_status eng_pool_create(int n_threads, eng_pool **out, kds_err *err);
void eng_pool_free(eng_pool *p);
int eng_pool_size(const eng_pool *p);
void eng_pool_run(eng_pool *p, eng_pool_fn fn, void *arg, int n_tasks);

/* The CPUs online (sysconf), at least 1 and, when cap > 0, at most cap:
 * the thread count of work that takes one thread a CPU by default (a
 * context's pool, a model's load, gen-model's writer). */
int eng_cpus_online(int cap);

#endif
