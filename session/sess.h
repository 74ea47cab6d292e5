/*
 * sess.h - snapshots and sessions of kdaserve sequences, kept in an LMDB
 * store (one environment per data directory).
 *
 * Objects
 *   snapshot  an immutable record of one sequence's state: a small msgpack
 *             header (model fingerprint, layout, token count, parent, time,
 *             checksums) and the engine's fixed state bytes; for hybrid
 *             models it also references the append-only chunks that hold the
 *             MLA latent rows of tokens [0, tokens). Saving after a turn
 *             writes only the new tokens' rows; forks and later snapshots of
 *             a session share the old chunks. Ids are sequential numbers,
 *             written "@12". Byte formats: docs/snapshot-format.md.
 *   session   a named, mutable pointer to a head snapshot plus metadata
 *             (parent session, created/updated, token count, owner, model)
 *             and a transcript (prompt and generated text of every turn).
 *             Forking copies the pointer and the transcript, never state
 *             bytes. Deleting a session leaves its snapshots; sess_prune
 *             deletes the snapshots the store's retention policy does not
 *             keep (sess_gc: every one that is no head) and chunks that no
 *             snapshot references; sess_compact shrinks the file.
 *   store     sess_store, the open LMDB environment of a data directory.
 *
 * Ownership: a sess_store is owned by the caller of sess_open (free with
 * sess_close). Lists and transcripts returned by the store are owned by the
 * caller and freed as each function says. Models and sequences passed in
 * are borrowed for the call.
 *
 * Thread-safety: one sess_store may be used by any number of threads at
 * once (reads run in parallel, writes are serialised by LMDB; a map resize
 * waits until no call of this process is inside a transaction). Open a
 * directory at most once per process (LMDB's locks are per process), and
 * never use a store in a child after fork(): open it again there. Several
 * processes may open the same directory at once.
 *
 * Durability: every write is one LMDB transaction, committed with a sync
 * unless sess_params.no_sync; a process killed at any moment loses nothing
 * committed before. When the map fills, the transaction is redone in a
 * larger map (nothing is lost). A full disk refuses the write whole, saying
 * so; space freed (in the store or elsewhere) serves the next write.
 * Opening refuses a data.mdb shorter than its pages in use (KDS_CORRUPT)
 * before reading one.
 *
 * Errors: commands return kds_status and fill the optional kds_err with one
 * line naming the snapshot, session, file or field. A snapshot whose
 * checksum fails is refused with KDS_CORRUPT, an unknown format version with
 * KDS_UNSUPPORTED, another model's snapshot with KDS_MISMATCH; the refusal
 * touches nothing, and the rest of the store stays usable. A command that
 * fails changes nothing (its transaction is aborted).
 */
#ifndef SESS_H
#define SESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "eng.h"
#include "kds_status.h"

typedef struct sess_store sess_store;

/* Session names: 1..64 of [A-Za-z0-9._-], starting with a letter or digit
 * (so they never look like an option or a snapshot id "@N"). */
#define SESS_NAME_MAX 64
#define SESS_FP_LEN 32 /* hex digits of a model fingerprint */
#define SESS_MODE_MAX 15 /* bytes of a session's mode ("chat", "plain") */

/* ------------------------------------------------------------------------ */
/* Store                                                                     */

typedef struct sess_params {
    /* Initial LMDB map size (the most the file may grow to before the map
     * is enlarged); 0 = 1 GiB. A store that is already larger keeps its
     * size. The map doubles whenever a write does not fit. */
    size_t map_size;
    /* The map never grows past this; 0 = 1 TiB. */
    size_t map_max;
    /* MDB_NOSYNC: commits survive a process crash but the most recent ones
     * may be lost on power loss. Default false (durable). */
    bool no_sync;
    /* Open without writing (MDB_RDONLY); write calls fail with
     * KDS_UNSUPPORTED. The store must exist. */
    bool read_only;
} sess_params;

sess_params sess_default_params(void);

/* The default data directory: $XDG_DATA_HOME/kdaserve, else
 * ~/.local/share/kdaserve. Errors: KDS_NOT_FOUND (no HOME), KDS_TOO_LARGE. */
