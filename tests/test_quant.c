/*
 * Block weight formats (kern.h): the byte layout of every format, the MXFP4
 * and Q8_0 values against the formats' definitions written out here (E2M1
 * table, nibble order, E8M0 bias; int8 times an f16 scale), and the CPU
 * reference product kern_matmul_w against a plain dequantise-then-multiply
 * loop in double, on the direct and the BLAS path, with ragged row ranges.
 * Element formats through kern_matmul_w are kern_matmul bit for bit.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kern.h"

static uint64_t next(uint64_t *x) {
    *x ^= *x << 13, *x ^= *x >> 7, *x ^= *x << 17;
    return *x;
}

static float unit(uint64_t *x) { return (float)((next(x) >> 11) * 0x1.0p-53) * 2.0f - 1.0f; }

Test(quant, layout_of_every_format) {
    kern_layout l = kern_weight_layout(KERN_F32, 3, 10);
    cr_expect_eq(l.row_bytes, 40);
    cr_expect_eq(l.bytes, 120);
    cr_expect_eq(l.scale_bytes, 0);
    l = kern_weight_layout(KERN_BF16, 3, 10);
    cr_expect_eq(l.row_bytes, 20);
    cr_expect_eq(l.bytes, 60);
    l = kern_weight_layout(KERN_MXFP4, 64, 96);
    cr_expect_eq(l.row_bytes, 48, "two codes per byte");
    cr_expect_eq(l.scale_row_bytes, 3, "one scale byte per 32 columns");
    cr_expect_eq(l.data_bytes, 64 * 48);
    cr_expect_eq(l.scale_bytes, 64 * 3);
    cr_expect_eq(l.bytes, 64 * 51);
    l = kern_weight_layout(KERN_Q8_0, 5, 64);
    cr_expect_eq(l.row_bytes, 64);
    cr_expect_eq(l.scale_row_bytes, 4, "one f16 scale per 32 columns");
    cr_expect_eq(l.bytes, 5 * 68);
    /* no layout: ragged blocks, negative sizes, unknown formats */
    cr_expect_eq(kern_weight_layout(KERN_MXFP4, 4, 48).bytes, 0);
    cr_expect_eq(kern_weight_layout(KERN_Q8_0, 4, 33).bytes, 0);
    cr_expect_eq(kern_weight_layout(KERN_F32, -1, 4).bytes, 0);
    cr_expect_eq(kern_weight_layout((kern_dtype)99, 4, 32).bytes, 0);
    cr_expect(kern_dtype_is_block(KERN_MXFP4) && kern_dtype_is_block(KERN_Q8_0));
    cr_expect(!kern_dtype_is_block(KERN_BF16));
    cr_expect_eq(kern_dtype_size(KERN_MXFP4), 0);
    cr_expect_str_eq(kern_dtype_name(KERN_MXFP4), "mxfp4");
    cr_expect_str_eq(kern_dtype_name(KERN_Q8_0), "q8_0");
}

