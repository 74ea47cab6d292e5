/*
 * eng_load.c - load a Kimi-Linear checkpoint directory (config.json plus
 * model.safetensors, or model.safetensors.index.json and its shards) into a
 * struct eng_model, and fingerprint it.
 *
 * Order of work: parse the config; open and validate every safetensors file
 * (eng_st_open checks the headers); build a name-sorted catalog of the
 * tensors; bind every tensor the config implies, checking presence, dtype
 * and exact shape (kda-model-spec.md §2); convert the small per-channel
 * vectors to float32; create the tokenizer; fingerprint.
 *
 * Nothing here trusts the files: every refusal names the file or tensor, and
 * partial work is undone through eng_model_free (all fields start NULL).
 */
#define _XOPEN_SOURCE 700 /* realpath */
#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "eng_ep.h"
#include "eng_genmodel.h"
#include "eng_model.h"
#include "eng_plan.h"
#include "eng_progress.h"
#include "eng_tokenizer.h"
#include "kds_file.h"

/* JSON files larger than these are damage, not a model (the 48B index is
 * about 2 MB, its config 2 KB). */
#define LOAD_MAX_CONFIG_BYTES ((size_t)16 << 20)
#define LOAD_MAX_INDEX_BYTES ((size_t)256 << 20)
/* How many tensors the plan may lack before the loader refuses without
 * listing it (bind_all): walking 65536 names costs milliseconds. */
#define LOAD_MAX_MISSING_TENSORS ((size_t)1 << 16)
/* Bytes hashed between progress updates. */
#define LOAD_HASH_STEP ((size_t)64 << 20)
/* Versioned into the cache key so a change of the hashed layout can never
 * reuse an old cached value. */
#define LOAD_FP_VERSION "kdaserve-fingerprint-v1"

eng_model_params eng_model_default_params(void) {
    eng_model_params p = {.cache_dir = NULL, .no_fingerprint_cache = false, .progress = false};
    return p;
}

/* ------------------------------------------------------------------------ */
/* Small helpers                                                             */

char *eng__path_join(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    char *p = malloc(la + lb + 2);
    if (!p) return NULL;
    memcpy(p, a, la);
    size_t n = la;
    if (n > 0 && p[n - 1] != '/') p[n++] = '/';
    memcpy(p + n, b, lb + 1);
    return p;
}

eng_path_state eng__path_state(const char *path) {
    struct stat st;
    if (stat(path, &st) == 0) return ENG_PATH_PRESENT;
    return errno == ENOENT || errno == ENOTDIR ? ENG_PATH_ABSENT : ENG_PATH_ERROR;
}

kds_status eng__read_file(const char *path, size_t cap, char **buf, size_t *len, kds_err *err) {
    kds_status rc = KDS_OK;
    *buf = NULL;
    *len = 0;
    int fd;
    size_t n;
    if ((rc = kds_open_regular(path, &fd, &n, err)) != KDS_OK) return rc;
    if (n > cap) {
        rc = kds_err_set(err, KDS_TOO_LARGE, "%s: %zu bytes is too large (limit %zu)", path, n, cap);
        goto out_close;
    }
    char *b = malloc(n + 1);
    if (!b) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory reading %s", path);
        goto out_close;
    }
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, b + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            free(b);
            rc = kds_err_set(err, KDS_IO, "%s: short read", path);
            goto out_close;
        }
        got += (size_t)r;
    }
    b[n] = '\0';
    *buf = b;
    *len = n;
out_close:
    close(fd);
    return rc;
}

static void fmt_shape(char *buf, size_t cap, int nd, const int64_t *d) {
    size_t o = 0;
    o += (size_t)snprintf(buf + o, cap - o, "[");
    for (int i = 0; i < nd && o < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%lld", i ? ", " : "", (long long)d[i]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

/* ------------------------------------------------------------------------ */
/* The catalog: every tensor of the checkpoint, sorted by name.              */

typedef struct cat_entry {
    const char *name; /* borrowed from the shard's header */
    const eng_st_tensor *t;
    int shard;
    uint64_t gen_key; /* generated models (eng_model_generate): a matrix's stream */
    float gen_sd;
    bool expert;      /* bound as (part of) a routed expert's matrix: not in the EP digest */
    bool bound;       /* read by the model (else a tensor of the file the model does not use) */
} cat_entry;

static int cat_cmp(const void *a, const void *b) {
    const cat_entry *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    if (c) return c;
    return (x->shard > y->shard) - (x->shard < y->shard);
}

typedef struct loader {
    eng_model *m;
    const char *dir;
    char *where;      /* the weights file or index, for messages */
    char *index_path; /* NULL when unsharded */
    cat_entry *cat;
    size_t n_cat;
    kds_err *err;
    kds_status rc;  /* sticky: the first failure wins */
    char name[256]; /* tensor being bound */
    bool expert;    /* it is a routed expert's matrix */
    eng_weights_mode weights; /* resolved: never AUTO from KDS_WEIGHTS */
    bool progress;
} loader;

static void fail(loader *ld, kds_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void fail(loader *ld, kds_status s, const char *fmt, ...) {
    if (ld->rc != KDS_OK) return;
    ld->rc = s;
    if (!ld->err) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ld->err->msg, sizeof ld->err->msg, fmt, ap);
    va_end(ap);
    ld->err->status = s;
}

/* Sort the catalog and refuse a tensor listed twice. */
static kds_status sort_catalog(loader *ld) {
    qsort(ld->cat, ld->n_cat, sizeof *ld->cat, cat_cmp);
    for (size_t i = 1; i < ld->n_cat; i++)
        if (strcmp(ld->cat[i].name, ld->cat[i - 1].name) == 0)
            return kds_err_set(ld->err, KDS_BAD_FORMAT, "%s: tensor '%s' appears twice", ld->where,
                               ld->cat[i].name);
    return KDS_OK;
}

static const cat_entry *cat_find(const loader *ld, const char *name) {
    cat_entry key = {.name = name, .t = NULL, .shard = 0};
    size_t lo = 0, hi = ld->n_cat;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(ld->cat[mid].name, key.name);
        if (c == 0) return &ld->cat[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* The amount from a line "key: N kB" of /proc/meminfo, in bytes; 0 if absent. */
static size_t meminfo_bytes(const char *key) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    size_t v = 0, klen = strlen(key);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, klen) && line[klen] == ':') {
            v = (size_t)strtoull(line + klen + 1, NULL, 10) << 10;
            break;
        }
    fclose(f);
    return v;
}

/* Whether AUTO reads a weights file of `bytes` into memory: it is larger
 * than half the last-level cache (a decode streams it from memory, where
 * 2 MiB pages read 10-20% faster: docs/benchmarks.md, "Weights in 2 MiB
 * pages"), transparent huge pages are not off, and the memory available
 * holds it with an eighth and 512 MiB to spare. */
static bool resident_pays(size_t bytes) {
    const size_t llc = eng_llc_bytes();
    if (bytes <= (llc ? llc : (size_t)32 << 20) / 2) return false;
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f) return false;
    char mode[128] = "";
    const bool read_ok = fgets(mode, sizeof mode, f) != NULL;
    fclose(f);
    if (!read_ok || strstr(mode, "[never]")) return false;
    return meminfo_bytes("MemAvailable") >= bytes + bytes / 8 + ((size_t)512 << 20);
}

