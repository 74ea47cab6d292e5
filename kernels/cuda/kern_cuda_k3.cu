/*
 * kern_cuda_k3.cu - the operators Kimi K3 adds to Kimi-Linear, on the GPU
 * (contracts in kern_cuda.h, design in README.md; CPU references in
 * kernels/cpu/k3.c, reference/kimi-k3.md §4):
 *
 *   kern_cuda_situ          SiTU, K3's gated activation (dense layer 0 and
 *                           the shared experts; the routed experts fuse it
 *                           into kern_cuda_moe_experts);
 *   kern_cuda_sigmoid_mul   MLA's sigmoid output gate;
 *   kern_cuda_attn_res_mix  Block Attention Residuals' depth mix: a softmax
 *                           over <= 64 candidate vectors per token, scored
 *                           by u . c / rms(c), mixing the raw candidates.
 */
#include <math.h>
#include <stdint.h>

#include "kern_cuda_impl.cuh"

namespace {

constexpr unsigned kFull = 0xffffffffu;

/* sigmoid as the CPU's: 1 / (1 + expf(-x)) */
__device__ __forceinline__ float sigm(float x) {
    return 1.0f / (1.0f + expf(-x));
}

/* kern_situ's expression, in its order of operations */
__device__ __forceinline__ float situ1(float g, float u, float beta, float beta_l) {
    const float gate = beta * tanhf(g / beta) * sigm(g);
    return gate * (beta_l * tanhf(u / beta_l));
}

/* ---- element kernels --------------------------------------------------------- */

constexpr int kElemThreads = 256;

/* OP 0: a = situ(a, b); OP 1: a *= sigmoid(b). Grid-stride; VEC: float4
 * over [0, n / 4 * 4), the n % 4 tail element by element. */
template <int OP>
__device__ __forceinline__ float elem_op(float a, float b, float beta, float beta_l) {
    if (OP == 0) return situ1(a, b, beta, beta_l);
    return a * sigm(b);
}

template <int OP, bool VEC>
__global__ void __launch_bounds__(kElemThreads)
    elem_kernel(float *a, const float *b, size_t n, float beta, float beta_l) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t done = 0;
    if (VEC) {
        const size_t n4 = n / 4;
        float4 *a4 = reinterpret_cast<float4 *>(a);
        const float4 *b4 = reinterpret_cast<const float4 *>(b);
        for (size_t k = i; k < n4; k += stride) {
            float4 x = a4[k];
            const float4 y = b4[k];
            x.x = elem_op<OP>(x.x, y.x, beta, beta_l);
            x.y = elem_op<OP>(x.y, y.y, beta, beta_l);
            x.z = elem_op<OP>(x.z, y.z, beta, beta_l);
            x.w = elem_op<OP>(x.w, y.w, beta, beta_l);
            a4[k] = x;
        }
        done = n4 * 4;
    }
    for (size_t k = done + i; k < n; k += stride)
        a[k] = elem_op<OP>(a[k], b[k], beta, beta_l);
}

bool aligned16(const void *p) {
    return ((uintptr_t)p & 15u) == 0;
}

template <int OP>
kds_status launch_elem(float *a, const float *b, size_t n, float beta, float beta_l, void *stream,
                       kds_err *err, const char *what) {
    const bool vec = aligned16(a) && aligned16(b);
    const size_t work = vec ? (n + 3) / 4 : n;
    size_t blocks = (work + kElemThreads - 1) / kElemThreads;
    if (blocks > 8192) blocks = 8192; /* grid-stride beyond ~60 blocks per SM */
    const cudaStream_t st = kern_cuda__stream(stream);
    if (vec)
        elem_kernel<OP, true><<<(unsigned)blocks, kElemThreads, 0, st>>>(a, b, n, beta, beta_l);
    else
        elem_kernel<OP, false><<<(unsigned)blocks, kElemThreads, 0, st>>>(a, b, n, beta, beta_l);
    return kern_cuda__status(cudaGetLastError(), err, what);
}

/* ---- Block Attention Residuals' mix -------------------------------------------- */

constexpr int kArThreads = 512; /* one CTA per token */
constexpr int kArWarps = kArThreads / 32;
constexpr int kArMaxCand = 64;

struct ar_params {
    int T, D, n_blocks, n;
    const float *blocks, *partial, *u;
    size_t block_stride;
    float eps;
    float *out;
};

/*
 * Token t = blockIdx.x. Thread tid owns the NV "units" tid + k * 512 of a
 * row (a unit is a float4 when VEC, one float otherwise): F = NV * (4 or 1)
 * floats of every candidate, of u and of the output. Candidates are taken
 * G at a time (G * F <= 64 floats of registers): the group's rows are
 * loaded (G * NV independent loads), each thread forms its partial sums of
 * c^2 and c.u in fp32, a warp butterfly sums them, warp 0 sums the 16
 * warps in double and turns them into z, the softmax's running max m and
 * sum l, the factor that rescales the accumulator and each candidate's
 * weight exp(z - m) (two barriers); every thread then adds the group to
 * its accumulator from the registers it already holds. So each candidate
 * is read from memory once; out = acc / l.
 */