kds_status sess_default_dir(char *buf, size_t cap, kds_err *err);

/*
 * Open (creating it and its parents if missing, unless read_only) the store
 * in directory `dir` (NULL = sess_default_dir). Clears reader slots left by
 * dead processes. Opening an existing store takes no write lock. Refuses a
 * store of an unknown format version (KDS_UNSUPPORTED). Caller owns *out:
 * free with sess_close. Errors: KDS_NOT_FOUND (read_only and no store),
 * KDS_IO (directory, LMDB), KDS_UNSUPPORTED, KDS_CORRUPT, KDS_NOMEM.
 */
kds_status sess_open(const char *dir, const sess_params *p, sess_store **out, kds_err *err);
void sess_close(sess_store *st); /* NULL is a no-op */

/* Borrowed, valid until sess_close. */
const char *sess_store_dir(const sess_store *st);

typedef struct sess_store_stats {
    size_t map_size;       /* current LMDB map size */
    size_t used_bytes;     /* pages in use (last page + 1) x page size */
    uint64_t sessions, snapshots, chunks;
    size_t snapshot_bytes; /* sum of snapshot record sizes */
    size_t chunk_bytes;    /* sum of chunk record sizes */
} sess_store_stats;

kds_status sess_store_stats_get(sess_store *st, sess_store_stats *out, kds_err *err);

/* ------------------------------------------------------------------------ */
/* Names and references                                                      */

bool sess_name_valid(const char *name);

/* "@12" (or "12") -> 12. False for anything else or 0. */
bool sess_parse_snapshot_id(const char *text, uint64_t *id);

/* What a user-given id names: a session (by name) or a snapshot. */
typedef struct sess_ref {
    bool is_session;
    char name[SESS_NAME_MAX + 1]; /* the session, when is_session */
    uint64_t snapshot;            /* the snapshot, or the session's head */
} sess_ref;

/* Resolve `text`: "@N" is snapshot N; otherwise an existing session of that
 * name; otherwise digits naming an existing snapshot. KDS_NOT_FOUND names
 * `text` when nothing matches. */
kds_status sess_resolve(sess_store *st, const char *text, sess_ref *out, kds_err *err);

/* ------------------------------------------------------------------------ */
/* Snapshots                                                                 */

typedef struct sess_snapshot_info {
    uint64_t id;
    uint64_t parent;           /* snapshot this one continued; 0 = none (may be gone after gc) */
    int64_t tokens;            /* tokens the state has consumed */
    int64_t created_us;        /* unix time in microseconds */
    uint32_t format_version;
    char fingerprint[SESS_FP_LEN + 1]; /* the model that made it */
    char origin[SESS_NAME_MAX + 1];    /* session that wrote it ("" for imports) */
    size_t record_bytes;       /* stored bytes of the snapshot record (header + fixed state) */
    size_t fixed_bytes;        /* the engine's fixed state bytes in it */
    size_t token_bytes;        /* MLA bytes per token (0 for pure-KDA models) */
    uint32_t n_chunks;         /* MLA chunks covering [0, tokens) */
    uint32_t n_new_chunks;     /* of which first stored with this snapshot */
    size_t new_chunk_bytes;    /* MLA payload bytes first stored with this snapshot */
} sess_snapshot_info;

/* Header of one snapshot (checks the frame and the header checksum, not the
 * payload; use sess_verify for that). */
kds_status sess_snapshot_get(sess_store *st, uint64_t id, sess_snapshot_info *out, kds_err *err);

/* Every snapshot in id order. Snapshots whose header cannot be read are
 * listed with tokens = -1 and the reason skipped (see sess_verify). Caller
 * owns *out: free(). */
kds_status sess_snapshot_list(sess_store *st, sess_snapshot_info **out, size_t *n, kds_err *err);

