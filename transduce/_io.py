"""Atomic writes: an artifact is written under a temporary name and renamed into place when complete,
so a crash never leaves a half-written checkpoint, artifact or engine that looks valid."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from transduce.errors import TransduceError


def check_parent_writable(final: str) -> str:
    """The directory atomic_directory writes `final`'s copies in (beside a link's target, as it does)
    exists or can be made, and can be written: checked before a long job. -> that directory."""
    parent = os.path.dirname(os.path.realpath(final)) or "."
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise TransduceError(f"cannot create directory {parent!r}: {e.strerror}",
                             hint="choose an output path you can write to") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise TransduceError(f"directory {parent!r} is not writable",
                             hint="choose an output path you can write to")
    return parent


def check_creatable(path: str, error: type[TransduceError] = TransduceError, what: str = "") -> str:
    """That `path` could be created, without creating anything (a check before a long job): its nearest
    existing ancestor is a writable directory. -> that ancestor."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise error(f"{what or path!r} cannot be created: {parent!r} is "
                    + ("not a directory" if not os.path.isdir(parent) else "not writable"),
                    hint="choose a path you can write to")
    return parent


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


# At most this many characters of a name go into its temporary copies' names: a legal 240-character
# name plus ".tmp-HOST-PID-XXXXXXXX" went over the file system's 255 (ENAMETOOLONG after a whole decode).
TMP_NAME_CHARS = 100


def _short(base: str) -> str:
    """`base` as it goes into its copies' names: a longer one cut, with a hash of the whole name, so that
    two names alike in their first characters never take (or remove) each other's copies."""
    if len(base) <= TMP_NAME_CHARS:
        return base
    import hashlib

    return base[: TMP_NAME_CHARS - 9] + "~" + hashlib.sha256(os.fsencode(base)).hexdigest()[:8]


def _tmp_prefix(base: str, what: str = "tmp") -> str:
    """Temporary copies of `base` (directories and files) are .BASE.tmp-HOST-PID-XXXX (BASE cut to
    TMP_NAME_CHARS, see _short): whose they are, for _remove_abandoned; previous copies moved aside by
    atomic_directory are .BASE.old-HOST-PID-XXXX (what="old")."""
    host = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:60]
    return f".{_short(base)}.{what}-{host}-"


ABANDONED_AFTER_S = 3600  # a writer's temporary copy unchanged this long (and its PID gone) is abandoned


def _remove_abandoned(parent: str, base: str, what: str = "tmp") -> None:
    """Delete the temporary copies of `base` (directories or files) that a killed process of this host
    left (its PID is not running, and nothing in it changed for ABANDONED_AFTER_S): a killed export or
    checkpoint left a hidden copy of its size (GBs at the big preset) behind at every try. Other hosts'
    (a shared disk) and running processes' are left alone; the age also spares a live writer in another
    PID namespace that shares this hostname (containers).

    what="old": the previous copies that such a process moved aside (.BASE.old-*, see atomic_directory),
    for a caller that has just put a newer complete `base` in place; their age is the time since they
    were moved (a rename sets the change time; their files keep the times they were written at)."""
    import time

    pattern = re.compile(re.escape(_tmp_prefix(base, what)) + r"(\d{1,10})-")
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        m = pattern.match(name)
        if not m or int(m.group(1)) == os.getpid() or _running(int(m.group(1))):
            continue
        path = os.path.join(parent, name)
        is_dir = os.path.isdir(path) and not os.path.islink(path)
        try:
            if what == "old":
                newest = os.lstat(path).st_ctime
            elif is_dir:
                newest = max(os.stat(os.path.join(root, n)).st_mtime for root, _, files in os.walk(path)
                             for n in [".", *files])
            else:
                newest = os.lstat(path).st_mtime
        except (OSError, ValueError):
            continue
        if time.time() - newest > ABANDONED_AFTER_S:
            _remove(path)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process (or no such PID at all)
        return False
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