/* One weights file, mapped or read into memory as ld->weights says (AUTO:
 * resident_pays; there a failed allocation falls back to the mapping). */
static kds_status open_weights_file(loader *ld, const char *path, eng_st_file **out) {
    bool resident = ld->weights == ENG_WEIGHTS_RESIDENT;
    if (ld->weights == ENG_WEIGHTS_AUTO) {
        struct stat sb;
        resident = stat(path, &sb) == 0 && S_ISREG(sb.st_mode) && resident_pays((size_t)sb.st_size);
    }
    if (!resident) return eng_st_open(path, out, ld->err);
    kds_status rc = eng_st_open_resident(path, ld->progress, out, ld->err);
    if (rc == KDS_NOMEM && ld->weights == ENG_WEIGHTS_AUTO) rc = eng_st_open(path, out, ld->err);
    return rc;
}

static kds_status open_single(loader *ld, const char *path) {
    eng_model *m = ld->m;
    kds_status rc = open_weights_file(ld, path, &m->shards[0]);
    if (rc != KDS_OK) return rc;
    m->n_shards = 1;
    size_t n = eng_st_count(m->shards[0]);
    ld->cat = calloc(n ? n : 1, sizeof *ld->cat);
    if (!ld->cat) return kds_err_set(ld->err, KDS_NOMEM, "out of memory loading %s", path);
    for (size_t i = 0; i < n; i++) {
        const eng_st_tensor *t = eng_st_at(m->shards[0], i);
        ld->cat[i] = (cat_entry){.name = t->name, .t = t, .shard = 0};
    }
    ld->n_cat = n;
    return sort_catalog(ld);
}

/* A shard must be a plain file name next to the index (no directories: the
 * index must not reach outside the model directory). */
static bool shard_name_ok(const char *s) {
    return s[0] && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

/* model.safetensors.index.json: {"weight_map": {tensor: shard file}}. Opens
 * each distinct shard once; every entry must name a tensor its shard has. */
static kds_status open_sharded(loader *ld) {
    eng_model *m = ld->m;
    kds_status rc = KDS_OK;
    char *text = NULL;
    size_t len = 0;
    cJSON *root = NULL;
    char *shard_names[ENG_MAX_SHARDS] = {0};
    int *entry_shard = NULL;
    cat_entry *all = NULL;
    size_t n_all = 0;

    if ((rc = eng__read_file(ld->index_path, LOAD_MAX_INDEX_BYTES, &text, &len, ld->err)) != KDS_OK)
        goto out;
    root = cJSON_ParseWithLength(text, len);
    if (!root || !cJSON_IsObject(root)) {
        rc = kds_err_set(ld->err, KDS_BAD_FORMAT, "%s: not a JSON object", ld->index_path);
        goto out;
    }
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        rc = kds_err_set(ld->err, KDS_BAD_FORMAT, "%s: 'weight_map' is missing or not an object",
                         ld->index_path);
        goto out;
    }
    size_t n = (size_t)cJSON_GetArraySize(wm);
    entry_shard = calloc(n ? n : 1, sizeof *entry_shard);
    if (!entry_shard) {
        rc = kds_err_set(ld->err, KDS_NOMEM, "out of memory reading %s", ld->index_path);
        goto out;
    }
    /* Pass 1: open every distinct shard. */
    size_t i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, wm) {
        if (!cJSON_IsString(it) || !shard_name_ok(it->valuestring)) {
            rc = kds_err_set(ld->err, KDS_BAD_FORMAT,
                             "%s: weight_map entry '%s' is not a plain shard file name",
                             ld->index_path, it->string);
            goto out;
        }
        int s = 0;
        while (s < m->n_shards && strcmp(shard_names[s], it->valuestring) != 0)
            s++;
        if (s == m->n_shards) {
            if (m->n_shards == ENG_MAX_SHARDS) {
                rc = kds_err_set(ld->err, KDS_TOO_LARGE, "%s: more than %d shards", ld->index_path,
                                 ENG_MAX_SHARDS);
                goto out;
            }
            shard_names[s] = strdup(it->valuestring);
            char *path = eng__path_join(ld->dir, it->valuestring);
            if (!shard_names[s] || !path) {
                free(path);
                rc = kds_err_set(ld->err, KDS_NOMEM, "out of memory reading %s", ld->index_path);
                goto out;
            }
            rc = open_weights_file(ld, path, &m->shards[s]);
            free(path);
            if (rc != KDS_OK) {
                kds_err_prefix(ld->err, "%s: shard '%s' (holding '%s')", ld->index_path,
                               it->valuestring, it->string);
                goto out;
            }
            m->n_shards++;
        }
        entry_shard[i++] = s;
    }
    /* Pass 2: all tensors of all shards sorted by (name, shard), so each
     * weight_map entry is one binary search. */
    for (int s = 0; s < m->n_shards; s++)
        n_all += eng_st_count(m->shards[s]);
    all = calloc(n_all ? n_all : 1, sizeof *all);
    ld->cat = calloc(n ? n : 1, sizeof *ld->cat);
    if (!all || !ld->cat) {
        rc = kds_err_set(ld->err, KDS_NOMEM, "out of memory reading %s", ld->index_path);
        goto out;
    }
    size_t k = 0;
    for (int s = 0; s < m->n_shards; s++)
        for (size_t j = 0; j < eng_st_count(m->shards[s]); j++) {
            const eng_st_tensor *t = eng_st_at(m->shards[s], j);
            all[k++] = (cat_entry){.name = t->name, .t = t, .shard = s};
        }
    qsort(all, n_all, sizeof *all, cat_cmp);
    i = 0;
    cJSON_ArrayForEach(it, wm) {
        cat_entry key = {.name = it->string, .t = NULL, .shard = entry_shard[i]};
        const cat_entry *hit = bsearch(&key, all, n_all, sizeof *all, cat_cmp);
        if (!hit) {
            rc = kds_err_set(ld->err, KDS_NOT_FOUND,
                             "%s: weight_map puts tensor '%s' in shard '%s', which has no such "
                             "tensor",
                             ld->index_path, it->string, it->valuestring);
            goto out;
        }
        ld->cat[i++] = *hit;
    }
    ld->n_cat = n;
    rc = sort_catalog(ld);
