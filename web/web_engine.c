/*
 * web_engine.c - the engine thread: the WebSocket and HTTP requests, over
 * the serving core's scheduler (core/srv.h, "The scheduler"), which holds
 * the sessions in memory, runs the continuous-batching loop and saves
 * finished turns on its saver thread.
 *
 * Every turn of the loop:
 *   1. answer the turns the saver has saved (srv_sched_collect: `done`, the
 *      HTTP response), first, so that their sessions are free for what
 *      comes;
 *   2. take every queued request into its connection's queue, and answer
 *      them in rounds of one request per connection (store operations run
 *      here, so the store and the sessions in memory have one owner); a
 *      connection with many requests waiting delays the others by one of
 *      its requests per round, not by all of them. Rounds go on while
 *      requests wait, for at most REQUEST_BUDGET_S of the turn, so that
 *      generations still advance every few milliseconds. A connection that
 *      closed has its waiting requests dropped unanswered;
 *   3. one step of the scheduler (srv_sched_step): a prefill slice for every
 *      turn feeding its prompt, one batched decode step for every turn
 *      whose connection is not behind on reading (backpressure is per
 *      connection: the stream's `reader` hook), and the turns that ended
 *      handed to the saver.
 *
 * What stays here is the front end's: requests checked and rendered to
 * tokens (`generate`, the OpenAI endpoints), events and HTTP responses made
 * from the scheduler's hooks (text, progress, done), tenants, the HTTP
 * resume (which stored prefix a stateless client continues), and the
 * bookkeeping of a document streamed in by `append` (chunks, UTF-8 carry,
 * the text tokenized with its last pre-tokens held back, spooled to a
 * temporary file for the transcript, progress and flow control): the
 * scheduler sees a document stream that takes tokens as they come.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <sys/mman.h>
#include <unistd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "eng_config.h"
#include "web_internal.h"
#include "kds_clock.h"

#define LAST_TURNS 4
#define LINEAGE_MAX 100000
/* Time a turn of the engine loop spends answering requests before it
 * advances the generations again (a request that has started finishes). */
#define REQUEST_BUDGET_S 0.005

/* Tokens of an ingest waiting to be prefilled above which its next chunk
 * waits in the connection's queue (the client's flow control: the answer to
 * a chunk is sent when it is taken). */
#define INGEST_BACKLOG 8192
/* Text held back untokenized: the last two pre-tokens, which more text may
 * still change; over this size a cut is made anyway (bounded memory). */
#define INGEST_HOLD_MAX (4u << 20)
/* Text below this size waits for more before it is split into pre-tokens. */
#define INGEST_MIN_SPLIT 65536
/* progress events of one ingest: at most one per this many seconds */
#define INGEST_PROGRESS_S 0.25
/* A plain document of at least this many tokens also leaves a resume point:
 * the state at the last prefill slice boundary before its last two
 * pre-tokens (which text after the document may change), saved and indexed,
 * so a stateless client whose prompt is the document plus a question
 * resumes there (prefilling < max_batch tokens of the document's end and
 * the question) instead of replaying it. */
#define RESUME_POINT_MIN 4096

/* An ingest (op `append`, docs/protocol.md): a document streamed in chunks
 * into one session, tokenized as it comes (the last pre-tokens held back,
 * so the tokens are those of the whole text) and handed to the scheduler's
 * document stream, which prefills it in slices aligned as a generate's
 * prompt is. The text tokenized so far goes to an unlinked temporary file,
 * read back (mapped) for the transcript at the end: memory stays bounded
 * whatever the document's size. */
typedef struct ingest {
    char name[SESS_DOC_NAME_MAX + 1];
    char client[SESS_NAME_MAX + 1]; /* the session as the client names it */
    int64_t size;                   /* bytes the client announced, -1 = not said */
    int64_t bytes;                  /* bytes received */
    unsigned char carry[4];         /* the start of a character a chunk's end cut */
    size_t n_carry;
    kds_buf text; /* received text not tokenized yet */
    int32_t *ids; /* a chunk's tokens on their way to the stream */
    int64_t ids_cap;
    int64_t tokens; /* text tokens known so far */
    bool last;      /* the last chunk came */
    bool hashed;    /* the stream indexes its end (a resume point is possible) */
    FILE *spool;    /* the text tokenized so far */
    bool broken;    /* spool unusable after a failed write */
    int64_t spool_bytes;
    double t_progress;
    int64_t doc_keep; /* bytes of the text kept (what went in), -1 = not counted yet */
    void *map;        /* the kept text, mapped for the save */
} ingest;

/* One turn, whichever front end asked (WebSocket op or HTTP endpoint): the
 * scheduler's stream and what the answers need. */
typedef struct wturn {
    web_engine *E;
    srv_stream *st;
    uint64_t serial, conn;
    cJSON *id;
    bool msgpack;
    web_route route; /* WEB_ROUTE_WS, or the HTTP endpoint answered */
    double t_arrive, t_first;
    /* HTTP */
    bool sse, include_usage; /* an HTTP stream (server-sent events) */
    char resp_id[48];
    int64_t created;      /* unix seconds */
    int64_t cached;       /* prompt tokens that came from a stored state */
    int64_t prompt_total; /* the request's tokens (usage.prompt_tokens) */
    ingest *ing;          /* an ingest (op append) rather than a reply */
} wturn;

/* The requests of one connection that the engine took and has not answered
 * yet, oldest first. */
typedef struct conn_queue {
    struct conn_queue *next;
    uint64_t conn;
    web_req *head, *tail;
} conn_queue;

struct web_engine {
    web_server *s;
    conn_queue *queues; /* connections with requests waiting, in turn order */
    srv_sched *S;       /* sessions in memory, the batching loop, the saver */
    uint64_t next_serial;
    bool model_chat;
    bool stopping;
    double rate_t0;
    uint64_t rate_tokens;
};

/* ------------------------------------------------------------------------ */
/* Helpers                                                                   */

static void prefix_scope(web_engine *E, const web_req *r, char *out, size_t cap);

static void send_ev(web_engine *E, const web_req *r, cJSON *ev) {
    web__send(E->s, r->conn, ev, r->msgpack);
}

static void fail(web_engine *E, const web_req *r, const cJSON *id, int code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void fail(web_engine *E, const web_req *r, const cJSON *id, int code, const char *fmt, ...) {
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    send_ev(E, r, web__error(E->s, id, code, "%s", msg));
}

static void fail_err(web_engine *E, const web_req *r, const cJSON *id, const kds_err *e) {
    fail(E, r, id, web__code_of(e->status), "%s", e->msg);
}

/* The store's name of a client's session name (tenants get "TENANT."). */
static bool store_name(const web_req *r, const char *client, char out[SESS_NAME_MAX + 1]) {
    if (!client || !sess_name_valid(client)) return false;
    if (!r->auth) {
        snprintf(out, SESS_NAME_MAX + 1, "%s", client);
        return true;
    }
    /* the same limit for every tenant, whatever the length of its name */
    size_t nt = strlen(r->tenant), nc = strlen(client);
    if (nc > SESS_NAME_MAX - WEB_TENANT_MAX - 1 || nt + 1 + nc > SESS_NAME_MAX) return false;
    memcpy(out, r->tenant, nt);
    out[nt] = '.';
    memcpy(out + nt + 1, client, nc + 1);
    return sess_name_valid(out);
}

/* True when a store name belongs to the request's tenant. */
static bool owned(const web_req *r, const char *store) {
    if (!r->auth) return true;
    size_t n = strlen(r->tenant);
    return !strncmp(store, r->tenant, n) && store[n] == '.';
}

static const char *client_name(const web_req *r, const char *store) {
    return r->auth ? store + strlen(r->tenant) + 1 : store;
}

static const char *get_str(const cJSON *msg, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(msg, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* A session name argument: present, a string, valid. */
static bool arg_session(web_engine *E, const web_req *r, const cJSON *id, const char *key,
                        char out[SESS_NAME_MAX + 1]) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(r->msg, key);
    if (!v) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST, "'%s' (a session name) is missing", key);
        return false;
    }
    if (!cJSON_IsString(v) || !store_name(r, v->valuestring, out)) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST,
             "'%s' must be a session name: 1-%d of [A-Za-z0-9._-], starting with a letter or digit",
             key, r->auth ? SESS_NAME_MAX - WEB_TENANT_MAX - 1 : SESS_NAME_MAX);
        return false;
    }
    return true;
}

/* An optional number in [lo, hi]; false (error sent) when present and wrong. */
static bool arg_num(web_engine *E, const web_req *r, const cJSON *id, const char *key, double lo,
                    double hi, double *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(r->msg, key);
    if (!v || cJSON_IsNull(v)) return true;
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= lo && v->valuedouble <= hi)) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST, "'%s' must be a number in [%g, %g]", key, lo, hi);
        return false;
    }
    *out = v->valuedouble;
    return true;
}

/* Whether the request gives field `key` (null is not giving it). */
static bool given(const web_req *r, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(r->msg, key);
    return v && !cJSON_IsNull(v);
}

/* Session info, refusing other tenants' sessions as not found. */
static bool get_session(web_engine *E, const web_req *r, const cJSON *id, const char *store,
                        sess_session_info *info) {
    kds_err e = {0};
    if (!owned(r, store)) {
        fail(E, r, id, WEB_ERR_NOT_FOUND, "no session '%s'", client_name(r, store));
        return false;
    }
    kds_status rc = sess_session_get(E->s->st, store, info, &e);
    if (rc == KDS_NOT_FOUND) {
        fail(E, r, id, WEB_ERR_NOT_FOUND, "no session '%s'", client_name(r, store));
        return false;
    }
    if (rc != KDS_OK) {
        fail_err(E, r, id, &e);
        return false;
    }
    return true;
}

static const char *state_of(web_engine *E, const char *store) {
    srv_sess *h = srv_sched_find(E->S, store);
    return !h ? "cold" : srv_sess_stream(h) ? "generating" : "hot";
}

/* The session in memory, loaded from the store when cold. */
static srv_sess *ensure_hot(web_engine *E, const web_req *r, const cJSON *id, const char *store) {
    srv_sess *h = srv_sched_find(E->S, store);
    if (h) {
        srv_sess_touch(h);
        return h;
    }
    sess_session_info info;
    if (!get_session(E, r, id, store, &info)) return NULL;
    char scope[WEB_TENANT_MAX + SESS_FP_LEN + 8];
    prefix_scope(E, r, scope, sizeof scope);
    kds_err e = {0};
    kds_status rc = srv_sched_open(E->S, &info, scope, &h, &e);
    if (rc == KDS_BUSY) {
        fail(E, r, id, WEB_ERR_LIMIT,
             "all %d sessions in memory are generating (--max-sessions); try again later",
             E->s->p.max_sessions);
        return NULL;
    }
    if (rc != KDS_OK) {
        fail(E, r, id, web__code_of(e.status), "cannot open session '%s': %s",
             client_name(r, store), e.msg);
        return NULL;
    }
    return h;
}

/* Bytes of an ingested document's text that history and open show (the
 * whole text is in the transcript: `kdaserve snap export` carries it). */
#define DOC_PREVIEW 1024

static cJSON *turn_json(const sess_turn_record *t) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    if (t->doc_name[0]) {
        /* the prompt is the document: its start only (cut on a character) */
        char *pv = t->prompt;
        size_t n = t->prompt_len < DOC_PREVIEW ? t->prompt_len : DOC_PREVIEW;
        pv[n] = '\0';
        n = web__utf8_prefix(pv, n);
        pv[n] = '\0';
        cJSON_AddStringToObject(o, "prompt", pv);
        cJSON *d = cJSON_AddObjectToObject(o, "document");
        cJSON_AddStringToObject(d, "name", t->doc_name);
        cJSON_AddNumberToObject(d, "bytes", (double)t->doc_bytes);
        cJSON_AddNumberToObject(d, "tokens", (double)t->prompt_tokens);
        cJSON_AddBoolToObject(d, "clipped", t->prompt_len > n);
    } else {
        cJSON_AddStringToObject(o, "prompt", t->prompt ? t->prompt : "");
    }
    cJSON_AddStringToObject(o, "reply", t->output ? t->output : "");
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)t->prompt_tokens);
    cJSON_AddNumberToObject(o, "reply_tokens", (double)t->output_tokens);
    cJSON_AddNumberToObject(o, "tokens", (double)t->tokens);
    cJSON_AddNumberToObject(o, "snapshot", (double)t->snapshot);
    cJSON_AddNumberToObject(o, "time", (double)t->time_us);
    return o;
}

