/*
 * quant.c - weight formats (kern.h): the byte layout of every format, the
 * values of the block formats (MXFP4, Q8_0), and the product over a weight
 * of any format (kern_matmul_w).
 *
 * A block-format product computes with the dequantised f32 values W[r, c]
 * exactly as kern_weight_row_f32 gives them (e2m1 * 2^(e - 127) and
 * int8 * f16 are the same f32 products here), so its result is the
 * dequantised matrix's product up to summation order, infinities and NaNs
 * included. Two paths, as in kern_matmul (ops.c):
 *   - Decode, T < 64 tokens (32 without AVX-512), is bound by the code
 *     bytes streamed per token.
 *     The codes and scales are read in place, eight rows per pass. An E2M1
 *     nibble becomes f32 through a 16-entry table held in a register
 *     (vpermps indexes it with the nibble): the row of E8M0_E2M1 for the
 *     block's exponent, the codes' values already times 2^(e - 127); an
 *     int8 becomes f32 by a sign-extending widen and a convert, times its
 *     f16 scale.
 *     One token decodes in registers, one FMA per 16 values; several tokens
 *     go in groups of up to three, each block decoded in registers once per
 *     group and feeding the group's FMAs in the one-token order, so row t
 *     of a T-token product is the one-token product of row t, bit for bit.
 *   - Prefill, T >= 64 (32), is bound by multiply-adds. Panels of 32 rows are
 *     dequantised into the scratch, transposed to [cols, 32] (gathers pick
 *     one code word per row), and an outer-product kernel keeps 12 tokens x
 *     32 rows of sums in registers (OpenBLAS's sgemm, the other choice,
 *     runs its generic SSE3 kernels on this CPU: docs/benchmarks.md).
 * The AVX-512 paths are chosen at compile time. With AVX2 (and FMA, F16C)
 * instead, the same two paths in eight lanes (the "AVX2" section below):
 *   - Decode: one row at a time, each block decoded in registers once per
 *     pair of tokens; an E2M1 nibble becomes f32 through vpermps on the
 *     block's row of E8M0_E2M1 (its eight magnitudes; the sign XORed in),
 *     an int8 as with AVX-512. Four chains per (row, token), so row t of a
 *     T-token product is the one-token product of row t, bit for bit.
 *   - Prefill (from KERN_PREFILL_GEMM_MIN_T tokens; kern_matmul_w from
 *     64): panels of 16 rows dequantised, transposed and run through the
 *     AVX2 GEMM (kern_gemm.h).
 * Without either, the scalar loops below run (one block of 32 values
 * dequantised at a time for decode; rows dequantised to f32 and BLAS for
 * prefill): they are the portable path and the readable specification.
 */
#include "kern.h"
#include "kern_gemm.h"
#include "kern_simd.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

int kern_dtype_is_block(kern_dtype dt) { return dt == KERN_MXFP4 || dt == KERN_Q8_0; }

const char *kern_dtype_name(kern_dtype dt) {
    switch (dt) {
    case KERN_F32: return "f32";
    case KERN_BF16: return "bf16";
    case KERN_F16: return "f16";
    case KERN_MXFP4: return "mxfp4";
    case KERN_Q8_0: return "q8_0";
    }
    return "?";
}

kern_layout kern_weight_layout(kern_dtype dt, int64_t rows, int64_t cols) {
    kern_layout l = {0, 0, 0, 0, 0};
    if (rows < 0 || cols < 0) return l;
    switch (dt) {
    case KERN_F32:
    case KERN_BF16:
    case KERN_F16: l.row_bytes = (size_t)cols * kern_dtype_size(dt); break;
    case KERN_MXFP4:
        if (cols % KERN_BLOCK) return l;
        l.row_bytes = (size_t)cols / 2;                    /* two codes per byte */
        l.scale_row_bytes = (size_t)(cols / KERN_BLOCK);   /* one E8M0 byte per block */
        break;
    case KERN_Q8_0:
        if (cols % KERN_BLOCK) return l;
        l.row_bytes = (size_t)cols;                        /* one int8 per value */
        l.scale_row_bytes = (size_t)(cols / KERN_BLOCK) * 2; /* one f16 per block */
        break;
    default: return l;
    }
    l.data_bytes = l.row_bytes * (size_t)rows;
    l.scale_bytes = l.scale_row_bytes * (size_t)rows;
    l.bytes = l.data_bytes + l.scale_bytes;
    return l;
}

float kern_e2m1_to_f32(unsigned code) {
    static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float v = mag[code & 7u];
    return code & 8u ? -v : v;
}

float kern_e8m0_to_f32(uint8_t e) {
    if (e == 255) return NAN;
    return ldexpf(1.0f, (int)e - 127); /* exact: every 2^k, k in [-127, 127], is a float */
}

#if KERN_AVX2
static void row_blocks_f32_avx2(const kern_weight *w, const kern_layout *l, int r, int b0, int b1,
                                float *out);
#endif

void kern_weight_row_f32(const kern_weight *w, int r, int c0, int c1, float *out) {
    const kern_layout l = kern_weight_layout(w->dt, w->rows, w->cols);
#if KERN_AVX2
    /* the whole blocks vectorised (the same values), the ends below */
    if (kern_dtype_is_block(w->dt) && c1 - c0 >= KERN_BLOCK) {
        const int b0 = (c0 + KERN_BLOCK - 1) / KERN_BLOCK, b1 = c1 / KERN_BLOCK;
        if (b0 < b1) {
            kern_weight_row_f32(w, r, c0, b0 * KERN_BLOCK, out);
            row_blocks_f32_avx2(w, &l, r, b0, b1, out + (b0 * KERN_BLOCK - c0));
            kern_weight_row_f32(w, r, b1 * KERN_BLOCK, c1, out + (b1 * KERN_BLOCK - c0));
            return;
        }
    }
#endif
    const unsigned char *row = (const unsigned char *)w->data + (size_t)r * l.row_bytes;
    /* element formats have no scales (NULL): no arithmetic on that pointer,
     * which is undefined even with a zero offset */
    const unsigned char *sc =
        w->scales ? (const unsigned char *)w->scales + (size_t)r * l.scale_row_bytes : NULL;
    switch (w->dt) {
    case KERN_F32:
    case KERN_BF16:
    case KERN_F16:
        kern_to_f32(w->dt, row + (size_t)c0 * kern_dtype_size(w->dt), out, (size_t)(c1 - c0));
        return;
    /* block formats: each block's scale converted once (MLA attention
     * widens its kv_b rows this way for every head at every step) */
    case KERN_MXFP4:
        for (int c = c0; c < c1;) {
            const int b = c / KERN_BLOCK, end = (b + 1) * KERN_BLOCK < c1 ? (b + 1) * KERN_BLOCK : c1;
            const float scale = kern_e8m0_to_f32(sc[b]);
            for (; c < end; c++) {
                const unsigned byte = row[c / 2], code = c % 2 ? byte >> 4 : byte & 15u;
                out[c - c0] = kern_e2m1_to_f32(code) * scale;
            }
        }
        return;
    case KERN_Q8_0:
        for (int c = c0; c < c1;) {
            const int b = c / KERN_BLOCK, end = (b + 1) * KERN_BLOCK < c1 ? (b + 1) * KERN_BLOCK : c1;
            uint16_t h;
            memcpy(&h, sc + (size_t)b * 2, sizeof h);
            const float scale = kern_f16_to_f32(h);
            for (; c < end; c++) out[c - c0] = (float)(int8_t)row[c] * scale;
        }
        return;
    }
}

