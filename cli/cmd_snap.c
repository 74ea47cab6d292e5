/* cmd_snap.c - `kdaserve snap`: list, show, fork, delete, verify, export,
 * import and collect snapshots and sessions; snapshot sizes; save/restore
 * benchmark. */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "eng_config.h"
#include "sess.h"
#include "kds_clock.h"

#define CMD "snap"

enum { OPT_DB = 2000, OPT_NAME, OPT_MODEL, OPT_TOKENS, OPT_REPEATS, OPT_THREADS, OPT_REPLAY_MAX,
       OPT_NO_SYNC, OPT_DEVICE, OPT_FORCE, OPT_DRY_RUN, OPT_ALL_HISTORY, OPT_KEEP_LAST,
       OPT_KEEP_EVERY, OPT_KEEP_DAYS, OPT_DEFAULT };

static const char *const SNAP_USAGE =
    "usage: kdaserve snap <command> [--db DIR] [options]\n\n"
    "Sessions and snapshots in the store (default $XDG_DATA_HOME/kdaserve, else\n"
    "~/.local/share/kdaserve; --db DIR chooses). A session is a name pointing at\n"
    "its latest snapshot; snapshots are immutable and written \"@N\". IDs below are\n"
    "a session name or a snapshot id.\n\n"
    "commands:\n"
    "  ls                      sessions and snapshots: ids, tokens, sizes, times\n"
    "  show ID                 one session (with its transcript) or snapshot\n"
    "  fork ID [--name N]      new session at ID's snapshot (no state is copied)\n"
    "  rm ID [--force]         delete a session (its snapshots stay until gc) or a\n"
    "                          snapshot that is no session's head (a restore point in\n"
    "                          a session's history only with --force or a yes)\n"
    "  verify [ID] [--model DIR]  check checksums (and with --model, fingerprints and\n"
    "                          layout) of one snapshot or of all; names the sessions a\n"
    "                          damaged snapshot leaves unresumable and their way back\n"
    "  recover NAME [--model DIR]  take session NAME, whose head is damaged, back to\n"
    "                          the last snapshot of its history that verifies\n"
    "  export ID FILE          write a session or snapshot to one portable file\n"
    "  import FILE [--name N]  add an exported file as a new session\n"
    "  gc [--dry-run]          delete the snapshots the retention policy lets go and\n"
    "                          the chunks no snapshot references (--all-history: every\n"
    "                          snapshot that is no head, with --force or a yes)\n"
    "  retention [--keep-last N] [--keep-every K] [--keep-days D] [--default]\n"
    "                          show or set what gc keeps of each session's history\n"
    "  compact                 shrink data.mdb to its live pages (store not in use)\n"
    "  size --model DIR [--tokens N]  bytes of one snapshot of that model at N tokens\n"
    "  bench --model DIR       save / restore latency and throughput, resume vs replay\n\n"
    "kdaserve snap <command> --help shows the command's options.\n";

static void usage(FILE *f) { fputs(SNAP_USAGE, f); }

/* ------------------------------------------------------------------------ */
/* Helpers                                                                   */

static void fmt_time(int64_t us, char *buf, size_t cap) {
    if (us <= 0) {
        snprintf(buf, cap, "-");
        return;
    }
    time_t t = (time_t)(us / 1000000);
    struct tm tm;
    localtime_r(&t, &tm);
    strftime(buf, cap, "%Y-%m-%d %H:%M:%S", &tm);
}

static void fmt_bytes(double b, char *buf, size_t cap) {
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    while (b >= 1024 && i < 4) b /= 1024, i++;
    snprintf(buf, cap, i ? "%.1f %s" : "%.0f %s", b, u[i]);
}

/* Text from a transcript: control bytes other than newline and tab shown as
 * \xHH, as generate prints them. */
static void print_text(const char *p, size_t n, const char *indent) {
    fputs(indent, stdout);
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)p[i];
        if (ch == '\n')
            printf("\n%s", indent);
        else if ((ch < 0x20 && ch != '\t') || ch == 0x7f)
            printf("\\x%02x", ch);
        else
            putchar(ch);
    }
    putchar('\n');
}

/* At a terminal, ask; in a script (stdin or stderr not a terminal) the
 * answer is no: --force says yes. */
static bool confirm(const char *question) {
    if (!isatty(0) || !isatty(2)) return false;
    fprintf(stderr, "%s [y/N] ", question);
    fflush(stderr);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return false;
    return line[0] == 'y' || line[0] == 'Y';
}

static const char *ordinal(uint32_t n, char *buf, size_t cap) {
    const char *suf = n % 100 >= 11 && n % 100 <= 13 ? "th"
                      : n % 10 == 1                  ? "st"
                      : n % 10 == 2                  ? "nd"
                      : n % 10 == 3                  ? "rd"
                                                     : "th";
    snprintf(buf, cap, "%u%s", n, suf);
    return buf;
}

/* "the last 10 snapshots of each session's line, the snapshot of every
 * 25th turn, ..." */
static void describe_retention(const sess_retention *r, char *buf, size_t cap) {
    char k[24];
    int n = r->keep_last > 1
                ? snprintf(buf, cap, "the last %u snapshots of each session's line", r->keep_last)
                : snprintf(buf, cap, "each session's head");
    if (n < 0 || (size_t)n >= cap) return;
    if (r->keep_every)
        n += snprintf(buf + n, cap - (size_t)n, ", the snapshot of every %s turn",
                      ordinal(r->keep_every, k, sizeof k));
    if (n < 0 || (size_t)n >= cap) return;
    if (r->keep_days)
        n += snprintf(buf + n, cap - (size_t)n, ", every snapshot younger than %u day%s",
                      r->keep_days, r->keep_days == 1 ? "" : "s");
    if (n < 0 || (size_t)n >= cap) return;
    snprintf(buf + n, cap - (size_t)n, ", and each fork's base");
}

/* Open the store (--db or the default). Commands that only read open it
 * read-only, so that a mistyped --db is an error, not a new empty store. */
static int open_store(const char *db, bool read_only, sess_store **st) {
    kds_err err = {0};
    sess_params p = sess_default_params();
    p.read_only = read_only;
    if (sess_open(db, &p, st, &err) != KDS_OK) return cli_fail(CMD, &err);
    return 0;
}

static int load_model(const char *dir, eng_model **m) {
    kds_err err = {0};
    eng_model_params mp = eng_model_default_params();
    mp.progress = true;
    mp.weights = ENG_WEIGHTS_MAPPED; /* states are checked against it, nothing runs */
    if (eng_model_load(dir, &mp, m, &err) != KDS_OK) return cli_fail(CMD, &err);
    return 0;
}

/* Common option parsing: --db, --help, plus the sub-command's extras. */
typedef struct sub_opts {
    const char *db, *name, *model, *device;
    int64_t tokens, repeats, threads, replay_max;
    bool tokens_set, no_sync;
    bool force, dry_run, all_history, default_policy;
    int64_t keep[3]; /* --keep-last, --keep-every, --keep-days; -1 = not given */
    const char *tokens_list;
    char **args;
    int n_args;
} sub_opts;

