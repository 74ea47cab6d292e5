/*
 * eng.h - the kdaserve engine: load a Kimi-Linear-family model (KDA + MoE,
 * optionally MLA full-attention layers) from a Hugging Face directory and run
 * it on the CPU or a CUDA GPU (eng_ctx_params.device).
 *
 * Objects
 *   eng_model  immutable weights + config, mmap'd. Shareable by any number of
 *              contexts and sequences on any threads.
 *   eng_ctx    compute context on one device: its backend (the CPU's thread
 *              pool, or a GPU with the weights, the sequences' states and
 *              CUDA graphs) and activation buffers sized once at creation for
 *              the largest batch. One thread uses a context at a time (calls
 *              on one context must not overlap).
 *   eng_seq    one sequence's whole state (KDA recurrent states and conv
 *              tails, MLA latent cache, position, last logits, sampler RNG and
 *              recent tokens). Plain memory; copy it out and back in with
 *              eng_seq_state_save / eng_seq_state_load (layout:
 *              docs/formats.md). A sequence is used by one thread at a time.
 *
 * Errors: commands return kds_status and fill the optional kds_err with a
 * message naming the offending file, tensor, field or token. On failure of
 * eng_prefill / eng_decode the sequence is left unchanged unless the call
 * says otherwise (inputs are checked before any state is touched).
 *
 * Hot path: eng_prefill, eng_decode and eng_decode_batch allocate nothing, except that a
 * hybrid model's MLA latent cache grows geometrically when a sequence passes
 * its capacity.
 */
#ifndef ENG_H
#define ENG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kds_status.h"

typedef struct eng_model eng_model;
typedef struct eng_ctx eng_ctx;
typedef struct eng_seq eng_seq;
typedef struct eng_tokenizer eng_tokenizer;
typedef struct eng_config eng_config;
typedef struct eng_comm eng_comm; /* the ranks of a job: eng_comm.h */

/* ------------------------------------------------------------------------ */
/* Model                                                                     */

/* Which rank holds which routed expert under expert parallelism
 * (docs/expert-parallel.md): of E experts per MoE layer over N ranks,
 *   block   rank r holds the contiguous experts [ceil(r*E/N), ceil((r+1)*E/N));
 *   cyclic  rank r holds the experts e with e mod N == r.
 * Every MoE layer is placed alike. */
typedef enum eng_ep_placement {
    ENG_EP_BLOCK = 0,
    ENG_EP_CYCLIC = 1,
} eng_ep_placement;

/* Where a loaded model's weight bytes live. */
typedef enum eng_weights_mode {
    /* KDS_WEIGHTS from the environment (auto, mapped or resident) if set,
     * else resident for each weights file larger than half the last-level
     * cache when transparent huge pages are not off and the memory
     * available holds it with room to spare, mapped otherwise (and always
     * for an expert-parallel rank, which reads only its own experts). */
    ENG_WEIGHTS_AUTO = 0,
    /* mmap the files read-only: nothing is read until used, pages are
     * shared with the page cache and other processes (4 KiB pages) */
    ENG_WEIGHTS_MAPPED,
    /* read the files into this process's memory in 2 MiB pages
     * (eng_st_open_resident): a decode that streams its weights from
     * memory reads them 10-20% faster, for a copy of the files in memory
     * and one read of them at load */
    ENG_WEIGHTS_RESIDENT,
} eng_weights_mode;

typedef struct eng_model_params {
    /* Where the fingerprint cache lives; NULL = $XDG_CACHE_HOME/kdaserve (or
     * ~/.cache/kdaserve). */
    const char *cache_dir;
    /* Skip the cache and hash every byte (slow for large models). */
    bool no_fingerprint_cache;
    /* Print progress of long work (hashing) to stderr. */
    bool progress;
    /* Expert parallelism: this process is rank ep_rank of ep_ranks (> 1)
     * and binds only the routed experts ep_placement gives it; the others
     * are checked (name, format, shape) but their bytes are never read
     * (their eng_weight data is NULL). Every other tensor is bound as
     * usual. Ranks other than 0 skip the fingerprint (rank 0's is handed
     * to them when their context joins: eng_ctx_params.comm); every rank
     * computes a digest of the config, every tensor's header and every
     * tensor but the routed experts, compared across ranks then.
     * ep_ranks <= 1: the whole model. */
    int ep_rank, ep_ranks;
    eng_ep_placement ep_placement;
    /* Where the weights live (ENG_WEIGHTS_AUTO by default). Reading them
     * into memory prints progress when `progress` is set. */
    eng_weights_mode weights;
} eng_model_params;

eng_model_params eng_model_default_params(void);

/*
 * Load the model in directory `dir`: config.json plus model.safetensors or
 * model.safetensors.index.json with its shards. Every tensor the config
 * implies is checked for presence, format (F32, BF16, F16, or a block-format
 * pair: MXFP4 as NAME_packed + NAME_scale U8, Q8_0 as NAME I8 + NAME_scale F16;
 * docs/formats.md) and shape before anything runs. With `tiktoken.model` in the directory, its
 * `tokenizer_config.json` is read too and the tokenizer checked against the
 * config's vocab_size. Errors: KDS_NOT_FOUND (missing file or tensor),
 * KDS_INVALID_ARG (KDS_WEIGHTS not auto, mapped or resident),
 * KDS_BAD_FORMAT (malformed JSON, safetensors or rank file), KDS_MISMATCH
 * (shape or dtype differs from the config, tokenizer larger than the
 * vocabulary), KDS_INVALID_ARG (inconsistent config), KDS_NOMEM, KDS_IO.
 * Caller owns *out: free with eng_model_free.
 */
