/*
 * Random models: presets have the documented shapes and sizes; generated
 * checkpoints load for every dtype, are deterministic in the seed, have the
 * documented value ranges, and shard into an index that loads to the same
 * fingerprint as the single file.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng.h"
#include "eng_genmodel.h"
#include "eng_model.h"
#include "test_model_util.h"

static eng_config preset(const char *name) {
    eng_config c;
    kds_err err = {0};
    cr_assert_eq(eng_genmodel_preset(name, &c, &err), KDS_OK, "%s: %s", name, err.msg);
    return c;
}

static eng_model *load_ok(const char *dir) {
    eng_model_params p = eng_model_default_params();
    p.no_fingerprint_cache = true;
    eng_model *m = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_model_load(dir, &p, &m, &err), KDS_OK, "loading %s: %s", dir, err.msg);
    return m;
}

static void write_ok(const eng_config *c, uint64_t seed, kern_dtype dt, const char *dir) {
    kds_err err = {0};
    cr_assert_eq(eng_genmodel_write(c, seed, dt, dir, false, &err), KDS_OK, "%s", err.msg);
}

Test(genmodel, presets) {
    eng_config c = preset("tiny");
    cr_assert_eq(c.n_kda_layers, 4);
    cr_assert_eq(c.n_mla_layers, 0);
    cr_assert_eq(c.hidden_size, 256);
    cr_assert_eq(c.kda_num_heads, 4);
    cr_assert_eq(c.kda_head_dim, 64);
    cr_assert_eq(c.num_attention_heads, c.kda_num_heads);
    cr_assert(!c.layer_is_moe[0] && c.layer_is_moe[1] && c.layer_is_moe[3]);
    cr_assert_eq(c.num_experts, 8);
    cr_assert_eq(c.num_experts_per_token, 2);
    cr_assert_eq(c.num_shared_experts, 1);
    cr_assert_lt(eng_config_param_count(&c) * 2, (size_t)16 << 20, "tiny is not a few MB");
    cr_assert_str_eq(c.moe_router_activation_func, "sigmoid");

    c = preset("tiny-hybrid");
    eng_layer_kind hyb[4] = {ENG_LAYER_KDA, ENG_LAYER_KDA, ENG_LAYER_MLA, ENG_LAYER_KDA};
    for (int l = 0; l < 4; l++)
        cr_assert_eq(c.layer_kind[l], hyb[l]);
    cr_assert(!c.layer_is_moe[0] && c.layer_is_moe[2]);

    c = preset("llamacpp-tiny");
    eng_layer_kind lc[4] = {ENG_LAYER_KDA, ENG_LAYER_KDA, ENG_LAYER_KDA, ENG_LAYER_MLA};
    for (int l = 0; l < 4; l++)
        cr_assert_eq(c.layer_kind[l], lc[l]);
    cr_assert_eq(c.vocab_size, 50304);
    cr_assert_eq(c.hidden_size, 256);
    size_t p = eng_config_param_count(&c);
    cr_assert(p > 25000000 && p < 35000000, "llamacpp-tiny has %zu params", p);

    c = preset("kimi-linear-48b");
    cr_assert_eq(eng_config_tensor_count(&c), (size_t)20493);
    cr_assert_eq(eng_config_param_count(&c), (size_t)49122681728ull);
    cr_assert_eq(c.bos_token_id, 163584);
    cr_assert_eq(c.eos_token_id, 163586);
    cr_assert_eq(c.pad_token_id, 163839);

    c = preset("wide");
    cr_assert_eq(c.num_hidden_layers, 4);
    cr_assert_eq(c.layer_kind[3], ENG_LAYER_MLA);
    cr_assert_eq(c.hidden_size, 2304);
    cr_assert_eq(c.kda_num_heads, 32);
    cr_assert_eq(c.kda_head_dim, 128);
    cr_assert_eq(c.kv_lora_rank, 512);
    cr_assert_eq(c.num_experts, 32);
    cr_assert_eq(c.moe_intermediate_size, 1024);
    cr_assert_eq(c.vocab_size, 163840);

    c = preset("full27");
    eng_config real = preset("kimi-linear-48b");
    cr_assert_eq(c.num_experts, 16);
    cr_assert_eq(c.n_mla_layers, 7);
    cr_assert_eq(memcmp(c.layer_kind, real.layer_kind, sizeof c.layer_kind), 0);
    cr_assert_eq(memcmp(c.layer_is_moe, real.layer_is_moe, sizeof c.layer_is_moe), 0);

    kds_err err = {0};
    cr_assert_eq(eng_genmodel_preset("huge", &c, &err), KDS_NOT_FOUND);
    cr_assert(strstr(err.msg, "huge") && strstr(err.msg, "tiny-hybrid"), "%s", err.msg);
}

/* Every preset's weights bound by the loader with the stored dtype. */
static void round_trip(const char *name, kern_dtype dt) {
    char *dir = tmu_mkdtemp();
    eng_config c = preset(name);
    write_ok(&c, 42, dt, dir);
    eng_model *m = load_ok(dir);
    eng_config want = c;
    snprintf(want.torch_dtype, sizeof want.torch_dtype, "%s",
             dt == KERN_F32    ? "float32"
             : dt == KERN_BF16 ? "bfloat16"
                               : "float16");
    cr_assert_eq(memcmp(eng_model_config(m), &want, sizeof want), 0, "%s: config differs", name);
    cr_assert_eq(m->embed_tokens.dt, dt);
    cr_assert_eq(m->layers[1].ffn.w2[3].dt, dt);
    cr_assert_eq(m->n_shards, 1);
    eng_model_free(m);
    tmu_rmtree(dir);
    free(dir);
}

