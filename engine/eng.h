/*
 * eng.h - the kdaserve engine: load a Kimi-Linear-family model (KDA + MoE,
 * optionally MLA full-attention layers) from a Hugging Face directory and run
 * it on the CPU.
 *
 * Objects
 *   eng_model  immutable weights + config, mmap'd. Shareable by any number of
 *              contexts and sequences on any threads.
 *   eng_ctx    compute context: thread pool + scratch arena sized once at
 *              creation for the largest batch. One thread uses a context at a
 *              time (calls on one context must not overlap).
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
 * Hot path: eng_prefill and eng_decode allocate nothing, except that a
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

/* ------------------------------------------------------------------------ */
/* Model                                                                     */

typedef struct eng_model_params {
    /* Where the fingerprint cache lives; NULL = $XDG_CACHE_HOME/kdaserve (or
     * ~/.cache/kdaserve). */
    const char *cache_dir;
    /* Skip the cache and hash every byte (slow for large models). */
    bool no_fingerprint_cache;
    /* Print progress of long work (hashing) to stderr. */
    bool progress;
} eng_model_params;

eng_model_params eng_model_default_params(void);

/*
 * Load the model in directory `dir`: config.json plus model.safetensors or
 * model.safetensors.index.json with its shards. Every tensor the config
 * implies is checked for presence, dtype (F32, BF16, F16) and shape before
 * anything runs. Errors: KDS_NOT_FOUND (missing file or tensor),
 * KDS_BAD_FORMAT (malformed JSON or safetensors), KDS_MISMATCH (shape or
 * dtype differs from the config), KDS_INVALID_ARG (inconsistent config),
 * KDS_NOMEM, KDS_IO. Caller owns *out: free with eng_model_free.
 */
kds_status eng_model_load(const char *dir, const eng_model_params *params, eng_model **out,
                          kds_err *err);
void eng_model_free(eng_model *m);   /* NULL is a no-op */

/* Borrowed, valid until eng_model_free. */
const eng_config *eng_model_config(const eng_model *m);
const char *eng_model_dir(const eng_model *m);
/* 32 hex digits: XXH3-128 over config.json and every tensor (name, dtype,
 * shape, bytes). Changes when the config or any weight changes. */
const char *eng_model_fingerprint(const eng_model *m);
/* The model's tokenizer (byte-level until a real vocabulary is loaded). */
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

/* Create a fresh sequence (position 0, zero state, RNG seeded with `seed`).
 * Caller owns *out: free with eng_seq_free. */
kds_status eng_seq_create(const eng_model *m, uint64_t seed, eng_seq **out, kds_err *err);
void eng_seq_free(eng_seq *s);
/* Back to position 0 with zero state; the RNG is re-seeded with `seed`. */
void eng_seq_reset(eng_seq *s, uint64_t seed);
/* Deep copy (fork). */
kds_status eng_seq_clone(const eng_seq *s, eng_seq **out, kds_err *err);

/* Tokens consumed so far. */
int64_t eng_seq_pos(const eng_seq *s);
/* Logits after the last consumed token, [vocab]; NULL at position 0.
 * Borrowed: valid until the next call that changes the sequence. */
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
 * sequence is used (until then they are zeros). */
kds_status eng_seq_load_fixed(eng_seq *s, const void *buf, size_t len, kds_err *err);
kds_status eng_seq_load_mla(eng_seq *s, int64_t t0, int64_t t1, const void *buf, size_t len,
                            kds_err *err);

/* ------------------------------------------------------------------------ */
/* Compute                                                                   */

typedef struct eng_ctx_params {
    int n_threads;        /* 0 = number of online CPUs */
    int max_batch;        /* tokens per prefill step (scratch is sized for it); 0 = 256 */
    int kda_chunk;        /* WY chunk length of the prefill path; 0 = 64 */
} eng_ctx_params;

eng_ctx_params eng_ctx_default_params(void);

kds_status eng_ctx_create(const eng_model *m, const eng_ctx_params *p, eng_ctx **out,
                          kds_err *err);
void eng_ctx_free(eng_ctx *c);
int eng_ctx_threads(const eng_ctx *c);

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

/* ------------------------------------------------------------------------ */
/* Tokenizer (byte-level: ids 0..255 are bytes, specials follow)             */

/* Encode UTF-8 text; writes at most `cap` ids, returns the count needed. */
int64_t eng_tok_encode(const eng_tokenizer *t, const char *text, size_t len, int32_t *ids,
                       int64_t cap);
/* Bytes of one token (specials as their names); *len set. Borrowed. */
const char *eng_tok_piece(const eng_tokenizer *t, int32_t id, size_t *len);
int eng_tok_vocab(const eng_tokenizer *t);
/* End-of-sequence id, or -1. */
int32_t eng_tok_eos(const eng_tokenizer *t);
int32_t eng_tok_bos(const eng_tokenizer *t);

#endif /* ENG_H */
