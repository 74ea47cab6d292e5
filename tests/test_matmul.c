/*
 * kern_matmul on every path (direct dot products for few tokens, the
 * register-blocked GEMM of kern_gemm.h for many; F32, BF16, F16; widths
 * that are and are not a multiple of 32, and wider than one panel; row
 * ranges with ragged ends) against a double-precision reference, and the
 * two properties the engine relies on: on the direct path, row t of a
 * T-token product is bit-identical to the one-token product of that row
 * (batched decoding); on the GEMM path every output is the left-to-right
 * fma sum of its row, bit for bit, whatever T, the token's place or the
 * row range (so prefill's results do not depend on the thread cut).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kern.h"
#include "cpu/kern_gemm.h"

static uint64_t next(uint64_t *x) {
    *x ^= *x << 13, *x ^= *x >> 7, *x ^= *x << 17;
    return *x;
}

static float unit(uint64_t *x) {
    return (float)((next(x) >> 11) * 0x1.0p-53) * 2.0f - 1.0f;
}

/* W: [rows, in] in dt, plus its exact f32 values in wf. */
static void *make_w(kern_dtype dt, int rows, int in, float *wf, uint64_t seed) {
    size_t n = (size_t)rows * in;
    void *w = malloc(n * kern_dtype_size(dt));
    cr_assert(w);
    for (size_t i = 0; i < n; i++) {
        float v = unit(&seed);
        if (dt == KERN_BF16) {
            ((uint16_t *)w)[i] = kern_f32_to_bf16(v);
            wf[i] = kern_bf16_to_f32(((uint16_t *)w)[i]);
        } else if (dt == KERN_F16) {
            ((uint16_t *)w)[i] = kern_f32_to_f16(v);
            wf[i] = kern_f16_to_f32(((uint16_t *)w)[i]);
        } else {
            ((float *)w)[i] = v;
            wf[i] = v;
        }
    }
    return w;
}

static void check_shape(kern_dtype dt, int rows, int in) {
    const int Ts[] = {1, 2, 3, 5, 7, 8, 11, 12, 13, 20, 31, 32, 40, 63, 64, 65, 77, 100};
    const int maxT = 100, r0 = 3, r1 = rows - 5, ldy = rows + 3;
    float *wf = malloc((size_t)rows * in * sizeof(float));
    float *x = malloc((size_t)maxT * in * sizeof(float));
    float *y = malloc((size_t)maxT * ldy * sizeof(float));
    float *y1 = malloc((size_t)ldy * sizeof(float));
    float *scratch = malloc(kern_matmul_scratch_floats(in) * sizeof(float));
    cr_assert(wf && x && y && y1 && scratch);
    void *w = make_w(dt, rows, in, wf, 0x9e3779b97f4a7c15ull + (uint64_t)rows * in + dt);
    uint64_t seed = 12345;
    for (int i = 0; i < maxT * in; i++)
        x[i] = unit(&seed);
    for (size_t k = 0; k < sizeof Ts / sizeof Ts[0]; k++) {
        const int T = Ts[k];
        for (int i = 0; i < T * ldy; i++)
            y[i] = NAN; /* columns outside [r0, r1) stay NaN */
        kern_matmul(dt, w, in, x, T, y, ldy, r0, r1, scratch);
        for (int t = 0; t < T; t++) {
            for (int r = 0; r < rows; r++) {
                float got = y[(size_t)t * ldy + r];
                if (r < r0 || r >= r1) {
                    cr_assert(isnan(got), "dt %d T %d: column %d outside [%d, %d) written", dt, T,
                              r, r0, r1);
                    continue;
                }
                double ref = 0.0, mag = 0.0;
                for (int i = 0; i < in; i++) {
                    ref += (double)wf[(size_t)r * in + i] * x[(size_t)t * in + i];
                    mag += fabs((double)wf[(size_t)r * in + i] * x[(size_t)t * in + i]);
                }
                cr_assert_leq(fabs(got - ref), 1e-5 * mag + 1e-6,
                              "dt %d rows %d in %d T %d: y[%d, %d] = %g, reference %g", dt, rows,
                              in, T, t, r, got, ref);
            }
            /* the direct path (T < 64): each row's sums are a lone token's,
             * bit for bit, whatever the group of tokens it went in */
            if (T < 64) {
                kern_matmul(dt, w, in, x + (size_t)t * in, 1, y1, ldy, r0, r1, scratch);
                cr_assert_eq(
                    memcmp(y1 + r0, y + (size_t)t * ldy + r0, (size_t)(r1 - r0) * 4), 0,
                    "dt %d rows %d in %d: token %d of %d differs from the same token alone", dt,
                    rows, in, t, T);
            }
        }
    }
    free(w);
    free(wf);
    free(x);
    free(y);
    free(y1);
    free(scratch);
}

Test(matmul, all_paths_match_reference) {
    const kern_dtype dts[] = {KERN_F32, KERN_BF16, KERN_F16};
    for (int d = 0; d < 3; d++) {
        check_shape(dts[d], 77, 256); /* 8-row blocks plus ragged ends */
        check_shape(dts[d], 300, 96);
        check_shape(dts[d], 41, 80); /* width not a multiple of 32 */
        check_shape(dts[d], 19, 83); /* nor of 8: every row's scalar tail */
    }
}

