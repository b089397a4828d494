"""The benchmark: every system on identical weights and identical inputs, interleaved, in one run.

Per model size:
 1. prepare: model directory, ONNX artifact, CTranslate2 conversion (models.prepare; cached).
 2. check: CTranslate2's greedy output must equal ours token for token (held-out sentences of the demo
    task, natural stopping; and random inputs at the benchmark's forced length). If any sentence
    differs, CTranslate2 is not timed for this size and the report says where it diverged.
 3. time, cell by cell (decoding mode x batch size): one warm-up per system, then `repeats` rounds; in
    each round every system runs once, in an order rotated by one each round (A B C, B C A, ...), so
    drift of the machine (up to ~1.8x between runs on these hosts) hits all systems alike. Each
    system measures
      decode   the whole forced-length decode of the batch: src_len encoder positions (EOS included),
               exactly `steps` generated tokens per sentence (EOS banned until then, the maximum length
               `steps`: our min_length steps+1 / max_len_b steps, CTranslate2's min = max = steps);
      first    the same with one step (encoder + one step);
      direct   (our backends) backend.encode alone and `steps` calls of backend.step at batch x beam rows.
    decode and first are each the median of back-to-back calls filling `min_seconds` (one call for
    slower cells), and a system is measured only once the last one's threads are idle (settle()).
    Derived for every system alike: step = (decode - first) / (steps - 1), encoder ~ first - step.
    Throughput: target tokens / s = batch x steps / decode (beam search counts the best hypothesis
    only), sentences / s = batch / decode.
    Quantized rows (`quantize`, e.g. onnxruntime-int8): ONNX Runtime on a quantized export of the same
    weights, timed only if quality_gate() passes on the demo size (BLEU within QUALITY_GATE_BLEU; the
    demo size runs first, and other sizes are quantized only after it passed).
 4. ratios: per round, our throughput / the fastest CTranslate2 setting's (the one with the lower median
    decode time in that cell), from the same round; the median over rounds and its min and max.

Every system lives in its own worker process (worker.py); the machine's ceilings (ceilings.py) are
measured at the start and at the end of the run.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from transduce.errors import BackendUnavailable, TransduceError
from transduce.exporter.quantize import METHODS as QUANTIZE_METHODS

OUR_BACKENDS = ("torch", "torch-cuda", "onnxruntime", "tensorrt")
# on the GPU (skipped with the reason where CUDA is missing): CTranslate2 runs on the CPU here, so these get no
# ratio to it and no CPU floor
GPU_SYSTEMS = ("torch-cuda", "tensorrt")


@dataclass(frozen=True)
class Ct2Setting:
    """One way of running CTranslate2 within the bench's thread budget (--threads)."""
    isa: str | None = None  # ONEDNN_MAX_CPU_ISA in the worker's environment (None: removed from it)
    mkl: str | None = None  # CT2_USE_MKL likewise (None: CTranslate2 uses MKL on Intel's CPUs only)
    one_thread: bool = False  # intra_threads 1 instead of the budget
    inter: bool = False  # the batch in parts at the same time: inter_threads = the budget, intra_threads 1

    def env(self) -> dict[str, str | None]:
        return {"ONEDNN_MAX_CPU_ISA": self.isa, "CT2_USE_MKL": self.mkl}


# Why these settings:
# - one thread (1thread): CTranslate2 on one thread decodes the demo model's greedy batch 1 faster than on two
#   on both machines measured (AMD EPYC: 3.1 vs 3.4-3.7 ms), as our backend's one-thread steps did there; its
#   best configuration is then within the budget.
# - inter: max_batch_size = the batch / --threads, rounded up (CTranslate2 sorts the batch by length and decodes
#   the sub-batches in parallel). Our ONNX Runtime backend decodes a small model's batch in parts on its own
#   (backend.shards), so CTranslate2's way of doing so is timed beside it: demo model, Intel Xeon (2 cores),
#   batch 16, ms: greedy 10.2 (nomkl-inter) against 16.8 for its best on one batch, beam 4 23.3 (inter) against
#   37.3.
# - nomkl: without CT2_USE_MKL, CTranslate2 multiplies with Intel MKL on GenuineIntel CPUs only (oneDNN
#   elsewhere). On an Intel Xeon (2 cores, 2026-11-24) MKL on two threads was 4-10x slower than on one (demo
#   greedy batch 16: 166 vs 17 ms), and CT2_USE_MKL=0 (oneDNN) on two threads was CTranslate2's fastest there
#   at batch 16 (16.8 and 37.3 ms greedy and beam 4) and for the base model at batch 1 (92 vs 183 ms with MKL
#   on one thread). On other CPUs the nomkl settings repeat default, 1thread and inter and are left out.
# - avx2: oneDNN's AVX-512 path was slow at 16-64 rows on the machine the issue was measured on (about 2x at
#   fp32 batch 16); on a CPU with nothing above AVX2 it repeats default and is left out.
CT2_SETTINGS: dict[str, Ct2Setting] = {
    "default": Ct2Setting(),
    "avx2": Ct2Setting(isa="AVX2"),
    "mkl": Ct2Setting(mkl="1"),
    "nomkl": Ct2Setting(mkl="0"),
    "1thread": Ct2Setting(one_thread=True),
    "nomkl-1thread": Ct2Setting(mkl="0", one_thread=True),
    "inter": Ct2Setting(inter=True),
    "nomkl-inter": Ct2Setting(mkl="0", inter=True),
}
DEFAULT_CT2_SETTINGS = ["default", "avx2", "1thread", "nomkl", "nomkl-1thread", "inter", "nomkl-inter"]


