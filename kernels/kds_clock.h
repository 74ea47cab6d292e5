/*
 * kds_clock.h - the one clock of kdaserve's timings: seconds since an
 * arbitrary start, CLOCK_MONOTONIC, so intervals survive wall-clock steps
 * (NTP, a user's `date`). Dependency-free like kds_status.h; thread-safe.
 */
#ifndef KDS_CLOCK_H
#define KDS_CLOCK_H

#include <time.h>

static inline double kds_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif
