/* cli_common.c - helpers shared by the subcommands. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <time.h>

#include "cli.h"
#include "eng_comm.h"
#include "eng_ep.h"
#include "kds_clock.h"

/* The process's ranks: MPI is per process, so this is too (set once by
 * main before any command runs, read by the commands' model opening). */
static eng_comm *g_comm;
static eng_ep_placement g_placement;

void cli_set_comm(eng_comm *comm, eng_ep_placement placement) {
    g_comm = comm;
    g_placement = placement;
}

eng_comm *cli_comm(void) { return g_comm; }

void cli_model_params(eng_model_params *mp, const char *device) {
    eng_ep_model_params(mp, g_comm, g_placement);
    /* a GPU holds its own copy: the host's would only cost the read */
    if (device && strcmp(device, "cpu") != 0) mp->weights = ENG_WEIGHTS_MAPPED;
}

eng_ep_placement cli_placement(void) { return g_placement; }

int cli_fail(const char *cmd, const kds_err *err) {
    fprintf(stderr, "kdaserve %s: %s\n", cmd,
            err && err->msg[0] ? err->msg : kds_status_str(err ? err->status : KDS_INTERNAL));
    return 1;
}

int cli_failf(const char *cmd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kdaserve %s: ", cmd);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 1;
}

int cli_usage_error(const char *cmd, const char *fmt, ...) {
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        fprintf(stderr, "kdaserve %s: ", cmd);
        vfprintf(stderr, fmt, ap);
        fputc('\n', stderr);
        va_end(ap);
    }
    fprintf(stderr, "Try 'kdaserve %s --help' for its options.\n", cmd);
    return 2;
}

static bool is_dir(const char *p) {
    struct stat st;
    return p && stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

bool cli_beside_binary(const char *rel, char *out, size_t cap) {
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return false;
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (!slash) return false;
    *slash = '\0';
    int k = snprintf(out, cap, "%s/../%s", exe, rel);
    return k > 0 && (size_t)k < cap && access(out, R_OK) == 0;
}

/* <dir of the kdaserve binary>/../models/default: the bundled model of a
 * source tree built into ./build, wherever the command is run from. */
static const char *bundled_model_dir(void) {
    static char path[4200]; /* one process, one answer */
    char cfg[4200];
    if (!cli_beside_binary("models/default/config.json", cfg, sizeof cfg)) return NULL;
    snprintf(path, sizeof path, "%.*s", (int)(strlen(cfg) - strlen("/config.json")), cfg);
    return path;
}

const char *cli_model_dir(const char *cmd, const char *given) {
    if (given) return given;
    const char *env = getenv("KDASERVE_MODEL");
    if (env && *env) return env;
    if (is_dir("models/default") && access("models/default/config.json", R_OK) == 0)
        return "models/default";
    const char *bundled = bundled_model_dir();
    if (bundled) return bundled;
    cli_failf(cmd, "no model: pass --model DIR, set KDASERVE_MODEL, or run from a directory "
                   "with models/default (make one with `kdaserve gen-model --preset tiny --out DIR`)");
    return NULL;
}

bool cli_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

bool cli_parse_f32(const char *s, float lo, float hi, float *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || *end || isnan(v) || v < lo || v > hi) return false;
    *out = v;
    return true;
}

int cli_open(const char *cmd, const char *model_dir, int threads, int max_batch, eng_model **m,
             eng_ctx **c) {
    return cli_open_on(cmd, model_dir, threads, max_batch, NULL, m, c);
}

bool cli_device_valid(const char *device) {
    eng_device d;
    return eng_device_from_name(device, &d);
}

int cli_open_on(const char *cmd, const char *model_dir, int threads, int max_batch,
                const char *device, eng_model **m, eng_ctx **c) {
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = threads;
    if (max_batch > 0) cp.max_batch = max_batch;
    cp.device = device;
    return cli_open_with(cmd, model_dir, &cp, m, c);
}

