/*
 * Kimi K3 generated models (gen-model presets k3 and k3-micro): the real
 * K3 config's sizes (reference/kimi-k3.md §3, §12: 2,779.48 B parameters,
 * ~104.2 B active, 1.560 TB), a written k3-micro that loads back as K3 with
 * MXFP4 experts whose codes and scales are the quantised values of the
 * plain model's experts (kern_quantize_row), and whose prefill and decode
 * logits agree; so do those of other layouts (MLA layers side by side or
 * first, residual blocks of 1, 3 and 4 layers).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "eng.h"
#include "eng_config.h"
#include "eng_genmodel.h"
#include "eng_model.h"
#include "eng_plan.h"
#include "test_helpers.h"
#include "test_model_util.h"

Test(k3_model, real_sizes) {
    eng_config c;
    kds_err err = {0};
    cr_assert_eq(eng_genmodel_preset("k3", &c, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(c.family, ENG_FAMILY_KIMI_K3);
    cr_expect_eq(c.num_hidden_layers, 93);
    cr_expect_eq(c.n_kda_layers, 69);
    cr_expect_eq(c.n_mla_layers, 24);
    cr_expect(c.layer_kind[91] == ENG_LAYER_MLA && c.layer_kind[92] == ENG_LAYER_MLA,
              "two MLA layers in a row at the tail");
    const eng_plan_sizes z = eng__plan_sizes(&c, KERN_BF16);
    /* the reference's figures: the text tower's 2,779.48 B parameters,
     * ~104.2 B active, 1,560,936,091,448 bytes with the vision tower */
    cr_expect_eq(z.params, (size_t)2779484478208ull, "parameters %zu", z.params);
    cr_expect(fabs((double)z.active / 104.2e9 - 1) < 0.002, "active %zu, want ~104.2 B", z.active);
    cr_expect(z.bytes > (size_t)1.55e12 && z.bytes < (size_t)1.561e12, "bytes %zu", z.bytes);
    eng_state_size s = eng_config_state_size(&c);
    cr_expect_eq(s.kda_state, (size_t)69 * 96 * 128 * 128 * 4, "414 MiB of KDA state");
    cr_expect_eq(s.per_token, (size_t)24 * 576 * 4, "the 24 MLA layers' latents per token");
}

static eng_model *load(const char *dir) {
    eng_model_params mp = eng_model_default_params();
    mp.no_fingerprint_cache = true;
    eng_model *m = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_model_load(dir, &mp, &m, &err), KDS_OK, "%s: %s", dir, err.msg);
    return m;
}

/* The generator writes MXFP4 experts as the quantised values of the
 * experts the same preset has without MXFP4 (same seed: same streams). */