/*
 * Load snapshot `id` into `s`, a sequence of model `m` (a fresh one or any
 * other: its whole state is replaced, nothing is replayed). Checks, before
 * touching `s`: the record's magic, format version and checksums, every
 * chunk's checksum and range, the model fingerprint (KDS_MISMATCH names
 * both) and layout. `info` (may be NULL) receives the header. On failure
 * `s` is unchanged.
 */
kds_status sess_load(sess_store *st, uint64_t id, const eng_model *m, eng_seq *s,
                     sess_snapshot_info *info, kds_err *err);

/* Check one snapshot completely: frame, header and payload checksums, chunk
 * checksums and coverage, and with `m` (may be NULL) the fingerprint and
 * layout against that model. Reads only; KDS_OK when sound. */
kds_status sess_verify(sess_store *st, uint64_t id, const eng_model *m, kds_err *err);

/* Where a session can go back to when its head does not verify. */
typedef struct sess_recovery {
    uint64_t head;                 /* the session's head */
    bool head_ok;                  /* the head verifies: nothing to recover */
    uint64_t to;                   /* newest sound snapshot of its history (0 = none) */
    int64_t tokens;                /* tokens of `to` */
    uint32_t turns;                /* transcript turns up to `to` */
    uint32_t turns_after;          /* transcript turns after it (kept in `kept`) */
    char kept[SESS_NAME_MAX + 1];  /* sess_session_recover: the session keeping what was */
} sess_recovery;

/*
 * The newest snapshot of session `name`'s history that verifies
 * completely (with `m`, may be NULL, also fingerprint and layout): its head
 * if sound, else the snapshots before it, newest first: its chain of
 * parents (as far as they remain), the snapshots its transcript names and
 * its fork point. Reads only. One damaged snapshot (or, for hybrid models,
 * one damaged MLA chunk, which every later snapshot shares) leaves the
 * session, and every fork whose head it is, unresumable; this is the way
 * back. Errors: KDS_NOT_FOUND (no session), KDS_CORRUPT (its record).
 */
kds_status sess_session_last_good(sess_store *st, const char *name, const eng_model *m,
                                  sess_recovery *out, kds_err *err);

/*
 * Recover session `name` whose head does not verify: it goes back to
 * sess_session_last_good's snapshot with its transcript up to it, and
 * what it was (the damaged head and the whole transcript) is kept as
 * session "<name>-damaged" (or "-damaged-K"), fork of `name` at that
 * snapshot, so nothing is deleted. One transaction. Errors:
 * KDS_INVALID_ARG (the head verifies: nothing to recover), KDS_NOT_FOUND
 * (no session, or no snapshot of its history verifies), KDS_CORRUPT.
 */
kds_status sess_session_recover(sess_store *st, const char *name, const eng_model *m,
                                sess_recovery *out, kds_err *err);

/* Delete one snapshot. Refused with KDS_BUSY while it is a session's head.
 * A restore point (sess_snapshot_uses) is deleted too: front ends ask
 * first. Chunks it shared stay until sess_gc. */
kds_status sess_snapshot_delete(sess_store *st, uint64_t id, kds_err *err);

/* ------------------------------------------------------------------------ */
/* Sessions                                                                  */

typedef struct sess_session_info {
    char name[SESS_NAME_MAX + 1];
    uint64_t id;                  /* internal number (keys its transcript) */
    uint64_t head;                /* current snapshot */
    char parent[SESS_NAME_MAX + 1]; /* session it was forked from ("" = none) */
    uint64_t fork_point;          /* snapshot it was forked at (0 = not a fork) */
    int64_t created_us, updated_us;
    int64_t tokens;               /* tokens of the head snapshot */
    uint32_t turns;               /* transcript entries */
    char owner[64];               /* user that created it */
    char model_dir[1024];         /* model directory of the last save ("" unknown) */
    char fingerprint[SESS_FP_LEN + 1];
    /* How its turns feed text to the model, as the writer declared it
     * (sess_turn.mode): "chat" (a chat format) or "plain" (continuation);
     * "" = never declared (sessions written before the field existed, or by
     * `generate --session` before it declared one). */
    char mode[SESS_MODE_MAX + 1];
    /* The sampler settings of its last turn, as its writer declared them
     * (sess_turn.sampler), so that a later turn with no settings of its own
     * continues as the last one did; has_sampler false = never declared. */
    bool has_sampler;
    eng_sampler_params sampler;
} sess_session_info;

