/* cmd_model.c - subcommands about model files: gen-model, info. */
#define _GNU_SOURCE
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "eng_config.h"
#include "eng_genmodel.h"
#include "kern.h"

static void gen_usage(FILE *f) {
    fprintf(f,
            "usage: kdaserve gen-model (--preset NAME | --config FILE) --out DIR [--seed S]\n"
            "                          [--dtype bf16|f16|f32] [--dry-run]\n\n"
            "Writes a complete Hugging Face Kimi-Linear model (config.json + safetensors)\n"
            "with seeded random weights, for tests and benchmarks.\n\n"
            "  --preset NAME   tiny, tiny-hybrid, llamacpp-tiny, wide, full27, kimi-linear-48b,\n"
            "                  state48b, k3-micro, k3 (Kimi K3: MXFP4 experts)\n"
            "  --config FILE   any Kimi-Linear config.json instead of a preset\n"
            "  --out DIR       output directory (created if missing)\n"
            "  --seed S        weight seed (default 0): same seed, same bytes\n"
            "  --dtype T       weight dtype (default bf16, as real checkpoints)\n"
            "  --dry-run       print tensor count, parameter count and per-session state\n"
            "                  size instead of writing anything\n");
}

int cmd_gen_model(int argc, char **argv) {
    static const struct option opts[] = {
        {"preset", required_argument, 0, 'p'}, {"config", required_argument, 0, 'c'},
        {"out", required_argument, 0, 'o'},    {"seed", required_argument, 0, 's'},
        {"dtype", required_argument, 0, 't'},  {"dry-run", no_argument, 0, 'n'},
        {"help", no_argument, 0, 'h'},         {0, 0, 0, 0}};
    const char *preset = NULL, *config = NULL, *out = NULL, *dtype_s = "bf16";
    int64_t seed = 0;
    bool dry = false;
    optind = 1;
    for (int o; (o = getopt_long(argc, argv, "h", opts, NULL)) != -1;) {
        switch (o) {
        case 'p': preset = optarg; break;
        case 'c': config = optarg; break;
        case 'o': out = optarg; break;
        case 't': dtype_s = optarg; break;
        case 'n': dry = true; break;
        case 's':
            if (!cli_parse_i64(optarg, 0, INT64_MAX, &seed))
                return cli_failf("gen-model", "--seed wants a number >= 0, got '%s'", optarg);
            break;
        case 'h': gen_usage(stdout); return 0;
        default: return cli_usage_error("gen-model", NULL);
        }
    }
    if (!!preset == !!config)
        return cli_usage_error("gen-model", "give exactly one of --preset or --config");
    kern_dtype dt;
    if (!strcmp(dtype_s, "bf16"))
        dt = KERN_BF16;
    else if (!strcmp(dtype_s, "f16"))
        dt = KERN_F16;
    else if (!strcmp(dtype_s, "f32"))
        dt = KERN_F32;
    else
        return cli_failf("gen-model", "--dtype wants bf16, f16 or f32, got '%s'", dtype_s);
    eng_config cfg;
    kds_err err = {0};
    kds_status st = preset ? eng_genmodel_preset(preset, &cfg, &err)
                           : eng_config_load(config, &cfg, &err);
    if (st != KDS_OK) return cli_fail("gen-model", &err);
    if (dry) {
        snprintf(cfg.torch_dtype, sizeof cfg.torch_dtype, "%s",
                 dt == KERN_BF16 ? "bfloat16" : dt == KERN_F16 ? "float16" : "float32");
        eng_genmodel_describe(&cfg, stdout);
        return 0;
    }
    if (!out) return cli_failf("gen-model", "--out DIR is required (or use --dry-run)");
    if (eng_genmodel_write(&cfg, (uint64_t)seed, dt, out, true, &err) != KDS_OK)
        return cli_fail("gen-model", &err);
    fprintf(stderr, "[kdaserve] wrote %s model to %s\n", preset ? preset : config, out);
    return 0;
}