/* The last `last` turns (0 = all) of a session as a JSON array. */
static cJSON *turns_json(web_engine *E, const char *store, size_t last, kds_err *e) {
    sess_turn_record *t = NULL;
    size_t n = 0;
    if (sess_transcript(E->s->st, store, &t, &n, e) != KDS_OK) return NULL;
    cJSON *a = cJSON_CreateArray();
    size_t from = last && n > last ? n - last : 0;
    for (size_t i = from; a && i < n; i++) cJSON_AddItemToArray(a, turn_json(&t[i]));
    sess_transcript_free(t, n);
    return a;
}

/* ------------------------------------------------------------------------ */
/* Operations                                                                */

static void op_info(web_engine *E, const web_req *r, const cJSON *id) {
    const eng_config *cfg = eng_model_config(E->s->m);
    eng_state_size sz = eng_config_state_size(cfg);
    cJSON *o = web__event(id, "result");
    cJSON_AddStringToObject(o, "server", "kdaserve 0.1.0");
    cJSON_AddStringToObject(o, "protocol", WEB_PROTOCOL);
    cJSON *m = cJSON_AddObjectToObject(o, "model");
    const char *dir = eng_model_dir(E->s->m), *base = strrchr(dir, '/');
    cJSON_AddStringToObject(m, "name", base && base[1] ? base + 1 : dir);
    cJSON_AddStringToObject(m, "fingerprint", eng_model_fingerprint(E->s->m));
    cJSON_AddNumberToObject(m, "params", (double)eng_config_param_count(cfg));
    cJSON_AddNumberToObject(m, "vocab", cfg->vocab_size);
    cJSON_AddNumberToObject(m, "layers", cfg->num_hidden_layers);
    cJSON_AddNumberToObject(m, "kda_layers", cfg->n_kda_layers);
    cJSON_AddNumberToObject(m, "mla_layers", cfg->n_mla_layers);
    cJSON_AddNumberToObject(m, "state_bytes", (double)sz.fixed);
    cJSON_AddNumberToObject(m, "state_bytes_per_token", (double)sz.per_token);
    cJSON_AddBoolToObject(m, "chat", E->model_chat);
    cJSON *l = cJSON_AddObjectToObject(o, "limits");
    const web_params *p = &E->s->p;
    cJSON_AddNumberToObject(l, "max_message_bytes", (double)p->max_message);
    cJSON_AddNumberToObject(l, "max_sessions", p->max_sessions);
    cJSON_AddNumberToObject(l, "max_generations", p->max_generations);
    cJSON_AddNumberToObject(l, "max_tokens", (double)p->max_tokens);
    cJSON_AddNumberToObject(l, "idle_timeout_s", p->idle_timeout_s);
    cJSON_AddNumberToObject(l, "max_queue", p->max_queue);
    cJSON_AddNumberToObject(l, "max_queue_total", p->max_queue_total);
    send_ev(E, r, o);
}

/* The session's mode: as in memory, else by the rule the REPL uses too
 * (srv_sched_chat_mode). */
static bool mode_is_chat(web_engine *E, const sess_session_info *info) {
    srv_sess *h = srv_sched_find(E->S, info->name);
    if (!h) return srv_sched_chat_mode(E->S, info);
    srv_sess_info si;
    srv_sess_get(h, &si);
    return si.chat;
}

static cJSON *session_json(web_engine *E, const web_req *r, const sess_session_info *s) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", client_name(r, s->name));
    cJSON_AddNumberToObject(o, "tokens", (double)s->tokens);
    cJSON_AddNumberToObject(o, "turns", s->turns);
    cJSON_AddNumberToObject(o, "created", (double)s->created_us);
    cJSON_AddNumberToObject(o, "updated", (double)s->updated_us);
    cJSON_AddStringToObject(o, "parent",
                            s->parent[0] && owned(r, s->parent) ? client_name(r, s->parent) : "");
    cJSON_AddNumberToObject(o, "head", (double)s->head);
    cJSON_AddStringToObject(o, "mode", mode_is_chat(E, s) ? "chat" : "plain");
    cJSON_AddStringToObject(o, "state", state_of(E, s->name));
    return o;
}

static void op_list(web_engine *E, const web_req *r, const cJSON *id) {
    sess_session_info *all = NULL;
    size_t n = 0;
    kds_err e = {0};
    if (sess_session_list(E->s->st, &all, &n, &e) != KDS_OK) {
        fail_err(E, r, id, &e);
        return;
    }
    cJSON *o = web__event(id, "result");
    cJSON *a = cJSON_AddArrayToObject(o, "sessions");
    for (size_t i = 0; i < n; i++)
        if (owned(r, all[i].name) && all[i].tokens >= 0)
            cJSON_AddItemToArray(a, session_json(E, r, &all[i]));
    free(all);
    send_ev(E, r, o);
}

/* The first free session name (as the client sees it) of BASE, BASE-2,
 * BASE-3 ..., or of BASE-2, BASE-3 ... when `suffixed`, as a store name;
 * false (error sent) when the first 999 are taken. */
static bool free_name(web_engine *E, const web_req *r, const cJSON *id, const char *base,
                      bool suffixed, char store[SESS_NAME_MAX + 1]) {
    char client[SESS_NAME_MAX + 1];
    for (int k = suffixed ? 2 : 1; k < 1000; k++) {
        if (k == 1)
            snprintf(client, sizeof client, "%.40s", base);
        else
            snprintf(client, sizeof client, "%.40s-%d", base, k);
        sess_session_info tmp;
        if (store_name(r, client, store) &&
            sess_session_get(E->s->st, store, &tmp, NULL) == KDS_NOT_FOUND)
            return true;
    }
    fail(E, r, id, WEB_ERR_EXISTS, "no free automatic session name; give one");
    return false;
}

/* The `busy` error for session h (store name `store`): what it is doing. */
static void fail_busy(web_engine *E, const web_req *r, const cJSON *id, const srv_sess *h,
                      const char *store, const char *then) {
    const srv_stream *st = srv_sess_stream(h);
    const wturn *w = srv_stream_user(st);
    if (srv_stream_get(st)->phase == SRV_PHASE_SAVE)
        fail(E, r, id, WEB_ERR_BUSY, "session '%s' is saving its last turn; try again in a moment",
             client_name(r, store));
    else
        fail(E, r, id, WEB_ERR_BUSY, "session '%s' is %s%s", client_name(r, store),
             w->ing ? "taking a document" : "generating", then);
}

/* An existing session of the tenant that is not generating (rename and
 * delete need one); *h: its entry in memory, or NULL. False: error sent. */
static bool idle_session(web_engine *E, const web_req *r, const cJSON *id, const char *store,
                         srv_sess **h) {
    sess_session_info info;
    if (!get_session(E, r, id, store, &info)) return false;
    *h = srv_sched_find(E->S, store);
    if (*h && srv_sess_stream(*h)) {
        fail_busy(E, r, id, *h, store, "; cancel it first");
        return false;
    }
    return true;
}

static void op_create(web_engine *E, const web_req *r, const cJSON *id) {
    char store[SESS_NAME_MAX + 1];
    kds_err e = {0};
    if (cJSON_GetObjectItemCaseSensitive(r->msg, "session")) {
        if (!arg_session(E, r, id, "session", store)) return;
    } else {
        time_t now = time(NULL);
        struct tm tmv;
        gmtime_r(&now, &tmv);
        char stamp[32];
        strftime(stamp, sizeof stamp, "s-%Y%m%d-%H%M%S", &tmv);
        if (!free_name(E, r, id, stamp, false, store)) return;
    }
    const char *mode = get_str(r->msg, "mode");
    const cJSON *mv = cJSON_GetObjectItemCaseSensitive(r->msg, "mode");
    if (mv && (!mode || (strcmp(mode, "chat") && strcmp(mode, "plain")))) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST, "'mode' must be \"chat\" or \"plain\"");
        return;
    }
    bool chat = mode ? !strcmp(mode, "chat") : E->model_chat;
    if (chat && !eng_chat_supported(eng_model_tokenizer(E->s->m))) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST,
             "this model's tokenizer has no chat format; use \"mode\":\"plain\"");
        return;
    }
    const cJSON *sv = cJSON_GetObjectItemCaseSensitive(r->msg, "system");
    if (sv && !cJSON_IsString(sv) && !cJSON_IsNull(sv)) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST, "'system' must be a string");
        return;
    }
    const char *system = cJSON_IsString(sv) ? sv->valuestring : NULL;
    sess_session_info tmp;
    kds_status rc = sess_session_get(E->s->st, store, &tmp, &e);
    if (rc == KDS_OK || srv_sched_find(E->S, store)) {
        fail(E, r, id, WEB_ERR_EXISTS, "session '%s' already exists", client_name(r, store));
        return;
    }
    if (rc != KDS_NOT_FOUND) {
        fail_err(E, r, id, &e);
        return;
    }
    kds_err_clear(&e);
    if (!srv_sched_has_room(E->S)) {
        fail(E, r, id, WEB_ERR_LIMIT, "all %d sessions in memory are generating (--max-sessions)",
             E->s->p.max_sessions);
        return;
    }
    int32_t *ids = NULL;
    int64_t n = 0;
    uint64_t snap = 0;
    srv_sess *h = NULL;
    if (system && *system) {
        const eng_tokenizer *tok = eng_model_tokenizer(E->s->m);
        /* chat: a system turn alone; plain: the text itself */
        if (chat) {
            eng_chat_msg msg = {.role = "system", .content = system};
            eng_chat_params cp = eng_chat_default_params();
            cp.add_generation_prompt = false;
            int64_t count = 0;
            if (eng_chat_render(tok, &msg, 1, &cp, NULL, 0, &count, &e) != KDS_OK) goto fail;
            if (!(ids = malloc((size_t)(count + 1) * sizeof *ids))) goto nomem;
            if (eng_chat_render(tok, &msg, 1, &cp, ids, count, &n, &e) != KDS_OK) goto fail;
        } else if (eng_chat_turn(tok, false, 0, NULL, system, strlen(system), false, &ids, &n,
                                 &e) != KDS_OK) {
            goto fail;
        }
    }
    /* a system text is the first transcript entry; without one the save
     * only declares the mode */
    bool has_system = system && *system;
    sess_turn turn = {.prompt = has_system ? system : NULL,
                      .prompt_len = has_system ? strlen(system) : 0,
                      .output = has_system ? "" : NULL, .prompt_tokens = n,
                      .mode = chat ? "chat" : "plain"};
    /* every token of the new session is known: the scheduler hashes its
     * sequence from here on, and indexes a system text's end */
    char scope[WEB_TENANT_MAX + SESS_FP_LEN + 8];
    prefix_scope(E, r, scope, sizeof scope);
    if (srv_sched_new(E->S, store, chat, ids, n, &turn, scope, &h, &snap, &e) != KDS_OK) goto fail;
    free(ids);
    srv_sess_info si;
    srv_sess_get(h, &si);
    cJSON *o = web__event(id, "result");
    cJSON_AddStringToObject(o, "session", client_name(r, store));
    cJSON_AddNumberToObject(o, "tokens", (double)si.tokens);
    cJSON_AddStringToObject(o, "mode", chat ? "chat" : "plain");
    cJSON_AddNumberToObject(o, "snapshot", (double)snap);
    send_ev(E, r, o);
    return;
nomem:
    kds_err_set(&e, KDS_NOMEM, "out of memory");
fail:
    free(ids);
    fail(E, r, id, web__code_of(e.status), "cannot create session '%s': %s", client_name(r, store),
         e.msg);
}

static void op_open(web_engine *E, const web_req *r, const cJSON *id) {
    char store[SESS_NAME_MAX + 1];
    if (!arg_session(E, r, id, "session", store)) return;
    bool was_hot = srv_sched_find(E->S, store) != NULL;
    srv_sess *h = ensure_hot(E, r, id, store);
    if (!h) return;
    kds_err e = {0};
    sess_session_info info;
    if (sess_session_get(E->s->st, store, &info, &e) != KDS_OK) {
        fail_err(E, r, id, &e);
        return;
    }
    cJSON *turns = turns_json(E, store, LAST_TURNS, &e);
    if (!turns) {
        fail_err(E, r, id, &e);
        return;
    }
    srv_sess_info si;
    srv_sess_get(h, &si);
    cJSON *o = web__event(id, "result");
    cJSON_AddStringToObject(o, "session", client_name(r, store));
    cJSON_AddNumberToObject(o, "tokens", (double)si.tokens);
    cJSON_AddNumberToObject(o, "turns", info.turns);
    cJSON_AddStringToObject(o, "mode", si.chat ? "chat" : "plain");
    cJSON_AddNumberToObject(o, "state_bytes", (double)si.state_bytes);
    cJSON_AddNumberToObject(o, "resume_ms", was_hot ? 0.0 : si.load_ms);
    cJSON_AddItemToObject(o, "last_turns", turns);
    send_ev(E, r, o);
}

