/*
 * kern_cuda_prefill.cu - host side of the chunked KDA prefill
 * (kern_cuda_kda_prefill in kern_cuda.h): argument checks, workspace
 * sizing, the passes over the sequence and their launches. Device code:
 * kda_prefill.cuh.
 */
#include <limits.h>
#include <stdint.h>

#include "kern_cuda_impl.cuh"
#include "kda_prefill.cuh"

static size_t ws_block_floats(const kern_kda_shape *sh) {
    return kda::prefill_ws_layout(sh->K, sh->V).stride;
}

extern "C" size_t kern_cuda_kda_prefill_workspace_bytes(const kern_kda_shape *sh, int chunks) {
    if (!sh || chunks < 1 || sh->HV < 1 || sh->K < 1 || sh->V < 1) return 0;
    return (size_t)chunks * (size_t)sh->HV * ws_block_floats(sh) * sizeof(float);
}

template <typename In>
static cudaError_t launch_intra(const kda::prefill_params &p, size_t smem, cudaStream_t st) {
    cudaError_t e = cudaFuncSetAttribute(kda::prefill_intra_kernel<In>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    dim3 grid((unsigned)p.n_chunks, (unsigned)p.HV);
    kda::prefill_intra_kernel<In><<<grid, kda::kIntraThreads, smem, st>>>(p);
    return cudaGetLastError();
}

template <typename In, int K>
static cudaError_t launch_intra_tc(const kda::prefill_params &p, cudaStream_t st) {
    const size_t smem = kda::intra_tc_smem_layout(K, p.V).total;
    cudaError_t e = cudaFuncSetAttribute(kda::prefill_intra_tc_kernel<In, K>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    dim3 grid((unsigned)p.n_chunks, (unsigned)p.HV);
    kda::prefill_intra_tc_kernel<In, K><<<grid, kda::kIntraThreads, smem, st>>>(p);
    return cudaGetLastError();
}

template <typename In>
static cudaError_t launch_intra_k(const kda::prefill_params &p, bool tc, size_t smem, cudaStream_t st) {
    if (!tc) return launch_intra<In>(p, smem, st);
    switch (p.K) { /* K % 16 == 0, checked */
    case 16: return launch_intra_tc<In, 16>(p, st);
    case 32: return launch_intra_tc<In, 32>(p, st);
    case 64: return launch_intra_tc<In, 64>(p, st);
    default: return launch_intra_tc<In, 128>(p, st);
    }
}

template <int K>
static cudaError_t launch_state(const kda::prefill_params &p, cudaStream_t st) {
    const size_t smem = kda::state_smem_layout(K).total_bytes;
    cudaError_t e = cudaFuncSetAttribute(kda::prefill_state_kernel<K>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    dim3 grid((unsigned)((p.V + kda::kStateBV - 1) / kda::kStateBV), (unsigned)p.HV);
    kda::prefill_state_kernel<K><<<grid, kda::kStateThreads, smem, st>>>(p);
    return cudaGetLastError();
}

template <int K>
static cudaError_t launch_state_tc(const kda::prefill_params &p, cudaStream_t st) {
    const size_t smem = kda::state_tc_smem_layout(K).total_bytes;
    cudaError_t e = cudaFuncSetAttribute(kda::prefill_state_tc_kernel<K>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    dim3 grid((unsigned)((p.V + kda::kStateBV - 1) / kda::kStateBV), (unsigned)p.HV);
    kda::prefill_state_tc_kernel<K><<<grid, kda::kStateThreads, smem, st>>>(p);
    return cudaGetLastError();
}

static cudaError_t launch_state_k(const kda::prefill_params &p, bool tc, cudaStream_t st) {
    if (tc) switch (p.K) { /* K % 16 == 0, checked */
        case 16: return launch_state_tc<16>(p, st);
        case 32: return launch_state_tc<32>(p, st);
        case 64: return launch_state_tc<64>(p, st);
        default: return launch_state_tc<128>(p, st);
        }
    switch (p.K) {
    case 8: return launch_state<8>(p, st);
    case 16: return launch_state<16>(p, st);
    case 32: return launch_state<32>(p, st);
    case 64: return launch_state<64>(p, st);
    default: return launch_state<128>(p, st);
    }
}

static size_t state_smem_bytes(int K, bool tc) {
    return tc ? kda::state_tc_smem_layout(K).total_bytes : kda::state_smem_layout(K).total_bytes;
}

static bool aligned16(const void *p) {
    return ((uintptr_t)p & 15u) == 0;
}

extern "C" kds_status kern_cuda_kda_prefill(const kern_cuda_kda_prefill_args *a, void *stream,
                                            kds_err *err) {
    if (!a) return kern_cuda__err(err, KDS_INVALID_ARG, "kda prefill: NULL arguments");
    const kern_kda_shape *sh = &a->shape;
    if (a->T < 0 || sh->H < 1 || sh->HV < 1 || sh->HV % sh->H != 0)
        return kern_cuda__err(err, KDS_INVALID_ARG,
                              "kda prefill: bad shape T=%d H=%d HV=%d (need T >= 0, HV %% H == 0)",
                              a->T, sh->H, sh->HV);
    if (sh->K != 8 && sh->K != 16 && sh->K != 32 && sh->K != 64 && sh->K != 128)
        return kern_cuda__err(err, KDS_UNSUPPORTED, "kda prefill: K=%d (compiled: 8, 16, 32, 64, 128)",
                              sh->K);
    if (sh->V < 4 || sh->V > kda::kPrefillMaxV || sh->V % 4 != 0)
        return kern_cuda__err(err, KDS_UNSUPPORTED,
                              "kda prefill: V=%d (need a multiple of 4 in [4, %d])", sh->V,
                              kda::kPrefillMaxV);
    if (a->in_dtype != KERN_F32 && a->in_dtype != KERN_BF16)
        return kern_cuda__err(err, KDS_INVALID_ARG, "kda prefill: input dtype %d (need F32 or BF16)",
                              (int)a->in_dtype);
    if (a->tensor_cores && sh->K % 16 != 0)
        return kern_cuda__err(err, KDS_UNSUPPORTED,
                              "kda prefill: tensor cores need K %% 16 == 0 (K=%d)", sh->K);
    if (a->T == 0) return KDS_OK;
    if (!a->q || !a->k || !a->v || !a->g || !a->beta || !a->state || !a->o || !a->workspace ||
        (a->raw && !a->A_log))
        return kern_cuda__err(err, KDS_INVALID_ARG, "kda prefill: NULL device pointer");
    if (!aligned16(a->workspace) || !aligned16(a->state))
        return kern_cuda__err(err, KDS_INVALID_ARG,
                              "kda prefill: workspace and state need 16-byte alignment");
    const size_t per_chunk = kern_cuda_kda_prefill_workspace_bytes(sh, 1);
    const long long n_chunks = ((long long)a->T + kda::kChunk - 1) / kda::kChunk;
    long long per_pass = (long long)(a->workspace_bytes / per_chunk);
    if (per_pass < 1)
        return kern_cuda__err(err, KDS_INVALID_ARG,
                              "kda prefill: workspace of %zu bytes is below one chunk (%zu bytes)",
                              a->workspace_bytes, per_chunk);
    if (per_pass > 65535) per_pass = 65535; /* grid.x of the intra kernel stays an int */

    /* The intra kernel's shared memory must fit the device (227 KiB on
     * H100/H200, 163 KiB on A100: K = V = 128 needs ~186 KiB in fp32, ~111 KiB
     * on tensor cores). */
    const size_t smem_intra = a->tensor_cores ? kda::intra_tc_smem_layout(sh->K, sh->V).total
                                              : kda::intra_smem_layout(sh->K, sh->V).total;
    int dev = 0, optin = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e != cudaSuccess) return kern_cuda__status(e, err, "kda prefill: device query");
    const size_t smem_state = state_smem_bytes(sh->K, a->tensor_cores);
    const size_t smem_max = smem_intra > smem_state ? smem_intra : smem_state;
    if ((size_t)optin < smem_max)
        return kern_cuda__err(err, KDS_UNSUPPORTED,
                              "kda prefill: K=%d V=%d needs %zu bytes of shared memory per block, "
                              "the device allows %d",
                              sh->K, sh->V, smem_max, optin);

    kda::prefill_params p;
    p.q = a->q;
    p.k = a->k;
    p.v = a->v;
    p.g = a->g;
    p.beta = a->beta;
    p.A_log = a->A_log;
    p.dt_bias = a->dt_bias;
    p.lower_bound = a->lower_bound;
    p.scale = sh->scale;
    p.raw = a->raw ? 1 : 0;
    p.T = a->T;
    p.H = sh->H;
    p.HV = sh->HV;
    p.K = sh->K;
    p.V = sh->V;
    p.ws = static_cast<float *>(a->workspace);
    p.ws_stride = ws_block_floats(sh);
    p.state = a->state;
    p.o = a->o;

    const cudaStream_t st = kern_cuda__stream(stream);
    const bool bf16 = a->in_dtype == KERN_BF16;
    cudaEvent_t ev[3] = {NULL, NULL, NULL};
    if (a->profile)
        for (int i = 0; i < 3 && e == cudaSuccess; i++) e = cudaEventCreate(&ev[i]);
    for (long long c0 = 0; c0 < n_chunks && e == cudaSuccess; c0 += per_pass) {
        p.c0 = (int)c0;
        p.n_chunks = (int)(n_chunks - c0 < per_pass ? n_chunks - c0 : per_pass);
        if (a->profile) e = cudaEventRecord(ev[0], st);
        if (e == cudaSuccess)
            e = bf16 ? launch_intra_k<kda::in_bf16>(p, a->tensor_cores, smem_intra, st)
                     : launch_intra_k<kda::in_f32>(p, a->tensor_cores, smem_intra, st);
        if (a->profile && e == cudaSuccess) e = cudaEventRecord(ev[1], st);
        if (e == cudaSuccess) e = launch_state_k(p, a->tensor_cores, st);
        if (a->profile && e == cudaSuccess) {
            float t1 = 0.0f, t2 = 0.0f;
            e = cudaEventRecord(ev[2], st);
            if (e == cudaSuccess) e = cudaEventSynchronize(ev[2]);
            if (e == cudaSuccess) e = cudaEventElapsedTime(&t1, ev[0], ev[1]);
            if (e == cudaSuccess) e = cudaEventElapsedTime(&t2, ev[1], ev[2]);
            a->profile->intra_ms += t1;
            a->profile->state_ms += t2;
            a->profile->passes++;
        }
    }
    for (int i = 0; i < 3; i++)
        if (ev[i]) (void)cudaEventDestroy(ev[i]);
    return kern_cuda__status(e, err, "kda prefill: launch");
}
