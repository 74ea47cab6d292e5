/*
 * Block-format weights through the loader and the forward pass: a generated
 * tiny model whose routed experts are rewritten as compressed-tensors'
 * MXFP4 pairs (NAME.weight_packed + NAME.weight_scale, U8) or as Q8_0 pairs
 * (NAME.weight I8 + NAME.weight_scale F16) loads with those formats, and its
 * prefill and decode logits equal those of the same model with the
 * experts' dequantised values stored as f32 (quantised here, from the
 * formats' definitions). Malformed pairs are refused, naming the tensor.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "eng.h"
#include "eng_config.h"
#include "eng_genmodel.h"
#include "eng_model.h"
#include "test_model_util.h"

/* The E2M1 magnitudes, in code order. */
static const float E2M1[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};

static bool is_expert(const char *name) {
    size_t n = strlen(name);
    return strstr(name, ".experts.") && n > 7 && strcmp(name + n - 7, ".weight") == 0;
}

/* One block of 32 values of an f32 row, quantised; deq gets the values the
 * block now holds. MXFP4: codes (16 bytes) and an E8M0 exponent with the
 * block's largest magnitude at most 6 x 2^e; Q8_0: int8 and an f16 scale. */
static void quant_block(kern_dtype fmt, const float *v, unsigned char *codes, unsigned char *scale,
                        float *deq) {
    float amax = 0;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
    if (fmt == KERN_MXFP4) {
        int e = amax > 0 ? (int)ceilf(log2f(amax / 6.0f)) : -127;
        if (e < -127) e = -127;
        *scale = (unsigned char)(e + 127);
        const float s = ldexpf(1.0f, e);
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(v[i]) / s;
            int best = 0;
            for (int c = 1; c < 8; c++)
                if (fabsf(E2M1[c] - a) < fabsf(E2M1[best] - a)) best = c;
            const unsigned code = (unsigned)best | (v[i] < 0 ? 8u : 0u);
            codes[i / 2] = i % 2 ? (unsigned char)(codes[i / 2] | code << 4) : (unsigned char)code;
            deq[i] = (code & 8 ? -1.0f : 1.0f) * E2M1[code & 7] * s;
        }
    } else {
        const uint16_t h = kern_f32_to_f16(amax > 0 ? amax / 127.0f : 1.0f);
        memcpy(scale, &h, 2);
        const float s = kern_f16_to_f32(h);
        for (int i = 0; i < 32; i++) {
            float q = rintf(v[i] / s);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            codes[i] = (unsigned char)(signed char)q;
            deq[i] = q * s;
        }
    }
}

/* Everything a rewritten checkpoint holds, freed together. */
typedef struct rewrite {
    eng_st_out_tensor *t;
    size_t n;
    char *names;
    void **bufs;
    size_t n_bufs;
} rewrite;

static void *keep(rewrite *r, size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    cr_assert(p);
    r->bufs[r->n_bufs++] = p;
    return p;
}

/* src_dir's model.safetensors with every routed expert weight (f32)
 * quantised to fmt: into block_dir as pairs, into deq_dir as the
 * dequantised f32 values. */
