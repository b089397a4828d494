"""transduce.io.atomic (and paths, reaping, text): atomic single-file writes (decode --output,
parity --json, engine plans, the timing cache)."""

import os
import shutil
import stat
import subprocess
import sys

import pytest

from transduce.formats.kinds import is_artifact_dir as _is_artifact
from transduce.io.atomic import atomic_file, write_bytes_atomic, write_text_atomic
from transduce.io.reaping import tmp_prefix as _tmp_prefix
from transduce.io.text import iter_lines


def _dead_pid() -> int:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(gone.stdout)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    import transduce.io.atomic as io

    path = tmp_path / "out.txt"
    path.write_text("old")
    os.chmod(path, 0o640)

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(io.os, "replace", full_disk)
        with pytest.raises(OSError, match="No space"):
            write_bytes_atomic(path, b"new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.txt"]
    write_text_atomic(path, "new é")
    assert path.read_text(encoding="utf-8") == "new é"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640  # an existing file keeps its mode
    assert os.listdir(tmp_path) == ["out.txt"]


def test_temporary_files_of_killed_writers_are_removed(tmp_path):
    """A write killed before its rename leaves .NAME.tmp-HOST-PID-*: the next write of NAME removes those
    of this host whose process is gone and that are an hour old; it keeps a running process's, another
    host's, a recent one and other names'."""
    dead = _dead_pid()
    prefix = _tmp_prefix("t.cache")
    abandoned = tmp_path / f"{prefix}{dead}-abc"
    running = tmp_path / f"{prefix}{os.getppid()}-def"
    other_host = tmp_path / f".t.cache.tmp-otherhost-{dead}-ghi"
    recent = tmp_path / f"{prefix}{dead}-jkl"
    other_name = tmp_path / f"{_tmp_prefix('u.cache')}{dead}-mno"
    hours_ago = os.stat(tmp_path).st_mtime - 2 * 3600
    for p in (abandoned, running, other_host, recent, other_name):
        p.write_bytes(b"partial")
        if p is not recent:
            os.utime(p, (hours_ago, hours_ago))
    write_bytes_atomic(tmp_path / "t.cache", b"cache")
    assert (tmp_path / "t.cache").read_bytes() == b"cache"
    assert sorted(os.listdir(tmp_path)) == sorted(["t.cache", running.name, other_host.name, recent.name,
                                                   other_name.name])


class _Mine(Exception):
    pass