/* Whether sampler settings are ones a session may record (the ranges of
 * `generate`'s options: temperature 0-100, top_k >= 0, top_p and min_p
 * 0-1, repeat_penalty 0.01-100, repeat_last_n 0-64). */
bool sess_sampler_valid(const eng_sampler_params *p);

/* The settings a turn samples with when the session recorded `recorded`:
 * those, except the fields named in `given` (SESS_SAMPLER_* bits), which
 * come from `own` (the turn's options or request fields). */
enum {
    SESS_SAMPLER_TEMPERATURE = 1u,
    SESS_SAMPLER_TOP_K = 2u,
    SESS_SAMPLER_TOP_P = 4u,
    SESS_SAMPLER_MIN_P = 8u,
    SESS_SAMPLER_REPEAT_PENALTY = 16u,
    SESS_SAMPLER_ALL = 31u
};
eng_sampler_params sess_sampler_merge(const eng_sampler_params *recorded,
                                      const eng_sampler_params *own, unsigned given);

kds_status sess_session_get(sess_store *st, const char *name, sess_session_info *out,
                            kds_err *err);

/*
 * Whether session `si` continues in chat mode (true) or plain: the mode it
 * recorded; for a session that never declared one (older stores), the
 * format its first turn was fed in (a plain turn's prompt_tokens equal its
 * text's plain encoding with `tok`, a chat turn adds markup); with no turn
 * to tell, `fallback`. A tokenizer without a chat format always gives
 * plain for undeclared sessions. One rule for every front end (REPL,
 * server). Errors: KDS_UNSUPPORTED when the session is in chat mode and
 * `tok` has no chat format, or its mode is one this version does not know
 * (the message names the session and the mode); *chat is then `fallback`.
 */
kds_status sess_session_chat_mode(sess_store *st, const sess_session_info *si,
                                  const eng_tokenizer *tok, bool fallback, bool *chat, kds_err *err);
/* Every session in name order. A session whose record cannot be read is
 * listed with head 0 and tokens -1 (sess_session_get says why). Caller owns
 * *out: free(). */
kds_status sess_session_list(sess_store *st, sess_session_info **out, size_t *n, kds_err *err);

/* What one turn did, for the transcript (text is stored as bytes). */
typedef struct sess_turn {
    const char *prompt;
    size_t prompt_len;
    const char *output;
    size_t output_len;
    int64_t prompt_tokens, output_tokens;
    /* NULL, or the session's mode to record (sess_session_info.mode, 1 to
     * SESS_MODE_MAX bytes of [a-z]): a save keeps the mode last declared. */
    const char *mode;
    /* NULL, or the sampler settings this turn used (sess_sampler_valid), to
     * record as the session's: a save keeps the settings last declared. */
    const eng_sampler_params *sampler;
    /* NULL, or the name of the document this turn ingested (1 to
     * SESS_DOC_NAME_MAX bytes, no NUL): the prompt is then that document's
     * text, doc_bytes its length as the client sent it. */
    const char *doc_name;
    int64_t doc_bytes;
} sess_turn;
/* A sess_turn whose prompt and output are both NULL appends no transcript
 * entry: it only declares the mode (a session created before its first turn). */

/*
 * Save sequence `s` (of model `m`) as a new snapshot and make it the head of
 * session `session`, creating the session if it does not exist; append
 * `turn` (may be NULL) to its transcript. One transaction: all or nothing.
 *
 * `base` is the snapshot `s` was loaded from (0 for a fresh sequence). When
 * the session exists its head must still be `base` (else KDS_BUSY: another
 * writer moved it; nothing is written). For hybrid models the MLA rows of
 * [0, tokens of base) are shared with `base` and only the rows after are
 * written, so `s` must continue `base` (checked on its last shared row:
 * KDS_MISMATCH). *snapshot (may be NULL) receives the new id.
 * Errors: KDS_INVALID_ARG (name, turn->mode, turn->sampler), KDS_BUSY, KDS_MISMATCH (another model's
 * session or base), KDS_NOT_FOUND (base), KDS_TOO_LARGE (map_max), KDS_IO.
 * sess_save_ex can save a conflicting turn as a fork instead of KDS_BUSY.
 */
