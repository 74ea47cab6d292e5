/*
 * fuzz_http_api.c - libFuzzer target: the body of an OpenAI-compatible
 * request (POST /v1/chat/completions or /v1/completions, docs/http-api.md)
 * as the server reads it: web__parse (the JSON checks every request
 * passes), then web__oai_parse (web/web_openai.c) with the bundled default
 * model's tokenizer, whose chat format renders the messages. The input's
 * first byte picks the endpoint (bit 0: 0 chat, 1 completions); the rest is
 * the body.
 *
 * Properties beyond no crash, leak or undefined behaviour:
 *   - a refusal has an HTTP status of 400-499 and a message that is
 *     non-empty, valid UTF-8 and without NUL (it goes into a JSON error
 *     body as it is);
 *   - an accepted request has at least one token, every id inside the
 *     vocabulary, at most WEB_STOP_COUNT stop strings of at most
 *     WEB_STOP_MAX bytes, sampling settings in OpenAI's ranges, and a
 *     prompt text that is valid UTF-8;
 *   - the same body parsed again gives the same tokens (no hidden state).
 */
#include "fuzz_util.h"

#include <math.h>

#include "eng_tokenizer.h"
#include "web_internal.h"

#define BODY_MAX 16384

static eng_tokenizer *tok;
static eng_config cfg;

int LLVMFuzzerInitialize(int *argc, char **argv[]) {
    (void)argc, (void)argv;
    kds_err e = {0};
    char path[4096];
    snprintf(path, sizeof path, "%s/models/default/config.json", KDS_SOURCE_DIR);
    FILE *f = fopen(path, "rb");
    if (!f) fz_fail("cannot open %s", path);
    char json[65536];
    size_t n = fread(json, 1, sizeof json, f);
    fclose(f);
    if (eng_config_parse(json, n, path, &cfg, &e) != KDS_OK) fz_fail("%s", e.msg);
    snprintf(path, sizeof path, "%s/models/default", KDS_SOURCE_DIR);
    if (eng__tok_create_model(path, &cfg, &tok, &e) != KDS_OK) fz_fail("%s", e.msg);
    return 0;
}

static bool valid_utf8(const unsigned char *p, size_t n) {
    size_t i = 0;
    while (i < n) {
        int st;
        size_t k = eng__utf8_scan(p + i, n - i, &st);
        if (st != ENG_U8_OK || k == 0) return false;
        i += k;
    }
    return true;
}

static void check_refusal(const web_oai_err *e) {
    size_t n = strnlen(e->msg, sizeof e->msg);
    if (e->status < 400 || e->status > 499) fz_fail("refused with HTTP status %d", e->status);
    if (n == 0 || n == sizeof e->msg) fz_fail("refused without a message (or an unended one)");
    if (!valid_utf8((const unsigned char *)e->msg, n))
        fz_fail("the refusal's message is not valid UTF-8: %s", e->msg);
    if (!valid_utf8((const unsigned char *)e->param, strnlen(e->param, sizeof e->param)))
        fz_fail("the refusal's param is not valid UTF-8");
}

static void check_accepted(const web_oai *q) {
    if (q->n_ids < 1 || !q->ids) fz_fail("an accepted request has no tokens");
    for (int64_t i = 0; i < q->n_ids; i++)
        if (q->ids[i] < 0 || q->ids[i] >= cfg.vocab_size)
            fz_fail("token %lld of the request is %d, outside the vocabulary (%d)", (long long)i,
                    q->ids[i], cfg.vocab_size);
    if (q->n_stop < 0 || q->n_stop > WEB_STOP_COUNT) fz_fail("%d stop strings", q->n_stop);
    for (int i = 0; i < q->n_stop; i++)
        if (strnlen(q->stop[i], WEB_STOP_MAX + 1) > WEB_STOP_MAX) fz_fail("stop %d too long", i);
    const eng_sampler_params *sp = &q->sp;
    if (!(sp->temperature >= 0 && sp->temperature <= 2) || !(sp->top_p >= 0 && sp->top_p <= 1) ||
        !(sp->min_p >= 0 && sp->min_p <= 1) || !isfinite(sp->repeat_penalty) || sp->top_k < 0)
        fz_fail("sampling settings out of range (temperature %g, top_p %g)", sp->temperature,
                sp->top_p);
    if (q->max_tokens < -1) fz_fail("max_tokens %lld", (long long)q->max_tokens);
    if (q->prompt_len && !valid_utf8((const unsigned char *)q->prompt, q->prompt_len))
        fz_fail("the prompt text kept for the transcript is not valid UTF-8");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > BODY_MAX + 1) return 0;
    const web_route route = data[0] & 1 ? WEB_ROUTE_COMPLETIONS : WEB_ROUTE_CHAT;
    kds_err pe = {0};
    cJSON *body = web__parse(data + 1, size - 1, false, &pe);
    if (!body) {
        if (!pe.msg[0]) fz_fail("a body refused without a message");
        return 0;
    }
    web_oai q, again;
    web_oai_err e, e2;
    if (!web__oai_parse(body, route, tok, "default", &q, &e)) {
        check_refusal(&e);
        cJSON_Delete(body);
        return 0;
    }
    check_accepted(&q);
    if (!web__oai_parse(body, route, tok, "default", &again, &e2))
        fz_fail("the same body refused the second time: %s", e2.msg);
    if (again.n_ids != q.n_ids || memcmp(again.ids, q.ids, (size_t)q.n_ids * sizeof *q.ids))
        fz_fail("the same body gave other tokens the second time");
    web__oai_free(&again);
    web__oai_free(&q);
    cJSON_Delete(body);
    return 0;
}
