/*
 * The serving core's scheduler (core/srv.h, "The scheduler"), directly, on
 * the default model and a fresh store: streams batched together give each
 * the reply, token counts and every state byte (as saved) that srv_turn_run
 * gives it alone, whatever their settings (sampled, greedy, chat closed at
 * max_tokens, a stop string); a cancel stops a stream where it is and saves
 * what went in while the others go on; a finished turn goes to the saver
 * and the other streams keep stepping until srv_sched_collect answers it; a
 * document appended in pieces equals its tokens fed as one prompt, and its
 * resume point is saved and indexed on the way; idle sessions are evicted
 * least recently used first, busy ones never; a session in memory records
 * the sampler settings the store records for it; a session's token hash
 * follows what is fed, so a turn stopped during its prompt keeps the
 * session's turns in the prefix index.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kds_buf.h"
#include "srv.h"
#include "test_model_util.h"

#define DEFAULT_MODEL KDS_SOURCE_DIR "/models/default"
#define SCOPE "test|sched"

/* What the hooks saw of one stream. */
typedef struct seen {
    kds_buf text;
    int done; /* times the done hook ran */
    char reason[32];
    kds_status save_rc;
    uint64_t snapshot;
    int64_t produced, fed, doc_fed;
    int steps_saving; /* steps the test made while this turn was with the saver */
} seen;

typedef struct fixture {
    eng_model *m;
    const eng_tokenizer *tok;
    char *tmp, *db;
    sess_store *st;
    srv_sched *S;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool woken_elsewhere; /* wake came from another thread than the owner */
    pthread_t owner;
} fixture;

static void on_wake(void *user) {
    fixture *f = user;
    pthread_mutex_lock(&f->lock);
    if (!pthread_equal(pthread_self(), f->owner)) f->woken_elsewhere = true;
    pthread_cond_signal(&f->cond);
    pthread_mutex_unlock(&f->lock);
}

static void open_fixture(fixture *f, int max_sessions, int max_streams) {
    memset(f, 0, sizeof *f);
    kds_err e = {0};
    cr_assert_eq(eng_model_load(DEFAULT_MODEL, NULL, &f->m, &e), KDS_OK, "%s", e.msg);
    f->tok = eng_model_tokenizer(f->m);
    f->tmp = tmu_mkdtemp();
    f->db = tmu_path(f->tmp, "db");
    sess_params sp = sess_default_params();
    cr_assert_eq(sess_open(f->db, &sp, &f->st, &e), KDS_OK, "%s", e.msg);
    pthread_mutex_init(&f->lock, NULL);
    pthread_cond_init(&f->cond, NULL);
    f->owner = pthread_self();
    srv_sched_params p = srv_sched_default_params();
    p.max_sessions = max_sessions;
    p.max_streams = max_streams;
    p.ctx.n_threads = 1;
    p.hooks = (srv_sched_hooks){.user = f, .wake = on_wake};
    cr_assert_eq(srv_sched_create(&p, f->m, f->st, &f->S, &e), KDS_OK, "%s", e.msg);
}

static void close_fixture(fixture *f) {
    srv_sched_free(f->S);
    sess_close(f->st);
    tmu_rmtree(f->tmp);
    free(f->db);
    free(f->tmp);
    pthread_mutex_destroy(&f->lock);
    pthread_cond_destroy(&f->cond);
    eng_model_free(f->m);
}

/* Wait (at most 60 s) until the saver has handed something back, then
 * answer it. */
static void wait_collect(fixture *f) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 60;
    pthread_mutex_lock(&f->lock);
    while (!srv_sched_collectable(f->S))
        cr_assert_neq(pthread_cond_timedwait(&f->cond, &f->lock, &ts), ETIMEDOUT,
                      "the saver handed nothing back in 60 s");
    pthread_mutex_unlock(&f->lock);
    srv_sched_collect(f->S);
}

/* Step and collect until every stream is answered. */
static void run_all(fixture *f) {
    for (int guard = 0; srv_sched_running(f->S) || srv_sched_saving(f->S); guard++) {
        cr_assert_lt(guard, 100000, "the streams never ended");
        if (srv_sched_running(f->S))
            srv_sched_step(f->S);
        else
            wait_collect(f);
        srv_sched_collect(f->S);
    }
}

static void on_text(void *user, srv_stream *st, const char *t, size_t n) {
    seen *s = user;
    kds_buf_append(&s->text, t, n, NULL);
}

static void on_done(void *user, srv_stream *st, const srv_stream_end *end) {
    seen *s = user;
    const srv_stream_info *i = srv_stream_get(st);
    s->done++;
    snprintf(s->reason, sizeof s->reason, "%s", end->reason);
    s->save_rc = end->save_rc;
    s->snapshot = end->snapshot;
    s->produced = i->produced;
    s->fed = i->fed;
    s->doc_fed = i->doc_fed;
}

static const srv_stream_hooks HOOKS = {.text = on_text, .done = on_done};

/* The state bytes of stored snapshot `id`. */
static void *stored_state(fixture *f, uint64_t id, size_t *n) {
    kds_err e = {0};
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f->m, 0, &s, &e), KDS_OK, "%s", e.msg);
    cr_assert_eq(sess_load(f->st, id, f->m, s, NULL, &e), KDS_OK, "@%llu: %s",
                 (unsigned long long)id, e.msg);
    *n = eng_seq_state_bytes(s);
    void *b = malloc(*n);
    cr_assert(b);
    cr_assert_eq(eng_seq_state_save(s, b, *n, &e), KDS_OK, "%s", e.msg);
    eng_seq_free(s);
    return b;
}

