/* main.c - the kdaserve program: dispatch to subcommands, top-level help. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

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
};

static void usage(FILE *f) {
    fprintf(f, "kdaserve - long-context sessions for Kimi-Linear (KDA + MoE) models\n\n"
               "usage: kdaserve <command> [options]     (kdaserve <command> --help for its options)\n\n"
               "commands:\n");
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++)
        fprintf(f, "  %-10s %s\n", COMMANDS[i].name, COMMANDS[i].summary);
    fprintf(f, "\nenvironment:\n"
               "  KDASERVE_MODEL   model directory used when --model is not given\n"
               "                   (otherwise ./models/default, then the models/default\n"
               "                   of the source tree this binary was built in)\n"
               "  XDG_DATA_HOME    the snapshot store is $XDG_DATA_HOME/kdaserve\n"
               "                   (otherwise ~/.local/share/kdaserve; --db DIR chooses)\n"
               "\ndocs: README.md, docs/architecture.md, docs/protocol.md, docs/formats.md,\n"
               "      docs/snapshot-format.md, docs/benchmarks.md\n");
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
            /* getopt names the program in its messages: "kdaserve generate:
             * unrecognized option", like every other message of a command */
            char name[64];
            snprintf(name, sizeof name, "kdaserve %s", COMMANDS[i].name);
            argv[1] = name;
            return COMMANDS[i].run(argc - 1, argv + 1);
        }
    fprintf(stderr, "kdaserve: unknown command '%s'\nTry 'kdaserve --help' for the commands.\n",
            argv[1]);
    return 2;
}
