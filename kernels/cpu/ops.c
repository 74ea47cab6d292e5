/*
 * ops.c - CPU reference kernels: dtype conversion, dense products, norms and
 * activations (contracts in kernels/kern.h).
 *
 * Dense products have two paths. Decode-sized batches (few tokens) are
 * memory-bound: they stream each weight row once from the mmap in its stored
 * dtype and dot it with every token, 16 lanes at a time. Prefill-sized
 * batches are compute-bound: panels of rows of W are unpacked to float32
 * in the caller's scratch, transposed, and run through the register-blocked
 * kernel of kern_gemm.h (12 tokens x 32 rows of sums per step with
 * AVX-512, 6 x 16 with AVX2); without either, row blocks are widened and
 * handed to BLAS (sgemm). The SIMD paths are chosen at compile time
 * (-march=native); the scalar loops are the portable fallback and the
 * readable specification.
 */
#include "kern.h"
#include "kern_gemm.h"
#include "kern_math.h"
#include "kern_simd.h"

#include <cblas.h>
#include <math.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

bool kern_bf16_products(void) {
#if KERN_AVX512 && defined(__AVX512BF16__)
    return true;
#else
    return false;
#endif
}

bool kern_bf16_tiles(void) { return kern__gemm_amx(); }

/* How far ahead the one-token product of a streamed matrix prefetches
 * along its one stream (rows8_one_stream) where the CPU is not a Zen 4:
 * 8 KiB. Decode of `wide` on a Zen 5 (rows on the lines), tok/s, two runs
 * each: one thread 2 KiB 15.5-16.0, 4 KiB 16.8-17.9, 6-10 KiB 18.2-18.9,
 * 16 KiB 17.2-17.4; two threads, three runs, 4 KiB 24.4-26.0, 8 KiB
 * 26.0-26.5, 12 KiB 25.8-30.1. */
#define DOT_T1_PF_AHEAD 8192

/* The CPU's family if it is AMD's (CPUID), else 0: the prefetch hints
 * below depend on it. */
static unsigned amd_family(void) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    /* vendor "AuthenticAMD" (ebx "Auth"), family = base 0xf + extended */
    if (__get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && __get_cpuid(1, &a, &b, &c, &d)) {
        const unsigned base = (a >> 8) & 0xfu;
        return base == 0xfu ? base + ((a >> 20) & 0xffu) : base;
    }
#endif
    return 0;
}

int kern_stream_prefetch_bytes(void) { return amd_family() == 0x19u ? 0 : DOT_T1_PF_AHEAD; }

/* In order on AMD family 19h (a Zen 4; its Zen 3 parts have no AVX-512,
 * where the hint is unused); each row's lines ahead elsewhere: an Intel
 * Xeon, and a Zen 5 (family 1Ah), where 4 to 8 tokens of [4096, 2304]
 * from memory read 1.1-1.7x faster that way (docs/benchmarks.md, "A
 * Zen 5 at today's head"). */
bool kern_prefetch_rows_ahead(void) { return amd_family() != 0x19u; }

size_t kern_dtype_size(kern_dtype dt) {
    switch (dt) {
    case KERN_F32: return 4;
    case KERN_BF16:
    case KERN_F16: return 2;
    case KERN_MXFP4:
    case KERN_Q8_0: break;
    }
    return 0;
}

float kern_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t kern_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                         /* round to nearest even */
    return (uint16_t)(u >> 16);
}

float kern_gen_normal(uint64_t stream, uint64_t i, float sd) {
    uint64_t z = stream + (i + 1) * 0x9e3779b97f4a7c15ull; /* splitmix64, counter form */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    /* Irwin-Hall: four 16-bit uniforms, mean 2, variance 1/3 */
    double s = (double)(z & 0xffff) + (double)((z >> 16) & 0xffff) + (double)((z >> 32) & 0xffff) +
               (double)(z >> 48);
    return (float)((s * (1.0 / 65536.0) - 2.0) * 1.7320508075688772 * (double)sd);
}

float kern_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: renormalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t kern_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t sign = (u >> 16) & 0x8000u;
    int32_t exp = (int32_t)((u >> 23) & 0xff) - 127 + 15;
    uint32_t man = u & 0x7fffffu;
    if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00u | (man ? 0x200u : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00u);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t half = 1u << (shift - 1);
        uint32_t r = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = (uint32_t)exp << 10 | (man >> 13);
    uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return (uint16_t)(sign | r);
}

void kern_to_f32(kern_dtype dt, const void *src, float *dst, size_t n) {
    size_t i = 0;
    if (dt == KERN_F32) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    const uint16_t *s = src;
    if (dt == KERN_BF16) {
#if KERN_AVX512
        for (; i + 16 <= n; i += 16) {
            __m256i h = _mm256_loadu_si256((const __m256i *)(s + i));
            __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
            _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(w));
        }
#endif
        for (; i < n; i++) dst[i] = kern_bf16_to_f32(s[i]);
    } else {
#if KERN_AVX512
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i,
                             _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i))));
#endif
        for (; i < n; i++) dst[i] = kern_f16_to_f32(s[i]);
    }
}

uint64_t kern_read_sum(const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t sum = 0;
    size_t i = 0;
#if KERN_AVX512
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 256 <= n; i += 256) {
        a0 = _mm512_add_epi64(a0, _mm512_load_si512((const void *)(b + i)));
        a1 = _mm512_add_epi64(a1, _mm512_load_si512((const void *)(b + i + 64)));
        a2 = _mm512_add_epi64(a2, _mm512_load_si512((const void *)(b + i + 128)));
        a3 = _mm512_add_epi64(a3, _mm512_load_si512((const void *)(b + i + 192)));
    }
    a0 = _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3));
    sum = (uint64_t)_mm512_reduce_add_epi64(a0);
#endif
    uint64_t s[4] = {0, 0, 0, 0};
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++) {
            uint64_t w;
            memcpy(&w, b + i + 8 * k, sizeof w);
            s[k] += w;
        }
    sum += s[0] + s[1] + s[2] + s[3];
    for (; i < n; i++) sum += b[i];
    return sum;
}

/* ------------------------------------------------------------------------ */
/* Dot products of one weight row with up to DOT_TOKENS activation rows.     */

#define DOT_TOKENS 4

#if KERN_AVX512
static inline __m512 load16(kern_dtype dt, const void *row, int i) {
    if (dt == KERN_F32) return _mm512_loadu_ps((const float *)row + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i));
    if (dt == KERN_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
#endif

static inline float load1(kern_dtype dt, const void *row, int i) {
    if (dt == KERN_F32) return ((const float *)row)[i];
    if (dt == KERN_BF16) return kern_bf16_to_f32(((const uint16_t *)row)[i]);
    return kern_f16_to_f32(((const uint16_t *)row)[i]);
}

#if KERN_AVX2
static inline __m256 load8(kern_dtype dt, const void *row, int i) {
    const uint16_t *h = (const uint16_t *)row + i;
    if (dt == KERN_F32) return _mm256_loadu_ps((const float *)row + i);
    if (dt == KERN_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}
#endif

/* out[t] = row . x[t*ldx ...] for t < nt (nt <= DOT_TOKENS). */
static void dot_row(kern_dtype dt, const void *row, int in, const float *x, int ldx, int nt,
                    float *out) {
    int i = 0;
    float acc[DOT_TOKENS] = {0};
#if KERN_AVX512
    __m512 a[DOT_TOKENS];
    for (int t = 0; t < DOT_TOKENS; t++) a[t] = _mm512_setzero_ps();
    for (; i + 16 <= in; i += 16) {
        __m512 w = load16(dt, row, i);
        for (int t = 0; t < nt; t++) a[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + (size_t)t * ldx + i), a[t]);
    }
    for (int t = 0; t < nt; t++) acc[t] = _mm512_reduce_add_ps(a[t]);
#elif KERN_AVX2
    /* AVX2 + FMA + F16C (a CPU without AVX-512 built for itself): eight
     * lanes; each token's chain is the same whatever nt, and dot8_avx2's */
    __m256 a[DOT_TOKENS];
    for (int t = 0; t < DOT_TOKENS; t++) a[t] = _mm256_setzero_ps();
    for (; i + 8 <= in; i += 8) {
        const __m256 w = load8(dt, row, i);
        for (int t = 0; t < nt; t++)
            a[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (size_t)t * ldx + i), a[t]);
    }
    for (int t = 0; t < nt; t++) acc[t] = hsum8(a[t]);
#endif
    for (; i < in; i++) {
        float w = load1(dt, row, i);
        for (int t = 0; t < nt; t++) acc[t] += w * x[(size_t)t * ldx + i];
    }
    for (int t = 0; t < nt; t++) out[t] = acc[t];
}

