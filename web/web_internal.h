/*
 * web_internal.h - what the files of web/ share: the server object, the
 * request queue (service thread -> engine thread), the per-connection event
 * queues (engine thread -> service thread), the codec and the metrics.
 *
 * Locking: `lock` guards the request queue, the connection registry and
 * every connection's event queue; it is never held across model or store
 * work. Connections are named by a 64-bit id across threads: the engine
 * thread never holds a connection pointer, so a connection may close at any
 * moment (its events are then dropped).
 */
#ifndef WEB_INTERNAL_H
#define WEB_INTERNAL_H

#include <cjson/cJSON.h>
#include <libwebsockets.h>
#include <pthread.h>
#include <stdatomic.h>

#include "kds_buf.h"
#include "srv.h"
#include "web.h"

#define WEB_PROTOCOL "kdaserve.v1"
#define WEB_TENANT_MAX 16
#define WEB_ID_MAX 64

/* One event waiting to be written. Other events are encoded when queued
 * (so that the pending bytes are what will be written); token events keep
 * their text apart so that tokens produced before the next write join one
 * frame, and are encoded when written. */
typedef struct web_event {
    struct web_event *next;
    unsigned char *frame; /* owned: the encoded frame after LWS_PRE bytes (not for tokens) */
    size_t frame_len;
    cJSON *ev;          /* owned, token events only: {"id","event":"token"} without text */
    bool msgpack;       /* a msgpack binary frame */
    uint64_t token_of;  /* generation serial for a token event, else 0 */
    kds_buf text;       /* token text so far (token events) */
    size_t bytes;       /* counted in the connection's pending bytes */
    /* HTTP connections (web_http.c): an event is the response head
     * (http_status != 0: status, content type and length, no body bytes) or
     * body bytes after LWS_PRE in `frame`; token events become server-sent
     * event chunks built from the connection's template when written. */
    int http_status;
    const char *http_type; /* static string: the Content-Type of a head */
    int64_t http_len;      /* head: Content-Length, -1 = until the connection closes (SSE) */
    bool last;             /* the response's last event */
} web_event;

/* A connection. The service thread owns it; the fields after `shared` are
 * guarded by the server lock and read by the engine thread through the id. */
typedef struct web_conn {
    uint64_t id;
    struct lws *wsi;
    struct web_conn *next;       /* registry */
    kds_buf rx;                  /* message being reassembled (at most max_message bytes) */
    bool authed;
    char tenant[WEB_TENANT_MAX + 1];
    int64_t last_seen_us;
    bool rx_paused;              /* reading stopped: too much output is waiting */
    /* shared */
    web_event *head, *tail;
    size_t pending;              /* bytes queued and not yet written */
    int queued;                  /* requests waiting for the engine or being handled */
    int close_code;              /* close after the queue drains (0 = no) */
    /* HTTP (web_http.c): one web_conn per request on an HTTP connection */
    bool http;
    cJSON *sse_tmpl; /* owned: a stream's chunk without its text (engine sets it) */
    bool sse_chat;   /* the text goes to choices[0].delta.content, else .text */
} web_conn;

/* A request handed to the engine thread. */
typedef enum web_req_kind { WEB_REQ_OP, WEB_REQ_CLOSED, WEB_REQ_STOP } web_req_kind;

/* The OpenAI-compatible endpoint an HTTP request asked for (docs/http-api.md). */
typedef enum web_route {
    WEB_ROUTE_WS = 0, /* not HTTP: a kdaserve.v1 operation */
    WEB_ROUTE_MODELS,
    WEB_ROUTE_CHAT,
    WEB_ROUTE_COMPLETIONS,
} web_route;

