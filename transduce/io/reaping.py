"""Temporary copies: the names atomic writes give them, and the removal of the ones killed writers left.

A copy is .BASE.tmp-HOST-PID-XXXX while it is written, and a replaced directory is moved aside as
.BASE.old-HOST-PID-XXXX between the two renames that replace it: the host and PID say whose it is.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import time

# At most this many characters of a name go into its temporary copies' names: a legal 240-character
# name plus ".tmp-HOST-PID-XXXXXXXX" went over the file system's 255 (ENAMETOOLONG after a whole decode).
TMP_NAME_CHARS = 100


def short_base(base: str) -> str:
    """`base` as it goes into its copies' names: a longer one cut, with a hash of the whole name, so that
    two names alike in their first characters never take (or remove) each other's copies."""
    if len(base) <= TMP_NAME_CHARS:
        return base
    import hashlib

    return base[: TMP_NAME_CHARS - 9] + "~" + hashlib.sha256(os.fsencode(base)).hexdigest()[:8]


def tmp_prefix(base: str, what: str = "tmp") -> str:
    """Temporary copies of `base` (directories and files) are .BASE.tmp-HOST-PID-XXXX (BASE cut to
    TMP_NAME_CHARS, see short_base): whose they are, for remove_abandoned; previous copies moved aside by
    atomic_directory are .BASE.old-HOST-PID-XXXX (what="old")."""
    host = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:60]
    return f".{short_base(base)}.{what}-{host}-"


ABANDONED_AFTER_S = 3600  # a writer's temporary copy unchanged this long (and its PID gone) is abandoned


def remove_abandoned(parent: str, base: str, what: str = "tmp", locked: bool = False) -> None:
    """Delete the temporary copies of `base` (directories or files) that a killed process of this host
    left (its PID is not running, and nothing in it changed for ABANDONED_AFTER_S): a killed export or
    checkpoint left a hidden copy of its size (GBs at the big preset) behind at every try. Other hosts'
    (a shared disk) and running processes' are left alone; the age also spares a live writer in another
    PID namespace that shares this hostname (containers).

    what="old": the previous copies that such a process moved aside (.BASE.old-*, see atomic_directory),
    for a caller that has just put a newer complete `base` in place; their age is the time since they
    were moved (a rename sets the change time; their files keep the times they were written at).

    locked: the caller holds `base`'s lock (locks.output_lock), which proves that no writer of it is alive:
    this host's copies go whatever their age and PID (a PID may have been taken by another process since)."""
    pattern = re.compile(re.escape(tmp_prefix(base, what)) + r"(\d{1,10})-")
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        m = pattern.match(name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        path = os.path.join(parent, name)
        if locked:
            remove(path)
            continue
        if _running(int(m.group(1))):
            continue
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
            remove(path)


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
        old = [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(f".{short_base(base)}.old-")]
        old.sort(key=lambda p: os.stat(p).st_ctime)  # the last one moved aside (a rename sets ctime)
    except OSError:
        return None
    if not old:
        return None
    return (f"a replacement of it was interrupted; the previous copy is {old[-1]!r}: "
            f"restore it with: mv {old[-1]} {final}")


def remove(path: str) -> None:
    """Remove a file or a directory tree, as far as possible (what is left is only disk space)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)
