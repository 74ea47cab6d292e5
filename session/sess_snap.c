/*
 * sess_snap.c - snapshots and sessions: save (snapshot + new MLA chunks +
 * head move + transcript entry in one transaction), load and verify (every
 * checksum before a byte reaches the sequence), fork, delete, list, gc.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "eng_config.h"
#include "sess_internal.h"

static void snap_what(char *buf, size_t cap, uint64_t id) {
    snprintf(buf, cap, "snapshot @%llu", (unsigned long long)id);
}

kds_status sess__get_snap(sess_store *st, MDB_txn *txn, uint64_t id, const void **rec,
                           size_t *len, kds_err *err) {
    unsigned char k[8];
    sess__key64(k, id);
    kds_status rc = sess__get(txn, st->db_snap, k, 8, rec, len, err);
    if (rc == KDS_NOT_FOUND)
        return kds_err_set(err, KDS_NOT_FOUND, "no snapshot @%llu in %s", (unsigned long long)id,
                           st->dir);
    return rc;
}

kds_status sess__get_session(sess_store *st, MDB_txn *txn, const char *name,
                              sess_session_info *out, kds_err *err) {
    const void *v;
    size_t n;
    kds_status rc = sess__get(txn, st->db_sess, name, strlen(name), &v, &n, err);
    if (rc == KDS_NOT_FOUND)
        return kds_err_set(err, KDS_NOT_FOUND, "no session '%s' in %s", name, st->dir);
    if (rc != KDS_OK) return rc;
    char what[96];
    snprintf(what, sizeof what, "session '%s'", name);
    return sess__session_parse(v, n, what, out, err);
}

static void info_from_hdr(uint64_t id, const sess__snap_hdr *h, size_t rec_len,
                          sess_snapshot_info *o) {
    memset(o, 0, sizeof *o);
    o->id = id;
    o->parent = h->parent;
    o->tokens = h->tokens;
    o->created_us = h->created_us;
    o->format_version = SESS_VERSION_SNAPSHOT;
    memcpy(o->fingerprint, h->fingerprint, sizeof o->fingerprint);
    memcpy(o->origin, h->origin, sizeof o->origin);
    o->record_bytes = rec_len;
    o->fixed_bytes = h->layout.fixed_bytes;
    o->token_bytes = h->layout.token_bytes;
    o->n_chunks = (uint32_t)h->n_chunks;
    o->n_new_chunks = h->n_new_chunks;
    for (size_t i = h->n_chunks - h->n_new_chunks; i < h->n_chunks; i++)
        o->new_chunk_bytes += (size_t)(h->chunks[i].t1 - h->chunks[i].t0) * h->layout.token_bytes;
}

/* The session that wrote snapshot h (its origin), while it still records
 * h's model: its model directory, mode and sampler settings are then the
 * snapshot's. False when that session is gone, renamed or since saved by
 * another model (or st / txn is NULL). */
static bool origin_session(sess_store *st, MDB_txn *txn, const sess__snap_hdr *h,
                           sess_session_info *se) {
    kds_err ignored = {0};
    return st && txn && h->origin[0] &&
           sess__get_session(st, txn, h->origin, se, &ignored) == KDS_OK &&
           strcmp(se->fingerprint, h->fingerprint) == 0;
}

/* What a fork takes over from the session it comes from: the model
 * directory, mode and sampler settings. */
static void inherit(sess_session_info *ne, const sess_session_info *src) {
    snprintf(ne->model_dir, sizeof ne->model_dir, "%s", src->model_dir);
    snprintf(ne->mode, sizeof ne->mode, "%s", src->mode);
    ne->has_sampler = src->has_sampler;
    ne->sampler = src->sampler;
}

/* The refusal of another model's state names both models and what to do:
 * the directory the store recorded for the session's model when it has
 * one, else its fingerprint (which `kdaserve info` prints for a model). */
static kds_status another_model(kds_err *err, const char *what, const char *their_fp,
                                const char *their_dir, const eng_model *m) {
    if (their_dir && their_dir[0])
        return kds_err_set(err, KDS_MISMATCH,
                           "%s was made by another model, %s (fingerprint %s), not by %s "
                           "(fingerprint %s): open it with --model %s, or keep this model's "
                           "sessions in another store (--db)", what, their_dir, their_fp,
                           eng_model_dir(m), eng_model_fingerprint(m), their_dir);
    return kds_err_set(err, KDS_MISMATCH,
                       "%s was made by another model (fingerprint %s; its directory is not "
                       "recorded), not by %s (fingerprint %s): open it with the model whose "
                       "`kdaserve info` prints that fingerprint, or keep this model's sessions in "
                       "another store (--db)", what, their_fp, eng_model_dir(m),
                       eng_model_fingerprint(m));
}

/* The snapshot belongs to model m: same fingerprint (the weights) and same
 * layout (the state's shape). Both are named in the refusal; st and txn (may
 * be NULL) let it name the directory of the model that made it. */
static kds_status check_model(sess_store *st, MDB_txn *txn, const sess__snap_hdr *h,
                              const eng_model *m, const char *what, kds_err *err) {
    const char *fp = eng_model_fingerprint(m);
    if (strcmp(h->fingerprint, fp) != 0) {
        sess_session_info se;
        return another_model(err, what, h->fingerprint,
                             origin_session(st, txn, h, &se) ? se.model_dir : "", m);
    }
    sess__layout l;
    sess__layout_of(eng_model_config(m), &l);
    uint64_t a, b;
    const char *f = sess__layout_diff(&h->layout, &l, &a, &b);
    if (f)
        return kds_err_set(err, KDS_MISMATCH, "%s has state layout %s = %llu, the model has %llu",
                           what, f, (unsigned long long)a, (unsigned long long)b);
    return KDS_OK;
}

/* The payload is the engine's fixed state (docs/formats.md): its own magic,
 * version and position must agree with the header. */
kds_status sess__check_state_bytes(const sess__frame *f, const sess__snap_hdr *h,
                                   const char *what, kds_err *err) {
    const unsigned char *p = f->payload;
    if (f->payload_len < 24 || memcmp(p, "KDSSTATE", 8) != 0)
        return kds_err_set(err, KDS_CORRUPT, "%s: payload is not a KDSSTATE sequence state", what);
    uint32_t v = (uint32_t)p[8] | (uint32_t)p[9] << 8 | (uint32_t)p[10] << 16 |
                 (uint32_t)p[11] << 24;
    if (v != 1)
        return kds_err_set(err, KDS_UNSUPPORTED, "%s: sequence state version %u is unknown", what,
                           v);
    uint64_t pos = 0;
    for (int i = 7; i >= 0; i--) pos = (pos << 8) | p[16 + i];
    if (pos != (uint64_t)h->tokens)
        return kds_err_set(err, KDS_CORRUPT, "%s: state position %llu, header says %lld tokens",
                           what, (unsigned long long)pos, (long long)h->tokens);
    return KDS_OK;
}

/* Check every chunk the header references (presence, frame, range, row
 * width, payload checksum); collect their payloads when `payloads`. */
