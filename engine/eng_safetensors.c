/* eng_safetensors.c - validated mmap reader and atomic writer for safetensors. */
#define _GNU_SOURCE
#include "eng_safetensors.h"
#include "eng_pool.h"
#include "eng_progress.h"
#include "eng_util.h"
#include "kds_file.h"

#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* A header larger than this is not a model header but an attack or damage. */
#define ST_MAX_HEADER_BYTES ((uint64_t)100 << 20)

struct eng_st_file {
    char *path;
    void *map;               /* the file's bytes: mapped, or anonymous memory (resident) */
    size_t map_len;
    bool resident;
    cJSON *json;             /* parsed header; tensor names borrow from it */
    eng_st_tensor *tensors;
    size_t n_tensors;
    cJSON *metadata;         /* borrowed from json */
};

static const struct {
    const char *name;
    eng_st_dtype dt;
    size_t size;
} DTYPES[] = {
    {"F32", ENG_ST_F32, 4},   {"BF16", ENG_ST_BF16, 2}, {"F16", ENG_ST_F16, 2},
    {"F64", ENG_ST_F64, 8},   {"I32", ENG_ST_I32, 4},   {"I64", ENG_ST_I64, 8},
    {"I16", ENG_ST_I16, 2},   {"I8", ENG_ST_I8, 1},     {"U8", ENG_ST_U8, 1},
    {"BOOL", ENG_ST_BOOL, 1},
};

const char *eng_st_dtype_name(eng_st_dtype dt) {
    for (size_t i = 0; i < sizeof DTYPES / sizeof DTYPES[0]; i++)
        if (DTYPES[i].dt == dt) return DTYPES[i].name;
    return "?";
}

size_t eng_st_dtype_size(eng_st_dtype dt) {
    for (size_t i = 0; i < sizeof DTYPES / sizeof DTYPES[0]; i++)
        if (DTYPES[i].dt == dt) return DTYPES[i].size;
    return 0;
}

static int dtype_from_name(const char *s, eng_st_dtype *out) {
    for (size_t i = 0; i < sizeof DTYPES / sizeof DTYPES[0]; i++)
        if (strcmp(DTYPES[i].name, s) == 0) {
            *out = DTYPES[i].dt;
            return 1;
        }
    return 0;
}

typedef struct span {
    uint64_t begin, end;
    size_t index;
} span;

static int span_cmp(const void *a, const void *b) {
    const span *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : 0;
}

