/*
 * web_engine.c - the engine thread: sessions in memory, requests, and the
 * continuous-batching generation loop.
 *
 * Every turn of the loop:
 *   1. take every queued request into its connection's queue, and answer
 *      them in rounds of one request per connection (store operations run
 *      here, so the store and the sessions in memory have one owner); a
 *      connection with many requests waiting delays the others by one of
 *      its requests per round, not by all of them. Rounds go on while
 *      requests wait, for at most REQUEST_BUDGET_S of the turn, so that
 *      generations still advance every few milliseconds. A connection that
 *      closed has its waiting requests dropped unanswered;
 *   2. advance prefills: each generation still feeding its prompt gets one
 *      slice of at most max_batch tokens (so a long prompt never stalls the
 *      other streams for more than one slice);
 *   3. one decode step for every generation that is decoding and whose
 *      connection is not behind on reading (backpressure is per
 *      connection): sample each next token from the sequence's logits, then
 *      feed all of them in ONE forward pass (eng_decode_batch);
 *   4. hand the generations that ended to the saver thread, which saves
 *      each session (a new snapshot as its head, with the turn in its
 *      transcript; a durable LMDB commit), and answer (`done`, the HTTP
 *      response) those whose save is over. A save never stalls the other
 *      streams: the session stays busy (its `gen` set) until it is saved,
 *      and its state is only read meanwhile.
 *
 * A generation ends on a stop token (kept in the context, as in the REPL),
 * at max_tokens, or on cancel / disconnect; in the chat format a reply cut
 * short is closed with <|im_end|> so the context always ends on a finished
 * turn. Sessions in memory are clean between turns (saved after every turn),
 * so evicting the least recently used idle one costs nothing.
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

#define LAST_TURNS 4
#define LINEAGE_MAX 100000
/* Time a turn of the engine loop spends answering requests before it
 * advances the generations again (a request that has started finishes). */
#define REQUEST_BUDGET_S 0.005

typedef struct gen gen;

typedef struct hot {
    bool used;
    char name[SESS_NAME_MAX + 1]; /* store name */
    eng_seq *seq;
    uint64_t base;                /* head snapshot the sequence equals */
    bool chat;
    bool has_sampler;             /* the session's recorded sampler settings */
    eng_sampler_params sampler;   /* (sess_session_info.sampler), kept current */
    double last_used;
    gen *gen;                     /* the generation running on it */
    double last_resume_ms, last_prefill_tok_s, last_decode_tok_s;
    /* The session's whole token sequence, when this server saw every token
     * of it (created here, or empty when loaded): its WebSocket turns' ends
     * then go into the prefix index too (as `fork` entries: a stateless
     * client that resumes one branches off, docs/http-api.md). A running
     * turn holds it (gen.hasher) and hands it back while it is whole. */
    sess_prefix_hasher *hash;
} hot;

/* G_WAIT: an ingest that has fed every token it has and waits for the next chunk. */
/* G_SAVE: its session being saved by the saver thread: over and out of the
 * batching loop, or (point_saving) paused at a resume point, to go on after. */
typedef enum gen_phase { G_PREFILL, G_DECODE, G_CLOSE, G_FINISH, G_WAIT, G_SAVE } gen_phase;

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
 * so the tokens are those of the whole text) and prefilled by the loop in
 * slices aligned as a generate's prompt is. The text tokenized so far goes
 * to an unlinked temporary file, read back (mapped) for the transcript at
 * the end: memory stays bounded whatever the document's size. */
typedef struct ingest {
    char name[SESS_DOC_NAME_MAX + 1];
    char client[SESS_NAME_MAX + 1]; /* the session as the client names it */
    int64_t size;                   /* bytes the client announced, -1 = not said */
    int64_t bytes;                  /* bytes received */
    unsigned char carry[4];         /* the start of a character a chunk's end cut */
    size_t n_carry;
    kds_buf text;                  /* received text not tokenized yet */
    int64_t ids_cap;               /* capacity of the gen's ids (the token buffer) */
    int64_t prefix_n, prefix_left; /* chat: opener tokens (not text); not fed yet */
    int64_t tokens;                /* text tokens known so far */
    int64_t fed_total;             /* tokens fed (opener included) */
    bool last;                     /* the last chunk came */
    FILE *spool;                   /* the text tokenized so far */
    bool broken;                   /* spool unusable after a failed write */
    int64_t spool_bytes;
    double t_progress;
} ingest;

struct gen {
    gen *next;
    uint64_t serial, conn;
    cJSON *id;
    bool msgpack;
    hot *h;
    int32_t *ids;
    int64_t n_ids, fed;
    char *prompt;                 /* the request's text, for the transcript */
    size_t prompt_len;
    int64_t max_tokens, produced, context0;
    eng_sampler_params sp;
    srv_reply *rp; /* the reply: text, stop tokens and strings (core/srv.h) */
    gen_phase phase;
    const char *reason;           /* why it ends (set with G_CLOSE / G_FINISH) */
    bool cancel, gone;
    bool ignore_eos;              /* stop tokens do not end the reply */
    int32_t feed;                 /* token fed in this step, -1 = none */
    int sample_row;               /* this step's row of the batched sample, -1 = none */
    gen_phase after;              /* phase after this step's feed */
    char error[512];              /* reason "error" */
    double t_arrive, t_start, t_first, t_prefill_end, t_decode0, t_end;
    /* One turn, whichever front end asked (WebSocket op or HTTP endpoint):
     * the turn logic below (feed, sample, stop, close, save) is the same. */
    web_route route; /* WEB_ROUTE_WS, or the HTTP endpoint answered */
    /* HTTP */
    bool sse, include_usage; /* an HTTP stream (server-sent events) */
    char resp_id[48];
    int64_t created;                 /* unix seconds */
    int64_t cached;                  /* prompt tokens that came from a stored state */
    int64_t prompt_total;            /* the request's tokens (usage.prompt_tokens) */
    char save_as[SESS_NAME_MAX + 1]; /* HTTP: the session the turn is saved to */
    bool fork_always;                /* HTTP: save_as is a stateful client's session: branch
                                        off it (SESS_CONFLICT_FORK_ALWAYS), never add to it */
    sess_prefix_hasher *hasher;      /* HTTP: the whole token sequence, to index the turn end */
    ingest *ing;                     /* an ingest (op append) rather than a reply */
    /* The save (G_SAVE): asked by the engine thread, done by the saver
     * thread, which writes only these fields and reads the gen and its
     * session (h->seq, name, base, mode), which nobody changes meanwhile. */
    gen *save_next;                   /* the saver's queue, then the done list */
    int64_t point_at;                 /* save a resume point when `fed` reaches it; 0 = none */
    bool point_saving;                /* this G_SAVE is that resume point: the turn goes on */
    unsigned char point_key[SESS_PREFIX_KEY_LEN]; /* HTTP: the key of the tokens up to it */
    bool save_failed;                 /* the engine could not hand the state over */
    kds_status save_rc;
    kds_err save_err;
    uint64_t save_snap;               /* the new head (h->base when nothing was saved) */
    char saved_to[SESS_NAME_MAX + 1]; /* HTTP: the session it went to (a fork, maybe) */
    double save_ms;
    int64_t doc_keep;                 /* ingest: bytes of the document's text kept */
};

/* The requests of one connection that the engine took and has not answered
 * yet, oldest first. */
typedef struct conn_queue {
    struct conn_queue *next;
    uint64_t conn;
    web_req *head, *tail;
} conn_queue;

struct web_engine {
    web_server *s;
    conn_queue *queues;           /* connections with requests waiting, in turn order */
    eng_ctx *c;
    hot *hots;
    int n_hot_max;
    gen *gens;
    int n_gens;
    uint64_t next_serial;
    bool model_chat;
    int32_t im_end;
    bool stopping;
    eng_seq **b_seqs;
    int32_t *b_ids;
    gen **b_gens;
    eng_sampler_params *b_params; /* each sampled row's own settings */
    int32_t *b_sampled;
    double rate_t0;
    uint64_t rate_tokens;
    /* The saver thread: gens in G_SAVE, oldest first, under save_lock;
     * saved ones come back on `saved` under s->lock (so the engine thread's
     * wait on s->wake sees them). */
    pthread_t saver;
    bool saver_started;
    pthread_mutex_t save_lock;
    pthread_cond_t save_wake;
    gen *save_head, *save_tail;
    bool save_stop;
    gen *saved;   /* under s->lock */
    int n_saving; /* engine thread: handed over and not answered yet */
};

/* ------------------------------------------------------------------------ */
/* Helpers                                                                   */

static void prefix_scope(web_engine *E, const web_req *r, char *out, size_t cap);
static void index_key(web_engine *E, const unsigned char key[SESS_PREFIX_KEY_LEN], uint64_t snap,
                      int64_t tokens, const char *session, bool fork);

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

static hot *find_hot(web_engine *E, const char *store) {
    for (int i = 0; i < E->n_hot_max; i++)
        if (E->hots[i].used && !strcmp(E->hots[i].name, store)) return &E->hots[i];
    return NULL;
}

static void drop_hot(web_engine *E, hot *h) {
    eng_seq_free(h->seq);
    sess_prefix_hasher_free(h->hash);
    memset(h, 0, sizeof *h);
    atomic_fetch_sub(&E->s->metrics.sessions_hot, 1);
}

/* A free slot, evicting the least recently used idle session (it is saved
 * already). NULL when every slot is generating. */
static hot *free_slot(web_engine *E) {
    hot *lru = NULL;
    for (int i = 0; i < E->n_hot_max; i++) {
        hot *h = &E->hots[i];
        if (!h->used) return h;
        if (!h->gen && (!lru || h->last_used < lru->last_used)) lru = h;
    }
    if (lru) drop_hot(E, lru);
    return lru;
}

