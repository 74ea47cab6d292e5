/*
 * The matrix products of kernels/cuda/kern_cuda_gemm.cu against the CPU:
 *   - kern_cuda_matmul on every path (GEMV for T <= 8, cuBLAS with a GEMM
 *     context in EXACT and BF16 mode, the tiled fallback without one)
 *     against kern_matmul: bf16 / f32 weights, T = 1, 3, 16, 17, 100,
 *     partial tiles, strides, accumulate, a context too small for one call;
 *   - kern_cuda_moe_experts (GEMV and tensor-core algorithms, plain and
 *     fused gate/up) against a loop of kern_matmul (+ kern_swiglu) per
 *     expert: empty experts, one expert taking every row, random routing by
 *     kern_moe_route + kern_moe_permute, rows past exp_off[E] untouched.
 * Tolerances, of the largest reference magnitude: exact paths 1e-5 (fp32
 * summation order only); EXACT bf16 split 2e-5; BF16 mode per element
 * 2^-8 sum_c |x W| (x rounded to bf16: <= 2^-9 relative each), and the EXACT
 * error must be 10x below the BF16 one, so a path that ignores the mode, or
 * silently runs another path, fails. Skips without a GPU.
 */
#include <criterion/criterion.h>

#ifdef KDS_HAVE_CUDA

#include "test_cuda_util.h"

typedef struct mm_case {
    kern_dtype dt;
    int rows, cols, T;
    bool accumulate;
    kern_cuda_gemm_ctx *ctx;
    kern_cuda_gemm_mode mode;
} mm_case;

/* Runs one kern_cuda_matmul and compares it with kern_matmul. Returns the
 * largest error over the largest magnitude; *bf16_ok tells whether every
 * element is within the bf16-rounding bound 2^-8 sum|x W| (+ 1e-6 big). */
static double run_mm(const mm_case *c, bool *bf16_ok) {
    const int rows = c->rows, cols = c->cols, T = c->T;
    uint64_t s = 0x6e3aull + (uint64_t)rows * 131 + (uint64_t)cols * 7 + (uint64_t)T;
    const int ldx = cols + 4, ldy = rows + 5; /* ldx % 4 == 0 iff cols % 4 == 0 */
    const size_t nw = (size_t)rows * cols;
    float *wf = tcu_malloc(nw * sizeof(float));
    tcu_fill(&s, wf, nw, -1.0f, 1.0f);
    if (c->dt == KERN_BF16) tcu_round_bf16(wf, nw);
    float *x = tcu_malloc((size_t)T * ldx * sizeof(float));
    tcu_fill(&s, x, (size_t)T * ldx, -2.0f, 2.0f);
    float *y0 = tcu_malloc((size_t)T * ldy * sizeof(float));
    tcu_fill(&s, y0, (size_t)T * ldy, -1.0f, 1.0f);
    float *xc = tcu_malloc((size_t)T * cols * sizeof(float));
    for (int t = 0; t < T; t++) memcpy(xc + (size_t)t * cols, x + (size_t)t * ldx, (size_t)cols * 4);
    float *prod = tcu_malloc((size_t)T * ldy * sizeof(float));
    void *wdev = tcu_upload_as(wf, nw, c->dt);
    /* CPU reference from the same (bf16-exact) weights */
    void *wcpu = wf;
    uint16_t *wb = NULL;
    if (c->dt == KERN_BF16) {
        wb = tcu_malloc(nw * sizeof *wb);
        for (size_t i = 0; i < nw; i++) wb[i] = kern_f32_to_bf16(wf[i]);
        wcpu = wb;
    }
    kern_matmul(c->dt, wcpu, cols, xc, T, prod, ldy, 0, rows, NULL);
    float *dx = tcu_upload(x, (size_t)T * ldx), *dy = tcu_upload(y0, (size_t)T * ldy);
    kds_err err = {0};
    kern_cuda_matmul_args a = {.W = wdev, .w_dtype = c->dt, .rows = rows, .cols = cols, .x = dx,
                               .ldx = ldx, .T = T, .y = dy, .ldy = ldy, .accumulate = c->accumulate,
                               .gemm = c->ctx, .mode = c->mode};
    cr_assert_eq(kern_cuda_matmul(&a, NULL, &err), KDS_OK, "%s", err.msg);
    float *got = tcu_malloc((size_t)T * ldy * sizeof(float));
    tcu_d2h(got, dy, (size_t)T * ldy * sizeof(float));
    double big = 0, worst = 0;
    for (int t = 0; t < T; t++)
        for (int r = 0; r < rows; r++) {
            const size_t i = (size_t)t * ldy + r;
            const double ref = c->accumulate ? (double)y0[i] + prod[i] : prod[i];
            if (fabs(ref) > big) big = fabs(ref);
        }
    bool ok = true;
    for (int t = 0; t < T; t++)
        for (int r = 0; r < rows; r++) {
            const size_t i = (size_t)t * ldy + r;
            const double ref = c->accumulate ? (double)y0[i] + prod[i] : prod[i];
            double e = fabs((double)got[i] - ref);
            if (isnan(e)) e = INFINITY;
            if (e > worst) worst = e;
            double mag = 0;
            for (int k = 0; k < cols; k++) mag += fabs((double)xc[(size_t)t * cols + k] * wf[(size_t)r * cols + k]);
            if (e > mag / 256.0 + 1e-6 * big) ok = false;
        }
    /* the padding columns [rows, ldy) are untouched */
    for (int t = 0; t < T; t++)
        for (int r = rows; r < ldy; r++)
            cr_assert_eq(got[(size_t)t * ldy + r], y0[(size_t)t * ldy + r],
                         "column %d of row %d (beyond rows) was written", r, t);
    if (bf16_ok) *bf16_ok = ok;
    kern_cuda_free(wdev), kern_cuda_free(dx), kern_cuda_free(dy);
    free(wf), free(wb), free(x), free(y0), free(xc), free(prod), free(got);
    return worst / (big > 0 ? big : 1);
}

