/*
 * Weights made on the GPU (kern_cuda_gen_normal) against the generated
 * model's CPU stream (kern_gen_normal, what `kdaserve gen-model` writes):
 * equal bit for bit, in f32 and bf16; block-format weights made there
 * (kern_cuda_gen_quant) against kern_quantize_row of the same stream, byte
 * for byte; and the embedding lookup (kern_cuda_embed) against a plain row
 * copy. Skips without a GPU.
 */
#include <criterion/criterion.h>

#ifdef KDS_HAVE_CUDA

#include "eng_genmodel.h"
#include "eng_model.h"
#include "test_cuda_util.h"
#include "test_model_util.h"

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

/* What a check_quant call went through: the mean scale byte (MXFP4: so
 * callers see the clamped cases reached), and how many values fell exactly
 * on a rounding midpoint (an E2M1 midpoint after the block's 2^-e, or n +
 * 1/2 for Q8_0), where only the ties-to-even rule decides the code. */
typedef struct quant_seen {
    double mean_scale;
    size_t ties;
} quant_seen;

static size_t count_ties(kern_dtype dt, const float *row, int cols, const unsigned char *scales) {
    static const float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    size_t ties = 0;
    for (int c = 0; c < cols; c++) {
        const int b = c / KERN_BLOCK;
        if (dt == KERN_MXFP4) {
            const float a = fabsf(row[c] * ldexpf(1.0f, -((int)scales[b] - 127)));
            for (int k = 0; k < 7; k++) ties += a == mid[k];
        } else {
            uint16_t h;
            memcpy(&h, scales + 2 * b, 2);
            const float q = row[c] / kern_f16_to_f32(h);
            ties += fabsf(q) < 127.0f && q - floorf(q) == 0.5f;
        }
    }
    return ties;
}

/* kern_cuda_gen_quant's codes and scales of a [rows, cols] weight against
 * kern_quantize_row of kern_gen_normal's row values, byte for byte; `skew`
 * offsets both device pointers from their allocation (1: unaligned codes,
 * the byte-store path). */
static quant_seen check_quant(kern_dtype dt, int rows, int cols, uint64_t key, float sd, int skew) {
    tcu_require_device();
    const kern_layout l = kern_weight_layout(dt, rows, cols);
    cr_assert(l.row_bytes > 0, "no layout for [%d, %d]", rows, cols);
    unsigned char *dev_c = tcu_dev_alloc(l.data_bytes + 16);
    unsigned char *dev_s = tcu_dev_alloc(l.scale_bytes + 16);
    kds_err err = {0};
    cr_assert_eq(kern_cuda_gen_quant(dev_c + skew, dev_s + skew, dt, rows, cols, key, sd, NULL, &err),
                 KDS_OK, "%s", err.msg);
    cr_assert_eq(kern_cuda_sync(NULL, &err), KDS_OK, "%s", err.msg);
    unsigned char *got_c = tcu_malloc(l.data_bytes), *got_s = tcu_malloc(l.scale_bytes);
    tcu_d2h(got_c, dev_c + skew, l.data_bytes);
    tcu_d2h(got_s, dev_s + skew, l.scale_bytes);
    unsigned char *want_c = tcu_malloc(l.data_bytes), *want_s = tcu_malloc(l.scale_bytes);
    float *row = tcu_malloc((size_t)cols * sizeof(float));
    quant_seen seen = {0.0, 0};
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < cols; c++)
            row[c] = kern_gen_normal(key, (uint64_t)r * (uint64_t)cols + (uint64_t)c, sd);
        kern_quantize_row(dt, row, cols, want_c + (size_t)r * l.row_bytes,
                          want_s + (size_t)r * l.scale_row_bytes);
        seen.ties += count_ties(dt, row, cols, want_s + (size_t)r * l.scale_row_bytes);
    }
    size_t bad_c = 0, bad_s = 0, first_c = 0, first_s = 0;
    for (size_t i = 0; i < l.data_bytes; i++)
        if (got_c[i] != want_c[i] && bad_c++ == 0) first_c = i;
    for (size_t i = 0; i < l.scale_bytes; i++)
        if (got_s[i] != want_s[i] && bad_s++ == 0) first_s = i;
    cr_expect_eq(bad_c, 0,
                 "%s [%d, %d] sd %g: %zu of %zu code bytes differ (first: byte %zu, row %zu: "
                 "0x%02x, want 0x%02x)",
                 kern_dtype_name(dt), rows, cols, (double)sd, bad_c, l.data_bytes, first_c,
                 first_c / l.row_bytes, got_c[first_c], want_c[first_c]);
    cr_expect_eq(bad_s, 0,
                 "%s [%d, %d] sd %g: %zu of %zu scale bytes differ (first: byte %zu: 0x%02x, "
                 "want 0x%02x)",
                 kern_dtype_name(dt), rows, cols, (double)sd, bad_s, l.scale_bytes, first_s,
                 got_s[first_s], want_s[first_s]);
    for (size_t i = 0; i < l.scale_bytes; i++) seen.mean_scale += want_s[i];
    seen.mean_scale /= (double)(l.scale_bytes ? l.scale_bytes : 1);
    kern_cuda_free(dev_c);
    kern_cuda_free(dev_s);
    free(got_c);
    free(got_s);
    free(want_c);
    free(want_s);
    free(row);
    return seen;
}

