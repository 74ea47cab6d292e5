/* cmd_plan.c - `kdaserve plan`: size an expert-parallel deployment of a
 * model from its config (engine/eng_ep.h: eng_ep_plan says how). */
#define _GNU_SOURCE
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "eng_config.h"
#include "eng_ep.h"
#include "eng_genmodel.h"

enum {
    OPT_GEN = 1000,
    OPT_RANKS,
    OPT_GPU,
    OPT_PLACEMENT,
    OPT_DTYPE,
    OPT_CONTEXT,
    OPT_BATCH,
    OPT_HBM,
    OPT_NVLINK,
    OPT_NET,
    OPT_LATENCY,
    OPT_PER_NODE,
    OPT_MEM,
};

static void plan_usage(FILE *f) {
    fprintf(f,
            "usage: kdaserve plan (--model DIR | --gen PRESET) --ranks N [--gpu h200|h100|b200]\n"
            "                     [--placement block|cyclic] [--dtype bf16|f16|f32]\n"
            "                     [--context TOKENS] [--batch B,B,...] [--mem-gb G]\n"
            "                     [--hbm-gbs X] [--nvlink-gbs X] [--net-gbs X] [--latency-us X]\n"
            "                     [--gpus-per-node N]\n\n"
            "Sizes the model on N expert-parallel ranks (docs/expert-parallel.md): weight\n"
            "memory per rank (the routed experts split by the placement, the rest on every\n"
            "rank), a session's state, the bytes the all-to-alls move per token and MoE\n"
            "layer, and the decode rate the bandwidths allow at each batch (sessions per\n"
            "rank): memory-bound, weights and states streamed once per step, links at their\n"
            "speed plus a latency per collective, no overlap. Reads only config.json.\n\n"
            "  --model DIR        the model's config.json (no weights are read)\n"
            "  --gen PRESET       a gen-model preset's config instead (e.g. k3, kimi-linear-48b)\n"
            "  --ranks N          ranks (one GPU each)\n"
            "  --gpu NAME         the figures below from a preset (default h200: 141 GB,\n"
            "                     4800 GB/s HBM, NVLink 450 GB/s per direction, 50 GB/s\n"
            "                     InfiniBand per GPU, 10 us per collective, 8 GPUs a node)\n"
            "  --placement P      block (default) or cyclic\n"
            "  --dtype T          the format of the non-expert weights (default bf16; the\n"
            "                     routed experts are in the config's format, MXFP4 for K3)\n"
            "  --context TOKENS   a session's length for its state (default 131072)\n"
            "  --batch B,...      sessions decoding together per rank (default 1,16,64,256)\n"
            "  --mem-gb, --hbm-gbs, --nvlink-gbs, --net-gbs, --latency-us, --gpus-per-node\n"
            "                     override the preset's figures\n");
}

static bool parse_f64(const char *s, double *out) {
    char *end;
    double v = strtod(s, &end);
    if (!*s || *end || !(v >= 0 && v < 1e12)) return false;
    *out = v;
    return true;
}

static double gb(double bytes) { return bytes / 1e9; }