static void *seq_state(const eng_seq *s, size_t *n) {
    kds_err e = {0};
    *n = eng_seq_state_bytes(s);
    void *b = malloc(*n);
    cr_assert(b);
    cr_assert_eq(eng_seq_state_save(s, b, *n, &e), KDS_OK, "%s", e.msg);
    return b;
}

/* One turn's settings, run batched and alone. */
typedef struct turn_case {
    const char *text;
    bool chat;
    float temperature;
    int top_k;
    float top_p;
    int64_t max_tokens;
    bool ignore_eos;
    const char *stop;
    uint64_t seed;
} turn_case;

static srv_stream_params case_params(fixture *f, const turn_case *t, int32_t **ids, int64_t *n) {
    kds_err e = {0};
    cr_assert_eq(
        eng_chat_turn(f->tok, t->chat, 0, NULL, t->text, strlen(t->text), true, ids, n, &e), KDS_OK,
        "%s", e.msg);
    srv_stream_params p = srv_stream_default_params();
    p.ids = *ids;
    p.n_ids = *n;
    p.prompt = t->text;
    p.prompt_len = strlen(t->text);
    p.reply.max_tokens = t->max_tokens;
    p.reply.ignore_eos = t->ignore_eos;
    p.reply.chat = t->chat;
    if (t->stop) {
        p.reply.stop[0] = t->stop;
        p.reply.n_stop = 1;
    }
    p.sampler.temperature = t->temperature;
    if (t->top_k) p.sampler.top_k = t->top_k;
    if (t->top_p > 0) p.sampler.top_p = t->top_p;
    p.reseed = true;
    p.seed = t->seed;
    p.hooks = &HOOKS;
    return p;
}

#define N_CASES 5
static const turn_case CASES[N_CASES] = {
    {"It is a truth universally acknowledged", false, 0.8f, 40, 0, 30, true, NULL, 11},
    {"Call me Ishmael.", false, 0.0f, 0, 0, 24, true, NULL, 12},
    {"Tell me about the whale.", true, 0.7f, 0, 0.9f, 9, true, NULL, 13}, /* closed at 9 */
    {"The sea was", false, 1.2f, 5, 0, 40, false, "e ", 14},              /* a stop string */
    {"What is up?", true, 0.5f, 20, 0, 60, false, NULL, 15},              /* may stop */
};

/* N streams in one batch equal each run alone through srv_turn_run: reply,
 * counts, and the saved state byte for byte. */
Test(srv_sched, batched_streams_equal_each_alone, .timeout = 120) {
    fixture f;
    open_fixture(&f, 8, 8);
    kds_err e = {0};
    seen sn[N_CASES] = {0};
    int32_t *ids[N_CASES];
    int64_t n[N_CASES];
    srv_sess *h[N_CASES];
    for (int i = 0; i < N_CASES; i++) {
        char name[16];
        snprintf(name, sizeof name, "b%d", i);
        sess_turn decl = {.mode = CASES[i].chat ? "chat" : "plain"};
        cr_assert_eq(srv_sched_new(f.S, name, CASES[i].chat, NULL, 0, &decl, NULL, &h[i], NULL, &e),
                     KDS_OK, "%s", e.msg);
        srv_stream_params p = case_params(&f, &CASES[i], &ids[i], &n[i]);
        p.user = &sn[i];
        srv_stream *st;
        cr_assert_eq(srv_stream_start(f.S, h[i], &p, &st, &e), KDS_OK, "%s", e.msg);
    }
    cr_expect_eq(srv_sched_running(f.S), N_CASES);
    run_all(&f);
    for (int i = 0; i < N_CASES; i++) {
        const turn_case *t = &CASES[i];
        cr_assert_eq(sn[i].done, 1, "case %d: done %d times", i, sn[i].done);
        cr_expect_eq(sn[i].save_rc, KDS_OK, "case %d", i);
        /* alone, its prompt prefilled in the scheduler's slices */
        eng_ctx *c = NULL;
        eng_ctx_params cp = eng_ctx_default_params();
        cp.n_threads = 1;
        cp.max_batch = (int)srv_sched_slice(f.S);
        cr_assert_eq(eng_ctx_create(f.m, &cp, &c, &e), KDS_OK, "%s", e.msg);
        eng_seq *s = NULL;
        cr_assert_eq(eng_seq_create(f.m, t->seed, &s, &e), KDS_OK, "%s", e.msg);
        srv_turn_params tp = srv_turn_default_params();
        srv_stream_params p = case_params(&f, t, &ids[i], &n[i]); /* the same settings */
        tp.reply = p.reply;
        tp.sampler = p.sampler;
        srv_turn_result r;
        cr_assert_eq(srv_turn_run(c, s, f.tok, ids[i], n[i], &tp, NULL, &r, &e), KDS_OK, "%s",
                     e.msg);
        cr_expect_str_eq(sn[i].reason, r.reason, "case %d", i);
        cr_expect_eq(sn[i].produced, r.drawn, "case %d: %lld drawn batched, %lld alone", i,
                     (long long)sn[i].produced, (long long)r.drawn);
        cr_expect_eq(sn[i].fed, n[i], "case %d", i);
        size_t len;
        const char *reply = NULL;
        sess_turn_record *tr = NULL;
        size_t ntr = 0;
        char name[16];
        snprintf(name, sizeof name, "b%d", i);
        cr_assert_eq(sess_transcript(f.st, name, &tr, &ntr, &e), KDS_OK, "%s", e.msg);
        cr_assert_geq(ntr, 1);
        reply = tr[ntr - 1].output;
        len = strlen(reply);
        cr_expect(len == r.reply_len && !memcmp(reply, r.reply, len),
                  "case %d: saved reply '%s', alone '%s'", i, reply, r.reply);
        cr_expect(sn[i].text.len == r.reply_len && !memcmp(sn[i].text.p, r.reply, r.reply_len),
                  "case %d: the text hook's pieces are not the reply", i);
        cr_expect_str_eq(tr[ntr - 1].prompt, t->text);
        sess_transcript_free(tr, ntr);
        sess_session_info si;
        cr_assert_eq(sess_session_get(f.st, name, &si, &e), KDS_OK, "%s", e.msg);
        cr_expect_eq(si.head, sn[i].snapshot, "case %d: the head is the done's snapshot", i);
        size_t na, nb;
        void *sa = stored_state(&f, si.head, &na), *sb = seq_state(s, &nb);
        cr_expect(na == nb && !memcmp(sa, sb, na), "case %d: saved state differs from alone", i);
        srv_sess_info hi;
        srv_sess_get(h[i], &hi);
        cr_expect_eq(hi.tokens, eng_seq_pos(s), "case %d", i);
        cr_expect_eq(hi.base, si.head, "case %d: the session in memory is at its head", i);
        cr_expect(hi.has_sampler == si.has_sampler &&
                      !memcmp(&hi.sampler, &si.sampler, sizeof hi.sampler),
                  "case %d: the session in memory records the settings the store does", i);
        cr_expect_null(srv_sess_stream(h[i]), "case %d: the session is idle again", i);
        free(sa);
        free(sb);
        srv_turn_result_free(&r);
        eng_seq_free(s);
        eng_ctx_free(c);
        free(ids[i]);
        kds_buf_free(&sn[i].text);
    }
    close_fixture(&f);
}

