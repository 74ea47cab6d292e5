/*
 * web_server.c - the service thread: libwebsockets setup, connections,
 * message reassembly, auth, the event queues and their writing, static files
 * at / and Prometheus text at /metrics.
 *
 * libwebsockets rules followed here (reference/libs.md §1): the protocol is
 * the vhost default (clients that offer no subprotocol still reach it); one
 * lws_write per WRITEABLE callback; other threads only call
 * lws_cancel_service, and WAIT_CANCELLED asks for WRITEABLE on every
 * connection with queued events; message size is capped here, since lws has
 * no limit; permessage-deflate is not offered.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "web_internal.h"
#include "kds_clock.h"

int64_t web__now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

web_params web_default_params(void) {
    web_params p = {0};
    p.listen = "127.0.0.1:8080";
    p.max_message = 1u << 20;
    p.max_http_body = (size_t)64 << 20;
    p.max_pending = 256u << 10;
    p.max_queue = 64;
    p.max_queue_total = 1024;
    p.max_connections = 256;
    p.max_sessions = 64;
    p.max_generations = 32;
    p.max_tokens = 4096;
    p.idle_timeout_s = 300;
    p.ctx = srv_sched_default_params().ctx; /* the scheduler's slice, not one stream's step */
    return p;
}

static void log_line(web_server *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void log_line(web_server *s, const char *fmt, ...) {
    if (s->p.quiet) return;
    va_list ap;
    va_start(ap, fmt);
    fputs("kdaserve serve: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* ------------------------------------------------------------------------ */
/* Events                                                                    */

cJSON *web__event(const cJSON *id, const char *name) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddItemToObject(o, "id", id ? cJSON_Duplicate(id, 1) : cJSON_CreateNull());
    cJSON_AddStringToObject(o, "event", name);
    return o;
}

cJSON *web__error(web_server *s, const cJSON *id, int code, const char *fmt, ...) {
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    web__utf8_trim(msg); /* the size limit cuts at a byte */
    if (code < 0 || code >= WEB_ERR_COUNT) code = WEB_ERR_INTERNAL;
    atomic_fetch_add(&s->metrics.errors[code], 1);
    cJSON *o = web__event(id, "error");
    if (!o) return NULL;
    cJSON_AddStringToObject(o, "code", web__code_name(code));
    cJSON_AddStringToObject(o, "message", msg);
    return o;
}

int web__code_of(kds_status st) {
    switch (st) {
    case KDS_INVALID_ARG: return WEB_ERR_BAD_REQUEST;
    case KDS_NOT_FOUND: return WEB_ERR_NOT_FOUND;
    case KDS_EXISTS: return WEB_ERR_EXISTS;
    case KDS_BUSY: return WEB_ERR_BUSY;
    case KDS_CORRUPT: return WEB_ERR_CORRUPT;
    case KDS_MISMATCH: return WEB_ERR_MISMATCH;
    case KDS_IO: return WEB_ERR_IO;
    case KDS_TOO_LARGE: return WEB_ERR_LIMIT;
    default: return WEB_ERR_INTERNAL;
    }
}

web_conn *web__conn_find(web_server *s, uint64_t id) {
    for (web_conn *c = s->conns; c; c = c->next)
        if (c->id == id) return c;
    return NULL;
}

void web__event_free(web_event *e) {
    free(e->frame);
    cJSON_Delete(e->ev);
    kds_buf_free(&e->text);
    free(e);
}

void web__enqueue(web_conn *c, web_event *e) {
    if (c->tail)
        c->tail->next = e;
    else
        c->head = e;
    c->tail = e;
    c->pending += e->bytes;
}

void web__send(web_server *s, uint64_t conn, cJSON *ev, bool msgpack) {
    if (!ev) return;
    /* encoded here, by the sender's thread, so that the connection's pending
     * bytes are the frame's and the service thread only writes */
    web_event *e = calloc(1, sizeof *e);
    if (e) e->frame = web__encode(ev, msgpack, &e->frame_len);
    cJSON_Delete(ev);
    pthread_mutex_lock(&s->lock);
    web_conn *c = web__conn_find(s, conn);
    if (c && e && e->frame) {
        e->msgpack = msgpack;
        e->bytes = e->frame_len;
        web__enqueue(c, e);
        e = NULL;
    } else if (c) {
        /* out of memory: an answer would be missing, so the client is told
         * by the close instead */
        c->close_code = LWS_CLOSE_STATUS_UNEXPECTED_CONDITION;
    }
    pthread_mutex_unlock(&s->lock);
    if (e) web__event_free(e);
    if (c) lws_cancel_service(s->lws);
}

void web__send_token(web_server *s, uint64_t conn, const cJSON *id, bool msgpack,
                     uint64_t serial, const char *text, size_t len) {
    if (!len) return;
    pthread_mutex_lock(&s->lock);
    web_conn *c = web__conn_find(s, conn);
    if (!c) {
        pthread_mutex_unlock(&s->lock);
        return;
    }
    web_event *e = c->tail;
    bool fresh = !(e && e->token_of == serial);
    if (fresh) {
        /* allocation under the lock is rare (once per written frame) and short */
        e = calloc(1, sizeof *e);
        /* an HTTP stream's chunk is built from its template when written */
        if (!e || (!c->http && !(e->ev = web__event(id, "token")))) {
            free(e);
            pthread_mutex_unlock(&s->lock);
            return;
        }
        e->msgpack = msgpack;
        e->token_of = serial;
        e->bytes = 48;
    }
    if (kds_buf_append(&e->text, text, len, NULL) != KDS_OK) {
        if (fresh) web__event_free(e);
        pthread_mutex_unlock(&s->lock);
        return;
    }
    e->bytes += len;
    c->pending += len;
    if (fresh) web__enqueue(c, e);
    pthread_mutex_unlock(&s->lock);
    /* Text joined to an event still queued needs no wake-up: the service
     * thread was woken when that event was queued and has not written it. */
    if (fresh) lws_cancel_service(s->lws);
}

size_t web__pending(web_server *s, uint64_t conn, bool *gone) {
    pthread_mutex_lock(&s->lock);
    web_conn *c = web__conn_find(s, conn);
    size_t n = c ? c->pending : 0;
    if (gone) *gone = c == NULL;
    pthread_mutex_unlock(&s->lock);
    return n;
}

/* ------------------------------------------------------------------------ */
/* Requests                                                                  */

static void reply_now(web_server *s, web_conn *c, cJSON *ev, bool msgpack) {
    web__send(s, c->id, ev, msgpack);
}

/* A request's id: absent, null, an integer or a short string. */
static bool valid_id(const cJSON *id) {
    if (!id || cJSON_IsNull(id)) return true;
    if (cJSON_IsNumber(id))
        return id->valuedouble == floor(id->valuedouble) && fabs(id->valuedouble) < 9007199254740992.0;
    return cJSON_IsString(id) && strlen(id->valuestring) <= WEB_ID_MAX;
}

static void handle_message(web_server *s, web_conn *c, const unsigned char *p, size_t len,
                           bool binary) {
    kds_err e = {0};
    atomic_fetch_add(&s->metrics.requests_total, 1);
    cJSON *msg = web__parse(p, len, binary, &e);
    if (!msg) {
        reply_now(s, c, web__error(s, NULL, WEB_ERR_BAD_REQUEST, "%s", e.msg), binary);
        return;
    }
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(msg, "id");
    if (!valid_id(id)) {
        reply_now(s, c,
                  web__error(s, NULL, WEB_ERR_BAD_REQUEST,
                             "'id' must be an integer or a string of at most %d bytes", WEB_ID_MAX),
                  binary);
        cJSON_Delete(msg);
        return;
    }
    const cJSON *op = cJSON_GetObjectItemCaseSensitive(msg, "op");
    if (!cJSON_IsString(op)) {
        reply_now(s, c, web__error(s, id, WEB_ERR_BAD_REQUEST, "'op' (a string) is missing"),
                  binary);
        cJSON_Delete(msg);
        return;
    }
    bool auth = s->n_tenants > 0;
    if (!strcmp(op->valuestring, "auth")) {
        const cJSON *tok = cJSON_GetObjectItemCaseSensitive(msg, "token");
        if (!cJSON_IsString(tok)) {
            reply_now(s, c, web__error(s, id, WEB_ERR_BAD_REQUEST, "'token' (a string) is missing"),
                      binary);
        } else if (!auth) {
            cJSON *r = web__event(id, "result");
            cJSON_AddStringToObject(r, "tenant", "");
            reply_now(s, c, r, binary);
        } else {
            const char *tenant = web__auth_check(s, tok->valuestring, strlen(tok->valuestring));
            if (!tenant) {
                reply_now(s, c, web__error(s, id, WEB_ERR_UNAUTHENTICATED, "wrong token"), binary);
                pthread_mutex_lock(&s->lock);
                c->close_code = LWS_CLOSE_STATUS_POLICY_VIOLATION;
                pthread_mutex_unlock(&s->lock);
                atomic_fetch_add(&s->metrics.closes_auth, 1);
            } else {
                c->authed = true;
                snprintf(c->tenant, sizeof c->tenant, "%s", tenant);
                cJSON *r = web__event(id, "result");
                cJSON_AddStringToObject(r, "tenant", tenant);
                reply_now(s, c, r, binary);
            }
        }
        cJSON_Delete(msg);
        return;
    }
    if (auth && !c->authed) {
        reply_now(s, c,
                  web__error(s, id, WEB_ERR_UNAUTHENTICATED,
                             "authenticate first: {\"op\":\"auth\",\"token\":...} or an "
                             "Authorization: Bearer header"),
                  binary);
        cJSON_Delete(msg);
        return;
    }
    if (!strcmp(op->valuestring, "ping")) {
        reply_now(s, c, web__event(id, "result"), binary);
        cJSON_Delete(msg);
        return;
    }
    web_req *r = calloc(1, sizeof *r);
    if (!r) {
        reply_now(s, c, web__error(s, id, WEB_ERR_INTERNAL, "out of memory"), binary);
        cJSON_Delete(msg);
        return;
    }
    r->kind = WEB_REQ_OP;
    r->conn = c->id;
    r->msg = msg;
    r->msgpack = binary;
    r->auth = auth;
    snprintf(r->tenant, sizeof r->tenant, "%s", c->tenant);
    r->t_arrive = kds_now_s();
    if (!web__submit_op(s, c, r)) {
        /* refused here, at once: a flood costs the engine nothing */
        reply_now(s, c,
                  web__error(s, id, WEB_ERR_LIMIT,
                             "too many requests waiting (%d of this connection, --max-queue; %d "
                             "in all, --max-queue-total); wait for answers before sending more",
                             s->p.max_queue, s->p.max_queue_total),
                  binary);
        cJSON_Delete(msg);
        free(r);
    }
}

/* ------------------------------------------------------------------------ */
/* WebSocket callback                                                        */

typedef struct ws_pss {
    web_conn *c;
} ws_pss;

static void hello(web_server *s, web_conn *c) {
    cJSON *h = web__event(NULL, "hello");
    if (!h) return;
    cJSON_AddStringToObject(h, "protocol", WEB_PROTOCOL);
    cJSON_AddStringToObject(h, "server", "kdaserve 0.1.0");
    const char *dir = eng_model_dir(s->m), *base = strrchr(dir, '/');
    cJSON_AddStringToObject(h, "model", base && base[1] ? base + 1 : dir);
    cJSON_AddBoolToObject(h, "auth_required", s->n_tenants > 0 && !c->authed);
    reply_now(s, c, h, false);
}

/* Does a Sec-WebSocket-Protocol list ("a, b,c") name `want`? */
static bool offers(const char *list, const char *want) {
    size_t wn = strlen(want);
    for (const char *p = list; *p;) {
        while (*p == ' ' || *p == '\t' || *p == ',') p++;
        const char *q = p;
        while (*q && *q != ',' && *q != ' ' && *q != '\t') q++;
        if ((size_t)(q - p) == wn && !memcmp(p, want, wn)) return true;
        p = q;
    }
    return false;
}

/* A plain-text HTTP answer on a connection that asked to upgrade (h1:
 * headers and body in one write, as lws_return_http_status does). */
static int http_answer(struct lws *wsi, unsigned status, const char *text) {
    unsigned char buf[LWS_PRE + 1024], *start = buf + LWS_PRE, *p = start, *end = buf + sizeof buf;
    size_t n = strlen(text);
    if (lws_add_http_common_headers(wsi, status, "text/plain; charset=utf-8", (lws_filepos_t)n, &p,
                                    end) ||
        lws_finalize_http_header(wsi, &p, end) || (size_t)(end - p) < n)
        return -1;
    memcpy(p, text, n);
    p += n;
    int len = lws_ptr_diff(p, start);
    return lws_write(wsi, start, (size_t)len, LWS_WRITE_HTTP) == len ? 1 : -1;
}

/* LWS_CALLBACK_HTTP_CONFIRM_UPGRADE: an upgrade that offers subprotocols but
 * not ours would get no HTTP answer at all from lws (it drops the TCP
 * connection), so it is answered here: 400 naming the one we speak. lws
 * reads the list into 127 bytes and drops longer ones too. Returns the
 * callback's value: 0 goes on with the upgrade, 1 after an answer. */
int web__confirm_upgrade(struct lws *wsi, const char *upgrade) {
    if (!upgrade || strcasecmp(upgrade, "websocket")) return 0;
    char list[128];
    int n = lws_hdr_total_length(wsi, WSI_TOKEN_PROTOCOL);
    if (n == 0) return 0; /* none offered: served version 1 */
    if (n < (int)sizeof list - 1 && lws_hdr_copy(wsi, list, sizeof list, WSI_TOKEN_PROTOCOL) > 0 &&
        offers(list, WEB_PROTOCOL))
        return 0;
    return http_answer(wsi, HTTP_STATUS_BAD_REQUEST,
                       n >= (int)sizeof list - 1
                           ? "Sec-WebSocket-Protocol is longer than 126 bytes; offer kdaserve.v1\n"
                           : "none of the offered WebSocket subprotocols is supported; this server "
                             "speaks kdaserve.v1 (docs/protocol.md)\n");
}

/* Auth by header at the upgrade: "Authorization: Bearer TOKEN". */
static int header_auth(web_server *s, struct lws *wsi, web_conn *c) {
    char buf[512];
    int n = lws_hdr_copy(wsi, buf, sizeof buf, WSI_TOKEN_HTTP_AUTHORIZATION);
    if (n <= 0) return 0;
    int rc = 0;
    if (strncmp(buf, "Bearer ", 7) != 0) {
        rc = -1;
    } else {
        const char *tenant = web__auth_check(s, buf + 7, strlen(buf + 7));
        if (!tenant) {
            rc = -1;
        } else {
            c->authed = true;
            snprintf(c->tenant, sizeof c->tenant, "%s", tenant);
        }
    }
    web__wipe(buf, sizeof buf);
    return rc;
}

static int write_one(web_server *s, struct lws *wsi, web_conn *c) {
    pthread_mutex_lock(&s->lock);
    web_event *e = c->head;
    if (e) {
        c->head = e->next;
        if (!c->head) c->tail = NULL;
        c->pending -= e->bytes;
    }
    bool more = c->head != NULL;
    bool drained = c->pending <= s->p.max_pending / 2;
    int close_code = c->close_code;
    pthread_mutex_unlock(&s->lock);
    if (c->rx_paused && drained) {
        /* the client reads again: read its requests again */
        c->rx_paused = false;
        lws_rx_flow_control(wsi, 1);
    }
    if (!e) {
        if (close_code) {
            const char *why = close_code == LWS_CLOSE_STATUS_POLICY_VIOLATION ? "wrong token"
                              : close_code == LWS_CLOSE_STATUS_GOINGAWAY    ? "server shutting down"
                              : close_code == LWS_CLOSE_STATUS_UNEXPECTED_CONDITION
                                  ? "server out of memory"
                                  : "closing";
            lws_close_reason(wsi, (enum lws_close_status)close_code, (unsigned char *)why,
                             strlen(why));
            return -1;
        }
        return 0;
    }
    if (e->token_of) {
        cJSON_AddStringToObject(e->ev, "text", kds_buf_str(&e->text));
        e->frame = web__encode(e->ev, e->msgpack, &e->frame_len);
    }
    bool binary = e->msgpack;
    unsigned char *buf = e->frame;
    size_t len = e->frame_len;
    int n = buf ? lws_write(wsi, buf + LWS_PRE, len, binary ? LWS_WRITE_BINARY : LWS_WRITE_TEXT)
                : -1;
    web__event_free(e);
    if (n < (int)len) return -1;
    if (more || close_code) lws_callback_on_writable(wsi);
    return 0;
}

static int ws_cb(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in,
                 size_t len) {
    web_server *s = lws_context_user(lws_get_context(wsi));
    ws_pss *pss = user;
    switch (reason) {
    case LWS_CALLBACK_ESTABLISHED: {
        if (s->n_conns >= s->p.max_connections) {
            atomic_fetch_add(&s->metrics.closes_limit, 1);
            lws_close_reason(wsi, (enum lws_close_status)1013, (unsigned char *)"too many connections",
                             20);
            return -1;
        }
        web_conn *c = calloc(1, sizeof *c);
        if (!c) return -1;
        c->wsi = wsi;
        c->last_seen_us = web__now_us();
        bool wrong_token = s->n_tenants && header_auth(s, wsi, c) != 0;
        pthread_mutex_lock(&s->lock);
        c->id = ++s->next_conn_id;
        c->next = s->conns;
        s->conns = c;
        s->n_conns++;
        pthread_mutex_unlock(&s->lock);
        pss->c = c;
        atomic_fetch_add(&s->metrics.connections, 1);
        atomic_fetch_add(&s->metrics.connections_total, 1);
        hello(s, c);
        if (wrong_token) {
            /* as for a wrong token of the auth op: the error, then close 1008 */
            reply_now(s, c,
                      web__error(s, NULL, WEB_ERR_UNAUTHENTICATED,
                                 "wrong token in the Authorization header (expected 'Bearer "
                                 "TOKEN' with a token of the auth file)"),
                      false);
            pthread_mutex_lock(&s->lock);
            c->close_code = LWS_CLOSE_STATUS_POLICY_VIOLATION;
            pthread_mutex_unlock(&s->lock);
            atomic_fetch_add(&s->metrics.closes_auth, 1);
        }
        return 0;
    }
    case LWS_CALLBACK_RECEIVE: {
        web_conn *c = pss ? pss->c : NULL;
        if (!c) return -1;
        if (c->close_code) return 0; /* closing: ignore the rest */
        /* The frame's header declared how much more is coming: judge that
         * now rather than after max_message bytes have arrived (lws calls
         * here from the frame's first payload bytes on, never for a header
         * alone). */
        size_t have = c->rx.len + len;
        if (have > s->p.max_message || lws_remaining_packet_payload(wsi) > s->p.max_message - have) {
            atomic_fetch_add(&s->metrics.closes_too_large, 1);
            lws_close_reason(wsi, LWS_CLOSE_STATUS_MESSAGE_TOO_LARGE,
                             (unsigned char *)"message too large", 17);
            return -1;
        }
        if (kds_buf_append(&c->rx, in, len, NULL) != KDS_OK) return -1;
        if (lws_is_final_fragment(wsi)) {
            handle_message(s, c, c->rx.p, c->rx.len, lws_frame_is_binary(wsi) != 0);
            kds_buf_reset(&c->rx);
            /* A client that does not read its answers stops being read: what
             * waits for it stays near max_pending however fast it sends
             * (write_one reads it again once half of that is gone). */
            pthread_mutex_lock(&s->lock);
            bool behind = c->pending > s->p.max_pending;
            pthread_mutex_unlock(&s->lock);
            if (behind && !c->rx_paused) {
                c->rx_paused = true;
                lws_rx_flow_control(wsi, 0);
            }
        }
        return 0;
    }
    case LWS_CALLBACK_SERVER_WRITEABLE:
        return pss && pss->c ? write_one(s, wsi, pss->c) : 0;
    case LWS_CALLBACK_CLOSED: {
        web_conn *c = pss ? pss->c : NULL;
        if (!c) return 0;
        pss->c = NULL;
        pthread_mutex_lock(&s->lock);
        for (web_conn **pp = &s->conns; *pp; pp = &(*pp)->next)
            if (*pp == c) {
                *pp = c->next;
                break;
            }
        s->n_conns--;
        web_event *e = c->head;
        c->head = c->tail = NULL;
        pthread_mutex_unlock(&s->lock);
        while (e) {
            web_event *next = e->next;
            web__event_free(e);
            e = next;
        }
        atomic_fetch_sub(&s->metrics.connections, 1);
        web__submit_closed(s, c->id);
        kds_buf_free(&c->rx);
        free(c);
        return 0;
    }
    case LWS_CALLBACK_HTTP_CONFIRM_UPGRADE: return web__confirm_upgrade(wsi, in);
    case LWS_CALLBACK_EVENT_WAIT_CANCELLED:
        /* several cancels may collapse into one: serve every queue */
        pthread_mutex_lock(&s->lock);
        for (web_conn *c = s->conns; c; c = c->next)
            if (c->head || c->close_code) lws_callback_on_writable(c->wsi);
        pthread_mutex_unlock(&s->lock);
        return 0;
    default:
        /* As the vhost's default protocol this one also receives the HTTP
         * callbacks of kept-alive connections after their first request
         * (static files): lws's own handler serves those. */
        return lws_callback_http_dummy(wsi, reason, user, in, len);
    }
}

/* ------------------------------------------------------------------------ */
/* Lifecycle                                                                 */

static kds_status parse_listen(web_server *s, const char *listen, kds_err *err) {
    const char *colon = strrchr(listen, ':');
    if (!colon || colon == listen)
        return kds_err_set(err, KDS_INVALID_ARG, "--listen '%s': expected HOST:PORT", listen);
    size_t hl = (size_t)(colon - listen);
    const char *h = listen;
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') h++, hl -= 2; /* [::1]:8080 */
    if (hl == 0 || hl >= sizeof s->listen_host)
        return kds_err_set(err, KDS_INVALID_ARG, "--listen '%s': bad host", listen);
    memcpy(s->listen_host, h, hl);
    s->listen_host[hl] = '\0';
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (!colon[1] || *end || port < 0 || port > 65535)
        return kds_err_set(err, KDS_INVALID_ARG, "--listen '%s': port must be 0-65535", listen);
    s->port = (int)port;
    return KDS_OK;
}

kds_status web_server_create(const web_params *p, eng_model *m, sess_store *st,
                             web_server **out, kds_err *err) {
    *out = NULL;
    web_server *s = calloc(1, sizeof *s);
    if (!s) return kds_err_set(err, KDS_NOMEM, "out of memory");
    s->p = p ? *p : web_default_params();
    web_params d = web_default_params();
    if (!s->p.listen) s->p.listen = d.listen;
    if (!s->p.max_message) s->p.max_message = d.max_message;
    if (!s->p.max_pending) s->p.max_pending = d.max_pending;
    if (!s->p.max_http_body) s->p.max_http_body = d.max_http_body;
    if (s->p.max_queue <= 0) s->p.max_queue = d.max_queue;
    if (s->p.max_queue_total <= 0) s->p.max_queue_total = d.max_queue_total;
    if (s->p.max_connections <= 0) s->p.max_connections = d.max_connections;
    if (s->p.max_sessions <= 0) s->p.max_sessions = d.max_sessions;
    if (s->p.max_generations <= 0) s->p.max_generations = d.max_generations;
    if (s->p.max_tokens <= 0) s->p.max_tokens = d.max_tokens;
    if (s->p.idle_timeout_s <= 0) s->p.idle_timeout_s = d.idle_timeout_s;
    s->m = m;
    s->st = st;
    s->started_us = web__now_us();
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->wake, NULL);
    kds_status rc = parse_listen(s, s->p.listen, err);
    if (rc != KDS_OK) goto fail;
    if (s->p.auth_file && (rc = web__auth_load(s, s->p.auth_file, err)) != KDS_OK) goto fail;
    if (s->p.www_dir && !(s->www_dir = strdup(s->p.www_dir))) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory");
        goto fail;
    }

    lws_set_log_level(LLL_ERR, NULL);
    s->protocols[0] =
        (struct lws_protocols){"http", web__http_cb, web__http_pss_size(), 0, 0, NULL, 0};
    s->protocols[1] = (struct lws_protocols){WEB_PROTOCOL, ws_cb, sizeof(ws_pss), 4096, 0, NULL, 0};
    /* protocols[2] stays zero: the terminator */
    s->pvo_default = (struct lws_protocol_vhost_options){NULL, NULL, "default", "1"};
    s->pvo = (struct lws_protocol_vhost_options){NULL, &s->pvo_default, WEB_PROTOCOL, ""};
    s->retry.secs_since_valid_ping = (uint16_t)(s->p.idle_timeout_s > 65000 ? 65000 : s->p.idle_timeout_s);
    s->retry.secs_since_valid_hangup = (uint16_t)(s->retry.secs_since_valid_ping + 10);
    memset(&s->mount_metrics, 0, sizeof s->mount_metrics);
    s->mount_metrics.mountpoint = "/metrics";
    s->mount_metrics.mountpoint_len = 8;
    s->mount_metrics.origin = "http";
    s->mount_metrics.origin_protocol = LWSMPRO_CALLBACK;
    /* the OpenAI-compatible endpoints (web_http.c) */
    memset(&s->mount_v1, 0, sizeof s->mount_v1);
    s->mount_v1.mountpoint = "/v1";
    s->mount_v1.mountpoint_len = 3;
    s->mount_v1.origin = "http";
    s->mount_v1.origin_protocol = LWSMPRO_CALLBACK;
    s->mount_metrics.mount_next = &s->mount_v1;
    if (s->www_dir) {
        memset(&s->mount_www, 0, sizeof s->mount_www);
        s->mount_www.mountpoint = "/";
        s->mount_www.mountpoint_len = 1;
        s->mount_www.origin = s->www_dir;
        s->mount_www.def = "index.html";
        s->mount_www.origin_protocol = LWSMPRO_FILE;
        s->mount_v1.mount_next = &s->mount_www;
    }

    struct lws_context_creation_info ci;
    memset(&ci, 0, sizeof ci);
    ci.options = LWS_SERVER_OPTION_EXPLICIT_VHOSTS | LWS_SERVER_OPTION_VALIDATE_UTF8;
    ci.user = s;
    ci.port = CONTEXT_PORT_NO_LISTEN;
    s->lws = lws_create_context(&ci);
    if (!s->lws) {
        rc = kds_err_set(err, KDS_IO, "cannot create the libwebsockets context");
        goto fail;
    }
    struct lws_context_creation_info vi;
    memset(&vi, 0, sizeof vi);
    vi.port = s->port;
    vi.iface = s->listen_host;
    vi.protocols = s->protocols;
    vi.pvo = &s->pvo;
    vi.mounts = &s->mount_metrics;
    vi.retry_and_idle_policy = &s->retry;
    vi.vhost_name = "kdaserve";
    vi.timeout_secs = 30;
    vi.options = LWS_SERVER_OPTION_VALIDATE_UTF8;
    s->vhost = lws_create_vhost(s->lws, &vi);
    if (!s->vhost) {
        rc = kds_err_set(err, KDS_IO, "cannot listen on %s (address in use, or not an address "
                                      "of this machine?)", s->p.listen);
        goto fail;
    }
    s->port = lws_get_vhost_listen_port(s->vhost);
    if ((rc = web__engine_start(s, err)) != KDS_OK) goto fail;
    *out = s;
    return KDS_OK;
fail:
    web_server_free(s);
    return rc;
}

