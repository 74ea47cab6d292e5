/*
 * sess_store.c - the LMDB environment behind a data directory: opening it
 * (named databases, store format check, stale readers), transactions with
 * map growth on MDB_MAP_FULL, the id counter, and small helpers.
 *
 * Databases (docs/snapshot-format.md, "Store"):
 *   meta         "store" -> KDSSTORE record; "next_id" -> u64 LE counter
 *   snapshots    u64 BE id -> KDSSNAP record
 *   chunks       u64 BE id -> KDSCHUNK record
 *   sessions     name -> KDSSESS record
 *   transcripts  u64 BE session id + u32 BE turn -> KDSTURN record
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <msgpack.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "sess_internal.h"

#define DEFAULT_MAP ((size_t)1 << 30)
#define DEFAULT_MAP_MAX ((size_t)1 << 40)
#define MIN_MAP ((size_t)64 << 10)

sess_params sess_default_params(void) {
    sess_params p = {.map_size = 0, .map_max = 0, .no_sync = false, .read_only = false};
    return p;
}

kds_status sess__mdb_err(int rc, const char *what, kds_err *err) {
    kds_status s = rc == MDB_MAP_FULL        ? KDS_TOO_LARGE
                   : rc == ENOMEM            ? KDS_NOMEM
                   : rc == MDB_NOTFOUND      ? KDS_NOT_FOUND
                   : rc == MDB_CORRUPTED || rc == MDB_PAGE_NOTFOUND ? KDS_CORRUPT
                   : rc == MDB_VERSION_MISMATCH || rc == MDB_INVALID ? KDS_UNSUPPORTED
                   : rc == EACCES || rc == EROFS ? KDS_UNSUPPORTED
                                             : KDS_IO;
    return kds_err_set(err, s, "%s: %s", what, mdb_strerror(rc));
}

static void human_bytes(uint64_t b, char *buf, size_t cap) {
    const char *u[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int i = 0;
    while (v >= 1024 && i < 4) v /= 1024, i++;
    if (i)
        snprintf(buf, cap, "%.1f %s", v, u[i]);
    else
        snprintf(buf, cap, "%llu bytes", (unsigned long long)b);
}

/* The directory the filesystem holding `dir` is mounted on: the highest
 * ancestor of its real path on the same device. */
static void mount_point(const char *dir, char *out, size_t cap) {
    char p[PATH_MAX];
    struct stat d, a;
    if (!realpath(dir, p) || stat(p, &d) != 0) {
        snprintf(out, cap, "%s", dir);
        return;
    }
    for (;;) {
        char *slash = strrchr(p, '/');
        if (!slash || slash == p) {
            /* parent is "/" */
            if (stat("/", &a) == 0 && a.st_dev == d.st_dev) snprintf(p, sizeof p, "/");
            break;
        }
        *slash = '\0';
        if (stat(p, &a) != 0 || a.st_dev != d.st_dev) {
            *slash = '/';
            break;
        }
    }
    snprintf(out, cap, "%s", p);
}

kds_status sess__write_err(sess__wtxn *w, int rc, const char *what, kds_err *err) {
    if (rc == MDB_MAP_FULL) w->map_full = true;
    if (rc != ENOSPC && rc != EDQUOT && rc != EIO && rc != EFBIG)
        return sess__mdb_err(rc, what, err);
    const char *dir = w->st->dir;
    if (rc == EFBIG)
        return kds_err_set(err, KDS_IO, "%s: %s/data.mdb reached the largest file this process "
                           "may write (ulimit -f); nothing was saved", what, dir);
    struct statvfs vf;
    bool known = statvfs(dir, &vf) == 0;
    uint64_t avail = known ? (uint64_t)vf.f_bavail * vf.f_frsize : 0;
    uint64_t total = known ? (uint64_t)vf.f_blocks * vf.f_frsize : 0;
    char mnt[PATH_MAX], a[32], t[32];
    mount_point(dir, mnt, sizeof mnt);
    human_bytes(avail, a, sizeof a);
    human_bytes(total, t, sizeof t);
    /* LMDB turns a short write into EIO ("filesystem full?"): with less room
     * left than this transaction writes, that is what it was. */
    bool full = rc != EIO || (known && avail < w->bytes + ((uint64_t)4 << 20));
    if (!full)
        return kds_err_set(err, KDS_IO, "%s: input/output error writing %s/data.mdb (the "
                           "filesystem on %s has %s free): check the disk", what, dir, mnt, a);
    w->disk_full = true;
    return kds_err_set(err, KDS_IO, "the disk is full%s: the filesystem on %s, which holds store "
                       "%s, has %s free of %s; nothing was written. Free space there (or delete "
                       "sessions with `kdaserve snap rm` and run `kdaserve snap gc`) and save "
                       "again", rc == EDQUOT ? " (disk quota)" : "", mnt, dir, a, t);
}

