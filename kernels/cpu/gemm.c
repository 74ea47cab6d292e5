/*
 * gemm.c - the prefill product's register-blocked micro-kernel (contract
 * in kern_gemm.h): with AVX-512, 12 tokens x 32 rows of sums in 24 of its
 * 32 registers; with AVX2 (and FMA, F16C), 6 tokens x 16 rows in 12 of its
 * 16. Every output is the same fma chain either way, so both give
 * kern_gemm_ref's bits. The blocking that feeds them (panels, packed x,
 * prefetch) is shared.
 */
/* syscall(2), for the AMX permission (kern__gemm_amx) */
#define _DEFAULT_SOURCE
#include "kern_gemm.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if KERN_GEMM_SIMD
#include <immintrin.h>
#endif
#if KERN_GEMM_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if KERN_GEMM_SIMD

/* The next panel's prefetch (kern_prefetch) spread over a step's `cols`
 * columns, a few lines each: row `row` of it, byte `off` of that row. */
typedef struct pf_walk {
    const kern_prefetch *pf;
    int row, per_col;
    size_t off;
} pf_walk;

static inline pf_walk pf_walk_start(const kern_prefetch *pf, int cols) {
    pf_walk w = {pf, 0, 0, 0};
    if (pf) {
        const size_t lines = (size_t)pf->rows * ((pf->row_bytes + 63) / 64);
        w.per_col = (int)((lines + (size_t)cols - 1) / (size_t)cols);
    }
    return w;
}

static inline void pf_walk_column(pf_walk *w) {
    for (int k = 0; k < w->per_col && w->off < w->pf->row_bytes; k++) {
        _mm_prefetch(w->pf->base + (size_t)w->row * w->pf->stride + w->off, _MM_HINT_T1);
        if (++w->row == w->pf->rows) w->row = 0, w->off += 64;
    }
}

/* A panel of nr < KERN_PANEL_ROWS rows runs on a copy of its sums, edge
 * [mt, KERN_PANEL_ROWS]: y's values where accumulating (rows < nr), else
 * zero, so that no store of a whole row of sums reaches y's columns past
 * nr (another thread's rows); edge_store copies the nr back. */
static inline void edge_load(const float *y, int ldy, int mt, int nr, bool accumulate,
                             float *edge) {
    for (int t = 0; t < mt; t++)
        for (int i = 0; i < KERN_PANEL_ROWS; i++)
            edge[t * KERN_PANEL_ROWS + i] = accumulate && i < nr ? y[(size_t)t * ldy + i] : 0;
}

static inline void edge_store(const float *edge, int mt, int nr, float *y, int ldy) {
    for (int t = 0; t < mt; t++)
        memcpy(y + (size_t)t * ldy, edge + t * KERN_PANEL_ROWS, (size_t)nr * sizeof(float));
}

