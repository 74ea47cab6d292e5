/*
 * web_http.c - the HTTP side of the service thread: /metrics and the
 * OpenAI-compatible endpoints under /v1 (docs/http-api.md), on the same
 * port and vhost as the WebSocket service.
 *
 * A /v1 request becomes a web_conn of its own (http = true) in the same
 * registry as WebSocket connections, so the engine thread answers it through
 * the same request queue (bounded per connection and in all), the same
 * event queue, the same backpressure (web__pending) and the same rule that
 * a connection may close at any moment (its generation then stops at the
 * next step and is saved). The engine queues a head event (status, type,
 * length) and body events; token events of a stream are joined as for
 * WebSocket and become one server-sent-event chunk per write.
 *
 * Bodies are read into a kds_buf capped at max_http_body. An over-long body
 * is read to its end and dropped (the client is still sending it; closing
 * at once would turn the 413 into a reset that clients retry) unless it is
 * declared larger than DISCARD_MAX, which closes at once. The body must be
 * UTF-8 (checked before cJSON sees it) and one JSON object.
 *
 * libwebsockets rules kept (reference/libs.md §1): one lws_write per
 * WRITEABLE (the head with lws_finalize_write_http_header, each body event
 * in a later WRITEABLE), other threads only lws_cancel_service.
 *
 * Keep-alive: the transaction ends (lws_http_transaction_completed) in the
 * WRITEABLE of the response's last write, so lws reads nothing of the
 * connection in between: lws 4.1 takes bytes of the next request read
 * before the end as part of the current one. After a POST body it calls
 * LWS_CALLBACK_HTTP_BODY_COMPLETION again for them, at every service while
 * they wait, without end (lws_read_h1 in LRS_BODY with nothing left to
 * read consumes none of them), and each was answered "the request body is
 * empty" into the running request's response: a keep-alive client whose
 * next request came before the next WRITEABLE read a stranger's answer
 * (or bytes after it), and a client that pipelines two requests got an
 * endless stream of them while the service thread spun. Only a client that
 * pipelines a request after a POST still causes a repeated completion: its
 * connection is closed then (the POST's generation stops as for a client
 * gone; RFC 9112 §9.3.2: the client retries unanswered requests), since
 * lws cannot read those bytes and cannot be told to wait
 * (lws_rx_flow_control also stops an HTTP connection's WRITEABLE, lws
 * 4.1.6 rops_handle_POLLIN_h1). After a GET lws reads nothing until the
 * answer (LRS_DOING_TRANSACTION), and with a pipelined request waiting it
 * sends no answer at all: its 5-second timeout closes the connection.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "web_internal.h"
#include "kds_clock.h"

/* A body declared larger than this is refused without reading it. */
#define DISCARD_MAX ((uint64_t)4 << 30)
#define SESSION_HEADER "x-kdaserve-session:"

typedef struct http_pss {
    /* GET /metrics */
    char *body;
    size_t len, sent;
    /* a /v1 request */
    web_conn *c; /* registered while it is answered */
    web_route route;
    bool refused; /* an error is decided: read the body, then send it */
    int status;   /* of that error */
    char err_type[32], err_code[32], err_msg[256];
    bool too_big;
    bool answered; /* the refusal is queued already (not at the body's end again) */
    uint64_t discarded;
    bool finishing;    /* the last event was written */
    bool stream_close; /* a response without length: close after it */
    bool received;     /* its body completed (a repeated completion is not) */
    bool authed;
    char tenant[WEB_TENANT_MAX + 1];
    char session_hdr[SESS_NAME_MAX + 1];
    kds_buf rx;
} http_pss;

size_t web__http_pss_size(void) {
    return sizeof(http_pss);
}

/* ------------------------------------------------------------------------ */
/* Events (any thread)                                                      */

static void queue_event(web_server *s, uint64_t conn, web_event *e) {
    pthread_mutex_lock(&s->lock);
    web_conn *c = web__conn_find(s, conn);
    if (c) {
        web__enqueue(c, e);
        e = NULL;
    }
    pthread_mutex_unlock(&s->lock);
    if (e)
        web__event_free(e);
    else
        lws_cancel_service(s->lws);
}

