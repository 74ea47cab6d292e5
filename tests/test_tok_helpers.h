/*
 * test_tok_helpers.h - shared by the tokenizer tests (tests/test_tok_*.c):
 * the reference tokenizer (OpenAI tiktoken@1.0.22 run by node, see
 * tests/node/), its rank files, texts, and small byte helpers.
 *
 * The reference needs node. scripts/bootstrap.sh installs node, npm and the
 * package; when the package is missing here, the first test that needs it
 * runs `npm ci` itself, and rank files are rebuilt on demand into
 * build/tok-ref (sha256-checked against OpenAI's files by build_ranks.js).
 * Only when node itself is missing do those tests skip, saying so.
 */
#ifndef TEST_TOK_HELPERS_H
#define TEST_TOK_HELPERS_H

#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "eng.h"
#include "test_helpers.h"
#include "kds_clock.h"

#define TOK_NODE_DIR KDS_SOURCE_DIR "/tests/node"
#define TOK_REF_DIR KDS_BINARY_DIR "/tok-ref"
#define TOK_CL100K TOK_REF_DIR "/cl100k_base.tiktoken"
#define TOK_O200K TOK_REF_DIR "/o200k_base.tiktoken"

typedef struct tok_text {
    char *s;
    size_t n;
} tok_text;

typedef struct tok_ids {
    int32_t *v;
    int64_t n;
} tok_ids;

static inline bool tok_exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

/* Make the reference usable: false (after a skip message) when node is
 * missing; any other failure fails the test. Serialised across the test
 * processes by a lock file, so parallel tests set up once. */
static inline bool tok_ref_ready(void) {
    if (th_system("node --version >/dev/null 2>&1") != 0) {
        cr_skip_test("node is not installed: the byte-exact comparison with OpenAI tiktoken "
                     "needs it (scripts/bootstrap.sh installs it)");
        return false;
    }
    int fd = open(KDS_BINARY_DIR "/tok-ref.lock", O_CREAT | O_RDWR | O_CLOEXEC, 0644);
    cr_assert(fd >= 0, "cannot open the lock file in %s", KDS_BINARY_DIR);
    cr_assert_eq(flock(fd, LOCK_EX), 0);
    int rc = 0;
    if (!tok_exists(TOK_NODE_DIR "/node_modules/tiktoken/package.json"))
        rc = th_system("cd '" TOK_NODE_DIR "' && npm ci --no-audit --no-fund >&2");
    if (rc == 0 && !(tok_exists(TOK_CL100K) && tok_exists(TOK_O200K)))
        rc = th_system("node '" TOK_NODE_DIR "/build_ranks.js' '" TOK_REF_DIR "'");
    flock(fd, LOCK_UN);
    close(fd);
    cr_assert_eq(rc, 0,
                 "could not set up the tiktoken reference (npm ci in tests/node, then "
                 "build_ranks.js): run scripts/bootstrap.sh");
    return true;
}

static inline eng_tokenizer *tok_load(const char *ranks, const char *pattern, bool specials) {
    eng_tok_params p = eng_tok_default_params();
    p.pattern = pattern;
    p.no_specials = !specials;
    eng_tokenizer *t = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_tok_load(ranks, &p, &t, &err), KDS_OK, "%s", err.msg);
    return t;
}

static inline tok_ids tok_encode(const eng_tokenizer *t, const char *s, size_t n, unsigned flags) {
    tok_ids r = {malloc((n + 1) * sizeof(int32_t)), 0};
    kds_err err = {0};
    cr_assert(r.v);
    cr_assert_eq(eng_tok_encode_ex(t, s, n, flags, r.v, (int64_t)n, &r.n, &err), KDS_OK, "%s",
                 err.msg);
    return r;
}