kds_status sess_save(sess_store *st, const char *session, uint64_t base, const eng_model *m,
                     const eng_seq *s, const sess_turn *turn, uint64_t *snapshot, kds_err *err);

/* What a save does when the session's head is no longer `base` (another
 * writer, e.g. the server or a second REPL, saved a turn meanwhile). */
typedef enum sess_conflict {
    SESS_CONFLICT_REFUSE = 0, /* KDS_BUSY, nothing written (sess_save) */
    /* Save anyway, as a new session "<session>-K" (the first free K >= 2)
     * forked at `base`: parent `session`, fork point `base`, the transcript
     * of `session` up to `base`, then this turn. `session` keeps the other
     * writer's head. Nothing is lost and nothing is overwritten. */
    SESS_CONFLICT_FORK = 1,
    /* The same fork whether or not the head moved: the turn never goes
     * into `session` itself (a stateless HTTP client resuming a state that
     * a stateful client's session stored: it branches off, that session
     * keeps only its own turns). */
    SESS_CONFLICT_FORK_ALWAYS = 2,
} sess_conflict;

typedef struct sess_save_result {
    uint64_t snapshot;               /* the new snapshot */
    char session[SESS_NAME_MAX + 1]; /* the session saved: `session`, or the fork */
    bool forked;                     /* the head had moved: saved as the fork above */
    uint64_t other_head;             /* when forked: the head the other writer left */
} sess_save_result;

/*
 * sess_save, choosing what a moved head does (`on_conflict`); `res` (may be
 * NULL) says what was saved where. With SESS_CONFLICT_FORK a moved head is
 * not an error: the turn is saved as a fork and res->forked is set (tell
 * the user res->session; continue there, with res->snapshot as the base).
 * A session deleted meanwhile is created again under its name. Errors as
 * sess_save, and KDS_EXISTS only if no fork name is free.
 */
kds_status sess_save_ex(sess_store *st, const char *session, uint64_t base, const eng_model *m,
                        const eng_seq *s, const sess_turn *turn, sess_conflict on_conflict,
                        sess_save_result *res, kds_err *err);

/* ------------------------------------------------------------------------ */
/* Writers                                                                   */

/* A process that has a session open for writing, as it declared itself. */
typedef struct sess_writer {
    int64_t pid;
    char host[64];
    char program[32];  /* "chat", "generate", "serve", ... */
    int64_t since_us;  /* when it claimed the session */
} sess_writer;

/*
 * Declare that this process writes session `name` (which need not exist
 * yet), as `program`; front ends do it whenever they take up a session (the
 * REPL at open, generate --session, the server when it loads one). Records
 * of writers that are gone (same host, process dead or its pid reused) are
 * dropped on the way. *busy is set when another live writer holds the
 * session, and `other` (may be NULL) receives the earliest of them: say so
 * at once ("open for writing in pid N"), since whoever saves second will
 * have its turn saved as a fork (SESS_CONFLICT_FORK). Claiming twice is a
 * no-op; a read-only store records nothing and only reports. The claim is
 * advisory: it never blocks a save. Errors: KDS_INVALID_ARG (name), KDS_IO.
 */
kds_status sess_writer_claim(sess_store *st, const char *name, const char *program,
                             sess_writer *other, bool *busy, kds_err *err);

/* Withdraw this process's claim on `name` (no-op if it had none). */
kds_status sess_writer_release(sess_store *st, const char *name, kds_err *err);

/* "pid 4242 (kdaserve serve, since 14:03:12)", with " on HOST" for
 * another host: the writer as a message names it. */
void sess_writer_describe(const sess_writer *w, char *buf, size_t cap);