void sess__key64(unsigned char k[8], uint64_t id) {
    for (int i = 0; i < 8; i++) k[i] = (unsigned char)(id >> (56 - 8 * i));
}

uint64_t sess__key64_get(const unsigned char k[8]) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = (v << 8) | k[i];
    return v;
}

void sess__turn_key(unsigned char k[12], uint64_t session_id, uint32_t turn) {
    sess__key64(k, session_id);
    for (int i = 0; i < 4; i++) k[8 + i] = (unsigned char)(turn >> (24 - 8 * i));
}

bool sess_name_valid(const char *name) {
    if (!name) return false;
    size_t n = strlen(name);
    if (n == 0 || n > SESS_NAME_MAX) return false;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        bool alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
        if (!alnum && (i == 0 || (c != '.' && c != '_' && c != '-'))) return false;
    }
    return true;
}

bool sess_parse_snapshot_id(const char *text, uint64_t *id) {
    if (!text) return false;
    if (*text == '@') text++;
    if (!*text || strlen(text) > 19) return false;
    uint64_t v = 0;
    for (const char *p = text; *p; p++) {
        if (*p < '0' || *p > '9') return false;
        v = v * 10 + (uint64_t)(*p - '0');
    }
    if (v == 0) return false;
    *id = v;
    return true;
}

void sess__owner(char *buf, size_t cap) {
    struct passwd pw, *res = NULL;
    char tmp[1024];
    if (getpwuid_r(geteuid(), &pw, tmp, sizeof tmp, &res) == 0 && res && res->pw_name &&
        strlen(res->pw_name) < cap) {
        snprintf(buf, cap, "%s", res->pw_name);
        return;
    }
    const char *u = getenv("USER");
    if (u && *u && strlen(u) < cap)
        snprintf(buf, cap, "%s", u);
    else
        snprintf(buf, cap, "uid %u", (unsigned)geteuid());
}

kds_status sess_default_dir(char *buf, size_t cap, kds_err *err) {
    const char *xdg = getenv("XDG_DATA_HOME");
    int n;
    if (xdg && *xdg == '/') {
        n = snprintf(buf, cap, "%s/kdaserve", xdg);
    } else {
        const char *home = getenv("HOME");
        if (!home || !*home)
            return kds_err_set(err, KDS_NOT_FOUND,
                               "no data directory: set XDG_DATA_HOME or HOME, or pass --db DIR");
        n = snprintf(buf, cap, "%s/.local/share/kdaserve", home);
    }
    if (n < 0 || (size_t)n >= cap)
        return kds_err_set(err, KDS_TOO_LARGE, "data directory path is too long");
    return KDS_OK;
}

/* mkdir -p with mode 0700 for the parts it creates. */
static kds_status make_dirs(const char *path, kds_err *err) {
    char *p = strdup(path);
    if (!p) return kds_err_set(err, KDS_NOMEM, "out of memory");
    kds_status rc = KDS_OK;
    for (char *s = p + 1;; s++) {
        if (*s == '/' || *s == '\0') {
            char c = *s;
            *s = '\0';
            if (mkdir(p, 0700) != 0 && errno != EEXIST) {
                rc = kds_err_set(err, KDS_IO, "cannot create directory %s: %s", p,
                                 strerror(errno));
                break;
            }
            *s = c;
            if (!c) break;
        }
    }
    free(p);
    if (rc != KDS_OK) return rc;
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
        return kds_err_set(err, KDS_IO, "%s is not a directory", path);
    return KDS_OK;
}