/* The OCP MX spec's E2M1 values and E8M0 bias. */
Test(quant, e2m1_and_e8m0_values) {
    const float want[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
    for (unsigned c = 0; c < 16; c++)
        cr_expect_eq(kern_e2m1_to_f32(c), want[c], "code %u: %g, want %g", c,
                     (double)kern_e2m1_to_f32(c), (double)want[c]);
    cr_expect(signbit(kern_e2m1_to_f32(8)), "code 8 is -0");
    cr_expect_eq(kern_e8m0_to_f32(127), 1.0f);
    cr_expect_eq(kern_e8m0_to_f32(128), 2.0f);
    cr_expect_eq(kern_e8m0_to_f32(120), 1.0f / 128.0f);
    cr_expect_eq(kern_e8m0_to_f32(254), ldexpf(1.0f, 127));
    cr_expect_eq(kern_e8m0_to_f32(0), ldexpf(1.0f, -127));
    cr_expect(isnan(kern_e8m0_to_f32(255)));
}

/* Element 2j in the low nibble, 2j + 1 in the high one; a block's scale
 * covers its 32 columns only. */
Test(quant, mxfp4_nibble_order_and_blocks) {
    unsigned char codes[32] = {0}, scales[2] = {127, 129}; /* x1, then x4 */
    codes[0] = 0x21;  /* c0 = 0.5, c1 = 1 */
    codes[1] = 0xF7;  /* c2 = 6, c3 = -6 */
    codes[16] = 0x9A; /* c32 = -1 (code 10), c33 = -0.5 (code 9), both x4 */
    const kern_weight w = {
        .dt = KERN_MXFP4, .data = codes, .scales = scales, .rows = 1, .cols = 64};
    float row[64];
    kern_weight_row_f32(&w, 0, 0, 64, row);
    cr_expect_eq(row[0], 0.5f);
    cr_expect_eq(row[1], 1.0f);
    cr_expect_eq(row[2], 6.0f);
    cr_expect_eq(row[3], -6.0f);
    cr_expect_eq(row[4], 0.0f);
    cr_expect_eq(row[32], -4.0f);
    cr_expect_eq(row[33], -2.0f);
    float part[3];
    kern_weight_row_f32(&w, 0, 1, 4, part); /* an unaligned range */
    cr_expect(part[0] == 1.0f && part[1] == 6.0f && part[2] == -6.0f);
}

/* Element formats carry no scales (NULL): a row of one must be read
 * without touching that pointer (UBSan, in the sanitizer suite, calls even
 * NULL + 0 undefined; every embedding lookup reads a row this way). */
Test(quant, element_row_without_scales) {
    const float w32[6] = {1, 2, 3, 4, 5, 6};
    const kern_weight w = {.dt = KERN_F32, .data = w32, .rows = 2, .cols = 3};
    float row[3];
    kern_weight_row_f32(&w, 1, 0, 3, row);
    cr_expect(row[0] == 4.0f && row[1] == 5.0f && row[2] == 6.0f);
    uint16_t b16[4] = {0x3f80, 0x4000, 0x4040, 0x4080}; /* bf16 1, 2, 3, 4 */
    const kern_weight wb = {.dt = KERN_BF16, .data = b16, .rows = 2, .cols = 2};
    kern_weight_row_f32(&wb, 1, 1, 2, row);
    cr_expect_eq(row[0], 4.0f);
}

Test(quant, q8_0_values) {
    signed char codes[64];
    for (int i = 0; i < 64; i++) codes[i] = (signed char)(i - 32);
    uint16_t scales[2] = {kern_f32_to_f16(0.25f), kern_f32_to_f16(-3.0f)};
    const kern_weight w = {.dt = KERN_Q8_0, .data = codes, .scales = scales, .rows = 1, .cols = 64};
    float row[64];
    kern_weight_row_f32(&w, 0, 0, 64, row);
    for (int i = 0; i < 64; i++) {
        const float want = (float)(i - 32) * (i < 32 ? 0.25f : -3.0f);
        cr_expect_eq(row[i], want, "column %d: %g, want %g", i, (double)row[i], (double)want);
    }
}

/* Whole rows (the vectorised form in AVX2 builds) give every value bit for
 * bit as the definition does, element by element: every E2M1 code in
 * both nibbles at every E8M0 exponent (the denormal 2^-127, overflow to
 * inf at 254, NaN at 255, -0 for code 8), and every int8 times f16 scales
 * from the denormal to inf and NaN; a range off the block edges too. */
Test(quant, whole_rows_are_the_definition_bit_for_bit) {
    /* MXFP4: 256 rows (one per exponent) of 64 columns; block 0 has the
     * codes 0..15 in the low nibbles and 15..0 in the high ones, block 1
     * the nibbles swapped */
    static unsigned char codes[256 * 32];
    static unsigned char scales[256 * 2];
    for (int e = 0; e < 256; e++) {
        for (int j = 0; j < 16; j++) {
            codes[e * 32 + j] = (unsigned char)(j | (15 - j) << 4);
            codes[e * 32 + 16 + j] = (unsigned char)((15 - j) | j << 4);
        }
        scales[e * 2] = scales[e * 2 + 1] = (unsigned char)e;
    }
    const kern_weight w = {
        .dt = KERN_MXFP4, .data = codes, .scales = scales, .rows = 256, .cols = 64};
    float row[64];
    for (int e = 0; e < 256; e++) {
        kern_weight_row_f32(&w, e, 0, 64, row);
        for (int c = 0; c < 64; c++) {
            const unsigned byte = codes[e * 32 + c / 2], code = c % 2 ? byte >> 4 : byte & 15u;
            const float want = kern_e2m1_to_f32(code) * kern_e8m0_to_f32((uint8_t)e);
            if (isnan(want)) {
                cr_assert(isnan(row[c]), "e8m0 %d, column %d (code %u): %g, want NaN", e, c, code,
                          (double)row[c]);
                continue;
            }
            cr_assert(memcmp(&row[c], &want, sizeof want) == 0,
                      "e8m0 %d, column %d (code %u): %a, want %a", e, c, code, (double)row[c],
                      (double)want);
        }
        float part[40];
        kern_weight_row_f32(&w, e, 13, 53, part); /* both blocks, off their edges */
        cr_assert(memcmp(part, row + 13, sizeof part) == 0 || e == 255, "e8m0 %d: columns 13..53",
                  e);
    }
    /* Q8_0: rows of the 256 int8 values (8 blocks) under f16 scales */
    const uint16_t f16s[] = {0x0001 /* the smallest denormal */, 0x3c00 /* 1 */,
                             0xc500 /* -5 */, 0x7bff /* 65504 */, 0x7c00 /* inf */,
                             0x7e00 /* NaN */, 0x8000 /* -0 */};
    const int ns = (int)(sizeof f16s / sizeof f16s[0]);
    signed char q[256];
    uint16_t qs[8];
    for (int i = 0; i < 256; i++) q[i] = (signed char)(i - 128);
    float qrow[256];
    for (int k = 0; k < ns; k++) {
        for (int b = 0; b < 8; b++) qs[b] = f16s[(k + b) % ns];
        const kern_weight wq = {
            .dt = KERN_Q8_0, .data = q, .scales = qs, .rows = 1, .cols = 256};
        kern_weight_row_f32(&wq, 0, 0, 256, qrow);
        for (int c = 0; c < 256; c++) {
            const float want = (float)q[c] * kern_f16_to_f32(qs[c / 32]);
            if (isnan(want)) {
                cr_assert(isnan(qrow[c]), "q8_0 scale %04x, column %d", qs[c / 32], c);
                continue;
            }
            cr_assert(memcmp(&qrow[c], &want, sizeof want) == 0,
                      "q8_0 scale %04x, column %d: %a, want %a", qs[c / 32], c, (double)qrow[c],
                      (double)want);
        }
    }
}

/* A random weight of a block format: codes of every value, a few
 * exponents; `ref` gets its values [rows, cols] as written in the formats'
 * definitions (not through the library). */
static kern_weight make_block(kern_dtype dt, int rows, int cols, double *ref, uint64_t seed) {
    const kern_layout l = kern_weight_layout(dt, rows, cols);
    cr_assert(l.bytes > 0);
    unsigned char *data = malloc(l.data_bytes), *sc = malloc(l.scale_bytes);
    cr_assert(data && sc);
    static const double e2m1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < cols / 32; b++) {
            double scale;
            if (dt == KERN_MXFP4) {
                const int e = 120 + (int)(next(&seed) % 10); /* 2^-7 .. 2^2 */
                sc[(size_t)r * l.scale_row_bytes + b] = (unsigned char)e;
                scale = ldexp(1.0, e - 127);
            } else {
                const uint16_t h = kern_f32_to_f16(unit(&seed) * 0.05f);
                memcpy(sc + (size_t)r * l.scale_row_bytes + 2 * b, &h, 2);
                scale = kern_f16_to_f32(h); /* the f16 itself is the scale */
            }
            for (int j = 0; j < 32; j++) {
                const int c = b * 32 + j;
                double v;
                if (dt == KERN_MXFP4) {
                    const unsigned code = (unsigned)(next(&seed) % 16);
                    unsigned char *byte = &data[(size_t)r * l.row_bytes + c / 2];
                    *byte = c % 2 ? (unsigned char)((*byte & 0x0F) | code << 4)
                                  : (unsigned char)((*byte & 0xF0) | code);
                    v = (code & 8 ? -1 : 1) * e2m1[code & 7];
                } else {
                    const int q = (int)(next(&seed) % 255) - 127;
                    data[(size_t)r * l.row_bytes + c] = (unsigned char)(signed char)q;
                    v = q;
                }
                ref[(size_t)r * cols + c] = v * scale;
            }
        }
    return (kern_weight){.dt = dt, .data = data, .scales = sc, .rows = rows, .cols = cols};
}

