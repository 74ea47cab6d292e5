/*
 * `kdaserve chat` in a real terminal: the program runs on a pseudo-terminal
 * (forkpty, TERM=xterm, so readline is on) and the tests type keys and read
 * what it draws, as a user in tmux would: streamed replies, Ctrl-C during a
 * long generation (the partial reply kept, the session intact), /fork then
 * diverging turns in both sessions, leaving and reopening (size, resume
 * time and last turns shown; greedy decoding continues exactly as one
 * uninterrupted process does), TAB completion of commands and session
 * names, the history file across processes (Up arrow), /ingest progress
 * redrawn in place, and leaving by Ctrl-D or a second Ctrl-C.
 *
 * Every wait is for text, with a generous deadline (the machine is slow
 * and shared); no assertion depends on timing. Model: the bundled
 * models/default (6.7M parameters: a turn takes well under a second).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <sys/stat.h>
#include <cJSON.h>
#include <errno.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_helpers.h"
#include "kds_clock.h"

#define KDASERVE KDS_BINARY_DIR "/kdaserve"
#define MODEL KDS_SOURCE_DIR "/models/default"
#define WAIT_S 60       /* per expected piece of output; only ever a failure deadline */
#define LONG_WAIT_S 600 /* for a whole /ingest (minutes in a sanitizer build) */

static char tmpdir[256], db[300];

static void make_tmp(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kds_repl_pty_XXXXXX");
    cr_assert(mkdtemp(tmpdir), "mkdtemp");
    snprintf(db, sizeof db, "%s/db", tmpdir);
}

static void rm_tmp(void) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    th_system(cmd);
}

/* ------------------------------------------------------------------------ */
/* A program on a pseudo-terminal                                            */

typedef struct term {
    pid_t pid;
    int fd;    /* the master side; -1 once the program has gone */
    char *raw; /* every byte it wrote */
    size_t raw_n, raw_cap;
    char *text; /* the same without escape sequences, \r and bells */
    size_t n, cap;
    size_t mark; /* searches start here */
    int esc;     /* escape-sequence state carried across reads */
    int status;  /* wait status once reaped */
    bool reaped;
} term;

static void grow(char **p, size_t *cap, size_t need) {
    if (need <= *cap) return;
    size_t c = *cap ? *cap : 65536;
    while (c < need)
        c *= 2;
    *p = realloc(*p, c);
    cr_assert(*p, "out of memory");
    *cap = c;
}

/* Append bytes to raw and, filtered, to text. Escape sequences (CSI
 * "ESC [ ... final", OSC "ESC ] ... BEL", and two-byte "ESC x") are what
 * readline draws with; they carry no text. */
static void absorb(term *t, const char *p, size_t n) {
    grow(&t->raw, &t->raw_cap, t->raw_n + n + 1);
    memcpy(t->raw + t->raw_n, p, n);
    t->raw_n += n;
    t->raw[t->raw_n] = '\0';
    grow(&t->text, &t->cap, t->n + n + 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        switch (t->esc) {
        case 1: /* after ESC */
            t->esc = c == '[' ? 2 : c == ']' ? 3 : (c == '(' || c == ')') ? 4 : 0;
            continue;
        case 2: /* CSI: parameters until a final byte */
            if (c >= 0x40 && c <= 0x7e) t->esc = 0;
            continue;
        case 3: /* OSC: until BEL (or ESC \) */
            if (c == 0x07)
                t->esc = 0;
            else if (c == 0x1b)
                t->esc = 1;
            continue;
        case 4: /* charset designation: one byte */ t->esc = 0; continue;
        }
        if (c == 0x1b) {
            t->esc = 1;
            continue;
        }
        if (c == '\r' || c == 0x07 || c == '\b') continue;
        t->text[t->n++] = (char)c;
    }
    t->text[t->n] = '\0';
}

/* Read what is there (waiting at most ms). False once the program's side
 * is closed. */
