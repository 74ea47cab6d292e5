/*
 * eng_tokenizer.h - engine-internal: the struct behind eng_tokenizer and the
 * constructors the model loader uses.
 *
 * One representation serves both kinds of eng.h: a byte-level tokenizer is a
 * tiktoken tokenizer whose 256 ranks are the single bytes, with no merges and
 * no pre-tokenisation regex (and a fast path that copies bytes).
 *
 * Files: eng_tiktoken.c builds tokenizers (rank files, presets, specials,
 * PCRE2) and encodes; eng_tokenizer.c decodes, streams, and makes the byte
 * tokenizer and a model directory's tokenizer.
 */
#ifndef ENG_TOKENIZER_H
#define ENG_TOKENIZER_H

#include "eng.h"
#include "eng_config.h"

/* Longest token (rank bytes or special name) a file may define. */
#define ENG_TOK_MAX_TOKEN_BYTES 4096
/* Ranks and special ids must stay below this (2^24: 16.7M ids; the largest
 * real vocabularies are ~200K). */
#define ENG_TOK_MAX_ID (1 << 24)
#define ENG_TOK_MAX_STOPS 8

enum { TOK_UNUSED = 0, TOK_RANK = 1, TOK_SPECIAL = 2 };

/* Rank map slot: open addressing, linear probing. key8 holds the first 8
 * token bytes (zero-padded), so tokens of <= 8 bytes (almost every pair the
 * merge loop asks about) compare without touching the byte arena. */
typedef struct eng__tok_slot {
    uint64_t key8;
    uint32_t id; /* UINT32_MAX = empty */
    uint32_t len;
} eng__tok_slot;

typedef struct eng__tok_piece {
    uint32_t off, len; /* bytes [off, off + len) of the arena */
} eng__tok_piece;

struct eng_tokenizer {
    int vocab;        /* ids are [0, vocab) */
    int32_t bos, eos; /* -1 when none */
    int32_t stops[ENG_TOK_MAX_STOPS];
    int n_stops;
    char kind_name[32]; /* "bytes" or "tiktoken/<preset>" */

    uint8_t *kind;         /* [vocab] TOK_UNUSED / TOK_RANK / TOK_SPECIAL */
    eng__tok_piece *piece; /* [vocab] */
    char *arena;           /* every token's bytes and every special's name */
    size_t max_piece;      /* longest token or special name, bytes */

    int32_t byte_rank[256]; /* the rank of each single byte */
    bool bytes_only;        /* no rank longer than one byte: encode copies */
    eng__tok_slot *slots;   /* rank map over TOK_RANK ids */
    uint32_t *pair_rank;    /* [65536] rank of each 2-byte token (UINT32_MAX: none):
                             * the merge loop's first and most frequent question */
    uint64_t mask;          /* slots - 1 (a power of two) */

    /* Specials for ENG_TOK_ALLOW_SPECIAL, grouped by first byte, longest
     * name first within a group: spec[spec_start[b] .. spec_start[b+1]). */
    int32_t *spec;
    int n_spec;
    int spec_start[257];

    /* The pre-tokenisation regex (a pcre2_code_8 *; void here so that the
     * PCRE2 header stays inside eng_tiktoken.c). NULL = whole text is one
     * piece. Compiled once, read-only afterwards: shareable by threads. */
    void *re;
    bool jit;
    /* Cut the text where Kimi's encode() cuts it before tiktoken (see
     * kimi_slices in eng_tiktoken.c). */
    bool kimi_slices;
};

/* The byte-level tokenizer for a config (ids 0..255 = bytes; ids 256.. are
 * specials "<|bos|>", "<|eos|>", then "<|special_N|>"; a config's bos/eos,
 * when set and inside the vocabulary, name the bos and eos tokens, else 256
 * and 257 when vocab_size allows). */
kds_status eng__tok_create_bytes(const eng_config *c, eng_tokenizer **out, kds_err *err);

/* The tokenizer of model directory `dir`: with tiktoken.model, a tiktoken
 * tokenizer set up from tokenizer_config.json (which must then exist: named
 * specials from added_tokens_decoder, the other ids from the number of ranks
 * up to vocab_size named <|reserved_token_ID|> as Kimi does; bos/eos from
 * the config, else from bos_token/eos_token; pre-tokeniser "kimi" unless the
 * file's "kdaserve_pattern" names another preset); without it, the byte
 * tokenizer. Ranks and specials must fit in the config's vocab_size
 * (KDS_MISMATCH otherwise). */
