/*
 * kds_file.h - opening a file that must be a regular file: a model's
 * config.json, safetensors and tokenizer files, the auth file.
 *
 * kds_open_regular opens `path` read-only without ever blocking on a FIFO or
 * a device: it opens non-blocking, checks with fstat that the file (after
 * symlinks) is a regular file, then makes the descriptor blocking. On
 * success *fd (the caller's: close() it) and *size. Errors: KDS_NOT_FOUND,
 * KDS_IO naming the path and what is there instead (a FIFO, a directory, a
 * device, a socket), a symlink loop, or the system's reason (permission).
 *
 * Dependency-free apart from kds_status.h, so every module can use it.
 * Thread-safety: none needed (no state).
 */
#ifndef KDS_FILE_H
#define KDS_FILE_H

#include <stddef.h>

#include "kds_status.h"

kds_status kds_open_regular(const char *path, int *fd, size_t *size, kds_err *err);

#endif /* KDS_FILE_H */
