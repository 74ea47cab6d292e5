/*
 * eng_genmodel.c - named preset configs and seeded random Kimi-Linear
 * checkpoints (see eng_genmodel.h for the format and the initialisation).
 */
#include "eng_genmodel.h"
#include "eng_model.h"
#include "eng_plan.h"
#include "eng_pool.h"
#include "eng_progress.h"

#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "eng.h"
#include "eng_safetensors.h"

/* A single model.safetensors up to this size; above it, shards of at most
 * this size (one tensor larger than it gets a shard of its own). */
#define GEN_SHARD_BYTES ((uint64_t)4 << 30)
/* More tensors than this is a config mistake, not a model to write. */
#define GEN_MAX_TENSORS ((size_t)4 << 20)
/* Tensors with at least this many elements are filled by several threads. */
#define GEN_PARALLEL_MIN ((size_t)1 << 20)
#define GEN_MAX_THREADS 16

/* ------------------------------------------------------------------------ */
/* Presets                                                                   */

static const char *const PRESET_NAMES[] = {
    "tiny", "tiny-hybrid", "llamacpp-tiny", "kimi-linear-48b", "wide", "full27", "state48b",
    "k3-micro", "k3", NULL};

const char *const *eng_genmodel_preset_names(void) {
    return PRESET_NAMES;
}

/* Fields every preset shares (those of the real 48B config). */
static void preset_common(eng_config *c) {
    memset(c, 0, sizeof *c);
    c->rms_norm_eps = 1e-5f;
    c->tie_word_embeddings = false;
    c->model_max_length = 1048576;
    snprintf(c->torch_dtype, sizeof c->torch_dtype, "bfloat16");
    c->short_conv_kernel_size = 4;
    c->mla_use_nope = true;
    c->q_lora_rank = 0;
    c->first_k_dense_replace = 1;
    c->moe_layer_freq = 1;
    c->moe_renormalize = true;
    c->routed_scaling_factor = 2.446f;
    c->use_grouped_topk = true;
    c->num_expert_group = 1;
    c->topk_group = 1;
    snprintf(c->moe_router_activation_func, sizeof c->moe_router_activation_func, "sigmoid");
}

/* Layer kinds from a string, one letter a layer: 'K' KDA, 'M' MLA. */
static void preset_layers(eng_config *c, const char *kinds) {
    c->num_hidden_layers = (int)strlen(kinds);
    for (int l = 0; l < c->num_hidden_layers; l++)
        c->layer_kind[l] = kinds[l] == 'M' ? ENG_LAYER_MLA : ENG_LAYER_KDA;
}

/* The 48B's MLA widths. */
static void preset_mla_48b(eng_config *c) {
    c->num_attention_heads = 32;
    c->kv_lora_rank = 512;
    c->qk_nope_head_dim = 128;
    c->qk_rope_head_dim = 64;
    c->v_head_dim = 128;
}

/* Real special ids where the vocabulary has them; else the byte
 * tokenizer's <|bos|>/<|eos|> (256, 257) and the last id as padding. */
static void preset_ids(eng_config *c) {
    if (c->vocab_size >= 163840) {
        c->bos_token_id = 163584; /* [BOS] */
        c->eos_token_id = 163586; /* <|im_end|> */
        c->pad_token_id = 163839; /* [PAD] */
    } else {
        c->bos_token_id = 256;
        c->eos_token_id = 257;
        c->pad_token_id = c->vocab_size - 1;
    }
}

static void preset_tiny(eng_config *c, const char *layers) {
    preset_common(c);
    preset_layers(c, layers);
    c->vocab_size = 512;
    c->hidden_size = 256;
    c->intermediate_size = 512;
    c->kda_num_heads = c->kda_num_v_heads = 4;
    c->kda_head_dim = c->kda_v_head_dim = 64;
    c->num_attention_heads = 4;
    c->kv_lora_rank = 64;
    c->qk_nope_head_dim = 32;
    c->qk_rope_head_dim = 16;
    c->v_head_dim = 32;
    c->num_experts = 8;
    c->num_experts_per_token = 2;
    c->num_shared_experts = 1;
    c->moe_intermediate_size = 128;
}

static void preset_48b(eng_config *c, const char *layers, int experts) {
    preset_common(c);
    preset_layers(c, layers);
    c->vocab_size = 163840;
    c->hidden_size = 2304;
    c->intermediate_size = 9216;
    c->kda_num_heads = c->kda_num_v_heads = 32;
    c->kda_head_dim = c->kda_v_head_dim = 128;
    preset_mla_48b(c);
    c->num_experts = experts;
    c->num_experts_per_token = 8;
    c->num_shared_experts = 1;
    c->moe_intermediate_size = 1024;
}

