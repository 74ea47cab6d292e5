/*
 * sess_history.c - a session's history: the snapshots it went through (its
 * head, the chain of parents from it as far as they remain, the snapshot
 * each transcript turn names, its fork point), and what is built on it:
 * finding the newest sound snapshot of a session and recovering a session
 * whose head is damaged.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sess_internal.h"

typedef struct hist_list {
    sess__hist *v;
    size_t n, cap;
} hist_list;

static sess__hist *hist_add(hist_list *l, uint64_t id, int64_t tokens) {
    for (size_t i = 0; i < l->n; i++)
        if (l->v[i].id == id) return &l->v[i];
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 32;
        sess__hist *p = realloc(l->v, cap * sizeof *p);
        if (!p) return NULL;
        l->v = p;
        l->cap = cap;
    }
    sess__hist *h = &l->v[l->n++];
    memset(h, 0, sizeof *h);
    h->id = id;
    h->tokens = tokens;
    h->chain = -1;
    return h;
}

static int cmp_newest(const void *a, const void *b) {
    uint64_t x = ((const sess__hist *)a)->id, y = ((const sess__hist *)b)->id;
    return x > y ? -1 : x < y;
}

/* Header of snapshot `id` when present and readable. */
static bool snap_header(sess_store *st, MDB_txn *txn, uint64_t id, sess__snap_hdr *h) {
    const void *rec;
    size_t len;
    if (sess__get_snap(st, txn, id, &rec, &len, NULL) != KDS_OK) return false;
    return sess__snap_parse(rec, len, id, h, NULL, NULL) == KDS_OK;
}

kds_status sess__history(sess_store *st, MDB_txn *txn, const sess_session_info *s, sess__hist **out,
                         size_t *n, kds_err *err) {
    *out = NULL;
    *n = 0;
    hist_list l = {0};
    sess__kv *turns = NULL;
    size_t n_turns = 0;
    kds_status rc = KDS_OK;
    /* the chain of parents from the head; ids grow with time, so a parent
     * is always older (a larger or equal one would be a damaged header) */
    uint64_t id = s->head;
    for (int pos = 0; id; pos++) {
        sess__snap_hdr h;
        bool known = snap_header(st, txn, id, &h);
        sess__hist *e = hist_add(&l, id, known ? h.tokens : -1);
        if (!e) goto nomem;
        e->chain = pos;
        uint64_t parent = known ? h.parent : 0;
        if (known) sess__snap_hdr_free(&h);
        if (!known || parent >= id) break;
        const void *rec;
        size_t len;
        if (sess__get_snap(st, txn, parent, &rec, &len, NULL) != KDS_OK) break; /* gone */
        id = parent;
    }
    /* the snapshots the transcript names (an imported transcript names the
     * exporting store's ids: only a snapshot of the same token count is
     * taken for the one a turn saved) */
    if ((rc = sess__collect_turns(st, txn, s->id, &turns, &n_turns, err)) != KDS_OK) goto out;
    for (size_t i = 0; i < n_turns; i++) {
        sess__turn_hdr t;
        if (sess__turn_parse(turns[i].val, turns[i].len, "turn", &t, NULL) != KDS_OK) continue;
        sess__snap_hdr h;
        if (!t.snapshot || !snap_header(st, txn, t.snapshot, &h)) continue;
        bool same = h.tokens == t.tokens;
        int64_t tokens = h.tokens;
        sess__snap_hdr_free(&h);
        if (!same) continue;
        sess__hist *e = hist_add(&l, t.snapshot, tokens);
        if (!e) goto nomem;
        e->turn = (uint32_t)(i + 1);
    }
    if (s->fork_point) {
        sess__snap_hdr h;
        if (snap_header(st, txn, s->fork_point, &h)) {
            sess__hist *e = hist_add(&l, s->fork_point, h.tokens);
            sess__snap_hdr_free(&h);
            if (!e) goto nomem;
            e->fork_point = true;
        }
    }
    if (l.n) qsort(l.v, l.n, sizeof *l.v, cmp_newest);
    *out = l.v;
    *n = l.n;
    l.v = NULL;
    goto out;
nomem:
    rc = kds_err_set(err, KDS_NOMEM, "out of memory reading the history of session '%s'", s->name);
out:
    free(l.v);
    sess__free_kv(turns, n_turns);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Last good snapshot, recovery                                              */

/* How many of a session's transcript turns lead up to snapshot `to`: turns name the
 * snapshot saved after them, ids grow with time, so they are the prefix
 * whose snapshots are <= to. */
static void turns_upto(sess__kv *turns, size_t n, uint64_t to, size_t *keep) {
    *keep = 0;
    for (; *keep < n; (*keep)++) {
        sess__turn_hdr t;
        if (sess__turn_parse(turns[*keep].val, turns[*keep].len, "turn", &t, NULL) != KDS_OK) break;
        if (t.snapshot > to) break;
    }
}

typedef struct good_ctx {
    const char *name;
    const eng_model *m;
    sess_recovery *out;
} good_ctx;

static kds_status find_good(sess_store *st, MDB_txn *txn, good_ctx *g, sess_session_info *s,
                            sess__kv **turns, size_t *n_turns, kds_err *err) {
    sess_recovery *o = g->out;
    memset(o, 0, sizeof *o);
    kds_status rc = sess__get_session(st, txn, g->name, s, err);
    if (rc != KDS_OK) return rc;
    o->head = s->head;
    sess__hist *h = NULL;
    size_t n = 0;
    if ((rc = sess__history(st, txn, s, &h, &n, err)) != KDS_OK) return rc;
    for (size_t i = 0; i < n && !o->to; i++) {
        if (h[i].id > s->head) continue;
        if (sess__verify_model_in(st, txn, h[i].id, g->m, NULL) != KDS_OK) continue;
        o->to = h[i].id;
        o->tokens = h[i].tokens;
    }
    free(h);
    o->head_ok = o->to == s->head;
    if ((rc = sess__collect_turns(st, txn, s->id, turns, n_turns, err)) != KDS_OK) return rc;
    size_t keep = 0;
    if (o->to) turns_upto(*turns, *n_turns, o->to, &keep);
    o->turns = (uint32_t)keep;
    o->turns_after = (uint32_t)(*n_turns - keep);
    return KDS_OK;
}

static kds_status good_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    sess_session_info s;
    sess__kv *turns = NULL;
    size_t n = 0;
    kds_status rc = find_good(st, txn, ctx, &s, &turns, &n, err);
    sess__free_kv(turns, n);
    return rc;
}