def interrupted_replace_hint(final: str | os.PathLike) -> str | None:
    """For a missing `final`: what an atomic_directory killed between its two renames left beside it
    (the previous complete copy, moved aside as .NAME.old-*), as the command that restores it."""
    final = os.path.realpath(os.fspath(final))  # where atomic_directory wrote: a link's target
    parent, base = os.path.dirname(final), os.path.basename(final)
    try:
        old = [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(f".{_short(base)}.old-")]
        old.sort(key=lambda p: os.stat(p).st_ctime)  # the last one moved aside (a rename sets ctime)
    except OSError:
        return None
    if not old:
        return None
    return (f"a replacement of it was interrupted; the previous copy is {old[-1]!r}: "
            f"restore it with: mv {old[-1]} {final}")


def require_directory(path: str, error: type[TransduceError], kind: str, name: str, file_hint: str,
                      missing_hint: str) -> None:
    """Raise `error` unless `path` is a directory: a file is "not {kind}"; a missing one is "{name} ...
    does not exist", with the way to restore an interrupted replacement of it, else `missing_hint`."""
    if os.path.isdir(path):
        return
    if os.path.exists(path):
        raise error(f"{path!r} is a file, not {kind}", hint=file_hint)
    raise error(f"{name} {path!r} does not exist", hint=interrupted_replace_hint(path) or missing_hint)


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike, overwrite: bool = True) -> Iterator[str]:
    """Yield a fresh temporary directory beside `final`; on success it replaces `final`.

    On an exception the temporary directory is removed and `final` is left as it was. The previous
    `final` is moved aside (.NAME.old-HOST-PID-*) between the two renames and removed after them; once
    this run's copy is in place, the previous copies that killed writers moved aside are removed too
    (_remove_abandoned). A symlink at
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
    _remove_abandoned(parent, os.path.basename(final))
    tmp = tempfile.mkdtemp(prefix=_tmp_prefix(os.path.basename(final)) + f"{os.getpid()}-", dir=parent)
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
                old = tempfile.mkdtemp(prefix=_tmp_prefix(os.path.basename(final), "old") + f"{os.getpid()}-",
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
        _remove(old)
    # a newer complete copy is in place: the previous ones a killed writer moved aside are not needed to
    # restore it any more, whether this run replaced one or wrote where it had been lost
    _remove_abandoned(parent, os.path.basename(final), "old")


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


def _remove(path: str) -> None:
    """Remove a file or a directory tree, as far as possible (what is left is only disk space)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


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


def written_in_place(path: str | os.PathLike) -> bool:
    """Whether write_bytes_atomic writes `path` in place: something other than a regular file is there."""
    return os.path.lexists(path) and (os.path.islink(path) or not os.path.isfile(path))


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


