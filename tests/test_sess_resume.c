/*
 * Resume is exact, across processes, through the command line: on freshly
 * generated tiny (pure KDA) and tiny-hybrid models, `generate --session`
 * for N tokens in one turn, and for k tokens and then N - k more in a new
 * process (resumed from the snapshot, nothing replayed), print the same
 * text, sample from bit-identical logits (--logits-out), and leave
 * bit-identical states behind; greedy and seeded sampling (the RNG lives in
 * the state); also a Kimi K3 model (k3-micro). Also: stdout of generate with --session is that of plain
 * generate, and a multi-turn conversation with prompts in between matches
 * the same calls made on one in-process sequence.
 */
#include "test_sess_util.h"

static void compare_logits(const char *one, const char *const *parts, int n_parts,
                           int64_t want_rows) {
    int64_t rows, vocab;
    float *ref = tsu_read_logits(one, &rows, &vocab);
    cr_assert_eq(rows, want_rows, "one-go logits rows");
    int64_t at = 0;
    for (int i = 0; i < n_parts; i++) {
        int64_t r, v;
        float *x = tsu_read_logits(parts[i], &r, &v);
        cr_assert_eq(v, vocab);
        cr_assert_leq(at + r, rows);
        /* bit for bit: memcmp, not a tolerance */
        for (int64_t t = 0; t < r; t++)
            cr_assert_eq(memcmp(x + t * v, ref + (at + t) * vocab, (size_t)v * sizeof(float)), 0,
                         "logits of token %lld differ after resume (part %d)",
                         (long long)(at + t), i);
        at += r;
        free(x);
    }
    cr_assert_eq(at, rows, "split turns sampled %lld tokens, one go %lld", (long long)at,
                 (long long)rows);
    free(ref);
}

/* N tokens in one turn vs the same N split into turns of `split` tokens,
 * each turn in its own process. */
