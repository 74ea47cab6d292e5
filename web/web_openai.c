/*
 * web_openai.c - OpenAI-compatible requests (docs/http-api.md): a parsed
 * /v1/chat/completions or /v1/completions body checked field by field and
 * rendered to the token ids the engine feeds. Pure functions of the body and
 * the tokenizer (no server state), so the engine thread calls them and tests
 * can reason about them.
 *
 * Every field that is present is checked for its type and range before
 * anything is rendered; the first problem is reported in OpenAI's terms
 * (HTTP status, the offending `param`, a `code`) and nothing is kept.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "web_internal.h"

#define MAX_MESSAGES 100000

static bool bad(web_oai_err *e, int status, const char *param, const char *code, const char *fmt,
                ...) __attribute__((format(printf, 5, 6)));
static bool bad(web_oai_err *e, int status, const char *param, const char *code, const char *fmt,
                ...) {
    e->status = status;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    web__utf8_trim(e->param); /* a client's key, cut to fit */
    snprintf(e->code, sizeof e->code, "%s", code ? code : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    web__utf8_trim(e->msg);
    return false;
}

static const cJSON *field(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

/* An optional number in [lo, hi] (finite): false with the error set when
 * present and wrong. */
static bool num(const cJSON *o, const char *k, double lo, double hi, double *out, web_oai_err *e) {
    const cJSON *v = field(o, k);
    if (!v) return true;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble < lo ||
        v->valuedouble > hi)
        return bad(e, 400, k, "invalid_value", "'%s' must be a number in [%g, %g]", k, lo, hi);
    *out = v->valuedouble;
    return true;
}

/* An optional integer in [lo, hi]. */
static bool integer(const cJSON *o, const char *k, double lo, double hi, double *out,
                    web_oai_err *e) {
    const cJSON *v = field(o, k);
    if (!v) return true;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) ||
        v->valuedouble != floor(v->valuedouble) || v->valuedouble < lo || v->valuedouble > hi)
        return bad(e, 400, k, "invalid_value", "'%s' must be an integer in [%.0f, %.0f]", k, lo,
                   hi);
    *out = v->valuedouble;
    return true;
}

static bool boolean(const cJSON *o, const char *k, bool *out, web_oai_err *e) {
    const cJSON *v = field(o, k);
    if (!v) return true;
    if (!cJSON_IsBool(v)) return bad(e, 400, k, "invalid_type", "'%s' must be true or false", k);
    *out = cJSON_IsTrue(v);
    return true;
}

/* Fields of OpenAI's API this server does not implement: refused when they
 * ask for something, so a client never silently gets less than it asked. */
static bool unsupported(const cJSON *o, web_oai_err *e) {
    static const char *const never[] = {"tools", "functions",  "logit_bias",
                                        "audio", "prediction", "modalities"};
    for (size_t i = 0; i < sizeof never / sizeof never[0]; i++) {
        const cJSON *v = field(o, never[i]);
        if (v && !((cJSON_IsArray(v) || cJSON_IsObject(v)) && cJSON_GetArraySize(v) == 0))
            return bad(e, 400, never[i], "unsupported_parameter",
                       "'%s' is not supported by kdaserve", never[i]);
    }
    const cJSON *v = field(o, "tool_choice");
    if (v && !(cJSON_IsString(v) && !strcmp(v->valuestring, "none")))
        return bad(e, 400, "tool_choice", "unsupported_parameter",
                   "'tool_choice' is not supported by kdaserve (only \"none\")");
    v = field(o, "logprobs");
    if (v && !cJSON_IsFalse(v) && !(cJSON_IsNumber(v) && v->valuedouble == 0))
        return bad(e, 400, "logprobs", "unsupported_parameter",
                   "'logprobs' is not supported by kdaserve");
    v = field(o, "top_logprobs");
    if (v && !(cJSON_IsNumber(v) && v->valuedouble == 0))
        return bad(e, 400, "top_logprobs", "unsupported_parameter",
                   "'top_logprobs' is not supported by kdaserve");
    v = field(o, "response_format");
    if (v) {
        const cJSON *t = cJSON_IsObject(v) ? field(v, "type") : NULL;
        if (!cJSON_IsString(t) || strcmp(t->valuestring, "text"))
            return bad(
                e, 400, "response_format", "unsupported_parameter",
                "'response_format' other than {\"type\":\"text\"} is not supported by kdaserve");
    }
    v = field(o, "echo");
    if (v && !cJSON_IsFalse(v))
        return bad(e, 400, "echo", "unsupported_parameter", "'echo' is not supported by kdaserve");
    v = field(o, "best_of");
    if (v && !(cJSON_IsNumber(v) && v->valuedouble == 1))
        return bad(e, 400, "best_of", "unsupported_parameter", "only best_of = 1 is supported");
    v = field(o, "suffix");
    if (v && !(cJSON_IsString(v) && !v->valuestring[0]))
        return bad(e, 400, "suffix", "unsupported_parameter",
                   "'suffix' is not supported by kdaserve");
    return true;
}

