/*
 * Refusals, never damage: a snapshot with one flipped byte (in the LMDB
 * file itself, in its payload or its header), an unknown format version, a
 * bad magic, a truncated record, a damaged MLA chunk, a hostile msgpack
 * header, or a snapshot of another model is refused with an error naming
 * the reason; the sequence it was to load into is left as it was, and every
 * other snapshot still loads, verifies and takes new turns. Also refused: a
 * save whose base is no longer the session's head, and a hybrid sequence
 * that does not continue its base.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <unistd.h>

#include "sess_internal.h"
#include "test_sess_util.h"

#define MICRO_KDA TMU_MICRO_KDA
#define MICRO_HYBRID TMU_MICRO_HYBRID

/* Three sessions s0, s1, s2 of different contexts; their heads in heads[]. */
static void three_sessions(sess_store *st, tsu_model *f, uint64_t heads[3]) {
    kds_err err = {0};
    for (int i = 0; i < 3; i++) {
        eng_seq *s = NULL;
        cr_assert_eq(eng_seq_create(f->m, (uint64_t)i, &s, &err), KDS_OK);
        tsu_feed(f, s, 10 + 7 * i, 100u + (uint32_t)i);
        char name[8];
        snprintf(name, sizeof name, "s%d", i);
        cr_assert_eq(sess_save(st, name, 0, f->m, s, NULL, &heads[i], &err), KDS_OK, "%s",
                     err.msg);
        eng_seq_free(s);
    }
}

static void expect_loads(sess_store *st, tsu_model *f, uint64_t id) {
    kds_err err = {0};
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f->m, 0, &s, &err), KDS_OK);
    cr_expect_eq(sess_load(st, id, f->m, s, NULL, &err), KDS_OK, "@%llu: %s",
                 (unsigned long long)id, err.msg);
    cr_expect_eq(sess_verify(st, id, f->m, &err), KDS_OK, "@%llu: %s", (unsigned long long)id,
                 err.msg);
    eng_seq_free(s);
}

/* Load must fail with `want` and a message containing `text`, leaving a
 * sequence that already holds a state exactly as it was. */
static void expect_refused(sess_store *st, tsu_model *f, uint64_t id, kds_status want,
                           const char *text) {
    kds_err err = {0};
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f->m, 0, &s, &err), KDS_OK);
    tsu_feed(f, s, 3, 5);
    size_t n = eng_seq_state_bytes(s);
    unsigned char *before = malloc(n), *after = malloc(n);
    cr_assert_eq(eng_seq_state_save(s, before, n, &err), KDS_OK);
    kds_status rc = sess_load(st, id, f->m, s, NULL, &err);
    cr_expect_eq(rc, want, "@%llu: got %s (%s), expected %s", (unsigned long long)id,
                 kds_status_str(rc), err.msg, kds_status_str(want));
    cr_expect(strstr(err.msg, text), "@%llu: message lacks '%s': %s", (unsigned long long)id,
              text, err.msg);
    cr_assert_eq(eng_seq_state_bytes(s), n);
    cr_assert_eq(eng_seq_state_save(s, after, n, &err), KDS_OK);
    cr_expect_eq(memcmp(before, after, n), 0, "a refused load changed the sequence");
    cr_expect_neq(sess_verify(st, id, f->m, &err), KDS_OK, "verify passed a refused snapshot");
    free(before);
    free(after);
    eng_seq_free(s);
}

/* The store still takes a new turn on session `name`. */
static void expect_writable(sess_store *st, tsu_model *f, const char *name) {
    kds_err err = {0};
    sess_session_info si;
    cr_assert_eq(sess_session_get(st, name, &si, &err), KDS_OK, "%s", err.msg);
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f->m, 0, &s, &err), KDS_OK);
    cr_assert_eq(sess_load(st, si.head, f->m, s, NULL, &err), KDS_OK, "%s", err.msg);
    tsu_feed(f, s, 4, 77);
    uint64_t id;
    cr_assert_eq(sess_save(st, name, si.head, f->m, s, NULL, &id, &err), KDS_OK, "%s", err.msg);
    expect_loads(st, f, id);
    eng_seq_free(s);
}

