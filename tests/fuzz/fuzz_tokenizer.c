/*
 * fuzz_tokenizer.c - libFuzzer target: a model directory's tokenizer files
 * (tiktoken.model and tokenizer_config.json, eng__tok_create_model in
 * engine/eng_tokenizer.h) and text through the tokenizer they make. The
 * input is the rank file, FZ_SEP, the tokenizer config, FZ_SEP, a text (at
 * most 4 KiB of it is used, to keep each run short).
 *
 * Properties of a tokenizer that loads (eng.h states them):
 *   - decode(encode(text)) == text for any bytes, with and without special
 *     tokens allowed (a special decodes to its name);
 *   - the token count never exceeds the text's length;
 *   - streaming the ids gives valid UTF-8, and exactly the text when the
 *     text is valid UTF-8;
 *   - pre-token boundaries increase and end at the text's end.
 */
#include "fuzz_util.h"

#include "eng_tokenizer.h"

#define TEXT_MAX 4096

static eng_config cfg;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    kds_err e = {0};
    if (eng_config_parse(FZ_NANO_KDA, strlen(FZ_NANO_KDA), "nano", &cfg, &e) != KDS_OK) abort();
    /* room for a few hundred ranks and specials; bos/eos from the file */
    cfg.vocab_size = 1024;
    cfg.bos_token_id = cfg.eos_token_id = -1;
    return 0;
}

static bool valid_utf8(const unsigned char *p, size_t n) {
    size_t i = 0;
    while (i < n) {
        int st;
        size_t k = eng__utf8_scan(p + i, n - i, &st);
        if (st != ENG_U8_OK) return false;
        i += k;
    }
    return true;
}

static void round_trip(const eng_tokenizer *t, const char *text, size_t len, unsigned flags) {
    int32_t *ids = malloc((len ? len : 1) * sizeof *ids);
    char *back = NULL;
    if (!ids) abort();
    int64_t n = 0;
    kds_err e = {0};
    if (eng_tok_encode_ex(t, text, len, flags, ids, (int64_t)len, &n, &e) != KDS_OK) {
        /* the regex engine may give up on a pathological text: by name */
        if (!e.msg[0]) fz_fail("encode failed without a message");
        goto out;
    }
    if (n < 0 || (size_t)n > len) fz_fail("%lld tokens for %zu bytes", (long long)n, len);
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= eng_tok_vocab(t)) fz_fail("id %d outside the vocabulary", ids[i]);
    int64_t need = eng_tok_decode(t, ids, n, 0, NULL, 0);
    if (need != (int64_t)len) fz_fail("decode(encode(x)) has %lld bytes, x has %zu (flags %u)",
                                      (long long)need, len, flags);
    back = malloc(len + 1);
    if (!back) abort();
    if (eng_tok_decode(t, ids, n, 0, back, len) != (int64_t)len || memcmp(back, text, len) != 0)
        fz_fail("decode(encode(x)) != x (flags %u)", flags);
    (void)eng_tok_decode(t, ids, n, ENG_TOK_SKIP_SPECIAL, back, len);

    /* streaming: valid UTF-8 always, the text itself when it was valid */
    eng_tok_stream *s = NULL;
    if (eng_tok_stream_create(t, 0, &s, &e) != KDS_OK) fz_fail("stream: %s", e.msg);
    size_t cap = 3 * len + 16, got = 0; /* U+FFFD is 3 bytes per bad byte at most */
    char *out = malloc(cap);
    if (!out) abort();
    for (int64_t i = 0; i < n; i++) {
        const char *p;
        size_t k;
        if (eng_tok_stream_put(s, ids[i], &p, &k, &e) != KDS_OK) fz_fail("stream put: %s", e.msg);
        if (got + k > cap) fz_fail("stream gave more than 3 bytes per input byte");
        memcpy(out + got, p, k);
        got += k;
    }
    size_t k;
    const char *p = eng_tok_stream_flush(s, &k);
    if (got + k > cap) fz_fail("stream gave more than 3 bytes per input byte");
    memcpy(out + got, p, k);
    got += k;
    if (!valid_utf8((const unsigned char *)out, got)) fz_fail("stream output is not valid UTF-8");
    if (valid_utf8((const unsigned char *)text, len) && (got != len || memcmp(out, text, len)))
        fz_fail("stream of a valid UTF-8 text is not the text (flags %u)", flags);
    free(out);
    eng_tok_stream_free(s);
out:
    free(back);
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz_part parts[3];
    if (fz_split(data, size, parts, 3) != 3) return 0;
    const char *dir = fz_subdir(0, "tok");
    fz_write_file(fz_path(1, "tok/tiktoken.model"), parts[0].p, parts[0].n);
    fz_write_file(fz_path(1, "tok/tokenizer_config.json"), parts[1].p, parts[1].n);
    eng_tokenizer *t = NULL;
    kds_err e = {0};
    if (eng__tok_create_model(dir, &cfg, &t, &e) != KDS_OK) {
        if (e.status == KDS_OK || !e.msg[0]) fz_fail("tokenizer refused without a message");
        return 0;
    }
    const char *text = (const char *)parts[2].p;
    size_t len = parts[2].n < TEXT_MAX ? parts[2].n : TEXT_MAX;
    round_trip(t, text, len, 0);
    round_trip(t, text, len, ENG_TOK_ALLOW_SPECIAL);

    size_t *ends = malloc((len ? len : 1) * sizeof *ends);
    int64_t n = 0;
    if (!ends) abort();
    if (eng_tok_split(t, text, len, ends, (int64_t)len, &n, &e) == KDS_OK) {
        if ((size_t)n > len) fz_fail("%lld pieces for %zu bytes", (long long)n, len);
        for (int64_t i = 0; i < n; i++)
            if (ends[i] > len || (i && ends[i] <= ends[i - 1]))
                fz_fail("piece end %zu out of order", ends[i]);
        if (len && (n == 0 || ends[n - 1] != len)) fz_fail("pieces do not end at the text's end");
    }
    free(ends);
    for (int32_t id = 0; id < eng_tok_vocab(t); id += 17) {
        size_t k;
        if (!eng_tok_piece(t, id, &k)) fz_fail("no piece for id %d", id);
        (void)eng_tok_is_special(t, id);
        (void)eng_tok_is_stop(t, id);
    }
    (void)eng_tok_special_id(t, "<|im_end|>");
    (void)eng_chat_supported(t);
    eng_tok_free(t);
    return 0;
}