static bool parse_stop(const cJSON *o, web_oai *q, web_oai_err *e) {
    const cJSON *v = field(o, "stop");
    if (!v) return true;
    if (cJSON_IsString(v)) {
        if (!v->valuestring[0] || strlen(v->valuestring) > WEB_STOP_MAX)
            return bad(e, 400, "stop", "invalid_value", "'stop' strings must have 1-%d bytes",
                       WEB_STOP_MAX);
        snprintf(q->stop[0], sizeof q->stop[0], "%s", v->valuestring);
        q->n_stop = 1;
        return true;
    }
    if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) > WEB_STOP_COUNT)
        return bad(e, 400, "stop", "invalid_type",
                   "'stop' must be a string or an array of at most %d strings", WEB_STOP_COUNT);
    const cJSON *it;
    cJSON_ArrayForEach(it, v) {
        if (!cJSON_IsString(it) || !it->valuestring[0] || strlen(it->valuestring) > WEB_STOP_MAX)
            return bad(e, 400, "stop", "invalid_value", "'stop' strings must have 1-%d bytes",
                       WEB_STOP_MAX);
        snprintf(q->stop[q->n_stop], sizeof q->stop[0], "%s", it->valuestring);
        q->n_stop++;
    }
    return true;
}

/* The fields both endpoints share. */
static bool common(const cJSON *o, const char *model_id, web_oai *q, web_oai_err *e) {
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(o, "model");
    if (!m) return bad(e, 400, "model", "missing_required_parameter", "'model' is required");
    if (!cJSON_IsString(m)) return bad(e, 400, "model", "invalid_type", "'model' must be a string");
    if (strcmp(m->valuestring, model_id))
        return bad(e, 404, "model", "model_not_found",
                   "the model '%.*s' does not exist; this server serves '%s' (GET /v1/models)",
                   (int)web__utf8_prefix(m->valuestring, 100), m->valuestring, model_id);
    if (!unsupported(o, e)) return false;
    double n = 1;
    if (!integer(o, "n", -1e15, 1e15, &n, e)) return false;
    if (n != 1) return bad(e, 400, "n", "unsupported_value", "only n = 1 is supported");
    if (!boolean(o, "stream", &q->stream, e) || !boolean(o, "ignore_eos", &q->ignore_eos, e))
        return false;
    const cJSON *so = field(o, "stream_options");
    if (so) {
        if (!cJSON_IsObject(so))
            return bad(e, 400, "stream_options", "invalid_type",
                       "'stream_options' must be an object");
        if (!boolean(so, "include_usage", &q->include_usage, e)) return false;
    }
    /* OpenAI's sampling: temperature 1 and top_p 1 unless told; no top-k,
     * min-p or repetition penalty (kdaserve's own fields may ask for them) */
    eng_sampler_params sp = eng_sampler_default_params();
    double temp = 1.0, top_p = 1.0, top_k = 0, min_p = 0, rep = 1.0, ignored = 0;
    if (!num(o, "temperature", 0, 2, &temp, e) || !num(o, "top_p", 0, 1, &top_p, e) ||
        !integer(o, "top_k", 0, 1e9, &top_k, e) || !num(o, "min_p", 0, 1, &min_p, e) ||
        !num(o, "repeat_penalty", 0.01, 100, &rep, e) ||
        !num(o, "presence_penalty", -2, 2, &ignored, e) ||
        !num(o, "frequency_penalty", -2, 2, &ignored, e))
        return false;
    sp.temperature = (float)temp;
    sp.top_p = (float)top_p;
    sp.top_k = (int)top_k;
    sp.min_p = (float)min_p;
    sp.repeat_penalty = (float)rep;
    q->sp = sp;
    double seed = 0;
    const cJSON *sv = field(o, "seed");
    if (sv) {
        if (!integer(o, "seed", -9223372036854775807.0, 9223372036854775807.0, &seed, e))
            return false;
        q->has_seed = true;
        q->seed = (uint64_t)(int64_t)seed;
    }
    double mt = -1, mct = -1;
    if (!integer(o, "max_tokens", 0, 1e15, &mt, e) ||
        !integer(o, "max_completion_tokens", 0, 1e15, &mct, e))
        return false;
    q->max_tokens = mct >= 0 ? (int64_t)mct : (int64_t)mt;
    if (!parse_stop(o, q, e)) return false;
    const cJSON *ss = field(o, "session");
    if (ss) {
        if (!cJSON_IsString(ss) || !sess_name_valid(ss->valuestring))
            return bad(e, 400, "session", "invalid_value",
                       "'session' must be a session name: 1-64 of [A-Za-z0-9._-], starting with a "
                       "letter or digit");
        snprintf(q->session, sizeof q->session, "%s", ss->valuestring);
    }
    return true;
}

