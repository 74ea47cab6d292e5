/*
 * Kimi K3's config.json (reference/kimi-k3.md §2): the kimi_k3 wrapper with
 * the text model in text_config, the fields K3 adds (SiTU, AttnRes, latent
 * MoE, the gates, compressed-tensors MXFP4), what is refused (naming the
 * field), the layer plan it gives, and the written form: a K3 config
 * survives eng_config_to_json and parses back to the same model, the real
 * K3 config's sizes (a preset) come out as the reference derives them.
 */
#include <cJSON.h>
#include <criterion/criterion.h>
#include <string.h>

#include "eng.h"
#include "eng_config.h"
#include "eng_genmodel.h"
#include "eng_plan.h"
#include "test_helpers.h"
#include "test_model_util.h"

#define MICRO_K3 GOLDEN_ROOT "/model-k3/micro-k3/config.json"

/* micro-k3's config with `path` (dotted, from the top; "text_config.x.y")
 * set to `value` (JSON; NULL deletes it), parsed. */
static kds_status parse_edited(const char *path, const char *value, eng_config *c, kds_err *err) {
    char *text = tmu_read(MICRO_K3, NULL);
    cr_assert(text, "cannot read " MICRO_K3);
    cJSON *root = cJSON_Parse(text);
    free(text);
    cr_assert(root);
    char key[256];
    snprintf(key, sizeof key, "%s", path);
    cJSON *obj = root;
    char *leaf = key, *dot;
    while ((dot = strchr(leaf, '.'))) {
        *dot = '\0';
        obj = cJSON_GetObjectItemCaseSensitive(obj, leaf);
        cr_assert(obj, "no object %s in %s", leaf, path);
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
    kds_status rc = eng_config_parse(out, strlen(out), "k3.json", c, err);
    free(out);
    return rc;
}

static void refused(const char *path, const char *value, kds_status status, const char *needle) {
    eng_config c;
    kds_err err = {0};
    kds_status rc = parse_edited(path, value, &c, &err);
    cr_expect_eq(rc, status, "%s=%s: got %s (%s), want %s", path, value ? value : "(deleted)",
                 kds_status_str(rc), err.msg, kds_status_str(status));
    cr_expect(strstr(err.msg, needle), "%s=%s: message '%s' lacks '%s'", path,
              value ? value : "(deleted)", err.msg, needle);
    cr_expect(strstr(err.msg, "k3.json"), "message '%s' does not name the file", err.msg);
}

Test(k3_config, micro_k3_fields) {
    eng_config c;
    kds_err err = {0};
    cr_assert_eq(eng_config_load(MICRO_K3, &c, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(c.family, ENG_FAMILY_KIMI_K3);
    cr_expect(c.has_vision);
    cr_expect_eq(c.hidden_size, 64);
    cr_expect_eq(c.num_hidden_layers, 5);
    cr_expect_eq(c.hidden_act, ENG_ACT_SITU);
    cr_expect_eq(c.situ_beta, 4.0f);
    cr_expect_eq(c.situ_linear_beta, 25.0f);
    cr_expect_eq(c.attn_res_block_size, 2);
    cr_expect_eq(c.latent_size, 64);
    cr_expect(c.latent_moe_use_norm);
    cr_expect(c.use_full_rank_gate);
    cr_expect(c.mla_use_output_gate);
    cr_expect_eq(c.q_lora_rank, 32);
    cr_expect(c.has_gate_lower_bound && c.gate_lower_bound == -5.0f);
    cr_expect(c.experts_mxfp4);
    cr_expect_eq(c.mla_lora_norm_eps, 1e-6f, "K3's q_a / kv_a norms use HF's eps");
    cr_expect_eq(c.num_shared_experts, 2);
    cr_expect_eq(c.layer_kind[3], ENG_LAYER_MLA);
    cr_expect_eq(c.bos_token_id, 256);
    eng_layer_plan p;
    eng__plan_layer(&c, 0, &p);
    cr_expect(p.ffn == ENG_FFN_DENSE && p.input == ENG_INPUT_ATTN_RES);
    eng__plan_layer(&c, 4, &p);
    cr_expect(p.ffn == ENG_FFN_LATENT_MOE && p.mixer == ENG_LAYER_KDA && p.slot == 3);
}

Test(k3_config, refusals) {
    refused("text_config", NULL, KDS_BAD_FORMAT, "text_config");
    refused("text_config", "[]", KDS_BAD_FORMAT, "text_config");
    refused("text_config.model_type", "\"deepseek_v3\"", KDS_UNSUPPORTED, "model_type");
    refused("text_config.hidden_act", "\"gelu\"", KDS_UNSUPPORTED, "hidden_act");
    refused("text_config.activation_situ_beta", "0", KDS_INVALID_ARG, "activation_situ_beta");
    refused("text_config.activation_situ_linear_beta", "-2", KDS_INVALID_ARG, "finite");
    refused("text_config.attn_res_block_size", "-1", KDS_INVALID_ARG, "attn_res_block_size");
    refused("text_config.attn_res_block_size", "\"2\"", KDS_BAD_FORMAT, "attn_res_block_size");
    refused("text_config.routed_expert_hidden_size", "-64", KDS_INVALID_ARG,
            "routed_expert_hidden_size");
    refused("text_config.num_nextn_predict_layers", "2", KDS_UNSUPPORTED, "num_nextn_predict_layers");
    refused("text_config.topk_method", "\"greedy\"", KDS_UNSUPPORTED, "topk_method");
    refused("text_config.mla_use_output_gate", "1", KDS_BAD_FORMAT, "mla_use_output_gate");
    refused("text_config.quantization_config.quant_method", "\"bitsandbytes\"", KDS_UNSUPPORTED,
            "quant_method");
    refused("text_config.quantization_config.format", "\"nvfp4-pack-quantized\"", KDS_UNSUPPORTED,
            "quantization_config.format");
    refused("text_config.quantization_config.config_groups.group_0.weights.num_bits", "8",
            KDS_UNSUPPORTED, "num_bits 8");
    refused("text_config.quantization_config.config_groups.group_0.weights.group_size", "128",
            KDS_UNSUPPORTED, "group_size 128");
    refused("text_config.quantization_config.config_groups.group_0.input_activations",
            "{\"num_bits\": 8}", KDS_UNSUPPORTED, "input_activations");
    refused("text_config.quantization_config.config_groups", NULL, KDS_BAD_FORMAT, "config_groups");
}

/* Written back (eng_config_to_json) and parsed again: the same text model,
 * now without the vision config a generated model has no tower for. */
Test(k3_config, round_trip) {
    eng_config c, back;
    kds_err err = {0};
    cr_assert_eq(eng_config_load(MICRO_K3, &c, &err), KDS_OK, "%s", err.msg);
    char *json = eng_config_to_json(&c);
    cr_assert(json);
    cr_assert(strstr(json, "\"kimi_k3\"") && strstr(json, "\"text_config\""), "%s", json);
    cr_assert_eq(eng_config_parse(json, strlen(json), "written", &back, &err), KDS_OK, "%s\n%s",
                 err.msg, json);
    free(json);
    back.has_vision = c.has_vision;
    cr_expect_eq(memcmp(&c, &back, sizeof c), 0, "the config changed on the way back");
    cr_expect_eq(eng_config_tensor_count(&c), eng_config_tensor_count(&back));
}

/* A Kimi-Linear config has none of it, and is written as before. */
Test(k3_config, kimi_linear_unchanged) {
    eng_config c;
    kds_err err = {0};
    cr_assert_eq(eng_config_load(TMU_MICRO_HYBRID "/config.json", &c, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(c.family, ENG_FAMILY_KIMI_LINEAR);
    cr_expect_eq(c.hidden_act, ENG_ACT_SILU);
    cr_expect(!c.attn_res_block_size && !c.latent_size && !c.use_full_rank_gate &&
              !c.mla_use_output_gate && !c.experts_mxfp4);
    cr_expect_eq(c.mla_lora_norm_eps, c.rms_norm_eps);
    char *json = eng_config_to_json(&c);
    cr_assert(json);
    cr_expect(!strstr(json, "kimi_k3") && !strstr(json, "attn_res") && !strstr(json, "situ") &&
              !strstr(json, "quantization"), "K3 fields in a Kimi-Linear config: %s", json);
    free(json);
}
