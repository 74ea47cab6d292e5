/* cmd_tokenize.c - `kdaserve tokenize`: text on stdin to ids, ids to text,
 * pre-token splits, and the encoding speed benchmark of docs/benchmarks.md. */
#define _GNU_SOURCE
#include <cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "kds_buf.h"
#include "kds_clock.h"

static void tokenize_usage(FILE *f) {
    fprintf(
        f,
        "usage: kdaserve tokenize (--vocab FILE --pattern NAME [--specials FILE] | --model DIR)\n"
        "                         [--allow-special] [--decode [--skip-special]] [--split]\n"
        "                         [--chat] [--bench N]\n\n"
        "Reads text on stdin (all of it, bytes as they are) and prints the token ids\n"
        "separated by spaces on one line. Ids equal OpenAI tiktoken's for the same rank\n"
        "file and pattern.\n\n"
        "  --vocab FILE      tiktoken rank file (\"base64-token rank\" lines), e.g.\n"
        "                    cl100k_base.tiktoken or a Kimi model's tiktoken.model\n"
        "  --pattern NAME    pre-tokeniser: cl100k, o200k, kimi or none\n"
        "  --specials FILE   special tokens as JSON: tiktoken's {\"special_tokens\": {..}},\n"
        "                    a tokenizer_config.json, or {NAME: ID} (default: the\n"
        "                    pattern preset's own specials)\n"
        "  --model DIR       use a model directory's tokenizer instead\n"
        "  --allow-special   text equal to a special token's name becomes that token\n"
        "                    (by default it is ordinary text)\n"
        "  --decode          read ids (separated by spaces, commas or newlines) and\n"
        "                    write their bytes, nothing added\n"
        "  --skip-special    with --decode: leave special tokens out\n"
        "  --split           print the pre-tokens, one JSON string per line\n"
        "  --chat            stdin is a conversation in JSON: [{\"role\": .., \"content\": ..},\n"
        "                    ..] or {\"messages\": [..], \"tools\": [..],\n"
        "                    \"add_generation_prompt\": true, \"default_system\": \"..\",\n"
        "                    \"thinking\": true, \"thinking_effort\": \"max\"} (OpenAI message\n"
        "                    fields: name, tool_call_id, tool_calls, reasoning_content);\n"
        "                    prints the ids of the tokenizer's chat format (Kimi-K2's, or\n"
        "                    K3's when it has <|open|> <|sep|> <|close|> <|end_of_msg|>)\n"
        "  --bench N         encode the input N times; print one JSON line with the\n"
        "                    median MB/s (10^6 input bytes per second, one thread)\n");
}

/* All of a stream; caller frees. NULL when out of memory or on a read error. */
static char *read_all(FILE *f, size_t *len) {
    kds_buf b = {0};
    char chunk[1 << 14];
    /* room for a typical input at once, and memory to return for an empty one */
    if (kds_buf_reserve(&b, 1 << 16, NULL) != KDS_OK) return NULL;
    for (;;) {
        size_t r = fread(chunk, 1, sizeof chunk, f);
        if (r == 0) break;
        if (kds_buf_append(&b, chunk, r, NULL) != KDS_OK) goto fail;
    }
    if (ferror(f)) goto fail;
    return kds_buf_detach(&b, len);
fail:
    kds_buf_free(&b);
    return NULL;
}

static void print_json_string(FILE *f, const char *s, size_t n) {
    fputc('"', f);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c == '\n')
            fputs("\\n", f);
        else if (c == '\r')
            fputs("\\r", f);
        else if (c == '\t')
            fputs("\\t", f);
        else if (c < 0x20 || c == 0x7f)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f); /* UTF-8 (and any invalid byte) as it is */
    }
    fputs("\"\n", f);
}

