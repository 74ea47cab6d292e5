/*
 * eng_quantize.c - a model directory with its routed experts (and, asked,
 * its other matrices) rewritten in a block format (eng_genmodel.h:
 * eng_model_quantize, `kdaserve quantize`).
 *
 * The source is loaded and checked as any model; the experts and the other
 * matrices are found by the layer plan (the tensors it marks as routed
 * experts, and its other matrices but the embedding and the routers),
 * every other tensor of the checkpoint (a vision tower included) is copied
 * as it is.
 * MXFP4 experts become compressed-tensors pairs (NAME_packed + NAME_scale
 * U8) with the quantization_config K3 ships; Q8_0 experts NAME (I8) +
 * NAME_scale (F16), which the loader recognises by their tensors. Tensors
 * are written in the source's order, quantised row by row as they are
 * written (nothing is held whole in memory), into shards of at most 4 GiB
 * when the total is larger; the new directory is loaded once to prove it.
 */
#include <cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "eng_genmodel.h"
#include "eng_model.h"
#include "eng_plan.h"
#include "eng_progress.h"
#include "eng_safetensors.h"

#define QUANT_SHARD_BYTES ((uint64_t)4 << 30)

/* One tensor to write: a copy, or a quantised expert's codes or scales. */
typedef struct out_tensor {
    char name[192];
    const eng_st_tensor *src;
    int part;          /* 0 copy, 1 codes, 2 scales */
    kern_dtype fmt;
    uint64_t bytes;
} out_tensor;

/* A list of tensor names, sorted for bsearch. */
typedef struct name_list {
    char **v;
    size_t n, cap;
} name_list;

typedef struct quantizer {
    kern_dtype fmt;    /* the experts' */
    bool dense;        /* the other matrices too, in dense_fmt */
    kern_dtype dense_fmt;
    out_tensor *t;
    size_t n, cap;
    name_list experts; /* the plan's routed experts */
    name_list others;  /* the plan's other matrices that may be quantised */
    const out_tensor *shard; /* the tensors of the shard being written */
    float *row;        /* [cols] one expert row in f32 */
    unsigned char *codes, *scales;
    uint64_t total;
    eng_progress line; /* bytes written of total */
    kds_status rc;
    kds_err *err;
} quantizer;

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static bool list_add(name_list *l, const char *name) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 1024;
        char **v = realloc(l->v, cap * sizeof *v);
        if (!v) return false;
        l->v = v;
        l->cap = cap;
    }
    return (l->v[l->n++] = strdup(name)) != NULL;
}

static bool list_has(const name_list *l, const char *name) {
    return bsearch(&name, l->v, l->n, sizeof *l->v, cmp_str) != NULL;
}

static void list_free(name_list *l) {
    for (size_t i = 0; i < l->n; i++) free(l->v[i]);
    free(l->v);
}

static bool ends_with(const char *s, const char *tail) {
    const size_t n = strlen(s), k = strlen(tail);
    return n >= k && strcmp(s + n - k, tail) == 0;
}

/* eng_tensor_fn: remember the routed experts' names, and the other
 * matrices that --dense may quantise: not the embedding table (one row is
 * read a token: nothing to gain, and every token's input would carry the
 * rounding), not a MoE router (`gate.weight`: its scores choose the
 * experts, and it is small), not an MLA layer's kv_b_proj (attention
 * widens its rows to f32 for every head at every step, which a block
 * format makes a dequantisation: on full27 in Q8_0 that took a third of a
 * decoded token, to save 30 MB of its 2.6 GB). */
static void note_matrix(void *user, const eng_tensor_spec *s) {
    quantizer *q = user;
    if (!s->matrix || q->rc != KDS_OK) return;
    bool ok = true;
    if (s->expert >= 0)
        ok = list_add(&q->experts, s->name);
    else if (!strstr(s->name, "embed_tokens") && !ends_with(s->name, ".gate.weight") &&
             !ends_with(s->name, "kv_b_proj.weight"))
        ok = list_add(&q->others, s->name);
    if (!ok) q->rc = kds_err_set(q->err, KDS_NOMEM, "out of memory listing the matrices");
}

