/*
 * sess_record.c - the byte forms of stored records: the 24-byte frame, the
 * bounded msgpack walk that runs before msgpack-c sees untrusted bytes, and
 * the msgpack headers of snapshots, chunks, sessions and transcript turns
 * (docs/snapshot-format.md).
 */
#include "kds_le.h"
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>
#include <zstd.h>

#include "sess_internal.h"

uint64_t sess__xxh3(const void *p, size_t n) { return (uint64_t)XXH3_64bits(p, n); }

uint64_t sess__now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}


/* ------------------------------------------------------------------------ */
/* Bounded msgpack walk                                                      */

#define WALK_DEPTH 8
#define WALK_ELEMS ((uint64_t)1 << 22)

static uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

bool sess__msgpack_sane(const unsigned char *p, size_t len) {
    /* stack[d] = objects still to read at depth d */
    uint64_t stack[WALK_DEPTH + 1];
    int depth = 0;
    uint64_t elems = 0;
    size_t i = 0;
    stack[0] = 1;
    while (depth >= 0) {
        if (stack[depth] == 0) {
            depth--;
            continue;
        }
        stack[depth]--;
        if (i >= len || ++elems > WALK_ELEMS) return false;
        unsigned t = p[i++];
        uint64_t skip = 0, children = 0;
        int nlen = 0;         /* bytes of a length field that follows */
        int kind = 0;         /* 0 scalar/skip, 1 array, 2 map */
        if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) {
        } else if (t >= 0x80 && t <= 0x8f) {
            kind = 2, children = t & 0x0f;
        } else if (t >= 0x90 && t <= 0x9f) {
            kind = 1, children = t & 0x0f;
        } else if (t >= 0xa0 && t <= 0xbf) {
            skip = t & 0x1f;
        } else {
            switch (t) {
            case 0xc4: case 0xd9: nlen = 1; break;
            case 0xc5: case 0xda: nlen = 2; break;
            case 0xc6: case 0xdb: nlen = 4; break;
            case 0xc7: nlen = 1, skip = 1; break; /* ext: + type byte */
            case 0xc8: nlen = 2, skip = 1; break;
            case 0xc9: nlen = 4, skip = 1; break;
            case 0xca: skip = 4; break;
            case 0xcb: skip = 8; break;
            case 0xcc: case 0xd0: skip = 1; break;
            case 0xcd: case 0xd1: skip = 2; break;
            case 0xce: case 0xd2: skip = 4; break;
            case 0xcf: case 0xd3: skip = 8; break;
            case 0xd4: skip = 2; break;
            case 0xd5: skip = 3; break;
            case 0xd6: skip = 5; break;
            case 0xd7: skip = 9; break;
            case 0xd8: skip = 17; break;
            case 0xdc: kind = 1, nlen = 2; break;
            case 0xdd: kind = 1, nlen = 4; break;
            case 0xde: kind = 2, nlen = 2; break;
            case 0xdf: kind = 2, nlen = 4; break;
            default: return false; /* 0xc1 */
            }
        }
        if (nlen) {
            if (len - i < (size_t)nlen) return false;
            uint64_t n = be(p + i, nlen);
            i += (size_t)nlen;
            if (kind)
                children = n;
            else
                skip += n;
        }
        if (skip > len - i) return false;
        i += (size_t)skip;
        if (kind) {
            /* every element needs at least one byte: a count larger than the
             * rest is a lie (and would make msgpack-c reserve it up front) */
            uint64_t objs = kind == 2 ? children * 2 : children;
            if (children > len || objs > len - i) return false;
            if (objs) {
                if (depth == WALK_DEPTH) return false;
                stack[++depth] = objs;
            }
        }
    }
    return i == len;
}

bool sess_msgpack_sane(const void *p, size_t len) { return sess__msgpack_sane(p, len); }

/* ------------------------------------------------------------------------ */
/* Frame                                                                     */

void sess__frame_write(unsigned char *rec, const char *magic, uint32_t version,
                       size_t header_len) {
    memcpy(rec, magic, 8);
    kds_put32(rec + 8, version);
    kds_put32(rec + 12, (uint32_t)header_len);
    kds_put64(rec + 16, sess__xxh3(rec + SESS_FRAME_BYTES, header_len));
}

kds_status sess__frame_parse(const void *rec, size_t len, const char *magic, uint32_t version,
                             const char *what, sess__frame *out, kds_err *err) {
    const unsigned char *p = rec;
    if (len < SESS_FRAME_BYTES || memcmp(p, magic, 8) != 0)
        return kds_err_set(err, KDS_BAD_FORMAT, "%s: bad magic (not a kdaserve %.7s record)",
                           what, magic);
    uint32_t v = kds_get32(p + 8);
    if (v != version)
        return kds_err_set(err, KDS_UNSUPPORTED,
                           "%s: unknown format version %u (this build reads version %u)", what, v,
                           version);
    uint32_t h = kds_get32(p + 12);
    if (h > SESS_HEADER_MAX || h > len - SESS_FRAME_BYTES)
        return kds_err_set(err, KDS_CORRUPT, "%s: header length %u exceeds the record (%zu bytes)",
                           what, h, len);
    const unsigned char *hdr = p + SESS_FRAME_BYTES;
    if (sess__xxh3(hdr, h) != kds_get64(p + 16))
        return kds_err_set(err, KDS_CORRUPT, "%s: header checksum mismatch (record is damaged)",
                           what);
    if (!sess__msgpack_sane(hdr, h) || h == 0 || !((hdr[0] & 0xf0) == 0x80 || hdr[0] == 0xde ||
                                                   hdr[0] == 0xdf))
        return kds_err_set(err, KDS_CORRUPT, "%s: header is not a well-formed msgpack map", what);
    out->header = hdr;
    out->header_len = h;
    out->payload = hdr + h;
    out->payload_len = len - SESS_FRAME_BYTES - h;
    out->version = v;
    return KDS_OK;
}

