/*
 * Crash safety: a child process continues a hybrid session in a loop
 * (load the head, feed tokens, save: snapshot + new MLA chunk + head move +
 * transcript entry in one transaction; now and then a fork or a delete) and
 * is killed with SIGKILL at a random moment, 30 times over (half of the
 * kills at any time from start-up on, half once it is saving in a loop). After every
 * kill the store opens (stale reader slots cleared), every snapshot the
 * child reported committed is there and passes verification with the
 * model, every snapshot and session head in the store verifies, and the
 * next child continues from the head. Finally `kdaserve snap verify` in a
 * new process agrees. Kill times come from a seeded generator (printed;
 * KDS_CRASH_SEED=N replays a schedule).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include "test_sess_util.h"

#define ROUNDS 30

/* The writer: runs until killed. Reports each committed snapshot id on fd
 * `out` (8 bytes) after sess_save returned. Never returns. */
static void writer(const char *db, const char *model, int out, unsigned seed) {
    kds_err err = {0};
    eng_model *m = NULL;
    eng_ctx *c = NULL;
    eng_model_params mp = eng_model_default_params();
    mp.no_fingerprint_cache = true;
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    sess_store *st = NULL;
    sess_params p = sess_default_params();
    if (eng_model_load(model, &mp, &m, &err) || eng_ctx_create(m, &cp, &c, &err) ||
        sess_open(db, &p, &st, &err))
        _exit(3);
    const int vocab = eng_model_config(m)->vocab_size;
    for (unsigned it = 0;; it++) {
        sess_session_info si;
        eng_seq *s = NULL;
        if (eng_seq_create(m, 1, &s, &err)) _exit(4);
        uint64_t base = 0;
        kds_status rc = sess_session_get(st, "w", &si, &err);
        if (rc == KDS_OK) {
            if (sess_load(st, si.head, m, s, NULL, &err)) _exit(5);
            base = si.head;
        } else if (rc != KDS_NOT_FOUND) {
            _exit(6);
        }
        int32_t ids[4];
        for (int i = 0; i < 4; i++) {
            seed = seed * 1103515245u + 12345u;
            ids[i] = (int32_t)((seed >> 8) % (unsigned)vocab);
        }
        if (eng_prefill(c, s, ids, 1 + (int)(it % 4), NULL, NULL, NULL, &err)) _exit(7);
        sess_turn t = {.prompt = "x", .prompt_len = 1, .output = "y", .output_len = 1};
        uint64_t id;
        if (sess_save(st, "w", base, m, s, &t, &id, &err)) _exit(8);
        if (write(out, &id, sizeof id) != sizeof id) _exit(9);
        eng_seq_free(s);
        if (it % 5 == 2) { /* other writes die mid-way too */
            char name[SESS_NAME_MAX + 1];
            if (sess_fork(st, "w", NULL, name, &err) == KDS_OK && it % 10 == 7)
                sess_session_delete(st, name, &err);
        }
    }
}

static void add(uint64_t **a, size_t *n, size_t *cap, uint64_t id) {
    if (*n == *cap) {
        *cap = *cap ? 2 * *cap : 64;
        *a = realloc(*a, *cap * sizeof **a);
        cr_assert(*a);
    }
    (*a)[(*n)++] = id;
}

static void verify_all(sess_store *st, tsu_model *f, const uint64_t *committed, size_t n_committed,
                       int round) {
    kds_err err = {0};
    for (size_t i = 0; i < n_committed; i++)
        cr_assert_eq(sess_verify(st, committed[i], f->m, &err), KDS_OK,
                     "round %d: committed snapshot @%llu: %s", round,
                     (unsigned long long)committed[i], err.msg);
    sess_snapshot_info *sn = NULL;
    size_t nn = 0;
    cr_assert_eq(sess_snapshot_list(st, &sn, &nn, &err), KDS_OK, "%s", err.msg);
    cr_assert_geq(nn, n_committed);
    for (size_t i = 0; i < nn; i++)
        cr_assert_eq(sess_verify(st, sn[i].id, f->m, &err), KDS_OK, "round %d: @%llu: %s", round,
                     (unsigned long long)sn[i].id, err.msg);
    free(sn);
    sess_session_info *ss = NULL;
    size_t ns = 0;
    cr_assert_eq(sess_session_list(st, &ss, &ns, &err), KDS_OK, "%s", err.msg);
    for (size_t i = 0; i < ns; i++)
        cr_assert_eq(sess_verify(st, ss[i].head, f->m, &err), KDS_OK, "round %d: '%s': %s", round,
                     ss[i].name, err.msg);
    free(ss);
}

