/*
 * The prefix index (sess.h, "Prefix index"; session/sess_prefix.c): keys are
 * a function of scope and tokens only, an incremental hash equals a one-shot
 * one, lookups return the longest indexed candidate whose length agrees, a
 * scope never sees another scope's entries, and the index survives closing
 * compacting and reopening the store.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "test_helpers.h"
#include "test_model_util.h"
#include "test_sess_util.h"

static void key_of(const char *scope, const int32_t *ids, int64_t n,
                   unsigned char key[SESS_PREFIX_KEY_LEN]) {
    sess_prefix_hasher *h = NULL;
    cr_assert_eq(sess_prefix_hasher_create(scope, &h, NULL), KDS_OK);
    sess_prefix_hasher_add(h, ids, n);
    cr_assert_eq(sess_prefix_hasher_count(h), n);
    sess_prefix_hasher_key(h, key);
    sess_prefix_hasher_free(h);
}

Test(sess_prefix, keys_depend_on_scope_and_every_token) {
    int32_t ids[64];
    for (int i = 0; i < 64; i++)
        ids[i] = i * 7 + 1;
    unsigned char a[16], b[16], c[16], d[16], e[16];
    key_of("t|fp", ids, 64, a);
    key_of("t|fp", ids, 64, b);
    cr_expect_eq(memcmp(a, b, 16), 0, "the same sequence, the same key");
    key_of("u|fp", ids, 64, c);
    cr_expect_neq(memcmp(a, c, 16), 0, "another scope, another key");
    ids[37]++;
    key_of("t|fp", ids, 64, d);
    cr_expect_neq(memcmp(a, d, 16), 0, "one token changed, another key");
    ids[37]--;
    key_of("t|fp", ids, 63, e);
    cr_expect_neq(memcmp(a, e, 16), 0, "a prefix has its own key");
    /* incremental: the key after each added token is the one-shot key of
     * that prefix, and taking a key leaves the hasher going on */
    sess_prefix_hasher *h = NULL;
    cr_assert_eq(sess_prefix_hasher_create("t|fp", &h, NULL), KDS_OK);
    for (int i = 0; i < 64; i++) {
        sess_prefix_hasher_add(h, &ids[i], 1);
        unsigned char inc[16], one[16];
        sess_prefix_hasher_key(h, inc);
        key_of("t|fp", ids, i + 1, one);
        cr_expect_eq(memcmp(inc, one, 16), 0, "prefix %d", i + 1);
    }
    sess_prefix_hasher_free(h);
}