/*
 * Fork: a new session `name` (NULL = "<source>-K" for a session, "snapN-K"
 * for snapshot "@N", with the first free K >= 2) whose head is the head of
 * session `source`, or snapshot "@N". Copies the source session's transcript,
 * model directory and mode (for "@N": the model directory and mode of the
 * session that wrote it, while that session exists with the snapshot's
 * model; no transcript); no state bytes are copied.
 * out_name (may be NULL) receives the name. Errors: KDS_NOT_FOUND,
 * KDS_EXISTS, KDS_INVALID_ARG.
 */
kds_status sess_fork(sess_store *st, const char *source, const char *name,
                     char out_name[SESS_NAME_MAX + 1], kds_err *err);

/* Delete a session and its transcript; its snapshots stay until sess_gc. */
kds_status sess_session_delete(sess_store *st, const char *name, kds_err *err);

/* Rename session `from` to `to` (keeps its id, head, transcript and
 * metadata; its snapshots keep naming `from` as their origin).
 * Errors: KDS_NOT_FOUND, KDS_EXISTS (to is taken), KDS_INVALID_ARG. */
kds_status sess_session_rename(sess_store *st, const char *from, const char *to, kds_err *err);

#define SESS_DOC_NAME_MAX 255

/* One transcript entry (caller-owned copies). */
typedef struct sess_turn_record {
    char *prompt;          /* NUL-terminated copy (text may contain NULs: use the lengths) */
    size_t prompt_len;
    char *output;
    size_t output_len;
    int64_t prompt_tokens, output_tokens;
    int64_t tokens;        /* session tokens after the turn */
    uint64_t snapshot;     /* snapshot saved after the turn */
    int64_t time_us;
    char doc_name[SESS_DOC_NAME_MAX + 1]; /* "" = not a document (sess_turn.doc_name) */
    int64_t doc_bytes;
} sess_turn_record;

/* The transcript of a session, oldest first. Free with sess_transcript_free. */
kds_status sess_transcript(sess_store *st, const char *name, sess_turn_record **out, size_t *n,
                           kds_err *err);
void sess_transcript_free(sess_turn_record *t, size_t n);

/* ------------------------------------------------------------------------ */
/* Garbage collection, export, import                                        */

typedef struct sess_gc_stats {
    uint64_t snapshots_freed, chunks_freed;
    size_t bytes_freed;          /* record bytes deleted (LMDB reuses the pages; the file
                                    keeps its size until sess_compact) */
    uint64_t snapshots_kept, chunks_kept;
    uint64_t unreadable;         /* kept snapshots whose header could not be read (every chunk is
                                    then kept; an unreadable session record keeps every snapshot) */
    /* Restore points: snapshots of a session's history that are not its
     * head (of snapshots_freed / snapshots_kept). */
    uint64_t restore_points_freed, restore_points_kept;
    /* Prefix-index entries (the HTTP API's resume) that named a snapshot
     * freed here, or no stored snapshot at all, or were damaged: deleted
     * with it, so the index never outgrows what it can resume. */
    uint64_t index_freed, index_kept;
} sess_gc_stats;

/* Delete every snapshot that is no session's head, then every chunk that
 * no remaining snapshot references, then every prefix-index entry of a
 * snapshot that is gone: every restore point goes (the same as sess_prune
 * with SESS_PRUNE_HEADS_ONLY). One transaction. */
kds_status sess_gc(sess_store *st, sess_gc_stats *out, kds_err *err);

/*
 * Retention: what sess_prune keeps of each session's history besides its
 * head. A session's line is its head and the chain of parents from it; a
 * turn is an entry of its transcript (which names the snapshot saved after
 * it). Kept: the last `keep_last` snapshots of its line (head included; 0
 * or 1 = the head alone), the snapshot of every `keep_every`th turn (turns
 * K, 2K, ...; 0 = none), every snapshot younger than `keep_days` days (0 =
 * none; this one also keeps snapshots of no session), and always each
 * session's fork point (the snapshot it was forked at). Snapshots of no
 * session's history go. Stored per store (sess_retention_set); a store
 * without one has sess_default_retention.
 */
