/*
 * Tokenizer properties that need no reference implementation: decode
 * undoes encode for any bytes (invalid UTF-8 included), invalid runs are
 * encoded apart from the text around them, the count/capacity contract,
 * the byte-level tokenizer, concurrent use, pathological inputs, the Kimi
 * pattern's known splits, and streaming decode (never half a character,
 * U+FFFD per maximal invalid subpart). The vocabularies are made here (a
 * "substring vocabulary" of a multilingual text, whose tokens also cut
 * UTF-8 characters in pieces), so these tests run without node.
 */
#include <pthread.h>

#include "eng_config.h"
#include "eng_tokenizer.h"
#include "test_tok_helpers.h"

static const char TRAIN[] =
    "The quick brown fox jumps over the lazy dog. It's what we'll do, isn't it?\n"
    "int main(void) { return 0; }  // code\n\t\tindented\n"
    "\xe4\xb8\xad\xe6\x96\x87\xe5\xad\x97\xe7\xac\xa6 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e "
    "\xed\x95\x9c\xea\xb5\xad\xec\x96\xb4 \xd0\xbf\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82 "
    "caf\xc3\xa9 na\xc3\xafve \xf0\x9f\x98\x80\xf0\x9f\x91\x8d 12345 \xe2\x82\xac\xe2\x80\x94";

/* A tokenizer over the substring vocabulary of TRAIN (substrings of up to
 * 5 bytes: many tokens are parts of a UTF-8 character). */
static eng_tokenizer *synth(const char *pattern, bool specials) {
    char path[] = "/tmp/kds_tok_synth_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    tok_text x = {(char *)TRAIN, sizeof TRAIN - 1};
    tok_write_substring_vocab(path, &x, 1, 5);
    eng_tokenizer *t = tok_load(path, pattern, specials);
    unlink(path);
    return t;
}

static eng_tokenizer *bytes_tok(int vocab) {
    eng_config c;
    memset(&c, 0, sizeof c);
    c.vocab_size = vocab;
    c.bos_token_id = c.eos_token_id = c.pad_token_id = -1;
    eng_tokenizer *t = NULL;
    kds_err err = {0};
    cr_assert_eq(eng__tok_create_bytes(&c, &t, &err), KDS_OK, "%s", err.msg);
    return t;
}

static void expect_round_trip(const eng_tokenizer *t, const char *s, size_t n, const char *what) {
    tok_ids ids = tok_encode(t, s, n, 0);
    cr_expect_leq(ids.n, (int64_t)n, "%s: more ids than bytes", what);
    int64_t need = eng_tok_decode(t, ids.v, ids.n, 0, NULL, 0);
    cr_assert_eq(need, (int64_t)n, "%s: decode gives %lld bytes, text has %zu", what,
                 (long long)need, n);
    char *back = malloc(n + 1);
    eng_tok_decode(t, ids.v, ids.n, 0, back, n);
    cr_expect(!memcmp(back, s, n), "%s: decode(encode(x)) != x", what);
    free(back);
    free(ids.v);
}

/* ---- round trips ---- */

Test(tok_codec, decode_undoes_encode_for_any_bytes, .timeout = 60) {
    const char *patterns[] = {"cl100k", "o200k", "kimi", "none"};
    uint64_t rng = 5;
    for (int p = 0; p < 4; p++) {
        eng_tokenizer *t = synth(patterns[p], false);
        for (int i = 0; i < 60; i++) {
            tok_text x = tok_random_text(&rng, 1 + (int)(tok_rand(&rng) % 80));
            expect_round_trip(t, x.s, x.n, patterns[p]);
            /* the same text with random bytes overwritten: invalid UTF-8 */
            for (int k = 0; x.n && k < 1 + (int)(x.n / 16); k++)
                x.s[tok_rand(&rng) % x.n] = (char)(0x80 + tok_rand(&rng) % 128);
            expect_round_trip(t, x.s, x.n, patterns[p]);
            free(x.s);
        }
        unsigned char raw[512]; /* pure noise */
        for (int i = 0; i < 20; i++) {
            for (size_t k = 0; k < sizeof raw; k++)
                raw[k] = (unsigned char)tok_rand(&rng);
            expect_round_trip(t, (const char *)raw, 1 + tok_rand(&rng) % sizeof raw, "noise");
        }
        eng_tok_free(t);
    }
}