static void check_product(kern_dtype dt, int rows, int cols) {
    const int Ts[] = {1, 3, 8, 31, 32, 45};
    const int maxT = 45, r0 = 2, r1 = rows - 3, ldy = rows + 1;
    double *ref = malloc((size_t)rows * cols * sizeof(double));
    float *x = malloc((size_t)maxT * cols * sizeof(float));
    float *y = malloc((size_t)maxT * ldy * sizeof(float));
    float *scratch = malloc(kern_matmul_scratch_floats(cols) * sizeof(float));
    cr_assert(ref && x && y && scratch);
    kern_weight w = make_block(dt, rows, cols, ref, 0x1234567ull + (uint64_t)rows * cols + dt);
    uint64_t seed = 99;
    for (int i = 0; i < maxT * cols; i++) x[i] = unit(&seed);
    double worst = 0;
    for (size_t k = 0; k < sizeof Ts / sizeof Ts[0]; k++) {
        const int T = Ts[k];
        for (size_t i = 0; i < (size_t)maxT * ldy; i++) y[i] = 1234.5f; /* must stay outside */
        kern_matmul_w(&w, x, T, y, ldy, r0, r1, scratch);
        for (int t = 0; t < T; t++)
            for (int r = 0; r < ldy; r++) {
                const float got = y[(size_t)t * ldy + r];
                if (r < r0 || r >= r1) {
                    cr_assert_eq(got, 1234.5f, "%s T=%d: column %d outside [%d, %d) written",
                                 kern_dtype_name(dt), T, r, r0, r1);
                    continue;
                }
                double want = 0, mag = 0;
                for (int c = 0; c < cols; c++) {
                    want += ref[(size_t)r * cols + c] * x[(size_t)t * cols + c];
                    mag += fabs(ref[(size_t)r * cols + c] * x[(size_t)t * cols + c]);
                }
                const double e = fabs(got - want) / (mag > 0 ? mag : 1);
                if (e > worst) worst = e;
                cr_assert(e < 1e-5, "%s [%d, %d] T=%d t=%d r=%d: %.9g, want %.9g", kern_dtype_name(dt),
                          rows, cols, T, t, r, (double)got, want);
            }
    }
    cr_log_info("quant %s [%d, %d]: worst error / sum |terms| %.2e (limit 1e-5)", kern_dtype_name(dt),
                rows, cols, worst);
    free((void *)w.data);
    free((void *)w.scales);
    free(ref);
    free(x);
    free(y);
    free(scratch);
}