kds_status sess_session_last_good(sess_store *st, const char *name, const eng_model *m,
                                  sess_recovery *out, kds_err *err) {
    memset(out, 0, sizeof *out);
    if (!sess_name_valid(name))
        return kds_err_set(err, KDS_INVALID_ARG, "invalid session name '%s'", name ? name : "");
    good_ctx g = {.name = name, .m = m, .out = out};
    return sess__read(st, good_fn, &g, err);
}

static kds_status recover_fn(sess__wtxn *w, void *ctx, kds_err *err) {
    good_ctx *g = ctx;
    sess_store *st = w->st;
    sess_recovery *o = g->out;
    sess_session_info s;
    sess__kv *turns = NULL;
    size_t n_turns = 0;
    unsigned char *rec = NULL;
    sess__snap_hdr to = {0};
    bool have_to = false;
    kds_status rc = find_good(st, w->txn, g, &s, &turns, &n_turns, err);
    if (rc != KDS_OK) goto out;
    if (o->head_ok) {
        rc = kds_err_set(err, KDS_INVALID_ARG,
                         "session '%s' is sound (its head @%llu "
                         "verifies): nothing to recover",
                         g->name, (unsigned long long)s.head);
        goto out;
    }
    if (!o->to) {
        rc = kds_err_set(err, KDS_NOT_FOUND,
                         "no snapshot of session '%s''s history verifies: "
                         "nothing to go back to (its transcript is intact: `kdaserve snap show "
                         "%s`)",
                         g->name, g->name);
        goto out;
    }
    if (!(have_to = snap_header(st, w->txn, o->to, &to))) {
        rc = kds_err_set(err, KDS_INTERNAL, "snapshot @%llu verified but cannot be read",
                         (unsigned long long)o->to);
        goto out;
    }
    /* what the session was: its record (and so its transcript, keyed by
     * its id) moves to "<name>-damaged", a fork of the recovered one */
    const void *v;
    size_t vn;
    for (unsigned k = 1;; k++) {
        if (k == 1)
            snprintf(o->kept, sizeof o->kept, "%.48s-damaged", g->name);
        else
            snprintf(o->kept, sizeof o->kept, "%.48s-damaged-%u", g->name, k);
        rc = sess__get(w->txn, st->db_sess, o->kept, strlen(o->kept), &v, &vn, err);
        if (rc == KDS_NOT_FOUND) break;
        if (rc != KDS_OK) goto out;
    }
    sess_session_info kept = s;
    snprintf(kept.name, sizeof kept.name, "%s", o->kept);
    snprintf(kept.parent, sizeof kept.parent, "%s", g->name);
    kept.fork_point = o->to;
    size_t len;
    if ((rc = sess__session_encode(&kept, &rec, &len, err)) != KDS_OK) goto out;
    if ((rc = sess__put(w, st->db_sess, kept.name, strlen(kept.name), rec, len, MDB_NOOVERWRITE,
                        err)) != KDS_OK)
        goto out;
    free(rec);
    rec = NULL;
    /* the session itself: a new record at the good snapshot, with the
     * transcript up to it */
    sess_session_info ne = s;
    if ((rc = sess__new_id(w, &ne.id, err)) != KDS_OK) goto out;
    ne.head = o->to;
    ne.tokens = to.tokens;
    ne.turns = o->turns;
    ne.updated_us = (int64_t)sess__now_us();
    snprintf(ne.fingerprint, sizeof ne.fingerprint, "%s", to.fingerprint);
    if ((rc = sess__session_encode(&ne, &rec, &len, err)) != KDS_OK) goto out;
    if ((rc = sess__put(w, st->db_sess, ne.name, strlen(ne.name), rec, len, 0, err)) != KDS_OK)
        goto out;
    for (uint32_t i = 0; i < o->turns; i++) {
        unsigned char k[12];
        memcpy(k, turns[i].key, 12);
        sess__key64(k, ne.id); /* same turn number, the recovered session */
        if ((rc = sess__put(w, st->db_turn, k, 12, turns[i].val, turns[i].len, 0, err)) != KDS_OK)
            goto out;
    }
out:
    free(rec);
    if (have_to) sess__snap_hdr_free(&to);
    sess__free_kv(turns, n_turns);
    return rc;
}