static void expect_exact(const mm_case *c, double tol) {
    const double r = run_mm(c, NULL);
    printf("cuda_gemm %s rows=%d cols=%d T=%d acc=%d ctx=%d mode=%d: err/max = %.2e\n",
           c->dt == KERN_BF16 ? "bf16" : "f32", c->rows, c->cols, c->T, (int)c->accumulate,
           c->ctx != NULL, (int)c->mode, r);
    cr_expect_leq(r, tol, "%s rows=%d cols=%d T=%d acc=%d ctx=%d mode=%d: error %.3e > %.0e",
                  c->dt == KERN_BF16 ? "bf16" : "f32", c->rows, c->cols, c->T, (int)c->accumulate,
                  c->ctx != NULL, (int)c->mode, r, tol);
}

static kern_cuda_gemm_ctx *make_ctx(size_t elems) {
    kds_err err = {0};
    kern_cuda_gemm_ctx *c = NULL;
    cr_assert_eq(kern_cuda_gemm_ctx_create(elems, &c, &err), KDS_OK, "%s", err.msg);
    return c;
}

/* T <= 8: the GEMV, exact whatever the mode and context; 16-byte loads
 * (cols % 8 == 0) and element loads (cols = 50), rows not a multiple of 4. */
Test(cuda_gemm, gemv_small_T_exact) {
    tcu_require_device();
    kern_cuda_gemm_ctx *ctx = make_ctx(4096);
    const int Ts[] = {1, 3, 8};
    for (int i = 0; i < 3; i++) {
        mm_case c = {KERN_BF16, 37, 72, Ts[i], false, NULL, KERN_CUDA_GEMM_EXACT};
        expect_exact(&c, 1e-5);
        c.ctx = ctx, c.mode = KERN_CUDA_GEMM_BF16, c.accumulate = true; /* still exact */
        expect_exact(&c, 1e-5);
        c.cols = 50; /* element loads */
        expect_exact(&c, 1e-5);
        c.dt = KERN_F32, c.cols = 300, c.rows = 19; /* f32, several batches of chunks */
        expect_exact(&c, 1e-5);
        c.cols = 70;
        expect_exact(&c, 1e-5);
    }
    mm_case big = {KERN_BF16, 21, 2304, 2, false, NULL, KERN_CUDA_GEMM_EXACT}; /* Kimi's hidden */
    expect_exact(&big, 1e-5);
    kern_cuda_gemm_ctx_free(ctx);
}

/* The T = 1 GEMV's other geometries (kds_cuda_bench's sweep): the same
 * bytes as the default, which the test above holds to the CPU; rows that
 * fill no geometry's last warp, 16-byte chunks in several batches, with
 * and without accumulation, the columns past `rows` untouched. */
