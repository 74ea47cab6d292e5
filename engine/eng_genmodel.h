/*
 * eng_genmodel.h - random Kimi-Linear checkpoints for tests, benchmarks and
 * comparisons with other engines.
 *
 * A generated model is an ordinary Hugging Face directory: config.json (every
 * field the real Kimi-Linear-48B config has, see eng_config_to_json) and
 * model.safetensors, or, above 4 GiB, model-0000N-of-0000M.safetensors
 * shards of at most 4 GiB each plus model.safetensors.index.json. Tensor
 * names and shapes are those of kda-model-spec.md §2 (A_log [1, 1, HV, 1],
 * conv taps [C, 1, W]), so HF, vLLM and llama.cpp's converter accept it.
 *
 * Weights are deterministic in (config, seed, dtype): each tensor draws from
 * its own counter-based stream (splitmix64 keyed by the seed and the tensor's
 * name), so a value depends on neither the write order nor the thread that
 * made it. Scales keep activations O(1) through any depth: matrices have
 * standard deviation 1/sqrt(fan_in) (output projections a further
 * 1/sqrt(num_hidden_layers)), the embedding 1, norm weights U(0.8, 1.2),
 * A_log = log U(1, 16), dt_bias = inverse-softplus of a log-uniform step in
 * [1e-3, 1e-1] (fla's initialisation), conv taps U(-0.5, 0.5), router
 * correction bias U(-0.1, 0.1).
 *
 * Thread-safety: reentrant; no globals.
 */
#ifndef ENG_GENMODEL_H
#define ENG_GENMODEL_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "eng.h"
#include "eng_config.h"
#include "kds_status.h"
#include "kern.h"

/*
 * Fill *out with a named preset (checked as eng_config_parse would):
 *   "tiny"            pure KDA + MoE, a few MB: hidden 256, 4 layers, 4 KDA
 *                     heads x 64, layer 0 dense, 8 experts top-2 + 1 shared,
 *                     vocab 512.
 *   "tiny-hybrid"     as tiny with an MLA layer: KDA+dense, KDA+MoE,
 *                     MLA+MoE, KDA+MoE.
 *   "llamacpp-tiny"   the llama.cpp comparison model (~30M parameters):
 *                     hidden 256, KDA+dense, KDA+MoE, KDA+MoE, MLA+MoE,
 *                     8 experts top-2 + shared, vocab 50304.
 *   "kimi-linear-48b" the exact Kimi-Linear-48B-A3B config (spec §1).
 *   "wide"            48B widths (hidden 2304, 32x128 KDA, real MLA and
 *                     expert sizes, vocab 163840), 4 layers KDA+dense,
 *                     KDA+MoE, KDA+MoE, MLA+MoE, 32 experts.
 *   "full27"          the real 27-layer layout and widths, 16 experts.
 *   "state48b"        the 48B's per-sequence state (20 KDA layers of 32 x 128
 *                     heads, ~43 MiB fixed) with small weights (hidden 128,
 *                     4 experts top-2, vocab 512), for snapshot benchmarks.
 * torch_dtype is "bfloat16"; eng_genmodel_write replaces it with the dtype
 * it writes. Errors: KDS_NOT_FOUND (unknown name, message lists the known).
 */
kds_status eng_genmodel_preset(const char *name, eng_config *out, kds_err *err);

/* The preset names, NULL-terminated. Static storage. */
const char *const *eng_genmodel_preset_names(void);

/*
 * Write a random model for config `c` into `out_dir` (created if needed;
 * an earlier model's config.json, model.safetensors and index there are
 * replaced, and the one the loader would prefer is removed, so the directory
 * always loads as the new model; shard files of another count are left
 * behind unused). Weights are stored in `dtype`; config.json's torch_dtype
 * says which. Files are written under temporary names and renamed,
 * config.json last. `progress` prints a
 * progress line to stderr. Errors: what eng_config_parse says of `c`
 * (KDS_INVALID_ARG, ...), KDS_IO, KDS_NOMEM, KDS_TOO_LARGE.
 */
kds_status eng_genmodel_write(const eng_config *c, uint64_t seed, kern_dtype dtype,
                              const char *out_dir, bool progress, kds_err *err);

/* Engine-internal: eng_genmodel_write with a chosen shard size (a single
 * file when the total fits in `shard_bytes`), so tests can write sharded
 * checkpoints without gigabytes. */
kds_status eng__genmodel_write_sharded(const eng_config *c, uint64_t seed, kern_dtype dtype,
                                       const char *out_dir, bool progress, uint64_t shard_bytes,
                                       kds_err *err);

/* Engine-internal (eng_model_generate): the tensors of the model that
 * eng_genmodel_write(c, seed, ...) writes, without writing them, in the
 * file's order and names. Vectors, conv taps and A_log come with their
 * float values (generated here, as in the file); 2-D matrices with values
 * == NULL and the (key, sd) from which kern_gen_normal /
 * kern_cuda_gen_normal make element i. A block-format weight (the config's
 * experts_mxfp4: every routed expert matrix, MXFP4) is listed as the file
 * has it, two tensors with values == NULL: part 1 its codes (NAME_packed U8
 * [rows, cols / 2]; Q8_0: NAME I8 [rows, cols]), part 2 its scales
 * (NAME_scale U8 [rows, cols / 32]; Q8_0: F16), both with the plain
 * weight's (key, sd): the file's bytes are kern_quantize_row(block, ...) of
 * kern_gen_normal's rows, which kern_cuda_gen_quant makes on the device.
 * c must be parsed (eng_config_parse). Free with
 * eng__genmodel_tensors_free. */
