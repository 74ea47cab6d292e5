/* kds_file.c - kds_open_regular (contract in kds_file.h). */
#include "kds_file.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *file_kind(mode_t m) {
    return S_ISDIR(m) ? "a directory" : S_ISFIFO(m) ? "a FIFO" : S_ISSOCK(m) ? "a socket"
         : S_ISCHR(m) || S_ISBLK(m) ? "a device" : "not a regular file";
}

kds_status kds_open_regular(const char *path, int *fd_out, size_t *size, kds_err *err) {
    *fd_out = -1;
    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a
     * writer forever */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        const int e = errno;
        if (e == ELOOP)
            return kds_err_set(err, KDS_IO, "%s: too many levels of symbolic links (a symlink "
                                            "loop?)", path);
        return kds_err_set(err, e == ENOENT ? KDS_NOT_FOUND : KDS_IO, "%s: %s", path, strerror(e));
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        kds_status rc = kds_err_set(err, KDS_IO, "%s: %s", path, strerror(errno));
        close(fd);
        return rc;
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return kds_err_set(err, KDS_IO, "%s: is %s, not a regular file", path,
                           file_kind(st.st_mode));
    }
    const int flags = fcntl(fd, F_GETFL);
    if (flags >= 0) (void)fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    *fd_out = fd;
    *size = (size_t)st.st_size;
    return KDS_OK;
}

