/*
 * kern_cuda_mla.cu - MLA attention of the hybrid Kimi-Linear layers on the
 * GPU (kern_cuda_mla_cache_append, kern_cuda_mla_attention in
 * kern_cuda.h), absorbed form, no RoPE (kda-model-spec.md §5.2).
 * CPU reference: kern_mla_attend (kernels/cpu/mla.c), the engine's own.
 *
 * Attention is three launches, all fp32 on CUDA cores:
 *   absorb    Qa[r, h] = [q_nope W_UK_h | q_pe] * scale          [rows, nh, dc+dr]
 *   attend    MQA against the sequence's latent cache, split over the
 *             context (flash-decoding): each CTA holds up to 32 (row, head)
 *             query units of ONE sequence in shared memory and streams its
 *             split of the cache through shared memory in tiles of 32 keys,
 *             once for all of them; online softmax per unit; writes
 *             unnormalised partials (max, sum, latent [dc]) per split.
 *   combine   merges the splits per (row, head), divides by the sum and
 *             multiplies by W_UV_h:  o[r, h] = lat W_UV_h^T           [rows, nh, dv]
 * Cache rows are [c (dc) | k_pe (dr)] fp32: key = the whole row, value = c.
 */
#include <limits.h>
#include <math.h>
#include <stdint.h>

#include "kern_cuda_impl.cuh"
#include "kern_cuda_dev.cuh"

