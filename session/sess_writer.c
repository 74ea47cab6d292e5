/*
 * sess_writer.c - who has a session open for writing: advisory claims, one
 * KDSWRITR record per writing process under meta "writer/<session>/<host>/
 * <pid>" (docs/snapshot-format.md, "Writer"). Front ends claim a session
 * when they take it up and release it when they leave it, so that a second
 * writer is told at once; saves never wait for a claim (a turn that finds
 * the head moved is saved as a fork, SESS_CONFLICT_FORK). A claim left by
 * a process that died is recognised (same host: the pid is gone, or now
 * belongs to a process that started at another time) and dropped.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "sess_internal.h"

#define PREFIX "writer/"

/* Start time of process `pid` in clock ticks after boot (field 22 of
 * /proc/PID/stat), 0 when unknown. */
static uint64_t proc_start(int64_t pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and ')' */
    if (!p) return 0;
    p++;
    /* fields 3.. follow: starttime is the 20th of them */
    for (int field = 3; field < 22; field++) {
        p = strchr(p + 1, ' ');
        if (!p) return 0;
    }
    return strtoull(p + 1, NULL, 10);
}

static void host_name(char *buf, size_t cap) {
    if (gethostname(buf, cap) != 0) snprintf(buf, cap, "?");
    buf[cap - 1] = '\0';
}

/* Whether the writer of a record still runs. Another host's cannot be
 * checked from here: taken as running. */
static bool alive(const sess_writer *w, uint64_t start, const char *host) {
    if (strcmp(w->host, host) != 0) return true;
    if (w->pid <= 0) return false;
    if (kill((pid_t)w->pid, 0) != 0 && errno != EPERM) return false;
    uint64_t now = proc_start(w->pid);
    return !start || !now || now == start;
}

typedef struct claim_ctx {
    const char *name;
    const char *program; /* NULL: release */
    char host[64];
    bool busy;
    sess_writer other;
} claim_ctx;

static bool has_prefix(const MDB_val *k, const char *p, size_t n) {
    return k->mv_size >= n && memcmp(k->mv_data, p, n) == 0;
}

/* Walk the claims on c->name: drop the dead (when `w`), note the earliest
 * live one of another process, and say whether this process has one. */
static kds_status scan(sess_store *st, MDB_txn *txn, sess__wtxn *w, claim_ctx *c, bool *mine,
                       kds_err *err) {
    char pre[SESS_NAME_MAX + 16];
    int pn = snprintf(pre, sizeof pre, PREFIX "%s/", c->name);
    MDB_cursor *cur;
    int m = mdb_cursor_open(txn, st->db_meta, &cur);
    if (m) return sess__mdb_err(m, "reading writers", err);
    MDB_val k = {(size_t)pn, pre}, v;
    *mine = false;
    c->busy = false;
    int64_t me = (int64_t)getpid();
    for (m = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE); m == 0 && has_prefix(&k, pre, pn);
         m = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        sess_writer wr;
        uint64_t start;
        char what[96];
        snprintf(what, sizeof what, "writer record of session '%s'", c->name);
        bool readable = sess__writer_parse(v.mv_data, v.mv_size, what, &wr, &start, NULL) == KDS_OK;
        if (readable && wr.pid == me && !strcmp(wr.host, c->host)) {
            *mine = true;
            continue;
        }
        if (!readable || !alive(&wr, start, c->host)) {
            if (w && (m = mdb_cursor_del(cur, 0)) != 0) break;
            continue;
        }
        if (!c->busy || wr.since_us < c->other.since_us) c->other = wr;
        c->busy = true;
    }
    mdb_cursor_close(cur);
    if (m != 0 && m != MDB_NOTFOUND) {
        if (w) return sess__write_err(w, m, "updating writers", err);
        return sess__mdb_err(m, "reading writers", err);
    }
    return KDS_OK;
}

static void own_key(const claim_ctx *c, char *key, size_t cap, size_t *len) {
    int n = snprintf(key, cap, PREFIX "%s/%s/%lld", c->name, c->host, (long long)getpid());
    *len = n < 0 ? 0 : (size_t)n < cap ? (size_t)n : cap - 1;
}

static kds_status claim_fn(sess__wtxn *w, void *ctx, kds_err *err) {
    claim_ctx *c = ctx;
    bool mine;
    kds_status rc = scan(w->st, w->txn, w, c, &mine, err);
    if (rc != KDS_OK) return rc;
    char key[SESS_NAME_MAX + 128];
    size_t kl;
    own_key(c, key, sizeof key, &kl);
    if (!c->program) { /* release: a plain delete, no free-space commit after it */
        MDB_val k = {kl, key};
        int m = mdb_del(w->txn, w->st->db_meta, &k, NULL);
        return m == 0 || m == MDB_NOTFOUND ? KDS_OK : sess__write_err(w, m, "releasing", err);
    }
    if (mine) return KDS_OK;
    sess_writer me = {.pid = (int64_t)getpid(), .since_us = (int64_t)sess__now_us()};
    snprintf(me.host, sizeof me.host, "%s", c->host);
    snprintf(me.program, sizeof me.program, "%s", c->program);
    unsigned char *rec = NULL;
    size_t len;
    if ((rc = sess__writer_encode(&me, proc_start(me.pid), &rec, &len, err)) != KDS_OK) return rc;
    rc = sess__put(w, w->st->db_meta, key, kl, rec, len, 0, err);
    free(rec);
    return rc;
}

static kds_status report_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    bool mine;
    return scan(st, txn, NULL, ctx, &mine, err);
}

kds_status sess_writer_claim(sess_store *st, const char *name, const char *program,
                             sess_writer *other, bool *busy, kds_err *err) {
    if (busy) *busy = false;
    if (!sess_name_valid(name))
        return kds_err_set(err, KDS_INVALID_ARG, "invalid session name '%s'", name ? name : "");
    claim_ctx c = {.name = name, .program = program && *program ? program : "kdaserve"};
    host_name(c.host, sizeof c.host);
    kds_status rc =
        st->read_only ? sess__read(st, report_fn, &c, err) : sess__write(st, claim_fn, &c, err);
    if (rc != KDS_OK) return rc;
    if (busy) *busy = c.busy;
    if (other && c.busy) *other = c.other;
    return KDS_OK;
}

kds_status sess_writer_release(sess_store *st, const char *name, kds_err *err) {
    if (!sess_name_valid(name))
        return kds_err_set(err, KDS_INVALID_ARG, "invalid session name '%s'", name ? name : "");
    if (st->read_only) return KDS_OK;
    claim_ctx c = {.name = name, .program = NULL};
    host_name(c.host, sizeof c.host);
    return sess__write(st, claim_fn, &c, err);
}

void sess_writer_describe(const sess_writer *w, char *buf, size_t cap) {
    char host[64], when[32] = "?";
    host_name(host, sizeof host);
    time_t t = (time_t)(w->since_us / 1000000);
    struct tm tm;
    if (w->since_us > 0 && localtime_r(&t, &tm)) strftime(when, sizeof when, "%H:%M:%S", &tm);
    snprintf(buf, cap, "pid %lld%s%s (kdaserve %s, since %s)", (long long)w->pid,
             strcmp(w->host, host) ? " on " : "", strcmp(w->host, host) ? w->host : "", w->program,
             when);
}
