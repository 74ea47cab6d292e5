/*
 * Kimi K3's chat format (XTML; kimi-k3.md section 4.10, engine/eng.h "Chat
 * format"), chosen when the tokenizer has <|open|> <|sep|> <|close|>
 * <|end_of_msg|>. The expected streams are written out byte for byte as
 * Moonshot's encoder (encoding_k3.py in the checkpoint) produces them, as
 * several independent public renderers record them (docs/k3.md "Chat
 * format"): the thinking-effort preamble, system and user messages and the
 * think-channel generation prompt; with thinking off, no preamble, no
 * think channel, a response-channel prompt; an assistant's reasoning,
 * response and typed tool-call arguments; tool results bound by position.
 * Each rendering also equals encoding its text with specials allowed (what
 * apply_chat_template(tokenize=True) does). And: refusals, <|end_of_msg|>
 * ends generation, a continuing conversation gets no preamble, the model
 * directory decides the format.
 */
#include "eng_config.h"
#include "eng_tokenizer.h"
#include "test_tok_helpers.h"

static const char K3_TRAIN[] =
    "message role=\"system\" type=\"thinking-effort\" `thinking_effort` guides on how much to "
    "think in your thinking channel (not including the response channel), supported values "
    "include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with "
    "`thinking_effort=max`. user assistant think response tools call tool index argument key "
    "type string number boolean object Hello hi";

/* The substring vocabulary of K3_TRAIN with K3's four specials (at the
 * real offsets from the ranks: <|end_of_msg|> +2, <|open|> +3, <|close|>
 * +4, <|sep|> +5) and nothing of Kimi-K2's. */
static eng_tokenizer *k3_tok(void) {
    char ranks[] = "/tmp/kds_tok_k3_XXXXXX", specials[] = "/tmp/kds_tok_k3s_XXXXXX";
    int fd = mkstemp(ranks);
    cr_assert(fd >= 0);
    close(fd);
    tok_text x = {(char *)K3_TRAIN, sizeof K3_TRAIN - 1};
    tok_write_substring_vocab(ranks, &x, 1, 6);
    eng_tokenizer *probe = tok_load(ranks, "kimi", false);
    const int base = eng_tok_vocab(probe);
    eng_tok_free(probe);
    fd = mkstemp(specials);
    cr_assert(fd >= 0);
    FILE *f = fdopen(fd, "w");
    cr_assert(f);
    fprintf(f,
            "{\"<|end_of_msg|>\": %d, \"<|open|>\": %d, \"<|close|>\": %d, \"<|sep|>\": %d}",
            base + 2, base + 3, base + 4, base + 5);
    fclose(f);
    eng_tok_params p = eng_tok_default_params();
    p.pattern = "kimi";
    p.specials_file = specials;
    eng_tokenizer *t = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_tok_load(ranks, &p, &t, &err), KDS_OK, "%s", err.msg);
    unlink(ranks);
    unlink(specials);
    return t;
}

/* Render, check the ids against encoding the text with specials allowed,
 * return the text (specials as their names). */