static void quantize_usage(FILE *f) {
    fprintf(f,
            "usage: kdaserve quantize [--model DIR] --experts mxfp4|q8_0 [--dense mxfp4|q8_0]\n"
            "                         --out DIR\n\n"
            "Writes the model with its routed experts quantised, and with --dense its\n"
            "other matrices too; everything else as it is:\n"
            "  mxfp4   4-bit E2M1 codes with one E8M0 scale per 32 inputs, as compressed-\n"
            "          tensors stores them (Kimi K3's experts): 4.25 bits a weight\n"
            "  q8_0    int8 with one f16 scale per 32 inputs: 8.5 bits a weight\n"
            "--dense quantises every other matrix the forward pass multiplies by\n"
            "(attention and its gates, shared experts, dense MLPs, the lm_head): what a\n"
            "decoded token reads besides its experts. The embedding table, the MoE\n"
            "routers and MLA's kv_b_proj stay as stored. q8_0 there costs little\n"
            "accuracy; mxfp4 more.\n"
            "The new directory loads as any model; it has its own fingerprint, so sessions\n"
            "saved with the original model do not resume on it (start new ones).\n\n"
            "  --model DIR      the model (default $KDASERVE_MODEL, else ./models/default)\n"
            "  --experts FMT    mxfp4 or q8_0\n"
            "  --dense FMT      mxfp4 or q8_0 for the other matrices (default: as stored)\n"
            "  --out DIR        where to write it (created if missing; not the model's own)\n");
}

static bool block_format(const char *name, kern_dtype *out) {
    if (!strcmp(name, "mxfp4")) *out = KERN_MXFP4;
    else if (!strcmp(name, "q8_0")) *out = KERN_Q8_0;
    else return false;
    return true;
}

int cmd_quantize(int argc, char **argv) {
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"experts", required_argument, 0, 'e'},
                                         {"dense", required_argument, 0, 'd'},
                                         {"out", required_argument, 0, 'o'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *model = NULL, *experts = NULL, *dense = NULL, *out = NULL;
    optind = 1;
    for (int o; (o = getopt_long(argc, argv, "h", opts, NULL)) != -1;) {
        switch (o) {
        case 'm': model = optarg; break;
        case 'e': experts = optarg; break;
        case 'd': dense = optarg; break;
        case 'o': out = optarg; break;
        case 'h': quantize_usage(stdout); return 0;
        default: return cli_usage_error("quantize", NULL);
        }
    }
    if (!experts || !out) return cli_usage_error("quantize", "--experts and --out are required");
    eng_quantize_params qp = eng_quantize_default_params();
    qp.progress = true;
    if (!block_format(experts, &qp.experts))
        return cli_failf("quantize", "--experts wants mxfp4 or q8_0, got '%s'", experts);
    if (dense) {
        if (!block_format(dense, &qp.dense_fmt))
            return cli_failf("quantize", "--dense wants mxfp4 or q8_0, got '%s'", dense);
        qp.dense = true;
    }
    const char *dir = cli_model_dir("quantize", model);
    if (!dir) return 1;
    if (!strcmp(dir, out)) return cli_failf("quantize", "--out must not be the model's own directory");
    kds_err err = {0};
    char fp[33] = "";
    if (eng_model_quantize(dir, &qp, out, fp, &err) != KDS_OK) return cli_fail("quantize", &err);
    fprintf(stderr, "[kdaserve] wrote %s with %s experts%s%s to %s (fingerprint %s)\n", dir,
            experts, dense ? " and other matrices in " : "", dense ? dense : "", out, fp);
    return 0;
}

static void info_usage(FILE *f) {
    fprintf(f, "usage: kdaserve info [--model DIR]\n\n"
               "Loads and checks a model, then prints its layout, sizes, per-session state\n"
               "size and fingerprint.\n");
}

int cmd_info(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    const char *model = NULL;
    optind = 1;
    for (int o; (o = getopt_long(argc, argv, "m:h", opts, NULL)) != -1;) {
        if (o == 'm')
            model = optarg;
        else if (o == 'h') {
            info_usage(stdout);
            return 0;
        } else {
            return cli_usage_error("info", NULL);
        }
    }
    const char *dir = cli_model_dir("info", model);
    if (!dir) return 1;
    kds_err err = {0};
    eng_model *m = NULL;
    eng_model_params mp = eng_model_default_params();
    mp.progress = true;
    mp.weights = ENG_WEIGHTS_MAPPED; /* runs nothing: no copy of the weights */
    if (eng_model_load(dir, &mp, &m, &err) != KDS_OK) return cli_fail("info", &err);
    const eng_config *cfg = eng_model_config(m);
    printf("model        %s\n", dir);
    printf("fingerprint  %s\n", eng_model_fingerprint(m));
    printf("layers       %d:", cfg->num_hidden_layers);
    for (int l = 0; l < cfg->num_hidden_layers; l++)
        printf(" %s%s", eng_layer_kind_name(cfg->layer_kind[l]),
               cfg->layer_is_moe[l] ? "+MoE" : "+MLP");
    printf("\n");
    eng_genmodel_describe(cfg, stdout);
    eng_model_free(m);
    return 0;
}