static bool pump(term *t, int ms) {
    if (t->fd < 0) return false;
    struct pollfd pfd = {.fd = t->fd, .events = POLLIN};
    int rc = poll(&pfd, 1, ms);
    if (rc <= 0) return true;
    char buf[8192];
    ssize_t k = read(t->fd, buf, sizeof buf);
    if (k > 0) {
        absorb(t, buf, (size_t)k);
        return true;
    }
    if (k < 0 && errno == EINTR) return true;
    close(t->fd); /* EIO: the last holder of the terminal closed it */
    t->fd = -1;
    return false;
}

/* Start `kdaserve chat --model MODEL --db DB --threads 1 ARGS...` on a new
 * 200x50 terminal. */
static void term_start(term *t, const char *args) {
    memset(t, 0, sizeof *t);
    absorb(t, "", 0); /* text and raw exist (empty) before the first read */
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "exec " KDASERVE " chat --model " MODEL " --db %s --threads 1 %s", db,
             args);
    struct winsize ws = {.ws_row = 50, .ws_col = 200};
    t->pid = forkpty(&t->fd, NULL, NULL, &ws);
    if (t->pid < 0 && (errno == ENOENT || errno == ENODEV || errno == ENXIO)) {
        int e = errno;
        rm_tmp();
        cr_skip_test("no pseudo-terminals here (forkpty: %s)", strerror(e));
    }
    cr_assert_geq(t->pid, 0, "forkpty: %s", strerror(errno));
    if (t->pid == 0) {
        setenv("TERM", "xterm", 1);
        setenv("INPUTRC", "/dev/null", 1); /* no personal key bindings */
        setenv("HOME", tmpdir, 1);
        unsetenv("KDASERVE_MODEL");
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
}

/* Wait (at most `secs`) for `needle` after the mark; the mark moves past
 * it. Returns a malloc'd copy of the text between the old mark and the
 * needle. */
static char *term_until_s(term *t, const char *needle, int secs) {
    double end = kds_now_s() + secs;
    for (;;) {
        char *at = strstr(t->text + t->mark, needle);
        if (at) {
            size_t from = t->mark, to = (size_t)(at - t->text);
            t->mark = to + strlen(needle);
            char *s = strndup(t->text + from, to - from);
            cr_assert(s);
            return s;
        }
        bool open = pump(t, 200);
        cr_assert(open || strstr(t->text + t->mark, needle),
                  "the program left before printing '%s'; its screen after the mark:\n%s", needle,
                  t->text + t->mark);
        cr_assert(kds_now_s() < end, "no '%s' within %d s; the screen after the mark:\n%s", needle,
                  secs, t->text + t->mark);
    }
}

static char *term_until(term *t, const char *needle) {
    return term_until_s(t, needle, WAIT_S);
}

static void term_wait(term *t, const char *needle) {
    free(term_until(t, needle));
}

/* Wait until at least `bytes` more bytes of text follow the mark. */
static void term_wait_bytes(term *t, size_t bytes) {
    double end = kds_now_s() + WAIT_S;
    while (t->n < t->mark + bytes) {
        cr_assert(pump(t, 200), "the program left; its screen:\n%s", t->text + t->mark);
        cr_assert(kds_now_s() < end, "fewer than %zu bytes within %d s:\n%s", bytes, WAIT_S,
                  t->text + t->mark);
    }
}

static void term_send(term *t, const char *keys) {
    size_t n = strlen(keys), off = 0;
    while (off < n) {
        ssize_t k = write(t->fd, keys + off, n - off);
        if (k < 0 && errno == EINTR) continue;
        cr_assert_gt(k, 0, "write to the terminal: %s", strerror(errno));
        off += (size_t)k;
    }
}

/* Wait for the program to end (reading what it still writes); its exit
 * status. */
static int term_exit(term *t) {
    double end = kds_now_s() + WAIT_S;
    while (!t->reaped) {
        pid_t p = waitpid(t->pid, &t->status, WNOHANG);
        if (p == t->pid) {
            t->reaped = true;
            break;
        }
        if (!pump(t, 200)) usleep(50000);
        cr_assert(kds_now_s() < end, "the program did not leave within %d s:\n%s", WAIT_S,
                  t->text + t->mark);
    }
    while (pump(t, 0) && t->fd >= 0) {
        struct pollfd pfd = {.fd = t->fd, .events = POLLIN};
        if (poll(&pfd, 1, 0) <= 0) break;
    }
    return WIFEXITED(t->status) ? WEXITSTATUS(t->status) : -1;
}