static unsigned char *raw_snapshot(sess_store *st, uint64_t id, size_t *n) {
    unsigned char k[8];
    sess__key64(k, id);
    void *v = NULL;
    kds_err err = {0};
    cr_assert_eq(sess__raw_get(st, "snapshots", k, 8, &v, n, &err), KDS_OK, "%s", err.msg);
    return v;
}

static void put_snapshot(sess_store *st, uint64_t id, const void *v, size_t n) {
    unsigned char k[8];
    sess__key64(k, id);
    kds_err err = {0};
    cr_assert_eq(sess__raw_put(st, "snapshots", k, 8, v, n, &err), KDS_OK, "%s", err.msg);
}

static void flipped_byte_in_lmdb_file(size_t (*where)(size_t len), const char *why) {
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db");
    tsu_model f = tsu_open_model(MICRO_KDA);
    sess_store *st = tsu_open_store(db);
    uint64_t h[3];
    three_sessions(st, &f, h);
    size_t n;
    unsigned char *rec = raw_snapshot(st, h[1], &n);
    sess_close(st);
    tsu_flip_in_file(db, rec, n, where(n));
    st = tsu_open_store(db);
    expect_refused(st, &f, h[1], KDS_CORRUPT, why);
    expect_loads(st, &f, h[0]);
    expect_loads(st, &f, h[2]);
    expect_writable(st, &f, "s0");
    expect_writable(st, &f, "s2");
    sess_close(st);
    /* the command line says the same, one line per snapshot */
    char out[8192];
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap verify --db %s --model %s",
                         db, MICRO_KDA), 1, "%s", out);
    char want[64];
    snprintf(want, sizeof want, "FAILED  @%llu", (unsigned long long)h[1]);
    cr_expect(strstr(out, want) && strstr(out, why), "%s", out);
    snprintf(want, sizeof want, "ok      @%llu", (unsigned long long)h[0]);
    cr_expect(strstr(out, want), "%s", out);
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " generate --db %s --session s1 "
                         "--model %s --max-tokens 2 2>&1", db, MICRO_KDA), 1);
    cr_expect(strstr(out, why), "generate names the reason: %s", out);
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " generate --db %s --session s2 "
                         "--model %s --max-tokens 2 2>&1", db, MICRO_KDA), 0, "%s", out);
    free(rec);
    tsu_close_model(&f);
    free(db);
    tmu_rmtree(tmp);
    free(tmp);
}

static size_t in_payload(size_t len) { return len - len / 3; }
static size_t in_header(size_t len) { return (void)len, 40; } /* inside the fingerprint */

Test(sess_refuse, flipped_payload_byte_in_lmdb_file, .timeout = 60) {
    flipped_byte_in_lmdb_file(in_payload, "payload checksum mismatch");
}

Test(sess_refuse, flipped_header_byte_in_lmdb_file, .timeout = 60) {
    flipped_byte_in_lmdb_file(in_header, "header checksum mismatch");
}

Test(sess_refuse, version_magic_truncation, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    tsu_model f = tsu_open_model(MICRO_KDA);
    sess_store *st = tsu_open_store(tmp);
    uint64_t h[3];
    three_sessions(st, &f, h);
    size_t n;
    unsigned char *good = raw_snapshot(st, h[0], &n);
    unsigned char *bad = malloc(n);
    memcpy(bad, good, n);
    bad[8] = 99; /* format version */
    put_snapshot(st, h[0], bad, n);
    expect_refused(st, &f, h[0], KDS_UNSUPPORTED, "unknown format version 99");
    memcpy(bad, good, n);
    bad[1] ^= 0x20; /* magic */
    put_snapshot(st, h[0], bad, n);
    expect_refused(st, &f, h[0], KDS_BAD_FORMAT, "bad magic");
    put_snapshot(st, h[0], good, n - 100); /* truncated */
    expect_refused(st, &f, h[0], KDS_CORRUPT, "payload");
    put_snapshot(st, h[0], good, 20); /* cut inside the frame */
    expect_refused(st, &f, h[0], KDS_BAD_FORMAT, "magic");
    memcpy(bad, good, n);
    bad[12] ^= 0x40; /* header length */
    put_snapshot(st, h[0], bad, n);
    expect_refused(st, &f, h[0], KDS_CORRUPT, "header");
    expect_loads(st, &f, h[1]);
    expect_loads(st, &f, h[2]);
    /* restored, it loads again: the refusals changed nothing else */
    put_snapshot(st, h[0], good, n);
    expect_loads(st, &f, h[0]);
    free(good);
    free(bad);
    sess_close(st);
    tsu_close_model(&f);
    tmu_rmtree(tmp);
    free(tmp);
}