/* Kimi K3's text model (reference/kimi-k3.md §2), at its real sizes or
 * scaled down: everything K3 switches on (SiTU, Block AttnRes, latent MoE,
 * the bounded and full-rank KDA gates, MLA's q-LoRA and output gate, MXFP4
 * routed experts). */
static void preset_k3_common(eng_config *c) {
    preset_common(c);
    c->family = ENG_FAMILY_KIMI_K3;
    c->hidden_act = ENG_ACT_SITU;
    c->situ_beta = 4.0f;
    c->situ_linear_beta = 25.0f;
    c->mla_use_output_gate = true;
    c->use_full_rank_gate = true;
    c->has_gate_lower_bound = true;
    c->gate_lower_bound = -5.0f;
    c->latent_moe_use_norm = true;
    c->routed_scaling_factor = 1.0f;
    c->experts_mxfp4 = true;
}

static void preset_k3(eng_config *c) {
    preset_k3_common(c);
    /* MLA at 1-based layers 4, 8, ..., 92 and 93: 0-based 3, 7, ..., 91, 92 */
    char kinds[94];
    for (int l = 0; l < 93; l++) kinds[l] = (l % 4 == 3 || l == 92) ? 'M' : 'K';
    kinds[93] = '\0';
    preset_layers(c, kinds);
    c->vocab_size = 163840;
    c->hidden_size = 7168;
    c->intermediate_size = 33792;
    c->kda_num_heads = c->kda_num_v_heads = 96;
    c->kda_head_dim = c->kda_v_head_dim = 128;
    c->num_attention_heads = 96;
    c->q_lora_rank = 1536;
    c->kv_lora_rank = 512;
    c->qk_nope_head_dim = 128;
    c->qk_rope_head_dim = 64;
    c->v_head_dim = 128;
    c->attn_res_block_size = 12;
    c->num_experts = 896;
    c->num_experts_per_token = 16;
    c->num_shared_experts = 2;
    c->moe_intermediate_size = 3072;
    c->latent_size = 3584;
}

/* Small widths, 6 layers in blocks of 2 (three snapshots roll over), one
 * MLA layer, shapes the GPU kernels take (K = 64, kv_lora_rank 64). */
static void preset_k3_micro(eng_config *c) {
    preset_k3_common(c);
    preset_layers(c, "KKKMKK");
    c->vocab_size = 512;
    c->hidden_size = 256;
    c->intermediate_size = 512;
    c->kda_num_heads = c->kda_num_v_heads = 4;
    c->kda_head_dim = c->kda_v_head_dim = 64;
    c->num_attention_heads = 4;
    c->q_lora_rank = 64;
    c->kv_lora_rank = 64;
    c->qk_nope_head_dim = 32;
    c->qk_rope_head_dim = 16;
    c->v_head_dim = 32;
    c->attn_res_block_size = 2;
    c->num_experts = 16;
    c->num_experts_per_token = 4;
    c->num_shared_experts = 2;
    c->moe_intermediate_size = 64;
    c->latent_size = 128;
}

kds_status eng_genmodel_preset(const char *name, eng_config *out, kds_err *err) {
    eng_config c;
    /* 48B layout: MLA at 1-based layers 4, 8, ..., 24 and 27 */
    const char *layout27 = "KKKMKKKMKKKMKKKMKKKMKKKMKKM";
    if (!name) name = "";
    if (strcmp(name, "tiny") == 0) {
        preset_tiny(&c, "KKKK");
    } else if (strcmp(name, "tiny-hybrid") == 0) {
        preset_tiny(&c, "KKMK");
    } else if (strcmp(name, "llamacpp-tiny") == 0) {
        preset_tiny(&c, "KKKM");
        c.vocab_size = 50304;
        c.kv_lora_rank = 128;
        c.qk_nope_head_dim = 64;
        c.qk_rope_head_dim = 64;
        c.v_head_dim = 64;
    } else if (strcmp(name, "kimi-linear-48b") == 0) {
        preset_48b(&c, layout27, 256);
    } else if (strcmp(name, "wide") == 0) {
        preset_48b(&c, "KKKM", 32);
    } else if (strcmp(name, "full27") == 0) {
        preset_48b(&c, layout27, 16);
    } else if (strcmp(name, "k3") == 0) {
        preset_k3(&c);
    } else if (strcmp(name, "k3-micro") == 0) {
        preset_k3_micro(&c);
    } else if (strcmp(name, "state48b") == 0) {
        /* The 48B's recurrent state (20 KDA layers of 32 x 128 x 128, conv
         * width 4: the same fixed state bytes) behind small everything else,
         * so snapshot benchmarks move real-sized states without 100 GB of
         * weights. */
        preset_tiny(&c, "KKKKKKKKKKKKKKKKKKKK");
        c.hidden_size = 128;
        c.kda_num_heads = c.kda_num_v_heads = 32;
        c.kda_head_dim = c.kda_v_head_dim = 128;
        c.num_experts = 4;
        c.moe_intermediate_size = 64;
        c.intermediate_size = 256;
    } else {
        char known[160] = "";
        for (const char *const *p = PRESET_NAMES; *p; p++)
            snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s",
                     p == PRESET_NAMES ? "" : ", ", *p);
        return kds_err_set(err, KDS_NOT_FOUND, "unknown model preset '%s' (known: %s)", name,
                           known);
    }
    c.num_key_value_heads = c.num_attention_heads;
    c.head_dim = c.hidden_size / c.num_attention_heads; /* legacy field: 2304/32 = 72 */
    preset_ids(&c);
    /* Derived fields (counts, is_moe) and the checks come from the parser,
     * so a preset is exactly what its config.json will load as. */
    char *json = eng_config_to_json(&c);
    if (!json) return kds_err_set(err, KDS_NOMEM, "out of memory building preset '%s'", name);
    kds_status rc = eng_config_parse(json, strlen(json), name, out, err);
    free(json);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* The tensor list                                                           */