/* The bf16 product of one token has two loops: a matrix that comes from
 * memory (kern_weight's `streamed`) is read one row after another (one
 * stream, with or without a software prefetch along it: kern_weight's
 * stream_prefetch; rows off the 64-byte lines by a multiple of 4 bytes
 * put together from aligned lines); from cache, or rows only 2-byte
 * aligned, eight rows side by side. Both must give the bits of the
 * many-token path's rows, so batched and lone decoding agree whatever the
 * hints and the file's alignment: W placed on a line and 2, 8, 32 and 34
 * bytes off it, row ranges with ragged ends, through kern_matmul and
 * kern_matmul_w with and without the hints. Two and three tokens (a
 * routed expert's share of a batch) too, with the hints. Rows of 1-4 KiB
 * and over 6 KiB on the lines go eight side by side from memory, the
 * next eight prefetched in order ([37, 1024], [19, 4096]): the same bits
 * again. */
Test(matmul, bf16_one_token_loops_agree_on_and_off_lines) {
    const int shapes[][2] = {{77, 256}, {300, 96}, {16, 2304}, {37, 1024}, {19, 4096}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int rows = shapes[s][0], in = shapes[s][1], T = 5, r0 = 3, r1 = rows - 2;
        float *wf = malloc((size_t)rows * in * sizeof(float));
        float *x = malloc((size_t)T * in * sizeof(float));
        float *yT = malloc((size_t)T * rows * sizeof(float)), *y1 = malloc(rows * sizeof(float));
        float *scratch = malloc(kern_matmul_scratch_floats(in) * sizeof(float));
        uint16_t *w = make_w(KERN_BF16, rows, in, wf, 0xa5a5ull + (uint64_t)s);
        const size_t wb = (size_t)rows * in * 2;
        unsigned char *base = aligned_alloc(64, wb + 128);
        cr_assert(wf && x && yT && y1 && scratch && w && base);
        uint64_t seed = 99 + s;
        for (int i = 0; i < T * in; i++)
            x[i] = unit(&seed);
        kern_matmul(KERN_BF16, w, in, x, T, yT, rows, r0, r1, scratch); /* the 5-token path */
        const size_t offs[] = {0, 2, 8, 32, 34};
        for (size_t o = 0; o < sizeof offs / sizeof offs[0]; o++) {
            memcpy(base + offs[o], w, wb);
            for (int t = 0; t < T; t++)
                for (int how = 0; how < 4; how++) {
                    const kern_weight kw = {.dt = KERN_BF16, .data = base + offs[o], .rows = rows,
                                            .cols = in, .streamed = how >= 2,
                                            .stream_prefetch = how == 3 ? 8192 : 0};
                    for (int r = 0; r < rows; r++)
                        y1[r] = NAN;
                    if (how == 0)
                        kern_matmul(KERN_BF16, base + offs[o], in, x + (size_t)t * in, 1, y1, rows,
                                    r0, r1, scratch);
                    else
                        kern_matmul_w(&kw, x + (size_t)t * in, 1, y1, rows, r0, r1, scratch);
                    cr_assert_eq(
                        memcmp(y1 + r0, yT + (size_t)t * rows + r0, (size_t)(r1 - r0) * 4), 0,
                        "[%d, %d], W %zu bytes off a line, %s: token %d alone differs", rows, in,
                        offs[o],
                        how == 3   ? "streamed, prefetched"
                        : how == 2 ? "streamed"
                        : how == 1 ? "cached"
                                   : "kern_matmul",
                        t);
                    cr_assert(isnan(y1[r0 - 1]) && isnan(y1[r1]), "rows outside [r0, r1) written");
                }
            /* two and three tokens, streamed (a routed expert's share of a
             * batch): still each token's lone bits */
            float *y3 = malloc((size_t)3 * rows * sizeof(float));
            cr_assert(y3);
            for (int n = 2; n <= 3; n++)
                for (int t0 = 0; t0 + n <= T; t0 += n) {
                    const kern_weight kw = {.dt = KERN_BF16, .data = base + offs[o], .rows = rows,
                                            .cols = in, .streamed = true,
                                            .stream_prefetch = 8192};
                    kern_matmul_w(&kw, x + (size_t)t0 * in, n, y3, rows, r0, r1, scratch);
                    for (int t = 0; t < n; t++)
                        cr_assert_eq(memcmp(y3 + (size_t)t * rows + r0,
                                            yT + (size_t)(t0 + t) * rows + r0,
                                            (size_t)(r1 - r0) * 4),
                                     0, "[%d, %d], W %zu bytes off a line, %d tokens streamed: "
                                        "token %d differs", rows, in, offs[o], n, t0 + t);
                }
            free(y3);
        }
        free(base);
        free(w);
        free(wf);
        free(x);
        free(yT);
        free(y1);
        free(scratch);
    }
}

/* A one-token product of a matrix from memory with rows shorter than a
 * page goes (AVX2; AVX-512 for bf16) as eight sequential runs of rows
 * instead of eight rows side by side; every element format must keep
 * each row's bits and write only [r0, r1): row ranges of 16 rows and
 * more, ragged at both ends, as a thread's share of full27's [2304, 1024]
 * down projection would be, and below 16 rows (side by side), against the
 * same product from cache. */
