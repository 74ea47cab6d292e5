/*
 * repl.c - the chat core: model, sequence and session; one user turn
 * (render, prefill the new tokens, stream the reply, save); the slash
 * commands; scripted mode (one message per line). Interactive readline
 * mode is in repl_line.c.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cJSON.h>

#include "eng_ep.h"
#include "srv.h"
#include "kds_buf.h"
#include "repl_internal.h"
#include "kds_clock.h"

static volatile sig_atomic_t g_interrupt;

void repl_interrupt(void) {
    g_interrupt = 1;
}
bool repl__interrupted(void) {
    return g_interrupt != 0;
}
void repl__clear_interrupt(void) {
    g_interrupt = 0;
}

repl_params repl_default_params(void) {
    repl_params p = {0};
    p.max_tokens = 256;
    p.sampler = eng_sampler_default_params();
    return p;
}

/* ------------------------------------------------------------------------ */
/* Output: text or JSON events                                               */

void repl__emit_json(repl *r, cJSON *o) {
    char *s = cJSON_PrintUnformatted(o);
    if (s) {
        fputs(s, r->out);
        fputc('\n', r->out);
        fflush(r->out);
    }
    free(s);
    cJSON_Delete(o);
}

static void emit_event(repl *r, const char *event, const char *key, const char *text) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "event", event);
    cJSON_AddStringToObject(o, key, text);
    repl__emit_json(r, o);
}

void repl__error(repl *r, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    r->failures++;
    if (r->json) {
        emit_event(r, "error", "message", msg);
    } else {
        fflush(r->out);
        fprintf(r->err, "kdaserve chat: %s\n", msg);
        fflush(r->err);
    }
}

void repl__info(repl *r, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (r->json) {
        emit_event(r, "info", "message", msg);
    } else {
        FILE *f = r->interactive ? r->out : r->err;
        fprintf(f, "%s%s\n", r->interactive ? "" : "[kdaserve] ", msg);
        fflush(f);
    }
}

/* What a command printed (built in a memstream): as is, or one event. */
void repl__output(repl *r, const char *cmd, const char *text) {
    if (r->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "event", "output");
        cJSON_AddStringToObject(o, "command", cmd);
        cJSON_AddStringToObject(o, "text", text);
        repl__emit_json(r, o);
    } else {
        fputs(text, r->out);
        fflush(r->out);
    }
}

/* A reply's bytes on a terminal or pipe: control bytes other than newline
 * and tab are shown as \xHH so a random model cannot scramble the screen. */
static void print_piece(FILE *f, const char *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)p[i];
        if ((ch < 0x20 && ch != '\n' && ch != '\t') || ch == 0x7f)
            fprintf(f, "\\x%02x", ch);
        else
            fputc(ch, f);
    }
}

static void emit_piece(repl *r, const char *p, size_t n) {
    if (!n) return;
    if (r->json) {
        char *t = strndup(p, n);
        if (!t) return;
        emit_event(r, "token", "text", t);
        free(t);
    } else {
        print_piece(r->out, p, n);
        fflush(r->out);
    }
}

/* ------------------------------------------------------------------------ */
/* Sessions                                                                  */

/* The first free "chat-N" (not the current session's name either). */
void repl__auto_name(repl *r, char name[SESS_NAME_MAX + 1]) {
    char cand[SESS_NAME_MAX + 1];
    for (unsigned k = 1;; k++) {
        sess_session_info si;
        kds_err e = {0};
        snprintf(cand, sizeof cand, "chat-%u", k);
        if (strcmp(cand, r->session) && sess_session_get(r->st, cand, &si, &e) == KDS_NOT_FOUND)
            break;
    }
    memcpy(name, cand, sizeof cand);
}

const char *repl__mode_name(const repl *r) {
    return r->chat ? "chat" : "plain";
}

size_t repl__utf8_head(const char *p, size_t n, size_t max) {
    if (n <= max) return n;
    while (max > 0 && ((unsigned char)p[max] & 0xC0) == 0x80)
        max--;
    return max;
}

/* At most `clip` bytes of p[0, n): its head or its tail, cut on UTF-8
 * character boundaries, with "[... N bytes]" where text was left out. */
