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

/* Bytes the auth file may not hold, found by tests/fuzz/fuzz_auth.c: a
 * token is printable ASCII (docs/protocol.md), and a NUL byte refuses the
 * file (a C line reader cut the line there and read the rest as a line of
 * its own, so "#\0TOKEN TENANT" hid a token behind a comment). */
Test(web_codec, auth_file_bytes) {
    static const char nul_comment[] = "#\0" "0123456789abcdef0 mallory\n";
    struct { const char *bytes; size_t n; const char *needle; } bad[] = {
        {"token\x01\x7f\xc3\xa9-0123456789 alice\n", 0, "printable ASCII"},
        {"0123456789abcdef\xc3\xa9 alice\n", 0, "printable ASCII"},
        {"0123456789abcdef\x7f alice\n", 0, "byte 0x7f"},
        {nul_comment, sizeof nul_comment - 1, "NUL"},
        {"0123456789abcdef0 alice\n\0", 25, ":2: a NUL"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        size_t n = bad[i].n ? bad[i].n : strlen(bad[i].bytes);
        char *path = strdup("/tmp/kds_auth_XXXXXX");
        int fd = mkstemp(path);
        cr_assert(fd >= 0);
        cr_assert_eq(write(fd, bad[i].bytes, n), (ssize_t)n);
        close(fd);
        web_server s;
        memset(&s, 0, sizeof s);
        kds_err e = {0};
        cr_expect_neq(web__auth_load(&s, path, &e), KDS_OK, "accepted case %zu", i);
        cr_expect(strstr(e.msg, bad[i].needle), "case %zu: '%s'", i, e.msg);
        cr_expect_null(strstr(e.msg, "0123456789"), "case %zu leaks the token", i);
        web__auth_free(&s);
        unlink(path);
        free(path);
    }
}

/* A JSON request is held to the msgpack form's limits, so it means the same
 * in both (found by tests/fuzz/fuzz_web_codec.c): nesting, key sizes and
 * finite numbers. */
Test(web_codec, json_held_to_msgpack_limits) {
    char key64[65], ok64[128], bad65[128];
    memset(key64, 'k', 64);
    key64[64] = 0;
    snprintf(ok64, sizeof ok64, "{\"op\":\"ping\",\"%s\":1}", key64);
    snprintf(bad65, sizeof bad65, "{\"op\":\"ping\",\"%sk\":1}", key64);
    struct { const char *json; const char *needle; } bad[] = {
        {"{\"id\":[[[[[[[[1]]]]]]]],\"op\":\"ping\"}", "deeper than 8"},
        {"{\"op\":\"ping\",\"x\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":1}}}}}}}}}",
         "deeper than 8"},
        {"{\"\":1,\"op\":\"ping\"}", "1 to 64 bytes"},
        {bad65, "1 to 64 bytes"},
        {"{\"id\":1e999,\"op\":\"ping\"}", "finite"},
        {"{\"op\":\"ping\",\"t\":[-1e400]}", "finite"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kds_err e = {0};
        cJSON *o = parse(bad[i].json, strlen(bad[i].json), false, &e);
        cr_expect_null(o, "accepted %s", bad[i].json);
        cJSON_Delete(o);
        cr_expect(e.status == KDS_INVALID_ARG && strstr(e.msg, bad[i].needle), "%s: '%s'",
                  bad[i].json, e.msg);
    }
    const char *fine[] = {"{\"id\":[[[[[[[1]]]]]]],\"op\":\"ping\"}", ok64,
                          "{\"op\":\"ping\",\"x\":[[[[[[[[]]]]]]]]}", "{\"id\":1e308,\"op\":\"ping\"}"};
    for (size_t i = 0; i < sizeof fine / sizeof fine[0]; i++) {
        kds_err e = {0};
        cJSON *o = parse(fine[i], strlen(fine[i]), false, &e);
        cr_expect_not_null(o, "refused %s: %s", fine[i], e.msg);
        cJSON_Delete(o);
    }
}

/* An OpenAI error message naming a client's string cuts it on a character
 * boundary (found by tests/fuzz/fuzz_http_api.c: a 100-byte cut inside
 * "é" put invalid UTF-8 into the JSON error body). */