static void term_free(term *t) {
    if (!t->reaped && t->pid > 0) {
        kill(t->pid, SIGKILL);
        waitpid(t->pid, &t->status, 0);
    }
    if (t->fd >= 0) close(t->fd);
    free(t->raw);
    free(t->text);
}

/* A scripted run on the same store: `input` on stdin, stdout returned
 * (malloc'd). */
static char *scripted(const char *args, const char *input) {
    char in_path[400], cmd[2048];
    snprintf(in_path, sizeof in_path, "%s/in.txt", tmpdir);
    FILE *f = fopen(in_path, "w");
    cr_assert(f);
    fputs(input, f);
    fclose(f);
    snprintf(cmd, sizeof cmd,
             KDASERVE " chat --model " MODEL " --db %s --threads 1 %s < %s 2>/dev/null", db, args,
             in_path);
    FILE *p = popen(cmd, "r");
    cr_assert(p, "popen %s", cmd);
    size_t cap = 1 << 20, n = 0, k;
    char *out = malloc(cap);
    cr_assert(out);
    while ((k = fread(out + n, 1, cap - 1 - n, p)) > 0)
        n += k;
    out[n] = '\0';
    cr_assert_eq(pclose(p), 0, "%s failed:\n%s", cmd, out);
    return out;
}

/* ------------------------------------------------------------------------ */

Test(repl_pty, stream_ctrl_c_keeps_partial_reply_then_two_ctrl_c_leave, .timeout = 600) {
    make_tmp();
    term t;
    term_start(&t, "--session s --max-tokens 1000000 --ignore-eos");
    term_wait(&t, "Ctrl-D leaves");
    term_wait(&t, "s> ");
    term_send(&t, "It is a truth universally\r");
    term_wait(&t, "It is a truth universally\n"); /* the echo of the line */
    /* streaming: reply text arrives while the turn is still running (it
     * has no end but Ctrl-C) */
    term_wait_bytes(&t, 400);
    term_send(&t, "\x03");
    char *reply = term_until(&t, "(stopped after ");
    char *count = term_until(&t, " tokens; kept)");
    long long produced = 0;
    cr_assert_eq(sscanf(count, "%lld", &produced), 1, "%s", count);
    free(count);
    cr_expect_gt(produced, 0);
    cr_expect_geq(strlen(reply), 400);
    cr_expect(!strstr(reply, "^C"), "Ctrl-C was echoed into the reply");
    term_wait(&t, "s> ");
    /* the session is intact: /history has the partial reply, /stats counts
     * it, and the next turn runs */
    char head[81];
    snprintf(head, sizeof head, "%.80s", reply);
    term_send(&t, "/history\r");
    term_wait(&t, "/history\n");
    char *hist = term_until(&t, "s> ");
    cr_expect(strstr(hist, "> It is a truth universally\n"), "%s", hist);
    cr_expect(strstr(hist, head), "the partial reply is not in /history:\n%s\n---\n%s", head, hist);
    term_send(&t, "/stats\r");
    char *stats = term_until(&t, "s> ");
    long long ctx = 0;
    const char *c = strstr(stats, "context tokens");
    cr_assert(c && sscanf(c, "context tokens %lld", &ctx) == 1, "%s", stats);
    cr_expect_gt(ctx, produced, "context %lld after %lld generated tokens", ctx, produced);
    cr_expect(strstr(stats, "head snapshot    @") && !strstr(stats, "not saved"), "%s", stats);
    term_send(&t, "/set max_tokens 8\r");
    term_wait(&t, "max_tokens = 8");
    term_wait(&t, "s> ");
    term_send(&t, "And then\r");
    term_wait(&t, "And then\n");
    char *second = term_until(&t, "s> ");
    cr_expect(!strstr(second, "kdaserve chat:"), "the turn after Ctrl-C failed: %s", second);
    /* a Ctrl-C at the prompt asks; a second one leaves */
    term_send(&t, "\x03");
    term_wait(&t, "(Ctrl-C again or Ctrl-D to leave)");
    term_wait(&t, "s> ");
    term_send(&t, "\x03");
    cr_expect_eq(term_exit(&t), 0, "%s", t.text);
    /* saved: a new process sees both turns, the first one cut short */
    char *out = scripted("--session s", "/history\n");
    cr_expect(strstr(out, head) && strstr(out, "> And then"), "%s", out);
    free(out);
    free(second);
    free(stats);
    free(hist);
    free(reply);
    term_free(&t);
    rm_tmp();
}

