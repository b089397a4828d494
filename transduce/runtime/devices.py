"""What a device parameter names: one check for training, parity and every backend; the CPUs this process has.
Messages name the parameter (`option`) as given; a command line spells it as its flag."""

from __future__ import annotations

import os
import re

from transduce.errors import InputError

_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")


def parse_device(name: str, option: str = "device", error: type[Exception] = InputError,
                 runs: str = "this runs") -> tuple[str, int | None]:
    """("cpu", None), ("cuda", None) or ("cuda", N) from "cpu", "cuda" or "cuda:N" (or a torch.device),
    without importing a framework; anything else is an `error` naming `option` and saying that `runs` on
    cpu or cuda."""
    m = _DEVICE.fullmatch(str(name))
    if m is None or (m[1] == "cpu" and m[2] not in (None, "0")):
        raise error(f"{option} {name!r}: {runs} on cpu or cuda", hint=f"{option} cpu, cuda or cuda:N",
                    params=(option,))
    return m[1], None if m[1] == "cpu" or m[2] is None else int(m[2])


def torch_device(name: str, option: str = "device", error: type[Exception] = InputError,
                 runs: str = "eager PyTorch runs", unavailable: type[Exception] | None = None,
                 cpu_hint: str | None = None) -> str:
    """`name` (parse_device) as a torch device that exists here: "cpu" or "cuda:N" ("cuda": the current
    GPU). A GPU this torch cannot see is an `unavailable` (default: `error`); cpu_hint: its hint."""
    kind, index = parse_device(name, option, error, runs)
    if kind == "cpu":
        return "cpu"
    import torch

    missing = unavailable or error
    if not torch.cuda.is_available():
        raise missing(f"{option} {name}: this torch sees no usable CUDA GPU (torch {torch.__version__})",
                      hint=cpu_hint or f"{option} cpu", params=(option,))
    index = torch.cuda.current_device() if index is None else index
    if index >= torch.cuda.device_count():
        raise missing(f"{option} {name}: there are {torch.cuda.device_count()} CUDA GPUs", hint="cuda:0 is the first",
                      params=(option,))
    return f"cuda:{index}"


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask's count (taskset, a container's cpuset), not the machine's,
    or fewer where a cgroup's CPU quota over it allows less time (docker --cpus, a Kubernetes CPU limit: whole
    CPUs of it, at least one). What parts of a batch decoded at once, or threads, can really use."""
    return _within(cpu_quota())


def quota_threads(threads: int) -> int:
    """`threads`, or where it is 0 (a framework's default: one per core of the machine) and a cgroup's CPU quota
    allows fewer, usable_cpus(): a pool wider than the quota only waits out its throttling."""
    if threads:
        return threads
    quota = cpu_quota()
    return 0 if quota is None else _within(quota)


def _within(quota: float | None) -> int:
    """The affinity mask's CPUs (the machine's where the OS has no mask), no more than whole CPUs of `quota`."""
    try:
        cpus = len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on this OS (macOS, Windows)
        cpus = os.cpu_count() or 1
    return cpus if quota is None else max(1, min(cpus, int(quota)))


# where cgroups are mounted, and each version's memory files: (limit, usage, memory.stat's count of reclaimable page
# cache)
CGROUP_ROOT = "/sys/fs/cgroup"
MEMBERSHIP = "/proc/self/cgroup"  # this process's cgroups
_MEMORY_FILES = {2: ("memory.max", "memory.current", "inactive_file"),
                 1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}
_MEMORY_MARKS = {version: files[0] for version, files in _MEMORY_FILES.items()}  # a memory cgroup's directory has it
_CPU_FILES = {2: "cpu.max", 1: "cpu.cfs_quota_us"}  # each version's CPU quota (v1's period: cpu.cfs_period_us)


def available_memory(meminfo: str = "/proc/meminfo", cgroup_root: str = CGROUP_ROOT,
                     membership: str = MEMBERSHIP) -> int | None:
    """Bytes of memory this process can still take: what the OS says is available (Linux's MemAvailable), or
    less where a cgroup limit over it (a container's, or a service's) leaves less -> None where neither can be
    read."""
    found = []
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    for directory, version in _cgroups(cgroup_root, membership, "memory", _MEMORY_MARKS):
        left = _cgroup_left(directory, *_MEMORY_FILES[version])
        if left is not None:
            found.append(left)
    return min(found) if found else None


def cpu_quota(cgroup_root: str | None = None, membership: str | None = None) -> float | None:
    """CPUs' worth of time per period that the cgroups over this process allow (v2's cpu.max, v1's
    cpu.cfs_quota_us over cpu.cfs_period_us), the least of its own and its ancestors' -> None where none is set.
    (None: CGROUP_ROOT, MEMBERSHIP.)"""
    found = []
    for directory, version in _cgroups(cgroup_root or CGROUP_ROOT, membership or MEMBERSHIP, "cpu", _CPU_FILES):
        try:
            if version == 2:
                with open(os.path.join(directory, "cpu.max"), encoding="ascii") as f:
                    quota, period = f.read().split()
            else:
                with open(os.path.join(directory, "cpu.cfs_quota_us"), encoding="ascii") as f:
                    quota = f.read().strip()
                with open(os.path.join(directory, "cpu.cfs_period_us"), encoding="ascii") as f:
                    period = f.read().strip()
            if quota != "max" and int(quota) > 0 and int(period) > 0:  # (v1 writes no quota as -1)
                found.append(int(quota) / int(period))
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def _cgroups(root: str, membership: str, controller: str, marks: dict[int, str]) -> list[tuple[str, int]]:
    """The cgroup directories of `controller` over this process, its own first, each with its version (where the
    version's file in `marks` is): its cgroup (from `membership`, /proc/self/cgroup) and every ancestor's up to the
    mount's root, which is all a container that hides the hierarchy shows. A v1 controller is mounted under its
    own name, or under the names of the controllers mounted with it (cpu,cpuacct)."""
    own = {2: "/", 1: "/"}
    mounts = [os.path.join(root, controller)]
    try:
        with open(membership, encoding="utf-8") as f:
            for line in f:
                number, controllers, path = line.rstrip("\n").split(":", 2)
                if number == "0" and not controllers:
                    own[2] = path
                elif controller in controllers.split(","):
                    own[1] = path  # the mount's name lists them as /proc does, or sorted (CentOS 7: cpuacct,cpu)
                    names = controllers.split(",")
                    mounts += [os.path.join(root, controllers), os.path.join(root, ",".join(sorted(names)))]
    except (OSError, ValueError):
        pass
    out = []
    for version, base in [(2, root)] + [(1, m) for m in dict.fromkeys(mounts)]:
        parts = [p for p in own[version].split("/") if p]
        for n in range(len(parts), -1, -1):
            directory = os.path.join(base, *parts[:n])
            if os.path.isfile(os.path.join(directory, marks[version])):
                out.append((directory, version))
        if version == 1 and any(v == 1 for _, v in out):
            break  # (the co-mounted name and its link are one hierarchy)
    return out


def _cgroup_left(directory: str, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    """What a cgroup's limit leaves: the limit less its usage, less the page cache it would reclaim first (its
    inactive file pages, as `docker stats` counts) -> None for no limit (v2's "max", v1's huge number)."""
    try:
        with open(os.path.join(directory, limit_file), encoding="ascii") as f:
            text = f.read().strip()
        if text == "max" or int(text) >= 1 << 60:
            return None
        with open(os.path.join(directory, usage_file), encoding="ascii") as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        with open(os.path.join(directory, "memory.stat"), encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
                    break
    except (OSError, ValueError):
        pass
    return max(0, int(text) - max(0, usage - inactive))