/* Parse one tensor entry; sets everything but `data`. */
static kds_status parse_entry(const char *path, const cJSON *item, eng_st_tensor *t,
                              uint64_t *begin, uint64_t *end, kds_err *err) {
    t->name = item->string;
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(item, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(item, "shape");
    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
    if (!cJSON_IsObject(item) || !cJSON_IsString(dt) || !cJSON_IsArray(shape) ||
        !cJSON_IsArray(offs))
        return kds_err_set(err, KDS_BAD_FORMAT,
                           "%s: tensor '%s' needs dtype, shape and data_offsets", path, t->name);
    if (!dtype_from_name(dt->valuestring, &t->dtype))
        return kds_err_set(err, KDS_BAD_FORMAT, "%s: tensor '%s' has unknown dtype '%s'", path,
                           t->name, dt->valuestring);
    int nd = cJSON_GetArraySize(shape);
    if (nd > ENG_ST_MAX_DIMS)
        return kds_err_set(err, KDS_BAD_FORMAT, "%s: tensor '%s' has %d dims (max %d)", path,
                           t->name, nd, ENG_ST_MAX_DIMS);
    t->n_dims = nd;
    uint64_t n = 1;
    for (int i = 0; i < nd; i++) {
        const cJSON *d = cJSON_GetArrayItem(shape, i);
        if (!cJSON_IsNumber(d) || d->valuedouble < 0 || d->valuedouble > 9.0e15 ||
            d->valuedouble != (double)(int64_t)d->valuedouble)
            return kds_err_set(err, KDS_BAD_FORMAT, "%s: tensor '%s' has a bad shape entry",
                               path, t->name);
        t->shape[i] = (int64_t)d->valuedouble;
        if (t->shape[i] != 0 && n > UINT64_MAX / (uint64_t)t->shape[i])
            return kds_err_set(err, KDS_BAD_FORMAT, "%s: tensor '%s' shape overflows", path,
                               t->name);
        n *= (uint64_t)t->shape[i];
    }
    if (cJSON_GetArraySize(offs) != 2)
        return kds_err_set(err, KDS_BAD_FORMAT, "%s: tensor '%s' data_offsets needs 2 numbers",
                           path, t->name);
    const cJSON *b = cJSON_GetArrayItem(offs, 0), *e = cJSON_GetArrayItem(offs, 1);
    if (!cJSON_IsNumber(b) || !cJSON_IsNumber(e) || b->valuedouble < 0 ||
        e->valuedouble < b->valuedouble || e->valuedouble > 9.0e15)
        return kds_err_set(err, KDS_BAD_FORMAT, "%s: tensor '%s' has bad data_offsets", path,
                           t->name);
    *begin = (uint64_t)b->valuedouble;
    *end = (uint64_t)e->valuedouble;
    size_t esz = eng_st_dtype_size(t->dtype);
    if (n > UINT64_MAX / esz || n * esz != *end - *begin)
        return kds_err_set(err, KDS_BAD_FORMAT,
                           "%s: tensor '%s' shape needs %" PRIu64 " bytes of %s but data_offsets "
                           "span %" PRIu64,
                           path, t->name, n * esz, dt->valuestring, *end - *begin);
    t->n_elems = (size_t)n;
    t->n_bytes = (size_t)(*end - *begin);
    return KDS_OK;
}

/* Huge pages are 2 MiB on x86-64 (and 4 KiB-page arm64). */
#define ST_HUGE_PAGE ((size_t)2 << 20)
/* The most bytes a thread reads in one piece, and so between the progress
 * updates of the caller, which reads too. */
#define ST_READ_STEP ((size_t)64 << 20)
/* Pieces are multiples of this; small files still make several, so that
 * the threads share them (and the suite's small models take that path). */
#define ST_READ_GRAIN ((size_t)64 << 10)
/* At most this many threads read one file. */
#define ST_READ_THREADS 8

/* One file read into memory by several threads. Pieces of `piece` bytes
 * are handed out in file order (`next`), so a disk still sees reads close
 * together. Why threads: what a read into fresh memory costs is mostly
 * the kernel faulting in and zeroing the pages it copies into, one core's
 * work; full27's 4.3 GB first shard, in the page cache, on a 2-core VM
 * (Zen 3): 1.95-2.65 s on one thread, 0.64-0.72 s on two
 * (docs/benchmarks.md, "Reading the weights in on every core"). */
typedef struct st_reader {
    int fd;
    char *p;
    size_t len, piece;
    atomic_size_t next; /* the next piece's index */
    atomic_size_t done; /* bytes read so far, for the progress line */
    atomic_bool failed; /* set with the first failure: the others stop */
    pthread_mutex_t lock;
    size_t fail_at; /* the lowest offset that failed, SIZE_MAX if none */
    int fail_errno; /* 0: the file ended there */
} st_reader;

static void reader_fail(st_reader *r, size_t at, int errno_value) {
    pthread_mutex_lock(&r->lock);
    if (at < r->fail_at) r->fail_at = at, r->fail_errno = errno_value;
    pthread_mutex_unlock(&r->lock);
    atomic_store(&r->failed, true);
}

/* Reads one piece; false when there is none left or a read failed. */
static bool reader_piece(st_reader *r) {
    if (atomic_load(&r->failed)) return false;
    const size_t first = atomic_fetch_add(&r->next, 1) * r->piece;
    if (first >= r->len) return false;
    const size_t end = r->len - first < r->piece ? r->len : first + r->piece;
    for (size_t at = first; at < end;) {
        const ssize_t n = pread(r->fd, r->p + at, end - at, (off_t)at);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            reader_fail(r, at, n < 0 ? errno : 0);
            return false;
        }
        at += (size_t)n;
        atomic_fetch_add(&r->done, (size_t)n);
    }
    return true;
}

static void *reader_main(void *arg) {
    while (reader_piece(arg)) {}
    return NULL;
}

/* The len bytes of fd read into fresh anonymous memory, 2 MiB aligned and
 * asked for in huge pages, then made read-only: *out, to munmap with len.
 * Read by up to ST_READ_THREADS threads, one a CPU, the caller among them;
 * where no thread can be started the caller reads it all. */
