/*
 * The fork-join pool: every task of every run executes exactly once, with
 * the run's own function and argument, and a run returns only when all of
 * its tasks are done. Back-to-back runs of changing sizes are where a late
 * worker could claim a task of the next run with the previous run's ticket.
 */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdint.h>

#include "eng_pool.h"

#define MAX_TASKS 64

typedef struct run_arg {
    int run;
    atomic_int hits[MAX_TASKS];
    atomic_int wrong_run;
} run_arg;

static void count_fn(void *arg, int task, int thread) {
    run_arg *r = arg;
    if (task < 0 || task >= MAX_TASKS) {
        atomic_fetch_add(&r->wrong_run, 1);
        return;
    }
    atomic_fetch_add(&r->hits[task], 1);
}

static void other_fn(void *arg, int task, int thread) {
    run_arg *r = arg;
    (void)task;
    atomic_fetch_add(&r->wrong_run, 1);
}

Test(pool, every_task_exactly_once, .timeout = 60) {
    for (int threads = 2; threads <= 4; threads++) {
        eng_pool *p = NULL;
        kds_err err = {0};
        cr_assert_eq(eng_pool_create(threads, &p, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_pool_size(p), threads);
        static run_arg a, b;
        uint32_t x = 12345;
        for (int run = 0; run < 40000; run++) {
            x = x * 1664525u + 1013904223u;
            int n = 1 + (int)(x >> 26) % MAX_TASKS;
            run_arg *r = (run & 1) ? &a : &b;
            memset(r, 0, sizeof *r);
            eng_pool_run(p, count_fn, r, n);
            int bad = 0;
            for (int t = 0; t < MAX_TASKS; t++) bad |= atomic_load(&r->hits[t]) != (t < n);
            cr_assert_not(bad, "run %d (%d tasks, %d threads): a task ran twice, never, or "
                          "out of range", run, n, threads);
            cr_assert_eq(atomic_load(&r->wrong_run), 0);
        }
        /* A run of another function right after must not see count_fn. */
        memset(&a, 0, sizeof a);
        eng_pool_run(p, other_fn, &a, 17);
        cr_expect_eq(atomic_load(&a.wrong_run), 17);
        eng_pool_free(p);
    }
}

Test(pool, single_thread_and_free_null) {
    eng_pool *p = NULL;
    cr_assert_eq(eng_pool_create(1, &p, NULL), KDS_OK);
    static run_arg a;
    memset(&a, 0, sizeof a);
    eng_pool_run(p, count_fn, &a, 5);
    for (int t = 0; t < 5; t++) cr_expect_eq(atomic_load(&a.hits[t]), 1);
    eng_pool_free(p);
    eng_pool_free(NULL);
}