static inline void tok_b64(FILE *f, const unsigned char *s, size_t n) {
    static const char A[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (size_t i = 0; i < n; i += 3) {
        uint32_t w = (uint32_t)s[i] << 16 | (i + 1 < n ? (uint32_t)s[i + 1] << 8 : 0) |
                     (i + 2 < n ? s[i + 2] : 0);
        fputc(A[w >> 18 & 63], f);
        fputc(A[w >> 12 & 63], f);
        fputc(i + 1 < n ? A[w >> 6 & 63] : '=', f);
        fputc(i + 2 < n ? A[w & 63] : '=', f);
    }
}

/* Encode every text with the reference: `args` are ref_encode.js's
 * (e.g. "cl100k_base ordinary"). Returns n id lists (free with tok_ids_free). */
static inline tok_ids *tok_ref_encode(const char *args, const tok_text *texts, int n) {
    char in[] = "/tmp/kds_tok_in_XXXXXX", out[] = "/tmp/kds_tok_out_XXXXXX";
    int fi = mkstemp(in), fo = mkstemp(out);
    cr_assert(fi >= 0 && fo >= 0, "mkstemp");
    close(fo);
    FILE *f = fdopen(fi, "w");
    for (int i = 0; i < n; i++) {
        tok_b64(f, (const unsigned char *)texts[i].s, texts[i].n);
        fputc('\n', f);
    }
    fclose(f);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "node '" TOK_NODE_DIR "/ref_encode.js' %s < %s > %s", args, in, out);
    int rc = th_system(cmd);
    cr_assert_eq(rc, 0, "reference failed: %s", cmd);
    f = fopen(out, "r");
    cr_assert(f);
    tok_ids *r = calloc((size_t)n, sizeof *r);
    size_t cap = 0;
    char *line = NULL;
    for (int i = 0; i < n; i++) {
        ssize_t l = getline(&line, &cap, f);
        cr_assert(l >= 0, "reference gave %d lines for %d texts", i, n);
        int64_t c = 0;
        for (char *q = line; *q; q++)
            c += *q == ' ';
        r[i].v = malloc((size_t)(c + 2) * sizeof(int32_t));
        char *q = line, *e;
        for (;;) {
            long v = strtol(q, &e, 10);
            if (e == q) break;
            r[i].v[r[i].n++] = (int32_t)v;
            q = e;
        }
    }
    free(line);
    fclose(f);
    unlink(in);
    unlink(out);
    return r;
}

static inline void tok_ids_free(tok_ids *r, int n) {
    for (int i = 0; r && i < n; i++)
        free(r[i].v);
    free(r);
}

/* Show where two id lists part, with the token bytes around it. */
static inline void tok_report_diff(const eng_tokenizer *t, const char *what, const tok_text *x,
                                   const tok_ids *got, const tok_ids *want) {
    int64_t k = 0;
    while (k < got->n && k < want->n && got->v[k] == want->v[k])
        k++;
    fprintf(stderr, "%s: ids differ at %lld (ours %lld ids, reference %lld); text (%zu bytes):\n",
            what, (long long)k, (long long)got->n, (long long)want->n, x->n);
    fwrite(x->s, 1, x->n > 300 ? 300 : x->n, stderr);
    fprintf(stderr, "\n");
    for (int side = 0; side < 2; side++) {
        const tok_ids *l = side ? want : got;
        fprintf(stderr, "  %s:", side ? "reference" : "ours     ");
        for (int64_t i = k > 3 ? k - 3 : 0; i < l->n && i < k + 6; i++) {
            size_t pl;
            const char *pc = eng_tok_piece(t, l->v[i], &pl);
            fprintf(stderr, " %d[", l->v[i]);
            for (size_t j = 0; j < pl; j++)
                fprintf(stderr,
                        (unsigned char)pc[j] >= 0x20 && (unsigned char)pc[j] < 0x7f ? "%c"
                                                                                    : "\\x%02x",
                        (unsigned char)pc[j]);
            fprintf(stderr, "]");
        }
        fprintf(stderr, "\n");
    }
}

/* Deterministic generator (xorshift64*). */
static inline uint64_t tok_rand(uint64_t *s) {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}

static inline void tok_put_cp(char **b, size_t *n, size_t *cap, uint32_t cp) {
    if (*n + 4 >= *cap) {
        *cap = *cap ? *cap * 2 : 256;
        *b = realloc(*b, *cap);
    }
    unsigned char *o = (unsigned char *)*b + *n;
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        *n += 1;
    } else if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | cp >> 6);
        o[1] = (unsigned char)(0x80 | (cp & 63));
        *n += 2;
    } else if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | cp >> 12);
        o[1] = (unsigned char)(0x80 | (cp >> 6 & 63));
        o[2] = (unsigned char)(0x80 | (cp & 63));
        *n += 3;
    } else {
        o[0] = (unsigned char)(0xF0 | cp >> 18);
        o[1] = (unsigned char)(0x80 | (cp >> 12 & 63));
        o[2] = (unsigned char)(0x80 | (cp >> 6 & 63));
        o[3] = (unsigned char)(0x80 | (cp & 63));
        *n += 4;
    }
}

