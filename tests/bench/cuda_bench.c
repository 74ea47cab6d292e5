/*
 * cuda_bench.c - GPU timings of the CUDA kernels (kern_cuda.h) at
 * Kimi-Linear-48B's KDA shape (H = HV = 32, K = V = 128, bf16 inputs, fp32
 * state), next to the figures of shared/reference/performance-anchors.md.
 * Built by CMake as `kds_cuda_bench` when nvcc is found; run by
 * scripts/gpu_check.sh on the GPU machine:
 *
 *   kds_cuda_bench [--quick] [--decode | --prefill | --gemm]
 *       --quick: fewer repeats, no T = 1M prefill; --decode / --prefill / --gemm: only those
 *   kds_cuda_bench --tiny         # toy sizes: a smoke test of this program
 *                                 # itself (e.g. under kernels/cuda/emu)
 *   kds_cuda_bench --once T       # one fp32 and one tensor-core prefill at T
 *                                 # tokens and one decode step at B = 256, no
 *                                 # repeats: a short run for a profiler (ncu)
 *
 * Prints markdown tables (the same lines go to docs/benchmarks.md):
 *   - device-to-device copy bandwidth (the ceiling the decode is judged by);
 *   - the fused KDA decode step, B = 1, 16, 64, 256: median kernel time with
 *     events around each launch, mean time back to back, and the effective
 *     bandwidth of the state traffic (state read + written once);
 *   - the chunked KDA prefill, T = 16K, 128K, 1M, raw inputs (L2 norm, gate
 *     and sigmoid in the kernel, as fla's chunk_kda was timed), tokens/s;
 *   - the smaller kernels: gated RMSNorm, MoE routing, sampling;
 *   - the matrix products (--gemm): kern_cuda_matmul at Kimi's q_proj,
 *     o_proj, lm_head for T = 1, 8, 64, 4096 and the grouped experts
 *     (top-8 of 256) at T = 1, 64, 4096, GB/s and TFLOP/s, both modes;
 *     Kimi K3's MXFP4 routed experts (top-16 of 896, w1 | w3 [3072, 3584]
 *     fused with SiTU, w2 [3584, 3072]; 15.7 GB of codes and scales) at
 *     T = 1, 8, 64 (GEMV) and 4096 (tensor cores).
 * Method: inputs filled on the GPU with random values (never zeros), a
 * warm-up, then repeats; before each timed run a 2 GiB fill is queued so the
 * host enqueues the timed launches while the GPU is still busy (no host gaps
 * inside the measurement). Decode rotates over pools whose total exceeds the
 * L2 cache, so the state comes from HBM as it would in serving.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "kern.h"
#include "kern_cuda.h"

static void die(const char *fmt, const char *a, const char *b) {
    fprintf(stderr, fmt, a, b);
    fputc('\n', stderr);
    exit(1);
}

#define CK(call)                                                                               \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) die("%s: %s", #call, cudaGetErrorString(e_));                   \
    } while (0)

#define KS(call)                                                                               \
    do {                                                                                       \
        kds_err err_;                                                                          \
        memset(&err_, 0, sizeof err_);                                                         \
        kds_status st_ = (call);                                                               \
        (void)err_;                                                                            \
        if (st_ != KDS_OK) die("%s: %s", #call, err_.msg);                                     \
    } while (0)
#define ERR (&err_)

static void *dalloc(size_t bytes) {
    void *p = NULL;
    CK(cudaMalloc(&p, bytes ? bytes : 16));
    return p;
}

static void fill(void *p, kern_dtype dt, size_t n, float lo, float hi, uint64_t seed) {
    KS(kern_cuda_fill_uniform(p, dt, n, lo, hi, seed, NULL, ERR));
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *x, int n) {
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

/* Keeps the GPU busy ~1-2 ms so that the launches queued after it run back
 * to back, whatever the host's launch rate. */
static void *g_busy;
static size_t g_busy_floats = (size_t)512 << 20; /* 2 GiB */
static int g_tiny;                               /* --tiny: toy sizes */
static void queue_busy_work(void) {
    fill(g_busy, KERN_F32, g_busy_floats, 0.0f, 1.0f, 7);
}

static double g_copy_tbs;

static void bench_copy(void) {
    const size_t bytes = g_tiny ? (size_t)1 << 20 : (size_t)4 << 30;
    void *a = dalloc(bytes), *b = dalloc(bytes);
    fill(a, KERN_F32, bytes / 4, -1.0f, 1.0f, 1);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double t[5];
    for (int i = 0; i < 6; i++) {
        CK(cudaEventRecord(e0, 0));
        CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i > 0) t[i - 1] = ms;
    }
    const double ms = median(t, 5);
    g_copy_tbs = 2.0 * bytes / (ms * 1e-3) / 1e12;
    printf("Device-to-device copy of 4 GiB: %.3f ms, **%.2f TB/s** (read + write; the anchor "
           "measured 4.27)\n\n",
           ms, g_copy_tbs);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    CK(cudaFree(a));
    CK(cudaFree(b));
}

/* ---- decode ------------------------------------------------------------------ */

