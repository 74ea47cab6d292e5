/*
 * eng_seq.h - engine-internal layout of one sequence's state (struct eng_seq)
 * and of its flat byte form. The byte form is documented in docs/formats.md;
 * keep the two in step.
 */
#ifndef ENG_SEQ_H
#define ENG_SEQ_H

#include "eng_model.h"

#define ENG_STATE_MAGIC "KDSSTATE"
#define ENG_STATE_VERSION 1u
#define ENG_STATE_HEADER_BYTES 128u
#define ENG_RECENT_TOKENS 64

/* Per-layer dimensions derived once from the config. */
typedef struct eng_dims {
    int hidden, vocab;
    int H, HV, K, V, W;          /* KDA heads, value heads, key dim, value dim, conv width */
    int kda_qk, kda_v;           /* H*K, HV*V */
    int conv_ch;                 /* 2*H*K + HV*V channels through the short conv */
    int mla_heads, dn, dr, dv, dc;  /* MLA: heads, nope dim, rope dim, v dim, kv_lora_rank */
    int mla_row;                 /* dc + dr floats cached per token per MLA layer */
    int n_kda, n_mla, n_layers;
    int layer_slot[ENG_MAX_LAYERS]; /* index among KDA (or MLA) layers */
} eng_dims;

void eng__dims(const eng_config *c, eng_dims *d);

struct eng_seq {
    const eng_model *model;
    eng_dims d;
    int64_t pos;
    float *kda_state;            /* [n_kda, HV, K, V] */
    float *conv_tail;            /* [n_kda, W-1, conv_ch], oldest first */
    float **mla_cache;           /* n_mla pointers, each [mla_cap, dc + dr] */
    int64_t mla_cap;
    float *logits;               /* [vocab] */
    int has_logits;
    uint64_t rng[4];             /* xoshiro256** */
    int32_t recent[ENG_RECENT_TOKENS]; /* ring of the last tokens (repetition penalty) */
    int32_t n_recent;            /* tokens ever pushed, saturating at INT32_MAX */
    /* Device residency (eng_backend.h; the CUDA backend, engine/eng_cuda.c).
     * While `gpu` is set, that backend holds this sequence's KDA states,
     * conv tails and MLA rows (in its slot `gpu_slot`). gpu_newer: the
     * device copy is ahead of the host buffers above (a reader of them calls
     * eng__seq_fetch first); host_newer: the host buffers were written
     * (load, reset) and the device copy is stale (the next pass there
     * uploads them). pos, logits, rng and recent are host fields and always
     * current, except that logits_on_gpu says the current logits row is in
     * the backend (a decode there leaves it; eng__seq_fetch_logits). */
    struct eng_backend *gpu;
    int gpu_slot;
    int gpu_newer, host_newer;
    int64_t gpu_host_rows;       /* MLA rows [0, this) of the host caches are current */
    int logits_on_gpu;
};

/* Residency hooks (through s->gpu's ops; trivial for sequences never run
 * on a device): bring the host buffers up to date before reading them
 * (synchronous copy from the device; `s` is logically const: its content
 * does not change), mark them written, and give up the device slot
 * (eng_seq_free). */
kds_status eng__seq_fetch_slow(const eng_seq *s, kds_err *err);
kds_status eng__seq_fetch_logits_slow(const eng_seq *s, kds_err *err);
void eng__seq_detach(eng_seq *s);
static inline kds_status eng__seq_fetch(const eng_seq *s, kds_err *err) {
    return s->gpu && (s->gpu_newer || s->logits_on_gpu) ? eng__seq_fetch_slow(s, err) : KDS_OK;
}
/* Only the logits (eng_seq_logits, eng_sample): one row, not the state. */
static inline kds_status eng__seq_fetch_logits(const eng_seq *s, kds_err *err) {
    return s->gpu && s->logits_on_gpu ? eng__seq_fetch_logits_slow(s, err) : KDS_OK;
}
static inline void eng__seq_host_written(eng_seq *s) {
    if (s->gpu) s->host_newer = 1, s->gpu_newer = 0, s->logits_on_gpu = 0;
}

/* Make room for `tokens` positions in every MLA cache (geometric growth). */
kds_status eng__seq_reserve(eng_seq *s, int64_t tokens, kds_err *err);
/* Remember a consumed token (for the repetition penalty). */
void eng__seq_push_recent(eng_seq *s, int32_t id);
/* The recent tokens p's repetition penalty looks at, newest first, into
 * out[ENG_RECENT_TOKENS]; returns how many (0 when the penalty is off).
 * One choice for the host sampler (eng_sample) and the device one. */
int eng__seq_penalty_ids(const eng_seq *s, const eng_sampler_params *p, int32_t *out);
/* eng_sample's host algorithm on s's (host) logits: the repetition
 * penalty, then kern_sample with s's RNG. Scratch: vocab floats and ids.
 * The caller checked that s has logits on the host. */
int32_t eng__sample_host(eng_seq *s, const eng_sampler_params *p, float *scratch_p,
                         int32_t *scratch_id);

#endif