/* A cancel stops one stream where it is (a prefill before its next slice,
 * a reply before its next draw) and saves what went in; GONE ends it as
 * "disconnected"; the other stream is not disturbed. */
Test(srv_sched, cancel, .timeout = 120) {
    fixture f;
    open_fixture(&f, 8, 8);
    kds_err e = {0};
    seen sa = {0}, sb = {0}, sc = {0}, sd = {0};
    turn_case long_case = {"It was the best of times", false, 0.8f, 0, 0, 200, true, NULL, 21};
    srv_sess *ha, *hb, *hc, *hd;
    sess_turn decl = {.mode = "plain"};
    cr_assert_eq(srv_sched_new(f.S, "ca", false, NULL, 0, &decl, NULL, &ha, NULL, &e), KDS_OK);
    cr_assert_eq(srv_sched_new(f.S, "cb", false, NULL, 0, &decl, NULL, &hb, NULL, &e), KDS_OK);
    cr_assert_eq(srv_sched_new(f.S, "cc", false, NULL, 0, &decl, NULL, &hc, NULL, &e), KDS_OK);
    cr_assert_eq(srv_sched_new(f.S, "cd", false, NULL, 0, &decl, NULL, &hd, NULL, &e), KDS_OK);
    int32_t *ids_a, *ids_b;
    int64_t na, nb;
    srv_stream *sta, *stb, *stc, *std_;
    srv_stream_params p = case_params(&f, &long_case, &ids_a, &na);
    p.user = &sa;
    cr_assert_eq(srv_stream_start(f.S, ha, &p, &sta, &e), KDS_OK, "%s", e.msg);
    p = case_params(&f, &long_case, &ids_b, &nb);
    p.user = &sb;
    cr_assert_eq(srv_stream_start(f.S, hb, &p, &stb, &e), KDS_OK, "%s", e.msg);
    /* a prompt of three slices, cancelled before its first: nothing fed */
    int64_t slice = srv_sched_slice(f.S), nl = 3 * slice;
    cr_expect_eq(slice, SRV_PREFILL_SLICE, "the server's slice, not the engine's %d-token step",
                 eng_ctx_default_params().max_batch);
    int32_t *big = malloc((size_t)nl * sizeof *big);
    for (int64_t i = 0; i < nl; i++)
        big[i] = ids_a[i % na];
    p.ids = big;
    p.n_ids = nl;
    p.user = &sc;
    cr_assert_eq(srv_stream_start(f.S, hc, &p, &stc, &e), KDS_OK, "%s", e.msg);
    srv_stream_cancel(stc, SRV_CANCEL_ASKED);
    cr_expect_eq(srv_stream_start(f.S, hc, &p, &std_, &e), KDS_BUSY, "a session runs one turn");
    p.user = &sd;
    cr_assert_eq(srv_stream_start(f.S, hd, &p, &std_, &e), KDS_OK, "%s", e.msg);
    srv_sched_step(f.S);
    cr_expect_eq(sc.done, 1, "a turn that fed nothing is answered at once");
    cr_expect_str_eq(sc.reason, "cancelled");
    cr_expect_eq(sc.fed, 0);
    srv_sess_info ci;
    srv_sess_get(hc, &ci);
    cr_expect_eq(ci.tokens, 0, "nothing went in");
    cr_expect_eq(ci.base, sc.snapshot, "nothing saved: the head is the base");
    /* d fed one slice of its prompt: gone stops it before the next */
    cr_assert_eq(srv_stream_get(std_)->fed, slice);
    srv_stream_cancel(std_, SRV_CANCEL_GONE);
    for (int i = 0; i < 5; i++)
        srv_sched_step(f.S);
    /* a is decoding: cancel it after a few draws */
    int64_t before = srv_stream_get(sta)->produced;
    cr_assert_gt(before, 0);
    srv_stream_cancel(sta, SRV_CANCEL_ASKED);
    srv_stream_cancel(sta, SRV_CANCEL_GONE); /* gone wins */
    run_all(&f);
    cr_expect_str_eq(sa.reason, "disconnected");
    cr_expect_lt(sa.produced, 200);
    cr_expect_eq(sa.produced, before, "no draw after the cancel");
    cr_expect_eq(sa.save_rc, KDS_OK);
    cr_expect_str_eq(sd.reason, "disconnected");
    cr_expect_eq(sd.fed, slice);
    cr_expect_eq(sd.produced, 0);
    sess_session_info si;
    cr_assert_eq(sess_session_get(f.st, "ca", &si, &e), KDS_OK, "%s", e.msg);
    cr_expect_eq(si.head, sa.snapshot);
    cr_expect_eq(si.tokens, na + sa.produced, "the prompt and every draw went in and were saved");
    cr_assert_eq(sess_session_get(f.st, "cd", &si, &e), KDS_OK, "%s", e.msg);
    cr_expect_eq(si.tokens, slice, "the slice that went in was saved");
    cr_expect_eq(si.head, sd.snapshot);
    /* b ran to the end, as alone */
    cr_expect_str_eq(sb.reason, "length");
    cr_expect_eq(sb.produced, 200);
    eng_ctx *c = NULL;
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cp.max_batch = (int)slice; /* as the scheduler prefilled it */
    cr_assert_eq(eng_ctx_create(f.m, &cp, &c, &e), KDS_OK, "%s", e.msg);
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, long_case.seed, &s, &e), KDS_OK);
    srv_turn_params tp = srv_turn_default_params();
    tp.reply = p.reply;
    tp.sampler = p.sampler;
    srv_turn_result r;
    cr_assert_eq(srv_turn_run(c, s, f.tok, ids_b, nb, &tp, NULL, &r, &e), KDS_OK, "%s", e.msg);
    cr_expect(sb.text.len == r.reply_len && !memcmp(sb.text.p, r.reply, r.reply_len),
              "the stream beside the cancelled ones differs from alone");
    srv_turn_result_free(&r);
    eng_seq_free(s);
    eng_ctx_free(c);
    free(big);
    free(ids_a);
    free(ids_b);
    kds_buf_free(&sa.text);
    kds_buf_free(&sb.text);
    kds_buf_free(&sc.text);
    kds_buf_free(&sd.text);
    close_fixture(&f);
}

