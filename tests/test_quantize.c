/*
 * `kdaserve quantize` (eng_model_quantize): a generated model's routed
 * experts rewritten as MXFP4 or Q8_0 pairs, bit for bit the rows'
 * kern_quantize_row, everything else copied byte for byte; the directory
 * loads back, runs, has its own fingerprint, and refuses the source's
 * sessions with a message that says so; nothing to quantise (no experts,
 * experts already in a block format) is refused naming why.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "eng.h"
#include "eng_config.h"
#include "eng_genmodel.h"
#include "eng_model.h"
#include "test_helpers.h"
#include "test_model_util.h"
#include "test_sess_util.h"

static eng_model *load(const char *dir) {
    eng_model_params mp = eng_model_default_params();
    mp.no_fingerprint_cache = true;
    eng_model *m = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_model_load(dir, &mp, &m, &err), KDS_OK, "%s: %s", dir, err.msg);
    return m;
}

static void check_format(kern_dtype fmt) {
    char *src = NULL, *out = tmu_mkdtemp();
    kds_err err = {0};
    eng_model *ms = tmu_gen_load("tiny-hybrid", 3, &src, &err);
    cr_assert(ms, "%s", err.msg);
    char fp[33];
    eng_quantize_params qp = eng_quantize_default_params();
    qp.experts = fmt;
    cr_assert_eq(eng_model_quantize(src, &qp, out, fp, &err), KDS_OK, "%s", err.msg);
    eng_model *mq = load(out);
    cr_expect_str_eq(fp, eng_model_fingerprint(mq));
    cr_expect_str_neq(fp, eng_model_fingerprint(ms), "a quantised model is another model");
    int rows_checked = 0;
    for (int l = 0; l < ms->cfg.num_hidden_layers; l++) {
        if (ms->layers[l].ffn_kind != ENG_FFN_MOE) continue;
        for (int e = 0; e < ms->cfg.num_experts; e++) {
            const eng_weight *ws[3][2] = {{&ms->layers[l].ffn.w1[e], &mq->layers[l].ffn.w1[e]},
                                          {&ms->layers[l].ffn.w2[e], &mq->layers[l].ffn.w2[e]},
                                          {&ms->layers[l].ffn.w3[e], &mq->layers[l].ffn.w3[e]}};
            for (int k = 0; k < 3; k++) {
                const eng_weight *a = ws[k][0], *b = ws[k][1];
                cr_assert_eq(b->dt, fmt, "layer %d expert %d: %s", l, e, kern_dtype_name(b->dt));
                const kern_layout lay = kern_weight_layout(fmt, a->rows, a->cols);
                float row[256];
                unsigned char codes[256], scales[16];
                const kern_weight ka = eng__kern_weight(a);
                for (int r = 0; r < a->rows; r++) {
                    kern_weight_row_f32(&ka, r, 0, a->cols, row);
                    kern_quantize_row(fmt, row, a->cols, codes, scales);
                    cr_assert_eq(memcmp(codes, (const char *)b->data + r * lay.row_bytes, lay.row_bytes),
                                 0, "layer %d expert %d matrix %d row %d", l, e, k, r);
                    cr_assert_eq(memcmp(scales, (const char *)b->scales + r * lay.scale_row_bytes,
                                        lay.scale_row_bytes), 0, "scales of row %d", r);
                    rows_checked++;
                }
            }
        }
        /* the rest is the same bytes */
        const eng_weight *a = &ms->layers[l].ffn.router, *b = &mq->layers[l].ffn.router;
        cr_expect_eq(memcmp(a->data, b->data, (size_t)a->rows * a->cols * 2), 0, "router of layer %d", l);
    }
    cr_expect_gt(rows_checked, 0);
    cr_expect_eq(memcmp(ms->embed_tokens.data, mq->embed_tokens.data,
                        (size_t)ms->cfg.vocab_size * ms->cfg.hidden_size * 2), 0);
    /* it runs, and its logits are those of a model near the source */
    eng_ctx *c = NULL;
    cr_assert_eq(eng_ctx_create(mq, NULL, &c, &err), KDS_OK, "%s", err.msg);
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(mq, 0, &s, &err), KDS_OK);
    const int32_t ids[5] = {1, 20, 300, 4, 50};
    cr_assert_eq(eng_prefill(c, s, ids, 5, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    for (int i = 0; i < ms->cfg.vocab_size; i++) cr_assert(isfinite(eng_seq_logits(s)[i]));
    eng_seq_free(s);
    eng_ctx_free(c);
    eng_model_free(mq);
    eng_model_free(ms);
    tmu_rmtree(src);
    tmu_rmtree(out);
    free(src);
    free(out);
}

Test(quantize, mxfp4_experts, .timeout = 60) { check_format(KERN_MXFP4); }
Test(quantize, q8_0_experts, .timeout = 60) { check_format(KERN_Q8_0); }

/* --dense: every other matrix the forward pass multiplies by in the asked
 * format too, row for row kern_quantize_row's; the embedding table, the
 * routers and MLA's kv_b_proj byte for byte the source's; it loads, runs near the source (Q8_0)
 * and reads fewer bytes a token. */
static void check_dense(kern_dtype experts, kern_dtype dense, double tol) {
    char *src = NULL, *out = tmu_mkdtemp();
    kds_err err = {0};
    eng_model *ms = tmu_gen_load("tiny-hybrid", 5, &src, &err);
    cr_assert(ms, "%s", err.msg);
    eng_quantize_params qp = eng_quantize_default_params();
    qp.experts = experts;
    qp.dense = true;
    qp.dense_fmt = dense;
    cr_assert_eq(eng_model_quantize(src, &qp, out, NULL, &err), KDS_OK, "%s", err.msg);
    eng_model *mq = load(out);
    cr_assert_eq(ms->n_weights, mq->n_weights);
    int dense_seen = 0;
    for (int i = 1; i < ms->n_weights; i++) {
        const eng_weight *a = ms->weights[i], *b = mq->weights[i];
        cr_assert_eq(a->rows, b->rows);
        cr_assert_eq(a->cols, b->cols);
        bool router = false, kv_b = false;
        for (int l = 0; l < ms->cfg.num_hidden_layers; l++) {
            router |= a == &ms->layers[l].ffn.router;
            kv_b |= a == &ms->layers[l].mla.kv_b_proj;
        }
        if (a == &ms->embed_tokens || router || kv_b) {
            cr_expect_eq(b->dt, a->dt, "weight %d changed format", i);
            cr_expect_eq(memcmp(a->data, b->data, (size_t)a->rows * a->cols * kern_dtype_size(a->dt)),
                         0, "weight %d changed", i);
            continue;
        }
        cr_assert(kern_dtype_is_block(b->dt), "weight %d [%d, %d] stayed %s", i, a->rows, a->cols,
                  kern_dtype_name(b->dt));
        if (b->dt != dense) continue; /* an expert: check_format's business */
        dense_seen++;
        const kern_layout lay = kern_weight_layout(dense, a->rows, a->cols);
        float *row = malloc((size_t)a->cols * sizeof *row);
        unsigned char *codes = malloc(lay.row_bytes + 64), *scales = malloc(lay.scale_row_bytes + 64);
        cr_assert(row && codes && scales);
        const kern_weight ka = eng__kern_weight(a);
        for (int r = 0; r < a->rows; r += 7) {
            kern_weight_row_f32(&ka, r, 0, a->cols, row);
            kern_quantize_row(dense, row, a->cols, codes, scales);
            cr_assert_eq(memcmp(codes, (const char *)b->data + r * lay.row_bytes, lay.row_bytes), 0,
                         "weight %d row %d", i, r);
            cr_assert_eq(memcmp(scales, (const char *)b->scales + r * lay.scale_row_bytes,
                                lay.scale_row_bytes), 0, "weight %d scales of row %d", i, r);
        }
        free(row);
        free(codes);
        free(scales);
    }
    cr_expect_gt(dense_seen, 10, "only %d matrices in the dense format", dense_seen);
    cr_expect_eq(mq->lm_head.dt, dense);
    cr_expect_lt(eng_model_decode_bytes(mq, 0).weights, 0.6 * eng_model_decode_bytes(ms, 0).weights);
    /* it runs, near the source */
    eng_ctx *cs = NULL, *cq = NULL;
    cr_assert_eq(eng_ctx_create(ms, NULL, &cs, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_ctx_create(mq, NULL, &cq, &err), KDS_OK, "%s", err.msg);
    eng_seq *a = NULL, *b = NULL;
    cr_assert_eq(eng_seq_create(ms, 0, &a, &err), KDS_OK);
    cr_assert_eq(eng_seq_create(mq, 0, &b, &err), KDS_OK);
    const int32_t ids[6] = {1, 20, 300, 4, 50, 7};
    cr_assert_eq(eng_prefill(cs, a, ids, 6, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_prefill(cq, b, ids, 6, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    double big = 0, diff = 0;
    for (int i = 0; i < ms->cfg.vocab_size; i++) {
        const float x = eng_seq_logits(a)[i], y = eng_seq_logits(b)[i];
        cr_assert(isfinite(y), "logit %d", i);
        big = fabs(x) > big ? fabs(x) : big;
        diff = fabs(x - y) > diff ? fabs(x - y) : diff;
    }
    cr_log_info("quantize --experts %s --dense %s: logits off by %g of the largest",
                kern_dtype_name(experts), kern_dtype_name(dense), diff / big);
    cr_expect_leq(diff / big, tol, "logits off by %g of the largest (limit %g)", diff / big, tol);
    eng_seq_free(a);
    eng_seq_free(b);
    eng_ctx_free(cs);
    eng_ctx_free(cq);
    eng_model_free(mq);
    eng_model_free(ms);
    tmu_rmtree(src);
    tmu_rmtree(out);
    free(src);
    free(out);
}

Test(quantize, dense_q8_0, .timeout = 60) { check_dense(KERN_Q8_0, KERN_Q8_0, 0.05); }
Test(quantize, dense_q8_0_mxfp4_experts, .timeout = 60) { check_dense(KERN_MXFP4, KERN_Q8_0, 0.3); }
Test(quantize, dense_mxfp4, .timeout = 60) { check_dense(KERN_Q8_0, KERN_MXFP4, 1.0); }

Test(quantize, refusals, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    kds_err err = {0};
    char msg0[4096];
    /* a dense model has nothing to quantise */
    eng_config c;
    cr_assert_eq(eng_genmodel_preset("tiny", &c, &err), KDS_OK);
    c.num_experts = 0;
    for (int l = 0; l < c.num_hidden_layers; l++) c.layer_is_moe[l] = false;
    char *dense = tmu_path(tmp, "dense"), *out = tmu_path(tmp, "out");
    cr_assert_eq(eng_genmodel_write(&c, 1, KERN_BF16, dense, false, &err), KDS_OK, "%s", err.msg);
    eng_quantize_params qp = eng_quantize_default_params();
    cr_expect_eq(eng_model_quantize(dense, &qp, out, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "no routed experts"), "%s", err.msg);
    /* K3's experts are MXFP4 already */
    char *k3 = tsu_gen_model(tmp, "k3", "k3-micro", 2);
    qp.experts = KERN_Q8_0;
    cr_expect_eq(eng_model_quantize(k3, &qp, out, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "mxfp4 already"), "%s", err.msg);
    qp.experts = KERN_BF16;
    cr_expect_eq(eng_model_quantize(k3, &qp, out, NULL, &err), KDS_INVALID_ARG);
    qp.experts = KERN_MXFP4;
    qp.dense = true;
    qp.dense_fmt = KERN_F16;
    cr_expect_eq(eng_model_quantize(dense, &qp, out, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "mxfp4 or q8_0"), "%s", err.msg);
    cr_expect_neq(tsu_run(msg0, sizeof msg0, NULL,
                          TSU_KDASERVE " quantize --model %s --experts mxfp4 --dense q4 --out %s 2>&1",
                          dense, out),
                  0);
    cr_expect(strstr(msg0, "--dense wants mxfp4 or q8_0"), "%s", msg0);
    /* the command refuses its own directory as the output */
    char msg[4096];
    cr_expect_neq(tsu_run(msg, sizeof msg, NULL,
                          TSU_KDASERVE " quantize --model %s --experts mxfp4 --out %s 2>&1", k3, k3),
                  0);
    cr_expect(strstr(msg, "own directory"), "%s", msg);
    free(dense);
    free(out);
    free(k3);
    tmu_rmtree(tmp);
    free(tmp);
}

/* A session of the source model does not resume on the quantised one. */
Test(quantize, source_sessions_are_refused, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *model = tsu_gen_model(tmp, "m", "tiny", 4);
    char out[4096], q[600];
    snprintf(q, sizeof q, "%s/q", tmp);
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " quantize --model %s --experts mxfp4 --out %s 2>&1", model, q),
                 0, "%s", out);
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " generate --model %s --db %s/db --session s --prompt hi "
                                      "--max-tokens 3 2>&1",
                         model, tmp),
                 0, "%s", out);
    cr_expect_neq(tsu_run(out, sizeof out, NULL,
                          TSU_KDASERVE " generate --model %s --db %s/db --session s --prompt more "
                                       "--max-tokens 3 2>&1",
                          q, tmp),
                  0, "the quantised model resumed the source's session");
    cr_expect(strstr(out, "another model"), "the refusal does not say why: %s", out);
    free(model);
    tmu_rmtree(tmp);
    free(tmp);
}