static void op_fork(web_engine *E, const web_req *r, const cJSON *id) {
    char src[SESS_NAME_MAX + 1], dst[SESS_NAME_MAX + 1], made[SESS_NAME_MAX + 1];
    if (!arg_session(E, r, id, "session", src)) return;
    bool named = cJSON_GetObjectItemCaseSensitive(r->msg, "name") != NULL;
    if (named && !arg_session(E, r, id, "name", dst)) return;
    sess_session_info info;
    if (!get_session(E, r, id, src, &info)) return;
    kds_err e = {0};
    if (sess_fork(E->s->st, src, named ? dst : NULL, made, &e) != KDS_OK) {
        fail_err(E, r, id, &e);
        return;
    }
    cJSON *o = web__event(id, "result");
    cJSON_AddStringToObject(o, "session", client_name(r, made));
    cJSON_AddNumberToObject(o, "tokens", (double)info.tokens);
    send_ev(E, r, o);
}

static void op_rename(web_engine *E, const web_req *r, const cJSON *id) {
    char from[SESS_NAME_MAX + 1], to[SESS_NAME_MAX + 1];
    srv_sess *h;
    if (!arg_session(E, r, id, "session", from) || !arg_session(E, r, id, "name", to) ||
        !idle_session(E, r, id, from, &h))
        return;
    kds_err e = {0};
    if (sess_session_rename(E->s->st, from, to, &e) != KDS_OK) {
        fail_err(E, r, id, &e);
        return;
    }
    if (h) srv_sess_rename(h, to);
    cJSON *o = web__event(id, "result");
    cJSON_AddStringToObject(o, "session", client_name(r, to));
    send_ev(E, r, o);
}

static void op_delete(web_engine *E, const web_req *r, const cJSON *id) {
    char store[SESS_NAME_MAX + 1];
    srv_sess *h;
    if (!arg_session(E, r, id, "session", store) || !idle_session(E, r, id, store, &h)) return;
    kds_err e = {0};
    if (sess_session_delete(E->s->st, store, &e) != KDS_OK) {
        fail_err(E, r, id, &e);
        return;
    }
    if (h) srv_sched_drop(E->S, h);
    send_ev(E, r, web__event(id, "result"));
}

static void op_history(web_engine *E, const web_req *r, const cJSON *id) {
    char store[SESS_NAME_MAX + 1];
    if (!arg_session(E, r, id, "session", store)) return;
    double last = 0;
    if (!arg_num(E, r, id, "last", 0, 1e9, &last)) return;
    sess_session_info info;
    if (!get_session(E, r, id, store, &info)) return;
    kds_err e = {0};
    cJSON *turns = turns_json(E, store, (size_t)last, &e);
    if (!turns) {
        fail_err(E, r, id, &e);
        return;
    }
    cJSON *o = web__event(id, "result");
    cJSON_AddItemToObject(o, "turns", turns);
    send_ev(E, r, o);
}

static void op_snapshots(web_engine *E, const web_req *r, const cJSON *id) {
    char store[SESS_NAME_MAX + 1];
    if (!arg_session(E, r, id, "session", store)) return;
    sess_session_info info;
    if (!get_session(E, r, id, store, &info)) return;
    cJSON *o = web__event(id, "result");
    cJSON *a = cJSON_AddArrayToObject(o, "snapshots");
    /* the head and its ancestors, newest first; gc may have removed old ones */
    uint64_t sid = info.head;
    for (int k = 0; sid && k < LINEAGE_MAX; k++) {
        sess_snapshot_info si;
        kds_err e = {0};
        if (sess_snapshot_get(E->s->st, sid, &si, &e) != KDS_OK) break;
        if (!owned(r, si.origin)) break;
        cJSON *p = cJSON_CreateObject();
        cJSON_AddNumberToObject(p, "id", (double)si.id);
        cJSON_AddNumberToObject(p, "tokens", (double)si.tokens);
        cJSON_AddNumberToObject(p, "created", (double)si.created_us);
        cJSON_AddNumberToObject(p, "parent", (double)si.parent);
        cJSON_AddItemToArray(a, p);
        sid = si.parent;
    }
    send_ev(E, r, o);
}

static void op_restore(web_engine *E, const web_req *r, const cJSON *id) {
    const cJSON *sv = cJSON_GetObjectItemCaseSensitive(r->msg, "snapshot");
    uint64_t sid = 0;
    if (cJSON_IsNumber(sv) && sv->valuedouble >= 1 && sv->valuedouble < 9007199254740992.0 &&
        sv->valuedouble == floor(sv->valuedouble))
        sid = (uint64_t)sv->valuedouble;
    else if (!cJSON_IsString(sv) || !sess_parse_snapshot_id(sv->valuestring, &sid)) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST, "'snapshot' must be a snapshot id (12 or \"@12\")");
        return;
    }
    char dst[SESS_NAME_MAX + 1], made[SESS_NAME_MAX + 1], src[32];
    bool named = cJSON_GetObjectItemCaseSensitive(r->msg, "name") != NULL;
    if (named && !arg_session(E, r, id, "name", dst)) return;
    kds_err e = {0};
    sess_snapshot_info si;
    if (sess_snapshot_get(E->s->st, sid, &si, &e) != KDS_OK) {
        if (e.status == KDS_NOT_FOUND)
            fail(E, r, id, WEB_ERR_NOT_FOUND, "no snapshot @%" PRIu64, sid);
        else
            fail_err(E, r, id, &e);
        return;
    }
    if (r->auth && !owned(r, si.origin)) {
        fail(E, r, id, WEB_ERR_NOT_FOUND, "no snapshot @%" PRIu64, sid);
        return;
    }
    if (sess_verify(E->s->st, sid, E->s->m, &e) != KDS_OK) {
        fail(E, r, id, web__code_of(e.status), "cannot restore @%" PRIu64 ": %s", sid, e.msg);
        return;
    }
    if (!named) {
        /* "snapN-K", the first free K from 2: the name the store gives a fork
         * of "@N" (kdaserve snap fork @N, the REPL's restore) */
        char base[32];
        snprintf(base, sizeof base, "snap%" PRIu64, sid);
        if (!free_name(E, r, id, base, true, dst)) return;
    }
    snprintf(src, sizeof src, "@%" PRIu64, sid);
    if (sess_fork(E->s->st, src, dst, made, &e) != KDS_OK) {
        fail_err(E, r, id, &e);
        return;
    }
    cJSON *o = web__event(id, "result");
    cJSON_AddStringToObject(o, "session", client_name(r, made));
    cJSON_AddNumberToObject(o, "tokens", (double)si.tokens);
    cJSON_AddNumberToObject(o, "snapshot", (double)sid);
    send_ev(E, r, o);
}

static void op_stats(web_engine *E, const web_req *r, const cJSON *id) {
    web_metrics *m = &E->s->metrics;
    cJSON *o = web__event(id, "result");
    cJSON *sv = cJSON_AddObjectToObject(o, "server");
    cJSON_AddNumberToObject(sv, "uptime_s", (double)(web__now_us() - E->s->started_us) / 1e6);
    cJSON_AddNumberToObject(sv, "connections", (double)atomic_load(&m->connections));
    cJSON_AddNumberToObject(sv, "sessions_hot", (double)atomic_load(&m->sessions_hot));
    cJSON_AddNumberToObject(sv, "generations_active", srv_sched_running(E->S));
    cJSON_AddNumberToObject(sv, "tokens_generated", (double)atomic_load(&m->tokens_generated));
    cJSON_AddNumberToObject(sv, "tokens_prefilled", (double)atomic_load(&m->tokens_prefilled));
    cJSON_AddNumberToObject(sv, "decode_tok_s", web__rate_get(&E->s->metrics));
    uint64_t steps = atomic_load(&m->decode_steps), rows = atomic_load(&m->decode_rows);
    cJSON_AddNumberToObject(sv, "batch_mean", steps ? (double)rows / (double)steps : 0.0);
    pthread_mutex_lock(&E->s->lock);
    int queued = E->s->n_queued;
    pthread_mutex_unlock(&E->s->lock);
    cJSON_AddNumberToObject(sv, "requests_queued", queued);
    if (cJSON_GetObjectItemCaseSensitive(r->msg, "session")) {
        char store[SESS_NAME_MAX + 1];
        if (!arg_session(E, r, id, "session", store)) {
            cJSON_Delete(o);
            return;
        }
        sess_session_info info;
        if (!get_session(E, r, id, store, &info)) {
            cJSON_Delete(o);
            return;
        }
        srv_sess *h = srv_sched_find(E->S, store);
        srv_sess_info si = {0};
        if (h) srv_sess_get(h, &si);
        cJSON *ss = cJSON_AddObjectToObject(o, "session");
        cJSON_AddNumberToObject(ss, "tokens", (double)(h ? si.tokens : info.tokens));
        cJSON_AddNumberToObject(ss, "state_bytes",
                                (double)(h ? si.state_bytes
                                           : sess_snapshot_size(eng_model_config(E->s->m),
                                                                info.tokens).total));
        cJSON_AddStringToObject(ss, "mode", mode_is_chat(E, &info) ? "chat" : "plain");
        cJSON_AddStringToObject(ss, "state", state_of(E, store));
        cJSON_AddNumberToObject(ss, "last_resume_ms", si.load_ms);
        cJSON_AddNumberToObject(ss, "last_prefill_tok_s", si.prefill_tok_s);
        cJSON_AddNumberToObject(ss, "last_decode_tok_s", si.decode_tok_s);
    }
    send_ev(E, r, o);
}

/* ------------------------------------------------------------------------ */
/* Turns: the scheduler's streams, as the front end sees them                */

static void ingest_free(ingest *in) {
    if (!in) return;
    kds_buf_free(&in->text);
    free(in->ids);
    if (in->spool) fclose(in->spool);
    free(in);
}

static void wturn_free(wturn *w) {
    if (!w) return;
    ingest_free(w->ing);
    cJSON_Delete(w->id);
    free(w);
}

/* A new turn of request r (not started). */
static wturn *wturn_new(web_engine *E, const web_req *r, const cJSON *id) {
    wturn *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->E = E;
    w->id = id ? cJSON_Duplicate(id, 1) : NULL;
    w->conn = r->conn;
    w->msgpack = r->msgpack;
    w->serial = ++E->next_serial;
    w->t_arrive = r->t_arrive;
    w->route = r->route;
    return w;
}

/* Start w's stream on session h: it joins the batching loop. */
static kds_status turn_start(web_engine *E, wturn *w, srv_sess *h, srv_stream_params *p,
                             kds_err *e) {
    p->user = w;
    kds_status rc = srv_stream_start(E->S, h, p, &w->st, e);
    if (rc != KDS_OK) return rc;
    atomic_fetch_add(&E->s->metrics.generations_active, 1);
    atomic_fetch_add(&E->s->metrics.generations_total, 1);
    return KDS_OK;
}

/* The turn is over (its `done` hook answered): forget it. */
static void turn_over(web_engine *E, wturn *w) {
    atomic_fetch_sub(&E->s->metrics.generations_active, 1);
    wturn_free(w);
}

/* Reply text that may be sent (srv_reply said so): WebSocket token events
 * or an HTTP stream's chunks (joined per write either way); a whole HTTP
 * answer waits for the end. */
static void on_text(void *user, srv_stream *st, const char *p, size_t n) {
    wturn *w = user;
    web_engine *E = w->E;
    if (!n) return;
    if (!w->t_first) {
        w->t_first = kds_now_s();
        web__hist_add(&E->s->metrics.ttft_ms, (w->t_first - w->t_arrive) * 1e3);
    }
    if (srv_stream_get(st)->gone || (w->route != WEB_ROUTE_WS && !w->sse)) return;
    web__send_token(E->s, w->conn, w->id, w->msgpack, w->serial, p, n);
}

/* Backpressure: a connection with more than max_pending bytes unsent
 * pauses its streams. */
static srv_reader on_reader(void *user, srv_stream *st) {
    wturn *w = user;
    bool gone = false;
    size_t pending = web__pending(w->E->s, w->conn, &gone);
    if (gone) return SRV_READER_GONE;
    return pending > w->E->s->p.max_pending ? SRV_READER_BEHIND : SRV_READER_OK;
}

/* The `error` object of a `done` event: the save's failure, else the
 * turn's own (an engine error), counted in the metrics. */
static void done_error(web_engine *E, cJSON *o, const srv_stream_end *end) {
    cJSON *err = cJSON_AddObjectToObject(o, "error");
    int code = end->save_rc != KDS_OK ? web__code_of(end->save_rc) : WEB_ERR_INTERNAL;
    cJSON_AddStringToObject(err, "code", web__code_name(code));
    cJSON_AddStringToObject(err, "message",
                            end->save_rc != KDS_OK ? end->save_err->msg : end->error);
    atomic_fetch_add(&E->s->metrics.errors[code], 1);
}

