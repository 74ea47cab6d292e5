/*
 * test_model_util.h - helpers for the model-loading, config and gen-model
 * tests: temporary directories, file copies, rewriting a checkpoint with one
 * tensor changed, and hand-made safetensors files.
 *
 * Temporary directories live under /tmp (mkdtemp) and are removed by the
 * test that made them.
 */
#ifndef TEST_MODEL_UTIL_H
#define TEST_MODEL_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "eng.h"
#include "eng_safetensors.h"

#define TMU_GOLDEN_MODELS KDS_SOURCE_DIR "/../shared/golden/model"
#define TMU_MICRO_KDA TMU_GOLDEN_MODELS "/micro-kda"
#define TMU_MICRO_HYBRID TMU_GOLDEN_MODELS "/micro-hybrid"

/* A fresh /tmp/kds_model_test_XXXXXX; caller frees (and tmu_rmtree's) it. */
char *tmu_mkdtemp(void);
/* rm -r; silently ignores what is not there. */
void tmu_rmtree(const char *dir);
/* dir + "/" + name, malloc'd. */
char *tmu_path(const char *dir, const char *name);

/* Whole-file read (NUL-terminated, caller frees) and write. */
char *tmu_read(const char *path, size_t *len);
bool tmu_write(const char *path, const void *data, size_t len);
bool tmu_copy(const char *src, const char *dst);
/* Copy config.json and model.safetensors of a model directory. */
bool tmu_copy_model(const char *src_dir, const char *dst_dir);

/*
 * Rewrite src_dir/model.safetensors into dst_dir/<out_name> (and copy
 * config.json), passing every tensor through `edit`: it may change the
 * name, dtype, shape (the data bytes stay as they are) or return false to
 * drop the tensor. edit == NULL copies.
 */
typedef bool (*tmu_edit_fn)(void *user, eng_st_out_tensor *t);
bool tmu_rewrite(const char *src_dir, const char *dst_dir, const char *out_name, tmu_edit_fn edit,
                 void *user);

/* Write a safetensors file from a literal header (padded to 8 bytes) and
 * `data_len` bytes of data (zeros). */
bool tmu_write_st(const char *path, const char *header, size_t data_len);

/* Write generated preset `preset` (bf16, `seed`) into a fresh tmu_mkdtemp
 * directory (*dir, caller frees and removes it) and load it without the
 * fingerprint cache. NULL with err filled on failure (*dir then NULL). */
eng_model *tmu_gen_load(const char *preset, uint64_t seed, char **dir, kds_err *err);

/* As tmu_gen_load, with the preset's hidden_size replaced by `hidden`
 * (0: the preset's own). */
eng_model *tmu_gen_load_hidden(const char *preset, int hidden, uint64_t seed, char **dir,
                               kds_err *err);

/* As tmu_gen_load_hidden, with the dense MLP's intermediate_size replaced
 * by `dense_inner` too (0: the preset's own). */
eng_model *tmu_gen_load_sized(const char *preset, int hidden, int dense_inner, uint64_t seed,
                              char **dir, kds_err *err);

/* Replace the first occurrence of `from` by `to` in a text file. */
bool tmu_replace_in_file(const char *path, const char *from, const char *to);

#endif
