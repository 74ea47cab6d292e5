/*
 * The store: map growth on MDB_MAP_FULL without losing a write (and a clean
 * refusal at the map limit), export/import round trips (API and command
 * line, byte-identical states, transcripts kept, damaged or truncated files
 * refused with the store unchanged), garbage collection of unreferenced
 * snapshots and chunks, and the default data directory.
 */
#include "sess_internal.h"
#include "test_sess_util.h"

#define MICRO_HYBRID TMU_MICRO_HYBRID

static size_t map_size(sess_store *st) {
    sess_store_stats z;
    kds_err err = {0};
    cr_assert_eq(sess_store_stats_get(st, &z, &err), KDS_OK, "%s", err.msg);
    return z.map_size;
}

Test(sess_store, map_grows_when_full, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *model = tsu_gen_model(tmp, "m", "tiny", 4); /* ~300 KB of state a snapshot */
    char *db = tmu_path(tmp, "db");
    tsu_model f = tsu_open_model(model);
    sess_params p = sess_default_params();
    p.map_size = 64 << 10; /* smaller than one snapshot */
    sess_store *st = NULL;
    kds_err err = {0};
    cr_assert_eq(sess_open(db, &p, &st, &err), KDS_OK, "%s", err.msg);
    size_t first = map_size(st);
    cr_assert_leq(first, (size_t)128 << 10);
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 1, &s, &err), KDS_OK);
    uint64_t ids[10], base = 0;
    unsigned char *states[10];
    size_t n = 0;
    for (int i = 0; i < 10; i++) {
        tsu_feed(&f, s, 3, (uint32_t)i);
        cr_assert_eq(sess_save(st, "grow", base, f.m, s, NULL, &ids[i], &err), KDS_OK,
                     "save %d: %s", i, err.msg);
        base = ids[i];
        n = eng_seq_state_bytes(s);
        states[i] = malloc(n);
        cr_assert_eq(eng_seq_state_save(s, states[i], n, &err), KDS_OK);
    }
    size_t grown = map_size(st);
    cr_assert_gt(grown, (size_t)10 * 300000, "map %zu after 10 snapshots", grown);
    sess_close(st);
    /* reopened with the small setting: keeps the data, grows again on need */
    cr_assert_eq(sess_open(db, &p, &st, &err), KDS_OK, "%s", err.msg);
    for (int i = 0; i < 10; i++) {
        size_t m;
        unsigned char *b = tsu_snapshot_state(st, ids[i], &f, &m);
        cr_assert_eq(m, n);
        cr_assert_eq(memcmp(b, states[i], n), 0, "snapshot %d changed", i);
        free(b);
        free(states[i]);
    }
    tsu_feed(&f, s, 2, 50);
    cr_assert_eq(sess_save(st, "grow", base, f.m, s, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    sess_close(st);

    /* at the limit: refused, named, nothing half-written, store still usable */
    char *db2 = tmu_path(tmp, "db2");
    p.map_max = 1 << 20;
    cr_assert_eq(sess_open(db2, &p, &st, &err), KDS_OK, "%s", err.msg);
    kds_status rc = KDS_OK;
    int saved = 0;
    char name[16];
    for (int i = 0; i < 8 && rc == KDS_OK; i++) {
        snprintf(name, sizeof name, "x%d", i);
        rc = sess_save(st, name, 0, f.m, s, NULL, NULL, &err);
        saved += rc == KDS_OK;
    }
    cr_assert_eq(rc, KDS_TOO_LARGE, "%s", err.msg);
    cr_assert(strstr(err.msg, "full"), "%s", err.msg);
    cr_assert_geq(saved, 1);
    sess_session_info *ss = NULL;
    size_t ns = 0;
    cr_assert_eq(sess_session_list(st, &ss, &ns, &err), KDS_OK);
    cr_assert_eq(ns, (size_t)saved, "the refused save left a session behind");
    for (size_t i = 0; i < ns; i++)
        cr_assert_eq(sess_verify(st, ss[i].head, f.m, &err), KDS_OK, "%s", err.msg);
    free(ss);
    sess_close(st);
    eng_seq_free(s);
    tsu_close_model(&f);
    free(db);
    free(db2);
    free(model);
    tmu_rmtree(tmp);
    free(tmp);
}

/* A hybrid session of three turns with transcript, and a fork. */
static uint64_t build_session(sess_store *st, tsu_model *f) {
    kds_err err = {0};
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f->m, 4, &s, &err), KDS_OK);
    uint64_t head = 0;
    const char *prompts[3] = {"first", "second\nline", ""};
    for (int i = 0; i < 3; i++) {
        tsu_feed(f, s, 6 + i, (uint32_t)(10 + i));
        char out[32];
        snprintf(out, sizeof out, "output %d\x01", i);
        sess_turn t = {.prompt = prompts[i], .prompt_len = strlen(prompts[i]), .output = out,
                       .output_len = strlen(out), .prompt_tokens = 6 + i, .output_tokens = 0};
        cr_assert_eq(sess_save(st, "conv", head, f->m, s, &t, &head, &err), KDS_OK, "%s",
                     err.msg);
    }
    char forked[SESS_NAME_MAX + 1];
    cr_assert_eq(sess_fork(st, "conv", NULL, forked, &err), KDS_OK, "%s", err.msg);
    cr_assert_str_eq(forked, "conv-2");
    eng_seq_free(s);
    return head;
}

