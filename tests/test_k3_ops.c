/*
 * The CPU references of Kimi K3's new operators (kern.h, kernels/cpu/k3.c)
 * against their definitions in reference/kimi-k3.md written out here in
 * double: SiTU (§4.6) with its two soft caps, the sigmoid output gate
 * (§4.4), and Block Attention Residuals' mix (§4.2) over snapshots and the
 * partial, with the edge cases the engine relies on (one candidate is
 * returned as it is; a zero query averages).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kern.h"
#include "cpu/kern_math.h"

static uint64_t next(uint64_t *x) {
    *x ^= *x << 13, *x ^= *x >> 7, *x ^= *x << 17;
    return *x;
}

static float unit(uint64_t *x) { return (float)((next(x) >> 11) * 0x1.0p-53) * 2.0f - 1.0f; }

static double sig(double x) { return 1.0 / (1.0 + exp(-x)); }

/* ulps between two floats of the same sign (or both zero). */
static double ulps(float a, float b) {
    if (a == b) return 0;
    int32_t ia, ib;
    memcpy(&ia, &a, 4);
    memcpy(&ib, &b, 4);
    if ((ia < 0) != (ib < 0)) return 1e9;
    return fabs((double)ia - (double)ib);
}

/* vtanh (kern_math.h), SiTU's tanh: within 3 ulp of tanh in double,
 * rounded to float, over one float in 61 from 2^-30 to 16 (every exponent,
 * mantissas all over; beyond 16 tanh is 1 in float) and their negatives;
 * saturates and keeps NaN. */
Test(k3_ops, vtanh_within_3_ulp) {
    double worst = 0;
    float at = 0;
    for (float x = 0x1p-30f; x < 16.0f;) {
        uint32_t bits;
        memcpy(&bits, &x, 4);
        bits += 61;
        memcpy(&x, &bits, 4);
        for (int sign = 0; sign < 2; sign++) {
            const float v = sign ? -x : x, want = (float)tanh((double)v);
            const double e = ulps(vtanh(v), want);
            if (e > worst) worst = e, at = v;
        }
    }
    cr_log_info("vtanh: worst %.0f ulp at %a", worst, (double)at);
    cr_expect(worst <= 3, "vtanh is %.0f ulp from tanh at %a", worst, (double)at);
    cr_expect_eq(vtanh(0.0f), 0.0f);
    cr_expect_eq(vtanh(100.0f), 1.0f);
    cr_expect_eq(vtanh(-1e30f), -1.0f);
    cr_expect(isnan(vtanh(NAN)));
}

Test(k3_ops, situ_matches_its_definition) {
    enum { N = 4096 };
    static float a[N], b[N], g[N], u[N];
    uint64_t s = 7;
    for (int i = 0; i < N; i++) {
        g[i] = a[i] = unit(&s) * 60.0f; /* past both caps */
        u[i] = b[i] = unit(&s) * 80.0f;
    }
    kern_situ(a, b, N, 4.0f, 25.0f);
    double worst = 0;
    for (int i = 0; i < N; i++) {
        const double want = (4.0 * tanh(g[i] / 4.0) * sig(g[i])) * (25.0 * tanh(u[i] / 25.0));
        const double e = fabs(a[i] - want) / fmax(1.0, fabs(want));
        worst = fmax(worst, e);
    }
    cr_log_info("situ: worst relative error %.2e", worst);
    cr_expect(worst < 1e-5, "situ differs from its definition by %g", worst);
    /* the caps: gate -> beta, up -> +-beta_l; small inputs are silu(g) * u */
    float big[3] = {1000.0f, 1e-3f, -1000.0f}, ub[3] = {1000.0f, 1e-3f, -1000.0f};
    kern_situ(big, ub, 3, 4.0f, 25.0f);
    cr_expect(fabsf(big[0] - 100.0f) < 1e-3f, "saturated: %g, want 4 * 25", (double)big[0]);
    cr_expect(fabsf(big[1] - 1e-3f * (float)sig(1e-3) * 1e-3f) < 1e-9f, "small: %g", (double)big[1]);
    cr_expect(fabsf(big[2]) < 1e-6f, "very negative gate closes: %g", (double)big[2]);
}