static kds_status check_chunks(sess_store *st, MDB_txn *txn, const sess__snap_hdr *h,
                               const char *what, const unsigned char **payloads, kds_err *err) {
    for (size_t i = 0; i < h->n_chunks; i++) {
        const sess__chunk_ref *r = &h->chunks[i];
        unsigned char k[8];
        sess__key64(k, r->id);
        const void *rec;
        size_t len;
        kds_status rc = sess__get(txn, st->db_chunk, k, 8, &rec, &len, err);
        if (rc == KDS_NOT_FOUND)
            return kds_err_set(err, KDS_CORRUPT, "%s: its chunk %llu (tokens [%lld, %lld)) is "
                               "missing", what, (unsigned long long)r->id, (long long)r->t0,
                               (long long)r->t1);
        if (rc != KDS_OK) return rc;
        sess__chunk_hdr c;
        sess__frame f;
        if ((rc = sess__chunk_parse(rec, len, r->id, &c, &f, err)) != KDS_OK) {
            kds_err_prefix(err, "%s", what);
            return rc;
        }
        if (c.t0 != r->t0 || c.t1 != r->t1 || c.token_bytes != h->layout.token_bytes)
            return kds_err_set(err, KDS_CORRUPT, "%s: chunk %llu holds tokens [%lld, %lld) of "
                               "%llu bytes, expected [%lld, %lld) of %llu", what,
                               (unsigned long long)r->id, (long long)c.t0, (long long)c.t1,
                               (unsigned long long)c.token_bytes, (long long)r->t0,
                               (long long)r->t1, (unsigned long long)h->layout.token_bytes);
        char cw[48];
        snprintf(cw, sizeof cw, "chunk %llu", (unsigned long long)r->id);
        if ((rc = sess__check_payload(&f, c.payload_bytes, c.payload_xxh3, cw, err)) != KDS_OK) {
            kds_err_prefix(err, "%s", what);
            return rc;
        }
        if (payloads) payloads[i] = f.payload;
    }
    return KDS_OK;
}

/* ------------------------------------------------------------------------ */
/* Resolve, get, list                                                        */

typedef struct resolve_ctx {
    const char *text;
    sess_ref *out;
} resolve_ctx;

static kds_status resolve_in(sess_store *st, MDB_txn *txn, const char *text, sess_ref *out,
                             kds_err *err) {
    memset(out, 0, sizeof *out);
    uint64_t id;
    const void *v;
    size_t n;
    if (text[0] != '@' && sess_name_valid(text)) {
        kds_status rc = sess__get(txn, st->db_sess, text, strlen(text), &v, &n, err);
        if (rc == KDS_OK) {
            sess_session_info s;
            char what[96];
            snprintf(what, sizeof what, "session '%s'", text);
            if ((rc = sess__session_parse(v, n, what, &s, err)) != KDS_OK) return rc;
            out->is_session = true;
            snprintf(out->name, sizeof out->name, "%s", s.name);
            out->snapshot = s.head;
            return KDS_OK;
        }
        if (rc != KDS_NOT_FOUND) return rc;
    }
    if (sess_parse_snapshot_id(text, &id)) {
        kds_status rc = sess__get_snap(st, txn, id, &v, &n, err);
        if (rc == KDS_NOT_FOUND && text[0] != '@')
            return kds_err_set(err, KDS_NOT_FOUND, "no session or snapshot '%s' in %s", text,
                               st->dir);
        if (rc != KDS_OK) return rc;
        out->snapshot = id;
        return KDS_OK;
    }
    return kds_err_set(err, KDS_NOT_FOUND, "no session or snapshot '%s' in %s", text, st->dir);
}

static kds_status resolve_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    resolve_ctx *r = ctx;
    return resolve_in(st, txn, r->text, r->out, err);
}

kds_status sess_resolve(sess_store *st, const char *text, sess_ref *out, kds_err *err) {
    if (!text || !*text) return kds_err_set(err, KDS_INVALID_ARG, "empty session or snapshot id");
    resolve_ctx r = {text, out};
    return sess__read(st, resolve_fn, &r, err);
}

typedef struct snap_get_ctx {
    uint64_t id;
    sess_snapshot_info *out;
} snap_get_ctx;

static kds_status snap_get_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    snap_get_ctx *g = ctx;
    const void *rec;
    size_t len;
    kds_status rc = sess__get_snap(st, txn, g->id, &rec, &len, err);
    if (rc != KDS_OK) return rc;
    sess__snap_hdr h;
    if ((rc = sess__snap_parse(rec, len, g->id, &h, NULL, err)) != KDS_OK) return rc;
    info_from_hdr(g->id, &h, len, g->out);
    sess__snap_hdr_free(&h);
    return KDS_OK;
}

kds_status sess_snapshot_get(sess_store *st, uint64_t id, sess_snapshot_info *out, kds_err *err) {
    snap_get_ctx g = {id, out};
    return sess__read(st, snap_get_fn, &g, err);
}

typedef struct list_ctx {
    void *items;
    size_t n, cap, size;
} list_ctx;

static void *list_push(list_ctx *l) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        void *p = realloc(l->items, cap * l->size);
        if (!p) return NULL;
        l->items = p;
        l->cap = cap;
    }
    return (char *)l->items + l->size * l->n++;
}

static kds_status snap_list_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    list_ctx *l = ctx;
    MDB_cursor *c;
    int m = mdb_cursor_open(txn, st->db_snap, &c);
    if (m) return sess__mdb_err(m, "listing snapshots", err);
    MDB_val k, v;
    kds_status rc = KDS_OK;
    for (m = mdb_cursor_get(c, &k, &v, MDB_FIRST); m == 0;
         m = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
        if (k.mv_size != 8) continue;
        uint64_t id = sess__key64_get(k.mv_data);
        sess_snapshot_info *o = list_push(l);
        if (!o) {
            rc = kds_err_set(err, KDS_NOMEM, "out of memory listing snapshots");
            break;
        }
        sess__snap_hdr h;
        if (sess__snap_parse(v.mv_data, v.mv_size, id, &h, NULL, NULL) == KDS_OK) {
            info_from_hdr(id, &h, v.mv_size, o);
            sess__snap_hdr_free(&h);
        } else { /* listed, flagged unreadable; sess_verify says why */
            memset(o, 0, sizeof *o);
            o->id = id;
            o->tokens = -1;
            o->record_bytes = v.mv_size;
        }
    }
    mdb_cursor_close(c);
    if (rc == KDS_OK && m != MDB_NOTFOUND) rc = sess__mdb_err(m, "listing snapshots", err);
    return rc;
}

kds_status sess_snapshot_list(sess_store *st, sess_snapshot_info **out, size_t *n, kds_err *err) {
    list_ctx l = {.size = sizeof(sess_snapshot_info)};
    kds_status rc = sess__read(st, snap_list_fn, &l, err);
    if (rc != KDS_OK) {
        free(l.items);
        l.items = NULL;
        l.n = 0;
    }
    *out = l.items;
    *n = l.n;
    return rc;
}

typedef struct sess_get_ctx {
    const char *name;
    sess_session_info *out;
} sess_get_ctx;

