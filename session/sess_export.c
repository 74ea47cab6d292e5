/*
 * sess_export.c - one portable file per session or snapshot: a KDSXPORT
 * frame whose header lists the records that follow (session, transcript
 * turns, snapshot, chunks), each byte-for-byte as stored with its own
 * checksums (docs/snapshot-format.md, "Export file"). Import checks every
 * record before writing anything and gives the records new ids.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sess_internal.h"

/* Records gathered for an export: pointers into the map, valid while the
 * read transaction lasts. */
typedef struct xpart {
    int type;
    const void *p;
    size_t n;
} xpart;

/* The records of one export, in file order. */
typedef struct xpart_list {
    xpart *v;
    size_t n, cap;
} xpart_list;

static kds_status add_part(xpart_list *l, int type, const void *p, size_t n, kds_err *err) {
    if (l->n == l->cap) {
        if (l->cap > SIZE_MAX / 2 / sizeof *l->v)
            return kds_err_set(err, KDS_NOMEM, "out of memory exporting");
        size_t cap = l->cap ? 2 * l->cap : 16;
        xpart *v = realloc(l->v, cap * sizeof *v);
        if (!v) return kds_err_set(err, KDS_NOMEM, "out of memory exporting");
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = (xpart){type, p, n};
    return KDS_OK;
}

typedef struct export_ctx {
    const char *source;
    const char *path;
} export_ctx;

static kds_status write_all(int fd, const void *p, size_t n, const char *path, kds_err *err) {
    const unsigned char *b = p;
    while (n) {
        ssize_t w = write(fd, b, n > ((size_t)1 << 30) ? (size_t)1 << 30 : n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return kds_err_set(err, KDS_IO, "writing %s: %s", path, strerror(errno));
        }
        b += w;
        n -= (size_t)w;
    }
    return KDS_OK;
}

static kds_status export_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    export_ctx *x = ctx;
    xpart_list parts = {0};
    sess__snap_hdr h = {0};
    sess__export_hdr eh = {0};
    unsigned char *head = NULL;
    char *tmp = NULL;
    int fd = -1;
    MDB_cursor *c = NULL;
    sess_ref ref;
    kds_status rc = KDS_OK;
    const void *v;
    size_t n;
    /* resolve inside this transaction, so the pieces are one consistent view */
    memset(&ref, 0, sizeof ref);
    uint64_t id;
    if (x->source[0] != '@' && sess_name_valid(x->source) &&
        sess__get(txn, st->db_sess, x->source, strlen(x->source), &v, &n, err) == KDS_OK) {
        sess_session_info s;
        char what[96];
        snprintf(what, sizeof what, "session '%s'", x->source);
        if ((rc = sess__session_parse(v, n, what, &s, err)) != KDS_OK) goto out;
        ref.is_session = true;
        ref.snapshot = s.head;
        if ((rc = add_part(&parts, SESS_XREC_SESSION, v, n, err)) != KDS_OK) goto out;
        unsigned char k0[12];
        sess__turn_key(k0, s.id, 0);
        int m = mdb_cursor_open(txn, st->db_turn, &c);
        if (m) {
            rc = sess__mdb_err(m, "exporting", err);
            goto out;
        }
        MDB_val k = {12, k0}, val;
        for (m = mdb_cursor_get(c, &k, &val, MDB_SET_RANGE); m == 0;
             m = mdb_cursor_get(c, &k, &val, MDB_NEXT)) {
            if (k.mv_size != 12 || memcmp(k.mv_data, k0, 8) != 0) break;
            if ((rc = add_part(&parts, SESS_XREC_TURN, val.mv_data, val.mv_size, err)) != KDS_OK)
                goto out;
        }
        mdb_cursor_close(c);
        c = NULL;
    } else if (sess_parse_snapshot_id(x->source, &id)) {
        ref.snapshot = id;
    } else {
        rc = kds_err_set(err, KDS_NOT_FOUND, "no session or snapshot '%s' in %s", x->source,
                         st->dir);
        goto out;
    }
    kds_err_clear(err);
    /* a damaged snapshot is refused here rather than carried elsewhere */
    if ((rc = sess__verify_in(st, txn, ref.snapshot, err)) != KDS_OK) goto out;
    unsigned char k[8];
    sess__key64(k, ref.snapshot);
    if ((rc = sess__get(txn, st->db_snap, k, 8, &v, &n, err)) != KDS_OK) goto out;
    if ((rc = sess__snap_parse(v, n, ref.snapshot, &h, NULL, err)) != KDS_OK) goto out;
    if ((rc = add_part(&parts, SESS_XREC_SNAPSHOT, v, n, err)) != KDS_OK) goto out;
    for (size_t i = 0; i < h.n_chunks; i++) {
        sess__key64(k, h.chunks[i].id);
        if ((rc = sess__get(txn, st->db_chunk, k, 8, &v, &n, err)) != KDS_OK) goto out;
        if ((rc = add_part(&parts, SESS_XREC_CHUNK, v, n, err)) != KDS_OK) goto out;
    }
    snprintf(eh.kind, sizeof eh.kind, "%s", ref.is_session ? "session" : "snapshot");
    snprintf(eh.source, sizeof eh.source, "%s", x->source);
    eh.created_us = (int64_t)sess__now_us();
    eh.n = parts.n;
    if (!(eh.recs = calloc(parts.n, sizeof *eh.recs))) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory exporting");
        goto out;
    }
    for (size_t i = 0; i < parts.n; i++)
        eh.recs[i] = (sess__xrec){parts.v[i].type, parts.v[i].n};
    size_t hl;
    if ((rc = sess__export_hdr_encode(&eh, &head, &hl, err)) != KDS_OK) goto out;
    /* temporary name in the same directory, synced, then renamed: a reader
     * never sees half a file under the final name */
    size_t pl = strlen(x->path);
    if (!(tmp = malloc(pl + 8))) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory exporting");
        goto out;
    }
    snprintf(tmp, pl + 8, "%s.XXXXXX", x->path);
    if ((fd = mkstemp(tmp)) < 0) {
        rc = kds_err_set(err, KDS_IO, "cannot create %s: %s", tmp, strerror(errno));
        goto out;
    }
    if ((rc = write_all(fd, head, hl, tmp, err)) != KDS_OK) goto out;
    for (size_t i = 0; i < parts.n; i++)
        if ((rc = write_all(fd, parts.v[i].p, parts.v[i].n, tmp, err)) != KDS_OK) goto out;
    if (fsync(fd) != 0) {
        rc = kds_err_set(err, KDS_IO, "syncing %s: %s", tmp, strerror(errno));
        goto out;
    }
    if (close(fd) != 0) {
        fd = -1;
        rc = kds_err_set(err, KDS_IO, "closing %s: %s", tmp, strerror(errno));
        goto out;
    }
    fd = -1;
    if (rename(tmp, x->path) != 0) {
        rc = kds_err_set(err, KDS_IO, "renaming %s to %s: %s", tmp, x->path, strerror(errno));
        goto out;
    }
    free(tmp);
    tmp = NULL;