/* Which part of a weight a written tensor is: the whole (its elements in
 * the writer's dtype), or a block-format weight's codes or scales (two
 * tensors NAME_packed / NAME_scale, or NAME / NAME_scale for Q8_0). */
typedef enum gen_part {
    GEN_WHOLE = 0,
    GEN_CODES = 1,
    GEN_SCALES = 2,
} gen_part;

/* A tensor to write: the plan's listing (eng__plan_tensors) plus its
 * random stream. */
typedef struct gen_tensor {
    char name[172];
    int n_dims;
    int64_t shape[4];     /* as written (a part: [rows, its bytes per row]) */
    size_t n_elems;
    eng_init init;
    float a, b;
    uint64_t stream;      /* RNG key of the weight (a part shares its weight's) */
    gen_part part;
    kern_dtype fmt;       /* a part's block format */
    int64_t rows, cols;   /* a part's weight */
} gen_tensor;

typedef struct gen_list {
    gen_tensor *t;
    size_t n, cap;
    uint64_t seed;
} gen_list;

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* eng_tensor_fn: one listed tensor, in the shape Hugging Face writes; a
 * block-format weight as its two tensors (the values are those the plain
 * weight would have, quantised: one stream, keyed by the weight's name). */
static void add_tensor(void *user, const eng_tensor_spec *s) {
    gen_list *g = user;
    const bool block = s->matrix && kern_dtype_is_block(s->quant);
    if (g->n + (block ? 2 : 1) > g->cap) return; /* sized from the same list: cannot happen */
    gen_tensor *t = &g->t[g->n++];
    snprintf(t->name, sizeof t->name, "%s", s->name);
    t->n_dims = s->n_dims;
    t->n_elems = 1;
    for (int i = 0; i < s->n_dims; i++) {
        t->shape[i] = s->shape[i];
        t->n_elems *= (size_t)s->shape[i];
    }
    t->init = s->init;
    t->a = s->a;
    t->b = s->b;
    t->stream = mix64(g->seed ^ XXH3_64bits(t->name, strlen(t->name)));
    if (!block) return;
    const kern_layout l = kern_weight_layout(s->quant, s->shape[0], s->shape[1]);
    gen_tensor *sc = &g->t[g->n++];
    *sc = *t;
    t->part = GEN_CODES;
    sc->part = GEN_SCALES;
    t->fmt = sc->fmt = s->quant;
    t->rows = sc->rows = s->shape[0];
    t->cols = sc->cols = s->shape[1];
    t->shape[1] = (int64_t)l.row_bytes;
    t->n_elems = l.data_bytes;
    sc->shape[1] = s->shape[1] / KERN_BLOCK;
    sc->n_elems = (size_t)sc->shape[0] * sc->shape[1];
    if (s->quant == KERN_MXFP4) snprintf(t->name, sizeof t->name, "%s_packed", s->name);
    snprintf(sc->name, sizeof sc->name, "%s_scale", s->name);
}

/* Block pairs count twice among the written tensors. */
static void count_written(void *user, const eng_tensor_spec *s) {
    *(size_t *)user += s->matrix && kern_dtype_is_block(s->quant) ? 2 : 1;
}

/* Bytes of a written tensor (a part's are single bytes, or f16 scales). */
static uint64_t gen_bytes(const gen_tensor *t, kern_dtype dt) {
    if (t->part == GEN_WHOLE) return (uint64_t)t->n_elems * kern_dtype_size(dt);
    const kern_layout l = kern_weight_layout(t->fmt, t->rows, t->cols);
    return t->part == GEN_CODES ? l.data_bytes : l.scale_bytes;
}

/* Every tensor of the config, in HF's module order. */
static void list_all(gen_list *g, const eng_config *c) { eng__plan_tensors(c, NULL, add_tensor, g); }

/* ------------------------------------------------------------------------ */
/* Values                                                                    */

static float sample(const gen_tensor *t, size_t i) {
    /* splitmix64 in counter form: element i of the tensor's stream */
    uint64_t r = mix64(t->stream + (uint64_t)(i + 1) * 0x9e3779b97f4a7c15ull);
    double u = (double)(r >> 40) * (1.0 / 16777216.0); /* U[0, 1), 24 bits */
    switch (t->init) {
    case ENG_INIT_NORMAL: return kern_gen_normal(t->stream, i, t->a); /* also on the GPU */
    case ENG_INIT_UNIFORM: return (float)(t->a + (t->b - t->a) * u);
    case ENG_INIT_A_LOG: return (float)log(1.0 + 15.0 * u);
    case ENG_INIT_DT_BIAS: {
        double dt = exp(log(1e-3) + u * (log(1e-1) - log(1e-3)));
        return (float)(dt + log(-expm1(-dt)));
    }
    }
    return 0.0f;
}

/* Rows [r0, r1) of a block-format weight's codes or scales: each row's
 * values made as the plain weight's, then quantised (kern_quantize_row). */
static void fill_part(const gen_tensor *t, void *buf, size_t r0, size_t r1) {
    const kern_layout l = kern_weight_layout(t->fmt, t->rows, t->cols);
    float *row = malloc((size_t)t->cols * sizeof *row);
    unsigned char *codes = malloc(l.row_bytes + 1), *scales = malloc(l.scale_row_bytes + 1);
    if (row && codes && scales)
        for (size_t r = r0; r < r1; r++) {
            for (int64_t c = 0; c < t->cols; c++)
                row[c] = sample(t, (size_t)r * (size_t)t->cols + (size_t)c);
            kern_quantize_row(t->fmt, row, (int)t->cols, codes, scales);
            if (t->part == GEN_CODES)
                memcpy((unsigned char *)buf + r * l.row_bytes, codes, l.row_bytes);
            else
                memcpy((unsigned char *)buf + r * l.scale_row_bytes, scales, l.scale_row_bytes);
        }
    free(row);
    free(codes);
    free(scales);
}

static void fill_range(const gen_tensor *t, kern_dtype dt, void *buf, size_t i0, size_t i1) {
    if (t->part != GEN_WHOLE) {
        fill_part(t, buf, i0, i1);
    } else if (dt == KERN_F32) {
        float *o = buf;
        for (size_t i = i0; i < i1; i++)
            o[i] = sample(t, i);
    } else if (dt == KERN_BF16) {
        uint16_t *o = buf;
        for (size_t i = i0; i < i1; i++)
            o[i] = kern_f32_to_bf16(sample(t, i));
    } else {
        uint16_t *o = buf;
        for (size_t i = i0; i < i1; i++)
            o[i] = kern_f32_to_f16(sample(t, i));
    }
}

typedef struct fill_job {
    const gen_tensor *t;
    kern_dtype dt;
    void *buf;
    size_t i0, i1;
} fill_job;

static void *fill_thread(void *arg) {
    fill_job *j = arg;
    fill_range(j->t, j->dt, j->buf, j->i0, j->i1);
    return NULL;
}

typedef struct writer {
    const gen_tensor *first; /* tensors of the shard being written */
    kern_dtype dt;
    int n_threads;
    eng_progress line; /* bytes of all shards */
} writer;

/* eng_st_fill_fn: values of tensor `index` of the current shard. */
static kds_status fill(void *user, size_t index, void *buf, size_t n_bytes, kds_err *err) {
    writer *w = user;
    const gen_tensor *t = &w->first[index];
    size_t n = t->part == GEN_WHOLE ? t->n_elems : (size_t)t->rows; /* a part: by rows */
    int nt = n >= GEN_PARALLEL_MIN ? w->n_threads : 1;
    pthread_t th[GEN_MAX_THREADS];
    fill_job jobs[GEN_MAX_THREADS];
    int started = 0;
    for (int k = 0; k < nt; k++) {
        jobs[k] =
            (fill_job){t, w->dt, buf, n * (size_t)k / (size_t)nt, n * (size_t)(k + 1) / (size_t)nt};
        /* job 0 runs here; if a thread cannot start its slice runs here too */
        if (k == 0 || pthread_create(&th[k], NULL, fill_thread, &jobs[k]) != 0)
            fill_thread(&jobs[k]);
        else
            started |= 1 << k;
    }
    for (int k = 1; k < nt; k++)
        if (started & (1 << k)) pthread_join(th[k], NULL);
    eng_progress_add(&w->line, n_bytes);
    (void)err;
    return KDS_OK;
}

/* ------------------------------------------------------------------------ */
/* Files                                                                     */


static kds_status make_dirs(const char *path, kds_err *err) {
    char *p = strdup(path);
    if (!p) return kds_err_set(err, KDS_NOMEM, "out of memory creating %s", path);
    kds_status rc = KDS_OK;
    for (char *s = p + 1; *s && rc == KDS_OK; s++) {
        if (*s != '/') continue;
        *s = '\0';
        if (mkdir(p, 0755) != 0 && errno != EEXIST)
            rc = kds_err_set(err, KDS_IO, "mkdir %s: %s", p, strerror(errno));
        *s = '/';
    }
    if (rc == KDS_OK && mkdir(p, 0755) != 0 && errno != EEXIST)
        rc = kds_err_set(err, KDS_IO, "mkdir %s: %s", p, strerror(errno));
    free(p);
    return rc;
}

/* Write `text` to dir/name through a temporary file and a rename. */
static kds_status write_text(const char *dir, const char *name, const char *text, kds_err *err) {
    kds_status rc = KDS_OK;
    char *path = eng__path_join(dir, name);
    size_t cap = path ? strlen(path) + 48 : 0;
    char *tmp = path ? malloc(cap) : NULL;
    if (!tmp) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory writing %s", name);
        goto out;
    }
    /* pid and a stack address: unique among processes and threads */
    snprintf(tmp, cap, "%s.tmp.%ld.%lx", path, (long)getpid(), (unsigned long)(uintptr_t)&cap);
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        rc = kds_err_set(err, KDS_IO, "%s: %s", tmp, strerror(errno));
        goto out;
    }
    size_t n = strlen(text);
    bool ok = fwrite(text, 1, n, f) == n && fputc('\n', f) != EOF;
    if (fclose(f) != 0) ok = false;
    if (!ok) {
        rc = kds_err_set(err, KDS_IO, "%s: write failed", tmp);
        unlink(tmp);
        goto out;
    }
    if (rename(tmp, path) != 0) {
        rc = kds_err_set(err, KDS_IO, "rename %s -> %s: %s", tmp, path, strerror(errno));
        unlink(tmp);
    }