void cli_note_bf16(const char *cmd, const eng_ctx_params *cp) {
    const bool cpu = !cp->device || !strcmp(cp->device, "cpu");
    if (cp->bf16_act && cpu && !eng_cpu_bf16_products())
        fprintf(stderr,
                "kdaserve %s: --bf16: this build has no AVX-512 BF16 dot products (this CPU "
                "lacks them, or it was built with -DKDS_NATIVE=OFF), so the products stay exact\n",
                cmd);
}

int cli_open_with(const char *cmd, const char *model_dir, const eng_ctx_params *cp, eng_model **m,
                  eng_ctx **c) {
    kds_err err = {0};
    cli_note_bf16(cmd, cp);
    eng_model_params mp = eng_model_default_params();
    mp.progress = true;
    cli_model_params(&mp, cp->device);
    eng_ctx_params q = *cp;
    q.comm = cli_comm(); /* under mpirun: this context drives every rank */
    if (eng_model_load(model_dir, &mp, m, &err) != KDS_OK) return cli_fail(cmd, &err);
    if (eng_ctx_create(*m, &q, c, &err) != KDS_OK) {
        eng_model_free(*m);
        *m = NULL;
        return cli_fail(cmd, &err);
    }
    return 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

void cli_sort_doubles(double *v, size_t n) { qsort(v, n, sizeof *v, cmp_double); }

double cli_median(double *v, int n) {
    cli_sort_doubles(v, (size_t)n);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

#ifdef KDS_HAVE_CUDA
#include "kern_cuda.h"

kds_status cli_copy_to_device_s(size_t bytes, int reps, double *median_s, kds_err *err) {
    void *host = NULL, *dev = NULL;
    double *t = calloc((size_t)(reps > 0 ? reps : 1), sizeof *t);
    kds_status rc = t ? KDS_OK : kds_err_set(err, KDS_NOMEM, "out of memory");
    if (rc == KDS_OK) rc = kern_cuda_host_alloc(&host, bytes, err);
    if (rc == KDS_OK) rc = kern_cuda_malloc(&dev, bytes, err);
    if (rc == KDS_OK) memset(host, 1, bytes);
    for (int i = 0; i < reps && rc == KDS_OK; i++) {
        double t0 = kds_now_s();
        rc = kern_cuda_memcpy_h2d(dev, host, bytes, NULL, err);
        if (rc == KDS_OK) rc = kern_cuda_sync(NULL, err);
        t[i] = kds_now_s() - t0;
    }
    if (rc == KDS_OK) *median_s = cli_median(t, reps);
    kern_cuda_free(dev);
    kern_cuda_host_free(host);
    free(t);
    return rc;
}
#else
kds_status cli_copy_to_device_s(size_t bytes, int reps, double *median_s, kds_err *err) {
    (void)bytes, (void)reps, (void)median_s;
    return kds_err_set(err, KDS_UNSUPPORTED, "this kdaserve was built without CUDA");
}
#endif

void cli_note_other_models(const char *cmd, sess_store *st, const eng_model *m) {
    sess_session_info *ss = NULL;
    size_t n = 0, other = 0, example = 0;
    kds_err err = {0};
    if (sess_session_list(st, &ss, &n, &err) != KDS_OK) return;
    const char *fp = eng_model_fingerprint(m);
    for (size_t i = 0; i < n; i++) {
        if (strcmp(ss[i].fingerprint, fp) == 0) continue;
        if (!other++) example = i;
    }
    if (other) {
        const sess_session_info *e = &ss[example];
        fprintf(stderr,
                "kdaserve %s: %zu of the %zu sessions in %s were made by another model (e.g. "
                "'%s', by %s) and cannot be opened with %s; serve them with --model %s, or give "
                "this model its own store (--db)\n",
                cmd, other, n, sess_store_dir(st), e->name,
                e->model_dir[0] ? e->model_dir : "a model whose directory was not recorded",
                eng_model_dir(m), e->model_dir[0] ? e->model_dir : "DIR");
    }
    free(ss);
}
