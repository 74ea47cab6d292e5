/* cmd_run.c - subcommands that run a model: generate, logits, bench. */
#define _GNU_SOURCE
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "eng_config.h"
#include "eng_safetensors.h"

/* Options shared by the sampling commands. */
enum {
    OPT_TEMP = 1000,
    OPT_TOPK,
    OPT_TOPP,
    OPT_MINP,
    OPT_REPEAT,
    OPT_MAXTOK,
    OPT_THREADS,
    OPT_SEED,
    OPT_IDS,
    OPT_OUT,
    OPT_DECODE,
    OPT_PROMPT_TOKENS,
    OPT_GEN_TOKENS,
    OPT_REPEATS,
    OPT_BATCH,
};

/* Print a token's bytes; control bytes other than newline and tab are shown
 * as \xHH so random models cannot scramble the terminal. */
static void print_piece(FILE *f, const char *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)p[i];
        if ((ch < 0x20 && ch != '\n' && ch != '\t') || ch == 0x7f)
            fprintf(f, "\\x%02x", ch);
        else
            fputc(ch, f);
    }
}

static void generate_usage(FILE *f) {
    fprintf(f,
            "usage: kdaserve generate [--model DIR] --prompt TEXT [--max-tokens N] [--seed S]\n"
            "                         [--temperature T] [--top-k K] [--top-p P] [--min-p M]\n"
            "                         [--repeat-penalty R] [--threads N]\n\n"
            "Feeds the prompt through the prefill path, then samples up to N tokens\n"
            "(default 128) through the decode path, printing them as they come.\n"
            "Stops early at the model's end-of-sequence token. Statistics go to stderr.\n\n"
            "  --model DIR          model directory (default: $KDASERVE_MODEL, ./models/default)\n"
            "  --prompt TEXT        the text to continue (may be empty)\n"
            "  --max-tokens N       tokens to generate (default 128)\n"
            "  --seed S             sampler seed (default 0): same seed, same text\n"
            "  --temperature T      0 = greedy (default 0.8)\n"
            "  --top-k K            keep the K most likely tokens, 0 = off (default 40)\n"
            "  --top-p P            nucleus sampling, 1 = off (default 0.95)\n"
            "  --min-p M            drop tokens below M x the best one's probability (default 0.05)\n"
            "  --repeat-penalty R   penalise the last 64 tokens, 1 = off (default 1)\n"
            "  --threads N          worker threads (default: all CPUs)\n");
}

static bool parse_sampling(int opt, const char *arg, eng_sampler_params *sp) {
    int64_t v;
    switch (opt) {
    case OPT_TEMP: return cli_parse_f32(arg, 0.0f, 100.0f, &sp->temperature);
    case OPT_TOPK:
        if (!cli_parse_i64(arg, 0, 1 << 30, &v)) return false;
        sp->top_k = (int)v;
        return true;
    case OPT_TOPP: return cli_parse_f32(arg, 0.0f, 1.0f, &sp->top_p);
    case OPT_MINP: return cli_parse_f32(arg, 0.0f, 1.0f, &sp->min_p);
    case OPT_REPEAT: return cli_parse_f32(arg, 0.01f, 100.0f, &sp->repeat_penalty);
    }
    return false;
}