/* The session's mode by the rule the REPL uses too (sess_session_chat_mode);
 * the model's default where nothing tells. A mode this version does not
 * know (a newer writer) continues as the model's default. */
static bool mode_is_chat(web_engine *E, const sess_session_info *info) {
    bool chat;
    (void)sess_session_chat_mode(E->s->st, info, eng_model_tokenizer(E->s->m), E->model_chat, &chat,
                                 NULL);
    return chat;
}

static const char *state_of(web_engine *E, const char *store) {
    hot *h = find_hot(E, store);
    return !h ? "cold" : h->gen ? "generating" : "hot";
}

/* The session in memory, loaded from the store when cold. */
static hot *ensure_hot(web_engine *E, const web_req *r, const cJSON *id, const char *store) {
    hot *h = find_hot(E, store);
    if (h) {
        h->last_used = web__now_s();
        return h;
    }
    sess_session_info info;
    if (!get_session(E, r, id, store, &info)) return NULL;
    if (!(h = free_slot(E))) {
        fail(E, r, id, WEB_ERR_LIMIT,
             "all %d sessions in memory are generating (--max-sessions); try again later",
             E->n_hot_max);
        return NULL;
    }
    kds_err e = {0};
    eng_seq *seq = NULL;
    if (eng_seq_create(E->s->m, 0, &seq, &e) != KDS_OK) {
        fail_err(E, r, id, &e);
        return NULL;
    }
    double t0 = web__now_s();
    if (sess_load(E->s->st, info.head, E->s->m, seq, NULL, &e) != KDS_OK) {
        eng_seq_free(seq);
        fail(E, r, id, web__code_of(e.status), "cannot open session '%s': %s",
             client_name(r, store), e.msg);
        return NULL;
    }
    double ms = (web__now_s() - t0) * 1e3;
    web__hist_add(&E->s->metrics.restore_ms, ms);
    memset(h, 0, sizeof *h);
    h->used = true;
    snprintf(h->name, sizeof h->name, "%s", store);
    h->seq = seq;
    h->base = info.head;
    h->chat = mode_is_chat(E, &info);
    h->has_sampler = info.has_sampler;
    h->sampler = info.sampler;
    h->last_used = web__now_s();
    h->last_resume_ms = ms;
    if (eng_seq_pos(seq) == 0) { /* every token to come passes through here */
        char scope[WEB_TENANT_MAX + SESS_FP_LEN + 8];
        prefix_scope(E, r, scope, sizeof scope);
        if (sess_prefix_hasher_create(scope, &h->hash, NULL) != KDS_OK) h->hash = NULL;
    }
    atomic_fetch_add(&E->s->metrics.sessions_hot, 1);
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
    hot *h = find_hot(E, s->name);
    cJSON_AddStringToObject(o, "mode", (h ? h->chat : mode_is_chat(E, s)) ? "chat" : "plain");
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
static void fail_busy(web_engine *E, const web_req *r, const cJSON *id, const hot *h,
                      const char *store, const char *then) {
    const gen *g = h->gen;
    if (g->phase == G_SAVE && !g->point_saving)
        fail(E, r, id, WEB_ERR_BUSY, "session '%s' is saving its last turn; try again in a moment",
             client_name(r, store));
    else
        fail(E, r, id, WEB_ERR_BUSY, "session '%s' is %s%s", client_name(r, store),
             g->ing ? "taking a document" : "generating", then);
}

/* An existing session of the tenant that is not generating (rename and
 * delete need one); *h: its entry in memory, or NULL. False: error sent. */
static bool idle_session(web_engine *E, const web_req *r, const cJSON *id, const char *store,
                         hot **h) {
    sess_session_info info;
    if (!get_session(E, r, id, store, &info)) return false;
    *h = find_hot(E, store);
    if (*h && (*h)->gen) {
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
    if (rc == KDS_OK || find_hot(E, store)) {
        fail(E, r, id, WEB_ERR_EXISTS, "session '%s' already exists", client_name(r, store));
        return;
    }
    if (rc != KDS_NOT_FOUND) {
        fail_err(E, r, id, &e);
        return;
    }
    kds_err_clear(&e);
    hot *h = free_slot(E);
    if (!h) {
        fail(E, r, id, WEB_ERR_LIMIT, "all %d sessions in memory are generating (--max-sessions)",
             E->n_hot_max);
        return;
    }
    eng_seq *seq = NULL;
    int32_t *ids = NULL;
    int64_t n = 0;
    uint64_t snap = 0;
    if (eng_seq_create(E->s->m, (uint64_t)web__now_us(), &seq, &e) != KDS_OK) goto fail;
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
        if (n > 0 && eng_prefill(E->c, seq, ids, n, NULL, NULL, NULL, &e) != KDS_OK) goto fail;
        atomic_fetch_add(&E->s->metrics.tokens_prefilled, (uint64_t)n);
    }
    /* a system text is the first transcript entry; without one the save
     * only declares the mode */
    bool has_system = system && *system;
    sess_turn turn = {.prompt = has_system ? system : NULL,
                      .prompt_len = has_system ? strlen(system) : 0,
                      .output = has_system ? "" : NULL, .prompt_tokens = n,
                      .mode = chat ? "chat" : "plain"};
    double t0 = web__now_s();
    if (sess_save(E->s->st, store, 0, E->s->m, seq, &turn, &snap, &e) != KDS_OK) {
        if (e.status == KDS_BUSY) e.status = KDS_EXISTS; /* another process made it meanwhile */
        goto fail;
    }
    web__hist_add(&E->s->metrics.save_ms, (web__now_s() - t0) * 1e3);
    memset(h, 0, sizeof *h);
    /* every token of the new session is known: its sequence is hashed from
     * here on (see hot.hash), and a system text's end is indexed */
    char scope[WEB_TENANT_MAX + SESS_FP_LEN + 8];
    prefix_scope(E, r, scope, sizeof scope);
    if (sess_prefix_hasher_create(scope, &h->hash, NULL) == KDS_OK) {
        sess_prefix_hasher_add(h->hash, ids, n);
        if (n > 0) {
            unsigned char key[SESS_PREFIX_KEY_LEN];
            sess_prefix_hasher_key(h->hash, key);
            index_key(E, key, snap, n, store, true);
        }
    } else {
        h->hash = NULL;
    }
    free(ids);
    h->used = true;
    snprintf(h->name, sizeof h->name, "%s", store);
    h->seq = seq;
    h->base = snap;
    h->chat = chat;
    h->last_used = web__now_s();
    atomic_fetch_add(&E->s->metrics.sessions_hot, 1);
    cJSON *o = web__event(id, "result");
    cJSON_AddStringToObject(o, "session", client_name(r, store));
    cJSON_AddNumberToObject(o, "tokens", (double)eng_seq_pos(seq));
    cJSON_AddStringToObject(o, "mode", chat ? "chat" : "plain");
    cJSON_AddNumberToObject(o, "snapshot", (double)snap);
    send_ev(E, r, o);
    return;
nomem:
    kds_err_set(&e, KDS_NOMEM, "out of memory");
fail:
    free(ids);
    eng_seq_free(seq);
    fail(E, r, id, web__code_of(e.status), "cannot create session '%s': %s", client_name(r, store),
         e.msg);
}

static void op_open(web_engine *E, const web_req *r, const cJSON *id) {
    char store[SESS_NAME_MAX + 1];
    if (!arg_session(E, r, id, "session", store)) return;
    bool was_hot = find_hot(E, store) != NULL;
    hot *h = ensure_hot(E, r, id, store);
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
    cJSON *o = web__event(id, "result");
    cJSON_AddStringToObject(o, "session", client_name(r, store));
    cJSON_AddNumberToObject(o, "tokens", (double)eng_seq_pos(h->seq));
    cJSON_AddNumberToObject(o, "turns", info.turns);
    cJSON_AddStringToObject(o, "mode", h->chat ? "chat" : "plain");
    cJSON_AddNumberToObject(o, "state_bytes", (double)eng_seq_state_bytes(h->seq));
    cJSON_AddNumberToObject(o, "resume_ms", was_hot ? 0.0 : h->last_resume_ms);
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
    hot *h;
    if (!arg_session(E, r, id, "session", from) || !arg_session(E, r, id, "name", to) ||
        !idle_session(E, r, id, from, &h))
        return;
    kds_err e = {0};
    if (sess_session_rename(E->s->st, from, to, &e) != KDS_OK) {
        fail_err(E, r, id, &e);
        return;
    }
    if (h) snprintf(h->name, sizeof h->name, "%s", to);
    cJSON *o = web__event(id, "result");
    cJSON_AddStringToObject(o, "session", client_name(r, to));
    send_ev(E, r, o);
}

static void op_delete(web_engine *E, const web_req *r, const cJSON *id) {
    char store[SESS_NAME_MAX + 1];
    hot *h;
    if (!arg_session(E, r, id, "session", store) || !idle_session(E, r, id, store, &h)) return;
    kds_err e = {0};
    if (sess_session_delete(E->s->st, store, &e) != KDS_OK) {
        fail_err(E, r, id, &e);
        return;
    }
    if (h) drop_hot(E, h);
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
    cJSON_AddNumberToObject(sv, "generations_active", E->n_gens);
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
        hot *h = find_hot(E, store);
        cJSON *ss = cJSON_AddObjectToObject(o, "session");
        cJSON_AddNumberToObject(ss, "tokens", (double)(h ? eng_seq_pos(h->seq) : info.tokens));
        cJSON_AddNumberToObject(ss, "state_bytes",
                                (double)(h ? eng_seq_state_bytes(h->seq)
                                           : sess_snapshot_size(eng_model_config(E->s->m),
                                                                info.tokens).total));
        cJSON_AddStringToObject(ss, "mode", (h ? h->chat : mode_is_chat(E, &info)) ? "chat" : "plain");
        cJSON_AddStringToObject(ss, "state", state_of(E, store));
        cJSON_AddNumberToObject(ss, "last_resume_ms", h ? h->last_resume_ms : 0.0);
        cJSON_AddNumberToObject(ss, "last_prefill_tok_s", h ? h->last_prefill_tok_s : 0.0);
        cJSON_AddNumberToObject(ss, "last_decode_tok_s", h ? h->last_decode_tok_s : 0.0);
    }
    send_ev(E, r, o);
}