/* 141 rows: a 128-row block and a ragged one, 8-row groups with a tail. */
Test(quant, mxfp4_product_against_dequantised_loop) {
    check_product(KERN_MXFP4, 141, 96);
    check_product(KERN_MXFP4, 20, 256);
}

Test(quant, q8_0_product_against_dequantised_loop) {
    check_product(KERN_Q8_0, 141, 64);
    check_product(KERN_Q8_0, 20, 320);
}

/* A block-format product needs its scratch: without one nothing is written. */
Test(quant, block_product_needs_scratch) {
    double ref[4 * 32];
    kern_weight w = make_block(KERN_MXFP4, 4, 32, ref, 5);
    float x[32] = {1}, y[4] = {7, 7, 7, 7};
    kern_matmul_w(&w, x, 1, y, 4, 0, 4, NULL);
    for (int i = 0; i < 4; i++) cr_expect_eq(y[i], 7.0f);
    free((void *)w.data);
    free((void *)w.scales);
}

/* Element formats go through kern_matmul unchanged. */
Test(quant, element_formats_are_kern_matmul) {
    const int rows = 37, cols = 64, T = 5;
    float *wf = malloc((size_t)rows * cols * sizeof(float));
    uint16_t *wb = malloc((size_t)rows * cols * sizeof(uint16_t));
    float x[T * 64], a[T * 37], b[T * 37];
    float *scratch = malloc(kern_matmul_scratch_floats(cols) * sizeof(float));
    cr_assert(wf && wb && scratch);
    uint64_t seed = 3;
    for (int i = 0; i < rows * cols; i++) {
        wf[i] = unit(&seed);
        wb[i] = kern_f32_to_bf16(wf[i]);
    }
    for (int i = 0; i < T * cols; i++) x[i] = unit(&seed);
    const kern_dtype dts[2] = {KERN_F32, KERN_BF16};
    const void *ws[2] = {wf, wb};
    for (int k = 0; k < 2; k++) {
        kern_matmul(dts[k], ws[k], cols, x, T, a, rows, 0, rows, scratch);
        kern_weight w = {.dt = dts[k], .data = ws[k], .rows = rows, .cols = cols};
        kern_matmul_w(&w, x, T, b, rows, 0, rows, scratch);
        cr_expect_eq(memcmp(a, b, sizeof a), 0, "%s differs", kern_dtype_name(dts[k]));
    }
    free(wf);
    free(wb);
    free(scratch);
}

/* Quantising: MXFP4 by the OCP rule (the block's largest value lands in
 * [4, 8) x 2^e, codes round to nearest, ties to even, saturate at 6); Q8_0
 * to max / 127. Dequantised, every value is within half a step of its
 * input (a quarter of its block's largest for MXFP4, where E2M1's steps
 * are 0.5, 1 and 2 of 2^e). */
Test(quant, quantize_rows) {
    enum { C = 256 };
    float x[C], back[C];
    uint64_t s = 77;
    for (int i = 0; i < C; i++) x[i] = unit(&s) * (i < 32 ? 1e-3f : i < 64 ? 0.0f : 40.0f);
    x[70] = 6.0f * 8.0f; /* a block whose largest is exactly 6 * 2^3 */
    const kern_dtype dts[2] = {KERN_MXFP4, KERN_Q8_0};
    for (int k = 0; k < 2; k++) {
        const kern_layout l = kern_weight_layout(dts[k], 1, C);
        unsigned char codes[256], scales[32];
        kern_quantize_row(dts[k], x, C, codes, scales);
        const kern_weight w = {.dt = dts[k], .data = codes, .scales = scales, .rows = 1, .cols = C};
        kern_weight_row_f32(&w, 0, 0, C, back);
        for (int b = 0; b < C / 32; b++) {
            float amax = 0;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[b * 32 + i]));
            const float step = dts[k] == KERN_MXFP4 ? amax / 4 : amax / 254;
            for (int i = 0; i < 32; i++) {
                const float e = fabsf(back[b * 32 + i] - x[b * 32 + i]);
                cr_expect(e <= step * 1.0001f + 1e-30f, "%s block %d value %d: %g back as %g",
                          kern_dtype_name(dts[k]), b, i, (double)x[b * 32 + i],
                          (double)back[b * 32 + i]);
            }
        }
        if (dts[k] == KERN_MXFP4) {
            cr_expect_eq(scales[1], 0, "an all-zero block: E8M0 0");
            cr_expect_eq(back[70], 48.0f, "6 x 2^3 is exact");
            cr_expect_eq(scales[2], 127 + 3, "its block's exponent is floor(log2 48) - 2 = 3");
        }
        (void)l;
    }
    /* ties to even: 2.5 lies between 2 (code 4) and 3 (code 5): code 4 */
    float tie[32] = {4.0f, 2.5f, 1.25f};
    unsigned char c[16], sc[1];
    kern_quantize_row(KERN_MXFP4, tie, 32, c, sc);
    cr_expect_eq(sc[0], 127, "largest 4: exponent 0");
    cr_expect_eq(c[0] >> 4, 4, "2.5 -> 2 (even code 4), got code %d", c[0] >> 4);
    cr_expect_eq(c[1] & 15, 2, "1.25 -> 1 (even code 2), got code %d", c[1] & 15);
}