Test(matmul, streamed_short_rows_keep_each_rows_bits) {
    const kern_dtype dts[] = {KERN_F32, KERN_BF16, KERN_F16};
    const int shapes[][2] = {{90, 1024}, {203, 256}, {40, 96}, {21, 1024}};
    for (int d = 0; d < 3; d++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            const int rows = shapes[s][0], in = shapes[s][1], r0 = 3, r1 = rows - 2;
            float *wf = malloc((size_t)rows * in * sizeof(float)), *x = malloc(in * sizeof(float));
            float *ya = malloc(rows * sizeof(float)), *yb = malloc(rows * sizeof(float));
            float *scratch = malloc(kern_matmul_scratch_floats(in) * sizeof(float));
            void *w = make_w(dts[d], rows, in, wf, 0x51ed27ull + (uint64_t)s * 7 + dts[d]);
            cr_assert(wf && x && ya && yb && scratch && w);
            uint64_t seed = 4242 + s;
            for (int i = 0; i < in; i++)
                x[i] = unit(&seed);
            for (int r = 0; r < rows; r++)
                ya[r] = yb[r] = NAN;
            kern_weight kw = {.dt = dts[d], .data = w, .rows = rows, .cols = in};
            kern_matmul_w(&kw, x, 1, ya, rows, r0, r1, scratch);
            kw.streamed = true;
            kern_matmul_w(&kw, x, 1, yb, rows, r0, r1, scratch);
            cr_assert_eq(memcmp(ya + r0, yb + r0, (size_t)(r1 - r0) * sizeof(float)), 0,
                         "%s [%d, %d] rows [%d, %d): streamed and cached products differ",
                         kern_dtype_name(dts[d]), rows, in, r0, r1);
            cr_assert(isnan(yb[r0 - 1]) && isnan(yb[r1]), "rows outside [r0, r1) written");
            for (int r = r0; r < r1; r++)
                cr_assert(isfinite(yb[r]), "row %d not written", r);
            free(w);
            free(wf);
            free(x);
            free(ya);
            free(yb);
            free(scratch);
        }
}

/* The GEMM path (T >= 64 with scratch; kern_matmul_w_prefill from
 * KERN_PREFILL_GEMM_MIN_T) against its specification: each output the
 * sequential fmaf chain over its row, compared bit for bit, for row ranges
 * cut anywhere (a thread's share of a product). */
static void check_gemm_exact(kern_dtype dt, int rows, int in, int T, bool prefill) {
    float *wf = malloc((size_t)rows * in * sizeof(float));
    float *x = malloc((size_t)T * in * sizeof(float));
    float *y = malloc((size_t)T * rows * sizeof(float));
    float *scratch = malloc(kern_matmul_scratch_floats(in) * sizeof(float));
    cr_assert(wf && x && y && scratch);
    void *w = make_w(dt, rows, in, wf, 0x5bd1e995ull * (uint64_t)(rows + in + T) + dt);
    uint64_t seed = 777 + (uint64_t)T;
    for (size_t i = 0; i < (size_t)T * in; i++)
        x[i] = unit(&seed);
    /* three ragged row ranges, as three threads would compute them */
    const int cut[4] = {0, rows / 3 + 1, 2 * rows / 3 - 2, rows};
    const kern_weight kw = {.dt = dt, .data = w, .scales = NULL, .rows = rows, .cols = in};
    for (int k = 0; k < 3; k++) {
        if (prefill)
            kern_matmul_w_prefill(&kw, x, T, y, rows, cut[k], cut[k + 1], scratch, false);
        else
            kern_matmul(dt, w, in, x, T, y, rows, cut[k], cut[k + 1], scratch);
    }
    for (int t = 0; t < T; t++)
        for (int r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int i = 0; i < in; i++)
                acc = fmaf(wf[(size_t)r * in + i], x[(size_t)t * in + i], acc);
            float got = y[(size_t)t * rows + r];
            cr_assert(memcmp(&got, &acc, sizeof acc) == 0,
                      "dt %d [%d, %d] T %d: y[%d, %d] = %a, the fma chain gives %a", dt, rows, in,
                      T, t, r, got, acc);
        }
    free(w);
    free(wf);
    free(x);
    free(y);
    free(scratch);
}

Test(matmul, gemm_path_is_the_fma_chain) {
#if !KERN_GEMM_SIMD
    cr_skip_test("the fma-chain GEMM is kern_gemm.h's AVX-512 or AVX2 panels; this build has "
                 "neither (KDS_NATIVE=OFF on x86-64, or such a CPU) and multiplies from 64 "
                 "tokens by BLAS");
#endif
    const kern_dtype dts[] = {KERN_F32, KERN_BF16, KERN_F16};
    for (int d = 0; d < 3; d++) {
        check_gemm_exact(dts[d], 70, 96, 64, false);
        check_gemm_exact(dts[d], 45, 81, 77, false); /* odd width: the last column alone */
        check_gemm_exact(dts[d], 33, 4200, 65, false); /* two panels of columns */
        /* a prefill's products: the same sums from fewer tokens */
        check_gemm_exact(dts[d], 70, 96, KERN_PREFILL_GEMM_MIN_T, true);
        check_gemm_exact(dts[d], 45, 81, 23, true);
    }
}

Test(matmul, no_scratch_forces_direct_path) {
    const int rows = 50, in = 64, T = 20;
    float *wf = malloc((size_t)rows * in * sizeof(float)), *x = malloc((size_t)T * in * 4);
    float *a = malloc((size_t)T * rows * 4), *b = malloc((size_t)T * rows * 4);
    float *scratch = malloc(kern_matmul_scratch_floats(in) * sizeof(float));
    void *w = make_w(KERN_BF16, rows, in, wf, 7);
    uint64_t seed = 99;
    for (int i = 0; i < T * in; i++)
        x[i] = unit(&seed);
    kern_matmul(KERN_BF16, w, in, x, T, a, rows, 0, rows, NULL);
    kern_matmul(KERN_BF16, w, in, x, T, b, rows, 0, rows, scratch);
    for (int i = 0; i < T * rows; i++)
        cr_assert_leq(fabsf(a[i] - b[i]), 1e-4f, "entry %d: %g without scratch, %g with", i, a[i],
                      b[i]);
    free(w);
    free(wf);
    free(x);
    free(a);
    free(b);
    free(scratch);
}

