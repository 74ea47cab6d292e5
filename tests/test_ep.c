/*
 * Expert parallelism (docs/expert-parallel.md) through real jobs: the built
 * kdaserve under `mpirun --oversubscribe -np N` on CPU ranks.
 *   - 2 and 3 ranks give one rank's logits bit for bit (prefill of 300
 *     tokens in two batches, and decode) and one rank's text (generate,
 *     sampling), on generated tiny,
 *     tiny-hybrid and k3-micro (MXFP4 experts, latent MoE) models, at 2
 *     threads per rank: the products are then cut into blocks, and each
 *     rank cuts its share as one rank cuts the whole batch (on row-group
 *     boundaries, where a row's bits do not depend on the cut:
 *     test_decode_batch.c, same_bits_on_any_thread_count);
 *   - the cyclic placement gives the same bits as the block one;
 *   - a session saved by a 1-rank run resumes exactly under 2 and 3 ranks
 *     and back, and the store verifies;
 *   - bad setups are refused in one line: more ranks than experts, a
 *     placement that does not exist, another model on one rank (a bind
 *     mount seen by rank 1 only), a GPU device with ranks;
 *   - a rank that hangs mid-generation fails the job with an error naming
 *     the collective after the deadline, never a silent wait;
 *   - `serve` on 2 ranks passes the WebSocket protocol's groups (basic,
 *     generate, concurrent streams, resume, cancel) and stops cleanly; a
 *     rank killed mid-generation gives its client a `done` with reason
 *     error naming the lost collective, the service ends the job, and the
 *     store verifies with the turn saved before the fault;
 *   - the communicator's collectives (kds_comm_check: MPI with 1 to 3
 *     ranks, a stalled rank, NCCL with one rank where there is a GPU);
 *   - in-process: the placement's arithmetic, and a rank's model binds its
 *     own experts only and agrees with rank 0 on the digest;
 *   - `kdaserve plan`: its figures for Kimi K3 on 64 H200s and
 *     Kimi-Linear-48B on 8 against the same quantities worked out here
 *     from the configs.
 * Skipped, saying why, without MPI in the build or mpirun on the machine.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "eng.h"
#include "eng_comm.h"
#include "eng_ep.h"
#include "eng_genmodel.h"
#include "eng_model.h"
#include "eng_plan.h"
#include "eng_safetensors.h"
#include "kds_clock.h"
#include "test_helpers.h"
#include "test_serve_util.h"
#ifdef KDS_HAVE_CUDA
#include "kern_cuda.h"
#endif

#define KDASERVE KDS_BINARY_DIR "/kdaserve"
#define COMM_CHECK KDS_BINARY_DIR "/kds_comm_check"

static char tmpdir[256];

static void make_tmp(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kds_ep_XXXXXX");
    cr_assert(mkdtemp(tmpdir), "mkdtemp");
}

static void rm_tmp(void) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    th_system(cmd);
}

/* Run a shell command; stdout into out (may be NULL), the exit status back. */
static int run(char *out, size_t cap, const char *fmt, ...) {
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    FILE *p = popen(cmd, "r");
    cr_assert(p, "popen %s", cmd);
    size_t n = out ? fread(out, 1, cap - 1, p) : 0;
    if (out) out[n] = '\0';
    char sink[4096];
    while (fread(sink, 1, sizeof sink, p) > 0) {}
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* "mpirun ... -np N" for this machine, or skip the test saying why. */
/* Under the sanitizer pass (scripts/sanitize.sh) the ranks do not look for
 * leaks: Open MPI keeps what MPI_Init allocated until exit, much of it in
 * MCA components it has unloaded by then, so LSan can neither name those
 * stacks nor be told to ignore them. The same engine code is leak-checked
 * in one process by every other test; ASan and UBSan stay on in the ranks. */
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TEST_EP_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define TEST_EP_ASAN 1
#endif
#ifdef TEST_EP_ASAN
#define RANK_ENV "-x ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 "
#else
#define RANK_ENV ""
#endif

static const char *mpirun(int n) {
    static char buf[320];
#ifndef KDS_HAVE_MPI
    (void)n;
    cr_skip_test("this kdaserve was built without MPI (install libopenmpi-dev and openmpi-bin: "
                 "scripts/bootstrap.sh)");
#endif
    if (th_system("command -v mpirun >/dev/null 2>&1") != 0)
        cr_skip_test("mpirun is not installed (openmpi-bin: scripts/bootstrap.sh installs it)");
    /* a job of a few ranks on a machine of fewer cores; root (CI containers)
     * must say so to Open MPI */
    snprintf(buf, sizeof buf, "mpirun --oversubscribe %s" RANK_ENV "-np %d",
             geteuid() == 0 ? "--allow-run-as-root " : "", n);
    /* a short deadline: a broken test job fails in seconds, not a minute */
    setenv("KDASERVE_EP_TIMEOUT", "30", 0);
    return buf;
}

static void gen_model(const char *preset, const char *name) {
    char out[4096];
    cr_assert_eq(run(out, sizeof out, KDASERVE " gen-model --preset %s --seed 11 --out %s/%s 2>&1",
                     preset, tmpdir, name), 0, "gen-model %s: %s", preset, out);
}

/* The 'logits' tensors of two files are the same bytes. */
static void expect_same_logits(const char *a, const char *b, const char *what) {
    char pa[512], pb[512];
    snprintf(pa, sizeof pa, "%s/%s", tmpdir, a);
    snprintf(pb, sizeof pb, "%s/%s", tmpdir, b);
    eng_st_file *fa = NULL, *fb = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_st_open(pa, &fa, &err), KDS_OK, "%s: %s", what, err.msg);
    cr_assert_eq(eng_st_open(pb, &fb, &err), KDS_OK, "%s: %s", what, err.msg);
    const eng_st_tensor *x = eng_st_find(fa, "logits"), *y = eng_st_find(fb, "logits");
    cr_assert(x && y, "%s: no logits tensor", what);
    cr_assert_eq(x->n_bytes, y->n_bytes, "%s: %zu and %zu bytes of logits", what, x->n_bytes,
                 y->n_bytes);
    const float *u = x->data, *v = y->data;
    size_t first = x->n_elems;
    for (size_t i = 0; i < x->n_elems && first == x->n_elems; i++)
        if (memcmp(&u[i], &v[i], sizeof(float)) != 0) first = i;
    cr_expect_eq(first, x->n_elems, "%s: logit %zu differs (%.9g vs %.9g)", what, first,
                 first < x->n_elems ? u[first] : 0.0, first < x->n_elems ? v[first] : 0.0);
    eng_st_close(fa);
    eng_st_close(fb);
}