out:
    free(tmp);
    free(path);
    return rc;
}

static void remove_file(const char *dir, const char *name) {
    char *p = eng__path_join(dir, name);
    if (p) unlink(p);
    free(p);
}

static eng_st_dtype st_dtype(kern_dtype dt) {
    return dt == KERN_F32 ? ENG_ST_F32 : dt == KERN_BF16 ? ENG_ST_BF16 : ENG_ST_F16;
}

static const char *torch_name(kern_dtype dt) {
    return dt == KERN_F32 ? "float32" : dt == KERN_BF16 ? "bfloat16" : "float16";
}

/* One shard: tensors [begin, end) of the list into dir/name. */
static kds_status write_shard(writer *w, const gen_tensor *t, size_t begin, size_t end,
                              const char *dir, const char *name, kds_err *err) {
    static const char *const metadata[] = {"format", "pt", NULL};
    size_t n = end - begin;
    eng_st_out_tensor *out = calloc(n ? n : 1, sizeof *out);
    char *path = eng__path_join(dir, name);
    kds_status rc = KDS_OK;
    if (!out || !path) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory writing %s", name);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        const gen_tensor *g = &t[begin + i];
        out[i].name = g->name;
        out[i].dtype = g->part == GEN_WHOLE ? st_dtype(w->dt)
                       : g->fmt == KERN_Q8_0 ? (g->part == GEN_CODES ? ENG_ST_I8 : ENG_ST_F16)
                                             : ENG_ST_U8;
        out[i].n_dims = g->n_dims;
        for (int d = 0; d < g->n_dims; d++)
            out[i].shape[d] = g->shape[d];
        out[i].data = NULL;
    }
    w->first = &t[begin];
    rc = eng_st_write_stream(path, out, n, metadata, fill, w, err);