out:
    if (c) mdb_cursor_close(c);
    if (fd >= 0) close(fd);
    if (tmp) {
        unlink(tmp);
        free(tmp);
    }
    free(head);
    free(parts.v);
    free(eh.recs);
    sess__snap_hdr_free(&h);
    return rc;
}

kds_status sess_export(sess_store *st, const char *source, const char *path, kds_err *err) {
    if (!source || !*source || !path || !*path)
        return kds_err_set(err, KDS_INVALID_ARG, "export needs a session or snapshot and a file");
    export_ctx x = {source, path};
    return sess__read(st, export_fn, &x, err);
}

/* ------------------------------------------------------------------------ */
/* Import                                                                    */

typedef struct import_ctx {
    const char *path;
    const char *name;          /* requested, or NULL */
    /* checked pieces of the file (pointers into its mapping) */
    const unsigned char *sess_rec;
    size_t sess_len;
    const unsigned char **turns;
    size_t *turn_len;
    size_t n_turns;
    const unsigned char *snap_rec;
    size_t snap_len;
    sess__snap_hdr h;
    sess__frame snap_frame;
    const unsigned char **chunks;
    size_t *chunk_len;
    size_t n_chunks;
    sess_session_info se;
    bool have_session;
    /* results */
    char out_name[SESS_NAME_MAX + 1];
    uint64_t out_snap;
} import_ctx;

