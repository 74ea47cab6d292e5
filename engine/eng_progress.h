/*
 * eng_progress.h - one progress line for long work: reading a model into
 * memory, fingerprinting it, writing a generated model, a GGUF or a
 * quantised copy.
 *
 *   reading /m/model.safetensors into memory:  42% (1.80 / 4.30 GB, 3s, about 4s left)
 *   reading /m/model.safetensors into memory: 100% (4.30 GB in 7.2s)
 *
 * Where the stream is a terminal the line is redrawn in place ('\r') at
 * most twice a second. Anywhere else (a log file, a pipe, journald under
 * `kdaserve serve`) a plain line is written at most every
 * ENG_PROGRESS_LOG_S seconds, so a log holds a few whole lines and no
 * carriage returns. Either way eng_progress_finish writes the final 100%
 * line, and eng_progress_abandon (the work failed) ends a line left open
 * on a terminal so that the error prints on a line of its own.
 *
 * Ownership: the eng_progress lives with the caller (a stack value is
 * fine); it holds the stream, not owning it. Threading: one thread calls
 * these functions, the one that owns the work; work spread over threads
 * sums its count there (eng_progress_set). Nothing allocates.
 */
#ifndef ENG_PROGRESS_H
#define ENG_PROGRESS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

/* Seconds between lines where the stream is not a terminal. */
#define ENG_PROGRESS_LOG_S 10.0
/* Seconds between redraws on a terminal. */
#define ENG_PROGRESS_TTY_S 0.5
/* Reading or hashing fewer bytes than this takes well under a second:
 * the loader starts no line for them. */
#define ENG_PROGRESS_MIN_BYTES ((uint64_t)256 << 20)

typedef struct eng_progress {
    FILE *f;          /* NULL: off (every call does nothing) */
    bool tty;         /* f is a terminal: redraw in place */
    bool open;        /* a terminal line was drawn and not yet ended */
    char label[480];  /* "reading PATH into memory" */
    uint64_t total, done; /* bytes (shown as GB) */
    double t0, last;  /* CLOCK_MONOTONIC seconds: the start, the last line */
    double every;     /* seconds between lines: ENG_PROGRESS_TTY_S or _LOG_S (a test may
                       * shorten it after eng_progress_start) */
} eng_progress;

/* Starts the work's line on f (NULL: off, as is a total of 0), the label
 * printf-formatted (cut to fit). Writes nothing yet: a short job shows
 * only its final line. */
void eng_progress_start(eng_progress *p, FILE *f, uint64_t total, const char *label_fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* done bytes of total so far (clamped to total); writes a line when its
 * interval has passed. */
void eng_progress_set(eng_progress *p, uint64_t done);
/* eng_progress_set(p, done + n). */
void eng_progress_add(eng_progress *p, uint64_t n);
/* The work is done: the final line, "LABEL: 100% (T GB in Ss)". */
void eng_progress_finish(eng_progress *p);
/* The work failed: ends a terminal line left open; writes nothing else. */
void eng_progress_abandon(eng_progress *p);

#endif
