/*
 * eng_cuda.h - engine-internal: the whole-model forward pass on a CUDA GPU
 * (eng_cuda.c), behind eng_ctx_params.device = "cuda".
 *
 * An eng_cuda holds, on the current CUDA device: a copy of the model's
 * weights as stored (bf16 / f32 matrices, f32 small vectors), activation
 * buffers for max(max_batch, max_seqs) rows, and max_seqs slots of
 * per-sequence state (every KDA layer's [HV, K, V] state and conv tail,
 * every MLA layer's latent cache). KDA and hybrid models, dense or MoE.
 *
 * State residency: a sequence that runs on the GPU keeps its state in a
 * device slot between calls (eng_seq.gpu / gpu_slot). Its host buffers are
 * brought up to date only when something reads them (snapshot saves,
 * clones: eng__seq_fetch, one copy of the state), and the device copy is
 * uploaded again only after the host buffers were written (a restore, a
 * reset: eng__seq_host_written). A pass over more sequences than free
 * slots evicts the least recently used resident sequence not in the pass
 * (its state goes back to its host buffers first). Freeing the context
 * hands every resident state back; freeing a sequence frees its slot.
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
kds_status eng__cuda_create(const eng_model *m, int max_batch, int max_seqs, bool bf16,
                            eng_cuda **out, kds_err *err);
void eng__cuda_free(eng_cuda *g);

/* forward() of eng_forward.c on the GPU, same arguments: T tokens of
 * seqs[0] (n_seqs == 1; chunked: the prefill kernel, else the decode
 * kernel, T == 1) or one token of each of seqs[0..T) (n_seqs == T). On
 * success the sequences advance exactly as forward() advances them (their
 * states on the device). Errors found before the pass (KDS_INVALID_ARG)
 * change nothing; after a device error (KDS_CUDA) the context is unusable
 * and a resident sequence's state is its last fetched one. */
kds_status eng__cuda_forward(eng_cuda *g, eng_seq *const *seqs, int n_seqs, const int32_t *ids,
                             int T, int chunked, float *logits, int want_last, kds_err *err);

/* Copy the KDA states and conv tails of `s` into device slot `slot`
 * (0 <= slot < max_seqs), or back from it into `s`, through the pinned
 * staging buffer; synchronous. Errors: KDS_INVALID_ARG (slot, model),
 * KDS_CUDA. */
/* eng_decode_batch_sample on the GPU (the checks and host MLA reserves
 * done by the caller, who also checked eng__cuda_sampler_takes(g, p)): the
 * pass with the logits left on the device, the sampler there, next[i] out. */
bool eng__cuda_sampler_takes(const eng_cuda *g, const eng_sampler_params *p);
/* eng_sample of a sequence whose logits are on the device (s->gpu == g,
 * s->logits_on_gpu; eng__cuda_sampler_takes(g, p)): sampled there. */
kds_status eng__cuda_sample_one(eng_cuda *g, eng_seq *s, const eng_sampler_params *p,
                                int32_t *token, kds_err *err);
kds_status eng__cuda_decode_sample(eng_cuda *g, eng_seq *const *seqs, int n, const int32_t *ids,
                                   const eng_sampler_params *p, int32_t *next, kds_err *err);

/* Make `s` resident now (eng_ctx_attach): what the first pass would do,
 * so a restore can be timed or overlapped. Errors: as eng__cuda_forward. */
kds_status eng__cuda_attach(eng_cuda *g, eng_seq *s, kds_err *err);

/* For tests: the context's GPU part (NULL on a CPU context), and how many
 * decode graphs it has captured (-1: graphs are off). */
eng_cuda *eng__ctx_gpu(const eng_ctx *c);
int eng__cuda_graph_count(const eng_cuda *g);

kds_status eng__cuda_state_upload(eng_cuda *g, int slot, const eng_seq *s, kds_err *err);
kds_status eng__cuda_state_download(eng_cuda *g, int slot, eng_seq *s, kds_err *err);

#endif /* ENG_CUDA_H */