Test(web_codec, openai_errors_stay_utf8) {
    char body[256], a99[100];
    memset(a99, 'a', 99);
    a99[99] = 0;
    snprintf(body, sizeof body, "{\"model\":\"%s\xc3\xa9\",\"prompt\":\"x\"}", a99);
    kds_err pe = {0};
    cJSON *o = parse(body, strlen(body), false, &pe);
    cr_assert_not_null(o, "%s", pe.msg);
    web_oai q;
    web_oai_err e;
    cr_assert_not(web__oai_parse(o, WEB_ROUTE_COMPLETIONS, NULL, "default", &q, &e));
    cr_expect_eq(e.status, 404);
    cr_expect(web__utf8_valid(e.msg, strlen(e.msg), NULL), "not UTF-8: %s", e.msg);
    cr_expect(strstr(e.msg, "does not exist"), "%s", e.msg);
    cJSON_Delete(o);
}

/* ------------------------------------------------------------------------ */
/* Text and numbers on the wire (issue 16)                                   */

/* Strict UTF-8 (RFC 3629, table 3-7 of Unicode): no overlong forms, no
 * surrogates, nothing above U+10FFFF. Written here from the table, not taken
 * from the code under test. */
static bool utf8_ok(const unsigned char *p, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = p[i];
        size_t k;
        unsigned char lo = 0x80, hi = 0xbf;
        if (c < 0x80) {
            i++;
            continue;
        } else if (c >= 0xc2 && c <= 0xdf) {
            k = 1;
        } else if (c >= 0xe0 && c <= 0xef) {
            k = 2;
            if (c == 0xe0) lo = 0xa0;
            if (c == 0xed) hi = 0x9f;
        } else if (c >= 0xf0 && c <= 0xf4) {
            k = 3;
            if (c == 0xf0) lo = 0x90;
            if (c == 0xf4) hi = 0x8f;
        } else {
            return false;
        }
        if (i + k >= n) return false; /* the sequence is cut off */
        if (p[i + 1] < lo || p[i + 1] > hi) return false;
        for (size_t j = 2; j <= k; j++)
            if (p[i + j] < 0x80 || p[i + j] > 0xbf) return false;
        i += k + 1;
    }
    return true;
}

/* {"op": "generate", KEY: <str of len bytes>} as msgpack. */
static size_t mp_map_with_str(unsigned char *out, const char *key, const void *s, size_t len) {
    size_t n = 0, kl = strlen(key);
    out[n++] = 0x82;
    out[n++] = 0xa2, out[n++] = 'o', out[n++] = 'p';
    out[n++] = 0xa8;
    memcpy(out + n, "generate", 8), n += 8;
    out[n++] = (unsigned char)(0xa0 | kl);
    memcpy(out + n, key, kl), n += kl;
    out[n++] = 0xd9, out[n++] = (unsigned char)len; /* str8 */
    memcpy(out + n, s, len), n += len;
    return n;
}

Test(web_codec, msgpack_strings_must_be_utf8) {
    struct {
        const char *bytes;
        const char *what;
    } bad[] = {
        {"f\xff\xfeg", "0xff 0xfe"},
        {"caf\xc3", "a sequence cut at the end"},
        {"\xc0\xaf", "an overlong '/'"},
        {"\xe0\x80\xaf", "a 3-byte overlong"},
        {"\xed\xa0\x80", "a UTF-16 surrogate (U+D800)"},
        {"\xf4\x90\x80\x80", "above U+10FFFF"},
        {"a\x80z", "a lone continuation byte"},
    };
    unsigned char buf[300];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kds_err e;
        size_t n = mp_map_with_str(buf, "text", bad[i].bytes, strlen(bad[i].bytes));
        cJSON *o = parse(buf, n, true, &e);
        cr_expect_null(o, "accepted a string with %s", bad[i].what);
        cJSON_Delete(o);
        cr_expect(e.status == KDS_INVALID_ARG && strlen(e.msg) > 0, "%s: %s", bad[i].what, e.msg);
        cr_expect(utf8_ok((const unsigned char *)e.msg, strlen(e.msg)),
                  "%s: the error message is not UTF-8 itself", bad[i].what);
        /* a key that is not UTF-8 is refused too */
        n = 0;
        buf[n++] = 0x81;
        buf[n++] = (unsigned char)(0xa0 | strlen(bad[i].bytes));
        memcpy(buf + n, bad[i].bytes, strlen(bad[i].bytes)), n += strlen(bad[i].bytes);
        buf[n++] = 0x01;
        o = parse(buf, n, true, &e);
        cr_expect_null(o, "accepted a key with %s", bad[i].what);
        cJSON_Delete(o);
    }
    /* every form of valid text passes unchanged: 2, 3 and 4-byte characters,
     * the largest code point, the ones around the surrogates */
    const char *good =
        "h\xc3\xa9llo \xe2\x82\xac \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbf \xed\x9f\xbf \xee\x80\x80";
    kds_err e;
    size_t n = mp_map_with_str(buf, "text", good, strlen(good));
    cJSON *o = parse(buf, n, true, &e);
    cr_assert_not_null(o, "valid UTF-8 refused: %s", e.msg);
    cr_expect_str_eq(cJSON_GetObjectItem(o, "text")->valuestring, good);
    cJSON_Delete(o);
}

