/*
 * mla.c - absorbed MLA attention (kda-model-spec.md §5.2; no RoPE), the CPU
 * engine's own code (engine/eng_forward.c calls kern_mla_attend_head per
 * head) and the reference of kern_cuda_mla_attention.
 *
 * One head is MQA against the sequence's latent cache [n, dc + dr]: the
 * query is absorbed through W_UK_h, scores and softmax run over blocks of
 * KERN_MLA_KEY_BLOCK keys with an online (flash-attention) softmax, so the
 * scratch does not grow with the context, and the softmax-weighted latent
 * goes out through W_UV_h.
 */
#include <cblas.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "kern.h"
#include "kern_gemm.h"
#include "kern_math.h"

#if defined(__AVX512F__)
#define MLA_GEMM 1
#endif

/* Columns of the widest product's panel (kern_gemm.h): the products
 * read dn, dc + dr, KEY_BLOCK and dc columns. */
static size_t panel_floats(const kern_mla_shape *sh) {
    size_t w = (size_t)sh->dc + sh->dr;
    if ((size_t)sh->dn > w) w = (size_t)sh->dn;
    if (KERN_MLA_KEY_BLOCK > w) w = KERN_MLA_KEY_BLOCK;
    if (w > KERN_PANEL_COLS) w = KERN_PANEL_COLS;
    return KERN_PANEL_ROWS * w;
}

/* The GEMM's scratch: a panel, and with bf16 activations the queries'
 * rows rounded to bf16 pairs ([T, (dc + dr) / 2] words at most). */
static size_t gemm_floats(const kern_mla_shape *sh, int T) {
    return panel_floats(sh) + (size_t)T * (((size_t)sh->dc + sh->dr + 1) / 2 + 1);
}

size_t kern_mla_attend_head_workspace_floats(const kern_mla_shape *sh, int T) {
    if (!sh || T < 1) return 0;
    const size_t row = (size_t)sh->dc + sh->dr;
    /* Q [T, dc+dr], S [T, KEY_BLOCK], Lat [T, dc], max and denominator [2, T],
     * and the GEMM's scratch */
    return (size_t)T * (row + KERN_MLA_KEY_BLOCK + (size_t)sh->dc + 2) + gemm_floats(sh, T);
}

/* y [T, ldy] (+)= x [T, ldx] W^T over `in` columns, rows [0, rows) of W
 * (W(r, c) at w[r * ldw + c], or at w[c * ldw + r] when cols_major): the
 * AVX-512 GEMM of kern_gemm.h (about twice OpenBLAS's AVX2 sgemm, which
 * Debian's 0.3.21 runs on this Zen), else sgemm. */
static void gemm(const float *w, int ldw, bool cols_major, int rows, int in, const float *x,
                 int ldx, int T, float *y, int ldy, bool accumulate, float *P) {
#if MLA_GEMM
    const kern_gemm_w gw = {KERN_F32, w, ldw, cols_major};
    kern__gemm(&gw, in, x, ldx, T, y, ldy, 0, rows, accumulate, P);
#else
    (void)P;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, cols_major ? CblasNoTrans : CblasTrans, T, rows, in,
                1.0f, x, ldx, w, ldw, accumulate ? 1.0f : 0.0f, y, ldy);
#endif
}

/* The attention's two big products (scores, weighted latent) with
 * bf16_act: both operands rounded to bf16, AVX-512 BF16 dot products
 * (kern_gemm.h); an exact gemm otherwise, and below 12 queries. */
static void gemm_att(const float *w, int ldw, bool cols_major, int rows, int in, const float *x,
                     int ldx, int T, float *y, int ldy, bool accumulate, float *P, size_t P_floats,
                     bool bf16_act) {
#if MLA_GEMM && defined(__AVX512BF16__)
    if (bf16_act && T >= KERN_PREFILL_GEMM_MIN_T) {
        const kern_gemm_w gw = {KERN_F32, w, ldw, cols_major};
        kern__gemm_bf16x(&gw, in, x, ldx, T, y, ldy, 0, rows, accumulate, P, P_floats);
        return;
    }
#endif
    (void)P_floats;
    (void)bf16_act;
    gemm(w, ldw, cols_major, rows, in, x, ldx, T, y, ldy, accumulate, P);
}

