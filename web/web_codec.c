/*
 * web_codec.c - the two wire forms of one message: JSON text and msgpack
 * binary. Both parse into the same cJSON tree, so one dispatcher serves
 * both; events are built as cJSON and encoded in the form of the request.
 *
 * msgpack from clients is untrusted: it goes through sess_msgpack_sane (a
 * bounded walk) before msgpack-c sees it, binary/ext values and non-string
 * map keys are refused.
 *
 * Every string of a parsed request, key or value, in either form, is valid
 * UTF-8 without NUL, or the request is refused: a session's text is read
 * back by JSON clients, whose text frames must be UTF-8 (browsers close on
 * anything else), and the rest of the server handles strings as C strings.
 * cJSON decodes the escape \u0000 into a NUL and then keeps only what comes
 * before it, so NULs of a JSON text are looked for in the text itself.
 *
 * Events are written by our own JSON writer rather than cJSON_Print: cJSON
 * prints integers of 2^31 and more through "%1.15g" with a relative
 * tolerance, which gives exponents (1.7961335944013e+15) and rounds ids
 * (9000000000000001 -> 9e+15); decoders that map integers to int64 (Go,
 * serde) refuse both. Here a number with no fraction and |v| < 2^63 is
 * written as an integer literal, any other as the shortest %g that reads
 * back as the same double. Text that is not UTF-8 (a store written before
 * the check) goes out with U+FFFD in place of each bad byte, in both forms.
 */
#include <inttypes.h>
#include <libwebsockets.h>
#include <math.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "web_internal.h"

#define WEB_DEPTH 8

/* Integers below this magnitude are written as integers: every double with
 * no fraction under 2^63 converts to int64_t exactly. */
#define INT_LIMIT 9223372036854775808.0

/* ------------------------------------------------------------------------ */
/* UTF-8                                                                     */

/* Length of the well-formed UTF-8 sequence at p[0 .. n), n >= 1: 1-4, or 0
 * when p does not start one (a stray continuation byte, an overlong form, a
 * surrogate, a code point above U+10FFFF, or a sequence cut off by n). */
static size_t utf8_seq(const unsigned char *p, size_t n) {
    unsigned char c = p[0];
    if (c < 0x80) return 1;
    size_t k;
    unsigned char lo = 0x80, hi = 0xbf; /* the range of the second byte */
    if (c >= 0xc2 && c <= 0xdf) {
        k = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
        k = 3;
        if (c == 0xe0) lo = 0xa0; /* overlong */
        if (c == 0xed) hi = 0x9f; /* U+D800-DFFF */
    } else if (c >= 0xf0 && c <= 0xf4) {
        k = 4;
        if (c == 0xf0) lo = 0x90; /* overlong */
        if (c == 0xf4) hi = 0x8f; /* above U+10FFFF */
    } else {
        return 0;
    }
    if (n < k || p[1] < lo || p[1] > hi) return 0;
    for (size_t i = 2; i < k; i++)
        if ((p[i] & 0xc0) != 0x80) return 0;
    return k;
}

bool web__utf8_valid(const void *p, size_t n, size_t *bad_at) {
    const unsigned char *u = p;
    for (size_t i = 0; i < n;) {
        size_t k = utf8_seq(u + i, n - i);
        if (!k) {
            if (bad_at) *bad_at = i;
            return false;
        }
        i += k;
    }
    return true;
}

size_t web__utf8_prefix(const char *s, size_t max) {
    const unsigned char *u = (const unsigned char *)s;
    size_t n = strlen(s), i = 0;
    while (i < n && i < max) {
        size_t k = utf8_seq(u + i, n - i);
        if (!k) k = 1; /* a bad byte is one unit: it never grows a prefix past max */
        if (i + k > max) break;
        i += k;
    }
    return i;
}

void web__utf8_trim(char *s) {
    size_t n = strlen(s);
    /* a lead byte among the last three whose sequence needs more bytes than follow */
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        unsigned char c = (unsigned char)s[n - back];
        if ((c & 0xc0) == 0x80) continue;
        size_t need = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
        if (need > back) s[n - back] = '\0';
        return;
    }
}