Test(sess_refuse, hostile_msgpack_header, .timeout = 30) {
    /* an array32 header that claims 2^32-1 elements in 5 bytes, and deep
     * nesting: the bounded walk refuses both before msgpack-c sees them */
    const unsigned char huge[] = {0x81, 0xa1, 'x', 0xdd, 0xff, 0xff, 0xff, 0xff};
    cr_expect(!sess__msgpack_sane(huge, sizeof huge));
    unsigned char deep[40];
    for (int i = 0; i < 39; i++) deep[i] = 0x91; /* [[[[...]]]] */
    deep[39] = 0xc0;
    cr_expect(!sess__msgpack_sane(deep, sizeof deep));
    const unsigned char ok[] = {0x82, 0xa1, 'a', 0x01, 0xa1, 'b', 0x92, 0xc3, 0xcb, 0, 0, 0, 0, 0,
                                0, 0, 0};
    cr_expect(sess__msgpack_sane(ok, sizeof ok));
    cr_expect(!sess__msgpack_sane(ok, sizeof ok - 1), "truncated");
    unsigned char trail[sizeof ok + 1];
    memcpy(trail, ok, sizeof ok);
    trail[sizeof ok] = 0xc0;
    cr_expect(!sess__msgpack_sane(trail, sizeof trail), "trailing bytes");
    /* stored as a snapshot with a valid frame and header checksum */
    char *tmp = tmu_mkdtemp();
    tsu_model f = tsu_open_model(MICRO_KDA);
    sess_store *st = tsu_open_store(tmp);
    uint64_t h[3];
    three_sessions(st, &f, h);
    unsigned char rec[SESS_FRAME_BYTES + sizeof huge];
    memcpy(rec + SESS_FRAME_BYTES, huge, sizeof huge);
    sess__frame_write(rec, SESS_MAGIC_SNAPSHOT, SESS_VERSION_SNAPSHOT, sizeof huge);
    put_snapshot(st, h[2], rec, sizeof rec);
    expect_refused(st, &f, h[2], KDS_CORRUPT, "msgpack");
    expect_loads(st, &f, h[0]);
    sess_close(st);
    tsu_close_model(&f);
    tmu_rmtree(tmp);
    free(tmp);
}

Test(sess_refuse, damaged_chunk_refuses_only_its_snapshots, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    tsu_model f = tsu_open_model(MICRO_HYBRID);
    sess_store *st = tsu_open_store(tmp);
    kds_err err = {0};
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 1, &s, &err), KDS_OK);
    tsu_feed(&f, s, 12, 1);
    uint64_t a, b;
    cr_assert_eq(sess_save(st, "h", 0, f.m, s, NULL, &a, &err), KDS_OK, "%s", err.msg);
    tsu_feed(&f, s, 5, 2);
    cr_assert_eq(sess_save(st, "h", a, f.m, s, NULL, &b, &err), KDS_OK, "%s", err.msg);
    sess_snapshot_info ib;
    cr_assert_eq(sess_snapshot_get(st, b, &ib, &err), KDS_OK);
    cr_assert_eq(ib.n_chunks, 2);
    cr_assert_eq(ib.n_new_chunks, 1);
    /* b's own chunk is the newest record: ids are allocated in order, the
     * snapshot first, then its chunks */
    unsigned char k[8];
    sess__key64(k, b + 1);
    void *v;
    size_t n;
    cr_assert_eq(sess__raw_get(st, "chunks", k, 8, &v, &n, &err), KDS_OK, "%s", err.msg);
    ((unsigned char *)v)[n - 3] ^= 1;
    cr_assert_eq(sess__raw_put(st, "chunks", k, 8, v, n, &err), KDS_OK);
    expect_refused(st, &f, b, KDS_CORRUPT, "chunk");
    expect_loads(st, &f, a); /* shares only the undamaged first chunk */
    free(v);
    eng_seq_free(s);
    sess_close(st);
    tsu_close_model(&f);
    tmu_rmtree(tmp);
    free(tmp);
}