static float elem(kern_dtype dt, const char *p) {
    uint16_t h;
    switch (dt) {
    case KERN_BF16: memcpy(&h, p, 2); return kern_bf16_to_f32(h);
    case KERN_F16: memcpy(&h, p, 2); return kern_f16_to_f32(h);
    default: {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    }
}

#endif

#if defined(__AVX512F__)

/* Tokens per step: 12 x 2 accumulators of 16 lanes, plus two weight
 * vectors and the broadcasts: 28 of the 32 registers. */
#define PANEL_TOKENS 12

/* The lanes of a panel's two 16-row halves that hold rows < nr. */
static inline void panel_masks(int nr, __mmask16 *m0, __mmask16 *m1) {
    *m0 = nr >= 16 ? 0xffff : (__mmask16)((1u << nr) - 1);
    *m1 = nr >= 32 ? 0xffff : nr > 16 ? (__mmask16)((1u << (nr - 16)) - 1) : 0;
}

/* The mt tokens' sums at the start of a step: y's values (accumulate: a
 * later panel of columns continues them) or zero; and back at its end. */
static inline __attribute__((always_inline)) void
sums_start(__m512 (*acc)[2], const int mt, const float *y, int ldy, __mmask16 m0, __mmask16 m1,
           bool accumulate) {
    for (int t = 0; t < mt; t++) {
        if (accumulate) {
            acc[t][0] = _mm512_maskz_loadu_ps(m0, y + (size_t)t * ldy);
            acc[t][1] = _mm512_maskz_loadu_ps(m1, y + (size_t)t * ldy + 16);
        } else {
            acc[t][0] = acc[t][1] = _mm512_setzero_ps();
        }
    }
}

static inline __attribute__((always_inline)) void
sums_store(__m512 (*acc)[2], const int mt, float *y, int ldy, __mmask16 m0, __mmask16 m1) {
    for (int t = 0; t < mt; t++) {
        _mm512_mask_storeu_ps(y + (size_t)t * ldy, m0, acc[t][0]);
        _mm512_mask_storeu_ps(y + (size_t)t * ldy + 16, m1, acc[t][1]);
    }
}

/* One column of a step: x[t] (t < mt, a constant at each call) times the
 * column's 32 weights w0 | w1, into 2 accumulators per token. */
static inline __attribute__((always_inline)) void
column_fmas(__m512 (*acc)[2], const int mt, __m512 w0, __m512 w1, const float *x) {
    for (int t = 0; t < mt; t++) {
        const __m512 b = _mm512_set1_ps(x[t]);
        acc[t][0] = _mm512_fmadd_ps(w0, b, acc[t][0]);
        acc[t][1] = _mm512_fmadd_ps(w1, b, acc[t][1]);
    }
}

/* y[t, i] (+)= sum_c x[t, c] P[c, i] for t < mt (1..12), i < nr: per
 * column c, one broadcast of x[t, c] times the panel's 32 values, into 2
 * accumulators per token. mt and packed are constants at each call (the
 * step tables), so the loops unroll and the accumulators stay in
 * registers. In place, the tokens' rows are read through one moving
 * pointer per 4 tokens (rows t, t + 1, t + 2, t + 3 at offsets 0, ldx,
 * 2 ldx, 3 ldx); packed, x is [kc, 12] (pack_tokens): one pointer, column
 * c's values side by side. */
static inline __attribute__((always_inline)) void
panel_tokens(const float *P, int kc, const float *x, int ldx, const int mt, float *y, int ldy,
             int nr, bool accumulate, const kern_prefetch *pf, const bool packed) {
    __m512 acc[PANEL_TOKENS][2];
    const float *xb[PANEL_TOKENS / 4];
    const int ng = (mt + 3) / 4;
    const size_t s1 = (size_t)ldx, s3 = 3 * (size_t)ldx;
    __mmask16 m0, m1;
    panel_masks(nr, &m0, &m1);
    for (int g = 0; g < ng; g++)
        xb[g] = x + (size_t)4 * g * ldx;
    sums_start(acc, mt, y, ldy, m0, m1, accumulate);
    pf_walk walk = pf_walk_start(pf, kc);
    for (int c = 0; c < kc; c++, P += KERN_PANEL_ROWS) {
        pf_walk_column(&walk);
        const __m512 w0 = _mm512_loadu_ps(P), w1 = _mm512_loadu_ps(P + 16);
        if (packed) {
            /* x packed (pack_tokens): this column's mt values side by side */
            column_fmas(acc, mt, w0, w1, x);
            x += PANEL_TOKENS;
            continue;
        }
        for (int g = 0; g < ng; g++) {
            const float *p = xb[g]++;
            const int t = 4 * g;
            /* the tokens of this group: 4, or mt % 4 in the last */
            const __m512 b0 = _mm512_set1_ps(p[0]);
            acc[t][0] = _mm512_fmadd_ps(w0, b0, acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(w1, b0, acc[t][1]);
            if (t + 1 < mt) {
                const __m512 b1 = _mm512_set1_ps(p[s1]);
                acc[t + 1][0] = _mm512_fmadd_ps(w0, b1, acc[t + 1][0]);
                acc[t + 1][1] = _mm512_fmadd_ps(w1, b1, acc[t + 1][1]);
            }
            if (t + 2 < mt) {
                const __m512 b2 = _mm512_set1_ps(p[2 * s1]);
                acc[t + 2][0] = _mm512_fmadd_ps(w0, b2, acc[t + 2][0]);
                acc[t + 2][1] = _mm512_fmadd_ps(w1, b2, acc[t + 2][1]);
            }
            if (t + 3 < mt) {
                const __m512 b3 = _mm512_set1_ps(p[s3]);
                acc[t + 3][0] = _mm512_fmadd_ps(w0, b3, acc[t + 3][0]);
                acc[t + 3][1] = _mm512_fmadd_ps(w1, b3, acc[t + 3][1]);
            }
        }
    }
    sums_store(acc, mt, y, ldy, m0, m1);
}

/* ------------------------------------------------------------------------ */
/* Unpacking panels                                                          */

/* a[i] (row i, 16 words) -> a[j] = word j of rows 0..15: a 16 x 16
 * transpose of 4-byte words in four shuffle stages of 16 ops. */
static inline void transpose16(__m512i a[16]) {
    __m512i b[16];
    for (int i = 0; i < 16; i += 2) {
        b[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]);
        b[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        a[i] = _mm512_unpacklo_epi64(b[i], b[i + 2]);
        a[i + 1] = _mm512_unpackhi_epi64(b[i], b[i + 2]);
        a[i + 2] = _mm512_unpacklo_epi64(b[i + 1], b[i + 3]);
        a[i + 3] = _mm512_unpackhi_epi64(b[i + 1], b[i + 3]);
    }
    /* a[4 q + k] now holds, in each 128-bit lane l, word 4 l + k of rows
     * 4 q .. 4 q + 3 */
    for (int q = 0; q < 4; q += 2)
        for (int k = 0; k < 4; k++) {
            b[4 * q + k] = _mm512_shuffle_i32x4(a[4 * q + k], a[4 * q + 4 + k], 0x88);
            b[4 * q + 4 + k] = _mm512_shuffle_i32x4(a[4 * q + k], a[4 * q + 4 + k], 0xdd);
        }
    for (int k = 0; k < 4; k++) {
        a[k] = _mm512_shuffle_i32x4(b[k], b[8 + k], 0x88);
        a[8 + k] = _mm512_shuffle_i32x4(b[k], b[8 + k], 0xdd);
        a[4 + k] = _mm512_shuffle_i32x4(b[4 + k], b[12 + k], 0x88);
        a[12 + k] = _mm512_shuffle_i32x4(b[4 + k], b[12 + k], 0xdd);
    }
}

/* Rows [r, r + nr) (nr <= 32), columns [c0, c0 + kc) of w, unpacked to f32
 * and transposed into the panel P [kc, 32]: P[c * 32 + i] = W(r + i, c0 + c),
 * rows nr..31 zero. Full blocks of 16 rows go through transpose16 (16
 * rows x 16 words: 32 bf16 / f16 columns, or 16 f32); the rest, and
 * ragged rows, through masked gathers of one word per row (two 2-byte
 * columns, or one f32) and a last odd column one value at a time (a word
 * there would run into the next row, or past the matrix). A cols_major
 * matrix's panel columns are its rows: plain copies. */
static void pack_panel(const kern_gemm_w *w, int r, int nr, int c0, int kc, float *P) {
    const kern_dtype dt = w->dt;
    const size_t esz = kern_dtype_size(dt), ld = (size_t)w->ld;
    if (w->cols_major) {
        const __mmask16 m0 = nr >= 16 ? 0xffff : (__mmask16)((1u << nr) - 1);
        const __mmask16 m1 = nr >= 32 ? 0xffff : nr > 16 ? (__mmask16)((1u << (nr - 16)) - 1) : 0;
        const float *src = (const float *)w->data + (size_t)c0 * ld + r;
        for (int c = 0; c < kc; c++, src += ld) {
            _mm512_storeu_ps(P + (size_t)c * KERN_PANEL_ROWS, _mm512_maskz_loadu_ps(m0, src));
            _mm512_storeu_ps(P + (size_t)c * KERN_PANEL_ROWS + 16,
                             _mm512_maskz_loadu_ps(m1, src + 16));
        }
        return;
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i idx = _mm512_mullo_epi32(lane, _mm512_set1_epi32(w->ld));
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
    const int step = dt == KERN_F32 ? 16 : 32; /* columns per transpose16 */
    for (int h = 0; h < 2; h++) {
        const int left = nr - 16 * h;
        const __mmask16 m = left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        const char *row = (const char *)w->data + ((size_t)(r + 16 * h) * ld + c0) * esz;
        float *p = P + 16 * h;
        int c = 0;
        if (m == 0xffff)
            for (; c + step <= kc; c += step) {
                __m512i a[16];
                for (int i = 0; i < 16; i++)
                    a[i] = _mm512_loadu_si512((const void *)(row + ((size_t)i * ld + c) * esz));
                transpose16(a);
                float *q = p + (size_t)c * KERN_PANEL_ROWS;
                for (int j = 0; j < 16; j++) {
                    if (dt == KERN_F32) {
                        _mm512_storeu_si512((void *)(q + (size_t)j * KERN_PANEL_ROWS), a[j]);
                    } else if (dt == KERN_BF16) {
                        _mm512_storeu_ps(q + (size_t)(2 * j) * KERN_PANEL_ROWS,
                                         _mm512_castsi512_ps(_mm512_slli_epi32(a[j], 16)));
                        _mm512_storeu_ps(q + (size_t)(2 * j + 1) * KERN_PANEL_ROWS,
                                         _mm512_castsi512_ps(_mm512_and_si512(a[j], hi_mask)));
                    } else {
                        _mm512_storeu_ps(q + (size_t)(2 * j) * KERN_PANEL_ROWS,
                                         _mm512_cvtph_ps(_mm512_cvtepi32_epi16(a[j])));
                        _mm512_storeu_ps(
                            q + (size_t)(2 * j + 1) * KERN_PANEL_ROWS,
                            _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(a[j], 16))));
                    }
                }
            }
        if (dt == KERN_F32) {
            for (; c < kc; c++)
                _mm512_storeu_ps(p + (size_t)c * KERN_PANEL_ROWS,
                                 _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx,
                                                          row + (size_t)c * 4, 4));
            continue;
        }
        for (; c + 2 <= kc; c += 2) {
            const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx,
                                                          row + (size_t)c * 2, 2);
            __m512 lo, hi;
            if (dt == KERN_BF16) {
                lo = _mm512_castsi512_ps(_mm512_slli_epi32(g, 16));
                hi = _mm512_castsi512_ps(_mm512_and_si512(g, hi_mask));
            } else {
                lo = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
                hi = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
            }
            _mm512_storeu_ps(p + (size_t)c * KERN_PANEL_ROWS, lo);
            _mm512_storeu_ps(p + (size_t)(c + 1) * KERN_PANEL_ROWS, hi);
        }
        for (; c < kc; c++)
            for (int i = 0; i < 16; i++)
                p[(size_t)c * KERN_PANEL_ROWS + i] =
                    i < left ? elem(dt, row + ((size_t)i * ld + c) * esz) : 0.0f;
    }
}

/* Tokens [0, mt) (mt <= 12) of x [.., ldx], columns [0, in), packed for
 * packed_tokens: xp[c * 12 + t] = x[t, c]. Blocks of 16 columns go through
 * transpose16 (12 rows and 4 of zeros in, 16 columns of 12 tokens out, each
 * stored as 12 floats), the rest one value at a time. */
static void pack_tokens(const float *x, size_t ldx, int mt, int in, float *xp) {
    int c = 0;
    for (; c + 16 <= in; c += 16) {
        __m512i a[16];
        for (int t = 0; t < 16; t++)
            a[t] = t < mt ? _mm512_loadu_si512((const void *)(x + (size_t)t * ldx + c))
                          : _mm512_setzero_si512();
        transpose16(a);
        for (int j = 0; j < 16; j++)
            _mm512_mask_storeu_epi32(xp + (size_t)(c + j) * PANEL_TOKENS, 0x0fff, a[j]);
    }
    for (; c < in; c++)
        for (int t = 0; t < mt; t++)
            xp[(size_t)c * PANEL_TOKENS + t] = x[(size_t)t * ldx + c];
}

/* Rows [r, r + nr) of the bf16 matrix W [rows, ld], columns [c0, c0 + kc),
 * as the word panel P2 [ceil(kc / 2), 32] (rows nr..31 zero; an odd last
 * column paired with 0): full blocks of 16 rows x 32 columns through
 * transpose16 (no widening: the words stay bf16 pairs), the rest through
 * gathers and single values. */
