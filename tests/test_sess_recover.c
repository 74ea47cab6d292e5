/*
 * One damaged snapshot: `snap verify` names every session it leaves
 * unresumable (the session whose head it is and every fork sharing it),
 * each with the last snapshot of its history that still verifies and the
 * command that goes back to it; `snap recover NAME` does, keeping what the
 * session was as NAME-damaged (nothing is deleted), and the session
 * resumes. For a hybrid model a damaged MLA chunk spoils every later
 * snapshot that shares it: the recovery goes back past all of them.
 */
#include "test_sess_util.h"

#define MICRO_KDA TMU_MICRO_KDA

static void expect_line(const char *out, const char *a, const char *b) {
    const char *p = out;
    while (p && *p) {
        const char *e = strchr(p, '\n');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        char line[1024];
        snprintf(line, sizeof line, "%.*s", (int)(n < sizeof line ? n : sizeof line - 1), p);
        if (strstr(line, a) && (!b || strstr(line, b))) return;
        p = e ? e + 1 : NULL;
    }
    cr_expect(false, "no line with '%s'%s%s in:\n%s", a, b ? " and " : "", b ? b : "", out);
}

Test(sess_recover, verify_names_the_sessions_and_recover_goes_back, .timeout = 120) {
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db");
    char out[16384];
    for (int i = 0; i < 3; i++)
        cr_assert_eq(tsu_run(out, sizeof out, NULL,
                             TSU_KDASERVE " generate --model %s --db %s --session A --prompt "
                                          "' turn %d' --max-tokens 2 2>&1",
                             MICRO_KDA, db, i),
                     0, "%s", out);
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " generate --model %s --db %s --session C --prompt 'c' "
                                      "--max-tokens 2 2>&1",
                         MICRO_KDA, db),
                 0, "%s", out);
    cr_assert_eq(
        tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap fork A --name B --db %s 2>&1", db), 0,
        "%s", out);
    sess_store *st = tsu_open_store(db);
    kds_err err = {0};
    sess_turn_record *t = NULL;
    size_t nt = 0;
    sess_session_info a;
    cr_assert_eq(sess_session_get(st, "A", &a, &err), KDS_OK);
    cr_assert_eq(sess_transcript(st, "A", &t, &nt, &err), KDS_OK);
    cr_assert_eq(nt, 3);
    uint64_t good = t[1].snapshot, bad = a.head;
    cr_assert_eq(t[2].snapshot, bad);
    sess_transcript_free(t, nt);
    sess_close(st);
    tsu_corrupt_head(db, "A");

    /* verify names the sessions it leaves unresumable, and the way back */
    char g[24], b[24];
    snprintf(g, sizeof g, "@%llu", (unsigned long long)good);
    snprintf(b, sizeof b, "@%llu", (unsigned long long)bad);
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap verify --db %s 2>&1", db), 1);
    expect_line(out, "FAILED", b);
    expect_line(out, "session 'A'", g);
    expect_line(out, "session 'B'", g);
    expect_line(out, "snap recover A", NULL);
    expect_line(out, "snap recover B", NULL);
    cr_expect_null(strstr(out, "session 'C'"), "C is sound:\n%s", out);
    /* one snapshot or session: the same */
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap verify B --db %s 2>&1", db), 1);
    expect_line(out, "session 'B'", g);

    /* recover goes back to it and keeps what was there */
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap recover A --db %s 2>&1", db), 0,
                 "%s", out);
    expect_line(out, "'A'", g);
    expect_line(out, "A-damaged", NULL);
    cr_expect_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " generate --db %s --session A --prompt ' again' "
                                      "--max-tokens 2 2>&1",
                         db),
                 0, "A does not resume: %s", out);
    st = tsu_open_store(db);
    sess_session_info ra, rd;
    cr_assert_eq(sess_session_get(st, "A", &ra, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(ra.turns, 3, "two turns up to the good snapshot, then the new one");
    cr_assert_eq(sess_session_get(st, "A-damaged", &rd, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(rd.head, bad, "the damaged state is kept, not deleted");
    cr_expect_eq(rd.turns, 3, "with the whole transcript");
    cr_expect_eq(sess_transcript(st, "A", &t, &nt, &err), KDS_OK);
    cr_expect_eq(nt, 3);
    if (nt == 3) {
        cr_expect_eq(t[1].snapshot, good);
        cr_expect_str_eq(t[2].prompt, " again");
    }
    sess_transcript_free(t, nt);
    /* a sound session has nothing to recover */
    sess_close(st);
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap recover C --db %s 2>&1", db),
                 1);
    cr_expect(strstr(out, "nothing to recover"), "%s", out);
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap recover B --db %s 2>&1", db), 0,
                 "%s", out);
    cr_expect_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " generate --db %s --session B --max-tokens 2 2>&1", db),
                 0, "B does not resume: %s", out);
    free(db);
    tmu_rmtree(tmp);
    free(tmp);
}

