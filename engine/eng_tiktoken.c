/*
 * eng_tiktoken.c - tiktoken-format byte-level BPE: rank files, the
 * pre-tokenisation presets (PCRE2 with JIT), special tokens, and encoding.
 *
 * Encoding is tiktoken's, step for step, so that ids match OpenAI's tiktoken
 * (tests/test_tok_ref.c runs tiktoken itself):
 *   1. with ENG_TOK_ALLOW_SPECIAL, cut the text at special-token names;
 *   2. split each ordinary segment into pieces with the preset's regex,
 *      match after match from the end of the last one (find_iter);
 *   3. a piece that is itself a token is that token; otherwise merge its
 *      bytes, always the adjacent pair whose concatenation has the lowest
 *      rank (leftmost on ties), until no adjacent pair is a token.
 * Our addition: tiktoken only sees valid UTF-8, so invalid bytes get a rule
 * of our own (eng.h): the segment is cut into maximal valid runs, which are
 * regex-split, and maximal invalid runs, which are BPE-merged as one piece.
 * We validate first rather than using PCRE2_MATCH_INVALID_UTF because a
 * valid run can then be matched without any UTF checks (the fast path of
 * every real text), and because the rule is simple to state.
 *
 * The regexes are tiktoken's (fancy-regex syntax) rewritten for PCRE2 with
 * the same meaning: `\s` becomes the explicit White_Space set (PCRE2's UCP
 * `\s` also takes U+180E, which Unicode stopped calling a space), Kimi's
 * class intersections `[X&&[^\p{Han}]]` become `(?:(?!\p{sc:Han})X)`, PCRE2
 * having no `&&`, and \p{Han} is spelt \p{sc:Han} (see HAN below). The
 * tests compare with tiktoken's own regex engine, which caught both of the
 * last two.
 */
#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#define XXH_INLINE_ALL /* the short-key paths of XXH3 inline into the merge loop */
#include <xxhash.h>

#include "eng_tokenizer.h"
#include "eng_util.h"

/* Rank files larger than this are not tokenizers (o200k: 3.6 MB, Kimi's
 * 163K ranks: ~2.5 MB). */
#define TOK_MAX_RANK_FILE ((size_t)512 << 20)
#define TOK_MAX_JSON_FILE ((size_t)64 << 20)
/* Pieces up to this many bytes use tiktoken's own O(n*m) merge loop on a
 * stack array (fastest for the short pieces real text is made of); longer
 * ones (long runs of spaces, digits-free letter soups, invalid bytes) use a
 * heap, O(n log n), which picks the same pairs in the same order. */
#define TOK_SMALL_PIECE 128
#define TOK_EMPTY UINT32_MAX

/* ------------------------------------------------------------------------ */
/* Presets                                                                   */

/* Unicode White_Space, what `\s` means in tiktoken's (Rust) regexes. */
#define WS                                                                                         \
    "\\t-\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}" \
    "\\x{3000}"
#define CONTRACTION "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
#define NOT_LN "[^\\r\\n\\p{L}\\p{N}]"
#define PUNCT "[^" WS "\\p{L}\\p{N}]"
#define SPACE_TAIL "|[" WS "]*[\\r\\n]+|[" WS "]+(?![^" WS "])|[" WS "]+"
#define UPPER "[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]"
#define LOWER "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]"
/* Kimi's \p{Han}: the Script property, as Rust's regex crate reads
 * \p{Han} (PCRE2 >= 10.40 reads the bare name as Script_Extensions, which
 * would also take CJK punctuation such as U+3001 into Han runs). */
#define HAN "\\p{sc:Han}"
#define UPPER_NO_HAN "(?:(?!" HAN ")" UPPER ")"
#define LOWER_NO_HAN "(?:(?!" HAN ")" LOWER ")"

static const char RE_CL100K[] =
    CONTRACTION "|" NOT_LN "?\\p{L}+|\\p{N}{1,3}| ?" PUNCT "+[\\r\\n]*" SPACE_TAIL;
static const char RE_O200K[] =
    NOT_LN "?" UPPER "*" LOWER "+" CONTRACTION "?|" NOT_LN "?" UPPER "+" LOWER "*" CONTRACTION
           "?|\\p{N}{1,3}| ?" PUNCT "+[\\r\\n/]*" SPACE_TAIL;
static const char RE_KIMI[] = "[" HAN "]+|" NOT_LN "?" UPPER_NO_HAN "*" LOWER_NO_HAN "+" CONTRACTION
                              "?|" NOT_LN "?" UPPER_NO_HAN "+" LOWER_NO_HAN "*" CONTRACTION
                              "?|\\p{N}{1,3}| ?" PUNCT "+[\\r\\n]*" SPACE_TAIL;

typedef struct preset_special {
    const char *name;
    int32_t id;
} preset_special;

static const preset_special CL100K_SPECIALS[] = {{"<|endoftext|>", 100257},
                                                 {"<|fim_prefix|>", 100258},
                                                 {"<|fim_middle|>", 100259},
                                                 {"<|fim_suffix|>", 100260},
                                                 {"<|endofprompt|>", 100276}};
static const preset_special O200K_SPECIALS[] = {{"<|endoftext|>", 199999},
                                                {"<|endofprompt|>", 200018}};
/* Kimi-K2's named specials, as offsets from the number of ranks (163584 in
 * the real file); the other slots of 256 are <|reserved_token_ID|>
 * (kda-model-spec.md section 7, tokenization_kimi.py). */
static const preset_special KIMI_SPECIALS[] = {{"[BOS]", 0},
                                               {"[EOS]", 1},
                                               {"<|im_end|>", 2},
                                               {"<|im_user|>", 3},
                                               {"<|im_assistant|>", 4},
                                               {"<|start_header_id|>", 6},
                                               {"<|end_header_id|>", 7},
                                               {"[EOT]", 9},
                                               {"<|im_system|>", 10},
                                               {"<|tool_calls_section_begin|>", 11},
                                               {"<|tool_calls_section_end|>", 12},
                                               {"<|tool_call_begin|>", 13},
                                               {"<|tool_call_argument_begin|>", 14},
                                               {"<|tool_call_end|>", 15},
                                               {"<|im_middle|>", 17},
                                               {"[UNK]", 254},
                                               {"[PAD]", 255}};
#define KIMI_RESERVED 256

typedef struct tok_preset {
    const char *name;
    const char *regex;
    const preset_special *specials;
    int n_specials;
    bool relative; /* special ids are offsets from the number of ranks */
    int reserved;  /* slots [n_ranks, n_ranks + reserved) filled with reserved names */
    const char *bos, *eos;
    bool kimi_slices;
} tok_preset;

