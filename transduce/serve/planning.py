"""How many engine processes `transduce serve --engine process` starts, on how many threads each, and whether
they fit in memory.

On the CPU, where --engines and --threads are left to it: two engines on two cores or more (each engine's decode
thread runs its batch's Python on one core: a second one turns a spare core into throughput), one on one core or
a GPU; each engine decodes on every core while it alone has work and on its share while another one has too,
where the backend can switch (ONNX Runtime: a second set of sessions). Every engine loads the model, and each
set of sessions holds its weights again: a large model's engines are fewer, or keep to their share of the cores,
where the memory the system has left would not hold them all (the server says which, and why).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from transduce.runtime import devices
from transduce.runtime.spec import MAX_THREADS, BackendSpec

SESSION_BYTES_PER_GRAPH_BYTE = 1.4  # one set of ONNX Runtime CPU sessions, per byte of the graphs it loads
PROCESS_BYTES = 64 << 20  # an engine process before its sessions: the interpreter, numpy, onnxruntime
MEMORY_SHARE = 0.8  # of the memory available at start-up, what the engines may plan to take


@dataclass(frozen=True)
class EnginePlan:
    """The engine processes a server starts."""

    count: int  # engine processes
    spec: BackendSpec  # what each one opens (its threads)
    crowded: int  # threads each decodes on while another engine decodes too (0: its threads are its own)
    note: str | None = None  # why it differs from what the cores alone would give, or why it may not fit


def engine_count(spec: BackendSpec, engines: int) -> int:
    """The engine processes to start: `engines`, or where it is 0 (auto) two on a CPU of two cores or more, else
    one (a GPU's work is one stream's)."""
    if engines:
        return engines
    return 2 if spec.device == "cpu" and devices.usable_cpus() >= 2 else 1


def engine_spec(spec: BackendSpec, engines: int) -> tuple[BackendSpec, int]:
    """The spec each engine process opens, and the threads it decodes on while another engine decodes too (0: its
    threads are its own). On the CPU, where the threads are left to the framework: each engine's share of the
    cores less the front end's one (each engine's decode thread is one of them); where the backend can run on
    fewer threads meanwhile (SharesCores), every core while no other engine decodes (a lone request decodes
    faster, and one engine takes the load until it holds fill_rows), that share while another one does."""
    if spec.threads or spec.device != "cpu":
        return spec, 0
    from transduce.runtime.backends.registry import entry

    cores = min(devices.usable_cpus(), MAX_THREADS)
    share = max(1, (cores - 1) // engines)
    if engines > 1 and entry(spec.backend).shares_cores and share < cores:
        return dataclasses.replace(spec, threads=cores), share
    return dataclasses.replace(spec, threads=share), 0


def session_bytes(path: str, spec: BackendSpec) -> int | None:
    """The memory one set of an engine's sessions takes, estimated from the graph files it loads (ONNX Runtime on
    the CPU: the encoder and the step graph, with their external-data files), -> None where it cannot be told
    (another backend or device, or a directory that is not an artifact: its loading says what is wrong)."""
    if spec.backend != "onnxruntime" or spec.device != "cpu":
        return None
    from transduce.errors import TransduceError
    from transduce.formats.artifact import cpu_step_graph, read_manifest
    from transduce.formats.contract import ENCODER_FILE

    try:
        manifest = read_manifest(path, verify_hashes=False)
        files = manifest["files"]
        graphs = sum(int(entry["bytes"]) for name, entry in files.items()
                     for graph in (ENCODER_FILE, cpu_step_graph(manifest))
                     if name == graph or name.startswith(graph + "."))  # (its weights in files beside it)
    except (TransduceError, OSError, KeyError, TypeError, ValueError):
        return None
    return int(graphs * SESSION_BYTES_PER_GRAPH_BYTE)


def plan_engines(path: str, spec: BackendSpec, engines: int, available: int | None = None) -> EnginePlan:
    """The engines to start for `engines` (0: auto) over the artifact at `path`, within the memory `available`
    (bytes; None: what the system says now, devices.available_memory). Where they would not fit: first no
    second set of sessions (each engine keeps to its share of the cores), then, for auto, fewer engines; engines
    given are started as given, with a note that they may not fit."""
    count = engine_count(spec, engines)
    each, crowded = engine_spec(spec, count)
    plan = EnginePlan(count, each, crowded)
    per_set = session_bytes(path, spec)
    available = devices.available_memory() if available is None else available
    if per_set is None or available is None:
        return plan
    budget = available * MEMORY_SHARE

    def need(n: int, lent: bool) -> int:
        return n * (PROCESS_BYTES + per_set * (2 if lent else 1))

    if need(count, bool(crowded)) <= budget:
        return plan
    sizes = f"one set of the model's sessions takes ~{_gb(per_set)}, and {_gb(available)} is available"
    if crowded and need(count, False) <= budget:
        return EnginePlan(count, dataclasses.replace(spec, threads=crowded), 0,
                          f"{count} engine processes on {_threads(crowded)} each, not on every core while one "
                          f"decodes alone: a second set of sessions in each would not fit ({sizes})")
    if engines:
        return dataclasses.replace(plan, note=f"{count} engine processes may not fit in memory ({sizes}): fewer "
                                              "(--engines) or a smaller model (transduce export --quantize) would")
    fits = max(1, min(count, math.floor(budget / need(1, False))))
    each, crowded = engine_spec(spec, fits)
    if crowded and need(fits, True) > budget:
        each, crowded = dataclasses.replace(spec, threads=crowded), 0
    note = f"{fits} engine process{'es' if fits > 1 else ''}, not {count}: {sizes} (--engines N overrides)"
    if need(fits, bool(crowded)) > budget:
        note = f"one engine process may not fit in memory: {sizes}"
    return EnginePlan(fits, each, crowded, note)


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n > 1 else ''}"


def _gb(n: int) -> str:
    return f"{n / (1 << 30):.1f} GB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MB"