out:
    for (int s = 0; s < ENG_MAX_SHARDS; s++)
        free(shard_names[s]);
    free(all);
    free(entry_shard);
    cJSON_Delete(root);
    free(text);
    return rc;
}

static kds_status open_weights(loader *ld) {
    kds_status rc = KDS_OK;
    char *single = eng__path_join(ld->dir, "model.safetensors");
    char *index = eng__path_join(ld->dir, "model.safetensors.index.json");
    if (!single || !index) {
        rc = kds_err_set(ld->err, KDS_NOMEM, "out of memory loading %s", ld->dir);
        goto out;
    }
    /* Like transformers: a single model.safetensors wins over an index. A
     * path that cannot be resolved (a symlink loop) is an error, not an
     * absent file. */
    eng_path_state ss = eng__path_state(single), is = ENG_PATH_ABSENT;
    int path_errno = errno;
    if (ss == ENG_PATH_ABSENT) {
        is = eng__path_state(index);
        path_errno = errno;
    }
    if (ss == ENG_PATH_ERROR || is == ENG_PATH_ERROR) {
        rc = kds_err_set(ld->err, KDS_IO, "%s: %s", ss == ENG_PATH_ERROR ? single : index,
                         path_errno == ELOOP ? "too many levels of symbolic links (a symlink loop?)"
                                             : strerror(path_errno));
    } else if (ss == ENG_PATH_PRESENT) {
        ld->where = single;
        single = NULL;
        rc = open_single(ld, ld->where);
    } else if (is == ENG_PATH_PRESENT) {
        ld->where = strdup(index);
        ld->index_path = index;
        index = NULL;
        rc = ld->where ? open_sharded(ld)
                       : kds_err_set(ld->err, KDS_NOMEM, "out of memory loading %s", ld->dir);
    } else {
        rc = kds_err_set(ld->err, KDS_NOT_FOUND,
                         "%s: no model.safetensors or model.safetensors.index.json", ld->dir);
    }
out:
    free(single);
    free(index);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Binding tensors: the plan lists every tensor (eng__plan_tensors), the
 * loader finds, checks and binds each. Every binder is a no-op once the
 * loader has failed.                                                       */

/* The element format of a stored tensor, for a matrix or vector that must
 * be F32, BF16 or F16. */
static bool element_format(eng_st_dtype st, kern_dtype *dt) {
    switch (st) {
    case ENG_ST_F32: *dt = KERN_F32; return true;
    case ENG_ST_BF16: *dt = KERN_BF16; return true;
    case ENG_ST_F16: *dt = KERN_F16; return true;
    default: return false;
    }
}

static bool shape_is(const eng_st_tensor *t, int nd, const int64_t *d) {
    if (t->n_dims != nd) return false;
    for (int i = 0; i < nd; i++)
        if (t->shape[i] != d[i]) return false;
    return true;
}

static void fail_shape(loader *ld, const char *name, const eng_st_tensor *t, int nd,
                       const int64_t *want, const char *what) {
    char got[128], exp[64];
    fmt_shape(got, sizeof got, t->n_dims, t->shape);
    fmt_shape(exp, sizeof exp, nd, want);
    fail(ld, KDS_MISMATCH, "tensor '%s' has shape %s; expected %s%s (%s)", name, got, exp, what,
         ld->where);
}

/* A block-format weight stored as a pair (kern.h):
 *   NAME_packed U8 [rows, cols/2] + NAME_scale U8 [rows, cols/32]  -> MXFP4
 *     (compressed-tensors' mxfp4-pack-quantized, Kimi K3's experts);
 *   NAME I8 [rows, cols] + NAME_scale F16 [rows, cols/32]          -> Q8_0.
 * Returns false (no failure) when neither form is present. */
static bool bind_block_pair(loader *ld, eng_weight *w, int64_t rows, int64_t cols) {
    char packed[sizeof ld->name + 8], scale[sizeof ld->name + 8];
    snprintf(packed, sizeof packed, "%s_packed", ld->name);
    snprintf(scale, sizeof scale, "%s_scale", ld->name);
    const cat_entry *codes = cat_find(ld, packed), *scales = cat_find(ld, scale);
    kern_dtype dt;
    const char *code_name = packed;
    if (codes && codes->t->dtype == ENG_ST_U8) {
        dt = KERN_MXFP4;
    } else {
        codes = cat_find(ld, ld->name);
        if (!codes || codes->t->dtype != ENG_ST_I8 || !scales) return false;
        dt = KERN_Q8_0;
        code_name = ld->name;
    }
    if (!scales) {
        fail(ld, KDS_NOT_FOUND, "tensor '%s' has no '%s' beside it (%s)", code_name, scale, ld->where);
        return true;
    }
    const kern_layout lay = kern_weight_layout(dt, rows, cols);
    if (!lay.bytes && rows * cols > 0) {
        fail(ld, KDS_MISMATCH,
             "tensor '%s': %s weights need a multiple of %d input columns (it has %lld) (%s)",
             code_name, kern_dtype_name(dt), KERN_BLOCK, (long long)cols, ld->where);
        return true;
    }
    const eng_st_dtype scale_dt = dt == KERN_MXFP4 ? ENG_ST_U8 : ENG_ST_F16;
    if (scales->t->dtype != scale_dt) {
        fail(ld, KDS_MISMATCH, "tensor '%s' has dtype %s; %s scales are %s (%s)", scale,
             eng_st_dtype_name(scales->t->dtype), kern_dtype_name(dt), eng_st_dtype_name(scale_dt),
             ld->where);
        return true;
    }
    const int64_t code_shape[2] = {rows, (int64_t)lay.row_bytes};
    const int64_t scale_shape[2] = {rows, cols / KERN_BLOCK};
    if (!shape_is(codes->t, 2, code_shape)) {
        fail_shape(ld, code_name, codes->t, 2, code_shape,
                   dt == KERN_MXFP4 ? " (two 4-bit codes per byte)" : "");
        return true;
    }
    if (!shape_is(scales->t, 2, scale_shape)) {
        fail_shape(ld, scale, scales->t, 2, scale_shape, " (one scale per 32 input columns)");
        return true;
    }
    /* a generated model's pair has no bytes: both parts carry the plain
     * weight's stream (eng__genmodel_tensors) */
    *w = (eng_weight){.dt = dt, .data = codes->t->data, .scales = scales->t->data,
                      .rows = (int)rows, .cols = (int)cols, .gen_key = codes->gen_key,
                      .gen_sd = codes->gen_sd};
    eng__plan_register(ld->m, w);
    /* the loader's own catalog: marks for the expert-parallel digest */
    ((cat_entry *)codes)->bound = ((cat_entry *)scales)->bound = true;
    if (ld->expert) ((cat_entry *)codes)->expert = ((cat_entry *)scales)->expert = true;
    return true;
}

/* A Linear weight [rows, cols], read in place. */
static void bind_matrix(loader *ld, eng_weight *w, int64_t rows, int64_t cols) {
    if (ld->rc != KDS_OK) return;
    const cat_entry *e = cat_find(ld, ld->name);
    kern_dtype dt;
    if ((!e || e->t->dtype == ENG_ST_I8) && bind_block_pair(ld, w, rows, cols)) return;
    if (!e) {
        fail(ld, KDS_NOT_FOUND, "tensor '%s' not found in %s", ld->name, ld->where);
        return;
    }
    if (!element_format(e->t->dtype, &dt)) {
        fail(ld, KDS_MISMATCH,
             "tensor '%s' has dtype %s; expected F32, BF16 or F16, or a block-format pair "
             "(%s_packed + %s_scale U8: MXFP4) (%s)",
             ld->name, eng_st_dtype_name(e->t->dtype), ld->name, ld->name, ld->where);
        return;
    }
    const int64_t want[2] = {rows, cols};
    if (!shape_is(e->t, 2, want)) {
        fail_shape(ld, ld->name, e->t, 2, want, "");
        return;
    }
    *w = (eng_weight){.dt = dt, .data = e->t->data, .rows = (int)rows, .cols = (int)cols,
                      .gen_key = e->gen_key, .gen_sd = e->gen_sd};
    eng__plan_register(ld->m, w);
    ((cat_entry *)e)->bound = true; /* the loader's own catalog */
    if (ld->expert) ((cat_entry *)e)->expert = true;
}

/* A small vector, converted into the model's arena; absent and optional:
 * *out = NULL. */
static void bind_vector(loader *ld, const eng_tensor_spec *s) {
    *s->vector = NULL;
    if (ld->rc != KDS_OK) return;
    const cat_entry *e = cat_find(ld, ld->name);
    if (!e) {
        if (!s->optional) fail(ld, KDS_NOT_FOUND, "tensor '%s' not found in %s", ld->name, ld->where);
        return;
    }
    const eng_st_tensor *t = e->t;
    kern_dtype dt;
    if (!element_format(t->dtype, &dt)) {
        fail(ld, KDS_MISMATCH, "tensor '%s' has dtype %s; expected F32, BF16 or F16 (%s)", ld->name,
             eng_st_dtype_name(t->dtype), ld->where);
        return;
    }
    if (!shape_is(t, s->n_dims, s->shape) &&
        !(s->n_dims_alt > 0 && shape_is(t, s->n_dims_alt, s->shape_alt))) {
        char got[128], want[128];
        fmt_shape(got, sizeof got, t->n_dims, t->shape);
        fmt_shape(want, sizeof want, s->n_dims, s->shape);
        if (s->n_dims_alt > 0) {
            size_t o = strlen(want);
            snprintf(want + o, sizeof want - o, " or ");
            o = strlen(want);
            fmt_shape(want + o, sizeof want - o, s->n_dims_alt, s->shape_alt);
        }
        fail(ld, KDS_MISMATCH, "tensor '%s' has shape %s; expected %s (%s)", ld->name, got, want,
             ld->where);
        return;
    }
    eng_model *m = ld->m;
    const size_t n = t->n_elems;
    if (m->small_f32_cap - m->small_f32_used < n) {
        fail(ld, KDS_INTERNAL, "small-vector arena too small for '%s'", ld->name);
        return;
    }
    float *dst = m->small_f32 + m->small_f32_used;
    m->small_f32_used += n;
    kern_to_f32(dt, t->data, dst, n);
    *s->vector = dst;
    ((cat_entry *)e)->bound = true;
}

static void bind_fn(void *user, const eng_tensor_spec *s) {
    loader *ld = user;
    if (ld->rc != KDS_OK) return;
    snprintf(ld->name, sizeof ld->name, "%s", s->name);
    ld->expert = s->expert >= 0;
    if (!s->matrix) {
        bind_vector(ld, s);
        return;
    }
    bind_matrix(ld, s->weight, s->shape[0], s->shape[1]);
    /* Expert parallelism: another rank's expert is checked like any
     * matrix but never read here (eng_ep.h: placement) */
    const eng_model *m = ld->m;
    if (ld->rc == KDS_OK && ld->expert && m->ep_ranks > 1 &&
        eng_ep_owner(m->ep_placement, s->expert, m->cfg.num_experts, m->ep_ranks) != m->ep_rank) {
        s->weight->data = NULL;
        s->weight->scales = NULL;
    }
}

static kds_status bind_all(loader *ld) {
    /* A 3 KB config can ask for 256 MoE layers of 65536 experts: 50M
     * tensors that the plan would list (twice) before the first is found
     * missing. A checkpoint holds at least one tensor per routed expert, so
     * when the config implies far more than the files hold, say so without
     * the walk; a small shortfall is left to binding, which names the first
     * missing tensor. */
    const size_t need = eng__plan_min_tensors(&ld->m->cfg);
    if (need > ld->n_cat + LOAD_MAX_MISSING_TENSORS)
        return kds_err_set(ld->err, KDS_NOT_FOUND,
                           "%s: config.json implies at least %zu tensors (one per routed expert "
                           "of every MoE layer); the checkpoint has %zu",
                           ld->dir, need, ld->n_cat);
    kds_status rc = eng__plan_alloc(ld->m, ld->err);
    if (rc != KDS_OK) return rc;
    eng__plan_tensors(&ld->m->cfg, ld->m, bind_fn, ld);
    if (ld->rc != KDS_OK) return ld->rc;
    return eng__plan_check(ld->m, ld->err);
}

/* ------------------------------------------------------------------------ */
/* Fingerprint: XXH3-128 over the config bytes, then every tensor in name
 * order (name, dtype, shape, bytes). Each field is length-prefixed so that
 * no two different inputs produce the same byte stream.                    */

static void feed_u64(XXH3_state_t *st, uint64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)(v >> (8 * i));
    XXH3_128bits_update(st, b, 8);
}

