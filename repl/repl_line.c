/*
 * repl_line.c - interactive mode on a terminal with GNU readline (callback
 * interface, so a Ctrl-C at the prompt is seen at once): history file, tab
 * completion of commands, session names and settings, Ctrl-C to stop a
 * reply, a second Ctrl-C at the prompt or Ctrl-D to leave; SIGHUP or
 * SIGTERM (the terminal closed) stop a reply, save and leave; Ctrl-Z and
 * window resizes are handled here too, since readline's own handlers are
 * only active inside rl_callback_read_char.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/select.h>
#include <termios.h>
#include <unistd.h>

#include <readline/history.h>
#include <readline/readline.h>

#include "repl_internal.h"

static repl *g_repl; /* for the completion callbacks (readline has no user pointer) */
static char *g_line;
static bool g_have_line, g_eof;
static volatile sig_atomic_t g_hangup; /* SIGHUP / SIGTERM: stop, save, leave */
static volatile sig_atomic_t g_winch;  /* the terminal was resized */
static volatile sig_atomic_t g_tstp;   /* Ctrl-Z at the prompt */

/* The handlers set a flag and write a byte here; the loop waits on this
 * pipe and the terminal together. A signal may be handled by any thread
 * (the engine's pool and OpenBLAS have their own), and may come between
 * printing the prompt and starting to wait: an EINTR of the waiting
 * thread would miss both, the byte in the pipe misses neither. */
static int g_wake[2] = {-1, -1};

static void wake(void) {
    int saved = errno;
    if (g_wake[1] >= 0) {
        ssize_t k = write(g_wake[1], "", 1); /* full pipe: a wake-up is pending anyway */
        (void)k;
    }
    errno = saved;
}

static void drain_wake(void) {
    char buf[64];
    while (g_wake[0] >= 0 && read(g_wake[0], buf, sizeof buf) > 0) {
    }
}

static void on_sigint(int sig) {
    (void)sig;
    repl_interrupt();
    wake();
}

/* readline's own SIGWINCH handler is installed only inside
 * rl_callback_read_char: a resize while the loop waits would be lost and
 * long lines would wrap at the old width. */
static void on_winch(int sig) {
    (void)sig;
    g_winch = 1;
    wake();
}

/* Ctrl-Z at the prompt: the terminal is in readline's mode, which the shell
 * does not undo, so the loop restores it before stopping and sets it up
 * again (and redraws the line) after `fg`. During a reply SIGTSTP keeps its
 * default action. */
static void on_tstp(int sig) {
    (void)sig;
    g_tstp = 1;
    wake();
}

static void stop_and_resume(void) {
    if (rl_deprep_term_function) rl_deprep_term_function();
    signal(SIGTSTP, SIG_DFL);
    raise(SIGTSTP); /* stopped here until SIGCONT */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_tstp;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTSTP, &sa, NULL);
    if (rl_prep_term_function) rl_prep_term_function(1);
    rl_forced_update_display();
}

static void on_hangup(int sig) {
    (void)sig;
    g_hangup = 1;
    repl_interrupt();
    wake();
}

/* While a reply streams, the terminal is in its normal (cooked) mode, since
 * readline's handler is removed; keys typed meanwhile would be echoed into
 * the reply, and Ctrl-C would print "^C" in it. Echo is off for the turn:
 * typed keys wait in the terminal and show up at the next prompt. */
static bool echo_off(int fd, struct termios *saved) {
    if (!isatty(fd) || tcgetattr(fd, saved) != 0) return false;
    struct termios t = *saved;
    t.c_lflag &= ~(tcflag_t)(ECHO | ECHOCTL);
    return tcsetattr(fd, TCSANOW, &t) == 0;
}

static void on_line(char *line) {
    if (!line) g_eof = true;
    g_line = line;
    g_have_line = true;
    rl_callback_handler_remove();
}

/* ---- completion ---- */

static char **g_cands; /* NULL-terminated candidates of the current completion */

static void free_cands(void) {
    if (!g_cands) return;
    for (char **p = g_cands; *p; p++)
        free(*p);
    free(g_cands);
    g_cands = NULL;
}

static char *cand_gen(const char *text, int state) {
    static size_t i, len;
    if (!state) {
        i = 0;
        len = strlen(text);
    }
    while (g_cands && g_cands[i]) {
        const char *c = g_cands[i++];
        if (!strncmp(c, text, len)) return strdup(c);
    }
    return NULL;
}

static char **complete(const char *text, int start, int end) {
    (void)end;
    rl_attempted_completion_over = 1; /* never fall back to file names */
    free_cands();
    const char *line = rl_line_buffer;
    if (start == 0) {
        const char *const *names = repl_commands();
        size_t n = 0;
        while (names[n])
            n++;
        g_cands = calloc(n + 1, sizeof *g_cands);
        for (size_t i = 0; g_cands && i < n; i++)
            g_cands[i] = strdup(names[i]);
    } else if (!strncmp(line, "/open ", 6) || !strncmp(line, "/fork ", 6) ||
               !strncmp(line, "/save ", 6)) {
        g_cands = repl_session_names(g_repl);
    } else if (!strncmp(line, "/set ", 5)) {
        static const char *keys[] = {"temperature", "top_p",      "top_k", "min_p",
                                     "max_tokens",  "ignore_eos", "seed",  NULL};
        g_cands = calloc(sizeof keys / sizeof keys[0], sizeof *g_cands);
        for (size_t i = 0; g_cands && keys[i]; i++)
            g_cands[i] = strdup(keys[i]);
    }
    return g_cands ? rl_completion_matches(text, cand_gen) : NULL;
}

