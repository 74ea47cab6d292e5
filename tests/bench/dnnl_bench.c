/*
 * dnnl_bench.c - the prefill's products against oneDNN's matmul, on the
 * same bf16 weights, the same shapes and as many threads: the figures
 * behind choosing our own GEMM (issue 18, docs/benchmarks.md "Our GEMM
 * against oneDNN"). Built by CMake as `kds_dnnl_bench` only where
 * Debian's libdnnl-dev (oneDNN 2.x) is installed; nothing else uses it.
 *
 *   kds_dnnl_bench [--threads N] [--runs R] [--quick]
 *
 * For each shape (weights [rows, in], bf16 as stored: a model's
 * projections and experts) and T tokens it prints GFLOP/s (2 T rows in /
 * time, median of R runs after one warm-up) of:
 *   ours exact   kern_matmul_w_prefill: the stored bf16 rows read in
 *                place, f32 sums of f32 activations (kdaserve's default);
 *   ours bf16    the same with bf16_act: x rounded to bf16, vdpbf16ps
 *                (`--bf16`);
 *   dnnl f32     oneDNN f32 x f32 on a widened f32 copy of the weights
 *                (twice the bytes: what exact would need from it), the
 *                weights as they lie ([in, rows] viewed as format `ba`)
 *                and in oneDNN's own packed layout (`any`, reordered once
 *                outside the clock);
 *   dnnl bf16    oneDNN bf16 x bf16 -> f32, x rounded to bf16 inside the
 *                clock (as ours), weights as they lie and packed;
 *   dnnl f32 x bf16: f32 activations against bf16 weights, which only
 *                oneDNN 3 offers ("weights decompression"): shown as
 *                "n/a" where primitive creation says it is unimplemented.
 * Ours run on the engine's pool (eng_pool), cut into 4 row blocks a
 * thread as the engine cuts a prefill's products; oneDNN on its OpenMP
 * runtime with omp_set_num_threads(N). Each product's result is checked
 * against ours exact (largest difference relative to the largest value),
 * so a misread layout cannot pass as fast.
 */
#include <math.h>
#include <oneapi/dnnl/dnnl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "eng_pool.h"
#include "kern.h"
#include "kds_clock.h"

