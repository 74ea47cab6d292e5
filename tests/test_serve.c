/*
 * `kdaserve serve` against docs/protocol.md, end to end: each test starts a
 * server (default model, a fresh store in /tmp) and runs groups of
 * tests/node/ws_protocol.test.js, a WebSocket client written from the
 * protocol document alone, which prints one line per check and exits 0 only
 * if all passed. Servers with an auth file of two tenants and with small
 * limits are started for the groups that need them; the server is restarted
 * (and once stopped by SIGTERM in the middle of a generation) to check that
 * sessions continue exactly; every server must exit 0 on SIGTERM.
 *
 * Needs node and the packages of tests/node (npm ci there; run
 * ./scripts/bootstrap.sh): without them these tests fail, saying so.
 */
#include <criterion/criterion.h>
#include <stdarg.h>

#include "eng.h"
#include "test_helpers.h"
#include "test_serve_util.h"
#include "test_sess_util.h"

#define PROTO_JS TS_NODE_DIR "/ws_protocol.test.js"
#define LOAD_JS TS_NODE_DIR "/ws_load.js"

static void need_node(void) {
    cr_assert_eq(th_system("node --version >/dev/null 2>&1"), 0,
                 "node is not installed: the WebSocket protocol tests run a node client "
                 "(run ./scripts/bootstrap.sh)");
    cr_assert(ts_node_module("ws") && ts_node_module("@msgpack/msgpack"),
              "the node packages ws and @msgpack/msgpack are missing from tests/node/node_modules: "
              "run ./scripts/bootstrap.sh (or npm ci in tests/node)");
}

static void make_tmp(char *dir, size_t cap) {
    snprintf(dir, cap, "/tmp/kds_serve_XXXXXX");
    cr_assert(mkdtemp(dir), "mkdtemp");
}

static void rm_tmp(const char *dir) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    th_system(cmd);
}

/* Start a server on store dir/db with extra options (NULL-terminated list
 * after the db), log in dir/server.log; fail the test with the log if it
 * does not come up. */
static void start_v(ts_server *s, const char *dir, va_list ap) {
    char db[512], log[512];
    snprintf(db, sizeof db, "%s/db", dir);
    snprintf(log, sizeof log, "%s/server.log", dir);
    const char *args[32] = {"--db", db};
    int n = 2;
    for (const char *a; n < 31 && (a = va_arg(ap, const char *));)
        args[n++] = a;
    args[n] = NULL;
    cr_assert(ts_start_log(s, args, log), "kdaserve serve did not start (exit %d); log:\n%s",
              s->status, s->log_tail);
}

static void start(ts_server *s, const char *dir, ...) {
    va_list ap;
    va_start(ap, dir);
    start_v(s, dir, ap);
    va_end(ap);
}

static void stop_clean(ts_server *s) {
    int st = ts_stop(s);
    cr_expect_eq(st, 0, "kdaserve serve did not exit 0 on SIGTERM (status %d); log:\n%s", st,
                 s->log_tail);
}

/* Run the protocol script with `args` against s; its output goes to stderr. */
static int node_run(const ts_server *s, const char *fmt, ...) {
    char args[2048], cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "node '" PROTO_JS "' --url '%s' %s 1>&2", s->url, args);
    return th_system(cmd);
}

static void expect_groups(ts_server *s, const char *groups, const char *extra) {
    int rc = node_run(s, "--group %s %s", groups, extra ? extra : "");
    if (rc != 0) ts_fill_tail(s);
    cr_expect_eq(rc, 0,
                 "ws_protocol.test.js --group %s %s: some checks failed (the 'not ok' "
                 "lines above say which); the server's log ends:\n%s",
                 groups, extra ? extra : "", s->log_tail);
}

/* Groups on a fresh server of their own, started with the options that
 * follow (NULL-terminated); `extra`: more arguments for the script. */
static void groups_on_server(const char *groups, const char *extra, ...) {
    need_node();
    char dir[64];
    make_tmp(dir, sizeof dir);
    ts_server s;
    va_list ap;
    va_start(ap, extra);
    start_v(&s, dir, ap);
    va_end(ap);
    expect_groups(&s, groups, extra);
    stop_clean(&s);
    rm_tmp(dir);
}

static void one_group(const char *group) {
    groups_on_server(group, NULL, NULL);
}

TestSuite(serve, .timeout = 900);

Test(serve, basic_operations) {
    one_group("basic");
}
/* --bf16: the server says so at start, and serves (a prefill's products
 * round their activations; the protocol does not change). A build without
 * bf16 dot products says the products stay exact. */