static kds_status sess_get_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    sess_get_ctx *g = ctx;
    return sess__get_session(st, txn, g->name, g->out, err);
}

kds_status sess_session_get(sess_store *st, const char *name, sess_session_info *out,
                            kds_err *err) {
    if (!sess_name_valid(name))
        return kds_err_set(err, KDS_INVALID_ARG, "invalid session name '%s' (1-%d of A-Z a-z "
                           "0-9 . _ -, starting with a letter or digit)", name ? name : "",
                           SESS_NAME_MAX);
    sess_get_ctx g = {name, out};
    return sess__read(st, sess_get_fn, &g, err);
}

static kds_status sess_list_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    list_ctx *l = ctx;
    MDB_cursor *c;
    int m = mdb_cursor_open(txn, st->db_sess, &c);
    if (m) return sess__mdb_err(m, "listing sessions", err);
    MDB_val k, v;
    kds_status rc = KDS_OK;
    for (m = mdb_cursor_get(c, &k, &v, MDB_FIRST); m == 0;
         m = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
        sess_session_info *o = list_push(l);
        if (!o) {
            rc = kds_err_set(err, KDS_NOMEM, "out of memory listing sessions");
            break;
        }
        char what[96];
        int kn = (int)(k.mv_size > SESS_NAME_MAX ? SESS_NAME_MAX : k.mv_size);
        snprintf(what, sizeof what, "session '%.*s'", kn, (const char *)k.mv_data);
        if (sess__session_parse(v.mv_data, v.mv_size, what, o, NULL) != KDS_OK) {
            /* listed, flagged unreadable (head 0, tokens -1), so that one
             * damaged record neither hides the others nor lets gc free the
             * snapshot it pointed at */
            memset(o, 0, sizeof *o);
            snprintf(o->name, sizeof o->name, "%.*s", kn, (const char *)k.mv_data);
            o->tokens = -1;
        }
    }
    mdb_cursor_close(c);
    if (rc == KDS_OK && m != MDB_NOTFOUND) rc = sess__mdb_err(m, "listing sessions", err);
    return rc;
}

kds_status sess__list_sessions(sess_store *st, MDB_txn *txn, sess_session_info **out, size_t *n,
                               kds_err *err) {
    list_ctx l = {.size = sizeof(sess_session_info)};
    kds_status rc = sess_list_fn(st, txn, &l, err);
    if (rc != KDS_OK) {
        free(l.items);
        l.items = NULL;
        l.n = 0;
    }
    *out = l.items;
    *n = l.n;
    return rc;
}

kds_status sess_session_list(sess_store *st, sess_session_info **out, size_t *n, kds_err *err) {
    list_ctx l = {.size = sizeof(sess_session_info)};
    kds_status rc = sess__read(st, sess_list_fn, &l, err);
    if (rc != KDS_OK) {
        free(l.items);
        l.items = NULL;
        l.n = 0;
    }
    *out = l.items;
    *n = l.n;
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Load and verify                                                           */

typedef struct load_ctx {
    uint64_t id;
    const eng_model *m;  /* NULL: verify without a model */
    eng_seq *s;          /* NULL: verify only */
    sess_snapshot_info *info;
} load_ctx;

static kds_status load_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    load_ctx *L = ctx;
    char what[48];
    snap_what(what, sizeof what, L->id);
    const void *rec;
    size_t len;
    kds_status rc = sess__get_snap(st, txn, L->id, &rec, &len, err);
    if (rc != KDS_OK) return rc;
    sess__snap_hdr h;
    sess__frame f;
    if ((rc = sess__snap_parse(rec, len, L->id, &h, &f, err)) != KDS_OK) return rc;
    const unsigned char **payloads = NULL;
    if (L->m && (rc = check_model(st, txn, &h, L->m, what, err)) != KDS_OK) goto out;
    if ((rc = sess__check_payload(&f, h.payload_bytes, h.payload_xxh3, what, err)) != KDS_OK)
        goto out;
    if ((rc = sess__check_state_bytes(&f, &h, what, err)) != KDS_OK) goto out;
    if (h.n_chunks && !(payloads = calloc(h.n_chunks, sizeof *payloads))) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory loading %s", what);
        goto out;
    }
    /* Every chunk is checked before the first byte reaches the sequence, so
     * a refused load leaves it as it was. */
    if ((rc = check_chunks(st, txn, &h, what, payloads, err)) != KDS_OK) goto out;
    if (L->info) info_from_hdr(L->id, &h, len, L->info);
    if (!L->s) goto out;
    if ((rc = eng_seq_load_fixed(L->s, f.payload, f.payload_len, err)) != KDS_OK) {
        kds_err_prefix(err, "%s", what);
        goto out;
    }
    for (size_t i = 0; i < h.n_chunks; i++) {
        const sess__chunk_ref *r = &h.chunks[i];
        rc = eng_seq_load_mla(L->s, r->t0, r->t1, payloads[i],
                              (size_t)(r->t1 - r->t0) * h.layout.token_bytes, err);
        if (rc != KDS_OK) {
            /* cannot happen after the checks above; never leave half a state */
            eng_seq_reset(L->s, 0);
            kds_err_prefix(err, "%s", what);
            goto out;
        }
    }
out:
    free(payloads);
    sess__snap_hdr_free(&h);
    return rc;
}

kds_status sess_load(sess_store *st, uint64_t id, const eng_model *m, eng_seq *s,
                     sess_snapshot_info *info, kds_err *err) {
    load_ctx L = {id, m, s, info};
    return sess__read(st, load_fn, &L, err);
}

kds_status sess__verify_in(sess_store *st, MDB_txn *txn, uint64_t id, kds_err *err) {
    load_ctx L = {id, NULL, NULL, NULL};
    return load_fn(st, txn, &L, err);
}

kds_status sess__verify_model_in(sess_store *st, MDB_txn *txn, uint64_t id, const eng_model *m,
                                 kds_err *err) {
    load_ctx L = {id, m, NULL, NULL};
    return load_fn(st, txn, &L, err);
}

kds_status sess_verify(sess_store *st, uint64_t id, const eng_model *m, kds_err *err) {
    load_ctx L = {id, m, NULL, NULL};
    return sess__read(st, load_fn, &L, err);
}

/* ------------------------------------------------------------------------ */
/* Save                                                                      */

typedef struct save_ctx {
    const char *name;
    sess_conflict on_conflict;
    char target[SESS_NAME_MAX + 1]; /* the session written: name, or the conflict's fork */
    bool forked;
    uint64_t other_head;
    uint64_t base;
    const eng_model *m;
    const eng_seq *s;
    const sess_turn *turn;
    sess__layout layout;
    const char *fp;
    char model_dir[1024];
    char owner[64];
    int64_t pos;
    int64_t now;
    unsigned char *row;  /* one MLA row, for the continuation check */
    uint64_t out_id;
} save_ctx;

