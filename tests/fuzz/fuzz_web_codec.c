/*
 * fuzz_web_codec.c - libFuzzer target: one WebSocket request as the server
 * receives it (web__parse, web/web_internal.h). The first input byte
 * chooses the frame type (bit 0: 1 binary = msgpack, 0 text = JSON); the
 * rest is the frame's payload.
 *
 * Properties (web_codec.c's header and docs/protocol.md state them):
 *   - a request is an object, or it is refused with a message;
 *   - no string of an accepted request holds a NUL (C code downstream reads
 *     names and ops as C strings: "a\u0000b" would be read as "a");
 *   - an accepted request survives both encodings: encode it as JSON and as
 *     msgpack (web__encode, what events go out as), parse each back, and the
 *     tree is the same, in order. So the two forms of the protocol accept
 *     the same requests: a JSON request beyond the msgpack form's limits (a
 *     key empty or over 64 bytes, nesting deeper than 8, a number such as
 *     1e999 that parses as infinite) must be refused as its msgpack twin is.
 */
#include "fuzz_util.h"

#include <math.h>

#include "web_internal.h"

/* Structural equality in order (cJSON_Compare looks keys up by name, which
 * a repeated key defeats). */
static bool same_tree(const cJSON *a, const cJSON *b) {
    if ((a->type & 0xff) != (b->type & 0xff)) return false;
    if ((a->string == NULL) != (b->string == NULL)) return false;
    if (a->string && strcmp(a->string, b->string) != 0) return false;
    /* cJSON prints a double with 15 digits when that reads back within its
     * own tolerance, so JSON may move one by an ulp or two: the protocol
     * echoes only integer ids, and takes other numbers as parameters */
    if (cJSON_IsNumber(a))
        return a->valuedouble == b->valuedouble ||
               fabs(a->valuedouble - b->valuedouble) <= 1e-14 * fabs(a->valuedouble);
    if (cJSON_IsString(a)) return strcmp(a->valuestring, b->valuestring) == 0;
    const cJSON *x = a->child, *y = b->child;
    for (; x && y; x = x->next, y = y->next)
        if (!same_tree(x, y)) return false;
    return !x && !y;
}

/* Does a JSON text that cJSON accepted hold a NUL inside a string (an
 * escaped \u0000 or a raw 0 byte)? A scanner of its own, so the answer
 * does not depend on the parser under test. */
static bool json_has_nul_string(const uint8_t *p, size_t n) {
    bool in = false;
    for (size_t i = 0; i < n; i++) {
        if (!in) {
            in = p[i] == '"';
            continue;
        }
        if (p[i] == '"') {
            in = false;
        } else if (p[i] == 0) {
            return true;
        } else if (p[i] == '\\' && i + 1 < n) {
            if (p[i + 1] == 'u' && i + 5 < n && !memcmp(p + i + 2, "0000", 4)) return true;
            i++;
        }
    }
    return false;
}

/* A number neither encoding can carry (JSON's 1e999 parses as inf). */
static bool has_nonfinite(const cJSON *o) {
    if (cJSON_IsNumber(o) && !isfinite(o->valuedouble)) return true;
    for (const cJSON *c = o->child; c; c = c->next)
        if (has_nonfinite(c)) return true;
    return false;
}

static void round_trip(const cJSON *req, bool msgpack) {
    size_t n = 0;
    unsigned char *frame = web__encode(req, msgpack, &n);
    if (!frame) fz_fail("encoding an accepted request failed");
    kds_err e = {0};
    cJSON *back = web__parse(frame + LWS_PRE, n, msgpack, &e);
    if (!back) {
        fz_fail("an accepted request, encoded as %s, is refused: %s",
                msgpack ? "msgpack" : "JSON", e.msg);
    } else if (!same_tree(req, back)) {
        char *a = cJSON_PrintUnformatted(req), *b = cJSON_PrintUnformatted(back);
        fz_fail("a request changes through %s:\n%s\n%s", msgpack ? "msgpack" : "JSON", a, b);
    }
    cJSON_Delete(back);
    free(frame);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const bool binary = data[0] & 1;
    const uint8_t *p = data + 1;
    const size_t n = size - 1;
    kds_err e = {0};
    cJSON *req = web__parse(p, n, binary, &e);
    if (!req) {
        if (e.status == KDS_OK || !e.msg[0]) fz_fail("a request refused without a message");
        return 0;
    }
    if (!cJSON_IsObject(req)) fz_fail("web__parse accepted a request that is not an object");
    if (!binary && json_has_nul_string(p, n))
        fz_fail("a JSON request with a NUL inside a string was accepted");
    if (has_nonfinite(req))
        fz_fail("a request with a non-finite number was accepted (msgpack's are refused)");
    round_trip(req, false);
    round_trip(req, true);
    cJSON_Delete(req);
    return 0;
}
