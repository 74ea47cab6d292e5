/*
 * kern_math.h - vectorisable scalar math shared by the CPU kernels (internal
 * to kernels/cpu). Branch-free so that loops calling these functions
 * vectorise under -O3; accuracy stated per function.
 */
#ifndef KERN_MATH_H
#define KERN_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/*
 * e^x, branch-free so that loops calling it vectorise. Cephes' expf:
 * x = n ln2 + r with |r| <= ln2/2 (n rounded with the 1.5 * 2^23 trick, ln2
 * split in two so n ln2 is exact), a degree-6 polynomial for e^r, 2^n built
 * in the exponent bits. Within 1 ulp of e^x on [-87, 88]. Below -87 it
 * returns 0 where expf would give a denormal under 1.7e-38: every caller
 * multiplies it into values of order 1, so the difference is invisible.
 * Above 88 it saturates at about e^88 (only the sigmoid's e^-y gets there,
 * where 1 / (1 + e^88) is as good as 0). NaN gives NaN; inside, a NaN is
 * clamped like a small x (every comparison with it is false), because
 * converting a NaN to int, as the exponent step does, is undefined.
 */
static inline float vexp(float x) {
    const float lo = -87.0f, hi = 88.0f;
    float xc = x >= lo ? (x > hi ? hi : x) : lo;
    float n = fmaf(xc, 1.44269504088896341f, 12582912.0f) - 12582912.0f;
    float r = fmaf(-n, 0.693359375f, xc);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p * r, r, r) + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return x >= lo ? p * two_n : (x < lo ? 0.0f : x);
}

/* 1 / (1 + e^-x), within 2.5 ulp. */
static inline float vsigmoid(float x) { return 1.0f / (1.0f + vexp(-x)); }

/*
 * tanh(x), branch-free so that loops calling it vectorise (libm's tanhf is
 * a call per value: SiTU, K3's expert activation, spent a tenth of a K3
 * slice's decode in tanhf and expm1f). Cephes' tanhf: below 0.625 in
 * magnitude an odd polynomial in x (no cancellation near 0), above it
 * 1 - 2 / (e^(2|x|) + 1) with the sign of x; both are computed and one is
 * kept. Within 3 ulp of tanhf (tests/test_k3_ops.c checks the whole float
 * range it can reach); saturates to +-1 (vexp's clamp) and keeps NaN.
 */
static inline float vtanh(float x) {
    const float ax = fabsf(x), z = x * x;
    float p = -5.70498872745e-3f;
    p = fmaf(p, z, 2.06390887954e-2f);
    p = fmaf(p, z, -5.37397155531e-2f);
    p = fmaf(p, z, 1.33314422036e-1f);
    p = fmaf(p, z, -3.33332819422e-1f);
    const float small = fmaf(p * z, x, x);
    const float big = 1.0f - 2.0f / (vexp(2.0f * ax) + 1.0f);
    const float sbig = x < 0.0f ? -big : big;
    return ax < 0.625f ? small : (x != x ? x : sbig);
}

#endif