/* ------------------------------------------------------------------------ */
/* The fast paths (AVX-512 builds) and the portable one, path by path        */

typedef void (*product_fn)(const kern_weight *w, const float *x, int T, float *y, int ldy, int r0,
                           int r1, float *scratch);

/* Floats past the scratch that no product may touch. */
#define GUARD 64
static const float SENTINEL = -7777.25f;

/* fn's product x W^T on rows [r0, r1) of a random [rows, cols] weight, for
 * each T of Ts, against the plain loop in double over the values the
 * formats define (make_block): |error| < 1e-5 of the sum of |terms|, no
 * column outside [r0, r1) and no row t >= T of y written, no scratch float
 * past kern_matmul_scratch_floats(cols) touched. */
static void check_against_loop(product_fn fn, const char *name, kern_dtype dt, int rows, int cols,
                               int r0, int r1, const int *Ts, int nT) {
    int maxT = 0;
    for (int k = 0; k < nT; k++)
        maxT = Ts[k] > maxT ? Ts[k] : maxT;
    const int ldy = rows + 2;
    const size_t ns = kern_matmul_scratch_floats(cols);
    double *ref = malloc((size_t)rows * cols * sizeof(double));
    double *want = malloc((size_t)maxT * rows * sizeof(double));
    double *mag = malloc((size_t)maxT * rows * sizeof(double));
    float *x = malloc((size_t)maxT * cols * sizeof(float));
    float *y = malloc((size_t)(maxT + 1) * ldy * sizeof(float));
    float *scratch = malloc((ns + GUARD) * sizeof(float));
    cr_assert(ref && want && mag && x && y && scratch);
    kern_weight w =
        make_block(dt, rows, cols, ref, 0xabcdefull + (uint64_t)rows * 7919 + cols + dt);
    uint64_t seed = 0x5eed + (uint64_t)cols;
    for (int i = 0; i < maxT * cols; i++)
        x[i] = unit(&seed);
    for (int t = 0; t < maxT; t++)
        for (int r = 0; r < rows; r++) {
            double s = 0, m = 0;
            for (int c = 0; c < cols; c++) {
                const double term = ref[(size_t)r * cols + c] * x[(size_t)t * cols + c];
                s += term;
                m += fabs(term);
            }
            want[(size_t)t * rows + r] = s;
            mag[(size_t)t * rows + r] = m;
        }
    double worst = 0;
    for (int k = 0; k < nT; k++) {
        const int T = Ts[k];
        for (size_t i = 0; i < (size_t)(maxT + 1) * ldy; i++)
            y[i] = SENTINEL;
        for (size_t i = 0; i < ns + GUARD; i++)
            scratch[i] = i < ns ? 0.0f : SENTINEL;
        fn(&w, x, T, y, ldy, r0, r1, scratch);
        for (size_t i = ns; i < ns + GUARD; i++)
            cr_assert_eq(scratch[i], SENTINEL,
                         "%s %s [%d, %d] T=%d: scratch float %zu of %zu written", name,
                         kern_dtype_name(dt), rows, cols, T, i, ns);
        for (int t = 0; t <= maxT; t++)
            for (int r = 0; r < ldy; r++) {
                const float got = y[(size_t)t * ldy + r];
                if (t >= T || r < r0 || r >= r1) {
                    cr_assert_eq(got, SENTINEL,
                                 "%s %s [%d, %d] T=%d: y[%d, %d] written (rows [%d, %d))", name,
                                 kern_dtype_name(dt), rows, cols, T, t, r, r0, r1);
                    continue;
                }
                const double m = mag[(size_t)t * rows + r],
                             e = fabs(got - want[(size_t)t * rows + r]) / (m > 0 ? m : 1);
                if (e > worst) worst = e;
                cr_assert(e < 1e-5,
                          "%s %s [%d, %d] rows [%d, %d) T=%d: y[%d, %d] = %.9g, want %.9g", name,
                          kern_dtype_name(dt), rows, cols, r0, r1, T, t, r, (double)got,
                          want[(size_t)t * rows + r]);
            }
    }
    cr_log_info("%s %s [%d, %d]: worst error / sum |terms| %.2e", name, kern_dtype_name(dt), rows,
                cols, worst);
    free((void *)w.data);
    free((void *)w.scales);
    free(ref);
    free(want);
    free(mag);
    free(x);
    free(y);
    free(scratch);
}

/* Shapes for the direct and prefill paths: ragged row counts and ranges
 * (not multiples of 8, 32 or 128, not starting on one), and widths of 1, 2,
 * 3, 33 and 112 blocks (K3's expert width 3584). */
static const int SHAPES[][4] = {
    /* rows, cols, r0, r1 */
    {141, 96, 3, 139}, {37, 32, 1, 36}, {29, 64, 5, 22}, {19, 1056, 0, 19}, {21, 3584, 2, 19},
};
#define N_SHAPES (int)(sizeof SHAPES / sizeof SHAPES[0])