static void bench_decode(int quick) {
    const int H = 32, K = 128, V = 128;
    const int Bs[] = {1, 16, 64, 256};
    const double fla_us[] = {214, 209, 275, 637};
    const size_t slot_bytes = (size_t)H * K * V * 4; /* 2 MiB */
    printf("### KDA decode step, one layer (H = HV = 32, K = V = 128, bf16 inputs, fp32 state)\n\n");
    printf("| B | kernel µs (median, events per launch) | back to back µs (mean) | state TB/s "
           "(kernel) | %% of 4.27 TB/s | %% of measured copy | fla µs (anchor) |\n");
    printf("|---|---|---|---|---|---|---|\n");
    for (size_t bi = 0; bi < (g_tiny ? 2 : sizeof Bs / sizeof Bs[0]); bi++) {
        const int B = Bs[bi];
        int sets = g_tiny ? 2 : (int)ceil((256.0 * (1 << 20)) / ((double)B * slot_bytes));
        if (sets < 2) sets = 2;
        const int P = B * sets;
        float *pool = dalloc((size_t)P * slot_bytes);
        fill(pool, KERN_F32, (size_t)P * slot_bytes / 4, -1.0f, 1.0f, 11);
        void *q = dalloc((size_t)B * H * K * 2), *k = dalloc((size_t)B * H * K * 2);
        void *v = dalloc((size_t)B * H * V * 2), *g = dalloc((size_t)B * H * K * 2);
        void *beta = dalloc((size_t)B * H * 2);
        float *A_log = dalloc(H * 4), *dt_bias = dalloc((size_t)H * K * 4);
        float *o = dalloc((size_t)B * H * V * 4);
        fill(q, KERN_BF16, (size_t)B * H * K, -1, 1, 12);
        fill(k, KERN_BF16, (size_t)B * H * K, -1, 1, 13);
        fill(v, KERN_BF16, (size_t)B * H * V, -1, 1, 14);
        fill(g, KERN_BF16, (size_t)B * H * K, -4, 4, 15);
        fill(beta, KERN_BF16, (size_t)B * H, -3, 3, 16);
        fill(A_log, KERN_F32, H, -1, 1.5f, 17);
        fill(dt_bias, KERN_F32, (size_t)H * K, -1, 1, 18);
        int32_t *slots_h = malloc((size_t)P * sizeof(int32_t));
        for (int i = 0; i < P; i++) slots_h[i] = i;
        int32_t *slots = dalloc((size_t)P * sizeof(int32_t));
        CK(cudaMemcpy(slots, slots_h, (size_t)P * sizeof(int32_t), cudaMemcpyHostToDevice));
        free(slots_h);
        kern_cuda_kda_decode_args a = {
            .shape = {H, H, K, V, 1.0f / sqrtf((float)K)}, .N = B, .in_dtype = KERN_BF16,
            .q = q, .k = k, .v = v, .g_raw = g, .beta_raw = beta, .A_log = A_log,
            .dt_bias = dt_bias, .lower_bound = 0.0f, .state_pool = pool, .pool_slots = P,
            .slots = slots, .o = o,
        };
        const int R = g_tiny ? 3 : quick ? 50 : 200;
        cudaEvent_t *ev = malloc((size_t)(2 * R + 2) * sizeof *ev);
        for (int i = 0; i < 2 * R + 2; i++) CK(cudaEventCreate(&ev[i]));
        for (int i = 0; i < (g_tiny ? 1 : 20); i++) { /* warm-up */
            a.slots = slots + (size_t)(i % sets) * B;
            KS(kern_cuda_kda_decode(&a, NULL, ERR));
        }
        CK(cudaDeviceSynchronize());
        /* events around each launch */
        queue_busy_work();
        for (int i = 0; i < R; i++) {
            a.slots = slots + (size_t)(i % sets) * B;
            CK(cudaEventRecord(ev[2 * i], 0));
            KS(kern_cuda_kda_decode(&a, NULL, ERR));
            CK(cudaEventRecord(ev[2 * i + 1], 0));
        }
        CK(cudaDeviceSynchronize());
        double *t = malloc((size_t)R * sizeof *t);
        for (int i = 0; i < R; i++) {
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
            t[i] = ms * 1e3;
        }
        const double us = median(t, R);
        /* back to back */
        queue_busy_work();
        CK(cudaEventRecord(ev[2 * R], 0));
        for (int i = 0; i < R; i++) {
            a.slots = slots + (size_t)(i % sets) * B;
            KS(kern_cuda_kda_decode(&a, NULL, ERR));
        }
        CK(cudaEventRecord(ev[2 * R + 1], 0));
        CK(cudaDeviceSynchronize());
        float ms_all = 0;
        CK(cudaEventElapsedTime(&ms_all, ev[2 * R], ev[2 * R + 1]));
        const double b2b = ms_all * 1e3 / R;
        const double state_bytes = 2.0 * B * (double)slot_bytes;
        const double tbs = state_bytes / (us * 1e-6) / 1e12;
        printf("| %d | %.2f | %.2f | %.2f | %.0f%% | %.0f%% | %.0f |\n", B, us, b2b, tbs,
               100.0 * tbs / 4.27, 100.0 * tbs / g_copy_tbs, fla_us[bi]);
        fflush(stdout);
        for (int i = 0; i < 2 * R + 2; i++) CK(cudaEventDestroy(ev[i]));
        free(ev);
        free(t);
        void *f[] = {pool, q, k, v, g, beta, A_log, dt_bias, o, slots};
        for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) CK(cudaFree(f[i]));
    }
    printf("\nTargets (issue 7): B = 1 <= 8 µs; B = 256 >= 85%% of 4.27 TB/s (<= ~295 µs).\n\n");
}

/* ---- prefill ---------------------------------------------------------------- */

static double time_prefill(kern_cuda_kda_prefill_args *a, float *state, size_t state_n, int reps) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double *t = malloc((size_t)reps * sizeof *t);
    for (int i = -1; i < reps; i++) { /* i = -1: warm-up */
        fill(state, KERN_F32, state_n, -1, 1, 21);
        queue_busy_work();
        CK(cudaEventRecord(e0, 0));
        KS(kern_cuda_kda_prefill(a, NULL, ERR));
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 0) t[i] = ms;
    }
    const double ms = median(t, reps);
    free(t);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return ms;
}

