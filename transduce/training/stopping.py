"""Stopping a training run on a signal at a safe point.

Ctrl-C (SIGINT) and SIGTERM let the current step finish (a half-applied optimizer step would make an
inconsistent checkpoint), save a checkpoint of it and stop; a second signal stops at once, without one. A
signal taken in during a validation cuts it short (it is no part of the checkpoint: docker stop waits 10 s, a
validation can take minutes); during the run's last step it lets the run complete.

SIGTERM is taken over only where the process has turned it into an exception (the `transduce` command does:
SystemExit(143)); under its default action it still kills at once, as the caller chose. After the checkpoint
the signal's own handler runs, so the command exits as it would have (143); a Ctrl-C ends in TrainingStopped.

The command's SIGTERM watchdog (transduce.cli) ends a process whose main thread cannot run a signal handler
(stuck in native code); it asks the handler in place, through `term_deadline()`, when the work under way should
be over, and waits for that (plus its grace) before it does, so that a save is not killed half-written.

A run on several processes (training.distributed) stops them together: each rank says after every step whether a
signal came, and all stop after the same step, the ones no signal reached included (`adopt`). A rank waiting for
rank 0 (its validation, its save) is in the phase "wait", which the watchdog lets last as long as the run's
collectives may wait.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

# the slowest a checkpoint is expected to be written (a network disk), in bytes/s: how long the watchdog lets
# a save take before the run has timed one of its own
SAVE_FLOOR_RATE = 20e6

_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
_NOTICES = {
    # os.write, not print: the handler may run while the main thread is inside a print
    signal.SIGINT: b"\ninterrupt: saving a checkpoint after this step (Ctrl-C again to stop without one)\n",
    signal.SIGTERM: b"\nSIGTERM: saving a checkpoint after this step, then stopping (another signal stops at once, "
                    b"without one)\n",
}


class TrainingStopped(KeyboardInterrupt):
    """A run stopped by a signal once the checkpoint of its last whole step was saved. A KeyboardInterrupt, so that
    whoever catches Ctrl-C's catches it. signum: the signal; step and out_dir: what was saved, and where."""

    def __init__(self, message: str, signum: int, step: int, out_dir: str):
        super().__init__(message)
        self.signum, self.step, self.out_dir = signum, step, out_dir


class SkipValidation(BaseException):
    """Raised by the handler in a validation that a signal cuts short (caught around the validation). Not an
    Exception, so that no `except Exception` inside the validation swallows it."""


# seconds within which the same signal again is a launcher's copy of the first (several processes only)
ECHO_S = 2.0


class StopAfterTheStep:
    """The SIGINT and SIGTERM handler of a training run (see the module's docstring). The loop says what it is
    doing (`phase`) and how long its steps and saves take; `signum` is the signal taken in, if any."""

    def __init__(self, save_bytes: int, wait_s: float = 0.0, notify: bool = True):
        self.signum: int | None = None
        self.taken_at = 0.0  # time.monotonic() when the handler ran
        self.phase = "step"  # "step", "validate", "save" or "wait" (for another rank)
        self.phase_since = time.monotonic()
        self.longest_step = 0.0  # seconds, this run's
        self.longest_save = 0.0
        self.save_bytes = save_bytes  # a checkpoint's estimated size
        self.wait_s = wait_s  # the longest a wait for another rank may take (the collectives' timeout)
        self._previous: dict[int, object] = {}  # the handlers in place before, while ours are installed
        # the signal is another rank's (adopt): this rank's own first one, arriving later, is not a second one
        self.adopted = False
        self.notify = notify  # say that the signal was taken in (rank 0 of several says it for all)

    def __call__(self, signum, frame) -> None:
        if self._echo(signum):
            return
        if self.signum is not None and not self.adopted:  # a second signal: stop at once
            previous = self._restore().get(signum)
            if callable(previous):
                previous(signum, frame)
            raise KeyboardInterrupt
        self.signum, self.taken_at, self.adopted = signum, time.monotonic(), False
        if self.notify:
            os.write(2, _NOTICES[signum])
        if self.phase == "validate":
            raise SkipValidation

    def _echo(self, signum: int) -> bool:
        """Whether `signum` is the first signal again, as a launcher forwards it: torchrun sends each rank the
        Ctrl-C that the terminal sent them already. Only on several processes (wait_s), within ECHO_S."""
        return (self.wait_s > 0 and signum == self.signum and not self.adopted
                and time.monotonic() - self.taken_at < ECHO_S)

    def set_phase(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.monotonic()

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around a checkpoint's save: the watchdog waits for it, and the next one's allowance learns from it."""
        self.set_phase("save")
        try:
            yield
        finally:
            self.longest_save = max(self.longest_save, time.monotonic() - self.phase_since)
            self.set_phase("step")

    def term_deadline(self) -> float:
        """When (time.monotonic()) the work under way should be over; the SIGTERM watchdog waits until then, plus
        its grace. The rule: a save may take twice this run's longest save, or SAVE_FLOOR_RATE's time for its size
        if longer (so a save in native code is not killed half-written); a step twice this run's longest step
        (nothing before one was timed); a validation nothing; a wait for another rank the collectives' timeout;
        counted from when each began. Once the handler has run, the main thread is not stuck in native code: from
        then on, at least the grace."""
        budget = {"step": 2 * self.longest_step, "validate": 0.0, "wait": self.wait_s,
                  "save": 2 * max(self.longest_save, self.save_bytes / SAVE_FLOOR_RATE)}[self.phase]
        end = self.phase_since + budget
        return max(end, self.taken_at) if self.signum is not None else end

    def stop(self, message: str, step: int, out_dir: str) -> None:
        """After the checkpoint: run the signal's own handler (the command's SIGTERM: SystemExit(143)), else raise
        TrainingStopped."""
        assert self.signum is not None
        previous = self._restore().get(self.signum)
        if callable(previous) and previous is not signal.default_int_handler:
            previous(self.signum, None)
        raise TrainingStopped(message, self.signum, step, out_dir)

    def adopt(self, signum: int) -> None:
        """The signal another rank took in, which stops this one too after the same step."""
        if self.signum is None:
            self.signum, self.taken_at, self.adopted = signum, time.monotonic(), True

    def name(self) -> str:
        return _NAMES.get(self.signum, f"signal {self.signum}")

    def install(self) -> None:
        """Take over SIGINT (unless ignored: a background job) and a SIGTERM that the process turned into an
        exception; only in the main thread, where Python delivers signals."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(signum)
            if callable(previous) or (signum == signal.SIGINT and previous == signal.SIG_DFL):
                self._previous[signum] = previous
                signal.signal(signum, self)

    def _restore(self) -> dict[int, object]:
        """Put the handlers that were in place back (once); -> them."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        return previous


@contextlib.contextmanager
def stop_after_the_step(save_bytes: int, wait_s: float = 0.0, notify: bool = True) -> Iterator[StopAfterTheStep]:
    """The run's StopAfterTheStep, installed meanwhile; the handlers in place before come back after."""
    stopper = StopAfterTheStep(save_bytes, wait_s, notify)
    stopper.install()
    try:
        yield stopper
    finally:
        stopper._restore()
