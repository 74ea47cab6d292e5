/*
 * Retention: a store keeps, per session, the last N snapshots of its line
 * and the snapshot of every Kth turn (and, if asked, every snapshot younger
 * than D days), and always each fork's base; `snap gc` deletes only what
 * that policy lets go (restore points are no longer all dropped), `snap gc
 * --all-history` (every snapshot that is no head) and `snap rm` of a
 * restore point in the middle of a history want --force; `snap compact`
 * shrinks data.mdb (LMDB's compacting copy, checked, then swapped in) and
 * refuses while another process has the store open.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>

#include "test_sess_util.h"

#define MICRO_KDA TMU_MICRO_KDA

/* Session `name` of `turns` turns (one snapshot each, in the transcript);
 * ids[i] = the snapshot of turn i + 1. */
static void make_session(sess_store *st, tsu_model *f, const char *name, int turns, uint64_t *ids) {
    kds_err err = {0};
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f->m, 1, &s, &err), KDS_OK);
    uint64_t head = 0;
    for (int i = 0; i < turns; i++) {
        tsu_feed(f, s, 2, (uint32_t)(i + 1));
        char p[32];
        snprintf(p, sizeof p, "turn %d", i + 1);
        sess_turn t = {.prompt = p,
                       .prompt_len = strlen(p),
                       .output = "o",
                       .output_len = 1,
                       .prompt_tokens = 2,
                       .mode = "plain"};
        cr_assert_eq(sess_save(st, name, head, f->m, s, &t, &head, &err), KDS_OK, "%s", err.msg);
        ids[i] = head;
    }
    eng_seq_free(s);
}

static bool exists(sess_store *st, uint64_t id) {
    sess_snapshot_info si;
    return sess_snapshot_get(st, id, &si, NULL) == KDS_OK;
}

Test(sess_retain, gc_keeps_what_the_policy_keeps, .timeout = 120) {
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db");
    tsu_model f = tsu_open_model(MICRO_KDA);
    sess_store *st = tsu_open_store(db);
    kds_err err = {0};
    uint64_t ids[30], fids[2];
    make_session(st, &f, "long", 30, ids);
    /* a fork at turn 7, moved on by one turn */
    char at[32];
    snprintf(at, sizeof at, "@%llu", (unsigned long long)ids[6]);
    cr_assert_eq(sess_fork(st, at, "f", NULL, &err), KDS_OK, "%s", err.msg);
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 0, &s, &err), KDS_OK);
    cr_assert_eq(sess_load(st, ids[6], f.m, s, NULL, &err), KDS_OK);
    tsu_feed(&f, s, 3, 99);
    cr_assert_eq(sess_save(st, "f", ids[6], f.m, s, NULL, &fids[0], &err), KDS_OK, "%s", err.msg);
    eng_seq_free(s);
    /* a deleted session's snapshots are garbage whatever the policy */
    uint64_t gone[3];
    make_session(st, &f, "gone", 3, gone);
    cr_assert_eq(sess_session_delete(st, "gone", &err), KDS_OK);
    sess_close(st);

    char out[8192];
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " snap retention --db %s "
                                      "--keep-last 5 --keep-every 10 2>&1",
                         db),
                 0, "%s", out);
    cr_expect(strstr(out, "last 5") && strstr(out, "every 10th"), "%s", out);
    /* a dry run says what would go and deletes nothing */
    cr_assert_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap gc --dry-run --db %s 2>&1", db),
                 0, "%s", out);
    /* long: keeps turns 26-30, 10, 20; f: its head, and the last 5 of its
     * line (head, turn 7 = its fork point, turns 6, 5, 4); gone: nothing.
     * 30 - 11 + 3 go. */
    cr_expect(strstr(out, "would free 22 snapshots"), "%s", out);
    st = tsu_open_store(db);
    for (int i = 0; i < 30; i++)
        cr_expect(exists(st, ids[i]), "dry run deleted turn %d", i + 1);
    sess_close(st);

    cr_assert_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap gc --db %s 2>&1", db), 0, "%s",
                 out);
    st = tsu_open_store(db);
    for (int i = 0; i < 30; i++) {
        int turn = i + 1;
        bool want = turn > 25 || turn % 10 == 0 || (turn >= 4 && turn <= 7);
        cr_expect_eq(exists(st, ids[i]), want, "turn %d of 'long' %s", turn,
                     want ? "was deleted" : "was kept");
    }
    cr_expect(exists(st, fids[0]), "the fork's head");
    for (int i = 0; i < 3; i++)
        cr_expect(!exists(st, gone[i]), "a deleted session's snapshot");
    /* a second gc with the same policy has nothing more to take */
    sess_close(st);
    cr_assert_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap gc --db %s 2>&1", db), 0, "%s",
                 out);
    cr_expect(strstr(out, "freed 0 snapshots"), "%s", out);
    /* what is kept still loads */
    st = tsu_open_store(db);
    cr_expect_eq(sess_verify(st, ids[9], f.m, &err), KDS_OK, "%s", err.msg);
    sess_retention r;
    bool set;
    cr_assert_eq(sess_retention_get(st, &r, &set, &err), KDS_OK, "%s", err.msg);
    cr_expect(set);
    cr_expect_eq(r.keep_last, 5);
    cr_expect_eq(r.keep_every, 10);
    cr_expect_eq(r.keep_days, 0);
    sess_close(st);
    tsu_close_model(&f);
    free(db);
    tmu_rmtree(tmp);
    free(tmp);
}