static const char *IDS_SHORT = "7,300,12,99,4,1";

/* 300 ids in [0, 512): two prefill batches (256 + 44 tokens), so experts
 * get more than 32 rows (the BLAS path) and the first batch's logits travel
 * as a block. */
static void long_ids(char *out, size_t cap) {
    uint64_t x = 0x9e3779b97f4a7c15ull;
    size_t o = 0;
    for (int i = 0; i < 300 && o + 8 < cap; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        o += (size_t)snprintf(out + o, cap - o, "%s%u", i ? "," : "", (unsigned)(x % 512));
    }
}

/* logits on the prefill path (300 tokens) and the decode path, one rank
 * against `ranks` ranks, 2 threads each, with `opts` given to every run. */
static void logits_equal_opts(const char *preset, const int *ranks, int n_ranks, const char *env,
                              const char *opts) {
    make_tmp();
    gen_model(preset, "m");
    char out[8192], ids_long[2048];
    long_ids(ids_long, sizeof ids_long);
    const char *mpi = mpirun(1); /* skips before any work when there is no MPI */
    (void)mpi;
    cr_assert_eq(run(out, sizeof out, KDASERVE " logits --model %s/m --ids %s --out %s/p1.st "
                     "--threads 2 %s 2>&1", tmpdir, ids_long, tmpdir, opts), 0, "%s", out);
    cr_assert_eq(run(out, sizeof out, KDASERVE " logits --model %s/m --ids %s --out %s/d1.st "
                     "--decode --threads 2 %s 2>&1", tmpdir, IDS_SHORT, tmpdir, opts), 0, "%s",
                 out);
    for (int i = 0; i < n_ranks; i++) {
        const int n = ranks[i];
        char what[128];
        cr_assert_eq(run(out, sizeof out, "%s %s " KDASERVE " logits --model %s/m --ids %s --out "
                         "%s/pn.st --threads 2 %s 2>&1", env, mpirun(n), tmpdir, ids_long, tmpdir,
                         opts),
                     0, "%d ranks: %s", n, out);
        snprintf(what, sizeof what, "%s prefill, %d ranks %s", preset, n, env);
        expect_same_logits("p1.st", "pn.st", what);
        cr_assert_eq(run(out, sizeof out, "%s %s " KDASERVE " logits --model %s/m --ids %s --out "
                         "%s/dn.st --decode --threads 2 %s 2>&1", env, mpirun(n), tmpdir,
                         IDS_SHORT, tmpdir, opts), 0, "%d ranks: %s", n, out);
        snprintf(what, sizeof what, "%s decode, %d ranks %s", preset, n, env);
        expect_same_logits("d1.st", "dn.st", what);
    }
    rm_tmp();
}

static void logits_equal(const char *preset, const int *ranks, int n_ranks, const char *env) {
    logits_equal_opts(preset, ranks, n_ranks, env, "");
}

TestSuite(ep, .timeout = 600);

static const int R23[] = {2, 3};

Test(ep, logits_equal_one_rank_tiny) { logits_equal("tiny", R23, 2, ""); }
Test(ep, logits_equal_one_rank_tiny_hybrid) { logits_equal("tiny-hybrid", R23, 2, ""); }
Test(ep, logits_equal_one_rank_k3_micro) { logits_equal("k3-micro", R23, 2, ""); }
/* --bf16 reaches every rank: their experts' prefill products round as
 * rank 0's do, so the logits are one rank's, bit for bit */
Test(ep, logits_equal_one_rank_bf16) {
    static const int r2[] = {2};
    logits_equal_opts("tiny", r2, 1, "", "--bf16");
}
Test(ep, logits_equal_one_rank_cyclic_placement) {
    static const int r3[] = {3};
    logits_equal("k3-micro", r3, 1, "KDASERVE_EP_PLACEMENT=cyclic");
}

