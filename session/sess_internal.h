/*
 * sess_internal.h - session-module internals shared between its files: the
 * record frame every stored value uses, the decoded headers of snapshots,
 * chunks, sessions and turns, the store object and its transaction helpers,
 * and test hooks. Not part of the public API (sess.h is).
 *
 * Record frame (docs/snapshot-format.md), little-endian:
 *   0   8 bytes  magic (per record kind)
 *   8   u32      format version
 *   12  u32      header length H
 *   16  u64      XXH3-64 of the H header bytes
 *   24  H bytes  header: one msgpack map
 *   24+H         payload (its length and XXH3-64 are header fields)
 */
#ifndef SESS_INTERNAL_H
#define SESS_INTERNAL_H

#include <lmdb.h>
#include <stdatomic.h>
#include <pthread.h>

#include "eng_config.h"
#include "sess.h"

#define SESS_FRAME_BYTES 24u
#define SESS_HEADER_MAX ((size_t)16 << 20) /* a header is a few hundred bytes; chunk lists grow */

#define SESS_MAGIC_SNAPSHOT "KDSSNAP\0"
#define SESS_MAGIC_CHUNK "KDSCHUNK"
#define SESS_MAGIC_SESSION "KDSSESS\0"
#define SESS_MAGIC_TURN "KDSTURN\0"
#define SESS_MAGIC_STORE "KDSSTORE"
#define SESS_MAGIC_EXPORT "KDSXPORT"
#define SESS_MAGIC_WRITER "KDSWRITR"
#define SESS_MAGIC_RETENTION "KDSRETN\0"

/* Format versions this build writes and reads (one per record kind, so a
 * kind can change without touching the others). */
#define SESS_VERSION_SNAPSHOT 1u
#define SESS_VERSION_CHUNK 1u
#define SESS_VERSION_SESSION 1u
#define SESS_VERSION_TURN 2u      /* a long prompt in the payload, zstd (1 still read and
                                     written for short turns, so older builds read them) */
#define SESS_VERSION_TURN_INLINE 1u
/* A prompt of at least this many bytes goes to a version-2 turn's payload,
 * compressed: a document's text (megabytes) no longer counts against the
 * header's SESS_HEADER_MAX, and takes about a third of the space. */
#define SESS_TURN_PAYLOAD_MIN 4096u
#define SESS_VERSION_STORE 1u
#define SESS_VERSION_EXPORT 1u
#define SESS_VERSION_WRITER 1u
#define SESS_VERSION_RETENTION 1u

/* A chunk holds at most this many payload bytes (more tokens are split
 * over several chunks), so no single LMDB value gets huge. */
#define SESS_CHUNK_MAX_BYTES ((size_t)64 << 20)

/* ------------------------------------------------------------------------ */
/* Frames (sess_record.c)                                                    */

typedef struct sess__frame {
    const unsigned char *header; /* points into the record */
    size_t header_len;
    const unsigned char *payload;
    size_t payload_len;          /* bytes after the header */
    uint32_t version;
} sess__frame;

/* Check magic, version (must equal `version`), header length, header
 * checksum, and that the header is one well-formed, bounded msgpack map.
 * `what` names the record in messages ("snapshot @12"). */
kds_status sess__frame_parse(const void *rec, size_t len, const char *magic, uint32_t version,
                             const char *what, sess__frame *out, kds_err *err);

/* Write the 24-byte frame in front of an encoded header at rec + 24. */
void sess__frame_write(unsigned char *rec, const char *magic, uint32_t version, size_t header_len);

/* Bounded walk over msgpack bytes: exactly one object, depth <= 8,
 * container counts within the remaining bytes. Protects the msgpack-c
 * decoder from headers that claim huge counts (libs.md §3.3). */
bool sess__msgpack_sane(const unsigned char *p, size_t len);

uint64_t sess__xxh3(const void *p, size_t n);
/* The user running this process (login name, else "uid N"), for a session's
 * owner field. */
void sess__owner(char *buf, size_t cap);
uint64_t sess__now_us(void);

/* ------------------------------------------------------------------------ */
/* Decoded headers                                                           */

typedef struct sess__layout {
    uint32_t kda_layers, mla_layers, kda_heads, kda_v_heads, key_dim, value_dim, conv_width,
        conv_channels, mla_row, vocab;
    uint64_t fixed_bytes, token_bytes;
} sess__layout;

