/*
 * kds_buf.h - the one growable byte buffer of kdaserve: streamed reply text,
 * a WebSocket message being reassembled, an encoded frame, /metrics text.
 *
 * Dependency-free apart from kds_status.h, so every module (kernels, engine,
 * session, web, repl, cli) can use it.
 *
 * Use: start from `kds_buf b = {0};` (empty, nothing allocated), append,
 * read b.p[0 .. b.len), then kds_buf_free(&b) or hand the bytes on with
 * kds_buf_detach. Capacity grows geometrically (at least doubling), so n
 * appends cost O(total bytes).
 *
 * Text: once anything has been reserved or appended, p[len] is a NUL that is
 * not counted in len, so the content reads as a C string (it ends at the
 * first NUL when the bytes hold one). kds_buf_str gives that string, "" for a
 * buffer that never allocated.
 *
 * Ownership: the caller owns the kds_buf and the memory at p, which comes
 * from realloc: free it with kds_buf_free, or take it with kds_buf_detach
 * (then free() it). b.p is invalidated by any call that grows the buffer.
 * Write b.p only through these functions; read-only access to p and len is
 * the point of the open struct.
 *
 * Errors: a command that cannot get the memory returns KDS_NOMEM and fills
 * err (may be NULL); a size that overflows size_t, or a buffer that would
 * pass PTRDIFF_MAX bytes, is KDS_NOMEM too (no allocator could give it) and
 * is refused before anything is allocated. A failed call leaves p, len, cap
 * and the content unchanged.
 *
 * Thread-safety: none; a kds_buf is plain data with one owner at a time.
 */
#ifndef KDS_BUF_H
#define KDS_BUF_H

#include <stdarg.h>
#include <stddef.h>

#include "kds_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kds_buf {
    unsigned char *p; /* NULL until the first reserve/append; then p[len] == '\0' */
    size_t len;       /* bytes of content */
    size_t cap;       /* bytes of content that fit at p (the NUL's byte is extra) */
} kds_buf;

/* Make room for `extra` more bytes after len (cap >= len + extra), growing
 * geometrically; allocates even for extra == 0 on an empty buffer, so that
 * p becomes a valid "". KDS_OK or KDS_NOMEM (buffer unchanged). */
kds_status kds_buf_reserve(kds_buf *b, size_t extra, kds_err *err);

/* Append n bytes from p (p may be NULL when n == 0; it must not point into
 * b's own memory). KDS_OK or KDS_NOMEM (buffer unchanged). */
kds_status kds_buf_append(kds_buf *b, const void *p, size_t n, kds_err *err);

/* Append printf-style text (no NUL counted). KDS_OK, KDS_NOMEM, or
 * KDS_INVALID_ARG when vsnprintf itself fails (a bad format or a result over
 * INT_MAX bytes); on any failure len and the content are unchanged (the
 * capacity may have grown). The va_list form is for variadic wrappers. */
kds_status kds_buf_printf(kds_buf *b, kds_err *err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
kds_status kds_buf_vprintf(kds_buf *b, kds_err *err, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));

/* The content as a C string: borrowed, valid until the buffer next changes;
 * "" when nothing was ever allocated. Never NULL. */
const char *kds_buf_str(const kds_buf *b);

/* Empty the content (len = 0) and keep the memory for reuse. */
void kds_buf_reset(kds_buf *b);

/* Free the memory; the buffer is empty ({0}) again. NULL is a no-op. */
void kds_buf_free(kds_buf *b);

/* Take the memory: returns p (caller owns: free with free(); NUL-terminated,
 * NULL when nothing was ever allocated), stores len in *len when len is not
 * NULL, and leaves the buffer empty ({0}). */
void *kds_buf_detach(kds_buf *b, size_t *len);

#ifdef __cplusplus
}
#endif

#endif /* KDS_BUF_H */
