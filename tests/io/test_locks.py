"""One writer per output (io.locks.output_lock): a second writer is refused at once, naming the holder; the
lock file goes with its writer; holding the lock removes what killed writers of this host left beside the output.

`lock_held_elsewhere` is the other process the exporter, builder and bench tests hold an output's lock with."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from transduce.errors import ExportError, TransduceError
from transduce.io import locks
from transduce.io.locks import lock_path, output_lock
from transduce.io.reaping import tmp_prefix

_HOLDER = """import sys
from transduce.io.locks import output_lock
with output_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes its end
"""

_TRY = """import sys
from transduce.errors import TransduceError
from transduce.io.locks import output_lock
try:
    with output_lock(sys.argv[1]):
        print("taken")
except TransduceError as e:
    print("refused:", e)
"""


@contextlib.contextmanager
def lock_held_elsewhere(final: str | os.PathLike) -> Iterator[int]:
    """Another process holds output `final`'s lock meanwhile; -> its PID."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, os.fspath(final)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n", "the holder did not take the lock"
        yield proc.pid
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()


def _try_elsewhere(final) -> str:
    """What another process gets when it tries to take `final`'s lock: "taken" or "refused: ..."."""
    return subprocess.run([sys.executable, "-c", _TRY, os.fspath(final)], capture_output=True, text=True,
                          timeout=60, check=True).stdout.strip()


def test_a_second_writer_is_refused_at_once_naming_the_holder(tmp_path):
    out = tmp_path / "out"
    with lock_held_elsewhere(out) as pid:
        t0 = time.monotonic()
        with pytest.raises(ExportError, match=f"the artifact '{out}' is being written by PID {pid}") as e:
            with output_lock(out, "the artifact", ExportError):
                pass
        assert time.monotonic() - t0 < 1
        assert lock_path(out) in str(e.value) and "wait for that command to end" in e.value.hint
    with output_lock(out, "the artifact", ExportError) as path:  # free again once the holder ended
        assert path == lock_path(out) == str(tmp_path / ".out.lock") and os.path.isfile(path)
        assert _try_elsewhere(out).startswith(f"refused: the output '{out}' is being written by PID {os.getpid()}")
    assert os.listdir(tmp_path) == []  # the lock file goes with its writer
    assert _try_elsewhere(out) == "taken"


def test_a_lock_file_removed_before_it_was_locked_is_not_the_lock(tmp_path, monkeypatch):
    """A writer that opened the lock file just before its holder ended and removed it must not hold that
    removed file: a third writer would lock the new one at the same time. It tries again on the new one."""
    out = tmp_path / "out"
    real_open = os.open
    opened = []

    def open_then_removed(path, *args, **kwargs):  # the holder ends between this open and the flock
        fd = real_open(path, *args, **kwargs)
        if path == lock_path(out):
            if not opened:
                os.unlink(path)
            opened.append(path)
        return fd

    monkeypatch.setattr(locks.os, "open", open_then_removed)
    with output_lock(out):
        assert len(opened) == 2 and os.path.isfile(lock_path(out))
        assert _try_elsewhere(out).startswith("refused:")


def abandoned_copy(parent: str | os.PathLike, name: str) -> str:
    """A temporary copy `name` in `parent`, just written (as a writer killed a moment ago left it). -> name"""
    path = os.path.join(parent, name)
    os.makedirs(os.path.join(path, "sub"))
    with open(os.path.join(path, "sub", "graph.onnx"), "wb") as f:
        f.write(b"x" * 100)
    return name


def other_host_prefix(base: str) -> str:
    """tmp_prefix(base) of another host (a disk shared with it)."""
    return tmp_prefix(base)[:-1] + "x-"


def test_the_lock_removes_what_killed_writers_of_this_host_left(tmp_path):
    """Recent copies of a live-looking PID go too: holding the lock proves their writer is gone (without it, an
    hour had to pass). Another host's copies and another output's stay, and so does a previous copy moved aside
    while the output is missing (it may be the only complete one)."""
    live = os.getppid()  # a running process, not this one
    mine = abandoned_copy(tmp_path, f"{tmp_prefix('out')}{live}-abc123")
    old = abandoned_copy(tmp_path, f"{tmp_prefix('out', 'old')}{live}-def456")
    other_host = abandoned_copy(tmp_path, f"{other_host_prefix('out')}{live}-ghi789")
    other_output = abandoned_copy(tmp_path, f"{tmp_prefix('out2')}{live}-jkl012")
    with output_lock(tmp_path / "out"):
        assert sorted(os.listdir(tmp_path)) == sorted([old, other_host, other_output, ".out.lock"])
    (tmp_path / "out").mkdir()  # a complete copy in place: the previous one is not needed any more
    with output_lock(tmp_path / "out"):
        assert sorted(os.listdir(tmp_path)) == sorted(["out", other_host, other_output, ".out.lock"])
    assert mine not in os.listdir(tmp_path)


def test_an_output_that_cannot_be_created_is_the_callers_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="cannot be created"):
        with output_lock(tmp_path / "file" / "out", "the artifact", ExportError):
            pass
    with pytest.raises(TransduceError, match="cannot be created"):
        with output_lock(tmp_path / "file" / "out"):
            pass