/* ------------------------------------------------------------------------ */
/* Generations                                                               */

static void ingest_free(ingest *in) {
    if (!in) return;
    kds_buf_free(&in->text);
    if (in->spool) fclose(in->spool);
    free(in);
}

static void gen_free(gen *g) {
    if (!g) return;
    ingest_free(g->ing);
    cJSON_Delete(g->id);
    free(g->ids);
    free(g->prompt);
    srv_reply_free(g->rp);
    sess_prefix_hasher_free(g->hasher);
    free(g);
}

/* Start a turn prepared by a front end (its hot session, ids to feed,
 * sampler, limits set): it joins the batching loop. */
static void gen_launch(web_engine *E, gen *g) {
    hot *h = g->h;
    g->phase = g->n_ids > 0 ? G_PREFILL : g->max_tokens > 0 ? G_DECODE : G_FINISH;
    if (g->phase == G_FINISH) g->reason = "length";
    h->gen = g;
    h->last_used = web__now_s();
    g->next = E->gens;
    E->gens = g;
    E->n_gens++;
    atomic_fetch_add(&E->s->metrics.generations_active, 1);
    atomic_fetch_add(&E->s->metrics.generations_total, 1);
}

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
    if (E->n_gens >= E->s->p.max_generations) {
        fail(E, r, id, WEB_ERR_LIMIT, "%d generations are running (--max-generations); try again later",
             E->n_gens);
        return;
    }
    hot *h = find_hot(E, store);
    if (h && h->gen) {
        fail_busy(E, r, id, h, store, "");
        return;
    }
    if (!(h = ensure_hot(E, r, id, store))) return;
    if (h->has_sampler) {
        /* the settings of the session's last turn, except those given now */
        unsigned own = (given(r, "temperature") ? SESS_SAMPLER_TEMPERATURE : 0) |
                       (given(r, "top_p") ? SESS_SAMPLER_TOP_P : 0) |
                       (given(r, "top_k") ? SESS_SAMPLER_TOP_K : 0) |
                       (given(r, "min_p") ? SESS_SAMPLER_MIN_P : 0) |
                       (given(r, "repeat_penalty") ? SESS_SAMPLER_REPEAT_PENALTY : 0);
        sp = sess_sampler_merge(&h->sampler, &sp, own);
    }
    const char *text = mv ? mv->valuestring : tv->valuestring;
    size_t len = strlen(text);
    gen *g = calloc(1, sizeof *g);
    kds_err e = {0};
    if (!g || !(g->prompt = malloc(len + 1))) {
        free(g);
        fail(E, r, id, WEB_ERR_INTERNAL, "out of memory");
        return;
    }
    memcpy(g->prompt, text, len + 1);
    g->prompt_len = len;
    g->id = id ? cJSON_Duplicate(id, 1) : NULL;
    g->conn = r->conn;
    g->msgpack = r->msgpack;
    g->serial = ++E->next_serial;
    g->h = h;
    g->sp = sp;
    g->max_tokens = (int64_t)max_tokens;
    g->ignore_eos = cJSON_IsTrue(ie);
    g->context0 = eng_seq_pos(h->seq);
    g->feed = -1;
    g->t_arrive = r->t_arrive;
    g->t_start = web__now_s();
    const eng_tokenizer *tok = eng_model_tokenizer(E->s->m);
    srv_reply_params rp = srv_reply_default_params();
    rp.max_tokens = g->max_tokens;
    rp.ignore_eos = g->ignore_eos;
    rp.chat = h->chat;
    if (eng_chat_turn(tok, mv && h->chat, g->context0, NULL, text, len, true, &g->ids, &g->n_ids,
                      &e) != KDS_OK ||
        srv_reply_create(tok, &rp, &g->rp, &e) != KDS_OK) {
        fail(E, r, id, web__code_of(e.status), "%s", e.msg);
        gen_free(g);
        return;
    }
    if (g->n_ids == 0 && g->context0 == 0) {
        fail(E, r, id, WEB_ERR_BAD_REQUEST,
             "the session is empty and so is the text; this model has no BOS token to start from");
        gen_free(g);
        return;
    }
    if (seed >= 0) eng_seq_reseed(h->seq, (uint64_t)seed);
    g->route = WEB_ROUTE_WS;
    if (h->hash && sess_prefix_hasher_count(h->hash) == g->context0) {
        /* the turn carries the session's sequence: its prompt now, each
         * token as decode_step feeds it, its end indexed at the save */
        g->hasher = h->hash;
        h->hash = NULL;
        sess_prefix_hasher_add(g->hasher, g->ids, g->n_ids);
    }
    gen_launch(E, g);
    cJSON *o = web__event(id, "started");
    cJSON_AddStringToObject(o, "session", client_name(r, store));
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)g->n_ids);
    cJSON_AddNumberToObject(o, "context", (double)g->context0);
    send_ev(E, r, o);
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
    for (gen *g = E->gens; g; g = g->next) {
        if (g->phase == G_FINISH || g->cancel) continue;
        bool hit = target ? g->conn == r->conn && same_id(g->id, target)
                          : owned(r, g->h->name) && !strcmp(g->h->name, store);
        if (hit) {
            g->cancel = true;
            any = true;
        }
    }
    cJSON *o = web__event(id, "result");
    cJSON_AddBoolToObject(o, "cancelled", any);
    send_ev(E, r, o);
}

/* ------------------------------------------------------------------------ */
/* Ingest: op append                                                         */

static void gen_error(gen *g, const kds_err *e);
static void prefix_scope(web_engine *E, const web_req *r, char *out, size_t cap);
static void index_turn(web_engine *E, gen *g, uint64_t snap, const char *session);

/* Text tokens of an ingest that were fed. */
static int64_t ingest_fed_text(const ingest *in) {
    return in->fed_total - (in->prefix_n - in->prefix_left);
}

/* Room for `more` tokens after the unfed ones of g's buffer (fed ones are
 * dropped first). */
static kds_status ingest_reserve(gen *g, int64_t more, kds_err *e) {
    ingest *in = g->ing;
    if (g->fed > 0) {
        memmove(g->ids, g->ids + g->fed, (size_t)(g->n_ids - g->fed) * sizeof *g->ids);
        g->n_ids -= g->fed;
        g->fed = 0;
    }
    if (g->n_ids + more <= in->ids_cap) return KDS_OK;
    int64_t cap = in->ids_cap ? in->ids_cap : 4096;
    while (cap < g->n_ids + more)
        cap *= 2;
    int32_t *p = realloc(g->ids, (size_t)cap * sizeof *p);
    if (!p) return kds_err_set(e, KDS_NOMEM, "out of memory");
    g->ids = p;
    in->ids_cap = cap;
    return KDS_OK;
}

/* Add text p[0 .. n) (whole characters) to ingest g and tokenize what can
 * no longer change: everything but the last two pre-tokens (all of it when
 * `last`). All or nothing: on error the ingest is as it was. */