int cmd_plan(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},    {"gen", required_argument, 0, OPT_GEN},
        {"ranks", required_argument, 0, OPT_RANKS}, {"gpu", required_argument, 0, OPT_GPU},
        {"placement", required_argument, 0, OPT_PLACEMENT},
        {"dtype", required_argument, 0, OPT_DTYPE}, {"context", required_argument, 0, OPT_CONTEXT},
        {"batch", required_argument, 0, OPT_BATCH}, {"hbm-gbs", required_argument, 0, OPT_HBM},
        {"nvlink-gbs", required_argument, 0, OPT_NVLINK}, {"net-gbs", required_argument, 0, OPT_NET},
        {"latency-us", required_argument, 0, OPT_LATENCY},
        {"gpus-per-node", required_argument, 0, OPT_PER_NODE},
        {"mem-gb", required_argument, 0, OPT_MEM}, {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    const char *model = NULL, *gen = NULL, *gpu = "h200", *batches = "1,16,64,256";
    int64_t ranks = 0, context = 131072, v;
    eng_ep_plan_in in = {.placement = ENG_EP_BLOCK, .dtype = KERN_BF16};
    /* the overrides, applied after the preset: < 0 = not given */
    double mem = -1, hbm = -1, nvlink = -1, net = -1, lat = -1, x;
    int64_t per_node = -1;
    optind = 1;
    for (int o; (o = getopt_long(argc, argv, "m:h", opts, NULL)) != -1;) {
        switch (o) {
        case 'm': model = optarg; break;
        case 'h': plan_usage(stdout); return 0;
        case OPT_GEN: gen = optarg; break;
        case OPT_GPU: gpu = optarg; break;
        case OPT_BATCH: batches = optarg; break;
        case OPT_RANKS:
            if (!cli_parse_i64(optarg, 1, 1 << 20, &ranks))
                return cli_usage_error("plan", "--ranks wants a count >= 1, got '%s'", optarg);
            break;
        case OPT_CONTEXT:
            if (!cli_parse_i64(optarg, 0, (int64_t)1 << 40, &context))
                return cli_usage_error("plan", "--context wants tokens >= 0, got '%s'", optarg);
            break;
        case OPT_PER_NODE:
            if (!cli_parse_i64(optarg, 1, 1 << 16, &per_node))
                return cli_usage_error("plan", "--gpus-per-node wants a count >= 1, got '%s'",
                                       optarg);
            break;
        case OPT_PLACEMENT:
            if (!eng_ep_placement_from_name(optarg, &in.placement))
                return cli_usage_error("plan", "--placement wants block or cyclic, got '%s'",
                                       optarg);
            break;
        case OPT_DTYPE:
            if (!strcmp(optarg, "bf16")) in.dtype = KERN_BF16;
            else if (!strcmp(optarg, "f16")) in.dtype = KERN_F16;
            else if (!strcmp(optarg, "f32")) in.dtype = KERN_F32;
            else return cli_usage_error("plan", "--dtype wants bf16, f16 or f32, got '%s'", optarg);
            break;
        case OPT_MEM: case OPT_HBM: case OPT_NVLINK: case OPT_NET: case OPT_LATENCY:
            if (!parse_f64(optarg, &x) || (o != OPT_LATENCY && x <= 0))
                return cli_usage_error("plan", "bad figure '%s'", optarg);
            *(o == OPT_MEM ? &mem : o == OPT_HBM ? &hbm : o == OPT_NVLINK ? &nvlink
              : o == OPT_NET ? &net : &lat) = x;
            break;
        default: return cli_usage_error("plan", NULL);
        }
    }
    if (optind < argc) return cli_usage_error("plan", "unexpected argument '%s'", argv[optind]);
    if (!model == !gen) return cli_usage_error("plan", "give one of --model DIR and --gen PRESET");
    if (ranks == 0) return cli_usage_error("plan", "--ranks N is required");
    if (!eng_ep_hw_preset(gpu, &in.hw))
        return cli_usage_error("plan", "--gpu wants h200, h100 or b200, got '%s'", gpu);
    if (mem >= 0) in.hw.mem_gb = mem;
    if (hbm >= 0) in.hw.hbm_gbs = hbm;
    if (nvlink >= 0) in.hw.nvlink_gbs = nvlink;
    if (net >= 0) in.hw.net_gbs = net;
    if (lat >= 0) in.hw.latency_us = lat;
    if (per_node > 0) in.hw.ranks_per_node = (int)per_node;
    in.ranks = (int)ranks;
    in.context = context;
    eng_config cfg;
    kds_err err = {0};
    char origin[4200];
    if (gen) {
        if (eng_genmodel_preset(gen, &cfg, &err) != KDS_OK) return cli_fail("plan", &err);
        snprintf(origin, sizeof origin, "preset %s", gen);
    } else {
        snprintf(origin, sizeof origin, "%s/config.json", model);
        if (eng_config_load(origin, &cfg, &err) != KDS_OK) return cli_fail("plan", &err);
    }
    /* the figures that do not depend on the batch first */
    in.batch = 1;
    eng_ep_plan_out o;
    if (eng_ep_plan(&cfg, &in, &o, &err) != KDS_OK) return cli_fail("plan", &err);
    const eng_ep_hw *h = &in.hw;
    const double X = cfg.latent_size > 0 ? cfg.latent_size : cfg.hidden_size;
    printf("model        %s: %d layers (%d MoE), hidden %d, %d routed experts top-%d%s, vocab %d\n",
           origin, cfg.num_hidden_layers, o.n_moe, cfg.hidden_size, cfg.num_experts,
           cfg.num_experts_per_token, cfg.latent_size > 0 ? " (latent MoE)" : "", cfg.vocab_size);
    printf("ranks        %lld x %s (%.0f GB, HBM %.0f GB/s, NVLink %.0f GB/s, network %.0f GB/s, "
           "%.0f us/collective, %d per node), %s placement\n",
           (long long)ranks, h->name, h->mem_gb, h->hbm_gbs, h->nvlink_gbs, h->net_gbs,
           h->latency_us, h->ranks_per_node, eng_ep_placement_name(in.placement));
    printf("weights      %.2f GB replicated on every rank (%s; embedding %.2f GB) + %.2f GB of "
           "routed experts (%.2f MB each, %s)\n",
           gb(o.replicated_bytes), kern_dtype_name(in.dtype), gb(o.embed_bytes),
           gb(o.expert_bytes), o.one_expert_bytes / 1e6, cfg.experts_mxfp4 ? "MXFP4" :
           kern_dtype_name(in.dtype));
    printf("per rank     %.2f GB: replicated + %d experts x %d MoE layers (%.2f GB)\n",
           gb(o.rank_weight_bytes), o.experts_rank_max, o.n_moe,
           gb(o.rank_weight_bytes - o.replicated_bytes));
    printf("session      %.2f MB fixed + %.0f B/token = %.2f GB at %lld tokens\n", o.state_fixed / 1e6,
           o.state_per_token, gb(o.state_session), (long long)context);
    printf("all-to-all   per token and MoE layer: %d rows of %.0f f32 (%.1f KB) out and back = "
           "%.1f KB, %.1f KB of it between ranks; counts exchange %.1f KB per rank and layer\n",
           cfg.num_experts_per_token, X, 4.0 * X * cfg.num_experts_per_token / 1e3,
           o.a2a_token_layer / 1e3, o.a2a_cross_token_layer / 1e3, o.counts_layer / 1e3);
    printf("             per token, all %d MoE layers: %.2f MB between ranks\n", o.n_moe,
           o.a2a_cross_token_layer * o.n_moe / 1e6);
    printf("decode       (sessions per rank B; memory-bound estimate, no overlap of memory and "
           "links)\n");
    printf("  %6s %10s %10s %9s %9s %10s %12s %14s %s\n", "B", "HBM/step", "net/step", "t_hbm",
           "t_comm", "t_step", "tok/s/sess", "tok/s (job)", "memory/rank");
    for (const char *p = batches; *p;) {
        char num[32];
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (len == 0 || len >= sizeof num) return cli_usage_error("plan", "bad --batch '%s'", batches);
        memcpy(num, p, len);
        num[len] = '\0';
        if (!cli_parse_i64(num, 1, 1 << 20, &v))
            return cli_usage_error("plan", "--batch wants counts >= 1, got '%s'", num);
        in.batch = (int)v;
        if (eng_ep_plan(&cfg, &in, &o, &err) != KDS_OK) return cli_fail("plan", &err);
        printf("  %6d %8.2fGB %8.2fGB %7.2fms %7.2fms %8.2fms %12.1f %14.0f %7.1f GB%s\n", in.batch,
               gb(o.hbm_step_bytes), gb(o.net_step_bytes), o.t_hbm * 1e3, o.t_comm * 1e3,
               o.t_step * 1e3, o.tok_s_session, o.tok_s_job, gb(o.mem_rank_bytes),
               o.fits ? "" : " (does not fit)");
        p = comma ? comma + 1 : p + len;
    }
    return 0;
}
