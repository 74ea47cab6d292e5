/*
 * eng_tokenizer.c - the tokenizer a model gets (byte-level, or tiktoken from
 * a Kimi-layout directory), decoding, streaming decode, and the small
 * accessors of eng.h. Building and encoding live in eng_tiktoken.c.
 */
#include <cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "eng_tokenizer.h"
#include "eng_util.h"

#define TOK_MAX_CONFIG_BYTES ((size_t)64 << 20)
#define TOK_MAX_RANK_BYTES ((size_t)512 << 20)

/* ------------------------------------------------------------------------ */
/* Byte-level                                                                */

kds_status eng__tok_create_bytes(const eng_config *c, eng_tokenizer **out, kds_err *err) {
    kds_status rc = KDS_OK;
    *out = NULL;
    if (c->vocab_size < 256)
        return kds_err_set(err, KDS_UNSUPPORTED,
                           "vocab_size %d is smaller than the 256 ids a byte-level tokenizer needs",
                           c->vocab_size);
    uint32_t rank[256], off[256], len[256];
    char bytes[256];
    for (int i = 0; i < 256; i++) {
        bytes[i] = (char)i;
        rank[i] = off[i] = (uint32_t)i;
        len[i] = 1;
    }
    eng__tok_rankset rs = {.bytes = bytes, .n_bytes = 256, .rank = rank, .off = off,
                           .len = len, .n = 256, .max_rank = 255};
    int32_t vocab = c->vocab_size, n_sp = vocab - 256;
    int32_t bos = c->bos_token_id >= 256 && c->bos_token_id < vocab ? c->bos_token_id
                  : vocab > 256                                      ? 256
                                                                     : -1;
    int32_t eos = c->eos_token_id >= 256 && c->eos_token_id < vocab && c->eos_token_id != bos
                      ? c->eos_token_id
                  : vocab > 257 ? 257
                                : -1;
    /* all names in one buffer: a 163,840-id vocabulary has 163,584 of them */
    eng__tok_special *sp = calloc((size_t)(n_sp ? n_sp : 1), sizeof *sp);
    char *names = malloc((size_t)(n_sp ? n_sp : 1) * 24);
    if (!sp || !names) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory creating the tokenizer");
        goto out;
    }
    for (int32_t i = 0; i < n_sp; i++) {
        int32_t id = 256 + i;
        char *name = names + (size_t)i * 24;
        if (id == bos)
            snprintf(name, 24, "<|bos|>");
        else if (id == eos)
            snprintf(name, 24, "<|eos|>");
        else
            snprintf(name, 24, "<|special_%d|>", id);
        sp[i] = (eng__tok_special){.name = name, .id = id};
    }
    rc = eng__tok_build(&rs, NULL, sp, n_sp, "none", vocab, out, err);
    if (rc == KDS_OK) {
        (*out)->bos = bos;
        (*out)->eos = eos;
        snprintf((*out)->kind_name, sizeof(*out)->kind_name, "bytes");
        eng__tok_set_stops(*out);
    }
out:
    free(names);
    free(sp);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* A model directory's tokenizer                                             */

static char *join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    size_t n = a;
    if (n && p[n - 1] != '/') p[n++] = '/';
    memcpy(p + n, name, b + 1);
    return p;
}

static int find_id(const eng__tok_special *sp, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (!strcmp(sp[i].name, name)) return sp[i].id;
    return -1;
}