/* Invalid UTF-8 (which tiktoken never sees) is our rule, eng.h: each
 * maximal invalid run is one piece of its own, the valid text around it is
 * pre-tokenised as separate runs. */
Test(tok_codec, invalid_runs_are_encoded_apart) {
    eng_tokenizer *t = synth("cl100k", false);
    const struct {
        const char *a, *bad, *b;
    } cases[] = {{"hello ", "\xff\xfe", " world"},
                 {"\xe4\xb8\xad\xe6\x96\x87", "\xe4\xb8", "ABC def"},
                 {"x", "\xc0\xaf\x80", "  \n"},
                 {"caf\xc3\xa9", "\xed\xa0\x80", "12345"},
                 {"", "\xf0\x9f\x98", "\xf0\x9f\x98\x80!"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char all[128];
        size_t la = strlen(cases[i].a), lb = strlen(cases[i].bad), lc = strlen(cases[i].b);
        memcpy(all, cases[i].a, la);
        memcpy(all + la, cases[i].bad, lb);
        memcpy(all + la + lb, cases[i].b, lc);
        tok_ids whole = tok_encode(t, all, la + lb + lc, 0);
        tok_ids pa = tok_encode(t, cases[i].a, la, 0), pb = tok_encode(t, cases[i].bad, lb, 0),
                pc = tok_encode(t, cases[i].b, lc, 0);
        cr_expect_eq(whole.n, pa.n + pb.n + pc.n, "case %zu: %lld ids, parts give %lld", i,
                     (long long)whole.n, (long long)(pa.n + pb.n + pc.n));
        if (whole.n == pa.n + pb.n + pc.n) {
            cr_expect(!memcmp(whole.v, pa.v, (size_t)pa.n * 4), "case %zu", i);
            cr_expect(!memcmp(whole.v + pa.n, pb.v, (size_t)pb.n * 4), "case %zu", i);
            cr_expect(!memcmp(whole.v + pa.n + pb.n, pc.v, (size_t)pc.n * 4), "case %zu", i);
        }
        size_t ends[64];
        int64_t n;
        cr_assert_eq(eng_tok_split(t, all, la + lb + lc, ends, 64, &n, NULL), KDS_OK);
        bool cut_before = la == 0, cut_after = false;
        for (int64_t k = 0; k < n; k++) {
            cut_before |= ends[k] == la;
            cut_after |= ends[k] == la + lb;
        }
        cr_expect(cut_before && cut_after, "case %zu: the invalid run is not a piece of its own",
                  i);
        free(whole.v);
        free(pa.v);
        free(pb.v);
        free(pc.v);
    }
    eng_tok_free(t);
}

Test(tok_codec, count_and_capacity) {
    eng_tokenizer *t = synth("o200k", false);
    const char *s = "The quick brown fox jumps over the lazy dog, 12345 times!";
    size_t n = strlen(s);
    int64_t need = eng_tok_encode(t, s, n, NULL, 0);
    cr_assert_gt(need, 4);
    int32_t ids[128];
    for (int i = 0; i < 128; i++)
        ids[i] = -7;
    cr_expect_eq(eng_tok_encode(t, s, n, ids, 3), need, "a short buffer still gets the count");
    cr_expect_eq(ids[3], -7, "nothing written past cap");
    int32_t full[128];
    cr_expect_eq(eng_tok_encode(t, s, n, full, 128), need);
    cr_expect(!memcmp(ids, full, 3 * sizeof *ids), "the first cap ids are the right ones");
    int64_t dn = eng_tok_decode(t, full, need, 0, NULL, 0);
    cr_expect_eq(dn, (int64_t)n);
    int32_t bad = eng_tok_vocab(t);
    cr_expect_eq(eng_tok_decode(t, &bad, 1, 0, NULL, 0), -1, "an id past the vocabulary");
    bad = -1;
    cr_expect_eq(eng_tok_decode(t, &bad, 1, 0, NULL, 0), -1, "a negative id");
    cr_expect_eq(eng_tok_encode(t, "", 0, NULL, 0), 0);
    eng_tok_free(t);
}

/* The tokenizer models get without tiktoken.model: ids are bytes, then
 * named specials, unchanged from before the tiktoken kind existed. */
Test(tok_codec, byte_tokenizer_is_bytes_then_specials) {
    eng_tokenizer *t = bytes_tok(300);
    cr_expect_str_eq(eng_tok_kind(t), "bytes");
    cr_expect_eq(eng_tok_vocab(t), 300);
    cr_expect_eq(eng_tok_bos(t), 256);
    cr_expect_eq(eng_tok_eos(t), 257);
    cr_expect(eng_tok_is_stop(t, 257));
    cr_expect(!eng_tok_is_stop(t, 'a'));
    const char *s = "h\xc3\xa9<|eos|>";
    tok_ids ids = tok_encode(t, s, strlen(s), 0);
    cr_assert_eq(ids.n, (int64_t)strlen(s));
    for (int64_t i = 0; i < ids.n; i++)
        cr_expect_eq(ids.v[i], (unsigned char)s[i]);
    free(ids.v);
    ids = tok_encode(t, s, strlen(s), ENG_TOK_ALLOW_SPECIAL);
    cr_assert_eq(ids.n, 4);
    cr_expect_eq(ids.v[3], 257);
    free(ids.v);
    size_t len;
    const char *pc = eng_tok_piece(t, 299, &len);
    cr_expect(len == strlen("<|special_299|>") && !memcmp(pc, "<|special_299|>", len));
    pc = eng_tok_piece(t, 256, &len);
    cr_expect(len == 7 && !memcmp(pc, "<|bos|>", 7));
    pc = eng_tok_piece(t, 'A', &len);
    cr_expect(len == 1 && pc[0] == 'A');
    eng_tok_free(t);
}

typedef struct job {
    const eng_tokenizer *t;
    uint64_t seed;
    uint64_t sum;
} job;

static void *encode_many(void *arg) {
    job *j = arg;
    uint64_t rng = j->seed;
    for (int i = 0; i < 200; i++) {
        tok_text x = tok_random_text(&rng, 60);
        int32_t *ids = malloc((x.n + 1) * sizeof *ids);
        int64_t n = 0;
        eng_tok_encode_ex(j->t, x.s, x.n, ENG_TOK_ALLOW_SPECIAL, ids, (int64_t)x.n, &n, NULL);
        for (int64_t k = 0; k < n; k++)
            j->sum = j->sum * 31 + (uint32_t)ids[k];
        free(ids);
        free(x.s);
    }
    return NULL;
}

/* One tokenizer, many threads: the same ids as one thread gets. */
Test(tok_codec, one_tokenizer_serves_threads, .timeout = 60) {
    eng_tokenizer *t = synth("kimi", true);
    job solo[4], par[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        solo[i] = (job){t, 100 + (uint64_t)i, 0};
        encode_many(&solo[i]);
        par[i] = (job){t, 100 + (uint64_t)i, 0};
    }
    for (int i = 0; i < 4; i++)
        pthread_create(&th[i], NULL, encode_many, &par[i]);
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 4; i++)
        cr_expect_eq(par[i].sum, solo[i].sum, "thread %d", i);
    eng_tok_free(t);
}

