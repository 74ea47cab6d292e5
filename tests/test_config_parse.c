/*
 * config.json: parsing every Kimi-Linear field, HF's defaults, the layer
 * table, the refusals (each with its status and the field in the message),
 * the complete serialisation and its round trip, and the tensor/parameter
 * counts of the real 48B config (kda-model-spec.md §1-2).
 */
#include <cJSON.h>
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng_config.h"
#include "eng_genmodel.h"
#include "test_model_util.h"

/* The real Kimi-Linear-48B-A3B-Instruct config.json (spec §1). */
static const char CFG_48B[] =
    "{\"architectures\": [\"KimiLinearForCausalLM\"],"
    " \"auto_map\": {\"AutoConfig\": \"configuration_kimi.KimiLinearConfig\","
    "   \"AutoModel\": \"modeling_kimi.KimiLinearModel\","
    "   \"AutoModelForCausalLM\": \"modeling_kimi.KimiLinearForCausalLM\"},"
    " \"model_type\": \"kimi_linear\", \"vocab_size\": 163840, \"hidden_size\": 2304,"
    " \"num_hidden_layers\": 27, \"num_attention_heads\": 32, \"num_key_value_heads\": 32,"
    " \"head_dim\": 72, \"intermediate_size\": 9216, \"hidden_act\": \"silu\","
    " \"rms_norm_eps\": 1e-05, \"rope_theta\": 10000.0, \"rope_scaling\": null,"
    " \"mla_use_nope\": true, \"q_lora_rank\": null, \"kv_lora_rank\": 512,"
    " \"qk_nope_head_dim\": 128, \"qk_rope_head_dim\": 64, \"v_head_dim\": 128,"
    " \"linear_attn_config\": {\"kda_layers\": [1,2,3,5,6,7,9,10,11,13,14,15,17,18,19,21,22,23,"
    "25,26], \"full_attn_layers\": [4,8,12,16,20,24,27], \"num_heads\": 32, \"head_dim\": 128,"
    " \"short_conv_kernel_size\": 4},"
    " \"num_experts\": 256, \"num_experts_per_token\": 8, \"num_shared_experts\": 1,"
    " \"moe_intermediate_size\": 1024, \"first_k_dense_replace\": 1, \"moe_layer_freq\": 1,"
    " \"moe_router_activation_func\": \"sigmoid\", \"moe_renormalize\": true,"
    " \"routed_scaling_factor\": 2.446, \"use_grouped_topk\": true, \"num_expert_group\": 1,"
    " \"topk_group\": 1, \"num_nextn_predict_layers\": 0, \"tie_word_embeddings\": false,"
    " \"dtype\": \"bfloat16\", \"model_max_length\": 1048576, \"bos_token_id\": 163584,"
    " \"eos_token_id\": 163586, \"pad_token_id\": 163839, \"initializer_range\": 0.02,"
    " \"use_cache\": true}";

static eng_config parse_ok(const char *text) {
    eng_config c;
    kds_err err = {0};
    kds_status rc = eng_config_parse(text, strlen(text), "test.json", &c, &err);
    cr_assert_eq(rc, KDS_OK, "%s", err.msg);
    return c;
}

/* Parse the micro-hybrid golden config after setting `path` (dotted, one
 * level of nesting) to `value` (JSON text; NULL deletes the field). */
static kds_status parse_edited(const char *path, const char *value, eng_config *c, kds_err *err) {
    char *text = tmu_read(TMU_MICRO_HYBRID "/config.json", NULL);
    cr_assert(text);
    cJSON *root = cJSON_Parse(text);
    free(text);
    cr_assert(root);
    cJSON *obj = root;
    char key[128];
    snprintf(key, sizeof key, "%s", path);
    char *dot = strchr(key, '.');
    const char *leaf = key;
    if (dot) {
        *dot = '\0';
        obj = cJSON_GetObjectItemCaseSensitive(root, key);
        cr_assert(obj, "no object %s", key);
        leaf = dot + 1;
    }
    cJSON_DeleteItemFromObjectCaseSensitive(obj, leaf);
    if (value) {
        cJSON *v = cJSON_Parse(value);
        cr_assert(v, "bad test value %s", value);
        cJSON_AddItemToObject(obj, leaf, v);
    }
    char *out = cJSON_Print(root);
    cJSON_Delete(root);
    kds_status rc = eng_config_parse(out, strlen(out), "edited.json", c, err);
    free(out);
    return rc;
}