kds_status sess__check_payload(const sess__frame *f, uint64_t want_bytes, uint64_t want_xxh3,
                               const char *what, kds_err *err) {
    if (f->payload_len != want_bytes)
        return kds_err_set(err, KDS_CORRUPT, "%s: payload is %zu bytes, header says %llu", what,
                           f->payload_len, (unsigned long long)want_bytes);
    if (sess__xxh3(f->payload, f->payload_len) != want_xxh3)
        return kds_err_set(err, KDS_CORRUPT, "%s: payload checksum mismatch (record is damaged)",
                           what);
    return KDS_OK;
}

/* ------------------------------------------------------------------------ */
/* msgpack helpers                                                           */

static void pk_key(msgpack_packer *pk, const char *k) {
    msgpack_pack_str_with_body(pk, k, strlen(k));
}
static void pk_u64(msgpack_packer *pk, const char *k, uint64_t v) {
    pk_key(pk, k);
    msgpack_pack_uint64(pk, v);
}
static void pk_i64(msgpack_packer *pk, const char *k, int64_t v) {
    pk_key(pk, k);
    msgpack_pack_int64(pk, v);
}
static void pk_str(msgpack_packer *pk, const char *k, const char *v) {
    pk_key(pk, k);
    msgpack_pack_str_with_body(pk, v, strlen(v));
}
static void pk_bin(msgpack_packer *pk, const char *k, const void *v, size_t n) {
    pk_key(pk, k);
    msgpack_pack_bin_with_body(pk, v, n);
}

/* Frame + header in one malloc'd buffer (payload not included). */
static kds_status finish(msgpack_sbuffer *sb, const char *magic, uint32_t version,
                         unsigned char **out, size_t *len, kds_err *err) {
    *out = NULL;
    if (!sb->data && sb->size) goto nomem;
    if (sb->size > SESS_HEADER_MAX) {
        msgpack_sbuffer_destroy(sb);
        return kds_err_set(err, KDS_TOO_LARGE, "record header of %zu bytes is too large",
                           sb->size);
    }
    /* a map count that disagrees with the fields packed would only show up
     * when the record is read back: catch it here */
    if (!sess__msgpack_sane((const unsigned char *)sb->data, sb->size)) {
        msgpack_sbuffer_destroy(sb);
        return kds_err_set(err, KDS_INTERNAL, "encoded %.7s header is malformed", magic);
    }
    unsigned char *r = malloc(SESS_FRAME_BYTES + sb->size);
    if (!r) goto nomem;
    memcpy(r + SESS_FRAME_BYTES, sb->data, sb->size);
    sess__frame_write(r, magic, version, sb->size);
    *out = r;
    *len = SESS_FRAME_BYTES + sb->size;
    msgpack_sbuffer_destroy(sb);
    return KDS_OK;
nomem:
    msgpack_sbuffer_destroy(sb);
    return kds_err_set(err, KDS_NOMEM, "out of memory encoding a record header");
}

/* Decoded header: the unpacked root map plus lookups by key. */
typedef struct dec {
    msgpack_unpacked u;
    const msgpack_object_map *map;
    const char *what;
    kds_err *err;
    kds_status rc; /* first failure */
} dec;

static kds_status dec_open(dec *d, const sess__frame *f, const char *what, kds_err *err) {
    memset(d, 0, sizeof *d);
    msgpack_unpacked_init(&d->u);
    d->what = what;
    d->err = err;
    size_t off = 0;
    msgpack_unpack_return r =
        msgpack_unpack_next(&d->u, (const char *)f->header, f->header_len, &off);
    if (r != MSGPACK_UNPACK_SUCCESS || off != f->header_len ||
        d->u.data.type != MSGPACK_OBJECT_MAP) {
        msgpack_unpacked_destroy(&d->u);
        return kds_err_set(err, KDS_CORRUPT, "%s: header does not decode as a msgpack map", what);
    }
    d->map = &d->u.data.via.map;
    return KDS_OK;
}

static void dec_close(dec *d) { msgpack_unpacked_destroy(&d->u); }

static const msgpack_object *dec_find(dec *d, const char *key, bool required) {
    size_t kl = strlen(key);
    for (uint32_t i = 0; i < d->map->size; i++) {
        const msgpack_object *k = &d->map->ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == kl &&
            memcmp(k->via.str.ptr, key, kl) == 0)
            return &d->map->ptr[i].val;
    }
    if (required && d->rc == KDS_OK)
        d->rc = kds_err_set(d->err, KDS_CORRUPT, "%s: header lacks field '%s'", d->what, key);
    return NULL;
}

static void dec_bad(dec *d, const char *key, const char *want) {
    if (d->rc == KDS_OK)
        d->rc = kds_err_set(d->err, KDS_CORRUPT, "%s: header field '%s' is not %s", d->what, key,
                            want);
}

static uint64_t obj_u64(dec *d, const msgpack_object *o, const char *key, uint64_t max) {
    if (o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 <= max) return o->via.u64;
    if (o) dec_bad(d, key, "an unsigned integer in range");
    return 0;
}

static uint64_t get_u64(dec *d, const char *key, uint64_t max) {
    return obj_u64(d, dec_find(d, key, true), key, max);
}

static int64_t get_i64(dec *d, const char *key) {
    const msgpack_object *o = dec_find(d, key, true);
    if (!o) return 0;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 <= INT64_MAX)
        return (int64_t)o->via.u64;
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) return o->via.i64;
    dec_bad(d, key, "an integer");
    return 0;
}

/* Copy a string field into buf (cap includes the NUL). */
static void get_str(dec *d, const char *key, char *buf, size_t cap, bool required) {
    buf[0] = '\0';
    const msgpack_object *o = dec_find(d, key, required);
    if (!o) return;
    if (o->type != MSGPACK_OBJECT_STR || o->via.str.size >= cap ||
        memchr(o->via.str.ptr, 0, o->via.str.size)) {
        dec_bad(d, key, "a short string");
        return;
    }
    memcpy(buf, o->via.str.ptr, o->via.str.size);
    buf[o->via.str.size] = '\0';
}