static kds_status read_resident(const char *path, int fd, size_t len, bool progress, void **out,
                                kds_err *err) {
    *out = NULL;
    /* over-allocate by one huge page and trim, so the start is aligned on
     * kernels that do not align large anonymous mappings themselves */
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t body = (len + page - 1) / page * page;
    char *raw = mmap(NULL, body + ST_HUGE_PAGE, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED)
        return kds_err_set(err, KDS_NOMEM, "%s: no memory to hold its %zu bytes (%s); "
                           "KDS_WEIGHTS=mapped maps the file instead", path, len, strerror(errno));
    char *p = (char *)(((uintptr_t)raw + ST_HUGE_PAGE - 1) & ~(uintptr_t)(ST_HUGE_PAGE - 1));
    if (p > raw) munmap(raw, (size_t)(p - raw));
    const size_t tail = (size_t)(raw + body + ST_HUGE_PAGE - (p + body));
    if (tail) munmap(p + body, tail);
    (void)madvise(p, body, MADV_HUGEPAGE); /* a hint: 4 KiB pages where THP is off */

    const int n_threads = eng_cpus_online(ST_READ_THREADS);
    /* about four pieces a thread; whole huge pages from 2 MiB on, so that
     * each huge page is faulted in by one thread */
    size_t piece = len / ((size_t)n_threads * 4) + 1;
    piece = (piece + ST_READ_GRAIN - 1) / ST_READ_GRAIN * ST_READ_GRAIN;
    if (piece >= ST_HUGE_PAGE) piece = (piece + ST_HUGE_PAGE - 1) / ST_HUGE_PAGE * ST_HUGE_PAGE;
    if (piece > ST_READ_STEP) piece = ST_READ_STEP;
    st_reader r = {.fd = fd, .p = p, .len = len, .piece = piece, .fail_at = SIZE_MAX};
    atomic_init(&r.next, 0);
    atomic_init(&r.done, 0);
    atomic_init(&r.failed, false);
    pthread_mutex_init(&r.lock, NULL);
    pthread_t threads[ST_READ_THREADS];
    int started = 0;
    for (int i = 1; i < n_threads && (size_t)i * piece < len; i++) {
        if (pthread_create(&threads[started], NULL, reader_main, &r) != 0) break;
        started++;
    }

    eng_progress line;
    eng_progress_start(&line, progress && len > ENG_PROGRESS_MIN_BYTES ? stderr : NULL, len,
                       "reading %s into memory", path);
    for (bool more = true; more;) {
        more = reader_piece(&r);
        eng_progress_set(&line, atomic_load(&r.done));
    }
    for (int i = 0; i < started; i++) pthread_join(threads[i], NULL);
    pthread_mutex_destroy(&r.lock);
    if (r.fail_at != SIZE_MAX) {
        kds_status rc;
        if (r.fail_errno)
            rc = kds_err_set(err, KDS_IO, "%s: read at byte %zu: %s", path, r.fail_at,
                             strerror(r.fail_errno));
        else
            rc = kds_err_set(err, KDS_IO, "%s: the file ended at byte %zu of %zu while being "
                             "read (truncated meanwhile?)", path, r.fail_at, len);
        munmap(p, body);
        eng_progress_abandon(&line);
        return rc;
    }
    eng_progress_finish(&line);
    (void)mprotect(p, body, PROT_READ); /* the weights are read-only, as the map's */
    *out = p;
    return KDS_OK;
}

static kds_status st_open(const char *path, bool resident, bool progress, eng_st_file **out,
                          kds_err *err);

kds_status eng_st_open(const char *path, eng_st_file **out, kds_err *err) {
    return st_open(path, false, false, out, err);
}

kds_status eng_st_open_resident(const char *path, bool progress, eng_st_file **out,
                                kds_err *err) {
    return st_open(path, true, progress, out, err);
}

bool eng_st_resident(const eng_st_file *f) { return f->resident; }
size_t eng_st_bytes(const eng_st_file *f) { return f->map_len; }