static void bench_prefill(int quick) {
    const int H = g_tiny ? 2 : 32, K = 128, V = 128;
    const int Ts[] = {16384, 131072, 1048576};
    const int Ttiny[] = {100, 131, 300};
    const double fla_ms[] = {3.00, 17.3, 135.6};
    const int nT = quick ? 2 : 3;
    const size_t Tmax = (size_t)(g_tiny ? Ttiny[nT - 1] : Ts[nT - 1]);
    const kern_kda_shape sh = {H, H, K, V, 1.0f / sqrtf((float)K)};
    void *q = dalloc(Tmax * H * K * 2), *k = dalloc(Tmax * H * K * 2);
    void *v = dalloc(Tmax * H * V * 2), *g = dalloc(Tmax * H * K * 2);
    void *beta = dalloc(Tmax * H * 2);
    float *A_log = dalloc(H * 4), *dt_bias = dalloc((size_t)H * K * 4);
    float *o = dalloc(Tmax * H * V * 4), *state = dalloc((size_t)H * K * V * 4);
    fill(q, KERN_BF16, Tmax * H * K, -1, 1, 31);
    fill(k, KERN_BF16, Tmax * H * K, -1, 1, 32);
    fill(v, KERN_BF16, Tmax * H * V, -1, 1, 33);
    fill(g, KERN_BF16, Tmax * H * K, -4, 4, 34);
    fill(beta, KERN_BF16, Tmax * H, -3, 3, 35);
    fill(A_log, KERN_F32, H, -1, 1.5f, 36);
    fill(dt_bias, KERN_F32, (size_t)H * K, -1, 1, 37);
    const int ws_chunks[] = {16, 64, 256};
    const size_t ws_max = kern_cuda_kda_prefill_workspace_bytes(&sh, 256);
    void *ws = dalloc(ws_max);
    printf("### KDA chunked prefill, one layer (H = HV = 32, K = V = 128, bf16 q/k/v/g/beta, "
           "fp32 state; L2 norm, gate and sigmoid in the kernel)\n\n");
    printf("| T | kernels (intra + state) | workspace (chunks, MiB) | ms (median) | M tokens/s | vs fla "
           "chunk_kda (anchor) | profiled run: intra / state ms (passes) |\n");
    printf("|---|---|---|---|---|---|---|\n");
    for (int ti = 0; ti < nT; ti++) {
        const int T = g_tiny ? Ttiny[ti] : Ts[ti];
        for (size_t wi = 0; wi < 2 * sizeof ws_chunks / sizeof ws_chunks[0]; wi++) {
            /* fp32 and tensor-core kernels (tensor_cores = true: the intra
             * kernel and the state pass both on tensor cores) at 64 chunks of workspace;
             * the workspace sweep at 128K only, fp32 */
            const int tc = (int)(wi / (sizeof ws_chunks / sizeof ws_chunks[0]));
            const int wc = ws_chunks[wi % (sizeof ws_chunks / sizeof ws_chunks[0])];
            if (wc != 64 && (ti != 1 || tc)) continue;
            kern_cuda_kda_prefill_args a = {
                .shape = sh, .T = T, .in_dtype = KERN_BF16, .raw = true,
                .q = q, .k = k, .v = v, .g = g, .beta = beta, .A_log = A_log, .dt_bias = dt_bias,
                .lower_bound = 0.0f, .state = state, .o = o, .workspace = ws,
                .workspace_bytes = kern_cuda_kda_prefill_workspace_bytes(&sh, wc),
                .tensor_cores = tc,
            };
            const int reps = g_tiny ? 1 : T >= 1048576 ? (quick ? 1 : 3) : T >= 131072 ? 5 : 10;
            const double ms = time_prefill(&a, state, (size_t)H * K * V, reps);
            const double mtok = T / (ms * 1e-3) / 1e6;
            /* one more run, profiled: where the time goes */
            kern_cuda_prefill_profile prof = {0};
            a.profile = &prof;
            KS(kern_cuda_kda_prefill(&a, NULL, ERR));
            CK(cudaDeviceSynchronize());
            a.profile = NULL;
            printf("| %d | %s | %d (%.0f) | %.2f | %.2f | %.2fx (fla %.1f ms) | %.2f / %.2f (%d) |\n",
                   T, tc ? "tensor cores (both)" : "fp32 (both)", wc, a.workspace_bytes / 1048576.0, ms, mtok,
                   fla_ms[ti] / ms, fla_ms[ti], prof.intra_ms, prof.state_ms, prof.passes);
            fflush(stdout);
        }
    }
    printf("\nTarget (issue 7): >= 2x fla's 7.7 M tokens/s, i.e. >= 15.4 M tokens/s per layer.\n\n");
    void *f[] = {q, k, v, g, beta, A_log, dt_bias, o, state, ws};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) CK(cudaFree(f[i]));
}

/* ---- small kernels ------------------------------------------------------------ */

typedef void (*launch_fn)(void *ctx);

static double time_us(launch_fn fn, void *ctx, int reps) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double *t = malloc((size_t)reps * sizeof *t);
    for (int i = 0; i < (g_tiny ? 1 : 5); i++) fn(ctx);
    for (int i = 0; i < reps; i++) {
        queue_busy_work();
        CK(cudaEventRecord(e0, 0));
        fn(ctx);
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t[i] = ms * 1e3;
    }
    const double us = median(t, reps);
    free(t);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return us;
}