static kds_status ingest_add(web_engine *E, gen *g, const unsigned char *p, size_t n, bool last,
                             kds_err *e) {
    ingest *in = g->ing;
    const eng_tokenizer *tok = eng_model_tokenizer(E->s->m);
    size_t old = in->text.len, *ends = NULL;
    if (in->broken)
        return kds_err_set(e, KDS_IO, "the document's temporary file failed; cancel it");
    kds_status rc = kds_buf_append(&in->text, p, n, e);
    if (rc != KDS_OK) return rc;
    size_t cut = 0, len = in->text.len, stable = 0;
    if (last) {
        cut = len;
        /* where text after the document can no longer change the tokens:
         * before its last two pre-tokens (as the hold-back rule) */
        int64_t np = 0;
        if (g->hasher && !g->h->chat &&
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
        int64_t k = 0, k1 = 0, tail = 0;
        if ((rc = ingest_reserve(g, (int64_t)len, e)) != KDS_OK) goto fail;
        if ((rc = eng_tok_encode_ex(tok, t, len, 0, g->ids + g->n_ids, (int64_t)len, &k, e)) != KDS_OK ||
            (cut < len &&
             (rc = eng_tok_encode_ex(tok, t + cut, len - cut, 0, NULL, 0, &tail, e)) != KDS_OK))
            goto fail;
        k -= tail;
        if (stable && (rc = eng_tok_encode_ex(tok, t + stable, cut - stable, 0, NULL, 0, &k1, e)) != KDS_OK)
            goto fail;
        k1 = stable ? k - k1 : 0;
        if (fwrite(in->text.p, 1, cut, in->spool) != cut || fflush(in->spool) != 0) {
            int why = errno;
            /* what was written after spool_bytes is never read (the end maps
             * only spool_bytes); the next write goes there again */
            clearerr(in->spool);
            if (fseeko(in->spool, (off_t)in->spool_bytes, SEEK_SET) != 0) in->broken = true;
            rc = kds_err_set(e, KDS_IO, "cannot keep the document's text: %s", strerror(why));
            goto fail;
        }
        in->spool_bytes += (int64_t)cut;
        if (last && g->hasher && !g->h->chat) {
            /* the resume point: the last slice boundary at or before the
             * stable end. Counted in g->ids, which ingest_reserve has just
             * compacted (fed 0): every feed before the last is a whole
             * slice, so what was fed is a multiple of the slice and the
             * boundaries in g->ids are those of the document */
            int64_t slice = E->s->p.ctx.max_batch > 0 ? E->s->p.ctx.max_batch : 256;
            int64_t point = (g->n_ids + k1) / slice * slice;
            if (g->n_ids + k >= RESUME_POINT_MIN && point > 0 && point < g->n_ids + k &&
                point >= g->fed)
                g->point_at = point;
        }
        g->n_ids += k;
        in->tokens += k;
        memmove(in->text.p, in->text.p + cut, len - cut);
        in->text.len = len - cut;
        in->text.p[in->text.len] = '\0';
    }
    if (last) in->last = true;
    if (g->phase == G_WAIT) g->phase = G_PREFILL;
    free(ends);
    return KDS_OK;
nomem:
    rc = kds_err_set(e, KDS_NOMEM, "out of memory");
fail:
    free(ends);
    in->text.len = old;
    if (in->text.p) in->text.p[old] = '\0';
    return rc;
}

/* The ingest running on session `store` (NULL: none). */
static gen *ingest_of(web_engine *E, const char *store) {
    hot *h = find_hot(E, store);
    return h && h->gen && h->gen->ing ? h->gen : NULL;
}

/* A chunk of an ingest whose backlog is full waits in its connection's
 * queue (answered when the backlog drains). */
static bool deferred(web_engine *E, const web_req *r) {
    if (E->stopping) return false;
    const char *op = get_str(r->msg, "op"), *sn = get_str(r->msg, "session");
    char store[SESS_NAME_MAX + 1];
    if (!op || strcmp(op, "append") || !sn || !store_name(r, sn, store)) return false;
    gen *g = ingest_of(E, store);
    return g && g->conn == r->conn && !g->cancel && !g->gone && g->n_ids - g->fed > INGEST_BACKLOG;
}

static void ingest_progress(web_engine *E, gen *g, bool force) {
    ingest *in = g->ing;
    double now = web__now_s();
    if (g->gone || (!force && now - in->t_progress < INGEST_PROGRESS_S)) return;
    in->t_progress = now;
    int64_t done = ingest_fed_text(in);
    double dt = now - g->t_start, tps = dt > 0 ? (double)done / dt : 0.0;
    /* the total: tokens known, or as the announced size predicts */
    double total = (double)in->tokens;
    if (in->size > 0 && in->bytes > 0 && !in->last && in->size > in->bytes && in->tokens > 0)
        total = (double)in->tokens * (double)in->size / (double)(in->bytes - (int64_t)in->text.len);
    cJSON *o = web__event(g->id, "progress");
    cJSON_AddStringToObject(o, "session", g->ing->client);
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
    web__send(E->s, g->conn, o, g->msgpack);
}

/* One prefill slice of an ingest (the loop's prefill step). Slices are
 * aligned on the ingest's start as a generate's prompt slices are, so the
 * state equals that of the whole text given to one generate. */
static void point_begin(web_engine *E, gen *g);

static void ingest_step(web_engine *E, gen *g) {
    ingest *in = g->ing;
    if (g->cancel || g->gone) {
        g->reason = g->gone ? "disconnected" : "cancelled";
        /* a chat turn begun is closed with <|im_end|> */
        g->phase = g->h->chat && in->fed_total > 0 ? G_CLOSE : G_FINISH;
        return;
    }
    if (g->point_at && g->fed == g->point_at) {
        point_begin(E, g);
        return;
    }
    int64_t avail = g->n_ids - g->fed,
            slice = E->s->p.ctx.max_batch > 0 ? E->s->p.ctx.max_batch : 256;
    bool all = in->last;
    if (avail == 0 && all) {
        g->reason = "complete";
        g->t_prefill_end = web__now_s();
        g->phase = g->h->chat && in->fed_total > 0 ? G_CLOSE : G_FINISH;
        return;
    }
    if (avail == 0 || (avail < slice && !all)) {
        g->phase = G_WAIT;
        return;
    }
    int64_t n = avail < slice ? avail : slice;
    kds_err e = {0};
    if (eng_prefill(E->c, g->h->seq, g->ids + g->fed, n, NULL, NULL, NULL, &e) != KDS_OK) {
        gen_error(g, &e);
        return;
    }
    if (g->hasher) sess_prefix_hasher_add(g->hasher, g->ids + g->fed, n);
    g->fed += n;
    in->fed_total += n;
    in->prefix_left -= n < in->prefix_left ? n : in->prefix_left;
    atomic_fetch_add(&E->s->metrics.tokens_prefilled, (uint64_t)n);
    ingest_progress(E, g, false);
}

/* The end of an ingest: save the session with one transcript entry (the
 * document's text that went in), then send `done`. */
/* The engine thread's half of an ingest that ended: how much of the text is
 * kept (text tokens taken but not fed, when cancelled, are not) and the
 * rate. The save is the saver's (save_document). */
static void ingest_end(web_engine *E, gen *g) {
    hot *h = g->h;
    ingest *in = g->ing;
    const eng_tokenizer *tok = eng_model_tokenizer(E->s->m);
    int64_t from = g->fed + in->prefix_left, unfed = g->n_ids - from;
    int64_t unfed_len = unfed > 0 ? eng_tok_decode(tok, g->ids + from, unfed, 0, NULL, 0) : 0;
    int64_t keep = in->spool_bytes - (unfed_len > 0 ? unfed_len : 0);
    g->doc_keep = keep < 0 ? 0 : keep;
    double prefill_s = (g->t_prefill_end ? g->t_prefill_end : g->t_end) - g->t_start;
    h->last_prefill_tok_s = prefill_s > 0 ? (double)ingest_fed_text(in) / prefill_s : 0.0;
}

/* Saver thread: g's state into its session, continuing h->base, with
 * `turn` (NULL: a resume point, no transcript entry). A WebSocket session
 * (a generate, an append) is saved in place; an HTTP turn goes to save_as,
 * or a fork of it when it moved on, or always one when save_as is a
 * stateful client's (fork_always); saved_to then names where it went.
 * Fills g->save_rc, save_err, save_snap. */
static void save_state(web_engine *E, gen *g, const sess_turn *turn) {
    hot *h = g->h;
    if (g->route == WEB_ROUTE_WS) {
        g->save_rc = sess_save(E->s->st, h->name, h->base, E->s->m, h->seq, turn, &g->save_snap,
                               &g->save_err);
        return;
    }
    sess_save_result res;
    g->save_rc = sess_save_ex(E->s->st, g->save_as, h->base, E->s->m, h->seq, turn,
                              g->fork_always ? SESS_CONFLICT_FORK_ALWAYS : SESS_CONFLICT_FORK, &res,
                              &g->save_err);
    if (g->save_rc != KDS_OK) return;
    g->save_snap = res.snapshot;
    snprintf(g->saved_to, sizeof g->saved_to, "%s", res.session);
}

/* Saver thread: the document's turn, its text read back from the spool. */
static void save_document(web_engine *E, gen *g) {
    hot *h = g->h;
    ingest *in = g->ing;
    size_t keep = (size_t)g->doc_keep;
    void *map = NULL;
    if (keep > 0) {
        map = mmap(NULL, keep, PROT_READ, MAP_PRIVATE, fileno(in->spool), 0);
        if (map == MAP_FAILED) {
            g->save_rc = kds_err_set(&g->save_err, KDS_IO,
                                     "cannot read the document's text back: %s", strerror(errno));
            return;
        }
    }
    sess_turn turn = {.prompt = map ? map : "",
                      .prompt_len = keep,
                      .output = "",
                      .prompt_tokens = ingest_fed_text(in),
                      .mode = h->chat ? "chat" : "plain",
                      .doc_name = in->name,
                      .doc_bytes = (int64_t)keep};
    save_state(E, g, &turn);
    if (g->save_rc == KDS_OK) index_turn(E, g, g->save_snap, h->name);
    if (map) munmap(map, keep);
}

/* The `error` object of a `done` event: the save's failure, else the
 * turn's own (an engine error), counted in the metrics. */
static void done_error(web_engine *E, cJSON *o, const gen *g) {
    cJSON *err = cJSON_AddObjectToObject(o, "error");
    int code = g->save_rc != KDS_OK ? web__code_of(g->save_rc) : WEB_ERR_INTERNAL;
    cJSON_AddStringToObject(err, "code", web__code_name(code));
    cJSON_AddStringToObject(err, "message", g->save_rc != KDS_OK ? g->save_err.msg : g->error);
    atomic_fetch_add(&E->s->metrics.errors[code], 1);
}

/* The answer to an ingest, once saved (or not). */
static void ingest_answer(web_engine *E, gen *g) {
    hot *h = g->h;
    ingest *in = g->ing;
    if (g->gone) return;
    bool failed = !strcmp(g->reason, "error");
    kds_status rc = g->save_rc;
    double prefill_s = (g->t_prefill_end ? g->t_prefill_end : g->t_end) - g->t_start;
    cJSON *o = web__event(g->id, "done");
    cJSON_AddStringToObject(o, "reason", rc == KDS_OK ? g->reason : "error");
    cJSON_AddStringToObject(o, "session", in->client);
    cJSON *d = cJSON_AddObjectToObject(o, "document");
    cJSON_AddStringToObject(d, "name", in->name);
    cJSON_AddNumberToObject(d, "bytes", (double)g->doc_keep);
    cJSON_AddNumberToObject(d, "tokens", (double)ingest_fed_text(in));
    cJSON_AddNumberToObject(o, "received", (double)in->bytes);
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)in->fed_total);
    cJSON_AddNumberToObject(o, "context", (double)eng_seq_pos(h->seq));
    cJSON_AddNumberToObject(o, "snapshot", (double)g->save_snap);
    cJSON_AddNumberToObject(o, "prefill_ms", prefill_s * 1e3);
    cJSON_AddNumberToObject(o, "tok_s", h->last_prefill_tok_s);
    if (rc != KDS_OK || failed) done_error(E, o, g);
    web__send(E->s, g->conn, o, g->msgpack);
}