def ct2_setting(name: str) -> str:
    """The setting of a CTranslate2 system name ("ctranslate2-avx2" -> "avx2", "ctranslate2" -> "default")."""
    return name.split("-", 1)[1] if "-" in name else "default"


def ct2_threads(setting: str, threads: int) -> int:
    """CTranslate2's intra_threads under `setting` with a budget of `threads`."""
    s = CT2_SETTINGS[setting]
    return 1 if s.one_thread or s.inter else threads


def ct2_inter_threads(setting: str, threads: int) -> int:
    """CTranslate2's inter_threads under `setting` with a budget of `threads`."""
    return threads if CT2_SETTINGS[setting].inter else 1


def ct2_effective_env(setting: str, intel: bool, above_avx2: bool = True) -> dict[str, str | None]:
    """The environment a setting amounts to: CTranslate2 resolves an unset CT2_USE_MKL to MKL on Intel CPUs
    only (cpu/backend.cc, mayiuse_mkl); ONEDNN_MAX_CPU_ISA=AVX2 caps nothing on a CPU with no instruction set
    above AVX2 that oneDNN would use (above_avx2 False: the variable amounts to being unset)."""
    env = CT2_SETTINGS[setting].env()
    if env["CT2_USE_MKL"] is None:
        env["CT2_USE_MKL"] = "1" if intel else "0"
    if env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and not above_avx2:
        env["ONEDNN_MAX_CPU_ISA"] = None
    return env


def ct2_cpu(intel: bool | None = None, above_avx2: bool | None = None) -> tuple[bool, bool]:
    """(an Intel CPU, an instruction set above AVX2): what ct2_effective_env needs, the values not given read
    from /proc/cpuinfo, once for both."""
    if intel is None or above_avx2 is None:
        info = cpuinfo()
        intel = cpu_is_intel(info) if intel is None else intel
        above_avx2 = cpu_above_avx2(info) if above_avx2 is None else above_avx2
    return intel, above_avx2


def ct2_configuration(setting: str, threads: int, cpu: tuple[bool, bool], batch: int | None = None) -> tuple:
    """What `setting` amounts to on this CPU (cpu: ct2_cpu()) with a budget of `threads`: its effective
    environment, intra_threads, and inter_threads, or with a batch the sub-batches decoded at once. Two
    settings with one configuration would time the same thing twice."""
    env = ct2_effective_env(setting, *cpu)
    parallel = ct2_inter_threads(setting, threads) if batch is None else ct2_sub_batches(setting, threads, batch)
    return tuple(sorted(env.items())), ct2_threads(setting, threads), parallel


def ct2_settings_run(settings: list[str], threads: int, intel: bool | None = None,
                     above_avx2: bool | None = None) -> list[str]:
    """The settings timed: those that would only repeat another's configuration at this budget are left
    out (1thread and inter at --threads 1 are the default setting; nomkl is the default on a CPU that is not
    Intel's; avx2 is the default on a CPU with nothing above AVX2). Timing a configuration twice would only
    let the faster of two identical runs, noise, stand as CTranslate2's best."""
    cpu = ct2_cpu(intel, above_avx2)
    seen: set[tuple] = set()
    out: list[str] = []
    for s in settings:
        key = ct2_configuration(s, threads, cpu)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def ct2_sub_batches(setting: str, threads: int, batch: int) -> int:
    """How many sub-batches CTranslate2 decodes at the same time under `setting` for `batch` sentences: an inter
    setting splits the batch into parts of ceil(batch / inter_threads) (bench/worker.py), so a batch of one
    sentence is one sub-batch on one thread, whatever inter_threads says."""
    inter = ct2_inter_threads(setting, threads)
    return 1 if inter == 1 else min(inter, math.ceil(batch / math.ceil(batch / inter)))


def ct2_cell_repeats(names: list[str], threads: int, batch: int, intel: bool | None = None,
                     above_avx2: bool | None = None) -> dict[str, str]:
    """The CTranslate2 systems (of those timed in the run, in order) that would repeat an earlier one's
    configuration (ct2_configuration) in a cell of `batch` sentences -> {system: the one it repeats}. At batch 1
    an inter setting is its one-thread counterpart (one sub-batch, intra_threads 1): timing both would let the
    faster of two identical runs, noise, stand as CTranslate2's best (ct2_settings_run does the same for the
    whole run)."""
    cpu = ct2_cpu(intel, above_avx2)
    first: dict[tuple, str] = {}
    out: dict[str, str] = {}
    for n in names:
        if is_ct2(n):
            key = ct2_configuration(ct2_setting(n), threads, cpu, batch)
            if key in first:
                out[n] = first[key]
            else:
                first[key] = n
    return out


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


# Between two measurements the measured worker must be idle: thread pools keep spinning after a call
# (ONNX Runtime's ~16-50 ms here unless bounded, as our backend does on onnxruntime 1.26+: 0.3-3 ms;
# CTranslate2's ~20 ms), and a pool still spinning when the next system
# starts takes a core from it. settle() waits until the worker's CPU time has stopped advancing for
# SETTLE_QUIET_SECONDS (checked every SETTLE_POLL_SECONDS; /proc counts in 10 ms ticks), at least
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


MAX_BATCH = 4096  # sentences per benchmarked batch: beyond it the inputs alone are of no machine's size


