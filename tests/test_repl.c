/*
 * `kdaserve chat` in scripted mode (stdin not a terminal), driven as a user
 * scripts it, on the bundled default model (plain continuation) and a
 * temporary store: a conversation resumed by a new process continues
 * exactly as if never interrupted (the sampler's random stream included);
 * /fork then diverging turns leave the original untouched; an unknown
 * command is one error line and the REPL goes on; --json events parse;
 * /ingest of a large file shows bounded progress and grows the context; a
 * corrupt snapshot, a missing session or file are one line each and the
 * REPL goes on; a session reopens in the mode (chat or plain) it was
 * written in. The interactive mode is tested in test_repl_pty.c.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <cJSON.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sess_internal.h"
#include "test_helpers.h"
#include "test_model_util.h"
#include "test_sess_util.h"

#define CHAT KDS_BINARY_DIR "/kdaserve chat --model " KDS_SOURCE_DIR "/models/default --threads 1"

static char tmpdir[256];

static void make_tmp(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kds_repl_XXXXXX");
    cr_assert(mkdtemp(tmpdir), "mkdtemp");
}

static void rm_tmp(void) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    th_system(cmd);
}

/* Run `CHAT --db tmp/db ARGS` with `input` on stdin; stdout into out,
 * stderr into err (either may be NULL). Returns the exit status. */