static out_tensor *push(quantizer *q) {
    if (q->n == q->cap) {
        size_t cap = q->cap ? 2 * q->cap : 1024;
        out_tensor *t = realloc(q->t, cap * sizeof *t);
        if (!t) return NULL;
        q->t = t;
        q->cap = cap;
    }
    out_tensor *t = &q->t[q->n++];
    memset(t, 0, sizeof *t);
    return t;
}

static kern_dtype element_format(eng_st_dtype d, bool *ok) {
    *ok = true;
    if (d == ENG_ST_F32) return KERN_F32;
    if (d == ENG_ST_BF16) return KERN_BF16;
    if (d == ENG_ST_F16) return KERN_F16;
    *ok = false;
    return KERN_F32;
}

/* The output list: every tensor of every shard in order, a quantised one
 * as two (codes, scales). */
static kds_status plan_outputs(quantizer *q, const eng_model *m) {
    for (int s = 0; s < m->n_shards; s++)
        for (size_t i = 0; i < eng_st_count(m->shards[s]); i++) {
            const eng_st_tensor *t = eng_st_at(m->shards[s], i);
            const bool expert = list_has(&q->experts, t->name);
            kern_dtype fmt = q->fmt;
            bool quantise = expert;
            if (!expert && q->dense && list_has(&q->others, t->name)) {
                bool ok;
                (void)element_format(t->dtype, &ok);
                /* as stored when it cannot be: a width off the blocks, or
                 * a format other than f32/bf16/f16 */
                quantise = ok && t->n_dims == 2 && t->shape[1] % KERN_BLOCK == 0;
                fmt = q->dense_fmt;
            }
            out_tensor *o = push(q);
            if (!o) return kds_err_set(q->err, KDS_NOMEM, "out of memory listing tensors");
            o->src = t;
            snprintf(o->name, sizeof o->name, "%s", t->name);
            if (!quantise) {
                o->bytes = t->n_bytes;
                continue;
            }
            bool ok;
            (void)element_format(t->dtype, &ok);
            if (!ok || t->n_dims != 2)
                return kds_err_set(q->err, KDS_UNSUPPORTED,
                                   "%s: expert tensor '%s' is %s, not an f32/bf16/f16 matrix "
                                   "(already quantised?)",
                                   eng_model_dir(m), t->name, eng_st_dtype_name(t->dtype));
            const kern_layout l = kern_weight_layout(fmt, t->shape[0], t->shape[1]);
            if (!l.bytes)
                return kds_err_set(q->err, KDS_UNSUPPORTED,
                                   "expert tensor '%s' has %lld input columns: %s needs a "
                                   "multiple of %d",
                                   t->name, (long long)t->shape[1], kern_dtype_name(fmt),
                                   KERN_BLOCK);
            out_tensor *sc = push(q);
            if (!sc) return kds_err_set(q->err, KDS_NOMEM, "out of memory listing tensors");
            o = &q->t[q->n - 2]; /* push may have moved the array */
            *sc = *o;
            o->part = 1;
            sc->part = 2;
            o->fmt = sc->fmt = fmt;
            o->bytes = l.data_bytes;
            sc->bytes = l.scale_bytes;
            if (fmt == KERN_MXFP4) snprintf(o->name, sizeof o->name, "%s_packed", t->name);
            snprintf(sc->name, sizeof sc->name, "%s_scale", t->name);
        }
    return KDS_OK;
}

/* eng_st_fill_fn: one output tensor's bytes. A codes tensor quantises its
 * expert row by row (its scales, written next, come out of the same rows
 * and are quantised again: cheaper than holding them). */
static kds_status fill(void *user, size_t index, void *buf, size_t n_bytes, kds_err *err) {
    quantizer *q = user;
    const out_tensor *o = &q->shard[index];
    const eng_st_tensor *t = o->src;
    if (o->part == 0) {
        memcpy(buf, t->data, n_bytes);
    } else {
        bool ok;
        const kern_dtype src_dt = element_format(t->dtype, &ok);
        const int rows = (int)t->shape[0], cols = (int)t->shape[1];
        const kern_weight w = {.dt = src_dt, .data = t->data, .rows = rows, .cols = cols};
        const kern_layout l = kern_weight_layout(o->fmt, rows, cols);
        for (int r = 0; r < rows; r++) {
            kern_weight_row_f32(&w, r, 0, cols, q->row);
            kern_quantize_row(o->fmt, q->row, cols, q->codes, q->scales);
            if (o->part == 1)
                memcpy((unsigned char *)buf + (size_t)r * l.row_bytes, q->codes, l.row_bytes);
            else
                memcpy((unsigned char *)buf + (size_t)r * l.scale_row_bytes, q->scales,
                       l.scale_row_bytes);
        }
    }
    eng_progress_add(&q->line, n_bytes);
    (void)err;
    return KDS_OK;
}