out:
    free(path);
    free(out);
    return rc;
}

/* model.safetensors.index.json for shards cut at `cuts` (n_shards + 1). */
static kds_status write_index(const gen_tensor *t, const size_t *cuts, int n_shards, uint64_t total,
                              const char *dir, kds_err *err) {
    kds_status rc = KDS_OK;
    char *text = NULL;
    cJSON *root = cJSON_CreateObject();
    cJSON *md = root ? cJSON_AddObjectToObject(root, "metadata") : NULL;
    cJSON *wm = root ? cJSON_AddObjectToObject(root, "weight_map") : NULL;
    if (!md || !wm) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory writing the index");
        goto out;
    }
    cJSON_AddNumberToObject(md, "total_size", (double)total);
    for (int s = 0; s < n_shards; s++) {
        char name[64];
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, n_shards);
        for (size_t i = cuts[s]; i < cuts[s + 1]; i++)
            if (!cJSON_AddStringToObject(wm, t[i].name, name)) {
                rc = kds_err_set(err, KDS_NOMEM, "out of memory writing the index");
                goto out;
            }
    }
    text = cJSON_Print(root);
    if (!text) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory writing the index");
        goto out;
    }
    rc = write_text(dir, "model.safetensors.index.json", text, err);
out:
    free(text);
    cJSON_Delete(root);
    return rc;
}