/* ------------------------------------------------------------------------ */
/* Transactions                                                              */

/* Begin a transaction with this process's shared lock held. A map grown by
 * another process shows up as MDB_MAP_RESIZED: adopt the new size (which
 * needs the exclusive lock, as any remap) and try again. */
static kds_status txn_begin(sess_store *st, bool write, MDB_txn **txn, kds_err *err) {
    for (int tries = 0;; tries++) {
        pthread_rwlock_rdlock(&st->lock);
        int rc = mdb_txn_begin(st->env, NULL, write ? 0 : MDB_RDONLY, txn);
        if (rc == 0) return KDS_OK;
        pthread_rwlock_unlock(&st->lock);
        if (rc != MDB_MAP_RESIZED || tries > 8)
            return sess__mdb_err(rc, write ? "beginning a write" : "beginning a read", err);
        pthread_rwlock_wrlock(&st->lock);
        rc = mdb_env_set_mapsize(st->env, 0);
        pthread_rwlock_unlock(&st->lock);
        if (rc) return sess__mdb_err(rc, "adopting the grown map size", err);
    }
}

/* Double the map (no transaction of this process may be open: the caller
 * has ended its own and the exclusive lock waits out everyone else's). */
static kds_status grow_map(sess_store *st, kds_err *err) {
    pthread_rwlock_wrlock(&st->lock);
    MDB_envinfo info;
    mdb_env_info(st->env, &info);
    size_t cur = info.me_mapsize;
    kds_status rc = KDS_OK;
    if (cur >= st->map_max) {
        rc = kds_err_set(err, KDS_TOO_LARGE, "the store is full: its map reached the limit of "
                         "%zu bytes", st->map_max);
    } else {
        size_t next = cur > st->map_max / 2 ? st->map_max : cur * 2;
        int m = mdb_env_set_mapsize(st->env, next);
        if (m) rc = sess__mdb_err(m, "growing the map", err);
    }
    pthread_rwlock_unlock(&st->lock);
    return rc;
}

static kds_status load_counter(sess__wtxn *w, kds_err *err) {
    const void *v;
    size_t n;
    kds_status rc = sess__get(w->txn, w->st->db_meta, "next_id", 7, &v, &n, err);
    if (rc == KDS_NOT_FOUND) {
        w->next_id = 1;
    } else if (rc != KDS_OK) {
        return rc;
    } else if (n != 8) {
        return kds_err_set(err, KDS_CORRUPT, "store meta 'next_id' has %zu bytes, expected 8", n);
    } else {
        const unsigned char *p = v;
        uint64_t x = 0;
        for (int i = 7; i >= 0; i--) x = (x << 8) | p[i];
        w->next_id = x;
    }
    w->id_loaded = true;
    return KDS_OK;
}

kds_status sess__new_id(sess__wtxn *w, uint64_t *id, kds_err *err) {
    if (!w->id_loaded) {
        kds_status rc = load_counter(w, err);
        if (rc != KDS_OK) return rc;
    }
    *id = w->next_id++;
    return KDS_OK;
}

/* A commit that changes nothing but the id counter's page: it makes what
 * the transactions before it freed reusable by the next one (LMDB reuses
 * pages freed by transaction T only from T + 2 on, and a failed write does
 * not advance the transaction id, so without it a store whose deletes
 * freed space would keep failing saves for want of it). */
static kds_status touch_fn(sess__wtxn *w, void *ctx, kds_err *err) {
    (void)ctx;
    return load_counter(w, err);
}