static eng_st_dtype out_dtype(const out_tensor *o) {
    if (o->part == 0) return o->src->dtype;
    if (o->fmt == KERN_Q8_0) return o->part == 1 ? ENG_ST_I8 : ENG_ST_F16;
    return ENG_ST_U8;
}

static kds_status write_shard(quantizer *q, size_t begin, size_t end, const char *path) {
    static const char *const metadata[] = {"format", "pt", NULL};
    const size_t n = end - begin;
    eng_st_out_tensor *out = calloc(n ? n : 1, sizeof *out);
    if (!out) return kds_err_set(q->err, KDS_NOMEM, "out of memory writing %s", path);
    for (size_t i = 0; i < n; i++) {
        const out_tensor *o = &q->t[begin + i];
        out[i].name = o->name;
        out[i].dtype = out_dtype(o);
        out[i].n_dims = o->src->n_dims;
        memcpy(out[i].shape, o->src->shape, sizeof out[i].shape);
        if (o->part) {
            const kern_layout l = kern_weight_layout(o->fmt, o->src->shape[0], o->src->shape[1]);
            out[i].shape[1] = o->part == 1 ? (int64_t)l.row_bytes : o->src->shape[1] / KERN_BLOCK;
        }
    }
    q->shard = &q->t[begin];
    kds_status rc = eng_st_write_stream(path, out, n, metadata, fill, q, q->err);
    free(out);
    return rc;
}

/* config.json with MXFP4's quantization_config in its text model (K3:
 * text_config) when any matrix is MXFP4; its `ignore` names what stays
 * bf16 (all but the experts, or with dense MXFP4 only the embedding, the
 * routers and the vision tower). Q8_0 needs none: its tensors say what they
 * are. */
static kds_status write_config(const eng_model *m, const quantizer *q, const char *src_dir,
                               const char *out_dir, kds_err *err) {
    char *src = eng__path_join(src_dir, "config.json"), *dst = eng__path_join(out_dir, "config.json");
    char *text = NULL, *json = NULL;
    size_t len = 0;
    cJSON *root = NULL;
    kds_status rc = KDS_OK;
    if (!src || !dst) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory writing the config");
        goto out;
    }
    if ((rc = eng__read_file(src, (size_t)16 << 20, &text, &len, err)) != KDS_OK) goto out;
    if (!(root = cJSON_ParseWithLength(text, len))) {
        rc = kds_err_set(err, KDS_BAD_FORMAT, "%s: not valid JSON", src);
        goto out;
    }
    cJSON *tc = m->cfg.family == ENG_FAMILY_KIMI_K3
                    ? cJSON_GetObjectItemCaseSensitive(root, "text_config") : root;
    const bool dense_mxfp4 = q->dense && q->dense_fmt == KERN_MXFP4;
    if ((q->fmt == KERN_MXFP4 || dense_mxfp4) && tc) {
        cJSON_DeleteItemFromObjectCaseSensitive(tc, "quantization_config");
        eng__config_add_mxfp4(tc, dense_mxfp4);
    }
    if (!(json = cJSON_Print(root))) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory writing the config");
        goto out;
    }
    FILE *f = fopen(dst, "wb");
    if (!f || fputs(json, f) == EOF || fputc('\n', f) == EOF) rc = kds_err_set(err, KDS_IO, "%s: %s", dst, strerror(errno));
    if (f && fclose(f) != 0 && rc == KDS_OK) rc = kds_err_set(err, KDS_IO, "%s: %s", dst, strerror(errno));
out:
    cJSON_Delete(root);
    free(json);
    free(text);
    free(src);
    free(dst);
    return rc;
}

