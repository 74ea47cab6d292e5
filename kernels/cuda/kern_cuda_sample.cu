/*
 * kern_cuda_sample.cu - token sampling on the GPU (kern_cuda_sample in
 * kern_cuda.h), kern_sample's algorithm (kernels/cpu/sample.c, itself the
 * engine's eng_sample) with one CTA of 1024 threads per row:
 *
 *   penalty   threads 0..n_penalty-1: each distinct id is rewritten once
 *   greedy    block arg-max (ties to the lower id); no RNG step
 *   top-k     radix select on the order-preserving bits of v = logit / T
 *             (4 passes of 8 bits, shared histograms) gives the k-th largest
 *             key; keys above it are taken, and of the keys equal to it the
 *             lowest ids (contiguous slices per thread + a block scan), so
 *             the kept set is the CPU heap's: top k under (v desc, id asc)
 *   sort      bitonic sort of the <= 1024 candidates on (key, ~id)
 *   softmax   p_i = (float)exp((double)(v_i - v_0)) in parallel, then thread
 *             0 runs the CPU's sequential double sums (min-p, top-p, the
 *             draw) in the same order, with the row's xoshiro256** step.
 * Cost per row: 5 passes over the V logits (4 histograms + the collection)
 * from L2/HBM by one SM; for V = 163,840 that is ~3 MB of loads, a few tens
 * of microseconds at one SM's bandwidth. Rows run in parallel.
 */
#include <stdint.h>

#include "kern_cuda_dev.cuh"
#include "kern_cuda_impl.cuh"

