/*
 * The optional `mode` field of a session record (docs/snapshot-format.md):
 * a save whose turn declares a mode records it, later saves that declare
 * none keep it, a fork and an export/import carry it, a session that never
 * declared one reads as "", and a malformed mode is refused before anything
 * is written.
 */
#include "test_sess_util.h"

static void expect_mode(sess_store *st, const char *name, const char *mode) {
    sess_session_info si;
    kds_err err = {0};
    cr_assert_eq(sess_session_get(st, name, &si, &err), KDS_OK, "%s", err.msg);
    cr_expect_str_eq(si.mode, mode, "session '%s'", name);
}

Test(sess_mode, recorded_kept_forked_exported, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db"), *file = tmu_path(tmp, "x.kds");
    tsu_model f = tsu_open_model(TMU_MICRO_KDA);
    sess_store *st = tsu_open_store(db);
    eng_seq *s = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_seq_create(f.m, 1, &s, &err), KDS_OK);
    uint64_t base = 0;

    /* never declared: "" */
    tsu_feed(&f, s, 5, 1);
    sess_turn plain = {.prompt = "a", .prompt_len = 1, .output = "", .prompt_tokens = 5};
    cr_assert_eq(sess_save(st, "old", 0, f.m, s, &plain, &base, &err), KDS_OK, "%s", err.msg);
    expect_mode(st, "old", "");
    /* declared later: recorded */
    tsu_feed(&f, s, 3, 2);
    plain.mode = "plain";
    cr_assert_eq(sess_save(st, "old", base, f.m, s, &plain, &base, &err), KDS_OK, "%s", err.msg);
    expect_mode(st, "old", "plain");

    /* chat declared, then saves without a turn or without a mode keep it */
    eng_seq_reset(s, 1);
    tsu_feed(&f, s, 4, 3);
    sess_turn chat = {.prompt = "b", .prompt_len = 1, .output = "", .mode = "chat"};
    uint64_t cb = 0;
    cr_assert_eq(sess_save(st, "c", 0, f.m, s, &chat, &cb, &err), KDS_OK, "%s", err.msg);
    expect_mode(st, "c", "chat");
    tsu_feed(&f, s, 2, 4);
    cr_assert_eq(sess_save(st, "c", cb, f.m, s, NULL, &cb, &err), KDS_OK, "%s", err.msg);
    tsu_feed(&f, s, 2, 5);
    chat.mode = NULL;
    cr_assert_eq(sess_save(st, "c", cb, f.m, s, &chat, &cb, &err), KDS_OK, "%s", err.msg);
    expect_mode(st, "c", "chat");

    /* a fork carries it; so does an export and import */
    cr_assert_eq(sess_fork(st, "c", "c2", NULL, &err), KDS_OK, "%s", err.msg);
    expect_mode(st, "c2", "chat");
    /* and a restore of one of its snapshots ("@N": the server's restore,
     * the REPL's /restore, snap fork) takes the mode of the session that
     * wrote it */
    char at[32], made[SESS_NAME_MAX + 1];
    snprintf(at, sizeof at, "@%llu", (unsigned long long)cb);
    cr_assert_eq(sess_fork(st, at, NULL, made, &err), KDS_OK, "%s", err.msg);
    expect_mode(st, made, "chat");
    cr_assert_eq(sess_export(st, "c", file, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(sess_import(st, file, "c3", NULL, NULL, &err), KDS_OK, "%s", err.msg);
    expect_mode(st, "c3", "chat");

    /* malformed modes: refused, nothing written (head and mode unchanged) */
    const char *bad[] = {"", "Chat", "chat mode", "abcdefghijklmnop", NULL};
    for (int i = 0; bad[i]; i++) {
        tsu_feed(&f, s, 1, 6);
        sess_turn t = {.prompt = "x", .prompt_len = 1, .output = "", .mode = bad[i]};
        uint64_t id = 0;
        cr_expect_eq(sess_save(st, "c", cb, f.m, s, &t, &id, &err), KDS_INVALID_ARG,
                     "mode '%s' accepted", bad[i]);
        cr_expect(strstr(err.msg, "invalid session mode"), "%s", err.msg);
    }
    sess_session_info si;
    cr_assert_eq(sess_session_get(st, "c", &si, &err), KDS_OK);
    cr_expect_eq(si.head, cb);
    cr_expect_str_eq(si.mode, "chat");
    /* and the records read back after reopening the store */
    sess_close(st);
    st = tsu_open_store(db);
    expect_mode(st, "old", "plain");
    expect_mode(st, "c2", "chat");

    eng_seq_free(s);
    sess_close(st);
    tsu_close_model(&f);
    tmu_rmtree(tmp);
    free(tmp);
    free(db);
    free(file);
}

/* sess_session_chat_mode, the one rule the REPL and the server follow: the
 * recorded mode; for an undeclared session the format of its first turn
 * (a plain turn's token count is the text's plain encoding); with no turn,
 * the fallback; chat on a tokenizer without a chat format, and unknown
 * modes, refused with the session named. */
Test(sess_mode, chat_mode_rule, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db");
    tsu_model f = tsu_open_model(KDS_SOURCE_DIR "/models/default"); /* has a chat format */
    tsu_model nf = tsu_open_model(TMU_MICRO_KDA);                  /* has none */
    const eng_tokenizer *tok = eng_model_tokenizer(f.m);
    cr_assert(eng_chat_supported(tok), "the default model should have a chat format");
    cr_assert(!eng_chat_supported(eng_model_tokenizer(nf.m)));
    sess_store *st = tsu_open_store(db);
    eng_seq *s = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_seq_create(f.m, 1, &s, &err), KDS_OK);
    tsu_feed(&f, s, 4, 1);
    const char *text = "hello there";
    int64_t plain_n = eng_tok_encode(tok, text, strlen(text), NULL, 0);
    cr_assert_gt(plain_n, 0);
    uint64_t id;
    /* undeclared, first turn fed as plain text / with chat markup / no turn */
    sess_turn t = {.prompt = text, .prompt_len = strlen(text), .output = "",
                   .prompt_tokens = plain_n};
    cr_assert_eq(sess_save(st, "u-plain", 0, f.m, s, &t, &id, &err), KDS_OK, "%s", err.msg);
    t.prompt_tokens = plain_n + 5;
    cr_assert_eq(sess_save(st, "u-chat", 0, f.m, s, &t, &id, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(sess_save(st, "u-none", 0, f.m, s, NULL, &id, &err), KDS_OK, "%s", err.msg);
    t.mode = "chat";
    cr_assert_eq(sess_save(st, "d-chat", 0, f.m, s, &t, &id, &err), KDS_OK, "%s", err.msg);
    t.mode = "plain";
    t.prompt_tokens = plain_n + 5; /* declared wins over the guess */
    cr_assert_eq(sess_save(st, "d-plain", 0, f.m, s, &t, &id, &err), KDS_OK, "%s", err.msg);
    struct { const char *name; bool fallback, want; } cases[] = {
        {"u-plain", true, false}, {"u-chat", false, true}, {"u-none", true, true},
        {"u-none", false, false}, {"d-chat", false, true}, {"d-plain", true, false}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        sess_session_info si;
        bool chat = !cases[i].want;
        cr_assert_eq(sess_session_get(st, cases[i].name, &si, &err), KDS_OK, "%s", err.msg);
        cr_expect_eq(sess_session_chat_mode(st, &si, tok, cases[i].fallback, &chat, &err), KDS_OK,
                     "%s: %s", cases[i].name, err.msg);
        cr_expect_eq(chat, cases[i].want, "%s (fallback %d): chat %d", cases[i].name,
                     cases[i].fallback, chat);
    }
    /* chat mode without a chat format, and a mode from a newer writer */
    sess_session_info si;
    cr_assert_eq(sess_session_get(st, "d-chat", &si, &err), KDS_OK, "%s", err.msg);
    bool chat = true;
    cr_expect_eq(sess_session_chat_mode(st, &si, eng_model_tokenizer(nf.m), false, &chat, &err),
                 KDS_UNSUPPORTED);
    cr_expect(strstr(err.msg, "d-chat") && strstr(err.msg, "chat format"), "%s", err.msg);
    cr_expect(!chat);
    snprintf(si.mode, sizeof si.mode, "poetry");
    cr_expect_eq(sess_session_chat_mode(st, &si, tok, true, &chat, &err), KDS_UNSUPPORTED);
    cr_expect(strstr(err.msg, "poetry"), "%s", err.msg);
    cr_expect(chat, "an unknown mode leaves the fallback");
    eng_seq_free(s);
    sess_close(st);
    tsu_close_model(&f);
    tsu_close_model(&nf);
    tmu_rmtree(tmp);
    free(db);
    free(tmp);
}

/* The optional `sampler` field: recorded by a turn that declares settings,
 * kept by saves that declare none, carried by a fork, a restore of "@N" and
 * an export and import; settings out of range are refused, nothing written. */
static void expect_sampler(sess_store *st, const char *name, const eng_sampler_params *want) {
    sess_session_info si;
    kds_err err = {0};
    cr_assert_eq(sess_session_get(st, name, &si, &err), KDS_OK, "%s", err.msg);
    cr_assert(si.has_sampler, "session '%s' has no recorded sampler", name);
    cr_expect(si.sampler.temperature == want->temperature && si.sampler.top_k == want->top_k &&
                  si.sampler.top_p == want->top_p && si.sampler.min_p == want->min_p &&
                  si.sampler.repeat_penalty == want->repeat_penalty &&
                  si.sampler.repeat_last_n == want->repeat_last_n,
              "session '%s': temperature %g top_k %d top_p %g", name, si.sampler.temperature,
              si.sampler.top_k, si.sampler.top_p);
}

Test(sess_mode, sampler_recorded_kept_forked_exported, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db"), *file = tmu_path(tmp, "x.kds");
    tsu_model f = tsu_open_model(TMU_MICRO_KDA);
    sess_store *st = tsu_open_store(db);
    eng_seq *s = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_seq_create(f.m, 1, &s, &err), KDS_OK);
    uint64_t head = 0;
    tsu_feed(&f, s, 4, 1);
    sess_turn t = {.prompt = "a", .prompt_len = 1, .output = ""};
    cr_assert_eq(sess_save(st, "s", 0, f.m, s, &t, &head, &err), KDS_OK, "%s", err.msg);
    sess_session_info si;
    cr_assert_eq(sess_session_get(st, "s", &si, &err), KDS_OK);
    cr_expect_not(si.has_sampler, "nothing declared, nothing recorded");

    eng_sampler_params sp = eng_sampler_default_params();
    sp.temperature = 1.3f; /* not a float32 round number: kept exactly */
    sp.top_k = 7;
    sp.top_p = 0.91f;
    sp.min_p = 0.0f;
    sp.repeat_penalty = 1.17f;
    sp.repeat_last_n = 33;
    t.sampler = &sp;
    tsu_feed(&f, s, 2, 2);
    cr_assert_eq(sess_save(st, "s", head, f.m, s, &t, &head, &err), KDS_OK, "%s", err.msg);
    expect_sampler(st, "s", &sp);
    t.sampler = NULL; /* a save that declares none keeps them */
    tsu_feed(&f, s, 2, 3);
    cr_assert_eq(sess_save(st, "s", head, f.m, s, &t, &head, &err), KDS_OK, "%s", err.msg);
    expect_sampler(st, "s", &sp);

    cr_assert_eq(sess_fork(st, "s", "s2", NULL, &err), KDS_OK, "%s", err.msg);
    expect_sampler(st, "s2", &sp);
    char at[32], made[SESS_NAME_MAX + 1];
    snprintf(at, sizeof at, "@%llu", (unsigned long long)head);
    cr_assert_eq(sess_fork(st, at, NULL, made, &err), KDS_OK, "%s", err.msg);
    expect_sampler(st, made, &sp);
    cr_assert_eq(sess_export(st, "s", file, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(sess_import(st, file, "s3", NULL, NULL, &err), KDS_OK, "%s", err.msg);
    expect_sampler(st, "s3", &sp);

    /* out of range: refused, head and settings unchanged */
    eng_sampler_params bad[4];
    for (int i = 0; i < 4; i++) bad[i] = sp;
    bad[0].temperature = -1;
    bad[1].top_p = 1.5f;
    bad[2].repeat_last_n = 65;
    bad[3].min_p = 0.0f / 0.0f; /* NaN */
    for (int i = 0; i < 4; i++) {
        t.sampler = &bad[i];
        tsu_feed(&f, s, 1, 10 + i);
        cr_expect_eq(sess_save(st, "s", head, f.m, s, &t, NULL, &err), KDS_INVALID_ARG,
                     "bad sampler %d accepted", i);
        cr_expect(strstr(err.msg, "sampler settings out of range"), "%s", err.msg);
    }
    cr_assert_eq(sess_session_get(st, "s", &si, &err), KDS_OK);
    cr_expect_eq(si.head, head);
    expect_sampler(st, "s", &sp);
    eng_seq_free(s);
    sess_close(st);
    tsu_close_model(&f);
    free(db);
    free(file);
    tmu_rmtree(tmp);
    free(tmp);
}

/* A document turn (the server's `append`): its name and size are recorded
 * with the turn, read back (also after reopening and through export and
 * import), other turns have none, and a name over SESS_DOC_NAME_MAX bytes is
 * refused before anything is written. */
Test(sess_mode, document_turn_recorded_and_exported, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *db = tmu_path(tmp, "db"), *file = tmu_path(tmp, "d.kds");
    tsu_model f = tsu_open_model(TMU_MICRO_KDA);
    sess_store *st = tsu_open_store(db);
    eng_seq *s = NULL;
    kds_err err = {0};
    cr_assert_eq(eng_seq_create(f.m, 1, &s, &err), KDS_OK);
    uint64_t base = 0;
    tsu_feed(&f, s, 5, 1);
    const char *text = "the whole text of a document";
    sess_turn doc = {.prompt = text,
                     .prompt_len = strlen(text),
                     .output = "",
                     .prompt_tokens = 5,
                     .doc_name = "notes.txt",
                     .doc_bytes = (int64_t)strlen(text)};
    cr_assert_eq(sess_save(st, "d", 0, f.m, s, &doc, &base, &err), KDS_OK, "%s", err.msg);
    tsu_feed(&f, s, 2, 2);
    sess_turn plain = {.prompt = "q", .prompt_len = 1, .output = "a", .prompt_tokens = 1};
    cr_assert_eq(sess_save(st, "d", base, f.m, s, &plain, &base, &err), KDS_OK, "%s", err.msg);

    char big[SESS_DOC_NAME_MAX + 2];
    memset(big, 'n', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    tsu_feed(&f, s, 1, 3);
    sess_turn bad = doc;
    bad.doc_name = big;
    uint64_t id = 0;
    cr_expect_eq(sess_save(st, "d", base, f.m, s, &bad, &id, &err), KDS_INVALID_ARG,
                 "a %zu-byte document name was accepted", strlen(big));

    cr_assert_eq(sess_export(st, "d", file, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(sess_import(st, file, "d2", NULL, NULL, &err), KDS_OK, "%s", err.msg);
    sess_close(st);
    st = tsu_open_store(db);
    const char *names[] = {"d", "d2"};
    for (int k = 0; k < 2; k++) {
        sess_turn_record *t = NULL;
        size_t n = 0;
        cr_assert_eq(sess_transcript(st, names[k], &t, &n, &err), KDS_OK, "%s", err.msg);
        cr_assert_eq(n, 2, "session '%s' has %zu turns", names[k], n);
        cr_expect_str_eq(t[0].doc_name, "notes.txt", "session '%s'", names[k]);
        cr_expect_eq(t[0].doc_bytes, (int64_t)strlen(text));
        cr_expect_eq(t[0].prompt_len, strlen(text));
        cr_expect(!memcmp(t[0].prompt, text, strlen(text)), "the document's text");
        cr_expect_str_eq(t[1].doc_name, "", "a turn that is no document");
        cr_expect_eq(t[1].doc_bytes, 0);
        sess_transcript_free(t, n);
    }
    eng_seq_free(s);
    sess_close(st);
    tsu_close_model(&f);
    tmu_rmtree(tmp);
    free(tmp);
    free(db);
    free(file);
}
