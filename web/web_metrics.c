/*
 * web_metrics.c - counters and latency histograms, and their Prometheus text
 * exposition (format 0.0.4) for GET /metrics.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "web_internal.h"

/* Upper bounds of the latency buckets, milliseconds. */
static const double BOUNDS_MS[WEB_LAT_BUCKETS] = {0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000};

static const char *ERR_NAMES[WEB_ERR_COUNT] = {
    "bad_request", "unknown_op", "unauthenticated", "not_found", "exists", "busy",
    "limit",       "corrupt",    "mismatch",        "io",        "internal"};

void web__hist_add(web_hist *h, double ms) {
    for (int i = 0; i < WEB_LAT_BUCKETS; i++)
        if (ms <= BOUNDS_MS[i]) atomic_fetch_add(&h->bucket[i], 1);
    atomic_fetch_add(&h->bucket[WEB_LAT_BUCKETS], 1);
    atomic_fetch_add(&h->count, 1);
    atomic_fetch_add(&h->sum_us, (uint64_t)(ms * 1000.0 + 0.5));
}

void web__rate_set(web_metrics *m, double tokens_per_s) {
    uint64_t bits;
    memcpy(&bits, &tokens_per_s, sizeof bits);
    atomic_store(&m->rate_bits, bits);
}

double web__rate_get(web_metrics *m) {
    uint64_t bits = atomic_load(&m->rate_bits);
    double v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The text being built. `failed` sticks, so that the callers need not
 * check each line and a page with a line missing is never served. */
typedef struct out_buf {
    kds_buf b;
    bool failed;
} out_buf;

static void put(out_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(out_buf *b, const char *fmt, ...) {
    if (b->failed) return;
    va_list ap;
    va_start(ap, fmt);
    if (kds_buf_vprintf(&b->b, NULL, fmt, ap) != KDS_OK) b->failed = true;
    va_end(ap);
}

static void counter(out_buf *b, const char *name, const char *help, uint64_t v) {
    put(b, "# HELP %s %s\n# TYPE %s counter\n%s %llu\n", name, help, name, name,
        (unsigned long long)v);
}

static void gauge(out_buf *b, const char *name, const char *help, double v) {
    put(b, "# HELP %s %s\n# TYPE %s gauge\n%s %.6g\n", name, help, name, name, v);
}

static void hist(out_buf *b, const char *name, const char *help, web_hist *h) {
    put(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (int i = 0; i < WEB_LAT_BUCKETS; i++)
        put(b, "%s_bucket{le=\"%g\"} %llu\n", name, BOUNDS_MS[i] / 1000.0,
            (unsigned long long)atomic_load(&h->bucket[i]));
    put(b, "%s_bucket{le=\"+Inf\"} %llu\n", name,
        (unsigned long long)atomic_load(&h->bucket[WEB_LAT_BUCKETS]));
    put(b, "%s_sum %.6f\n%s_count %llu\n", name, (double)atomic_load(&h->sum_us) / 1e6, name,
        (unsigned long long)atomic_load(&h->count));
}

char *web__metrics_text(web_server *s, size_t *len) {
    web_metrics *m = &s->metrics;
    out_buf b = {0};
    /* the page is a few KiB: room for it at once rather than seven doublings */
    if (kds_buf_reserve(&b.b, 4096, NULL) != KDS_OK) return NULL;
    double rate = web__rate_get(m);
    gauge(&b, "kdaserve_uptime_seconds", "Seconds since the server started.",
          (double)(web__now_us() - s->started_us) / 1e6);
    gauge(&b, "kdaserve_connections", "Open WebSocket connections.",
          (double)atomic_load(&m->connections));
    counter(&b, "kdaserve_connections_total", "WebSocket connections accepted.",
            atomic_load(&m->connections_total));
    gauge(&b, "kdaserve_sessions_hot", "Sessions held in memory.",
          (double)atomic_load(&m->sessions_hot));
    gauge(&b, "kdaserve_generations_active", "Generations in progress.",
          (double)atomic_load(&m->generations_active));
    counter(&b, "kdaserve_requests_total", "Requests received.", atomic_load(&m->requests_total));
    pthread_mutex_lock(&s->lock);
    int queued = s->n_queued;
    pthread_mutex_unlock(&s->lock);
    gauge(&b, "kdaserve_requests_queued",
          "Requests waiting for the engine thread or being handled (--max-queue-total).",
          (double)queued);
    counter(&b, "kdaserve_generations_total", "Generations started.",
            atomic_load(&m->generations_total));
    counter(&b, "kdaserve_tokens_generated_total", "Tokens generated.",
            atomic_load(&m->tokens_generated));
    counter(&b, "kdaserve_tokens_prefilled_total", "Prompt tokens prefilled.",
            atomic_load(&m->tokens_prefilled));
    counter(&b, "kdaserve_decode_steps_total", "Batched decode steps.",
            atomic_load(&m->decode_steps));
    counter(&b, "kdaserve_decode_rows_total",
            "Sequences decoded over all steps (rows / steps = mean batch).",
            atomic_load(&m->decode_rows));
    gauge(&b, "kdaserve_decode_tokens_per_second",
          "Tokens generated per second over the last few seconds, all streams.", rate);
    hist(&b, "kdaserve_snapshot_save_seconds", "Time to save a session (durable commit).",
         &m->save_ms);
    hist(&b, "kdaserve_snapshot_restore_seconds", "Time to load a session from the store.",
         &m->restore_ms);
    hist(&b, "kdaserve_time_to_first_token_seconds",
         "From a generate request to its first token.", &m->ttft_ms);
    put(&b, "# HELP kdaserve_errors_total Error events sent, by code.\n"
            "# TYPE kdaserve_errors_total counter\n");
    for (int i = 0; i < WEB_ERR_COUNT; i++)
        put(&b, "kdaserve_errors_total{code=\"%s\"} %llu\n", ERR_NAMES[i],
            (unsigned long long)atomic_load(&m->errors[i]));
    put(&b, "# HELP kdaserve_closes_total Connections closed by the server, by reason.\n"
            "# TYPE kdaserve_closes_total counter\n"
            "kdaserve_closes_total{reason=\"too_large\"} %llu\n"
            "kdaserve_closes_total{reason=\"auth\"} %llu\n"
            "kdaserve_closes_total{reason=\"limit\"} %llu\n",
        (unsigned long long)atomic_load(&m->closes_too_large),
        (unsigned long long)atomic_load(&m->closes_auth),
        (unsigned long long)atomic_load(&m->closes_limit));
    if (b.failed) {
        kds_buf_free(&b.b);
        return NULL;
    }
    return kds_buf_detach(&b.b, len);
}

const char *web__code_name(int code) {
    return code >= 0 && code < WEB_ERR_COUNT ? ERR_NAMES[code] : "internal";
}
