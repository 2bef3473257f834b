"""Reading the files operators and the cluster manager write, without ever blocking.

The nodes file and the cluster directory are re-read on the reactor's thread; a FIFO or a
device put where a file belongs would block that read (and with it every connection) or
never end. Only a regular file is read; anything else is an OSError like a missing one.
"""

from __future__ import annotations

import errno
import os
import stat


def stamp(path: str) -> tuple | None:
    """What says a file changed, so a watch re-reads it only then: None when it is missing,
    the error when it cannot be stat'ed, else its mtime, size, inode and (for files whose
    permissions are checked, like the API-key file) mode, owner and ctime."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return ("unreadable", exc.errno)
    return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode, st.st_uid, st.st_ctime_ns)


def read_regular_file(path: str) -> bytes:
    """The whole content of the regular file at ``path`` (symlinks followed).

    Raises OSError for anything else: missing, a directory, a symlink loop, a FIFO, a device.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