size_t web__utf8_partial_tail(const void *p, size_t n) {
    const unsigned char *u = p;
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        unsigned char c = u[n - back];
        if ((c & 0xc0) == 0x80) continue;
        size_t need = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
        if (need <= back) return 0;
        /* complete it with the smallest bytes that could follow: a real prefix
         * of a character then reads as one */
        unsigned char t[4] = {0x80, 0x80, 0x80, 0x80};
        memcpy(t, u + n - back, back);
        if (back == 1) t[1] = c == 0xe0 ? 0xa0 : c == 0xf0 ? 0x90 : 0x80;
        return utf8_seq(t, need) == need ? back : 0;
    }
    return 0;
}

static int b64_val(unsigned char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

bool web__b64_decode(const char *s, size_t n, unsigned char *out, size_t *out_len) {
    *out_len = 0;
    if (n % 4) return false;
    size_t o = 0;
    for (size_t i = 0; i < n; i += 4) {
        bool end = i + 4 == n;
        int v[4];
        int pad = 0;
        for (int k = 0; k < 4; k++) {
            unsigned char c = (unsigned char)s[i + k];
            if (c == '=' && end && k >= 2) {
                v[k] = 0;
                pad++;
                continue;
            }
            if (pad || (v[k] = b64_val(c)) < 0) return false; /* '=' only at the end */
        }
        uint32_t w =
            (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[o++] = (unsigned char)(w >> 16);
        if (pad < 2) out[o++] = (unsigned char)(w >> 8);
        if (pad < 1) out[o++] = (unsigned char)w;
    }
    *out_len = o;
    return true;
}

/* ------------------------------------------------------------------------ */
/* Parsing                                                                   */

/* Does a JSON text (already parsed by cJSON) hold a NUL in a string: a raw
 * NUL byte, or the escape \u0000? Inside a string a backslash always starts
 * an escape of one character (or of 'u' and four hex digits), so stepping
 * over the character after each backslash keeps "\\u0000" (an escaped
 * backslash, then "u0000") apart from "\u0000". */
static bool json_has_nul(const char *p, size_t n) {
    if (n && memchr(p, 0, n)) return true;
    bool in_string = false;
    for (size_t i = 0; i < n; i++) {
        if (!in_string) {
            in_string = p[i] == '"';
        } else if (p[i] == '"') {
            in_string = false;
        } else if (p[i] == '\\') {
            if (i + 5 < n && p[i + 1] == 'u' && !memcmp(p + i + 2, "0000", 4)) return true;
            i++;
        }
    }
    return false;
}

/* Every key and string of a tree is UTF-8 (what cJSON decodes from a frame
 * that libwebsockets validated is; web__parse promises it for any input). */
static bool tree_utf8(const cJSON *o) {
    for (; o; o = o->next) {
        if (o->string && !web__utf8_valid(o->string, strlen(o->string), NULL)) return false;
        if (cJSON_IsString(o) && !web__utf8_valid(o->valuestring, strlen(o->valuestring), NULL))
            return false;
        if (o->child && !tree_utf8(o->child)) return false;
    }
    return true;
}

/* A msgpack str as a C string: NULL (err set) unless it is UTF-8 without NUL.
 * `what` names it in the message ("string", "map key"); its bytes are never
 * repeated there. Caller owns the result: free(). */
static char *mp_string(const msgpack_object_str *s, const char *what, kds_err *err) {
    size_t bad;
    /* an empty str may come with ptr NULL: no memchr/memcpy on it */
    if (s->size && memchr(s->ptr, 0, s->size)) {
        kds_err_set(err, KDS_INVALID_ARG, "a msgpack %s contains a NUL byte", what);
        return NULL;
    }
    if (s->size && !web__utf8_valid(s->ptr, s->size, &bad)) {
        kds_err_set(err, KDS_INVALID_ARG,
                    "a msgpack %s is not valid UTF-8 (bad byte at offset %zu of its %" PRIu32 ")",
                    what, bad, s->size);
        return NULL;
    }
    char *t = malloc((size_t)s->size + 1);
    if (!t) {
        kds_err_set(err, KDS_NOMEM, "out of memory parsing msgpack");
        return NULL;
    }
    if (s->size) memcpy(t, s->ptr, s->size);
    t[s->size] = '\0';
    return t;
}

static cJSON *from_msgpack(const msgpack_object *o, int depth, kds_err *err) {
    if (depth > WEB_DEPTH) {
        kds_err_set(err, KDS_INVALID_ARG, "msgpack nested deeper than %d", WEB_DEPTH);
        return NULL;
    }
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: return cJSON_CreateNull();
    case MSGPACK_OBJECT_BOOLEAN: return cJSON_CreateBool(o->via.boolean);
    case MSGPACK_OBJECT_POSITIVE_INTEGER: return cJSON_CreateNumber((double)o->via.u64);
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: return cJSON_CreateNumber((double)o->via.i64);
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        if (!isfinite(o->via.f64)) {
            kds_err_set(err, KDS_INVALID_ARG, "msgpack number is not finite");
            return NULL;
        }
        return cJSON_CreateNumber(o->via.f64);
    case MSGPACK_OBJECT_STR: {
        char *t = mp_string(&o->via.str, "string", err);
        if (!t) return NULL;
        cJSON *j = cJSON_CreateString(t);
        free(t);
        return j;
    }
    case MSGPACK_OBJECT_ARRAY: {
        cJSON *a = cJSON_CreateArray();
        for (uint32_t i = 0; a && i < o->via.array.size; i++) {
            cJSON *e = from_msgpack(&o->via.array.ptr[i], depth + 1, err);
            if (!e) {
                cJSON_Delete(a);
                return NULL;
            }
            cJSON_AddItemToArray(a, e);
        }
        return a;
    }
    case MSGPACK_OBJECT_MAP: {
        cJSON *m = cJSON_CreateObject();
        for (uint32_t i = 0; m && i < o->via.map.size; i++) {
            const msgpack_object_kv *kv = &o->via.map.ptr[i];
            if (kv->key.type != MSGPACK_OBJECT_STR || kv->key.via.str.size == 0 ||
                kv->key.via.str.size > 64) {
                kds_err_set(err, KDS_INVALID_ARG, "msgpack map key is not a short string");
                cJSON_Delete(m);
                return NULL;
            }
            char *key = mp_string(&kv->key.via.str, "map key", err);
            cJSON *v = key ? from_msgpack(&kv->val, depth + 1, err) : NULL;
            if (!v) {
                free(key);
                cJSON_Delete(m);
                return NULL;
            }
            cJSON_AddItemToObject(m, key, v);
            free(key);
        }
        return m;
    }
    default:
        kds_err_set(err, KDS_INVALID_ARG, "msgpack bin/ext values are not part of the protocol");
        return NULL;
    }
}

/* A JSON request is held to the msgpack form's limits (sess_msgpack_sane,
 * from_msgpack), so that a request means the same in both encodings: no
 * container with members deeper than WEB_DEPTH, map keys of 1-64 bytes,
 * finite numbers (cJSON reads 1e999 as infinity). Says which in err. */
static bool json_within_limits(const cJSON *n, int depth, kds_err *err) {
    if (cJSON_IsNumber(n) && !isfinite(n->valuedouble)) {
        kds_err_set(err, KDS_INVALID_ARG, "a JSON number is out of range (not a finite double)");
        return false;
    }
    if (!cJSON_IsArray(n) && !cJSON_IsObject(n)) return true;
    if (n->child && depth == WEB_DEPTH) {
        kds_err_set(err, KDS_INVALID_ARG, "JSON nested deeper than %d", WEB_DEPTH);
        return false;
    }
    for (const cJSON *c = n->child; c; c = c->next) {
        if (cJSON_IsObject(n)) {
            size_t k = c->string ? strlen(c->string) : 0;
            if (k == 0 || k > 64) {
                kds_err_set(err, KDS_INVALID_ARG, "a JSON key must have 1 to 64 bytes");
                return false;
            }
        }
        if (!json_within_limits(c, depth + 1, err)) return false;
    }
    return true;
}

cJSON *web__parse(const void *p, size_t len, bool binary, kds_err *err) {
    cJSON *out = NULL;
    if (!binary) {
        const char *end = NULL;
        out = cJSON_ParseWithLengthOpts(p, len, &end, 0);
        if (!out) {
            kds_err_set(err, KDS_INVALID_ARG, "not valid JSON (near byte %zu)",
                        end ? (size_t)(end - (const char *)p) : (size_t)0);
            return NULL;
        }
        /* only whitespace may follow the value */
        for (const char *q = end; q && q < (const char *)p + len; q++)
            if (*q != ' ' && *q != '\n' && *q != '\r' && *q != '\t') {
                cJSON_Delete(out);
                kds_err_set(err, KDS_INVALID_ARG, "trailing bytes after the JSON value");
                return NULL;
            }
        if (json_has_nul(p, len)) {
            cJSON_Delete(out);
            kds_err_set(err, KDS_INVALID_ARG,
                        "a JSON string contains NUL (\\u0000), which no "
                        "string of the protocol may hold");
            return NULL;
        }
        if (!tree_utf8(out)) {
            cJSON_Delete(out);
            kds_err_set(err, KDS_INVALID_ARG, "a JSON string is not valid UTF-8");
            return NULL;
        }
        if (!json_within_limits(out, 0, err)) {
            cJSON_Delete(out);
            return NULL;
        }
    } else {
        if (!sess_msgpack_sane(p, len)) {
            kds_err_set(err, KDS_INVALID_ARG,
                        "not one well-formed msgpack value (or nested deeper than 8)");
            return NULL;
        }
        msgpack_unpacked u;
        msgpack_unpacked_init(&u);
        size_t off = 0;
        msgpack_unpack_return r = msgpack_unpack_next(&u, p, len, &off);
        if (r == MSGPACK_UNPACK_SUCCESS && off == len)
            out = from_msgpack(&u.data, 0, err);
        else
            kds_err_set(err, KDS_INVALID_ARG, "not one well-formed msgpack value");
        msgpack_unpacked_destroy(&u);
        if (!out) {
            if (err && err->status == KDS_OK)
                kds_err_set(err, KDS_NOMEM, "out of memory parsing msgpack");
            return NULL;
        }
    }
    if (!cJSON_IsObject(out)) {
        cJSON_Delete(out);
        kds_err_set(err, KDS_INVALID_ARG, "a request must be an object (a map)");
        return NULL;
    }
    return out;
}

/* ------------------------------------------------------------------------ */
/* Encoding                                                                  */

/* A packer sink. The frame starts with LWS_PRE bytes of headroom (counted
 * in b.len). `failed` sticks: to_msgpack does not check each write, and a
 * frame with a hole in it must not go out. */
typedef struct frame_buf {
    kds_buf b;
    bool failed;
} frame_buf;

static int frame_write(void *data, const char *buf, size_t len) {
    frame_buf *f = data;
    if (f->failed || kds_buf_append(&f->b, buf, len, NULL) != KDS_OK) {
        f->failed = true;
        return -1;
    }
    return 0;
}

/* Text as UTF-8: valid runs as they are, U+FFFD for each byte that starts
 * no valid sequence. `put` receives the pieces in order. */
static const char REPLACEMENT[] = "\xef\xbf\xbd";

static void put_utf8(frame_buf *f, const char *s, size_t n,
                     void (*put)(frame_buf *f, const char *p, size_t n)) {
    const unsigned char *u = (const unsigned char *)s;
    size_t run = 0, i = 0;
    while (i < n) {
        size_t k = utf8_seq(u + i, n - i);
        if (k) {
            i += k;
            continue;
        }
        put(f, s + run, i - run);
        put(f, REPLACEMENT, sizeof REPLACEMENT - 1);
        run = ++i;
    }
    put(f, s + run, n - run);
}

static void put_raw(frame_buf *f, const char *p, size_t n) {
    if (n) frame_write(f, p, n);
}

/* A JSON string body piece: '"', '\\' and control characters escaped,
 * everything else (UTF-8 already) as it is. */
static void put_json_escaped(frame_buf *f, const char *p, size_t n) {
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        put_raw(f, p + run, i - run);
        char esc[8];
        switch (c) {
        case '"': memcpy(esc, "\\\"", 3); break;
        case '\\': memcpy(esc, "\\\\", 3); break;
        case '\n': memcpy(esc, "\\n", 3); break;
        case '\r': memcpy(esc, "\\r", 3); break;
        case '\t': memcpy(esc, "\\t", 3); break;
        case '\b': memcpy(esc, "\\b", 3); break;
        case '\f': memcpy(esc, "\\f", 3); break;
        default: snprintf(esc, sizeof esc, "\\u%04x", c); break;
        }
        put_raw(f, esc, strlen(esc));
        run = i + 1;
    }
    put_raw(f, p + run, n - run);
}