/* Write rows [t0, t1) of s as a new chunk; its id in *id. */
static kds_status put_chunk(sess__wtxn *w, const eng_seq *s, int64_t t0, int64_t t1,
                            uint64_t token_bytes, uint64_t *id, kds_err *err) {
    sess__chunk_hdr h = {.t0 = t0, .t1 = t1, .token_bytes = token_bytes,
                         .payload_bytes = (uint64_t)(t1 - t0) * token_bytes, .payload_xxh3 = 0};
    unsigned char *head = NULL, *head2 = NULL;
    size_t hl, hl2;
    kds_status rc = sess__chunk_hdr_encode(&h, &head, &hl, err);
    if (rc != KDS_OK) return rc;
    if ((rc = sess__new_id(w, id, err)) != KDS_OK) goto out;
    unsigned char k[8];
    sess__key64(k, *id);
    void *space;
    /* Reserve and fill in place: the rows go from the sequence straight into
     * LMDB's page buffer, one copy. */
    if ((rc = sess__reserve(w, w->st->db_chunk, k, 8, hl + h.payload_bytes, &space, err)) != KDS_OK)
        goto out;
    unsigned char *p = space;
    if ((rc = eng_seq_save_mla(s, t0, t1, p + hl, h.payload_bytes, err)) != KDS_OK) goto out;
    h.payload_xxh3 = sess__xxh3(p + hl, h.payload_bytes);
    if ((rc = sess__chunk_hdr_encode(&h, &head2, &hl2, err)) != KDS_OK) goto out;
    if (hl2 != hl) {
        rc = kds_err_set(err, KDS_INTERNAL, "chunk header length changed while encoding");
        goto out;
    }
    memcpy(p, head2, hl);
out:
    free(head);
    free(head2);
    return rc;
}

/* For hybrid models: the sequence must continue `base`, or sharing its rows
 * would splice two conversations. Comparing the last shared row catches a
 * sequence loaded from anywhere else. */
static kds_status check_continues(sess__wtxn *w, save_ctx *c, const sess__snap_hdr *b,
                                  const char *what, kds_err *err) {
    if (!b->n_chunks) return KDS_OK;
    const sess__chunk_ref *r = &b->chunks[b->n_chunks - 1];
    unsigned char k[8];
    sess__key64(k, r->id);
    const void *rec;
    size_t len;
    kds_status rc = sess__get(w->txn, w->st->db_chunk, k, 8, &rec, &len, err);
    if (rc == KDS_NOT_FOUND)
        return kds_err_set(err, KDS_CORRUPT, "%s: its chunk %llu is missing", what,
                           (unsigned long long)r->id);
    if (rc != KDS_OK) return rc;
    sess__chunk_hdr ch;
    sess__frame f;
    if ((rc = sess__chunk_parse(rec, len, r->id, &ch, &f, err)) != KDS_OK) return rc;
    size_t tb = (size_t)b->layout.token_bytes;
    if ((rc = eng_seq_save_mla(c->s, r->t1 - 1, r->t1, c->row, tb, err)) != KDS_OK) return rc;
    if (memcmp(f.payload + (size_t)(r->t1 - 1 - r->t0) * tb, c->row, tb) != 0)
        return kds_err_set(err, KDS_MISMATCH, "the sequence does not continue %s (its MLA "
                           "cache differs at token %lld)", what, (long long)(r->t1 - 1));
    return KDS_OK;
}


/* The head of `se` moved past c->base: turn `se` into a new session, the
 * fork "<name>-K" at c->base (not yet written: save_fn writes it with the
 * new head), with the transcript entries of `se` up to c->base copied. An
 * entry names the snapshot saved after it; ids grow with time, so the
 * entries up to the base are the prefix whose snapshots are <= base. */
static kds_status conflict_fork(sess__wtxn *w, save_ctx *c, sess_session_info *se,
                                kds_err *err) {
    sess_store *st = w->st;
    sess__kv *turns = NULL;
    size_t n = 0, keep = 0;
    kds_status rc = sess__collect_turns(st, w->txn, se->id, &turns, &n, err);
    if (rc != KDS_OK) return rc;
    for (; keep < n; keep++) {
        char what[96];
        snprintf(what, sizeof what, "session '%s' turn %zu", c->name, keep + 1);
        sess__turn_hdr t;
        if ((rc = sess__turn_parse(turns[keep].val, turns[keep].len, what, &t, err)) != KDS_OK)
            goto out;
        if (t.snapshot > c->base) break;
    }
    if ((rc = sess__free_fork_name(w, c->name, c->target, err)) != KDS_OK) goto out;
    c->forked = true;
    c->other_head = se->head;
    sess_session_info ne;
    memset(&ne, 0, sizeof ne);
    snprintf(ne.name, sizeof ne.name, "%s", c->target);
    if ((rc = sess__new_id(w, &ne.id, err)) != KDS_OK) goto out;
    snprintf(ne.parent, sizeof ne.parent, "%s", se->name);
    ne.fork_point = c->base;
    ne.created_us = c->now;
    snprintf(ne.owner, sizeof ne.owner, "%s", c->owner);
    inherit(&ne, se); /* (its model directory is the saving model's, set by the save) */
    ne.turns = (uint32_t)keep;
    for (size_t i = 0; i < keep; i++) {
        unsigned char k[12];
        memcpy(k, turns[i].key, 12);
        sess__key64(k, ne.id); /* same turn number, new session */
        if ((rc = sess__put(w, st->db_turn, k, 12, turns[i].val, turns[i].len, 0, err)) != KDS_OK)
            goto out;
    }
    *se = ne;
out:
    sess__free_kv(turns, n);
    return rc;
}

