/*
 * srv.h - the serving core: what every front end of kdaserve does the same
 * way around one turn of a conversation, below the front ends (web, repl,
 * cli) and above the session store. Library `kds_core`, prefix `srv_`.
 *
 * Two parts:
 *   srv_reply  the reply of a turn, token by token: what text the client may
 *              be sent, when the reply ends (a stop token, a stop string,
 *              max_tokens) and which token the context is fed next (the
 *              sampled one, or <|im_end|> where a chat turn must end on it).
 *              The server's batching loop (web/web_engine.c) drives one per
 *              stream, for WebSocket and HTTP turns alike.
 *   srv_turn   one whole turn on one sequence, as the REPL (`kdaserve chat`)
 *              and `kdaserve generate` run it: prefill the rendered ids, then
 *              draw, reply (srv_reply), feed, until the reply ends; close a
 *              chat reply cut short; and save it as the session's new head
 *              (srv_turn_save). Rendering is eng_chat_turn's (engine/eng.h),
 *              the same for every front end.
 *
 * Ownership: srv_reply_create's caller owns the reply (srv_reply_free); a
 * srv_turn_result owns its reply text (srv_turn_result_free). The
 * tokenizer, context, sequence and hooks are borrowed for the call.
 *
 * Thread-safety: a reply, and a turn's sequence and context, are used by
 * one thread at a time.
 *
 * Allocation: at create; srv_reply_token appends to the reply's text
 * buffer, which grows geometrically (kds_buf), and allocates nothing else.
 * srv_turn_run allocates its reply once, per turn, not per token.
 *
 * Errors: kds_status with a one-line message; a failed call leaves the
 * reply as it was (a failed turn leaves the sequence part way: the caller
 * does not save it).
 */
#ifndef SRV_H
#define SRV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "eng.h"
#include "kds_status.h"
#include "sess.h"

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
    bool specials_as_text;            /* special tokens sampled inside the reply are text
                                         (`generate` prints them); default: they are not */
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

/* ------------------------------------------------------------------------ */
/* One turn on one sequence (the REPL, `generate`)                           */

typedef struct srv_turn_params {
    srv_reply_params reply;      /* max_tokens, ignore_eos, chat, stop strings */
    eng_sampler_params sampler;
    /* Feed every token the reply takes, the stop token and the closing
     * <|im_end|> included, so the context is whole for the next turn (a
     * session). False: the last token is not fed, nor a cut-short chat
     * reply closed (nobody reads the state afterwards). */
    bool keep_context;
} srv_turn_params;

srv_turn_params srv_turn_default_params(void);

typedef struct srv_turn_hooks {
    void *user;
    /* Text that may be shown now (whole characters; NULL = not shown). */
    void (*text)(void *user, const char *text, size_t len);
    /* Asked before each draw: false stops the reply there (Ctrl-C), reason
     * "interrupt"; a chat reply is closed as one cut short. NULL = never. */
    bool (*go_on)(void *user);
    /* After each draw: the logits it was drawn from and the token (generate
     * --logits-out). NULL = not asked (on a GPU it costs the logits' copy). */
    void (*drawn)(void *user, const float *logits, int32_t token);
} srv_turn_hooks;

typedef struct srv_turn_result {
    const char *reason;    /* "stop", "length" or "interrupt" (static) */
    int64_t prompt_tokens; /* fed before the reply */
    int64_t tokens;        /* the reply's tokens, a final stop token not counted */
    int64_t drawn;         /* draws (the stop token counted) */
    double prefill_s, decode_s;
    char *reply;           /* owned, NUL-terminated: the reply's text */
    size_t reply_len;
} srv_turn_result;

/*
 * One turn: prefill ids[0..n) into s, then draw, reply and feed until the
 * reply ends (srv_reply: a stop token, a stop string, max_tokens; or
 * go_on). A sequence with nothing to draw from (position 0 and n == 0) is
 * refused with KDS_INVALID_ARG before anything. *out is filled on success
 * (free with srv_turn_result_free) and zeroed on failure.
 */
kds_status srv_turn_run(eng_ctx *c, eng_seq *s, const eng_tokenizer *tok, const int32_t *ids,
                        int64_t n, const srv_turn_params *p, const srv_turn_hooks *hooks,
                        srv_turn_result *out, kds_err *err);
void srv_turn_result_free(srv_turn_result *r); /* NULL or zeroed: no-op */

/*
 * The turn as the session's new head: a snapshot of s with the turn in the
 * transcript (prompt text, reply, token counts, mode, sampler settings),
 * continuing `base`; when another writer moved the session on since `base`,
 * saved as a fork (sess_save_ex, SESS_CONFLICT_FORK; res says which).
 * Errors: those of sess_save_ex.
 */
kds_status srv_turn_save(sess_store *st, const char *session, uint64_t base, const eng_model *m,
                         const eng_seq *s, const char *prompt, size_t prompt_len, bool chat,
                         const srv_turn_params *p, const srv_turn_result *r, sess_save_result *res,
                         kds_err *err);

#endif /* SRV_H */