kds_status eng_genmodel_write(const eng_config *c, uint64_t seed, kern_dtype dtype,
                              const char *out_dir, bool progress, kds_err *err) {
    return eng__genmodel_write_sharded(c, seed, dtype, out_dir, progress, GEN_SHARD_BYTES, err);
}

kds_status eng__genmodel_write_sharded(const eng_config *c, uint64_t seed, kern_dtype dtype,
                                       const char *out_dir, bool progress, uint64_t shard_bytes,
                                       kds_err *err) {
    kds_status rc = KDS_OK;
    char *json = NULL;
    gen_list g = {NULL, 0, 0, seed};
    size_t *cuts = NULL;
    writer w = {.dt = dtype}; /* its progress line off until the writing starts */
    eng_config cfg;
    if (!c || !out_dir || !out_dir[0])
        return kds_err_set(err, KDS_INVALID_ARG, "eng_genmodel_write: no config or directory");
    if (dtype != KERN_F32 && dtype != KERN_BF16 && dtype != KERN_F16)
        return kds_err_set(err, KDS_INVALID_ARG, "eng_genmodel_write: unknown dtype %d",
                           (int)dtype);

    /* Check the config exactly as the loader will read it back. */
    eng_config want = *c;
    snprintf(want.torch_dtype, sizeof want.torch_dtype, "%s", torch_name(dtype));
    json = eng_config_to_json(&want);
    if (!json) return kds_err_set(err, KDS_NOMEM, "out of memory writing %s", out_dir);
    if ((rc = eng_config_parse(json, strlen(json), "generated config", &cfg, err)) != KDS_OK)
        goto out;

    size_t n = 0;
    eng__plan_tensors(&cfg, NULL, count_written, &n);
    if (n > GEN_MAX_TENSORS) {
        rc = kds_err_set(err, KDS_TOO_LARGE, "%zu tensors is too many to generate (max %zu)", n,
                         GEN_MAX_TENSORS);
        goto out;
    }
    g.t = calloc(n, sizeof *g.t);
    if (!g.t) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory listing %zu tensors", n);
        goto out;
    }
    g.cap = n;
    list_all(&g, &cfg);
    if (g.n != n) {
        rc = kds_err_set(err, KDS_INTERNAL, "listed %zu tensors, expected %zu", g.n, n);
        goto out;
    }

    /* Plan the shards: greedy, in order, at most shard_bytes each. */
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) total += gen_bytes(&g.t[i], dtype);
    cuts = calloc(n + 2, sizeof *cuts);
    if (!cuts) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory planning shards");
        goto out;
    }
    int n_shards = 1;
    if (total > shard_bytes) {
        uint64_t cur = 0;
        n_shards = 0;
        for (size_t i = 0; i < n; i++) {
            uint64_t b = gen_bytes(&g.t[i], dtype);
            if (i == 0 || (cur > 0 && cur + b > shard_bytes)) {
                cuts[n_shards++] = i;
                cur = 0;
            }
            cur += b;
        }
        if (n_shards > 99999) {
            rc = kds_err_set(err, KDS_TOO_LARGE, "%d shards is too many", n_shards);
            goto out;
        }
    }
    cuts[n_shards] = n;

    if ((rc = make_dirs(out_dir, err)) != KDS_OK) goto out;
    w.n_threads = eng_cpus_online(GEN_MAX_THREADS);
    eng_progress_start(&w.line, progress ? stderr : NULL, total, "writing %s", out_dir);
    if (n_shards == 1) {
        rc = write_shard(&w, g.t, 0, n, out_dir, "model.safetensors", err);
        if (rc != KDS_OK) goto out;
        remove_file(out_dir, "model.safetensors.index.json"); /* a stale index */
    } else {
        for (int s = 0; s < n_shards; s++) {
            char name[64];
            snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, n_shards);
            rc = write_shard(&w, g.t, cuts[s], cuts[s + 1], out_dir, name, err);
            if (rc != KDS_OK) goto out;
        }
        rc = write_index(g.t, cuts, n_shards, total, out_dir, err);
        if (rc != KDS_OK) goto out;
        /* the loader prefers model.safetensors: a stale one would win */
        remove_file(out_dir, "model.safetensors");
    }
    eng_progress_finish(&w.line);
    rc = write_text(out_dir, "config.json", json, err);