/* A new ingest on hot session h (not launched). */
static gen *ingest_create(web_engine *E, const web_req *r, const cJSON *id, hot *h,
                          const char *name, int64_t size, kds_err *e) {
    gen *g = calloc(1, sizeof *g);
    if (!g || !(g->ing = calloc(1, sizeof *g->ing))) goto nomem;
    ingest *in = g->ing;
    snprintf(in->name, sizeof in->name, "%s", name);
    snprintf(in->client, sizeof in->client, "%s", client_name(r, h->name));
    in->size = size;
    if (!(in->spool = tmpfile())) {
        kds_err_set(e, KDS_IO, "cannot create a temporary file for the document: %s",
                    strerror(errno));
        goto fail;
    }
    g->id = id ? cJSON_Duplicate(id, 1) : NULL;
    g->conn = r->conn;
    g->msgpack = r->msgpack;
    g->serial = ++E->next_serial;
    g->h = h;
    g->context0 = eng_seq_pos(h->seq);
    g->feed = -1;
    g->t_arrive = r->t_arrive;
    g->t_start = web__now_s();
    g->route = WEB_ROUTE_WS;
    if (h->hash && sess_prefix_hasher_count(h->hash) == g->context0) {
        /* every token of the session is known (hot.hash): the document's
         * end goes into the prefix index and an HTTP client that sends the
         * same conversation resumes there (advisory: without it, it
         * replays) */
        g->hasher = h->hash;
        h->hash = NULL;
    } else if (g->context0 == 0) {
        char scope[WEB_TENANT_MAX + SESS_FP_LEN + 8];
        prefix_scope(E, r, scope, sizeof scope);
        if (sess_prefix_hasher_create(scope, &g->hasher, NULL) != KDS_OK) g->hasher = NULL;
    }
    const eng_tokenizer *tok = eng_model_tokenizer(E->s->m);
    srv_reply_params rp = srv_reply_default_params();
    rp.max_tokens = 0;
    rp.chat = h->chat;
    if (srv_reply_create(tok, &rp, &g->rp, e) != KDS_OK) goto fail;
    if (h->chat) {
        /* the document is one user turn: its opener now, its text as it
         * comes, <|im_end|> at the end */
        int32_t *ids = NULL;
        int64_t n = 0;
        if (eng_chat_turn(tok, true, g->context0, NULL, "", 0, false, &ids, &n, e) != KDS_OK)
            goto fail;
        if (n < 1 || ids[n - 1] != srv_reply_close_token(g->rp)) {
            free(ids);
            kds_err_set(e, KDS_INTERNAL, "this chat format does not end a turn on <|im_end|>");
            goto fail;
        }
        g->ids = ids;
        g->n_ids = n - 1;
        in->ids_cap = n;
        in->prefix_n = in->prefix_left = n - 1;
    }
    return g;
nomem:
    kds_err_set(e, KDS_NOMEM, "out of memory");
fail:
    gen_free(g);
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
    gen *g = ingest_of(E, store);
    if (begin) {
        hot *h = find_hot(E, store);
        if (h && h->gen) {
            fail_busy(E, r, id, h, store, "");
            return;
        }
        if (E->n_gens >= E->s->p.max_generations) {
            fail(E, r, id, WEB_ERR_LIMIT,
                 "%d generations are running (--max-generations); try again later", E->n_gens);
            return;
        }
    } else if (!g || g->conn != r->conn || g->cancel || g->gone || g->ing->last ||
               g->phase == G_SAVE) {
        hot *h = find_hot(E, store);
        if (h && h->gen && !h->gen->ing)
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
    if (begin) {
        hot *h = ensure_hot(E, r, id, store);
        if (!h) goto out;
        if (!(g = ingest_create(E, r, id, h, nv->valuestring, (int64_t)size, &e))) {
            fail(E, r, id, web__code_of(e.status), "%s", e.msg);
            goto out;
        }
    } else if (size >= 0) {
        g->ing->size = (int64_t)size;
    }
    if (ingest_add(E, g, buf, total - tail, last, &e) != KDS_OK) {
        fail(E, r, id, web__code_of(e.status), "%s", e.msg);
        if (begin) gen_free(g);
        goto out;
    }
    ingest *in = g->ing;
    memcpy(in->carry, buf + total - tail, tail);
    in->n_carry = tail;
    in->bytes += (int64_t)n;
    if (begin) {
        gen_launch(E, g);
        g->phase = g->n_ids > 0 || in->last ? G_PREFILL : G_WAIT;
        g->reason = NULL;
    }
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

/* Saver thread (the store is thread-safe): the turn's end in the prefix
 * index, under the session it was saved to. */
static void index_key(web_engine *E, const unsigned char key[SESS_PREFIX_KEY_LEN], uint64_t snap,
                      int64_t tokens, const char *session, bool fork) {
    sess_prefix_entry pe = {.snapshot = snap, .tokens = tokens, .fork = fork};
    snprintf(pe.session, sizeof pe.session, "%s", session);
    kds_err e = {0};
    /* advisory: a turn that is not indexed is replayed next time, no more */
    if (sess_prefix_put(E->s->st, key, &pe, &e) != KDS_OK && !E->s->p.quiet)
        fprintf(stderr, "kdaserve serve: indexing turn @%" PRIu64 ": %s\n", snap, e.msg);
}

static void index_turn(web_engine *E, gen *g, uint64_t snap, const char *session) {
    /* only a sequence known token for token (fed whole, nothing cut) */
    if (!g->hasher || sess_prefix_hasher_count(g->hasher) != eng_seq_pos(g->h->seq)) return;
    unsigned char key[SESS_PREFIX_KEY_LEN];
    sess_prefix_hasher_key(g->hasher, key);
    /* a WebSocket session's turn (a stateful client's): resumed over HTTP
     * it is forked, never added to */
    index_key(E, key, snap, eng_seq_pos(g->h->seq), session, g->route == WEB_ROUTE_WS);
}

/* Find the state to start from: the longest indexed prefix of q's tokens
 * that loads. Returns the hot entry to use (in memory already, or a fresh
 * slot loaded from the snapshot or empty) and *cached, the tokens it holds;
 * NULL when every slot is generating. `target` gets the session the turn
 * is saved to when the request named none. */
static hot *http_resume(web_engine *E, const web_req *r, const web_oai *q, bool named,
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
    hot *h = NULL;
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
        hot *m = find_hot(E, pe.session);
        if (m && !m->gen && m->base == pe.snapshot && eng_seq_pos(m->seq) == pe.tokens) {
            h = m;
        } else {
            hot *slot = free_slot(E);
            if (!slot) break;
            eng_seq *seq = NULL;
            double t0 = web__now_s();
            if (eng_seq_create(E->s->m, (uint64_t)web__now_us(), &seq, NULL) != KDS_OK) break;
            if (sess_load(E->s->st, pe.snapshot, E->s->m, seq, NULL, NULL) != KDS_OK ||
                eng_seq_pos(seq) != pe.tokens) {
                eng_seq_free(seq); /* pruned or damaged: try a shorter prefix */
                continue;
            }
            double ms = (web__now_s() - t0) * 1e3;
            web__hist_add(&E->s->metrics.restore_ms, ms);
            memset(slot, 0, sizeof *slot);
            slot->used = true;
            slot->seq = seq;
            slot->base = pe.snapshot;
            slot->last_resume_ms = ms;
            atomic_fetch_add(&E->s->metrics.sessions_hot, 1);
            h = slot;
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
    hot *slot = free_slot(E);
    if (!slot) return NULL;
    eng_seq *seq = NULL;
    if (eng_seq_create(E->s->m, (uint64_t)web__now_us(), &seq, e) != KDS_OK) return NULL;
    memset(slot, 0, sizeof *slot);
    slot->used = true;
    slot->seq = seq;
    atomic_fetch_add(&E->s->metrics.sessions_hot, 1);
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
            if (store_name(r, client, target) && !find_hot(E, target) &&
                sess_session_get(E->s->st, target, &tmp, NULL) == KDS_NOT_FOUND)
                break;
            target[0] = '\0';
        }
        if (!target[0]) {
            drop_hot(E, slot);
            kds_err_set(e, KDS_EXISTS, "no free automatic session name");
            return NULL;
        }
    }
    return slot;
}

static cJSON *chunk_base(const gen *g, const char *model) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", g->resp_id);
    cJSON_AddStringToObject(
        o, "object", g->route == WEB_ROUTE_CHAT ? "chat.completion.chunk" : "text_completion");
    cJSON_AddNumberToObject(o, "created", (double)g->created);
    cJSON_AddStringToObject(o, "model", model);
    return o;
}