/* A megabyte of one character class is one huge pre-token for some
 * patterns: the heap merge keeps it O(n log n) and the regex finishes. */
Test(tok_codec, pathological_runs_finish, .timeout = 120) {
    const size_t n = 1 << 20;
    char *s = malloc(n);
    const char *fills[] = {"a", " ", "7", "!", "\n", "\xe4\xb8\xad", "a "};
    const char *patterns[] = {"cl100k", "o200k", "kimi"};
    for (int p = 0; p < 3; p++) {
        eng_tokenizer *t = synth(patterns[p], false);
        for (size_t f = 0; f < sizeof fills / sizeof fills[0]; f++) {
            size_t fl = strlen(fills[f]);
            for (size_t i = 0; i < n; i++)
                s[i] = fills[f][i % fl];
            size_t len = n - n % fl;
            double t0 = kds_now_s();
            expect_round_trip(t, s, len, fills[f]);
            fprintf(stderr, "%s: 1 MiB of '%s' in %.3f s\n", patterns[p],
                    fills[f][0] == '\n' ? "\\n" : fills[f], kds_now_s() - t0);
        }
        eng_tok_free(t);
    }
    free(s);
}

/* ---- the Kimi pattern ---- */

static void expect_split(const eng_tokenizer *t, const char *text, const char *const *want,
                         int n_want) {
    size_t ends[64];
    int64_t n;
    cr_assert_eq(eng_tok_split(t, text, strlen(text), ends, 64, &n, NULL), KDS_OK);
    bool same = n == n_want;
    for (int64_t i = 0, at = 0; same && i < n; at = (int64_t)ends[i++])
        same = strlen(want[i]) == ends[i] - (size_t)at &&
               !memcmp(text + at, want[i], ends[i] - (size_t)at);
    if (!same) {
        fprintf(stderr, "split of '%s' is:", text);
        for (int64_t i = 0, at = 0; i < n; at = (int64_t)ends[i++])
            fprintf(stderr, " [%.*s]", (int)(ends[i] - (size_t)at), text + at);
        fprintf(stderr, "\n");
    }
    cr_expect(same, "'%s' splits into %lld pieces, expected %d (pieces above)", text, (long long)n,
              n_want);
}

