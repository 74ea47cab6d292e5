/* kds_status.c - status names and the error record helpers. */
#include "kds_status.h"

#include <stdio.h>
#include <string.h>

const char *kds_status_str(kds_status s) {
    switch (s) {
#define KDS_STATUS_CASE_(name, value, text) \
    case KDS_##name:                         \
        return text;
        KDS_STATUS_MAP(KDS_STATUS_CASE_)
#undef KDS_STATUS_CASE_
    }
    return "unknown status";
}

kds_status kds_err_set(kds_err *err, kds_status s, const char *fmt, ...) {
    if (!err) return s;
    err->status = s;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return s;
}

kds_status kds_err_prefix(kds_err *err, const char *fmt, ...) {
    if (!err) return KDS_OK;
    char head[sizeof err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(head, sizeof head, fmt, ap);
    va_end(ap);
    /* Longer than msg on purpose: the join is cut to fit, not refused. */
    char joined[2 * sizeof err->msg + 2];
    snprintf(joined, sizeof joined, "%s: %s", head, err->msg);
    memcpy(err->msg, joined, sizeof err->msg - 1);
    err->msg[sizeof err->msg - 1] = '\0';
    return err->status;
}

void kds_err_clear(kds_err *err) {
    if (!err) return;
    err->status = KDS_OK;
    err->msg[0] = '\0';
}