static void feed_str(XXH3_state_t *st, const char *s) {
    size_t n = strlen(s);
    feed_u64(st, n);
    XXH3_128bits_update(st, s, n);
}

static kds_status hash_model(loader *ld, const char *cfg, size_t cfg_len, bool progress,
                             char out[33]) {
    XXH3_state_t *st = XXH3_createState();
    if (!st) return kds_err_set(ld->err, KDS_NOMEM, "out of memory fingerprinting %s", ld->dir);
    XXH3_128bits_reset(st);
    feed_u64(st, cfg_len);
    XXH3_128bits_update(st, cfg, cfg_len);
    feed_u64(st, ld->n_cat);
    uint64_t total = 0;
    for (size_t i = 0; i < ld->n_cat; i++)
        total += ld->cat[i].t->n_bytes;
    eng_progress line;
    eng_progress_start(&line, progress && total > ENG_PROGRESS_MIN_BYTES ? stderr : NULL, total,
                       "fingerprinting %s", ld->dir);
    for (size_t i = 0; i < ld->n_cat; i++) {
        const eng_st_tensor *t = ld->cat[i].t;
        feed_str(st, ld->cat[i].name);
        feed_str(st, eng_st_dtype_name(t->dtype));
        feed_u64(st, (uint64_t)t->n_dims);
        for (int d = 0; d < t->n_dims; d++)
            feed_u64(st, (uint64_t)t->shape[d]);
        feed_u64(st, t->n_bytes);
        /* in steps, so a huge tensor still moves the progress line */
        for (size_t off = 0; off < t->n_bytes; off += LOAD_HASH_STEP) {
            size_t n = t->n_bytes - off < LOAD_HASH_STEP ? t->n_bytes - off : LOAD_HASH_STEP;
            XXH3_128bits_update(st, (const char *)t->data + off, n);
            eng_progress_add(&line, n);
        }
    }
    eng_progress_finish(&line);
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(st));
    XXH3_freeState(st);
    for (int i = 0; i < 16; i++)
        snprintf(out + 2 * i, 3, "%02x", canon.digest[i]);
    return KDS_OK;
}

