/* test_model_util.c - see test_model_util.h. */
#define _XOPEN_SOURCE 700 /* nftw */
#include "test_model_util.h"

#include "eng.h"
#include "eng_config.h"
#include "eng_genmodel.h"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

char *tmu_mkdtemp(void) {
    char tmpl[] = "/tmp/kds_model_test_XXXXXX";
    if (!mkdtemp(tmpl)) return NULL;
    return strdup(tmpl);
}

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

void tmu_rmtree(const char *dir) {
    if (dir) nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

char *tmu_path(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

char *tmu_read(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[n] = '\0';
        if (len) *len = (size_t)n;
    }
    return buf;
}

bool tmu_write(const char *path, const void *data, size_t len) {
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    bool ok = fwrite(data, 1, len, f) == len;
    return fclose(f) == 0 && ok;
}

bool tmu_copy(const char *src, const char *dst) {
    size_t n = 0;
    char *buf = tmu_read(src, &n);
    if (!buf) return false;
    bool ok = tmu_write(dst, buf, n);
    free(buf);
    return ok;
}

static bool copy_named(const char *src_dir, const char *dst_dir, const char *name) {
    char *s = tmu_path(src_dir, name), *d = tmu_path(dst_dir, name);
    bool ok = s && d && tmu_copy(s, d);
    free(s);
    free(d);
    return ok;
}

bool tmu_copy_model(const char *src_dir, const char *dst_dir) {
    return copy_named(src_dir, dst_dir, "config.json") &&
           copy_named(src_dir, dst_dir, "model.safetensors");
}

bool tmu_rewrite(const char *src_dir, const char *dst_dir, const char *out_name, tmu_edit_fn edit,
                 void *user) {
    bool ok = false;
    eng_st_file *f = NULL;
    eng_st_out_tensor *out = NULL;
    char *names = NULL;
    char *src = tmu_path(src_dir, "model.safetensors");
    char *dst = tmu_path(dst_dir, out_name);
    if (!src || !dst || !copy_named(src_dir, dst_dir, "config.json")) goto out;
    if (eng_st_open(src, &f, NULL) != KDS_OK) goto out;
    size_t n = eng_st_count(f), k = 0;
    out = calloc(n ? n : 1, sizeof *out);
    names = calloc(n ? n : 1, 128); /* editable copies of the names */
    if (!out || !names) goto out;
    for (size_t i = 0; i < n; i++) {
        const eng_st_tensor *t = eng_st_at(f, i);
        eng_st_out_tensor o = {
            .name = names + 128 * k, .dtype = t->dtype, .n_dims = t->n_dims, .data = t->data};
        snprintf(names + 128 * k, 128, "%s", t->name);
        for (int d = 0; d < t->n_dims; d++)
            o.shape[d] = t->shape[d];
        if (edit && !edit(user, &o)) continue;
        out[k++] = o;
    }
    ok = eng_st_write(dst, out, k, NULL, NULL) == KDS_OK;
out:
    eng_st_close(f);
    free(names);
    free(out);
    free(src);
    free(dst);
    return ok;
}

bool tmu_write_st(const char *path, const char *header, size_t data_len) {
    size_t hl = strlen(header), padded = (hl + 7) & ~(size_t)7;
    size_t total = 8 + padded + data_len;
    unsigned char *buf = calloc(1, total);
    if (!buf) return false;
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    memcpy(buf + 8, header, hl);
    memset(buf + 8 + hl, ' ', padded - hl);
    bool ok = tmu_write(path, buf, total);
    free(buf);
    return ok;
}

bool tmu_replace_in_file(const char *path, const char *from, const char *to) {
    size_t n = 0;
    char *text = tmu_read(path, &n);
    if (!text) return false;
    char *hit = strstr(text, from);
    bool ok = false;
    if (hit) {
        size_t lf = strlen(from), lt = strlen(to);
        char *out = malloc(n - lf + lt + 1);
        if (out) {
            size_t pre = (size_t)(hit - text);
            memcpy(out, text, pre);
            memcpy(out + pre, to, lt);
            memcpy(out + pre + lt, hit + lf, n - pre - lf);
            ok = tmu_write(path, out, n - lf + lt);
            free(out);
        }
    }
    free(text);
    return ok;
}

eng_model *tmu_gen_load(const char *preset, uint64_t seed, char **dir, kds_err *err) {
    return tmu_gen_load_hidden(preset, 0, seed, dir, err);
}

eng_model *tmu_gen_load_hidden(const char *preset, int hidden, uint64_t seed, char **dir,
                               kds_err *err) {
    return tmu_gen_load_sized(preset, hidden, 0, seed, dir, err);
}

eng_model *tmu_gen_load_sized(const char *preset, int hidden, int dense_inner, uint64_t seed,
                              char **dir, kds_err *err) {
    eng_config cfg;
    eng_model *m = NULL;
    *dir = NULL;
    if (eng_genmodel_preset(preset, &cfg, err) != KDS_OK) return NULL;
    if (hidden > 0) cfg.hidden_size = hidden;
    if (dense_inner > 0) cfg.intermediate_size = dense_inner;
    if (!(*dir = tmu_mkdtemp())) {
        kds_err_set(err, KDS_IO, "cannot make a temporary directory");
        return NULL;
    }
    eng_model_params mp = eng_model_default_params();
    mp.no_fingerprint_cache = true;
    if (eng_genmodel_write(&cfg, seed, KERN_BF16, *dir, false, err) != KDS_OK ||
        eng_model_load(*dir, &mp, &m, err) != KDS_OK) {
        tmu_rmtree(*dir);
        free(*dir);
        *dir = NULL;
        return NULL;
    }
    return m;
}