Test(serve, bf16_prefill_flag) {
    need_node();
    char dir[64];
    make_tmp(dir, sizeof dir);
    ts_server s;
    start(&s, dir, "--bf16", NULL);
    expect_groups(&s, "basic", NULL);
    char *log = tmu_read(s.log, NULL);
    cr_assert(log);
    if (eng_cpu_bf16_products())
        cr_expect(strstr(log, "products with bf16 activations in a prefill (--bf16)"), "%s", log);
    else /* a build without AVX-512 BF16 says the products stay exact */
        cr_expect(strstr(log, "so the products stay exact") && strstr(log, "products exact"),
                  "%s", log);
    free(log);
    stop_clean(&s);
    rm_tmp(dir);
}

Test(serve, generate_streams_and_forks) {
    one_group("generate");
}
Test(serve, resume_in_halves_equals_one_request) {
    one_group("resume");
}
Test(serve, msgpack_frames) {
    one_group("msgpack");
}
Test(serve, cancel_and_busy) {
    one_group("cancel");
}
Test(serve, concurrent_streams_match_alone) {
    one_group("concurrent");
}
Test(serve, client_disconnect_saves_session) {
    one_group("disconnect");
}
Test(serve, malformed_input) {
    one_group("malformed");
}

/* Half a reply, restart the server, the other half: the same text as the
 * whole reply generated in one request (greedy and sampled). */
Test(serve, resume_after_restart) {
    need_node();
    char dir[64], extra[256];
    make_tmp(dir, sizeof dir);
    ts_server s;
    start(&s, dir, NULL);
    snprintf(extra, sizeof extra, "--phase save --state '%s/state.json'", dir);
    expect_groups(&s, "restart", extra);
    stop_clean(&s);
    start(&s, dir, NULL);
    snprintf(extra, sizeof extra, "--phase check --state '%s/state.json'", dir);
    expect_groups(&s, "restart", extra);
    stop_clean(&s);
    rm_tmp(dir);
}

/* SIGTERM (sent by the script) while a reply streams: the client is closed
 * with 1001, the server exits 0, and after a restart the session has the
 * partial turn. */
Test(serve, sigterm_mid_generation_saves_and_exits_0) {
    need_node();
    char dir[64], extra[256];
    make_tmp(dir, sizeof dir);
    ts_server s;
    start(&s, dir, NULL);
    snprintf(extra, sizeof extra, "--phase save --state '%s/state.json' --server-pid %d", dir,
             (int)s.pid);
    expect_groups(&s, "shutdown", extra);
    int st = ts_wait(&s, TS_STOP_TIMEOUT_S);
    cr_expect_eq(st, 0, "after SIGTERM mid-generation the server exited with %d; log:\n%s", st,
                 s.log_tail);
    start(&s, dir, NULL);
    snprintf(extra, sizeof extra, "--phase check --state '%s/state.json'", dir);
    expect_groups(&s, "shutdown", extra);
    stop_clean(&s);
    rm_tmp(dir);
}

/* A token of 32 hex digits from /dev/urandom. */
static void random_token(char out[33]) {
    unsigned char b[16] = {0};
    FILE *f = fopen("/dev/urandom", "rb");
    cr_assert(f && fread(b, 1, sizeof b, f) == sizeof b, "/dev/urandom");
    fclose(f);
    for (int i = 0; i < 16; i++)
        snprintf(out + 2 * i, 3, "%02x", b[i]);
}

/* --auth-file with tenants alice and bob: isolation, the auth op and the
 * Bearer header, wrong tokens; then the ordinary operations as alice; the
 * store keeps tenant sessions as TENANT.NAME. */
Test(serve, auth_two_tenants) {
    need_node();
    char dir[64], auth[128], ta[33], tb[33], extra[512];
    make_tmp(dir, sizeof dir);
    random_token(ta);
    random_token(tb);
    snprintf(auth, sizeof auth, "%s/tokens", dir);
    FILE *f = fopen(auth, "w");
    cr_assert(f, "cannot write %s", auth);
    fprintf(f, "# kdaserve tokens: TOKEN TENANT\n%s alice\n\n%s bob\n", ta, tb);
    fclose(f);
    chmod(auth, 0600);
    ts_server s;
    start(&s, dir, "--auth-file", auth, NULL);
    snprintf(extra, sizeof extra, "--token-a %s --token-b %s --tenant-a alice --tenant-b bob", ta,
             tb);
    expect_groups(&s, "auth", extra);
    snprintf(extra, sizeof extra, "--token-a %s", ta);
    expect_groups(&s, "basic,cancel", extra);
    stop_clean(&s);

    char out[65536];
    char cmd[1024];
    snprintf(cmd, sizeof cmd, TS_KDASERVE " snap ls --db '%s/db' 2>&1", dir);
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = '\0';
    cr_expect_eq(pclose(p), 0, "%s:\n%s", cmd, out);
    cr_expect(strstr(out, "alice.") && strstr(out, "bob."),
              "the store should list tenant sessions as alice.NAME and bob.NAME:\n%s", out);
    rm_tmp(dir);
}

