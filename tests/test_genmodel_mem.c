/*
 * eng_model_generate: the generated model without files, for the GPU. Its
 * small vectors must equal the written model's bit for bit, and every
 * matrix's (key, sd) must make, through kern_gen_normal (what
 * kern_cuda_gen_normal computes on the device), exactly the bf16 bytes
 * `gen-model` writes. Checked on the CPU against a written "tiny" and
 * "tiny-hybrid"; and a CPU context refuses the model with a message. With
 * MXFP4 experts (k3-micro) every routed expert is bound as the written
 * directory's NAME_packed + NAME_scale pair, without bytes, and its (key,
 * sd) through kern_quantize_row (what kern_cuda_gen_quant computes) gives
 * the file's codes and scales byte for byte.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "eng.h"
#include "eng_genmodel.h"
#include "eng_model.h"
#include "test_model_util.h"

/* every element of w's generated values, rounded to bf16, against the file */
static size_t matrix_mismatches(const eng_weight *gen, const eng_weight *file, const char *what) {
    cr_assert_null(gen->data, "%s: a generated matrix has host bytes", what);
    cr_assert_eq(file->dt, KERN_BF16, "%s: the written model is not bf16", what);
    cr_assert_eq(gen->rows, file->rows, "%s: rows", what);
    cr_assert_eq(gen->cols, file->cols, "%s: cols", what);
    const uint16_t *want = file->data;
    size_t n = (size_t)gen->rows * gen->cols, bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += kern_f32_to_bf16(kern_gen_normal(gen->gen_key, i, gen->gen_sd)) != want[i];
    return bad;
}

static void expect_same_vector(const float *a, const float *b, size_t n, const char *what) {
    cr_assert(a && b, "%s: missing", what);
    cr_expect_eq(memcmp(a, b, n * sizeof(float)), 0, "%s: values differ", what);
}

static void check_preset(const char *preset) {
    kds_err err = {0};
    char *dir = NULL;
    eng_model *file = tmu_gen_load(preset, 11, &dir, &err);
    cr_assert(file, "%s", err.msg);
    eng_config cfg;
    cr_assert_eq(eng_genmodel_preset(preset, &cfg, &err), KDS_OK, "%s", err.msg);
    eng_model *gen = NULL;
    cr_assert_eq(eng_model_generate(&cfg, 11, preset, &gen, &err), KDS_OK, "%s", err.msg);
    cr_expect(gen->generated);
    cr_expect(strstr(eng_model_dir(gen), preset) != NULL, "dir '%s'", eng_model_dir(gen));
    const eng_config *c = &gen->cfg;
    const int D = c->hidden_size;
    size_t bad = matrix_mismatches(&gen->embed_tokens, &file->embed_tokens, "embed_tokens");
    bad += matrix_mismatches(&gen->lm_head, &file->lm_head, "lm_head");
    expect_same_vector(gen->final_norm, file->final_norm, (size_t)D, "model.norm");
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const eng_layer_weights *g = &gen->layers[l], *f = &file->layers[l];
        expect_same_vector(g->input_layernorm, f->input_layernorm, (size_t)D, "input_layernorm");
        if (g->kind == ENG_LAYER_KDA) {
            const int HV = c->kda_num_v_heads, K = c->kda_head_dim;
            bad += matrix_mismatches(&g->kda.q_proj, &f->kda.q_proj, "q_proj");
            bad += matrix_mismatches(&g->kda.o_proj, &f->kda.o_proj, "o_proj");
            bad += matrix_mismatches(&g->kda.f_b_proj, &f->kda.f_b_proj, "f_b_proj");
            expect_same_vector(g->kda.A_log, f->kda.A_log, (size_t)HV, "A_log");
            expect_same_vector(g->kda.dt_bias, f->kda.dt_bias, (size_t)HV * K, "dt_bias");
            expect_same_vector(g->kda.q_conv, f->kda.q_conv,
                               (size_t)c->kda_num_heads * K * c->short_conv_kernel_size, "q_conv");
        } else {
            bad += matrix_mismatches(&g->mla.kv_b_proj, &f->mla.kv_b_proj, "kv_b_proj");
            expect_same_vector(g->mla.kv_a_layernorm, f->mla.kv_a_layernorm,
                               (size_t)c->kv_lora_rank, "kv_a_layernorm");
        }
        if (g->ffn_kind == ENG_FFN_MOE) {
            int last = c->num_experts - 1;
            bad += matrix_mismatches(&g->ffn.router, &f->ffn.router, "router");
            bad += matrix_mismatches(&g->ffn.w1[last], &f->ffn.w1[last], "w1 of the last expert");
            bad += matrix_mismatches(&g->ffn.w2[0], &f->ffn.w2[0], "w2 of expert 0");
            expect_same_vector(g->ffn.router_bias, f->ffn.router_bias, (size_t)c->num_experts,
                               "router bias");
        } else {
            bad += matrix_mismatches(&g->ffn.down_proj, &f->ffn.down_proj, "down_proj");
        }
    }
    cr_expect_eq(bad, 0, "%s: %zu matrix elements differ from the written model", preset, bad);
    /* only a GPU context can run it */
    eng_ctx *ctx = NULL;
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cr_expect_eq(eng_ctx_create(gen, &cp, &ctx, &err), KDS_UNSUPPORTED);
    cr_expect_null(ctx);
    cr_expect(strstr(err.msg, "GPU") != NULL, "message: '%s'", err.msg);
    /* a different seed is a different model */
    eng_model *other = NULL;
    cr_assert_eq(eng_model_generate(&cfg, 12, preset, &other, &err), KDS_OK, "%s", err.msg);
    cr_expect_str_neq(eng_model_fingerprint(other), eng_model_fingerprint(gen));
    cr_expect_neq(other->layers[0].kda.q_proj.gen_key, gen->layers[0].kda.q_proj.gen_key);
    eng_model_free(other);
    eng_model_free(gen);
    eng_model_free(file);
    tmu_rmtree(dir);
    free(dir);
}

