/*
 * The OpenAI-compatible HTTP API of `kdaserve serve` (docs/http-api.md), end
 * to end: each test starts a server (default model, a fresh store in /tmp)
 * and runs groups of tests/node/openai_api.test.js, whose client is the
 * official `openai` npm package pinned in tests/node/package.json. The
 * script prints one line per check and exits 0 only if all passed. The
 * resume test restarts the server between its two phases, so the second
 * half of the conversation resumes from the store on disk; its replies are
 * compared with a stateful WebSocket session's turn for turn.
 *
 * Needs node and the packages of tests/node (./scripts/bootstrap.sh, or
 * npm ci there): without them these tests fail, saying so.
 */
#include <criterion/criterion.h>
#include <stdarg.h>
#include <sys/stat.h>

#include "test_helpers.h"
#include "test_serve_util.h"

#define OPENAI_JS TS_NODE_DIR "/openai_api.test.js"

static void need_node(void) {
    cr_assert_eq(th_system("node --version >/dev/null 2>&1"), 0,
                 "node is not installed: the HTTP API tests run the openai SDK under node "
                 "(run ./scripts/bootstrap.sh)");
    cr_assert(ts_node_module("openai") && ts_node_module("ws"),
              "the node packages openai and ws are missing from tests/node/node_modules: run "
              "./scripts/bootstrap.sh (or npm ci in tests/node)");
}

/* Start a server on store dir/db with the options that follow (NULL-ended). */
static void start(ts_server *s, const char *dir, ...) {
    char db[512], log[512];
    snprintf(db, sizeof db, "%s/db", dir);
    snprintf(log, sizeof log, "%s/server.log", dir);
    const char *args[32] = {"--db", db};
    int n = 2;
    va_list ap;
    va_start(ap, dir);
    for (const char *a; n < 31 && (a = va_arg(ap, const char *));)
        args[n++] = a;
    va_end(ap);
    args[n] = NULL;
    cr_assert(ts_start_log(s, args, log), "kdaserve serve did not start (exit %d); log:\n%s",
              s->status, s->log_tail);
}

static void stop_clean(ts_server *s) {
    int st = ts_stop(s);
    cr_expect_eq(st, 0, "kdaserve serve did not exit 0 on SIGTERM (status %d); log:\n%s", st,
                 s->log_tail);
}

/* Run groups of the script against s (http://127.0.0.1:PORT). */
static void expect_groups(ts_server *s, const char *groups, const char *extra) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "node '" OPENAI_JS "' --url 'http://127.0.0.1:%d' --group %s %s 1>&2",
             s->port, groups, extra ? extra : "");
    int rc = th_system(cmd);
    if (rc != 0) ts_fill_tail(s);
    cr_expect_eq(rc, 0,
                 "openai_api.test.js --group %s %s: some checks failed (the 'not ok' lines above "
                 "say which); the server's log ends:\n%s",
                 groups, extra ? extra : "", s->log_tail);
}

static void make_tmp(char *dir, size_t cap) {
    snprintf(dir, cap, "/tmp/kds_openai_XXXXXX");
    cr_assert(mkdtemp(dir), "mkdtemp");
}

static void rm_tmp(const char *dir) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    th_system(cmd);
}

TestSuite(openai, .timeout = 900);

/* Models, completions, streams, usage, stop, seeds; then bad requests of
 * every kind, answered in OpenAI's error shape, the server surviving them
 * (a small --max-http-body so that the over-long body is cheap to send; a
 * large --max-tokens so that a client going away must be what stops a reply). */
Test(openai, endpoints_and_errors) {
    need_node();
    char dir[64];
    make_tmp(dir, sizeof dir);
    ts_server s;
    start(&s, dir, "--max-http-body", "65536", "--max-tokens", "100000", NULL);
    expect_groups(&s, "basic,errors", NULL);
    stop_clean(&s);
    rm_tmp(dir);
}

/* --auth-file with two tenants: 401s, and no tenant resumes another's state. */
Test(openai, auth_and_tenant_isolation) {
    need_node();
    char dir[64], auth[128], extra[256];
    make_tmp(dir, sizeof dir);
    const char *ta = "tok-alice-0123456789abcdef", *tb = "tok-bob-0123456789abcdef00";
    snprintf(auth, sizeof auth, "%s/tokens", dir);
    FILE *f = fopen(auth, "w");
    cr_assert(f, "cannot write %s", auth);
    fprintf(f, "%s alice\n%s bob\n", ta, tb);
    fclose(f);
    chmod(auth, 0600);
    ts_server s;
    start(&s, dir, "--auth-file", auth, NULL);
    snprintf(extra, sizeof extra, "--token-a %s --token-b %s", ta, tb);
    expect_groups(&s, "auth", extra);
    stop_clean(&s);
    rm_tmp(dir);
}

/* A 10-turn conversation resent whole every turn: 5 turns, a restart, 5
 * more from the store, then an edited branch; every reply equals the
 * stateful WebSocket session's and costs only its new tokens. */
Test(openai, resume_across_restart) {
    need_node();
    char dir[64], extra[256];
    make_tmp(dir, sizeof dir);
    ts_server s;
    start(&s, dir, NULL);
    snprintf(extra, sizeof extra, "--phase save --state '%s/state.json'", dir);
    expect_groups(&s, "resume", extra);
    stop_clean(&s);
    start(&s, dir, NULL);
    snprintf(extra, sizeof extra, "--phase check --state '%s/state.json'", dir);
    expect_groups(&s, "resume", extra);
    stop_clean(&s);
    rm_tmp(dir);
}

/* An HTTP turn's sampler settings are what its session records: a later
 * WebSocket generate without sampling fields samples with them, whether the
 * session stayed in memory or was loaded from the store. */
Test(openai, http_turn_records_its_sampler) {
    need_node();
    char dir[64];
    make_tmp(dir, sizeof dir);
    ts_server s;
    start(&s, dir, NULL);
    expect_groups(&s, "recorded", NULL);
    stop_clean(&s);
    rm_tmp(dir);
}

/* A WebSocket generate cancelled, or left by its client, while its prompt
 * is prefilled leaves its session's token hash whole: the turn's end and
 * the session's later turns stay in the prefix index, and a stateless
 * client resumes from them. */
Test(openai, cancelled_prefill_keeps_the_index) {
    need_node();
    char dir[64];
    make_tmp(dir, sizeof dir);
    ts_server s;
    start(&s, dir, NULL);
    expect_groups(&s, "cancelled", NULL);
    stop_clean(&s);
    rm_tmp(dir);
}

/* Keep-alive: a connection carries request after request, each answered
 * whole; a request pipelined after a POST closes the connection instead of
 * being answered as part of the POST; the openai client's pooled
 * connections under load get every answer right (with --auth-file, so that
 * the Bearer header goes through the kept connection too). */
Test(openai, keep_alive_and_pipelining) {
    need_node();
    char dir[64], auth[128], extra[256];
    make_tmp(dir, sizeof dir);
    const char *ta = "tok-alice-0123456789abcdef";
    snprintf(auth, sizeof auth, "%s/tokens", dir);
    FILE *f = fopen(auth, "w");
    cr_assert(f, "cannot write %s", auth);
    fprintf(f, "%s alice\n", ta);
    fclose(f);
    chmod(auth, 0600);
    ts_server s;
    start(&s, dir, "--auth-file", auth, NULL);
    snprintf(extra, sizeof extra, "--token-a %s", ta);
    expect_groups(&s, "keepalive", extra);
    stop_clean(&s);
    rm_tmp(dir);
}
