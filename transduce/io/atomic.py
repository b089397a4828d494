"""Atomic writes: a file or directory is written under a temporary name and renamed into place when
complete, so a crash never leaves a half-written checkpoint, artifact or engine that looks valid."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from transduce.errors import TransduceError
from transduce.io.paths import check_parent_writable, is_empty_dir, written_in_place
from transduce.io.reaping import remove, remove_abandoned, tmp_prefix


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it (os.umask can only set it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _umask_modes(top: str) -> None:
    """The modes a plain mkdir / open would have given (mkdtemp makes 0700, mkstemp and safetensors 0600):
    another account (a server's) can read what was written, as far as the umask allows. Files with other
    links (an engine directory hard-links its artifact's files) keep theirs: they are not only ours."""
    mask = _umask()
    for root, _, files in os.walk(top):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            st = os.lstat(path)
            if st.st_nlink == 1 and not stat.S_ISLNK(st.st_mode):
                os.chmod(path, 0o666 & ~mask)


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike, overwrite: bool = True) -> Iterator[str]:
    """Yield a fresh temporary directory beside `final`; on success it replaces `final`.

    On an exception the temporary directory is removed and `final` is left as it was. The previous
    `final` is moved aside (.NAME.old-HOST-PID-*) between the two renames and removed after them; once
    this run's copy is in place, the previous copies that killed writers moved aside are removed too
    (remove_abandoned). A symlink at
    `final` stays: the directory it points to is the one replaced. Without `overwrite` an existing
    `final` is refused, unless it is an empty directory, which is then replaced only if it is still
    empty at the end (one rename; whatever was written into it meanwhile stays, and this run's output
    is discarded with an error).
    """
    final = os.path.realpath(os.fspath(final))
    parent = check_parent_writable(final)
    if os.path.lexists(final) and not overwrite and not _is_empty(final):
        raise TransduceError(f"{final!r} is not empty (any more): it was left as it is",
                             hint="choose a new or empty output directory that nothing else writes to")
    remove_abandoned(parent, os.path.basename(final))
    tmp = tempfile.mkdtemp(prefix=tmp_prefix(os.path.basename(final)) + f"{os.getpid()}-", dir=parent)
    old = None
    try:
        yield tmp
        _umask_modes(tmp)
        _fsync_tree(tmp)
        renamed = False
        if _is_empty(final):
            try:  # replaces an empty directory in one step, and refuses one that something wrote into meanwhile
                os.rename(tmp, final)
                renamed = True
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        if not renamed:
            if os.path.lexists(final):
                if not overwrite:  # it was empty (or absent) when this began
                    raise TransduceError(f"{final!r} was created or written to while this ran: it was left as it is "
                                         "and this run's output discarded",
                                         hint="choose an output directory nothing else writes to")
                old = tempfile.mkdtemp(prefix=tmp_prefix(os.path.basename(final), "old") + f"{os.getpid()}-",
                                       dir=parent)
                os.rmdir(old)
                os.replace(final, old)
            os.replace(tmp, final)
    except BaseException as e:
        if old is not None and not os.path.lexists(final):  # the previous one back in place
            with contextlib.suppress(OSError):
                os.replace(old, final)
                old = None
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and isinstance(e, Exception) and not os.path.lexists(final):
            raise TransduceError(f"replacing {final!r} failed ({e}), and its previous copy could not be put back",
                                 hint=f"restore it with: mv {old} {final}") from e
        raise
    _fsync_dir(parent)  # the renames on disk before the previous copy goes
    if old is not None:
        remove(old)
    # a newer complete copy is in place: the previous ones a killed writer moved aside are not needed to
    # restore it any more, whether this run replaced one or wrote where it had been lost
    remove_abandoned(parent, os.path.basename(final), "old")


def _fsync_tree(top: str) -> None:
    """Every file and directory under `top` on disk (fsync), so that after the rename that publishes it a
    power loss or an OS crash cannot leave a complete-looking copy with missing data."""
    for root, _, files in os.walk(top):
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                _fsync_path(path)
        _fsync_dir(root)


def _fsync_dir(path: str) -> None:
    """A directory's entries on disk (a rename in it, a file created in it), where the file system can."""
    _fsync_path(path)


# what says "this cannot be synced here" (a file system or platform without it, a file we may not open),
# as opposed to an I/O error, which is raised
_CANNOT_SYNC = {errno.EINVAL, errno.EBADF, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTSUP,
                getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)}


