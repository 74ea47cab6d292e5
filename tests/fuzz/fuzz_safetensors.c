/*
 * fuzz_safetensors.c - libFuzzer target: a safetensors file
 * (engine/eng_safetensors.h). The input is the whole file; it is written to
 * the scratch directory and opened with eng_st_open, the way the model
 * loader opens a checkpoint (mmap, then the header checks).
 *
 * Properties beyond "no crash, no leak, no undefined behaviour": every
 * tensor an open file hands out lies inside the mapping with exactly
 * n_elems * dtype size bytes (every byte is read, so ASan sees an overrun),
 * its name finds it again, and at most ENG_ST_MAX_DIMS dims. The same file
 * read into memory (eng_st_open_resident, as the loader does for large
 * files) is refused or accepted alike, with the same message, and holds
 * the same tensors with the same bytes.
 */
#include "fuzz_util.h"

#include "eng_safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fz_path(0, "model.safetensors");
    fz_write_file(path, data, size);
    eng_st_file *f = NULL, *r = NULL;
    kds_err e = {0}, er = {0};
    const kds_status rc = eng_st_open(path, &f, &e);
    const kds_status rr = eng_st_open_resident(path, false, &r, &er);
    if (rr != rc || (rc != KDS_OK && strcmp(e.msg, er.msg) != 0))
        fz_fail("mapped: %d '%s'; read into memory: %d '%s'", (int)rc, e.msg, (int)rr, er.msg);
    if (rc != KDS_OK) {
        if (e.status == KDS_OK || !e.msg[0]) fz_fail("eng_st_open failed without a message");
        return 0;
    }
    if (eng_st_count(r) != eng_st_count(f)) fz_fail("read into memory: another tensor count");
    for (size_t i = 0; i < eng_st_count(f); i++) {
        const eng_st_tensor *a = eng_st_at(f, i), *b = eng_st_at(r, i);
        if (strcmp(a->name, b->name) != 0 || a->n_bytes != b->n_bytes ||
            memcmp(a->data, b->data, a->n_bytes) != 0)
            fz_fail("tensor '%s' read into memory differs from the mapping", a->name);
    }
    eng_st_close(r);
    unsigned sum = 0;
    for (size_t i = 0; i < eng_st_count(f); i++) {
        const eng_st_tensor *t = eng_st_at(f, i);
        if (!t || !t->name) fz_fail("tensor %zu missing", i);
        if (t->n_dims < 0 || t->n_dims > ENG_ST_MAX_DIMS) fz_fail("tensor %zu: %d dims", i, t->n_dims);
        size_t n = 1;
        for (int d = 0; d < t->n_dims; d++) n *= (size_t)t->shape[d];
        if (n != t->n_elems || t->n_elems * eng_st_dtype_size(t->dtype) != t->n_bytes)
            fz_fail("tensor '%s': %zu elements, %zu bytes do not match its shape", t->name,
                    t->n_elems, t->n_bytes);
        const unsigned char *b = t->data;
        for (size_t j = 0; j < t->n_bytes; j++) sum += b[j];
        /* a name given twice in the JSON finds the first: enough that it finds one */
        const eng_st_tensor *u = eng_st_find(f, t->name);
        if (!u || strcmp(u->name, t->name) != 0) fz_fail("tensor '%s' not found by name", t->name);
        (void)eng_st_dtype_name(t->dtype);
    }
    (void)eng_st_metadata(f, "format");
    (void)eng_st_metadata(f, "path");
    (void)eng_st_count(f);
    eng_st_close(f);
    /* keep the reads: the compiler may not drop them */
    volatile unsigned sink = sum;
    (void)sink;
    return 0;
}