Test(sess_refuse, foreign_model, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    /* same preset, other weights: identical state layout, other fingerprint */
    char *m1 = tsu_gen_model(tmp, "m1", "tiny", 1);
    char *m2 = tsu_gen_model(tmp, "m2", "tiny", 2);
    char *db = tmu_path(tmp, "db");
    tsu_model f1 = tsu_open_model(m1), f2 = tsu_open_model(m2), fh = tsu_open_model(MICRO_HYBRID);
    sess_store *st = tsu_open_store(db);
    kds_err err = {0};
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f1.m, 1, &s, &err), KDS_OK);
    tsu_feed(&f1, s, 9, 3);
    uint64_t id;
    cr_assert_eq(sess_save(st, "mine", 0, f1.m, s, NULL, &id, &err), KDS_OK, "%s", err.msg);
    expect_refused(st, &f2, id, KDS_MISMATCH, "another model");
    eng_seq *t = NULL;
    cr_assert_eq(eng_seq_create(f2.m, 0, &t, &err), KDS_OK);
    cr_assert_eq(sess_load(st, id, f2.m, t, NULL, &err), KDS_MISMATCH);
    cr_expect(strstr(err.msg, eng_model_fingerprint(f1.m)) &&
                  strstr(err.msg, eng_model_fingerprint(f2.m)),
              "both fingerprints named: %s", err.msg);
    cr_expect_eq(sess_verify(st, id, f2.m, &err), KDS_MISMATCH);
    cr_expect_eq(sess_verify(st, id, NULL, &err), KDS_OK, "checksums alone are fine");
    expect_refused(st, &fh, id, KDS_MISMATCH, "another model");
    /* saving another model's sequence onto the session is refused too */
    tsu_feed(&f2, t, 4, 8);
    cr_expect_eq(sess_save(st, "mine", id, f2.m, t, NULL, NULL, &err), KDS_MISMATCH);
    expect_loads(st, &f1, id);
    sess_close(st);
    /* through the command line: refused with the reason, store unharmed */
    char out[8192];
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " generate --db %s --session mine "
                         "--model %s --max-tokens 3 2>&1", db, m2), 1);
    cr_expect(strstr(out, "another model"), "%s", out);
    /* it names the directory the store recorded and what to do (issue 16) */
    char hint[1200];
    snprintf(hint, sizeof hint, "open it with --model %s", eng_model_dir(f1.m));
    cr_expect(strstr(out, hint), "no '%s' in: %s", hint, out);
    /* serve says so at start, before any client asks */
    cr_expect_eq(tsu_run(out, sizeof out, NULL, "timeout -s TERM 6 " TSU_KDASERVE " serve --listen "
                         "127.0.0.1:0 --db %s --model %s 2>&1", db, m2) >= 0, 1);
    snprintf(hint, sizeof hint, "1 of the 1 sessions in %s were made by another model (e.g. "
             "'mine', by %s)", db, eng_model_dir(f1.m));
    cr_expect(strstr(out, hint), "no '%s' in: %s", hint, out);
    cr_expect(strstr(out, "listening on"), "serve did not start: %s", out);
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " generate --db %s --session mine "
                         "--max-tokens 3 2>&1", db), 0, "%s", out);
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap verify --db %s --model %s",
                         db, m2), 1);
    cr_expect(strstr(out, "another model"), "%s", out);
    cr_expect_eq(tsu_run(out, sizeof out, NULL, TSU_KDASERVE " snap verify --db %s --model %s",
                         db, m1), 0, "%s", out);
    eng_seq_free(s);
    eng_seq_free(t);
    tsu_close_model(&f1);
    tsu_close_model(&f2);
    tsu_close_model(&fh);
    free(m1);
    free(m2);
    free(db);
    tmu_rmtree(tmp);
    free(tmp);
}