kds_status eng_model_load(const char *dir, const eng_model_params *params, eng_model **out,
                          kds_err *err);
void eng_model_free(eng_model *m);   /* NULL is a no-op */

/* Borrowed, valid until eng_model_free. */
const eng_config *eng_model_config(const eng_model *m);
/* Bytes of the weights files read into memory (ENG_WEIGHTS_RESIDENT, or
 * AUTO's choice); 0 when every file is mapped. */
size_t eng_model_resident_bytes(const eng_model *m);
const char *eng_model_dir(const eng_model *m);
/* 32 hex digits: XXH3-128 over config.json and every tensor (name, dtype,
 * shape, bytes). Changes when the config or any weight changes. */
const char *eng_model_fingerprint(const eng_model *m);
/* The model's tokenizer: tiktoken when the directory has tiktoken.model and
 * tokenizer_config.json, else byte-level. Borrowed, valid until eng_model_free. */
const eng_tokenizer *eng_model_tokenizer(const eng_model *m);

/* ------------------------------------------------------------------------ */
/* Sequence state                                                            */

/* Byte sizes of a sequence's state for a config (see docs/formats.md):
 * total(tokens) = fixed + per_token * tokens. */
typedef struct eng_state_size {
    size_t fixed;            /* header + KDA states + conv tails + logits + sampler */
    size_t per_token;        /* MLA latent cache bytes per token (0 for pure KDA) */
    size_t kda_state;        /* of which: KDA recurrent states */
    size_t conv_state;       /* of which: conv tails */
} eng_state_size;

eng_state_size eng_config_state_size(const eng_config *c);

/* What one decoded token of one sequence reads, in bytes: the figure a
 * batch-1 decode is judged by against the memory bandwidth. weights: every
 * matrix as stored (its format's bytes, scales included), but one row of
 * the embedding table (unless it is also the lm_head) and, of each MoE
 * layer's routed experts, top-k of E; the small vectors (norms, biases)
 * are left out. state: each KDA layer's recurrent state and conv tail,
 * read and written, plus the MLA latent rows of `pos` earlier tokens. */
typedef struct eng_decode_bytes {
    double weights, state;
} eng_decode_bytes;
eng_decode_bytes eng_model_decode_bytes(const eng_model *m, int64_t pos);

/* The multiply-adds of a prefill of `tokens` tokens (>= 1) in its matrix
 * products: the figure a prefill bound by arithmetic is judged by against
 * the machine's multiply-add peak (eng_madd_peak). Every matrix's rows x
 * columns for each token, but of each MoE layer's routed experts top-k of
 * E, none of the embedding table (a lookup; unless it is also the
 * lm_head), and the lm_head once: a prefill's logits are its last
 * token's. Left out: the attention's own arithmetic (KDA's chunks, MLA's
 * scores over the context), the small vectors, and a block format's
 * decoding. */
double eng_model_prefill_madds(const eng_model *m, int64_t tokens);

/* Create a fresh sequence (position 0, zero state, RNG seeded with `seed`).
 * Caller owns *out: free with eng_seq_free. */
kds_status eng_seq_create(const eng_model *m, uint64_t seed, eng_seq **out, kds_err *err);
void eng_seq_free(eng_seq *s);
/* Back to position 0 with zero state; the RNG is re-seeded with `seed`. */
void eng_seq_reset(eng_seq *s, uint64_t seed);
/* Re-seed only the sampler's RNG (the model state is untouched). */
void eng_seq_reseed(eng_seq *s, uint64_t seed);
/* Deep copy (fork). */
kds_status eng_seq_clone(const eng_seq *s, eng_seq **out, kds_err *err);

/* Tokens consumed so far. */
int64_t eng_seq_pos(const eng_seq *s);
/* Logits after the last consumed token, [vocab]; NULL at position 0.
 * Borrowed: valid until the next call that changes the sequence. After a
 * decode on a GPU context the logits are on the device and this copies
 * them back first (one row); NULL also if that copy fails (a device
 * error). */
const float *eng_seq_logits(const eng_seq *s);

/* Bytes eng_seq_state_save will write now (grows with position only for
 * hybrid models). */
size_t eng_seq_state_bytes(const eng_seq *s);
/* Copy the whole state into buf (at least eng_seq_state_bytes bytes). */
kds_status eng_seq_state_save(const eng_seq *s, void *buf, size_t len, kds_err *err);
/* Replace the state with the bytes in buf. The bytes are checked (magic,
 * version, sizes against this model's config) and refused with
 * KDS_BAD_FORMAT / KDS_MISMATCH without touching the sequence. */
kds_status eng_seq_state_load(eng_seq *s, const void *buf, size_t len, kds_err *err);

/*
 * Split form, for stores that keep a hybrid model's MLA latent cache as
 * append-only chunks (a save after a turn writes only the new tokens' rows,
 * and forks share the old ones):
 *   fixed part  = the same bytes as eng_seq_state_save with the MLA section
 *                 left out (header, KDA states, conv tails, logits, sampler);
 *   MLA rows    = for tokens [t0, t1): per token, per MLA layer, its cache row
 *                 [c | k_pe] as f32 ("token-major", so any range stands alone).
 * Pure-KDA models have no MLA rows: the fixed part is the whole state.
 */