static void print_clipped(FILE *f, const char *p, size_t n, size_t clip, bool tail) {
    if (!clip || n <= clip) {
        print_piece(f, p, n);
        return;
    }
    if (tail) {
        size_t from = n - clip;
        while (from < n && ((unsigned char)p[from] & 0xC0) == 0x80)
            from++;
        fprintf(f, "[... %zu bytes] ", from);
        print_piece(f, p + from, n - from);
    } else {
        const size_t to = repl__utf8_head(p, n, clip);
        print_piece(f, p, to);
        fprintf(f, " [... %zu bytes]", n - to);
    }
}

void repl__print_transcript(FILE *f, const sess_turn_record *t, size_t count, size_t last,
                            size_t clip) {
    size_t first = last && count > last ? count - last : 0;
    if (first) fprintf(f, "... %zu earlier turn%s\n", first, first == 1 ? "" : "s");
    for (size_t i = first; i < count; i++) {
        /* an ingested document shows collapsed (its text is in the store
         * and in an export); "" below is the empty reply of an ingest */
        if (t[i].doc_name[0]) {
            fprintf(f, "[document %s: %lld bytes, %lld tokens]\n", t[i].doc_name,
                    (long long)t[i].doc_bytes, (long long)t[i].prompt_tokens);
            if (!t[i].output_len) continue;
        } else {
            fprintf(f, "> ");
            print_clipped(f, t[i].prompt, t[i].prompt_len, clip, false);
        }
        fputc('\n', f);
        print_clipped(f, t[i].output, t[i].output_len, clip, true);
        fputc('\n', f);
    }
}

/* The format session `si` continues in: --chat / --plain when given, else
 * the session module's rule (sess_session_chat_mode, shared with the
 * server), with the current format for a session nothing tells about. */
static kds_status session_mode(repl *r, const sess_session_info *si, bool *chat, kds_err *e) {
    if (r->mode != REPL_MODE_AUTO) {
        *chat = r->mode == REPL_MODE_CHAT;
        return KDS_OK;
    }
    kds_status rc = sess_session_chat_mode(r->st, si, r->tok, r->chat, chat, e);
    if (rc != KDS_OK) /* the way out: say the format */
        snprintf(e->msg + strlen(e->msg), sizeof e->msg - strlen(e->msg),
                 "; pass --chat or --plain (model %s)", r->model_path);
    return rc;
}

/* Load session `name` into the sequence (the repl is unchanged on failure). */
kds_status repl__open(repl *r, const char *name, kds_err *e) {
    sess_session_info si;
    bool chat;
    if (sess_session_get(r->st, name, &si, e) != KDS_OK) return e->status;
    if (session_mode(r, &si, &chat, e) != KDS_OK) return e->status;
    sess_snapshot_info head;
    double t0 = kds_now_s();
    if (sess_load(r->st, si.head, r->m, r->s, &head, e) != KDS_OK) return e->status;
    r->last_resume_ms = (kds_now_s() - t0) * 1e3;
    if (si.mode[0] && strcmp(si.mode, chat ? "chat" : "plain"))
        repl__info(r, "session '%s' was written in %s mode; continuing in %s mode as asked", name,
                   si.mode, chat ? "chat" : "plain");
    if (si.has_sampler && !r->sp_given) r->sp = si.sampler; /* as its last turn sampled */
    r->chat = chat;
    r->base = si.head;
    r->base_tokens = head.tokens;
    snprintf(r->session, sizeof r->session, "%s", name);
    free(r->system);
    r->system = NULL;
    repl__claim(r);
    return KDS_OK;
}

void repl__claim(repl *r) {
    if (r->claimed[0] && strcmp(r->claimed, r->session)) {
        sess_writer_release(r->st, r->claimed, NULL);
        r->claimed[0] = '\0';
    }
    if (!strcmp(r->claimed, r->session)) return;
    sess_writer other;
    bool busy = false;
    /* advisory: a claim that cannot be written (read-only disk, full
     * disk) must not stop the conversation */
    if (sess_writer_claim(r->st, r->session, "chat", &other, &busy, NULL) != KDS_OK) return;
    snprintf(r->claimed, sizeof r->claimed, "%s", r->session);
    if (busy) {
        char who[200];
        sess_writer_describe(&other, who, sizeof who);
        repl__info(r, "session '%s' is also open for writing in %s: if it saves a turn first, "
                   "yours is saved as a fork", r->session, who);
    }
}

