/* cmd_run.c - subcommands that run a model: generate, logits, bench. */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "kds_buf.h"
#include "eng_config.h"
#include "eng_ep.h"
#include "eng_genmodel.h"
#include "eng_safetensors.h"
#include "repl.h"
#include "sess.h"
#include "srv.h"
#include "kds_clock.h"

/* Options shared by the sampling commands. */
enum {
    OPT_TEMP = 1000,
    OPT_TOPK,
    OPT_TOPP,
    OPT_MINP,
    OPT_REPEAT,
    OPT_MAXTOK,
    OPT_THREADS,
    OPT_SEED,
    OPT_IDS,
    OPT_OUT,
    OPT_DECODE,
    OPT_PROMPT_TOKENS,
    OPT_GEN_TOKENS,
    OPT_REPEATS,
    OPT_BATCH,
    OPT_DB,
    OPT_SESSION,
    OPT_IGNORE_EOS,
    OPT_LOGITS_OUT,
    OPT_SEQS,
    OPT_DEVICE,
    OPT_PROMPT_FILE,
    OPT_GEN,
    OPT_GPU_BF16,
    OPT_BANDWIDTH_MIB,
    OPT_PROFILE,
};

/* Print a token's bytes; control bytes other than newline and tab are shown
 * as \xHH so random models cannot scramble the terminal. */
static void print_piece(FILE *f, const char *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)p[i];
        if ((ch < 0x20 && ch != '\n' && ch != '\t') || ch == 0x7f)
            fprintf(f, "\\x%02x", ch);
        else
            fputc(ch, f);
    }
}

/* generate's hooks of its turn (core/srv.h): text to stdout as it comes;
 * with --logits-out, every draw's logits and token. */
typedef struct gen_out {
    float *logits; /* [max_tokens, vocab] or NULL */
    int32_t *ids;
    int64_t rows, cap;
    int vocab;
} gen_out;

static void gen_text(void *user, const char *text, size_t len) {
    (void)user;
    print_piece(stdout, text, len);
    fflush(stdout);
}

static void gen_drawn(void *user, const float *logits, int32_t token) {
    gen_out *o = user;
    if (!o->logits || o->rows >= o->cap) return;
    memcpy(o->logits + (size_t)o->rows * o->vocab, logits, (size_t)o->vocab * sizeof(float));
    o->ids[o->rows++] = token;
}

static void generate_usage(FILE *f) {
    fprintf(
        f,
        "usage: kdaserve generate [--model DIR] --prompt TEXT | --prompt-file FILE\n"
        "                         [--max-tokens N] [--seed S]\n"
        "                         [--temperature T] [--top-k K] [--top-p P] [--min-p M]\n"
        "                         [--repeat-penalty R] [--threads N] [--ignore-eos]\n"
        "                         [--device cpu|cuda] [--bf16]\n"
        "                         [--logits-out FILE] [--session NAME [--db DIR]]\n\n"
        "Feeds the prompt through the prefill path, then samples up to N tokens\n"
        "(default 128) through the decode path, printing them as they come.\n"
        "Stops early at the model's end-of-sequence token. Statistics go to stderr.\n\n"
        "With --session the conversation is kept in the snapshot store: a new session\n"
        "starts from the prompt; an existing one is resumed from its last snapshot\n"
        "(no replay) and the prompt, if any, is fed after it; an empty prompt just\n"
        "continues. After the turn the state is saved as a new snapshot and becomes the\n"
        "session's head. Generating N tokens in one turn prints the same text as\n"
        "k tokens and then N-k in a later process. If another process (the server, a\n"
        "chat) has the session open for writing, that is said at once; if it saved a\n"
        "turn while this one ran, this turn is saved as a fork NAME-K (said on stderr)\n"
        "rather than lost. A chat session (made by `kdaserve chat` or the server in chat\n"
        "mode) takes the prompt as a user message in its chat format, as they do; a\n"
        "session generate starts is plain continuation. The sampler settings are saved\n"
        "with the session: a later turn uses the recorded ones, except for the sampling\n"
        "options it gives.\n\n"
        "  --model DIR          model directory (default: the session's model, else\n"
        "                       $KDASERVE_MODEL, else ./models/default)\n"
        "  --prompt TEXT        the text to continue (may be empty)\n"
        "  --prompt-file FILE   read the text from FILE ('-' = standard input): a long\n"
        "                       document, past the command line's length limit\n"
        "  --max-tokens N       tokens to generate (default 128)\n"
        "  --seed S             sampler seed of a new sequence (default 0): same seed, same\n"
        "                       text. A resumed session continues its saved random stream.\n"
        "  --temperature T      0 = greedy (default 0.8)\n"
        "  --top-k K            keep the K most likely tokens, 0 = off (default 40)\n"
        "  --top-p P            nucleus sampling, 1 = off (default 0.95)\n"
        "  --min-p M            drop tokens below M x the best one's probability (default 0.05)\n"
        "  --repeat-penalty R   penalise the last 64 tokens, 1 = off (default 1)\n"
        "  --threads N          worker threads (default: all CPUs)\n"
        "  --device cpu|cuda    where the forward pass runs (default cpu; cuda: the\n"
        "                       current GPU, sampling on the host)\n"
        "  --bf16               the prompt's products round their activations to bf16\n"
        "                       (llama.cpp's precision, ~3e-3 relative error a product;\n"
        "                       on the CPU about twice as fast a long prompt; default exact)\n"
        "  --ignore-eos         do not stop at the end-of-sequence token\n"
        "  --logits-out FILE    write the logits each generated token was sampled from\n"
        "                       (safetensors: 'ids' I32 [n], 'logits' F32 [n, vocab])\n"
        "  --session NAME       continue (or create) this session and save it afterwards\n"
        "  --db DIR             snapshot store (default $XDG_DATA_HOME/kdaserve, else\n"
        "                       ~/.local/share/kdaserve)\n");
}

/* The long name of option value `val` in `opts`, for error messages. */
static const char *option_name(const struct option *opts, int val) {
    for (; opts->name; opts++)
        if (opts->val == val) return opts->name;
    return "?";
}

/* The SESS_SAMPLER_* bit of a sampling option, to tell given options from
 * defaults. */
static unsigned sampling_bit(int opt) {
    switch (opt) {
    case OPT_TEMP: return SESS_SAMPLER_TEMPERATURE;
    case OPT_TOPK: return SESS_SAMPLER_TOP_K;
    case OPT_TOPP: return SESS_SAMPLER_TOP_P;
    case OPT_MINP: return SESS_SAMPLER_MIN_P;
    case OPT_REPEAT: return SESS_SAMPLER_REPEAT_PENALTY;
    }
    return 0;
}

static bool parse_sampling(int opt, const char *arg, eng_sampler_params *sp) {
    int64_t v;
    switch (opt) {
    case OPT_TEMP: return cli_parse_f32(arg, 0.0f, 100.0f, &sp->temperature);
    case OPT_TOPK:
        if (!cli_parse_i64(arg, 0, 1 << 30, &v)) return false;
        sp->top_k = (int)v;
        return true;
    case OPT_TOPP: return cli_parse_f32(arg, 0.0f, 1.0f, &sp->top_p);
    case OPT_MINP: return cli_parse_f32(arg, 0.0f, 1.0f, &sp->min_p);
    case OPT_REPEAT: return cli_parse_f32(arg, 0.01f, 100.0f, &sp->repeat_penalty);
    }
    return false;
}

/* The whole of a prompt file ("-": standard input) into *out. A NUL byte is
 * refused: the prompt is text, and would be cut there. */
static kds_status read_prompt_file(const char *path, kds_buf *out, kds_err *err) {
    bool std_in = !strcmp(path, "-");
    FILE *f = std_in ? stdin : fopen(path, "rb");
    if (!f) return kds_err_set(err, KDS_IO, "--prompt-file %s: %s", path, strerror(errno));
    kds_status rc = KDS_OK;
    char buf[65536];
    for (size_t n; (n = fread(buf, 1, sizeof buf, f)) > 0;) {
        if (memchr(buf, 0, n)) {
            rc = kds_err_set(err, KDS_INVALID_ARG,
                             "--prompt-file %s holds a NUL byte (at byte %zu): not text", path,
                             out->len + (size_t)((char *)memchr(buf, 0, n) - buf));
            break;
        }
        if ((rc = kds_buf_append(out, buf, n, err)) != KDS_OK) break;
    }
    if (rc == KDS_OK && ferror(f))
        rc = kds_err_set(err, KDS_IO, "--prompt-file %s: %s", path,
                         errno ? strerror(errno) : "read error");
    if (!std_in) fclose(f);
    return rc;
}