Test(cuda_gemm, gemv_variants_match_default_bit_for_bit) {
    tcu_require_device();
    const int shapes[][2] = {{37, 72}, {61, 2304}, {5, 520}};
    uint64_t rs = 91;
    for (int si = 0; si < 3; si++) {
        const int rows = shapes[si][0], cols = shapes[si][1], ldy = rows + 3;
        uint16_t *w = tcu_malloc((size_t)rows * cols * 2);
        float *x = tcu_malloc((size_t)cols * 4), *y0 = tcu_malloc((size_t)ldy * 4);
        float *want = tcu_malloc((size_t)ldy * 4), *got = tcu_malloc((size_t)ldy * 4);
        for (size_t i = 0; i < (size_t)rows * cols; i++) w[i] = (uint16_t)(tcu_next(&rs) >> 48) & 0xbfffu;
        tcu_fill(&rs, x, (size_t)cols, -1.0f, 1.0f);
        tcu_fill(&rs, y0, (size_t)ldy, -1.0f, 1.0f);
        void *dw = tcu_dev_alloc((size_t)rows * cols * 2);
        float *dx = tcu_dev_alloc((size_t)cols * 4), *dy = tcu_dev_alloc((size_t)ldy * 4);
        tcu_h2d(dw, w, (size_t)rows * cols * 2);
        tcu_h2d(dx, x, (size_t)cols * 4);
        for (int acc = 0; acc < 2; acc++)
            for (int v = 0; v <= KERN_CUDA_GEMV_VARIANTS; v++) {
                kds_err err = {0};
                tcu_h2d(dy, y0, (size_t)ldy * 4);
                kern_cuda_matmul_args a = {.W = dw, .w_dtype = KERN_BF16, .rows = rows, .cols = cols,
                                           .x = dx, .ldx = cols, .T = 1, .y = dy, .ldy = ldy,
                                           .accumulate = acc, .gemv_variant = v};
                cr_assert_eq(kern_cuda_matmul(&a, NULL, &err), KDS_OK, "%s", err.msg);
                tcu_d2h(v ? got : want, dy, (size_t)ldy * 4);
                if (v)
                    cr_expect_eq(memcmp(got, want, (size_t)ldy * 4), 0,
                                 "variant %d (%s), rows %d, cols %d, accumulate %d: not the default's bytes",
                                 v, kern_cuda_gemv_variant_name(v), rows, cols, acc);
                else
                    for (int r = rows; r < ldy; r++) cr_expect_eq(want[r], y0[r], "column %d written", r);
            }
        kern_cuda_free(dw), kern_cuda_free(dx), kern_cuda_free(dy);
        free(w), free(x), free(y0), free(want), free(got);
    }
}

/* T > 8 with a context: cuBLAS. EXACT within 2e-5, BF16 within its rounding
 * bound, and EXACT at least 10x closer. */
Test(cuda_gemm, cublas_modes_bf16_weights) {
    tcu_require_device();
    kern_cuda_gemm_ctx *ctx = make_ctx(100 * 136);
    const int Ts[] = {16, 17, 100};
    for (int i = 0; i < 3; i++)
        for (int acc = 0; acc < 2; acc++) {
            mm_case c = {KERN_BF16, 45, 136, Ts[i], acc, ctx, KERN_CUDA_GEMM_EXACT};
            bool ok = false;
            const double e_exact = run_mm(&c, NULL);
            c.mode = KERN_CUDA_GEMM_BF16;
            const double e_bf16 = run_mm(&c, &ok);
            printf("cuda_gemm cublas T=%d acc=%d: EXACT %.2e, BF16 %.2e\n", Ts[i], acc, e_exact, e_bf16);
            cr_expect_leq(e_exact, 2e-5, "T=%d acc=%d: EXACT error %.3e", Ts[i], acc, e_exact);
            cr_expect(ok, "T=%d acc=%d: BF16 mode outside the bf16 rounding bound (%.3e)", Ts[i], acc, e_bf16);
            cr_expect_gt(e_bf16, 10 * e_exact, "T=%d: BF16 (%.3e) not clearly less exact than EXACT (%.3e)",
                         Ts[i], e_bf16, e_exact);
        }
    kern_cuda_gemm_ctx_free(ctx);
}