/* Every record of the file is checked here, before any write. */
static kds_status import_check(import_ctx *I, const unsigned char *file, size_t size,
                               kds_err *err) {
    char what[64];
    snprintf(what, sizeof what, "export file");
    sess__frame f;
    kds_status rc =
        sess__frame_parse(file, size, SESS_MAGIC_EXPORT, SESS_VERSION_EXPORT, what, &f, err);
    if (rc != KDS_OK) return rc;
    sess__export_hdr eh;
    if ((rc = sess__export_hdr_decode(&f, what, &eh, err)) != KDS_OK) return rc;
    uint64_t total = 0;
    size_t n_snap = 0;
    for (size_t i = 0; i < eh.n; i++) {
        if (eh.recs[i].len > f.payload_len || total > f.payload_len - eh.recs[i].len) {
            rc = kds_err_set(err, KDS_CORRUPT, "export file: its records run past the end "
                             "(file truncated?)");
            goto out;
        }
        total += eh.recs[i].len;
        n_snap += eh.recs[i].type == SESS_XREC_SNAPSHOT;
    }
    if (total != f.payload_len || n_snap != 1) {
        rc = kds_err_set(err, KDS_CORRUPT, "export file: %zu trailing bytes or %zu snapshots "
                         "(expected one)", (size_t)(f.payload_len - total), n_snap);
        goto out;
    }
    I->turns = calloc(eh.n, sizeof *I->turns);
    I->turn_len = calloc(eh.n, sizeof *I->turn_len);
    I->chunks = calloc(eh.n, sizeof *I->chunks);
    I->chunk_len = calloc(eh.n, sizeof *I->chunk_len);
    if (!I->turns || !I->turn_len || !I->chunks || !I->chunk_len) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory importing");
        goto out;
    }
    /* order: [session, turns...], snapshot, chunks... */
    const unsigned char *p = f.payload;
    int stage = 0;
    for (size_t i = 0; i < eh.n; i++) {
        const unsigned char *r = p;
        size_t len = (size_t)eh.recs[i].len;
        p += len;
        int t = eh.recs[i].type;
        bool order_ok = (t == SESS_XREC_SESSION && stage == 0) ||
                        (t == SESS_XREC_TURN && stage == 1) ||
                        (t == SESS_XREC_SNAPSHOT && stage <= 1) ||
                        (t == SESS_XREC_CHUNK && stage == 2);
        if (!order_ok) {
            rc = kds_err_set(err, KDS_CORRUPT, "export file: record %zu is out of order", i);
            goto out;
        }
        char rw[64];
        if (t == SESS_XREC_SESSION) {
            stage = 1;
            snprintf(rw, sizeof rw, "export file: session record");
            if ((rc = sess__session_parse(r, len, rw, &I->se, err)) != KDS_OK) goto out;
            I->sess_rec = r;
            I->sess_len = len;
            I->have_session = true;
        } else if (t == SESS_XREC_TURN) {
            snprintf(rw, sizeof rw, "export file: turn %zu", I->n_turns + 1);
            sess__turn_hdr th;
            if ((rc = sess__turn_parse(r, len, rw, &th, err)) != KDS_OK) goto out;
            I->turns[I->n_turns] = r;
            I->turn_len[I->n_turns++] = len;
        } else if (t == SESS_XREC_SNAPSHOT) {
            stage = 2;
            snprintf(rw, sizeof rw, "export file: snapshot");
            if ((rc = sess__frame_parse(r, len, SESS_MAGIC_SNAPSHOT, SESS_VERSION_SNAPSHOT, rw,
                                        &I->snap_frame, err)) != KDS_OK ||
                (rc = sess__snap_hdr_decode(&I->snap_frame, rw, &I->h, err)) != KDS_OK)
                goto out;
            if ((rc = sess__check_payload(&I->snap_frame, I->h.payload_bytes, I->h.payload_xxh3,
                                          rw, err)) != KDS_OK ||
                (rc = sess__check_state_bytes(&I->snap_frame, &I->h, rw, err)) != KDS_OK)
                goto out;
            I->snap_rec = r;
            I->snap_len = len;
        } else {
            size_t ci = I->n_chunks;
            snprintf(rw, sizeof rw, "export file: chunk %zu", ci + 1);
            if (ci >= I->h.n_chunks) {
                rc = kds_err_set(err, KDS_CORRUPT, "%s: the snapshot references only %zu", rw,
                                 I->h.n_chunks);
                goto out;
            }
            sess__chunk_hdr ch;
            sess__frame cf;
            if ((rc = sess__chunk_parse(r, len, ci + 1, &ch, &cf, err)) != KDS_OK ||
                (rc = sess__check_payload(&cf, ch.payload_bytes, ch.payload_xxh3, rw, err)) !=
                    KDS_OK)
                goto out;
            if (ch.t0 != I->h.chunks[ci].t0 || ch.t1 != I->h.chunks[ci].t1 ||
                ch.token_bytes != I->h.layout.token_bytes) {
                rc = kds_err_set(err, KDS_CORRUPT, "%s: holds tokens [%lld, %lld), the snapshot "
                                 "expects [%lld, %lld)", rw, (long long)ch.t0, (long long)ch.t1,
                                 (long long)I->h.chunks[ci].t0, (long long)I->h.chunks[ci].t1);
                goto out;
            }
            I->chunks[ci] = r;
            I->chunk_len[ci] = len;
            I->n_chunks++;
        }
    }
    if (I->n_chunks != I->h.n_chunks) {
        rc = kds_err_set(err, KDS_CORRUPT, "export file: %zu of the snapshot's %zu chunks",
                         I->n_chunks, I->h.n_chunks);
        goto out;
    }
    if (I->have_session && strcmp(I->se.fingerprint, I->h.fingerprint) != 0) {
        rc = kds_err_set(err, KDS_CORRUPT, "export file: session and snapshot name different "
                         "models");
        goto out;
    }
