/*
 * The kdaserve program end to end, as a user runs it: generated tiny and
 * tiny-hybrid models, `logits` on the prefill path against `logits --decode`
 * (must agree to 1e-4 of the largest logit), `generate` determinism, and
 * clean refusals (non-zero exit, one clear line) for bad arguments and
 * missing models.
 */
#include <criterion/criterion.h>
#ifdef KDS_HAVE_CUDA
#include "kern_cuda.h"
#endif
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "eng.h"
#include "eng_safetensors.h"
#include "test_helpers.h"

#define KDASERVE KDS_BINARY_DIR "/kdaserve"

static char tmpdir[256];

static void make_tmp(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kds_cli_XXXXXX");
    cr_assert(mkdtemp(tmpdir), "mkdtemp");
}

static void rm_tmp(void) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    th_system(cmd);
}

/* Run a shell command, capture stdout+stderr into out (cap bytes). */
static int run(char *out, size_t cap, const char *fmt, ...) {
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    FILE *p = popen(cmd, "r");
    cr_assert(p, "popen %s", cmd);
    size_t n = out ? fread(out, 1, cap - 1, p) : 0;
    if (out) out[n] = '\0';
    else {
        char sink[4096];
        while (fread(sink, 1, sizeof sink, p) > 0) {}
    }
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void compare_paths(const char *preset) {
    make_tmp();
    char out[8192];
    cr_assert_eq(run(out, sizeof out, KDASERVE " gen-model --preset %s --seed 3 --out %s/m 2>&1",
                     preset, tmpdir), 0, "%s", out);
    const char *ids = "1,5,9,200,17,3,3,3,44,100,7,8,250,251,2,9,9,1,0,11,12,13,14,15,16,17,18,"
                      "19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,"
                      "43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,62,63,64,65,66,67,"
                      "68,69,70";
    cr_assert_eq(run(out, sizeof out, KDASERVE " logits --model %s/m --ids %s --out %s/p.st 2>&1",
                     tmpdir, ids, tmpdir), 0, "%s", out);
    cr_assert_eq(run(out, sizeof out,
                     KDASERVE " logits --model %s/m --ids %s --out %s/d.st --decode 2>&1", tmpdir,
                     ids, tmpdir), 0, "%s", out);
    char pp[512], dp[512];
    snprintf(pp, sizeof pp, "%s/p.st", tmpdir);
    snprintf(dp, sizeof dp, "%s/d.st", tmpdir);
    eng_st_file *pf = NULL, *df = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_st_open(pp, &pf, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_st_open(dp, &df, &err), KDS_OK, "%s", err.msg);
    const eng_st_tensor *a = eng_st_find(pf, "logits"), *b = eng_st_find(df, "logits");
    cr_assert(a && b && a->n_elems == b->n_elems && a->n_dims == 2);
    int64_t n_ids = 1;
    for (const char *q = ids; *q; q++) n_ids += *q == ',';
    cr_assert_eq(a->shape[0], n_ids);
    double ref, d = th_max_abs_diff(b->data, a->data, a->n_elems, &ref);
    fprintf(stderr, "cli %s: prefill vs decode logits max err %.3g = %.3g of max |logit|\n", preset,
            d, d / ref);
    cr_expect_leq(d, 1e-4 * ref, "%s: prefill and decode differ by %g (max |logit| %g)", preset,
                  d, ref);
    cr_expect_str_eq(eng_st_metadata(pf, "path"), "prefill");
    cr_expect_str_eq(eng_st_metadata(df, "path"), "decode");
    eng_st_close(pf);
    eng_st_close(df);
    rm_tmp();
}

Test(cli, logits_prefill_matches_decode_tiny, .timeout = 120) { compare_paths("tiny"); }
Test(cli, logits_prefill_matches_decode_tiny_hybrid, .timeout = 120) { compare_paths("tiny-hybrid"); }

Test(cli, generate_is_deterministic_per_seed, .timeout = 120) {
    make_tmp();
    char a[4096], b[4096], c[4096];
    cr_assert_eq(run(a, sizeof a, KDASERVE " gen-model --preset tiny --out %s/m 2>&1", tmpdir), 0,
                 "%s", a);
    const char *fmt = KDASERVE " generate --model %s/m --prompt 'Once upon' --max-tokens 24 "
                               "--seed %d --temperature 1 --min-p 0 2>/dev/null";
    cr_assert_eq(run(a, sizeof a, fmt, tmpdir, 1), 0);
    cr_assert_eq(run(b, sizeof b, fmt, tmpdir, 1), 0);
    cr_assert_eq(run(c, sizeof c, fmt, tmpdir, 2), 0);
    cr_expect_str_eq(a, b, "same seed, same text");
    cr_expect_str_neq(a, c, "different seeds should differ");
    rm_tmp();
}

/* generate --bf16: the prompt's products round their activations (the
 * stats line says so), and it still generates. A build without bf16 dot
 * products says instead that they stay exact. */
Test(cli, generate_bf16_prompt, .timeout = 120) {
    char out[4096];
    cr_assert_eq(run(out, sizeof out,
                     KDASERVE " generate --model " KDS_SOURCE_DIR "/models/default --prompt "
                              "'It is a truth universally acknowledged, that a single man in "
                              "possession of a good fortune' --max-tokens 4 --bf16 2>&1"),
                 0, "%s", out);
    if (eng_cpu_bf16_products())
        cr_expect(strstr(out, "prompt products with bf16 activations"), "%s", out);
    else
        cr_expect(strstr(out, "so the products stay exact") &&
                      !strstr(out, "prompt products with bf16 activations"),
                  "%s", out);
    cr_expect(strstr(out, "generated 4 tokens"), "%s", out);
}

/* --prompt-file FILE and --prompt-file - (standard input) feed the same text
 * as --prompt; a prompt longer than the kernel's argument limit (ARG_MAX,
 * 2 MiB here; "Argument list too long" as --prompt) goes through the file;
 * a NUL byte, a missing file and both options at once are refused. */
Test(cli, generate_prompt_file_and_stdin, .timeout = 600) {
    make_tmp();
    char a[4096], b[4096], c[4096], path[600];
    cr_assert_eq(run(a, sizeof a, KDASERVE " gen-model --preset tiny --out %s/m 2>&1", tmpdir), 0,
                 "%s", a);
    snprintf(path, sizeof path, "%s/p.txt", tmpdir);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    fputs("Once upon a time, there was", f);
    fclose(f);
    const char *g = KDASERVE " generate --model %s/m --max-tokens 16 --temperature 0 ";
    char fmt[512];
    snprintf(fmt, sizeof fmt, "%s--prompt 'Once upon a time, there was' 2>/dev/null", g);
    cr_assert_eq(run(a, sizeof a, fmt, tmpdir), 0);
    snprintf(fmt, sizeof fmt, "%s--prompt-file '%%s' 2>/dev/null", g);
    cr_assert_eq(run(b, sizeof b, fmt, tmpdir, path), 0);
    snprintf(fmt, sizeof fmt, "%s--prompt-file - < '%%s' 2>/dev/null", g);
    cr_assert_eq(run(c, sizeof c, fmt, tmpdir, path), 0);
    cr_expect(a[0], "no text generated");
    cr_expect_str_eq(b, a, "--prompt-file gives what --prompt gives");
    cr_expect_str_eq(c, a, "--prompt-file - gives what --prompt gives");

    /* 160 KiB of text: more than one argument may hold (MAX_ARG_STRLEN,
     * 128 KiB: "Argument list too long" as --prompt); runs of dashes are
     * 64 characters a token with the default model's tokenizer, so the
     * prefill is short. The count must be what `tokenize` counts of it. */
    snprintf(path, sizeof path, "%s/big.txt", tmpdir);
    f = fopen(path, "w");
    cr_assert(f);
    for (int i = 0; i < 160; i++) {
        for (int k = 0; k < 1023; k++)
            fputc('-', f);
        fputc('\n', f);
    }
    fclose(f);
    cr_assert_eq(run(c, sizeof c,
                     KDASERVE " tokenize --model " KDS_SOURCE_DIR "/models/default < '%s' | "
                              "tr ' ,' '\\n\\n' | grep -c .",
                     path),
                 0);
    long want = strtol(c, NULL, 10);
    cr_assert(want > 1000, "tokenize counted %ld tokens", want);
    cr_expect_eq(run(c, sizeof c,
                     KDASERVE " generate --model " KDS_SOURCE_DIR "/models/default --max-tokens 1 "
                              "--prompt-file '%s' 2>&1",
                     path),
                 0, "%s", c);
    char said[64];
    snprintf(said, sizeof said, "prompt %ld tokens", want);
    cr_expect(strstr(c, said) != NULL, "the whole file is the prompt (%s):\n%s", said, c);

    snprintf(path, sizeof path, "%s/nul.txt", tmpdir);
    f = fopen(path, "w");
    cr_assert(f);
    fwrite("ab\0cd", 1, 5, f);
    fclose(f);
    snprintf(fmt, sizeof fmt, "%s--prompt-file '%%s' 2>&1", g);
    cr_expect_eq(run(c, sizeof c, fmt, tmpdir, path), 1);
    cr_expect(strstr(c, "NUL byte (at byte 2)"), "%s", c);
    cr_expect_eq(run(c, sizeof c, fmt, tmpdir, "/nonexistent/p.txt"), 1);
    cr_expect(strstr(c, "No such file"), "%s", c);
    snprintf(fmt, sizeof fmt, "%s--prompt x --prompt-file '%%s' 2>&1", g);
    cr_expect_neq(run(c, sizeof c, fmt, tmpdir, path), 0);
    cr_expect(strstr(c, "not both"), "%s", c);
    rm_tmp();
}

Test(cli, help_lists_commands) {
    char out[4096];
    cr_assert_eq(run(out, sizeof out, KDASERVE " --help"), 0);
    const char *cmds[] = {"generate", "logits", "bench", "gen-model", "info"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        cr_expect(strstr(out, cmds[i]), "--help lacks %s", cmds[i]);
    cr_expect_eq(run(out, sizeof out, KDASERVE " frobnicate 2>&1"), 2);
    cr_expect(strstr(out, "unknown command 'frobnicate'"), "%s", out);
    cr_expect_null(strstr(out, "commands:"), "a usage error is not the whole help: %s", out);
}

/* A usage error is the problem in one line and where the options are, not
 * the whole help (issue 16), and exits 2. */
Test(cli, usage_errors_point_at_help) {
    char out[4096];
    const char *cases[][2] = {
        {"generate --bogus", "kdaserve generate: unrecognized option '--bogus'"},
        {"serve --listen", "kdaserve serve: option '--listen' requires an argument"},
        {"logits", "kdaserve logits: --ids and --out are required"},
        {"gen-model", "kdaserve gen-model: give exactly one of --preset or --config"},
        {"quantize --out /tmp/x", "kdaserve quantize: --experts and --out are required"},
        {"serve extra", "kdaserve serve: unexpected argument 'extra'"},
        {"snap", "kdaserve snap: which command?"},
        {"snap frob", "kdaserve snap: unknown command 'frob'"},
        {"snap ls --bogus", "kdaserve snap ls: unrecognized option '--bogus'"},
        {"snap show", "kdaserve snap show: wants 1 argument"},
        {"snap ls extra", "kdaserve snap ls: takes no arguments, got 'extra'"},
        {"snap export 3", "kdaserve snap export: wants 2 arguments"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cr_expect_eq(run(out, sizeof out, KDASERVE " %s 2>&1", cases[i][0]), 2, "%s", cases[i][0]);
        cr_expect(strstr(out, cases[i][1]), "%s: %s", cases[i][0], out);
        cr_expect(strstr(out, "--help' for its options."), "%s: %s", cases[i][0], out);
        cr_expect_null(strstr(out, "usage:"), "%s printed the whole help: %s", cases[i][0], out);
    }
}

/* Nothing of CUDA is linked into the program (the static cudart opens the
 * driver, and cuBLAS is opened, only when a GPU is used): a CPU run or
 * --help neither needs the CUDA libraries nor maps their ~700 MB (it took
 * 0.3 s and 220 MB resident when they were linked; issue 16). */
Test(cli, cuda_libraries_are_not_linked) {
    char out[16384];
    cr_assert_eq(run(out, sizeof out, "readelf -d " KDASERVE " 2>&1"), 0, "%s", out);
    cr_assert(strstr(out, "(NEEDED)"), "readelf lists no NEEDED entries: %s", out);
    cr_expect_null(strstr(out, "libcublas"), "%s", out);
    cr_expect_null(strstr(out, "libcudart"), "%s", out);
    cr_expect_null(strstr(out, "libcuda."), "%s", out);
    /* this test's only child: its peak resident set is --help's */
    cr_assert_eq(run(NULL, 0, KDASERVE " --help"), 0);
    struct rusage ru;
    cr_assert_eq(getrusage(RUSAGE_CHILDREN, &ru), 0);
    cr_expect_lt(ru.ru_maxrss, 64 * 1024, "--help peaked at %ld KiB resident", ru.ru_maxrss);
}

/* An auth file that is a FIFO or a directory is refused at once (an open
 * for reading would wait on a FIFO forever). */
Test(cli, auth_file_must_be_a_regular_file, .timeout = 60) {
    make_tmp();
    char out[4096], fifo[300], dir[300];
    snprintf(fifo, sizeof fifo, "%s/auth.fifo", tmpdir);
    snprintf(dir, sizeof dir, "%s/auth.dir", tmpdir);
    cr_assert_eq(mkfifo(fifo, 0600), 0);
    cr_assert_eq(mkdir(dir, 0700), 0);
    cr_expect_eq(run(out, sizeof out, "timeout 20 " KDASERVE " serve --auth-file %s --listen "
                     "127.0.0.1:0 --db %s/db 2>&1", fifo, tmpdir), 1, "%s", out);
    cr_expect(strstr(out, "auth.fifo: is a FIFO, not a regular file"), "%s", out);
    cr_expect_eq(run(out, sizeof out, "timeout 20 " KDASERVE " serve --auth-file %s --listen "
                     "127.0.0.1:0 --db %s/db 2>&1", dir, tmpdir), 1, "%s", out);
    cr_expect(strstr(out, "auth.dir: is a directory"), "%s", out);
    rm_tmp();
}

Test(cli, refusals_are_one_clear_line) {
    char out[4096];
    cr_expect_eq(run(out, sizeof out, KDASERVE " generate --model /nonexistent/dir --prompt x 2>&1"), 1);
    cr_expect(strstr(out, "/nonexistent/dir"), "names the path: %s", out);
    cr_expect_eq(run(out, sizeof out, KDASERVE " generate --max-tokens -3 --prompt x 2>&1"), 1);
    cr_expect(strstr(out, "--max-tokens"), "%s", out);
    cr_expect_eq(run(out, sizeof out, KDASERVE " logits --model %s --ids 1,x --out /tmp/x 2>&1",
                     GOLDEN_ROOT "/model/micro-kda"), 1);
    cr_expect(strstr(out, "--ids"), "%s", out);
    cr_expect_eq(run(out, sizeof out, KDASERVE " logits --model %s --ids 1,99999 --out /tmp/x 2>&1",
                     GOLDEN_ROOT "/model/micro-kda"), 1);
    cr_expect(strstr(out, "token id 99999"), "%s", out);
    cr_expect_eq(run(out, sizeof out, KDASERVE " gen-model --preset nope --out /tmp/x 2>&1"), 1);
    cr_expect(strstr(out, "nope"), "%s", out);
    cr_expect_eq(run(out, sizeof out, KDASERVE " gen-model --preset tiny --dtype f8 --out /tmp/x 2>&1"), 1);
    cr_expect(strstr(out, "--dtype"), "%s", out);
    cr_expect_eq(run(out, sizeof out, KDASERVE " serve --prefill-slice 0 2>&1"), 1);
    cr_expect(strstr(out, "--prefill-slice wants 1..16384 tokens, got '0'"), "%s", out);
}

Test(cli, dry_run_reports_48b_sizes) {
    char out[4096];
    cr_assert_eq(run(out, sizeof out, KDASERVE " gen-model --preset kimi-linear-48b --dry-run"), 0);
    cr_expect(strstr(out, "20,493"), "tensor count: %s", out);
    cr_expect(strstr(out, "49,122,681,728"), "parameter count: %s", out);
    cr_expect(strstr(out, "KDA state 40.00 MiB"), "state size: %s", out);
}

Test(cli, device_flag_refuses_unknown_names) {
    char out[4096];
    cr_expect_eq(run(out, sizeof out, KDASERVE " bench --device tpu 2>&1"), 1);
    cr_expect(strstr(out, "--device wants cpu or cuda, got 'tpu'"), "%s", out);
    cr_expect_eq(run(out, sizeof out, KDASERVE " generate --device gpu --prompt x 2>&1"), 1);
    cr_expect(strstr(out, "--device wants cpu or cuda, got 'gpu'"), "%s", out);
    cr_expect_eq(run(out, sizeof out, KDASERVE " serve --device npu 2>&1"), 1);
    cr_expect(strstr(out, "--device wants cpu or cuda, got 'npu'"), "%s", out);
}

/* bench --gen makes the model on the GPU: refused on the CPU, with an
 * unknown preset, next to --model, and (here, without a GPU) with the
 * reason the device cannot be used. */
Test(cli, bench_gen_refusals) {
    char out[4096];
    cr_expect_eq(run(out, sizeof out, KDASERVE " bench --gen tiny --device cpu 2>&1"), 1);
    cr_expect(strstr(out, "--device cuda only"), "%s", out);
    cr_expect_eq(run(out, sizeof out, KDASERVE " bench --gen tiny --model /tmp 2>&1"), 1);
    cr_expect(strstr(out, "exclude each other"), "%s", out);
    cr_expect_eq(run(out, sizeof out, KDASERVE " bench --gen nope 2>&1"), 1);
    cr_expect(strstr(out, "nope"), "%s", out);
    cr_expect_eq(run(out, sizeof out, KDASERVE " snap bench --device tpu --model /tmp 2>&1"), 1);
    cr_expect(strstr(out, "--device wants cpu or cuda, got 'tpu'"), "%s", out);
#ifdef KDS_HAVE_CUDA
    kds_err why = {0};
    if (kern_cuda_available(&why)) return; /* with a GPU it would run */
#endif
    cr_expect_eq(run(out, sizeof out, KDASERVE " bench --gen tiny 2>&1"), 1);
    cr_expect(strstr(out, "cuda"), "names the device: %s", out);
}

/* bench --profile: one more prefill and decode timed product by product,
 * a row per matrix role with the decode's count a token; refused where the
 * products do not run on the CPU's pool. */
Test(cli, bench_profile) {
    char out[16384];
    cr_assert_eq(run(out, sizeof out,
                     KDASERVE " bench --model %s --prompt-tokens 16 --gen-tokens 4 --repeats 1 "
                              "--threads 2 --bandwidth-mib 0 --profile 2>&1",
                     GOLDEN_ROOT "/model/micro-hybrid"),
                 0, "%s", out);
    cr_expect(strstr(out, "prefill of 16 tokens"), "%s", out);
    cr_expect(strstr(out, "decode of 4 tokens"), "%s", out);
    cr_expect(strstr(out, "of the 2 threads' time"), "%s", out);
    /* 8 experts top-2: two w2 products a MoE layer a token, three MoE layers */
    cr_expect(strstr(out, "experts w2 (down) [64, 32] f32, 6.0"), "%s", out);
    cr_expect(strstr(out, "lm_head [512, 64] f32, 1.0"), "%s", out);
    /* with --seqs, each N's batched steps too: one lm_head product a step of 3 tokens */
    cr_assert_eq(run(out, sizeof out,
                     KDASERVE " bench --model %s --prompt-tokens 4 --gen-tokens 3 --repeats 1 "
                              "--threads 2 --bandwidth-mib 0 --seqs 3 --profile 2>&1",
                     GOLDEN_ROOT "/model/micro-hybrid"),
                 0, "%s", out);
    cr_expect(strstr(out, "3 batched steps of 3 sequences"), "%s", out);
    cr_expect(strstr(out, "lm_head [512, 64] f32, 1.0, 3.0"), "%s", out);
    cr_expect_eq(run(out, sizeof out, KDASERVE " bench --model %s --device cuda --profile 2>&1",
                     GOLDEN_ROOT "/model/micro-hybrid"),
                 1);
    cr_expect(strstr(out, "--profile times the CPU's products"), "%s", out);
}