/* The one-token loops of a matrix from memory (AVX-512 bf16: dot8_bf16;
 * AVX2: dot8_avx2_body) take rows shorter than this many bytes in eight
 * (AVX-512) or four (AVX2) sequential streams, each prefetched
 * DOT_SPREAD_PF bytes ahead along itself: rows side by side are then
 * short pieces of one block and a jump, and AVX-512's one row at a time
 * (rows8_one_stream) waits on its one chain of FMAs (a 512-byte row is 16 FMAs in a row).
 * 4 KiB: wide's and full27's [1024, 2304] up projections (4.5 KiB rows)
 * read faster side by side on a Zen 3 (from memory, one thread: 20.0
 * GB/s side by side, 17.8 spread); llamacpp-tiny's [50304, 256] lm_head
 * (25.8 of the 31.8 MB a token reads) and the [2304, 1024] down
 * projections are spread (docs/benchmarks.md, "Side by side at today's
 * head" and "A Zen 4 with AVX-512, side by side, and short rows").
 * AVX-512 spreads only rows under 1 KiB when W is on the lines
 * (DOT_IN_ORDER_FROM); longer ones go in order there. */
#define DOT_SPREAD_BELOW 4096
#define DOT_SPREAD_PF 4096

/* AVX-512's one-token loop of a matrix from memory, by row length in
 * bytes: rows of 4 to 6 KiB are read one after another
 * (rows8_one_stream), rows of 1 to 4 KiB and over 6 KiB eight side by
 * side with the next eight prefetched into L2 in the order they lie
 * (rows8_bf16_t1's next_in_order), shorter rows spread (DOT_SPREAD_PF).
 * Memory sees one stream in the first two. One chain of FMAs a row reads
 * at most 42 GB/s on a Zen 4 thread from L2 at 2304 columns, 35 at
 * 4096 and 30 at 9216, where x (4 bytes a column, split) no longer
 * stays in L1 beside the row, so two threads fell short of memory in its
 * fast minutes; eight chains from L2 do not. From memory, two threads,
 * the two loops alternating (docs/benchmarks.md, "Rows side by side,
 * fetched in order"): [2304, 9216] 25 -> 52 GB/s, [2304, 4096] 48 ->
 * 54, [2304, 1024] 39 -> 47, [16384, 512] 38 -> 42; [4096, 2304] 57
 * against 53 and [50304, 256] 38 against 36 keep their loops. */
#define DOT_ONE_STREAM_FROM 4096
#define DOT_ONE_STREAM_TO 6144
#define DOT_IN_ORDER_FROM 1024

#if KERN_AVX512
/* Columns per block when more than three tokens share eight rows: the
 * rows' block (8 KiB) and the tokens' (up to 63 x 2 KiB) stay in L1 / L2
 * while every group of three runs over them. */
#define DOT_COL_BLOCK 512

/* Up to this many tokens, eight rows on the lines are read with the
 * next eight prefetched into L2 in the order they lie (rows8_tokens), as
 * one token's long rows (DOT_ONE_STREAM_FROM): memory sees one stream
 * instead of eight. [4096, 2304] from memory, two threads, alternating
 * with the earlier prefetches (docs/benchmarks.md, "Rows side by side,
 * fetched in order"): exact 2, 3, 4, 8 tokens 34 -> 45, 34 -> 48,
 * 29 -> 42, 21 -> 23 GB/s; [2304, 1024] for 2 tokens 28 -> 45; under
 * --bf16, 4 to 8 tokens +16-17%. From 12 tokens on the products are
 * bound by arithmetic, and 16 under --bf16 lost 9% (18.4 -> 16.6). Not
 * where kern_weight's prefetch_rows_ahead says the CPU does better
 * without (an Intel Xeon: 15-30% slower in order; a Zen 5, up to
 * 40%). */
#define DOT_IN_ORDER_MAX_T 8

/* The in-order prefetch of the loops below: of the next eight rows
 * (next: their start, row stride in, so 16 in bytes), the 512 bytes that
 * follow what columns [i, i + 32) of eight rows take, into L2: eight
 * lines in the order they lie, so that memory sees one stream while the
 * eight rows here are read side by side (DOT_ONE_STREAM_FROM). */
static inline __attribute__((always_inline)) void prefetch_next8(const char *next, int i) {
    const char *nx = next + (size_t)(i / 32) * 512;
    for (int k = 0; k < 8; k++) _mm_prefetch(nx + 64 * k, _MM_HINT_T1);
}

/* One step of 32 columns of the loops below: row[k] (k in [0, 8)) the
 * eight rows' 32 bf16 values, xp token 0's x at those columns (token j at
 * xp + j * xs bytes), into the running sums a[j][k]. bf16x: x rounded to
 * bf16, one vdpbf16ps per (row, token); else x f32 split even/odd
 * (dot8_bf16's xd), the row widened by shift and mask, two FMAs. */
static inline __attribute__((always_inline)) void
rows8_step32(const char *const row[8], const char *xp, size_t xs, const int nt, __m512 (*a)[8],
             const bool bf16x) {
#if defined(__AVX512BF16__)
    if (bf16x) {
        __m512bh xv[3];
        for (int j = 0; j < nt; j++)
            xv[j] = (__m512bh)_mm512_loadu_si512((const void *)(xp + (size_t)j * xs));
        for (int k = 0; k < 8; k++) {
            const __m512bh v = (__m512bh)_mm512_loadu_si512((const void *)row[k]);
            for (int j = 0; j < nt; j++) a[j][k] = _mm512_dpbf16_ps(a[j][k], v, xv[j]);
        }
        return;
    }
#endif
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
    __m512 xe[3], xo[3];
    for (int j = 0; j < nt; j++) {
        xe[j] = _mm512_loadu_ps((const float *)(xp + (size_t)j * xs));
        xo[j] = _mm512_loadu_ps((const float *)(xp + (size_t)j * xs) + 16);
    }
    for (int k = 0; k < 8; k++) {
        const __m512i v = _mm512_loadu_si512((const void *)row[k]);
        const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
        for (int j = 0; j < nt; j++) {
            a[j][k] = _mm512_fmadd_ps(ve, xe[j], a[j][k]);
            a[j][k] = _mm512_fmadd_ps(vo, xo[j], a[j][k]);
        }
    }
}

/* Rows w[0..8) (row stride in), columns [i0, i1), dotted with nt (1..3,
 * a constant at each call) tokens xv0 [nt, in], continuing the 8 x nt
 * running sums acc[t][k] (16 lanes each; zero before the first columns):
 * per 32 columns, each of the eight rows' vectors feeds the nt tokens'
 * products, the eight rows read as eight streams. bf16x (a constant at
 * each call): xv0 is x rounded to bf16 in column order and each product
 * is one vdpbf16ps (a pair of columns a lane: kern_matmul_w_bf16act);
 * else xv0 is f32 split even/odd as dot8_bf16's xd, each product two
 * FMAs on the widened row. pf > 0: rows [pk0, pk1) are prefetched pf
 * elements ahead of column i (pf_wrap: past the row's end, into the same
 * row of the next eight; then pf <= in). Rows read in order take
 * rows8_cols_in_order instead. */
static inline __attribute__((always_inline)) void
rows8_cols(const uint16_t *w, int in, const void *xv0, const int nt, int i0, int i1, int pf,
           bool pf_wrap, int pk0, int pk1, __m512 (*acc)[8], const bool bf16x) {
    const size_t xsz = bf16x ? sizeof(uint16_t) : sizeof(float);
    __m512 a[3][8];
    for (int j = 0; j < nt; j++)
        for (int k = 0; k < 8; k++) a[j][k] = acc[j][k];
    for (int i = i0; i < i1; i += 32) {
        if (pf > 0) {
            size_t off = (size_t)i + (size_t)pf;
            if (pf_wrap && off >= (size_t)in) off += (size_t)7 * in; /* the next eight rows */
            for (int k = pk0; k < pk1; k++)
                _mm_prefetch((const char *)(w + (size_t)k * in + off), _MM_HINT_T0);
        }
        const char *row[8];
        for (int k = 0; k < 8; k++) row[k] = (const char *)(w + (size_t)k * in + i);
        rows8_step32(row, (const char *)xv0 + (size_t)i * xsz, (size_t)in * xsz, nt, a, bf16x);
    }
    for (int j = 0; j < nt; j++)
        for (int k = 0; k < 8; k++) acc[j][k] = a[j][k];
}