size_t eng_seq_fixed_bytes(const eng_seq *s);
/* MLA bytes per token (n_mla * (kv_lora_rank + qk_rope_head_dim) * 4). */
size_t eng_seq_mla_token_bytes(const eng_seq *s);
kds_status eng_seq_save_fixed(const eng_seq *s, void *buf, size_t len, kds_err *err);
/* Rows of tokens [t0, t1), t1 <= position. len >= (t1-t0) * token bytes. */
kds_status eng_seq_save_mla(const eng_seq *s, int64_t t0, int64_t t1, void *buf, size_t len,
                            kds_err *err);
/* Load a fixed part: checked like eng_seq_state_load, refused without
 * touching the sequence. Afterwards the position is the saved one and the
 * MLA rows [0, position) must be filled with eng_seq_load_mla before the
 * sequence is used (until then they are zeros, which take address space
 * but no memory: a position no row backs yet costs nothing). */
kds_status eng_seq_load_fixed(eng_seq *s, const void *buf, size_t len, kds_err *err);
kds_status eng_seq_load_mla(eng_seq *s, int64_t t0, int64_t t1, const void *buf, size_t len,
                            kds_err *err);

/* ------------------------------------------------------------------------ */
/* Compute                                                                   */

/* Where a context runs the forward pass. */
typedef enum eng_device {
    ENG_DEVICE_CPU = 0,
    ENG_DEVICE_CUDA = 1,
} eng_device;

/* The device named `name` ("cpu" or "cuda"; NULL is "cpu"): true and *out
 * set, or false for any other name. The one place device names are read. */
bool eng_device_from_name(const char *name, eng_device *out);
/* "cpu" or "cuda". Static storage. */
const char *eng_device_name(eng_device d);

typedef struct eng_ctx_params {
    int n_threads;        /* 0 = number of online CPUs */
    int max_batch;        /* tokens per prefill step (scratch is sized for it); 0 = 512 */
    int kda_chunk;        /* WY chunk length of the prefill path; 0 = 64 */
    int max_seqs;         /* sequences per eng_decode_batch (sizes a [max_seqs, vocab]
                           * logits scratch and the row buffers); 0 = 64 */
    /* NULL or "cpu" (default), or "cuda": eng_prefill / eng_decode /
     * eng_decode_batch run the forward pass on the current CUDA device (the
     * weights are uploaded once at eng_ctx_create; KDA and hybrid models,
     * MLA layers included). Sequence states stay on the device between
     * calls (eng_ctx_attach below says how they come back for snapshots);
     * decode logits stay there too and are sampled there (eng_sample,
     * eng_decode_batch_sample) when the GPU sampler takes the settings.
     * eng_ctx_create fails with KDS_UNSUPPORTED and a message naming what is
     * missing when CUDA is not compiled in, no usable device is present, or
     * the model has something the GPU kernels lack (weights other than f32
     * or bf16, an MLA kv_lora_rank outside 64/128/256/512, KDA head sizes
     * without a kernel); a CPU context refuses a model generated for the
     * GPU the same way; KDS_INVALID_ARG for another name. Environment:
     * KDS_CUDA_GRAPHS=0 runs decode passes without CUDA graphs. */
    const char *device;
    /* Products round their fp32 activations to bf16 (~3e-3 relative error
     * per product: the precision of llama.cpp's bf16 path and of vLLM),
     * for speed; never the default, which is exact (fp32 sums of the
     * stored weights). On "cuda": matrix products of more than 8 rows
     * (about half the tensor-core work of the default split into bf16 hi +
     * lo, ~1e-5). On the CPU: the bf16 matrices of a prefill from
     * KERN_PREFILL_GEMM_MIN_T tokens, and of a decode step the products
     * of 4 tokens and more (a batched step's projections and lm_head, the
     * routed experts several sequences chose: kern_matmul_w_bf16act), by
     * AVX-512 BF16 dot products, about twice the multiply-adds per second
     * of the exact kernel; where the build lacks AVX512_BF16 it stays
     * exact. Products of fewer tokens (a lone decode; a GPU's up to 8
     * rows) are exact either way, so a sequence's results in a batched
     * step under bf16_act depend on what shares the step. */
    bool bf16_act;
    /* Expert parallelism (docs/expert-parallel.md): the job's ranks
     * (borrowed; must outlive the context), or NULL for one process as
     * before. With comm, rank 0's context drives every rank: its creation
     * has the other ranks (waiting in eng_ep_worker_run) load the same
     * model with their share of the experts and make contexts of the same
     * parameters, and compares the models' digests; each pass sends the
     * tokens of every MoE layer to the ranks holding their experts and the
     * results back, and the sequences' states live on the ranks that own
     * them (least loaded first; rank 0 last), brought back to rank 0 when
     * read (saves) like a GPU's (eng_ctx_attach). The logits equal one
     * rank's bit for bit at the same n_threads. The model must be loaded
     * with ep_rank / ep_ranks of the same communicator. CPU only: "cuda"
     * with comm is refused (KDS_UNSUPPORTED). Errors of a dead or hung
     * rank: KDS_COMM (every later call fails too; the job must end). */
    eng_comm *comm;
} eng_ctx_params;

