/*
 * fuzz_seeds.c - writes the seed corpora (tests/fuzz/corpus/<target>/) and
 * the regression inputs of known crashes (tests/fuzz/regress/<target>/)
 * from real files: the golden checkpoints' configs and the smallest golden
 * safetensors file (../shared/golden), models/default's config and the
 * first ranks and specials of its tokenizer, and files the project's own
 * writers make (nano models, saved states, a store's records and an
 * export file, the protocol's requests encoded both ways).
 *
 *   fuzz_seeds SOURCE_DIR OUT_DIR     (OUT_DIR: usually SOURCE_DIR/tests/fuzz)
 *
 * Deterministic but for the times inside session records; run it again
 * when a format changes and commit what changed. Not a fuzz target (it has
 * a main), built beside them.
 */
#include "fuzz_sess_fixture.h"

#include <cjson/cJSON.h>
#include <libwebsockets.h>

#include "eng_safetensors.h"
#include "web_internal.h"

static const char *src_dir, *out_dir;
static int n_written;

static void out_file(const char *sub, const char *target, const char *name, const void *p,
                     size_t n) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", out_dir, sub);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/%s/%s", out_dir, sub, target);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/%s/%s/%s", out_dir, sub, target, name);
    fz_write_file(path, p, n);
    n_written++;
}

static void seed(const char *target, const char *name, const void *p, size_t n) {
    out_file("corpus", target, name, p, n);
}

/* One byte of mode in front of a body. */
static void seed_mode(const char *sub, const char *target, const char *name, uint8_t mode,
                      const void *p, size_t n) {
    unsigned char *b = malloc(n + 1);
    if (!b) abort();
    b[0] = mode;
    memcpy(b + 1, p, n);
    out_file(sub, target, name, b, n + 1);
    free(b);
}

/* Parts joined by FZ_SEP, into corpus/ or regress/ (sub). */
static void seed_parts(const char *sub, const char *target, const char *name,
                       const fz_part *parts, int k) {
    size_t n = 0;
    for (int i = 0; i < k; i++) n += parts[i].n + FZ_SEP_LEN;
    unsigned char *b = malloc(n + 1), *q = b;
    if (!b) abort();
    for (int i = 0; i < k; i++) {
        if (i) {
            memcpy(q, FZ_SEP, FZ_SEP_LEN);
            q += FZ_SEP_LEN;
        }
        memcpy(q, parts[i].p, parts[i].n);
        q += parts[i].n;
    }
    out_file(sub, target, name, b, (size_t)(q - b));
    free(b);
}

static unsigned char *must_read(const char *path, size_t *n) {
    unsigned char *b = fz_read_file(path, n);
    if (!b) {
        fprintf(stderr, "fuzz_seeds: cannot read %s\n", path);
        exit(1);
    }
    return b;
}

static const char *src(const char *rel) {
    static char buf[4][4200];
    static int k;
    k = (k + 1) & 3;
    snprintf(buf[k], sizeof buf[k], "%s/%s", src_dir, rel);
    return buf[k];
}

/* ---- config and safetensors ---------------------------------------------- */

static void config_seeds(void) {
    const char *real[][2] = {{"../shared/golden/model/micro-kda/config.json", "golden-micro-kda"},
                             {"../shared/golden/model/micro-hybrid/config.json", "golden-micro-hybrid"},
                             {"../shared/golden/model-k3/micro-k3/config.json", "golden-micro-k3"},
                             {"models/default/config.json", "models-default"}};
    for (size_t i = 0; i < sizeof real / sizeof real[0]; i++) {
        size_t n;
        unsigned char *b = must_read(src(real[i][0]), &n);
        seed("config", real[i][1], b, n);
        free(b);
    }
    seed("config", "nano-kda", FZ_NANO_KDA, strlen(FZ_NANO_KDA));
    seed("config", "nano-hybrid", FZ_NANO_HYBRID, strlen(FZ_NANO_HYBRID));
    /* every preset as eng_config_to_json writes it (the 48B's, K3's, ...) */
    for (const char *const *p = eng_genmodel_preset_names(); *p; p++) {
        eng_config c;
        kds_err e = {0};
        if (eng_genmodel_preset(*p, &c, &e) != KDS_OK) continue;
        char *j = eng_config_to_json(&c);
        char name[64];
        snprintf(name, sizeof name, "preset-%s", *p);
        seed("config", name, j, strlen(j));
        free(j);
    }
}