/* A usage error of `snap SUB`: one line, and where the options are. */
static int snap_usage_error(const char *sub, const char *what) {
    char cmd[48];
    snprintf(cmd, sizeof cmd, "snap %s", sub);
    return what ? cli_usage_error(cmd, "%s", what) : cli_usage_error(cmd, NULL);
}

static int parse_sub(int argc, char **argv, const char *help, sub_opts *o) {
    static const struct option opts[] = {
        {"db", required_argument, 0, OPT_DB},         {"name", required_argument, 0, OPT_NAME},
        {"model", required_argument, 0, OPT_MODEL},   {"tokens", required_argument, 0, OPT_TOKENS},
        {"repeats", required_argument, 0, OPT_REPEATS},
        {"threads", required_argument, 0, OPT_THREADS},
        {"replay-max", required_argument, 0, OPT_REPLAY_MAX},
        {"no-sync", no_argument, 0, OPT_NO_SYNC},     {"device", required_argument, 0, OPT_DEVICE},
        {"force", no_argument, 0, OPT_FORCE},         {"dry-run", no_argument, 0, OPT_DRY_RUN},
        {"all-history", no_argument, 0, OPT_ALL_HISTORY},
        {"keep-last", required_argument, 0, OPT_KEEP_LAST},
        {"keep-every", required_argument, 0, OPT_KEEP_EVERY},
        {"keep-days", required_argument, 0, OPT_KEEP_DAYS},
        {"default", no_argument, 0, OPT_DEFAULT},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    /* getopt names argv[0] in its messages: "kdaserve snap ls: ..." */
    char whole[64];
    snprintf(whole, sizeof whole, "kdaserve snap %s", argv[0]);
    const char *sub = argv[0];
    argv[0] = whole;
    optind = 1;
    o->keep[0] = o->keep[1] = o->keep[2] = -1;
    for (int c; (c = getopt_long(argc, argv, "h", opts, NULL)) != -1;) {
        switch (c) {
        case OPT_DB: o->db = optarg; break;
        case OPT_NAME: o->name = optarg; break;
        case OPT_MODEL: o->model = optarg; break;
        case OPT_NO_SYNC: o->no_sync = true; break;
        case OPT_FORCE: o->force = true; break;
        case OPT_DRY_RUN: o->dry_run = true; break;
        case OPT_ALL_HISTORY: o->all_history = true; break;
        case OPT_DEFAULT: o->default_policy = true; break;
        case OPT_KEEP_LAST:
        case OPT_KEEP_EVERY:
        case OPT_KEEP_DAYS: {
            int i = c == OPT_KEEP_LAST ? 0 : c == OPT_KEEP_EVERY ? 1 : 2;
            if (!cli_parse_i64(optarg, 0, UINT32_MAX, &o->keep[i]))
                return cli_failf(CMD, "--%s wants a count >= 0, got '%s'",
                                 i == 0 ? "keep-last" : i == 1 ? "keep-every" : "keep-days",
                                 optarg);
            break;
        }
        case OPT_DEVICE:
            if (!cli_device_valid(optarg))
                return cli_failf(CMD, "--device wants cpu or cuda, got '%s'", optarg);
            o->device = optarg;
            break;
        case OPT_TOKENS:
            o->tokens_list = optarg;
            o->tokens_set = true;
            if (!strchr(optarg, ',') && !cli_parse_i64(optarg, 0, (int64_t)1 << 40, &o->tokens))
                return cli_failf(CMD, "--tokens wants a count >= 0, got '%s'", optarg);
            break;
        case OPT_REPEATS:
            if (!cli_parse_i64(optarg, 1, 1000, &o->repeats))
                return cli_failf(CMD, "--repeats wants 1..1000, got '%s'", optarg);
            break;
        case OPT_THREADS:
            if (!cli_parse_i64(optarg, 1, 1024, &o->threads))
                return cli_failf(CMD, "--threads wants 1..1024, got '%s'", optarg);
            break;
        case OPT_REPLAY_MAX:
            if (!cli_parse_i64(optarg, 0, (int64_t)1 << 40, &o->replay_max))
                return cli_failf(CMD, "--replay-max wants a count >= 0, got '%s'", optarg);
            break;
        case 'h': fputs(help, stdout); return -1;
        default: argv[0] = (char *)sub; return snap_usage_error(sub, NULL);
        }
    }
    argv[0] = (char *)sub;
    o->args = argv + optind;
    o->n_args = argc - optind;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* ls                                                                        */

static int snap_ls(sess_store *st) {
    kds_err err = {0};
    sess_session_info *ss = NULL;
    sess_snapshot_info *sn = NULL;
    size_t ns = 0, nn = 0;
    int rc = 0;
    if (sess_session_list(st, &ss, &ns, &err) != KDS_OK ||
        sess_snapshot_list(st, &sn, &nn, &err) != KDS_OK) {
        rc = cli_fail(CMD, &err);
        goto out;
    }
    char t[32], b[32];
    printf("store %s\n\nsessions (%zu)\n", sess_store_dir(st), ns);
    if (ns)
        printf("  %-24s %-8s %10s %6s  %-19s  %s\n", "NAME", "HEAD", "TOKENS", "TURNS", "UPDATED",
               "MODEL");
    for (size_t i = 0; i < ns; i++) {
        char head[24];
        if (ss[i].tokens < 0) {
            printf("  %-24s (unreadable: run `kdaserve snap verify`)\n", ss[i].name);
            continue;
        }
        snprintf(head, sizeof head, "@%llu", (unsigned long long)ss[i].head);
        fmt_time(ss[i].updated_us, t, sizeof t);
        printf("  %-24s %-8s %10lld %6u  %-19s  %.12s%s%s\n", ss[i].name, head,
               (long long)ss[i].tokens, ss[i].turns, t, ss[i].fingerprint,
               ss[i].parent[0] ? "  fork of " : "", ss[i].parent);
    }
    printf("\nsnapshots (%zu)\n", nn);
    if (nn)
        printf("  %-8s %10s %-8s %11s  %-19s  %s\n", "ID", "TOKENS", "PARENT", "SIZE", "CREATED",
               "HEAD OF");
    size_t total = 0;
    for (size_t i = 0; i < nn; i++) {
        char id[24], parent[24];
        snprintf(id, sizeof id, "@%llu", (unsigned long long)sn[i].id);
        if (sn[i].parent)
            snprintf(parent, sizeof parent, "@%llu", (unsigned long long)sn[i].parent);
        else
            snprintf(parent, sizeof parent, "-");
        size_t size = sn[i].record_bytes + sn[i].new_chunk_bytes;
        total += size;
        fmt_bytes((double)size, b, sizeof b);
        fmt_time(sn[i].created_us, t, sizeof t);
        if (sn[i].tokens < 0) {
            printf("  %-8s %10s %-8s %11s  %-19s  (unreadable: run `kdaserve snap verify %s`)\n",
                   id, "?", "?", b, "?", id);
            continue;
        }
        printf("  %-8s %10lld %-8s %11s  %-19s ", id, (long long)sn[i].tokens, parent, b, t);
        for (size_t j = 0; j < ns; j++)
            if (ss[j].head == sn[i].id) printf(" %s", ss[j].name);
        putchar('\n');
    }
    fmt_bytes((double)total, b, sizeof b);
    printf("\n%zu snapshots, %s (state plus the MLA rows each first stored)\n", nn, b);
out:
    free(ss);
    free(sn);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* show                                                                      */

static void show_snapshot(const sess_snapshot_info *s) {
    char t[32], b[32];
    printf("snapshot      @%llu\n", (unsigned long long)s->id);
    printf("tokens        %lld\n", (long long)s->tokens);
    if (s->parent)
        printf("parent        @%llu\n", (unsigned long long)s->parent);
    else
        printf("parent        -\n");
    fmt_time(s->created_us, t, sizeof t);
    printf("created       %s\n", t);
    printf("written by    %s\n", s->origin[0] ? s->origin : "(import)");
    printf("model         %s\n", s->fingerprint);
    printf("format        KDSSNAP version %u\n", s->format_version);
    fmt_bytes((double)s->record_bytes, b, sizeof b);
    printf("record        %zu bytes (%s): header + fixed state of %zu bytes\n", s->record_bytes,
           b, s->fixed_bytes);
    if (s->token_bytes)
        printf("MLA cache     %zu bytes/token in %u chunks (%u new here, %zu bytes)\n",
               s->token_bytes, s->n_chunks, s->n_new_chunks, s->new_chunk_bytes);
    else
        printf("MLA cache     none (pure KDA model)\n");
}

static int snap_show(sess_store *st, const char *id) {
    kds_err err = {0};
    sess_ref ref;
    if (sess_resolve(st, id, &ref, &err) != KDS_OK) return cli_fail(CMD, &err);
    sess_snapshot_info si;
    if (!ref.is_session) {
        if (sess_snapshot_get(st, ref.snapshot, &si, &err) != KDS_OK) return cli_fail(CMD, &err);
        show_snapshot(&si);
        sess_session_info *ss = NULL;
        size_t ns = 0;
        if (sess_session_list(st, &ss, &ns, &err) == KDS_OK) {
            printf("head of      ");
            bool any = false;
            for (size_t i = 0; i < ns; i++)
                if (ss[i].head == si.id) printf(" %s", ss[i].name), any = true;
            printf("%s\n", any ? "" : " (no session: `snap gc` would delete it)");
        }
        free(ss);
        return 0;
    }
    sess_session_info s;
    if (sess_session_get(st, ref.name, &s, &err) != KDS_OK) return cli_fail(CMD, &err);
    char t[32];
    printf("session       %s\n", s.name);
    printf("head          @%llu\n", (unsigned long long)s.head);
    printf("tokens        %lld\n", (long long)s.tokens);
    printf("turns         %u\n", s.turns);
    if (s.parent[0] || s.fork_point)
        printf("forked from   %s at @%llu\n", s.parent[0] ? s.parent : "(snapshot)",
               (unsigned long long)s.fork_point);
    fmt_time(s.created_us, t, sizeof t);
    printf("created       %s\n", t);
    fmt_time(s.updated_us, t, sizeof t);
    printf("updated       %s\n", t);
    printf("owner         %s\n", s.owner);
    printf("model         %s\n", s.model_dir[0] ? s.model_dir : "-");
    printf("fingerprint   %s\n", s.fingerprint);
    sess_turn_record *tr = NULL;
    size_t n = 0;
    if (sess_transcript(st, s.name, &tr, &n, &err) != KDS_OK) return cli_fail(CMD, &err);
    printf("\ntranscript (%zu turns)\n", n);
    for (size_t i = 0; i < n; i++) {
        fmt_time(tr[i].time_us, t, sizeof t);
        printf("--- turn %zu, %s: %lld prompt + %lld generated tokens -> @%llu (%lld tokens)\n",
               i + 1, t, (long long)tr[i].prompt_tokens, (long long)tr[i].output_tokens,
               (unsigned long long)tr[i].snapshot, (long long)tr[i].tokens);
        if (tr[i].doc_name[0]) /* collapsed: `snap export` carries the text */
            printf("  [document %s: %lld bytes]\n", tr[i].doc_name, (long long)tr[i].doc_bytes);
        else if (tr[i].prompt_len)
            print_text(tr[i].prompt, tr[i].prompt_len, "  > ");
        print_text(tr[i].output, tr[i].output_len, "  < ");
    }
    sess_transcript_free(tr, n);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* verify                                                                    */

/* A session its head leaves unresumable: why, and the way back (the
 * newest snapshot of its history that verifies, and the command). */
static void session_failed(sess_store *st, const sess_session_info *s, const eng_model *m,
                           const char *model_dir, const char *why) {
    sess_recovery r;
    kds_err e = {0};
    printf("FAILED  session '%s' cannot be resumed: its head @%llu %s", s->name,
           (unsigned long long)s->head, why);
    if (sess_session_last_good(st, s->name, m, &r, &e) != KDS_OK)
        printf("; %s\n", e.msg);
    else if (r.to)
        printf("; last good snapshot of its history: @%llu (%lld tokens, %u of its %u turns): "
               "`kdaserve snap recover %s%s%s` goes back to it (keeping what it is now as "
               "session '%s-damaged')\n", (unsigned long long)r.to, (long long)r.tokens, r.turns,
               r.turns + r.turns_after, s->name, model_dir ? " --model " : "",
               model_dir ? model_dir : "", s->name);
    else
        printf("; no earlier snapshot of its history verifies (its transcript is intact: "
               "`kdaserve snap show %s`)\n", s->name);
}

static void print_heads_of(const sess_session_info *ss, size_t ns, uint64_t id) {
    bool any = false;
    for (size_t j = 0; j < ns; j++)
        if (ss[j].tokens >= 0 && ss[j].head == id) {
            printf("%s%s", any ? ", " : "  (head of: ", ss[j].name);
            any = true;
        }
    if (any) printf(")");
}

static int snap_verify(sess_store *st, const char *id, const char *model_dir) {
    kds_err err = {0};
    eng_model *m = NULL;
    int rc = 0;
    sess_snapshot_info *sn = NULL;
    sess_session_info *ss = NULL;
    uint64_t *failed = NULL;
    size_t nn = 0, ns = 0, bad = 0, n_failed = 0;
    if (model_dir && (rc = load_model(model_dir, &m))) return rc;
    if (sess_session_list(st, &ss, &ns, &err) != KDS_OK) {
        rc = cli_fail(CMD, &err);
        goto out;
    }
    if (id) {
        sess_ref ref;
        if (sess_resolve(st, id, &ref, &err) != KDS_OK) {
            rc = cli_fail(CMD, &err);
        } else if (sess_verify(st, ref.snapshot, m, &err) != KDS_OK) {
            printf("FAILED  @%llu  %s", (unsigned long long)ref.snapshot, err.msg);
            print_heads_of(ss, ns, ref.snapshot);
            printf("\n");
            char why[600];
            snprintf(why, sizeof why, "does not verify (%s)", err.msg);
            for (size_t j = 0; j < ns; j++)
                if (ss[j].tokens >= 0 && ss[j].head == ref.snapshot &&
                    (!ref.is_session || !strcmp(ss[j].name, ref.name)))
                    session_failed(st, &ss[j], m, model_dir, why);
            rc = 1;
        } else {
            printf("ok      @%llu%s\n", (unsigned long long)ref.snapshot,
                   m ? "" : "  (fingerprint not checked: no --model)");
        }
        goto out;
    }
    if (sess_snapshot_list(st, &sn, &nn, &err) != KDS_OK) {
        rc = cli_fail(CMD, &err);
        goto out;
    }
    if (nn && !(failed = calloc(nn, sizeof *failed))) {
        rc = cli_failf(CMD, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < nn; i++) {
        if (sess_verify(st, sn[i].id, m, &err) != KDS_OK) {
            printf("FAILED  @%llu  %s", (unsigned long long)sn[i].id, err.msg);
            print_heads_of(ss, ns, sn[i].id);
            printf("\n");
            failed[n_failed++] = sn[i].id;
            bad++;
        } else {
            printf("ok      @%llu  %lld tokens\n", (unsigned long long)sn[i].id,
                   (long long)sn[i].tokens);
        }
    }
    /* the sessions those failures leave unresumable, each with its way back */
    for (size_t i = 0; i < ns; i++) {
        sess_snapshot_info si;
        bool head_failed = false;
        for (size_t j = 0; j < n_failed; j++) head_failed |= failed[j] == ss[i].head;
        if (ss[i].tokens < 0) {
            sess_session_info one;
            sess_session_get(st, ss[i].name, &one, &err);
            printf("FAILED  session '%s': %s\n", ss[i].name, err.msg);
            bad++;
        } else if (head_failed) {
            session_failed(st, &ss[i], m, model_dir, "does not verify (above)");
            bad++;
        } else if (sess_snapshot_get(st, ss[i].head, &si, &err) != KDS_OK) {
            char why[600];
            snprintf(why, sizeof why, "cannot be read: %s", err.msg);
            session_failed(st, &ss[i], m, model_dir, why);
            bad++;
        }
    }
    printf("%zu snapshots, %zu sessions: %zu failed%s\n", nn, ns, bad,
           m ? "" : " (fingerprints not checked: no --model)");
    rc = bad ? 1 : 0;
out:
    free(sn);
    free(ss);
    free(failed);
    eng_model_free(m);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* recover                                                                   */

static int snap_recover(sess_store *st, const char *name, const char *model_dir) {
    kds_err err = {0};
    eng_model *m = NULL;
    int rc = 0;
    if (model_dir && (rc = load_model(model_dir, &m))) return rc;
    sess_recovery r;
    if (sess_session_recover(st, name, m, &r, &err) != KDS_OK) {
        rc = cli_fail(CMD, &err);
    } else {
        printf("session '%s' went back from @%llu (damaged) to @%llu (%lld tokens, %u turns); "
               "what it was, @%llu with all %u turns, is kept as session '%s'\n", name,
               (unsigned long long)r.head, (unsigned long long)r.to, (long long)r.tokens, r.turns,
               (unsigned long long)r.head, r.turns + r.turns_after, r.kept);
    }
    eng_model_free(m);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* gc, rm, retention, compact                                                */

static void print_gc(const sess_gc_stats *g, bool dry) {
    char b[32];
    fmt_bytes((double)g->bytes_freed, b, sizeof b);
    printf("%s %llu snapshots (%llu of them restore points) and %llu chunks (%s); kept %llu "
           "snapshots (%llu restore points) and %llu chunks%s\n", dry ? "would free" : "freed",
           (unsigned long long)g->snapshots_freed, (unsigned long long)g->restore_points_freed,
           (unsigned long long)g->chunks_freed, b, (unsigned long long)g->snapshots_kept,
           (unsigned long long)g->restore_points_kept, (unsigned long long)g->chunks_kept,
           g->unreadable ? " (unreadable records: kept all they might reference)" : "");
    if (g->index_freed)
        printf("%s %llu resume-index entries of snapshots that are gone; kept %llu\n",
               dry ? "would drop" : "dropped", (unsigned long long)g->index_freed,
               (unsigned long long)g->index_kept);
}

static int snap_gc(sess_store *st, const sub_opts *o) {
    kds_err err = {0};
    sess_gc_stats g;
    if (o->all_history) {
        /* every restore point goes: say how many, and want a yes */
        if (sess_prune(st, NULL, SESS_PRUNE_HEADS_ONLY | SESS_PRUNE_DRY_RUN, &g, &err) != KDS_OK)
            return cli_fail(CMD, &err);
        if (o->dry_run) {
            print_gc(&g, true);
            return 0;
        }
        if (g.restore_points_freed && !o->force) {
            char q[200];
            snprintf(q, sizeof q, "gc --all-history deletes %llu restore points (every snapshot "
                     "of the sessions' histories but their heads): go on?",
                     (unsigned long long)g.restore_points_freed);
            if (!confirm(q))
                return cli_failf(CMD, "gc --all-history would delete %llu restore points (every "
                                 "snapshot of the sessions' histories but their heads; `snap gc` "
                                 "keeps what the retention policy keeps): pass --force to delete "
                                 "them", (unsigned long long)g.restore_points_freed);
        }
        if (sess_gc(st, &g, &err) != KDS_OK) return cli_fail(CMD, &err);
        print_gc(&g, false);
        return 0;
    }
    sess_retention r;
    if (sess_retention_get(st, &r, NULL, &err) != KDS_OK) return cli_fail(CMD, &err);
    if (o->keep[0] >= 0) r.keep_last = (uint32_t)o->keep[0];
    if (o->keep[1] >= 0) r.keep_every = (uint32_t)o->keep[1];
    if (o->keep[2] >= 0) r.keep_days = (uint32_t)o->keep[2];
    if (sess_prune(st, &r, o->dry_run ? SESS_PRUNE_DRY_RUN : 0, &g, &err) != KDS_OK)
        return cli_fail(CMD, &err);
    print_gc(&g, o->dry_run);
    char d[300];
    describe_retention(&r, d, sizeof d);
    printf("kept: %s (`kdaserve snap retention` sets the policy)\n", d);
    if (!o->dry_run && g.bytes_freed)
        printf("data.mdb keeps its size (LMDB reuses the pages): `kdaserve snap compact` shrinks "
               "it\n");
    return 0;
}

static int snap_rm(sess_store *st, const char *id, bool force) {
    kds_err err = {0};
    sess_ref ref;
    if (sess_resolve(st, id, &ref, &err) != KDS_OK) return cli_fail(CMD, &err);
    if (ref.is_session) {
        if (sess_session_delete(st, ref.name, &err) != KDS_OK) return cli_fail(CMD, &err);
        printf("deleted session '%s' (its snapshots stay until `snap gc`)\n", ref.name);
        return 0;
    }
    sess_snapshot_use uses[8];
    size_t n = 0;
    if (sess_snapshot_uses(st, ref.snapshot, uses, 8, &n, &err) != KDS_OK)
        return cli_fail(CMD, &err);
    size_t restore = 0, first = n;
    for (size_t i = 0; i < n && i < 8; i++)
        if (!uses[i].head) {
            restore++;
            if (first == n) first = i;
        }
    if (restore && !force) {
        const sess_snapshot_use *u = &uses[first];
        char where[96];
        if (u->turn)
            snprintf(where, sizeof where, "turn %u of %u", u->turn, u->turns);
        else if (u->fork_point)
            snprintf(where, sizeof where, "the snapshot it was forked at");
        else
            snprintf(where, sizeof where, "%d snapshots back from its head", u->chain);
        char more[48] = "";
        if (n > 1) snprintf(more, sizeof more, ", and of %zu more sessions", n - 1);
        char q[400];
        snprintf(q, sizeof q, "snapshot @%llu is a restore point of session '%s' (%s)%s: delete "
                 "it?", (unsigned long long)ref.snapshot, u->session, where, more);
        if (!confirm(q))
            return cli_failf(CMD, "snapshot @%llu is a restore point of session '%s' (%s)%s: "
                             "deleting it cuts that history (the session stays resumable); pass "
                             "--force to delete it", (unsigned long long)ref.snapshot,
                             u->session, where, more);
    }
    if (sess_snapshot_delete(st, ref.snapshot, &err) != KDS_OK) return cli_fail(CMD, &err);
    printf("deleted snapshot @%llu%s\n", (unsigned long long)ref.snapshot,
           restore ? " (a restore point)" : "");
    return 0;
}

static int snap_retention(sess_store *st, const sub_opts *o) {
    kds_err err = {0};
    sess_retention r;
    bool set;
    /* a damaged policy record can still be reset */
    if (sess_retention_get(st, &r, &set, &err) != KDS_OK && !o->default_policy)
        return cli_fail(CMD, &err);
    bool change = o->default_policy || o->keep[0] >= 0 || o->keep[1] >= 0 || o->keep[2] >= 0;
    if (o->default_policy) {
        if (sess_retention_set(st, NULL, &err) != KDS_OK) return cli_fail(CMD, &err);
        r = sess_default_retention();
        set = false;
    }
    if (o->keep[0] >= 0) r.keep_last = (uint32_t)o->keep[0];
    if (o->keep[1] >= 0) r.keep_every = (uint32_t)o->keep[1];
    if (o->keep[2] >= 0) r.keep_days = (uint32_t)o->keep[2];
    if (o->keep[0] >= 0 || o->keep[1] >= 0 || o->keep[2] >= 0) {
        if (sess_retention_set(st, &r, &err) != KDS_OK) return cli_fail(CMD, &err);
        set = true;
    }
    char d[300];
    describe_retention(&r, d, sizeof d);
    printf("retention of store %s%s: %s\n", sess_store_dir(st), set ? "" : " (the default)", d);
    sess_gc_stats g;
    if (sess_prune(st, &r, SESS_PRUNE_DRY_RUN, &g, &err) == KDS_OK) {
        printf("`kdaserve snap gc` %s: ", change ? "would now" : "would");
        print_gc(&g, true);
    }
    return 0;
}

static int snap_compact(const char *db) {
    kds_err err = {0};
    sess_compact_stats z;
    if (sess_compact(db, &z, &err) != KDS_OK) return cli_fail(CMD, &err);
    char a[32], b[32];
    fmt_bytes((double)z.bytes_before, a, sizeof a);
    fmt_bytes((double)z.bytes_after, b, sizeof b);
    if (z.bytes_after == z.bytes_before)
        printf("data.mdb is already compact: %llu bytes (%s)\n",
               (unsigned long long)z.bytes_before, a);
    else
        printf("compacted data.mdb from %llu bytes (%s) to %llu bytes (%s)\n",
               (unsigned long long)z.bytes_before, a, (unsigned long long)z.bytes_after, b);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* size                                                                      */

static int snap_size(const char *model_dir, int64_t tokens) {
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", model_dir);
    eng_config cfg;
    kds_err err = {0};
    if (eng_config_load(path, &cfg, &err) != KDS_OK) return cli_fail(CMD, &err);
    sess_size z = sess_snapshot_size(&cfg, tokens);
    sess_size one = sess_snapshot_size(&cfg, 1);
    char b[32];
    printf("model          %s (%d KDA + %d MLA layers)\n", model_dir, cfg.n_kda_layers,
           cfg.n_mla_layers);
    fmt_bytes((double)z.fixed_bytes, b, sizeof b);
    printf("fixed state    %zu bytes (%s): KDA states, conv tails, logits, sampler\n",
           z.fixed_bytes, b);
    printf("per token      %zu bytes (MLA latent cache)\n", z.token_bytes);
    fmt_bytes((double)z.total, b, sizeof b);
    printf("at %lld tokens  %zu bytes (%s) = record %zu + MLA chunks %zu\n", (long long)tokens,
           z.total, b, z.record, z.chunks);
    printf("a later turn   record %zu bytes + %zu bytes per new token (older rows shared)\n",
           one.record, z.token_bytes);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* bench                                                                     */

static const char *const BENCH_USAGE =
    "usage: kdaserve snap bench --model DIR [--db DIR] [--tokens N,N,...] [--repeats R]\n"
    "                           [--replay-max N] [--threads N] [--no-sync]\n"
    "                           [--device cpu|cuda]\n\n"
    "For each context length N (default 1024,32768): builds the state of N random\n"
    "tokens by prefill (the replay a resume avoids, timed), saves it as a snapshot\n"
    "R times (default 5) and loads it back R times, and prints the median save and\n"
    "restore latency and throughput, and resume (open the store + load) against\n"
    "replay. Contexts above --replay-max (default 32768) are not prefilled: for a\n"
    "pure-KDA model the state of the largest measured context is saved with its\n"
    "position set to N (the bytes have the same size at every position), and the\n"
    "replay time is extrapolated from the measured prefill rate (marked \"extrap.\").\n"
    "Without --db a temporary store under /tmp is used and removed. --no-sync saves\n"
    "without fsync (MDB_NOSYNC).\n\n"
    "--device cuda prefills on the GPU and adds a column: the state of each restore\n"
    "moved onto the device (eng_ctx_attach), next to a plain pinned-memory copy of\n"
    "the same bytes to the device, so restore-to-GPU can be read against the copy.\n";

static int rm_tree(const char *dir) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd);
}

static int snap_bench(sub_opts *o) {
    if (!o->model) return cli_failf(CMD, "bench needs --model DIR");
    int64_t counts[16];
    int n_counts = 0;
    const char *list = o->tokens_list ? o->tokens_list : "1024,32768";
    for (const char *p = list; *p && n_counts < 16;) {
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || v < 1 || errno || (*end && *end != ','))
            return cli_failf(CMD, "--tokens wants counts like 1024,32768, got '%s'", list);
        counts[n_counts++] = v;
        p = *end ? end + 1 : end;
    }
    int reps = o->repeats ? (int)o->repeats : 5;
    int64_t replay_max = o->replay_max ? o->replay_max : 32768;
    char tmpdb[] = "/tmp/kds_snapbench_XXXXXX";
    const char *db = o->db;
    if (!db) {
        if (!mkdtemp(tmpdb)) return cli_failf(CMD, "mkdtemp: %s", strerror(errno));
        db = tmpdb;
    }
    eng_model *m = NULL;
    eng_ctx *c = NULL;
    eng_seq *s = NULL, *r = NULL;
    sess_store *st = NULL;
    int32_t *ids = NULL;
    unsigned char *state = NULL, *back = NULL;
    double *t_save = calloc((size_t)reps, sizeof(double)), *t_load = calloc((size_t)reps,
                                                                              sizeof(double));
    double *t_resume = calloc((size_t)reps, sizeof(double));
    kds_err err = {0};
    eng_device dev = ENG_DEVICE_CPU;
    const bool on_gpu = eng_device_from_name(o->device, &dev) && dev == ENG_DEVICE_CUDA;
    double *t_up = calloc((size_t)reps, sizeof(double));
    int rc = cli_open_on(CMD, o->model, (int)o->threads, 0, o->device, &m, &c);
    if (rc) goto out;
    if (!t_save || !t_load || !t_resume || !t_up) {
        rc = cli_failf(CMD, "out of memory");
        goto out;
    }
    const eng_config *cfg = eng_model_config(m);
    sess_params sp = sess_default_params();
    sp.no_sync = o->no_sync;
    if (sess_open(db, &sp, &st, &err) != KDS_OK) {
        rc = cli_fail(CMD, &err);
        goto out;
    }
    int64_t maxc = 0;
    for (int i = 0; i < n_counts; i++)
        if (counts[i] <= replay_max && counts[i] > maxc) maxc = counts[i];
    if (!(ids = malloc(((size_t)maxc + 1) * sizeof *ids))) {
        rc = cli_failf(CMD, "out of memory for %lld tokens", (long long)maxc);
        goto out;
    }
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int64_t i = 0; i < maxc; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        ids[i] = (int32_t)(x % (uint64_t)cfg->vocab_size);
    }
    printf("model        %s (%d KDA + %d MLA layers), fingerprint %.12s\n", o->model,
           cfg->n_kda_layers, cfg->n_mla_layers, eng_model_fingerprint(m));
    eng_state_size z = eng_config_state_size(cfg);
    printf("state        %zu bytes fixed + %zu bytes/token\n", z.fixed, z.per_token);
    printf("store        %s (%s commits), %d repeats, %d threads\n", db,
           o->no_sync ? "no-sync" : "durable", reps, eng_ctx_threads(c));
    printf("device       %s\n", eng_ctx_device(c));
    printf("\n%10s %10s %22s %22s %22s %12s %14s %9s%s\n", "tokens", "snapshot", "save (median)",
           "restore (median)", "resume (open+load)", "replay", "replay tok/s", "speedup",
           on_gpu ? "   onto GPU (median)   copy alone" : "");
    double rate = 0; /* measured prefill tokens/s of the largest measured context */
    int64_t rate_at = 0;
    for (int ci = 0; ci < n_counts; ci++) {
        int64_t T = counts[ci];
        bool measured = T <= replay_max;
        double replay = 0;
        eng_seq_free(s);
        s = NULL;
        if (eng_seq_create(m, 1, &s, &err) != KDS_OK) goto fail;
        if (measured) {
            double t0 = kds_now_s();
            if (eng_prefill(c, s, ids, T, NULL, NULL, NULL, &err) != KDS_OK) goto fail;
            replay = kds_now_s() - t0;
            if (T >= rate_at) rate = T / replay, rate_at = T;
        } else {
            if (z.per_token) {
                rc = cli_failf(CMD, "%lld tokens is above --replay-max and the model has MLA "
                               "layers (their cache grows with the context): raise --replay-max",
                               (long long)T);
                goto out;
            }
            /* the largest measured state, with its position field set to T:
             * for a pure-KDA model every byte count is the same at any
             * position (docs/formats.md, offset 16 of KDSSTATE) */
            if (!rate_at) {
                rc = cli_failf(CMD, "list a context <= --replay-max before %lld", (long long)T);
                goto out;
            }
            if (eng_prefill(c, s, ids, rate_at, NULL, NULL, NULL, &err) != KDS_OK) goto fail;
            size_t n = eng_seq_state_bytes(s);
            unsigned char *b = malloc(n);
            if (!b || eng_seq_state_save(s, b, n, &err) != KDS_OK) {
                free(b);
                goto fail;
            }
            for (int i = 0; i < 8; i++) b[16 + i] = (unsigned char)((uint64_t)T >> (8 * i));
            kds_status ls = eng_seq_state_load(s, b, n, &err);
            free(b);
            if (ls != KDS_OK) goto fail;
            replay = T / rate;
        }
        size_t n = eng_seq_state_bytes(s);
        free(state);
        free(back);
        state = malloc(n);
        back = malloc(n);
        if (!state || !back || eng_seq_state_save(s, state, n, &err) != KDS_OK) goto fail;
        char name[64];
        uint64_t snap = 0;
        for (int i = 0; i < reps; i++) {
            /* a fresh session each time: a full snapshot, as a first save */
            snprintf(name, sizeof name, "bench-%lld-%d", (long long)T, i);
            double t0 = kds_now_s();
            if (sess_save(st, name, 0, m, s, NULL, &snap, &err) != KDS_OK) goto fail;
            t_save[i] = kds_now_s() - t0;
        }
        sess_snapshot_info si;
        for (int i = 0; i < reps; i++) {
            eng_seq_free(r);
            r = NULL;
            if (eng_seq_create(m, 0, &r, &err) != KDS_OK) goto fail;
            double t0 = kds_now_s();
            if (sess_load(st, snap, m, r, &si, &err) != KDS_OK) goto fail;
            t_load[i] = kds_now_s() - t0;
            if (on_gpu) { /* the restored state onto the device */
                t0 = kds_now_s();
                if (eng_ctx_attach(c, r, &err) != KDS_OK) goto fail;
                t_up[i] = kds_now_s() - t0;
            }
        }
        if (eng_seq_state_save(r, back, n, &err) != KDS_OK) goto fail;
        if (memcmp(state, back, n) != 0) {
            rc = cli_failf(CMD, "restored state differs from the saved one at %lld tokens",
                           (long long)T);
            goto out;
        }
        /* resume as a new process does it: open the store, find the session,
         * load its head (model loading excluded: replay needs it too) */
        for (int i = 0; i < reps; i++) {
            eng_seq_free(r);
            r = NULL;
            if (eng_seq_create(m, 0, &r, &err) != KDS_OK) goto fail;
            sess_close(st);
            st = NULL;
            double t0 = kds_now_s();
            sess_session_info ss;
            if (sess_open(db, &sp, &st, &err) != KDS_OK ||
                sess_session_get(st, name, &ss, &err) != KDS_OK ||
                sess_load(st, ss.head, m, r, NULL, &err) != KDS_OK)
                goto fail;
            t_resume[i] = kds_now_s() - t0;
        }
        size_t bytes = si.record_bytes + si.new_chunk_bytes;
        double ms = cli_median(t_save, reps), ml = cli_median(t_load, reps),
               mr = cli_median(t_resume, reps);
        char b1[40], b2[40], b3[40], b4[24], b5[24];
        snprintf(b1, sizeof b1, "%.2f ms %6.0f MB/s", ms * 1e3, bytes / ms / 1e6);
        snprintf(b2, sizeof b2, "%.2f ms %6.0f MB/s", ml * 1e3, bytes / ml / 1e6);
        snprintf(b3, sizeof b3, "%.2f ms", mr * 1e3);
        snprintf(b4, sizeof b4, "%.2f s%s", replay, measured ? "" : "*");
        snprintf(b5, sizeof b5, "%.0f%s", measured ? T / replay : rate, measured ? "" : "*");
        char sz[24];
        fmt_bytes((double)bytes, sz, sizeof sz);
        printf("%10lld %10s %22s %22s %22s %12s %14s %8.0fx", (long long)T, sz, b1, b2, b3, b4,
               b5, replay / mr);
        if (on_gpu) {
            double copy = 0, mu = cli_median(t_up, reps);
            if (cli_copy_to_device_s(eng_seq_fixed_bytes(r), reps, &copy, &err) != KDS_OK) goto fail;
            printf("   %8.2f ms %5.1f GB/s   %8.2f ms %5.1f GB/s", mu * 1e3,
                   eng_seq_fixed_bytes(r) / mu / 1e9, copy * 1e3, eng_seq_fixed_bytes(r) / copy / 1e9);
        }
        printf("\n");
        fflush(stdout);
        /* drop this length's snapshots so the store does not grow run to run */
        for (int i = 0; i < reps; i++) {
            snprintf(name, sizeof name, "bench-%lld-%d", (long long)T, i);
            sess_session_delete(st, name, NULL);
        }
        sess_gc(st, NULL, NULL);
    }
    printf("\n* extrapolated: state of %lld measured tokens saved at the listed position; "
           "replay = tokens / the prefill rate measured at %lld tokens\n", (long long)rate_at,
           (long long)rate_at);
    printf("MB/s = snapshot bytes / median time; restore reads a warm page cache\n");
    goto out;
fail:
    rc = cli_fail(CMD, &err);
out:
    free(ids);
    free(state);
    free(back);
    free(t_save);
    free(t_load);
    free(t_resume);
    free(t_up);
    eng_seq_free(s);
    eng_seq_free(r);
    sess_close(st);
    eng_ctx_free(c);
    eng_model_free(m);
    if (!o->db) rm_tree(tmpdb);
    return rc;
}

/* ------------------------------------------------------------------------ */

static const char *const LS_USAGE = "usage: kdaserve snap ls [--db DIR]\n\n"
                                    "Lists sessions (name, head snapshot, tokens, turns, last "
                                    "update, model) and\nsnapshots (id, tokens, parent, stored "
                                    "size, creation time, sessions it heads).\n";
static const char *const SHOW_USAGE =
    "usage: kdaserve snap show ID [--db DIR]\n\n"
    "A session (metadata and transcript) or a snapshot \"@N\" (header, sizes).\n";
static const char *const FORK_USAGE =
    "usage: kdaserve snap fork ID [--name NAME] [--db DIR]\n\n"
    "Creates session NAME (default \"<ID>-N\") at the snapshot of session or snapshot ID,\n"
    "with a copy of the session's transcript. No state bytes are copied: both\n"
    "sessions share the snapshot, and each moves on with its own next save.\n";
static const char *const RM_USAGE =
    "usage: kdaserve snap rm ID [--force] [--db DIR]\n\n"
    "Deletes a session and its transcript (its snapshots stay until `snap gc`), or a\n"
    "snapshot \"@N\" that is no session's head. A snapshot in the middle of a\n"
    "session's history (a restore point: a turn its transcript names, a parent on its\n"
    "line, its fork point) is deleted only with --force, or when you say yes at a\n"
    "terminal: the refusal names the session and the turn. The session stays\n"
    "resumable either way; only that restore point is gone.\n";
static const char *const VERIFY_USAGE =
    "usage: kdaserve snap verify [ID] [--model DIR] [--db DIR]\n\n"
    "Checks one snapshot (or every snapshot and session head): magic, format version,\n"
    "header and payload checksums (XXH3-64), every MLA chunk and its coverage. With\n"
    "--model also the model fingerprint and the state layout. Exit status 1 if any\n"
    "check fails; each failure is one line naming the reason. A damaged snapshot is\n"
    "followed by one line for every session it leaves unresumable (the session whose\n"
    "head it is, and every fork sharing that head): the last snapshot of that\n"
    "session's history that still verifies, and the `snap recover` that goes back.\n";
static const char *const RECOVER_USAGE =
    "usage: kdaserve snap recover NAME [--model DIR] [--db DIR]\n\n"
    "Session NAME's head does not verify (see `snap verify`): NAME goes back to the\n"
    "newest snapshot of its history that does (its parents, the snapshots its turns\n"
    "saved, its fork point), with its transcript up to there. What it was, the\n"
    "damaged head with the whole transcript, is kept as session NAME-damaged (a\n"
    "fork of NAME), so nothing is deleted. With --model the snapshot gone back to\n"
    "must also be that model's. Refused when NAME's head verifies.\n";
static const char *const EXPORT_USAGE =
    "usage: kdaserve snap export ID FILE [--db DIR]\n\n"
    "Writes session ID (record, transcript, snapshot, MLA chunks) or snapshot \"@N\" to\n"
    "FILE, one portable file (docs/snapshot-format.md). The snapshot is verified first.\n";
static const char *const IMPORT_USAGE =
    "usage: kdaserve snap import FILE [--name NAME] [--db DIR]\n\n"
    "Adds an exported file as a new session (NAME, else the exported name, else\n"
    "\"import-N\"). Every record is checked before anything is written.\n";
static const char *const GC_USAGE =
    "usage: kdaserve snap gc [--dry-run] [--keep-last N] [--keep-every K] [--keep-days D]\n"
    "                        [--all-history [--force]] [--db DIR]\n\n"
    "Deletes the snapshots the store's retention policy does not keep (`snap\n"
    "retention`; the default keeps the last 10 snapshots of each session's line and\n"
    "the snapshot of every 25th turn), snapshots of no session's history, and then\n"
    "the MLA chunks no remaining snapshot references. Heads and each fork's base are\n"
    "always kept. --keep-last/--keep-every/--keep-days override the policy for this\n"
    "run. --dry-run counts what would go and deletes nothing. --all-history keeps\n"
    "only the heads, deleting every restore point: it wants --force (or a yes at a\n"
    "terminal). data.mdb keeps its size (LMDB reuses the pages): `snap compact`\n"
    "shrinks it.\n";
static const char *const RETENTION_USAGE =
    "usage: kdaserve snap retention [--keep-last N] [--keep-every K] [--keep-days D]\n"
    "                               [--default] [--db DIR]\n\n"
    "Shows, or sets (options given), what `snap gc` keeps of each session's history\n"
    "besides its head: the last N snapshots of its line (head included), the\n"
    "snapshot of every Kth turn of its transcript, and every snapshot younger than D\n"
    "days (0 turns a rule off); each fork's base is always kept. Stored in the store\n"
    "(options not given keep their values); --default goes back to the default (the\n"
    "last 10, every 25th turn, no age). Deletes nothing itself: it says what `snap\n"
    "gc` would delete now.\n";
static const char *const COMPACT_USAGE =
    "usage: kdaserve snap compact [--db DIR]\n\n"
    "Shrinks data.mdb to its live pages: LMDB's compacting copy into DIR/compact.tmp,\n"
    "checked (it opens and holds as many records as the store), synced and renamed\n"
    "over data.mdb. Needs the store to itself: refused, naming the process, while\n"
    "another process has it open (stop `kdaserve serve`, leave `kdaserve chat`).\n"
    "Needs free space for the copy; on any failure data.mdb is untouched. Run it\n"
    "after `snap gc`.\n";
static const char *const SIZE_USAGE =
    "usage: kdaserve snap size --model DIR [--tokens N]\n\n"
    "Bytes one snapshot of that model takes at N tokens (default 1024), and what a\n"
    "later turn adds. Reads only config.json.\n";

int cmd_snap(int argc, char **argv) {
    if (argc < 2)
        return cli_usage_error(CMD, "which command? ls, show, fork, rm, verify, recover, "
                                    "export, import, gc, retention, compact, size or bench");
    const char *sub = argv[1];
    if (!strcmp(sub, "--help") || !strcmp(sub, "-h") || !strcmp(sub, "help")) {
        usage(stdout);
        return 0;
    }
    static const struct {
        const char *name;
        int min_args, max_args;
    } SUBS[] = {{"ls", 0, 0},     {"show", 1, 1}, {"fork", 1, 1},   {"rm", 1, 1},
                {"verify", 0, 1}, {"export", 2, 2}, {"import", 1, 1}, {"gc", 0, 0},
                {"size", 0, 0},   {"bench", 0, 0}, {"recover", 1, 1}, {"retention", 0, 0},
                {"compact", 0, 0}};
    const char *helps[] = {LS_USAGE,     SHOW_USAGE,   FORK_USAGE,      RM_USAGE,
                           VERIFY_USAGE, EXPORT_USAGE, IMPORT_USAGE,    GC_USAGE,
                           SIZE_USAGE,   BENCH_USAGE,  RECOVER_USAGE,   RETENTION_USAGE,
                           COMPACT_USAGE};
    int k = -1;
    for (int i = 0; i < (int)(sizeof SUBS / sizeof SUBS[0]); i++)
        if (!strcmp(sub, SUBS[i].name)) k = i;
    if (k < 0) return cli_usage_error(CMD, "unknown command '%s'", sub);
    sub_opts o = {0};
    int pr = parse_sub(argc - 1, argv + 1, helps[k], &o);
    if (pr < 0) return 0;
    if (pr) return pr;
    if (o.n_args < SUBS[k].min_args || o.n_args > SUBS[k].max_args) {
        char what[128];
        if (SUBS[k].max_args == 0)
            snprintf(what, sizeof what, "takes no arguments, got '%s'", o.args[0]);
        else if (o.n_args < SUBS[k].min_args)
            snprintf(what, sizeof what, "wants %s%d argument%s (see the usage line)",
                     SUBS[k].min_args == SUBS[k].max_args ? "" : "at least ", SUBS[k].min_args,
                     SUBS[k].min_args == 1 ? "" : "s");
        else
            snprintf(what, sizeof what, "takes at most %d argument%s, got %d", SUBS[k].max_args,
                     SUBS[k].max_args == 1 ? "" : "s", o.n_args);
        return snap_usage_error(sub, what);
    }
    if (!strcmp(sub, "size")) {
        if (!o.model) return cli_failf(CMD, "size needs --model DIR");
        return snap_size(o.model, o.tokens_set ? o.tokens : 1024);
    }
    if (!strcmp(sub, "bench")) return snap_bench(&o);
    if (!strcmp(sub, "compact")) return snap_compact(o.db);
    sess_store *st = NULL;
    bool reads = !strcmp(sub, "ls") || !strcmp(sub, "show") || !strcmp(sub, "verify") ||
                 !strcmp(sub, "export");
    int rc = open_store(o.db, reads, &st);
    if (rc) return rc;
    kds_err err = {0};
    if (!strcmp(sub, "ls")) {
        rc = snap_ls(st);
    } else if (!strcmp(sub, "show")) {
        rc = snap_show(st, o.args[0]);
    } else if (!strcmp(sub, "fork")) {
        char name[SESS_NAME_MAX + 1];
        if (sess_fork(st, o.args[0], o.name, name, &err) != KDS_OK) {
            rc = cli_fail(CMD, &err);
        } else {
            sess_session_info s;
            if (sess_session_get(st, name, &s, &err) == KDS_OK)
                printf("forked %s -> session '%s' at @%llu (%lld tokens)\n", o.args[0], name,
                       (unsigned long long)s.head, (long long)s.tokens);
        }
    } else if (!strcmp(sub, "rm")) {
        rc = snap_rm(st, o.args[0], o.force);
    } else if (!strcmp(sub, "verify")) {
        rc = snap_verify(st, o.n_args ? o.args[0] : NULL, o.model);
    } else if (!strcmp(sub, "recover")) {
        rc = snap_recover(st, o.args[0], o.model);
    } else if (!strcmp(sub, "export")) {
        if (sess_export(st, o.args[0], o.args[1], &err) != KDS_OK)
            rc = cli_fail(CMD, &err);
        else
            printf("exported %s to %s\n", o.args[0], o.args[1]);
    } else if (!strcmp(sub, "import")) {
        char name[SESS_NAME_MAX + 1];
        uint64_t snap;
        if (sess_import(st, o.args[0], o.name, name, &snap, &err) != KDS_OK)
            rc = cli_fail(CMD, &err);
        else
            printf("imported %s as session '%s' at @%llu\n", o.args[0], name,
                   (unsigned long long)snap);
    } else if (!strcmp(sub, "gc")) {
        rc = snap_gc(st, &o);
    } else if (!strcmp(sub, "retention")) {
        rc = snap_retention(st, &o);
    }
    sess_close(st);
    return rc;
}
