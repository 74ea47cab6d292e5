/*
 * test_cuda_k3.c - the CUDA kernels of Kimi K3's operators against their CPU
 * references (kern.h: kernels/cpu/k3.c, kernels/cpu/quant.c):
 *   kern_cuda_situ, kern_cuda_sigmoid_mul   kern_situ, kern_sigmoid_mul, per
 *                        element: |gpu - cpu| <= 4e-6 |cpu| + 1e-6 max|cpu|
 *                        (tanhf / expf against the CPU's tanhf and its own
 *                        exp: a few ulp), both load paths, saturation;
 *   kern_cuda_attn_res_mix   kern_attn_res_mix: 1, 2, 9 (K3) and 64
 *                        candidates, with and without the partial, D from 1
 *                        to 8192 (K3: 7168), vector and element loads,
 *                        padded snapshot strides (NaN in the gaps), peaked
 *                        and flat softmaxes: 1e-5 of the largest |out|;
 *   kern_cuda_moe_experts, act SITU  a loop of kern_matmul + kern_situ per
 *                        expert (bf16 / f32 weights, GEMV and tensor cores);
 *   kern_cuda_moe_experts, MXFP4 weights  a loop of kern_matmul_w (+
 *                        kern_swiglu / kern_situ) per expert: GEMV and
 *                        tensor cores, plain and fused, pointer tables and
 *                        the stacked buffer, uneven groups with empty
 *                        experts, random codes (all 16) and scales, the
 *                        E8M0 extremes (0: 2^-127; 255: NaN where the CPU
 *                        has NaN), K3's expert shape.
 * Expert tolerances as test_cuda_gemm.c: exact paths (GEMV) 1e-5 of the
 * largest magnitude, tensor cores EXACT 2e-5, BF16 mode <= 2e-2 and 10x
 * worse than EXACT. GPU tests skip with "no CUDA device: <reason>".
 */
#include <criterion/criterion.h>

#ifdef KDS_HAVE_CUDA

#include "test_cuda_util.h"

/* ---- element kernels ---------------------------------------------------------- */

/* Per-element check: |got - want| <= rel |want| + floor * max|want|. */
static void assert_elems(const float *got, const float *want, size_t n, double rel, double floor,
                         const char *what) {
    double mag = 0.0, worst = 0.0;
    size_t wi = 0;
    for (size_t i = 0; i < n; i++)
        if (fabs((double)want[i]) > mag) mag = fabs((double)want[i]);
    bool ok = true;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - (double)want[i]);
        if (isnan(e)) e = INFINITY;
        const double lim = rel * fabs((double)want[i]) + floor * mag;
        if (!(e <= lim) && ok) ok = false, wi = i;
        if (mag > 0 && e / mag > worst) worst = e / mag;
    }
    printf("cuda check %-52s max err / max|ref| = %.2e (tol %.0e rel + %.0e)\n", what, worst, rel,
           floor);
    fflush(stdout);
    cr_assert(ok, "%s: [%zu] gpu %.9g cpu %.9g", what, wi, (double)got[wi], (double)want[wi]);
}

/* n values a, b from [-lo, hi) with specials planted (0, tiny, the
 * sigmoid's and tanh's saturation). */
static void fill_act(uint64_t *s, float *a, float *b, size_t n) {
    tcu_fill(s, a, n, -30.0f, 30.0f);
    tcu_fill(s, b, n, -120.0f, 120.0f);
    const float sp[] = {0.0f,    -0.0f,  1e-8f, -1e-8f, 1e-30f, 100.0f,
                        -100.0f, -89.0f, 89.0f, 4.0f,   -4.0f,  25.0f};
    for (size_t i = 0; i < sizeof sp / sizeof sp[0] && i < n; i++)
        a[i] = sp[i], b[n - 1 - i] = sp[i];
    for (size_t i = 12; i + 1 < n; i += 97)
        a[i] *= 0.01f, b[i + 1] *= 0.01f; /* the small-argument range */
}

typedef enum { OP_SITU, OP_SIGMUL } elem_op;

/* One call on n values at offset off (0: 16-byte aligned, vector loads;
 * 1: element loads) against the CPU. */
static void check_elem(elem_op op, size_t n, size_t off, float beta, float beta_l, uint64_t seed) {
    uint64_t s = seed;
    float *a = tcu_malloc((n + off) * sizeof(float)), *b = tcu_malloc((n + off) * sizeof(float));
    fill_act(&s, a + off, b + off, n);
    float *da = tcu_upload(a, n + off), *db = tcu_upload(b, n + off);
    kds_err err = {0};
    kds_status st = op == OP_SITU ? kern_cuda_situ(da + off, db + off, n, beta, beta_l, NULL, &err)
                                  : kern_cuda_sigmoid_mul(da + off, db + off, n, NULL, &err);
    cr_assert_eq(st, KDS_OK, "%s", err.msg);
    float *got = tcu_malloc((n + off) * sizeof(float));
    tcu_d2h(got, da, (n + off) * sizeof(float));
    float *ref = tcu_malloc((n + off) * sizeof(float));
    memcpy(ref, a, (n + off) * sizeof(float));
    if (op == OP_SITU)
        kern_situ(ref + off, b + off, n, beta, beta_l);
    else
        kern_sigmoid_mul(ref + off, b + off, n);
    char what[96];
    snprintf(what, sizeof what, "%s n=%zu%s beta %g/%g", op == OP_SITU ? "situ" : "sigmoid_mul", n,
             off ? " misaligned" : "", (double)beta, (double)beta_l);
    assert_elems(got + off, ref + off, n, 4e-6, 1e-6, what);
    for (size_t i = 0; i < off; i++)
        cr_assert_eq(got[i], a[i], "value before the range was written");
    kern_cuda_free(da), kern_cuda_free(db);
    free(a), free(b), free(got), free(ref);
}

