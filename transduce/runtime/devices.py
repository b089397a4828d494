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
    """CPUs this process may run on (its affinity mask where the OS has one, as under taskset or a container's
    cpuset), not the machine's count: what parts of a batch decoded at once can really use."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on this OS (macOS, Windows)
        return os.cpu_count() or 1


# a cgroup's memory limit and usage (a container's): v2, then v1 (which writes "no limit" as a huge number)
CGROUP_MEMORY = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def available_memory(meminfo: str = "/proc/meminfo", cgroups=CGROUP_MEMORY) -> int | None:
    """Bytes of memory this process can still take: what the OS says is available (Linux's MemAvailable), or
    less where its cgroup's limit (a container's) leaves less -> None where neither can be read."""
    found = []
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in cgroups:
        try:
            with open(limit, encoding="ascii") as f, open(usage, encoding="ascii") as g:
                text = f.read().strip()
                if text != "max" and int(text) < 1 << 60:
                    found.append(max(0, int(text) - int(g.read().strip())))
                break
        except (OSError, ValueError):
            continue
    return min(found) if found else None
