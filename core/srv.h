/*
 * srv.h - the serving core: what every front end of kdaserve does the same
 * way around a turn of a conversation, below the front ends (web, repl,
 * cli) and above the session store. Library `kds_core`, prefix `srv_`.
 *
 * Three parts:
 *   srv_reply  the reply of a turn, token by token: what text the client may
 *              be sent, when the reply ends (a stop token, a stop string,
 *              max_tokens) and which token the context is fed next (the
 *              sampled one, or <|im_end|> where a chat turn must end on it).
 *              Both other parts drive one per turn.
 *   srv_turn   one whole turn on one sequence, as the REPL (`kdaserve chat`)
 *              and `kdaserve generate` run it: prefill the rendered ids, then
 *              draw, reply (srv_reply), feed, until the reply ends; close a
 *              chat reply cut short; and save it as the session's new head
 *              (srv_turn_save). Rendering is eng_chat_turn's (engine/eng.h),
 *              the same for every front end.
 *   srv_sched  the scheduler of `kdaserve serve`: sessions in memory (LRU),
 *              many turns (streams) at once in one continuous-batching loop
 *              (a prefill slice per step, one batched sample and one
 *              eng_decode_batch per step, per-stream backpressure), and a
 *              saver thread that makes finished turns durable off that loop.
 *              Its contract is at its section below.
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

/* Tokens of a prefill slice unless the context's max_batch says otherwise:
 * one scheduler step prefills at most this much of each stream, so it
 * bounds how long a prefill holds up the other streams' decode (wide,
 * exact, two threads: about a second). Half the engine's own default,
 * which is for one stream's throughput. */
#define SRV_PREFILL_SLICE 256
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

/* ------------------------------------------------------------------------ */
/* The scheduler: many turns at once (`kdaserve serve`)                      */
/*
 * A srv_sched holds sessions in memory (srv_sess: a session's sequence at a
 * stored snapshot, at most max_sessions of them; to make room the least
 * recently used idle one is evicted, which loses nothing since every turn
 * is saved as it ends) and runs turns on them, streams (srv_stream, at most
 * max_streams at once, one per session), in one batching loop. Each
 * srv_sched_step:
 *   1. gives every stream still feeding its prompt one prefill slice of at
 *      most eng_ctx_params.max_batch tokens (a long prompt never stalls the
 *      other streams for more than one slice);
 *   2. samples the next token of every decoding stream whose reader keeps up
 *      (the stream's `reader` hook: backpressure is per stream), each with
 *      its own settings, in one eng_sample_batch; passes each through the
 *      stream's srv_reply (text, stop rules, max_tokens); and feeds every
 *      token due (sampled, or the <|im_end|> that closes a chat reply cut
 *      short) in ONE eng_decode_batch;
 *   3. hands the streams that ended to the saver thread, which saves each as
 *      its session's new head (one durable store commit, the turn in the
 *      transcript) and puts its end into the prefix index, while the loop
 *      goes on with the others. The session stays busy (srv_sess_stream)
 *      until srv_sched_collect has answered the save; its sequence is only
 *      read meanwhile (eng_ctx_release took it off the context first).
 * A stream that ended without moving its context, or on an engine error,
 * is answered at once (nothing to save; an error's sequence is not trusted
 * and its session is dropped from memory, to be reloaded from the store).
 *
 * Two kinds of streams: a reply (a prompt known at the start, then a reply
 * drawn token by token: WebSocket `generate`, the HTTP endpoints) and a
 * document (tokens appended while it runs, srv_stream_append, no reply:
 * WebSocket `append`). A stream may pause once at a resume point (point_at):
 * the saver saves the state there as the session's head (no transcript
 * entry) and indexes it, then the stream goes on.
 *
 * Events reach the front end through each stream's hooks (text, fed,
 * reader, ended, done) and the scheduler's own (wake, log, and the metrics:
 * loaded, saved, sessions, prefilled, decoded).
 *
 * Threads: one owner thread (the server's engine thread) makes every srv_
 * call below and receives every hook call, except `wake` and `log`, which
 * the saver thread makes too. The saver thread only reads a saving stream's
 * session and writes the store (which is thread-safe).
 *
 * Ownership: srv_sched_create borrows the model and the store (both must
 * outlive the scheduler) and owns its compute context, its sessions in
 * memory, its streams and its saver thread. A srv_sess * is borrowed: valid
 * until srv_sched_drop, or until the session is evicted (only an idle one,
 * only by a call that loads or creates a session) or dropped at the end of
 * a failed turn. A srv_stream * is borrowed: valid until its `done` hook
 * returns.
 *
 * Allocation: at create (the batch arrays, sized for max_streams); per
 * session loaded (its sequence) and per stream (its ids, its reply);
 * srv_stream_append grows the stream's ids geometrically. A step allocates
 * nothing (the replies' text grows geometrically, kds_buf).
 *
 * Errors: kds_status with a one-line message; a call that fails changes
 * nothing unless its comment says otherwise. A stream's own failure (an
 * engine error) ends it with reason "error"; a failed save reaches its
 * `done` hook (srv_stream_end.save_rc).
 */

