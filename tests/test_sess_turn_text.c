/*
 * Long transcript texts (docs/snapshot-format.md, "Transcript turn"): a
 * prompt of SESS_TURN_PAYLOAD_MIN bytes or more is kept in a version-2
 * turn's payload, zstd-compressed when that is smaller. A 20 MiB document
 * (over the 16 MiB a record header may hold, so it could not be saved
 * before) saves, reads back byte for byte, takes a fraction of its size and
 * goes through export and import; incompressible text is kept as it is;
 * short turns stay version 1; a damaged payload is refused naming the turn,
 * and the rest of the session stays usable.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "sess_internal.h"
#include "test_helpers.h"
#include "test_model_util.h"
#include "test_sess_util.h"

static char *prose(size_t n, uint32_t seed) {
    static const char *words[] = {"the", "whale", "ship", "sea", "captain", "Ishmael", "said",
                                  "and", "of", "morning", "storm", "harpoon"};
    char *p = malloc(n + 1);
    cr_assert(p);
    size_t i = 0;
    while (i < n) {
        seed = seed * 1664525u + 1013904223u;
        const char *w = words[(seed >> 8) % 12];
        for (const char *c = w; *c && i < n; c++) p[i++] = *c;
        if (i < n) p[i++] = (seed >> 20) % 13 ? ' ' : '\n';
    }
    p[n] = '\0';
    return p;
}

/* The raw record of turn `k` (0-based) of session `name`. */
static void *turn_record(sess_store *st, const char *name, uint32_t k, size_t *len) {
    sess_session_info si;
    kds_err e = {0};
    cr_assert_eq(sess_session_get(st, name, &si, &e), KDS_OK, "%s", e.msg);
    unsigned char key[12];
    sess__turn_key(key, si.id, k);
    void *rec = NULL;
    cr_assert_eq(sess__raw_get(st, "transcripts", key, 12, &rec, len, &e), KDS_OK, "%s", e.msg);
    return rec;
}

static uint32_t version_of(const void *rec) {
    const unsigned char *p = rec;
    return (uint32_t)p[8] | (uint32_t)p[9] << 8 | (uint32_t)p[10] << 16 | (uint32_t)p[11] << 24;
}

Test(sess_turn_text, long_prompts_in_the_payload, .timeout = 120) {
    char *tmp = tmu_mkdtemp();
    char *model = tsu_gen_model(tmp, "m", "tiny", 3);
    char *db = tmu_path(tmp, "db");
    tsu_model f = tsu_open_model(model);
    sess_store *st = tsu_open_store(db);
    kds_err e = {0};
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 1, &s, &e), KDS_OK);
    const size_t BIG = (size_t)20 << 20, RAW = 6000;
    char *doc = prose(BIG, 7);
    char *noise = malloc(RAW);
    cr_assert(noise);
    uint64_t x = 99;
    for (size_t i = 0; i < RAW; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        noise[i] = (char)(x >> 56);
    }
    const char *texts[3] = {doc, noise, "a short turn"};
    size_t lens[3] = {BIG, RAW, strlen(texts[2])};
    uint64_t base = 0;
    for (int t = 0; t < 3; t++) {
        tsu_feed(&f, s, 3, (uint32_t)t);
        sess_turn turn = {.prompt = texts[t], .prompt_len = lens[t], .output = "ok",
                          .output_len = 2, .prompt_tokens = 3, .mode = "plain",
                          .doc_name = t == 0 ? "big.txt" : NULL, .doc_bytes = t == 0 ? (int64_t)BIG : 0};
        cr_assert_eq(sess_save(st, "doc", base, f.m, s, &turn, &base, &e), KDS_OK,
                     "turn %d (%zu bytes): %s", t, lens[t], e.msg);
    }
    size_t n0, n1, n2;
    void *r0 = turn_record(st, "doc", 0, &n0), *r1 = turn_record(st, "doc", 1, &n1),
         *r2 = turn_record(st, "doc", 2, &n2);
    cr_expect_eq(version_of(r0), 2);
    cr_expect_eq(version_of(r1), 2);
    cr_expect_eq(version_of(r2), 1, "a short turn stays version 1 (older builds read it)");
    cr_expect_lt(n0, BIG / 2, "the document's record is %zu bytes for %zu of text", n0, BIG);
    cr_expect_gt(n1, RAW, "incompressible text is kept as it is");
    /* read back, byte for byte */
    sess_turn_record *tr = NULL;
    size_t nt = 0;
    cr_assert_eq(sess_transcript(st, "doc", &tr, &nt, &e), KDS_OK, "%s", e.msg);
    cr_assert_eq(nt, 3);
    for (int t = 0; t < 3; t++) {
        cr_expect_eq(tr[t].prompt_len, lens[t], "turn %d", t);
        cr_expect(tr[t].prompt_len == lens[t] && memcmp(tr[t].prompt, texts[t], lens[t]) == 0,
                  "turn %d's prompt differs", t);
        cr_expect_str_eq(tr[t].output, "ok");
    }
    cr_expect_str_eq(tr[0].doc_name, "big.txt");
    cr_expect_eq(tr[0].doc_bytes, (int64_t)BIG);
    sess_transcript_free(tr, nt);
    /* export and import carry it */
    char *file = tmu_path(tmp, "doc.kdsx");
    cr_assert_eq(sess_export(st, "doc", file, &e), KDS_OK, "%s", e.msg);
    cr_assert_eq(sess_import(st, file, "doc2", NULL, NULL, &e), KDS_OK, "%s", e.msg);
    cr_assert_eq(sess_transcript(st, "doc2", &tr, &nt, &e), KDS_OK, "%s", e.msg);
    cr_assert_eq(nt, 3);
    cr_expect(tr[0].prompt_len == BIG && memcmp(tr[0].prompt, doc, BIG) == 0,
              "the imported document differs");
    sess_transcript_free(tr, nt);
    sess_close(st);
    /* a flipped byte in the compressed payload: refused, naming the turn;
     * the session still loads */
    tsu_flip_in_file(db, r0, n0, n0 - n0 / 3);
    st = tsu_open_store(db);
    cr_expect_eq(sess_transcript(st, "doc", &tr, &nt, &e), KDS_CORRUPT, "a damaged turn was read");
    cr_expect(strstr(e.msg, "turn 1"), "the message does not name the turn: %s", e.msg);
    sess_session_info si;
    cr_assert_eq(sess_session_get(st, "doc", &si, &e), KDS_OK, "%s", e.msg);
    eng_seq *back = NULL;
    cr_assert_eq(eng_seq_create(f.m, 1, &back, &e), KDS_OK);
    cr_expect_eq(sess_load(st, si.head, f.m, back, NULL, &e), KDS_OK, "the state: %s", e.msg);
    eng_seq_free(back);
    sess_close(st);
    eng_seq_free(s);
    tsu_close_model(&f);
    free(r0);
    free(r1);
    free(r2);
    free(doc);
    free(noise);
    free(file);
    tmu_rmtree(tmp);
    free(db);
    free(model);
    free(tmp);
}
