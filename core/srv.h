/*
 * srv.h - the serving core: what every front end of kdaserve does the same
 * way around one turn of a conversation, below the front ends (web, repl,
 * cli) and above the session store. Library `kds_core`, prefix `srv_`.
 *
 * Today it holds the reply of a turn (srv_reply): token by token, what text
 * the client may be sent, when the reply ends (a stop token, a stop string,
 * max_tokens) and which token the context is fed next (the sampled one, or
 * <|im_end|> where a chat turn must end on it). The server's scheduler
 * (web/web_engine.c) drives it for WebSocket and HTTP turns alike.
 *
 * Ownership: srv_reply_create's caller owns the reply (srv_reply_free). The
 * tokenizer is borrowed for the reply's life.
 *
 * Thread-safety: a reply is used by one thread at a time.
 *
 * Allocation: at create; srv_reply_token appends to the reply's text buffer,
 * which grows geometrically (kds_buf), and allocates nothing else.
 *
 * Errors: kds_status with a one-line message; a failed call leaves the
 * reply as it was.
 */
#ifndef SRV_H
#define SRV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "eng.h"
#include "kds_status.h"

#define SRV_STOP_COUNT 4 /* stop strings of one reply */
#define SRV_STOP_MAX 256 /* bytes of one stop string */

typedef struct srv_reply srv_reply;

typedef struct srv_reply_params {
    int64_t max_tokens;               /* tokens to sample at most */
    bool ignore_eos;                  /* stop tokens do not end the reply */
    bool chat;                        /* a chat turn: cut short, it is closed with <|im_end|> */
    bool end_on_im_end;               /* chat: a stop token ends the context as <|im_end|> does
                                         (a base model's [EOS]), so the context is what re-rendering
                                         the conversation gives (HTTP resume) */
    const char *stop[SRV_STOP_COUNT]; /* copied; the reply ends before the first */
    int n_stop;
} srv_reply_params;

srv_reply_params srv_reply_default_params(void);

/* What the turn does after feeding srv_step.feed. */
typedef enum srv_after {
    SRV_DECODE = 0, /* sample the next token */
    SRV_CLOSE,      /* the reply ended: feed srv_reply_close_token (if any), then finish */
    SRV_FINISH,     /* the turn is over */
} srv_after;

typedef struct srv_step {
    int32_t feed; /* the token the context takes now */
    srv_after after;
    const char *reason; /* "stop" or "length" once the reply ended, else NULL */
    const char *text;   /* reply text that may be sent now (borrowed: until the next call) */
    size_t len;         /* never ends inside a UTF-8 character; text that could still
                           begin a stop string is held back until it cannot */
} srv_step;

/* A reply decoded with `tok` (specials are not text). Errors: KDS_INVALID_ARG
 * (a stop string empty or over SRV_STOP_MAX bytes, n_stop out of range),
 * KDS_NOMEM. */
kds_status srv_reply_create(const eng_tokenizer *tok, const srv_reply_params *p, srv_reply **out,
                            kds_err *err);
void srv_reply_free(srv_reply *r); /* NULL is a no-op */

/* The sampled token `token`: what to feed, what comes next, what to send. */
kds_status srv_reply_token(srv_reply *r, int32_t token, srv_step *out, kds_err *err);

/* The token that closes a reply cut short (<|im_end|> of a chat turn), -1
 * when none is needed. */
int32_t srv_reply_close_token(const srv_reply *r);

/* At the end: the text still to send (what the decoder and the stop strings
 * held back), borrowed until the next call. */
const char *srv_reply_finish(srv_reply *r, size_t *len);

/* The reply so far (cut before a stop string), NUL-terminated; borrowed. */
const char *srv_reply_text(const srv_reply *r, size_t *len);
/* Tokens sampled (a stop token counts). */
int64_t srv_reply_produced(const srv_reply *r);

#endif /* SRV_H */
