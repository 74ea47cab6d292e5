/* cmd_serve.c - `kdaserve serve`: the WebSocket session service (web/). */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "eng_comm.h"
#include "sess.h"
#include "web.h"

static void serve_usage(FILE *f) {
    fprintf(f, "usage: kdaserve serve [--model DIR] [--db DIR] [--listen HOST:PORT]\n"
               "                      [--auth-file FILE] [--www DIR] [limits...] [--threads N]\n"
               "                      [--device cpu|cuda] [--bf16]\n\n"
               "Serve sessions over WebSocket (protocol kdaserve.v1, docs/protocol.md) and the\n"
               "web chat page at http://HOST:PORT/ (Prometheus metrics at /metrics), and the\n"
               "OpenAI-compatible API under /v1 (docs/http-api.md) on the same port. Sessions\n"
               "live in the same snapshot store as `kdaserve chat`; every turn is saved as it\n"
               "ends. Decode steps of all generating sessions run as one batch.\n"
               "Ctrl-C or SIGTERM stops: running generations end (reason \"cancelled\") and\n"
               "their sessions are saved first.\n\n"
               "  --model DIR            model directory (default $KDASERVE_MODEL, else the\n"
               "                         bundled models/default)\n"
               "  --db DIR               snapshot store (default $XDG_DATA_HOME/kdaserve, else\n"
               "                         ~/.local/share/kdaserve)\n"
               "  --listen HOST:PORT     address (default 127.0.0.1:8080; PORT 0 = any free\n"
               "                         port, printed at start). Plain ws/http: put a TLS\n"
               "                         proxy in front to expose it beyond this machine\n"
               "  --auth-file FILE       require a token: lines 'TOKEN TENANT' (token 16-256\n"
               "                         characters, tenant 1-16 of [A-Za-z0-9_-]); each tenant\n"
               "                         sees only its own sessions\n"
               "  --www DIR              static files at / (default: web/www of the source tree)\n"
               "  --max-message BYTES    largest request (default 1048576; bigger: close 1009)\n"
               "  --max-http-body BYTES  largest body of an HTTP /v1 request (default 67108864;\n"
               "                         bigger: 413; a long document is a long body)\n"
               "  --no-resume            HTTP /v1: never resume from a stored prefix (replay\n"
               "                         every request whole; turns are still saved)\n"
               "  --max-connections N    open connections (default 256; more: close 1013)\n"
               "  --max-sessions N       sessions kept in memory (default 64; idle ones are\n"
               "                         evicted, least recently used first)\n"
               "  --max-generations N    concurrent generations (default 32; more: error limit)\n"
               "  --max-tokens N         cap of a generate's max_tokens (default 4096)\n"
               "  --max-pending BYTES    unsent output per connection before its streams pause\n"
               "                         and its requests are no longer read (default 262144)\n"
               "  --max-queue N          requests of one connection waiting to be handled\n"
               "                         (default 64; more: error limit at once)\n"
               "  --max-queue-total N    requests of all connections waiting (default 1024;\n"
               "                         more: error limit, except for a connection with none)\n"
               "  --idle-timeout S       ping a silent connection after S s, drop it when it\n"
               "                         does not answer (default 300)\n"
               "  --threads N            compute threads (default: all CPUs)\n"
               "  --prefill-slice N      tokens of each stream's prompt or document one\n"
               "                         scheduler step prefills (default 256; at most 16384):\n"
               "                         smaller keeps the other streams' decode steps closer\n"
               "                         together, larger prefills faster (one user: 512)\n"
               "  --device cpu|cuda      where the model runs (default cpu; cuda: the current\n"
               "                         GPU, see kernels/cuda/README.md)\n"
               "  --bf16                 prompts' and documents' products round their\n"
               "                         activations to bf16 (llama.cpp's precision, ~3e-3\n"
               "                         relative error a product; on the CPU about twice as\n"
               "                         fast a long prefill). Default exact. Sessions saved\n"
               "                         either way continue in the other\n"
               "  --quiet                no log lines\n");
}

enum {
    OPT_MAXBODY = 900,
    OPT_BF16,
    OPT_NORESUME,
    OPT_DB = 1000,
    OPT_LISTEN,
    OPT_AUTH,
    OPT_WWW,
    OPT_MAXMSG,
    OPT_MAXCONN,
    OPT_MAXSESS,
    OPT_MAXGEN,
    OPT_MAXTOK,
    OPT_MAXPEND,
    OPT_IDLE,
    OPT_THREADS,
    OPT_QUIET,
    OPT_DEVICE,
    OPT_MAXQUEUE,
    OPT_MAXQUEUE_TOTAL,
    OPT_SLICE
};

/* Signals reach the process in any thread (OpenBLAS starts threads before
 * main, so blocking them everywhere is not possible): the handler only
 * writes the signal number to a pipe, and a plain thread reads it and asks
 * the server to stop. The pipe's write end is the one process-wide variable
 * a handler needs. */
