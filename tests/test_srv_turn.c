/*
 * The serving core's turn on one sequence (core/srv.h, srv_turn_run and
 * srv_turn_save), directly, on the default model: a turn equals the plain
 * loop it replaces (prefill, then draw and decode token by token) in reply,
 * token counts, RNG and every state byte; the text hook's pieces joined are
 * the reply; a chat reply cut short ends on <|im_end|>; go_on stops before
 * a draw; keep_context false leaves the last token unfed; the drawn hook
 * sees each draw's logits; an empty context and prompt is refused; a saved
 * turn is the session's head with its transcript entry.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "eng_config.h"
#include "kds_buf.h"
#include "srv.h"
#include "test_helpers.h"
#include "test_model_util.h"

#define DEFAULT_MODEL KDS_SOURCE_DIR "/models/default"

typedef struct fixture {
    eng_model *m;
    eng_ctx *c;
    const eng_tokenizer *tok;
    int vocab;
} fixture;

static fixture open_default(void) {
    fixture f = {0};
    kds_err e = {0};
    cr_assert_eq(eng_model_load(DEFAULT_MODEL, NULL, &f.m, &e), KDS_OK, "%s", e.msg);
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &f.c, &e), KDS_OK, "%s", e.msg);
    f.tok = eng_model_tokenizer(f.m);
    f.vocab = eng_model_config(f.m)->vocab_size;
    return f;
}

static void close_fixture(fixture *f) {
    eng_ctx_free(f->c);
    eng_model_free(f->m);
}

static void *state(const eng_seq *s, size_t *n) {
    kds_err e = {0};
    *n = eng_seq_state_bytes(s);
    void *b = malloc(*n);
    cr_assert(b);
    cr_assert_eq(eng_seq_state_save(s, b, *n, &e), KDS_OK, "%s", e.msg);
    return b;
}

typedef struct seen {
    kds_buf text;
    int draws, stop_after; /* go_on says no once `draws` reaches stop_after (-1: never) */
    float first_logit;
} seen;

static void on_text(void *user, const char *t, size_t n) {
    seen *s = user;
    kds_buf_append(&s->text, t, n, NULL);
}
static bool on_go_on(void *user) {
    seen *s = user;
    return s->stop_after < 0 || s->draws < s->stop_after;
}
static void on_drawn(void *user, const float *logits, int32_t token) {
    seen *s = user;
    (void)token;
    if (s->draws++ == 0) s->first_logit = logits[0];
}

/* The loop srv_turn_run replaces, for a reply that ends at max_tokens
 * without a stop token (ignore_eos): prefill, then draw and decode. */
static void plain_loop(fixture *f, eng_seq *s, const int32_t *ids, int64_t n, int max,
                       const eng_sampler_params *sp, kds_buf *reply) {
    kds_err e = {0};
    eng_tok_stream *dec = NULL;
    cr_assert_eq(eng_tok_stream_create(f->tok, ENG_TOK_SKIP_SPECIAL, &dec, &e), KDS_OK);
    cr_assert_eq(eng_prefill(f->c, s, ids, n, NULL, NULL, NULL, &e), KDS_OK, "%s", e.msg);
    for (int i = 0; i < max; i++) {
        int32_t next;
        cr_assert_eq(eng_sample(f->c, s, sp, &next, &e), KDS_OK, "%s", e.msg);
        cr_assert_eq(eng_decode(f->c, s, next, &e), KDS_OK, "%s", e.msg);
        const char *p;
        size_t len;
        cr_assert_eq(eng_tok_stream_put(dec, next, &p, &len, &e), KDS_OK);
        kds_buf_append(reply, p, len, NULL);
    }
    size_t len;
    const char *rest = eng_tok_stream_flush(dec, &len);
    kds_buf_append(reply, rest, len, NULL);
    eng_tok_stream_free(dec);
}

