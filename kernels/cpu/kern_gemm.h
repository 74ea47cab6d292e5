/*
 * kern_gemm.h - the compute-bound product of prefill (internal to
 * kernels/cpu): the register-blocked micro-kernel that ops.c (element
 * formats), quant.c (block formats) and mla.c run over panels of weight
 * rows they have unpacked to f32 (kern__gemm, with AVX-512, keeps a bf16
 * matrix's panel as pairs of bf16 columns and widens them in the kernel).
 *
 * A panel is KERN_PANEL_ROWS weight rows over kc columns, transposed:
 * P [kc, R] f32 (R = KERN_PANEL_ROWS: 32 with AVX-512, 16 with AVX2),
 * P[c * R + i] = W[r + i, c0 + c], rows past the matrix's end zero. The
 * kernel keeps a tile of tokens x R rows of sums in registers (12 x 32 in
 * 24 of AVX-512's 32, 6 x 16 in 12 of AVX2's 16) and adds one column at a
 * time (one broadcast of x[t, c] times the panel's R values), so every
 * output is the plain left-to-right sum
 *     y[t, r] = fma(W[r, in-1], x[t, in-1], ... fma(W[r, 0], x[t, 0], 0))
 * whatever the panel's row, the token's place in its step, or how the
 * columns were cut into panels of kc (a later panel continues the sums the
 * earlier ones stored in y, and an f32 store and load change no bit). The
 * result therefore does not depend on T, on the thread cut, on the block
 * sizes or on the instruction set: kern_gemm_ref is its specification, bit
 * for bit.
 */
#ifndef KERN_GEMM_H
#define KERN_GEMM_H

#include <stdbool.h>
#include <stdint.h>

#include "kern.h"

/* KERN_GEMM_SIMD: this build has the GEMM (AVX-512F, or AVX2 with FMA and
 * F16C). Builds without it multiply by widened rows and BLAS
 * (kern__matmul_blas). */
#if defined(__AVX512F__)
#define KERN_GEMM_SIMD 1
#define KERN_PANEL_ROWS 32
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KERN_GEMM_SIMD 1
#define KERN_PANEL_ROWS 16
#else
#define KERN_GEMM_SIMD 0
#define KERN_PANEL_ROWS 32 /* sizes scratch only */
#endif

/* KERN_GEMM_AMX: this build can run kern__gemm_bf16x on AMX tiles (built
 * for a CPU with AMX-BF16, on Linux); whether it does is asked at run
 * time (kern__gemm_amx). */
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) &&                   \
    defined(__AMX_BF16__) && defined(__linux__) && defined(__x86_64__)
#define KERN_GEMM_AMX 1
#else
#define KERN_GEMM_AMX 0
#endif

/* Columns per panel: P (kc * R floats, at most 512 KiB) stays in L2 while
 * every tile of tokens runs over it (the AVX-512 kernel reads 128 bytes of
 * it per 24 fmas, the AVX2 kernel 64 per 12). One panel over the whole
 * row, where it fits, lets the unpacking read each weight row as one long
 * stream the hardware prefetcher follows:
 * measured on the dev machine (Zen 5, one thread, bf16 [4096, 2304]),
 * panels of 256 columns ran at 139-175 GFLOP/s, whole rows at 158-208
 * (T = 64 .. 512), widened rows + OpenBLAS sgemm at 91. */
#define KERN_PANEL_COLS 4096

/* Columns per block where kern__gemm packs x (see there): the panel (R x
 * at most 1536 floats, 192 KiB with AVX-512) stays in L2 beside the packed x of the
 * tokens running over it, and W is unpacked once per block of tokens. On
 * the dev machine (Zen 5, one thread, bf16, T = 128 .. 512) blocks of 1,536
 * ran at 79-90% of the fma peak where 4,096 (whole rows up to 4,096 wide)
 * fell to 65% at in = 4,096 (the packed x of 512 tokens, 8 MiB, read from
 * the last-level cache for every panel) and 256 to 56-71% (y read and
 * written once per block). */
#define KERN_GEMM_BLOCK_COLS 1536

/* Bytes the next panel's unpacking will read, fetched into L2 while this
 * panel computes: `rows` rows of `row_bytes` bytes, `stride` bytes apart
 * from `base` (weights come from memory once per product, and an unpacking
 * that waits for them is time the fmas do not overlap). */
typedef struct kern_prefetch {
    const char *base;
    size_t stride, row_bytes;
    int rows;
} kern_prefetch;