#define SPLIT(t, text, ...)                                                                        \
    do {                                                                                           \
        const char *const w_[] = {__VA_ARGS__};                                                    \
        expect_split(t, text, w_, (int)(sizeof w_ / sizeof w_[0]));                                \
    } while (0)

Test(tok_kimi, known_splits) {
    eng_tokenizer *t = synth("kimi", false);
    /* data-sources.md: "中文English混合" gives three pre-tokens */
    SPLIT(t,
          "\xe4\xb8\xad\xe6\x96\x87"
          "English"
          "\xe6\xb7\xb7\xe5\x90\x88",
          "\xe4\xb8\xad\xe6\x96\x87", "English", "\xe6\xb7\xb7\xe5\x90\x88");
    SPLIT(t, "Hello world", "Hello", " world");
    SPLIT(t, "Hello, world!", "Hello", ",", " world", "!");
    SPLIT(t, "\xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c",
          "\xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c");
    SPLIT(t, "1234567890", "123", "456", "789", "0");
    /* CJK punctuation is not Han (Script, not Script_Extensions) */
    SPLIT(t, "\xe4\xb8\xad\xe6\x96\x87\xe3\x80\x81\xe8\x8b\xb1\xe6\x96\x87\xe3\x80\x82",
          "\xe4\xb8\xad\xe6\x96\x87", "\xe3\x80\x81", "\xe8\x8b\xb1\xe6\x96\x87", "\xe3\x80\x82");
    /* kana is a letter but not Han: it joins the letter branches */
    SPLIT(t, "Kimi\xe3\x81\xae\xe6\xa8\xa1\xe5\x9e\x8b", "Kimi\xe3\x81\xae",
          "\xe6\xa8\xa1\xe5\x9e\x8b");
    /* contractions stay on their word (unlike cl100k, which splits them off) */
    SPLIT(t, "don't STOP'LL we're", "don't", " STOP'LL", " we're");
    SPLIT(t, "a  \n\n  b", "a", "  \n\n", " ", " b");
    SPLIT(t, "x //y", "x", " //", "y");
    eng_tok_free(t);
}