/* The answer to a WebSocket generate, once saved (or not). */
static void on_generate_done(void *user, srv_stream *st, const srv_stream_end *end) {
    wturn *w = user;
    web_engine *E = w->E;
    const srv_stream_info *i = srv_stream_get(st);
    if (!i->gone) {
        srv_sess_info si;
        srv_sess_get(i->sess, &si);
        double decode_s = i->t_decode0 ? i->t_end - i->t_decode0 : 0.0;
        double prefill_s = i->t_prefill_end ? i->t_prefill_end - i->t_start : 0.0;
        cJSON *o = web__event(w->id, "done");
        cJSON_AddStringToObject(o, "reason", end->save_rc == KDS_OK ? end->reason : "error");
        cJSON_AddNumberToObject(o, "tokens", (double)i->produced);
        cJSON_AddNumberToObject(o, "prompt_tokens", (double)i->given);
        cJSON_AddNumberToObject(o, "context", (double)si.tokens);
        cJSON_AddNumberToObject(o, "snapshot", (double)end->snapshot);
        cJSON_AddStringToObject(o, "reply", srv_stream_reply(st, NULL));
        cJSON_AddNumberToObject(o, "prefill_ms", prefill_s * 1e3);
        cJSON_AddNumberToObject(o, "decode_ms", decode_s * 1e3);
        cJSON_AddNumberToObject(o, "decode_tok_s", si.decode_tok_s);
        cJSON_AddNumberToObject(o, "queue_ms", (i->t_start - w->t_arrive) * 1e3);
        if (end->save_rc != KDS_OK || !strcmp(end->reason, "error")) done_error(E, o, end);
        web__send(E->s, w->conn, o, w->msgpack);
    }
    turn_over(E, w);
}

static const srv_stream_hooks GENERATE_HOOKS = {
    .text = on_text, .reader = on_reader, .done = on_generate_done};

static void op_generate(web_engine *E, const web_req *r, const cJSON *id) {
    char store[SESS_NAME_MAX + 1];
    if (!arg_session(E, r, id, "session", store)) return;
    const cJSON *mv = cJSON_GetObjectItemCaseSensitive(r->msg, "message");
    const cJSON *tv = cJSON_GetObjectItemCaseSensitive(r->msg, "text");
    if ((mv != NULL) == (tv != NULL) || (mv && !cJSON_IsString(mv)) || (tv && !cJSON_IsString(tv))) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST,
             "give exactly one of 'message' (a user message) or 'text' (raw text), as a string");
        return;
    }
    eng_sampler_params sp = eng_sampler_default_params();
    double temp = sp.temperature, top_p = sp.top_p, top_k = sp.top_k, min_p = sp.min_p,
           rep = sp.repeat_penalty, max_tokens = 512, seed = -1;
    if (!arg_num(E, r, id, "temperature", 0, 100, &temp) || !arg_num(E, r, id, "top_p", 0, 1, &top_p) ||
        !arg_num(E, r, id, "top_k", 0, 1e9, &top_k) || !arg_num(E, r, id, "min_p", 0, 1, &min_p) ||
        !arg_num(E, r, id, "repeat_penalty", 0.01, 100, &rep) ||
        !arg_num(E, r, id, "max_tokens", 0, 1e12, &max_tokens) ||
        !arg_num(E, r, id, "seed", 0, 18446744073709551615.0, &seed))
        return;
    const cJSON *ie = cJSON_GetObjectItemCaseSensitive(r->msg, "ignore_eos");
    if (ie && !cJSON_IsBool(ie) && !cJSON_IsNull(ie)) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST, "'ignore_eos' must be true or false");
        return;
    }
    if (max_tokens > (double)E->s->p.max_tokens) max_tokens = (double)E->s->p.max_tokens;
    sp.temperature = (float)temp;
    sp.top_p = (float)top_p;
    sp.top_k = (int)top_k;
    sp.min_p = (float)min_p;
    sp.repeat_penalty = (float)rep;
    if (srv_sched_running(E->S) >= E->s->p.max_generations) {
        fail(E, r, id, WEB_ERR_LIMIT, "%d generations are running (--max-generations); try again later",
             srv_sched_running(E->S));
        return;
    }
    srv_sess *h = srv_sched_find(E->S, store);
    if (h && srv_sess_stream(h)) {
        fail_busy(E, r, id, h, store, "");
        return;
    }
    if (!(h = ensure_hot(E, r, id, store))) return;
    srv_sess_info si;
    srv_sess_get(h, &si);
    if (si.has_sampler) {
        /* the settings of the session's last turn, except those given now */
        unsigned own = (given(r, "temperature") ? SESS_SAMPLER_TEMPERATURE : 0) |
                       (given(r, "top_p") ? SESS_SAMPLER_TOP_P : 0) |
                       (given(r, "top_k") ? SESS_SAMPLER_TOP_K : 0) |
                       (given(r, "min_p") ? SESS_SAMPLER_MIN_P : 0) |
                       (given(r, "repeat_penalty") ? SESS_SAMPLER_REPEAT_PENALTY : 0);
        sp = sess_sampler_merge(&si.sampler, &sp, own);
    }
    const char *text = mv ? mv->valuestring : tv->valuestring;
    size_t len = strlen(text);
    double t_start = kds_now_s();
    wturn *w = wturn_new(E, r, id);
    int32_t *ids = NULL;
    int64_t n = 0;
    kds_err e = {0};
    if (!w) {
        fail(E, r, id, WEB_ERR_INTERNAL, "out of memory");
        return;
    }
    const eng_tokenizer *tok = eng_model_tokenizer(E->s->m);
    if (eng_chat_turn(tok, mv && si.chat, si.tokens, NULL, text, len, true, &ids, &n, &e) !=
        KDS_OK) {
        fail(E, r, id, web__code_of(e.status), "%s", e.msg);
        goto out;
    }
    if (n == 0 && si.tokens == 0) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST,
             "the session is empty and so is the text; this model has no BOS token to start from");
        goto out;
    }
    srv_stream_params p = srv_stream_default_params();
    p.ids = ids;
    p.n_ids = n;
    p.prompt = text;
    p.prompt_len = len;
    p.reply.max_tokens = (int64_t)max_tokens;
    p.reply.ignore_eos = cJSON_IsTrue(ie);
    p.reply.chat = si.chat;
    p.sampler = sp;
    p.reseed = seed >= 0;
    p.seed = seed >= 0 ? (uint64_t)seed : 0;
    p.index_fork = true; /* a stateful client's turns: resumed over HTTP, they fork */
    p.t_start = t_start;
    p.hooks = &GENERATE_HOOKS;
    /* a session whose every token this server saw (srv_sess_hashed) has the
     * turn's end indexed: the scheduler hashes each token as it goes in */
    if (turn_start(E, w, h, &p, &e) != KDS_OK) {
        fail(E, r, id, web__code_of(e.status), "%s", e.msg);
        goto out;
    }
    free(ids);
    cJSON *o = web__event(id, "started");
    cJSON_AddStringToObject(o, "session", client_name(r, store));
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)n);
    cJSON_AddNumberToObject(o, "context", (double)si.tokens);
    send_ev(E, r, o);
    return;
out:
    free(ids);
    wturn_free(w);
}

static bool same_id(const cJSON *a, const cJSON *b) {
    if (!a || !b) return false;
    if (cJSON_IsNumber(a) && cJSON_IsNumber(b)) return a->valuedouble == b->valuedouble;
    if (cJSON_IsString(a) && cJSON_IsString(b)) return !strcmp(a->valuestring, b->valuestring);
    return false;
}

static void op_cancel(web_engine *E, const web_req *r, const cJSON *id) {
    const cJSON *target = cJSON_GetObjectItemCaseSensitive(r->msg, "target");
    bool by_session = cJSON_GetObjectItemCaseSensitive(r->msg, "session") != NULL;
    char store[SESS_NAME_MAX + 1];
    if (!target && !by_session) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST, "give 'target' (the generate request's id) or 'session'");
        return;
    }
    if (target && !cJSON_IsNumber(target) && !cJSON_IsString(target)) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST, "'target' must be a request id (number or string)");
        return;
    }
    if (by_session && !arg_session(E, r, id, "session", store)) return;
    bool any = false;
    for (srv_stream *st = srv_sched_next(E->S, NULL); st; st = srv_sched_next(E->S, st)) {
        const srv_stream_info *i = srv_stream_get(st);
        const wturn *w = srv_stream_user(st);
        if (i->phase == SRV_PHASE_FINISH || i->cancelled) continue;
        const char *name = srv_sess_name(i->sess);
        bool hit = target ? w->conn == r->conn && same_id(w->id, target)
                          : owned(r, name) && !strcmp(name, store);
        if (hit) {
            srv_stream_cancel(st, SRV_CANCEL_ASKED);
            any = true;
        }
    }
    cJSON *o = web__event(id, "result");
    cJSON_AddBoolToObject(o, "cancelled", any);
    send_ev(E, r, o);
}

/* ------------------------------------------------------------------------ */
/* Ingest: op append                                                         */

/* Room for `n` tokens in in->ids. */
static kds_status ingest_room(ingest *in, int64_t n, kds_err *e) {
    if (n <= in->ids_cap) return KDS_OK;
    int64_t cap = in->ids_cap ? in->ids_cap : 4096;
    while (cap < n)
        cap *= 2;
    int32_t *p = realloc(in->ids, (size_t)cap * sizeof *p);
    if (!p) return kds_err_set(e, KDS_NOMEM, "out of memory");
    in->ids = p;
    in->ids_cap = cap;
    return KDS_OK;
}

/*
 * Add text p[0 .. n) (whole characters) to ingest w, tokenize what can no
 * longer change (everything but the last two pre-tokens; all of it when
 * `last`) and hand those tokens to w's document stream. The first chunk
 * starts the stream on session h with `sp` (its opener, a chat turn's
 * start, already in in->ids[0 .. sp->n_ids)); later ones append. All or
 * nothing: on error the ingest and the stream are as they were (the first
 * chunk's new hasher, sp->hasher, is freed; the session keeps its own).
 */
