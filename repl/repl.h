/*
 * repl.h - `kdaserve chat`: a conversation with a model kept in a session of
 * the snapshot store, driven line by line.
 *
 * One repl owns a model, a compute context, one sequence and the open
 * store. Every user message is rendered (Kimi's chat format when the
 * tokenizer has it, else the text is fed as a plain continuation), only the
 * new tokens are prefilled (the sequence keeps the whole context), the reply
 * is streamed until a stop token or max_tokens, and the session is saved
 * after every turn, so a later `chat --session NAME` resumes exactly where
 * it was (the snapshot is loaded, nothing is replayed).
 *
 * Lines starting with '/' are commands (/help lists them). Errors (unknown
 * command, missing session, corrupt snapshot, bad value) are one line and
 * the repl goes on.
 *
 * Output: in text mode replies go to `out` (one line per reply); notices
 * (session opened, saved) go to `err` in scripted mode and to `out` in
 * interactive mode; errors go to `err` as "kdaserve chat: REASON". In JSON
 * mode every event is one JSON object on its own line of `out`:
 *   {"event":"token","text":T}        a piece of the reply
 *   {"event":"done","tokens":N,"prompt_tokens":P,"context":C,"session":S,
 *    "snapshot":ID,"stopped":"stop"|"length"|"interrupt", "reply": TEXT}
 *   {"event":"error","message":M}
 *   {"event":"info","message":M}      a notice
 *   {"event":"output","command":C,"text":T}  what a command printed
 *   {"event":"progress","done":D,"total":T,"tok_s":S}  /ingest
 *
 * Mode: see repl_params.mode.
 *
 * Ownership: repl_create borrows the strings in repl_params for the call
 * only. Caller owns the repl: free with repl_free. Not thread-safe (one
 * thread drives a repl); repl_interrupt alone may be called from a signal
 * handler.
 */
#ifndef REPL_H
#define REPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "eng.h"
#include "kds_status.h"

typedef struct repl repl;

typedef struct repl_params {
    const char *model_dir;  /* NULL: the session's model directory, else default_model_dir */
    const char *default_model_dir;
    const char *db_dir;     /* NULL = sess_default_dir */
    const char *session;    /* open or create this session; NULL = a new "chat-N" */
    bool json;              /* one JSON object per event on `out` */
    bool interactive;       /* notices go to `out`, a prompt is shown */
    /* AUTO: the chat format when the tokenizer has it and the model
     * directory has a chat template (else plain continuation: the text is
     * fed as is); CHAT / PLAIN force one. */
    enum { REPL_MODE_AUTO, REPL_MODE_CHAT, REPL_MODE_PLAIN } mode;
    int threads;            /* 0 = all CPUs */
    bool bf16_act;          /* prompts' (and /ingest's) products with bf16 activations
                             * (eng_ctx_params.bf16_act); default exact */
    int64_t max_tokens;     /* reply limit per turn; default 256 */
    bool ignore_eos;        /* go on past stop tokens (a reply ends at max_tokens or Ctrl-C) */
    uint64_t seed;          /* sampler seed of a new sequence; default 0 */
    eng_sampler_params sampler;
    /* true: `sampler` came from options and replaces the settings a session
     * recorded; false: an opened session continues with its own */
    bool sampler_given;
    const char *history_file; /* interactive: readline history (NULL = none) */
    /* Expert parallelism (docs/expert-parallel.md): the job's ranks under
     * mpirun (borrowed), or NULL for one process; the model is loaded with
     * this rank's share of the experts, the context drives the others. */
    eng_comm *comm;
    eng_ep_placement ep_placement;
} repl_params;

repl_params repl_default_params(void);

/* Load the model, open the store and the session (resuming its head
 * snapshot when it exists). Errors name the model, store or session; *out
 * is NULL on failure. Caller owns *out: free with repl_free. */
kds_status repl_create(const repl_params *p, FILE *out, FILE *err, repl **out_repl,
                       kds_err *e);
void repl_free(repl *r); /* NULL is a no-op */

/* Handle one input line (without its newline): a command or a user message.
 * Returns false when the repl should end (/quit). Errors are reported on the
 * repl's streams and the repl stays usable. */
bool repl_line(repl *r, const char *line);

/* Read lines from `in` until EOF or /quit (scripted mode). Returns the
 * number of turns and commands that failed. */
int repl_run_stream(repl *r, FILE *in);

/* Interactive mode on the terminal with GNU readline: history, tab
 * completion of commands and session names, Ctrl-C stops a generation (a
 * second Ctrl-C at the prompt leaves), Ctrl-D leaves. Returns the number of
 * failures. */
int repl_run_interactive(repl *r);

/* Ask the current generation to stop after its current token (async-signal
 * safe). */
void repl_interrupt(void);

/* The command names (NULL-terminated), for completion and help. */
const char *const *repl_commands(void);

/* Session names of the repl's store, for completion: a malloc'd,
 * NULL-terminated array of malloc'd strings (free each and the array). */
char **repl_session_names(repl *r);

#endif /* REPL_H */