Test(genmodel_mem, tiny_equals_the_written_model) { check_preset("tiny"); }
Test(genmodel_mem, tiny_hybrid_equals_the_written_model) { check_preset("tiny-hybrid"); }

/* A generated block-format weight, quantised on the CPU as the device
 * quantises it (kern_gen_normal rows through kern_quantize_row), against
 * the written pair's bytes; the number of differing bytes. */
static size_t block_mismatches(const eng_weight *gen, const eng_weight *file, const char *what) {
    cr_assert_null(gen->data, "%s: a generated block weight has host codes", what);
    cr_assert_null(gen->scales, "%s: a generated block weight has host scales", what);
    cr_assert_eq(file->dt, KERN_MXFP4, "%s: the written expert is %s", what,
                 kern_dtype_name(file->dt));
    cr_assert_eq(gen->dt, file->dt, "%s: generated as %s", what, kern_dtype_name(gen->dt));
    cr_assert(gen->rows == file->rows && gen->cols == file->cols, "%s: [%d, %d] vs [%d, %d]", what,
              gen->rows, gen->cols, file->rows, file->cols);
    const kern_layout l = kern_weight_layout(gen->dt, gen->rows, gen->cols);
    float *row = malloc((size_t)gen->cols * sizeof *row);
    unsigned char *codes = malloc(l.row_bytes), *scales = malloc(l.scale_row_bytes);
    cr_assert(row && codes && scales);
    size_t bad = 0;
    for (int r = 0; r < gen->rows; r++) {
        for (int c = 0; c < gen->cols; c++)
            row[c] = kern_gen_normal(gen->gen_key, (size_t)r * gen->cols + c, gen->gen_sd);
        kern_quantize_row(gen->dt, row, gen->cols, codes, scales);
        const unsigned char *fc = (const unsigned char *)file->data + (size_t)r * l.row_bytes;
        const unsigned char *fs = (const unsigned char *)file->scales + (size_t)r * l.scale_row_bytes;
        for (size_t i = 0; i < l.row_bytes; i++) bad += codes[i] != fc[i];
        for (size_t i = 0; i < l.scale_row_bytes; i++) bad += scales[i] != fs[i];
    }
    free(row);
    free(codes);
    free(scales);
    return bad;
}

/* Kimi K3's MXFP4 routed experts: generated without files they are the
 * written model's, and the rest as for tiny. */
