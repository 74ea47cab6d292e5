/*
 * srv_sched.c - the scheduler (srv.h, "The scheduler"): sessions in memory,
 * the continuous-batching loop over their streams, and the saver thread.
 *
 * Moved here from web/web_engine.c (issue 15), which is now the WebSocket
 * and HTTP adapter over it: the steps, the phases and their order are the
 * server's as they were; what is the front end's (requests, events, frames,
 * a document's chunks and text) stayed in web, behind the stream hooks.
 *
 * Locking: `save_lock` guards the saver's queue, `done_lock` the list of
 * saves it hands back. The saver reads a saving stream and its session
 * (sequence, name, base, mode), which nobody changes meanwhile, and writes
 * only the stream's save_* fields; the owner thread does everything else.
 */
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "srv.h"
#include "kds_clock.h"

struct srv_sess {
    bool used;
    char name[SESS_NAME_MAX + 1]; /* store name ("" = none yet) */
    eng_seq *seq;
    uint64_t base; /* head snapshot the sequence equals */
    bool chat;
    bool has_sampler;           /* the session's recorded sampler settings */
    eng_sampler_params sampler; /* (sess_session_info.sampler): what its saves recorded */
    double last_used;
    srv_stream *st; /* the stream running on it */
    double load_ms, prefill_tok_s, decode_tok_s;
    /* The session's whole token sequence, when this server saw every token
     * of it (created here, or empty when loaded, or given by a stream's
     * params): its turns' ends then go into the prefix index too. Every
     * token fed to the sequence is added as it goes in (a prefill slice,
     * a decoded token), so it stays whole whatever stops a turn (a cancel,
     * a client gone); it is whole while its count is the sequence's
     * length. NULL: none. */
    sess_prefix_hasher *hash;
};

struct srv_stream {
    srv_stream *next;
    srv_stream_info i; /* what srv_stream_get shows */
    srv_sess *h;
    int32_t *ids; /* ids[0 .. n) hold given tokens from `off` on (fed ones dropped) */
    int64_t n, cap, off;
    int64_t opener; /* a document's tokens given at the start (not its own) */
    int64_t max_tokens;
    char *prompt;
    size_t prompt_len;
    eng_sampler_params sp;
    srv_reply *rp;
    const srv_stream_hooks *hooks;
    void *user;
    char error[512]; /* reason "error" */
    int32_t feed;    /* token fed in this step, -1 = none */
    int sample_row;  /* this step's row of the batched sample, -1 = none */
    srv_phase after; /* phase after this step's feed */
    /* saving */
    char save_as[SESS_NAME_MAX + 1]; /* "" = the session itself */
    sess_conflict conflict;
    bool index_fork;
    int64_t point_at;
    sess_turn turn;        /* the transcript entry the save writes (set at the end) */
    bool save_turn;        /* a turn (else a resume point) */
    srv_stream *save_next; /* the saver's queue, then the list handed back */
    kds_status save_rc;
    kds_err save_err;
    uint64_t save_snap;               /* the new head (h->base when nothing was saved) */
    char saved_to[SESS_NAME_MAX + 1]; /* save_as: the session it went to (a fork, maybe) */
    double save_ms;
};

struct srv_sched {
    srv_sched_params p;
    const eng_model *m;
    sess_store *st;
    eng_ctx *c;
    int64_t slice;
    bool model_chat;
    srv_sess *hots;
    int n_hot;
    srv_stream *streams; /* in the loop, newest first */
    int n_streams;
    int n_saving; /* handed to the saver and not collected */
    eng_seq **b_seqs;
    int32_t *b_ids;
    srv_stream **b_streams;
    eng_sampler_params *b_params; /* each sampled row's own settings */
    int32_t *b_sampled;
    /* the saver thread */
    pthread_t saver;
    bool saver_started;
    pthread_mutex_t save_lock;
    pthread_cond_t save_wake;
    srv_stream *save_head, *save_tail;
    bool save_stop;
    pthread_mutex_t done_lock;
    srv_stream *saved; /* handed back, newest first (under done_lock) */
};

double srv_now_s(void) { return kds_now_s(); }

