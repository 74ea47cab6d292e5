/*
 * `kdaserve chat` in scripted mode (stdin not a terminal), driven as a user
 * scripts it, on the bundled default model (plain continuation) and a
 * temporary store: a conversation resumed by a new process continues
 * exactly as if never interrupted (the sampler's random stream included);
 * /fork then diverging turns leave the original untouched; an unknown
 * command is one error line and the REPL goes on; --json events parse.
 */
#include <criterion/criterion.h>
#include <cJSON.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_helpers.h"

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
    for (int i = 0; i < n; i++) free(s[i]);
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
    cr_assert_eq(chat(args, "Hello there\nWhat next?\n", out, sizeof out, err, sizeof err), 0,
                 "%s", err);
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
    cr_assert_eq(chat("--session one --json --max-tokens 16", msgs, out, sizeof out, err,
                      sizeof err), 0, "%s", err);
    cr_assert_eq(replies(out, one, 4), 2, "%s", out);
    /* the same, cut after the first turn and resumed by a new process */
    cr_assert_eq(chat("--session two --json --max-tokens 16", "It is a truth universally\n", out,
                      sizeof out, err, sizeof err), 0, "%s", err);
    cr_assert_eq(replies(out, a, 4), 1, "%s", out);
    cr_assert_eq(chat("--session two --json --max-tokens 16", " and she said\n", out, sizeof out,
                      err, sizeof err), 0, "%s", err);
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
                      out, sizeof out, err, sizeof err), 0, "%s\n%s", out, err);
    cr_assert_eq(replies(out, r, 8), 4, "%s", out);
    cr_expect_str_eq(r[1], r[2], "the fork and the original diverged from different states");
    cr_assert(strstr(out, "forked 'base'"), "%s", out);
    free_all(r, 4);
    /* each session has its own transcript: base 2 turns, side 3 */
    cr_assert_eq(chat("--session base", "/history\n", out, sizeof out, err, sizeof err), 0);
    cr_expect(!strstr(out, "and then"), "the fork's turn leaked into the original: %s", out);
    cr_assert_eq(chat("--session side", "/sessions\n/history\n", out, sizeof out, err,
                      sizeof err), 0);
    cr_expect(strstr(out, "> Once upon a time") && strstr(out, ">  and then"), "%s", out);
    cr_expect(strstr(out, "forked from base"), "%s", out);
    rm_tmp();
}

Test(repl, unknown_command_is_one_line_and_continues) {
    make_tmp();
    static char out[65536], err[8192];
    int rc = chat("--session u --max-tokens 8", "/frobnicate now\n/open missing\n"
                  "/set top_p 7\nHello\n/stats\n", out, sizeof out, err, sizeof err);
    cr_expect_eq(rc, 1, "failed commands should give exit status 1");
    cr_expect(strstr(err, "kdaserve chat: unknown command '/frobnicate' (try /help)\n"), "%s", err);
    cr_expect(strstr(err, "kdaserve chat: no session 'missing'"), "%s", err);
    cr_expect(strstr(err, "kdaserve chat: bad value '7' for top_p"), "%s", err);
    /* the message after the errors was answered and counted */
    cr_expect(strstr(out, "context tokens"), "%s", out);
    cr_expect(strstr(out, "head snapshot    @1"), "%s", out);
    rm_tmp();
}

Test(repl, json_events_parse) {
    make_tmp();
    static char out[65536], err[8192];
    cr_assert_eq(chat("--json --max-tokens 10", "It was\n/bogus\n/stats\n", out, sizeof out,
                      err, sizeof err), 1, "%s", err);
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
             "/stats\n/ingest %s/none.txt\n",
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
    rm_tmp();
}