static char *render_k3(const eng_tokenizer *t, const eng_chat_msg *m, int n,
                       const eng_chat_params *p) {
    int64_t cnt = 0;
    kds_err err = {0};
    cr_assert_eq(eng_chat_render(t, m, n, p, NULL, 0, &cnt, &err), KDS_OK, "%s", err.msg);
    int32_t *ids = malloc((size_t)(cnt + 1) * sizeof(int32_t));
    int64_t got = 0;
    cr_assert_eq(eng_chat_render(t, m, n, p, ids, cnt, &got, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(got, cnt);
    int64_t len = eng_tok_decode(t, ids, got, 0, NULL, 0);
    char *s = malloc((size_t)len + 1);
    eng_tok_decode(t, ids, got, 0, s, (size_t)len);
    s[len] = '\0';
    tok_ids want = tok_encode(t, s, (size_t)len, ENG_TOK_ALLOW_SPECIAL);
    cr_expect(want.n == got && !memcmp(want.v, ids, (size_t)got * sizeof(int32_t)),
              "rendered ids differ from encoding the rendered text (%lld vs %lld ids)",
              (long long)got, (long long)want.n);
    free(want.v);
    free(ids);
    return s;
}

#define PREAMBLE(effort)                                                                        \
    "<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>`thinking_effort` guides "  \
    "on how much to think in your thinking channel (not including the response channel), "     \
    "supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked " \
    "with `thinking_effort=" effort "`.<|close|>message<|sep|><|end_of_msg|>"

Test(tok_chat_k3, preamble_messages_and_generation_prompt) {
    eng_tokenizer *t = k3_tok();
    cr_expect(eng_chat_supported(t));
    eng_chat_msg m[] = {{.role = "system", .content = "You are helpful."},
                        {.role = "user", .content = "Hello"}};
    char *s = render_k3(t, m, 2, NULL);
    cr_expect_str_eq(s, PREAMBLE("max") "<|open|>message role=\"system\"<|sep|>You are helpful."
                                        "<|close|>message<|sep|><|end_of_msg|>"
                                        "<|open|>message role=\"user\"<|sep|>Hello<|close|>message"
                                        "<|sep|><|end_of_msg|><|open|>message role=\"assistant\""
                                        "<|sep|><|open|>think<|sep|>");
    free(s);
    /* no default system message, unlike Kimi-K2's format */
    s = render_k3(t, m + 1, 1, NULL);
    cr_expect_str_eq(s, PREAMBLE("max") "<|open|>message role=\"user\"<|sep|>Hello<|close|>"
                                        "message<|sep|><|end_of_msg|><|open|>message role="
                                        "\"assistant\"<|sep|><|open|>think<|sep|>");
    free(s);
    eng_tok_free(t);
}

Test(tok_chat_k3, thinking_off_drops_the_think_channel) {
    eng_tokenizer *t = k3_tok();
    eng_chat_msg m[] = {{.role = "user", .content = "hi"},
                        {.role = "assistant", .content = "A", .reasoning = "R"},
                        {.role = "user", .content = "q"}};
    eng_chat_params p = eng_chat_default_params();
    p.no_thinking = true;
    char *s = render_k3(t, m, 3, &p);
    cr_expect_str_eq(s, "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|>"
                        "<|end_of_msg|><|open|>message role=\"assistant\"<|sep|><|open|>response"
                        "<|sep|>A<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
                        "<|open|>message role=\"user\"<|sep|>q<|close|>message<|sep|>"
                        "<|end_of_msg|><|open|>message role=\"assistant\"<|sep|><|open|>response"
                        "<|sep|>");
    free(s);
    /* thinking on: the history keeps its reasoning, an assistant without
     * reasoning gets an empty think channel */
    p = eng_chat_default_params();
    p.thinking_effort = "low";
    p.add_generation_prompt = false;
    eng_chat_msg m2[] = {{.role = "assistant", .content = "A", .reasoning = "R"},
                         {.role = "assistant", .content = "B"}};
    s = render_k3(t, m2, 2, &p);
    cr_expect_str_eq(s, PREAMBLE("low") "<|open|>message role=\"assistant\"<|sep|><|open|>think"
                                        "<|sep|>R<|close|>think<|sep|><|open|>response<|sep|>A"
                                        "<|close|>response<|sep|><|close|>message<|sep|>"
                                        "<|end_of_msg|><|open|>message role=\"assistant\"<|sep|>"
                                        "<|open|>think<|sep|><|close|>think<|sep|><|open|>"
                                        "response<|sep|>B<|close|>response<|sep|><|close|>"
                                        "message<|sep|><|end_of_msg|>");
    free(s);
    eng_tok_free(t);
}

Test(tok_chat_k3, tools_declared_called_and_answered) {
    eng_tokenizer *t = k3_tok();
    const char *tools = "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}]";
    eng_chat_tool_call calls[] = {
        {"functions.get_weather:0",
         "{\"city\": \"Beijing\", \"days\": 3, \"metric\": true, \"unit\": null, \"ratio\": 0.5, "
         "\"opts\": {\"a\": [1, 2.25], \"q\": \"x\\\"y\\u00e9\\n\"}}",
         NULL},
        {"call_9", "[1,2]", "clock"}, /* an OpenAI id: the name given apart */
        {"functions.ping:2", "not json", NULL}};
    eng_chat_msg m[] = {
        {.role = "user", .content = "Weather?", .name = "ann \"a\""},
        {.role = "assistant", .content = "", .tool_calls = calls, .n_tool_calls = 3},
        {.role = "tool", .content = "{\"weather\": \"Sunny\"}"},
        {.role = "tool", .content = "12:00"}};
    eng_chat_params p = eng_chat_default_params();
    p.tools_json = tools;
    p.no_thinking = true;
    char *s = render_k3(t, m, 4, &p);
    cr_expect_str_eq(
        s,
        "<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools\nHere are the "
        "available tools, described in JSONSchema.\n\n```json\n[{\"type\":\"function\","
        "\"function\":{\"name\":\"get_weather\"}}]\n```<|close|>message<|sep|><|end_of_msg|>"
        "<|open|>message role=\"user\" name=\"ann \\\"a\\\"\"<|sep|>Weather?<|close|>message"
        "<|sep|><|end_of_msg|>"
        "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|><|close|>response"
        "<|sep|><|open|>tools<|sep|>"
        "<|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
        "<|open|>argument key=\"city\" type=\"string\"<|sep|>Beijing<|close|>argument<|sep|>"
        "<|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|>"
        "<|open|>argument key=\"metric\" type=\"boolean\"<|sep|>true<|close|>argument<|sep|>"
        "<|open|>argument key=\"unit\" type=\"null\"<|sep|>null<|close|>argument<|sep|>"
        "<|open|>argument key=\"ratio\" type=\"number\"<|sep|>0.5<|close|>argument<|sep|>"
        "<|open|>argument key=\"opts\" type=\"object\"<|sep|>{\"a\": [1, 2.25], \"q\": "
        "\"x\\\"y\xc3\xa9\\n\"}<|close|>argument<|sep|><|close|>call<|sep|>"
        "<|open|>call tool=\"clock\" index=\"2\"<|sep|><|open|>json type=\"object\"<|sep|>"
        "[1, 2]<|close|>json<|sep|><|close|>call<|sep|>"
        "<|open|>call tool=\"ping\" index=\"3\"<|sep|><|open|>json type=\"object\"<|sep|>"
        "not json<|close|>json<|sep|><|close|>call<|sep|>"
        "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        "<|open|>message role=\"tool\" tool=\"get_weather\" index=\"1\"<|sep|>{\"weather\": "
        "\"Sunny\"}<|close|>message<|sep|><|end_of_msg|>"
        "<|open|>message role=\"tool\" tool=\"clock\" index=\"2\"<|sep|>12:00<|close|>message"
        "<|sep|><|end_of_msg|>"
        "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>");
    free(s);
    eng_tok_free(t);
}

Test(tok_chat_k3, refusals_stops_and_continuing_turns) {
    eng_tokenizer *t = k3_tok();
    eng_chat_msg m[] = {{.role = "user", .content = "Hello"}};
    eng_chat_params p = eng_chat_default_params();
    p.thinking_effort = "medium"; /* named in the preamble's prose, refused by the encoder */
    int32_t ids[256];
    int64_t n = 0;
    kds_err err = {0};
    cr_expect_eq(eng_chat_render(t, m, 1, &p, ids, 256, &n, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "medium") && strstr(err.msg, "low, high, max"), "%s", err.msg);
    /* a result with no call before it and no name cannot be bound */
    eng_chat_msg orphan[] = {{.role = "tool", .content = "x"}};
    cr_expect_eq(eng_chat_render(t, orphan, 1, NULL, ids, 256, &n, &err), KDS_INVALID_ARG);
    cr_expect(strstr(err.msg, "tool result"), "%s", err.msg);
    /* <|end_of_msg|> ends generation */
    cr_expect(eng_tok_is_stop(t, eng_tok_special_id(t, "<|end_of_msg|>")));
    cr_expect(!eng_tok_is_stop(t, eng_tok_special_id(t, "<|close|>")));
    /* a message to a conversation under way: no preamble again */
    int32_t *turn = NULL;
    cr_assert_eq(eng_chat_turn(t, true, 42, NULL, "hi", 2, true, &turn, &n, &err), KDS_OK, "%s",
                 err.msg);
    int64_t len = eng_tok_decode(t, turn, n, 0, NULL, 0);
    char *s = malloc((size_t)len + 1);
    eng_tok_decode(t, turn, n, 0, s, (size_t)len);
    s[len] = '\0';
    cr_expect_str_eq(s, "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|>"
                        "<|end_of_msg|><|open|>message role=\"assistant\"<|sep|><|open|>think"
                        "<|sep|>");
    free(s);
    free(turn);
    /* and at position 0 the preamble comes first */
    cr_assert_eq(eng_chat_turn(t, true, 0, NULL, "hi", 2, true, &turn, &n, &err), KDS_OK);
    len = eng_tok_decode(t, turn, n, 0, NULL, 0);
    s = malloc((size_t)len + 1);
    eng_tok_decode(t, turn, n, 0, s, (size_t)len);
    s[len] = '\0';
    cr_expect(!strncmp(s, PREAMBLE("max"), strlen(PREAMBLE("max"))), "%s", s);
    free(s);
    free(turn);
    eng_tok_free(t);
}

/* What a K3 model writes after the generation prompt, streamed with
 * specials skipped (as the REPL and the server show it): the tags' markup
 * vanishes whole, headers included; the channels' text stays. Without the
 * flag every byte comes back. */
Test(tok_chat_k3, streamed_reply_drops_the_markup) {
    eng_tokenizer *t = k3_tok();
    const char *reply = "hmm<|close|>think<|sep|><|open|>response<|sep|>Hello there<|close|>"
                        "response<|sep|><|close|>message<|sep|><|end_of_msg|>";
    tok_ids ids = tok_encode(t, reply, strlen(reply), ENG_TOK_ALLOW_SPECIAL);
    for (int skip = 0; skip < 2; skip++) {
        eng_tok_stream *st = NULL;
        kds_err err = {0};
        cr_assert_eq(eng_tok_stream_create(t, skip ? ENG_TOK_SKIP_SPECIAL : 0, &st, &err), KDS_OK);
        char out[512];
        size_t o = 0;
        for (int64_t i = 0; i < ids.n; i++) {
            const char *piece;
            size_t len;
            cr_assert_eq(eng_tok_stream_put(st, ids.v[i], &piece, &len, &err), KDS_OK);
            cr_assert(o + len < sizeof out);
            memcpy(out + o, piece, len);
            o += len;
        }
        out[o] = '\0';
        cr_expect_str_eq(out, skip ? "hmmHello there" : reply);
        eng_tok_stream_free(st);
    }
    free(ids.v);
    eng_tok_free(t);
}

/* A chat reply or turn cut short is closed with the format's end token. */
Test(tok_chat_k3, end_token) {
    eng_tokenizer *t = k3_tok();
    cr_expect_eq(eng_chat_end_token(t), eng_tok_special_id(t, "<|end_of_msg|>"));
    cr_expect_geq(eng_chat_end_token(t), 0);
    eng_tok_free(t);
}