Test(web_codec, json_strings_with_nul_refused) {
    const char *bad[] = {
        "{\"op\":\"ping\\u0000junk\"}",
        "{\"op\":\"create\",\"session\":\"nul\\u0000evil\"}",
        "{\"op\":\"generate\",\"session\":\"s\",\"text\":\"a\\u0000b\"}",
        "{\"op\":\"ping\",\"o\\u0000p\":1}",
        "{\"op\":\"ping\",\"x\":[\"\\u0000\"]}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kds_err e;
        cJSON *o = parse(bad[i], strlen(bad[i]), false, &e);
        cr_expect_null(o, "accepted %s", bad[i]);
        cJSON_Delete(o);
        cr_expect(e.status == KDS_INVALID_ARG && strstr(e.msg, "NUL"), "%s: '%s'", bad[i], e.msg);
    }
    /* a raw NUL byte inside a string (JSON does not allow it, cJSON would cut there) */
    const char raw[] = "{\"op\":\"ping\",\"t\":\"a\0b\"}";
    kds_err e;
    cJSON *o = parse(raw, sizeof raw - 1, false, &e);
    cr_expect_null(o, "accepted a raw NUL byte in a string");
    cJSON_Delete(o);
    /* an escaped backslash followed by "u0000" is six plain characters */
    const char *fine = "{\"op\":\"ping\",\"t\":\"a\\\\u0000b\"}";
    o = parse(fine, strlen(fine), false, &e);
    cr_assert_not_null(o, "refused %s: %s", fine, e.msg);
    cr_expect_str_eq(cJSON_GetObjectItem(o, "t")->valuestring, "a\\u0000b");
    cJSON_Delete(o);
}

/* An empty msgpack string (a0) alone and as a value: UBSan's nonnull check
 * (KDS_SANITIZE=ON, UBSAN_OPTIONS=halt_on_error=1) catches memchr(NULL, 0, 0). */
Test(web_codec, empty_msgpack_string) {
    kds_err e;
    const unsigned char alone[] = {0xa0};
    cJSON *o = parse(alone, sizeof alone, true, &e);
    cr_expect_null(o, "a bare string is not a request");
    cr_expect(e.status == KDS_INVALID_ARG);
    const unsigned char in_map[] = {0x82, 0xa2, 'o', 'p',  0xa4, 'p',
                                    'i',  'n',  'g', 0xa1, 'x',  0xa0};
    o = parse(in_map, sizeof in_map, true, &e);
    cr_assert_not_null(o, "%s", e.msg);
    cr_expect_str_eq(cJSON_GetObjectItem(o, "x")->valuestring, "");
    cJSON_Delete(o);
}

/* The JSON text of a one-field event {"v": x}. */
static char *json_of_number(const char *key, double v) {
    cJSON *ev = cJSON_CreateObject();
    cJSON_AddNumberToObject(ev, key, v);
    size_t len;
    unsigned char *buf = web__encode(ev, false, &len);
    cJSON_Delete(ev);
    cr_assert_not_null(buf);
    char *t = malloc(len + 1);
    memcpy(t, buf + LWS_PRE, len);
    t[len] = '\0';
    free(buf);
    return t;
}

