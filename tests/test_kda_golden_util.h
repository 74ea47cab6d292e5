/*
 * test_kda_golden_util.h - reading fla's KDA reference files in
 * shared/golden/kda/ (*.safetensors; format in shared/golden/README.md) for
 * the CPU and CUDA golden tests (header-only, static functions). Every
 * missing directory, file, metadata key or tensor fails the test with its
 * name.
 */
#ifndef TEST_KDA_GOLDEN_UTIL_H
#define TEST_KDA_GOLDEN_UTIL_H

#include <criterion/criterion.h>

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng_safetensors.h"
#include "kern.h"

#define GOLDEN_MAX_FILES 256

static inline const char *golden_dir(void) {
    const char *env = getenv("KDA_GOLDEN_DIR");
    return env && *env ? env : KDS_SOURCE_DIR "/../shared/golden/kda";
}

static inline int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Sorted paths of every *.safetensors in the golden dir (caller frees each
 * and the array). Fails the test when there are none. */
static inline char **golden_files(int *n_out) {
    const char *dir = golden_dir();
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "cannot open golden dir %s", dir);
    char **names = calloc(GOLDEN_MAX_FILES, sizeof *names);
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        size_t len = strlen(e->d_name), sfx = strlen(".safetensors");
        if (len <= sfx || strcmp(e->d_name + len - sfx, ".safetensors") != 0) continue;
        cr_assert_lt(n, GOLDEN_MAX_FILES, "more than %d golden files", GOLDEN_MAX_FILES);
        size_t sz = strlen(dir) + len + 2;
        names[n] = malloc(sz);
        snprintf(names[n], sz, "%s/%s", dir, e->d_name);
        n++;
    }
    closedir(d);
    cr_assert_gt(n, 0, "no *.safetensors in golden dir %s", dir);
    qsort(names, (size_t)n, sizeof *names, cmp_str);
    *n_out = n;
    return names;
}

typedef struct golden {
    eng_st_file *f;
    const char *name; /* file name without the dir */
    int T, H, HV, K, V;
    float scale, eps;
    const float *q_raw, *k_raw, *v, *g_raw, *beta_raw, *A_log, *dt_bias, *h0;
    const float *q, *k, *g, *beta, *o, *hT;
} golden;

static inline int meta_int(const golden *gd, const char *key) {
    const char *s = eng_st_metadata(gd->f, key);
    cr_assert_not_null(s, "%s: no metadata %s", gd->name, key);
    return atoi(s);
}

static inline double meta_double(const golden *gd, const char *key) {
    const char *s = eng_st_metadata(gd->f, key);
    cr_assert_not_null(s, "%s: no metadata %s", gd->name, key);
    return strtod(s, NULL);
}

/* F32 tensor `name` with exactly `n` elements. */
static inline const float *tensor(const golden *gd, const char *name, size_t n) {
    const eng_st_tensor *t = eng_st_find(gd->f, name);
    cr_assert_not_null(t, "%s: no tensor %s", gd->name, name);
    cr_assert_eq(t->dtype, ENG_ST_F32, "%s: tensor %s is not F32", gd->name, name);
    cr_assert_eq(t->n_elems, n, "%s: tensor %s has %zu elements, expected %zu", gd->name, name,
                 t->n_elems, n);
    return t->data;
}

static inline void golden_open(const char *path, golden *gd) {
    memset(gd, 0, sizeof *gd);
    kds_err err = {0};
    kds_status st = eng_st_open(path, &gd->f, &err);
    cr_assert_eq(st, KDS_OK, "cannot read %s: %s", path, err.msg);
    const char *slash = strrchr(path, '/');
    gd->name = slash ? slash + 1 : path;
    gd->T = meta_int(gd, "T");
    gd->H = meta_int(gd, "H");
    gd->HV = meta_int(gd, "HV");
    gd->K = meta_int(gd, "K");
    gd->V = meta_int(gd, "V");
    gd->scale = (float)meta_double(gd, "scale");
    gd->eps = (float)meta_double(gd, "l2norm_eps");
    cr_assert(gd->T >= 0 && gd->H > 0 && gd->HV % gd->H == 0 && gd->K > 0 && gd->V > 0,
              "%s: bad shape metadata", gd->name);
    size_t T = gd->T, H = gd->H, HV = gd->HV, K = gd->K, V = gd->V;
    gd->q_raw = tensor(gd, "q_raw", T * H * K);
    gd->k_raw = tensor(gd, "k_raw", T * H * K);
    gd->v = tensor(gd, "v", T * HV * V);
    gd->g_raw = tensor(gd, "g_raw", T * HV * K);
    gd->beta_raw = tensor(gd, "beta_raw", T * HV);
    gd->A_log = tensor(gd, "A_log", HV);
    gd->dt_bias = tensor(gd, "dt_bias", HV * K);
    gd->h0 = tensor(gd, "h0", HV * K * V);
    gd->q = tensor(gd, "q", T * H * K);
    gd->k = tensor(gd, "k", T * H * K);
    gd->g = tensor(gd, "g", T * HV * K);
    gd->beta = tensor(gd, "beta", T * HV);
    gd->o = tensor(gd, "o", T * HV * V);
    gd->hT = tensor(gd, "hT", HV * K * V);
}

static inline kern_kda_shape golden_shape(const golden *gd) {
    kern_kda_shape sh = {gd->H, gd->HV, gd->K, gd->V, gd->scale};
    return sh;
}

#endif /* TEST_KDA_GOLDEN_UTIL_H */