eng_ctx_params eng_ctx_default_params(void);

kds_status eng_ctx_create(const eng_model *m, const eng_ctx_params *p, eng_ctx **out,
                          kds_err *err);
void eng_ctx_free(eng_ctx *c);
int eng_ctx_threads(const eng_ctx *c);

/*
 * The machine's memory read bandwidth in GB/s (10^9 bytes/s): the best of
 * `reps` plain streaming reads (kern_read_sum) of a buffer of `bytes` (in
 * 2 MiB pages where the kernel gives them, as resident weights are) on
 * n_threads threads (1..64), each thread reading its share (four per
 * thread) as the forward pass cuts its products. What decode at batch 1
 * is judged against (`kdaserve bench` prints both): bytes
 * eng_read_bandwidth_default_bytes() (1 GiB, or four times the last-level
 * cache if that is more) come from memory, not from a cache. Allocates and
 * frees the buffer and a thread pool. Errors: KDS_INVALID_ARG, KDS_NOMEM.
 */
kds_status eng_read_bandwidth(int n_threads, size_t bytes, int reps, double *gbs, kds_err *err);
/*
 * The same read, kept ready for repeated measurements: a caller that times
 * something between reads (`kdaserve bench` reads just before and just
 * after each decode run, so that both see the same load on a shared
 * machine) allocates and fills the buffer, and starts the threads, once.
 * eng_membw_create: Errors KDS_INVALID_ARG, KDS_NOMEM (also the pool's).
 * eng_membw_read: the best of `reps` (>= 1) reads, GB/s. A handle is used
 * by one thread at a time; eng_membw_free(NULL) is a no-op.
 * eng_membw_read_for: reads back to back for at least `seconds` (one at
 * least), GB/s over all of them: what the memory gave over that time, as
 * a decode run's GB/s is over its tokens (on a shared machine the best of
 * a few short reads catches the quietest instant, 9-19% above such a mean
 * on the dev machine: docs/benchmarks.md, "Where the time goes, matrix by
 * matrix, and a sustained read"); *best (may be NULL) the best single
 * read, *reads (may be NULL) how many.
 */
typedef struct eng_membw eng_membw;
kds_status eng_membw_create(int n_threads, size_t bytes, eng_membw **out, kds_err *err);
double eng_membw_read(eng_membw *b, int reps);
double eng_membw_read_for(eng_membw *b, double seconds, double *best, int *reads);
void eng_membw_free(eng_membw *b);
size_t eng_read_bandwidth_default_bytes(void);
/*
 * The machine's multiply-add peak in GFLOP/s (two flops a multiply-add) on
 * n_threads threads (1..64): 24 independent chains of register-only f32
 * FMAs per thread (kern_madd_chains), or with bf16 AVX-512 BF16 dot
 * products, the best of `reps` (>= 1) runs of about 50 ms. What a prefill
 * is judged against (`kdaserve bench` prints both), as decode is against
 * eng_read_bandwidth. Starts and ends a thread pool. Errors:
 * KDS_INVALID_ARG; KDS_UNSUPPORTED where the build has no such loop
 * (neither AVX-512 nor AVX2 with FMA; bf16 without AVX512_BF16);
 * KDS_NOMEM.
 */
kds_status eng_madd_peak(int n_threads, bool bf16, int reps, double *gflops, kds_err *err);
/* The largest CPU cache's size in bytes (sysfs; 0 when unknown). */
size_t eng_llc_bytes(void);
/* Whether the CPU backend can honour eng_ctx_params.bf16_act: this build
 * has AVX-512 BF16 dot products. Without them the mode changes nothing
 * on the CPU (its products stay exact); front ends say so. */
bool eng_cpu_bf16_products(void);
/* Whether they run on AMX tiles (kern_bf16_tiles). */
bool eng_cpu_bf16_tiles(void);
/*
 * Where a CPU context's matrix products spend their time (`kdaserve bench
 * --profile`). Between eng_ctx_profile_start and eng_ctx_profile_stop
 * every product task is timed on the thread that runs it (two clock reads
 * a task; the results do not change), and stop sums the time by what the
 * matrix is and its shape: one row per role (the checkpoint's name without
 * layer and expert indices, e.g. "experts w2 (down)", "kda o_proj",
 * "lm_head") and shape, most time first. Time outside the products (the
 * other ops, waits at the pool's joins) is what the caller's clock saw
 * times the threads, less the rows' busy_s. start restarts a running
 * profile. Errors: KDS_UNSUPPORTED (a CUDA or expert-parallel context),
 * KDS_NOMEM; stop: KDS_INVALID_ARG without a start, or with more than
 * `cap` rows (the profile ends either way).
 */
typedef struct eng_product_time {
    const char *role;  /* static strings */
    const char *dtype; /* "bf16", "mxfp4", ... */
    int rows, cols;
    int64_t products;  /* products of such a matrix dispatched */
    int64_t tokens;    /* their token rows, summed */
    double bytes;      /* their matrices' bytes, once a product */
    double busy_s;     /* seconds in their tasks, summed over the threads */
} eng_product_time;
kds_status eng_ctx_profile_start(eng_ctx *c, kds_err *err);
kds_status eng_ctx_profile_stop(eng_ctx *c, eng_product_time *out, int cap, int *n,
                                kds_err *err);