#if KERN_GEMM_SIMD
/* One shape of gemm_f32_strides_transposed_accumulate. */
static void gemm_f32_case(int rows, int in, int T, int ldw, int ldx, int ldy, uint64_t seed) {
    float *w = malloc((size_t)ldw * (in + 10) * sizeof(float));
    float *x = malloc((size_t)T * ldx * sizeof(float));
    float *y = malloc((size_t)T * ldy * sizeof(float)), *y0 = malloc((size_t)T * ldy * sizeof(float));
    /* scratch_floats 0: x in place (as MLA attention calls it; the buffer
     * still holds the in-place panel); one tile of room; all T tokens */
    const size_t scratch[3] = {0, kern__gemm_scratch_floats(in, 1),
                               kern__gemm_scratch_floats(in, T)};
    const size_t panel = (size_t)KERN_PANEL_ROWS * in;
    float *P = malloc((scratch[2] > panel ? scratch[2] : panel) * sizeof(float));
    cr_assert(w && x && y && y0 && P);
    for (int i = 0; i < ldw * (in + 10); i++) w[i] = unit(&seed);
    for (int i = 0; i < T * ldx; i++) x[i] = unit(&seed);
    for (int sc = 0; sc < 3; sc++) {
        for (int cm = 0; cm < 2; cm++) {
            for (int acc = 0; acc < 2; acc++) {
                for (int i = 0; i < T * ldy; i++) y0[i] = y[i] = unit(&seed);
                const kern_gemm_w gw = {KERN_F32, w, ldw, cm != 0};
                kern__gemm(&gw, in, x, ldx, T, y, ldy, 2, rows, acc != 0, P, scratch[sc]);
                for (int t = 0; t < T; t++)
                    for (int r = 0; r < ldy; r++) {
                        float want = y0[(size_t)t * ldy + r];
                        if (r >= 2 && r < rows) {
                            float a = acc ? want : 0.0f;
                            for (int c = 0; c < in; c++) {
                                float wv = cm ? w[(size_t)c * ldw + r] : w[(size_t)r * ldw + c];
                                a = fmaf(wv, x[(size_t)t * ldx + c], a);
                            }
                            want = a;
                        }
                        float got = y[(size_t)t * ldy + r];
                        cr_assert(memcmp(&got, &want, sizeof got) == 0,
                                  "in %d scratch %zu cols_major %d accumulate %d: y[%d, %d] = %a, "
                                  "want %a",
                                  in, scratch[sc], cm, acc, t, r, got, want);
                    }
            }
        }
    }
    free(w);
    free(x);
    free(y);
    free(y0);
    free(P);
}

/* The GEMM's other forms (kern_gemm.h), as MLA attention uses them: f32
 * matrices with their own leading dimension, stored as rows or transposed
 * (cols_major), x with its own stride, continuing the sums already in y.
 * Each output is the fma chain from y's old value, bit for bit, whether x
 * is read in place (scratch_floats 0), packed one tile of tokens at a time
 * (W unpacked for each) or packed whole; in one block of columns and in
 * two (1,700 columns: blocks of 864 and 836). */
Test(matmul, gemm_f32_strides_transposed_accumulate) {
    gemm_f32_case(45, 70, 13, 77, 75, 50, 4242);
    gemm_f32_case(45, 1700, 30, 1703, 1705, 47, 4343);
}
#endif

#if defined(__AVX512BF16__)
/* kern__gemm_bf16x on f32 matrices (rows and cols_major, own strides, the
 * accumulate form): every value of W and x rounded to bf16 first, then the
 * exact products summed in f32, so against a double sum of the rounded
 * values it is within f32 summation error, and it is not the f32 product.
 * 70 columns take the vdpbf16ps kernel everywhere, 96 the AMX tiles where
 * the CPU has them (MLA attention's products under bf16_act). */
static void gemm_bf16x_f32_case(int in) {
    const int rows = 45, T = 29, ldw = in + 7, ldx = in + 5, ldy = 50;
    const int wrows = in + 10; /* rows of W's storage: in for cols_major, 45 else */
    float *w = malloc((size_t)ldw * wrows * sizeof(float)), *x = malloc((size_t)T * ldx * 4);
    float *y = malloc((size_t)T * ldy * 4), *y0 = malloc((size_t)T * ldy * 4);
    const size_t scratch_floats = 64 * 1024;
    float *scratch = malloc(scratch_floats * sizeof(float));
    cr_assert(w && x && y && y0 && scratch);
    uint64_t seed = 99;
    for (int i = 0; i < ldw * wrows; i++) w[i] = unit(&seed);
    for (int i = 0; i < T * ldx; i++) x[i] = unit(&seed);
    for (int cm = 0; cm < 2; cm++)
        for (int acc = 0; acc < 2; acc++) {
            for (int i = 0; i < T * ldy; i++) y0[i] = y[i] = unit(&seed);
            const kern_gemm_w gw = {KERN_F32, w, ldw, cm != 0};
            kern__gemm_bf16x(&gw, in, x, ldx, T, y, ldy, 2, rows, acc != 0, scratch,
                             scratch_floats);
            int differ = 0;
            for (int t = 0; t < T; t++)
                for (int r = 0; r < ldy; r++) {
                    const float got = y[(size_t)t * ldy + r];
                    if (r < 2 || r >= rows) {
                        cr_assert(got == y0[(size_t)t * ldy + r], "column %d written", r);
                        continue;
                    }
                    double ref = acc ? y0[(size_t)t * ldy + r] : 0.0, mag = fabs(ref), exact = ref;
                    for (int c = 0; c < in; c++) {
                        const float wv = cm ? w[(size_t)c * ldw + r] : w[(size_t)r * ldw + c];
                        const float xv = x[(size_t)t * ldx + c];
                        const double p = (double)kern_bf16_to_f32(kern_f32_to_bf16(wv)) *
                                         kern_bf16_to_f32(kern_f32_to_bf16(xv));
                        ref += p;
                        mag += fabs(p);
                        exact += (double)wv * xv;
                    }
                    cr_assert_leq(fabs(got - ref), 1e-6 * mag + 1e-7,
                                  "in %d cols_major %d accumulate %d: y[%d, %d] = %g, rounded %g",
                                  in, cm, acc, t, r, got, ref);
                    differ += fabs(got - exact) > 1e-6 * mag;
                }
            cr_expect_gt(differ, T * (rows - 2) / 2, "in %d cols_major %d: the f32 product's values",
                         in, cm);
        }
    free(w);
    free(x);
    free(y);
    free(y0);
    free(scratch);
}