/* The expert-parallel digest (eng_model.ep_digest): like the fingerprint,
 * but the bytes only of the tensors every rank reads (not the routed
 * experts, not tensors the model leaves unused), the headers of all:
 * every rank of a job can compute it and compare. */
static kds_status hash_ep(loader *ld, const char *cfg, size_t cfg_len, unsigned char out[16]) {
    XXH3_state_t *st = XXH3_createState();
    if (!st) return kds_err_set(ld->err, KDS_NOMEM, "out of memory fingerprinting %s", ld->dir);
    XXH3_128bits_reset(st);
    feed_str(st, "kdaserve-ep-digest-v1");
    feed_u64(st, cfg_len);
    XXH3_128bits_update(st, cfg, cfg_len);
    feed_u64(st, ld->n_cat);
    for (size_t i = 0; i < ld->n_cat; i++) {
        const eng_st_tensor *t = ld->cat[i].t;
        feed_str(st, ld->cat[i].name);
        feed_str(st, eng_st_dtype_name(t->dtype));
        feed_u64(st, (uint64_t)t->n_dims);
        for (int d = 0; d < t->n_dims; d++) feed_u64(st, (uint64_t)t->shape[d]);
        feed_u64(st, t->n_bytes);
        feed_u64(st, ld->cat[i].expert);
        if (ld->cat[i].bound && !ld->cat[i].expert) XXH3_128bits_update(st, t->data, t->n_bytes);
    }
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(st));
    XXH3_freeState(st);
    memcpy(out, canon.digest, 16);
    return KDS_OK;
}