/* Decode: every T below 64 on the direct path (codes read in place; the
 * GEMM from 32 in a build without AVX-512). */
Test(quant, direct_path_every_T_against_dequantised_loop) {
    int Ts[63];
    for (int i = 0; i < 63; i++)
        Ts[i] = i + 1;
    for (int d = 0; d < 2; d++)
        for (int s = 0; s < N_SHAPES; s++)
            check_against_loop(kern_matmul_w, "direct", d ? KERN_Q8_0 : KERN_MXFP4, SHAPES[s][0],
                               SHAPES[s][1], SHAPES[s][2], SHAPES[s][3], Ts, 63);
}

/* Prefill: from 64 tokens, token counts that leave every remainder of the
 * kernel's 12-token steps, row ranges that leave ragged 32-row panels (of
 * 8, 1, 23 and 2 rows). */
Test(quant, prefill_path_against_dequantised_loop) {
    const int Ts[] = {64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 77, 96};
    const int nT = (int)(sizeof Ts / sizeof Ts[0]);
    for (int d = 0; d < 2; d++) {
        const kern_dtype dt = d ? KERN_Q8_0 : KERN_MXFP4;
        check_against_loop(kern_matmul_w, "prefill", dt, 141, 96, 3, 139, Ts, nT);
        check_against_loop(kern_matmul_w, "prefill", dt, 40, 32, 7, 40, Ts, nT);
        check_against_loop(kern_matmul_w, "prefill", dt, 60, 64, 2, 57, Ts, nT); /* 32 + 23 rows */
        /* K3's width, with every kind of last step */
        const int wide[] = {64, 65, 67, 98};
        check_against_loop(kern_matmul_w, "prefill", dt, 70, 3584, 1, 67, wide, 4);
    }
}

/* The portable path (the build without AVX-512; here through
 * kern_matmul_w_ref) meets the same contract. */
Test(quant, portable_path_against_dequantised_loop) {
    const int Ts[] = {1, 2, 7, 31, 32, 45};
    for (int d = 0; d < 2; d++)
        for (int s = 0; s < N_SHAPES; s++)
            check_against_loop(kern_matmul_w_ref, "portable", d ? KERN_Q8_0 : KERN_MXFP4,
                               SHAPES[s][0], SHAPES[s][1], SHAPES[s][2], SHAPES[s][3], Ts, 6);
}

/* What batched decode relies on: below maxT + 1 tokens (the fast path's
 * 64, the portable path's 32), row t of a T-token product is the one-token
 * product of x's row t, bit for bit. */
static void check_rows_independent_of_T(product_fn fn, const char *name, kern_dtype dt, int rows,
                                        int cols, int r0, int r1, int maxT) {
    const int ldy = rows;
    double *ref = malloc((size_t)rows * cols * sizeof(double));
    float *x = malloc((size_t)maxT * cols * sizeof(float));
    float *y = malloc((size_t)maxT * ldy * sizeof(float)),
          *y1 = malloc((size_t)maxT * ldy * sizeof(float));
    float *scratch = malloc(kern_matmul_scratch_floats(cols) * sizeof(float));
    cr_assert(ref && x && y && y1 && scratch);
    kern_weight w = make_block(dt, rows, cols, ref, 0x77ull + (uint64_t)rows * cols + dt);
    uint64_t seed = 4242;
    for (int i = 0; i < maxT * cols; i++)
        x[i] = unit(&seed);
    for (int t = 0; t < maxT; t++)
        fn(&w, x + (size_t)t * cols, 1, y1 + (size_t)t * ldy, ldy, r0, r1, scratch);
    for (int T = 2; T <= maxT; T++) {
        fn(&w, x, T, y, ldy, r0, r1, scratch);
        for (int t = 0; t < T; t++)
            cr_assert_eq(
                memcmp(y + (size_t)t * ldy + r0, y1 + (size_t)t * ldy + r0,
                       (size_t)(r1 - r0) * sizeof(float)),
                0, "%s %s [%d, %d] rows [%d, %d): token %d of %d differs from the same token alone",
                name, kern_dtype_name(dt), rows, cols, r0, r1, t, T);
    }
    free((void *)w.data);
    free((void *)w.scales);
    free(ref);
    free(x);
    free(y);
    free(y1);
    free(scratch);
}

Test(quant, direct_rows_do_not_depend_on_T) {
    for (int d = 0; d < 2; d++)
        for (int s = 0; s < N_SHAPES; s++) {
            const kern_dtype dt = d ? KERN_Q8_0 : KERN_MXFP4;
            check_rows_independent_of_T(kern_matmul_w, "direct", dt, SHAPES[s][0], SHAPES[s][1],
                                        SHAPES[s][2], SHAPES[s][3], 63);
            check_rows_independent_of_T(kern_matmul_w_ref, "portable", dt, SHAPES[s][0],
                                        SHAPES[s][1], SHAPES[s][2], SHAPES[s][3], 31);
        }
}