/* The tokenizer and everything else beside the weights, copied. */
static kds_status copy_others(const char *src_dir, const char *out_dir, kds_err *err) {
    DIR *d = opendir(src_dir);
    if (!d) return kds_err_set(err, KDS_IO, "%s: %s", src_dir, strerror(errno));
    kds_status rc = KDS_OK;
    struct dirent *e;
    while (rc == KDS_OK && (e = readdir(d))) {
        const char *n = e->d_name;
        const size_t len = strlen(n);
        if (n[0] == '.' || strcmp(n, "config.json") == 0 ||
            strcmp(n, "model.safetensors.index.json") == 0 ||
            (len > 12 && strcmp(n + len - 12, ".safetensors") == 0))
            continue;
        char *from = eng__path_join(src_dir, n), *to = eng__path_join(out_dir, n);
        struct stat st;
        if (!from || !to) {
            rc = kds_err_set(err, KDS_NOMEM, "out of memory copying %s", n);
        } else if (stat(from, &st) == 0 && S_ISREG(st.st_mode)) {
            char *buf = NULL;
            size_t blen = 0;
            if ((rc = eng__read_file(from, (size_t)1 << 30, &buf, &blen, err)) == KDS_OK) {
                FILE *f = fopen(to, "wb");
                if (!f || fwrite(buf, 1, blen, f) != blen) rc = kds_err_set(err, KDS_IO, "%s: %s", to, strerror(errno));
                if (f && fclose(f) != 0 && rc == KDS_OK) rc = kds_err_set(err, KDS_IO, "%s: %s", to, strerror(errno));
            }
            free(buf);
        }
        free(from);
        free(to);
    }
    closedir(d);
    return rc;
}

eng_quantize_params eng_quantize_default_params(void) {
    return (eng_quantize_params){.experts = KERN_MXFP4, .dense = false, .dense_fmt = KERN_Q8_0,
                                 .progress = false};
}