static void run_norm(void *ctx) {
    KS(kern_cuda_rmsnorm((const kern_cuda_norm_args *)ctx, NULL, ERR));
}
static void run_route(void *ctx) {
    KS(kern_cuda_moe_route((const kern_cuda_moe_route_args *)ctx, NULL, ERR));
}
static void run_sample(void *ctx) {
    KS(kern_cuda_sample((const kern_cuda_sample_args *)ctx, NULL, ERR));
}

static void bench_small(int quick) {
    const int reps = g_tiny ? 1 : quick ? 10 : 30;
    printf("### Smaller kernels\n\n| kernel | size | µs (median) |\n|---|---|---|\n");
    const int rows_list[] = {g_tiny ? 64 : 256 * 32, g_tiny ? 96 : 16384 * 32};
    for (int i = 0; i < 2; i++) {
        const int rows = rows_list[i], n = 128;
        float *x = dalloc((size_t)rows * n * 4);
        void *z = dalloc((size_t)rows * n * 2), *w = dalloc(n * 4), *y = dalloc((size_t)rows * n * 2);
        fill(x, KERN_F32, (size_t)rows * n, -3, 3, 41);
        fill(z, KERN_BF16, (size_t)rows * n, -3, 3, 42);
        fill(w, KERN_F32, n, 0.5f, 1.5f, 43);
        kern_cuda_norm_args a = {.rows = rows, .n = n, .eps = 1e-5f, .x = x, .z = z,
                                 .z_dtype = KERN_BF16, .w = w, .w_dtype = KERN_F32, .y = y,
                                 .y_dtype = KERN_BF16};
        printf("| gated RMSNorm (fp32 o, bf16 gate -> bf16) | %d tokens x 32 heads x 128 | %.2f |\n",
               rows / 32, time_us(run_norm, &a, reps));
        void *f[] = {x, z, w, y};
        for (size_t j = 0; j < 4; j++) CK(cudaFree(f[j]));
    }
    /* the hidden-size norms of a decode step: one row of 2304 (Kimi-Linear)
     * and of 7168 (K3), fp32 -> fp32 with a bf16 weight */
    const int wide_n[] = {2304, 7168};
    for (int i = 0; i < 2; i++) {
        const int n = g_tiny ? 512 * (i + 1) : wide_n[i];
        float *x = dalloc((size_t)n * 4), *y = dalloc((size_t)n * 4);
        void *w = dalloc((size_t)n * 2);
        fill(x, KERN_F32, (size_t)n, -3, 3, 44);
        fill(w, KERN_BF16, (size_t)n, 0.5f, 1.5f, 45);
        kern_cuda_norm_args a = {.rows = 1, .n = n, .eps = 1e-6f, .x = x, .w = w, .w_dtype = KERN_BF16,
                                 .y = y, .y_dtype = KERN_F32};
        printf("| RMSNorm (fp32, bf16 weight) | 1 row x %d | %.2f |\n", n, time_us(run_norm, &a, reps));
        CK(cudaFree(x));
        CK(cudaFree(y));
        CK(cudaFree(w));
    }
    const int Tr[] = {1, 256, 8192};
    for (int i = 0; i < (g_tiny ? 2 : 3); i++) {
        const int T = Tr[i], E = 256, kk = 8;
        float *lg = dalloc((size_t)T * E * 4), *bias = dalloc(E * 4), *w = dalloc((size_t)T * kk * 4);
        int32_t *sel = dalloc((size_t)T * kk * 4), *row = dalloc((size_t)T * kk * 4);
        int32_t *tok = dalloc((size_t)T * kk * 4), *off = dalloc((E + 1) * 4);
        fill(lg, KERN_F32, (size_t)T * E, -4, 4, 51);
        fill(bias, KERN_F32, E, -0.1f, 0.1f, 52);
        kern_cuda_moe_route_args a = {
            .p = {.n_experts = E, .top_k = kk, .n_group = 1, .topk_group = 1, .renormalize = 1,
                  .routed_scaling_factor = 2.446f},
            .T = T, .logits = lg, .apply_sigmoid = true, .bias = bias, .sel = sel, .w = w,
            .exp_off = off, .row_of = row, .tok_of = tok};
        printf("| MoE routing + permutation (sigmoid, bias, top-8 of 256) | T = %d | %.2f |\n", T,
               time_us(run_route, &a, reps));
        void *f[] = {lg, bias, w, sel, row, tok, off};
        for (size_t j = 0; j < 7; j++) CK(cudaFree(f[j]));
    }
    const int Ns[] = {1, 64};
    for (int i = 0; i < 2; i++) {
        const int N = g_tiny ? i + 1 : Ns[i], V = g_tiny ? 5000 : 163840;
        float *lg = dalloc((size_t)N * V * 4);
        uint64_t *rng = dalloc((size_t)N * 32);
        int32_t *tok = dalloc((size_t)N * 4);
        fill(lg, KERN_F32, (size_t)N * V, -10, 10, 61);
        fill(rng, KERN_F32, (size_t)N * 8, 0, 1, 62); /* any bits */
        kern_cuda_sample_args a = {.N = N, .V = V, .logits = lg,
                                   .params = {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f,
                                              .min_p = 0.05f, .repeat_penalty = 1.0f},
                                   .rng = rng, .tokens = tok};
        printf("| sampling (T 0.8, top-k 40, top-p 0.95, min-p 0.05) | %d rows x %d | %.2f |\n", N,
               V, time_us(run_sample, &a, reps));
        a.params.temperature = 0.0f;
        printf("| greedy | %d rows x %d | %.2f |\n", N, V, time_us(run_sample, &a, reps));
        CK(cudaFree(lg));
        CK(cudaFree(rng));
        CK(cudaFree(tok));
    }
    printf("\n");
}

