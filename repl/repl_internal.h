/* repl_internal.h - the repl object and the functions the files of repl/ share. */
#ifndef REPL_INTERNAL_H
#define REPL_INTERNAL_H

#include "repl.h"
#include "sess.h"

struct repl {
    FILE *out, *err;
    bool json, interactive;
    bool chat;                 /* the current session uses the chat format (else plain) */
    bool new_chat;             /* the format a new session gets */
    int mode;                  /* repl_params.mode */
    eng_model *m;
    eng_ctx *c;
    eng_seq *s;
    const eng_tokenizer *tok;
    sess_store *st;
    char session[SESS_NAME_MAX + 1]; /* current session (may not be saved yet) */
    char claimed[SESS_NAME_MAX + 1]; /* the session this process declared it writes ("" none) */
    uint64_t base;             /* snapshot the sequence continues (0 = fresh) */
    int64_t base_tokens;
    bool dirty;                /* the sequence holds tokens not yet saved */
    char *system;              /* system message for the next turn (NULL = none) */
    eng_sampler_params sp;
    bool sp_given; /* repl_params.sampler_given */
    int64_t max_tokens;
    bool ignore_eos;
    bool bf16_act; /* repl_params.bf16_act: /stats says which products run */
    uint64_t seed;
    char *history_file;
    char model_path[4096];     /* the model directory, resolved (for notices) */
    int64_t last_prefill_n, last_decode_n;
    double last_prefill_s, last_decode_s, last_resume_ms;
    int failures;
};

void repl__error(repl *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void repl__info(repl *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A "/..." line; false for /quit. */
bool repl__command(repl *r, char *line);
/* The longest head of p[0, n) of at most `max` bytes that does not end
 * inside a UTF-8 character. */
size_t repl__utf8_head(const char *p, size_t n, size_t max);
bool repl__interrupted(void);
void repl__clear_interrupt(void);
kds_status repl__open(repl *r, const char *name, kds_err *e);
void repl__opened_notice(repl *r);
void repl__auto_name(repl *r, char name[SESS_NAME_MAX + 1]);
/* Save the sequence as the current session's new head. A head another
 * writer moved meanwhile is not lost over: the turn is saved as a fork
 * (SESS_CONFLICT_FORK), said so, and the repl continues there. */
bool repl__save(repl *r, const sess_turn *turn, uint64_t *snap);
/* Declare r->session as written by this process (releasing the previous
 * one) and say so when another process has it open for writing too. */
void repl__claim(repl *r);
/* Print the last `last` turns of a transcript (0 = all); clip > 0 shows at
 * most that many bytes of each prompt (its start) and reply (its end). */
void repl__print_transcript(FILE *f, const sess_turn_record *t, size_t count, size_t last,
                            size_t clip);
/* "chat" or "plain": the mode the current session records. */
const char *repl__mode_name(const repl *r);
void repl__output(repl *r, const char *cmd, const char *text);
/* The ids a message adds: a chat user turn (ending in the assistant's opener
 * when gen_prompt) or the plain text. Caller owns *ids. */
bool repl__render(repl *r, const char *text, bool gen_prompt, int32_t **ids, int64_t *n);
struct cJSON;
void repl__emit_json(repl *r, struct cJSON *o); /* prints and frees o */

#endif
