/*
 * Non-finite values in the CPU kernels: damaged weights or a damaged saved
 * state can put NaN and infinities into any activation (the fuzz targets
 * tests/fuzz/fuzz_model.c and fuzz_state.c do). The kernels must carry
 * them through without undefined behaviour (the sanitizer pass of
 * scripts/test.sh fails on any), and NaN must stay NaN rather than turn
 * into a plausible number.
 */
#include <criterion/criterion.h>
#include <math.h>

#include "kern.h"

#define N 37 /* vector body and a scalar tail */

static void fill(float *x, float v) {
    for (int i = 0; i < N; i++) x[i] = i % 3 == 0 ? v : (float)i * 0.1f - 1.0f;
}

Test(nonfinite, nan_through_the_activations) {
    float x[N], y[N];
    fill(x, NAN);
    kern_silu(x, N);
    for (int i = 0; i < N; i += 3) cr_expect(isnan(x[i]), "silu(NaN) at %d is %g", i, (double)x[i]);
    fill(x, NAN);
    kern_sigmoid_inplace(x, N);
    for (int i = 0; i < N; i += 3) cr_expect(isnan(x[i]), "sigmoid(NaN) at %d", i);
    fill(x, NAN);
    fill(y, 1.0f);
    kern_swiglu(x, y, N);
    for (int i = 0; i < N; i += 3) cr_expect(isnan(x[i]), "swiglu(NaN) at %d", i);
    cr_expect(isnan(kern_sigmoid(NAN)));
    fill(x, 2.0f);
    fill(y, NAN);
    kern_sigmoid_mul(x, y, N);
    for (int i = 0; i < N; i += 3) cr_expect(isnan(x[i]), "x * sigmoid(NaN) at %d", i);
}

Test(nonfinite, infinities_through_the_activations) {
    float x[N];
    fill(x, INFINITY);
    kern_sigmoid_inplace(x, N);
    for (int i = 0; i < N; i += 3) cr_expect_eq(x[i], 1.0f, "sigmoid(inf) at %d", i);
    fill(x, -INFINITY);
    kern_sigmoid_inplace(x, N);
    for (int i = 0; i < N; i += 3) cr_expect(x[i] >= 0.0f && x[i] < 1e-30f, "sigmoid(-inf) at %d", i);
    fill(x, INFINITY);
    kern_silu(x, N);
    for (int i = 0; i < N; i += 3) cr_expect(isinf(x[i]) && x[i] > 0, "silu(inf) at %d", i);
}