static void json_string(frame_buf *f, const char *s) {
    put_raw(f, "\"", 1);
    put_utf8(f, s, strlen(s), put_json_escaped);
    put_raw(f, "\"", 1);
}

static void json_number(frame_buf *f, double v) {
    char t[40];
    if (!isfinite(v)) {
        snprintf(t, sizeof t, "null");
    } else if (v == floor(v) && fabs(v) < INT_LIMIT) {
        snprintf(t, sizeof t, "%" PRId64, (int64_t)v);
    } else {
        /* the shortest of 15, 16, 17 digits that reads back as v (17 always does) */
        for (int digits = 15; digits <= 17; digits++) {
            snprintf(t, sizeof t, "%.*g", digits, v);
            if (strtod(t, NULL) == v) break;
        }
    }
    put_raw(f, t, strlen(t));
}

static void to_json(frame_buf *f, const cJSON *o) {
    if (cJSON_IsTrue(o)) {
        put_raw(f, "true", 4);
    } else if (cJSON_IsFalse(o)) {
        put_raw(f, "false", 5);
    } else if (cJSON_IsNumber(o)) {
        json_number(f, o->valuedouble);
    } else if (cJSON_IsString(o)) {
        json_string(f, o->valuestring);
    } else if (cJSON_IsArray(o) || cJSON_IsObject(o)) {
        bool obj = cJSON_IsObject(o);
        put_raw(f, obj ? "{" : "[", 1);
        for (const cJSON *e = o->child; e; e = e->next) {
            if (e != o->child) put_raw(f, ",", 1);
            if (obj) {
                json_string(f, e->string ? e->string : "");
                put_raw(f, ":", 1);
            }
            to_json(f, e);
        }
        put_raw(f, obj ? "}" : "]", 1);
    } else {
        put_raw(f, "null", 4); /* null, and anything cJSON could hold that JSON cannot */
    }
}