#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))
static const tok_preset PRESETS[] = {
    {"cl100k", RE_CL100K, CL100K_SPECIALS, N_OF(CL100K_SPECIALS), false, 0, NULL, "<|endoftext|>",
     false},
    {"o200k", RE_O200K, O200K_SPECIALS, N_OF(O200K_SPECIALS), false, 0, NULL, "<|endoftext|>",
     false},
    {"kimi", RE_KIMI, KIMI_SPECIALS, N_OF(KIMI_SPECIALS), true, KIMI_RESERVED, "[BOS]", "[EOS]",
     true},
    {"none", NULL, NULL, 0, false, 0, NULL, NULL, false},
};

static const tok_preset *find_preset(const char *name) {
    if (!name) name = "none";
    /* tiktoken's encoding names are accepted too */
    if (!strcmp(name, "cl100k_base")) name = "cl100k";
    if (!strcmp(name, "o200k_base")) name = "o200k";
    for (int i = 0; i < N_OF(PRESETS); i++)
        if (!strcmp(PRESETS[i].name, name)) return &PRESETS[i];
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* Files                                                                     */


static int b64_val(unsigned char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Standard base64 with '=' padding, as Python's b64decode reads a rank file.
 * Returns the decoded length, or -1. */
static long b64_decode(const char *s, size_t n, unsigned char *out) {
    if (n == 0 || n % 4) return -1;
    size_t pad = s[n - 1] == '=' ? (s[n - 2] == '=' ? 2 : 1) : 0;
    long o = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4];
        for (int k = 0; k < 4; k++) {
            bool padding = i + 4 == n && k >= 4 - (int)pad;
            v[k] = padding ? 0 : b64_val((unsigned char)s[i + k]);
            if (v[k] < 0) return -1;
        }
        uint32_t w =
            (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[o++] = (unsigned char)(w >> 16);
        if (!(i + 4 == n && pad == 2)) out[o++] = (unsigned char)(w >> 8);
        if (!(i + 4 == n && pad >= 1)) out[o++] = (unsigned char)w;
    }
    return o;
}

void eng__tok_rankset_free(eng__tok_rankset *rs) {
    if (!rs) return;
    free(rs->bytes);
    free(rs->rank);
    free(rs->off);
    free(rs->len);
    free(rs->line);
    memset(rs, 0, sizeof *rs);
}

static bool is_blank(char c) {
    return c == ' ' || c == '\t';
}

kds_status eng__tok_parse_ranks(const char *text, size_t len, const char *path,
                                eng__tok_rankset *rs, kds_err *err) {
    kds_status rc = KDS_OK;
    uint32_t *seen = NULL; /* line of each rank + 1, 0 = not seen */
    memset(rs, 0, sizeof *rs);
    size_t lines = 1;
    for (size_t i = 0; i < len; i++)
        lines += text[i] == '\n';
    rs->bytes = malloc(len / 4 * 3 + 4);
    rs->rank = malloc(lines * sizeof *rs->rank);
    rs->off = malloc(lines * sizeof *rs->off);
    rs->len = malloc(lines * sizeof *rs->len);
    rs->line = malloc(lines * sizeof *rs->line);
    if (!rs->bytes || !rs->rank || !rs->off || !rs->len || !rs->line) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory reading %s", path);
        goto fail;
    }
    rs->max_rank = -1;
    const char *p = text, *end = text + len;
    for (int line = 1; p < end; line++) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *le = nl ? nl : end, *next = nl ? nl + 1 : end;
        if (le > p && le[-1] == '\r') le--;
        const char *f[3][2];
        int nf = 0;
        for (const char *q = p; q < le;) {
            while (q < le && is_blank(*q))
                q++;
            if (q == le) break;
            const char *s = q;
            while (q < le && !is_blank(*q))
                q++;
            if (nf < 3) {
                f[nf][0] = s;
                f[nf][1] = q;
            }
            nf++;
        }
        p = next;
        if (nf == 0) continue; /* blank lines are allowed, as tiktoken's loader allows them */
        if (nf != 2) {
            rc = kds_err_set(err, KDS_BAD_FORMAT,
                             "%s:%d: expected 'base64-token rank', found %d field%s", path, line,
                             nf, nf == 1 ? "" : "s");
            goto fail;
        }
        size_t tl = (size_t)(f[0][1] - f[0][0]);
        long n = tl <= (size_t)ENG_TOK_MAX_TOKEN_BYTES / 3 * 4 + 4
                     ? b64_decode(f[0][0], tl, (unsigned char *)rs->bytes + rs->n_bytes)
                     : -2;
        if (n == -2 || n > ENG_TOK_MAX_TOKEN_BYTES) {
            rc = kds_err_set(err, KDS_BAD_FORMAT, "%s:%d: token longer than %d bytes", path, line,
                             ENG_TOK_MAX_TOKEN_BYTES);
            goto fail;
        }
        if (n <= 0) {
            rc = kds_err_set(err, KDS_BAD_FORMAT, "%s:%d: token '%.*s' is not base64%s", path, line,
                             tl > 40 ? 40 : (int)tl, f[0][0], n == 0 ? " of 1+ bytes" : "");
            goto fail;
        }
        uint64_t r = 0;
        size_t rl = (size_t)(f[1][1] - f[1][0]);
        bool ok = rl > 0 && rl <= 9;
        for (size_t k = 0; ok && k < rl; k++) {
            char c = f[1][0][k];
            ok = c >= '0' && c <= '9';
            r = r * 10 + (uint64_t)(c - '0');
        }
        if (!ok || r >= ENG_TOK_MAX_ID) {
            rc = kds_err_set(err, KDS_BAD_FORMAT, "%s:%d: rank '%.*s' is not an integer in [0, %d)",
                             path, line, rl > 20 ? 20 : (int)rl, f[1][0], ENG_TOK_MAX_ID);
            goto fail;
        }
        rs->rank[rs->n] = (uint32_t)r;
        rs->off[rs->n] = (uint32_t)rs->n_bytes;
        rs->len[rs->n] = (uint32_t)n;
        rs->line[rs->n] = (uint32_t)line;
        rs->n++;
        rs->n_bytes += (size_t)n;
        if ((int32_t)r > rs->max_rank) rs->max_rank = (int32_t)r;
    }
    if (rs->n == 0) {
        rc = kds_err_set(err, KDS_BAD_FORMAT, "%s: no ranks in the file", path);
        goto fail;
    }
    seen = calloc((size_t)rs->max_rank + 1, sizeof *seen);
    if (!seen) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory reading %s", path);
        goto fail;
    }
    bool have_byte[256] = {0};
    for (int i = 0; i < rs->n; i++) {
        uint32_t r = rs->rank[i];
        if (seen[r]) {
            rc = kds_err_set(err, KDS_BAD_FORMAT, "%s:%u: rank %u was already given on line %u",
                             path, rs->line[i], r, seen[r] - 1);
            goto fail;
        }
        seen[r] = rs->line[i] + 1;
        if (rs->len[i] == 1) have_byte[(unsigned char)rs->bytes[rs->off[i]]] = true;
    }
    for (int b = 0; b < 256; b++)
        if (!have_byte[b]) {
            rc = kds_err_set(err, KDS_BAD_FORMAT,
                             "%s: no token for the single byte 0x%02x (a byte-level BPE needs all "
                             "256 to encode any text)",
                             path, b);
            goto fail;
        }
    free(seen);
    return KDS_OK;
