/*
 * eng_safetensors.h - reading and writing the safetensors format
 * (https://github.com/huggingface/safetensors: an 8-byte little-endian header
 * length N, N bytes of JSON {name: {dtype, shape, data_offsets}, __metadata__},
 * then the raw little-endian tensor bytes).
 *
 * Reading mmaps the file read-only (eng_st_open), or reads it into anonymous
 * memory in 2 MiB pages (eng_st_open_resident), and validates the whole
 * header before any tensor is handed out: header length within the file, JSON well formed,
 * dtype known, shape x element size == byte count, offsets inside the data
 * section, no two tensors overlapping. Any violation is refused with
 * KDS_BAD_FORMAT and a message naming the file and tensor.
 *
 * Ownership: an eng_st_file owns its mapping or memory; every pointer it hands out is
 * borrowed and valid until eng_st_close(). Thread-safety: a file is immutable
 * after open; concurrent readers are fine.
 */
#ifndef ENG_SAFETENSORS_H
#define ENG_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kds_status.h"

#define ENG_ST_MAX_DIMS 8

typedef enum eng_st_dtype {
    ENG_ST_F32,
    ENG_ST_BF16,
    ENG_ST_F16,
    ENG_ST_F64,
    ENG_ST_I32,
    ENG_ST_I64,
    ENG_ST_I16,
    ENG_ST_I8,
    ENG_ST_U8,
    ENG_ST_BOOL,
} eng_st_dtype;

typedef struct eng_st_tensor {
    const char *name;           /* borrowed */
    eng_st_dtype dtype;
    int n_dims;
    int64_t shape[ENG_ST_MAX_DIMS];
    size_t n_elems;
    size_t n_bytes;
    const void *data;           /* borrowed, points into the mapping */
} eng_st_tensor;

typedef struct eng_st_file eng_st_file;

/* Open and validate `path`. On success *out is set (free with eng_st_close). */
kds_status eng_st_open(const char *path, eng_st_file **out, kds_err *err);
/* The same, but the file's bytes are read into anonymous memory (2 MiB
 * aligned, madvise(MADV_HUGEPAGE), then read-only) instead of mapped: a
 * product that streams its matrix from memory reads 2 MiB pages 10-20%
 * faster than the page cache's 4 KiB ones (docs/benchmarks.md, "Weights
 * in 2 MiB pages"). Costs the file's size in memory and one read of it.
 * progress: a progress line with an ETA on stderr for files over 256 MiB.
 * Errors as eng_st_open, plus KDS_NOMEM (no memory for the copy) and
 * KDS_IO (a read failed, or the file shrank while being read). */
kds_status eng_st_open_resident(const char *path, bool progress, eng_st_file **out,
                                kds_err *err);
/* Whether f's bytes are held by eng_st_open_resident. */
bool eng_st_resident(const eng_st_file *f);
/* The file's size in bytes. */
size_t eng_st_bytes(const eng_st_file *f);
void eng_st_close(eng_st_file *f);

size_t eng_st_count(const eng_st_file *f);
/* i-th tensor in header order, or NULL past the end. */
const eng_st_tensor *eng_st_at(const eng_st_file *f, size_t i);
/* Tensor by name, or NULL. */
const eng_st_tensor *eng_st_find(const eng_st_file *f, const char *name);
/* __metadata__ string value, or NULL. */
const char *eng_st_metadata(const eng_st_file *f, const char *key);
const char *eng_st_path(const eng_st_file *f);

const char *eng_st_dtype_name(eng_st_dtype dt);
size_t eng_st_dtype_size(eng_st_dtype dt);

/*
 * Writing: describe tensors, then write them in one go. Data pointers are
 * borrowed until eng_st_write returns. The file is written to a temporary
 * name and renamed, so a reader never sees a half-written file.
 */
typedef struct eng_st_out_tensor {
    const char *name;
    eng_st_dtype dtype;
    int n_dims;
    int64_t shape[ENG_ST_MAX_DIMS];
    const void *data;
} eng_st_out_tensor;

/* metadata: NULL or alternating key, value strings ending with NULL. */
kds_status eng_st_write(const char *path, const eng_st_out_tensor *tensors, size_t n,
                        const char *const *metadata, kds_err *err);

/* Streaming variant for files larger than memory: `data` of each tensor is
 * ignored; `fill` is called once per tensor, in order, with a buffer of the
 * tensor's byte size to fill (reused between calls). */
typedef kds_status (*eng_st_fill_fn)(void *user, size_t index, void *buf, size_t n_bytes,
                                     kds_err *err);
kds_status eng_st_write_stream(const char *path, const eng_st_out_tensor *tensors, size_t n,
                               const char *const *metadata, eng_st_fill_fn fill, void *user,
                               kds_err *err);

#endif /* ENG_SAFETENSORS_H */
