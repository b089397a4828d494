"""A directory held open while it is read: one handle on the directory, and one on each file read through it.

A writer replaces a whole directory by renaming a complete copy into its place (atomic.atomic_directory),
then removes the previous copy. A reader that opened files by name at different moments could get files of
two copies. Through a PinnedDir every file comes from the copy that was in place when the directory was
opened: a name is resolved against the held directory (openat), and once a file is open it stays readable
even after the writer removed it. Libraries that open files by name (ONNX Runtime, safetensors, tokenizers)
are given `/proc/self/fd/N`, a name of the held file itself, where the system has one (Linux); elsewhere the
plain path, and a replace during the load can then mix copies.

A file the copy held here no longer has, because it was removed while this read it, raises Replaced: the
caller reads the directory again from its name (it then gets the new copy).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from transduce.io.reaping import interrupted_replace_hint

PROC_FD = "/proc/self/fd"
ATTEMPTS = 5  # reads of a directory replaced under each one before read_pinned gives up
T = TypeVar("T")
_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def _proc_fd() -> bool:
    return os.path.isdir(PROC_FD)


class Replaced(Exception):
    """The directory was replaced (renamed away or removed) while it was read: read it again by its name."""


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class PinnedDir:
    """`path` held open (OSError as os.open raises it where it is not a directory that can be opened)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)  # as given: messages name it so
        self.fd = os.open(self.path, _FLAGS | getattr(os, "O_DIRECTORY", 0))
        self._fds: list[int] = [self.fd]  # every handle, closed together when this is collected or closed
        self._files: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closer = weakref.finalize(self, _close, self._fds)

    def close(self) -> None:
        self._closer()

    def __repr__(self) -> str:
        return f"PinnedDir({self.path!r})"

    def display(self, name: str) -> str:
        """The path of file `name` as a message shows it."""
        return os.path.join(self.path, name)

    def open(self, name: str) -> int:
        """A handle on file `name` of the held directory, opened once (FileNotFoundError where it has none:
        Replaced where the directory was replaced meanwhile)."""
        with self._lock:
            fd = self._files.get(name)
            if fd is not None:
                return fd
            try:
                fd = os.open(name, _FLAGS, dir_fd=self.fd)
            except FileNotFoundError:
                if self.replaced():
                    raise Replaced(self.path) from None
                raise
            self._fds.append(fd)
            self._files[name] = fd
            return fd

    def is_file(self, name: str) -> bool:
        try:
            return stat.S_ISREG(os.fstat(self.open(name)).st_mode)
        except Replaced:
            raise
        except OSError:
            return False

    def path_of(self, name: str) -> str:
        """A path that names file `name` of the held directory for a library that opens files by name."""
        fd = self.open(name)
        return f"{PROC_FD}/{fd}" if _proc_fd() else self.display(name)

    def directory_path(self) -> str:
        """A path of the held directory, for a library that reads files beside the one it is given (a graph's
        external weights)."""
        return f"{PROC_FD}/{self.fd}" if _proc_fd() else self.path

    def size(self, name: str) -> int:
        return os.fstat(self.open(name)).st_size

    def read_bytes(self, name: str) -> bytes:
        fd = self.open(name)
        chunks, offset = [], 0
        while chunk := os.pread(fd, 1 << 20, offset):
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks)

    def read_json(self, name: str) -> Any:
        """A JSON file's content (UTF-8); OSError or ValueError as reading and json.loads raise them."""
        return json.loads(self.read_bytes(name).decode("utf-8"))

    def sha256(self, name: str) -> str:
        fd, h, offset = self.open(name), hashlib.sha256(), 0
        while chunk := os.pread(fd, 1 << 20, offset):
            h.update(chunk)
            offset += len(chunk)
        return h.hexdigest()

    def link(self, name: str, dst: str) -> bool:
        """Hard-link the held file `name` as `dst` -> whether it was (else nothing is left at dst: a file system
        without links, another device, or the name now naming another file, as after a replace)."""
        held = os.fstat(self.open(name))
        try:
            os.link(self.display(name), dst)  # a link is made by name: then checked to be the held file
        except OSError:
            return False
        made = os.stat(dst)
        if (made.st_dev, made.st_ino) != (held.st_dev, held.st_ino):
            os.unlink(dst)
            return False
        return True

    def replaced(self) -> bool:
        """Whether `path` no longer names the held directory (renamed away, replaced or removed)."""
        try:
            now, held = os.stat(self.path), os.fstat(self.fd)
        except OSError:
            return True
        return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino) or held.st_nlink == 0


def await_replacement(path: str | os.PathLike, attempts: int = ATTEMPTS) -> bool:
    """Whether `path` is a directory, waited for briefly while it is missing between the two renames of a replace
    (its previous copy moved aside beside it: reaping.interrupted_replace_hint); a writer killed there leaves it
    missing, and the caller then says so."""
    for attempt in range(attempts):
        if os.path.isdir(path):
            return True
        if interrupted_replace_hint(path) is None:
            return False
        time.sleep(0.01 * (attempt + 1))
    return os.path.isdir(path)


def read_pinned(path: str | os.PathLike, read: Callable[[PinnedDir], T], attempts: int = ATTEMPTS) -> T:
    """read(the directory `path`, held open), read again from its name while it is replaced under each read;
    Replaced after `attempts` reads. A directory missing for a moment, between a replace's two renames, is
    waited for; `read` is called only once the directory could be opened. The PinnedDir of a read that
    raises is closed; the one a read returns stays open as long as something refers to it."""
    for attempt in range(attempts):
        try:
            pinned = PinnedDir(path)
        except (FileNotFoundError, NotADirectoryError):
            time.sleep(0.01 * (attempt + 1))
            continue
        try:
            return read(pinned)
        except Replaced:
            pinned.close()
            time.sleep(0.01 * (attempt + 1))
        except BaseException:
            pinned.close()
            raise
    raise Replaced(os.fspath(path))