/* Small limits: concurrent generations, message size, sessions in memory
 * (LRU eviction is invisible), requests waiting, connections. */
Test(serve, limits) {
    groups_on_server("limits", "--max-connections 6", "--max-generations", "2", "--max-message",
                     "65536", "--max-sessions", "3", "--max-queue", "4", "--max-queue-total", "6",
                     "--max-connections", "6", NULL);
}

/* A short idle timeout and a small --max-tokens. */
Test(serve, idle_timeout_and_max_tokens) {
    groups_on_server("maxtokens,idle", NULL, "--idle-timeout", "2", "--max-tokens", "64", NULL);
}

/* A client that stops reading: only its stream pauses (small
 * --max-pending so the pause comes soon after the socket buffers fill). */
Test(serve, slow_reader_backpressure) {
    groups_on_server("backpressure", NULL, "--max-pending", "4096", "--max-tokens", "1000000",
                     NULL);
}

/* A snapshot damaged on disk (one byte of data.mdb flipped) is refused
 * with the code corrupt by open, generate and restore, changes nothing,
 * and the server goes on serving the other sessions. */
Test(serve, corrupt_snapshot_refused) {
    need_node();
    char dir[64], db[128], cmd[1024];
    make_tmp(dir, sizeof dir);
    snprintf(db, sizeof db, "%s/db", dir);
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd,
                 TS_KDASERVE " generate --db %s --session %s --prompt 'It is a truth' "
                             "--max-tokens 8 >/dev/null 2>&1",
                 db, i ? "bad" : "good");
        cr_assert_eq(th_system(cmd), 0, "%s", cmd);
    }
    tsu_corrupt_head(db, "bad");
    ts_server s;
    start(&s, dir, NULL);
    expect_groups(&s, "corrupt", NULL);
    stop_clean(&s);
    rm_tmp(dir);
}

/* The load test runs (2 connections, a few tokens) and sees no error; its
 * figures are not judged here (docs/benchmarks.md has them). */
Test(serve, load_test_smoke) {
    need_node();
    char dir[64], cmd[1024];
    make_tmp(dir, sizeof dir);
    ts_server s;
    start(&s, dir, NULL);
    snprintf(cmd, sizeof cmd, "node '" LOAD_JS "' --url '%s' --conns 2 --tokens 16 1>&2", s.url);
    cr_expect_eq(th_system(cmd), 0, "%s failed", cmd);
    stop_clean(&s);
    rm_tmp(dir);
}

/* A flood of requests on one connection (default limits): the extra ones are
 * refused at once, another connection's stats is not starved, a closing
 * connection's queued requests are dropped; SIGTERM (sent by the script)
 * during a flood: the server exits 0 within 30 s, not after the flood. */
Test(serve, flood_is_bounded_and_stops_quickly) {
    need_node();
    char dir[64], extra[128];
    make_tmp(dir, sizeof dir);
    ts_server s;
    start(&s, dir, NULL);
    snprintf(extra, sizeof extra, "--server-pid %d", (int)s.pid);
    expect_groups(&s, "flood", extra);
    double t0 = kds_now_s();
    int st = ts_wait(&s, 30);
    cr_expect_eq(st, 0,
                 "after SIGTERM during a flood the server exited with %d after %.0f s; log:\n%s",
                 st, kds_now_s() - t0, s.log_tail);
    rm_tmp(dir);
}

/* op append: a document of several MB streamed in chunks equals the same
 * text in one generate (tokens, next greedy reply); progress, UTF-8 cut by
 * chunks, invalid UTF-8, cancel, another connection streaming meanwhile.
 * --max-message is raised so that one generate can carry the whole text. */
Test(serve, ingest_document_in_chunks) {
    groups_on_server("ingest", NULL, "--max-message", "8388608", NULL);
}

/* --prefill-slice: the server says its slice at start (256 by default,
 * whatever the engine's own prefill step), and with slices of 64 a
 * document in chunks still equals the same text in one generate (both
 * prefilled in the same slices; their resume points on 64s). */
Test(serve, prefill_slice_flag) {
    need_node();
    char dir[64];
    make_tmp(dir, sizeof dir);
    ts_server s;
    start(&s, dir, NULL);
    char *log = tmu_read(s.log, NULL);
    cr_assert(log);
    cr_expect(strstr(log, "prefill slices of 256 tokens"), "%s", log);
    free(log);
    stop_clean(&s);
    rm_tmp(dir);
    make_tmp(dir, sizeof dir);
    start(&s, dir, "--prefill-slice", "64", "--max-message", "8388608", NULL);
    log = tmu_read(s.log, NULL);
    cr_assert(log);
    cr_expect(strstr(log, "prefill slices of 64 tokens"), "%s", log);
    free(log);
    expect_groups(&s, "ingest", NULL);
    stop_clean(&s);
    rm_tmp(dir);
}
