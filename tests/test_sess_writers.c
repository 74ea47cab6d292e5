/*
 * Two writers on one session: a REPL (`kdaserve chat`) holds session s
 * open while another process (`generate --session s`, standing in for the
 * server) saves a turn of its own. Nothing is lost: the other process is
 * told at once that s is open for writing elsewhere; the REPL's next turn,
 * which now conflicts with the moved head, is saved as a fork named after
 * the session and said so, the REPL goes on in the fork, and `/save NAME`
 * works there. Through the API: sess_save still refuses the stale base
 * (KDS_BUSY); sess_save_ex with SESS_CONFLICT_FORK forks at the base, with
 * the transcript up to it, leaving the other writer's head alone.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>

#include "test_sess_util.h"

#define MICRO_KDA TMU_MICRO_KDA

/* `kdaserve ARGS...` with stdin from a pipe (*in) and stdout / stderr to
 * files; returns its pid. */
static pid_t spawn(char *const argv[], int *in, const char *out_path, const char *err_path) {
    int p[2];
    cr_assert_eq(pipe(p), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        dup2(p[0], 0);
        int o = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int e = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (o < 0 || e < 0) _exit(120);
        dup2(o, 1);
        dup2(e, 2);
        close(p[0]);
        close(p[1]);
        execv(TSU_KDASERVE, argv);
        _exit(121);
    }
    close(p[0]);
    *in = p[1];
    return pid;
}