static inline void tok_put_str(char **b, size_t *n, size_t *cap, const char *s) {
    size_t l = strlen(s);
    while (*n + l + 4 >= *cap) {
        *cap = *cap ? *cap * 2 : 256;
        *b = realloc(*b, *cap);
    }
    memcpy(*b + *n, s, l);
    *n += l;
}

/*
 * Random valid UTF-8 text nobody wrote by hand: fragments drawn from the
 * places where tokenizers disagree (letter categories Lu/Ll/Lt/Lm/Lo and
 * marks, scripts with and without Han, digits of many scripts, every
 * Unicode space and the near-spaces that are not White_Space, contractions
 * in odd cases, 4-byte characters, special-token names), sometimes repeated
 * into long runs.
 */
static inline tok_text tok_random_text(uint64_t *rng, int fragments) {
    static const uint32_t CPS[] = {
        /* Latin-1 and Latin: letters of every case class, ordinal/micro */
        0xE9, 0xDF, 0xC4, 0xFF, 0xB5, 0xAA, 0xBA, 0x1C5, 0x1C8, 0x1F2, 0x2B0, 0x2C6, 0x130, 0x131,
        0x17F, 0x212A, 0x1E9E,
        /* digits and numbers: superscripts, fractions, Arabic-Indic, Devanagari,
         * fullwidth, roman numerals (Nl), circled (No) */
        0xB2, 0xB9, 0xBC, 0x663, 0x96B, 0xFF11, 0x216B, 0x2460, 0x2070, 0x1D7CE,
        /* punctuation and symbols */
        0xA1, 0xAB, 0xBB, 0xD7, 0xF7, 0x2019, 0x201C, 0x2026, 0x20AC, 0x2122, 0xFF01, 0x3001,
        0x3002, 0x300C, 0x300D, 0x30FB, 0xFF0C,
        /* spaces: White_Space ones, and look-alikes that are not (U+180E, ZWSP,
         * BOM, soft hyphen) */
        0x85, 0xA0, 0x1680, 0x2000, 0x2003, 0x2007, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000,
        0x180E, 0x200B, 0xFEFF, 0xAD, 0x0B, 0x0C,
        /* marks: combining acute/diaeresis/cedilla, enclosing, variation selector,
         * Devanagari vowel sign (Mc) */
        0x301, 0x308, 0x327, 0x20DD, 0xFE0F, 0x93F, 0x94D,
        /* Greek, Cyrillic, Armenian, Hebrew, Arabic, Thai, Devanagari, Hangul */
        0x3B1, 0x3A9, 0x436, 0x42F, 0x561, 0x5E9, 0x645, 0x631, 0xE20, 0xE32, 0x928, 0x92E, 0xD55C,
        0x3131,
        /* Han and its neighbours: ideographs, ext-B (4 bytes), iteration mark
         * 々 (Lm, Han), 〇 (Nl, Han), kana, prolonged sound mark ー (Lm) */
        0x4E2D, 0x6587, 0x5B57, 0x8A9E, 0x20000, 0x2A6D6, 0x3005, 0x3007, 0x3042, 0x30AB, 0x30FC,
        0xF900,
        /* 4-byte: emoji, skin tone (Sk), ZWJ, flags, math letters, Gothic, Deseret */
        0x1F600, 0x1F44D, 0x1F3FD, 0x200D, 0x1F1EF, 0x1F1F5, 0x1D54F, 0x1D4B6, 0x10348, 0x10400,
        0x10428, 0x1F9D1, 0xE0041,
        /* controls, NUL included */
        0x0, 0x1B, 0x7F};
    static const char *const FRAGS[] = {" ",
                                        "  ",
                                        "\n",
                                        "\r\n",
                                        "\t",
                                        " \n",
                                        "\n\n",
                                        "'",
                                        "'s",
                                        "'S",
                                        "'ll",
                                        "'LL",
                                        "'Ll",
                                        "'re",
                                        "'RE",
                                        "'Ve",
                                        "'m",
                                        "'M",
                                        "'d",
                                        "'D",
                                        "'t",
                                        "'T",
                                        "'x",
                                        "\xc5\xbf", /* ſ */
                                        "'\xc5\xbf",
                                        "don't",
                                        "DON'T",
                                        "I'M",
                                        "we'LL",
                                        "it'S",
                                        " the",
                                        " The",
                                        " THE",
                                        "Hello",
                                        " world",
                                        "HTTPServer",
                                        "camelCase",
                                        "snake_case",
                                        "x86_64",
                                        "0x7FFF",
                                        "3.14159",
                                        "1,000,000",
                                        "2024-01-01",
                                        "12345678901234",
                                        "<|endoftext|>",
                                        "<|fim_prefix|>",
                                        "<|fim_middle|>",
                                        "<|fim_suffix|>",
                                        "<|endofprompt|>",
                                        "<|im_end|>",
                                        "<|endoftext",
                                        "|>",
                                        "<|",
                                        "//",
                                        "/*",
                                        "*/",
                                        "{",
                                        "}",
                                        "();",
                                        "->",
                                        "=>",
                                        "!=",
                                        "...",
                                        "?!",
                                        "\"",
                                        "`",
                                        "~",
                                        "@",
                                        "#",
                                        "$",
                                        "%",
                                        "^",
                                        "&",
                                        "*",
                                        "(",
                                        ")",
                                        "[",
                                        "]",
                                        "\\",
                                        "/",
                                        "|",
                                        "-",
                                        "+",
                                        "=",
                                        "_",
                                        ":",
                                        ";",
                                        ",",
                                        ".",
                                        "<",
                                        ">",
                                        "?",
                                        "\x7f",
                                        "\x01"};
    char *b = NULL;
    size_t n = 0, cap = 0;
    for (int f = 0; f < fragments; f++) {
        uint64_t r = tok_rand(rng);
        int kind = (int)(r % 16), reps = 1;
        if ((r >> 8) % 23 == 0) reps = 2 + (int)((r >> 16) % 300); /* a long run */
        uint32_t cp = CPS[(r >> 32) % (sizeof CPS / sizeof CPS[0])];
        const char *fr = FRAGS[(r >> 40) % (sizeof FRAGS / sizeof FRAGS[0])];
        for (int k = 0; k < reps; k++) {
            if (kind < 5)
                tok_put_cp(&b, &n, &cap,
                           'a' + (uint32_t)(tok_rand(rng) % 26) - ((r >> 4) & 1 ? 32 : 0));
            else if (kind < 7)
                tok_put_cp(&b, &n, &cap, '0' + (uint32_t)(tok_rand(rng) % 10));
            else if (kind < 11)
                tok_put_cp(&b, &n, &cap, cp);
            else
                tok_put_str(&b, &n, &cap, fr);
        }
    }
    if (!b) b = malloc(1);
    return (tok_text){b, n};
}

