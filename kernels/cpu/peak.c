/*
 * peak.c - the multiply-add peak loops (contract in kern.h): 24
 * independent chains of register-only multiply-adds, the most a core's
 * FMA pipes retire. What a product bound by arithmetic (a prefill's GEMM,
 * a batched decode step's) is judged against, as decode is against a
 * plain streaming read (kern_read_sum). 24 chains: more than the FMAs in
 * flight on any core we run on (two pipes x four cycles of latency), so
 * the loop is bound by the pipes, not by a chain's latency.
 */
#include <string.h>

#include "kern.h"
#include "kern_simd.h"

#if KERN_AVX512
typedef __m512 peak_vec;
#define PEAK_LANES 16
#define peak_set1 _mm512_set1_ps
#define peak_fmadd _mm512_fmadd_ps
#elif KERN_AVX2
typedef __m256 peak_vec;
#define PEAK_LANES 8
#define peak_set1 _mm256_set1_ps
#define peak_fmadd _mm256_fmadd_ps
#else
#define PEAK_LANES 0
#endif

#define PEAK_CHAINS(M)                                                                             \
    M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15) M(16)   \
        M(17) M(18) M(19) M(20) M(21) M(22) M(23)
#define PEAK_N_CHAINS 24

int kern_madd_per_round(bool bf16) {
#if KERN_AVX512 && defined(__AVX512BF16__)
    if (bf16) return PEAK_N_CHAINS * 2 * PEAK_LANES; /* a pair of products a lane */
#endif
    return bf16 ? 0 : PEAK_N_CHAINS * PEAK_LANES;
}

#if KERN_AVX512 && defined(__AVX512BF16__)
#define PEAK_DP_DECL(i) __m512 d##i = _mm512_set1_ps(0.001f * (i));
#define PEAK_DP(i) d##i = _mm512_dpbf16_ps(d##i, mb, cb);
#define PEAK_DP_ADD(i) memcpy(lanes, &d##i, sizeof lanes), s += lanes[0];
static float dp_chains(long iters) {
    PEAK_CHAINS(PEAK_DP_DECL)
    /* 1.0 and about 1e-6 in bf16: the sums stay finite however long */
    const __m512bh mb = (__m512bh)_mm512_set1_epi16(0x3f80);
    const __m512bh cb = (__m512bh)_mm512_set1_epi16(0x3580);
    for (long n = 0; n < iters; n++) {
        PEAK_CHAINS(PEAK_DP)
    }
    float s = 0, lanes[16];
    PEAK_CHAINS(PEAK_DP_ADD)
    return s;
}
#endif

#if PEAK_LANES
#define PEAK_DECL(i) peak_vec a##i = peak_set1(0.001f * (i));
#define PEAK_FMA(i) a##i = peak_fmadd(a##i, m, c);
#define PEAK_ADD(i) memcpy(lanes, &a##i, sizeof lanes), s += lanes[0];
static float fma_chains(long iters) {
    PEAK_CHAINS(PEAK_DECL)
    /* a * 0.9999 + 1e-6 tends to 0.01: finite however long */
    const peak_vec m = peak_set1(0.9999f), c = peak_set1(1e-6f);
    for (long n = 0; n < iters; n++) {
        PEAK_CHAINS(PEAK_FMA)
    }
    float s = 0, lanes[PEAK_LANES];
    PEAK_CHAINS(PEAK_ADD)
    return s;
}
#endif

float kern_madd_chains(bool bf16, long iters) {
#if KERN_AVX512 && defined(__AVX512BF16__)
    if (bf16) return dp_chains(iters);
#endif
#if PEAK_LANES
    if (!bf16) return fma_chains(iters);
#endif
    (void)iters;
    return 0.0f;
}
