/*
 * test_helpers.h - small helpers shared by the test files (header-only,
 * static functions, so each test file stays self-contained).
 */
#ifndef TEST_HELPERS_H
#define TEST_HELPERS_H

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define GOLDEN_ROOT KDS_SOURCE_DIR "/../shared/golden"

/* max |a - b| over n floats, and max |b| (the reference's scale). */
static inline double th_max_abs_diff(const float *a, const float *b, size_t n, double *ref_max) {
    double d = 0.0, m = 0.0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - (double)b[i]);
        if (e > d || isnan(e)) d = isnan(e) ? INFINITY : e;
        if (fabs((double)b[i]) > m) m = fabs((double)b[i]);
    }
    if (ref_max) *ref_max = m;
    return d;
}

/* Sorted list of sub-directories (or files with `suffix`) of `dir`.
 * Returns the count; names are malloc'd full paths in out[] (cap entries). */
static inline int th_list(const char *dir, const char *suffix, int want_dirs, char **out, int cap) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < cap) {
        if (e->d_name[0] == '.') continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat st;
        if (stat(path, &st) != 0) continue;
        if (want_dirs ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode)) continue;
        size_t ln = strlen(e->d_name), ls = suffix ? strlen(suffix) : 0;
        if (suffix && (ln < ls || strcmp(e->d_name + ln - ls, suffix) != 0)) continue;
        out[n++] = strdup(path);
    }
    closedir(d);
    for (int i = 1; i < n; i++) /* insertion sort: a handful of names */
        for (int j = i; j > 0 && strcmp(out[j - 1], out[j]) > 0; j--) {
            char *t = out[j];
            out[j] = out[j - 1];
            out[j - 1] = t;
        }
    return n;
}

/* Run a shell command, return its exit status (or -1). */
static inline int th_system(const char *cmd) {
    int rc = system(cmd);
    if (rc == -1) return -1;
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

#endif
