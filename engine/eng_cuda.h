/*
 * eng_cuda.h - engine-internal: the CUDA backend (eng_cuda.c, built only
 * with the CUDA kernels), behind eng_ctx_params.device = "cuda". Its ops are
 * eng__cuda_ops (eng_backend.h); what is declared here is for tests and
 * benchmarks that look inside it.
 *
 * An eng_cuda holds, on the current CUDA device: a copy of the model's
 * weights as stored (bf16 / f32 matrices, f32 small vectors; ops->load),
 * the activation buffers its context asks for, and max_seqs slots of
 * per-sequence state (every KDA layer's [HV, K, V] state and conv tail,
 * every MLA layer's latent cache).
 *
 * State residency: a sequence that runs on the GPU keeps its state in a
 * device slot between calls (eng_seq.gpu / gpu_slot). Its host buffers are
 * brought up to date only when something reads them (snapshot saves,
 * clones: eng__seq_fetch, one copy of the state), and the device copy is
 * uploaded again only after the host buffers were written (a restore, a
 * reset: eng__seq_host_written). A pass over more sequences than free
 * slots evicts the least recently used resident sequence not in the pass
 * (its state goes back to its host buffers first). Freeing the backend
 * hands every resident state back; freeing a sequence frees its slot.
 *
 * Threading: one host thread at a time per eng_cuda (as for eng_ctx).
 */
#ifndef ENG_CUDA_H
#define ENG_CUDA_H

#include "eng_seq.h"

typedef struct eng_cuda eng_cuda;

/* A CUDA backend for model m with buffers for max_batch tokens of one
 * sequence and max_seqs sequences of one token, its weights not yet
 * copied (eng__cuda_ops.load does that). bf16: eng_ctx_params.bf16_act.
 * Errors: KDS_UNSUPPORTED (no usable device), KDS_NOMEM (device memory),
 * KDS_CUDA. */
kds_status eng__cuda_create(const eng_model *m, int max_batch, int max_seqs, bool bf16,
                            eng_cuda **out, kds_err *err);
void eng__cuda_free(eng_cuda *g);

/* Make `s` resident now (eng_ctx_attach). Errors: KDS_INVALID_ARG (another
 * model), KDS_NOMEM, KDS_CUDA. */
kds_status eng__cuda_attach(eng_cuda *g, eng_seq *s, kds_err *err);

/* Copy the KDA states and conv tails of `s` into device slot `slot`
 * (0 <= slot < max_seqs), or back from it into `s`, through the pinned
 * staging buffer; synchronous. Errors: KDS_INVALID_ARG (slot, model),
 * KDS_CUDA. */
kds_status eng__cuda_state_upload(eng_cuda *g, int slot, const eng_seq *s, kds_err *err);
kds_status eng__cuda_state_download(eng_cuda *g, int slot, eng_seq *s, kds_err *err);

/* For tests: the context's CUDA backend (NULL on a CPU context), and how
 * many decode graphs it has captured (-1: graphs are off). */
eng_cuda *eng__ctx_gpu(const eng_ctx *c);
int eng__cuda_graph_count(const eng_cuda *g);

#endif /* ENG_CUDA_H */
