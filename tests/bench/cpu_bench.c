/*
 * cpu_bench.c - CPU timings of the block-format products (kern_matmul_w,
 * kernels/cpu/quant.c) at Kimi K3's routed-expert shapes, judged against
 * the machine's own memory read bandwidth. Built by CMake as
 * `kds_cpu_bench`:
 *
 *   kds_cpu_bench [--quick] [--runs N] [--only PARTS]
 *       --quick: 3 runs per figure and smaller stacks (a smoke test);
 *       --runs N: N runs per figure (default 7); every figure is a median;
 *       --only PARTS: some of the parts below (a-i), e.g. `--only ab` ((b)
 *       runs (a) too: its percentages are of (a)'s read).
 *
 * Prints markdown tables (the same lines go to docs/benchmarks.md):
 *   (a) memory read bandwidth: a streaming read (kern_read_sum: 64-byte
 *       AVX-512 loads, or 8-byte loads without, four independent sums)
 *       of a buffer of max(1 GiB, 4 x L3), 1 and 2 threads;
 *   (b) T = 1 products (decode): MXFP4, Q8_0 and, for comparison, bf16
 *       (kern_matmul) on [3072, 3584] and [3584, 3072] (and bf16 on the
 *       48B layout's expert shapes [1024, 2304], [2304, 1024], and
 *       llamacpp-tiny's lm_head [50304, 256]), each one matrix
 *       over and over (it stays in L3: the kernels' compute ceiling) and a
 *       stack of experts whose total is >= 4 x L3 (each expert once per
 *       sweep, as routed experts come from memory), in bytes read per
 *       second (codes + scales + x) and as a fraction of (a);
 *   (c) the same products for T = 1 .. 64 tokens on [3072, 3584], 1 thread:
 *       where the direct path (T < 32) hands over to the prefill path;
 *   (d) prefill, T = 64 and 256, GFLOP/s (2 T rows cols / time), the fast
 *       path, the portable path kern_matmul_w_ref (dequantise + OpenBLAS
 *       sgemm), bf16 (kern_matmul: widen + sgemm) and f32 (sgemm alone);
 *   (e) T = 1 MXFP4 and bf16 on [3072, 3584] stacks, each round a read of
 *       the stack's bytes then a product sweep over them, so the fraction
 *       of bandwidth is a ratio measured a second apart (medians over
 *       rounds), which holds on a machine whose load moves;
 *   (f) long prompts: one 256-token prefill slice at context position P
 *       (0 .. 128K; 16K with --quick) of Kimi-Linear-48B's attention, one
 *       thread: the MLA layer's attention (kern_mla_attend, 32 heads, dc
 *       512, dr 64) and a KDA layer's chunked core (kern_kda_chunked, 32
 *       heads of 128, chunks of 64), each in microseconds per token, beside
 *       a layer's matrix products (about 100 M bf16 weights per token at
 *       these widths) at the GEMM's rate measured in the same run: where the
 *       attention would start to dominate a long prefill;
 *   (g) decode: one token's MLA attention (same widths) at context 4K ..
 *       128K (16K with --quick), one thread, head by head (kern_mla_attend,
 *       T = 1) against all heads at once (kern_mla_decode_heads), with the
 *       largest difference between the two outputs (relative to the
 *       largest output); and a batched step's, 8 sequences at context
 *       256 .. 4K, row by row against the rows at once
 *       (kern_mla_decode_rows), whose outputs must be the same bits;
 *   (h) batched decode: bf16 [4096, 2304] for T = 1 .. 16 tokens on the
 *       direct path (exact; where the CPU has AMX tiles, exact on them as
 *       well; and under --bf16), 1 and 2 threads, with its rows in L2 (128
 *       of them, over and over), in the last-level cache (one matrix over
 *       and over) and in memory (a stack as (b); one token also with
 *       the software prefetch this CPU does not get,
 *       kern_stream_prefetch_bytes),
 *       against the FMA peak measured in the same run and a read of the
 *       stack's bytes in the same round: where the products of a batched
 *       step lose their time;
 *   (i) prefill's GEMM (kern__gemm) on bf16 [2304, in] for in = 1024,
 *       2304, 4096, 9216 (wide's expert down, projections, attention out
 *       and dense down) and T = 64, 256, one thread, with x read in place
 *       (the panel's scratch alone) and packed 12 tokens side by side (the
 *       engine's scratch), alternating round by round, against the FMA peak
 *       measured in the same run;
 *   (j) --bf16's prefill GEMM (kern__gemm_bf16act's kernel) on the same
 *       matrices, T = 64, 256, 512, one thread: the vdpbf16ps kernel
 *       against AMX tiles where the CPU has them (kern__gemm_bf16x_on),
 *       alternating round by round, against the vdpbf16ps and FMA peaks
 *       measured in the same run, with the largest difference between the
 *       two outputs (relative to the largest output).
 * Threads: products go through the engine's pool (eng_pool), their rows cut
 * into 4 tasks per thread as eng_cpu.c's run_mm does; with one thread the
 * call is made inline, as there. OpenBLAS is pinned to one thread (the
 * engine's setting).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cblas.h>
#include <immintrin.h>

#include "cpu/kern_gemm.h"
#include "eng_pool.h"
#include "kern.h"
#include "kds_clock.h"

static void *xalloc(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) {
        fprintf(stderr, "cpu_bench: out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

/* Random bytes (splitmix64), so every page is written and no value is 0. */
static void fill_bytes(void *p, size_t n, uint64_t seed) {
    unsigned char *b = p;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t z = (seed += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        memcpy(b + i, &z, 8);
    }
    for (; i < n; i++)
        b[i] = (unsigned char)(i * 131 + seed);
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *x, int n) {
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

static size_t cache_bytes(int index) {
    char path[96];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", index);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    unsigned long v = 0;
    char unit = 0;
    if (fscanf(f, "%lu%c", &v, &unit) < 1) v = 0;
    fclose(f);
    return unit == 'K' ? v << 10 : unit == 'M' ? v << 20 : v;
}

static void cpu_model(char *out, size_t n) {
    snprintf(out, n, "?");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[256];
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10) && strchr(line, ':')) {
            snprintf(out, n, "%s", strchr(line, ':') + 2);
            out[strcspn(out, "\n")] = 0;
            break;
        }
    fclose(f);
}

/* ------------------------------------------------------------------------ */
/* Work on the pool                                                          */

static eng_pool *g_pool[3]; /* [threads] */
static float *g_scratch[2]; /* one kern_matmul_scratch_floats(widest) per thread */
static int g_runs = 7, g_quick;
static const char *g_only = "abcdefghij";
static size_t g_l3;
static double g_bw[3]; /* measured read bandwidth, GB/s, [threads] */

typedef struct mm_job {
    const kern_weight *w;
    const float *x;
    int T, n_tasks, ref;
    float *y;
} mm_job;