def test_atomic_file_maps_only_its_own_errors(tmp_path, monkeypatch):
    """error=: what atomic_file's own OSErrors become (creating, closing, renaming); an exception of the
    block, an OSError included, passes through unchanged, and no temporary stays either way."""
    import transduce.io.atomic as io

    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(OSError, match="from the block") as raised:
        with atomic_file(path, error=_Mine) as f:
            f.write(b"new")
            raise OSError(5, "from the block")
    assert type(raised.value) is OSError
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.txt"]

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(io.os, "replace", full_disk)
        with pytest.raises(_Mine):
            with atomic_file(path, error=_Mine) as f:
                f.write(b"new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.txt"]
    def interrupted(*args):
        raise KeyboardInterrupt

    for name in ("replace", "fdopen"):  # a Ctrl-C at the rename, a failure to wrap the descriptor
        with monkeypatch.context() as m:
            m.setattr(io.os, name, interrupted)
            with pytest.raises(KeyboardInterrupt):
                with atomic_file(path, error=_Mine) as f:
                    f.write(b"new")
        assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.txt"], name
    with pytest.raises(_Mine):  # the parent cannot be made: a file is in the way
        with atomic_file(path / "below", error=_Mine):
            pass
    if os.path.exists("/dev/full"):  # written in place; the full device shows when the buffer is flushed
        with pytest.raises(_Mine, match="No space"):
            with atomic_file("/dev/full", error=_Mine) as f:
                f.write(b"x")
    with atomic_file(path, error=_Mine) as f:
        f.write(b"new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["out.txt"]


def test_written_in_place_when_not_a_regular_file(tmp_path):
    link = tmp_path / "link"
    target = tmp_path / "target.txt"
    target.write_text("x")
    os.symlink(target, link)
    write_text_atomic(link, "through the link")
    assert os.path.islink(link) and target.read_text() == "through the link"
    write_bytes_atomic(os.devnull, b"discarded")


def test_long_names_get_short_temporaries(tmp_path):
    """A legal 240-character name: its temporary copies' names stay under 255 bytes."""
    from transduce.io.atomic import atomic_directory

    name = "x" * 240
    write_text_atomic(tmp_path / f"{name}.txt", "ok")
    assert (tmp_path / f"{name}.txt").read_text() == "ok"
    with atomic_directory(tmp_path / name) as tmp:
        with open(os.path.join(tmp, "f"), "w") as f:
            f.write("1")
    with atomic_directory(tmp_path / name) as tmp:  # replaces the first: its old copy is named short too
        with open(os.path.join(tmp, "f"), "w") as f:
            f.write("2")
    assert (tmp_path / name / "f").read_text() == "2" and sorted(os.listdir(tmp_path)) == sorted([f"{name}.txt", name])


def test_a_symlinked_directory_is_replaced_where_it_points(tmp_path):
    from transduce.io.atomic import atomic_directory

    real = tmp_path / "real"
    real.mkdir()
    (real / "old").write_text("old")
    os.symlink(real, tmp_path / "link")
    with atomic_directory(tmp_path / "link") as tmp:
        with open(os.path.join(tmp, "new"), "w") as f:
            f.write("new")
    assert os.path.islink(tmp_path / "link") and sorted(os.listdir(real)) == ["new"]
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]  # no .link.old-* left behind


def test_what_force_cannot_replace_is_said_before_asking_for_force(tmp_path):
    from transduce.errors import TransduceError
    from transduce.io.paths import check_replaceable

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    for force in (False, True):
        with pytest.raises(TransduceError, match="is not an artifact; --force replaces only artifacts"):
            check_replaceable(str(tmp_path / "model"), force, _is_artifact, "an artifact", "artifacts")


def test_an_empty_directory_is_written_without_force(tmp_path):
    """mkdir -p before a command: nothing to lose, so no --force; a directory with a file still needs it."""
    from transduce.errors import TransduceError
    from transduce.io.atomic import atomic_directory
    from transduce.io.paths import check_replaceable

    out = tmp_path / "out"
    out.mkdir()
    check_replaceable(str(out), False, _is_artifact, "an artifact", "artifacts")
    with atomic_directory(out, overwrite=False) as tmp:
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            f.write('{"kind": "transduce-artifact"}')
    assert os.listdir(out) == ["manifest.json"]
    with pytest.raises(TransduceError, match="already exists and is an artifact") as e:
        check_replaceable(str(out), False, _is_artifact, "an artifact", "artifacts")
    assert "--force" in e.value.hint
    with pytest.raises(TransduceError, match="is not empty .any more.: it was left as it is"):
        with atomic_directory(out, overwrite=False):
            pass


def test_an_empty_directory_written_to_meanwhile_is_left_alone(tmp_path):
    """Accepted because it was empty; at the end it is replaced only if it still is (one rename)."""
    from transduce.errors import TransduceError
    from transduce.io.atomic import atomic_directory

    for made_before in (True, False):
        out = tmp_path / f"out-{made_before}"
        if made_before:
            out.mkdir()
        with pytest.raises(TransduceError, match="was created or written to while this ran"):
            with atomic_directory(out, overwrite=False) as tmp:
                with open(os.path.join(tmp, "manifest.json"), "w") as f:
                    f.write("{}")
                out.mkdir(exist_ok=True)
                (out / "notes.txt").write_text("mine")
        assert os.listdir(out) == ["notes.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out-False", "out-True"]  # no temporary directory left