/*
 * y[t, i] = (accumulate ? y[t, i] : 0) + sum_{c < kc} x[t, c] * P[c * R + i]
 * for t < T, i < nr (nr <= R = KERN_PANEL_ROWS; columns nr.. of y are not
 * touched), the sum taken left to right with one fma per column.
 *   P: [kc, R] f32 (see above).   x: [T, ldx] f32, columns [0, kc) read.
 *   y: [T, ldy] f32.   T >= 1.
 *   next: NULL, or the next panel's bytes, prefetched during the first
 *   tile of tokens (a few lines per column).
 * Builds with KERN_GEMM_SIMD only (quant.c's block-format panels call it
 * with AVX-512 and with AVX2).
 */
void kern__panel_gemm(const float *P, int kc, const float *x, int ldx, int T, float *y, int ldy,
                      int nr, bool accumulate, const kern_prefetch *next);

/* kern_matmul with kern_weight's hints `streamed` and `stream_prefetch`
 * taken from `hint` (kern_matmul_w's element formats; NULL: no hints): the
 * same results, bit for bit, whatever they are. */
void kern__matmul_hinted(kern_dtype dt, const void *W, int in, const float *x, int T, float *y,
                         int ldy, int r0, int r1, float *scratch, const kern_weight *hint);

/* kern_matmul's product by BLAS: row blocks of W widened to f32 in
 * scratch (kern_matmul_scratch_floats(in); unused for f32), then sgemm.
 * A row's sums depend on the tokens beside it. Builds without the GEMM
 * (KERN_GEMM_SIMD 0) take it for T >= 64, and for a prefill's element
 * formats (kern_matmul_w_prefill) from KERN_PORTABLE_BLAS_MIN_T tokens,
 * where it beats the direct path; builds without AVX-512 for f32 rows
 * without scratch (the block formats' portable prefill). */
#define KERN_PORTABLE_BLAS_MIN_T 8
void kern__matmul_blas(kern_dtype dt, const void *W, int in, const float *x, int T, float *y,
                       int ldy, int r0, int r1, float *scratch);
/* A matrix as the GEMM reads it: element (r, c) of W [rows, in] at
 * data + (r * ld + c) * size(dt), or, cols_major (f32 only), at
 * data + (c * ld + r) * 4 (W stored transposed: the B of a product
 * x B, [in, rows]). */
typedef struct kern_gemm_w {
    kern_dtype dt; /* F32, BF16 or F16 */
    const void *data;
    int ld;
    bool cols_major;
} kern_gemm_w;

/*
 * The GEMM: y[t, r] = (accumulate ? y[t, r] : 0) + sum_{c < in} x[t, c] W(r, c)
 * for t < T, r in [r0, r1), each output the left-to-right fma chain (the
 * accumulate form continues it from y's value); the bits do not depend on
 * the scratch. x: [T, ldx]; y: [T, ldy]. Builds with KERN_GEMM_SIMD only.
 *
 * A tile is the kernel's tokens: 12 with AVX-512, 6 with AVX2. With
 * scratch_floats >= kern__gemm_scratch_floats(in, 1) (one tile): per block of
 * columns (KERN_GEMM_BLOCK_COLS), the tokens' x is packed a tile side by
 * side ([kc, tile] per tile), then per panel of R rows the panel is
 * unpacked (transposed: f32, or with AVX-512 a bf16 matrix's pairs of
 * columns as words, widened in the kernel) and run over every tile, which
 * reads one stream of x. As many tokens are packed at once as the scratch
 * holds; W is unpacked once per such block of tokens. Below that (0 included), x is
 * read in place, a tile's rows ldx apart, and scratch must hold that form's
 * panel, R * min(in, KERN_PANEL_COLS) floats, whatever scratch_floats
 * says. In place, rows a multiple of 4 KiB apart (in = 1024, 4096, 9216
 * f32) fall into one L1 set and ran at 58-68% of the fma peak where packed
 * ran at 78-85% (Zen 5, one thread, bf16 [2304, in]).
 */
void kern__gemm(const kern_gemm_w *w, int in, const float *x, int ldx, int T, float *y, int ldy,
                int r0, int r1, bool accumulate, float *scratch, size_t scratch_floats);

/* Scratch floats for kern__gemm to pack T tokens' x at once (and the
 * panel). */
size_t kern__gemm_scratch_floats(int in, int T);

/* Scratch floats of the panel that kern__gemm needs with x read in place
 * (scratch_floats below kern__gemm_scratch_floats(in, 1)), for products
 * over at most `in` columns. */
static inline size_t kern__gemm_panel_floats(int in) {
    return (size_t)KERN_PANEL_ROWS * (size_t)(in < KERN_PANEL_COLS ? in : KERN_PANEL_COLS);
}