Test(matmul, gemm_bf16x_f32_matrices) {
    gemm_bf16x_f32_case(70);
    gemm_bf16x_f32_case(96);
}

/* kern__gemm_bf16x on bf16 rows, on AMX tiles where this machine has them
 * and on vdpbf16ps (kern__gemm_bf16x_on): both within f32 summation error
 * of a double sum of the rounded values, over two blocks of columns (4,096
 * + 64), a panel cut short (rows 2..45: 32 + 11), a last step of 13 tokens
 * and the accumulate form; and each token's sums the same bits alone as
 * among 45 tokens, and under another row cut. Without AMX the tile half
 * is the dot-product kernel again, and says so. */
Test(matmul, gemm_bf16x_tiles_and_dot_products) {
    const int rows = 45, in = 4160, T = 45, ldy = 48;
    float *wf = malloc((size_t)rows * in * sizeof(float)), *x = malloc((size_t)T * in * 4);
    float *y = malloc((size_t)T * ldy * 4), *y0 = malloc((size_t)T * ldy * 4);
    float *one = malloc((size_t)ldy * 4);
    const size_t scratch_floats = kern__gemm_scratch_floats(in, T) + (size_t)T * in;
    float *scratch = malloc(scratch_floats * sizeof(float));
    uint16_t *w = make_w(KERN_BF16, rows, in, wf, 31);
    cr_assert(x && y && y0 && one && scratch && w);
    uint64_t seed = 17;
    for (int i = 0; i < T * in; i++) x[i] = unit(&seed);
    if (!kern__gemm_amx())
        cr_log_info("no AMX tiles on this machine: both runs take the vdpbf16ps kernel");
    const kern_gemm_w gw = {KERN_BF16, w, in, false};
    for (int amx = 0; amx < 2; amx++)
        for (int acc = 0; acc < 2; acc++) {
            for (int i = 0; i < T * ldy; i++) y0[i] = y[i] = unit(&seed);
            kern__gemm_bf16x_on(amx, &gw, in, x, in, T, y, ldy, 2, rows, acc, scratch,
                                scratch_floats);
            for (int t = 0; t < T; t++)
                for (int r = 0; r < ldy; r++) {
                    const float got = y[(size_t)t * ldy + r];
                    if (r < 2 || r >= rows) {
                        cr_assert(got == y0[(size_t)t * ldy + r], "amx %d: column %d written", amx,
                                  r);
                        continue;
                    }
                    double ref = acc ? y0[(size_t)t * ldy + r] : 0.0, mag = fabs(ref);
                    for (int c = 0; c < in; c++) {
                        const double p = (double)wf[(size_t)r * in + c] *
                                         kern_bf16_to_f32(kern_f32_to_bf16(x[(size_t)t * in + c]));
                        ref += p;
                        mag += fabs(p);
                    }
                    cr_assert_leq(fabs(got - ref), 2e-6 * mag + 1e-7,
                                  "amx %d accumulate %d: y[%d, %d] = %.9g, rounded %.9g", amx, acc,
                                  t, r, got, ref);
                }
            if (acc) continue;
            /* token 40 alone (the 13-token step's ninth), rows cut at 20 */
            for (int r = 0; r < ldy; r++) one[r] = -1.0f;
            kern__gemm_bf16x_on(amx, &gw, in, x + (size_t)40 * in, in, 1, one, ldy, 2, 20, false,
                                scratch, scratch_floats);
            kern__gemm_bf16x_on(amx, &gw, in, x + (size_t)40 * in, in, 1, one, ldy, 20, rows,
                                false, scratch, scratch_floats);
            for (int r = 2; r < rows; r++)
                cr_assert(memcmp(&one[r], &y[(size_t)40 * ldy + r], sizeof(float)) == 0,
                          "amx %d: token 40 row %d alone %a, among 45 %a", amx, r, one[r],
                          y[(size_t)40 * ldy + r]);
        }
    free(w);
    free(wf);
    free(x);
    free(y);
    free(y0);
    free(one);
    free(scratch);
}

/* kern_matmul_w_prefill's bf16 activations: within the error of rounding x
 * to bf16 (2^-9 relative per value, so 2^-8 of sum |w x| with room for the
 * sums' own rounding), and not the exact products (the mode reached them). */