void sess__layout_of(const eng_config *c, sess__layout *out);
/* First field that differs, or NULL. */
const char *sess__layout_diff(const sess__layout *a, const sess__layout *b, uint64_t *va,
                              uint64_t *vb);

typedef struct sess__chunk_ref {
    uint64_t id;
    int64_t t0, t1;
} sess__chunk_ref;

typedef struct sess__snap_hdr {
    char fingerprint[SESS_FP_LEN + 1];
    sess__layout layout;
    int64_t tokens;
    uint64_t parent;
    int64_t created_us;
    uint64_t payload_bytes, payload_xxh3;
    char origin[SESS_NAME_MAX + 1];
    uint32_t n_new_chunks;
    size_t n_chunks;
    sess__chunk_ref *chunks; /* malloc'd; free with sess__snap_hdr_free */
} sess__snap_hdr;

void sess__snap_hdr_free(sess__snap_hdr *h);
/* Encode into a malloc'd buffer *out of *len bytes. The payload checksum is
 * written at fixed width, so the length does not depend on its value. */
kds_status sess__snap_hdr_encode(const sess__snap_hdr *h, unsigned char **out, size_t *len,
                                 kds_err *err);
/* Decode a frame's header; checks the chunk list covers [0, tokens) in
 * order and that the payload length matches. */
kds_status sess__snap_hdr_decode(const sess__frame *f, const char *what, sess__snap_hdr *out,
                                 kds_err *err);
/* Frame + header of a snapshot record. */
kds_status sess__snap_parse(const void *rec, size_t len, uint64_t id, sess__snap_hdr *out,
                            sess__frame *frame, kds_err *err);

typedef struct sess__chunk_hdr {
    int64_t t0, t1;
    uint64_t token_bytes, payload_bytes, payload_xxh3;
} sess__chunk_hdr;

kds_status sess__chunk_hdr_encode(const sess__chunk_hdr *h, unsigned char **out, size_t *len,
                                  kds_err *err);
kds_status sess__chunk_parse(const void *rec, size_t len, uint64_t id, sess__chunk_hdr *out,
                             sess__frame *frame, kds_err *err);

typedef sess_session_info sess__sess_rec;
kds_status sess__session_encode(const sess_session_info *s, unsigned char **out, size_t *len,
                                kds_err *err);
kds_status sess__session_parse(const void *rec, size_t len, const char *what,
                               sess_session_info *out, kds_err *err);

typedef struct sess__turn_hdr {
    const char *prompt;   /* borrowed from the record; parse: NULL when it is in
                             the payload (prompt_z), see sess__turn_prompt */
    size_t prompt_len;    /* the prompt's bytes (uncompressed) */
    const unsigned char *prompt_z; /* parse, version 2: the payload, zstd or raw */
    size_t prompt_z_len;
    bool prompt_zstd;              /* the payload is a zstd frame (else the bytes) */
    const char *output;
    size_t output_len;
    int64_t prompt_tokens, output_tokens, tokens, time_us;
    uint64_t snapshot;
    const char *doc_name;            /* encode: NULL = not a document */
    char doc[SESS_DOC_NAME_MAX + 1]; /* parse: "" = not a document */
    int64_t doc_bytes;
} sess__turn_hdr;

kds_status sess__turn_encode(const sess__turn_hdr *t, unsigned char **out, size_t *len,
                             kds_err *err);
kds_status sess__turn_parse(const void *rec, size_t len, const char *what, sess__turn_hdr *out,
                            kds_err *err);
/* A parsed turn's prompt as a NUL-terminated copy (decompressed from the
 * payload when it is there). Caller frees *out. Errors: KDS_CORRUPT (the
 * payload does not decompress to the header's size), KDS_NOMEM. */
kds_status sess__turn_prompt(const sess__turn_hdr *t, const char *what, char **out, kds_err *err);

/* The snapshot payload is a KDSSTATE fixed state at the header's position
 * (sess_snap.c). */
kds_status sess__check_state_bytes(const sess__frame *f, const sess__snap_hdr *h,
                                   const char *what, kds_err *err);
/* sess_verify without a model, inside a caller's transaction (sess_snap.c). */
kds_status sess__verify_in(sess_store *st, MDB_txn *txn, uint64_t id, kds_err *err);
/* sess_verify with model `m` (may be NULL) inside a caller's transaction. */
kds_status sess__verify_model_in(sess_store *st, MDB_txn *txn, uint64_t id, const eng_model *m,
                                 kds_err *err);

