/* repl_cmd.c - the slash commands of `kdaserve chat`. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cJSON.h>

#include "repl_internal.h"
#include "kds_clock.h"

typedef struct command {
    const char *name;
    bool (*run)(repl *r, char *arg); /* false: leave the repl */
    const char *args, *help;
} command;

/* ---- helpers ---- */

static bool parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

static bool parse_f32(const char *s, float lo, float hi, float *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || *end || isnan(v) || v < lo || v > hi) return false;
    *out = v;
    return true;
}

/* Split off the first word of *arg (NULL when none); *arg moves past it. */
static char *next_word(char **arg) {
    char *p = *arg;
    while (*p == ' ' || *p == '\t')
        p++;
    if (!*p) {
        *arg = p;
        return NULL;
    }
    char *w = p;
    while (*p && *p != ' ' && *p != '\t')
        p++;
    if (*p) *p++ = '\0';
    while (*p == ' ' || *p == '\t')
        p++;
    *arg = p;
    return w;
}

static bool check_name(repl *r, const char *name) {
    if (sess_name_valid(name)) return true;
    repl__error(r,
                "invalid session name '%s' (1-%d of A-Z a-z 0-9 . _ -, starting with a letter "
                "or digit)",
                name, SESS_NAME_MAX);
    return false;
}

/* Output built in a memstream, then sent as text or one event. */
typedef struct outbuf {
    FILE *f;
    char *p;
    size_t n;
} outbuf;

static FILE *out_begin(outbuf *o) {
    o->p = NULL;
    o->n = 0;
    o->f = open_memstream(&o->p, &o->n);
    return o->f;
}

static void out_end(repl *r, outbuf *o, const char *cmd) {
    if (!o->f) {
        repl__error(r, "out of memory");
        return;
    }
    fclose(o->f);
    repl__output(r, cmd, o->p ? o->p : "");
    free(o->p);
}

static void fmt_time(int64_t us, char *buf, size_t cap) {
    time_t t = (time_t)(us / 1000000);
    struct tm tm;
    localtime_r(&t, &tm);
    strftime(buf, cap, "%Y-%m-%d %H:%M", &tm);
}

/* ---- commands ---- */

static bool c_help(repl *r, char *arg);

static bool c_quit(repl *r, char *arg) {
    if (r->dirty) {
        uint64_t snap;
        repl__save(r, NULL, &snap);
    }
    return false;
}

static bool c_sessions(repl *r, char *arg) {
    sess_session_info *list = NULL;
    size_t n = 0;
    kds_err e = {0};
    if (sess_session_list(r->st, &list, &n, &e) != KDS_OK) {
        repl__error(r, "%s", e.msg);
        return true;
    }
    outbuf o;
    FILE *f = out_begin(&o);
    if (f) {
        bool current_listed = false;
        for (size_t i = 0; i < n; i++) {
            char when[32] = "?";
            if (list[i].updated_us > 0) fmt_time(list[i].updated_us, when, sizeof when);
            bool cur = !strcmp(list[i].name, r->session);
            current_listed |= cur;
            if (list[i].tokens < 0)
                fprintf(f, "%c %-24s (unreadable)\n", cur ? '*' : ' ', list[i].name);
            else
                fprintf(f, "%c %-24s %10lld tokens %4u turns  %s%s%s\n", cur ? '*' : ' ',
                        list[i].name, (long long)list[i].tokens, list[i].turns, when,
                        list[i].parent[0] ? "  forked from " : "", list[i].parent);
        }
        if (!current_listed) fprintf(f, "* %-24s (new, not saved yet)\n", r->session);
    }
    out_end(r, &o, "sessions");
    free(list);
    return true;
}

static bool c_new(repl *r, char *arg) {
    char *name = next_word(&arg);
    char fresh[SESS_NAME_MAX + 1];
    if (name) {
        if (!check_name(r, name)) return true;
        sess_session_info si;
        if (sess_session_get(r->st, name, &si, NULL) == KDS_OK) {
            repl__error(r, "session '%s' exists (use /open %s)", name, name);
            return true;
        }
        snprintf(fresh, sizeof fresh, "%s", name);
    } else {
        repl__auto_name(r, fresh);
    }
    if (r->dirty) {
        uint64_t snap;
        repl__save(r, NULL, &snap);
    }
    eng_seq_reset(r->s, r->seed);
    r->chat = r->new_chat;
    snprintf(r->session, sizeof r->session, "%s", fresh);
    repl__claim(r);
    r->base = 0;
    r->base_tokens = 0;
    r->dirty = false;
    free(r->system);
    r->system = NULL;
    repl__info(r, "new session '%s' (%s mode)", r->session, repl__mode_name(r));
    return true;
}

