/*
 * kern_mla_attend_head (kernels/cpu/mla.c), the CPU's MLA attention, on
 * its two paths: exact, and with bf16 activations in the scores and the
 * weighted latent (eng_ctx_params.bf16_act in a prefill). The bf16 path
 * stays within bf16's error of the exact one at a context of several key
 * blocks and is not the exact one; fewer than 12 queries stay exact.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kern.h"

static float unit(uint64_t *x) {
    *x ^= *x << 13, *x ^= *x >> 7, *x ^= *x << 17;
    return (float)((*x >> 11) * 0x1.0p-53) * 2.0f - 1.0f;
}

/* One head, T queries at position pos over a random cache; the output of
 * each path into `exact` and `bf16`. */
static void attend_both(int T, int64_t pos, float *exact, float *bf16) {
    const kern_mla_shape sh = {4, 128, 32, 64, 64}; /* nh, dc, dr, dn, dv */
    const int row = sh.dc + sh.dr, n = (int)pos + T;
    float *cache = malloc((size_t)n * row * sizeof(float));
    float *wuk = malloc((size_t)sh.dn * sh.dc * sizeof(float));
    float *wuv = malloc((size_t)sh.dv * sh.dc * sizeof(float));
    float *q = malloc((size_t)T * (sh.dn + sh.dr) * sizeof(float));
    float *ws = malloc(kern_mla_attend_head_workspace_floats(&sh, T) * sizeof(float));
    cr_assert(cache && wuk && wuv && q && ws);
    uint64_t s = 0x1234567 + (uint64_t)T;
    for (size_t i = 0; i < (size_t)n * row; i++) cache[i] = unit(&s);
    for (int i = 0; i < sh.dn * sh.dc; i++) wuk[i] = 0.1f * unit(&s);
    for (int i = 0; i < sh.dv * sh.dc; i++) wuv[i] = 0.1f * unit(&s);
    for (int i = 0; i < T * (sh.dn + sh.dr); i++) q[i] = unit(&s);
    kern_mla_attend_head(&sh, wuk, wuv, q, sh.dn + sh.dr, T, pos, cache, exact, sh.dv, false, ws);
    kern_mla_attend_head(&sh, wuk, wuv, q, sh.dn + sh.dr, T, pos, cache, bf16, sh.dv, true, ws);
    free(cache);
    free(wuk);
    free(wuv);
    free(q);
    free(ws);
}

Test(mla, bf16_attention_within_bf16_error) {
    enum { T = 40, DV = 64 };
    static float exact[T * DV], bf16[T * DV];
    attend_both(T, 600, exact, bf16); /* 3 key blocks of 256 */
    double big = 0, diff = 0;
    for (int i = 0; i < T * DV; i++) {
        cr_assert(isfinite(bf16[i]), "output %d", i);
        big = fmax(big, fabs(exact[i]));
        diff = fmax(diff, fabs(exact[i] - bf16[i]));
    }
    cr_log_info("mla: bf16 attention off by %g of the largest output", diff / big);
    cr_expect_leq(diff / big, 3e-2, "bf16 attention: %g of the largest output", diff / big);
    if (kern_bf16_products())
        cr_expect_gt(diff / big, 1e-7, "bf16 attention changed nothing: the mode did not reach it");
    else /* a build without AVX-512 BF16: the attention stays exact */
        cr_expect(!memcmp(exact, bf16, sizeof exact), "without bf16 dot products the mode moved "
                  "the attention (%g)", diff / big);
}

Test(mla, bf16_attention_below_12_queries_is_exact) {
    enum { T = 5, DV = 64 };
    static float exact[T * DV], bf16[T * DV];
    attend_both(T, 300, exact, bf16);
    cr_expect_eq(memcmp(exact, bf16, sizeof exact), 0, "decode-sized batches stay exact");
}