fail:
    free(seen);
    eng__tok_rankset_free(rs);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* The rank map                                                              */

/* 8 bytes that, with the length, identify a token of <= 8 bytes (and start
 * the comparison of longer ones). Two overlapping loads instead of a
 * variable-length copy: branch-light and the same at insert and lookup. */
static inline uint64_t key8(const unsigned char *p, size_t n) {
    uint32_t a, b;
    uint64_t v;
    if (n >= 8) {
        memcpy(&v, p, 8);
        return v;
    }
    if (n >= 4) {
        memcpy(&a, p, 4);
        memcpy(&b, p + n - 4, 4);
        return (uint64_t)a | (uint64_t)b << 32;
    }
    return (uint64_t)p[0] | (uint64_t)p[n >> 1] << 8 | (uint64_t)p[n - 1] << 16;
}

static inline uint64_t tok_hash(const unsigned char *p, size_t n, uint64_t k8) {
    if (n > 8) return XXH3_64bits(p, n);
    uint64_t x = k8 + n * 0x9E3779B97F4A7C15ull; /* splitmix64 finaliser */
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* The rank (= id) of the token with bytes p[0..n), or TOK_EMPTY. */
static inline uint32_t rank_of(const eng_tokenizer *t, const unsigned char *p, size_t n) {
    if (n == 2) return t->pair_rank[(size_t)p[0] << 8 | p[1]];
    uint64_t k8 = key8(p, n);
    for (uint64_t i = tok_hash(p, n, k8) & t->mask;; i = (i + 1) & t->mask) {
        const eng__tok_slot *s = &t->slots[i];
        if (s->id == TOK_EMPTY) return TOK_EMPTY;
        if (s->len == n && s->key8 == k8 &&
            (n <= 8 || !memcmp(t->arena + t->piece[s->id].off + 8, p + 8, n - 8)))
            return s->id;
    }
}

/* Insert rank `id`; returns the id already holding these bytes, or TOK_EMPTY. */
static uint32_t rank_insert(eng_tokenizer *t, uint32_t id) {
    const unsigned char *p = (const unsigned char *)t->arena + t->piece[id].off;
    size_t n = t->piece[id].len;
    uint32_t have = rank_of(t, p, n);
    if (have != TOK_EMPTY) return have;
    if (n == 2) {
        t->pair_rank[(size_t)p[0] << 8 | p[1]] = id;
        return TOK_EMPTY;
    }
    uint64_t k8 = key8(p, n);
    uint64_t i = tok_hash(p, n, k8) & t->mask;
    while (t->slots[i].id != TOK_EMPTY)
        i = (i + 1) & t->mask;
    t->slots[i] = (eng__tok_slot){.key8 = k8, .id = id, .len = (uint32_t)n};
    return TOK_EMPTY;
}

/* ------------------------------------------------------------------------ */
/* Building                                                                  */

void eng__tok_specials_free(eng__tok_special *sp, int n) {
    if (!sp) return;
    for (int i = 0; i < n; i++)
        free(sp[i].name);
    free(sp);
}

typedef struct spec_key {
    const char *name;
    uint32_t len;
    int32_t id;
} spec_key;

/* By first byte, longest first, then by name (so that a name given twice
 * ends up adjacent), then by id. */
static int spec_cmp(const void *a, const void *b) {
    const spec_key *x = a, *y = b;
    unsigned char fx = (unsigned char)x->name[0], fy = (unsigned char)y->name[0];
    if (fx != fy) return fx - fy;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    int c = memcmp(x->name, y->name, x->len);
    return c ? c : (x->id > y->id) - (x->id < y->id);
}

static bool utf8_valid(const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n;) {
        int st;
        size_t k = eng__utf8_scan(p + i, n - i, &st);
        if (st != ENG_U8_OK) return false;
        i += k;
    }
    return true;
}

static kds_status compile_pattern(eng_tokenizer *t, const tok_preset *ps, kds_err *err) {
    if (!ps->regex) return KDS_OK;
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)ps->regex, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP, &ec, &eo, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        return kds_err_set(err, KDS_INTERNAL, "pre-tokeniser '%s': PCRE2 refuses it at %zu: %s",
                           ps->name, (size_t)eo, (const char *)msg);
    }
    /* Without JIT (a platform PCRE2 has no JIT for) the interpreter gives
     * the same matches, only slower. */
    t->jit = pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) == 0;
    t->re = re;
    return KDS_OK;
}

