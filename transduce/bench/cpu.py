"""The machine the bench runs on: its CPU (from /proc/cpuinfo), the CPU time of processes (from /proc), the
wait until a worker is idle (settle), and the machine facts recorded in bench.json."""

from __future__ import annotations

import os
import platform
import time
from typing import Any


def cpuinfo() -> dict[str, Any] | None:
    """The first CPU's vendor, model name and flags from /proc/cpuinfo (None where it cannot be read)."""
    info: dict[str, Any] = {"vendor": "", "model": "", "flags": set()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not info["vendor"]:
                    info["vendor"] = value.strip()
                elif key == "model name" and not info["model"]:
                    info["model"] = value.strip()
                elif key == "flags" and not info["flags"]:
                    info["flags"] = set(value.split())
    except OSError:
        return None
    return info


_UNREAD: Any = object()


def cpu_is_intel(info: dict[str, Any] | None = _UNREAD) -> bool:
    """Whether /proc/cpuinfo (or `info`, cpuinfo()'s answer) names a GenuineIntel CPU (False where it cannot be
    read)."""
    info = cpuinfo() if info is _UNREAD else info
    return info is not None and info["vendor"] == "GenuineIntel"


def cpu_above_avx2(info: dict[str, Any] | None = _UNREAD) -> bool:
    """Whether the CPU (or `info`, cpuinfo()'s answer) has an instruction set above AVX2 that oneDNN dispatches to
    (AVX-512, AVX-VNNI, AMX): where it has not, ONEDNN_MAX_CPU_ISA=AVX2 changes nothing. True where /proc/cpuinfo
    cannot be read (time both)."""
    info = cpuinfo() if info is _UNREAD else info
    return info is None or any(f.startswith(("avx512", "avx_vnni", "amx")) for f in info["flags"])


# Between two measurements the measured worker must be idle: thread pools keep spinning after a call, and a
# pool still spinning when the next system starts takes a core from it (how long they spin:
# docs/design/bench.md, "Waiting for idle workers"). settle() waits until the worker's CPU time has stopped
# advancing for SETTLE_QUIET_SECONDS (checked every SETTLE_POLL_SECONDS; /proc counts in 10 ms ticks), at least
# SETTLE_SECONDS, at most SETTLE_MAX_SECONDS; without /proc it waits SETTLE_BLIND_SECONDS.
SETTLE_SECONDS = 0.02
SETTLE_POLL_SECONDS = 0.01
SETTLE_QUIET_SECONDS = 0.03
SETTLE_MAX_SECONDS = 1.0
SETTLE_BLIND_SECONDS = 0.1


def process_ticks(pid: int) -> int | None:
    """CPU time (user + system, in clock ticks) a process has used so far; None without /proc."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            stat = f.read().rsplit(")", 1)[1].split()
        return int(stat[11]) + int(stat[12])  # utime, stime (fields 14 and 15)
    except (OSError, ValueError, IndexError):
        return None


def settle(pid: int, clock=time.monotonic, sleep=time.sleep) -> float:
    """Wait until process `pid` is idle (see SETTLE_SECONDS); -> seconds waited."""
    start = clock()
    sleep(SETTLE_SECONDS)
    last = process_ticks(pid)
    if last is None:
        sleep(max(0.0, SETTLE_BLIND_SECONDS - SETTLE_SECONDS))
        return clock() - start
    quiet_since = clock()
    while clock() - start < SETTLE_MAX_SECONDS:
        sleep(SETTLE_POLL_SECONDS)
        now = process_ticks(pid)
        if now != last:
            last, quiet_since = now, clock()
        elif clock() - quiet_since >= SETTLE_QUIET_SECONDS:
            break
    return clock() - start


def cpu_sample(pids: list[int]) -> tuple[int, int, int] | None:
    """(all CPUs' busy jiffies, all CPUs' total jiffies, these processes' jiffies) from /proc; None elsewhere."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
        busy = total - fields[3] - fields[4]
    except (OSError, ValueError, IndexError):
        return None
    ticks = [process_ticks(pid) for pid in pids]
    return None if None in ticks else (busy, total, sum(ticks))


def foreign_cpu_share(before, after) -> float | None:
    """The share of the machine's CPU time that processes other than ours used between two samples."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    other = (after[0] - before[0]) - (after[2] - before[2])
    return max(0.0, other / (after[1] - before[1]))


def machine_info() -> dict[str, Any]:
    """The CPU, its instruction sets that matter here, the libraries' versions and the load at the start."""
    import numpy as np

    info = cpuinfo()
    cpu = (info and info["model"]) or platform.processor() or ""
    flags: set[str] = info["flags"] if info else set()
    isa = [f for f in ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    versions: dict[str, str] = {"python": platform.python_version(), "numpy": np.__version__}
    for mod in ("torch", "onnxruntime", "ctranslate2"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            pass
    load = None
    try:
        load = os.getloadavg()[0]
    except OSError:
        pass
    return {"cpu": cpu, "isa": isa, "logical_cpus": os.cpu_count(), "platform": platform.platform(),
            "versions": versions, "load_average_1min_at_start": load}
