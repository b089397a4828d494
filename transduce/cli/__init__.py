"""The `transduce` command: one subcommand per job; each parses options and calls one library function."""

from __future__ import annotations

import contextlib

import click

from transduce.cli.errors import cli_errors, cli_messages

__all__ = ["main", "cli_errors"]


class _Group(click.Group):
    """Prints a TransduceError as one clear message (no traceback) and exits with status 2; the
    package's warnings as 'warning: ...' lines (cli_messages). SIGTERM ends a command as Ctrl-C does; Ctrl-C
    ends it with status 130 (click's own would print "Aborted!" and exit 1, like a failure)."""

    def invoke(self, ctx):
        try:
            with cli_messages(), _terminate_like_interrupt():
                return super().invoke(ctx)
        except KeyboardInterrupt:  # its temporaries were removed on the way out
            click.echo("interrupted", err=True)
            raise SystemExit(130) from None


# seconds a SIGTERM waits for the interpreter: a long native call (a TensorRT build, a big matmul) runs no
# Python signal handler until it returns, so past this the process exits without the cleanup, as SIGTERM's
# default action would (within docker stop's 10 s before its SIGKILL)
TERM_GRACE_S = 5.0


@contextlib.contextmanager
def _terminate_like_interrupt():
    """SIGTERM (docker stop, systemd, Kubernetes, timeout) as an exception in the main thread, so that the
    cleanup Ctrl-C gets runs too: a killed export or checkpoint removes its temporary copy, which the
    default action (death without cleanup) leaves on disk, the size of the artifact. Exit status 143.

    Python runs the handler only between bytecodes of the main thread; a watchdog thread, woken by the
    signal through signal.set_wakeup_fd, ends the process with status 143 if it is still alive TERM_GRACE_S
    later (the main thread stuck in native code), or at once on a second SIGTERM. Native code that keeps the
    GIL keeps the watchdog waiting too; TensorRT's builder, ONNX Runtime and torch's kernels let go of it.

    A command may defer SIGTERM to a safe point with a handler of its own in place of ours (train: the end of
    the step, then a checkpoint); then the watchdog asks that handler's term_deadline() when the work under
    way should be over, and waits until then plus TERM_GRACE_S, asking again each time (see _wait_for_the_end)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield  # not ours to change: a caller that set its own handler, or a thread (no handler can be set)
        return

    def terminate(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
        if _importing(frame):  # raised inside a module's body, the exit leaves it half-made for its importers
            _exit_after_import(threading.main_thread().ident)
            return
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    stop_watchdog = _start_term_watchdog()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        stop_watchdog()


class _Terminated(SystemExit):
    """SystemExit(143), raised in the main thread by another one (which can give only the class)."""

    def __init__(self, *args):
        super().__init__(143)


def _importing(frame) -> bool:
    """Whether `frame` runs inside an import (a module's body under importlib's machinery)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _exit_after_import(main_ident: int) -> None:
    """Raise SystemExit(143) in the main thread as soon as it is past the import it is in."""
    import ctypes
    import sys
    import threading
    import time

    def wait() -> None:
        while (frame := sys._current_frames().get(main_ident)) is not None and _importing(frame):
            time.sleep(0.005)
        if frame is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main_ident), ctypes.py_object(_Terminated))

    threading.Thread(target=wait, name="transduce-sigterm-after-import", daemon=True).start()


def _start_term_watchdog():
    """The watchdog of _terminate_like_interrupt; -> a function that stops it. None started where a wakeup fd
    is already in use (an event loop's): the handler alone then."""
    import os
    import signal
    import socket
    import threading

    receive, send = socket.socketpair()
    send.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(send.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main thread of the main interpreter
        previous = None
    if previous != -1:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        receive.close()
        send.close()
        return lambda: None

    def watch():
        # one byte per caught signal, its number (SIGINT's too: ignored); 0: stop
        while (byte := receive.recv(1)) and byte[0] != 0:
            if byte[0] != signal.SIGTERM:
                continue
            if _wait_for_the_end(receive):
                return  # stopped: the command ended in time
            os._exit(128 + signal.SIGTERM)

    thread = threading.Thread(target=watch, name="transduce-sigterm-watchdog", daemon=True)
    thread.start()

    def stop():
        signal.set_wakeup_fd(-1)
        try:
            send.send(b"\0")
        except OSError:
            pass
        thread.join(timeout=1.0)
        send.close()
        if not thread.is_alive():
            receive.close()

    return stop


def _wait_for_the_end(receive) -> bool:
    """After a SIGTERM: whether the command ends (a 0 byte on `receive`) in time. In time: within TERM_GRACE_S, or
    past it while the SIGTERM handler in place says its work should still be under way (term_deadline()), until
    that time plus TERM_GRACE_S; not a second SIGTERM."""
    import signal
    import time

    deadline = time.monotonic() + TERM_GRACE_S
    while True:
        receive.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            byte = receive.recv(1)
        except TimeoutError:
            expected = _expected_end()
            if expected is None or expected + TERM_GRACE_S <= time.monotonic():
                return False
            deadline = expected + TERM_GRACE_S
            continue
        if not byte or byte[0] == 0:
            return True
        if byte[0] == signal.SIGTERM:
            return False


def _expected_end() -> float | None:
    """The time.monotonic() by which the SIGTERM handler in place expects its work to be over (its term_deadline()),
    or None: ours, or one that says nothing."""
    import signal

    term_deadline = getattr(signal.getsignal(signal.SIGTERM), "term_deadline", None)
    try:
        return float(term_deadline()) if callable(term_deadline) else None
    except Exception:  # a broken handler must not keep the process from ending
        return None


@click.group(cls=_Group)
@click.version_option(package_name="transduce")
def main() -> None:
    """transduce: train -> export -> build -> decode -> parity -> bench for encoder-decoder Transformers."""


def _register() -> None:
    """Each command group's click code is a module of this package (click only, no heavy imports)."""
    import importlib

    for module in ("transduce.cli.train", "transduce.cli.export", "transduce.cli.build",
                   "transduce.cli.import_", "transduce.cli.decode", "transduce.cli.score", "transduce.cli.parity",
                   "transduce.cli.inspect", "transduce.cli.bench", "transduce.cli.demo",
                   "transduce.cli.serve"):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if not e.name or not module.startswith(e.name):
                raise
            continue
        for cmd in mod.COMMANDS:
            main.add_command(cmd)


_register()

if __name__ == "__main__":
    main()