void web__http_head(web_server *s, uint64_t conn, int status, const char *type, int64_t len) {
    web_event *e = calloc(1, sizeof *e);
    if (!e) return; /* the connection then times out: nothing else can be said */
    e->http_status = status;
    e->http_type = type;
    e->http_len = len;
    e->bytes = 128;
    queue_event(s, conn, e);
}

void web__http_body(web_server *s, uint64_t conn, const char *p, size_t len, bool last) {
    web_event *e = calloc(1, sizeof *e);
    if (!e) return;
    if (!(e->frame = malloc(LWS_PRE + len + 1))) {
        free(e);
        return;
    }
    memcpy(e->frame + LWS_PRE, p, len);
    e->frame_len = len;
    e->bytes = len;
    e->last = last;
    queue_event(s, conn, e);
}

void web__http_json(web_server *s, uint64_t conn, int status, cJSON *ev) {
    char *text = ev ? cJSON_PrintUnformatted(ev) : NULL;
    cJSON_Delete(ev);
    if (!text) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":"
                                  "\"server_error\",\"param\":null,\"code\":null}}";
        web__http_head(s, conn, 500, "application/json", (int64_t)strlen(oom));
        web__http_body(s, conn, oom, strlen(oom), true);
        return;
    }
    size_t n = strlen(text);
    web__http_head(s, conn, status, "application/json", (int64_t)n);
    web__http_body(s, conn, text, n, true);
    free(text);
}

static cJSON *error_json(const char *type, const char *param, const char *code, const char *msg) {
    cJSON *o = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(o, "error");
    cJSON_AddStringToObject(e, "message", msg);
    cJSON_AddStringToObject(e, "type", type);
    cJSON_AddItemToObject(e, "param", param ? cJSON_CreateString(param) : cJSON_CreateNull());
    cJSON_AddItemToObject(e, "code", code ? cJSON_CreateString(code) : cJSON_CreateNull());
    return o;
}

void web__http_error(web_server *s, uint64_t conn, int status, const char *type, const char *param,
                     const char *code, const char *fmt, ...) {
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    web__utf8_trim(msg);
    atomic_fetch_add(&s->metrics.errors[status == 401   ? WEB_ERR_UNAUTHENTICATED
                                        : status == 404 ? WEB_ERR_NOT_FOUND
                                        : status == 429 ? WEB_ERR_LIMIT
                                        : status >= 500 ? WEB_ERR_INTERNAL
                                                        : WEB_ERR_BAD_REQUEST],
                     1);
    web__http_json(s, conn, status, error_json(type, param, code, msg));
}

void web__http_stream_template(web_server *s, uint64_t conn, cJSON *tmpl, bool chat) {
    pthread_mutex_lock(&s->lock);
    web_conn *c = web__conn_find(s, conn);
    if (c) {
        cJSON_Delete(c->sse_tmpl);
        c->sse_tmpl = tmpl;
        c->sse_chat = chat;
        tmpl = NULL;
    }
    pthread_mutex_unlock(&s->lock);
    cJSON_Delete(tmpl);
}

/* ------------------------------------------------------------------------ */
/* The service thread                                                       */

static void refuse(http_pss *pss, int status, const char *type, const char *code, const char *msg) {
    pss->refused = true;
    pss->status = status;
    snprintf(pss->err_type, sizeof pss->err_type, "%s", type);
    snprintf(pss->err_code, sizeof pss->err_code, "%s", code ? code : "");
    snprintf(pss->err_msg, sizeof pss->err_msg, "%s", msg);
}

static void send_refusal(web_server *s, http_pss *pss) {
    if (pss->answered) return;
    pss->answered = true;
    web__http_error(s, pss->c->id, pss->status, pss->err_type, NULL,
                    pss->err_code[0] ? pss->err_code : NULL, "%s", pss->err_msg);
}

/* The request is over (answered, or its connection closed): out of the
 * registry, and the engine drops whatever of it remains. */
