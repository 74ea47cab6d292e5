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
    fprintf(f, "usage: kdaserve chat [--model DIR] [--db DIR] [--session NAME | --new] [--json]\n"
               "                     [--chat | --plain] [--max-tokens N] [--ignore-eos]\n"
               "                     [--temperature T] [--top-k K] [--top-p P] [--min-p M]\n"
               "                     [--seed S] [--threads N] [--bf16]\n\n"
               "Talk with a model. The conversation is a session of the snapshot store: saved\n"
               "after every turn and on leaving, and resumed by `kdaserve chat --session NAME`\n"
               "exactly where it was (its state is loaded, nothing is replayed). Opening a saved\n"
               "session prints its size, how long the resume took and its last turns.\n\n"
               "Type a message and press Enter; the reply streams. Lines starting with / are\n"
               "commands (/help lists them all): /sessions /new /open /fork /save /restore\n"
               "/ingest /export /history /system /set /stats /quit.\n\n"
               "Keys (on a terminal): Ctrl-C stops a reply (what was generated is kept and\n"
               "saved); Ctrl-C twice at the prompt, or Ctrl-D, leaves. TAB completes commands,\n"
               "session names and /set keys; Up/Down walk the input history, kept in\n"
               "DB/chat_history.\n\n"
               "Scripted mode (stdin not a terminal): one message or command per line, only the\n"
               "replies on stdout (one line each), notices and errors on stderr; exit status 1\n"
               "when any line failed. --json: one JSON event per line on stdout instead.\n\n"
               "  --model DIR       model directory (default: the session's model, else\n"
               "                    $KDASERVE_MODEL, else the bundled models/default)\n"
               "  --db DIR          snapshot store (default $XDG_DATA_HOME/kdaserve, else\n"
               "                    ~/.local/share/kdaserve)\n"
               "  --session NAME    open this session, or create it under this name\n"
               "  --new             start a new session named chat-N (the default)\n"
               "  --json            one JSON object per event on stdout: token, done, error,\n"
               "                    info, output, progress (see docs/repl.md)\n"
               "  --chat            chat format (Kimi's turns) even without a chat template\n"
               "  --plain           plain continuation: each message is fed as text (the\n"
               "                    default for models without a chat template, such as\n"
               "                    models/default). A saved session keeps its own mode; these\n"
               "                    two override it\n"
               "  --max-tokens N    reply limit per turn (default 256; /set max_tokens N)\n"
               "  --ignore-eos      do not stop at stop tokens (a reply ends at max-tokens or\n"
               "                    Ctrl-C)\n"
               "  --temperature T   0 = greedy; --top-k K, --top-p P, --min-p M as generate.\n"
               "                    Sampling settings are saved with each turn; a session\n"
               "                    opened without these options continues with its own\n"
               "  --seed S          sampler seed of a new session (default 0); a saved session\n"
               "                    continues its own random stream\n"
               "  --threads N       worker threads (default: all CPUs)\n"
               "  --bf16            prompts and /ingest prefilled with bf16 activations\n"
               "                    (llama.cpp's precision; about twice as fast on the CPU;\n"
               "                    default exact)\n\n"
               "More: docs/repl.md.\n");
}

enum {
    OPT_DB = 1000,
    OPT_SESSION,
    OPT_NEW,
    OPT_JSON,
    OPT_PLAIN,
    OPT_MAXTOK,
    OPT_TEMP,
    OPT_TOPK,
    OPT_TOPP,
    OPT_MINP,
    OPT_SEED,
    OPT_THREADS,
    OPT_CHAT,
    OPT_IGNORE_EOS,
    OPT_BF16
};

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
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"db", required_argument, 0, OPT_DB},
                                         {"session", required_argument, 0, OPT_SESSION},
                                         {"new", no_argument, 0, OPT_NEW},
                                         {"json", no_argument, 0, OPT_JSON},
                                         {"plain", no_argument, 0, OPT_PLAIN},
                                         {"chat", no_argument, 0, OPT_CHAT},
                                         {"max-tokens", required_argument, 0, OPT_MAXTOK},
                                         {"ignore-eos", no_argument, 0, OPT_IGNORE_EOS},
                                         {"temperature", required_argument, 0, OPT_TEMP},
                                         {"top-k", required_argument, 0, OPT_TOPK},
                                         {"top-p", required_argument, 0, OPT_TOPP},
                                         {"min-p", required_argument, 0, OPT_MINP},
                                         {"seed", required_argument, 0, OPT_SEED},
                                         {"threads", required_argument, 0, OPT_THREADS},
                                         {"bf16", no_argument, 0, OPT_BF16},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    repl_params p = repl_default_params();
    p.comm = cli_comm(); /* under mpirun: the other ranks hold their experts */
    p.ep_placement = cli_placement();
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
        case OPT_IGNORE_EOS: p.ignore_eos = true; break;
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
        case OPT_BF16: p.bf16_act = true; break;
        case OPT_TEMP:
            if (!cli_parse_f32(optarg, 0.0f, 100.0f, &p.sampler.temperature))
                return cli_failf("chat", "bad value '%s' for --temperature", optarg);
            p.sampler_given = true;
            break;
        case OPT_TOPK:
            if (!cli_parse_i64(optarg, 0, 1 << 30, &v))
                return cli_failf("chat", "bad value '%s' for --top-k", optarg);
            p.sampler.top_k = (int)v;
            p.sampler_given = true;
            break;
        case OPT_TOPP:
            if (!cli_parse_f32(optarg, 0.0f, 1.0f, &p.sampler.top_p))
                return cli_failf("chat", "bad value '%s' for --top-p", optarg);
            p.sampler_given = true;
            break;
        case OPT_MINP:
            if (!cli_parse_f32(optarg, 0.0f, 1.0f, &p.sampler.min_p))
                return cli_failf("chat", "bad value '%s' for --min-p", optarg);
            p.sampler_given = true;
            break;
        default: return cli_usage_error("chat", NULL);
        }
    }
    if (optind < argc) return cli_failf("chat", "unexpected argument '%s'", argv[optind]);
    {
        eng_ctx_params note = eng_ctx_default_params();
        note.bf16_act = p.bf16_act;
        cli_note_bf16("chat", &note);
    }
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