/* Notice after opening: size, resume time, the last few turns. */
void repl__opened_notice(repl *r) {
    repl__info(r,
               "session '%s' (%s mode): %lld tokens, %zu bytes of state, resumed from @%llu "
               "in %.2f ms",
               r->session, repl__mode_name(r), (long long)eng_seq_pos(r->s),
               eng_seq_state_bytes(r->s), (unsigned long long)r->base, r->last_resume_ms);
    if (!r->interactive) return;
    sess_turn_record *t = NULL;
    size_t n = 0;
    if (sess_transcript(r->st, r->session, &t, &n, NULL) == KDS_OK && n) {
        /* the last few turns, clipped: a long reply or ingested document
         * must not scroll the screen away (/history shows them whole) */
        repl__print_transcript(r->out, t, n, 3, 320);
        fflush(r->out);
    }
    sess_transcript_free(t, n);
}

/* Save the sequence as the session's new head. */
bool repl__save(repl *r, const sess_turn *turn, uint64_t *snap) {
    kds_err e = {0};
    sess_save_result res;
    if (sess_save_ex(r->st, r->session, r->base, r->m, r->s, turn, SESS_CONFLICT_FORK, &res,
                     &e) != KDS_OK) {
        repl__error(r, "session '%s' not saved: %s", r->session, e.msg);
        return false;
    }
    if (res.forked) {
        repl__info(r, "session '%s' was moved on to @%llu by another writer while this turn ran "
                   "from @%llu: this turn was saved as session '%s' (a fork at @%llu), and you "
                   "are now in '%s'; '%s' keeps the other writer's turns",
                   r->session, (unsigned long long)res.other_head, (unsigned long long)r->base,
                   res.session, (unsigned long long)r->base, res.session, r->session);
        snprintf(r->session, sizeof r->session, "%s", res.session);
        repl__claim(r);
    }
    *snap = res.snapshot;
    r->base = *snap;
    r->base_tokens = eng_seq_pos(r->s);
    return true;
}

/* ------------------------------------------------------------------------ */
/* Create / free                                                             */

