/* main.c - the kdaserve program: dispatch to subcommands, top-level help;
 * under mpirun, the job's ranks (rank 0 runs the command, the others serve
 * its expert-parallel contexts: docs/expert-parallel.md). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "eng_comm.h"
#include "eng_ep.h"

typedef struct command {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} command;

static const command COMMANDS[] = {
    {"chat", cmd_chat, "talk to a model in a saved session (readline; scripted on a pipe)"},
    {"serve", cmd_serve, "WebSocket session service and web chat page (docs/protocol.md)"},
    {"generate", cmd_generate, "continue a prompt and print the text (stats on stderr)"},
    {"logits", cmd_logits, "write the logits of every position of a token list (safetensors)"},
    {"bench", cmd_bench, "measure prefill and decode tokens/s on a model"},
    {"snap", cmd_snap, "sessions and snapshots: ls, show, fork, rm, verify, export, import, gc"},
    {"tokenize", cmd_tokenize, "text on stdin to token ids (or --decode ids to text)"},
    {"gen-model", cmd_gen_model, "write a Kimi-Linear model with seeded random weights"},
    {"info", cmd_info, "show a model's config, size, state size and fingerprint"},
    {"quantize", cmd_quantize, "write a model with its routed experts in MXFP4 or Q8_0"},
    {"export-gguf", cmd_export_gguf, "write a model as one GGUF file for llama.cpp"},
    {"plan", cmd_plan, "size a model on N expert-parallel ranks (memory, traffic, decode rate)"},
};

static void usage(FILE *f) {
    fprintf(f, "kdaserve - long-context sessions for Kimi-Linear (KDA + MoE) models\n\n"
               "usage: kdaserve <command> [options]     (kdaserve <command> --help for its options)\n\n"
               "commands:\n");
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++)
        fprintf(f, "  %-11s %s\n", COMMANDS[i].name, COMMANDS[i].summary);
    fprintf(f, "\nenvironment:\n"
               "  KDASERVE_MODEL   model directory used when --model is not given\n"
               "                   (otherwise ./models/default, then the models/default\n"
               "                   of the source tree this binary was built in)\n"
               "  XDG_DATA_HOME    the snapshot store is $XDG_DATA_HOME/kdaserve\n"
               "                   (otherwise ~/.local/share/kdaserve; --db DIR chooses)\n"
               "\nunder mpirun -np N (expert parallelism, docs/expert-parallel.md):\n"
               "  KDASERVE_EP_PLACEMENT  block (default) or cyclic: which rank holds which\n"
               "                   routed expert\n"
               "  KDASERVE_EP_TIMEOUT    seconds a collective may take before the job is\n"
               "                   declared broken (default 60)\n"
               "\ndocs: README.md, docs/architecture.md, docs/protocol.md, docs/formats.md,\n"
               "      docs/snapshot-format.md, docs/benchmarks.md, docs/expert-parallel.md\n");
}

/* The ranks of a job started by mpirun, from the environment's settings;
 * 0, or an exit status after printing why not. */
static int join_job(int *argc, char ***argv, eng_comm **out, eng_ep_placement *placement) {
    eng_comm_params cp = eng_comm_default_params();
    const char *t = getenv("KDASERVE_EP_TIMEOUT");
    if (t && *t) {
        char *end;
        double s = strtod(t, &end);
        if (*end || !(s > 0 && s <= 86400)) {
            fprintf(stderr, "kdaserve: KDASERVE_EP_TIMEOUT wants seconds in (0, 86400], got '%s'\n",
                    t);
            return 2;
        }
        cp.timeout_ms = (int)(s * 1000 + 0.5);
    }
    const char *pl = getenv("KDASERVE_EP_PLACEMENT");
    *placement = ENG_EP_BLOCK;
    if (pl && *pl && !eng_ep_placement_from_name(pl, placement)) {
        fprintf(stderr, "kdaserve: KDASERVE_EP_PLACEMENT wants block or cyclic, got '%s'\n", pl);
        return 2;
    }
    cp.kind = ENG_COMM_MPI;
    kds_err err = {0};
    if (eng_comm_create(&cp, argc, argv, out, &err) != KDS_OK) {
        fprintf(stderr, "kdaserve: cannot join the MPI job: %s\n", err.msg);
        return 1;
    }
    return 0;
}

/* A rank other than 0: serve rank 0's contexts until it is done. Ctrl-C
 * and SIGTERM (mpirun hands them to every rank) are rank 0's to act on: it
 * cancels, saves and then lets the others go; a job whose rank 0 is gone
 * is ended by mpirun. */
static int run_worker(eng_comm *comm) {
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    kds_err err = {0};
    const int rank = eng_comm_rank(comm);
    if (eng_ep_worker_run(comm, &err) == KDS_OK) {
        eng_comm_free(comm);
        return 0;
    }
    fprintf(stderr, "kdaserve: rank %d: %s\n", rank, err.msg);
    if (eng_comm_broken(comm, NULL)) eng_comm_abort(comm, 1); /* the job cannot finish cleanly */
    eng_comm_free(comm);
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version")) {
        puts("kdaserve 0.1.0");
        return 0;
    }
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++)
        if (!strcmp(argv[1], COMMANDS[i].name)) {
            eng_comm *comm = NULL;
            if (eng_comm_launched()) {
                eng_ep_placement placement;
                int rc = join_job(&argc, &argv, &comm, &placement);
                if (rc) return rc;
                if (eng_comm_rank(comm) != 0) return run_worker(comm);
                cli_set_comm(comm, placement);
            }
            /* getopt names the program in its messages: "kdaserve generate:
             * unrecognized option", like every other message of a command */
            char name[64];
            snprintf(name, sizeof name, "kdaserve %s", COMMANDS[i].name);
            argv[1] = name;
            int rc = COMMANDS[i].run(argc - 1, argv + 1);
            if (comm) {
                kds_err err = {0};
                if (eng_ep_shutdown(comm, &err) != KDS_OK)
                    fprintf(stderr, "kdaserve: ending the job: %s\n", err.msg);
                /* a broken job cannot finalise: end every rank, with this status */
                if (eng_comm_broken(comm, NULL)) eng_comm_abort(comm, rc ? rc : 1);
                cli_set_comm(NULL, ENG_EP_BLOCK);
                eng_comm_free(comm);
            }
            return rc;
        }
    fprintf(stderr, "kdaserve: unknown command '%s'\nTry 'kdaserve --help' for the commands.\n",
            argv[1]);
    return 2;
}
