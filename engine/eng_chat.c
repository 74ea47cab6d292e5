/*
 * eng_chat.c - Kimi's chat format (eng.h, "Chat format") rendered to ids.
 *
 * Hugging Face renders the template to one string and encodes it with
 * specials allowed; tiktoken then encodes the text between two specials as
 * one unit. We emit specials by id and encode each run of text between two
 * specials as one unit too (the pieces of a run are joined first: a tool
 * result's "## Return of ID\n" and its content), which gives the same ids,
 * except that special names typed inside a message stay text here, and
 * that with the kimi preset the Python wrapper's cuts (every 400,000
 * characters, runs over 25,000: eng_tiktoken.c) count from the start of the
 * whole rendered string there and from the start of each run of text here:
 * the two differ only for conversations of more than 25,000 characters.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cJSON.h>

#include "eng_tokenizer.h"
#include "eng_util.h"
#include "kds_file.h"
#include "kds_buf.h"

#define CHAT_DEFAULT_SYSTEM "You are Kimi, an AI assistant created by Moonshot AI."

eng_chat_params eng_chat_default_params(void) {
    eng_chat_params p = {.tools_json = NULL, .default_system = NULL, .add_generation_prompt = true};
    return p;
}

enum {
    SP_SYSTEM,
    SP_USER,
    SP_ASSISTANT,
    SP_MIDDLE,
    SP_END,
    SP_SEC_BEGIN,
    SP_SEC_END,
    SP_CALL_BEGIN,
    SP_CALL_ARG,
    SP_CALL_END,
    SP_COUNT
};
static const char *const SPECIAL_NAMES[SP_COUNT] = {"<|im_system|>",
                                                    "<|im_user|>",
                                                    "<|im_assistant|>",
                                                    "<|im_middle|>",
                                                    "<|im_end|>",
                                                    "<|tool_calls_section_begin|>",
                                                    "<|tool_calls_section_end|>",
                                                    "<|tool_call_begin|>",
                                                    "<|tool_call_argument_begin|>",
                                                    "<|tool_call_end|>"};
#define SP_BASIC SP_SEC_BEGIN /* the first five make a chat format */

/* Kimi K3's four (XTML): a tag opens with <|open|>, its header ends with
 * <|sep|>, it closes with <|close|>TAG<|sep|>; a message ends with
 * <|end_of_msg|>. */
enum { XT_OPEN, XT_SEP, XT_CLOSE, XT_EOM, XT_COUNT };
static const char *const XTML_NAMES[XT_COUNT] = {"<|open|>", "<|sep|>", "<|close|>",
                                                 "<|end_of_msg|>"};

static bool xtml_supported(const eng_tokenizer *t) {
    for (int i = 0; i < XT_COUNT; i++)
        if (eng_tok_special_id(t, XTML_NAMES[i]) < 0) return false;
    return true;
}

static bool k2_supported(const eng_tokenizer *t) {
    for (int i = 0; i < SP_BASIC; i++)
        if (eng_tok_special_id(t, SPECIAL_NAMES[i]) < 0) return false;
    return true;
}

bool eng_chat_supported(const eng_tokenizer *t) { return xtml_supported(t) || k2_supported(t); }

int32_t eng_chat_end_token(const eng_tokenizer *t) {
    if (xtml_supported(t)) return eng_tok_special_id(t, XTML_NAMES[XT_EOM]);
    return eng_tok_special_id(t, SPECIAL_NAMES[SP_END]);
}

typedef struct render {
    const eng_tokenizer *t;
    int32_t sp[SP_COUNT];
    int32_t xt[XT_COUNT];
    int32_t *ids;
    int64_t cap, n;
    kds_buf text; /* the run of text since the last special */
    kds_status rc;
    kds_err *err;
} render;

static void text_n(render *r, const char *s, size_t n) {
    if (r->rc != KDS_OK || !s || n == 0) return;
    if (kds_buf_append(&r->text, s, n, NULL) != KDS_OK)
        r->rc = kds_err_set(r->err, KDS_NOMEM, "out of memory rendering a conversation");
}

static void text(render *r, const char *s) {
    if (s) text_n(r, s, strlen(s));
}

static void flush(render *r) {
    if (r->rc != KDS_OK || r->text.len == 0) return;
    int64_t got = 0, room = r->n < r->cap ? r->cap - r->n : 0;
    r->rc = eng_tok_encode_ex(r->t, kds_buf_str(&r->text), r->text.len, 0,
                              room ? r->ids + r->n : NULL, room, &got, r->err);
    r->n += got;
    kds_buf_reset(&r->text);
}

