/*
 * kern_cuda_moe.cu - MoE routing, token permutation, gather and combine on
 * the GPU (kern_cuda.h). CPU references: kern_moe_route, kern_moe_permute
 * (kernels/cpu/moe.c, the engine's route_token and moe_ffn gather) and the
 * engine's combine loop.
 *
 * Launches of kern_cuda_moe_route:
 *   route  one warp per token: scores and biased scores in shared memory,
 *          group scores (top-2 sums) by lanes over groups, then topk_group
 *          and k rounds of a warp arg-max (ties to the lower index, as the
 *          CPU's "strictly greater" scan), weights by lane n for slot n;
 *   count  one CTA per expert: how many (token, slot) pairs chose it;
 *   scan   one CTA: exp_off = exclusive prefix sums of the counts;
 *   place  one CTA per expert: walks the pairs in order, 256 at a time,
 *          ranks its matches with warp ballots (a stable order), writes
 *          row_of and tok_of.
 * Everything is deterministic; count and place read the [T, k] selection
 * once per expert (from L2: 8 KiB at a decode batch of 256, 2 MiB for an
 * 8K-token prefill step with k = 8).
 */
#include <stdint.h>

#include "kern_cuda_dev.cuh"
#include "kern_cuda_impl.cuh"

namespace {

constexpr int kRouteWarps = 4;
constexpr int kPermThreads = 256;

struct route_params {
    const float *logits, *bias;
    int apply_sigmoid;
    int T, E, k, G, topk_group, renorm;
    float scale;
    int32_t *sel;
    float *w;
};

/* (v, i) beats (bv, bi): a valid index beats none, then the larger value,
 * then the lower index. */
__device__ __forceinline__ void argmax_step(float &bv, int &bi, float v, int i) {
    if (i < 0) return;
    if (bi < 0 || v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

__device__ __forceinline__ void warp_argmax(float &bv, int &bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, bv, o);
        const int i = __shfl_xor_sync(0xffffffffu, bi, o);
        argmax_step(bv, bi, v, i);
    }
}

__global__ void __launch_bounds__(kRouteWarps * 32) route_kernel(const route_params p) {
    KDS_DYN_SMEM(smem);
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const int t = blockIdx.x * kRouteWarps + wib;
    if (t >= p.T) return; /* whole warps; only warp-level sync below */
    const int E = p.E, G = p.G, pg = E / G;
    float *sv = reinterpret_cast<float *>(smem) + (size_t)wib * (2 * E + 256); /* biased */
    float *ss = sv + E;                                                        /* scores */
    float *gs = ss + E; /* group scores, then 1/0 for kept groups */
    const float *lg = p.logits + (size_t)t * E;
    for (int e = lane; e < E; e += 32) {
        float s = lg[e];
        if (p.apply_sigmoid) s = 1.0f / (1.0f + expf(-s));
        ss[e] = s;
        sv[e] = s + (p.bias ? p.bias[e] : 0.0f);
    }
    __syncwarp();

    if (G > 1) {
        for (int g = lane; g < G; g += 32) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int e = g * pg; e < (g + 1) * pg; e++) {
                const float v = sv[e];
                if (v > b1) {
                    b2 = b1;
                    b1 = v;
                } else if (v > b2) {
                    b2 = v;
                }
            }
            gs[g] = b1 + (pg > 1 ? b2 : 0.0f);
        }
        __syncwarp();
        unsigned kept = 0; /* bit j: group lane + 32 j */
        for (int n = 0; n < p.topk_group && n < G; n++) {
            float bv = -INFINITY;
            int bi = -1;
            for (int g = lane, j = 0; g < G; g += 32, j++)
                if (!((kept >> j) & 1u)) argmax_step(bv, bi, gs[g], g);
            warp_argmax(bv, bi);
            if (bi >= 0 && (bi & 31) == lane) kept |= 1u << (bi >> 5);
        }
        __syncwarp();
        for (int g = lane, j = 0; g < G; g += 32, j++) gs[g] = ((kept >> j) & 1u) ? 1.0f : 0.0f;
        __syncwarp();
    }

    unsigned taken = 0; /* bit j: expert lane + 32 j (E <= 1024) */
    int mysel = -1;     /* lane n holds slot n's expert */
    for (int n = 0; n < p.k; n++) {
        float bv = -INFINITY;
        int bi = -1;
        for (int e = lane, j = 0; e < E; e += 32, j++) {
            if ((taken >> j) & 1u) continue;
            if (G > 1 && gs[e / pg] == 0.0f) continue;
            argmax_step(bv, bi, sv[e], e);
        }
        warp_argmax(bv, bi);
        if (bi >= 0 && (bi & 31) == lane) taken |= 1u << (bi >> 5);
        if (lane == n) mysel = bi;
    }
    double sum = 0.0; /* in slot order, as the CPU */
    for (int n = 0; n < p.k; n++) {
        const int e = __shfl_sync(0xffffffffu, mysel, n);
        sum += ss[e];
    }
    if (lane < p.k) {
        float wgt = ss[mysel];
        if (p.renorm && sum > 0.0) wgt = (float)(wgt / sum);
        p.sel[(size_t)t * p.k + lane] = mysel;
        p.w[(size_t)t * p.k + lane] = __fmul_rn(wgt, p.scale);
    }
}