/* ------------------------------------------------------------------------ */
/* Products                                                                  */

/* From this many tokens the prefill path (dequantised panels) wins: the
 * direct path's cost grows with every token, the panels' is paid once per
 * 32 rows. With AVX-512 the direct path decodes a block once per three
 * tokens in registers and stays ahead up to 63 (kds_cpu_bench (c), MXFP4
 * [3072, 3584] from L3, one thread: 32 tokens 3.7 ms direct against 4.5-4.8
 * ms in panels, 48: 5.8 against 6.4-6.6; the K3 slice's 64-token prefill,
 * whose experts get ~32 tokens each, 106-108 -> 124-128 tok/s), the same
 * threshold as kern_matmul's. The portable path (kern_matmul_w_ref) keeps
 * 32: its direct loop is scalar and BLAS is not. */
#define QUANT_REF_GEMM_MIN_T 32
/* kern_matmul_w's change-over in every build: below it a token's row is its
 * one-token product (batched decode). The portable build's kern_matmul_w
 * runs direct_scalar up to it; its prefill keeps kern_matmul_w_ref's 32.
 * An AVX2 build's kern_matmul_w runs direct_avx2 up to it; its prefill
 * takes the panels from KERN_PREFILL_GEMM_MIN_T. */
#define QUANT_GEMM_MIN_T 64

#if KERN_AVX512
/* The f32 scales of rows [r, r + nr), one per block: sg [nr, ld] (the
 * first nb of each row of ld; ld is unused when nr is 1). Row r's scales start at scales + r *
 * scale_row_bytes; f16 scales are read with memcpy, as they need not be
 * 2-byte aligned. */
static void row_scales(const kern_weight *w, const kern_layout *l, int r, int nr, float *sg,
                       size_t ld) {
    const int nb = w->cols / KERN_BLOCK;
    for (int k = 0; k < nr; k++) {
        const unsigned char *sc =
            (const unsigned char *)w->scales + (size_t)(r + k) * l->scale_row_bytes;
        float *out = sg + (size_t)k * ld;
        int b = 0;
        if (w->dt == KERN_MXFP4) {
#if KERN_AVX512
            /* 2^(e - 127) built in the exponent bits: e << 23 for e in
             * [1, 254]; e = 0 is the denormal 2^-127 (mantissa bit 22),
             * e = 255 NaN, as kern_e8m0_to_f32 says. */
            const __m512i zero = _mm512_setzero_si512(), ff = _mm512_set1_epi32(255);
            for (; b + 16 <= nb; b += 16) {
                const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sc + b)));
                __m512i f = _mm512_slli_epi32(e, 23);
                f = _mm512_mask_mov_epi32(f, _mm512_cmpeq_epi32_mask(e, zero),
                                          _mm512_set1_epi32(0x00400000));
                f = _mm512_mask_mov_epi32(f, _mm512_cmpeq_epi32_mask(e, ff),
                                          _mm512_set1_epi32(0x7fc00000));
                _mm512_storeu_ps(out + b, _mm512_castsi512_ps(f));
            }
#endif
            for (; b < nb; b++)
                out[b] = kern_e8m0_to_f32(sc[b]);
        } else {
#if KERN_AVX512
            for (; b + 16 <= nb; b += 16)
                _mm512_storeu_ps(
                    out + b, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 2 * b))));
#endif
            for (; b < nb; b++) {
                uint16_t h;
                memcpy(&h, sc + 2 * (size_t)b, sizeof h);
                out[b] = kern_f16_to_f32(h);
            }
        }
    }
}
#endif

/* The portable direct path: per row, one block of 32 values dequantised at
 * a time (kern_weight_row_f32, the definition) and dotted with every
 * token, each token's sum in column order, so a token's result does not
 * depend on the others. x [T, in]; y [T, ldy]. */
static void direct_scalar(const kern_weight *w, const float *x, int T, float *y, int ldy, int r0,
                          int r1) {
    const int in = w->cols;
    float wb[KERN_BLOCK], acc[QUANT_GEMM_MIN_T];
    for (int r = r0; r < r1; r++) {
        for (int t = 0; t < T; t++)
            acc[t] = 0.0f;
        for (int c0 = 0; c0 < in; c0 += KERN_BLOCK) {
            kern_weight_row_f32(w, r, c0, c0 + KERN_BLOCK, wb);
            for (int t = 0; t < T; t++)
                for (int j = 0; j < KERN_BLOCK; j++)
                    acc[t] += wb[j] * x[(size_t)t * in + c0 + j];
        }
        for (int t = 0; t < T; t++)
            y[(size_t)t * ldy + r] = acc[t];
    }
}

/* The portable prefill path: blocks of up to 128 rows dequantised to f32
 * in the scratch ([nr, in]) and multiplied as f32 weights (BLAS). */