kds_status eng_model_quantize(const char *src_dir, const eng_quantize_params *p,
                              const char *out_dir, char fingerprint[33], kds_err *err) {
    if (!p) return kds_err_set(err, KDS_INVALID_ARG, "eng_model_quantize: no parameters");
    const kern_dtype experts = p->experts;
    const bool progress = p->progress;
    if (experts != KERN_MXFP4 && experts != KERN_Q8_0)
        return kds_err_set(err, KDS_INVALID_ARG, "experts can be quantised to mxfp4 or q8_0");
    if (p->dense && p->dense_fmt != KERN_MXFP4 && p->dense_fmt != KERN_Q8_0)
        return kds_err_set(err, KDS_INVALID_ARG,
                           "the other matrices can be quantised to mxfp4 or q8_0");
    quantizer q = {.fmt = experts, .dense = p->dense, .dense_fmt = p->dense_fmt,
                   .err = err, .rc = KDS_OK};
    eng_model *m = NULL, *back = NULL;
    eng_model_params mp = eng_model_default_params();
    mp.progress = progress;
    char **shard_names = NULL;
    int n_shards = 0;
    kds_status rc = eng_model_load(src_dir, &mp, &m, err);
    if (rc != KDS_OK) goto out;
    if (m->n_moe == 0) {
        rc = kds_err_set(err, KDS_INVALID_ARG, "%s has no routed experts to quantise", src_dir);
        goto out;
    }
    if (kern_dtype_is_block(m->banks[0]->w1[0].dt)) {
        rc = kds_err_set(err, KDS_INVALID_ARG, "%s: the routed experts are %s already", src_dir,
                         kern_dtype_name(m->banks[0]->w1[0].dt));
        goto out;
    }
    eng__plan_tensors(&m->cfg, NULL, note_matrix, &q);
    if ((rc = q.rc) != KDS_OK) goto out;
    qsort(q.experts.v, q.experts.n, sizeof *q.experts.v, cmp_str);
    qsort(q.others.v, q.others.n, sizeof *q.others.v, cmp_str);
    if ((rc = plan_outputs(&q, m)) != KDS_OK) goto out;
    int widest = 1;
    for (size_t i = 0; i < q.n; i++)
        if (q.t[i].part && q.t[i].src->shape[1] > widest) widest = (int)q.t[i].src->shape[1];
    q.row = malloc((size_t)widest * sizeof *q.row);
    q.codes = malloc((size_t)widest + 64);
    q.scales = malloc((size_t)widest / 16 + 64);
    if (!q.row || !q.codes || !q.scales) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory quantising");
        goto out;
    }
    /* shards: greedy, in order, at most 4 GiB each */
    size_t *cuts = calloc(q.n + 2, sizeof *cuts);
    if (!cuts) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory planning shards");
        goto out;
    }
    for (size_t i = 0; i < q.n; i++) q.total += q.t[i].bytes;
    n_shards = 1;
    if (q.total > QUANT_SHARD_BYTES) {
        uint64_t cur = 0;
        n_shards = 0;
        for (size_t i = 0; i < q.n; i++) {
            if (i == 0 || (cur > 0 && cur + q.t[i].bytes > QUANT_SHARD_BYTES)) {
                cuts[n_shards++] = i;
                cur = 0;
            }
            cur += q.t[i].bytes;
        }
    }
    cuts[n_shards] = q.n;
    if (mkdir(out_dir, 0755) != 0 && errno != EEXIST) {
        rc = kds_err_set(err, KDS_IO, "mkdir %s: %s", out_dir, strerror(errno));
        free(cuts);
        goto out;
    }
    shard_names = calloc((size_t)n_shards, sizeof *shard_names);
    if (!shard_names) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory naming shards");
        free(cuts);
        goto out;
    }
    eng_progress_start(&q.line, progress ? stderr : NULL, q.total, "quantising into %s", out_dir);
    for (int s = 0; s < n_shards && rc == KDS_OK; s++) {
        char name[64];
        if (n_shards == 1)
            snprintf(name, sizeof name, "model.safetensors");
        else
            snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, n_shards);
        shard_names[s] = eng__path_join(out_dir, name);
        rc = shard_names[s] ? write_shard(&q, cuts[s], cuts[s + 1], shard_names[s])
                            : kds_err_set(err, KDS_NOMEM, "out of memory");
    }
    if (rc == KDS_OK)
        eng_progress_finish(&q.line);
    else
        eng_progress_abandon(&q.line);
    if (rc == KDS_OK && n_shards > 1) {
        /* the index: every written tensor's shard */
        cJSON *root = cJSON_CreateObject(), *wm = cJSON_AddObjectToObject(root, "weight_map");
        cJSON_AddNumberToObject(cJSON_AddObjectToObject(root, "metadata"), "total_size", (double)q.total);
        for (int s = 0; s < n_shards && wm; s++) {
            const char *base = strrchr(shard_names[s], '/');
            for (size_t i = cuts[s]; i < cuts[s + 1]; i++)
                cJSON_AddStringToObject(wm, q.t[i].name, base ? base + 1 : shard_names[s]);
        }
        char *json = cJSON_Print(root), *ip = eng__path_join(out_dir, "model.safetensors.index.json");
        FILE *f = json && ip ? fopen(ip, "wb") : NULL;
        if (!f || fputs(json, f) == EOF) rc = kds_err_set(err, KDS_IO, "writing the index in %s", out_dir);
        if (f && fclose(f) != 0 && rc == KDS_OK) rc = kds_err_set(err, KDS_IO, "writing the index in %s", out_dir);
        free(json);
        free(ip);
        cJSON_Delete(root);
    }
    free(cuts);
    if (rc == KDS_OK) rc = write_config(m, &q, src_dir, out_dir, err);
    if (rc == KDS_OK) rc = copy_others(src_dir, out_dir, err);
    /* it must load back, as a model with these experts */
    if (rc == KDS_OK && (rc = eng_model_load(out_dir, &mp, &back, err)) == KDS_OK) {
        if (back->banks[0]->w1[0].dt != experts)
            rc = kds_err_set(err, KDS_INTERNAL, "%s loads back with %s experts", out_dir,
                             kern_dtype_name(back->banks[0]->w1[0].dt));
        else if (fingerprint)
            snprintf(fingerprint, 33, "%s", eng_model_fingerprint(back));
    }
out:
    for (int s = 0; shard_names && s < n_shards; s++) free(shard_names[s]);
    free(shard_names);
    list_free(&q.experts);
    list_free(&q.others);
    free(q.t);
    free(q.row);
    free(q.codes);
    free(q.scales);
    eng_model_free(back);
    eng_model_free(m);
    return rc;
}
