"""Output paths: checks before a long job (it can be written), which existing directories --force may
replace, and the refusal of a path that is not the directory asked for."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable

from transduce.errors import InputError, TransduceError
from transduce.io.files import read_json
from transduce.io.reaping import interrupted_replace_hint, tmp_prefix


def check_parent_writable(final: str, error: type[TransduceError] = TransduceError) -> str:
    """The directory atomic_directory writes `final`'s copies in (beside a link's target, as it does)
    exists or can be made, and can be written: checked before a long job (else `error`). -> that directory."""
    parent = os.path.dirname(os.path.realpath(final)) or "."
    make_writable_dir(parent, "directory", error, hint="choose an output path you can write to")
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


def require_directory(path: str, error: type[TransduceError], kind: str, name: str, file_hint: str,
                      missing_hint: str) -> None:
    """Raise `error` unless `path` is a directory: a file is "not {kind}"; a missing one is "{name} ...
    does not exist", with the way to restore an interrupted replacement of it, else `missing_hint`."""
    if os.path.isdir(path):
        return
    if os.path.exists(path):
        raise error(f"{path!r} is a file, not {kind}", hint=file_hint)
    raise error(f"{name} {path!r} does not exist", hint=interrupted_replace_hint(path) or missing_hint)


def make_writable_dir(path: str, option: str, error: type[TransduceError] = TransduceError,
                      hint: str | None = None) -> None:
    """Create directory `path` if needed; `error` naming it as `option` (an option, or what it is for) where it
    cannot be created or written to, with `hint` (default: choose another `option`)."""
    hint = hint or f"choose another {option}"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise error(f"{option} {path!r} cannot be created ({e.strerror})", hint=hint) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise error(f"{option} {path!r} is not writable", hint=hint)


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
        data = read_json(os.path.join(directory, marker))
    except ValueError:
        return os.path.isfile(os.path.join(directory, damaged_if))
    except OSError:
        return False
    return isinstance(data, dict) and data.get(key) == value


def is_empty_dir(path: str | os.PathLike) -> bool:
    """Whether directory `path` has nothing in it; an OSError where it cannot be read (or is no directory)."""
    with os.scandir(path) as entries:
        return next(entries, None) is None


def written_in_place(path: str | os.PathLike) -> bool:
    """Whether write_bytes_atomic writes `path` in place: something other than a regular file is there."""
    return os.path.lexists(path) and (os.path.islink(path) or not os.path.isfile(path))


def check_output_file(path: str, option: str = "--output", stdout: bool = True) -> None:
    """Before any work: the output file can be created (a long job is not lost at the end). stdout:
    whether '-' means standard output."""
    if path == "-" and stdout:
        if sys.stdout is None:
            raise InputError("standard output is closed", hint=f"give {option} FILE")
        return
    if path == "-":
        raise InputError(f"{option} -: the report goes to standard output already", hint=f"give {option} a file path")
    if not path:
        raise InputError(f"{option} is empty", hint="give a file path")
    if os.path.isdir(path):
        raise InputError(f"{option} {path!r} is a directory", hint="give a file path")
    if path.endswith(os.sep) or (os.altsep and path.endswith(os.altsep)):
        raise InputError(f"{option} {path!r} names a directory (it ends in {path[-1]!r})", hint="give a file path")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise InputError(f"{option} {path!r} is not writable", hint=f"choose another {option}")
    if os.path.islink(path) and not os.path.exists(path):  # a dangling link: its target is written, in place
        check_creatable(os.path.realpath(path), InputError, f"{option} {path!r} (a link to {os.path.realpath(path)!r})")
    elif not written_in_place(path):  # written beside it and renamed (/dev/null, a FIFO: in place)
        parent = check_creatable(path, InputError, f"{option} {path!r}")
        try:
            name_max = os.pathconf(parent, "PC_NAME_MAX")
        except (OSError, ValueError):
            name_max = 255
        # every name still to be created: the missing directories' and the file's
        missing = os.path.relpath(os.path.abspath(path), parent).split(os.sep)
        too_long = [name for name in missing if len(os.fsencode(name)) > name_max]
        if too_long:
            raise InputError(f"{option} {path!r}: the name {too_long[0][:40]!r}... is longer than this file system "
                             f"allows ({name_max} bytes)", hint=f"choose a shorter {option}")


def check_output(path: str, option: str, force: bool, stdout: bool = True) -> None:
    """Before any work: the output file `path` can be written (check_output_file), an existing one is
    replaced only with --force, and the directory it is written in can hold a new file. '-' (standard
    output, where `stdout`) and what is written in place (/dev/null, a FIFO) are taken as they are; an empty
    file (mktemp's) has nothing to lose."""
    check_output_file(path, option, stdout=stdout)
    if path == "-" and stdout:
        return
    if not force and os.path.isfile(path) and os.path.getsize(path) > 0:  # a link: its target
        raise InputError(f"{option} {path!r} already exists",
                         hint=f"pass --force to replace it, or choose another {option}")
    if not written_in_place(path):
        _check_new_file(path, option)


def _check_new_file(path: str, option: str) -> None:
    """The directory a regular-file output is written in (a temporary file beside it, renamed into place)
    can hold a new file: a permission check alone passes root anywhere, /proc and read-only mounts too. The
    probe is named as that temporary is (a killed run's is removed by the next write of `path`)."""
    import tempfile

    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(parent) and os.path.dirname(parent) != parent:  # made when written
        parent = os.path.dirname(parent)
    try:
        fd, probe = tempfile.mkstemp(prefix=tmp_prefix(os.path.basename(path)) + f"{os.getpid()}-", dir=parent)
    except OSError as e:
        raise InputError(f"{option} {path!r}: the directory {parent!r} cannot hold new files ({e.strerror})",
                         hint=f"choose another {option}") from None
    os.close(fd)
    os.unlink(probe)


def write_error(option: str, path: str, e: OSError) -> InputError:
    """What an OSError writing output file `path` was, named by its cause."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return InputError(f"cannot write {option} {path!r}: {e.strerror}",
                          hint=f"free disk space, or choose another {option}")
    if not written_in_place(path) and e.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS):
        parent = os.path.dirname(os.path.abspath(path))
        return InputError(f"cannot write {option} {path!r}: its directory {parent!r} cannot hold new files "
                          f"({e.strerror})", hint=f"choose another {option}")
    return InputError(f"cannot write {option} {path!r}: {e.strerror or e}", hint=f"choose another {option}")


def free_bytes(path: str) -> int:
    """Free bytes (for this user) on the file system that holds `path`, or its nearest existing ancestor."""
    import shutil

    existing = os.path.abspath(path)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    return shutil.disk_usage(existing).free


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def check_free_space(path: str, need: int, what: str, error: type[TransduceError] = TransduceError) -> None:
    """Refuse up front, naming both figures, when the file system that will hold `path` has less room than the
    `need` bytes `what` will write (an estimate): before a long job, not after it."""
    try:
        free = free_bytes(path)
    except OSError:  # cannot tell: the write itself will say
        return
    if free < need:
        raise error(f"{what} needs about {_size(need)} on the disk of {path!r}, which has {_size(free)} free",
                    hint="free some disk space, or choose an output path on another disk")
