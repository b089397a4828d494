"""What a training run shows while it trains, on stderr: a progress bar on a terminal (steps, loss, learning
rate, tokens/s, time left), else, in a log, a plain line every LOG_EVERY_S seconds with the same figures."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

LOG_EVERY_S = 30.0  # seconds between progress lines when stderr is not a terminal


def duration(seconds: float) -> str:
    """'42s', '3m05s', '2h07m'."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """The bar or the periodic lines of one run, from step `initial` to `total`, unless not `enabled` (--quiet).
    `log` prints a line; `write` prints one beside the bar, if any (validation lines, shown either way)."""

    def __init__(self, total: int, initial: int, log: Callable[[str], None], enabled: bool = True):
        self.total, self.initial, self.log = total, initial, log
        self.bar = None
        self.lines = enabled and not _is_terminal(sys.stderr)
        if enabled and not self.lines:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                            mininterval=0.5, file=sys.stderr)
        self.started = self.since = time.monotonic()  # the run's start here; the figures' window's
        self.tokens = 0  # in the window: tokens trained on, and the seconds the steps took
        self.seconds = 0.0

    def update(self, step: int, loss: float, lr: float, ntok: int, step_seconds: float) -> None:
        """After each step. tokens/s: over the steps' own time (validations and saves left out); the time left:
        at this run's pace so far, validations and saves included (the rest of the run has them too)."""
        self.tokens += ntok
        self.seconds += step_seconds
        if self.bar is not None:
            self.bar.update(1)
            if step % 10 == 0:
                self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{self._rate():.0f}")
                self.tokens, self.seconds = 0, 0.0
            return
        now = time.monotonic()
        if not self.lines or now - self.since < LOG_EVERY_S:
            return
        left = (self.total - step) * (now - self.started) / max(step - self.initial, 1)
        self.log(f"step {step}/{self.total}: train loss {loss:.3f}, lr {lr:.2e}, {self._rate():,.0f} tokens/s, "
                 f"ETA {duration(left)}")
        self.since, self.tokens, self.seconds = now, 0, 0.0

    def _rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)  # above the bar, off stdout (the CLI's JSON summary)
        else:
            self.log(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _is_terminal(stream) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