static void pack_pairs(const uint16_t *W, size_t ld, int r, int nr, int c0, int kc, uint32_t *P2) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i idx = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)ld));
    for (int h = 0; h < 2; h++) {
        const int left = nr - 16 * h;
        const __mmask16 m = left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        const uint16_t *row = W + (size_t)(r + 16 * h) * ld + c0;
        uint32_t *p = P2 + 16 * h;
        int c = 0;
        if (m == 0xffff)
            for (; c + 32 <= kc; c += 32) {
                __m512i a[16];
                for (int i = 0; i < 16; i++)
                    a[i] = _mm512_loadu_si512((const void *)(row + (size_t)i * ld + c));
                transpose16(a);
                for (int j = 0; j < 16; j++)
                    _mm512_storeu_si512((void *)(p + (size_t)(c / 2 + j) * KERN_PANEL_ROWS), a[j]);
            }
        for (; c + 2 <= kc; c += 2)
            _mm512_storeu_si512((void *)(p + (size_t)(c / 2) * KERN_PANEL_ROWS),
                                _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx,
                                                            row + c, 2));
        if (c < kc)
            for (int i = 0; i < 16; i++)
                p[(size_t)(c / 2) * KERN_PANEL_ROWS + i] = i < left ? row[(size_t)i * ld + c] : 0u;
    }
}

/* panel_tokens' packed form for a bf16 matrix's word panel P2
 * [ceil(kc / 2), 32] (pack_pairs: row i's columns 2 c2 and 2 c2 + 1 as the
 * low and high halves of a word): each pair of columns is one load per 16
 * rows, widened in registers (shift: the even column, mask: the odd one)
 * instead of in the panel. pack_panel widens and stores 32 floats a column;
 * this panel is half the bytes and no widening, and the shift and the mask
 * are 4 integer ops beside a pair's 48 fmas. The same fmas in the same
 * order as panel_tokens', so the same bits. `kds_cpu_bench
 * --only i` (one thread, bf16 [2304, in], T = 64 and 256; six rounds
 * alternating, Zen 5): 75-85% of the FMA peak -> 80-86% (the mean of the
 * eight shapes' medians 80.9 -> 83.3%); in wide's exact prefill pack time
 * 4.6% -> 3.2% of the samples (docs/benchmarks.md, "The prefill's panels
 * as bf16 pairs"). x is packed [kc, 12] (pack_tokens). */
static inline __attribute__((always_inline)) void
pairs_tokens(const uint32_t *P2, int kc, const float *x, const int mt, float *y, int ldy, int nr,
             bool accumulate, const kern_prefetch *pf) {
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[PANEL_TOKENS][2];
    __mmask16 m0, m1;
    panel_masks(nr, &m0, &m1);
    sums_start(acc, mt, y, ldy, m0, m1, accumulate);
    pf_walk walk = pf_walk_start(pf, (kc + 1) / 2);
    for (int c = 0; c < kc; c += 2, P2 += KERN_PANEL_ROWS, x += 2 * PANEL_TOKENS) {
        pf_walk_column(&walk);
        const __m512i v0 = _mm512_loadu_si512((const void *)P2);
        const __m512i v1 = _mm512_loadu_si512((const void *)(P2 + 16));
        column_fmas(acc, mt, _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)),
                    _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)), x);
        if (c + 1 == kc) break; /* an odd last column: its pair's high half is 0 */
        column_fmas(acc, mt, _mm512_castsi512_ps(_mm512_and_si512(v0, hi_mask)),
                    _mm512_castsi512_ps(_mm512_and_si512(v1, hi_mask)), x + PANEL_TOKENS);
    }
    sums_store(acc, mt, y, ldy, m0, m1);
}

#elif KERN_GEMM_SIMD
/* ------------------------------------------------------------------------ */
/* AVX2: 6 tokens x 16 rows                                                  */

/* Tokens per step: 6 x 2 accumulators of 8 lanes, plus two weight vectors
 * and a broadcast: 15 of the 16 registers (the 6 x 16 tile of the classic
 * AVX2 sgemm kernels; a 32-row panel would leave no register for x). */
#define PANEL_TOKENS 6

/* Lanes of a panel half that hold rows < n (n may be <= 0 or > 8), as the
 * sign bits _mm256_maskload_ps / _mm256_maskstore_ps read. */
static inline __m256i rows_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* y[t, i] (+)= sum_c x[t, c] P[c, i] for t < mt (1..6), i < nr: per column
 * c, one broadcast of x[t, c] times the panel's 16 values, into 2
 * accumulators per token (mt and packed constant at each call, as in the
 * AVX-512 kernel). In place, the tokens' rows are read through one moving
 * pointer per 3 tokens (offsets 0, ldx, 2 ldx); packed, x is [kc, 6]. A
 * panel of fewer than 16 rows runs on a copy of its sums (edge), so that
 * the kernel loads and stores whole vectors. The loops over tokens are
 * unrolled by pragma: left to GCC 12 (-O3) they kept the 12 sums in
 * registers but also stored them to the stack every column (a store per
 * fma, 40% of the fma peak, against 92-108% unrolled: kds_cpu_bench
 * --only i), and -O2 did not unroll them at all. */
