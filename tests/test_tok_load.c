/*
 * Loading tokenizers: rank files (every malformed line refused with
 * FILE:LINE), special tokens (three JSON layouts, presets, collisions,
 * longest match), a model directory in Kimi's layout (tiktoken.model +
 * tokenizer_config.json) picked up by eng_model_load, and the `kdaserve
 * tokenize` command end to end.
 */
#include <sys/wait.h>

#include "eng_genmodel.h"
#include "test_model_util.h"
#include "test_tok_helpers.h"

#define KDASERVE KDS_BINARY_DIR "/kdaserve"
#define KDASERVE_TOK KDASERVE " tokenize"

/* The 256 single bytes as rank lines, ranks 0..255, then `extra`. */
static char *byte_ranks(const char *extra) {
    size_t cap = 256 * 12 + strlen(extra) + 1, n = 0;
    char *s = malloc(cap);
    FILE *f = fmemopen(s, cap, "w");
    for (int b = 0; b < 256; b++) {
        unsigned char c = (unsigned char)b;
        tok_b64(f, &c, 1);
        fprintf(f, " %d\n", b);
    }
    fputs(extra, f);
    n = (size_t)ftell(f);
    fclose(f);
    s[n] = '\0';
    return s;
}

static char *write_tmp(const char *text) {
    char *path = strdup("/tmp/kds_tok_file_XXXXXX");
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return path;
}

/* Load `text` as a rank file; return the status and fill msg. */
static kds_status load_text(const char *text, const char *pattern, char *msg, size_t cap,
                            char **path_out) {
    char *path = write_tmp(text);
    eng_tok_params p = eng_tok_default_params();
    p.pattern = pattern;
    p.no_specials = true;
    eng_tokenizer *t = NULL;
    kds_err err = {0};
    kds_status st = eng_tok_load(path, &p, &t, &err);
    snprintf(msg, cap, "%s", err.msg);
    eng_tok_free(t);
    unlink(path);
    if (path_out)
        *path_out = path;
    else
        free(path);
    return st;
}

