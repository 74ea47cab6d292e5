/*
 * web_auth.c - the auth file (`TOKEN TENANT` per line, '#' comments) and the
 * token check. Every check compares the presented token with every known
 * token over the full length of the longer one, so the time taken says
 * nothing about which token or how many bytes matched. Tokens never reach a
 * log line or an error message.
 */
#include <ctype.h>
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

kds_status web__auth_load(web_server *s, const char *path, kds_err *err) {
    /* a FIFO or directory in the file's place is refused, never waited on */
    int fd;
    size_t size;
    kds_err why = {0};
    if (kds_open_regular(path, &fd, &size, &why) != KDS_OK)
        return kds_err_set(err, KDS_IO, "cannot read the auth file: %s", why.msg);
    FILE *f = fdopen(fd, "r");
    if (!f) {
        close(fd);
        return kds_err_set(err, KDS_IO, "cannot read the auth file %s", path);
    }
    char line[1024];
    int lineno = 0;
    kds_status rc = KDS_OK;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        size_t n = strlen(line);
        if (n == sizeof line - 1 && line[n - 1] != '\n') {
            rc = kds_err_set(err, KDS_INVALID_ARG, "%s:%d: line too long", path, lineno);
            break;
        }
        while (n && isspace((unsigned char)line[n - 1])) line[--n] = '\0';
        char *p = line;
        while (*p && isspace((unsigned char)*p)) p++;
        if (!*p || *p == '#') continue;
        char *tok = p;
        while (*p && !isspace((unsigned char)*p)) p++;
        size_t tok_len = (size_t)(p - tok);
        while (*p && isspace((unsigned char)*p)) p++;
        char *ten = p;
        while (*p && !isspace((unsigned char)*p)) p++;
        size_t ten_len = (size_t)(p - ten);
        while (*p && isspace((unsigned char)*p)) p++;
        if (*p || !ten_len) {
            rc = kds_err_set(err, KDS_INVALID_ARG,
                             "%s:%d: expected 'TOKEN TENANT' (two fields)", path, lineno);
            break;
        }
        if (tok_len < TOKEN_MIN || tok_len > TOKEN_MAX) {
            rc = kds_err_set(err, KDS_INVALID_ARG, "%s:%d: a token must have %d to %d characters",
                             path, lineno, TOKEN_MIN, TOKEN_MAX);
            break;
        }
        if (!tenant_valid(ten, ten_len)) {
            rc = kds_err_set(err, KDS_INVALID_ARG,
                             "%s:%d: a tenant is 1-%d of [A-Za-z0-9_-]", path, lineno,
                             WEB_TENANT_MAX);
            break;
        }
        for (size_t i = 0; i < s->n_tenants; i++)
            if (s->tenants[i].token_len == tok_len && !memcmp(s->tenants[i].token, tok, tok_len)) {
                rc = kds_err_set(err, KDS_INVALID_ARG, "%s:%d: the same token appears twice",
                                 path, lineno);
                goto out;
            }
        web_tenant *t = realloc(s->tenants, (s->n_tenants + 1) * sizeof *t);
        if (!t) {
            rc = kds_err_set(err, KDS_NOMEM, "out of memory reading the auth file");
            break;
        }
        s->tenants = t;
        t = &s->tenants[s->n_tenants];
        if (!(t->token = malloc(tok_len + 1))) {
            rc = kds_err_set(err, KDS_NOMEM, "out of memory reading the auth file");
            break;
        }
        memcpy(t->token, tok, tok_len);
        t->token[tok_len] = '\0';
        t->token_len = tok_len;
        memcpy(t->name, ten, ten_len);
        t->name[ten_len] = '\0';
        s->n_tenants++;
    }
    if (rc == KDS_OK && s->n_tenants == 0)
        rc = kds_err_set(err, KDS_INVALID_ARG, "%s: no 'TOKEN TENANT' lines", path);
out:
    fclose(f);
    web__wipe(line, sizeof line); /* it held a token */
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