static kds_status save_fn(sess__wtxn *w, void *ctx, kds_err *err) {
    save_ctx *c = ctx;
    sess_store *st = w->st;
    sess_session_info se;
    bool exists = false;
    sess__snap_hdr base = {0}, h = {0};
    unsigned char *head = NULL, *head2 = NULL, *srec = NULL, *trec = NULL;
    snprintf(c->target, sizeof c->target, "%s", c->name);
    c->forked = false;
    c->other_head = 0;
    kds_status rc = sess__get_session(st, w->txn, c->name, &se, err);
    if (rc == KDS_OK) {
        exists = true;
        if (strcmp(se.fingerprint, c->fp) != 0) {
            char what[SESS_NAME_MAX + 16];
            snprintf(what, sizeof what, "session '%s'", c->name);
            rc = another_model(err, what, se.fingerprint, se.model_dir, c->m);
            goto out;
        }
        if (se.head != c->base && c->on_conflict == SESS_CONFLICT_REFUSE) {
            rc = kds_err_set(err, KDS_BUSY, "session '%s' moved to @%llu while this turn ran "
                             "from @%llu (another writer saved it); nothing was saved", c->name,
                             (unsigned long long)se.head, (unsigned long long)c->base);
            goto out;
        }
        if ((se.head != c->base || c->on_conflict == SESS_CONFLICT_FORK_ALWAYS) &&
            (rc = conflict_fork(w, c, &se, err)) != KDS_OK)
            goto out;
    } else if (rc != KDS_NOT_FOUND) {
        goto out;
    }
    kds_err_clear(err);
    char bw[48];
    snap_what(bw, sizeof bw, c->base);
    if (c->base) {
        const void *rec;
        size_t len;
        if ((rc = sess__get_snap(st, w->txn, c->base, &rec, &len, err)) != KDS_OK) goto out;
        if ((rc = sess__snap_parse(rec, len, c->base, &base, NULL, err)) != KDS_OK) goto out;
        if ((rc = check_model(st, w->txn, &base, c->m, bw, err)) != KDS_OK) goto out;
        if (base.tokens > c->pos) {
            rc = kds_err_set(err, KDS_INVALID_ARG, "the sequence (%lld tokens) is behind its "
                             "base %s (%lld tokens)", (long long)c->pos, bw,
                             (long long)base.tokens);
            goto out;
        }
        if ((rc = check_continues(w, c, &base, bw, err)) != KDS_OK) goto out;
    }
    uint64_t snap_id;
    if ((rc = sess__new_id(w, &snap_id, err)) != KDS_OK) goto out;
    /* Header: the base's chunks, then new ones for the rows after it. */
    snprintf(h.fingerprint, sizeof h.fingerprint, "%s", c->fp);
    h.layout = c->layout;
    h.tokens = c->pos;
    h.parent = c->base;
    h.created_us = c->now;
    h.payload_bytes = c->layout.fixed_bytes;
    snprintf(h.origin, sizeof h.origin, "%s", c->target);
    int64_t from = c->base ? base.tokens : 0;
    size_t tb = (size_t)c->layout.token_bytes;
    size_t n_new = 0;
    int64_t per = 0;
    if (tb) {
        per = (int64_t)(SESS_CHUNK_MAX_BYTES / tb);
        if (per < 1) per = 1;
        n_new = (size_t)((c->pos - from + per - 1) / per);
    }
    h.n_chunks = base.n_chunks + n_new;
    h.n_new_chunks = (uint32_t)n_new;
    if (h.n_chunks && !(h.chunks = calloc(h.n_chunks, sizeof *h.chunks))) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory saving a snapshot");
        goto out;
    }
    if (base.n_chunks) memcpy(h.chunks, base.chunks, base.n_chunks * sizeof *h.chunks);
    for (size_t i = 0; i < n_new; i++) {
        sess__chunk_ref *r = &h.chunks[base.n_chunks + i];
        r->t0 = from + (int64_t)i * per;
        r->t1 = r->t0 + per < c->pos ? r->t0 + per : c->pos;
        if ((rc = put_chunk(w, c->s, r->t0, r->t1, tb, &r->id, err)) != KDS_OK) goto out;
    }
    /* The snapshot record, filled in place like the chunks. */
    size_t hl, hl2;
    if ((rc = sess__snap_hdr_encode(&h, &head, &hl, err)) != KDS_OK) goto out;
    unsigned char k[8];
    sess__key64(k, snap_id);
    void *space;
    if ((rc = sess__reserve(w, st->db_snap, k, 8, hl + h.payload_bytes, &space, err)) != KDS_OK)
        goto out;
    unsigned char *p = space;
    if ((rc = eng_seq_save_fixed(c->s, p + hl, h.payload_bytes, err)) != KDS_OK) goto out;
    h.payload_xxh3 = sess__xxh3(p + hl, h.payload_bytes);
    if ((rc = sess__snap_hdr_encode(&h, &head2, &hl2, err)) != KDS_OK) goto out;
    if (hl2 != hl) {
        rc = kds_err_set(err, KDS_INTERNAL, "snapshot header length changed while encoding");
        goto out;
    }
    memcpy(p, head2, hl);
    /* The session now points at it. */
    if (!exists) {
        memset(&se, 0, sizeof se);
        snprintf(se.name, sizeof se.name, "%s", c->target);
        if ((rc = sess__new_id(w, &se.id, err)) != KDS_OK) goto out;
        se.created_us = c->now;
        snprintf(se.owner, sizeof se.owner, "%s", c->owner);
        se.fork_point = 0;
    }
    se.head = snap_id;
    se.updated_us = c->now;
    se.tokens = c->pos;
    snprintf(se.model_dir, sizeof se.model_dir, "%s", c->model_dir);
    snprintf(se.fingerprint, sizeof se.fingerprint, "%s", c->fp);
    if (c->turn && c->turn->mode) snprintf(se.mode, sizeof se.mode, "%s", c->turn->mode);
    if (c->turn && c->turn->sampler) {
        se.has_sampler = true;
        se.sampler = *c->turn->sampler;
    }
    uint32_t turn_no = se.turns;
    /* a turn without prompt and output only declares the mode */
    bool entry = c->turn && (c->turn->prompt || c->turn->output);
    if (entry) se.turns++;
    size_t sl;
    if ((rc = sess__session_encode(&se, &srec, &sl, err)) != KDS_OK) goto out;
    if ((rc = sess__put(w, st->db_sess, c->target, strlen(c->target), srec, sl, 0, err)) !=
        KDS_OK)
        goto out;
    if (entry) {
        sess__turn_hdr t = {.prompt = c->turn->prompt ? c->turn->prompt : "",
                            .prompt_len = c->turn->prompt ? c->turn->prompt_len : 0,
                            .output = c->turn->output ? c->turn->output : "",
                            .output_len = c->turn->output ? c->turn->output_len : 0,
                            .prompt_tokens = c->turn->prompt_tokens,
                            .output_tokens = c->turn->output_tokens,
                            .tokens = c->pos,
                            .time_us = c->now,
                            .snapshot = snap_id,
                            .doc_name = c->turn->doc_name,
                            .doc_bytes = c->turn->doc_bytes};
        size_t tl;
        if ((rc = sess__turn_encode(&t, &trec, &tl, err)) != KDS_OK) goto out;
        unsigned char tk[12];
        sess__turn_key(tk, se.id, turn_no);
        if ((rc = sess__put(w, st->db_turn, tk, 12, trec, tl, 0, err)) != KDS_OK) goto out;
    }
    c->out_id = snap_id;
out:
    free(head);
    free(head2);
    free(srec);
    free(trec);
    sess__snap_hdr_free(&base);
    sess__snap_hdr_free(&h);
    return rc;
}

kds_status sess_save(sess_store *st, const char *session, uint64_t base, const eng_model *m,
                     const eng_seq *s, const sess_turn *turn, uint64_t *snapshot, kds_err *err) {
    sess_save_result r;
    kds_status rc = sess_save_ex(st, session, base, m, s, turn, SESS_CONFLICT_REFUSE, &r, err);
    if (rc == KDS_OK && snapshot) *snapshot = r.snapshot;
    return rc;
}