static kds_status st_open(const char *path, bool resident, bool progress, eng_st_file **out,
                          kds_err *err) {
    kds_status rc = KDS_OK;
    *out = NULL;
    eng_st_file *f = calloc(1, sizeof *f);
    span *spans = NULL;
    int fd = -1;
    if (!f) return kds_err_set(err, KDS_NOMEM, "out of memory opening %s", path);
    f->path = strdup(path);
    if (!f->path) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory opening %s", path);
        goto fail;
    }
    /* a FIFO, directory or device in a checkpoint's place is refused
     * without blocking or mapping it */
    size_t file_size = 0;
    if ((rc = kds_open_regular(path, &fd, &file_size, err)) != KDS_OK) goto fail;
    if (file_size < 8) {
        rc = kds_err_set(err, KDS_BAD_FORMAT, "%s: file of %zu bytes is too short for a "
                         "safetensors header", path, file_size);
        goto fail;
    }
    f->map_len = file_size;
    if (resident) {
        if ((rc = read_resident(path, fd, file_size, progress, &f->map, err)) != KDS_OK) goto fail;
        f->resident = true;
    } else {
        f->map = mmap(NULL, f->map_len, PROT_READ, MAP_PRIVATE, fd, 0);
    }
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        rc = kds_err_set(err, KDS_IO, "%s: mmap: %s", path, strerror(errno));
        goto fail;
    }
    const unsigned char *base = f->map;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | base[i];
    if (hlen > f->map_len - 8) {
        rc = kds_err_set(err, KDS_BAD_FORMAT, "%s: header length %" PRIu64
                         " runs past the end of the %zu-byte file (truncated?)", path, hlen,
                         f->map_len);
        goto fail;
    }
    if (hlen > ST_MAX_HEADER_BYTES) {
        rc = kds_err_set(err, KDS_TOO_LARGE, "%s: header of %" PRIu64 " bytes is larger than "
                         "the %" PRIu64 " MiB safetensors allows", path, hlen,
                         ST_MAX_HEADER_BYTES >> 20);
        goto fail;
    }
    f->json = cJSON_ParseWithLength((const char *)base + 8, (size_t)hlen);
    if (!f->json || !cJSON_IsObject(f->json)) {
        rc = kds_err_set(err, KDS_BAD_FORMAT, "%s: header is not a JSON object", path);
        goto fail;
    }
    size_t data_len = f->map_len - 8 - (size_t)hlen;
    const unsigned char *data = base + 8 + hlen;
    size_t n = 0;
    for (cJSON *it = f->json->child; it; it = it->next)
        if (strcmp(it->string, "__metadata__") != 0) n++;
    f->tensors = calloc(n ? n : 1, sizeof *f->tensors);
    spans = calloc(n ? n : 1, sizeof *spans);
    if (!f->tensors || !spans) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory reading %s", path);
        goto fail;
    }
    size_t i = 0;
    for (cJSON *it = f->json->child; it; it = it->next) {
        if (strcmp(it->string, "__metadata__") == 0) {
            if (!cJSON_IsObject(it)) {
                rc = kds_err_set(err, KDS_BAD_FORMAT, "%s: __metadata__ is not an object", path);
                goto fail;
            }
            f->metadata = it;
            continue;
        }
        uint64_t b = 0, e = 0;
        rc = parse_entry(path, it, &f->tensors[i], &b, &e, err);
        if (rc != KDS_OK) goto fail;
        if (e > data_len) {
            rc = kds_err_set(err, KDS_BAD_FORMAT, "%s: tensor '%s' ends at byte %" PRIu64
                             " past the %zu-byte data section (truncated file?)",
                             path, f->tensors[i].name, e, data_len);
            goto fail;
        }
        /* Tensors are read in place from the mapping (page-aligned), so one
         * whose start is not a multiple of its element size would make every
         * kernel load misaligned: writers keep them aligned (the safetensors
         * library, and eng_st_write, order tensors by element size). */
        const size_t esz = eng_st_dtype_size(f->tensors[i].dtype);
        const uint64_t at = 8 + (uint64_t)hlen + b;
        if (esz > 1 && at % esz != 0) {
            rc = kds_err_set(err, KDS_BAD_FORMAT, "%s: tensor '%s' (%s) starts at byte %" PRIu64
                             " of the file, not a multiple of its %zu-byte element (a damaged "
                             "file, or a writer that does not align tensors: write it again with "
                             "the safetensors library)",
                             path, f->tensors[i].name, eng_st_dtype_name(f->tensors[i].dtype), at,
                             esz);
            goto fail;
        }
        f->tensors[i].data = data + b;
        spans[i] = (span){b, e, i};
        i++;
    }
    f->n_tensors = n;
    qsort(spans, n, sizeof *spans, span_cmp);
    for (size_t j = 1; j < n; j++) {
        if (spans[j].begin < spans[j - 1].end) {
            rc = kds_err_set(err, KDS_BAD_FORMAT, "%s: tensors '%s' and '%s' overlap", path,
                             f->tensors[spans[j - 1].index].name, f->tensors[spans[j].index].name);
            goto fail;
        }
    }
    free(spans);
    close(fd);
    *out = f;
    return KDS_OK;