/* K3's expert widths divided down (7168 = 224 blocks, 3584 = 112, 3072 =
 * 96), single rows of the full width, one block, and sds of a real
 * initialisation (1/sqrt(fan_in)), the embedding's 1 and a negative one
 * (the signs flip, -0.0 appears); then 3.1M values of an sd chosen so that
 * some land exactly on a midpoint, so the tie rule is tested too (an
 * element takes one of 2^18 values for a given sd: most sds have no value
 * on a midpoint at all). */
Test(cuda_gen, quant_mxfp4_matches_cpu, .timeout = 300) {
    size_t ties = 0;
    ties += check_quant(KERN_MXFP4, 96, 224, 0x1234abcdull, 0.0118f, 0).ties; /* [3072, 7168] / 32 */
    ties += check_quant(KERN_MXFP4, 7, 3584, 0xfeedfacecafebeefull, 0.0167f, 0).ties;
    ties += check_quant(KERN_MXFP4, 3, 7168, 42, 1.0f, 0).ties;
    ties += check_quant(KERN_MXFP4, 1, 32, 7, 0.02f, 0).ties;
    ties += check_quant(KERN_MXFP4, 37, 96, 0xdeadbeefull, -0.5f, 0).ties;
    ties += check_quant(KERN_MXFP4, 5, 160, 99, 0.0302f, 1).ties; /* unaligned: byte stores */
    ties += check_quant(KERN_MXFP4, 0, 64, 1, 1.0f, 0).ties;      /* nothing to write */
    /* 0.0221...: an sd one of whose 2^18 possible values is 1.75 * 2^-6,
     * which the blocks' 2^-e take to 3.5 or 1.75 (about 30 times here) */
    ties += check_quant(KERN_MXFP4, 1536, 2048, 0x5eedull, 0x1.6a1622p-6f, 0).ties;
    cr_log_info("cuda_gen mxfp4: %zu values exactly on an E2M1 midpoint", ties);
    cr_expect_gt(ties, 0, "no value fell on a midpoint: the tie rule went untested");
}

/* E8M0's edges: an all-zero weight (e = -127, every code +0), values so
 * small the exponent clamps at -127 (the multiplier 2^127, values and
 * products subnormal), values near f32's top and beyond it. */