def _fsync_path(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        if e.errno in _CANNOT_SYNC:
            return
        raise
    try:
        _fsync_fd(fd)
    finally:
        os.close(fd)


def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _CANNOT_SYNC:
            raise


def _is_empty(path: str) -> bool:
    """Whether `path` is an empty directory (False for anything else, or where it cannot be read)."""
    try:
        return os.path.isdir(path) and is_empty_dir(path)
    except OSError:
        return False


@contextlib.contextmanager
def atomic_output(final: str | os.PathLike, overwrite: bool, error: type[TransduceError], what: str,
                  hint: str) -> Iterator[str]:
    """atomic_directory for a command's output: an OSError on the way (disk full, permissions) becomes
    `error` ("cannot write <what> <final>: ...", with `hint`); transduce's own errors pass through."""
    try:
        with atomic_directory(final, overwrite=overwrite) as tmp:
            yield tmp
    except TransduceError:
        raise
    except OSError as e:
        raise error(f"cannot write {what} {os.fspath(final)!r}: {e}", hint=hint) from None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """write_bytes_atomic for UTF-8 text."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_png_atomic(fig, path: str | os.PathLike, dpi: int, **savefig) -> None:
    """A matplotlib figure as a PNG at `path`, whole or not at all: rendered in memory, then written with
    write_bytes_atomic; the figure is closed either way."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=dpi, **savefig)
    finally:
        plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())


def write_bytes_atomic(path: str | os.PathLike, data) -> None:
    """Write a file whole or not at all (see atomic_file). `data`: bytes or any buffer (a TensorRT
    IHostMemory)."""
    with atomic_file(path) as f:
        f.write(data)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, error: Callable[[OSError], Exception] | None = None) -> Iterator[Any]:
    """A binary file object writing `path` under a temporary name beside it (.NAME.tmp-HOST-PID-*,
    removed by a later write of NAME if this process is killed), renamed into place when the block ends
    without an exception: a regular file is whole or unchanged; an existing one keeps its mode, a new
    one gets the umask's. Anything else at `path` (/dev/null, a FIFO, a symlink) is written in place, as
    a plain open would. No temporary is left behind, whatever fails.

    error: what an OSError of this function's own becomes (a parent directory that cannot be created
    or written, a flush or close that fails, the rename); the block's exceptions, its writes' included,
    pass through as they are. Without it, those OSErrors are raised as they are."""
    path = os.fspath(path)

    def own(e: OSError) -> BaseException:
        return error(e) if error is not None else e

    tmp = None
    try:
        if written_in_place(path):
            f = open(path, "wb")
        else:
            mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else 0o666 & ~_umask()
            parent = os.path.dirname(os.path.abspath(path))
            os.makedirs(parent, exist_ok=True)
            base = os.path.basename(path)
            remove_abandoned(parent, base)
            fd, tmp = tempfile.mkstemp(prefix=tmp_prefix(base) + f"{os.getpid()}-", dir=parent)
            try:
                f = os.fdopen(fd, "wb")
            except BaseException:
                os.close(fd)
                raise
    except BaseException as e:
        _unlink_quietly(tmp)
        if isinstance(e, OSError):
            raise own(e) from None
        raise
    try:
        yield f
    except BaseException:
        with contextlib.suppress(OSError):
            f.close()
        _unlink_quietly(tmp)
        raise
    try:
        if tmp is not None:
            f.flush()  # a full disk shows here
            _fsync_fd(f.fileno())  # on disk before the rename publishes it
        f.close()  # flushes what is written in place
        if tmp is not None:
            os.chmod(tmp, mode)  # mkstemp creates 0600
            os.replace(tmp, path)
            _fsync_dir(os.path.dirname(tmp))
    except BaseException as e:  # a Ctrl-C too: no temporary is left
        _unlink_quietly(tmp)
        if isinstance(e, OSError):
            raise own(e) from None
        raise


def _unlink_quietly(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
