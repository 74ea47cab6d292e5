/*
 * sess_compact.c - shrinking a store's data.mdb. LMDB never gives pages
 * back to the filesystem: deleted snapshots leave free pages that later
 * writes reuse, but the file keeps its largest size. LMDB's compacting
 * copy (mdb_env_copy2 with MDB_CP_COMPACT) writes only the live pages,
 * renumbered; this file makes that copy, checks it, and swaps it in.
 *
 * The swap is only safe with no other process in the store: one that has
 * data.mdb mapped would go on reading and writing the old, unlinked file.
 * Every process that opens an LMDB environment holds a shared fcntl lock
 * on byte 0 of lock.mdb (LMDB takes it exclusively only while it is the
 * sole opener); so compaction takes that byte exclusively for the whole
 * run, which fails at once if anyone else has the store open (the refusal
 * names the pid) and makes processes that open the store meanwhile wait.
 * Before letting them go, the lock region's magic is cleared: a waiter
 * would otherwise trust the transaction id recorded there for the old
 * file; finding no magic it fails to open (sess_open retries), and the
 * next opener, alone, initialises the region afresh for the new file.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sess_internal.h"

static void remove_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            char p[PATH_MAX];
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            unlink(p);
        }
        closedir(d);
    }
    rmdir(dir);
}

static kds_status sync_path(const char *path, int flags, kds_err *err) {
    int fd = open(path, flags | O_CLOEXEC);
    if (fd < 0 || fsync(fd) != 0) {
        int e = errno;
        if (fd >= 0) close(fd);
        return kds_err_set(err, KDS_IO, "syncing %s: %s", path, strerror(e));
    }
    close(fd);
    return KDS_OK;
}

/* Records in each named database, and LMDB's last transaction id. */
/* The prefix index (sess_prefix.c) is the sixth; stores written before it
 * have none (counted as 0). */
#define N_DBS 6
static const char *const DB_NAMES[N_DBS] = {"meta",     "snapshots",   "chunks",
                                            "sessions", "transcripts", "prefixes"};

typedef struct census {
    size_t entries[N_DBS];
} census;

static kds_status take_census(MDB_env *env, census *c, const char *what, kds_err *err) {
    MDB_txn *txn;
    int m = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn);
    if (m) return sess__mdb_err(m, what, err);
    for (int i = 0; i < N_DBS && !m; i++) {
        MDB_dbi dbi;
        MDB_stat s;
        if (!(m = mdb_dbi_open(txn, DB_NAMES[i], 0, &dbi)) && !(m = mdb_stat(txn, dbi, &s)))
            c->entries[i] = s.ms_entries;
        if (m == MDB_NOTFOUND && i == N_DBS - 1) m = 0, c->entries[i] = 0;
    }
    mdb_txn_abort(txn);
    return m ? sess__mdb_err(m, what, err) : KDS_OK;
}

/* The compacted copy opens as an LMDB environment and holds what the
 * store holds. */
static kds_status check_copy(const char *tmp, const census *want, kds_err *err) {
    MDB_env *env;
    int m = mdb_env_create(&env);
    if (m) return sess__mdb_err(m, "checking the compacted copy", err);
    mdb_env_set_maxdbs(env, 8);
    census got = {{0}};
    kds_status rc;
    if ((m = mdb_env_open(env, tmp, MDB_RDONLY | MDB_NOTLS, 0600)) != 0)
        rc = sess__mdb_err(m, "opening the compacted copy", err);
    else
        rc = take_census(env, &got, "reading the compacted copy", err);
    mdb_env_close(env);
    if (rc != KDS_OK) return rc;
    for (int i = 0; i < N_DBS; i++)
        if (got.entries[i] != want->entries[i])
            return kds_err_set(err, KDS_INTERNAL,
                               "the compacted copy holds %zu %s records, the "
                               "store %zu; nothing was changed",
                               got.entries[i], DB_NAMES[i], want->entries[i]);
    return KDS_OK;
}

static void describe_pid(pid_t pid, char *buf, size_t cap) {
    char p[64], comm[64] = "";
    snprintf(p, sizeof p, "/proc/%d/comm", (int)pid);
    FILE *f = fopen(p, "r");
    if (f) {
        if (fgets(comm, sizeof comm, f)) comm[strcspn(comm, "\n")] = '\0';
        fclose(f);
    }
    if (comm[0])
        snprintf(buf, cap, "pid %d, %s", (int)pid, comm);
    else
        snprintf(buf, cap, "pid %d", (int)pid);
}