int cmd_generate(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},   {"prompt", required_argument, 0, 'p'},
        {"max-tokens", required_argument, 0, OPT_MAXTOK},
        {"seed", required_argument, 0, OPT_SEED},
        {"temperature", required_argument, 0, OPT_TEMP},
        {"top-k", required_argument, 0, OPT_TOPK}, {"top-p", required_argument, 0, OPT_TOPP},
        {"min-p", required_argument, 0, OPT_MINP},
        {"repeat-penalty", required_argument, 0, OPT_REPEAT},
        {"threads", required_argument, 0, OPT_THREADS}, {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    const char *model = NULL, *prompt = NULL;
    int64_t max_tokens = 128, seed = 0, threads = 0;
    eng_sampler_params sp = eng_sampler_default_params();
    optind = 1;
    for (int o; (o = getopt_long(argc, argv, "m:p:h", opts, NULL)) != -1;) {
        switch (o) {
        case 'm': model = optarg; break;
        case 'p': prompt = optarg; break;
        case 'h': generate_usage(stdout); return 0;
        case OPT_MAXTOK:
            if (!cli_parse_i64(optarg, 0, INT32_MAX, &max_tokens))
                return cli_failf("generate", "--max-tokens wants a count >= 0, got '%s'", optarg);
            break;
        case OPT_SEED:
            if (!cli_parse_i64(optarg, 0, INT64_MAX, &seed))
                return cli_failf("generate", "--seed wants a number >= 0, got '%s'", optarg);
            break;
        case OPT_THREADS:
            if (!cli_parse_i64(optarg, 1, 1024, &threads))
                return cli_failf("generate", "--threads wants 1..1024, got '%s'", optarg);
            break;
        case OPT_TEMP: case OPT_TOPK: case OPT_TOPP: case OPT_MINP: case OPT_REPEAT:
            if (!parse_sampling(o, optarg, &sp))
                return cli_failf("generate", "bad value '%s' for --%s", optarg,
                                 opts[o == OPT_TEMP ? 4 : o == OPT_TOPK ? 5 : o == OPT_TOPP ? 6
                                      : o == OPT_MINP ? 7 : 8].name);
            break;
        default: generate_usage(stderr); return 2;
        }
    }
    if (optind < argc) return cli_failf("generate", "unexpected argument '%s'", argv[optind]);
    if (!prompt) prompt = "";
    const char *dir = cli_model_dir("generate", model);
    if (!dir) return 1;
    eng_model *m = NULL;
    eng_ctx *c = NULL;
    eng_seq *s = NULL;
    int32_t *ids = NULL;
    int rc = cli_open("generate", dir, (int)threads, 0, &m, &c);
    if (rc) return rc;
    kds_err err = {0};
    const eng_tokenizer *tok = eng_model_tokenizer(m);
    size_t plen = strlen(prompt);
    int64_t n = eng_tok_encode(tok, prompt, plen, NULL, 0);
    ids = malloc(((size_t)n + 1) * sizeof *ids);
    if (!ids) {
        rc = cli_failf("generate", "out of memory for %lld prompt tokens", (long long)n);
        goto out;
    }
    eng_tok_encode(tok, prompt, plen, ids, n);
    if (n == 0 && eng_tok_bos(tok) >= 0) ids[n++] = eng_tok_bos(tok); /* nothing to continue from */
    if (n == 0) {
        rc = cli_failf("generate", "empty prompt and the model has no BOS token to start from");
        goto out;
    }
    if (eng_seq_create(m, (uint64_t)seed, &s, &err) != KDS_OK) {
        rc = cli_fail("generate", &err);
        goto out;
    }
    double t0 = cli_now();
    if (eng_prefill(c, s, ids, n, NULL, NULL, NULL, &err) != KDS_OK) {
        rc = cli_fail("generate", &err);
        goto out;
    }
    double t1 = cli_now();
    int64_t produced = 0;
    const int32_t eos = eng_tok_eos(tok);
    for (; produced < max_tokens; produced++) {
        int32_t next;
        if (eng_sample(c, s, &sp, &next, &err) != KDS_OK) {
            rc = cli_fail("generate", &err);
            goto out;
        }
        if (next == eos) break;
        size_t len;
        const char *piece = eng_tok_piece(tok, next, &len);
        print_piece(stdout, piece, len);
        fflush(stdout);
        if (produced + 1 < max_tokens && eng_decode(c, s, next, &err) != KDS_OK) {
            rc = cli_fail("generate", &err);
            goto out;
        }
    }
    double t2 = cli_now();
    fputc('\n', stdout);
    fprintf(stderr,
            "[kdaserve] prompt %lld tokens in %.3f s (%.1f tok/s); generated %lld tokens in "
            "%.3f s (%.1f tok/s); %d threads\n",
            (long long)n, t1 - t0, n / (t1 - t0 > 0 ? t1 - t0 : 1e-9), (long long)produced,
            t2 - t1, produced / (t2 - t1 > 0 ? t2 - t1 : 1e-9), eng_ctx_threads(c));
out:
    free(ids);
    eng_seq_free(s);
    eng_ctx_free(c);
    eng_model_free(m);
    return rc;
}

/* ------------------------------------------------------------------------ */

static void logits_usage(FILE *f) {
    fprintf(f, "usage: kdaserve logits [--model DIR] --ids 1,2,3 --out FILE.safetensors "
               "[--decode] [--threads N]\n\n"
               "Writes the float32 logits of every position (tensor 'logits', shape [T, vocab],\n"
               "and the input as tensor 'ids', I32 [T]). By default the whole list goes through\n"
               "the prefill path; --decode feeds it token by token through the decode path.\n");
}