Test(tok_load, malformed_rank_lines_name_file_and_line) {
    const struct {
        const char *extra;
        const char *why;
    } bad[] = {
        {"YWI=\n", "found 1 field"},
        {"YWI= 256 7\n", "found 3 fields"},
        {"YW!= 256\n", "is not base64"},
        {"YWI 256\n", "is not base64"},
        {"YWI= -1\n", "is not an integer"},
        {"YWI= 25x\n", "is not an integer"},
        {"YWI= 99999999999\n", "is not an integer"},
        {"YWI= 16777216\n", "is not an integer"},
        {"YWI= 12\n", "rank 12 was already given on line 13"},
        {"YWI= 256\nYWI= 257\n", "repeats the token of rank 256"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *text = byte_ranks(bad[i].extra), msg[512], *path;
        kds_status st = load_text(text, "none", msg, sizeof msg, &path);
        cr_expect_eq(st, KDS_BAD_FORMAT, "case %zu: %s", i, msg);
        char where[300];
        /* the bad line is the first after the 256 byte lines, or the second */
        snprintf(where, sizeof where, "%s:%d: ", path, i == 9 ? 258 : 257);
        cr_expect(strstr(msg, where), "case %zu: '%s' does not name %s", i, msg, where);
        cr_expect(strstr(msg, bad[i].why), "case %zu: '%s' does not say '%s'", i, msg, bad[i].why);
        free(path);
        free(text);
    }
}

Test(tok_load, missing_byte_and_empty_file_are_refused) {
    char msg[512];
    char *text = byte_ranks("");
    char *line = strstr(text, "QQ== 65\n"); /* drop byte 'A' */
    memmove(line, line + 8, strlen(line + 8) + 1);
    cr_expect_eq(load_text(text, "none", msg, sizeof msg, NULL), KDS_BAD_FORMAT);
    cr_expect(strstr(msg, "0x41"), "names the byte: %s", msg);
    free(text);
    cr_expect_eq(load_text("", "none", msg, sizeof msg, NULL), KDS_BAD_FORMAT);
    cr_expect(strstr(msg, "no ranks"), "%s", msg);
    cr_expect_eq(load_text("\n\n", "none", msg, sizeof msg, NULL), KDS_BAD_FORMAT);
    eng_tok_params p = eng_tok_default_params();
    eng_tokenizer *t = NULL;
    kds_err err = {0};
    cr_expect_eq(eng_tok_load("/nonexistent/ranks", &p, &t, &err), KDS_NOT_FOUND);
    cr_expect(strstr(err.msg, "/nonexistent/ranks"), "%s", err.msg);
    cr_expect_null(t);
}

/* What tiktoken's own loader accepts (blank lines, CRLF, other whitespace
 * between the fields, ranks in any order or with gaps) loads. */
Test(tok_load, tolerant_where_tiktoken_is) {
    char *text = byte_ranks("\r\nYWI=\t300\r\n\nYWJj   299\n");
    char msg[512];
    cr_expect_eq(load_text(text, "cl100k", msg, sizeof msg, NULL), KDS_OK, "%s", msg);
    char *path = write_tmp(text);
    eng_tokenizer *t = tok_load(path, "cl100k", false);
    cr_expect_eq(eng_tok_vocab(t), 301);
    size_t len;
    eng_tok_piece(t, 280, &len);
    cr_expect_eq(len, 0, "a gap decodes to nothing");
    tok_ids ids = tok_encode(t, "abc ab", 6, 0);
    cr_expect(ids.n == 3 && ids.v[0] == 299 && ids.v[1] == ' ' && ids.v[2] == 300,
              "abc ab -> [abc][ ][ab]: %lld ids", (long long)ids.n);
    free(ids.v);
    eng_tok_free(t);
    unlink(path);
    free(path);
    free(text);
    cr_expect_eq(load_text("", "cl200k", msg, sizeof msg, NULL), KDS_INVALID_ARG);
}

/* ---- specials ---- */

static eng_tokenizer *with_specials(const char *ranks, const char *json, kds_status want) {
    char *rp = write_tmp(ranks), *jp = write_tmp(json);
    eng_tok_params p = eng_tok_default_params();
    p.pattern = "cl100k";
    p.specials_file = jp;
    eng_tokenizer *t = NULL;
    kds_err err = {0};
    cr_expect_eq(eng_tok_load(rp, &p, &t, &err), want, "%s: %s", json, err.msg);
    unlink(rp);
    unlink(jp);
    free(rp);
    free(jp);
    return t;
}

Test(tok_load, specials_from_three_json_layouts) {
    char *r = byte_ranks("");
    const char *layouts[] = {
        "{\"pat_str\": \"x\", \"special_tokens\": {\"<|a|>\": 300, \"<|a|>x\": 301}}",
        "{\"added_tokens_decoder\": {\"300\": {\"content\": \"<|a|>\", \"special\": true},"
        " \"301\": {\"content\": \"<|a|>x\"}}, \"eos_token\": {\"content\": \"<|a|>\"}}",
        "{\"<|a|>\": 300, \"<|a|>x\": 301}"};
    for (int l = 0; l < 3; l++) {
        eng_tokenizer *t = with_specials(r, layouts[l], KDS_OK);
        if (!t) continue;
        cr_expect_eq(eng_tok_special_id(t, "<|a|>"), 300, "layout %d", l);
        cr_expect_eq(eng_tok_special_id(t, "<|a|>x"), 301, "layout %d", l);
        cr_expect(eng_tok_is_special(t, 301) && !eng_tok_is_special(t, 'a'));
        if (l == 1) cr_expect_eq(eng_tok_eos(t), 300, "eos_token of a tokenizer_config");
        /* not allowed: ordinary text; allowed: the longest name at a byte wins */
        const char *s = "q<|a|>xy<|a|";
        tok_ids plain = tok_encode(t, s, strlen(s), 0);
        for (int64_t i = 0; i < plain.n; i++)
            cr_expect_lt(plain.v[i], 256);
        tok_ids sp = tok_encode(t, s, strlen(s), ENG_TOK_ALLOW_SPECIAL);
        cr_expect(sp.n == 7 && sp.v[0] == 'q' && sp.v[1] == 301 && sp.v[2] == 'y' && sp.v[3] == '<',
                  "layout %d: %lld ids", l, (long long)sp.n);
        free(plain.v);
        free(sp.v);
        eng_tok_free(t);
    }
    cr_expect_null(with_specials(r, "{\"<|a|>\": 65}", KDS_INVALID_ARG), "collides with a rank");
    cr_expect_null(with_specials(r, "{\"<|a|>\": 300, \"<|b|>\": 300}", KDS_INVALID_ARG));
    cr_expect_null(with_specials(r, "{\"<|a|>\": 300, \"<|b|>\": 301, \"<|a|>\": 302}",
                                 KDS_INVALID_ARG),
                   "a name given twice");
    cr_expect_null(with_specials(r, "{\"<|a|>\": \"x\"}", KDS_BAD_FORMAT));
    cr_expect_null(with_specials(r, "{\"<|a|>\": 1.5}", KDS_BAD_FORMAT));
    cr_expect_null(with_specials(r, "{\"\": 300}", KDS_INVALID_ARG), "empty name");
    cr_expect_null(with_specials(r, "[1, 2]", KDS_BAD_FORMAT));
    cr_expect_null(with_specials(r, "{\"added_tokens_decoder\": {\"x\": {}}}", KDS_BAD_FORMAT));
    free(r);
}

Test(tok_load, preset_specials) {
    char *r = byte_ranks("YWI= 256\n"), *path = write_tmp(r);
    eng_tokenizer *t = tok_load(path, "cl100k", true);
    cr_expect_eq(eng_tok_special_id(t, "<|endoftext|>"), 100257);
    cr_expect_eq(eng_tok_special_id(t, "<|endofprompt|>"), 100276);
    cr_expect_eq(eng_tok_eos(t), 100257);
    cr_expect(eng_tok_is_stop(t, 100257));
    cr_expect_eq(eng_tok_vocab(t), 100277);
    eng_tok_free(t);
    /* Kimi's sit after the ranks (here 257 of them), 256 slots */
    t = tok_load(path, "kimi", true);
    cr_expect_str_eq(eng_tok_kind(t), "tiktoken/kimi");
    cr_expect_eq(eng_tok_vocab(t), 257 + 256);
    cr_expect_eq(eng_tok_special_id(t, "[BOS]"), 257);
    cr_expect_eq(eng_tok_bos(t), 257);
    cr_expect_eq(eng_tok_special_id(t, "<|im_end|>"), 259);
    cr_expect_eq(eng_tok_special_id(t, "<|im_middle|>"), 274);
    cr_expect_eq(eng_tok_special_id(t, "[PAD]"), 512);
    cr_expect_eq(eng_tok_special_id(t, "<|reserved_token_262|>"), 262);
    cr_expect(eng_tok_is_stop(t, 258) && eng_tok_is_stop(t, 259), "[EOS] and <|im_end|> stop");
    eng_tok_free(t);
    unlink(path);
    free(path);
    free(r);
}

/* ---- a model directory in Kimi's layout ---- */

static char *tiny_model(int bos, int eos) {
    char *dir = tmu_mkdtemp();
    eng_config c;
    kds_err err = {0};
    cr_assert_eq(eng_genmodel_preset("tiny", &c, &err), KDS_OK, "%s", err.msg);
    c.bos_token_id = bos;
    c.eos_token_id = eos;
    cr_assert_eq(eng_genmodel_write(&c, 1, KERN_BF16, dir, false, &err), KDS_OK, "%s", err.msg);
    return dir;
}

static void put(const char *dir, const char *name, const char *text) {
    char *p = tmu_path(dir, name);
    cr_assert(tmu_write(p, text, strlen(text)));
    free(p);
}

static const char KIMI_CONFIG[] =
    "{\"tokenizer_class\": \"TikTokenTokenizer\", \"bos_token\": \"[BOS]\","
    " \"eos_token\": \"[EOS]\", \"added_tokens_decoder\": {"
    "\"300\": {\"content\": \"[BOS]\", \"special\": true},"
    "\"301\": {\"content\": \"[EOS]\", \"special\": true},"
    "\"302\": {\"content\": \"<|im_end|>\", \"special\": true},"
    "\"303\": {\"content\": \"<|im_user|>\", \"special\": true}}}";

/* 256 bytes + merges up to rank 299 (t h e and friends) */
static char *model_ranks(void) {
    char extra[4096] = "";
    const char *merges[] = {"th", "he", "the", " t", " the", "in", "ing", "er"};
    int rank = 256;
    for (size_t i = 0; i < sizeof merges / sizeof merges[0]; i++) {
        char line[64];
        FILE *f = fmemopen(line, sizeof line, "w");
        tok_b64(f, (const unsigned char *)merges[i], strlen(merges[i]));
        fprintf(f, " %d\n", rank++);
        long n = ftell(f);
        fclose(f);
        line[n] = '\0';
        strcat(extra, line);
    }
    for (; rank < 300; rank++) { /* filler tokens: three-byte runs of '~' + rank */
        unsigned char tk[3] = {'~', (unsigned char)rank, (unsigned char)(rank >> 8)};
        char line[64];
        FILE *f = fmemopen(line, sizeof line, "w");
        tok_b64(f, tk, 3);
        fprintf(f, " %d\n", rank);
        long n = ftell(f);
        fclose(f);
        line[n] = '\0';
        strcat(extra, line);
    }
    return byte_ranks(extra);
}

Test(tok_model, kimi_layout_loads_with_the_model, .timeout = 60) {
    char *dir = tiny_model(300, 302);
    char *r = model_ranks();
    put(dir, "tiktoken.model", r);
    put(dir, "tokenizer_config.json", KIMI_CONFIG);
    eng_model *m = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_model_load(dir, NULL, &m, &err), KDS_OK, "%s", err.msg);
    const eng_tokenizer *t = eng_model_tokenizer(m);
    cr_expect_str_eq(eng_tok_kind(t), "tiktoken/kimi");
    int vocab = eng_model_config(m)->vocab_size;
    cr_expect_eq(eng_tok_vocab(t), vocab);
    cr_expect_eq(eng_tok_bos(t), 300);
    cr_expect_eq(eng_tok_eos(t), 302);
    cr_expect(eng_tok_is_stop(t, 302) && eng_tok_is_stop(t, 301), "<|im_end|> and [EOS] stop");
    cr_expect_eq(eng_tok_special_id(t, "<|im_user|>"), 303);
    char name[48];
    snprintf(name, sizeof name, "<|reserved_token_%d|>", vocab - 1);
    cr_expect_eq(eng_tok_special_id(t, name), vocab - 1, "unnamed ids are reserved specials");
    tok_ids ids = tok_encode(t, "the thing", 9, 0);
    /* " thing": "th" (256) merges before " t" (259), then "in", "ing" */
    cr_expect(ids.n == 4 && ids.v[0] == 258 && ids.v[1] == ' ' && ids.v[2] == 256 &&
                  ids.v[3] == 262,
              "the thing -> [the][ ][th][ing]: %lld ids", (long long)ids.n);
    free(ids.v);
    eng_model_free(m);

    /* kdaserve_pattern picks another preset */
    put(dir, "tokenizer_config.json",
        "{\"kdaserve_pattern\": \"cl100k\", \"added_tokens_decoder\": {}}");
    cr_assert_eq(eng_model_load(dir, NULL, &m, &err), KDS_OK, "%s", err.msg);
    cr_expect_str_eq(eng_tok_kind(eng_model_tokenizer(m)), "tiktoken/cl100k");
    eng_model_free(m);
    put(dir, "tokenizer_config.json", "{\"kdaserve_pattern\": \"nope\"}");
    cr_expect_eq(eng_model_load(dir, NULL, &m, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "nope") && strstr(err.msg, dir), "%s", err.msg);

    /* named specials must fit the vocabulary */
    put(dir, "tokenizer_config.json",
        "{\"added_tokens_decoder\": {\"100000\": {\"content\": \"[X]\"}}}");
    cr_expect_eq(eng_model_load(dir, NULL, &m, &err), KDS_MISMATCH);
    cr_expect(strstr(err.msg, "tokenizer_config.json") && strstr(err.msg, "100000"), "%s", err.msg);
    /* a rank file without its config is refused, not silently replaced by bytes */
    char *cfg = tmu_path(dir, "tokenizer_config.json");
    unlink(cfg);
    cr_expect_eq(eng_model_load(dir, NULL, &m, &err), KDS_NOT_FOUND);
    cr_expect(strstr(err.msg, "tokenizer_config.json"), "%s", err.msg);
    free(cfg);
    /* a malformed rank file names itself and the line */
    put(dir, "tokenizer_config.json", KIMI_CONFIG);
    put(dir, "tiktoken.model", "QQ== 0\nQg==\n");
    cr_expect_eq(eng_model_load(dir, NULL, &m, &err), KDS_BAD_FORMAT);
    cr_expect(strstr(err.msg, "tiktoken.model:2:"), "%s", err.msg);
    tmu_rmtree(dir);
    free(dir);
    free(r);
}