fail:
    free(spans);
    if (fd >= 0) close(fd);
    eng_st_close(f);
    return rc;
}

void eng_st_close(eng_st_file *f) {
    if (!f) return;
    if (f->map) munmap(f->map, f->map_len);
    cJSON_Delete(f->json);
    free(f->tensors);
    free(f->path);
    free(f);
}

size_t eng_st_count(const eng_st_file *f) { return f->n_tensors; }

const eng_st_tensor *eng_st_at(const eng_st_file *f, size_t i) {
    return i < f->n_tensors ? &f->tensors[i] : NULL;
}

const eng_st_tensor *eng_st_find(const eng_st_file *f, const char *name) {
    for (size_t i = 0; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    return NULL;
}

const char *eng_st_metadata(const eng_st_file *f, const char *key) {
    if (!f->metadata) return NULL;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(f->metadata, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

const char *eng_st_path(const eng_st_file *f) { return f->path; }

/* ------------------------------------------------------------------------ */

static kds_status write_all(int fd, const void *buf, size_t n, const char *path, kds_err *err) {
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return kds_err_set(err, KDS_IO, "%s: write: %s", path, strerror(errno));
        }
        p += w;
        n -= (size_t)w;
    }
    return KDS_OK;
}

static size_t out_bytes(const eng_st_out_tensor *t) {
    size_t n = eng_st_dtype_size(t->dtype);
    for (int d = 0; d < t->n_dims; d++) n *= (size_t)t->shape[d];
    return n;
}

static kds_status copy_fill(void *user, size_t index, void *buf, size_t n_bytes, kds_err *err) {
    (void)err;
    const eng_st_out_tensor *t = user;
    memcpy(buf, t[index].data, n_bytes);
    return KDS_OK;
}

/* Where the tensor data starts in a file this writer makes, and where each
 * tensor whose size is a multiple of it starts: a cache line. A bf16 row
 * read by a 64-byte load that straddles two lines costs the decode product
 * a quarter of its speed (docs/formats.md, "Safetensors"). */
#define ST_DATA_ALIGN 64

/* A tensor's place in the data section: whole lines first, then element
 * size, then its index. */
typedef struct write_slot {
    size_t esz, index;
    bool lines; /* its byte size is a multiple of ST_DATA_ALIGN */
} write_slot;

static int write_slot_cmp(const void *a, const void *b) {
    const write_slot *x = a, *y = b;
    if (x->lines != y->lines) return x->lines ? -1 : 1;
    if (x->esz != y->esz) return x->esz > y->esz ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index ? 1 : 0;
}

kds_status eng_st_write(const char *path, const eng_st_out_tensor *tensors, size_t n,
                        const char *const *metadata, kds_err *err) {
    return eng_st_write_stream(path, tensors, n, metadata, copy_fill, (void *)tensors, err);
}

kds_status eng_st_write_stream(const char *path, const eng_st_out_tensor *tensors, size_t n,
                               const char *const *metadata, eng_st_fill_fn fill, void *user,
                               kds_err *err) {
    kds_status rc = KDS_OK;
    char *header = NULL, *tmp = NULL;
    void *buf = NULL;
    write_slot *order = NULL;
    uint64_t *offsets = NULL;
    int fd = -1;
    cJSON *root = cJSON_CreateObject();
    if (!root) return kds_err_set(err, KDS_NOMEM, "out of memory writing %s", path);
    if (metadata) {
        cJSON *md = cJSON_AddObjectToObject(root, "__metadata__");
        for (size_t i = 0; md && metadata[i] && metadata[i + 1]; i += 2)
            cJSON_AddStringToObject(md, metadata[i], metadata[i + 1]);
    }
    /* Data in two runs: first the tensors whose byte size is a multiple
     * of ST_DATA_ALIGN (the weight matrices), then the rest; in each, by
     * element size, widest first (ties in the caller's order). With the
     * data starting on a multiple of ST_DATA_ALIGN (the header is padded
     * below), every tensor of the first run starts on a cache line and
     * every tensor at a multiple of its element size: readers use tensors
     * in place (what the safetensors library does too, at 8 bytes; the
     * format allows no gaps between tensors, hence the order). order[k]:
     * the k-th written. */
    order = malloc((n ? n : 1) * sizeof *order);
    offsets = malloc((n ? n : 1) * sizeof *offsets);
    if (!order || !offsets) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory writing %s", path);
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        order[i] = (write_slot){eng_st_dtype_size(tensors[i].dtype), i,
                                out_bytes(&tensors[i]) % ST_DATA_ALIGN == 0};
    qsort(order, n, sizeof *order, write_slot_cmp);
    uint64_t off = 0;
    size_t max_bytes = 0;
    for (size_t k = 0; k < n; k++) {
        const size_t nb = out_bytes(&tensors[order[k].index]);
        offsets[order[k].index] = off;
        off += nb;
        if (nb > max_bytes) max_bytes = nb;
    }
    for (size_t i = 0; i < n; i++) {
        cJSON *t = cJSON_AddObjectToObject(root, tensors[i].name);
        if (!t) {
            rc = kds_err_set(err, KDS_NOMEM, "out of memory writing %s", path);
            goto out;
        }
        cJSON_AddStringToObject(t, "dtype", eng_st_dtype_name(tensors[i].dtype));
        cJSON *sh = cJSON_AddArrayToObject(t, "shape");
        for (int d = 0; d < tensors[i].n_dims; d++)
            cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)tensors[i].shape[d]));
        const size_t nb = out_bytes(&tensors[i]);
        cJSON *of = cJSON_AddArrayToObject(t, "data_offsets");
        cJSON_AddItemToArray(of, cJSON_CreateNumber((double)offsets[i]));
        cJSON_AddItemToArray(of, cJSON_CreateNumber((double)(offsets[i] + nb)));
    }
    header = cJSON_PrintUnformatted(root);
    if (!header) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory writing %s", path);
        goto out;
    }
    size_t hlen = strlen(header);
    /* 8 length bytes + header + spaces: the data starts on a line */
    const size_t padded = (8 + hlen + ST_DATA_ALIGN - 1) / ST_DATA_ALIGN * ST_DATA_ALIGN - 8;
    if (asprintf(&tmp, "%s.tmp.%d", path, (int)getpid()) < 0) {
        tmp = NULL;
        rc = kds_err_set(err, KDS_NOMEM, "out of memory writing %s", path);
        goto out;
    }
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        rc = kds_err_set(err, KDS_IO, "%s: %s", tmp, strerror(errno));
        goto out;
    }
    unsigned char lenb[8];
    for (int i = 0; i < 8; i++) lenb[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    if ((rc = write_all(fd, lenb, 8, tmp, err)) != KDS_OK) goto out;
    if ((rc = write_all(fd, header, hlen, tmp, err)) != KDS_OK) goto out;
    char spaces[ST_DATA_ALIGN]; /* padded - hlen < ST_DATA_ALIGN */
    memset(spaces, ' ', sizeof spaces);
    if ((rc = write_all(fd, spaces, padded - hlen, tmp, err)) != KDS_OK) goto out;
    buf = malloc(max_bytes ? max_bytes : 1);
    if (!buf) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory writing %s", path);
        goto out;
    }
    for (size_t k = 0; k < n; k++) {
        const size_t i = order[k].index, nb = out_bytes(&tensors[i]);
        if ((rc = fill(user, i, buf, nb, err)) != KDS_OK) goto out;
        if ((rc = write_all(fd, buf, nb, tmp, err)) != KDS_OK) goto out;
    }
    if (fsync(fd) != 0 || close(fd) != 0) {
        fd = -1;
        rc = kds_err_set(err, KDS_IO, "%s: %s", tmp, strerror(errno));
        goto out;
    }
    fd = -1;
    if (rename(tmp, path) != 0) {
        rc = kds_err_set(err, KDS_IO, "rename %s -> %s: %s", tmp, path, strerror(errno));
        goto out;
    }
out:
    if (fd >= 0) close(fd);
    if (rc != KDS_OK && tmp) unlink(tmp);
    free(tmp);
    free(buf);
    free(order);
    free(offsets);
    free(header);
    cJSON_Delete(root);
    return rc;
}