kds_status eng__tok_build(const eng__tok_rankset *rs, const char *path, const eng__tok_special *sp,
                          int n_sp, const char *pattern, int vocab, eng_tokenizer **out,
                          kds_err *err) {
    kds_status rc = KDS_OK;
    spec_key *keys = NULL;
    eng_tokenizer *t = NULL;
    const char *where = path ? path : "tokenizer";
    *out = NULL;
    const tok_preset *ps = find_preset(pattern);
    if (!ps)
        return kds_err_set(err, KDS_INVALID_ARG,
                           "unknown pre-tokeniser '%s' (known: cl100k, o200k, kimi, none)",
                           pattern);
    int64_t max_id = rs->max_rank;
    size_t arena = rs->n_bytes;
    for (int i = 0; i < n_sp; i++) {
        if (sp[i].id < 0 || sp[i].id >= ENG_TOK_MAX_ID)
            return kds_err_set(err, KDS_INVALID_ARG, "special '%s' has id %d, outside [0, %d)",
                               sp[i].name, sp[i].id, ENG_TOK_MAX_ID);
        size_t nl = strlen(sp[i].name);
        if (nl == 0 || nl > ENG_TOK_MAX_TOKEN_BYTES ||
            !utf8_valid((const unsigned char *)sp[i].name, nl))
            return kds_err_set(err, KDS_INVALID_ARG,
                               "special token %d: its name must be 1..%d bytes of UTF-8", sp[i].id,
                               ENG_TOK_MAX_TOKEN_BYTES);
        if (sp[i].id > max_id) max_id = sp[i].id;
        arena += nl;
    }
    if (vocab == 0) vocab = (int)max_id + 1;
    if (vocab < max_id + 1)
        return kds_err_set(err, KDS_MISMATCH, "%s: id %lld does not fit a vocabulary of %d tokens",
                           where, (long long)max_id, vocab);
    if (vocab > ENG_TOK_MAX_ID)
        return kds_err_set(err, KDS_INVALID_ARG, "vocabulary of %d tokens is larger than %d", vocab,
                           ENG_TOK_MAX_ID);

    t = calloc(1, sizeof *t);
    if (!t) goto nomem;
    t->vocab = vocab;
    t->bos = t->eos = -1;
    snprintf(t->kind_name, sizeof t->kind_name, "tiktoken/%s", ps->name);
    t->kind = calloc((size_t)vocab, 1);
    t->piece = calloc((size_t)vocab, sizeof *t->piece);
    t->arena = malloc(arena + 1);
    size_t slots = 64;
    while (slots < (size_t)rs->n * 2)
        slots *= 2; /* load factor <= 1/2 */
    t->slots = malloc(slots * sizeof *t->slots);
    t->pair_rank = malloc(65536 * sizeof *t->pair_rank);
    if (!t->kind || !t->piece || !t->arena || !t->slots || !t->pair_rank) goto nomem;
    memset(t->slots, 0xff, slots * sizeof *t->slots); /* id = TOK_EMPTY everywhere */
    memset(t->pair_rank, 0xff, 65536 * sizeof *t->pair_rank);
    t->mask = slots - 1;

    memcpy(t->arena, rs->bytes, rs->n_bytes);
    size_t used = rs->n_bytes;
    t->bytes_only = true;
    for (int i = 0; i < 256; i++)
        t->byte_rank[i] = -1;
    for (int i = 0; i < rs->n; i++) {
        uint32_t id = rs->rank[i];
        t->kind[id] = TOK_RANK;
        t->piece[id] = (eng__tok_piece){.off = rs->off[i], .len = rs->len[i]};
        if (rs->len[i] > t->max_piece) t->max_piece = rs->len[i];
        if (rs->len[i] == 1)
            t->byte_rank[(unsigned char)rs->bytes[rs->off[i]]] = (int32_t)id;
        else
            t->bytes_only = false;
        uint32_t dup = rank_insert(t, id);
        if (dup != TOK_EMPTY) {
            rc = kds_err_set(err, KDS_BAD_FORMAT,
                             "%s:%u: the token of rank %u repeats the token of rank %u", where,
                             rs->line ? rs->line[i] : 0, id, dup);
            goto fail;
        }
    }
    for (int b = 0; b < 256; b++)
        if (t->byte_rank[b] < 0) {
            rc = kds_err_set(err, KDS_BAD_FORMAT, "%s: no token for the single byte 0x%02x", where,
                             b);
            goto fail;
        }

    keys = malloc((size_t)(n_sp ? n_sp : 1) * sizeof *keys);
    t->spec = malloc((size_t)(n_sp ? n_sp : 1) * sizeof *t->spec);
    if (!keys || !t->spec) goto nomem;
    for (int i = 0; i < n_sp; i++) {
        int32_t id = sp[i].id;
        if (t->kind[id] != TOK_UNUSED) {
            rc =
                kds_err_set(err, KDS_INVALID_ARG, "special '%s' has id %d, which is already %s",
                            sp[i].name, id, t->kind[id] == TOK_RANK ? "a rank" : "another special");
            goto fail;
        }
        size_t nl = strlen(sp[i].name);
        memcpy(t->arena + used, sp[i].name, nl);
        t->kind[id] = TOK_SPECIAL;
        t->piece[id] = (eng__tok_piece){.off = (uint32_t)used, .len = (uint32_t)nl};
        used += nl;
        if (nl > t->max_piece) t->max_piece = nl;
        keys[i] = (spec_key){.name = sp[i].name, .len = (uint32_t)nl, .id = id};
    }
    qsort(keys, (size_t)n_sp, sizeof *keys, spec_cmp);
    for (int i = 0; i < n_sp; i++) {
        if (i > 0 && keys[i].len == keys[i - 1].len &&
            !memcmp(keys[i].name, keys[i - 1].name, keys[i].len)) {
            rc = kds_err_set(err, KDS_INVALID_ARG, "special '%.*s' has two ids, %d and %d",
                             (int)keys[i].len, t->arena + t->piece[keys[i].id].off, keys[i - 1].id,
                             keys[i].id);
            goto fail;
        }
        t->spec[i] = keys[i].id;
    }
    t->n_spec = n_sp;
    for (int b = 0, i = 0; b <= 256; b++) {
        while (i < n_sp && (unsigned char)keys[i].name[0] < b)
            i++;
        t->spec_start[b] = i;
    }
    t->kimi_slices = ps->kimi_slices;
    rc = compile_pattern(t, ps, err);
    if (rc != KDS_OK) goto fail;
    free(keys);
    *out = t;
    return KDS_OK;
nomem:
    rc = kds_err_set(err, KDS_NOMEM, "out of memory building the tokenizer of %s", where);
fail:
    free(keys);
    eng_tok_free(t);
    return rc;
}

void eng_tok_free(eng_tokenizer *t) {
    if (!t) return;
    pcre2_code_free((pcre2_code *)t->re);
    free(t->kind);
    free(t->piece);
    free(t->arena);
    free(t->slots);
    free(t->pair_rank);
    free(t->spec);
    free(t);
}

void eng__tok_free(eng_tokenizer *t) {
    eng_tok_free(t);
}

int32_t eng_tok_special_id(const eng_tokenizer *t, const char *name) {
    size_t nl = strlen(name);
    if (nl == 0) return -1;
    unsigned char b = (unsigned char)name[0];
    for (int i = t->spec_start[b]; i < t->spec_start[b + 1]; i++) {
        const eng__tok_piece *pc = &t->piece[t->spec[i]];
        if (pc->len == nl && !memcmp(t->arena + pc->off, name, nl)) return t->spec[i];
    }
    return -1;
}

void eng__tok_set_stops(eng_tokenizer *t) {
    static const char *const ENDS[] = {"<|im_end|>", "[EOS]", "<|endoftext|>", "<|end_of_msg|>"};
    t->n_stops = 0;
    if (t->eos >= 0) t->stops[t->n_stops++] = t->eos;
    for (int i = 0; i < N_OF(ENDS); i++) {
        int32_t id = eng_tok_special_id(t, ENDS[i]);
        if (id >= 0 && id != t->eos && t->n_stops < ENG_TOK_MAX_STOPS) t->stops[t->n_stops++] = id;
    }
}

/* ------------------------------------------------------------------------ */
/* Specials from JSON and presets                                            */