kds_status sess_session_recover(sess_store *st, const char *name, const eng_model *m,
                                sess_recovery *out, kds_err *err) {
    memset(out, 0, sizeof *out);
    if (!sess_name_valid(name))
        return kds_err_set(err, KDS_INVALID_ARG, "invalid session name '%s'", name ? name : "");
    good_ctx g = {.name = name, .m = m, .out = out};
    return sess__write(st, recover_fn, &g, err);
}

/* ------------------------------------------------------------------------ */
/* Retention policy                                                          */

sess_retention sess_default_retention(void) {
    sess_retention r = {.keep_last = 10, .keep_every = 25, .keep_days = 0};
    return r;
}

typedef struct retention_ctx {
    sess_retention r;
    bool set;
} retention_ctx;

static kds_status retention_read(sess_store *st, MDB_txn *txn, retention_ctx *c, kds_err *err) {
    const void *v;
    size_t n;
    c->r = sess_default_retention();
    c->set = false;
    kds_status rc = sess__get(txn, st->db_meta, "retention", 9, &v, &n, err);
    if (rc == KDS_NOT_FOUND) return KDS_OK;
    if (rc != KDS_OK) return rc;
    char what[1100];
    snprintf(what, sizeof what,
             "retention policy of store %s (reset it with `kdaserve snap "
             "retention --default`)",
             st->dir);
    if ((rc = sess__retention_parse(v, n, what, &c->r, err)) != KDS_OK) return rc;
    c->set = true;
    return KDS_OK;
}