static inline __attribute__((always_inline)) void
panel_tokens(const float *P, int kc, const float *x, int ldx, const int mt, float *y, int ldy,
             int nr, bool accumulate, const kern_prefetch *pf, const bool packed) {
    float edge[PANEL_TOKENS * KERN_PANEL_ROWS];
    float *ys = y;
    size_t lds = (size_t)ldy;
    if (nr < KERN_PANEL_ROWS) {
        ys = edge, lds = KERN_PANEL_ROWS;
        edge_load(y, ldy, mt, nr, accumulate, edge);
    }
    __m256 acc[PANEL_TOKENS][2];
    #pragma GCC unroll 6
    for (int t = 0; t < mt; t++) {
        acc[t][0] = accumulate ? _mm256_loadu_ps(ys + t * lds) : _mm256_setzero_ps();
        acc[t][1] = accumulate ? _mm256_loadu_ps(ys + t * lds + 8) : _mm256_setzero_ps();
    }
    const float *xb[PANEL_TOKENS / 3];
    const int ng = (mt + 2) / 3;
    const size_t s1 = (size_t)ldx;
    for (int g = 0; g < ng; g++)
        xb[g] = x + (size_t)3 * g * ldx;
    pf_walk walk = pf_walk_start(pf, kc);
    for (int c = 0; c < kc; c++, P += KERN_PANEL_ROWS) {
        pf_walk_column(&walk);
        const __m256 w0 = _mm256_loadu_ps(P), w1 = _mm256_loadu_ps(P + 8);
        if (packed) {
            #pragma GCC unroll 6
            for (int t = 0; t < mt; t++) {
                const __m256 b = _mm256_broadcast_ss(x + t);
                acc[t][0] = _mm256_fmadd_ps(w0, b, acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(w1, b, acc[t][1]);
            }
            x += PANEL_TOKENS;
            continue;
        }
        #pragma GCC unroll 6
        for (int t = 0; t < mt; t++) {
            const __m256 b = _mm256_broadcast_ss(xb[t / 3] + (size_t)(t % 3) * s1);
            acc[t][0] = _mm256_fmadd_ps(w0, b, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(w1, b, acc[t][1]);
        }
        for (int g = 0; g < ng; g++)
            xb[g]++;
    }
    #pragma GCC unroll 6
    for (int t = 0; t < mt; t++) {
        _mm256_storeu_ps(ys + t * lds, acc[t][0]);
        _mm256_storeu_ps(ys + t * lds + 8, acc[t][1]);
    }
    if (nr < KERN_PANEL_ROWS) edge_store(edge, mt, nr, y, ldy);
}

/* a[i] (row i, 8 floats) -> a[j] = column j of rows 0..7. */
static inline void transpose8(__m256 a[8]) {
    __m256 t[8], s[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(a[i], a[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
    }
    /* t[2 q], t[2 q + 1]: rows 2 q, 2 q + 1 interleaved, low and high pairs */
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    /* s[4 h + k]: column k (128-bit lane 0) and k + 4 (lane 1) of rows
     * 4 h .. 4 h + 3 */
    for (int k = 0; k < 4; k++) {
        a[k] = _mm256_permute2f128_ps(s[k], s[4 + k], 0x20);
        a[4 + k] = _mm256_permute2f128_ps(s[k], s[4 + k], 0x31);
    }
}

/* 8 values of a row from p, widened to f32. */
static inline __attribute__((always_inline)) __m256 load8_f32(const kern_dtype dt, const char *p) {
    if (dt == KERN_F32) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dt == KERN_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* pack_panel for rows stored as rows, one format: per half of 8 rows,
 * blocks of 8 columns widened and transposed (rows past nr zero), the
 * last kc % 8 columns one value at a time. */
static inline __attribute__((always_inline)) void
pack_rows(const kern_dtype dt, const char *data, size_t ld, int r, int nr, int c0, int kc,
          float *P) {
    const size_t esz = kern_dtype_size(dt);
    for (int h = 0; h < 2; h++) {
        const int left = nr - 8 * h;
        const char *row = data + ((size_t)(r + 8 * h) * ld + c0) * esz;
        float *p = P + 8 * h;
        int c = 0;
        if (left > 0)
            for (; c + 8 <= kc; c += 8) {
                __m256 a[8];
                for (int i = 0; i < 8; i++)
                    a[i] = i < left ? load8_f32(dt, row + ((size_t)i * ld + c) * esz)
                                    : _mm256_setzero_ps();
                transpose8(a);
                for (int j = 0; j < 8; j++)
                    _mm256_storeu_ps(p + (size_t)(c + j) * KERN_PANEL_ROWS, a[j]);
            }
        for (; c < kc; c++)
            for (int i = 0; i < 8; i++)
                p[(size_t)c * KERN_PANEL_ROWS + i] =
                    i < left ? elem(dt, row + ((size_t)i * ld + c) * esz) : 0.0f;
    }
}

/* Rows [r, r + nr) (nr <= 16), columns [c0, c0 + kc) of w, unpacked to f32
 * and transposed into the panel P [kc, 16]: P[c * 16 + i] = W(r + i, c0 + c),
 * rows nr..15 zero. A cols_major matrix's panel columns are its rows:
 * copies. */
static void pack_panel(const kern_gemm_w *w, int r, int nr, int c0, int kc, float *P) {
    const size_t ld = (size_t)w->ld;
    if (w->cols_major) {
        const __m256i m0 = rows_mask(nr), m1 = rows_mask(nr - 8);
        const float *src = (const float *)w->data + (size_t)c0 * ld + r;
        for (int c = 0; c < kc; c++, src += ld) {
            _mm256_storeu_ps(P + (size_t)c * KERN_PANEL_ROWS, _mm256_maskload_ps(src, m0));
            _mm256_storeu_ps(P + (size_t)c * KERN_PANEL_ROWS + 8, _mm256_maskload_ps(src + 8, m1));
        }
        return;
    }
    switch (w->dt) {
    case KERN_BF16: pack_rows(KERN_BF16, w->data, ld, r, nr, c0, kc, P); break;
    case KERN_F16: pack_rows(KERN_F16, w->data, ld, r, nr, c0, kc, P); break;
    default: pack_rows(KERN_F32, w->data, ld, r, nr, c0, kc, P); break;
    }
}

/* Tokens [0, mt) (mt <= 6) of x [.., ldx], columns [0, in), packed for
 * packed_tokens: xp[c * 6 + t] = x[t, c]. Blocks of 8 columns go through
 * transpose8 (mt rows and zeros in, 8 columns out, 6 floats of each
 * stored), the rest one value at a time. */
static void pack_tokens(const float *x, size_t ldx, int mt, int in, float *xp) {
    int c = 0;
    for (; c + 8 <= in; c += 8) {
        __m256 a[8];
        for (int t = 0; t < 8; t++)
            a[t] = t < mt ? _mm256_loadu_ps(x + (size_t)t * ldx + c) : _mm256_setzero_ps();
        transpose8(a);
        for (int j = 0; j < 8; j++) {
            float *q = xp + (size_t)(c + j) * PANEL_TOKENS;
            _mm_storeu_ps(q, _mm256_castps256_ps128(a[j]));
            _mm_storel_pi((__m64 *)(q + 4), _mm256_extractf128_ps(a[j], 1));
        }
    }
    for (; c < in; c++)
        for (int t = 0; t < mt; t++)
            xp[(size_t)c * PANEL_TOKENS + t] = x[(size_t)t * ldx + c];
}
#endif

#if KERN_GEMM_SIMD
/* One function per step size, so that each is compiled with its own
 * constant mt. */
#if PANEL_TOKENS == 12
#define PANEL_STEPS(M) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12)
#else
#define PANEL_STEPS(M) M(1) M(2) M(3) M(4) M(5) M(6)
#endif
#define PANEL_STEP(n)                                                                              \
    static void panel_tokens##n(const float *P, int kc, const float *x, int ldx, float *y,        \
                                int ldy, int nr, bool accumulate, const kern_prefetch *pf) {      \
        panel_tokens(P, kc, x, ldx, n, y, ldy, nr, accumulate, pf, false);                        \
    }                                                                                              \
    static void packed_tokens##n(const float *P, int kc, const float *x, int ldx, float *y,       \
                                 int ldy, int nr, bool accumulate, const kern_prefetch *pf) {     \
        panel_tokens(P, kc, x, ldx, n, y, ldy, nr, accumulate, pf, true);                         \
    }
PANEL_STEPS(PANEL_STEP)
#define IN_PLACE_STEP(n) panel_tokens##n,
#define PACKED_STEP(n) packed_tokens##n,
#if defined(__AVX512F__)
#define PAIRS_STEP(n)                                                                              \
    static void pairs_tokens##n(const float *P, int kc, const float *x, int ldx, float *y,        \
                                int ldy, int nr, bool accumulate, const kern_prefetch *pf) {      \
        (void)ldx;                                                                                 \
        pairs_tokens((const uint32_t *)P, kc, x, n, y, ldy, nr, accumulate, pf);                  \
    }
PANEL_STEPS(PAIRS_STEP)
#define PAIRS_ENTRY(n) pairs_tokens##n,
#endif

typedef void (*panel_step_fn)(const float *, int, const float *, int, float *, int, int, bool,
                              const kern_prefetch *);

void kern__panel_gemm(const float *P, int kc, const float *x, int ldx, int T, float *y, int ldy,
                      int nr, bool accumulate, const kern_prefetch *next) {
    static const panel_step_fn step[PANEL_TOKENS + 1] = {NULL, PANEL_STEPS(IN_PLACE_STEP)};
    for (int t0 = 0; t0 < T; t0 += PANEL_TOKENS) {
        const int mt = T - t0 < PANEL_TOKENS ? T - t0 : PANEL_TOKENS;
        step[mt](P, kc, x + (size_t)t0 * ldx, ldx, y + (size_t)t0 * ldy, ldy, nr, accumulate,
                 t0 == 0 && next && next->rows > 0 ? next : NULL);
    }
}

/* The bytes of the panel after rows [r, r + nr) x columns [c0, c0 + kc) of
 * rows [.., r1), fetched while this one computes: the next columns of these
 * rows, else the first columns of the next rows; none for a cols_major
 * matrix, whose panels are small. */
static kern_prefetch next_panel(const kern_gemm_w *w, int in, int r, int nr, int r1, int c0,
                                int kc) {
    const size_t esz = kern_dtype_size(w->dt), ld = (size_t)w->ld;
    kern_prefetch next = {NULL, ld * esz, 0, 0};
    if (!w->cols_major && c0 + kc < in) {
        const int kn = in - c0 - kc < KERN_PANEL_COLS ? in - c0 - kc : KERN_PANEL_COLS;
        next.base = (const char *)w->data + ((size_t)r * ld + (size_t)(c0 + kc)) * esz;
        next.row_bytes = (size_t)kn * esz, next.rows = nr;
    } else if (!w->cols_major && r + nr < r1) {
        const int kn = in < KERN_PANEL_COLS ? in : KERN_PANEL_COLS;
        next.base = (const char *)w->data + (size_t)(r + nr) * ld * esz;
        next.row_bytes = (size_t)kn * esz;
        next.rows = r1 - r - nr < KERN_PANEL_ROWS ? r1 - r - nr : KERN_PANEL_ROWS;
    }
    return next;
}

/* Columns per block of the packed path: `in` cut into equal blocks of at
 * most KERN_GEMM_BLOCK_COLS, multiples of 16 (pack_tokens' transposes). */
static int block_cols(int in) {
    const int blocks = (in + KERN_GEMM_BLOCK_COLS - 1) / KERN_GEMM_BLOCK_COLS;
    const int kc = ((in + blocks - 1) / blocks + 15) / 16 * 16;
    return kc < in ? kc : in;
}

size_t kern__gemm_scratch_floats(int in, int T) {
    const size_t kc = (size_t)block_cols(in);
    const size_t tiles = (size_t)(T + PANEL_TOKENS - 1) / PANEL_TOKENS;
    return KERN_PANEL_ROWS * kc + tiles * PANEL_TOKENS * kc;
}

/* The panel after rows [r, r + nr) of rows [r0, r1), columns [c0, c0 + kc)
 * (blocks of kb columns): the next KERN_PANEL_ROWS rows' same columns, else the first
 * rows' next columns. None for a cols_major matrix, whose panels are
 * small. */
static kern_prefetch next_block_panel(const kern_gemm_w *w, int in, int r, int nr, int r0, int r1,
                                      int c0, int kc, int kb) {
    const size_t esz = kern_dtype_size(w->dt), ld = (size_t)w->ld;
    kern_prefetch next = {NULL, ld * esz, 0, 0};
    if (w->cols_major) return next;
    if (r + nr < r1) {
        next.base = (const char *)w->data + ((size_t)(r + nr) * ld + (size_t)c0) * esz;
        next.row_bytes = (size_t)kc * esz;
        next.rows = r1 - r - nr < KERN_PANEL_ROWS ? r1 - r - nr : KERN_PANEL_ROWS;
    } else if (c0 + kc < in) {
        const int kn = in - c0 - kc < kb ? in - c0 - kc : kb;
        next.base = (const char *)w->data + ((size_t)r0 * ld + (size_t)(c0 + kc)) * esz;
        next.row_bytes = (size_t)kn * esz;
        next.rows = r1 - r0 < KERN_PANEL_ROWS ? r1 - r0 : KERN_PANEL_ROWS;
    }
    return next;
}

/* x read in place: per panel of 32 rows and KERN_PANEL_COLS columns, every
 * 12 tokens run over the panel reading their rows ldx apart. */
static void gemm_in_place(const kern_gemm_w *w, int in, const float *x, int ldx, int T, float *y,
                          int ldy, int r0, int r1, bool accumulate, float *P) {
    for (int r = r0; r < r1; r += KERN_PANEL_ROWS) {
        const int nr = r1 - r < KERN_PANEL_ROWS ? r1 - r : KERN_PANEL_ROWS;
        for (int c0 = 0; c0 < in; c0 += KERN_PANEL_COLS) {
            const int kc = in - c0 < KERN_PANEL_COLS ? in - c0 : KERN_PANEL_COLS;
            pack_panel(w, r, nr, c0, kc, P);
            const kern_prefetch next = next_panel(w, in, r, nr, r1, c0, kc);
            kern__panel_gemm(P, kc, x + c0, ldx, T, y + r, ldy, nr, accumulate || c0 > 0, &next);
        }
    }
}

/* The panel of rows [r, r + nr), columns [c0, c0 + kc) that kern__gemm's
 * steps read: bf16 column pairs for pairs_tokens (pairs), else f32. */
static void pack_step_panel(const kern_gemm_w *w, bool pairs, int r, int nr, int c0, int kc,
                            float *P) {
#if defined(__AVX512F__)
    if (pairs) {
        pack_pairs(w->data, (size_t)w->ld, r, nr, c0, kc, (uint32_t *)P);
        return;
    }
#endif
    (void)pairs;
    pack_panel(w, r, nr, c0, kc, P);
}

void kern__gemm(const kern_gemm_w *w, int in, const float *x, int ldx, int T, float *y, int ldy,
                int r0, int r1, bool accumulate, float *scratch, size_t scratch_floats) {
    static const panel_step_fn widened[PANEL_TOKENS + 1] = {NULL, PANEL_STEPS(PACKED_STEP)};
#if defined(__AVX512F__)
    /* bf16 rows: panels of column pairs, widened in the kernel (pairs_tokens) */
    static const panel_step_fn paired[PANEL_TOKENS + 1] = {NULL, PANEL_STEPS(PAIRS_ENTRY)};
    const bool pairs = w->dt == KERN_BF16 && !w->cols_major;
    const panel_step_fn *step = pairs ? paired : widened;
#else
    const bool pairs = false;
    const panel_step_fn *step = widened;
#endif
    const int kb = block_cols(in);
    const size_t panel = (size_t)KERN_PANEL_ROWS * kb, tile = (size_t)PANEL_TOKENS * kb;
    /* the tokens whose packed x fits the rest of the scratch, in steps of
     * 12: W is unpacked once per block of them */
    const size_t room = scratch_floats > panel ? (scratch_floats - panel) / tile : 0;
    if (room == 0) {
        gemm_in_place(w, in, x, ldx, T, y, ldy, r0, r1, accumulate, scratch);
        return;
    }
    float *P = scratch, *xp = scratch + panel;
    const int cap = room * PANEL_TOKENS < (size_t)T ? (int)room * PANEL_TOKENS : T;
    for (int tb = 0; tb < T; tb += cap) {
        const int nb = T - tb < cap ? T - tb : cap;
        /* the tokens dealt out evenly over the tiles (tile i: tokens
         * [nb i / n, nb (i + 1) / n)), so that 64 runs as 10 and 11 a
         * tile, not 5 x 12 and a tile of 4, whose sums cost 1.7x a
         * token's in a full tile (the decode step of 64 sequences) */
        const int n_tiles = (nb + PANEL_TOKENS - 1) / PANEL_TOKENS;
        for (int c0 = 0; c0 < in; c0 += kb) {
            const int kc = in - c0 < kb ? in - c0 : kb;
            /* tile i's x at xp + i * 12 * kc: [kc, 12] */
            for (int i = 0; i < n_tiles; i++) {
                const int t0 = nb * i / n_tiles, t1 = nb * (i + 1) / n_tiles;
                pack_tokens(x + (size_t)(tb + t0) * ldx + c0, (size_t)ldx, t1 - t0, kc,
                            xp + (size_t)i * PANEL_TOKENS * kc);
            }
            for (int r = r0; r < r1; r += KERN_PANEL_ROWS) {
                const int nr = r1 - r < KERN_PANEL_ROWS ? r1 - r : KERN_PANEL_ROWS;
                pack_step_panel(w, pairs, r, nr, c0, kc, P);
                const kern_prefetch next = next_block_panel(w, in, r, nr, r0, r1, c0, kc, kb);
                for (int i = 0; i < n_tiles; i++) {
                    const int t0 = nb * i / n_tiles, mt = nb * (i + 1) / n_tiles - t0;
                    /* each tile fetches its share of the next panel's rows,
                     * so that the reads from memory spread over the panel */
                    const int p0 = next.rows * i / n_tiles, p1 = next.rows * (i + 1) / n_tiles;
                    kern_prefetch share;
                    const kern_prefetch *pf = NULL;
                    if (p1 > p0) { /* next.base is NULL when there is no next panel */
                        share = (kern_prefetch){next.base + (size_t)p0 * next.stride, next.stride,
                                                next.row_bytes, p1 - p0};
                        pf = &share;
                    }
                    step[mt](P, kc, xp + (size_t)i * PANEL_TOKENS * kc, 0,
                             y + (size_t)(tb + t0) * ldy + r, ldy, nr, accumulate || c0 > 0, pf);
                }
            }
        }
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* ------------------------------------------------------------------------ */
/* Activations rounded to bf16: AVX-512 BF16 dot products                    */

/* y[t, i] (+)= sum over column pairs c2 of the dot of x's pair and the
 * panel's pair, for t < mt (1..12, a constant at each call), i < nr. P2:
 * [kc2, 32] words, each row i's columns 2 c2 and 2 c2 + 1 as bf16 (low,
 * high); xw: [mt, ldx2] words, the tokens' columns as bf16 pairs the same
 * way. One vdpbf16ps per 16 rows and token adds both columns' products:
 * twice the multiply-adds of an f32 fma per instruction. */
static inline __attribute__((always_inline)) void
panel_tokens_bf16(const uint32_t *P2, int kc2, const uint32_t *xw, int ldx2, const int mt, float *y,
                  int ldy, int nr, bool accumulate, const kern_prefetch *pf) {
    __m512 acc[PANEL_TOKENS][2];
    const uint32_t *xb[PANEL_TOKENS / 4];
    const int ng = (mt + 3) / 4;
    const size_t s1 = (size_t)ldx2, s3 = 3 * (size_t)ldx2;
    __mmask16 m0, m1;
    panel_masks(nr, &m0, &m1);
    for (int g = 0; g < ng; g++)
        xb[g] = xw + (size_t)4 * g * ldx2;
    sums_start(acc, mt, y, ldy, m0, m1, accumulate);
    pf_walk walk = pf_walk_start(pf, kc2);
    for (int c = 0; c < kc2; c++, P2 += KERN_PANEL_ROWS) {
        pf_walk_column(&walk);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)P2);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(P2 + 16));
        for (int g = 0; g < ng; g++) {
            const uint32_t *p = xb[g]++;
            const int t = 4 * g;
            const __m512bh b0 = (__m512bh)_mm512_set1_epi32((int)p[0]);
            acc[t][0] = _mm512_dpbf16_ps(acc[t][0], w0, b0);
            acc[t][1] = _mm512_dpbf16_ps(acc[t][1], w1, b0);
            if (t + 1 < mt) {
                const __m512bh b1 = (__m512bh)_mm512_set1_epi32((int)p[s1]);
                acc[t + 1][0] = _mm512_dpbf16_ps(acc[t + 1][0], w0, b1);
                acc[t + 1][1] = _mm512_dpbf16_ps(acc[t + 1][1], w1, b1);
            }
            if (t + 2 < mt) {
                const __m512bh b2 = (__m512bh)_mm512_set1_epi32((int)p[2 * s1]);
                acc[t + 2][0] = _mm512_dpbf16_ps(acc[t + 2][0], w0, b2);
                acc[t + 2][1] = _mm512_dpbf16_ps(acc[t + 2][1], w1, b2);
            }
            if (t + 3 < mt) {
                const __m512bh b3 = (__m512bh)_mm512_set1_epi32((int)p[s3]);
                acc[t + 3][0] = _mm512_dpbf16_ps(acc[t + 3][0], w0, b3);
                acc[t + 3][1] = _mm512_dpbf16_ps(acc[t + 3][1], w1, b3);
            }
        }
    }
    sums_store(acc, mt, y, ldy, m0, m1);
}

#define PANEL_STEP_BF16(n)                                                                         \
    static void panel_bf16_##n(const uint32_t *P2, int kc2, const uint32_t *xw, int ldx2,        \
                               float *y, int ldy, int nr, bool accumulate,                        \
                               const kern_prefetch *pf) {                                         \
        panel_tokens_bf16(P2, kc2, xw, ldx2, n, y, ldy, nr, accumulate, pf);                      \
    }