static int g_signal_pipe = -1;

static void on_signal(int sig) {
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    if (g_signal_pipe >= 0) (void)!write(g_signal_pipe, &b, 1);
    errno = saved;
}

typedef struct signal_waiter {
    web_server *srv;
    int fd;         /* read end */
    eng_comm *comm; /* the job's ranks (mpirun), or NULL */
} signal_waiter;

/* Waits for a signal's byte; under mpirun it also looks at the job every
 * 200 ms: once a rank has died or hung (a collective of the engine thread
 * timed out, and the generations of that pass got an error), the service
 * stops as on SIGTERM, and the program ends the job (docs/expert-parallel.md). */
static void *signal_thread(void *arg) {
    signal_waiter *w = arg;
    unsigned char b = 0;
    ssize_t n = 0;
    for (;;) {
        struct pollfd pfd = {w->fd, POLLIN, 0};
        int r = poll(&pfd, 1, w->comm ? 200 : -1);
        if (r < 0 && errno == EINTR) continue;
        const char *why = NULL;
        if (r == 0 && w->comm && eng_comm_broken(w->comm, &why)) {
            fprintf(stderr, "kdaserve serve: stopping: the job lost a rank: %s\n", why);
            break;
        }
        if (r == 0) continue;
        while ((n = read(w->fd, &b, 1)) < 0 && errno == EINTR) {
        }
        if (n == 1 && b != 0) fprintf(stderr, "kdaserve serve: %s received\n", strsignal(b));
        break;
    }
    web_server_stop(w->srv);
    return NULL;
}

static const char *opt_name(const struct option *opts, int val) {
    for (; opts->name; opts++)
        if (opts->val == val) return opts->name;
    return "?";
}

