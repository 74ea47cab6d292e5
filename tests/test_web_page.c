/*
 * The web chat page (web/www) in a real browser against a real server:
 * `kdaserve serve` on a free port with a temporary store and the bundled
 * default model, then tests/node/web_page.test.js (headless Chromium driven
 * by playwright-core) connects, creates a session, sees a reply stream in
 * piece by piece, stops a long generation with the Stop button, forks,
 * restores, renames, deletes and saves a screenshot to
 * KDS_BINARY_DIR/artifacts/web-page.png. The server then gets SIGTERM and
 * must exit 0.
 *
 * Node, playwright-core (npm ci in tests/node) and Chromium are installed by
 * scripts/bootstrap.sh, as in CI; when one is missing this test fails and
 * says so (a skip would hide that the page went untested).
 */
#include <criterion/criterion.h>

#include "test_helpers.h"
#include "test_serve_util.h"

#define ARTIFACTS KDS_BINARY_DIR "/artifacts"
#define SHOT ARTIFACTS "/web-page.png"
#define SERVER_LOG ARTIFACTS "/web-page-server.log"
#define BROWSER_LOG ARTIFACTS "/web-page-browser.log"

/* The browser web_page.test.js will use: $KDS_CHROMIUM, else Debian's. */
static const char *chromium(void) {
    const char *env = getenv("KDS_CHROMIUM");
    if (env && *env) return access(env, X_OK) == 0 ? env : NULL;
    static const char *const cands[] = {"/usr/bin/chromium", "/usr/bin/chromium-browser",
                                        "/usr/lib/chromium/chromium"};
    for (size_t i = 0; i < sizeof cands / sizeof cands[0]; i++)
        if (access(cands[i], X_OK) == 0) return cands[i];
    return NULL;
}

/* Print a log file to stderr (the browser test's check lines, or the
 * server's output when something failed). */
static void dump(const char *what, const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return;
    fprintf(stderr, "---- %s (%s) ----\n", what, path);
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        fwrite(buf, 1, n, stderr);
    fprintf(stderr, "---- end of %s ----\n", what);
    fclose(f);
}

Test(web_page, browser_drives_the_page, .timeout = 600) {
    cr_assert_eq(th_system("node --version >/dev/null 2>&1"), 0,
                 "node is not installed: run ./scripts/bootstrap.sh");
    cr_assert(ts_node_module("playwright-core"),
              "tests/node/node_modules/playwright-core is missing: run ./scripts/bootstrap.sh "
              "(it runs npm ci in tests/node)");
    cr_assert(chromium(), "no Chromium at $KDS_CHROMIUM or /usr/bin/chromium: run "
                          "./scripts/bootstrap.sh (it installs Debian's chromium)");
    int mk = mkdir(ARTIFACTS, 0755);
    cr_assert(mk == 0 || errno == EEXIST, "mkdir %s: %s", ARTIFACTS, strerror(errno));
    unlink(SHOT);
    unlink(SERVER_LOG); /* ts_start appends */

    char dir[] = "/tmp/kds_web_page_XXXXXX";
    cr_assert(mkdtemp(dir), "mkdtemp: %s", strerror(errno));
    char db[sizeof dir + 8];
    snprintf(db, sizeof db, "%s/db", dir);

    /* One compute thread (the machine is shared) and a high --max-tokens:
     * the page's Stop button gets a generation of tens of seconds to
     * interrupt, however fast this machine streams. */
    const char *args[] = {"--db",         db,
                          "--model",      KDS_SOURCE_DIR "/models/default",
                          "--www",        KDS_SOURCE_DIR "/web/www",
                          "--threads",    "1",
                          "--max-tokens", "100000",
                          NULL};
    ts_server s;
    bool up = ts_start_log(&s, args, SERVER_LOG);
    char rm[128];
    snprintf(rm, sizeof rm, "rm -rf '%s'", dir);
    if (!up) th_system(rm);
    cr_assert(up, "kdaserve serve did not start (exit status %d):\n%s", s.status, s.log_tail);

    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "node '" TS_NODE_DIR "/web_page.test.js' 'http://127.0.0.1:%d/' '" SHOT
             "' > '" BROWSER_LOG "' 2>&1",
             s.port);
    int rc = th_system(cmd);
    dump("browser checks", BROWSER_LOG);

    struct stat st;
    bool shot_ok = stat(SHOT, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0;
    int status = ts_stop(&s);
    if (rc != 0 || status != 0) dump("server log", SERVER_LOG);

    th_system(rm);

    cr_expect_eq(rc, 0, "web_page.test.js failed (exit %d): its check lines are above", rc);
    cr_expect(shot_ok, "no screenshot at %s (or it is empty)", SHOT);
    cr_expect_eq(status, 0, "kdaserve serve exited %d after SIGTERM, not 0:\n%s", status,
                 s.log_tail);
}
