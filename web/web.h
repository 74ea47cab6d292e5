/*
 * web.h - `kdaserve serve`: the kdaserve.v1 WebSocket session service
 * (docs/protocol.md), the web chat page and /metrics, on libwebsockets.
 *
 * Threads
 *   service thread  the caller of web_server_run: libwebsockets' loop. It
 *                   reassembles and parses frames (JSON text or msgpack
 *                   binary, both into one cJSON tree), checks auth, and
 *                   writes queued events; it never touches the model or
 *                   the store.
 *   engine thread   the one caller of the serving core's scheduler
 *                   (core/srv.h, srv_sched), which owns the model context
 *                   and every session in memory. Each turn of its loop it
 *                   takes the queued requests, answers store operations,
 *                   starts turns as the scheduler's streams, and makes one
 *                   scheduler step: every prefill advances by one slice, and
 *                   every generating session decodes one token in a single
 *                   batched forward pass (continuous batching,
 *                   eng_decode_batch).
 *   saver thread    the scheduler's: makes finished turns durable off the
 *                   batching loop.
 *   The two talk through a request queue (service -> engine) and a
 *   per-connection event queue (engine -> service, woken with
 *   lws_cancel_service, the one lws call allowed from another thread).
 *   The request queue is bounded per connection and in all (max_queue,
 *   max_queue_total: the service thread answers the excess with error
 *   `limit`); the engine takes one request of each connection in turn, and
 *   drops the waiting requests of a connection that closed.
 *
 * Ownership: web_server_create borrows the model (it must outlive the
 * server) and owns everything else it creates. web_server_stop may be called
 * from any thread or a signal handler; web_server_run then returns.
 *
 * Errors: create returns KDS_IO when the address cannot be bound,
 * KDS_INVALID_ARG for a bad listen address or auth file (naming the line).
 */
#ifndef WEB_H
#define WEB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "eng.h"
#include "kds_status.h"
#include "sess.h"

typedef struct web_server web_server;

typedef struct web_params {
    const char *listen;        /* "HOST:PORT" (default "127.0.0.1:8080"; PORT 0 = any free) */
    const char *auth_file;     /* NULL = no auth (one anonymous tenant) */
    const char *www_dir;       /* static files served at / (NULL = none) */
    size_t max_message;        /* bytes per incoming message (1 MiB) */
    size_t max_http_body;      /* bytes of an HTTP request body, /v1 endpoints (64 MiB; a long
                                  document is a long body: docs/http-api.md) */
    bool no_resume;            /* HTTP: never resume from a stored prefix (always replay) */
    size_t max_pending;        /* unsent output bytes per connection before its streams pause
                                  and its requests are no longer read (256 KiB) */
    int max_queue;             /* requests of one connection waiting for the engine (64) */
    int max_queue_total;       /* requests of all connections waiting; a connection with none
                                  waiting may still add one (1024) */
    int max_connections;       /* 256 */
    int max_sessions;          /* sessions kept in memory (64) */
    int max_generations;       /* concurrent generations (32) */
    int64_t max_tokens;        /* cap of a generate's max_tokens (4096) */
    int idle_timeout_s;        /* ping after this much silence; close if no answer (300) */
    eng_ctx_params ctx;        /* compute context of the engine thread */
    bool quiet;                /* no log lines on stderr */
} web_params;

web_params web_default_params(void);

/* Bind the address, read the auth file, start the engine thread. The store
 * must stay open until web_server_free. Caller owns *out. */
kds_status web_server_create(const web_params *p, eng_model *m, sess_store *st,
                             web_server **out, kds_err *err);

/* The port actually bound (useful with PORT 0). */
int web_server_port(const web_server *s);

/* Serve until web_server_stop. Generations in flight are cancelled and
 * their sessions saved before it returns. */
kds_status web_server_run(web_server *s, kds_err *err);

/* Async-signal-safe: ask web_server_run to return. */
void web_server_stop(web_server *s);

void web_server_free(web_server *s); /* NULL is a no-op */

#endif /* WEB_H */
