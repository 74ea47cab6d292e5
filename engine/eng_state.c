/*
 * eng_state.c - sequence objects and their flat byte form.
 *
 * Byte form, version 1 (all little-endian; docs/formats.md):
 *   header  128 bytes: magic "KDSSTATE", u32 version, u32 header bytes,
 *           u64 position, u32 n_kda, u32 n_mla, u32 H, HV, K, V, W,
 *           u32 conv_ch, u32 mla_row, u32 vocab, u32 has_logits,
 *           u32 n_recent, u64 rng[4], zero padding
 *   kda     n_kda * HV * K * V f32   recurrent states, [layer, hv, k, v]
 *   conv    n_kda * (W-1) * conv_ch f32  conv tails, oldest first, q|k|v
 *   logits  vocab f32                 logits after the last token
 *   recent  64 i32                    ring of recent tokens
 *   mla     n_mla * position * (dc+dr) f32  latent cache rows [c | k_pe]
 */
#include "kds_le.h"
#include "eng_backend.h"
#include "eng_plan.h"
#include "eng_seq.h"

#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void eng__dims(const eng_config *c, eng_dims *d) {
    memset(d, 0, sizeof *d);
    d->hidden = c->hidden_size;
    d->vocab = c->vocab_size;
    d->H = c->kda_num_heads;
    d->HV = c->kda_num_v_heads ? c->kda_num_v_heads : c->kda_num_heads;
    d->K = c->kda_head_dim;
    d->V = c->kda_v_head_dim ? c->kda_v_head_dim : c->kda_head_dim;
    d->W = c->short_conv_kernel_size;
    d->kda_qk = d->H * d->K;
    d->kda_v = d->HV * d->V;
    d->conv_ch = 2 * d->kda_qk + d->kda_v;
    d->mla_heads = c->num_attention_heads;
    d->dn = c->qk_nope_head_dim;
    d->dr = c->qk_rope_head_dim;
    d->dv = c->v_head_dim;
    d->dc = c->kv_lora_rank;
    d->mla_row = d->dc + d->dr;
    d->n_layers = c->num_hidden_layers;
    /* the plan's state slots: a layer's index among those of its mixer kind */
    for (int l = 0; l < c->num_hidden_layers; l++) {
        eng_layer_plan p;
        eng__plan_layer(c, l, &p);
        d->layer_slot[l] = p.slot;
        switch (p.mixer) { /* a new mixer kind with state gets its count here */
        case ENG_LAYER_KDA: d->n_kda++; break;
        case ENG_LAYER_MLA: d->n_mla++; break;
        }
    }
}

static size_t kda_floats(const eng_dims *d) { return (size_t)d->n_kda * d->HV * d->K * d->V; }
static size_t conv_floats(const eng_dims *d) {
    return (size_t)d->n_kda * (size_t)(d->W > 1 ? d->W - 1 : 0) * d->conv_ch;
}

eng_state_size eng_config_state_size(const eng_config *c) {
    eng_dims d;
    eng__dims(c, &d);
    eng_state_size s;
    s.kda_state = kda_floats(&d) * sizeof(float);
    s.conv_state = conv_floats(&d) * sizeof(float);
    s.fixed = ENG_STATE_HEADER_BYTES + s.kda_state + s.conv_state +
              (size_t)d.vocab * sizeof(float) + ENG_RECENT_TOKENS * sizeof(int32_t);
    s.per_token = (size_t)d.n_mla * d.mla_row * sizeof(float);
    return s;
}

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void eng_seq_reset(eng_seq *s, uint64_t seed) {
    s->pos = 0;
    memset(s->kda_state, 0, kda_floats(&s->d) * sizeof(float));
    memset(s->conv_tail, 0, conv_floats(&s->d) * sizeof(float));
    memset(s->logits, 0, (size_t)s->d.vocab * sizeof(float));
    s->has_logits = 0;
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix64(&x);
    memset(s->recent, 0, sizeof s->recent);
    s->n_recent = 0;
    eng__seq_host_written(s);
}