Test(cuda_k3, situ_matches_cpu) {
    tcu_require_device();
    check_elem(OP_SITU, 1027, 0, 4.0f, 25.0f, 1); /* K3's betas; a float4 tail of 3 */
    check_elem(OP_SITU, 1027, 1, 4.0f, 25.0f, 2); /* element loads */
    check_elem(OP_SITU, 64, 0, 1.0f, 2.5f, 3);    /* other caps */
    check_elem(OP_SITU, 3, 0, 4.0f, 25.0f, 4);    /* tail only */
}

Test(cuda_k3, sigmoid_mul_matches_cpu) {
    tcu_require_device();
    check_elem(OP_SIGMUL, 1027, 0, 0, 0, 5);
    check_elem(OP_SIGMUL, 1027, 1, 0, 0, 6);
    check_elem(OP_SIGMUL, 1, 0, 0, 0, 7);
}

/* More values than one pass of the capped grid (8192 CTAs x 256 threads x
 * 4): the grid-stride loop. */
Test(cuda_k3, situ_grid_stride, .timeout = 600) {
    tcu_require_device();
    check_elem(OP_SITU, (size_t)8192 * 256 * 4 + 5, 0, 4.0f, 25.0f, 8);
}

Test(cuda_k3, element_kernels_refuse_bad_arguments) {
    kds_err err = {0};
    static float d[4] __attribute__((aligned(16)));
    cr_expect_eq(kern_cuda_situ(d, d, 4, 0.0f, 25.0f, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "beta"), "message: %s", err.msg);
    cr_expect_eq(kern_cuda_situ(d, d, 4, 4.0f, NAN, NULL, &err), KDS_INVALID_ARG);
    cr_expect_eq(kern_cuda_situ(d, d, 4, INFINITY, 25.0f, NULL, &err), KDS_INVALID_ARG);
    cr_expect_eq(kern_cuda_situ(NULL, d, 4, 4.0f, 25.0f, NULL, &err), KDS_INVALID_ARG);
    cr_expect_eq(kern_cuda_situ(NULL, NULL, 0, 4.0f, 25.0f, NULL, &err), KDS_OK,
                 "n = 0: nothing to do");
    cr_expect_eq(kern_cuda_sigmoid_mul(d, NULL, 4, NULL, &err), KDS_INVALID_ARG);
    cr_expect_eq(kern_cuda_sigmoid_mul(NULL, NULL, 0, NULL, &err), KDS_OK);
}

/* ---- Block Attention Residuals' mix -------------------------------------------- */

typedef struct ar_case {
    int T, D, n_blocks;
    bool partial;
    size_t pad;    /* block_stride = T * D + pad (NaN in the gaps) */
    float u_scale; /* z's spread is about u_scale * 3 */
    size_t off;    /* floats by which every buffer is offset (1: element loads) */
    uint64_t seed;
} ar_case;

static void check_ar(const ar_case *c) {
    const int T = c->T, D = c->D, nb = c->n_blocks;
    const size_t rowsz = (size_t)T * D, stride = rowsz + c->pad, off = c->off;
    uint64_t s = c->seed;
    const size_t nblk = nb > 0 ? (size_t)nb * stride : 1;
    float *blocks = tcu_malloc((nblk + off) * sizeof(float));
    for (size_t i = 0; i < nblk + off; i++)
        blocks[i] = NAN; /* the gaps between snapshots */
    for (int j = 0; j < nb; j++) {
        /* candidates of different sizes, so the rms matters */
        const float amp = 0.2f + 3.0f * (float)((j * 7) % 5);
        tcu_fill(&s, blocks + off + (size_t)j * stride, rowsz, -amp, amp);
    }
    float *partial = tcu_malloc((rowsz + off) * sizeof(float));
    tcu_fill(&s, partial, rowsz + off, -1.5f, 1.5f);
    float *u = tcu_malloc((D + off) * sizeof(float));
    const float ua = c->u_scale * 3.0f * sqrtf(3.0f) / sqrtf((float)D);
    tcu_fill(&s, u, D + off, -ua, ua);
    float *ref = tcu_malloc(rowsz * sizeof(float));
    kern_attn_res_mix(T, D, nb ? blocks + off : NULL, stride, nb, c->partial ? partial + off : NULL,
                      u + off, 1e-5f, ref);
    float *dblocks = tcu_upload(blocks, nblk + off), *dpartial = tcu_upload(partial, rowsz + off);
    float *du = tcu_upload(u, D + off);
    float *dout = tcu_dev_alloc((rowsz + off) * sizeof(float));
    tcu_poison(dout, (rowsz + off) * sizeof(float));
    kern_cuda_attn_res_args a = {.T = T,
                                 .D = D,
                                 .blocks = nb ? dblocks + off : NULL,
                                 .block_stride = stride,
                                 .n_blocks = nb,
                                 .partial = c->partial ? dpartial + off : NULL,
                                 .u = du + off,
                                 .eps = 1e-5f,
                                 .out = dout + off};
    kds_err err = {0};
    cr_assert_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_OK, "%s", err.msg);
    float *got = tcu_malloc(rowsz * sizeof(float));
    tcu_d2h(got, dout + off, rowsz * sizeof(float));
    char what[96];
    snprintf(what, sizeof what, "attn_res T=%d D=%d %d blocks%s%s%s u x%g", T, D, nb,
             c->partial ? " + partial" : "", c->pad ? " padded" : "", off ? " misaligned" : "",
             (double)c->u_scale);
    tcu_assert_close(got, ref, rowsz, 1e-5, what);
    kern_cuda_free(dblocks), kern_cuda_free(dpartial), kern_cuda_free(du), kern_cuda_free(dout);
    free(blocks), free(partial), free(u), free(ref), free(got);
}

