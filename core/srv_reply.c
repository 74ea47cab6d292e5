/*
 * srv_reply.c - the reply of one turn, token by token (srv.h).
 *
 * Text comes from the tokenizer's stream decoder (never half a character).
 * With stop strings, a stop string can only end inside the newest text, so
 * each token searches the last longest-stop-minus-one bytes before it plus
 * the new ones; what could still begin a stop string is held back.
 */
#include <stdlib.h>
#include <string.h>

#include "kds_buf.h"
#include "srv.h"

struct srv_reply {
    srv_reply_params p;
    char stop[SRV_STOP_COUNT][SRV_STOP_MAX + 1];
    size_t hold; /* the longest stop string less one */
    const eng_tokenizer *tok;
    eng_tok_stream *dec;
    int32_t im_end;
    kds_buf text;
    size_t sent; /* bytes of text handed out */
    bool cut;    /* a stop string ended it */
    int64_t produced;
};

srv_reply_params srv_reply_default_params(void) {
    srv_reply_params p = {.max_tokens = 512};
    return p;
}

kds_status srv_reply_create(const eng_tokenizer *tok, const srv_reply_params *p, srv_reply **out,
                            kds_err *err) {
    *out = NULL;
    if (p->n_stop < 0 || p->n_stop > SRV_STOP_COUNT)
        return kds_err_set(err, KDS_INVALID_ARG, "at most %d stop strings", SRV_STOP_COUNT);
    for (int i = 0; i < p->n_stop; i++)
        if (!p->stop[i] || !p->stop[i][0] || strlen(p->stop[i]) > SRV_STOP_MAX)
            return kds_err_set(err, KDS_INVALID_ARG, "stop string %d must have 1-%d bytes", i,
                               SRV_STOP_MAX);
    srv_reply *r = calloc(1, sizeof *r);
    if (!r) return kds_err_set(err, KDS_NOMEM, "out of memory");
    kds_status rc =
        eng_tok_stream_create(tok, p->specials_as_text ? 0 : ENG_TOK_SKIP_SPECIAL, &r->dec, err);
    if (rc != KDS_OK) {
        free(r);
        return rc;
    }
    r->p = *p;
    for (int i = 0; i < p->n_stop; i++) {
        size_t n = strlen(p->stop[i]);
        memcpy(r->stop[i], p->stop[i], n + 1);
        r->p.stop[i] = r->stop[i];
        if (n - 1 > r->hold) r->hold = n - 1;
    }
    r->tok = tok;
    r->im_end = eng_chat_end_token(tok); /* <|im_end|>, or K3's <|end_of_msg|> */
    *out = r;
    return KDS_OK;
}

void srv_reply_free(srv_reply *r) {
    if (!r) return;
    eng_tok_stream_free(r->dec);
    kds_buf_free(&r->text);
    free(r);
}

/* The length of the longest prefix of p[0..n) that does not end inside a
 * UTF-8 character (a bad byte counts as one). */
static size_t utf8_whole(const unsigned char *p, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = p[i];
        size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
        if (i + k > n) break;
        i += k;
    }
    return i;
}

/* Append decoded text; find a stop string; say how far it may be sent. */
static kds_status add_text(srv_reply *r, const char *p, size_t n, size_t *upto, kds_err *err) {
    size_t before = r->text.len;
    kds_status rc = kds_buf_append(&r->text, p, n, err);
    if (rc != KDS_OK) return rc;
    *upto = r->text.len;
    if (!r->p.n_stop) return KDS_OK;
    size_t from = before > r->hold ? before - r->hold : 0, cut = SIZE_MAX;
    for (int i = 0; i < r->p.n_stop; i++) {
        size_t sl = strlen(r->stop[i]);
        for (size_t at = from; at + sl <= r->text.len && at < cut; at++)
            if (!memcmp(r->text.p + at, r->stop[i], sl)) {
                cut = at;
                break;
            }
    }
    if (cut != SIZE_MAX) {
        r->text.len = cut;
        r->text.p[cut] = '\0';
        r->cut = true;
        *upto = cut;
        return KDS_OK;
    }
    size_t u = r->text.len > r->hold ? r->text.len - r->hold : 0;
    if (u < r->sent) u = r->sent;
    *upto = r->sent + utf8_whole(r->text.p + r->sent, u - r->sent);
    return KDS_OK;
}

static void hand_out(srv_reply *r, size_t upto, const char **text, size_t *len) {
    if (upto < r->sent) upto = r->sent;
    *text = r->text.p ? (const char *)r->text.p + r->sent : ""; /* nothing kept yet: no NULL + 0 */
    *len = upto - r->sent;
    r->sent = upto;
}

kds_status srv_reply_token(srv_reply *r, int32_t token, srv_step *out, kds_err *err) {
    memset(out, 0, sizeof *out);
    out->feed = token;
    out->text = "";
    if (!r->p.ignore_eos && eng_tok_is_stop(r->tok, token)) {
        r->produced++;
        out->after = SRV_FINISH; /* the stop token ends the turn in the context */
        out->reason = "stop";
        if (r->p.chat && r->p.end_on_im_end && r->im_end >= 0) out->feed = r->im_end;
        return KDS_OK;
    }
    const char *piece;
    size_t n, upto = r->sent;
    kds_status rc = eng_tok_stream_put(r->dec, token, &piece, &n, err);
    if (rc != KDS_OK) return rc;
    if (n && !r->cut && (rc = add_text(r, piece, n, &upto, err)) != KDS_OK) return rc;
    r->produced++;
    hand_out(r, upto, &out->text, &out->len);
    if (r->cut) {
        out->after = SRV_CLOSE; /* the token is fed; a chat reply is then closed */
        out->reason = "stop";
    } else if (r->produced >= r->p.max_tokens) {
        out->after = SRV_CLOSE;
        out->reason = "length";
    } else {
        out->after = SRV_DECODE;
    }
    return KDS_OK;
}

int32_t srv_reply_close_token(const srv_reply *r) {
    return r->p.chat ? r->im_end : -1;
}

const char *srv_reply_finish(srv_reply *r, size_t *len) {
    size_t n = 0, upto;
    const char *rest = eng_tok_stream_flush(r->dec, &n);
    /* a failed append keeps what there was: the end is sent without it */
    if (n && !r->cut) (void)add_text(r, rest, n, &upto, NULL);
    const char *t;
    hand_out(r, r->text.len, &t, len); /* everything held back */
    return t;
}

const char *srv_reply_text(const srv_reply *r, size_t *len) {
    if (len) *len = r->text.len;
    return kds_buf_str(&r->text);
}

int64_t srv_reply_produced(const srv_reply *r) {
    return r->produced;
}