PANEL_STEP_BF16(1)
PANEL_STEP_BF16(2)
PANEL_STEP_BF16(3)
PANEL_STEP_BF16(4)
PANEL_STEP_BF16(5)
PANEL_STEP_BF16(6)
PANEL_STEP_BF16(7)
PANEL_STEP_BF16(8)
PANEL_STEP_BF16(9)
PANEL_STEP_BF16(10)
PANEL_STEP_BF16(11)
PANEL_STEP_BF16(12)

typedef void (*panel_bf16_fn)(const uint32_t *, int, const uint32_t *, int, float *, int, int,
                              bool, const kern_prefetch *);

/* The same word panel from an f32 matrix, each value rounded to bf16
 * (nearest even): rows stored as rows (16 rows x 32 columns converted and
 * transposed), or cols_major (a panel column pair is two stored rows of 32
 * values, converted and interleaved); ragged edges one value at a time. */
static void pack_pairs_f32(const kern_gemm_w *w, int r, int nr, int c0, int kc, uint32_t *P2) {
    const float *W = w->data;
    const size_t ld = (size_t)w->ld;
    int c = 0;
    if (w->cols_major) {
        if (nr == KERN_PANEL_ROWS)
            for (; c + 2 <= kc; c += 2) {
                const float *a = W + (size_t)(c0 + c) * ld + r, *b = a + ld;
                for (int h = 0; h < 2; h++) {
                    const __m512i lo = _mm512_cvtepu16_epi32(
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(a + 16 * h)));
                    const __m512i hi = _mm512_cvtepu16_epi32(
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(b + 16 * h)));
                    _mm512_storeu_si512((void *)(P2 + (size_t)(c / 2) * KERN_PANEL_ROWS + 16 * h),
                                        _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
                }
            }
    } else if (nr == KERN_PANEL_ROWS) {
        for (; c + 32 <= kc; c += 32)
            for (int h = 0; h < 2; h++) {
                __m512i a[16];
                for (int i = 0; i < 16; i++) {
                    const float *row = W + (size_t)(r + 16 * h + i) * ld + c0 + c;
                    a[i] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16),
                                                        _mm512_loadu_ps(row));
                }
                transpose16(a);
                for (int j = 0; j < 16; j++)
                    _mm512_storeu_si512(
                        (void *)(P2 + (size_t)(c / 2 + j) * KERN_PANEL_ROWS + 16 * h), a[j]);
            }
    }
    for (; c < kc; c += 2)
        for (int i = 0; i < KERN_PANEL_ROWS; i++) {
            uint32_t word = 0;
            for (int e = 0; e < 2 && i < nr && c + e < kc; e++) {
                const size_t at = w->cols_major ? (size_t)(c0 + c + e) * ld + (size_t)(r + i)
                                                : (size_t)(r + i) * ld + (size_t)(c0 + c + e);
                word |= (uint32_t)kern_f32_to_bf16(W[at]) << (16 * e);
            }
            P2[(size_t)(c / 2) * KERN_PANEL_ROWS + i] = word;
        }
}