def test_a_failed_final_rename_keeps_the_old_directory(tmp_path, monkeypatch):
    """EBUSY and the like on the last rename: the previous directory is put back, the new one removed."""
    import errno

    from transduce.errors import TransduceError
    from transduce.io import atomic as _io

    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text("old")
    real_replace = os.replace

    def replace(src, dst):
        if os.path.basename(src).startswith(".out.tmp-"):
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real_replace(src, dst)

    monkeypatch.setattr(_io.os, "replace", replace)
    with pytest.raises(OSError, match="busy"):
        with _io.atomic_directory(out) as tmp:
            with open(os.path.join(tmp, "manifest.json"), "w") as f:
                f.write("new")
    assert os.listdir(tmp_path) == ["out"] and (out / "manifest.json").read_text() == "old"

    def neither(src, dst):  # and the previous copy cannot be put back either: the error says where it is
        if ".out.tmp-" in src or ".out.old-" in src:
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real_replace(src, dst)

    monkeypatch.setattr(_io.os, "replace", neither)
    with pytest.raises(TransduceError, match="replacing .*failed .*busy.*could not be put back") as e:
        with _io.atomic_directory(out):
            pass
    [old] = os.listdir(tmp_path)
    assert old.startswith(".out.old-") and e.value.hint == f"restore it with: mv {tmp_path / old} {out}"
    assert (tmp_path / old / "manifest.json").read_text() == "old"


def test_previous_copies_that_killed_writers_moved_aside_are_removed(tmp_path, monkeypatch):
    """A writer killed between atomic_directory's two renames leaves the previous copy as .NAME.old-HOST-PID-*
    (the load error's mv hint names it). A later run that writes NAME, replacing it or where it was lost,
    removes those of this host whose process is gone and that were moved aside over an hour ago (once a
    newer complete NAME is in place nothing names them any more: hidden copies the size of the artifact);
    it keeps a running process's, another host's, a recent one, and another name's whose first characters
    are the same."""
    import time

    from transduce.io import atomic as _io
    from transduce.io import reaping

    long_a, long_b = "a" * 120 + "x", "a" * 120 + "y"
    assert (reaping.short_base(long_a) != reaping.short_base(long_b)
            and len(reaping.short_base(long_a)) == reaping.TMP_NAME_CHARS)
    out = tmp_path / long_a
    dead = _dead_pid()
    prefix = _tmp_prefix(long_a, "old")
    abandoned = tmp_path / f"{prefix}{dead}-abc"
    running = tmp_path / f"{prefix}{os.getppid()}-def"
    other_host = tmp_path / f".{reaping.short_base(long_a)}.old-otherhost-{dead}-ghi"
    other_name = tmp_path / f"{_tmp_prefix(long_b, 'old')}{dead}-jkl"
    huge_pid = tmp_path / f"{prefix}99999999999999999999-mno"  # not a PID this pattern takes
    kept = [running.name, other_host.name, other_name.name, huge_pid.name]
    for p in (abandoned, running, other_host, other_name, huge_pid):
        p.mkdir()
        (p / "manifest.json").write_text("previous")
    real_time = time.time
    hours_later = lambda: real_time() + 2 * 3600  # noqa: E731
    for step, later in (("creates beside a recent one", False), ("replaces a recent one", False), ("creates", True)):
        if step == "creates":
            shutil.rmtree(out)  # lost (an interrupted replacement): written again where it was
        with monkeypatch.context() as m:
            if later:
                m.setattr(time, "time", hours_later)
            with _io.atomic_directory(out) as tmp:
                (tmp_path / tmp / "manifest.json").write_text(step)
        left = [abandoned.name] if step != "creates" else []
        assert sorted(os.listdir(tmp_path)) == sorted([out.name, *kept, *left]), step
    assert (out / "manifest.json").read_text() == "creates"