/* A turn that ends goes to the saver: the step returns without its save,
 * its session stays busy, the other stream keeps stepping, and only
 * srv_sched_collect answers it (the saver's wake came from its thread). */
Test(srv_sched, a_save_goes_to_the_saver_while_others_step, .timeout = 120) {
    fixture f;
    open_fixture(&f, 8, 8);
    kds_err e = {0};
    seen sa = {0}, sb = {0};
    turn_case short_case = {"Call me Ishmael.", false, 0.8f, 0, 0, 2, true, NULL, 31};
    turn_case long_case = {"Call me Ishmael.", false, 0.8f, 0, 0, 40, true, NULL, 32};
    srv_sess *ha, *hb;
    sess_turn decl = {.mode = "plain"};
    cr_assert_eq(srv_sched_new(f.S, "sa", false, NULL, 0, &decl, NULL, &ha, NULL, &e), KDS_OK);
    cr_assert_eq(srv_sched_new(f.S, "sb", false, NULL, 0, &decl, NULL, &hb, NULL, &e), KDS_OK);
    int32_t *ids_a, *ids_b;
    int64_t na, nb;
    srv_stream *sta, *stb;
    srv_stream_params p = case_params(&f, &short_case, &ids_a, &na);
    p.user = &sa;
    cr_assert_eq(srv_stream_start(f.S, ha, &p, &sta, &e), KDS_OK, "%s", e.msg);
    p = case_params(&f, &long_case, &ids_b, &nb);
    p.user = &sb;
    cr_assert_eq(srv_stream_start(f.S, hb, &p, &stb, &e), KDS_OK, "%s", e.msg);
    /* prefill, then two draws: a ends in the third step */
    for (int i = 0; i < 3; i++)
        srv_sched_step(f.S);
    cr_assert_eq(srv_sched_saving(f.S), 1, "a is with the saver");
    cr_assert_eq(srv_sched_running(f.S), 1, "b is still in the loop");
    cr_expect_eq(srv_stream_get(sta)->phase, SRV_PHASE_SAVE);
    cr_expect_eq(srv_sess_stream(ha), sta, "a's session is busy while it saves");
    int64_t b0 = srv_stream_get(stb)->produced;
    for (int i = 0; i < 10; i++)
        srv_sched_step(f.S);
    cr_expect_eq(srv_stream_get(stb)->produced, b0 + 10, "b drew a token each step meanwhile");
    cr_expect_eq(sa.done, 0, "a is answered by srv_sched_collect only");
    wait_collect(&f);
    cr_expect_eq(sa.done, 1);
    cr_expect_eq(sa.save_rc, KDS_OK);
    cr_expect(f.woken_elsewhere, "the saver's wake came from the saver thread");
    cr_expect_null(srv_sess_stream(ha), "a's session is idle again");
    srv_sess_info ai;
    srv_sess_get(ha, &ai);
    cr_expect_eq(ai.base, sa.snapshot);
    cr_expect(ai.has_sampler && ai.sampler.temperature == p.sampler.temperature,
              "the session keeps the turn's settings");
    sess_session_info si;
    cr_assert_eq(sess_session_get(f.st, "sa", &si, &e), KDS_OK, "%s", e.msg);
    cr_expect_eq(si.head, sa.snapshot);
    cr_expect_eq(si.tokens, na + 2);
    run_all(&f);
    cr_expect_eq(sb.done, 1);
    cr_expect_eq(sb.produced, 40);
    free(ids_a);
    free(ids_b);
    kds_buf_free(&sa.text);
    kds_buf_free(&sb.text);
    close_fixture(&f);
}

