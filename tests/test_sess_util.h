/*
 * test_sess_util.h - helpers shared by the session tests (test_sess_*.c):
 * running the kdaserve program, generating fresh models with it, loading a
 * model in-process, and reading back snapshots and logits files. Header-only
 * static functions, like test_helpers.h.
 */
#ifndef TEST_SESS_UTIL_H
#define TEST_SESS_UTIL_H

#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "eng.h"
#include "eng_config.h"
#include "eng_safetensors.h"
#include "sess.h"
#include "sess_internal.h"
#include "test_model_util.h"

#define TSU_KDASERVE KDS_BINARY_DIR "/kdaserve"

/* Run a shell command; its stdout goes into out (cap bytes, NUL-terminated,
 * *len = bytes read when len != NULL). Returns the exit status (-1 if it
 * did not exit). */
static inline int tsu_run(char *out, size_t cap, size_t *len, const char *fmt, ...) {
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    FILE *p = popen(cmd, "r");
    cr_assert(p, "popen %s", cmd);
    size_t n = 0;
    if (out) {
        n = fread(out, 1, cap - 1, p);
        out[n] = '\0';
    }
    char sink[4096];
    while (fread(sink, 1, sizeof sink, p) > 0) {}
    if (len) *len = n;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* `kdaserve gen-model --preset P --seed S --out dir/name`; returns the path
 * (malloc'd). */
static inline char *tsu_gen_model(const char *dir, const char *name, const char *preset,
                                  int seed) {
    char *path = tmu_path(dir, name);
    char out[4096];
    int rc = tsu_run(out, sizeof out, NULL,
                     TSU_KDASERVE " gen-model --preset %s --seed %d --out %s 2>&1", preset, seed,
                     path);
    cr_assert_eq(rc, 0, "gen-model %s: %s", preset, out);
    return path;
}

typedef struct tsu_model {
    eng_model *m;
    eng_ctx *c;
    int vocab;
} tsu_model;

static inline tsu_model tsu_open_model(const char *dir) {
    tsu_model f = {0};
    kds_err err = {0};
    eng_model_params mp = eng_model_default_params();
    mp.no_fingerprint_cache = true; /* small models: hashing is instant */
    cr_assert_eq(eng_model_load(dir, &mp, &f.m, &err), KDS_OK, "%s", err.msg);
    eng_ctx_params cp = eng_ctx_default_params();
    cp.max_batch = 64;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &f.c, &err), KDS_OK, "%s", err.msg);
    f.vocab = eng_model_config(f.m)->vocab_size;
    return f;
}

static inline void tsu_close_model(tsu_model *f) {
    eng_ctx_free(f->c);
    eng_model_free(f->m);
    f->c = NULL;
    f->m = NULL;
}

static inline sess_store *tsu_open_store(const char *dir) {
    sess_store *st = NULL;
    kds_err err = {0};
    sess_params p = sess_default_params();
    cr_assert_eq(sess_open(dir, &p, &st, &err), KDS_OK, "%s", err.msg);
    return st;
}

/* Feed `n` pseudo-random tokens (seeded) through the prefill path. */
static inline void tsu_feed(tsu_model *f, eng_seq *s, int n, uint32_t seed) {
    int32_t ids[512];
    cr_assert(n <= 512);
    for (int i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        ids[i] = (int32_t)((seed >> 8) % (uint32_t)f->vocab);
    }
    kds_err err = {0};
    cr_assert_eq(eng_prefill(f->c, s, ids, n, NULL, NULL, NULL, &err), KDS_OK, "%s", err.msg);
}

/* The whole state of snapshot `id` loaded into a fresh sequence, as bytes
 * (malloc'd, *n bytes). */
static inline unsigned char *tsu_snapshot_state(sess_store *st, uint64_t id, tsu_model *f,
                                                size_t *n) {
    eng_seq *s = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_seq_create(f->m, 0, &s, &err), KDS_OK);
    cr_assert_eq(sess_load(st, id, f->m, s, NULL, &err), KDS_OK, "%s", err.msg);
    *n = eng_seq_state_bytes(s);
    unsigned char *b = malloc(*n);
    cr_assert(b);
    cr_assert_eq(eng_seq_state_save(s, b, *n, &err), KDS_OK);
    eng_seq_free(s);
    return b;
}

/* The 'logits' tensor of a --logits-out file: rows x vocab f32, malloc'd. */
static inline float *tsu_read_logits(const char *path, int64_t *rows, int64_t *vocab) {
    eng_st_file *f = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_st_open(path, &f, &err), KDS_OK, "%s", err.msg);
    const eng_st_tensor *t = eng_st_find(f, "logits");
    cr_assert(t && t->n_dims == 2, "%s has no [n, vocab] logits", path);
    *rows = t->shape[0];
    *vocab = t->shape[1];
    float *out = malloc(t->n_elems * sizeof(float));
    cr_assert(out);
    memcpy(out, t->data, t->n_elems * sizeof(float));
    eng_st_close(f);
    return out;
}

/* Strip one trailing newline (generate ends its text with one). */
static inline void tsu_chomp(char *s, size_t *n) {
    if (*n && s[*n - 1] == '\n') s[--*n] = '\0';
}

/* Flip one byte of the LMDB data file where snapshot record `rec` lies (at
 * `offset` into the record): damage as a disk or a stray write would do it,
 * below LMDB. Records are stored contiguously (LMDB overflow pages) and
 * their first 256 bytes are unique (fingerprint, time, checksums). */
static inline unsigned char *tsu_find(const char *hay, size_t n, const unsigned char *needle,
                                      size_t m) {
    for (size_t i = 0; m <= n && i <= n - m; i++)
        if ((unsigned char)hay[i] == needle[0] && !memcmp(hay + i, needle, m))
            return (unsigned char *)hay + i;
    return NULL;
}

static inline void tsu_flip_in_file(const char *db, const unsigned char *rec, size_t rec_len,
                                    size_t offset) {
    char *path = tmu_path(db, "data.mdb");
    size_t n;
    char *file = tmu_read(path, &n);
    cr_assert(file, "read %s", path);
    cr_assert_gt(rec_len, 256);
    unsigned char *at = tsu_find(file, n, rec, 256);
    cr_assert(at, "snapshot record not found in %s", path);
    cr_assert_eq(memcmp(at, rec, rec_len), 0);
    size_t pos = (size_t)(at - (unsigned char *)file) + offset;
    int fd = open(path, O_WRONLY);
    cr_assert_geq(fd, 0);
    unsigned char b = (unsigned char)file[pos] ^ 0x10;
    cr_assert_eq(pwrite(fd, &b, 1, (off_t)pos), 1);
    fsync(fd);
    close(fd);
    free(file);
    free(path);
}

/* Damage the payload of session `name`'s head snapshot in store `db` (which
 * no process may have open). */
static inline void tsu_corrupt_head(const char *db, const char *name) {
    sess_store *st = NULL;
    kds_err e = {0};
    sess_params sp = sess_default_params();
    cr_assert_eq(sess_open(db, &sp, &st, &e), KDS_OK, "%s", e.msg);
    sess_session_info si;
    cr_assert_eq(sess_session_get(st, name, &si, &e), KDS_OK, "%s", e.msg);
    unsigned char k[8];
    sess__key64(k, si.head);
    void *rec = NULL;
    size_t len = 0;
    cr_assert_eq(sess__raw_get(st, "snapshots", k, 8, &rec, &len, &e), KDS_OK, "%s", e.msg);
    sess_close(st);
    tsu_flip_in_file(db, rec, len, len - len / 3); /* in the payload */
    free(rec);
}

#endif
