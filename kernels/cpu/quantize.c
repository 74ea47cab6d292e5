/*
 * quantize.c - rows of f32 values into the block formats of kern.h (the
 * inverse of kern_weight_row_f32): the generator's MXFP4 experts and
 * `kdaserve quantize`.
 */
#include "kern.h"

#include <math.h>
#include <string.h>

/* E2M1 magnitudes in code order (kern_e2m1_to_f32). */
static const float E2M1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

/* The nearest E2M1 code of a (|a| <= 6 after saturation), ties to the even
 * code: the midpoints between neighbours are exact in f32. */
static unsigned e2m1_code(float a) {
    const unsigned sign = a < 0.0f || (a == 0.0f && signbit(a)) ? 8u : 0u;
    float m = fabsf(a);
    if (!(m < 6.0f)) m = 6.0f; /* also NaN -> 6: a NaN weight has no code */
    unsigned best = 0;
    for (unsigned c = 1; c < 8; c++) {
        const float dc = fabsf(E2M1[c] - m), db = fabsf(E2M1[best] - m);
        if (dc < db || (dc == db && (c & 1u) == 0)) best = c;
    }
    return sign | best;
}

static void mxfp4_block(const float *x, unsigned char *codes, unsigned char *scale) {
    float amax = 0.0f;
    for (int i = 0; i < KERN_BLOCK; i++) amax = fmaxf(amax, fabsf(x[i]));
    int e = -127;
    if (amax > 0.0f && isfinite(amax)) {
        int ex;
        frexpf(amax, &ex);  /* amax = f * 2^ex, f in [0.5, 1): floor(log2) = ex - 1 */
        e = ex - 1 - 2;     /* E2M1's largest value is 1.5 * 2^2 */
        if (e < -127) e = -127;
        if (e > 127) e = 127;
    }
    *scale = (unsigned char)(e + 127);
    const float inv = ldexpf(1.0f, -e);
    for (int i = 0; i < KERN_BLOCK; i += 2) {
        const unsigned lo = e2m1_code(x[i] * inv), hi = e2m1_code(x[i + 1] * inv);
        codes[i / 2] = (unsigned char)(lo | hi << 4);
    }
}

static void q8_0_block(const float *x, signed char *codes, unsigned char *scale) {
    float amax = 0.0f;
    for (int i = 0; i < KERN_BLOCK; i++) amax = fmaxf(amax, fabsf(x[i]));
    const uint16_t h = kern_f32_to_f16(amax > 0.0f ? amax / 127.0f : 1.0f);
    memcpy(scale, &h, sizeof h);
    const float s = kern_f16_to_f32(h);
    for (int i = 0; i < KERN_BLOCK; i++) {
        float q = rintf(x[i] / s);
        q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
        codes[i] = (signed char)q;
    }
}

void kern_quantize_row(kern_dtype dt, const float *x, int cols, void *codes, void *scales) {
    for (int b = 0; b < cols / KERN_BLOCK; b++) {
        const float *xb = x + (size_t)b * KERN_BLOCK;
        if (dt == KERN_MXFP4)
            mxfp4_block(xb, (unsigned char *)codes + (size_t)b * KERN_BLOCK / 2,
                        (unsigned char *)scales + b);
        else if (dt == KERN_Q8_0)
            q8_0_block(xb, (signed char *)codes + (size_t)b * KERN_BLOCK,
                       (unsigned char *)scales + (size_t)b * 2);
    }
}
