/* eng_progress.c - one progress line: redrawn on a terminal, whole lines
 * at long intervals in a log (eng_progress.h). */
#include "eng_progress.h"
#include "kds_clock.h"

#include <stdarg.h>
#include <time.h>
#include <unistd.h>

void eng_progress_start(eng_progress *p, FILE *f, uint64_t total, const char *label_fmt, ...) {
    *p = (eng_progress){.f = total > 0 ? f : NULL, .total = total};
    if (!p->f) return;
    p->tty = isatty(fileno(f)) == 1;
    p->every = p->tty ? ENG_PROGRESS_TTY_S : ENG_PROGRESS_LOG_S;
    va_list ap;
    va_start(ap, label_fmt);
    vsnprintf(p->label, sizeof p->label, label_fmt, ap);
    va_end(ap);
    p->t0 = p->last = kds_now_s();
}

/* "LABEL:  42% (1.80 / 4.30 GB, 3s, about 4s left)"; the time left from
 * the rate so far, once a second has passed. */
static void draw(eng_progress *p, double now) {
    const double frac = (double)p->done / (double)p->total, elapsed = now - p->t0;
    char left[48] = "";
    if (elapsed >= 1.0 && p->done > 0)
        snprintf(left, sizeof left, ", about %.0fs left", elapsed * (1.0 - frac) / frac);
    /* the spaces wipe what a longer line before left on a terminal */
    fprintf(p->f, "%s%s: %3d%% (%.2f / %.2f GB, %.0fs%s)%s", p->tty ? "\r" : "", p->label,
            (int)(100.0 * frac), (double)p->done / 1e9, (double)p->total / 1e9, elapsed, left,
            p->tty ? "    " : "\n");
    fflush(p->f);
    p->open = p->tty;
    p->last = now;
}

void eng_progress_set(eng_progress *p, uint64_t done) {
    if (!p->f) return;
    p->done = done < p->total ? done : p->total;
    const double now = kds_now_s();
    if (now - p->last >= p->every) draw(p, now);
}

void eng_progress_add(eng_progress *p, uint64_t n) { eng_progress_set(p, p->done + n); }

void eng_progress_finish(eng_progress *p) {
    if (!p->f) return;
    fprintf(p->f, "%s%s: 100%% (%.2f GB in %.1fs)%s\n", p->tty ? "\r" : "", p->label,
            (double)p->total / 1e9, kds_now_s() - p->t0, p->tty ? "                    " : "");
    fflush(p->f);
    p->f = NULL;
}

void eng_progress_abandon(eng_progress *p) {
    if (!p->f) return;
    if (p->open) fputc('\n', p->f);
    fflush(p->f);
    p->f = NULL;
}