/* ---- matrix products (--gemm) -------------------------------------------------- */

typedef struct gemm_run {
    kern_cuda_matmul_args a;
    char *w0;          /* copies of the weights, rotated so they come from HBM */
    size_t w_bytes;
    int copies, next;
    kern_cuda_moe_experts_args m;
} gemm_run;

static void run_matmul(void *ctx) {
    gemm_run *g = (gemm_run *)ctx;
    g->a.W = g->w0 + (size_t)(g->next++ % g->copies) * g->w_bytes;
    KS(kern_cuda_matmul(&g->a, NULL, ERR));
}
static void run_experts(void *ctx) {
    KS(kern_cuda_moe_experts(&((gemm_run *)ctx)->m, NULL, ERR));
}

static void bench_mxfp4_experts(int quick);

/* GB/s of weights + activations and TFLOP/s (2 per multiply-add) of
 * kern_cuda_matmul at Kimi-48B's projections and of the grouped experts
 * (top-8 of 256, random routing), in both precision modes where it matters. */
static void bench_gemm(int quick) {
    const int reps = g_tiny ? 1 : quick ? 5 : 15;
    kern_cuda_gemm_ctx *ctx = NULL;
    const size_t max_elems = g_tiny ? 64 * 128 : (size_t)4096 * 4096;
    KS(kern_cuda_gemm_ctx_create(max_elems, &ctx, ERR));
    printf("### Matrix products (kern_cuda_matmul: bf16 weights, fp32 activations; GEMV for T <= %d, "
           "cuBLAS above)\n\n",
           KERN_CUDA_GEMV_MAX_T);
    printf("| product | rows x cols | T | path | µs (median) | GB/s (weights + x + y) | TFLOP/s |\n");
    printf("|---|---|---|---|---|---|---|\n");
    struct { const char *name; int rows, cols; } P[] = {
        {"q_proj", 4096, 2304}, {"o_proj", 2304, 4096}, {"lm_head", 163840, 2304}};
    const int Ts[] = {1, 8, 64, 4096}, Ttiny[] = {1, 8, 64, 64};
    const int nT = g_tiny ? 3 : 4;
    const size_t xmax = g_tiny ? 64 * 128 : (size_t)4096 * 4096;
    float *x = dalloc(xmax * 4), *y = dalloc(g_tiny ? 64 * 256 * 4 : (size_t)64 * 163840 * 4 > xmax * 4 ? (size_t)64 * 163840 * 4 : xmax * 4);
    fill(x, KERN_F32, xmax, -1, 1, 71);
    for (int pi = 0; pi < 3; pi++) {
        const int rows = g_tiny ? (pi == 2 ? 256 : 64 + 32 * pi) : P[pi].rows;
        const int cols = g_tiny ? (pi == 1 ? 128 : 64) : P[pi].cols;
        const size_t wb = (size_t)rows * cols * 2;
        int copies = (int)(((size_t)256 << 20) / wb) + 1;
        if (copies < 2 || g_tiny) copies = 2;
        gemm_run g = {.w0 = dalloc(wb * copies), .w_bytes = wb, .copies = copies};
        fill(g.w0, KERN_BF16, wb / 2 * copies, -1, 1, 72 + pi);
        for (int ti = 0; ti < nT; ti++) {
            const int T = g_tiny ? Ttiny[ti] : Ts[ti];
            if (pi == 2 && T > 64) continue; /* logits are needed for the last rows only */
            for (int mode = 0; mode < 2; mode++) {
                if (T <= KERN_CUDA_GEMV_MAX_T && mode) continue; /* the GEMV has no mode */
                g.a = (kern_cuda_matmul_args){.w_dtype = KERN_BF16, .rows = rows, .cols = cols, .x = x,
                                              .ldx = cols, .T = T, .y = y, .ldy = rows, .gemm = ctx,
                                              .mode = mode};
                const double us = time_us(run_matmul, &g, reps);
                const double bytes = (double)wb + (double)T * cols * 4 + (double)T * rows * 4;
                const double flop = 2.0 * T * rows * cols;
                printf("| %s | %d x %d | %d | %s | %.2f | %.0f | %.2f |\n", g_tiny ? "tiny" : P[pi].name, rows,
                       cols, T, T <= KERN_CUDA_GEMV_MAX_T ? "GEMV" : mode ? "cuBLAS BF16" : "cuBLAS EXACT", us,
                       bytes / (us * 1e-6) / 1e9, flop / (us * 1e-6) / 1e12);
                fflush(stdout);
            }
            /* the T = 1 GEMV's other geometries (same bytes out; the
             * default is kern_cuda_gemv_variant_name(0)) */
            for (int v = 1; T == 1 && v <= KERN_CUDA_GEMV_VARIANTS; v++) {
                g.a.gemv_variant = v;
                const double us = time_us(run_matmul, &g, reps);
                const double bytes = (double)wb + (double)cols * 4 + (double)rows * 4;
                printf("| %s | %d x %d | 1 | GEMV v%d (%s) | %.2f | %.0f | %.2f |\n", g_tiny ? "tiny" : P[pi].name,
                       rows, cols, v, kern_cuda_gemv_variant_name(v), us, bytes / (us * 1e-6) / 1e9,
                       2.0 * rows * cols / (us * 1e-6) / 1e12);
                fflush(stdout);
            }
            g.a.gemv_variant = 0;
        }
        CK(cudaFree(g.w0));
    }
    CK(cudaFree(x));
    CK(cudaFree(y));

    /* grouped experts: w1/w3 fused (silu(x W1^T) * x W3^T) and w2, experts
     * stacked [E][w1 | w3 | w2] as the engine stores them */
    const int E = g_tiny ? 8 : 256, k = g_tiny ? 2 : 8, inner = g_tiny ? 32 : 1024, hid = g_tiny ? 64 : 2304;
    const int Te[] = {1, 64, 4096}, Tetiny[] = {1, 4, 32};
    const size_t mat = (size_t)inner * hid * 2, stride = 3 * mat;
    char *wexp = dalloc(stride * E);
    fill(wexp, KERN_BF16, stride / 2 * E, -1, 1, 81);
    const int Tmax = g_tiny ? 32 : 4096;
    float *lg = dalloc((size_t)Tmax * E * 4), *selw = dalloc((size_t)Tmax * k * 4);
    int32_t *sel = dalloc((size_t)Tmax * k * 4), *row = dalloc((size_t)Tmax * k * 4);
    int32_t *tok = dalloc((size_t)Tmax * k * 4), *off = dalloc((size_t)(E + 1) * 4);
    float *xg = dalloc((size_t)Tmax * k * hid * 4), *hb = dalloc((size_t)Tmax * k * inner * 4);
    float *yg = dalloc((size_t)Tmax * k * hid * 4);
    fill(lg, KERN_F32, (size_t)Tmax * E, -4, 4, 82);
    fill(xg, KERN_F32, (size_t)Tmax * k * hid, -1, 1, 83);
    int32_t *h_off = malloc((size_t)(E + 1) * 4);
    printf("\n### Grouped experts (kern_cuda_moe_experts: top-%d of %d, random routing, bf16 experts "
           "[%d x %d], stacked)\n\n", k, E, inner, hid);
    printf("| T | rows (T*k) | active experts | product | path | µs (median) | GB/s (active weights) | "
           "TFLOP/s |\n|---|---|---|---|---|---|---|---|\n");
    for (int ti = 0; ti < 3; ti++) {
        const int T = g_tiny ? Tetiny[ti] : Te[ti], n = T * k;
        kern_cuda_moe_route_args ra = {
            .p = {.n_experts = E, .top_k = k, .n_group = 1, .topk_group = 1, .renormalize = 1,
                  .routed_scaling_factor = 1.0f},
            .T = T, .logits = lg, .apply_sigmoid = true, .sel = sel, .w = selw, .exp_off = off,
            .row_of = row, .tok_of = tok};
        KS(kern_cuda_moe_route(&ra, NULL, ERR));
        CK(cudaMemcpy(h_off, off, (size_t)(E + 1) * 4, cudaMemcpyDeviceToHost));
        int active = 0;
        for (int e = 0; e < E; e++) active += h_off[e + 1] > h_off[e];
        const int tc = n > 2 * E; /* what KERN_CUDA_MOE_AUTO picks */
        for (int mode = 0; mode < 2; mode++) {
            if (!tc && mode) continue;
            for (int prod = 0; prod < 2; prod++) {
                gemm_run g = {.m = {.E = E, .w_dtype = KERN_BF16, .w_stride = stride, .exp_off = off, .n_rows = n,
                                    .mode = mode, .algo = KERN_CUDA_MOE_AUTO}};
                if (prod == 0) { /* w1 | w3 fused: [inner, hid] each */
                    g.m.rows = inner, g.m.cols = hid, g.m.W_base = wexp, g.m.W3_base = wexp + mat;
                    g.m.x = xg, g.m.ldx = hid, g.m.y = hb, g.m.ldy = inner;
                } else { /* w2: [hid, inner] */
                    g.m.rows = hid, g.m.cols = inner, g.m.W_base = wexp + 2 * mat;
                    g.m.x = hb, g.m.ldx = inner, g.m.y = yg, g.m.ldy = hid;
                }
                const double us = time_us(run_experts, &g, reps);
                const double wbytes = (double)active * mat * (prod == 0 ? 2 : 1);
                const double flop = 2.0 * n * (double)inner * hid * (prod == 0 ? 2 : 1);
                printf("| %d | %d | %d | %s | %s | %.2f | %.0f | %.2f |\n", T, n, active,
                       prod == 0 ? "w1+w3 fused (SwiGLU)" : "w2", tc ? (mode ? "tensor BF16" : "tensor EXACT") : "GEMV",
                       us, wbytes / (us * 1e-6) / 1e9, flop / (us * 1e-6) / 1e12);
                fflush(stdout);
            }
        }
    }
    printf("\nTargets: GEMV and grouped GEMV at T = 1 near 4.3 TB/s (weights streamed once); T = 4096 on "
           "tensor cores (EXACT does two bf16 products).\n\n");
    free(h_off);
    void *f[] = {wexp, lg, selw, sel, row, tok, off, xg, hb, yg};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) CK(cudaFree(f[i]));
    kern_cuda_gemm_ctx_free(ctx);
    bench_mxfp4_experts(quick);
}