@dataclass
class BenchConfig:
    sizes: list[str] = field(default_factory=lambda: ["demo", "base"])
    backends: list[str] = field(default_factory=lambda: ["torch", "onnxruntime", "ctranslate2"])
    batches: list[int] = field(default_factory=lambda: [1, 16])
    modes: list[str] = field(default_factory=lambda: ["greedy", "beam4"])
    repeats: int = 5
    warmup: int = 1
    steps: int = 32  # generated tokens per sentence, forced
    src_len: int = 32  # encoder positions per sentence, EOS included
    threads: int = 2
    out_dir: str = os.path.join("runs", "bench")
    cache_dir: str | None = None  # default: out_dir/models
    model_dir: str | None = None  # the demo size's model (default runs/demo/model, else a random one)
    artifact_dir: str | None = None  # its ONNX export, if one exists elsewhere
    engines: dict[str, str] = field(default_factory=dict)  # size -> TensorRT engine directory
    ct2_settings: list[str] = field(default_factory=lambda: list(DEFAULT_CT2_SETTINGS))
    quantize: list[str] = field(default_factory=list)  # extra ONNX Runtime rows on quantized exports ("int8")
    # one measurement: the median of back-to-back decode calls that fill this many seconds (one call for
    # slower cells). A single call of a few ms after an idle pause measures thread wake-ups and cold
    # caches as much as decoding: demo greedy batch 1, single calls, 5 rounds: our/CTranslate2 ratios
    # 0.55-3.27 in one run.
    min_seconds: float = 0.2
    check_sentences: int = 100  # held-out demo sentences for the natural-stopping check
    check_inputs: int = 4  # random inputs for the forced-length check
    ceilings: bool = True
    quick: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        # a size, system, batch or mode given twice would be prepared and timed twice
        for name in ("sizes", "backends", "batches", "modes", "ct2_settings"):
            setattr(self, name, list(dict.fromkeys(getattr(self, name))))
        for name, option in (("sizes", "--sizes"), ("backends", "--backends"), ("modes", "--modes")):
            if not getattr(self, name):
                problems.append(f"{option} names nothing")
        if "ctranslate2" in self.backends and not self.ct2_settings:
            problems.append("--ct2-settings names nothing (leave ctranslate2 out of --backends to time it in none)")
        if self.steps < 2:
            problems.append(f"--steps must be >= 2 (per-step latency is derived from 1 and N steps), got {self.steps}")
        if self.src_len < 2:
            problems.append(f"--src-len must be >= 2, got {self.src_len}")
        if not (math.isfinite(self.min_seconds) and self.min_seconds >= 0):
            problems.append(f"--min-seconds must be a number >= 0, got {self.min_seconds}")
        if self.repeats < 1 or self.warmup < 0:
            problems.append("--repeats must be >= 1 and --warmup >= 0")
        if not self.batches or any(not 1 <= b <= MAX_BATCH for b in self.batches):
            problems.append(f"batch sizes must be between 1 and {MAX_BATCH}, got {self.batches}")
        for m in self.modes:
            try:
                beam_of(m)
            except ValueError:
                problems.append(f"unknown mode {m!r} (greedy, or beamN such as beam4)")
        for b in self.backends:
            if b not in OUR_BACKENDS + ("ctranslate2",):
                problems.append(f"unknown backend {b!r} (torch, torch-cuda, onnxruntime, tensorrt, ctranslate2)")
        for size in self.sizes:
            if size not in ("demo", "base"):
                problems.append(f"unknown model size {size!r} (demo, base; --model-dir replaces the demo model)")
        for s in self.ct2_settings:
            if s not in CT2_SETTINGS:
                problems.append(f"unknown CTranslate2 setting {s!r} ({', '.join(CT2_SETTINGS)})")
        if self.threads < 1:
            problems.append("--threads must be >= 1")
        if self.seed < 0:
            problems.append(f"--seed must be >= 0, got {self.seed}")
        if self.check_sentences < 1:
            problems.append(f"--check-sentences must be >= 1, got {self.check_sentences}")
        if self.check_inputs < 1:
            problems.append(f"check_inputs must be >= 1, got {self.check_inputs}")
        if "tensorrt" in self.backends and not self.engines:
            problems.append("tensorrt times engines: give --engine SIZE=DIR (transduce build) for a size")
        for size, path in self.engines.items():
            if size not in self.sizes:
                problems.append(f"--engine {size}={path}: {size!r} is not among the sizes ({', '.join(self.sizes)})")
            elif not os.path.isdir(path):
                problems.append(f"--engine {size}={path}: no such directory")
        if (self.model_dir or self.artifact_dir) and "demo" not in self.sizes:
            problems.append("--model-dir and --artifact-dir replace the demo size's model: keep demo in --sizes")
        self.quantize = list(dict.fromkeys(self.quantize))
        for q in self.quantize:
            if q not in QUANTIZE_METHODS:
                problems.append(f"unknown quantization {q!r} ({', '.join(QUANTIZE_METHODS)})")
        if self.quantize and "onnxruntime" not in self.backends:
            problems.append("--quantize adds ONNX Runtime rows: keep onnxruntime in --backends")
        if self.quantize and "demo" not in self.sizes:
            problems.append("--quantize needs the demo size: its BLEU on the demo data gates the quantized rows")
        elif self.quantize:  # the gate runs on the demo size, before any other size's quantized row
            self.sizes = ["demo"] + [s for s in self.sizes if s != "demo"]
        if problems:
            raise TransduceError("invalid bench options: " + "; ".join(problems))

    @classmethod
    def quick_preset(cls, **overrides) -> BenchConfig:
        """A smoke run: the demo size, a few steps, two rounds, small ceilings."""
        base = dict(sizes=["demo"], batches=[1, 4], modes=["greedy", "beam2"], repeats=2, warmup=1, steps=6,
                    src_len=8, check_sentences=8, check_inputs=2, quick=True, min_seconds=0.0)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