/* Append a special (name copied). */
static bool push_special(eng__tok_special **sp, int *n, int *cap, const char *name, size_t nl,
                         int32_t id) {
    if (*n == *cap) {
        int nc = *cap ? *cap * 2 : 16;
        eng__tok_special *g = realloc(*sp, (size_t)nc * sizeof *g);
        if (!g) return false;
        *sp = g;
        *cap = nc;
    }
    char *s = malloc(nl + 1);
    if (!s) return false;
    memcpy(s, name, nl);
    s[nl] = '\0';
    (*sp)[(*n)++] = (eng__tok_special){.name = s, .id = id};
    return true;
}

/* "bos_token": "X" or {"content": "X", ...} */
static char *token_name(const cJSON *v) {
    if (cJSON_IsObject(v)) v = cJSON_GetObjectItemCaseSensitive(v, "content");
    return cJSON_IsString(v) && v->valuestring[0] ? strdup(v->valuestring) : NULL;
}

static bool json_id(const cJSON *v, int32_t *id) {
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble >= ENG_TOK_MAX_ID ||
        v->valuedouble != (double)(int32_t)v->valuedouble)
        return false;
    *id = (int32_t)v->valuedouble;
    return true;
}

kds_status eng__tok_parse_specials_json(const char *text, size_t len, const char *path, bool hf,
                                        eng__tok_special **sp, int *n_sp, char **bos_name,
                                        char **eos_name, kds_err *err) {
    kds_status rc = KDS_OK;
    int n = 0, cap = 0;
    eng__tok_special *list = NULL;
    *sp = NULL;
    *n_sp = 0;
    if (bos_name) *bos_name = NULL;
    if (eos_name) *eos_name = NULL;
    cJSON *root = cJSON_ParseWithLength(text, len);
    if (!cJSON_IsObject(root)) {
        rc = kds_err_set(err, KDS_BAD_FORMAT, "%s: not a JSON object", path);
        goto fail;
    }
    const cJSON *dec = cJSON_GetObjectItemCaseSensitive(root, "added_tokens_decoder");
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "special_tokens");
    const cJSON *e;
    if (dec || hf) { /* Hugging Face tokenizer_config.json: {"163584": {"content": "[BOS]"}} */
        if (dec && !cJSON_IsObject(dec)) {
            rc =
                kds_err_set(err, KDS_BAD_FORMAT, "%s: added_tokens_decoder is not an object", path);
            goto fail;
        }
        cJSON_ArrayForEach(e, dec) {
            char *end;
            errno = 0;
            long id = strtol(e->string, &end, 10);
            const cJSON *c = cJSON_GetObjectItemCaseSensitive(e, "content");
            if (errno || *end || !e->string[0] || id < 0 || id >= ENG_TOK_MAX_ID ||
                !cJSON_IsString(c)) {
                rc = kds_err_set(err, KDS_BAD_FORMAT,
                                 "%s: added_tokens_decoder entry '%.40s' needs an id key and a "
                                 "\"content\" string",
                                 path, e->string);
                goto fail;
            }
            if (!push_special(&list, &n, &cap, c->valuestring, strlen(c->valuestring), (int32_t)id))
                goto nomem;
        }
        if (bos_name) *bos_name = token_name(cJSON_GetObjectItemCaseSensitive(root, "bos_token"));
        if (eos_name) *eos_name = token_name(cJSON_GetObjectItemCaseSensitive(root, "eos_token"));
    } else { /* tiktoken's {"special_tokens": {NAME: ID}} or a bare {NAME: ID} */
        if (!map) map = root;
        if (!cJSON_IsObject(map)) {
            rc = kds_err_set(err, KDS_BAD_FORMAT, "%s: special_tokens is not an object", path);
            goto fail;
        }
        cJSON_ArrayForEach(e, map) {
            int32_t id;
            if (!json_id(e, &id)) {
                rc = kds_err_set(err, KDS_BAD_FORMAT,
                                 "%s: special '%.40s' needs an integer id in [0, %d)", path,
                                 e->string, ENG_TOK_MAX_ID);
                goto fail;
            }
            if (!push_special(&list, &n, &cap, e->string, strlen(e->string), id)) goto nomem;
        }
    }
    cJSON_Delete(root);
    *sp = list;
    *n_sp = n;
    return KDS_OK;
nomem:
    rc = kds_err_set(err, KDS_NOMEM, "out of memory reading %s", path);
fail:
    cJSON_Delete(root);
    eng__tok_specials_free(list, n);
    if (bos_name) free(*bos_name), *bos_name = NULL;
    if (eos_name) free(*eos_name), *eos_name = NULL;
    return rc;
}

/* The preset's specials for `n_ranks` ranks (Kimi's sit after the ranks). */
static kds_status preset_specials(const tok_preset *ps, int32_t n_ranks, eng__tok_special **sp,
                                  int *n_sp, kds_err *err) {
    int n = 0, cap = 0;
    eng__tok_special *list = NULL;
    int32_t base = ps->relative ? n_ranks : 0;
    for (int i = 0; i < ps->n_specials; i++)
        if (!push_special(&list, &n, &cap, ps->specials[i].name, strlen(ps->specials[i].name),
                          base + ps->specials[i].id))
            goto nomem;
    for (int k = 0; k < ps->reserved; k++) {
        bool named = false;
        for (int i = 0; i < ps->n_specials && !named; i++)
            named = ps->specials[i].id == k;
        if (named) continue;
        char name[48];
        int nl = snprintf(name, sizeof name, "<|reserved_token_%d|>", base + k);
        if (!push_special(&list, &n, &cap, name, (size_t)nl, base + k)) goto nomem;
    }
    *sp = list;
    *n_sp = n;
    return KDS_OK;
nomem:
    eng__tok_specials_free(list, n);
    return kds_err_set(err, KDS_NOMEM, "out of memory building the specials of '%s'", ps->name);
}

eng_tok_params eng_tok_default_params(void) {
    eng_tok_params p = {.pattern = NULL, .specials_file = NULL, .no_specials = false, .vocab = 0};
    return p;
}

