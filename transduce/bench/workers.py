"""The client side of a worker process (bench/worker.py): one benchmarked system in a process of its own, asked
over a JSON-lines pipe, and stopped when it hangs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from transduce.errors import TransduceError

# How long a worker may take to answer one request (a load, or one measurement of at most MAX_CALLS decodes)
# before it is taken for hung (a deadlocked thread pool, a stopped process) and killed: far beyond any real
# request, the largest batches included (docs/design/bench.md, "Worker timeout").
WORKER_TIMEOUT_SECONDS = 3600.0


class WorkerError(TransduceError):
    """A worker that refused a request, died or hung (its message says which, with the end of its log)."""


class Worker:
    """A worker process (python -m transduce.bench.worker) and its JSON-lines pipe."""

    def __init__(self, name: str, env_changes: dict[str, str | None], log_path: str):
        self.name = name
        env = dict(os.environ)
        for k, v in env_changes.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.env_changes = {k: v for k, v in env_changes.items() if v is not None}
        self.log_path = log_path
        self._log = open(log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen([sys.executable, "-m", "transduce.bench.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env, text=True, bufsize=1)

    def _tail(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-1500:]
        except OSError:
            return ""

    def call(self, req: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        import select

        timeout = WORKER_TIMEOUT_SECONDS if timeout is None else timeout
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            # one reply line per request, nothing read ahead: the pipe itself says whether it has come
            if not select.select([self.proc.stdout], [], [], timeout)[0]:
                self.proc.kill()
                self.proc.wait()
                raise WorkerError(f"the {self.name} worker did not answer {req.get('op')!r} in {timeout:g} s and was "
                                  f"stopped; its log {self.log_path} ends with:\n{self._tail()}")
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            raise WorkerError(f"the {self.name} worker died (exit status {self.proc.poll()}); its log "
                              f"{self.log_path} ends with:\n{self._tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError(f"{self.name}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()