def beam_of(mode: str) -> int:
    if mode == "greedy":
        return 1
    if mode.startswith("beam") and mode[4:].isdigit() and int(mode[4:]) >= 1:
        return int(mode[4:])
    raise ValueError(mode)


def ct2_system_name(setting: str) -> str:
    return "ctranslate2" if setting == "default" else f"ctranslate2-{setting}"


def is_ct2(name: str) -> bool:
    return name.startswith("ctranslate2")


# A quantized export is timed only if its BLEU on the demo task's held-out sentences (beam 4) is within
# this much of the fp32 export's (the gate); sizes without reference translations (base: random
# weights) are timed when the demo size passed the gate in the same run.
QUALITY_GATE_BLEU = 0.5


def quantized_system(name: str) -> str | None:
    """The quantization of an ONNX Runtime system name ("onnxruntime-int8" -> "int8"), else None."""
    head, _, tail = name.partition("-")
    return tail if head == "onnxruntime" and tail in QUANTIZE_METHODS else None


# -- workers ----------------------------------------------------------------------------------------
# How long a worker may take to answer one request (a load, or one measurement of at most MAX_CALLS
# decodes) before it is taken for hung (a deadlocked thread pool, a stopped process) and killed: far
# beyond any real request (base beam 4 batch 16 on eager torch is ~3 s a decode; even --batches 4096
# there, ~10 minutes, stays below it)
WORKER_TIMEOUT_SECONDS = 3600.0


class WorkerError(TransduceError):
    pass


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


# -- statistics -------------------------------------------------------------------------------------
def summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": float(statistics.median(values)), "min": float(min(values)), "max": float(max(values)),
            "n": len(values)}


def throughput_ratios(ours: list[float], theirs: list[float]) -> dict[str, Any] | None:
    """Per-round ratios of our throughput to theirs = their seconds / our seconds, same round."""
    pairs = [(a, b) for a, b in zip(ours, theirs) if a and b]
    if not pairs:
        return None
    per_round = [b / a for a, b in pairs]
    return {"per_round": per_round, **summary(per_round)}


def ct2_ratios(raw: dict[str, dict[str, list]], active: list[str]) -> dict[str, Any]:
    """One cell's ratios to CTranslate2 (its fastest setting there): {"ratios": {system: ...}} for our CPU
    systems (the GPU ones get none: CTranslate2 runs on the CPU here), plus "ct2_best" and, with several
    settings timed, "ct2_settings_ratio" (the fastest's throughput over each other's); {"ratios": {}}
    when no CTranslate2 setting was timed."""
    out: dict[str, Any] = {"ratios": {}}
    ct2_names = [n for n in active if is_ct2(n) and raw[n]["decode"]]
    if not ct2_names:
        return out
    best = min(ct2_names, key=lambda n: statistics.median(raw[n]["decode"]))
    out["ct2_best"] = best
    for n in active:
        if not is_ct2(n) and n not in GPU_SYSTEMS:
            r = throughput_ratios(raw[n]["decode"], raw[best]["decode"])
            if r:
                out["ratios"][n] = {"vs": best, **r}
    if len(ct2_names) > 1:
        out["ct2_settings_ratio"] = {n: throughput_ratios(raw[best]["decode"], raw[n]["decode"])
                                     for n in ct2_names if n != best}
    return out


def cell_stats(raw: dict[str, Any], batch: int, steps: int) -> dict[str, Any]:
    """Summaries of one system's measurements in one cell (times in ms)."""
    dec = raw.get("decode", [])
    first = raw.get("first", [])
    out: dict[str, Any] = {}
    if dec:
        out["decode_ms"] = summary([t * 1e3 for t in dec])
        # throughput at the median decode time (with an even count of rounds the median of the per-round
        # rates is not the rate at the median time shown beside it); min and max are the rounds' own
        for key, work in (("tokens_per_s", batch * steps), ("sentences_per_s", batch)):
            out[key] = summary([work / t for t in dec])
            out[key]["median"] = float(work / statistics.median(dec))
    if first:
        out["first_ms"] = summary([t * 1e3 for t in first])
    if dec and first:
        step = (statistics.median(dec) - statistics.median(first)) / (steps - 1)
        out["step_ms_derived"] = step * 1e3
        out["encoder_ms_derived"] = (statistics.median(first) - step) * 1e3
    if raw.get("calls"):
        out["calls_per_measurement"] = summary([float(c) for c in raw["calls"]])
    if raw.get("direct_encode"):
        out["encoder_ms_direct"] = summary([t * 1e3 for t in raw["direct_encode"]])
        out["step_ms_direct"] = summary([t * 1e3 for t in raw["direct_step"]])
    return out


# -- inputs -----------------------------------------------------------------------------------------
def random_sources(rng: np.random.Generator, batch: int, src_len: int, vocab_size: int) -> list[list[int]]:
    """batch sources of src_len - 1 non-special ids (the EOS is appended by each system)."""
    return rng.integers(4, vocab_size, size=(batch, src_len - 1)).tolist()


def held_out_pairs(prepared, n: int) -> list[tuple[str, str]]:
    """The demo task's first n held-out (source, reference) sentence pairs."""
    valid_tsv = os.path.join(os.path.dirname(prepared.model_dir), "data", "valid.tsv")
    if os.path.isfile(valid_tsv):
        from transduce.formats.parallel import read_parallel

        return read_parallel(valid_tsv)[:n]
    from transduce.models.corpus import demo_corpus

    _, pairs = demo_corpus(n_train=10, n_valid=max(n, 1), seed=1234)
    return pairs[:n]


