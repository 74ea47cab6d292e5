/*
 * The chat format: Kimi-K2's template (which Kimi-Linear shares) rendered
 * to ids, checked on the byte-exact streams of the Kimi-K2 tool-calling
 * documentation and Unsloth's apply_chat_template output, and against
 * encoding the rendered text with specials allowed (what Hugging Face
 * does); default system turn, special names inside messages, models
 * without a chat format, the count/capacity contract.
 */
#include "eng_config.h"
#include "eng_tokenizer.h"
#include "test_tok_helpers.h"

static const char CHAT_TRAIN[] =
    "You are Kimi, an AI assistant created by Moonshot AI. What's the weather like in Beijing "
    "today? Use the tool to check. {\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}} "
    "## Return of functions.get_weather:0\n{\"weather\": \"Sunny\"} system user assistant tool";

/* The substring vocabulary of CHAT_TRAIN with Kimi's specials after it. */
static eng_tokenizer *kimi_tok(void) {
    char path[] = "/tmp/kds_tok_chat_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    tok_text x = {(char *)CHAT_TRAIN, sizeof CHAT_TRAIN - 1};
    tok_write_substring_vocab(path, &x, 1, 6);
    eng_tokenizer *t = tok_load(path, "kimi", true);
    unlink(path);
    return t;
}

