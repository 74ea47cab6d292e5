/* cmd_chat.c - `kdaserve chat`: the conversation REPL (repl/). */
#define _GNU_SOURCE
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "repl.h"
#include "sess.h"

static void chat_usage(FILE *f) {
    fprintf(f,
            "usage: kdaserve chat [--model DIR] [--db DIR] [--session NAME | --new] [--json]\n"
            "                     [--chat | --plain] [--max-tokens N] [--temperature T]\n"
            "                     [--top-k K] [--top-p P] [--min-p M] [--seed S] [--threads N]\n\n"
            "A conversation kept in a session of the snapshot store: saved after every turn,\n"
            "resumed instantly (no replay) by `kdaserve chat --session NAME`. /help lists the\n"
            "commands (/sessions, /open, /fork, /save, /history, /system, /set, /stats, /quit).\n\n"
            "On a terminal: readline editing, history, tab completion; Ctrl-C stops a reply,\n"
            "a second Ctrl-C at the prompt or Ctrl-D leaves. Otherwise (scripted): one message\n"
            "per line on stdin, only the replies on stdout (notices on stderr).\n\n"
            "  --model DIR       model directory (default: the session's model, else\n"
            "                    $KDASERVE_MODEL, else ./models/default)\n"
            "  --db DIR          snapshot store (default $XDG_DATA_HOME/kdaserve)\n"
            "  --session NAME    open this session, or create it\n"
            "  --new             start a new session (named chat-N; the default)\n"
            "  --json            one JSON object per event on stdout (token, done, error, ...)\n"
            "  --chat            use the chat format (Kimi's) even without a chat template\n"
            "  --plain           plain continuation: each line is fed as text (default for\n"
            "                    models without a chat template, like models/default)\n"
            "  --max-tokens N    reply limit per turn (default 256)\n"
            "  --temperature T, --top-k K, --top-p P, --min-p M   sampling (as generate)\n"
            "  --seed S          sampler seed of a new session (default 0)\n"
            "  --threads N       worker threads (default: all CPUs)\n");
}

enum { OPT_DB = 1000, OPT_SESSION, OPT_NEW, OPT_JSON, OPT_PLAIN, OPT_MAXTOK, OPT_TEMP, OPT_TOPK,
       OPT_TOPP, OPT_MINP, OPT_SEED, OPT_THREADS, OPT_CHAT };

/* <db or default store dir>/chat_history (the directory exists once the
 * store is open). */
static char *history_path(const char *db) {
    char dir[4096];
    if (db)
        snprintf(dir, sizeof dir, "%s", db);
    else if (sess_default_dir(dir, sizeof dir, NULL) != KDS_OK)
        return NULL;
    size_t n = strlen(dir) + 32;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/chat_history", dir);
    return p;
}

int cmd_chat(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"db", required_argument, 0, OPT_DB},
        {"session", required_argument, 0, OPT_SESSION}, {"new", no_argument, 0, OPT_NEW},
        {"json", no_argument, 0, OPT_JSON}, {"plain", no_argument, 0, OPT_PLAIN},
        {"chat", no_argument, 0, OPT_CHAT},
        {"max-tokens", required_argument, 0, OPT_MAXTOK},
        {"temperature", required_argument, 0, OPT_TEMP},
        {"top-k", required_argument, 0, OPT_TOPK}, {"top-p", required_argument, 0, OPT_TOPP},
        {"min-p", required_argument, 0, OPT_MINP}, {"seed", required_argument, 0, OPT_SEED},
        {"threads", required_argument, 0, OPT_THREADS}, {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    repl_params p = repl_default_params();
    bool fresh = false;
    int64_t v;
    optind = 1;
    for (int o; (o = getopt_long(argc, argv, "m:h", opts, NULL)) != -1;) {
        switch (o) {
        case 'm': p.model_dir = optarg; break;
        case 'h': chat_usage(stdout); return 0;
        case OPT_DB: p.db_dir = optarg; break;
        case OPT_SESSION: p.session = optarg; break;
        case OPT_NEW: fresh = true; break;
        case OPT_JSON: p.json = true; break;
        case OPT_PLAIN: p.mode = REPL_MODE_PLAIN; break;
        case OPT_CHAT: p.mode = REPL_MODE_CHAT; break;
        case OPT_MAXTOK:
            if (!cli_parse_i64(optarg, 1, INT32_MAX, &p.max_tokens))
                return cli_failf("chat", "--max-tokens wants a count >= 1, got '%s'", optarg);
            break;
        case OPT_SEED:
            if (!cli_parse_i64(optarg, 0, INT64_MAX, &v))
                return cli_failf("chat", "--seed wants a number >= 0, got '%s'", optarg);
            p.seed = (uint64_t)v;
            break;
        case OPT_THREADS:
            if (!cli_parse_i64(optarg, 1, 1024, &v))
                return cli_failf("chat", "--threads wants 1..1024, got '%s'", optarg);
            p.threads = (int)v;
            break;
        case OPT_TEMP:
            if (!cli_parse_f32(optarg, 0.0f, 100.0f, &p.sampler.temperature))
                return cli_failf("chat", "bad value '%s' for --temperature", optarg);
            break;
        case OPT_TOPK:
            if (!cli_parse_i64(optarg, 0, 1 << 30, &v))
                return cli_failf("chat", "bad value '%s' for --top-k", optarg);
            p.sampler.top_k = (int)v;
            break;
        case OPT_TOPP:
            if (!cli_parse_f32(optarg, 0.0f, 1.0f, &p.sampler.top_p))
                return cli_failf("chat", "bad value '%s' for --top-p", optarg);
            break;
        case OPT_MINP:
            if (!cli_parse_f32(optarg, 0.0f, 1.0f, &p.sampler.min_p))
                return cli_failf("chat", "bad value '%s' for --min-p", optarg);
            break;
        default: chat_usage(stderr); return 2;
        }
    }
    if (optind < argc) return cli_failf("chat", "unexpected argument '%s'", argv[optind]);
    if (fresh && p.session) return cli_failf("chat", "give --session NAME or --new, not both");
    if (!p.model_dir) p.default_model_dir = cli_model_dir("chat", NULL);
    p.interactive = isatty(STDIN_FILENO) && isatty(STDOUT_FILENO) && !p.json;
    char *hist = p.interactive ? history_path(p.db_dir) : NULL;
    p.history_file = hist;
    repl *r = NULL;
    kds_err err = {0};
    if (repl_create(&p, stdout, stderr, &r, &err) != KDS_OK) {
        free(hist);
        if (p.json) {
            /* one error event, so a script reading JSON sees why */
            printf("{\"event\":\"error\",\"message\":\"");
            for (const char *c = err.msg; *c; c++) {
                if (*c == '"' || *c == '\\') putchar('\\');
                if ((unsigned char)*c >= 0x20) putchar(*c);
            }
            printf("\"}\n");
        }
        return cli_fail("chat", &err);
    }
    free(hist);
    /* scripted: exit 1 when any turn or command failed (each said why) */
    int failures = p.interactive ? (repl_run_interactive(r), 0) : repl_run_stream(r, stdin);
    repl_free(r);
    return failures ? 1 : 0;
}