static kds_status write_once(sess_store *st, sess__write_fn fn, void *ctx, sess__wtxn *w,
                             kds_err *err) {
    kds_status rc = txn_begin(st, true, &w->txn, err);
    if (rc != KDS_OK) return rc;
    rc = fn(w, ctx, err);
    if (rc == KDS_OK && w->id_loaded) {
        unsigned char v[8];
        for (int i = 0; i < 8; i++) v[i] = (unsigned char)(w->next_id >> (8 * i));
        rc = sess__put(w, st->db_meta, "next_id", 7, v, 8, 0, err);
    }
    if (rc == KDS_OK) {
        int mrc = mdb_txn_commit(w->txn);
        if (mrc) rc = sess__write_err(w, mrc, "committing", err);
    } else {
        mdb_txn_abort(w->txn);
    }
    pthread_rwlock_unlock(&st->lock);
    return rc;
}

kds_status sess__write(sess_store *st, sess__write_fn fn, void *ctx, kds_err *err) {
    if (st->read_only)
        return kds_err_set(err, KDS_UNSUPPORTED, "store %s is open read-only", st->dir);
    bool retried = false;
    for (;;) {
        sess__wtxn w = {.st = st};
        kds_status rc = write_once(st, fn, ctx, &w, err);
        if (rc == KDS_OK && w.freed && fn != touch_fn) {
            sess__wtxn t = {.st = st};
            (void)write_once(st, touch_fn, NULL, &t, NULL); /* best effort */
        }
        if (w.disk_full && !retried && fn != touch_fn) {
            /* Space freed since (by this process or another) may only be
             * waiting for a later commit: make one and try once more. */
            retried = true;
            sess__wtxn t = {.st = st};
            if (write_once(st, touch_fn, NULL, &t, NULL) == KDS_OK) {
                kds_err_clear(err);
                continue;
            }
        }
        if (!w.map_full) return rc;
        /* The aborted transaction wrote nothing; redo it in a larger map. */
        kds_err_clear(err);
        if ((rc = grow_map(st, err)) != KDS_OK) return rc;
    }
}

kds_status sess__read(sess_store *st, sess__read_fn fn, void *ctx, kds_err *err) {
    MDB_txn *txn;
    kds_status rc = txn_begin(st, false, &txn, err);
    if (rc != KDS_OK) return rc;
    rc = fn(st, txn, ctx, err);
    mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    return rc;
}

static kds_status put_result(sess__wtxn *w, int rc, kds_err *err) {
    if (rc == 0) return KDS_OK;
    if (rc == MDB_KEYEXIST) return kds_err_set(err, KDS_EXISTS, "record already exists");
    return sess__write_err(w, rc, "writing", err);
}

kds_status sess__put(sess__wtxn *w, MDB_dbi dbi, const void *key, size_t key_len,
                     const void *val, size_t val_len, unsigned flags, kds_err *err) {
    MDB_val k = {key_len, (void *)key}, v = {val_len, (void *)val};
    w->bytes += val_len;
    return put_result(w, mdb_put(w->txn, dbi, &k, &v, flags), err);
}

kds_status sess__reserve(sess__wtxn *w, MDB_dbi dbi, const void *key, size_t key_len,
                         size_t val_len, void **space, kds_err *err) {
    MDB_val k = {key_len, (void *)key}, v = {val_len, NULL};
    w->bytes += val_len;
    kds_status rc = put_result(w, mdb_put(w->txn, dbi, &k, &v, MDB_RESERVE | MDB_NOOVERWRITE),
                               err);
    *space = rc == KDS_OK ? v.mv_data : NULL;
    return rc;
}

kds_status sess__del(sess__wtxn *w, MDB_dbi dbi, const void *key, size_t key_len, kds_err *err) {
    MDB_val k = {key_len, (void *)key};
    int rc = mdb_del(w->txn, dbi, &k, NULL);
    if (rc == MDB_NOTFOUND) return KDS_NOT_FOUND;
    if (rc == 0) w->freed = true;
    return put_result(w, rc, err);
}