Test(web_codec, integers_are_printed_as_integers) {
    struct {
        double v;
        const char *want;
    } ints[] = {
        {9000000000000001.0, "{\"id\":9000000000000001}"},
        {9007199254740991.0, "{\"id\":9007199254740991}"},
        {-9007199254740991.0, "{\"id\":-9007199254740991}"},
        {4503599627370497.0, "{\"id\":4503599627370497}"},
        {1796133594401300.0, "{\"id\":1796133594401300}"},
        {1e15, "{\"id\":1000000000000000}"},
        {0.0, "{\"id\":0}"},
        {-1.0, "{\"id\":-1}"},
        {2147483648.0, "{\"id\":2147483648}"},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        char *t = json_of_number("id", ints[i].v);
        cr_expect_str_eq(t, ints[i].want, "%.17g", ints[i].v);
        free(t);
    }
    /* fractions keep every digit that the double holds, in the shortest form */
    struct {
        double v;
    } fl[] = {{816.3}, {0.1}, {-2.5e-7}, {1.0 / 3.0}, {6.02214076e23}};
    for (size_t i = 0; i < sizeof fl / sizeof fl[0]; i++) {
        char *t = json_of_number("x", fl[i].v);
        cJSON *back = cJSON_Parse(t);
        cr_assert_not_null(back, "%s", t);
        cr_expect(cJSON_GetObjectItem(back, "x")->valuedouble == fl[i].v, "%s vs %.17g", t,
                  fl[i].v);
        cJSON_Delete(back);
        free(t);
    }
    /* msgpack: the same integers as msgpack integers (int64 / uint64 forms) */
    cJSON *ev = cJSON_CreateObject();
    cJSON_AddNumberToObject(ev, "id", 9000000000000001.0);
    size_t len;
    unsigned char *buf = web__encode(ev, true, &len);
    cJSON_Delete(ev);
    const unsigned char want[] = {0x81, 0xa2, 'i',  'd',  0xcf, 0x00, 0x1f,
                                  0xf9, 0x73, 0xca, 0xfa, 0x80, 0x01};
    const unsigned char want_signed[] = {0x81, 0xa2, 'i',  'd',  0xd3, 0x00, 0x1f,
                                         0xf9, 0x73, 0xca, 0xfa, 0x80, 0x01};
    cr_assert_eq(len, sizeof want);
    cr_expect(!memcmp(buf + LWS_PRE, want, len) || !memcmp(buf + LWS_PRE, want_signed, len),
              "9000000000000001 is not a msgpack integer");
    free(buf);
}

/* Text that is not UTF-8 (a store written before the check, say) goes out
 * as UTF-8 with U+FFFD in place of each bad sequence, in both forms. */
Test(web_codec, events_are_always_utf8) {
    cJSON *ev = cJSON_CreateObject();
    cJSON_AddStringToObject(ev, "event", "result");
    cJSON_AddStringToObject(ev, "reply", "ok \xff\xfe and caf\xc3");
    cJSON *a = cJSON_AddArrayToObject(ev, "turns");
    cJSON_AddItemToArray(a, cJSON_CreateString("\xed\xa0\x80 x"));
    for (int form = 0; form < 2; form++) {
        size_t len;
        unsigned char *buf = web__encode(ev, form == 1, &len);
        cr_assert_not_null(buf);
        kds_err e;
        cJSON *back = parse(buf + LWS_PRE, len, form == 1, &e);
        cr_assert_not_null(back, "form %d: %s", form, e.msg);
        const char *r = cJSON_GetObjectItem(back, "reply")->valuestring;
        cr_expect(utf8_ok((const unsigned char *)r, strlen(r)), "form %d: reply not UTF-8", form);
        cr_expect(strstr(r, "ok \xef\xbf\xbd") == r, "form %d: '%s'", form, r);
        const char *t = cJSON_GetArrayItem(cJSON_GetObjectItem(back, "turns"), 0)->valuestring;
        cr_expect(utf8_ok((const unsigned char *)t, strlen(t)), "form %d: turn not UTF-8", form);
        if (form == 0) cr_expect(utf8_ok(buf + LWS_PRE, len), "the JSON frame is not UTF-8");
        cJSON_Delete(back);
        free(buf);
    }
    cJSON_Delete(ev);
}

/* An error message cut at its size limit does not end in half a character. */
Test(web_codec, error_messages_stay_utf8) {
    web_server *s = calloc(1, sizeof *s);
    cr_assert_not_null(s);
    char big[2048] = "";
    for (int i = 0; i < 600; i++)
        strcat(big, "\xc3\xa9"); /* é: 1200 bytes */
    for (int shift = 0; shift < 2; shift++) {
        cJSON *ev = web__error(s, NULL, WEB_ERR_BAD_REQUEST, "%s%s", shift ? "x" : "", big);
        cr_assert_not_null(ev);
        const char *m = cJSON_GetObjectItem(ev, "message")->valuestring;
        cr_expect(strlen(m) > 100, "message too short: %zu bytes", strlen(m));
        cr_expect(utf8_ok((const unsigned char *)m, strlen(m)),
                  "shift %d: the message ends in half a character", shift);
        cJSON_Delete(ev);
    }
    free(s);
}
