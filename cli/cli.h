/*
 * cli.h - the kdaserve program's subcommands. Each takes argc/argv with
 * argv[0] = the subcommand's name and returns a process exit status
 * (0 ok, 1 failure, 2 usage error). Errors go to stderr as one line:
 * "kdaserve <cmd>: <reason>".
 */
#ifndef CLI_H
#define CLI_H

#include <stdbool.h>
#include <stdint.h>

#include "eng.h"
#include "sess.h"

int cmd_gen_model(int argc, char **argv);
int cmd_quantize(int argc, char **argv);
int cmd_export_gguf(int argc, char **argv);
int cmd_info(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_logits(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_snap(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_chat(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_plan(int argc, char **argv);

/* Shared helpers (cli_common.c). */

/* The job's ranks (docs/expert-parallel.md): main sets them once, before
 * the command runs, when kdaserve was started by mpirun (NULL otherwise:
 * one process, as always). Rank 0 runs the command; a command that opens
 * a model (cli_open_with) loads rank 0's share of the experts and makes a
 * context that drives the other ranks. placement: KDASERVE_EP_PLACEMENT. */
void cli_set_comm(eng_comm *comm, eng_ep_placement placement);
eng_comm *cli_comm(void);
/* eng_model_params for this process's rank (all experts without ranks)
 * and a context on `device` (NULL or "cpu": the host; else a GPU, which
 * holds its own copy of the weights, so the host's stay mapped). */
void cli_model_params(eng_model_params *mp, const char *device);
eng_ep_placement cli_placement(void);

/* Print "kdaserve <cmd>: <msg>" to stderr; returns 1. */
int cli_fail(const char *cmd, const kds_err *err);
int cli_failf(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A usage error: "kdaserve CMD: MESSAGE" (none when fmt is NULL: getopt has
 * already named the option) and where the options are described, not the
 * whole help; returns 2, the exit status of a usage error. */
int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Resolve the model directory: the --model value, else $KDASERVE_MODEL, else
 * ./models/default. Returns NULL (with a message) when none exists. */
const char *cli_model_dir(const char *cmd, const char *given);

/* "<directory of the kdaserve binary>/../REL" into out when it exists (the
 * source tree of a binary built in ./build). */
bool cli_beside_binary(const char *rel, char *out, size_t cap);

/* Strict number parsing: the whole string must be a number in range. */
bool cli_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out);
bool cli_parse_f32(const char *s, float lo, float hi, float *out);

/* Load model + context with the common options; prints what went wrong. */
int cli_open(const char *cmd, const char *model_dir, int threads, int max_batch, eng_model **m,
             eng_ctx **c);
/* cli_open on a device: NULL or "cpu", or "cuda" (eng_ctx_params.device). */
int cli_open_on(const char *cmd, const char *model_dir, int threads, int max_batch,
                const char *device, eng_model **m, eng_ctx **c);
/* Benchmark figures: sort ascending in place; the median (sorts too; the
 * mean of the two middle values for an even count). */
void cli_sort_doubles(double *v, size_t n);
double cli_median(double *v, int n);
/* Median seconds of `reps` copies of `bytes` from pinned host memory to
 * the GPU (the reference a restore onto the device is read against).
 * KDS_UNSUPPORTED without CUDA. */
kds_status cli_copy_to_device_s(size_t bytes, int reps, double *median_s, kds_err *err);
/* cli_open with every context parameter given. */
int cli_open_with(const char *cmd, const char *model_dir, const eng_ctx_params *cp, eng_model **m,
                  eng_ctx **c);
/* true for "cpu" and "cuda", the values --device takes */
bool cli_device_valid(const char *device);

/* Says on stderr, once at start, when sessions of `st` were made by another
 * model than `m` (they cannot be opened with it): how many, one example with
 * the model directory the store recorded, and what to do. Nothing when all
 * match; a store that cannot be listed is left to the command's own error. */
void cli_note_other_models(const char *cmd, sess_store *st, const eng_model *m);
/* --bf16 on the CPU of a build without AVX-512 BF16 dot products: says on
 * stderr that the products stay exact (eng_cpu_bf16_products). */
void cli_note_bf16(const char *cmd, const eng_ctx_params *cp);

#endif