Test(sess_crash, killed_writer_loses_nothing_committed, .timeout = 120) {
    char *tmp = tmu_mkdtemp();
    char *model = tsu_gen_model(tmp, "m", "tiny-hybrid", 3);
    char *db = tmu_path(tmp, "db");
    const char *env = getenv("KDS_CRASH_SEED"); /* replay a failing schedule */
    unsigned seed = env ? (unsigned)strtoul(env, NULL, 10) : (unsigned)time(NULL);
    fprintf(stderr, "sess_crash: kill schedule seed %u\n", seed);
    srand(seed);
    uint64_t *committed = NULL;
    size_t n_committed = 0, cap = 0;
    tsu_model f = tsu_open_model(model);
    int64_t last_tokens = 0;
    int kills_mid_run = 0;
    for (int round = 0; round < ROUNDS; round++) {
        int fds[2];
        cr_assert_eq(pipe(fds), 0);
        /* no store is open in this process while the child runs: LMDB
         * environments must not cross fork(), and the child opens its own */
        pid_t pid = fork();
        cr_assert_geq(pid, 0);
        if (pid == 0) {
            close(fds[0]);
            writer(db, model, fds[1], seed + (unsigned)round);
        }
        close(fds[1]);
        uint64_t id;
        if (round % 2 == 0) {
            /* even rounds: once the writer is in its loop (first commit
             * reported), 0..40 ms on, inside later saves */
            struct pollfd pf = {.fd = fds[0], .events = POLLIN};
            cr_assert_eq(poll(&pf, 1, 20000), 1, "round %d: the writer never committed", round);
            cr_assert_eq(read(fds[0], &id, sizeof id), (ssize_t)sizeof id);
            add(&committed, &n_committed, &cap, id);
            struct timespec d = {0, (rand() % 41) * 1000000L};
            nanosleep(&d, NULL);
        } else {
            /* odd rounds: 1..100 ms after the fork, start-up included */
            struct timespec d = {0, (1 + rand() % 100) * 1000000L};
            nanosleep(&d, NULL);
        }
        kill(pid, SIGKILL);
        int status;
        cr_assert_eq(waitpid(pid, &status, 0), pid);
        cr_assert(WIFSIGNALED(status) || WEXITSTATUS(status) == 0,
                  "round %d: writer failed with exit %d (before it was killed)", round,
                  WEXITSTATUS(status));
        kills_mid_run += WIFSIGNALED(status);
        while (read(fds[0], &id, sizeof id) == sizeof id) add(&committed, &n_committed, &cap, id);
        close(fds[0]);
        sess_store *st = tsu_open_store(db);
        verify_all(st, &f, committed, n_committed, round);
        kds_err err = {0};
        sess_session_info si;
        if (n_committed) {
            cr_assert_eq(sess_session_get(st, "w", &si, &err), KDS_OK, "%s", err.msg);
            /* the head moved only forward, and at least to the last report */
            cr_assert_geq(si.head, committed[n_committed - 1]);
            cr_assert_geq(si.tokens, last_tokens);
            last_tokens = si.tokens;
        }
        sess_close(st);
    }
    cr_assert_gt(n_committed, 0, "the writer never committed: kills came too early");
    cr_assert_gt(kills_mid_run, ROUNDS / 2);
    fprintf(stderr, "sess_crash: %d kills, %zu committed snapshots, session at %lld tokens\n",
            ROUNDS, n_committed, (long long)last_tokens);
    char out[1 << 16];
    cr_assert_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap verify --db %s --model %s",
                         db, model), 0, "%s", out);
    cr_assert(strstr(out, " 0 failed"), "%s", out);
    free(committed);
    tsu_close_model(&f);
    free(db);
    free(model);
    tmu_rmtree(tmp);
    free(tmp);
}