typedef struct eng_gen_tensor {
    const char *name;
    int n_dims;
    int64_t shape[4]; /* as written (a part: [rows, its bytes or scales per row]) */
    size_t n_elems;   /* of the shape */
    float *values;    /* NULL for matrices and block parts */
    uint64_t key;     /* matrices and parts: the stream of kern_gen_normal */
    float sd;
    kern_dtype block; /* a part's block format (KERN_MXFP4, KERN_Q8_0); else KERN_F32 */
    int part;         /* 0: a whole tensor; 1: a block weight's codes; 2: its scales */
} eng_gen_tensor;

kds_status eng__genmodel_tensors(const eng_config *c, uint64_t seed, eng_gen_tensor **out,
                                 size_t *n, kds_err *err);
void eng__genmodel_tensors_free(eng_gen_tensor *t, size_t n);

/*
 * A model generated in memory, for the GPU: config `c` (checked as
 * eng_config_parse would), its small vectors made on the host, and every
 * matrix left to be made on the device where it is used (eng_weight.data
 * NULL, gen_key / gen_sd set; eng_model.generated true). The values equal
 * those eng_genmodel_write(c, seed, KERN_BF16, ...) writes, so this is that
 * model without the file, e.g. the 98 GB Kimi-Linear-48B. With MXFP4
 * experts (c->experts_mxfp4, Kimi K3) each routed expert matrix is bound as
 * a loaded gen-model directory binds its NAME_packed + NAME_scale pair:
 * dt KERN_MXFP4, rows and cols of the plain weight, data and scales NULL,
 * gen_key / gen_sd of its stream; a device makes its codes and scales with
 * kern_cuda_gen_quant (the bytes gen-model writes). The fingerprint hashes
 * the config JSON (quantization_config included) and the seed, so the MXFP4
 * model and its bf16-expert twin differ. Only a "cuda" context can run it
 * (a "cpu" one refuses it with KDS_UNSUPPORTED); it has no tokenizer.
 * eng_model_dir() names it "generated:<label> seed <seed>". Errors:
 * KDS_INVALID_ARG (config), KDS_NOMEM, KDS_TOO_LARGE.
 */
kds_status eng_model_generate(const eng_config *c, uint64_t seed, const char *label,
                              eng_model **out, kds_err *err);

/* What eng_model_quantize writes in a block format. */
typedef struct eng_quantize_params {
    kern_dtype experts;   /* the routed experts: KERN_MXFP4 or KERN_Q8_0 */
    /* Also every other matrix the forward pass multiplies by (attention and
     * its gates, the shared experts, dense MLPs, K3's latent projections,
     * the lm_head), in dense_fmt: not the embedding table (read one row a
     * token), not the MoE routers (their scores pick the experts), not
     * the MLA layers' kv_b_proj (widened per head at every step), and not
     * a matrix whose width is not a multiple of 32 (kept as stored). */
    bool dense;
    kern_dtype dense_fmt; /* KERN_MXFP4 or KERN_Q8_0 */
    bool progress;        /* a progress line with an ETA on stderr */
} eng_quantize_params;

/* experts KERN_MXFP4, nothing else, no progress. */
eng_quantize_params eng_quantize_default_params(void);

/*
 * Write model `src_dir` into `out_dir` (created if missing) with its routed
 * experts (and, with p->dense, its other matrices) in a block format
 * (KERN_MXFP4: compressed-tensors pairs NAME_packed + NAME_scale and the
 * quantization_config K3 ships; KERN_Q8_0: NAME I8 + NAME_scale F16),
 * quantised row by row (kern_quantize_row); every other tensor and file
 * (tokenizer, chat template) copied. The result loads back (checked) and
 * has its own fingerprint, so sessions of the source model are refused by
 * it. *fingerprint (33 bytes, or NULL) gets the new model's. Errors: what
 * loading the source gives, KDS_INVALID_ARG (no experts, already block
 * format, another format asked), KDS_UNSUPPORTED (an expert's width not a
 * multiple of 32), KDS_IO, KDS_NOMEM.
 */
kds_status eng_model_quantize(const char *src_dir, const eng_quantize_params *p,
                              const char *out_dir, char fingerprint[33], kds_err *err);

/* Print a summary: layout, tensor and parameter counts, bytes at the
 * config's torch_dtype (bf16 when unset) and the per-sequence state size. */
void eng_genmodel_describe(const eng_config *c, FILE *f);

/*
 * Write model `model_dir` (loaded and checked as any model) as one GGUF
 * file `out_path` for llama.cpp's kimi-linear architecture (engine/
 * eng_gguf.c and docs/formats.md say what goes where): matrices in their
 * stored dtype (bf16 stays BF16), vectors, norms, router, conv taps and
 * A_log (as -exp(A_log)) in F32, routed experts stacked, MLA kv_b_proj
 * split into k_b / v_b; the tokenizer as a GPT-2-style BPE vocabulary with
 * merges rebuilt from the tiktoken ranks. Written under a temporary name,
 * fsync'd and renamed: a reader never sees a half-written file. `progress`
 * prints a progress line to stderr. Errors: what eng_model_load says;
 * KDS_UNSUPPORTED (naming why) for a model llama.cpp's graph cannot run
 * (K3, lower-bound gate, value heads != heads, KDA and MLA head counts that
 * differ, quantised experts, ...); KDS_IO, KDS_NOMEM.
 */
kds_status eng_model_export_gguf(const char *model_dir, const char *out_path, bool progress,
                                 kds_err *err);

#endif /* ENG_GENMODEL_H */