kds_status repl_create(const repl_params *p, FILE *out, FILE *errf, repl **out_repl, kds_err *e) {
    *out_repl = NULL;
    repl *r = calloc(1, sizeof *r);
    if (!r) return kds_err_set(e, KDS_NOMEM, "out of memory");
    r->out = out;
    r->err = errf;
    r->json = p->json;
    r->interactive = p->interactive;
    r->sp = p->sampler;
    r->sp_given = p->sampler_given;
    r->max_tokens = p->max_tokens > 0 ? p->max_tokens : 256;
    r->ignore_eos = p->ignore_eos;
    r->bf16_act = p->bf16_act;
    r->seed = p->seed;
    r->mode = p->mode;
    if (p->history_file) r->history_file = strdup(p->history_file);
    sess_params sp = sess_default_params();
    if (sess_open(p->db_dir, &sp, &r->st, e) != KDS_OK) goto fail;
    sess_session_info si;
    bool exists = false;
    if (p->session) {
        if (!sess_name_valid(p->session)) {
            kds_err_set(e, KDS_INVALID_ARG,
                        "invalid session name '%s' (1-%d of A-Z a-z 0-9 . _ -, starting with a "
                        "letter or digit)",
                        p->session, SESS_NAME_MAX);
            goto fail;
        }
        kds_status st = sess_session_get(r->st, p->session, &si, e);
        if (st == KDS_OK)
            exists = true;
        else if (st != KDS_NOT_FOUND)
            goto fail;
    }
    const char *dir = p->model_dir                ? p->model_dir
                      : exists && si.model_dir[0] ? si.model_dir
                                                  : p->default_model_dir;
    if (!dir) {
        kds_err_set(e, KDS_NOT_FOUND, "no model: pass --model DIR or set KDASERVE_MODEL");
        goto fail;
    }
    eng_model_params mp = eng_model_default_params();
    mp.progress = true; /* reading a large model into memory takes seconds */
    eng_ep_model_params(&mp, p->comm, p->ep_placement);
    if (eng_model_load(dir, &mp, &r->m, e) != KDS_OK) goto fail;
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = p->threads;
    cp.bf16_act = p->bf16_act;
    cp.comm = p->comm;
    if (eng_ctx_create(r->m, &cp, &r->c, e) != KDS_OK) goto fail;
    if (eng_seq_create(r->m, r->seed, &r->s, e) != KDS_OK) goto fail;
    r->tok = eng_model_tokenizer(r->m);
    /* "build/../models/default" reads better resolved */
    char real[PATH_MAX];
    snprintf(r->model_path, sizeof r->model_path, "%s",
             realpath(eng_model_dir(r->m), real) ? real : eng_model_dir(r->m));
    r->new_chat =
        eng_chat_supported(r->tok) &&
        (p->mode == REPL_MODE_CHAT || (p->mode == REPL_MODE_AUTO && eng_model_chat_format(r->m)));
    r->chat = r->new_chat;
    if (p->mode == REPL_MODE_CHAT && !r->chat) {
        kds_err_set(e, KDS_UNSUPPORTED,
                    "model %s has no chat format (its tokenizer lacks "
                    "<|im_user|>, <|im_middle|>, <|im_end|>, and K3's <|open|>, <|sep|>, "
                    "<|close|>, <|end_of_msg|>): use plain mode",
                    dir);
        goto fail;
    }
    if (exists) {
        if (repl__open(r, p->session, e) == KDS_OK) {
            repl__opened_notice(r);
            goto done;
        }
        kds_err_prefix(e, "cannot resume session '%s'", p->session);
        /* A script stops here (its next lines were meant for that session);
         * at a terminal the error is one line and the repl starts a new
         * session, so /sessions, /open and the rest stay at hand. */
        if (!p->interactive) goto fail;
        repl__error(r, "%s", e->msg);
        kds_err_clear(e);
        repl__auto_name(r, r->session);
    } else if (p->session) {
        snprintf(r->session, sizeof r->session, "%s", p->session);
    } else {
        repl__auto_name(r, r->session);
    }
    repl__info(r, "new session '%s' (%s mode, model %s)", r->session, repl__mode_name(r),
               r->model_path);
    repl__claim(r);
done:
    *out_repl = r;
    return KDS_OK;
fail:
    repl_free(r);
    return e ? e->status : KDS_INTERNAL;
}

void repl_free(repl *r) {
    if (!r) return;
    if (r->st && r->claimed[0]) sess_writer_release(r->st, r->claimed, NULL);
    eng_seq_free(r->s);
    eng_ctx_free(r->c);
    eng_model_free(r->m);
    sess_close(r->st);
    free(r->system);
    free(r->history_file);
    free(r);
}

/* ------------------------------------------------------------------------ */
/* One turn                                                                  */

/* The ids this message adds to the context: a chat turn (with a pending or
 * default system turn first when the conversation starts) ending in the
 * assistant's opener, or the plain text. Caller owns *ids. */
bool repl__render(repl *r, const char *text, bool gen_prompt, int32_t **ids, int64_t *n) {
    kds_err e = {0};
    if (eng_chat_turn(r->tok, r->chat, eng_seq_pos(r->s), r->system, text, strlen(text),
                      gen_prompt, ids, n, &e) != KDS_OK) {
        repl__error(r, "cannot render the message: %s", e.msg);
        return false;
    }
    return true;
}

/* The turn's hooks (core/srv.h): text as it comes (terminal or JSON token
 * events); Ctrl-C stops the reply before the next draw. */
static void turn_text(void *user, const char *text, size_t len) {
    emit_piece(user, text, len);
}

static bool turn_go_on(void *user) {
    (void)user;
    return !repl__interrupted();
}