Test(genmodel, round_trip_all_dtypes) {
    kern_dtype dts[3] = {KERN_F32, KERN_BF16, KERN_F16};
    for (int i = 0; i < 3; i++) {
        round_trip("tiny", dts[i]);
        round_trip("tiny-hybrid", dts[i]);
    }
}

Test(genmodel, deterministic_in_the_seed) {
    char *a = tmu_mkdtemp(), *b = tmu_mkdtemp();
    eng_config c = preset("tiny-hybrid");
    write_ok(&c, 7, KERN_BF16, a);
    write_ok(&c, 7, KERN_BF16, b);
    eng_model *ma = load_ok(a), *mb = load_ok(b);
    cr_assert_str_eq(eng_model_fingerprint(ma), eng_model_fingerprint(mb));
    eng_model_free(mb);
    write_ok(&c, 8, KERN_BF16, b); /* rewrite in place with another seed */
    mb = load_ok(b);
    cr_assert_str_neq(eng_model_fingerprint(ma), eng_model_fingerprint(mb));
    eng_model_free(ma);
    eng_model_free(mb);
    tmu_rmtree(a);
    tmu_rmtree(b);
    free(a);
    free(b);
}

static void range_of(const float *x, size_t n, float lo, float hi, const char *what) {
    for (size_t i = 0; i < n; i++)
        cr_assert(x[i] >= lo && x[i] <= hi, "%s[%zu] = %g outside [%g, %g]", what, i, x[i], lo, hi);
}

/* mean and standard deviation of an F32 weight */
static void moments(const eng_weight *w, double *mean, double *sdev) {
    const float *x = w->data;
    size_t n = (size_t)w->rows * (size_t)w->cols;
    double s = 0, s2 = 0;
    for (size_t i = 0; i < n; i++) {
        s += x[i];
        s2 += (double)x[i] * x[i];
    }
    *mean = s / (double)n;
    *sdev = sqrt(s2 / (double)n - *mean * *mean);
}

Test(genmodel, value_ranges) {
    char *dir = tmu_mkdtemp();
    eng_config c = preset("tiny-hybrid");
    write_ok(&c, 1, KERN_F32, dir);
    eng_model *m = load_ok(dir);
    const eng_layer_weights *k = &m->layers[1], *a = &m->layers[2];
    range_of(k->input_layernorm, 256, 0.8f, 1.2f, "input_layernorm");
    range_of(m->final_norm, 256, 0.8f, 1.2f, "final_norm");
    range_of(k->kda.o_norm, 64, 0.8f, 1.2f, "o_norm");
    range_of(a->mla.kv_a_layernorm, 64, 0.8f, 1.2f, "kv_a_layernorm");
    range_of(k->kda.A_log, 4, 0.0f, logf(16.0f) + 1e-6f, "A_log");
    range_of(k->kda.q_conv, 256 * 4, -0.5f, 0.5f, "q_conv");
    range_of(k->kda.dt_bias, 256, -7.0f, -2.2f, "dt_bias"); /* softplus^-1 of [1e-3, 1e-1] */
    range_of(k->ffn.router_bias, 8, -0.1f, 0.1f, "router_bias");
    double mean, sdev;
    moments(&k->kda.q_proj, &mean, &sdev);
    cr_assert(fabs(mean) < 0.01 && fabs(sdev - 1.0 / 16.0) < 0.005, "q_proj mean %g sd %g", mean,
              sdev);
    moments(&m->embed_tokens, &mean, &sdev);
    cr_assert(fabs(sdev - 1.0) < 0.02, "embed sd %g", sdev);
    /* output projections carry the extra 1/sqrt(layers) */
    moments(&k->kda.o_proj, &mean, &sdev);
    cr_assert(fabs(sdev - 1.0 / 16.0 / 2.0) < 0.003, "o_proj sd %g", sdev);
    /* distinct tensors of the same shape are different draws */
    cr_assert_neq(memcmp(k->kda.q_proj.data, k->kda.k_proj.data, 256 * 256 * sizeof(float)), 0);
    eng_model_free(m);
    tmu_rmtree(dir);
    free(dir);
}

