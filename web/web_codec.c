/*
 * web_codec.c - the two wire forms of one message: JSON text and msgpack
 * binary. Both parse into the same cJSON tree, so one dispatcher serves
 * both; events are built as cJSON and encoded in the form of the request.
 *
 * msgpack from clients is untrusted: it goes through sess_msgpack_sane (a
 * bounded walk) before msgpack-c sees it, binary/ext values and non-string
 * map keys are refused, and strings must not contain NUL.
 */
#include <libwebsockets.h>
#include <math.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "web_internal.h"

#define WEB_DEPTH 8

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
        if (memchr(o->via.str.ptr, 0, o->via.str.size)) {
            kds_err_set(err, KDS_INVALID_ARG, "msgpack string contains a NUL byte");
            return NULL;
        }
        char *t = malloc(o->via.str.size + 1);
        if (!t) return NULL;
        memcpy(t, o->via.str.ptr, o->via.str.size);
        t[o->via.str.size] = '\0';
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
                kv->key.via.str.size > 64 || memchr(kv->key.via.str.ptr, 0, kv->key.via.str.size)) {
                kds_err_set(err, KDS_INVALID_ARG, "msgpack map key is not a short string");
                cJSON_Delete(m);
                return NULL;
            }
            char key[65];
            memcpy(key, kv->key.via.str.ptr, kv->key.via.str.size);
            key[kv->key.via.str.size] = '\0';
            cJSON *v = from_msgpack(&kv->val, depth + 1, err);
            if (!v) {
                cJSON_Delete(m);
                return NULL;
            }
            cJSON_AddItemToObject(m, key, v);
        }
        return m;
    }
    default:
        kds_err_set(err, KDS_INVALID_ARG, "msgpack bin/ext values are not part of the protocol");
        return NULL;
    }
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

static void pack_str(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
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
        if (v == floor(v) && fabs(v) < 9007199254740992.0)
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
            pack_str(pk, e->string);
            to_msgpack(pk, e);
        }
    } else {
        msgpack_pack_nil(pk);
    }
}

unsigned char *web__encode(const cJSON *ev, bool msgpack, size_t *len) {
    *len = 0;
    if (!msgpack) {
        char *t = cJSON_PrintUnformatted(ev);
        if (!t) return NULL;
        size_t n = strlen(t);
        unsigned char *b = malloc(LWS_PRE + n + 1);
        if (b) {
            memcpy(b + LWS_PRE, t, n + 1);
            *len = n;
        }
        free(t);
        return b;
    }
    frame_buf f = {0};
    static const char headroom[LWS_PRE];
    frame_write(&f, headroom, LWS_PRE);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &f, frame_write);
    to_msgpack(&pk, ev);
    if (f.failed) {
        kds_buf_free(&f.b);
        return NULL;
    }
    size_t n;
    unsigned char *frame = kds_buf_detach(&f.b, &n);
    *len = n - LWS_PRE;
    return frame;
}