Test(tok_model, ranks_must_fit_the_vocabulary, .timeout = 60) {
    char *dir = tiny_model(-1, -1);
    /* more ranks than the tiny model's vocabulary (512) */
    size_t cap = 1 << 16;
    char *extra = calloc(cap, 1);
    FILE *f = fmemopen(extra, cap, "w");
    for (int r = 256; r < 700; r++) {
        unsigned char tk[3] = {'~', (unsigned char)r, (unsigned char)(r >> 8)};
        tok_b64(f, tk, 3);
        fprintf(f, " %d\n", r);
    }
    fclose(f);
    char *ranks = byte_ranks(extra);
    put(dir, "tiktoken.model", ranks);
    put(dir, "tokenizer_config.json", "{}");
    eng_model *m = NULL;
    kds_err err = {0};
    cr_expect_eq(eng_model_load(dir, NULL, &m, &err), KDS_MISMATCH);
    cr_expect(strstr(err.msg, "700 ranks") && strstr(err.msg, "512"), "%s", err.msg);
    tmu_rmtree(dir);
    free(dir);
    free(extra);
    free(ranks);
}

Test(tok_model, without_tiktoken_model_the_byte_tokenizer_stays, .timeout = 60) {
    char *dir = tiny_model(-1, -1);
    eng_model *m = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_model_load(dir, NULL, &m, &err), KDS_OK, "%s", err.msg);
    cr_expect_str_eq(eng_tok_kind(eng_model_tokenizer(m)), "bytes");
    eng_model_free(m);
    tmu_rmtree(dir);
    free(dir);
}