static void gemm_scalar(const kern_weight *w, const float *x, int T, float *y, int ldy, int r0,
                        int r1, float *scratch) {
    const int in = w->cols;
    for (int rb = r0; rb < r1; rb += 128) {
        const int nr = r1 - rb < 128 ? r1 - rb : 128;
        for (int r = 0; r < nr; r++) kern_weight_row_f32(w, rb + r, 0, in, scratch + (size_t)r * in);
        /* the block is f32 now: rows [0, nr) of it land in y's columns rb.. */
        kern_matmul(KERN_F32, scratch, in, x, T, y + rb, ldy, 0, nr, NULL);
    }
}

#if KERN_AVX512 || KERN_AVX2
/* x [T, in] -> xs [T, in] with each block of 32 as its 16 even then its 16
 * odd values: the order of an MXFP4 block's low and high nibbles, so the
 * 16 bytes of a block widened to 16 lanes give the weights of xs's first
 * half (low nibbles) and second half (high nibbles). */
static void split_even_odd(const float *x, size_t n, float *xs) {
    size_t i = 0;
#if KERN_AVX512
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (; i + 32 <= n; i += 32) {
        const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        _mm512_storeu_ps(xs + i, _mm512_permutex2var_ps(a, ev, b));
        _mm512_storeu_ps(xs + i + 16, _mm512_permutex2var_ps(a, od, b));
    }
#endif
    for (; i < n; i += 32) /* the scalar form (n is a multiple of 32), AVX2's */
        for (int j = 0; j < 16; j++) {
            xs[i + j] = x[i + 2 * j];
            xs[i + 16 + j] = x[i + 2 * j + 1];
        }
}

/* E8M0_E2M1[e][c] = kern_e2m1_to_f32(c) * kern_e8m0_to_f32(e): the f32
 * values of the dequantised weights (exact; denormal for the smallest e;
 * +-inf where 2^(e - 127) times the code passes f32's range; NaN for e =
 * 255), written out by the compiler. Row e is the table vpermps reads for
 * a block of scale e: loading it costs no multiply (one uop less per block
 * and row than scaling E2M1 by 2^(e - 127)) and no microcode assist (a
 * multiply with denormal results takes one, ~150 cycles on Intel cores,
 * and the quantiser gives all-zero blocks e = 0). 16 KiB, a 64-byte line per
 * exponent: the few exponents a weight uses stay in L1. Row 127 is E2M1
 * itself. */
#define E2M1_ROW(s)                                                                                \
    {                                                                                              \
        0.0f * (s), 0.5f * (s), 1.0f * (s), 1.5f * (s), 2.0f * (s), 3.0f * (s), 4.0f * (s),        \
            6.0f * (s), -0.0f * (s), -0.5f * (s), -1.0f * (s), -1.5f * (s), -2.0f * (s),           \
            -3.0f * (s), -4.0f * (s), -6.0f * (s)                                                  \
    }
/* The rows of 15 (16) consecutive exponents from scale s = 2^(e0 - 127),
 * each scale twice the one before (exact: powers of two). */
#define E2M1_ROWS15(s)                                                                             \
    E2M1_ROW(s), E2M1_ROW((s)*0x1p1f), E2M1_ROW((s)*0x1p2f), E2M1_ROW((s)*0x1p3f),                 \
        E2M1_ROW((s)*0x1p4f), E2M1_ROW((s)*0x1p5f), E2M1_ROW((s)*0x1p6f), E2M1_ROW((s)*0x1p7f),    \
        E2M1_ROW((s)*0x1p8f), E2M1_ROW((s)*0x1p9f), E2M1_ROW((s)*0x1p10f), E2M1_ROW((s)*0x1p11f),  \
        E2M1_ROW((s)*0x1p12f), E2M1_ROW((s)*0x1p13f), E2M1_ROW((s)*0x1p14f)
#define E2M1_ROWS16(s) E2M1_ROWS15(s), E2M1_ROW((s)*0x1p15f)
_Alignas(64) static const float E8M0_E2M1[256][16] = {
    E2M1_ROWS16(0x1p-127f), E2M1_ROWS16(0x1p-111f), E2M1_ROWS16(0x1p-95f),
    E2M1_ROWS16(0x1p-79f),  E2M1_ROWS16(0x1p-63f),  E2M1_ROWS16(0x1p-47f),
    E2M1_ROWS16(0x1p-31f),  E2M1_ROWS16(0x1p-15f),  E2M1_ROWS16(0x1p1f),
    E2M1_ROWS16(0x1p17f),   E2M1_ROWS16(0x1p33f),   E2M1_ROWS16(0x1p49f),
    E2M1_ROWS16(0x1p65f),   E2M1_ROWS16(0x1p81f),   E2M1_ROWS16(0x1p97f),
    E2M1_ROWS15(0x1p113f), /* e = 240 .. 254 */
    E2M1_ROW(NAN),         /* e = 255 */
};
#define E2M1 (E8M0_E2M1[127])
#endif

#if KERN_AVX512

/* Block b of one row as two vectors of f32 weights, w0 for x's (or xs's)
 * values 0-15 of the block, w1 for 16-31. `sw` is the block's scale word
 * (scale_words): MXFP4, the byte offset of its row of E8M0_E2M1;
 * Q8_0, its f32 scale. MXFP4: the 16 code bytes widened to 16 lanes;
 * vpermps reads the low 4 bits of a lane, so the lane is the even
 * element's index into the row and the lane shifted right by 4 the odd
 * one's. Q8_0: the 32 int8 widened and converted, times the scale. */
static inline void block_values(const kern_dtype dt, const unsigned char *codes, int b,
                                const unsigned char *sw, __m512 *w0, __m512 *w1) {
    if (dt == KERN_MXFP4) {
        uint32_t off; /* 64 e: its row's byte offset, used as loaded (a zero-extending load
                       * and the table address; e * 16 floats cost a shift back and forth) */
        memcpy(&off, sw, sizeof off);
        const __m512 tab = _mm512_load_ps((const float *)((const char *)E8M0_E2M1 + off));
        const __m512i v =
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16 * (size_t)b)));
        *w0 = _mm512_permutexvar_ps(v, tab);
        *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tab);
    } else {
        float s;
        memcpy(&s, sw, sizeof s);
        const __m512 sv = _mm512_set1_ps(s);
        const unsigned char *p = codes + 32 * (size_t)b;
        const __m128i q0 = _mm_loadu_si128((const __m128i *)p);
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(p + 16));
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), sv);
        *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), sv);
    }
}

