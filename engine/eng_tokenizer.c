/* eng_tokenizer.c - the byte-level tokenizer (ids 0..255 = bytes, then specials). */
#include "eng_tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOK_NAME_MAX 24

struct eng_tokenizer {
    int vocab;
    int32_t bos, eos;
    unsigned char bytes[256];
    char (*names)[TOK_NAME_MAX]; /* [vocab - 256] special names */
};

kds_status eng__tok_create_bytes(const eng_config *c, eng_tokenizer **out, kds_err *err) {
    *out = NULL;
    if (c->vocab_size < 256)
        return kds_err_set(err, KDS_UNSUPPORTED,
                           "vocab_size %d is smaller than the 256 ids a byte-level tokenizer needs",
                           c->vocab_size);
    eng_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return kds_err_set(err, KDS_NOMEM, "out of memory creating the tokenizer");
    t->vocab = c->vocab_size;
    for (int i = 0; i < 256; i++) t->bytes[i] = (unsigned char)i;
    int n_special = c->vocab_size - 256;
    if (n_special > 0) {
        t->names = calloc((size_t)n_special, sizeof *t->names);
        if (!t->names) {
            free(t);
            return kds_err_set(err, KDS_NOMEM, "out of memory creating the tokenizer");
        }
    }
    t->bos = c->bos_token_id >= 256 && c->bos_token_id < t->vocab ? c->bos_token_id
             : t->vocab > 256                                      ? 256
                                                                   : -1;
    t->eos = c->eos_token_id >= 256 && c->eos_token_id < t->vocab && c->eos_token_id != t->bos
                 ? c->eos_token_id
             : t->vocab > 257 ? 257
                              : -1;
    for (int i = 0; i < n_special; i++) {
        int id = 256 + i;
        if (id == t->bos)
            snprintf(t->names[i], TOK_NAME_MAX, "<|bos|>");
        else if (id == t->eos)
            snprintf(t->names[i], TOK_NAME_MAX, "<|eos|>");
        else
            snprintf(t->names[i], TOK_NAME_MAX, "<|special_%d|>", id);
    }
    *out = t;
    return KDS_OK;
}

void eng__tok_free(eng_tokenizer *t) {
    if (!t) return;
    free(t->names);
    free(t);
}

int64_t eng_tok_encode(const eng_tokenizer *t, const char *text, size_t len, int32_t *ids,
                       int64_t cap) {
    (void)t;
    for (size_t i = 0; i < len && (int64_t)i < cap; i++) ids[i] = (unsigned char)text[i];
    return (int64_t)len;
}

const char *eng_tok_piece(const eng_tokenizer *t, int32_t id, size_t *len) {
    if (id >= 0 && id < 256) {
        *len = 1;
        return (const char *)&t->bytes[id];
    }
    if (id >= 256 && id < t->vocab) {
        *len = strlen(t->names[id - 256]);
        return t->names[id - 256];
    }
    *len = 0;
    return "";
}

int eng_tok_vocab(const eng_tokenizer *t) { return t->vocab; }
int32_t eng_tok_eos(const eng_tokenizer *t) { return t->eos; }
int32_t eng_tok_bos(const eng_tokenizer *t) { return t->bos; }