static void pack_str(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    if (web__utf8_valid(s, n, NULL)) {
        msgpack_pack_str(pk, n);
        msgpack_pack_str_body(pk, s, n);
        return;
    }
    /* the header needs the length after replacement: collect the body first */
    frame_buf t = {0};
    put_utf8(&t, s, n, put_raw);
    if (t.failed) {
        frame_buf *out = pk->data;
        out->failed = true;
    } else {
        msgpack_pack_str(pk, t.b.len);
        msgpack_pack_str_body(pk, t.b.p, t.b.len);
    }
    kds_buf_free(&t.b);
}

static void to_msgpack(msgpack_packer *pk, const cJSON *o) {
    if (cJSON_IsNull(o) || cJSON_IsInvalid(o)) {
        msgpack_pack_nil(pk);
    } else if (cJSON_IsTrue(o)) {
        msgpack_pack_true(pk);
    } else if (cJSON_IsFalse(o)) {
        msgpack_pack_false(pk);
    } else if (cJSON_IsNumber(o)) {
        double v = o->valuedouble;
        if (v == floor(v) && fabs(v) < INT_LIMIT)
            msgpack_pack_int64(pk, (int64_t)v);
        else
            msgpack_pack_double(pk, v);
    } else if (cJSON_IsString(o)) {
        pack_str(pk, o->valuestring);
    } else if (cJSON_IsArray(o)) {
        msgpack_pack_array(pk, (size_t)cJSON_GetArraySize(o));
        for (const cJSON *e = o->child; e; e = e->next) to_msgpack(pk, e);
    } else if (cJSON_IsObject(o)) {
        msgpack_pack_map(pk, (size_t)cJSON_GetArraySize(o));
        for (const cJSON *e = o->child; e; e = e->next) {
            pack_str(pk, e->string ? e->string : "");
            to_msgpack(pk, e);
        }
    } else {
        msgpack_pack_nil(pk);
    }
}

unsigned char *web__encode(const cJSON *ev, bool msgpack, size_t *len) {
    *len = 0;
    frame_buf f = {0};
    static const char headroom[LWS_PRE];
    frame_write(&f, headroom, LWS_PRE);
    if (msgpack) {
        msgpack_packer pk;
        msgpack_packer_init(&pk, &f, frame_write);
        to_msgpack(&pk, ev);
    } else {
        to_json(&f, ev);
    }
    if (f.failed) {
        kds_buf_free(&f.b);
        return NULL;
    }
    size_t n;
    unsigned char *frame = kds_buf_detach(&f.b, &n);
    *len = n - LWS_PRE;
    return frame;
}