Test(repl_pty, fork_then_diverging_turns_in_both_sessions, .timeout = 600) {
    make_tmp();
    term t;
    term_start(&t, "--session base --temperature 0 --max-tokens 12");
    term_wait(&t, "base> ");
    term_send(&t, "Once upon a time\r");
    term_wait(&t, "Once upon a time\n");
    char *first = term_until(&t, "\nbase> ");
    term_send(&t, "/fork side\r");
    term_wait(&t, "forked 'base' at @");
    term_wait(&t, "now in 'side' ('base' is untouched)");
    term_wait(&t, "side> ");
    term_send(&t, "The end came\r");
    term_wait(&t, "The end came\n");
    char *in_side = term_until(&t, "\nside> ");
    term_send(&t, "/open base\r");
    term_wait(&t, "session 'base' (plain mode)");
    term_wait(&t, "base> ");
    term_send(&t, "She said\r");
    term_wait(&t, "She said\n");
    char *in_base = term_until(&t, "\nbase> ");
    cr_expect_str_neq(in_side, in_base, "different messages after the fork, the same reply");
    /* each transcript: the shared first turn, then only its own */
    term_send(&t, "/history\r");
    term_wait(&t, "/history\n");
    char *hb = term_until(&t, "base> ");
    term_send(&t, "/open side\r");
    term_wait(&t, "side> ");
    term_send(&t, "/history\r");
    term_wait(&t, "/history\n");
    char *hs = term_until(&t, "side> ");
    for (int i = 0; i < 2; i++) {
        const char *h = i ? hs : hb;
        cr_expect(strstr(h, "> Once upon a time\n") && strstr(h, first), "%s", h);
    }
    cr_expect(strstr(hb, "> She said\n") && strstr(hb, in_base), "%s", hb);
    cr_expect(!strstr(hb, "The end came"), "the fork's turn is in the original:\n%s", hb);
    cr_expect(strstr(hs, "> The end came\n") && strstr(hs, in_side), "%s", hs);
    cr_expect(!strstr(hs, "She said"), "the original's turn is in the fork:\n%s", hs);
    term_send(&t, "\x04"); /* Ctrl-D */
    cr_expect_eq(term_exit(&t), 0);
    free(first);
    free(in_side);
    free(in_base);
    free(hb);
    free(hs);
    term_free(&t);
    rm_tmp();
}

/* The replies of a --json run (malloc'd, in order). */
static int json_replies(const char *out, char **r, int cap) {
    int n = 0;
    for (const char *p = out; *p && n < cap;) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        cJSON *o = cJSON_ParseWithLength(p, len);
        cr_assert(o, "not JSON: %.*s", (int)len, p);
        if (!strcmp(cJSON_GetObjectItem(o, "event")->valuestring, "done"))
            r[n++] = strdup(cJSON_GetObjectItem(o, "reply")->valuestring);
        cJSON_Delete(o);
        p = nl ? nl + 1 : p + len;
    }
    return n;
}