out:
    if (rc != KDS_OK) eng_progress_abandon(&w.line);
    free(cuts);
    free(g.t);
    free(json);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Describe                                                                  */

/* 49122681728 -> "49,122,681,728" */
static const char *grouped(size_t v, char *buf, size_t cap) {
    char raw[32];
    snprintf(raw, sizeof raw, "%zu", v);
    size_t n = strlen(raw), o = 0;
    for (size_t i = 0; i < n && o + 2 < cap; i++) {
        if (i > 0 && (n - i) % 3 == 0) buf[o++] = ',';
        buf[o++] = raw[i];
    }
    buf[o] = '\0';
    return buf;
}

static const char *human(double bytes, char *buf, size_t cap) {
    const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (bytes >= 1024.0 && u < 4) {
        bytes /= 1024.0;
        u++;
    }
    snprintf(buf, cap, u ? "%.2f %s" : "%.0f %s", bytes, unit[u]);
    return buf;
}

void eng_genmodel_describe(const eng_config *c, FILE *f) {
    char a[48], b[48], d[48];
    int L = c->num_hidden_layers, n_dense = 0;
    for (int l = 0; l < L; l++)
        n_dense += !c->layer_is_moe[l];
    fprintf(f, "layers:      %d (%d KDA, %d MLA; %d dense, %d MoE)", L, c->n_kda_layers,
            c->n_mla_layers, n_dense, L - n_dense);
    if (L <= 8) {
        fprintf(f, ":");
        for (int l = 0; l < L; l++)
            fprintf(f, "%s %s+%s", l ? "," : "", eng_layer_kind_name(c->layer_kind[l]),
                    c->layer_is_moe[l] ? "MoE" : "dense");
    }
    fprintf(f, "\nwidths:      hidden %d, vocab %d, dense FFN %d\n", c->hidden_size, c->vocab_size,
            c->intermediate_size);
    if (c->n_kda_layers)
        fprintf(f, "KDA:         %d q/k heads, %d v heads, head dim %d, conv %d, %s gate\n",
                c->kda_num_heads, c->kda_num_v_heads, c->kda_head_dim, c->short_conv_kernel_size,
                c->has_gate_lower_bound ? "lower-bound" : "softplus");
    if (c->n_mla_layers)
        fprintf(f,
                "MLA:         %d heads, kv_lora_rank %d, q_lora_rank %d, nope %d, rope %d, "
                "v %d\n",
                c->num_attention_heads, c->kv_lora_rank, c->q_lora_rank, c->qk_nope_head_dim,
                c->qk_rope_head_dim, c->v_head_dim);
    if (c->num_experts) {
        fprintf(f, "MoE:         %d experts, top-%d, %d shared, width %d", c->num_experts,
                c->num_experts_per_token, c->num_shared_experts, c->moe_intermediate_size);
        if (c->latent_size)
            fprintf(f, ", routed in a %d-wide latent%s", c->latent_size,
                    c->latent_moe_use_norm ? " (normed)" : "");
        fprintf(f, "%s\n", c->experts_mxfp4 ? ", MXFP4 experts" : "");
    }
    if (c->family == ENG_FAMILY_KIMI_K3)
        fprintf(f, "checkpoint:  Kimi K3 (kimi_k3: text model from text_config, tensors under "
                   "language_model.)%s\n",
                c->has_vision ? "; the vision tower is not loaded (text only)" : "");
    if (c->hidden_act == ENG_ACT_SITU)
        fprintf(f, "activation:  SiTU (beta %g, linear beta %g)\n", (double)c->situ_beta,
                (double)c->situ_linear_beta);
    if (c->attn_res_block_size)
        fprintf(f, "residuals:   Block Attention Residuals, blocks of %d layers (%d snapshots + the "
                   "partial)\n",
                c->attn_res_block_size,
                (c->num_hidden_layers + c->attn_res_block_size - 1) / c->attn_res_block_size);
    if (c->use_full_rank_gate || c->mla_use_output_gate)
        fprintf(f, "gates:       %s%s%s\n", c->use_full_rank_gate ? "KDA full-rank output gate" : "",
                c->use_full_rank_gate && c->mla_use_output_gate ? ", " : "",
                c->mla_use_output_gate ? "MLA sigmoid output gate" : "");
    const bool f32 = strcmp(c->torch_dtype, "float32") == 0;
    const eng_plan_sizes z = eng__plan_sizes(c, f32 ? KERN_F32 : KERN_BF16);
    fprintf(f, "tensors:     %s\n", grouped(eng_config_tensor_count(c), a, sizeof a));
    fprintf(f, "parameters:  %s (%s active per token)\n", grouped(z.params, a, sizeof a),
            grouped(z.active, b, sizeof b));
    fprintf(f, "bytes:       %s (%s as %s", grouped(z.bytes, a, sizeof a),
            human((double)z.bytes, b, sizeof b), c->torch_dtype[0] ? c->torch_dtype : "bfloat16");
    if (c->experts_mxfp4)
        fprintf(f, ", routed experts MXFP4: %s", human((double)z.expert_bytes, d, sizeof d));
    fprintf(f, ")\n");
    eng_state_size s = eng_config_state_size(c);
    fprintf(f, "state/seq:   %s fixed (KDA state %s, conv %s)", human((double)s.fixed, a, sizeof a),
            human((double)s.kda_state, b, sizeof b), human((double)s.conv_state, d, sizeof d));
    if (s.per_token)
        fprintf(f, " + %zu B/token (%s at 128K tokens)", s.per_token,
                human((double)s.fixed + (double)s.per_token * 131072.0, a, sizeof a));
    fprintf(f, "\n");
}

