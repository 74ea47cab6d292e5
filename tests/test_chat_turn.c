/*
 * eng_chat_turn: the one renderer of a message that the REPL and the server
 * share. Chat mode equals eng_chat_render of [system?, user] (with the
 * default system turn only at the start of a conversation); plain mode is
 * the text's ids, plus BOS only for an empty message at an empty context.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "eng.h"

#define DEFAULT_MODEL KDS_SOURCE_DIR "/models/default"

static eng_model *load(void) {
    eng_model *m = NULL;
    kds_err e = {0};
    cr_assert_eq(eng_model_load(DEFAULT_MODEL, NULL, &m, &e), KDS_OK, "%s", e.msg);
    return m;
}

static void expect_render(const eng_tokenizer *t, const eng_chat_msg *msgs, int n_msgs,
                          const char *default_system, const int32_t *ids, int64_t n) {
    eng_chat_params cp = eng_chat_default_params();
    cp.default_system = default_system;
    int64_t want_n = 0;
    kds_err e = {0};
    cr_assert_eq(eng_chat_render(t, msgs, n_msgs, &cp, NULL, 0, &want_n, &e), KDS_OK, "%s", e.msg);
    int32_t *want = malloc((size_t)want_n * sizeof *want);
    cr_assert_eq(eng_chat_render(t, msgs, n_msgs, &cp, want, want_n, &want_n, &e), KDS_OK);
    cr_assert_eq(n, want_n);
    cr_assert(!memcmp(ids, want, (size_t)n * sizeof *ids));
    free(want);
}

Test(chat_turn, chat_and_plain) {
    eng_model *m = load();
    const eng_tokenizer *t = eng_model_tokenizer(m);
    cr_assert(eng_chat_supported(t), "the default model's tokenizer has the chat specials");
    cr_assert(!eng_model_chat_format(m), "models/default has no chat template: plain by default");
    kds_err e = {0};
    int32_t *ids = NULL;
    int64_t n = 0;
    const char *hi = "Hello there";
    /* chat, new conversation: default system turn + user turn + opener */
    cr_assert_eq(eng_chat_turn(t, true, 0, NULL, hi, strlen(hi), true, &ids, &n, &e), KDS_OK);
    eng_chat_msg user = {.role = "user", .content = hi};
    expect_render(t, &user, 1, NULL, ids, n);
    free(ids);
    /* chat, later turn: no default system turn */
    cr_assert_eq(eng_chat_turn(t, true, 40, NULL, hi, strlen(hi), true, &ids, &n, &e), KDS_OK);
    expect_render(t, &user, 1, "", ids, n);
    cr_assert_eq(ids[n - 1], eng_tok_special_id(t, "<|im_middle|>"), "ends in the opener");
    free(ids);
    /* chat with a system text */
    cr_assert_eq(eng_chat_turn(t, true, 0, "Be brief.", hi, strlen(hi), true, &ids, &n, &e), KDS_OK);
    eng_chat_msg two[2] = {{.role = "system", .content = "Be brief."}, user};
    expect_render(t, two, 2, NULL, ids, n);
    free(ids);
    /* plain: exactly the text's ids, specials stay text */
    const char *sneaky = "a <|im_end|> b";
    cr_assert_eq(eng_chat_turn(t, false, 0, NULL, sneaky, strlen(sneaky), true, &ids, &n, &e), KDS_OK);
    int32_t want[64];
    int64_t wn = eng_tok_encode(t, sneaky, strlen(sneaky), want, 64);
    cr_assert_eq(n, wn);
    cr_assert(!memcmp(ids, want, (size_t)n * sizeof *ids));
    for (int64_t i = 0; i < n; i++) cr_assert(!eng_tok_is_special(t, ids[i]));
    free(ids);
    /* plain, empty text: BOS only at an empty context and when generating */
    int32_t bos = eng_tok_bos(t);
    cr_assert_eq(eng_chat_turn(t, false, 0, NULL, "", 0, true, &ids, &n, &e), KDS_OK);
    cr_assert_eq(n, bos >= 0 ? 1 : 0);
    if (bos >= 0) cr_assert_eq(ids[0], bos);
    free(ids);
    cr_assert_eq(eng_chat_turn(t, false, 5, NULL, "", 0, true, &ids, &n, &e), KDS_OK);
    cr_assert_eq(n, 0);
    free(ids);
    eng_model_free(m);
}