static void special(render *r, int which) {
    flush(r);
    if (r->rc != KDS_OK) return;
    if (r->sp[which] < 0) {
        r->rc = kds_err_set(r->err, KDS_UNSUPPORTED,
                            "the tokenizer has no %s token, which the chat format needs",
                            SPECIAL_NAMES[which]);
        return;
    }
    if (r->n < r->cap) r->ids[r->n] = r->sp[which];
    r->n++;
}

static void xspecial(render *r, int which) {
    flush(r);
    if (r->rc != KDS_OK) return;
    if (r->n < r->cap) r->ids[r->n] = r->xt[which];
    r->n++;
}

static void turn(render *r, int opener, const char *name, const char *body) {
    special(r, opener);
    text(r, name);
    special(r, SP_MIDDLE);
    text(r, body);
    special(r, SP_END);
}

/* ------------------------------------------------------------------------ */
/* Kimi K3 (XTML)                                                            */

/* TAG and its attributes: <|open|>TAG KEY="VALUE"...<|sep|> is opened by
 * xopen(TAG), attr()s, xsep(); a value's double quotes become \". */
static void xopen(render *r, const char *tag) {
    xspecial(r, XT_OPEN);
    text(r, tag);
}

static void attr(render *r, const char *key, const char *value) {
    text(r, " ");
    text(r, key);
    text(r, "=\"");
    for (const char *s = value ? value : "", *q; *s; s = q + 1) {
        q = strchr(s, '"');
        if (!q) {
            text(r, s);
            break;
        }
        text_n(r, s, (size_t)(q - s));
        text(r, "\\\"");
    }
    text(r, "\"");
}

static void attr_int(render *r, const char *key, int value) {
    char v[16];
    snprintf(v, sizeof v, "%d", value);
    attr(r, key, v);
}

static void xsep(render *r) { xspecial(r, XT_SEP); }

static void xclose(render *r, const char *tag) {
    xspecial(r, XT_CLOSE);
    text(r, tag);
    xspecial(r, XT_SEP);
}

static void xchannel(render *r, const char *tag, const char *body) {
    xopen(r, tag);
    xsep(r);
    text(r, body);
    xclose(r, tag);
}

static void xmessage_end(render *r) {
    xclose(r, "message");
    xspecial(r, XT_EOM);
}

/* A system message of K3's own (tool-declare, thinking-effort). */
static void xsystem_block(render *r, const char *type, const char *body1, const char *body2,
                          const char *body3) {
    xopen(r, "message");
    attr(r, "role", "system");
    attr(r, "type", type);
    xsep(r);
    text(r, body1);
    text(r, body2);
    text(r, body3);
    xmessage_end(r);
}

/* A JSON value as Python's json.dumps(v, ensure_ascii=False) writes it
 * (", " and ": " between items; non-ASCII as is). A number is written as
 * an integer when it is one, else in the shortest form that reads back
 * (Python's repr; a JSON 5.0 is written 5 here, 5.0 there). */
static void py_json(render *r, const cJSON *v) {
    if (cJSON_IsNull(v)) {
        text(r, "null");
    } else if (cJSON_IsBool(v)) {
        text(r, cJSON_IsTrue(v) ? "true" : "false");
    } else if (cJSON_IsNumber(v)) {
        char b[40];
        const double d = v->valuedouble;
        /* the range first: casting a larger double to an integer is undefined */
        if (d > -9.007199254740992e15 && d < 9.007199254740992e15 && d == (double)(long long)d) {
            snprintf(b, sizeof b, "%lld", (long long)d);
        } else {
            for (int prec = 1; prec <= 17; prec++) { /* the shortest that reads back */
                snprintf(b, sizeof b, "%.*g", prec, d);
                if (strtod(b, NULL) == d) break;
            }
            /* Python writes a float with a point or an exponent: 1e+20, 0.5 */
            if (!strpbrk(b, ".eEn")) strcat(b, ".0");
        }
        text(r, b);
    } else if (cJSON_IsString(v)) {
        text(r, "\"");
        for (const unsigned char *s = (const unsigned char *)v->valuestring; *s; s++) {
            char e[8];
            switch (*s) {
            case '"': text(r, "\\\""); break;
            case '\\': text(r, "\\\\"); break;
            case '\n': text(r, "\\n"); break;
            case '\r': text(r, "\\r"); break;
            case '\t': text(r, "\\t"); break;
            case '\b': text(r, "\\b"); break;
            case '\f': text(r, "\\f"); break;
            default:
                if (*s < 0x20) {
                    snprintf(e, sizeof e, "\\u%04x", *s);
                    text(r, e);
                } else {
                    text_n(r, (const char *)s, 1);
                }
            }
        }
        text(r, "\"");
    } else if (cJSON_IsArray(v) || cJSON_IsObject(v)) {
        const bool obj = cJSON_IsObject(v);
        text(r, obj ? "{" : "[");
        for (const cJSON *c = v->child; c; c = c->next) {
            if (c != v->child) text(r, ", ");
            if (obj) {
                cJSON key = {.type = cJSON_String, .valuestring = c->string};
                py_json(r, &key);
                text(r, ": ");
            }
            py_json(r, c);
        }
        text(r, obj ? "}" : "]");
    }
}