Test(repl_pty, leave_and_reopen_continues_as_if_never_interrupted, .timeout = 600) {
    make_tmp();
    /* the reference: both turns in one uninterrupted (scripted) process */
    char *ref_out = scripted("--session ref --json --temperature 0 --max-tokens 24",
                             "It is a truth universally\n and she said\n");
    char *ref[2];
    cr_assert_eq(json_replies(ref_out, ref, 2), 2, "%s", ref_out);
    /* on the terminal: turn 1, leave with Ctrl-D */
    term t;
    term_start(&t, "--session r --temperature 0 --max-tokens 24");
    term_wait(&t, "r> ");
    term_send(&t, "It is a truth universally\r");
    term_wait(&t, "It is a truth universally\n");
    char *one = term_until(&t, "\nr> ");
    cr_expect_str_eq(one, ref[0]);
    term_send(&t, "\x04");
    cr_expect_eq(term_exit(&t), 0);
    term_free(&t);
    /* a new process on the same session: size, resume time, last turns;
     * then turn 2 is the reference's */
    term_start(&t, "--session r --temperature 0 --max-tokens 24");
    term_wait(&t, "session 'r' (plain mode): ");
    char *notice = term_until(&t, "\n");
    long long tokens = 0, snap = 0;
    size_t bytes = 0;
    double ms = -1;
    cr_expect_eq(sscanf(notice, "%lld tokens, %zu bytes of state, resumed from @%lld in %lf ms",
                        &tokens, &bytes, &snap, &ms),
                 4, "%s", notice);
    cr_expect_gt(tokens, 24);
    cr_expect_gt(bytes, 0);
    cr_expect_geq(ms, 0.0);
    char *last = term_until(&t, "Ctrl-D leaves");
    cr_expect(strstr(last, "> It is a truth universally\n") && strstr(last, one),
              "the last turns are not shown:\n%s", last);
    term_wait(&t, "r> ");
    term_send(&t, " and she said\r");
    term_wait(&t, " and she said\n");
    char *two = term_until(&t, "\nr> ");
    cr_expect_str_eq(two, ref[1], "resumed in a new process: '%s'\nuninterrupted: '%s'", two,
                     ref[1]);
    term_send(&t, "\x04");
    cr_expect_eq(term_exit(&t), 0);
    free(ref[0]);
    free(ref[1]);
    free(ref_out);
    free(one);
    free(two);
    free(notice);
    free(last);
    term_free(&t);
    rm_tmp();
}

Test(repl_pty, tab_completion_and_history_across_runs, .timeout = 600) {
    make_tmp();
    term t;
    term_start(&t, "--session longname-alpha --max-tokens 4");
    term_wait(&t, "longname-alpha> ");
    /* "/ses" TAB completes the command: only /sessions prints this line */
    term_send(&t, "/ses\t");
    term_wait(&t, "/sessions");
    term_send(&t, "\r");
    term_wait(&t, "(new, not saved yet)");
    term_wait(&t, "longname-alpha> ");
    term_send(&t, "Hello\r");
    term_wait(&t, "Hello\n");
    term_wait(&t, "longname-alpha> ");
    term_send(&t, "/set ignore_\t on\r"); /* a /set key completes too */
    term_wait(&t, "ignore_eos = on");
    term_send(&t, "/set top_k 7\r");
    term_wait(&t, "top_k = 7");
    term_wait(&t, "longname-alpha> ");
    term_send(&t, "\x04");
    cr_expect_eq(term_exit(&t), 0);
    term_free(&t);
    /* a new process: Up recalls the last line of the last run */
    term_start(&t, "--session other --max-tokens 4");
    term_wait(&t, "other> ");
    term_send(&t, "\x1b[A");
    term_wait(&t, "/set top_k 7");
    term_send(&t, "\r");
    term_wait(&t, "top_k = 7");
    term_wait(&t, "other> ");
    /* a session name completes after /open */
    term_send(&t, "/open longn\t");
    term_wait(&t, "ame-alpha");
    term_send(&t, "\r");
    term_wait(&t, "session 'longname-alpha' (plain mode): ");
    term_wait(&t, "longname-alpha> ");
    term_send(&t, "\x04");
    cr_expect_eq(term_exit(&t), 0);
    term_free(&t);
    rm_tmp();
}