/* A document appended in pieces (the last one late) is its tokens fed as
 * one prompt, state byte for byte; its resume point is saved as the head
 * on the way and indexed under the key of the tokens before it. */
Test(srv_sched, document_in_pieces_and_its_resume_point, .timeout = 120) {
    fixture f;
    open_fixture(&f, 8, 8);
    kds_err e = {0};
    int64_t slice = srv_sched_slice(f.S), n = 2 * slice + slice / 2;
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    const char *words =
        "Whenever it is a damp, drizzly November in my soul, I account it high time.";
    int32_t *w = NULL;
    int64_t nw = 0;
    cr_assert_eq(eng_chat_turn(f.tok, false, 1, NULL, words, strlen(words), false, &w, &nw, &e),
                 KDS_OK);
    for (int64_t i = 0; i < n; i++)
        ids[i] = w[i % nw];
    free(w);
    srv_sess *h;
    sess_turn decl = {.mode = "plain"};
    cr_assert_eq(srv_sched_new(f.S, "doc", false, NULL, 0, &decl, NULL, &h, NULL, &e), KDS_OK);
    seen sd = {0};
    srv_stream_params p = srv_stream_default_params();
    p.kind = SRV_STREAM_DOCUMENT;
    p.ids = ids;
    p.n_ids = 100;
    p.hooks = &HOOKS;
    p.user = &sd;
    p.index_fork = true;
    cr_assert_eq(sess_prefix_hasher_create(SCOPE, &p.hasher, &e), KDS_OK);
    srv_stream *st;
    cr_assert_eq(srv_stream_start(f.S, h, &p, &st, &e), KDS_OK, "%s", e.msg);
    srv_stream_point(st, slice);
    srv_sched_step(f.S);
    cr_expect_eq(srv_stream_get(st)->phase, SRV_PHASE_WAIT, "less than a slice: it waits");
    cr_assert_eq(srv_stream_append(st, ids + 100, slice + 50, false, &e), KDS_OK, "%s", e.msg);
    srv_sched_step(f.S);
    cr_expect_eq(srv_stream_get(st)->fed, slice);
    srv_sched_step(f.S); /* at the point: it pauses for the saver */
    cr_expect_eq(srv_stream_get(st)->phase, SRV_PHASE_PAUSE);
    wait_collect(&f);
    cr_expect_eq(srv_stream_get(st)->phase, SRV_PHASE_PREFILL, "back in the loop");
    srv_sess_info hi;
    srv_sess_get(h, &hi);
    sess_snapshot_info pi;
    cr_assert_eq(sess_snapshot_get(f.st, hi.base, &pi, &e), KDS_OK, "%s", e.msg);
    cr_expect_eq(pi.tokens, slice, "the resume point is the head, at the point");
    /* indexed under the first `slice` tokens */
    sess_prefix_hasher *k = NULL;
    cr_assert_eq(sess_prefix_hasher_create(SCOPE, &k, &e), KDS_OK);
    sess_prefix_hasher_add(k, ids, slice);
    unsigned char key[1][SESS_PREFIX_KEY_LEN];
    int64_t len = slice;
    size_t found;
    sess_prefix_entry pe;
    sess_prefix_hasher_key(k, key[0]);
    cr_assert_eq(sess_prefix_find(f.st, (const unsigned char(*)[SESS_PREFIX_KEY_LEN])key, &len, 1,
                                  &found, &pe, &e),
                 KDS_OK, "the resume point is not indexed");
    cr_expect_eq(pe.snapshot, hi.base);
    cr_expect(pe.fork);
    cr_expect_str_eq(pe.session, "doc");
    int64_t unfed = 0;
    srv_stream_unfed(st, &unfed);
    cr_expect_eq(unfed, 100 + slice + 50 - slice);
    cr_assert_eq(srv_stream_append(st, ids + 150 + slice, n - 150 - slice, true, &e), KDS_OK);
    cr_expect_eq(srv_stream_append(st, ids, 1, false, &e), KDS_INVALID_ARG, "after the last");
    run_all(&f);
    cr_expect_str_eq(sd.reason, "complete");
    cr_expect_eq(sd.fed, n);
    cr_expect_eq(sd.doc_fed, n, "no opener: every token is the document's");
    /* the same tokens as one prompt, prefilled in the scheduler's slices
     * (a reply's prompt is; the engine's own default step is larger) */
    eng_ctx *c = NULL;
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = 1;
    cp.max_batch = (int)slice;
    cr_assert_eq(eng_ctx_create(f.m, &cp, &c, &e), KDS_OK, "%s", e.msg);
    eng_seq *s = NULL;
    cr_assert_eq(eng_seq_create(f.m, 0, &s, &e), KDS_OK);
    cr_assert_eq(eng_prefill(c, s, ids, n, NULL, NULL, NULL, &e), KDS_OK, "%s", e.msg);
    size_t nsa, nsb;
    void *sa = stored_state(&f, sd.snapshot, &nsa);
    eng_seq *t = NULL;
    cr_assert_eq(eng_seq_create(f.m, 0, &t, &e), KDS_OK);
    cr_assert_eq(sess_load(f.st, sd.snapshot, f.m, t, NULL, &e), KDS_OK, "%s", e.msg);
    cr_expect_eq(eng_seq_pos(t), n);
    /* RNG aside (the session's own seed): compare after giving both the same */
    eng_seq_reseed(t, 5);
    eng_seq_reseed(s, 5);
    free(sa);
    void *sb = seq_state(s, &nsb);
    sa = seq_state(t, &nsa);
    cr_expect(nsa == nsb && !memcmp(sa, sb, nsa), "the document's state is not its one prefill's");
    /* and its end is indexed, the hasher back with the session */
    sess_prefix_hasher_add(k, ids + slice, n - slice);
    sess_prefix_hasher_key(k, key[0]);
    len = n;
    cr_expect_eq(sess_prefix_find(f.st, (const unsigned char(*)[SESS_PREFIX_KEY_LEN])key, &len, 1,
                                  &found, &pe, &e),
                 KDS_OK, "the document's end is not indexed");
    cr_expect(srv_sess_hashed(h), "the session's hasher is whole");
    free(sa);
    free(sb);
    sess_prefix_hasher_free(k);
    eng_seq_free(s);
    eng_seq_free(t);
    eng_ctx_free(c);
    free(ids);
    close_fixture(&f);
}