Test(cuda_gen, quant_mxfp4_extremes) {
    cr_expect_eq(check_quant(KERN_MXFP4, 4, 64, 3, 0.0f, 0).mean_scale, 0.0, "all-zero: scale 0");
    const double tiny = check_quant(KERN_MXFP4, 4, 64, 5, 1e-38f, 0).mean_scale;
    cr_expect(tiny < 1.0, "sd 1e-38: mean scale byte %g, expected the clamp at 0", tiny);
    check_quant(KERN_MXFP4, 4, 64, 6, 3e-39f, 0); /* subnormal values */
    const double big = check_quant(KERN_MXFP4, 4, 64, 8, 5e37f, 0).mean_scale;
    cr_expect(big > 240.0, "sd 5e37: mean scale byte %g", big);
    /* values that overflow to inf (a non-finite amax: e = -127, the codes
     * saturate at 6) and NaN (fmaxf skips it; its code is +6) */
    check_quant(KERN_MXFP4, 4, 64, 9, 3e38f, 0);
    check_quant(KERN_MXFP4, 2, 32, 10, NAN, 0);
}

Test(cuda_gen, quant_q8_0_matches_cpu, .timeout = 300) {
    size_t ties = 0;
    ties += check_quant(KERN_Q8_0, 48, 224, 0x1234abcdull, 0.0118f, 0).ties;
    ties += check_quant(KERN_Q8_0, 2, 3584, 11, 1.0f, 0).ties;
    ties += check_quant(KERN_Q8_0, 9, 96, 0xdeadbeefull, -0.25f, 0).ties;
    ties += check_quant(KERN_Q8_0, 3, 64, 12, 0.0f, 0).ties;   /* all-zero: scale 1.0 (f16 0x3c00) */
    ties += check_quant(KERN_Q8_0, 5, 128, 13, 0.05f, 1).ties; /* unaligned, odd scale pointer */
    ties += check_quant(KERN_Q8_0, 2048, 2048, 0x5eedull, 0.0312f, 0).ties; /* ~2 ties per M */
    cr_log_info("cuda_gen q8_0: %zu values exactly on n + 1/2", ties);
    cr_expect_gt(ties, 0, "no value fell on a midpoint: the tie rule went untested");
}

Test(cuda_gen, quant_refuses) {
    tcu_require_device();
    void *d = tcu_dev_alloc(256);
    kds_err err = {0};
    cr_expect_eq(kern_cuda_gen_quant(d, d, KERN_BF16, 2, 32, 1, 1.0f, NULL, &err), KDS_INVALID_ARG);
    cr_expect_eq(kern_cuda_gen_quant(d, d, KERN_MXFP4, 2, 48, 1, 1.0f, NULL, &err), KDS_INVALID_ARG,
                 "cols not a multiple of 32");
    cr_expect(strstr(err.msg, "multiple of 32") != NULL, "message: %s", err.msg);
    cr_expect_eq(kern_cuda_gen_quant(d, d, KERN_MXFP4, -1, 32, 1, 1.0f, NULL, &err), KDS_INVALID_ARG);
    cr_expect_eq(kern_cuda_gen_quant(NULL, d, KERN_Q8_0, 2, 32, 1, 1.0f, NULL, &err), KDS_INVALID_ARG);
    cr_expect_eq(kern_cuda_gen_quant(NULL, NULL, KERN_MXFP4, 0, 32, 1, 1.0f, NULL, &err), KDS_OK,
                 "an empty weight is nothing to do");
    kern_cuda_free(d);
}

/* Kimi K3's experts without files: k3-micro from eng_model_generate (its
 * routed experts bound as MXFP4 with no bytes, only their streams), made on
 * the device by kern_cuda_gen_quant as the CUDA backend makes them
 * (eng_cuda.c gen_block_weight: each MoE layer's codes in one arena
 * [E][w1 | w3 | w2], its scales in another), equal byte for byte the
 * NAME_packed and NAME_scale tensors of the directory gen-model writes. */