typedef struct tok_sub {
    const char *p;
    uint32_t n;
} tok_sub;

static inline int tok_sub_cmp(const void *a, const void *b) {
    const tok_sub *x = a, *y = b;
    uint32_t m = x->n < y->n ? x->n : y->n;
    int c = memcmp(x->p, y->p, m);
    return c ? c : (x->n > y->n) - (x->n < y->n);
}

/* The "substring vocabulary": a rank file of the 256 bytes, then every
 * distinct substring of 2..maxlen bytes of the texts. Every pre-token of
 * those texts (up to maxlen bytes) is then one token, so ids show exactly
 * where a pattern splits. */
static inline void tok_write_substring_vocab(const char *path, const tok_text *x, int n,
                                             uint32_t maxlen) {
    size_t cap = 0;
    for (int i = 0; i < n; i++)
        cap += x[i].n * maxlen;
    tok_sub *s = malloc((cap + 1) * sizeof *s);
    size_t m = 0;
    for (int i = 0; i < n; i++)
        for (size_t a = 0; a < x[i].n; a++)
            for (uint32_t l = 2; l <= maxlen && a + l <= x[i].n; l++)
                s[m++] = (tok_sub){x[i].s + a, l};
    qsort(s, m, sizeof *s, tok_sub_cmp);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    int rank = 0;
    for (int b = 0; b < 256; b++) {
        unsigned char c = (unsigned char)b;
        tok_b64(f, &c, 1);
        fprintf(f, " %d\n", rank++);
    }
    for (size_t i = 0; i < m; i++) {
        if (i && !tok_sub_cmp(&s[i], &s[i - 1])) continue;
        tok_b64(f, (const unsigned char *)s[i].p, s[i].n);
        fprintf(f, " %d\n", rank++);
    }
    fclose(f);
    free(s);
}

#endif