void kern_mla_attend_head(const kern_mla_shape *sh, const float *wuk, const float *wuv,
                          const float *qh, int q_stride, int T, int64_t pos, const float *cache,
                          float *oh, int o_stride, bool bf16_act, float *workspace) {
    const int dc = sh->dc, dn = sh->dn, dr = sh->dr, dv = sh->dv, row = dc + dr;
    const float scale = 1.0f / sqrtf((float)(dn + dr));
    float *Q = workspace, *S = Q + (size_t)T * row, *lat = S + (size_t)T * KERN_MLA_KEY_BLOCK;
    float *mx = lat + (size_t)T * dc, *den = mx + T, *P = den + T;
    const size_t P_floats = gemm_floats(sh, T);
    /* Q[:, :dc] = q_nope W_UK_h; Q[:, dc:] = q_pe; all times the scale. */
    gemm(wuk, dc, true, dc, dn, qh, q_stride, T, Q, row, false, P);
    for (int t = 0; t < T; t++) {
        for (int j = 0; j < dc; j++) Q[(size_t)t * row + j] *= scale;
        for (int j = 0; j < dr; j++)
            Q[(size_t)t * row + dc + j] = scale * qh[(size_t)t * q_stride + dn + j];
    }
    memset(lat, 0, (size_t)T * dc * sizeof(float));
    for (int t = 0; t < T; t++) {
        mx[t] = -INFINITY;
        den[t] = 0.0f;
    }
    const int64_t n_ctx = pos + T;
    for (int64_t k0 = 0; k0 < n_ctx; k0 += KERN_MLA_KEY_BLOCK) {
        int nb = n_ctx - k0 < KERN_MLA_KEY_BLOCK ? (int)(n_ctx - k0) : KERN_MLA_KEY_BLOCK;
        const float *Kb = cache + (size_t)k0 * row;
        /* queries that see none of this block (k0 > pos + t) are skipped */
        int t0 = k0 > pos ? (int)(k0 - pos) : 0;
        int nq = T - t0;
        if (nq == 1) /* decode: gemv, which packs nothing */
            cblas_sgemv(CblasRowMajor, CblasNoTrans, nb, row, 1.0f, Kb, row,
                        Q + (size_t)t0 * row, 1, 0.0f, S, 1);
        else
            gemm_att(Kb, row, false, nb, row, Q + (size_t)t0 * row, row, nq, S, KERN_MLA_KEY_BLOCK,
                     false, P, P_floats, bf16_act);
        for (int i = 0; i < nq; i++) {
            int t = t0 + i;
            float *srow = S + (size_t)i * KERN_MLA_KEY_BLOCK;
            int visible = (int)(pos + t - k0 + 1); /* keys k0 .. pos+t */
            if (visible > nb) visible = nb;
            float bm = mx[t];
            for (int j = 0; j < visible; j++) bm = srow[j] > bm ? srow[j] : bm;
            float corr = expf(mx[t] - bm); /* 0 on the first block (mx = -inf) */
            /* vexp: branch-free, so the block's exponentials vectorise
             * (scalar expf took a tenth of a long prefill) */
            for (int j = 0; j < visible; j++) srow[j] = vexp(srow[j] - bm);
            float sum = 0.0f;
            for (int j = 0; j < visible; j++) sum += srow[j];
            for (int j = visible; j < nb; j++) srow[j] = 0.0f;
            den[t] = den[t] * corr + sum;
            mx[t] = bm;
            float *lrow = lat + (size_t)t * dc;
            if (corr != 1.0f)
                for (int j = 0; j < dc; j++) lrow[j] *= corr;
        }
        /* Lat[t0:] += P C_b, C_b = the first dc columns of the key rows */
        if (nq == 1)
            cblas_sgemv(CblasRowMajor, CblasTrans, nb, dc, 1.0f, Kb, row, S, 1, 1.0f,
                        lat + (size_t)t0 * dc, 1);
        else
            gemm_att(Kb, row, true, dc, nb, S, KERN_MLA_KEY_BLOCK, nq, lat + (size_t)t0 * dc, dc,
                     true, P, P_floats, bf16_act);
    }
    for (int t = 0; t < T; t++) {
        float inv = 1.0f / den[t], *lrow = lat + (size_t)t * dc;
        for (int j = 0; j < dc; j++) lrow[j] *= inv;
    }
    /* O_h = Lat W_UV_h^T, written into this head's columns of o */
    gemm(wuv, dc, false, dv, dc, lat, dc, T, oh, o_stride, false, P);
}

size_t kern_mla_attend_workspace_floats(const kern_mla_shape *sh, int T) {
    if (!sh || T < 1) return 0;
    return (size_t)(sh->dn + sh->dv) * sh->dc + kern_mla_attend_head_workspace_floats(sh, T);
}

void kern_mla_attend(const kern_mla_shape *sh, kern_dtype dt, const void *kv_b, const float *q,
                     int T, int64_t pos, const float *cache, float *o, int h0, int h1,
                     float *workspace) {
    const int dc = sh->dc, dn = sh->dn, dr = sh->dr, dv = sh->dv;
    const size_t esz = kern_dtype_size(dt), wfl = (size_t)(dn + dv) * dc;
    float *w = workspace; /* [dn + dv, dc]: W_UK_h then W_UV_h, widened */
    for (int h = h0; h < h1; h++) {
        kern_to_f32(dt, (const char *)kv_b + (size_t)h * wfl * esz, w, wfl);
        kern_mla_attend_head(sh, w, w + (size_t)dn * dc, q + (size_t)h * (dn + dr),
                             sh->nh * (dn + dr), T, pos, cache, o + (size_t)h * dv, sh->nh * dv,
                             false, workspace + wfl);
    }
}
