"""Reading the files operators and the cluster manager write, without ever blocking, and
watching them for changes.

The nodes file and the cluster directory are re-read on the reactor's thread; a FIFO or a
device put where a file belongs would block that read (and with it every connection) or
never end. Only a regular file is read; anything else is an OSError like a missing one.

The nodes file, the API-key file and the cluster directory are watched one way
(:class:`FileWatch`): a few stat calls say whether anything changed since the last read, and
only then are the files read again.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import Callable, Iterable, Mapping, TypeVar

import attrs

T = TypeVar("T")

# Per watched path, its stamp (see ``stamp``).
Stamps = Mapping[str, object]

# The points ``write_atomically`` passes, in order; its ``step`` seam is called at each.
WRITE_STEPS = ("created", "written", "synced", "closed", "renamed", "dir-synced")


def no_step(name: str) -> None:
    """``write_atomically``'s seam when nothing is to happen between its steps."""


def write_atomically(path: str, data: bytes, step: Callable[[str], None] = no_step) -> None:
    """Replace ``path``'s content with ``data`` so that a crash at any point leaves the old
    file or the new one, never a torn one (docs/decisions.md#crash-safe-state).

    A temporary file in the same directory (a rename is atomic only within one file system)
    is written and fsync'ed, renamed over ``path``, and the directory fsync'ed so the rename
    itself survives a power loss. A crash leaves at most a ``.tmp`` file beside it, which no
    reader opens. Raises OSError; on an error nothing is left behind but what was renamed.
    ``step(name)`` is called at each of ``WRITE_STEPS``: a test's seam to stop the writer there.
    """
    folder = os.path.dirname(path) or "."
    temp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            step("created")
            handle.write(data)
            handle.flush()
            step("written")
            os.fsync(handle.fileno())
            step("synced")
        step("closed")
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    step("renamed")
    directory = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    step("dir-synced")


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


@attrs.define(eq=False)
class FileWatch:
    """The stamps the watched files had when last read, so a watch reads them again only when
    one changed.

    ``paths()`` names the files; it may name others after a read (the TLS files a nodes file
    names, the pins in the cluster directory). :meth:`changed` is the cheap question, asked on
    a timer or per request, and with a clock's ``now`` at most once per ``every`` seconds, so
    a burst of requests costs one round of stat calls. :meth:`read` wraps the actual reading.
    """

    paths: Callable[[], Iterable[str]]
    _seen: Stamps | None = None
    _checked_at: float = float("-inf")

    def stamps(self) -> dict[str, object]:
        """The watched files' stamps now."""
        return {path: stamp(path) for path in self.paths()}

    def changed(self, now: float | None = None, every: float = 0.0) -> Stamps | None:
        """The stamps now if they differ from those last read, else None (also when asked again
        within ``every`` seconds of ``now``)."""
        if now is not None:
            if now - self._checked_at < every:
                return None
            self._checked_at = now
        current = self.stamps()
        return None if current == self._seen else current

    def read(self, before: Stamps | None, read: Callable[[], T]) -> T:
        """``read()``, the files then remembered as they were ``before`` it (the stamps
        :meth:`changed` gave, or taken now), so an edit saved while they are read is seen by
        the next check. A file the read names for the first time is stamped after it (its
        first reading happened inside). Remembered even when ``read`` raises: a failed read is
        not retried until something changes."""
        before = self.stamps() if before is None else before
        try:
            return read()
        finally:
            self._seen = {
                path: before[path] if path in before else stamp(path) for path in self.paths()
            }