kds_status sess_save_ex(sess_store *st, const char *session, uint64_t base, const eng_model *m,
                        const eng_seq *s, const sess_turn *turn, sess_conflict on_conflict,
                        sess_save_result *res, kds_err *err) {
    if (res) memset(res, 0, sizeof *res);
    if (!sess_name_valid(session))
        return kds_err_set(err, KDS_INVALID_ARG, "invalid session name '%s' (1-%d of A-Z a-z "
                           "0-9 . _ -, starting with a letter or digit)", session ? session : "",
                           SESS_NAME_MAX);
    if (turn && turn->mode) {
        size_t ml = strlen(turn->mode);
        bool ok = ml >= 1 && ml <= SESS_MODE_MAX;
        for (size_t i = 0; ok && i < ml; i++) ok = turn->mode[i] >= 'a' && turn->mode[i] <= 'z';
        if (!ok)
            return kds_err_set(err, KDS_INVALID_ARG, "invalid session mode '%.32s' (1-%d of a-z)",
                               turn->mode, SESS_MODE_MAX);
    }
    if (turn && turn->sampler && !sess_sampler_valid(turn->sampler))
        return kds_err_set(err, KDS_INVALID_ARG, "sampler settings out of range (temperature %g, "
                           "top_p %g, min_p %g, repeat_penalty %g)", turn->sampler->temperature,
                           turn->sampler->top_p, turn->sampler->min_p,
                           turn->sampler->repeat_penalty);
    if (turn && turn->doc_name &&
        (!turn->doc_name[0] || strlen(turn->doc_name) > SESS_DOC_NAME_MAX))
        return kds_err_set(err, KDS_INVALID_ARG, "a document name must be 1-%d bytes",
                           SESS_DOC_NAME_MAX);
    save_ctx c = {.name = session, .on_conflict = on_conflict, .base = base, .m = m, .s = s,
                  .turn = turn,
                  .fp = eng_model_fingerprint(m), .pos = eng_seq_pos(s),
                  .now = (int64_t)sess__now_us()};
    sess__layout_of(eng_model_config(m), &c.layout);
    if (c.layout.fixed_bytes != eng_seq_fixed_bytes(s) ||
        c.layout.token_bytes != eng_seq_mla_token_bytes(s))
        return kds_err_set(err, KDS_INVALID_ARG, "the sequence is not of model %s",
                           eng_model_dir(m));
    char real[PATH_MAX];
    const char *dir = realpath(eng_model_dir(m), real) ? real : eng_model_dir(m);
    size_t dl = strlen(dir);
    if (dl < sizeof c.model_dir) memcpy(c.model_dir, dir, dl + 1); /* too long: left "" */
    sess__owner(c.owner, sizeof c.owner);
    if (c.layout.token_bytes && !(c.row = malloc(c.layout.token_bytes)))
        return kds_err_set(err, KDS_NOMEM, "out of memory saving a snapshot");
    kds_status rc = sess__write(st, save_fn, &c, err);
    free(c.row);
    if (rc == KDS_OK && res) {
        res->snapshot = c.out_id;
        memcpy(res->session, c.target, sizeof res->session);
        res->forked = c.forked;
        res->other_head = c.other_head;
    }
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Fork                                                                      */

/* Copies of the transcript records of session `id` (the records are put
 * again under another key, so they are collected before any write). */
kds_status sess__collect_turns(sess_store *st, MDB_txn *txn, uint64_t id, sess__kv **out, size_t *n,
                                kds_err *err) {
    *out = NULL;
    *n = 0;
    MDB_cursor *c;
    int m = mdb_cursor_open(txn, st->db_turn, &c);
    if (m) return sess__mdb_err(m, "reading a transcript", err);
    unsigned char k0[12];
    sess__turn_key(k0, id, 0);
    MDB_val k = {12, k0}, v;
    size_t cap = 0;
    kds_status rc = KDS_OK;
    for (m = mdb_cursor_get(c, &k, &v, MDB_SET_RANGE); m == 0;
         m = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
        if (k.mv_size != 12 || memcmp(k.mv_data, k0, 8) != 0) break;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            sess__kv *p = realloc(*out, cap * sizeof *p);
            if (!p) goto nomem;
            *out = p;
        }
        sess__kv *e = &(*out)[*n];
        memcpy(e->key, k.mv_data, 12);
        if (!(e->val = malloc(v.mv_size ? v.mv_size : 1))) goto nomem;
        memcpy(e->val, v.mv_data, v.mv_size);
        e->len = v.mv_size;
        (*n)++;
    }
    mdb_cursor_close(c);
    return rc;
nomem:
    mdb_cursor_close(c);
    return kds_err_set(err, KDS_NOMEM, "out of memory copying a transcript");
}

void sess__free_kv(sess__kv *a, size_t n) {
    for (size_t i = 0; i < n; i++) free(a[i].val);
    free(a);
}

/* "<base>-K" with the first K >= 2 that names no session. */
kds_status sess__free_fork_name(sess__wtxn *w, const char *base, char out[SESS_NAME_MAX + 1],
                                 kds_err *err) {
    for (unsigned i = 2; i < 1000000; i++) {
        const void *v;
        size_t n;
        snprintf(out, SESS_NAME_MAX + 1, "%.54s-%u", base, i);
        kds_status rc = sess__get(w->txn, w->st->db_sess, out, strlen(out), &v, &n, err);
        if (rc == KDS_NOT_FOUND) return KDS_OK;
        if (rc != KDS_OK) return rc;
    }
    return kds_err_set(err, KDS_EXISTS, "no free name '%.54s-K' for a fork", base);
}

typedef struct fork_ctx {
    const char *source;
    const char *name;
    char out[SESS_NAME_MAX + 1];
} fork_ctx;

static kds_status fork_fn(sess__wtxn *w, void *ctx, kds_err *err) {
    fork_ctx *f = ctx;
    sess_store *st = w->st;
    sess_ref ref;
    sess__kv *turns = NULL;
    size_t n_turns = 0;
    unsigned char *rec = NULL;
    kds_status rc = resolve_in(st, w->txn, f->source, &ref, err);
    if (rc != KDS_OK) return rc;
    sess_session_info src, ne;
    memset(&ne, 0, sizeof ne);
    sess__snap_hdr h = {0};
    const void *v;
    size_t n;
    if (ref.is_session) {
        if ((rc = sess__get_session(st, w->txn, ref.name, &src, err)) != KDS_OK) goto out;
        if ((rc = sess__collect_turns(st, w->txn, src.id, &turns, &n_turns, err)) != KDS_OK) goto out;
        snprintf(ne.parent, sizeof ne.parent, "%s", src.name);
        inherit(&ne, &src);
    }
    if ((rc = sess__get_snap(st, w->txn, ref.snapshot, &v, &n, err)) != KDS_OK) goto out;
    if ((rc = sess__snap_parse(v, n, ref.snapshot, &h, NULL, err)) != KDS_OK) goto out;
    /* "@N": what the session that wrote it records (a chat snapshot
     * restored as a plain session would feed its next turn as raw text) */
    if (!ref.is_session && origin_session(st, w->txn, &h, &src)) inherit(&ne, &src);
    if (f->name) {
        if (!sess_name_valid(f->name)) {
            rc = kds_err_set(err, KDS_INVALID_ARG, "invalid session name '%s'", f->name);
            goto out;
        }
        snprintf(f->out, sizeof f->out, "%s", f->name);
    } else {
        char base[SESS_NAME_MAX + 1];
        if (ref.is_session)
            snprintf(base, sizeof base, "%s", ref.name);
        else
            snprintf(base, sizeof base, "snap%llu", (unsigned long long)ref.snapshot);
        if ((rc = sess__free_fork_name(w, base, f->out, err)) != KDS_OK) goto out;
    }
    rc = sess__get(w->txn, st->db_sess, f->out, strlen(f->out), &v, &n, err);
    if (rc == KDS_OK) {
        rc = kds_err_set(err, KDS_EXISTS, "session '%s' already exists", f->out);
        goto out;
    }
    if (rc != KDS_NOT_FOUND) goto out;
    kds_err_clear(err);
    snprintf(ne.name, sizeof ne.name, "%s", f->out);
    if ((rc = sess__new_id(w, &ne.id, err)) != KDS_OK) goto out;
    ne.head = ref.snapshot;
    ne.fork_point = ref.snapshot;
    ne.created_us = ne.updated_us = (int64_t)sess__now_us();
    ne.tokens = h.tokens;
    ne.turns = (uint32_t)n_turns;
    sess__owner(ne.owner, sizeof ne.owner);
    snprintf(ne.fingerprint, sizeof ne.fingerprint, "%s", h.fingerprint);
    size_t len;
    if ((rc = sess__session_encode(&ne, &rec, &len, err)) != KDS_OK) goto out;
    if ((rc = sess__put(w, st->db_sess, ne.name, strlen(ne.name), rec, len, MDB_NOOVERWRITE,
                        err)) != KDS_OK)
        goto out;
    for (size_t i = 0; i < n_turns; i++) {
        unsigned char k[12];
        memcpy(k, turns[i].key, 12);
        sess__key64(k, ne.id); /* same turn number, new session */
        if ((rc = sess__put(w, st->db_turn, k, 12, turns[i].val, turns[i].len, 0, err)) != KDS_OK)
            goto out;
    }
out:
    free(rec);
    sess__free_kv(turns, n_turns);
    sess__snap_hdr_free(&h);
    return rc;
}