static bool c_open(repl *r, char *arg) {
    char *name = next_word(&arg);
    if (!name) {
        repl__error(r, "/open needs a session name (see /sessions)");
        return true;
    }
    if (r->dirty) {
        uint64_t snap;
        repl__save(r, NULL, &snap);
    }
    kds_err e = {0};
    if (repl__open(r, name, &e) != KDS_OK) {
        if (e.status == KDS_NOT_FOUND)
            repl__error(r, "no session '%s' (see /sessions)", name);
        else
            repl__error(r, "cannot open session '%s': %s", name, e.msg);
        return true;
    }
    r->dirty = false;
    repl__opened_notice(r);
    return true;
}

static bool c_fork(repl *r, char *arg) {
    char *name = next_word(&arg);
    if (name && !check_name(r, name)) return true;
    if (r->dirty) {
        uint64_t snap;
        if (!repl__save(r, NULL, &snap)) return true;
        r->dirty = false;
    }
    if (!r->base) {
        repl__error(r, "nothing to fork: session '%s' has no saved turn yet", r->session);
        return true;
    }
    char out[SESS_NAME_MAX + 1];
    kds_err e = {0};
    if (sess_fork(r->st, r->session, name, out, &e) != KDS_OK) {
        repl__error(r, "cannot fork '%s': %s", r->session, e.msg);
        return true;
    }
    repl__info(r, "forked '%s' at @%llu as '%s'; now in '%s' ('%s' is untouched)", r->session,
               (unsigned long long)r->base, out, out, r->session);
    snprintf(r->session, sizeof r->session, "%s", out);
    repl__claim(r);
    return true;
}

static bool c_save(repl *r, char *arg) {
    char *name = next_word(&arg);
    if (name && !check_name(r, name)) return true;
    if (!r->base && eng_seq_pos(r->s) == 0) {
        repl__error(r, "nothing to save yet: session '%s' is empty", r->session);
        return true;
    }
    if (r->dirty || !r->base) {
        uint64_t snap;
        if (!repl__save(r, NULL, &snap)) return true;
        r->dirty = false;
    }
    if (!name) {
        repl__info(r, "session '%s' saved at @%llu (%lld tokens)", r->session,
                   (unsigned long long)r->base, (long long)r->base_tokens);
        return true;
    }
    char out[SESS_NAME_MAX + 1];
    kds_err e = {0};
    if (sess_fork(r->st, r->session, name, out, &e) != KDS_OK) {
        repl__error(r, "cannot save as '%s': %s", name, e.msg);
        return true;
    }
    repl__info(r, "this moment (@%llu, %lld tokens) saved as session '%s'; still in '%s'",
               (unsigned long long)r->base, (long long)r->base_tokens, out, r->session);
    return true;
}

static bool c_history(repl *r, char *arg) {
    sess_turn_record *t = NULL;
    size_t n = 0;
    kds_err e = {0};
    kds_status st = sess_transcript(r->st, r->session, &t, &n, &e);
    if (st != KDS_OK && st != KDS_NOT_FOUND) {
        repl__error(r, "%s", e.msg);
        return true;
    }
    outbuf o;
    FILE *f = out_begin(&o);
    if (f) {
        if (!n) fprintf(f, "(no turns yet in '%s')\n", r->session);
        repl__print_transcript(f, t, n, 0, 0);
    }
    out_end(r, &o, "history");
    sess_transcript_free(t, n);
    return true;
}

static bool c_system(repl *r, char *arg) {
    while (*arg == ' ' || *arg == '\t')
        arg++;
    if (!*arg) {
        repl__error(r, "/system needs the text of the system message");
        return true;
    }
    if (!r->chat) {
        repl__error(r, "this model has no chat format (plain continuation): /system is not used");
        return true;
    }
    char *s = strdup(arg);
    if (!s) {
        repl__error(r, "out of memory");
        return true;
    }
    free(r->system);
    r->system = s;
    repl__info(r, "system message set: it goes before your next message");
    return true;
}