Test(sess_store, export_import_round_trip, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *dba = tmu_path(tmp, "a"), *dbb = tmu_path(tmp, "b"), *file = tmu_path(tmp, "x.kds");
    char *file2 = tmu_path(tmp, "snap.kds"), *bad = tmu_path(tmp, "bad.kds");
    tsu_model f = tsu_open_model(MICRO_HYBRID);
    sess_store *a = tsu_open_store(dba), *b = tsu_open_store(dbb);
    kds_err err = {0};
    uint64_t head = build_session(a, &f);
    cr_assert_eq(sess_export(a, "conv", file, &err), KDS_OK, "%s", err.msg);
    char name[SESS_NAME_MAX + 1];
    uint64_t id;
    cr_assert_eq(sess_import(b, file, NULL, name, &id, &err), KDS_OK, "%s", err.msg);
    cr_assert_str_eq(name, "conv");
    size_t na, nb;
    unsigned char *sa = tsu_snapshot_state(a, head, &f, &na);
    unsigned char *sb = tsu_snapshot_state(b, id, &f, &nb);
    cr_assert_eq(na, nb);
    cr_assert_eq(memcmp(sa, sb, na), 0, "imported state differs");
    cr_assert_eq(sess_verify(b, id, f.m, &err), KDS_OK, "%s", err.msg);
    sess_session_info ia, ib;
    cr_assert_eq(sess_session_get(a, "conv", &ia, &err), KDS_OK);
    cr_assert_eq(sess_session_get(b, "conv", &ib, &err), KDS_OK);
    cr_assert_eq(ib.head, id);
    cr_assert_eq(ib.tokens, ia.tokens);
    cr_assert_eq(ib.turns, 3);
    cr_assert_str_eq(ib.fingerprint, ia.fingerprint);
    cr_assert_str_eq(ib.owner, ia.owner);
    sess_turn_record *tr = NULL;
    size_t nt = 0;
    cr_assert_eq(sess_transcript(b, "conv", &tr, &nt, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(nt, 3);
    cr_assert_str_eq(tr[1].prompt, "second\nline");
    cr_assert_str_eq(tr[2].output, "output 2\x01");
    sess_transcript_free(tr, nt);
    /* the name is taken now; another name works; a bare snapshot too */
    cr_assert_eq(sess_import(b, file, NULL, NULL, NULL, &err), KDS_EXISTS);
    cr_assert_eq(sess_import(b, file, "again", NULL, NULL, &err), KDS_OK, "%s", err.msg);
    char ref[32];
    snprintf(ref, sizeof ref, "@%llu", (unsigned long long)head);
    cr_assert_eq(sess_export(a, ref, file2, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(sess_import(b, file2, NULL, name, &id, &err), KDS_OK, "%s", err.msg);
    cr_assert(strncmp(name, "import-", 7) == 0, "%s", name);
    cr_assert_eq(sess_verify(b, id, f.m, &err), KDS_OK, "%s", err.msg);

    /* damaged or truncated files are refused and the store is unchanged */
    sess_store_stats before, after;
    cr_assert_eq(sess_store_stats_get(b, &before, &err), KDS_OK);
    size_t n;
    char *bytes = tmu_read(file, &n);
    cr_assert(bytes);
    size_t spots[4] = {3, 30, n / 2, n - 5};
    for (int i = 0; i < 4; i++) {
        bytes[spots[i]] ^= 0x04;
        cr_assert(tmu_write(bad, bytes, n));
        cr_expect_neq(sess_import(b, bad, "damaged", NULL, NULL, &err), KDS_OK,
                      "flip at %zu accepted", spots[i]);
        bytes[spots[i]] ^= 0x04;
    }
    cr_assert(tmu_write(bad, bytes, n - 1000));
    cr_expect_neq(sess_import(b, bad, "damaged", NULL, NULL, &err), KDS_OK, "truncated accepted");
    cr_expect(strstr(err.msg, bad), "the message names the file: %s", err.msg);
    cr_assert_eq(sess_store_stats_get(b, &after, &err), KDS_OK);
    cr_expect_eq(after.sessions, before.sessions);
    cr_expect_eq(after.snapshots, before.snapshots);
    cr_expect_eq(after.chunks, before.chunks);
    cr_expect_eq(sess_import(b, "/nonexistent/x.kds", NULL, NULL, NULL, &err), KDS_NOT_FOUND);
    free(bytes);
    free(sa);
    free(sb);
    sess_close(a);
    sess_close(b);
    tsu_close_model(&f);
    free(dba);
    free(dbb);
    free(file);
    free(file2);
    free(bad);
    tmu_rmtree(tmp);
    free(tmp);
}

/* Export in one store, import in another, continue in a new process: the
 * same text as continuing the original. */
Test(sess_store, export_import_through_the_cli, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *model = tsu_gen_model(tmp, "m", "tiny-hybrid", 8);
    static char out[8192], a[8192], b[8192];
    size_t na, nb;
    const char *gen = "--max-tokens 10 --temperature 1 --ignore-eos";
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " generate --model %s --db %s/a --session s --prompt hi %s "
                                      "2>/dev/null", model, tmp, gen), 0);
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " snap export s %s/s.kds --db %s/a", tmp, tmp), 0, "%s", out);
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " snap import %s/s.kds --db %s/b", tmp, tmp), 0, "%s", out);
    cr_assert(strstr(out, "as session 's'"), "%s", out);
    cr_assert_eq(tsu_run(a, sizeof a, &na, TSU_KDASERVE " generate --db %s/a --session s %s "
                         "2>/dev/null", tmp, gen), 0);
    cr_assert_eq(tsu_run(b, sizeof b, &nb, TSU_KDASERVE " generate --db %s/b --session s %s "
                         "2>/dev/null", tmp, gen), 0);
    cr_assert_eq(na, nb);
    cr_assert_eq(memcmp(a, b, na), 0, "imported session continues differently");
    cr_assert_eq(tsu_run(out, sizeof out, NULL,
                         TSU_KDASERVE " snap import %s/s.kds --db %s/b 2>&1", tmp, tmp), 1);
    cr_assert(strstr(out, "already exists"), "%s", out);
    free(model);
    tmu_rmtree(tmp);
    free(tmp);
}