/* What rows8_cols_in_order prefetches of the next eight rows at each 32
 * columns: nothing, all eight lines (prefetch_next8), or four of them,
 * lines pk0, pk0 + 1, pk1 - 2 and pk1 - 1 (a group's share, pk1 - pk0 in
 * 2..4, when two or three groups deal the eight out). */
enum { NEXT8_NONE, NEXT8_ALL, NEXT8_SHARE };

/* rows8_cols for rows on the lines read in order (rows8_tokens'
 * in_order), with the same products in the same order, so the same sums
 * bit for bit, written so that the loop needs few general registers:
 * rows 0-3 and 4-7 are two pointers plus the row stride (1, 2 and 3
 * times), the nt tokens' x one pointer plus the token stride. rows8_cols'
 * general loop holds eight row pointers, three x pointers and its
 * prefetch's state, and GCC 12 ran out of registers there: it reloaded
 * row pointers from the stack on every pass and sent rows' vectors
 * through the stack (docs/benchmarks.md, "Fewer registers for the
 * batched products"). next_mode a constant at each call; the next
 * eight rows follow w's. */
static inline __attribute__((always_inline)) void
rows8_cols_in_order(const uint16_t *w, int in, const void *xv0, const int nt, int i0, int i1,
                    __m512 (*acc)[8], const bool bf16x, const int next_mode, int pk0, int pk1) {
    const size_t rs = (size_t)in * sizeof(uint16_t), rs3 = 3 * rs;
    const size_t xsz = bf16x ? sizeof(uint16_t) : sizeof(float), xs = (size_t)in * xsz;
    const char *p = (const char *)(w + i0), *q = p + 4 * rs;
    const char *xp = (const char *)xv0 + (size_t)i0 * xsz;
    /* prefetch_next8's lines for column i0 of the next eight rows: 512
     * bytes each 32 columns */
    const char *nx = (const char *)(w + (size_t)8 * in) + (size_t)(i0 / 32) * 512 +
                     64 * (next_mode == NEXT8_SHARE ? pk0 : 0);
    const size_t nd = next_mode == NEXT8_SHARE ? (size_t)64 * (pk1 - 2 - pk0) : 0;
    __m512 a[3][8];
    for (int j = 0; j < nt; j++)
        for (int k = 0; k < 8; k++) a[j][k] = acc[j][k];
    for (int n = (i1 - i0) / 32; n > 0; n--) {
        if (next_mode == NEXT8_ALL) {
            for (int k = 0; k < 8; k++) _mm_prefetch(nx + 64 * k, _MM_HINT_T1);
        } else if (next_mode == NEXT8_SHARE) {
            _mm_prefetch(nx, _MM_HINT_T1);
            _mm_prefetch(nx + 64, _MM_HINT_T1);
            _mm_prefetch(nx + nd, _MM_HINT_T1);
            _mm_prefetch(nx + nd + 64, _MM_HINT_T1);
        }
        const char *row[8] = {p, p + rs, p + 2 * rs, p + rs3, q, q + rs, q + 2 * rs, q + rs3};
        rows8_step32(row, xp, xs, nt, a, bf16x);
        p += 64;
        q += 64;
        xp += 32 * xsz;
        nx += 512;
    }
    for (int j = 0; j < nt; j++)
        for (int k = 0; k < 8; k++) acc[j][k] = a[j][k];
}

/* Rows w[0..8) (row stride in, a multiple of 32; w 4-byte aligned) dotted
 * with one token xd [in] (split even/odd as dot8_bf16's), into out[k] (16
 * lanes each, for reduce8), reading the eight rows one after another: the
 * matrix is then one stream from start to end, prefetched pf bytes ahead
 * along it (0: by the hardware prefetcher alone; kern_weight's
 * stream_prefetch). For a matrix from memory this beats eight rows side
 * by side (rows8_bf16_t1): on a Zen 5, one token read at 91-100% of a
 * plain streaming read measured beside it against 72-79% (1 GiB of
 * [4096, 2304] bf16 matrices, one and two threads, medians of 15
 * alternations; two or four rows side by side 80-84%); in the engine on
 * `wide`, one thread, a routed expert's [1024, 2304] product went from
 * 198 to 178 us and the lm_head's from 30.5 to 28 ms. On a Zen 4 without
 * the software prefetch, 101-104% (docs/benchmarks.md, "No software
 * prefetch on a Zen 4"). But one row's chain of FMAs at a time is bound
 * by the FMAs' latency: from cache one token reads 35-42 GB/s against
 * 50-65 side by side, so a model that stays in cache keeps the other
 * loop (kern_weight's `streamed`). Two and three tokens keep it too: each
 * row here would read their x again, 18-28 KiB that crowd L1 beside the
 * stream (from memory at 57-63% and 37-42% of the read against 70-75%
 * side by side, one thread). Each row's sum is the same chain of FMAs as
 * there, so the results are the same, bit for bit. */
static inline __attribute__((always_inline)) void
rows8_one_stream(const uint16_t *w, int in, const float *xd, size_t pf, __m512 *out) {
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
    /* Rows off the lines by a multiple of 4 bytes (a Hugging Face
     * checkpoint's data is 8-byte aligned): each 64 bytes of a row are
     * put together from the two aligned lines it straddles (one aligned
     * load per line, one two-source permute), since a load that straddles
     * two lines costs the one stream a quarter of its speed. The same
     * values, so the same sums. The last line read holds the row's last
     * bytes, so it never crosses into a page the matrix does not touch. */
    const int shift = (int)((uintptr_t)w % 64) / 4; /* 32-bit words */
    const __m512i pick = _mm512_add_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(shift));
    for (int k = 0; k < 8; k++) {
        const uint16_t *wk = w + (size_t)k * in;
        const char *line = (const char *)((uintptr_t)wk & ~(uintptr_t)63);
        __m512i lo = _mm512_load_si512((const void *)line);
        __m512 s = _mm512_setzero_ps();
        for (int i = 0; i < in; i += 32) {
            if (pf) _mm_prefetch((const char *)(wk + i) + pf, _MM_HINT_T0);
            __m512i v;
            if (shift == 0) {
                v = _mm512_load_si512((const void *)(wk + i));
            } else {
                line += 64;
                const __m512i hi = _mm512_load_si512((const void *)line);
                v = _mm512_permutex2var_epi32(lo, pick, hi);
                lo = hi;
            }
            s = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
                                _mm512_loadu_ps(xd + i), s);
            s = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, hi_mask)),
                                _mm512_loadu_ps(xd + i + 16), s);
        }
        out[k] = s;
    }
}

/* Eight rows w + k * stride (k in [0, 8), stride in elements) dotted with
 * one token xd [in] (split even/odd as dot8_bf16's), into y[k * ystep]:
 * eight FMA chains side by side, one a row, each the chain the other
 * one-token loops give that row, then reduce8, so the same bits however
 * the rows are grouped. Each row's line at column i is prefetched pf
 * bytes on: with the rows side by side (stride one row) that is the
 * same columns pf / (2 in) rows on; with rows n8 apart (short rows from
 * memory), each run of consecutive rows' own stream pf bytes on.
 * next_in_order (a constant at each call; stride == in): instead, the
 * next eight rows are prefetched in order (prefetch_next8), so memory
 * sees one stream, as rows8_one_stream's, while the eight chains here
 * read it from L2. */
