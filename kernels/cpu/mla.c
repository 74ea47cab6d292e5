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

#define MLA_GEMM KERN_GEMM_SIMD

/* Columns of the widest product's panel (kern_gemm.h): the products
 * read dn, dc + dr, KEY_BLOCK and dc columns. */
static size_t panel_floats(const kern_mla_shape *sh) {
    size_t w = (size_t)sh->dc + sh->dr;
    if ((size_t)sh->dn > w) w = (size_t)sh->dn;
    if (KERN_MLA_KEY_BLOCK > w) w = KERN_MLA_KEY_BLOCK;
    return kern__gemm_panel_floats((int)w);
}

/* The GEMM's scratch: a panel, and with bf16 activations the queries'
 * rows rounded to bf16 pairs ([T, (dc + dr) / 2] words at most). */
static size_t gemm_floats(const kern_mla_shape *sh, int T) {
    return panel_floats(sh) + (size_t)T * (((size_t)sh->dc + sh->dr + 1) / 2 + 1);
}

/* Floats per query row of Q (absorbed dc + dr, expanded dn + dr) and of the
 * output accumulator (dc, dv): the larger of the two forms. */
static size_t qrow_floats(const kern_mla_shape *sh) {
    const size_t a = (size_t)sh->dc + sh->dr, e = (size_t)sh->dn + sh->dr;
    return a > e ? a : e;
}
static size_t acc_floats(const kern_mla_shape *sh) {
    return (size_t)(sh->dc > sh->dv ? sh->dc : sh->dv);
}

size_t kern_mla_attend_head_workspace_floats(const kern_mla_shape *sh, int T) {
    if (!sh || T < 1) return 0;
    /* Q [T, qrow], S [T, KEY_BLOCK], the output accumulator [T, acc], max
     * and denominator [2, T], the GEMM's scratch, and the expanded form's
     * projected keys and values [KEY_BLOCK, dn + dr + dv] */
    return (size_t)T * (qrow_floats(sh) + KERN_MLA_KEY_BLOCK + acc_floats(sh) + 2) +
           gemm_floats(sh, T) + (size_t)KERN_MLA_KEY_BLOCK * (sh->dn + sh->dr + sh->dv);
}

/* y [T, ldy] (+)= x [T, ldx] W^T over `in` columns, rows [0, rows) of W
 * (W(r, c) at w[r * ldw + c], or at w[c * ldw + r] when cols_major): the
 * GEMM of kern_gemm.h (with AVX-512 about twice OpenBLAS's AVX2 sgemm, which
 * Debian's 0.3.21 runs on a Zen 5; with AVX2 on a Zen 3 a 256-token slice's
 * attention took 5-7% less time than sgemm's), else sgemm. */