static void mm_task(void *arg, int task, int thread) {
    const mm_job *j = arg;
    const int rows = j->w->rows;
    const int r0 = (int)((int64_t)rows * task / j->n_tasks);
    const int r1 = (int)((int64_t)rows * (task + 1) / j->n_tasks);
    if (j->ref == 2)
        kern_matmul_w_bf16act(j->w, j->x, j->T, j->y, rows, r0, r1, g_scratch[thread]);
    else if (j->ref)
        kern_matmul_w_ref(j->w, j->x, j->T, j->y, rows, r0, r1, g_scratch[thread]);
    else
        kern_matmul_w(j->w, j->x, j->T, j->y, rows, r0, r1, g_scratch[thread]);
}

/* fn's tasks [0, n_tasks) on `threads` threads: one thread runs them
 * inline, as the engine does; more go to the pool. */
static void run_tasks(int threads, eng_pool_fn fn, void *arg, int n_tasks) {
    if (threads == 1)
        for (int t = 0; t < n_tasks; t++)
            fn(arg, t, 0);
    else
        eng_pool_run(g_pool[threads], fn, arg, n_tasks);
}

/* y [T, rows] = x [T, cols] W^T on `threads` threads; ref 1: the
 * reference loops, 2: x rounded to bf16 (kern_matmul_w_bf16act). */
static void product(const kern_weight *w, const float *x, int T, float *y, int threads, int ref) {
    mm_job j = {w, x, T, threads == 1 ? 1 : 4 * threads, ref, y};
    run_tasks(threads, mm_task, &j, j.n_tasks);
}

typedef struct read_job {
    const unsigned char *p;
    size_t n;
    int n_tasks;
    double sum[16];
} read_job;

/* One streaming read of task's share (kern_read_sum: four 64-byte loads
 * per step into independent sums, bound by the loads), the reading that
 * `kdaserve bench` judges decode against (eng_read_bandwidth). */
static void read_task(void *arg, int task, int thread) {
    read_job *j = arg;
    const size_t per = j->n / (size_t)j->n_tasks / 256 * 256;
    j->sum[task] = (double)kern_read_sum(j->p + per * (size_t)task, per);
    (void)thread;
}

/* Seconds of one streaming read of p[0, n) on `threads` threads. */
static double read_sweep(const unsigned char *p, size_t n, int threads) {
    read_job j = {p, n, threads == 1 ? 1 : 4 * threads, {0}};
    const double t0 = kds_now_s();
    run_tasks(threads, read_task, &j, j.n_tasks);
    return kds_now_s() - t0;
}

/* ------------------------------------------------------------------------ */

static void bench_bandwidth(void) {
    size_t n = (size_t)1 << 30;
    if (4 * g_l3 > n) n = 4 * g_l3;
    if (g_quick) n /= 2;
    unsigned char *buf = xalloc(n);
    fill_bytes(buf, n, 1);
    printf("### (a) Memory read bandwidth\n\n");
    printf("Streaming read of %.0f MiB (kern_read_sum: 4 independent sums, %s), median of %d.\n\n",
           n / 1048576.0,
#if defined(__AVX512F__) /* kern_simd.h's KERN_AVX512: the kernels' flags are this file's */
           "64-byte AVX-512 loads",
#else
           "8-byte loads",
#endif
           g_runs);
    printf("| threads | GB/s |\n|---|---|\n");
    for (int th = 1; th <= 2; th++) {
        double gbs[64];
        for (int run = 0; run <= g_runs; run++) {
            const double dt = read_sweep(buf, n, th);
            if (run > 0) gbs[run - 1] = (double)n / dt / 1e9; /* run 0: warm-up */
        }
        g_bw[th] = median(gbs, g_runs);
        printf("| %d | %.1f |\n", th, g_bw[th]);
    }
    printf("\n");
    free(buf);
}

/* A stack of n weights [rows, cols] of format dt in one allocation: codes
 * random bytes; MXFP4 scales 2^-6 .. 2^1, Q8_0 scales f16 in +-[0.001, 0.05],
 * bf16 and f32 values uniform in (-1, 1). */
typedef struct stack {
    kern_weight *w;
    int n;
    void *codes, *scales;
    size_t bytes_per; /* codes + scales of one weight */
} stack;