namespace {

constexpr int kKeys = 32;        /* keys per tile: one per lane in the score phase */
constexpr int kWarps = 8;        /* attend CTA: 256 threads */
constexpr int kUnitsPerWarp = 4; /* (row, head) query units per warp */
constexpr int kUnits = kWarps * kUnitsPerWarp; /* 32 per CTA */
constexpr int kRowTile = 8;      /* rows per CTA of the absorb and combine kernels */
/* The absorb and combine kernels also split their outputs over grid.z, so
 * that a decode step (one row: one CTA per head) still covers the GPU: with
 * a CTA per head alone, 32 of the H200's 132 SMs read the 4 MiB of W_UK /
 * W_UV in turn (~120 / ~50 µs a layer). Each output keeps its own thread
 * (absorb) or warp (combine), and its order of summation. */
constexpr int kAbsorbThreads = 64;   /* latent columns per CTA */
constexpr int kCombineThreads = 256;
constexpr int kCombineVPerCta = 16;  /* output columns per CTA: 2 per warp */
constexpr int kAppendThreads = 256; /* a warp per row */
constexpr int kMinSplitKeys = 256;  /* do not split the context finer than this */

__device__ __forceinline__ float ld_w(const void *p, int bf16, size_t i) {
    if (bf16) return __uint_as_float((uint32_t)static_cast<const uint16_t *>(p)[i] << 16);
    return static_cast<const float *>(p)[i];
}

/* Where a row's cache is and which position its query/latent has. */
struct rows_map {
    float *cache;            /* one sequence (caches == NULL) */
    long long pos0;
    float *const *caches;    /* else: per slot */
    int n_caches;
    const int32_t *slots, *pos;
};

/* Row r's cache (NULL: a padding row) and position. */
__device__ __forceinline__ float *row_cache(const rows_map &m, int r, long long *p) {
    if (!m.caches) {
        *p = m.pos0 + r;
        return m.cache;
    }
    const int s = m.slots[r];
    if (s < 0 || s >= m.n_caches) {
        *p = -1;
        return nullptr;
    }
    *p = m.pos[r];
    return m.caches[s];
}

/* ---- cache append ------------------------------------------------------- */

struct append_params {
    rows_map map;
    int rows, dc, dr;
    float eps;
    const float *kva;
    const void *w;
    int w_bf16;
};

/* kern_rmsnorm's numerics: sum of squares in double, r = (float)(1 / sqrt(
 * ss / n + eps)), y = x * r * w rounded product by product. */
__global__ void __launch_bounds__(kAppendThreads) mla_append_kernel(const append_params p) {
    const int r = (int)((blockIdx.x * (unsigned)blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= p.rows) return;
    long long pos;
    float *cache = row_cache(p.map, r, &pos);
    if (!cache || pos < 0) return;
    const int row = p.dc + p.dr;
    const float *x = p.kva + (size_t)r * row;
    float *dst = cache + (size_t)pos * row;
    double ss = 0.0;
    for (int i = lane; i < p.dc; i += 32) ss += (double)x[i] * x[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float rs = (float)(1.0 / sqrt(ss / p.dc + (double)p.eps));
    for (int i = lane; i < p.dc; i += 32) {
        float y = __fmul_rn(x[i], rs);
        if (p.w) y = __fmul_rn(y, ld_w(p.w, p.w_bf16, i));
        dst[i] = y;
    }
    for (int i = lane; i < p.dr; i += 32) dst[p.dc + i] = x[p.dc + i];
}

/* ---- attention ------------------------------------------------------------ */

struct attn_params {
    rows_map map;
    int rows, nh, dc, dr, dn, dv;
    float scale;
    const float *q;    /* [rows, nh*(dn+dr)] */
    const void *kvb;   /* [nh*(dn+dv), dc] */
    int kvb_bf16;
    float *o;          /* [rows, nh*dv] */
    float *qa;         /* workspace: [rows, nh, dc+dr] absorbed queries */
    float *part;       /* workspace: [rows, nh, n_split, dc] unnormalised latents */
    float *ml;         /* workspace: [rows, nh, n_split, 2] max and sum */
    int n_split;
    int split_keys;    /* keys per split (a multiple of kKeys); the last runs to the end */
    int rows_per_cta;  /* rows of one CTA (rows of one sequence only) */
    int heads_per_cta; /* rows_per_cta * heads_per_cta <= kUnits */
    int head_groups;
    int ldq;           /* shared-memory row stride of queries and keys, floats */
};

/* Qa = [q_nope W_UK_h | q_pe] * scale for kRowTile rows and one head; a
 * thread per latent column, W_UK_h read once per row tile, coalesced. */
template <int BF16>
__global__ void __launch_bounds__(kAbsorbThreads) mla_absorb_kernel(const attn_params p) {
    KDS_DYN_SMEM(smem);
    float *qn = reinterpret_cast<float *>(smem); /* [kRowTile, dn] */
    const int r0 = blockIdx.x * kRowTile, h = blockIdx.y;
    const int nr = min(kRowTile, p.rows - r0);
    const int qw = p.nh * (p.dn + p.dr), row = p.dc + p.dr;
    for (int i = threadIdx.x; i < kRowTile * p.dn; i += blockDim.x) {
        const int r = i / p.dn, n = i % p.dn;
        qn[i] = r < nr ? p.q[(size_t)(r0 + r) * qw + (size_t)h * (p.dn + p.dr) + n] : 0.0f;
    }
    __syncthreads();
    const size_t wbase = (size_t)h * (p.dn + p.dv) * p.dc;
    for (int c = blockIdx.z * blockDim.x + threadIdx.x; c < p.dc; c += gridDim.z * blockDim.x) {
        float acc[kRowTile];
#pragma unroll
        for (int r = 0; r < kRowTile; r++) acc[r] = 0.0f;
#pragma unroll 8 /* eight weight loads in flight */
        for (int n = 0; n < p.dn; n++) {
            const float w = ld_w(p.kvb, BF16, wbase + (size_t)n * p.dc + c);
#pragma unroll
            for (int r = 0; r < kRowTile; r++) acc[r] = fmaf(qn[r * p.dn + n], w, acc[r]);
        }
#pragma unroll
        for (int r = 0; r < kRowTile; r++)
            if (r < nr) p.qa[((size_t)(r0 + r) * p.nh + h) * row + c] = acc[r] * p.scale;
    }
    if (blockIdx.z != 0) return;
    for (int i = threadIdx.x; i < nr * p.dr; i += blockDim.x) {
        const int r = i / p.dr, j = i % p.dr;
        p.qa[((size_t)(r0 + r) * p.nh + h) * row + p.dc + j] =
            p.q[(size_t)(r0 + r) * qw + (size_t)h * (p.dn + p.dr) + p.dn + j] * p.scale;
    }
}

/*
 * One CTA: units (rows [r0, r0+rows_per_cta) x heads [h0, h0+heads_per_cta))
 * of one sequence, context split blockIdx.y. Warp w owns units w, w+8, w+16,
 * w+24; lane l holds latent columns l, l+32, ... (NC = dc/32 of them) of
 * each. Per tile of 32 keys: lane j scores key j against the warp's units
 * (float4 dot products over dc+dr from shared memory; the row stride ldq/4 is
 * odd, so 8 lanes' float4s hit distinct banks), a warp max/sum updates the
 * online softmax, and every lane adds p_j * c_j for its columns.
 */
template <int NC>
__global__ void __launch_bounds__(kWarps * 32) mla_attend_kernel(const attn_params p) {
    KDS_DYN_SMEM(smem);
    float *qs = reinterpret_cast<float *>(smem); /* [kUnits, ldq] */
    float *ks = qs + (size_t)kUnits * p.ldq;     /* [kKeys, ldq] */
    __shared__ float *s_cache;
    __shared__ long long s_pos[kUnits]; /* unit's query position, -1: none */
    __shared__ long long s_kend;        /* end of this CTA's key range */

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rg = blockIdx.x / p.head_groups, hg = blockIdx.x % p.head_groups;
    const int r0 = rg * p.rows_per_cta, h0 = hg * p.heads_per_cta;
    const int hpc = min(p.heads_per_cta, p.nh - h0);
    const int row = p.dc + p.dr, split = blockIdx.y;
    const long long kbeg = (long long)split * p.split_keys;
    const bool last_split = split == p.n_split - 1;

    if (threadIdx.x < kUnits) {
        const int u = threadIdx.x, ri = u / p.heads_per_cta, hi = u % p.heads_per_cta;
        long long pos = -1;
        float *c = nullptr;
        if (ri < p.rows_per_cta && r0 + ri < p.rows && hi < hpc) c = row_cache(p.map, r0 + ri, &pos);
        s_pos[u] = c ? pos : -1;
        if (u == 0) s_cache = nullptr;
        __syncwarp();
        if (c && ri == 0 && hi == 0) s_cache = c; /* all rows of a CTA share it */
    }
    /* the first unit may be padding in decode (one row per CTA): then every
     * unit is, and nothing is read */
    __syncthreads();
    if (threadIdx.x == 0) {
        long long e = kbeg;
        for (int u = 0; u < kUnits; u++) {
            if (s_pos[u] < 0) continue;
            long long ue = s_pos[u] + 1;
            if (!last_split && ue > kbeg + p.split_keys) ue = kbeg + p.split_keys;
            if (ue > e) e = ue;
        }
        s_kend = e;
    }
    /* queries into shared memory (zeros for units without a query) */
    const int row4 = row / 4, ldq4 = p.ldq / 4;
    for (int i = threadIdx.x; i < kUnits * row4; i += blockDim.x) {
        const int u = i / row4, k4 = i % row4;
        const int ri = u / p.heads_per_cta, hi = u % p.heads_per_cta;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (s_pos[u] >= 0)
            v = reinterpret_cast<const float4 *>(
                p.qa + ((size_t)(r0 + ri) * p.nh + h0 + hi) * row)[k4];
        reinterpret_cast<float4 *>(qs)[(size_t)u * ldq4 + k4] = v;
    }
    __syncthreads();
    const long long kend = s_kend;
    const float *cache = s_cache;

    float m[kUnitsPerWarp], l[kUnitsPerWarp], acc[kUnitsPerWarp][NC];
    long long upos[kUnitsPerWarp];
#pragma unroll
    for (int j = 0; j < kUnitsPerWarp; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
        upos[j] = s_pos[warp + kWarps * j];
#pragma unroll
        for (int i = 0; i < NC; i++) acc[j][i] = 0.0f;
    }
    /* the split's own end for each unit (the last split runs to the query) */
    const long long send = last_split ? LLONG_MAX : kbeg + p.split_keys;

    for (long long t0 = kbeg; t0 < kend; t0 += kKeys) {
        const int nk = (int)min((long long)kKeys, kend - t0);
        for (int i = threadIdx.x; i < kKeys * row4; i += blockDim.x) {
            const int j = i / row4, k4 = i % row4;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (j < nk) v = reinterpret_cast<const float4 *>(cache + (size_t)(t0 + j) * row)[k4];
            reinterpret_cast<float4 *>(ks)[(size_t)j * ldq4 + k4] = v;
        }
        __syncthreads();
        /* scores: lane = key */
        float s[kUnitsPerWarp];
#pragma unroll
        for (int j = 0; j < kUnitsPerWarp; j++) s[j] = 0.0f;
        const float4 *kr = reinterpret_cast<const float4 *>(ks) + (size_t)lane * ldq4;
        for (int k4 = 0; k4 < row4; k4++) {
            const float4 kv = kr[k4];
#pragma unroll
            for (int j = 0; j < kUnitsPerWarp; j++) {
                const float4 qv =
                    reinterpret_cast<const float4 *>(qs)[(size_t)(warp + kWarps * j) * ldq4 + k4];
                s[j] = fmaf(qv.x, kv.x, s[j]);
                s[j] = fmaf(qv.y, kv.y, s[j]);
                s[j] = fmaf(qv.z, kv.z, s[j]);
                s[j] = fmaf(qv.w, kv.w, s[j]);
            }
        }
        const long long key = t0 + lane;
        float pr[kUnitsPerWarp];
#pragma unroll
        for (int j = 0; j < kUnitsPerWarp; j++) {
            const bool vis = lane < nk && key <= upos[j] && key < send;
            float sv = vis ? s[j] : -INFINITY;
            float mt = sv;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
            const float mn = fmaxf(m[j], mt);
            float pj = 0.0f, corr = 1.0f;
            if (mn != -INFINITY) { /* else nothing visible yet: all stays 0 */
                pj = vis ? expf(sv - mn) : 0.0f;
                corr = expf(m[j] - mn); /* 0 when m was -inf */
                m[j] = mn;
            }
            float sum = pj;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            l[j] = l[j] * corr + sum;
#pragma unroll
            for (int i = 0; i < NC; i++) acc[j][i] *= corr;
            pr[j] = pj;
        }
        /* values: acc += p_k * c_k over the tile's keys */
        for (int k = 0; k < nk; k++) {
            const float *cr = ks + (size_t)k * p.ldq;
            float cv[NC];
#pragma unroll
            for (int i = 0; i < NC; i++) cv[i] = cr[lane + 32 * i];
#pragma unroll
            for (int j = 0; j < kUnitsPerWarp; j++) {
                const float pk = __shfl_sync(0xffffffffu, pr[j], k);
#pragma unroll
                for (int i = 0; i < NC; i++) acc[j][i] = fmaf(pk, cv[i], acc[j][i]);
            }
        }
        __syncthreads(); /* before the next tile overwrites ks */
    }
    /* partials of this split */
#pragma unroll
    for (int j = 0; j < kUnitsPerWarp; j++) {
        if (upos[j] < 0) continue;
        const int u = warp + kWarps * j, ri = u / p.heads_per_cta, hi = u % p.heads_per_cta;
        const size_t idx = ((size_t)(r0 + ri) * p.nh + h0 + hi) * p.n_split + split;
        float *dst = p.part + idx * p.dc;
#pragma unroll
        for (int i = 0; i < NC; i++) dst[lane + 32 * i] = acc[j][i];
        if (lane == 0) {
            p.ml[idx * 2] = m[j];
            p.ml[idx * 2 + 1] = l[j];
        }
    }
}

/* Merge the splits of kRowTile rows of head h, normalise, and multiply by
 * W_UV_h: warp w computes outputs v = w, w+8, ... with lanes over the
 * latent (coalesced rows of W_UV_h), one warp sum per (row, v). */
template <int BF16>
__global__ void __launch_bounds__(kCombineThreads) mla_combine_kernel(const attn_params p) {
    KDS_DYN_SMEM(smem);
    float *lat = reinterpret_cast<float *>(smem); /* [kRowTile, dc] */
    const int r0 = blockIdx.x * kRowTile, h = blockIdx.y;
    const int nr = min(kRowTile, p.rows - r0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int r = warp; r < kRowTile; r += nw) {
        long long pos = -1;
        const bool live = r < nr && row_cache(p.map, r0 + r, &pos) != nullptr && pos >= 0;
        const size_t base = ((size_t)(r0 + r) * p.nh + h) * p.n_split;
        float M = -INFINITY, L = 0.0f;
        if (live) {
            for (int s = 0; s < p.n_split; s++) M = fmaxf(M, p.ml[(base + s) * 2]);
            for (int s = 0; s < p.n_split; s++) {
                const float ms = p.ml[(base + s) * 2];
                if (ms != -INFINITY) L += p.ml[(base + s) * 2 + 1] * expf(ms - M);
            }
        }
        const float inv = live ? 1.0f / L : 0.0f;
        for (int c = lane; c < p.dc; c += 32) {
            float v = 0.0f;
            if (live)
                for (int s = 0; s < p.n_split; s++) {
                    const float ms = p.ml[(base + s) * 2];
                    if (ms != -INFINITY) v = fmaf(p.part[(base + s) * p.dc + c], expf(ms - M), v);
                }
            lat[r * p.dc + c] = v * inv; /* padding rows: 0, so o = 0 */
        }
    }
    __syncthreads();
    const size_t wbase = ((size_t)h * (p.dn + p.dv) + p.dn) * p.dc;
    for (int v = blockIdx.z * nw + warp; v < p.dv; v += gridDim.z * nw) {
        float acc[kRowTile];
#pragma unroll
        for (int r = 0; r < kRowTile; r++) acc[r] = 0.0f;
#pragma unroll 4
        for (int c = lane; c < p.dc; c += 32) {
            const float w = ld_w(p.kvb, BF16, wbase + (size_t)v * p.dc + c);
#pragma unroll
            for (int r = 0; r < kRowTile; r++) acc[r] = fmaf(lat[r * p.dc + c], w, acc[r]);
        }
#pragma unroll
        for (int r = 0; r < kRowTile; r++)
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
        if (lane == 0)
#pragma unroll
            for (int r = 0; r < kRowTile; r++)
                if (r < nr) p.o[((size_t)(r0 + r) * p.nh + h) * p.dv + v] = acc[r];
    }
}

/* ---- host side ------------------------------------------------------------ */

size_t align256(size_t b) {
    return (b + 255) & ~(size_t)255;
}

/* Workspace pieces for `rows` rows and `splits` splits. */
size_t ws_bytes(const kern_mla_shape *sh, int rows, int splits) {
    const size_t units = (size_t)rows * sh->nh;
    return align256(units * (size_t)(sh->dc + sh->dr) * 4) +
           align256(units * (size_t)splits * sh->dc * 4) + align256(units * (size_t)splits * 8);
}

bool aligned16(const void *p) {
    return ((uintptr_t)p & 15u) == 0;
}

const char *shape_problem(const kern_mla_shape *sh) {
    if (sh->nh < 1 || sh->dn < 1 || sh->dv < 1 || sh->dr < 0) return "nh, dn, dv must be >= 1, dr >= 0";
    if (sh->dc != 64 && sh->dc != 128 && sh->dc != 256 && sh->dc != 512)
        return "dc (kv_lora_rank) must be 64, 128, 256 or 512";
    if (sh->dr % 4) return "dr (qk_rope_head_dim) must be a multiple of 4";
    return nullptr;
}

kds_status check_map(const kern_cuda_mla_rows *m, kds_err *err, const char *what) {
    if (m->rows < 0) return kern_cuda__err(err, KDS_INVALID_ARG, "%s: rows=%d", what, m->rows);
    if (m->rows == 0) return KDS_OK;
    if (m->caches) {
        if (m->n_caches < 0 || !m->slots || !m->pos)
            return kern_cuda__err(err, KDS_INVALID_ARG,
                                  "%s: a cache table needs n_caches >= 0, slots and pos", what);
    } else {
        if (!m->cache) return kern_cuda__err(err, KDS_INVALID_ARG, "%s: NULL cache", what);
        if (m->pos0 < 0) return kern_cuda__err(err, KDS_INVALID_ARG, "%s: pos0=%lld", what, (long long)m->pos0);
        if (!aligned16(m->cache))
            return kern_cuda__err(err, KDS_INVALID_ARG, "%s: cache not 16-byte aligned", what);
    }
    return KDS_OK;
}

rows_map make_map(const kern_cuda_mla_rows *m) {
    rows_map r;
    r.cache = m->cache;
    r.pos0 = (long long)m->pos0;
    r.caches = m->caches;
    r.n_caches = m->n_caches;
    r.slots = m->slots;
    r.pos = m->pos;
    return r;
}

template <int NC>
cudaError_t launch_attend(const attn_params &p, dim3 grid, size_t smem, cudaStream_t st) {
    cudaError_t e = cudaFuncSetAttribute(mla_attend_kernel<NC>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    mla_attend_kernel<NC><<<grid, kWarps * 32, smem, st>>>(p);
    return cudaGetLastError();
}

int ldq_of(const kern_mla_shape *sh) {
    int ld = sh->dc + sh->dr; /* a multiple of 4 */
    if ((ld / 4) % 2 == 0) ld += 4; /* odd float4 stride: conflict-free */
    return ld;
}

} /* namespace */

extern "C" size_t kern_cuda_mla_workspace_bytes(const kern_mla_shape *sh, int rows, int max_splits) {
    if (!sh || rows < 1 || max_splits < 1 || shape_problem(sh)) return 0;
    return ws_bytes(sh, rows, max_splits);
}

extern "C" size_t kern_cuda_mla_attention_smem_bytes(const kern_mla_shape *sh) {
    if (!sh || shape_problem(sh)) return 0;
    return (size_t)(kUnits + kKeys) * ldq_of(sh) * sizeof(float);
}

extern "C" kds_status kern_cuda_mla_cache_append(const kern_cuda_mla_append_args *a, void *stream,
                                                 kds_err *err) {
    if (!a) return kern_cuda__err(err, KDS_INVALID_ARG, "mla cache append: NULL arguments");
    kds_status st = check_map(&a->map, err, "mla cache append");
    if (st != KDS_OK || a->map.rows == 0) return st;
    if (a->dc < 1 || a->dr < 0)
        return kern_cuda__err(err, KDS_INVALID_ARG, "mla cache append: dc=%d dr=%d", a->dc, a->dr);
    if (!a->kva) return kern_cuda__err(err, KDS_INVALID_ARG, "mla cache append: NULL kva");
    if (a->norm_w && a->norm_w_dtype != KERN_F32 && a->norm_w_dtype != KERN_BF16)
        return kern_cuda__err(err, KDS_INVALID_ARG, "mla cache append: norm weight dtype %d (F32 or BF16)",
                              (int)a->norm_w_dtype);
    append_params p;
    p.map = make_map(&a->map);
    p.rows = a->map.rows;
    p.dc = a->dc;
    p.dr = a->dr;
    p.eps = a->eps;
    p.kva = a->kva;
    p.w = a->norm_w;
    p.w_bf16 = a->norm_w_dtype == KERN_BF16;
    const unsigned blocks = (unsigned)((p.rows + kAppendThreads / 32 - 1) / (kAppendThreads / 32));
    mla_append_kernel<<<blocks, kAppendThreads, 0, kern_cuda__stream(stream)>>>(p);
    return kern_cuda__status(cudaGetLastError(), err, "mla cache append launch");
}

extern "C" kds_status kern_cuda_mla_attention(const kern_cuda_mla_args *a, void *stream,
                                              kds_err *err) {
    if (!a) return kern_cuda__err(err, KDS_INVALID_ARG, "mla attention: NULL arguments");
    kds_status st = check_map(&a->map, err, "mla attention");
    if (st != KDS_OK) return st;
    const kern_mla_shape *sh = &a->shape;
    if (const char *why = shape_problem(sh))
        return kern_cuda__err(err, KDS_UNSUPPORTED, "mla attention: nh=%d dc=%d dr=%d dn=%d dv=%d: %s",
                              sh->nh, sh->dc, sh->dr, sh->dn, sh->dv, why);
    const int rows = a->map.rows;
    if (rows == 0) return KDS_OK;
    if (!a->q || !a->kv_b || !a->o || !a->workspace)
        return kern_cuda__err(err, KDS_INVALID_ARG, "mla attention: NULL q, kv_b, o or workspace");
    if (a->kv_b_dtype != KERN_F32 && a->kv_b_dtype != KERN_BF16)
        return kern_cuda__err(err, KDS_INVALID_ARG, "mla attention: kv_b dtype %d (F32 or BF16)",
                              (int)a->kv_b_dtype);
    if (!aligned16(a->workspace))
        return kern_cuda__err(err, KDS_INVALID_ARG, "mla attention: workspace not 16-byte aligned");
    if (a->max_ctx < 0)
        return kern_cuda__err(err, KDS_INVALID_ARG, "mla attention: max_ctx=%d", a->max_ctx);
    if (a->workspace_bytes < ws_bytes(sh, rows, 1))
        return kern_cuda__err(err, KDS_INVALID_ARG,
                              "mla attention: workspace of %zu bytes, %d rows need at least %zu",
                              a->workspace_bytes, rows, ws_bytes(sh, rows, 1));
    cudaStream_t cs = kern_cuda__stream(stream);

    attn_params p;
    p.map = make_map(&a->map);
    p.rows = rows;
    p.nh = sh->nh;
    p.dc = sh->dc;
    p.dr = sh->dr;
    p.dn = sh->dn;
    p.dv = sh->dv;
    p.scale = 1.0f / sqrtf((float)(sh->dn + sh->dr));
    p.q = a->q;
    p.kvb = a->kv_b;
    p.kvb_bf16 = a->kv_b_dtype == KERN_BF16;
    p.o = a->o;
    p.ldq = ldq_of(sh);
    p.heads_per_cta = sh->nh < kUnits ? sh->nh : kUnits;
    p.head_groups = (sh->nh + p.heads_per_cta - 1) / p.heads_per_cta;
    /* rows of one sequence may share a CTA (they share its cache tiles) */
    p.rows_per_cta = a->map.caches ? 1 : kUnits / p.heads_per_cta;
    const int row_groups = (rows + p.rows_per_cta - 1) / p.rows_per_cta;
    const long long ctas = (long long)row_groups * p.head_groups;

    /* Split the context so that the grid covers the GPU twice, no split
     * shorter than kMinSplitKeys, as many as the workspace holds. */
    int n_split = a->n_split;
    const long long ctx = a->max_ctx > 0 ? a->max_ctx : 1;
    if (n_split <= 0) {
        int sms = 132;
        int dev = 0;
        if (cudaGetDevice(&dev) == cudaSuccess)
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        long long want = (2LL * sms + ctas - 1) / ctas;
        long long most = (ctx + kMinSplitKeys - 1) / kMinSplitKeys;
        if (want > most) want = most;
        n_split = want < 1 ? 1 : want > 1024 ? 1024 : (int)want;
    }
    while (n_split > 1 && ws_bytes(sh, rows, n_split) > a->workspace_bytes) n_split--;
    if (ws_bytes(sh, rows, n_split) > a->workspace_bytes)
        return kern_cuda__err(err, KDS_INVALID_ARG, "mla attention: workspace too small");
    long long sk = (ctx + n_split - 1) / n_split;
    sk = (sk + kKeys - 1) / kKeys * kKeys;
    if (sk > INT32_MAX) return kern_cuda__err(err, KDS_UNSUPPORTED, "mla attention: context too long");
    p.n_split = n_split;
    p.split_keys = (int)sk;
    if (ctas > INT32_MAX || n_split > 65535)
        return kern_cuda__err(err, KDS_UNSUPPORTED, "mla attention: too many rows (%d)", rows);

    const size_t units = (size_t)rows * sh->nh;
    char *ws = static_cast<char *>(a->workspace);
    p.qa = reinterpret_cast<float *>(ws);
    ws += align256(units * (size_t)(sh->dc + sh->dr) * 4);
    p.part = reinterpret_cast<float *>(ws);
    ws += align256(units * (size_t)n_split * sh->dc * 4);
    p.ml = reinterpret_cast<float *>(ws);

    const unsigned row_tiles = (unsigned)((rows + kRowTile - 1) / kRowTile);
    const dim3 tiles(row_tiles, (unsigned)sh->nh, (unsigned)((sh->dc + kAbsorbThreads - 1) / kAbsorbThreads));
    const dim3 combine_tiles(row_tiles, (unsigned)sh->nh,
                             (unsigned)((sh->dv + kCombineVPerCta - 1) / kCombineVPerCta));
    const size_t absorb_smem = (size_t)kRowTile * sh->dn * sizeof(float);
    const size_t combine_smem = (size_t)kRowTile * sh->dc * sizeof(float);
    cudaError_t e;
    if (p.kvb_bf16) {
        e = cudaFuncSetAttribute(mla_absorb_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)absorb_smem);
        if (e == cudaSuccess) {
            mla_absorb_kernel<1><<<tiles, kAbsorbThreads, absorb_smem, cs>>>(p);
            e = cudaGetLastError();
        }
    } else {
        e = cudaFuncSetAttribute(mla_absorb_kernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)absorb_smem);
        if (e == cudaSuccess) {
            mla_absorb_kernel<0><<<tiles, kAbsorbThreads, absorb_smem, cs>>>(p);
            e = cudaGetLastError();
        }
    }
    if (e != cudaSuccess) return kern_cuda__status(e, err, "mla absorb launch");

    const dim3 grid((unsigned)ctas, (unsigned)n_split);
    const size_t smem = (size_t)(kUnits + kKeys) * p.ldq * sizeof(float);
    switch (sh->dc) {
    case 64: e = launch_attend<2>(p, grid, smem, cs); break;
    case 128: e = launch_attend<4>(p, grid, smem, cs); break;
    case 256: e = launch_attend<8>(p, grid, smem, cs); break;
    default: e = launch_attend<16>(p, grid, smem, cs); break;
    }
    if (e != cudaSuccess) return kern_cuda__status(e, err, "mla attend launch");

    if (p.kvb_bf16) {
        e = cudaFuncSetAttribute(mla_combine_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)combine_smem);
        if (e == cudaSuccess) {
            mla_combine_kernel<1><<<combine_tiles, kCombineThreads, combine_smem, cs>>>(p);
            e = cudaGetLastError();
        }
    } else {
        e = cudaFuncSetAttribute(mla_combine_kernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)combine_smem);
        if (e == cudaSuccess) {
            mla_combine_kernel<0><<<combine_tiles, kCombineThreads, combine_smem, cs>>>(p);
            e = cudaGetLastError();
        }
    }
    return kern_cuda__status(e, err, "mla combine launch");
}