/*
 * The GEMM with the activations rounded to bf16 (nearest even), for a bf16
 * W [rows, in] (row-major, ld = in): rows [r0, r1) of y [T, ldy] =
 * bf16(x) [T, in] W^T, two columns per AVX-512 BF16 dot product (each pair
 * of products summed, then added: not the fma chain, and x carries about
 * 3e-3 relative error). Twice the multiply-adds per instruction of the
 * exact kernel: llama.cpp's and vLLM's precision, chosen by the caller
 * (eng_ctx_params.bf16_prefill). scratch: kern_matmul_scratch_floats(in)
 * (x is rounded once per block of tokens that fits it). Builds with
 * AVX512_BF16 only.
 */
void kern__gemm_bf16act(const uint16_t *W, int in, const float *x, int T, float *y, int ldy,
                        int r0, int r1, float *scratch);

/*
 * The same for any matrix kern__gemm reads (bf16 rows, or f32 rows or
 * cols_major, each value then rounded to bf16 too), x with its own stride,
 * and the accumulate form: y[t, r] (+)= bf16(x) . bf16(W(r, .)) over `in`
 * columns. scratch: scratch_floats floats, at least 32 * ceil(min(in,
 * KERN_PANEL_COLS) / 2) + 12 * ceil(in / 2) (more: x rounded once for more
 * tokens). MLA attention's products under bf16_act.
 */
void kern__gemm_bf16x(const kern_gemm_w *w, int in, const float *x, int ldx, int T, float *y,
                      int ldy, int r0, int r1, bool accumulate, float *scratch,
                      size_t scratch_floats);

/*
 * Whether kern__gemm_bf16x (and so kern__gemm_bf16act) runs on AMX tiles
 * here: a KERN_GEMM_AMX build, a CPU with AMX-BF16, and the kernel granting
 * this process the tiles' state (asked at every call, no state kept; false
 * in every other build). With tiles, in % 32 == 0: 32 tokens x 32 rows a
 * step, each sum a chain of TDPBF16PS over 32 columns at a time (its own
 * order inside; the same bits whatever the tokens beside it and the row
 * cut, but not vdpbf16ps's bits: both carry bf16(x)'s error, the order
 * adds ~1e-6 relative). Else the vdpbf16ps kernel. Any thread.
 */
bool kern__gemm_amx(void);

/*
 * y[t, r] = bf16(x[t]) . W[r] on AMX tiles with W's rows read in place as
 * the A operand (no panel: 16 rows x 32 columns a tile, straight from the
 * matrix), x rounded to bf16 and laid out as the B operand in scratch
 * (16 * in floats a block of 32 tokens, up to 256 tokens at a time: at
 * most 128 * in, which kern_matmul_scratch_floats(in) holds): for bf16 W
 * [rows, in], in % 32 == 0, rows [r0, r1), T >= 1 tokens x [T, ldx], y
 * [T, ldy]. Each 32-row panel is read once per 256 tokens. Only where
 * kern__gemm_amx() (a KERN_GEMM_AMX build). Each sum a chain of TDPBF16PS
 * over 32 columns at a time: the same bits whatever the tokens beside it
 * and the row cut.
 */
void kern__amx_rows_bf16(const uint16_t *W, int in, const float *x, int ldx, int T, float *y,
                         int ldy, int r0, int r1, float *scratch);

/*
 * kern__amx_rows_bf16 without rounding x: y[t, r] = x[t] . W[r] with x
 * split exactly into three bf16 values (hi + mid + lo, 8 significant bits
 * each), three columns of the B operand a token, so every product is
 * exact and each column's sum a chain of TDPBF16PS (f32, round to nearest
 * even; denormals flushed, as the tiles do), the three added as
 * (hi + mid) + lo. Blocks of 10 tokens (16 * in floats each, up to 80
 * tokens at a time: at most 128 * in). The same bits whatever the tokens
 * beside it and the row cut, so a lone decode and a batched step agree.
 */
void kern__amx_rows_split(const uint16_t *W, int in, const float *x, int ldx, int T, float *y,
                          int ldy, int r0, int r1, float *scratch);

/* kern__gemm_bf16x with the choice made by the caller: amx false gives the
 * vdpbf16ps kernel even where tiles run (tests and kds_cpu_bench compare
 * the two), true the tiles where kern__gemm_amx() and in % 32 == 0. */
void kern__gemm_bf16x_on(bool amx, const kern_gemm_w *w, int in, const float *x, int ldx, int T,
                         float *y, int ldy, int r0, int r1, bool accumulate, float *scratch,
                         size_t scratch_floats);

#endif