static bool c_set(repl *r, char *arg) {
    char *key = next_word(&arg), *val = next_word(&arg);
    if (!key) {
        outbuf o;
        FILE *f = out_begin(&o);
        if (f)
            fprintf(f,
                    "temperature %g\ntop_p %g\ntop_k %d\nmin_p %g\nmax_tokens %lld\n"
                    "ignore_eos %s\nseed %llu\n",
                    r->sp.temperature, r->sp.top_p, r->sp.top_k, r->sp.min_p,
                    (long long)r->max_tokens, r->ignore_eos ? "on" : "off",
                    (unsigned long long)r->seed);
        out_end(r, &o, "set");
        return true;
    }
    if (!val) {
        repl__error(r, "/set %s needs a value", key);
        return true;
    }
    int64_t v;
    bool ok;
    if (!strcmp(key, "temperature"))
        ok = parse_f32(val, 0.0f, 100.0f, &r->sp.temperature);
    else if (!strcmp(key, "top_p"))
        ok = parse_f32(val, 0.0f, 1.0f, &r->sp.top_p);
    else if (!strcmp(key, "min_p"))
        ok = parse_f32(val, 0.0f, 1.0f, &r->sp.min_p);
    else if (!strcmp(key, "top_k")) {
        ok = parse_i64(val, 0, 1 << 30, &v);
        if (ok) r->sp.top_k = (int)v;
    } else if (!strcmp(key, "max_tokens")) {
        ok = parse_i64(val, 1, INT32_MAX, &v);
        if (ok) r->max_tokens = v;
    } else if (!strcmp(key, "ignore_eos")) {
        bool on = !strcmp(val, "on") || !strcmp(val, "1");
        ok = on || !strcmp(val, "off") || !strcmp(val, "0");
        if (ok) r->ignore_eos = on;
    } else if (!strcmp(key, "seed")) {
        ok = parse_i64(val, 0, INT64_MAX, &v);
        if (ok) {
            r->seed = (uint64_t)v;
            /* a sequence that has not started takes the seed now; a running
             * one keeps its random stream (it is part of its state) */
            if (eng_seq_pos(r->s) == 0) eng_seq_reset(r->s, r->seed);
        }
    } else {
        repl__error(r,
                    "unknown setting '%s' (temperature, top_p, top_k, min_p, max_tokens, "
                    "ignore_eos, seed)",
                    key);
        return true;
    }
    if (!ok) {
        repl__error(r, "bad value '%s' for %s", val, key);
        return true;
    }
    repl__info(r, "%s = %s", key, val);
    return true;
}

static bool c_stats(repl *r, char *arg) {
    outbuf o;
    FILE *f = out_begin(&o);
    if (f) {
        fprintf(f, "session          %s%s\n", r->session, r->base ? "" : " (not saved yet)");
        fprintf(f, "head snapshot    @%llu\n", (unsigned long long)r->base);
        fprintf(f, "mode             %s\n", r->chat ? "chat" : "plain continuation");
        fprintf(f, "model            %s\n", r->model_path);
        fprintf(f, "context tokens   %lld\n", (long long)eng_seq_pos(r->s));
        fprintf(f, "state bytes      %zu\n", eng_seq_state_bytes(r->s));
        fprintf(f, "last prefill     %lld tokens, %.1f tok/s\n", (long long)r->last_prefill_n,
                r->last_prefill_s > 0 ? r->last_prefill_n / r->last_prefill_s : 0.0);
        fprintf(f, "last decode      %lld tokens, %.1f tok/s\n", (long long)r->last_decode_n,
                r->last_decode_s > 0 ? r->last_decode_n / r->last_decode_s : 0.0);
        if (r->last_resume_ms > 0)
            fprintf(f, "last resume      %.2f ms\n", r->last_resume_ms);
        else
            fprintf(f, "last resume      (none)\n");
        fprintf(f, "threads          %d\n", eng_ctx_threads(r->c));
        fprintf(f, "products         %s\n",
                !r->bf16_act               ? "exact"
                : eng_cpu_bf16_products() ? "bf16 activations in a prefill (--bf16)"
                                          : "exact (--bf16: this build has no bf16 dot products)");
    }
    out_end(r, &o, "stats");
    return true;
}