Test(cuda_k3, attn_res_small_shapes) {
    tcu_require_device();
    check_ar(&(ar_case){.T = 3, .D = 64, .n_blocks = 2, .partial = true, .u_scale = 1, .seed = 11});
    check_ar(&(ar_case){
        .T = 2, .D = 64, .n_blocks = 5, .partial = false, .pad = 12, .u_scale = 1, .seed = 12});
    check_ar(&(ar_case){
        .T = 2, .D = 100, .n_blocks = 0, .partial = true, .u_scale = 1, .seed = 13}); /* one */
    check_ar(&(ar_case){.T = 1, .D = 1, .n_blocks = 1, .partial = true, .u_scale = 1, .seed = 14});
    check_ar(&(ar_case){
        .T = 4, .D = 50, .n_blocks = 3, .partial = true, .pad = 1, .u_scale = 1, .seed = 15});
    check_ar(&(ar_case){
        .T = 2, .D = 64, .n_blocks = 3, .partial = true, .u_scale = 1, .off = 1, .seed = 16});
    check_ar(&(ar_case){
        .T = 2, .D = 96, .n_blocks = 4, .partial = true, .u_scale = 0, .seed = 17}); /* mean */
    check_ar(&(ar_case){
        .T = 2, .D = 96, .n_blocks = 4, .partial = true, .u_scale = 15, .seed = 18}); /* peaked */
}

/* 64 candidates: eight groups of the online softmax (D <= 2048: G = 8),
 * and sixteen at D = 4099 (element loads, G = 4). */
Test(cuda_k3, attn_res_64_candidates) {
    tcu_require_device();
    check_ar(
        &(ar_case){.T = 2, .D = 128, .n_blocks = 63, .partial = true, .u_scale = 2, .seed = 21});
    check_ar(
        &(ar_case){.T = 1, .D = 4099, .n_blocks = 64, .partial = false, .u_scale = 2, .seed = 22});
}

/* Every instantiation: float4 units per thread 1, 2, 4 (D 96, 2304, 4096)
 * and element units 1, 2, 4, 8, 16 (D 50, 1001, 2001, 3999, 8191). */
Test(cuda_k3, attn_res_every_width_class) {
    tcu_require_device();
    const int Ds[] = {96, 2304, 4096, 50, 1001, 2001, 3999, 8191};
    for (int i = 0; i < 8; i++)
        check_ar(&(ar_case){.T = 2,
                            .D = Ds[i],
                            .n_blocks = 4,
                            .partial = true,
                            .pad = 4 * (size_t)(i % 2),
                            .u_scale = 1.5f,
                            .seed = 25 + (uint64_t)i});
}

/* K3: 8 snapshots + the partial of width 7168; and the largest width. */
Test(cuda_k3, attn_res_k3_shape) {
    tcu_require_device();
    check_ar(
        &(ar_case){.T = 3, .D = 7168, .n_blocks = 8, .partial = true, .u_scale = 1, .seed = 31});
    check_ar(
        &(ar_case){.T = 2, .D = 7168, .n_blocks = 8, .partial = true, .u_scale = 8, .seed = 32});
    check_ar(&(ar_case){
        .T = 1, .D = 8192, .n_blocks = 5, .partial = true, .pad = 4, .u_scale = 1, .seed = 33});
    check_ar(
        &(ar_case){.T = 1, .D = 8191, .n_blocks = 2, .partial = true, .u_scale = 1, .seed = 34});
}

Test(cuda_k3, attn_res_refuses_bad_arguments) {
    static float d[64] __attribute__((aligned(16)));
    kds_err err = {0};
    const kern_cuda_attn_res_args ok = {.T = 1,
                                        .D = 16,
                                        .blocks = d,
                                        .block_stride = 16,
                                        .n_blocks = 2,
                                        .partial = d,
                                        .u = d,
                                        .eps = 1e-5f,
                                        .out = d + 32};
    kern_cuda_attn_res_args a = ok;
    cr_expect_eq(kern_cuda_attn_res_mix(NULL, NULL, &err), KDS_INVALID_ARG);
    a.n_blocks = 0, a.partial = NULL; /* no candidate */
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "candidates"), "message: %s", err.msg);
    a = ok, a.n_blocks = 64; /* 65 with the partial */
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_INVALID_ARG);
    a = ok, a.T = -1;
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_INVALID_ARG);
    a = ok, a.D = KERN_CUDA_ATTN_RES_MAX_D + 1;
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_UNSUPPORTED);
    cr_expect(strstr(err.msg, "D=8193"), "message: %s", err.msg);
    a = ok, a.D = 0;
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_UNSUPPORTED);
    a = ok, a.u = NULL;
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_INVALID_ARG);
    a = ok, a.blocks = NULL;
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_INVALID_ARG);
    a = ok, a.T = 0, a.u = NULL; /* nothing to do */
    cr_expect_eq(kern_cuda_attn_res_mix(&a, NULL, &err), KDS_OK);
}

/* ---- grouped experts: SiTU and MXFP4 -------------------------------------------- */

/* One expert matrix on the host: f32 values (bf16-exact for BF16), or
 * MXFP4 codes and scales. */
typedef struct hmat {
    float *f;
    uint16_t *h;
    uint8_t *codes, *scales;
} hmat;