void eng_seq_reseed(eng_seq *s, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix64(&x);
}

/* Replace the MLA caches with fresh zeroed ones of at least `tokens` rows,
 * or change nothing (KDS_NOMEM). calloc hands out the kernel's zero pages:
 * a row costs memory only once it is written, so the rows a fixed part
 * claims (eng_seq_load_fixed) cost address space until eng_seq_load_mla
 * brings them, not a memset of everything a header says. */
static kds_status fresh_caches(eng_seq *s, int64_t tokens, kds_err *err) {
    int64_t cap = 256;
    while (cap < tokens) cap *= 2;
    const size_t row = (size_t)s->d.mla_row * sizeof(float);
    float **fresh = calloc((size_t)s->d.n_mla + 1, sizeof *fresh);
    bool ok = fresh && (row == 0 || (uint64_t)cap <= SIZE_MAX / row);
    for (int i = 0; ok && i < s->d.n_mla; i++) ok = (fresh[i] = calloc((size_t)cap, row)) != NULL;
    if (!ok) {
        for (int i = 0; fresh && i < s->d.n_mla; i++) free(fresh[i]);
        free(fresh);
        return kds_err_set(err, KDS_NOMEM, "out of memory for the MLA cache of %lld tokens",
                           (long long)tokens);
    }
    for (int i = 0; i < s->d.n_mla; i++) {
        free(s->mla_cache[i]);
        s->mla_cache[i] = fresh[i];
    }
    free(fresh);
    s->mla_cap = cap;
    return KDS_OK;
}

kds_status eng__seq_reserve(eng_seq *s, int64_t tokens, kds_err *err) {
    if (s->d.n_mla == 0 || tokens <= s->mla_cap) return KDS_OK;
    int64_t cap = s->mla_cap ? s->mla_cap : 256;
    while (cap < tokens) cap *= 2;
    size_t row = (size_t)s->d.mla_row * sizeof(float);
    for (int i = 0; i < s->d.n_mla; i++) {
        float *p = realloc(s->mla_cache[i], (size_t)cap * row);
        if (!p)
            return kds_err_set(err, KDS_NOMEM,
                               "out of memory growing the MLA cache to %lld tokens",
                               (long long)cap);
        s->mla_cache[i] = p;
    }
    s->mla_cap = cap;
    return KDS_OK;
}

void eng__seq_push_recent(eng_seq *s, int32_t id) {
    s->recent[(uint32_t)s->n_recent % ENG_RECENT_TOKENS] = id;
    if (s->n_recent < INT32_MAX) s->n_recent++;
}

int eng__seq_penalty_ids(const eng_seq *s, const eng_sampler_params *p, int32_t *out) {
    if (!(p->repeat_penalty > 0.0f && p->repeat_penalty != 1.0f)) return 0;
    int n = s->n_recent < ENG_RECENT_TOKENS ? s->n_recent : ENG_RECENT_TOKENS;
    if (p->repeat_last_n < n) n = p->repeat_last_n > 0 ? p->repeat_last_n : 0;
    for (int i = 0; i < n; i++)
        out[i] = s->recent[((uint32_t)s->n_recent - 1 - (uint32_t)i) % ENG_RECENT_TOKENS];
    return n;
}

int32_t eng__sample_host(eng_seq *s, const eng_sampler_params *p, float *scratch_p,
                         int32_t *scratch_id) {
    /* the recent tokens, newest first, that the repetition penalty looks at */
    int32_t recent[ENG_RECENT_TOKENS];
    const int n = eng__seq_penalty_ids(s, p, recent);
    const kern_sample_params sp = {.temperature = p->temperature, .top_k = p->top_k,
                                   .top_p = p->top_p, .min_p = p->min_p,
                                   .repeat_penalty = p->repeat_penalty};
    /* kern_sample is also the reference of the CUDA sampler */
    return kern_sample(s->logits, s->d.vocab, &sp, recent, n, s->rng, scratch_p, scratch_id);
}

