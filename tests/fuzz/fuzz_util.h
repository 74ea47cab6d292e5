/*
 * fuzz_util.h - what the libFuzzer targets of tests/fuzz/ share (header-only,
 * static functions): a scratch directory per process, writing an input out
 * as files, cutting one input into parts, the two nano models the targets
 * and the seed writer (fuzz_seeds.c) generate, and the abort that turns a
 * broken property into a crash libFuzzer keeps.
 *
 * Why files: the parsers under test read files (safetensors is mmap'd, a
 * model is a directory), so the targets feed them real files in a
 * per-process directory under $TMPDIR (a tmpfs in CI is faster, not
 * needed). Everything here is deterministic: a nano model written twice
 * has the same bytes and the same fingerprint, which lets the committed
 * seeds of the snapshot target name the chunk and snapshot ids that the
 * target's own store hands out.
 */
#ifndef FUZZ_UTIL_H
#define FUZZ_UTIL_H

#define _GNU_SOURCE
#include <fcntl.h>
#include <ftw.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "eng.h"
#include "eng_config.h"
#include "eng_genmodel.h"

/* Where one input is cut into parts (a config and a safetensors file, a
 * rank file, a tokenizer config and a text): a line no JSON, rank file or
 * safetensors header of the seeds contains, so mutations inside a part
 * rarely move the cut. */
#define FZ_SEP "\n--kdsfuzz-part--\n"
#define FZ_SEP_LEN (sizeof FZ_SEP - 1)

/* A broken property: print why and abort, so libFuzzer saves the input. */
static inline void fz_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static inline void fz_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kdsfuzz: property violated: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    abort();
}

/*
 * Known open bugs. A property that a module outside the engine breaks today,
 * whose fix belongs to another branch (tests/fuzz/known-open.txt lists
 * them, with the reproducer under regress/), has an id; scripts/fuzz.sh
 * puts the listed ids into KDS_FUZZ_KNOWN (comma-separated), and a target
 * skips an input that would only trip a known one, so a timed run keeps
 * looking for new bugs instead of finding the known one again. Unset, as
 * when a developer runs a target by hand, every property is enforced.
 */
static inline bool fz_known(const char *id) {
    const char *k = getenv("KDS_FUZZ_KNOWN");
    size_t n = strlen(id);
    while (k && *k) {
        const char *c = strchr(k, ',');
        size_t m = c ? (size_t)(c - k) : strlen(k);
        if (m == n && memcmp(k, id, n) == 0) return true;
        k = c ? c + 1 : NULL;
    }
    return false;
}

/* ---- the scratch directory ---------------------------------------------- */

static char fz_dir_path[4096];

static inline int fz_rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static inline void fz_rm_tree(const char *dir) { nftw(dir, fz_rm_one, 16, FTW_DEPTH | FTW_PHYS); }

static inline void fz_dir_cleanup(void) {
    if (fz_dir_path[0]) fz_rm_tree(fz_dir_path);
}

/* This process's scratch directory (made on first use, removed at exit). */
static inline const char *fz_dir(void) {
    if (fz_dir_path[0]) return fz_dir_path;
    const char *tmp = getenv("TMPDIR");
    snprintf(fz_dir_path, sizeof fz_dir_path, "%s/kdsfuzz-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(fz_dir_path)) {
        perror("kdsfuzz: mkdtemp");
        abort();
    }
    atexit(fz_dir_cleanup);
    return fz_dir_path;
}

/* "scratch/name" in a static buffer per slot (0..3), so a call can hold a
 * few paths at once. */
static inline const char *fz_path(int slot, const char *name) {
    static char buf[4][4200];
    snprintf(buf[slot & 3], sizeof buf[0], "%s/%s", fz_dir(), name);
    return buf[slot & 3];
}

/* Make a directory under the scratch directory (no error if it exists). */
static inline const char *fz_subdir(int slot, const char *name) {
    const char *p = fz_path(slot, name);
    if (mkdir(p, 0700) != 0 && access(p, F_OK) != 0) {
        perror("kdsfuzz: mkdir");
        abort();
    }
    return p;
}

/* Write n bytes to path (replacing it). Aborts on failure: the scratch
 * directory is ours, a failure there is the harness's, not the input's. */
static inline void fz_write_file(const char *path, const void *p, size_t n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        perror(path);
        abort();
    }
    const unsigned char *b = p;
    while (n) {
        ssize_t w = write(fd, b, n);
        if (w <= 0) {
            perror(path);
            abort();
        }
        b += w;
        n -= (size_t)w;
    }
    close(fd);
}

/* Read a whole file into a malloc'd buffer (NULL when unreadable). */
static inline unsigned char *fz_read_file(const char *path, size_t *n) {
    *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, len = 0;
    unsigned char *b = malloc(cap);
    size_t r;
    while (b && (r = fread(b + len, 1, cap - len, f)) > 0) {
        len += r;
        if (len == cap) {
            unsigned char *g = realloc(b, cap * 2);
            if (!g) {
                free(b);
                b = NULL;
                break;
            }
            b = g;
            cap *= 2;
        }
    }
    fclose(f);
    *n = len;
    return b;
}

/* ---- cutting an input ---------------------------------------------------- */

typedef struct fz_part {
    const uint8_t *p;
    size_t n;
} fz_part;

/* Cut data at the first (max - 1) separators into at most `max` parts; the
 * last part takes the rest. Returns the number of parts. */
static inline int fz_split(const uint8_t *data, size_t size, fz_part *parts, int max) {
    int k = 0;
    const uint8_t *p = data, *end = data + size;
    while (k < max - 1) {
        const uint8_t *s = memmem(p, (size_t)(end - p), FZ_SEP, FZ_SEP_LEN);
        if (!s) break;
        parts[k++] = (fz_part){p, (size_t)(s - p)};
        p = s + FZ_SEP_LEN;
    }
    parts[k++] = (fz_part){p, (size_t)(end - p)};
    return k;
}