static inline __attribute__((always_inline)) void
rows8_bf16_t1(const uint16_t *w, size_t stride, int in, const float *xd, float *y,
                  size_t ystep, size_t pf, const bool next_in_order) {
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
    __m512 a[8];
    for (int k = 0; k < 8; k++) a[k] = _mm512_setzero_ps();
    for (int i = 0; i < in; i += 32) {
        const __m512 xe = _mm512_loadu_ps(xd + i), xo = _mm512_loadu_ps(xd + i + 16);
        if (next_in_order)
            prefetch_next8((const char *)(w + 8 * stride), i);
        else
            for (int k = 0; k < 8; k++)
                _mm_prefetch((const char *)(w + (size_t)k * stride + i) + pf, _MM_HINT_T0);
        for (int k = 0; k < 8; k++) {
            const __m512i v = _mm512_loadu_si512((const void *)(w + (size_t)k * stride + i));
            a[k] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), xe, a[k]);
            a[k] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, hi_mask)), xo, a[k]);
        }
    }
    _Alignas(32) float sums[8];
    _mm256_store_ps(sums, reduce8(a));
    for (int k = 0; k < 8; k++) y[(size_t)k * ystep] = sums[k];
}

/* rows8_cols_in_order with next_mode picked at run time (mode: NEXT8_*)
 * among its three constant forms. */
static inline __attribute__((always_inline)) void
group_in_order(const uint16_t *w, int in, const void *x0, const int nt, int i0, int i1,
               __m512 (*acc)[8], const bool bf16x, int mode, int pk0, int pk1) {
    if (mode == NEXT8_ALL)
        rows8_cols_in_order(w, in, x0, nt, i0, i1, acc, bf16x, NEXT8_ALL, pk0, pk1);
    else if (mode == NEXT8_SHARE)
        rows8_cols_in_order(w, in, x0, nt, i0, i1, acc, bf16x, NEXT8_SHARE, pk0, pk1);
    else
        rows8_cols_in_order(w, in, x0, nt, i0, i1, acc, bf16x, NEXT8_NONE, pk0, pk1);
}

/* Rows [r, r + 8) of W, nt (2..63) tokens xv [nt, in] (as rows8_cols,
 * bf16x a constant at each call), into y[t * ldy + r ..]: the tokens in
 * groups of three over the eight rows, in column blocks of DOT_COL_BLOCK
 * when there are more than three (the first group reads the rows from
 * memory, the others from L1), then reduce8. acc: 64 x 8 scratch sums.
 * Every (row, token) sum is the same chain whatever the tokens beside it.
 * Rows on the lines, up to DOT_IN_ORDER_MAX_T tokens: the next eight
 * rows are prefetched into L2 in the order they lie, by the first group
 * (exact) or dealt out among the groups (bf16x). Else pf_rows: the first
 * group's prefetch with up to three tokens, that many rows on. */
static inline __attribute__((always_inline)) void
rows8_tokens(const uint16_t *W, int in, const void *xv, int nt, int r, int pf_rows, float *y,
             int ldy, __m512 (*acc)[8], const bool bf16x, bool rows_ahead) {
    const uint16_t *w = W + (size_t)r * in;
    const size_t xsz = bf16x ? sizeof(uint16_t) : sizeof(float);
    const int cb = nt <= 3 ? in : DOT_COL_BLOCK;
    for (int t = 0; t < nt; t++)
        for (int k = 0; k < 8; k++) acc[t][k] = _mm512_setzero_ps();
    /* the first group's prefetch: with whole rows (up to three
     * tokens), the same columns pf_rows rows on; with column blocks,
     * the next block, which the other groups give time to arrive
     * (T = 5, 6 read 10-17% faster than with the rows on) */
    const int pf_first = nt <= 3 ? pf_rows * in : DOT_COL_BLOCK;
    /* Rows on lines, column blocks: the block after next (at most a
     * row on), its eight rows dealt out among the token groups, so
     * that the lines are asked for evenly over the block's time:
     * wide's lm_head for 8 tokens from memory, two threads, 27-28 ->
     * 21-23 ms in a standalone harness; in the engine (--seqs 8, six
     * rounds alternating) 80-87 -> 81-98 tok/s, median 86.3 -> 89.7.
     * Rows off the lines lost 9% that way (83.7 -> 76.3), so they keep
     * the first group's prefetch. Up to DOT_IN_ORDER_MAX_T tokens the
     * rows go in order instead, but where the CPU reads them faster with
     * each row's lines prefetched ahead (rows_ahead: kern_weight's
     * prefetch_rows_ahead; an Intel Xeon, 2 to 8 tokens of [4096, 2304]
     * from memory on two threads 16-27 -> 21-31 GB/s). In order, under
     * bf16x the next rows' lines are dealt out among the groups as well,
     * each group a share of the eight lines at each 32 columns: the
     * first group alone asked for them in a third of a block's time,
     * and the other groups' vdpbf16ps ran with no read in flight. A Zen
     * 4, kds_cpu_bench (h), two threads, --bf16 4 to 8 tokens from
     * memory at 80-100% of the read against 70-93%; wide's --seqs 8
     * --bf16 93.8-115.9 tok/s against 93.0-101.5, four rounds
     * alternating. The exact products of 8 tokens, bound by their FMAs,
     * gained nothing (--seqs 8: 78-86 against 83-89), so they keep the
     * first group's (docs/benchmarks.md, "The in-order prefetch dealt
     * out"). */
    const bool on_lines = (uintptr_t)W % 64 == 0;
    const bool in_order = on_lines && nt <= DOT_IN_ORDER_MAX_T && !rows_ahead;
    const bool spread = on_lines && !in_order && nt > 3;
    const int ng = (nt + 2) / 3;
    const int pf_far = 2 * DOT_COL_BLOCK < in ? 2 * DOT_COL_BLOCK : in;
    for (int i0 = 0; i0 < in; i0 += cb) {
        const int i1 = in - i0 < cb ? in : i0 + cb;
        for (int t = 0, g = 0; t < nt; t += 3, g++) {
            const void *x0 = (const char *)xv + (size_t)t * in * xsz;
            const int pk0 = 8 * g / ng, pk1 = 8 * (g + 1) / ng;
            if (in_order) {
                /* exact: the first group prefetches all eight lines;
                 * bf16x: the groups deal them out */
                const int mode = bf16x ? (ng == 1 ? NEXT8_ALL : NEXT8_SHARE)
                                       : (t == 0 ? NEXT8_ALL : NEXT8_NONE);
                if (nt - t >= 3)
                    group_in_order(w, in, x0, 3, i0, i1, acc + t, bf16x, mode, pk0, pk1);
                else if (nt - t == 2)
                    group_in_order(w, in, x0, 2, i0, i1, acc + t, bf16x, mode, pk0, pk1);
                else
                    group_in_order(w, in, x0, 1, i0, i1, acc + t, bf16x, mode, pk0, pk1);
                continue;
            }
            /* the spread prefetch is dealt out too; else the first group's */
            const int pf_dist = spread ? pf_far : t > 0 ? 0 : pf_first;
            const int pa = spread ? pk0 : 0, pb = spread ? pk1 : 8;
            if (nt - t >= 3)
                rows8_cols(w, in, x0, 3, i0, i1, pf_dist, nt > 3, pa, pb, acc + t, bf16x);
            else if (nt - t == 2)
                rows8_cols(w, in, x0, 2, i0, i1, pf_dist, nt > 3, pa, pb, acc + t, bf16x);
            else
                rows8_cols(w, in, x0, 1, i0, i1, pf_dist, nt > 3, pa, pb, acc + t, bf16x);
        }
    }
    for (int t = 0; t < nt; t++) _mm256_storeu_ps(y + (size_t)t * ldy + r, reduce8(acc[t]));
}

/* Eight weight rows at a time, every token over them: the activation
 * vectors are loaded once per eight rows and each (row, token) pair gets
 * its own accumulator, so the loop is bound by streaming W. Tokens go in
 * groups of up to three (rows8_cols: 8 x 3 sums in registers): the first
 * group reads the eight rows from memory as eight streams, the others from
 * cache. Eight streams matter: four rows at a time read at half the
 * bandwidth (batched decode gives each routed expert one to three tokens;
 * on one thread of the dev machine 2 and 3 tokens went from 16 and 13 GB/s
 * to 26 and 25, 1 token 25-27 either way). With more than three tokens
 * the columns go in blocks of DOT_COL_BLOCK, so that the later groups find
 * the rows and their x in cache (x of 8 tokens over 2,304 columns does
 * not fit L1 beside the rows), the sums carried from block to block.
 * Every (row, token) sum gets the same FMAs in the same order and reduce8
 * sums each vector the same way whatever vectors share the call, so a
 * token's results are bit for bit those it has alone.
 *
 * BF16 rows are widened without a shuffle: a 512-bit load holds 32 bf16
 * values; shifting each 32-bit lane left by 16 gives the even-indexed ones as
 * f32, masking off the low half gives the odd-indexed ones. The activation
 * vectors are pre-split the same way (xd: [nt, in], per 32-block 16 even then
 * 16 odd values), so each block costs two cheap integer ops and two FMAs per
 * row. nt < 64. y: [nt, ldy]. */
