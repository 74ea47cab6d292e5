/*
 * sess_prefix.c - the prefix index: which stored snapshot holds the state
 * after a given token sequence (sess.h, "Prefix index").
 *
 * Database "prefixes": key = XXH3-128 of (scope, NUL, the token ids as
 * 32-bit little-endian integers), 16 bytes; value = snapshot id (u64 LE),
 * token count (i64 LE), session name length (u8), session name, and for a
 * `fork` entry one flags byte (1) after it (a value without it is a plain
 * entry: the form of every entry before the flag existed). One key per
 * indexed turn end, so the index grows by one small record per turn and a
 * lookup is one B-tree search per candidate length, all in one read
 * transaction. A 128-bit hash makes a false match (two different sequences
 * with one key) improbable beyond any store's size (about 2^-64 at 2^32
 * keys); the token count in the value is checked too.
 */
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "kds_le.h"
#include "sess_internal.h"

struct sess_prefix_hasher {
    XXH3_state_t *st;
    int64_t count;
};

kds_status sess_prefix_hasher_create(const char *scope, sess_prefix_hasher **out, kds_err *err) {
    *out = NULL;
    sess_prefix_hasher *h = calloc(1, sizeof *h);
    if (!h || !(h->st = XXH3_createState())) {
        free(h);
        return kds_err_set(err, KDS_NOMEM, "out of memory");
    }
    XXH3_128bits_reset(h->st);
    const char *sc = scope ? scope : "";
    XXH3_128bits_update(h->st, sc, strlen(sc) + 1); /* the NUL ends the scope */
    *out = h;
    return KDS_OK;
}

void sess_prefix_hasher_free(sess_prefix_hasher *h) {
    if (!h) return;
    XXH3_freeState(h->st);
    free(h);
}

void sess_prefix_hasher_add(sess_prefix_hasher *h, const int32_t *ids, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        unsigned char b[4];
        kds_put32(b, (uint32_t)ids[i]);
        XXH3_128bits_update(h->st, b, 4);
    }
    h->count += n;
}

int64_t sess_prefix_hasher_count(const sess_prefix_hasher *h) {
    return h->count;
}

void sess_prefix_hasher_key(const sess_prefix_hasher *h, unsigned char key[SESS_PREFIX_KEY_LEN]) {
    XXH128_hash_t d = XXH3_128bits_digest(h->st); /* leaves the state as it was */
    kds_put64(key, d.high64);
    kds_put64(key + 8, d.low64);
}

typedef struct put_ctx {
    const unsigned char *key;
    const sess_prefix_entry *e;
} put_ctx;

static kds_status put_fn(sess__wtxn *w, void *ctx, kds_err *err) {
    put_ctx *c = ctx;
    sess_store *st = w->st;
    if (!atomic_load(&st->has_prefix)) {
        int m = mdb_dbi_open(w->txn, "prefixes", MDB_CREATE, &st->db_prefix);
        if (m) return sess__mdb_err(m, "creating the prefix index", err);
    }
    unsigned char v[18 + SESS_NAME_MAX];
    size_t nl = strlen(c->e->session);
    kds_put64(v, c->e->snapshot);
    kds_put64(v + 8, (uint64_t)c->e->tokens);
    v[16] = (unsigned char)nl;
    memcpy(v + 17, c->e->session, nl);
    if (c->e->fork) {
        v[17 + nl] = 1;
        /* a stateful session's turn never displaces an entry already there */
        const void *old;
        size_t on;
        kds_status g = sess__get(w->txn, st->db_prefix, c->key, SESS_PREFIX_KEY_LEN, &old, &on, err);
        if (g == KDS_OK) return KDS_OK;
        if (g != KDS_NOT_FOUND) return g;
        kds_err_clear(err);
    }
    return sess__put(w, st->db_prefix, c->key, SESS_PREFIX_KEY_LEN, v, 17 + nl + (c->e->fork ? 1 : 0),
                     0, err);
}

kds_status sess_prefix_put(sess_store *st, const unsigned char key[SESS_PREFIX_KEY_LEN],
                           const sess_prefix_entry *e, kds_err *err) {
    if (!e->snapshot || e->tokens <= 0 || !sess_name_valid(e->session))
        return kds_err_set(err, KDS_INVALID_ARG, "prefix entry: bad snapshot, count or session");
    if (st->read_only) return kds_err_set(err, KDS_UNSUPPORTED, "the store is open read-only");
    put_ctx c = {key, e};
    kds_status rc = sess__write(st, put_fn, &c, err);
    if (rc == KDS_OK) atomic_store(&st->has_prefix, true);
    return rc;
}

typedef struct find_ctx {
    const unsigned char (*keys)[SESS_PREFIX_KEY_LEN];
    const int64_t *lens;
    size_t n;
    size_t found;
    sess_prefix_entry out;
} find_ctx;

bool sess__prefix_parse(const void *p, size_t n, sess_prefix_entry *e) {
    const unsigned char *v = p;
    if (n < 17 || v[16] > SESS_NAME_MAX || (n != 17u + v[16] && n != 18u + v[16])) return false;
    e->snapshot = kds_get64(v);
    e->tokens = (int64_t)kds_get64(v + 8);
    memcpy(e->session, v + 17, v[16]);
    e->session[v[16]] = '\0';
    e->fork = n == 18u + v[16];
    if (e->fork && v[17 + v[16]] != 1) return false;
    return e->snapshot != 0 && sess_name_valid(e->session);
}

static kds_status find_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    find_ctx *c = ctx;
    for (size_t i = c->n; i-- > 0;) {
        const void *v;
        size_t vn;
        kds_status rc =
            sess__get(txn, st->db_prefix, c->keys[i], SESS_PREFIX_KEY_LEN, &v, &vn, err);
        if (rc == KDS_NOT_FOUND) continue;
        if (rc != KDS_OK) return rc;
        sess_prefix_entry e;
        /* a damaged record, or one whose count disagrees, is no match */
        if (!sess__prefix_parse(v, vn, &e) || e.tokens != c->lens[i]) continue;
        c->found = i;
        c->out = e;
        return KDS_OK;
    }
    return KDS_NOT_FOUND;
}

kds_status sess_prefix_find(sess_store *st, const unsigned char (*keys)[SESS_PREFIX_KEY_LEN],
                            const int64_t *lens, size_t n, size_t *found, sess_prefix_entry *out,
                            kds_err *err) {
    if (!atomic_load(&st->has_prefix) || n == 0) return KDS_NOT_FOUND;
    find_ctx c = {.keys = keys, .lens = lens, .n = n};
    kds_status rc = sess__read(st, find_fn, &c, err);
    if (rc == KDS_OK) {
        *found = c.found;
        *out = c.out;
    }
    return rc;
}
