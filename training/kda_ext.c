/*
 * kda_ext.c - the KDA delta rule (kda-model-spec.md section 3.5), forward and
 * backward, for training on the CPU. Loaded by kda_ext.py through ctypes
 * (built on first use with gcc -O3 -fopenmp); no Python headers needed.
 *
 * Per (batch, head) sequence, state S [K][V] (row = key dim), S_0 = 0:
 *   P   = diag(exp(g_t)) S_{t-1}
 *   u   = v_t - P^T k_t
 *   S_t = P + beta_t k_t u^T
 *   o_t = S_t^T q_t            (q already scaled by K^-1/2 by the caller)
 * The forward stores the state entering every CK-token segment; the backward
 * recomputes a segment's states from it and runs the steps in reverse with
 * the gradient dS of the current state. All arithmetic is float32, arrays are contiguous
 * [BH][T][K] (q, k, g), [BH][T][V] (v, o), [BH][T] (beta).
 */
#include <math.h>
#include <stddef.h>
#include <string.h>

/* One step: St = state after token t from Sp; writes o_t when o != NULL. */
static void step_fwd(int K, int V, const float *Sp, float *St, const float *qt, const float *kt,
                     const float *vt, const float *gt, float b, float *ot) {
    float u[V];
    for (int j = 0; j < V; j++) u[j] = vt[j];
    for (int i = 0; i < K; i++) {
        const float ai = expf(gt[i]), ki = kt[i];
        const float *sp = Sp + (size_t)i * V;
        float *st = St + (size_t)i * V;
        for (int j = 0; j < V; j++) {
            st[j] = ai * sp[j];
            u[j] -= ki * st[j];
        }
    }
    if (ot)
        for (int j = 0; j < V; j++) ot[j] = 0.0f;
    for (int i = 0; i < K; i++) {
        const float bk = b * kt[i], qi = qt[i];
        float *st = St + (size_t)i * V;
        for (int j = 0; j < V; j++) st[j] += bk * u[j];
        if (ot)
            for (int j = 0; j < V; j++) ot[j] += qi * st[j];
    }
}

/* states: [BH][T/CK + 1][K][V], the state entering every CK-token segment
 * (S_0, S_CK, S_2CK, ...). */
void kda_fwd(int BH, int T, int K, int V, int CK, const float *q, const float *k,
             const float *v, const float *g, const float *beta, float *o, float *states) {
    const int NS = T / CK + 1;
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < BH; bh++) {
        float buf[2][K * V];
        float *ckpt = states + (size_t)bh * NS * K * V;
        memset(buf[0], 0, sizeof buf[0]);
        for (int t = 0; t < T; t++) {
            const size_t tk = ((size_t)bh * T + t) * K, tv = ((size_t)bh * T + t) * V;
            if (t % CK == 0) memcpy(ckpt + (size_t)(t / CK) * K * V, buf[t & 1], sizeof buf[0]);
            step_fwd(K, V, buf[t & 1], buf[(t + 1) & 1], q + tk, k + tk, v + tv, g + tk,
                     beta[(size_t)bh * T + t], o + tv);
        }
    }
}

void kda_bwd(int BH, int T, int K, int V, int CK, const float *q, const float *k,
             const float *v, const float *g, const float *beta, const float *states,
             const float *dout, float *dq, float *dk, float *dv, float *dg, float *dbeta,
             float *work) {
    const int NS = T / CK + 1;
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < BH; bh++) {
        float u[V], w[V], du[V], a[K];
        float dS[K * V];
        memset(dS, 0, sizeof dS);
        /* the states of one segment, recomputed from its checkpoint */
        float *seg = work + (size_t)bh * (CK + 1) * K * V;
        for (int t = T - 1; t >= 0; t--) {
            const int t0 = t - t % CK;
            if (t == T - 1 || t % CK == CK - 1) {
                memcpy(seg, states + ((size_t)bh * NS + t0 / CK) * K * V, sizeof dS);
                for (int r = t0; r <= t; r++) {
                    const size_t rk = ((size_t)bh * T + r) * K, rv = ((size_t)bh * T + r) * V;
                    step_fwd(K, V, seg + (size_t)(r - t0) * K * V,
                             seg + (size_t)(r - t0 + 1) * K * V, q + rk, k + rk, v + rv, g + rk,
                             beta[(size_t)bh * T + r], NULL);
                }
            }
            const size_t tk = ((size_t)bh * T + t) * K, tv = ((size_t)bh * T + t) * V;
            const float *Sp = seg + (size_t)(t - t0) * K * V, *St = Sp + (size_t)K * V;
            const float *kt = k + tk, *qt = q + tk, *gt = g + tk, *vt = v + tv, *dot = dout + tv;
            const float b = beta[(size_t)bh * T + t];
            /* recompute u = v - (a * Sp)^T k */
            for (int j = 0; j < V; j++) u[j] = vt[j];
            for (int i = 0; i < K; i++) {
                a[i] = expf(gt[i]);
                const float aki = a[i] * kt[i];
                const float *sp = Sp + (size_t)i * V;
                for (int j = 0; j < V; j++) u[j] -= aki * sp[j];
            }
            /* o = St^T q:  dS += q do^T, dq = St do; then w = dS^T k */
            for (int j = 0; j < V; j++) w[j] = 0.0f;
            for (int i = 0; i < K; i++) {
                const float qi = qt[i], ki = kt[i];
                const float *st = St + (size_t)i * V;
                float *ds = dS + (size_t)i * V;
                float acc = 0.0f;
                for (int j = 0; j < V; j++) {
                    ds[j] += qi * dot[j];
                    acc += st[j] * dot[j];
                    w[j] += ds[j] * ki;
                }
                dq[tk + i] = acc;
            }
            /* S_t = P + b k u^T */
            float db = 0.0f;
            for (int j = 0; j < V; j++) {
                db += w[j] * u[j];
                du[j] = b * w[j];
                dv[tv + j] = du[j];
            }
            dbeta[(size_t)bh * T + t] = db;
            /* u = v - P^T k; P = a * Sp */
            for (int i = 0; i < K; i++) {
                const float ki = kt[i], ai = a[i];
                const float *sp = Sp + (size_t)i * V;
                float *ds = dS + (size_t)i * V;
                float dk1 = 0.0f, dk2 = 0.0f, da = 0.0f;
                for (int j = 0; j < V; j++) {
                    dk1 += ds[j] * u[j];
                    dk2 += sp[j] * du[j];
                    const float dp = ds[j] - ki * du[j];
                    da += dp * sp[j];
                    ds[j] = ai * dp;
                }
                dk[tk + i] = b * dk1 - ai * dk2;
                dg[tk + i] = da * ai;
            }
        }
    }
}

#ifdef _OPENMP
#include <omp.h>
void kda_set_threads(int n) { omp_set_num_threads(n); }
#else
void kda_set_threads(int n) { (void)n; }
#endif
