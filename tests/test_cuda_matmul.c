/*
 * kern_cuda_matmul (the whole-model GPU pass's projections) against the CPU
 * kern_matmul: bf16 and f32 weights, partial tiles in every direction,
 * strided x and y, and the accumulate form. Skips without a GPU.
 */
#include <criterion/criterion.h>

#ifdef KDS_HAVE_CUDA

#include "test_cuda_util.h"

/* rows, cols, T: none a multiple of the 16-wide tiles except where noted */
static void check(kern_dtype dt, int rows, int cols, int T, bool accumulate) {
    tcu_require_device();
    uint64_t s = 0x5eedu + (uint64_t)rows * 131 + (uint64_t)cols * 7 + (uint64_t)T;
    const int ldx = cols + 3, ldy = rows + 5;
    float *wf = tcu_malloc((size_t)rows * cols * sizeof(float));
    tcu_fill(&s, wf, (size_t)rows * cols, -1.0f, 1.0f);
    uint16_t *wb = tcu_malloc((size_t)rows * cols * sizeof(uint16_t));
    for (size_t i = 0; i < (size_t)rows * cols; i++) wb[i] = kern_f32_to_bf16(wf[i]);
    const void *w = dt == KERN_BF16 ? (const void *)wb : (const void *)wf;
    const size_t wbytes = (size_t)rows * cols * kern_dtype_size(dt);
    float *x = tcu_malloc((size_t)T * ldx * sizeof(float));
    tcu_fill(&s, x, (size_t)T * ldx, -2.0f, 2.0f);
    float *y0 = tcu_malloc((size_t)T * ldy * sizeof(float));
    tcu_fill(&s, y0, (size_t)T * ldy, -1.0f, 1.0f);
    /* CPU reference: kern_matmul writes [T, ldy] columns [0, rows) */
    float *ref = tcu_malloc((size_t)T * ldy * sizeof(float));
    memcpy(ref, y0, (size_t)T * ldy * sizeof(float));
    float *prod = tcu_malloc((size_t)T * ldy * sizeof(float));
    memcpy(prod, y0, (size_t)T * ldy * sizeof(float));
    float *xc = tcu_malloc((size_t)T * cols * sizeof(float)); /* kern_matmul wants ldx == cols */
    for (int t = 0; t < T; t++) memcpy(xc + (size_t)t * cols, x + (size_t)t * ldx, (size_t)cols * 4);
    kern_matmul(dt, w, cols, xc, T, prod, ldy, 0, rows, NULL);
    for (int t = 0; t < T; t++)
        for (int r = 0; r < rows; r++) {
            size_t i = (size_t)t * ldy + r;
            ref[i] = accumulate ? y0[i] + prod[i] : prod[i];
        }
    void *dw = tcu_dev_alloc(wbytes);
    float *dx = tcu_dev_alloc((size_t)T * ldx * sizeof(float));
    float *dy = tcu_dev_alloc((size_t)T * ldy * sizeof(float));
    tcu_h2d(dw, w, wbytes);
    tcu_h2d(dx, x, (size_t)T * ldx * sizeof(float));
    tcu_h2d(dy, y0, (size_t)T * ldy * sizeof(float));
    kds_err err = {0};
    kern_cuda_matmul_args a = {.W = dw, .w_dtype = dt, .rows = rows, .cols = cols, .x = dx,
                               .ldx = ldx, .T = T, .y = dy, .ldy = ldy, .accumulate = accumulate};
    cr_assert_eq(kern_cuda_matmul(&a, NULL, &err), KDS_OK, "%s", err.msg);
    float *got = tcu_malloc((size_t)T * ldy * sizeof(float));
    tcu_d2h(got, dy, (size_t)T * ldy * sizeof(float));
    double big = 0, worst = 0;
    for (size_t i = 0; i < (size_t)T * ldy; i++) {
        if (fabs(ref[i]) > big) big = fabs(ref[i]);
        double e = fabs((double)got[i] - ref[i]);
        if (e > worst || isnan(e)) worst = isnan(e) ? INFINITY : e;
    }
    cr_expect_leq(worst, 1e-5 * (big > 1 ? big : 1),
                  "%s rows=%d cols=%d T=%d acc=%d: max error %g (largest %g)",
                  dt == KERN_BF16 ? "bf16" : "f32", rows, cols, T, (int)accumulate, worst, big);
    /* the padding columns [rows, ldy) are untouched */
    for (int t = 0; t < T; t++)
        for (int r = rows; r < ldy; r++)
            cr_assert_eq(got[(size_t)t * ldy + r], y0[(size_t)t * ldy + r],
                         "column %d of row %d (beyond rows) was written", r, t);
    kern_cuda_free(dw);
    kern_cuda_free(dx);
    kern_cuda_free(dy);
    free(wf), free(wb), free(x), free(y0), free(ref), free(prod), free(xc), free(got);
}

Test(cuda_matmul, bf16_matches_cpu) {
    check(KERN_BF16, 37, 50, 1, false);
    check(KERN_BF16, 37, 50, 19, false);
    check(KERN_BF16, 64, 32, 16, true);
}

Test(cuda_matmul, f32_matches_cpu) {
    check(KERN_F32, 21, 70, 3, false);
    check(KERN_F32, 21, 70, 33, true);
}

Test(cuda_matmul, bad_arguments_refused) {
    tcu_require_device();
    kds_err err = {0};
    float *d = tcu_dev_alloc(1024);
    kern_cuda_matmul_args a = {.W = d, .w_dtype = KERN_F16, .rows = 4, .cols = 4, .x = d,
                               .ldx = 4, .T = 1, .y = d + 64, .ldy = 4};
    cr_expect_eq(kern_cuda_matmul(&a, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "dtype"), "message: %s", err.msg);
    a.w_dtype = KERN_BF16;
    a.ldx = 3;
    cr_expect_eq(kern_cuda_matmul(&a, NULL, &err), KDS_INVALID_ARG);
    kern_cuda_free(d);
}

#else

Test(cuda_matmul, skipped_without_cuda) {
    cr_skip_test("built without CUDA (KDS_HAVE_CUDA unset)");
}

#endif