/* Where this context runs the forward pass, and its name ("cpu", "cuda"). */
eng_device eng_ctx_device_kind(const eng_ctx *c);
const char *eng_ctx_device(const eng_ctx *c);

/*
 * Device contexts keep each sequence's state on the device between calls
 * (up to max_seqs sequences; the least recently used one goes back to host
 * memory when another needs its slot). Reading a sequence's state bytes
 * (eng_seq_state_save, eng_seq_save_fixed / _mla, eng_seq_clone) copies it
 * back first; writing them (eng_seq_state_load, eng_seq_load_*,
 * eng_seq_reset) makes the next pass upload it. eng_ctx_attach moves `s`
 * onto the context's device now instead of at its next pass (a restored
 * session's state goes up while nothing waits for it; benchmarks time the
 * hand-over with it); on a CPU context it brings the host copy up to date.
 * A sequence must not be used by two threads at once, and a context and
 * the sequences resident on it belong to one thread at a time. Freeing the
 * context copies every resident state back to its sequence.
 * Errors: KDS_INVALID_ARG (another model), KDS_CUDA.
 */
kds_status eng_ctx_attach(eng_ctx *c, eng_seq *s, kds_err *err);
/* The reverse: s's state and logits back in its host buffers and off any
 * device, so that no context touches s until its next pass. Afterwards
 * another thread may read s (sess_save) while the context serves other
 * sequences; the caller must not run s through a context until that reader
 * is done. Call it on the thread that owns the context. On a CPU context
 * nothing moves. Errors: KDS_INVALID_ARG (another model), KDS_CUDA (the
 * copy back failed: the sequence stays where it was). */
kds_status eng_ctx_release(eng_ctx *c, eng_seq *s, kds_err *err);

/*
 * Feed `n` tokens through the prefill path (chunked KDA, batched matrix
 * products), in steps of at most max_batch tokens. If `logits_all` is not
 * NULL it receives [n, vocab] logits of every position; the sequence's last
 * logits are always updated. Token ids are checked first: an id outside
 * [0, vocab) is refused with KDS_INVALID_ARG and nothing changes.
 * `progress`, when not NULL, is called after every step with tokens done.
 */
typedef void (*eng_progress_fn)(void *user, int64_t done, int64_t total);
kds_status eng_prefill(eng_ctx *c, eng_seq *s, const int32_t *ids, int64_t n,
                       float *logits_all, eng_progress_fn progress, void *user, kds_err *err);

/* Feed one token through the recurrent (decode) path. */
kds_status eng_decode(eng_ctx *c, eng_seq *s, int32_t id, kds_err *err);

/* Feed one token to each of n distinct sequences in one forward pass (continuous batching):
 * ids[i] goes to seqs[i]. Every weight matrix is streamed once for all n. Each sequence
 * ends exactly as after eng_decode(c, seqs[i], ids[i]) (same state, logits equal up to
 * float summation order). n <= eng_ctx_max_seqs(c). Checks first (model, distinctness,
 * ids, n): on error nothing changes. */
kds_status eng_decode_batch(eng_ctx *c, eng_seq *const *seqs, const int32_t *ids, int n, kds_err *err);
/* (n == 0 does nothing. Errors: KDS_INVALID_ARG naming the bad sequence, id or count;
 * KDS_NOMEM when a hybrid model's MLA cache cannot grow.) eng_ctx_max_seqs is
 * eng_ctx_params.max_seqs of the context. */
int eng_ctx_max_seqs(const eng_ctx *c);


/* ------------------------------------------------------------------------ */
/* Sampling                                                                  */

typedef struct eng_sampler_params {
    float temperature;       /* 0 = greedy (argmax) */
    int top_k;               /* 0 = off */
    float top_p;             /* 1 = off */
    float min_p;             /* 0 = off */
    float repeat_penalty;    /* 1 = off; divides positive logits of recent tokens */
    int repeat_last_n;       /* how many recent tokens the penalty looks at (<= 64) */
} eng_sampler_params;

eng_sampler_params eng_sampler_default_params(void);

/* Pick the next token from the sequence's last logits. Advances the
 * sequence's RNG (part of its state), so a resumed sequence continues the
 * same random stream. Uses the context's scratch; allocates nothing.
 * Returns KDS_INVALID_ARG at position 0 (no logits yet). */
kds_status eng_sample(eng_ctx *c, eng_seq *s, const eng_sampler_params *p, int32_t *token,
                      kds_err *err);

/*
 * eng_decode_batch, then a token for each sequence from its new logits with
 * sampler p: next[i], exactly what eng_sample(c, seqs[i], p) would give
 * (the same algorithm, RNG step and repetition penalty). On a GPU context
 * the sampler runs on the device and each sequence's logits stay there
 * until something reads them (eng_seq_logits, eng_sample and state saves
 * fetch them), so only the tokens cross the bus; settings the GPU sampler
 * lacks (temperature > 0 with top_k off or above 1024) sample on the host.
 * On the CPU it is eng_decode_batch followed by eng_sample for each. next
 * may be ids (each step's tokens feed the next step).
 * Errors: those of eng_decode_batch (nothing changed), KDS_INVALID_ARG
 * (p or next NULL); an error after the pass leaves the sequences advanced
 * and next unspecified.
 */
kds_status eng_decode_batch_sample(eng_ctx *c, eng_seq *const *seqs, const int32_t *ids, int n,
                                   const eng_sampler_params *p, int32_t *next, kds_err *err);

