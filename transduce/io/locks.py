"""One writer per output: an exclusive advisory lock (fcntl.flock) on a lock file beside the output, taken when
a command starts writing it and released by the OS when the process ends, however it ends (kill -9 leaves no
stale lock). A second writer of the same output is refused at once, naming the process that holds it.

The lock file is .NAME.lock beside the output NAME (a directory is replaced by a rename, so the lock cannot live
inside it). The writer removes it when it ends, still holding it (a killed one leaves it, unlocked: the next writer
takes it over); a writer that locked a file removed meanwhile tries again on the new one, so two writers never hold
two different files. Holding the lock proves that no other writer of NAME is alive, so the temporary copies a killed
writer left beside it (.NAME.tmp-*) are removed then.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from transduce.errors import TransduceError
from transduce.io.paths import check_parent_writable
from transduce.io.reaping import remove_abandoned, short_base


def lock_path(final: str | os.PathLike) -> str:
    """The lock file of output `final`: .NAME.lock beside it (beside a link's target, where writes go)."""
    final = os.path.realpath(os.fspath(final))
    return os.path.join(os.path.dirname(final), f".{short_base(os.path.basename(final))}.lock")


def _holder(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        pid = ""
    return f"PID {pid}" if pid.isdigit() else "another process"


def _locked(fd: int, path: str) -> bool:
    """Whether the file `fd` locked is still the one at `path` (a writer that ended removed it, and another may
    have made a new one there since: this lock would exclude no one)."""
    try:
        mine, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


@contextlib.contextmanager
def output_lock(final: str | os.PathLike, what: str = "the output", error: type[TransduceError] = TransduceError,
                ) -> Iterator[str]:
    """Hold the lock of output `final` (a directory or file written atomically) meanwhile; `error` at once if
    another process holds it. Yields the lock file's path. Where the OS has no flock, no lock is taken."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        yield ""
        return
    final = os.fspath(final)
    check_parent_writable(final, error)
    path = lock_path(final)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise error(f"cannot open the lock file {path!r} of {what} {final!r}: {e.strerror}",
                        hint="choose an output path you can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise error(f"{what} {final!r} is being written by {holder} (it holds {path})",
                        hint="wait for that command to end, or stop it; two writers of one output would overwrite "
                             "each other's work") from None
        except OSError:  # a file system without locks (some network ones): go on unlocked, as before locks
            os.close(fd)
            fd = -1
            break
        if _locked(fd, path):
            break
        os.close(fd)  # removed by the writer that held it until now: lock the one there now
    if fd < 0:
        yield path
        return
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        parent, base = os.path.split(os.path.realpath(final))
        remove_abandoned(parent, base, locked=True)  # this host's copies: their writers are gone
        if os.path.lexists(final):  # a complete copy is in place: the previous ones moved aside are not needed
            remove_abandoned(parent, base, "old", locked=True)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # while still held: one that opened it meanwhile sees it gone once it locks it
        os.close(fd)  # releases the lock