Test(srv_turn, equals_the_plain_loop, .timeout = 60) {
    fixture f = open_default();
    kds_err e = {0};
    int32_t *ids = NULL;
    int64_t n = 0;
    const char *text = "It is a truth universally acknowledged";
    cr_assert_eq(eng_chat_turn(f.tok, false, 0, NULL, text, strlen(text), true, &ids, &n, &e), KDS_OK);
    eng_seq *a, *b;
    cr_assert_eq(eng_seq_create(f.m, 7, &a, &e), KDS_OK);
    cr_assert_eq(eng_seq_create(f.m, 7, &b, &e), KDS_OK);
    srv_turn_params tp = srv_turn_default_params(); /* temperature 0.8, top-k 40: sampled */
    tp.reply.max_tokens = 24;
    tp.reply.ignore_eos = true;
    seen sn = {.stop_after = -1};
    srv_turn_hooks h = {.user = &sn, .text = on_text, .go_on = on_go_on, .drawn = on_drawn};
    srv_turn_result r;
    cr_assert_eq(srv_turn_run(f.c, a, f.tok, ids, n, &tp, &h, &r, &e), KDS_OK, "%s", e.msg);
    kds_buf ref = {0};
    plain_loop(&f, b, ids, n, 24, &tp.sampler, &ref);
    cr_expect_str_eq(r.reason, "length");
    cr_expect_eq(r.tokens, 24);
    cr_expect_eq(r.drawn, 24);
    cr_expect_eq(sn.draws, 24, "the drawn hook saw %d draws", sn.draws);
    cr_expect_eq(r.prompt_tokens, n);
    cr_expect_eq(eng_seq_pos(a), n + 24, "every sampled token is in the context");
    cr_expect(r.reply_len == ref.len && memcmp(r.reply, ref.p, ref.len) == 0, "reply '%s' vs the loop's '%s'",
              r.reply, kds_buf_str(&ref));
    cr_expect(sn.text.len == r.reply_len && memcmp(sn.text.p, r.reply, r.reply_len) == 0,
              "the text hook's pieces are not the reply");
    size_t na, nb;
    void *sa = state(a, &na), *sb = state(b, &nb);
    cr_expect(na == nb && memcmp(sa, sb, na) == 0, "state bytes differ from the plain loop's");
    free(sa);
    free(sb);
    srv_turn_result_free(&r);
    kds_buf_free(&ref);
    kds_buf_free(&sn.text);
    /* keep_context false: the last token is drawn, not fed */
    eng_seq *c;
    cr_assert_eq(eng_seq_create(f.m, 7, &c, &e), KDS_OK);
    tp.keep_context = false;
    cr_assert_eq(srv_turn_run(f.c, c, f.tok, ids, n, &tp, NULL, &r, &e), KDS_OK, "%s", e.msg);
    cr_expect_eq(eng_seq_pos(c), n + 23);
    srv_turn_result_free(&r);
    /* nothing to continue from */
    eng_seq *empty;
    cr_assert_eq(eng_seq_create(f.m, 1, &empty, &e), KDS_OK);
    cr_expect_eq(srv_turn_run(f.c, empty, f.tok, NULL, 0, &tp, NULL, &r, &e), KDS_INVALID_ARG);
    cr_expect(strstr(e.msg, "empty"), "%s", e.msg);
    cr_expect_null(r.reply);
    eng_seq_free(a);
    eng_seq_free(b);
    eng_seq_free(c);
    eng_seq_free(empty);
    free(ids);
    close_fixture(&f);
}

/* A chat reply cut short (max_tokens, go_on) ends on <|im_end|>: the state
 * is the loop's followed by a decode of <|im_end|>; a stop before the
 * first draw closes the turn at once. */