static void safetensors_seeds(void) {
    size_t n;
    unsigned char *b = must_read(src("../shared/golden/kda/kda_decode_step.safetensors"), &n);
    seed("safetensors", "golden-kda-decode-step", b, n);
    free(b);
    /* every dtype, a 0-d and an empty tensor, metadata: what eng_st_write makes */
    static const float f[4] = {1, -2, 3.5f, 0};
    static const unsigned char u[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    eng_st_out_tensor t[] = {
        {"f32", ENG_ST_F32, 2, {2, 2}, f},    {"bf16", ENG_ST_BF16, 1, {4}, u},
        {"f16", ENG_ST_F16, 1, {2}, u},       {"i8", ENG_ST_I8, 1, {3}, u},
        {"u8.scale", ENG_ST_U8, 2, {1, 2}, u}, {"bool", ENG_ST_BOOL, 1, {1}, u},
        {"scalar", ENG_ST_I32, 0, {0}, u},    {"empty", ENG_ST_F64, 2, {0, 3}, u},
        {"i64", ENG_ST_I64, 1, {1}, u},       {"i16", ENG_ST_I16, 1, {2}, u},
    };
    const char *md[] = {"format", "pt", "path", "prefill", NULL};
    const char *path = fz_path(0, "dtypes.safetensors");
    kds_err e = {0};
    if (eng_st_write(path, t, sizeof t / sizeof t[0], md, &e) != KDS_OK) {
        fprintf(stderr, "fuzz_seeds: %s\n", e.msg);
        exit(1);
    }
    b = must_read(path, &n);
    seed("safetensors", "all-dtypes", b, n);
    free(b);
}

/* ---- models -------------------------------------------------------------- */

static void model_seed(const char *json, const char *name) {
    const char *dir = fz_subdir(0, name);
    fz_nano_write(json, dir);
    char p1[4200], p2[4200];
    snprintf(p1, sizeof p1, "%s/config.json", dir);
    snprintf(p2, sizeof p2, "%s/model.safetensors", dir);
    size_t n1, n2;
    unsigned char *c = must_read(p1, &n1), *w = must_read(p2, &n2);
    fz_part parts[2] = {{c, n1}, {w, n2}};
    seed_parts("corpus", "model", name, parts, 2);
    seed("safetensors", name, w, n2);
    free(c);
    free(w);
}

/* A nano model's weights under a config of 256 MoE layers of 65536
 * experts: eng_model_load once listed all 50M tensors, twice, before
 * finding the first missing (50 s; the target's -timeout is 10). */
static void model_regress(void) {
    const char *dir = fz_subdir(0, "nano-kda");
    char p[4200];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    size_t n;
    unsigned char *w = must_read(p, &n);
    cJSON *c = cJSON_Parse(FZ_NANO_KDA), *kda = cJSON_CreateArray();
    if (!c || !kda) abort();
    for (int l = 1; l <= 256; l++) cJSON_AddItemToArray(kda, cJSON_CreateNumber(l));
    cJSON_ReplaceItemInObject(cJSON_GetObjectItem(c, "linear_attn_config"), "kda_layers", kda);
    cJSON_ReplaceItemInObject(c, "num_hidden_layers", cJSON_CreateNumber(256));
    cJSON_ReplaceItemInObject(c, "num_experts", cJSON_CreateNumber(65536));
    char *j = cJSON_PrintUnformatted(c);
    fz_part parts[2] = {{(const uint8_t *)j, strlen(j)}, {w, n}};
    seed_parts("regress", "model", "config-implies-50M-tensors", parts, 2);
    free(j);
    cJSON_Delete(c);
    /* The same weights behind a header one byte longer (a trailing space):
     * every tensor starts at an odd byte, and the loader once converted a
     * BF16 norm through misaligned uint16_t loads (UBSan). */
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)w[i] << (8 * i);
    unsigned char *odd = malloc(n + 1);
    if (!odd || hlen > n - 8) abort();
    for (int i = 0; i < 8; i++) odd[i] = (unsigned char)((hlen + 1) >> (8 * i));
    memcpy(odd + 8, w + 8, (size_t)hlen);
    odd[8 + hlen] = ' ';
    memcpy(odd + 9 + hlen, w + 8 + hlen, n - 8 - (size_t)hlen);
    const fz_part odd_parts[2] = {{(const uint8_t *)FZ_NANO_KDA, strlen(FZ_NANO_KDA)},
                                  {odd, n + 1}};
    seed_parts("regress", "model", "tensors-at-odd-bytes", odd_parts, 2);
    free(odd);
    free(w);
}