static stack make_stack(kern_dtype dt, int rows, int cols, int n) {
    stack s = {xalloc((size_t)n * sizeof(kern_weight)), n, NULL, NULL, 0};
    const kern_layout l = kern_weight_layout(dt, rows, cols);
    s.codes = xalloc(l.data_bytes * (size_t)n);
    s.scales = l.scale_bytes ? xalloc(l.scale_bytes * (size_t)n) : NULL;
    s.bytes_per = l.bytes;
    if (dt == KERN_BF16 || dt == KERN_F32) {
        uint64_t r = 7;
        for (size_t i = 0; i < (size_t)rows * cols * n; i++) {
            r ^= r << 13, r ^= r >> 7, r ^= r << 17;
            const float f = (float)((r >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
            if (dt == KERN_BF16)
                ((uint16_t *)s.codes)[i] = kern_f32_to_bf16(f);
            else
                ((float *)s.codes)[i] = f;
        }
    } else {
        fill_bytes(s.codes, l.data_bytes * (size_t)n, 2);
    }
    unsigned char *sc = s.scales;
    for (size_t i = 0; i < l.scale_bytes * (size_t)n; i++) {
        if (dt == KERN_MXFP4) {
            sc[i] = (unsigned char)(121 + i * 7 % 8);
        } else if (i % 2 == 0) {
            const uint16_t h = kern_f32_to_f16((0.001f + 0.049f * (float)(i * 37 % 101) / 100.0f) *
                                               (i % 4 ? 1.0f : -1.0f));
            memcpy(sc + i, &h, 2);
        }
    }
    for (int e = 0; e < n; e++)
        s.w[e] = (kern_weight){
            .dt = dt,
            .data = (const char *)s.codes + l.data_bytes * (size_t)e,
            .scales = s.scales ? (const char *)s.scales + l.scale_bytes * (size_t)e : NULL,
            .rows = rows,
            .cols = cols,
            /* a stack of several matrices is read from memory (the engine's
             * hint for a model larger than the cache); one, over and over,
             * from cache */
            .streamed = n > 1,
            .stream_prefetch = kern_stream_prefetch_bytes(),
            .prefetch_rows_ahead = kern_prefetch_rows_ahead()};
    return s;
}

/* How many weights of `per` bytes a stack read from memory holds: at least
 * 1 GiB and 4 x L3 (a quarter of that with --quick). */
static int stack_count(size_t per) {
    size_t want = 4 * g_l3 > ((size_t)1 << 30) ? 4 * g_l3 : (size_t)1 << 30;
    if (g_quick) want /= 4;
    return (int)((want + per - 1) / per);
}

static void free_stack(stack *s) {
    free(s->w);
    free(s->codes);
    free(s->scales);
}

static float *random_x(size_t n, uint64_t seed) {
    float *x = xalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        seed ^= seed << 13, seed ^= seed >> 7, seed ^= seed << 17;
        x[i] = (float)((seed >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
    }
    return x;
}

/* Median seconds of one sweep: `reps` products over weights w[0..n) in turn. */
static double time_sweeps(const kern_weight *w, int n, int reps, const float *x, int T, float *y,
                          int threads, int ref) {
    double t[64];
    for (int run = 0; run <= g_runs; run++) {
        const double t0 = kds_now_s();
        for (int i = 0; i < reps; i++)
            product(&w[i % n], x, T, y, threads, ref);
        if (run > 0) t[run - 1] = kds_now_s() - t0; /* run 0: warm-up */
    }
    return median(t, g_runs);
}

static const int SHAPES[2][2] = {{3072, 3584}, {3584, 3072}};

/* One row pair of (b): format dt, [rows, cols], hot and as a stack. */
static void decode_rows(kern_dtype dt, int rows, int cols) {
    const size_t per = kern_weight_layout(dt, rows, cols).bytes;
    const int n = stack_count(per);
    stack st = make_stack(dt, rows, cols, n);
    float *x = random_x((size_t)cols, 3), *y = xalloc((size_t)rows * sizeof(float));
    const double bytes = (double)per + 4.0 * cols;
    for (int th = 1; th <= 2; th++) {
        const int reps_hot = 40;
        const double hot = time_sweeps(st.w, 1, reps_hot, x, 1, y, th, 0) / reps_hot;
        const double cold = time_sweeps(st.w, n, n, x, 1, y, th, 0) / n;
        printf("| %s | [%d, %d] | hot (%.1f MB) | %d | %.0f | %.1f | %.0f%% |\n",
               kern_dtype_name(dt), rows, cols, bytes / 1e6, th, hot * 1e6, bytes / hot / 1e9,
               100.0 * bytes / hot / 1e9 / g_bw[th]);
        printf("| %s | [%d, %d] | stack of %d (%.0f MB) | %d | %.0f | %.1f | **%.0f%%** |\n",
               kern_dtype_name(dt), rows, cols, n, bytes * n / 1e6, th, cold * 1e6,
               bytes / cold / 1e9, 100.0 * bytes / cold / 1e9 / g_bw[th]);
    }
    fflush(stdout);
    free(x);
    free(y);
    free_stack(&st);
}

static void bench_decode(void) {
    const kern_dtype dts[3] = {KERN_MXFP4, KERN_Q8_0, KERN_BF16};
    printf("### (b) T = 1 (decode): bytes read per second\n\n");
    printf("GB/s = (codes + scales + x bytes) / time, median of %d sweeps; %% of the read "
           "bandwidth of (a) with as many threads. `hot`: one matrix over and over (from L3); "
           "`stack`: each expert of the stack once per sweep (from memory).\n\n",
           g_runs);
    printf("| format | shape | weights | threads | µs / matrix | GB/s | %% of bandwidth |\n");
    printf("|---|---|---|---|---|---|---|\n");
    for (int d = 0; d < 3; d++)
        for (int s = 0; s < 2; s++) decode_rows(dts[d], SHAPES[s][0], SHAPES[s][1]);
    /* the bf16 experts of wide and full27: up / gate (4.5 KiB rows) and
     * down (2 KiB rows, shorter than a page: ops.c's DOT_SPREAD_BELOW),
     * and llamacpp-tiny's lm_head (512-byte rows, 81% of its token) */
    decode_rows(KERN_BF16, 1024, 2304);
    decode_rows(KERN_BF16, 2304, 1024);
    /* wide's and full27's attention output [2304, 4096] and dense down
     * [2304, 9216]: x split even/odd is 16 and 36 KiB beside the rows */
    decode_rows(KERN_BF16, 2304, 4096);
    decode_rows(KERN_BF16, 2304, 9216);
    decode_rows(KERN_BF16, 50304, 256);
    printf("\n");
}

static void bench_tokens(void) {
    const int Ts[] = {1, 2, 3, 4, 8, 16, 24, 31, 32, 48, 64};
    const kern_dtype dts[2] = {KERN_MXFP4, KERN_Q8_0};
    const int rows = 3072, cols = 3584;
    printf("### (c) T tokens, one thread, [3072, 3584] (hot)\n\n");
    printf("T < 32: direct path; T >= 32: prefill path. µs per product and GFLOP/s.\n\n");
    printf("| T | mxfp4 µs | mxfp4 GFLOP/s | q8_0 µs | q8_0 GFLOP/s |\n|---|---|---|---|---|\n");
    stack st[2] = {make_stack(dts[0], rows, cols, 1), make_stack(dts[1], rows, cols, 1)};
    float *x = random_x((size_t)64 * cols, 5), *y = xalloc((size_t)64 * rows * sizeof(float));
    for (size_t k = 0; k < sizeof Ts / sizeof Ts[0]; k++) {
        const int T = Ts[k];
        printf("| %d |", T);
        for (int d = 0; d < 2; d++) {
            const int reps = T < 8 ? 10 : 3;
            const double s = time_sweeps(st[d].w, 1, reps, x, T, y, 1, 0) / reps;
            printf(" %.0f | %.1f |", s * 1e6, 2.0 * T * rows * cols / s / 1e9);
        }
        printf("\n");
        fflush(stdout);
    }
    printf("\n");
    free(x);
    free(y);
    free_stack(&st[0]);
    free_stack(&st[1]);
}

static void bench_prefill(void) {
    const int Ts[2] = {64, 256};
    printf("### (d) Prefill, GFLOP/s (2 T rows cols / time), median of %d\n\n", g_runs);
    printf("`fast`: kern_matmul_w; `portable`: kern_matmul_w_ref (rows dequantised to f32 by the "
           "scalar loop, then OpenBLAS sgemm); bf16 and f32: kern_matmul (the GEMM of "
           "kernels/cpu/kern_gemm.h, panels unpacked to f32).\n\n");
    printf("| shape | T | threads | mxfp4 fast | mxfp4 portable | q8_0 fast | q8_0 portable | bf16 "
           "| f32 |\n|---|---|---|---|---|---|---|---|---|\n");
    const kern_dtype dts[4] = {KERN_MXFP4, KERN_Q8_0, KERN_BF16, KERN_F32};
    for (int s = 0; s < 2; s++) {
        const int rows = SHAPES[s][0], cols = SHAPES[s][1];
        stack st[4];
        for (int d = 0; d < 4; d++)
            st[d] = make_stack(dts[d], rows, cols, 1);
        float *x = random_x((size_t)256 * cols, 9), *y = xalloc((size_t)256 * rows * sizeof(float));
        for (int k = 0; k < 2; k++)
            for (int th = 1; th <= 2; th++) {
                const int T = Ts[k];
                const double flop = 2.0 * T * rows * cols;
                printf("| [%d, %d] | %d | %d |", rows, cols, T, th);
                for (int d = 0; d < 4; d++)
                    for (int ref = 0; ref < (d < 2 ? 2 : 1); ref++) {
                        const double t = time_sweeps(st[d].w, 1, 1, x, T, y, th, ref);
                        printf(" %.1f |", flop / t / 1e9);
                    }
                printf("\n");
                fflush(stdout);
            }
        free(x);
        free(y);
        for (int d = 0; d < 4; d++)
            free_stack(&st[d]);
    }
    printf("\n");
}

/* (e) The same stack read two ways in alternation, round after round: a
 * streaming read of its codes and scales (read_task), then one product
 * sweep over it (each weight once). On a shared machine the load changes
 * from second to second, so a bandwidth measured minutes before a product
 * (parts a and b) can be off by 2x; a round's two sweeps are a second apart
 * and its ratio is what this part reports: the median over rounds of
 * (product bytes/s) / (read bytes/s) for the same bytes. */
static void bench_alternating(void) {
    const kern_dtype dts[2] = {KERN_MXFP4, KERN_BF16};
    const int rounds = g_runs < 5 ? 5 : 2 * g_runs + 1;
    printf("### (e) T = 1 products against a read of the same bytes, alternating\n\n");
    printf("Per round: a streaming read of the stack's codes (as (a)), then one product sweep "
           "over every weight of it; %d rounds; medians. `ratio` = median over rounds of "
           "(product GB/s) / (read GB/s) in the same round.\n\n",
           rounds);
    printf("| format | shape | stack | threads | read GB/s | product GB/s | ratio |\n");
    printf("|---|---|---|---|---|---|---|\n");
    for (int d = 0; d < 2; d++) {
        const int rows = SHAPES[0][0], cols = SHAPES[0][1];
        const kern_layout l = kern_weight_layout(dts[d], rows, cols);
        const int n = stack_count(l.bytes);
        stack st = make_stack(dts[d], rows, cols, n);
        float *x = random_x((size_t)cols, 3), *y = xalloc((size_t)rows * sizeof(float));
        const size_t codes = l.data_bytes * (size_t)n;
        const double bytes = ((double)l.bytes + 4.0 * cols) * n;
        for (int th = 1; th <= 2; th++) {
            double rd[128], pr[128], ra[128];
            for (int r = 0; r <= rounds; r++) {
                const double tr = read_sweep(st.codes, codes, th);
                const double t0 = kds_now_s();
                for (int i = 0; i < n; i++)
                    product(&st.w[i], x, 1, y, th, 0);
                const double tp = kds_now_s() - t0;
                if (r == 0) continue; /* warm-up */
                rd[r - 1] = (double)codes / tr / 1e9;
                pr[r - 1] = bytes / tp / 1e9;
                ra[r - 1] = pr[r - 1] / rd[r - 1];
            }
            printf("| %s | [%d, %d] | %d (%.0f MB) | %d | %.1f | %.1f | **%.0f%%** |\n",
                   kern_dtype_name(dts[d]), rows, cols, n, bytes / 1e6, th, median(rd, rounds),
                   median(pr, rounds), 100.0 * median(ra, rounds));
            fflush(stdout);
        }
        free(x);
        free(y);
        free_stack(&st);
    }
    printf("\n");
}

/* (f) Long prompts: the attention of one prefill slice at context
 * position P against a layer's products. */
static double now_cpu(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void bench_long(void) {
    const int T = 256, H = 32, K = 128;
    const int64_t P[5] = {0, 4096, 16384, 65536, 131072};
    const int nP = g_quick ? 3 : 5;
    const kern_mla_shape msh = {H, 512, 64, 128, 128};
    const int row = msh.dc + msh.dr;
    /* the products' rate: a [4096, 2304] bf16 GEMM of T tokens, one thread */
    stack w = make_stack(KERN_BF16, 4096, 2304, 1);
    float *x = random_x((size_t)T * 2304, 3), *y = xalloc((size_t)T * 4096 * sizeof(float));
    double t_mm = 1e30;
    for (int r = 0; r < g_runs; r++) {
        const double t0 = now_cpu();
        kern_matmul_w(&w.w[0], x, T, y, 4096, 0, 4096, g_scratch[0]);
        const double dt = now_cpu() - t0;
        if (dt < t_mm) t_mm = dt;
    }
    const double gemm_flops = 2.0 * T * 4096 * 2304 / t_mm;
    const double layer_us = 2.0 * 100e6 / gemm_flops * 1e6; /* per token */
    printf("### (f) Long prompts: attention per token of a 256-token slice at position P, one "
           "thread, best of %d (CPU time)\n\n", g_runs);
    printf("Kimi-Linear-48B widths. A layer's products (~100 M bf16 weights a token) take %.0f us "
           "a token at the GEMM's %.0f GFLOP/s measured now.\n\n", layer_us, gemm_flops / 1e9);
    printf("| P | MLA attention, us/token | x a layer's products | KDA chunked core, us/token | "
           "x a layer's products |\n|---|---|---|---|---|\n");
    /* KDA: position does not matter (a fixed-size state) */
    const kern_kda_shape ksh = {H, H, K, K, 1.0f / sqrtf((float)K)};
    const size_t nq = (size_t)T * H * K;
    float *q = random_x(nq, 11), *k = random_x(nq, 12), *v = random_x(nq, 13), *g = xalloc(nq * 4);
    float *beta = xalloc((size_t)T * H * 4), *o = xalloc(nq * 4);
    float *state = xalloc((size_t)H * K * K * 4), *ws = xalloc(kern_kda_chunked_workspace_floats(&ksh, 64) * 4);
    for (size_t i = 0; i < nq; i++) {
        q[i] *= 0.1f, k[i] *= 0.1f;
        g[i] = -0.05f;
    }
    for (int i = 0; i < T * H; i++) beta[i] = 0.5f;
    double t_kda = 1e30;
    for (int r = 0; r < g_runs; r++) {
        memset(state, 0, (size_t)H * K * K * 4);
        const double t0 = now_cpu();
        kern_kda_chunked(&ksh, T, 64, q, k, v, g, beta, state, o, 0, H, ws);
        const double dt = now_cpu() - t0;
        if (dt < t_kda) t_kda = dt;
    }
    const double kda_us = t_kda / T * 1e6;
    /* MLA: the cache of P + T rows, the slice's queries, 32 heads */
    stack kvb = make_stack(KERN_BF16, H * (msh.dn + msh.dv), msh.dc, 1);
    float *mq = random_x((size_t)T * H * (msh.dn + msh.dr), 14), *mo = xalloc((size_t)T * H * msh.dv * 4);
    float *mws = xalloc(kern_mla_attend_workspace_floats(&msh, T) * 4);
    for (int p = 0; p < nP; p++) {
        const size_t rows = (size_t)P[p] + T;
        float *cache = random_x(rows * row, 15 + p);
        double t_mla = 1e30;
        const int runs = P[p] >= 65536 ? 1 : g_runs;
        for (int r = 0; r < runs; r++) {
            const double t0 = now_cpu();
            kern_mla_attend(&msh, KERN_BF16, kvb.codes, mq, T, P[p], cache, mo, 0, H, mws);
            const double dt = now_cpu() - t0;
            if (dt < t_mla) t_mla = dt;
        }
        const double mla_us = t_mla / T * 1e6;
        printf("| %lldK | %.0f | %.2f | %.0f | %.2f |\n", (long long)(P[p] / 1024), mla_us,
               mla_us / layer_us, kda_us, kda_us / layer_us);
        fflush(stdout);
        free(cache);
    }
    printf("\n");
    free(q), free(k), free(v), free(g), free(beta), free(o), free(state), free(ws);
    free(mq), free(mo), free(mws), free(x), free(y);
    free_stack(&kvb);
    free_stack(&w);
}

/* (g, second table) a batched step's MLA attention: N sequences, one
 * query each, at context P, one thread: row by row (kern_mla_decode_heads,
 * which widens all of kv_b, 8 MB of bf16, for every row) against one call
 * for the N rows (kern_mla_decode_rows: each kv_b row widened once), whose
 * outputs must be the same bits. kv_b stays in the last-level cache here;
 * in a step the other matrices stream through between two calls. */
static void bench_decode_attention_rows(const kern_mla_shape *msh, const kern_weight *kw) {
    enum { N = 8 };
    const int64_t P[3] = {256, 1024, 4096};
    const int H = msh->nh, row = msh->dc + msh->dr;
    float *q = random_x((size_t)N * H * (msh->dn + msh->dr), 23);
    const size_t o_bytes = (size_t)N * H * msh->dv * 4;
    float *o_row = xalloc(o_bytes), *o_all = xalloc(o_bytes);
    float *ws_row = xalloc(kern_mla_decode_heads_workspace_floats(msh) * 4);
    float *ws_all = xalloc(kern_mla_decode_rows_workspace_floats(msh, N) * 4);
    printf("### (g) A batched step's MLA attention: %d sequences at context P, 32 heads, one "
           "thread, best of %d (wall time)\n\n", N, g_runs);
    printf("| P | row by row, ms | the rows at once, ms | ratio | same bits |\n"
           "|---|---|---|---|---|\n");
    for (int p = 0; p < 3; p++) {
        const float *caches[N];
        int64_t pos[N];
        float *cache_mem = random_x((size_t)N * (P[p] + 1) * row, 41 + p);
        for (int i = 0; i < N; i++) {
            caches[i] = cache_mem + (size_t)i * (P[p] + 1) * row;
            pos[i] = P[p];
        }
        double t_row = 1e30, t_all = 1e30;
        for (int r = 0; r < g_runs; r++) {
            double t0 = kds_now_s();
            for (int i = 0; i < N; i++)
                kern_mla_decode_heads(msh, kw, q + (size_t)i * H * (msh->dn + msh->dr), 0, H,
                                      pos[i], caches[i], o_row + (size_t)i * H * msh->dv, ws_row);
            double dt = kds_now_s() - t0;
            if (dt < t_row) t_row = dt;
            t0 = kds_now_s();
            kern_mla_decode_rows(msh, kw, N, q, 0, H, pos, caches, o_all, ws_all);
            dt = kds_now_s() - t0;
            if (dt < t_all) t_all = dt;
        }
        const bool same = !memcmp(o_row, o_all, o_bytes);
        printf("| %lld | %.2f | %.2f | %.2fx | %s |\n", (long long)P[p], t_row * 1e3,
               t_all * 1e3, t_row / t_all, same ? "yes" : "NO");
        fflush(stdout);
        free(cache_mem);
    }
    printf("\n");
    free(q), free(o_row), free(o_all), free(ws_row), free(ws_all);
}

/* (g) one decode step's MLA attention at context P, one thread: head by
 * head (kern_mla_attend, T = 1: each head reads the cache twice) against
 * all heads at once (kern_mla_decode_heads: each cache block read once),
 * with the largest difference between their outputs. */
static void bench_decode_attention(void) {
    const int H = 32;
    const int64_t P[4] = {4096, 16384, 65536, 131072};
    const int nP = g_quick ? 2 : 4;
    const kern_mla_shape msh = {H, 512, 64, 128, 128};
    const int row = msh.dc + msh.dr;
    stack kvb = make_stack(KERN_BF16, H * (msh.dn + msh.dv), msh.dc, 1);
    const kern_weight kw = kvb.w[0];
    float *q = random_x((size_t)H * (msh.dn + msh.dr), 21);
    float *o_head = xalloc((size_t)H * msh.dv * 4), *o_all = xalloc((size_t)H * msh.dv * 4);
    float *ws_head = xalloc(kern_mla_attend_workspace_floats(&msh, 1) * 4);
    float *ws_all = xalloc(kern_mla_decode_heads_workspace_floats(&msh) * 4);
    printf("### (g) Decode: one token's MLA attention at context P, 32 heads, one thread, best "
           "of %d (wall time)\n\n", g_runs);
    printf("| P | cache MB | head by head, ms | all heads at once, ms | ratio | max diff / max |o| |\n"
           "|---|---|---|---|---|---|\n");
    for (int p = 0; p < nP; p++) {
        const size_t rows = (size_t)P[p] + 1;
        float *cache = random_x(rows * row, 31 + p);
        double t_head = 1e30, t_all = 1e30;
        const int runs = P[p] >= 65536 ? 3 : g_runs;
        for (int r = 0; r < runs; r++) {
            double t0 = kds_now_s();
            kern_mla_attend(&msh, KERN_BF16, kvb.codes, q, 1, P[p], cache, o_head, 0, H, ws_head);
            double dt = kds_now_s() - t0;
            if (dt < t_head) t_head = dt;
            t0 = kds_now_s();
            kern_mla_decode_heads(&msh, &kw, q, 0, H, P[p], cache, o_all, ws_all);
            dt = kds_now_s() - t0;
            if (dt < t_all) t_all = dt;
        }
        double diff = 0, mag = 0;
        for (int i = 0; i < H * msh.dv; i++) {
            const double dd = fabs((double)o_head[i] - o_all[i]);
            if (dd > diff) diff = dd;
            if (fabs((double)o_head[i]) > mag) mag = fabs((double)o_head[i]);
        }
        diff /= mag > 0 ? mag : 1;
        printf("| %lldK | %.0f | %.2f | %.2f | %.1fx | %.1e |\n", (long long)(P[p] / 1024),
               rows * row * 4 / 1e6, t_head * 1e3, t_all * 1e3, t_head / t_all, diff);
        fflush(stdout);
        free(cache);
    }
    printf("\n");
    free(q), free(o_head), free(o_all), free(ws_head), free(ws_all);
    bench_decode_attention_rows(&msh, &kw);
    free_stack(&kvb);
}

/* (h) Batched decode's products. The FMA peak first: 24 independent
 * chains of register-only fmas per thread (kern_madd_chains, the loop
 * `kdaserve bench` judges a prefill by), two flops a multiply-add. Without
 * FMA the peak is not measured and the percentages of (h) are left out. */

/* PEAK_TASKS tasks of `iters` rounds each, small enough that a thread the
 * pool wakes late still gets its share. */
#define PEAK_TASKS 64
typedef struct peak_job {
    bool dp; /* vdpbf16ps, not f32 FMAs */
    long iters;
    float sink[PEAK_TASKS]; /* a sum per task, so that the chains are not optimised away */
} peak_job;

static void peak_task(void *arg, int task, int thread) {
    peak_job *j = arg;
    (void)thread;
    j->sink[task] = kern_madd_chains(j->dp, j->iters);
}

/* GFLOP/s of `threads` threads of peak_task, the best of g_runs: a peak
 * is what the cores do when nothing else takes them. 0 where the build
 * has no such loop. */
static double fma_peak_of(int threads, bool dp) {
    const int per_round = kern_madd_per_round(dp);
    double best = 0;
    if (per_round == 0) return 0;
    for (int run = 0; run <= g_runs; run++) {
        peak_job j = {dp, g_quick ? 50000 : 250000, {0}};
        const double t0 = kds_now_s();
        run_tasks(threads, peak_task, &j, PEAK_TASKS);
        const double dt = kds_now_s() - t0;
        const double gflops = 2.0 * per_round * (double)j.iters * PEAK_TASKS / dt / 1e9;
        if (run > 0 && gflops > best) best = gflops;
    }
    return best;
}

static double fma_peak(int threads) { return fma_peak_of(threads, false); }

/* "62%": v as a share of the peak, or "-" where no peak was measured. */
static const char *pct(char *buf, size_t n, double v, double peak) {
    if (peak > 0)
        snprintf(buf, n, "%.0f%%", 100.0 * v / peak);
    else
        snprintf(buf, n, "-");
    return buf;
}

/* Rows [0, 128) of a matrix, over and over (`reps` products), each thread
 * its own share of them: they stay in its L2. */
typedef struct l2_job {
    const kern_weight *w;
    const float *x;
    float *y;
    int T, reps, n_tasks, ref;
} l2_job;

static void l2_task(void *arg, int task, int thread) {
    const l2_job *j = arg;
    const int r0 = 128 * task / j->n_tasks, r1 = 128 * (task + 1) / j->n_tasks;
    for (int i = 0; i < j->reps; i++) {
        if (j->ref == 2)
            kern_matmul_w_bf16act(j->w, j->x, j->T, j->y, j->w->rows, r0, r1, g_scratch[thread]);
        else
            kern_matmul_w(j->w, j->x, j->T, j->y, j->w->rows, r0, r1, g_scratch[thread]);
    }
}

/* bf16 [4096, 2304] (wide's q, k, v projections; its lm_head's rows are
 * as long) for T tokens on the direct path, as a batched decode step runs
 * them: each round times 128 rows over and over (from L2: the kernel's
 * compute ceiling), one matrix over and over (from the last-level
 * cache), a read of the stack's bytes (the memory's speed that second)
 * and a sweep over the stack (from memory). `overlap`: the larger of the
 * L3 and read times over the memory time; 100% would mean arithmetic and
 * memory overlap perfectly. mode 0: the exact products (kern_matmul_w);
 * 1: the same on AMX tiles (kern_weight.exact_tiles, where the CPU has
 * them), as the engine runs all but routed experts there; 2: x rounded to
 * bf16 (--bf16's kern_matmul_w_bf16act), its shares of the vdpbf16ps
 * peak. */
static void bench_batched(int mode) {
    const int Ts[] = {1, 2, 3, 4, 6, 8, 12, 16};
    const int rows = 4096, cols = 2304;
    const int rounds = g_runs < 5 ? 5 : g_runs;
    const kern_layout l = kern_weight_layout(KERN_BF16, rows, cols);
    const int n = stack_count(l.bytes);
    stack st = make_stack(KERN_BF16, rows, cols, n);
    const int own_pf = kern_stream_prefetch_bytes(), alt_pf = own_pf ? 0 : 8192;
    for (int i = 0; i < n; i++) st.w[i].exact_tiles = mode == 1;
    kern_weight hot = st.w[0];
    hot.streamed = false;
    float *x = random_x((size_t)16 * cols, 9), *y = xalloc((size_t)16 * rows * sizeof(float));
    if (mode == 2)
        printf("### (h) Batched decode under --bf16: bf16 [%d, %d] for T tokens, x rounded to "
               "bf16 (vdpbf16ps), from cache and from memory\n\n",
               rows, cols);
    else if (mode == 1)
        printf("### (h) Batched decode on AMX tiles: bf16 [%d, %d] for T tokens, exact (x split "
               "into three bf16 values, kern_weight.exact_tiles), from cache and from memory\n\n",
               rows, cols);
    else
        printf("### (h) Batched decode: bf16 [%d, %d] for T tokens, from cache and from memory\n\n",
               rows, cols);
    const double peak[3] = {0, fma_peak_of(1, mode == 2), fma_peak_of(2, mode == 2)};
    printf("%s peak (24 chains of register %s, best of %d): %.0f GFLOP/s on 1 thread, %.0f on "
           "2. Per "
           "round: its first 128 rows 640 times, each thread its share (`L2`: they stay in "
           "its L2), one matrix 20 times (`L3`: %.1f MB, in the last-level cache), a read of "
           "the stack (%d matrices, %.0f MB), a sweep over the stack (`memory`; this CPU's "
           "kern_stream_prefetch_bytes %d; T = 1 also with the other `prefetch`); %d rounds, "
           "medians. `overlap` = max(L3 time, read time) / memory time, for the same "
           "bytes.\n\n",
           mode == 2 ? "vdpbf16ps" : "FMA", mode == 2 ? "vdpbf16ps" : "fmas", g_runs, peak[1],
           peak[2], (double)l.bytes / 1e6, n, (double)l.bytes * n / 1e6, own_pf,
           rounds);
    printf("| T | threads | L2: %% of peak | L3: %% of peak | memory GFLOP/s | %% of peak | memory "
           "GB/s | prefetch %s | read GB/s | overlap |\n|---|---|---|---|---|---|---|---|---|---|\n",
           own_pf ? "none" : "8 KiB");
    for (size_t k = 0; k < sizeof Ts / sizeof Ts[0]; k++) {
        const int T = Ts[k];
        const double flops = 2.0 * T * rows * cols;
        for (int th = 1; th <= 2; th++) {
            double l2_g[64], hot_g[64], mem_g[64], mem_b[64], rd_b[64], ov[64], alt_b[64];
            for (int r = 0; r <= rounds; r++) {
                const int reps = 20;
                l2_job lj = {&hot, x, y, T, 32 * reps, th, mode};
                double t0 = kds_now_s();
                run_tasks(th, l2_task, &lj, th);
                const double t_l2 = (kds_now_s() - t0) / (32.0 * reps) * (rows / 128.0);
                t0 = kds_now_s();
                for (int i = 0; i < reps; i++)
                    product(&hot, x, T, y, th, mode);
                const double t_hot = (kds_now_s() - t0) / reps;
                const double t_read = read_sweep(st.codes, l.data_bytes * (size_t)n, th) / n;
                t0 = kds_now_s();
                for (int i = 0; i < n; i++)
                    product(&st.w[i], x, T, y, th, mode);
                const double t_mem = (kds_now_s() - t0) / n;
                /* one token: the same sweep with the other software
                 * prefetch (none against 8 KiB along the stream) */
                double t_alt = 0;
                if (T == 1 && mode == 0) {
                    for (int i = 0; i < n; i++) st.w[i].stream_prefetch = alt_pf;
                    t0 = kds_now_s();
                    for (int i = 0; i < n; i++)
                        product(&st.w[i], x, T, y, th, 0);
                    t_alt = (kds_now_s() - t0) / n;
                    for (int i = 0; i < n; i++) st.w[i].stream_prefetch = own_pf;
                }
                if (r == 0) continue; /* warm-up */
                alt_b[r - 1] = t_alt > 0 ? (double)l.bytes / t_alt / 1e9 : 0;
                l2_g[r - 1] = flops / t_l2 / 1e9;
                hot_g[r - 1] = flops / t_hot / 1e9;
                mem_g[r - 1] = flops / t_mem / 1e9;
                mem_b[r - 1] = (double)l.bytes / t_mem / 1e9;
                rd_b[r - 1] = (double)l.bytes / t_read / 1e9;
                ov[r - 1] = (t_hot > t_read ? t_hot : t_read) / t_mem;
            }
            const double lg = median(l2_g, rounds), hg = median(hot_g, rounds),
                         mg = median(mem_g, rounds);
            char p1[16], p2[16], p3[16], alt[16] = "-";
            if (T == 1 && mode == 0) snprintf(alt, sizeof alt, "%.1f", median(alt_b, rounds));
            printf("| %d | %d | %s | %s | %.0f | %s | %.1f | %s | %.1f | **%.0f%%** |\n", T, th,
                   pct(p1, sizeof p1, lg, peak[th]), pct(p2, sizeof p2, hg, peak[th]), mg,
                   pct(p3, sizeof p3, mg, peak[th]), median(mem_b, rounds), alt,
                   median(rd_b, rounds), 100.0 * median(ov, rounds));
            fflush(stdout);
        }
    }
    printf("\n");
    free(x);
    free(y);
    free_stack(&st);
}

/* (i) and (j)'s bf16 W [rows, in]: finite values near 0.01, seeded by in. */
static uint16_t *gemm_matrix(int rows, int in) {
    uint16_t *W = xalloc((size_t)rows * in * sizeof(uint16_t));
    fill_bytes(W, (size_t)rows * in * sizeof(uint16_t), 77 + (uint64_t)in);
    for (size_t i = 0; i < (size_t)rows * in; i++)
        W[i] = (uint16_t)(0x3c00 + (W[i] & 0xff));
    return W;
}

/* (i) The prefill GEMM with x read in place (12 token rows `in` floats
 * apart: a multiple of 4 KiB for in = 1024, 4096, 9216) against x packed
 * 12 tokens side by side, the same product and bits, alternating round by
 * round, one thread. Each matrix is 4.7-42 MB: in the last-level cache up
 * to in = 4096, from memory at 9216. */
static void bench_gemm_packing(void) {
#if KERN_GEMM_SIMD
    const int ins[] = {1024, 2304, 4096, 9216}, Ts[] = {64, 256}, rows = 2304;
    const int rounds = g_runs < 3 ? 3 : g_runs;
    const double peak = fma_peak(1);
    printf("### (i) Prefill GEMM: x in place against x packed (bf16 [%d, in], 1 thread)\n\n",
           rows);
    printf("FMA peak %.0f GFLOP/s (1 thread). %d rounds, each timing both forms once (the "
           "better of 2 products); medians.\n\n",
           peak, rounds);
    printf("| in | T | in place GFLOP/s | %% of peak | packed GFLOP/s | %% of peak "
           "| packed / in place |\n|---|---|---|---|---|---|---|\n");
    for (size_t a = 0; a < sizeof ins / sizeof ins[0]; a++) {
        const int in = ins[a];
        uint16_t *W = gemm_matrix(rows, in);
        const kern_gemm_w gw = {KERN_BF16, W, in, false};
        for (size_t b = 0; b < sizeof Ts / sizeof Ts[0]; b++) {
            const int T = Ts[b];
            float *x = random_x((size_t)T * in, 5), *y = xalloc((size_t)T * rows * sizeof(float));
            const size_t panel = kern__gemm_panel_floats(in);
            const size_t packed = kern__gemm_scratch_floats(in, T);
            float *scr = xalloc((panel > packed ? panel : packed) * sizeof(float));
            double g[2][64];
            const double flops = 2.0 * rows * in * T;
            for (int r = 0; r < rounds; r++)
                for (int form = 0; form < 2; form++) {
                    double best = 1e30;
                    for (int k = 0; k < 2; k++) {
                        const double t0 = kds_now_s();
                        kern__gemm(&gw, in, x, in, T, y, rows, 0, rows, false, scr,
                                   form ? packed : panel);
                        const double dt = kds_now_s() - t0;
                        if (dt < best) best = dt;
                    }
                    g[form][r] = flops / best / 1e9;
                }
            const double in_place = median(g[0], rounds), pk = median(g[1], rounds);
            char p1[16], p2[16];
            printf("| %d | %d | %.0f | %s | %.0f | %s | %.2fx |\n", in, T, in_place,
                   pct(p1, sizeof p1, in_place, peak), pk, pct(p2, sizeof p2, pk, peak),
                   pk / in_place);
            fflush(stdout);
            free(x);
            free(y);
            free(scr);
        }
        free(W);
    }
    printf("\n");
#else
    printf("### (i) Prefill GEMM: needs AVX-512 or AVX2 (not built)\n\n");
#endif
}

/* (j) --bf16's prefill GEMM, vdpbf16ps against AMX tiles: one thread,
 * the engine's scratch (x rounded once for all T tokens), the better of 2
 * products per form per round, the forms alternating. */
static void bench_gemm_amx(void) {
#if KERN_GEMM_SIMD && defined(__AVX512BF16__)
    const int ins[] = {1024, 2304, 4096, 9216}, Ts[] = {64, 256, 512}, rows = 2304;
    const int rounds = g_runs < 3 ? 3 : g_runs;
    const bool amx = kern__gemm_amx();
    const double dp_peak = fma_peak_of(1, true), fma = fma_peak(1);
    printf("### (j) Prefill GEMM under --bf16: vdpbf16ps against AMX tiles (bf16 [%d, in], 1 "
           "thread)\n\n",
           rows);
    printf("AMX tiles here: %s. Peaks on 1 thread: vdpbf16ps %.0f GFLOP/s, f32 FMA %.0f (the "
           "exact prefill's ceiling). %d rounds, each timing both forms once (the better of 2 "
           "products); medians. `diff`: the largest |tiles - vdpbf16ps| of either tile kernel "
           "over the largest |output|.\n\n",
           amx ? "yes" : "no (both columns are the vdpbf16ps kernel)", dp_peak, fma, rounds);
    printf("| in | T | vdpbf16ps GFLOP/s | %% of its peak | tiles GFLOP/s | rows in place "
           "GFLOP/s | tiles / vdpbf16ps | tiles / FMA peak | diff |\n"
           "|---|---|---|---|---|---|---|---|---|\n");
    for (size_t a = 0; a < sizeof ins / sizeof ins[0]; a++) {
        const int in = ins[a];
        uint16_t *W = gemm_matrix(rows, in);
        const kern_gemm_w gw = {KERN_BF16, W, in, false};
        for (size_t b = 0; b < sizeof Ts / sizeof Ts[0]; b++) {
            const int T = Ts[b];
            float *x = random_x((size_t)T * in, 5);
            float *y[3] = {xalloc((size_t)T * rows * sizeof(float)),
                           xalloc((size_t)T * rows * sizeof(float)),
                           xalloc((size_t)T * rows * sizeof(float))};
            const size_t sf = kern__gemm_scratch_floats(in, T) + (size_t)T * in;
            float *scr = xalloc(sf * sizeof(float));
            double g[3][64];
            const double flops = 2.0 * rows * in * T;
            for (int r = 0; r < rounds; r++)
                for (int form = 0; form < (amx ? 3 : 2); form++) {
                    double best = 1e30;
                    for (int k = 0; k < 2; k++) {
                        const double t0 = kds_now_s();
#if KERN_GEMM_AMX
                        if (form == 2)
                            kern__amx_rows_bf16(W, in, x, in, T, y[2], rows, 0, rows, scr);
                        else
#endif
                            kern__gemm_bf16x_on(form == 1, &gw, in, x, in, T, y[form], rows, 0,
                                                rows, false, scr, sf);
                        const double dt = kds_now_s() - t0;
                        if (dt < best) best = dt;
                    }
                    g[form][r] = flops / best / 1e9;
                }
            double big = 0, diff = 0;
            for (size_t i = 0; i < (size_t)T * rows; i++) {
                double d = fabs((double)y[1][i] - y[0][i]);
                if (amx && fabs((double)y[2][i] - y[0][i]) > d) d = fabs((double)y[2][i] - y[0][i]);
                const double m = fabs((double)y[0][i]);
                if (d > diff) diff = d;
                if (m > big) big = m;
            }
            const double dp = median(g[0], rounds), tl = median(g[1], rounds);
            const double direct = amx ? median(g[2], rounds) : 0;
            char p1[16];
            printf("| %d | %d | %.0f | %s | %.0f | %.0f | %.2fx | %.2fx | %.1e |\n", in, T, dp,
                   pct(p1, sizeof p1, dp, dp_peak), tl, direct, tl / dp, tl / fma,
                   big > 0 ? diff / big : 0.0);
            fflush(stdout);
            free(x);
            free(y[0]);
            free(y[1]);
            free(y[2]);
            free(scr);
        }
        free(W);
    }
    printf("\n");
#else
    printf("### (j) Prefill GEMM under --bf16: needs AVX-512 BF16 (not built)\n\n");
#endif
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) {
            g_quick = 1;
            g_runs = 3;
        } else if (!strcmp(argv[i], "--runs") && i + 1 < argc && atoi(argv[i + 1]) > 0 &&
                   atoi(argv[i + 1]) <= 63) {
            g_runs = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
            g_only = argv[++i];
        } else {
            fprintf(stderr, "usage: %s [--quick] [--runs N (1..63)] [--only abcdefghij]\n", argv[0]);
            return 2;
        }
    }
    openblas_set_num_threads(1);
    for (int th = 1; th <= 2; th++) {
        kds_err err;
        memset(&err, 0, sizeof err);
        if (eng_pool_create(th, &g_pool[th], &err) != KDS_OK) {
            fprintf(stderr, "cpu_bench: pool: %s\n", err.msg);
            return 1;
        }
    }
    for (int t = 0; t < 2; t++) {
        const size_t n = kern_matmul_scratch_floats(3584);
        g_scratch[t] = xalloc(n * sizeof(float));
        memset(g_scratch[t], 0, n * sizeof(float));
    }
    g_l3 = cache_bytes(3);
    char model[160], when[64];
    cpu_model(model, sizeof model);
    const time_t now = time(NULL);
    strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", gmtime(&now));
    printf("## kds_cpu_bench\n\n");
    printf("- command: `");
    for (int i = 0; i < argc; i++)
        printf("%s%s", i ? " " : "", argv[i]);
    printf("`, %s\n", when);
    printf("- machine: %s, %ld CPUs online, L2 %zu KiB, L3 %zu MiB; OpenBLAS core %s; gcc %s\n\n",
           model, sysconf(_SC_NPROCESSORS_ONLN), cache_bytes(2) >> 10, g_l3 >> 20,
           openblas_get_corename(), __VERSION__);
    /* (b) gives its GB/s as a share of (a)'s: it runs (a) first */
    if (strchr(g_only, 'a') || strchr(g_only, 'b')) bench_bandwidth();
    if (strchr(g_only, 'b')) bench_decode();
    if (strchr(g_only, 'c')) bench_tokens();
    if (strchr(g_only, 'd')) bench_prefill();
    if (strchr(g_only, 'e')) bench_alternating();
    if (strchr(g_only, 'f')) bench_long();
    if (strchr(g_only, 'g')) bench_decode_attention();
    if (strchr(g_only, 'h')) {
        bench_batched(0);
        if (kern_bf16_tiles()) bench_batched(1);
        if (kern_bf16_products()) bench_batched(2);
    }
    if (strchr(g_only, 'i')) bench_gemm_packing();
    if (strchr(g_only, 'j')) bench_gemm_amx();
    for (int t = 0; t < 2; t++)
        free(g_scratch[t]);
    for (int th = 1; th <= 2; th++)
        eng_pool_free(g_pool[th]);
    return 0;
}