static void quantise_model(const char *src_dir, kern_dtype fmt, const char *block_dir,
                           const char *deq_dir) {
    char *src = tmu_path(src_dir, "model.safetensors");
    eng_st_file *f = NULL;
    cr_assert_eq(eng_st_open(src, &f, NULL), KDS_OK);
    const size_t n = eng_st_count(f);
    rewrite blk = {calloc(2 * n, sizeof(eng_st_out_tensor)), 0, calloc(2 * n, 160),
                   calloc(4 * n, sizeof(void *)), 0};
    rewrite deq = {calloc(n, sizeof(eng_st_out_tensor)), 0, NULL, calloc(n, sizeof(void *)), 0};
    cr_assert(blk.t && blk.names && blk.bufs && deq.t && deq.bufs);
    for (size_t i = 0; i < n; i++) {
        const eng_st_tensor *t = eng_st_at(f, i);
        eng_st_out_tensor o = {.name = t->name, .dtype = t->dtype, .n_dims = t->n_dims, .data = t->data};
        memcpy(o.shape, t->shape, sizeof o.shape);
        if (!is_expert(t->name)) {
            blk.t[blk.n++] = o;
            deq.t[deq.n++] = o;
            continue;
        }
        cr_assert_eq(t->dtype, ENG_ST_F32);
        const int64_t rows = t->shape[0], cols = t->shape[1];
        const kern_layout l = kern_weight_layout(fmt, rows, cols);
        unsigned char *codes = keep(&blk, l.data_bytes), *scales = keep(&blk, l.scale_bytes);
        float *dv = keep(&deq, (size_t)rows * cols * 4);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t b = 0; b < cols / 32; b++)
                quant_block(fmt, (const float *)t->data + r * cols + b * 32,
                            codes + r * l.row_bytes + b * (fmt == KERN_MXFP4 ? 16 : 32),
                            scales + r * l.scale_row_bytes + b * (fmt == KERN_MXFP4 ? 1 : 2),
                            dv + r * cols + b * 32);
        char *cn = blk.names + 160 * blk.n, *sn = blk.names + 160 * (blk.n + 1);
        snprintf(cn, 160, "%s%s", t->name, fmt == KERN_MXFP4 ? "_packed" : "");
        snprintf(sn, 160, "%s_scale", t->name);
        blk.t[blk.n++] = (eng_st_out_tensor){.name = cn,
                                             .dtype = fmt == KERN_MXFP4 ? ENG_ST_U8 : ENG_ST_I8,
                                             .n_dims = 2, .shape = {rows, (int64_t)l.row_bytes},
                                             .data = codes};
        blk.t[blk.n++] = (eng_st_out_tensor){.name = sn,
                                             .dtype = fmt == KERN_MXFP4 ? ENG_ST_U8 : ENG_ST_F16,
                                             .n_dims = 2, .shape = {rows, cols / 32},
                                             .data = scales};
        o.data = dv;
        deq.t[deq.n++] = o;
    }
    const char *dirs[2] = {block_dir, deq_dir};
    rewrite *rw[2] = {&blk, &deq};
    for (int k = 0; k < 2; k++) {
        char *cs = tmu_path(src_dir, "config.json"), *cd = tmu_path(dirs[k], "config.json");
        char *st = tmu_path(dirs[k], "model.safetensors");
        cr_assert(tmu_copy(cs, cd));
        cr_assert_eq(eng_st_write(st, rw[k]->t, rw[k]->n, NULL, NULL), KDS_OK);
        free(cs);
        free(cd);
        free(st);
        for (size_t i = 0; i < rw[k]->n_bufs; i++) free(rw[k]->bufs[i]);
        free(rw[k]->bufs);
        free(rw[k]->t);
    }
    free(blk.names);
    eng_st_close(f);
    free(src);
}

typedef struct pair_dirs {
    char *src, *blk, *deq;
} pair_dirs;

static pair_dirs make_pair(kern_dtype fmt) {
    pair_dirs d = {tmu_mkdtemp(), tmu_mkdtemp(), tmu_mkdtemp()};
    cr_assert(d.src && d.blk && d.deq);
    eng_config c;
    kds_err err = {0};
    cr_assert_eq(eng_genmodel_preset("tiny-hybrid", &c, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_genmodel_write(&c, 21, KERN_F32, d.src, false, &err), KDS_OK, "%s", err.msg);
    quantise_model(d.src, fmt, d.blk, d.deq);
    return d;
}

static void drop_pair(pair_dirs *d) {
    tmu_rmtree(d->src);
    tmu_rmtree(d->blk);
    tmu_rmtree(d->deq);
    free(d->src);
    free(d->blk);
    free(d->deq);
}

static eng_model *load(const char *dir) {
    eng_model_params p = eng_model_default_params();
    p.no_fingerprint_cache = true;
    eng_model *m = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_model_load(dir, &p, &m, &err), KDS_OK, "%s: %s", dir, err.msg);
    return m;
}

/* Prefill 40 tokens then decode 4 on both models; the logits agree to
 * 1e-5 of the largest (the same values; only the order of the sums may
 * differ between the block and the f32 path). */