typedef struct sess_retention {
    uint32_t keep_last;
    uint32_t keep_every;
    uint32_t keep_days;
} sess_retention;

/* The last 10 snapshots of each line and every 25th turn: a 1,000-turn
 * chat keeps 50 snapshots, not 1,000. */
sess_retention sess_default_retention(void);

/* The store's policy (*is_set false: none stored, the default). */
kds_status sess_retention_get(sess_store *st, sess_retention *out, bool *is_set, kds_err *err);
/* Store `r` as the store's policy (NULL: back to the default). Deletes
 * nothing by itself: sess_prune applies it. */
kds_status sess_retention_set(sess_store *st, const sess_retention *r, kds_err *err);

enum {
    SESS_PRUNE_DRY_RUN = 1,    /* count what would go, delete nothing (a read) */
    SESS_PRUNE_HEADS_ONLY = 2, /* keep only heads (and young snapshots by `r`): sess_gc */
};

/*
 * Delete the snapshots retention `r` (NULL: the store's) does not keep,
 * then the chunks no remaining snapshot references; `flags` as above.
 * With an unreadable session record every snapshot is kept (any might be
 * its head). One transaction; the freed pages serve the next write.
 */
kds_status sess_prune(sess_store *st, const sess_retention *r, unsigned flags, sess_gc_stats *out,
                      kds_err *err);

/* One session whose history holds a snapshot (sess_snapshot_uses). */
typedef struct sess_snapshot_use {
    char session[SESS_NAME_MAX + 1];
    bool head;       /* the session's head */
    bool fork_point; /* the snapshot the session was forked at */
    int chain;       /* steps back from its head along its line (-1: not on it) */
    uint32_t turn;   /* the transcript turn that saved it (0: none) */
    uint32_t turns;  /* the session's transcript turns */
} sess_snapshot_use;

/* The sessions whose history holds snapshot `id`: up to `cap` in `uses`,
 * *n = how many there are. A snapshot no session uses can go without
 * cutting any history; one in the middle of a history is a restore point
 * (front ends ask before deleting it). */
kds_status sess_snapshot_uses(sess_store *st, uint64_t id, sess_snapshot_use *uses, size_t cap,
                              size_t *n, kds_err *err);

typedef struct sess_compact_stats {
    uint64_t bytes_before, bytes_after; /* size of data.mdb */
} sess_compact_stats;

/*
 * Shrink the store in directory `dir` (which this process must not have
 * open): LMDB's compacting copy (mdb_env_copy2, MDB_CP_COMPACT) of the
 * live pages into DIR/compact.tmp, checked (it opens, and every database
 * holds as many records as the original), synced, and renamed over
 * data.mdb. Needs the store to itself: refused (KDS_BUSY, naming the pid)
 * while another process has it open; one that opens it meanwhile waits for
 * the swap and then opens the compacted file. Needs free disk space for
 * the copy. On any failure data.mdb is untouched.
 */
kds_status sess_compact(const char *dir, sess_compact_stats *out, kds_err *err);

/*
 * Write session `source` (or snapshot "@N") to one portable file `path`
 * (format: docs/snapshot-format.md, "Export file"): the session record and
 * transcript (for a session), the snapshot and the chunks it references,
 * each byte-for-byte as stored with its own checksums. Written to a
 * temporary name, synced and renamed.
 */
kds_status sess_export(sess_store *st, const char *source, const char *path, kds_err *err);

/*
 * Import a file written by sess_export as a new session: `name`, or the
 * exported session's name, or "import-N" for a bare snapshot. Every record
 * is checked (magic, version, checksums, chunk coverage) before anything is
 * written; the snapshot and chunks get new ids. KDS_EXISTS when the name is
 * taken. out_name (may be NULL) receives the session name, *snapshot (may
 * be NULL) the new snapshot id.
 */
kds_status sess_import(sess_store *st, const char *path, const char *name,
                       char out_name[SESS_NAME_MAX + 1], uint64_t *snapshot, kds_err *err);