/* The scale words of rows [r, r + nr), one 4-byte word per block, row k's
 * at sw + k * ld bytes: MXFP4, e * 64 (the byte offset of row e of
 * E8M0_E2M1); Q8_0, the f32 scale (row_scales). */
static void scale_words(const kern_weight *w, const kern_layout *l, int r, int nr,
                        unsigned char *sw, size_t ld) {
    if (w->dt != KERN_MXFP4) {
        for (int k = 0; k < nr; k++)
            row_scales(w, l, r + k, 1, (float *)(void *)(sw + (size_t)k * ld), 0);
        return;
    }
    const int nb = w->cols / KERN_BLOCK;
    for (int k = 0; k < nr; k++) {
        const unsigned char *sc =
            (const unsigned char *)w->scales + (size_t)(r + k) * l->scale_row_bytes;
        unsigned char *out = sw + (size_t)k * ld;
        int b = 0;
        for (; b + 16 <= nb; b += 16) {
            const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sc + b)));
            _mm512_storeu_si512((void *)(out + 4 * (size_t)b), _mm512_slli_epi32(e, 6));
        }
        for (; b < nb; b++) { /* the scalar form */
            const uint32_t off = 64u * sc[b];
            memcpy(out + 4 * (size_t)b, &off, sizeof off);
        }
    }
}

/* Prefetch distance of the direct path in rows: ~16 KiB ahead, at least
 * the next eight rows (ops.c's dot8_bf16 found the hardware prefetcher
 * alone left decode well short of bandwidth). x86 prefetches never fault,
 * so running past the last row is harmless. The rows ahead go to L2
 * (_MM_HINT_T1), not L1: a whole group of eight rows ahead (14 KiB at
 * 3,584 columns) beside x split even/odd (14 KiB) and the rows being read
 * crowded the 48 KiB L1 and evicted lines before their use; to L2 the
 * MXFP4 product ran 1.4-1.6x faster on the Emerald Rapids dev VM (T = 1,
 * [3072, 3584] and [3584, 3072], from L3 and from memory, one thread;
 * kds_cpu_bench (b), two rounds alternating the binaries). */
static int prefetch_rows(size_t row_bytes) {
    return 16384 / row_bytes > 8 ? (int)(16384 / row_bytes) : 8;
}

/* One token, rows [r, r + 8) starting at codes c (row stride rb): each
 * block of the eight rows decoded in registers and multiplied into that
 * row's accumulator (16 lanes of partial sums), then one reduction gives
 * the eight sums, y[0..8). sw: the rows' scale words, row k's at byte
 * offset k * rb (the code rows' stride, so one offset register serves a
 * row's codes and its scales and the loop needs no spilled pointers). dt
 * is a constant at each call (direct_avx512), so the format's branches
 * fold away. */
static inline void rows8_one_token(const kern_dtype dt, const unsigned char *c, size_t rb, int nb,
                                   const unsigned char *sw, const float *xs, float *y) {
    const int bb = dt == KERN_MXFP4 ? 16 : 32; /* code bytes per block */
    const int per_line = 64 / bb, pf = prefetch_rows(rb);
    /* the prefetched rows through their own pointer, at the same offsets
     * k * rb as the rows read (no second set of offsets to keep in
     * registers: with eight it spilled to vector registers and cost a move
     * per prefetch) */
    const unsigned char *cp = c + (size_t)pf * rb;
    __m512 acc[8];
    for (int k = 0; k < 8; k++)
        acc[k] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, c += bb, cp += bb, sw += 4) {
        if (b % per_line == 0)
            for (int k = 0; k < 8; k++)
                _mm_prefetch((const char *)(cp + k * rb), _MM_HINT_T1);
        const __m512 x0 = _mm512_loadu_ps(xs + 32 * (size_t)b);
        const __m512 x1 = _mm512_loadu_ps(xs + 32 * (size_t)b + 16);
        for (int k = 0; k < 8; k++) {
            __m512 w0, w1;
            block_values(dt, c + k * rb, 0, sw + k * rb, &w0, &w1);
            acc[k] = _mm512_fmadd_ps(w0, x0, acc[k]);
            acc[k] = _mm512_fmadd_ps(w1, x1, acc[k]);
        }
    }
    _mm256_storeu_ps(y, reduce8(acc));
}

/* Blocks [b0, b1) of rows [r, r + 8) (codes c, row stride rb; scale words
 * sw at the same stride) for nt (1..3, a constant at each call) tokens x0
 * [nt, in] (split even/odd for MXFP4), continuing the running sums acc[t][k]
 * (16 lanes each): each block of each row is decoded once in registers and
 * feeds the nt tokens' FMAs, in the order rows8_one_token gives them, so a
 * token's sums are the ones it gets alone. pf > 0: every row is prefetched
 * pf rows on (into L2, as rows8_one_token). */
static inline __attribute__((always_inline)) void
rows8_group(const kern_dtype dt, const unsigned char *c, size_t rb, int in,
            const unsigned char *sw, const float *x0, const int nt, int b0, int b1, int pf,
            __m512 (*acc)[8]) {
    const int bb = dt == KERN_MXFP4 ? 16 : 32;
    const int per_line = 64 / bb;
    __m512 a[3][8];
    for (int j = 0; j < nt; j++)
        for (int k = 0; k < 8; k++) a[j][k] = acc[j][k];
    for (int b = b0; b < b1; b++) {
        if (pf > 0 && b % per_line == 0)
            for (int k = 0; k < 8; k++)
                _mm_prefetch((const char *)(c + (size_t)(k + pf) * rb + (size_t)b * bb),
                             _MM_HINT_T1);
        for (int k = 0; k < 8; k++) {
            __m512 w0, w1;
            block_values(dt, c + k * rb, b, sw + k * rb + 4 * (size_t)b, &w0, &w1);
            for (int j = 0; j < nt; j++) {
                const float *xj = x0 + (size_t)j * in + 32 * (size_t)b;
                a[j][k] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xj), a[j][k]);
                a[j][k] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xj + 16), a[j][k]);
            }
        }
    }
    for (int j = 0; j < nt; j++)
        for (int k = 0; k < 8; k++) acc[j][k] = a[j][k];
}

