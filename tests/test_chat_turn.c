/*
 * eng_chat_turn: the one renderer of a message that the REPL and the server
 * share. Chat mode equals eng_chat_render of [system?, user] (with the
 * default system turn only at the start of a conversation); plain mode is
 * the text's ids, plus BOS only for an empty message at an empty context.
 * A tokenizer with K3's specials takes K3's format.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "eng.h"
#include "eng_model.h"
#include "test_model_util.h"

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

/* A model whose tokenizer names K3's four specials (models/default's
 * tokenizer_config.json with <|im_end|> <|im_user|> <|im_assistant|> and
 * the slot after them renamed, where K3 keeps them) talks in K3's format:
 * no chat template is needed (K3 ships none), a message renders as XTML
 * with the thinking preamble only at the start, and <|end_of_msg|> ends
 * generation. */
Test(chat_turn, k3_specials_choose_k3s_format) {
    char *dir = tmu_mkdtemp();
    cr_assert(dir && tmu_copy_model(DEFAULT_MODEL, dir));
    char *cfg = tmu_path(dir, "tokenizer_config.json"), *ranks = tmu_path(dir, "tiktoken.model");
    cr_assert(tmu_copy(DEFAULT_MODEL "/tokenizer_config.json", cfg) &&
              tmu_copy(DEFAULT_MODEL "/tiktoken.model", ranks));
    const char *renames[4][2] = {{"\"<|im_end|>\"", "\"<|end_of_msg|>\""},
                                 {"\"<|im_user|>\"", "\"<|open|>\""},
                                 {"\"<|im_assistant|>\"", "\"<|close|>\""},
                                 {"\"<|reserved_token_8197|>\"", "\"<|sep|>\""}};
    for (int i = 0; i < 4; i++)
        cr_assert(tmu_replace_in_file(cfg, renames[i][0], renames[i][1]), "%s", renames[i][0]);
    eng_model_params mp = eng_model_default_params();
    mp.no_fingerprint_cache = true;
    eng_model *m = NULL;
    kds_err e = {0};
    cr_assert_eq(eng_model_load(dir, &mp, &m, &e), KDS_OK, "%s", e.msg);
    const eng_tokenizer *t = eng_model_tokenizer(m);
    cr_expect(eng_model_chat_format(m), "K3's specials choose the chat format without a template");
    cr_expect(eng_tok_is_stop(t, eng_tok_special_id(t, "<|end_of_msg|>")));
    int32_t *ids = NULL;
    int64_t n = 0;
    for (int k = 0; k < 2; k++) {
        const int64_t pos = k ? 40 : 0;
        cr_assert_eq(eng_chat_turn(t, true, pos, NULL, "Hello", 5, true, &ids, &n, &e), KDS_OK,
                     "%s", e.msg);
        int64_t len = eng_tok_decode(t, ids, n, 0, NULL, 0);
        char *s = malloc((size_t)len + 1);
        eng_tok_decode(t, ids, n, 0, s, (size_t)len);
        s[len] = '\0';
        const char *turn = "<|open|>message role=\"user\"<|sep|>Hello<|close|>message<|sep|>"
                           "<|end_of_msg|><|open|>message role=\"assistant\"<|sep|><|open|>think"
                           "<|sep|>";
        if (k == 0)
            cr_expect(strstr(s, "type=\"thinking-effort\"") && strstr(s, turn) &&
                          !strcmp(s + strlen(s) - strlen(turn), turn),
                      "%s", s);
        else
            cr_expect_str_eq(s, turn);
        free(s);
        free(ids);
    }
    eng_model_free(m);
    free(cfg);
    free(ranks);
    tmu_rmtree(dir);
    free(dir);
}