Test(sess_prefix, longest_indexed_candidate_wins_and_survives_reopen, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char db[600];
    snprintf(db, sizeof db, "%s/db", tmp);
    sess_store *st = tsu_open_store(db);
    int32_t ids[100];
    for (int i = 0; i < 100; i++)
        ids[i] = 1000 + i;
    int64_t lens[4] = {10, 40, 70, 100};
    unsigned char keys[4][SESS_PREFIX_KEY_LEN];
    for (int i = 0; i < 4; i++)
        key_of("alice|fp", ids, lens[i], keys[i]);
    size_t found = 99;
    sess_prefix_entry e;
    kds_err err = {0};
    cr_expect_eq(sess_prefix_find(st, (const unsigned char(*)[16])keys, lens, 4, &found, &e, &err),
                 KDS_NOT_FOUND, "nothing indexed yet");
    sess_prefix_entry p10 = {.snapshot = 5, .tokens = 10, .session = "alice.a"};
    sess_prefix_entry p70 = {.snapshot = 9, .tokens = 70, .session = "alice.b"};
    cr_assert_eq(sess_prefix_put(st, keys[0], &p10, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(sess_prefix_put(st, keys[2], &p70, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(sess_prefix_find(st, (const unsigned char(*)[16])keys, lens, 4, &found, &e, &err),
                 KDS_OK);
    cr_expect_eq(found, 2);
    cr_expect_eq(e.snapshot, 9);
    cr_expect_eq(e.tokens, 70);
    cr_expect_str_eq(e.session, "alice.b");
    /* the caller's retry below a candidate that did not load */
    cr_assert_eq(sess_prefix_find(st, (const unsigned char(*)[16])keys, lens, 2, &found, &e, &err),
                 KDS_OK);
    cr_expect_eq(found, 0);
    cr_expect_eq(e.snapshot, 5);
    /* a length that disagrees with the entry is no match */
    int64_t wrong[4] = {10, 40, 71, 100};
    cr_assert_eq(sess_prefix_find(st, (const unsigned char(*)[16])keys, wrong, 4, &found, &e, &err),
                 KDS_OK);
    cr_expect_eq(found, 0, "the 70-token entry looked up as 71 tokens");
    /* bad entries are refused */
    sess_prefix_entry bad = {.snapshot = 0, .tokens = 3, .session = "x"};
    cr_expect_eq(sess_prefix_put(st, keys[1], &bad, &err), KDS_INVALID_ARG);
    sess_close(st);
    /* compaction copies and counts the index too */
    sess_compact_stats cs;
    cr_assert_eq(sess_compact(db, &cs, &err), KDS_OK, "%s", err.msg);
    st = tsu_open_store(db);
    cr_assert_eq(sess_prefix_find(st, (const unsigned char(*)[16])keys, lens, 4, &found, &e, &err),
                 KDS_OK, "after compacting and reopening");
    cr_expect_eq(found, 2);
    /* another tenant's scope never finds alice's entries */
    unsigned char bob[4][SESS_PREFIX_KEY_LEN];
    for (int i = 0; i < 4; i++)
        key_of("bob|fp", ids, lens[i], bob[i]);
    cr_expect_eq(sess_prefix_find(st, (const unsigned char(*)[16])bob, lens, 4, &found, &e, &err),
                 KDS_NOT_FOUND);
    sess_close(st);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    th_system(cmd);
}

/* gc drops the index entries of the snapshots it frees (and of snapshots
 * that were already gone, and damaged ones) and keeps the rest, so the
 * index never outgrows what it can resume; a dry run only counts. */
Test(sess_prefix, gc_drops_entries_of_freed_snapshots, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *model = tsu_gen_model(tmp, "m", "tiny", 4);
    char *db = tmu_path(tmp, "db");
    tsu_model f = tsu_open_model(model);
    sess_store *st = tsu_open_store(db);
    kds_err err = {0};
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 1, &s, &err), KDS_OK);
    int32_t ids[12];
    for (int i = 0; i < 12; i++)
        ids[i] = 300 + i;
    /* three turns of one session, each end indexed; then an entry of a
     * snapshot that never existed */
    uint64_t snap[3], base = 0;
    unsigned char keys[4][SESS_PREFIX_KEY_LEN];
    int64_t lens[4] = {4, 8, 12, 12};
    for (int t = 0; t < 3; t++) {
        tsu_feed(&f, s, 4, (uint32_t)t);
        cr_assert_eq(sess_save(st, "doc", base, f.m, s, NULL, &snap[t], &err), KDS_OK, "%s", err.msg);
        base = snap[t];
        key_of("|fp", ids, lens[t], keys[t]);
        sess_prefix_entry e = {.snapshot = snap[t], .tokens = lens[t], .session = "doc"};
        cr_assert_eq(sess_prefix_put(st, keys[t], &e, &err), KDS_OK, "%s", err.msg);
    }
    key_of("|other", ids, 12, keys[3]);
    sess_prefix_entry ghost = {.snapshot = snap[2] + 1000, .tokens = 12, .session = "doc"};
    cr_assert_eq(sess_prefix_put(st, keys[3], &ghost, &err), KDS_OK, "%s", err.msg);
    sess_gc_stats g;
    sess_retention none = {0}; /* sess_gc's: heads only, whatever their age */
    cr_assert_eq(sess_prune(st, &none, SESS_PRUNE_HEADS_ONLY | SESS_PRUNE_DRY_RUN, &g, &err), KDS_OK,
                 "%s", err.msg);
    cr_expect_eq(g.index_freed, 3, "a dry run counts %llu", (unsigned long long)g.index_freed);
    cr_assert_eq(sess_gc(st, &g, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(g.snapshots_freed, 2, "the two restore points");
    cr_expect_eq(g.index_freed, 3, "their two entries and the ghost's");
    cr_expect_eq(g.index_kept, 1, "the head's entry");
    size_t found = 99;
    sess_prefix_entry e;
    for (int t = 0; t < 4; t++) {
        kds_status rc = sess_prefix_find(st, (const unsigned char(*)[16]) & keys[t], &lens[t], 1,
                                         &found, &e, &err);
        cr_expect_eq(rc, t == 2 ? KDS_OK : KDS_NOT_FOUND, "entry %d after gc: %s", t, kds_status_str(rc));
    }
    cr_expect_eq(e.snapshot, snap[2]);
    cr_assert_eq(sess_gc(st, &g, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(g.index_freed, 0, "a second gc finds nothing to drop");
    eng_seq_free(s);
    sess_close(st);
    tsu_close_model(&f);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    th_system(cmd);
    free(model);
    free(db);
}

/* A `fork` entry (a WebSocket session's turn) never replaces an entry
 * already under its key, reads back with its flag, and is replaced by a
 * plain one; SESS_CONFLICT_FORK_ALWAYS branches off a session whose head
 * has not moved, which keeps its own head. */
Test(sess_prefix, fork_entries_and_forced_forks, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *model = tsu_gen_model(tmp, "m", "tiny", 4);
    char *db = tmu_path(tmp, "db");
    tsu_model f = tsu_open_model(model);
    sess_store *st = tsu_open_store(db);
    kds_err err = {0};
    int32_t ids[8] = {5, 6, 7, 8, 9, 10, 11, 12};
    unsigned char k1[SESS_PREFIX_KEY_LEN], k2[SESS_PREFIX_KEY_LEN];
    int64_t l1 = 4, l2 = 8;
    key_of("|fp", ids, l1, k1);
    key_of("|fp", ids, l2, k2);
    sess_prefix_entry plain = {.snapshot = 5, .tokens = 4, .session = "api"};
    sess_prefix_entry fork = {.snapshot = 9, .tokens = 4, .session = "ws", .fork = true};
    cr_assert_eq(sess_prefix_put(st, k1, &plain, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(sess_prefix_put(st, k1, &fork, &err), KDS_OK, "%s", err.msg);
    size_t found;
    sess_prefix_entry e;
    cr_assert_eq(sess_prefix_find(st, (const unsigned char(*)[16])k1, &l1, 1, &found, &e, &err), KDS_OK);
    cr_expect_eq(e.snapshot, 5, "a fork entry replaced the stateless client's own");
    cr_expect(!e.fork);
    fork.tokens = 8;
    cr_assert_eq(sess_prefix_put(st, k2, &fork, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(sess_prefix_find(st, (const unsigned char(*)[16])k2, &l2, 1, &found, &e, &err), KDS_OK);
    cr_expect(e.fork && e.snapshot == 9 && !strcmp(e.session, "ws"), "the fork entry reads back");
    plain.tokens = 8;
    cr_assert_eq(sess_prefix_put(st, k2, &plain, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(sess_prefix_find(st, (const unsigned char(*)[16])k2, &l2, 1, &found, &e, &err), KDS_OK);
    cr_expect(!e.fork && e.snapshot == 5, "a plain entry replaces a fork entry");
    /* the forced fork */
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 1, &s, &err), KDS_OK);
    tsu_feed(&f, s, 4, 1);
    uint64_t head = 0;
    cr_assert_eq(sess_save(st, "ws", 0, f.m, s, NULL, &head, &err), KDS_OK, "%s", err.msg);
    tsu_feed(&f, s, 3, 2);
    sess_save_result res;
    cr_assert_eq(sess_save_ex(st, "ws", head, f.m, s, NULL, SESS_CONFLICT_FORK_ALWAYS, &res, &err),
                 KDS_OK, "%s", err.msg);
    cr_expect(res.forked, "not saved as a fork");
    cr_expect_str_eq(res.session, "ws-2");
    sess_session_info si;
    cr_assert_eq(sess_session_get(st, "ws", &si, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(si.head, head, "the forked-from session moved");
    cr_assert_eq(sess_session_get(st, "ws-2", &si, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(si.head, res.snapshot);
    cr_expect_str_eq(si.parent, "ws");
    eng_seq_free(s);
    sess_close(st);
    tsu_close_model(&f);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    th_system(cmd);
    free(model);
    free(db);
}