/* The index entry of `ids[0..n)` (SCOPE): its snapshot and length, or
 * KDS_NOT_FOUND. */
static kds_status find_key(fixture *f, const int32_t *ids, int64_t n, sess_prefix_entry *pe) {
    sess_prefix_hasher *k = NULL;
    cr_assert_eq(sess_prefix_hasher_create(SCOPE, &k, NULL), KDS_OK);
    sess_prefix_hasher_add(k, ids, n);
    unsigned char key[1][SESS_PREFIX_KEY_LEN];
    sess_prefix_hasher_key(k, key[0]);
    sess_prefix_hasher_free(k);
    size_t found;
    return sess_prefix_find(f->st, (const unsigned char(*)[SESS_PREFIX_KEY_LEN])key, &n, 1, &found,
                            pe, NULL);
}

/* A session's token hash follows what is fed: a turn stopped during its
 * prompt (cancelled, its client gone, before or after a slice went in)
 * leaves it whole, its end indexed under what went in (a chat turn's with
 * the <|im_end|> that closed it), and so are the turns after it; a stream
 * that fails to start leaves the session's hash as it was. */
Test(srv_sched, a_stopped_prefill_leaves_the_session_hash_whole, .timeout = 120) {
    fixture f;
    open_fixture(&f, 4, 4);
    kds_err e = {0};
    int64_t slice = srv_sched_slice(f.S), nl = 3 * slice;
    int32_t *w = NULL, *big = malloc((size_t)nl * sizeof *big), *all = NULL;
    int64_t nw = 0;
    const char *words = "It was the best of times, it was the worst of times, it was the age";
    cr_assert_eq(eng_chat_turn(f.tok, false, 1, NULL, words, strlen(words), false, &w, &nw, &e),
                 KDS_OK);
    for (int64_t i = 0; i < nl; i++)
        big[i] = w[i % nw];
    srv_sess *hp, *hc;
    sess_turn plain = {.mode = "plain"}, chat = {.mode = "chat"};
    cr_assert_eq(srv_sched_new(f.S, "hp", false, NULL, 0, &plain, SCOPE, &hp, NULL, &e), KDS_OK);
    cr_assert_eq(srv_sched_new(f.S, "hc", true, NULL, 0, &chat, SCOPE, &hc, NULL, &e), KDS_OK);
    cr_expect(srv_sess_hashed(hp) && srv_sess_hashed(hc), "new sessions are hashed");
    seen s1 = {0}, s2 = {0}, s3 = {0}, s4 = {0};
    srv_stream_params p = srv_stream_default_params();
    p.ids = big;
    p.n_ids = nl;
    p.reply.max_tokens = 5;
    p.hooks = &HOOKS;
    srv_stream *st;
    /* gone before anything went in: nothing saved, the hash as it was */
    p.user = &s1;
    cr_assert_eq(srv_stream_start(f.S, hp, &p, &st, &e), KDS_OK, "%s", e.msg);
    srv_stream_cancel(st, SRV_CANCEL_GONE);
    srv_sched_step(f.S);
    cr_assert_eq(s1.done, 1);
    cr_expect_eq(s1.fed, 0);
    cr_expect(srv_sess_hashed(hp), "a turn that fed nothing leaves the hash whole");
    /* a plain turn and a chat turn, each cancelled after one slice */
    p.user = &s2;
    cr_assert_eq(srv_stream_start(f.S, hp, &p, &st, &e), KDS_OK, "%s", e.msg);
    srv_stream *stc;
    p.user = &s3;
    p.reply.chat = true;
    cr_assert_eq(srv_stream_start(f.S, hc, &p, &stc, &e), KDS_OK, "%s", e.msg);
    srv_sched_step(f.S);
    cr_assert_eq(srv_stream_get(st)->fed, slice);
    cr_assert_eq(srv_stream_get(stc)->fed, slice);
    srv_stream_cancel(st, SRV_CANCEL_ASKED);
    srv_stream_cancel(stc, SRV_CANCEL_GONE);
    run_all(&f);
    cr_expect_str_eq(s2.reason, "cancelled");
    cr_expect_str_eq(s3.reason, "disconnected");
    cr_assert_eq(s2.save_rc, KDS_OK);
    cr_assert_eq(s3.save_rc, KDS_OK);
    srv_sess_info pi, ci;
    srv_sess_get(hp, &pi);
    srv_sess_get(hc, &ci);
    cr_expect_eq(pi.tokens, slice);
    cr_expect_eq(ci.tokens, slice + 1, "the chat turn was closed with <|im_end|>");
    cr_expect(srv_sess_hashed(hp), "the plain session's hash holds what went in");
    cr_expect(srv_sess_hashed(hc), "the chat session's hash holds what went in");
    sess_prefix_entry pe;
    cr_expect_eq(find_key(&f, big, slice, &pe), KDS_OK, "the cancelled turn's end is not indexed");
    cr_expect_eq(pe.snapshot, s2.snapshot);
    cr_expect_eq(pe.tokens, slice);
    all = malloc((size_t)(nl + 64) * sizeof *all);
    memcpy(all, big, (size_t)slice * sizeof *all);
    all[slice] = eng_tok_special_id(f.tok, "<|im_end|>");
    cr_assert_geq(all[slice], 0);
    cr_expect_eq(find_key(&f, all, slice + 1, &pe), KDS_OK,
                 "the closed chat turn's end is not indexed");
    cr_expect_eq(pe.snapshot, s3.snapshot);
    /* a stream that cannot start (an empty stop string) leaves the hash */
    sess_prefix_hasher *bogus = NULL;
    cr_assert_eq(sess_prefix_hasher_create(SCOPE, &bogus, NULL), KDS_OK);
    p.hasher = bogus; /* taken, also on failure */
    p.reply.chat = false;
    p.reply.stop[0] = "";
    p.reply.n_stop = 1;
    cr_expect_eq(srv_stream_start(f.S, hp, &p, &st, &e), KDS_INVALID_ARG);
    cr_expect(srv_sess_hashed(hp), "a failed start took the session's hash");
    /* the next turn: its end is indexed after the stopped one's */
    p = srv_stream_default_params();
    p.ids = w;
    p.n_ids = nw;
    p.reply.max_tokens = 0;
    p.hooks = &HOOKS;
    p.user = &s4;
    cr_assert_eq(srv_stream_start(f.S, hp, &p, &st, &e), KDS_OK, "%s", e.msg);
    run_all(&f);
    cr_assert_eq(s4.save_rc, KDS_OK);
    memcpy(all + slice, w, (size_t)nw * sizeof *all);
    cr_expect_eq(find_key(&f, all, slice + nw, &pe), KDS_OK,
                 "the turn after the stopped one is not indexed");
    cr_expect_eq(pe.snapshot, s4.snapshot);
    free(all);
    free(big);
    free(w);
    kds_buf_free(&s1.text);
    kds_buf_free(&s2.text);
    kds_buf_free(&s3.text);
    kds_buf_free(&s4.text);
    close_fixture(&f);
}