/*
 * A token for each of n distinct sequences from its last logits, sequence
 * i with its own settings p[i] (a batch of streams that sample differently:
 * the server's continuous-batching step): tokens[i] is exactly what
 * eng_sample(c, seqs[i], &p[i]) gives (the same algorithm, RNG step and
 * repetition penalty). On a GPU context every sequence whose logits a
 * device decode left there, with settings the device sampler has, is
 * sampled in ONE device call (only the tokens cross the bus); the others
 * sample on the host. n <= eng_ctx_max_seqs(c). Uses the context's
 * scratch; allocates nothing.
 * Errors: KDS_INVALID_ARG (n out of range, a NULL or repeated sequence,
 * another model's, one with no logits yet: checked before any draw, so no
 * RNG moves), KDS_CUDA.
 */
kds_status eng_sample_batch(eng_ctx *c, eng_seq *const *seqs, int n, const eng_sampler_params *p,
                            int32_t *tokens, kds_err *err);

/* ------------------------------------------------------------------------ */
/* Tokenizer                                                                 */
/*
 * Two kinds behind one type, both immutable once made and safe to share
 * between threads (every call allocates its own scratch):
 *   byte-level  ids 0..255 are the bytes, then named specials (a model
 *               directory without a tokenizer gets this one);
 *   tiktoken    byte-level BPE by rank from a tiktoken rank file
 *               ("base64-token rank" lines), the pre-tokenisation regex of a
 *               preset (cl100k, o200k, kimi; PCRE2 with JIT), and special
 *               tokens. Ids equal OpenAI tiktoken's for the same ranks,
 *               pattern and text (tests/test_tok_*.c check this against
 *               tiktoken itself).
 * A model directory holding `tiktoken.model` and `tokenizer_config.json`
 * (Kimi's layout, docs/formats.md) loads the tiktoken kind automatically.
 *
 * Text is bytes. Valid UTF-8 is split exactly as tiktoken splits it; bytes
 * that are not valid UTF-8 (tiktoken cannot receive them) are never lost:
 * each maximal run of them is encoded on its own, byte-level, and the text
 * around it is pre-tokenised as separate runs. So decode(encode(x)) == x for
 * any bytes x. The kimi preset also cuts long texts where Kimi's Python
 * encode() cuts them (every 400,000 characters, runs over 25,000), so its
 * ids stay Moonshot's on texts of any length (docs/formats.md).
 */

/* Flags of eng_tok_encode_ex. */
enum {
    /* Text equal to a special token's name becomes that special's id (the
     * longest name wins where two start at the same byte). Without it, such
     * text is ordinary text (tiktoken's encode_ordinary): user text cannot
     * smuggle in control tokens. */
    ENG_TOK_ALLOW_SPECIAL = 1u << 0,
};

/* Flags of eng_tok_decode and eng_tok_stream_create. */
enum {
    /* specials decode to nothing (not their names); in a stream
     * (eng_tok_stream_create), K3's tag headers too: <|open|>response<|sep|>
     * and <|close|>think<|sep|> vanish whole, the channels' text stays */
    ENG_TOK_SKIP_SPECIAL = 1u << 0,
};

typedef struct eng_tok_params {
    /* Pre-tokenisation preset: "cl100k", "o200k", "kimi", or "none" (NULL =
     * "none": the text is one piece; slow on long text). */
    const char *pattern;
    /* JSON file of special tokens: tiktoken's {"special_tokens": {NAME: ID}},
     * Hugging Face's tokenizer_config.json ("added_tokens_decoder"), or a
     * plain {NAME: ID} object. NULL = the preset's own specials (cl100k,
     * o200k: OpenAI's; kimi: Kimi-K2's names at (number of ranks + k), the
     * rest of 256 slots named <|reserved_token_ID|>). */
    const char *specials_file;
    bool no_specials;   /* no special tokens at all (overrides the above) */
    /* Vocabulary size; 0 = one past the largest rank or special id. Larger
     * values leave unused ids, which decode to nothing. */
    int vocab;
} eng_tok_params;

eng_tok_params eng_tok_default_params(void);

/*
 * Load a tiktoken rank file (one "base64-token rank" line per token, empty
 * lines ignored). Refused with KDS_BAD_FORMAT and "FILE:LINE: reason" for a
 * malformed line, bad base64, a rank out of [0, 2^24), a repeated rank or
 * token, or (naming the byte) a rank file without all 256 single bytes,
 * which a byte-level BPE needs to encode any text. Other errors:
 * KDS_NOT_FOUND / KDS_IO (files), KDS_INVALID_ARG (unknown preset, special
 * colliding with a rank or named twice), KDS_MISMATCH (`vocab` smaller than
 * the largest id), KDS_NOMEM. Caller owns *out: free with eng_tok_free.
 */
kds_status eng_tok_load(const char *rank_file, const eng_tok_params *p, eng_tokenizer **out,
                        kds_err *err);
/* NULL is a no-op. Never free a model's tokenizer (eng_model_free does). */
void eng_tok_free(eng_tokenizer *t);

/*
 * Encode text. Writes the first min(count, cap) ids to `ids` (may be NULL
 * when cap is 0) and the count to *n. The count never exceeds `len` (every
 * token covers at least one byte), so cap = len always suffices. Errors:
 * KDS_NOMEM, KDS_INTERNAL (the regex engine gave up; the message says why).
 */