/* ---- tokenizer ----------------------------------------------------------- */

/* The real rank file's first n ranks (its first 256 are the single bytes,
 * then merges), and its tokenizer_config.json with the first k specials
 * renumbered after them (the chat template and long strings left out). */
static void tokenizer_seeds(void) {
    size_t n;
    unsigned char *ranks = must_read(src("models/default/tiktoken.model"), &n);
    size_t cut = 0;
    for (int lines = 0; cut < n && lines < 320; cut++)
        if (ranks[cut] == '\n') lines++;
    unsigned char *js = must_read(src("models/default/tokenizer_config.json"), &n);
    cJSON *root = cJSON_ParseWithLength((const char *)js, n), *small = cJSON_CreateObject();
    if (!root || !small) abort();
    cJSON *dec = cJSON_AddObjectToObject(small, "added_tokens_decoder");
    const cJSON *atd = cJSON_GetObjectItemCaseSensitive(root, "added_tokens_decoder"), *it;
    int k = 0;
    cJSON_ArrayForEach(it, atd) {
        if (k == 12) break;
        char id[16];
        snprintf(id, sizeof id, "%d", 320 + k++);
        cJSON_AddItemToObject(dec, id, cJSON_Duplicate(it, true));
    }
    cJSON_ArrayForEach(it, root) {
        if (!strcmp(it->string, "added_tokens_decoder")) continue;
        if (cJSON_IsString(it) && strlen(it->valuestring) > 256) continue;
        if (cJSON_IsObject(it) || cJSON_IsArray(it)) continue;
        cJSON_AddItemToObject(small, it->string, cJSON_Duplicate(it, true));
    }
    const char *texts[][2] = {
        {"plain", "Hello, world! It's 2026: kdaserve's tokenizer  test\n\tdone."},
        {"utf8", "na\xc3\xafve caf\xc3\xa9 \xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c "
                 "\xf0\x9f\x98\x80 \xd0\xbf\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82 12345"},
        {"invalid", "ok \xff\xfe bad \xc3 cut \xed\xa0\x80 surrogate \xf4\x90\x80\x80 end"},
        {"specials", "<|im_user|>user<|im_middle|>hi<|im_end|>[EOS] <|reserved_token_400|>"},
    };
    const char *patterns[] = {"kimi", "cl100k", "o200k", "none"};
    for (size_t p = 0; p < sizeof patterns / sizeof patterns[0]; p++) {
        cJSON_DeleteItemFromObjectCaseSensitive(small, "kdaserve_pattern");
        if (p) cJSON_AddStringToObject(small, "kdaserve_pattern", patterns[p]);
        char *cfg = cJSON_Print(small);
        for (size_t t = 0; t < sizeof texts / sizeof texts[0]; t++) {
            if (p && t != p % 4 && t != 3) continue; /* every text once, specials for each */
            fz_part parts[3] = {{ranks, cut},
                                {(const uint8_t *)cfg, strlen(cfg)},
                                {(const uint8_t *)texts[t][1], strlen(texts[t][1])}};
            char name[64];
            snprintf(name, sizeof name, "%s-%s", patterns[p], texts[t][0]);
            seed_parts("corpus", "tokenizer", name, parts, 3);
        }
        free(cfg);
    }
    cJSON_Delete(root);
    cJSON_Delete(small);
    free(js);
    free(ranks);
}

/* ---- sequence states ----------------------------------------------------- */