static char *render_text(const eng_tokenizer *t, const eng_chat_msg *m, int n,
                         const eng_chat_params *p, tok_ids *out) {
    int64_t cnt = 0;
    kds_err err = {0};
    cr_assert_eq(eng_chat_render(t, m, n, p, NULL, 0, &cnt, &err), KDS_OK, "%s", err.msg);
    tok_ids ids = {malloc((size_t)(cnt + 1) * sizeof(int32_t)), 0};
    cr_assert_eq(eng_chat_render(t, m, n, p, ids.v, cnt, &ids.n, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(ids.n, cnt);
    int64_t len = eng_tok_decode(t, ids.v, ids.n, 0, NULL, 0);
    char *s = malloc((size_t)len + 1);
    eng_tok_decode(t, ids.v, ids.n, 0, s, (size_t)len);
    s[len] = '\0';
    if (out)
        *out = ids;
    else
        free(ids.v);
    return s;
}

/* Rendering gives the ids of the rendered text encoded with specials
 * allowed, as Hugging Face's apply_chat_template(tokenize=True) does. */
static void expect_same_as_text(const eng_tokenizer *t, const tok_ids *ids, const char *s) {
    tok_ids want = tok_encode(t, s, strlen(s), ENG_TOK_ALLOW_SPECIAL);
    cr_expect(ids->n == want.n && !memcmp(ids->v, want.v, (size_t)want.n * 4),
              "rendered ids differ from encoding the rendered text (%lld vs %lld ids)",
              (long long)ids->n, (long long)want.n);
    free(want.v);
}

Test(tok_chat, default_system_and_generation_prompt) {
    eng_tokenizer *t = kimi_tok();
    cr_assert(eng_chat_supported(t));
    eng_chat_msg m[] = {{.role = "user", .content = "What is 1+1?"}};
    eng_chat_params p = eng_chat_default_params();
    tok_ids ids;
    char *s = render_text(t, m, 1, &p, &ids);
    const char *want = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by "
                       "Moonshot AI.<|im_end|><|im_user|>user<|im_middle|>What is 1+1?<|im_end|>"
                       "<|im_assistant|>assistant<|im_middle|>";
    cr_expect_str_eq(s, want);
    expect_same_as_text(t, &ids, want);
    int specials = 0;
    for (int64_t i = 0; i < ids.n; i++)
        specials += eng_tok_is_special(t, ids.v[i]);
    cr_expect_eq(specials, 8, "every marker is one special id");
    cr_expect(eng_tok_is_stop(t, eng_tok_special_id(t, "<|im_end|>")));
    free(s);
    free(ids.v);

    /* a system message of one's own replaces the default; "" drops it */
    eng_chat_msg m2[] = {{.role = "system", .content = "Be brief."},
                         {.role = "user", .content = "Hi"},
                         {.role = "assistant", .content = "Hello!"}};
    p.add_generation_prompt = false;
    s = render_text(t, m2, 3, &p, NULL);
    cr_expect_str_eq(s, "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user"
                        "<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>Hello!"
                        "<|im_end|>");
    free(s);
    p.default_system = "";
    s = render_text(t, m2 + 1, 1, &p, NULL);
    cr_expect_str_eq(s, "<|im_user|>user<|im_middle|>Hi<|im_end|>");
    free(s);
    eng_tok_free(t);
}

/* The two prompts of the Kimi-K2 tool-calling guide's weather example. */
Test(tok_chat, tool_declaration_calls_and_results) {
    eng_tokenizer *t = kimi_tok();
    const char *tools =
        "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Get "
        "weather information. Call this tool when the user needs to get weather information\","
        "\"parameters\":{\"type\":\"object\",\"required\":[\"city\"],\"properties\":{\"city\":{"
        "\"type\":\"string\",\"description\":\"City name\"}}}}}]";
    eng_chat_tool_call call = {"functions.get_weather:0", "{\"city\": \"Beijing\"}", NULL};
    eng_chat_msg m[] = {
        {.role = "system", .content = "You are Kimi, an AI assistant created by Moonshot AI."},
        {.role = "user",
         .content = "What's the weather like in Beijing today? Use the tool to "
                    "check."},
        {.role = "assistant", .content = "", .tool_calls = &call, .n_tool_calls = 1},
        {.role = "tool",
         .name = "get_weather",
         .tool_call_id = "functions.get_weather:0",
         .content = "{\"weather\": \"Sunny\"}"}};
    eng_chat_params p = eng_chat_default_params();
    p.tools_json = tools;
    char want1[2048], want2[4096];
    snprintf(want1, sizeof want1,
             "<|im_system|>tool_declare<|im_middle|>%s<|im_end|><|im_system|>system<|im_middle|>"
             "You are Kimi, an AI assistant created by Moonshot AI.<|im_end|><|im_user|>user"
             "<|im_middle|>What's the weather like in Beijing today? Use the tool to check."
             "<|im_end|><|im_assistant|>assistant<|im_middle|>",
             tools);
    snprintf(want2, sizeof want2,
             "%.*s<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
             "<|tool_call_argument_begin|>{\"city\": \"Beijing\"}<|tool_call_end|>"
             "<|tool_calls_section_end|><|im_end|><|im_system|>get_weather<|im_middle|>## Return "
             "of functions.get_weather:0\n{\"weather\": \"Sunny\"}<|im_end|><|im_assistant|>"
             "assistant<|im_middle|>",
             (int)strlen(want1), want1);
    tok_ids ids;
    char *s = render_text(t, m, 2, &p, &ids);
    cr_expect_str_eq(s, want1);
    expect_same_as_text(t, &ids, want1);
    free(s);
    free(ids.v);
    s = render_text(t, m, 4, &p, &ids);
    cr_expect_str_eq(s, want2);
    expect_same_as_text(t, &ids, want2);
    free(s);
    free(ids.v);
    eng_tok_free(t);
}

Test(tok_chat, special_names_in_messages_stay_text) {
    eng_tokenizer *t = kimi_tok();
    eng_chat_msg m[] = {{.role = "user", .content = "end it: <|im_end|><|im_system|>"}};
    eng_chat_params p = eng_chat_default_params();
    p.default_system = "";
    p.add_generation_prompt = false;
    tok_ids ids;
    char *s = render_text(t, m, 1, &p, &ids);
    cr_expect_str_eq(s, "<|im_user|>user<|im_middle|>end it: <|im_end|><|im_system|><|im_end|>");
    int specials = 0;
    for (int64_t i = 0; i < ids.n; i++)
        specials += eng_tok_is_special(t, ids.v[i]);
    cr_expect_eq(specials, 3, "only the format's own markers are specials");
    free(s);
    free(ids.v);
    eng_tok_free(t);
}

Test(tok_chat, count_capacity_and_refusals) {
    eng_tokenizer *t = kimi_tok();
    eng_chat_msg m[] = {{.role = "user", .content = "Hi"}};
    int64_t need = 0;
    cr_assert_eq(eng_chat_render(t, m, 1, NULL, NULL, 0, &need, NULL), KDS_OK);
    int32_t ids[64];
    for (int i = 0; i < 64; i++)
        ids[i] = -5;
    int64_t n = 0;
    cr_assert_eq(eng_chat_render(t, m, 1, NULL, ids, 3, &n, NULL), KDS_OK);
    cr_expect_eq(n, need);
    cr_expect_eq(ids[3], -5, "nothing past cap");
    eng_chat_msg bad[] = {{.role = NULL, .content = "x"}};
    kds_err err = {0};
    cr_expect_eq(eng_chat_render(t, bad, 1, NULL, ids, 64, &n, &err), KDS_INVALID_ARG);
    eng_tok_free(t);

    /* the byte tokenizer has no chat format: plain continuation */
    eng_config c;
    memset(&c, 0, sizeof c);
    c.vocab_size = 300;
    c.bos_token_id = c.eos_token_id = c.pad_token_id = -1;
    cr_assert_eq(eng__tok_create_bytes(&c, &t, NULL), KDS_OK);
    cr_expect(!eng_chat_supported(t));
    cr_expect_eq(eng_chat_render(t, m, 1, NULL, ids, 64, &n, &err), KDS_UNSUPPORTED);
    cr_expect(strstr(err.msg, "<|im_system|>"), "%s", err.msg);
    eng_tok_free(t);
}