/* f32 weights through cuBLAS stay fp32 (no TF32): 1e-5. */
Test(cuda_gemm, cublas_f32_weights) {
    tcu_require_device();
    kern_cuda_gemm_ctx *ctx = make_ctx(4096);
    mm_case c = {KERN_F32, 33, 70, 17, false, ctx, KERN_CUDA_GEMM_BF16};
    expect_exact(&c, 1e-5);
    c.accumulate = true, c.T = 100;
    expect_exact(&c, 1e-5);
    kern_cuda_gemm_ctx_free(ctx);
}

/* A context whose scratch holds 3 rows: the call runs in pieces, same result. */
Test(cuda_gemm, cublas_in_pieces) {
    tcu_require_device();
    kern_cuda_gemm_ctx *ctx = make_ctx(3 * 72 + 5);
    mm_case c = {KERN_BF16, 40, 72, 17, true, ctx, KERN_CUDA_GEMM_EXACT};
    expect_exact(&c, 2e-5);
    kern_cuda_gemm_ctx_free(ctx);
    /* scratch below one row: refused with a message */
    ctx = make_ctx(10);
    kds_err err = {0};
    float *d = tcu_dev_alloc(64 * 1024);
    kern_cuda_matmul_args a = {.W = d, .w_dtype = KERN_BF16, .rows = 16, .cols = 64, .x = d + 2048,
                               .ldx = 64, .T = 9, .y = d + 8192, .ldy = 16, .gemm = ctx};
    cr_expect_eq(kern_cuda_matmul(&a, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "scratch"), "message: %s", err.msg);
    kern_cuda_free(d);
    kern_cuda_gemm_ctx_free(ctx);
}

/* Without a context, T > 8 takes the tiled fallback: exact. */
Test(cuda_gemm, tiled_fallback_exact) {
    tcu_require_device();
    const int Ts[] = {16, 17, 100};
    for (int i = 0; i < 3; i++) {
        mm_case c = {KERN_BF16, 37, 50, Ts[i], i == 1, NULL, KERN_CUDA_GEMM_BF16};
        expect_exact(&c, 1e-5);
        c.dt = KERN_F32;
        expect_exact(&c, 1e-5);
    }
}

Test(cuda_gemm, bad_arguments_refused) {
    tcu_require_device();
    kds_err err = {0};
    kern_cuda_gemm_ctx *ctx = NULL;
    cr_expect_eq(kern_cuda_gemm_ctx_create(0, &ctx, &err), KDS_INVALID_ARG);
    cr_expect_null(ctx);
    cr_expect_eq(kern_cuda_gemm_ctx_create(16, NULL, &err), KDS_INVALID_ARG);
    kern_cuda_gemm_ctx_free(NULL);
    float *d = tcu_dev_alloc(4096);
    kern_cuda_matmul_args a = {.W = d, .w_dtype = KERN_BF16, .rows = 4, .cols = 4, .x = d,
                               .ldx = 4, .T = 1, .y = d + 64, .ldy = 4, .mode = 7};
    cr_expect_eq(kern_cuda_matmul(&a, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "mode"), "message: %s", err.msg);
    kern_cuda_moe_experts_args m = {.E = 4, .rows = 8, .cols = 8, .w_dtype = KERN_F32, .W = (void *)d,
                                    .exp_off = (int32_t *)d, .n_rows = 4, .x = d, .ldx = 8,
                                    .y = d + 256, .ldy = 8, .algo = KERN_CUDA_MOE_TENSOR};
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_UNSUPPORTED, "f32 on tensor cores");
    cr_expect(strstr(err.msg, "tensor"), "message: %s", err.msg);
    m.algo = KERN_CUDA_MOE_AUTO, m.ldy = 7;
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_INVALID_ARG);
    m.ldy = 8, m.w_dtype = KERN_F16;
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_INVALID_ARG);
    m.w_dtype = KERN_BF16, m.exp_off = NULL;
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_INVALID_ARG);
    m.exp_off = (int32_t *)d, m.W = NULL, m.W_base = d, m.w_stride = 64; /* < 8 x 8 bf16 */
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "w_stride"), "message: %s", err.msg);
    kern_cuda_free(d);
}

/* ---- grouped experts ---------------------------------------------------------- */

typedef struct moe_case {
    kern_dtype dt;
    int E, rows, cols, n_rows;
    const int32_t *off; /* host [E + 1]; off[E] <= n_rows */
    bool fused;
    kern_cuda_moe_algo algo;
    kern_cuda_gemm_mode mode;
    bool stacked; /* one buffer [E][W | W3 | 32 bytes] (W_base, w_stride), else pointer tables */
} moe_case;

