/*
 * sample.c - CPU reference of token sampling (kern_sample in kern.h): the
 * engine's eng_sample (engine/eng_forward.c) on an explicit logits row and
 * RNG state, so that the CUDA sampler (kernels/cuda/kern_cuda_sample.cu)
 * has a reference with the same contract. tests/test_sample_ref.c checks
 * that this and eng_sample draw the same tokens from the same stream.
 */
#include "kern.h"

#include <math.h>
#include <string.h>

static uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

uint64_t kern_rng_next(uint64_t s[4]) {
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

/* Order candidates by descending logit, ties by ascending id: a min-heap on
 * (p, -id) whose root is the worst kept candidate. */
static void sift_down(float *p, int32_t *id, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && (p[l] < p[m] || (p[l] == p[m] && id[l] > id[m]))) m = l;
        if (r < n && (p[r] < p[m] || (p[r] == p[m] && id[r] > id[m]))) m = r;
        if (m == i) return;
        float tp = p[i];
        p[i] = p[m];
        p[m] = tp;
        int32_t ti = id[i];
        id[i] = id[m];
        id[m] = ti;
        i = m;
    }
}

int32_t kern_sample(const float *logits, int V, const kern_sample_params *sp,
                    const int32_t *penalty_ids, int n_penalty, uint64_t rng[4], float *lp,
                    int32_t *ids) {
    memcpy(lp, logits, (size_t)V * sizeof(float));
    if (sp->repeat_penalty > 0.0f && sp->repeat_penalty != 1.0f) {
        for (int i = 0; i < n_penalty; i++) {
            int32_t id = penalty_ids[i];
            if (id < 0 || id >= V) continue;
            /* penalise each distinct token once */
            int seen = 0;
            for (int j = 0; j < i; j++) seen |= penalty_ids[j] == id;
            if (!seen)
                lp[id] = lp[id] > 0 ? lp[id] / sp->repeat_penalty : lp[id] * sp->repeat_penalty;
        }
    }
    if (sp->temperature <= 0.0f) {
        int best = 0;
        for (int i = 1; i < V; i++)
            if (lp[i] > lp[best]) best = i;
        return best;
    }
    /* Keep the best k candidates with a bounded min-heap (k = V when off). */
    int k = sp->top_k > 0 && sp->top_k < V ? sp->top_k : V;
    int n = 0;
    for (int i = 0; i < V; i++) {
        float v = lp[i] / sp->temperature;
        if (n < k) {
            lp[n] = v; /* safe: n <= i, and lp[i] was read first */
            ids[n] = i;
            n++;
            if (n == k)
                for (int j = k / 2 - 1; j >= 0; j--) sift_down(lp, ids, k, j);
        } else if (v > lp[0]) {
            lp[0] = v;
            ids[0] = i;
            sift_down(lp, ids, k, 0);
        }
    }
    if (n < k) {
        k = n;
        for (int j = k / 2 - 1; j >= 0; j--) sift_down(lp, ids, k, j);
    }
    /* Heap-sort ascending-worst to the end: afterwards lp[0] is the best. */
    for (int end = k - 1; end > 0; end--) {
        float tp = lp[0];
        lp[0] = lp[end];
        lp[end] = tp;
        int32_t ti = ids[0];
        ids[0] = ids[end];
        ids[end] = ti;
        sift_down(lp, ids, end, 0);
    }
    /* softmax over the sorted candidates */
    const float mx = lp[0];
    double sum = 0.0;
    for (int i = 0; i < k; i++) {
        lp[i] = expf(lp[i] - mx);
        sum += lp[i];
    }
    int keep = k;
    if (sp->min_p > 0.0f) {
        float floor_p = sp->min_p * lp[0];
        while (keep > 1 && lp[keep - 1] < floor_p) keep--;
    }
    if (sp->top_p < 1.0f) {
        double kept_sum = 0.0;
        for (int i = 0; i < keep; i++) kept_sum += lp[i];
        double acc = 0.0;
        for (int i = 0; i < keep; i++) {
            acc += lp[i];
            if (acc >= sp->top_p * kept_sum) {
                keep = i + 1;
                break;
            }
        }
    }
    sum = 0.0;
    for (int i = 0; i < keep; i++) sum += lp[i];
    double u = (double)(kern_rng_next(rng) >> 11) * 0x1.0p-53 * sum, acc = 0.0;
    int pick = keep - 1;
    for (int i = 0; i < keep; i++) {
        acc += lp[i];
        if (u < acc) {
            pick = i;
            break;
        }
    }
    return ids[pick];
}
