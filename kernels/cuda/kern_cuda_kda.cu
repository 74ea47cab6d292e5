/*
 * kern_cuda_kda.cu - host side of the KDA CUDA kernels (kern_cuda.h):
 * argument checks, launch geometry, dispatch over K and the input dtype.
 * Device code: kda_kernels.cuh. Design notes: README.md.
 */
#include <limits.h>
#include <stdint.h>

#include "kern_cuda_impl.cuh"
#include "kda_kernels.cuh"

cudaError_t kern_cuda__probe_kernels(void) {
    cudaFuncAttributes fa;
    return cudaFuncGetAttributes(&fa, kda::decode_kernel<128, kda::in_bf16>);
}

static bool aligned(const void *p, uintptr_t a) {
    return ((uintptr_t)p & (a - 1)) == 0;
}

template <int K, typename In>
static cudaError_t launch_decode(const kda::decode_params &p, unsigned blocks, cudaStream_t st) {
    kda::decode_kernel<K, In><<<blocks, kda::kDecodeThreads, 0, st>>>(p);
    return cudaGetLastError();
}

extern "C" kds_status kern_cuda_kda_decode(const kern_cuda_kda_decode_args *a, void *stream,
                                           kds_err *err) {
    if (!a) return kern_cuda__err(err, KDS_INVALID_ARG, "kda decode: NULL arguments");
    const kern_kda_shape *sh = &a->shape;
    if (a->N < 0 || sh->H < 1 || sh->HV < 1 || sh->HV % sh->H != 0 || a->pool_slots < 0)
        return kern_cuda__err(err, KDS_INVALID_ARG,
                           "kda decode: bad shape N=%d H=%d HV=%d pool_slots=%d (need N >= 0, "
                           "HV %% H == 0, pool_slots >= 0)",
                           a->N, sh->H, sh->HV, a->pool_slots);
    if (sh->K != 64 && sh->K != 128)
        return kern_cuda__err(err, KDS_UNSUPPORTED, "kda decode: K=%d (compiled: 64, 128)", sh->K);
    if (sh->V < kda::kDecodeBV || sh->V % kda::kDecodeBV != 0)
        return kern_cuda__err(err, KDS_UNSUPPORTED, "kda decode: V=%d is not a multiple of %d",
                           sh->V, kda::kDecodeBV);
    if (a->in_dtype != KERN_F32 && a->in_dtype != KERN_BF16)
        return kern_cuda__err(err, KDS_INVALID_ARG, "kda decode: input dtype %d (need F32 or BF16)",
                           (int)a->in_dtype);
    if (a->N == 0) return KDS_OK;
    if (!a->q || !a->k || !a->v || !a->g_raw || !a->beta_raw || !a->A_log || !a->slots || !a->o ||
        (!a->state_pool && a->pool_slots > 0))
        return kern_cuda__err(err, KDS_INVALID_ARG, "kda decode: NULL device pointer");
    const uintptr_t v_align = a->in_dtype == KERN_F32 ? 16 : 8;
    if (!aligned(a->state_pool, 16) || !aligned(a->o, 16) || !aligned(a->v, v_align))
        return kern_cuda__err(err, KDS_INVALID_ARG,
                           "kda decode: misaligned buffer (state_pool and o need 16 bytes, v %u)",
                           (unsigned)v_align);

    const long long n_vtiles = sh->V / kda::kDecodeBV;
    const long long blocks = (long long)a->N * sh->HV * n_vtiles;
    if (blocks > INT_MAX)
        return kern_cuda__err(err, KDS_UNSUPPORTED, "kda decode: grid of %lld CTAs is too large",
                           blocks);

    kda::decode_params p;
    p.q = a->q;
    p.k = a->k;
    p.v = a->v;
    p.g_raw = a->g_raw;
    p.beta_raw = a->beta_raw;
    p.A_log = a->A_log;
    p.dt_bias = a->dt_bias;
    p.lower_bound = a->lower_bound;
    p.scale = sh->scale;
    p.pool = a->state_pool;
    p.slots = a->slots;
    p.o = a->o;
    p.pool_slots = a->pool_slots;
    p.H = sh->H;
    p.HV = sh->HV;
    p.V = sh->V;
    p.n_vtiles = (int)n_vtiles;

    const cudaStream_t st = kern_cuda__stream(stream);
    const unsigned nb = (unsigned)blocks;
    const bool bf16 = a->in_dtype == KERN_BF16;
    cudaError_t e;
    /* Compiled: K in {64, 128} x {fp32, bf16} inputs. Any K % 16 == 0 works
     * with the thread layout of kda_kernels.cuh: add a case here to get it. */
    if (sh->K == 64)
        e = bf16 ? launch_decode<64, kda::in_bf16>(p, nb, st) : launch_decode<64, kda::in_f32>(p, nb, st);
    else
        e = bf16 ? launch_decode<128, kda::in_bf16>(p, nb, st)
                 : launch_decode<128, kda::in_f32>(p, nb, st);
    return kern_cuda__status(e, err, "kda decode launch");
}