int cmd_generate(int argc, char **argv) {
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"prompt", required_argument, 0, 'p'},
                                         {"max-tokens", required_argument, 0, OPT_MAXTOK},
                                         {"seed", required_argument, 0, OPT_SEED},
                                         {"temperature", required_argument, 0, OPT_TEMP},
                                         {"top-k", required_argument, 0, OPT_TOPK},
                                         {"top-p", required_argument, 0, OPT_TOPP},
                                         {"min-p", required_argument, 0, OPT_MINP},
                                         {"repeat-penalty", required_argument, 0, OPT_REPEAT},
                                         {"bf16", no_argument, 0, OPT_GPU_BF16},
                                         {"threads", required_argument, 0, OPT_THREADS},
                                         {"help", no_argument, 0, 'h'},
                                         {"db", required_argument, 0, OPT_DB},
                                         {"session", required_argument, 0, OPT_SESSION},
                                         {"ignore-eos", no_argument, 0, OPT_IGNORE_EOS},
                                         {"logits-out", required_argument, 0, OPT_LOGITS_OUT},
                                         {"device", required_argument, 0, OPT_DEVICE},
                                         {"prompt-file", required_argument, 0, OPT_PROMPT_FILE},
                                         {0, 0, 0, 0}};
    const char *model = NULL, *prompt = NULL, *db = NULL, *session = NULL, *logits_out = NULL;
    const char *prompt_file = NULL;
    const char *device = NULL;
    bool ignore_eos = false;
    int64_t max_tokens = 128, seed = 0, threads = 0;
    bool bf16_act = false;
    eng_sampler_params sp = eng_sampler_default_params();
    unsigned sampling_given = 0; /* bits of the options given (sampling_bit) */
    optind = 1;
    for (int o; (o = getopt_long(argc, argv, "m:p:h", opts, NULL)) != -1;) {
        switch (o) {
        case 'm': model = optarg; break;
        case 'p': prompt = optarg; break;
        case OPT_PROMPT_FILE: prompt_file = optarg; break;
        case 'h': generate_usage(stdout); return 0;
        case OPT_DB: db = optarg; break;
        case OPT_SESSION: session = optarg; break;
        case OPT_IGNORE_EOS: ignore_eos = true; break;
        case OPT_GPU_BF16: bf16_act = true; break;
        case OPT_LOGITS_OUT: logits_out = optarg; break;
        case OPT_DEVICE:
            if (!cli_device_valid(optarg))
                return cli_failf("generate", "--device wants cpu or cuda, got '%s'", optarg);
            device = optarg;
            break;
        case OPT_MAXTOK:
            if (!cli_parse_i64(optarg, 0, INT32_MAX, &max_tokens))
                return cli_failf("generate", "--max-tokens wants a count >= 0, got '%s'", optarg);
            break;
        case OPT_SEED:
            if (!cli_parse_i64(optarg, 0, INT64_MAX, &seed))
                return cli_failf("generate", "--seed wants a number >= 0, got '%s'", optarg);
            break;
        case OPT_THREADS:
            if (!cli_parse_i64(optarg, 1, 1024, &threads))
                return cli_failf("generate", "--threads wants 1..1024, got '%s'", optarg);
            break;
        case OPT_TEMP: case OPT_TOPK: case OPT_TOPP: case OPT_MINP: case OPT_REPEAT:
            if (!parse_sampling(o, optarg, &sp))
                return cli_failf("generate", "bad value '%s' for --%s", optarg,
                                 option_name(opts, o));
            sampling_given |= sampling_bit(o);
            break;
        default: return cli_usage_error("generate", NULL);
        }
    }
    if (optind < argc) return cli_failf("generate", "unexpected argument '%s'", argv[optind]);
    if (db && !session) return cli_failf("generate", "--db is used with --session NAME");
    if (session && !sess_name_valid(session))
        return cli_failf("generate", "invalid session name '%s' (1-%d of A-Z a-z 0-9 . _ -, "
                         "starting with a letter or digit)", session, SESS_NAME_MAX);
    if (prompt && prompt_file)
        return cli_failf("generate", "give --prompt or --prompt-file, not both");
    kds_buf file_text = {0}; /* the --prompt-file text */
    if (prompt_file) {
        kds_err ferr = {0};
        if (read_prompt_file(prompt_file, &file_text, &ferr) != KDS_OK) {
            kds_buf_free(&file_text);
            return cli_fail("generate", &ferr);
        }
        prompt = kds_buf_str(&file_text);
    }
    if (!prompt) prompt = "";
    eng_model *m = NULL;
    eng_ctx *c = NULL;
    eng_seq *s = NULL;
    int32_t *ids = NULL;
    gen_out go = {0};
    srv_turn_result tr = {0};
    sess_store *store = NULL;
    bool claimed = false;
    kds_err err = {0};
    int rc = 0;
    /* The session decides where the model comes from (unless --model says)
     * and whether this turn starts fresh or from a snapshot. */
    sess_session_info si;
    bool resume = false;
    if (session) {
        sess_params pp = sess_default_params();
        if (sess_open(db, &pp, &store, &err) != KDS_OK) {
            rc = cli_fail("generate", &err);
            goto out;
        }
        kds_status st = sess_session_get(store, session, &si, &err);
        if (st == KDS_OK)
            resume = true;
        else if (st != KDS_NOT_FOUND) {
            rc = cli_fail("generate", &err);
            goto out;
        }
        /* say at once that another process writes it: whoever saves second
         * has its turn saved as a fork (advisory; a failed claim is no
         * reason not to generate) */
        sess_writer other;
        bool busy = false;
        if (sess_writer_claim(store, session, "generate", &other, &busy, NULL) == KDS_OK) {
            claimed = true;
            if (busy) {
                char who[200];
                sess_writer_describe(&other, who, sizeof who);
                fprintf(stderr, "[kdaserve] session '%s' is also open for writing in %s: if it "
                        "saves a turn first, this one is saved as a fork\n", session, who);
            }
        }
    }
    /* a turn continues with the sampler settings the session's last turn
     * used, except for the options given now */
    if (resume && si.has_sampler) {
        sp = sess_sampler_merge(&si.sampler, &sp, sampling_given);
        if (sampling_given != SESS_SAMPLER_ALL)
            fprintf(stderr, "[kdaserve] session '%s': sampling with its recorded settings%s "
                    "(temperature %g, top-k %d, top-p %g, min-p %g, repeat-penalty %g)\n",
                    session, sampling_given ? " and the options given" : "", sp.temperature,
                    sp.top_k, sp.top_p, sp.min_p, sp.repeat_penalty);
    }
    const char *dir = model ? model : resume && si.model_dir[0] ? si.model_dir
                                                                : cli_model_dir("generate", NULL);
    if (!dir) {
        rc = 1;
        goto out;
    }
    {
        eng_ctx_params cp = eng_ctx_default_params();
        cp.n_threads = (int)threads;
        cp.device = device;
        cp.bf16_act = bf16_act;
        if ((rc = cli_open_with("generate", dir, &cp, &m, &c))) goto out;
    }
    const eng_tokenizer *tok = eng_model_tokenizer(m);
    const int vocab = eng_model_config(m)->vocab_size;
    size_t plen = strlen(prompt);
    /* A session continues in its mode (sess_session_chat_mode, the rule the
     * REPL and the server follow): in a chat session the prompt is a user
     * message in the chat format, and a reply cut short is closed; a new
     * session from generate is plain continuation, and says so. */
    bool chat = false;
    if (resume && sess_session_chat_mode(store, &si, tok, false, &chat, &err) != KDS_OK) {
        rc = cli_fail("generate", &err);
        goto out;
    }
    /* the turn's ids as every front end renders them (eng_chat_turn): a
     * chat message in the chat format, or the text itself (BOS when the
     * context and the text are both empty) */
    int64_t n = 0;
    int64_t pos = resume ? si.tokens : 0;
    if (eng_chat_turn(tok, chat && plen, pos, NULL, prompt, plen, true, &ids, &n, &err) != KDS_OK) {
        rc = cli_fail("generate", &err);
        goto out;
    }
    if (n == 0 && pos == 0) {
        rc = cli_failf("generate", "empty prompt and the model has no BOS token to start from");
        goto out;
    }
    if (logits_out && max_tokens > 0) {
        go.vocab = vocab;
        go.cap = max_tokens;
        go.ids = malloc((size_t)max_tokens * sizeof *go.ids);
        go.logits = malloc((size_t)max_tokens * (size_t)vocab * sizeof *go.logits);
        if (!go.ids || !go.logits) {
            rc = cli_failf("generate", "out of memory for %lld x %d logits (--logits-out)",
                           (long long)max_tokens, vocab);
            goto out;
        }
    }
    if (eng_seq_create(m, (uint64_t)seed, &s, &err) != KDS_OK) {
        rc = cli_fail("generate", &err);
        goto out;
    }
    double tr0 = kds_now_s();
    sess_snapshot_info head = {0};
    if (resume && sess_load(store, si.head, m, s, &head, &err) != KDS_OK) {
        rc = cli_failf("generate", "cannot resume session '%s': %s", session, err.msg);
        goto out;
    }
    /* the turn (core/srv.h): a session keeps every token in its state (the
     * end of turn too, and a chat reply cut short is closed), so its next
     * turn starts right after; plain generation skips the decodes nobody
     * would read */
    srv_turn_params tp = srv_turn_default_params();
    tp.sampler = sp;
    tp.keep_context = session != NULL;
    tp.reply.max_tokens = max_tokens;
    tp.reply.ignore_eos = ignore_eos;
    tp.reply.chat = chat;
    tp.reply.specials_as_text = true;
    srv_turn_hooks hooks = {.user = &go, .text = gen_text, .drawn = logits_out ? gen_drawn : NULL};
    double t0 = kds_now_s();
    if (srv_turn_run(c, s, tok, ids, n, &tp, &hooks, &tr, &err) != KDS_OK) {
        rc = cli_fail("generate", &err);
        goto out;
    }
    fputc('\n', stdout);
    fflush(stdout);
    int64_t produced = tr.tokens;
    fprintf(stderr,
            "[kdaserve] prompt %lld tokens in %.3f s (%.1f tok/s); generated %lld tokens in "
            "%.3f s (%.1f tok/s); %d threads%s\n",
            (long long)n, tr.prefill_s, n / (tr.prefill_s > 0 ? tr.prefill_s : 1e-9),
            (long long)produced, tr.decode_s, produced / (tr.decode_s > 0 ? tr.decode_s : 1e-9),
            eng_ctx_threads(c),
            bf16_act && (eng_ctx_device_kind(c) != ENG_DEVICE_CPU || eng_cpu_bf16_products())
                ? "; prompt products with bf16 activations"
                : "");
    if (logits_out) {
        int64_t rows = go.rows;
        if (rows == 0) {
            fprintf(stderr, "[kdaserve] no token generated: %s not written\n", logits_out);
        } else {
            eng_st_out_tensor t[2] = {
                {.name = "ids", .dtype = ENG_ST_I32, .n_dims = 1, .shape = {rows},
                 .data = go.ids},
                {.name = "logits", .dtype = ENG_ST_F32, .n_dims = 2, .shape = {rows, vocab},
                 .data = go.logits},
            };
            const char *meta[] = {"path", "generate", "model_fingerprint",
                                  eng_model_fingerprint(m), NULL};
            if (eng_st_write(logits_out, t, 2, meta, &err) != KDS_OK) {
                rc = cli_fail("generate", &err);
                goto out;
            }
        }
    }
    if (session && resume && eng_seq_pos(s) == head.tokens) {
        /* nothing consumed (empty prompt, no token): the head already is
         * this state; a second identical snapshot would only take space */
        fprintf(stderr, "[kdaserve] session '%s': nothing new, head stays @%llu\n", session,
                (unsigned long long)si.head);
    } else if (session) {
        double ts0 = kds_now_s();
        sess_save_result res;
        if (srv_turn_save(store, session, resume ? si.head : 0, m, s, prompt, plen, chat, &tp, &tr,
                          &res, &err) != KDS_OK) {
            rc = cli_failf("generate", "session '%s' not saved: %s", session, err.msg);
            goto out;
        }
        uint64_t snap = res.snapshot;
        double ts1 = kds_now_s();
        if (res.forked)
            fprintf(stderr, "[kdaserve] session '%s' was moved on to @%llu by another writer "
                    "while this turn ran from @%llu: this turn was saved as session '%s' (a "
                    "fork at @%llu); '%s' keeps the other writer's turns\n", session,
                    (unsigned long long)res.other_head, (unsigned long long)(resume ? si.head : 0),
                    res.session, (unsigned long long)(resume ? si.head : 0), session);
        size_t saved = eng_seq_fixed_bytes(s) +
                       eng_seq_mla_token_bytes(s) * (size_t)(eng_seq_pos(s) - head.tokens);
        if (resume)
            fprintf(stderr, "[kdaserve] session '%s': resumed @%llu (%lld tokens, %.2f MB) in "
                    "%.2f ms; ", session, (unsigned long long)si.head, (long long)head.tokens,
                    (head.fixed_bytes + head.token_bytes * (size_t)head.tokens) / 1e6,
                    (t0 - tr0) * 1e3);
        else
            fprintf(stderr, "[kdaserve] session '%s': new; ", session);
        fprintf(stderr, "saved @%llu (%lld tokens, %.2f MB written) in %.2f ms to %s\n",
                (unsigned long long)snap, (long long)eng_seq_pos(s), saved / 1e6,
                (ts1 - ts0) * 1e3, sess_store_dir(store));
    }