/* A message's content: a string, null, or an array of {"type":"text","text"} parts (joined). */
static bool content_of(const cJSON *msg, int i, kds_buf *out, web_oai_err *e) {
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(msg, "content");
    char param[64];
    snprintf(param, sizeof param, "messages[%d].content", i);
    if (!c || cJSON_IsNull(c)) return true;
    if (cJSON_IsString(c))
        return kds_buf_append(out, c->valuestring, strlen(c->valuestring), NULL) == KDS_OK ||
               bad(e, 500, NULL, NULL, "out of memory");
    if (!cJSON_IsArray(c))
        return bad(e, 400, param, "invalid_type", "'%s' must be a string or an array of text parts",
                   param);
    const cJSON *part;
    cJSON_ArrayForEach(part, c) {
        const cJSON *t = cJSON_IsObject(part) ? field(part, "type") : NULL;
        const cJSON *x = cJSON_IsObject(part) ? field(part, "text") : NULL;
        if (!cJSON_IsString(t) || strcmp(t->valuestring, "text") || !cJSON_IsString(x))
            return bad(e, 400, param, "invalid_type",
                       "'%s' parts must be {\"type\":\"text\",\"text\":\"...\"} (kdaserve takes "
                       "text only)",
                       param);
        if (kds_buf_append(out, x->valuestring, strlen(x->valuestring), NULL) != KDS_OK)
            return bad(e, 500, NULL, NULL, "out of memory");
    }
    return true;
}

/* Without a chat format in the tokenizer a conversation is rendered as
 * plain text, "Role: content" paragraphs ending in "Assistant:". */
static kds_status render_plain_chat(const eng_tokenizer *tok, const eng_chat_msg *msgs, int n,
                                    int32_t **ids, int64_t *n_ids, kds_err *err) {
    kds_buf t = {0};
    kds_status rc = KDS_OK;
    for (int i = 0; i < n && rc == KDS_OK; i++) {
        const char *r = msgs[i].role;
        const char *name = !strcmp(r, "user")        ? "User"
                           : !strcmp(r, "assistant") ? "Assistant"
                                                     : "System";
        rc = kds_buf_printf(&t, NULL, "%s: %s\n\n", name, msgs[i].content ? msgs[i].content : "");
    }
    if (rc == KDS_OK) rc = kds_buf_printf(&t, NULL, "Assistant:");
    if (rc != KDS_OK) {
        kds_buf_free(&t);
        return kds_err_set(err, KDS_NOMEM, "out of memory rendering the conversation");
    }
    rc = eng_chat_turn(tok, false, 0, NULL, kds_buf_str(&t), t.len, true, ids, n_ids, err);
    kds_buf_free(&t);
    return rc;
}