typedef struct k3_moe_case {
    kern_dtype dt; /* BF16, F32 or MXFP4 */
    int E, rows, cols, n_rows;
    const int32_t *off; /* host [E + 1]; off[E] <= n_rows */
    bool fused;
    kern_cuda_moe_act act;
    kern_cuda_moe_algo algo;
    kern_cuda_gemm_mode mode;
    bool stacked;   /* one buffer [E][W | W3 | 32 bytes] (+ scales [E][S | S3 | 7 bytes]) */
    int scale_case; /* MXFP4: 0 random around the size; 1 all 0 (2^-127) with big x; 2 NaN blocks */
    int shift;      /* weights times 2^shift: > 0 saturates SiTU's caps, < 0 keeps to its slopes */
    uint64_t seed;
} k3_moe_case;

#define K3_BETA 4.0f
#define K3_BETA_L 25.0f

/* Scale byte around which the products come out O(1-10) (SiTU's range):
 * |sum| ~ sqrt(cols) * rms(x) * rms(e2m1) * 2^(s - 127). The errors are
 * measured against the largest |y|; SiTU caps |y| at 4 * 25, so its
 * saturated cases compare a product's error with a capped maximum, which
 * the exact GEMV passes and the tensor cores' 16-bit x (EXACT) does not
 * always: their SiTU cases keep the products in the slopes (shift -2). */
static int scale_center(int cols) {
    return 127 - (int)lround(log2(sqrt((double)cols) * 0.58 * 2.9 / 3.0));
}

static hmat make_mat(const k3_moe_case *c, uint64_t *s) {
    hmat m = {0};
    const size_t nw = (size_t)c->rows * c->cols;
    if (c->dt == KERN_MXFP4) {
        const kern_layout l = kern_weight_layout(KERN_MXFP4, c->rows, c->cols);
        m.codes = tcu_malloc(l.data_bytes), m.scales = tcu_malloc(l.scale_bytes);
        for (size_t i = 0; i < l.data_bytes; i++)
            m.codes[i] = (uint8_t)(tcu_next(s) >> 56); /* every code */
        const int sc = scale_center(c->cols) + c->shift;
        for (size_t i = 0; i < l.scale_bytes; i++) {
            m.scales[i] = c->scale_case == 1 ? 0 : (uint8_t)(sc - 2 + (int)(tcu_next(s) % 5));
            if (c->scale_case == 2 && tcu_next(s) % 13 == 0) m.scales[i] = 255;
        }
    } else {
        m.f = tcu_malloc(nw * sizeof(float));
        const float a = ldexpf(4.0f / sqrtf((float)c->cols), c->shift);
        tcu_fill(s, m.f, nw, -a, a);
        if (c->dt == KERN_BF16) {
            tcu_round_bf16(m.f, nw);
            m.h = tcu_malloc(nw * sizeof(uint16_t));
            for (size_t i = 0; i < nw; i++)
                m.h[i] = kern_f32_to_bf16(m.f[i]);
        }
    }
    return m;
}

static kern_weight weight_of(const k3_moe_case *c, const hmat *m) {
    kern_weight w = {.dt = c->dt, .rows = c->rows, .cols = c->cols};
    if (c->dt == KERN_MXFP4)
        w.data = m->codes, w.scales = m->scales;
    else
        w.data = c->dt == KERN_BF16 ? (const void *)m->h : (const void *)m->f;
    return w;
}

static void free_mat(hmat *m) {
    free(m->f), free(m->h), free(m->codes), free(m->scales);
}

/* Runs one kern_cuda_moe_experts call and returns the largest error over
 * the largest magnitude against kern_matmul_w (+ the activation) per
 * expert; NaN must be where the CPU has NaN (and only there); rows outside
 * the groups and columns >= rows must be untouched. */