kds_status eng_tok_encode_ex(const eng_tokenizer *t, const char *text, size_t len,
                             unsigned flags, int32_t *ids, int64_t cap, int64_t *n,
                             kds_err *err);
/* eng_tok_encode_ex without flags (specials are ordinary text): writes at
 * most `cap` ids, returns the count needed, or -1 on failure. */
int64_t eng_tok_encode(const eng_tokenizer *t, const char *text, size_t len, int32_t *ids,
                       int64_t cap);
/* Bytes of the ids, concatenated (specials as their names unless
 * ENG_TOK_SKIP_SPECIAL). Writes at most `cap` bytes (no NUL added), returns
 * the length needed, or -1 when an id is outside [0, vocab). */
int64_t eng_tok_decode(const eng_tokenizer *t, const int32_t *ids, int64_t n, unsigned flags,
                       char *out, size_t cap);
/* Bytes of one token (specials as their names, unused ids as ""); *len set.
 * Borrowed: valid until the tokenizer is freed. A token may be part of a
 * UTF-8 character: print a stream of tokens with eng_tok_stream. */
const char *eng_tok_piece(const eng_tokenizer *t, int32_t id, size_t *len);
int eng_tok_vocab(const eng_tokenizer *t);
/* End-of-sequence id, or -1. */
int32_t eng_tok_eos(const eng_tokenizer *t);
int32_t eng_tok_bos(const eng_tokenizer *t);
/* True for every id that ends generation: the eos id and the specials that
 * mark an end in the known vocabularies (<|im_end|>, [EOS], <|endoftext|>,
 * K3's <|end_of_msg|>; Kimi models emit both <|im_end|> and [EOS],
 * kda-model-spec.md section 7). */
bool eng_tok_is_stop(const eng_tokenizer *t, int32_t id);
/* True when `id` is a special token. */
bool eng_tok_is_special(const eng_tokenizer *t, int32_t id);
/* The id of the special named `name`, or -1. */
int32_t eng_tok_special_id(const eng_tokenizer *t, const char *name);
/* Pre-token boundaries: the end offset of every piece the encoder hands to
 * the BPE (special names are not looked for). Writes up to `cap` ends to
 * `ends` (NULL when cap is 0), the count to *n. For inspecting a pattern
 * (`kdaserve tokenize --split`) and for tests. Errors as eng_tok_encode_ex. */
kds_status eng_tok_split(const eng_tokenizer *t, const char *text, size_t len, size_t *ends,
                         int64_t cap, int64_t *n, kds_err *err);
/* "bytes", or "tiktoken/<preset>" (e.g. "tiktoken/kimi"). Borrowed. */
const char *eng_tok_kind(const eng_tokenizer *t);

/*
 * Streaming decode: feed ids one at a time as they are generated, get back
 * text that never ends inside a UTF-8 character (the bytes of an incomplete
 * character wait for the next id). The output is always valid UTF-8: bytes
 * that cannot become a character are replaced by U+FFFD, one per maximal
 * invalid subpart (the Unicode/WHATWG practice). One stream per generated
 * sequence; it borrows the tokenizer (which must outlive it).
 */
typedef struct eng_tok_stream eng_tok_stream;
kds_status eng_tok_stream_create(const eng_tokenizer *t, unsigned flags, eng_tok_stream **out,
                                 kds_err *err);
void eng_tok_stream_free(eng_tok_stream *s);   /* NULL is a no-op */
/* Add one id; *text and *len receive the text it completes (often none).
 * Borrowed: valid until the next call on `s`. Allocates nothing. An id
 * outside [0, vocab) is refused with KDS_INVALID_ARG, changing nothing. */
kds_status eng_tok_stream_put(eng_tok_stream *s, int32_t id, const char **text, size_t *len,
                              kds_err *err);
/* End of the stream: returns what is still held (an incomplete character
 * becomes U+FFFD) and empties the stream for reuse. Borrowed as above. */
const char *eng_tok_stream_flush(eng_tok_stream *s, size_t *len);

