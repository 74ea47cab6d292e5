/*
 * srv_turn.c - one turn on one sequence (srv.h, "One turn on one
 * sequence"): the loop the REPL and `generate` share. The server runs the
 * same steps for many streams at once in its batching loop (one srv_reply
 * each); here they run for one, with a decode per token.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kds_buf.h"
#include "srv.h"
#include "kds_clock.h"

srv_turn_params srv_turn_default_params(void) {
    return (srv_turn_params){.reply = srv_reply_default_params(),
                             .sampler = eng_sampler_default_params(),
                             .keep_context = true};
}

void srv_turn_result_free(srv_turn_result *r) {
    if (!r) return;
    free(r->reply);
    memset(r, 0, sizeof *r);
}

static void show(const srv_turn_hooks *h, const char *text, size_t len) {
    if (h && h->text && len) h->text(h->user, text, len);
}

kds_status srv_turn_run(eng_ctx *c, eng_seq *s, const eng_tokenizer *tok, const int32_t *ids,
                        int64_t n, const srv_turn_params *p, const srv_turn_hooks *hooks,
                        srv_turn_result *out, kds_err *err) {
    memset(out, 0, sizeof *out);
    if (n == 0 && eng_seq_pos(s) == 0)
        return kds_err_set(err, KDS_INVALID_ARG,
                           "nothing to continue from: the context and the prompt are empty");
    srv_reply *rp = NULL;
    kds_status rc = srv_reply_create(tok, &p->reply, &rp, err);
    if (rc != KDS_OK) return rc;
    const char *reason = "length";
    int64_t drawn = 0;
    bool stop_token = false;
    double t0 = kds_now_s();
    if (n > 0 && (rc = eng_prefill(c, s, ids, n, NULL, NULL, NULL, err)) != KDS_OK) goto fail;
    double t1 = kds_now_s();
    /* SRV_CLOSE: the reply ended and a chat reply is closed (max_tokens 0
     * ends it before any draw) */
    srv_after after = p->reply.max_tokens > 0 ? SRV_DECODE : SRV_CLOSE;
    while (after == SRV_DECODE) {
        if (hooks && hooks->go_on && !hooks->go_on(hooks->user)) {
            reason = "interrupt";
            after = SRV_CLOSE;
            break;
        }
        int32_t next;
        if ((rc = eng_sample(c, s, &p->sampler, &next, err)) != KDS_OK) goto fail;
        drawn++;
        if (hooks && hooks->drawn) hooks->drawn(hooks->user, eng_seq_logits(s), next);
        srv_step st;
        if ((rc = srv_reply_token(rp, next, &st, err)) != KDS_OK) goto fail;
        show(hooks, st.text, st.len);
        after = st.after;
        if (st.reason) reason = st.reason;
        stop_token = after == SRV_FINISH;
        /* the last token is fed only when the context must stay whole */
        if ((after == SRV_DECODE || p->keep_context) &&
            (rc = eng_decode(c, s, st.feed, err)) != KDS_OK)
            goto fail;
    }
    /* a chat reply cut short (length, a stop string, interrupt) is closed,
     * so the context ends on a finished turn and the next one renders on */
    int32_t close = srv_reply_close_token(rp);
    if (after == SRV_CLOSE && close >= 0 && p->keep_context &&
        (rc = eng_decode(c, s, close, err)) != KDS_OK)
        goto fail;
    size_t len;
    const char *rest = srv_reply_finish(rp, &len);
    show(hooks, rest, len);
    const char *text = srv_reply_text(rp, &len);
    if (!(out->reply = malloc(len + 1))) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory keeping the reply");
        goto fail;
    }
    memcpy(out->reply, text, len + 1);
    out->reply_len = len;
    out->reason = reason;
    out->prompt_tokens = n;
    out->drawn = drawn;
    out->tokens = srv_reply_produced(rp) - (stop_token ? 1 : 0);
    out->prefill_s = t1 - t0;
    out->decode_s = kds_now_s() - t1;
    srv_reply_free(rp);
    return KDS_OK;
fail:
    srv_reply_free(rp);
    srv_turn_result_free(out);
    return rc;
}

kds_status srv_turn_save(sess_store *st, const char *session, uint64_t base, const eng_model *m,
                         const eng_seq *s, const char *prompt, size_t prompt_len, bool chat,
                         const srv_turn_params *p, const srv_turn_result *r, sess_save_result *res,
                         kds_err *err) {
    sess_turn turn = {.prompt = prompt,
                      .prompt_len = prompt_len,
                      .output = r->reply ? r->reply : "",
                      .output_len = r->reply_len,
                      .prompt_tokens = r->prompt_tokens,
                      .output_tokens = r->tokens,
                      .mode = chat ? "chat" : "plain",
                      .sampler = &p->sampler};
    return sess_save_ex(st, session, base, m, s, &turn, SESS_CONFLICT_FORK, res, err);
}