kds_status sess__get(MDB_txn *txn, MDB_dbi dbi, const void *key, size_t key_len,
                     const void **val, size_t *val_len, kds_err *err) {
    *val = NULL;
    *val_len = 0;
    MDB_val k = {key_len, (void *)key}, v;
    int rc = mdb_get(txn, dbi, &k, &v);
    if (rc == MDB_NOTFOUND) return KDS_NOT_FOUND;
    if (rc) return sess__mdb_err(rc, "reading", err);
    *val = v.mv_data;
    *val_len = v.mv_size;
    return KDS_OK;
}

/* ------------------------------------------------------------------------ */
/* Open / close                                                              */

/* LMDB maps data.mdb and reads pages straight from the map, so a file cut
 * short (a copy that stopped, a disk that filled during a backup) would
 * raise SIGBUS at the first page past its end, in whatever command touched
 * it first. Its meta pages (the first two, read with pread by
 * mdb_env_open) record the last page in use: a sound file always reaches
 * past it. Checked before any transaction touches a page. */
static kds_status check_data_file(sess_store *st, kds_err *err) {
    MDB_envinfo info;
    MDB_stat ms;
    int fd;
    struct stat sb;
    if (mdb_env_info(st->env, &info) || mdb_env_stat(st->env, &ms) ||
        mdb_env_get_fd(st->env, &fd) || fstat(fd, &sb) != 0)
        return kds_err_set(err, KDS_IO, "store %s: cannot read the size of data.mdb: %s",
                           st->dir, strerror(errno));
    uint64_t need = ((uint64_t)info.me_last_pgno + 1) * ms.ms_psize;
    if ((uint64_t)sb.st_size < need)
        return kds_err_set(err, KDS_CORRUPT,
                           "store %s: data.mdb is truncated: %lld bytes, but its pages in use "
                           "reach %llu bytes (page %zu of %u bytes); nothing was read from it: "
                           "restore the file from a backup",
                           st->dir, (long long)sb.st_size, (unsigned long long)need,
                           (size_t)info.me_last_pgno, ms.ms_psize);
    return KDS_OK;
}

/* lock.mdb's lock region has no magic: sess_compact cleared it (see
 * sess_compact.c). Read with a descriptor of its own: this process holds no
 * lock on the file here (its environment is closed), so closing the
 * descriptor drops none. */
static bool lock_reset(const char *dir) {
    char path[1100];
    unsigned char b[4];
    snprintf(path, sizeof path, "%s/lock.mdb", dir);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    bool zero = pread(fd, b, 4, 0) == 4 && !b[0] && !b[1] && !b[2] && !b[3];
    close(fd);
    return zero;
}

/* mdb_env_open refused the data file: shorter than its two meta pages is a
 * truncated store, not "not an LMDB file". */
static kds_status open_refused(const char *dir, int m, kds_err *err) {
    char path[1100];
    struct stat sb;
    snprintf(path, sizeof path, "%s/data.mdb", dir);
    long page = sysconf(_SC_PAGESIZE);
    if (m == MDB_INVALID && stat(path, &sb) == 0 && sb.st_size > 0 &&
        sb.st_size < 2 * (page > 0 ? page : 4096))
        return kds_err_set(err, KDS_CORRUPT,
                           "store %s: data.mdb is truncated: %lld bytes, less than LMDB's two "
                           "meta pages; restore the file from a backup",
                           dir, (long long)sb.st_size);
    kds_status rc = sess__mdb_err(m, "opening", err);
    kds_err_prefix(err, "store %s", dir);
    return rc;
}

/* Store record: written once when the store is created; a later build that
 * changes the store's layout bumps SESS_VERSION_STORE, and this build then
 * refuses the store instead of misreading it. */