kds_status eng__tok_create_model(const char *dir, const eng_config *c, eng_tokenizer **out,
                                 kds_err *err) {
    kds_status rc = KDS_OK;
    char *rank_path = join(dir, "tiktoken.model"), *cfg_path = join(dir, "tokenizer_config.json");
    char *text = NULL, *js = NULL, *bos_name = NULL, *eos_name = NULL, *pattern = NULL;
    size_t len = 0, jl = 0;
    eng__tok_rankset rs = {0};
    eng__tok_special *sp = NULL;
    int n_sp = 0;
    bool *named = NULL;
    eng_tokenizer *t = NULL;
    *out = NULL;
    if (!rank_path || !cfg_path) goto nomem;
    switch (eng__path_state(rank_path)) {
    case ENG_PATH_ABSENT:
        rc = eng__tok_create_bytes(c, out, err);
        goto out;
    case ENG_PATH_ERROR:
        /* a rank file that cannot be reached (a symlink loop, no permission)
         * is not a model without one: falling back to bytes would give
         * garbage ids */
        rc = kds_err_set(err, KDS_IO, "%s: %s", rank_path,
                         errno == ELOOP ? "too many levels of symbolic links (a symlink loop?)"
                                        : strerror(errno));
        goto out;
    case ENG_PATH_PRESENT:
        break;
    }
    /* A rank file without its config is a half-copied tokenizer: refuse it
     * rather than fall back to bytes and produce garbage ids. */
    rc = eng__read_file(cfg_path, TOK_MAX_CONFIG_BYTES, &js, &jl, err);
    if (rc == KDS_NOT_FOUND) {
        rc = kds_err_set(err, KDS_NOT_FOUND,
                         "%s: missing (the model has tiktoken.model, whose "
                         "special tokens it lists)",
                         cfg_path);
        goto out;
    }
    if (rc != KDS_OK) goto out;
    rc =
        eng__tok_parse_specials_json(js, jl, cfg_path, true, &sp, &n_sp, &bos_name, &eos_name, err);
    if (rc != KDS_OK) goto out;
    cJSON *root = cJSON_ParseWithLength(js, jl); /* parsed fine just above */
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(root, "kdaserve_pattern");
    pattern = strdup(cJSON_IsString(pat) ? pat->valuestring : "kimi");
    bool bad_pat = pat && !cJSON_IsString(pat);
    cJSON_Delete(root);
    if (!pattern) goto nomem;
    if (bad_pat) {
        rc = kds_err_set(err, KDS_BAD_FORMAT, "%s: kdaserve_pattern must be a preset name",
                         cfg_path);
        goto out;
    }

    rc = eng__read_file(rank_path, TOK_MAX_RANK_BYTES, &text, &len, err);
    if (rc != KDS_OK) goto out;
    rc = eng__tok_parse_ranks(text, len, rank_path, &rs, err);
    if (rc != KDS_OK) goto out;
    int32_t vocab = c->vocab_size, n_ranks = rs.max_rank + 1;
    if (n_ranks > vocab) {
        rc = kds_err_set(err, KDS_MISMATCH, "%s: %d ranks do not fit the config's vocab_size %d",
                         rank_path, n_ranks, vocab);
        goto out;
    }
    named = calloc((size_t)vocab, sizeof *named);
    if (!named) goto nomem;
    for (int i = 0; i < n_sp; i++) {
        if (sp[i].id >= vocab) {
            rc = kds_err_set(err, KDS_MISMATCH,
                             "%s: special '%s' has id %d, outside the config's vocab_size %d",
                             cfg_path, sp[i].name, sp[i].id, vocab);
            goto out;
        }
        named[sp[i].id] = true;
    }
    /* Every id after the ranks is a special, as in tokenization_kimi.py:
     * the unnamed ones are <|reserved_token_ID|>. */
    int cap = n_sp + (vocab - n_ranks);
    eng__tok_special *g = realloc(sp, (size_t)(cap ? cap : 1) * sizeof *g);
    if (!g) goto nomem;
    sp = g;
    for (int32_t id = n_ranks; id < vocab; id++) {
        if (named[id]) continue;
        char name[48];
        snprintf(name, sizeof name, "<|reserved_token_%d|>", id);
        sp[n_sp].name = strdup(name);
        sp[n_sp].id = id;
        if (!sp[n_sp++].name) goto nomem;
    }
    rc = eng__tok_build(&rs, rank_path, sp, n_sp, pattern, vocab, &t, err);
    if (rc != KDS_OK) {
        kds_err_prefix(err, "%s: ", dir);
        goto out;
    }
    t->bos = c->bos_token_id >= 0 && c->bos_token_id < vocab ? c->bos_token_id
             : bos_name                                      ? find_id(sp, n_sp, bos_name)
                                                             : -1;
    t->eos = c->eos_token_id >= 0 && c->eos_token_id < vocab ? c->eos_token_id
             : eos_name                                      ? find_id(sp, n_sp, eos_name)
                                                             : -1;
    eng__tok_set_stops(t);
    /* the tokenizer's own eos (Kimi: [EOS]) ends generation too */
    int32_t tok_eos = eos_name ? find_id(sp, n_sp, eos_name) : -1;
    bool have = tok_eos < 0;
    for (int i = 0; i < t->n_stops && !have; i++)
        have = t->stops[i] == tok_eos;
    if (!have && t->n_stops < ENG_TOK_MAX_STOPS) t->stops[t->n_stops++] = tok_eos;
    *out = t;
    t = NULL;
    goto out;
nomem:
    rc = kds_err_set(err, KDS_NOMEM, "out of memory loading the tokenizer of %s", dir);
out:
    eng_tok_free(t);
    free(named);
    eng__tok_specials_free(sp, n_sp);
    eng__tok_rankset_free(&rs);
    free(text);
    free(js);
    free(bos_name);
    free(eos_name);
    free(pattern);
    free(rank_path);
    free(cfg_path);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Decoding                                                                  */

int64_t eng_tok_decode(const eng_tokenizer *t, const int32_t *ids, int64_t n, unsigned flags,
                       char *out, size_t cap) {
    size_t need = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->vocab) return -1;
        if ((flags & ENG_TOK_SKIP_SPECIAL) && t->kind[id] == TOK_SPECIAL) continue;
        const eng__tok_piece *pc = &t->piece[id];
        if (need < cap)
            memcpy(out + need, t->arena + pc->off, pc->len < cap - need ? pc->len : cap - need);
        need += pc->len;
    }
    return (int64_t)need;
}