static bool c_restore(repl *r, char *arg) {
    char *id = next_word(&arg);
    uint64_t snap;
    if (!id || !sess_parse_snapshot_id(id, &snap)) {
        repl__error(r, "/restore wants a snapshot id like @12 (kdaserve snap ls lists them)");
        return true;
    }
    char src[32], out[SESS_NAME_MAX + 1];
    snprintf(src, sizeof src, "@%llu", (unsigned long long)snap);
    kds_err e = {0};
    sess_snapshot_info si;
    if (sess_snapshot_get(r->st, snap, &si, &e) != KDS_OK) {
        repl__error(r, "cannot restore %s: %s", src, e.msg);
        return true;
    }
    if (r->dirty) {
        uint64_t s2;
        repl__save(r, NULL, &s2);
    }
    /* a snapshot is continued in a new session, so nothing else moves */
    if (sess_fork(r->st, src, NULL, out, &e) != KDS_OK) {
        repl__error(r, "cannot restore %s: %s", src, e.msg);
        return true;
    }
    if (repl__open(r, out, &e) != KDS_OK) {
        repl__error(r, "cannot restore %s: %s", src, e.msg);
        sess_session_delete(r->st, out, NULL);
        return true;
    }
    r->dirty = false;
    repl__info(r, "restored %s as session '%s'", src, out);
    repl__opened_notice(r);
    return true;
}

static bool c_export(repl *r, char *arg) {
    while (*arg == ' ' || *arg == '\t')
        arg++;
    if (!*arg) {
        repl__error(r, "/export needs a file name");
        return true;
    }
    if (r->dirty) {
        uint64_t snap;
        if (!repl__save(r, NULL, &snap)) return true;
        r->dirty = false;
    }
    if (!r->base) {
        repl__error(r, "nothing to export: session '%s' has no saved turn yet", r->session);
        return true;
    }
    kds_err e = {0};
    if (sess_export(r->st, r->session, arg, &e) != KDS_OK) {
        repl__error(r, "cannot export '%s': %s", r->session, e.msg);
        return true;
    }
    repl__info(r, "session '%s' (@%llu, %lld tokens) exported to %s", r->session,
               (unsigned long long)r->base, (long long)r->base_tokens, arg);
    return true;
}

/* Progress of one /ingest: the prefill runs in slices (so Ctrl-C can stop
 * it between two), and the engine reports every batch of each slice. */
typedef struct ingest_progress {
    repl *r;
    FILE *f;        /* text progress goes here */
    bool tty;       /* f is a terminal: one line redrawn in place */
    int64_t offset; /* tokens of the slices before the current one */
    int64_t total;
    double t0, last;
    int shown_pct; /* not a terminal: the last 10% step printed */
} ingest_progress;

/* A terminal gets one bar redrawn at most five times a second; a file or
 * pipe a line per 10% (at most eleven lines, however long the document);
 * JSON an event at most five times a second. The final 100% always shows. */
static void on_progress(void *user, int64_t slice_done, int64_t slice_total) {
    (void)slice_total;
    ingest_progress *g = user;
    int64_t done = g->offset + slice_done, total = g->total;
    double t = kds_now_s();
    double tps = t > g->t0 ? done / (t - g->t0) : 0.0;
    int pct = total ? (int)(100 * done / total) : 100;
    if (g->r->json || g->tty) {
        if (done < total && t - g->last < 0.2) return;
    } else if (done < total && pct / 10 <= g->shown_pct / 10) {
        return;
    }
    g->last = t;
    g->shown_pct = pct;
    if (g->r->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "event", "progress");
        cJSON_AddNumberToObject(o, "done", (double)done);
        cJSON_AddNumberToObject(o, "total", (double)total);
        cJSON_AddNumberToObject(o, "tok_s", tps);
        repl__emit_json(g->r, o);
        return;
    }
    if (g->tty) {
        int width = 30, fill = total ? (int)(width * done / total) : width;
        fprintf(g->f, "\r[%.*s%*s] %3d%% %lld/%lld tokens, %.0f tok/s", fill,
                "==============================", width - fill, "", pct, (long long)done,
                (long long)total, tps);
        if (done >= total) fputc('\n', g->f);
    } else {
        fprintf(g->f, "%singest: %3d%% %lld/%lld tokens, %.0f tok/s\n",
                g->r->interactive ? "" : "[kdaserve] ", pct, (long long)done, (long long)total,
                tps);
    }
    fflush(g->f);
}

/* Tokens per prefill call of /ingest: a multiple of the engine's batch
 * (256), so slicing changes no batch boundary, and small enough that
 * Ctrl-C is answered within a second or two. */
#define INGEST_SLICE 4096

/* Bytes of `text` that the first `done` of its rendered ids (ids[0, n))
 * cover: the text's own tokens are one run inside them; -1 when that run
 * is not there (then nothing but a note is kept). */
