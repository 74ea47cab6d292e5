/*
 * eng_cuda.h - engine-internal: the whole-model forward pass on a CUDA GPU
 * (eng_cuda.c), behind eng_ctx_params.device = "cuda".
 *
 * An eng_cuda holds, on the current CUDA device: a copy of the model's
 * weights as stored (bf16 / f32 matrices, f32 small vectors), activation
 * buffers for max(max_batch, max_seqs) rows, and max_seqs slots of
 * per-sequence state (every KDA layer's [HV, K, V] state and conv tail).
 * Pure-KDA models only (KDA + dense / MoE FFN); a model with MLA layers is
 * refused with KDS_UNSUPPORTED.
 *
 * State hand-over (the simplest correct form): eng__cuda_forward uploads
 * each sequence's state from its eng_seq into a slot before the pass and
 * downloads it back after, through a pinned staging buffer, so host memory
 * always holds the current state and snapshots work unchanged. The cost is
 * two state copies per call (~2 x 43 MiB per sequence at Kimi's 48B shape):
 * keeping states resident across calls is the next step.
 *
 * Threading: one host thread at a time per eng_cuda (as for eng_ctx).
 * Without KDS_HAVE_CUDA every function fails with KDS_UNSUPPORTED.
 */
#ifndef ENG_CUDA_H
#define ENG_CUDA_H

#include "eng_seq.h"

typedef struct eng_cuda eng_cuda;

/* Upload the weights of `m` and size buffers for max_batch tokens of one
 * sequence and max_seqs sequences of one token; kda_chunk is ignored (the
 * GPU prefill uses chunks of 64). Errors: KDS_UNSUPPORTED (no CUDA build,
 * no device, MLA layers, f16 weights), KDS_NOMEM (device memory), KDS_CUDA. */
kds_status eng__cuda_create(const eng_model *m, int max_batch, int max_seqs, eng_cuda **out,
                            kds_err *err);
void eng__cuda_free(eng_cuda *g);

/* forward() of eng_forward.c on the GPU, same arguments: T tokens of
 * seqs[0] (n_seqs == 1; chunked: the prefill kernel, else the decode
 * kernel, T == 1) or one token of each of seqs[0..T) (n_seqs == T). On
 * success the sequences advance exactly as forward() advances them. On
 * error (KDS_CUDA, KDS_NOMEM) nothing in the sequences changed. */
kds_status eng__cuda_forward(eng_cuda *g, eng_seq *const *seqs, int n_seqs, const int32_t *ids,
                             int T, int chunked, float *logits, int want_last, kds_err *err);

/* Copy the KDA states and conv tails of `s` into device slot `slot`
 * (0 <= slot < max_seqs), or back from it into `s`, through the pinned
 * staging buffer; synchronous. Errors: KDS_INVALID_ARG (slot, model),
 * KDS_CUDA. */
kds_status eng__cuda_state_upload(eng_cuda *g, int slot, const eng_seq *s, kds_err *err);
kds_status eng__cuda_state_download(eng_cuda *g, int slot, eng_seq *s, kds_err *err);

#endif /* ENG_CUDA_H */