const char *eng_tok_piece(const eng_tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->vocab) {
        *len = 0;
        return "";
    }
    *len = t->piece[id].len;
    return t->arena + t->piece[id].off;
}

int eng_tok_vocab(const eng_tokenizer *t) {
    return t->vocab;
}
int32_t eng_tok_eos(const eng_tokenizer *t) {
    return t->eos;
}
int32_t eng_tok_bos(const eng_tokenizer *t) {
    return t->bos;
}
const char *eng_tok_kind(const eng_tokenizer *t) {
    return t->kind_name;
}

bool eng_tok_is_special(const eng_tokenizer *t, int32_t id) {
    return id >= 0 && id < t->vocab && t->kind[id] == TOK_SPECIAL;
}

bool eng_tok_is_stop(const eng_tokenizer *t, int32_t id) {
    for (int i = 0; i < t->n_stops; i++)
        if (t->stops[i] == id) return true;
    return false;
}

/* ------------------------------------------------------------------------ */
/* Streaming decode                                                          */

struct eng_tok_stream {
    const eng_tokenizer *t;
    unsigned flags;
    unsigned char pend[4]; /* start of a character cut off by the last token */
    size_t n_pend;
    unsigned char *in; /* pend + one token: max_piece + 4 */
    char *out;         /* at most 3 bytes (U+FFFD) per input byte */
    /* K3's XTML tags (<|open|> or <|close|>, a header, <|sep|>) are markup:
     * with ENG_TOK_SKIP_SPECIAL their headers are skipped with them */
    int32_t xt_open, xt_close, xt_sep; /* -1 without K3's specials */
    bool in_tag;
};

kds_status eng_tok_stream_create(const eng_tokenizer *t, unsigned flags, eng_tok_stream **out,
                                 kds_err *err) {
    *out = NULL;
    eng_tok_stream *s = calloc(1, sizeof *s);
    if (!s) goto nomem;
    s->t = t;
    s->flags = flags;
    s->xt_open = eng_tok_special_id(t, "<|open|>");
    s->xt_close = eng_tok_special_id(t, "<|close|>");
    s->xt_sep = eng_tok_special_id(t, "<|sep|>");
    if (s->xt_open < 0 || s->xt_close < 0 || s->xt_sep < 0) s->xt_open = s->xt_close = s->xt_sep = -1;
    s->in = malloc(t->max_piece + 4);
    s->out = malloc(3 * (t->max_piece + 4));
    if (!s->in || !s->out) goto nomem;
    *out = s;
    return KDS_OK;
nomem:
    eng_tok_stream_free(s);
    return kds_err_set(err, KDS_NOMEM, "out of memory creating a decode stream");
}

void eng_tok_stream_free(eng_tok_stream *s) {
    if (!s) return;
    free(s->in);
    free(s->out);
    free(s);
}

kds_status eng_tok_stream_put(eng_tok_stream *s, int32_t id, const char **text, size_t *len,
                              kds_err *err) {
    const eng_tokenizer *t = s->t;
    if (id < 0 || id >= t->vocab)
        return kds_err_set(err, KDS_INVALID_ARG, "token id %d is outside the vocabulary [0, %d)",
                           id, t->vocab);
    size_t pl = t->piece[id].len;
    if (s->flags & ENG_TOK_SKIP_SPECIAL) {
        if (s->xt_sep >= 0 && (id == s->xt_open || id == s->xt_close)) s->in_tag = true;
        const bool header = s->in_tag;
        if (id == s->xt_sep) s->in_tag = false;
        if (t->kind[id] == TOK_SPECIAL || header) pl = 0;
    }
    memcpy(s->in, s->pend, s->n_pend);
    memcpy(s->in + s->n_pend, t->arena + t->piece[id].off, pl);
    size_t n = s->n_pend + pl, i = 0, o = 0;
    s->n_pend = 0;
    while (i < n) {
        int st;
        size_t k = eng__utf8_scan(s->in + i, n - i, &st);
        if (st == ENG_U8_OK) {
            memcpy(s->out + o, s->in + i, k);
            o += k;
        } else if (st == ENG_U8_SHORT) { /* only at the end: wait for the next token */
            memcpy(s->pend, s->in + i, k);
            s->n_pend = k;
        } else {
            memcpy(s->out + o, "\xEF\xBF\xBD", 3);
            o += 3;
        }
        i += k;
    }
    *text = s->out;
    *len = o;
    return KDS_OK;
}

const char *eng_tok_stream_flush(eng_tok_stream *s, size_t *len) {
    *len = 0;
    if (s->n_pend) {
        memcpy(s->out, "\xEF\xBF\xBD", 3);
        *len = 3;
    }
    s->n_pend = 0;
    s->in_tag = false;
    return s->out;
}