static kds_status retention_get_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    return retention_read(st, txn, ctx, err);
}

kds_status sess_retention_get(sess_store *st, sess_retention *out, bool *is_set, kds_err *err) {
    retention_ctx c;
    kds_status rc = sess__read(st, retention_get_fn, &c, err);
    if (rc != KDS_OK) return rc;
    *out = c.r;
    if (is_set) *is_set = c.set;
    return KDS_OK;
}

static kds_status retention_set_fn(sess__wtxn *w, void *ctx, kds_err *err) {
    const sess_retention *r = ctx;
    if (!r) {
        MDB_val k = {9, "retention"};
        int m = mdb_del(w->txn, w->st->db_meta, &k, NULL);
        return m == 0 || m == MDB_NOTFOUND ? KDS_OK : sess__write_err(w, m, "retention", err);
    }
    unsigned char *rec = NULL;
    size_t len;
    kds_status rc = sess__retention_encode(r, &rec, &len, err);
    if (rc == KDS_OK) rc = sess__put(w, w->st->db_meta, "retention", 9, rec, len, 0, err);
    free(rec);
    return rc;
}

kds_status sess_retention_set(sess_store *st, const sess_retention *r, kds_err *err) {
    return sess__write(st, retention_set_fn, (void *)r, err);
}

/* ------------------------------------------------------------------------ */
/* Pruning                                                                   */

typedef struct idset {
    uint64_t *v;
    size_t n, cap;
} idset;

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static bool idset_add(idset *s, uint64_t id) {
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 64;
        uint64_t *p = realloc(s->v, cap * sizeof *p);
        if (!p) return false;
        s->v = p;
        s->cap = cap;
    }
    s->v[s->n++] = id;
    return true;
}

static void idset_sort(idset *s) {
    if (!s->n) return;
    qsort(s->v, s->n, sizeof *s->v, cmp_u64);
    size_t j = 1;
    for (size_t i = 1; i < s->n; i++)
        if (s->v[i] != s->v[j - 1]) s->v[j++] = s->v[i];
    s->n = j;
}

static bool idset_has(const idset *s, uint64_t id) {
    return s->n && bsearch(&id, s->v, s->n, sizeof *s->v, cmp_u64) != NULL;
}

typedef struct prune_ctx {
    sess_retention r;
    unsigned flags;
    int64_t now_us;
    sess_gc_stats *g;
} prune_ctx;

/* Heads; every snapshot of some history; those the policy keeps. */
static kds_status plan(sess_store *st, MDB_txn *txn, const prune_ctx *p, idset *heads, idset *hist,
                       idset *keep, bool *unknown, kds_err *err) {
    sess_session_info *ss = NULL;
    size_t ns = 0;
    *unknown = false;
    kds_status rc = sess__list_sessions(st, txn, &ss, &ns, err);
    if (rc != KDS_OK) return rc;
    uint32_t last = p->r.keep_last > 1 ? p->r.keep_last : 1;
    for (size_t i = 0; i < ns && rc == KDS_OK; i++) {
        if (ss[i].tokens < 0) { /* unreadable: its head is unknown */
            *unknown = true;
            continue;
        }
        if (!idset_add(heads, ss[i].head) || !idset_add(keep, ss[i].head)) goto nomem;
        sess__hist *h = NULL;
        size_t n = 0;
        if ((rc = sess__history(st, txn, &ss[i], &h, &n, err)) != KDS_OK) break;
        for (size_t j = 0; j < n; j++) {
            bool kept = !(p->flags & SESS_PRUNE_HEADS_ONLY) &&
                        ((h[j].chain >= 0 && (uint32_t)h[j].chain < last) || h[j].fork_point ||
                         (p->r.keep_every && h[j].turn && h[j].turn % p->r.keep_every == 0));
            if (!idset_add(hist, h[j].id) || (kept && !idset_add(keep, h[j].id))) {
                free(h);
                goto nomem;
            }
        }
        free(h);
    }
    free(ss);
    idset_sort(heads);
    idset_sort(hist);
    idset_sort(keep);
    return rc;
nomem:
    free(ss);
    return kds_err_set(err, KDS_NOMEM, "out of memory planning gc");
}