/* Residency: the backend holding the state does the copying. */
kds_status eng__seq_fetch_slow(const eng_seq *s, kds_err *err) {
    /* logically const: the host buffers get the state the sequence has */
    return s->gpu->ops->fetch(s->gpu, (eng_seq *)s, false, err);
}

kds_status eng__seq_fetch_logits_slow(const eng_seq *s, kds_err *err) {
    return s->gpu->ops->fetch(s->gpu, (eng_seq *)s, true, err);
}

void eng__seq_detach(eng_seq *s) {
    if (s->gpu) s->gpu->ops->detach(s->gpu, s);
}

kds_status eng_seq_create(const eng_model *m, uint64_t seed, eng_seq **out, kds_err *err) {
    *out = NULL;
    eng_seq *s = calloc(1, sizeof *s);
    if (!s) goto nomem;
    s->model = m;
    eng__dims(&m->cfg, &s->d);
    s->kda_state = malloc(kda_floats(&s->d) * sizeof(float) + 1);
    s->conv_tail = malloc(conv_floats(&s->d) * sizeof(float) + 1);
    s->logits = malloc((size_t)s->d.vocab * sizeof(float));
    s->mla_cache = calloc((size_t)s->d.n_mla + 1, sizeof *s->mla_cache);
    if (!s->kda_state || !s->conv_tail || !s->logits || !s->mla_cache) goto nomem;
    eng_seq_reset(s, seed);
    *out = s;
    return KDS_OK;
nomem:
    eng_seq_free(s);
    return kds_err_set(err, KDS_NOMEM, "out of memory creating a sequence");
}

void eng_seq_free(eng_seq *s) {
    if (!s) return;
    eng__seq_detach(s);
    if (s->mla_cache)
        for (int i = 0; i < s->d.n_mla; i++) free(s->mla_cache[i]);
    free(s->mla_cache);
    free(s->kda_state);
    free(s->conv_tail);
    free(s->logits);
    free(s);
}

kds_status eng_seq_clone(const eng_seq *s, eng_seq **out, kds_err *err) {
    eng_seq *c;
    kds_status rc = eng__seq_fetch(s, err);
    if (rc != KDS_OK) return rc;
    rc = eng_seq_create(s->model, 0, &c, err);
    if (rc != KDS_OK) return rc;
    if ((rc = eng__seq_reserve(c, s->pos, err)) != KDS_OK) {
        eng_seq_free(c);
        return rc;
    }
    c->pos = s->pos;
    memcpy(c->kda_state, s->kda_state, kda_floats(&s->d) * sizeof(float));
    memcpy(c->conv_tail, s->conv_tail, conv_floats(&s->d) * sizeof(float));
    memcpy(c->logits, s->logits, (size_t)s->d.vocab * sizeof(float));
    for (int i = 0; i < s->d.n_mla && s->pos; i++)
        memcpy(c->mla_cache[i], s->mla_cache[i], (size_t)s->pos * s->d.mla_row * sizeof(float));
    c->has_logits = s->has_logits;
    memcpy(c->rng, s->rng, sizeof c->rng);
    memcpy(c->recent, s->recent, sizeof c->recent);
    c->n_recent = s->n_recent;
    *out = c;
    return KDS_OK;
}

int64_t eng_seq_pos(const eng_seq *s) { return s->pos; }
const float *eng_seq_logits(const eng_seq *s) {
    /* logits left on a GPU by eng_decode_batch_sample come back first */
    if (eng__seq_fetch_logits(s, NULL) != KDS_OK) return NULL;
    return s->has_logits ? s->logits : NULL;
}