static bool user_turn(repl *r, const char *text) {
    kds_err e = {0};
    int32_t *ids = NULL;
    int64_t n = 0;
    srv_turn_result tr = {0};
    bool ok = false;
    if (!repl__render(r, text, true, &ids, &n)) return false;
    if (n == 0 && eng_seq_pos(r->s) == 0) {
        repl__error(r, "empty message and the model has no BOS token to start from");
        goto out;
    }
    repl__clear_interrupt();
    /* the turn as every front end runs it: the stop token stays in the
     * context (the next turn follows it), a chat reply cut short (length,
     * Ctrl-C) is closed so the context ends on a finished turn */
    srv_turn_params tp = srv_turn_default_params();
    tp.sampler = r->sp;
    tp.keep_context = true;
    tp.reply.max_tokens = r->max_tokens;
    tp.reply.ignore_eos = r->ignore_eos;
    tp.reply.chat = r->chat;
    srv_turn_hooks hooks = {.user = r, .text = turn_text, .go_on = turn_go_on};
    int64_t pos0 = eng_seq_pos(r->s);
    kds_status rc = srv_turn_run(r->c, r->s, r->tok, ids, n, &tp, &hooks, &tr, &e);
    if (eng_seq_pos(r->s) != pos0) r->dirty = true;
    if (rc != KDS_OK) {
        repl__error(r, "%s", e.msg);
        goto out;
    }
    if (!r->json) {
        fputc('\n', r->out);
        fflush(r->out);
    }
    r->last_prefill_n = n;
    r->last_prefill_s = tr.prefill_s;
    r->last_decode_n = tr.tokens;
    r->last_decode_s = tr.decode_s;
    free(r->system);
    r->system = NULL;
    sess_turn turn = {.prompt = text,
                      .prompt_len = strlen(text),
                      .output = tr.reply,
                      .output_len = tr.reply_len,
                      .prompt_tokens = n,
                      .output_tokens = tr.tokens,
                      .mode = repl__mode_name(r),
                      .sampler = &r->sp};
    uint64_t snap = 0;
    if (!repl__save(r, &turn, &snap)) goto out;
    r->dirty = false;
    if (r->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "event", "done");
        cJSON_AddNumberToObject(o, "tokens", (double)tr.tokens);
        cJSON_AddNumberToObject(o, "prompt_tokens", (double)n);
        cJSON_AddNumberToObject(o, "context", (double)eng_seq_pos(r->s));
        cJSON_AddStringToObject(o, "session", r->session);
        cJSON_AddNumberToObject(o, "snapshot", (double)snap);
        cJSON_AddStringToObject(o, "stopped", tr.reason);
        cJSON_AddStringToObject(o, "reply", tr.reply);
        cJSON_AddNumberToObject(o, "prefill_tok_s", tr.prefill_s > 0 ? n / tr.prefill_s : 0.0);
        cJSON_AddNumberToObject(o, "decode_tok_s",
                                tr.decode_s > 0 ? tr.tokens / tr.decode_s : 0.0);
        repl__emit_json(r, o);
    } else if (!strcmp(tr.reason, "interrupt")) {
        repl__info(r, "(stopped after %lld tokens; kept)", (long long)tr.tokens);
    }
    ok = true;
out:
    repl__clear_interrupt();
    free(ids);
    srv_turn_result_free(&tr);
    return ok;
}

/* ------------------------------------------------------------------------ */
/* Lines                                                                     */

bool repl_line(repl *r, const char *line) {
    size_t len = strlen(line);
    while (len && (line[len - 1] == '\n' || line[len - 1] == '\r'))
        len--;
    char *text = strndup(line, len);
    if (!text) {
        repl__error(r, "out of memory");
        return true;
    }
    bool go_on = true;
    if (text[0] == '/')
        go_on = repl__command(r, text);
    else if (text[0] || !r->chat) /* an empty plain line continues the text */
        user_turn(r, text);
    free(text);
    return go_on;
}

int repl_run_stream(repl *r, FILE *in) {
    char *line = NULL;
    size_t cap = 0;
    bool quit = false;
    while (!quit && getline(&line, &cap, in) != -1)
        quit = !repl_line(r, line);
    free(line);
    if (!quit) repl__command(r, (char[]){"/quit"}); /* end of input: save what is unsaved */
    return r->failures;
}
