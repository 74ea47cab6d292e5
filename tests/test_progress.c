/*
 * The progress line of long work (eng_progress.h): redrawn in place on a
 * terminal (a pty here), whole lines without carriage returns anywhere
 * else (a file standing for a log), the final 100% line either way, and a
 * failed job's terminal line ended so that its error starts a line.
 */
#include <criterion/criterion.h>
#include <pty.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "eng_progress.h"

static void nap(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* Everything written to f, from its start. */
static size_t slurp(FILE *f, char *buf, size_t cap) {
    fflush(f);
    rewind(f);
    const size_t n = fread(buf, 1, cap - 1, f);
    buf[n] = '\0';
    return n;
}

/* What a pty's other side got, up to and including `until` (or all of
 * it once the writer's end is closed), NUL-ended. */
static void read_pty(int master, char *buf, size_t cap, const char *until) {
    size_t n = 0;
    ssize_t got;
    buf[0] = '\0';
    while (n + 1 < cap && (got = read(master, buf + n, cap - 1 - n)) > 0) {
        n += (size_t)got;
        buf[n] = '\0';
        if (strstr(buf, until)) break;
    }
    close(master);
}

/* A pty: its terminal side as a stream, the other side's fd in *master. */
static FILE *open_terminal(int *master) {
    int slave = -1;
    cr_assert_eq(openpty(master, &slave, NULL, NULL, NULL), 0, "openpty");
    FILE *f = fdopen(slave, "w");
    cr_assert_not_null(f);
    return f;
}

static int count(const char *s, const char *what) {
    int n = 0;
    for (const char *p = strstr(s, what); p; p = strstr(p + 1, what)) n++;
    return n;
}

Test(progress, a_log_gets_whole_lines_and_no_carriage_returns) {
    FILE *f = tmpfile();
    cr_assert_not_null(f);
    eng_progress p;
    eng_progress_start(&p, f, 4000000000u, "reading %s into memory", "/m/model.safetensors");
    cr_assert_eq(p.every, ENG_PROGRESS_LOG_S, "a file is not a terminal: the log's interval");
    eng_progress_set(&p, 1000000000u); /* within the interval: nothing yet */
    char buf[4096];
    cr_assert_eq(slurp(f, buf, sizeof buf), 0, "wrote before its interval: \"%s\"", buf);
    fseek(f, 0, SEEK_END);

    p.every = 0.05;
    nap(0.06);
    eng_progress_set(&p, 2000000000u);
    nap(0.06);
    eng_progress_add(&p, 1000000000u);
    eng_progress_finish(&p);
    eng_progress_finish(&p); /* a second finish writes nothing */
    slurp(f, buf, sizeof buf);
    cr_assert_null(strchr(buf, '\r'), "a carriage return in a log: \"%s\"", buf);
    cr_assert_eq(count(buf, "\n"), 3, "three lines: \"%s\"", buf);
    cr_assert(strstr(buf, "reading /m/model.safetensors into memory:  50% (2.00 / 4.00 GB, "),
              "the half-way line: \"%s\"", buf);
    cr_assert(strstr(buf, "reading /m/model.safetensors into memory:  75% (3.00 / 4.00 GB, "),
              "the three-quarter line: \"%s\"", buf);
    cr_assert(strstr(buf, "reading /m/model.safetensors into memory: 100% (4.00 GB in "),
              "the final line: \"%s\"", buf);
    fclose(f);
}

Test(progress, a_terminal_line_is_redrawn_in_place) {
    int master = -1;
    FILE *f = open_terminal(&master);
    eng_progress p;
    eng_progress_start(&p, f, 2000000000u, "writing %s", "/m");
    cr_assert(p.tty, "a pty is a terminal");
    cr_assert_eq(p.every, ENG_PROGRESS_TTY_S);
    p.every = 0.05;
    for (int i = 1; i <= 3; i++) {
        nap(0.06);
        eng_progress_set(&p, 500000000u * (uint64_t)i);
    }
    eng_progress_finish(&p);
    fclose(f);
    char buf[4096];
    read_pty(master, buf, sizeof buf, "\n");
    cr_assert_eq(count(buf, "\r"), 4 + 1, "three redraws and the final line (the pty adds a \\r "
                 "before the newline): \"%s\"", buf);
    cr_assert(strstr(buf, "\rwriting /m:  75% (1.50 / 2.00 GB, "), "the last redraw: \"%s\"", buf);
    cr_assert(strstr(buf, "\rwriting /m: 100% (2.00 GB in "), "the final line: \"%s\"", buf);
    cr_assert_eq(count(buf, "\n"), 1, "one line on the terminal: \"%s\"", buf);
}

Test(progress, a_failed_job_ends_its_terminal_line_and_says_nothing_more) {
    int master = -1;
    FILE *f = open_terminal(&master);
    eng_progress p;
    eng_progress_start(&p, f, 1000, "quantising into %s", "/q");
    p.every = 0.0;
    eng_progress_set(&p, 400);
    eng_progress_abandon(&p);
    eng_progress_finish(&p); /* after abandon: nothing */
    fputs("error\n", f);
    fclose(f);
    char buf[4096];
    read_pty(master, buf, sizeof buf, "error\r\n");
    cr_assert(strstr(buf, "quantising into /q:  40%"), "the line drawn: \"%s\"", buf);
    cr_assert(strstr(buf, "\r\nerror"), "the error on a line of its own: \"%s\"", buf);
    cr_assert_null(strstr(buf, "100%"), "no final line for a failed job: \"%s\"", buf);
}

Test(progress, off_and_empty_jobs_write_nothing) {
    FILE *f = tmpfile();
    cr_assert_not_null(f);
    eng_progress p;
    eng_progress_start(&p, NULL, 100, "off");
    eng_progress_set(&p, 50);
    eng_progress_finish(&p);
    eng_progress_start(&p, f, 0, "nothing to do");
    eng_progress_add(&p, 10);
    eng_progress_finish(&p);
    eng_progress_abandon(&p);
    char buf[256];
    cr_assert_eq(slurp(f, buf, sizeof buf), 0, "wrote \"%s\"", buf);
    fclose(f);
}
