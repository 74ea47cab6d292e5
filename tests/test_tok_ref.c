/*
 * Byte-exact with OpenAI's tiktoken: our ids against tiktoken@1.0.22's own
 * encoder (run by node, tests/node/ref_encode.js) on cl100k_base and
 * o200k_base, over a hand-picked text set and over random text nobody
 * wrote, with special-token text both as text and as specials. The Kimi
 * pattern is checked the same way through tiktoken's regex engine
 * (fancy-regex reads Kimi's `&&` classes natively), and a "substring
 * vocabulary" makes every pre-token one token, so that any difference in
 * where a pattern splits shows as a different id.
 */
#include "test_tok_helpers.h"

#define T(lit)                                                                                     \
    { lit, sizeof(lit) - 1 }
static const struct {
    const char *s;
    size_t n;
} CASES[] = {
    T(""),
    T("Hello world"),
    T("Hello, world!"),
    T("It is a truth universally acknowledged, that a single man in possession of a good "
      "fortune, must be in want of a wife.\n\nHowever little known the feelings or views of "
      "such a man may be on his first entering a neighbourhood, this truth is so well fixed."),
    T("Call me Ishmael. Some years ago\xe2\x80\x94never mind how long precisely\xe2\x80\x94having "
      "little or no money in my purse, I thought I would sail about a little."),
    T("int main(int argc, char **argv) {\n    for (int i = 0; i < argc; i++)\n        "
      "printf(\"%s\\n\", argv[i]);\n    return 0;\n}\n"),
    T("def f(x):\n\treturn {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\n\n"),
    T("<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>\r\n"),
    T("https://example.com/path/to/file.html?query=1&x=y#frag /usr/lib/x86_64-linux-gnu/"),
    T("\xe4\xb8\xad\xe6\x96\x87"
      "English\xe6\xb7\xb7\xe5\x90\x88"),                              /* 中文English混合 */
    T("\xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c\xef\xbc\x81"), /* 你好世界！ */
    T("\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae\xe3\x83\x86\xe3\x82\xad\xe3\x82\xb9"
      "\xe3\x83\x88\xe3\x80\x82\xe3\x82\xab\xe3\x82\xbf\xe3\x82\xab\xe3\x83\x8a\xe3\x83\xbc"),
    T("\xed\x95\x9c\xea\xb5\xad\xec\x96\xb4 \xed\x85\x8c\xec\x8a\xa4\xed\x8a\xb8"),
    T("\xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82, \xd0\xbc\xd0\xb8\xd1\x80! "
      "\xce\x93\xce\xb5\xce\xb9\xce\xac \xcf\x83\xce\xbf\xcf\x85"),
    T("\xd9\x85\xd8\xb1\xd8\xad\xd8\xa8\xd8\xa7 \xd7\xa9\xd7\x9c\xd7\x95\xd7\x9d "
      "\xe0\xa4\xa8\xe0\xa4\xae\xe0\xa4\xb8\xe0\xa5\x8d\xe0\xa4\xa4\xe0\xa5\x87 "
      "\xe0\xb8\xa0\xe0\xb8\xb2\xe0\xb8\xa9\xe0\xb8\xb2"),
    T("\xf0\x9f\x98\x80\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd \xf0\x9f\x91\xa8\xe2\x80\x8d\xf0\x9f\x91"
      "\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7 \xf0\x9f\x87\xaf\xf0\x9f\x87\xb5 \xf0\x9d\x95\x8f "
      "\xf0\xa0\x80\x80\xf0\x90\x8d\x88"),
    T("e\xcc\x81 a\xcc\x88o\xcc\x88 c\xcc\xa7 n\xcc\x83\xcc\x81 Z\xcd\x91\xcd\x9b\xcc\x80\xcd\xa0"
      "a\xcc\xb0l\xcd\x9c\xcc\x81g\xcc\xbdo\xcd\x8c"),
    T("1234567890 3.14159 1,000,000 0x7fff 1e-10 -42 +7 \xd9\xa3\xd9\xa4 \xef\xbc\x91\xef\xbc\x92 "
      "\xe2\x85\xab \xe2\x91\xa0 \xc2\xb2\xc2\xbc"),
    T("a                                                                                   b"),
    T("\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n"),
    T("  \t  \t\t   \n   \r\n \r\r\n\n  x  \n  "),
    T("   "),
    T(" "),
    T("don't I'll we've they're she'd I'm it's DON'T I'LL WE'VE THEY'RE SHE'D I'M IT'S "
      "Don'T i'Ll We'Ve tHEY'rE 's 'S 'll 'LL 'lL x'y ''s '''"),
    T("\xc5\xbf '\xc5\xbf it'\xc5\xbf \xe2\x84\xaa '\xe2\x84\xaa"), /* ſ, Kelvin */
    T("<|endoftext|>"),
    T("Hello<|endoftext|>world <|fim_prefix|>a<|fim_middle|>b<|fim_suffix|> <|endofprompt|>"),
    T("<|endoftext|<|endoftext|>>|> <|im_end|> <|endoftext <|"),
    T("\x00\x01\x02\x1b[31mred\x1b[0m\x7f"),
    T("\xc2\xa0\xc2\xa0non\xc2\xa0"
      "breaking \xe2\x80\x83"
      "em\xe2\x80\x83space\xe3\x80\x80ideo "
      "\xe1\xa0\x8emongol \xe2\x80\x8bzw \xef\xbb\xbf"
      "bom \xc2\x85nel"),
    T("\xc7\x85ungla \xc7\x88ubljana \xca\xb0"
      "ello \xc2\xaa"
      "a \xc2\xb5s I\xcc\x87 \xc4\xb1"),
    T("\xe3\x80\x85\xe4\xba\xba\xe3\x80\x87\xe3\x80\x81\xe4\xb8\xad\xe3\x80\x82\xe3\x83\xbc"
      "\xe3\x83\xbb"),
    T("ALLCAPS WORDS AND MixedCase wordsWithCAPS HTTPServer getHTTPResponse iPhone"),
    T("!!!???... --- ___ *** ### /// \\\\\\ ''' \"\"\" ``` ~~~ ^^^ |||\n\n"),
    T("trailing spaces   \nand tabs\t\t\nand both \t \n"),
};