/* Blocks per column block when more than three tokens share eight rows:
 * the rows' block (8 x 256 MXFP4 / 512 Q8_0 bytes) and the tokens' x
 * (up to 63 x 2 KiB) stay in L1 / L2 while every group of three runs over
 * them. */
#define QUANT_COL_BLOCKS 16

/* T (2 .. QUANT_GEMM_MIN_T - 1) tokens, rows [r, r + 8): the tokens go in
 * groups of up to three (rows8_group: 8 x 3 sums in registers, each block
 * decoded once per group). Up to three tokens take whole rows, read from
 * memory as eight
 * streams; more go over column blocks of QUANT_COL_BLOCKS, the first group
 * reading a block from memory and the others from cache. Decoding a block
 * once per group costs less than decoding it once into an L1 tile that
 * every token reads back (the path before: two tokens took 3.5x one
 * token's time, kds_cpu_bench (c)). xs [T, in]; y [T, ldy]. */
static inline void rows8_tokens(const kern_dtype dt, const unsigned char *c, size_t rb, int nb,
                                const unsigned char *sw, const float *xs, int T, float *y,
                                int ldy) {
    const int pf = prefetch_rows(rb), in = nb * KERN_BLOCK;
    __m512 acc[QUANT_GEMM_MIN_T][8];
    for (int t = 0; t < T; t++)
        for (int k = 0; k < 8; k++) acc[t][k] = _mm512_setzero_ps();
    const int cb = T <= 3 ? nb : QUANT_COL_BLOCKS;
    for (int b0 = 0; b0 < nb; b0 += cb) {
        const int b1 = nb - b0 < cb ? nb : b0 + cb;
        for (int t = 0; t < T; t += 3) {
            const float *x0 = xs + (size_t)t * in;
            const int p = t == 0 ? pf : 0;
            if (T - t >= 3)
                rows8_group(dt, c, rb, in, sw, x0, 3, b0, b1, p, acc + t);
            else if (T - t == 2)
                rows8_group(dt, c, rb, in, sw, x0, 2, b0, b1, p, acc + t);
            else
                rows8_group(dt, c, rb, in, sw, x0, 1, b0, b1, p, acc + t);
        }
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(y + (size_t)t * ldy, reduce8(acc[t]));
}

/* One row (past the last multiple of 8), every token in turn, at every T
 * alike: sw, its nb scale words. */
static inline void row1_tokens(const kern_dtype dt, const unsigned char *c, int nb,
                               const unsigned char *sw, const float *xs, int T, float *y, int ldy) {
    const int in = nb * KERN_BLOCK;
    for (int t = 0; t < T; t++) {
        const float *xt = xs + (size_t)t * in;
        __m512 a = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m512 w0, w1;
            block_values(dt, c, b, sw + 4 * (size_t)b, &w0, &w1);
            a = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt + 32 * (size_t)b), a);
            a = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 32 * (size_t)b + 16), a);
        }
        y[(size_t)t * ldy] = _mm512_reduce_add_ps(a);
    }
}

/* The direct path, rows [r0, r1) for T < 64 tokens: eight rows at a time
 * (one token: rows8_one_token; several: rows8_tokens), the rest one by
 * one. xs [T, in]: x, split even/odd for MXFP4; sw: 8 * row_bytes bytes
 * of scratch (the scale words of eight rows at the code rows' stride). */
static inline void direct_rows(const kern_dtype dt, const kern_weight *w, const kern_layout *l,
                               const float *xs, int T, float *y, int ldy, int r0, int r1,
                               unsigned char *sw) {
    const int nb = w->cols / KERN_BLOCK;
    const size_t rb = l->row_bytes, srb = l->scale_row_bytes;
    const unsigned char *codes = w->data, *scales = w->scales;
    int r = r0;
    for (; r + 8 <= r1; r += 8) {
        for (size_t i = 0; i < 8 * srb; i += 64) /* the next group's scales */
            _mm_prefetch((const char *)(scales + (size_t)(r + 8) * srb + i), _MM_HINT_T0);
        scale_words(w, l, r, 8, sw, rb);
        if (T == 1)
            rows8_one_token(dt, codes + (size_t)r * rb, rb, nb, sw, xs, y + r);
        else
            rows8_tokens(dt, codes + (size_t)r * rb, rb, nb, sw, xs, T, y + r, ldy);
    }
    for (; r < r1; r++) {
        scale_words(w, l, r, 1, sw, rb);
        row1_tokens(dt, codes + (size_t)r * rb, nb, sw, xs, T, y + r, ldy);
    }
}

static void direct_avx512(const kern_weight *w, const kern_layout *l, const float *xs, int T,
                          float *y, int ldy, int r0, int r1, unsigned char *sw) {
    if (w->dt == KERN_MXFP4)
        direct_rows(KERN_MXFP4, w, l, xs, T, y, ldy, r0, r1, sw);
    else
        direct_rows(KERN_Q8_0, w, l, xs, T, y, ldy, r0, r1, sw);
}

/* Rows of a prefill panel (kern_gemm.h). */
#define PANEL_ROWS KERN_PANEL_ROWS

/* Rows [r, r + nr) (nr <= 32) dequantised into P [in, 32]: P[c * 32 + i] =
 * W[r + i, c], rows nr..31 zero. sg [nr, nb]: the rows' scales. Lane i of
 * a gather reads 4 code bytes of row r + 16 h + i: 8 MXFP4 codes (column
 * 8 m + q in bits 4q..4q+3) or 4 int8 (column 4 m + q in bits 8q..8q+7),
 * which become 8 (or 4) columns of P, 16 rows each. */