/* libgomp's, which oneDNN's OpenMP runtime reads */
void omp_set_num_threads(int n);

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void *xalloc(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) {
        fprintf(stderr, "dnnl_bench: out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

/* ------------------------------------------------------------------------ */
/* Ours, on the pool                                                         */

typedef struct ours_job {
    const kern_weight *w;
    const float *x;
    float *y;
    int T, n_tasks;
    bool bf16_act;
    float **scratch; /* [threads] */
} ours_job;

static void ours_task(void *arg, int task, int thread) {
    const ours_job *j = arg;
    const int rows = j->w->rows;
    int r0 = (int)((int64_t)rows * task / j->n_tasks);
    int r1 = (int)((int64_t)rows * (task + 1) / j->n_tasks);
    /* row blocks on multiples of 8, as the engine cuts a bf16 product
     * (eng_cpu.c, run_mm_as) */
    r0 -= r0 % 8;
    if (task + 1 < j->n_tasks) r1 -= r1 % 8;
    if (r1 > r0)
        kern_matmul_w_prefill(j->w, j->x, j->T, j->y, rows, r0, r1, j->scratch[thread],
                              j->bf16_act);
}

/* ------------------------------------------------------------------------ */
/* oneDNN                                                                    */

typedef struct dnnl_case {
    dnnl_primitive_t prim;
    dnnl_memory_t src, wei, dst;
    void *src_buf, *wei_buf; /* owned here (wei: the packed copy, if any) */
    bool ok;
} dnnl_case;

/* A matmul dst [T, rows] f32 = src [T, in] (src_dt) x W^T, W given as
 * `w` ([rows, in] row-major of w_dt, i.e. [in, rows] in format `ba`):
 * used in place, or (packed) reordered once into oneDNN's own layout.
 * c.ok false: oneDNN has no such matmul (or ran out of memory). */
static dnnl_case dnnl_make(dnnl_engine_t eng, dnnl_stream_t st, int T, int rows, int in,
                           dnnl_data_type_t src_dt, dnnl_data_type_t w_dt, void *w, bool packed,
                           float *dst) {
    dnnl_case c = {0};
    dnnl_memory_desc_t src_md, wei_md, wei_any, dst_md;
    dnnl_dims_t sd = {T, in}, wd = {in, rows}, dd = {T, rows};
    dnnl_primitive_desc_t pd = NULL, rpd = NULL;
    dnnl_primitive_t reorder = NULL;
    dnnl_memory_t user_w = NULL;
    dnnl_matmul_desc_t md;
    dnnl_status_t s = dnnl_memory_desc_init_by_tag(&src_md, 2, sd, src_dt, dnnl_ab);
    if (s == dnnl_success) s = dnnl_memory_desc_init_by_tag(&wei_md, 2, wd, w_dt, dnnl_ba);
    if (s == dnnl_success)
        s = dnnl_memory_desc_init_by_tag(&wei_any, 2, wd, w_dt, dnnl_format_tag_any);
    if (s == dnnl_success) s = dnnl_memory_desc_init_by_tag(&dst_md, 2, dd, dnnl_f32, dnnl_ab);
    if (s == dnnl_success)
        s = dnnl_matmul_desc_init(&md, &src_md, packed ? &wei_any : &wei_md, NULL, &dst_md);
    if (s == dnnl_success) s = dnnl_primitive_desc_create(&pd, &md, NULL, eng, NULL);
    if (s == dnnl_success) s = dnnl_primitive_create(&c.prim, pd);
    if (s == dnnl_success) {
        c.src_buf = xalloc((size_t)T * in * 4);
        s = dnnl_memory_create(&c.src, &src_md, eng, c.src_buf);
    }
    if (s == dnnl_success) s = dnnl_memory_create(&c.dst, &dst_md, eng, dst);
    if (s == dnnl_success && !packed) s = dnnl_memory_create(&c.wei, &wei_md, eng, w);
    if (s == dnnl_success && packed) {
        const dnnl_memory_desc_t *want = dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
        c.wei_buf = xalloc(dnnl_memory_desc_get_size(want));
        s = dnnl_memory_create(&c.wei, want, eng, c.wei_buf);
        if (s == dnnl_success) s = dnnl_memory_create(&user_w, &wei_md, eng, w);
        if (s == dnnl_success)
            s = dnnl_reorder_primitive_desc_create(&rpd, &wei_md, eng, want, eng, NULL);
        if (s == dnnl_success) s = dnnl_primitive_create(&reorder, rpd);
        dnnl_exec_arg_t ra[2] = {{DNNL_ARG_FROM, user_w}, {DNNL_ARG_TO, c.wei}};
        if (s == dnnl_success) s = dnnl_primitive_execute(reorder, st, 2, ra);
        if (s == dnnl_success) s = dnnl_stream_wait(st);
    }
    c.ok = s == dnnl_success;
    if (reorder) dnnl_primitive_destroy(reorder);
    if (rpd) dnnl_primitive_desc_destroy(rpd);
    if (user_w) dnnl_memory_destroy(user_w);
    if (pd) dnnl_primitive_desc_destroy(pd);
    return c;
}

static void dnnl_free(dnnl_case *c) {
    if (c->prim) dnnl_primitive_destroy(c->prim);
    if (c->src) dnnl_memory_destroy(c->src);
    if (c->wei) dnnl_memory_destroy(c->wei);
    if (c->dst) dnnl_memory_destroy(c->dst);
    free(c->src_buf);
    free(c->wei_buf);
}

/* One run: x (f32 [T, in]) into the case's src (rounded to bf16 when the
 * src is bf16, inside the clock), then the matmul. */
static void dnnl_run(dnnl_case *c, dnnl_stream_t st, const float *x, size_t n, bool src_bf16) {
    if (src_bf16) {
        uint16_t *s = c->src_buf;
        for (size_t i = 0; i < n; i++) s[i] = kern_f32_to_bf16(x[i]);
    } else {
        memcpy(c->src_buf, x, n * sizeof(float));
    }
    dnnl_exec_arg_t a[3] = {{DNNL_ARG_SRC, c->src}, {DNNL_ARG_WEIGHTS, c->wei},
                            {DNNL_ARG_DST, c->dst}};
    if (dnnl_primitive_execute(c->prim, st, 3, a) != dnnl_success ||
        dnnl_stream_wait(st) != dnnl_success) {
        fprintf(stderr, "dnnl_bench: oneDNN matmul failed\n");
        exit(1);
    }
}

/* One run of a product being timed (ours on the pool, or a oneDNN case). */
typedef void (*run_fn)(void *arg);

/* The median of `runs` timings of run(arg), after one untimed warm-up, in
 * seconds. */
static double median_seconds(run_fn run, void *arg, int runs) {
    double t[64];
    for (int i = 0; i <= runs; i++) {
        const double t0 = kds_now_s();
        run(arg);
        if (i) t[i - 1] = kds_now_s() - t0;
    }
    qsort(t, (size_t)runs, sizeof t[0], cmp_double);
    return t[runs / 2];
}

typedef struct ours_run {
    eng_pool *pool;
    ours_job job;
} ours_run;

static void run_ours(void *arg) {
    ours_run *o = arg;
    eng_pool_run(o->pool, ours_task, &o->job, o->job.n_tasks);
}

typedef struct dnnl_timed {
    dnnl_case *c;
    dnnl_stream_t st;
    const float *x;
    size_t n;
    bool src_bf16;
} dnnl_timed;

static void run_dnnl(void *arg) {
    const dnnl_timed *d = arg;
    dnnl_run(d->c, d->st, d->x, d->n, d->src_bf16);
}

/* Largest |a - b| over the largest |b|. */
static double rel_diff(const float *a, const float *b, size_t n) {
    double d = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        m = fmax(m, fabs((double)b[i]));
    }
    return m > 0 ? d / m : d;
}

int main(int argc, char **argv) {
    int threads = 2, runs = 7;
    bool quick = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            threads = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--runs") && i + 1 < argc) {
            runs = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--quick")) {
            quick = true;
        } else {
            fprintf(stderr, "usage: %s [--threads N (1..64)] [--runs R (1..63)] [--quick]\n",
                    argv[0]);
            return 2;
        }
    }
    if (threads < 1 || threads > 64 || runs < 1 || runs > 63) {
        fprintf(stderr, "dnnl_bench: --threads 1..64, --runs 1..63\n");
        return 2;
    }
    if (quick) runs = 3;
    omp_set_num_threads(threads);
    kds_err err = {0};
    eng_pool *pool = NULL;
    if (eng_pool_create(threads, &pool, &err) != KDS_OK) {
        fprintf(stderr, "dnnl_bench: %s\n", err.msg);
        return 1;
    }
    dnnl_engine_t eng;
    dnnl_stream_t st;
    if (dnnl_engine_create(&eng, dnnl_cpu, 0) != dnnl_success ||
        dnnl_stream_create(&st, eng, dnnl_stream_default_flags) != dnnl_success) {
        fprintf(stderr, "dnnl_bench: cannot create oneDNN's CPU engine\n");
        return 1;
    }
    const dnnl_version_t *v = dnnl_version();
    printf("## kds_dnnl_bench\n\n- oneDNN %d.%d.%d (%s runtime), %d threads; ours on eng_pool; "
           "GFLOP/s = 2 T rows in / time, median of %d runs\n\n",
           v->major, v->minor, v->patch, v->cpu_runtime == DNNL_RUNTIME_OMP ? "OpenMP" : "other",
           threads, runs);
    printf("| weights [rows, in] | T | ours exact | ours bf16 | dnnl f32 (copy as lies / packed) "
           "| dnnl bf16 (as lies / packed) | dnnl f32 x bf16 | largest difference against ours "
           "exact |\n|---|---|---|---|---|---|---|---|\n");
    /* wide's (and Kimi-Linear-48B's) expert up / down, attention q / out
     * and dense down, at a 512-token prefill step (experts: the ~128
     * tokens each of 32 experts top-8 gets) */
    const int shapes[][3] = {{1024, 2304, 128}, {2304, 1024, 128}, {4096, 2304, 512},
                             {2304, 4096, 512}, {2304, 9216, 512}};
    const int n_shapes = quick ? 2 : (int)(sizeof shapes / sizeof shapes[0]);
    for (int s = 0; s < n_shapes; s++) {
        const int rows = shapes[s][0], in = shapes[s][1], T = shapes[s][2];
        const size_t nw = (size_t)rows * in, nx = (size_t)T * in, ny = (size_t)T * rows;
        uint16_t *wb = xalloc(nw * 2);
        float *wf = xalloc(nw * 4), *x = xalloc(nx * 4), *y0 = xalloc(ny * 4), *y = xalloc(ny * 4);
        uint64_t r = 0x9e3779b97f4a7c15ull + (uint64_t)s;
        for (size_t i = 0; i < nw; i++) {
            r ^= r << 13, r ^= r >> 7, r ^= r << 17;
            wb[i] = kern_f32_to_bf16(((float)(r >> 40) / 16777216.0f - 0.5f) * 0.1f);
            wf[i] = kern_bf16_to_f32(wb[i]);
        }
        for (size_t i = 0; i < nx; i++) {
            r ^= r << 13, r ^= r >> 7, r ^= r << 17;
            x[i] = (float)(r >> 40) / 16777216.0f * 2.0f - 1.0f;
        }
        const kern_weight w = {.dt = KERN_BF16, .data = wb, .rows = rows, .cols = in};
        float *scratch[64];
        for (int t = 0; t < threads; t++)
            scratch[t] = xalloc(kern_matmul_scratch_floats(in) * sizeof(float));
        const double flop = 2.0 * T * rows * in;
        double g[7] = {0}, diff[7] = {0};
        bool have[7] = {false};
        /* 0, 1: ours exact, bf16 */
        for (int k = 0; k < 2; k++) {
            ours_run o = {pool, {&w, x, k == 0 ? y0 : y, T, threads == 1 ? 1 : 4 * threads,
                                 k == 1, scratch}};
            g[k] = flop / median_seconds(run_ours, &o, runs) / 1e9;
            have[k] = true;
            if (k == 1) diff[k] = rel_diff(y, y0, ny);
        }
        /* 2..5: dnnl f32 as lies / packed, bf16 as lies / packed; 6: f32 x bf16 */
        for (int k = 2; k < 7; k++) {
            const bool bf16w = k >= 4, packed = k == 3 || k == 5;
            const dnnl_data_type_t sdt = k == 4 || k == 5 ? dnnl_bf16 : dnnl_f32;
            dnnl_case c = dnnl_make(eng, st, T, rows, in, sdt, bf16w ? dnnl_bf16 : dnnl_f32,
                                    bf16w ? (void *)wb : (void *)wf, packed, y);
            if (c.ok) {
                dnnl_timed d = {&c, st, x, nx, sdt == dnnl_bf16};
                g[k] = flop / median_seconds(run_dnnl, &d, runs) / 1e9;
                have[k] = true;
                diff[k] = rel_diff(y, y0, ny);
            }
            dnnl_free(&c);
        }
        char cell[3][48];
        for (int k = 2, i = 0; k < 6; k += 2, i++) {
            char a[16] = "n/a", b[16] = "n/a";
            if (have[k]) snprintf(a, sizeof a, "%.0f", g[k]);
            if (have[k + 1]) snprintf(b, sizeof b, "%.0f", g[k + 1]);
            snprintf(cell[i], sizeof cell[i], "%s / %s", a, b);
        }
        if (have[6])
            snprintf(cell[2], sizeof cell[2], "%.0f", g[6]);
        else
            snprintf(cell[2], sizeof cell[2], "n/a (unimplemented)");
        printf("| [%d, %d] | %d | %.0f | %.0f | %s | %s | %s | ", rows, in, T, g[0], g[1], cell[0],
               cell[1], cell[2]);
        printf("bf16 %.1e, dnnl f32 %.1e, dnnl bf16 %.1e |\n", diff[1], diff[3], diff[5]);
        fflush(stdout);
        for (int t = 0; t < threads; t++) free(scratch[t]);
        free(wb);
        free(wf);
        free(x);
        free(y0);
        free(y);
    }
    dnnl_stream_destroy(st);
    dnnl_engine_destroy(eng);
    eng_pool_free(pool);
    return 0;
}
