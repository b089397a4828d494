"""`transduce train --nproc N`: the ranks of a data-parallel run started on this machine as torchrun starts them
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT in each one's environment), each running
the same command without --nproc; torch.distributed joins them (training.distributed).

The launcher forwards SIGINT and SIGTERM to every rank (a rank takes a launcher's copy of the terminal's Ctrl-C as
the same signal: stopping.ECHO_S), reports a rank that died, and ends the others if they outlive it by more than
their collectives' timeout. Its exit status is rank 0's, or else the first failed rank's.

No rank outlives its launcher: a rank gets SIGTERM when the launcher dies, even by SIGKILL (Linux's parent-death
signal; elsewhere a thread of the rank watches the launcher's pid: watch_launcher), so it saves the step under way
and exits, and the output's lock is free within seconds. Ranks take SIGINT as Ctrl-C even where the launcher
started with it ignored (a background job of a script): the launcher forwards it, and they must not ignore it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from transduce.errors import ConfigError
from transduce.runtime.devices import usable_cpus

# seconds the ranks get to end after a SIGTERM from the launcher (their last checkpoint), before SIGKILL
KILL_AFTER_S = 30.0
LAUNCHER_PID = "TRANSDUCE_LAUNCHER_PID"  # a rank's environment: the pid of the launcher it must not outlive
PR_SET_PDEATHSIG = 1  # prctl(2)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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
    env[LAUNCHER_PID] = str(os.getpid())
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
    check_ranks(nproc, device, log)
    port = int(os.environ.get("MASTER_PORT") or free_port())
    command = [sys.executable, "-m", "transduce.cli", "train", *args]
    procs: list[subprocess.Popen] = []
    forwarded: list[int] = []

    def forward(signum, frame) -> None:
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    # whatever SIGINT's inherited disposition (ignored in a background job), the launcher takes it as Ctrl-C
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        start = _rank_start(os.getpid())
        for r in range(nproc):
            procs.append(subprocess.Popen(command, env=rank_environment(r, nproc, port, device, threads),
                                          preexec_fn=start))
        return _wait(procs, timeout_s, forwarded, log)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:  # the launcher itself failed (or a second Ctrl-C): no rank outlives it
            if p.poll() is None:
                p.kill()
                p.wait()


def check_ranks(nproc: int, device: str, log: Callable[[str], None]) -> None:
    """More ranks than GPUs is refused (NCCL runs one rank per GPU); more than CPUs is warned about."""
    if device.startswith("cuda"):
        n = gpu_count()
        if nproc > n:
            raise ConfigError(f"--nproc {nproc}: {nproc} ranks on cuda, but this machine has {n} GPU(s)",
                              hint=f"one rank per GPU: --nproc {n} or fewer, or --device cpu", params=("nproc",))
    else:
        cpus = usable_cpus()
        if nproc > cpus:
            log(f"warning: {nproc} ranks on {cpus} CPU(s): each rank gets less than a core, and the run is slower "
                f"than on {cpus} rank(s); --nproc {cpus} or fewer")


def _rank_start(launcher: int) -> Callable[[], None]:
    """What a rank's process does before it runs (in the child, between fork and exec): SIGINT back to its default
    (a background job's launcher started with it ignored, and forwards it), and SIGTERM when the launcher dies.
    prctl is looked up here, in the launcher, once: the child only calls it."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no prctl (not Linux): watch_launcher's thread in the rank
        prctl = None

    def start() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if prctl is None:
            return
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # the launcher died before the signal was asked for
            os.kill(os.getpid(), signal.SIGTERM)

    return start


def watch_launcher(every_s: float = 0.5, anywhere: bool = False) -> threading.Thread | None:
    """In a rank that launch() started, where the OS has no parent-death signal (or `anywhere`): a thread that
    sends this process SIGTERM once, when its launcher is gone (the rank then saves its step and stops)."""
    pid = os.environ.get(LAUNCHER_PID)
    if not pid or (sys.platform.startswith("linux") and not anywhere):
        return None

    def watch() -> None:
        while os.getppid() == int(pid):
            time.sleep(every_s)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


def _wait(procs: list[subprocess.Popen], timeout_s: float, forwarded: list[int], log) -> int:
    """Wait for every rank; a rank that failed is reported. Once a rank failed or a signal was forwarded, ranks still
    running after `timeout_s` (they give up on a lost rank themselves by then) plus KILL_AFTER_S are killed."""
    failed_at = signalled_at = None
    why = ""  # what the ranks still running should have ended after
    reported: set[int] = set()  # ranks whose end was dealt with (said, or theirs to say)
    while any(p.poll() is None for p in procs):
        time.sleep(0.1)
        now = time.monotonic()
        for rank, p in enumerate(procs):
            code = p.poll()
            if code is not None and code != 0 and rank not in reported:
                reported.add(rank)
                if failed_at is None:
                    failed_at, why = now, why or f"rank {rank} failed (status {128 - code if code < 0 else code})"
                if code < 0 and not forwarded:  # killed by a signal nobody here sent: it says nothing itself
                    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else -code
                    log(f"error: rank {rank} of {len(procs)} (pid {p.pid}) was killed by {name}; the other ranks "
                        "stop at their next exchange with it")
        if forwarded and signalled_at is None:
            signalled_at, why = now, why or f"the launcher forwarded {signal.Signals(forwarded[0]).name}"
        since = min((t for t in (failed_at, signalled_at) if t is not None), default=now)
        if now - since > timeout_s + KILL_AFTER_S:
            for rank, p in enumerate(procs):
                if p.poll() is None:
                    reported.add(rank)
                    log(f"error: rank {rank} of {len(procs)} (pid {p.pid}) was still running {now - since:.0f} s "
                        f"after {why} (its collectives' timeout {timeout_s:g} s, then {KILL_AFTER_S:g} s more): the "
                        "launcher killed it")
                    p.kill()
    codes = [p.wait() for p in procs]
    return exit_status(codes)


def exit_status(codes: Sequence[int]) -> int:
    """The launcher's status from its ranks': rank 0's unless 0, else the first other failure's; a rank killed by
    signal S counts as 128 + S, as a shell reports it."""
    statuses = [128 - c if c < 0 else c for c in codes]
    return statuses[0] or next((s for s in statuses if s), 0)
