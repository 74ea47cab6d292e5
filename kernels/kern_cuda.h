/*
 * kern_cuda.h - the CUDA kernels of kdaserve (kernels/cuda/), behind plain C
 * contracts that mirror the CPU reference ones in kern.h.
 *
 * Built only when nvcc is found (CMake defines KDS_HAVE_CUDA=1 for users of
 * kds_kernels); without it, this header is still valid C but nothing
 * implements it, so callers guard their use with #ifdef KDS_HAVE_CUDA.
 *
 * Contract for every function here:
 *   - No CUDA type leaks: device pointers are `void *` / `float *` that point
 *     into device memory (from kern_cuda_malloc or any cudaMalloc), and a
 *     stream is an opaque `void *` that is really a cudaStream_t; NULL means
 *     the legacy default stream.
 *   - Everything runs on the calling host thread's current CUDA device
 *     (cudaSetDevice is the caller's business).
 *   - Kernel launches are asynchronous on `stream`: a KDS_OK return means the
 *     launch was accepted, not that the kernel finished or succeeded. Errors
 *     that happen while a kernel runs surface at the next synchronising call
 *     (kern_cuda_sync, a d2h copy, ...), as the CUDA runtime reports them.
 *   - Errors are kds_status: KDS_CUDA with cudaGetErrorString's text in the
 *     optional kds_err, KDS_INVALID_ARG for bad shapes, NULL pointers or
 *     misaligned buffers (checked on the host before any launch, so nothing
 *     is touched), KDS_UNSUPPORTED for shapes that have no compiled kernel.
 *   - Numerics: all arithmetic in fp32 with IEEE expf/log1pf (no fast-math),
 *     recurrent states are fp32. Results match the CPU kernels of kern.h up to
 *     summation order (relative error ~1e-6 of the magnitude, not bitwise).
 *   - Ownership: the caller owns every buffer; the kernels allocate nothing,
 *     keep no pointer after they return, and may be called from several host
 *     threads on different streams (they share no mutable globals).
 */
#ifndef KERN_CUDA_H
#define KERN_CUDA_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* kds_status.h and kern.h have no C++ guards of their own: include them
 * with C linkage so that the .cu files (C++) link against the C objects. */
