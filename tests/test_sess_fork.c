/*
 * Forks through the command line: `snap fork` makes new sessions that point
 * at the parent's snapshot without writing any state; two forks continued
 * with different prompts diverge, neither touches the other nor the parent
 * (the parent, continued with the first fork's prompt, says exactly what
 * that fork said), and the forks share the parent's MLA chunks.
 */
#include "test_sess_util.h"

static void stats(sess_store *st, sess_store_stats *s) {
    kds_err err = {0};
    cr_assert_eq(sess_store_stats_get(st, s, &err), KDS_OK, "%s", err.msg);
}

Test(sess_fork, forks_are_independent, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *model = tsu_gen_model(tmp, "m", "tiny-hybrid", 21);
    char db[600];
    snprintf(db, sizeof db, "%s/db", tmp);
    static char out[8192], outB[8192], outC[8192], again[8192];
    size_t n, nB, nC, nA;
    const char *gen = "--max-tokens 12 --temperature 1 --seed 9 --ignore-eos";
    cr_assert_eq(tsu_run(out, sizeof out, &n,
                         TSU_KDASERVE " generate --model %s --db %s --session A --prompt 'Once "
                                      "upon a time' %s 2>/dev/null",
                         model, db, gen),
                 0);
    kds_err err = {0};
    sess_store *st = tsu_open_store(db);
    sess_session_info A0;
    cr_assert_eq(sess_session_get(st, "A", &A0, &err), KDS_OK);
    sess_store_stats before;
    stats(st, &before);
    sess_close(st); /* one open per process at a time: the CLI opens it too */

    cr_assert_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap fork A --name B --db %s", db),
                 0, "%s", out);
    cr_assert(strstr(out, "'B'"), "%s", out);
    cr_assert_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap fork A --db %s", db), 0);
    cr_assert(strstr(out, "'A-2'"), "default fork name: %s", out);
    cr_assert_neq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap fork A --name B --db %s "
                          "2>&1", db), 0, "a taken name is refused");
    cr_assert(strstr(out, "already exists"), "%s", out);

    st = tsu_open_store(db);
    sess_store_stats after;
    stats(st, &after);
    cr_assert_eq(after.snapshots, before.snapshots, "a fork must not write a snapshot");
    cr_assert_eq(after.chunks, before.chunks, "a fork must not write state");
    cr_assert_eq(after.snapshot_bytes, before.snapshot_bytes);
    sess_session_info B, C;
    cr_assert_eq(sess_session_get(st, "B", &B, &err), KDS_OK);
    cr_assert_eq(B.head, A0.head);
    cr_assert_str_eq(B.parent, "A");
    cr_assert_eq(B.turns, A0.turns, "the transcript is copied");
    sess_close(st);

    /* continue B and C (a fork of the snapshot id) differently */
    cr_assert_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap fork @%llu --name C --db %s",
                         (unsigned long long)A0.head, db), 0, "%s", out);
    cr_assert_eq(tsu_run(outB, sizeof outB, &nB,
                         TSU_KDASERVE " generate --db %s --session B --prompt ' there lived' %s "
                                      "2>/dev/null", db, gen), 0);
    cr_assert_eq(tsu_run(outC, sizeof outC, &nC,
                         TSU_KDASERVE " generate --model %s --db %s --session C --prompt ' in a "
                                      "galaxy' %s 2>/dev/null", model, db, gen), 0);
    cr_assert(nB != nC || memcmp(outB, outC, nB) != 0, "the forks did not diverge");

    st = tsu_open_store(db);
    sess_session_info A1;
    cr_assert_eq(sess_session_get(st, "A", &A1, &err), KDS_OK);
    cr_assert_eq(A1.head, A0.head, "continuing a fork moved the parent");
    cr_assert_eq(A1.turns, A0.turns);
    cr_assert_eq(A1.updated_us, A0.updated_us);
    cr_assert_eq(sess_session_get(st, "B", &B, &err), KDS_OK);
    cr_assert_eq(sess_session_get(st, "C", &C, &err), KDS_OK);
    cr_assert_neq(B.head, C.head);
    cr_assert_neq(B.head, A0.head);
    cr_assert_eq(B.turns, A0.turns + 1);
    cr_assert_eq(C.turns, 1, "a fork of a bare snapshot starts an empty transcript");
    cr_assert_eq(sess_verify(st, A0.head, NULL, &err), KDS_OK, "%s", err.msg);
    /* B's snapshot wrote only its own tokens' MLA rows; the rest is shared */
    sess_snapshot_info hb, ha;
    cr_assert_eq(sess_snapshot_get(st, B.head, &hb, &err), KDS_OK);
    cr_assert_eq(sess_snapshot_get(st, A0.head, &ha, &err), KDS_OK);
    cr_assert_gt(hb.token_bytes, 0);
    cr_assert_eq(hb.n_chunks, ha.n_chunks + 1);
    cr_assert_eq(hb.n_new_chunks, 1);
    cr_assert_eq(hb.new_chunk_bytes, (size_t)(hb.tokens - ha.tokens) * hb.token_bytes);
    cr_assert_eq(hb.parent, A0.head);
    sess_close(st);

    /* the parent is untouched: continued the way B was, it says what B said;
     * a fresh fork of the same snapshot continued like C says what C said */
    cr_assert_eq(tsu_run(again, sizeof again, &nA,
                         TSU_KDASERVE " generate --db %s --session A --prompt ' there lived' %s "
                                      "2>/dev/null", db, gen), 0);
    cr_assert_eq(nA, nB);
    cr_assert_eq(memcmp(again, outB, nB), 0, "parent continued differs from its fork:\n%s\n%s",
                 again, outB);
    cr_assert_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap fork @%llu --name D --db %s",
                         (unsigned long long)A0.head, db), 0);
    cr_assert_eq(tsu_run(again, sizeof again, &nA,
                         TSU_KDASERVE " generate --model %s --db %s --session D --prompt ' in a "
                                      "galaxy' %s 2>/dev/null", model, db, gen), 0);
    cr_assert_eq(nA, nC);
    cr_assert_eq(memcmp(again, outC, nC), 0);

    /* deleting the parent leaves the shared snapshot to its forks */
    cr_assert_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap rm A --db %s", db), 0);
    cr_assert_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap gc --db %s", db), 0, "%s", out);
    cr_assert_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap verify --db %s --model %s "
                         "2>&1", db, model), 0, "%s", out);
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " generate --db %s --session B --max-tokens 3 2>/dev/null",
                         db), 0, "B still resumes after its parent was deleted and gc ran");
    free(model);
    tmu_rmtree(tmp);
    free(tmp);
}