/* Returns the largest error over the largest magnitude against a loop of
 * kern_matmul (+ kern_swiglu) per expert; checks untouched rows/columns. */
static double run_moe(const moe_case *c, uint64_t seed) {
    const int E = c->E, rows = c->rows, cols = c->cols, n = c->n_rows;
    const int ldx = cols + 4, ldy = rows + 3;
    uint64_t s = seed;
    const size_t nw = (size_t)rows * cols;
    const int nmat = c->fused ? 2 : 1;
    float *wf = tcu_malloc((size_t)nmat * E * nw * sizeof(float));
    tcu_fill(&s, wf, (size_t)nmat * E * nw, -1.0f, 1.0f);
    if (c->dt == KERN_BF16) tcu_round_bf16(wf, (size_t)nmat * E * nw);
    void **dw = tcu_malloc((size_t)nmat * E * sizeof *dw);
    for (int i = 0; i < nmat * E; i++) dw[i] = tcu_upload_as(wf + (size_t)i * nw, nw, c->dt);
    void *dtab = tcu_dev_alloc((size_t)nmat * E * sizeof(void *));
    tcu_h2d(dtab, dw, (size_t)nmat * E * sizeof(void *));
    /* the stacked form: expert e's W at e * stride, its W3 right after */
    const size_t mbytes = nw * kern_dtype_size(c->dt), stride = nmat * mbytes + 32;
    char *dstack = tcu_dev_alloc(E * stride);
    tcu_poison(dstack, E * stride);
    for (int e = 0; e < E; e++)
        for (int m = 0; m < nmat; m++) {
            void *tmp = tcu_malloc(mbytes);
            kds_err e2 = {0};
            cr_assert_eq(kern_cuda_memcpy_d2h(tmp, dw[m * E + e], mbytes, NULL, &e2), KDS_OK, "%s", e2.msg);
            tcu_h2d(dstack + e * stride + m * mbytes, tmp, mbytes);
            free(tmp);
        }
    float *x = tcu_malloc((size_t)n * ldx * sizeof(float));
    tcu_fill(&s, x, (size_t)n * ldx, -2.0f, 2.0f);
    float *y0 = tcu_malloc((size_t)n * ldy * sizeof(float));
    tcu_fill(&s, y0, (size_t)n * ldy, -1.0f, 1.0f);
    float *dx = tcu_upload(x, (size_t)n * ldx), *dy = tcu_upload(y0, (size_t)n * ldy);
    int32_t *doff = tcu_dev_alloc((size_t)(E + 1) * sizeof(int32_t));
    tcu_h2d(doff, c->off, (size_t)(E + 1) * sizeof(int32_t));
    kds_err err = {0};
    kern_cuda_moe_experts_args a = {
        .E = E, .rows = rows, .cols = cols, .w_dtype = c->dt,
        .W = c->stacked ? NULL : (const void *const *)dtab,
        .W3 = c->fused && !c->stacked ? (const void *const *)dtab + E : NULL,
        .W_base = c->stacked ? dstack : NULL, .W3_base = c->stacked && c->fused ? dstack + mbytes : NULL,
        .w_stride = c->stacked ? stride : 0, .exp_off = doff, .n_rows = n,
        .x = dx, .ldx = ldx, .y = dy, .ldy = ldy, .mode = c->mode, .algo = c->algo};
    cr_assert_eq(kern_cuda_moe_experts(&a, NULL, &err), KDS_OK, "%s", err.msg);
    float *got = tcu_malloc((size_t)n * ldy * sizeof(float));
    tcu_d2h(got, dy, (size_t)n * ldy * sizeof(float));
    /* reference, expert by expert */
    float *ref = tcu_malloc((size_t)n * ldy * sizeof(float));
    memcpy(ref, y0, (size_t)n * ldy * sizeof(float));
    float *xc = tcu_malloc((size_t)(n ? n : 1) * cols * sizeof(float));
    float *b = tcu_malloc((size_t)(n ? n : 1) * rows * sizeof(float));
    uint16_t *wb = tcu_malloc(nw * sizeof *wb);
    for (int e = 0; e < E; e++) {
        const int r0 = c->off[e], ne = c->off[e + 1] - r0;
        if (ne <= 0) continue;
        for (int i = 0; i < ne; i++) memcpy(xc + (size_t)i * cols, x + (size_t)(r0 + i) * ldx, (size_t)cols * 4);
        for (int m = 0; m < nmat; m++) {
            const float *w = wf + ((size_t)m * E + e) * nw;
            const void *wp = w;
            if (c->dt == KERN_BF16) {
                for (size_t i = 0; i < nw; i++) wb[i] = kern_f32_to_bf16(w[i]);
                wp = wb;
            }
            kern_matmul(c->dt, wp, cols, xc, ne, m == 0 ? ref + (size_t)r0 * ldy : b, m == 0 ? ldy : rows, 0,
                        rows, NULL);
        }
        if (c->fused)
            for (int i = 0; i < ne; i++) kern_swiglu(ref + (size_t)(r0 + i) * ldy, b + (size_t)i * rows, (size_t)rows);
    }
    double big = 0, worst = 0;
    for (size_t i = 0; i < (size_t)n * ldy; i++) {
        if (fabs(ref[i]) > big) big = fabs(ref[i]);
        double e = fabs((double)got[i] - ref[i]);
        if (isnan(e)) e = INFINITY;
        if (e > worst) worst = e;
    }
    /* rows past exp_off[E] and columns >= rows keep their values bit for bit */
    for (int t = 0; t < n; t++)
        for (int r = 0; r < ldy; r++)
            if (t >= c->off[E] || r >= rows)
                cr_assert_eq(got[(size_t)t * ldy + r], y0[(size_t)t * ldy + r],
                             "y[%d, %d] outside every group was written", t, r);
    for (int i = 0; i < nmat * E; i++) kern_cuda_free(dw[i]);
    kern_cuda_free(dtab), kern_cuda_free(dstack), kern_cuda_free(dx), kern_cuda_free(dy), kern_cuda_free(doff);
    free(wf), free(dw), free(x), free(y0), free(got), free(ref), free(xc), free(b), free(wb);
    return worst / (big > 0 ? big : 1);
}