/* A stream's chunk with an empty delta (chat) or no text yet. */
static cJSON *chunk_template(const gen *g, const char *model, const char *finish) {
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

static void send_sse(web_engine *E, const gen *g, cJSON *o, bool last) {
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
    int64_t slice = E->s->p.ctx.max_batch > 0 ? E->s->p.ctx.max_batch : 256;
    point = cached + (q->n_ids - tail - cached) / slice * slice; /* prefill_step's slices */
    if (point <= cached || point >= q->n_ids) point = 0;
out:
    free(ends);
    return point;
}

static void http_generate(web_engine *E, const web_req *r) {
    web_oai q;
    web_oai_err oe;
    const eng_tokenizer *tok = eng_model_tokenizer(E->s->m);
    if (!web__oai_parse(r->msg, r->route, tok, model_id(E), &q, &oe)) {
        http_fail(E, r, &oe);
        return;
    }
    gen *g = NULL;
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
    if (E->n_gens >= E->s->p.max_generations) {
        web__http_error(E->s, r->conn, 429, "rate_limit_exceeded", NULL, "rate_limit_exceeded",
                        "%d generations are running (--max-generations); retry later", E->n_gens);
        goto out;
    }
    int64_t cached = 0;
    bool fork_always = false;
    hot *h = http_resume(E, r, &q, named != NULL, target, &cached, &fork_always, &e);
    if (!h) {
        if (e.status)
            web__http_error(E->s, r->conn, 500, "server_error", NULL, NULL, "%s", e.msg);
        else
            web__http_error(
                E->s, r->conn, 429, "rate_limit_exceeded", NULL, "rate_limit_exceeded",
                "all %d sessions in memory are generating (--max-sessions); retry later",
                E->n_hot_max);
        goto out;
    }
    if (!(g = calloc(1, sizeof *g))) goto nomem;
    g->route = r->route;
    g->conn = r->conn;
    g->serial = ++E->next_serial;
    g->h = h;
    g->sp = q.sp;
    int64_t mt = q.max_tokens >= 0 ? q.max_tokens : HTTP_DEFAULT_MAX_TOKENS;
    g->max_tokens = mt > E->s->p.max_tokens ? E->s->p.max_tokens : mt;
    g->context0 = eng_seq_pos(h->seq);
    g->feed = -1;
    g->t_arrive = r->t_arrive;
    g->t_start = web__now_s();
    g->sse = q.stream;
    g->include_usage = q.include_usage;
    g->ignore_eos = q.ignore_eos;
    g->created = web__now_us() / 1000000;
    snprintf(g->resp_id, sizeof g->resp_id, "%s-%016" PRIx64,
             r->route == WEB_ROUTE_CHAT ? "chatcmpl" : "cmpl",
             ((uint64_t)web__now_us() << 16) ^ g->serial);
    g->cached = cached;
    g->prompt_total = q.n_ids;
    snprintf(g->save_as, sizeof g->save_as, "%s", target);
    g->fork_always = fork_always;
    char scope[WEB_TENANT_MAX + SESS_FP_LEN + 8];
    prefix_scope(E, r, scope, sizeof scope);
    if (sess_prefix_hasher_create(scope, &g->hasher, &e) != KDS_OK) goto fail;
    /* the whole sequence, in one pass, taking the resume point's key on the way */
    int64_t point = http_point(E, &q, cached);
    sess_prefix_hasher_add(g->hasher, q.ids, point);
    if (point) {
        sess_prefix_hasher_key(g->hasher, g->point_key);
        g->point_at = point - cached; /* g->fed counts from the resumed state */
    }
    sess_prefix_hasher_add(g->hasher, q.ids + point, q.n_ids - point);
    /* feed only what the stored state lacks */
    g->n_ids = q.n_ids - cached;
    memmove(q.ids, q.ids + cached, (size_t)g->n_ids * sizeof *q.ids);
    g->ids = q.ids;
    q.ids = NULL;
    g->prompt = q.prompt;
    g->prompt_len = q.prompt_len;
    q.prompt = NULL;
    srv_reply_params rp = srv_reply_default_params();
    rp.max_tokens = g->max_tokens;
    rp.ignore_eos = g->ignore_eos;
    rp.chat = q.chat;
    rp.end_on_im_end = g->route == WEB_ROUTE_CHAT;
    for (int i = 0; i < q.n_stop; i++)
        rp.stop[i] = q.stop[i];
    rp.n_stop = q.n_stop;
    if (srv_reply_create(tok, &rp, &g->rp, &e) != KDS_OK) goto fail;
    h->chat = q.chat;
    if (q.has_seed) eng_seq_reseed(h->seq, q.seed);
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
    gen_launch(E, g);
    web__oai_free(&q);
    return;
nomem:
    kds_err_set(&e, KDS_NOMEM, "out of memory");
fail:
    web__http_error(E->s, r->conn, 500, "server_error", NULL, NULL, "%s", e.msg);
    if (g) {
        if (!h->name[0]) drop_hot(E, h);
        gen_free(g);
    }
out:
    web__oai_free(&q);
}

/* The answer of an HTTP turn that ended (saved or not). */
static void http_done(web_engine *E, gen *g, kds_status rc, const kds_err *e, uint64_t snap) {
    if (g->gone) return;
    bool error = rc != KDS_OK || !strcmp(g->reason, "error");
    const char *why = rc != KDS_OK ? e->msg : g->error;
    const char *finish = !strcmp(g->reason, "stop") ? "stop" : "length";
    const char *model = model_id(E);
    cJSON *usage = cJSON_CreateObject();
    cJSON_AddNumberToObject(usage, "prompt_tokens", (double)g->prompt_total);
    cJSON_AddNumberToObject(usage, "completion_tokens", (double)g->produced);
    cJSON_AddNumberToObject(usage, "total_tokens", (double)(g->prompt_total + g->produced));
    cJSON *ptd = cJSON_AddObjectToObject(usage, "prompt_tokens_details");
    cJSON_AddNumberToObject(ptd, "cached_tokens", (double)g->cached);
    /* kdaserve's own: where the turn went */
    cJSON *kx = cJSON_CreateObject();
    if (!error && g->h->name[0]) {
        const char *store = g->h->name, *dot = strchr(store, '.');
        cJSON_AddStringToObject(kx, "session", E->s->n_tenants > 0 && dot ? dot + 1 : store);
        cJSON_AddNumberToObject(kx, "snapshot", (double)snap);
    }
    cJSON_AddNumberToObject(kx, "context", (double)eng_seq_pos(g->h->seq));
    cJSON_AddNumberToObject(kx, "prefilled_tokens", (double)g->fed);
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
            return;
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
        return;
    }
    if (error) {
        cJSON_Delete(usage);
        cJSON_Delete(kx);
        web__http_error(E->s, g->conn, 500, "server_error", NULL, NULL, "%s", why);
        return;
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
        cJSON_AddStringToObject(m, "content", srv_reply_text(g->rp, NULL));
        cJSON_AddItemToObject(m, "refusal", cJSON_CreateNull());
    } else {
        cJSON_AddStringToObject(c, "text", srv_reply_text(g->rp, NULL));
    }
    cJSON_AddItemToObject(c, "logprobs", cJSON_CreateNull());
    cJSON_AddStringToObject(c, "finish_reason", finish);
    cJSON_AddItemToArray(a, c);
    cJSON_AddItemToObject(o, "usage", usage);
    cJSON_AddItemToObject(o, "kdaserve", kx);
    web__http_json(E->s, g->conn, 200, o);
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
/* The loop                                                                  */

/* Reply text that may be sent (srv_reply said so): WebSocket token events
 * or an HTTP stream's chunks (joined per write either way); a whole HTTP
 * answer waits for the end. */
static void emit_text(web_engine *E, gen *g, const char *p, size_t n) {
    if (!n) return;
    if (!g->t_first) {
        g->t_first = web__now_s();
        web__hist_add(&E->s->metrics.ttft_ms, (g->t_first - g->t_arrive) * 1e3);
    }
    if (g->gone || (g->route != WEB_ROUTE_WS && !g->sse)) return;
    web__send_token(E->s, g->conn, g->id, g->msgpack, g->serial, p, n);
}

static void http_done(web_engine *E, gen *g, kds_status rc, const kds_err *e, uint64_t snap);
static void index_turn(web_engine *E, gen *g, uint64_t snap, const char *session);

/* The engine thread's half of a reply that ended: send what was held back
 * and note the rates. */
static void reply_end(web_engine *E, gen *g) {
    hot *h = g->h;
    size_t len;
    const char *rest = srv_reply_finish(g->rp, &len); /* what was held back */
    if (strcmp(g->reason, "error")) emit_text(E, g, rest, len);
    double decode_s = g->t_decode0 ? g->t_end - g->t_decode0 : 0.0;
    double prefill_s = g->t_prefill_end ? g->t_prefill_end - g->t_start : 0.0;
    h->last_prefill_tok_s = prefill_s > 0 ? (double)g->fed / prefill_s : 0.0;
    h->last_decode_tok_s = decode_s > 0 ? (double)g->produced / decode_s : 0.0;
}

/* Saver thread: the reply's turn. */
static void save_reply(web_engine *E, gen *g) {
    hot *h = g->h;
    size_t reply_len;
    const char *reply = srv_reply_text(g->rp, &reply_len);
    sess_turn turn = {.prompt = g->prompt,
                      .prompt_len = g->prompt_len,
                      .output = reply,
                      .output_len = reply_len,
                      .prompt_tokens = g->fed,
                      .output_tokens = g->produced,
                      .mode = h->chat ? "chat" : "plain",
                      .sampler = &g->sp};
    /* a stateless client's turn continues the session it resumed, or forks
     * it when that session moved on since (the branch of an edited
     * conversation), or when it is a WebSocket conversation's */
    save_state(E, g, &turn);
    if (g->save_rc == KDS_OK)
        index_turn(E, g, g->save_snap, g->route == WEB_ROUTE_WS ? h->name : g->saved_to);
}

/* The answer to a WebSocket generate, once saved (or not). */
static void reply_answer(web_engine *E, gen *g) {
    hot *h = g->h;
    kds_status rc = g->save_rc;
    if (g->route != WEB_ROUTE_WS) {
        http_done(E, g, rc, &g->save_err, g->save_snap);
        return;
    }
    if (g->gone) return;
    double decode_s = g->t_decode0 ? g->t_end - g->t_decode0 : 0.0;
    double prefill_s = g->t_prefill_end ? g->t_prefill_end - g->t_start : 0.0;
    cJSON *o = web__event(g->id, "done");
    cJSON_AddStringToObject(o, "reason", rc == KDS_OK ? g->reason : "error");
    cJSON_AddNumberToObject(o, "tokens", (double)g->produced);
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)g->n_ids);
    cJSON_AddNumberToObject(o, "context", (double)eng_seq_pos(h->seq));
    cJSON_AddNumberToObject(o, "snapshot", (double)g->save_snap);
    cJSON_AddStringToObject(o, "reply", srv_reply_text(g->rp, NULL));
    cJSON_AddNumberToObject(o, "prefill_ms", prefill_s * 1e3);
    cJSON_AddNumberToObject(o, "decode_ms", decode_s * 1e3);
    cJSON_AddNumberToObject(o, "decode_tok_s", h->last_decode_tok_s);
    cJSON_AddNumberToObject(o, "queue_ms", (g->t_start - g->t_arrive) * 1e3);
    if (rc != KDS_OK || !strcmp(g->reason, "error")) done_error(E, o, g);
    web__send(E->s, g->conn, o, g->msgpack);
}

