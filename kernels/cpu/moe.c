/*
 * moe.c - CPU reference of the MoE routing and token permutation (kern.h):
 * the expert choice of the engine's route_token and the stable counting sort
 * of its moe_ffn gather, as plain functions over caller-owned arrays, so that
 * the CUDA kernels (kernels/cuda/kern_cuda_moe.cu) have a reference with the
 * same contract.
 */
#include "kern.h"

#include <math.h>
#include <string.h>

/* One token: the engine's route_token, line for line. */
static void route_one(const kern_moe_route_params *p, const float *s, const float *bias,
                      int32_t *sel, float *selw) {
    const int E = p->n_experts, k = p->top_k;
    const int G = p->n_group > 1 ? p->n_group : 1;
    const int per_group = E / G;
    uint64_t group_ok[4] = {0}; /* up to 256 groups */
    if (G > 1) {
        /* group score = sum of its two best biased scores; keep topk_group groups */
        float gscore[256];
        for (int g = 0; g < G && g < 256; g++) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int e = g * per_group; e < (g + 1) * per_group; e++) {
                float v = s[e] + (bias ? bias[e] : 0.0f);
                if (v > b1) {
                    b2 = b1;
                    b1 = v;
                } else if (v > b2) {
                    b2 = v;
                }
            }
            gscore[g] = b1 + (per_group > 1 ? b2 : 0.0f);
        }
        for (int n = 0; n < p->topk_group && n < G; n++) {
            int best = -1;
            for (int g = 0; g < G && g < 256; g++)
                if (!(group_ok[g / 64] >> (g % 64) & 1) && (best < 0 || gscore[g] > gscore[best]))
                    best = g;
            if (best >= 0) group_ok[best / 64] |= 1ull << (best % 64);
        }
    }
    for (int n = 0; n < k; n++) {
        int best = -1;
        float bv = -INFINITY;
        for (int e = 0; e < E; e++) {
            int g = e / per_group;
            if (G > 1 && !(group_ok[g / 64] >> (g % 64) & 1)) continue;
            int taken = 0;
            for (int m = 0; m < n; m++) taken |= sel[m] == e;
            if (taken) continue;
            float v = s[e] + (bias ? bias[e] : 0.0f);
            if (best < 0 || v > bv) {
                best = e;
                bv = v;
            }
        }
        sel[n] = best;
    }
    double sum = 0.0;
    for (int n = 0; n < k; n++) sum += s[sel[n]];
    for (int n = 0; n < k; n++) {
        float wgt = s[sel[n]];
        if (p->renormalize && sum > 0.0) wgt = (float)(wgt / sum);
        selw[n] = wgt * p->routed_scaling_factor;
    }
}

void kern_moe_route(const kern_moe_route_params *p, int T, const float *scores, const float *bias,
                    int32_t *sel, float *w) {
    for (int t = 0; t < T; t++)
        route_one(p, scores + (size_t)t * p->n_experts, bias, sel + (size_t)t * p->top_k,
                  w + (size_t)t * p->top_k);
}

void kern_moe_permute(int E, int T, int k, const int32_t *sel, int32_t *exp_off, int32_t *row_of,
                      int32_t *tok_of) {
    memset(exp_off, 0, (size_t)(E + 1) * sizeof *exp_off);
    for (size_t i = 0; i < (size_t)T * k; i++) exp_off[sel[i] + 1]++;
    for (int e = 0; e < E; e++) exp_off[e + 1] += exp_off[e];
    /* Shift right by one: exp_off[e + 1] = start of expert e, used as e's
     * fill pointer while the pairs are walked in (t, slot) order; once all
     * are placed it has advanced to the start of e + 1, the final layout. */
    for (int e = E; e > 0; e--) exp_off[e] = exp_off[e - 1];
    exp_off[0] = 0;
    for (int t = 0; t < T; t++)
        for (int n = 0; n < k; n++) {
            int32_t row = exp_off[sel[(size_t)t * k + n] + 1]++;
            row_of[(size_t)t * k + n] = row;
            tok_of[row] = t;
        }
}