Test(ep, generate_equal_one_rank) {
    make_tmp();
    static const char *presets[] = {"tiny", "k3-micro"};
    char one[8192], many[8192];
    const char *gen = "generate --model %s/%s --prompt 'Once upon a time' --max-tokens 24 --seed 5 "
                      "--temperature 1 --min-p 0 --threads 2 2>/dev/null";
    for (size_t p = 0; p < sizeof presets / sizeof presets[0]; p++) {
        gen_model(presets[p], presets[p]);
        char cmd[1024];
        snprintf(cmd, sizeof cmd, gen, tmpdir, presets[p]);
        cr_assert_eq(run(one, sizeof one, KDASERVE " %s", cmd), 0);
        cr_assert(strlen(one) > 10, "%s generated nothing: '%s'", presets[p], one);
        for (int n = 2; n <= 3; n++) {
            cr_assert_eq(run(many, sizeof many, "%s " KDASERVE " %s", mpirun(n), cmd), 0,
                         "%s, %d ranks", presets[p], n);
            cr_expect_str_eq(many, one, "%s, %d ranks: another text than one rank's", presets[p], n);
        }
    }
    rm_tmp();
}

/* A session's turns alternate between deployments: 1 rank, 2 ranks, 3
 * ranks, 1 rank; each turn's text equals that of the same turns all on one
 * rank, and the store verifies. */
Test(ep, session_moves_between_deployments) {
    make_tmp();
    gen_model("tiny-hybrid", "m"); /* MLA rows travel with the state */
    const char *gen = "generate --model %s/m --max-tokens 8 --temperature 1 --min-p 0 --threads 2 "
                      "--seed 5 --session s --db %s/%s --prompt '%s' 2>/dev/null";
    static const char *prompts[] = {"Once upon", "", " and then", ""};
    const int ranks[] = {1, 2, 3, 1};
    char ref[4096], got[4096], cmd[2048];
    for (int t = 0; t < 4; t++) {
        snprintf(cmd, sizeof cmd, gen, tmpdir, tmpdir, "one", prompts[t]);
        cr_assert_eq(run(ref, sizeof ref, KDASERVE " %s", cmd), 0, "turn %d on one rank", t);
        snprintf(cmd, sizeof cmd, gen, tmpdir, tmpdir, "many", prompts[t]);
        if (ranks[t] == 1)
            cr_assert_eq(run(got, sizeof got, KDASERVE " %s", cmd), 0, "turn %d", t);
        else
            cr_assert_eq(run(got, sizeof got, "%s " KDASERVE " %s", mpirun(ranks[t]), cmd), 0,
                         "turn %d on %d ranks", t, ranks[t]);
        cr_expect_str_eq(got, ref, "turn %d (%d ranks) differs from one rank's", t, ranks[t]);
    }
    char out[8192];
    cr_expect_eq(run(out, sizeof out, KDASERVE " snap verify --db %s/many --model %s/m 2>&1",
                     tmpdir, tmpdir), 0, "%s", out);
    cr_expect(strstr(out, "0 failed"), "%s", out);
    rm_tmp();
}

Test(ep, bad_setups_are_refused) {
    make_tmp();
    gen_model("tiny", "m"); /* 8 routed experts */
    char out[8192];
    cr_expect_eq(run(out, sizeof out, "%s " KDASERVE " logits --model %s/m --ids 1,2 --out %s/x.st "
                     "--threads 1 2>&1", mpirun(9), tmpdir, tmpdir), 1, "%s", out);
    cr_expect(strstr(out, "9 ranks") && strstr(out, "8 routed experts"), "%s", out);
    cr_expect_neq(run(out, sizeof out, "KDASERVE_EP_PLACEMENT=diagonal %s " KDASERVE " logits "
                      "--model %s/m --ids 1,2 --out %s/x.st 2>&1", mpirun(2), tmpdir, tmpdir), 0);
    cr_expect(strstr(out, "KDASERVE_EP_PLACEMENT wants block or cyclic"), "%s", out);
    cr_expect_eq(run(out, sizeof out, "%s " KDASERVE " generate --model %s/m --prompt x "
                     "--max-tokens 2 --device cuda 2>&1", mpirun(2), tmpdir), 1, "%s", out);
    cr_expect(strstr(out, "cuda"), "%s", out);
    /* another model under the same path on rank 1 only (its own mount
     * namespace): refused by the digest comparison, naming the rank */
    cr_assert_eq(run(NULL, 0, KDASERVE " gen-model --preset tiny --seed 12 --out %s/other "
                     ">/dev/null 2>&1", tmpdir), 0);
    if (run(NULL, 0, "unshare -m true 2>/dev/null") != 0) {
        cr_log_warn("no mount namespaces here (unshare -m): the mismatched-model case is not run");
    } else {
        const char *mpi = mpirun(1);
        cr_expect_eq(run(out, sizeof out, "%s " KDASERVE " logits --model %s/m --ids 1,2 --out "
                         "%s/x.st --threads 1 : -np 1 unshare -m sh -c 'mount --bind %s/other %s/m"
                         " && exec " KDASERVE " logits --model %s/m --ids 1,2 --out %s/x.st' 2>&1",
                         mpi, tmpdir, tmpdir, tmpdir, tmpdir, tmpdir, tmpdir), 1, "%s", out);
        cr_expect(strstr(out, "rank 1 loaded a different model"), "%s", out);
    }
    rm_tmp();
}

/* ------------------------------------------------------------------------ */
/* A hung rank                                                               */

/* The children of process `pid` (scanning /proc). */
static int children_of(pid_t pid, pid_t *out, int cap) {
    DIR *d = opendir("/proc");
    if (!d) return 0;
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) && n < cap;) {
        char path[300], buf[512];
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        size_t len = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[len] = '\0';
        const char *rp = strrchr(buf, ')'); /* the name may hold spaces */
        int ppid = 0;
        char state;
        if (rp && sscanf(rp + 1, " %c %d", &state, &ppid) == 2 && ppid == pid)
            out[n++] = (pid_t)atoi(e->d_name);
    }
    closedir(d);
    return n;
}