def held_out_sources(prepared, n: int) -> list[list[int]]:
    """The demo task's held-out sentences, as ids of the model's tokenizer."""
    from transduce.models.checkpoint import load_tokenizer

    pairs = held_out_pairs(prepared, n)
    tok = load_tokenizer(prepared.model_dir)
    limit = prepared.config["max_positions"] - 1
    return [ids for ids in (tok.encode(src)[:limit] for src, _ in pairs) if ids]


# -- machine ----------------------------------------------------------------------------------------
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


# -- the run ----------------------------------------------------------------------------------------
def quality_gate(prepared, method: str, cfg: BenchConfig, log) -> dict[str, Any]:
    """BLEU of ONNX Runtime decoding (beam 4) with the fp32 and the `method` export on the demo task's
    held-out sentences; passed when the quantized one is at most QUALITY_GATE_BLEU below."""
    import sacrebleu

    from transduce.runtime.api import load

    pairs = held_out_pairs(prepared, cfg.check_sentences)
    sources, refs = [s for s, _ in pairs], [t for _, t in pairs]
    gate: dict[str, Any] = {"method": method, "sentences": len(pairs), "beam": 4, "max_drop": QUALITY_GATE_BLEU,
                            "size": prepared.size, "passed": False}
    if not prepared.trained:
        gate["reason"] = "the demo model is untrained (random weights), so BLEU says nothing: run `transduce demo` first"
    elif method in prepared.quantize_errors:
        gate["reason"] = f"its export failed: {prepared.quantize_errors[method]}"
    else:
        try:
            bleu = {}
            for label, path in (("fp32", prepared.artifact_dir), (method, prepared.quantized_dirs[method])):
                hyps = [r.text for r in load(path, threads=cfg.threads).translate(sources, beam_size=4, truncate=True)]
                bleu[label] = sacrebleu.corpus_bleu(hyps, [refs]).score
        except TransduceError as e:
            gate["reason"] = f"decoding the held-out sentences failed: {e}"
        else:
            gate.update({"bleu_fp32": round(bleu["fp32"], 2), f"bleu_{method}": round(bleu[method], 2),
                         "passed": bleu[method] >= bleu["fp32"] - QUALITY_GATE_BLEU})
            if not gate["passed"]:
                gate["reason"] = (f"its BLEU on the demo data is more than {QUALITY_GATE_BLEU} below fp32's "
                                  f"({gate[f'bleu_{method}']} vs {gate['bleu_fp32']})")
    log(f"[gate] {method}: " + (f"BLEU {gate[f'bleu_{method}']:.2f} vs fp32 {gate['bleu_fp32']:.2f} on {len(pairs)} "
                                f"held-out demo sentences (beam 4): " if "bleu_fp32" in gate else "")
        + ("pass" if gate["passed"] else f"FAIL, not timed: {gate['reason']}"))
    return gate


def _checks(prepared, cfg: BenchConfig, log) -> list[dict[str, Any]]:
    from transduce.bench.ctranslate2_export import check_greedy_equality, load_translator
    from transduce.runtime.backends.torch_backend import TorchBackend

    backend = TorchBackend.from_model_dir(prepared.model_dir)
    translator = load_translator(prepared.ct2_dir, threads=1)
    reports = []
    if prepared.size == "demo":
        src = held_out_sources(prepared, cfg.check_sentences)
        if src:
            reports.append(check_greedy_equality(prepared.model_dir, prepared.ct2_dir, src,
                                                 f"{prepared.size}: held-out demo sentences",
                                                 translator=translator, backend=backend))
    rng = np.random.default_rng(cfg.seed + 1)
    src = random_sources(rng, cfg.check_inputs, cfg.src_len, prepared.config["vocab_size"])
    reports.append(check_greedy_equality(prepared.model_dir, prepared.ct2_dir, src,
                                         f"{prepared.size}: random inputs at the benchmark's shape",
                                         forced_steps=cfg.steps, translator=translator, backend=backend))
    for r in reports:
        log(f"[check] {r.summary()}")
    return [r.to_dict() for r in reports]