static bool parse_chat(const cJSON *o, const eng_tokenizer *tok, web_oai *q, web_oai_err *e) {
    const cJSON *ms = cJSON_GetObjectItemCaseSensitive(o, "messages");
    if (!ms) return bad(e, 400, "messages", "missing_required_parameter", "'messages' is required");
    int n = cJSON_IsArray(ms) ? cJSON_GetArraySize(ms) : -1;
    if (n < 1 || n > MAX_MESSAGES)
        return bad(e, 400, "messages", "invalid_type",
                   "'messages' must be an array of 1-%d messages", MAX_MESSAGES);
    eng_chat_msg *msgs = calloc((size_t)n, sizeof *msgs);
    kds_buf *texts = calloc((size_t)n, sizeof *texts);
    bool ok = msgs && texts;
    if (!ok) bad(e, 500, NULL, NULL, "out of memory");
    int i = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, ms) {
        if (!ok) break;
        char param[64];
        snprintf(param, sizeof param, "messages[%d]", i);
        const cJSON *role = cJSON_IsObject(m) ? cJSON_GetObjectItemCaseSensitive(m, "role") : NULL;
        if (!cJSON_IsObject(m)) {
            ok = bad(e, 400, param, "invalid_type", "'%s' must be an object", param);
            break;
        }
        static const char *const roles[] = {"system", "developer", "user", "assistant", "tool"};
        size_t k = 0;
        while (cJSON_IsString(role) && k < 5 && strcmp(role->valuestring, roles[k]))
            k++;
        if (!cJSON_IsString(role) || k == 5) {
            snprintf(param, sizeof param, "messages[%d].role", i);
            ok = bad(e, 400, param, "invalid_value",
                     "'%s' must be one of system, developer, user, assistant, tool", param);
            break;
        }
        if (!content_of(m, i, &texts[i], e)) {
            ok = false;
            break;
        }
        const cJSON *name = field(m, "name");
        if (name && !cJSON_IsString(name)) {
            snprintf(param, sizeof param, "messages[%d].name", i);
            ok = bad(e, 400, param, "invalid_type", "'%s' must be a string", param);
            break;
        }
        const cJSON *tc = field(m, "tool_calls");
        if (tc && !(cJSON_IsArray(tc) && cJSON_GetArraySize(tc) == 0)) {
            snprintf(param, sizeof param, "messages[%d].tool_calls", i);
            ok = bad(e, 400, param, "unsupported_parameter",
                     "tool calls are not supported by kdaserve");
            break;
        }
        const cJSON *tid = field(m, "tool_call_id");
        msgs[i].role = k == 1 ? "system" : roles[k]; /* a developer message is a system turn */
        msgs[i].content = kds_buf_str(&texts[i]);
        msgs[i].name = name ? name->valuestring : NULL;
        msgs[i].tool_call_id = cJSON_IsString(tid) ? tid->valuestring : NULL;
        i++;
    }
    if (ok) {
        /* the transcript keeps the last user message (the whole request is
         * in the tokens) */
        const char *last = "";
        for (int j = n - 1; j >= 0; j--)
            if (!strcmp(msgs[j].role, "user")) {
                last = msgs[j].content;
                break;
            }
        q->prompt_len = strlen(last);
        if (!(q->prompt = malloc(q->prompt_len + 1))) {
            ok = bad(e, 500, NULL, NULL, "out of memory");
        } else {
            memcpy(q->prompt, last, q->prompt_len + 1);
        }
    }
    if (ok) {
        kds_err ke = {0};
        kds_status rc;
        q->chat = eng_chat_supported(tok);
        if (q->chat) {
            eng_chat_params cp = eng_chat_default_params();
            int64_t count = 0;
            rc = eng_chat_render(tok, msgs, n, &cp, NULL, 0, &count, &ke);
            if (rc == KDS_OK && !(q->ids = malloc((size_t)(count + 1) * sizeof *q->ids)))
                rc = kds_err_set(&ke, KDS_NOMEM, "out of memory");
            if (rc == KDS_OK)
                rc = eng_chat_render(tok, msgs, n, &cp, q->ids, count, &q->n_ids, &ke);
        } else {
            rc = render_plain_chat(tok, msgs, n, &q->ids, &q->n_ids, &ke);
        }
        if (rc != KDS_OK) ok = bad(e, rc == KDS_NOMEM ? 500 : 400, "messages", NULL, "%s", ke.msg);
    }
    for (int j = 0; texts && j < n; j++)
        kds_buf_free(&texts[j]);
    free(texts);
    free(msgs);
    return ok;
}