static tok_text *case_texts(int *n) {
    *n = (int)(sizeof CASES / sizeof CASES[0]);
    tok_text *x = calloc((size_t)*n, sizeof *x);
    for (int i = 0; i < *n; i++) {
        x[i].s = malloc(CASES[i].n + 1);
        memcpy(x[i].s, CASES[i].s, CASES[i].n);
        x[i].n = CASES[i].n;
    }
    return x;
}

static tok_text *random_texts(uint64_t seed, int n, int fragments) {
    tok_text *x = calloc((size_t)n, sizeof *x);
    uint64_t rng = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int i = 0; i < n; i++)
        x[i] = tok_random_text(&rng, 1 + (int)(tok_rand(&rng) % fragments));
    return x;
}

static void texts_free(tok_text *x, int n) {
    for (int i = 0; i < n; i++)
        free(x[i].s);
    free(x);
}

/* Compare ours with the reference on every text; fail listing the first few. */
static void compare(const char *what, const eng_tokenizer *t, const char *ref_args,
                    const tok_text *x, int n, unsigned flags) {
    tok_ids *want = tok_ref_encode(ref_args, x, n);
    int bad = 0;
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        tok_ids got = tok_encode(t, x[i].s, x[i].n, flags);
        total += got.n;
        bool same =
            got.n == want[i].n && !memcmp(got.v, want[i].v, (size_t)got.n * sizeof(int32_t));
        if (!same && bad++ < 5) {
            char label[128];
            snprintf(label, sizeof label, "%s, text %d", what, i);
            tok_report_diff(t, label, &x[i], &got, &want[i]);
        }
        free(got.v);
    }
    fprintf(stderr, "%s: %d texts, %lld ids, %d differ from tiktoken\n", what, n, (long long)total,
            bad);
    cr_expect_eq(bad, 0, "%s: %d of %d texts encode differently from tiktoken (details above)",
                 what, bad, n);
    tok_ids_free(want, n);
}

static void check_encoding(const char *ranks, const char *pattern, const char *enc_name) {
    if (!tok_ref_ready()) return;
    eng_tokenizer *t = tok_load(ranks, pattern, true);
    int n;
    tok_text *x = case_texts(&n);
    char args[128], what[128];
    snprintf(args, sizeof args, "%s ordinary", enc_name);
    snprintf(what, sizeof what, "%s cases, ordinary", enc_name);
    compare(what, t, args, x, n, 0);
    snprintf(args, sizeof args, "%s all", enc_name);
    snprintf(what, sizeof what, "%s cases, specials allowed", enc_name);
    compare(what, t, args, x, n, ENG_TOK_ALLOW_SPECIAL);
    texts_free(x, n);
    eng_tok_free(t);
}

static void check_random(const char *ranks, const char *pattern, const char *enc_name,
                         uint64_t seed) {
    if (!tok_ref_ready()) return;
    eng_tokenizer *t = tok_load(ranks, pattern, true);
    const int n = 400;
    tok_text *x = random_texts(seed, n, 120);
    char args[128], what[128];
    snprintf(args, sizeof args, "%s ordinary", enc_name);
    snprintf(what, sizeof what, "%s random (seed %llu), ordinary", enc_name,
             (unsigned long long)seed);
    compare(what, t, args, x, n, 0);
    snprintf(args, sizeof args, "%s all", enc_name);
    snprintf(what, sizeof what, "%s random (seed %llu), specials allowed", enc_name,
             (unsigned long long)seed);
    compare(what, t, args, x, n, ENG_TOK_ALLOW_SPECIAL);
    texts_free(x, n);
    eng_tok_free(t);
}

Test(tok_ref, cl100k_cases_match_tiktoken, .timeout = 120) {
    check_encoding(TOK_CL100K, "cl100k", "cl100k_base");
}

Test(tok_ref, o200k_cases_match_tiktoken, .timeout = 120) {
    check_encoding(TOK_O200K, "o200k", "o200k_base");
}