static void gemm(const float *w, int ldw, bool cols_major, int rows, int in, const float *x,
                 int ldx, int T, float *y, int ldy, bool accumulate, float *P) {
#if MLA_GEMM
    const kern_gemm_w gw = {KERN_F32, w, ldw, cols_major};
    kern__gemm(&gw, in, x, ldx, T, y, ldy, 0, rows, accumulate, P, 0);
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

/* gemm_att for the rows of a decode token's heads (attend_rows' step 0),
 * each of whose outputs must not depend on the rows beside it (a head's
 * result is the same whichever heads share the call: threads split the
 * heads, and batched decode relies on it). The GEMM gives that (every
 * output its own fma chain); BLAS does not, so without it each row goes
 * through the product alone (on a Zen 3 with AVX2, all 32 heads of a token
 * at 16K context took 10x the GEMM's time: kds_cpu_bench --only g). */
static void gemm_att_rows_apart(const float *w, int ldw, bool cols_major, int rows, int in,
                                const float *x, int ldx, int T, float *y, int ldy,
                                bool accumulate, float *P, size_t P_floats) {
#if MLA_GEMM
    gemm_att(w, ldw, cols_major, rows, in, x, ldx, T, y, ldy, accumulate, P, P_floats, false);
#else
    for (int t = 0; t < T; t++)
        gemm_att(w, ldw, cols_major, rows, in, x + (size_t)t * ldx, ldx, 1, y + (size_t)t * ldy,
                 ldy, accumulate, P, P_floats, false);
#endif
}

/* Whether T queries of a prefill slice attend in the expanded form
 * (below). Per key and head the absorbed form does dc + dr + dc multiply-
 * adds a query (1,088 at Kimi's widths), the expanded one dn + dr + dv
 * (320) plus projecting the key up once per slice ((dn + dv) dc, 131K):
 * at Kimi's widths cheaper from about 171 queries, 0.77 of the arithmetic
 * at 256. Taken when it saves a tenth at least (the projections' copies
 * and extra passes are not counted), so from 199 queries there; never
 * for heads whose dn + dv outgrows 2 dc. */
static bool expanded_pays(const kern_mla_shape *sh, int T) {
    const double absorbed = 2.0 * sh->dc + sh->dr;
    const double expanded =
        (double)(sh->dn + sh->dv) * sh->dc / T + (double)(sh->dn + sh->dr + sh->dv);
    return expanded < 0.9 * absorbed;
}

/* Where one head's attention reads its keys and values. Absorbed (wuk ==
 * NULL): the queries are [q_nope W_UK_h | q_pe] (dc + dr wide), the keys the
 * cache rows, the values their first dc columns, the output the weighted
 * latent [dc]. Expanded: per block of the cache the keys are projected up,
 * K_b = [C_b W_UK_h^T | k_pe] [nb, dn + dr] and V_b = C_b W_UV_h^T [nb, dv],
 * the queries are [q_nope | q_pe] and the output is the head's [dv]. */
typedef struct attn_form {
    const float *wuk, *wuv; /* expanded: W_UK_h [dn, dc], W_UV_h [dv, dc] */
    float *Kx, *Vx;         /* expanded: [KEY_BLOCK, dn + dr], [KEY_BLOCK, dv] */
} attn_form;

/* The online-softmax attention of nq scaled query rows Q [nq, qw] (qw:
 * dc + dr absorbed, dn + dr expanded) over the latent cache: row i sees
 * keys 0 .. last0 + step * i (step 1: the tokens of a prefill slice,
 * causal; step 0: the heads of one decode token, which all see the same
 * keys). acc [nq, aw] (aw: dc absorbed, dv expanded) gets the softmax-
 * weighted values, normalised. S [nq, KEY_BLOCK], mx, den [nq] and P
 * (P_floats of GEMM scratch) are workspace. With step 0 each row's result
 * depends on its own query and the keys only (every GEMM output is its own
 * fma chain), not on the rows beside it, so even one row goes through the
 * GEMM; with step 1 a block seen by one query alone takes the cheaper gemv. */
static void attend_rows(const kern_mla_shape *sh, const attn_form *f, const float *Q, int nq_all,
                        int64_t last0, int step, const float *cache, float *S, float *acc,
                        float *mx, float *den, float *P, size_t P_floats, bool bf16_act) {
    const int dc = sh->dc, dr = sh->dr, dn = sh->dn, dv = sh->dv, row = dc + dr;
    const bool expanded = f->wuk != NULL;
    const int qw = expanded ? dn + dr : row, aw = expanded ? dv : dc;
    memset(acc, 0, (size_t)nq_all * aw * sizeof(float));
    for (int t = 0; t < nq_all; t++) {
        mx[t] = -INFINITY;
        den[t] = 0.0f;
    }
    const int64_t n_ctx = last0 + (int64_t)step * (nq_all - 1) + 1;
    for (int64_t k0 = 0; k0 < n_ctx; k0 += KERN_MLA_KEY_BLOCK) {
        int nb = n_ctx - k0 < KERN_MLA_KEY_BLOCK ? (int)(n_ctx - k0) : KERN_MLA_KEY_BLOCK;
        const float *Cb = cache + (size_t)k0 * row;
        /* rows that see none of this block (last key < k0) are skipped */
        int t0 = step && k0 > last0 ? (int)(k0 - last0) : 0;
        int nq = nq_all - t0;
        /* keys [nb, qw] (ldk) and values (W(r, key) at vals[key * ldv + r]) */
        const float *keys = Cb, *vals = Cb;
        int ldk = row, ldv = row;
        if (expanded) {
            gemm(f->wuk, dc, false, dn, dc, Cb, row, nb, f->Kx, dn + dr, false, P);
            gemm(f->wuv, dc, false, dv, dc, Cb, row, nb, f->Vx, dv, false, P);
            for (int j = 0; j < nb; j++)
                memcpy(f->Kx + (size_t)j * (dn + dr) + dn, Cb + (size_t)j * row + dc,
                       (size_t)dr * sizeof(float));
            keys = f->Kx, ldk = dn + dr;
            vals = f->Vx, ldv = dv;
        }
        const bool gemv = nq == 1 && step;
        if (gemv) /* one query: gemv, which packs nothing */
            cblas_sgemv(CblasRowMajor, CblasNoTrans, nb, qw, 1.0f, keys, ldk,
                        Q + (size_t)t0 * qw, 1, 0.0f, S, 1);
        else if (!step)
            gemm_att_rows_apart(keys, ldk, false, nb, qw, Q + (size_t)t0 * qw, qw, nq, S,
                                KERN_MLA_KEY_BLOCK, false, P, P_floats);
        else
            gemm_att(keys, ldk, false, nb, qw, Q + (size_t)t0 * qw, qw, nq, S, KERN_MLA_KEY_BLOCK,
                     false, P, P_floats, bf16_act);
        for (int i = 0; i < nq; i++) {
            int t = t0 + i;
            float *srow = S + (size_t)i * KERN_MLA_KEY_BLOCK;
            int64_t last = last0 + (int64_t)step * t;
            int visible = last - k0 + 1 < nb ? (int)(last - k0 + 1) : nb;
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
            float *arow = acc + (size_t)t * aw;
            if (corr != 1.0f)
                for (int j = 0; j < aw; j++) arow[j] *= corr;
        }
        /* acc[t0:] += P V_b */
        if (gemv)
            cblas_sgemv(CblasRowMajor, CblasTrans, nb, aw, 1.0f, vals, ldv, S, 1, 1.0f,
                        acc + (size_t)t0 * aw, 1);
        else if (!step)
            gemm_att_rows_apart(vals, ldv, true, aw, nb, S, KERN_MLA_KEY_BLOCK, nq,
                                acc + (size_t)t0 * aw, aw, true, P, P_floats);
        else
            gemm_att(vals, ldv, true, aw, nb, S, KERN_MLA_KEY_BLOCK, nq, acc + (size_t)t0 * aw, aw,
                     true, P, P_floats, bf16_act);
    }
    for (int t = 0; t < nq_all; t++) {
        float inv = 1.0f / den[t], *arow = acc + (size_t)t * aw;
        for (int j = 0; j < aw; j++) arow[j] *= inv;
    }
}

void kern_mla_attend_head(const kern_mla_shape *sh, const float *wuk, const float *wuv,
                          const float *qh, int q_stride, int T, int64_t pos, const float *cache,
                          float *oh, int o_stride, bool bf16_act, float *workspace) {
    const int dc = sh->dc, dn = sh->dn, dr = sh->dr, dv = sh->dv, row = dc + dr;
    const float scale = 1.0f / sqrtf((float)(dn + dr));
    float *Q = workspace, *S = Q + (size_t)T * qrow_floats(sh);
    float *acc = S + (size_t)T * KERN_MLA_KEY_BLOCK, *mx = acc + (size_t)T * acc_floats(sh);
    float *den = mx + T, *P = den + T, *Kx = P + gemm_floats(sh, T);
    if (expanded_pays(sh, T)) {
        /* expanded: Q = [q_nope | q_pe] * scale, the head's output straight out */
        const int qw = dn + dr;
        for (int t = 0; t < T; t++)
            for (int j = 0; j < qw; j++)
                Q[(size_t)t * qw + j] = scale * qh[(size_t)t * q_stride + j];
        const attn_form f = {wuk, wuv, Kx, Kx + (size_t)KERN_MLA_KEY_BLOCK * (dn + dr)};
        attend_rows(sh, &f, Q, T, pos, 1, cache, S, acc, mx, den, P, gemm_floats(sh, T), bf16_act);
        for (int t = 0; t < T; t++)
            memcpy(oh + (size_t)t * o_stride, acc + (size_t)t * dv, (size_t)dv * sizeof(float));
        return;
    }
    /* Q[:, :dc] = q_nope W_UK_h; Q[:, dc:] = q_pe; all times the scale. */
    gemm(wuk, dc, true, dc, dn, qh, q_stride, T, Q, row, false, P);
    for (int t = 0; t < T; t++) {
        for (int j = 0; j < dc; j++) Q[(size_t)t * row + j] *= scale;
        for (int j = 0; j < dr; j++)
            Q[(size_t)t * row + dc + j] = scale * qh[(size_t)t * q_stride + dn + j];
    }
    const attn_form f = {NULL, NULL, NULL, NULL};
    attend_rows(sh, &f, Q, T, pos, 1, cache, S, acc, mx, den, P, gemm_floats(sh, T), bf16_act);
    /* O_h = Lat W_UV_h^T, written into this head's columns of o */
    gemm(wuv, dc, false, dv, dc, acc, dc, T, oh, o_stride, false, P);
}

size_t kern_mla_decode_rows_workspace_floats(const kern_mla_shape *sh, int n) {
    if (!sh || sh->nh < 1 || n < 1) return 0;
    const size_t nh = (size_t)sh->nh, row = (size_t)sh->dc + sh->dr;
    /* one widened kv_b row [dc], Q [n, nh, row], Lat [n, nh, dc], S [nh,
     * KEY_BLOCK], max and denominator [2, nh], GEMM scratch */
    return (size_t)sh->dc + (size_t)n * nh * (row + (size_t)sh->dc) +
           nh * (KERN_MLA_KEY_BLOCK + 2) + gemm_floats(sh, sh->nh);
}

size_t kern_mla_decode_heads_workspace_floats(const kern_mla_shape *sh) {
    return kern_mla_decode_rows_workspace_floats(sh, 1);
}

void kern_mla_decode_rows(const kern_mla_shape *sh, const kern_weight *kv_b, int n,
                          const float *q, int h0, int h1, const int64_t *pos,
                          const float *const *cache, float *o, float *workspace) {
    const int dc = sh->dc, dn = sh->dn, dr = sh->dr, dv = sh->dv, row = dc + dr, nq = h1 - h0;
    if (nq < 1 || n < 1) return;
    const size_t q_stride = (size_t)sh->nh * (dn + dr), o_stride = (size_t)sh->nh * dv;
    const size_t q_rows = (size_t)nq * row, lat_rows = (size_t)nq * dc;
    const float scale = 1.0f / sqrtf((float)(dn + dr));
    float *w = workspace, *Q = w + dc, *lat = Q + (size_t)n * q_rows;
    float *S = lat + (size_t)n * lat_rows, *mx = S + (size_t)nq * KERN_MLA_KEY_BLOCK;
    float *den = mx + nq, *P = den + nq;
    /* Q[s, h] = [q_nope_sh W_UK_h | q_pe_sh] * scale. One query per head
     * and row, so no GEMM (whose panel packing cost more than the product
     * here): each row i of W_UK_h is widened once and added into every
     * row's query, q[s, h, i] W_UK_h[i, :], every Q[s, h, j] the same chain
     * over i whatever heads and rows share the call. */
    for (int h = h0; h < h1; h++) {
        for (int s = 0; s < n; s++)
            memset(Q + s * q_rows + (size_t)(h - h0) * row, 0, (size_t)dc * sizeof(float));
        for (int i = 0; i < dn; i++) {
            kern_weight_row_f32(kv_b, h * (dn + dv) + i, 0, dc, w);
            for (int s = 0; s < n; s++) {
                float *Qsh = Q + s * q_rows + (size_t)(h - h0) * row;
                const float qi = q[s * q_stride + (size_t)h * (dn + dr) + i];
                for (int j = 0; j < dc; j++) Qsh[j] += qi * w[j];
            }
        }
        for (int s = 0; s < n; s++) {
            float *Qsh = Q + s * q_rows + (size_t)(h - h0) * row;
            const float *qsh = q + s * q_stride + (size_t)h * (dn + dr);
            for (int j = 0; j < dc; j++) Qsh[j] *= scale;
            for (int j = 0; j < dr; j++) Qsh[dc + j] = scale * qsh[dn + j];
        }
    }
    /* each row's heads against its keys 0 .. pos[s]: each of its cache
     * blocks read once */
    const attn_form f = {NULL, NULL, NULL, NULL};
    for (int s = 0; s < n; s++)
        attend_rows(sh, &f, Q + s * q_rows, nq, pos[s], 0, cache[s], S, lat + s * lat_rows, mx,
                    den, P, gemm_floats(sh, sh->nh), false);
    /* o[s, h, r] = Lat[s, h] . W_UV_h[r, :]: sixteen running sums over the
     * columns, added up in a fixed order; W_UV_h's row widened once */
    for (int h = h0; h < h1; h++) {
        for (int r = 0; r < dv; r++) {
            kern_weight_row_f32(kv_b, h * (dn + dv) + dn + r, 0, dc, w);
            for (int s = 0; s < n; s++) {
                const float *lh = lat + s * lat_rows + (size_t)(h - h0) * dc;
                float part[16] = {0};
                int j = 0;
                for (; j + 16 <= dc; j += 16)
                    for (int l = 0; l < 16; l++) part[l] += lh[j + l] * w[j + l];
                for (; j < dc; j++) part[j % 16] += lh[j] * w[j];
                float sum = 0.0f;
                for (int l = 0; l < 16; l++) sum += part[l];
                o[s * o_stride + (size_t)h * dv + r] = sum;
            }
        }
    }
}

void kern_mla_decode_heads(const kern_mla_shape *sh, const kern_weight *kv_b, const float *q,
                           int h0, int h1, int64_t pos, const float *cache, float *o,
                           float *workspace) {
    kern_mla_decode_rows(sh, kv_b, 1, q, h0, h1, &pos, &cache, o, workspace);
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