static const char *json_type_name(const cJSON *v) {
    if (cJSON_IsBool(v)) return "boolean";
    if (cJSON_IsNull(v)) return "null";
    if (cJSON_IsNumber(v)) return "number";
    if (cJSON_IsString(v)) return "string";
    if (cJSON_IsObject(v)) return "object";
    return "array";
}

/* A call's tool into out: its name, else NAME of a Kimi id
 * "functions.NAME:IDX" (K3 binds results by position, not id); another id
 * is the name itself. */
static void call_name(const eng_chat_tool_call *c, char *out, size_t cap) {
    if (c->name && c->name[0]) {
        snprintf(out, cap, "%s", c->name);
        return;
    }
    const char *s = c->id ? c->id : "";
    if (!strncmp(s, "functions.", 10)) s += 10;
    size_t len = strlen(s);
    const char *colon = strrchr(s, ':');
    if (colon && colon != s && strspn(colon + 1, "0123456789") == strlen(colon + 1) && colon[1])
        len = (size_t)(colon - s);
    if (len >= cap) len = cap - 1;
    memcpy(out, s, len);
    out[len] = '\0';
}

static void xtool_calls(render *r, const eng_chat_msg *m) {
    xopen(r, "tools");
    xsep(r);
    for (int k = 0; k < m->n_tool_calls && r->rc == KDS_OK; k++) {
        const eng_chat_tool_call *c = &m->tool_calls[k];
        char name[256];
        call_name(c, name, sizeof name);
        xopen(r, "call");
        attr(r, "tool", name);
        attr_int(r, "index", k + 1);
        xsep(r);
        cJSON *args = c->arguments ? cJSON_Parse(c->arguments) : NULL;
        if (cJSON_IsObject(args)) {
            for (const cJSON *a = args->child; a; a = a->next) {
                xopen(r, "argument");
                attr(r, "key", a->string);
                attr(r, "type", json_type_name(a));
                xsep(r);
                if (cJSON_IsString(a))
                    text(r, a->valuestring);
                else
                    py_json(r, a);
                xclose(r, "argument");
            }
        } else if (c->arguments) {
            /* not an object: the whole value in a json tag (text that is
             * not JSON, as it is) */
            xopen(r, "json");
            attr(r, "type", "object");
            xsep(r);
            if (args)
                py_json(r, args);
            else
                text(r, c->arguments);
            xclose(r, "json");
        }
        cJSON_Delete(args);
        xclose(r, "call");
    }
    xclose(r, "tools");
}

