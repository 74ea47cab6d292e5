/*
 * A full disk: the store lives on a small tmpfs (mounted in a private mount
 * namespace, so it vanishes with the test process; needs root, skipped
 * otherwise). Saving until the disk is full fails with a message that says
 * the disk is full and where (the store and the filesystem), nothing half
 * written; and saving works again as soon as space is freed, whether by
 * deleting a file elsewhere on that disk or by deleting sessions and
 * collecting their snapshots in the store itself (LMDB reuses pages freed
 * by a transaction only once a later one has committed: the store commits
 * that later one itself).
 */
#define _GNU_SOURCE
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>

#include "test_sess_util.h"

#define MICRO_KDA TMU_MICRO_KDA

/* A private tmpfs of `size` at dir/mnt; NULL (test skipped) without the
 * privileges to make one. */
static char *small_disk(const char *dir, const char *size) {
    if (geteuid() != 0) return NULL;
    if (unshare(CLONE_NEWNS) != 0) return NULL;
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) return NULL;
    char *mnt = tmu_path(dir, "mnt");
    cr_assert_eq(mkdir(mnt, 0700), 0);
    char opt[32];
    snprintf(opt, sizeof opt, "size=%s", size);
    if (mount("tmpfs", mnt, "tmpfs", 0, opt) != 0) {
        free(mnt);
        return NULL;
    }
    return mnt;
}

/* New sessions of one 48 KiB snapshot each until a save fails; returns how
 * many were saved, *rc and err hold the failure. */
static int fill(sess_store *st, tsu_model *f, const char *prefix, kds_status *rc, kds_err *err) {
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f->m, 1, &s, err), KDS_OK);
    tsu_feed(f, s, 5, 3);
    int n = 0;
    for (;; n++) {
        char name[32];
        snprintf(name, sizeof name, "%s%d", prefix, n);
        *rc = sess_save(st, name, 0, f->m, s, NULL, NULL, err);
        if (*rc != KDS_OK) break;
        cr_assert_lt(n, 1000, "the disk never filled");
    }
    eng_seq_free(s);
    return n;
}

static kds_status save_one(sess_store *st, tsu_model *f, const char *name, kds_err *err) {
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f->m, 1, &s, err), KDS_OK);
    tsu_feed(f, s, 5, 4);
    kds_status rc = sess_save(st, name, 0, f->m, s, NULL, NULL, err);
    eng_seq_free(s);
    return rc;
}

Test(sess_disk, full_disk_said_and_recovered, .timeout = 120) {
    char *tmp = tmu_mkdtemp();
    char *mnt = small_disk(tmp, "2m");
    if (!mnt) {
        tmu_rmtree(tmp);
        free(tmp);
        cr_skip_test("needs root (a private tmpfs mount) to fill a disk");
    }
    char *db = tmu_path(mnt, "db"), *filler = tmu_path(mnt, "filler");
    static char junk[256 << 10];
    cr_assert(tmu_write(filler, junk, sizeof junk));
    tsu_model f = tsu_open_model(MICRO_KDA);
    sess_store *st = tsu_open_store(db);
    kds_err err = {0};
    kds_status rc;
    int saved = fill(st, &f, "a", &rc, &err);
    cr_assert_geq(saved, 3, "only %d saves fit: %s", saved, err.msg);

    /* said as it is, and where */
    cr_expect_eq(rc, KDS_IO, "%s", err.msg);
    cr_expect(strstr(err.msg, "disk is full"), "the message should say the disk is full: %s",
              err.msg);
    cr_expect(strstr(err.msg, db), "the message should name the store: %s", err.msg);
    cr_expect(strstr(err.msg, mnt), "the message should name the filesystem: %s", err.msg);
    cr_expect_null(strstr(err.msg, "Input/output error"), "%s", err.msg);

    /* nothing half written: every saved session is there and sound */
    sess_session_info *ss = NULL;
    size_t ns = 0;
    cr_assert_eq(sess_session_list(st, &ss, &ns, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(ns, (size_t)saved);
    for (size_t i = 0; i < ns; i++)
        cr_expect_eq(sess_verify(st, ss[i].head, f.m, &err), KDS_OK, "%s", err.msg);
    free(ss);

    /* a command says the same */
    char out[4096];
    cr_expect_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " generate --model %s --db %s --session cli --prompt x "
                                      "--max-tokens 2 2>&1",
                         MICRO_KDA, db),
                 1, "%s", out);
    cr_expect(strstr(out, "disk is full"), "%s", out);

    /* space freed in the store (sessions deleted, gc): the next save works */
    for (int i = 0; i < 4; i++) {
        char name[32];
        snprintf(name, sizeof name, "a%d", i);
        cr_assert_eq(sess_session_delete(st, name, &err), KDS_OK, "%s", err.msg);
    }
    sess_gc_stats g;
    cr_assert_eq(sess_gc(st, &g, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(g.snapshots_freed, 4);
    rc = save_one(st, &f, "after-gc", &err);
    cr_expect_eq(rc, KDS_OK, "save after gc freed %zu bytes: %s", g.bytes_freed, err.msg);
    rc = save_one(st, &f, "after-gc-2", &err);
    cr_expect_eq(rc, KDS_OK, "second save after gc: %s", err.msg);

    /* full again; space freed elsewhere on the disk: the next save works */
    saved = fill(st, &f, "b", &rc, &err);
    cr_expect(strstr(err.msg, "disk is full"), "%s", err.msg);
    cr_assert_eq(unlink(filler), 0);
    rc = save_one(st, &f, "after-unlink", &err);
    cr_expect_eq(rc, KDS_OK, "save after a file was deleted: %s", err.msg);

    sess_close(st);
    st = tsu_open_store(db);
    cr_assert_eq(sess_session_list(st, &ss, &ns, &err), KDS_OK, "%s", err.msg);
    for (size_t i = 0; i < ns; i++)
        cr_expect_eq(sess_verify(st, ss[i].head, f.m, &err), KDS_OK, "%s", err.msg);
    free(ss);
    sess_close(st);
    tsu_close_model(&f);
    umount2(mnt, MNT_DETACH);
    free(db);
    free(filler);
    free(mnt);
    tmu_rmtree(tmp);
    free(tmp);
}