static kds_status ingest_take(web_engine *E, wturn *w, srv_sess *h, srv_stream_params *sp,
                              const unsigned char *p, size_t n, bool last, kds_err *e) {
    ingest *in = w->ing;
    const eng_tokenizer *tok = eng_model_tokenizer(E->s->m);
    size_t old = in->text.len, *ends = NULL;
    kds_status rc = KDS_OK;
    int64_t at = w->st ? 0 : sp->n_ids; /* ids ahead of this chunk's (the opener) */
    int64_t k = 0, point = 0;
    bool spooled = false;
    if (in->broken) {
        rc = kds_err_set(e, KDS_IO, "the document's temporary file failed; cancel it");
        goto fail;
    }
    if ((rc = kds_buf_append(&in->text, p, n, e)) != KDS_OK) goto fail;
    size_t cut = 0, len = in->text.len, stable = 0;
    if (last) {
        cut = len;
        /* where text after the document can no longer change the tokens:
         * before its last two pre-tokens (as the hold-back rule) */
        int64_t np = 0;
        if (in->hashed &&
            (rc = eng_tok_split(tok, (const char *)in->text.p, len, NULL, 0, &np, e)) != KDS_OK)
            goto fail;
        if (np >= 3) {
            if (!(ends = malloc((size_t)np * sizeof *ends))) goto nomem;
            if ((rc = eng_tok_split(tok, (const char *)in->text.p, len, ends, np, &np, e)) != KDS_OK)
                goto fail;
            stable = ends[np - 3];
        }
    } else if (len >= INGEST_MIN_SPLIT) {
        int64_t np = 0;
        if ((rc = eng_tok_split(tok, (const char *)in->text.p, len, NULL, 0, &np, e)) != KDS_OK)
            goto fail;
        if (np >= 3) {
            if (!(ends = malloc((size_t)np * sizeof *ends))) goto nomem;
            if ((rc = eng_tok_split(tok, (const char *)in->text.p, len, ends, np, &np, e)) !=
                KDS_OK)
                goto fail;
            cut = ends[np - 3];
        }
        if (!cut && len > INGEST_HOLD_MAX) cut = len; /* one pre-token of megabytes */
    }
    if (cut) {
        /* The tokens of text[0, cut) as they are inside the whole text. Text
         * cut at a pre-token boundary and encoded alone may end otherwise
         * (a run of spaces before a digit is two pre-tokens, at the end of a
         * text one), so the whole text is encoded and the tokens of
         * text[cut, len) dropped: text that starts on a pre-token boundary
         * encodes alone as it does inside (the split looks ahead, never
         * back). k1: the tokens before `stable`, the same way. */
        const char *t = (const char *)in->text.p;
        int64_t k1 = 0, tail = 0;
        if ((rc = ingest_room(in, at + (int64_t)len, e)) != KDS_OK) goto fail;
        if ((rc = eng_tok_encode_ex(tok, t, len, 0, in->ids + at, (int64_t)len, &k, e)) != KDS_OK ||
            (cut < len &&
             (rc = eng_tok_encode_ex(tok, t + cut, len - cut, 0, NULL, 0, &tail, e)) != KDS_OK))
            goto fail;
        k -= tail;
        if (stable && (rc = eng_tok_encode_ex(tok, t + stable, cut - stable, 0, NULL, 0, &k1, e)) != KDS_OK)
            goto fail;
        k1 = stable ? k - k1 : 0;
        spooled = true;
        if (fwrite(in->text.p, 1, cut, in->spool) != cut || fflush(in->spool) != 0) {
            rc = kds_err_set(e, KDS_IO, "cannot keep the document's text: %s", strerror(errno));
            goto fail;
        }
        if (last && in->hashed) {
            /* the resume point: the last slice boundary at or before the
             * stable end. Every feed before the last is a whole slice, so
             * what was fed is a multiple of the slice and the boundaries
             * counted from it are those of the document */
            const srv_stream_info *i = w->st ? srv_stream_get(w->st) : NULL;
            int64_t slice = srv_sched_slice(E->S), fed = i ? i->fed : 0;
            int64_t unfed = i ? i->given - i->fed : at;
            int64_t rel = (unfed + k1) / slice * slice;
            if (unfed + k >= RESUME_POINT_MIN && rel > 0 && rel < unfed + k) point = fed + rel;
        }
    }
    if (!w->st) {
        sp->ids = in->ids;
        sp->opener = at;
        sp->n_ids = at + k;
        sp->point_at = point;
        rc = turn_start(E, w, h, sp, e);
        sp->hasher = NULL; /* the stream's, started or not */
        if (rc != KDS_OK) goto fail;
        if (last) (void)srv_stream_append(w->st, NULL, 0, true, NULL); /* allocates nothing */
    } else {
        if ((rc = srv_stream_append(w->st, in->ids, k, last, e)) != KDS_OK) goto fail;
        if (point) srv_stream_point(w->st, point);
    }
    in->spool_bytes += (int64_t)cut;
    in->tokens += k;
    if (cut) {
        memmove(in->text.p, in->text.p + cut, len - cut);
        in->text.len = len - cut;
        in->text.p[in->text.len] = '\0';
    }
    if (last) in->last = true;
    free(ends);
    return KDS_OK;
nomem:
    rc = kds_err_set(e, KDS_NOMEM, "out of memory");
fail:
    free(ends);
    if (!w->st) {
        sess_prefix_hasher_free(sp->hasher);
        sp->hasher = NULL;
    }
    if (spooled) {
        /* what was written after spool_bytes is never read (the end maps
         * only spool_bytes); the next write goes there again */
        clearerr(in->spool);
        if (fseeko(in->spool, (off_t)in->spool_bytes, SEEK_SET) != 0) in->broken = true;
    }
    in->text.len = old;
    if (in->text.p) in->text.p[old] = '\0';
    return rc;
}

/* The ingest running on session `store` (NULL: none). */
static wturn *ingest_of(web_engine *E, const char *store) {
    srv_sess *h = srv_sched_find(E->S, store);
    srv_stream *st = h ? srv_sess_stream(h) : NULL;
    wturn *w = st ? srv_stream_user(st) : NULL;
    return w && w->ing ? w : NULL;
}

/* A chunk of an ingest whose backlog is full waits in its connection's
 * queue (answered when the backlog drains). */
static bool deferred(web_engine *E, const web_req *r) {
    if (E->stopping) return false;
    const char *op = get_str(r->msg, "op"), *sn = get_str(r->msg, "session");
    char store[SESS_NAME_MAX + 1];
    if (!op || strcmp(op, "append") || !sn || !store_name(r, sn, store)) return false;
    wturn *w = ingest_of(E, store);
    if (!w || w->conn != r->conn) return false;
    const srv_stream_info *i = srv_stream_get(w->st);
    return !i->cancelled && !i->gone && i->given - i->fed > INGEST_BACKLOG;
}

/* A slice of the document went in: a `progress` event, at most every
 * INGEST_PROGRESS_S. */
static void on_ingest_fed(void *user, srv_stream *st, int64_t n) {
    wturn *w = user;
    ingest *in = w->ing;
    const srv_stream_info *i = srv_stream_get(st);
    double now = kds_now_s();
    if (i->gone || now - in->t_progress < INGEST_PROGRESS_S) return;
    in->t_progress = now;
    int64_t done = i->doc_fed;
    double dt = now - i->t_start, tps = dt > 0 ? (double)done / dt : 0.0;
    /* the total: tokens known, or as the announced size predicts */
    double total = (double)in->tokens;
    if (in->size > 0 && in->bytes > 0 && !in->last && in->size > in->bytes && in->tokens > 0)
        total = (double)in->tokens * (double)in->size / (double)(in->bytes - (int64_t)in->text.len);
    cJSON *o = web__event(w->id, "progress");
    cJSON_AddStringToObject(o, "session", in->client);
    cJSON_AddNumberToObject(o, "tokens", (double)done);
    cJSON_AddNumberToObject(o, "total", (double)in->tokens);
    cJSON_AddNumberToObject(o, "bytes", (double)in->bytes);
    if (in->size >= 0)
        cJSON_AddNumberToObject(o, "size", (double)in->size);
    else
        cJSON_AddNullToObject(o, "size");
    cJSON_AddBoolToObject(o, "last", in->last);
    cJSON_AddNumberToObject(o, "tok_s", tps);
    if (tps > 0)
        cJSON_AddNumberToObject(o, "eta_s",
                                total > (double)done ? (total - (double)done) / tps : 0);
    else
        cJSON_AddNullToObject(o, "eta_s");
    web__send(w->E->s, w->conn, o, w->msgpack);
}

/* Bytes of the document's text that went in: the spooled text less that of
 * the tokens taken and not fed (a cancel leaves those out). */
static int64_t ingest_keep(web_engine *E, wturn *w) {
    ingest *in = w->ing;
    if (in->doc_keep >= 0) return in->doc_keep;
    int64_t unfed = 0;
    const int32_t *ids = srv_stream_unfed(w->st, &unfed);
    int64_t unfed_len =
        unfed > 0 ? eng_tok_decode(eng_model_tokenizer(E->s->m), ids, unfed, 0, NULL, 0) : 0;
    int64_t keep = in->spool_bytes - (unfed_len > 0 ? unfed_len : 0);
    in->doc_keep = keep < 0 ? 0 : keep;
    return in->doc_keep;
}

/* The document's transcript entry: its text read back from the spool
 * (mapped until the answer), its name and size. */
static kds_status on_ingest_ended(void *user, srv_stream *st, sess_turn *turn, kds_err *e) {
    wturn *w = user;
    ingest *in = w->ing;
    size_t keep = (size_t)ingest_keep(w->E, w);
    if (keep > 0) {
        void *map = mmap(NULL, keep, PROT_READ, MAP_PRIVATE, fileno(in->spool), 0);
        if (map == MAP_FAILED)
            return kds_err_set(e, KDS_IO, "cannot read the document's text back: %s",
                               strerror(errno));
        in->map = map;
        turn->prompt = map;
    }
    turn->prompt_len = keep;
    turn->doc_name = in->name;
    turn->doc_bytes = (int64_t)keep;
    return KDS_OK;
}

/* The answer to an ingest, once saved (or not). */
static void on_ingest_done(void *user, srv_stream *st, const srv_stream_end *end) {
    wturn *w = user;
    web_engine *E = w->E;
    ingest *in = w->ing;
    const srv_stream_info *i = srv_stream_get(st);
    int64_t keep = ingest_keep(E, w);
    if (in->map) {
        munmap(in->map, (size_t)keep);
        in->map = NULL;
    }
    if (!i->gone) {
        srv_sess_info si;
        srv_sess_get(i->sess, &si);
        double prefill_s = (i->t_prefill_end ? i->t_prefill_end : i->t_end) - i->t_start;
        cJSON *o = web__event(w->id, "done");
        cJSON_AddStringToObject(o, "reason", end->save_rc == KDS_OK ? end->reason : "error");
        cJSON_AddStringToObject(o, "session", in->client);
        cJSON *d = cJSON_AddObjectToObject(o, "document");
        cJSON_AddStringToObject(d, "name", in->name);
        cJSON_AddNumberToObject(d, "bytes", (double)keep);
        cJSON_AddNumberToObject(d, "tokens", (double)i->doc_fed);
        cJSON_AddNumberToObject(o, "received", (double)in->bytes);
        cJSON_AddNumberToObject(o, "prompt_tokens", (double)i->fed);
        cJSON_AddNumberToObject(o, "context", (double)si.tokens);
        cJSON_AddNumberToObject(o, "snapshot", (double)end->snapshot);
        cJSON_AddNumberToObject(o, "prefill_ms", prefill_s * 1e3);
        cJSON_AddNumberToObject(o, "tok_s", si.prefill_tok_s);
        if (end->save_rc != KDS_OK || !strcmp(end->reason, "error")) done_error(E, o, end);
        web__send(E->s, w->conn, o, w->msgpack);
    }
    turn_over(E, w);
}

static const srv_stream_hooks INGEST_HOOKS = {
    .fed = on_ingest_fed, .ended = on_ingest_ended, .done = on_ingest_done};

/* A new ingest on session h (not started: its first chunk starts it); *sp
 * gets the stream's parameters. */
static wturn *ingest_create(web_engine *E, const web_req *r, const cJSON *id, srv_sess *h,
                            const char *name, int64_t size, srv_stream_params *sp, kds_err *e) {
    wturn *w = wturn_new(E, r, id);
    if (!w || !(w->ing = calloc(1, sizeof *w->ing))) goto nomem;
    ingest *in = w->ing;
    snprintf(in->name, sizeof in->name, "%s", name);
    snprintf(in->client, sizeof in->client, "%s", client_name(r, srv_sess_name(h)));
    in->size = size;
    in->doc_keep = -1;
    if (!(in->spool = tmpfile())) {
        kds_err_set(e, KDS_IO, "cannot create a temporary file for the document: %s",
                    strerror(errno));
        goto fail;
    }
    srv_sess_info si;
    srv_sess_get(h, &si);
    *sp = srv_stream_default_params();
    sp->kind = SRV_STREAM_DOCUMENT;
    sp->reply.chat = si.chat;
    sp->index_fork = true;
    sp->t_start = kds_now_s();
    sp->hooks = &INGEST_HOOKS;
    /* When every token of the session is known (the scheduler's session
     * hash, or an empty session's new one), the document's end goes into the
     * prefix index and an HTTP client that sends the same conversation
     * resumes there (advisory: without it, it replays). */
    if (!srv_sess_hashed(h) && si.tokens == 0) {
        char scope[WEB_TENANT_MAX + SESS_FP_LEN + 8];
        prefix_scope(E, r, scope, sizeof scope);
        if (sess_prefix_hasher_create(scope, &sp->hasher, NULL) != KDS_OK) sp->hasher = NULL;
    }
    in->hashed = (srv_sess_hashed(h) || sp->hasher) && !si.chat;
    if (si.chat) {
        /* the document is one user turn: its opener now, its text as it
         * comes, its end token (<|im_end|>, K3's <|end_of_msg|>) at the
         * end (the stream's close) */
        const eng_tokenizer *tok = eng_model_tokenizer(E->s->m);
        int32_t *ids = NULL;
        int64_t n = 0;
        if (eng_chat_turn(tok, true, si.tokens, NULL, "", 0, false, &ids, &n, e) != KDS_OK)
            goto fail;
        if (n < 1 || ids[n - 1] != eng_chat_end_token(tok)) {
            free(ids);
            kds_err_set(e, KDS_INTERNAL, "this chat format does not end a turn on its end token");
            goto fail;
        }
        in->ids = ids;
        in->ids_cap = n;
        sp->n_ids = n - 1;
    }
    return w;
nomem:
    kds_err_set(e, KDS_NOMEM, "out of memory");
fail:
    if (sp) {
        sess_prefix_hasher_free(sp->hasher);
        sp->hasher = NULL;
    }
    wturn_free(w);
    return NULL;
}