Test(tok_ref, cl100k_random_text_matches_tiktoken, .timeout = 180) {
    check_random(TOK_CL100K, "cl100k", "cl100k_base", 1);
}

Test(tok_ref, o200k_random_text_matches_tiktoken, .timeout = 180) {
    check_random(TOK_O200K, "o200k", "o200k_base", 2);
}

/* Long pieces go through the heap merge (> 128 bytes): a few thousand
 * letters without a space, digits-free soups, whitespace. */
Test(tok_ref, long_pieces_match_tiktoken, .timeout = 180) {
    if (!tok_ref_ready()) return;
    eng_tokenizer *t = tok_load(TOK_CL100K, "cl100k", false);
    uint64_t rng = 99;
    tok_text x[6];
    for (int i = 0; i < 6; i++) {
        size_t n = 200 + (size_t)(tok_rand(&rng) % 3000);
        x[i].s = malloc(n);
        x[i].n = n;
        for (size_t k = 0; k < n; k++) {
            uint64_t r = tok_rand(&rng);
            x[i].s[k] = i < 3    ? (char)('a' + r % (i == 0   ? 26
                                                     : i == 1 ? 3
                                                              : 2))
                        : i == 3 ? " \t"[r % 2]
                        : i == 4 ? "!?.-*"[r % 5]
                                 : (char)('A' + r % 26);
        }
    }
    compare("cl100k long pieces", t, "cl100k_base ordinary", x, 6, 0);
    for (int i = 0; i < 6; i++)
        free(x[i].s);
    eng_tok_free(t);
}

/* The Kimi pattern (our PCRE2 rewrite) against Kimi's own pat_str in
 * tiktoken's engine, over the cl100k ranks. */
Test(tok_ref, kimi_pattern_matches_tiktoken_regex, .timeout = 180) {
    if (!tok_ref_ready()) return;
    eng_tokenizer *t = tok_load(TOK_CL100K, "kimi", false);
    int n;
    tok_text *x = case_texts(&n);
    compare("kimi pattern, cases", t, "custom ordinary " TOK_CL100K " kimi", x, n, 0);
    texts_free(x, n);
    x = random_texts(3, 400, 120);
    compare("kimi pattern, random", t, "custom ordinary " TOK_CL100K " kimi", x, 400, 0);
    texts_free(x, 400);
    eng_tok_free(t);
}

static void check_splits(const char *pattern) {
    if (!tok_ref_ready()) return;
    int nc;
    tok_text *cases = case_texts(&nc);
    tok_text *rnd = random_texts(7, 120, 60);
    char path[] = "/tmp/kds_tok_sub_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    tok_text all[200];
    int n = 0;
    for (int i = 0; i < nc; i++)
        all[n++] = cases[i];
    for (int i = 0; i < 120; i++)
        all[n++] = rnd[i];
    tok_write_substring_vocab(path, all, n, 24);
    eng_tokenizer *t = tok_load(path, pattern, false);
    char args[256], what[64];
    snprintf(args, sizeof args, "custom ordinary %s %s", path, pattern);
    snprintf(what, sizeof what, "%s splits (substring vocabulary)", pattern);
    compare(what, t, args, all, n, 0);
    eng_tok_free(t);
    unlink(path);
    texts_free(cases, nc);
    texts_free(rnd, 120);
}

Test(tok_ref, cl100k_splits_match_tiktoken, .timeout = 180) {
    check_splits("cl100k");
}
Test(tok_ref, o200k_splits_match_tiktoken, .timeout = 180) {
    check_splits("o200k");
}
Test(tok_ref, kimi_splits_match_tiktoken, .timeout = 180) {
    check_splits("kimi");
}

/* Long texts through the kimi preset: our cuts (every 400,000 characters,
 * runs over 25,000) against a line-by-line port of tokenization_kimi.py's
 * encode() loop feeding tiktoken (tests/node/ref_encode.js). */
Test(tok_ref, kimi_long_texts_match_kimi_encode, .timeout = 240) {
    if (!tok_ref_ready()) return;
    eng_tokenizer *t = tok_load(TOK_CL100K, "kimi", false);
    tok_text x[4];
    const char unit[] = "h\xc3\xa9llo w\xc3\xb6rld ";
    size_t ul = sizeof unit - 1;
    x[0].n = ul * 33334;
    x[0].s = malloc(x[0].n);
    for (size_t r = 0; r < 33334; r++)
        memcpy(x[0].s + r * ul, unit, ul);
    x[1].n = 90001;
    x[1].s = malloc(x[1].n);
    memset(x[1].s, 'x', 30000);
    memset(x[1].s + 30000, ' ', 60000);
    x[1].s[90000] = 'y';
    x[2].n = 25004;
    x[2].s = malloc(x[2].n);
    memset(x[2].s, 0x1c, 25001);
    memcpy(x[2].s + 25001, "abc", 3);
    uint64_t rng = 11;
    x[3] = tok_random_text(&rng, 90000); /* ~500K characters of everything */
    compare("kimi long texts", t, "custom ordinary " TOK_CL100K " kimi", x, 4, 0);
    for (int i = 0; i < 4; i++)
        free(x[i].s);
    eng_tok_free(t);
}