/* Mark and sweep: snapshots the plan (or their age) keeps stay and mark
 * their chunks; the rest go, then unmarked chunks. `w` NULL: count only. */
static kds_status sweep(sess_store *st, MDB_txn *txn, sess__wtxn *w, prune_ctx *p, kds_err *err) {
    sess_gc_stats *g = p->g;
    memset(g, 0, sizeof *g);
    idset heads = {0}, hist = {0}, keep = {0}, used = {0}, alive = {0};
    bool unknown, keep_chunks = false;
    MDB_cursor *c = NULL;
    kds_status rc = plan(st, txn, p, &heads, &hist, &keep, &unknown, err);
    if (rc != KDS_OK) goto out;
    int64_t cutoff = p->r.keep_days ? p->now_us - (int64_t)p->r.keep_days * 86400 * 1000000 : 0;
    int m = mdb_cursor_open(txn, st->db_snap, &c);
    if (m) {
        rc = sess__mdb_err(m, "gc", err);
        goto out;
    }
    MDB_val k, v;
    for (m = mdb_cursor_get(c, &k, &v, MDB_FIRST); m == 0;
         m = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
        uint64_t id = k.mv_size == 8 ? sess__key64_get(k.mv_data) : 0;
        bool restore_point = idset_has(&hist, id) && !idset_has(&heads, id);
        sess__snap_hdr h;
        bool readable = sess__snap_parse(v.mv_data, v.mv_size, id, &h, NULL, NULL) == KDS_OK;
        /* with an unreadable session record any snapshot may be its head:
         * then none is deleted */
        bool kept =
            unknown || idset_has(&keep, id) || (cutoff && readable && h.created_us >= cutoff);
        if (!kept) {
            if (readable) sess__snap_hdr_free(&h);
            size_t bytes = v.mv_size;
            if (w) {
                if ((m = mdb_cursor_del(c, 0)) != 0) break;
                w->freed = true;
            }
            g->snapshots_freed++;
            g->restore_points_freed += restore_point;
            g->bytes_freed += bytes;
            continue;
        }
        g->snapshots_kept++;
        g->restore_points_kept += restore_point;
        if (!idset_add(&alive, id)) {
            if (readable) sess__snap_hdr_free(&h);
            rc = kds_err_set(err, KDS_NOMEM, "out of memory in gc");
            goto out;
        }
        if (!readable) { /* its chunks are unknown, so none may go */
            g->unreadable++;
            keep_chunks = true;
            continue;
        }
        bool ok = true;
        for (size_t i = 0; i < h.n_chunks && ok; i++)
            ok = idset_add(&used, h.chunks[i].id);
        sess__snap_hdr_free(&h);
        if (!ok) {
            rc = kds_err_set(err, KDS_NOMEM, "out of memory in gc");
            goto out;
        }
    }
    mdb_cursor_close(c);
    c = NULL;
    if (m != MDB_NOTFOUND) {
        rc = w ? sess__write_err(w, m, "gc", err) : sess__mdb_err(m, "gc", err);
        goto out;
    }
    idset_sort(&used);
    if ((m = mdb_cursor_open(txn, st->db_chunk, &c)) != 0) {
        rc = sess__mdb_err(m, "gc", err);
        goto out;
    }
    for (m = mdb_cursor_get(c, &k, &v, MDB_FIRST); m == 0;
         m = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
        uint64_t id = k.mv_size == 8 ? sess__key64_get(k.mv_data) : 0;
        if (keep_chunks || idset_has(&used, id)) {
            g->chunks_kept++;
            continue;
        }
        size_t bytes = v.mv_size;
        if (w) {
            if ((m = mdb_cursor_del(c, 0)) != 0) break;
            w->freed = true;
        }
        g->chunks_freed++;
        g->bytes_freed += bytes;
    }
    if (m != MDB_NOTFOUND) {
        rc = w ? sess__write_err(w, m, "gc", err) : sess__mdb_err(m, "gc", err);
        goto out;
    }
    mdb_cursor_close(c);
    c = NULL;
    /* the prefix index: entries of snapshots that are gone (freed now, or
     * earlier by a version that left them) would only be misses */
    if (!atomic_load(&st->has_prefix)) goto out;
    idset_sort(&alive);
    if ((m = mdb_cursor_open(txn, st->db_prefix, &c)) != 0) {
        rc = sess__mdb_err(m, "gc", err);
        goto out;
    }
    for (m = mdb_cursor_get(c, &k, &v, MDB_FIRST); m == 0;
         m = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
        sess_prefix_entry e;
        if (sess__prefix_parse(v.mv_data, v.mv_size, &e) && idset_has(&alive, e.snapshot)) {
            g->index_kept++;
            continue;
        }
        if (w) {
            if ((m = mdb_cursor_del(c, 0)) != 0) break;
            w->freed = true;
        }
        g->index_freed++;
        g->bytes_freed += v.mv_size;
    }
    if (m != MDB_NOTFOUND) rc = w ? sess__write_err(w, m, "gc", err) : sess__mdb_err(m, "gc", err);
out:
    if (c) mdb_cursor_close(c);
    free(heads.v);
    free(hist.v);
    free(keep.v);
    free(used.v);
    free(alive.v);
    return rc;
}