Test(k3_ops, sigmoid_mul_matches_its_definition) {
    float x[64], g[64], x0[64];
    uint64_t s = 9;
    for (int i = 0; i < 64; i++) {
        x0[i] = x[i] = unit(&s) * 3;
        g[i] = unit(&s) * 20;
    }
    kern_sigmoid_mul(x, g, 64);
    for (int i = 0; i < 64; i++)
        cr_expect(fabs(x[i] - x0[i] * sig(g[i])) < 1e-6 * fmax(1.0, fabs(x0[i])), "element %d", i);
}

/* The mix in double, as §4.2 writes it. */
static void mix_ref(int T, int D, const float *blocks, size_t stride, int nb, const float *partial,
                    const float *u, double eps, double *out) {
    const int n = nb + (partial != NULL);
    for (int t = 0; t < T; t++) {
        double z[16], m = -INFINITY, sum = 0;
        for (int j = 0; j < n; j++) {
            const float *c = j < nb ? blocks + j * stride + (size_t)t * D : partial + (size_t)t * D;
            double ss = 0, dot = 0;
            for (int d = 0; d < D; d++) ss += (double)c[d] * c[d];
            const double rms = sqrt(ss / D + eps);
            for (int d = 0; d < D; d++) dot += (c[d] / rms) * u[d];
            z[j] = dot;
            m = fmax(m, dot);
        }
        for (int j = 0; j < n; j++) sum += exp(z[j] - m);
        for (int d = 0; d < D; d++) {
            double v = 0;
            for (int j = 0; j < n; j++) {
                const float *c = j < nb ? blocks + j * stride + (size_t)t * D : partial + (size_t)t * D;
                v += exp(z[j] - m) / sum * c[d];
            }
            out[(size_t)t * D + d] = v;
        }
    }
}

Test(k3_ops, attn_res_mix_matches_its_definition) {
    enum { T = 5, D = 96, MAXB = 8, STRIDE = 7 * 96 }; /* snapshots padded apart: a stride > T*D */
    static float blocks[MAXB * STRIDE], partial[T * D], u[D], out[T * D];
    static double want[T * D];
    uint64_t s = 11;
    for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++) blocks[i] = unit(&s) * (1 + i % 5);
    for (int i = 0; i < T * D; i++) partial[i] = unit(&s) * 2;
    for (int i = 0; i < D; i++) u[i] = unit(&s) * 0.5f;
    double worst = 0;
    for (int nb = 0; nb <= MAXB; nb++)
        for (int with_p = 0; with_p < 2; with_p++) {
            if (nb == 0 && !with_p) continue;
            const float *p = with_p ? partial : NULL;
            kern_attn_res_mix(T, D, blocks, STRIDE, nb, p, u, 1e-5f, out);
            mix_ref(T, D, blocks, STRIDE, nb, p, u, 1e-5, want);
            for (int i = 0; i < T * D; i++) {
                const double e = fabs(out[i] - want[i]) / fmax(1.0, fabs(want[i]));
                worst = fmax(worst, e);
                cr_assert(e < 1e-5, "%d snapshots%s, element %d: %g, want %g", nb,
                          with_p ? " + partial" : "", i, (double)out[i], want[i]);
            }
        }
    cr_log_info("attn_res_mix: worst relative error %.2e over 0..8 snapshots", worst);
}

/* One candidate comes back as it is; a zero query weighs all equally. */
Test(k3_ops, attn_res_mix_edges) {
    enum { D = 32 };
    float b[3 * D], out[D], zero[D] = {0}, u[D];
    uint64_t s = 5;
    for (int i = 0; i < 3 * D; i++) b[i] = unit(&s) * 4;
    for (int i = 0; i < D; i++) u[i] = unit(&s);
    kern_attn_res_mix(1, D, NULL, 0, 0, b, u, 1e-5f, out);
    for (int d = 0; d < D; d++) cr_expect_eq(out[d], b[d], "a lone partial is the input itself");
    kern_attn_res_mix(1, D, b, D, 3, NULL, zero, 1e-5f, out);
    for (int d = 0; d < D; d++) {
        const double mean = ((double)b[d] + b[D + d] + b[2 * D + d]) / 3;
        cr_expect(fabs(out[d] - mean) < 1e-6, "zero query: the mean (%g, want %g)", (double)out[d], mean);
    }
}