static const char *algo_name(kern_cuda_moe_algo a) {
    return a == KERN_CUDA_MOE_GEMV ? "gemv" : a == KERN_CUDA_MOE_TENSOR ? "tensor" : "auto";
}

/* Exact paths (GEMV: 1e-5; tensor cores EXACT: 2e-5); for the tensor
 * cores, BF16 mode must be clearly less exact. */
static void check_moe(moe_case c, const char *what, uint64_t seed) {
    c.mode = KERN_CUDA_GEMM_EXACT;
    const double e = run_moe(&c, seed);
    const double tol = c.algo == KERN_CUDA_MOE_GEMV || c.dt == KERN_F32 ? 1e-5 : 2e-5;
    printf("cuda_gemm moe %-28s %s %s%s%s: EXACT err/max %.2e\n", what, c.dt == KERN_BF16 ? "bf16" : "f32",
           algo_name(c.algo), c.fused ? " fused" : "", c.stacked ? " stacked" : "", e);
    cr_expect_leq(e, tol, "%s %s%s: EXACT error %.3e > %.0e", what, algo_name(c.algo), c.fused ? " fused" : "", e,
                  tol);
    if (c.algo != KERN_CUDA_MOE_TENSOR || c.off[c.E] == 0) return; /* no rows: nothing to compare */
    c.mode = KERN_CUDA_GEMM_BF16;
    const double eb = run_moe(&c, seed);
    printf("cuda_gemm moe %-28s bf16 tensor%s: BF16 err/max %.2e\n", what, c.fused ? " fused" : "", eb);
    cr_expect_leq(eb, 2e-2, "%s: BF16 error %.3e", what, eb);
    cr_expect_gt(eb, 10 * e, "%s: BF16 (%.3e) not clearly less exact than EXACT (%.3e)", what, eb, e);
}

/* Empty experts and one expert taking every row (partial last tiles of 8
 * and of 64 rows); n_rows above exp_off[E] (rows never touched). */