typedef struct srv_sched srv_sched;
typedef struct srv_sess srv_sess;
typedef struct srv_stream srv_stream;

/* The clock of every time below: seconds, monotonic (CLOCK_MONOTONIC). */
double srv_now_s(void);

typedef struct srv_sched_hooks {
    void *user;
    /* Saver thread: a save is done, srv_sched_collect has work. Called
     * without any lock of the scheduler held (the owner may hold its own
     * lock around srv_sched_collectable and its wait: no wake-up is lost). */
    void (*wake)(void *user);
    /* An advisory failure, one line (a turn end not indexed, a resume point
     * not saved): any thread. NULL = silent. */
    void (*log)(void *user, const char *line);
    /* A session's state read from the store, in ms (owner thread). */
    void (*loaded)(void *user, double ms);
    /* A durable save done, in ms: a new session, a turn, a resume point
     * (owner thread, when it is answered). */
    void (*saved)(void *user, double ms);
    /* The number of sessions in memory changed to n (owner thread). */
    void (*sessions)(void *user, int n);
    /* n tokens fed through the prefill path: a slice, a new session's
     * context (owner thread). */
    void (*prefilled)(void *user, int64_t n);
    /* A batched decode step fed `rows` tokens, one per stream (owner
     * thread; also when the step failed). */
    void (*decoded)(void *user, int rows);
} srv_sched_hooks;

typedef struct srv_sched_params {
    int max_sessions;   /* sessions in memory (64) */
    int max_streams;    /* streams at once, the largest batch (32) */
    eng_ctx_params ctx; /* the compute context (max_seqs raised to max_streams;
                         * max_batch: the prefill slice, SRV_PREFILL_SLICE) */
    srv_sched_hooks hooks;
} srv_sched_params;

srv_sched_params srv_sched_default_params(void);

/* A scheduler over model m and store st: its compute context and saver
 * thread (which takes no signals). Caller owns *out (srv_sched_free).
 * Errors: KDS_INVALID_ARG (a limit below 1), those of eng_ctx_create,
 * KDS_NOMEM, KDS_INTERNAL (the thread). */
kds_status srv_sched_create(const srv_sched_params *p, const eng_model *m, sess_store *st,
                            srv_sched **out, kds_err *err);
/* Stops the saver and frees everything. Call it when no stream runs or
 * saves (cancel them, then step and collect until srv_sched_running and
 * srv_sched_saving are 0): a stream left is freed without its hooks.
 * NULL is a no-op. */
void srv_sched_free(srv_sched *S);

/* Tokens of one prefill slice (eng_ctx_params.max_batch; 0 there =
 * SRV_PREFILL_SLICE). */
int64_t srv_sched_slice(const srv_sched *S);
/* Whether session `info` continues in chat mode: sess_session_chat_mode,
 * with the model's chat format as the fallback (a mode this version does
 * not know continues as that). */
bool srv_sched_chat_mode(const srv_sched *S, const sess_session_info *info);

/* -- sessions in memory ---------------------------------------------------- */

/* What a session in memory is (srv_sess_get). */
typedef struct srv_sess_info {
    const char *name;   /* store name; "" for a resumed state no session has taken
                           yet (it gets the name its turn is saved to). Borrowed */
    uint64_t base;      /* the stored snapshot its sequence equals */
    int64_t tokens;     /* its length */
    size_t state_bytes; /* eng_seq_state_bytes */
    bool chat;          /* its mode */
    bool has_sampler;   /* the sampler settings its turns recorded: always the
                           store's (sess_session_info), a reply's saved turn
                           records its `sampler`, a document's keeps them */
    eng_sampler_params sampler;
    double load_ms;       /* the load from the store that brought it here (0: made here) */
    double prefill_tok_s; /* its last turn's prefill and decode rates (0 = none) */
    double decode_tok_s;
} srv_sess_info;

