/*
 * test_serve_util.h - start and stop a `kdaserve serve` for a test, and run
 * the node scripts of tests/node against it (header-only, static functions).
 *
 *   ts_server s;
 *   const char *args[] = {"--db", dir, NULL};
 *   cr_assert(ts_start(&s, args), "%s", s.log_tail);   // pid, port, url
 *   ... node against s.url ...
 *   cr_expect_eq(ts_stop(&s), 0, "exit status");       // SIGTERM, wait
 *
 * ts_start picks a free loopback port (another one if it was taken before
 * the server bound it), runs KDS_BINARY_DIR/kdaserve serve
 * --listen 127.0.0.1:PORT followed by `args`, with stdout and stderr
 * appended to a log file (s.log, in /tmp unless log_path is set), and waits
 * until the port accepts connections (60 s) or the server exits. Nothing
 * here calls Criterion, so any test can use it; the caller asserts.
 */
#ifndef TEST_SERVE_UTIL_H
#define TEST_SERVE_UTIL_H

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "kds_clock.h"

#define TS_KDASERVE KDS_BINARY_DIR "/kdaserve"
#define TS_NODE_DIR KDS_SOURCE_DIR "/tests/node"
#define TS_START_TIMEOUT_S 60
#define TS_STOP_TIMEOUT_S 60

typedef struct ts_server {
    pid_t pid; /* 0 when not running */
    int port;
    char url[64];        /* ws://127.0.0.1:PORT/ */
    char log[512];       /* the server's stdout + stderr */
    char log_tail[2048]; /* the log's last bytes, filled when start or stop fails */
    int status;          /* exit status once stopped: 0-255, 128+signal, or -1 */
} ts_server;