Test(repl_pty, ingest_progress_redrawn_in_place_and_ctrl_c_stops_it, .timeout = 1500) {
    make_tmp();
    /* ~150 KB of text: tens of thousands of tokens */
    char doc[400];
    snprintf(doc, sizeof doc, "%s/doc.txt", tmpdir);
    FILE *f = fopen(doc, "w");
    cr_assert(f);
    for (int i = 0; i < 1200; i++)
        fprintf(f,
                "Paragraph %d. The captain walked to the house, and Emma said that the sea "
                "was a great deal colder than her sister had thought.\n",
                i);
    fclose(f);
    char cmd[600];
    term t;
    term_start(&t, "--session doc");
    term_wait(&t, "doc> ");
    snprintf(cmd, sizeof cmd, "/ingest %s\r", doc);
    term_send(&t, cmd);
    term_wait(&t, "doc.txt\n");
    size_t from = t.raw_n;
    char *bar = term_until_s(&t, "ingested ", LONG_WAIT_S);
    char *line = term_until(&t, " tok/s); context ");
    long long n = 0;
    cr_assert(strstr(line, ": ") && sscanf(strstr(line, ": ") + 2, "%lld tokens", &n) == 1, "%s",
              line);
    free(line);
    cr_expect_gt(n, 20000);
    /* the bar is redrawn in place: updates, but no new line until it ends */
    cr_expect(strstr(bar, "100% ") && strstr(bar, "tok/s"), "%s", bar);
    int newlines = 0;
    for (size_t i = from; i < t.raw_n && strncmp(t.raw + i, "ingested ", 9); i++)
        newlines += t.raw[i] == '\n';
    cr_expect_eq(newlines, 1, "the progress took %d lines:\n%s", newlines, bar);
    term_wait(&t, "doc> ");
    term_send(&t, "/stats\r");
    char *stats = term_until(&t, "doc> ");
    long long ctx = 0;
    const char *c = strstr(stats, "context tokens");
    cr_assert(c && sscanf(c, "context tokens %lld", &ctx) == 1, "%s", stats);
    cr_expect_eq(ctx, n, "%s", stats);
    /* Ctrl-C during an ingest keeps what went in. (If the document went in
     * before the key arrived, the key lands at the prompt instead: then
     * there is nothing to check here.) */
    term_send(&t, cmd);
    term_wait(&t, "doc.txt\n");
    term_wait(&t, "tokens, ");
    term_send(&t, "\x03");
    char *rest = term_until_s(&t, "doc> ", LONG_WAIT_S);
    long long kept = -1, of = 0;
    const char *stop = strstr(rest, "stopped after ");
    if (stop) {
        cr_assert_eq(sscanf(stop, "stopped after %lld of %lld tokens", &kept, &of), 2, "%s", rest);
        cr_expect_eq(of, n);
        cr_expect_lt(kept, n);
        term_send(&t, "/stats\r");
        free(stats);
        stats = term_until(&t, "doc> ");
        c = strstr(stats, "context tokens");
        cr_assert(c && sscanf(c, "context tokens %lld", &ctx) == 1, "%s", stats);
        cr_expect_eq(ctx, n + kept, "%s", stats);
        /* the history keeps the part that went in: the document, with the
         * bytes of its fed tokens (fewer than the file's) */
        term_send(&t, "/history\r");
        char *hist = term_until(&t, "doc> ");
        const char *last = NULL;
        for (const char *h = hist; (h = strstr(h, "[document doc.txt: ")); h++) last = h;
        long long bytes = 0, toks = 0;
        cr_assert(last && sscanf(last, "[document doc.txt: %lld bytes, %lld tokens]", &bytes, &toks) == 2,
                  "%s", hist);
        struct stat sb;
        cr_assert_eq(stat(doc, &sb), 0);
        cr_expect(bytes > 0 && bytes < (long long)sb.st_size, "kept %lld of %lld bytes", bytes,
                  (long long)sb.st_size);
        cr_expect_eq(toks, kept, "%s", hist);
        free(hist);
    } else {
        cr_log_warn("the second ingest ended before Ctrl-C arrived: %s", rest);
    }
    term_send(&t, "\x04");
    cr_expect_eq(term_exit(&t), 0);
    free(rest);
    free(stats);
    free(bar);
    term_free(&t);
    rm_tmp();
}