/* Block-wide sum of one int per thread (kPermThreads threads). */
__device__ __forceinline__ int block_sum(int x, int *s_warp) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    if (lane == 0) s_warp[warp] = x;
    __syncthreads();
    int t = 0;
    for (int w = 0; w < kPermThreads / 32; w++) t += s_warp[w];
    __syncthreads(); /* s_warp reusable */
    return t;
}

/* exp_off[e + 1] = number of pairs that chose e; exp_off[0] = 0. */
__global__ void __launch_bounds__(kPermThreads)
count_kernel(const int32_t *sel, int n_pairs, int32_t *exp_off) {
    __shared__ int s_warp[kPermThreads / 32];
    const int e = blockIdx.x;
    int c = 0;
    for (int i = threadIdx.x; i < n_pairs; i += kPermThreads) c += sel[i] == e;
    c = block_sum(c, s_warp);
    if (threadIdx.x == 0) {
        exp_off[e + 1] = c;
        if (e == 0) exp_off[0] = 0;
    }
}

/* exp_off[1..E] = inclusive prefix sums of the counts (one CTA): thread i
 * sums its run of kScanRun entries, the runs' totals are scanned across the
 * block, then each thread writes its run. (One thread over all 256 entries
 * of a decode step took ~4 µs.) */
constexpr int kScanRun = (1025 + kPermThreads - 1) / kPermThreads;
__global__ void __launch_bounds__(kPermThreads) scan_kernel(int32_t *exp_off, int E) {
    __shared__ int s_scan[kPermThreads / 32 + 1];
    const int e0 = threadIdx.x * kScanRun;
    int32_t run[kScanRun], sum = 0;
#pragma unroll
    for (int j = 0; j < kScanRun; j++) {
        run[j] = e0 + j <= E ? exp_off[e0 + j] : 0;
        sum += run[j];
    }
    int total;
    int32_t before = block_exclusive_scan<kPermThreads>(sum, s_scan, &total);
#pragma unroll
    for (int j = 0; j < kScanRun; j++) {
        before += run[j];
        if (e0 + j <= E) exp_off[e0 + j] = before;
    }
}

/* Expert e's pairs, in (token, slot) order, to rows exp_off[e].. */
__global__ void __launch_bounds__(kPermThreads)
place_kernel(const int32_t *sel, int n_pairs, int k, const int32_t *exp_off, int32_t *row_of,
             int32_t *tok_of) {
    __shared__ int s_warp[kPermThreads / 32];
    const int e = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int row = exp_off[e];
    for (int base = 0; base < n_pairs; base += kPermThreads) {
        const int i = base + threadIdx.x;
        const bool hit = i < n_pairs && sel[i] == e;
        const unsigned b = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) s_warp[warp] = __popc(b);
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < kPermThreads / 32; w++) {
            before += w < warp ? s_warp[w] : 0;
            total += s_warp[w];
        }
        if (hit) {
            const int r = row + before + __popc(b & ((1u << lane) - 1u));
            row_of[i] = r;
            tok_of[r] = i / k;
        }
        row += total;
        __syncthreads(); /* s_warp is rewritten next round */
    }
}