static void pack_panel(const kern_weight *w, const kern_layout *l, int r, int nr, const float *sg,
                       float *P) {
    const int in = w->cols, nb = in / KERN_BLOCK;
    const __m512 e2m1 = _mm512_load_ps(E2M1);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i idx = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)l->row_bytes));
    const __m512i sidx = _mm512_mullo_epi32(lane, _mm512_set1_epi32(nb));
    for (int h = 0; h < 2; h++) {
        const int left = nr - 16 * h;
        const __mmask16 m = left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        const unsigned char *c =
            (const unsigned char *)w->data + (size_t)(r + 16 * h) * l->row_bytes;
        const float *s = sg + (size_t)16 * h * nb;
        float *p = P + 16 * h;
        for (int b = 0; b < nb; b++) {
            /* masked-off lanes read nothing and give 0 * 0 = 0 */
            const __m512 sv = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, sidx, s + b, 4);
            if (w->dt == KERN_MXFP4) {
                for (int q4 = 0; q4 < 4; q4++) {
                    const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx,
                                                                  c + 16 * (size_t)b + 4 * q4, 1);
                    for (int q = 0; q < 8; q++) {
                        const __m512 v = _mm512_permutexvar_ps(_mm512_srli_epi32(g, 4 * q), e2m1);
                        _mm512_storeu_ps(p + (size_t)(32 * b + 8 * q4 + q) * PANEL_ROWS,
                                         _mm512_mul_ps(v, sv));
                    }
                }
            } else {
                for (int q4 = 0; q4 < 8; q4++) {
                    const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx,
                                                                  c + 32 * (size_t)b + 4 * q4, 1);
                    for (int q = 0; q < 4; q++) {
                        const __m512i v = _mm512_srai_epi32(_mm512_slli_epi32(g, 24 - 8 * q), 24);
                        _mm512_storeu_ps(p + (size_t)(32 * b + 4 * q4 + q) * PANEL_ROWS,
                                         _mm512_mul_ps(_mm512_cvtepi32_ps(v), sv));
                    }
                }
            }
        }
    }
}

/* The prefill path: per panel of 32 rows, the scales (sg [32, nb]) and the
 * transposed f32 panel (P [in, 32], 32 * in floats of scratch, in L2 while
 * every 12 tokens run over it). */
static void gemm_avx512(const kern_weight *w, const kern_layout *l, const float *x, int T, float *y,
                        int ldy, int r0, int r1, float *scratch) {
    const int in = w->cols;
    float *P = scratch, *sg = scratch + (size_t)PANEL_ROWS * in;
    for (int r = r0; r < r1; r += PANEL_ROWS) {
        const int nr = r1 - r < PANEL_ROWS ? r1 - r : PANEL_ROWS;
        row_scales(w, l, r, nr, sg, (size_t)in / KERN_BLOCK);
        pack_panel(w, l, r, nr, sg, P);
        kern__panel_gemm(P, in, x, in, T, y + r, ldy, nr, false, NULL);
    }
}
#endif

#if KERN_AVX2
/* ------------------------------------------------------------------------ */
/* Without AVX-512: AVX2 + FMA + F16C                                        */

/* Block b of a row (codes c) as four vectors of eight f32 weights, exactly
 * kern_weight_row_f32's values, in the order of x split as split_even_odd
 * gives it for MXFP4 (w[0] even values 0-7 of the block, w[1] even 8-15,
 * w[2] odd 0-7, w[3] odd 8-15) and in column order for Q8_0 (w[h] columns
 * 8h..8h+7). `tabx` (MXFP4) and `scale` (Q8_0): block_scale_avx2's.
 * MXFP4: each code byte widened to a 32-bit lane; vpermps reads a lane's
 * low three bits, the magnitude m of its low nibble (and, shifted right by
 * 4, of its high one), from tabx, whose entry m is the magnitude's f32
 * bits XOR m << 28; the nibble shifted left by 28 (m at bits 28-30, the
 * sign at 31, the rest shifted out) XORed in takes those bits back out
 * and puts the sign in: the table's negative half with no second table
 * and no mask (-0 stays -0, NaN stays NaN: XOR twice is the identity on
 * any bits). Three operations per eight weights. Q8_0: the int8 widened
 * and converted, times the scale. */
static inline __attribute__((always_inline)) void
block_values_avx2(const kern_dtype dt, const unsigned char *c, int b, __m256 tabx, __m256 scale,
                  __m256 w[4]) {
    if (dt == KERN_MXFP4) {
        const unsigned char *p = c + 16 * (size_t)b;
        for (int h = 0; h < 2; h++) {
            const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h)));
            const __m256i hi = _mm256_srli_epi32(lo, 4);
            w[h] = _mm256_xor_ps(_mm256_permutevar8x32_ps(tabx, lo),
                                 _mm256_castsi256_ps(_mm256_slli_epi32(lo, 28)));
            w[2 + h] = _mm256_xor_ps(_mm256_permutevar8x32_ps(tabx, hi),
                                     _mm256_castsi256_ps(_mm256_slli_epi32(hi, 28)));
        }
    } else {
        const unsigned char *p = c + 32 * (size_t)b;
        for (int h = 0; h < 4; h++) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(p + 8 * h));
            w[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scale);
        }
    }
}

/* Block b's table (MXFP4: row sc[b] of E8M0_E2M1, the magnitudes times the
 * block's scale, entry m XOR m << 28 as block_values_avx2 reads it) or
 * broadcast scale (Q8_0); sc: the row's scales. */
static inline __attribute__((always_inline)) void block_scale_avx2(const kern_dtype dt,
                                                                   const unsigned char *sc, int b,
                                                                   __m256 *tabx, __m256 *scale) {
    if (dt == KERN_MXFP4) {
        const __m256i m28 = _mm256_setr_epi32(0, 1 << 28, 2 << 28, 3 << 28, 4 << 28, 5 << 28,
                                              6 << 28, 7 << 28);
        *tabx = _mm256_xor_ps(_mm256_load_ps(E8M0_E2M1[sc[b]]), _mm256_castsi256_ps(m28));
    } else {
        uint16_t h;
        memcpy(&h, sc + 2 * (size_t)b, sizeof h);
        *scale = _mm256_set1_ps(_cvtsh_ss(h));
    }
}

/* One row (codes c, scales sc) dotted with nt (1 or 2, a constant at
 * each call) tokens xs [nt, in] (split even/odd for MXFP4), into y[t *
 * ldy]. Each block is decoded once for the nt tokens. Each (row, token)
 * sum is four eight-lane chains, one per vector h of a block (so that a
 * row's chains do not wait on the FMA's latency: one chain took four
 * dependent FMAs a block), added ((h0 + h1) + (h2 + h3)) and then by
 * hsum8 (kern_simd.h): the same whatever nt, so a token's results are its
 * lone product's, bit for bit. pf > 0: the row's line pf bytes on is
 * prefetched as the loop passes each block. */
