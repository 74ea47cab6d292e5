/*
 * kern.h - numeric kernels of kdaserve: the CPU reference implementations
 * (kernels/cpu/, always built) and, behind the same contracts, the CUDA ones
 * (kernels/cuda/, built when nvcc is found; see kern_cuda.h).
 *
 * Contract for every kernel here:
 *   - Pure functions over caller-owned buffers. No allocation, no globals, no
 *     I/O: callable on the per-token hot path. Scratch memory, when needed,
 *     is passed in by the caller (sized by the matching *_workspace() call).
 *   - CPU kernels: all activations and states are float32. Weights may be F32, BF16 or F16
 *     (kern_dtype); they are read in place (usually from an mmap).
 *   - Thread-safety: reentrant. Kernels that take a [begin, end) range work on
 *     that slice only, so a caller's thread pool can split the work: distinct
 *     ranges never write the same memory.
 *   - Shapes are in row-major order, last index fastest, written [A, B, C].
 */
#ifndef KERN_H
#define KERN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kds_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Format of a stored weight. Element formats hold one value per element;
 * block formats hold codes plus one scale per KERN_BLOCK consecutive
 * columns of a row (a matrix's input dimension), kept apart from the codes
 * (compressed-tensors' `weight_packed` / `weight_scale` pair):
 *   MXFP4  code bytes [rows, cols / 2]: two E2M1 codes per byte, element 2j
 *          in the low nibble, 2j + 1 in the high one; code bit 3 is the
 *          sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6};
 *          scale bytes [rows, cols / 32]: E8M0 exponents;
 *          W[r, c] = e2m1(code[r, c]) * 2^(scale[r, c / 32] - 127)
 *          (OCP Microscaling MXFP4; Kimi K3's routed experts).
 *   Q8_0   code bytes [rows, cols]: int8; scales [rows, cols / 32]: f16;
 *          W[r, c] = code[r, c] * scale[r, c / 32] (ggml's Q8_0 values,
 *          with the scales in their own array).
 * Never renumbered: the values appear in no file, but tests name them.
 */
typedef enum kern_dtype {
    KERN_F32 = 0,
    KERN_BF16 = 1,
    KERN_F16 = 2,
    KERN_MXFP4 = 3,
    KERN_Q8_0 = 4,
} kern_dtype;

/* Columns that share one scale in a block format. */
#define KERN_BLOCK 32

/* Bytes per element of an element format (4, 2 or 2); 0 for a block
 * format (use kern_weight_layout). */
size_t kern_dtype_size(kern_dtype dt);
/* True for MXFP4 and Q8_0. */
int kern_dtype_is_block(kern_dtype dt);
/* "f32", "bf16", "f16", "mxfp4", "q8_0"; "?" for anything else. */
const char *kern_dtype_name(kern_dtype dt);

/* A weight matrix [rows, cols] (PyTorch Linear: out, in) as stored.
 * Borrowed pointers; row r of the codes at data + r * row_bytes, of the
 * scales at scales + r * scale_row_bytes (kern_weight_layout). */
typedef struct kern_weight {
    kern_dtype dt;
    const void *data;   /* elements, or a block format's codes */
    const void *scales; /* a block format's scales; NULL for element formats */
    int rows, cols;
    /* A hint, never a change in the results: the matrix comes from memory
     * at every product (the model's per-token bytes exceed the last-level
     * cache), not from cache. A bf16 product of one token then reads
     * the rows as one stream, which memory serves faster and the cache
     * slower than eight rows side by side. */
    bool streamed;
    /* A hint too: how many bytes ahead the one-token product of a streamed
     * bf16 matrix (AVX-512: its rows read one after another, one stream)
     * prefetches along that stream; 0: not at all, the hardware prefetcher
     * alone. kern_stream_prefetch_bytes() gives this CPU's. */
    int stream_prefetch;
    /* A hint too: a bf16 product of 2 to 8 tokens prefetches each row's
     * lines ahead of where it reads them, as from 9 tokens on, rather than
     * the next eight rows in the order they lie (false, where unset). The
     * order they lie made a Zen 4 16-45% faster, and an Intel Xeon 15-30%
     * and a Zen 5 up to 40% slower (docs/benchmarks.md, "AMX tiles
     * for --bf16", "A Zen 5 at today's head"). Never a change in the
     * results. kern_prefetch_rows_ahead() gives this CPU's. */
    bool prefetch_rows_ahead;
    /* Not a hint: this changes the bits. Where the CPU has AMX tiles (and
     * the build can use them), the exact products of this bf16 matrix of
     * up to 63 tokens (in >= KERN_TILES_MIN_IN, in % 32 == 0) run on them,
     * x split exactly into three bf16 values (kern_gemm.h,
     * kern__amx_rows_split): the products stay exact and the sums f32, in
     * the tiles' order. A step of 8 tokens is then bound by reading W
     * rather than by the f32 FMAs (docs/benchmarks.md, "Exact products on
     * AMX tiles"). Each token's sums are the same whatever the tokens and
     * rows beside it, so a caller that sets this for a matrix at every
     * product keeps batched and lone products bit for bit equal; the
     * engine sets it for all but routed experts, whose few tokens a
     * product leave them bound by reading W either way and which the
     * tiles' 32 rows side by side read slower than one stream. */
    bool exact_tiles;
} kern_weight;

/* The shortest rows (in columns) that kern_weight's exact_tiles puts on
 * the tiles: shorter rows read slower there one token at a time (an
 * Intel Xeon, one thread, [16384, 512] from memory 11.6 against 14.3
 * GB/s, [8192, 1024] 12.7 against 14.0; [4096, 2304] 13.8 against 12.5),
 * and llamacpp-tiny's (256) decode lost 13%. */
#define KERN_TILES_MIN_IN 2048

/* The stream_prefetch that suits this CPU (docs/benchmarks.md, "No
 * software prefetch on a Zen 4"): 0 on AMD family 19h (Zen 4; its Zen 3
 * parts have no AVX-512, where the hint is unused), whose hardware
 * prefetcher alone reads one stream at 101-108% of a plain streaming read
 * and an 8 KiB software prefetch lost it 7-30%; 8 KiB elsewhere (measured
 * best on a Zen 5). Thread-safe: reads CPUID, keeps nothing. */
int kern_stream_prefetch_bytes(void);

/* The prefetch_rows_ahead that suits this CPU: false on AMD family 19h
 * (the rows in the order they lie; measured on a Zen 4), true elsewhere
 * (measured on an Intel Xeon and a Zen 5). Thread-safe: reads CPUID (so
 * call it once, not per product: in a VM each CPUID traps to the host),
 * keeps nothing. */
bool kern_prefetch_rows_ahead(void);

/* The byte layout of a weight: the one place the size of a format is
 * computed. */
typedef struct kern_layout {
    size_t row_bytes;       /* one row of data (elements or codes) */
    size_t scale_row_bytes; /* one row of scales (0 for element formats) */
    size_t data_bytes;      /* rows * row_bytes */
    size_t scale_bytes;     /* rows * scale_row_bytes */
    size_t bytes;           /* data_bytes + scale_bytes */
} kern_layout;

/* Layout of a [rows, cols] weight of format dt. All zero when it has no
 * layout: an unknown format, a negative size, or a block format whose cols
 * is not a multiple of KERN_BLOCK. */
kern_layout kern_weight_layout(kern_dtype dt, int64_t rows, int64_t cols);

/* E2M1 code (low 4 bits of `code`) and E8M0 scale values, exact in f32
 * (E8M0 255 is NaN; 0 is 2^-127, a denormal). */
float kern_e2m1_to_f32(unsigned code);
float kern_e8m0_to_f32(uint8_t e);

/* Columns [c0, c1) of row r of w as f32 (any format; for block formats c0
 * and c1 need not be block aligned). out receives c1 - c0 values. */
void kern_weight_row_f32(const kern_weight *w, int r, int c0, int c1, float *out);

/* Scalar conversions (exact for bf16 -> f32; round-to-nearest-even back). */
float kern_bf16_to_f32(uint16_t h);
uint16_t kern_f32_to_bf16(float f);
float kern_f16_to_f32(uint16_t h);
uint16_t kern_f32_to_f16(float f);

/* Element i of a generated model's weight matrix (eng_genmodel.h): the
 * counter-based splitmix64 stream keyed by `stream`, turned into an
 * N(0, sd^2)-like value (Irwin-Hall of four 16-bit uniforms, in double).
 * kern_cuda_gen_normal makes the same values on a GPU, bit for bit, so a
 * model generated there equals the one `kdaserve gen-model` writes. */
float kern_gen_normal(uint64_t stream, uint64_t i, float sd);

/* Convert `n` elements of type `dt` at `src` to float32 at `dst`. */
void kern_to_f32(kern_dtype dt, const void *src, float *dst, size_t n);

/* A plain streaming read of n bytes at p (64-byte aligned): the sum of
 * its 64-bit words (wrapping), so the reads cannot be left out. Four
 * independent 64-byte loads per step, so the loop is bound by memory: the
 * machine's read bandwidth, which decode is judged against. */
uint64_t kern_read_sum(const void *p, size_t n);

/* The multiply-add peak (kernels/cpu/peak.c): `iters` rounds of 24
 * independent chains of register-only multiply-adds, what the arithmetic-
 * bound products are judged against. bf16 false: f32 FMAs (AVX-512 or
 * AVX2); true: AVX-512 BF16 dot products (vdpbf16ps, a pair of products
 * a lane: the --bf16 products' instruction). Returns a sum of the chains,
 * so that they cannot be left out. kern_madd_per_round: the multiply-adds
 * of one round, 0 where the build has no such loop (then kern_madd_chains
 * does nothing). Pure functions of their arguments; any thread. */
int kern_madd_per_round(bool bf16);
float kern_madd_chains(bool bf16, long iters);

/* ------------------------------------------------------------------------ */
/* Dense products                                                            */

/*
 * y[t, r] = sum_i x[t, i] * W[r, i]  for t in [0, T), r in [r0, r1).
 *   W: [rows, in] of dtype `dt` (a PyTorch Linear weight, row-major).
 *   x: [T, in] float32.   y: [T, ldy] float32 (only columns r0..r1-1 written).
 * Below 64 tokens, dot products straight from W (no conversion), and row t
 * of the result is token t's one-token product, bit for bit, in every build
 * (batched decode relies on it); from 64, with scratch, a GEMM: AVX-512
 * and AVX2 builds the register-blocked panels of kern_gemm.h (each output
 * one fma chain, the same bits in both), others row blocks of W widened to
 * f32 in `scratch` and BLAS.
 *   scratch: kern_matmul_scratch_floats(in) floats, or NULL to force the
 *   direct path (but for f32 from 64 tokens without AVX-512: BLAS, which
 *   needs no scratch).
 */
void kern_matmul(kern_dtype dt, const void *W, int in, const float *x, int T,
                 float *y, int ldy, int r0, int r1, float *scratch);
size_t kern_matmul_scratch_floats(int in);

/*
 * The same product for a weight of any format (what the engine calls):
 * element formats are exactly kern_matmul(w->dt, w->data, w->cols, ...),
 * bit for bit. Block formats (MXFP4, Q8_0) compute with the dequantised
 * f32 values (kern_weight_row_f32), so the result is the dequantised
 * matrix's product up to summation order (infinities and NaNs of the
 * values included):
 *   T < 64 (in every build): the codes and scales are read
 *   in place, eight rows per pass,
 *   no dequantised copy of the matrix (decode: bound by the code bytes
 *   read). Row t of a T-token product is the 1-token product of row t of
 *   x, bit for bit (what batched decode relies on).
 *   T >= 64: panels of rows are dequantised into `scratch` and multiplied
 *   there (prefill).
 *   scratch: kern_matmul_scratch_floats(w->cols) floats, required for
 *   block formats (without it nothing is written; NULL forces kern_matmul's
 *   direct path for element formats, as there).
 */
void kern_matmul_w(const kern_weight *w, const float *x, int T, float *y, int ldy, int r0, int r1,
                   float *scratch);

/*
 * kern_matmul_w for a decode step's product under eng_ctx_params.bf16_act
 * (llama.cpp's precision): a bf16 matrix (in AVX-512 BF16 builds) takes
 * x rounded to bf16 (nearest even) and AVX-512 BF16 dot products, twice
 * the multiply-adds of f32 FMAs an instruction (on AMX CPUs, tiles:
 * kern_gemm.h's kern__amx_rows_bf16), where a batched step of 8 or more
 * sequences is bound by them: below 64 tokens (cols a multiple of 32)
 * eight rows at a time, from 64 tokens the prefill's GEMM
 * (kern__gemm_bf16act). Row t of the result is token t's own product in
 * this mode, bit for bit, whatever tokens share the call, below 64
 * tokens (at any T on AMX tiles); from 64 each sum is added in another
 * order, as kern_matmul_w's exact GEMM from 64 (~3e-3 relative error
 * against the exact product either way). Anything else: kern_matmul_w.
 * Same arguments and scratch.
 */
void kern_matmul_w_bf16act(const kern_weight *w, const float *x, int T, float *y, int ldy, int r0,
                           int r1, float *scratch);

/*
 * kern_matmul_w for the tokens of one sequence's prefill, where row t of
 * the result need not be token t's one-token product (batched decoding
 * needs that; a prompt does not): from KERN_PREFILL_GEMM_MIN_T tokens it
 * takes the GEMM path of kern_matmul_w's many-token case, which is
 * compute-bound and faster there than the direct path; below it it is
 * kern_matmul_w. Block formats are kern_matmul_w at every T (their direct
 * path is as fast as the GEMM up to where kern_matmul_w changes over).
 * Without AVX-512: element formats by the AVX2 GEMM from
 * KERN_PREFILL_GEMM_MIN_T tokens, or without AVX2 by BLAS from 8
 * (kern_gemm.h); block formats kern_matmul_w_ref (panels from 32). Same
 * arguments and contract.
 * bf16_act: a bf16 weight's GEMM rounds x to bf16 and runs on AVX-512 BF16
 * dot products (about twice the multiply-adds per second; x then carries
 * ~3e-3 relative error: llama.cpp's and vLLM's precision, never the
 * default); ignored for other formats, below the GEMM's tokens, and in
 * builds without AVX512_BF16.
 */
#define KERN_PREFILL_GEMM_MIN_T 12
/* Whether this build has bf16 dot products (AVX-512 BF16), which bf16_act
 * needs; without them the products it would round stay exact. */
bool kern_bf16_products(void);
/* Whether those products run on AMX tiles here (an AMX build, a CPU with
 * AMX-BF16 and the kernel's leave for this process; asked anew at each
 * call): a prefill's bf16 GEMM and a batched step's bf16 products. */
bool kern_bf16_tiles(void);
void kern_matmul_w_prefill(const kern_weight *w, const float *x, int T, float *y, int ldy, int r0,
                           int r1, float *scratch, bool bf16_act);

/*
 * kern_matmul_w's portable path for a block format, in every build (its
 * loops are those kern_matmul_w and a prefill take without AVX-512; there
 * kern_matmul_w changes over at 64 tokens, as everywhere): below 32 tokens
 * each row's blocks of 32 values dequantised one at a time and dotted with
 * every token, from 32 blocks of 128 rows dequantised to f32 in `scratch`
 * and multiplied by BLAS. The readable specification of the fast paths,
 * and slow. Same arguments and contract as kern_matmul_w (row t a lone
 * token's product below 32 tokens); w must be a block format.
 */
void kern_matmul_w_ref(const kern_weight *w, const float *x, int T, float *y, int ldy, int r0,
                       int r1, float *scratch);

/* ------------------------------------------------------------------------ */
/* Element-wise and normalisation                                            */

/* y = x * rsqrt(mean(x^2) + eps) * w   over one vector of length n.
 * w has dtype `dt` and may be NULL (no weight). x and y may alias. */
void kern_rmsnorm(const float *x, const void *w, kern_dtype dt, int n, float eps, float *y);

/* x /= sqrt(sum(x^2) + eps), in place, over `n_vecs` vectors of length dim
 * (fla's l2norm; eps 1e-6 for KDA q and k). */
void kern_l2norm(float *x, int n_vecs, int dim, float eps);

/* silu(x) = x * sigmoid(x), in place. */
void kern_silu(float *x, size_t n);
/* a[i] = silu(a[i]) * b[i] (SwiGLU), in place into a. */
void kern_swiglu(float *a, const float *b, size_t n);
float kern_sigmoid(float x);
/* x[i] = sigmoid(x[i]), in place (vectorised). */
void kern_sigmoid_inplace(float *x, size_t n);
/* softplus with PyTorch's threshold 20: x > 20 ? x : log1p(exp(x)). */
float kern_softplus(float x);

/*
 * SiTU (Kimi K3's gated activation, reference/kimi-k3.md §4.6), in place
 * into a, in fp32 (tanhf, the engine's sigmoid):
 *   a[i] = [beta * tanh(a[i] / beta) * sigmoid(a[i])] * [beta_l * tanh(b[i] / beta_l)]
 * the gate soft-capped at beta (K3: 4), the up branch at +-beta_l (25). */
void kern_situ(float *a, const float *b, size_t n, float beta, float beta_l);

/* x[i] *= sigmoid(g[i]) (MLA's output gate), n values. */
void kern_sigmoid_mul(float *x, const float *g, size_t n);

/*
 * Block Attention Residuals' mix (reference/kimi-k3.md §4.2), per token t
 * of T, over the candidates c_0..c_{n-1} = the n_blocks frozen snapshots
 * (snapshot j's row t at blocks + j * block_stride + t * D) and, when
 * `partial` is not NULL, the running partial (row t at partial + t * D):
 *   z_j = (sum_d c_j[d] * u[d]) / sqrt(mean_d c_j[d]^2 + eps)
 *   out[t] = sum_j softmax(z)_j * c_j          (the raw candidates)
 * u = the sublayer's res_norm weight times its res_proj (fused once, fp32
 * [D]). Sums in double, the softmax's weights rounded to f32, the mix
 * summed in candidate order in f32. 1 to 64 candidates. out [T, D] may not
 * alias a candidate.
 */
void kern_attn_res_mix(int T, int D, const float *blocks, size_t block_stride, int n_blocks,
                       const float *partial, const float *u, float eps, float *out);

/*
 * Quantise one row of `cols` values (a multiple of KERN_BLOCK) into a block
 * format's codes and scales (kern_weight_layout's row_bytes and
 * scale_row_bytes of them):
 *   MXFP4  the OCP Microscaling rule: per block of 32 the shared exponent
 *          e = floor(log2(max |x|)) - 2 (E2M1's largest exponent), clamped to
 *          E8M0's range; each x / 2^e rounded to the nearest E2M1 value (ties
 *          to the even code), saturating at +-6; an all-zero block gets e =
 *          -127;
 *   Q8_0   per block the f16 scale max |x| / 127 (1 for an all-zero block),
 *          each x / scale rounded to the nearest integer in [-127, 127].
 * Reentrant; used by the random-model generator and `kdaserve quantize`.
 */
void kern_quantize_row(kern_dtype dt, const float *x, int cols, void *codes, void *scales);

/* ------------------------------------------------------------------------ */
/* KDA (Kimi Delta Attention) core                                           */

/*
 * Shapes of one KDA layer for one sequence.
 *   H  : query/key heads, HV: value heads (HV % H == 0; value head hv uses
 *        q/k head hv / (HV / H): "GVA"; Kimi-Linear has HV == H),
 *   K  : key (and query) head dim, V: value head dim,
 *   scale: multiplies q in the read-out (K^-1/2 by default).
 */
typedef struct kern_kda_shape {
    int H, HV, K, V;
    float scale;
} kern_kda_shape;

/*
 * Decay gate in log space, per token t, value head hv and key dim d:
 *   softplus form (lower_bound >= 0, i.e. "off"; Kimi-Linear-48B):
 *     g = -exp(A_log[hv]) * softplus(g_raw + dt_bias[hv*K + d])
 *   lower-bound form (lower_bound < 0):
 *     g = lower_bound * sigmoid(exp(A_log[hv]) * (g_raw + dt_bias[hv*K + d]))
 * g_raw, g: [T, HV, K]; A_log: [HV]; dt_bias: [HV*K] or NULL (no bias).
 * g may alias g_raw.
 */
void kern_kda_gate(const float *g_raw, const float *A_log, const float *dt_bias, int T,
                   int HV, int K, float lower_bound, float *g);

/*
 * Token-by-token delta rule (the decode path; exact reference of the
 * recurrence in kda-model-spec.md §3.5), for value heads [hv0, hv1):
 *   S = diag(exp(g_t)) S ;  S += beta_t * k_t (v_t - S^T k_t)^T ;
 *   o_t = S^T (scale * q_t)
 * q, k: [T, H, K] (already L2-normalised); v: [T, HV, V]; g: [T, HV, K];
 * beta: [T, HV] (after sigmoid); state: [HV, K, V] in/out; o: [T, HV, V].
 */
void kern_kda_recurrent(const kern_kda_shape *sh, int T, const float *q, const float *k,
                        const float *v, const float *g, const float *beta, float *state,
                        float *o, int hv0, int hv1);

/*
 * Chunked (WY / UT) form of the same recurrence for prefill (spec §4.1), for
 * value heads [hv0, hv1): the sequence is cut in chunks of `chunk` tokens
 * (the last may be shorter); within a chunk the work is dense matrix
 * products, across chunks the state is carried. Same inputs, outputs and
 * state semantics as kern_kda_recurrent, so the two must agree to rounding.
 * workspace: kern_kda_chunked_workspace_floats(sh, chunk) floats per calling
 * thread (caller-owned, reused across calls).
 */
void kern_kda_chunked(const kern_kda_shape *sh, int T, int chunk, const float *q,
                      const float *k, const float *v, const float *g, const float *beta,
                      float *state, float *o, int hv0, int hv1, float *workspace);
size_t kern_kda_chunked_workspace_floats(const kern_kda_shape *sh, int chunk);

/*
 * Gated RMSNorm of the KDA output (spec §3.6), per row of n values:
 *   y = x * rsqrt(mean(x^2) + eps) * w * sigmoid(z)
 * exactly the engine's per-head output norm (kern_rmsnorm, then the
 * sigmoid gate). x, z, y: [rows, n] float32, y may alias x (not z);
 * w: [n] of dtype `dt`, or NULL (no weight).
 */
void kern_rmsnorm_gated(const float *x, const float *z, const void *w, kern_dtype dt, int rows,
                        int n, float eps, float *y);

/* ------------------------------------------------------------------------ */
/* MLA attention, absorbed form (kda-model-spec.md §5.2; no RoPE)            */

/*
 * Widths of one MLA layer: nh heads; dc = kv_lora_rank (the latent);
 * dr = qk_rope_head_dim (the shared k_pe, not rotated); dn = qk_nope_head_dim;
 * dv = v_head_dim. Kimi-Linear: nh 32, dc 512, dr 64, dn 128, dv 128.
 * A sequence's latent cache is fp32 [n, dc + dr], row tau =
 * [rmsnorm(c_tau) * kv_a_layernorm | k_pe_tau].
 */
typedef struct kern_mla_shape {
    int nh, dc, dr, dn, dv;
} kern_mla_shape;

/* Keys per block of the CPU kernel's online softmax. */
#define KERN_MLA_KEY_BLOCK 256

/*
 * One head of absorbed MLA for T queries of one sequence at positions
 * pos .. pos+T-1 (causal: query t sees keys 0 .. pos+t), the CPU engine's
 * attention (engine/eng_forward.c):
 *   Q = [q_nope W_UK_h | q_pe] / sqrt(dn + dr)            [T, dc + dr]
 *   per block of KERN_MLA_KEY_BLOCK cache rows K_b:        [nb, dc + dr]
 *     S = Q K_b^T (masked), online softmax, Lat += P K_b[:, :dc]
 *   O_h = (Lat / l) W_UV_h^T                               [T, dv]
 *   wuk: W_UK_h [dn, dc], wuv: W_UV_h [dv, dc], fp32 (kv_b_proj rows of
 *        head h, widened);
 *   qh:  row t at qh + t*q_stride: [q_nope (dn) | q_pe (dr)];
 *   cache: [pos + T, dc + dr] fp32;
 *   oh:  row t at oh + t*o_stride, dv values written;
 *   bf16_act: from 12 queries the scores and the weighted latent round both
 *        operands to bf16 (AVX-512 BF16 dot products, ~3e-3 relative error:
 *        a prefill under eng_ctx_params.bf16_act); false: exact;
 *   workspace: kern_mla_attend_head_workspace_floats(sh, T) floats.
 */
void kern_mla_attend_head(const kern_mla_shape *sh, const float *wuk, const float *wuv,
                          const float *qh, int q_stride, int T, int64_t pos, const float *cache,
                          float *oh, int o_stride, bool bf16_act, float *workspace);
size_t kern_mla_attend_head_workspace_floats(const kern_mla_shape *sh, int T);

/*
 * Heads [h0, h1) of the same, weights in their stored dtype: head h's
 * kv_b_proj rows (W_UK_h then W_UV_h) are widened into the workspace, then
 * kern_mla_attend_head. kv_b: [nh*(dn+dv), dc] of dtype dt; q: [T, nh*(dn+dr)];
 * o: [T, nh*dv] (only the heads' columns written); cache as above;
 * workspace: kern_mla_attend_workspace_floats(sh, T) floats.
 */
void kern_mla_attend(const kern_mla_shape *sh, kern_dtype dt, const void *kv_b, const float *q,
                     int T, int64_t pos, const float *cache, float *o, int h0, int h1,
                     float *workspace);
size_t kern_mla_attend_workspace_floats(const kern_mla_shape *sh, int T);

/*
 * Heads [h0, h1) of absorbed MLA for one query (a decode step) at position
 * pos, all at once. The heads share the latent cache (MLA is MQA in the
 * latent), so each block of it is read once for all of them, not once per
 * head as kern_mla_attend_head would: at 16K of context a 32-head layer's
 * cache (38 MB, past L3) was read 64 times a token.
 *   Q = [q_nope_h W_UK_h | q_pe_h] / sqrt(dn + dr), one row per head
 *   per block of the cache K_b: S = Q K_b^T, online softmax, Lat += P K_b[:, :dc]
 *   o_h = (Lat_h / l_h) W_UV_h^T
 * kv_b: kv_b_proj [nh*(dn+dv), dc], any dtype (widened a row at a time
 * into the workspace); q: [nh*(dn+dr)]; cache: [pos + 1, dc + dr] fp32;
 * o: [nh*dv], the heads' columns written. A head's result does not depend
 * on which heads share the call. Exact (fp32).
 * workspace: kern_mla_decode_heads_workspace_floats(sh) floats.
 */
void kern_mla_decode_heads(const kern_mla_shape *sh, const kern_weight *kv_b, const float *q,
                           int h0, int h1, int64_t pos, const float *cache, float *o,
                           float *workspace);
size_t kern_mla_decode_heads_workspace_floats(const kern_mla_shape *sh);

/*
 * kern_mla_decode_heads for n rows at once, each one query of its own
 * sequence (a batched decode step): q [n, nh*(dn+dr)], pos[s] and cache[s]
 * row s's position and latent cache, o [n, nh*dv]. Each kv_b row is widened
 * once for all n rows rather than once per row (kv_b is 8 MB in bf16 at
 * Kimi-Linear's shape); row s's result is bit for bit
 * kern_mla_decode_heads of that row alone.
 * workspace: kern_mla_decode_rows_workspace_floats(sh, n) floats.
 */
void kern_mla_decode_rows(const kern_mla_shape *sh, const kern_weight *kv_b, int n,
                          const float *q, int h0, int h1, const int64_t *pos,
                          const float *const *cache, float *o, float *workspace);
size_t kern_mla_decode_rows_workspace_floats(const kern_mla_shape *sh, int n);

/* ------------------------------------------------------------------------ */
/* MoE routing (CPU reference of the CUDA routing kernels)                   */

/* Router settings, from the model config. n_group = 1 means no group limit
 * (the engine passes num_expert_group when use_grouped_topk is set and
 * num_expert_group > 1, else 1). */
typedef struct kern_moe_route_params {
    int n_experts;               /* E */
    int top_k;                   /* k <= E */
    int n_group;                 /* G: E % G == 0, G <= 256 */
    int topk_group;              /* groups kept when G > 1 */
    int renormalize;             /* weights / their sum */
    float routed_scaling_factor; /* multiplies every weight */
} kern_moe_route_params;

/*
 * Expert choice for T tokens, the engine's route_token (eng_forward.c):
 * selection by score + bias within the best topk_group groups (a group's
 * score is the sum of its two best biased scores), k rounds of "best
 * remaining" with ties to the lower expert index; weights from the
 * unbiased scores, renormalised (sum in double) when asked, times
 * routed_scaling_factor.
 *   scores [T, E] sigmoid scores; bias [E] or NULL;
 *   sel [T, k] chosen experts in selection order; w [T, k] their weights.
 */
void kern_moe_route(const kern_moe_route_params *p, int T, const float *scores, const float *bias,
                    int32_t *sel, float *w);

/*
 * Token permutation for the grouped expert products: a counting sort of the
 * T*k (token, slot) pairs by expert, stable in (token, slot) order (the
 * engine's moe_ffn gather).
 *   sel [T, k] experts in [0, E);
 *   exp_off [E + 1]: expert e's rows are [exp_off[e], exp_off[e+1]);
 *   row_of [T, k]: the gathered row of pair (t, slot);
 *   tok_of [T * k]: the token of each gathered row.
 */
void kern_moe_permute(int E, int T, int k, const int32_t *sel, int32_t *exp_off, int32_t *row_of,
                      int32_t *tok_of);

/* ------------------------------------------------------------------------ */
/* Sampling (CPU reference of kern_cuda_sample)                              */

typedef struct kern_sample_params {
    float temperature;    /* <= 0: greedy (argmax, lowest id on ties) */
    int top_k;            /* <= 0 or >= V: off */
    float top_p;          /* >= 1: off */
    float min_p;          /* <= 0: off */
    float repeat_penalty; /* 1 (or <= 0): off; divides positive logits, multiplies negative */
} kern_sample_params;

/*
 * One draw from `logits` [V], eng_sample's algorithm (engine/eng_forward.c):
 * repetition penalty on each distinct id of penalty_ids[0..n_penalty)
 * (ids outside [0, V) ignored), then greedy, or temperature -> top-k (ties
 * to the lower id) -> softmax in sorted order -> min-p -> top-p -> one
 * uniform draw from the xoshiro256** state `rng` (advanced exactly once,
 * and not at all when greedy). Scratch: p and id of V entries each.
 * Returns the token id.
 */
int32_t kern_sample(const float *logits, int V, const kern_sample_params *sp,
                    const int32_t *penalty_ids, int n_penalty, uint64_t rng[4], float *scratch_p,
                    int32_t *scratch_id);

/* xoshiro256** step (the engine's sequence RNG): returns the next output. */
uint64_t kern_rng_next(uint64_t s[4]);

#ifdef __cplusplus
}
#endif

#endif /* KERN_H */
