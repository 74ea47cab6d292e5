/*
 * kern_simd.h - the vector ISA a CPU kernel file is built for, and the
 * horizontal sums that ops.c's and quant.c's direct paths share (internal
 * to kernels/cpu). One definition of each, so that a block format's
 * product ends its chains exactly as an element format's does.
 *
 * KERN_AVX512: AVX-512F. KERN_AVX2: AVX2 with FMA and F16C, no AVX-512.
 * Neither: the portable loops. Chosen at compile time (-march).
 */
#ifndef KERN_SIMD_H
#define KERN_SIMD_H

#if defined(__AVX512F__)
#include <immintrin.h>
#define KERN_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KERN_AVX2 1
#endif

#if KERN_AVX512 || KERN_AVX2
/* The sum of a's eight lanes: halves, then pairs, then the last two. */
static inline float hsum8(__m256 a) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#endif

#if KERN_AVX512
/* Sum each of eight 16-lane accumulators: [sum(a0), ..., sum(a7)]. One
 * transposing tree (halve to 256 bits, two levels of hadd, one lane swap)
 * instead of eight separate horizontal reductions: with short rows (hidden
 * 256) the per-row reductions cost as much as the dot products. */
static inline __m256 reduce8(const __m512 a[8]) {
    __m256 b[8];
    for (int k = 0; k < 8; k++)
        b[k] = _mm256_add_ps(_mm512_castps512_ps256(a[k]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[k]), 1)));
    __m256 t0 = _mm256_hadd_ps(b[0], b[1]), t1 = _mm256_hadd_ps(b[2], b[3]);
    __m256 t2 = _mm256_hadd_ps(b[4], b[5]), t3 = _mm256_hadd_ps(b[6], b[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#endif /* KERN_SIMD_H */
