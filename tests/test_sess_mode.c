/*
 * The optional `mode` field of a session record (docs/snapshot-format.md):
 * a save whose turn declares a mode records it, later saves that declare
 * none keep it, a fork and an export/import carry it, a session that never
 * declared one reads as "", and a malformed mode is refused before anything
 * is written.
 */
#include "test_sess_util.h"

static void expect_mode(sess_store *st, const char *name, const char *mode) {
    sess_session_info si;
    kds_err err = {0};
    cr_assert_eq(sess_session_get(st, name, &si, &err), KDS_OK, "%s", err.msg);
    cr_expect_str_eq(si.mode, mode, "session '%s'", name);
}

Test(sess_mode, recorded_kept_forked_exported, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db"), *file = tmu_path(tmp, "x.kds");
    tsu_model f = tsu_open_model(TMU_MICRO_KDA);
    sess_store *st = tsu_open_store(db);
    eng_seq *s = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_seq_create(f.m, 1, &s, &err), KDS_OK);
    uint64_t base = 0;

    /* never declared: "" */
    tsu_feed(&f, s, 5, 1);
    sess_turn plain = {.prompt = "a", .prompt_len = 1, .output = "", .prompt_tokens = 5};
    cr_assert_eq(sess_save(st, "old", 0, f.m, s, &plain, &base, &err), KDS_OK, "%s", err.msg);
    expect_mode(st, "old", "");
    /* declared later: recorded */
    tsu_feed(&f, s, 3, 2);
    plain.mode = "plain";
    cr_assert_eq(sess_save(st, "old", base, f.m, s, &plain, &base, &err), KDS_OK, "%s", err.msg);
    expect_mode(st, "old", "plain");

    /* chat declared, then saves without a turn or without a mode keep it */
    eng_seq_reset(s, 1);
    tsu_feed(&f, s, 4, 3);
    sess_turn chat = {.prompt = "b", .prompt_len = 1, .output = "", .mode = "chat"};
    uint64_t cb = 0;
    cr_assert_eq(sess_save(st, "c", 0, f.m, s, &chat, &cb, &err), KDS_OK, "%s", err.msg);
    expect_mode(st, "c", "chat");
    tsu_feed(&f, s, 2, 4);
    cr_assert_eq(sess_save(st, "c", cb, f.m, s, NULL, &cb, &err), KDS_OK, "%s", err.msg);
    tsu_feed(&f, s, 2, 5);
    chat.mode = NULL;
    cr_assert_eq(sess_save(st, "c", cb, f.m, s, &chat, &cb, &err), KDS_OK, "%s", err.msg);
    expect_mode(st, "c", "chat");

    /* a fork carries it; so does an export and import */
    cr_assert_eq(sess_fork(st, "c", "c2", NULL, &err), KDS_OK, "%s", err.msg);
    expect_mode(st, "c2", "chat");
    cr_assert_eq(sess_export(st, "c", file, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(sess_import(st, file, "c3", NULL, NULL, &err), KDS_OK, "%s", err.msg);
    expect_mode(st, "c3", "chat");

    /* malformed modes: refused, nothing written (head and mode unchanged) */
    const char *bad[] = {"", "Chat", "chat mode", "abcdefghijklmnop", NULL};
    for (int i = 0; bad[i]; i++) {
        tsu_feed(&f, s, 1, 6);
        sess_turn t = {.prompt = "x", .prompt_len = 1, .output = "", .mode = bad[i]};
        uint64_t id = 0;
        cr_expect_eq(sess_save(st, "c", cb, f.m, s, &t, &id, &err), KDS_INVALID_ARG,
                     "mode '%s' accepted", bad[i]);
        cr_expect(strstr(err.msg, "invalid session mode"), "%s", err.msg);
    }
    sess_session_info si;
    cr_assert_eq(sess_session_get(st, "c", &si, &err), KDS_OK);
    cr_expect_eq(si.head, cb);
    cr_expect_str_eq(si.mode, "chat");
    /* and the records read back after reopening the store */
    sess_close(st);
    st = tsu_open_store(db);
    expect_mode(st, "old", "plain");
    expect_mode(st, "c2", "chat");

    eng_seq_free(s);
    sess_close(st);
    tsu_close_model(&f);
    tmu_rmtree(tmp);
    free(tmp);
    free(db);
    free(file);
}