Test(cuda_gemm, moe_one_expert_takes_all) {
    tcu_require_device();
    const int32_t off[] = {0, 0, 0, 70, 70, 70};
    for (int al = 1; al <= 2; al++)
        for (int f = 0; f < 2; f++) {
            moe_case c = {KERN_BF16, 5, 80, 72, 75, off, f, al, 0, f};
            check_moe(c, "one expert, 70 rows", 11);
        }
    moe_case c = {KERN_F32, 5, 21, 36, 75, off, true, KERN_CUDA_MOE_GEMV, 0, false};
    check_moe(c, "one expert, 70 rows", 12);
    const int32_t none[] = {0, 0, 0, 0, 0, 0}; /* no rows at all: nothing written */
    moe_case z = {KERN_BF16, 5, 16, 16, 9, none, false, KERN_CUDA_MOE_TENSOR, 0, false};
    check_moe(z, "no rows", 13);
    z.algo = KERN_CUDA_MOE_GEMV;
    check_moe(z, "no rows", 13);
}

/* Uneven groups with empties between them, element loads (cols 50) on the
 * GEMV path. */
Test(cuda_gemm, moe_uneven_groups) {
    tcu_require_device();
    const int32_t off[] = {0, 1, 1, 10, 12, 12, 29, 29};
    moe_case c = {KERN_BF16, 7, 24, 50, 29, off, false, KERN_CUDA_MOE_GEMV, 0, false};
    check_moe(c, "uneven, cols 50", 21);
    c.fused = true;
    check_moe(c, "uneven, cols 50", 22);
    c.cols = 48, c.fused = false, c.algo = KERN_CUDA_MOE_TENSOR;
    check_moe(c, "uneven, cols 48", 23);
    c.stacked = true;
    check_moe(c, "uneven, cols 48", 25);
    c.dt = KERN_F32, c.algo = KERN_CUDA_MOE_GEMV, c.cols = 50;
    check_moe(c, "uneven, cols 50", 24);
    c.fused = true, c.stacked = true; /* element loads from the stacked form */
    check_moe(c, "uneven, cols 50", 26);
}

/* Random routing: CPU routing and permutation of T tokens (kern_moe_route,
 * kern_moe_permute), rows gathered as kern_cuda_moe_gather would. */
static void check_routed(int T, int E, int k, int rows, int cols, kern_cuda_moe_algo algo, bool fused,
                         uint64_t seed) {
    uint64_t s = seed;
    float *scores = tcu_malloc((size_t)T * E * sizeof(float));
    tcu_fill(&s, scores, (size_t)T * E, 0.0f, 1.0f);
    int32_t *sel = tcu_malloc((size_t)T * k * sizeof(int32_t));
    float *w = tcu_malloc((size_t)T * k * sizeof(float));
    int32_t *off = tcu_malloc((size_t)(E + 1) * sizeof(int32_t));
    int32_t *row_of = tcu_malloc((size_t)T * k * sizeof(int32_t));
    int32_t *tok_of = tcu_malloc((size_t)T * k * sizeof(int32_t));
    kern_moe_route_params p = {.n_experts = E, .top_k = k, .n_group = 1, .topk_group = 1,
                               .renormalize = 1, .routed_scaling_factor = 1.0f};
    kern_moe_route(&p, T, scores, NULL, sel, w);
    kern_moe_permute(E, T, k, sel, off, row_of, tok_of);
    int empty = 0, most = 0;
    for (int e = 0; e < E; e++) {
        empty += off[e + 1] == off[e];
        if (off[e + 1] - off[e] > most) most = off[e + 1] - off[e];
    }
    char what[64];
    snprintf(what, sizeof what, "routed T=%d E=%d k=%d (%d empty, max %d)", T, E, k, empty, most);
    moe_case c = {KERN_BF16, E, rows, cols, T * k, off, fused, algo, 0, (seed & 1) != 0};
    check_moe(c, what, seed + 1);
    free(scores), free(sel), free(w), free(off), free(row_of), free(tok_of);
}

Test(cuda_gemm, moe_random_routing) {
    tcu_require_device();
    check_routed(3, 16, 4, 40, 64, KERN_CUDA_MOE_GEMV, true, 31);   /* decode-like: 1 row per expert */
    check_routed(24, 8, 3, 40, 64, KERN_CUDA_MOE_GEMV, false, 32);  /* ~9 rows: chunks of 8 + rest */
    check_routed(24, 8, 3, 72, 64, KERN_CUDA_MOE_TENSOR, true, 33); /* partial 64-row tiles */
    check_routed(40, 6, 2, 65, 40, KERN_CUDA_MOE_AUTO, false, 34);  /* auto -> tensor cores */
}

#else

Test(cuda_gemm, skipped_without_cuda) {
    cr_skip_test("built without CUDA (KDS_HAVE_CUDA unset)");
}

#endif