static void resume_across_processes_ex(const char *preset, const char *sampling,
                                       const int *split, int n_split, bool first_only) {
    char *tmp = tmu_mkdtemp();
    char *model = tsu_gen_model(tmp, "m", preset, 11);
    const char *prompt = "The quick brown fox";
    const char *common = "--ignore-eos --seed 7";
    int N = 0;
    for (int i = 0; i < n_split; i++) N += split[i];
    static char one[65536], plain[65536], part[65536], joined[65536];
    size_t n_one, n_plain, n_part, n_joined = 0;

    /* one go, as a session of one turn */
    cr_assert_eq(tsu_run(one, sizeof one, &n_one,
                         TSU_KDASERVE " generate --model %s --db %s/db1 --session one "
                                      "--prompt '%s' --max-tokens %d %s %s "
                                      "--logits-out %s/one.st 2>/dev/null",
                         model, tmp, prompt, N, common, sampling, tmp),
                 0);
    tsu_chomp(one, &n_one);
    /* plain generate prints the same (stdout carries only the text) */
    cr_assert_eq(tsu_run(plain, sizeof plain, &n_plain,
                         TSU_KDASERVE " generate --model %s --prompt '%s' --max-tokens %d %s %s "
                                      "2>/dev/null",
                         model, prompt, N, common, sampling),
                 0);
    tsu_chomp(plain, &n_plain);
    cr_assert_eq(n_plain, n_one);
    cr_assert_eq(memcmp(plain, one, n_one), 0, "--session changed stdout:\n%s\n%s", plain, one);

    /* the same tokens over several processes; later turns give no --model
     * (the session remembers it) and no prompt (just continue) */
    char parts[8][600];
    const char *pp[8];
    for (int i = 0; i < n_split; i++) {
        snprintf(parts[i], sizeof parts[i], "%s/part%d.st", tmp, i);
        pp[i] = parts[i];
        char first[1200];
        if (i == 0)
            snprintf(first, sizeof first, "--model %s --prompt '%s'", model, prompt);
        else
            first[0] = '\0';
        cr_assert_eq(tsu_run(part, sizeof part, &n_part,
                             TSU_KDASERVE " generate %s --db %s/db2 --session split "
                                          "--max-tokens %d %s %s --logits-out %s 2>/dev/null",
                             first, tmp, split[i], common,
                             i > 0 && first_only ? "" : sampling, parts[i]),
                     0, "turn %d", i);
        tsu_chomp(part, &n_part);
        memcpy(joined + n_joined, part, n_part);
        n_joined += n_part;
    }
    cr_assert_eq(n_joined, n_one, "%s %s: split text has %zu bytes, one go %zu", preset, sampling,
                 n_joined, n_one);
    cr_assert_eq(memcmp(joined, one, n_one), 0, "%s %s: text differs after resume:\n%.*s\n%.*s",
                 preset, sampling, (int)n_one, one, (int)n_joined, joined);
    char one_st[600];
    snprintf(one_st, sizeof one_st, "%s/one.st", tmp);
    compare_logits(one_st, pp, n_split, N);

    /* both sessions end in the same state, bit for bit (KDA states, conv
     * tails, logits, RNG, recent tokens, every MLA row) */
    tsu_model f = tsu_open_model(model);
    char db1[600], db2[600];
    snprintf(db1, sizeof db1, "%s/db1", tmp);
    snprintf(db2, sizeof db2, "%s/db2", tmp);
    sess_store *s1 = tsu_open_store(db1), *s2 = tsu_open_store(db2);
    sess_session_info a, b;
    kds_err err = {0};
    cr_assert_eq(sess_session_get(s1, "one", &a, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(sess_session_get(s2, "split", &b, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(a.tokens, b.tokens);
    cr_assert_eq(b.turns, (uint32_t)n_split);
    size_t na, nb;
    unsigned char *sa = tsu_snapshot_state(s1, a.head, &f, &na);
    unsigned char *sb = tsu_snapshot_state(s2, b.head, &f, &nb);
    cr_assert_eq(na, nb);
    cr_assert_eq(memcmp(sa, sb, na), 0, "final states differ");
    free(sa);
    free(sb);
    sess_close(s1);
    sess_close(s2);
    tsu_close_model(&f);
    free(model);
    tmu_rmtree(tmp);
    free(tmp);
}

static void resume_across_processes(const char *preset, const char *sampling,
                                    const int *split, int n_split) {
    resume_across_processes_ex(preset, sampling, split, n_split, false);
}

static const int SPLIT2[] = {9, 15};
static const int SPLIT3[] = {5, 1, 18};

Test(sess_resume, greedy_pure, .timeout = 60) {
    resume_across_processes("tiny", "--temperature 0", SPLIT2, 2);
}
Test(sess_resume, sampled_pure, .timeout = 60) {
    resume_across_processes("tiny", "--temperature 1 --top-k 0 --min-p 0 --top-p 1", SPLIT2, 2);
}
Test(sess_resume, greedy_hybrid, .timeout = 60) {
    resume_across_processes("tiny-hybrid", "--temperature 0", SPLIT3, 3);
}
Test(sess_resume, sampled_hybrid, .timeout = 60) {
    resume_across_processes("tiny-hybrid", "--temperature 0.9 --top-k 40 --repeat-penalty 1.1",
                            SPLIT3, 3);
}

/* Kimi K3 (AttnRes, latent MoE with MXFP4 experts, SiTU, the gates): its
 * session state is the same kind (KDA states, conv tails, MLA rows; the
 * AttnRes snapshots are per pass), so resume is exact the same way. */
Test(sess_resume, greedy_k3, .timeout = 120) {
    resume_across_processes("k3-micro", "--temperature 0", SPLIT3, 3);
}
Test(sess_resume, sampled_k3, .timeout = 120) {
    resume_across_processes("k3-micro", "--temperature 0.9 --top-k 40 --repeat-penalty 1.1",
                            SPLIT2, 2);
}

/* Turns with prompts in between: the session's snapshots reproduce one
 * in-process sequence fed the same prompts and sampled the same way. */
Test(sess_resume, turns_with_prompts_match_one_sequence, .timeout = 60) {
    char *tmp = tmu_mkdtemp();
    char *model = tsu_gen_model(tmp, "m", "tiny-hybrid", 5);
    const char *prompts[3] = {"Hello", " and then", ""};
    const int gen[3] = {6, 4, 5};
    static char out[3][4096];
    size_t n_out[3];
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(tsu_run(out[i], sizeof out[i], &n_out[i],
                             TSU_KDASERVE " generate --model %s --db %s/db --session s "
                                          "--prompt '%s' --max-tokens %d --seed 3 --temperature 1 "
                                          "--ignore-eos 2>/dev/null",
                             model, tmp, prompts[i], gen[i]),
                     0);
        tsu_chomp(out[i], &n_out[i]);
    }
    /* the same conversation on one sequence, in this process */
    tsu_model f = tsu_open_model(model);
    kds_err err = {0};
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 3, &s, &err), KDS_OK);
    eng_sampler_params sp = eng_sampler_default_params();
    sp.temperature = 1.0f;
    const eng_tokenizer *tok = eng_model_tokenizer(f.m);
    for (int i = 0; i < 3; i++) {
        int32_t ids[64];
        int64_t n = eng_tok_encode(tok, prompts[i], strlen(prompts[i]), ids, 64);
        if (n) cr_assert_eq(eng_prefill(f.c, s, ids, n, NULL, NULL, NULL, &err), KDS_OK);
        char text[4096];
        size_t tn = 0;
        /* generate prints through a UTF-8-safe stream and escapes control bytes */
        eng_tok_stream *ts = NULL;
        cr_assert_eq(eng_tok_stream_create(tok, 0, &ts, &err), KDS_OK);
        for (int t = 0; t <= gen[i]; t++) {
            size_t len;
            const char *p;
            if (t < gen[i]) {
                int32_t next;
                cr_assert_eq(eng_sample(f.c, s, &sp, &next, &err), KDS_OK);
                cr_assert_eq(eng_decode(f.c, s, next, &err), KDS_OK);
                cr_assert_eq(eng_tok_stream_put(ts, next, &p, &len, &err), KDS_OK);
            } else {
                p = eng_tok_stream_flush(ts, &len);
            }
            for (size_t j = 0; j < len; j++) {
                unsigned char ch = (unsigned char)p[j];
                if ((ch < 0x20 && ch != '\n' && ch != '\t') || ch == 0x7f)
                    tn += (size_t)snprintf(text + tn, sizeof text - tn, "\\x%02x", ch);
                else
                    text[tn++] = (char)ch;
            }
        }
        eng_tok_stream_free(ts);
        cr_assert_eq(tn, n_out[i], "turn %d", i);
        cr_assert_eq(memcmp(text, out[i], tn), 0, "turn %d differs", i);
    }
    char db[600];
    snprintf(db, sizeof db, "%s/db", tmp);
    sess_store *st = tsu_open_store(db);
    sess_session_info si;
    cr_assert_eq(sess_session_get(st, "s", &si, &err), KDS_OK);
    cr_assert_eq(si.tokens, eng_seq_pos(s));
    size_t n;
    unsigned char *saved = tsu_snapshot_state(st, si.head, &f, &n);
    unsigned char *mine = malloc(n);
    cr_assert_eq(eng_seq_state_bytes(s), n);
    cr_assert_eq(eng_seq_state_save(s, mine, n, &err), KDS_OK);
    cr_assert_eq(memcmp(saved, mine, n), 0, "session state differs from the in-process one");
    /* the transcript has what generate did */
    sess_turn_record *tr = NULL;
    size_t nt = 0;
    cr_assert_eq(sess_transcript(st, "s", &tr, &nt, &err), KDS_OK, "%s", err.msg);
    cr_assert_eq(nt, 3);
    cr_assert_str_eq(tr[1].prompt, " and then");
    cr_assert_eq(tr[2].prompt_len, 0);
    cr_assert_eq(tr[0].output_tokens, gen[0]);
    cr_assert_eq(tr[2].snapshot, si.head);
    sess_transcript_free(tr, nt);
    free(saved);
    free(mine);
    sess_close(st);
    eng_seq_free(s);
    tsu_close_model(&f);
    free(model);
    tmu_rmtree(tmp);
    free(tmp);
}

/* The sampler settings are saved with the session: later turns that give
 * none continue with the first turn's (not the defaults), so the split
 * turns still equal one go bit for bit (issue 15). */
Test(sess_resume, sampler_settings_recorded, .timeout = 60) {
    resume_across_processes_ex("tiny", "--temperature 1.3 --top-k 7 --top-p 0.9 --min-p 0",
                               SPLIT3, 3, true);
}