static kds_status check_store_record(sess__wtxn *w, void *ctx, kds_err *err) {
    (void)ctx;
    const void *v;
    size_t n;
    kds_status rc = sess__get(w->txn, w->st->db_meta, "store", 5, &v, &n, err);
    if (rc == KDS_OK) {
        char what[1100];
        snprintf(what, sizeof what, "store %s", w->st->dir);
        sess__frame f;
        return sess__frame_parse(v, n, SESS_MAGIC_STORE, SESS_VERSION_STORE, what, &f, err);
    }
    if (rc != KDS_NOT_FOUND) return rc;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 2);
    msgpack_pack_str_with_body(&pk, "created_us", 10);
    msgpack_pack_uint64(&pk, sess__now_us());
    msgpack_pack_str_with_body(&pk, "writer", 6);
    msgpack_pack_str_with_body(&pk, "kdaserve 0.1.0", 14);
    unsigned char *rec = malloc(SESS_FRAME_BYTES + sb.size);
    if (!rec) {
        msgpack_sbuffer_destroy(&sb);
        return kds_err_set(err, KDS_NOMEM, "out of memory");
    }
    memcpy(rec + SESS_FRAME_BYTES, sb.data, sb.size);
    sess__frame_write(rec, SESS_MAGIC_STORE, SESS_VERSION_STORE, sb.size);
    rc = sess__put(w, w->st->db_meta, "store", 5, rec, SESS_FRAME_BYTES + sb.size,
                   MDB_NOOVERWRITE, err);
    free(rec);
    msgpack_sbuffer_destroy(&sb);
    return rc;
}

static kds_status read_store_record(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    (void)ctx;
    const void *v;
    size_t n;
    kds_status rc = sess__get(txn, st->db_meta, "store", 5, &v, &n, err);
    if (rc == KDS_NOT_FOUND)
        return kds_err_set(err, KDS_NOT_FOUND, "%s holds no kdaserve store", st->dir);
    if (rc != KDS_OK) return rc;
    char what[1100];
    snprintf(what, sizeof what, "store %s", st->dir);
    sess__frame f;
    return sess__frame_parse(v, n, SESS_MAGIC_STORE, SESS_VERSION_STORE, what, &f, err);
}

/* Open the five named databases; with create in a write transaction that
 * makes missing ones. KDS_NOT_FOUND (no message) when one is missing. */
static kds_status open_dbs(sess_store *st, bool create, kds_err *err) {
    MDB_txn *txn;
    int m = mdb_txn_begin(st->env, NULL, create ? 0 : MDB_RDONLY, &txn);
    if (m) return sess__mdb_err(m, "opening", err);
    struct {
        const char *name;
        MDB_dbi *dbi;
    } dbs[] = {{"meta", &st->db_meta},    {"snapshots", &st->db_snap}, {"chunks", &st->db_chunk},
               {"sessions", &st->db_sess}, {"transcripts", &st->db_turn}};
    for (size_t i = 0; i < sizeof dbs / sizeof dbs[0]; i++) {
        m = mdb_dbi_open(txn, dbs[i].name, create ? MDB_CREATE : 0, dbs[i].dbi);
        if (m) {
            mdb_txn_abort(txn);
            return m == MDB_NOTFOUND ? KDS_NOT_FOUND : sess__mdb_err(m, dbs[i].name, err);
        }
    }
    /* The prefix index (sess_prefix.c) came later: a store without it opens
     * as before and gets it with its first indexed turn. */
    m = mdb_dbi_open(txn, "prefixes", create ? MDB_CREATE : 0, &st->db_prefix);
    if (m && m != MDB_NOTFOUND) {
        mdb_txn_abort(txn);
        return sess__mdb_err(m, "prefixes", err);
    }
    atomic_store(&st->has_prefix, m == 0);
    /* commit, not abort: handles opened in an aborted transaction close */
    m = mdb_txn_commit(txn);
    return m ? sess__mdb_err(m, "opening the databases", err) : KDS_OK;
}