static void state_seeds(void) {
    eng_model *m[2] = {fz_nano_load(FZ_NANO_KDA, "s-kda"), fz_nano_load(FZ_NANO_HYBRID, "s-hyb")};
    const char *mname[2] = {"kda", "hybrid"};
    for (int w = 0; w < 2; w++) {
        eng_ctx *ctx = fz_ctx(m[w]);
        eng_seq *s = NULL;
        kds_err e = {0};
        if (eng_seq_create(m[w], 9, &s, &e) != KDS_OK) abort();
        char name[64];
        size_t n = eng_seq_state_bytes(s);
        unsigned char *b = malloc(n);
        if (!b || eng_seq_state_save(s, b, n, &e) != KDS_OK) abort();
        /* the 0-token state: for the hybrid model, issue 16's crash (its
         * MLA caches are not allocated at position 0) */
        snprintf(name, sizeof name, "%s-0-tokens", mname[w]);
        seed_mode("corpus", "state", name, (uint8_t)w, b, n);
        if (w == 1) seed_mode("regress", "state", "hybrid-0-token-state", 1, b, n);
        free(b);
        const int32_t ids[6] = {1, 5, 9, 2, 7, 3};
        if (eng_prefill(ctx, s, ids, 6, NULL, NULL, NULL, &e) != KDS_OK) abort();
        n = eng_seq_state_bytes(s);
        b = malloc(n);
        if (!b || eng_seq_state_save(s, b, n, &e) != KDS_OK) abort();
        snprintf(name, sizeof name, "%s-6-tokens", mname[w]);
        seed_mode("corpus", "state", name, (uint8_t)w, b, n);
        free(b);
        n = eng_seq_fixed_bytes(s);
        b = malloc(n);
        if (!b || eng_seq_save_fixed(s, b, n, &e) != KDS_OK) abort();
        snprintf(name, sizeof name, "%s-6-tokens-fixed", mname[w]);
        seed_mode("corpus", "state", name, (uint8_t)(w | 2), b, n);
        if (w == 1) {
            /* a fixed part claiming 2^28 rows (12 GiB of a nano model's MLA
             * cache): address space only, until the fuzz target cloned it
             * (the clone copies every row) and went past its memory limit */
            const uint64_t claim = (uint64_t)1 << 28;
            for (int i = 0; i < 8; i++) b[16 + i] = (unsigned char)(claim >> (8 * i));
            seed_mode("regress", "state", "hybrid-fixed-claims-12GiB-of-rows", 1 | 2, b, n);
        }
        free(b);
        if (w == 1) { /* rows [1, 4) behind their two range bytes */
            size_t tb = eng_seq_mla_token_bytes(s);
            n = 2 + 3 * tb;
            b = malloc(n);
            if (!b || eng_seq_save_mla(s, 1, 4, b + 2, n - 2, &e) != KDS_OK) abort();
            b[0] = 1, b[1] = 4;
            seed_mode("corpus", "state", "hybrid-mla-rows-1-4", 1 | 4, b, n);
            free(b);
        }
        eng_seq_free(s);
        eng_ctx_free(ctx);
        eng_model_free(m[w]);
    }
}

/* ---- session records and export ------------------------------------------ */

static void snapshot_seeds(void) {
    fz_fixture fx;
    fz_fixture_make(&fx, "seeds");
    size_t n;
    unsigned char *x = must_read(fx.export_path, &n);
    seed_mode("corpus", "snapshot", "export", 0, x, n);
    seed_mode("corpus", "snapshot", "export-fix", 0x80, x, n);
    free(x);
    const char *names[] = {"", "snapshot", "chunk", "session", "turn"};
    for (int mode = 1; mode <= 4; mode++) {
        fz_slot sl = fz_fixture_slot(&fx, mode);
        void *rec;
        kds_err e = {0};
        if (sess__raw_get(fx.st, sl.db, sl.key, sl.key_len, &rec, &n, &e) != KDS_OK) {
            fprintf(stderr, "fuzz_seeds: %s\n", e.msg);
            exit(1);
        }
        char name[64];
        seed_mode("corpus", "snapshot", names[mode], (uint8_t)mode, rec, n);
        snprintf(name, sizeof name, "%s-fix", names[mode]);
        seed_mode("corpus", "snapshot", name, (uint8_t)(mode | 0x80), rec, n);
        free(rec);
    }
    sess_close(fx.st);
    eng_ctx_free(fx.ctx);
    eng_model_free(fx.m);
}

/* ---- the protocol -------------------------------------------------------- */