static uint64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static void say(srv_sched *S, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(srv_sched *S, const char *fmt, ...) {
    if (!S->p.hooks.log) return;
    char line[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    S->p.hooks.log(S->p.hooks.user, line);
}

static void count_sessions(srv_sched *S) {
    if (S->p.hooks.sessions) S->p.hooks.sessions(S->p.hooks.user, S->n_hot);
}

srv_sched_params srv_sched_default_params(void) {
    srv_sched_params p = {.max_sessions = 64, .max_streams = 32, .ctx = eng_ctx_default_params()};
    p.ctx.max_batch = SRV_PREFILL_SLICE;
    return p;
}

srv_stream_params srv_stream_default_params(void) {
    return (srv_stream_params){.reply = srv_reply_default_params(),
                               .sampler = eng_sampler_default_params(),
                               .conflict = SESS_CONFLICT_FORK};
}

int64_t srv_sched_slice(const srv_sched *S) {
    return S->slice;
}

bool srv_sched_chat_mode(const srv_sched *S, const sess_session_info *info) {
    bool chat;
    (void)sess_session_chat_mode(S->st, info, eng_model_tokenizer(S->m), S->model_chat, &chat,
                                 NULL);
    return chat;
}

/* ------------------------------------------------------------------------ */
/* Sessions in memory                                                        */

srv_sess *srv_sched_find(srv_sched *S, const char *name) {
    for (int i = 0; i < S->p.max_sessions; i++)
        if (S->hots[i].used && !strcmp(S->hots[i].name, name)) return &S->hots[i];
    return NULL;
}

static void hot_clear(srv_sess *h) {
    eng_seq_free(h->seq);
    sess_prefix_hasher_free(h->hash);
    memset(h, 0, sizeof *h);
}

void srv_sched_drop(srv_sched *S, srv_sess *h) {
    hot_clear(h);
    S->n_hot--;
    count_sessions(S);
}

bool srv_sched_has_room(const srv_sched *S) {
    for (int i = 0; i < S->p.max_sessions; i++)
        if (!S->hots[i].used || !S->hots[i].st) return true;
    return false;
}

/* A free slot, evicting the least recently used idle session (it is saved
 * already). NULL when every slot runs a turn. */
static srv_sess *free_slot(srv_sched *S) {
    srv_sess *lru = NULL;
    for (int i = 0; i < S->p.max_sessions; i++) {
        srv_sess *h = &S->hots[i];
        if (!h->used) return h;
        if (!h->st && (!lru || h->last_used < lru->last_used)) lru = h;
    }
    if (lru) srv_sched_drop(S, lru);
    return lru;
}

/* Slot h (free) becomes session `seq` at snapshot `base`. */
static void hot_fill(srv_sched *S, srv_sess *h, const char *name, eng_seq *seq, uint64_t base) {
    memset(h, 0, sizeof *h);
    h->used = true;
    snprintf(h->name, sizeof h->name, "%s", name ? name : "");
    h->seq = seq;
    h->base = base;
    h->last_used = srv_now_s();
    S->n_hot++;
    count_sessions(S);
}

static kds_status no_room(srv_sched *S, kds_err *err) {
    return kds_err_set(err, KDS_BUSY, "all %d sessions in memory run a turn", S->p.max_sessions);
}

kds_status srv_sched_open(srv_sched *S, const sess_session_info *info, const char *scope,
                          srv_sess **out, kds_err *err) {
    *out = srv_sched_find(S, info->name);
    if (*out) {
        (*out)->last_used = srv_now_s();
        return KDS_OK;
    }
    srv_sess *h = free_slot(S);
    if (!h) return no_room(S, err);
    eng_seq *seq = NULL;
    kds_status rc = eng_seq_create(S->m, 0, &seq, err);
    if (rc != KDS_OK) return rc;
    double t0 = srv_now_s();
    if ((rc = sess_load(S->st, info->head, S->m, seq, NULL, err)) != KDS_OK) {
        eng_seq_free(seq);
        return rc;
    }
    double ms = (srv_now_s() - t0) * 1e3;
    if (S->p.hooks.loaded) S->p.hooks.loaded(S->p.hooks.user, ms);
    hot_fill(S, h, info->name, seq, info->head);
    h->chat = srv_sched_chat_mode(S, info);
    h->has_sampler = info->has_sampler;
    h->sampler = info->sampler;
    h->load_ms = ms;
    /* every token to come passes through here */
    if (eng_seq_pos(seq) == 0 && scope &&
        sess_prefix_hasher_create(scope, &h->hash, NULL) != KDS_OK)
        h->hash = NULL;
    *out = h;
    return KDS_OK;
}

kds_status srv_sched_open_state(srv_sched *S, uint64_t snapshot, int64_t tokens, srv_sess **out,
                                kds_err *err) {
    *out = NULL;
    srv_sess *h = free_slot(S);
    if (!h) return no_room(S, err);
    eng_seq *seq = NULL;
    double t0 = srv_now_s();
    kds_status rc = eng_seq_create(S->m, now_us(), &seq, err);
    if (rc != KDS_OK) return rc;
    double ms = 0;
    if (snapshot) {
        if ((rc = sess_load(S->st, snapshot, S->m, seq, NULL, err)) != KDS_OK) goto fail;
        if (eng_seq_pos(seq) != tokens) {
            rc = kds_err_set(err, KDS_MISMATCH,
                             "snapshot @%" PRIu64 " holds %" PRId64 " tokens, not %" PRId64,
                             snapshot, eng_seq_pos(seq), tokens);
            goto fail;
        }
        ms = (srv_now_s() - t0) * 1e3;
        if (S->p.hooks.loaded) S->p.hooks.loaded(S->p.hooks.user, ms);
    }
    hot_fill(S, h, NULL, seq, snapshot);
    h->load_ms = ms;
    *out = h;
    return KDS_OK;
fail:
    eng_seq_free(seq);
    return rc;
}

/* The owner thread or the saver: put `key` into the prefix index
 * (advisory: a turn that is not indexed is replayed next time, no more). */
static void index_key(srv_sched *S, const unsigned char key[SESS_PREFIX_KEY_LEN], uint64_t snap,
                      int64_t tokens, const char *session, bool fork) {
    sess_prefix_entry pe = {.snapshot = snap, .tokens = tokens, .fork = fork};
    snprintf(pe.session, sizeof pe.session, "%s", session);
    kds_err e = {0};
    if (sess_prefix_put(S->st, key, &pe, &e) != KDS_OK)
        say(S, "indexing turn @%" PRIu64 ": %s", snap, e.msg);
}

kds_status srv_sched_new(srv_sched *S, const char *name, bool chat, const int32_t *ids, int64_t n,
                         const sess_turn *turn, const char *scope, srv_sess **out,
                         uint64_t *snapshot, kds_err *err) {
    *out = NULL;
    srv_sess *h = free_slot(S);
    if (!h) return no_room(S, err);
    eng_seq *seq = NULL;
    uint64_t snap = 0;
    kds_status rc = eng_seq_create(S->m, now_us(), &seq, err);
    if (rc != KDS_OK) return rc;
    if (n > 0) {
        if ((rc = eng_prefill(S->c, seq, ids, n, NULL, NULL, NULL, err)) != KDS_OK) goto fail;
        if (S->p.hooks.prefilled) S->p.hooks.prefilled(S->p.hooks.user, n);
    }
    double t0 = srv_now_s();
    if ((rc = sess_save(S->st, name, 0, S->m, seq, turn, &snap, err)) != KDS_OK) {
        if (rc == KDS_BUSY) /* another process made it meanwhile */
            rc = err ? (err->status = KDS_EXISTS) : KDS_EXISTS;
        goto fail;
    }
    if (S->p.hooks.saved) S->p.hooks.saved(S->p.hooks.user, (srv_now_s() - t0) * 1e3);
    hot_fill(S, h, name, seq, snap);
    h->chat = chat;
    /* every token of the new session is known: its sequence is hashed from
     * here on, and a system text's end is indexed */
    if (scope && sess_prefix_hasher_create(scope, &h->hash, NULL) == KDS_OK) {
        sess_prefix_hasher_add(h->hash, ids, n);
        if (n > 0) {
            unsigned char key[SESS_PREFIX_KEY_LEN];
            sess_prefix_hasher_key(h->hash, key);
            index_key(S, key, snap, n, name, true);
        }
    }
    *out = h;
    if (snapshot) *snapshot = snap;
    return KDS_OK;
fail:
    eng_seq_free(seq);
    return rc;
}

void srv_sess_get(const srv_sess *h, srv_sess_info *out) {
    *out = (srv_sess_info){.name = h->name,
                           .base = h->base,
                           .tokens = eng_seq_pos(h->seq),
                           .state_bytes = eng_seq_state_bytes(h->seq),
                           .chat = h->chat,
                           .has_sampler = h->has_sampler,
                           .sampler = h->sampler,
                           .load_ms = h->load_ms,
                           .prefill_tok_s = h->prefill_tok_s,
                           .decode_tok_s = h->decode_tok_s};
}

const char *srv_sess_name(const srv_sess *h) {
    return h->name;
}
srv_stream *srv_sess_stream(const srv_sess *h) {
    return h->st;
}
void srv_sess_touch(srv_sess *h) {
    h->last_used = srv_now_s();
}

void srv_sess_rename(srv_sess *h, const char *name) {
    snprintf(h->name, sizeof h->name, "%s", name);
}

/* Whether h's hasher holds exactly its sequence. */
static bool hash_whole(const srv_sess *h) {
    return h->hash && sess_prefix_hasher_count(h->hash) == eng_seq_pos(h->seq);
}

bool srv_sess_hashed(const srv_sess *h) {
    return hash_whole(h);
}

/* ------------------------------------------------------------------------ */
/* Streams                                                                   */

static void stream_free(srv_stream *g) {
    if (!g) return;
    free(g->ids);
    free(g->prompt);
    srv_reply_free(g->rp);
    free(g);
}

/* Room for `more` ids after the unfed ones (the fed ones are dropped first). */
static kds_status ids_reserve(srv_stream *g, int64_t more, kds_err *err) {
    int64_t unfed = g->off + g->n - g->i.fed;
    if (g->i.fed > g->off) {
        memmove(g->ids, g->ids + (g->i.fed - g->off), (size_t)unfed * sizeof *g->ids);
        g->off = g->i.fed;
        g->n = unfed;
    }
    if (g->n + more <= g->cap) return KDS_OK;
    int64_t cap = g->cap ? g->cap : 4096;
    while (cap < g->n + more)
        cap *= 2;
    int32_t *p = realloc(g->ids, (size_t)cap * sizeof *p);
    if (!p) return kds_err_set(err, KDS_NOMEM, "out of memory");
    g->ids = p;
    g->cap = cap;
    return KDS_OK;
}

kds_status srv_stream_start(srv_sched *S, srv_sess *h, const srv_stream_params *p, srv_stream **out,
                            kds_err *err) {
    *out = NULL;
    kds_status rc;
    srv_stream *g = NULL;
    sess_prefix_hasher *hasher = p->hasher;
    bool doc = p->kind == SRV_STREAM_DOCUMENT;
    if (h->st) {
        rc = kds_err_set(err, KDS_BUSY, "session '%s' runs a turn", h->name);
        goto fail;
    }
    if (S->n_streams >= S->p.max_streams) {
        rc = kds_err_set(err, KDS_BUSY, "%d streams run (the most at once)", S->n_streams);
        goto fail;
    }
    if (!p->hooks || !p->hooks->done) {
        rc = kds_err_set(err, KDS_INVALID_ARG, "a stream needs its done hook");
        goto fail;
    }
    if (!doc && p->n_ids == 0 && eng_seq_pos(h->seq) == 0) {
        rc = kds_err_set(err, KDS_INVALID_ARG,
                         "nothing to continue from: the context and the prompt are empty");
        goto fail;
    }
    if (!(g = calloc(1, sizeof *g))) goto nomem;
    srv_reply_params rp = p->reply;
    if (doc) rp.max_tokens = 0;
    if ((rc = srv_reply_create(eng_model_tokenizer(S->m), &rp, &g->rp, err)) != KDS_OK) goto fail;
    if (p->n_ids > 0) {
        if (!(g->ids = malloc((size_t)p->n_ids * sizeof *g->ids))) goto nomem;
        memcpy(g->ids, p->ids, (size_t)p->n_ids * sizeof *g->ids);
        g->n = g->cap = p->n_ids;
    }
    if (p->prompt && p->prompt_len) {
        if (!(g->prompt = malloc(p->prompt_len + 1))) goto nomem;
        memcpy(g->prompt, p->prompt, p->prompt_len);
        g->prompt[p->prompt_len] = '\0';
        g->prompt_len = p->prompt_len;
    }
    g->h = h;
    g->opener = doc ? (p->opener < p->n_ids ? p->opener : p->n_ids) : 0;
    g->max_tokens = rp.max_tokens;
    g->sp = p->sampler;
    g->hooks = p->hooks;
    g->user = p->user;
    g->feed = -1;
    g->sample_row = -1;
    snprintf(g->save_as, sizeof g->save_as, "%s", p->save_as ? p->save_as : "");
    g->conflict = p->conflict;
    g->index_fork = p->index_fork;
    g->point_at = p->point_at;
    srv_stream_info *i = &g->i;
    i->kind = p->kind;
    i->sess = h;
    i->last = !doc;
    i->context0 = eng_seq_pos(h->seq);
    i->given = p->n_ids;
    i->t_start = p->t_start > 0 ? p->t_start : srv_now_s();
    if (doc)
        i->phase = i->given > 0 ? SRV_PHASE_PREFILL : SRV_PHASE_WAIT;
    else if (p->n_ids > 0)
        i->phase = SRV_PHASE_PREFILL;
    else if (p->reply.max_tokens > 0)
        i->phase = SRV_PHASE_DECODE;
    else {
        i->phase = SRV_PHASE_FINISH;
        i->reason = "length";
    }
    /* the session takes the turn's mode and seed, and the hasher given */
    if (hasher) {
        sess_prefix_hasher_free(h->hash);
        h->hash = hasher;
        hasher = NULL;
    }
    h->chat = p->reply.chat;
    if (p->reseed) eng_seq_reseed(h->seq, p->seed);
    h->st = g;
    h->last_used = srv_now_s();
    g->next = S->streams;
    S->streams = g;
    S->n_streams++;
    *out = g;
    return KDS_OK;
nomem:
    rc = kds_err_set(err, KDS_NOMEM, "out of memory");
fail:
    sess_prefix_hasher_free(hasher); /* the session keeps its own */
    stream_free(g);
    return rc;
}

kds_status srv_stream_append(srv_stream *g, const int32_t *ids, int64_t n, bool last,
                             kds_err *err) {
    if (g->i.kind != SRV_STREAM_DOCUMENT || g->i.last)
        return kds_err_set(err, KDS_INVALID_ARG, "not a document taking tokens");
    if (n > 0) {
        kds_status rc = ids_reserve(g, n, err);
        if (rc != KDS_OK) return rc;
        memcpy(g->ids + g->n, ids, (size_t)n * sizeof *ids);
        g->n += n;
        g->i.given += n;
    }
    if (last) g->i.last = true;
    if (g->i.phase == SRV_PHASE_WAIT) g->i.phase = SRV_PHASE_PREFILL;
    return KDS_OK;
}

void srv_stream_point(srv_stream *g, int64_t at) {
    g->point_at = at;
}

const int32_t *srv_stream_unfed(const srv_stream *g, int64_t *n) {
    int64_t from = g->i.fed > g->opener ? g->i.fed : g->opener;
    if (from > g->i.given) from = g->i.given;
    *n = g->i.given - from;
    return g->ids ? g->ids + (from - g->off) : NULL;
}

void srv_stream_cancel(srv_stream *g, srv_cancel why) {
    if (why == SRV_CANCEL_GONE)
        g->i.gone = true;
    else
        g->i.cancelled = true;
}

const srv_stream_info *srv_stream_get(const srv_stream *g) {
    return &g->i;
}
void *srv_stream_user(const srv_stream *g) {
    return g->user;
}

const char *srv_stream_reply(const srv_stream *g, size_t *len) {
    return srv_reply_text(g->rp, len);
}

int srv_sched_running(const srv_sched *S) {
    return S->n_streams;
}
int srv_sched_saving(const srv_sched *S) {
    return S->n_saving;
}

srv_stream *srv_sched_next(srv_sched *S, srv_stream *prev) {
    return prev ? prev->next : S->streams;
}

/* ------------------------------------------------------------------------ */
/* The saver                                                                 */

/* Saver thread: g's state into its session, continuing h->base, with
 * `turn` (NULL: a resume point, no transcript entry): in place, or to
 * save_as (a fork of it when it moved on, or always one with
 * SESS_CONFLICT_FORK_ALWAYS); saved_to then names where it went. */
static void save_state(srv_sched *S, srv_stream *g, const sess_turn *turn) {
    srv_sess *h = g->h;
    if (!g->save_as[0]) {
        g->save_rc =
            sess_save(S->st, h->name, h->base, S->m, h->seq, turn, &g->save_snap, &g->save_err);
        return;
    }
    sess_save_result res;
    g->save_rc = sess_save_ex(S->st, g->save_as, h->base, S->m, h->seq, turn, g->conflict, &res,
                              &g->save_err);
    if (g->save_rc != KDS_OK) return;
    g->save_snap = res.snapshot;
    snprintf(g->saved_to, sizeof g->saved_to, "%s", res.session);
}

/* Saver thread: the state just saved (a turn's end, a resume point) in the
 * prefix index, when the session's hasher holds every token of it. The loop
 * leaves the hasher alone meanwhile: the stream is out of it or paused. */
static void index_saved(srv_sched *S, srv_stream *g, const char *session) {
    if (!hash_whole(g->h)) return;
    unsigned char key[SESS_PREFIX_KEY_LEN];
    sess_prefix_hasher_key(g->h->hash, key);
    index_key(S, key, g->save_snap, eng_seq_pos(g->h->seq), session, g->index_fork);
}

/* Saver thread: one turn's durable save, or a resume point's. */
static void save_one(srv_sched *S, srv_stream *g) {
    double t0 = srv_now_s();
    save_state(S, g, g->save_turn ? &g->turn : NULL);
    if (g->save_rc == KDS_OK) index_saved(S, g, g->save_as[0] ? g->saved_to : g->h->name);
    g->save_ms = (srv_now_s() - t0) * 1e3;
}

static void *saver_main(void *arg) {
    srv_sched *S = arg;
    pthread_mutex_lock(&S->save_lock);
    for (;;) {
        while (!S->save_head && !S->save_stop)
            pthread_cond_wait(&S->save_wake, &S->save_lock);
        srv_stream *g = S->save_head;
        if (!g) break; /* stopping, and nothing is left to save */
        S->save_head = g->save_next;
        if (!S->save_head) S->save_tail = NULL;
        pthread_mutex_unlock(&S->save_lock);
        save_one(S, g);
        pthread_mutex_lock(&S->done_lock);
        g->save_next = S->saved;
        S->saved = g;
        pthread_mutex_unlock(&S->done_lock);
        if (S->p.hooks.wake) S->p.hooks.wake(S->p.hooks.user);
        pthread_mutex_lock(&S->save_lock);
    }
    pthread_mutex_unlock(&S->save_lock);
    return NULL;
}

static void save_enqueue(srv_sched *S, srv_stream *g, srv_phase phase) {
    g->i.phase = phase;
    g->save_next = NULL;
    S->n_saving++;
    pthread_mutex_lock(&S->save_lock);
    if (S->save_tail)
        S->save_tail->save_next = g;
    else
        S->save_head = g;
    S->save_tail = g;
    pthread_cond_signal(&S->save_wake);
    pthread_mutex_unlock(&S->save_lock);
}

/* A turn is over, saved or not: the session is free again and the front end
 * is told. A failed save leaves memory ahead of the store: the session is
 * forgotten, the next use reloads what is stored (so is an engine error's
 * sequence, which is not trusted, and a session that has no name: its
 * sequence belongs to no stored session). */
static void turn_done(srv_sched *S, srv_stream *g) {
    srv_sess *h = g->h;
    bool failed = !strcmp(g->i.reason, "error");
    if (g->i.phase == SRV_PHASE_SAVE) {
        S->n_saving--;
        if (g->save_rc == KDS_OK) {
            if (S->p.hooks.saved) S->p.hooks.saved(S->p.hooks.user, g->save_ms);
            h->base = g->save_snap;
            if (g->saved_to[0]) snprintf(h->name, sizeof h->name, "%s", g->saved_to);
            if (g->save_turn && g->turn.sampler) {
                /* what the store now records for the session (a save keeps
                 * the settings last declared): memory follows, so a turn
                 * that takes the recorded settings samples alike whether
                 * the session stays here or is loaded again */
                h->has_sampler = true;
                h->sampler = *g->turn.sampler;
            }
        }
    }
    h->st = NULL;
    srv_stream_end end = {.reason = g->i.reason,
                          .error = g->error,
                          .save_rc = g->save_rc,
                          .save_err = &g->save_err,
                          .snapshot = g->save_snap};
    g->hooks->done(g->user, g, &end);
    if (g->save_rc != KDS_OK || failed || !h->name[0]) srv_sched_drop(S, h);
    stream_free(g);
}

/* A stream reached its resume point: it pauses (skipped by the loop) while
 * the saver saves it, then goes on (point_done). Advisory: when the state
 * cannot be handed over, it goes on without one. */
static void point_begin(srv_sched *S, srv_stream *g) {
    g->point_at = 0; /* once */
    kds_err e = {0};
    if (eng_ctx_release(S->c, g->h->seq, &e) != KDS_OK) return;
    g->save_turn = false;
    g->save_rc = KDS_OK;
    save_enqueue(S, g, SRV_PHASE_PAUSE);
}

static void point_done(srv_sched *S, srv_stream *g) {
    srv_sess *h = g->h;
    S->n_saving--;
    if (g->save_rc == KDS_OK) {
        if (S->p.hooks.saved) S->p.hooks.saved(S->p.hooks.user, g->save_ms);
        h->base = g->save_snap;
        if (g->saved_to[0]) { /* the turn's own save goes there too */
            snprintf(h->name, sizeof h->name, "%s", g->saved_to);
            snprintf(g->save_as, sizeof g->save_as, "%s", g->saved_to);
            g->saved_to[0] = '\0';
            if (g->conflict == SESS_CONFLICT_FORK_ALWAYS)
                g->conflict = SESS_CONFLICT_FORK; /* the branch is the turn's own now */
        }
    } else {
        say(S, "resume point of '%s' not saved (the turn goes on): %s", h->name, g->save_err.msg);
    }
    g->save_rc = KDS_OK;
    kds_err_clear(&g->save_err);
    g->i.phase = SRV_PHASE_PREFILL;
}

void srv_sched_collect(srv_sched *S) {
    pthread_mutex_lock(&S->done_lock);
    srv_stream *list = S->saved;
    S->saved = NULL;
    pthread_mutex_unlock(&S->done_lock);
    /* answered in the order they were saved */
    srv_stream *fifo = NULL;
    while (list) {
        srv_stream *g = list;
        list = g->save_next;
        g->save_next = fifo;
        fifo = g;
    }
    while (fifo) {
        srv_stream *g = fifo;
        fifo = g->save_next;
        if (g->i.phase == SRV_PHASE_PAUSE)
            point_done(S, g);
        else
            turn_done(S, g);
    }
}

bool srv_sched_collectable(srv_sched *S) {
    pthread_mutex_lock(&S->done_lock);
    bool any = S->saved != NULL;
    pthread_mutex_unlock(&S->done_lock);
    return any;
}

/* ------------------------------------------------------------------------ */
/* The loop                                                                  */

static void stream_error(srv_stream *g, const kds_err *e) {
    snprintf(g->error, sizeof g->error, "%s", e->msg);
    g->i.reason = "error";
    g->i.phase = SRV_PHASE_FINISH;
}

static void emit(srv_stream *g, const char *p, size_t n) {
    if (n && g->hooks->text) g->hooks->text(g->user, g, p, n);
}

/* The owner thread's half of a turn that ended: send what the reply held
 * back, note the session's rates, and fill the transcript entry. */
static void turn_close(srv_stream *g) {
    srv_sess *h = g->h;
    srv_stream_info *i = &g->i;
    const char *mode = h->chat ? "chat" : "plain";
    if (i->kind == SRV_STREAM_DOCUMENT) {
        double prefill_s = (i->t_prefill_end ? i->t_prefill_end : i->t_end) - i->t_start;
        h->prefill_tok_s = prefill_s > 0 ? (double)i->doc_fed / prefill_s : 0.0;
        g->turn =
            (sess_turn){.prompt = "", .output = "", .prompt_tokens = i->doc_fed, .mode = mode};
        return;
    }
    size_t len;
    const char *rest = srv_reply_finish(g->rp, &len); /* what was held back */
    if (strcmp(i->reason, "error")) emit(g, rest, len);
    double decode_s = i->t_decode0 ? i->t_end - i->t_decode0 : 0.0;
    double prefill_s = i->t_prefill_end ? i->t_prefill_end - i->t_start : 0.0;
    h->prefill_tok_s = prefill_s > 0 ? (double)i->fed / prefill_s : 0.0;
    h->decode_tok_s = decode_s > 0 ? (double)i->produced / decode_s : 0.0;
    size_t reply_len;
    const char *reply = srv_reply_text(g->rp, &reply_len);
    g->turn = (sess_turn){.prompt = g->prompt ? g->prompt : "",
                          .prompt_len = g->prompt_len,
                          .output = reply,
                          .output_len = reply_len,
                          .prompt_tokens = i->fed,
                          .output_tokens = i->produced,
                          .mode = mode,
                          .sampler = &g->sp};
}

/* A stream that ended leaves the loop: saved by the saver thread when its
 * context moved (the loop goes on with the others), answered at once
 * otherwise. */
static void turn_end(srv_sched *S, srv_stream *g) {
    srv_sess *h = g->h;
    g->i.t_end = srv_now_s();
    h->last_used = g->i.t_end;
    turn_close(g);
    g->save_rc = KDS_OK;
    g->save_snap = h->base;
    if (!strcmp(g->i.reason, "error") || eng_seq_pos(h->seq) == g->i.context0) {
        turn_done(S, g);
        return;
    }
    if (g->hooks->ended &&
        (g->save_rc = g->hooks->ended(g->user, g, &g->turn, &g->save_err)) != KDS_OK) {
        turn_done(S, g);
        return;
    }
    /* no context touches the sequence while the saver reads it */
    if ((g->save_rc = eng_ctx_release(S->c, h->seq, &g->save_err)) != KDS_OK) {
        turn_done(S, g);
        return;
    }
    g->save_turn = true;
    save_enqueue(S, g, SRV_PHASE_SAVE);
}

static void remove_finished(srv_sched *S) {
    for (srv_stream **pp = &S->streams; *pp;) {
        srv_stream *g = *pp;
        if (g->i.phase == SRV_PHASE_FINISH) {
            *pp = g->next;
            S->n_streams--;
            turn_end(S, g);
        } else {
            pp = &g->next;
        }
    }
}

/* One prefill slice of g. A document's slices are aligned on its start as a
 * reply's prompt slices are, so its state equals that of its whole text fed
 * as one prompt; it waits for more while it has less than a slice, until
 * its last tokens came. */
static void prefill_one(srv_sched *S, srv_stream *g) {
    srv_stream_info *i = &g->i;
    bool doc = i->kind == SRV_STREAM_DOCUMENT;
    if (i->cancelled || i->gone) {
        /* stop before feeding the rest: a chat turn begun is closed */
        i->reason = i->gone ? "disconnected" : "cancelled";
        i->phase =
            i->fed > 0 ? SRV_PHASE_CLOSE : SRV_PHASE_FINISH; /* nothing fed: nothing to close */
        return;
    }
    if (g->point_at && i->fed == g->point_at) {
        point_begin(S, g);
        return;
    }
    int64_t avail = i->given - i->fed;
    if (doc && avail == 0 && i->last) {
        i->reason = "complete";
        i->t_prefill_end = srv_now_s();
        i->phase = i->fed > 0 ? SRV_PHASE_CLOSE : SRV_PHASE_FINISH;
        return;
    }
    if (doc && (avail == 0 || (avail < S->slice && !i->last))) {
        i->phase = SRV_PHASE_WAIT;
        return;
    }
    int64_t n = avail < S->slice ? avail : S->slice;
    const int32_t *ids = g->ids + (i->fed - g->off);
    kds_err e = {0};
    if (eng_prefill(S->c, g->h->seq, ids, n, NULL, NULL, NULL, &e) != KDS_OK) {
        stream_error(g, &e);
        return;
    }
    if (g->h->hash) sess_prefix_hasher_add(g->h->hash, ids, n); /* what went in, as it did */
    if (doc && i->fed + n > g->opener) /* the document's own tokens in this slice */
        i->doc_fed += i->fed + n - (i->fed > g->opener ? i->fed : g->opener);
    i->fed += n;
    if (!doc && i->fed == i->given) {
        i->t_prefill_end = srv_now_s();
        i->phase = g->max_tokens > 0 ? SRV_PHASE_DECODE : SRV_PHASE_CLOSE;
        if (g->max_tokens == 0) i->reason = "length";
    }
    if (S->p.hooks.prefilled) S->p.hooks.prefilled(S->p.hooks.user, n);
    if (g->hooks->fed) g->hooks->fed(g->user, g, n);
}

/* One prefill slice for every stream still feeding its tokens. */
static void prefill_step(srv_sched *S) {
    for (srv_stream *g = S->streams; g; g = g->next) {
        srv_phase ph = g->i.phase;
        if (ph == SRV_PHASE_PREFILL || (ph == SRV_PHASE_WAIT && g->i.kind == SRV_STREAM_DOCUMENT))
            prefill_one(S, g);
    }
}

static srv_reader reader_of(srv_stream *g) {
    return g->hooks->reader ? g->hooks->reader(g->user, g) : SRV_READER_OK;
}

/* One batched decode step over every decoding stream whose reader keeps
 * up: their next tokens sampled in one call, each with its own settings
 * (eng_sample_batch: one device launch on a GPU), then fed in one forward
 * pass. */
static void decode_step(srv_sched *S) {
    int ns = 0, max = S->p.max_streams;
    for (srv_stream *g = S->streams; g; g = g->next) {
        srv_stream_info *i = &g->i;
        g->feed = -1;
        g->sample_row = -1;
        if (i->phase == SRV_PHASE_DECODE && (i->cancelled || i->gone)) {
            i->reason = i->gone ? "disconnected" : "cancelled";
            i->phase = SRV_PHASE_CLOSE;
        }
        if (i->phase != SRV_PHASE_DECODE) continue;
        if (!i->gone) {
            srv_reader rd = reader_of(g);
            if (rd == SRV_READER_BEHIND) continue;
            if (rd == SRV_READER_GONE) i->gone = true; /* this step still decodes */
        }
        if (ns >= max) continue;
        S->b_seqs[ns] = g->h->seq;
        S->b_params[ns] = g->sp;
        g->sample_row = ns++;
    }
    kds_err se = {0};
    kds_status src = eng_sample_batch(S->c, S->b_seqs, ns, S->b_params, S->b_sampled, &se);
    int n = 0;
    for (srv_stream *g = S->streams; g; g = g->next) {
        srv_stream_info *i = &g->i;
        if (i->phase == SRV_PHASE_CLOSE) {
            /* a chat reply cut short is closed with <|im_end|> */
            int32_t close = srv_reply_close_token(g->rp);
            if (close >= 0) {
                g->feed = close;
                g->after = SRV_PHASE_FINISH;
            } else {
                i->phase = SRV_PHASE_FINISH;
            }
        } else if (g->sample_row >= 0) {
            if (src != KDS_OK) {
                stream_error(g, &se);
                continue;
            }
            if (!i->t_decode0) i->t_decode0 = srv_now_s();
            srv_step st;
            kds_err e = {0};
            if (srv_reply_token(g->rp, S->b_sampled[g->sample_row], &st, &e) != KDS_OK) {
                stream_error(g, &e);
                continue;
            }
            i->produced = srv_reply_produced(g->rp);
            emit(g, st.text, st.len);
            g->feed = st.feed;
            if (st.reason) i->reason = st.reason;
            g->after = st.after == SRV_DECODE  ? SRV_PHASE_DECODE
                       : st.after == SRV_CLOSE ? SRV_PHASE_CLOSE
                                               : SRV_PHASE_FINISH;
        }
        if (g->feed >= 0 && n < max) {
            S->b_seqs[n] = g->h->seq;
            S->b_ids[n] = g->feed;
            S->b_streams[n] = g;
            n++;
        }
    }
    if (n == 0) return;
    kds_err e = {0};
    kds_status rc = eng_decode_batch(S->c, S->b_seqs, S->b_ids, n, &e);
    for (int k = 0; k < n; k++) {
        srv_stream *g = S->b_streams[k];
        if (rc != KDS_OK) {
            stream_error(g, &e);
        } else {
            g->i.phase = g->after;
            if (g->h->hash) sess_prefix_hasher_add(g->h->hash, &S->b_ids[k], 1);
        }
    }
    if (S->p.hooks.decoded) S->p.hooks.decoded(S->p.hooks.user, n);
}

void srv_sched_step(srv_sched *S) {
    prefill_step(S);
    decode_step(S);
    remove_finished(S);
}

bool srv_sched_runnable(srv_sched *S) {
    for (srv_stream *g = S->streams; g; g = g->next) {
        if (g->i.cancelled || g->i.gone) return true;
        /* a document waiting for its next tokens, a stream paused at its resume point */
        if (g->i.phase == SRV_PHASE_WAIT || g->i.phase == SRV_PHASE_PAUSE) continue;
        if (g->i.phase != SRV_PHASE_DECODE) return true;
    }
    /* only decoding streams: runnable unless every reader is behind */
    for (srv_stream *g = S->streams; g; g = g->next)
        if (g->i.phase == SRV_PHASE_DECODE && reader_of(g) != SRV_READER_BEHIND) return true;
    return false;
}

/* ------------------------------------------------------------------------ */
/* Create and free                                                           */

/* The saver thread ends once its queue is empty. */
static void saver_stop(srv_sched *S) {
    if (!S->saver_started) return;
    pthread_mutex_lock(&S->save_lock);
    S->save_stop = true;
    pthread_cond_signal(&S->save_wake);
    pthread_mutex_unlock(&S->save_lock);
    pthread_join(S->saver, NULL);
    S->saver_started = false;
}

kds_status srv_sched_create(const srv_sched_params *p, const eng_model *m, sess_store *st,
                            srv_sched **out, kds_err *err) {
    *out = NULL;
    if (p->max_sessions < 1 || p->max_streams < 1)
        return kds_err_set(err, KDS_INVALID_ARG, "max_sessions and max_streams must be >= 1");
    srv_sched *S = calloc(1, sizeof *S);
    if (!S) return kds_err_set(err, KDS_NOMEM, "out of memory");
    S->p = *p;
    S->m = m;
    S->st = st;
    S->model_chat = eng_model_chat_format(m);
    S->slice = p->ctx.max_batch > 0 ? p->ctx.max_batch : SRV_PREFILL_SLICE;
    pthread_mutex_init(&S->save_lock, NULL);
    pthread_cond_init(&S->save_wake, NULL);
    pthread_mutex_init(&S->done_lock, NULL);
    eng_ctx_params cp = p->ctx;
    cp.max_batch = (int)S->slice; /* scratch for a slice, not the engine's default step */
    if (cp.max_seqs < p->max_streams) cp.max_seqs = p->max_streams;
    kds_status rc = eng_ctx_create(m, &cp, &S->c, err);
    if (rc != KDS_OK) goto fail;
    size_t ns = (size_t)p->max_streams;
    S->hots = calloc((size_t)p->max_sessions, sizeof *S->hots);
    S->b_seqs = calloc(ns, sizeof *S->b_seqs);
    S->b_ids = calloc(ns, sizeof *S->b_ids);
    S->b_streams = calloc(ns, sizeof *S->b_streams);
    S->b_params = calloc(ns, sizeof *S->b_params);
    S->b_sampled = calloc(ns, sizeof *S->b_sampled);
    if (!S->hots || !S->b_seqs || !S->b_ids || !S->b_streams || !S->b_params || !S->b_sampled) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory");
        goto fail;
    }
    /* the saver takes no signals (the caller handles them) */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int prc = pthread_create(&S->saver, NULL, saver_main, S);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (prc != 0) {
        rc = kds_err_set(err, KDS_INTERNAL, "cannot start the saver thread: %s", strerror(prc));
        goto fail;
    }
    S->saver_started = true;
    *out = S;
    return KDS_OK;
fail:
    srv_sched_free(S);
    return rc;
}

void srv_sched_free(srv_sched *S) {
    if (!S) return;
    saver_stop(S);
    /* nothing is left in a scheduler stopped as srv.h says; free what is */
    while (S->saved) {
        srv_stream *g = S->saved;
        S->saved = g->save_next;
        stream_free(g);
    }
    while (S->streams) {
        srv_stream *g = S->streams;
        S->streams = g->next;
        stream_free(g);
    }
    for (int i = 0; S->hots && i < S->p.max_sessions; i++)
        if (S->hots[i].used) hot_clear(&S->hots[i]);
    eng_ctx_free(S->c);
    free(S->hots);
    free(S->b_seqs);
    free(S->b_ids);
    free(S->b_streams);
    free(S->b_params);
    free(S->b_sampled);
    pthread_mutex_destroy(&S->save_lock);
    pthread_cond_destroy(&S->save_wake);
    pthread_mutex_destroy(&S->done_lock);
    free(S);
}