kds_status sess_open(const char *dir, const sess_params *p, sess_store **out, kds_err *err) {
    *out = NULL;
    sess_params dp = sess_default_params();
    if (!p) p = &dp;
    char defdir[1024];
    kds_status rc;
    if (!dir) {
        if ((rc = sess_default_dir(defdir, sizeof defdir, err)) != KDS_OK) return rc;
        dir = defdir;
    }
    if (strlen(dir) > 1000)
        return kds_err_set(err, KDS_TOO_LARGE, "store path is too long: %.60s...", dir);
    if (!p->read_only && (rc = make_dirs(dir, err)) != KDS_OK) return rc;
    sess_store *st = calloc(1, sizeof *st);
    if (!st || !(st->dir = strdup(dir))) {
        free(st);
        return kds_err_set(err, KDS_NOMEM, "out of memory opening %s", dir);
    }
    pthread_rwlock_init(&st->lock, NULL);
    st->read_only = p->read_only;
    st->map_max = p->map_max ? p->map_max : DEFAULT_MAP_MAX;
    size_t map = p->map_size ? p->map_size : DEFAULT_MAP;
    if (map < MIN_MAP) map = MIN_MAP;
    if (map > st->map_max) map = st->map_max;
    int m;
    for (int tries = 0;; tries++) {
        if ((m = mdb_env_create(&st->env)) != 0) {
            rc = sess__mdb_err(m, "creating the LMDB environment", err);
            goto fail;
        }
        mdb_env_set_maxdbs(st->env, 8);
        mdb_env_set_mapsize(st->env, map);
        /* NOTLS: read transactions belong to the call, not the thread, so
         * a pool of threads can share the store without each holding a
         * slot. */
        unsigned flags =
            MDB_NOTLS | (p->no_sync ? MDB_NOSYNC : 0) | (p->read_only ? MDB_RDONLY : 0);
        m = mdb_env_open(st->env, dir, flags, 0600);
        if (m != MDB_INVALID || tries >= 200) break;
        mdb_env_close(st->env);
        st->env = NULL;
        /* opened while sess_compact swapped data.mdb: it cleared the lock
         * region's magic; once it is done, the next opener starts the
         * region afresh */
        if (!lock_reset(dir)) break;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (m == ENOENT && p->read_only) {
        rc = kds_err_set(err, KDS_NOT_FOUND, "no kdaserve store in %s", dir);
        goto fail;
    }
    if (m) {
        rc = open_refused(dir, m, err);
        goto fail;
    }
    if ((rc = check_data_file(st, err)) != KDS_OK) goto fail;
    /* Reader slots of processes that died inside a read would pin pages
     * forever (the store would only grow). */
    int dead = 0;
    mdb_reader_check(st->env, &dead);
    /* An existing store opens without the writer lock (a read transaction
     * can open named databases that exist), so opening never waits for
     * another process's long write; only a new store needs a write. */
    if ((rc = open_dbs(st, false, err)) == KDS_NOT_FOUND && !p->read_only)
        rc = open_dbs(st, true, err);
    if (rc == KDS_NOT_FOUND)
        kds_err_set(err, KDS_NOT_FOUND, "%s holds no kdaserve store", dir);
    if (rc != KDS_OK) goto fail;
    rc = sess__read(st, read_store_record, NULL, err);
    if (rc == KDS_NOT_FOUND && !p->read_only) {
        kds_err_clear(err);
        rc = sess__write(st, check_store_record, NULL, err);
    }
    if (rc != KDS_OK) goto fail;
    *out = st;
    return KDS_OK;
fail:
    sess_close(st);
    return rc;
}

void sess_close(sess_store *st) {
    if (!st) return;
    if (st->env) mdb_env_close(st->env);
    pthread_rwlock_destroy(&st->lock);
    free(st->dir);
    free(st);
}

const char *sess_store_dir(const sess_store *st) { return st->dir; }

/* ------------------------------------------------------------------------ */
/* Stats and raw access                                                      */

static kds_status sum_db(MDB_txn *txn, MDB_dbi dbi, uint64_t *count, size_t *bytes, kds_err *err) {
    MDB_cursor *c;
    int m = mdb_cursor_open(txn, dbi, &c);
    if (m) return sess__mdb_err(m, "listing", err);
    MDB_val k, v;
    *count = 0;
    *bytes = 0;
    for (m = mdb_cursor_get(c, &k, &v, MDB_FIRST); m == 0;
         m = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
        (*count)++;
        *bytes += v.mv_size;
    }
    mdb_cursor_close(c);
    return m == MDB_NOTFOUND ? KDS_OK : sess__mdb_err(m, "listing", err);
}

static kds_status stats_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    sess_store_stats *o = ctx;
    MDB_envinfo info;
    MDB_stat ms;
    mdb_env_info(st->env, &info);
    mdb_env_stat(st->env, &ms);
    o->map_size = info.me_mapsize;
    o->used_bytes = (info.me_last_pgno + 1) * (size_t)ms.ms_psize;
    size_t junk;
    kds_status rc = sum_db(txn, st->db_sess, &o->sessions, &junk, err);
    if (rc == KDS_OK) rc = sum_db(txn, st->db_snap, &o->snapshots, &o->snapshot_bytes, err);
    if (rc == KDS_OK) rc = sum_db(txn, st->db_chunk, &o->chunks, &o->chunk_bytes, err);
    return rc;
}