/* Parse "1,2,3" into a new array; returns the count or -1 with a message. */
static int64_t parse_ids(const char *s, int32_t **out) {
    int64_t cap = 16, n = 0;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    if (!ids) return -1;
    const char *p = s;
    while (*p) {
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p || v < INT32_MIN || v > INT32_MAX || (*end && *end != ',')) {
            fprintf(stderr, "kdaserve logits: --ids wants comma-separated integers, bad at '%s'\n", p);
            free(ids);
            return -1;
        }
        if (n == cap) {
            cap *= 2;
            int32_t *grown = realloc(ids, (size_t)cap * sizeof *ids);
            if (!grown) {
                free(ids);
                return -1;
            }
            ids = grown;
        }
        ids[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    *out = ids;
    return n;
}

int cmd_logits(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},  {"ids", required_argument, 0, OPT_IDS},
        {"out", required_argument, 0, OPT_OUT}, {"decode", no_argument, 0, OPT_DECODE},
        {"threads", required_argument, 0, OPT_THREADS}, {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    const char *model = NULL, *ids_arg = NULL, *out_path = NULL;
    bool decode = false;
    int64_t threads = 0;
    optind = 1;
    for (int o; (o = getopt_long(argc, argv, "m:h", opts, NULL)) != -1;) {
        switch (o) {
        case 'm': model = optarg; break;
        case OPT_IDS: ids_arg = optarg; break;
        case OPT_OUT: out_path = optarg; break;
        case OPT_DECODE: decode = true; break;
        case OPT_THREADS:
            if (!cli_parse_i64(optarg, 1, 1024, &threads))
                return cli_failf("logits", "--threads wants 1..1024, got '%s'", optarg);
            break;
        case 'h': logits_usage(stdout); return 0;
        default: logits_usage(stderr); return 2;
        }
    }
    if (!ids_arg || !out_path) {
        logits_usage(stderr);
        return 2;
    }
    int32_t *ids = NULL;
    int64_t n = parse_ids(ids_arg, &ids);
    if (n < 0) return 1;
    if (n == 0) {
        free(ids);
        return cli_failf("logits", "--ids is empty");
    }
    const char *dir = cli_model_dir("logits", model);
    if (!dir) {
        free(ids);
        return 1;
    }
    eng_model *m = NULL;
    eng_ctx *c = NULL;
    eng_seq *s = NULL;
    float *logits = NULL;
    int rc = cli_open("logits", dir, (int)threads, 0, &m, &c);
    if (rc) {
        free(ids);
        return rc;
    }
    kds_err err = {0};
    const int vocab = eng_model_config(m)->vocab_size;
    logits = malloc((size_t)n * vocab * sizeof(float));
    if (!logits) {
        rc = cli_failf("logits", "out of memory for %lld x %d logits", (long long)n, vocab);
        goto out;
    }
    if (eng_seq_create(m, 0, &s, &err) != KDS_OK) goto fail;
    if (!decode) {
        if (eng_prefill(c, s, ids, n, logits, NULL, NULL, &err) != KDS_OK) goto fail;
    } else {
        for (int64_t t = 0; t < n; t++) {
            if (eng_decode(c, s, ids[t], &err) != KDS_OK) goto fail;
            memcpy(logits + (size_t)t * vocab, eng_seq_logits(s), (size_t)vocab * sizeof(float));
        }
    }
    eng_st_out_tensor t[2] = {
        {.name = "ids", .dtype = ENG_ST_I32, .n_dims = 1, .shape = {n}, .data = ids},
        {.name = "logits", .dtype = ENG_ST_F32, .n_dims = 2, .shape = {n, vocab}, .data = logits},
    };
    const char *meta[] = {"path", decode ? "decode" : "prefill", "model_fingerprint",
                          eng_model_fingerprint(m), NULL};
    if (eng_st_write(out_path, t, 2, meta, &err) != KDS_OK) goto fail;
    fprintf(stderr, "[kdaserve] wrote logits [%lld, %d] (%s path) to %s\n", (long long)n, vocab,
            decode ? "decode" : "prefill", out_path);
    goto out;
fail:
    rc = cli_fail("logits", &err);
out:
    free(logits);
    free(ids);
    eng_seq_free(s);
    eng_ctx_free(c);
    eng_model_free(m);
    return rc;
}

/* ------------------------------------------------------------------------ */

static void bench_usage(FILE *f) {
    fprintf(f, "usage: kdaserve bench [--model DIR] [--prompt-tokens N] [--gen-tokens N]\n"
               "                      [--repeats R] [--threads N] [--batch B]\n\n"
               "Measures prefill tokens/s (N random tokens through the prefill path, default\n"
               "512) and decode tokens/s (N tokens one at a time after that prompt, default\n"
               "128), best of R runs (default 3), and prints them with the model, thread\n"
               "count and sizes.\n");
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int cmd_bench(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},
        {"prompt-tokens", required_argument, 0, OPT_PROMPT_TOKENS},
        {"gen-tokens", required_argument, 0, OPT_GEN_TOKENS},
        {"repeats", required_argument, 0, OPT_REPEATS},
        {"threads", required_argument, 0, OPT_THREADS},
        {"batch", required_argument, 0, OPT_BATCH},
        {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    const char *model = NULL;
    int64_t pt = 512, gt = 128, reps = 3, threads = 0, batch = 0;
    optind = 1;
    for (int o; (o = getopt_long(argc, argv, "m:h", opts, NULL)) != -1;) {
        int64_t *dst = o == OPT_PROMPT_TOKENS ? &pt : o == OPT_GEN_TOKENS ? &gt
                       : o == OPT_REPEATS ? &reps : o == OPT_THREADS ? &threads
                       : o == OPT_BATCH ? &batch : NULL;
        if (o == 'm') {
            model = optarg;
        } else if (o == 'h') {
            bench_usage(stdout);
            return 0;
        } else if (dst) {
            if (!cli_parse_i64(optarg, o == OPT_BATCH || o == OPT_THREADS || o == OPT_REPEATS ? 1 : 0,
                               1 << 24, dst))
                return cli_failf("bench", "bad number '%s'", optarg);
        } else {
            bench_usage(stderr);
            return 2;
        }
    }
    const char *dir = cli_model_dir("bench", model);
    if (!dir) return 1;
    eng_model *m = NULL;
    eng_ctx *c = NULL;
    eng_seq *s = NULL;
    int32_t *ids = NULL;
    double *pre = NULL, *dec = NULL;
    int rc = cli_open("bench", dir, (int)threads, (int)batch, &m, &c);
    if (rc) return rc;
    kds_err err = {0};
    const eng_config *cfg = eng_model_config(m);
    ids = malloc(((size_t)pt + 1) * sizeof *ids);
    pre = calloc((size_t)reps, sizeof *pre);
    dec = calloc((size_t)reps, sizeof *dec);
    if (!ids || !pre || !dec) {
        rc = cli_failf("bench", "out of memory");
        goto out;
    }
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int64_t i = 0; i < pt; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        ids[i] = (int32_t)(x % (uint64_t)cfg->vocab_size);
    }
    if (pt == 0) ids[pt++] = 0;
    if (eng_seq_create(m, 0, &s, &err) != KDS_OK) goto fail;
    eng_sampler_params greedy = eng_sampler_default_params();
    greedy.temperature = 0.0f;
    for (int64_t r = 0; r < reps; r++) {
        eng_seq_reset(s, 0);
        double t0 = cli_now();
        if (eng_prefill(c, s, ids, pt, NULL, NULL, NULL, &err) != KDS_OK) goto fail;
        double t1 = cli_now();
        for (int64_t i = 0; i < gt; i++) {
            int32_t next;
            if (eng_sample(c, s, &greedy, &next, &err) != KDS_OK) goto fail;
            if (eng_decode(c, s, next, &err) != KDS_OK) goto fail;
        }
        double t2 = cli_now();
        pre[r] = pt / (t1 - t0);
        dec[r] = gt ? gt / (t2 - t1) : 0.0;
    }
    qsort(pre, (size_t)reps, sizeof *pre, cmp_double);
    qsort(dec, (size_t)reps, sizeof *dec, cmp_double);
    eng_state_size z = eng_config_state_size(cfg);
    printf("model        %s\n", dir);
    printf("fingerprint  %s\n", eng_model_fingerprint(m));
    printf("params       %.2f M (%zu tensors), hidden %d, layers %d (%d KDA, %d MLA), "
           "experts %d top-%d, vocab %d\n",
           eng_config_param_count(cfg) / 1e6, eng_config_tensor_count(cfg), cfg->hidden_size,
           cfg->num_hidden_layers, cfg->n_kda_layers, cfg->n_mla_layers, cfg->num_experts,
           cfg->num_experts_per_token, cfg->vocab_size);
    printf("state        %zu bytes fixed + %zu bytes/token\n", z.fixed, z.per_token);
    printf("threads      %d\n", eng_ctx_threads(c));
    printf("prefill      %.1f tokens/s  (%lld tokens, best of %lld; median %.1f)\n",
           pre[reps - 1], (long long)pt, (long long)reps, pre[reps / 2]);
    printf("decode       %.1f tokens/s  (%lld tokens after the prompt, best of %lld; "
           "median %.1f; %.3f ms/token)\n",
           dec[reps - 1], (long long)gt, (long long)reps, dec[reps / 2],
           dec[reps - 1] > 0 ? 1000.0 / dec[reps - 1] : 0.0);
    goto out;
fail:
    rc = cli_fail("bench", &err);
out:
    free(ids);
    free(pre);
    free(dec);
    eng_seq_free(s);
    eng_ctx_free(c);
    eng_model_free(m);
    return rc;
}