static void v1_end(web_server *s, http_pss *pss) {
    web_conn *c = pss->c;
    kds_buf_free(&pss->rx);
    if (!c) return;
    pss->c = NULL;
    pthread_mutex_lock(&s->lock);
    for (web_conn **pp = &s->conns; *pp; pp = &(*pp)->next)
        if (*pp == c) {
            *pp = c->next;
            break;
        }
    web_event *e = c->head;
    c->head = c->tail = NULL;
    pthread_mutex_unlock(&s->lock);
    while (e) {
        web_event *next = e->next;
        web__event_free(e);
        e = next;
    }
    web__submit_closed(s, c->id);
    cJSON_Delete(c->sse_tmpl);
    free(c);
}

static void submit(web_server *s, http_pss *pss, cJSON *body) {
    web_req *r = calloc(1, sizeof *r);
    if (!r) {
        cJSON_Delete(body);
        web__http_error(s, pss->c->id, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    r->kind = WEB_REQ_OP;
    r->conn = pss->c->id;
    r->msg = body;
    r->route = pss->route;
    r->auth = s->n_tenants > 0;
    snprintf(r->tenant, sizeof r->tenant, "%s", pss->tenant);
    snprintf(r->session_hdr, sizeof r->session_hdr, "%s", pss->session_hdr);
    r->t_arrive = kds_now_s();
    atomic_fetch_add(&s->metrics.requests_total, 1);
    /* Every HTTP request is a connection of its own with nothing waiting,
     * which web__submit_op always lets in: the total bound is applied here
     * (only this thread adds requests, so the count cannot grow meanwhile). */
    pthread_mutex_lock(&s->lock);
    bool full = s->n_queued >= s->p.max_queue_total;
    pthread_mutex_unlock(&s->lock);
    if (full || !web__submit_op(s, pss->c, r)) {
        cJSON_Delete(body);
        free(r);
        web__http_error(s, pss->c->id, 429, "rate_limit_exceeded", NULL, "rate_limit_exceeded",
                        "too many requests waiting (--max-queue-total %d); retry later",
                        s->p.max_queue_total);
    }
}

/* LWS_CALLBACK_HTTP of a /v1 path: register the request, check method and
 * auth, and for GET submit it at once (POST waits for its body). */
static int v1_begin(web_server *s, struct lws *wsi, http_pss *pss, const char *uri, bool post) {
    v1_end(s, pss); /* a request not ended (never, above): abandoned, not leaked */
    web_conn *c = calloc(1, sizeof *c);
    if (!c) return -1;
    c->wsi = wsi;
    c->http = true;
    c->last_seen_us = web__now_us();
    pthread_mutex_lock(&s->lock);
    c->id = ++s->next_conn_id;
    c->next = s->conns;
    s->conns = c;
    pthread_mutex_unlock(&s->lock);
    kds_buf_free(&pss->rx);
    free(pss->body);
    memset(pss, 0, sizeof *pss);
    pss->c = c;
    bool want_post = true;
    if (!strcmp(uri, "/v1/models")) {
        pss->route = WEB_ROUTE_MODELS;
        want_post = false;
    } else if (!strcmp(uri, "/v1/chat/completions")) {
        pss->route = WEB_ROUTE_CHAT;
    } else if (!strcmp(uri, "/v1/completions")) {
        pss->route = WEB_ROUTE_COMPLETIONS;
    } else {
        char msg[200];
        snprintf(msg, sizeof msg,
                 "no endpoint %.100s (this server has GET /v1/models, POST /v1/chat/completions "
                 "and POST /v1/completions)",
                 uri);
        web__utf8_trim(msg);
        refuse(pss, 404, "invalid_request_error", "unknown_url", msg);
    }
    if (!pss->refused && post != want_post)
        refuse(pss, 405, "invalid_request_error", "method_not_allowed",
               want_post ? "this endpoint takes POST" : "this endpoint takes GET");
    if (!pss->refused && s->n_tenants > 0) {
        char buf[512];
        int n = lws_hdr_copy(wsi, buf, sizeof buf, WSI_TOKEN_HTTP_AUTHORIZATION);
        const char *tenant = NULL;
        if (n > 7 && !strncasecmp(buf, "Bearer ", 7))
            tenant = web__auth_check(s, buf + 7, strlen(buf + 7));
        web__wipe(buf, sizeof buf);
        if (!tenant) {
            refuse(pss, 401, "invalid_request_error", "invalid_api_key",
                   n <= 0 ? "no API key: send 'Authorization: Bearer TOKEN' with a token of the "
                            "server's auth file"
                          : "incorrect API key (expected 'Authorization: Bearer TOKEN' with a "
                            "token of the server's auth file)");
        } else {
            pss->authed = true;
            snprintf(pss->tenant, sizeof pss->tenant, "%s", tenant);
        }
    }
    int hn = lws_hdr_custom_length(wsi, SESSION_HEADER, (int)strlen(SESSION_HEADER));
    if (!pss->refused && hn > 0) {
        if (hn > SESS_NAME_MAX ||
            lws_hdr_custom_copy(wsi, pss->session_hdr, sizeof pss->session_hdr, SESSION_HEADER,
                                (int)strlen(SESSION_HEADER)) <= 0)
            refuse(pss, 400, "invalid_request_error", "invalid_session",
                   "X-Kdaserve-Session must be a session name of 1-64 of [A-Za-z0-9._-]");
    }
    if (post) {
        char cl[32];
        if (!pss->refused && lws_hdr_total_length(wsi, WSI_TOKEN_HTTP_CONTENT_LENGTH) <= 0) {
            /* lws 4.1 reads no chunked request body: say so, then close */
            pss->stream_close = true;
            refuse(pss, 411, "invalid_request_error", "length_required",
                   "send the body with a Content-Length header (chunked request bodies are not "
                   "supported)");
            send_refusal(s, pss);
            return 0;
        }
        if (lws_hdr_copy(wsi, cl, sizeof cl, WSI_TOKEN_HTTP_CONTENT_LENGTH) > 0) {
            unsigned long long v = strtoull(cl, NULL, 10);
            if (v > s->p.max_http_body) pss->too_big = true;
            if (v > DISCARD_MAX) {
                /* not worth reading to its end: answer and close */
                pss->stream_close = true;
                refuse(pss, 413, "invalid_request_error", "request_too_large",
                       "request body too large");
                send_refusal(s, pss);
            }
        }
        return 0;
    }
    if (pss->refused)
        send_refusal(s, pss);
    else
        submit(s, pss, NULL);
    return 0;
}

static int v1_body(web_server *s, http_pss *pss, const void *in, size_t len) {
    if (!pss->c) return 0;
    if (pss->too_big || pss->refused) {
        pss->discarded += len;
        return pss->discarded > DISCARD_MAX ? -1 : 0;
    }
    if (pss->rx.len + len > s->p.max_http_body) {
        pss->too_big = true;
        pss->discarded = pss->rx.len + len;
        kds_buf_free(&pss->rx);
        return 0;
    }
    if (kds_buf_append(&pss->rx, in, len, NULL) != KDS_OK) {
        refuse(pss, 500, "server_error", NULL, "out of memory reading the request body");
        kds_buf_free(&pss->rx);
    }
    return 0;
}

/* Returns the callback's value: -1 closes the connection. */
static int v1_body_done(web_server *s, http_pss *pss) {
    if (!pss->c) return 0;
    /* lws again, for bytes of a pipelined request that it read before this
     * one is answered and will never consume (above) */
    if (pss->received) return -1;
    pss->received = true;
    char msg[256];
    if (pss->too_big && !pss->refused) {
        snprintf(msg, sizeof msg,
                 "request body too large: at most %zu bytes (kdaserve serve --max-http-body)",
                 s->p.max_http_body);
        refuse(pss, 413, "invalid_request_error", "request_too_large", msg);
    }
    if (pss->refused) {
        send_refusal(s, pss);
        kds_buf_free(&pss->rx);
        return 0;
    }
    size_t bad = 0;
    if (!web__utf8_valid(pss->rx.p, pss->rx.len, &bad)) {
        web__http_error(s, pss->c->id, 400, "invalid_request_error", NULL, "invalid_json",
                        "the request body is not valid UTF-8 (first bad byte at offset %zu)", bad);
        kds_buf_free(&pss->rx);
        return 0;
    }
    /* the WebSocket frames' parser: UTF-8 and NUL checks, trailing bytes */
    kds_err pe = {0};
    cJSON *body = pss->rx.len ? web__parse(pss->rx.p, pss->rx.len, false, &pe) : NULL;
    if (!body || !cJSON_IsObject(body)) {
        if (!pss->rx.len)
            web__http_error(s, pss->c->id, 400, "invalid_request_error", NULL, "invalid_json",
                            "the request body is empty; send a JSON object");
        else if (!body)
            web__http_error(s, pss->c->id, 400, "invalid_request_error", NULL, "invalid_json",
                            "the request body is %s", pe.msg);
        else
            web__http_error(s, pss->c->id, 400, "invalid_request_error", NULL, "invalid_json",
                            "the request body must be a JSON object");
        cJSON_Delete(body);
        kds_buf_free(&pss->rx);
        return 0;
    }
    kds_buf_free(&pss->rx);
    submit(s, pss, body);
    return 0;
}

/* Build the server-sent event of joined token text from the template. */
static unsigned char *sse_chunk(const web_conn *c, const char *text, size_t *len) {
    cJSON *o = c->sse_tmpl ? cJSON_Duplicate(c->sse_tmpl, 1) : NULL;
    if (!o) return NULL;
    cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(o, "choices"), 0);
    cJSON *where = c->sse_chat ? cJSON_GetObjectItemCaseSensitive(ch, "delta") : ch;
    cJSON_AddStringToObject(where ? where : o, c->sse_chat ? "content" : "text", text);
    char *j = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!j) return NULL;
    size_t n = strlen(j);
    unsigned char *buf = malloc(LWS_PRE + n + 8);
    if (buf) {
        memcpy(buf + LWS_PRE, "data: ", 6);
        memcpy(buf + LWS_PRE + 6, j, n);
        memcpy(buf + LWS_PRE + 6 + n, "\n\n", 2);
        *len = n + 8;
    }
    free(j);
    return buf;
}