namespace {

constexpr int kThreads = 1024;
constexpr int kMaxK = KERN_CUDA_SAMPLE_MAX_K;
static_assert(kMaxK <= kThreads, "one candidate per thread in the sort");

struct sample_params {
    float *logits;
    int V, n_penalty;
    kern_sample_params sp;
    const kern_sample_params *row_sp; /* [N] device, or NULL: sp for every row */
    const int32_t *pen;
    uint64_t *rng;
    int32_t *tokens;
};

/* Order-preserving key of a float (larger float -> larger key); -0 and +0
 * compare equal, as floats do. */
__device__ __forceinline__ uint32_t fkey(float v) {
    uint32_t u = __float_as_uint(v);
    if ((u & 0x7fffffffu) == 0) u = 0;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_to_float(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

__global__ void __launch_bounds__(kThreads) sample_kernel(const sample_params p) {
    /* this row's settings (one CTA per row) */
    const kern_sample_params sp = p.row_sp ? p.row_sp[blockIdx.x] : p.sp;
    __shared__ unsigned s_hist[256];
    __shared__ int s_scan[kThreads / 32 + 1];
    __shared__ unsigned long long s_cand[kMaxK];
    __shared__ float s_p[kMaxK];
    __shared__ uint32_t s_prefix, s_mask;
    __shared__ int s_remaining, s_count;
    __shared__ float s_bv[kThreads / 32];
    __shared__ int s_bi[kThreads / 32];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int row = blockIdx.x, V = p.V;
    float *lp = p.logits + (size_t)row * V;

    /* repetition penalty: the first occurrence of each id rewrites it */
    if (p.pen && sp.repeat_penalty > 0.0f && sp.repeat_penalty != 1.0f) {
        const int32_t *pen = p.pen + (size_t)row * p.n_penalty;
        for (int i = tid; i < p.n_penalty; i += kThreads) {
            const int32_t id = pen[i];
            if (id < 0 || id >= V) continue;
            bool seen = false;
            for (int j = 0; j < i; j++) seen |= pen[j] == id;
            if (!seen) {
                const float x = lp[id];
                lp[id] = x > 0 ? x / sp.repeat_penalty : x * sp.repeat_penalty;
            }
        }
        __syncthreads(); /* global writes of the block are visible after it */
    }

    if (sp.temperature <= 0.0f) {
        float bv = 0.0f;
        int bi = -1;
        for (int i = tid; i < V; i += kThreads) {
            const float v = lp[i];
            if (bi < 0 || v > bv) { /* i only grows: ties keep the lower id */
                bv = v;
                bi = i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float v = __shfl_xor_sync(0xffffffffu, bv, o);
            const int i = __shfl_xor_sync(0xffffffffu, bi, o);
            if (i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi))) {
                bv = v;
                bi = i;
            }
        }
        if (lane == 0) {
            s_bv[warp] = bv;
            s_bi[warp] = bi;
        }
        __syncthreads();
        if (tid == 0) {
            float b = s_bv[0];
            int id = s_bi[0];
            for (int w = 1; w < kThreads / 32; w++) {
                const int i = s_bi[w];
                if (i >= 0 && (id < 0 || s_bv[w] > b || (s_bv[w] == b && i < id))) {
                    b = s_bv[w];
                    id = i;
                }
            }
            p.tokens[row] = id < 0 ? 0 : id;
        }
        return;
    }

    const float temp = sp.temperature;
    const int k = sp.top_k > 0 && sp.top_k < V ? sp.top_k : V; /* <= kMaxK (host) */

    /* radix select: the k-th largest key, 8 bits at a time from the top */
    if (tid == 0) {
        s_prefix = 0;
        s_mask = 0;
        s_remaining = k;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += kThreads) s_hist[i] = 0;
        __syncthreads();
        /* every thread reads this round's state here, between two
         * barriers: the one lane's writes below come after the next one
         * (lanes of a warp are not ordered by shuffles; racecheck) */
        const uint32_t prefix = s_prefix, mask = s_mask;
        const unsigned rem = (unsigned)s_remaining;
        for (int i = tid; i < V; i += kThreads) {
            const uint32_t key = fkey(lp[i] / temp);
            if ((key & mask) == prefix) atomicAdd(&s_hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (warp == 0) {
            /* lane l owns digits 8l .. 8l+7; find the digit where the count
             * of keys above reaches `remaining` */
            unsigned c8 = 0;
            for (int d = 0; d < 8; d++) c8 += s_hist[lane * 8 + d];
            unsigned suf = c8; /* inclusive suffix sum: lanes >= lane */
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned y = __shfl_down_sync(0xffffffffu, suf, o);
                if (lane + o < 32) suf += y;
            }
            const unsigned above = suf - c8; /* keys in the digits above this lane's */
            if (above < rem && above + c8 >= rem) { /* exactly one lane */
                unsigned acc = above;
                int digit = lane * 8;
                for (int d = 7; d >= 0; d--) {
                    const unsigned h = s_hist[lane * 8 + d];
                    if (acc + h >= rem) {
                        digit = lane * 8 + d;
                        break;
                    }
                    acc += h;
                }
                s_prefix = prefix | ((uint32_t)digit << shift);
                s_mask = mask | (255u << shift);
                s_remaining = (int)(rem - acc);
            }
        }
        __syncthreads();
    }
    const uint32_t thr = s_prefix;
    const int need_eq = s_remaining; /* keys equal to thr to take, >= 1 */
    const int n_gt = k - need_eq;

    /* collect: every key above thr, then the lowest ids among the ties */
    if (tid == 0) s_count = 0;
    __syncthreads();
    for (int i = tid; i < V; i += kThreads) {
        const uint32_t key = fkey(lp[i] / temp);
        if (key > thr) {
            const int pos = atomicAdd(&s_count, 1);
            s_cand[pos] = ((unsigned long long)key << 32) | (uint32_t)~(uint32_t)i;
        }
    }
    const int slice = (V + kThreads - 1) / kThreads;
    const int i0 = tid * slice, i1 = i0 + slice < V ? i0 + slice : V;
    int ties = 0;
    for (int i = i0; i < i1; i++) ties += fkey(lp[i] / temp) == thr;
    int total = 0;
    int off = block_exclusive_scan<kThreads>(ties, s_scan, &total);
    for (int i = i0; i < i1 && off < need_eq; i++)
        if (fkey(lp[i] / temp) == thr) {
            s_cand[n_gt + off] = ((unsigned long long)thr << 32) | (uint32_t)~(uint32_t)i;
            off++;
        }
    int P = 1;
    while (P < k) P <<= 1;
    for (int i = k + tid; i < P; i += kThreads) s_cand[i] = 0ull; /* below every real entry */
    __syncthreads();

    /* bitonic sort, descending */
    for (int size = 2; size <= P; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            const int i = tid, j = i ^ stride;
            if (i < P && j > i) {
                const unsigned long long a = s_cand[i], b = s_cand[j];
                const bool desc = (i & size) == 0;
                if ((a < b) == desc) {
                    s_cand[i] = b;
                    s_cand[j] = a;
                }
            }
            __syncthreads();
        }
    }

    /* softmax numerators in sorted order */
    const float mx = key_to_float((uint32_t)(s_cand[0] >> 32));
    if (tid < k) {
        const float v = key_to_float((uint32_t)(s_cand[tid] >> 32));
        s_p[tid] = (float)exp((double)(v - mx));
    }
    __syncthreads();
    if (tid == 0) {
        int keep = k;
        if (sp.min_p > 0.0f) {
            const float floor_p = sp.min_p * s_p[0];
            while (keep > 1 && s_p[keep - 1] < floor_p) keep--;
        }
        if (sp.top_p < 1.0f) {
            double kept_sum = 0.0;
            for (int i = 0; i < keep; i++) kept_sum += s_p[i];
            double acc = 0.0;
            for (int i = 0; i < keep; i++) {
                acc += s_p[i];
                if (acc >= sp.top_p * kept_sum) {
                    keep = i + 1;
                    break;
                }
            }
        }
        double sum = 0.0;
        for (int i = 0; i < keep; i++) sum += s_p[i];
        uint64_t *s = p.rng + (size_t)row * 4;
        uint64_t s0 = s[0], s1 = s[1], s2 = s[2], s3 = s[3];
        const uint64_t r = rotl(s1 * 5, 7) * 9, t = s1 << 17;
        s2 ^= s0;
        s3 ^= s1;
        s1 ^= s2;
        s0 ^= s3;
        s2 ^= t;
        s3 = rotl(s3, 45);
        s[0] = s0;
        s[1] = s1;
        s[2] = s2;
        s[3] = s3;
        const double u = (double)(r >> 11) * 0x1.0p-53 * sum;
        double acc = 0.0;
        int pick = keep - 1;
        for (int i = 0; i < keep; i++) {
            acc += s_p[i];
            if (u < acc) {
                pick = i;
                break;
            }
        }
        p.tokens[row] = (int32_t)~(uint32_t)(s_cand[pick] & 0xffffffffull);
    }
}

} /* namespace */