/* Expect a refusal with `status` and `needle` in the message. */
static void refused(const char *path, const char *value, kds_status status, const char *needle) {
    eng_config c;
    kds_err err = {0};
    kds_status rc = parse_edited(path, value, &c, &err);
    cr_assert_eq(rc, status, "%s=%s: got %s (%s), want %s", path, value ? value : "(deleted)",
                 kds_status_str(rc), err.msg, kds_status_str(status));
    cr_assert_eq(err.status, status);
    cr_assert(strstr(err.msg, needle), "%s=%s: message '%s' lacks '%s'", path,
              value ? value : "(deleted)", err.msg, needle);
    cr_assert(strstr(err.msg, "edited.json"), "message '%s' does not name the file", err.msg);
}

Test(config, golden_micro_kda) {
    eng_config c;
    kds_err err = {0};
    cr_assert_eq(eng_config_load(TMU_MICRO_KDA "/config.json", &c, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(c.vocab_size, 384);
    cr_assert_eq(c.hidden_size, 96);
    cr_assert_eq(c.num_hidden_layers, 3);
    cr_assert_eq(c.n_kda_layers, 3);
    cr_assert_eq(c.n_mla_layers, 0);
    cr_assert_eq(c.kda_num_heads, 3);
    cr_assert_eq(c.kda_num_v_heads, 3);
    cr_assert_eq(c.kda_head_dim, 32);
    cr_assert_eq(c.kda_v_head_dim, 32);
    cr_assert_eq(c.short_conv_kernel_size, 4);
    cr_assert(!c.has_gate_lower_bound);
    cr_assert_eq(c.num_experts, 6);
    cr_assert_eq(c.num_experts_per_token, 3);
    cr_assert_eq(c.num_shared_experts, 1);
    cr_assert_eq(c.moe_intermediate_size, 48);
    cr_assert_eq(c.intermediate_size, 192);
    cr_assert(!c.layer_is_moe[0] && c.layer_is_moe[1] && c.layer_is_moe[2]);
    cr_assert_eq(c.rms_norm_eps, 1e-5f);
    cr_assert_eq(c.routed_scaling_factor, 2.446f);
    cr_assert(c.moe_renormalize && c.use_grouped_topk && !c.tie_word_embeddings);
    cr_assert_eq(c.bos_token_id, 1);
    cr_assert_eq(c.eos_token_id, 1);
    cr_assert_eq(c.pad_token_id, -1);
    cr_assert_eq(c.model_max_length, 1048576);
    cr_assert_str_eq(c.torch_dtype, "float32");
    cr_assert_str_eq(c.moe_router_activation_func, "sigmoid");
}

Test(config, golden_micro_hybrid) {
    eng_config c;
    kds_err err = {0};
    cr_assert_eq(eng_config_load(TMU_MICRO_HYBRID "/config.json", &c, &err), KDS_OK, "%s", err.msg);
    eng_layer_kind want[4] = {ENG_LAYER_KDA, ENG_LAYER_KDA, ENG_LAYER_MLA, ENG_LAYER_KDA};
    for (int l = 0; l < 4; l++)
        cr_assert_eq(c.layer_kind[l], want[l], "layer %d", l);
    cr_assert_eq(c.n_kda_layers, 3);
    cr_assert_eq(c.n_mla_layers, 1);
    cr_assert_eq(c.num_attention_heads, 4);
    cr_assert_eq(c.kv_lora_rank, 32);
    cr_assert_eq(c.q_lora_rank, 0);
    cr_assert_eq(c.qk_nope_head_dim, 16);
    cr_assert_eq(c.qk_rope_head_dim, 8);
    cr_assert_eq(c.v_head_dim, 16);
    cr_assert(c.mla_use_nope);
    cr_assert_eq(c.num_experts, 8);
    cr_assert_eq(c.num_experts_per_token, 2);
}

Test(config, real_48b_counts) {
    eng_config c = parse_ok(CFG_48B);
    cr_assert_eq(c.n_kda_layers, 20);
    cr_assert_eq(c.n_mla_layers, 7);
    int mla[] = {3, 7, 11, 15, 19, 23, 26};
    for (int i = 0; i < 7; i++)
        cr_assert_eq(c.layer_kind[mla[i]], ENG_LAYER_MLA);
    cr_assert_eq(c.layer_kind[24], ENG_LAYER_KDA);
    cr_assert(!c.layer_is_moe[0]);
    for (int l = 1; l < 27; l++)
        cr_assert(c.layer_is_moe[l], "layer %d", l);
    cr_assert_eq(c.head_dim, 72);
    cr_assert_str_eq(c.torch_dtype, "bfloat16"); /* from "dtype" */
    cr_assert_eq(eng_config_tensor_count(&c), (size_t)20493);
    cr_assert_eq(eng_config_param_count(&c), (size_t)49122681728ull);
}

Test(config, preset_48b_is_the_real_config) {
    eng_config real = parse_ok(CFG_48B), p;
    kds_err err = {0};
    cr_assert_eq(eng_genmodel_preset("kimi-linear-48b", &p, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(memcmp(&real, &p, sizeof p), 0, "preset differs from the real config");
}

Test(config, hf_defaults) {
    /* only what the math needs; everything else from configuration_kimi.py */
    eng_config c = parse_ok("{\"vocab_size\": 300, \"hidden_size\": 64, \"num_hidden_layers\": 2,"
                            " \"intermediate_size\": 128, \"linear_attn_config\": {"
                            "\"kda_layers\": [1, 2], \"full_attn_layers\": [],"
                            " \"num_heads\": 2, \"head_dim\": 32}}");
    cr_assert_eq(c.rms_norm_eps, 1e-6f);
    cr_assert(c.moe_renormalize);
    cr_assert_eq(c.routed_scaling_factor, 1.0f);
    cr_assert(!c.mla_use_nope);
    cr_assert_eq(c.num_shared_experts, 0);
    cr_assert_eq(c.first_k_dense_replace, 0);
    cr_assert_eq(c.moe_layer_freq, 1);
    cr_assert_eq(c.num_experts, 0);
    cr_assert(!c.layer_is_moe[0] && !c.layer_is_moe[1]);
    cr_assert_eq(c.short_conv_kernel_size, 4);
    cr_assert_eq(c.kda_num_v_heads, 2);
    cr_assert_eq(c.num_attention_heads, 32);
    cr_assert_eq(c.num_key_value_heads, 32);
    cr_assert_eq(c.bos_token_id, -1);
    cr_assert_eq(c.eos_token_id, -1);
    cr_assert_eq(c.torch_dtype[0], '\0');
    cr_assert_str_eq(c.moe_router_activation_func, "sigmoid");
}

Test(config, moe_layer_rule) {
    eng_config c;
    kds_err err = {0};
    cr_assert_eq(parse_edited("moe_layer_freq", "2", &c, &err), KDS_OK, "%s", err.msg);
    /* first_k_dense_replace 1, freq 2: MoE iff l >= 1 and l even */
    cr_assert(!c.layer_is_moe[0] && !c.layer_is_moe[1] && c.layer_is_moe[2] && !c.layer_is_moe[3]);
    cr_assert_eq(parse_edited("num_experts", "null", &c, &err), KDS_OK, "%s", err.msg);
    for (int l = 0; l < 4; l++)
        cr_assert(!c.layer_is_moe[l]);
}

Test(config, optional_kda_fields) {
    eng_config c;
    kds_err err = {0};
    cr_assert_eq(parse_edited("linear_attn_config.num_v_heads", "8", &c, &err), KDS_OK, "%s",
                 err.msg);
    cr_assert_eq(c.kda_num_heads, 4);
    cr_assert_eq(c.kda_num_v_heads, 8);
    cr_assert_eq(parse_edited("linear_attn_config.gate_lower_bound", "-5.0", &c, &err), KDS_OK,
                 "%s", err.msg);
    cr_assert(c.has_gate_lower_bound);
    cr_assert_eq(c.gate_lower_bound, -5.0f);
    cr_assert_eq(parse_edited("q_lora_rank", "24", &c, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(c.q_lora_rank, 24);
    cr_assert_eq(parse_edited("eos_token_id", "[7, 9]", &c, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(c.eos_token_id, 7);
}

Test(config, refusals) {
    refused("vocab_size", "\"many\"", KDS_BAD_FORMAT, "vocab_size");
    refused("vocab_size", NULL, KDS_BAD_FORMAT, "vocab_size");
    refused("hidden_size", "64.5", KDS_BAD_FORMAT, "hidden_size");
    refused("hidden_size", "0", KDS_INVALID_ARG, "hidden_size");
    refused("tie_word_embeddings", "1", KDS_BAD_FORMAT, "tie_word_embeddings");
    refused("rms_norm_eps", "\"x\"", KDS_BAD_FORMAT, "rms_norm_eps");
    refused("rms_norm_eps", "0", KDS_INVALID_ARG, "rms_norm_eps");
    refused("linear_attn_config", "[]", KDS_BAD_FORMAT, "linear_attn_config");
    refused("linear_attn_config", NULL, KDS_BAD_FORMAT, "linear_attn_config");
    refused("linear_attn_config.kda_layers", "[1, 2]", KDS_INVALID_ARG, "layer 4");
    refused("linear_attn_config.kda_layers", "[1, 2, 3, 4]", KDS_INVALID_ARG, "layer 3");
    refused("linear_attn_config.kda_layers", "[1, 2, 4, 5]", KDS_INVALID_ARG, "outside");
    refused("linear_attn_config.kda_layers", "[1, 2, 4, 4]", KDS_INVALID_ARG, "twice");
    refused("linear_attn_config.kda_layers", "[1, \"2\", 4]", KDS_BAD_FORMAT, "kda_layers");
    refused("linear_attn_config.num_heads", "0", KDS_INVALID_ARG, "num_heads");
    refused("linear_attn_config.num_v_heads", "6", KDS_INVALID_ARG, "num_v_heads");
    refused("linear_attn_config.gate_lower_bound", "1.0", KDS_INVALID_ARG, "gate_lower_bound");
    refused("num_nextn_predict_layers", "1", KDS_UNSUPPORTED, "num_nextn_predict_layers");
    refused("num_hidden_layers", "300", KDS_INVALID_ARG, "num_hidden_layers");
    refused("num_experts_per_token", "9", KDS_INVALID_ARG, "num_experts_per_token");
    refused("num_experts_per_token", NULL, KDS_BAD_FORMAT, "num_experts_per_token");
    refused("num_expert_group", "3", KDS_INVALID_ARG, "num_expert_group");
    refused("topk_group", "2", KDS_INVALID_ARG, "topk_group");
    refused("moe_intermediate_size", "-4", KDS_INVALID_ARG, "moe_intermediate_size");
    refused("moe_router_activation_func", "\"softmax\"", KDS_UNSUPPORTED,
            "moe_router_activation_func");
    refused("mla_use_nope", "false", KDS_UNSUPPORTED, "mla_use_nope");
    refused("kv_lora_rank", "null", KDS_BAD_FORMAT, "kv_lora_rank");
    refused("q_lora_rank", "-1", KDS_INVALID_ARG, "q_lora_rank");
    refused("v_head_dim", "0", KDS_INVALID_ARG, "v_head_dim");
    refused("model_type", "\"deepseek_v3\"", KDS_UNSUPPORTED, "model_type");
    refused("hidden_act", "\"gelu\"", KDS_UNSUPPORTED, "hidden_act");
    refused("bos_token_id", "512", KDS_INVALID_ARG, "bos_token_id");
    refused("torch_dtype", "\"a-very-long-dtype-name\"", KDS_BAD_FORMAT, "torch_dtype");
    refused("hidden_size", "1e300", KDS_BAD_FORMAT, "hidden_size");
    refused("hidden_size", "1000000000", KDS_INVALID_ARG, "hidden_size");
}

Test(config, bad_json_and_files) {
    eng_config c;
    kds_err err = {0};
    const char *bad = "{\"vocab_size\": 12,";
    cr_assert_eq(eng_config_parse(bad, strlen(bad), "broken.json", &c, &err), KDS_BAD_FORMAT);
    cr_assert(strstr(err.msg, "broken.json") && strstr(err.msg, "JSON"), "%s", err.msg);
    cr_assert_eq(eng_config_parse("[1, 2]", 6, "list.json", &c, &err), KDS_BAD_FORMAT);
    cr_assert(strstr(err.msg, "list.json"), "%s", err.msg);
    cr_assert_eq(eng_config_load("/nonexistent/kds/config.json", &c, &err), KDS_NOT_FOUND);
    cr_assert(strstr(err.msg, "/nonexistent/kds/config.json"), "%s", err.msg);
    /* length-limited parse: text past len is not read */
    const char *text = "{\"vocab_size\": 1}garbage";
    cr_assert_eq(eng_config_parse(text, 4, "short.json", &c, &err), KDS_BAD_FORMAT);
}

/* parse(to_json(c)) == c, byte for byte. */
static void round_trip(const eng_config *c, const char *what) {
    char *json = eng_config_to_json(c);
    cr_assert(json, "%s: to_json failed", what);
    eng_config back;
    kds_err err = {0};
    cr_assert_eq(eng_config_parse(json, strlen(json), what, &back, &err), KDS_OK, "%s: %s", what,
                 err.msg);
    cr_assert_eq(memcmp(c, &back, sizeof back), 0, "%s: round trip differs:\n%s", what, json);
    free(json);
}

Test(config, round_trip) {
    eng_config c;
    kds_err err = {0};
    for (const char *const *p = eng_genmodel_preset_names(); *p; p++) {
        cr_assert_eq(eng_genmodel_preset(*p, &c, &err), KDS_OK, "%s: %s", *p, err.msg);
        round_trip(&c, *p);
    }
    cr_assert_eq(eng_config_load(TMU_MICRO_KDA "/config.json", &c, &err), KDS_OK);
    round_trip(&c, "micro-kda");
    cr_assert_eq(eng_config_load(TMU_MICRO_HYBRID "/config.json", &c, &err), KDS_OK);
    round_trip(&c, "micro-hybrid");
    round_trip((c = parse_ok(CFG_48B), &c), "48b");
    const char *edits[][2] = {{"linear_attn_config.num_v_heads", "8"},
                              {"linear_attn_config.gate_lower_bound", "-3.5"},
                              {"q_lora_rank", "24"},
                              {"tie_word_embeddings", "true"},
                              {"rms_norm_eps", "3.3e-7"},
                              {"num_experts", "null"},
                              {"bos_token_id", "null"},
                              /* 0 is a valid rope width with MLA layers:
                               * written as 0, not null */
                              {"qk_rope_head_dim", "0"}};
    for (size_t i = 0; i < sizeof edits / sizeof edits[0]; i++) {
        cr_assert_eq(parse_edited(edits[i][0], edits[i][1], &c, &err), KDS_OK, "%s", err.msg);
        round_trip(&c, edits[i][0]);
    }
}

Test(config, to_json_is_a_complete_kimi_config) {
    eng_config c = parse_ok(CFG_48B);
    char *json = eng_config_to_json(&c);
    cJSON *o = cJSON_Parse(json);
    cr_assert(o, "%s", json);
    /* every field of the real config, with the real values */
    cJSON *real = cJSON_Parse(CFG_48B);
    for (cJSON *it = real->child; it; it = it->next) {
        cJSON *mine = cJSON_GetObjectItemCaseSensitive(o, it->string);
        cr_assert(mine, "field '%s' missing from:\n%s", it->string, json);
        cr_assert(cJSON_Compare(it, mine, true), "field '%s' differs", it->string);
    }
    cr_assert_str_eq(cJSON_GetObjectItem(o, "torch_dtype")->valuestring, "bfloat16");
    cJSON *lac = cJSON_GetObjectItem(o, "linear_attn_config");
    cr_assert_null(cJSON_GetObjectItem(lac, "num_v_heads"));
    cr_assert_null(cJSON_GetObjectItem(lac, "gate_lower_bound"));
    cJSON_Delete(real);
    cJSON_Delete(o);
    free(json);

    /* optional fields are written only when set */
    kds_err err = {0};
    cr_assert_eq(parse_edited("linear_attn_config.num_v_heads", "8", &c, &err), KDS_OK);
    c.has_gate_lower_bound = true;
    c.gate_lower_bound = -5.0f;
    json = eng_config_to_json(&c);
    o = cJSON_Parse(json);
    lac = cJSON_GetObjectItem(o, "linear_attn_config");
    cr_assert_eq(cJSON_GetObjectItem(lac, "num_v_heads")->valueint, 8);
    cr_assert_eq(cJSON_GetObjectItem(lac, "gate_lower_bound")->valuedouble, -5.0);
    cJSON_Delete(o);
    free(json);
}

Test(config, q_lora_counts) {
    eng_config c, q;
    kds_err err = {0};
    cr_assert_eq(parse_edited("q_lora_rank", NULL, &c, &err), KDS_OK);
    cr_assert_eq(parse_edited("q_lora_rank", "24", &q, &err), KDS_OK);
    /* q_proj [4*24, 64] -> q_a [24, 64] + q_a_layernorm [24] + q_b [96, 24] */
    cr_assert_eq(eng_config_tensor_count(&q), eng_config_tensor_count(&c) + 2);
    cr_assert_eq(eng_config_param_count(&q),
                 eng_config_param_count(&c) - 96 * 64 + 24 * 64 + 24 + 96 * 24);
}