/* Tokens [0, mt) of x [.., ldx], columns [c0, c0 + kc), rounded to bf16
 * (nearest even) as word pairs: xw [mt, ceil(kc / 2)]. */
static void round_tile(const float *x, int ldx, int mt, int c0, int kc, uint32_t *xw) {
    const int kc2 = (kc + 1) / 2;
    for (int t = 0; t < mt; t++) {
        const float *src = x + (size_t)t * ldx + c0;
        uint32_t *dst = xw + (size_t)t * kc2;
        int c = 0;
        for (; c + 32 <= kc; c += 32)
            _mm512_storeu_si512((void *)(dst + c / 2),
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + c + 16),
                                                             _mm512_loadu_ps(src + c)));
        for (; c < kc; c += 2) {
            const uint32_t lo = kern_f32_to_bf16(src[c]);
            const uint32_t hi = c + 1 < kc ? kern_f32_to_bf16(src[c + 1]) : 0u;
            dst[c / 2] = lo | hi << 16;
        }
    }
}


#if KERN_GEMM_AMX
/* ------------------------------------------------------------------------ */
/* The same products on AMX tiles                                           */

/* Intel's AMX (Sapphire Rapids and later) multiplies bf16 tiles: one
 * TDPBF16PS adds a [16, 32] x [32, 16] product to 16 x 16 f32 sums, 8,192
 * multiply-adds an instruction. On the dev machine's Xeon this GEMM ran
 * at 5-9x the vdpbf16ps kernel's speed (kds_cpu_bench --only j). There
 * vdpbf16ps runs at half the f32 FMA's rate, so without tiles --bf16 was
 * the slower prefill (docs/benchmarks.md, "AMX tiles"). The word panel P2
 * [kc2, 32] is already the B operand's layout (pairs of columns, rows
 * side by side: rows 16 h .. 16 h + 15 are the tile at P2 + 16 h, 128
 * bytes a row) and the rounded x [mt, ldx2] words the A operand's, so the
 * packing is shared with the vdpbf16ps kernel. Tiles: 0-3 the sums
 * (tokens 0-15 / 16-31 x rows 0-15 / 16-31), 4-5 x, 6-7 the panel. */
enum { AMX_TOKENS = 32 };

/* The tile configuration LDTILECFG reads (palette 1): rows and bytes a
 * row of each tile; mt tokens (1..32) in the sums and x tiles. */