out:
    free(eh.recs);
    return rc;
}

static kds_status import_fn(sess__wtxn *w, void *ctx, kds_err *err) {
    import_ctx *I = ctx;
    sess_store *st = w->st;
    unsigned char *head = NULL, *srec = NULL;
    sess__snap_hdr h = I->h; /* shallow: the chunk list is rewritten in a copy */
    h.chunks = NULL;
    kds_status rc;
    uint64_t snap_id;
    if ((rc = sess__new_id(w, &snap_id, err)) != KDS_OK) return rc;
    const char *name = I->name ? I->name : I->have_session ? I->se.name : NULL;
    if (name)
        snprintf(I->out_name, sizeof I->out_name, "%s", name);
    else
        snprintf(I->out_name, sizeof I->out_name, "import-%llu", (unsigned long long)snap_id);
    const void *v;
    size_t n;
    rc = sess__get(w->txn, st->db_sess, I->out_name, strlen(I->out_name), &v, &n, err);
    if (rc == KDS_OK)
        return kds_err_set(err, KDS_EXISTS, "session '%s' already exists (import with another "
                           "name)", I->out_name);
    if (rc != KDS_NOT_FOUND) return rc;
    if (h.n_chunks && !(h.chunks = calloc(h.n_chunks, sizeof *h.chunks))) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory importing");
        goto out;
    }
    for (size_t i = 0; i < h.n_chunks; i++) {
        h.chunks[i] = I->h.chunks[i];
        if ((rc = sess__new_id(w, &h.chunks[i].id, err)) != KDS_OK) goto out;
        unsigned char k[8];
        sess__key64(k, h.chunks[i].id);
        /* chunk records carry no ids: stored exactly as exported */
        if ((rc = sess__put(w, st->db_chunk, k, 8, I->chunks[i], I->chunk_len[i],
                            MDB_NOOVERWRITE, err)) != KDS_OK)
            goto out;
    }
    /* The snapshot's header names the exporting store's ids: rewrite it
     * with the new chunk ids and no parent; the payload is copied as is. */
    h.parent = 0;
    h.n_new_chunks = (uint32_t)h.n_chunks;
    h.origin[0] = '\0';
    size_t hl;
    if ((rc = sess__snap_hdr_encode(&h, &head, &hl, err)) != KDS_OK) goto out;
    unsigned char k[8];
    sess__key64(k, snap_id);
    void *space;
    if ((rc = sess__reserve(w, st->db_snap, k, 8, hl + I->snap_frame.payload_len, &space, err)) !=
        KDS_OK)
        goto out;
    memcpy(space, head, hl);
    memcpy((unsigned char *)space + hl, I->snap_frame.payload, I->snap_frame.payload_len);
    sess_session_info se;
    if (I->have_session) {
        se = I->se;
        se.parent[0] = '\0'; /* that session is in another store */
        se.fork_point = 0;
    } else {
        memset(&se, 0, sizeof se);
        se.created_us = (int64_t)sess__now_us();
        sess__owner(se.owner, sizeof se.owner);
        snprintf(se.fingerprint, sizeof se.fingerprint, "%s", h.fingerprint);
    }
    snprintf(se.name, sizeof se.name, "%s", I->out_name);
    if ((rc = sess__new_id(w, &se.id, err)) != KDS_OK) goto out;
    se.head = snap_id;
    se.tokens = h.tokens;
    se.updated_us = (int64_t)sess__now_us();
    se.turns = (uint32_t)I->n_turns;
    size_t sl;
    if ((rc = sess__session_encode(&se, &srec, &sl, err)) != KDS_OK) goto out;
    if ((rc = sess__put(w, st->db_sess, se.name, strlen(se.name), srec, sl, MDB_NOOVERWRITE,
                        err)) != KDS_OK)
        goto out;
    for (size_t i = 0; i < I->n_turns; i++) {
        unsigned char tk[12];
        sess__turn_key(tk, se.id, (uint32_t)i);
        if ((rc = sess__put(w, st->db_turn, tk, 12, I->turns[i], I->turn_len[i], 0, err)) !=
            KDS_OK)
            goto out;
    }
    I->out_snap = snap_id;