static void op_append(web_engine *E, const web_req *r, const cJSON *id) {
    char store[SESS_NAME_MAX + 1];
    if (!arg_session(E, r, id, "session", store)) return;
    const cJSON *nv = cJSON_GetObjectItemCaseSensitive(r->msg, "name");
    const cJSON *tv = cJSON_GetObjectItemCaseSensitive(r->msg, "text");
    const cJSON *dv = cJSON_GetObjectItemCaseSensitive(r->msg, "data");
    const cJSON *lv = cJSON_GetObjectItemCaseSensitive(r->msg, "last");
    bool begin = nv != NULL;
    if (begin && (!cJSON_IsString(nv) || !nv->valuestring[0] ||
                  strlen(nv->valuestring) > SESS_DOC_NAME_MAX)) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST, "'name' (the document's name) must be 1-%d bytes",
             SESS_DOC_NAME_MAX);
        return;
    }
    if ((tv != NULL) == (dv != NULL) || (tv && !cJSON_IsString(tv)) ||
        (dv && !cJSON_IsString(dv))) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST,
             "give exactly one of 'text' (a string) or 'data' (base64 bytes) for the chunk");
        return;
    }
    if (lv && !cJSON_IsBool(lv) && !cJSON_IsNull(lv)) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST, "'last' must be true or false");
        return;
    }
    double size = -1;
    if (!arg_num(E, r, id, "size", 0, 9007199254740991.0, &size)) return;
    bool last = cJSON_IsTrue(lv);
    wturn *g = ingest_of(E, store);
    const srv_stream_info *gi = g ? srv_stream_get(g->st) : NULL;
    if (begin) {
        srv_sess *h = srv_sched_find(E->S, store);
        if (h && srv_sess_stream(h)) {
            fail_busy(E, r, id, h, store, "");
            return;
        }
        if (srv_sched_running(E->S) >= E->s->p.max_generations) {
            fail(E, r, id, WEB_ERR_LIMIT,
                 "%d generations are running (--max-generations); try again later",
                 srv_sched_running(E->S));
            return;
        }
    } else if (!g || g->conn != r->conn || gi->cancelled || gi->gone || g->ing->last ||
               gi->phase == SRV_PHASE_PAUSE || gi->phase == SRV_PHASE_SAVE) {
        srv_sess *h = srv_sched_find(E->S, store);
        srv_stream *hs = h ? srv_sess_stream(h) : NULL;
        if (hs && !((wturn *)srv_stream_user(hs))->ing)
            fail(E, r, id, WEB_ERR_BUSY, "session '%s' is generating", client_name(r, store));
        else
            fail(E, r, id, WEB_ERR_NOT_FOUND,
                 "no document is being appended to session '%s' on this connection (the first "
                 "chunk gives 'name')",
                 client_name(r, store));
        return;
    }
    /* the chunk's bytes after what the last chunk left of a character */
    const char *src = tv ? tv->valuestring : dv->valuestring;
    size_t slen = strlen(src), carry = begin ? 0 : g->ing->n_carry, n = 0;
    unsigned char *buf = malloc(4 + (tv ? slen : slen / 4 * 3) + 1);
    if (!buf) {
        fail(E, r, id, WEB_ERR_INTERNAL, "out of memory");
        return;
    }
    if (carry) memcpy(buf, g->ing->carry, carry);
    if (tv) {
        memcpy(buf + carry, src, slen);
        n = slen;
    } else if (!web__b64_decode(src, slen, buf + carry, &n)) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST, "'data' is not base64 (RFC 4648, padded)");
        goto out;
    }
    size_t total = carry + n, tail = web__utf8_partial_tail(buf, total), bad = 0;
    if (!web__utf8_valid(buf, total - tail, &bad)) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST,
             "the document is not UTF-8: bad byte at offset %zu of this chunk; nothing taken",
             bad >= carry ? bad - carry : 0);
        goto out;
    }
    if (memchr(buf, 0, total - tail)) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST,
             "the document holds a NUL byte (offset %zu of this chunk); nothing taken",
             (size_t)((unsigned char *)memchr(buf, 0, total - tail) - buf) - carry);
        goto out;
    }
    if (last && tail) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST,
             "the document ends inside a UTF-8 character; nothing taken");
        goto out;
    }
    kds_err e = {0};
    srv_sess *h = NULL;
    srv_stream_params sp = {0};
    if (begin) {
        if (!(h = ensure_hot(E, r, id, store))) goto out;
        if (!(g = ingest_create(E, r, id, h, nv->valuestring, (int64_t)size, &sp, &e))) {
            fail(E, r, id, web__code_of(e.status), "%s", e.msg);
            goto out;
        }
    } else if (size >= 0) {
        g->ing->size = (int64_t)size;
    }
    if (ingest_take(E, g, h, &sp, buf, total - tail, last, &e) != KDS_OK) {
        fail(E, r, id, web__code_of(e.status), "%s", e.msg);
        if (begin) wturn_free(g);
        goto out;
    }
    ingest *in = g->ing;
    memcpy(in->carry, buf + total - tail, tail);
    in->n_carry = tail;
    in->bytes += (int64_t)n;
    cJSON *o = web__event(id, "result");
    cJSON_AddStringToObject(o, "session", client_name(r, store));
    cJSON_AddNumberToObject(o, "received", (double)in->bytes);
    cJSON_AddNumberToObject(o, "tokens", (double)in->tokens);
    cJSON_AddBoolToObject(o, "last", in->last);
    send_ev(E, r, o);
out:
    free(buf);
}
/* ------------------------------------------------------------------------ */
/* HTTP: the OpenAI-compatible endpoints (docs/http-api.md)                  */
/*
 * A request is checked and rendered to tokens (web_openai.c), then resumed
 * from the longest stored exact-token prefix of the same tenant and model
 * (the prefix index, sess.h) and run as one generation of the batching loop
 * like a WebSocket `generate`. Its turn is saved to the session it resumed
 * (a fork when that session moved on), or to a new one, and the turn end is
 * indexed so that the client's next request, which resends everything,
 * resumes there.
 */

/* Stored turn ends a plain prompt can resume from: within its last
 * PLAIN_WINDOW tokens (a client appends to its prompt), and after any stop
 * token anywhere. Chat requests resume after a stop token (every stored
 * chat turn ends on one) or at their end. */
#define PLAIN_WINDOW 65536
#define HTTP_DEFAULT_MAX_TOKENS 256

static const char *model_id(web_engine *E) {
    const char *dir = eng_model_dir(E->s->m), *base = strrchr(dir, '/');
    return base && base[1] ? base + 1 : dir;
}

static void http_fail(web_engine *E, const web_req *r, const web_oai_err *e) {
    web__http_error(E->s, r->conn, e->status,
                    e->status == 404   ? "invalid_request_error"
                    : e->status >= 500 ? "server_error"
                                       : "invalid_request_error",
                    e->param[0] ? e->param : NULL, e->code[0] ? e->code : NULL, "%s", e->msg);
}

static void http_models(web_engine *E, const web_req *r) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *a = cJSON_AddArrayToObject(o, "data");
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", model_id(E));
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)(E->s->started_us / 1000000));
    cJSON_AddStringToObject(m, "owned_by", "kdaserve");
    cJSON_AddItemToArray(a, m);
    web__http_json(E->s, r->conn, 200, o);
}

/* The scope of the prefix index: a tenant's sequences of this model. */
static void prefix_scope(web_engine *E, const web_req *r, char *out, size_t cap) {
    snprintf(out, cap, "%s|%s", r->auth ? r->tenant : "", eng_model_fingerprint(E->s->m));
}

/* Find the state to start from: the longest indexed prefix of q's tokens
 * that loads. Returns the session in memory to use (in memory already, or
 * one without a name at that snapshot, or an empty one) and *cached, the
 * tokens it holds; NULL when every session in memory is generating (*e
 * untouched) or on error (*e set). `target` gets the session the turn is
 * saved to when the request named none. */
static srv_sess *http_resume(web_engine *E, const web_req *r, const web_oai *q, bool named,
                             char target[SESS_NAME_MAX + 1], int64_t *cached, bool *fork_always,
                             kds_err *e) {
    *cached = 0;
    *fork_always = false;
    const eng_tokenizer *tok = eng_model_tokenizer(E->s->m);
    int64_t n = q->n_ids;
    /* candidate lengths, shortest first */
    size_t ncand = 0, cap = 0;
    for (int64_t p = 1; p <= n; p++)
        if (p == n || eng_tok_is_stop(tok, q->ids[p - 1]) || (!q->chat && p > n - PLAIN_WINDOW))
            cap++;
    unsigned char(*keys)[SESS_PREFIX_KEY_LEN] = NULL;
    int64_t *lens = NULL;
    sess_prefix_hasher *hs = NULL;
    char scope[WEB_TENANT_MAX + SESS_FP_LEN + 8];
    prefix_scope(E, r, scope, sizeof scope);
    srv_sess *h = NULL;
    if (!E->s->p.no_resume && cap > 0) {
        keys = malloc(cap * sizeof *keys);
        lens = malloc(cap * sizeof *lens);
        if (keys && lens && sess_prefix_hasher_create(scope, &hs, NULL) == KDS_OK) {
            for (int64_t p = 1; p <= n; p++) {
                sess_prefix_hasher_add(hs, &q->ids[p - 1], 1);
                if (p == n || eng_tok_is_stop(tok, q->ids[p - 1]) ||
                    (!q->chat && p > n - PLAIN_WINDOW)) {
                    sess_prefix_hasher_key(hs, keys[ncand]);
                    lens[ncand++] = p;
                }
            }
        }
    }
    size_t lim = ncand, found;
    sess_prefix_entry pe;
    while (lim > 0 && sess_prefix_find(E->s->st, (const unsigned char(*)[SESS_PREFIX_KEY_LEN])keys,
                                       lens, lim, &found, &pe, NULL) == KDS_OK) {
        lim = found;
        if (!owned(r, pe.session)) continue; /* the scope says so already; belt and braces */
        /* in memory, idle, at exactly that snapshot: no load at all */
        srv_sess *m = srv_sched_find(E->S, pe.session);
        srv_sess_info mi;
        if (m) srv_sess_get(m, &mi);
        if (m && !srv_sess_stream(m) && mi.base == pe.snapshot && mi.tokens == pe.tokens) {
            h = m;
        } else {
            kds_status rc = srv_sched_open_state(E->S, pe.snapshot, pe.tokens, &h, NULL);
            if (rc == KDS_BUSY) break;  /* no room */
            if (rc != KDS_OK) continue; /* pruned or damaged: try a shorter prefix */
        }
        *cached = pe.tokens;
        if (!named) {
            snprintf(target, SESS_NAME_MAX + 1, "%s", pe.session);
            *fork_always = pe.fork; /* a WebSocket conversation: branch off it */
        }
        break;
    }
    free(keys);
    free(lens);
    sess_prefix_hasher_free(hs);
    if (h) return h;
    /* nothing stored: a fresh sequence */
    srv_sess *slot = NULL;
    kds_err le = {0};
    kds_status rc = srv_sched_open_state(E->S, 0, 0, &slot, &le);
    if (rc == KDS_BUSY) return NULL;
    if (rc != KDS_OK) {
        *e = le;
        return NULL;
    }
    if (!named) {
        time_t now = time(NULL);
        struct tm tmv;
        gmtime_r(&now, &tmv);
        char stamp[32];
        strftime(stamp, sizeof stamp, "api-%Y%m%d-%H%M%S", &tmv);
        char client[SESS_NAME_MAX + 1];
        target[0] = '\0';
        for (int k = 1; k < 1000 && !target[0]; k++) {
            if (k == 1)
                snprintf(client, sizeof client, "%s", stamp);
            else
                snprintf(client, sizeof client, "%s-%d", stamp, k);
            sess_session_info tmp;
            if (store_name(r, client, target) && !srv_sched_find(E->S, target) &&
                sess_session_get(E->s->st, target, &tmp, NULL) == KDS_NOT_FOUND)
                break;
            target[0] = '\0';
        }
        if (!target[0]) {
            srv_sched_drop(E->S, slot);
            kds_err_set(e, KDS_EXISTS, "no free automatic session name");
            return NULL;
        }
    }
    return slot;
}

static cJSON *chunk_base(const wturn *g, const char *model) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", g->resp_id);
    cJSON_AddStringToObject(
        o, "object", g->route == WEB_ROUTE_CHAT ? "chat.completion.chunk" : "text_completion");
    cJSON_AddNumberToObject(o, "created", (double)g->created);
    cJSON_AddStringToObject(o, "model", model);
    return o;
}

/* A stream's chunk with an empty delta (chat) or no text yet. */
static cJSON *chunk_template(const wturn *g, const char *model, const char *finish) {
    cJSON *o = chunk_base(g, model);
    cJSON *a = cJSON_AddArrayToObject(o, "choices");
    cJSON *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", 0);
    if (g->route == WEB_ROUTE_CHAT) cJSON_AddObjectToObject(c, "delta");
    cJSON_AddItemToObject(c, "logprobs", cJSON_CreateNull());
    cJSON_AddItemToObject(c, "finish_reason",
                          finish ? cJSON_CreateString(finish) : cJSON_CreateNull());
    cJSON_AddItemToArray(a, c);
    return o;
}