static int do_decode(const eng_tokenizer *tok, const char *in, size_t len, bool skip) {
    int rc = 0;
    int64_t cap = 256, n = 0;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    char *out = NULL;
    if (!ids) return cli_failf("tokenize", "out of memory");
    for (size_t i = 0; i < len;) {
        while (i < len && (isspace((unsigned char)in[i]) || in[i] == ','))
            i++;
        if (i == len) break;
        size_t s = i;
        while (i < len && !isspace((unsigned char)in[i]) && in[i] != ',')
            i++;
        char word[24];
        int64_t v;
        size_t wl = i - s;
        if (wl >= sizeof word) wl = sizeof word - 1;
        memcpy(word, in + s, wl);
        word[wl] = '\0';
        if (i - s >= sizeof word || !cli_parse_i64(word, 0, eng_tok_vocab(tok) - 1, &v)) {
            rc = cli_failf("tokenize", "'%s' is not a token id in [0, %d)", word,
                           eng_tok_vocab(tok));
            goto out;
        }
        if (n == cap) {
            int32_t *g = realloc(ids, (size_t)(cap *= 2) * sizeof *ids);
            if (!g) {
                rc = cli_failf("tokenize", "out of memory");
                goto out;
            }
            ids = g;
        }
        ids[n++] = (int32_t)v;
    }
    unsigned flags = skip ? ENG_TOK_SKIP_SPECIAL : 0;
    int64_t need = eng_tok_decode(tok, ids, n, flags, NULL, 0);
    out = malloc((size_t)need + 1);
    if (!out) {
        rc = cli_failf("tokenize", "out of memory");
        goto out;
    }
    eng_tok_decode(tok, ids, n, flags, out, (size_t)need);
    fwrite(out, 1, (size_t)need, stdout);
out:
    free(ids);
    free(out);
    return rc;
}

static int do_split(const eng_tokenizer *tok, const char *in, size_t len) {
    kds_err err = {0};
    int64_t n = 0;
    if (eng_tok_split(tok, in, len, NULL, 0, &n, &err) != KDS_OK) return cli_fail("tokenize", &err);
    size_t *ends = malloc(((size_t)n + 1) * sizeof *ends);
    if (!ends) return cli_failf("tokenize", "out of memory");
    if (eng_tok_split(tok, in, len, ends, n, &n, &err) != KDS_OK) {
        free(ends);
        return cli_fail("tokenize", &err);
    }
    for (int64_t i = 0, at = 0; i < n; at = (int64_t)ends[i++])
        print_json_string(stdout, in + at, ends[i] - (size_t)at);
    free(ends);
    return 0;
}