typedef struct web_req {
    struct web_req *next;
    web_req_kind kind;
    uint64_t conn;
    cJSON *msg;                  /* owned; the parsed request */
    bool msgpack;
    bool auth;                   /* the server uses tenants */
    char tenant[WEB_TENANT_MAX + 1];
    double t_arrive;             /* kds_now_s() */
    web_route route;             /* HTTP: the endpoint; msg is the body (NULL for GET) */
    char session_hdr[SESS_NAME_MAX + 1]; /* HTTP: the X-Kdaserve-Session header ("" = none) */
} web_req;

/* Counters for /metrics and `stats`. Written by either thread with atomics. */
#define WEB_LAT_BUCKETS 12
typedef struct web_hist {
    _Atomic uint64_t bucket[WEB_LAT_BUCKETS + 1]; /* cumulative <= bound, +Inf last */
    _Atomic uint64_t count;
    _Atomic uint64_t sum_us;
} web_hist;

enum { WEB_ERR_BAD_REQUEST, WEB_ERR_UNKNOWN_OP, WEB_ERR_UNAUTHENTICATED, WEB_ERR_NOT_FOUND,
       WEB_ERR_EXISTS, WEB_ERR_BUSY, WEB_ERR_LIMIT, WEB_ERR_CORRUPT, WEB_ERR_MISMATCH, WEB_ERR_IO,
       WEB_ERR_INTERNAL, WEB_ERR_COUNT };

typedef struct web_metrics {
    _Atomic int64_t connections, sessions_hot, generations_active;
    _Atomic uint64_t connections_total, requests_total, generations_total;
    _Atomic uint64_t tokens_generated, tokens_prefilled, decode_steps, decode_rows;
    _Atomic uint64_t errors[WEB_ERR_COUNT];
    _Atomic uint64_t closes_too_large, closes_auth, closes_limit;
    web_hist save_ms, restore_ms, ttft_ms;
    /* recent decode rate (engine thread writes, others read) */
    _Atomic uint64_t rate_bits;  /* double tokens/s over the last window, as bits */
} web_metrics;

typedef struct web_tenant {
    char *token;
    size_t token_len;
    char name[WEB_TENANT_MAX + 1];
} web_tenant;

typedef struct web_engine web_engine;

struct web_server {
    web_params p;
    char listen_host[256];
    int port;
    eng_model *m;
    sess_store *st;
    struct lws_context *lws;
    struct lws_vhost *vhost;
    /* libwebsockets keeps pointers to these for the context's lifetime */
    struct lws_protocols protocols[3];
    struct lws_http_mount mount_www, mount_metrics, mount_v1;
    struct lws_protocol_vhost_options pvo, pvo_default;
    lws_retry_bo_t retry;
    atomic_bool stop;
    int64_t started_us;
    /* auth */
    web_tenant *tenants;
    size_t n_tenants;
    /* shared state */
    pthread_mutex_t lock;
    pthread_cond_t wake;         /* engine thread waits here for requests and saved turns */
    web_req *req_head, *req_tail;
    int n_queued;                /* requests of every connection waiting or being handled */
    web_conn *conns;
    uint64_t next_conn_id;
    int n_conns;
    /* engine thread */
    pthread_t engine_thread;
    bool engine_started;
    web_engine *eng;
    web_metrics metrics;
    char *www_dir;
};

/* -- time ---------------------------------------------------------------- */
int64_t web__now_us(void);

/* -- codec (web_codec.c) -------------------------------------------------- */
/* Parse one message: JSON text or msgpack map, into a cJSON object whose
 * keys and strings are all valid UTF-8 without NUL. NULL with a message in
 * err on anything else (the message never repeats the request's bytes). */
cJSON *web__parse(const void *p, size_t len, bool binary, kds_err *err);
/* Encode an event into a new buffer with LWS_PRE bytes of headroom.
 * *len is the payload length (after the headroom). NULL on out-of-memory.
 * Numbers with no fraction below 2^63 become integers (JSON literals without
 * exponent, msgpack ints); text that is not UTF-8 gets U+FFFD per bad byte. */
