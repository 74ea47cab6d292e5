/*
 * fuzz_auth.c - libFuzzer target: the server's auth file (web__auth_load,
 * web/web_internal.h). The input is the file.
 *
 * Property: web__auth_load reads exactly the file docs/protocol.md
 * describes ("each non-comment line is TOKEN TENANT; token: 16-256
 * printable non-space characters; tenant: 1-16 of [A-Za-z0-9_-]"), as a
 * small reference reader here reads it: the same files are accepted, with
 * the same tenants in the same order, and every accepted token checks back
 * as its tenant. web_auth.c's own limits are part of the reference (a line
 * of more than 1022 bytes is refused, a repeated token is refused, a file
 * without any line is refused); a NUL byte is refused (a C line reader
 * would silently cut the line there).
 */
#include "fuzz_util.h"

#include <ctype.h>

#include "web_internal.h"

#define REF_MAX 4096

typedef struct ref_tenant {
    const uint8_t *tok;
    size_t tok_len;
    const uint8_t *ten;
    size_t ten_len;
} ref_tenant;

static bool sp(uint8_t c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

/* The documented reader: true and the tenants when the file is valid. */
static bool ref_parse(const uint8_t *p, size_t n, ref_tenant *out, size_t *count) {
    *count = 0;
    if (memchr(p, 0, n)) return false;
    size_t i = 0;
    while (i < n) {
        const uint8_t *nl = memchr(p + i, '\n', n - i);
        size_t end = nl ? (size_t)(nl - p) : n, len = end - i;
        if (len > 1022) return false;
        size_t a = i, b = end;
        while (a < b && sp(p[a])) a++;
        while (b > a && sp(p[b - 1])) b--;
        i = nl ? end + 1 : n;
        if (a == b || p[a] == '#') continue;
        size_t t0 = a;
        while (a < b && !sp(p[a])) a++;
        size_t t1 = a;
        while (a < b && sp(p[a])) a++;
        size_t n0 = a;
        while (a < b && !sp(p[a])) a++;
        size_t n1 = a;
        if (a != b || n1 == n0) return false;
        if (t1 - t0 < 16 || t1 - t0 > 256) return false;
        for (size_t k = t0; k < t1; k++)
            if (p[k] < 0x21 || p[k] > 0x7e) return false;
        if (n1 - n0 > WEB_TENANT_MAX) return false;
        for (size_t k = n0; k < n1; k++)
            if (!isalnum(p[k]) && p[k] != '_' && p[k] != '-') return false;
        for (size_t k = 0; k < *count; k++)
            if (out[k].tok_len == t1 - t0 && !memcmp(out[k].tok, p + t0, t1 - t0)) return false;
        if (*count == REF_MAX) return false;
        out[(*count)++] = (ref_tenant){p + t0, t1 - t0, p + n0, n1 - n0};
    }
    return *count > 0;
}

static ref_tenant ref[REF_MAX];

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fz_path(0, "auth.txt");
    fz_write_file(path, data, size);
    web_server *s = calloc(1, sizeof *s);
    if (!s) abort();
    kds_err e = {0};
    kds_status rc = web__auth_load(s, path, &e);
    size_t n_ref = 0;
    bool ok_ref = ref_parse(data, size, ref, &n_ref);
    if (rc != KDS_OK && !e.msg[0]) fz_fail("auth file refused without a message");
    if ((rc == KDS_OK) != ok_ref)
        fz_fail("web__auth_load %s a file the documented format %s (%s)",
                rc == KDS_OK ? "accepts" : "refuses", ok_ref ? "allows" : "refuses",
                rc == KDS_OK ? "" : e.msg);
    if (rc == KDS_OK && ok_ref) {
        if (s->n_tenants != n_ref) fz_fail("%zu tenants, the format reads %zu", s->n_tenants, n_ref);
        for (size_t i = 0; i < n_ref; i++) {
            const web_tenant *t = &s->tenants[i];
            if (t->token_len != ref[i].tok_len || memcmp(t->token, ref[i].tok, t->token_len) ||
                strlen(t->name) != ref[i].ten_len || memcmp(t->name, ref[i].ten, ref[i].ten_len))
                fz_fail("tenant %zu differs from the format's reading", i);
        }
    }
    for (size_t i = 0; rc == KDS_OK && i < s->n_tenants; i++) {
        const web_tenant *t = &s->tenants[i];
        const char *who = web__auth_check(s, t->token, t->token_len);
        if (!who || strcmp(who, t->name) != 0) fz_fail("tenant %zu's token does not check", i);
    }
    (void)web__auth_check(s, (const char *)data, size);
    web__auth_free(s);
    free(s);
    return 0;
}