static void web_seeds(void) {
    /* docs/protocol.md's requests */
    const char *reqs[] = {
        "{\"id\":1,\"op\":\"auth\",\"token\":\"0123456789abcdef0123\"}",
        "{\"id\":2,\"op\":\"list\"}",
        "{\"id\":3,\"op\":\"create\",\"session\":\"notes\",\"system\":\"Be brief.\",\"mode\":\"chat\"}",
        "{\"id\":4,\"op\":\"open\",\"session\":\"notes\",\"last_turns\":3}",
        "{\"id\":5,\"op\":\"generate\",\"session\":\"notes\",\"prompt\":\"Hi \\u00e9\\ud83d\\ude00\","
        "\"max_tokens\":200,\"temperature\":0.7,\"top_p\":0.95,\"top_k\":40,\"min_p\":0.05,"
        "\"repeat_penalty\":1.1,\"seed\":42,\"ignore_eos\":false,\"stop\":[\"\\n\\n\"]}",
        "{\"id\":\"g-7\",\"op\":\"cancel\",\"target\":5}",
        "{\"id\":6,\"op\":\"fork\",\"session\":\"notes\",\"name\":\"notes-b\"}",
        "{\"id\":7,\"op\":\"restore\",\"snapshot\":12,\"name\":null}",
        "{\"id\":8,\"op\":\"history\",\"session\":\"notes\",\"limit\":-1.5e3}",
        "{\"id\":[1,{\"a\":[true,false,null]}],\"op\":\"stats\"}  \n",
    };
    for (size_t i = 0; i < sizeof reqs / sizeof reqs[0]; i++) {
        char name[32];
        snprintf(name, sizeof name, "json-%zu", i);
        seed_mode("corpus", "web_codec", name, 0, reqs[i], strlen(reqs[i]));
        kds_err e = {0};
        cJSON *o = web__parse(reqs[i], strlen(reqs[i]), false, &e);
        if (!o) {
            fprintf(stderr, "fuzz_seeds: request %zu: %s\n", i, e.msg);
            exit(1);
        }
        size_t n;
        unsigned char *f = web__encode(o, true, &n);
        snprintf(name, sizeof name, "msgpack-%zu", i);
        seed_mode("corpus", "web_codec", name, 1, f + LWS_PRE, n);
        free(f);
        cJSON_Delete(o);
    }
    /* issue 16's known crashes: an empty msgpack string as the whole frame,
     * and NULs hidden in a JSON op and session name */
    seed_mode("regress", "web_codec", "web-msgpack-empty-str-a0", 1, "\xa0", 1);
    const char *nul_op = "{\"id\":1,\"op\":\"li\\u0000st\"}";
    const char *nul_name = "{\"id\":2,\"op\":\"open\",\"session\":\"notes\\u0000../x\"}";
    seed_mode("regress", "web_codec", "web-json-nul-op", 0, nul_op, strlen(nul_op));
    seed_mode("regress", "web_codec", "web-json-nul-session", 0, nul_name, strlen(nul_name));
    /* found by the fuzz target: JSON requests the msgpack form refuses */
    const char *limits[][2] = {
        {"web-json-limits-empty-key", "{\"\":1,\"id\":1,\"op\":\"list\"}"},
        {"web-json-limits-long-key", "{\"id\":1,\"op\":\"list\",\"k0123456789012345678901234567"
                                     "8901234567890123456789012345678901234567\":0}"},
        {"web-json-limits-depth", "{\"id\":[[[[[[[[[[1]]]]]]]]]],\"op\":\"list\"}"},
        {"web-json-limits-inf", "{\"id\":1e999,\"op\":\"list\"}"},
    };
    for (size_t i = 0; i < sizeof limits / sizeof limits[0]; i++)
        seed_mode("regress", "web_codec", limits[i][0], 0, limits[i][1], strlen(limits[i][1]));
}

/* Bodies of the OpenAI-compatible endpoints (docs/http-api.md): byte 0
 * bit 0 is the endpoint (0 chat, 1 completions). */
static void http_api_seeds(void) {
    static const struct { uint8_t route; const char *body; } bodies[] = {
        {0, "{\"model\":\"default\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}]}"},
        {0, "{\"model\":\"default\",\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
            "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Tell me a story\"}]},"
            "{\"role\":\"assistant\",\"content\":\"Once\"},{\"role\":\"user\",\"content\":\"go on\"}],"
            "\"stream\":true,\"stream_options\":{\"include_usage\":true},\"max_tokens\":16,"
            "\"temperature\":0.7,\"top_p\":0.9,\"seed\":42,\"stop\":[\"\\n\\n\",\"The end\"]}"},
        {0, "{\"model\":\"default\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
            "\"max_completion_tokens\":3,\"session\":\"chat-1\",\"n\":1,\"ignore_eos\":false}"},
        {1, "{\"model\":\"default\",\"prompt\":\"Once upon a time\",\"max_tokens\":8}"},
        {1, "{\"model\":\"default\",\"prompt\":\"\",\"stop\":\"\\n\",\"top_k\":40,\"min_p\":0.05,"
            "\"repeat_penalty\":1.1,\"presence_penalty\":0.5,\"frequency_penalty\":-0.5}"},
        {1, "{\"model\":\"other\",\"prompt\":\"x\"}"},
    };
    for (size_t i = 0; i < sizeof bodies / sizeof bodies[0]; i++) {
        char name[32];
        snprintf(name, sizeof name, "body-%zu", i);
        seed_mode("corpus", "http_api", name, bodies[i].route, bodies[i].body,
                  strlen(bodies[i].body));
    }
    /* found by this target: the unknown-model message cut the name at 100
     * bytes inside a character (invalid UTF-8 in the JSON error) */
    char a99[100], cut[256];
    memset(a99, 'a', 99);
    a99[99] = 0;
    snprintf(cut, sizeof cut, "{\"model\":\"%s\xc3\xa9\",\"prompt\":\"x\"}", a99);
    seed_mode("regress", "http_api", "model-name-cut-inside-a-character", 1, cut, strlen(cut));
}