/* Lookups inside a caller's transaction (sess_snap.c): KDS_NOT_FOUND names
 * the snapshot or session and the store. The record points into the map. */
kds_status sess__get_snap(sess_store *st, MDB_txn *txn, uint64_t id, const void **rec,
                          size_t *len, kds_err *err);
kds_status sess__get_session(sess_store *st, MDB_txn *txn, const char *name,
                             sess_session_info *out, kds_err *err);
/* sess_session_list inside a caller's transaction; caller frees *out. */
kds_status sess__list_sessions(sess_store *st, MDB_txn *txn, sess_session_info **out, size_t *n,
                               kds_err *err);

/* One snapshot of a session's history (sess_history.c). */
typedef struct sess__hist {
    uint64_t id;
    int64_t tokens;  /* -1: header unreadable */
    int chain;       /* steps from the head along parent links (0 = head), -1 = not on it */
    uint32_t turn;   /* 1-based transcript turn that saved it, 0 = none */
    bool fork_point; /* the snapshot the session was forked at */
} sess__hist;
/* The snapshots of session `s`'s history present in the store: its head,
 * its chain of parents as far as they remain, the snapshots its transcript
 * names (matched on token count) and its fork point; deduplicated, newest
 * (largest id) first. Caller frees *out. */
kds_status sess__history(sess_store *st, MDB_txn *txn, const sess_session_info *s,
                         sess__hist **out, size_t *n, kds_err *err);

/* A record copied out of a transaction (transcript turns, put again under
 * another key). */
typedef struct sess__kv {
    unsigned char key[12];
    void *val;
    size_t len;
} sess__kv;
/* Copies of the transcript records of session id `id`, in turn order. */
kds_status sess__collect_turns(sess_store *st, MDB_txn *txn, uint64_t id, sess__kv **out,
                               size_t *n, kds_err *err);
void sess__free_kv(sess__kv *a, size_t n);

/* Writer record (meta "writer/<session>/<host>/<pid>"): who declared it
 * writes a session; `start` is the process's start time in clock ticks
 * after boot (/proc/PID/stat), so a reused pid is not taken for it. */
kds_status sess__writer_encode(const sess_writer *w, uint64_t start, unsigned char **out,
                               size_t *len, kds_err *err);
kds_status sess__writer_parse(const void *rec, size_t len, const char *what, sess_writer *w,
                              uint64_t *start, kds_err *err);

/* Retention record (meta "retention"). */
kds_status sess__retention_encode(const sess_retention *r, unsigned char **out, size_t *len,
                                  kds_err *err);
kds_status sess__retention_parse(const void *rec, size_t len, const char *what,
                                 sess_retention *r, kds_err *err);

/* Export file header (sess_record.c). */
enum { SESS_XREC_SESSION = 0, SESS_XREC_TURN = 1, SESS_XREC_SNAPSHOT = 2, SESS_XREC_CHUNK = 3 };
typedef struct sess__xrec {
    int type;
    uint64_t len;
} sess__xrec;
typedef struct sess__export_hdr {
    char kind[16];          /* "session" or "snapshot" */
    char source[SESS_NAME_MAX + 24];
    int64_t created_us;
    size_t n;
    sess__xrec *recs;       /* malloc'd on decode */
} sess__export_hdr;
kds_status sess__export_hdr_encode(const sess__export_hdr *h, unsigned char **out, size_t *len,
                                   kds_err *err);
kds_status sess__export_hdr_decode(const sess__frame *f, const char *what, sess__export_hdr *out,
                                   kds_err *err);

/* Whole-record checks of snapshot / chunk payloads. */
kds_status sess__check_payload(const sess__frame *f, uint64_t want_bytes, uint64_t want_xxh3,
                               const char *what, kds_err *err);

/* ------------------------------------------------------------------------ */
/* Store (sess_store.c)                                                      */

struct sess_store {
    MDB_env *env;
    MDB_dbi db_meta, db_snap, db_chunk, db_sess, db_turn;
    MDB_dbi db_prefix; /* the prefix index, once has_prefix (sess_prefix.c) */
    atomic_bool has_prefix;
    /* Held shared by every call for the length of its transaction, and
     * exclusively to resize the map: LMDB remaps on resize, which would pull
     * the pages out from under a concurrent reader of this process. */
    pthread_rwlock_t lock;
    size_t map_max;
    bool read_only;
    char *dir;
};