/* The rank of an MPI process, from its environment; -1 if none. */
static int rank_of(pid_t pid) {
    char path[64], buf[65536];
    snprintf(path, sizeof path, "/proc/%d/environ", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    for (size_t i = 0; i < n; i += strlen(buf + i) + 1)
        if (!strncmp(buf + i, "OMPI_COMM_WORLD_RANK=", 21)) return atoi(buf + i + 21);
    return -1;
}

static void nap_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static size_t file_size(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? (size_t)st.st_size : 0;
}

Test(ep, hung_rank_fails_the_job_with_an_error) {
    make_tmp();
    gen_model("tiny", "m");
    char cmd[2048], out_path[300], err_path[300];
    snprintf(out_path, sizeof out_path, "%s/out.txt", tmpdir);
    snprintf(err_path, sizeof err_path, "%s/err.txt", tmpdir);
    snprintf(cmd, sizeof cmd, "KDASERVE_EP_TIMEOUT=3 exec %s " KDASERVE " generate --model %s/m "
             "--prompt hello --max-tokens 1000000 --ignore-eos --threads 1 >%s 2>%s", mpirun(2),
             tmpdir, out_path, err_path);
    pid_t job = fork();
    cr_assert(job >= 0);
    if (job == 0) {
        setpgid(0, 0);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    /* generating: tokens are coming out */
    double t0 = kds_now_s();
    while (file_size(out_path) < 64 && kds_now_s() - t0 < 60) nap_ms(50);
    cr_assert_geq(file_size(out_path), 64, "the job did not start generating");
    pid_t kids[8];
    int n = children_of(job, kids, 8), stopped = 0;
    for (int i = 0; i < n; i++)
        if (rank_of(kids[i]) == 1) {
            kill(kids[i], SIGSTOP);
            stopped = 1;
        }
    cr_assert(stopped, "no rank 1 among mpirun's %d children", n);
    const double t_stop = kds_now_s();
    int st = 0;
    pid_t w = 0;
    while ((w = waitpid(job, &st, WNOHANG)) == 0 && kds_now_s() - t_stop < 60) nap_ms(50);
    if (w == 0) kill(-job, SIGKILL); /* our own job's process group */
    if (w == 0) waitpid(job, &st, 0);
    cr_assert_neq(w, 0, "the job still ran 60 s after rank 1 stopped (deadline 3 s)");
    const double took = kds_now_s() - t_stop;
    cr_expect(!WIFEXITED(st) || WEXITSTATUS(st) != 0, "the job ended with status 0");
    char errs[16384] = "";
    FILE *f = fopen(err_path, "r");
    if (f) {
        errs[fread(errs, 1, sizeof errs - 1, f)] = '\0';
        fclose(f);
    }
    cr_expect(strstr(errs, "kdaserve generate: ") && strstr(errs, "did not complete within 3000 ms"),
              "no error naming the timeout: %s", errs);
    fprintf(stderr, "ep: a stopped rank ended the job %.1f s later (deadline 3 s)\n", took);
    rm_tmp();
}

/* ------------------------------------------------------------------------ */
/* The communicator                                                          */

Test(ep, comm_collectives_mpi) {
    char out[8192];
    for (int n = 1; n <= 3; n++) {
        cr_assert_eq(run(out, sizeof out, "%s " COMM_CHECK " 2>&1", mpirun(n)), 0, "%s", out);
        char want[64];
        snprintf(want, sizeof want, "comm check ok: %d ranks (mpi)", n);
        cr_expect(strstr(out, want), "%s", out);
    }
    /* a rank that stalls: the others' barrier fails at its deadline */
    double t0 = kds_now_s();
    run(out, sizeof out, "%s " COMM_CHECK " --stall-rank 2 --timeout-ms 1000 2>&1", mpirun(3));
    double took = kds_now_s() - t0;
    cr_expect(strstr(out, "rank 0: timed out as expected") && strstr(out, "rank 1: timed out as "
              "expected"), "%s", out);
    cr_expect_lt(took, 30.0, "the stalled job took %.1f s to end", took);
}

Test(ep, comm_nccl_one_rank) {
#ifndef KDS_HAVE_NCCL
    cr_skip_test("this build has no NCCL (it needs CUDA and MPI at configure time)");
#else
    kds_err err = {0};
    if (!kern_cuda_available(&err)) cr_skip_test("no usable GPU: %s", err.msg);
    char out[8192];
    int rc = run(out, sizeof out, "%s " COMM_CHECK " --comm nccl 2>&1", mpirun(1));
    if (rc == 77) cr_skip_test("NCCL cannot run here: %s", out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, "comm check ok: 1 ranks (nccl, device buffers)"), "%s", out);
#endif
}

Test(ep, comm_single_rank) {
    eng_comm *c = NULL;
    kds_err err = {0};
    eng_comm_params p = eng_comm_default_params();
    p.kind = ENG_COMM_SINGLE;
    cr_assert_eq(eng_comm_create(&p, NULL, NULL, &c, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(eng_comm_size(c), 1);
    cr_expect_eq(eng_comm_rank(c), 0);
    int32_t mine[3] = {4, 5, 6}, all[3] = {0};
    cr_expect_eq(eng_comm_allgather(c, mine, sizeof mine, all, &err), KDS_OK);
    cr_expect(all[0] == 4 && all[1] == 5 && all[2] == 6);
    float send[8], recv[16] = {0}; /* rows 4..6 of 2 floats land at recv[8..13] */
    for (int i = 0; i < 8; i++) send[i] = (float)i;
    int64_t sr = 3, so = 1, rr = 3, ro = 4;
    cr_expect_eq(eng_comm_alltoallv(c, send, &sr, &so, recv, &rr, &ro, 2 * sizeof(float), &err),
                 KDS_OK);
    for (int i = 0; i < 6; i++) cr_expect_eq(recv[ro * 2 + i], send[so * 2 + i]);
    int64_t bad = -1;
    cr_expect_eq(eng_comm_alltoallv(c, send, &bad, &so, recv, &rr, &ro, 4, &err), KDS_INVALID_ARG);
    cr_expect_eq(eng_comm_bcast(c, send, 4, 1, &err), KDS_INVALID_ARG, "root 1 of 1 rank");
    cr_expect_not(eng_comm_broken(c, NULL));
    eng_comm_free(c);
}

/* ------------------------------------------------------------------------ */
/* In-process: placement and a rank's model                                  */

Test(ep, placement_covers_every_expert_once) {
    const int Es[] = {8, 16, 256, 896, 7};
    for (size_t i = 0; i < sizeof Es / sizeof Es[0]; i++)
        for (int n = 1; n <= 8 && n <= Es[i]; n++)
            for (int pl = 0; pl < 2; pl++) {
                const int E = Es[i];
                int count[8] = {0}, last = -1;
                for (int e = 0; e < E; e++) {
                    int r = eng_ep_owner((eng_ep_placement)pl, e, E, n);
                    cr_assert(r >= 0 && r < n, "E %d n %d: expert %d on rank %d", E, n, e, r);
                    if (pl == ENG_EP_BLOCK) cr_assert_geq(r, last, "block placement is contiguous");
                    last = r;
                    count[r]++;
                }
                for (int r = 0; r < n; r++) {
                    cr_expect_eq(count[r], eng_ep_count((eng_ep_placement)pl, r, E, n));
                    cr_expect(count[r] == E / n || count[r] == E / n + 1,
                              "E %d n %d rank %d holds %d", E, n, r, count[r]);
                }
            }
    eng_ep_placement p;
    cr_expect(eng_ep_placement_from_name("cyclic", &p) && p == ENG_EP_CYCLIC);
    cr_expect_not(eng_ep_placement_from_name("round", &p));
}

/* A rank binds its own experts only, every other tensor in full, and agrees
 * with rank 0 on the digest; another model's digest differs. */
Test(ep, a_rank_binds_only_its_experts) {
    make_tmp();
    gen_model("k3-micro", "m"); /* 16 MXFP4 experts per layer */
    cr_assert_eq(run(NULL, 0, KDASERVE " gen-model --preset k3-micro --seed 12 --out %s/o >/dev/null "
                     "2>&1", tmpdir), 0);
    char dir[300], other[300];
    snprintf(dir, sizeof dir, "%s/m", tmpdir);
    snprintf(other, sizeof other, "%s/o", tmpdir);
    kds_err err = {0};
    eng_model *r0 = NULL, *r1 = NULL, *o1 = NULL, *whole = NULL;
    eng_model_params mp = eng_model_default_params();
    mp.ep_ranks = 3;
    mp.ep_placement = ENG_EP_CYCLIC;
    mp.ep_rank = 0;
    cr_assert_eq(eng_model_load(dir, &mp, &r0, &err), KDS_OK, "%s", err.msg);
    mp.ep_rank = 1;
    cr_assert_eq(eng_model_load(dir, &mp, &r1, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_model_load(other, &mp, &o1, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_model_load(dir, NULL, &whole, &err), KDS_OK, "%s", err.msg);
    cr_expect_eq(memcmp(r0->ep_digest, r1->ep_digest, 16), 0, "ranks 0 and 1 disagree");
    cr_expect_neq(memcmp(r1->ep_digest, o1->ep_digest, 16), 0, "two models, one digest");
    cr_expect_str_eq(r0->fingerprint, whole->fingerprint, "rank 0's fingerprint is the model's");
    cr_expect_str_eq(r1->fingerprint, "", "rank 1 computed a fingerprint (it reads every byte)");
    const int E = r1->cfg.num_experts;
    int held = 0;
    for (int b = 0; b < r1->n_moe; b++) {
        const eng_ffn_weights *f = r1->banks[b], *w = whole->banks[b];
        for (int e = 0; e < E; e++) {
            const bool mine = e % 3 == 1;
            const eng_weight *ws[3] = {&f->w1[e], &f->w2[e], &f->w3[e]};
            const eng_weight *wh[3] = {&w->w1[e], &w->w2[e], &w->w3[e]};
            for (int k = 0; k < 3; k++) {
                cr_expect_eq(ws[k]->data != NULL, mine, "bank %d expert %d: bound %d", b, e,
                             ws[k]->data != NULL);
                cr_expect_eq(ws[k]->rows, wh[k]->rows);
                cr_expect_eq(ws[k]->dt, wh[k]->dt);
            }
            held += mine;
        }
        cr_expect(f->router.data && f->sh_gate.data, "bank %d: the router or shared expert unbound",
                  b);
    }
    cr_expect_eq(held, r1->n_moe * eng_ep_count(ENG_EP_CYCLIC, 1, E, 3));
    /* more ranks than experts: refused naming both */
    mp.ep_ranks = E + 1;
    eng_model *bad = NULL;
    cr_expect_eq(eng_model_load(dir, &mp, &bad, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "routed experts"), "%s", err.msg);
    eng_model_free(r0);
    eng_model_free(r1);
    eng_model_free(o1);
    eng_model_free(whole);
    rm_tmp();
}

/* ------------------------------------------------------------------------ */
/* Sizing                                                                    */

/* The plan's figures for Kimi K3 on 64 H200s and Kimi-Linear-48B on 8,
 * against the same quantities worked out by hand from the configs. */
Test(ep, plan_figures_match_a_hand_calculation) {
    static const struct {
        const char *preset;
        int ranks;
    } cases[] = {{"k3", 64}, {"kimi-linear-48b", 8}, {"kimi-linear-48b", 3}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        eng_config c;
        kds_err err = {0};
        cr_assert_eq(eng_genmodel_preset(cases[i].preset, &c, &err), KDS_OK, "%s", err.msg);
        eng_ep_plan_in in = {.ranks = cases[i].ranks, .placement = ENG_EP_BLOCK,
                             .dtype = KERN_BF16, .context = 131072, .batch = 16};
        cr_assert(eng_ep_hw_preset("h200", &in.hw));
        eng_ep_plan_out o;
        cr_assert_eq(eng_ep_plan(&c, &in, &o, &err), KDS_OK, "%s", err.msg);
        const double N = in.ranks, E = c.num_experts, k = c.num_experts_per_token;
        const double I = c.moe_intermediate_size;
        const double X = c.latent_size > 0 ? c.latent_size : c.hidden_size;
        int moe = 0;
        for (int l = 0; l < c.num_hidden_layers; l++) moe += c.layer_is_moe[l];
        /* an expert: w1, w3 [I, X] and w2 [X, I]; MXFP4 is 4 bits a value and
         * an 8-bit scale per 32, bf16 2 bytes */
        const double per_value = c.experts_mxfp4 ? 0.5 + 1.0 / 32 : 2.0;
        const double one = 3 * I * X * per_value;
        cr_expect_float_eq(o.one_expert_bytes, one, 1e-9 * one, "%s", cases[i].preset);
        cr_expect_float_eq(o.expert_bytes, one * E * moe, 1e-9 * one * E * moe);
        /* the rest is everything else the checkpoint holds */
        const eng_plan_sizes sz = eng__plan_sizes(&c, KERN_BF16);
        cr_expect_float_eq(o.replicated_bytes, (double)(sz.bytes - sz.expert_bytes), 1.0);
        const double fullest = ceil(E / N);
        cr_expect_eq(o.experts_rank_max, (int)fullest);
        cr_expect_float_eq(o.rank_weight_bytes, o.replicated_bytes + fullest * moe * one, 1e3);
        /* a token: k rows of X f32 out and back; (N-1)/N of it leaves */
        cr_expect_float_eq(o.a2a_token_layer, 2 * k * X * 4, 1e-6);
        cr_expect_float_eq(o.a2a_cross_token_layer, 2 * k * X * 4 * (N - 1) / N, 1e-6);
        const eng_state_size st = eng_config_state_size(&c);
        cr_expect_float_eq(o.state_session, (double)st.fixed + 131072.0 * st.per_token, 1.0);
        /* a step: the time is the bytes over the bandwidth, the rate B / step */
        cr_expect_float_eq(o.t_hbm, o.hbm_step_bytes / 4800e9, 1e-12);
        cr_expect_float_eq(o.tok_s_job, N * 16 / o.t_step, 1e-6 * o.tok_s_job);
        const double active = fullest * (1 - pow(1 - k / E, N * 16));
        cr_expect_float_eq(o.active_experts_rank, active, 1e-9);
    }
    /* K3's experts are about 1.4 TB in MXFP4 (issue 14) */
    eng_config k3;
    cr_assert_eq(eng_genmodel_preset("k3", &k3, NULL), KDS_OK);
    eng_ep_plan_in in = {.ranks = 64, .dtype = KERN_BF16, .context = 0, .batch = 1};
    eng_ep_hw_preset("h200", &in.hw);
    eng_ep_plan_out o;
    cr_assert_eq(eng_ep_plan(&k3, &in, &o, NULL), KDS_OK);
    cr_expect(o.expert_bytes > 1.40e12 && o.expert_bytes < 1.50e12, "%g", o.expert_bytes);
    /* too many ranks: refused naming the numbers */
    in.ranks = 1000;
    kds_err err = {0};
    cr_expect_eq(eng_ep_plan(&k3, &in, &o, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "896 routed experts"), "%s", err.msg);
}

Test(ep, plan_command_prints_the_figures) {
    char out[16384];
    cr_assert_eq(run(out, sizeof out, KDASERVE " plan --gen k3 --ranks 64 --gpu h200 2>&1"), 0,
                 "%s", out);
    cr_expect(strstr(out, "64 x h200"), "%s", out);
    cr_expect(strstr(out, "14 experts x 92 MoE layers"), "%s", out);
    cr_expect(strstr(out, "16 rows of 3584 f32"), "%s", out);
    cr_expect(strstr(out, "tok/s"), "%s", out);
    cr_expect_eq(run(out, sizeof out, KDASERVE " plan --gen k3 2>&1"), 2, "no --ranks: %s", out);
    cr_expect_eq(run(out, sizeof out, KDASERVE " plan --gen tiny --ranks 9 2>&1"), 1, "%s", out);
    cr_expect(strstr(out, "8 routed experts"), "%s", out);
    cr_expect_eq(run(out, sizeof out, KDASERVE " plan --gen k3 --ranks 8 --gpu a100 2>&1"), 2, "%s",
                 out);
}

/* ------------------------------------------------------------------------ */
/* The service on several ranks                                              */

typedef struct ep_job {
    pid_t pid; /* mpirun */
    int port;
    char url[64], log[300];
} ep_job;

static int rank_pid(const ep_job *j, int rank) {
    pid_t kids[16];
    int n = children_of(j->pid, kids, 16);
    for (int i = 0; i < n; i++)
        if (rank_of(kids[i]) == rank) return kids[i];
    return -1;
}

/* `mpirun [opts] -np N kdaserve serve --listen 127.0.0.1:PORT args`, its
 * output in tmpdir/serve.log; true once it listens. */
static bool serve_start(ep_job *j, const char *mpi, const char *env, const char *args) {
    memset(j, 0, sizeof *j);
    j->port = ts_free_port();
    snprintf(j->url, sizeof j->url, "ws://127.0.0.1:%d/", j->port);
    snprintf(j->log, sizeof j->log, "%s/serve.log", tmpdir);
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s exec %s " KDASERVE " serve --listen 127.0.0.1:%d --db %s/db %s "
             ">%s 2>&1", env, mpi, j->port, tmpdir, args, j->log);
    j->pid = fork();
    if (j->pid < 0) return false;
    if (j->pid == 0) {
        setpgid(0, 0);
        for (int fd = 3; fd < 1024; fd++) close(fd); /* the test runner's pipes */
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    double t0 = kds_now_s();
    while (kds_now_s() - t0 < 60) {
        int st;
        if (waitpid(j->pid, &st, WNOHANG) == j->pid) {
            j->pid = 0;
            return false;
        }
        if (ts_port_open(j->port)) return true;
        nap_ms(50);
    }
    return false;
}

/* Wait up to timeout_s for the job to end by itself; its exit status, or
 * -1 (then it is killed: our own process group). */
static int serve_wait(ep_job *j, int timeout_s) {
    double t0 = kds_now_s();
    int st = 0;
    pid_t w = 0;
    while ((w = waitpid(j->pid, &st, WNOHANG)) == 0 && kds_now_s() - t0 < timeout_s) nap_ms(50);
    if (w == 0) {
        kill(-j->pid, SIGKILL);
        waitpid(j->pid, &st, 0);
        j->pid = 0;
        return -1;
    }
    j->pid = 0;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void log_tail(const ep_job *j, char *out, size_t cap) {
    out[0] = '\0';
    FILE *f = fopen(j->log, "r");
    if (!f) return;
    fseek(f, 0, SEEK_END);
    long n = ftell(f), take = n < (long)cap - 1 ? n : (long)cap - 1;
    fseek(f, n - take, SEEK_SET);
    out[fread(out, 1, (size_t)take, f)] = '\0';
    fclose(f);
}

static bool node_ready(void) {
    return th_system("node --version >/dev/null 2>&1") == 0 && ts_node_module("ws") &&
           ts_node_module("@msgpack/msgpack");
}

Test(ep, serve_on_two_ranks_passes_the_protocol_groups) {
    const char *mpi = mpirun(2);
    cr_assert(node_ready(), "node and tests/node's packages are needed (scripts/bootstrap.sh)");
    make_tmp();
    char args[512], tail[4096];
    /* the bundled model, as the 1-rank protocol tests use (tests/test_serve.c) */
    snprintf(args, sizeof args, "--model " KDS_SOURCE_DIR "/models/default --threads 1");
    ep_job j;
    bool up = serve_start(&j, mpi, "", args);
    log_tail(&j, tail, sizeof tail);
    cr_assert(up, "serve on 2 ranks did not start: %s", tail);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "node '" TS_NODE_DIR "/ws_protocol.test.js' --url '%s' --group "
             "basic,generate,concurrent,resume,cancel 1>&2", j.url);
    int rc = th_system(cmd);
    log_tail(&j, tail, sizeof tail);
    cr_expect_eq(rc, 0, "protocol checks failed on 2 ranks (the 'not ok' lines say which); log: %s",
                 tail);
    /* rank 0 stops the service (SIGTERM), then lets the other rank go */
    int r0 = rank_pid(&j, 0);
    cr_assert_gt(r0, 0, "no rank 0 under mpirun");
    kill(r0, SIGTERM);
    const int st = serve_wait(&j, 60);
    log_tail(&j, tail, sizeof tail);
    cr_expect_eq(st, 0, "the job did not end with status 0 on SIGTERM to rank 0: %s", tail);
    rm_tmp();
}

Test(ep, serve_rank_killed_mid_generation) {
    /* --enable-recovery: Open MPI then leaves the other ranks alone when one
     * dies (its default ends the whole job at once), so rank 0 finds the
     * loss itself, answers the client and ends the job */
    char mpi[400]; /* mpirun(2) and --enable-recovery */
    snprintf(mpi, sizeof mpi, "%s", mpirun(2));
    char *np = strstr(mpi, "-np");
    cr_assert(np);
    memmove(np + strlen("--enable-recovery "), np, strlen(np) + 1);
    memcpy(np, "--enable-recovery ", strlen("--enable-recovery "));
    cr_assert(node_ready(), "node and tests/node's packages are needed (scripts/bootstrap.sh)");
    make_tmp();
    char args[512], tail[4096], out_path[300], cmd[1024];
    snprintf(args, sizeof args, "--model " KDS_SOURCE_DIR "/models/default --threads 1 "
             "--max-tokens 100000");
    ep_job j;
    bool up = serve_start(&j, mpi, "KDASERVE_EP_TIMEOUT=3", args);
    log_tail(&j, tail, sizeof tail);
    cr_assert(up, "serve on 2 ranks did not start: %s", tail);
    snprintf(out_path, sizeof out_path, "%s/client.txt", tmpdir);
    snprintf(cmd, sizeof cmd, "node '" TS_NODE_DIR "/ep_fault.js' '%s' f1 >%s 2>&1", j.url, out_path);
    pid_t client = fork();
    cr_assert(client >= 0);
    if (client == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    char got[4096] = "";
    double t0 = kds_now_s();
    while (!strstr(got, "generating") && kds_now_s() - t0 < 60) {
        nap_ms(100);
        FILE *f = fopen(out_path, "r");
        if (f) {
            got[fread(got, 1, sizeof got - 1, f)] = '\0';
            fclose(f);
        }
    }
    cr_assert(strstr(got, "generating"), "the client never saw tokens: %s", got);
    const int r1 = rank_pid(&j, 1);
    cr_assert_gt(r1, 0, "no rank 1 under mpirun");
    kill(r1, SIGKILL);
    int cst = 0;
    t0 = kds_now_s();
    pid_t w;
    while ((w = waitpid(client, &cst, WNOHANG)) == 0 && kds_now_s() - t0 < 60) nap_ms(100);
    if (w == 0) {
        kill(client, SIGKILL);
        waitpid(client, &cst, 0);
    }
    FILE *f = fopen(out_path, "r");
    if (f) {
        got[fread(got, 1, sizeof got - 1, f)] = '\0';
        fclose(f);
    }
    cr_expect(strstr(got, "first length"), "the first turn was not saved: %s", got);
    cr_expect(strstr(got, "done error") && strstr(got, "did not complete within 3000 ms"),
              "the client got no error naming the loss: %s", got);
    const int st = serve_wait(&j, 60);
    log_tail(&j, tail, sizeof tail);
    cr_expect_neq(st, -1, "the service still ran a minute after losing rank 1: %s", tail);
    cr_expect(strstr(tail, "the job lost a rank"), "%s", tail);
    char out[8192];
    cr_expect_eq(run(out, sizeof out, KDASERVE " snap verify --db %s/db --model "
                     KDS_SOURCE_DIR "/models/default 2>&1", tmpdir), 0, "%s", out);
    cr_expect(strstr(out, "0 failed") && strstr(out, "1 sessions"), "%s", out);
    rm_tmp();
}

/* `kdaserve chat` on rank 0 of 2 (the other holds half the experts): the
 * same replies as on one rank, and the session resumes on one rank. */
Test(ep, chat_on_two_ranks_equals_one) {
    const char *mpi = mpirun(2);
    make_tmp();
    char one[8192], two[8192];
    const char *chat = KDASERVE " chat --model " KDS_SOURCE_DIR "/models/default --db %s/%s "
                       "--session c --threads 1 2>&1";
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "printf 'Hello there\\nTell me more\\n/quit\\n' | ");
    size_t l = strlen(cmd);
    snprintf(cmd + l, sizeof cmd - l, chat, tmpdir, "one");
    cr_assert_eq(run(one, sizeof one, "%s", cmd), 0, "%s", one);
    snprintf(cmd, sizeof cmd, "printf 'Hello there\\nTell me more\\n/quit\\n' | %s ", mpi);
    l = strlen(cmd);
    snprintf(cmd + l, sizeof cmd - l, chat, tmpdir, "two");
    cr_assert_eq(run(two, sizeof two, "%s", cmd), 0, "%s", two);
    cr_expect_str_eq(two, one, "2 ranks' chat differs from one rank's");
    cr_expect(strlen(one) > 40, "%s", one);
    rm_tmp();
}

/* A hybrid session (MLA rows) chatted for three turns on 2 ranks, saved
 * after each (a save brings back only the rows rank 0 lacks), then resumed
 * on one rank: the same text as the same turns all on one rank. */
Test(ep, hybrid_session_saves_incrementally) {
    const char *mpi = mpirun(2);
    make_tmp();
    gen_model("tiny-hybrid", "m");
    char ref[8192], got[8192], cmd[2048], tail_ref[4096], tail_got[4096];
    const char *chat = "printf 'Hello\\nmore of it\\nand again\\n/quit\\n' | %s " KDASERVE " chat "
                       "--model %s/m --db %s/%s --session c --threads 2 --max-tokens 12 2>&1";
    snprintf(cmd, sizeof cmd, chat, "", tmpdir, tmpdir, "one");
    cr_assert_eq(run(ref, sizeof ref, "%s", cmd), 0, "%s", ref);
    snprintf(cmd, sizeof cmd, chat, mpi, tmpdir, tmpdir, "two");
    cr_assert_eq(run(got, sizeof got, "%s", cmd), 0, "%s", got);
    cr_expect_str_eq(got, ref, "the chat on 2 ranks differs from one rank's");
    const char *gen = KDASERVE " generate --model %s/m --db %s/%s --session c --prompt ' then' "
                      "--max-tokens 16 --threads 2 2>/dev/null";
    snprintf(cmd, sizeof cmd, gen, tmpdir, tmpdir, "one");
    cr_assert_eq(run(tail_ref, sizeof tail_ref, "%s", cmd), 0);
    snprintf(cmd, sizeof cmd, gen, tmpdir, tmpdir, "two");
    cr_assert_eq(run(tail_got, sizeof tail_got, "%s", cmd), 0);
    cr_expect_str_eq(tail_got, tail_ref, "resumed on one rank from the 2-rank saves: another text");
    rm_tmp();
}
