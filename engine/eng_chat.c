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

bool eng_chat_supported(const eng_tokenizer *t) {
    for (int i = 0; i < SP_BASIC; i++)
        if (eng_tok_special_id(t, SPECIAL_NAMES[i]) < 0) return false;
    return true;
}

typedef struct render {
    const eng_tokenizer *t;
    int32_t sp[SP_COUNT];
    int32_t *ids;
    int64_t cap, n;
    kds_buf text; /* the run of text since the last special */
    kds_status rc;
    kds_err *err;
} render;

static void text(render *r, const char *s) {
    if (r->rc != KDS_OK || !s) return;
    if (kds_buf_append(&r->text, s, strlen(s), NULL) != KDS_OK)
        r->rc = kds_err_set(r->err, KDS_NOMEM, "out of memory rendering a conversation");
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

static void turn(render *r, int opener, const char *name, const char *body) {
    special(r, opener);
    text(r, name);
    special(r, SP_MIDDLE);
    text(r, body);
    special(r, SP_END);
}

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
    for (int i = 0; i < SP_COUNT; i++)
        r.sp[i] = eng_tok_special_id(t, SPECIAL_NAMES[i]);

    if (p->tools_json && p->tools_json[0]) turn(&r, SP_SYSTEM, "tool_declare", p->tools_json);
    const char *def = p->default_system ? p->default_system : CHAT_DEFAULT_SYSTEM;
    if (def[0] && (n_msgs == 0 || strcmp(msgs[0].role, "system") != 0))
        turn(&r, SP_SYSTEM, "system", def);
    for (int i = 0; i < n_msgs && r.rc == KDS_OK; i++) {
        const eng_chat_msg *m = &msgs[i];
        const char *name = m->name && m->name[0] ? m->name : m->role;
        bool user = !strcmp(m->role, "user"), assistant = !strcmp(m->role, "assistant");
        special(&r, user ? SP_USER : assistant ? SP_ASSISTANT : SP_SYSTEM);
        text(&r, name);
        special(&r, SP_MIDDLE);
        if (!strcmp(m->role, "tool")) {
            text(&r, "## Return of ");
            text(&r, m->tool_call_id ? m->tool_call_id : "");
            text(&r, "\n");
        }
        text(&r, m->content);
        if (assistant && m->n_tool_calls > 0) {
            special(&r, SP_SEC_BEGIN);
            for (int k = 0; k < m->n_tool_calls; k++) {
                special(&r, SP_CALL_BEGIN);
                text(&r, m->tool_calls[k].id);
                special(&r, SP_CALL_ARG);
                text(&r, m->tool_calls[k].arguments);
                special(&r, SP_CALL_END);
            }
            special(&r, SP_SEC_END);
        }
        special(&r, SP_END);
    }
    if (p->add_generation_prompt) {
        special(&r, SP_ASSISTANT);
        text(&r, "assistant");
        special(&r, SP_MIDDLE);
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
        if (pos > 0) cp.default_system = ""; /* only a new conversation gets one */
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
    return eng_chat_supported(eng_model_tokenizer(m)) && dir_has_chat_template(eng_model_dir(m));
}