/* Kimi K3's routed experts: MXFP4 codes [E][w1 | w3 | w2] and their
 * E8M0 scales [E][s1 | s3 | s2] stacked, top-16 of 896 by random routing,
 * the gate/up product fused with SiTU. All 896 experts are resident
 * (15.7 GB), so the active ones come from HBM as in serving. GB/s counts
 * the active experts' codes + scales once per call. */
static void bench_mxfp4_experts(int quick) {
    const int reps = g_tiny ? 1 : quick ? 5 : 15;
    const int E = g_tiny ? 8 : 896, k = g_tiny ? 2 : 16;
    const int inner = g_tiny ? 64 : 3072, hid = g_tiny ? 96 : 3584; /* moe_intermediate, latent */
    const int Te[] = {1, 8, 64, 4096}, Tetiny[] = {1, 4, 8, 32};
    const size_t mat = (size_t)inner * (hid / 2), mat2 = (size_t)hid * (inner / 2); /* code bytes */
    const size_t sc = (size_t)inner * (hid / 32), sc2 = (size_t)hid * (inner / 32);  /* scale bytes */
    const size_t stride = 2 * mat + mat2, sstride = 2 * sc + sc2;
    char *codes = dalloc(stride * E), *scales = dalloc(sstride * E);
    fill(codes, KERN_BF16, stride / 2 * E, -1, 1, 91); /* any bytes are valid E2M1 codes */
    CK(cudaMemset(scales, 127, sstride * E));         /* 2^0: finite products */
    const int Tmax = g_tiny ? 32 : 4096;
    float *lg = dalloc((size_t)Tmax * E * 4), *selw = dalloc((size_t)Tmax * k * 4);
    int32_t *sel = dalloc((size_t)Tmax * k * 4), *row = dalloc((size_t)Tmax * k * 4);
    int32_t *tok = dalloc((size_t)Tmax * k * 4), *off = dalloc((size_t)(E + 1) * 4);
    float *xg = dalloc((size_t)Tmax * k * hid * 4), *hb = dalloc((size_t)Tmax * k * inner * 4);
    float *yg = dalloc((size_t)Tmax * k * hid * 4);
    fill(lg, KERN_F32, (size_t)Tmax * E, -4, 4, 92);
    fill(xg, KERN_F32, (size_t)Tmax * k * hid, -1, 1, 93);
    int32_t *h_off = malloc((size_t)(E + 1) * 4);
    printf("### Kimi K3 routed experts (kern_cuda_moe_experts: MXFP4, top-%d of %d, random routing, "
           "w1 | w3 [%d x %d] + SiTU, w2 [%d x %d], stacked)\n\n",
           k, E, inner, hid, hid, inner);
    printf("| T | rows (T*k) | active experts | product | path | µs (median) | GB/s (active codes + "
           "scales) | TFLOP/s |\n|---|---|---|---|---|---|---|---|\n");
    for (int ti = 0; ti < 4; ti++) {
        const int T = g_tiny ? Tetiny[ti] : Te[ti], n = T * k;
        kern_cuda_moe_route_args ra = {
            .p = {.n_experts = E, .top_k = k, .n_group = 1, .topk_group = 1, .renormalize = 1,
                  .routed_scaling_factor = 1.0f},
            .T = T, .logits = lg, .apply_sigmoid = true, .sel = sel, .w = selw, .exp_off = off,
            .row_of = row, .tok_of = tok};
        KS(kern_cuda_moe_route(&ra, NULL, ERR));
        CK(cudaMemcpy(h_off, off, (size_t)(E + 1) * 4, cudaMemcpyDeviceToHost));
        int active = 0;
        for (int e = 0; e < E; e++) active += h_off[e + 1] > h_off[e];
        const int tc = n > 2 * E; /* what KERN_CUDA_MOE_AUTO picks */
        for (int mode = 0; mode < 2; mode++) {
            if (!tc && mode) continue;
            for (int prod = 0; prod < 2; prod++) {
                gemm_run g = {.m = {.E = E, .w_dtype = KERN_MXFP4, .w_stride = stride,
                                    .exp_off = off, .n_rows = n, .mode = mode,
                                    .algo = KERN_CUDA_MOE_AUTO, .s_stride = sstride}};
                if (prod == 0) { /* w1 | w3 fused with SiTU: [inner, hid] each */
                    g.m.rows = inner, g.m.cols = hid;
                    g.m.W_base = codes, g.m.W3_base = codes + mat;
                    g.m.S_base = scales, g.m.S3_base = scales + sc;
                    g.m.act = KERN_CUDA_MOE_SITU, g.m.situ_beta = 4.0f, g.m.situ_beta_l = 25.0f;
                    g.m.x = xg, g.m.ldx = hid, g.m.y = hb, g.m.ldy = inner;
                } else { /* w2: [hid, inner] */
                    g.m.rows = hid, g.m.cols = inner;
                    g.m.W_base = codes + 2 * mat, g.m.S_base = scales + 2 * sc;
                    g.m.x = hb, g.m.ldx = inner, g.m.y = yg, g.m.ldy = hid;
                }
                const double us = time_us(run_experts, &g, reps);
                const double wbytes = (double)active * (prod == 0 ? 2.0 * (mat + sc) : (double)(mat2 + sc2));
                const double flop = 2.0 * n * (double)inner * hid * (prod == 0 ? 2 : 1);
                printf("| %d | %d | %d | %s | %s | %.2f | %.0f | %.2f |\n", T, n, active,
                       prod == 0 ? "w1+w3 fused (SiTU)" : "w2",
                       tc ? (mode ? "tensor BF16" : "tensor EXACT") : "GEMV", us,
                       wbytes / (us * 1e-6) / 1e9, flop / (us * 1e-6) / 1e12);
                fflush(stdout);
            }
        }
    }
    printf("\nTargets: the MXFP4 GEMV at T = 1 near 4.3 TB/s of codes + scales (~0.53 bytes per "
           "weight: 16 experts are 280 MB, ~65 µs per layer); it decodes each code once for all "
           "the chunk's rows, so it turns issue-bound as rows per expert grow (README).\n\n");
    free(h_off);
    void *f[] = {codes, scales, lg, selw, sel, row, tok, off, xg, hb, yg};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) CK(cudaFree(f[i]));
}