/* ------------------------------------------------------------------------ */
/* Fingerprint cache: <root>/fingerprints/<XXH3-64 of the file identities>,
 * one line of 32 hex digits. <root> = params->cache_dir, else
 * $XDG_CACHE_HOME/kdaserve, else ~/.cache/kdaserve. The key covers the
 * real path of the directory and, for config.json, the index and each shard,
 * the name, size, mtime (ns) and inode, so any rewrite of a file changes it.
 * Every failure here only means "no cache".                                */

static int str_cmp(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static void feed64_u64(XXH3_state_t *st, uint64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)(v >> (8 * i));
    XXH3_64bits_update(st, b, 8);
}

static bool feed_identity(XXH3_state_t *st, const char *path) {
    struct stat sb;
    if (stat(path, &sb) != 0) return false;
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    feed64_u64(st, strlen(base));
    XXH3_64bits_update(st, base, strlen(base));
    feed64_u64(st, (uint64_t)sb.st_size);
    feed64_u64(st, (uint64_t)sb.st_mtim.tv_sec * 1000000000u + (uint64_t)sb.st_mtim.tv_nsec);
    feed64_u64(st, (uint64_t)sb.st_ino);
    feed64_u64(st, (uint64_t)sb.st_dev);
    return true;
}

static bool cache_key(const loader *ld, const char *cfg_path, uint64_t *key) {
    bool ok = false;
    const char *paths[ENG_MAX_SHARDS];
    char *rp = realpath(ld->dir, NULL);
    XXH3_state_t *st = XXH3_createState();
    if (!rp || !st) goto out;
    XXH3_64bits_reset(st);
    XXH3_64bits_update(st, LOAD_FP_VERSION, strlen(LOAD_FP_VERSION) + 1);
    XXH3_64bits_update(st, rp, strlen(rp) + 1);
    if (!feed_identity(st, cfg_path)) goto out;
    if (ld->index_path && !feed_identity(st, ld->index_path)) goto out;
    int n = ld->m->n_shards;
    for (int s = 0; s < n; s++)
        paths[s] = eng_st_path(ld->m->shards[s]);
    qsort(paths, (size_t)n, sizeof *paths, str_cmp);
    for (int s = 0; s < n; s++)
        if (!feed_identity(st, paths[s])) goto out;
    *key = XXH3_64bits_digest(st);
    ok = true;
out:
    XXH3_freeState(st);
    free(rp);
    return ok;
}

/* <root>/fingerprints (malloc'd), or NULL when no root can be named. */
static char *cache_dir(const eng_model_params *p) {
    char *root = NULL;
    const char *xdg = getenv("XDG_CACHE_HOME");
    const char *home = getenv("HOME");
    if (p->cache_dir && p->cache_dir[0])
        root = strdup(p->cache_dir);
    else if (xdg && xdg[0] == '/')
        root = eng__path_join(xdg, "kdaserve");
    else if (home && home[0] == '/')
        root = eng__path_join(home, ".cache/kdaserve");
    if (!root) return NULL;
    char *dir = eng__path_join(root, "fingerprints");
    free(root);
    return dir;
}

/* mkdir -p; false on failure (read-only file systems are normal here). */
static bool make_dirs(char *path) {
    for (char *s = path + 1; *s; s++) {
        if (*s != '/') continue;
        *s = '\0';
        bool ok = mkdir(path, 0755) == 0 || errno == EEXIST;
        *s = '/';
        if (!ok) return false;
    }
    return mkdir(path, 0755) == 0 || errno == EEXIST;
}

static bool cache_read(const char *file, char out[33]) {
    char buf[40] = {0};
    FILE *f = fopen(file, "rb");
    if (!f) return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    if (n < 32 || (n > 32 && buf[32] != '\n')) return false;
    for (int i = 0; i < 32; i++)
        if (!((buf[i] >= '0' && buf[i] <= '9') || (buf[i] >= 'a' && buf[i] <= 'f'))) return false;
    memcpy(out, buf, 32);
    out[32] = '\0';
    return true;
}

static void cache_write(char *dir, const char *file, const char *fp) {
    if (!make_dirs(dir)) return;
    size_t n = strlen(file) + 48;
    char *tmp = malloc(n);
    if (!tmp) return;
    /* pid and a stack address: unique among processes and threads */
    snprintf(tmp, n, "%s.tmp.%ld.%lx", file, (long)getpid(), (unsigned long)(uintptr_t)&n);
    FILE *f = fopen(tmp, "wb");
    bool ok = f && fprintf(f, "%s\n", fp) == 33;
    if (f && fclose(f) != 0) ok = false;
    if (!ok || rename(tmp, file) != 0) unlink(tmp);
    free(tmp);
}

static kds_status fingerprint(loader *ld, const char *cfg_path, const char *cfg, size_t cfg_len,
                              const eng_model_params *p) {
    char *dir = NULL, *file = NULL;
    uint64_t key = 0;
    bool cached = false;
    if (!p->no_fingerprint_cache && cache_key(ld, cfg_path, &key) && (dir = cache_dir(p))) {
        char name[17];
        snprintf(name, sizeof name, "%016" PRIx64, key);
        file = eng__path_join(dir, name);
        cached = file && cache_read(file, ld->m->fingerprint);
    }
    kds_status rc = KDS_OK;
    if (!cached) {
        rc = hash_model(ld, cfg, cfg_len, p->progress, ld->m->fingerprint);
        if (rc == KDS_OK && file) cache_write(dir, file, ld->m->fingerprint);
    }
    free(file);
    free(dir);
    return rc;
}

