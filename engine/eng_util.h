/*
 * eng_util.h - small file helpers shared by the engine's sources (internal).
 */
#ifndef ENG_UTIL_H
#define ENG_UTIL_H

#include <stddef.h>

#include "kds_status.h"

/* "a/b" (caller owns: free()), or NULL when out of memory. */
char *eng__path_join(const char *a, const char *b);

/* What is at `path`: nothing (ENOENT, ENOTDIR), something, or a path that
 * cannot be resolved (a symlink loop, no permission: errno kept, and the
 * caller reports it rather than treating the file as absent). */
typedef enum eng_path_state {
    ENG_PATH_ABSENT = 0,
    ENG_PATH_PRESENT = 1,
    ENG_PATH_ERROR = 2,
} eng_path_state;
eng_path_state eng__path_state(const char *path);

/* Read a whole regular file of at most `cap` bytes. On success *buf is
 * NUL-terminated (caller owns: free()) and *len its length. Errors:
 * KDS_NOT_FOUND, KDS_IO (also "not a regular file"), KDS_TOO_LARGE,
 * KDS_NOMEM; each message names the path. */
kds_status eng__read_file(const char *path, size_t cap, char **buf, size_t *len, kds_err *err);

#endif