static int write_http(web_server *s, struct lws *wsi, http_pss *pss) {
    web_conn *c = pss->c;
    pthread_mutex_lock(&s->lock);
    web_event *e = c->head;
    if (e) {
        c->head = e->next;
        if (!c->head) c->tail = NULL;
        c->pending -= e->bytes;
    }
    bool more = c->head != NULL;
    int close_code = c->close_code;
    unsigned char *chunk = NULL;
    size_t chunk_len = 0;
    if (e && e->token_of) chunk = sse_chunk(c, kds_buf_str(&e->text), &chunk_len);
    pthread_mutex_unlock(&s->lock);
    if (!e) {
        if (pss->finishing) { /* a response that ends its connection, written */
            v1_end(s, pss);
            return -1;
        }
        if (close_code) {
            v1_end(s, pss);
            return -1;
        }
        return 0;
    }
    int rc = 0;
    if (e->http_status) {
        unsigned char hdr[LWS_PRE + 1024], *start = hdr + LWS_PRE, *p = start,
                                           *end = hdr + sizeof hdr;
        bool stream = e->http_len < 0;
        pss->stream_close = pss->stream_close || stream;
        if (lws_add_http_common_headers(
                wsi, (unsigned)e->http_status, e->http_type,
                stream ? LWS_ILLEGAL_HTTP_CONTENT_LEN : (lws_filepos_t)e->http_len, &p, end) ||
            /* a response after which this side closes says so, or a
             * keep-alive client would send its next request into the close */
            (!stream && pss->stream_close &&
             lws_add_http_header_by_token(wsi, WSI_TOKEN_CONNECTION, (const unsigned char *)"close",
                                          5, &p, end)) ||
            (stream &&
             lws_add_http_header_by_name(wsi, (const unsigned char *)"cache-control:",
                                         (const unsigned char *)"no-cache", 8, &p, end)) ||
            lws_finalize_write_http_header(wsi, start, &p, end))
            rc = -1;
    } else {
        unsigned char *buf = e->token_of ? chunk : e->frame;
        size_t len = e->token_of ? chunk_len : e->frame_len;
        if (!buf) {
            rc = -1;
        } else if (len) {
            int n =
                lws_write(wsi, buf + LWS_PRE, len,
                          e->last && !pss->stream_close ? LWS_WRITE_HTTP_FINAL : LWS_WRITE_HTTP);
            if (n < (int)len) rc = -1;
        }
    }
    if (e->last) pss->finishing = true;
    free(chunk);
    web__event_free(e);
    if (rc) {
        v1_end(s, pss);
        return -1;
    }
    if (pss->finishing && !pss->stream_close) {
        /* the response is whole: the transaction ends now, before lws reads
         * anything more of the connection, and reading goes on (the next
         * request's bytes, if any came, are parsed as new headers) */
        v1_end(s, pss); /* nothing after the last event belongs to it */
        return lws_http_transaction_completed(wsi) ? -1 : 0;
    }
    if (more || pss->finishing || close_code) lws_callback_on_writable(wsi);
    return 0;
}