/* ---- the loop ---- */

int repl_run_interactive(repl *r) {
    g_repl = r;
    if (pipe2(g_wake, O_NONBLOCK | O_CLOEXEC) != 0) {
        repl__error(r, "cannot create a pipe: %s", strerror(errno));
        return r->failures;
    }
    rl_catch_signals = 0;  /* SIGINT is ours: it stops a reply, or leaves at the prompt */
    rl_catch_sigwinch = 0; /* ours: on_winch */
    rl_readline_name = "kdaserve";
    rl_attempted_completion_function = complete;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART; /* a signal during a reply must not cut a write short */
    sa.sa_handler = on_sigint;
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = on_hangup;
    sigaction(SIGHUP, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sa.sa_handler = on_tstp;
    sigaction(SIGTSTP, &sa, NULL);
    sa.sa_handler = on_winch;
    sigaction(SIGWINCH, &sa, NULL);
    g_hangup = g_winch = g_tstp = 0;
    using_history();
    if (r->history_file) read_history(r->history_file);
    fprintf(r->out, "kdaserve chat: /help for commands, Ctrl-C stops a reply, Ctrl-D leaves\n");
    int in = fileno(rl_instream ? rl_instream : stdin);
    bool armed = false; /* one Ctrl-C at the prompt was pressed */
    for (;;) {
        char prompt[SESS_NAME_MAX + 8];
        snprintf(prompt, sizeof prompt, "%s> ", r->session);
        g_have_line = g_eof = false;
        g_line = NULL;
        /* a Ctrl-C that stopped the last reply is spent */
        drain_wake();
        repl__clear_interrupt();
        g_tstp = 0;
        if (g_winch) {
            g_winch = 0;
            rl_resize_terminal();
        }
        rl_callback_handler_install(prompt, on_line);
        bool leave = false;
        while (!g_have_line) {
            fd_set fds;
            FD_ZERO(&fds);
            FD_SET(in, &fds);
            FD_SET(g_wake[0], &fds);
            int rc = select((in > g_wake[0] ? in : g_wake[0]) + 1, &fds, NULL, NULL, NULL);
            if (rc < 0 && errno != EINTR) {
                leave = true;
                break;
            }
            if (rc > 0 && FD_ISSET(g_wake[0], &fds)) drain_wake();
            if (g_hangup) {
                leave = true;
                break;
            }
            if (g_winch) {
                g_winch = 0;
                rl_resize_terminal();
            }
            if (g_tstp) {
                g_tstp = 0;
                stop_and_resume();
                continue;
            }
            if (repl__interrupted()) {
                repl__clear_interrupt();
                if (armed) {
                    leave = true;
                    break;
                }
                armed = true;
                rl_free_line_state(); /* also ends a search or a half-typed key sequence */
                rl_callback_sigcleanup();
                rl_replace_line("", 0);
                rl_crlf();
                fprintf(r->out, "(Ctrl-C again or Ctrl-D to leave)\n");
                rl_on_new_line();
                rl_redisplay();
                continue;
            }
            if (rc > 0 && FD_ISSET(in, &fds)) rl_callback_read_char();
        }
        if (leave) {
            rl_callback_handler_remove();
            fputc('\n', r->out);
            break;
        }
        if (g_eof) {
            fputc('\n', r->out);
            break;
        }
        armed = false;
        bool go_on = true;
        if (g_line[0]) {
            HIST_ENTRY *prev =
                history_length ? history_get(history_base + history_length - 1) : NULL;
            if (!prev || strcmp(prev->line, g_line)) { /* no repeated entries */
                add_history(g_line);
                if (r->history_file && append_history(1, r->history_file) != 0)
                    write_history(r->history_file);
            }
            struct termios saved;
            bool restore = echo_off(in, &saved);
            struct sigaction tstp;
            sigaction(SIGTSTP, NULL, &tstp);
            signal(SIGTSTP, SIG_DFL); /* a reply just stops and goes on after fg */
            go_on = repl_line(r, g_line);
            sigaction(SIGTSTP, &tstp, NULL);
            if (restore) tcsetattr(in, TCSANOW, &saved);
        }
        free(g_line);
        g_line = NULL;
        if (!go_on || g_hangup) break;
    }
    if (r->history_file) history_truncate_file(r->history_file, 2000);
    /* leaving saves what a failed save or an interrupted turn left */
    repl__command(r, (char[]){"/quit"});
    free_cands();
    signal(SIGINT, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGWINCH, SIG_DFL);
    signal(SIGTSTP, SIG_DFL);
    close(g_wake[0]);
    close(g_wake[1]);
    g_wake[0] = g_wake[1] = -1;
    return r->failures;
}