kds_status eng_tok_load(const char *rank_file, const eng_tok_params *p, eng_tokenizer **out,
                        kds_err *err) {
    kds_status rc;
    char *text = NULL, *js = NULL, *bos_name = NULL, *eos_name = NULL;
    size_t len = 0, jl = 0;
    eng__tok_rankset rs = {0};
    eng__tok_special *sp = NULL;
    int n_sp = 0;
    eng_tokenizer *t = NULL;
    eng_tok_params dp = eng_tok_default_params();
    if (!out) return kds_err_set(err, KDS_INVALID_ARG, "eng_tok_load: no output pointer");
    *out = NULL;
    if (!p) p = &dp;
    const tok_preset *ps = find_preset(p->pattern);
    if (!ps)
        return kds_err_set(err, KDS_INVALID_ARG,
                           "unknown pre-tokeniser '%s' (known: cl100k, o200k, kimi, none)",
                           p->pattern);
    rc = eng__read_file(rank_file, TOK_MAX_RANK_FILE, &text, &len, err);
    if (rc != KDS_OK) goto out;
    rc = eng__tok_parse_ranks(text, len, rank_file, &rs, err);
    if (rc != KDS_OK) goto out;
    if (p->no_specials) {
        /* none */
    } else if (p->specials_file) {
        rc = eng__read_file(p->specials_file, TOK_MAX_JSON_FILE, &js, &jl, err);
        if (rc != KDS_OK) goto out;
        rc = eng__tok_parse_specials_json(js, jl, p->specials_file, false, &sp, &n_sp, &bos_name,
                                          &eos_name, err);
    } else {
        rc = preset_specials(ps, rs.max_rank + 1, &sp, &n_sp, err);
        bos_name = ps->bos ? strdup(ps->bos) : NULL;
        eos_name = ps->eos ? strdup(ps->eos) : NULL;
    }
    if (rc != KDS_OK) goto out;
    rc = eng__tok_build(&rs, rank_file, sp, n_sp, ps->name, p->vocab, &t, err);
    if (rc != KDS_OK) goto out;
    if (bos_name) t->bos = eng_tok_special_id(t, bos_name);
    if (eos_name) t->eos = eng_tok_special_id(t, eos_name);
    eng__tok_set_stops(t);
    *out = t;
out:
    free(text);
    free(js);
    free(bos_name);
    free(eos_name);
    eng__tok_specials_free(sp, n_sp);
    eng__tok_rankset_free(&rs);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Encoding                                                                  */

/* A per-call memo of short pieces -> ids, for long texts. Words repeat
 * (Zipf): a hit in this small table (128 KiB, cache-resident) saves the
 * rank map's cache miss and any merging, ~1.2x on English and code. The
 * memo only remembers results, so ids are the same with or without it. */
#define TOK_MEMO_SLOTS 4096
#define TOK_MEMO_MIN_TEXT 8192 /* shorter texts do not pay for clearing it */
typedef struct piece_memo {
    uint8_t len; /* 0 = empty */
    uint8_t n_ids;
    unsigned char bytes[14];
    int32_t ids[4];
} piece_memo;

typedef struct enc {
    const eng_tokenizer *t;
    piece_memo *memo; /* NULL = none */
    int32_t *ids;     /* NULL in split mode */
    int64_t cap, n;
    size_t *ends;              /* split mode: piece end offsets */
    const unsigned char *text; /* the caller's text, for offsets */
    uint32_t *scratch;         /* long-piece merge scratch, grown on demand */
    size_t scratch_words;
    pcre2_match_data *md;
    kds_err *err;
} enc;

static inline void emit(enc *e, int32_t id) {
    if (e->n < e->cap) e->ids[e->n] = id;
    e->n++;
}

/* tiktoken's merge loop over parts [start, rank-of-pair-with-next) kept in
 * two arrays, for pieces of at most TOK_SMALL_PIECE bytes. tok[i] is the id
 * of part i, known from the merge that made it (no final lookups). */
static void bpe_small(enc *e, const unsigned char *p, size_t n) {
    const eng_tokenizer *t = e->t;
    uint32_t st[TOK_SMALL_PIECE + 1], rk[TOK_SMALL_PIECE + 1], tok[TOK_SMALL_PIECE + 1];
    size_t m = n + 1; /* parts, the last one the end sentinel */
    uint32_t min_r = TOK_EMPTY;
    size_t min_i = 0;
    for (size_t i = 0; i < n; i++) {
        st[i] = (uint32_t)i;
        tok[i] = (uint32_t)t->byte_rank[p[i]];
        rk[i] = i + 1 < n ? rank_of(t, p + i, 2) : TOK_EMPTY;
        if (rk[i] < min_r) {
            min_r = rk[i];
            min_i = i;
        }
    }
    st[n] = (uint32_t)n;
    rk[n] = TOK_EMPTY;
    tok[n] = TOK_EMPTY;
    while (min_r != TOK_EMPTY) {
        size_t i = min_i;
        tok[i] = min_r;
        /* parts i and i+1 merge: the pairs starting at i-1 and i now span
         * one more part (i+1 is still in the arrays, hence the +3) */
        if (i > 0)
            rk[i - 1] = i + 2 < m ? rank_of(t, p + st[i - 1], st[i + 2] - st[i - 1]) : TOK_EMPTY;
        rk[i] = i + 3 < m ? rank_of(t, p + st[i], st[i + 3] - st[i]) : TOK_EMPTY;
        memmove(st + i + 1, st + i + 2, (m - i - 2) * sizeof *st);
        memmove(rk + i + 1, rk + i + 2, (m - i - 2) * sizeof *rk);
        memmove(tok + i + 1, tok + i + 2, (m - i - 2) * sizeof *tok);
        m--;
        min_r = TOK_EMPTY;
        for (size_t k = 0; k + 1 < m; k++)
            if (rk[k] < min_r) {
                min_r = rk[k];
                min_i = k;
            }
    }
    for (size_t k = 0; k + 1 < m; k++)
        emit(e, (int32_t)tok[k]);
}

static inline void heap_push(uint64_t *h, size_t *n, uint64_t v) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (h[up] <= v) break;
        h[i] = h[up];
        i = up;
    }
    h[i] = v;
}

static inline uint64_t heap_pop(uint64_t *h, size_t *n) {
    uint64_t top = h[0], v = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && h[c + 1] < h[c]) c++;
        if (h[c] >= v) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = v;
    return top;
}

/* The same merges for long pieces: parts form a linked list over start
 * offsets; a min-heap keyed (rank << 32 | start) yields the lowest rank,
 * leftmost on ties, exactly tiktoken's choice. Entries go stale when a
 * neighbour merges; an entry is current iff its part is alive and still has
 * that pair rank (a longer span is other bytes, hence another rank). */
