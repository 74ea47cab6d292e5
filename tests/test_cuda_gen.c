/*
 * Weights made on the GPU (kern_cuda_gen_normal) against the generated
 * model's CPU stream (kern_gen_normal, what `kdaserve gen-model` writes):
 * equal bit for bit, in f32 and bf16; and the embedding lookup
 * (kern_cuda_embed) against a plain row copy. Skips without a GPU.
 */
#include <criterion/criterion.h>

#ifdef KDS_HAVE_CUDA

#include "test_cuda_util.h"

static void check_gen(kern_dtype dt, size_t n, uint64_t key, float sd) {
    tcu_require_device();
    const size_t esz = kern_dtype_size(dt);
    void *dev = tcu_dev_alloc(n * esz);
    kds_err err = {0};
    cr_assert_eq(kern_cuda_gen_normal(dev, dt, n, key, sd, NULL, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(kern_cuda_sync(NULL, &err), KDS_OK, "%s", err.msg);
    unsigned char *got = tcu_malloc(n * esz);
    tcu_d2h(got, dev, n * esz);
    size_t bad = 0, first = 0;
    double sum2 = 0.0;
    for (size_t i = 0; i < n; i++) {
        float v = kern_gen_normal(key, i, sd);
        sum2 += (double)v * v;
        int same = dt == KERN_BF16 ? ((uint16_t *)got)[i] == kern_f32_to_bf16(v)
                                   : memcmp((float *)got + i, &v, 4) == 0;
        if (!same && bad++ == 0) first = i;
    }
    cr_expect_eq(bad, 0, "%zu of %zu elements differ from the CPU stream (first at %zu)", bad, n,
                 first);
    /* and the stream is what it claims: standard deviation ~sd */
    double rms = sqrt(sum2 / (double)n);
    cr_expect(fabs(rms / sd - 1.0) < 0.05, "rms %g for sd %g", rms, (double)sd);
    kern_cuda_free(dev);
    free(got);
}

Test(cuda_gen, normal_f32_matches_cpu) { check_gen(KERN_F32, 40000, 0x1234abcdull, 0.02f); }
Test(cuda_gen, normal_bf16_matches_cpu) { check_gen(KERN_BF16, 65537, 0xfeedfacecafebeefull, 1.0f); }

static void check_embed(kern_dtype dt) {
    tcu_require_device();
    const int vocab = 37, hidden = 300, T = 6;
    const int32_t ids[6] = {0, 36, 5, 5, -1, 37}; /* the last two are out of range */
    uint64_t s = 99;
    float *tf = tcu_malloc((size_t)vocab * hidden * sizeof(float));
    tcu_fill(&s, tf, (size_t)vocab * hidden, -3.0f, 3.0f);
    uint16_t *tb = tcu_malloc((size_t)vocab * hidden * sizeof(uint16_t));
    for (size_t i = 0; i < (size_t)vocab * hidden; i++) tb[i] = kern_f32_to_bf16(tf[i]);
    const size_t tbytes = (size_t)vocab * hidden * kern_dtype_size(dt);
    void *dt_tab = tcu_dev_alloc(tbytes);
    tcu_h2d(dt_tab, dt == KERN_BF16 ? (void *)tb : (void *)tf, tbytes);
    int32_t *dids = tcu_dev_alloc(sizeof ids);
    tcu_h2d(dids, ids, sizeof ids);
    float *dx = tcu_dev_alloc((size_t)T * hidden * sizeof(float));
    kds_err err = {0};
    cr_assert_eq(kern_cuda_embed(dt_tab, dt, vocab, hidden, dids, T, dx, NULL, &err), KDS_OK, "%s",
                 err.msg);
    cr_assert_eq(kern_cuda_sync(NULL, &err), KDS_OK, "%s", err.msg);
    float *x = tcu_malloc((size_t)T * hidden * sizeof(float));
    tcu_d2h(x, dx, (size_t)T * hidden * sizeof(float));
    for (int t = 0; t < T; t++)
        for (int c = 0; c < hidden; c++) {
            float want = 0.0f;
            if (ids[t] >= 0 && ids[t] < vocab) {
                size_t i = (size_t)ids[t] * hidden + c;
                want = dt == KERN_BF16 ? kern_bf16_to_f32(tb[i]) : tf[i];
            }
            cr_assert_eq(x[(size_t)t * hidden + c], want, "row %d (id %d) column %d: %g, want %g", t,
                         ids[t], c, x[(size_t)t * hidden + c], want);
        }
    cr_expect_eq(kern_cuda_embed(dt_tab, KERN_F16, vocab, hidden, dids, T, dx, NULL, &err),
                 KDS_INVALID_ARG);
    kern_cuda_free(dt_tab);
    kern_cuda_free(dids);
    kern_cuda_free(dx);
    free(tf);
    free(tb);
    free(x);
}

Test(cuda_gen, embed_bf16) { check_embed(KERN_BF16); }
Test(cuda_gen, embed_f32) { check_embed(KERN_F32); }

/* Rows back to their slots: dst[idx[i]] = src[i]; a negative index skips
 * its row; rows of dst nobody names stay as they were. */
Test(cuda_gen, rows_scatter) {
    tcu_require_device();
    const int n = 3, slots = 5, cols = 12; /* 48-byte rows */
    const int32_t idx[3] = {4, -1, 1};
    float src[3][12], dst[5][12], want[5][12];
    for (int i = 0; i < n; i++)
        for (int c = 0; c < cols; c++) src[i][c] = (float)(100 * i + c);
    for (int r = 0; r < slots; r++)
        for (int c = 0; c < cols; c++) dst[r][c] = want[r][c] = -1.0f - (float)r;
    memcpy(want[4], src[0], sizeof want[4]);
    memcpy(want[1], src[2], sizeof want[1]);
    void *ds = tcu_dev_alloc(sizeof src), *dd = tcu_dev_alloc(sizeof dst);
    int32_t *di = tcu_dev_alloc(sizeof idx);
    tcu_h2d(ds, src, sizeof src);
    tcu_h2d(dd, dst, sizeof dst);
    tcu_h2d(di, idx, sizeof idx);
    kds_err err = {0};
    cr_assert_eq(kern_cuda_rows_scatter(ds, sizeof src[0], di, n, dd, NULL, &err), KDS_OK, "%s",
                 err.msg);
    cr_assert_eq(kern_cuda_sync(NULL, &err), KDS_OK, "%s", err.msg);
    tcu_d2h(dst, dd, sizeof dst);
    cr_expect_eq(memcmp(dst, want, sizeof dst), 0, "scattered rows differ");
    cr_expect_eq(kern_cuda_rows_scatter(ds, 20, di, n, dd, NULL, &err), KDS_INVALID_ARG);
    kern_cuda_free(ds);
    kern_cuda_free(dd);
    kern_cuda_free(di);
}

#else

Test(cuda_gen, skipped) { cr_skip_test("built without CUDA"); }

#endif