static int64_t fed_text_bytes(repl *r, const char *text, const int32_t *ids, int64_t n,
                              int64_t done) {
    size_t len = strlen(text);
    int64_t nt = eng_tok_encode(r->tok, text, len, NULL, 0);
    if (nt <= 0 || nt > n) return -1;
    int32_t *t = malloc((size_t)nt * sizeof *t);
    if (!t) return -1;
    eng_tok_encode(r->tok, text, len, t, nt);
    int64_t bytes = -1;
    for (int64_t p = 0; p + nt <= n; p++)
        if (!memcmp(ids + p, t, (size_t)nt * sizeof *t)) {
            int64_t fed = done - p < 0 ? 0 : done - p > nt ? nt : done - p;
            bytes = eng_tok_decode(r->tok, t, fed, 0, NULL, 0);
            break;
        }
    free(t);
    return bytes;
}

static bool c_ingest(repl *r, char *arg) {
    while (*arg == ' ' || *arg == '\t')
        arg++;
    if (!*arg) {
        repl__error(r, "/ingest needs a file name");
        return true;
    }
    FILE *f = fopen(arg, "rb");
    if (!f) {
        repl__error(r, "cannot read %s: %s", arg, strerror(errno));
        return true;
    }
    char *text = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&text, &len);
    char buf[65536];
    size_t k;
    errno = 0;
    while (m && (k = fread(buf, 1, sizeof buf, f)) > 0)
        fwrite(buf, 1, k, m);
    int rerr = ferror(f) ? (errno ? errno : EIO) : 0;
    fclose(f);
    if (!m || fclose(m) != 0 || rerr) {
        repl__error(r, "cannot read %s: %s", arg, rerr ? strerror(rerr) : "out of memory");
        free(text);
        return true;
    }
    /* a chat context gets the document as a user turn (no reply asked);
     * plain mode feeds the text as is. Text stops at a NUL byte. */
    int32_t *ids = NULL;
    int64_t n = 0, done = 0;
    kds_err e = {0};
    if (!repl__render(r, text, false, &ids, &n)) {
        free(text);
        return true;
    }
    if (n == 0) {
        repl__error(r, "%s is empty: nothing to ingest", arg);
        goto out;
    }
    FILE *pf = r->interactive ? r->out : r->err;
    ingest_progress g = {
        .r = r, .f = pf, .tty = isatty(fileno(pf)), .total = n, .t0 = kds_now_s(), .shown_pct = 0};
    repl__clear_interrupt();
    bool stopped = false;
    while (done < n) {
        if (repl__interrupted()) {
            stopped = true;
            break;
        }
        int64_t step = n - done < INGEST_SLICE ? n - done : INGEST_SLICE;
        g.offset = done;
        if (eng_prefill(r->c, r->s, ids + done, step, NULL, on_progress, &g, &e) != KDS_OK) {
            if (done) break; /* what went in before stays and is saved below */
            repl__error(r, "cannot ingest %s: %s", arg, e.msg);
            goto out;
        }
        done += step;
        r->dirty = true;
    }
    repl__clear_interrupt();
    if (done < n && !r->json && g.tty) fputc('\n', pf); /* end the bar's line */
    /* a chat turn cut short is closed, as a cut reply is */
    if (done < n && r->chat) {
        int32_t end = eng_chat_end_token(r->tok);
        if (end >= 0 && eng_decode(r->c, r->s, end, &e) != KDS_OK) {
            repl__error(r, "cannot ingest %s: %s", arg, e.msg);
            goto out;
        }
    }
    double dt = kds_now_s() - g.t0;
    r->last_prefill_n = done;
    r->last_prefill_s = dt;
    char prompt[4200];
    if (done < n)
        snprintf(prompt, sizeof prompt, "/ingest %s (stopped after %lld of %lld tokens)", arg,
                 (long long)done, (long long)n);
    else
        snprintf(prompt, sizeof prompt, "/ingest %s", arg);
    sess_turn turn = {.prompt = prompt,
                      .prompt_len = strlen(prompt),
                      .output = "",
                      .prompt_tokens = done,
                      .mode = repl__mode_name(r),
                      .sampler = &r->sp};
    /* The document is kept as the turn's text under its file name, as the
     * server's `append` keeps one (an export carries it). One cut short
     * keeps the text its fed tokens cover: the text's own tokens are one
     * run inside the rendered ids (a chat turn's opener before them, its
     * close after), so the bytes kept are those the fed part of that run
     * decodes to. Where the run is not found, only the note above. */
    char doc_name[SESS_DOC_NAME_MAX + 1];
    int64_t kept = done == n ? (int64_t)strlen(text) : fed_text_bytes(r, text, ids, n, done);
    if (kept >= 0) {
        const char *base = strrchr(arg, '/');
        base = base && base[1] ? base + 1 : arg;
        const size_t bl = repl__utf8_head(base, strlen(base), SESS_DOC_NAME_MAX);
        memcpy(doc_name, base, bl);
        doc_name[bl] = '\0';
        turn.prompt = text;
        turn.prompt_len = (size_t)kept;
        turn.doc_name = bl ? doc_name : NULL;
        turn.doc_bytes = kept;
    }
    uint64_t snap;
    if (!repl__save(r, &turn, &snap)) goto out;
    r->dirty = false;
    if (done < n && !stopped) {
        repl__error(r, "ingest of %s failed after %lld of %lld tokens (kept and saved): %s", arg,
                    (long long)done, (long long)n, e.msg);
    } else if (done < n) {
        repl__info(r, "(ingest of %s stopped after %lld of %lld tokens; kept)", arg,
                   (long long)done, (long long)n);
    } else {
        repl__info(r, "ingested %s: %lld tokens in %.2f s (%.0f tok/s); context %lld tokens", arg,
                   (long long)n, dt, dt > 0 ? n / dt : 0.0, (long long)eng_seq_pos(r->s));
    }