/* ------------------------------------------------------------------------ */
/* Chat format                                                               */
/*
 * Kimi's instruct format (Kimi-K2's chat template, which Kimi-Linear shares;
 * kda-model-spec.md section 7), rendered straight to ids. Every turn is
 *   OPENER NAME <|im_middle|> BODY <|im_end|>
 * with OPENER <|im_user|> for "user", <|im_assistant|> for "assistant" and
 * <|im_system|> for every other role, NAME the message's name or its role,
 * and no newlines between turns. Before the turns: a tool_declare turn when
 * tools are given, then a default system turn when the first message is
 * not a system message. A "tool" result's body starts with "## Return of
 * TOOL_CALL_ID\n"; an assistant's tool calls follow its content as
 *   <|tool_calls_section_begin|> (<|tool_call_begin|> ID
 *   <|tool_call_argument_begin|> ARGUMENTS <|tool_call_end|>)...
 *   <|tool_calls_section_end|>.
 * The generation prompt is <|im_assistant|>assistant<|im_middle|>. No BOS.
 * Text (names, content, tools JSON) is encoded as ordinary text: special
 * names typed in a message stay text. Generation ends on eng_tok_is_stop
 * ids (<|im_end|>). A tokenizer without these specials has no chat format:
 * use the model in plain continuation mode.
 *
 * Kimi K3's format (kimi-k3.md section 4.10; docs/k3.md) is taken instead
 * when the tokenizer has its four specials <|open|> <|sep|> <|close|>
 * <|end_of_msg|>. A tag is <|open|>TAG ATTRS<|sep|> ... <|close|>TAG<|sep|>,
 * attribute values in double quotes (a quote in a value as \"), and every
 * message is
 *   <|open|>message role="ROLE"[ name="NAME"]<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>
 * Before the messages: a system message with type="tool-declare" when
 * tools are given (body "# Tools\nHere are the available tools, described
 * in JSONSchema.\n\n```json\nTOOLS\n```"), then, with thinking on, one with
 * type="thinking-effort" naming the effort. There is no default system
 * message. An assistant's body is, with thinking on, a think channel
 * (<|open|>think<|sep|>REASONING<|close|>think<|sep|>), then the response
 * channel (<|open|>response<|sep|>CONTENT<|close|>response<|sep|>), then
 * its calls: <|open|>tools<|sep|> and per call <|open|>call tool="NAME"
 * index="K"<|sep|>, per argument of the JSON object <|open|>argument key=
 * "KEY" type="string|number|boolean|null|object|array"<|sep|>VALUE
 * <|close|>argument<|sep|> (strings as they are, other values as Python's
 * json.dumps writes them), closed in turn. A "tool" message carries
 * tool="NAME" index="K", K its place among the results since the last
 * assistant message. The generation prompt opens an assistant message and
 * its think channel (thinking on) or its response channel (off).
 * Generation ends on <|end_of_msg|>.
 */

typedef struct eng_chat_tool_call {
    const char *id;        /* "functions.NAME:IDX" */
    const char *arguments; /* JSON text, as the model wrote it */
    const char *name;      /* K3: the tool (NULL = NAME of a "functions.NAME:IDX" id) */
} eng_chat_tool_call;

typedef struct eng_chat_msg {
    const char *role;         /* "system", "user", "assistant", "tool", ... */
    const char *content;      /* NULL = "" */
    const char *name;         /* NULL = the role; K3: a user/system name attribute, or a
                               * "tool" message's tool (NULL = its call's name) */
    const char *tool_call_id; /* "tool" messages: the call answered (NULL = "") */
    const eng_chat_tool_call *tool_calls; /* "assistant" messages */
    int n_tool_calls;
    const char *reasoning; /* K3 "assistant" messages: the think channel (NULL = "") */
} eng_chat_msg;

typedef struct eng_chat_params {
    const char *tools_json;     /* compact JSON array of tool schemas; NULL/"" = none */
    const char *default_system; /* NULL = "You are Kimi, an AI assistant created by
                                 * Moonshot AI."; "" = no default system turn (K2 format
                                 * only: K3's has none) */
    bool add_generation_prompt; /* end with the assistant's opener */
    /* K3 only: thinking is on unless no_thinking; thinking_effort "low",
     * "high" or "max" (NULL = "max") */
    bool no_thinking;
    const char *thinking_effort;
    /* the conversation already has turns: no default system turn (K2) and
     * no tool-declare / thinking-effort messages (K3) */
    bool continuing;
} eng_chat_params;

eng_chat_params eng_chat_default_params(void);

/* True when the tokenizer has the specials of a chat format. */
bool eng_chat_supported(const eng_tokenizer *t);

/* The special that ends a message: <|end_of_msg|> with K3's format, else
 * <|im_end|> (Kimi-K2's); -1 when the tokenizer has neither. A chat reply
 * or turn cut short is closed with it. */
int32_t eng_chat_end_token(const eng_tokenizer *t);

/* True when the model should be talked to in the chat format: its tokenizer
 * has the specials and its directory has a chat template (chat_template.jinja,
 * or "chat_template" in tokenizer_config.json; a directory without
 * tokenizer_config.json gives no hint, so the specials decide). A base model
 * without a template is used in plain continuation. */
bool eng_model_chat_format(const eng_model *m);

/*
 * The ids one message adds to a conversation that has `pos` tokens, as the
 * REPL and the server feed them: in chat format (`chat`) an optional system
 * turn and the user turn, ending in the assistant's opener when
 * `gen_prompt` (a conversation at pos 0 also gets the default system turn
 * when no system text is given); in plain mode the text itself (and the BOS
 * token when the context is empty and so is the text, so a generation has
 * something to start from). Caller owns *ids (free()); *n may be 0.
 * Errors: those of eng_chat_render / eng_tok_encode_ex.
 */
kds_status eng_chat_turn(const eng_tokenizer *t, bool chat, int64_t pos, const char *system,
                         const char *text, size_t len, bool gen_prompt, int32_t **ids,
                         int64_t *n, kds_err *err);

/*
 * Render a conversation to ids: writes the first min(count, cap) to `ids`
 * and the count to *n (as eng_tok_encode_ex). Errors: KDS_UNSUPPORTED (the
 * tokenizer lacks a special the conversation needs, named in the message),
 * KDS_INVALID_ARG (a message without a role), KDS_NOMEM.
 */
kds_status eng_chat_render(const eng_tokenizer *t, const eng_chat_msg *msgs, int n_msgs,
                           const eng_chat_params *p, int32_t *ids, int64_t cap, int64_t *n,
                           kds_err *err);

#endif /* ENG_H */
