/*
 * eng_plan.h - engine-internal: the layer plan, and the one list of every
 * layer kind's tensors.
 *
 * At load time the config becomes a list of layers (eng_model.layers), each
 * a token mixer (KDA, MLA), a feed-forward kind (dense, MoE) and how the
 * sublayers' inputs are formed (the residual sum), with its weights. Every
 * part of the engine that depends on what a layer is made of reads the
 * plan instead of the config's fields:
 *   - the tensors of each kind are listed once (eng__plan_tensors): the
 *     loader binds them (eng_load.c), the random-model generator writes
 *     them (eng_genmodel.c), the parameter and tensor counts add them up;
 *   - the forward pass runs each layer's mixer and FFN by kind
 *     (eng_forward.c), through a backend (eng_backend.h);
 *   - the per-sequence state is laid out by kind and slot (eng__dims,
 *     eng_state.c).
 * docs/architecture.md ("Adding a layer kind") walks through a new kind.
 *
 * Thread-safety: pure functions of their arguments.
 */
#ifndef ENG_PLAN_H
#define ENG_PLAN_H

#include <stdbool.h>
#include <stdint.h>

#include "eng_config.h"
#include "kds_status.h"
#include "kern.h"

typedef struct eng_model eng_model;
typedef struct eng_weight eng_weight;

/* What layer l of config c is made of. slot: the layer's index among the
 * layers of its mixer kind (the slot of its per-sequence state). */
typedef struct eng_layer_plan {
    eng_layer_kind mixer;
    eng_ffn_kind ffn;
    eng_input_kind input;
    int slot;
} eng_layer_plan;

void eng__plan_layer(const eng_config *c, int l, eng_layer_plan *out);

/* How the generator fills a tensor (eng_genmodel.h says why these). */
typedef enum eng_init {
    ENG_INIT_NORMAL,  /* kern_gen_normal with sd a */
    ENG_INIT_UNIFORM, /* U(a, b) */
    ENG_INIT_A_LOG,   /* log U(1, 16) */
    ENG_INIT_DT_BIAS, /* inverse softplus of exp(U(log 1e-3, log 1e-1)) */
} eng_init;

/* One tensor of a checkpoint, as the plan lists it. */
typedef struct eng_tensor_spec {
    char name[160];
    bool matrix;          /* a 2-D weight read in place; else a small vector widened to f32 */
    int n_dims;
    int64_t shape[4];     /* as written (Hugging Face's layout) */
    int n_dims_alt;       /* > 0: another shape the loader accepts (fla's or llama.cpp's) */
    int64_t shape_alt[4];
    bool optional;        /* may be absent (then the loader leaves it NULL) */
    eng_init init;        /* the generator's values */
    float a, b;
    int expert;           /* a routed expert's matrix: its index in its layer; else -1 */
    kern_dtype quant;     /* a block format the generator writes this matrix in (the
                           * config's experts_mxfp4: KERN_MXFP4); KERN_F32: none, the
                           * writer's element dtype */
    /* Where the loader puts it (NULL when listing without a model). */
    eng_weight *weight;   /* matrix */
    const float **vector; /* vector */
} eng_tensor_spec;

typedef void (*eng_tensor_fn)(void *user, const eng_tensor_spec *t);

/*
 * Every tensor config c implies, in Hugging Face's module order (embedding;
 * per layer: input_layernorm, the mixer's tensors, post_attention_layernorm,
 * the FFN's tensors; final norm; lm_head unless tied), handed to fn one by
 * one. With m (made by eng__plan_alloc for c) the destinations point into
 * its layers, and a tied lm_head is set to the embedding at the end.
 */
void eng__plan_tensors(const eng_config *c, eng_model *m, eng_tensor_fn fn, void *user);

/* A lower bound on the tensors config c implies, in O(layers): one per
 * routed expert of every MoE layer (each has at least one matrix). The
 * loader compares it with the checkpoint's tensor count before listing the
 * plan, whose length a config alone can make tens of millions. */
size_t eng__plan_min_tensors(const eng_config *c);

/* Sizes of config c: parameters (a block-format element counts as one),
 * those one token uses (the top-k of the routed experts; the embedding
 * lookup not counted), and the checkpoint's bytes with the non-block
 * tensors stored as `dt`. */
typedef struct eng_plan_sizes {
    size_t params, active, bytes, expert_bytes;
} eng_plan_sizes;

eng_plan_sizes eng__plan_sizes(const eng_config *c, kern_dtype dt);

/*
 * The plan of m->cfg in m: the layers with their kinds and slots, the
 * experts' weight arrays, the small-vector arena sized for every vector the
 * plan lists, and the weight table. Errors: KDS_NOMEM.
 */
kds_status eng__plan_alloc(eng_model *m, kds_err *err);

/* After binding: a matrix bound by the loader gets the next id. */
void eng__plan_register(eng_model *m, eng_weight *w);

/* After binding: what the forward pass reads that no file holds (the fused
 * AttnRes queries u = res_norm * res_proj, into the arena), and the layout
 * it relies on (a KDA layer's q, k and v conv taps one after another).
 * Errors: KDS_INTERNAL. */
kds_status eng__plan_check(eng_model *m, kds_err *err);

#endif /* ENG_PLAN_H */