Test(genmodel, variants_q_lora_gva_tied) {
    char *dir = tmu_mkdtemp();
    eng_config c = preset("tiny-hybrid");
    c.q_lora_rank = 48;
    c.kda_num_v_heads = 8; /* GVA: 2 value heads per q/k head */
    c.tie_word_embeddings = true;
    c.has_gate_lower_bound = true;
    c.gate_lower_bound = -5.0f;
    write_ok(&c, 3, KERN_BF16, dir);
    eng_model *m = load_ok(dir);
    const eng_config *mc = eng_model_config(m);
    cr_assert_eq(mc->q_lora_rank, 48);
    cr_assert_eq(mc->kda_num_v_heads, 8);
    cr_assert(mc->has_gate_lower_bound && mc->gate_lower_bound == -5.0f);
    const eng_mla_weights *a = &m->layers[2].mla;
    cr_assert_null(a->q_proj.data);
    cr_assert_eq(a->q_a_proj.rows, 48);
    cr_assert_eq(a->q_b_proj.rows, 4 * (32 + 16));
    cr_assert_eq(a->q_b_proj.cols, 48);
    cr_assert(a->q_a_layernorm);
    const eng_kda_weights *k = &m->layers[0].kda;
    cr_assert_eq(k->v_proj.rows, 8 * 64);
    cr_assert_eq(k->b_proj.rows, 8);
    cr_assert_eq(k->f_b_proj.rows, 8 * 64);
    cr_assert_eq(k->o_proj.cols, 8 * 64);
    cr_assert_eq(m->lm_head.data, m->embed_tokens.data);
    eng_model_free(m);
    tmu_rmtree(dir);
    free(dir);
}

Test(genmodel, sharded_equals_single) {
    char *one = tmu_mkdtemp(), *many = tmu_mkdtemp();
    eng_config c = preset("tiny");
    write_ok(&c, 5, KERN_BF16, one);
    kds_err err = {0};
    cr_assert_eq(eng__genmodel_write_sharded(&c, 5, KERN_BF16, many, false, 1 << 20, &err), KDS_OK,
                 "%s", err.msg);
    char *index = tmu_path(many, "model.safetensors.index.json");
    char *single = tmu_path(many, "model.safetensors");
    size_t n = 0;
    char *text = tmu_read(index, &n);
    cr_assert(text, "no index written");
    cr_assert(strstr(text, "\"total_size\""));
    cr_assert(strstr(text, "model-00001-of-"));
    free(text);
    cr_assert_null(tmu_read(single, NULL), "a single file next to the shards");
    eng_model *m1 = load_ok(one), *mn = load_ok(many);
    cr_assert_gt(mn->n_shards, 4);
    cr_assert_str_eq(eng_model_fingerprint(m1), eng_model_fingerprint(mn));
    eng_model_free(mn);
    /* writing a single file over a sharded dir removes the stale index */
    write_ok(&c, 5, KERN_BF16, many);
    cr_assert_null(tmu_read(index, NULL), "stale index left behind");
    mn = load_ok(many);
    cr_assert_eq(mn->n_shards, 1);
    cr_assert_str_eq(eng_model_fingerprint(m1), eng_model_fingerprint(mn));
    eng_model_free(mn);
    eng_model_free(m1);
    free(index);
    free(single);
    tmu_rmtree(one);
    tmu_rmtree(many);
    free(one);
    free(many);
}

Test(genmodel, refuses_bad_configs) {
    char *dir = tmu_mkdtemp();
    eng_config c = preset("tiny");
    c.num_experts_per_token = 9;
    kds_err err = {0};
    cr_assert_eq(eng_genmodel_write(&c, 1, KERN_BF16, dir, false, &err), KDS_INVALID_ARG);
    cr_assert(strstr(err.msg, "num_experts_per_token"), "%s", err.msg);
    c = preset("tiny");
    cr_assert_eq(eng_genmodel_write(&c, 1, (kern_dtype)9, dir, false, &err), KDS_INVALID_ARG);
    cr_assert_eq(eng_genmodel_write(&c, 1, KERN_BF16, "/proc/kds-no-such/dir", false, &err),
                 KDS_IO);
    char *cfg = tmu_path(dir, "config.json");
    cr_assert_null(tmu_read(cfg, NULL), "a refused write left a config.json");
    free(cfg);
    tmu_rmtree(dir);
    free(dir);
}

Test(genmodel, describe) {
    eng_config c = preset("kimi-linear-48b");
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    eng_genmodel_describe(&c, f);
    fclose(f);
    cr_assert(strstr(buf, "20,493"), "%s", buf);
    cr_assert(strstr(buf, "49,122,681,728"), "%s", buf);
    cr_assert(strstr(buf, "bfloat16"), "%s", buf);
    cr_assert(strstr(buf, "state"), "%s", buf);
    free(buf);
}