unsigned char *web__encode(const cJSON *ev, bool msgpack, size_t *len);
/* Is p[0 .. n) well-formed UTF-8 (no overlongs, surrogates or code points
 * above U+10FFFF)? *bad_at (may be NULL) receives the first bad offset. */
bool web__utf8_valid(const void *p, size_t n, size_t *bad_at);
/* The length of the longest prefix of string s of at most max bytes that
 * does not end inside a UTF-8 character (for "%.*s" in messages). */
size_t web__utf8_prefix(const char *s, size_t max);
/* Cut a character that a byte limit left incomplete at the end of s. */
void web__utf8_trim(char *s);
/* The number of bytes (0-3) at the end of p[0 .. n) that begin a UTF-8
 * character without finishing it (bytes that can begin none count as 0: the
 * validity check then refuses them). */
size_t web__utf8_partial_tail(const void *p, size_t n);
/* Strict base64 (RFC 4648 alphabet, padded, no whitespace): n % 4 == 0 and
 * '=' only at the end. out needs n / 4 * 3 bytes. False on anything else. */
bool web__b64_decode(const char *s, size_t n, unsigned char *out, size_t *out_len);

/* -- events (web_server.c) ------------------------------------------------ */
/* Queue `ev` (ownership taken) for connection `conn`; dropped if it is gone.
 * Wakes the service thread. */
void web__send(web_server *s, uint64_t conn, cJSON *ev, bool msgpack);
/* Append token text for generation `serial` (joins the queued token event
 * of the same generation when it has not been written yet). */
void web__send_token(web_server *s, uint64_t conn, const cJSON *id, bool msgpack,
                     uint64_t serial, const char *text, size_t len);