static const char *json_str(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* A conversation in JSON (OpenAI's message shape) to Kimi's chat format. */
static int do_chat(const eng_tokenizer *tok, const char *in, size_t len) {
    int rc = 0;
    eng_chat_msg *msgs = NULL;
    eng_chat_tool_call *calls = NULL;
    char *tools = NULL;
    int32_t *ids = NULL;
    cJSON *root = cJSON_ParseWithLength(in, len);
    const cJSON *list =
        cJSON_IsArray(root) ? root : cJSON_GetObjectItemCaseSensitive(root, "messages");
    if (!cJSON_IsArray(list)) {
        rc = cli_failf("tokenize", "--chat wants a JSON array of messages or an object with "
                                   "\"messages\"");
        goto out;
    }
    eng_chat_params p = eng_chat_default_params();
    if (cJSON_IsObject(root)) {
        const cJSON *tl = cJSON_GetObjectItemCaseSensitive(root, "tools");
        if (cJSON_IsArray(tl) && cJSON_GetArraySize(tl) > 0)
            p.tools_json = tools = cJSON_PrintUnformatted(tl);
        const cJSON *g = cJSON_GetObjectItemCaseSensitive(root, "add_generation_prompt");
        if (cJSON_IsBool(g)) p.add_generation_prompt = cJSON_IsTrue(g);
        p.default_system = json_str(root, "default_system");
        const cJSON *th = cJSON_GetObjectItemCaseSensitive(root, "thinking");
        if (cJSON_IsBool(th)) p.no_thinking = !cJSON_IsTrue(th);
        p.thinking_effort = json_str(root, "thinking_effort");
    }
    int n = cJSON_GetArraySize(list), n_calls = 0;
    const cJSON *m, *c;
    cJSON_ArrayForEach(m, list) {
        const cJSON *tc = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
        if (cJSON_IsArray(tc)) n_calls += cJSON_GetArraySize(tc);
    }
    msgs = calloc((size_t)n + 1, sizeof *msgs);
    calls = calloc((size_t)n_calls + 1, sizeof *calls);
    if (!msgs || !calls) {
        rc = cli_failf("tokenize", "out of memory");
        goto out;
    }
    int i = 0, k = 0;
    cJSON_ArrayForEach(m, list) {
        eng_chat_msg *e = &msgs[i++];
        e->role = json_str(m, "role");
        e->content = json_str(m, "content");
        e->name = json_str(m, "name");
        e->tool_call_id = json_str(m, "tool_call_id");
        e->reasoning = json_str(m, "reasoning_content");
        e->tool_calls = calls + k;
        cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(m, "tool_calls")) {
            const cJSON *f = cJSON_GetObjectItemCaseSensitive(c, "function");
            calls[k].id = json_str(c, "id");
            calls[k].arguments = json_str(f ? f : c, "arguments");
            calls[k].name = json_str(f ? f : c, "name");
            k++;
            e->n_tool_calls++;
        }
    }
    kds_err err = {0};
    int64_t cnt = 0;
    if (eng_chat_render(tok, msgs, n, &p, NULL, 0, &cnt, &err) != KDS_OK) {
        rc = cli_fail("tokenize", &err);
        goto out;
    }
    ids = malloc(((size_t)cnt + 1) * sizeof *ids);
    if (!ids || eng_chat_render(tok, msgs, n, &p, ids, cnt, &cnt, &err) != KDS_OK) {
        rc = ids ? cli_fail("tokenize", &err) : cli_failf("tokenize", "out of memory");
        goto out;
    }
    for (int64_t j = 0; j < cnt; j++)
        printf(j ? " %d" : "%d", ids[j]);
    putchar('\n');
out:
    free(ids);
    free(msgs);
    free(calls);
    free(tools);
    cJSON_Delete(root);
    return rc;
}

static int do_encode(const eng_tokenizer *tok, const char *in, size_t len, unsigned flags,
                     int64_t bench) {
    kds_err err = {0};
    int64_t n = 0;
    int32_t *ids = malloc((len + 1) * sizeof *ids); /* never more ids than bytes */
    double *mbps = bench ? calloc((size_t)bench, sizeof *mbps) : NULL;
    int rc = 0;
    if (!ids || (bench && !mbps)) {
        rc = cli_failf("tokenize", "out of memory for %zu bytes of text", len);
        goto out;
    }
    if (eng_tok_encode_ex(tok, in, len, flags, ids, (int64_t)len, &n, &err) != KDS_OK) {
        rc = cli_fail("tokenize", &err); /* also the warm-up of --bench */
        goto out;
    }
    if (bench) {
        for (int64_t r = 0; r < bench; r++) {
            double t0 = kds_now_s();
            if (eng_tok_encode_ex(tok, in, len, flags, ids, (int64_t)len, &n, &err) != KDS_OK) {
                rc = cli_fail("tokenize", &err);
                goto out;
            }
            double s = kds_now_s() - t0;
            mbps[r] = (double)len / 1e6 / (s > 0 ? s : 1e-9);
        }
        cli_sort_doubles(mbps, (size_t)bench);
        printf(
            "{\"impl\": \"kdaserve\", \"tokenizer\": \"%s\", \"bytes\": %zu, \"tokens\": %lld, "
            "\"repeats\": %lld, \"median_mbps\": %.3f, \"min_mbps\": %.3f, \"max_mbps\": %.3f}\n",
            eng_tok_kind(tok), len, (long long)n, (long long)bench, mbps[bench / 2], mbps[0],
            mbps[bench - 1]);
        goto out;
    }
    for (int64_t i = 0; i < n; i++)
        printf(i ? " %d" : "%d", ids[i]);
    putchar('\n');
out:
    free(ids);
    free(mbps);
    return rc;
}

int cmd_tokenize(int argc, char **argv) {
    enum {
        OPT_VOCAB = 256,
        OPT_PATTERN,
        OPT_SPECIALS,
        OPT_MODEL,
        OPT_ALLOW,
        OPT_DECODE,
        OPT_SKIP,
        OPT_SPLIT,
        OPT_BENCH,
        OPT_CHAT
    };
    static const struct option opts[] = {{"vocab", required_argument, 0, OPT_VOCAB},
                                         {"pattern", required_argument, 0, OPT_PATTERN},
                                         {"specials", required_argument, 0, OPT_SPECIALS},
                                         {"model", required_argument, 0, OPT_MODEL},
                                         {"allow-special", no_argument, 0, OPT_ALLOW},
                                         {"decode", no_argument, 0, OPT_DECODE},
                                         {"skip-special", no_argument, 0, OPT_SKIP},
                                         {"split", no_argument, 0, OPT_SPLIT},
                                         {"bench", required_argument, 0, OPT_BENCH},
                                         {"chat", no_argument, 0, OPT_CHAT},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *vocab = NULL, *pattern = NULL, *specials = NULL, *model = NULL;
    bool allow = false, decode = false, skip = false, split = false, chat = false;
    int64_t bench = 0;
    optind = 1;
    for (int o; (o = getopt_long(argc, argv, "h", opts, NULL)) != -1;) {
        switch (o) {
        case OPT_VOCAB: vocab = optarg; break;
        case OPT_PATTERN: pattern = optarg; break;
        case OPT_SPECIALS: specials = optarg; break;
        case OPT_MODEL: model = optarg; break;
        case OPT_ALLOW: allow = true; break;
        case OPT_DECODE: decode = true; break;
        case OPT_SKIP: skip = true; break;
        case OPT_SPLIT: split = true; break;
        case OPT_CHAT: chat = true; break;
        case OPT_BENCH:
            if (!cli_parse_i64(optarg, 1, 1000000, &bench))
                return cli_failf("tokenize", "--bench wants a count in 1..1000000, got '%s'",
                                 optarg);
            break;
        case 'h': tokenize_usage(stdout); return 0;
        default: return cli_usage_error("tokenize", NULL);
        }
    }
    if (optind < argc) return cli_failf("tokenize", "unexpected argument '%s'", argv[optind]);
    if (!!vocab == !!model)
        return cli_usage_error("tokenize", "give exactly one of --vocab FILE or --model DIR");
    if (vocab && !pattern)
        return cli_usage_error("tokenize", "--vocab needs --pattern (cl100k, o200k, kimi or none)");
    if (model && (pattern || specials))
        return cli_failf("tokenize", "--pattern and --specials go with --vocab, not --model");
    if (decode + split + chat + (bench > 0) > 1)
        return cli_failf("tokenize", "--decode, --split, --chat and --bench exclude each other");

    int rc = 0;
    kds_err err = {0};
    eng_tokenizer *own = NULL;
    eng_model *m = NULL;
    const eng_tokenizer *tok;
    size_t len = 0;
    char *in = NULL;
    if (vocab) {
        eng_tok_params p = eng_tok_default_params();
        p.pattern = pattern;
        p.specials_file = specials;
        if (eng_tok_load(vocab, &p, &own, &err) != KDS_OK) return cli_fail("tokenize", &err);
        tok = own;
    } else {
        eng_model_params mp = eng_model_default_params();
        mp.progress = true;
        mp.weights = ENG_WEIGHTS_MAPPED; /* the tokenizer alone: no copy of the weights */
        if (eng_model_load(model, &mp, &m, &err) != KDS_OK) return cli_fail("tokenize", &err);
        tok = eng_model_tokenizer(m);
    }
    in = read_all(stdin, &len);
    if (!in) {
        rc = cli_failf("tokenize", "cannot read stdin: %s",
                       errno ? strerror(errno) : "out of memory");
        goto out;
    }
    if (decode)
        rc = do_decode(tok, in, len, skip);
    else if (split)
        rc = do_split(tok, in, len);
    else if (chat)
        rc = do_chat(tok, in, len);
    else
        rc = do_encode(tok, in, len, allow ? ENG_TOK_ALLOW_SPECIAL : 0, bench);
    if (fflush(stdout) != 0 && !rc) rc = cli_failf("tokenize", "cannot write stdout");
out:
    free(in);
    eng_tok_free(own);
    eng_model_free(m);
    return rc;
}