/* The session in memory named `name`, or NULL. */
srv_sess *srv_sched_find(srv_sched *S, const char *name);
/* Whether a session can come into memory now: a slot is free, or an idle
 * session can be evicted. */
bool srv_sched_has_room(const srv_sched *S);

/*
 * Stored session `info` (sess_session_get's) into memory: its head loaded
 * into a free slot (evicting the least recently used idle session). A
 * session that is empty there gets a prefix hasher in `scope` (NULL: none):
 * every token of it passes through here, so its turns' ends can be indexed.
 * When it is in memory already, that one (made the most recently used).
 * Errors: KDS_BUSY (every session in memory runs a turn: nothing evicted),
 * those of eng_seq_create and sess_load.
 */
kds_status srv_sched_open(srv_sched *S, const sess_session_info *info, const char *scope,
                          srv_sess **out, kds_err *err);
/*
 * A session in memory without a name at stored snapshot `snapshot`, whose
 * length must be `tokens` (0, 0: an empty sequence, nothing read): a state a
 * stateless client resumes. It takes the name its first turn is saved to
 * (srv_stream_params.save_as); without a saved turn it is dropped when the
 * turn ends. Errors: KDS_BUSY (no room: nothing evicted), KDS_MISMATCH (the
 * snapshot's length is not `tokens`), those of eng_seq_create and sess_load.
 */
kds_status srv_sched_open_state(srv_sched *S, uint64_t snapshot, int64_t tokens, srv_sess **out,
                                kds_err *err);
/*
 * A new session `name`, in memory and in the store: its context ids[0..n)
 * (a rendered system text; n may be 0), fed here, saved as its first
 * snapshot with `turn` (NULL: none) in the transcript; *snapshot gets it.
 * With `scope`, its token sequence is hashed from here on, and the end of
 * a non-empty context is indexed (a fork entry: a stateful client's).
 * Errors: KDS_BUSY (no room), KDS_EXISTS (the store has the name), those of
 * eng_prefill and sess_save; nothing is kept on failure.
 */
kds_status srv_sched_new(srv_sched *S, const char *name, bool chat, const int32_t *ids, int64_t n,
                         const sess_turn *turn, const char *scope, srv_sess **out,
                         uint64_t *snapshot, kds_err *err);
/* Forget a session in memory that runs no turn (a deleted one). */
void srv_sched_drop(srv_sched *S, srv_sess *h);

void srv_sess_get(const srv_sess *h, srv_sess_info *out);
const char *srv_sess_name(const srv_sess *h); /* borrowed; "" when it has none */
/* The stream running on h (saving its end included), or NULL: idle. */
srv_stream *srv_sess_stream(const srv_sess *h);
/* Make h the most recently used. */
void srv_sess_touch(srv_sess *h);
/* The session was renamed in the store: its name here follows. */
void srv_sess_rename(srv_sess *h, const char *name);
/* Whether the session knows its whole token sequence: its prefix hasher (a
 * new session's, an empty loaded one's, or a stream's, srv_stream_params.
 * hasher) holds every token of it. Then the end of each of its turns, and
 * each resume point, goes into the prefix index as it is saved. The
 * scheduler adds every token to the hasher as it is fed, so a turn stopped
 * anywhere (cancelled, its client gone, during its prompt or its reply)
 * leaves it whole; only a session dropped from memory loses it (an engine
 * error, a failed save, an eviction), and a session loaded with tokens in
 * it has none (the store keeps no token sequence). */
bool srv_sess_hashed(const srv_sess *h);

/* -- streams --------------------------------------------------------------- */

typedef enum srv_stream_kind {
    SRV_STREAM_REPLY = 0, /* a prompt, then a reply */
    SRV_STREAM_DOCUMENT,  /* tokens appended while it runs; no reply */
} srv_stream_kind;