template <int NV, bool VEC>
__global__ void __launch_bounds__(kArThreads) attn_res_kernel(const ar_params p) {
    constexpr int W = VEC ? 4 : 1;
    constexpr int F = NV * W;
    constexpr int G = F >= 16 ? 4 : 8;
    __shared__ float s_part[kArWarps][2 * G]; /* per warp: sum c^2 (g), sum c.u (G + g) */
    __shared__ float s_w[G + 2];              /* weights of the group, rescale, 1 / l */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int units = VEC ? p.D / 4 : p.D;
    const size_t row = (size_t)blockIdx.x * p.D;

    float uv[F], acc[F];
#pragma unroll
    for (int k = 0; k < NV; k++) {
        const int idx = tid + k * kArThreads;
#pragma unroll
        for (int w = 0; w < W; w++)
            uv[k * W + w] = 0.0f;
        if (idx < units) {
            if (VEC) {
                const float4 v = __ldg(reinterpret_cast<const float4 *>(p.u) + idx);
                uv[k * 4] = v.x, uv[k * 4 + 1] = v.y, uv[k * 4 + 2] = v.z, uv[k * 4 + 3] = v.w;
            } else {
                uv[k] = __ldg(p.u + idx);
            }
        }
    }
#pragma unroll
    for (int f = 0; f < F; f++)
        acc[f] = 0.0f;
    double m = -INFINITY, l = 0.0; /* warp 0 lane 0's running softmax state */

    for (int j0 = 0; j0 < p.n; j0 += G) {
        float c[G][F];
#pragma unroll
        for (int g = 0; g < G; g++) {
            const int j = j0 + g;
            const float *src = j < p.n_blocks ? p.blocks + (size_t)j * p.block_stride + row
                                              : p.partial + row; /* j == n_blocks: the partial */
#pragma unroll
            for (int k = 0; k < NV; k++) {
                const int idx = tid + k * kArThreads;
                const bool ok = j < p.n && idx < units;
                if (VEC) {
                    const float4 v = ok ? *(reinterpret_cast<const float4 *>(src) + idx)
                                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    c[g][k * 4] = v.x, c[g][k * 4 + 1] = v.y, c[g][k * 4 + 2] = v.z,
                             c[g][k * 4 + 3] = v.w;
                } else {
                    c[g][k] = ok ? src[idx] : 0.0f;
                }
            }
        }
        float ps[2 * G];
#pragma unroll
        for (int g = 0; g < G; g++) {
            float ss = 0.0f, dot = 0.0f;
#pragma unroll
            for (int f = 0; f < F; f++) {
                ss = fmaf(c[g][f], c[g][f], ss);
                dot = fmaf(c[g][f], uv[f], dot);
            }
            ps[g] = ss, ps[G + g] = dot;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int v = 0; v < 2 * G; v++)
                ps[v] += __shfl_xor_sync(kFull, ps[v], o);
        if (lane == 0)
#pragma unroll
            for (int v = 0; v < 2 * G; v++)
                s_part[warp][v] = ps[v];
        __syncthreads();
        if (warp == 0) {
            /* lane v < 2G: the CTA's sum v, in double */
            double sum = 0.0;
            if (lane < 2 * G)
                for (int w = 0; w < kArWarps; w++)
                    sum += (double)s_part[w][lane];
            const double dot = __shfl_down_sync(kFull, sum, G); /* lane g: (ss_g, dot_g) */
            const bool live = lane < G && j0 + lane < p.n;
            const double z = live ? dot / sqrt(sum / p.D + (double)p.eps) : -INFINITY;
            double zmax = z;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                zmax = fmax(zmax, __shfl_xor_sync(kFull, zmax, o));
            const double m_new = fmax(m, zmax); /* finite: the group has a live candidate */
            const double e = live ? exp(z - m_new) : 0.0;
            double esum = e;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                esum += __shfl_xor_sync(kFull, esum, o);
            const double rescale = exp(m - m_new); /* 0 on the first group (m = -inf) */
            l = l * rescale + esum;
            m = m_new;
            if (lane < G) s_w[lane] = (float)e;
            if (lane == 0) {
                s_w[G] = (float)rescale;
                s_w[G + 1] = (float)(1.0 / l);
            }
        }
        __syncthreads();
        const float rescale = s_w[G];
#pragma unroll
        for (int f = 0; f < F; f++)
            acc[f] *= rescale;
#pragma unroll
        for (int g = 0; g < G; g++) {
            const float wg = s_w[g];
#pragma unroll
            for (int f = 0; f < F; f++)
                acc[f] = fmaf(wg, c[g][f], acc[f]);
        }
    }
    /* s_w[G + 1] = 1 / l of the last group; nobody writes s_w after that barrier */
    const float inv_l = s_w[G + 1];
    float *dst = p.out + row;
#pragma unroll
    for (int k = 0; k < NV; k++) {
        const int idx = tid + k * kArThreads;
        if (idx >= units) continue;
        if (VEC)
            reinterpret_cast<float4 *>(dst)[idx] =
                make_float4(acc[k * 4] * inv_l, acc[k * 4 + 1] * inv_l, acc[k * 4 + 2] * inv_l,
                            acc[k * 4 + 3] * inv_l);
        else
            dst[idx] = acc[k] * inv_l;
    }
}

