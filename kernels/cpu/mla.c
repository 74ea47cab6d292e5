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
#include <string.h>

#include "kern.h"

size_t kern_mla_attend_head_workspace_floats(const kern_mla_shape *sh, int T) {
    if (!sh || T < 1) return 0;
    const size_t row = (size_t)sh->dc + sh->dr;
    /* Q [T, dc+dr], S [T, KEY_BLOCK], Lat [T, dc], max and denominator [2, T] */
    return (size_t)T * (row + KERN_MLA_KEY_BLOCK + (size_t)sh->dc + 2);
}

void kern_mla_attend_head(const kern_mla_shape *sh, const float *wuk, const float *wuv,
                          const float *qh, int q_stride, int T, int64_t pos, const float *cache,
                          float *oh, int o_stride, float *workspace) {
    const int dc = sh->dc, dn = sh->dn, dr = sh->dr, dv = sh->dv, row = dc + dr;
    const float scale = 1.0f / sqrtf((float)(dn + dr));
    float *Q = workspace, *S = Q + (size_t)T * row, *lat = S + (size_t)T * KERN_MLA_KEY_BLOCK;
    float *mx = lat + (size_t)T * dc, *den = mx + T;
    /* Q[:, :dc] = q_nope W_UK_h; Q[:, dc:] = q_pe; all times the scale. */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, dc, dn, scale, qh, q_stride, wuk, dc,
                0.0f, Q, row);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < dr; j++)
            Q[(size_t)t * row + dc + j] = scale * qh[(size_t)t * q_stride + dn + j];
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
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nb, row, 1.0f,
                        Q + (size_t)t0 * row, row, Kb, row, 0.0f, S, KERN_MLA_KEY_BLOCK);
        for (int i = 0; i < nq; i++) {
            int t = t0 + i;
            float *srow = S + (size_t)i * KERN_MLA_KEY_BLOCK;
            int visible = (int)(pos + t - k0 + 1); /* keys k0 .. pos+t */
            if (visible > nb) visible = nb;
            float bm = mx[t];
            for (int j = 0; j < visible; j++) bm = srow[j] > bm ? srow[j] : bm;
            float corr = expf(mx[t] - bm); /* 0 on the first block (mx = -inf) */
            float sum = 0.0f;
            for (int j = 0; j < visible; j++) {
                srow[j] = expf(srow[j] - bm);
                sum += srow[j];
            }
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
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, dc, nb, 1.0f, S,
                        KERN_MLA_KEY_BLOCK, Kb, row, 1.0f, lat + (size_t)t0 * dc, dc);
    }
    for (int t = 0; t < T; t++) {
        float inv = 1.0f / den[t], *lrow = lat + (size_t)t * dc;
        for (int j = 0; j < dc; j++) lrow[j] *= inv;
    }
    /* O_h = Lat W_UV_h^T, written into this head's columns of o */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, dv, dc, 1.0f, lat, dc, wuv, dc, 0.0f,
                oh, o_stride);
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
                             workspace + wfl);
    }
}