size_t eng_seq_state_bytes(const eng_seq *s) {
    eng_state_size z = eng_config_state_size(&s->model->cfg);
    return z.fixed + z.per_token * (size_t)s->pos;
}


/* Header fields after magic, version and header size, in order. */
enum { HDR_POS = 16, HDR_DIMS = 24, HDR_RNG = 80 };

static void dims_words(const eng_seq *s, uint32_t w[13]) {
    const eng_dims *d = &s->d;
    uint32_t v[13] = {(uint32_t)d->n_kda, (uint32_t)d->n_mla, (uint32_t)d->H, (uint32_t)d->HV,
                      (uint32_t)d->K,     (uint32_t)d->V,     (uint32_t)d->W, (uint32_t)d->conv_ch,
                      (uint32_t)d->mla_row, (uint32_t)d->vocab, (uint32_t)s->has_logits,
                      (uint32_t)s->n_recent, 0};
    memcpy(w, v, sizeof v);
}

static const char *const DIM_NAMES[] = {"KDA layers", "MLA layers", "KDA heads", "KDA value heads",
                                        "key dim",    "value dim",  "conv width", "conv channels",
                                        "MLA row",    "vocab"};

size_t eng_seq_fixed_bytes(const eng_seq *s) {
    return eng_config_state_size(&s->model->cfg).fixed;
}

size_t eng_seq_mla_token_bytes(const eng_seq *s) {
    return (size_t)s->d.n_mla * s->d.mla_row * sizeof(float);
}

/* Header and fixed sections; the MLA section follows when with_mla. */
static kds_status save_state(const eng_seq *s, void *buf, size_t len, int with_mla,
                             kds_err *err) {
    size_t need = with_mla ? eng_seq_state_bytes(s) : eng_seq_fixed_bytes(s);
    if (len < need)
        return kds_err_set(err, KDS_TOO_LARGE, "state needs %zu bytes, buffer has %zu", need, len);
    kds_status rc = eng__seq_fetch(s, err);
    if (rc != KDS_OK) return rc;
    unsigned char *p = buf;
    memset(p, 0, ENG_STATE_HEADER_BYTES);
    memcpy(p, ENG_STATE_MAGIC, 8);
    kds_put32(p + 8, ENG_STATE_VERSION);
    kds_put32(p + 12, ENG_STATE_HEADER_BYTES);
    kds_put64(p + HDR_POS, (uint64_t)s->pos);
    uint32_t w[13];
    dims_words(s, w);
    for (int i = 0; i < 13; i++) kds_put32(p + HDR_DIMS + 4 * i, w[i]);
    for (int i = 0; i < 4; i++) kds_put64(p + HDR_RNG + 8 * i, s->rng[i]);
    p += ENG_STATE_HEADER_BYTES;
    /* Float sections are copied as host bytes: every supported host is
     * little-endian (checked at configure time). */
    size_t n = kda_floats(&s->d) * sizeof(float);
    memcpy(p, s->kda_state, n);
    p += n;
    n = conv_floats(&s->d) * sizeof(float);
    memcpy(p, s->conv_tail, n);
    p += n;
    n = (size_t)s->d.vocab * sizeof(float);
    memcpy(p, s->logits, n);
    p += n;
    for (int i = 0; i < ENG_RECENT_TOKENS; i++) kds_put32(p + 4 * i, (uint32_t)s->recent[i]);
    p += ENG_RECENT_TOKENS * 4;
    if (!with_mla) return KDS_OK;
    /* at position 0 a hybrid model's caches are not even allocated */
    n = (size_t)s->pos * s->d.mla_row * sizeof(float);
    for (int i = 0; i < s->d.n_mla && n; i++) {
        memcpy(p, s->mla_cache[i], n);
        p += n;
    }
    return KDS_OK;
}

kds_status eng_seq_state_save(const eng_seq *s, void *buf, size_t len, kds_err *err) {
    return save_state(s, buf, len, 1, err);
}