static kds_status bpe_long(enc *e, const unsigned char *p, size_t n) {
    const eng_tokenizer *t = e->t;
    /* words: nxt, prv, tok, pr [n+1 each] + heap (3n u64 = 6n words) */
    size_t words = 4 * (n + 1) + 6 * n + 2;
    if (words > e->scratch_words) {
        uint32_t *g = realloc(e->scratch, words * sizeof *g);
        if (!g) return kds_err_set(e->err, KDS_NOMEM, "out of memory encoding a %zu-byte piece", n);
        e->scratch = g;
        e->scratch_words = words;
    }
    uint32_t *nxt = e->scratch, *prv = nxt + n + 1, *tok = prv + n + 1, *pr = tok + n + 1;
    uint64_t *heap = (uint64_t *)(void *)(((uintptr_t)(pr + n + 1) + 7) & ~(uintptr_t)7);
    size_t hn = 0;
    for (size_t i = 0; i <= n; i++) {
        nxt[i] = (uint32_t)i + 1;
        prv[i] = (uint32_t)i - 1;
        tok[i] = i < n ? (uint32_t)t->byte_rank[p[i]] : TOK_EMPTY;
        pr[i] = i + 1 < n ? rank_of(t, p + i, 2) : TOK_EMPTY;
        if (pr[i] != TOK_EMPTY) heap_push(heap, &hn, (uint64_t)pr[i] << 32 | i);
    }
    while (hn) {
        uint64_t top = heap_pop(heap, &hn);
        uint32_t r = (uint32_t)(top >> 32), i = (uint32_t)top;
        if (tok[i] == TOK_EMPTY || pr[i] != r) continue; /* stale */
        uint32_t j = nxt[i];
        tok[i] = r;
        tok[j] = TOK_EMPTY; /* part j is gone */
        pr[j] = TOK_EMPTY;
        nxt[i] = nxt[j];
        prv[nxt[j]] = i;
        uint32_t k = nxt[i];
        pr[i] = k < n ? rank_of(t, p + i, nxt[k] - i) : TOK_EMPTY;
        if (pr[i] != TOK_EMPTY) heap_push(heap, &hn, (uint64_t)pr[i] << 32 | i);
        if (i > 0) {
            uint32_t h = prv[i];
            pr[h] = rank_of(t, p + h, nxt[i] - h);
            if (pr[h] != TOK_EMPTY) heap_push(heap, &hn, (uint64_t)pr[h] << 32 | h);
        }
    }
    for (uint32_t i = 0; i < n; i = nxt[i])
        emit(e, (int32_t)tok[i]);
    return KDS_OK;
}

/* One piece: itself a token, else merged. */
static kds_status encode_piece(enc *e, const unsigned char *p, size_t n) {
    if (e->ends) {
        if (e->n < e->cap) e->ends[e->n] = (size_t)(p + n - e->text);
        e->n++;
        return KDS_OK;
    }
    if (n == 1) {
        emit(e, e->t->byte_rank[p[0]]);
        return KDS_OK;
    }
    piece_memo *m = NULL;
    if (e->memo && n <= sizeof m->bytes) {
        m = &e->memo[tok_hash(p, n, key8(p, n)) & (TOK_MEMO_SLOTS - 1)];
        if (m->len == n && !memcmp(m->bytes, p, n)) {
            for (int i = 0; i < m->n_ids; i++)
                emit(e, m->ids[i]);
            return KDS_OK;
        }
    }
    int64_t first = e->n;
    uint32_t whole = n <= e->t->max_piece ? rank_of(e->t, p, n) : TOK_EMPTY;
    if (whole != TOK_EMPTY)
        emit(e, (int32_t)whole);
    else if (n <= TOK_SMALL_PIECE)
        bpe_small(e, p, n);
    else
        return bpe_long(e, p, n);
    int64_t k = e->n - first;
    if (m && k <= 4 && e->n <= e->cap) { /* remember it (the ids must have been stored) */
        m->len = (uint8_t)n;
        m->n_ids = (uint8_t)k;
        memcpy(m->bytes, p, n);
        memcpy(m->ids, e->ids + first, (size_t)k * sizeof *m->ids);
    }
    return KDS_OK;
}

/* Length of the valid UTF-8 prefix of p[0..n). */
static size_t utf8_valid_prefix(const unsigned char *p, size_t n) {
    size_t i = 0;
    while (i < n) {
        /* ASCII eight bytes at a time: most text is mostly ASCII */
        while (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, p + i, 8);
            if (w & 0x8080808080808080ull) break;
            i += 8;
        }
        if (i >= n) break;
        if (p[i] < 0x80) {
            i++;
            continue;
        }
        int st;
        size_t k = eng__utf8_scan(p + i, n - i, &st);
        if (st != ENG_U8_OK) break;
        i += k;
    }
    return i;
}

/* Length of the invalid run at p: bytes up to where a valid character starts. */
static size_t utf8_invalid_run(const unsigned char *p, size_t n) {
    size_t i = 0;
    while (i < n) {
        int st;
        size_t k = eng__utf8_scan(p + i, n - i, &st);
        if (st == ENG_U8_OK) break;
        i += st == ENG_U8_BAD ? k : n - i; /* a cut-off start runs to the end */
    }
    return i;
}

/* Match at `off` in s[0..n). Returns the pcre2 result (< 0: no match or
 * error). The JIT's 32 KiB machine stack can run out on a pathological
 * piece; the interpreter (heap frames) then finishes the match. */
static int re_match(enc *e, const unsigned char *s, size_t n, size_t off) {
    const pcre2_code *re = e->t->re;
    int rc = PCRE2_ERROR_JIT_STACKLIMIT;
    if (e->t->jit) rc = pcre2_jit_match(re, s, n, off, 0, e->md, NULL);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
        rc = pcre2_match(re, s, n, off, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, e->md, NULL);
    return rc;
}

/* Pre-tokenise a valid UTF-8 run and encode its pieces. */
static kds_status encode_valid(enc *e, const unsigned char *s, size_t n) {
    kds_status rc = KDS_OK;
    if (!e->t->re) return encode_piece(e, s, n);
    size_t off = 0;
    while (off < n && rc == KDS_OK) {
        int m = re_match(e, s, n, off);
        if (m == PCRE2_ERROR_NOMATCH) { /* cannot happen with the presets: keep the bytes */
            rc = encode_piece(e, s + off, n - off);
            break;
        }
        if (m < 0) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(m, msg, sizeof msg);
            return kds_err_set(e->err, KDS_INTERNAL, "pre-tokeniser failed at byte %zu: %s",
                               (size_t)(s + off - e->text), (const char *)msg);
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
        size_t a = ov[0], b = ov[1];
        if (a > off) rc = encode_piece(e, s + off, a - off); /* skipped text: kept, see above */
        if (rc != KDS_OK) break;
        if (b == a) { /* an empty match (no preset has one): step one character */
            int st;
            b = a + (a < n ? eng__utf8_scan(s + a, n - a, &st) : 1);
            if (b > n) b = n;
        }
        rc = encode_piece(e, s + a, b - a);
        off = b;
    }
    return rc;
}

/* Ordinary text (no specials): valid runs are pre-tokenised, invalid runs
 * are one piece each. */
static kds_status encode_ordinary(enc *e, const unsigned char *s, size_t n) {
    kds_status rc = KDS_OK;
    const eng_tokenizer *t = e->t;
    if (t->bytes_only && !e->ends) {
        for (size_t i = 0; i < n; i++)
            emit(e, t->byte_rank[s[i]]);
        return KDS_OK;
    }
    size_t i = 0;
    while (i < n && rc == KDS_OK) {
        size_t v = utf8_valid_prefix(s + i, n - i);
        if (v) {
            rc = encode_valid(e, s + i, v);
            i += v;
        }
        if (i < n && rc == KDS_OK) {
            size_t bad = utf8_invalid_run(s + i, n - i);
            rc = encode_piece(e, s + i, bad);
            i += bad;
        }
    }
    return rc;
}

