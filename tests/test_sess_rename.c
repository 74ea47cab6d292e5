/*
 * Renaming a session keeps everything but the name (head, transcript,
 * metadata), frees the old name, refuses a taken or invalid name and a
 * missing session without changing anything; an empty sequence can be saved
 * (a session created before its first turn), and a turn with neither prompt
 * nor output records the mode without a transcript entry.
 */
#include "test_sess_util.h"

Test(sess_rename, rename_keeps_everything, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *model = tsu_gen_model(tmp, "m", "tiny", 5);
    char db[600];
    snprintf(db, sizeof db, "%s/db", tmp);
    tsu_model f = tsu_open_model(model);
    sess_store *st = tsu_open_store(db);
    kds_err err = {0};
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 1, &s, &err), KDS_OK);

    /* empty: saved, mode only, no transcript entry */
    sess_turn declare = {.mode = "plain"};
    uint64_t snap0 = 0;
    cr_assert_eq(sess_save(st, "a", 0, f.m, s, &declare, &snap0, &err), KDS_OK, "%s", err.msg);
    sess_session_info A;
    cr_assert_eq(sess_session_get(st, "a", &A, &err), KDS_OK);
    cr_assert_eq(A.tokens, 0);
    cr_assert_eq(A.turns, 0, "a mode-only save adds no transcript entry");
    cr_assert_str_eq(A.mode, "plain");

    tsu_feed(&f, s, 20, 3);
    sess_turn t = {.prompt = "p", .prompt_len = 1, .output = "o", .output_len = 1,
                   .prompt_tokens = 20};
    uint64_t snap1 = 0;
    cr_assert_eq(sess_save(st, "a", snap0, f.m, s, &t, &snap1, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(sess_fork(st, "a", "b", NULL, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(sess_session_get(st, "a", &A, &err), KDS_OK);

    /* refusals change nothing */
    cr_assert_eq(sess_session_rename(st, "a", "b", &err), KDS_EXISTS, "%s", err.msg);
    cr_assert_eq(sess_session_rename(st, "a", "a", &err), KDS_EXISTS);
    cr_assert_eq(sess_session_rename(st, "nope", "c", &err), KDS_NOT_FOUND);
    cr_assert_eq(sess_session_rename(st, "a", "-bad", &err), KDS_INVALID_ARG);
    sess_session_info again;
    cr_assert_eq(sess_session_get(st, "a", &again, &err), KDS_OK);
    cr_assert_eq(again.head, A.head);

    cr_assert_eq(sess_session_rename(st, "a", "c", &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(sess_session_get(st, "a", &again, &err), KDS_NOT_FOUND, "the old name is free");
    sess_session_info C;
    cr_assert_eq(sess_session_get(st, "c", &C, &err), KDS_OK);
    cr_assert_eq(C.id, A.id);
    cr_assert_eq(C.head, snap1);
    cr_assert_eq(C.tokens, 20);
    cr_assert_eq(C.turns, 1);
    cr_assert_str_eq(C.mode, "plain");
    sess_turn_record *tr = NULL;
    size_t n = 0;
    cr_assert_eq(sess_transcript(st, "c", &tr, &n, &err), KDS_OK);
    cr_assert_eq(n, 1);
    cr_assert_str_eq(tr[0].prompt, "p");
    sess_transcript_free(tr, n);
    /* the renamed session continues: a save on its head works */
    tsu_feed(&f, s, 3, 4);
    cr_assert_eq(sess_save(st, "c", snap1, f.m, s, &t, NULL, &err), KDS_OK, "%s", err.msg);
    eng_seq_free(s);
    sess_close(st);
    tsu_close_model(&f);
    tmu_rmtree(tmp);
    free(model);
    free(tmp);
}
