/*
 * fuzz_sess_fixture.h - the store the snapshot target fuzzes against, made
 * the same way by the target at start-up and by the seed writer
 * (fuzz_seeds.c), so that the committed seeds name records that exist:
 * the hybrid nano model (fuzz_util.h), a fresh store, one session "s" of
 * two turns (5 then 3 tokens, so its head references two MLA chunks), gc
 * (the first turn's snapshot goes), and an export of "s". Ids come from the
 * store's counter and the model's fingerprint from its bytes, both
 * deterministic.
 *
 * Also here: recomputing a record's checksums after a mutation, so that
 * mutated headers and payloads reach the decoders behind the checksums.
 */
#ifndef FUZZ_SESS_FIXTURE_H
#define FUZZ_SESS_FIXTURE_H

#include "fuzz_util.h"

#include "kds_le.h"
#include "sess_internal.h"

typedef struct fz_fixture {
    eng_model *m;
    eng_ctx *ctx;
    sess_store *st;
    uint64_t head;          /* head snapshot of "s" */
    uint64_t chunk0;        /* its first chunk */
    uint64_t sess_id;       /* "s"'s internal id (keys its transcript) */
    char export_path[4200]; /* the export of "s" */
} fz_fixture;

static inline void fz_check(kds_status rc, const kds_err *e, const char *what) {
    if (rc != KDS_OK) {
        fprintf(stderr, "kdsfuzz: fixture: %s: %s\n", what, e->msg);
        abort();
    }
}

/* Build the fixture under scratch/`name`. */
static inline void fz_fixture_make(fz_fixture *fx, const char *name) {
    kds_err e = {0};
    char sub[256];
    memset(fx, 0, sizeof *fx);
    snprintf(sub, sizeof sub, "%s-model", name);
    fx->m = fz_nano_load(FZ_NANO_HYBRID, sub);
    fx->ctx = fz_ctx(fx->m);
    sess_params sp = sess_default_params();
    sp.no_sync = true;
    sp.map_size = (size_t)64 << 20;
    snprintf(sub, sizeof sub, "%s-store", name);
    fz_check(sess_open(fz_path(1, sub), &sp, &fx->st, &e), &e, "sess_open");
    eng_seq *s = NULL;
    fz_check(eng_seq_create(fx->m, 3, &s, &e), &e, "eng_seq_create");
    const int32_t a[5] = {4, 8, 15, 16, 23}, b[3] = {42, 1, 2};
    sess_turn t1 = {.prompt = "hello", .prompt_len = 5, .output = "w\0rld", .output_len = 5,
                    .prompt_tokens = 5, .output_tokens = 0, .mode = "plain"};
    sess_turn t2 = {.prompt = "\xff\xfe", .prompt_len = 2, .output = "", .output_len = 0,
                    .prompt_tokens = 3, .output_tokens = 0, .mode = "plain"};
    uint64_t first;
    fz_check(eng_prefill(fx->ctx, s, a, 5, NULL, NULL, NULL, &e), &e, "prefill");
    fz_check(sess_save(fx->st, "s", 0, fx->m, s, &t1, &first, &e), &e, "save 1");
    fz_check(eng_prefill(fx->ctx, s, b, 3, NULL, NULL, NULL, &e), &e, "prefill");
    fz_check(sess_save(fx->st, "s", first, fx->m, s, &t2, &fx->head, &e), &e, "save 2");
    eng_seq_free(s);
    sess_gc_stats gs;
    fz_check(sess_gc(fx->st, &gs, &e), &e, "gc");
    sess_session_info si;
    fz_check(sess_session_get(fx->st, "s", &si, &e), &e, "session");
    fx->sess_id = si.id;
    /* the head's first chunk, from its header */
    unsigned char k[8];
    void *rec;
    size_t n;
    sess__key64(k, fx->head);
    fz_check(sess__raw_get(fx->st, "snapshots", k, 8, &rec, &n, &e), &e, "raw head");
    sess__snap_hdr h;
    fz_check(sess__snap_parse(rec, n, fx->head, &h, NULL, &e), &e, "head header");
    if (h.n_chunks != 2) {
        fprintf(stderr, "kdsfuzz: fixture: head has %zu chunks, expected 2\n", h.n_chunks);
        abort();
    }
    fx->chunk0 = h.chunks[0].id;
    sess__snap_hdr_free(&h);
    free(rec);
    snprintf(sub, sizeof sub, "%s-export.kds", name);
    snprintf(fx->export_path, sizeof fx->export_path, "%s", fz_path(1, sub));
    fz_check(sess_export(fx->st, "s", fx->export_path, &e), &e, "export");
}

/* The records the target replaces, by the input's mode (1..4). */
typedef struct fz_slot {
    const char *db;
    unsigned char key[16];
    size_t key_len;
} fz_slot;

static inline fz_slot fz_fixture_slot(const fz_fixture *fx, int mode) {
    fz_slot s = {0};
    switch (mode) {
    case 1:
        s.db = "snapshots";
        sess__key64(s.key, fx->head);
        s.key_len = 8;
        break;
    case 2:
        s.db = "chunks";
        sess__key64(s.key, fx->chunk0);
        s.key_len = 8;
        break;
    case 3:
        s.db = "sessions";
        memcpy(s.key, "s", 1);
        s.key_len = 1;
        break;
    default:
        s.db = "transcripts";
        sess__turn_key(s.key, fx->sess_id, 0);
        s.key_len = 12;
        break;
    }
    return s;
}

/* ---- checksums ----------------------------------------------------------- */

/* Recompute one record's checksums in place: the payload's XXH3 where the
 * header has a fixed-width "payload_xxh3" (snapshots, chunks), then the
 * frame's header checksum. A record too short for a frame, or whose header
 * length runs past it, is left alone. */
static inline void fz_fix_record(unsigned char *r, size_t n) {
    if (n < SESS_FRAME_BYTES) return;
    uint32_t h = kds_get32(r + 12);
    if (h > n - SESS_FRAME_BYTES) return;
    unsigned char *hdr = r + SESS_FRAME_BYTES;
    static const char key[] = "\xac" "payload_xxh3" "\xcf";
    const size_t kl = sizeof key - 1;
    unsigned char *q = memmem(hdr, h, key, kl);
    if (q && (size_t)(q - hdr) + kl + 8 <= h) {
        uint64_t x = sess__xxh3(hdr + h, n - SESS_FRAME_BYTES - h);
        for (int i = 0; i < 8; i++) q[kl + i] = (unsigned char)(x >> (56 - 8 * i)); /* msgpack: BE */
    }
    kds_put64(r + 16, sess__xxh3(hdr, h));
}

/* An export file: its frame, then every record its (now valid) header
 * lists, as far as they lie inside the file. */
static inline void fz_fix_export(unsigned char *r, size_t n) {
    fz_fix_record(r, n);
    sess__frame f;
    sess__export_hdr eh;
    if (sess__frame_parse(r, n, SESS_MAGIC_EXPORT, SESS_VERSION_EXPORT, "export", &f, NULL) !=
            KDS_OK ||
        sess__export_hdr_decode(&f, "export", &eh, NULL) != KDS_OK)
        return;
    size_t off = 0;
    unsigned char *p = (unsigned char *)f.payload;
    for (size_t i = 0; i < eh.n && eh.recs[i].len <= f.payload_len - off; i++) {
        fz_fix_record(p + off, (size_t)eh.recs[i].len);
        off += (size_t)eh.recs[i].len;
    }
    free(eh.recs);
}

#endif /* FUZZ_SESS_FIXTURE_H */