static void send_sse(web_engine *E, const wturn *g, cJSON *o, bool last) {
    char *j = o ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    if (!j) return;
    kds_buf b = {0};
    if (kds_buf_printf(&b, NULL, "data: %s\n\n%s", j, last ? "data: [DONE]\n\n" : "") == KDS_OK)
        web__http_body(E->s, g->conn, kds_buf_str(&b), b.len, last);
    kds_buf_free(&b);
    free(j);
}

/* A long plain prompt's resume point (RESUME_POINT_MIN): the last prefill
 * slice boundary before the prompt's last two pre-tokens, which text after
 * the prompt may change; 0 = none. A string prompt's ids are exactly its
 * tokens (web__oai_parse: BOS only for an empty one), so the boundary is
 * counted from the end: the tokens of the last two pre-tokens, which start
 * on a boundary and so encode alone as inside. Advisory: anything odd, and
 * there is none. */
static int64_t http_point(web_engine *E, const web_oai *q, int64_t cached) {
    if (q->chat || q->n_ids - cached < RESUME_POINT_MIN || !q->prompt || !q->prompt_len) return 0;
    const eng_tokenizer *tok = eng_model_tokenizer(E->s->m);
    int64_t np = 0, tail = 0, point = 0;
    size_t *ends = NULL;
    if (eng_tok_split(tok, q->prompt, q->prompt_len, NULL, 0, &np, NULL) != KDS_OK || np < 3 ||
        !(ends = malloc((size_t)np * sizeof *ends)) ||
        eng_tok_split(tok, q->prompt, q->prompt_len, ends, np, &np, NULL) != KDS_OK ||
        eng_tok_encode_ex(tok, q->prompt + ends[np - 3], q->prompt_len - ends[np - 3], 0, NULL, 0,
                          &tail, NULL) != KDS_OK)
        goto out;
    int64_t slice = srv_sched_slice(E->S);
    point = cached + (q->n_ids - tail - cached) / slice * slice; /* prefill_step's slices */
    if (point <= cached || point >= q->n_ids) point = 0;
out:
    free(ends);
    return point;
}

/* The answer of an HTTP turn that ended (saved or not). */
static void on_http_done(void *user, srv_stream *st, const srv_stream_end *end) {
    wturn *g = user;
    web_engine *E = g->E;
    const srv_stream_info *i = srv_stream_get(st);
    if (i->gone) goto out;
    bool error = end->save_rc != KDS_OK || !strcmp(end->reason, "error");
    const char *why = end->save_rc != KDS_OK ? end->save_err->msg : end->error;
    const char *finish = !strcmp(end->reason, "stop") ? "stop" : "length";
    const char *model = model_id(E);
    srv_sess_info si;
    srv_sess_get(i->sess, &si);
    cJSON *usage = cJSON_CreateObject();
    cJSON_AddNumberToObject(usage, "prompt_tokens", (double)g->prompt_total);
    cJSON_AddNumberToObject(usage, "completion_tokens", (double)i->produced);
    cJSON_AddNumberToObject(usage, "total_tokens", (double)(g->prompt_total + i->produced));
    cJSON *ptd = cJSON_AddObjectToObject(usage, "prompt_tokens_details");
    cJSON_AddNumberToObject(ptd, "cached_tokens", (double)g->cached);
    /* kdaserve's own: where the turn went */
    cJSON *kx = cJSON_CreateObject();
    if (!error && si.name[0]) {
        const char *store = si.name, *dot = strchr(store, '.');
        cJSON_AddStringToObject(kx, "session", E->s->n_tenants > 0 && dot ? dot + 1 : store);
        cJSON_AddNumberToObject(kx, "snapshot", (double)end->snapshot);
    }
    cJSON_AddNumberToObject(kx, "context", (double)si.tokens);
    cJSON_AddNumberToObject(kx, "prefilled_tokens", (double)i->fed);
    if (g->sse) {
        if (error) {
            cJSON *o = cJSON_CreateObject(), *er = cJSON_AddObjectToObject(o, "error");
            cJSON_AddStringToObject(er, "message", why);
            cJSON_AddStringToObject(er, "type", "server_error");
            cJSON_AddItemToObject(er, "param", cJSON_CreateNull());
            cJSON_AddItemToObject(er, "code", cJSON_CreateNull());
            send_sse(E, g, o, true);
            cJSON_Delete(usage);
            cJSON_Delete(kx);
            goto out;
        }
        cJSON *last = chunk_template(g, model, finish);
        cJSON_AddItemToObject(last, "kdaserve", kx);
        if (g->include_usage) {
            send_sse(E, g, last, false);
            cJSON *u = chunk_base(g, model);
            cJSON_AddArrayToObject(u, "choices");
            cJSON_AddItemToObject(u, "usage", usage);
            send_sse(E, g, u, true);
        } else {
            cJSON_Delete(usage);
            send_sse(E, g, last, true);
        }
        goto out;
    }
    if (error) {
        cJSON_Delete(usage);
        cJSON_Delete(kx);
        web__http_error(E->s, g->conn, 500, "server_error", NULL, NULL, "%s", why);
        goto out;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", g->resp_id);
    cJSON_AddStringToObject(o, "object",
                            g->route == WEB_ROUTE_CHAT ? "chat.completion" : "text_completion");
    cJSON_AddNumberToObject(o, "created", (double)g->created);
    cJSON_AddStringToObject(o, "model", model);
    cJSON *a = cJSON_AddArrayToObject(o, "choices"), *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", 0);
    if (g->route == WEB_ROUTE_CHAT) {
        cJSON *m = cJSON_AddObjectToObject(c, "message");
        cJSON_AddStringToObject(m, "role", "assistant");
        cJSON_AddStringToObject(m, "content", srv_stream_reply(st, NULL));
        cJSON_AddItemToObject(m, "refusal", cJSON_CreateNull());
    } else {
        cJSON_AddStringToObject(c, "text", srv_stream_reply(st, NULL));
    }
    cJSON_AddItemToObject(c, "logprobs", cJSON_CreateNull());
    cJSON_AddStringToObject(c, "finish_reason", finish);
    cJSON_AddItemToArray(a, c);
    cJSON_AddItemToObject(o, "usage", usage);
    cJSON_AddItemToObject(o, "kdaserve", kx);
    web__http_json(E->s, g->conn, 200, o);
out:
    turn_over(E, g);
}

static const srv_stream_hooks HTTP_HOOKS = {
    .text = on_text, .reader = on_reader, .done = on_http_done};

static void http_generate(web_engine *E, const web_req *r) {
    web_oai q;
    web_oai_err oe;
    const eng_tokenizer *tok = eng_model_tokenizer(E->s->m);
    if (!web__oai_parse(r->msg, r->route, tok, model_id(E), &q, &oe)) {
        http_fail(E, r, &oe);
        return;
    }
    wturn *g = NULL;
    srv_sess *h = NULL;
    srv_stream_params p = srv_stream_default_params();
    kds_err e = {0};
    char target[SESS_NAME_MAX + 1] = "";
    const char *named = q.session[0] ? q.session : r->session_hdr[0] ? r->session_hdr : NULL;
    if (named && !store_name(r, named, target)) {
        oe = (web_oai_err){.status = 400};
        snprintf(oe.param, sizeof oe.param, "session");
        snprintf(oe.msg, sizeof oe.msg, "'session' is too long for this tenant");
        http_fail(E, r, &oe);
        goto out;
    }
    if (srv_sched_running(E->S) >= E->s->p.max_generations) {
        web__http_error(E->s, r->conn, 429, "rate_limit_exceeded", NULL, "rate_limit_exceeded",
                        "%d generations are running (--max-generations); retry later",
                        srv_sched_running(E->S));
        goto out;
    }
    int64_t cached = 0;
    bool fork_always = false;
    h = http_resume(E, r, &q, named != NULL, target, &cached, &fork_always, &e);
    if (!h) {
        if (e.status)
            web__http_error(E->s, r->conn, 500, "server_error", NULL, NULL, "%s", e.msg);
        else
            web__http_error(
                E->s, r->conn, 429, "rate_limit_exceeded", NULL, "rate_limit_exceeded",
                "all %d sessions in memory are generating (--max-sessions); retry later",
                E->s->p.max_sessions);
        goto out;
    }
    p.t_start = kds_now_s();
    if (!(g = wturn_new(E, r, NULL))) goto nomem;
    g->sse = q.stream;
    g->include_usage = q.include_usage;
    g->created = web__now_us() / 1000000;
    snprintf(g->resp_id, sizeof g->resp_id, "%s-%016" PRIx64,
             r->route == WEB_ROUTE_CHAT ? "chatcmpl" : "cmpl",
             ((uint64_t)web__now_us() << 16) ^ g->serial);
    g->cached = cached;
    g->prompt_total = q.n_ids;
    char scope[WEB_TENANT_MAX + SESS_FP_LEN + 8];
    prefix_scope(E, r, scope, sizeof scope);
    /* the session's tokens are the request's up to the state resumed; the
     * scheduler hashes the rest as it feeds them, so the resume point and
     * the turn's end are indexed under what went in */
    if (sess_prefix_hasher_create(scope, &p.hasher, &e) != KDS_OK) goto fail;
    sess_prefix_hasher_add(p.hasher, q.ids, cached);
    int64_t point = http_point(E, &q, cached);
    if (point) p.point_at = point - cached; /* the stream counts from the resumed state */
    /* feed only what the stored state lacks */
    p.ids = q.ids + cached;
    p.n_ids = q.n_ids - cached;
    p.prompt = q.prompt;
    p.prompt_len = q.prompt_len;
    int64_t mt = q.max_tokens >= 0 ? q.max_tokens : HTTP_DEFAULT_MAX_TOKENS;
    p.reply.max_tokens = mt > E->s->p.max_tokens ? E->s->p.max_tokens : mt;
    p.reply.ignore_eos = q.ignore_eos;
    p.reply.chat = q.chat;
    p.reply.end_on_im_end = r->route == WEB_ROUTE_CHAT;
    for (int i = 0; i < q.n_stop; i++)
        p.reply.stop[i] = q.stop[i];
    p.reply.n_stop = q.n_stop;
    p.sampler = q.sp;
    p.reseed = q.has_seed;
    p.seed = q.seed;
    /* a stateless client's turn continues the session it resumed, or forks
     * it when that session moved on since (the branch of an edited
     * conversation), or when it is a WebSocket conversation's */
    p.save_as = target;
    p.conflict = fork_always ? SESS_CONFLICT_FORK_ALWAYS : SESS_CONFLICT_FORK;
    p.hooks = &HTTP_HOOKS;
    kds_status rc = turn_start(E, g, h, &p, &e);
    p.hasher = NULL; /* the stream's, started or not */
    if (rc != KDS_OK) goto fail;
    if (g->sse) {
        web__http_head(E->s, r->conn, 200, "text/event-stream", -1);
        web__http_stream_template(E->s, r->conn, chunk_template(g, model_id(E), NULL),
                                  g->route == WEB_ROUTE_CHAT);
        if (g->route == WEB_ROUTE_CHAT) {
            /* OpenAI's first chunk names the role */
            cJSON *c = chunk_template(g, model_id(E), NULL);
            cJSON *d = cJSON_GetObjectItemCaseSensitive(
                cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(c, "choices"), 0), "delta");
            cJSON_AddStringToObject(d, "role", "assistant");
            cJSON_AddStringToObject(d, "content", "");
            send_sse(E, g, c, false);
        }
    }
    web__oai_free(&q);
    return;
nomem:
    kds_err_set(&e, KDS_NOMEM, "out of memory");
fail:
    web__http_error(E->s, r->conn, 500, "server_error", NULL, NULL, "%s", e.msg);
    sess_prefix_hasher_free(p.hasher);
    if (!srv_sess_name(h)[0]) srv_sched_drop(E->S, h);
    wturn_free(g);
out:
    web__oai_free(&q);
}

static void http_handle(web_engine *E, web_req *r) {
    if (E->stopping) {
        web__http_error(E->s, r->conn, 503, "server_error", NULL, NULL,
                        "the server is shutting down");
        return;
    }
    if (r->route == WEB_ROUTE_MODELS)
        http_models(E, r);
    else
        http_generate(E, r);
}
typedef void (*op_fn)(web_engine *E, const web_req *r, const cJSON *id);
typedef struct op_entry {
    const char *name;
    op_fn fn;
} op_entry;

