"""The builder's view of its progress: TensorRT's build phases as bars on a terminal, or log lines."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass

def make_progress_monitor(trt, label: str, enabled: bool = True, log: Log = _quiet, stream=None):
    """A trt.IProgressMonitor showing the builder's phases: nested tqdm bars on a terminal, else one
    log line per top-level phase. TensorRT calls it from several threads (hence the lock); it must
    never raise (pybind turns an exception into a cancelled build), and step_complete returns True
    (False asks TensorRT to cancel the build)."""
    stream = stream if stream is not None else sys.stderr
    bars_ok = enabled and hasattr(stream, "isatty") and stream.isatty()

    class BuildProgress(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self._lock = threading.Lock()
            self._depth: dict[str, int] = {}
            self._bars: dict[str, Any] = {}
            self.phases: list[tuple[int, str, int]] = []  # (depth, name, steps), for the record

        def phase_start(self, phase_name, parent_phase, num_steps):
            try:
                with self._lock:
                    depth = self._depth.get(parent_phase, -1) + 1 if parent_phase else 0
                    self._depth[phase_name] = depth
                    self.phases.append((depth, str(phase_name), int(num_steps)))
                    if bars_ok:
                        from tqdm import tqdm

                        self._bars[phase_name] = tqdm(total=int(num_steps), desc=f"{label}: {'  ' * depth}{phase_name}",
                                                      position=depth, leave=depth == 0, file=stream, dynamic_ncols=True)
                    elif enabled and depth == 0:
                        log(f"{label}: {phase_name} ({num_steps} steps)")
            except Exception:  # noqa: BLE001
                pass

        def step_complete(self, phase_name, step):
            try:
                with self._lock:
                    bar = self._bars.get(phase_name)
                    if bar is not None:
                        bar.n = int(step) + 1
                        bar.refresh()
            except Exception:  # noqa: BLE001
                pass
            return True

        def phase_finish(self, phase_name):
            try:
                with self._lock:
                    bar = self._bars.pop(phase_name, None)
                    if bar is not None:
                        bar.n = bar.total
                        bar.close()
                    self._depth.pop(phase_name, None)
            except Exception:  # noqa: BLE001
                pass

        def close(self):
            with self._lock:
                for bar in self._bars.values():
                    bar.close()
                self._bars.clear()

    return BuildProgress()