kds_status eng__tok_create_model(const char *dir, const eng_config *c, eng_tokenizer **out,
                                 kds_err *err);
void eng__tok_free(eng_tokenizer *t);

/* ---- building blocks shared by the two files (eng_tiktoken.c) ---- */

/* A special token while a tokenizer is being built. */
typedef struct eng__tok_special {
    char *name; /* malloc'd, NUL-terminated, valid UTF-8, 1..ENG_TOK_MAX_TOKEN_BYTES bytes */
    int32_t id;
} eng__tok_special;

/* Ranks from a rank file's text (`path` for messages): every line checked
 * (format, base64, rank range, repeated ranks) and all 256 single bytes
 * required. Repeated token bytes are found by eng__tok_build. */
typedef struct eng__tok_rankset {
    char *bytes; /* decoded token bytes, back to back */
    size_t n_bytes;
    uint32_t *rank, *off, *len; /* [n] */
    uint32_t *line;             /* [n] line of the file, for messages */
    int n;
    int32_t max_rank;
} eng__tok_rankset;
kds_status eng__tok_parse_ranks(const char *text, size_t len, const char *path,
                                eng__tok_rankset *rs, kds_err *err);
void eng__tok_rankset_free(eng__tok_rankset *rs);

/* Assemble a tokenizer: ranks (`path` names their file in messages, NULL
 * when made in code), specials (their names are freed by the caller),
 * pre-tokeniser preset (NULL or "none" = none), vocab (0 = one past the
 * largest id). bos/eos are -1 and there are no stops: the caller sets them. */
kds_status eng__tok_build(const eng__tok_rankset *rs, const char *path, const eng__tok_special *sp,
                          int n_sp, const char *pattern, int vocab, eng_tokenizer **out,
                          kds_err *err);
void eng__tok_specials_free(eng__tok_special *sp, int n);

/* Specials from a JSON text (the formats of eng_tok_params.specials_file;
 * `hf`: read it as a tokenizer_config.json, whose added_tokens_decoder may
 * be absent). *bos_name / *eos_name (may be NULL) receive malloc'd
 * "bos_token" / "eos_token" names of a tokenizer_config.json, else NULL. */
kds_status eng__tok_parse_specials_json(const char *text, size_t len, const char *path, bool hf,
                                        eng__tok_special **sp, int *n_sp, char **bos_name,
                                        char **eos_name, kds_err *err);

/* Add the ids of the end-marking specials (and eos) to t->stops. */
void eng__tok_set_stops(eng_tokenizer *t);

/* What eng__utf8_scan found at the start of its input. */
enum { ENG_U8_OK, ENG_U8_SHORT, ENG_U8_BAD };

/* Look at the UTF-8 sequence at p (n >= 1 bytes, Unicode Table 3-7).
 * Returns a byte count and sets *state: ENG_U8_OK, one well-formed
 * character; ENG_U8_SHORT, a well-formed start that the input cuts off;
 * ENG_U8_BAD, the maximal ill-formed subpart (>= 1 byte) to replace by one
 * U+FFFD or to step over. */
static inline size_t eng__utf8_scan(const unsigned char *p, size_t n, int *state) {
    unsigned c = p[0], lo = 0x80, hi = 0xBF;
    size_t need;
    if (c < 0x80) {
        *state = ENG_U8_OK;
        return 1;
    }
    if (c < 0xC2 || c > 0xF4) { /* continuation byte, overlong lead C0/C1, or past U+10FFFF */
        *state = ENG_U8_BAD;
        return 1;
    }
    if (c < 0xE0) {
        need = 2;
    } else if (c < 0xF0) {
        need = 3;
        if (c == 0xE0)
            lo = 0xA0; /* no overlong 3-byte forms */
        else if (c == 0xED)
            hi = 0x9F; /* no surrogates */
    } else {
        need = 4;
        if (c == 0xF0)
            lo = 0x90; /* no overlong 4-byte forms */
        else if (c == 0xF4)
            hi = 0x8F; /* nothing past U+10FFFF */
    }
    for (size_t i = 1; i < need; i++) {
        if (i >= n) {
            *state = ENG_U8_SHORT;
            return i;
        }
        unsigned b = p[i];
        if (i == 1 ? (b < lo || b > hi) : (b & 0xC0) != 0x80) {
            *state = ENG_U8_BAD;
            return i;
        }
    }
    *state = ENG_U8_OK;
    return need;
}

#endif