static double run_k3_moe(const k3_moe_case *c) {
    const int E = c->E, rows = c->rows, cols = c->cols, n = c->n_rows;
    const int ldx = cols + 4, ldy = rows + 3;
    const bool fp4 = c->dt == KERN_MXFP4;
    const int nmat = c->fused ? 2 : 1;
    uint64_t s = c->seed;
    hmat *mats = tcu_malloc((size_t)nmat * E * sizeof *mats);
    for (int i = 0; i < nmat * E; i++)
        mats[i] = make_mat(c, &s);
    const kern_layout lay = kern_weight_layout(c->dt, rows, cols);
    const size_t mbytes = lay.data_bytes, sbytes = lay.scale_bytes;
    /* pointer tables: one device buffer per matrix (codes, and scales) */
    void **dw = tcu_malloc((size_t)nmat * E * sizeof *dw),
         **ds = tcu_malloc((size_t)nmat * E * sizeof *ds);
    for (int i = 0; i < nmat * E; i++) {
        const kern_weight w = weight_of(c, &mats[i]);
        dw[i] = tcu_dev_alloc(mbytes);
        tcu_h2d(dw[i], w.data, mbytes);
        ds[i] = fp4 ? tcu_dev_alloc(sbytes) : NULL;
        if (fp4) tcu_h2d(ds[i], w.scales, sbytes);
    }
    void *dwtab = tcu_dev_alloc((size_t)nmat * E * sizeof(void *)),
         *dstab = tcu_dev_alloc((size_t)nmat * E * sizeof(void *));
    tcu_h2d(dwtab, dw, (size_t)nmat * E * sizeof(void *));
    tcu_h2d(dstab, ds, (size_t)nmat * E * sizeof(void *));
    /* stacked: expert e's W at e * stride, its W3 right after; scales
     * likewise with an odd stride (they need no alignment). Poisoned: the
     * padding reads as NaN scales / -6 codes if touched. */
    const size_t stride = nmat * mbytes + 32, sstride = nmat * sbytes + 7;
    char *dstack = tcu_dev_alloc(E * stride), *dsstack = tcu_dev_alloc(E * sstride + 1);
    tcu_poison(dstack, E * stride);
    tcu_poison(dsstack, E * sstride + 1);
    for (int e = 0; e < E; e++)
        for (int m = 0; m < nmat; m++) {
            const kern_weight w = weight_of(c, &mats[m * E + e]);
            tcu_h2d(dstack + e * stride + m * mbytes, w.data, mbytes);
            if (fp4) tcu_h2d(dsstack + e * sstride + m * sbytes, w.scales, sbytes);
        }
    float *x = tcu_malloc((size_t)(n ? n : 1) * ldx * sizeof(float));
    const float xa = c->scale_case == 1 ? 1e18f : 1.0f; /* scale 2^-127 wants big x */
    tcu_fill(&s, x, (size_t)n * ldx, -xa, xa);
    float *y0 = tcu_malloc((size_t)(n ? n : 1) * ldy * sizeof(float));
    tcu_fill(&s, y0, (size_t)n * ldy, -1.0f, 1.0f);
    float *dx = tcu_upload(x, (size_t)n * ldx), *dy = tcu_upload(y0, (size_t)n * ldy);
    int32_t *doff = tcu_dev_alloc((size_t)(E + 1) * sizeof(int32_t));
    tcu_h2d(doff, c->off, (size_t)(E + 1) * sizeof(int32_t));
    const void *const *wt = (const void *const *)dwtab, *const *st = (const void *const *)dstab;
    kern_cuda_moe_experts_args a = {.E = E,
                                    .rows = rows,
                                    .cols = cols,
                                    .w_dtype = c->dt,
                                    .W = c->stacked ? NULL : wt,
                                    .W3 = c->fused && !c->stacked ? wt + E : NULL,
                                    .W_base = c->stacked ? dstack : NULL,
                                    .W3_base = c->stacked && c->fused ? dstack + mbytes : NULL,
                                    .w_stride = c->stacked ? stride : 0,
                                    .exp_off = doff,
                                    .n_rows = n,
                                    .x = dx,
                                    .ldx = ldx,
                                    .y = dy,
                                    .ldy = ldy,
                                    .mode = c->mode,
                                    .algo = c->algo,
                                    .S = fp4 && !c->stacked ? st : NULL,
                                    .S3 = fp4 && c->fused && !c->stacked ? st + E : NULL,
                                    .S_base = fp4 && c->stacked ? dsstack : NULL,
                                    .S3_base =
                                        fp4 && c->stacked && c->fused ? dsstack + sbytes : NULL,
                                    .s_stride = fp4 && c->stacked ? sstride : 0,
                                    .act = c->act,
                                    .situ_beta = c->act == KERN_CUDA_MOE_SITU ? K3_BETA : 0.0f,
                                    .situ_beta_l = c->act == KERN_CUDA_MOE_SITU ? K3_BETA_L : 0.0f};
    kds_err err = {0};
    cr_assert_eq(kern_cuda_moe_experts(&a, NULL, &err), KDS_OK, "%s", err.msg);
    float *got = tcu_malloc((size_t)(n ? n : 1) * ldy * sizeof(float));
    tcu_d2h(got, dy, (size_t)n * ldy * sizeof(float));
    /* reference, expert by expert */
    float *ref = tcu_malloc((size_t)(n ? n : 1) * ldy * sizeof(float));
    memcpy(ref, y0, (size_t)n * ldy * sizeof(float));
    float *xc = tcu_malloc((size_t)(n ? n : 1) * cols * sizeof(float));
    float *b = tcu_malloc((size_t)(n ? n : 1) * rows * sizeof(float));
    float *scratch = tcu_malloc(kern_matmul_scratch_floats(cols) * sizeof(float));
    for (int e = 0; e < E; e++) {
        const int r0 = c->off[e], ne = c->off[e + 1] - r0;
        if (ne <= 0) continue;
        for (int i = 0; i < ne; i++)
            memcpy(xc + (size_t)i * cols, x + (size_t)(r0 + i) * ldx, (size_t)cols * 4);
        for (int m = 0; m < nmat; m++) {
            const kern_weight w = weight_of(c, &mats[m * E + e]);
            kern_matmul_w(&w, xc, ne, m == 0 ? ref + (size_t)r0 * ldy : b, m == 0 ? ldy : rows, 0,
                          rows, scratch);
        }
        if (c->fused)
            for (int i = 0; i < ne; i++) {
                float *yr = ref + (size_t)(r0 + i) * ldy;
                if (c->act == KERN_CUDA_MOE_SITU)
                    kern_situ(yr, b + (size_t)i * rows, (size_t)rows, K3_BETA, K3_BETA_L);
                else
                    kern_swiglu(yr, b + (size_t)i * rows, (size_t)rows);
            }
    }
    double big = 0, worst = 0;
    int nans = 0;
    for (int t = 0; t < n; t++)
        for (int r = 0; r < ldy; r++) {
            const size_t i = (size_t)t * ldy + r;
            if (t >= c->off[E] || r >= rows) { /* outside every group: untouched, bit for bit */
                cr_assert_eq(memcmp(&got[i], &y0[i], sizeof(float)), 0,
                             "y[%d, %d] outside every group was written", t, r);
                continue;
            }
            if (isnan(ref[i])) {
                nans++;
                cr_assert(isnan(got[i]), "y[%d, %d]: the CPU has NaN (a NaN scale), the GPU %g", t,
                          r, (double)got[i]);
                continue;
            }
            if (fabs(ref[i]) > big) big = fabs(ref[i]);
            double e = fabs((double)got[i] - ref[i]);
            if (isnan(e)) e = INFINITY;
            if (e > worst) worst = e;
        }
    if (c->scale_case == 2) cr_assert_gt(nans, 0, "the NaN-scale case planted no NaN");
    for (int i = 0; i < nmat * E; i++) {
        kern_cuda_free(dw[i]), kern_cuda_free(ds[i]);
        free_mat(&mats[i]);
    }
    kern_cuda_free(dwtab), kern_cuda_free(dstab), kern_cuda_free(dstack), kern_cuda_free(dsstack);
    kern_cuda_free(dx), kern_cuda_free(dy), kern_cuda_free(doff);
    free(mats), free(dw), free(ds), free(x), free(y0), free(got), free(ref), free(xc), free(b),
        free(scratch);
    return worst / (big > 0 ? big : 1);
}