/* --once T: one run of each kernel of interest, for ncu. */
static void run_once(int T) {
    const int H = 32, K = 128, V = 128, B = 256;
    const kern_kda_shape sh = {H, H, K, V, 1.0f / sqrtf((float)K)};
    const size_t Tz = (size_t)(T > B ? T : B); /* the decode reads B rows of the inputs */
    void *q = dalloc(Tz * H * K * 2), *k = dalloc(Tz * H * K * 2), *v = dalloc(Tz * H * V * 2);
    void *g = dalloc(Tz * H * K * 2), *beta = dalloc(Tz * H * 2);
    float *A_log = dalloc(H * 4), *dt_bias = dalloc((size_t)H * K * 4);
    float *o = dalloc(Tz * H * V * 4), *state = dalloc((size_t)B * H * K * V * 4);
    fill(q, KERN_BF16, Tz * H * K, -1, 1, 31);
    fill(k, KERN_BF16, Tz * H * K, -1, 1, 32);
    fill(v, KERN_BF16, Tz * H * V, -1, 1, 33);
    fill(g, KERN_BF16, Tz * H * K, -4, 4, 34);
    fill(beta, KERN_BF16, Tz * H, -3, 3, 35);
    fill(A_log, KERN_F32, H, -1, 1.5f, 36);
    fill(dt_bias, KERN_F32, (size_t)H * K, -1, 1, 37);
    fill(state, KERN_F32, (size_t)B * H * K * V, -1, 1, 38);
    void *ws = dalloc(kern_cuda_kda_prefill_workspace_bytes(&sh, 64));
    for (int tc = 0; tc < 2; tc++) {
        kern_cuda_kda_prefill_args a = {
            .shape = sh, .T = T, .in_dtype = KERN_BF16, .raw = true, .q = q, .k = k, .v = v,
            .g = g, .beta = beta, .A_log = A_log, .dt_bias = dt_bias, .lower_bound = 0.0f,
            .state = state, .o = o, .workspace = ws,
            .workspace_bytes = kern_cuda_kda_prefill_workspace_bytes(&sh, 64), .tensor_cores = tc};
        KS(kern_cuda_kda_prefill(&a, NULL, ERR));
    }
    int32_t *slots_h = malloc(B * sizeof(int32_t));
    for (int i = 0; i < B; i++) slots_h[i] = i;
    int32_t *slots = dalloc(B * sizeof(int32_t));
    CK(cudaMemcpy(slots, slots_h, B * sizeof(int32_t), cudaMemcpyHostToDevice));
    free(slots_h);
    kern_cuda_kda_decode_args d = {
        .shape = sh, .N = B, .in_dtype = KERN_BF16, .q = q, .k = k, .v = v, .g_raw = g,
        .beta_raw = beta, .A_log = A_log, .dt_bias = dt_bias, .lower_bound = 0.0f,
        .state_pool = state, .pool_slots = B, .slots = slots, .o = o};
    KS(kern_cuda_kda_decode(&d, NULL, ERR));
    CK(cudaDeviceSynchronize());
    printf("--once %d: one fp32 prefill, one tensor-core prefill, one decode step at B = %d\n", T, B);
    void *f[] = {q, k, v, g, beta, A_log, dt_bias, o, state, ws, slots};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) CK(cudaFree(f[i]));
}

