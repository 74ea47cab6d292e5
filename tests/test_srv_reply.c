/*
 * The serving core's reply (core/srv.h), directly: token by token against
 * text encoded with the default model's tokenizer. The text handed out,
 * joined, is the decoded text (cut before the first stop string, whichever
 * tokens a stop string spans); a piece never ends inside a UTF-8 character;
 * text that could begin a stop string is held back until it cannot; stop
 * tokens, max_tokens and the chat close decide what is fed and what comes
 * next.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "kds_buf.h"
#include "srv.h"

#define DEFAULT_MODEL KDS_SOURCE_DIR "/models/default"

static eng_model *M;
static void load(void) {
    kds_err e = {0};
    cr_assert_eq(eng_model_load(DEFAULT_MODEL, NULL, &M, &e), KDS_OK, "%s", e.msg);
}
static void unload(void) {
    eng_model_free(M);
}

/* Feed the tokens of `text` (ignoring stop/length ends unless told), the
 * pieces joined into `out`; returns how many tokens were taken before the
 * reply said it ended. */
static int run(const srv_reply_params *p, const char *text, kds_buf *out, srv_step *last) {
    const eng_tokenizer *tok = eng_model_tokenizer(M);
    int32_t ids[4096];
    int64_t n = eng_tok_encode(tok, text, strlen(text), ids, 4096);
    cr_assert(n > 0 && n <= 4096);
    srv_reply *r = NULL;
    kds_err e = {0};
    cr_assert_eq(srv_reply_create(tok, p, &r, &e), KDS_OK, "%s", e.msg);
    int taken = 0;
    for (int64_t i = 0; i < n; i++) {
        srv_step st;
        cr_assert_eq(srv_reply_token(r, ids[i], &st, &e), KDS_OK, "%s", e.msg);
        taken++;
        /* a piece never ends inside a character */
        if (st.len) {
            unsigned char c = (unsigned char)st.text[st.len - 1];
            cr_expect(c < 0x80 || (c & 0xC0) == 0x80, "a piece ends on a lead byte");
        }
        kds_buf_append(out, st.text, st.len, NULL);
        *last = st;
        if (st.after != SRV_DECODE) break;
    }
    size_t len;
    const char *rest = srv_reply_finish(r, &len);
    kds_buf_append(out, rest, len, NULL);
    size_t tl;
    const char *all = srv_reply_text(r, &tl);
    cr_expect_eq(tl, out->len, "the text handed out is the reply");
    cr_expect_eq(memcmp(all, out->p, tl), 0);
    srv_reply_free(r);
    return taken;
}

TestSuite(srv_reply, .init = load, .fini = unload);

Test(srv_reply, pieces_join_to_the_decoded_text) {
    srv_reply_params p = srv_reply_default_params();
    p.max_tokens = 1000;
    kds_buf out = {0};
    srv_step st;
    const char *text = "It is a truth universally acknowledged — naïve café, 日本語, emoji 🐋.";
    run(&p, text, &out, &st);
    cr_expect_str_eq(kds_buf_str(&out), text);
    cr_expect_eq(st.after, SRV_DECODE, "no end before the text ran out");
    kds_buf_free(&out);
}

Test(srv_reply, a_stop_string_cuts_the_reply_wherever_the_tokens_split_it) {
    const char *text = "Call me Ishmael. Some years ago, never mind how long precisely";
    const char *stops[] = {"Ishmael", "l. So", "years ago, never", "y", "precisely"};
    for (size_t i = 0; i < sizeof stops / sizeof stops[0]; i++) {
        srv_reply_params p = srv_reply_default_params();
        p.max_tokens = 1000;
        p.stop[0] = "zzzz not there";
        p.stop[1] = stops[i];
        p.n_stop = 2;
        kds_buf out = {0};
        srv_step st;
        run(&p, text, &out, &st);
        size_t at = (size_t)(strstr(text, stops[i]) - text);
        cr_expect_eq(out.len, at, "stop '%s': %zu bytes, expected %zu", stops[i], out.len, at);
        cr_expect_eq(memcmp(out.p, text, at), 0);
        cr_expect_eq(st.after, SRV_CLOSE, "stop '%s' ends the reply", stops[i]);
        cr_expect_str_eq(st.reason, "stop");
        kds_buf_free(&out);
    }
}