/* Saver thread: a resume point (RESUME_POINT_MIN): the state so far as the
 * session's head, no transcript entry (the turn's own save adds it), and
 * its token sequence in the prefix index. */
static void save_point(web_engine *E, gen *g) {
    hot *h = g->h;
    save_state(E, g, NULL);
    if (g->save_rc != KDS_OK) return;
    if (g->route == WEB_ROUTE_WS)
        index_turn(E, g, g->save_snap, h->name);
    else
        index_key(E, g->point_key, g->save_snap, eng_seq_pos(h->seq), g->saved_to, false);
}

/* Saver thread: one turn's durable save (or a resume point). It reads the
 * gen and its session and writes only the gen's save_* fields. */
static void save_turn(web_engine *E, gen *g) {
    double t0 = web__now_s();
    if (g->point_saving)
        save_point(E, g);
    else if (g->ing)
        save_document(E, g);
    else
        save_reply(E, g);
    g->save_ms = (web__now_s() - t0) * 1e3;
}

static void *saver_main(void *arg) {
    web_engine *E = arg;
    pthread_mutex_lock(&E->save_lock);
    for (;;) {
        while (!E->save_head && !E->save_stop)
            pthread_cond_wait(&E->save_wake, &E->save_lock);
        gen *g = E->save_head;
        if (!g) break; /* stopping, and nothing is left to save */
        E->save_head = g->save_next;
        if (!E->save_head) E->save_tail = NULL;
        pthread_mutex_unlock(&E->save_lock);
        save_turn(E, g);
        pthread_mutex_lock(&E->s->lock);
        g->save_next = E->saved;
        E->saved = g;
        pthread_cond_signal(&E->s->wake);
        pthread_mutex_unlock(&E->s->lock);
        pthread_mutex_lock(&E->save_lock);
    }
    pthread_mutex_unlock(&E->save_lock);
    return NULL;
}

/* A turn is over, saved or not: the session is free again and the client
 * is answered. A failed save leaves memory ahead of the store: the session
 * is forgotten, the next use reloads what is stored (so is an engine
 * error's sequence, which is not trusted, and an HTTP turn that saved
 * nothing: its sequence belongs to no session). */
static void turn_done(web_engine *E, gen *g) {
    hot *h = g->h;
    bool failed = !strcmp(g->reason, "error");
    if (g->phase == G_SAVE) {
        E->n_saving--;
        if (g->save_rc == KDS_OK) {
            web__hist_add(&E->s->metrics.save_ms, g->save_ms);
            h->base = g->save_snap;
            if (g->saved_to[0]) snprintf(h->name, sizeof h->name, "%s", g->saved_to);
            if (g->route == WEB_ROUTE_WS && !g->ing) { /* what the session now records */
                h->has_sampler = true;
                h->sampler = g->sp;
            }
        }
    }
    h->gen = NULL;
    /* the sequence's hash goes back to the session while it is whole */
    if (g->hasher && g->save_rc == KDS_OK && !failed &&
        sess_prefix_hasher_count(g->hasher) == eng_seq_pos(h->seq)) {
        sess_prefix_hasher_free(h->hash);
        h->hash = g->hasher;
        g->hasher = NULL;
    }
    if (g->ing)
        ingest_answer(E, g);
    else
        reply_answer(E, g);
    if (g->save_rc != KDS_OK || failed || !h->name[0]) drop_hot(E, h);
    gen_free(g);
    atomic_fetch_sub(&E->s->metrics.generations_active, 1);
}

static void save_enqueue(web_engine *E, gen *g) {
    g->phase = G_SAVE;
    g->save_next = NULL;
    E->n_saving++;
    pthread_mutex_lock(&E->save_lock);
    if (E->save_tail)
        E->save_tail->save_next = g;
    else
        E->save_head = g;
    E->save_tail = g;
    pthread_cond_signal(&E->save_wake);
    pthread_mutex_unlock(&E->save_lock);
}

/* A turn reached its resume point: it pauses (G_SAVE, skipped by the loop)
 * while the saver saves it, then goes on (point_done). Advisory: when the
 * state cannot be handed over, the turn goes on without one. */
static void point_begin(web_engine *E, gen *g) {
    g->point_at = 0; /* once */
    kds_err e = {0};
    if (eng_ctx_release(E->c, g->h->seq, &e) != KDS_OK) return;
    g->point_saving = true;
    g->save_rc = KDS_OK;
    save_enqueue(E, g);
}

static void point_done(web_engine *E, gen *g) {
    hot *h = g->h;
    E->n_saving--;
    g->point_saving = false;
    if (g->save_rc == KDS_OK) {
        web__hist_add(&E->s->metrics.save_ms, g->save_ms);
        h->base = g->save_snap;
        if (g->saved_to[0]) { /* HTTP: the turn's own save goes there too */
            snprintf(h->name, sizeof h->name, "%s", g->saved_to);
            snprintf(g->save_as, sizeof g->save_as, "%s", g->saved_to);
            g->saved_to[0] = '\0';
            g->fork_always = false; /* the branch is the client's own now */
        }
    } else if (!E->s->p.quiet) {
        fprintf(stderr, "kdaserve serve: resume point of '%s' not saved (the turn goes on): %s\n",
                h->name, g->save_err.msg);
    }
    g->save_rc = KDS_OK;
    kds_err_clear(&g->save_err);
    g->phase = G_PREFILL;
}

/* A turn that ended leaves the batching loop: saved by the saver thread
 * when its context moved (the engine thread goes on with the others),
 * answered at once otherwise. */
static void turn_end(web_engine *E, gen *g) {
    hot *h = g->h;
    g->t_end = web__now_s();
    h->last_used = g->t_end;
    if (g->ing)
        ingest_end(E, g);
    else
        reply_end(E, g);
    g->save_rc = KDS_OK;
    g->save_snap = h->base;
    if (!strcmp(g->reason, "error") || eng_seq_pos(h->seq) == g->context0) {
        turn_done(E, g);
        return;
    }
    /* no context touches the sequence while the saver reads it */
    if ((g->save_rc = eng_ctx_release(E->c, h->seq, &g->save_err)) != KDS_OK) {
        turn_done(E, g);
        return;
    }
    save_enqueue(E, g);
}

/* Turns the saver has saved, answered in the order they were saved (a
 * resume point goes back into the loop). */
static void answer_saved(web_engine *E, gen *list) {
    gen *fifo = NULL;
    while (list) {
        gen *g = list;
        list = g->save_next;
        g->save_next = fifo;
        fifo = g;
    }
    while (fifo) {
        gen *g = fifo;
        fifo = g->save_next;
        if (g->point_saving)
            point_done(E, g);
        else
            turn_done(E, g);
    }
}

static void remove_finished(web_engine *E) {
    for (gen **pp = &E->gens; *pp;) {
        gen *g = *pp;
        if (g->phase == G_FINISH) {
            *pp = g->next;
            E->n_gens--;
            turn_end(E, g);
        } else {
            pp = &g->next;
        }
    }
}

static void gen_error(gen *g, const kds_err *e) {
    snprintf(g->error, sizeof g->error, "%s", e->msg);
    g->reason = "error";
    g->phase = G_FINISH;
}

/* One prefill slice for every generation still feeding its prompt. */
static void prefill_step(web_engine *E) {
    for (gen *g = E->gens; g; g = g->next) {
        if (g->ing) {
            if (g->phase == G_PREFILL || g->phase == G_WAIT) ingest_step(E, g);
            continue;
        }
        if (g->phase != G_PREFILL) continue;
        if (g->cancel || g->gone) {
            /* stop before feeding the rest of the prompt */
            g->reason = g->gone ? "disconnected" : "cancelled";
            g->phase = g->fed > 0 ? G_CLOSE : G_FINISH; /* nothing fed: nothing to close */
            continue;
        }
        if (g->point_at && g->fed == g->point_at) {
            point_begin(E, g);
            continue;
        }
        int64_t n = g->n_ids - g->fed, slice = E->s->p.ctx.max_batch > 0 ? E->s->p.ctx.max_batch : 256;
        if (n > slice) n = slice;
        kds_err e = {0};
        if (eng_prefill(E->c, g->h->seq, g->ids + g->fed, n, NULL, NULL, NULL, &e) != KDS_OK) {
            gen_error(g, &e);
            continue;
        }
        g->fed += n;
        atomic_fetch_add(&E->s->metrics.tokens_prefilled, (uint64_t)n);
        if (g->fed == g->n_ids) {
            g->t_prefill_end = web__now_s();
            g->phase = g->max_tokens > 0 ? G_DECODE : G_CLOSE;
            if (g->max_tokens == 0) g->reason = "length";
        }
    }
}