Test(sess_refuse, stale_base_and_foreign_sequence, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    tsu_model f = tsu_open_model(MICRO_HYBRID);
    sess_store *st = tsu_open_store(tmp);
    kds_err err = {0};
    eng_seq *s = NULL, *other = NULL;
    cr_assert_eq(eng_seq_create(f.m, 1, &s, &err), KDS_OK);
    tsu_feed(&f, s, 8, 1);
    uint64_t a, b;
    cr_assert_eq(sess_save(st, "h", 0, f.m, s, NULL, &a, &err), KDS_OK);
    tsu_feed(&f, s, 3, 2);
    cr_assert_eq(sess_save(st, "h", a, f.m, s, NULL, &b, &err), KDS_OK);
    /* a writer still holding the old head cannot move it back */
    tsu_feed(&f, s, 3, 3);
    cr_expect_eq(sess_save(st, "h", a, f.m, s, NULL, NULL, &err), KDS_BUSY);
    cr_expect(strstr(err.msg, "moved"), "%s", err.msg);
    /* a sequence that does not continue its base is not spliced onto it */
    cr_assert_eq(eng_seq_create(f.m, 1, &other, &err), KDS_OK);
    tsu_feed(&f, other, 20, 99);
    cr_expect_eq(sess_save(st, "h", b, f.m, other, NULL, NULL, &err), KDS_MISMATCH);
    cr_expect(strstr(err.msg, "does not continue"), "%s", err.msg);
    sess_store_stats z;
    cr_assert_eq(sess_store_stats_get(st, &z, &err), KDS_OK);
    cr_expect_eq(z.snapshots, 2, "refused saves wrote nothing");
    cr_expect_eq(sess_save(st, "h", b, f.m, s, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(sess_save(st, "bad name", 0, f.m, s, NULL, NULL, &err), KDS_INVALID_ARG);
    cr_expect_eq(sess_save(st, "@3", 0, f.m, s, NULL, NULL, &err), KDS_INVALID_ARG);
    eng_seq_free(s);
    eng_seq_free(other);
    sess_close(st);
    tsu_close_model(&f);
    tmu_rmtree(tmp);
    free(tmp);
}

Test(sess_refuse, damaged_session_record, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    tsu_model f = tsu_open_model(MICRO_KDA);
    sess_store *st = tsu_open_store(tmp);
    uint64_t h[3];
    three_sessions(st, &f, h);
    kds_err err = {0};
    cr_assert_eq(sess_session_delete(st, "s2", &err), KDS_OK); /* h[2]: garbage now */
    void *v;
    size_t n;
    cr_assert_eq(sess__raw_get(st, "sessions", "s1", 2, &v, &n, &err), KDS_OK, "%s", err.msg);
    ((unsigned char *)v)[n / 2] ^= 0x08;
    cr_assert_eq(sess__raw_put(st, "sessions", "s1", 2, v, n, &err), KDS_OK);
    sess_session_info si;
    cr_expect_eq(sess_session_get(st, "s1", &si, &err), KDS_CORRUPT);
    cr_expect(strstr(err.msg, "session 's1'") && strstr(err.msg, "checksum"), "%s", err.msg);
    /* listed (flagged), others fine, nothing its head might be is collected */
    sess_session_info *ss = NULL;
    size_t ns = 0;
    cr_assert_eq(sess_session_list(st, &ss, &ns, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(ns, 2);
    cr_expect_eq(ss[0].tokens, 10, "s0 is readable");
    cr_expect_str_eq(ss[1].name, "s1");
    cr_expect_eq(ss[1].tokens, -1);
    free(ss);
    sess_gc_stats g;
    cr_assert_eq(sess_gc(st, &g, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(g.snapshots_freed, 0);
    cr_expect_eq(sess_snapshot_delete(st, h[2], &err), KDS_BUSY);
    expect_loads(st, &f, h[1]);
    expect_writable(st, &f, "s0");
    /* the snapshot is still there to fork a repaired session from */
    char ref[32];
    snprintf(ref, sizeof ref, "@%llu", (unsigned long long)h[1]);
    cr_expect_eq(sess_fork(st, ref, "s1-rescued", NULL, &err), KDS_OK, "%s", err.msg);
    free(v);
    sess_close(st);
    tsu_close_model(&f);
    tmu_rmtree(tmp);
    free(tmp);
}