static int metrics_begin(web_server *s, struct lws *wsi, http_pss *pss) {
    unsigned char hdr[LWS_PRE + 512], *start = hdr + LWS_PRE, *p = start, *end = hdr + sizeof hdr;
    free(pss->body);
    pss->body = web__metrics_text(s, &pss->len);
    pss->sent = 0;
    if (!pss->body) return -1;
    if (lws_add_http_common_headers(wsi, HTTP_STATUS_OK, "text/plain; version=0.0.4",
                                    (lws_filepos_t)pss->len, &p, end) ||
        lws_finalize_write_http_header(wsi, start, &p, end))
        return 1;
    lws_callback_on_writable(wsi);
    return 0;
}

static int metrics_write(struct lws *wsi, http_pss *pss) {
    size_t chunk = pss->len - pss->sent;
    if (chunk > 16384) chunk = 16384;
    unsigned char *buf = malloc(LWS_PRE + chunk + 1);
    if (!buf) return -1;
    memcpy(buf + LWS_PRE, pss->body + pss->sent, chunk);
    bool last = pss->sent + chunk == pss->len;
    int n = lws_write(wsi, buf + LWS_PRE, chunk, last ? LWS_WRITE_HTTP_FINAL : LWS_WRITE_HTTP);
    free(buf);
    if (n < (int)chunk) return -1;
    pss->sent += chunk;
    if (!last) {
        lws_callback_on_writable(wsi);
        return 0;
    }
    free(pss->body);
    pss->body = NULL;
    if (lws_http_transaction_completed(wsi)) return -1;
    return 0;
}