static bool has_end(const size_t *ends, int64_t n, size_t at) {
    for (int64_t i = 0; i < n; i++)
        if (ends[i] == at) return true;
    return false;
}

/* Kimi's encode() cuts the text before tiktoken: every 400,000 characters,
 * and where a run of whitespace or non-whitespace passes 25,000 characters
 * (tokenization_kimi.py). The kimi preset cuts in the same places; the
 * OpenAI presets do not cut. */
Test(tok_kimi, long_texts_are_cut_where_kimi_cuts_them, .timeout = 60) {
    eng_tokenizer *k = synth("kimi", false), *c = synth("cl100k", false);
    /* "h\xc3\xa9llo w\xc3\xb6rld " is 12 characters, 14 bytes: character 400,000
     * falls inside a word (400,000 = 12 * 33,333 + 4: after "h\xc3\xa9ll") */
    const char unit[] = "h\xc3\xa9llo w\xc3\xb6rld ";
    size_t ul = sizeof unit - 1, reps = 33334, n = ul * reps;
    char *s = malloc(n);
    for (size_t r = 0; r < reps; r++)
        memcpy(s + r * ul, unit, ul);
    size_t cut = 33333 * ul + 5; /* the byte offset of character 400,000 */
    size_t *ends = malloc(n * sizeof *ends);
    int64_t m;
    cr_assert_eq(eng_tok_split(k, s, n, ends, (int64_t)n, &m, NULL), KDS_OK);
    cr_expect(has_end(ends, m, cut), "kimi: no cut at character 400,000");
    cr_expect(!has_end(ends, m, cut - 1), "the cut falls inside a word");
    tok_ids whole = tok_encode(k, s, n, 0), a = tok_encode(k, s, cut, 0),
            b = tok_encode(k, s + cut, n - cut, 0);
    cr_expect(whole.n == a.n + b.n && !memcmp(whole.v, a.v, (size_t)a.n * 4) &&
                  !memcmp(whole.v + a.n, b.v, (size_t)b.n * 4),
              "kimi: encoding is that of the two slices");
    cr_assert_eq(eng_tok_split(c, s, n, ends, (int64_t)n, &m, NULL), KDS_OK);
    cr_expect(!has_end(ends, m, cut), "cl100k does not cut");
    free(whole.v);
    free(a.v);
    free(b.v);
    /* runs: 30,000 letters, then 60,000 spaces, then a letter */
    n = 90001;
    memset(s, 'x', 30000);
    memset(s + 30000, ' ', 60000);
    s[90000] = 'y';
    cr_assert_eq(eng_tok_split(k, s, n, ends, (int64_t)n, &m, NULL), KDS_OK);
    cr_expect(has_end(ends, m, 25000), "kimi: a 30,000-letter run is cut after 25,000");
    cr_expect(has_end(ends, m, 55000) && has_end(ends, m, 80000), "kimi: space runs are cut");
    cr_assert_eq(eng_tok_split(c, s, n, ends, (int64_t)n, &m, NULL), KDS_OK);
    cr_expect(!has_end(ends, m, 25000), "cl100k: one piece of 30,000 letters");
    /* U+001C..U+001F are spaces to Python (not to the regex): 25,001 of them cut */
    memset(s, 0x1c, 25001);
    cr_assert_eq(eng_tok_split(k, s, 25001, ends, (int64_t)n, &m, NULL), KDS_OK);
    cr_expect(has_end(ends, m, 25000));
    free(ends);
    free(s);
    eng_tok_free(k);
    eng_tok_free(c);
}

