"""`transduce train --nproc N`: the ranks of a data-parallel run started on this machine as torchrun starts them
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT in each one's environment), each running
the same command without --nproc; torch.distributed joins them (training.distributed).

The launcher forwards SIGINT and SIGTERM to every rank (a rank takes a launcher's copy of the terminal's Ctrl-C as
the same signal: stopping.ECHO_S), reports a rank that died, and ends the others if they outlive it by more than
their collectives' timeout. Its exit status is rank 0's, or else the first failed rank's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from transduce.errors import ConfigError

# seconds the ranks get to end after a SIGTERM from the launcher (their last checkpoint), before SIGKILL
KILL_AFTER_S = 30.0


def free_port() -> int:
    """A TCP port free on this machine now, for rank 0's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, nproc: int, port: int, device: str, threads: int) -> dict[str, str]:
    """Rank `rank`'s environment: torchrun's variables; on the CPU without --threads, each rank's share of the
    cores for torch's threads (N ranks each taking every core run slower than one)."""
    env = dict(os.environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cpu" and not threads and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    return env


def launch(args: Sequence[str], nproc: int, device: str = "cpu", threads: int = 0, timeout_s: float = 1800.0,
           log: Callable[[str], None] = print) -> int:
    """Run `transduce train ARGS` on `nproc` ranks of this machine; -> the exit status (see the module's
    docstring)."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        raise ConfigError("--nproc starts the ranks itself, but this process is one rank of a run already "
                          "(WORLD_SIZE is set: torchrun?)", hint="drop --nproc under torchrun", params=("nproc",))
    port = int(os.environ.get("MASTER_PORT") or free_port())
    command = [sys.executable, "-m", "transduce.cli", "train", *args]
    procs = [subprocess.Popen(command, env=rank_environment(r, nproc, port, device, threads)) for r in range(nproc)]
    forwarded: list[int] = []

    def forward(signum, frame) -> None:
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _wait(procs, timeout_s, forwarded, log)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:  # the launcher itself failed (or a second Ctrl-C): no rank outlives it
            if p.poll() is None:
                p.kill()
                p.wait()


def _wait(procs: list[subprocess.Popen], timeout_s: float, forwarded: list[int], log) -> int:
    """Wait for every rank; a rank that failed is reported. Once a rank failed or a signal was forwarded, ranks still
    running after `timeout_s` (they give up on a lost rank themselves by then) plus KILL_AFTER_S are killed."""
    failed_at = signalled_at = None
    reported: set[int] = set()
    while any(p.poll() is None for p in procs):
        time.sleep(0.1)
        now = time.monotonic()
        for rank, p in enumerate(procs):
            code = p.poll()
            if code is not None and code != 0 and rank not in reported:
                reported.add(rank)
                failed_at = failed_at or now
                if code < 0 and not forwarded:  # killed by a signal nobody here sent: it says nothing itself
                    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else -code
                    log(f"error: rank {rank} of {len(procs)} (pid {p.pid}) was killed by {name}; the other ranks "
                        "stop at their next exchange with it")
        if forwarded and signalled_at is None:
            signalled_at = now
        since = min((t for t in (failed_at, signalled_at) if t is not None), default=now)
        if now - since > timeout_s + KILL_AFTER_S:
            for rank, p in enumerate(procs):
                if p.poll() is None:
                    log(f"error: rank {rank} (pid {p.pid}) did not end in time: killed")
                    p.kill()
    codes = [p.wait() for p in procs]
    return exit_status(codes)


def exit_status(codes: Sequence[int]) -> int:
    """The launcher's status from its ranks': rank 0's unless 0, else the first other failure's; a rank killed by
    signal S counts as 128 + S, as a shell reports it."""
    statuses = [128 - c if c < 0 else c for c in codes]
    return statuses[0] or next((s for s in statuses if s), 0)