def test_the_restore_hint_follows_a_link_to_the_output(tmp_path):
    """atomic_directory replaces a link's target: the previous copy is moved aside beside the target, and
    the hint for the missing output names it there."""
    from transduce.io import reaping

    (tmp_path / "real").mkdir()
    link = tmp_path / "out"
    os.symlink(tmp_path / "real", link)
    old = tmp_path / f"{_tmp_prefix('real', 'old')}{_dead_pid()}-abc"
    os.rename(tmp_path / "real", old)  # as a writer killed between its renames leaves it
    assert reaping.interrupted_replace_hint(link) == (f"a replacement of it was interrupted; the previous copy is "
                                                  f"{str(old)!r}: restore it with: mv {old} {tmp_path / 'real'}")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name a descriptor")
def test_what_is_published_is_on_disk_first(tmp_path, monkeypatch):
    """A replacement syncs every file of the new copy before the rename that publishes it, and the
    directory after it, before the previous copy goes (a power loss leaves one complete copy)."""
    from transduce.io import atomic as _io

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(_io.os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                     real_fsync(fd))[1])
    monkeypatch.setattr(_io.os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    out = tmp_path / "out"
    for _ in range(2):  # a new directory, then a replacement
        events.clear()
        with _io.atomic_directory(out) as tmp:
            (tmp_path / tmp / "weights").write_bytes(b"w")
        publish = events.index(("replace", str(out)))
        synced = [p for kind, p in events[:publish] if kind == "fsync"]
        assert any(p.endswith("/weights") for p in synced) and any(".out.tmp-" in p for p in synced), events
        assert ("fsync", str(tmp_path)) in events[publish:], events
    events.clear()
    write_bytes_atomic(tmp_path / "f.bin", b"data")
    publish = events.index(("replace", str(tmp_path / "f.bin")))
    assert any(".f.bin.tmp-" in p for kind, p in events[:publish] if kind == "fsync")
    assert ("fsync", str(tmp_path)) in events[publish:], events


def test_a_file_system_that_cannot_sync_is_no_error_but_an_io_error_is(tmp_path, monkeypatch):
    import errno

    from transduce.io import atomic as _io

    def fsync_fails(code):
        def fsync(fd):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(_io.os, "fsync", fsync)

    fsync_fails(errno.EINVAL)
    with _io.atomic_directory(tmp_path / "out") as tmp:
        (tmp_path / tmp / "f").write_text("x")
    assert (tmp_path / "out" / "f").read_text() == "x"
    fsync_fails(errno.EIO)
    with pytest.raises(OSError, match="Input/output error"):
        with _io.atomic_directory(tmp_path / "out") as tmp:
            (tmp_path / tmp / "f").write_text("y")
    assert (tmp_path / "out" / "f").read_text() == "x" and sorted(os.listdir(tmp_path)) == ["out"]


def test_mount_points_and_unreadable_directories_are_named(tmp_path, monkeypatch):
    from transduce.errors import TransduceError
    from transduce.io import paths as _io

    out = tmp_path / "out"
    out.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(_io.os.path, "ismount", lambda p: p == str(out) or real_ismount(p))
    with pytest.raises(TransduceError, match="is a mount point") as e:
        _io.check_replaceable(str(out), True, _is_artifact, "an artifact", "artifacts")
    assert "inside it" in e.value.hint
    monkeypatch.setattr(_io.os.path, "ismount", real_ismount)

    def unreadable(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_io, "is_empty_dir", unreadable)
    with pytest.raises(TransduceError, match="cannot read .*Permission denied"):
        _io.check_replaceable(str(out), False, _is_artifact, "an artifact", "artifacts")


def test_lines_of_a_pipe_come_as_they_arrive(tmp_path):
    """iter_lines does not wait for the end of its input: a line written to a pipe is read at once, and an
    invalid byte further on is an error only when its line is reached."""
    import threading

    from transduce.errors import InputError

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list = []

    def read():
        lines = iter_lines(str(fifo), InputError)
        got.append(next(lines))
        seen.set()
        try:
            got.extend(lines)
        except InputError as e:
            got.append(e)

    seen = threading.Event()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with open(fifo, "wb", buffering=0) as f:
        f.write("\ufefffirst\r\n".encode())
        assert seen.wait(10), "the first line was not read before the input ended"
        f.write(b"second\nth\xffird\n")
    reader.join(10)
    assert got[:2] == ["first", "second"]
    for data, lines in ((b"\xef\xbb\xbf", []), (b"\xef\xbb\xbf\n", [""]), (b"", []), (b"a\r\r\nb", ["a\r", "b"])):
        (tmp_path / "f.txt").write_bytes(data)
        assert list(iter_lines(str(tmp_path / "f.txt"), InputError)) == lines, data
    assert isinstance(got[2], InputError) and "line 3 has an invalid byte" in str(got[2])



@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_sigterm_cleans_up_like_ctrl_c(tmp_path, tiny_model_dir, signum):
    """SIGTERM (docker stop, systemd, timeout) during an export: the temporary copy is removed, as after
    Ctrl-C, and the command exits with status 143 (the default action would die leaving it on disk); Ctrl-C
    (SIGINT) the same, with status 130 (not click's "Aborted!" and 1, which reads as a failure)."""
    import signal
    import time

    out = tmp_path / "artifact"
    # SIGINT as a terminal's Ctrl-C gives it, even where this runs with it ignored (nohup, a background job)
    proc = subprocess.Popen([sys.executable, "-c", "from transduce.cli import main; main()", "export", tiny_model_dir,
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    prefix = _tmp_prefix("artifact")
    deadline = time.monotonic() + 120
    while not any(n.startswith(prefix) for n in os.listdir(tmp_path)):  # the export has begun writing
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(getattr(signal, signum))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + getattr(signal, signum), err
    assert "Aborted!" not in err and (signum == "SIGTERM" or err.strip().endswith("interrupted")), err
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)  # no hidden copy, no artifact


def _in_native_sleep(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Wait until the main thread of the scripts below, which printed 'ready', is in libc's sleep: the signal must
    find it in native code, not in the Python code before it (where a handler runs at once). Nothing else the
    scripts do after 'ready' sleeps in the kernel, so state S in /proc says so."""
    import time

    stat_file = f"/proc/{proc.pid}/task/{proc.pid}/stat"
    if not os.path.exists(stat_file):  # no /proc: give it time instead
        time.sleep(0.5)
        return
    end = time.monotonic() + timeout
    while True:
        with open(stat_file) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state == "S":
            return
        assert proc.poll() is None and time.monotonic() < end, (state, proc.poll())
        time.sleep(0.005)


def _send_sigterm(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM to `proc`, returning once it is delivered (no longer pending): a second one sent before that would
    merge with it into one."""
    import signal
    import time

    proc.send_signal(signal.SIGTERM)
    status_file = f"/proc/{proc.pid}/status"
    if not os.path.exists(status_file):
        time.sleep(0.5)
        return
    end = time.monotonic() + timeout
    while True:
        with open(status_file) as f:
            pending = [int(line.split()[1], 16) for line in f if line.startswith(("ShdPnd:", "SigPnd:"))]
        if not any(mask & (1 << (signal.SIGTERM - 1)) for mask in pending):
            return
        assert proc.poll() is None and time.monotonic() < end, "the SIGTERM was not delivered"
        time.sleep(0.005)


def test_sigterm_ends_a_command_stuck_in_native_code(tmp_path):
    """Python runs no signal handler while the main thread is in native code (a TensorRT build): SIGTERM still
    ends the command, with status 143, once the grace period has passed, and a second SIGTERM at once."""
    import time

    # native code that lets go of the GIL, as TensorRT's builder and ONNX Runtime do: libc's sleep, with SIGTERM
    # blocked in the main thread so that it is not cut short (the signal goes to the watchdog's thread)
    script = ("import ctypes, signal, sys; from transduce import cli; cli.TERM_GRACE_S = float(sys.argv[1])\n"
              "with cli._terminate_like_interrupt():\n"
              "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
              "    print('ready', flush=True)\n"
              "    ctypes.CDLL(None).sleep(3600)\n")
    for grace, signals in ((0.5, 1), (60.0, 2)):
        proc = subprocess.Popen([sys.executable, "-c", script, str(grace)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        _in_native_sleep(proc)
        t0 = time.monotonic()
        for _ in range(signals):
            _send_sigterm(proc)
        try:
            proc.wait(timeout=30)
        finally:
            proc.kill()
        assert proc.returncode == 143 and time.monotonic() - t0 < 20, (grace, signals, proc.returncode)


def test_the_sigterm_watchdog_waits_for_the_work_a_handler_says_is_under_way():
    """A command that defers SIGTERM (train: to the end of its step, then a checkpoint) puts a handler with a
    term_deadline() in place: the watchdog waits for that, plus its grace, rather than kill a save in native code
    half-written; past it, the process ends as one stuck in native code does."""
    import signal
    import time

    # the main thread in native code (a save: libc's sleep, SIGTERM blocked there as above) for `busy` seconds,
    # which its handler says should be over `expected` seconds after it began
    script = ("import ctypes, signal, sys, time; from transduce import cli; cli.TERM_GRACE_S = 0.5\n"
              "class Saving:\n"
              "    since = time.monotonic()\n"
              "    def __call__(self, signum, frame):\n"
              "        print('handled', flush=True)\n"
              "        raise SystemExit(143)\n"
              "    def term_deadline(self):\n"
              "        return self.since + float(sys.argv[1])\n"
              "with cli._terminate_like_interrupt():\n"
              "    signal.signal(signal.SIGTERM, Saving())\n"
              "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
              "    print('ready', flush=True)\n"
              "    ctypes.CDLL(None).sleep(int(sys.argv[2]))\n"
              "    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})\n")
    # the first: its handler runs once the 2 s of native code are over, seconds before the watchdog's deadline
    for expected, busy, handled in ((6.0, 2, True), (1.0, 3600, False)):
        proc = subprocess.Popen([sys.executable, "-c", script, str(expected), str(busy)], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline() == "ready\n"
        _in_native_sleep(proc)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        finally:
            proc.kill()
        assert proc.returncode == 143 and time.monotonic() - t0 < 20, (expected, busy, proc.returncode)
        assert ("handled" in out) == handled, (expected, busy, out)


def test_a_command_that_ends_stops_the_sigterm_watchdog():
    """The watchdog thread and the wakeup fd are the command's only: gone once it returns."""
    import signal
    import threading

    from transduce import cli

    with cli._terminate_like_interrupt():
        assert any(t.name == "transduce-sigterm-watchdog" for t in threading.enumerate())
    assert not any(t.name == "transduce-sigterm-watchdog" for t in threading.enumerate())
    assert signal.set_wakeup_fd(-1) == -1 and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_sigterm_during_an_import_ends_the_command_after_it(tmp_path):
    """A SIGTERM that lands while a module is being imported (an export imports parts of torch late) waits for the
    import to finish: raised inside it, the exit would leave the module half-made for whatever catches it (seen as
    a TypeError and exit 1 from inside torch's imports). The command still ends with 143, at the import's end."""
    (tmp_path / "slow_module.py").write_text(
        "import os, signal, pathlib\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "total = sum(range(200_000))  # bytecode after the signal: where a handler would run\n"
        "pathlib.Path(os.environ['MARKER']).write_text('imported')\n")
    script = ("import time; from transduce import cli\n"
              "with cli._terminate_like_interrupt():\n"
              "    import slow_module\n"
              "    while True:\n"
              "        time.sleep(0.01)\n")
    marker = tmp_path / "marker"
    env = {**os.environ, "MARKER": str(marker), "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143, proc.stderr
    assert marker.read_text() == "imported", "the SIGTERM cut the import short"
    assert "Traceback" not in proc.stderr, proc.stderr
