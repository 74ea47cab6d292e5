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

kds_status sess__history(sess_store *st, MDB_txn *txn, const sess_session_info *s,
                         sess__hist **out, size_t *n, kds_err *err) {
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
    rc = kds_err_set(err, KDS_NOMEM, "out of memory reading the history of session '%s'",
                     s->name);
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
        if (sess__turn_parse(turns[*keep].val, turns[*keep].len, "turn", &t, NULL) != KDS_OK)
            break;
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
        rc = kds_err_set(err, KDS_INVALID_ARG, "session '%s' is sound (its head @%llu "
                         "verifies): nothing to recover", g->name, (unsigned long long)s.head);
        goto out;
    }
    if (!o->to) {
        rc = kds_err_set(err, KDS_NOT_FOUND, "no snapshot of session '%s''s history verifies: "
                         "nothing to go back to (its transcript is intact: `kdaserve snap show "
                         "%s`)", g->name, g->name);
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