template <int NV, bool VEC> void launch_ar(const ar_params &p, cudaStream_t st) {
    attn_res_kernel<NV, VEC><<<(unsigned)p.T, kArThreads, 0, st>>>(p);
}

} /* namespace */

extern "C" kds_status kern_cuda_situ(float *a, const float *b, size_t n, float beta, float beta_l,
                                     void *stream, kds_err *err) {
    if (!(beta > 0.0f && beta < INFINITY) || !(beta_l > 0.0f && beta_l < INFINITY))
        return kern_cuda__err(err, KDS_INVALID_ARG,
                              "situ: beta=%g beta_l=%g (need positive, finite)", (double)beta,
                              (double)beta_l);
    if (n == 0) return KDS_OK;
    if (!a || !b) return kern_cuda__err(err, KDS_INVALID_ARG, "situ: NULL device pointer");
    return launch_elem<0>(a, b, n, beta, beta_l, stream, err, "situ launch");
}

extern "C" kds_status kern_cuda_sigmoid_mul(float *x, const float *g, size_t n, void *stream,
                                            kds_err *err) {
    if (n == 0) return KDS_OK;
    if (!x || !g) return kern_cuda__err(err, KDS_INVALID_ARG, "sigmoid_mul: NULL device pointer");
    return launch_elem<1>(x, g, n, 0.0f, 0.0f, stream, err, "sigmoid_mul launch");
}

extern "C" kds_status kern_cuda_attn_res_mix(const kern_cuda_attn_res_args *a, void *stream,
                                             kds_err *err) {
    if (!a) return kern_cuda__err(err, KDS_INVALID_ARG, "attn_res_mix: NULL arguments");
    const int n = a->n_blocks + (a->partial != NULL);
    if (a->T < 0 || a->n_blocks < 0 || n < 1 || n > kArMaxCand)
        return kern_cuda__err(err, KDS_INVALID_ARG,
                              "attn_res_mix: T=%d n_blocks=%d%s: need T >= 0 and 1..%d candidates",
                              a->T, a->n_blocks, a->partial ? " + partial" : "", kArMaxCand);
    if (a->D < 1 || a->D > KERN_CUDA_ATTN_RES_MAX_D)
        return kern_cuda__err(err, KDS_UNSUPPORTED, "attn_res_mix: D=%d (supported 1..%d)", a->D,
                              KERN_CUDA_ATTN_RES_MAX_D);
    if (a->T == 0) return KDS_OK;
    if (!a->u || !a->out || (a->n_blocks > 0 && !a->blocks))
        return kern_cuda__err(err, KDS_INVALID_ARG,
                              "attn_res_mix: NULL blocks, u or out device pointer");
    const ar_params p = {a->T,       a->D, a->n_blocks,     n,      a->blocks,
                         a->partial, a->u, a->block_stride, a->eps, a->out};
    const bool vec = a->D % 4 == 0 && a->block_stride % 4 == 0 && aligned16(a->u) &&
                     aligned16(a->out) && (a->n_blocks == 0 || aligned16(a->blocks)) &&
                     (!a->partial || aligned16(a->partial));
    const cudaStream_t st = kern_cuda__stream(stream);
    const int units = vec ? a->D / 4 : a->D;
    const int nv = (units + kArThreads - 1) / kArThreads; /* 1 .. 4 (vec), 1 .. 16 */
    if (vec) {
        if (nv <= 1)
            launch_ar<1, true>(p, st);
        else if (nv <= 2)
            launch_ar<2, true>(p, st);
        else
            launch_ar<4, true>(p, st);
    } else {
        if (nv <= 1)
            launch_ar<1, false>(p, st);
        else if (nv <= 2)
            launch_ar<2, false>(p, st);
        else if (nv <= 4)
            launch_ar<4, false>(p, st);
        else if (nv <= 8)
            launch_ar<8, false>(p, st);
        else
            launch_ar<16, false>(p, st);
    }
    return kern_cuda__status(cudaGetLastError(), err, "attn_res_mix launch");
}