Test(sess_retain, default_policy_and_age, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db");
    tsu_model f = tsu_open_model(MICRO_KDA);
    sess_store *st = tsu_open_store(db);
    kds_err err = {0};
    sess_retention r = {0};
    bool set = true;
    cr_assert_eq(sess_retention_get(st, &r, &set, &err), KDS_OK, "%s", err.msg);
    cr_expect(!set);
    sess_retention d = sess_default_retention();
    cr_expect_eq(r.keep_last, d.keep_last);
    cr_expect_eq(r.keep_every, d.keep_every);
    cr_expect_gt(d.keep_last, 1, "the default keeps restore points");
    uint64_t ids[12];
    make_session(st, &f, "s", 12, ids);
    /* by age: everything here is younger than a day */
    sess_retention young = {.keep_last = 1, .keep_every = 0, .keep_days = 1};
    sess_gc_stats g;
    cr_assert_eq(sess_prune(st, &young, 0, &g, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(g.snapshots_freed, 0);
    for (int i = 0; i < 12; i++)
        cr_expect(exists(st, ids[i]));
    /* head only: the old gc */
    sess_retention head = {.keep_last = 1};
    cr_assert_eq(sess_prune(st, &head, SESS_PRUNE_DRY_RUN, &g, &err), KDS_OK);
    cr_expect_eq(g.snapshots_freed, 11);
    cr_expect_eq(g.restore_points_freed, 11);
    cr_expect(exists(st, ids[0]), "a dry run deletes nothing");
    cr_assert_eq(sess_prune(st, NULL, 0, &g, &err), KDS_OK, "%s", err.msg);
    int kept = 0;
    for (int i = 0; i < 12; i++)
        kept += exists(st, ids[i]);
    cr_expect_eq(kept,
                 (int)(d.keep_last < 12 ? d.keep_last : 12) +
                     (d.keep_every && 12 >= d.keep_every && 12 - d.keep_every >= d.keep_last),
                 "default policy kept %d", kept);
    /* set, reopened, back to the default */
    sess_retention mine = {.keep_last = 3, .keep_every = 4, .keep_days = 9};
    cr_assert_eq(sess_retention_set(st, &mine, &err), KDS_OK, "%s", err.msg);
    sess_close(st);
    st = tsu_open_store(db);
    cr_assert_eq(sess_retention_get(st, &r, &set, &err), KDS_OK);
    cr_expect(set && r.keep_last == 3 && r.keep_every == 4 && r.keep_days == 9);
    cr_assert_eq(sess_retention_set(st, NULL, &err), KDS_OK);
    cr_assert_eq(sess_retention_get(st, &r, &set, &err), KDS_OK);
    cr_expect(!set && r.keep_last == d.keep_last);
    sess_close(st);
    tsu_close_model(&f);
    free(db);
    tmu_rmtree(tmp);
    free(tmp);
}

Test(sess_retain, cutting_history_wants_force, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db");
    tsu_model f = tsu_open_model(MICRO_KDA);
    sess_store *st = tsu_open_store(db);
    uint64_t ids[6], other[2];
    make_session(st, &f, "conv", 6, ids);
    make_session(st, &f, "old", 2, other);
    kds_err err = {0};
    cr_assert_eq(sess_session_delete(st, "old", &err), KDS_OK);
    sess_close(st);
    char out[8192];
    /* a restore point in the middle of conv's history */
    cr_expect_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " snap rm @%llu --db %s 2>&1 "
                                      "</dev/null",
                         (unsigned long long)ids[3], db),
                 1, "%s", out);
    cr_expect(strstr(out, "session 'conv'") && strstr(out, "turn 4") && strstr(out, "--force"),
              "%s", out);
    st = tsu_open_store(db);
    cr_expect(exists(st, ids[3]), "refused, yet deleted");
    sess_close(st);
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap rm @%llu --force --db %s 2>&1",
                         (unsigned long long)ids[3], db),
                 0, "%s", out);
    /* a snapshot of no session's history goes without asking */
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap rm @%llu --db %s 2>&1",
                         (unsigned long long)other[0], db),
                 0, "%s", out);
    /* gc --all-history drops every restore point: only with --force */
    cr_expect_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " snap gc --all-history --db %s 2>&1 "
                                      "</dev/null",
                         db),
                 1, "%s", out);
    cr_expect(strstr(out, "--force") && strstr(out, "restore point"), "%s", out);
    st = tsu_open_store(db);
    cr_expect(exists(st, ids[0]));
    sess_close(st);
    cr_expect_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " snap gc --all-history --force "
                                      "--db %s 2>&1",
                         db),
                 0, "%s", out);
    st = tsu_open_store(db);
    for (int i = 0; i < 5; i++)
        cr_expect(!exists(st, ids[i]));
    cr_expect(exists(st, ids[5]), "the head stays");
    sess_close(st);
    cr_expect_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " generate --db %s --session conv "
                                      "--max-tokens 2 2>&1",
                         db),
                 0, "%s", out);
    tsu_close_model(&f);
    free(db);
    tmu_rmtree(tmp);
    free(tmp);
}

