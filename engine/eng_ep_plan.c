/*
 * eng_ep_plan.c - sizing an expert-parallel deployment (eng_ep.h,
 * `kdaserve plan`): per-rank weight memory, a session's state, what the
 * all-to-alls move per token and MoE layer, and the decode rate the
 * memory and link bandwidths allow.
 *
 * The model of a decode step (batch B sessions per rank, N ranks):
 *   memory  each rank streams its replicated weights once (the embedding
 *           only for its B rows unless it is also the lm_head), the
 *           routed experts of its own that the step's N B tokens chose
 *           (each of the E_r it holds is chosen with probability
 *           1 - (1 - k/E)^(N B), uniform routing), and its sessions'
 *           states: KDA states and conv tails read and written, the MLA
 *           latent rows read;
 *   links   per MoE layer a counts all-gather and two all-to-alls of B k
 *           rows of X f32 (X: hidden, or the latent width), of which the
 *           share (N-1)/N leaves the rank, split between the node's links
 *           (NVLink) and the network (InfiniBand) by where the other ranks
 *           are; a latency per collective; then the pass's logits rows go
 *           to rank 0 (its sampler): (N-1) B rows of vocab f32 into one
 *           rank;
 *   step    the sum (no overlap): t_hbm + t_comm.
 * The bytes come from the plan's tensor list (eng_plan.h) with the
 * non-block weights in the given dtype and the experts in the config's
 * format (MXFP4 when the config says so).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "eng_ep.h"
#include "eng_plan.h"

bool eng_ep_hw_preset(const char *name, eng_ep_hw *out) {
    /* HBM and memory: vendor sheets; NVLink: per direction; network: one
     * 400 Gb/s (50 GB/s) NIC per GPU, the usual 8-GPU node */
    static const eng_ep_hw presets[] = {
        {"h200", 141, 4800, 450, 50, 10, 8},
        {"h100", 80, 3350, 450, 50, 10, 8},
        {"b200", 180, 8000, 900, 50, 10, 8},
    };
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
        if (name && !strcmp(name, presets[i].name)) {
            *out = presets[i];
            return true;
        }
    return false;
}

typedef struct sizes {
    const eng_config *c;
    kern_dtype dt;
    double replicated, embed, experts;
} sizes;

static void size_fn(void *user, const eng_tensor_spec *t) {
    sizes *z = user;
    double n = 1;
    for (int i = 0; i < t->n_dims; i++) n *= (double)t->shape[i];
    const double bytes = t->matrix && kern_dtype_is_block(t->quant)
                             ? (double)kern_weight_layout(t->quant, t->shape[0], t->shape[1]).bytes
                             : n * (double)kern_dtype_size(z->dt);
    if (t->expert >= 0) { /* every routed expert has the same three matrices */
        z->experts += bytes;
        return;
    }
    if (strstr(t->name, "embed_tokens")) z->embed += bytes;
    z->replicated += bytes;
}