/* The leftmost special name in s[from..n) (longest at that byte):
 * returns its offset and id, or n. */
static size_t find_special(const eng_tokenizer *t, const unsigned char *s, size_t n, size_t from,
                           int32_t *id) {
    for (size_t i = from; i < n; i++) {
        unsigned b = s[i];
        for (int k = t->spec_start[b]; k < t->spec_start[b + 1]; k++) {
            const eng__tok_piece *pc = &t->piece[t->spec[k]];
            if (pc->len <= n - i && !memcmp(t->arena + pc->off, s + i, pc->len)) {
                *id = t->spec[k];
                return i;
            }
        }
    }
    return n;
}

/* One call of tiktoken's encode: specials (when allowed) cut the text, the
 * rest is ordinary. */
static kds_status encode_text(enc *e, const unsigned char *s, size_t len, unsigned flags) {
    kds_status rc = KDS_OK;
    if (!(flags & ENG_TOK_ALLOW_SPECIAL) || e->t->n_spec == 0) return encode_ordinary(e, s, len);
    size_t at = 0;
    while (at < len && rc == KDS_OK) {
        int32_t id = -1;
        size_t sp = find_special(e->t, s, len, at, &id);
        if (sp > at) rc = encode_ordinary(e, s + at, sp - at);
        if (sp == len || rc != KDS_OK) break;
        if (e->ends) {
            if (e->n < e->cap) e->ends[e->n] = (size_t)(s + sp - e->text) + e->t->piece[id].len;
            e->n++;
        } else {
            emit(e, id);
        }
        at = sp + e->t->piece[id].len;
    }
    return rc;
}

/* Python's str.isspace(): White_Space plus U+001C..U+001F. */
static bool py_isspace(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
           c == 0x202F || c == 0x205F || c == 0x3000;
}

/* The character at s (valid UTF-8 of k bytes, else one byte). */
static uint32_t code_point(const unsigned char *s, size_t n, size_t *k) {
    int st;
    *k = eng__utf8_scan(s, n, &st);
    if (st != ENG_U8_OK) {
        *k = 1; /* an invalid byte counts as one character that is not a space */
        return 0xFFFD;
    }
    switch (*k) {
    case 1: return s[0];
    case 2: return (uint32_t)(s[0] & 0x1F) << 6 | (s[1] & 0x3F);
    case 3: return (uint32_t)(s[0] & 0x0F) << 12 | (uint32_t)(s[1] & 0x3F) << 6 | (s[2] & 0x3F);
    default:
        return (uint32_t)(s[0] & 0x07) << 18 | (uint32_t)(s[1] & 0x3F) << 12 |
               (uint32_t)(s[2] & 0x3F) << 6 | (s[3] & 0x3F);
    }
}

/* Kimi's encode() (tokenization_kimi.py, after Llama 3's) does not hand
 * tiktoken the whole text: it cuts it every 400,000 characters and, inside
 * those, before any character that would make a run of whitespace (or of
 * non-whitespace) longer than 25,000 characters, then encodes the slices one
 * by one. Pre-tokens and special names cannot cross a cut, so we cut in the
 * same places (characters are code points, as in Python). Texts of at most
 * 25,000 bytes have no cut, and skip the scan. */
#define KIMI_MAX_ENCODE_CHARS 400000
#define KIMI_MAX_RUN_CHARS 25000
static kds_status kimi_slices(enc *e, const unsigned char *s, size_t len, unsigned flags) {
    kds_status rc = KDS_OK;
    if (len <= KIMI_MAX_RUN_CHARS) return encode_text(e, s, len, flags);
    size_t i = 0;
    while (i < len && rc == KDS_OK) { /* one 400,000-character chunk */
        size_t k, slice = i, chars = 0, run = 0;
        bool run_space = py_isspace(code_point(s + i, len - i, &k));
        for (; i < len && chars < KIMI_MAX_ENCODE_CHARS && rc == KDS_OK; i += k, chars++) {
            bool sp = py_isspace(code_point(s + i, len - i, &k));
            if (sp != run_space) {
                run = 1;
                run_space = sp;
            } else if (++run > KIMI_MAX_RUN_CHARS) {
                rc = encode_text(e, s + slice, i - slice, flags);
                slice = i;
                run = 1;
            }
        }
        if (rc == KDS_OK) rc = encode_text(e, s + slice, i - slice, flags);
    }
    return rc;
}

static kds_status run_encoder(enc *e, const char *text, size_t len, unsigned flags) {
    kds_status rc = KDS_OK;
    const unsigned char *s = (const unsigned char *)text;
    e->text = s;
    if (e->t->re) {
        e->md = pcre2_match_data_create(1, NULL);
        if (!e->md) return kds_err_set(e->err, KDS_NOMEM, "out of memory encoding text");
    }
    if (len >= TOK_MEMO_MIN_TEXT && e->ids && !e->t->bytes_only)
        e->memo = calloc(TOK_MEMO_SLOTS, sizeof *e->memo); /* optional: NULL just means slower */
    rc = e->t->kimi_slices ? kimi_slices(e, s, len, flags) : encode_text(e, s, len, flags);
    pcre2_match_data_free(e->md);
    free(e->memo);
    free(e->scratch);
    return rc;
}

kds_status eng_tok_encode_ex(const eng_tokenizer *t, const char *text, size_t len, unsigned flags,
                             int32_t *ids, int64_t cap, int64_t *n, kds_err *err) {
    enc e = {.t = t, .ids = ids, .cap = ids ? cap : 0, .err = err};
    kds_status rc = run_encoder(&e, text, len, flags);
    if (n) *n = rc == KDS_OK ? e.n : 0;
    return rc;
}

int64_t eng_tok_encode(const eng_tokenizer *t, const char *text, size_t len, int32_t *ids,
                       int64_t cap) {
    int64_t n = 0;
    return eng_tok_encode_ex(t, text, len, 0, ids, cap, &n, NULL) == KDS_OK ? n : -1;
}

kds_status eng_tok_split(const eng_tokenizer *t, const char *text, size_t len, size_t *ends,
                         int64_t cap, int64_t *n, kds_err *err) {
    size_t dummy;
    enc e = {.t = t, .ends = ends ? ends : &dummy, .cap = ends ? cap : 0, .err = err};
    kds_status rc = run_encoder(&e, text, len, 0);
    if (n) *n = rc == KDS_OK ? e.n : 0;
    return rc;
}