typedef struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Tiles 0-7 as rows[t] x colsb[t] bytes (a tile with either 0 unused). */
static void amx_load_config(const int rows[8], const int colsb[8]) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        const bool used = rows[t] && colsb[t];
        c.rows[t] = (uint8_t)(used ? rows[t] : 0);
        c.colsb[t] = (uint16_t)(used ? colsb[t] : 0);
    }
    /* Not _tile_loadconfig: GCC 12's tells the compiler it reads only the
     * first 8 bytes ("m" of a pointer's size), so the stores of the rest
     * may be dropped as dead, and LDTILECFG then faults on what was on the
     * stack. This operand is the whole 64 bytes. */
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
}

static void amx_configure(int mt) {
    const int lo = mt < 16 ? mt : 16, hi = mt > 16 ? mt - 16 : 0;
    const int rows[8] = {lo, lo, hi, hi, lo, hi, 16, 16};
    const int colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_load_config(rows, colsb);
}

/* Whether this thread may use the tiles: the kernel lets the process use
 * their state (Linux asks each process to request it: arch_prctl
 * ARCH_REQ_XCOMP_PERM for XTILEDATA, which fails where the CPU has no AMX
 * or the kernel predates it, and is granted again at no cost once
 * granted: 62 ns). Asked at each product rather than remembered, so that
 * no state hides here. Not CPUID: in a VM each CPUID traps to the host,
 * and asking it per product cost 16% of llamacpp-tiny's --bf16 prefill. */
bool kern__gemm_amx(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

/* y[t, i] (+)= sum over the kc2 column pairs of bf16 products, t < mt
 * (the tiles configured for mt by amx_configure), i < nr: P2 and xw as
 * panel_tokens_bf16's, kc2 a multiple of 16. Rows past nr are zero in P2;
 * their sums go to `stage` [32, 32], never to y, whose columns past nr
 * belong to other rows (another thread's). */
static void amx_panel(const uint32_t *P2, int kc2, const uint32_t *xw, int ldx2, int mt, float *y,
                      int ldy, int nr, bool accumulate, float *stage) {
    float *ys = y;
    size_t lds = (size_t)ldy;
    if (nr < KERN_PANEL_ROWS) {
        ys = stage, lds = KERN_PANEL_ROWS;
        edge_load(y, ldy, mt, nr, accumulate, stage);
        accumulate = true;
    }
    const size_t sb = lds * sizeof(float), xb = (size_t)ldx2 * sizeof(uint32_t);
    const bool two = mt > 16;
    if (accumulate) {
        _tile_loadd(0, ys, sb);
        _tile_loadd(1, ys + 16, sb);
        if (two) {
            _tile_loadd(2, ys + 16 * lds, sb);
            _tile_loadd(3, ys + 16 * lds + 16, sb);
        }
    } else {
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
            _tile_zero(2);
            _tile_zero(3);
        }
    }
    for (int k = 0; k < kc2; k += 16) {
        _tile_loadd(6, P2 + (size_t)k * KERN_PANEL_ROWS, KERN_PANEL_ROWS * sizeof(uint32_t));
        _tile_loadd(7, P2 + (size_t)k * KERN_PANEL_ROWS + 16, KERN_PANEL_ROWS * sizeof(uint32_t));
        _tile_loadd(4, xw + k, xb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, xw + (size_t)16 * ldx2 + k, xb);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, ys, sb);
    _tile_stored(1, ys + 16, sb);
    if (two) {
        _tile_stored(2, ys + 16 * lds, sb);
        _tile_stored(3, ys + 16 * lds + 16, sb);
    }
    if (ys == stage) edge_store(stage, mt, nr, y, ldy);
}

/* The tile configuration for W's rows as the A operand
 * (kern__amx_rows_bf16): nr rows (1..32) of W in tiles 4-5 (16 + the
 * rest), nb tokens (1..32) of x in tiles 6-7 (16 + the rest), their sums
 * in 0-3 (rows 0-15 / 16-31 x tokens 0-15 / 16-31). */
static void amx_configure_rows(int nr, int nb) {
    const int r0 = nr < 16 ? nr : 16, r1 = nr > 16 ? nr - 16 : 0;
    const int t0 = nb < 16 ? nb : 16, t1 = nb > 16 ? nb - 16 : 0;
    const int rows[8] = {r0, r1, r0, r1, r0, r1, 16, 16};
    const int colsb[8] = {4 * t0, 4 * t0, 4 * t1, 4 * t1, 64, 64, 4 * t0, 4 * t1};
    amx_load_config(rows, colsb);
}

/* Tokens a block of the B operand holds: 32 rounded tokens, or 10 split
 * ones (three columns each, kern__amx_rows_split). */
enum { AMX_SPLIT_BLOCK = 10 };

/* x [in] of one token as the B operand's columns: at word xb[p * 32 + c]
 * the pair of columns (2p, 2p + 1). Rounded (split false): bf16(x) in
 * column c. Split: x = hi + mid + lo exactly, each a bf16 value (hi is x
 * with its low 16 bits cut, mid the same of x - hi, lo the rest: 8
 * significant bits each), in columns c, c + 1, c + 2. */
static void amx_lay_token(const float *xt, int in, uint32_t *xb, int c, bool split,
                          __m512i by_row) {
    const __m512i cut = _mm512_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < in; i += 32) {
        const __m512 a = _mm512_loadu_ps(xt + i), b = _mm512_loadu_ps(xt + i + 16);
        uint32_t *dst = xb + (size_t)(i / 2) * 32 + c;
        if (!split) {
            _mm512_i32scatter_epi32(dst, by_row, (__m512i)_mm512_cvtne2ps_pbh(b, a), 4);
            continue;
        }
        const __m512 ah = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), cut));
        const __m512 bh = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(b), cut));
        const __m512 ar = _mm512_sub_ps(a, ah), br = _mm512_sub_ps(b, bh);
        const __m512 am = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(ar), cut));
        const __m512 bm = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(br), cut));
        const __m512 al = _mm512_sub_ps(ar, am), bl = _mm512_sub_ps(br, bm);
        /* each value already a bf16's, so the conversion is exact */
        _mm512_i32scatter_epi32(dst, by_row, (__m512i)_mm512_cvtne2ps_pbh(bh, ah), 4);
        _mm512_i32scatter_epi32(dst + 1, by_row, (__m512i)_mm512_cvtne2ps_pbh(bm, am), 4);
        _mm512_i32scatter_epi32(dst + 2, by_row, (__m512i)_mm512_cvtne2ps_pbh(bl, al), 4);
    }
}