#ifdef __cplusplus
extern "C" {
#endif

#include "kds_status.h"
#include "kern.h"

/* ------------------------------------------------------------------------ */
/* Device, memory, streams                                                   */

/*
 * True iff a CUDA device is present, the driver works, and this build's
 * kernels have an image for the current device (sm_80 family natively,
 * sm_90a natively, newer archs through the compute_80 PTX). Otherwise false,
 * with the reason in `err` (status KDS_CUDA or KDS_UNSUPPORTED). Safe to call
 * on a machine with no GPU or no driver: it never aborts. Cheap enough to
 * call once per test or at start-up, not per token.
 */
bool kern_cuda_available(kds_err *err);

/* Allocate `bytes` of device memory (256-byte aligned) into *dptr; bytes == 0
 * gives *dptr = NULL and KDS_OK. Errors: KDS_INVALID_ARG (dptr NULL),
 * KDS_NOMEM (device out of memory), KDS_CUDA. On error *dptr = NULL.
 * Free with kern_cuda_free. */
kds_status kern_cuda_malloc(void **dptr, size_t bytes, kds_err *err);
/* Free memory from kern_cuda_malloc. NULL is a no-op. Synchronises the
 * device implicitly (cudaFree semantics): not for the hot path. */
void kern_cuda_free(void *dptr);

/* Copies of `bytes` between host memory and device memory, ordered on
 * `stream`. With a pageable host buffer the call returns once the source
 * is consumed (h2d) or the data has landed (d2h); with pinned memory it may
 * return earlier, and the caller must kern_cuda_sync before touching the
 * host buffer. Errors: KDS_INVALID_ARG (NULL with bytes > 0), KDS_CUDA. */
kds_status kern_cuda_memcpy_h2d(void *dst_dev, const void *src_host, size_t bytes, void *stream,
                                kds_err *err);
kds_status kern_cuda_memcpy_d2h(void *dst_host, const void *src_dev, size_t bytes, void *stream,
                                kds_err *err);
/* Device-to-device copy and byte fill, ordered on `stream`. */
kds_status kern_cuda_memcpy_d2d(void *dst_dev, const void *src_dev, size_t bytes, void *stream,
                                kds_err *err);
kds_status kern_cuda_memset(void *dst_dev, int byte, size_t bytes, void *stream, kds_err *err);

/* A stream of our own (non-blocking: not ordered with the legacy default stream),
 * for work that is captured into graphs. Errors: KDS_CUDA. */
kds_status kern_cuda_stream_create(void **stream, kds_err *err);
void kern_cuda_stream_free(void *stream); /* NULL: no-op */

/*
 * CUDA graphs: kern_cuda_graph_begin starts capturing what is queued on
 * `stream` (relaxed mode: nothing runs; kernels, copies from pinned memory
 * and cuBLAS calls are recorded); kern_cuda_graph_end stops and
 * instantiates it into *exec (on any failure the capture is ended and
 * discarded, *exec = NULL); kern_cuda_graph_launch replays it on `stream`.
 * A replay reads device buffers and pinned host buffers at replay time, so
 * a graph is reused by changing their contents, never the kernel
 * arguments. KDS_UNSUPPORTED where capture is not available (the CPU
 * emulation): callers launch directly. Errors: KDS_CUDA.
 */
kds_status kern_cuda_graph_begin(void *stream, kds_err *err);
kds_status kern_cuda_graph_end(void *stream, void **exec, kds_err *err);
kds_status kern_cuda_graph_launch(void *exec, void *stream, kds_err *err);
void kern_cuda_graph_free(void *exec); /* NULL: no-op */

/* Wait until all work queued on `stream` (NULL: the whole device) finished.
 * Returns the first pending asynchronous error as KDS_CUDA. */
kds_status kern_cuda_sync(void *stream, kds_err *err);

/* Fill n elements of dst (dt F32 or BF16) with uniform values in [lo, hi),
 * reproducible: element i depends only on (seed, i). For tests and
 * benchmarks too large to fill from the host. Errors: KDS_INVALID_ARG,
 * KDS_CUDA. */
kds_status kern_cuda_fill_uniform(void *dst, kern_dtype dt, size_t n, float lo, float hi,
                                  uint64_t seed, void *stream, kds_err *err);

/* Fill n elements of dst (F32 or BF16) with kern_gen_normal(key, i, sd)
 * for i < n: a generated model's matrix made on the GPU, equal bit for bit
 * to what eng_genmodel writes (bf16: round to nearest even, as
 * kern_f32_to_bf16). Errors: KDS_INVALID_ARG, KDS_CUDA. */
kds_status kern_cuda_gen_normal(void *dst, kern_dtype dt, size_t n, uint64_t key, float sd,
                                void *stream, kds_err *err);

/* A generated model's block-format weight [rows, cols] (dt MXFP4 or Q8_0,
 * cols a multiple of 32) made on the GPU: its plain values
 * kern_gen_normal(key, r * cols + c, sd), quantised row by row as
 * kern_quantize_row(dt, ...) does, equal bit for bit to what eng_genmodel
 * writes (NAME_packed / NAME and NAME_scale). Layout as kern_weight_layout:
 * row r's codes at codes + r * row_bytes (MXFP4: cols / 2 bytes, two E2M1
 * codes a byte, the even column in the low nibble; Q8_0: cols int8), its
 * scales at scales + r * scale_row_bytes (MXFP4: cols / 32 E8M0 bytes;
 * Q8_0: cols / 32 little-endian f16), both device buffers of any alignment
 * (16-byte aligned codes are written 16 bytes at a time). rows * cols == 0
 * does nothing. Errors: KDS_INVALID_ARG (dtype, shape, NULL pointer),
 * KDS_CUDA. */
kds_status kern_cuda_gen_quant(void *codes, void *scales, kern_dtype dt, int64_t rows,
                               int64_t cols, uint64_t key, float sd, void *stream, kds_err *err);

/* x[t, :] = float(table[ids[t], :]) for t < T: the embedding lookup. table
 * [vocab, hidden] in dt (F32 or BF16), ids [T] int32 and x [T, hidden] fp32
 * on the device. Ids are the caller's to check (the engine checks them on
 * the host); one outside [0, vocab) gives a zero row. Errors:
 * KDS_INVALID_ARG, KDS_CUDA. */
kds_status kern_cuda_embed(const void *table, kern_dtype dt, int vocab, int hidden,
                           const int32_t *ids, int T, float *x, void *stream, kds_err *err);

/* dst[idx[i]] = src[i] for rows i < n of `row_bytes` bytes (a multiple of
 * 16; src, dst 16-byte aligned): rows of a batch back to their sequences'
 * slots. idx on the device; an index below 0 skips its row. The indices
 * must be distinct. Errors: KDS_INVALID_ARG, KDS_CUDA. */
kds_status kern_cuda_rows_scatter(const void *src, size_t row_bytes, const int32_t *idx, int n,
                                  void *dst, void *stream, kds_err *err);

/* ------------------------------------------------------------------------ */
/* Element kernels (same semantics as kern.h; all pointers are device ones)  */

/* x /= sqrt(sum(x^2) + eps), in place, over `n_vecs` fp32 vectors of length
 * `dim` (kern_l2norm). Errors: KDS_INVALID_ARG (n_vecs < 0, dim < 1 with
 * n_vecs > 0, x NULL), KDS_CUDA. */
kds_status kern_cuda_l2norm(float *x, int n_vecs, int dim, float eps, void *stream,
                            kds_err *err);

/* The KDA decay gate of kern_kda_gate, fp32, g_raw/g: [T, HV, K], A_log:
 * [HV], dt_bias: [HV*K] or NULL; g may alias g_raw. lower_bound >= 0 selects
 * the softplus form (Kimi-Linear-48B), < 0 the lower-bound form. Errors:
 * KDS_INVALID_ARG, KDS_CUDA. */
kds_status kern_cuda_kda_gate(const float *g_raw, const float *A_log, const float *dt_bias,
                              int T, int HV, int K, float lower_bound, float *g, void *stream,
                              kds_err *err);

/* ------------------------------------------------------------------------ */
/* Kimi K3's operators (kern_cuda_k3.cu; CPU: kernels/cpu/k3.c)              */

/*
 * SiTU (kern_situ, reference/kimi-k3.md §4.6), in place into a, n fp32
 * device values:
 *   a[i] = [beta tanh(a[i] / beta) sigmoid(a[i])] * [beta_l tanh(b[i] / beta_l)]
 * (K3: beta 4, beta_l 25), and MLA's output gate (kern_sigmoid_mul, §4.4):
 *   x[i] *= sigmoid(g[i])
 * fp32 with tanhf, expf and the CPU's order of operations, sigmoid =
 * 1 / (1 + expf(-x)); the CPU's sigmoid uses its own exp (within 1 ulp), so
 * the two agree to a few ulp per element (tested: |gpu - cpu| <= 4e-6 |cpu|
 * + 1e-6 max|cpu|). a and b (x and g) may not overlap unless equal. 16-byte
 * aligned buffers take 16-byte loads, others element loads.
 * Errors: KDS_INVALID_ARG (NULL with n > 0; beta or beta_l not a positive
 * finite number), KDS_CUDA.
 */
kds_status kern_cuda_situ(float *a, const float *b, size_t n, float beta, float beta_l,
                          void *stream, kds_err *err);
kds_status kern_cuda_sigmoid_mul(float *x, const float *g, size_t n, void *stream, kds_err *err);

/*
 * Block Attention Residuals' depth mix (kern_attn_res_mix, kimi-k3.md §4.2),
 * per token t of T, over the candidates c_0..c_{n-1}: the n_blocks frozen
 * snapshots (snapshot j's row t at blocks + j * block_stride + t * D) and,
 * when `partial` is not NULL, the running partial (row t at partial + t * D):
 *   z_j    = (sum_d c_j[d] u[d]) / sqrt(mean_d c_j[d]^2 + eps)
 *   out[t] = sum_j softmax(z)_j c_j              (the raw candidates)
 * Device pointers, fp32: blocks (NULL when n_blocks == 0), partial [T, D] or
 * NULL, u [D] (res_norm weight times res_proj, fused once), out [T, D], which
 * may not alias a candidate. block_stride is in floats (>= T * D for
 * snapshots that do not overlap; not checked).
 * One CTA of 512 threads per token reads every candidate once (the group of
 * candidates being scored stays in registers while its weights are found,
 * online softmax across groups). Numerics: per-thread and warp sums in fp32,
 * the sum over warps, z and the softmax in double, the mix in fp32: within
 * ~1e-6 of the largest |out| of the CPU's (double sums, then an f32 mix).
 * Shapes: 1 <= n_blocks + (partial != NULL) <= 64 (K3: 9), 1 <= D <= 8192
 * (K3: 7168), T >= 0 (0 is a no-op). 16-byte loads when D % 4 == 0,
 * block_stride % 4 == 0 and every pointer is 16-byte aligned.
 * Errors: KDS_INVALID_ARG (NULL, T < 0, candidates outside 1..64),
 * KDS_UNSUPPORTED (D outside 1..8192), KDS_CUDA.
 */
#define KERN_CUDA_ATTN_RES_MAX_D 8192

typedef struct kern_cuda_attn_res_args {
    int T, D;
    const float *blocks;
    size_t block_stride; /* floats from one snapshot to the next */
    int n_blocks;
    const float *partial;
    const float *u;
    float eps;
    float *out;
} kern_cuda_attn_res_args;

kds_status kern_cuda_attn_res_mix(const kern_cuda_attn_res_args *a, void *stream, kds_err *err);

/* ------------------------------------------------------------------------ */
/* Fused KDA decode step                                                     */

/*
 * One decode token for each of N sequences of one KDA layer, everything that
 * follows the short convolution fused in one kernel:
 *   per sequence n and value head hv (h = hv / (HV / H), GVA):
 *     qn = q[n,h] / sqrt(|q[n,h]|^2 + 1e-6),  kn likewise     (kern_l2norm)
 *     g  = gate(g_raw[n,hv], A_log[hv], dt_bias[hv*K..])      (kern_kda_gate)
 *     b  = sigmoid(beta_raw[n,hv])                            (kern_sigmoid)
 *     S  = pool[slots[n], hv]   (fp32 [K, V], row = key dim, fla's layout)
 *     S  = diag(exp(g)) S ;  S += b * kn (v[n,hv] - S^T kn)^T
 *     o[n,hv] = S^T (scale * qn) ;  pool[slots[n], hv] = S
 * i.e. exactly kern_kda_recurrent with T = 1 on normalised, gated inputs.
 *
 * All pointers are device pointers:
 *   q, k      [N, H, K]   in_dtype (KERN_F32 or KERN_BF16), raw (post conv)
 *   v         [N, HV, V]  in_dtype
 *   g_raw     [N, HV, K]  in_dtype, before the gate
 *   beta_raw  [N, HV]     in_dtype, logits (before the sigmoid)
 *   A_log     [HV]        fp32
 *   dt_bias   [HV * K]    fp32, or NULL (no bias)
 *   state_pool[pool_slots, HV, K, V] fp32, read and written in place
 *   slots     [N]         int32: sequence n uses pool slot slots[n]. A slot
 *                         outside [0, pool_slots) (e.g. -1 for padding)
 *                         skips the sequence: its state is not touched and
 *                         its o rows are set to 0. Two sequences must not
 *                         name the same slot in one call (they would race).
 *   o         [N, HV, V]  fp32 output
 * Pool slots not named in `slots` are never read or written.
 *
 * Shapes supported: K in {64, 128}, V a multiple of 32, HV % H == 0,
 * N >= 0 (N == 0 is a no-op). Alignment: state_pool and o 16 bytes, v 16
 * bytes (fp32) or 8 bytes (bf16); cudaMalloc'd bases always qualify.
 * Nothing may alias o or state_pool.
 *
 * Errors (checked before launching; nothing is touched): KDS_INVALID_ARG
 * (NULL pointer, N < 0, H < 1, HV % H != 0, pool_slots < 0, misalignment,
 * in_dtype not F32/BF16), KDS_UNSUPPORTED (K or V not supported), KDS_CUDA
 * (launch failure).
 */
typedef struct kern_cuda_kda_decode_args {
    kern_kda_shape shape; /* H, HV, K, V, scale */
    int N;                /* sequences in this step */
    kern_dtype in_dtype;  /* dtype of q, k, v, g_raw, beta_raw */
    const void *q, *k, *v, *g_raw, *beta_raw;
    const float *A_log, *dt_bias;
    float lower_bound;    /* >= 0: softplus gate (Kimi); < 0: lower-bound gate */
    float *state_pool;
    int pool_slots;
    const int32_t *slots;
    float *o;
} kern_cuda_kda_decode_args;

kds_status kern_cuda_kda_decode(const kern_cuda_kda_decode_args *a, void *stream, kds_err *err);

/* Bytes of HBM traffic one kern_cuda_kda_decode call moves (state read and
 * written once plus the inputs and o), for bandwidth reporting. Counts
 * every sequence, padding included. */
size_t kern_cuda_kda_decode_bytes(const kern_cuda_kda_decode_args *a);

/* ------------------------------------------------------------------------ */
/* Chunked KDA prefill                                                       */

/*
 * The chunked (WY / UT) form of the delta rule for the T tokens of ONE
 * sequence, all value heads, chunks of 64 tokens (kda-model-spec.md §4.1):
 * the same result as kern_kda_chunked(sh, T, 64, ...) over [0, HV), up to
 * summation order, with the state carried in and out.
 *
 * Two input conventions:
 *   raw == false (kern_kda_chunked's contract): q, k already L2-normalised,
 *     g the log-decay (fp32), beta after the sigmoid (fp32);
 *   raw == true (the decode kernel's contract): q, k raw (post conv),
 *     normalised in the kernel (eps 1e-6); g = g_raw (in_dtype) gated in the
 *     kernel with A_log, dt_bias, lower_bound exactly as kern_kda_gate;
 *     beta = beta_raw (in_dtype), sigmoided in the kernel.
 * All pointers are device pointers:
 *   q, k     [T, H, K]   in_dtype (KERN_F32 or KERN_BF16)
 *   v        [T, HV, V]  in_dtype
 *   g        [T, HV, K]  fp32 (raw == false) or in_dtype (raw == true)
 *   beta     [T, HV]     fp32 (raw == false) or in_dtype (raw == true)
 *   A_log    [HV] fp32, dt_bias [HV * K] fp32 or NULL: raw only
 *   state    [HV, K, V]  fp32, read and written in place (16-byte aligned)
 *   o        [T, HV, V]  fp32 output
 *   workspace  caller-owned device scratch of workspace_bytes (16-byte
 *              aligned): kern_cuda_kda_prefill_workspace_bytes(sh, n) holds
 *              n chunks; the sequence is processed in passes of as many
 *              chunks as fit (at least one), so a small workspace costs
 *              launches, not correctness. ~4.6 MiB per chunk at Kimi's shape
 *              (HV = 32, K = V = 128); 64 chunks (~300 MiB) keep the GPU busy.
 * Nothing may alias o, state or workspace.
 *
 * Shapes supported: K in {8, 16, 32, 64, 128}, V a multiple of 4 up to 128,
 * HV % H == 0, T >= 0 (0 is a no-op). Needs ~186 KiB of shared memory per
 * block at K = V = 128 (~196 KiB with tensor cores, for the state pass; fits
 * H100/H200; A100 gets KDS_UNSUPPORTED there).
 *
 * Numerics: fp32 arithmetic (CUDA cores), cumulative log-decays in double,
 * every exponent <= 0 (see kda_prefill.cuh); agrees with kern_kda_chunked
 * to ~1e-6 of the largest magnitude. tensor_cores = true runs the products
 * of both kernels (the intra-chunk one and the sequential state pass) on
 * tensor cores (bf16 operands split in hi + lo, three products each, fp32
 * accumulation: ~1e-5 of the largest magnitude); K must then be a multiple
 * of 16.
 *
 * Errors (checked before launching; nothing is touched): KDS_INVALID_ARG
 * (NULL pointer, bad shape, dtype, misalignment, workspace below one
 * chunk), KDS_UNSUPPORTED (K, V or shared memory), KDS_CUDA (launch).
 */
typedef struct kern_cuda_kda_prefill_args {
    kern_kda_shape shape; /* H, HV, K, V, scale */
    int T;                /* tokens */
    kern_dtype in_dtype;  /* dtype of q, k, v (and of g, beta when raw) */
    bool raw;             /* see above */
    const void *q, *k, *v, *g, *beta;
    const float *A_log, *dt_bias; /* raw only */
    float lower_bound;            /* raw only: >= 0 softplus gate, < 0 lower-bound gate */
    float *state;
    float *o;
    void *workspace;
    size_t workspace_bytes;
    bool tensor_cores; /* both kernels on tensor cores (bf16 x 3 split); default false */
    /* NULL, or: time the two kernels of every pass with events and add the
     * times here (synchronises the stream after each pass: for benchmarks,
     * not for serving). */
    struct kern_cuda_prefill_profile *profile;
} kern_cuda_kda_prefill_args;

/* Where kern_cuda_kda_prefill's time goes (added to by each profiled call). */
typedef struct kern_cuda_prefill_profile {
    double intra_ms; /* intra-chunk kernels */
    double state_ms; /* state passes */
    int passes;
} kern_cuda_prefill_profile;

kds_status kern_cuda_kda_prefill(const kern_cuda_kda_prefill_args *a, void *stream, kds_err *err);

/* Workspace bytes that hold `chunks` chunks of 64 tokens for shape `sh`
 * (0 for a bad shape or chunks < 1). */
size_t kern_cuda_kda_prefill_workspace_bytes(const kern_kda_shape *sh, int chunks);

/* ------------------------------------------------------------------------ */
/* RMSNorm and the gated output RMSNorm                                      */

/*
 * Per row of n values (one warp per row):
 *   z == NULL: y = x * rsqrt(mean(x^2) + eps) * w                (kern_rmsnorm)
 *   z != NULL: y = x * rsqrt(mean(x^2) + eps) * w * sigmoid(z)   (kern_rmsnorm_gated,
 *              the KDA output norm with rows = T * HV, n = V)
 * Device pointers: x [rows, n] fp32; z [rows, n] z_dtype or NULL; w [n]
 * w_dtype or NULL (no weight); y [rows, n] y_dtype. Dtypes F32 or BF16 (bf16
 * output rounds to nearest even). y may alias x when y is fp32; nothing may
 * alias z. Errors: KDS_INVALID_ARG (shape, dtype, NULL, aliasing), KDS_CUDA.
 */
typedef struct kern_cuda_norm_args {
    int rows, n;
    float eps;
    const float *x;
    const void *z;
    kern_dtype z_dtype;
    const void *w;
    kern_dtype w_dtype;
    void *y;
    kern_dtype y_dtype;
} kern_cuda_norm_args;

kds_status kern_cuda_rmsnorm(const kern_cuda_norm_args *a, void *stream, kds_err *err);

/* ------------------------------------------------------------------------ */
/* MoE routing and token permutation                                         */

/*
 * Routing of T tokens and the permutation for grouped expert products, the
 * contracts of kern_moe_route + kern_moe_permute (kern.h) in one call
 * (four launches: route, count, scan, place):
 *   scores    = sigmoid(logits) (1 / (1 + expf(-x))) when apply_sigmoid,
 *               else the logits are taken as the scores;
 *   sel, w    [T, k]: experts chosen by score + bias within the group limit,
 *               ties to the lower expert index; weights from the unbiased
 *               scores (renormalised in double), times routed_scaling_factor;
 *   exp_off   [E + 1], row_of [T, k], tok_of [T * k]: the stable counting
 *               sort of the (token, slot) pairs by expert.
 * Device pointers: logits [T, E] fp32, bias [E] fp32 or NULL, the outputs
 * int32 / fp32 as listed. Deterministic: the same inputs give the same
 * outputs bit for bit, equal to the CPU reference's (sel, exp_off, row_of,
 * tok_of exactly; w exactly for identical scores). NaN scores: unspecified.
 * Limits: E <= 1024, k <= min(E, 32), E % n_group == 0, n_group <= 256.
 * Errors: KDS_INVALID_ARG (shape, NULL), KDS_UNSUPPORTED (limits), KDS_CUDA.
 */
typedef struct kern_cuda_moe_route_args {
    kern_moe_route_params p;
    int T;
    const float *logits;
    bool apply_sigmoid;
    const float *bias;
    int32_t *sel;
    float *w;
    int32_t *exp_off;
    int32_t *row_of;
    int32_t *tok_of;
} kern_cuda_moe_route_args;

kds_status kern_cuda_moe_route(const kern_cuda_moe_route_args *a, void *stream, kds_err *err);

/* Gather rows for the expert products: dst[r] = src[tok_of[r]] for
 * r < n_rows, rows of row_bytes bytes (a multiple of 16; any dtype).
 * Device pointers, 16-byte aligned. Errors: KDS_INVALID_ARG, KDS_CUDA. */
kds_status kern_cuda_moe_gather(const void *src, size_t row_bytes, const int32_t *tok_of,
                                int n_rows, void *dst, void *stream, kds_err *err);

/* Weighted sum of the experts' outputs back per token, in selection order:
 *   out[t] = sum_{n < k} w[t, n] * yg[row_of[t, n]]  (+ shared[t] if not NULL)
 * yg [T*k, hidden], shared / out [T, hidden] fp32; row_of, w [T, k]. Each
 * product and sum is rounded as the engine's loop rounds it (no FMA), so
 * the result equals the CPU's bit for bit. Errors: KDS_INVALID_ARG, KDS_CUDA. */
kds_status kern_cuda_moe_combine(const float *yg, const int32_t *row_of, const float *w, int T,
                                 int k, int hidden, const float *shared, float *out, void *stream,
                                 kds_err *err);

/* ------------------------------------------------------------------------ */
/* Sampling                                                                  */

/* Largest top-k the GPU sampler keeps (its candidates are sorted in shared
 * memory). */
#define KERN_CUDA_SAMPLE_MAX_K 1024

/*
 * One token for each of N rows of logits, kern_sample's algorithm (and so
 * eng_sample's) on the GPU, one CTA per row: repetition penalty, then greedy
 * or temperature -> top-k (radix select, ties to the lower id) -> sorted
 * softmax -> min-p -> top-p -> one draw from the row's xoshiro256** state.
 * The draw is exact: the same candidates in the same order, the same double
 * sums in the same order, the same RNG step; the only possible difference is
 * expf (the GPU rounds exp() in double to float, glibc's expf is within
 * 0.502 ulp), which can move a pick only when the uniform lands within an
 * ulp of a boundary.
 * Device pointers:
 *   logits       [N, V] fp32; the penalised entries are rewritten in place
 *   penalty_ids  [N, n_penalty] int32 or NULL (ids outside [0, V) ignored,
 *                repeats penalised once)
 *   rng          [N, 4] uint64: advanced once per row, not when greedy
 *   tokens       [N] int32 output
 *   row_params   [N] kern_sample_params, or NULL: each row's own settings
 *                (a batch of streams that sample differently), instead of
 *                `params` for every row
 * Limits: with temperature > 0 the effective top-k (V when top_k is off)
 * must be <= KERN_CUDA_SAMPLE_MAX_K, else KDS_UNSUPPORTED (sample such rows
 * on the CPU). `params` is checked here; row_params live on the device and
 * are not: the caller checks each row first (eng_cuda does, through the
 * backend's supports). NaN logits: unspecified. Errors: KDS_INVALID_ARG,
 * KDS_UNSUPPORTED, KDS_CUDA.
 */
typedef struct kern_cuda_sample_args {
    int N, V;
    float *logits;
    kern_sample_params params;
    const kern_sample_params *row_params;
    const int32_t *penalty_ids;
    int n_penalty;
    uint64_t *rng;
    int32_t *tokens;
} kern_cuda_sample_args;

kds_status kern_cuda_sample(const kern_cuda_sample_args *a, void *stream, kds_err *err);

/* ------------------------------------------------------------------------ */
/* MLA attention, absorbed form (kern_cuda_mla.cu; CPU: kern_mla_attend)     */

/*
 * Which sequence's latent cache each of `rows` rows uses, and at which
 * position. A cache is fp32 [capacity, dc + dr] in device memory, 16-byte
 * aligned, row tau = [rmsnorm(c_tau) * kv_a_layernorm (dc) | k_pe_tau (dr)]
 * (kern_mla_shape in kern.h). Two forms:
 *   caches == NULL  one sequence (prefill, or eng_decode): row r is position
 *                   pos0 + r of the sequence whose cache is `cache`;
 *   caches != NULL  one row per sequence (batched decode): row r is position
 *                   pos[r] of the sequence whose cache is caches[slots[r]].
 *                   caches: device array of n_caches device pointers (one
 *                   per slot, for this layer); slots, pos: device int32
 *                   [rows], so the host need not know them at launch. A
 *                   slot outside [0, n_caches) marks a padding row: nothing
 *                   is written to any cache, its o row is 0.
 * Positions must be below the cache's capacity (not checked on the device).
 */
typedef struct kern_cuda_mla_rows {
    int rows;
    float *cache;
    int64_t pos0;
    float *const *caches;
    int n_caches;
    const int32_t *slots, *pos;
} kern_cuda_mla_rows;

/*
 * Append each row's latent to its cache (the engine's loop in mla_layer):
 *   cache[pos] = [kern_rmsnorm(kva[r, :dc], norm_w, eps) | kva[r, dc:dc+dr]]
 * kva: device fp32 [rows, dc + dr] (the kv_a_proj_with_mqa output); norm_w:
 * device [dc] F32 or BF16 (kv_a_layernorm), or NULL (no weight). Numerics as
 * kern_rmsnorm (sum of squares in double, products rounded one by one): the
 * only difference is the summation order of the squares. With the table
 * form, two rows must not name the same (slot, position). Errors:
 * KDS_INVALID_ARG (NULL, shape, dtype, alignment), KDS_CUDA.
 */
typedef struct kern_cuda_mla_append_args {
    kern_cuda_mla_rows map;
    int dc, dr;
    float eps;
    const float *kva;
    const void *norm_w;
    kern_dtype norm_w_dtype;
} kern_cuda_mla_append_args;

kds_status kern_cuda_mla_cache_append(const kern_cuda_mla_append_args *a, void *stream,
                                      kds_err *err);

/*
 * Absorbed MLA attention for the rows of `map` (after their latents were
 * appended: row r sees cache rows 0 .. its position), all heads:
 *   o[r, h] = softmax_tau( [q_nope W_UK_h | q_pe] . cache[tau] / sqrt(dn + dr) )
 *             . cache[tau, :dc]  W_UV_h^T
 * i.e. kern_mla_attend for every row (one sequence: kern_mla_attend with
 * T = rows at pos0; table form: T = 1 per row), up to summation order.
 * Device pointers: q fp32 [rows, nh*(dn+dr)] (head h: [q_nope | q_pe]);
 * kv_b [nh*(dn+dv), dc] F32 or BF16 (kv_b_proj: head h's rows are W_UK_h
 * then W_UV_h); o fp32 [rows, nh*dv]; workspace (16-byte aligned) of
 * workspace_bytes >= kern_cuda_mla_workspace_bytes(shape, rows, 1).
 *
 * Three launches: absorb (Qa = [q_nope W_UK_h | q_pe] scaled, into the
 * workspace), attend (MQA over the shared 576-wide keys, the context cut in
 * n_split splits, flash-decoding partials into the workspace), combine
 * (merge the splits, W_UV_h). n_split <= 0 chooses it: enough CTAs for two
 * per SM, no split below 256 keys of max_ctx, no more than the workspace
 * holds; an explicit n_split is lowered to what the workspace holds.
 * max_ctx: the longest context among the rows (position + 1), only for that
 * choice (a row longer than it is still attended in full, by the last split).
 * Shapes: dc in {64, 128, 256, 512}, dr % 4 == 0, any nh, dn, dv. Dynamic
 * shared memory kern_cuda_mla_attention_smem_bytes(shape) (148,480 B at
 * Kimi's dc + dr = 576: H100/H200/A100 only). Nothing may alias o.
 * Errors: KDS_INVALID_ARG (NULL, dtype, alignment, workspace below one
 * split), KDS_UNSUPPORTED (shape), KDS_CUDA.
 */
typedef struct kern_cuda_mla_args {
    kern_mla_shape shape;
    kern_cuda_mla_rows map;
    const float *q;
    const void *kv_b;
    kern_dtype kv_b_dtype;
    float *o;
    int max_ctx;
    int n_split; /* <= 0: automatic */
    void *workspace;
    size_t workspace_bytes;
} kern_cuda_mla_args;

kds_status kern_cuda_mla_attention(const kern_cuda_mla_args *a, void *stream, kds_err *err);

/* Workspace for `rows` rows with up to max_splits context splits:
 * rows*nh*((dc+dr) + max_splits*(dc+2)) floats, each part 256-byte aligned
 * (0 for a bad shape). Kimi (nh 32): 73.7 KB + 65.8 KB per split per row. */
size_t kern_cuda_mla_workspace_bytes(const kern_mla_shape *sh, int rows, int max_splits);

/* Dynamic shared memory of the attend kernel (0 for an unsupported shape). */
size_t kern_cuda_mla_attention_smem_bytes(const kern_mla_shape *sh);

/* ------------------------------------------------------------------------ */
/* Whole-model helpers (kern_cuda_model.cu; used by engine/eng_cuda.c)       */

/*
 * GEMM context (kernels/cuda/kern_cuda_gemm.cu): what the cuBLAS path of
 * kern_cuda_matmul needs, made once: a cuBLAS handle, its workspace
 * (32 MiB, the size cuBLAS recommends for Hopper) and a bf16 scratch for
 * the activations, 2 x max_act_elems bf16 (the hi and lo halves of x).
 *   max_act_elems: the largest T * cols of one cuBLAS product; a call with
 *     more is run in pieces of floor(max_act_elems / cols) rows (same
 *     result, more launches). Suggested: max_batch * the largest `cols` the
 *     caller multiplies (Kimi-48B: 4096, o_proj). Must be >= 1.
 * Ownership: caller owns: free with kern_cuda_gemm_ctx_free (which
 * synchronises the device, cudaFree semantics: not on the hot path).
 * Threading: one host thread and one stream at a time: the scratch is shared
 * by every call, so calls on different streams must be ordered by the
 * caller. The stream given to kern_cuda_matmul wins (the handle is re-bound,
 * with its workspace, when it changes); kern_cuda_gemm_ctx_set_stream binds
 * one ahead of time.
 * Errors: KDS_INVALID_ARG (out NULL, max_act_elems 0), KDS_NOMEM (device
 * memory), KDS_CUDA (cuBLAS initialisation: message names the cuBLAS
 * status). On error *out = NULL and nothing is left allocated.
 */
typedef struct kern_cuda_gemm_ctx kern_cuda_gemm_ctx;

kds_status kern_cuda_gemm_ctx_create(size_t max_act_elems, kern_cuda_gemm_ctx **out,
                                     kds_err *err);
void kern_cuda_gemm_ctx_free(kern_cuda_gemm_ctx *c); /* NULL: no-op */
kds_status kern_cuda_gemm_ctx_set_stream(kern_cuda_gemm_ctx *c, void *stream, kds_err *err);

/* Precision of the tensor-core products (cuBLAS in kern_cuda_matmul, the
 * WMMA grouped expert product). Weights are used as stored (bf16 exactly);
 * only the fp32 activations are rounded:
 *   EXACT (0, the default): x = hi + lo with hi = bf16(x), lo = bf16(x - hi),
 *     two products accumulated in fp32: ~16 bits of x, ~1e-5 of the largest
 *     magnitude, about what fp32 activations give;
 *   BF16: x rounded to bf16 once (what vLLM does): half the work, ~2^-9
 *     relative error per activation, ~3e-3 of the largest output. */
typedef enum kern_cuda_gemm_mode {
    KERN_CUDA_GEMM_EXACT = 0,
    KERN_CUDA_GEMM_BF16 = 1,
} kern_cuda_gemm_mode;

/*
 * y[t, r] = sum_c x[t, c] * W[r, c]   (accumulate: y[t, r] += that sum)
 * for t < T, r < rows: kern_matmul's product (PyTorch Linear, W [rows, cols]
 * row-major in w_dtype F32 or BF16, fp32 activations and accumulation).
 * Device pointers: W; x [T, ldx] fp32 (ldx >= cols); y [T, ldy] fp32
 * (ldy >= rows, columns [rows, ldy) untouched). Nothing may alias y.
 * Dispatch (kernels/cuda/README.md):
 *   T <= 8 (KERN_CUDA_GEMV_MAX_T): a bandwidth-bound GEMV on CUDA cores that
 *     streams every weight byte once for all T rows (16-byte loads when W,
 *     x are 16-byte aligned, cols % (16 / dtype size) == 0 and ldx % 4 == 0;
 *     element loads otherwise); exact fp32 arithmetic whatever `mode`;
 *     no context needed;
 *   T > 8 with gemm != NULL: cuBLAS on tensor cores, bf16 weights x bf16
 *     activations (split by `mode`), fp32 accumulation and output
 *     (accumulate = beta 1); f32 weights: an fp32 cuBLAS product (no TF32);
 *   T > 8 without a context: a 16 x 16 shared-memory tiling on CUDA cores
 *     (exact, slow: the fallback).
 * Zero-initialised gemm/mode keep the exact fp32-activation results. All
 * paths agree with kern_matmul up to summation order (~1e-6 relative),
 * except the cuBLAS bf16 product (EXACT ~1e-5, BF16 ~3e-3, see above).
 * Errors: KDS_INVALID_ARG (shape, dtype, mode, NULL), KDS_UNSUPPORTED
 * (T > 1048560 without a context), KDS_CUDA (launch or cuBLAS status).
 */
#define KERN_CUDA_GEMV_MAX_T 8

typedef struct kern_cuda_matmul_args {
    const void *W;
    kern_dtype w_dtype;
    int rows, cols;
    const float *x;
    int ldx, T;
    float *y;
    int ldy;
    bool accumulate;
    kern_cuda_gemm_ctx *gemm;  /* NULL: no cuBLAS (GEMV or the tiled fallback) */
    kern_cuda_gemm_mode mode;  /* cuBLAS bf16 products only */
    /* 0 (the default): the GEMV's geometry; 1 .. KERN_CUDA_GEMV_VARIANTS:
     * another geometry of the T = 1 bf16 GEMV, same results bit for bit
     * (kern_cuda_gemv_variant_name; kds_cuda_bench compares them) */
    int gemv_variant;
} kern_cuda_matmul_args;

enum { KERN_CUDA_GEMV_VARIANTS = 5 };
/* "rows/warp R, depth D, warps W" of variant v (0: the default). */
const char *kern_cuda_gemv_variant_name(int v);

kds_status kern_cuda_matmul(const kern_cuda_matmul_args *a, void *stream, kds_err *err);

/*
 * The routed experts' products, grouped, with the grouping read on the
 * device (no host sync): rows [exp_off[e], exp_off[e+1]) of x belong to
 * expert e (kern_cuda_moe_route's exp_off, after kern_cuda_moe_gather):
 *   no W3:    y[i, r] = sum_c x[i, c] * W_e[r, c]
 *   with W3:  y[i, r] = act(x[i] . W_e[r], x[i] . W3_e[r])
 *                (gate and up projections fused), act by `act`:
 *                SWIGLU (0, the default): silu(a) * b          (kern_swiglu)
 *                SITU: [situ_beta tanh(a / situ_beta) sigmoid(a)]
 *                      * [situ_beta_l tanh(b / situ_beta_l)]   (kern_situ; K3)
 * for every row i of expert e, r < rows. Device pointers:
 *   the experts' matrices, each [rows, cols] row-major in w_dtype (BF16,
 *             F32 or MXFP4), given either way:
 *     W, W3   [E] device arrays of device pointers, one matrix per expert,
 *             each 16-byte aligned (cudaMalloc'd bases qualify; build the
 *             tables once at load time: kern_cuda_malloc + memcpy_h2d), or,
 *             with W == NULL,
 *     W_base, W3_base, w_stride: expert e's matrix at W_base + e * w_stride
 *             bytes (one buffer per layer, e.g. [E][w1 | w3 | w2] gives
 *             W_base = w1 of expert 0, W3_base = W_base + |w1|, w_stride =
 *             |w1| + |w3| + |w2|); w_stride >= one matrix's bytes.
 *             16-byte loads need the bases and w_stride 16-byte aligned
 *             (checked here; otherwise element loads, or KDS_UNSUPPORTED
 *             for TENSOR and MXFP4).
 *   MXFP4 (kern.h's KERN_MXFP4, K3's routed experts): W / W3 / W_base /
 *             W3_base hold the codes [rows, cols / 2] (two E2M1 per byte,
 *             16-byte aligned as above); the E8M0 scales [rows, cols / 32]
 *             (any alignment) come, with the tables, from S and S3 ([E]
 *             device arrays of device pointers), with the stacked form from
 *             S_base, S3_base: expert e's scales at S_base + e * s_stride
 *             bytes, s_stride >= rows * cols / 32. cols % 32 == 0. The
 *             product is that of the dequantised matrix (kern_matmul_w):
 *             GEMV exact in fp32 for activations of magnitude in
 *             [2^-60, 2^60] (see README); TENSOR dequantises to bf16
 *             exactly (every MXFP4 value is a bf16 value).
 *   exp_off   [E + 1] int32, non-decreasing from 0 (bad offsets are clamped
 *             to [0, n_rows], never read or written out of bounds)
 *   x         [n_rows, ldx] fp32, y [n_rows, ldy] fp32 (ldy >= rows);
 *             n_rows is what the host knows: the allocated rows (T * k).
 *             Rows of y outside every group and columns >= rows untouched.
 *             MXFP4 needs x 16-byte aligned and ldx % 4 == 0.
 * The grid is sized from n_rows; CTAs without work exit at once.
 * Algorithms (`algo`, KERN_CUDA_MOE_AUTO picks GEMV when n_rows <= 2 * E,
 * i.e. about two rows per expert or fewer, or for f32 weights):
 *   GEMV: per expert, chunks of up to 8 rows, each streaming the expert's
 *     weights once (CUDA cores, exact fp32 whatever `mode`; MXFP4 codes
 *     dequantised in registers, one 16-byte load = one 32-column block);
 *   TENSOR: WMMA tiles of 64 rows x 64 weight rows, bf16 operands, fp32
 *     accumulation, x split by `mode` (BF16 or MXFP4 weights, the latter
 *     dequantised to bf16 in shared memory; needs cols % 8 == 0, ldx % 4 ==
 *     0, x 16-byte aligned, else KDS_UNSUPPORTED).
 * A zero-initialised act / S / S3 / S_base / S3_base / s_stride / situ_*
 * keeps the bf16 / f32 behaviour of before they existed, bit for bit.
 * Errors: KDS_INVALID_ARG (shape, dtype, NULL, missing scales, act without
 * W3 or with betas that are not positive and finite), KDS_UNSUPPORTED
 * (TENSOR or MXFP4 asked for what it cannot do), KDS_CUDA (launch).
 * Nothing may alias y.
 */
typedef enum kern_cuda_moe_algo {
    KERN_CUDA_MOE_AUTO = 0,
    KERN_CUDA_MOE_GEMV = 1,
    KERN_CUDA_MOE_TENSOR = 2,
} kern_cuda_moe_algo;

/* The activation of the fused gate/up form. */
typedef enum kern_cuda_moe_act {
    KERN_CUDA_MOE_SWIGLU = 0,
    KERN_CUDA_MOE_SITU = 1,
} kern_cuda_moe_act;

typedef struct kern_cuda_moe_experts_args {
    int E;                  /* experts */
    int rows, cols;         /* each expert's matrix [rows, cols] */
    kern_dtype w_dtype;     /* BF16, F32 or MXFP4 */
    const void *const *W;   /* device [E] of device pointers, or NULL: W_base */
    const void *const *W3;  /* NULL, or device [E]: fused act(x W^T, x W3^T) */
    const void *W_base;     /* with W == NULL: expert e at W_base + e * w_stride */
    const void *W3_base;    /* NULL, or the fused up projection likewise */
    size_t w_stride;        /* bytes from one expert's matrix (codes) to the next */
    const int32_t *exp_off; /* device [E + 1] */
    int n_rows;             /* rows of x and y (upper bound of exp_off[E]) */
    const float *x;
    int ldx;
    float *y;
    int ldy;
    kern_cuda_gemm_mode mode;
    kern_cuda_moe_algo algo;
    /* MXFP4 only: the scales, as the codes are given (tables or stacked) */
    const void *const *S, *const *S3; /* with W / W3: device [E] of device pointers */
    const void *S_base, *S3_base;     /* with W_base / W3_base */
    size_t s_stride;                  /* bytes from one expert's scales to the next */
    /* fused form only */
    kern_cuda_moe_act act;             /* SWIGLU (0) or SITU */
    float situ_beta, situ_beta_l;      /* SITU: K3's 4 and 25 */
} kern_cuda_moe_experts_args;

kds_status kern_cuda_moe_experts(const kern_cuda_moe_experts_args *a, void *stream, kds_err *err);

/*
 * The KDA depthwise causal short convolution + SiLU over C = 2*n_qk + n_v
 * channels (q | k | v), taps w [C, W] fp32 (last tap = current token):
 *   slots == NULL (T tokens of one sequence): ext [W-1+T, C] holds the
 *     sequence's conv tail (W-1 rows, oldest first) then the T new rows;
 *     out_t = silu(sum_j w[:, j] * ext[t + j]). The caller moves the tail
 *     on (ext rows T .. T+W-2).
 *   slots != NULL (one token of each of T sequences): tails
 *     [pool, W-1, C]; token t reads tails[slots[t]] and ext row W-1+t,
 *     and that tail moves on by one row in place (slots must be distinct).
 * Outputs q, k [T, n_qk] and v [T, n_v] fp32. Errors: KDS_INVALID_ARG,
 * KDS_CUDA.
 */
typedef struct kern_cuda_conv_args {
    int T, W, n_qk, n_v;
    const float *ext, *w;
    float *tails;
    const int32_t *slots;
    float *q, *k, *v;
} kern_cuda_conv_args;

kds_status kern_cuda_short_conv(const kern_cuda_conv_args *a, void *stream, kds_err *err);

/* a[i] = silu(a[i]) * b[i] (kern_swiglu) and y[i] += x[i], n fp32 device
 * values. Errors: KDS_INVALID_ARG (NULL with n > 0), KDS_CUDA. */
kds_status kern_cuda_swiglu(float *a, const float *b, size_t n, void *stream, kds_err *err);
kds_status kern_cuda_add(float *y, const float *x, size_t n, void *stream, kds_err *err);

/* Page-locked host memory (cudaMallocHost) for fast, asynchronous copies;
 * bytes == 0 gives NULL. Errors: KDS_INVALID_ARG, KDS_NOMEM, KDS_CUDA.
 * kern_cuda_host_free(NULL) is a no-op. */
kds_status kern_cuda_host_alloc(void **ptr, size_t bytes, kds_err *err);
void kern_cuda_host_free(void *ptr);

#ifdef __cplusplus
}
#endif

#endif /* KERN_CUDA_H */