extern "C" size_t kern_cuda_kda_decode_bytes(const kern_cuda_kda_decode_args *a) {
    if (!a || a->N <= 0) return 0;
    const kern_kda_shape *sh = &a->shape;
    const size_t N = (size_t)a->N, H = (size_t)sh->H, HV = (size_t)sh->HV;
    const size_t K = (size_t)sh->K, V = (size_t)sh->V;
    const size_t es = a->in_dtype == KERN_F32 ? 4 : 2;
    size_t b = 2 * N * HV * K * V * sizeof(float);    /* state in + out */
    b += N * (2 * H * K + HV * V + HV * K + HV) * es; /* q, k, v, g_raw, beta_raw */
    b += N * HV * V * sizeof(float);                  /* o */
    b += N * sizeof(int32_t) + HV * (K + 1) * sizeof(float);
    return b;
}

extern "C" kds_status kern_cuda_l2norm(float *x, int n_vecs, int dim, float eps, void *stream,
                                       kds_err *err) {
    if (n_vecs < 0 || (n_vecs > 0 && (dim < 1 || !x)))
        return kern_cuda__err(err, KDS_INVALID_ARG, "l2norm: n_vecs=%d dim=%d x=%p", n_vecs, dim,
                           (void *)x);
    if (n_vecs == 0) return KDS_OK;
    const int threads = 256; /* 8 vectors per CTA, one warp each */
    const unsigned blocks = (unsigned)((n_vecs + threads / 32 - 1) / (threads / 32));
    kda::l2norm_kernel<<<blocks, threads, 0, kern_cuda__stream(stream)>>>(x, n_vecs, dim, eps);
    return kern_cuda__status(cudaGetLastError(), err, "l2norm launch");
}

extern "C" kds_status kern_cuda_kda_gate(const float *g_raw, const float *A_log,
                                         const float *dt_bias, int T, int HV, int K,
                                         float lower_bound, float *g, void *stream,
                                         kds_err *err) {
    if (T < 0 || HV < 1 || K < 1 || (T > 0 && (!g_raw || !A_log || !g)))
        return kern_cuda__err(err, KDS_INVALID_ARG, "kda gate: T=%d HV=%d K=%d or NULL pointer", T,
                           HV, K);
    const size_t n = (size_t)T * (size_t)HV * (size_t)K;
    if (n == 0) return KDS_OK;
    const int threads = 256;
    size_t want = (n + threads - 1) / threads;
    const unsigned blocks = (unsigned)(want < 65536 ? want : 65536); /* grid-stride beyond */
    kda::gate_kernel<<<blocks, threads, 0, kern_cuda__stream(stream)>>>(g_raw, A_log, dt_bias, n,
                                                                       HV, K, lower_bound, g);
    return kern_cuda__status(cudaGetLastError(), err, "kda gate launch");
}