/* dst[r] = src[tok_of[r]], a warp per row, 16 bytes per lane and step. */
__global__ void gather_kernel(const uint4 *src, size_t row_vec, const int32_t *tok_of, int n_rows,
                              uint4 *dst) {
    const int r = (int)((blockIdx.x * (unsigned)blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= n_rows) return;
    const uint4 *s = src + (size_t)tok_of[r] * row_vec;
    uint4 *d = dst + (size_t)r * row_vec;
#pragma unroll 4 /* loads in flight, not one row walked load by load */
    for (size_t i = lane; i < row_vec; i += 32) d[i] = s[i];
}

__global__ void combine_kernel(const float *yg, const int32_t *row_of, const float *w, int T, int k,
                               int hidden, const float *shared, float *out) {
    const size_t n = (size_t)T * hidden;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / (size_t)hidden, c = i - t * (size_t)hidden;
        float acc = 0.0f;
        for (int s = 0; s < k; s++) {
            const float y = yg[(size_t)row_of[t * k + s] * hidden + c];
            acc = __fadd_rn(acc, __fmul_rn(w[t * k + s], y));
        }
        if (shared) acc = __fadd_rn(acc, shared[i]);
        out[i] = acc;
    }
}

} /* namespace */

extern "C" kds_status kern_cuda_moe_route(const kern_cuda_moe_route_args *a, void *stream,
                                          kds_err *err) {
    if (!a) return kern_cuda__err(err, KDS_INVALID_ARG, "moe route: NULL arguments");
    const kern_moe_route_params *p = &a->p;
    const int E = p->n_experts, k = p->top_k, G = p->n_group > 1 ? p->n_group : 1;
    if (a->T < 0 || E < 1 || k < 1 || k > E || E % G != 0 || (G > 1 && p->topk_group < 1))
        return kern_cuda__err(err, KDS_INVALID_ARG,
                              "moe route: T=%d E=%d k=%d n_group=%d topk_group=%d (need k <= E, "
                              "E %% n_group == 0)",
                              a->T, E, k, p->n_group, p->topk_group);
    if (G > 1 && (long)(p->topk_group < G ? p->topk_group : G) * (E / G) < k)
        return kern_cuda__err(err, KDS_INVALID_ARG,
                              "moe route: %d kept groups of %d experts cannot give top_k=%d",
                              p->topk_group, E / G, k);
    if (E > 1024 || k > 32 || G > 256)
        return kern_cuda__err(err, KDS_UNSUPPORTED,
                              "moe route: E=%d k=%d n_group=%d (compiled: E <= 1024, k <= 32, "
                              "n_group <= 256)",
                              E, k, G);
    if (a->T == 0) {
        if (!a->exp_off) return kern_cuda__err(err, KDS_INVALID_ARG, "moe route: NULL exp_off");
        return kern_cuda__status(cudaMemsetAsync(a->exp_off, 0, (size_t)(E + 1) * sizeof(int32_t),
                                                 kern_cuda__stream(stream)),
                                 err, "moe route: memset");
    }
    if (!a->logits || !a->sel || !a->w || !a->exp_off || !a->row_of || !a->tok_of)
        return kern_cuda__err(err, KDS_INVALID_ARG, "moe route: NULL device pointer");
    if ((long long)a->T * k > INT32_MAX / 2)
        return kern_cuda__err(err, KDS_UNSUPPORTED, "moe route: T*k=%lld pairs is too many",
                              (long long)a->T * k);

    route_params rp;
    rp.logits = a->logits;
    rp.bias = a->bias;
    rp.apply_sigmoid = a->apply_sigmoid ? 1 : 0;
    rp.T = a->T;
    rp.E = E;
    rp.k = k;
    rp.G = G;
    rp.topk_group = p->topk_group;
    rp.renorm = p->renormalize ? 1 : 0;
    rp.scale = p->routed_scaling_factor;
    rp.sel = a->sel;
    rp.w = a->w;
    const cudaStream_t st = kern_cuda__stream(stream);
    const size_t smem = (size_t)kRouteWarps * (2 * E + 256) * sizeof(float);
    cudaError_t e = cudaSuccess;
    if (smem > 48 * 1024)
        e = cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)smem);
    if (e != cudaSuccess) return kern_cuda__status(e, err, "moe route: shared memory");
    const unsigned rblocks = (unsigned)((a->T + kRouteWarps - 1) / kRouteWarps);
    route_kernel<<<rblocks, kRouteWarps * 32, smem, st>>>(rp);
    if ((e = cudaGetLastError()) != cudaSuccess) return kern_cuda__status(e, err, "moe route launch");
    const int n_pairs = a->T * k;
    count_kernel<<<(unsigned)E, kPermThreads, 0, st>>>(a->sel, n_pairs, a->exp_off);
    if ((e = cudaGetLastError()) != cudaSuccess) return kern_cuda__status(e, err, "moe count launch");
    scan_kernel<<<1, kPermThreads, 0, st>>>(a->exp_off, E);
    if ((e = cudaGetLastError()) != cudaSuccess) return kern_cuda__status(e, err, "moe scan launch");
    place_kernel<<<(unsigned)E, kPermThreads, 0, st>>>(a->sel, n_pairs, k, a->exp_off, a->row_of,
                                                       a->tok_of);
    return kern_cuda__status(cudaGetLastError(), err, "moe place launch");
}