Test(srv_turn, chat_reply_cut_short_is_closed, .timeout = 60) {
    fixture f = open_default();
    kds_err e = {0};
    cr_assert(eng_chat_supported(f.tok), "the default model's tokenizer has no chat format");
    int32_t im_end = eng_tok_special_id(f.tok, "<|im_end|>");
    int32_t *ids = NULL;
    int64_t n = 0;
    const char *msg = "Tell me about the whale.";
    cr_assert_eq(eng_chat_turn(f.tok, true, 0, NULL, msg, strlen(msg), true, &ids, &n, &e), KDS_OK);
    srv_turn_params tp = srv_turn_default_params();
    tp.sampler.temperature = 0.0f;
    tp.reply.chat = true;
    tp.reply.ignore_eos = true;
    for (int stop_after = -1; stop_after <= 5; stop_after += 5) {
        /* -1: max_tokens ends it (12); 0: go_on says no before any draw; 5: after 5 */
        int want = stop_after < 0 ? 12 : stop_after;
        tp.reply.max_tokens = 12;
        eng_seq *a, *b;
        cr_assert_eq(eng_seq_create(f.m, 3, &a, &e), KDS_OK);
        cr_assert_eq(eng_seq_create(f.m, 3, &b, &e), KDS_OK);
        seen sn = {.stop_after = stop_after};
        srv_turn_hooks h = {.user = &sn, .go_on = on_go_on, .drawn = on_drawn};
        srv_turn_result r;
        cr_assert_eq(srv_turn_run(f.c, a, f.tok, ids, n, &tp, &h, &r, &e), KDS_OK, "%s", e.msg);
        cr_expect_str_eq(r.reason, stop_after < 0 ? "length" : "interrupt", "stop_after %d", stop_after);
        cr_expect_eq(r.tokens, want, "stop_after %d: %lld tokens", stop_after, (long long)r.tokens);
        kds_buf ref = {0};
        plain_loop(&f, b, ids, n, want, &tp.sampler, &ref);
        cr_assert_eq(eng_decode(f.c, b, im_end, &e), KDS_OK, "%s", e.msg);
        cr_expect_eq(eng_seq_pos(a), n + want + 1, "stop_after %d: context", stop_after);
        size_t na, nb;
        void *sa = state(a, &na), *sb = state(b, &nb);
        cr_expect(na == nb && memcmp(sa, sb, na) == 0,
                  "stop_after %d: not the loop's state closed with <|im_end|>", stop_after);
        free(sa);
        free(sb);
        kds_buf_free(&ref);
        srv_turn_result_free(&r);
        eng_seq_free(a);
        eng_seq_free(b);
    }
    free(ids);
    close_fixture(&f);
}

/* srv_turn_save: the turn is the session's new head, its transcript entry
 * what the turn was; a second save from the same base forks. */
Test(srv_turn, saved_turn_is_the_head_with_its_transcript, .timeout = 60) {
    fixture f = open_default();
    kds_err e = {0};
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db");
    sess_params sp = sess_default_params();
    sess_store *st = NULL;
    cr_assert_eq(sess_open(db, &sp, &st, &e), KDS_OK, "%s", e.msg);
    int32_t *ids = NULL;
    int64_t n = 0;
    const char *text = "Call me Ishmael.";
    cr_assert_eq(eng_chat_turn(f.tok, false, 0, NULL, text, strlen(text), true, &ids, &n, &e), KDS_OK);
    eng_seq *s;
    cr_assert_eq(eng_seq_create(f.m, 5, &s, &e), KDS_OK);
    srv_turn_params tp = srv_turn_default_params();
    tp.reply.max_tokens = 10;
    tp.reply.ignore_eos = true;
    srv_turn_result r;
    cr_assert_eq(srv_turn_run(f.c, s, f.tok, ids, n, &tp, NULL, &r, &e), KDS_OK, "%s", e.msg);
    sess_save_result res;
    cr_assert_eq(srv_turn_save(st, "t1", 0, f.m, s, text, strlen(text), false, &tp, &r, &res, &e),
                 KDS_OK, "%s", e.msg);
    cr_expect_str_eq(res.session, "t1");
    cr_expect(!res.forked);
    sess_session_info si;
    cr_assert_eq(sess_session_get(st, "t1", &si, &e), KDS_OK, "%s", e.msg);
    cr_expect_eq(si.head, res.snapshot);
    cr_expect_eq(si.tokens, eng_seq_pos(s));
    cr_expect(si.has_sampler && si.sampler.temperature == tp.sampler.temperature);
    sess_turn_record *t = NULL;
    size_t nt = 0;
    cr_assert_eq(sess_transcript(st, "t1", &t, &nt, &e), KDS_OK, "%s", e.msg);
    cr_assert_eq(nt, 1);
    cr_expect_str_eq(t[0].prompt, text);
    cr_expect_str_eq(t[0].output, r.reply);
    cr_expect_eq(t[0].prompt_tokens, n);
    cr_expect_eq(t[0].output_tokens, 10);
    sess_transcript_free(t, nt);
    /* another turn from the same base: the session moved on, so a fork */
    cr_assert_eq(srv_turn_save(st, "t1", 0, f.m, s, text, strlen(text), false, &tp, &r, &res, &e),
                 KDS_OK, "%s", e.msg);
    cr_expect(res.forked, "saved over a session that moved on");
    cr_expect_str_neq(res.session, "t1");
    srv_turn_result_free(&r);
    eng_seq_free(s);
    free(ids);
    sess_close(st);
    tmu_rmtree(tmp);
    free(db);
    free(tmp);
    close_fixture(&f);
}