out:
    free(ids);
    free(text);
    return true;
}

static const command COMMANDS[] = {
    {"/help", c_help, "", "this list"},
    {"/sessions", c_sessions, "", "sessions in the store (* = current)"},
    {"/new", c_new, "[NAME]", "start a new session"},
    {"/open", c_open, "NAME", "switch to a saved session (resumes its state)"},
    {"/fork", c_fork, "[NAME]", "continue in a fork; the original stays untouched"},
    {"/save", c_save, "[NAME]", "save now; with NAME also keep this moment as session NAME"},
    {"/restore", c_restore, "ID", "continue snapshot @ID in a new session"},
    {"/ingest", c_ingest, "FILE", "feed a document into the context (progress, tok/s)"},
    {"/export", c_export, "FILE", "write this session to one portable file"},
    {"/history", c_history, "", "the transcript of this session"},
    {"/system", c_system, "TEXT", "a system message before your next message"},
    {"/set", c_set, "[KEY VALUE]",
     "temperature|top_p|top_k|min_p|max_tokens|ignore_eos|seed (no args: show)"},
    {"/stats", c_stats, "", "context tokens, state bytes, speeds, last resume time"},
    {"/quit", c_quit, "", "leave (the session is saved)"},
    {"/exit", c_quit, "", "the same as /quit"},
};
#define N_COMMANDS (sizeof COMMANDS / sizeof COMMANDS[0])

static bool c_help(repl *r, char *arg) {
    outbuf o;
    FILE *f = out_begin(&o);
    if (f) {
        fprintf(f, "Type a message to chat; lines starting with / are commands:\n");
        for (size_t i = 0; i < N_COMMANDS; i++) {
            char head[64];
            snprintf(head, sizeof head, "%s %s", COMMANDS[i].name, COMMANDS[i].args);
            fprintf(f, "  %-22s %s\n", head, COMMANDS[i].help);
        }
        if (r->interactive)
            fprintf(f, "Ctrl-C stops a reply (keeping it); Ctrl-D or /quit leaves.\n");
    }
    out_end(r, &o, "help");
    return true;
}

const char *const *repl_commands(void) {
    static const char *names[N_COMMANDS + 1];
    for (size_t i = 0; i < N_COMMANDS; i++)
        names[i] = COMMANDS[i].name;
    names[N_COMMANDS] = NULL;
    return names;
}

bool repl__command(repl *r, char *line) {
    char *arg = line;
    char *name = next_word(&arg);
    if (!name) return true;
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (!strcmp(name, COMMANDS[i].name)) return COMMANDS[i].run(r, arg);
    repl__error(r, "unknown command '%s' (try /help)", name);
    return true;
}

char **repl_session_names(repl *r) {
    sess_session_info *list = NULL;
    size_t n = 0;
    if (sess_session_list(r->st, &list, &n, NULL) != KDS_OK) n = 0;
    char **names = calloc(n + 1, sizeof *names);
    if (names)
        for (size_t i = 0; i < n; i++)
            names[i] = strdup(list[i].name);
    free(list);
    return names;
}