/* The sampler settings a session in memory records are the store's, turn
 * after turn, whatever the turn (a reply records its settings, a document
 * keeps those before it), so a later turn that takes the recorded settings
 * (a WebSocket generate without sampling fields) samples as it would after
 * the session was evicted and loaded again. */
static void expect_records_as_stored(fixture *f, srv_sess *h, const char *name, const char *when) {
    kds_err e = {0};
    srv_sess_info hi;
    srv_sess_get(h, &hi);
    sess_session_info si;
    cr_assert_eq(sess_session_get(f->st, name, &si, &e), KDS_OK, "%s", e.msg);
    cr_expect_eq(hi.has_sampler, si.has_sampler, "%s: has_sampler %d in memory, %d stored", when,
                 hi.has_sampler, si.has_sampler);
    cr_expect(!si.has_sampler || !memcmp(&hi.sampler, &si.sampler, sizeof hi.sampler),
              "%s: temperature %g in memory, %g stored", when, hi.sampler.temperature,
              si.sampler.temperature);
    /* and what a load from the store gives */
    srv_sess *back = NULL;
    srv_sched_drop(f->S, h);
    cr_assert_eq(srv_sched_open(f->S, &si, NULL, &back, &e), KDS_OK, "%s", e.msg);
    srv_sess_info bi;
    srv_sess_get(back, &bi);
    cr_expect(bi.has_sampler == hi.has_sampler &&
                  (!bi.has_sampler || !memcmp(&bi.sampler, &hi.sampler, sizeof bi.sampler)),
              "%s: reloaded, the session records other settings than in memory", when);
}