static kds_status prune_write_fn(sess__wtxn *w, void *ctx, kds_err *err) {
    return sweep(w->st, w->txn, w, ctx, err);
}

static kds_status prune_read_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    return sweep(st, txn, NULL, ctx, err);
}

kds_status sess_prune(sess_store *st, const sess_retention *r, unsigned flags, sess_gc_stats *out,
                      kds_err *err) {
    sess_gc_stats g;
    prune_ctx p = {.flags = flags, .now_us = (int64_t)sess__now_us(), .g = &g};
    if (r) {
        p.r = *r;
    } else {
        kds_status rc = sess_retention_get(st, &p.r, NULL, err);
        if (rc != KDS_OK) return rc;
    }
    kds_status rc = flags & SESS_PRUNE_DRY_RUN ? sess__read(st, prune_read_fn, &p, err)
                                               : sess__write(st, prune_write_fn, &p, err);
    if (out) *out = g;
    return rc;
}

kds_status sess_gc(sess_store *st, sess_gc_stats *out, kds_err *err) {
    sess_retention none = {0};
    return sess_prune(st, &none, SESS_PRUNE_HEADS_ONLY, out, err);
}

/* ------------------------------------------------------------------------ */
/* Uses of a snapshot                                                        */

typedef struct uses_ctx {
    uint64_t id;
    sess_snapshot_use *uses;
    size_t cap, n;
} uses_ctx;

static kds_status uses_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    uses_ctx *u = ctx;
    sess_session_info *ss = NULL;
    size_t ns = 0;
    kds_status rc = sess__list_sessions(st, txn, &ss, &ns, err);
    for (size_t i = 0; i < ns && rc == KDS_OK; i++) {
        if (ss[i].tokens < 0) continue;
        sess__hist *h = NULL;
        size_t n = 0;
        if ((rc = sess__history(st, txn, &ss[i], &h, &n, err)) != KDS_OK) break;
        for (size_t j = 0; j < n; j++) {
            if (h[j].id != u->id) continue;
            if (u->n < u->cap) {
                sess_snapshot_use *o = &u->uses[u->n];
                memset(o, 0, sizeof *o);
                snprintf(o->session, sizeof o->session, "%s", ss[i].name);
                o->head = ss[i].head == u->id;
                o->fork_point = h[j].fork_point;
                o->chain = h[j].chain;
                o->turn = h[j].turn;
                o->turns = ss[i].turns;
            }
            u->n++;
        }
        free(h);
    }
    free(ss);
    return rc;
}

kds_status sess_snapshot_uses(sess_store *st, uint64_t id, sess_snapshot_use *uses, size_t cap,
                              size_t *n, kds_err *err) {
    uses_ctx u = {.id = id, .uses = uses, .cap = uses ? cap : 0};
    kds_status rc = sess__read(st, uses_fn, &u, err);
    *n = u.n;
    return rc;
}