kds_status sess_compact(const char *dir, sess_compact_stats *out, kds_err *err) {
    sess_compact_stats z = {0};
    sess_store *st = NULL;
    int lfd = -1;
    char data[1100], lock[1100], tmp[1100], copy[1200]; /* dir is at most 1000 bytes */
    bool made_tmp = false;
    sess_params p = sess_default_params();
    p.read_only = true; /* the copy only reads; and no store is created */
    kds_status rc = sess_open(dir, &p, &st, err);
    if (rc != KDS_OK) return rc;
    dir = sess_store_dir(st);
    snprintf(data, sizeof data, "%s/data.mdb", dir);
    snprintf(lock, sizeof lock, "%s/lock.mdb", dir);
    snprintf(tmp, sizeof tmp, "%s/compact.tmp", dir);
    snprintf(copy, sizeof copy, "%s/data.mdb", tmp);

    /* The store to itself (see the top of the file). Closing any
     * descriptor of lock.mdb drops this process's locks on it, LMDB's
     * included: lfd stays open until the store is closed. */
    if ((lfd = open(lock, O_RDWR | O_CLOEXEC)) < 0) {
        rc = kds_err_set(err, KDS_IO, "opening %s: %s", lock, strerror(errno));
        goto out;
    }
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    if (fcntl(lfd, F_SETLK, &fl) != 0) {
        struct flock q = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
        char who[128] = "another process";
        if (fcntl(lfd, F_GETLK, &q) == 0 && q.l_type != F_UNLCK) {
            char d[96];
            describe_pid(q.l_pid, d, sizeof d);
            snprintf(who, sizeof who, "another process (%s)", d);
        }
        rc = kds_err_set(err, KDS_BUSY,
                         "store %s is open in %s: compacting needs it to itself "
                         "(stop `kdaserve serve`, leave `kdaserve chat`) and run compact again; "
                         "nothing was changed",
                         dir, who);
        goto out;
    }
    struct stat sb;
    if (stat(data, &sb) != 0) {
        rc = kds_err_set(err, KDS_IO, "%s: %s", data, strerror(errno));
        goto out;
    }
    z.bytes_before = (uint64_t)sb.st_size;
    mode_t mode = sb.st_mode & 07777;
    census want = {{0}};
    if ((rc = take_census(st->env, &want, "reading the store", err)) != KDS_OK) goto out;

    /* the copy, in a directory of its own (a leftover of an interrupted
     * run is garbage: the store was never swapped) */
    remove_dir(tmp);
    if (mkdir(tmp, 0700) != 0) {
        rc = kds_err_set(err, KDS_IO, "creating %s: %s", tmp, strerror(errno));
        goto out;
    }
    made_tmp = true;
    int m = mdb_env_copy2(st->env, tmp, MDB_CP_COMPACT);
    if (m) {
        struct sess__wtxn w = {.st = st};
        rc = sess__write_err(&w, m, "writing the compacted copy", err);
        kds_err_prefix(err, "compacting %s (nothing was changed)", dir);
        goto out;
    }
    if ((rc = sync_path(copy, O_RDONLY, err)) != KDS_OK) goto out;
    if ((rc = check_copy(tmp, &want, err)) != KDS_OK) goto out;
    if (stat(copy, &sb) != 0) {
        rc = kds_err_set(err, KDS_IO, "%s: %s", copy, strerror(errno));
        goto out;
    }
    z.bytes_after = (uint64_t)sb.st_size;
    if (z.bytes_after >= z.bytes_before) { /* nothing to gain: keep the file as it is */
        z.bytes_after = z.bytes_before;
        goto out;
    }
    /* LMDB creates the copy 0666 & umask; the store keeps its own mode */
    if (chmod(copy, mode) != 0) {
        rc = kds_err_set(err, KDS_IO, "%s: %s (nothing was changed)", copy, strerror(errno));
        goto out;
    }
    if (rename(copy, data) != 0) {
        rc = kds_err_set(err, KDS_IO, "replacing %s: %s (nothing was changed)", data,
                         strerror(errno));
        goto out;
    }
    /* from here data.mdb is the compacted copy */
    rc = sync_path(dir, O_RDONLY | O_DIRECTORY, err);
    /* waiters must not trust the old file's transaction id: no magic, no
     * trust (MDB_txninfo starts with it) */
    static const unsigned char zero[4] = {0};
    if (pwrite(lfd, zero, sizeof zero, 0) != (ssize_t)sizeof zero && rc == KDS_OK)
        rc = kds_err_set(err, KDS_IO, "resetting %s: %s", lock, strerror(errno));
out:
    sess_close(st);
    if (lfd >= 0) close(lfd);
    if (made_tmp) remove_dir(tmp);
    if (out) *out = z;
    return rc;
}