/* ------------------------------------------------------------------------ */

kds_status eng_model_load(const char *dir, const eng_model_params *params, eng_model **out,
                          kds_err *err) {
    kds_status rc = KDS_OK;
    char *cfg_path = NULL, *cfg_text = NULL;
    size_t cfg_len = 0;
    eng_model_params p = params ? *params : eng_model_default_params();
    loader ld = {.err = err, .rc = KDS_OK};
    eng_model *m = NULL;
    if (!out) return kds_err_set(err, KDS_INVALID_ARG, "eng_model_load: no output pointer");
    *out = NULL;
    if (!dir || !dir[0]) return kds_err_set(err, KDS_INVALID_ARG, "eng_model_load: no directory");

    m = calloc(1, sizeof *m);
    if (!m) return kds_err_set(err, KDS_NOMEM, "out of memory loading %s", dir);
    m->dir = strdup(dir);
    cfg_path = eng__path_join(dir, "config.json");
    if (!m->dir || !cfg_path) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory loading %s", dir);
        goto fail;
    }
    ld.m = m;
    ld.dir = m->dir;
    m->ep_ranks = p.ep_ranks > 1 ? p.ep_ranks : 1;
    m->ep_rank = p.ep_ranks > 1 ? p.ep_rank : 0;
    m->ep_placement = p.ep_placement;
    if (m->ep_rank < 0 || m->ep_rank >= m->ep_ranks || !eng_ep_placement_name(p.ep_placement)) {
        rc = kds_err_set(err, KDS_INVALID_ARG, "expert parallelism: rank %d of %d, placement %d",
                         p.ep_rank, p.ep_ranks, (int)p.ep_placement);
        goto fail;
    }

    rc = eng__read_file(cfg_path, LOAD_MAX_CONFIG_BYTES, &cfg_text, &cfg_len, err);
    if (rc != KDS_OK) goto fail;
    rc = eng_config_parse(cfg_text, cfg_len, cfg_path, &m->cfg, err);
    if (rc != KDS_OK) goto fail;
    if (m->ep_ranks > 1 && (rc = eng_ep_check_config(&m->cfg, m->ep_ranks, err)) != KDS_OK)
        goto fail;
    ld.progress = p.progress;
    ld.weights = p.weights;
    if (ld.weights == ENG_WEIGHTS_AUTO) {
        const char *env = getenv("KDS_WEIGHTS");
        if (env && env[0] && strcmp(env, "auto") != 0) {
            if (!strcmp(env, "mapped")) {
                ld.weights = ENG_WEIGHTS_MAPPED;
            } else if (!strcmp(env, "resident")) {
                ld.weights = ENG_WEIGHTS_RESIDENT;
            } else {
                rc = kds_err_set(err, KDS_INVALID_ARG,
                                 "KDS_WEIGHTS=%s: expected auto, mapped or resident", env);
                goto fail;
            }
        }
    }
    /* a rank binds only its own experts: a copy of the whole files would
     * hold every rank's */
    if (ld.weights == ENG_WEIGHTS_AUTO && m->ep_ranks > 1) ld.weights = ENG_WEIGHTS_MAPPED;
    rc = open_weights(&ld);
    if (rc != KDS_OK) goto fail;
    rc = bind_all(&ld);
    if (rc != KDS_OK) goto fail;
    rc = eng__tok_create_model(m->dir, &m->cfg, &m->tokenizer, err);
    if (rc != KDS_OK) goto fail;
    /* a rank other than 0 reads no expert bytes but its own: the
     * fingerprint (every byte) is rank 0's, handed over when its context
     * joins the job; all compare the digest of what they share */
    if (m->ep_ranks > 1) rc = hash_ep(&ld, cfg_text, cfg_len, m->ep_digest);
    if (rc == KDS_OK && m->ep_rank == 0) rc = fingerprint(&ld, cfg_path, cfg_text, cfg_len, &p);
    if (rc != KDS_OK) goto fail;

    *out = m;
    m = NULL;
fail:
    eng_model_free(m);
    free(ld.cat);
    free(ld.where);
    free(ld.index_path);
    free(cfg_text);
    free(cfg_path);
    return rc;
}

size_t eng_model_resident_bytes(const eng_model *m) {
    size_t n = 0;
    for (int s = 0; s < m->n_shards; s++)
        if (eng_st_resident(m->shards[s])) n += eng_st_bytes(m->shards[s]);
    return n;
}

void eng_model_free(eng_model *m) {
    if (!m) return;
    for (int s = 0; s < m->n_shards; s++)
        eng_st_close(m->shards[s]);
    eng__tok_free(m->tokenizer);
    free(m->layers);
    free(m->weights);
    free(m->banks);
    free(m->expert_arena);
    free(m->small_f32);
    free(m->dir);
    free(m);
}

const eng_config *eng_model_config(const eng_model *m) {
    return &m->cfg;
}

static double weight_bytes(const eng_weight *w) {
    return (double)kern_weight_layout(w->dt, w->rows, w->cols).bytes;
}

static double weight_madds(const eng_weight *w) {
    return (double)w->rows * w->cols;
}

/* measure summed over every matrix a token uses: all of them, but of each
 * MoE layer's routed experts top-k of E (the embedding table and the
 * lm_head whole: the callers say what a token takes of them) */
static double token_sum(const eng_model *m, double (*measure)(const eng_weight *)) {
    double sum = 0.0;
    for (int i = 1; i < m->n_weights; i++) sum += measure(m->weights[i]);
    const int E = m->cfg.num_experts, k = m->cfg.num_experts_per_token;
    for (int l = 0; l < m->n_moe && E > 0; l++) {
        const eng_ffn_weights *f = m->banks[l];
        double bank = 0.0;
        for (int e = 0; e < E; e++)
            bank += measure(&f->w1[e]) + measure(&f->w3[e]) + measure(&f->w2[e]);
        sum -= bank * (1.0 - (double)k / E);
    }
    return sum;
}