static const char *dt_name(kern_dtype dt) {
    return dt == KERN_MXFP4 ? "mxfp4" : dt == KERN_BF16 ? "bf16" : "f32";
}

/* The case in EXACT mode (GEMV 1e-5, tensor cores 2e-5) and, on tensor
 * cores with rows to compare, in BF16 mode (<= 2e-2 and 10x worse). */
static void check_k3_moe(k3_moe_case c, const char *what) {
    c.mode = KERN_CUDA_GEMM_EXACT;
    const double e = run_k3_moe(&c);
    const bool tc = c.algo == KERN_CUDA_MOE_TENSOR ||
                    (c.algo == KERN_CUDA_MOE_AUTO && c.dt != KERN_F32 && c.n_rows > 2 * c.E);
    const double tol = tc ? 2e-5 : 1e-5;
    printf("cuda_k3 moe %-34s %s %s%s%s%s: EXACT err/max %.2e (tol %.0e)\n", what, dt_name(c.dt),
           tc ? "tensor" : "gemv",
           c.fused ? (c.act == KERN_CUDA_MOE_SITU ? " situ" : " swiglu") : "",
           c.stacked ? " stacked" : "",
           c.scale_case == 1   ? " scales 0"
           : c.scale_case == 2 ? " NaN scales"
                               : "",
           e, tol);
    fflush(stdout);
    cr_expect_leq(e, tol, "%s %s: EXACT error %.3e > %.0e", what, dt_name(c.dt), e, tol);
    if (!tc || c.off[c.E] == 0) return;
    c.mode = KERN_CUDA_GEMM_BF16;
    const double eb = run_k3_moe(&c);
    printf("cuda_k3 moe %-34s %s tensor: BF16 err/max %.2e\n", what, dt_name(c.dt), eb);
    cr_expect_leq(eb, 2e-2, "%s: BF16 error %.3e", what, eb);
    cr_expect_gt(eb, 10 * e, "%s: BF16 (%.3e) not clearly less exact than EXACT (%.3e)", what, eb,
                 e);
}

/* uneven groups with empty experts between them (8 rows: a full GEMV
 * chunk and a partial one; partial 64-row tiles) */
static const int32_t kOff7[] = {0, 1, 1, 10, 12, 12, 29, 29};

Test(cuda_k3, moe_situ_matches_cpu) {
    tcu_require_device();
    for (int al = 1; al <= 2; al++)
        for (int st = 0; st < 2; st++) {
            k3_moe_case c = {.dt = KERN_BF16,
                             .E = 7,
                             .rows = 40,
                             .cols = 64,
                             .n_rows = 29,
                             .off = kOff7,
                             .fused = true,
                             .act = KERN_CUDA_MOE_SITU,
                             .algo = al,
                             .stacked = st,
                             .seed = 41 + st};
            check_k3_moe(c, "situ, uneven");
        }
    k3_moe_case f = {.dt = KERN_F32,
                     .E = 7,
                     .rows = 24,
                     .cols = 50,
                     .n_rows = 29,
                     .off = kOff7,
                     .fused = true,
                     .act = KERN_CUDA_MOE_SITU,
                     .algo = KERN_CUDA_MOE_GEMV,
                     .seed = 43}; /* element loads */
    check_k3_moe(f, "situ, cols 50");
    f.dt = KERN_BF16, f.cols = 64, f.shift = 5; /* products of +-50: both caps saturate */
    check_k3_moe(f, "situ, saturated");
    const int32_t all[] = {0, 0, 70, 70}; /* one expert, 70 rows: two tiles of 64, 9 GEMV chunks */
    k3_moe_case g = {.dt = KERN_BF16,
                     .E = 3,
                     .rows = 72,
                     .cols = 96,
                     .n_rows = 75,
                     .off = all,
                     .fused = true,
                     .act = KERN_CUDA_MOE_SITU,
                     .algo = KERN_CUDA_MOE_TENSOR,
                     .stacked = true,
                     .seed = 44};
    check_k3_moe(g, "situ, one expert 70 rows");
    g.algo = KERN_CUDA_MOE_GEMV;
    check_k3_moe(g, "situ, one expert 70 rows");
}