Test(genmodel_mem, k3_micro_mxfp4_experts_equal_the_written_model, .timeout = 120) {
    kds_err err = {0};
    char *dir = NULL;
    eng_model *file = tmu_gen_load("k3-micro", 11, &dir, &err);
    cr_assert(file, "%s", err.msg);
    eng_config cfg;
    cr_assert_eq(eng_genmodel_preset("k3-micro", &cfg, &err), KDS_OK, "%s", err.msg);
    cr_assert(cfg.experts_mxfp4);
    eng_model *gen = NULL;
    cr_assert_eq(eng_model_generate(&cfg, 11, "k3-micro", &gen, &err), KDS_OK, "%s", err.msg);
    cr_expect(gen->generated);
    cr_expect(gen->cfg.experts_mxfp4, "the generated config lost quantization_config");
    const eng_config *c = &gen->cfg;
    size_t bad = matrix_mismatches(&gen->embed_tokens, &file->embed_tokens, "embed_tokens");
    int experts = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const eng_layer_weights *g = &gen->layers[l], *f = &file->layers[l];
        cr_assert_eq(g->ffn_kind, f->ffn_kind);
        expect_same_vector(g->input_layernorm, f->input_layernorm, (size_t)c->hidden_size,
                           "input_layernorm");
        if (g->ffn_kind != ENG_FFN_LATENT_MOE) continue;
        bad += matrix_mismatches(&g->ffn.router, &f->ffn.router, "router");
        bad += matrix_mismatches(&g->ffn.latent_down, &f->ffn.latent_down, "latent_down");
        bad += matrix_mismatches(&g->ffn.sh_up, &f->ffn.sh_up, "shared up");
        /* every expert of the first MoE layer, a few of the others */
        for (int e = 0; e < c->num_experts; e++) {
            if (g->ffn.bank > 0 && e % 5 != 0) continue;
            char what[64];
            snprintf(what, sizeof what, "layer %d expert %d w1", l, e);
            bad += block_mismatches(&g->ffn.w1[e], &f->ffn.w1[e], what);
            snprintf(what, sizeof what, "layer %d expert %d w3", l, e);
            bad += block_mismatches(&g->ffn.w3[e], &f->ffn.w3[e], what);
            snprintf(what, sizeof what, "layer %d expert %d w2", l, e);
            bad += block_mismatches(&g->ffn.w2[e], &f->ffn.w2[e], what);
            experts++;
            /* the three matrices of one expert are three streams */
            cr_expect(g->ffn.w1[e].gen_key != g->ffn.w3[e].gen_key &&
                      g->ffn.w1[e].gen_key != g->ffn.w2[e].gen_key);
        }
    }
    cr_expect_gt(experts, c->num_experts, "checked %d experts", experts);
    cr_expect_eq(bad, 0, "k3-micro: %zu elements or bytes differ from the written model", bad);
    /* as many matrices as the loaded directory binds (a pair is one) */
    cr_expect_eq(gen->n_weights, file->n_weights);
    /* only a GPU context can run it */
    eng_ctx *ctx = NULL;
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cr_expect_eq(eng_ctx_create(gen, &cp, &ctx, &err), KDS_UNSUPPORTED);
    cr_expect_null(ctx);
    cr_expect(strstr(err.msg, "GPU") != NULL, "message: '%s'", err.msg);
    /* the config JSON (its quantization_config) is in the fingerprint: the
     * same preset with bf16 experts is another model */
    eng_config plain = cfg;
    plain.experts_mxfp4 = false;
    eng_model *bf16 = NULL;
    cr_assert_eq(eng_model_generate(&plain, 11, "k3-micro", &bf16, &err), KDS_OK, "%s", err.msg);
    cr_expect(!bf16->cfg.experts_mxfp4);
    cr_expect_eq(bf16->layers[1].ffn.w1[0].dt, KERN_BF16);
    cr_expect_eq(bf16->layers[1].ffn.w1[0].gen_key, gen->layers[1].ffn.w1[0].gen_key,
                 "one stream, quantised or not");
    cr_expect_str_neq(eng_model_fingerprint(bf16), eng_model_fingerprint(gen));
    eng_model_free(bf16);
    eng_model_free(gen);
    eng_model_free(file);
    tmu_rmtree(dir);
    free(dir);
}

/* A bad config is refused like the writer refuses it. */
Test(genmodel_mem, bad_config_refused) {
    kds_err err = {0};
    eng_config cfg;
    cr_assert_eq(eng_genmodel_preset("tiny", &cfg, &err), KDS_OK, "%s", err.msg);
    cfg.hidden_size = 0;
    eng_model *m = NULL;
    cr_expect_neq(eng_model_generate(&cfg, 1, "bad", &m, &err), KDS_OK);
    cr_expect_null(m);
    cr_expect(err.msg[0] != '\0');
}