/* Moonshot's own ids, from tiktoken with the real file (data-sources.md):
 * runs when KDS_KIMI_TIKTOKEN names a Kimi-K2/Kimi-Linear tiktoken.model. */
Test(tok_kimi, real_vocabulary_gives_moonshot_ids) {
    const char *path = getenv("KDS_KIMI_TIKTOKEN");
    if (!path || !*path) {
        cr_skip_test("set KDS_KIMI_TIKTOKEN to a Kimi tiktoken.model to check Moonshot's ids");
        return;
    }
    eng_tokenizer *t = tok_load(path, "kimi", true);
    const struct {
        const char *s;
        int32_t ids[8];
        int n;
    } v[] = {{"Hello world", {19180, 2695}, 2},
             {"Hello, world!", {19180, 11, 2695, 0}, 4},
             {"\xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c", {33845, 2243}, 2},
             {"1234567890", {6694, 12972, 16242, 15}, 4},
             {"\xe4\xb8\xad\xe6\x96\x87"
              "English"
              "\xe6\xb7\xb7\xe5\x90\x88",
              {16717, 44372, 13935},
              3}};
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        tok_ids got = tok_encode(t, v[i].s, strlen(v[i].s), 0);
        cr_expect(got.n == v[i].n && !memcmp(got.v, v[i].ids, (size_t)v[i].n * 4),
                  "'%s' encodes differently from Moonshot's tokenizer", v[i].s);
        free(got.v);
    }
    cr_expect_eq(eng_tok_special_id(t, "<|im_end|>"), 163586);
    cr_expect_eq(eng_tok_special_id(t, "[EOS]"), 163585);
    eng_tok_free(t);
}

/* ---- streaming decode ---- */

static bool valid_utf8(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        int st;
        size_t k = eng__utf8_scan((const unsigned char *)s + i, n - i, &st);
        if (st != ENG_U8_OK) return false;
        i += k;
    }
    return true;
}

/* Feed ids, check every chunk is whole UTF-8, return the concatenation. */
static char *stream_all(const eng_tokenizer *t, const int32_t *ids, int64_t n, unsigned flags,
                        size_t *len) {
    eng_tok_stream *s = NULL;
    cr_assert_eq(eng_tok_stream_create(t, flags, &s, NULL), KDS_OK);
    char *all = malloc(16 * (size_t)(n + 1) + 64);
    size_t o = 0;
    for (int64_t i = 0; i < n; i++) {
        const char *c;
        size_t cl;
        cr_assert_eq(eng_tok_stream_put(s, ids[i], &c, &cl, NULL), KDS_OK);
        cr_expect(valid_utf8(c, cl), "chunk %lld is not whole UTF-8", (long long)i);
        memcpy(all + o, c, cl);
        o += cl;
    }
    size_t cl;
    const char *c = eng_tok_stream_flush(s, &cl);
    memcpy(all + o, c, cl);
    o += cl;
    eng_tok_stream_free(s);
    *len = o;
    return all;
}

Test(tok_stream, never_emits_half_a_character) {
    eng_tokenizer *t = synth("o200k", false);
    const char *text = TRAIN;
    tok_ids ids = tok_encode(t, text, strlen(text), 0);
    int split_chars = 0; /* tokens that end inside a character */
    for (int64_t i = 0; i < ids.n; i++) {
        size_t pl;
        const char *pc = eng_tok_piece(t, ids.v[i], &pl);
        split_chars += !valid_utf8(pc, pl);
    }
    cr_assert_gt(split_chars, 0, "the test needs tokens that cut characters");
    size_t n;
    char *out = stream_all(t, ids.v, ids.n, 0, &n);
    cr_expect(n == strlen(text) && !memcmp(out, text, n), "the stream's text differs");
    free(out);
    free(ids.v);
    eng_tok_free(t);
}