Test(sess_store, gc_reclaims_only_unreferenced, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    tsu_model f = tsu_open_model(MICRO_HYBRID);
    sess_store *st = tsu_open_store(tmp);
    kds_err err = {0};
    uint64_t head = build_session(st, &f); /* conv (3 snapshots, 3 chunks) + fork conv-2 */
    sess_gc_stats g;
    cr_assert_eq(sess_gc(st, &g, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(g.snapshots_freed, 2, "the two older turns' snapshots");
    cr_expect_eq(g.chunks_freed, 0, "every chunk is still referenced by the head");
    cr_expect_eq(g.snapshots_kept, 1);
    cr_expect_eq(g.chunks_kept, 3);
    /* the head is shared by conv and conv-2: deleting one keeps it */
    cr_assert_eq(sess_session_delete(st, "conv", &err), KDS_OK);
    cr_assert_eq(sess_gc(st, &g, &err), KDS_OK);
    cr_expect_eq(g.snapshots_freed, 0);
    cr_expect_eq(sess_verify(st, head, f.m, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(sess_snapshot_delete(st, head, &err), KDS_BUSY, "a head cannot be deleted");
    cr_assert_eq(sess_session_delete(st, "conv-2", &err), KDS_OK);
    cr_expect_eq(sess_session_delete(st, "conv-2", &err), KDS_NOT_FOUND);
    cr_assert_eq(sess_gc(st, &g, &err), KDS_OK);
    cr_expect_eq(g.snapshots_freed, 1);
    cr_expect_eq(g.chunks_freed, 3);
    sess_store_stats z;
    cr_assert_eq(sess_store_stats_get(st, &z, &err), KDS_OK);
    cr_expect_eq(z.snapshots + z.chunks + z.sessions, 0);
    sess_turn_record *tr;
    size_t nt;
    cr_expect_eq(sess_transcript(st, "conv", &tr, &nt, &err), KDS_NOT_FOUND);
    sess_close(st);
    tsu_close_model(&f);
    tmu_rmtree(tmp);
    free(tmp);
}

Test(sess_store, default_dir_and_names) {
    char buf[1024];
    kds_err err = {0};
    setenv("XDG_DATA_HOME", "/x/data", 1);
    cr_assert_eq(sess_default_dir(buf, sizeof buf, &err), KDS_OK);
    cr_expect_str_eq(buf, "/x/data/kdaserve");
    unsetenv("XDG_DATA_HOME");
    setenv("HOME", "/home/u", 1);
    cr_assert_eq(sess_default_dir(buf, sizeof buf, &err), KDS_OK);
    cr_expect_str_eq(buf, "/home/u/.local/share/kdaserve");
    cr_expect(sess_name_valid("chat-1.b_2"));
    cr_expect(!sess_name_valid("-x"));
    cr_expect(!sess_name_valid("@1"));
    cr_expect(!sess_name_valid("a b"));
    cr_expect(!sess_name_valid("a/b"));
    cr_expect(!sess_name_valid(""));
    uint64_t id;
    cr_expect(sess_parse_snapshot_id("@42", &id) && id == 42);
    cr_expect(!sess_parse_snapshot_id("@0", &id));
    cr_expect(!sess_parse_snapshot_id("@4x", &id));
}

/* Another process grows the map while this one has the store open with a
 * small map: the next transaction here adopts the new size (LMDB reports
 * MDB_MAP_RESIZED) and reads and writes go on. */
Test(sess_store, map_grown_by_another_process, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *model = tsu_gen_model(tmp, "m", "tiny", 6);
    char *db = tmu_path(tmp, "db");
    tsu_model f = tsu_open_model(model);
    sess_params p = sess_default_params();
    p.map_size = 64 << 10;
    sess_store *st = NULL;
    kds_err err = {0};
    cr_assert_eq(sess_open(db, &p, &st, &err), KDS_OK, "%s", err.msg);
    char out[4096];
    for (int i = 0; i < 4; i++)
        cr_assert_eq(tsu_run(out, sizeof out, NULL,
                             TSU_KDASERVE " generate --model %s --db %s --session other "
                                          "--prompt 'turn %d' --max-tokens 2 2>&1",
                             model, db, i), 0, "%s", out);
    sess_session_info si;
    cr_assert_eq(sess_session_get(st, "other", &si, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(si.turns, 4);
    cr_assert_eq(sess_verify(st, si.head, f.m, &err), KDS_OK, "%s", err.msg);
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 0, &s, &err), KDS_OK);
    cr_assert_eq(sess_load(st, si.head, f.m, s, NULL, &err), KDS_OK, "%s", err.msg);
    tsu_feed(&f, s, 3, 1);
    cr_assert_eq(sess_save(st, "other", si.head, f.m, s, NULL, NULL, &err), KDS_OK, "%s",
                 err.msg);
    cr_assert_gt(map_size(st), (size_t)4 * 300000);
    eng_seq_free(s);
    sess_close(st);
    tsu_close_model(&f);
    free(db);
    free(model);
    tmu_rmtree(tmp);
    free(tmp);
}