static void auth_seeds(void) {
    const char *files[][2] = {
        {"two-tenants", "# kdaserve auth file\nalice-token-0123456789 alice\n\n"
                        "   bob_token_abcdefghijklmnop   bob-2  \n"},
        {"crlf", "0123456789abcdef0123456789abcdef team_a\r\n#c\r\nZYXWVUTSRQPONMLKJIHG b\r\n"},
        {"one-no-newline", "!\"#$%&'()*+,-./0123456789:;<=>?@ x"},
        {"bad-short-token", "short tenant\n"},
        {"bad-three-fields", "0123456789abcdef0123 alice extra\n"},
    };
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++)
        seed("auth", files[i][0], files[i][1], strlen(files[i][1]));
    /* found by the fuzz target: a token of control characters and non-ASCII
     * bytes (the format says printable), and a NUL that ends a comment line
     * early for fgets's strlen, so the rest of that 1023-byte read counts as
     * its own line: a token hidden behind a comment */
    const char ctl[] = "token\x01\x7f\xc3\xa9-0123456789 alice\n";
    out_file("regress", "auth", "web-auth-printable-control-bytes", ctl, sizeof ctl - 1);
    char nul[1200];
    size_t n = 0;
    nul[n++] = '#', nul[n++] = '\0';
    while (n < 1023) nul[n++] = 'x';
    const char tail[] = "smuggled-token-0123456789 mallory\n";
    memcpy(nul + n, tail, sizeof tail - 1);
    out_file("regress", "auth", "web-auth-nul-comment-hides-a-token", nul, n + sizeof tail - 1);
}

/* Every key eng_config_to_json writes, for libFuzzer's -dict. */
static void dictionaries(void) {
    eng_config c;
    kds_err e = {0};
    if (eng_genmodel_preset("kimi-linear-48b", &c, &e) != KDS_OK) abort();
    char *j = eng_config_to_json(&c);
    cJSON *root = cJSON_Parse(j);
    char path[4200];
    snprintf(path, sizeof path, "%s/dict", out_dir);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/dict/config.dict", out_dir);
    FILE *f = fopen(path, "w");
    if (!f || !root) abort();
    fprintf(f, "# config.json keys (written by fuzz_seeds from eng_config_to_json)\n");
    const cJSON *stack[8] = {root};
    int sp = 1;
    while (sp) {
        const cJSON *o = stack[--sp], *it;
        cJSON_ArrayForEach(it, o) {
            if (it->string) fprintf(f, "\"\\\"%s\\\"\"\n", it->string);
            if (cJSON_IsObject(it) && sp < 8) stack[sp++] = it;
        }
    }
    fprintf(f, "\"null\"\n\"true\"\n\"false\"\n\"kimi_k3\"\n\"text_config\"\n"
               "\"quantization_config\"\n\"compressed-tensors\"\n\"mxfp4-pack-quantized\"\n");
    fclose(f);
    cJSON_Delete(root);
    free(j);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s SOURCE_DIR OUT_DIR\n", argv[0]);
        return 2;
    }
    src_dir = argv[1];
    out_dir = argv[2];
    config_seeds();
    safetensors_seeds();
    model_seed(FZ_NANO_KDA, "nano-kda");
    model_seed(FZ_NANO_HYBRID, "nano-hybrid");
    model_regress();
    tokenizer_seeds();
    state_seeds();
    snapshot_seeds();
    web_seeds();
    auth_seeds();
    http_api_seeds();
    dictionaries();
    printf("fuzz_seeds: wrote %d files under %s\n", n_written, out_dir);
    return 0;
}
