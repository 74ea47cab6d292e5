/*
 * Empty sessions: a session saved before its first token (the server
 * creates one that way, to record its mode) reopens in a new process, for
 * a pure-KDA and a hybrid model. For the hybrid model the load restores
 * zero MLA rows into a sequence whose MLA cache was never allocated: no
 * call may then pass its NULL rows to memset/memcpy (undefined behaviour,
 * reported by a -DKDS_SANITIZE=ON build, where the command-line half of
 * this test halts on the first UBSan report).
 */
#include "test_sess_util.h"

static void empty_session_reopens(const char *model) {
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db");
    tsu_model f = tsu_open_model(model);
    kds_err err = {0};
    /* created the way the server creates a session: 0 tokens, mode only */
    sess_store *st = tsu_open_store(db);
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 0, &s, &err), KDS_OK);
    sess_turn mode = {.mode = "plain"};
    uint64_t id = 0;
    cr_assert_eq(sess_save(st, "empty", 0, f.m, s, &mode, &id, &err), KDS_OK, "%s", err.msg);
    eng_seq_free(s);
    sess_close(st);

    /* "restart": a new store handle and a fresh sequence */
    st = tsu_open_store(db);
    cr_assert_eq(eng_seq_create(f.m, 0, &s, &err), KDS_OK);
    sess_snapshot_info si;
    cr_assert_eq(sess_load(st, id, f.m, s, &si, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(si.tokens, 0);
    cr_expect_eq(eng_seq_pos(s), 0);
    eng_seq_free(s);
    sess_close(st);

    /* and a new process opens it (UBSan, when built in, halts on a report) */
    char out[16384];
    int rc = tsu_run(out, sizeof out, NULL,
                     "UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 " TSU_KDASERVE
                     " chat --db %s --session empty --plain </dev/null 2>&1",
                     db);
    cr_expect_eq(rc, 0, "chat --session empty: exit %d: %s", rc, out);
    cr_expect_null(strstr(out, "runtime error"), "undefined behaviour opening it:\n%s", out);
    cr_expect(strstr(out, "session 'empty'"), "%s", out);
    rc = tsu_run(out, sizeof out, NULL,
                 "UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 " TSU_KDASERVE
                 " generate --db %s --session empty --prompt 'a' --max-tokens 2 2>&1",
                 db);
    cr_expect_eq(rc, 0, "generate --session empty: exit %d: %s", rc, out);
    cr_expect_null(strstr(out, "runtime error"), "undefined behaviour resuming it:\n%s", out);
    tsu_close_model(&f);
    free(db);
    tmu_rmtree(tmp);
    free(tmp);
}

Test(sess_empty, hybrid_zero_token_session_reopens, .timeout = 60) {
    empty_session_reopens(TMU_MICRO_HYBRID);
}

Test(sess_empty, kda_zero_token_session_reopens, .timeout = 60) {
    empty_session_reopens(TMU_MICRO_KDA);
}