/* ------------------------------------------------------------------------ */
/* E8M0 scales at the ends of their range, on every path                    */

/* [9, 544] MXFP4 weights for the scale tests: 8 rows and a tail; 17 blocks
 * per row, so the scales go through the 16-wide conversion and its tail. */
#define EDGE_COLS 544

/* y[k] [9] = the last token's row of the product of a [9, EDGE_COLS]
 * MXFP4 weight (codes [9, EDGE_COLS / 2], scales [9, EDGE_COLS / 32]), for
 * every token equal to x [EDGE_COLS], at T = 1 (direct, one token), 5
 * (direct, token groups) and 70 (prefill), k = 0, 1, 2. */
static void product_all_paths(const unsigned char *codes, const unsigned char *scales,
                              const float *x, float y[3][9]) {
    const kern_weight w = {
        .dt = KERN_MXFP4, .data = codes, .scales = scales, .rows = 9, .cols = EDGE_COLS};
    float *xs = malloc((size_t)70 * EDGE_COLS * sizeof(float)),
          *ys = malloc((size_t)70 * 9 * sizeof(float));
    float *scratch = malloc(kern_matmul_scratch_floats(EDGE_COLS) * sizeof(float));
    cr_assert(xs && ys && scratch);
    for (int t = 0; t < 70; t++)
        memcpy(xs + (size_t)t * EDGE_COLS, x, EDGE_COLS * sizeof(float));
    const int Ts[3] = {1, 5, 70};
    for (int k = 0; k < 3; k++) {
        kern_matmul_w(&w, xs, Ts[k], ys, 9, 0, 9, scratch);
        memcpy(y[k], ys + (size_t)(Ts[k] - 1) * 9, 9 * sizeof(float));
    }
    free(xs);
    free(ys);
    free(scratch);
}

/* Every finite exponent, 0 (2^-127, a denormal) to 254 (2^127), is the
 * power of two kern_e8m0_to_f32 says: products against the double loop,
 * x scaled by 2^(117 - e) so every term is near 2^-10 whatever e is. The
 * codes stay where the weights are finite in f32 (up to 3 at e = 253, 1.5
 * at e = 254). */
Test(quant, every_finite_e8m0_exponent) {
    static const double e2m1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    static unsigned char codes[9 * EDGE_COLS / 2];
    static float x[EDGE_COLS];
    uint64_t seed = 31337;
    for (int e = 0; e <= 254; e++) {
        /* magnitudes v with v * 2^(e - 127) < 2^128: all below 253, up to 3 at 253, 1.5 at 254 */
        const unsigned lim = e == 254 ? 4 : e == 253 ? 6 : 8;
        for (int i = 0; i < 9 * EDGE_COLS / 2; i++) {
            const unsigned lo = (unsigned)(next(&seed) % lim) | (unsigned)(next(&seed) % 2) << 3;
            const unsigned hi = (unsigned)(next(&seed) % lim) | (unsigned)(next(&seed) % 2) << 3;
            codes[i] = (unsigned char)(lo | hi << 4);
        }
        for (int c = 0; c < EDGE_COLS; c++)
            x[c] = ldexpf(unit(&seed), 117 - e);
        float y[3][9];
        unsigned char scales[9 * EDGE_COLS / 32];
        memset(scales, e, sizeof scales);
        product_all_paths(codes, scales, x, y);
        cr_assert_eq(kern_e8m0_to_f32((uint8_t)e), (float)ldexp(1.0, e - 127));
        for (int r = 0; r < 9; r++) {
            double want = 0, mag = 0;
            for (int c = 0; c < EDGE_COLS; c++) {
                const unsigned code = codes[r * EDGE_COLS / 2 + c / 2] >> (c % 2 ? 4 : 0) & 15u;
                const double term =
                    (code & 8 ? -1 : 1) * e2m1[code & 7] * ldexp(1.0, e - 127) * x[c];
                want += term;
                mag += fabs(term);
            }
            for (int k = 0; k < 3; k++)
                cr_assert(fabs(y[k][r] - want) <= 1e-5 * mag,
                          "e8m0 %d, path %d, row %d: %.9g, want %.9g", e, k, r, (double)y[k][r],
                          want);
        }
    }
}

/* The values past f32's range behave as the dequantised f32 weights do
 * (kern_weight_row_f32): e = 254 times a code of 2 or more is +-inf in f32
 * (2^128 and up), so the sums are +-inf, or NaN with both signs; e = 255
 * is NaN and makes every sum it enters NaN, in any block (one per row
 * here, the 16-wide conversion's and its tail's). */
