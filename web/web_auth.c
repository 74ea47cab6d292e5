/*
 * web_auth.c - the auth file (`TOKEN TENANT` per line, '#' comments) and the
 * token check. Every check compares the presented token with every known
 * token over the full length of the longer one, so the time taken says
 * nothing about which token or how many bytes matched. Tokens never reach a
 * log line or an error message.
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kds_file.h"
#include "web_internal.h"

#define TOKEN_MIN 16
#define TOKEN_MAX 256

static bool tenant_valid(const char *t, size_t n) {
    if (n == 0 || n > WEB_TENANT_MAX) return false;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)t[i]) && t[i] != '_' && t[i] != '-') return false;
    return true;
}

/* The auth file's bytes are read whole and split at '\n' here rather than
 * by fgets: a NUL byte would cut a C line short and the rest of that read
 * would pass for a line of its own (a comment could hide a token). */
#define AUTH_FILE_MAX (16u << 20)
#define AUTH_LINE_MAX 1022 /* bytes of a line without its '\n' */

static bool auth_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

/* One line of the file, [a, b) without its '\n'. Adds its tenant, or says
 * what is wrong with it (never echoing a token's bytes). */
static kds_status auth_line(web_server *s, const char *path, int lineno, const char *a,
                            const char *b, kds_err *err) {
    if (b - a > AUTH_LINE_MAX)
        return kds_err_set(err, KDS_INVALID_ARG, "%s:%d: line too long", path, lineno);
    while (a < b && auth_space((unsigned char)*a)) a++;
    while (b > a && auth_space((unsigned char)b[-1])) b--;
    if (a == b || *a == '#') return KDS_OK;
    const char *tok = a;
    while (a < b && !auth_space((unsigned char)*a)) a++;
    size_t tok_len = (size_t)(a - tok);
    while (a < b && auth_space((unsigned char)*a)) a++;
    const char *ten = a;
    while (a < b && !auth_space((unsigned char)*a)) a++;
    size_t ten_len = (size_t)(a - ten);
    if (a != b || !ten_len)
        return kds_err_set(err, KDS_INVALID_ARG, "%s:%d: expected 'TOKEN TENANT' (two fields)",
                           path, lineno);
    if (tok_len < TOKEN_MIN || tok_len > TOKEN_MAX)
        return kds_err_set(err, KDS_INVALID_ARG, "%s:%d: a token must have %d to %d characters",
                           path, lineno, TOKEN_MIN, TOKEN_MAX);
    for (size_t i = 0; i < tok_len; i++)
        if ((unsigned char)tok[i] < 0x21 || (unsigned char)tok[i] > 0x7e)
            return kds_err_set(err, KDS_INVALID_ARG,
                               "%s:%d: a token is printable ASCII ('!' to '~'); this one holds "
                               "byte 0x%02x at character %zu", path, lineno,
                               (unsigned char)tok[i], i + 1);
    if (!tenant_valid(ten, ten_len))
        return kds_err_set(err, KDS_INVALID_ARG, "%s:%d: a tenant is 1-%d of [A-Za-z0-9_-]", path,
                           lineno, WEB_TENANT_MAX);
    for (size_t i = 0; i < s->n_tenants; i++)
        if (s->tenants[i].token_len == tok_len && !memcmp(s->tenants[i].token, tok, tok_len))
            return kds_err_set(err, KDS_INVALID_ARG, "%s:%d: the same token appears twice", path,
                               lineno);
    web_tenant *t = realloc(s->tenants, (s->n_tenants + 1) * sizeof *t);
    if (!t) return kds_err_set(err, KDS_NOMEM, "out of memory reading the auth file");
    s->tenants = t;
    t = &s->tenants[s->n_tenants];
    if (!(t->token = malloc(tok_len + 1)))
        return kds_err_set(err, KDS_NOMEM, "out of memory reading the auth file");
    memcpy(t->token, tok, tok_len);
    t->token[tok_len] = '\0';
    t->token_len = tok_len;
    memcpy(t->name, ten, ten_len);
    t->name[ten_len] = '\0';
    s->n_tenants++;
    return KDS_OK;
}

kds_status web__auth_load(web_server *s, const char *path, kds_err *err) {
    /* a FIFO or directory in the file's place is refused, never waited on */
    int fd;
    size_t size;
    kds_err why = {0};
    if (kds_open_regular(path, &fd, &size, &why) != KDS_OK)
        return kds_err_set(err, KDS_IO, "cannot read the auth file: %s", why.msg);
    kds_status rc = KDS_OK;
    char *buf = NULL;
    if (size > AUTH_FILE_MAX) {
        rc = kds_err_set(err, KDS_INVALID_ARG, "%s: %zu bytes; an auth file holds at most %u MiB",
                         path, size, AUTH_FILE_MAX >> 20);
        goto out;
    }
    if (!(buf = malloc(size ? size : 1))) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory reading the auth file");
        goto out;
    }
    size_t got = 0;
    while (got < size) {
        ssize_t r = read(fd, buf + got, size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            rc = kds_err_set(err, KDS_IO, "cannot read the auth file %s: %s", path,
                             r < 0 ? strerror(errno) : "it shrank while being read");
            goto out;
        }
        got += (size_t)r;
    }
    const char *nul = memchr(buf, 0, size);
    if (nul) {
        int at = 1;
        for (const char *q = buf; q < nul; q++) at += *q == '\n';
        rc = kds_err_set(err, KDS_INVALID_ARG, "%s:%d: a NUL byte (an auth file is text)", path,
                         at);
        goto out;
    }
    int lineno = 0;
    for (const char *p = buf, *end = buf + size; p < end && rc == KDS_OK;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *b = nl ? nl : end;
        rc = auth_line(s, path, ++lineno, p, b, err);
        p = nl ? nl + 1 : end;
    }
    if (rc == KDS_OK && s->n_tenants == 0)
        rc = kds_err_set(err, KDS_INVALID_ARG, "%s: no 'TOKEN TENANT' lines", path);
out:
    if (buf) {
        web__wipe(buf, size); /* it held tokens */
        free(buf);
    }
    close(fd);
    return rc;
}

void web__wipe(void *p, size_t n) {
    volatile unsigned char *v = p;
    for (size_t i = 0; i < n; i++) v[i] = 0;
}

/* Equal in time independent of where (or whether) the bytes differ. */
static bool ct_equal(const char *a, size_t na, const char *b, size_t nb) {
    size_t n = na > nb ? na : nb;
    unsigned diff = (unsigned)(na ^ nb);
    for (size_t i = 0; i < n; i++) {
        unsigned char x = i < na ? (unsigned char)a[i] : 0;
        unsigned char y = i < nb ? (unsigned char)b[i] : 0;
        diff |= (unsigned)(x ^ y);
    }
    return diff == 0;
}

const char *web__auth_check(const web_server *s, const char *token, size_t len) {
    const char *found = NULL;
    if (len > TOKEN_MAX) len = TOKEN_MAX + 1; /* never equal, still constant work */
    for (size_t i = 0; i < s->n_tenants; i++)
        if (ct_equal(s->tenants[i].token, s->tenants[i].token_len, token, len) && !found)
            found = s->tenants[i].name;
    return found;
}

void web__auth_free(web_server *s) {
    for (size_t i = 0; i < s->n_tenants; i++) {
        web__wipe(s->tenants[i].token, s->tenants[i].token_len);
        free(s->tenants[i].token);
    }
    free(s->tenants);
    s->tenants = NULL;
    s->n_tenants = 0;
}