kds_status eng_ep_plan(const eng_config *c, const eng_ep_plan_in *in, eng_ep_plan_out *o,
                       kds_err *err) {
    memset(o, 0, sizeof *o);
    const int N = in->ranks, B = in->batch;
    const eng_ep_hw *h = &in->hw;
    if (N < 1) return kds_err_set(err, KDS_INVALID_ARG, "%d ranks", N);
    if (B < 1) return kds_err_set(err, KDS_INVALID_ARG, "a batch of %d sessions per rank", B);
    if (!(h->hbm_gbs > 0 && h->nvlink_gbs > 0 && h->net_gbs > 0 && h->mem_gb > 0 &&
          h->latency_us >= 0 && h->ranks_per_node >= 1))
        return kds_err_set(err, KDS_INVALID_ARG, "bandwidths, memory and ranks per node must be "
                           "positive");
    if (N > 1) {
        kds_status rc = eng_ep_check_config(c, N, err);
        if (rc != KDS_OK) return rc;
    }
    sizes z = {c, in->dtype, 0, 0, 0};
    eng__plan_tensors(c, NULL, size_fn, &z);
    const int E = c->num_experts > 0 ? c->num_experts : 0;
    const int k = E ? c->num_experts_per_token : 0;
    for (int l = 0; l < c->num_hidden_layers; l++) o->n_moe += c->layer_is_moe[l];
    o->replicated_bytes = z.replicated;
    o->embed_bytes = z.embed;
    o->expert_bytes = z.experts;
    o->one_expert_bytes = o->n_moe && E ? z.experts / ((double)o->n_moe * E) : 0;
    for (int r = 0; r < N && E; r++) {
        int n = eng_ep_count(in->placement, r, E, N);
        if (n > o->experts_rank_max) o->experts_rank_max = n;
    }
    o->rank_weight_bytes =
        o->replicated_bytes + (double)o->n_moe * o->experts_rank_max * o->one_expert_bytes;
    const eng_state_size st = eng_config_state_size(c);
    o->state_fixed = (double)st.fixed;
    o->state_per_token = (double)st.per_token;
    o->state_session = o->state_fixed + o->state_per_token * (double)in->context;
    /* the routed experts' width: the latent's in a latent MoE */
    const double X = c->latent_size > 0 ? c->latent_size : c->hidden_size;
    const double row = 4.0 * X;
    o->a2a_token_layer = 2.0 * k * row;
    o->a2a_cross_token_layer = o->a2a_token_layer * (N - 1) / N;
    o->counts_layer = (double)N * (E + 2) * 4.0;
    /* memory traffic of a step */
    const double tokens = (double)N * B;
    o->active_experts_rank = E ? o->experts_rank_max * (1.0 - pow(1.0 - (double)k / E, tokens)) : 0;
    const double dsz = (double)kern_dtype_size(in->dtype);
    const double embed_read = c->tie_word_embeddings ? o->embed_bytes
                                                     : (double)B * c->hidden_size * dsz;
    const double weights = o->replicated_bytes - o->embed_bytes + embed_read +
                           (double)o->n_moe * o->active_experts_rank * o->one_expert_bytes;
    const double recurrent = (double)st.kda_state + (double)st.conv_state;
    const double states = (double)B * (2.0 * recurrent + o->state_per_token * (double)in->context);
    o->hbm_step_bytes = weights + states;
    o->t_hbm = o->hbm_step_bytes / (h->hbm_gbs * 1e9);
    /* links: a rank's share of the others on its node and elsewhere */
    const int rpn = h->ranks_per_node < N ? h->ranks_per_node : N;
    const double intra = (double)(rpn - 1) / N, inter = (double)(N - rpn) / N;
    const double a2a_out = (double)B * k * row; /* one all-to-all, out of one rank */
    const double t_a2a = fmax(a2a_out * intra / (h->nvlink_gbs * 1e9),
                              a2a_out * inter / (h->net_gbs * 1e9)) + h->latency_us * 1e-6;
    const double link = N > rpn ? h->net_gbs : h->nvlink_gbs; /* the slowest way in or out */
    const double t_counts = o->counts_layer / (link * 1e9) + h->latency_us * 1e-6;
    double t_comm = 0, net = 0;
    if (N > 1) {
        t_comm = o->n_moe * (2.0 * t_a2a + t_counts);
        /* per pass: the command broadcast, the status all-gather, the logits into rank 0 */
        const double logits_in = (double)(N - 1) * B * c->vocab_size * 4.0;
        t_comm += 3.0 * h->latency_us * 1e-6 + logits_in / (link * 1e9);
        net = o->n_moe * (2.0 * a2a_out * (N - 1) / N + o->counts_layer);
    }
    o->net_step_bytes = net;
    o->t_comm = t_comm;
    o->t_step = o->t_hbm + o->t_comm;
    o->tok_s_session = 1.0 / o->t_step;
    o->tok_s_rank = B / o->t_step;
    o->tok_s_job = tokens / o->t_step;
    o->mem_rank_bytes = o->rank_weight_bytes + (double)B * o->state_session;
    o->fits = o->mem_rank_bytes <= h->mem_gb * 1e9;
    return KDS_OK;
}