kds_status sess_fork(sess_store *st, const char *source, const char *name,
                     char out_name[SESS_NAME_MAX + 1], kds_err *err) {
    if (!source || !*source)
        return kds_err_set(err, KDS_INVALID_ARG, "fork needs a session or snapshot id");
    fork_ctx f = {.source = source, .name = name};
    kds_status rc = sess__write(st, fork_fn, &f, err);
    if (rc == KDS_OK && out_name) memcpy(out_name, f.out, sizeof f.out);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Delete                                                                    */

static kds_status del_turns(sess__wtxn *w, uint64_t id, kds_err *err) {
    MDB_cursor *c;
    int m = mdb_cursor_open(w->txn, w->st->db_turn, &c);
    if (m) return sess__mdb_err(m, "deleting a transcript", err);
    unsigned char k0[12];
    sess__turn_key(k0, id, 0);
    MDB_val k = {12, k0}, v;
    for (m = mdb_cursor_get(c, &k, &v, MDB_SET_RANGE); m == 0;
         m = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
        if (k.mv_size != 12 || memcmp(k.mv_data, k0, 8) != 0) break;
        if ((m = mdb_cursor_del(c, 0)) != 0) break;
        w->freed = true;
    }
    mdb_cursor_close(c);
    if (m == 0 || m == MDB_NOTFOUND) return KDS_OK;
    return sess__write_err(w, m, "deleting a transcript", err);
}

static kds_status sess_del_fn(sess__wtxn *w, void *ctx, kds_err *err) {
    const char *name = ctx;
    sess_session_info s;
    kds_status rc = sess__get_session(w->st, w->txn, name, &s, err);
    if (rc != KDS_OK) return rc;
    if ((rc = sess__del(w, w->st->db_sess, name, strlen(name), err)) != KDS_OK) return rc;
    return del_turns(w, s.id, err);
}

kds_status sess_session_delete(sess_store *st, const char *name, kds_err *err) {
    if (!sess_name_valid(name))
        return kds_err_set(err, KDS_INVALID_ARG, "invalid session name '%s'", name ? name : "");
    return sess__write(st, sess_del_fn, (void *)name, err);
}

/* ------------------------------------------------------------------------ */
/* Rename                                                                    */

typedef struct rename_ctx {
    const char *from, *to;
} rename_ctx;

/* The record moves to the new key; the transcript is keyed by the session's
 * internal id, so it stays where it is. Snapshots keep their origin name. */
static kds_status rename_fn(sess__wtxn *w, void *ctx, kds_err *err) {
    const rename_ctx *r = ctx;
    sess_session_info s;
    unsigned char *rec = NULL;
    size_t len;
    kds_status rc = sess__get_session(w->st, w->txn, r->from, &s, err);
    if (rc != KDS_OK) return rc;
    const void *v;
    size_t n;
    rc = sess__get(w->txn, w->st->db_sess, r->to, strlen(r->to), &v, &n, err);
    if (rc == KDS_OK) return kds_err_set(err, KDS_EXISTS, "session '%s' already exists", r->to);
    if (rc != KDS_NOT_FOUND) return rc;
    kds_err_clear(err);
    snprintf(s.name, sizeof s.name, "%s", r->to);
    s.updated_us = (int64_t)sess__now_us();
    if ((rc = sess__session_encode(&s, &rec, &len, err)) != KDS_OK) return rc;
    rc = sess__put(w, w->st->db_sess, r->to, strlen(r->to), rec, len, MDB_NOOVERWRITE, err);
    free(rec);
    if (rc != KDS_OK) return rc;
    return sess__del(w, w->st->db_sess, r->from, strlen(r->from), err);
}

kds_status sess_session_rename(sess_store *st, const char *from, const char *to, kds_err *err) {
    if (!sess_name_valid(from))
        return kds_err_set(err, KDS_INVALID_ARG, "invalid session name '%s'", from ? from : "");
    if (!sess_name_valid(to))
        return kds_err_set(err, KDS_INVALID_ARG, "invalid session name '%s'", to ? to : "");
    if (!strcmp(from, to)) return kds_err_set(err, KDS_EXISTS, "session '%s' already exists", to);
    rename_ctx r = {from, to};
    return sess__write(st, rename_fn, &r, err);
}

static kds_status snap_del_fn(sess__wtxn *w, void *ctx, kds_err *err) {
    uint64_t id = *(uint64_t *)ctx;
    const void *v;
    size_t n;
    kds_status rc = sess__get_snap(w->st, w->txn, id, &v, &n, err);
    if (rc != KDS_OK) return rc;
    sess_session_info *all = NULL;
    list_ctx l = {.size = sizeof(sess_session_info)};
    if ((rc = sess_list_fn(w->st, w->txn, &l, err)) != KDS_OK) goto out;
    all = l.items;
    for (size_t i = 0; i < l.n; i++)
        if (all[i].head == id || all[i].tokens < 0) {
            rc = all[i].tokens < 0
                     ? kds_err_set(err, KDS_BUSY, "session '%s' is unreadable, so @%llu may be "
                                   "its head; not deleted", all[i].name, (unsigned long long)id)
                     : kds_err_set(err, KDS_BUSY, "snapshot @%llu is the head of session '%s'; "
                                   "delete or move the session first", (unsigned long long)id,
                                   all[i].name);
            goto out;
        }
    unsigned char k[8];
    sess__key64(k, id);
    rc = sess__del(w, w->st->db_snap, k, 8, err);
out:
    free(all);
    return rc;
}

kds_status sess_snapshot_delete(sess_store *st, uint64_t id, kds_err *err) {
    return sess__write(st, snap_del_fn, &id, err);
}

/* ------------------------------------------------------------------------ */
/* Transcript                                                                */

typedef struct transcript_ctx {
    const char *name;
    sess_turn_record *t;
    size_t n;
} transcript_ctx;

static char *dup_bytes(const char *p, size_t n) {
    char *d = malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, p, n);
    d[n] = '\0';
    return d;
}