Test(matmul, prefill_bf16_activations_within_rounding) {
    const int rows = 70, in = 200, T = 30;
    float *wf = malloc((size_t)rows * in * sizeof(float)), *x = malloc((size_t)T * in * 4);
    float *y = malloc((size_t)T * rows * 4), *e = malloc((size_t)T * rows * 4);
    float *scratch = malloc(kern_matmul_scratch_floats(in) * sizeof(float));
    void *w = make_w(KERN_BF16, rows, in, wf, 99);
    uint64_t seed = 5;
    for (int i = 0; i < T * in; i++) x[i] = unit(&seed);
    const kern_weight kw = {.dt = KERN_BF16, .data = w, .scales = NULL, .rows = rows, .cols = in};
    kern_matmul_w_prefill(&kw, x, T, y, rows, 0, rows, scratch, true);
    kern_matmul_w_prefill(&kw, x, T, e, rows, 0, rows, scratch, false);
    int differ = 0;
    for (int t = 0; t < T; t++)
        for (int r = 0; r < rows; r++) {
            double ref = 0.0, mag = 0.0;
            for (int i = 0; i < in; i++) {
                ref += (double)wf[(size_t)r * in + i] * x[(size_t)t * in + i];
                mag += fabs((double)wf[(size_t)r * in + i] * x[(size_t)t * in + i]);
            }
            const float got = y[(size_t)t * rows + r];
            cr_assert_leq(fabs(got - ref), 0x1p-8 * mag + 1e-6, "y[%d, %d] = %g, reference %g", t, r,
                          got, ref);
            differ += got != e[(size_t)t * rows + r];
        }
    cr_expect_gt(differ, T * rows / 2, "only %d of %d outputs differ from the exact products", differ,
                 T * rows);
    free(w);
    free(wf);
    free(x);
    free(y);
    free(e);
    free(scratch);
}
#endif

/* kern_weight's prefetch_rows_ahead changes where lines are fetched from,
 * never a result: 2 to 9 tokens of a bf16 matrix on 64-byte lines (where
 * the rows would go in order without it), exact and under bf16_act,
 * streamed or not, give the same bits with the hint on and off. */
Test(matmul, prefetch_rows_ahead_changes_no_bits) {
    const int rows = 77, in = 2304, TM = 9;
    float *wf = malloc((size_t)rows * in * sizeof(float)), *x = malloc((size_t)TM * in * 4);
    float *ya = malloc((size_t)TM * rows * 4), *yb = malloc((size_t)TM * rows * 4);
    float *scratch = malloc(kern_matmul_scratch_floats(in) * sizeof(float));
    uint16_t *w0 = make_w(KERN_BF16, rows, in, wf, 4321);
    uint16_t *w = aligned_alloc(64, (size_t)rows * in * sizeof(uint16_t));
    cr_assert(wf && x && ya && yb && scratch && w0 && w);
    memcpy(w, w0, (size_t)rows * in * sizeof(uint16_t));
    uint64_t seed = 1234;
    for (int i = 0; i < TM * in; i++) x[i] = unit(&seed);
    for (int T = 2; T <= TM; T++)
        for (int mode = 0; mode < 4; mode++) {
            kern_weight kw = {.dt = KERN_BF16, .data = w, .rows = rows, .cols = in,
                              .streamed = mode & 1};
            float *out[2] = {ya, yb};
            for (int ahead = 0; ahead < 2; ahead++) {
                kw.prefetch_rows_ahead = ahead;
                if (mode & 2)
                    kern_matmul_w_bf16act(&kw, x, T, out[ahead], rows, 0, rows, scratch);
                else
                    kern_matmul_w(&kw, x, T, out[ahead], rows, 0, rows, scratch);
            }
            cr_assert_eq(memcmp(ya, yb, (size_t)T * rows * sizeof(float)), 0,
                         "T %d %s%s: the hint changed the results", T,
                         mode & 2 ? "bf16_act" : "exact", mode & 1 ? ", streamed" : "");
        }
    free(w);
    free(w0);
    free(wf);
    free(x);
    free(ya);
    free(yb);
    free(scratch);
}

/* A decode step's product under bf16_act (kern_matmul_w_bf16act): each
 * value is the product of x rounded to bf16 (nearest even) with the bf16
 * row, summed in f32 (checked against a double sum of the same rounded
 * values, to 1e-5 of the sum of |products|), and row t of a T-token
 * product is token t's one-token product bit for bit, whatever tokens
 * and rows share the call: 1 to 9, 17 and 33 tokens (groups of three,
 * column blocks above three; on AMX tiles one and two blocks of 32), and
 * 70 and 300 (on tiles three blocks, two runs of up to 256; else the
 * GEMM, whose sums are in another order than a lone token's, so there
 * a token's bits are those it has among other tokens of a call of 64 or
 * more, and a cut of the rows), ragged row ranges, widths on and off the
 * 512-column blocks, W off and on 64-byte lines. Without AVX-512 BF16 it
 * is kern_matmul_w, bit for bit. */
