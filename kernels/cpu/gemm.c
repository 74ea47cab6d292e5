/*
 * gemm.c - the prefill product's register-blocked micro-kernel (contract
 * in kern_gemm.h).
 */
#include "kern_gemm.h"

#include <stddef.h>

#if defined(__AVX512F__)
#include <immintrin.h>

/* Tokens per step: 12 x 2 accumulators of 16 lanes, plus two weight
 * vectors and the broadcasts: 28 of the 32 registers. */
#define PANEL_TOKENS 12

/* y[t, i] (+)= sum_c x[t, c] P[c, i] for t < mt (1..12), i < nr: per
 * column c, one broadcast of x[t, c] times the panel's 32 values, into 2
 * accumulators per token. mt is a constant at each call (the switch in
 * kern__panel_gemm), so the loops unroll and the accumulators stay in
 * registers; the tokens' rows are read through one moving pointer per 4
 * tokens (rows t, t + 1, t + 2, t + 3 at offsets 0, ldx, 2 ldx, 3 ldx). */
static inline __attribute__((always_inline)) void
panel_tokens(const float *P, int kc, const float *x, int ldx, const int mt, float *y, int ldy,
             int nr, bool accumulate) {
    __m512 acc[PANEL_TOKENS][2];
    const float *xb[PANEL_TOKENS / 4];
    const int ng = (mt + 3) / 4;
    const size_t s1 = (size_t)ldx, s3 = 3 * (size_t)ldx;
    const __mmask16 m0 = nr >= 16 ? 0xffff : (__mmask16)((1u << nr) - 1);
    const __mmask16 m1 = nr >= 32 ? 0xffff : nr > 16 ? (__mmask16)((1u << (nr - 16)) - 1) : 0;
    for (int g = 0; g < ng; g++)
        xb[g] = x + (size_t)4 * g * ldx;
    for (int t = 0; t < mt; t++) {
        if (accumulate) {
            acc[t][0] = _mm512_maskz_loadu_ps(m0, y + (size_t)t * ldy);
            acc[t][1] = _mm512_maskz_loadu_ps(m1, y + (size_t)t * ldy + 16);
        } else {
            acc[t][0] = acc[t][1] = _mm512_setzero_ps();
        }
    }
    for (int c = 0; c < kc; c++, P += KERN_PANEL_ROWS) {
        const __m512 w0 = _mm512_loadu_ps(P), w1 = _mm512_loadu_ps(P + 16);
        for (int g = 0; g < ng; g++) {
            const float *p = xb[g]++;
            const int t = 4 * g;
            /* the tokens of this group: 4, or mt % 4 in the last */
            const __m512 b0 = _mm512_set1_ps(p[0]);
            acc[t][0] = _mm512_fmadd_ps(w0, b0, acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(w1, b0, acc[t][1]);
            if (t + 1 < mt) {
                const __m512 b1 = _mm512_set1_ps(p[s1]);
                acc[t + 1][0] = _mm512_fmadd_ps(w0, b1, acc[t + 1][0]);
                acc[t + 1][1] = _mm512_fmadd_ps(w1, b1, acc[t + 1][1]);
            }
            if (t + 2 < mt) {
                const __m512 b2 = _mm512_set1_ps(p[2 * s1]);
                acc[t + 2][0] = _mm512_fmadd_ps(w0, b2, acc[t + 2][0]);
                acc[t + 2][1] = _mm512_fmadd_ps(w1, b2, acc[t + 2][1]);
            }
            if (t + 3 < mt) {
                const __m512 b3 = _mm512_set1_ps(p[s3]);
                acc[t + 3][0] = _mm512_fmadd_ps(w0, b3, acc[t + 3][0]);
                acc[t + 3][1] = _mm512_fmadd_ps(w1, b3, acc[t + 3][1]);
            }
        }
    }
    for (int t = 0; t < mt; t++) {
        _mm512_mask_storeu_ps(y + (size_t)t * ldy, m0, acc[t][0]);
        _mm512_mask_storeu_ps(y + (size_t)t * ldy + 16, m1, acc[t][1]);
    }
}

/* One function per step size, so that each is compiled with its own
 * constant mt. */
#define PANEL_STEP(n)                                                                              \
    static void panel_tokens##n(const float *P, int kc, const float *x, int ldx, float *y,        \
                                int ldy, int nr, bool accumulate) {                               \
        panel_tokens(P, kc, x, ldx, n, y, ldy, nr, accumulate);                                   \
    }
PANEL_STEP(1)
PANEL_STEP(2)
PANEL_STEP(3)
PANEL_STEP(4)
PANEL_STEP(5)
PANEL_STEP(6)
PANEL_STEP(7)
PANEL_STEP(8)
PANEL_STEP(9)
PANEL_STEP(10)
PANEL_STEP(11)
PANEL_STEP(12)

typedef void (*panel_step_fn)(const float *, int, const float *, int, float *, int, int, bool);

void kern__panel_gemm(const float *P, int kc, const float *x, int ldx, int T, float *y, int ldy,
                      int nr, bool accumulate) {
    static const panel_step_fn step[PANEL_TOKENS + 1] = {
        NULL,           panel_tokens1, panel_tokens2,  panel_tokens3,  panel_tokens4,
        panel_tokens5,  panel_tokens6, panel_tokens7,  panel_tokens8,  panel_tokens9,
        panel_tokens10, panel_tokens11, panel_tokens12};
    for (int t0 = 0; t0 < T; t0 += PANEL_TOKENS) {
        const int mt = T - t0 < PANEL_TOKENS ? T - t0 : PANEL_TOKENS;
        step[mt](P, kc, x + (size_t)t0 * ldx, ldx, y + (size_t)t0 * ldy, ldy, nr, accumulate);
    }
}
#endif