/* Borrow a bin field (points into the record). */
static const char *get_bin(dec *d, const char *key, size_t *n) {
    *n = 0;
    const msgpack_object *o = dec_find(d, key, true);
    if (!o) return "";
    if (o->type != MSGPACK_OBJECT_BIN) {
        dec_bad(d, key, "binary");
        return "";
    }
    *n = o->via.bin.size;
    return o->via.bin.size ? o->via.bin.ptr : "";
}

static bool is_hex_fp(const char *s) {
    if (strlen(s) != SESS_FP_LEN) return false;
    for (const char *p = s; *p; p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'))) return false;
    return true;
}

/* ------------------------------------------------------------------------ */
/* Layout                                                                    */

void sess__layout_of(const eng_config *c, sess__layout *o) {
    memset(o, 0, sizeof *o);
    o->kda_layers = (uint32_t)c->n_kda_layers;
    o->mla_layers = (uint32_t)c->n_mla_layers;
    o->kda_heads = (uint32_t)c->kda_num_heads;
    o->kda_v_heads = (uint32_t)(c->kda_num_v_heads ? c->kda_num_v_heads : c->kda_num_heads);
    o->key_dim = (uint32_t)c->kda_head_dim;
    o->value_dim = (uint32_t)(c->kda_v_head_dim ? c->kda_v_head_dim : c->kda_head_dim);
    o->conv_width = (uint32_t)c->short_conv_kernel_size;
    o->conv_channels = 2 * o->kda_heads * o->key_dim + o->kda_v_heads * o->value_dim;
    o->mla_row = (uint32_t)(c->kv_lora_rank + c->qk_rope_head_dim);
    if (!o->mla_layers) o->mla_row = 0; /* no MLA cache: the row width means nothing */
    o->vocab = (uint32_t)c->vocab_size;
    eng_state_size z = eng_config_state_size(c);
    o->fixed_bytes = z.fixed;
    o->token_bytes = z.per_token;
}

static const char *const LAYOUT_KEYS[] = {"kda_layers", "mla_layers", "kda_heads",
                                          "kda_v_heads", "key_dim",   "value_dim",
                                          "conv_width", "conv_channels", "mla_row",
                                          "vocab",      "fixed_bytes", "token_bytes"};
enum { N_LAYOUT = 12 };

static void layout_words(const sess__layout *l, uint64_t w[N_LAYOUT]) {
    uint64_t v[N_LAYOUT] = {l->kda_layers, l->mla_layers, l->kda_heads,     l->kda_v_heads,
                            l->key_dim,    l->value_dim,  l->conv_width,    l->conv_channels,
                            l->mla_row,    l->vocab,      l->fixed_bytes,   l->token_bytes};
    memcpy(w, v, sizeof v);
}

const char *sess__layout_diff(const sess__layout *a, const sess__layout *b, uint64_t *va,
                              uint64_t *vb) {
    uint64_t x[N_LAYOUT], y[N_LAYOUT];
    layout_words(a, x);
    layout_words(b, y);
    for (int i = 0; i < N_LAYOUT; i++)
        if (x[i] != y[i]) {
            *va = x[i];
            *vb = y[i];
            return LAYOUT_KEYS[i];
        }
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* Snapshot header                                                           */

void sess__snap_hdr_free(sess__snap_hdr *h) {
    if (!h) return;
    free(h->chunks);
    h->chunks = NULL;
    h->n_chunks = 0;
}

kds_status sess__snap_hdr_encode(const sess__snap_hdr *h, unsigned char **out, size_t *len,
                                 kds_err *err) {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 10);
    pk_str(&pk, "model", h->fingerprint);
    pk_key(&pk, "layout");
    uint64_t w[N_LAYOUT];
    layout_words(&h->layout, w);
    msgpack_pack_map(&pk, N_LAYOUT + 2);
    for (int i = 0; i < N_LAYOUT; i++) pk_u64(&pk, LAYOUT_KEYS[i], w[i]);
    pk_str(&pk, "dtype", "f32"); /* every state section is f32 (docs/formats.md) */
    pk_str(&pk, "state_format", "KDSSTATE/1");
    pk_i64(&pk, "tokens", h->tokens);
    pk_u64(&pk, "parent", h->parent);
    pk_i64(&pk, "created_us", h->created_us);
    pk_u64(&pk, "payload_bytes", h->payload_bytes);
    /* fixed width: the header length must not depend on the checksum, which
     * is computed after the payload was written into the reserved record */
    pk_key(&pk, "payload_xxh3");
    msgpack_pack_fix_uint64(&pk, h->payload_xxh3);
    pk_str(&pk, "origin", h->origin);
    pk_u64(&pk, "new_chunks", h->n_new_chunks);
    pk_key(&pk, "chunks");
    msgpack_pack_array(&pk, h->n_chunks);
    for (size_t i = 0; i < h->n_chunks; i++) {
        msgpack_pack_array(&pk, 3);
        msgpack_pack_uint64(&pk, h->chunks[i].id);
        msgpack_pack_int64(&pk, h->chunks[i].t0);
        msgpack_pack_int64(&pk, h->chunks[i].t1);
    }
    return finish(&sb, SESS_MAGIC_SNAPSHOT, SESS_VERSION_SNAPSHOT, out, len, err);
}

kds_status sess__snap_hdr_decode(const sess__frame *f, const char *what, sess__snap_hdr *h,
                                 kds_err *err) {
    memset(h, 0, sizeof *h);
    dec d;
    kds_status rc = dec_open(&d, f, what, err);
    if (rc != KDS_OK) return rc;
    get_str(&d, "model", h->fingerprint, sizeof h->fingerprint, true);
    if (d.rc == KDS_OK && !is_hex_fp(h->fingerprint)) dec_bad(&d, "model", "a fingerprint");
    const msgpack_object *lo = dec_find(&d, "layout", true);
    if (lo && lo->type == MSGPACK_OBJECT_MAP) {
        dec sub = d;
        sub.map = &lo->via.map;
        uint64_t w[N_LAYOUT];
        for (int i = 0; i < N_LAYOUT; i++)
            w[i] = get_u64(&sub, LAYOUT_KEYS[i], i >= 10 ? UINT64_MAX / 4 : UINT32_MAX);
        char dt[8];
        get_str(&sub, "dtype", dt, sizeof dt, true);
        if (sub.rc == KDS_OK && strcmp(dt, "f32") != 0) dec_bad(&sub, "dtype", "f32");
        d.rc = sub.rc;
        sess__layout *l = &h->layout;
        l->kda_layers = (uint32_t)w[0], l->mla_layers = (uint32_t)w[1];
        l->kda_heads = (uint32_t)w[2], l->kda_v_heads = (uint32_t)w[3];
        l->key_dim = (uint32_t)w[4], l->value_dim = (uint32_t)w[5];
        l->conv_width = (uint32_t)w[6], l->conv_channels = (uint32_t)w[7];
        l->mla_row = (uint32_t)w[8], l->vocab = (uint32_t)w[9];
        l->fixed_bytes = w[10], l->token_bytes = w[11];
    } else if (lo) {
        dec_bad(&d, "layout", "a map");
    }
    h->tokens = get_i64(&d, "tokens");
    h->parent = get_u64(&d, "parent", UINT64_MAX);
    h->created_us = get_i64(&d, "created_us");
    h->payload_bytes = get_u64(&d, "payload_bytes", SIZE_MAX / 2);
    h->payload_xxh3 = get_u64(&d, "payload_xxh3", UINT64_MAX);
    get_str(&d, "origin", h->origin, sizeof h->origin, true);
    h->n_new_chunks = (uint32_t)get_u64(&d, "new_chunks", UINT32_MAX);
    const msgpack_object *ch = dec_find(&d, "chunks", true);
    if (d.rc != KDS_OK) goto out;
    if (h->tokens < 0 || (uint64_t)h->tokens > ((uint64_t)1 << 40)) {
        dec_bad(&d, "tokens", "a token count in range");
        goto out;
    }
    if (ch->type != MSGPACK_OBJECT_ARRAY) {
        dec_bad(&d, "chunks", "an array");
        goto out;
    }
    h->n_chunks = ch->via.array.size;
    if (h->n_new_chunks > h->n_chunks) {
        dec_bad(&d, "new_chunks", "at most the chunk count");
        goto out;
    }
    if (h->n_chunks) {
        h->chunks = calloc(h->n_chunks, sizeof *h->chunks);
        if (!h->chunks) {
            d.rc = kds_err_set(err, KDS_NOMEM, "%s: out of memory reading the chunk list", what);
            goto out;
        }
    }
    /* The chunks must cover [0, tokens) in order with no gap or overlap:
     * that is what the loader fills from them. */
    int64_t at = 0;
    for (size_t i = 0; i < h->n_chunks; i++) {
        const msgpack_object *e = &ch->via.array.ptr[i];
        if (e->type != MSGPACK_OBJECT_ARRAY || e->via.array.size != 3 ||
            e->via.array.ptr[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER ||
            e->via.array.ptr[1].type != MSGPACK_OBJECT_POSITIVE_INTEGER ||
            e->via.array.ptr[2].type != MSGPACK_OBJECT_POSITIVE_INTEGER) {
            dec_bad(&d, "chunks", "a list of [id, t0, t1]");
            goto out;
        }
        sess__chunk_ref *r = &h->chunks[i];
        r->id = e->via.array.ptr[0].via.u64;
        uint64_t t0 = e->via.array.ptr[1].via.u64, t1 = e->via.array.ptr[2].via.u64;
        if (r->id == 0 || t0 != (uint64_t)at || t1 <= t0 || t1 > (uint64_t)h->tokens) {
            d.rc = kds_err_set(err, KDS_CORRUPT,
                               "%s: chunk %zu covers [%llu, %llu), expected to start at %lld "
                               "and end by %lld", what, i, (unsigned long long)t0,
                               (unsigned long long)t1, (long long)at, (long long)h->tokens);
            goto out;
        }
        r->t0 = (int64_t)t0;
        r->t1 = (int64_t)t1;
        at = r->t1;
    }
    if (h->layout.token_bytes ? at != h->tokens : h->n_chunks != 0) {
        d.rc = kds_err_set(err, KDS_CORRUPT, "%s: chunks cover %lld of %lld tokens", what,
                           (long long)at, (long long)h->tokens);
        goto out;
    }
    if (h->payload_bytes != h->layout.fixed_bytes)
        d.rc = kds_err_set(err, KDS_CORRUPT, "%s: payload of %llu bytes, layout says %llu", what,
                           (unsigned long long)h->payload_bytes,
                           (unsigned long long)h->layout.fixed_bytes);
out:
    rc = d.rc;
    dec_close(&d);
    if (rc != KDS_OK) sess__snap_hdr_free(h);
    return rc;
}

kds_status sess__snap_parse(const void *rec, size_t len, uint64_t id, sess__snap_hdr *out,
                            sess__frame *frame, kds_err *err) {
    char what[48];
    snprintf(what, sizeof what, "snapshot @%llu", (unsigned long long)id);
    sess__frame f;
    kds_status rc = sess__frame_parse(rec, len, SESS_MAGIC_SNAPSHOT, SESS_VERSION_SNAPSHOT, what,
                                      &f, err);
    if (rc != KDS_OK) return rc;
    if ((rc = sess__snap_hdr_decode(&f, what, out, err)) != KDS_OK) return rc;
    if (f.payload_len != out->payload_bytes) {
        sess__snap_hdr_free(out);
        return kds_err_set(err, KDS_CORRUPT, "%s: payload is %zu bytes, header says %llu", what,
                           f.payload_len, (unsigned long long)out->payload_bytes);
    }
    if (frame) *frame = f;
    return KDS_OK;
}

/* ------------------------------------------------------------------------ */
/* Chunk header                                                              */

kds_status sess__chunk_hdr_encode(const sess__chunk_hdr *h, unsigned char **out, size_t *len,
                                  kds_err *err) {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 5);
    pk_i64(&pk, "t0", h->t0);
    pk_i64(&pk, "t1", h->t1);
    pk_u64(&pk, "token_bytes", h->token_bytes);
    pk_u64(&pk, "payload_bytes", h->payload_bytes);
    pk_key(&pk, "payload_xxh3");
    msgpack_pack_fix_uint64(&pk, h->payload_xxh3); /* fixed width, as for snapshots */
    return finish(&sb, SESS_MAGIC_CHUNK, SESS_VERSION_CHUNK, out, len, err);
}

kds_status sess__chunk_parse(const void *rec, size_t len, uint64_t id, sess__chunk_hdr *h,
                             sess__frame *frame, kds_err *err) {
    char what[48];
    snprintf(what, sizeof what, "chunk %llu", (unsigned long long)id);
    sess__frame f;
    kds_status rc =
        sess__frame_parse(rec, len, SESS_MAGIC_CHUNK, SESS_VERSION_CHUNK, what, &f, err);
    if (rc != KDS_OK) return rc;
    dec d;
    if ((rc = dec_open(&d, &f, what, err)) != KDS_OK) return rc;
    h->t0 = get_i64(&d, "t0");
    h->t1 = get_i64(&d, "t1");
    h->token_bytes = get_u64(&d, "token_bytes", UINT32_MAX);
    h->payload_bytes = get_u64(&d, "payload_bytes", SIZE_MAX / 2);
    h->payload_xxh3 = get_u64(&d, "payload_xxh3", UINT64_MAX);
    rc = d.rc;
    dec_close(&d);
    if (rc != KDS_OK) return rc;
    if (h->t0 < 0 || h->t1 <= h->t0 || h->token_bytes == 0 ||
        (uint64_t)(h->t1 - h->t0) > h->payload_bytes / h->token_bytes ||
        (uint64_t)(h->t1 - h->t0) * h->token_bytes != h->payload_bytes)
        return kds_err_set(err, KDS_CORRUPT, "%s: rows [%lld, %lld) of %llu bytes do not make "
                           "%llu payload bytes", what, (long long)h->t0, (long long)h->t1,
                           (unsigned long long)h->token_bytes,
                           (unsigned long long)h->payload_bytes);
    if (f.payload_len != h->payload_bytes)
        return kds_err_set(err, KDS_CORRUPT, "%s: payload is %zu bytes, header says %llu", what,
                           f.payload_len, (unsigned long long)h->payload_bytes);
    if (frame) *frame = f;
    return KDS_OK;
}

/* ------------------------------------------------------------------------ */
/* Session record                                                            */

bool sess_sampler_valid(const eng_sampler_params *p) {
    return p->temperature >= 0 && p->temperature <= 100 && p->top_k >= 0 && p->top_p >= 0 &&
           p->top_p <= 1 && p->min_p >= 0 && p->min_p <= 1 && p->repeat_penalty >= 0.01f &&
           p->repeat_penalty <= 100 && p->repeat_last_n >= 0 && p->repeat_last_n <= 64;
}

eng_sampler_params sess_sampler_merge(const eng_sampler_params *recorded,
                                      const eng_sampler_params *own, unsigned given) {
    eng_sampler_params p = *recorded;
    if (given & SESS_SAMPLER_TEMPERATURE) p.temperature = own->temperature;
    if (given & SESS_SAMPLER_TOP_K) p.top_k = own->top_k;
    if (given & SESS_SAMPLER_TOP_P) p.top_p = own->top_p;
    if (given & SESS_SAMPLER_MIN_P) p.min_p = own->min_p;
    if (given & SESS_SAMPLER_REPEAT_PENALTY) p.repeat_penalty = own->repeat_penalty;
    return p;
}

/* A float field of the sampler map (float32 as written, float64 read too). */
static float sampler_f(dec *d, const msgpack_object_map *m, const char *key) {
    for (uint32_t i = 0; i < m->size; i++) {
        const msgpack_object *k = &m->ptr[i].key, *v = &m->ptr[i].val;
        if (k->type != MSGPACK_OBJECT_STR || k->via.str.size != strlen(key) ||
            memcmp(k->via.str.ptr, key, k->via.str.size))
            continue;
        if (v->type == MSGPACK_OBJECT_FLOAT32 || v->type == MSGPACK_OBJECT_FLOAT64)
            return (float)v->via.f64;
        if (v->type == MSGPACK_OBJECT_POSITIVE_INTEGER && v->via.u64 <= (1u << 30))
            return (float)v->via.u64;
        break;
    }
    dec_bad(d, "sampler", "a map of the six sampler settings");
    return 0;
}

/* The optional "sampler" map of a session record: all six settings, in
 * their ranges, or the record is corrupt. */
static void get_sampler(dec *d, sess_session_info *s) {
    const msgpack_object *o = dec_find(d, "sampler", false);
    if (!o) return;
    if (o->type != MSGPACK_OBJECT_MAP) {
        dec_bad(d, "sampler", "a map of the six sampler settings");
        return;
    }
    const msgpack_object_map *m = &o->via.map;
    eng_sampler_params *p = &s->sampler;
    p->temperature = sampler_f(d, m, "temperature");
    p->top_k = (int)sampler_f(d, m, "top_k");
    p->top_p = sampler_f(d, m, "top_p");
    p->min_p = sampler_f(d, m, "min_p");
    p->repeat_penalty = sampler_f(d, m, "repeat_penalty");
    p->repeat_last_n = (int)sampler_f(d, m, "repeat_last_n");
    if (d->rc == KDS_OK && !sess_sampler_valid(p)) {
        dec_bad(d, "sampler", "sampler settings in range");
        return;
    }
    s->has_sampler = d->rc == KDS_OK;
}

kds_status sess__session_encode(const sess_session_info *s, unsigned char **out, size_t *len,
                                kds_err *err) {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    /* "mode" is optional (added without a version bump: readers ignore
     * fields they do not know), so a session that never declared one keeps
     * the record it always had. */
    msgpack_pack_map(&pk, 12 + (s->mode[0] ? 1 : 0) + (s->has_sampler ? 1 : 0));
    pk_str(&pk, "name", s->name);
    pk_u64(&pk, "id", s->id);
    pk_u64(&pk, "head", s->head);
    pk_str(&pk, "parent", s->parent);
    pk_u64(&pk, "fork_point", s->fork_point);
    pk_i64(&pk, "created_us", s->created_us);
    pk_i64(&pk, "updated_us", s->updated_us);
    pk_i64(&pk, "tokens", s->tokens);
    pk_u64(&pk, "turns", s->turns);
    pk_str(&pk, "owner", s->owner);
    pk_str(&pk, "model_dir", s->model_dir);
    pk_str(&pk, "model", s->fingerprint);
    if (s->mode[0]) pk_str(&pk, "mode", s->mode);
    if (s->has_sampler) { /* optional too; floats as float32, exactly what was used */
        const eng_sampler_params *p = &s->sampler;
        pk_key(&pk, "sampler");
        msgpack_pack_map(&pk, 6);
        pk_key(&pk, "temperature");
        msgpack_pack_float(&pk, p->temperature);
        pk_u64(&pk, "top_k", (uint64_t)p->top_k);
        pk_key(&pk, "top_p");
        msgpack_pack_float(&pk, p->top_p);
        pk_key(&pk, "min_p");
        msgpack_pack_float(&pk, p->min_p);
        pk_key(&pk, "repeat_penalty");
        msgpack_pack_float(&pk, p->repeat_penalty);
        pk_u64(&pk, "repeat_last_n", (uint64_t)p->repeat_last_n);
    }
    return finish(&sb, SESS_MAGIC_SESSION, SESS_VERSION_SESSION, out, len, err);
}

kds_status sess__session_parse(const void *rec, size_t len, const char *what,
                               sess_session_info *s, kds_err *err) {
    memset(s, 0, sizeof *s);
    sess__frame f;
    kds_status rc =
        sess__frame_parse(rec, len, SESS_MAGIC_SESSION, SESS_VERSION_SESSION, what, &f, err);
    if (rc != KDS_OK) return rc;
    if (f.payload_len != 0)
        return kds_err_set(err, KDS_CORRUPT, "%s: %zu stray bytes after the header", what,
                           f.payload_len);
    dec d;
    if ((rc = dec_open(&d, &f, what, err)) != KDS_OK) return rc;
    get_str(&d, "name", s->name, sizeof s->name, true);
    s->id = get_u64(&d, "id", UINT64_MAX);
    s->head = get_u64(&d, "head", UINT64_MAX);
    get_str(&d, "parent", s->parent, sizeof s->parent, true);
    s->fork_point = get_u64(&d, "fork_point", UINT64_MAX);
    s->created_us = get_i64(&d, "created_us");
    s->updated_us = get_i64(&d, "updated_us");
    s->tokens = get_i64(&d, "tokens");
    s->turns = (uint32_t)get_u64(&d, "turns", UINT32_MAX);
    get_str(&d, "owner", s->owner, sizeof s->owner, true);
    get_str(&d, "model_dir", s->model_dir, sizeof s->model_dir, true);
    get_str(&d, "model", s->fingerprint, sizeof s->fingerprint, true);
    get_str(&d, "mode", s->mode, sizeof s->mode, false);
    get_sampler(&d, s);
    rc = d.rc;
    dec_close(&d);
    if (rc == KDS_OK && (!sess_name_valid(s->name) || s->head == 0))
        rc = kds_err_set(err, KDS_CORRUPT, "%s: invalid name or head", what);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Transcript turn                                                           */

kds_status sess__turn_encode(const sess__turn_hdr *t, unsigned char **out, size_t *len,
                             kds_err *err) {
    *out = NULL;
    /* A long prompt (a document) goes to the payload, zstd-compressed when
     * that is smaller: version 2. Short turns stay version 1. */
    bool in_payload = t->prompt_len >= SESS_TURN_PAYLOAD_MIN;
    void *z = NULL;
    size_t z_len = 0;
    bool zstd = false;
    if (in_payload) {
        size_t cap = ZSTD_compressBound(t->prompt_len);
        if (!(z = malloc(cap))) return kds_err_set(err, KDS_NOMEM, "out of memory compressing a turn");
        size_t r = ZSTD_compress(z, cap, t->prompt, t->prompt_len, 3);
        if (!ZSTD_isError(r) && r < t->prompt_len) {
            z_len = r;
            zstd = true;
        } else { /* incompressible: the bytes as they are */
            memcpy(z, t->prompt, t->prompt_len);
            z_len = t->prompt_len;
        }
    }
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    bool doc = t->doc_name && t->doc_name[0];
    /* "doc" and "doc_bytes" are optional (an ingested document; added
     * without a version bump: readers ignore unknown keys) */
    msgpack_pack_map(&pk, (doc ? 9 : 7) + (in_payload ? 3 : 0));
    /* bin, not str: a byte-level model's text need not be valid UTF-8 */
    if (in_payload) {
        pk_u64(&pk, "prompt_bytes", t->prompt_len);
        pk_str(&pk, "prompt_codec", zstd ? "zstd" : "none");
        pk_u64(&pk, "payload_bytes", z_len);
        pk_key(&pk, "payload_xxh3");
        msgpack_pack_uint64(&pk, sess__xxh3(z, z_len));
    } else {
        pk_bin(&pk, "prompt", t->prompt, t->prompt_len);
    }
    pk_bin(&pk, "output", t->output, t->output_len);
    pk_i64(&pk, "prompt_tokens", t->prompt_tokens);
    pk_i64(&pk, "output_tokens", t->output_tokens);
    pk_i64(&pk, "tokens", t->tokens);
    pk_u64(&pk, "snapshot", t->snapshot);
    pk_i64(&pk, "time_us", t->time_us);
    if (doc) {
        pk_str(&pk, "doc", t->doc_name);
        pk_i64(&pk, "doc_bytes", t->doc_bytes);
    }
    kds_status rc = finish(&sb, SESS_MAGIC_TURN,
                           in_payload ? SESS_VERSION_TURN : SESS_VERSION_TURN_INLINE, out, len, err);
    if (rc == KDS_OK && in_payload) {
        unsigned char *r = realloc(*out, *len + z_len);
        if (!r) {
            free(*out);
            *out = NULL;
            rc = kds_err_set(err, KDS_NOMEM, "out of memory encoding a turn");
        } else {
            memcpy(r + *len, z, z_len);
            *out = r;
            *len += z_len;
        }
    }
    free(z);
    return rc;
}

kds_status sess__turn_parse(const void *rec, size_t len, const char *what, sess__turn_hdr *t,
                            kds_err *err) {
    memset(t, 0, sizeof *t);
    sess__frame f;
    /* both versions are read: 1 (the prompt in the header), 2 (a long one
     * in the payload) */
    uint32_t v = len >= 12 ? kds_get32((const unsigned char *)rec + 8) : 0;
    if (v != SESS_VERSION_TURN_INLINE) v = SESS_VERSION_TURN;
    kds_status rc = sess__frame_parse(rec, len, SESS_MAGIC_TURN, v, what, &f, err);
    if (rc != KDS_OK) return rc;
    if (v == SESS_VERSION_TURN_INLINE && f.payload_len != 0)
        return kds_err_set(err, KDS_CORRUPT, "%s: %zu stray bytes after the header", what,
                           f.payload_len);
    dec d;
    if ((rc = dec_open(&d, &f, what, err)) != KDS_OK) return rc;
    /* the texts point into the record (the header bytes), not the zone */
    if (v == SESS_VERSION_TURN_INLINE) {
        t->prompt = get_bin(&d, "prompt", &t->prompt_len);
    } else {
        t->prompt_len = (size_t)get_u64(&d, "prompt_bytes", SIZE_MAX / 2);
        char codec[8];
        get_str(&d, "prompt_codec", codec, sizeof codec, true);
        uint64_t pb = get_u64(&d, "payload_bytes", UINT64_MAX);
        uint64_t px = get_u64(&d, "payload_xxh3", UINT64_MAX);
        if (d.rc == KDS_OK && strcmp(codec, "zstd") && strcmp(codec, "none"))
            d.rc = kds_err_set(err, KDS_UNSUPPORTED, "%s: prompt codec '%s' (this build reads "
                               "zstd and none)", what, codec);
        if (d.rc == KDS_OK) d.rc = sess__check_payload(&f, pb, px, what, err);
        if (d.rc == KDS_OK && !strcmp(codec, "none") && pb != t->prompt_len)
            d.rc = kds_err_set(err, KDS_CORRUPT, "%s: a prompt of %zu bytes in a payload of %llu",
                               what, t->prompt_len, (unsigned long long)pb);
        t->prompt_z = f.payload;
        t->prompt_z_len = f.payload_len;
        t->prompt_zstd = !strcmp(codec, "zstd");
    }
    t->output = get_bin(&d, "output", &t->output_len);
    t->prompt_tokens = get_i64(&d, "prompt_tokens");
    t->output_tokens = get_i64(&d, "output_tokens");
    t->tokens = get_i64(&d, "tokens");
    t->snapshot = get_u64(&d, "snapshot", UINT64_MAX);
    t->time_us = get_i64(&d, "time_us");
    get_str(&d, "doc", t->doc, sizeof t->doc, false);
    if (t->doc[0]) t->doc_bytes = get_i64(&d, "doc_bytes");
    rc = d.rc;
    dec_close(&d);
    return rc;
}

kds_status sess__turn_prompt(const sess__turn_hdr *t, const char *what, char **out, kds_err *err) {
    *out = NULL;
    if (!t->prompt_z && t->prompt_len > 0 && !t->prompt)
        return kds_err_set(err, KDS_INTERNAL, "%s: no prompt", what);
    if (t->prompt_zstd) {
        /* the frame says its size: it must be the header's, before any
         * memory is reserved for it */
        unsigned long long fs = ZSTD_getFrameContentSize(t->prompt_z, t->prompt_z_len);
        if (fs != (unsigned long long)t->prompt_len)
            return kds_err_set(err, KDS_CORRUPT, "%s: the compressed prompt is not the header's "
                               "%zu bytes (record damaged)", what, t->prompt_len);
    }
    char *p = malloc(t->prompt_len + 1);
    if (!p) return kds_err_set(err, KDS_NOMEM, "out of memory reading a turn's %zu-byte prompt",
                               t->prompt_len);
    if (t->prompt_zstd) {
        size_t r = ZSTD_decompress(p, t->prompt_len, t->prompt_z, t->prompt_z_len);
        if (ZSTD_isError(r) || r != t->prompt_len) {
            free(p);
            return kds_err_set(err, KDS_CORRUPT, "%s: the compressed prompt does not decompress "
                               "(record damaged): %s", what,
                               ZSTD_isError(r) ? ZSTD_getErrorName(r) : "short");
        }
    } else if (t->prompt_len) {
        memcpy(p, t->prompt_z ? (const char *)t->prompt_z : t->prompt, t->prompt_len);
    }
    p[t->prompt_len] = '\0';
    *out = p;
    return KDS_OK;
}

/* ------------------------------------------------------------------------ */
/* Writer                                                                    */

kds_status sess__writer_encode(const sess_writer *w, uint64_t start, unsigned char **out,
                               size_t *len, kds_err *err) {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 5);
    pk_i64(&pk, "pid", w->pid);
    pk_str(&pk, "host", w->host);
    pk_str(&pk, "program", w->program);
    pk_i64(&pk, "since_us", w->since_us);
    pk_u64(&pk, "start", start);
    return finish(&sb, SESS_MAGIC_WRITER, SESS_VERSION_WRITER, out, len, err);
}

kds_status sess__writer_parse(const void *rec, size_t len, const char *what, sess_writer *w,
                              uint64_t *start, kds_err *err) {
    memset(w, 0, sizeof *w);
    sess__frame f;
    kds_status rc =
        sess__frame_parse(rec, len, SESS_MAGIC_WRITER, SESS_VERSION_WRITER, what, &f, err);
    if (rc != KDS_OK) return rc;
    dec d;
    if ((rc = dec_open(&d, &f, what, err)) != KDS_OK) return rc;
    w->pid = get_i64(&d, "pid");
    get_str(&d, "host", w->host, sizeof w->host, true);
    get_str(&d, "program", w->program, sizeof w->program, true);
    w->since_us = get_i64(&d, "since_us");
    *start = get_u64(&d, "start", UINT64_MAX);
    rc = d.rc;
    dec_close(&d);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Retention                                                                 */

kds_status sess__retention_encode(const sess_retention *r, unsigned char **out, size_t *len,
                                  kds_err *err) {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 3);
    pk_u64(&pk, "keep_last", r->keep_last);
    pk_u64(&pk, "keep_every", r->keep_every);
    pk_u64(&pk, "keep_days", r->keep_days);
    return finish(&sb, SESS_MAGIC_RETENTION, SESS_VERSION_RETENTION, out, len, err);
}

kds_status sess__retention_parse(const void *rec, size_t len, const char *what,
                                 sess_retention *r, kds_err *err) {
    memset(r, 0, sizeof *r);
    sess__frame f;
    kds_status rc = sess__frame_parse(rec, len, SESS_MAGIC_RETENTION, SESS_VERSION_RETENTION,
                                      what, &f, err);
    if (rc != KDS_OK) return rc;
    dec d;
    if ((rc = dec_open(&d, &f, what, err)) != KDS_OK) return rc;
    r->keep_last = (uint32_t)get_u64(&d, "keep_last", UINT32_MAX);
    r->keep_every = (uint32_t)get_u64(&d, "keep_every", UINT32_MAX);
    r->keep_days = (uint32_t)get_u64(&d, "keep_days", UINT32_MAX);
    rc = d.rc;
    dec_close(&d);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Export file header                                                        */

static const char *const XREC_NAMES[] = {"session", "turn", "snapshot", "chunk"};

kds_status sess__export_hdr_encode(const sess__export_hdr *h, unsigned char **out, size_t *len,
                                   kds_err *err) {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 4);
    pk_str(&pk, "kind", h->kind);
    pk_str(&pk, "source", h->source);
    pk_i64(&pk, "created_us", h->created_us);
    pk_key(&pk, "records");
    msgpack_pack_array(&pk, h->n);
    for (size_t i = 0; i < h->n; i++) {
        msgpack_pack_array(&pk, 2);
        const char *t = XREC_NAMES[h->recs[i].type];
        msgpack_pack_str_with_body(&pk, t, strlen(t));
        msgpack_pack_uint64(&pk, h->recs[i].len);
    }
    return finish(&sb, SESS_MAGIC_EXPORT, SESS_VERSION_EXPORT, out, len, err);
}

kds_status sess__export_hdr_decode(const sess__frame *f, const char *what, sess__export_hdr *h,
                                   kds_err *err) {
    memset(h, 0, sizeof *h);
    dec d;
    kds_status rc = dec_open(&d, f, what, err);
    if (rc != KDS_OK) return rc;
    get_str(&d, "kind", h->kind, sizeof h->kind, true);
    get_str(&d, "source", h->source, sizeof h->source, true);
    h->created_us = get_i64(&d, "created_us");
    const msgpack_object *r = dec_find(&d, "records", true);
    if (d.rc != KDS_OK) goto out;
    if (strcmp(h->kind, "session") != 0 && strcmp(h->kind, "snapshot") != 0) {
        dec_bad(&d, "kind", "'session' or 'snapshot'");
        goto out;
    }
    if (r->type != MSGPACK_OBJECT_ARRAY || r->via.array.size == 0) {
        dec_bad(&d, "records", "a non-empty list");
        goto out;
    }
    h->n = r->via.array.size;
    if (!(h->recs = calloc(h->n, sizeof *h->recs))) {
        d.rc = kds_err_set(err, KDS_NOMEM, "%s: out of memory", what);
        goto out;
    }
    for (size_t i = 0; i < h->n; i++) {
        const msgpack_object *e = &r->via.array.ptr[i];
        int type = -1;
        if (e->type == MSGPACK_OBJECT_ARRAY && e->via.array.size == 2 &&
            e->via.array.ptr[0].type == MSGPACK_OBJECT_STR &&
            e->via.array.ptr[1].type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
            const msgpack_object_str *s = &e->via.array.ptr[0].via.str;
            for (int t = 0; t < 4; t++)
                if (s->size == strlen(XREC_NAMES[t]) && !memcmp(s->ptr, XREC_NAMES[t], s->size))
                    type = t;
        }
        if (type < 0) {
            dec_bad(&d, "records", "a list of [type, length]");
            goto out;
        }
        h->recs[i].type = type;
        h->recs[i].len = e->via.array.ptr[1].via.u64;
    }
out:
    rc = d.rc;
    dec_close(&d);
    if (rc != KDS_OK) {
        free(h->recs);
        h->recs = NULL;
        h->n = 0;
    }
    return rc;
}