typedef enum srv_phase {
    SRV_PHASE_PREFILL = 0, /* feeding its tokens, one slice per step */
    SRV_PHASE_WAIT,        /* a document that fed all it has, waiting for srv_stream_append */
    SRV_PHASE_DECODE,      /* drawing its reply, one token per step */
    SRV_PHASE_CLOSE,       /* the reply ended: the close token (if any) is fed next step */
    SRV_PHASE_FINISH,      /* over: it leaves the loop at the end of this step */
    SRV_PHASE_PAUSE,       /* paused at its resume point while the saver saves it */
    SRV_PHASE_SAVE,        /* over and out of the loop: the saver saves it */
} srv_phase;

/* Why a stream is cancelled (srv_stream_cancel). */
typedef enum srv_cancel {
    SRV_CANCEL_ASKED = 0, /* reason "cancelled" */
    SRV_CANCEL_GONE,      /* reason "disconnected": nobody reads it (wins over ASKED) */
} srv_cancel;

/* Whether a stream's reader keeps up (the `reader` hook). */
typedef enum srv_reader {
    SRV_READER_OK = 0, /* decode */
    SRV_READER_BEHIND, /* too much output unread: not this step */
    SRV_READER_GONE,   /* nobody reads it: decode this step, then end "disconnected" */
} srv_reader;

/* What a stream is and did so far (srv_stream_get: live, borrowed). */
typedef struct srv_stream_info {
    srv_stream_kind kind;
    srv_sess *sess;
    srv_phase phase;
    const char *reason;   /* why it ends (static), NULL while it runs: "stop", "length"
                             (a reply), "complete" (a document fed whole), "cancelled",
                             "disconnected", "error" */
    bool cancelled, gone; /* srv_stream_cancel asked (ASKED, GONE) */
    bool last;            /* every token is given (a reply's at once; a document's last) */
    int64_t context0;     /* the session's length at the start */
    int64_t given;        /* tokens given: ids at the start, plus those appended */
    int64_t fed;          /* of those, tokens fed (prefill) */
    int64_t doc_fed;      /* a document: its own tokens fed (the opener not counted) */
    int64_t produced;     /* tokens drawn (srv_reply_produced) */
    /* srv_now_s times: start, last prefill slice (0 = not yet; a document:
     * its last), first draw, end (0 = running) */
    double t_start, t_prefill_end, t_decode0, t_end;
} srv_stream_info;

/* How a stream ended (the `done` hook). */
typedef struct srv_stream_end {
    const char *reason; /* as srv_stream_info.reason */
    const char *error;  /* the engine's message when reason is "error", else "" */
    kds_status save_rc; /* KDS_OK: saved, or nothing to save */
    const kds_err *save_err;
    uint64_t snapshot; /* the session's head now (its base when nothing was saved) */
} srv_stream_end;

typedef struct srv_stream_hooks {
    /* Reply text that may be shown now (srv_step.text's rules), and at the
     * end what was held back (not after an error). */
    void (*text)(void *user, srv_stream *st, const char *text, size_t len);
    /* A prefill slice of n tokens went in. */
    void (*fed)(void *user, srv_stream *st, int64_t n);
    /* Asked for a decoding stream before each step (and by
     * srv_sched_runnable). NULL = always SRV_READER_OK. */
    srv_reader (*reader)(void *user, srv_stream *st);
    /* The turn ended and is about to be saved: `turn` is the transcript entry
     * the saver will write (a reply's: prompt, reply, counts, mode, sampler;
     * a document's: counts and mode only), which the hook may change; what it
     * points to must stay valid until `done`. An error fails the save (done
     * carries it). NULL: the entry as it is. Not called when nothing is
     * saved. */
    kds_status (*ended)(void *user, srv_stream *st, sess_turn *turn, kds_err *err);
    /* The turn is over: saved, or not (end->save_rc). The session has its
     * new head and name, and its rates; the stream is freed when this
     * returns (then the session too, when the turn failed or the session
     * has no name). Required. */
    void (*done)(void *user, srv_stream *st, const srv_stream_end *end);
} srv_stream_hooks;