Test(srv_reply, text_that_may_begin_a_stop_string_is_held_back) {
    const eng_tokenizer *tok = eng_model_tokenizer(M);
    srv_reply_params p = srv_reply_default_params();
    p.max_tokens = 100;
    p.stop[0] = " whale!";
    p.n_stop = 1;
    srv_reply *r = NULL;
    cr_assert_eq(srv_reply_create(tok, &p, &r, NULL), KDS_OK);
    int32_t ids[64];
    int64_t n = eng_tok_encode(tok, "the white whale? yes", 20, ids, 64);
    kds_buf out = {0};
    for (int64_t i = 0; i < n; i++) {
        srv_step st;
        cr_assert_eq(srv_reply_token(r, ids[i], &st, NULL), KDS_OK);
        kds_buf_append(&out, st.text, st.len, NULL);
        /* never more than the text minus what could begin " whale!" */
        size_t tl;
        srv_reply_text(r, &tl);
        cr_expect(out.len + strlen(p.stop[0]) - 1 >= tl, "held back too little");
    }
    size_t len;
    const char *rest = srv_reply_finish(r, &len);
    kds_buf_append(&out, rest, len, NULL);
    cr_expect_str_eq(kds_buf_str(&out), "the white whale? yes", "all of it once no stop came");
    srv_reply_free(r);
    kds_buf_free(&out);
}

Test(srv_reply, max_tokens_and_stop_tokens_end_the_reply) {
    const eng_tokenizer *tok = eng_model_tokenizer(M);
    srv_reply_params p = srv_reply_default_params();
    p.max_tokens = 3;
    kds_buf out = {0};
    srv_step st;
    cr_expect_eq(run(&p, "one two three four five six", &out, &st), 3);
    cr_expect_eq(st.after, SRV_CLOSE);
    cr_expect_str_eq(st.reason, "length");
    kds_buf_free(&out);

    int32_t eos = eng_tok_eos(tok), im_end = eng_tok_special_id(tok, "<|im_end|>");
    cr_assert(eos >= 0 && im_end >= 0 && eos != im_end);
    srv_reply *r = NULL;
    /* plain: the stop token is fed and ends the turn; nothing closes it */
    p.max_tokens = 10;
    cr_assert_eq(srv_reply_create(tok, &p, &r, NULL), KDS_OK);
    cr_assert_eq(srv_reply_token(r, eos, &st, NULL), KDS_OK);
    cr_expect_eq(st.feed, eos);
    cr_expect_eq(st.after, SRV_FINISH);
    cr_expect_str_eq(st.reason, "stop");
    cr_expect_eq(srv_reply_close_token(r), -1);
    cr_expect_eq(srv_reply_produced(r), 1, "a stop token counts");
    srv_reply_free(r);
    /* chat that must end on <|im_end|>: [EOS] is fed as <|im_end|>; cut
     * short, it is closed with <|im_end|> */
    p.chat = true;
    p.end_on_im_end = true;
    cr_assert_eq(srv_reply_create(tok, &p, &r, NULL), KDS_OK);
    cr_assert_eq(srv_reply_token(r, eos, &st, NULL), KDS_OK);
    cr_expect_eq(st.feed, im_end);
    cr_expect_eq(srv_reply_close_token(r), im_end);
    srv_reply_free(r);
    /* ignore_eos: a stop token is text (none: specials are skipped) */
    p.ignore_eos = true;
    cr_assert_eq(srv_reply_create(tok, &p, &r, NULL), KDS_OK);
    cr_assert_eq(srv_reply_token(r, eos, &st, NULL), KDS_OK);
    cr_expect_eq(st.after, SRV_DECODE);
    cr_expect_eq(st.feed, eos);
    srv_reply_free(r);
}

Test(srv_reply, bad_stop_strings_are_refused) {
    const eng_tokenizer *tok = eng_model_tokenizer(M);
    srv_reply_params p = srv_reply_default_params();
    srv_reply *r = NULL;
    kds_err e = {0};
    p.stop[0] = "";
    p.n_stop = 1;
    cr_expect_eq(srv_reply_create(tok, &p, &r, &e), KDS_INVALID_ARG);
    cr_expect_null(r);
    p.n_stop = 5;
    cr_expect_eq(srv_reply_create(tok, &p, &r, &e), KDS_INVALID_ARG);
}