int web_server_port(const web_server *s) { return s->port; }

void web_server_stop(web_server *s) {
    atomic_store(&s->stop, true);
    if (s->lws) lws_cancel_service(s->lws);
}

kds_status web_server_run(web_server *s, kds_err *err) {
    log_line(s, "listening on http://%s:%d/ (WebSocket subprotocol %s%s)", s->listen_host,
             s->port, WEB_PROTOCOL, s->n_tenants ? ", auth required" : "");
    while (!atomic_load(&s->stop))
        if (lws_service(s->lws, 0) < 0) break;
    log_line(s, "stopping: finishing generations and saving their sessions");
    web__engine_stop(s);
    /* Send what is queued (the `done` of cancelled generations), then close
     * every connection with 1001 "going away"; give up after a second. */
    pthread_mutex_lock(&s->lock);
    for (web_conn *c = s->conns; c; c = c->next) c->close_code = LWS_CLOSE_STATUS_GOINGAWAY;
    pthread_mutex_unlock(&s->lock);
    double until = kds_now_s() + 1.0;
    for (;;) {
        pthread_mutex_lock(&s->lock);
        bool open = s->conns != NULL;
        pthread_mutex_unlock(&s->lock);
        if (!open || kds_now_s() > until) break;
        lws_cancel_service(s->lws); /* never sleep in the loop below */
        lws_service(s->lws, 0);
    }
    (void)err;
    return KDS_OK;
}

void web_server_free(web_server *s) {
    if (!s) return;
    web__engine_stop(s);
    if (s->lws) lws_context_destroy(s->lws); /* runs CLOSED for every connection */
    s->lws = NULL;
    while (s->req_head) {
        web_req *r = s->req_head;
        s->req_head = r->next;
        cJSON_Delete(r->msg);
        free(r);
    }
    web__auth_free(s);
    free(s->www_dir);
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->wake);
    free(s);
}