extern "C" kds_status kern_cuda_moe_gather(const void *src, size_t row_bytes,
                                           const int32_t *tok_of, int n_rows, void *dst,
                                           void *stream, kds_err *err) {
    if (n_rows < 0 || (n_rows > 0 && (!src || !tok_of || !dst)))
        return kern_cuda__err(err, KDS_INVALID_ARG, "moe gather: n_rows=%d or NULL pointer",
                              n_rows);
    if (row_bytes == 0 || row_bytes % 16 != 0 || ((uintptr_t)src & 15u) || ((uintptr_t)dst & 15u))
        return kern_cuda__err(err, KDS_INVALID_ARG,
                              "moe gather: row_bytes=%zu must be a positive multiple of 16, "
                              "src and dst 16-byte aligned",
                              row_bytes);
    if (n_rows == 0) return KDS_OK;
    const int threads = 256;
    const unsigned blocks = (unsigned)((n_rows + threads / 32 - 1) / (threads / 32));
    gather_kernel<<<blocks, threads, 0, kern_cuda__stream(stream)>>>(
        static_cast<const uint4 *>(src), row_bytes / 16, tok_of, n_rows, static_cast<uint4 *>(dst));
    return kern_cuda__status(cudaGetLastError(), err, "moe gather launch");
}

extern "C" kds_status kern_cuda_moe_combine(const float *yg, const int32_t *row_of, const float *w,
                                            int T, int k, int hidden, const float *shared,
                                            float *out, void *stream, kds_err *err) {
    if (T < 0 || k < 1 || hidden < 1 || (T > 0 && (!yg || !row_of || !w || !out)))
        return kern_cuda__err(err, KDS_INVALID_ARG, "moe combine: T=%d k=%d hidden=%d or NULL", T,
                              k, hidden);
    const size_t n = (size_t)T * (size_t)hidden;
    if (n == 0) return KDS_OK;
    const int threads = 256;
    size_t want = (n + threads - 1) / threads;
    const unsigned blocks = (unsigned)(want < 65536 ? want : 65536);
    combine_kernel<<<blocks, threads, 0, kern_cuda__stream(stream)>>>(yg, row_of, w, T, k, hidden,
                                                                     shared, out);
    return kern_cuda__status(cudaGetLastError(), err, "moe combine launch");
}