static inline void ts_sleep_ms(int ms) {
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* A loopback port nobody listens on now (the kernel's choice of an
 * ephemeral port; another process could take it before the server binds,
 * which ts_start reports as the server exiting early). */
static inline int ts_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    int port = -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

static inline bool ts_port_open(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return false;
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons((uint16_t)port);
    bool ok = connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    return ok;
}

static inline void ts_fill_tail(ts_server *s) {
    s->log_tail[0] = '\0';
    FILE *f = fopen(s->log, "rb");
    if (!f) return;
    fseek(f, 0, SEEK_END);
    long n = ftell(f), take = n < (long)sizeof s->log_tail - 1 ? n : (long)sizeof s->log_tail - 1;
    fseek(f, n - take, SEEK_SET);
    size_t got = fread(s->log_tail, 1, (size_t)take, f);
    s->log_tail[got] = '\0';
    fclose(f);
}

static inline int ts_decode_status(int st) {
    if (WIFEXITED(st)) return WEXITSTATUS(st);
    if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
    return -1;
}

/* Whether the file at `path` holds `needle` past its first `from` bytes. */
static inline bool ts_log_has(const char *path, long from, const char *needle) {
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    bool found = false;
    long n = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    char *text = n > from ? malloc((size_t)(n - from) + 1) : NULL;
    if (text && fseek(f, from, SEEK_SET) == 0) {
        size_t got = fread(text, 1, (size_t)(n - from), f);
        text[got] = '\0';
        found = strstr(text, needle) != NULL;
    }
    free(text);
    fclose(f);
    return found;
}

/* Start `kdaserve serve --listen 127.0.0.1:PORT args...` (args: NULL-terminated,
 * may be NULL). log_path: where its output goes (NULL: /tmp/kds_serve_<port>.log).
 * True once the port accepts connections and the server has said so ("listening
 * on", written after its start lines and its signal handlers: the port opens a
 * moment before, and a SIGTERM then ended the process unsaved, status 143);
 * false (log_tail filled, nothing left running) when it exited first or did not
 * listen within 60 s. */
static inline bool ts_start_once(ts_server *s, const char *const *args, const char *log_path) {
    memset(s, 0, sizeof *s);
    s->status = -1;
    s->port = ts_free_port();
    if (s->port <= 0) {
        snprintf(s->log_tail, sizeof s->log_tail, "no free loopback port: %s", strerror(errno));
        return false;
    }
    snprintf(s->url, sizeof s->url, "ws://127.0.0.1:%d/", s->port);
    if (log_path)
        snprintf(s->log, sizeof s->log, "%s", log_path);
    else
        snprintf(s->log, sizeof s->log, "/tmp/kds_serve_%d.log", s->port);
    char listen[64];
    snprintf(listen, sizeof listen, "127.0.0.1:%d", s->port);
    const char *argv[64] = {TS_KDASERVE, "serve", "--listen", listen};
    int n = 4;
    for (int i = 0; args && args[i] && n < 63; i++)
        argv[n++] = args[i];
    argv[n] = NULL;

    FILE *lf = fopen(s->log, "ab");
    long from = 0; /* this start's output, after earlier starts' in the same log */
    if (lf) {
        fprintf(lf, "$");
        for (int i = 0; i < n; i++)
            fprintf(lf, " %s", argv[i]);
        fprintf(lf, "\n");
        from = ftell(lf);
        fclose(lf);
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(s->log_tail, sizeof s->log_tail, "fork: %s", strerror(errno));
        return false;
    }
    if (pid == 0) {
        int fd = open(s->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        int nul = open("/dev/null", O_RDONLY);
        if (nul >= 0) {
            dup2(nul, 0);
            close(nul);
        }
        /* The test runner's pipes are not the server's business. */
        for (int fd = 3; fd < 1024; fd++)
            close(fd);
        execv(argv[0], (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    s->pid = pid;
    double t0 = kds_now_s();
    while (kds_now_s() - t0 < TS_START_TIMEOUT_S) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            s->pid = 0;
            s->status = ts_decode_status(st);
            ts_fill_tail(s);
            return false;
        }
        if (ts_port_open(s->port) && ts_log_has(s->log, from, "listening on http://")) return true;
        ts_sleep_ms(50);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    s->pid = 0;
    ts_fill_tail(s);
    size_t l = strlen(s->log_tail);
    snprintf(s->log_tail + l, sizeof s->log_tail - l, "\n[not listening on %d after %d s; killed]",
             s->port, TS_START_TIMEOUT_S);
    return false;
}

/* ts_start_once, again on another port when the one picked was taken in
 * between (the server then says "cannot listen" and exits). */
static inline bool ts_start_log(ts_server *s, const char *const *args, const char *log_path) {
    for (int attempt = 0;; attempt++) {
        if (ts_start_once(s, args, log_path)) return true;
        if (attempt == 4 || s->pid != 0 || !strstr(s->log_tail, "cannot listen")) return false;
    }
}

static inline bool ts_start(ts_server *s, const char *const *args) {
    return ts_start_log(s, args, NULL);
}

/* Wait for the server to exit by itself (e.g. after a client sent it
 * SIGTERM) for up to timeout_s; then SIGKILL. Returns its exit status
 * (128+signal if a signal ended it, -1 if it had to be killed). */
static inline int ts_wait(ts_server *s, int timeout_s) {
    if (s->pid <= 0) return s->status;
    double t0 = kds_now_s();
    int st;
    while (kds_now_s() - t0 < timeout_s) {
        pid_t r = waitpid(s->pid, &st, WNOHANG);
        if (r == s->pid) {
            s->pid = 0;
            s->status = ts_decode_status(st);
            if (s->status != 0) ts_fill_tail(s);
            return s->status;
        }
        if (r < 0 && errno != EINTR) break;
        ts_sleep_ms(50);
    }
    kill(s->pid, SIGKILL);
    waitpid(s->pid, NULL, 0);
    s->pid = 0;
    s->status = -1;
    ts_fill_tail(s);
    size_t l = strlen(s->log_tail);
    snprintf(s->log_tail + l, sizeof s->log_tail - l, "\n[still running after %d s; killed]",
             timeout_s);
    return -1;
}

/* SIGTERM, then wait up to 60 s (SIGKILL after). Returns the exit status as
 * ts_wait does; a clean shutdown is 0. */
static inline int ts_stop(ts_server *s) {
    if (s->pid <= 0) return s->status;
    kill(s->pid, SIGTERM);
    return ts_wait(s, TS_STOP_TIMEOUT_S);
}

/* Is tests/node/node_modules/<module> installed (npm ci in tests/node, which
 * scripts/bootstrap.sh runs)? */
static inline bool ts_node_module(const char *module) {
    char p[1024];
    snprintf(p, sizeof p, TS_NODE_DIR "/node_modules/%s/package.json", module);
    struct stat st;
    return stat(p, &st) == 0;
}

#endif