eng_decode_bytes eng_model_decode_bytes(const eng_model *m, int64_t pos) {
    eng_decode_bytes b = {token_sum(m, weight_bytes), 0.0};
    if (m->embed_tokens.id != m->lm_head.id && m->embed_tokens.rows > 0)
        b.weights -= weight_bytes(&m->embed_tokens) * (1.0 - 1.0 / m->embed_tokens.rows);
    const eng_state_size z = eng_config_state_size(&m->cfg);
    b.state = 2.0 * (double)(z.kda_state + z.conv_state) + (double)z.per_token * (double)pos;
    return b;
}

double eng_model_prefill_madds(const eng_model *m, int64_t tokens) {
    /* every matrix but the embedding (a lookup) and the lm_head, a token */
    double per_token = token_sum(m, weight_madds);
    if (m->embed_tokens.rows > 0) per_token -= weight_madds(&m->embed_tokens);
    if (m->lm_head.id != m->embed_tokens.id) per_token -= weight_madds(&m->lm_head);
    return per_token * (double)tokens + weight_madds(&m->lm_head);
}

const char *eng_model_dir(const eng_model *m) {
    return m->dir;
}

const char *eng_model_fingerprint(const eng_model *m) {
    return m->fingerprint;
}

const eng_tokenizer *eng_model_tokenizer(const eng_model *m) {
    return m->tokenizer;
}

/* ------------------------------------------------------------------------ */
/* A generated model without files (eng_genmodel.h): the loader's binding   */
/* over a catalog of in-memory tensors whose matrices have no bytes.        */

kds_status eng_model_generate(const eng_config *c, uint64_t seed, const char *label,
                              eng_model **out, kds_err *err) {
    if (!out) return kds_err_set(err, KDS_INVALID_ARG, "eng_model_generate: no output pointer");
    *out = NULL;
    if (!c) return kds_err_set(err, KDS_INVALID_ARG, "eng_model_generate: no config");
    kds_status rc = KDS_OK;
    eng_gen_tensor *gt = NULL;
    eng_st_tensor *st = NULL;
    size_t n = 0;
    char *json = NULL, name[256];
    loader ld = {.err = err, .rc = KDS_OK};
    eng_model *m = calloc(1, sizeof *m);
    if (!m) return kds_err_set(err, KDS_NOMEM, "out of memory generating a model");
    /* the config exactly as a written model's config.json would load */
    eng_config want = *c;
    snprintf(want.torch_dtype, sizeof want.torch_dtype, "bfloat16");
    if (!(json = eng_config_to_json(&want))) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory generating a model");
        goto fail;
    }
    if ((rc = eng_config_parse(json, strlen(json), "generated config", &m->cfg, err)) != KDS_OK)
        goto fail;
    snprintf(name, sizeof name, "generated:%s seed %llu", label && label[0] ? label : "model",
             (unsigned long long)seed);
    if (!(m->dir = strdup(name))) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory generating a model");
        goto fail;
    }
    if ((rc = eng__genmodel_tensors(&m->cfg, seed, &gt, &n, err)) != KDS_OK) goto fail;
    st = calloc(n ? n : 1, sizeof *st);
    ld.cat = calloc(n ? n : 1, sizeof *ld.cat);
    if (!st || !ld.cat) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory generating a model");
        goto fail;
    }
    for (size_t i = 0; i < n; i++) {
        const eng_gen_tensor *g = &gt[i];
        /* a written model stores every tensor in bf16: round the vectors
         * the same way (the matrices are rounded where they are made) */
        for (size_t j = 0; g->values && j < g->n_elems; j++)
            g->values[j] = kern_bf16_to_f32(kern_f32_to_bf16(g->values[j]));
        /* a block weight's parts as the file stores them (the pair the
         * binder looks for): MXFP4 U8 codes and U8 scales, Q8_0 I8 codes
         * and F16 scales */
        eng_st_dtype dt = g->values ? ENG_ST_F32 : ENG_ST_BF16;
        if (g->part != 0)
            dt = g->block != KERN_Q8_0 ? ENG_ST_U8 : g->part == 1 ? ENG_ST_I8 : ENG_ST_F16;
        st[i] = (eng_st_tensor){.name = g->name,
                                .dtype = dt,
                                .n_dims = g->n_dims,
                                .n_elems = g->n_elems,
                                .n_bytes = g->n_elems * eng_st_dtype_size(dt),
                                .data = g->values};
        memcpy(st[i].shape, g->shape, sizeof g->shape);
        ld.cat[i] = (cat_entry){.name = g->name, .t = &st[i], .shard = 0, .gen_key = g->key,
                                .gen_sd = g->sd};
    }
    ld.n_cat = n;
    ld.m = m;
    ld.dir = m->dir;
    ld.where = strdup("the generated model");
    if (!ld.where) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory generating a model");
        goto fail;
    }
    if ((rc = sort_catalog(&ld)) != KDS_OK || (rc = bind_all(&ld)) != KDS_OK) goto fail;
    /* the fingerprint names what the weights are made of: config and seed */
    XXH3_state_t *hs = XXH3_createState();
    if (!hs) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory generating a model");
        goto fail;
    }
    XXH3_128bits_reset(hs);
    feed_str(hs, "kdaserve-generated-v1");
    feed_str(hs, json);
    feed_u64(hs, seed);
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(hs));
    XXH3_freeState(hs);
    for (int i = 0; i < 16; i++) snprintf(m->fingerprint + 2 * i, 3, "%02x", canon.digest[i]);
    m->generated = true;
    *out = m;
    m = NULL;
fail:
    eng_model_free(m);
    eng__genmodel_tensors_free(gt, n);
    free(st);
    free(ld.cat);
    free(ld.where);
    free(json);
    return rc;
}