Test(cuda_gen, k3_micro_experts_made_on_the_device_equal_the_file, .timeout = 600) {
    tcu_require_device();
    kds_err err = {0};
    char *dir = NULL;
    eng_model *file = tmu_gen_load("k3-micro", 5, &dir, &err);
    cr_assert(file, "%s", err.msg);
    eng_config cfg;
    cr_assert_eq(eng_genmodel_preset("k3-micro", &cfg, &err), KDS_OK, "%s", err.msg);
    eng_model *gen = NULL;
    cr_assert_eq(eng_model_generate(&cfg, 5, "k3-micro", &gen, &err), KDS_OK, "%s", err.msg);
    const int E = cfg.num_experts;
    int layers = 0;
    for (int l = 0; l < cfg.num_hidden_layers; l++) {
        const eng_ffn_weights *gf = &gen->layers[l].ffn, *ff = &file->layers[l].ffn;
        if (gen->layers[l].ffn_kind != ENG_FFN_LATENT_MOE) continue;
        /* the first and the last MoE layer */
        if (gf->bank != 0 && gf->bank != gen->n_moe - 1) continue;
        const eng_weight *gw[3] = {&gf->w1[0], &gf->w3[0], &gf->w2[0]};
        kern_layout lay[3];
        size_t cstride = 0, sstride = 0;
        for (int k = 0; k < 3; k++) {
            cr_assert_eq(gw[k]->dt, KERN_MXFP4, "layer %d: %s", l, kern_dtype_name(gw[k]->dt));
            lay[k] = kern_weight_layout(gw[k]->dt, gw[k]->rows, gw[k]->cols);
            cstride += lay[k].data_bytes;
            sstride += lay[k].scale_bytes;
        }
        unsigned char *dc = tcu_dev_alloc((size_t)E * cstride), *ds = tcu_dev_alloc((size_t)E * sstride);
        for (int e = 0; e < E; e++) {
            const eng_weight *w[3] = {&gf->w1[e], &gf->w3[e], &gf->w2[e]};
            size_t co = (size_t)e * cstride, so = (size_t)e * sstride;
            for (int k = 0; k < 3; k++) {
                cr_assert(!w[k]->data && !w[k]->scales, "layer %d expert %d: host bytes", l, e);
                cr_assert_eq(kern_cuda_gen_quant(dc + co, ds + so, w[k]->dt, w[k]->rows,
                                                 w[k]->cols, w[k]->gen_key, w[k]->gen_sd, NULL,
                                                 &err),
                             KDS_OK, "%s", err.msg);
                co += lay[k].data_bytes;
                so += lay[k].scale_bytes;
            }
        }
        cr_assert_eq(kern_cuda_sync(NULL, &err), KDS_OK, "%s", err.msg);
        unsigned char *hc = tcu_malloc((size_t)E * cstride), *hs = tcu_malloc((size_t)E * sstride);
        tcu_d2h(hc, dc, (size_t)E * cstride);
        tcu_d2h(hs, ds, (size_t)E * sstride);
        for (int e = 0; e < E; e++) {
            const eng_weight *w[3] = {&ff->w1[e], &ff->w3[e], &ff->w2[e]};
            static const char *const name[3] = {"w1", "w3", "w2"};
            size_t co = (size_t)e * cstride, so = (size_t)e * sstride;
            for (int k = 0; k < 3; k++) {
                cr_assert_eq(w[k]->dt, KERN_MXFP4);
                cr_expect_eq(memcmp(hc + co, w[k]->data, lay[k].data_bytes), 0,
                             "layer %d expert %d %s: codes differ from the file", l, e, name[k]);
                cr_expect_eq(memcmp(hs + so, w[k]->scales, lay[k].scale_bytes), 0,
                             "layer %d expert %d %s: scales differ from the file", l, e, name[k]);
                co += lay[k].data_bytes;
                so += lay[k].scale_bytes;
            }
        }
        kern_cuda_free(dc);
        kern_cuda_free(ds);
        free(hc);
        free(hs);
        layers++;
    }
    cr_expect_eq(layers, 2, "MoE layers checked");
    eng_model_free(gen);
    eng_model_free(file);
    tmu_rmtree(dir);
    free(dir);
}

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