Test(tok_stream, one_byte_at_a_time_waits_for_whole_characters) {
    eng_tokenizer *t = bytes_tok(258);
    const char *text = "a\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80z"; /* a é € 😀 z */
    size_t emitted_at[16] = {0}, n = strlen(text);
    eng_tok_stream *s = NULL;
    cr_assert_eq(eng_tok_stream_create(t, 0, &s, NULL), KDS_OK);
    for (size_t i = 0; i < n; i++) {
        const char *c;
        size_t cl;
        cr_assert_eq(eng_tok_stream_put(s, (unsigned char)text[i], &c, &cl, NULL), KDS_OK);
        emitted_at[i] = cl;
    }
    size_t want[] = {1, 0, 2, 0, 0, 3, 0, 0, 0, 4, 1};
    for (size_t i = 0; i < n; i++)
        cr_expect_eq(emitted_at[i], want[i], "after byte %zu: %zu bytes out, expected %zu", i,
                     emitted_at[i], want[i]);
    size_t fl;
    eng_tok_stream_flush(s, &fl);
    cr_expect_eq(fl, 0);
    int32_t bad = 258;
    const char *c = NULL;
    size_t cl = 99;
    cr_expect_eq(eng_tok_stream_put(s, bad, &c, &cl, NULL), KDS_INVALID_ARG);
    eng_tok_stream_free(s);
    eng_tok_free(t);
}

/* Ill-formed bytes: U+FFFD per maximal subpart (Unicode 3-7, WHATWG). */
Test(tok_stream, invalid_bytes_become_replacement_characters) {
    eng_tokenizer *t = bytes_tok(256);
#define R "\xef\xbf\xbd"
    const struct {
        const char *in, *out;
    } cases[] = {
        {"\xe4\xb8", R}, /* cut off at the end: flushed as one */
        {"\xe4\xb8"
         "A",
         R "A"},
        {"\xf0\x9f\x98"
         "A",
         R "A"},
        {"\xc0\xaf", R R},             /* overlong lead, stray continuation */
        {"\xed\xa0\x80", R R R},       /* a surrogate */
        {"\xf4\x90\x80\x80", R R R R}, /* past U+10FFFF */
        {"\xff", R},
        {"\x80\x80", R R},
        {"a\xe2\x82\xac"
         "b",
         "a\xe2\x82\xac"
         "b"},
        {"\xe2\x82\xe2\x82\xac", R "\xe2\x82\xac"},
    };
#undef R
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t n = strlen(cases[i].in), got_n;
        int32_t ids[16];
        for (size_t k = 0; k < n; k++)
            ids[k] = (unsigned char)cases[i].in[k];
        char *got = stream_all(t, ids, (int64_t)n, 0, &got_n);
        cr_expect(got_n == strlen(cases[i].out) && !memcmp(got, cases[i].out, got_n),
                  "case %zu: got %zu bytes", i, got_n);
        free(got);
    }
    eng_tok_free(t);
}

Test(tok_stream, specials_print_or_skip) {
    eng_tokenizer *t = bytes_tok(258); /* 257 = <|eos|> */
    int32_t ids[] = {0xe2, 0x82, 257, 0xac, 'x'};
    size_t n;
    char *s = stream_all(t, ids, 5, ENG_TOK_SKIP_SPECIAL, &n);
    cr_expect(n == 4 && !memcmp(s,
                                "\xe2\x82\xac"
                                "x",
                                4),
              "a skipped special leaves the "
              "character it interrupts whole");
    free(s);
    s = stream_all(t, ids, 5, 0, &n);
    const char *want = "\xef\xbf\xbd<|eos|>\xef\xbf\xbdx";
    cr_expect(n == strlen(want) && !memcmp(s, want, n), "a printed special cuts the character");
    free(s);
    char buf[32];
    cr_expect_eq(eng_tok_decode(t, ids, 5, ENG_TOK_SKIP_SPECIAL, buf, sizeof buf), 4);
    cr_expect_eq(eng_tok_decode(t, ids, 5, 0, buf, sizeof buf), 11);
    eng_tok_free(t);
}