static void dot8_bf16(const uint16_t *W, int in, const float *xd, int nt, int r0, int r1,
                      float *y, int ldy, bool streamed, int stream_prefetch, bool rows_ahead) {
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
    /* Software prefetch ~16 KiB ahead: the hardware prefetcher alone left
     * decode at about half the machine's streaming bandwidth on lm_head-sized
     * matrices (measured 15-20% more tokens/s with it). x86 prefetches never
     * fault, so running past the last row is harmless. */
    const int pf_rows = 16384 / (2 * in) > 8 ? 16384 / (2 * in) : 8;
    /* in % 32 == 0, so every row is as far off a 64-byte line as W */
    const bool one_stream = streamed && nt == 1 && (uintptr_t)W % 4 == 0;
    const size_t pf = stream_prefetch > 0 ? (size_t)stream_prefetch : 0;
    _Alignas(64) __m512 acc[64][8];
    /* rows of 1-4 KiB and over 6 KiB from memory (DOT_ONE_STREAM_FROM),
     * on 64-byte lines: rows8_bf16_t1's loads would straddle lines */
    const size_t row_bytes = (size_t)in * 2;
    const bool in_order = one_stream && (uintptr_t)W % 64 == 0 && row_bytes >= DOT_IN_ORDER_FROM &&
                          (row_bytes < DOT_ONE_STREAM_FROM || row_bytes > DOT_ONE_STREAM_TO);
    int r = r0;
    if (nt == 1 && streamed && row_bytes < DOT_SPREAD_BELOW && r1 - r0 >= 16 && !in_order) {
        /* Short rows from memory: eight runs of n8 consecutive rows, the
         * eight rows of a step n8 rows apart, so that each run is one
         * sequential stream and the eight chains hide each other's
         * latency (rows8_bf16_t1). */
        const int n8 = (r1 - r0) / 8;
        for (int j = 0; j < n8; j++)
            rows8_bf16_t1(W + (size_t)(r0 + j) * in, (size_t)n8 * in, in, xd, y + r0 + j,
                          (size_t)n8, DOT_SPREAD_PF, false);
        r = r0 + 8 * n8;
    }
    for (; r + 8 <= r1; r += 8) {
        const uint16_t *w = W + (size_t)r * in;
        if (in_order) {
            rows8_bf16_t1(w, (size_t)in, in, xd, y + r, 1, 0, true);
            continue;
        }
        if (one_stream) {
            /* One token (decode) of a matrix that comes from memory (rows
             * 4-byte aligned, as every file's are but a 2-byte odd one):
             * rows8_one_stream reads the eight rows one after another,
             * one stream. */
            __m512 a1[8];
            rows8_one_stream(w, in, xd, pf, a1);
            _mm256_storeu_ps(y + r, reduce8(a1));
            continue;
        }
        if (nt == 1) {
            /* One token from cache (or rows not 4-byte aligned): the
             * eight rows side by side, the eight sums in registers, each
             * row prefetched in the next eight; the row group's generic
             * path below costs a fifth of the bandwidth here (measured
             * 20-26 against 29-30 GB/s on one thread, 1 GiB of rows). */
            rows8_bf16_t1(w, (size_t)in, in, xd, y + r, 1, (size_t)pf_rows * in * 2, false);
            continue;
        }
        rows8_tokens(W, in, xd, nt, r, pf_rows, y, ldy, acc, false, rows_ahead);
    }
    for (; r < r1; r++) {
        const uint16_t *w0 = W + (size_t)r * in;
        for (int t = 0; t < nt; t++) {
            const float *x = xd + (size_t)t * in;
            __m512 a0 = _mm512_setzero_ps();
            for (int i = 0; i < in; i += 32) {
                __m512i v = _mm512_loadu_si512((const void *)(w0 + i));
                a0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
                                     _mm512_loadu_ps(x + i), a0);
                a0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, hi_mask)),
                                     _mm512_loadu_ps(x + i + 16), a0);
            }
            y[(size_t)t * ldy + r] = _mm512_reduce_add_ps(a0);
        }
    }
}

/* Same for F32 and F16 rows (16 lanes per step), eight rows at a time.
 * x: [nt, in]; y: [nt, ldy]. */
static void dot8(kern_dtype dt, const void *W, int in, const float *x, int nt, int r0, int r1,
                 float *y, int ldy) {
    size_t esz = kern_dtype_size(dt), stride = (size_t)in * esz;
    int r = r0;
    for (; r + 8 <= r1; r += 8) {
        const char *w = (const char *)W + (size_t)r * stride;
        for (int t = 0; t < nt; t++) {
            const float *xt = x + (size_t)t * in;
            __m512 acc[8];
            for (int k = 0; k < 8; k++) acc[k] = _mm512_setzero_ps();
            for (int i = 0; i < in; i += 16) {
                __m512 xv = _mm512_loadu_ps(xt + i);
                for (int k = 0; k < 8; k++)
                    acc[k] = _mm512_fmadd_ps(load16(dt, w + k * stride, i), xv, acc[k]);
            }
            _mm256_storeu_ps(y + (size_t)t * ldy + r, reduce8(acc));
        }
    }
    for (; r < r1; r++)
        for (int t = 0; t < nt; t++)
            dot_row(dt, (const char *)W + (size_t)r * stride, in, x + (size_t)t * in, in, 1,
                    &y[(size_t)t * ldy + r]);
}
#endif

#if KERN_AVX2
/* nr rows (4 or 8, a constant at each call) from w (row stride `stride`
 * bytes) dotted with one token x [in], into y[k * ystep] for k in [0,
 * nr): per eight columns each row's vector feeds its own FMA, one
 * eight-lane chain per row, then hsum8 and the scalar tail as dot_row.
 * Each 64-byte line of each row (32 bf16 or f16 columns, 16 f32) is
 * prefetched pf bytes ahead as the loop reaches it (with four rows at
 * every eight columns, so several times a line: dot8_avx2_body): with
 * the rows side by side (stride one row) that is the matrix pf bytes on;
 * with rows far apart, each row's own stream pf bytes on. */
static inline __attribute__((always_inline)) void
rows_avx2(const kern_dtype dt, const char *w, size_t stride, int in, const float *x, float *y,
          size_t ystep, size_t pf, const int nr) {
    const int vec_end = in & ~7;
    const size_t esz = kern_dtype_size(dt);
    __m256 a[8];
    for (int k = 0; k < nr; k++) a[k] = _mm256_setzero_ps();
    for (int i = 0; i < vec_end; i += 8) {
        if (nr == 4 || (i * esz) % 64 == 0)
            for (int k = 0; k < nr; k++)
                _mm_prefetch(w + k * stride + (size_t)i * esz + pf, _MM_HINT_T0);
        const __m256 xv = _mm256_loadu_ps(x + i);
        for (int k = 0; k < nr; k++)
            a[k] = _mm256_fmadd_ps(load8(dt, w + k * stride, i), xv, a[k]);
    }
    for (int k = 0; k < nr; k++) {
        float acc = hsum8(a[k]);
        for (int i = vec_end; i < in; i++) acc += load1(dt, w + k * stride, i) * x[i];
        y[(size_t)k * ystep] = acc;
    }
}

/* Four rows from w (row stride `stride` bytes) dotted with nt (1..3, a
 * constant at each call) tokens x [nt, in], into y[t * ldy + k]: per eight
 * columns each row's widened vector feeds the nt tokens' FMAs (12 sums in
 * the 16 registers at nt = 3), each (row, token) sum the chain rows_avx2
 * and dot_row give it (the same FMAs, hsum8, the same scalar tail), so
 * the same bits. Every eight columns it prefetches: with pf_step 0, the
 * line of each of the four rows at this column in the rows at pf (each
 * line four times over for bf16: a test for the line's start cost more
 * than the repeats); otherwise one address, pf, moved on pf_step bytes
 * (its pass's share of the rows ahead, dot8_avx2_body). Written for GCC
 * 12's register allocator:
 * - the token vectors are pinned in registers (the empty asm). Left to
 *   itself GCC folds each x load into every FMA that uses it, 16 loads per
 *   12 FMAs, and Zen 3 issues two 256-bit loads a cycle: the loads, not
 *   the FMAs, set the pace (in L1, 4 x 3 tiles 70.6 -> 77.0 GFLOP/s of an
 *   88 peak);
 * - it is a function of its own (rows4_tile_avx2). Inlined into
 *   dot8_avx2_body with the asm, it spilled accumulators and fell to 49%
 *   of the peak. */