static int chat(const char *args, const char *input, char *out, size_t cap, char *err,
                size_t ecap) {
    char in_path[300], err_path[300], cmd[2048];
    snprintf(in_path, sizeof in_path, "%s/in.txt", tmpdir);
    snprintf(err_path, sizeof err_path, "%s/err.txt", tmpdir);
    FILE *f = fopen(in_path, "w");
    cr_assert(f);
    fputs(input, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, CHAT " --db %s/db %s < %s 2> %s", tmpdir, args, in_path, err_path);
    FILE *p = popen(cmd, "r");
    cr_assert(p, "popen %s", cmd);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    if (err) {
        FILE *e = fopen(err_path, "r");
        size_t k = e ? fread(err, 1, ecap - 1, e) : 0;
        err[k] = '\0';
        if (e) fclose(e);
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void free_all(char **s, int n) {
    for (int i = 0; i < n; i++)
        free(s[i]);
}

/* The "reply" of every "done" event of JSON output, in order (malloc'd). */
static int replies(const char *json, char **out, int cap) {
    int n = 0;
    const char *p = json;
    while (*p && n < cap) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        cJSON *o = cJSON_ParseWithLength(p, len);
        cr_assert(o, "not JSON: %.*s", (int)len, p);
        const cJSON *ev = cJSON_GetObjectItem(o, "event");
        cr_assert(cJSON_IsString(ev), "no event in %.*s", (int)len, p);
        if (!strcmp(ev->valuestring, "done"))
            out[n++] = strdup(cJSON_GetObjectItem(o, "reply")->valuestring);
        cJSON_Delete(o);
        p = nl ? nl + 1 : p + len;
    }
    return n;
}

/* Turn 2 of one process == turn 2 of a second process resuming turn 1. */
static void check_resume(const char *mode) {
    static char out[65536], err[8192];
    char args[256], *one[4], *a[4], *b[4];
    snprintf(args, sizeof args, "--session c1 --json --max-tokens 16 %s", mode);
    cr_assert_eq(chat(args, "Hello there\nWhat next?\n", out, sizeof out, err, sizeof err), 0, "%s",
                 err);
    cr_assert_eq(replies(out, one, 4), 2, "%s", out);
    snprintf(args, sizeof args, "--session c2 --json --max-tokens 16 %s", mode);
    cr_assert_eq(chat(args, "Hello there\n", out, sizeof out, err, sizeof err), 0, "%s", err);
    cr_assert_eq(replies(out, a, 4), 1, "%s", out);
    cr_assert_eq(chat(args, "What next?\n", out, sizeof out, err, sizeof err), 0, "%s", err);
    cr_assert_eq(replies(out, b, 4), 1, "%s", out);
    cr_expect_str_eq(a[0], one[0]);
    cr_expect_str_eq(b[0], one[1], "%s: resumed turn differs", mode);
    free_all(one, 2);
    free_all(a, 1);
    free_all(b, 1);
}

Test(repl, resume_in_chat_format) {
    make_tmp();
    check_resume("--chat");
    static char out[8192], err[8192];
    cr_assert_eq(chat("--session c1", "/stats\n", out, sizeof out, err, sizeof err), 0);
    cr_expect(strstr(out, "mode             chat"), "%s", out);
    rm_tmp();
}

Test(repl, resume_continues_exactly) {
    make_tmp();
    static char out[65536], err[8192];
    char *one[4], *a[4], *b[4];
    const char *msgs = "It is a truth universally\n and she said\n";
    /* the whole conversation in one process */
    cr_assert_eq(
        chat("--session one --json --max-tokens 16", msgs, out, sizeof out, err, sizeof err), 0,
        "%s", err);
    cr_assert_eq(replies(out, one, 4), 2, "%s", out);
    /* the same, cut after the first turn and resumed by a new process */
    cr_assert_eq(chat("--session two --json --max-tokens 16", "It is a truth universally\n", out,
                      sizeof out, err, sizeof err),
                 0, "%s", err);
    cr_assert_eq(replies(out, a, 4), 1, "%s", out);
    cr_assert_eq(chat("--session two --json --max-tokens 16", " and she said\n", out, sizeof out,
                      err, sizeof err),
                 0, "%s", err);
    cr_assert_eq(replies(out, b, 4), 1, "%s", out);
    cr_assert(strstr(out, "resumed from @"), "no resume notice: %s", out);
    cr_expect_str_eq(a[0], one[0]);
    cr_expect_str_eq(b[0], one[1], "resumed turn differs: '%s' vs '%s'", b[0], one[1]);
    cr_expect_gt(strlen(one[1]), 0);
    /* the transcript holds both turns */
    cr_assert_eq(chat("--session two", "/history\n", out, sizeof out, err, sizeof err), 0, "%s",
                 err);
    cr_expect(strstr(out, "> It is a truth universally") && strstr(out, ">  and she said"), "%s",
              out);
    free_all(one, 2);
    free_all(a, 1);
    free_all(b, 1);
    rm_tmp();
}

Test(repl, fork_then_diverging_turns) {
    make_tmp();
    static char out[65536], err[8192];
    char *r[8];
    /* base turn, fork, a turn in the fork; back to the original, the same
     * message there continues from the same state: the same reply */
    cr_assert_eq(chat("--session base --json --max-tokens 12",
                      "Once upon a time\n/fork side\n there was\n/open base\n there was\n"
                      "/open side\n and then\n",
                      out, sizeof out, err, sizeof err),
                 0, "%s\n%s", out, err);
    cr_assert_eq(replies(out, r, 8), 4, "%s", out);
    cr_expect_str_eq(r[1], r[2], "the fork and the original diverged from different states");
    cr_assert(strstr(out, "forked 'base'"), "%s", out);
    free_all(r, 4);
    /* each session has its own transcript: base 2 turns, side 3 */
    cr_assert_eq(chat("--session base", "/history\n", out, sizeof out, err, sizeof err), 0);
    cr_expect(!strstr(out, "and then"), "the fork's turn leaked into the original: %s", out);
    cr_assert_eq(chat("--session side", "/sessions\n/history\n", out, sizeof out, err, sizeof err),
                 0);
    cr_expect(strstr(out, "> Once upon a time") && strstr(out, ">  and then"), "%s", out);
    cr_expect(strstr(out, "forked from base"), "%s", out);
    rm_tmp();
}

Test(repl, unknown_command_is_one_line_and_continues) {
    make_tmp();
    static char out[65536], err[8192];
    int rc = chat("--session u --max-tokens 8",
                  "/frobnicate now\n/open missing\n"
                  "/set top_p 7\nHello\n/stats\n",
                  out, sizeof out, err, sizeof err);
    cr_expect_eq(rc, 1, "failed commands should give exit status 1");
    cr_expect(strstr(err, "kdaserve chat: unknown command '/frobnicate' (try /help)\n"), "%s", err);
    cr_expect(strstr(err, "kdaserve chat: no session 'missing'"), "%s", err);
    cr_expect(strstr(err, "kdaserve chat: bad value '7' for top_p"), "%s", err);
    /* the message after the errors was answered and counted */
    cr_expect(strstr(out, "context tokens"), "%s", out);
    cr_expect(strstr(out, "head snapshot    @1"), "%s", out);
    rm_tmp();
}

/* --bf16: /stats says the prompts' products run with bf16 activations
 * (exact without it, or in a build without bf16 dot products), and the
 * turn is answered. */
Test(repl, bf16_flag_in_stats) {
    make_tmp();
    static char out[65536], err[8192];
    cr_expect_eq(chat("--session b --max-tokens 4 --bf16",
                      "It is a truth universally acknowledged, that a single man\n/stats\n", out,
                      sizeof out, err, sizeof err),
                 0, "%s", err);
    cr_expect(strstr(out, eng_cpu_bf16_products()
                              ? "products         bf16 activations in a prefill (--bf16)"
                              : "products         exact (--bf16: this build has no bf16 dot "
                                "products)"),
              "%s", out);
    const char *ctx = strstr(out, "context tokens   ");
    long long n = 0;
    cr_assert(ctx && sscanf(ctx, "context tokens   %lld", &n) == 1, "%s", out);
    cr_expect_gt(n, 10, "the prompt went in: %s", out);
    cr_expect_eq(chat("--session c --max-tokens 2", "Hello\n/stats\n", out, sizeof out, err,
                      sizeof err),
                 0, "%s", err);
    cr_expect(strstr(out, "products         exact"), "%s", out);
    rm_tmp();
}

Test(repl, json_events_parse) {
    make_tmp();
    static char out[65536], err[8192];
    cr_assert_eq(chat("--json --max-tokens 10", "It was\n/bogus\n/stats\n", out, sizeof out, err,
                      sizeof err),
                 1, "%s", err);
    int tokens = 0, done = 0, errors = 0, outputs = 0;
    char text[4096] = "";
    const char *p = out;
    while (*p) {
        const char *nl = strchr(p, '\n');
        cr_assert(nl, "unterminated event: %s", p);
        cJSON *o = cJSON_ParseWithLength(p, (size_t)(nl - p));
        cr_assert(o, "not JSON: %.*s", (int)(nl - p), p);
        const char *ev = cJSON_GetObjectItem(o, "event")->valuestring;
        if (!strcmp(ev, "token")) {
            tokens++;
            strncat(text, cJSON_GetObjectItem(o, "text")->valuestring,
                    sizeof text - strlen(text) - 1);
        } else if (!strcmp(ev, "done")) {
            done++;
            cr_expect_eq(cJSON_GetObjectItem(o, "tokens")->valueint, 10);
            cr_expect_str_eq(cJSON_GetObjectItem(o, "reply")->valuestring, text);
            cr_expect_str_eq(cJSON_GetObjectItem(o, "stopped")->valuestring, "length");
        } else if (!strcmp(ev, "error")) {
            errors++;
            cr_expect(strstr(cJSON_GetObjectItem(o, "message")->valuestring, "/bogus"));
        } else if (!strcmp(ev, "output")) {
            outputs++;
        }
        cJSON_Delete(o);
        p = nl + 1;
    }
    cr_expect_gt(tokens, 0);
    cr_expect_eq(done, 1);
    cr_expect_eq(errors, 1);
    cr_expect_eq(outputs, 1);
    rm_tmp();
}

Test(repl, ingest_export_restore) {
    make_tmp();
    static char out[65536], err[8192];
    char input[1024];
    snprintf(input, sizeof input,
             "/ingest " KDS_SOURCE_DIR "/repl/README.md\nSo\n/export %s/s.kds\n/restore @1\n"
             "/stats\n/ingest %s/none.txt\n/open doc\n/history\n",
             tmpdir, tmpdir);
    int rc = chat("--session doc --max-tokens 4", input, out, sizeof out, err, sizeof err);
    cr_expect_eq(rc, 1, "the missing file should count as a failure");
    cr_expect(strstr(err, "ingested "), "%s", err);
    cr_expect(strstr(err, " tok/s"), "%s", err);
    cr_expect(strstr(err, "exported to "), "%s", err);
    cr_expect(strstr(err, "restored @1 as session 'snap1-2'"), "%s", err);
    cr_expect(strstr(err, "kdaserve chat: cannot read "), "%s", err);
    char path[300];
    snprintf(path, sizeof path, "%s/s.kds", tmpdir);
    cr_expect_eq(access(path, R_OK), 0, "export file missing");
    /* the restored session holds the ingested document (snapshot @1) */
    const char *ctx = strstr(out, "context tokens");
    cr_assert(ctx, "%s", out);
    long long n = 0;
    sscanf(ctx, "context tokens %lld", &n);
    cr_expect_gt(n, 100, "%s", out);
    /* the document is kept under its name, shown collapsed */
    const char *doc = strstr(out, "[document README.md: ");
    cr_expect(doc, "/history does not show the document: %s", out);
    long long bytes = 0, tokens = 0;
    if (doc) sscanf(doc, "[document README.md: %lld bytes, %lld tokens]", &bytes, &tokens);
    struct stat sb;
    cr_assert_eq(stat(KDS_SOURCE_DIR "/repl/README.md", &sb), 0);
    cr_expect_eq(bytes, (long long)sb.st_size);
    cr_expect_gt(tokens, 100);
    rm_tmp();
}

/* ------------------------------------------------------------------------ */

/* Lines of `text` that start with `prefix`. */
static int count_lines(const char *text, const char *prefix) {
    int n = 0;
    size_t pl = strlen(prefix);
    for (const char *p = text; *p;) {
        if (!strncmp(p, prefix, pl)) n++;
        const char *nl = strchr(p, '\n');
        if (!nl) break;
        p = nl + 1;
    }
    return n;
}

/* The numbers after "context tokens" in /stats outputs, in order. */
static int context_tokens(const char *out, long long *v, int cap) {
    int n = 0;
    for (const char *p = out; n < cap && (p = strstr(p, "context tokens")); p++)
        cr_assert_eq(sscanf(p, "context tokens %lld", &v[n++]), 1);
    return n;
}

/* ~`bytes` of English-like text (seeded): a document for /ingest. */
static void write_document(const char *path, size_t bytes) {
    static const char *words[] = {
        "the",  "of",      "and",    "a",     "to",     "in",     "she",     "was",
        "her",  "it",      "that",   "house", "letter", "Emma",   "Elinor",  "whale",
        "sea",  "said",    "could",  "would", "never",  "sister", "morning", "walked",
        "ship", "captain", "little", "great", "deal",   "heart",  "opinion"};
    FILE *f = fopen(path, "w");
    cr_assert(f, "cannot write %s", path);
    uint32_t x = 12345;
    size_t n = 0, in_sentence = 0;
    while (n < bytes) {
        x = x * 1664525u + 1013904223u;
        const char *w = words[(x >> 8) % (sizeof words / sizeof words[0])];
        n += (size_t)fprintf(f, "%s%s", in_sentence ? " " : "", w);
        if (++in_sentence > 6 + (x >> 28)) {
            n += (size_t)fprintf(f, (x >> 4) % 5 ? ". " : ".\n\n");
            in_sentence = 0;
        }
    }
    fclose(f);
}

Test(repl, ingest_large_file_shows_progress, .timeout = 600) {
    make_tmp();
    static char out[65536], err[65536];
    char doc[300], input[1024];
    snprintf(doc, sizeof doc, "%s/doc.txt", tmpdir);
    write_document(doc, 256 * 1024);
    snprintf(input, sizeof input, "Chapter one\n/stats\n/ingest %s\n/stats\nAnd so\n/stats\n", doc);
    cr_assert_eq(chat("--session big --max-tokens 4", input, out, sizeof out, err, sizeof err), 0,
                 "%s", err);
    /* progress: a line per 10% when stderr is a file, never one per batch */
    int lines = count_lines(err, "[kdaserve] ingest: ");
    cr_expect(lines >= 2 && lines <= 11, "%d progress lines:\n%s", lines, err);
    cr_expect(strstr(err, "[kdaserve] ingest: 100% "), "%s", err);
    cr_expect_eq(count_lines(err, "[kdaserve] ingest: "), (int)(strstr(err, "tok/s") ? lines : -1),
                 "a progress line without tok/s");
    const char *done = strstr(err, "[kdaserve] ingested ");
    cr_assert(done, "%s", err);
    long long n = 0;
    cr_assert(strstr(done, ": ") && sscanf(strstr(done, ": ") + 2, "%lld tokens", &n) == 1, "%s",
              done);
    cr_expect_gt(n, 40000, "a 256 KB document is tens of thousands of tokens");
    cr_expect(strstr(done, " tok/s); context "), "%s", done);
    /* /stats: the context grew by exactly the document, and a turn follows */
    long long ctx[3];
    cr_assert_eq(context_tokens(out, ctx, 3), 3, "%s", out);
    cr_expect_eq(ctx[1] - ctx[0], n, "context %lld -> %lld for %lld ingested", ctx[0], ctx[1], n);
    cr_expect_gt(ctx[2], ctx[1]);
    /* a new process resumes the grown context */
    cr_assert_eq(chat("--session big", "/stats\n", out, sizeof out, err, sizeof err), 0, "%s", err);
    long long again;
    cr_assert_eq(context_tokens(out, &again, 1), 1, "%s", out);
    cr_expect_eq(again, ctx[2]);
    /* --json: progress events that count up to the total */
    snprintf(input, sizeof input, "/ingest %s\n", doc);
    cr_assert_eq(chat("--session bigj --json", input, out, sizeof out, err, sizeof err), 0, "%s",
                 err);
    int events = 0;
    double last = -1, total = 0;
    for (const char *p = out; *p;) {
        const char *nl = strchr(p, '\n');
        cr_assert(nl);
        cJSON *o = cJSON_ParseWithLength(p, (size_t)(nl - p));
        cr_assert(o, "not JSON: %.*s", (int)(nl - p), p);
        if (!strcmp(cJSON_GetObjectItem(o, "event")->valuestring, "progress")) {
            double d = cJSON_GetObjectItem(o, "done")->valuedouble;
            total = cJSON_GetObjectItem(o, "total")->valuedouble;
            cr_expect_gt(d, last, "progress went back");
            cr_expect(cJSON_IsNumber(cJSON_GetObjectItem(o, "tok_s")));
            last = d;
            events++;
        }
        cJSON_Delete(o);
        p = nl + 1;
    }
    cr_expect_geq(events, 1);
    cr_expect_eq((long long)total, n, "total %g, %lld ingested", total, n);
    cr_expect_eq((long long)last, n, "the last progress event is not the whole document");
    rm_tmp();
}

Test(repl, corrupt_snapshot_is_one_line_and_repl_goes_on, .timeout = 120) {
    make_tmp();
    static char out[65536], err[8192];
    char db[300];
    snprintf(db, sizeof db, "%s/db", tmpdir);
    cr_assert_eq(chat("--session good --max-tokens 4", "Hello\n", out, sizeof out, err, sizeof err),
                 0, "%s", err);
    cr_assert_eq(chat("--session bad --max-tokens 4", "Hello\n", out, sizeof out, err, sizeof err),
                 0, "%s", err);
    tsu_corrupt_head(db, "bad");
    /* /open of it: one line naming the session and the reason; still in
     * 'good', which takes the next turn */
    int rc = chat("--session good --max-tokens 4", "/open bad\n/stats\nAgain\n/stats\n", out,
                  sizeof out, err, sizeof err);
    cr_expect_eq(rc, 1);
    cr_expect_eq(count_lines(err, "kdaserve chat: "), 1, "%s", err);
    cr_expect_eq(count_lines(err, ""),
                 count_lines(err, "kdaserve chat: ") + count_lines(err, "[kdaserve] "),
                 "stray lines: %s", err);
    const char *line = strstr(err, "kdaserve chat: cannot open session 'bad': ");
    cr_expect(line && strstr(line, "payload checksum mismatch"), "%s", err);
    cr_expect_eq(count_lines(out, "session          good"), 2, "%s", out);
    long long ctx[2];
    cr_assert_eq(context_tokens(out, ctx, 2), 2, "%s", out);
    cr_expect_gt(ctx[1], ctx[0], "the turn after the error did not run");
    /* starting on it (scripted): one line, exit status 1, nothing written */
    rc = chat("--session bad", "Hello\n", out, sizeof out, err, sizeof err);
    cr_expect_eq(rc, 1);
    cr_expect_eq(count_lines(err, ""), 1, "%s", err);
    cr_expect(strstr(err, "kdaserve chat: cannot resume session 'bad': ") &&
                  strstr(err, "payload checksum mismatch"),
              "%s", err);
    cr_expect_str_eq(out, "");
    rm_tmp();
}

Test(repl, errors_are_one_line_each, .timeout = 120) {
    make_tmp();
    static char out[65536], err[8192];
    char input[2048], empty[300];
    snprintf(empty, sizeof empty, "%s/empty.txt", tmpdir);
    FILE *f = fopen(empty, "w");
    cr_assert(f);
    fclose(f);
    snprintf(input, sizeof input,
             "/frobnicate now\n/open nosuch\n/ingest %s/missing.txt\n/ingest %s\n/ingest %s\n"
             "/new bad!name\n/set max_tokens zero\nHello\n/stats\n",
             tmpdir, tmpdir, empty);
    int rc = chat("--session e --max-tokens 4", input, out, sizeof out, err, sizeof err);
    cr_expect_eq(rc, 1);
    cr_expect_eq(count_lines(err, "kdaserve chat: "), 7, "%s", err);
    cr_expect_eq(count_lines(err, ""), 7 + count_lines(err, "[kdaserve] "), "stray lines: %s", err);
    cr_expect(strstr(err, "kdaserve chat: unknown command '/frobnicate' (try /help)\n"), "%s", err);
    cr_expect(strstr(err, "kdaserve chat: no session 'nosuch' (see /sessions)\n"), "%s", err);
    cr_expect(strstr(err, "/missing.txt: No such file or directory\n"), "%s", err);
    cr_expect(strstr(err, ": Is a directory\n"), "%s", err);
    cr_expect(strstr(err, "empty.txt is empty: nothing to ingest\n"), "%s", err);
    cr_expect(strstr(err, "kdaserve chat: invalid session name 'bad!name'"), "%s", err);
    cr_expect(strstr(err, "kdaserve chat: bad value 'zero' for max_tokens\n"), "%s", err);
    /* the REPL went on: the message was answered and saved */
    cr_expect(strstr(out, "session          e\n"), "%s", out);
    cr_expect(strstr(out, "head snapshot    @"), "%s", out);
    cr_expect(!strstr(out, "(not saved yet)"), "%s", out);
    rm_tmp();
}

static void expect_mode(const char *db, const char *name, const char *mode) {
    sess_store *st = NULL;
    kds_err e = {0};
    sess_params sp = sess_default_params();
    cr_assert_eq(sess_open(db, &sp, &st, &e), KDS_OK, "%s", e.msg);
    sess_session_info si;
    cr_assert_eq(sess_session_get(st, name, &si, &e), KDS_OK, "%s", e.msg);
    cr_expect_str_eq(si.mode, mode, "session '%s'", name);
    sess_close(st);
}

Test(repl, session_reopens_in_its_mode, .timeout = 120) {
    make_tmp();
    static char out[65536], err[8192];
    char db[300], input[1024];
    snprintf(db, sizeof db, "%s/db", tmpdir);
    /* p: plain (the default model's default), started with a document, so
     * its first turn's token count is not its text's (the old guess took
     * such a session for a chat one); c: chat, asked for */
    snprintf(input, sizeof input, "/ingest " KDS_SOURCE_DIR "/repl/README.md\nSo\n");
    cr_assert_eq(chat("--session p --max-tokens 4", input, out, sizeof out, err, sizeof err), 0,
                 "%s", err);
    cr_assert_eq(
        chat("--session c --chat --max-tokens 4", "Hi\n", out, sizeof out, err, sizeof err), 0,
        "%s", err);
    expect_mode(db, "p", "plain");
    expect_mode(db, "c", "chat");
    /* reopened without --chat/--plain, and switched between with /open */
    cr_assert_eq(chat("--session p --max-tokens 4",
                      "/stats\n/open c\n/stats\n/open p\n/stats\n"
                      "/open c\nAgain\n/new fresh\n/stats\n",
                      out, sizeof out, err, sizeof err),
                 0, "%s", err);
    const char *m1 = strstr(out, "mode             plain");
    const char *m2 = m1 ? strstr(m1, "mode             chat") : NULL;
    const char *m3 = m2 ? strstr(m2, "mode             plain") : NULL;
    const char *m4 = m3 ? strstr(m3 + 1, "mode             plain") : NULL;
    cr_expect(m1 && m2 && m3 && m4, "modes not plain, chat, plain, plain (new):\n%s", out);
    cr_expect(strstr(err, "session 'p' (plain mode)") && strstr(err, "session 'c' (chat mode)"),
              "%s", err);
    expect_mode(db, "c", "chat"); /* the turn in c kept its mode */
    /* --plain overrides, and says so */
    cr_assert_eq(chat("--session c --plain", "/stats\n", out, sizeof out, err, sizeof err), 0, "%s",
                 err);
    cr_expect(strstr(err, "session 'c' was written in chat mode; continuing in plain mode as "
                          "asked"),
              "%s", err);
    cr_expect(strstr(out, "mode             plain"), "%s", out);
    /* a fork keeps it */
    cr_assert_eq(chat("--session c", "/fork c2\n", out, sizeof out, err, sizeof err), 0, "%s", err);
    expect_mode(db, "c2", "chat");
    rm_tmp();
}

/* The sampling settings are saved with each turn: a later process opening
 * the session without sampling options continues with them (/set shows
 * them); options given replace them (issue 15). */
Test(repl, sampler_settings_saved_with_the_session) {
    make_tmp();
    static char out[8192], err[8192];
    cr_assert_eq(chat("--session smp --max-tokens 4 --temperature 1.25 --top-k 9", "Hello\n", out,
                      sizeof out, err, sizeof err), 0, "%s", err);
    cr_assert_eq(chat("--session smp", "/set\n", out, sizeof out, err, sizeof err), 0, "%s", err);
    cr_expect(strstr(out, "temperature 1.25") && strstr(out, "top_k 9"), "%s", out);
    cr_assert_eq(chat("--session smp --temperature 0.5", "/set\n", out, sizeof out, err,
                      sizeof err), 0, "%s", err);
    cr_expect(strstr(out, "temperature 0.5"), "%s", out);
    rm_tmp();
}

/* generate --session on a chat session continues it in the chat format,
 * as the REPL does: the second turn given to generate equals the second
 * turn of one REPL process, and the session stays a chat session (issue
 * 15: generate fed the prompt as raw text into the chat context). */
Test(repl, generate_continues_a_chat_session_in_chat_format) {
    make_tmp();
    static char out[65536], err[8192];
    char *one[4], *first[4];
    const char *args = "--json --max-tokens 12 --chat --temperature 0";
    char a[256];
    snprintf(a, sizeof a, "--session both %s", args);
    cr_assert_eq(chat(a, "Hello there\nWhat next?\n", out, sizeof out, err, sizeof err), 0, "%s",
                 err);
    cr_assert_eq(replies(out, one, 4), 2, "%s", out);
    snprintf(a, sizeof a, "--session split %s", args);
    cr_assert_eq(chat(a, "Hello there\n", out, sizeof out, err, sizeof err), 0, "%s", err);
    cr_assert_eq(replies(out, first, 4), 1, "%s", out);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, KDS_BINARY_DIR "/kdaserve generate --db %s/db --session split "
             "--prompt 'What next?' --max-tokens 12 --temperature 0 --threads 1 2>%s/gen.err",
             tmpdir, tmpdir);
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    cr_assert_eq(pclose(p), 0, "%s", out);
    while (n && out[n - 1] == '\n') out[--n] = 0;
    cr_expect_str_eq(out, one[1], "generate's chat turn differs from the REPL's");
    cr_assert_eq(chat("--session split", "/stats\n", out, sizeof out, err, sizeof err), 0);
    cr_expect(strstr(out, "mode             chat"), "%s", out);
    free_all(one, 2);
    free_all(first, 1);
    rm_tmp();
}