static void render_xtml(render *r, const eng_chat_msg *msgs, int n_msgs,
                        const eng_chat_params *p) {
    const bool thinking = !p->no_thinking;
    const char *effort = p->thinking_effort ? p->thinking_effort : "max";
    if (thinking && strcmp(effort, "low") && strcmp(effort, "high") && strcmp(effort, "max")) {
        r->rc = kds_err_set(r->err, KDS_INVALID_ARG,
                            "thinking effort \"%s\" is not one of low, high, max (K3's)", effort);
        return;
    }
    if (!p->continuing) {
        if (p->tools_json && p->tools_json[0])
            xsystem_block(r, "tool-declare",
                          "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
                          "```json\n",
                          p->tools_json, "\n```");
        if (thinking) {
            char line[96];
            snprintf(line, sizeof line, "Now the system is invoked with `thinking_effort=%s`.",
                     effort);
            xsystem_block(r, "thinking-effort",
                          "`thinking_effort` guides on how much to think in your thinking channel "
                          "(not including the response channel), supported values include "
                          "`low`, `medium`, `high`, and `max`.\n",
                          line, NULL);
        }
    }
    const eng_chat_msg *calls = NULL; /* the last assistant message: results bind to its calls */
    int result_index = 0;
    for (int i = 0; i < n_msgs && r->rc == KDS_OK; i++) {
        const eng_chat_msg *m = &msgs[i];
        xopen(r, "message");
        attr(r, "role", m->role);
        if (!strcmp(m->role, "assistant")) {
            calls = m;
            result_index = 0;
            xsep(r);
            if (thinking) xchannel(r, "think", m->reasoning);
            xchannel(r, "response", m->content);
            if (m->n_tool_calls > 0) xtool_calls(r, m);
        } else if (!strcmp(m->role, "tool")) {
            result_index++;
            char name[256] = "";
            if (m->name && m->name[0])
                snprintf(name, sizeof name, "%s", m->name);
            else if (calls && result_index <= calls->n_tool_calls)
                call_name(&calls->tool_calls[result_index - 1], name, sizeof name);
            if (!name[0]) {
                r->rc = kds_err_set(r->err, KDS_INVALID_ARG,
                                    "chat message %d: a tool result needs its tool's name (K3 "
                                    "binds results to calls by position): give it a name, or "
                                    "follow an assistant message with as many calls",
                                    i);
                break;
            }
            attr(r, "tool", name);
            attr_int(r, "index", result_index);
            xsep(r);
            text(r, m->content);
        } else {
            if (m->name && m->name[0]) attr(r, "name", m->name);
            xsep(r);
            text(r, m->content);
        }
        xmessage_end(r);
    }
    if (p->add_generation_prompt && r->rc == KDS_OK) {
        xopen(r, "message");
        attr(r, "role", "assistant");
        xsep(r);
        xopen(r, thinking ? "think" : "response");
        xsep(r);
    }
}

/* ------------------------------------------------------------------------ */
/* Kimi-K2 (the turns of its template)                                      */

static void render_k2(render *r, const eng_chat_msg *msgs, int n_msgs, const eng_chat_params *p) {
    if (p->tools_json && p->tools_json[0] && !p->continuing)
        turn(r, SP_SYSTEM, "tool_declare", p->tools_json);
    const char *def = p->default_system ? p->default_system : CHAT_DEFAULT_SYSTEM;
    if (def[0] && !p->continuing && (n_msgs == 0 || strcmp(msgs[0].role, "system") != 0))
        turn(r, SP_SYSTEM, "system", def);
    for (int i = 0; i < n_msgs && r->rc == KDS_OK; i++) {
        const eng_chat_msg *m = &msgs[i];
        const char *name = m->name && m->name[0] ? m->name : m->role;
        bool user = !strcmp(m->role, "user"), assistant = !strcmp(m->role, "assistant");
        special(r, user ? SP_USER : assistant ? SP_ASSISTANT : SP_SYSTEM);
        text(r, name);
        special(r, SP_MIDDLE);
        if (!strcmp(m->role, "tool")) {
            text(r, "## Return of ");
            text(r, m->tool_call_id ? m->tool_call_id : "");
            text(r, "\n");
        }
        text(r, m->content);
        if (assistant && m->n_tool_calls > 0) {
            special(r, SP_SEC_BEGIN);
            for (int k = 0; k < m->n_tool_calls; k++) {
                special(r, SP_CALL_BEGIN);
                text(r, m->tool_calls[k].id);
                special(r, SP_CALL_ARG);
                text(r, m->tool_calls[k].arguments);
                special(r, SP_CALL_END);
            }
            special(r, SP_SEC_END);
        }
        special(r, SP_END);
    }
    if (p->add_generation_prompt) {
        special(r, SP_ASSISTANT);
        text(r, "assistant");
        special(r, SP_MIDDLE);
    }
}

/* ------------------------------------------------------------------------ */
/* Either format                                                             */

