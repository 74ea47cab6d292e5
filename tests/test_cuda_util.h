/*
 * test_cuda_util.h - helpers shared by the CUDA kernel tests
 * (tests/test_cuda_*.c): device skip, allocation and copies that fail the
 * test on error, deterministic random inputs, bf16 rounding and the
 * "close to the CPU reference" check. Header-only, static functions.
 *
 * Only meaningful when the CUDA library is built (KDS_HAVE_CUDA).
 */
#ifndef TEST_CUDA_UTIL_H
#define TEST_CUDA_UTIL_H

#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kern.h"
#include "kern_cuda.h"

/* Skip the calling test, with the reason, when no usable GPU is present. */
static inline void tcu_require_device(void) {
    kds_err err;
    kds_err_clear(&err);
    if (!kern_cuda_available(&err)) cr_skip_test("no CUDA device: %s", err.msg);
}

/* ---- deterministic random numbers (splitmix64) ---------------------------- */

static inline uint64_t tcu_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* uniform in [lo, hi) */
static inline float tcu_uniform(uint64_t *s, float lo, float hi) {
    return lo + (hi - lo) * (float)((tcu_next(s) >> 40) * (1.0 / 16777216.0));
}

static inline void tcu_fill(uint64_t *s, float *x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++) x[i] = tcu_uniform(s, lo, hi);
}

/* Round fp32 values to what bf16 holds, so CPU and GPU see the same inputs. */
static inline void tcu_round_bf16(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = kern_bf16_to_f32(kern_f32_to_bf16(x[i]));
}

/* malloc that fails the test instead of returning NULL. */
static inline void *tcu_malloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    cr_assert_not_null(p, "out of host memory (%zu bytes)", bytes);
    return p;
}

/* ---- device memory --------------------------------------------------------- */

static inline void *tcu_dev_alloc(size_t bytes) {
    kds_err err;
    void *p = NULL;
    kds_status st = kern_cuda_malloc(&p, bytes ? bytes : 16, &err);
    cr_assert_eq(st, KDS_OK, "kern_cuda_malloc(%zu): %s", bytes, err.msg);
    return p;
}

static inline void tcu_h2d(void *dst, const void *src, size_t bytes) {
    kds_err err;
    kds_status st = kern_cuda_memcpy_h2d(dst, src, bytes, NULL, &err);
    cr_assert_eq(st, KDS_OK, "h2d: %s", err.msg);
}

static inline void tcu_d2h(void *dst, const void *src, size_t bytes) {
    kds_err err;
    kds_status st = kern_cuda_memcpy_d2h(dst, src, bytes, NULL, &err);
    cr_assert_eq(st, KDS_OK, "d2h: %s", err.msg);
}

static inline void tcu_sync(void) {
    kds_err err;
    kds_status st = kern_cuda_sync(NULL, &err);
    cr_assert_eq(st, KDS_OK, "sync: %s", err.msg);
}

/* Fill device memory with 0xff bytes (NaN floats), so unwritten outputs show. */
static inline void tcu_poison(void *dst, size_t bytes) {
    kds_err err;
    cr_assert_eq(kern_cuda_memset(dst, 0xff, bytes, NULL, &err), KDS_OK, "memset: %s", err.msg);
}

/* Upload n fp32 host values as `dt` (F32 or BF16) into a new device buffer. */
static inline void *tcu_upload_as(const float *src, size_t n, kern_dtype dt) {
    if (dt == KERN_F32) {
        void *d = tcu_dev_alloc(n * sizeof(float));
        tcu_h2d(d, src, n * sizeof(float));
        return d;
    }
    uint16_t *tmp = tcu_malloc(n * sizeof *tmp);
    for (size_t i = 0; i < n; i++) tmp[i] = kern_f32_to_bf16(src[i]);
    void *d = tcu_dev_alloc(n * sizeof *tmp);
    tcu_h2d(d, tmp, n * sizeof *tmp);
    free(tmp);
    return d;
}

static inline float *tcu_upload(const float *src, size_t n) {
    return tcu_upload_as(src, n, KERN_F32);
}

/* ---- comparison ------------------------------------------------------------- */

/* max |got - want| / max |want| over n values (NaN anywhere gives +inf);
 * *worst gets the index of the largest error. */
static inline double tcu_rel_err(const float *got, const float *want, size_t n, size_t *worst) {
    double err = 0.0, mag = 0.0;
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - (double)want[i]);
        if (isnan(e)) e = INFINITY;
        if (!(e <= err)) {
            err = e;
            w = i;
        }
        if (fabs((double)want[i]) > mag) mag = fabs((double)want[i]);
    }
    if (worst) *worst = w;
    if (err == 0.0) return 0.0;
    return err / (mag > 0.0 ? mag : 1e-30);
}

/* Assert max |got - want| <= rel * max |want|, printing the measured ratio
 * (CI and the GPU check script keep the numbers). */
static inline void tcu_assert_close(const float *got, const float *want, size_t n, double rel,
                                    const char *what) {
    size_t w = 0;
    double r = tcu_rel_err(got, want, n, &w);
    printf("cuda check %-52s max err / max|ref| = %.2e (tol %.0e)\n", what, r, rel);
    fflush(stdout);
    cr_assert(r <= rel, "%s: max err / max|ref| = %.3e > %.0e at [%zu] (gpu %.9g, cpu %.9g)", what,
              r, rel, w, n ? (double)got[w] : 0.0, n ? (double)want[w] : 0.0);
}

#endif /* TEST_CUDA_UTIL_H */
