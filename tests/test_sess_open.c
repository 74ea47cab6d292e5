/*
 * Opening a damaged store: a data.mdb cut short (a copy that stopped, a
 * full disk during a backup, `head -c`) is refused at open with one line
 * naming the file and both sizes, by the API and by every command that
 * opens the store, instead of the SIGBUS a read past the end of LMDB's map
 * would raise. The intact original stays usable.
 */
#include <sys/stat.h>

#include "test_sess_util.h"

#define MICRO_KDA TMU_MICRO_KDA

/* A store with a few sessions, closed; returns the size of its data.mdb. */
static size_t make_store(const char *db, tsu_model *f) {
    sess_store *st = tsu_open_store(db);
    kds_err err = {0};
    for (int k = 0; k < 6; k++) {
        eng_seq *s = NULL;
        cr_assert_eq(eng_seq_create(f->m, 1, &s, &err), KDS_OK);
        uint64_t head = 0;
        char name[16];
        snprintf(name, sizeof name, "s%d", k);
        for (int t = 0; t < 3; t++) {
            tsu_feed(f, s, 4, (uint32_t)(k * 10 + t));
            sess_turn turn = {
                .prompt = "p", .prompt_len = 1, .output = "o", .output_len = 1, .prompt_tokens = 4};
            cr_assert_eq(sess_save(st, name, head, f->m, s, &turn, &head, &err), KDS_OK, "%s",
                         err.msg);
        }
        eng_seq_free(s);
    }
    sess_close(st);
    char *path = tmu_path(db, "data.mdb");
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    free(path);
    return (size_t)sb.st_size;
}

/* The first `keep` bytes of src/data.mdb as dst/data.mdb (no lock file). */
static void copy_head(const char *src, const char *dst, size_t keep) {
    char *from = tmu_path(src, "data.mdb"), *to = tmu_path(dst, "data.mdb");
    size_t n;
    char *bytes = tmu_read(from, &n);
    cr_assert(bytes && n >= keep);
    cr_assert_eq(mkdir(dst, 0700), 0);
    cr_assert(tmu_write(to, bytes, keep));
    free(bytes);
    free(from);
    free(to);
}

Test(sess_open, truncated_data_file_refused, .timeout = 120) {
    char *tmp = tmu_mkdtemp();
    tsu_model f = tsu_open_model(MICRO_KDA);
    char *db = tmu_path(tmp, "db"), *cut = tmu_path(tmp, "cut"), *tiny = tmu_path(tmp, "tiny");
    size_t size = make_store(db, &f);
    cr_assert_gt(size, (size_t)64 << 10, "store of %zu bytes is too small to cut", size);
    copy_head(db, cut, size / 2);

    /* the API refuses it at open, read-write and read-only, touching nothing */
    sess_params p = sess_default_params();
    for (int ro = 0; ro < 2; ro++) {
        p.read_only = ro;
        sess_store *st = NULL;
        kds_err err = {0};
        kds_status rc = sess_open(cut, &p, &st, &err);
        if (rc == KDS_OK) { /* unfixed: reading on is where it dies */
            sess_session_info *ss = NULL;
            size_t ns = 0;
            sess_session_list(st, &ss, &ns, &err);
            for (size_t i = 0; i < ns; i++)
                sess_verify(st, ss[i].head, NULL, &err);
            free(ss);
            sess_close(st);
        }
        cr_assert_eq(rc, KDS_CORRUPT, "open %s: %s", ro ? "read-only" : "read-write", err.msg);
        cr_assert_null(st);
        cr_expect(strstr(err.msg, "data.mdb") && strstr(err.msg, "truncated"), "%s", err.msg);
        char have[32];
        snprintf(have, sizeof have, "%zu bytes", size / 2);
        cr_expect(strstr(err.msg, have), "the message names the file's size: %s", err.msg);
    }
    char *path = tmu_path(cut, "data.mdb");
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    cr_expect_eq((size_t)sb.st_size, size / 2, "the refused open changed the file");
    free(path);

    /* every command says so and exits 1: no SIGBUS */
    const char *cmds[] = {"snap verify", "snap ls", "snap gc", "snap show s1",
                          "generate --session s1 --max-tokens 2"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        char out[4096];
        int rc = tsu_run(out, sizeof out, NULL, TSU_KDASERVE " %s --db %s 2>&1", cmds[i], cut);
        cr_expect_eq(rc, 1, "`%s` on a truncated store: exit %d: %s", cmds[i], rc, out);
        cr_expect(strstr(out, "truncated"), "`%s`: %s", cmds[i], out);
    }
    char out[4096];
    int rc = tsu_run(out, sizeof out, NULL,
                     "timeout 60 " TSU_KDASERVE " serve --model %s --db %s --listen 127.0.0.1:0 "
                     "--quiet 2>&1", MICRO_KDA, cut);
    cr_expect_eq(rc, 1, "serve on a truncated store: exit %d: %s", rc, out);
    cr_expect(strstr(out, "truncated"), "serve: %s", out);

    /* shorter than LMDB's two meta pages: named as truncated too */
    copy_head(db, tiny, 5000);
    sess_store *st = NULL;
    kds_err err = {0};
    p.read_only = false;
    cr_expect_neq(sess_open(tiny, &p, &st, &err), KDS_OK);
    cr_expect(strstr(err.msg, "truncated") && strstr(err.msg, "5000 bytes"), "%s", err.msg);
    sess_close(st);

    /* the original is untouched and opens */
    st = tsu_open_store(db);
    sess_session_info si;
    cr_assert_eq(sess_session_get(st, "s5", &si, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(sess_verify(st, si.head, f.m, &err), KDS_OK, "%s", err.msg);
    sess_close(st);
    tsu_close_model(&f);
    free(db);
    free(cut);
    free(tiny);
    tmu_rmtree(tmp);
    free(tmp);
}