kds_status eng_chat_render(const eng_tokenizer *t, const eng_chat_msg *msgs, int n_msgs,
                           const eng_chat_params *p, int32_t *ids, int64_t cap, int64_t *n,
                           kds_err *err) {
    eng_chat_params dp = eng_chat_default_params();
    if (!p) p = &dp;
    if (n) *n = 0;
    for (int i = 0; i < n_msgs; i++)
        if (!msgs[i].role || !msgs[i].role[0])
            return kds_err_set(err, KDS_INVALID_ARG, "chat message %d has no role", i);
    render r = {.t = t, .ids = ids, .cap = ids ? cap : 0, .err = err};
    if (xtml_supported(t)) {
        for (int i = 0; i < XT_COUNT; i++)
            r.xt[i] = eng_tok_special_id(t, XTML_NAMES[i]);
        render_xtml(&r, msgs, n_msgs, p);
    } else {
        for (int i = 0; i < SP_COUNT; i++)
            r.sp[i] = eng_tok_special_id(t, SPECIAL_NAMES[i]);
        render_k2(&r, msgs, n_msgs, p);
    }
    flush(&r);
    kds_buf_free(&r.text);
    if (r.rc == KDS_OK && n) *n = r.n;
    return r.rc;
}

/* ------------------------------------------------------------------------ */
/* One message of a conversation                                             */

kds_status eng_chat_turn(const eng_tokenizer *t, bool chat, int64_t pos, const char *system,
                         const char *text, size_t len, bool gen_prompt, int32_t **ids,
                         int64_t *n, kds_err *err) {
    *ids = NULL;
    *n = 0;
    kds_status rc;
    if (chat) {
        char *copy = malloc(len + 1); /* the renderer takes NUL-terminated text */
        if (!copy) return kds_err_set(err, KDS_NOMEM, "out of memory rendering a message");
        memcpy(copy, text, len);
        copy[len] = '\0';
        eng_chat_msg msgs[2];
        int k = 0;
        if (system) msgs[k++] = (eng_chat_msg){.role = "system", .content = system};
        msgs[k++] = (eng_chat_msg){.role = "user", .content = copy};
        eng_chat_params cp = eng_chat_default_params();
        cp.add_generation_prompt = gen_prompt;
        cp.continuing = pos > 0; /* only a new conversation gets a default system turn */
        int64_t count = 0;
        rc = eng_chat_render(t, msgs, k, &cp, NULL, 0, &count, err);
        if (rc == KDS_OK && !(*ids = malloc((size_t)(count + 1) * sizeof **ids)))
            rc = kds_err_set(err, KDS_NOMEM, "out of memory rendering a message");
        if (rc == KDS_OK) rc = eng_chat_render(t, msgs, k, &cp, *ids, count, n, err);
        free(copy);
    } else {
        /* byte-level BPE never makes more ids than bytes */
        if (!(*ids = malloc((len + 1) * sizeof **ids)))
            return kds_err_set(err, KDS_NOMEM, "out of memory encoding a message");
        rc = eng_tok_encode_ex(t, text, len, 0, *ids, (int64_t)len, n, err);
        if (rc == KDS_OK && gen_prompt && *n == 0 && pos == 0 && eng_tok_bos(t) >= 0)
            (*ids)[(*n)++] = eng_tok_bos(t);
    }
    if (rc != KDS_OK) {
        free(*ids);
        *ids = NULL;
        *n = 0;
    }
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Does the model directory ask for the chat format?                         */

static bool dir_has_chat_template(const char *dir) {
    char path[4200];
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    /* only its presence matters: never opened, so a FIFO cannot block */
    if (eng__path_state(path) == ENG_PATH_PRESENT) return true;
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    int fd;
    size_t size;
    kds_err ignored = {0};
    if (kds_open_regular(path, &fd, &size, &ignored) != KDS_OK) return true;
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return true;
    }
    bool found = false;
    char buf[8192];
    size_t n, keep = 0;
    /* a streaming search for the key, so large configs need no parse */
    while ((n = fread(buf + keep, 1, sizeof buf - 1 - keep, f)) > 0) {
        buf[keep + n] = '\0';
        if (strstr(buf, "\"chat_template\"")) {
            found = true;
            break;
        }
        size_t total = keep + n;
        keep = total < 16 ? total : 16;
        memmove(buf, buf + total - keep, keep);
    }
    fclose(f);
    return found;
}

bool eng_model_chat_format(const eng_model *m) {
    const eng_tokenizer *t = eng_model_tokenizer(m);
    /* K3 ships no template (its format is code): its specials decide */
    return xtml_supported(t) || (k2_supported(t) && dir_has_chat_template(eng_model_dir(m)));
}
