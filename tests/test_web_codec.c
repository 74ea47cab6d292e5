/*
 * test_web_codec.c - the server's message codec and auth file, without a
 * network: hostile JSON and msgpack are refused with a message (and without
 * huge allocations), events survive an encode/parse round trip in both
 * forms, and the auth file is read strictly and checked without shortcuts.
 */
#include <criterion/criterion.h>
#include <libwebsockets.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "web_internal.h"

static cJSON *parse(const void *p, size_t n, bool binary, kds_err *e) {
    memset(e, 0, sizeof *e);
    return web__parse(p, n, binary, e);
}

Test(web_codec, json_requests) {
    kds_err e;
    const char *ok = "{\"id\":1,\"op\":\"list\"}  \n";
    cJSON *o = parse(ok, strlen(ok), false, &e);
    cr_assert_not_null(o, "%s", e.msg);
    cr_assert_str_eq(cJSON_GetObjectItem(o, "op")->valuestring, "list");
    cJSON_Delete(o);
    const char *bad[] = {"", "not json", "{\"op\":", "[1,2]", "\"op\"", "{} {}", "{\"a\":1}x", "null"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_assert_null(parse(bad[i], strlen(bad[i]), false, &e), "accepted '%s'", bad[i]);
        cr_assert_eq(e.status, KDS_INVALID_ARG, "'%s'", bad[i]);
        cr_assert(strlen(e.msg) > 0);
    }
}

Test(web_codec, hostile_msgpack) {
    kds_err e;
    /* array32 claiming 2^32-1 elements (msgpack-c would reserve ~96 GiB) */
    const unsigned char huge_array[] = {0xdd, 0xff, 0xff, 0xff, 0xff, 0x01};
    /* map32 claiming 2^26 pairs inside a map */
    const unsigned char huge_map[] = {0x81, 0xa1, 'a', 0xdf, 0x04, 0x00, 0x00, 0x00};
    /* a str claiming more bytes than follow */
    const unsigned char short_str[] = {0x81, 0xa2, 'o', 'p', 0xdb, 0x00, 0x10, 0x00, 0x00, 'x'};
    /* bin value, ext value, integer key, NUL inside a string, trailing byte */
    const unsigned char bin_val[] = {0x81, 0xa2, 'o', 'p', 0xc4, 0x01, 0x00};
    const unsigned char ext_val[] = {0x81, 0xa2, 'o', 'p', 0xd4, 0x01, 0x00};
    const unsigned char int_key[] = {0x81, 0x01, 0x02};
    const unsigned char nul_str[] = {0x81, 0xa2, 'o', 'p', 0xa3, 'a', 0x00, 'b'};
    const unsigned char trailing[] = {0x80, 0x00};
    const unsigned char not_map[] = {0x93, 0x01, 0x02, 0x03};
    const unsigned char reserved[] = {0xc1};
    struct { const unsigned char *p; size_t n; const char *what; } cases[] = {
        {huge_array, sizeof huge_array, "huge array"}, {huge_map, sizeof huge_map, "huge map"},
        {short_str, sizeof short_str, "short str"},    {bin_val, sizeof bin_val, "bin"},
        {ext_val, sizeof ext_val, "ext"},              {int_key, sizeof int_key, "int key"},
        {nul_str, sizeof nul_str, "NUL"},              {trailing, sizeof trailing, "trailing"},
        {not_map, sizeof not_map, "array"},            {reserved, sizeof reserved, "0xc1"},
        {NULL, 0, "empty"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cJSON *o = parse(cases[i].p, cases[i].n, true, &e);
        cr_assert_null(o, "accepted %s", cases[i].what);
        cr_assert(e.status == KDS_INVALID_ARG && strlen(e.msg) > 0, "%s: %s", cases[i].what, e.msg);
    }
    /* 40 nested single-element arrays inside a map: refused, not crashed */
    unsigned char deep[64];
    size_t n = 0;
    deep[n++] = 0x81, deep[n++] = 0xa1, deep[n++] = 'x';
    for (int d = 0; d < 40; d++) deep[n++] = 0x91;
    deep[n++] = 0x01;
    cr_assert_null(parse(deep, n, true, &e));
}

Test(web_codec, roundtrip_both_forms) {
    cJSON *ev = cJSON_CreateObject();
    cJSON_AddNumberToObject(ev, "id", 7);
    cJSON_AddStringToObject(ev, "event", "token");
    cJSON_AddStringToObject(ev, "text", "h\xc3\xa9llo \"w\"\n");
    cJSON_AddNumberToObject(ev, "rate", 812.25);
    cJSON_AddNumberToObject(ev, "neg", -3);
    cJSON_AddBoolToObject(ev, "ok", 1);
    cJSON_AddNullToObject(ev, "none");
    cJSON *arr = cJSON_AddArrayToObject(ev, "list");
    cJSON_AddItemToArray(arr, cJSON_CreateNumber(1e15));
    for (int form = 0; form < 2; form++) {
        size_t len;
        unsigned char *buf = web__encode(ev, form == 1, &len);
        cr_assert_not_null(buf);
        kds_err e;
        cJSON *back = parse(buf + LWS_PRE, len, form == 1, &e);
        cr_assert_not_null(back, "form %d: %s", form, e.msg);
        cr_assert(cJSON_Compare(ev, back, 1), "form %d changed the event", form);
        cJSON_Delete(back);
        free(buf);
    }
    cJSON_Delete(ev);
}

static char *write_tmp(const char *text) {
    char *path = strdup("/tmp/kds_auth_XXXXXX");
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return path;
}

Test(web_codec, auth_file) {
    struct { const char *text; const char *needle; } bad[] = {
        {"short alice\n", "16 to 256"},
        {"0123456789abcdef0 ali.ce\n", "tenant"},
        {"0123456789abcdef0\n", "two fields"},
        {"0123456789abcdef0 alice extra\n", "two fields"},
        {"0123456789abcdef0 alice\n0123456789abcdef0 bob\n", "twice"},
        {"# only a comment\n\n", "no 'TOKEN TENANT'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        web_server s;
        memset(&s, 0, sizeof s);
        char *path = write_tmp(bad[i].text);
        kds_err e = {0};
        cr_assert_neq(web__auth_load(&s, path, &e), KDS_OK, "accepted case %zu", i);
        cr_assert(strstr(e.msg, bad[i].needle), "case %zu: '%s'", i, e.msg);
        /* the message never repeats a token */
        cr_assert_null(strstr(e.msg, "0123456789abcdef0"), "case %zu leaks the token", i);
        web__auth_free(&s);
        unlink(path);
        free(path);
    }
    web_server s;
    memset(&s, 0, sizeof s);
    char *path = write_tmp("# tokens\n  0123456789abcdef0   alice  \nfedcba9876543210ff bob\n");
    kds_err e = {0};
    cr_assert_eq(web__auth_load(&s, path, &e), KDS_OK, "%s", e.msg);
    cr_assert_str_eq(web__auth_check(&s, "0123456789abcdef0", 17), "alice");
    cr_assert_str_eq(web__auth_check(&s, "fedcba9876543210ff", 18), "bob");
    cr_assert_null(web__auth_check(&s, "0123456789abcdef", 16), "a prefix is not the token");
    cr_assert_null(web__auth_check(&s, "0123456789abcdef00", 18), "a longer token is not it");
    cr_assert_null(web__auth_check(&s, "", 0));
    web__auth_free(&s);
    unlink(path);
    free(path);
}