static kds_status transcript_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    transcript_ctx *T = ctx;
    sess_session_info s;
    kds_status rc = sess__get_session(st, txn, T->name, &s, err);
    if (rc != KDS_OK) return rc;
    sess__kv *recs = NULL;
    size_t n = 0;
    if ((rc = sess__collect_turns(st, txn, s.id, &recs, &n, err)) != KDS_OK) return rc;
    if (n && !(T->t = calloc(n, sizeof *T->t))) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory reading a transcript");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        char what[96];
        snprintf(what, sizeof what, "session '%s' turn %zu", T->name, i + 1);
        sess__turn_hdr h;
        if ((rc = sess__turn_parse(recs[i].val, recs[i].len, what, &h, err)) != KDS_OK) goto out;
        sess_turn_record *r = &T->t[i];
        rc = sess__turn_prompt(&h, what, &r->prompt, err);
        r->output = dup_bytes(h.output, h.output_len);
        T->n = i + 1;
        if (rc != KDS_OK) goto out;
        if (!r->output) {
            rc = kds_err_set(err, KDS_NOMEM, "out of memory reading a transcript");
            goto out;
        }
        r->prompt_len = h.prompt_len;
        r->output_len = h.output_len;
        r->prompt_tokens = h.prompt_tokens;
        r->output_tokens = h.output_tokens;
        r->tokens = h.tokens;
        r->snapshot = h.snapshot;
        r->time_us = h.time_us;
        memcpy(r->doc_name, h.doc, sizeof r->doc_name);
        r->doc_bytes = h.doc_bytes;
    }
out:
    sess__free_kv(recs, n);
    return rc;
}

kds_status sess_transcript(sess_store *st, const char *name, sess_turn_record **out, size_t *n,
                           kds_err *err) {
    *out = NULL;
    *n = 0;
    if (!sess_name_valid(name))
        return kds_err_set(err, KDS_INVALID_ARG, "invalid session name '%s'", name ? name : "");
    transcript_ctx T = {.name = name};
    kds_status rc = sess__read(st, transcript_fn, &T, err);
    if (rc != KDS_OK) {
        sess_transcript_free(T.t, T.n);
        return rc;
    }
    *out = T.t;
    *n = T.n;
    return KDS_OK;
}

void sess_transcript_free(sess_turn_record *t, size_t n) {
    if (!t) return;
    for (size_t i = 0; i < n; i++) {
        free(t[i].prompt);
        free(t[i].output);
    }
    free(t);
}

/* ------------------------------------------------------------------------ */
/* Sizes                                                                     */

sess_size sess_snapshot_size(const eng_config *c, int64_t tokens) {
    sess_size z = {0};
    sess__snap_hdr h = {0};
    sess__layout_of(c, &h.layout);
    z.fixed_bytes = h.layout.fixed_bytes;
    z.token_bytes = h.layout.token_bytes;
    if (tokens < 1) tokens = 1;
    h.tokens = tokens;
    h.parent = 1u << 20; /* ids of a store with about a million records */
    h.created_us = (int64_t)sess__now_us();
    h.payload_bytes = h.layout.fixed_bytes;
    snprintf(h.fingerprint, sizeof h.fingerprint, "%032d", 0);
    snprintf(h.origin, sizeof h.origin, "session-name");
    int64_t per = 0;
    if (z.token_bytes) {
        per = (int64_t)(SESS_CHUNK_MAX_BYTES / z.token_bytes);
        if (per < 1) per = 1;
        h.n_chunks = (size_t)((tokens + per - 1) / per);
        h.n_new_chunks = (uint32_t)h.n_chunks;
        h.chunks = calloc(h.n_chunks, sizeof *h.chunks);
    }
    unsigned char *rec = NULL;
    size_t len = 0;
    if (h.n_chunks && !h.chunks) return z;
    for (size_t i = 0; i < h.n_chunks; i++) {
        h.chunks[i].id = (1u << 20) + i;
        h.chunks[i].t0 = (int64_t)i * per;
        h.chunks[i].t1 = h.chunks[i].t0 + per < tokens ? h.chunks[i].t0 + per : tokens;
        sess__chunk_hdr ch = {.t0 = h.chunks[i].t0, .t1 = h.chunks[i].t1,
                              .token_bytes = z.token_bytes,
                              .payload_bytes = (uint64_t)(h.chunks[i].t1 - h.chunks[i].t0) *
                                               z.token_bytes};
        if (sess__chunk_hdr_encode(&ch, &rec, &len, NULL) == KDS_OK)
            z.chunks += len + ch.payload_bytes;
        free(rec);
        rec = NULL;
    }
    if (sess__snap_hdr_encode(&h, &rec, &len, NULL) == KDS_OK) z.record = len + z.fixed_bytes;
    free(rec);
    sess__snap_hdr_free(&h);
    z.total = z.record + z.chunks;
    return z;
}

kds_status sess_session_chat_mode(sess_store *st, const sess_session_info *si,
                                  const eng_tokenizer *tok, bool fallback, bool *chat,
                                  kds_err *err) {
    *chat = fallback;
    if (!strcmp(si->mode, "chat") || !strcmp(si->mode, "plain")) {
        if (!strcmp(si->mode, "chat") && !eng_chat_supported(tok))
            return kds_err_set(err, KDS_UNSUPPORTED,
                               "session '%s' is in chat mode but the model has no chat format",
                               si->name);
        *chat = !strcmp(si->mode, "chat");
        return KDS_OK;
    }
    if (si->mode[0])
        return kds_err_set(err, KDS_UNSUPPORTED,
                           "session '%s' has mode '%s', which this version does not know (it "
                           "knows chat and plain)",
                           si->name, si->mode);
    if (!eng_chat_supported(tok)) {
        *chat = false;
        return KDS_OK;
    }
    /* a plain turn's prompt_tokens equal the text's plain encoding; a chat
     * turn adds its markup */
    sess_turn_record *t = NULL;
    size_t n = 0;
    if (sess_transcript(st, si->name, &t, &n, NULL) == KDS_OK && n) {
        int64_t plain = eng_tok_encode(tok, t[0].prompt, t[0].prompt_len, NULL, 0);
        if (plain >= 0 && t[0].prompt_tokens > 0)
            *chat = t[0].prompt_tokens != plain &&
                    !(plain == 0 && t[0].prompt_tokens == 1); /* BOS alone */
    }
    sess_transcript_free(t, n);
    return KDS_OK;
}