out:
    free(ids);
    free(go.ids);
    free(go.logits);
    srv_turn_result_free(&tr);
    kds_buf_free(&file_text);
    eng_seq_free(s);
    eng_ctx_free(c);
    eng_model_free(m);
    if (claimed) sess_writer_release(store, session, NULL);
    sess_close(store);
    return rc;
}

/* ------------------------------------------------------------------------ */

static void logits_usage(FILE *f) {
    fprintf(f, "usage: kdaserve logits [--model DIR] --ids 1,2,3 --out FILE.safetensors "
               "[--decode] [--threads N] [--bf16]\n\n"
               "Writes the float32 logits of every position (tensor 'logits', shape [T, vocab],\n"
               "and the input as tensor 'ids', I32 [T]). By default the whole list goes through\n"
               "the prefill path; --decode feeds it token by token through the decode path.\n"
               "--bf16 runs the prefill's products with bf16 activations (llama.cpp's\n"
               "precision; see bench --help): for comparing the mode, not for checks against\n"
               "reference logits, which the exact default is.\n");
}

/* Parse "1,2,3" into a new array; returns the count or -1 with a message. */
static int64_t parse_ids(const char *s, int32_t **out) {
    int64_t cap = 16, n = 0;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    if (!ids) return -1;
    const char *p = s;
    while (*p) {
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p || v < INT32_MIN || v > INT32_MAX || (*end && *end != ',')) {
            fprintf(stderr, "kdaserve logits: --ids wants comma-separated integers, bad at '%s'\n", p);
            free(ids);
            return -1;
        }
        if (n == cap) {
            cap *= 2;
            int32_t *grown = realloc(ids, (size_t)cap * sizeof *ids);
            if (!grown) {
                free(ids);
                return -1;
            }
            ids = grown;
        }
        ids[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    *out = ids;
    return n;
}

int cmd_logits(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},  {"ids", required_argument, 0, OPT_IDS},
        {"out", required_argument, 0, OPT_OUT}, {"decode", no_argument, 0, OPT_DECODE},
        {"bf16", no_argument, 0, OPT_GPU_BF16},
        {"threads", required_argument, 0, OPT_THREADS}, {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    const char *model = NULL, *ids_arg = NULL, *out_path = NULL;
    bool decode = false;
    bool bf16_act = false;
    int64_t threads = 0;
    optind = 1;
    for (int o; (o = getopt_long(argc, argv, "m:h", opts, NULL)) != -1;) {
        switch (o) {
        case 'm': model = optarg; break;
        case OPT_IDS: ids_arg = optarg; break;
        case OPT_OUT: out_path = optarg; break;
        case OPT_GPU_BF16: bf16_act = true; break;
        case OPT_DECODE: decode = true; break;
        case OPT_THREADS:
            if (!cli_parse_i64(optarg, 1, 1024, &threads))
                return cli_failf("logits", "--threads wants 1..1024, got '%s'", optarg);
            break;
        case 'h': logits_usage(stdout); return 0;
        default: return cli_usage_error("logits", NULL);
        }
    }
    if (!ids_arg || !out_path) return cli_usage_error("logits", "--ids and --out are required");
    int32_t *ids = NULL;
    int64_t n = parse_ids(ids_arg, &ids);
    if (n < 0) return 1;
    if (n == 0) {
        free(ids);
        return cli_failf("logits", "--ids is empty");
    }
    const char *dir = cli_model_dir("logits", model);
    if (!dir) {
        free(ids);
        return 1;
    }
    eng_model *m = NULL;
    eng_ctx *c = NULL;
    eng_seq *s = NULL;
    float *logits = NULL;
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = (int)threads;
    cp.bf16_act = bf16_act;
    int rc = cli_open_with("logits", dir, &cp, &m, &c);
    if (rc) {
        free(ids);
        return rc;
    }
    kds_err err = {0};
    const int vocab = eng_model_config(m)->vocab_size;
    logits = malloc((size_t)n * vocab * sizeof(float));
    if (!logits) {
        rc = cli_failf("logits", "out of memory for %lld x %d logits", (long long)n, vocab);
        goto out;
    }
    if (eng_seq_create(m, 0, &s, &err) != KDS_OK) goto fail;
    if (!decode) {
        if (eng_prefill(c, s, ids, n, logits, NULL, NULL, &err) != KDS_OK) goto fail;
    } else {
        for (int64_t t = 0; t < n; t++) {
            if (eng_decode(c, s, ids[t], &err) != KDS_OK) goto fail;
            memcpy(logits + (size_t)t * vocab, eng_seq_logits(s), (size_t)vocab * sizeof(float));
        }
    }
    eng_st_out_tensor t[2] = {
        {.name = "ids", .dtype = ENG_ST_I32, .n_dims = 1, .shape = {n}, .data = ids},
        {.name = "logits", .dtype = ENG_ST_F32, .n_dims = 2, .shape = {n, vocab}, .data = logits},
    };
    const char *meta[] = {"path", decode ? "decode" : "prefill", "model_fingerprint",
                          eng_model_fingerprint(m), NULL};
    if (eng_st_write(out_path, t, 2, meta, &err) != KDS_OK) goto fail;
    fprintf(stderr, "[kdaserve] wrote logits [%lld, %d] (%s path) to %s\n", (long long)n, vocab,
            decode ? "decode" : "prefill", out_path);
    goto out;
fail:
    rc = cli_fail("logits", &err);
out:
    free(logits);
    free(ids);
    eng_seq_free(s);
    eng_ctx_free(c);
    eng_model_free(m);
    return rc;
}

/* ------------------------------------------------------------------------ */

static void bench_usage(FILE *f) {
    fprintf(f, "usage: kdaserve bench [--model DIR | --gen PRESET [--seed S]] [--prompt-tokens N]\n"
               "                      [--gen-tokens N] [--repeats R] [--threads N] [--batch B]\n"
               "                      [--seqs N,N,...] [--device cpu|cuda] [--bf16]\n"
               "                      [--bandwidth-mib M] [--profile]\n\n"
               "Measures prefill tokens/s (N random tokens through the prefill path, default\n"
               "512) and decode tokens/s (N tokens one at a time after that prompt, default\n"
               "128), best of R runs (default 3), and prints them with the model, thread\n"
               "count and sizes.\n\n"
               "On the CPU it also prints what a decoded token reads (the weights of its\n"
               "top-k experts and every other matrix, one embedding row, the state) as\n"
               "GB/s at the decode's speed, beside the machine's memory read bandwidth\n"
               "measured in the same run: a plain streaming read of M MiB (default 1024,\n"
               "or four times the last-level cache if more; 0 skips it) on as many\n"
               "threads. When a token reads more than the last-level cache holds, each\n"
               "decode run is put between two such measurements (reads back to back for\n"
               "0.25 s each) and gets one more read every 0.25 s inside it (between two\n"
               "tokens; its time is left out of the run's), and each run's GB/s against\n"
               "those reads' (GB/s over them all, as the run's is over its tokens) is\n"
               "printed too (median and range over the runs: the figure that holds while\n"
               "other tenants' load moves); the first line's read is the best single\n"
               "read among them (the memory at its quietest). A model that fits in the\n"
               "cache gets one read, best of 3, after the runs.\n\n"
               "--seqs N,N,... adds continuous batching: for each N, N sequences with\n"
               "different prompts (--prompt-tokens each) decode --gen-tokens greedy tokens\n"
               "each, once together (one eng_decode_batch_sample per step) and once one after\n"
               "another (eng_decode for each sequence in turn, every step), and prints the\n"
               "aggregate tokens/s of both. --batch B is the prefill batch, not this.\n\n"
               "--batch B: tokens per prefill step (default 512, the engine's; `serve`\n"
               "prefills in slices of 256, which bound how long one stream's prefill holds\n"
               "up the others' decode).\n\n"
               "--device cuda runs the forward pass on the GPU. States stay\n"
               "on the device between steps; each repeat's fresh state is moved there before\n"
               "its clock starts (the restore is `snap bench --device cuda`'s figure).\n\n"
               "--bf16 rounds activations to bf16 in the products where speed is bound by\n"
               "arithmetic (llama.cpp's and vLLM's precision, ~3e-3 relative error per\n"
               "product; default: exact): on the CPU the bf16 matrices of a prefill and\n"
               "a decode step's products of 4 tokens and more (a batched step of --seqs;\n"
               "AVX-512 BF16, or AMX tiles where the CPU has them: the `device` line says\n"
               "which; a lone decode stays exact), on a GPU the products above 8\n"
               "rows (default: split into bf16 hi + lo). --gpu-bf16 is its old name.\n\n"
               "On the CPU the prefill is also given in GFLOP/s (two a multiply-add of its\n"
               "matrix products, the lm_head once) against the machine's multiply-add peak\n"
               "measured in the same run on as many threads (24 chains of f32 FMAs; with\n"
               "--bf16 also of AVX-512 BF16 dot products, about twice as many): the bound\n"
               "of a prefill, as the memory's read is decode's.\n\n"
               "--profile (CPU) then runs one more prefill and decode with every matrix\n"
               "product's tasks timed, and prints where their time went by matrix (role\n"
               "and shape, layers and experts summed): each one's share of the threads'\n"
               "time, its GFLOP/s a thread in the prefill against the f32 FMA peak (the\n"
               "bf16 pairs of --bf16 have about twice that), its GB/s a thread in the\n"
               "decode against the sustained read beside and inside the runs, and the\n"
               "share outside the products (the other ops, waits at joins); with --seqs,\n"
               "also one more batched run of each N (GB/s and GFLOP/s a thread: a step's\n"
               "products multiply-add each weight once a token). See docs/benchmarks.md.\n\n"
               "--gen PRESET benchmarks a model generated on the GPU itself (gen-model's\n"
               "weights for that preset and --seed, default 1; no files: e.g. the 98 GB\n"
               "kimi-linear-48b). Needs --device cuda (implied). Presets: see gen-model.\n");
}

/* The prefill's multiply-adds (eng_model_prefill_madds) at the best and
 * median runs' speed, against the machine's multiply-add peak measured
 * now on the same threads: f32 FMAs, and with bf16 (--bf16 where the
 * build has the dot products) vdpbf16ps too, whose peak is about twice
 * as many multiply-adds. What decode's line does for the memory, for a
 * prefill bound by arithmetic. */
static double print_prefill_peak(const eng_model *m, int64_t pt, double best_tps,
                                 double median_tps, int threads, bool bf16) {
    double fma_peak = 0.0;
    const double madds = eng_model_prefill_madds(m, pt) / (double)pt;
    const double best = 2.0 * madds * best_tps / 1e9, median = 2.0 * madds * median_tps / 1e9;
    printf("arithmetic   a prefill token multiply-adds %.1f M in products (the lm_head once): "
           "%.1f GFLOP/s at the best run (median %.1f)\n",
           madds / 1e6, best, median);
    for (int dp = 0; dp <= (bf16 ? 1 : 0); dp++) {
        double peak = 0.0;
        kds_err err = {0};
        if (eng_madd_peak(threads, dp == 1, 3, &peak, &err) != KDS_OK || peak <= 0) {
            printf("             no multiply-add peak this run: %s\n", err.msg);
            continue;
        }
        printf("             %s peak on %d threads, this run: %.0f GFLOP/s (best of 3 runs) -> "
               "prefill at %.0f%% of it (median %.0f%%)\n",
               dp ? "vdpbf16ps (bf16 pairs)" : "f32 FMA", threads, peak, 100.0 * best / peak,
               100.0 * median / peak);
        if (dp == 0) fma_peak = peak;
    }
    return fma_peak;
}

#define MAX_PROFILE_ROWS 64

/* Seconds of back-to-back reads on each side of a decode run (bench): on a
 * shared machine a read's speed moves from one 1 GiB read to the next by
 * up to 2x; over a quarter of a second it is the load of that time. */
#define PAIR_READ_S 0.25

/* And inside the run, one read (eng_membw's buffer once) whenever this
 * long has passed since the last, its time left out of the run's: the
 * tenants' load that the reads on each side see can change within a run
 * of seconds, and the reads inside see the load of the run's own time. */
#define INSIDE_READ_EVERY_S 0.25

/* The reads held against one decode run: GB and seconds over them all,
 * the best single read and how many. */
typedef struct read_tally {
    double gb, seconds, best;
    int n;
} read_tally;

/* eng_membw_read_for(b, seconds) into *t; returns the seconds it took. */
static double timed_read(eng_membw *b, double seconds, read_tally *t) {
    double best = 0.0;
    int n = 0;
    const double t0 = kds_now_s();
    const double gbs = eng_membw_read_for(b, seconds, &best, &n);
    const double took = kds_now_s() - t0;
    t->gb += gbs * took;
    t->seconds += took;
    t->best = best > t->best ? best : t->best;
    t->n += n;
    return took;
}

/* What a profiled pass was: a prefill of `tokens` tokens (n_seqs 0), or
 * `tokens` decode steps of n_seqs sequences (1: a lone decode). */
typedef struct profiled_pass {
    int n_seqs;
    int64_t tokens;
    double wall_s;
} profiled_pass;

/* One profiled pass's table (eng_ctx_profile_stop's rows): a prefill in
 * GFLOP/s a thread against a thread's share of the FMA peak (0: no
 * column); decode steps in bytes a step and GB/s a thread against a
 * thread's share of the read (0: no column), and with several sequences
 * also GFLOP/s a thread, since a batched step's products multiply-add
 * each weight once per token. */
static void print_profile(const eng_product_time *r, int n, profiled_pass pp, int threads,
                          double peak, double read_gbs) {
    const bool decode = pp.n_seqs > 0, batched = pp.n_seqs > 1;
    double busy = 0.0;
    for (int i = 0; i < n; i++) busy += r[i].busy_s;
    /* a clock that saw no time gives no rates (0), not a division by zero */
    const double all = pp.wall_s > 0 ? pp.wall_s * threads : 0.0, steps = (double)pp.tokens;
    const double all_pct = all > 0 ? 100.0 / all : 0.0;
    char what[64];
    if (!decode)
        snprintf(what, sizeof what, "prefill of %lld tokens, %.3f ms", (long long)pp.tokens,
                 1e3 * pp.wall_s);
    else if (!batched)
        snprintf(what, sizeof what, "decode of %lld tokens, %.3f ms a token",
                 (long long)pp.tokens, 1e3 * pp.wall_s / steps);
    else
        snprintf(what, sizeof what, "%lld batched steps of %d sequences, %.3f ms a step",
                 (long long)pp.tokens, pp.n_seqs, 1e3 * pp.wall_s / steps);
    printf("  %s: products %.1f%% of the %d threads' time, the rest %.1f%% (the other ops, "
           "waits at joins)\n",
           what, busy * all_pct, threads, (all - busy) * all_pct);
    if (decode && read_gbs > 0)
        printf("    (the read: %.1f GB/s on %d threads, %.1f a thread, the mean of the reads "
               "beside and inside the decode runs above)\n", read_gbs, threads, read_gbs / threads);
    if (decode)
        printf("    share    MB/%s  GB/s a thread%s%s  matrix (shape, products a %s%s)\n",
               batched ? "step " : "token", read_gbs > 0 ? "  of the read" : "",
               batched ? "  GFLOP/s a thread" : "", batched ? "step" : "token",
               batched ? ", tokens a product" : "");
    else
        printf("    share   GFLOP/s a thread%s  matrix (shape, tokens a product)\n",
               peak > 0 ? "  of the f32 FMA peak" : "");
    for (int i = 0; i < n; i++) {
        const double share = r[i].busy_s * all_pct;
        const double per_s = r[i].busy_s > 0 ? 1.0 / r[i].busy_s : 0.0;
        const double gbs = r[i].bytes * per_s / 1e9;
        const double gflops = 2.0 * r[i].rows * r[i].cols * (double)r[i].tokens * per_s / 1e9;
        const double of = decode ? read_gbs / threads : peak / threads;
        const double per_product = (double)r[i].tokens / (double)r[i].products;
        char pct[32] = "", flops[32] = "", per[32] = "";
        if (of > 0)
            snprintf(pct, sizeof pct, "  %*.0f%%", decode ? 10 : 18,
                     100.0 * (decode ? gbs : gflops) / of);
        if (batched) snprintf(flops, sizeof flops, "  %16.1f", gflops);
        if (batched) snprintf(per, sizeof per, ", %.1f", per_product);
        if (decode)
            printf("  %6.1f%%  %9.2f  %13.1f%s%s  %s [%d, %d] %s, %.1f%s\n", share,
                   r[i].bytes / steps / 1e6, gbs, pct, flops, r[i].role, r[i].rows, r[i].cols,
                   r[i].dtype, (double)r[i].products / steps, per);
        else
            printf("  %6.1f%%  %16.1f%s  %s [%d, %d] %s, %.0f\n", share, gflops, pct, r[i].role,
                   r[i].rows, r[i].cols, r[i].dtype, per_product);
    }
}

/* The end of a profiled pass: rc, the pass's own status; on failure the
 * profile is dropped and rc returned, else its table printed. */
static kds_status end_profile(eng_ctx *c, kds_status rc, profiled_pass pp, double peak,
                              double read_gbs, kds_err *err) {
    eng_product_time rows[MAX_PROFILE_ROWS];
    int n = 0;
    if (rc != KDS_OK) {
        eng_ctx_profile_stop(c, rows, MAX_PROFILE_ROWS, &n, NULL);
        return rc;
    }
    if ((rc = eng_ctx_profile_stop(c, rows, MAX_PROFILE_ROWS, &n, err)) != KDS_OK) return rc;
    print_profile(rows, n, pp, eng_ctx_threads(c), peak, read_gbs);
    return KDS_OK;
}

/* --profile: one prefill of pt tokens and gt decode steps from a fresh
 * state, each pass timed product by product (eng_ctx_profile_*). */
static kds_status bench_profile(eng_ctx *c, eng_seq *s, const int32_t *ids, int64_t pt,
                                int64_t gt, double peak, double read_gbs, kds_err *err) {
    eng_sampler_params greedy = eng_sampler_default_params();
    greedy.temperature = 0.0f;
    eng_seq_reset(s, 0);
    kds_status rc = eng_ctx_attach(c, s, err);
    if (rc != KDS_OK || (rc = eng_ctx_profile_start(c, err)) != KDS_OK) return rc;
    printf("profile      one more prefill and decode, every product's tasks timed:\n");
    double t0 = kds_now_s();
    rc = eng_prefill(c, s, ids, pt, NULL, NULL, NULL, err);
    rc = end_profile(c, rc, (profiled_pass){0, pt, kds_now_s() - t0}, peak, 0.0, err);
    if (rc != KDS_OK || gt == 0) return rc;
    if ((rc = eng_ctx_profile_start(c, err)) != KDS_OK) return rc;
    t0 = kds_now_s();
    for (int64_t i = 0; i < gt && rc == KDS_OK; i++) {
        int32_t next;
        rc = eng_sample(c, s, &greedy, &next, err);
        if (rc == KDS_OK) rc = eng_decode(c, s, next, err);
    }
    return end_profile(c, rc, (profiled_pass){1, gt, kds_now_s() - t0}, 0.0, read_gbs, err);
}

#define MAX_SEQ_COUNTS 16
#define MAX_BENCH_SEQS 1024

/* "1,4,16" -> counts in [1, MAX_BENCH_SEQS]; false on anything else. */
static bool parse_seq_counts(const char *arg, int *counts, int *n) {
    *n = 0;
    for (const char *p = arg;;) {
        const char *comma = strchr(p, ',');
        char num[32];
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        int64_t v;
        if (len == 0 || len >= sizeof num || *n == MAX_SEQ_COUNTS) return false;
        memcpy(num, p, len);
        num[len] = '\0';
        if (!cli_parse_i64(num, 1, MAX_BENCH_SEQS, &v)) return false;
        counts[(*n)++] = (int)v;
        if (!comma) return true;
        p = comma + 1;
    }
}

/* One more run of the n sequences together from their saved states, gt
 * steps, each product timed (bench --profile --seqs). */
static kds_status profile_together(eng_ctx *c, eng_seq **s, void **saved, const size_t *len,
                                   int n, int64_t gt, double read_gbs, int32_t *next,
                                   kds_err *err) {
    eng_sampler_params greedy = eng_sampler_default_params();
    greedy.temperature = 0.0f;
    kds_status rc = KDS_OK;
    for (int i = 0; i < n && rc == KDS_OK; i++)
        if ((rc = eng_seq_state_load(s[i], saved[i], len[i], err)) == KDS_OK)
            rc = eng_ctx_attach(c, s[i], err);
    for (int i = 0; i < n && rc == KDS_OK; i++) rc = eng_sample(c, s[i], &greedy, &next[i], err);
    if (rc != KDS_OK || (rc = eng_ctx_profile_start(c, err)) != KDS_OK) return rc;
    const double t0 = kds_now_s();
    for (int64_t step = 0; step < gt && rc == KDS_OK; step++)
        rc = eng_decode_batch_sample(c, s, next, n, &greedy, next, err);
    return end_profile(c, rc, (profiled_pass){n, gt, kds_now_s() - t0}, 0.0, read_gbs, err);
}

/*
 * Continuous batching for n sequences: each gets its own random prompt of
 * pt tokens (prefilled once, state saved), then every repeat restores the
 * states and times gt greedy steps twice: together (sample each, one
 * eng_decode_batch) and one after another (sample and eng_decode each in
 * turn, as a server without batching would). out: best and median aggregate
 * tokens/s, together then apart, printed as a line; then with `profile`
 * one more run together, product by product (profile_together).
 */
static kds_status bench_seqs(eng_ctx *c, const eng_model *m, int n, int64_t pt, int64_t gt,
                             int64_t reps, bool profile, double read_gbs, double out[4],
                             kds_err *err) {
    const int vocab = eng_model_config(m)->vocab_size;
    const int64_t plen = pt > 0 ? pt : 1;
    kds_status rc = KDS_OK;
    eng_seq **s = calloc((size_t)n, sizeof *s);
    void **saved = calloc((size_t)n, sizeof *saved);
    size_t *len = calloc((size_t)n, sizeof *len);
    int32_t *ids = malloc((size_t)plen * sizeof *ids), *next = malloc((size_t)n * sizeof *next);
    double *tog = calloc((size_t)reps, sizeof *tog), *apart = calloc((size_t)reps, sizeof *apart);
    eng_sampler_params greedy = eng_sampler_default_params();
    greedy.temperature = 0.0f;
    if (!s || !saved || !len || !ids || !next || !tog || !apart) {
        rc = kds_err_set(err, KDS_NOMEM, "out of memory for %d sequences", n);
        goto out;
    }
    uint64_t x = 0x2545f4914f6cdd1dull;
    for (int i = 0; i < n; i++) {
        for (int64_t j = 0; j < plen; j++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            ids[j] = (int32_t)(x % (uint64_t)vocab);
        }
        if ((rc = eng_seq_create(m, (uint64_t)i, &s[i], err)) != KDS_OK) goto out;
        if ((rc = eng_prefill(c, s[i], ids, plen, NULL, NULL, NULL, err)) != KDS_OK) goto out;
        len[i] = eng_seq_state_bytes(s[i]);
        if (!(saved[i] = malloc(len[i]))) {
            rc = kds_err_set(err, KDS_NOMEM, "out of memory saving %d sequences", n);
            goto out;
        }
        if ((rc = eng_seq_state_save(s[i], saved[i], len[i], err)) != KDS_OK) goto out;
    }
    for (int64_t r = 0; r < reps; r++)
        for (int k = 0; k < 2; k++) {
            const int together = (k + r) % 2 == 0; /* alternate which goes first */
            for (int i = 0; i < n; i++)
                if ((rc = eng_seq_state_load(s[i], saved[i], len[i], err)) != KDS_OK ||
                    (rc = eng_ctx_attach(c, s[i], err)) != KDS_OK) /* onto a GPU: untimed */
                    goto out;
            double t0 = kds_now_s();
            if (together) {
                /* each step one batched pass that also samples the next
                 * tokens (on a GPU: on the device, only the tokens come back) */
                for (int i = 0; i < n; i++)
                    if ((rc = eng_sample(c, s[i], &greedy, &next[i], err)) != KDS_OK) goto out;
                for (int64_t step = 0; step < gt; step++)
                    if ((rc = eng_decode_batch_sample(c, s, next, n, &greedy, next, err)) != KDS_OK)
                        goto out;
            } else {
                for (int64_t step = 0; step < gt; step++)
                    for (int i = 0; i < n; i++)
                        if ((rc = eng_sample(c, s[i], &greedy, &next[i], err)) != KDS_OK ||
                            (rc = eng_decode(c, s[i], next[i], err)) != KDS_OK)
                            goto out;
            }
            double tps = (double)n * gt / (kds_now_s() - t0);
            (together ? tog : apart)[r] = tps;
        }
    cli_sort_doubles(tog, (size_t)reps);
    cli_sort_doubles(apart, (size_t)reps);
    out[0] = tog[reps - 1];
    out[1] = tog[reps / 2];
    out[2] = apart[reps - 1];
    out[3] = apart[reps / 2];
    printf("  N=%-4d     together %9.1f (%9.1f)   one after another %9.1f (%9.1f)   x%.2f\n", n,
           out[0], out[1], out[2], out[3], out[2] > 0 ? out[0] / out[2] : 0.0);
    fflush(stdout);
    if (profile) rc = profile_together(c, s, saved, len, n, gt, read_gbs, next, err);
out:
    if (s)
        for (int i = 0; i < n; i++) eng_seq_free(s[i]);
    if (saved)
        for (int i = 0; i < n; i++) free(saved[i]);
    free(s);
    free(saved);
    free(len);
    free(ids);
    free(next);
    free(tog);
    free(apart);
    return rc;
}

int cmd_bench(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},
        {"prompt-tokens", required_argument, 0, OPT_PROMPT_TOKENS},
        {"gen-tokens", required_argument, 0, OPT_GEN_TOKENS},
        {"repeats", required_argument, 0, OPT_REPEATS},
        {"threads", required_argument, 0, OPT_THREADS},
        {"batch", required_argument, 0, OPT_BATCH},
        {"seqs", required_argument, 0, OPT_SEQS},
        {"device", required_argument, 0, OPT_DEVICE},
        {"gen", required_argument, 0, OPT_GEN},
        {"bf16", no_argument, 0, OPT_GPU_BF16},
        {"gpu-bf16", no_argument, 0, OPT_GPU_BF16},
        {"seed", required_argument, 0, OPT_SEED},
        {"bandwidth-mib", required_argument, 0, OPT_BANDWIDTH_MIB},
        {"profile", no_argument, 0, OPT_PROFILE},
        {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    const char *model = NULL, *device = NULL, *gen = NULL;
    int64_t pt = 512, gt = 128, reps = 3, threads = 0, batch = 0, seed = 1;
    int64_t bw_mib = (int64_t)(eng_read_bandwidth_default_bytes() >> 20);
    bool gpu_bf16 = false; /* --bf16 */
    bool profile = false;
    int seq_counts[MAX_SEQ_COUNTS], n_counts = 0;
    optind = 1;
    for (int o; (o = getopt_long(argc, argv, "m:h", opts, NULL)) != -1;) {
        int64_t *dst = o == OPT_PROMPT_TOKENS ? &pt : o == OPT_GEN_TOKENS ? &gt
                       : o == OPT_REPEATS ? &reps : o == OPT_THREADS ? &threads
                       : o == OPT_BATCH ? &batch : NULL;
        if (o == 'm') {
            model = optarg;
        } else if (o == OPT_GEN) {
            gen = optarg;
        } else if (o == OPT_GPU_BF16) {
            gpu_bf16 = true;
        } else if (o == OPT_PROFILE) {
            profile = true;
        } else if (o == OPT_SEED) {
            if (!cli_parse_i64(optarg, 0, INT64_MAX, &seed))
                return cli_failf("bench", "--seed wants a number, got '%s'", optarg);
        } else if (o == OPT_BANDWIDTH_MIB) {
            if (!cli_parse_i64(optarg, 0, 1 << 20, &bw_mib))
                return cli_failf("bench", "--bandwidth-mib wants MiB in 0..1048576, got '%s'",
                                 optarg);
        } else if (o == OPT_DEVICE) {
            if (!cli_device_valid(optarg))
                return cli_failf("bench", "--device wants cpu or cuda, got '%s'", optarg);
            device = optarg;
        } else if (o == OPT_SEQS) {
            if (!parse_seq_counts(optarg, seq_counts, &n_counts))
                return cli_failf("bench",
                                 "--seqs wants up to %d counts in 1..%d separated by commas, "
                                 "got '%s'",
                                 MAX_SEQ_COUNTS, MAX_BENCH_SEQS, optarg);
        } else if (o == 'h') {
            bench_usage(stdout);
            return 0;
        } else if (dst) {
            if (!cli_parse_i64(optarg, o == OPT_BATCH || o == OPT_THREADS || o == OPT_REPEATS ? 1 : 0,
                               1 << 24, dst))
                return cli_failf("bench", "bad number '%s'", optarg);
        } else {
            return cli_usage_error("bench", NULL);
        }
    }
    if (n_counts > 0 && gt == 0) return cli_failf("bench", "--seqs needs --gen-tokens of at least 1");
    if (gen && model) return cli_failf("bench", "--gen and --model exclude each other");
    if (profile && (gen || (device && strcmp(device, "cpu"))))
        return cli_failf("bench", "--profile times the CPU's products: leave it out with "
                                  "--device cuda or --gen");
    eng_device dev = ENG_DEVICE_CPU;
    if (gen && device && !(eng_device_from_name(device, &dev) && dev == ENG_DEVICE_CUDA))
        return cli_failf("bench", "--gen makes the model on the GPU: it runs with --device cuda only");
    eng_model *m = NULL;
    eng_ctx *c = NULL;
    eng_seq *s = NULL;
    int32_t *ids = NULL;
    double *pre = NULL, *dec = NULL;
    double *paired = NULL; /* [reps]: each decode run against the reads beside it */
    eng_membw *membw = NULL;
    kds_err bw_err = {0};
    eng_ep_stats *ep_all = NULL, *ep_sum = NULL; /* [ranks] under mpirun */
    kds_err err = {0};
    const char *dir;
    int rc;
    eng_ctx_params cp = eng_ctx_default_params();
    cp.n_threads = (int)threads;
    if (batch > 0) cp.max_batch = (int)batch;
    cp.bf16_act = gpu_bf16;
    if (gen) {
        device = "cuda";
        eng_config gcfg;
        cp.device = device;
        fprintf(stderr, "generating %s (seed %lld) on the GPU...\n", gen, (long long)seed);
        if (eng_genmodel_preset(gen, &gcfg, &err) != KDS_OK ||
            eng_model_generate(&gcfg, (uint64_t)seed, gen, &m, &err) != KDS_OK ||
            eng_ctx_create(m, &cp, &c, &err) != KDS_OK) {
            eng_model_free(m);
            return cli_fail("bench", &err);
        }
        dir = eng_model_dir(m);
    } else {
        if (!(dir = cli_model_dir("bench", model))) return 1;
        cp.device = device;
        if ((rc = cli_open_with("bench", dir, &cp, &m, &c))) return rc;
    }
    rc = 0;
    const eng_config *cfg = eng_model_config(m);
    ids = malloc(((size_t)pt + 1) * sizeof *ids);
    pre = calloc((size_t)reps, sizeof *pre);
    dec = calloc((size_t)reps, sizeof *dec);
    paired = calloc((size_t)reps, sizeof *paired);
    if (!ids || !pre || !dec || !paired) {
        rc = cli_failf("bench", "out of memory");
        goto out;
    }
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int64_t i = 0; i < pt; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        ids[i] = (int32_t)(x % (uint64_t)cfg->vocab_size);
    }
    if (pt == 0) ids[pt++] = 0;
    if (eng_seq_create(m, 0, &s, &err) != KDS_OK) goto fail;
    eng_sampler_params greedy = eng_sampler_default_params();
    greedy.temperature = 0.0f;
    /* expert parallelism: every rank's exchanges in the decode steps,
     * summed over the repeats (ep_sum[rank]) */
    eng_ep_stats one;
    const bool ep_on = eng_ctx_ep_stats(c, &one);
    if (ep_on) {
        ep_all = calloc((size_t)one.ranks, sizeof *ep_all);
        ep_sum = calloc((size_t)one.ranks, sizeof *ep_sum);
        if (!ep_all || !ep_sum) {
            rc = cli_failf("bench", "out of memory");
            goto out;
        }
    }
    /* The decode against a streaming read of the machine's memory (CPU).
     * When a token reads more than the last-level cache holds, each decode
     * run is put between two reads, just before and just after it, and
     * gets reads inside it: on a shared machine the other tenants' load
     * moves within seconds, and a read taken once, after all the runs,
     * can see another load than the run it is held against (a token reads
     * its weights from memory anyway, so a read between two tokens costs
     * the next one nothing it would have found in the cache). A model
     * that fits in the cache keeps the one
     * read after the runs (a read before each would empty the cache of
     * the weights its decode finds there). */
    const eng_decode_bytes db = eng_model_decode_bytes(m, pt + gt / 2);
    const double per_tok = db.weights + db.state;
    const bool want_bw = eng_ctx_device_kind(c) == ENG_DEVICE_CPU && gt > 0 && bw_mib > 0;
    if (want_bw &&
        eng_membw_create(eng_ctx_threads(c), (size_t)bw_mib << 20, &membw, &bw_err) != KDS_OK)
        membw = NULL; /* said with the figures; the bench stands */
    const bool pair_reads = membw && per_tok > (double)eng_llc_bytes();
    double bw = 0.0;   /* the best read of the run */
    int bw_reads = 0;  /* how many reads that was the best of */
    double sustained = 0.0; /* each run's reads' GB/s (beside and inside it), summed */
    for (int64_t r = 0; r < reps; r++) {
        eng_seq_reset(s, 0);
        if (eng_ctx_attach(c, s, &err) != KDS_OK) goto fail; /* a GPU's state upload: untimed */
        double t0 = kds_now_s();
        if (eng_prefill(c, s, ids, pt, NULL, NULL, NULL, &err) != KDS_OK) goto fail;
        double tp = kds_now_s();
        if (ep_on && eng_ctx_ep_stats_all(c, ep_all, true, &err) != KDS_OK) goto fail;
        /* a sustained read on each side (back to back for PAIR_READ_S)
         * and reads inside the run (INSIDE_READ_EVERY_S), GB/s over all of
         * them, as the run's own is over its tokens (the best of a few
         * short reads catches the quietest instant) */
        read_tally reads = {0};
        if (pair_reads) timed_read(membw, PAIR_READ_S, &reads);
        double t1 = kds_now_s(), last_read = t1;
        double inside = 0.0; /* seconds of reads inside the run */
        for (int64_t i = 0; i < gt; i++) {
            int32_t next;
            if (eng_sample(c, s, &greedy, &next, &err) != KDS_OK) goto fail;
            if (eng_decode(c, s, next, &err) != KDS_OK) goto fail;
            if (pair_reads && i + 1 < gt && kds_now_s() - last_read >= INSIDE_READ_EVERY_S) {
                inside += timed_read(membw, 0.0, &reads);
                last_read = kds_now_s();
            }
        }
        double t2 = kds_now_s() - inside;
        if (pair_reads) {
            timed_read(membw, PAIR_READ_S, &reads);
            const double mean = reads.seconds > 0 ? reads.gb / reads.seconds : 0.0;
            paired[r] = mean > 0 && t2 > t1 ? per_tok * gt / (t2 - t1) / 1e9 / mean : 0.0;
            bw = reads.best > bw ? reads.best : bw;
            bw_reads += reads.n;
            sustained += mean;
        }
        if (ep_on) {
            if (eng_ctx_ep_stats_all(c, ep_all, true, &err) != KDS_OK) goto fail;
            for (int k = 0; k < one.ranks; k++) {
                eng_ep_stats *a = &ep_sum[k], *b = &ep_all[k];
                a->ranks = b->ranks;
                a->passes += b->passes;
                a->moe_layers += b->moe_layers;
                a->dispatch_s += b->dispatch_s;
                a->counts_s += b->counts_s;
                a->experts_s += b->experts_s;
                a->combine_s += b->combine_s;
                a->pass_s += b->pass_s;
                a->rows_sent += b->rows_sent;
                a->rows_received += b->rows_received;
                a->bytes_sent += b->bytes_sent;
            }
        }
        pre[r] = pt / (tp - t0); /* the stats' own exchange (t1 - tp) is neither's */
        dec[r] = gt ? gt / (t2 - t1) : 0.0;
    }
    cli_sort_doubles(pre, (size_t)reps);
    cli_sort_doubles(dec, (size_t)reps);
    cli_sort_doubles(paired, (size_t)reps);
    eng_state_size z = eng_config_state_size(cfg);
    printf("model        %s\n", dir);
    printf("fingerprint  %s\n", eng_model_fingerprint(m));
    printf("params       %.2f M (%zu tensors), hidden %d, layers %d (%d KDA, %d MLA), "
           "experts %d top-%d, vocab %d\n",
           eng_config_param_count(cfg) / 1e6, eng_config_tensor_count(cfg), cfg->hidden_size,
           cfg->num_hidden_layers, cfg->n_kda_layers, cfg->n_mla_layers, cfg->num_experts,
           cfg->num_experts_per_token, cfg->vocab_size);
    printf("state        %zu bytes fixed + %zu bytes/token\n", z.fixed, z.per_token);
    const size_t resident = eng_model_resident_bytes(m);
    if (resident) {
        /* how much of it the kernel gave in huge pages (a hint it may not honour) */
        size_t huge = 0;
        FILE *sm = fopen("/proc/self/smaps_rollup", "r");
        char line[256];
        while (sm && fgets(line, sizeof line, sm))
            if (!strncmp(line, "AnonHugePages:", 14))
                huge = (size_t)strtoull(line + 14, NULL, 10) << 10;
        if (sm) fclose(sm);
        printf("weights      read into memory, %.2f GB (%.2f GB of this process in 2 MiB pages; "
               "KDS_WEIGHTS=mapped maps them)\n",
               resident / 1e9, huge / 1e9);
    } else {
        printf("weights      mapped from the files\n");
    }
    printf("threads      %d\n", eng_ctx_threads(c));
    printf("device       %s%s\n", eng_ctx_device(c),
           eng_ctx_device_kind(c) != ENG_DEVICE_CUDA
               ? (!gpu_bf16 ? (eng_cpu_bf16_tiles()
                                   ? " (exact; AMX tiles for rows of 2048+ columns but routed "
                                     "experts', x as bf16 hi + mid + lo)"
                                   : " (exact)")
                  : eng_cpu_bf16_tiles()
                      ? " (bf16 activations on AMX tiles: a prefill's bf16 products, a batched step's)"
                  : eng_cpu_bf16_products() ? " (bf16 activations: a prefill's bf16 products, a batched step's)"
                                            : " (exact: this build has no bf16 dot products)")
           : gpu_bf16 ? " (products above 8 rows: bf16 activations)"
                      : " (products above 8 rows: exact, bf16 hi + lo)");
    printf("prefill      %.1f tokens/s  (%lld tokens, best of %lld; median %.1f)\n",
           pre[reps - 1], (long long)pt, (long long)reps, pre[reps / 2]);
    printf("decode       %.1f tokens/s  (%lld tokens after the prompt, best of %lld; "
           "median %.1f; %.3f ms/token)\n",
           dec[reps - 1], (long long)gt, (long long)reps, dec[reps / 2],
           dec[reps - 1] > 0 ? 1000.0 / dec[reps - 1] : 0.0);
    double fma_peak = 0.0;
    if (eng_ctx_device_kind(c) == ENG_DEVICE_CPU && pre[reps - 1] > 0)
        fma_peak = print_prefill_peak(m, pt, pre[reps - 1], pre[reps / 2], eng_ctx_threads(c),
                                      gpu_bf16 && eng_cpu_bf16_products());
    if (want_bw) {
        /* what the decode read per token (at its middle position), against
         * a streaming read of the machine's memory measured now */
        const double best = per_tok * dec[reps - 1] / 1e9, median = per_tok * dec[reps / 2] / 1e9;
        printf("memory       a decoded token reads %.1f MB (weights %.1f, state %.1f): %.1f GB/s "
               "at the best run (median %.1f)\n",
               per_tok / 1e6, db.weights / 1e6, db.state / 1e6, best, median);
        if (!membw) {
            /* the figures above stand; only the comparison is missing */
            printf("             no streaming read this run: %s (a smaller --bandwidth-mib, or "
                   "0 to leave it out)\n", bw_err.msg);
        } else {
            if (!pair_reads) bw = eng_membw_read(membw, 3);
            /* above 100%: a token's bytes held in the caches, or (a machine
             * whose memory is shared) a read that got less than the decode */
            const char *above = best <= bw ? ""
                                : per_tok <= (double)eng_llc_bytes()
                                    ? "; above 100%: a token's bytes fit in the caches"
                                    : "; above 100%: the read got less of the memory than the "
                                      "decode (other tenants' load moves; repeat)";
            printf("             streaming read of %lld MiB on %d threads, this run: %.1f GB/s "
                   "(best of %lld) -> decode at %.0f%% of it (median %.0f%%)%s\n",
                   (long long)bw_mib, eng_ctx_threads(c), bw,
                   pair_reads ? (long long)bw_reads : 3LL, bw > 0 ? 100.0 * best / bw : 0.0,
                   bw > 0 ? 100.0 * median / bw : 0.0, above);
            if (pair_reads)
                printf("             each decode run against the reads beside and inside "
                       "it: %.0f%% (median of %lld runs; %.0f-%.0f%%; each side reads back to "
                       "back for %.2f s, and one read every %.2f s inside, its time left out "
                       "of the run's; GB/s over them all)\n",
                       100.0 * paired[reps / 2], (long long)reps, 100.0 * paired[0],
                       100.0 * paired[reps - 1], PAIR_READ_S, INSIDE_READ_EVERY_S);
        }
    }
    if (ep_on && ep_sum[0].moe_layers > 0) {
        /* each rank's own clock: a collective's time includes waiting for
         * the slowest rank to get there */
        printf("experts      %d ranks (expert parallel), per decode step and MoE layer, each "
               "rank's clock (us):\n", one.ranks);
        printf("  rank     counts  rows out    experts  rows back   rows sent  received   KB out\n");
        for (int k = 0; k < one.ranks; k++) {
            const eng_ep_stats *e = &ep_sum[k];
            const double per = e->moe_layers ? 1e6 / (double)e->moe_layers : 0.0;
            printf("  %4d %10.1f %9.1f %10.1f %10.1f %11.1f %9.1f %8.1f\n", k, e->counts_s * per,
                   (e->dispatch_s - e->counts_s) * per, e->experts_s * per, e->combine_s * per,
                   (double)e->rows_sent * per / 1e6, (double)e->rows_received * per / 1e6,
                   (double)e->bytes_sent * per / 1e9);
        }
        printf("  (counts: the counts exchange, with the wait for the slowest rank to reach the "
               "layer; rows back: with the wait for the slowest rank's experts)\n");
    }

    /* the decode's products against the sustained read where there is one */
    const double prof_read = !want_bw || !membw ? 0.0 : pair_reads ? sustained / (double)reps : bw;
    if (profile && bench_profile(c, s, ids, pt, gt, fma_peak, prof_read, &err) != KDS_OK)
        goto fail;
    if (n_counts > 0) {
        int most = 0;
        for (int i = 0; i < n_counts; i++) most = seq_counts[i] > most ? seq_counts[i] : most;
        if (most > eng_ctx_max_seqs(c)) { /* the batched decode's scratch is sized at creation */
            cp.max_seqs = most;
            cp.comm = cli_comm(); /* the same ranks (cli_open_with's) */
            eng_ctx_free(c);
            c = NULL;
            if (eng_ctx_create(m, &cp, &c, &err) != KDS_OK) goto fail;
        }
        printf("batching     aggregate decode tokens/s of N sequences (%lld-token prompts, "
               "%lld tokens each), best of %lld (median)\n",
               (long long)pt, (long long)gt, (long long)reps);
        for (int i = 0; i < n_counts; i++) {
            double r[4] = {0};
            if (bench_seqs(c, m, seq_counts[i], pt, gt, reps, profile, prof_read, r, &err) !=
                KDS_OK)
                goto fail;
        }
    }
    goto out;
fail:
    rc = cli_fail("bench", &err);
out:
    free(ids);
    free(pre);
    free(dec);
    free(paired);
    eng_membw_free(membw);
    free(ep_all);
    free(ep_sum);
    eng_seq_free(s);
    eng_ctx_free(c);
    eng_model_free(m);
    return rc;
}