Test(k3_model, generated_experts_are_quantised_plain_experts, .timeout = 60) {
    char *dq = tmu_mkdtemp(), *df = tmu_mkdtemp();
    eng_config c;
    kds_err err = {0};
    cr_assert_eq(eng_genmodel_preset("k3-micro", &c, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_genmodel_write(&c, 9, KERN_F32, dq, false, &err), KDS_OK, "%s", err.msg);
    c.experts_mxfp4 = false;
    cr_assert_eq(eng_genmodel_write(&c, 9, KERN_F32, df, false, &err), KDS_OK, "%s", err.msg);
    eng_model *mq = load(dq), *mf = load(df);
    cr_expect(eng_model_config(mq)->experts_mxfp4);
    int checked = 0;
    for (int l = 1; l < c.num_hidden_layers; l++) {
        const eng_ffn_weights *q = &mq->layers[l].ffn, *f = &mf->layers[l].ffn;
        cr_assert_eq(mq->layers[l].ffn_kind, ENG_FFN_LATENT_MOE);
        const eng_weight *pairs[3][2] = {{&q->w1[3], &f->w1[3]}, {&q->w2[0], &f->w2[0]},
                                         {&q->w3[15], &f->w3[15]}};
        for (int k = 0; k < 3; k++) {
            const eng_weight *wq = pairs[k][0], *wf = pairs[k][1];
            cr_assert_eq(wq->dt, KERN_MXFP4);
            cr_assert_eq(wf->dt, KERN_F32);
            cr_assert(wq->rows == wf->rows && wq->cols == wf->cols);
            const kern_layout lay = kern_weight_layout(KERN_MXFP4, wq->rows, wq->cols);
            unsigned char codes[512], scales[64];
            cr_assert(lay.row_bytes <= sizeof codes && lay.scale_row_bytes <= sizeof scales);
            for (int r = 0; r < wq->rows; r++) {
                kern_quantize_row(KERN_MXFP4, (const float *)wf->data + (size_t)r * wf->cols,
                                  wf->cols, codes, scales);
                cr_assert_eq(memcmp(codes, (const unsigned char *)wq->data + r * lay.row_bytes,
                                    lay.row_bytes), 0, "layer %d matrix %d row %d: codes", l, k, r);
                cr_assert_eq(memcmp(scales,
                                    (const unsigned char *)wq->scales + r * lay.scale_row_bytes,
                                    lay.scale_row_bytes), 0, "layer %d matrix %d row %d: scales",
                             l, k, r);
            }
            checked++;
        }
        /* everything else is the same bytes */
        cr_expect_eq(memcmp(mq->layers[l].ffn.latent_down.data, mf->layers[l].ffn.latent_down.data,
                            (size_t)c.latent_size * c.hidden_size * 4), 0);
    }
    cr_expect_eq(checked, 15);
    eng_model_free(mq);
    eng_model_free(mf);
    tmu_rmtree(dq);
    tmu_rmtree(df);
    free(dq);
    free(df);
}

/* Model m: the prefill (chunked KDA, batches of 16) and the token-by-token
 * decode of 37 tokens give the same logits up to summation order. */
static void expect_prefill_equals_decode(eng_model *m, const char *what) {
    kds_err err = {0};
    const int V = eng_model_config(m)->vocab_size, N = 37;
    eng_ctx_params cp = eng_ctx_default_params();
    cp.max_batch = 16;
    cp.kda_chunk = 8;
    eng_ctx *c = NULL;
    cr_assert_eq(eng_ctx_create(m, &cp, &c, &err), KDS_OK, "%s", err.msg);
    eng_seq *a = NULL, *b = NULL;
    cr_assert_eq(eng_seq_create(m, 1, &a, &err), KDS_OK);
    cr_assert_eq(eng_seq_create(m, 1, &b, &err), KDS_OK);
    int32_t ids[37];
    for (int i = 0; i < N; i++) ids[i] = (i * 131 + 7) % V;
    float *pre = malloc((size_t)N * V * sizeof(float)), *dec = malloc((size_t)N * V * sizeof(float));
    cr_assert(pre && dec);
    cr_assert_eq(eng_prefill(c, a, ids, N, pre, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    for (int t = 0; t < N; t++) {
        cr_assert_eq(eng_decode(c, b, ids[t], &err), KDS_OK, "%s", err.msg);
        memcpy(dec + (size_t)t * V, eng_seq_logits(b), (size_t)V * sizeof(float));
    }
    double ref, d = th_max_abs_diff(dec, pre, (size_t)N * V, &ref);
    cr_log_info("%s: prefill vs decode %.3g of the largest logit %.3g", what, d / ref, ref);
    cr_expect(ref > 0.1, "%s: logits are not trivially small", what);
    cr_expect_leq(d, 1e-4 * ref, "%s: prefill and decode differ by %g (largest %g)", what, d, ref);
    free(pre);
    free(dec);
    eng_seq_free(a);
    eng_seq_free(b);
    eng_ctx_free(c);
}

/* A generated K3: prefill and decode agree. */
Test(k3_model, prefill_equals_decode, .timeout = 60) {
    char *dir = NULL;
    kds_err err = {0};
    eng_model *m = tmu_gen_load("k3-micro", 4, &dir, &err);
    cr_assert(m, "%s", err.msg);
    expect_prefill_equals_decode(m, "k3-micro");
    eng_model_free(m);
    tmu_rmtree(dir);
    free(dir);
}

/* Other K3 layouts than k3-micro's (as K3 checkpoints may have): MLA
 * layers next to each other, one first, and residual blocks of other
 * sizes (1: every layer its own block; 3 and 4: blocks that end inside an
 * MLA pair or past the last layer). Each must load back with the layout it
 * was written with, and its prefill and decode agree. */
Test(k3_model, other_layouts_prefill_equals_decode, .timeout = 120) {
    const struct {
        const char *kinds; /* one letter a layer: K (KDA) or M (MLA) */
        int block;
    } layouts[] = {{"KKMMKK", 3}, {"MMKKKM", 4}, {"KMMKKK", 1}};
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        kds_err err = {0};
        eng_config c;
        cr_assert_eq(eng_genmodel_preset("k3-micro", &c, &err), KDS_OK, "%s", err.msg);
        const int L = (int)strlen(layouts[i].kinds);
        cr_assert_eq(c.num_hidden_layers, L, "k3-micro has %d layers", c.num_hidden_layers);
        c.n_kda_layers = c.n_mla_layers = 0;
        for (int l = 0; l < L; l++) {
            const bool mla = layouts[i].kinds[l] == 'M';
            c.layer_kind[l] = mla ? ENG_LAYER_MLA : ENG_LAYER_KDA;
            mla ? c.n_mla_layers++ : c.n_kda_layers++;
        }
        c.attn_res_block_size = layouts[i].block;
        char *dir = tmu_mkdtemp();
        cr_assert(dir);
        cr_assert_eq(eng_genmodel_write(&c, 11 + i, KERN_BF16, dir, false, &err), KDS_OK, "%s",
                     err.msg);
        eng_model_params mp = eng_model_default_params();
        mp.no_fingerprint_cache = true;
        eng_model *m = NULL;
        cr_assert_eq(eng_model_load(dir, &mp, &m, &err), KDS_OK, "%s: %s", layouts[i].kinds,
                     err.msg);
        const eng_config *got = eng_model_config(m);
        cr_expect_eq(got->attn_res_block_size, layouts[i].block);
        for (int l = 0; l < L; l++)
            cr_expect_eq(got->layer_kind[l], c.layer_kind[l], "%s: layer %d", layouts[i].kinds, l);
        char what[64];
        snprintf(what, sizeof what, "%s, blocks of %d", layouts[i].kinds, layouts[i].block);
        expect_prefill_equals_decode(m, what);
        eng_model_free(m);
        tmu_rmtree(dir);
        free(dir);
    }
}
