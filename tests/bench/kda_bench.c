/*
 * kda_bench.c - timing of the CPU KDA core at Kimi-Linear's shape
 * (H = HV = 32, K = V = 128), single thread. Not part of the CMake build
 * (the test glob takes only the .c files directly in tests/); build and run
 * by hand from the repo root:
 *
 *   gcc -O3 -march=native -std=c11 -D_POSIX_C_SOURCE=200809L -I kernels \
 *       kernels/cpu/kda.c kernels/cpu/ops.c kernels/cpu/gemm.c kernels/cpu/quant.c \
 *       tests/bench/kda_bench.c $(pkg-config --cflags --libs openblas) \
 *       -lm -lpthread -o /tmp/kda_bench && OPENBLAS_NUM_THREADS=1 /tmp/kda_bench [T] [chunk]
 *
 * Prints the decode step (one token, all 32 heads, state 2 MiB) in
 * microseconds, and the prefill throughput in tokens per second of the
 * chunked path and, for comparison, of the recurrent path over the same
 * tokens (both called once per value head, as the engine's pool does).
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kern.h"
#include "kds_clock.h"

static unsigned long long rng = 88172645463325252ull;
static float frand(float lo, float hi) { /* xorshift64 */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return lo + (hi - lo) * (float)((rng >> 40) * (1.0 / 16777216.0));
}

static float *alloc_fill(size_t n, float lo, float hi) {
    float *p = malloc(n * sizeof *p);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < n; i++)
        p[i] = frand(lo, hi);
    return p;
}

int main(int argc, char **argv) {
    const int H = 32, K = 128, V = 128;
    int T = argc > 1 ? atoi(argv[1]) : 4096;
    int chunk = argc > 2 ? atoi(argv[2]) : 64;
    kern_kda_shape sh = {H, H, K, V, 0.08838834764831845f};
    size_t nqk = (size_t)T * H * K, nv = (size_t)T * H * V, ns = (size_t)H * K * V;
    float *q = alloc_fill(nqk, -1, 1), *k = alloc_fill(nqk, -1, 1);
    kern_l2norm(q, T * H, K, 1e-6f);
    kern_l2norm(k, T * H, K, 1e-6f);
    float *v = alloc_fill(nv, -1, 1), *g = alloc_fill(nqk, -3, 3);
    float *beta = alloc_fill((size_t)T * H, 0, 1), *o = alloc_fill(nv, 0, 0); /* touched */
    float *A_log = alloc_fill(H, -1, 2.5f), *dt_bias = alloc_fill((size_t)H * K, -1, 1);
    kern_kda_gate(g, A_log, dt_bias, T, H, K, 0.0f, g);
    float *state = alloc_fill(ns, -0.1f, 0.1f);
    float *ws = malloc(kern_kda_chunked_workspace_floats(&sh, chunk) * sizeof *ws);

    /* decode: one token, all heads; best of 7 runs of 300 steps (the VM's
     * timing is noisy; the state, 2 MiB, lives in L2/L3 between steps) */
    double dec = 1e30;
    kern_kda_recurrent(&sh, 1, q, k, v, g, beta, state, o, 0, H);
    for (int trial = 0; trial < 7; trial++) {
        int steps = 300;
        double t0 = kds_now_s();
        for (int i = 0; i < steps; i++) {
            size_t t = (size_t)(i % T);
            kern_kda_recurrent(&sh, 1, q + t * H * K, k + t * H * K, v + t * H * V, g + t * H * K,
                               beta + t * H, state, o, 0, H);
        }
        double dt = (kds_now_s() - t0) / steps;
        if (dt < dec) dec = dt;
    }

    /* prefill, as the engine's thread pool calls it: one call per value
     * head over the whole sequence (best of 3), chunked and recurrent */
    kern_kda_chunked(&sh, T < 256 ? T : 256, chunk, q, k, v, g, beta, state, o, 0, H, ws);
    double best = 1e30, best1 = 1e30, rec = 1e30;
    for (int r = 0; r < 3; r++) {
        double t0 = kds_now_s();
        for (int hv = 0; hv < H; hv++)
            kern_kda_chunked(&sh, T, chunk, q, k, v, g, beta, state, o, hv, hv + 1, ws);
        double dt = kds_now_s() - t0;
        if (dt < best) best = dt;
        t0 = kds_now_s();
        kern_kda_chunked(&sh, T, chunk, q, k, v, g, beta, state, o, 0, H, ws);
        dt = kds_now_s() - t0;
        if (dt < best1) best1 = dt;
        t0 = kds_now_s();
        for (int hv = 0; hv < H; hv++)
            kern_kda_recurrent(&sh, T, q, k, v, g, beta, state, o, hv, hv + 1);
        dt = kds_now_s() - t0;
        if (dt < rec) rec = dt;
    }

    printf("decode step  H=%d K=V=%d: %.1f us/token\n", H, K, dec * 1e6);
    printf("chunked      H=%d K=V=%d T=%d C=%d: %.3f s, %.0f tokens/s (per-head calls)\n", H, K, T,
           chunk, best, T / best);
    printf("chunked      H=%d K=V=%d T=%d C=%d: %.3f s, %.0f tokens/s (one call, all heads)\n", H,
           K, T, chunk, best1, T / best1);
    printf("recurrent    H=%d K=V=%d T=%d: %.3f s, %.0f tokens/s\n", H, K, T, rec, T / rec);
    printf("(check %g)\n", (double)o[0] + state[7]);
    return 0;
}