extern "C" kds_status kern_cuda_sample(const kern_cuda_sample_args *a, void *stream, kds_err *err) {
    if (!a) return kern_cuda__err(err, KDS_INVALID_ARG, "sample: NULL arguments");
    if (a->N < 0 || a->V < 1 || a->n_penalty < 0)
        return kern_cuda__err(err, KDS_INVALID_ARG, "sample: N=%d V=%d n_penalty=%d", a->N, a->V,
                              a->n_penalty);
    const kern_sample_params *sp = &a->params;
    if (!a->row_params && sp->temperature > 0.0f) {
        const int k = sp->top_k > 0 && sp->top_k < a->V ? sp->top_k : a->V;
        if (k > KERN_CUDA_SAMPLE_MAX_K)
            return kern_cuda__err(err, KDS_UNSUPPORTED,
                                  "sample: top_k=%d over a vocabulary of %d keeps %d candidates; "
                                  "the GPU sampler keeps at most %d (sample on the CPU)",
                                  sp->top_k, a->V, k, KERN_CUDA_SAMPLE_MAX_K);
        if (!(sp->temperature < INFINITY))
            return kern_cuda__err(err, KDS_INVALID_ARG, "sample: temperature %g",
                                  (double)sp->temperature);
    }
    if (a->N == 0) return KDS_OK;
    if (!a->logits || !a->rng || !a->tokens)
        return kern_cuda__err(err, KDS_INVALID_ARG, "sample: NULL device pointer");
    sample_params p;
    p.logits = a->logits;
    p.V = a->V;
    p.n_penalty = a->penalty_ids ? a->n_penalty : 0;
    p.sp = *sp;
    p.row_sp = a->row_params;
    p.pen = a->penalty_ids;
    p.rng = a->rng;
    p.tokens = a->tokens;
    sample_kernel<<<(unsigned)a->N, kThreads, 0, kern_cuda__stream(stream)>>>(p);
    return kern_cuda__status(cudaGetLastError(), err, "sample launch");
}
