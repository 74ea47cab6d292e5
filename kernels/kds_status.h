/*
 * kds_status.h - the one status enum of kdaserve, and the error record that
 * carries a human-readable reason beside it.
 *
 * Dependency-free on purpose: kernels/, engine/, session/, web/ and repl/ all
 * include it. Codes are never renumbered; a retired code becomes
 * KDS_OBSOLETE_n.
 *
 * Contract: every command returns a kds_status. Functions that can fail for a
 * reason worth telling a user also take a `kds_err *` (may be NULL) and fill
 * it with the status and a one-line message naming the offending thing
 * (file, tensor, field, token id...). Messages never end with a newline.
 *
 * Thread-safety: a kds_err is plain data owned by the caller; use one per
 * thread.
 */
#ifndef KDS_STATUS_H
#define KDS_STATUS_H

#include <stdarg.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KDS_STATUS_MAP(X)                                                 \
    X(OK, 0, "ok")                                                        \
    X(NOMEM, 1, "out of memory")                                          \
    X(IO, 2, "input/output error")                                        \
    X(BAD_FORMAT, 3, "malformed input")                                   \
    X(NOT_FOUND, 4, "not found")                                          \
    X(TOO_LARGE, 5, "too large")                                          \
    X(UNSUPPORTED, 6, "unsupported")                                      \
    X(INVALID_ARG, 7, "invalid argument")                                 \
    X(MISMATCH, 8, "does not match")                                      \
    X(CUDA, 9, "CUDA error")                                              \
    X(ABORTED, 10, "aborted")                                             \
    X(CORRUPT, 11, "corrupt data")                                        \
    X(EXISTS, 12, "already exists")                                       \
    X(BUSY, 13, "busy")                                                   \
    X(INTERNAL, 14, "internal error")                                     \
    X(COMM, 15, "communication failure")

typedef enum kds_status {
#define KDS_STATUS_ENUM_(name, value, text) KDS_##name = value,
    KDS_STATUS_MAP(KDS_STATUS_ENUM_)
#undef KDS_STATUS_ENUM_
} kds_status;

/* A status plus the reason. 512 bytes is enough for a path and a tensor name. */
typedef struct kds_err {
    kds_status status;
    char msg[512];
} kds_err;

/* Static text for a status ("ok", "out of memory", ...). Never NULL. */
const char *kds_status_str(kds_status s);

/* Fill `err` (if not NULL) with `s` and a printf-style message; returns `s`
 * so that callers can write `return kds_err_set(err, KDS_BAD_FORMAT, ...)`. */
kds_status kds_err_set(kds_err *err, kds_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prefix the message already in `err` with more context ("loading X: ...").
 * Returns err->status (KDS_OK when err is NULL). */
kds_status kds_err_prefix(kds_err *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Reset to KDS_OK with an empty message. */
void kds_err_clear(kds_err *err);

#ifdef __cplusplus
}
#endif

#endif /* KDS_STATUS_H */