static inline __attribute__((always_inline)) void
rows4_tile_body(const kern_dtype dt, const char *w, size_t stride, int in, const float *x,
                const int nt, float *y, int ldy, const char *pf, const size_t pf_step) {
    const int vec_end = in & ~7;
    __m256 a[3][4];
    for (int j = 0; j < 3; j++)
        for (int k = 0; k < 4; k++) a[j][k] = _mm256_setzero_ps();
    for (int i = 0; i < vec_end; i += 8) {
        if (pf_step == 0) {
            for (int k = 0; k < 4; k++)
                _mm_prefetch(pf + k * stride + (size_t)i * kern_dtype_size(dt), _MM_HINT_T0);
        } else {
            _mm_prefetch(pf, _MM_HINT_T0);
            if (dt == KERN_F32) _mm_prefetch(pf + 64, _MM_HINT_T0); /* up to 128 bytes a step */
            pf += pf_step;
        }
        __m256 xv[3];
        for (int j = 0; j < nt; j++) {
            xv[j] = _mm256_loadu_ps(x + (size_t)j * in + i);
            __asm__("" : "+x"(xv[j]));
        }
        for (int k = 0; k < 4; k++) {
            const __m256 wv = load8(dt, w + k * stride, i);
            for (int j = 0; j < nt; j++) a[j][k] = _mm256_fmadd_ps(wv, xv[j], a[j][k]);
        }
    }
    for (int j = 0; j < nt; j++)
        for (int k = 0; k < 4; k++) {
            const float *xt = x + (size_t)j * in;
            float acc = hsum8(a[j][k]);
            for (int i = vec_end; i < in; i++) acc += load1(dt, w + k * stride, i) * xt[i];
            y[(size_t)j * ldy + k] = acc;
        }
}

/* rows4_tile_body with the format and the token count constants in each
 * copy (the format tested in the loop cost a compare and a spill). */
static __attribute__((noinline)) void rows4_tile_avx2(const kern_dtype dt, const char *w,
                                                      size_t stride, int in, const float *x,
                                                      const int nt, float *y, int ldy,
                                                      const char *pf, size_t pf_step) {
    if (dt == KERN_BF16) {
        if (nt == 3)
            rows4_tile_body(KERN_BF16, w, stride, in, x, 3, y, ldy, pf, pf_step);
        else if (nt == 2)
            rows4_tile_body(KERN_BF16, w, stride, in, x, 2, y, ldy, pf, pf_step);
        else
            rows4_tile_body(KERN_BF16, w, stride, in, x, 1, y, ldy, pf, pf_step);
    } else if (dt == KERN_F16) {
        if (nt == 3)
            rows4_tile_body(KERN_F16, w, stride, in, x, 3, y, ldy, pf, pf_step);
        else if (nt == 2)
            rows4_tile_body(KERN_F16, w, stride, in, x, 2, y, ldy, pf, pf_step);
        else
            rows4_tile_body(KERN_F16, w, stride, in, x, 1, y, ldy, pf, pf_step);
    } else {
        if (nt == 3)
            rows4_tile_body(KERN_F32, w, stride, in, x, 3, y, ldy, pf, pf_step);
        else if (nt == 2)
            rows4_tile_body(KERN_F32, w, stride, in, x, 2, y, ldy, pf, pf_step);
        else
            rows4_tile_body(KERN_F32, w, stride, in, x, 1, y, ldy, pf, pf_step);
    }
}

/* The direct path with AVX2. One token (decode: bound by the bytes):
 * several rows at a time, a chain each (one row's chain alone, dot_row's
 * loop, is bound by the FMA's latency): eight from cache, four from
 * memory (`streamed`), four streams a thread. Eight rows from memory were
 * eight streams a thread, and rows whose stride is a multiple of 4 KiB
 * (8 KiB: the attention's [2304, 4096] output projections) put all eight
 * of a step's lines in one L1 set, beside the next eight prefetched
 * there. A harness of our own (1 GB of one shape from memory, the two
 * loops alternating sweep by sweep in one process, 11-15 rounds, bits
 * compared; a Zen 3, 2026-12-07), four rows' speed over eight's, two /
 * one threads: [2304, 4096] 1.15x / 1.25x, [1024, 2304] (4.5 KiB) 1.02x
 * / 0.99x, and as four runs instead of eight (rows under 4 KiB, above)
 * [2304, 1024] 1.17x / 1.23x, [4096, 128] 1.27x / 1.23x, [50304, 256]
 * 1.21x / 0.98x; [2304, 9216] (18 KiB rows) 1.19x in a first try. From
 * the last-level cache four rows were 4-22% slower (their four chains
 * wait on the FMA's latency), hence eight there. Four rows take each
 * line's prefetch at every eight columns, as the tiles do (a prefetch a
 * line was 0.89-0.98x the tile's speed). Decode, alternating with the
 * build before (docs/benchmarks.md, "Four streams a thread"): wide
 * 89-92% -> 95-100% of the reads beside and inside each run, full27 85%
 * -> 98-108%, llamacpp-tiny 0.94-1.08x. Two tokens or more (a batched step, a routed
 * expert's share of one): four rows at a time, up to three tokens sharing
 * each widened row vector (rows4_tile_avx2), so a widening (a shuffle and
 * a shift, on the FMAs' pipes) is paid once per three FMAs instead of once
 * per FMA; the first group reads the rows from memory, the others from
 * cache. The four rows pf bytes on (two tiles at wide's widths) are
 * prefetched while a tile is worked on: with one group (up to three
 * tokens) row by row at the group's column, as one token's rows are;
 * with more, dealt out among the groups, each pass asking for its share
 * of the bytes (one line-sized step at a time), so that the lines are
 * asked for over the whole of the tile's time and not crowded into its
 * first pass (the memory is idle while the later groups work from
 * cache). A harness of our own, wide's lm_head [163840,
 * 2304] bf16 from memory, 2 threads, new / old time in 21 alternating
 * rounds: T = 4 1.09x, 6 1.16-1.19x, 8 1.13x, 12 1.08-1.12x, 16
 * 1.05-1.09x; the shares for one group too (a single stream through the
 * next tile) were 0.88-0.93x at T = 2-3, so one group keeps the rows.
 * On a Zen 3 (kds_cpu_bench (h), [4096, 2304] bf16, 2 threads,
 * alternating with the build before):
 * - T = 2 and 3, which went eight rows at a time, token after token:
 *   from memory 25-27 -> 33-38 and 20 -> 33-36 GB/s, the read's speed
 *   (34-41 GB/s);
 * - T = 6..16 (rows4_tile_avx2 as it is now): 73-78% -> 79-85% of the FMA
 *   peak with the rows in L2, 113-126 -> 122-136 GFLOP/s from memory;
 * - `wide`, batched decode (two runs each, alternating): 8 sequences
 *   57.1-57.7 -> 62.2-64.5 tok/s, 32 sequences 72.1-73.1 -> 76.5-76.9.
 * (On a Zen 5 running a -march=haswell build, four-row tiles of the old
 * form were slower than eight rows from memory.) Four tokens left go as
 * three and one: two and two measured the same. Column blocks that keep
 * the rows and x in L1 for every group were 7-12% slower: L2 is not what
 * bounds the tile (docs/benchmarks.md, "AVX2: the direct path's tiles").
 * Fewer widenings per FMA lost too, both by loading more bytes per FMA:
 * two rows by four to six tokens 0.90-0.93x at T = 6-12, sixteen columns
 * widened by an unpack against zero 0.70-0.89x ("Two other tile shapes").
 * Rows left over go four at a time, then one by one (dot_row). Each (row,
 * token) sum is the chain dot_row gives it, so a token's results are its
 * lone product's, bit for bit, however it is grouped. y: [T, ldy]. */