static const op_entry OPS[] = {
    {"info", op_info},       {"list", op_list},         {"create", op_create},
    {"open", op_open},       {"fork", op_fork},         {"rename", op_rename},
    {"delete", op_delete},   {"history", op_history},   {"snapshots", op_snapshots},
    {"restore", op_restore}, {"generate", op_generate}, {"cancel", op_cancel},
    {"stats", op_stats},     {"append", op_append},
};

static void handle(web_engine *E, web_req *r) {
    if (r->route != WEB_ROUTE_WS) {
        http_handle(E, r);
        return;
    }
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(r->msg, "id");
    const char *op = get_str(r->msg, "op");
    if (E->stopping) {
        fail(E, r, id, WEB_ERR_INTERNAL, "the server is shutting down");
        return;
    }
    for (size_t i = 0; i < sizeof OPS / sizeof OPS[0]; i++)
        if (!strcmp(op, OPS[i].name)) {
            OPS[i].fn(E, r, id);
            return;
        }
    fail(E, r, id, WEB_ERR_UNKNOWN_OP,
         "unknown op '%.*s' (info, list, create, open, fork, rename, delete, history, snapshots, "
         "restore, generate, append, cancel, stats, auth, ping)",
         (int)web__utf8_prefix(op, 64), op);
}

/* ------------------------------------------------------------------------ */
/* The scheduler's hooks: wake-ups, log lines, metrics                       */

/* Saver thread: a save is ready (the engine thread waits on `wake`). */
static void on_wake(void *user) {
    web_engine *E = user;
    pthread_mutex_lock(&E->s->lock);
    pthread_cond_signal(&E->s->wake);
    pthread_mutex_unlock(&E->s->lock);
}

static void on_log(void *user, const char *line) {
    web_engine *E = user;
    if (!E->s->p.quiet) fprintf(stderr, "kdaserve serve: %s\n", line);
}

static void on_loaded(void *user, double ms) {
    web_engine *E = user;
    web__hist_add(&E->s->metrics.restore_ms, ms);
}

static void on_saved(void *user, double ms) {
    web_engine *E = user;
    web__hist_add(&E->s->metrics.save_ms, ms);
}

static void on_sessions(void *user, int n) {
    web_engine *E = user;
    atomic_store(&E->s->metrics.sessions_hot, n);
}

static void on_prefilled(void *user, int64_t n) {
    web_engine *E = user;
    atomic_fetch_add(&E->s->metrics.tokens_prefilled, (uint64_t)n);
}

static void on_decoded(void *user, int rows) {
    web_engine *E = user;
    atomic_fetch_add(&E->s->metrics.decode_steps, 1);
    atomic_fetch_add(&E->s->metrics.decode_rows, (uint64_t)rows);
    atomic_fetch_add(&E->s->metrics.tokens_generated, (uint64_t)rows);
    E->rate_tokens += (uint64_t)rows;
}

static void update_rate(web_engine *E) {
    double now = kds_now_s();
    if (!E->rate_t0) E->rate_t0 = now;
    double dt = now - E->rate_t0;
    if (dt < 2.0) return;
    web__rate_set(&E->s->metrics, (double)E->rate_tokens / dt);
    E->rate_t0 = now;
    E->rate_tokens = 0;
}
/* ------------------------------------------------------------------------ */
/* Requests                                                                  */

/* A request of a connection is answered (or dropped): it no longer counts
 * against the connection's and the server's bounds. */
static void req_done(web_engine *E, web_req *r) {
    web_server *s = E->s;
    pthread_mutex_lock(&s->lock);
    s->n_queued--;
    web_conn *c = web__conn_find(s, r->conn);
    if (c) c->queued--;
    pthread_mutex_unlock(&s->lock);
    cJSON_Delete(r->msg);
    free(r);
}

static void drop_queue(web_engine *E, conn_queue **pp) {
    conn_queue *q = *pp;
    *pp = q->next;
    while (q->head) {
        web_req *r = q->head;
        q->head = r->next;
        req_done(E, r);
    }
    free(q);
}

/* A request taken from the shared list: queued under its connection, or
 * (closed, stop) acted on at once. */
static void take(web_engine *E, web_req *r) {
    if (r->kind == WEB_REQ_STOP) {
        E->stopping = true;
        free(r);
        return;
    }
    if (r->kind == WEB_REQ_CLOSED) {
        /* nobody reads the answers: drop what still waits */
        for (srv_stream *st = srv_sched_next(E->S, NULL); st; st = srv_sched_next(E->S, st))
            if (((wturn *)srv_stream_user(st))->conn == r->conn)
                srv_stream_cancel(st, SRV_CANCEL_GONE);
        for (conn_queue **pp = &E->queues; *pp; pp = &(*pp)->next)
            if ((*pp)->conn == r->conn) {
                drop_queue(E, pp);
                break;
            }
        free(r);
        return;
    }
    conn_queue **pp = &E->queues;
    while (*pp && (*pp)->conn != r->conn)
        pp = &(*pp)->next;
    if (!*pp && !(*pp = calloc(1, sizeof **pp))) {
        fail(E, r, cJSON_GetObjectItemCaseSensitive(r->msg, "id"), WEB_ERR_INTERNAL,
             "out of memory");
        req_done(E, r);
        return;
    }
    conn_queue *q = *pp;
    q->conn = r->conn;
    r->next = NULL;
    if (q->tail)
        q->tail->next = r;
    else
        q->head = r;
    q->tail = r;
}

/* Rounds of one request per connection, until none waits or the turn's
 * budget is spent. While stopping, everything waiting is refused at once. */
/* A connection whose next request waits (deferred: a chunk of an ingest
 * whose backlog is full) still gets its later `cancel` requests answered. */
static void cancels_ahead(web_engine *E, conn_queue *q) {
    web_req **pp = &q->head->next;
    while (*pp) {
        web_req *r = *pp;
        const char *op = get_str(r->msg, "op");
        if (op && !strcmp(op, "cancel")) {
            *pp = r->next;
            handle(E, r);
            req_done(E, r);
        } else {
            pp = &r->next;
        }
    }
    q->tail = q->head; /* q->head stays, so the list is never empty */
    while (q->tail->next)
        q->tail = q->tail->next;
}

static void answer_requests(web_engine *E) {
    double t0 = kds_now_s();
    while (E->queues) {
        bool any = false;
        for (conn_queue **pp = &E->queues; *pp;) {
            conn_queue *q = *pp;
            web_req *r = q->head;
            if (deferred(E, r)) {
                cancels_ahead(E, q);
                pp = &q->next;
                continue;
            }
            any = true;
            q->head = r->next;
            if (!q->head) q->tail = NULL;
            handle(E, r);
            req_done(E, r);
            if (!q->head) {
                *pp = q->next;
                free(q);
            } else {
                pp = &q->next;
            }
        }
        if (!any || (!E->stopping && kds_now_s() - t0 > REQUEST_BUDGET_S)) break;
    }
}

static void *engine_main(void *arg) {
    web_server *s = arg;
    web_engine *E = s->eng;
    for (;;) {
        pthread_mutex_lock(&s->lock);
        web_req *list = s->req_head;
        s->req_head = s->req_tail = NULL;
        pthread_mutex_unlock(&s->lock);
        srv_sched_collect(E->S); /* first: their sessions are free for what comes */
        while (list) {
            web_req *r = list;
            list = r->next;
            take(E, r);
        }
        answer_requests(E);
        if (E->stopping)
            for (srv_stream *st = srv_sched_next(E->S, NULL); st; st = srv_sched_next(E->S, st))
                srv_stream_cancel(st, SRV_CANCEL_ASKED);
        srv_sched_step(E->S);
        update_rate(E);
        if (E->stopping && !srv_sched_running(E->S) && !srv_sched_saving(E->S)) break;
        pthread_mutex_lock(&s->lock);
        /* (the saver signals `wake` when it hands a save back) */
        bool idle =
            !s->req_head && !srv_sched_running(E->S) && !E->queues && !srv_sched_collectable(E->S);
        if (idle) {
            pthread_cond_wait(&s->wake, &s->lock);
        } else if (!s->req_head && !E->queues) {
            pthread_mutex_unlock(&s->lock);
            bool run = srv_sched_runnable(E->S);
            pthread_mutex_lock(&s->lock);
            if (!run && !s->req_head && !srv_sched_collectable(E->S)) {
                /* every reader is behind: look again shortly */
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                ts.tv_nsec += 5 * 1000 * 1000;
                if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
                pthread_cond_timedwait(&s->wake, &s->lock, &ts);
            }
        }
        pthread_mutex_unlock(&s->lock);
    }
    return NULL;
}

/* Append r to the shared list; the lock is held. */
static void append_locked(web_server *s, web_req *r) {
    r->next = NULL;
    if (s->req_tail)
        s->req_tail->next = r;
    else
        s->req_head = r;
    s->req_tail = r;
    pthread_cond_signal(&s->wake);
}

void web__submit(web_server *s, web_req *r) {
    pthread_mutex_lock(&s->lock);
    append_locked(s, r);
    pthread_mutex_unlock(&s->lock);
}

bool web__submit_op(web_server *s, web_conn *c, web_req *r) {
    pthread_mutex_lock(&s->lock);
    bool full =
        c->queued >= s->p.max_queue || (c->queued > 0 && s->n_queued >= s->p.max_queue_total);
    if (!full) {
        c->queued++;
        s->n_queued++;
        append_locked(s, r);
    }
    pthread_mutex_unlock(&s->lock);
    return !full;
}

void web__submit_closed(web_server *s, uint64_t conn) {
    web_req *r = calloc(1, sizeof *r);
    web_req *gone = NULL;
    pthread_mutex_lock(&s->lock);
    /* the requests the engine has not taken yet go now, under the same lock
     * that queues the marker, so none of them can come after it */
    web_req **pp = &s->req_head;
    s->req_tail = NULL;
    while (*pp) {
        web_req *q = *pp;
        if (q->kind == WEB_REQ_OP && q->conn == conn) {
            *pp = q->next;
            q->next = gone;
            gone = q;
            s->n_queued--;
        } else {
            s->req_tail = q;
            pp = &q->next;
        }
    }
    if (r) { /* without it (out of memory) what the engine took still runs, unread */
        r->kind = WEB_REQ_CLOSED;
        r->conn = conn;
        append_locked(s, r);
    }
    pthread_mutex_unlock(&s->lock);
    while (gone) {
        web_req *q = gone;
        gone = q->next;
        cJSON_Delete(q->msg);
        free(q);
    }
}

/* The saver thread ends once its queue is empty (the engine thread has
 * answered every save before it stops). */

kds_status web__engine_start(web_server *s, kds_err *err) {
    web_engine *E = calloc(1, sizeof *E);
    if (!E) return kds_err_set(err, KDS_NOMEM, "out of memory");
    E->s = s;
    E->model_chat = eng_model_chat_format(s->m);
    srv_sched_params sp = srv_sched_default_params();
    sp.max_sessions = s->p.max_sessions;
    sp.max_streams = s->p.max_generations;
    sp.ctx = s->p.ctx;
    sp.hooks = (srv_sched_hooks){.user = E,
                                 .wake = on_wake,
                                 .log = on_log,
                                 .loaded = on_loaded,
                                 .saved = on_saved,
                                 .sessions = on_sessions,
                                 .prefilled = on_prefilled,
                                 .decoded = on_decoded};
    kds_status rc = srv_sched_create(&sp, s->m, s->st, &E->S, err);
    if (rc != KDS_OK) {
        free(E);
        return rc;
    }
    s->eng = E;
    /* the engine thread takes no SIGINT/SIGTERM (the caller handles them) */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int prc = pthread_create(&s->engine_thread, NULL, engine_main, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (prc != 0) {
        s->eng = NULL;
        srv_sched_free(E->S);
        free(E);
        return kds_err_set(err, KDS_INTERNAL, "cannot start the engine thread");
    }
    s->engine_started = true;
    return KDS_OK;
}

void web__engine_stop(web_server *s) {
    if (!s->engine_started) return;
    web_req *r = calloc(1, sizeof *r);
    if (r) {
        r->kind = WEB_REQ_STOP;
        web__submit(s, r);
    } else {
        pthread_mutex_lock(&s->lock);
        s->eng->stopping = true; /* read by the engine thread after its next wake */
        pthread_cond_signal(&s->wake);
        pthread_mutex_unlock(&s->lock);
    }
    pthread_join(s->engine_thread, NULL);
    s->engine_started = false;
    web_engine *E = s->eng;
    /* every turn was answered (stopping cancels them and waits for their
     * saves): the saver stops, the sessions in memory go */
    srv_sched_free(E->S);
    /* none are left (stopping answers all that wait), but free what is */
    while (E->queues) drop_queue(E, &E->queues);
    free(E);
    s->eng = NULL;
}