Test(srv_sched, session_in_memory_records_the_stored_sampler, .timeout = 60) {
    fixture f;
    open_fixture(&f, 4, 4);
    kds_err e = {0};
    srv_sess *h;
    sess_turn decl = {.mode = "plain"};
    cr_assert_eq(srv_sched_new(f.S, "rs", false, NULL, 0, &decl, NULL, &h, NULL, &e), KDS_OK);
    expect_records_as_stored(&f, h, "rs", "new");
    h = srv_sched_find(f.S, "rs");
    /* a reply with its own settings (a front end that sets nothing else) */
    seen s1 = {0};
    int32_t *ids;
    int64_t n;
    turn_case t = {"Call me Ishmael.", false, 1.7f, 3, 0.5f, 4, true, NULL, 41};
    srv_stream_params p = case_params(&f, &t, &ids, &n);
    p.user = &s1;
    srv_stream *st;
    cr_assert_eq(srv_stream_start(f.S, h, &p, &st, &e), KDS_OK, "%s", e.msg);
    run_all(&f);
    cr_assert_eq(s1.save_rc, KDS_OK);
    expect_records_as_stored(&f, h, "rs", "after a reply");
    srv_sess_info hi;
    h = srv_sched_find(f.S, "rs");
    srv_sess_get(h, &hi);
    cr_expect(hi.has_sampler && hi.sampler.temperature == 1.7f && hi.sampler.top_k == 3,
              "the reply's settings are recorded");
    /* a document records none: the reply's stay */
    seen s2 = {0};
    srv_stream_params d = srv_stream_default_params();
    d.kind = SRV_STREAM_DOCUMENT;
    d.ids = ids;
    d.n_ids = n;
    d.hooks = &HOOKS;
    d.user = &s2;
    cr_assert_eq(srv_stream_start(f.S, h, &d, &st, &e), KDS_OK, "%s", e.msg);
    cr_assert_eq(srv_stream_append(st, NULL, 0, true, &e), KDS_OK);
    run_all(&f);
    cr_assert_eq(s2.save_rc, KDS_OK);
    cr_assert_str_eq(s2.reason, "complete");
    expect_records_as_stored(&f, srv_sched_find(f.S, "rs"), "rs", "after a document");
    free(ids);
    kds_buf_free(&s1.text);
    kds_buf_free(&s2.text);
    close_fixture(&f);
}

/* Sessions in memory: the least recently used idle one makes room; a
 * session running a turn is never evicted (KDS_BUSY when all are). */
Test(srv_sched, lru_eviction_spares_busy_sessions, .timeout = 60) {
    fixture f;
    open_fixture(&f, 2, 2);
    kds_err e = {0};
    srv_sess *a, *b, *c;
    sess_turn decl = {.mode = "plain"};
    cr_assert_eq(srv_sched_new(f.S, "la", false, NULL, 0, &decl, NULL, &a, NULL, &e), KDS_OK);
    cr_assert_eq(srv_sched_new(f.S, "lb", false, NULL, 0, &decl, NULL, &b, NULL, &e), KDS_OK);
    srv_sess_touch(a); /* b is now the least recently used */
    cr_assert_eq(srv_sched_new(f.S, "lc", false, NULL, 0, &decl, NULL, &c, NULL, &e), KDS_OK);
    cr_expect_not_null(srv_sched_find(f.S, "la"));
    cr_expect_null(srv_sched_find(f.S, "lb"), "the least recently used idle session went");
    /* a and c busy: nothing can come in */
    seen s1 = {0}, s2 = {0};
    int32_t *ids;
    int64_t n;
    turn_case t = {"Hello", false, 0.0f, 0, 0, 50, true, NULL, 1};
    srv_stream_params p = case_params(&f, &t, &ids, &n);
    srv_stream *st;
    a = srv_sched_find(f.S, "la");
    c = srv_sched_find(f.S, "lc");
    p.user = &s1;
    cr_assert_eq(srv_stream_start(f.S, a, &p, &st, &e), KDS_OK, "%s", e.msg);
    p.user = &s2;
    cr_assert_eq(srv_stream_start(f.S, c, &p, &st, &e), KDS_OK, "%s", e.msg);
    cr_expect(!srv_sched_has_room(f.S));
    sess_session_info si;
    cr_assert_eq(sess_session_get(f.st, "lb", &si, &e), KDS_OK, "%s", e.msg);
    srv_sess *h = NULL;
    cr_expect_eq(srv_sched_open(f.S, &si, NULL, &h, &e), KDS_BUSY);
    cr_expect_null(h);
    run_all(&f);
    cr_expect(srv_sched_has_room(f.S));
    cr_assert_eq(srv_sched_open(f.S, &si, NULL, &h, &e), KDS_OK, "%s", e.msg);
    cr_expect_str_eq(srv_sess_name(h), "lb");
    free(ids);
    kds_buf_free(&s1.text);
    kds_buf_free(&s2.text);
    close_fixture(&f);
}