int main(int argc, char **argv) {
    int quick = 0, only_decode = 0, only_prefill = 0, only_gemm = 0, once = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (!strcmp(argv[i], "--decode"))
            only_decode = 1;
        else if (!strcmp(argv[i], "--prefill"))
            only_prefill = 1;
        else if (!strcmp(argv[i], "--gemm"))
            only_gemm = 1;
        else if (!strcmp(argv[i], "--tiny"))
            g_tiny = 1;
        else if (!strcmp(argv[i], "--once") && i + 1 < argc && atoi(argv[i + 1]) > 0)
            once = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--quick] [--decode | --prefill | --gemm] [--tiny] [--once T]\n",
                    argv[0]);
            return 2;
        }
    }
    kds_err err;
    memset(&err, 0, sizeof err);
    if (!kern_cuda_available(&err)) {
        fprintf(stderr, "kds_cuda_bench: no usable CUDA device: %s\n", err.msg);
        return 3;
    }
    struct cudaDeviceProp prop;
    int dev = 0, rt = 0, drv = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaGetDeviceProperties(&prop, dev));
    CK(cudaRuntimeGetVersion(&rt));
    CK(cudaDriverGetVersion(&drv));
    printf("## kds_cuda_bench%s: %s, %d SMs, sm_%d%d, %.0f GiB, CUDA runtime %d, driver %d\n\n",
           quick ? " --quick" : "", prop.name, prop.multiProcessorCount, prop.major, prop.minor,
           prop.totalGlobalMem / 1073741824.0, rt, drv);
    if (once) {
        run_once(once);
        return 0;
    }
    if (g_tiny) g_busy_floats = 1 << 12;
    g_busy = dalloc(g_busy_floats * 4);
    bench_copy();
    if (!only_prefill && !only_gemm) bench_decode(quick);
    if (!only_decode && !only_gemm) bench_prefill(quick);
    if (!only_decode && !only_prefill && !only_gemm) bench_small(quick);
    if (!only_decode && !only_prefill) bench_gemm(quick);
    CK(cudaFree(g_busy));
    return 0;
}