kds_status eng_seq_save_fixed(const eng_seq *s, void *buf, size_t len, kds_err *err) {
    return save_state(s, buf, len, 0, err);
}

kds_status eng_seq_save_mla(const eng_seq *s, int64_t t0, int64_t t1, void *buf, size_t len,
                            kds_err *err) {
    size_t row = (size_t)s->d.mla_row * sizeof(float);
    if (t0 < 0 || t1 < t0 || t1 > s->pos)
        return kds_err_set(err, KDS_INVALID_ARG, "MLA rows [%lld, %lld) outside [0, %lld)",
                           (long long)t0, (long long)t1, (long long)s->pos);
    if (len < (size_t)(t1 - t0) * eng_seq_mla_token_bytes(s))
        return kds_err_set(err, KDS_TOO_LARGE, "buffer too small for %lld MLA rows",
                           (long long)(t1 - t0));
    kds_status rc = eng__seq_fetch(s, err);
    if (rc != KDS_OK) return rc;
    unsigned char *p = buf;
    for (int64_t t = t0; t < t1; t++)
        for (int i = 0; i < s->d.n_mla; i++) {
            memcpy(p, s->mla_cache[i] + (size_t)t * s->d.mla_row, row);
            p += row;
        }
    return KDS_OK;
}

kds_status eng_seq_load_mla(eng_seq *s, int64_t t0, int64_t t1, const void *buf, size_t len,
                            kds_err *err) {
    size_t row = (size_t)s->d.mla_row * sizeof(float);
    if (t0 < 0 || t1 < t0 || t1 > s->pos)
        return kds_err_set(err, KDS_INVALID_ARG, "MLA rows [%lld, %lld) outside [0, %lld)",
                           (long long)t0, (long long)t1, (long long)s->pos);
    if (len != (size_t)(t1 - t0) * eng_seq_mla_token_bytes(s))
        return kds_err_set(err, KDS_BAD_FORMAT, "%zu bytes for %lld MLA rows, expected %zu", len,
                           (long long)(t1 - t0), (size_t)(t1 - t0) * eng_seq_mla_token_bytes(s));
    /* a partial write: the rest of the host copy must be current first */
    kds_status rc = eng__seq_fetch(s, err);
    if (rc != KDS_OK) return rc;
    const unsigned char *p = buf;
    for (int64_t t = t0; t < t1; t++)
        for (int i = 0; i < s->d.n_mla; i++) {
            memcpy(s->mla_cache[i] + (size_t)t * s->d.mla_row, p, row);
            p += row;
        }
    eng__seq_host_written(s);
    return KDS_OK;
}

/* Physical memory in bytes, 0 when the system does not say. */
static uint64_t physical_memory_bytes(void) {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
}

/* Check the header and fixed sections and load them; with_mla also loads
 * the trailing MLA section. Nothing changes unless every check passes. */