static inline __attribute__((always_inline)) void
dot8_avx2_body(const kern_dtype dt, const void *W, int in, const float *x, int T, int r0, int r1,
               float *y, int ldy, bool streamed) {
    const size_t stride = (size_t)in * kern_dtype_size(dt);
    /* The first token's pass over eight rows (the first group's over
     * four) prefetches the matrix this far ahead (at least 16 KiB and
     * eight rows, as dot8_bf16): without it the loads of a matrix from
     * memory or the last-level cache waited on their lines, and one-token
     * decode of llamacpp-tiny read 6 GB/s on one thread of a Zen 3 (no
     * AVX-512). */
    const size_t pf = 8 * stride > 16384 ? 8 * stride : 16384;
    const char *w0 = (const char *)W;
    int r = r0;
    if (T == 1 && streamed && stride < DOT_SPREAD_BELOW && r1 - r0 >= 16) {
        /* Rows shorter than a page, from memory (a [2304, 1024] down
         * projection: 2 KiB rows): rows side by side are a few short
         * pieces of one block, then a jump, and read slower than long
         * rows. Taken instead as four runs of n4 consecutive rows, the
         * four rows of a step n4 rows apart, each run is one sequential
         * stream, prefetched DOT_SPREAD_PF bytes ahead along itself
         * (eight runs were slower: above). */
        const int n4 = (r1 - r0) / 4;
        for (int j = 0; j < n4; j++)
            rows_avx2(dt, w0 + (size_t)(r0 + j) * stride, (size_t)n4 * stride, in, x, y + r0 + j,
                      (size_t)n4, DOT_SPREAD_PF, 4);
        r = r0 + 4 * n4;
    }
    /* from cache eight rows at a time, from memory four (above) */
    for (; T == 1 && !streamed && r + 8 <= r1; r += 8)
        rows_avx2(dt, w0 + (size_t)r * stride, stride, in, x, y + r, 1, pf, 8);
    for (; T == 1 && r + 4 <= r1; r += 4)
        rows_avx2(dt, w0 + (size_t)r * stride, stride, in, x, y + r, 1, pf, 4);
    const int ng = (T + 2) / 3, steps = in / 8 > 0 ? in / 8 : 1;
    const size_t share = (4 * stride + (size_t)ng - 1) / (size_t)ng;
    const size_t pf_step = (share + (size_t)steps - 1) / (size_t)steps;
    for (; r + 4 <= r1; r += 4)
        for (int t = 0, g = 0; t < T; t += 3, g++)
            rows4_tile_avx2(dt, w0 + (size_t)r * stride, stride, in, x + (size_t)t * in,
                            T - t < 3 ? T - t : 3, y + (size_t)t * ldy + r, ldy,
                            w0 + (size_t)r * stride + pf + (size_t)g * share,
                            ng == 1 ? 0 : pf_step);
    float out[DOT_TOKENS];
    for (; r < r1; r++)
        for (int t0 = 0; t0 < T; t0 += DOT_TOKENS) {
            const int nt = T - t0 < DOT_TOKENS ? T - t0 : DOT_TOKENS;
            dot_row(dt, w0 + (size_t)r * stride, in, x + (size_t)t0 * in, in, nt, out);
            for (int t = 0; t < nt; t++) y[(size_t)(t0 + t) * ldy + r] = out[t];
        }
}

/* dot8_avx2_body with the format a constant in each copy: a format tested
 * in the inner loop cost a compare and a spill per eight columns. */
static void dot8_avx2(kern_dtype dt, const void *W, int in, const float *x, int T, int r0,
                      int r1, float *y, int ldy, bool streamed) {
    if (dt == KERN_BF16)
        dot8_avx2_body(KERN_BF16, W, in, x, T, r0, r1, y, ldy, streamed);
    else if (dt == KERN_F16)
        dot8_avx2_body(KERN_F16, W, in, x, T, r0, r1, y, ldy, streamed);
    else
        dot8_avx2_body(KERN_F32, W, in, x, T, r0, r1, y, ldy, streamed);
}
#endif

/* 128 * in (the direct paths' split x and scales), or at least the GEMM's
 * panel and 516 tokens of packed x (kern__gemm unpacks W once for a prefill
 * step of up to 516 tokens). */
size_t kern_matmul_scratch_floats(int in) {
    const size_t direct = (size_t)128 * (size_t)in;
#if KERN_GEMM_SIMD
    const size_t gemm = kern__gemm_scratch_floats(in, 516);
    return gemm > direct ? gemm : direct;
#else
    return direct;
#endif
}

/* From this many tokens the product is compute-bound and runs as a GEMM:
 * the register-blocked panels of kern_gemm.h with AVX-512 or AVX2, widened
 * rows and BLAS (sgemm) without. Below it the direct (streaming) path wins: it costs
 * about the same per token at any T (the rows come from memory once, then
 * from L1), while unpacking a panel is paid once per panel of rows. On the CI
 * kind of machine (2 threads, bf16, `wide`: hidden 2304, a 163840-row LM
 * head) the direct path still won at 32 against widen + sgemm: raising
 * the crossover from 32 to 64 took the aggregate decode of 32 batched
 * sequences from 21.7 to 34.2 tok/s and a 32-token prefill from 27.4 to
 * 60.9 tok/s in one run (docs/benchmarks.md, "Continuous batching").
 * Below it each token's row is its one-token product, bit for bit, in
 * every build: batched decode relies on it. Without AVX-512 the direct
 * path is dot8_avx2 (AVX2) or dot_row; a prefill (kern_matmul_w_prefill)
 * takes the GEMM from KERN_PREFILL_GEMM_MIN_T tokens, or without it BLAS
 * (kern__matmul_blas) from KERN_PORTABLE_BLAS_MIN_T. */
#define MATMUL_GEMM_MIN_T 64

void kern_matmul(kern_dtype dt, const void *W, int in, const float *x, int T, float *y, int ldy,
                 int r0, int r1, float *scratch) {
    kern__matmul_hinted(dt, W, in, x, T, y, ldy, r0, r1, scratch, NULL);
}

void kern__matmul_blas(kern_dtype dt, const void *W, int in, const float *x, int T, float *y,
                       int ldy, int r0, int r1, float *scratch) {
    if (r1 <= r0 || T <= 0) return;
    if (dt == KERN_F32) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, r1 - r0, in, 1.0f, x, in,
                    (const float *)W + (size_t)r0 * in, in, 0.0f, y + r0, ldy);
        return;
    }
    const size_t esz = kern_dtype_size(dt);
    for (int rb = r0; rb < r1; rb += 128) {
        int nr = r1 - rb < 128 ? r1 - rb : 128;
        kern_to_f32(dt, (const char *)W + (size_t)rb * in * esz, scratch, (size_t)nr * in);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, nr, in, 1.0f, x, in, scratch, in,
                    0.0f, y + rb, ldy);
    }
}

#if KERN_AVX512 && defined(__AVX512BF16__)
/* y[t, r] = bf16(x[t]) . W[r] for rows [r0, r1) and nt (< 64) tokens xb
 * [nt, in] already rounded (in % 32 == 0): eight rows at a time through
 * dot8_bf16's row-group driver (rows8_tokens, one vdpbf16ps per pair of
 * columns), the rows past the last eight one at a time. Every (row,
 * token) sum is the same chain of vdpbf16ps whatever the tokens beside
 * it and the row cut, so a token's results do not depend on the batch
 * (in this mode). */
static void dot8_bf16act(const uint16_t *W, int in, const uint16_t *xb, int nt, int r0, int r1,
                         float *y, int ldy, bool rows_ahead) {
    _Alignas(64) __m512 acc[64][8];
    const int pf_rows = 16384 / (2 * in) > 8 ? 16384 / (2 * in) : 8; /* as dot8_bf16's */
    int r = r0;
    for (; r + 8 <= r1; r += 8)
        rows8_tokens(W, in, xb, nt, r, pf_rows, y, ldy, acc, true, rows_ahead);
    for (; r < r1; r++) {
        const uint16_t *w0 = W + (size_t)r * in;
        for (int t = 0; t < nt; t++) {
            __m512 a0 = _mm512_setzero_ps();
            for (int i = 0; i < in; i += 32)
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(w0 + i)),
                                      (__m512bh)_mm512_loadu_si512(
                                          (const void *)(xb + (size_t)t * in + i)));
            y[(size_t)t * ldy + r] = _mm512_reduce_add_ps(a0);
        }
    }
}
#endif