/* A write in progress: run by sess__write, which redoes it in a larger map
 * when a put reports MDB_MAP_FULL. */
typedef struct sess__wtxn {
    sess_store *st;
    MDB_txn *txn;
    bool map_full;
    bool disk_full;   /* a write failed for room on the disk (sess__write_err) */
    bool freed;       /* records were deleted: pages went to LMDB's free list */
    size_t bytes;     /* value bytes put so far (how much room the commit needs) */
    uint64_t next_id; /* id counter, loaded lazily */
    bool id_loaded;
} sess__wtxn;

typedef kds_status (*sess__write_fn)(sess__wtxn *w, void *ctx, kds_err *err);
typedef kds_status (*sess__read_fn)(sess_store *st, MDB_txn *txn, void *ctx, kds_err *err);

/* Run fn in a write transaction and commit; on MDB_MAP_FULL abort, grow the
 * map and run fn again from the start (fn must not keep state between
 * attempts other than through ctx, which it must reset itself). A commit
 * that fails for room on the disk is run again once, after a commit that
 * lets LMDB reuse what the last transactions freed; a transaction that
 * deleted records (w->freed) is followed by that commit too, so that the
 * space it freed serves the very next write (LMDB hands out pages freed by
 * transaction T only from transaction T + 2 on). */
kds_status sess__write(sess_store *st, sess__write_fn fn, void *ctx, kds_err *err);
/* Run fn in a read-only transaction. */
kds_status sess__read(sess_store *st, sess__read_fn fn, void *ctx, kds_err *err);

/* Put helpers: map MDB errors to kds_status (flagging MAP_FULL). With
 * reserve, *space receives writable room of val_len bytes to fill before
 * the next update. */
kds_status sess__put(sess__wtxn *w, MDB_dbi dbi, const void *key, size_t key_len,
                     const void *val, size_t val_len, unsigned flags, kds_err *err);
kds_status sess__reserve(sess__wtxn *w, MDB_dbi dbi, const void *key, size_t key_len,
                         size_t val_len, void **space, kds_err *err);
kds_status sess__del(sess__wtxn *w, MDB_dbi dbi, const void *key, size_t key_len, kds_err *err);
/* KDS_NOT_FOUND (no message) when absent. The value points into the map:
 * valid until the transaction ends or the next update. */
kds_status sess__get(MDB_txn *txn, MDB_dbi dbi, const void *key, size_t key_len,
                     const void **val, size_t *val_len, kds_err *err);
kds_status sess__mdb_err(int rc, const char *what, kds_err *err);
/* An LMDB error of a write (put, delete, commit): MDB_MAP_FULL flagged for
 * sess__write to grow the map; a full disk (ENOSPC, EDQUOT, or the EIO LMDB
 * returns for a short write when the disk has no room left for this
 * transaction) said as such, naming the store and its filesystem, and
 * flagged for the one retry. */
kds_status sess__write_err(sess__wtxn *w, int rc, const char *what, kds_err *err);

/* Next fresh id (the store-wide counter shared by snapshots, chunks and
 * sessions); the counter is written back by sess__write before commit. */
kds_status sess__new_id(sess__wtxn *w, uint64_t *id, kds_err *err);

/* "<base>-K" with the first K >= 2 that names no session. */
kds_status sess__free_fork_name(sess__wtxn *w, const char *base, char out[SESS_NAME_MAX + 1],
                                kds_err *err);

/* 8-byte big-endian key, so LMDB's byte order is id order. */
void sess__key64(unsigned char k[8], uint64_t id);
uint64_t sess__key64_get(const unsigned char k[8]);
/* A prefix-index value (sess_prefix.c); false when damaged. */
bool sess__prefix_parse(const void *p, size_t n, sess_prefix_entry *e);
/* Transcript key: session id then turn number. */
void sess__turn_key(unsigned char k[12], uint64_t session_id, uint32_t turn);

/* ------------------------------------------------------------------------ */
/* Test hooks: raw access to one stored value (db = "snapshots", "chunks",
 * "sessions", "transcripts", "meta"), for tests that damage records. */
kds_status sess__raw_get(sess_store *st, const char *db, const void *key, size_t key_len,
                         void **val, size_t *val_len, kds_err *err);
kds_status sess__raw_put(sess_store *st, const char *db, const void *key, size_t key_len,
                         const void *val, size_t val_len, kds_err *err);

#endif /* SESS_INTERNAL_H */