static size_t file_size(const char *db) {
    char *p = tmu_path(db, "data.mdb");
    struct stat sb;
    cr_assert_eq(stat(p, &sb), 0);
    free(p);
    return (size_t)sb.st_size;
}

Test(sess_retain, compact_shrinks_the_file, .timeout = 120) {
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db");
    tsu_model f = tsu_open_model(TMU_MICRO_HYBRID);
    sess_store *st = tsu_open_store(db);
    kds_err err = {0};
    uint64_t ids[8], keep_head = 0;
    for (int k = 0; k < 12; k++) {
        char name[16];
        snprintf(name, sizeof name, "s%d", k);
        make_session(st, &f, name, 8, ids);
        if (k == 5) keep_head = ids[7];
    }
    size_t n;
    unsigned char *before = tsu_snapshot_state(st, keep_head, &f, &n);
    for (int k = 0; k < 12; k++) {
        if (k == 5) continue;
        char name[16];
        snprintf(name, sizeof name, "s%d", k);
        cr_assert_eq(sess_session_delete(st, name, &err), KDS_OK);
    }
    sess_gc_stats g;
    cr_assert_eq(sess_gc(st, &g, &err), KDS_OK, "%s", err.msg);
    sess_close(st);
    size_t big = file_size(db);

    /* refused while another process has the store open; nothing changes */
    char out[8192];
    int in[2];
    cr_assert_eq(pipe(in), 0);
    pid_t holder = fork();
    cr_assert_geq(holder, 0);
    if (holder == 0) {
        dup2(in[0], 0);
        close(in[1]);
        int nul = open("/dev/null", O_WRONLY);
        dup2(nul, 1);
        dup2(nul, 2);
        execl(TSU_KDASERVE, "kdaserve", "chat", "--db", db, "--session", "s5", "--plain", NULL);
        _exit(121);
    }
    close(in[0]);
    bool seen = false;
    for (int i = 0; i < 3000 && !seen; i++) { /* until it holds the store */
        char cmd[64];
        snprintf(cmd, sizeof cmd, "/proc/%d/fd", (int)holder);
        char o2[8192];
        tsu_run(o2, sizeof o2, NULL, "ls -l %s 2>/dev/null", cmd);
        seen = strstr(o2, "lock.mdb") != NULL;
        struct timespec ts = {0, 10 * 1000 * 1000};
        if (!seen) nanosleep(&ts, NULL);
    }
    cr_assert(seen, "the chat never opened the store");
    char pidtext[32];
    snprintf(pidtext, sizeof pidtext, "pid %d", (int)holder);
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap compact --db %s 2>&1", db), 1,
                 "%s", out);
    cr_expect(strstr(out, "another process") && strstr(out, pidtext), "%s", out);
    cr_expect_eq(file_size(db), big);
    close(in[1]);
    int wst;
    waitpid(holder, &wst, 0);

    cr_assert_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap compact --db %s 2>&1", db), 0,
                 "%s", out);
    size_t small = file_size(db);
    char *dm = tmu_path(db, "data.mdb");
    struct stat sb;
    cr_assert_eq(stat(dm, &sb), 0);
    cr_expect_eq(sb.st_mode & 0777, 0600, "the store keeps its file mode");
    free(dm);
    cr_expect_lt(small * 2, big, "compacted %zu -> %zu bytes", big, small);
    char want[64];
    snprintf(want, sizeof want, "%zu", small);
    cr_expect(strstr(out, want), "the new size is said: %s", out);
    /* everything kept is there, sound and the same */
    st = tsu_open_store(db);
    sess_session_info si;
    cr_assert_eq(sess_session_get(st, "s5", &si, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(si.head, keep_head);
    cr_expect_eq(sess_verify(st, si.head, f.m, &err), KDS_OK, "%s", err.msg);
    size_t m;
    unsigned char *after = tsu_snapshot_state(st, keep_head, &f, &m);
    cr_assert_eq(m, n);
    cr_expect_eq(memcmp(before, after, n), 0);
    sess_turn_record *t = NULL;
    size_t nt = 0;
    cr_assert_eq(sess_transcript(st, "s5", &t, &nt, &err), KDS_OK);
    cr_expect_eq(nt, 8);
    sess_transcript_free(t, nt);
    /* and takes new writes */
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 0, &s, &err), KDS_OK);
    cr_assert_eq(sess_load(st, keep_head, f.m, s, NULL, &err), KDS_OK);
    tsu_feed(&f, s, 4, 7);
    cr_expect_eq(sess_save(st, "s5", keep_head, f.m, s, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    eng_seq_free(s);
    sess_close(st);
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap verify --db %s 2>&1", db), 0,
                 "%s", out);
    free(before);
    free(after);
    tsu_close_model(&f);
    free(db);
    tmu_rmtree(tmp);
    free(tmp);
}