void kern_matmul_w_bf16act(const kern_weight *w, const float *x, int T, float *y, int ldy, int r0,
                           int r1, float *scratch) {
#if KERN_AVX512 && defined(__AVX512BF16__)
    const int in = w->cols;
#if KERN_GEMM_AMX
    /* AMX tiles where the CPU has them: W's rows straight from memory as
     * the A operand, 16 x 32 a tile, so the step reads each row once at
     * the memory's speed while vdpbf16ps (half the fma rate on Intel's
     * cores) would keep it bound by arithmetic (docs/benchmarks.md, "AMX
     * tiles") */
    if (w->dt == KERN_BF16 && in % 32 == 0 && scratch && T > 0 && r1 > r0 && kern__gemm_amx()) {
        kern__amx_rows_bf16(w->data, in, x, in, T, y, ldy, r0, r1, scratch);
        return;
    }
#endif
    if (w->dt == KERN_BF16 && in % 32 == 0 && scratch && T > 0 && T < MATMUL_GEMM_MIN_T &&
        r1 > r0) {
        /* x rounded to bf16 (nearest even) in column order, [T, in] */
        uint16_t *xb = (uint16_t *)scratch;
        for (int t = 0; t < T; t++)
            for (int i = 0; i < in; i += 32) {
                const float *xt = x + (size_t)t * in + i;
                const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xt + 16), _mm512_loadu_ps(xt));
                _mm512_storeu_si512((void *)(xb + (size_t)t * in + i), (__m512i)v);
            }
        dot8_bf16act(w->data, in, xb, T, r0, r1, y, ldy, w->prefetch_rows_ahead);
        return;
    }
    /* From MATMUL_GEMM_MIN_T tokens (a batched step of 64 sequences and
     * more), the prefill's vdpbf16ps GEMM, as the exact products take
     * the exact GEMM there: before, these went to the exact GEMM, at
     * half the multiply-adds per second (wide --bf16 --seqs 64 on a Zen
     * 4, docs/benchmarks.md "A batched step of 64 under --bf16"). Each
     * (row, token) sum is then one chain over the columns in order,
     * whatever the tokens beside it, but not dot8_bf16act's chain: a step
     * keeps the bits of its sequences' lone products below 64 tokens, as
     * the exact mode does. */
    if (w->dt == KERN_BF16 && scratch && T >= MATMUL_GEMM_MIN_T && r1 > r0) {
        kern__gemm_bf16act(w->data, in, x, T, y, ldy, r0, r1, scratch);
        return;
    }
#endif
    kern_matmul_w(w, x, T, y, ldy, r0, r1, scratch);
}

void kern__matmul_hinted(kern_dtype dt, const void *W, int in, const float *x, int T, float *y,
                         int ldy, int r0, int r1, float *scratch, const kern_weight *hint) {
    /* used by the one-token loops of AVX-512 (bf16) and AVX2 (short rows) */
    const bool streamed = hint && hint->streamed;
    (void)streamed;
    if (r1 <= r0 || T <= 0) return;
#if KERN_GEMM_SIMD
    if (T >= MATMUL_GEMM_MIN_T && scratch) {
        const kern_gemm_w gw = {dt, W, in, false};
        kern__gemm(&gw, in, x, in, T, y, ldy, r0, r1, false, scratch,
                   kern_matmul_scratch_floats(in));
        return;
    }
#endif
#if !KERN_AVX512
    /* f32 rows need no scratch for BLAS: the block formats' portable
     * prefill (quant.c's gemm_scalar) multiplies its dequantised rows so */
    if (T >= MATMUL_GEMM_MIN_T && (dt == KERN_F32 || scratch)) {
        kern__matmul_blas(dt, W, in, x, T, y, ldy, r0, r1, scratch);
        return;
    }
#endif
#if KERN_GEMM_AMX
    /* A matrix marked exact_tiles, where the CPU has AMX tiles, takes them
     * at every T here, one token too, so a lone decode and a batched step
     * still agree bit for bit (kern_weight) */
    if (hint && hint->exact_tiles && dt == KERN_BF16 && in % 32 == 0 && in >= KERN_TILES_MIN_IN &&
        scratch && kern__gemm_amx()) {
        kern__amx_rows_split(W, in, x, in, T, y, ldy, r0, r1, scratch);
        return;
    }
#endif
#if KERN_AVX512
    /* With scratch, T < MATMUL_GEMM_MIN_T here, so the split rows fit it. */
    if (in % 32 == 0) {
        if (dt == KERN_BF16 && scratch) {
            /* split x into the even/odd halves that dot8_bf16 expects */
            for (int t = 0; t < T; t++) {
                const float *xt = x + (size_t)t * in;
                float *st = scratch + (size_t)t * in;
                for (int i = 0; i < in; i += 32)
                    for (int j = 0; j < 16; j++) {
                        st[i + j] = xt[i + 2 * j];
                        st[i + 16 + j] = xt[i + 2 * j + 1];
                    }
            }
            dot8_bf16(W, in, scratch, T, r0, r1, y, ldy, streamed, hint ? hint->stream_prefetch : 0,
                      hint && hint->prefetch_rows_ahead);
            return;
        }
        if (dt != KERN_BF16) {
            dot8(dt, W, in, x, T, r0, r1, y, ldy);
            return;
        }
    }
#elif KERN_AVX2
    dot8_avx2(dt, W, in, x, T, r0, r1, y, ldy, streamed);
    return;
#endif
    const size_t ez = kern_dtype_size(dt);
    float out[DOT_TOKENS];
    for (int t0 = 0; t0 < T; t0 += DOT_TOKENS) {
        int nt = T - t0 < DOT_TOKENS ? T - t0 : DOT_TOKENS;
        for (int r = r0; r < r1; r++) {
            dot_row(dt, (const char *)W + (size_t)r * in * ez, in, x + (size_t)t0 * in, in, nt,
                    out);
            for (int t = 0; t < nt; t++) y[(size_t)(t0 + t) * ldy + r] = out[t];
        }
    }
}

/* ------------------------------------------------------------------------ */

/* sum(x[i]^2) in double (the sum of squares of thousands of values), in
 * 16 running sums, x[i] into sum i % 16, added in a fixed tree at the end:
 * independent chains the compiler turns into vector adds (one chain of
 * double adds held kern_rmsnorm to one value per add latency, 3% of a
 * llamacpp-tiny prefill on the main thread alone). Each square is exact in
 * double; the order is C's, so every build gives the same sums. */
static double sum_squares(const float *x, int n) {
    double acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += (double)x[i + j] * x[i + j];
    for (int j = 0; i < n; i++, j++) acc[j] += (double)x[i] * x[i];
    for (int h = 8; h >= 1; h /= 2)
        for (int j = 0; j < h; j++) acc[j] += acc[j + h];
    return acc[0];
}

void kern_rmsnorm(const float *x, const void *w, kern_dtype dt, int n, float eps, float *y) {
    const double ss = sum_squares(x, n);
    float r = (float)(1.0 / sqrt(ss / n + eps));
    if (!w) {
        for (int i = 0; i < n; i++) y[i] = x[i] * r;
    } else if (dt == KERN_F32) {
        const float *wf = w;
        for (int i = 0; i < n; i++) y[i] = x[i] * r * wf[i];
    } else {
        for (int i = 0; i < n; i++) y[i] = x[i] * r * load1(dt, w, i);
    }
}

void kern_l2norm(float *x, int n_vecs, int dim, float eps) {
    for (int v = 0; v < n_vecs; v++) {
        float *p = x + (size_t)v * dim;
        const double ss = sum_squares(p, dim);
        float r = (float)(1.0 / sqrt(ss + eps));
        for (int i = 0; i < dim; i++) p[i] *= r;
    }
}

float kern_sigmoid(float x) { return vsigmoid(x); }

float kern_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

void kern_silu(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = x[i] * vsigmoid(x[i]);
}

void kern_swiglu(float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++) a[i] = a[i] * vsigmoid(a[i]) * b[i];
}

void kern_sigmoid_inplace(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = vsigmoid(x[i]);
}