static kds_status load_state(eng_seq *s, const void *buf, size_t len, int with_mla,
                             kds_err *err) {
    const unsigned char *p = buf;
    if (len < ENG_STATE_HEADER_BYTES || memcmp(p, ENG_STATE_MAGIC, 8) != 0)
        return kds_err_set(err, KDS_BAD_FORMAT, "not a kdaserve sequence state (bad magic)");
    uint32_t version = kds_get32(p + 8);
    if (version != ENG_STATE_VERSION)
        return kds_err_set(err, KDS_UNSUPPORTED, "sequence state version %u is not supported "
                           "(this build reads version %u)", version, ENG_STATE_VERSION);
    if (kds_get32(p + 12) != ENG_STATE_HEADER_BYTES)
        return kds_err_set(err, KDS_BAD_FORMAT, "sequence state header size %u, expected %u",
                           kds_get32(p + 12), ENG_STATE_HEADER_BYTES);
    uint64_t pos = kds_get64(p + HDR_POS);
    uint32_t want[13];
    dims_words(s, want);
    for (int i = 0; i < 10; i++) {
        uint32_t got = kds_get32(p + HDR_DIMS + 4 * i);
        if (got != want[i])
            return kds_err_set(err, KDS_MISMATCH, "state was made by another model: %s %u, "
                               "this model has %u", DIM_NAMES[i], got, want[i]);
    }
    eng_state_size z = eng_config_state_size(&s->model->cfg);
    size_t per_token = with_mla ? z.per_token : 0;
    if (pos > (uint64_t)INT32_MAX * 64 || len != z.fixed + per_token * pos)
        return kds_err_set(err, KDS_BAD_FORMAT, "state of %zu bytes does not match its position "
                           "%llu (expected %zu bytes)", len, (unsigned long long)pos,
                           (size_t)(z.fixed + per_token * pos));
    /* A fixed part only claims its rows, so its length cannot bound pos: a
     * claim whose rows could never be held in this machine's memory is a
     * damaged or foreign header, named here rather than failing later at
     * the first clone or decode (a clone copies every claimed row). */
    const uint64_t phys = physical_memory_bytes();
    if (!with_mla && z.per_token && phys && pos > phys / z.per_token)
        return kds_err_set(err, KDS_TOO_LARGE, "state claims %llu tokens, whose MLA cache "
                           "(%.1f GiB) is more than this machine's memory (%.1f GiB): the "
                           "state is damaged or was not written for this model",
                           (unsigned long long)pos, (double)pos * (double)z.per_token / 1073741824.0,
                           (double)phys / 1073741824.0);
    uint32_t has_logits = kds_get32(p + HDR_DIMS + 40);
    if (has_logits > 1 || (has_logits == 0) != (pos == 0))
        return kds_err_set(err, KDS_BAD_FORMAT, "state logits flag %u does not fit position %llu",
                           has_logits, (unsigned long long)pos);
    /* The full form carries its rows (the length check bounds pos); a
     * fixed part only claims them, so its caches start fresh and untouched. */
    kds_status rc = with_mla || s->d.n_mla == 0 || pos == 0
                        ? eng__seq_reserve(s, (int64_t)pos, err)
                        : fresh_caches(s, (int64_t)pos, err);
    if (rc != KDS_OK) return rc;
    s->pos = (int64_t)pos;
    s->has_logits = (int)has_logits;
    s->n_recent = (int32_t)kds_get32(p + HDR_DIMS + 44);
    for (int i = 0; i < 4; i++) s->rng[i] = kds_get64(p + HDR_RNG + 8 * i);
    p += ENG_STATE_HEADER_BYTES;
    size_t n = kda_floats(&s->d) * sizeof(float);
    memcpy(s->kda_state, p, n);
    p += n;
    n = conv_floats(&s->d) * sizeof(float);
    memcpy(s->conv_tail, p, n);
    p += n;
    n = (size_t)s->d.vocab * sizeof(float);
    memcpy(s->logits, p, n);
    p += n;
    for (int i = 0; i < ENG_RECENT_TOKENS; i++) s->recent[i] = (int32_t)kds_get32(p + 4 * i);
    p += ENG_RECENT_TOKENS * 4;
    /* a 0-token state: no rows, and caches that were never allocated; a
     * fixed part's rows are the zeros of fresh_caches */
    n = (size_t)pos * s->d.mla_row * sizeof(float);
    for (int i = 0; with_mla && i < s->d.n_mla && n; i++) {
        memcpy(s->mla_cache[i], p, n);
        p += n;
    }
    eng__seq_host_written(s);
    return KDS_OK;
}

kds_status eng_seq_state_load(eng_seq *s, const void *buf, size_t len, kds_err *err) {
    return load_state(s, buf, len, 1, err);
}

kds_status eng_seq_load_fixed(eng_seq *s, const void *buf, size_t len, kds_err *err) {
    return load_state(s, buf, len, 0, err);
}