static inline __attribute__((always_inline)) void
qrow_avx2(const kern_dtype dt, const unsigned char *c, const unsigned char *sc, int nb,
          const float *xs, const int nt, float *y, int ldy, size_t pf) {
    const int in = nb * KERN_BLOCK, bb = dt == KERN_MXFP4 ? 16 : 32;
    __m256 a[2][4];
    for (int j = 0; j < nt; j++)
        for (int h = 0; h < 4; h++) a[j][h] = _mm256_setzero_ps();
    __m256 tab = _mm256_setzero_ps(), scale = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        if (pf) _mm_prefetch((const char *)(c + (size_t)b * bb) + pf, _MM_HINT_T0);
        block_scale_avx2(dt, sc, b, &tab, &scale);
        __m256 w[4];
        block_values_avx2(dt, c, b, tab, scale, w);
        for (int j = 0; j < nt; j++) {
            const float *xb = xs + (size_t)j * in + 32 * (size_t)b;
            for (int h = 0; h < 4; h++)
                a[j][h] = _mm256_fmadd_ps(w[h], _mm256_loadu_ps(xb + 8 * h), a[j][h]);
        }
    }
    for (int j = 0; j < nt; j++) {
        const __m256 v = _mm256_add_ps(_mm256_add_ps(a[j][0], a[j][1]),
                                       _mm256_add_ps(a[j][2], a[j][3]));
        y[(size_t)j * ldy] = hsum8(v);
    }
}

/* Rows [r0, r1) of the product, each row over the tokens in pairs:
 * qrow_avx2 with the format and token count constants, in a function of
 * its own (GCC 12 spilled tiles inlined into a bigger caller: ops.c's
 * rows4_tile_body). The rows are read one after another, one stream,
 * prefetched pf bytes ahead by the first pair. */
static __attribute__((noinline)) void qrows_avx2(const kern_dtype dt, const unsigned char *codes,
                                                 size_t rb, const unsigned char *scales,
                                                 size_t srb, int nb, const float *xs, int T,
                                                 float *y, int ldy, int r0, int r1, size_t pf) {
    const int in = nb * KERN_BLOCK;
    for (int r = r0; r < r1; r++) {
        const unsigned char *c = codes + (size_t)r * rb, *sc = scales + (size_t)r * srb;
        for (int t = 0; t < T; t += 2) {
            const float *xt = xs + (size_t)t * in;
            float *yt = y + (size_t)t * ldy + r;
            const size_t p = t == 0 ? pf : 0;
            if (dt == KERN_MXFP4) {
                if (T - t >= 2)
                    qrow_avx2(KERN_MXFP4, c, sc, nb, xt, 2, yt, ldy, p);
                else
                    qrow_avx2(KERN_MXFP4, c, sc, nb, xt, 1, yt, ldy, p);
            } else {
                if (T - t >= 2)
                    qrow_avx2(KERN_Q8_0, c, sc, nb, xt, 2, yt, ldy, p);
                else
                    qrow_avx2(KERN_Q8_0, c, sc, nb, xt, 1, yt, ldy, p);
            }
        }
    }
}

/* The AVX2 direct path, rows [r0, r1) for T < QUANT_GEMM_MIN_T tokens
 * (qrows_avx2), the matrix prefetched about 16 KiB ahead. xs [T, in]: x,
 * split even/odd for MXFP4; y [T, ldy]. */
static void direct_avx2(const kern_weight *w, const kern_layout *l, const float *xs, int T,
                        float *y, int ldy, int r0, int r1) {
    const size_t pf = 16384;
    qrows_avx2(w->dt, w->data, l->row_bytes, w->scales, l->scale_row_bytes, w->cols / KERN_BLOCK,
               xs, T, y, ldy, r0, r1, pf);
}

/* The AVX2 prefill path: per panel of KERN_PANEL_ROWS (16) rows, the rows
 * dequantised (row_blocks_f32_avx2: kern_weight_row_f32's values) into
 * scratch [16, in], transposed into the panel P [in, 16] (kern_gemm.h),
 * and the AVX2 GEMM over every token with x in place: each output the
 * left-to-right fma chain over the dequantised row, as the AVX-512 panels
 * give it. scratch: 2 * 16 * in floats. */
static void gemm_avx2_blocks(const kern_weight *w, const kern_layout *l, const float *x, int T,
                             float *y, int ldy, int r0, int r1, float *scratch) {
    const int in = w->cols, nb = in / KERN_BLOCK;
    float *rows = scratch, *P = scratch + (size_t)KERN_PANEL_ROWS * in;
    for (int r = r0; r < r1; r += KERN_PANEL_ROWS) {
        const int nr = r1 - r < KERN_PANEL_ROWS ? r1 - r : KERN_PANEL_ROWS;
        for (int i = 0; i < nr; i++) row_blocks_f32_avx2(w, l, r + i, 0, nb, rows + (size_t)i * in);
        for (int c = 0; c < in; c++) {
            float *pc = P + (size_t)c * KERN_PANEL_ROWS;
            for (int i = 0; i < nr; i++) pc[i] = rows[(size_t)i * in + c];
            for (int i = nr; i < KERN_PANEL_ROWS; i++) pc[i] = 0.0f;
        }
        kern__panel_gemm(P, in, x, in, T, y + r, ldy, nr, false, NULL);
    }
}

/* kern_weight_row_f32's whole blocks [b0, b1) of row r, in column order:
 * the same values (block_values_avx2's, put back in order: MXFP4's even
 * and odd values interleaved). */