static bool parse_completion(const cJSON *o, const eng_tokenizer *tok, web_oai *q, web_oai_err *e) {
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(o, "prompt");
    if (!p) return bad(e, 400, "prompt", "missing_required_parameter", "'prompt' is required");
    /* a string, an array of one string, or an array of token ids */
    if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1 && cJSON_IsString(cJSON_GetArrayItem(p, 0)))
        p = cJSON_GetArrayItem(p, 0);
    q->chat = false;
    if (cJSON_IsString(p)) {
        const char *text = p->valuestring;
        size_t len = strlen(text);
        if (!(q->prompt = malloc(len + 1))) return bad(e, 500, NULL, NULL, "out of memory");
        memcpy(q->prompt, text, len + 1);
        q->prompt_len = len;
        kds_err ke = {0};
        /* the BOS rule of every plain turn: BOS only when the text is empty */
        if (eng_chat_turn(tok, false, 0, NULL, text, len, true, &q->ids, &q->n_ids, &ke) != KDS_OK)
            return bad(e, 400, "prompt", NULL, "%s", ke.msg);
        if (q->n_ids == 0)
            return bad(e, 400, "prompt", "invalid_value",
                       "the prompt is empty and this model has no BOS token to start from");
        return true;
    }
    int n = cJSON_IsArray(p) ? cJSON_GetArraySize(p) : -1;
    if (n < 1)
        return bad(e, 400, "prompt", "invalid_type",
                   "'prompt' must be a string, an array of one string, or an array of token ids");
    if (!(q->ids = malloc((size_t)n * sizeof *q->ids)))
        return bad(e, 500, NULL, NULL, "out of memory");
    int vocab = eng_tok_vocab(tok), i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, p) {
        if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) ||
            it->valuedouble < 0 || it->valuedouble >= vocab)
            return bad(e, 400, "prompt", "invalid_value",
                       "'prompt' token ids must be integers in [0, %d) (batches of prompts are "
                       "not supported)",
                       vocab);
        q->ids[i++] = (int32_t)it->valuedouble;
    }
    q->n_ids = n;
    if (!(q->prompt = calloc(1, 1))) return bad(e, 500, NULL, NULL, "out of memory");
    return true;
}

bool web__oai_parse(const cJSON *body, web_route route, const eng_tokenizer *tok,
                    const char *model_id, web_oai *q, web_oai_err *e) {
    memset(q, 0, sizeof *q);
    memset(e, 0, sizeof *e);
    q->route = route;
    q->max_tokens = -1;
    if (!common(body, model_id, q, e)) return false;
    bool ok =
        route == WEB_ROUTE_CHAT ? parse_chat(body, tok, q, e) : parse_completion(body, tok, q, e);
    if (!ok) web__oai_free(q);
    return ok;
}

void web__oai_free(web_oai *q) {
    free(q->ids);
    free(q->prompt);
    q->ids = NULL;
    q->prompt = NULL;
}