/* ------------------------------------------------------------------------ */
/* Prefix index                                                              */
/*
 * Which stored snapshot holds the state after a given token sequence, so a
 * stateless client that resends a whole conversation resumes from the
 * longest stored exact-token prefix instead of replaying it (the HTTP API,
 * docs/http-api.md "Resume"). A key is the XXH3-128 of a scope string (the
 * tenant and the model fingerprint: another tenant's or model's sequences
 * never match) and the token ids; a front end puts one key per saved turn
 * end and looks up the candidate lengths of a new request, longest first,
 * in one read transaction (one B-tree search each: fast at any store size).
 * The index is advisory: an entry whose snapshot was pruned or does not
 * load is a miss, and the caller tries the next shorter candidate.
 */
#define SESS_PREFIX_KEY_LEN 16

typedef struct sess_prefix_hasher sess_prefix_hasher;
/* A hasher of token sequences in `scope`. Caller owns *out: free with
 * sess_prefix_hasher_free. Errors: KDS_NOMEM. */
kds_status sess_prefix_hasher_create(const char *scope, sess_prefix_hasher **out, kds_err *err);
void sess_prefix_hasher_free(sess_prefix_hasher *h); /* NULL is a no-op */
/* Append tokens (allocates nothing: per-token use is fine). */
void sess_prefix_hasher_add(sess_prefix_hasher *h, const int32_t *ids, int64_t n);
/* Tokens added so far. */
int64_t sess_prefix_hasher_count(const sess_prefix_hasher *h);
/* The key of the sequence added so far (the hasher goes on unchanged). */
void sess_prefix_hasher_key(const sess_prefix_hasher *h, unsigned char key[SESS_PREFIX_KEY_LEN]);

typedef struct sess_prefix_entry {
    uint64_t snapshot;               /* the state after the sequence */
    int64_t tokens;                  /* the sequence's length */
    char session[SESS_NAME_MAX + 1]; /* the session that saved it */
    /* The session is a stateful client's (a WebSocket conversation): a
     * stateless client that resumes here forks it (SESS_CONFLICT_FORK_ALWAYS)
     * instead of adding its turn to it; and such an entry never replaces
     * one already indexed under its key (the stateless client's own). */
    bool fork;
} sess_prefix_entry;

/* Index `key` -> `e`, replacing an older entry of the same key unless e is
 * a `fork` entry and one is there (then nothing changes). One write
 * transaction. Errors: KDS_INVALID_ARG, KDS_UNSUPPORTED (read-only), KDS_IO. */
kds_status sess_prefix_put(sess_store *st, const unsigned char key[SESS_PREFIX_KEY_LEN],
                           const sess_prefix_entry *e, kds_err *err);
/* The largest i < n whose keys[i] is indexed with length lens[i]: *found = i
 * and *out its entry. KDS_NOT_FOUND (no message) when none is. */
kds_status sess_prefix_find(sess_store *st, const unsigned char (*keys)[SESS_PREFIX_KEY_LEN],
                            const int64_t *lens, size_t n, size_t *found, sess_prefix_entry *out,
                            kds_err *err);

/* ------------------------------------------------------------------------ */
/* Untrusted msgpack                                                         */

/* True when `p` holds exactly one msgpack object, nested at most 8 deep, whose
 * every length and count fits in the bytes that follow. Run it before
 * msgpack-c sees bytes from outside: msgpack-c reserves memory for a
 * container's declared count before reading it (reference/libs.md 3.3). */
bool sess_msgpack_sane(const void *p, size_t len);

/* ------------------------------------------------------------------------ */
/* Sizes                                                                     */

typedef struct sess_size {
    size_t record;       /* snapshot record: frame + header + fixed state */
    size_t chunks;       /* chunk records holding the MLA rows of `tokens` tokens */
    size_t total;        /* record + chunks */
    size_t fixed_bytes, token_bytes;
} sess_size;

/* Bytes a snapshot of a model with config `c` takes at `tokens` tokens when
 * saved in one go (later turns add a record plus only their own rows). */
sess_size sess_snapshot_size(const eng_config *c, int64_t tokens);

#endif /* SESS_H */