Test(cuda_k3, moe_mxfp4_gemv_matches_cpu) {
    tcu_require_device();
    for (int f = 0; f < 3; f++)
        for (int st = 0; st < 2; st++) {
            k3_moe_case c = {.dt = KERN_MXFP4,
                             .E = 7,
                             .rows = 24,
                             .cols = 96,
                             .n_rows = 29,
                             .off = kOff7,
                             .fused = f > 0,
                             .act = f == 2 ? KERN_CUDA_MOE_SITU : KERN_CUDA_MOE_SWIGLU,
                             .algo = KERN_CUDA_MOE_GEMV,
                             .stacked = st,
                             .seed = 51 + 2 * f + st};
            check_k3_moe(c, "uneven, cols 96");
        }
    k3_moe_case sat = {.dt = KERN_MXFP4,
                       .E = 7,
                       .rows = 24,
                       .cols = 96,
                       .n_rows = 29,
                       .off = kOff7,
                       .fused = true,
                       .act = KERN_CUDA_MOE_SITU,
                       .algo = KERN_CUDA_MOE_GEMV,
                       .shift = 3,
                       .seed = 58};
    check_k3_moe(sat, "situ, saturated");
    /* more than one batch of chunks per lane (cols / 32 > 32 * 4) and a row
     * count that is not a multiple of a CTA's rows */
    const int32_t off[] = {0, 3, 3, 5};
    k3_moe_case c = {.dt = KERN_MXFP4,
                     .E = 3,
                     .rows = 13,
                     .cols = 4160,
                     .n_rows = 6,
                     .off = off,
                     .fused = true,
                     .act = KERN_CUDA_MOE_SITU,
                     .algo = KERN_CUDA_MOE_GEMV,
                     .stacked = true,
                     .seed = 57};
    check_k3_moe(c, "cols 4160 (two chunk batches)");
}

Test(cuda_k3, moe_mxfp4_tensor_matches_cpu) {
    tcu_require_device();
    for (int f = 0; f < 3; f++)
        for (int st = 0; st < 2; st++) {
            k3_moe_case c = {.dt = KERN_MXFP4,
                             .E = 7,
                             .rows = 72,
                             .cols = 64,
                             .n_rows = 29,
                             .off = kOff7,
                             .fused = f > 0,
                             .act = f == 2 ? KERN_CUDA_MOE_SITU : KERN_CUDA_MOE_SWIGLU,
                             .algo = KERN_CUDA_MOE_TENSOR,
                             .stacked = st,
                             .shift = f == 2 ? -2 : 0,
                             .seed = 61 + 2 * f + st};
            check_k3_moe(c, "uneven, rows 72");
        }
    const int32_t all[] = {0, 0, 70, 70}; /* one expert with every row: two 64-row tiles */
    k3_moe_case c = {.dt = KERN_MXFP4,
                     .E = 3,
                     .rows = 40,
                     .cols = 96,
                     .n_rows = 75,
                     .off = all,
                     .fused = true,
                     .act = KERN_CUDA_MOE_SITU,
                     .algo = KERN_CUDA_MOE_AUTO,
                     .shift = -2,
                     .seed = 67};
    check_k3_moe(c, "auto, one expert 70 rows");
}

/* Random routing (kern_moe_route + kern_moe_permute) of T tokens, top-k of
 * E, both algorithms through AUTO's choice. */
static void check_routed_fp4(int T, int E, int k, int rows, int cols, bool fused,
                             kern_cuda_moe_act act, int shift, uint64_t seed) {
    uint64_t s = seed;
    float *scores = tcu_malloc((size_t)T * E * sizeof(float));
    tcu_fill(&s, scores, (size_t)T * E, 0.0f, 1.0f);
    int32_t *sel = tcu_malloc((size_t)T * k * sizeof(int32_t)),
            *off = tcu_malloc((size_t)(E + 1) * sizeof(int32_t));
    int32_t *row_of = tcu_malloc((size_t)T * k * sizeof(int32_t)),
            *tok_of = tcu_malloc((size_t)T * k * sizeof(int32_t));
    float *w = tcu_malloc((size_t)T * k * sizeof(float));
    kern_moe_route_params p = {.n_experts = E,
                               .top_k = k,
                               .n_group = 1,
                               .topk_group = 1,
                               .renormalize = 1,
                               .routed_scaling_factor = 1.0f};
    kern_moe_route(&p, T, scores, NULL, sel, w);
    kern_moe_permute(E, T, k, sel, off, row_of, tok_of);
    int empty = 0;
    for (int e = 0; e < E; e++)
        empty += off[e + 1] == off[e];
    char what[64];
    snprintf(what, sizeof what, "routed T=%d E=%d k=%d (%d empty)", T, E, k, empty);
    k3_moe_case c = {.dt = KERN_MXFP4,
                     .E = E,
                     .rows = rows,
                     .cols = cols,
                     .n_rows = T * k,
                     .off = off,
                     .fused = fused,
                     .act = act,
                     .algo = KERN_CUDA_MOE_AUTO,
                     .stacked = (seed & 1) != 0,
                     .shift = shift,
                     .seed = seed + 1};
    check_k3_moe(c, what);
    free(scores), free(sel), free(off), free(row_of), free(tok_of), free(w);
}

Test(cuda_k3, moe_mxfp4_random_routing) {
    tcu_require_device();
    check_routed_fp4(3, 16, 4, 40, 64, true, KERN_CUDA_MOE_SITU, 0, 71);    /* decode-like: GEMV */
    check_routed_fp4(40, 6, 2, 65, 64, false, KERN_CUDA_MOE_SWIGLU, 0, 72); /* tensor cores */
    check_routed_fp4(40, 6, 2, 48, 96, true, KERN_CUDA_MOE_SITU, -2, 73); /* tensor cores, fused */
}

/* E8M0 extremes: scale 0 is 2^-127 (a denormal; x up to 1e18 keeps the
 * products normal), 255 is NaN where the CPU's dequantised weight is. */
