/* cmd_gguf.c - `kdaserve export-gguf`: a model directory as one GGUF file
 * for llama.cpp (engine/eng_gguf.c), so that both engines run the same
 * weights side by side (scripts/bench_vs.sh, docs/benchmarks.md). */
#define _GNU_SOURCE
#include <getopt.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "eng_genmodel.h"

static void export_usage(FILE *f) {
    fprintf(f, "usage: kdaserve export-gguf [--model DIR] --out FILE.gguf [--quiet]\n\n"
               "Writes the model as one GGUF file that llama.cpp's kimi-linear support loads\n"
               "(llama-bench, llama-cli): matrices in their stored dtype (bf16 stays BF16),\n"
               "vectors, norms, router and conv taps in F32, routed experts stacked, the\n"
               "tokenizer as llama.cpp's \"kimi-k2\" BPE vocabulary. Names, shapes and keys:\n"
               "docs/formats.md. A model llama.cpp cannot run (K3, quantised experts, ...)\n"
               "is refused with the reason.\n\n"
               "  --model DIR      the model (default $KDASERVE_MODEL, else ./models/default)\n"
               "  --out FILE       the GGUF file to write (replaced if it exists)\n"
               "  --quiet          no progress line\n");
}

int cmd_export_gguf(int argc, char **argv) {
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"out", required_argument, 0, 'o'},
                                         {"quiet", no_argument, 0, 'q'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *model = NULL, *out = NULL;
    bool quiet = false;
    optind = 1;
    for (int o; (o = getopt_long(argc, argv, "h", opts, NULL)) != -1;) {
        switch (o) {
        case 'm': model = optarg; break;
        case 'o': out = optarg; break;
        case 'q': quiet = true; break;
        case 'h': export_usage(stdout); return 0;
        default: return cli_usage_error("export-gguf", NULL);
        }
    }
    if (optind < argc)
        return cli_usage_error("export-gguf", "unexpected argument '%s'", argv[optind]);
    if (!out || !*out) return cli_usage_error("export-gguf", "--out FILE.gguf is required");
    struct stat st;
    if (stat(out, &st) == 0 && S_ISDIR(st.st_mode))
        return cli_failf("export-gguf", "--out %s is a directory; give a file name", out);
    const char *dir = cli_model_dir("export-gguf", model);
    if (!dir) return 1;
    kds_err err = {0};
    if (eng_model_export_gguf(dir, out, !quiet, &err) != KDS_OK)
        return cli_fail("export-gguf", &err);
    if (!quiet) fprintf(stderr, "[kdaserve] wrote %s as GGUF to %s\n", dir, out);
    return 0;
}