/* One batched decode step over every decoding generation whose reader
 * keeps up: their next tokens sampled in one call, each with its own
 * settings (eng_sample_batch: one device launch on a GPU), then fed in one
 * forward pass. */
static void decode_step(web_engine *E) {
    int ns = 0;
    for (gen *g = E->gens; g; g = g->next) {
        g->feed = -1;
        g->sample_row = -1;
        if (g->phase == G_DECODE && (g->cancel || g->gone)) {
            g->reason = g->gone ? "disconnected" : "cancelled";
            g->phase = G_CLOSE;
        }
        if (g->phase != G_DECODE) continue;
        bool gone = false;
        if (!g->gone && web__pending(E->s, g->conn, &gone) > E->s->p.max_pending) continue;
        if (gone) g->gone = true;
        if (ns >= E->s->p.max_generations) continue;
        E->b_seqs[ns] = g->h->seq;
        E->b_params[ns] = g->sp;
        g->sample_row = ns++;
    }
    kds_err se = {0};
    kds_status src = eng_sample_batch(E->c, E->b_seqs, ns, E->b_params, E->b_sampled, &se);
    int n = 0;
    for (gen *g = E->gens; g; g = g->next) {
        if (g->phase == G_CLOSE) {
            /* a chat reply cut short is closed with <|im_end|> */
            int32_t close = srv_reply_close_token(g->rp);
            if (close >= 0) {
                g->feed = close;
                g->after = G_FINISH;
            } else {
                g->phase = G_FINISH;
            }
        } else if (g->sample_row >= 0) {
            if (src != KDS_OK) {
                gen_error(g, &se);
                continue;
            }
            if (!g->t_decode0) g->t_decode0 = web__now_s();
            srv_step st;
            kds_err e = {0};
            if (srv_reply_token(g->rp, E->b_sampled[g->sample_row], &st, &e) != KDS_OK) {
                gen_error(g, &e);
                continue;
            }
            g->produced = srv_reply_produced(g->rp);
            emit_text(E, g, st.text, st.len);
            g->feed = st.feed;
            if (st.reason) g->reason = st.reason;
            g->after = st.after == SRV_DECODE  ? G_DECODE
                       : st.after == SRV_CLOSE ? G_CLOSE
                                               : G_FINISH;
        }
        if (g->feed >= 0 && n < E->s->p.max_generations) {
            E->b_seqs[n] = g->h->seq;
            E->b_ids[n] = g->feed;
            E->b_gens[n] = g;
            n++;
        }
    }
    if (n == 0) return;
    kds_err e = {0};
    kds_status rc = eng_decode_batch(E->c, E->b_seqs, E->b_ids, n, &e);
    for (int i = 0; i < n; i++) {
        gen *g = E->b_gens[i];
        if (rc != KDS_OK) {
            gen_error(g, &e);
        } else {
            g->phase = g->after;
            if (g->hasher) sess_prefix_hasher_add(g->hasher, &E->b_ids[i], 1);
        }
    }
    atomic_fetch_add(&E->s->metrics.decode_steps, 1);
    atomic_fetch_add(&E->s->metrics.decode_rows, (uint64_t)n);
    atomic_fetch_add(&E->s->metrics.tokens_generated, (uint64_t)n);
    E->rate_tokens += (uint64_t)n;
}

static void update_rate(web_engine *E) {
    double now = web__now_s();
    if (!E->rate_t0) E->rate_t0 = now;
    double dt = now - E->rate_t0;
    if (dt < 2.0) return;
    web__rate_set(&E->s->metrics, (double)E->rate_tokens / dt);
    E->rate_t0 = now;
    E->rate_tokens = 0;
}

static bool runnable(web_engine *E) {
    for (gen *g = E->gens; g; g = g->next) {
        if (g->cancel || g->gone) return true;
        /* an ingest waiting for its next chunk, a turn paused at its resume point */
        if (g->phase == G_WAIT || g->phase == G_SAVE) continue;
        if (g->phase != G_DECODE) return true;
    }
    /* only decoding generations: runnable unless every reader is behind */
    for (gen *g = E->gens; g; g = g->next)
        if (g->phase == G_DECODE && web__pending(E->s, g->conn, NULL) <= E->s->p.max_pending)
            return true;
    return false;
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
        for (gen *g = E->gens; g; g = g->next)
            if (g->conn == r->conn) g->gone = true;
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
    double t0 = web__now_s();
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
        if (!any || (!E->stopping && web__now_s() - t0 > REQUEST_BUDGET_S)) break;
    }
}

static void *engine_main(void *arg) {
    web_server *s = arg;
    web_engine *E = s->eng;
    for (;;) {
        pthread_mutex_lock(&s->lock);
        web_req *list = s->req_head;
        s->req_head = s->req_tail = NULL;
        gen *saved = E->saved;
        E->saved = NULL;
        pthread_mutex_unlock(&s->lock);
        answer_saved(E, saved); /* first: their sessions are free for what comes */
        while (list) {
            web_req *r = list;
            list = r->next;
            take(E, r);
        }
        answer_requests(E);
        if (E->stopping)
            for (gen *g = E->gens; g; g = g->next) g->cancel = true;
        prefill_step(E);
        decode_step(E);
        remove_finished(E);
        update_rate(E);
        if (E->stopping && !E->gens && E->n_saving == 0) break;
        pthread_mutex_lock(&s->lock);
        /* (the saver signals `wake` when it hands a save back) */
        bool idle = !s->req_head && !E->gens && !E->queues && !E->saved;
        if (idle) {
            pthread_cond_wait(&s->wake, &s->lock);
        } else if (!s->req_head && !E->queues) {
            pthread_mutex_unlock(&s->lock);
            bool run = runnable(E);
            pthread_mutex_lock(&s->lock);
            if (!run && !s->req_head && !E->saved) {
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
static void saver_stop(web_engine *E) {
    if (!E->saver_started) return;
    pthread_mutex_lock(&E->save_lock);
    E->save_stop = true;
    pthread_cond_signal(&E->save_wake);
    pthread_mutex_unlock(&E->save_lock);
    pthread_join(E->saver, NULL);
    E->saver_started = false;
}

kds_status web__engine_start(web_server *s, kds_err *err) {
    web_engine *E = calloc(1, sizeof *E);
    if (!E) return kds_err_set(err, KDS_NOMEM, "out of memory");
    E->s = s;
    E->n_hot_max = s->p.max_sessions;
    E->model_chat = eng_model_chat_format(s->m);
    E->im_end = eng_tok_special_id(eng_model_tokenizer(s->m), "<|im_end|>");
    eng_ctx_params cp = s->p.ctx;
    if (cp.max_seqs < s->p.max_generations) cp.max_seqs = s->p.max_generations;
    kds_status rc = eng_ctx_create(s->m, &cp, &E->c, err);
    if (rc != KDS_OK) {
        free(E);
        return rc;
    }
    E->hots = calloc((size_t)E->n_hot_max, sizeof *E->hots);
    E->b_seqs = calloc((size_t)s->p.max_generations, sizeof *E->b_seqs);
    E->b_ids = calloc((size_t)s->p.max_generations, sizeof *E->b_ids);
    E->b_gens = calloc((size_t)s->p.max_generations, sizeof *E->b_gens);
    E->b_params = calloc((size_t)s->p.max_generations, sizeof *E->b_params);
    E->b_sampled = calloc((size_t)s->p.max_generations, sizeof *E->b_sampled);
    if (!E->hots || !E->b_seqs || !E->b_ids || !E->b_gens || !E->b_params || !E->b_sampled) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory");
        goto fail;
    }
    pthread_mutex_init(&E->save_lock, NULL);
    pthread_cond_init(&E->save_wake, NULL);
    s->eng = E;
    /* neither thread may take SIGINT/SIGTERM (the caller handles them) */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int prc = pthread_create(&E->saver, NULL, saver_main, E);
    E->saver_started = prc == 0;
    if (prc == 0) prc = pthread_create(&s->engine_thread, NULL, engine_main, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (prc != 0) {
        s->eng = NULL;
        rc = kds_err_set(err, KDS_INTERNAL, "cannot start the engine and saver threads");
        goto fail;
    }
    s->engine_started = true;
    return KDS_OK;
fail:
    saver_stop(E);
    eng_ctx_free(E->c);
    free(E->hots);
    free(E->b_seqs);
    free(E->b_ids);
    free(E->b_gens);
    free(E->b_params);
    free(E->b_sampled);
    free(E);
    return rc;
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
    saver_stop(E);
    /* none are left (stopping answers all that wait), but free what is */
    while (E->queues) drop_queue(E, &E->queues);
    for (int i = 0; i < E->n_hot_max; i++)
        if (E->hots[i].used) {
            eng_seq_free(E->hots[i].seq);
            sess_prefix_hasher_free(E->hots[i].hash);
        }
    eng_ctx_free(E->c);
    free(E->hots);
    free(E->b_seqs);
    free(E->b_ids);
    free(E->b_gens);
    free(E->b_params);
    free(E->b_sampled);
    pthread_mutex_destroy(&E->save_lock);
    pthread_cond_destroy(&E->save_wake);
    free(E);
    s->eng = NULL;
}