static void expect_same_logits(kern_dtype fmt) {
    pair_dirs d = make_pair(fmt);
    eng_model *mb = load(d.blk), *mf = load(d.deq);
    const eng_layer_weights *L = &mb->layers[1];
    cr_assert_eq(L->ffn_kind, ENG_FFN_MOE);
    cr_expect_eq(L->ffn.w1[0].dt, fmt, "expert weights load as %s", kern_dtype_name(fmt));
    cr_expect_eq(L->ffn.w2[7].dt, fmt);
    cr_expect(L->ffn.w1[0].scales != NULL, "scales bound");
    cr_expect_eq(L->ffn.w1[0].rows, 128);
    cr_expect_eq(L->ffn.w1[0].cols, 256);
    cr_expect_eq(L->ffn.router.dt, KERN_F32, "only the experts change");
    kds_err err = {0};
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 2;
    cp.max_batch = 16; /* several prefill steps */
    eng_ctx *cb, *cf;
    cr_assert_eq(eng_ctx_create(mb, &cp, &cb, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_ctx_create(mf, &cp, &cf, &err), KDS_OK, "%s", err.msg);
    eng_seq *sb, *sf;
    cr_assert_eq(eng_seq_create(mb, 1, &sb, &err), KDS_OK);
    cr_assert_eq(eng_seq_create(mf, 1, &sf, &err), KDS_OK);
    const int N = 40, V = 512;
    int32_t ids[40];
    for (int i = 0; i < N; i++) ids[i] = (i * 37 + 11) % V;
    float *lb = malloc((size_t)N * V * sizeof(float)), *lf = malloc((size_t)N * V * sizeof(float));
    cr_assert(lb && lf);
    cr_assert_eq(eng_prefill(cb, sb, ids, N, lb, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(eng_prefill(cf, sf, ids, N, lf, NULL, NULL, &err), KDS_OK, "%s", err.msg);
    double worst = 0, top = 0;
    for (size_t i = 0; i < (size_t)N * V; i++) {
        worst = fmax(worst, fabs((double)lb[i] - lf[i]));
        top = fmax(top, fabs((double)lf[i]));
    }
    for (int s = 0; s < 4; s++) {
        cr_assert_eq(eng_decode(cb, sb, ids[s], &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(eng_decode(cf, sf, ids[s], &err), KDS_OK, "%s", err.msg);
        const float *a = eng_seq_logits(sb), *b = eng_seq_logits(sf);
        for (int i = 0; i < V; i++) worst = fmax(worst, fabs((double)a[i] - b[i]));
    }
    cr_log_info("%s experts: largest logit difference %.3g of %.3g", kern_dtype_name(fmt), worst, top);
    cr_expect(top > 0.1, "logits are not trivially small");
    cr_expect(worst <= 1e-5 * top, "%s experts: logits differ by %g (largest %g)", kern_dtype_name(fmt),
              worst, top);
    free(lb);
    free(lf);
    eng_seq_free(sb);
    eng_seq_free(sf);
    eng_ctx_free(cb);
    eng_ctx_free(cf);
    eng_model_free(mb);
    eng_model_free(mf);
    drop_pair(&d);
}

Test(model_block, mxfp4_experts_run_as_their_values, .timeout = 120) { expect_same_logits(KERN_MXFP4); }

Test(model_block, q8_0_experts_run_as_their_values, .timeout = 120) { expect_same_logits(KERN_Q8_0); }

/* One edit of the MXFP4 checkpoint, and the refusal it must give. */
typedef struct bad_edit {
    const char *suffix;       /* the tensor edited: a name ending in this */
    int what;                 /* 0 drop, 1 dtype, 2 shape */
    eng_st_dtype dtype;
    int64_t cols;
} bad_edit;

static bool edit_fn(void *user, eng_st_out_tensor *t) {
    const bad_edit *e = user;
    size_t n = strlen(t->name), k = strlen(e->suffix);
    if (n < k || strcmp(t->name + n - k, e->suffix) != 0) return true;
    if (e->what == 0) return false;
    if (e->what == 1) t->dtype = e->dtype;
    if (e->what == 2) t->shape[1] = e->cols;
    return true;
}

Test(model_block, malformed_pairs_are_refused, .timeout = 120) {
    pair_dirs d = make_pair(KERN_MXFP4);
    const struct {
        bad_edit e;
        kds_status want;
        const char *needle;
    } cases[] = {
        /* no scales beside the codes */
        {{"layers.1.block_sparse_moe.experts.3.w1.weight_scale", 0, 0, 0}, KDS_NOT_FOUND,
         "experts.3.w1.weight_scale"},
        /* scales of the wrong dtype (the data bytes reinterpreted) */
        {{"layers.1.block_sparse_moe.experts.3.w1.weight_scale", 1, ENG_ST_I8, 0}, KDS_MISMATCH,
         "weight_scale"},
        /* codes of the wrong width: w2 [256, 32] instead of [256, 64] (128 inputs) */
        {{"layers.2.block_sparse_moe.experts.0.w2.weight_packed", 2, 0, 32}, KDS_MISMATCH,
         "experts.0.w2.weight_packed"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *bad = tmu_mkdtemp();
        bad_edit e = cases[i].e;
        cr_assert(tmu_rewrite(d.blk, bad, "model.safetensors", edit_fn, &e));
        eng_model_params p = eng_model_default_params();
        p.no_fingerprint_cache = true;
        eng_model *m = NULL;
        kds_err err = {0};
        kds_status rc = eng_model_load(bad, &p, &m, &err);
        cr_expect_eq(rc, cases[i].want, "case %zu: got %s (%s)", i, kds_status_str(rc), err.msg);
        cr_expect(strstr(err.msg, cases[i].needle), "case %zu: '%s' does not name '%s'", i, err.msg,
                  cases[i].needle);
        cr_expect_null(m);
        eng_model_free(m);
        tmu_rmtree(bad);
        free(bad);
    }
    drop_pair(&d);
}