/* Wait (up to 30 s) until file `path` contains `what`. */
static bool wait_for(const char *path, const char *what) {
    for (int i = 0; i < 3000; i++) {
        size_t n;
        char *t = tmu_read(path, &n);
        bool found = t && strstr(t, what);
        free(t);
        if (found) return true;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return false;
}

static int wait_exit(pid_t pid) {
    int st = 0;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void say(int fd, const char *line) {
    size_t n = strlen(line);
    cr_assert_eq(write(fd, line, n), (ssize_t)n);
}

Test(sess_writers, repl_turn_after_another_writer_is_forked, .timeout = 120) {
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db"), *out = tmu_path(tmp, "out"), *errf = tmu_path(tmp, "err");
    char buf[16384];
    cr_assert_eq(tsu_run(buf, sizeof buf, NULL,
                         TSU_KDASERVE " generate --model %s --db %s --session s --prompt 'one' "
                                      "--max-tokens 3 2>&1",
                         MICRO_KDA, db),
                 0, "%s", buf);
    sess_store *st = tsu_open_store(db);
    kds_err err = {0};
    sess_session_info s0;
    cr_assert_eq(sess_session_get(st, "s", &s0, &err), KDS_OK, "%s", err.msg);
    sess_close(st);

    /* the REPL opens s and waits for its input */
    int in;
    char *argv[] = {"kdaserve", "chat",    "--db",         db,  "--session",
                    "s",        "--plain", "--max-tokens", "3", NULL};
    pid_t repl = spawn(argv, &in, out, errf);
    cr_assert(wait_for(errf, "session 's'"), "the REPL did not open s");

    /* another writer saves a turn meanwhile: it is told at once */
    cr_assert_eq(tsu_run(buf, sizeof buf, NULL,
                         TSU_KDASERVE " generate --db %s --session s --prompt ' two' "
                                      "--max-tokens 3 2>&1",
                         db),
                 0, "%s", buf);
    char pidtext[32];
    snprintf(pidtext, sizeof pidtext, "pid %d", (int)repl);
    cr_expect(strstr(buf, "open for writing") && strstr(buf, pidtext),
              "generate was not told that the REPL (%s) writes s:\n%s", pidtext, buf);
    st = tsu_open_store(db);
    sess_session_info s1;
    cr_assert_eq(sess_session_get(st, "s", &s1, &err), KDS_OK, "%s", err.msg);
    sess_close(st);
    cr_assert_neq(s1.head, s0.head);

    /* the REPL's turn conflicts: saved as a fork, said so; /save NAME works */
    say(in, "three\n");
    say(in, "/save kept\n");
    close(in);
    int rc = wait_exit(repl);
    size_t n;
    char *e = tmu_read(errf, &n);
    cr_assert(e);
    cr_expect_eq(rc, 0, "the REPL reported failures:\n%s", e);
    cr_expect_null(strstr(e, "not saved"), "%s", e);
    cr_expect(strstr(e, "saved as session 's-2'"), "the fork is not announced:\n%s", e);

    st = tsu_open_store(db);
    sess_session_info a, b, k;
    cr_assert_eq(sess_session_get(st, "s", &a, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(a.head, s1.head, "the other writer's head was moved");
    cr_expect_eq(a.turns, 2);
    cr_assert_eq(sess_session_get(st, "s-2", &b, &err), KDS_OK, "no fork: %s\n%s", err.msg, e);
    cr_expect_str_eq(b.parent, "s");
    cr_expect_eq(b.fork_point, s0.head, "forked at the head the REPL continued");
    cr_expect_eq(b.turns, 2, "its transcript: the turn before the fork and its own");
    sess_turn_record *t = NULL;
    size_t nt = 0;
    cr_assert_eq(sess_transcript(st, "s-2", &t, &nt, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(nt, 2);
    cr_expect_str_eq(t[0].prompt, "one");
    cr_expect_str_eq(t[1].prompt, "three");
    sess_transcript_free(t, nt);
    cr_assert_eq(sess_session_get(st, "kept", &k, &err), KDS_OK, "/save kept: %s\n%s", err.msg, e);
    cr_expect_eq(k.head, b.head);
    cr_expect_eq(sess_verify(st, b.head, NULL, &err), KDS_OK, "%s", err.msg);
    sess_close(st);
    free(e);
    free(db);
    free(out);
    free(errf);
    tmu_rmtree(tmp);
    free(tmp);
}

/* The API: a stale base is refused by sess_save, forked by sess_save_ex. */
Test(sess_writers, save_ex_forks_a_moved_head, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db");
    tsu_model f = tsu_open_model(TMU_MICRO_HYBRID);
    sess_store *st = tsu_open_store(db);
    kds_err err = {0};
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 2, &s, &err), KDS_OK);
    tsu_feed(&f, s, 9, 1);
    sess_turn t1 = {.prompt = "first",
                    .prompt_len = 5,
                    .output = "a",
                    .output_len = 1,
                    .prompt_tokens = 9,
                    .mode = "plain"};
    uint64_t base;
    cr_assert_eq(sess_save(st, "h", 0, f.m, s, &t1, &base, &err), KDS_OK, "%s", err.msg);
    /* another process saves a turn on h */
    char buf[8192];
    cr_assert_eq(tsu_run(buf, sizeof buf, NULL,
                         TSU_KDASERVE " generate --db %s --session h --prompt ' x' "
                                      "--max-tokens 2 2>&1",
                         db),
                 0, "%s", buf);
    sess_session_info moved;
    cr_assert_eq(sess_session_get(st, "h", &moved, &err), KDS_OK);
    cr_assert_neq(moved.head, base);

    tsu_feed(&f, s, 5, 2);
    sess_turn t2 = {.prompt = "mine",
                    .prompt_len = 4,
                    .output = "b",
                    .output_len = 1,
                    .prompt_tokens = 5,
                    .mode = "plain"};
    cr_expect_eq(sess_save(st, "h", base, f.m, s, &t2, NULL, &err), KDS_BUSY);
    cr_expect(strstr(err.msg, "moved"), "%s", err.msg);
    sess_save_result r;
    cr_assert_eq(sess_save_ex(st, "h", base, f.m, s, &t2, SESS_CONFLICT_FORK, &r, &err), KDS_OK,
                 "%s", err.msg);
    cr_expect(r.forked);
    cr_expect_str_eq(r.session, "h-2");
    cr_expect_eq(r.other_head, moved.head);
    sess_session_info h, fk;
    cr_assert_eq(sess_session_get(st, "h", &h, &err), KDS_OK);
    cr_expect_eq(h.head, moved.head, "the other writer's head stays");
    cr_assert_eq(sess_session_get(st, "h-2", &fk, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(fk.head, r.snapshot);
    cr_expect_eq(fk.fork_point, base);
    cr_expect_str_eq(fk.parent, "h");
    cr_expect_str_eq(fk.mode, "plain");
    cr_expect_eq(fk.turns, 2);
    sess_snapshot_info si;
    cr_assert_eq(sess_snapshot_get(st, r.snapshot, &si, &err), KDS_OK);
    cr_expect_eq(si.parent, base);
    cr_expect_eq(si.n_new_chunks, 1, "the fork shares the base's MLA rows");
    /* the fork holds exactly this sequence */
    size_t n = eng_seq_state_bytes(s), m;
    unsigned char *want = malloc(n);
    cr_assert_eq(eng_seq_state_save(s, want, n, &err), KDS_OK);
    unsigned char *got = tsu_snapshot_state(st, r.snapshot, &f, &m);
    cr_assert_eq(m, n);
    cr_expect_eq(memcmp(got, want, n), 0);
    free(got);
    free(want);
    /* a second conflicting save (from the same stale base) gets the next name */
    cr_assert_eq(sess_save_ex(st, "h", base, f.m, s, NULL, SESS_CONFLICT_FORK, &r, &err), KDS_OK,
                 "%s", err.msg);
    cr_expect_str_eq(r.session, "h-3");
    /* no conflict: the session itself moves on */
    cr_assert_eq(sess_save_ex(st, "h-2", fk.head, f.m, s, NULL, SESS_CONFLICT_FORK, &r, &err),
                 KDS_OK, "%s", err.msg);
    cr_expect(!r.forked);
    cr_expect_str_eq(r.session, "h-2");
    eng_seq_free(s);
    sess_close(st);
    tsu_close_model(&f);
    free(db);
    tmu_rmtree(tmp);
    free(tmp);
}

/* Claims: another live process is reported, a dead one's claim dropped. */
Test(sess_writers, claims_report_the_living_only, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    sess_store *st = tsu_open_store(tmp);
    kds_err err = {0};
    sess_writer other;
    bool busy = true;
    cr_assert_eq(sess_writer_claim(st, "c", "test", &other, &busy, &err), KDS_OK, "%s", err.msg);
    cr_expect(!busy, "this process alone");
    cr_assert_eq(sess_writer_claim(st, "c", "test", &other, &busy, &err), KDS_OK);
    cr_expect(!busy, "claiming twice is a no-op");

    /* a claim left by a process that has exited */
    pid_t dead = fork();
    cr_assert_geq(dead, 0);
    if (dead == 0) _exit(0);
    waitpid(dead, NULL, 0);
    char host[64];
    gethostname(host, sizeof host);
    host[63] = '\0';
    sess_writer w = {.pid = dead, .since_us = 1};
    snprintf(w.host, sizeof w.host, "%s", host);
    snprintf(w.program, sizeof w.program, "serve");
    unsigned char *rec;
    size_t len;
    cr_assert_eq(sess__writer_encode(&w, 0, &rec, &len, &err), KDS_OK);
    char key[200];
    int kl = snprintf(key, sizeof key, "writer/c/%s/%d", host, (int)dead);
    cr_assert_eq(sess__raw_put(st, "meta", key, (size_t)kl, rec, len, &err), KDS_OK);
    cr_assert_eq(sess_writer_claim(st, "c", "test", &other, &busy, &err), KDS_OK);
    cr_expect(!busy, "a dead writer is not reported");
    void *v;
    size_t vn;
    cr_expect_eq(sess__raw_get(st, "meta", key, (size_t)kl, &v, &vn, &err), KDS_NOT_FOUND,
                 "the dead writer's claim is dropped");

    /* a live one (the parent of this test process is as good as any) */
    w.pid = getppid();
    w.since_us = 7;
    free(rec);
    cr_assert_eq(sess__writer_encode(&w, 0, &rec, &len, &err), KDS_OK);
    kl = snprintf(key, sizeof key, "writer/c/%s/%d", host, (int)w.pid);
    cr_assert_eq(sess__raw_put(st, "meta", key, (size_t)kl, rec, len, &err), KDS_OK);
    cr_assert_eq(sess_writer_claim(st, "c", "test", &other, &busy, &err), KDS_OK);
    cr_expect(busy);
    cr_expect_eq(other.pid, (int64_t)getppid());
    cr_expect_str_eq(other.program, "serve");
    char who[200];
    sess_writer_describe(&other, who, sizeof who);
    char want[32];
    snprintf(want, sizeof want, "pid %d (kdaserve serve", (int)getppid());
    cr_expect(strstr(who, want), "%s", who);
    /* released, this process's claim is gone; the other stays */
    cr_assert_eq(sess_writer_release(st, "c", &err), KDS_OK);
    cr_assert_eq(sess_writer_claim(st, "d", "test", &other, &busy, &err), KDS_OK);
    cr_expect(!busy, "claims are per session");
    free(rec);
    sess_close(st);
    tmu_rmtree(tmp);
    free(tmp);
}