/* ------------------------------------------------------------------------ */
/* The same model without files: eng__genmodel_tensors                      */

kds_status eng__genmodel_tensors(const eng_config *c, uint64_t seed, eng_gen_tensor **out,
                                 size_t *n_out, kds_err *err) {
    *out = NULL;
    *n_out = 0;
    /* as written: a block-format weight is its two tensors */
    size_t n = 0;
    eng__plan_tensors(c, NULL, count_written, &n);
    if (n > GEN_MAX_TENSORS)
        return kds_err_set(err, KDS_TOO_LARGE, "%zu tensors is too many to generate (max %zu)", n,
                           GEN_MAX_TENSORS);
    gen_list g = {calloc(n ? n : 1, sizeof(gen_tensor)), 0, n, seed};
    eng_gen_tensor *t = calloc(n ? n : 1, sizeof *t);
    kds_status rc = KDS_OK;
    if (!g.t || !t) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory listing %zu tensors", n);
        goto out;
    }
    list_all(&g, c);
    if (g.n != n) {
        rc = kds_err_set(err, KDS_INTERNAL, "listed %zu tensors, expected %zu", g.n, n);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        const gen_tensor *s = &g.t[i];
        eng_gen_tensor *d = &t[i];
        d->name = strdup(s->name);
        d->n_dims = s->n_dims;
        memcpy(d->shape, s->shape, sizeof d->shape);
        d->n_elems = s->n_elems;
        d->key = s->stream;
        d->sd = s->a;
        d->block = s->part == GEN_WHOLE ? KERN_F32 : s->fmt;
        d->part = (int)s->part;
        if (!d->name) {
            rc = kds_err_set(err, KDS_NOMEM, "out of memory listing %zu tensors", n);
            goto out;
        }
        /* matrices are left to the device (every one is INIT_NORMAL), the
         * codes and scales of a block-format one too (kern_cuda_gen_quant) */
        if (s->part != GEN_WHOLE || (s->n_dims == 2 && s->init == ENG_INIT_NORMAL)) continue;
        if (!(d->values = malloc(s->n_elems * sizeof(float)))) {
            rc = kds_err_set(err, KDS_NOMEM, "out of memory generating '%s'", s->name);
            goto out;
        }
        fill_range(s, KERN_F32, d->values, 0, s->n_elems);
    }
    *out = t;
    *n_out = n;
    t = NULL;
out:
    eng__genmodel_tensors_free(t, n);
    free(g.t);
    return rc;
}

void eng__genmodel_tensors_free(eng_gen_tensor *t, size_t n) {
    if (!t) return;
    for (size_t i = 0; i < n; i++) {
        free((char *)t[i].name);
        free(t[i].values);
    }
    free(t);
}