Test(quant, e8m0_254_overflow_and_255_nan) {
    static unsigned char codes[9 * EDGE_COLS / 2];
    static float x[EDGE_COLS];
    float y[3][9];
    const int rb = EDGE_COLS / 2, nb = EDGE_COLS / 32;
    unsigned char scales[9 * EDGE_COLS / 32];
    for (int c = 0; c < EDGE_COLS; c++)
        x[c] = 1.0f;
    memset(codes, 0, sizeof codes);
    codes[0 * rb] = 0x07;       /* row 0, column 0: +6 -> +inf */
    codes[1 * rb + 200] = 0x0F; /* row 1, column 400: -6 -> -inf */
    codes[2 * rb + 130] = 0x4C; /* row 2, columns 260, 261: -2 and +2 -> -inf + inf = NaN */
    codes[3 * rb + 271] = 0x30; /* row 3, column 543: 1.5 * 2^127, finite */
    codes[8 * rb + 5] = 0x70;   /* row 8 (the tail row): +inf */
    const unsigned char w0[16] = {0x07};
    float row[32];
    const unsigned char s254 = 254;
    const kern_weight w254 = {
        .dt = KERN_MXFP4, .data = w0, .scales = &s254, .rows = 1, .cols = 32};
    kern_weight_row_f32(&w254, 0, 0, 32, row);
    cr_assert(isinf(row[0]) && row[0] > 0, "the reference dequantises 6 * 2^127 to +inf");
    memset(scales, 254, sizeof scales);
    product_all_paths(codes, scales, x, y);
    for (int k = 0; k < 3; k++) {
        cr_expect(isinf(y[k][0]) && y[k][0] > 0, "path %d: row 0 %g, want +inf", k,
                  (double)y[k][0]);
        cr_expect(isinf(y[k][1]) && y[k][1] < 0, "path %d: row 1 %g, want -inf", k,
                  (double)y[k][1]);
        cr_expect(isnan(y[k][2]), "path %d: row 2 %g, want NaN", k, (double)y[k][2]);
        cr_expect_eq(y[k][3], ldexpf(1.5f, 127), "path %d: row 3 %g, want 1.5 * 2^127", k,
                     (double)y[k][3]);
        for (int r = 4; r < 8; r++)
            cr_expect_eq(y[k][r], 0.0f, "path %d: row %d", k, r);
        cr_expect(isinf(y[k][8]) && y[k][8] > 0, "path %d: row 8 %g, want +inf", k,
                  (double)y[k][8]);
    }
    memset(codes, 0x22, sizeof codes); /* every value 1 */
    memset(scales, 127, sizeof scales);
    for (int r = 0; r < 9; r++)
        scales[r * nb + (r * 5 + 1) % nb] = 255; /* row 3: block 16, the tail */
    product_all_paths(codes, scales, x, y);
    for (int k = 0; k < 3; k++)
        for (int r = 0; r < 9; r++)
            cr_expect(isnan(y[k][r]), "path %d: row %d %g, want NaN", k, r, (double)y[k][r]);
    cr_expect(isnan(kern_e8m0_to_f32(255)));
}

/* Element formats through kern_matmul_w are kern_matmul bit for bit on
 * every path: direct (T < 64 with AVX-512, 8 without), the GEMM or widen +
 * BLAS beyond, no scratch. */
Test(quant, element_formats_are_kern_matmul_on_every_path) {
    const int rows = 45, cols = 96, r0 = 3, r1 = 43, maxT = 70;
    float *wf = malloc((size_t)rows * cols * sizeof(float));
    uint16_t *wb = malloc((size_t)rows * cols * sizeof(uint16_t)),
             *wh = malloc((size_t)rows * cols * sizeof(uint16_t));
    float *x = malloc((size_t)maxT * cols * sizeof(float));
    float *a = malloc((size_t)maxT * rows * sizeof(float)),
          *b = malloc((size_t)maxT * rows * sizeof(float));
    float *scratch = malloc(kern_matmul_scratch_floats(cols) * sizeof(float));
    cr_assert(wf && wb && wh && x && a && b && scratch);
    uint64_t seed = 11;
    for (int i = 0; i < rows * cols; i++) {
        wf[i] = unit(&seed);
        wb[i] = kern_f32_to_bf16(wf[i]);
        wh[i] = kern_f32_to_f16(wf[i]);
    }
    for (int i = 0; i < maxT * cols; i++)
        x[i] = unit(&seed);
    const kern_dtype dts[3] = {KERN_F32, KERN_BF16, KERN_F16};
    const void *ws[3] = {wf, wb, wh};
    const int Ts[] = {1, 4, 31, 32, 40, 64, 70};
    for (int d = 0; d < 3; d++)
        for (int k = 0; k < 7; k++)
            for (int with = 0; with < 2; with++) {
                const int T = Ts[k];
                float *sc = with ? scratch : NULL;
                memset(a, 0, (size_t)maxT * rows * sizeof(float));
                memset(b, 0, (size_t)maxT * rows * sizeof(float));
                kern_matmul(dts[d], ws[d], cols, x, T, a, rows, r0, r1, sc);
                kern_weight w = {.dt = dts[d], .data = ws[d], .rows = rows, .cols = cols};
                kern_matmul_w(&w, x, T, b, rows, r0, r1, sc);
                cr_expect_eq(memcmp(a, b, (size_t)maxT * rows * sizeof(float)), 0,
                             "%s T=%d %s scratch differs", kern_dtype_name(dts[d]), T,
                             with ? "with" : "without");
            }
    free(wf);
    free(wb);
    free(wh);
    free(x);
    free(a);
    free(b);
    free(scratch);
}