/* kern__amx_rows_bf16 (split false) and kern__amx_rows_split (true). */
static void amx_rows(const uint16_t *W, int in, const float *x, int ldx, int T, float *y, int ldy,
                     int r0, int r1, float *scratch, const bool split) {
    _Alignas(64) float stage[32 * 32]; /* [32 rows, 32 columns] */
    const __m512i by_row = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(32));
    const size_t block_words = (size_t)in / 2 * 32; /* a block of B's 32 columns */
    const int per_block = split ? AMX_SPLIT_BLOCK : 32; /* tokens a block */
    const int cols_per = split ? 3 : 1;                   /* columns a token */
    /* up to eight blocks at a time (128 * in floats of scratch), their x
     * laid out first, so that each 32-row panel is read from memory once
     * and then stays in L2 for every block */
    const int chunk = 8 * per_block;
    int cfg_nr = 0, cfg_nb = 0;
    for (int tc = 0; tc < T; tc += chunk) {
        const int nc = T - tc < chunk ? T - tc : chunk;
        for (int t = 0; t < nc; t++)
            amx_lay_token(x + (size_t)(tc + t) * ldx, in,
                          (uint32_t *)scratch + (size_t)(t / per_block) * block_words,
                          cols_per * (t % per_block), split, by_row);
        for (int r = r0; r < r1; r += 32) {
            const int nr = r1 - r < 32 ? r1 - r : 32;
            const uint16_t *w = W + (size_t)r * in;
            const size_t wb = (size_t)in * sizeof(uint16_t);
            const bool two_r = nr > 16;
            for (int tb = 0; tb < nc; tb += per_block) {
                const int nt = nc - tb < per_block ? nc - tb : per_block;
                const int nb = cols_per * nt; /* B's columns */
                const bool two_t = nb > 16;
                const uint32_t *xv =
                    (const uint32_t *)scratch + (size_t)(tb / per_block) * block_words;
                if (nr != cfg_nr || nb != cfg_nb)
                    amx_configure_rows(nr, nb), cfg_nr = nr, cfg_nb = nb;
                _tile_zero(0);
                if (two_r) _tile_zero(1);
                if (two_t) {
                    _tile_zero(2);
                    if (two_r) _tile_zero(3);
                }
                for (int i = 0; i < in; i += 32) {
                    const uint32_t *xk = xv + (size_t)(i / 2) * 32;
                    _tile_loadd(4, w + i, wb);
                    _tile_loadd(6, xk, 128);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two_r) {
                        _tile_loadd(5, w + (size_t)16 * in + i, wb);
                        _tile_dpbf16ps(1, 5, 6);
                    }
                    if (two_t) {
                        _tile_loadd(7, xk + 16, 128);
                        _tile_dpbf16ps(2, 4, 7);
                        if (two_r) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                /* sums [rows, columns] -> y [tokens, rows]; split: a
                 * token's three columns added as (hi + mid) + lo */
                _tile_stored(0, stage, 128);
                if (two_r) _tile_stored(1, stage + 16 * 32, 128);
                if (two_t) {
                    _tile_stored(2, stage + 16, 128);
                    if (two_r) _tile_stored(3, stage + 16 * 32 + 16, 128);
                }
                for (int t = 0; t < nt; t++) {
                    float *yt = y + (size_t)(tc + tb + t) * ldy + r;
                    const float *col = stage + cols_per * t;
                    for (int h = 0; h < nr; h += 16) {
                        const int left = nr - h < 16 ? nr - h : 16;
                        const __mmask16 m = (__mmask16)((1u << left) - 1);
                        __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, by_row,
                                                            col + h * 32, 4);
                        if (split) {
                            const __m512 vm = _mm512_mask_i32gather_ps(
                                _mm512_setzero_ps(), m, by_row, col + h * 32 + 1, 4);
                            const __m512 vl = _mm512_mask_i32gather_ps(
                                _mm512_setzero_ps(), m, by_row, col + h * 32 + 2, 4);
                            v = _mm512_add_ps(_mm512_add_ps(v, vm), vl);
                        }
                        _mm512_mask_storeu_ps(yt + h, m, v);
                    }
                }
            }
        }
    }
    if (cfg_nr) _tile_release();
}

void kern__amx_rows_bf16(const uint16_t *W, int in, const float *x, int ldx, int T, float *y,
                         int ldy, int r0, int r1, float *scratch) {
    amx_rows(W, in, x, ldx, T, y, ldy, r0, r1, scratch, false);
}

void kern__amx_rows_split(const uint16_t *W, int in, const float *x, int ldx, int T, float *y,
                          int ldy, int r0, int r1, float *scratch) {
    amx_rows(W, in, x, ldx, T, y, ldy, r0, r1, scratch, true);
}
#endif

/* kern__gemm_bf16x on the tiles (amx: kern__gemm_amx() said yes, in % 32 ==
 * 0) or on vdpbf16ps: the same panels and rounded x, 32 or 12 tokens a
 * step. */
static void gemm_bf16x(const kern_gemm_w *w, int in, const float *x, int ldx, int T, float *y,
                       int ldy, int r0, int r1, bool accumulate, float *scratch,
                       size_t scratch_floats, bool amx) {
    static const panel_bf16_fn step[PANEL_TOKENS + 1] = {
        NULL,           panel_bf16_1, panel_bf16_2,  panel_bf16_3,  panel_bf16_4,
        panel_bf16_5,   panel_bf16_6, panel_bf16_7,  panel_bf16_8,  panel_bf16_9,
        panel_bf16_10,  panel_bf16_11, panel_bf16_12};
    const int kmax = in < KERN_PANEL_COLS ? in : KERN_PANEL_COLS, in2 = (in + 1) / 2;
    const size_t p2_words = (size_t)KERN_PANEL_ROWS * ((kmax + 1) / 2);
    const size_t ld = (size_t)w->ld;
    uint32_t *P2 = (uint32_t *)scratch, *xw = P2 + p2_words;
#if KERN_GEMM_AMX
    const int tile = amx ? AMX_TOKENS : PANEL_TOKENS;
    float stage[KERN_PANEL_ROWS * AMX_TOKENS];
    int configured = 0; /* the tokens the tiles are configured for */
#else
    const int tile = PANEL_TOKENS;
    amx = false; /* no tiles in this build */
#endif
    /* the tokens whose rounded x fits the rest of the scratch, in steps of
     * a tile (at least one step of 12): each block's x is rounded once,
     * and W is unpacked once per block */
    int cap = scratch_floats > p2_words ? (int)((scratch_floats - p2_words) / (size_t)in2) : 0;
    cap = cap >= tile ? cap / tile * tile : cap / PANEL_TOKENS * PANEL_TOKENS;
    if (cap < PANEL_TOKENS) cap = PANEL_TOKENS;
    for (int tb = 0; tb < T; tb += cap) {
        const int nb = T - tb < cap ? T - tb : cap;
        round_tile(x + (size_t)tb * ldx, ldx, nb, 0, in, xw);
        for (int r = r0; r < r1; r += KERN_PANEL_ROWS) {
            const int nr = r1 - r < KERN_PANEL_ROWS ? r1 - r : KERN_PANEL_ROWS;
            for (int c0 = 0; c0 < in; c0 += KERN_PANEL_COLS) {
                const int kc = in - c0 < KERN_PANEL_COLS ? in - c0 : KERN_PANEL_COLS;
                if (w->dt == KERN_BF16)
                    pack_pairs(w->data, ld, r, nr, c0, kc, P2);
                else
                    pack_pairs_f32(w, r, nr, c0, kc, P2);
                const kern_prefetch next = next_panel(w, in, r, nr, r1, c0, kc);
                /* vdpbf16ps: the tokens dealt out evenly over the tiles,
                 * as kern__gemm's; the tiles' own 32 a step and a last
                 * ragged one, whose shape each change of mt reconfigures */
                const int n_steps = (nb + tile - 1) / tile;
                for (int i = 0; i < n_steps; i++) {
                    const int t0 = amx ? i * tile : nb * i / n_steps;
                    const int mt = amx ? (nb - t0 < tile ? nb - t0 : tile)
                                       : nb * (i + 1) / n_steps - t0;
                    const uint32_t *xt = xw + (size_t)t0 * in2 + c0 / 2;
                    float *yt = y + (size_t)(tb + t0) * ldy + r;
#if KERN_GEMM_AMX
                    if (amx) {
                        if (configured != mt) amx_configure(mt), configured = mt;
                        amx_panel(P2, kc / 2, xt, in2, mt, yt, ldy, nr, accumulate || c0 > 0,
                                  stage);
                        continue;
                    }
#endif
                    step[mt](P2, (kc + 1) / 2, xt, in2, yt, ldy, nr, accumulate || c0 > 0,
                             t0 == 0 && next.rows > 0 ? &next : NULL);
                }
            }
        }
    }
#if KERN_GEMM_AMX
    if (configured) _tile_release();
#endif
}

void kern__gemm_bf16x(const kern_gemm_w *w, int in, const float *x, int ldx, int T, float *y,
                      int ldy, int r0, int r1, bool accumulate, float *scratch,
                      size_t scratch_floats) {
    kern__gemm_bf16x_on(true, w, in, x, ldx, T, y, ldy, r0, r1, accumulate, scratch,
                        scratch_floats);
}

void kern__gemm_bf16x_on(bool amx, const kern_gemm_w *w, int in, const float *x, int ldx, int T,
                         float *y, int ldy, int r0, int r1, bool accumulate, float *scratch,
                         size_t scratch_floats) {
    gemm_bf16x(w, in, x, ldx, T, y, ldy, r0, r1, accumulate, scratch, scratch_floats,
               amx && in % 32 == 0 && kern__gemm_amx());
}

void kern__gemm_bf16act(const uint16_t *W, int in, const float *x, int T, float *y, int ldy,
                        int r0, int r1, float *scratch) {
    const kern_gemm_w w = {KERN_BF16, W, in, false};
    kern__gemm_bf16x(&w, in, x, in, T, y, ldy, r0, r1, false, scratch,
                     kern_matmul_scratch_floats(in));
}
#endif

#if !KERN_GEMM_AMX
bool kern__gemm_amx(void) { return false; }
#endif