int web__http_cb(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in,
                 size_t len) {
    web_server *s = lws_context_user(lws_get_context(wsi));
    http_pss *pss = user;
    switch (reason) {
    case LWS_CALLBACK_HTTP: {
        /* lws also lands here for a static file it did not find on a
         * connection last bound to this protocol */
        char uri[256];
        bool post = lws_hdr_total_length(wsi, WSI_TOKEN_POST_URI) > 0;
        int n = lws_hdr_copy(wsi, uri, sizeof uri, post ? WSI_TOKEN_POST_URI : WSI_TOKEN_GET_URI);
        if (n > 0 && !post && !strcmp(uri, "/metrics")) return metrics_begin(s, wsi, pss);
        if (n > 0 && !strncmp(uri, "/v1", 3) && (uri[3] == '/' || !uri[3]))
            return v1_begin(s, wsi, pss, uri, post);
        if (lws_return_http_status(wsi, HTTP_STATUS_NOT_FOUND, NULL)) return -1;
        return lws_http_transaction_completed(wsi) ? -1 : 0;
    }
    case LWS_CALLBACK_HTTP_BODY: return v1_body(s, pss, in, len);
    case LWS_CALLBACK_HTTP_BODY_COMPLETION: return v1_body_done(s, pss);
    case LWS_CALLBACK_HTTP_WRITEABLE:
        if (pss && pss->c) return write_http(s, wsi, pss);
        if (pss && pss->body) return metrics_write(wsi, pss);
        break;
    case LWS_CALLBACK_HTTP_CONFIRM_UPGRADE:
        /* a kept-alive connection whose last request was one of ours */
        return web__confirm_upgrade(wsi, in);
    case LWS_CALLBACK_CLOSED_HTTP:
    case LWS_CALLBACK_HTTP_DROP_PROTOCOL:
        if (pss) {
            v1_end(s, pss);
            free(pss->body);
            pss->body = NULL;
        }
        break;
    default: break;
    }
    return lws_callback_http_dummy(wsi, reason, user, in, len);
}