/* ---- kdaserve tokenize ---- */

static int run(char *out, size_t cap, const char *fmt, ...) {
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    FILE *p = popen(cmd, "r");
    cr_assert(p, "popen %s", cmd);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

Test(tok_cli, encode_decode_split, .timeout = 60) {
    char *r = model_ranks(), *rp = write_tmp(r), out[4096];
    cr_assert_eq(
        run(out, sizeof out, "printf 'the thing' | " KDASERVE_TOK " --vocab %s --pattern kimi", rp),
        0, "%s", out);
    cr_expect_str_eq(out, "258 32 256 262\n");
    cr_assert_eq(
        run(out, sizeof out,
            "echo '258, 32 256\n262' | " KDASERVE_TOK " --vocab %s --pattern kimi --decode", rp),
        0, "%s", out);
    cr_expect_str_eq(out, "the thing");
    cr_assert_eq(run(out, sizeof out,
                     "printf 'Hi  there\\n' | " KDASERVE_TOK " --vocab %s --pattern kimi --split",
                     rp),
                 0, "%s", out);
    cr_expect_str_eq(out, "\"Hi\"\n\" \"\n\" there\"\n\"\\n\"\n");
    /* specials: as text unless allowed */
    cr_assert_eq(run(out, sizeof out,
                     "printf '<|im_end|>' | " KDASERVE_TOK " --vocab %s --pattern kimi "
                     "--allow-special",
                     rp),
                 0, "%s", out);
    cr_expect_str_eq(out, "302\n");
    cr_assert_eq(run(out, sizeof out,
                     "printf '302' | " KDASERVE_TOK " --vocab %s --pattern kimi --decode "
                     "--skip-special",
                     rp),
                 0, "%s", out);
    cr_expect_str_eq(out, "");
    cr_assert_eq(run(out, sizeof out,
                     "printf 'x' | " KDASERVE_TOK " --vocab %s --pattern kimi --bench 3", rp),
                 0, "%s", out);
    cr_expect(strstr(out, "\"median_mbps\""), "%s", out);
    unlink(rp);
    free(rp);
    free(r);
}

Test(tok_cli, model_directory, .timeout = 60) {
    char *dir = tiny_model(300, 302), *r = model_ranks(), out[4096];
    put(dir, "tiktoken.model", r);
    put(dir, "tokenizer_config.json", KIMI_CONFIG);
    cr_assert_eq(
        run(out, sizeof out, "printf 'the thing' | " KDASERVE_TOK " --model %s 2>/dev/null", dir),
        0, "%s", out);
    cr_expect_str_eq(out, "258 32 256 262\n");
    tmu_rmtree(dir);
    free(dir);
    free(r);
}

Test(tok_cli, refusals) {
    char out[4096];
    cr_expect_eq(run(out, sizeof out, "echo x | " KDASERVE_TOK " --vocab /x 2>&1"), 2);
    cr_expect(strstr(out, "--pattern"), "%s", out);
    cr_expect_eq(run(out, sizeof out, "echo x | " KDASERVE_TOK " 2>&1"), 2);
    cr_expect_eq(run(out, sizeof out,
                     "echo x | " KDASERVE_TOK " --vocab /nonexistent "
                     "--pattern cl100k 2>&1"),
                 1);
    cr_expect(strstr(out, "kdaserve tokenize: /nonexistent"), "%s", out);
    char *r = byte_ranks("YWI= x\n"), *rp = write_tmp(r);
    cr_expect_eq(
        run(out, sizeof out, "echo x | " KDASERVE_TOK " --vocab %s --pattern o200k 2>&1", rp), 1);
    char want[300];
    snprintf(want, sizeof want, "%s:257: rank 'x'", rp);
    cr_expect(strstr(out, want), "%s", out);
    unlink(rp);
    free(rp);
    free(r);
    r = byte_ranks("");
    rp = write_tmp(r);
    cr_expect_eq(run(out, sizeof out,
                     "echo 5 999 | " KDASERVE_TOK " --vocab %s --pattern none --decode 2>&1", rp),
                 1);
    cr_expect(strstr(out, "'999' is not a token id"), "%s", out);
    cr_expect_eq(
        run(out, sizeof out, "echo x | " KDASERVE_TOK " --vocab %s --pattern p50k 2>&1", rp), 1);
    cr_expect(strstr(out, "unknown pre-tokeniser 'p50k'"), "%s", out);
    unlink(rp);
    free(rp);
    free(r);
}

/* `tokenize --chat` with a tokenizer that has K3's four specials renders
 * K3's format: OpenAI message fields (a tool call's function name,
 * reasoning_content) and the thinking options; a refused effort exits 1
 * naming it. */
Test(tok_cli, k3_chat) {
    const char *spec = "{\"<|end_of_msg|>\": 8194, \"<|open|>\": 8195, \"<|close|>\": 8196, "
                       "\"<|sep|>\": 8197}";
    char *sp = write_tmp(spec), out[8192];
    char tok[1024];
    snprintf(tok, sizeof tok,
             KDASERVE_TOK " --vocab " KDS_SOURCE_DIR "/models/default/tiktoken.model --pattern "
                          "kimi --specials %s",
             sp);
    cr_assert_eq(
        run(out, sizeof out,
            "printf '%%s' '{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":"
            "\"assistant\",\"content\":\"Yes\",\"reasoning_content\":\"hm\",\"tool_calls\":[{"
            "\"id\":\"call_1\",\"function\":{\"name\":\"w\",\"arguments\":\"{\\\"c\\\":1}\"}}]},{"
            "\"role\":\"tool\",\"tool_call_id\":\"call_1\",\"content\":\"ok\"}],"
            "\"thinking_effort\":\"low\"}' | %s --chat | %s --decode",
            tok, tok),
        0, "%s", out);
    cr_expect_str_eq(
        out,
        "<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>`thinking_effort` guides "
        "on how much to think in your thinking channel (not including the response channel), "
        "supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked "
        "with `thinking_effort=low`.<|close|>message<|sep|><|end_of_msg|><|open|>message role="
        "\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|><|open|>message role=\"assistant\""
        "<|sep|><|open|>think<|sep|>hm<|close|>think<|sep|><|open|>response<|sep|>Yes<|close|>"
        "response<|sep|><|open|>tools<|sep|><|open|>call tool=\"w\" index=\"1\"<|sep|><|open|>"
        "argument key=\"c\" type=\"number\"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|>"
        "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|><|open|>message role=\"tool\" "
        "tool=\"w\" index=\"1\"<|sep|>ok<|close|>message<|sep|><|end_of_msg|><|open|>message "
        "role=\"assistant\"<|sep|><|open|>think<|sep|>");
    cr_expect_eq(run(out, sizeof out,
                     "printf '%%s' '{\"messages\":[],\"thinking_effort\":\"medium\"}' | %s --chat "
                     "2>&1",
                     tok),
                 1);
    cr_expect(strstr(out, "\"medium\" is not one of low, high, max"), "%s", out);
    unlink(sp);
    free(sp);
}