/* ---- nano models --------------------------------------------------------- */

/* The smallest configs of the family that still have every part: a dense
 * and a MoE layer (grouped router, shared expert), KDA layers, and for the
 * hybrid one an MLA layer; the KDA one ties its embeddings. The 256 ids
 * of the byte tokenizer a model without tiktoken.model gets. About 12 KiB
 * of safetensors (half of it the JSON header), so a whole model directory
 * fits in a seed and loads in microseconds. */
static const char FZ_NANO_KDA[] =
    "{\"architectures\":[\"KimiLinearForCausalLM\"],\"model_type\":\"kimi_linear\","
    "\"vocab_size\":256,\"hidden_size\":8,\"num_hidden_layers\":2,\"num_attention_heads\":1,"
    "\"num_key_value_heads\":1,\"head_dim\":8,\"intermediate_size\":8,\"hidden_act\":\"silu\","
    "\"rms_norm_eps\":1e-05,\"mla_use_nope\":true,\"q_lora_rank\":null,\"kv_lora_rank\":null,"
    "\"qk_nope_head_dim\":null,\"qk_rope_head_dim\":null,\"v_head_dim\":null,"
    "\"linear_attn_config\":{\"kda_layers\":[1,2],\"full_attn_layers\":[],\"num_heads\":1,"
    "\"head_dim\":8,\"short_conv_kernel_size\":4},"
    "\"num_experts\":2,\"num_experts_per_token\":1,\"num_shared_experts\":1,"
    "\"moe_intermediate_size\":8,\"first_k_dense_replace\":1,\"moe_layer_freq\":1,"
    "\"moe_router_activation_func\":\"sigmoid\",\"moe_renormalize\":true,"
    "\"routed_scaling_factor\":2.0,\"use_grouped_topk\":true,\"num_expert_group\":1,"
    "\"topk_group\":1,\"tie_word_embeddings\":true,\"model_max_length\":4096,"
    "\"bos_token_id\":1,\"eos_token_id\":2,\"torch_dtype\":\"bfloat16\"}";

static const char FZ_NANO_HYBRID[] =
    "{\"architectures\":[\"KimiLinearForCausalLM\"],\"model_type\":\"kimi_linear\","
    "\"vocab_size\":256,\"hidden_size\":8,\"num_hidden_layers\":3,\"num_attention_heads\":1,"
    "\"num_key_value_heads\":1,\"head_dim\":8,\"intermediate_size\":8,\"hidden_act\":\"silu\","
    "\"rms_norm_eps\":1e-05,\"mla_use_nope\":true,\"q_lora_rank\":null,\"kv_lora_rank\":8,"
    "\"qk_nope_head_dim\":8,\"qk_rope_head_dim\":4,\"v_head_dim\":8,"
    "\"linear_attn_config\":{\"kda_layers\":[1,3],\"full_attn_layers\":[2],\"num_heads\":1,"
    "\"head_dim\":8,\"short_conv_kernel_size\":4},"
    "\"num_experts\":2,\"num_experts_per_token\":1,\"num_shared_experts\":1,"
    "\"moe_intermediate_size\":8,\"first_k_dense_replace\":1,\"moe_layer_freq\":1,"
    "\"moe_router_activation_func\":\"sigmoid\",\"moe_renormalize\":true,"
    "\"routed_scaling_factor\":2.0,\"use_grouped_topk\":true,\"num_expert_group\":1,"
    "\"topk_group\":1,\"tie_word_embeddings\":false,\"model_max_length\":4096,"
    "\"bos_token_id\":1,\"eos_token_id\":2,\"torch_dtype\":\"bfloat16\"}";

/* Write nano model `json` (seed 7, bf16) into dir; aborts on failure. */
static inline void fz_nano_write(const char *json, const char *dir) {
    eng_config c;
    kds_err e = {0};
    if (eng_config_parse(json, strlen(json), "nano config", &c, &e) != KDS_OK ||
        eng_genmodel_write(&c, 7, KERN_BF16, dir, false, &e) != KDS_OK) {
        fprintf(stderr, "kdsfuzz: nano model: %s\n", e.msg);
        abort();
    }
}

/* Model params that keep the fingerprint cache out of the user's home. */
static inline eng_model_params fz_model_params(void) {
    eng_model_params p = eng_model_default_params();
    p.cache_dir = fz_path(3, "fp-cache");
    p.no_fingerprint_cache = true;
    return p;
}

/* Load nano model `json` (written under scratch/name once). */
static inline eng_model *fz_nano_load(const char *json, const char *name) {
    const char *dir = fz_subdir(0, name);
    fz_nano_write(json, dir);
    eng_model_params mp = fz_model_params();
    eng_model *m = NULL;
    kds_err e = {0};
    if (eng_model_load(dir, &mp, &m, &e) != KDS_OK) {
        fprintf(stderr, "kdsfuzz: loading the nano model: %s\n", e.msg);
        abort();
    }
    return m;
}

/* A one-thread CPU context (the pool's threads would only add noise). */
static inline eng_ctx *fz_ctx(const eng_model *m) {
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cp.max_batch = 16;
    cp.max_seqs = 2;
    eng_ctx *c = NULL;
    kds_err e = {0};
    if (eng_ctx_create(m, &cp, &c, &e) != KDS_OK) {
        fprintf(stderr, "kdsfuzz: context: %s\n", e.msg);
        abort();
    }
    return c;
}

#endif /* FUZZ_UTIL_H */