int cmd_serve(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},
        {"db", required_argument, 0, OPT_DB},
        {"listen", required_argument, 0, OPT_LISTEN},
        {"auth-file", required_argument, 0, OPT_AUTH},
        {"www", required_argument, 0, OPT_WWW},
        {"max-message", required_argument, 0, OPT_MAXMSG},
        {"max-http-body", required_argument, 0, OPT_MAXBODY},
        {"no-resume", no_argument, 0, OPT_NORESUME},
        {"max-connections", required_argument, 0, OPT_MAXCONN},
        {"max-sessions", required_argument, 0, OPT_MAXSESS},
        {"max-generations", required_argument, 0, OPT_MAXGEN},
        {"max-tokens", required_argument, 0, OPT_MAXTOK},
        {"max-pending", required_argument, 0, OPT_MAXPEND},
        {"max-queue", required_argument, 0, OPT_MAXQUEUE},
        {"max-queue-total", required_argument, 0, OPT_MAXQUEUE_TOTAL},
        {"idle-timeout", required_argument, 0, OPT_IDLE},
        {"threads", required_argument, 0, OPT_THREADS},
        {"prefill-slice", required_argument, 0, OPT_SLICE},
        {"quiet", no_argument, 0, OPT_QUIET},
        {"device", required_argument, 0, OPT_DEVICE},
        {"bf16", no_argument, 0, OPT_BF16},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    web_params p = web_default_params();
    const char *model = NULL, *db = NULL, *www = NULL;
    int64_t v;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case OPT_DB: db = optarg; break;
        case OPT_LISTEN: p.listen = optarg; break;
        case OPT_AUTH: p.auth_file = optarg; break;
        case OPT_WWW: www = optarg; break;
        case OPT_QUIET: p.quiet = true; break;
        case OPT_BF16: p.ctx.bf16_act = true; break;
        case OPT_DEVICE:
            if (!cli_device_valid(optarg))
                return cli_failf("serve", "--device wants cpu or cuda, got '%s'", optarg);
            p.ctx.device = optarg;
            break;
        case 'h': serve_usage(stdout); return 0;
        case OPT_MAXMSG:
            if (!cli_parse_i64(optarg, 64, (int64_t)1 << 30, &v))
                return cli_failf("serve", "--max-message wants 64..1073741824 bytes");
            p.max_message = (size_t)v;
            break;
        case OPT_MAXBODY:
            if (!cli_parse_i64(optarg, 1024, (int64_t)1 << 32, &v))
                return cli_failf("serve", "--max-http-body wants 1024..4294967296 bytes");
            p.max_http_body = (size_t)v;
            break;
        case OPT_NORESUME: p.no_resume = true; break;
        case OPT_SLICE:
            if (!cli_parse_i64(optarg, 1, 16384, &v))
                return cli_failf("serve", "--prefill-slice wants 1..16384 tokens, got '%s'", optarg);
            p.ctx.max_batch = (int)v;
            break;
        case OPT_MAXPEND:
            if (!cli_parse_i64(optarg, 1024, (int64_t)1 << 30, &v))
                return cli_failf("serve", "--max-pending wants 1024..1073741824 bytes");
            p.max_pending = (size_t)v;
            break;
        case OPT_MAXCONN:
        case OPT_MAXSESS:
        case OPT_MAXGEN:
        case OPT_MAXTOK:
        case OPT_IDLE:
        case OPT_THREADS:
        case OPT_MAXQUEUE:
        case OPT_MAXQUEUE_TOTAL:
            if (!cli_parse_i64(optarg, 1, c == OPT_MAXTOK ? (int64_t)1 << 40 : 1 << 20, &v))
                return cli_failf("serve", "--%s wants a positive number", opt_name(opts, c));
            if (c == OPT_MAXCONN) p.max_connections = (int)v;
            if (c == OPT_MAXSESS) p.max_sessions = (int)v;
            if (c == OPT_MAXGEN) p.max_generations = (int)v;
            if (c == OPT_MAXTOK) p.max_tokens = v;
            if (c == OPT_IDLE) p.idle_timeout_s = (int)v;
            if (c == OPT_THREADS) p.ctx.n_threads = (int)v;
            if (c == OPT_MAXQUEUE) p.max_queue = (int)v;
            if (c == OPT_MAXQUEUE_TOTAL) p.max_queue_total = (int)v;
            break;
        default: return cli_usage_error("serve", NULL);
        }
    }
    if (optind < argc) return cli_usage_error("serve", "unexpected argument '%s'", argv[optind]);
    if (p.max_generations > 256) return cli_failf("serve", "--max-generations is at most 256");
    char www_buf[4200];
    if (!www) {
        if (access("web/www/index.html", R_OK) == 0)
            www = "web/www";
        else if (cli_beside_binary("web/www/index.html", www_buf, sizeof www_buf)) {
            www_buf[strlen(www_buf) - strlen("/index.html")] = '\0';
            www = www_buf;
        }
    } else if (access(www, R_OK) != 0) {
        return cli_failf("serve", "--www %s: no such directory", www);
    }
    p.www_dir = www;
    const char *dir = cli_model_dir("serve", model);
    if (!dir) return 1;

    kds_err err = {0};
    eng_model *m = NULL;
    sess_store *st = NULL;
    web_server *srv = NULL;
    int rc = 1;
    eng_model_params mp = eng_model_default_params();
    mp.progress = !p.quiet;
    cli_model_params(&mp, p.ctx.device); /* under mpirun: this rank's share of the experts */
    p.ctx.comm = cli_comm();     /* and a context that drives the other ranks */
    if (eng_model_load(dir, &mp, &m, &err) != KDS_OK) return cli_fail("serve", &err);
    if (sess_open(db, NULL, &st, &err) != KDS_OK) {
        rc = cli_fail("serve", &err);
        goto out;
    }
    if (web_server_create(&p, m, st, &srv, &err) != KDS_OK) {
        rc = cli_fail("serve", &err);
        goto out;
    }
    int fds[2];
    if (pipe(fds) != 0) {
        rc = cli_failf("serve", "cannot create a pipe: %s", strerror(errno));
        goto out;
    }
    signal_waiter w = {srv, fds[0], cli_comm()};
    pthread_t sig_thread;
    if (pthread_create(&sig_thread, NULL, signal_thread, &w) != 0) {
        rc = cli_failf("serve", "cannot start the signal thread");
        close(fds[0]);
        close(fds[1]);
        goto out;
    }
    g_signal_pipe = fds[1];
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    if (!p.quiet) {
        cli_note_bf16("serve", &p.ctx);
        fprintf(stderr,
                "kdaserve serve: model %s, store %s, web page %s, products %s, prefill slices "
                "of %d tokens\n",
                dir, sess_store_dir(st), www ? www : "none (no web/www found; --www DIR)",
                p.ctx.bf16_act && ((p.ctx.device && strcmp(p.ctx.device, "cpu") != 0) ||
                                   eng_cpu_bf16_products())
                    ? "with bf16 activations in a prefill (--bf16)"
                    : "exact",
                p.ctx.max_batch);
        cli_note_other_models("serve", st, m);
    }
    /* the line tests and scripts wait for (the port is known now) */
    const char *colon = strrchr(p.listen, ':'); /* HOST:PORT, checked by web_server_create */
    int host_len = colon ? (int)(colon - p.listen) : (int)strlen(p.listen);
    printf("listening on http://%.*s:%d/ port %d\n", host_len, p.listen, web_server_port(srv),
           web_server_port(srv));
    fflush(stdout);
    rc = web_server_run(srv, &err) == KDS_OK ? 0 : cli_fail("serve", &err);
    if (rc == 0 && cli_comm() && eng_comm_broken(cli_comm(), NULL)) rc = 1; /* a rank was lost */
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    g_signal_pipe = -1;
    {
        unsigned char zero = 0; /* wakes the signal thread if the loop ended otherwise */
        (void)!write(fds[1], &zero, 1);
    }
    pthread_join(sig_thread, NULL);
    close(fds[0]);
    close(fds[1]);
out:
    web_server_free(srv);
    sess_close(st);
    eng_model_free(m);
    return rc;
}