kds_status sess_store_stats_get(sess_store *st, sess_store_stats *out, kds_err *err) {
    memset(out, 0, sizeof *out);
    return sess__read(st, stats_fn, out, err);
}

static MDB_dbi db_by_name(sess_store *st, const char *db, bool *ok) {
    *ok = true;
    if (!strcmp(db, "snapshots")) return st->db_snap;
    if (!strcmp(db, "chunks")) return st->db_chunk;
    if (!strcmp(db, "sessions")) return st->db_sess;
    if (!strcmp(db, "transcripts")) return st->db_turn;
    if (!strcmp(db, "meta")) return st->db_meta;
    *ok = false;
    return 0;
}

typedef struct raw_ctx {
    MDB_dbi dbi;
    const void *key;
    size_t key_len;
    const void *in;
    size_t in_len;
    void *out;
    size_t out_len;
} raw_ctx;

static kds_status raw_get_fn(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err) {
    (void)st;
    raw_ctx *r = ctx;
    const void *v;
    size_t n;
    kds_status rc = sess__get(txn, r->dbi, r->key, r->key_len, &v, &n, err);
    if (rc == KDS_NOT_FOUND) return kds_err_set(err, KDS_NOT_FOUND, "no such record");
    if (rc != KDS_OK) return rc;
    if (!(r->out = malloc(n ? n : 1))) return kds_err_set(err, KDS_NOMEM, "out of memory");
    memcpy(r->out, v, n);
    r->out_len = n;
    return KDS_OK;
}

static kds_status raw_put_fn(sess__wtxn *w, void *ctx, kds_err *err) {
    raw_ctx *r = ctx;
    return sess__put(w, r->dbi, r->key, r->key_len, r->in, r->in_len, 0, err);
}

kds_status sess__raw_get(sess_store *st, const char *db, const void *key, size_t key_len,
                         void **val, size_t *val_len, kds_err *err) {
    bool ok;
    raw_ctx r = {.dbi = db_by_name(st, db, &ok), .key = key, .key_len = key_len};
    if (!ok) return kds_err_set(err, KDS_INVALID_ARG, "no database '%s'", db);
    kds_status rc = sess__read(st, raw_get_fn, &r, err);
    *val = r.out;
    *val_len = r.out_len;
    return rc;
}

kds_status sess__raw_put(sess_store *st, const char *db, const void *key, size_t key_len,
                         const void *val, size_t val_len, kds_err *err) {
    bool ok;
    raw_ctx r = {.dbi = db_by_name(st, db, &ok), .key = key, .key_len = key_len, .in = val,
                 .in_len = val_len};
    if (!ok) return kds_err_set(err, KDS_INVALID_ARG, "no database '%s'", db);
    return sess__write(st, raw_put_fn, &r, err);
}