static void check_scale_case(kern_cuda_moe_algo al, int sc) {
    k3_moe_case c = {.dt = KERN_MXFP4,
                     .E = 7,
                     .rows = 40,
                     .cols = 64,
                     .n_rows = 29,
                     .off = kOff7,
                     .fused = sc == 2,
                     .act = sc == 2 ? KERN_CUDA_MOE_SITU : KERN_CUDA_MOE_SWIGLU,
                     .algo = al,
                     .scale_case = sc,
                     .shift = al == KERN_CUDA_MOE_TENSOR ? -2 : 0,
                     .seed = 81 + sc};
    const double e = run_k3_moe(&c);
    const double tol = al == KERN_CUDA_MOE_TENSOR ? 2e-5 : 1e-5;
    printf("cuda_k3 moe %-34s mxfp4 %s: EXACT err/max %.2e (tol %.0e)\n",
           sc == 1 ? "scales all 0" : "NaN scales", al == KERN_CUDA_MOE_TENSOR ? "tensor" : "gemv",
           e, tol);
    cr_expect_leq(e, tol, "scale case %d algo %d: %.3e", sc, (int)al, e);
}

Test(cuda_k3, moe_mxfp4_scale_extremes) {
    tcu_require_device();
    check_scale_case(KERN_CUDA_MOE_GEMV, 1);
    check_scale_case(KERN_CUDA_MOE_GEMV, 2);
    check_scale_case(KERN_CUDA_MOE_TENSOR, 2);
}

/* Scale 0 on tensor cores: the weights are bf16 subnormals (2^-128 ..
 * 1.5 * 2^-127), exact here; whether the GPU's tensor cores keep bf16
 * subnormals is what this case will tell (README: unverified). */
Test(cuda_k3, moe_mxfp4_tensor_subnormal_weights) {
    tcu_require_device();
    check_scale_case(KERN_CUDA_MOE_TENSOR, 1);
}

/* Kimi K3's routed expert: w1 | w3 [3072, 3584] fused with SiTU and w2
 * [3584, 3072], MXFP4, a few rows over 3 experts (one empty). Minutes
 * under the emulation (hundreds of CTAs per expert), hence the limit. */
Test(cuda_k3, moe_mxfp4_k3_expert_shape, .timeout = 900) {
    tcu_require_device();
    const int32_t off[] = {0, 2, 2, 3};
    k3_moe_case up = {.dt = KERN_MXFP4,
                      .E = 3,
                      .rows = 3072,
                      .cols = 3584,
                      .n_rows = 3,
                      .off = off,
                      .fused = true,
                      .act = KERN_CUDA_MOE_SITU,
                      .algo = KERN_CUDA_MOE_GEMV,
                      .stacked = true,
                      .seed = 91};
    check_k3_moe(up, "K3 w1|w3 3072x3584");
    k3_moe_case down = {.dt = KERN_MXFP4,
                        .E = 3,
                        .rows = 3584,
                        .cols = 3072,
                        .n_rows = 3,
                        .off = off,
                        .algo = KERN_CUDA_MOE_GEMV,
                        .stacked = true,
                        .seed = 92};
    check_k3_moe(down, "K3 w2 3584x3072");
}

/* Every refusal comes before any CUDA call: no device needed. */
Test(cuda_k3, moe_refuses_bad_arguments) {
    static float d[8192] __attribute__((aligned(16)));
    kds_err err = {0};
    const kern_cuda_moe_experts_args ok = {.E = 2,
                                           .rows = 8,
                                           .cols = 64,
                                           .w_dtype = KERN_MXFP4,
                                           .W_base = d,
                                           .W3_base = d,
                                           .w_stride = 256,
                                           .exp_off = (int32_t *)d,
                                           .n_rows = 4,
                                           .x = d,
                                           .ldx = 64,
                                           .y = d + 4096,
                                           .ldy = 8,
                                           .S_base = d,
                                           .S3_base = d,
                                           .s_stride = 16};
    kern_cuda_moe_experts_args m = ok;
    m.act = KERN_CUDA_MOE_SITU, m.situ_beta = 4, m.situ_beta_l = 25,
    m.W3_base = NULL; /* SiTU needs W3 */
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "SITU"), "message: %s", err.msg);
    m = ok, m.act = KERN_CUDA_MOE_SITU, m.situ_beta = 0, m.situ_beta_l = 25;
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "beta"), "message: %s", err.msg);
    m.situ_beta = 4, m.situ_beta_l = NAN;
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_INVALID_ARG);
    m = ok, m.act = 7;
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_INVALID_ARG);
    m = ok, m.cols = 48, m.ldx = 48; /* not whole MXFP4 blocks */
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "cols"), "message: %s", err.msg);
    m = ok, m.S3_base = NULL; /* fused without the up projection's scales */
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "scales"), "message: %s", err.msg);
    m = ok, m.s_stride = 15; /* < 8 rows x 2 blocks */
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "s_stride"), "message: %s", err.msg);
    m = ok, m.w_stride = 255; /* < 8 x 32 code bytes */
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_INVALID_ARG);
    m = ok, m.w_stride = 264; /* not 16-byte aligned */
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_UNSUPPORTED);
    m = ok, m.ldx = 66; /* x rows not 16-byte aligned */
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_UNSUPPORTED);
    cr_expect(strstr(err.msg, "MXFP4"), "message: %s", err.msg);
    m = ok, m.W_base = NULL, m.W3_base = NULL, m.W = (const void *const *)d,
    m.W3 = (const void *const *)d;
    cr_expect_eq(kern_cuda_moe_experts(&m, NULL, &err), KDS_INVALID_ARG,
                 "tables without S / S3 tables");
}

#else

Test(cuda_k3, skipped_without_cuda) {
    cr_skip_test("built without CUDA (KDS_HAVE_CUDA unset)");
}

#endif