typedef struct srv_stream_params {
    srv_stream_kind kind;
    /* The rendered tokens to feed first (copied): a reply's prompt; a
     * document's first tokens, of which the first `opener` (a chat user
     * turn's start) are not the document's own. */
    const int32_t *ids;
    int64_t n_ids;
    int64_t opener;
    /* A reply: the prompt's text for the transcript (copied). */
    const char *prompt;
    size_t prompt_len;
    /* max_tokens, stop rules, chat; the session takes this mode. A
     * document: max_tokens is ignored (0), chat closes it with <|im_end|>. */
    srv_reply_params reply;
    /* A reply's settings: its saved turn records them as the session's
     * (sess_turn.sampler), in the store and in memory alike (srv_sess_info).
     * A document samples nothing and records none. */
    eng_sampler_params sampler;
    bool reseed; /* re-seed the session's sampler with `seed` at the start */
    uint64_t seed;
    /* Where the turn is saved: NULL = the session itself (sess_save: a head
     * another writer moved is an error); else this session name, with
     * sess_save_ex and `conflict`, and the session in memory takes the name
     * it was saved to (a resume point's save too, after which a forced fork
     * becomes SESS_CONFLICT_FORK: the branch is the turn's own). */
    const char *save_as;
    sess_conflict conflict;
    /* NULL: the session's own prefix hasher goes on (srv_sess_hashed).
     * Else a hasher that holds exactly the session's tokens as they are
     * now (an HTTP resume's: the request's tokens up to the state resumed),
     * which becomes the session's when the stream starts (ownership taken,
     * also on failure, when the session keeps its own). The scheduler adds
     * every token as it is fed; a saved end or resume point is indexed
     * while the hasher is whole (index_fork: as a fork entry). */
    sess_prefix_hasher *hasher;
    bool index_fork;
    /* A resume point when `fed` reaches point_at (0 = none; also
     * srv_stream_point). */
    int64_t point_at;
    double t_start;                /* srv_now_s when the turn began (0 = now) */
    const srv_stream_hooks *hooks; /* borrowed: outlives the stream */
    void *user;
} srv_stream_params;

srv_stream_params srv_stream_default_params(void);

/*
 * Start a turn on idle session h: it joins the loop (a document that has
 * no token yet waits for srv_stream_append). Errors: KDS_BUSY (h runs a
 * turn, or max_streams run), KDS_INVALID_ARG (a reply with nothing to draw
 * from: h and the prompt both empty; no hooks; a bad stop string), KDS_NOMEM.
 */
kds_status srv_stream_start(srv_sched *S, srv_sess *h, const srv_stream_params *p, srv_stream **out,
                            kds_err *err);
/* Append ids[0..n) to document st (copied; `last`: the document ends
 * there). Errors: KDS_INVALID_ARG (not a document, or its last came),
 * KDS_NOMEM; the stream is unchanged then. */
kds_status srv_stream_append(srv_stream *st, const int32_t *ids, int64_t n, bool last,
                             kds_err *err);
/* Set st's resume point (as srv_stream_params.point_at). */
void srv_stream_point(srv_stream *st, int64_t at);
/* The tokens given and not fed yet of a document's own (borrowed, until the
 * next call on st). */
const int32_t *srv_stream_unfed(const srv_stream *st, int64_t *n);
/* Ask st to stop: a prefill stops before its next slice, a reply before its
 * next draw (a chat reply is closed); what went in is saved. */
void srv_stream_cancel(srv_stream *st, srv_cancel why);
const srv_stream_info *srv_stream_get(const srv_stream *st);
void *srv_stream_user(const srv_stream *st);
/* The reply so far (srv_reply_text), borrowed. */
const char *srv_stream_reply(const srv_stream *st, size_t *len);

/* -- the loop -------------------------------------------------------------- */

/* One step of the loop (above). Hooks are called from here: text, fed,
 * reader, ended, prefilled, decoded, and done for a stream with nothing to
 * save. */
void srv_sched_step(srv_sched *S);
/* Answer the saves the saver has finished, in the order it finished them:
 * each turn's `done` (its session free again), or a resume point's stream
 * back into the loop. */
void srv_sched_collect(srv_sched *S);
/* Whether srv_sched_collect has work (any thread). */
bool srv_sched_collectable(srv_sched *S);
/* Whether a step would do anything: a stream prefills, ends, closes, or
 * decodes with its reader keeping up (false: only waiting, paused or
 * backpressured streams). */
bool srv_sched_runnable(srv_sched *S);
/* Streams in the loop (not those saving their end), and those saving. */
int srv_sched_running(const srv_sched *S);
int srv_sched_saving(const srv_sched *S);
/* The streams in the loop, newest first: NULL starts, NULL ends. */
srv_stream *srv_sched_next(srv_sched *S, srv_stream *prev);

#endif /* SRV_H */