def _time_cell(workers: dict[str, Worker], names: list[str], src: list[list[int]], beam: int, cfg: BenchConfig,
               log) -> dict[str, dict[str, list]]:
    raw: dict[str, dict[str, list]] = {n: {"decode": [], "first": [], "direct_encode": [], "direct_step": [],
                                           "order": [], "calls": []} for n in names}
    failed: dict[str, str] = {}

    def measure(name: str, record: bool, position: int) -> None:
        w = workers[name]
        try:
            d = w.call({"op": "decode", "src": src, "beam": beam, "steps": cfg.steps, "min_seconds": cfg.min_seconds})
            settle(w.proc.pid)
            f = w.call({"op": "decode", "src": src, "beam": beam, "steps": 1, "min_seconds": cfg.min_seconds})
            settle(w.proc.pid)
            direct = None
            if not is_ct2(name):
                direct = w.call({"op": "direct", "src": src, "beam": beam, "steps": cfg.steps})
                settle(w.proc.pid)
        except WorkerError as e:
            failed[name] = str(e)
            log(f"{name} failed: {e}")
            return
        if record:
            raw[name]["decode"].append(d["seconds"])
            raw[name]["first"].append(f["seconds"])
            raw[name]["order"].append(position)
            raw[name]["calls"].append(d.get("calls", 1))  # decode calls behind each decode median
            if direct is not None:
                raw[name]["direct_encode"].append(direct["encode_seconds"])
                raw[name]["direct_step"].append(float(np.mean(direct["step_seconds"])))

    for _ in range(cfg.warmup):
        for i, n in enumerate(names):
            if n not in failed:
                measure(n, False, i)
    for r in range(cfg.repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for i, n in enumerate(order):
            if n not in failed:
                measure(n, True, i)
    for n, msg in failed.items():
        raw[n]["error"] = msg  # type: ignore[assignment]
    return raw


def check_paths_and_lengths(cfg: BenchConfig) -> str:
    """Before any work: the output and cache directories can be written and do not overlap wrongly, a
    given --model-dir is a model, and --src-len and --steps fit every size's model. -> the cache dir."""
    from transduce.bench import models
    from transduce.formats.paths import make_writable_dir

    cache = cfg.cache_dir or os.path.join(cfg.out_dir, "models")
    real_out, real_cache = os.path.realpath(cfg.out_dir), os.path.realpath(cache)
    if real_out.startswith(real_cache + os.sep):  # CACHE/<size>/... are replaced whole when prepared again
        raise TransduceError(f"--out {cfg.out_dir!r} is inside --cache-dir {cfg.cache_dir!r}, where prepared models "
                             "and exports go", hint="choose an --out outside the cache")
    make_writable_dir(cfg.out_dir, "--out")
    make_writable_dir(os.path.join(cfg.out_dir, "logs"), "--out's logs directory")
    make_writable_dir(cache, "--cache-dir")
    # CACHE/<size>/{model,artifact,...} are the bench's to replace: none may be a model or export of the user's
    # (--cache-dir runs would make CACHE/demo the demo's own directory)
    theirs = [p for p in (cfg.model_dir, cfg.artifact_dir, models.DEMO_MODEL_DIR) if p]
    for size in cfg.sizes:
        mine = os.path.realpath(os.path.join(cache, size))
        for p in theirs:
            real = os.path.realpath(p)
            if real == mine or real.startswith(mine + os.sep):
                raise TransduceError(f"--cache-dir {cache!r} would put the bench's {size} models in {mine}, which holds "
                                     f"{p}: the bench replaces what is in its cache",
                                     hint="choose a --cache-dir of its own (the default is OUT/models)")
    if cfg.model_dir:
        models.check_model_dir(cfg.model_dir)
    if cfg.artifact_dir:
        demo_model = models.demo_model_dir(cfg.model_dir)
        if demo_model is None:
            raise TransduceError(f"--artifact-dir {cfg.artifact_dir} needs the model it was exported from",
                                 hint="give it with --model-dir (without a trained demo model, the bench makes a random one)")
        models.check_artifact(cfg.artifact_dir, demo_model)
    for size in cfg.sizes:
        limit = models.max_positions(size, cfg.model_dir if size == "demo" else None)
        for value, option in ((cfg.src_len, "--src-len"), (cfg.steps, "--steps")):
            if value > limit:
                raise TransduceError(f"{option} {value} exceeds the {size} model's max_positions ({limit})",
                                     hint=f"use {option} {limit} or less")
    return cache


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    from transduce.bench import ceilings as ceil

    cache = check_paths_and_lengths(cfg)
    logs = os.path.join(cfg.out_dir, "logs")  # made writable by check_paths_and_lengths
    started = time.time()
    result: dict[str, Any] = {
        "format": "transduce-bench", "format_version": 1,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": asdict(cfg), "machine": machine_info(), "sizes": [],
    }
    try:  # the plot is one of the three reports: without it the run would be lost at its very end
        import matplotlib  # noqa: F401
    except ImportError:
        raise TransduceError("matplotlib is not installed: the bench draws its plot (bench.png) with it",
                             hint="pip install 'transduce[bench]'") from None
    want_ct2 = "ctranslate2" in cfg.backends
    ct2_missing = None
    if want_ct2:
        try:
            import ctranslate2  # noqa: F401
        except ImportError:
            ct2_missing = "ctranslate2 is not installed (pip install 'transduce[bench]')"
            log(f"[bench] {ct2_missing}: CTranslate2 is skipped")

    copy_mib, matmul_n = (32, 512) if cfg.quick else (256, 1536)
    ceilings_runs: list[tuple[str, Any]] = []

    def measure_ceilings(when: str) -> None:
        if cfg.ceilings:
            log(f"[ceilings] measuring memory bandwidth and matmul rate ({when})")
            ceilings_runs.append((when, ceil.measure_ceilings(cfg.threads, copy_mib, matmul_n)))

    measure_ceilings("start")

    # workers: one per system, started together (imports overlap), loaded per size
    names = [b for b in cfg.backends if b in ("torch", "torch-cuda", "onnxruntime")]
    names += [f"onnxruntime-{q}" for q in cfg.quantize]
    if "tensorrt" in cfg.backends or cfg.engines:
        names.append("tensorrt")
    if want_ct2 and not ct2_missing:
        names += [ct2_system_name(s) for s in ct2_settings_run(cfg.ct2_settings, cfg.threads)]
    workers: dict[str, Worker] = {}
    gates: dict[str, dict[str, Any]] = {}  # quantization -> the demo size's quality gate (see quality_gate)
    try:
        for n in names:
            env = CT2_SETTINGS[ct2_setting(n)].env() if is_ct2(n) else {}
            workers[n] = Worker(n, env, os.path.join(logs, f"worker-{n}.log"))
        for i, size in enumerate(cfg.sizes):
            result["sizes"].append(_run_size(size, cfg, cache, workers, ct2_missing, log, gates))
            if i + 1 < len(cfg.sizes):
                measure_ceilings(f"after {size}")
    finally:
        for w in workers.values():
            w.close()
    if not any(s["cells"] for s in result["sizes"]):
        reasons = sorted({f"{name}: {info['reason']}" for s in result["sizes"] for name, info in s["systems"].items()
                          if info.get("status") == "skipped"})
        raise TransduceError("nothing was timed: every system was skipped" + (" (" + "; ".join(reasons) + ")" if reasons else ""),
                             hint="see the reasons above; `transduce bench --help` lists the systems")
    measure_ceilings("end")
    if cfg.ceilings:
        # the best of the run's measurements: contention only ever lowers them
        result["ceilings"] = {"runs": [{"when": when, **c.to_dict()} for when, c in ceilings_runs],
                              "bandwidth_gbs": max(c.bandwidth_gbs for _, c in ceilings_runs),
                              "matmul_gflops": max(c.matmul_gflops for _, c in ceilings_runs),
                              "threads": cfg.threads}
        best = ceil.Ceilings(result["ceilings"]["bandwidth_gbs"], result["ceilings"]["matmul_gflops"], cfg.threads, {})
        for s in result["sizes"]:
            for c in s.get("cells", []):
                c["floor"] = ceil.decode_floor(s["model"]["config"], best, c["batch"], c["beam"], cfg.src_len, cfg.steps)
                c["floor"]["decode_ms"] = c["floor"]["seconds"] * 1e3
    result["seconds"] = round(time.time() - started, 1)
    return result


def _run_size(size: str, cfg: BenchConfig, cache: str, workers: dict[str, Worker], ct2_missing: str | None,
              log, gates: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One model size; `gates` holds the quantized exports' quality gates, set by the demo size."""
    from transduce.bench.models import prepare

    log(f"[{size}] preparing the model, its ONNX export and its CTranslate2 conversion")
    model_dir = cfg.model_dir if size == "demo" else None
    want_ct2 = any(is_ct2(n) for n in workers)
    prepared = prepare(size, cache, model_dir=model_dir, with_ct2=want_ct2,
                       artifact_dir=cfg.artifact_dir if size == "demo" else None, log=lambda m: log(f"[{size}] {m}"),
                       # the other sizes' quantized exports only once the demo size's gate passed
                       quantize=[q for q in cfg.quantize if size == "demo" or gates.get(q, {}).get("passed")])
    entry: dict[str, Any] = {
        "size": size,
        "model": {"description": prepared.description, "trained": prepared.trained, "config": prepared.config,
                  "model_dir": prepared.model_dir, "artifact_dir": prepared.artifact_dir, "ct2_dir": prepared.ct2_dir,
                  "notes": prepared.notes},
        "systems": {}, "checks": [], "cells": [], "quality_gates": {},
    }
    cpu = ct2_cpu()  # what the CTranslate2 settings amount to here, read once for the size's cells
    if size == "demo":
        for q in cfg.quantize:
            gates[q] = entry["quality_gates"][q] = quality_gate(prepared, q, cfg, log)
    if ct2_missing:
        for s in ct2_settings_run(cfg.ct2_settings, cfg.threads, *cpu):
            entry["systems"][ct2_system_name(s)] = {"status": "skipped", "reason": ct2_missing}

    ct2_ok, ct2_reason = want_ct2, ""
    if want_ct2 and prepared.ct2_error:
        ct2_ok, ct2_reason = False, prepared.ct2_error
    elif want_ct2:
        log(f"[{size}] checking CTranslate2's greedy output against ours, token for token")
        try:
            entry["checks"] = _checks(prepared, cfg, log)
        except BackendUnavailable as e:  # CTranslate2 refusing its conversion (load_translator): time the others
            entry["checks"], ct2_ok, ct2_reason = [], False, e.args[0]
            log(f"[{size}] CTranslate2 is NOT timed: {ct2_reason}")
        bad = [c for c in entry["checks"] if not c["passed"]]
        if bad:
            ct2_ok = False
            ct2_reason = "greedy output differs from ours: " + "; ".join(_divergence_text(c) for c in bad)
            log(f"[{size}] CTranslate2 is NOT timed: {ct2_reason}")

    active = []
    for name, w in workers.items():
        if is_ct2(name):
            if not ct2_ok:
                entry["systems"][name] = {"status": "skipped", "reason": ct2_reason}
                continue
            req = {"op": "load", "system": "ctranslate2", "path": prepared.ct2_dir,
                   "threads": ct2_threads(ct2_setting(name), cfg.threads),
                   "inter_threads": ct2_inter_threads(ct2_setting(name), cfg.threads)}
        elif quantized_system(name):
            q = quantized_system(name)
            gate = gates.get(q)
            reason = None
            if gate is None or not gate["passed"]:
                reason = gate["reason"] if gate else "its quality gate (BLEU on the demo data) did not run"
            elif q in prepared.quantize_errors:
                reason = f"its export failed: {prepared.quantize_errors[q]}"
            if reason:
                entry["systems"][name] = {"status": "skipped", "reason": reason}
                continue
            if size != "demo":
                entry["quality_gates"][q] = {**gate, "from": "demo"}
            req = {"op": "load", "system": "onnxruntime", "path": prepared.quantized_dirs[q], "model_dir": prepared.model_dir,
                   "threads": cfg.threads}
        elif name == "tensorrt":
            if size not in cfg.engines:
                entry["systems"][name] = {"status": "skipped", "reason": f"no TensorRT engine given for {size} (--engine {size}=DIR)"}
                continue
            req = {"op": "load", "system": "tensorrt", "path": cfg.engines[size], "model_dir": prepared.model_dir,
                   "threads": cfg.threads}
        else:
            req = {"op": "load", "system": name, "path": prepared.artifact_dir, "model_dir": prepared.model_dir,
                   "threads": cfg.threads}
        try:
            info = w.call(req)
            entry["systems"][name] = {"status": "ok", "info": info.get("info", {}), "env": w.env_changes}
            active.append(name)
        except WorkerError as e:
            entry["systems"][name] = {"status": "skipped", "reason": str(e)}
            log(f"[{size}] {name} is skipped: {e}")

    if not active:
        log(f"[{size}] nothing to time: every system was skipped")
        return entry
    rng = np.random.default_rng(cfg.seed)
    for mode in cfg.modes:
        beam = beam_of(mode)
        for batch in cfg.batches:
            src = random_sources(rng, batch, cfg.src_len, prepared.config["vocab_size"])
            # live workers only: a dead one's pid cannot be read, which would void every later cell's sample
            pids = [os.getpid()] + [w.proc.pid for w in workers.values() if w.proc.poll() is None]
            before = cpu_sample(pids)
            head = f"[{size}] {mode} batch {batch}: "
            cell = {"mode": mode, "beam": beam,
                    **_timed_cell(workers, active, src, beam, cfg, cpu, functools.partial(_prefixed, log, head))}
            cell["foreign_cpu_share"] = foreign_cpu_share(before, cpu_sample(pids))
            entry["cells"].append(cell)
            _log_cell(cell, size, log)
    return entry


def _prefixed(log, head: str, message: str) -> None:
    log(head + message)


def _timed_cell(workers: dict[str, Worker], active: list[str], src: list[list[int]], beam: int, cfg: BenchConfig,
                cpu: tuple[bool, bool], log) -> dict[str, Any]:
    """One cell's measurements, stats and ratios. A CTranslate2 setting that repeats another in this cell
    (ct2_cell_repeats) is not timed, unless the one it repeats fails there: then the whole cell is timed
    again with it standing in and without what failed, and the ratios are over that second timing, whose
    rounds pair with each other."""
    batch = len(src)
    repeats = ct2_cell_repeats(active, cfg.threads, batch, *cpu)
    timed = [n for n in active if n not in repeats]
    log(f"{', '.join(timed)} x {cfg.repeats} rounds")
    if repeats:
        log("not timed, repeating another here: " + ", ".join(f"{n} (= {r})" for n, r in repeats.items()))
    raw = _time_cell(workers, timed, src, beam, cfg, log)
    paired = timed  # the systems whose rounds the ratios pair: those of one timing
    stand_ins = {n: r for n, r in repeats.items() if "error" in raw[r]}
    # timed again: the stand-ins and the CPU systems that did not fail (the GPU ones get no ratios)
    again = [n for n in active if n not in GPU_SYSTEMS and (n in stand_ins or (n in timed and "error" not in raw[n]))]
    if stand_ins and any(not is_ct2(n) for n in again):
        log("timed again, " + ", ".join(f"{n} in place of {r}, which failed" for n, r in stand_ins.items()))
        raw.update(_time_cell(workers, again, src, beam, cfg, log))
        paired = again  # what failed in the first timing has no rounds paired with the second's
        timed = [n for n in active if n in timed or n in stand_ins]
    else:
        stand_ins = {}  # nothing of ours left to pair with a stand-in
    cell: dict[str, Any] = {"batch": batch, "src_len": cfg.src_len, "steps": cfg.steps, "repeats": cfg.repeats,
                            "systems": {}, "ratios": {}}
    not_timed = {n: r for n, r in repeats.items() if n not in stand_ins}
    if not_timed:
        cell["not_timed"] = not_timed  # {system: the system it repeats in this cell}
    if stand_ins:
        cell["stand_ins"] = stand_ins  # {system: the failed system it was timed in place of}
        cell["timed_again"] = paired  # the systems of the second timing, over which the ratios are
    for name in timed:
        cell["systems"][name] = {"stats": cell_stats(raw[name], batch, cfg.steps), "raw": raw[name]}
    cell.update(ct2_ratios(raw, paired))
    return cell


def _divergence_text(check: dict[str, Any]) -> str:
    s = f"{check['label']}: {check['equal']}/{check['sentences']} equal"
    if check.get("logprob_tolerance_exceeded"):
        s += (f", {check['logprob_tolerance_exceeded']} log-probs outside the tolerance (max |diff| "
              f"{max(check.get('max_abs_logprob_diff') or 0, check.get('max_abs_logprob_diff_random') or 0):.1e})")
    if check["divergences"]:
        d = check["divergences"][0]
        s += f", first at sentence {d['sentence']} position {d['position']} (ours {d['ours']}, CTranslate2 {d['theirs']})"
    return s


def _log_cell(cell: dict[str, Any], size: str, log) -> None:
    parts = []
    for name, s in cell["systems"].items():
        tps = s["stats"].get("tokens_per_s")
        if tps:
            parts.append(f"{name} {tps['median']:.0f} tok/s")
    for name, r in cell["ratios"].items():
        parts.append(f"{name}/{r['vs']} {r['median']:.2f}x")
    if cell.get("foreign_cpu_share") is not None:
        parts.append(f"other processes used {100 * cell['foreign_cpu_share']:.0f}% of the CPUs meanwhile")
    log(f"[{size}] {cell['mode']} batch {cell['batch']}: " + ", ".join(parts))