Test(matmul, bf16act_decode_rounds_x_and_keeps_each_tokens_bits) {
    const int shapes[][2] = {{77, 256}, {45, 2304}, {19, 96}, {109, 2304}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int rows = shapes[s][0], in = shapes[s][1], r0 = 3, r1 = rows - 2, TM = 300;
        float *wf = malloc((size_t)rows * in * sizeof(float));
        float *x = malloc((size_t)TM * in * sizeof(float));
        float *y = malloc((size_t)TM * rows * sizeof(float)), *y1 = malloc(rows * sizeof(float));
        float *ye = malloc((size_t)TM * rows * sizeof(float));
        float *scratch = malloc(kern_matmul_scratch_floats(in) * sizeof(float));
        uint16_t *w = make_w(KERN_BF16, rows, in, wf, 0xbf16ull + (uint64_t)s);
        cr_assert(wf && x && y && y1 && ye && scratch && w);
        uint64_t seed = 777 + s;
        for (int i = 0; i < TM * in; i++)
            x[i] = unit(&seed) * 3.0f;
        /* W as malloc gives it, and on 64-byte lines, as the engine's
         * weights lie: only there do 2 to 8 tokens read the rows in the
         * order they lie (rows8_tokens' in_order), which malloc's 16-byte
         * alignment reaches only by chance */
        const size_t wbytes = (size_t)rows * in * sizeof(uint16_t);
        uint16_t *wa = aligned_alloc(64, (wbytes + 63) / 64 * 64);
        cr_assert(wa);
        memcpy(wa, w, wbytes);
        kern_weight kw = {.dt = KERN_BF16, .data = w, .rows = rows, .cols = in};
        const int Ts[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 33, 70, 300};
        const int nTs = (int)(sizeof Ts / sizeof Ts[0]);
        for (int k = 0; k < 2 * nTs; k++) {
            const int T = Ts[k % nTs];
            kw.data = k < nTs ? (const void *)w : (const void *)wa;
            for (int i = 0; i < T * rows; i++)
                y[i] = NAN;
            kern_matmul_w_bf16act(&kw, x, T, y, rows, r0, r1, scratch);
            if (!kern_bf16_products()) {
                kern_matmul_w(&kw, x, T, ye, rows, r0, r1, scratch);
                for (int t = 0; t < T; t++)
                    cr_assert_eq(memcmp(y + (size_t)t * rows + r0, ye + (size_t)t * rows + r0,
                                        (size_t)(r1 - r0) * sizeof(float)),
                                 0, "without bf16 products: not kern_matmul_w");
                continue;
            }
            for (int t = 0; t < T; t++) {
                const float *xt = x + (size_t)t * in;
                for (int r = r0; r < r1; r++) {
                    double ref = 0, mag = 0;
                    for (int i = 0; i < in; i++) {
                        const double p = (double)kern_bf16_to_f32(kern_f32_to_bf16(xt[i])) *
                                         (double)wf[(size_t)r * in + i];
                        ref += p;
                        mag += fabs(p);
                    }
                    const float got = y[(size_t)t * rows + r];
                    cr_assert(fabs(got - ref) <= 1e-5 * mag + 1e-30,
                              "[%d, %d] T %d token %d row %d: %.9g, want %.9g (sum |p| %.3g)",
                              rows, in, T, t, r, got, ref, mag);
                }
                cr_assert(isnan(y[(size_t)t * rows + r0 - 1]) && isnan(y[(size_t)t * rows + r1]),
                          "rows outside [r0, r1) written");
                if (T >= 64 && !kern_bf16_tiles()) continue; /* the GEMM's, below */
                /* alone, and with the rows cut in two on an eight-row
                 * boundary (as the CPU backend cuts): the same bits */
                for (int r = 0; r < rows; r++)
                    y1[r] = NAN;
                kern_matmul_w_bf16act(&kw, xt, 1, y1, rows, r0, r0 + 8, scratch);
                kern_matmul_w_bf16act(&kw, xt, 1, y1, rows, r0 + 8, r1, scratch);
                cr_assert_eq(memcmp(y1 + r0, y + (size_t)t * rows + r0,
                                    (size_t)(r1 - r0) * sizeof(float)),
                             0, "[%d, %d]: token %d of %d differs from its lone product", rows,
                             in, t, T);
            }
            if (T < 64 || kern_bf16_tiles()) continue;
            /* the GEMM: tokens [1, T) as a call of their own, the rows cut
             * in two on an eight-row boundary, give each token its bits */
            for (int i = 0; i < T * rows; i++)
                ye[i] = NAN;
            kern_matmul_w_bf16act(&kw, x + in, T - 1, ye, rows, r0, r0 + 8, scratch);
            kern_matmul_w_bf16act(&kw, x + in, T - 1, ye, rows, r0 + 8, r1, scratch);
            for (int t = 1; t < T; t++)
                cr_assert_eq(memcmp(ye + (size_t)(t - 1) * rows + r0, y + (size_t)t * rows + r0,
                                    (size_t)(r1 - r0) * sizeof(float)),
                             0, "[%d, %d]: token %d of %d differs among other tokens", rows, in,
                             t, T);
        }
        free(w);
        free(wa);
        free(wf);
        free(x);
        free(y);
        free(y1);
        free(ye);
        free(scratch);
    }
}

/* kern_matmul_w_bf16act below 64 tokens on a width that is not a
 * multiple of 32 (no eight-row loop for it) and not on AMX tiles: "anything
 * else", kern_matmul_w, bit for bit, not the GEMM that takes 64 tokens and
 * more. */
Test(matmul, bf16act_ragged_width_below_64_tokens_is_kern_matmul_w) {
    if (kern_bf16_tiles()) cr_skip_test("AMX tiles take every width here");
    const int rows = 21, in = 100, T = 5;
    float *wf = malloc((size_t)rows * in * sizeof(float));
    float *x = malloc((size_t)T * in * sizeof(float));
    float *y = malloc((size_t)T * rows * sizeof(float));
    float *ye = malloc((size_t)T * rows * sizeof(float));
    float *scratch = malloc(kern_matmul_scratch_floats(in) * sizeof(float));
    cr_assert(wf && x && y && ye && scratch);
    uint16_t *w = make_w(KERN_BF16, rows, in, wf, 0x5a11ull);
    uint64_t seed = 99;
    for (int i = 0; i < T * in; i++)
        x[i] = unit(&seed) * 3.0f;
    const kern_weight kw = {.dt = KERN_BF16, .data = w, .rows = rows, .cols = in};
    kern_matmul_w_bf16act(&kw, x, T, y, rows, 0, rows, scratch);
    kern_matmul_w(&kw, x, T, ye, rows, 0, rows, scratch);
    cr_assert_eq(memcmp(y, ye, (size_t)T * rows * sizeof(float)), 0,
                 "[%d, %d], %d tokens: not kern_matmul_w", rows, in, T);
    free(w);
    free(wf);
    free(x);
    free(y);
    free(ye);
    free(scratch);
}