static void row_blocks_f32_avx2(const kern_weight *w, const kern_layout *l, int r, int b0, int b1,
                                float *out) {
    const unsigned char *c = (const unsigned char *)w->data + (size_t)r * l->row_bytes;
    const unsigned char *sc = (const unsigned char *)w->scales + (size_t)r * l->scale_row_bytes;
    __m256 tab = _mm256_setzero_ps(), scale = _mm256_setzero_ps();
    for (int b = b0; b < b1; b++, out += KERN_BLOCK) {
        __m256 v[4];
        if (w->dt == KERN_MXFP4) {
            block_scale_avx2(KERN_MXFP4, sc, b, &tab, &scale);
            block_values_avx2(KERN_MXFP4, c, b, tab, scale, v);
            for (int h = 0; h < 2; h++) {
                /* even e0..e7 and odd o0..o7 -> e0 o0 e1 o1 ... e7 o7; lo: e0 o0 e1 o1
                 * | e4 o4 e5 o5, hi: e2 o2 e3 o3 | e6 o6 e7 o7 */
                const __m256 lo = _mm256_unpacklo_ps(v[h], v[2 + h]);
                const __m256 hi = _mm256_unpackhi_ps(v[h], v[2 + h]);
                _mm256_storeu_ps(out + 16 * h, _mm256_permute2f128_ps(lo, hi, 0x20));
                _mm256_storeu_ps(out + 16 * h + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
            }
        } else {
            block_scale_avx2(KERN_Q8_0, sc, b, &tab, &scale);
            block_values_avx2(KERN_Q8_0, c, b, tab, scale, v);
            for (int h = 0; h < 4; h++) _mm256_storeu_ps(out + 8 * h, v[h]);
        }
    }
}
#endif

/* Scratch use (floats), within kern_matmul_scratch_floats(in) = 128 * in:
 * direct: T * in (MXFP4's split x) + 8 * row_bytes / 4 (scales; in or
 * 2 * in; not with AVX2), T < QUANT_GEMM_MIN_T;
 * prefill: 32 * in (the panel) + 32 * in / 32 (scales); AVX2: 16 * in (the
 * dequantised rows) + 16 * in (the panel). */
void kern_matmul_w(const kern_weight *w, const float *x, int T, float *y, int ldy, int r0, int r1,
                   float *scratch) {
    if (!kern_dtype_is_block(w->dt)) {
        kern__matmul_hinted(w->dt, w->data, w->cols, x, T, y, ldy, r0, r1, scratch, w);
        return;
    }
#if KERN_AVX512
    if (!scratch || r1 <= r0 || T <= 0) return;
    const kern_layout l = kern_weight_layout(w->dt, w->rows, w->cols);
    if (T >= QUANT_GEMM_MIN_T) {
        gemm_avx512(w, &l, x, T, y, ldy, r0, r1, scratch);
        return;
    }
    const float *xs = x;
    float *sw = scratch;
    if (w->dt == KERN_MXFP4) {
        split_even_odd(x, (size_t)T * w->cols, scratch);
        xs = scratch;
        sw = scratch + (size_t)T * w->cols;
    }
    direct_avx512(w, &l, xs, T, y, ldy, r0, r1, (unsigned char *)sw);
#else
    /* kern_matmul_w_ref's loops with kern_matmul_w's change-over; with
     * AVX2 its own direct path */
    if (!scratch || r1 <= r0 || T <= 0) return;
#if KERN_AVX2
    const kern_layout l = kern_weight_layout(w->dt, w->rows, w->cols);
    if (T >= QUANT_GEMM_MIN_T) {
        gemm_avx2_blocks(w, &l, x, T, y, ldy, r0, r1, scratch);
        return;
    }
    const float *xs = x;
    if (w->dt == KERN_MXFP4) {
        split_even_odd(x, (size_t)T * w->cols, scratch);
        xs = scratch;
    }
    direct_avx2(w, &l, xs, T, y, ldy, r0, r1);
#else
    if (T >= QUANT_GEMM_MIN_T)
        gemm_scalar(w, x, T, y, ldy, r0, r1, scratch);
    else
        direct_scalar(w, x, T, y, ldy, r0, r1);
#endif
#endif
}

void kern_matmul_w_prefill(const kern_weight *w, const float *x, int T, float *y, int ldy, int r0,
                           int r1, float *scratch, bool bf16_act) {
    (void)bf16_act;
    /* A prompt's rows need not be one-token products (kern_matmul_w keeps
     * the direct path up to 63 tokens): the GEMM from fewer tokens. */
    if (scratch && r1 > r0 && T > 0) {
#if KERN_AVX2
        /* The block formats' AVX2 direct path decodes each block once per
         * pair of tokens: from KERN_PREFILL_GEMM_MIN_T tokens the panels,
         * dequantised once, win. */
        if (kern_dtype_is_block(w->dt)) {
            if (T >= KERN_PREFILL_GEMM_MIN_T) {
                const kern_layout l = kern_weight_layout(w->dt, w->rows, w->cols);
                gemm_avx2_blocks(w, &l, x, T, y, ldy, r0, r1, scratch);
            } else {
                kern_matmul_w(w, x, T, y, ldy, r0, r1, scratch);
            }
            return;
        }
#elif !KERN_AVX512
        /* Without AVX2 or AVX-512: BLAS over dequantised rows. */
        if (kern_dtype_is_block(w->dt)) {
            kern_matmul_w_ref(w, x, T, y, ldy, r0, r1, scratch);
            return;
        }
#endif
        /* With AVX-512 the block formats take kern_matmul_w's own
         * change-over: their direct path is as fast as the panels below
         * QUANT_GEMM_MIN_T. */
#if KERN_GEMM_SIMD
        if (!kern_dtype_is_block(w->dt) && T >= KERN_PREFILL_GEMM_MIN_T) {
#if KERN_AVX512 && defined(__AVX512BF16__)
            if (bf16_act && w->dt == KERN_BF16) {
                kern__gemm_bf16act(w->data, w->cols, x, T, y, ldy, r0, r1, scratch);
                return;
            }
#endif
            const kern_gemm_w gw = {w->dt, w->data, w->cols, false};
            kern__gemm(&gw, w->cols, x, w->cols, T, y, ldy, r0, r1, false, scratch,
                       kern_matmul_scratch_floats(w->cols));
            return;
        }
#else
        if (T >= KERN_PORTABLE_BLAS_MIN_T) {
            kern__matmul_blas(w->dt, w->data, w->cols, x, T, y, ldy, r0, r1, scratch);
            return;
        }
#endif
    }
    kern_matmul_w(w, x, T, y, ldy, r0, r1, scratch);
}

void kern_matmul_w_ref(const kern_weight *w, const float *x, int T, float *y, int ldy, int r0,
                       int r1, float *scratch) {
    if (!kern_dtype_is_block(w->dt) || !scratch || r1 <= r0 || T <= 0) return;
    if (T >= QUANT_REF_GEMM_MIN_T)
        gemm_scalar(w, x, T, y, ldy, r0, r1, scratch);
    else
        direct_scalar(w, x, T, y, ldy, r0, r1);
}