/* Bytes queued for `conn` (0 when it is gone); *gone tells which. */
size_t web__pending(web_server *s, uint64_t conn, bool *gone);
/* Free an event; append one to c's queue (the caller holds the lock). */
void web__event_free(web_event *e);
void web__enqueue(web_conn *c, web_event *e);
/* LWS_CALLBACK_HTTP_CONFIRM_UPGRADE: 0 to go on, 1 after a 400 naming kdaserve.v1. */
int web__confirm_upgrade(struct lws *wsi, const char *upgrade);
/* The connection of id `conn`, or NULL; the caller holds the lock. */
web_conn *web__conn_find(web_server *s, uint64_t conn);
/* An event {"id": id, "event": name}; id is copied (NULL = null). */
cJSON *web__event(const cJSON *id, const char *name);
/* An error event with a stable code (WEB_ERR_*) and a message. Counts it. */
cJSON *web__error(web_server *s, const cJSON *id, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* The protocol's code for a kds_status. */
int web__code_of(kds_status st);

/* -- OpenAI-compatible requests (web_openai.c) ---------------------------- */
#define WEB_STOP_COUNT SRV_STOP_COUNT /* stop strings of one request (OpenAI's limit) */
#define WEB_STOP_MAX SRV_STOP_MAX     /* bytes of one stop string */

/* A checked /v1/chat/completions or /v1/completions request. */
typedef struct web_oai {
    web_route route;
    bool stream, include_usage;
    bool ignore_eos; /* kdaserve's extension: stop tokens do not end the reply */
    eng_sampler_params sp;
    int64_t max_tokens; /* -1 = not given */
    bool has_seed;
    uint64_t seed;
    char stop[WEB_STOP_COUNT][WEB_STOP_MAX + 1];
    int n_stop;
    char session[SESS_NAME_MAX + 1]; /* the "session" extension ("" = none) */
    bool chat;                       /* rendered in the tokenizer's chat format */
    int32_t *ids;                    /* owned: the whole request as tokens */
    int64_t n_ids;
    char *prompt; /* owned: the text the transcript keeps */
    size_t prompt_len;
} web_oai;

/* Why a request was refused, in OpenAI's terms. */
typedef struct web_oai_err {
    int status;     /* HTTP status */
    char param[64]; /* "" = null */
    char code[48];  /* "" = null */
    char msg[400];
} web_oai_err;

/* Check `body` for endpoint `route` (CHAT or COMPLETIONS) and render it with
 * `tok`: the messages in the tokenizer's chat format with the generation
 * prompt (plain "Role: text" paragraphs when it has none), a prompt as plain
 * text (BOS only when empty). `model_id` is the one model served. True and
 * *q filled (free with web__oai_free), or false with *e and nothing kept. */
bool web__oai_parse(const cJSON *body, web_route route, const eng_tokenizer *tok,
                    const char *model_id, web_oai *q, web_oai_err *e);
void web__oai_free(web_oai *q);

/* -- HTTP responses (web_http.c) ------------------------------------------ */
/* Queue the head of an HTTP response for request connection `conn`: status,
 * content type (a static string) and length (-1: a stream that ends when the
 * connection closes). */
void web__http_head(web_server *s, uint64_t conn, int status, const char *type, int64_t len);
/* Queue body bytes (copied); `last` ends the response. */
void web__http_body(web_server *s, uint64_t conn, const char *p, size_t len, bool last);
/* A whole JSON response (head and body; ev freed). */
void web__http_json(web_server *s, uint64_t conn, int status, cJSON *ev);
/* An error response in OpenAI's shape {"error":{"message","type","param","code"}};
 * param and code may be NULL (JSON null). */
void web__http_error(web_server *s, uint64_t conn, int status, const char *type, const char *param,
                     const char *code, const char *fmt, ...) __attribute__((format(printf, 7, 8)));
/* The chunk template of a stream (ownership taken): token text joined by
 * web__send_token goes into choices[0].delta.content (chat) or
 * choices[0].text when written. */
void web__http_stream_template(web_server *s, uint64_t conn, cJSON *tmpl, bool chat);
/* The service thread's part: the /v1 callback (web_server.c's http_cb
 * hands /v1 requests here) and the writer of queued HTTP events. */
int web__http_cb(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in,
                 size_t len);
size_t web__http_pss_size(void);

/* -- engine thread (web_engine.c) ----------------------------------------- */
kds_status web__engine_start(web_server *s, kds_err *err);
/* Queue a request for the engine thread (ownership of r taken). */
void web__submit(web_server *s, web_req *r);
/* Queue request r of connection c (service thread; ownership taken on
 * success). False, and nothing queued, when c has max_queue requests
 * waiting, or when max_queue_total wait in all and c has one at least (so
 * that others' floods never shut out a connection that waits for nothing). */
bool web__submit_op(web_server *s, web_conn *c, web_req *r);
/* Connection `conn` closed (service thread): its requests not yet taken by
 * the engine are freed, and the engine is told to drop the rest. */
void web__submit_closed(web_server *s, uint64_t conn);
/* Stop: cancel generations, save their sessions, join. */
void web__engine_stop(web_server *s);

/* -- auth (web_auth.c) ---------------------------------------------------- */
/* Zero n bytes that held a secret (volatile stores: not optimised away). */
void web__wipe(void *p, size_t n);
kds_status web__auth_load(web_server *s, const char *path, kds_err *err);
/* The tenant of `token` or NULL; compares every token in constant time. */
const char *web__auth_check(const web_server *s, const char *token, size_t len);
void web__auth_free(web_server *s);

/* -- metrics (web_metrics.c) ---------------------------------------------- */
void web__hist_add(web_hist *h, double ms);
/* The recent decode rate (tokens/s, all streams): set by the engine thread,
 * read by any. */
void web__rate_set(web_metrics *m, double tokens_per_s);
double web__rate_get(web_metrics *m);
/* The protocol's name of a WEB_ERR_* code ("not_found"). */
const char *web__code_name(int code);
/* Prometheus text; caller frees. */
char *web__metrics_text(web_server *s, size_t *len);

#endif /* WEB_INTERNAL_H */