/* kern_weight's exact_tiles (kern__amx_rows_split where the CPU has AMX
 * tiles): every output within f32 summation error of a double sum of the
 * exact products (x not rounded: a rounding of x to bf16 would miss it by
 * far more, and the test checks that it would), and row t of a T-token
 * product is token t's one-token product bit for bit, whatever tokens
 * share the call (1 to 12, 23: one block of 10 tokens, two, three) and
 * under another row cut (rows 3..40 and 40..77 against 0..77 on the
 * tiles: ragged panels of 32; 8..40 and 40..77 on the FMA loops, whose
 * row groups of eight a cut must keep whole). Rows shorter than KERN_TILES_MIN_IN stay on the FMA
 * loops, flag or not, bit for bit. Without AMX the flag changes nothing,
 * and the test says so. */
Test(matmul, exact_tiles_keep_x_exact_and_each_tokens_bits) {
    const int rows = 77, in = 2304, TM = 23, short_in = 1024;
    float *wf = malloc((size_t)rows * in * sizeof(float)), *x = malloc((size_t)TM * in * 4);
    float *y = malloc((size_t)TM * rows * 4), *one = malloc((size_t)rows * 4);
    float *plain = malloc((size_t)TM * rows * 4);
    float *scratch = malloc(kern_matmul_scratch_floats(in) * sizeof(float));
    uint16_t *w = make_w(KERN_BF16, rows, in, wf, 777);
    cr_assert(wf && x && y && one && plain && scratch && w);
    uint64_t seed = 4242;
    for (int i = 0; i < TM * in; i++) x[i] = unit(&seed);
    const bool tiles = kern_bf16_tiles();
    if (!tiles)
        cr_log_info("no AMX tiles on this machine: exact_tiles takes the FMA loops, as checked");
    kern_weight kw = {.dt = KERN_BF16, .data = w, .rows = rows, .cols = in, .streamed = true,
                      .exact_tiles = true};
    kern_weight kp = kw;
    kp.exact_tiles = false;
    const int Ts[] = {1, 2, 3, 5, 8, 10, 11, 12, 23};

    for (size_t n = 0; n < sizeof Ts / sizeof Ts[0]; n++) {
        const int T = Ts[n];
        kern_matmul_w(&kw, x, T, y, rows, 0, rows, scratch);
        kern_matmul_w(&kp, x, T, plain, rows, 0, rows, scratch);
        int far_from_rounded = 0;
        for (int t = 0; t < T; t++) {
            /* token t alone, rows cut at 40 and starting at `first`. On
             * the tiles each row's sums are its own, so any cut; the FMA
             * loops give a row its bits on cuts at multiples of eight
             * rows (the engine's), a cut elsewhere leaving rows to the
             * single-row tail, whose sum is reduced in another order. */
            const int first = tiles ? 3 : 8;
            for (int r = 0; r < rows; r++) one[r] = -1.0f;
            kern_matmul_w(&kw, x + (size_t)t * in, 1, one, rows, first, 40, scratch);
            kern_matmul_w(&kw, x + (size_t)t * in, 1, one, rows, 40, rows, scratch);
            for (int r = 0; r < rows; r++) {
                const float got = y[(size_t)t * rows + r];
                double ref = 0.0, mag = 0.0, rounded = 0.0;
                for (int c = 0; c < in; c++) {
                    const double xv = x[(size_t)t * in + c], wv = wf[(size_t)r * in + c];
                    ref += wv * xv;
                    mag += fabs(wv * xv);
                    rounded += wv * kern_bf16_to_f32(kern_f32_to_bf16((float)xv));
                }
                cr_assert_leq(fabs(got - ref), 2e-7 * mag,
                              "T %d: y[%d, %d] = %.9g, exact %.9g", T, t, r, got, ref);
                far_from_rounded += fabs(rounded - ref) > 2e-7 * mag;

                if (r >= first)
                    cr_assert(memcmp(&one[r], &got, sizeof got) == 0,
                              "T %d: token %d row %d alone %a, among %d %a", T, t, r, one[r], T,
                              got);
                if (!tiles)
                    cr_assert(memcmp(&plain[(size_t)t * rows + r], &got, sizeof got) == 0,
                              "no tiles: the flag changed y[%d, %d]", t, r);
            }
        }
        cr_expect_gt(far_from_rounded, T * rows / 2, "T %d: bf16(x) would have passed too", T);
    }
    /* short rows keep the FMA loops whatever the flag */
    kern_weight ks = kw, ksp = kp;
    ks.cols = ksp.cols = short_in;
    kern_matmul_w(&ks, x, 8, y, rows, 0, rows, scratch);
    kern_matmul_w(&ksp, x, 8, plain, rows, 0, rows, scratch);
    cr_assert_eq(memcmp(y, plain, (size_t)8 * rows * sizeof(float)), 0,
                 "rows of %d columns left the FMA loops", short_in);
    free(w);
    free(wf);
    free(x);
    free(y);
    free(one);
    free(plain);
    free(scratch);
}