out:
    free(head);
    free(srec);
    free(h.chunks);
    return rc;
}

kds_status sess_import(sess_store *st, const char *path, const char *name,
                       char out_name[SESS_NAME_MAX + 1], uint64_t *snapshot, kds_err *err) {
    if (name && !sess_name_valid(name))
        return kds_err_set(err, KDS_INVALID_ARG, "invalid session name '%s'", name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kds_err_set(err, errno == ENOENT ? KDS_NOT_FOUND : KDS_IO, "%s: %s", path,
                                   strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size < (off_t)SESS_FRAME_BYTES) {
        close(fd);
        return kds_err_set(err, KDS_BAD_FORMAT, "%s: not a kdaserve export file (too short)",
                           path);
    }
    size_t size = (size_t)sb.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return kds_err_set(err, KDS_IO, "%s: %s", path, strerror(errno));
    import_ctx I = {.path = path, .name = name};
    kds_status rc = import_check(&I, map, size, err);
    if (rc != KDS_OK) {
        kds_err_prefix(err, "%s", path);
        goto out;
    }
    if ((rc = sess__write(st, import_fn, &I, err)) != KDS_OK) goto out;
    if (out_name) memcpy(out_name, I.out_name, sizeof I.out_name);
    if (snapshot) *snapshot = I.out_snap;
out:
    munmap(map, size);
    free(I.turns);
    free(I.turn_len);
    free(I.chunks);
    free(I.chunk_len);
    sess__snap_hdr_free(&I.h);
    return rc;
}
