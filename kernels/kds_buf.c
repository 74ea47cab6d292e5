/*
 * kds_buf.c - the growable byte buffer of kds_buf.h.
 *
 * The allocation is always cap + 1 bytes: the NUL after the content has its
 * own byte, so a buffer grown to a power-of-two content size (a 1 MiB
 * WebSocket message) costs that much and one byte, not twice as much.
 */
#include "kds_buf.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The first allocation: small enough for a token's text, big enough that a
 * short line does not grow three times. */
#define KDS_BUF_MIN_CAP 64

kds_status kds_buf_reserve(kds_buf *b, size_t extra, kds_err *err) {
    /* Everything is checked before realloc sees a size: the allocation
     * (cap + 1) must not pass PTRDIFF_MAX, or pointer differences over the
     * content would overflow. */
    const size_t max_cap = (size_t)PTRDIFF_MAX - 1;
    if (extra > max_cap || b->len > max_cap - extra)
        return kds_err_set(err, KDS_NOMEM, "buffer of %zu bytes cannot grow by %zu more", b->len,
                           extra);
    size_t need = b->len + extra;
    if (b->p && need <= b->cap) return KDS_OK;
    size_t cap = b->cap ? b->cap : KDS_BUF_MIN_CAP;
    while (cap < need)
        cap = cap <= max_cap / 2 ? cap * 2 : max_cap;
    unsigned char *p = realloc(b->p, cap + 1);
    if (!p) return kds_err_set(err, KDS_NOMEM, "out of memory growing a buffer to %zu bytes", cap);
    p[b->len] = '\0'; /* a fresh allocation has no terminator yet */
    b->p = p;
    b->cap = cap;
    return KDS_OK;
}

kds_status kds_buf_append(kds_buf *b, const void *p, size_t n, kds_err *err) {
    kds_status rc = kds_buf_reserve(b, n, err);
    if (rc != KDS_OK) return rc;
    if (n) memcpy(b->p + b->len, p, n);
    b->len += n;
    b->p[b->len] = '\0';
    return KDS_OK;
}

kds_status kds_buf_vprintf(kds_buf *b, kds_err *err, const char *fmt, va_list ap) {
    /* First into the room already there (most calls fit), then, knowing the
     * length, once more after growing. */
    kds_status rc = kds_buf_reserve(b, 0, err);
    if (rc != KDS_OK) return rc;
    va_list again;
    va_copy(again, ap);
    size_t room = b->cap - b->len;
    int n = vsnprintf((char *)b->p + b->len, room + 1, fmt, ap);
    if (n < 0) {
        rc = kds_err_set(err, KDS_INVALID_ARG, "cannot format '%s'", fmt);
        goto out;
    }
    if ((size_t)n > room) {
        if ((rc = kds_buf_reserve(b, (size_t)n, err)) != KDS_OK) goto out;
        if (vsnprintf((char *)b->p + b->len, (size_t)n + 1, fmt, again) != n) {
            rc = kds_err_set(err, KDS_INVALID_ARG, "cannot format '%s'", fmt);
            goto out;
        }
    }
    b->len += (size_t)n;
out:
    /* a failed attempt may have written over the terminator */
    b->p[b->len] = '\0';
    va_end(again);
    return rc;
}

kds_status kds_buf_printf(kds_buf *b, kds_err *err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    kds_status rc = kds_buf_vprintf(b, err, fmt, ap);
    va_end(ap);
    return rc;
}

const char *kds_buf_str(const kds_buf *b) {
    return b->p ? (const char *)b->p : "";
}

void kds_buf_reset(kds_buf *b) {
    b->len = 0;
    if (b->p) b->p[0] = '\0';
}

void kds_buf_free(kds_buf *b) {
    if (!b) return;
    free(b->p);
    *b = (kds_buf){0};
}

void *kds_buf_detach(kds_buf *b, size_t *len) {
    void *p = b->p;
    if (len) *len = b->len;
    *b = (kds_buf){0};
    return p;
}