/* Hybrid: a damaged MLA chunk spoils the snapshot that wrote it and every
 * later one sharing it; the way back goes past all of them. */
Test(sess_recover, damaged_chunk_goes_back_past_its_sharers, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db");
    tsu_model f = tsu_open_model(TMU_MICRO_HYBRID);
    sess_store *st = tsu_open_store(db);
    kds_err err = {0};
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 3, &s, &err), KDS_OK);
    uint64_t ids[3], head = 0;
    for (int i = 0; i < 3; i++) {
        /* 30 tokens of 160 bytes: a chunk in overflow pages, stored once */
        tsu_feed(&f, s, 30, (uint32_t)(i + 5));
        sess_turn t = {
            .prompt = "p", .prompt_len = 1, .output = "o", .output_len = 1, .prompt_tokens = 30};
        cr_assert_eq(sess_save(st, "h", head, f.m, s, &t, &ids[i], &err), KDS_OK, "%s", err.msg);
        head = ids[i];
    }
    cr_assert_eq(sess_fork(st, "h", "g", NULL, &err), KDS_OK, "%s", err.msg);
    /* the chunk snapshot 2 wrote */
    unsigned char k[8];
    sess__key64(k, ids[1]);
    void *rec;
    size_t len;
    cr_assert_eq(sess__raw_get(st, "snapshots", k, 8, &rec, &len, &err), KDS_OK);
    sess__snap_hdr h;
    cr_assert_eq(sess__snap_parse(rec, len, ids[1], &h, NULL, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(h.n_new_chunks, 1);
    sess__key64(k, h.chunks[h.n_chunks - 1].id);
    sess__snap_hdr_free(&h);
    free(rec);
    cr_assert_eq(sess__raw_get(st, "chunks", k, 8, &rec, &len, &err), KDS_OK);
    sess_close(st);
    tsu_flip_in_file(db, rec, len, len - 7);
    free(rec);

    st = tsu_open_store(db);
    cr_expect_neq(sess_verify(st, ids[1], NULL, &err), KDS_OK);
    cr_expect_neq(sess_verify(st, ids[2], NULL, &err), KDS_OK);
    sess_recovery r;
    cr_assert_eq(sess_session_last_good(st, "g", f.m, &r, &err), KDS_OK, "%s", err.msg);
    cr_expect(!r.head_ok);
    cr_expect_eq(r.to, ids[0], "back past both snapshots sharing the chunk");
    cr_expect_eq(r.turns, 1);
    cr_expect_eq(r.turns_after, 2);
    cr_assert_eq(sess_session_recover(st, "h", f.m, &r, &err), KDS_OK, "%s", err.msg);
    cr_expect_str_eq(r.kept, "h-damaged");
    sess_session_info a, d;
    cr_assert_eq(sess_session_get(st, "h", &a, &err), KDS_OK);
    cr_expect_eq(a.head, ids[0]);
    cr_expect_eq(a.turns, 1);
    cr_expect_eq(a.tokens, 30);
    cr_assert_eq(sess_session_get(st, "h-damaged", &d, &err), KDS_OK);
    cr_expect_eq(d.head, ids[2]);
    cr_expect_eq(d.turns, 3);
    cr_expect_str_eq(d.parent, "h");
    eng_seq *back = NULL;
    cr_assert_eq(eng_seq_create(f.m, 0, &back, &err), KDS_OK);
    cr_expect_eq(sess_load(st, a.head, f.m, back, NULL, &err), KDS_OK, "%s", err.msg);
    /* a second recovery of h: it is sound now */
    cr_expect_eq(sess_session_recover(st, "h", f.m, &r, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "nothing to recover"), "%s", err.msg);
    /* g recovers too, and its kept copy gets its own name */
    cr_assert_eq(sess_session_recover(st, "g", f.m, &r, &err), KDS_OK, "%s", err.msg);
    cr_expect_str_eq(r.kept, "g-damaged");
    eng_seq_free(back);
    eng_seq_free(s);
    sess_close(st);
    tsu_close_model(&f);
    free(db);
    tmu_rmtree(tmp);
    free(tmp);
}
