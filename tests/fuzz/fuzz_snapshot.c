/*
 * fuzz_snapshot.c - libFuzzer target: the session store's records and
 * export files (session/sess.h; formats in docs/snapshot-format.md),
 * against the fixture store of fuzz_sess_fixture.h. The first input byte:
 *   bits 0-2   0  the rest is an export file: sess_import it, and if that
 *                 works load, verify and read back the imported session;
 *              1  the rest replaces the head snapshot record of "s",
 *              2  ... its first MLA chunk record,
 *              3  ... the session record of "s",
 *              4  ... its first transcript record,
 *                 and every reader runs over the store (get, list, resolve,
 *                 load into a sequence, verify, transcript, export, import
 *                 of that export); then the original record is put back;
 *   bit 7      recompute the checksums after the mutation (frame header
 *              XXH3, payload XXH3 in the header; for an export file those
 *              of every record inside), so that mutations reach the
 *              decoders behind the checksums instead of stopping there.
 *
 * Properties: no crash, leak or undefined behaviour; a refusal has a
 * message; a sequence a refused load was given is unchanged; once the
 * original record is back, the store reads as before (the head loads).
 */
#include "fuzz_sess_fixture.h"

static fz_fixture fx;
static uint64_t runs;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fz_fixture_make(&fx, "fixture");
    return 0;
}

static void need_msg(kds_status rc, const kds_err *e, const char *what) {
    if (rc != KDS_OK && (e->status == KDS_OK || !e->msg[0]))
        fz_fail("%s failed without a message", what);
}

/* Load `id` into a sequence that already holds a state: on refusal the
 * state must not change. */
static void load_checked(uint64_t id) {
    kds_err e = {0};
    eng_seq *s = NULL;
    if (eng_seq_create(fx.m, 5, &s, &e) != KDS_OK) abort();
    const int32_t ids[2] = {3, 9};
    if (eng_prefill(fx.ctx, s, ids, 2, NULL, NULL, NULL, &e) != KDS_OK) abort();
    size_t n = eng_seq_state_bytes(s);
    unsigned char *before = malloc(n), *after = NULL;
    if (!before || eng_seq_state_save(s, before, n, &e) != KDS_OK) abort();
    sess_snapshot_info info;
    kds_status rc = sess_load(fx.st, id, fx.m, s, &info, &e);
    need_msg(rc, &e, "sess_load");
    if (rc != KDS_OK) {
        size_t m = eng_seq_state_bytes(s);
        after = malloc(m);
        if (!after || eng_seq_state_save(s, after, m, &e) != KDS_OK) abort();
        if (m != n || memcmp(before, after, n) != 0) fz_fail("a refused sess_load changed the sequence");
    } else {
        if (eng_seq_pos(s) != info.tokens) fz_fail("loaded %lld tokens, header says %lld",
                                                   (long long)eng_seq_pos(s), (long long)info.tokens);
        if (eng_seq_pos(s) > 0) (void)eng_decode(fx.ctx, s, 1, &e);
    }
    free(before);
    free(after);
    eng_seq_free(s);
}

/* Import `path` as "imp" and read it back. True when it was imported
 * (drop_import removes it: only once the fixture is whole again, since gc
 * with a replaced session record could take the fixture's own head). */
static bool import_read(const char *path) {
    kds_err e = {0};
    char name[SESS_NAME_MAX + 1];
    uint64_t snap = 0;
    kds_status rc = sess_import(fx.st, path, "imp", name, &snap, &e);
    need_msg(rc, &e, "sess_import");
    if (rc != KDS_OK) return false;
    load_checked(snap);
    rc = sess_verify(fx.st, snap, fx.m, &e);
    need_msg(rc, &e, "sess_verify");
    sess_turn_record *t = NULL;
    size_t nt = 0;
    if (sess_transcript(fx.st, "imp", &t, &nt, &e) == KDS_OK) sess_transcript_free(t, nt);
    return true;
}

static void drop_import(void) {
    kds_err e = {0};
    if (sess_session_delete(fx.st, "imp", &e) != KDS_OK) fz_fail("deleting 'imp': %s", e.msg);
    sess_gc_stats gs;
    if (sess_gc(fx.st, &gs, &e) != KDS_OK) fz_fail("gc after an import: %s", e.msg);
}

/* Every reader over the store, with one record replaced. True when its
 * export was imported back (see drop_import). */
static bool read_all(void) {
    kds_err e = {0};
    sess_snapshot_info si, *sl = NULL;
    sess_session_info ss, *ssl = NULL;
    size_t n = 0;
    need_msg(sess_snapshot_get(fx.st, fx.head, &si, &e), &e, "sess_snapshot_get");
    if (sess_snapshot_list(fx.st, &sl, &n, &e) == KDS_OK) free(sl);
    kds_status rc = sess_session_get(fx.st, "s", &ss, &e);
    need_msg(rc, &e, "sess_session_get");
    if (sess_session_list(fx.st, &ssl, &n, &e) == KDS_OK) free(ssl);
    sess_ref ref;
    (void)sess_resolve(fx.st, "s", &ref, &e);
    if (rc == KDS_OK) {
        bool chat;
        (void)sess_session_chat_mode(fx.st, &ss, eng_model_tokenizer(fx.m), false, &chat, &e);
    }
    load_checked(fx.head);
    need_msg(sess_verify(fx.st, fx.head, fx.m, &e), &e, "sess_verify");
    sess_turn_record *t = NULL;
    size_t nt = 0;
    if (sess_transcript(fx.st, "s", &t, &nt, &e) == KDS_OK) sess_transcript_free(t, nt);
    sess_store_stats stats;
    (void)sess_store_stats_get(fx.st, &stats, &e);
    const char *xp = fz_path(2, "readback.kds");
    return sess_export(fx.st, "s", xp, &e) == KDS_OK && import_read(xp);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const int mode = data[0] & 7;
    const bool fix = data[0] & 0x80;
    if (mode > 4) return 0;
    unsigned char *rec = malloc(size);
    if (!rec) abort();
    size_t n = size - 1;
    memcpy(rec, data + 1, n);
    kds_err e = {0};
    if (mode == 0) {
        if (fix) fz_fix_export(rec, n);
        const char *path = fz_path(2, "input.kds");
        fz_write_file(path, rec, n);
        if (import_read(path)) drop_import();
    } else {
        if (fix) fz_fix_record(rec, n);
        fz_slot sl = fz_fixture_slot(&fx, mode);
        void *orig = NULL;
        size_t orig_n = 0;
        if (sess__raw_get(fx.st, sl.db, sl.key, sl.key_len, &orig, &orig_n, &e) != KDS_OK)
            fz_fail("fixture record missing: %s", e.msg);
        if (sess__raw_put(fx.st, sl.db, sl.key, sl.key_len, rec, n, &e) != KDS_OK)
            fz_fail("raw put: %s", e.msg);
        const bool imported = read_all();
        if (sess__raw_put(fx.st, sl.db, sl.key, sl.key_len, orig, orig_n, &e) != KDS_OK)
            fz_fail("raw put back: %s", e.msg);
        free(orig);
        if (imported) drop_import();
        /* the store is whole again: now and then, prove it */
        if (++runs % 64 == 0 && sess_verify(fx.st, fx.head, fx.m, &e) != KDS_OK)
            fz_fail("the restored fixture does not verify: %s", e.msg);
    }
    free(rec);
    return 0;
}