def make_writable_dir(path: str, option: str, error: type[TransduceError] = TransduceError) -> None:
    """Create directory `path` (an option's value) if needed; `error` naming `option` where it cannot be
    created or written to."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise error(f"{option} {path!r} cannot be created ({e.strerror})", hint=f"choose another {option}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise error(f"{option} {path!r} is not writable", hint=f"choose another {option}")


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
            _remove_abandoned(parent, base)
            fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(base) + f"{os.getpid()}-", dir=parent)
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


def check_replaceable(out_dir: str, force: bool, is_kind: Callable[[str], bool], kind: str, kinds: str,
                      error=TransduceError, option: str = "output directory",
                      force_hint: str = "pass --force to replace it") -> bool:
    """Refuse an existing `out_dir` unless force, and never replace a directory that is not `kind`.
    -> whether the output replaces an existing directory (its writer's `overwrite`: False for a new or an
    empty one, so that whatever is written into it meanwhile is refused, not deleted).

    `is_kind(out_dir)` says whether transduce wrote it as a `kind` (see marked_as), so that --force
    replaces only that. An empty directory (mkdir -p) has nothing to lose and needs no --force; a mount
    point cannot be replaced at all.
    """
    if not os.path.lexists(out_dir):
        return False
    # what could never be replaced is said first: "pass --force" would only lead to this refusal
    if not os.path.isdir(out_dir):
        raise error(f"{out_dir!r} exists and is not a directory", hint=f"choose another {option}")
    if os.path.ismount(os.path.realpath(out_dir)):
        raise error(f"{out_dir!r} is a mount point: the output is written beside it and renamed into place, "
                    "which a mount point cannot take", hint=f"give a new directory inside it as the {option}")
    try:
        if is_empty_dir(out_dir):
            return False
    except OSError as e:
        raise error(f"cannot read {out_dir!r}: {e.strerror}", hint=f"choose another {option}") from None
    if not is_kind(out_dir):
        raise error(f"{out_dir!r} holds files but is not {kind}; --force replaces only {kinds} (ones transduce "
                    "wrote)",
                    hint=f"choose another {option}")
    if not force:
        raise error(f"{out_dir!r} already exists and is {kind}", hint=force_hint)
    return True


def marked_as(directory: str, marker: str, key: str, value: str, damaged_if: str) -> bool:
    """Whether transduce wrote `directory` (for check_replaceable's is_kind): its JSON file `marker` has
    `key` == `value`, or `marker` is there but not JSON and the file `damaged_if` (one that only such a
    directory has) is beside it: a damaged one of ours, which --force may replace."""
    try:
        with open(os.path.join(directory, marker), encoding="utf-8") as f:
            data = json.load(f)
    except ValueError:
        return os.path.isfile(os.path.join(directory, damaged_if))
    except OSError:
        return False
    return isinstance(data, dict) and data.get(key) == value


def is_empty_dir(path: str | os.PathLike) -> bool:
    """Whether directory `path` has nothing in it; an OSError where it cannot be read (or is no directory)."""
    with os.scandir(path) as entries:
        return next(entries, None) is None


def read_lines(path: str | os.PathLike, error: type[TransduceError], what: str = "input file") -> list[str]:
    """All of iter_lines(path, error, what)."""
    return list(iter_lines(path, error, what))


def iter_lines(path: str | os.PathLike, error: type[TransduceError], what: str = "input file") -> Iterator[str]:
    """A UTF-8 text file ("-": stdin) line by line, each as soon as it has been read (a pipe's lines as
    they arrive): split at "\n" only (a "\r" before it is dropped; Unicode's other line breaks, such as
    U+2028 or form feed, stay inside their line, as `wc -l` counts), a leading byte-order mark dropped,
    no empty last line for the final newline. Unreadable input is `error` naming the file (and the line
    of an invalid byte), raised when that line is reached."""
    import sys

    stdin = os.fspath(path) == "-"
    name = "standard input" if stdin else repr(os.fspath(path))

    def unreadable(e: OSError) -> TransduceError:
        if isinstance(e, FileNotFoundError):
            return error(f"{what} {name} does not exist")
        if isinstance(e, IsADirectoryError):
            return error(f"{what} {name} is a directory", hint="give a text file, one sentence per line")
        return error(f"cannot read {what} {name}: {e.strerror}")

    if stdin and sys.stdin is None:  # fd 0 closed (a daemon's, `<&-`)
        raise error(f"standard input (the {what} '-') is closed", hint=f"give the {what}'s path")
    try:
        f = sys.stdin.buffer if stdin else open(path, "rb")  # noqa: SIM115 (closed below)
    except OSError as e:
        raise unreadable(e) from None
    try:
        n = 0
        while True:
            try:
                raw = f.readline()
            except OSError as e:
                raise unreadable(e) from None
            if not raw:
                return
            n += 1
            if n == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
                if not raw:  # a byte-order mark alone: no lines
                    return
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{what} {name} is not UTF-8 text: line {n} has an invalid byte ({e.reason})",
                            hint="convert it, e.g. iconv -f LATIN1 -t UTF-8") from None
            if line.endswith("\n"):
                line = line[:-1]
            yield line[:-1] if line.endswith("\r") else line
    finally:
        if not stdin:
            f.close()
