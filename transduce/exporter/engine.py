"""`transduce build`: an exported artifact -> TensorRT engines, and the engine directory the runtime reads.

  ENGINE_DIR/
    encoder.plan         serialized TensorRT engine of encoder.onnx
    decoder_step.plan    serialized TensorRT engine of decoder_step.onnx
    engine.json          what was built, for what, and from what: engine format version, TensorRT
                         version, GPU name and compute capability, precision, the optimization
                         profiles and the limits they came from, the artifact's path, contract
                         version and manifest sha256, the sha256 of the source ONNX files, and
                         {name: {sha256, bytes}} of every other file in the directory
    manifest.json        the artifact itself, hard-linked from ARTIFACT_DIR (copied where links are
    config.json          impossible): the engine directory is self-contained, it is also a valid
    tokenizer.json       artifact (the onnxruntime backend and `transduce parity` read it), and an
    encoder.onnx         engine can be rebuilt from it if the original artifact is gone
    decoder_step.onnx    (plus <graph>.onnx.data where the export has external weights)

Building (`build_engines`, needs TensorRT >= 10 and a CUDA GPU; runs only on a GPU machine):
- the artifact's manifest is read and every file checked against its sha256 (contract.read_manifest);
- each graph is parsed with `trt.OnnxParser.parse_from_file`; every parser error is reported with
  its node index, name, operator and description (EngineError naming the file);
- networks are strongly typed (`NetworkDefinitionCreationFlag.STRONGLY_TYPED`): the precision is the
  ONNX graph's own (an fp16 or bf16 export carries Cast nodes around its fp32 islands: LayerNorm,
  softmax, log_softmax), so no precision flag is ever set. TensorRT 10 needs the flag; TensorRT 11
  made strong typing the only mode (the flag is accepted and ignored) and removed BuilderFlag.FP16,
  BF16, INT8 and the precision-constraint flags, which this module therefore never touches.
  EXPLICIT_BATCH is deprecated in 10 and gone from the enum in 11: not used either;
- BuilderFlag.TF32 (on by default in TensorRT) is cleared unless tf32=True: TF32 matmuls round fp32
  inputs to 10-bit mantissas, ~1e-3 relative error, which would break fp32 parity (PyTorch's own
  default is TF32 off for matmuls);
- optimization profiles come from `derive_profiles` (pure; see there for the choice between one and
  two profiles), one `builder.create_optimization_profile()` per profile with `set_shape(name, min,
  opt, max)` for every input, added with `config.add_optimization_profile`;
- `config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_gb * 2**30)`;
- a timing cache (`config.create_timing_cache(bytes)`, `set_timing_cache(cache, ignore_mismatch=False)`)
  is loaded from `timing_cache` if the file exists, shared by both builds, and written back
  atomically after them (`cache.serialize()`). TensorRT rejects a cache from another device or
  version (and bytes it cannot read); the build then starts from an empty cache, says so, and leaves
  that file as it is rather than replace another GPU's cache with this one's;
- a `trt.IProgressMonitor` subclass shows the builder's phases (tqdm bars on a terminal, one line
  per top-level phase otherwise);
- `builder.build_serialized_network(network, config)`; the plans are deserialized again
  (`trt.Runtime.deserialize_cuda_engine`) and their IO names, dtypes and profile shapes checked
  against the contract and the derived profiles before anything is written in place;
- everything is written under `atomic_directory`: a failed build leaves no engine directory, and an
  existing one is replaced only with force=True (and only if it is an engine directory).

Loading (`read_engine_manifest`, CPU-only logic): refuses, with a message naming
`transduce build ARTIFACT_DIR --out ENGINE_DIR --force`, an engine directory built with another
TensorRT version or on another GPU (compute capability or name: a plan is specific to both; the
comparison is `compatibility_problems`, pure, with the current TensorRT version and GPU injected),
a plan or copied file whose sha256 changed, a missing file, or another engine format or contract
version.
"""

from __future__ import annotations

import collections
import contextlib
import datetime as _dt
import json
import math
import os
import shutil
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transduce._io import (
    atomic_output,
    check_creatable,
    check_replaceable,
    marked_as,
    require_directory,
    write_bytes_atomic,
    write_json,
)
from transduce.errors import ArtifactError, BackendUnavailable, EngineError
from transduce.runtime import contract

ENGINE_KIND = "transduce-engine"
ENGINE_FORMAT_VERSION = 1
ENGINE_MANIFEST = contract.ENGINE_MANIFEST_FILE
ENCODER_PLAN = "encoder.plan"
STEP_PLAN = "decoder_step.plan"
# graph name -> (ONNX file, plan file)
GRAPHS: dict[str, tuple[str, str]] = {
    "encoder": (contract.ENCODER_FILE, ENCODER_PLAN),
    "decoder_step": (contract.STEP_FILE, STEP_PLAN),
}
MIN_TENSORRT_MAJOR = 10
GPU_HINT = "pip install 'transduce[gpu]' (TensorRT >= 10 and onnxruntime-gpu) on a machine with an NVIDIA GPU and a CUDA build of PyTorch"
PROFILE_MODES = ("auto", "single", "split")

# Default limits (the CLI's): 16 sentences x beam 4 = 64 decoder rows, sources up to 128 tokens (EOS
# included), targets up to max_src_len + 50 (the paper's "input length + 50", decoding.max_lengths).
DEFAULT_MAX_BATCH = 16
DEFAULT_BEAM = 4
DEFAULT_MAX_SRC_LEN = 128
DEFAULT_TGT_MARGIN = 50
DEFAULT_WORKSPACE_GB = 4.0
# "auto" profiles: a latency profile for up to SMALL_BATCH sentences next to a throughput profile,
# once max_batch is at least SPLIT_MIN_BATCH (below that one profile's range is narrow enough).
SMALL_BATCH = 2
SPLIT_MIN_BATCH = 8

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# -- profiles (pure: no TensorRT, no torch) ------------------------------------------------------


@dataclass(frozen=True)
class AxisRange:
    """min <= opt <= max of one dynamic axis in one optimization profile (TensorRT tunes for opt)."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.opt <= self.max:
            raise EngineError(f"invalid axis range min={self.min} opt={self.opt} max={self.max}: "
                              "need 1 <= min <= opt <= max")

    def contains(self, n: int) -> bool:
        return self.min <= n <= self.max

    def as_list(self) -> list[int]:
        return [self.min, self.opt, self.max]

    @classmethod
    def from_list(cls, v: Sequence[int]) -> AxisRange:
        return cls(int(v[0]), int(v[1]), int(v[2]))


@dataclass(frozen=True)
class ProfileSpec:
    """One optimization profile over the contract's dynamic axes.

    batch is the graph's batch axis: sentences for the encoder, decoder rows (sentences x beam) for
    the step graph. cache_len is None for the encoder (it has no cache input).
    """

    name: str
    batch: AxisRange
    src_len: AxisRange
    cache_len: AxisRange | None = None

    def contains(self, batch: int, src_len: int, cache_len: int | None = None) -> bool:
        if not (self.batch.contains(batch) and self.src_len.contains(src_len)):
            return False
        return cache_len is None or self.cache_len is None or self.cache_len.contains(cache_len)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "batch": self.batch.as_list(), "src_len": self.src_len.as_list()}
        if self.cache_len is not None:
            d["cache_len"] = self.cache_len.as_list()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProfileSpec:
        cache = d.get("cache_len")
        return cls(str(d["name"]), AxisRange.from_list(d["batch"]), AxisRange.from_list(d["src_len"]),
                   AxisRange.from_list(cache) if cache is not None else None)


@dataclass(frozen=True)
class EnginePlan:
    """The limits a build was asked for and the profiles derived from them, per graph."""

    limits: dict[str, Any]
    encoder: tuple[ProfileSpec, ...]
    decoder_step: tuple[ProfileSpec, ...]

    def profiles(self, graph: str) -> tuple[ProfileSpec, ...]:
        if graph not in GRAPHS:
            raise KeyError(graph)
        return self.encoder if graph == "encoder" else self.decoder_step

    def to_dict(self) -> dict[str, Any]:
        return {"limits": dict(self.limits), "encoder": [p.to_dict() for p in self.encoder],
                "decoder_step": [p.to_dict() for p in self.decoder_step]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EnginePlan:
        return cls(dict(d.get("limits", {})), tuple(ProfileSpec.from_dict(p) for p in d["encoder"]),
                   tuple(ProfileSpec.from_dict(p) for p in d["decoder_step"]))


def _positive(name: str, flag: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineError(f"{name} must be a positive integer, got {value!r}", hint=f"pass {flag} N with N >= 1")
    return value


def _clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


def derive_profiles(config: dict[str, Any], max_batch: int = DEFAULT_MAX_BATCH, beam: int = DEFAULT_BEAM,
                    max_src_len: int | None = None, max_tgt_len: int | None = None, opt_batch: int | None = None,
                    opt_src_len: int | None = None, opt_tgt_len: int | None = None,
                    profiles: str = "auto") -> EnginePlan:
    """The optimization profiles of both engines, from the limits a user declares (pure, no TensorRT).

    Axes (transduce/runtime/contract.py): the encoder's batch is sentences; the step graph's batch is
    decoder rows = sentences x beam (beam search runs every beam of every sentence as one row);
    src_len is source tokens (EOS included); cache_len is the self-attention cache's capacity, which
    the runtime sets to the batch's longest allowed target (decoding.max_lengths), so max_tgt_len
    bounds it. Defaults: max_src_len = min(128, max_positions), max_tgt_len = min(max_src_len + 50,
    max_positions); each opt defaults to half its max (at least 1): tactics are timed at opt, and
    the middle of the range is the least bad single point for shapes that vary over it.

    Minimums are 1 everywhere: the contract never produces an empty tensor (a source has at least its
    EOS, the cache has at least one slot even at step 0, a batch at least one row). TensorRT accepts
    min 0 (empty tensors) in a profile, but a binding still needs a valid address of at least one
    byte, so a runtime that allowed empty tensors would have to bind a placeholder buffer; ours does
    that defensively but never needs it.

    One profile or two ("auto" decides). A profile's kernels are timed at its opt shape; a step graph
    run at 4 rows with tactics tuned for 32 rows (or the reverse) pays for GEMM tiles and attention
    kernels chosen for the other size. Interactive use (one or two sentences, rows = beam or 2 x
    beam) and batch translation (rows up to max_batch x beam) are both common, so from max_batch >=
    8 on "auto" builds two profiles that split the batch range without overlap: "latency" for 1..2
    sentences (opt 1 sentence) and "throughput" for the rest (opt opt_batch). Each profile costs a
    build (time roughly doubles) and engine size; at run time each profile in use has its own execution
    context (created when first used), whose activation memory is sized for that profile alone. Below
    max_batch 8 the range is narrow and one profile is built. "single" and "split" force the choice.
    """
    if profiles not in PROFILE_MODES:
        raise EngineError(f"unknown profiles mode {profiles!r}", hint=f"choose one of {', '.join(PROFILE_MODES)}")
    limit = int(config["max_positions"])
    max_batch = _positive("max batch", "--max-batch", max_batch)
    beam = _positive("beam", "--beam", beam)
    if max_src_len is None:
        max_src_len = min(DEFAULT_MAX_SRC_LEN, limit)
    max_src_len = _positive("max source length", "--max-src-len", max_src_len)
    if max_src_len > limit:
        raise EngineError(f"--max-src-len {max_src_len} exceeds the model's max_positions ({limit}): "
                          "the graphs cannot take longer sources", hint=f"pass --max-src-len <= {limit}")
    if max_tgt_len is None:
        max_tgt_len = min(max_src_len + DEFAULT_TGT_MARGIN, limit)
    max_tgt_len = _positive("max target length", "--max-tgt-len", max_tgt_len)
    if max_tgt_len > limit:
        raise EngineError(f"--max-tgt-len {max_tgt_len} exceeds the model's max_positions ({limit}): "
                          "decoding never needs a cache longer than that", hint=f"pass --max-tgt-len <= {limit}")
    opt_batch = max(1, max_batch // 2) if opt_batch is None else _positive("opt batch", "--opt-batch", opt_batch)
    opt_src_len = max(1, max_src_len // 2) if opt_src_len is None else _positive("opt source length", "--opt-src-len", opt_src_len)
    opt_tgt_len = max(1, max_tgt_len // 2) if opt_tgt_len is None else _positive("opt target length", "--opt-tgt-len", opt_tgt_len)
    for name, opt, mx, flag in (("--opt-batch", opt_batch, max_batch, "--max-batch"),
                                ("--opt-src-len", opt_src_len, max_src_len, "--max-src-len"),
                                ("--opt-tgt-len", opt_tgt_len, max_tgt_len, "--max-tgt-len")):
        if opt > mx:
            raise EngineError(f"{name} {opt} is larger than {flag} {mx}", hint=f"pass {name} <= {mx}")
    split = profiles == "split" or (profiles == "auto" and max_batch >= SPLIT_MIN_BATCH)
    if split and max_batch <= SMALL_BATCH:
        raise EngineError(f"--profiles split needs --max-batch > {SMALL_BATCH} (got {max_batch})",
                          hint="use --profiles single or auto")
    src = AxisRange(1, opt_src_len, max_src_len)
    cache = AxisRange(1, opt_tgt_len, max_tgt_len)
    if not split:
        enc = (ProfileSpec("all", AxisRange(1, opt_batch, max_batch), src),)
        step = (ProfileSpec("all", AxisRange(1, opt_batch * beam, max_batch * beam), src, cache),)
    else:
        small_opt = opt_batch if opt_batch <= SMALL_BATCH else 1
        large_opt = opt_batch if opt_batch > SMALL_BATCH else _clamp(max_batch // 2, SMALL_BATCH + 1, max_batch)
        enc = (
            ProfileSpec("latency", AxisRange(1, small_opt, SMALL_BATCH), src),
            ProfileSpec("throughput", AxisRange(SMALL_BATCH + 1, large_opt, max_batch), src),
        )
        step = (
            ProfileSpec("latency", AxisRange(1, small_opt * beam, SMALL_BATCH * beam), src, cache),
            ProfileSpec("throughput", AxisRange(SMALL_BATCH * beam + 1, large_opt * beam, max_batch * beam), src, cache),
        )
    limits = {"max_batch": max_batch, "beam": beam, "max_rows": max_batch * beam, "max_src_len": max_src_len,
              "max_tgt_len": max_tgt_len, "opt_batch": opt_batch, "opt_src_len": opt_src_len,
              "opt_tgt_len": opt_tgt_len, "profiles": profiles, "max_positions": limit}
    return EnginePlan(limits, enc, step)


def graph_inputs(graph: str, config: dict[str, Any]) -> list[contract.TensorSpec]:
    n = config["decoder_layers"]
    return contract.encoder_inputs() if graph == "encoder" else contract.step_inputs(n)


def graph_outputs(graph: str, config: dict[str, Any]) -> list[contract.TensorSpec]:
    n = config["decoder_layers"]
    return contract.encoder_outputs(n) if graph == "encoder" else contract.step_outputs(n)


def profile_shapes(spec: ProfileSpec, graph: str, config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """{input name: (min shape, opt shape, max shape)} of one profile, per the contract's axes."""
    fixed = contract.static_axis_sizes(config)
    ranges = {"batch": spec.batch, "src_len": spec.src_len, "cache_len": spec.cache_len}
    out = {}
    for t in graph_inputs(graph, config):
        shapes = []
        for k in range(3):
            dims = []
            for axis in t.axes:
                if axis in fixed:
                    dims.append(fixed[axis])
                else:
                    r = ranges[axis]
                    if r is None:
                        raise EngineError(f"profile {spec.name!r} has no {axis} range, which {graph} input {t.name} needs")
                    dims.append((r.min, r.opt, r.max)[k])
            shapes.append(tuple(dims))
        out[t.name] = tuple(shapes)
    return out


def choose_chunks(rows: int, profiles: Sequence[ProfileSpec], src_len: int,
                  cache_len: int | None = None) -> list[tuple[int, int, int]]:
    """Split `rows` batch rows into runs the profiles accept: [(start, stop, profile index)].

    Rows are independent in both graphs, so a batch larger than every profile's max batch is run in
    chunks of that max (and the remainder). src_len and cache_len cannot be split: outside every
    profile's range they are an EngineError naming the build flag to raise. Among the profiles that
    accept a chunk, the one whose opt batch is nearest is used (ties: the first).
    """
    if rows < 1:
        raise EngineError(f"cannot run a batch of {rows} rows")
    fits = [i for i, p in enumerate(profiles) if p.src_len.contains(src_len)
            and (cache_len is None or p.cache_len is None or p.cache_len.contains(cache_len))]
    if not fits:
        src_max = max(p.src_len.max for p in profiles)
        if src_len > src_max:
            raise EngineError(f"a source of {src_len} tokens is longer than the engines were built for ({src_max})",
                              hint=f"rebuild with transduce build ... --max-src-len {src_len} --force, or shorten the input")
        src_min = min(p.src_len.min for p in profiles)
        if src_len < src_min:  # no rebuild flag helps: the profiles start at 1 unless hand-made
            raise EngineError(f"a source of {src_len} tokens is shorter than every profile takes ({src_min})")
        cache_max = max(p.cache_len.max for p in profiles if p.cache_len is not None)
        raise EngineError(f"decoding needs a cache of {cache_len} positions, more than the engines were built for "
                          f"({cache_max})",
                          hint=f"rebuild with transduce build ... --max-tgt-len {cache_len} --force, or decode with a "
                               "smaller --max-len-b")
    chunks = []
    start = 0
    biggest = max(profiles[i].batch.max for i in fits)
    while start < rows:
        n = min(biggest, rows - start)
        while True:
            accepting = [i for i in fits if profiles[i].batch.contains(n)]
            if accepting:
                break
            smaller = [profiles[i].batch.max for i in fits if profiles[i].batch.max < n]
            if not smaller:
                raise EngineError(f"no optimization profile accepts a batch of {n} rows "
                                  f"(profiles: {[p.to_dict() for p in profiles]})")
            n = max(smaller)
        best = min(accepting, key=lambda i: (abs(n - profiles[i].batch.opt), i))
        chunks.append((start, start + n, best))
        start += n
    return chunks


def _shape_str(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape)


def ort_tensorrt_profile_options(spec: ProfileSpec, graph: str, config: dict[str, Any]) -> dict[str, str]:
    """ONNX Runtime TensorRT execution provider options giving it one explicit profile for `graph`.

    Without trt_profile_{min,opt,max}_shapes the TensorRT EP builds an engine for the first shapes it
    sees and rebuilds whenever a later input falls outside them: with our cache_len and batch changing
    during a decode that is a rebuild per new shape. Format: "name:AxBxC,name2:...".
    """
    shapes = profile_shapes(spec, graph, config)
    return {
        f"trt_profile_{which}_shapes": ",".join(f"{name}:{_shape_str(s[k])}" for name, s in shapes.items())
        for k, which in enumerate(("min", "opt", "max"))
    }


# -- runtime identity (TensorRT version, GPU) ----------------------------------------------------


@dataclass(frozen=True)
class RuntimeInfo:
    """What a plan must match to be loaded: the TensorRT version and the GPU."""

    tensorrt_version: str
    gpu_name: str
    compute_capability: str  # "major.minor"


def import_tensorrt():
    """`import tensorrt`, or BackendUnavailable with the reason and the pip hint."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise BackendUnavailable(f"TensorRT is not installed here ({e})", hint=GPU_HINT) from None
    except OSError as e:  # the wheel is there but libnvinfer or CUDA libraries are not loadable
        raise BackendUnavailable(f"TensorRT is installed but cannot be loaded ({e})", hint=GPU_HINT) from None
    version = str(getattr(trt, "__version__", "0"))
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 0
    if major < MIN_TENSORRT_MAJOR:
        raise BackendUnavailable(f"TensorRT {version} is too old: transduce needs TensorRT >= {MIN_TENSORRT_MAJOR} "
                                 "(strongly typed networks, the tensor-address execution API)", hint=GPU_HINT)
    return trt


def device_index(device: int | str | None) -> int:
    """0 for None/"cuda", N for "cuda:N" or N."""
    if device is None:
        return 0
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise BackendUnavailable(f"CUDA device {device} does not exist", hint="use --device cuda or cuda:N, N >= 0")
        return device
    from transduce._devices import parse_device

    try:  # the one spelling check
        kind, index = parse_device(str(device), error=BackendUnavailable)
    except BackendUnavailable:
        kind = index = None
    if kind != "cuda":
        raise BackendUnavailable(f"TensorRT runs on CUDA devices only, not {device!r}", hint="use --device cuda or cuda:N")
    return index or 0


def gpu_info(device: int | str | None = 0) -> dict[str, Any]:
    """Name, compute capability and memory of a CUDA device (torch.cuda.get_device_properties)."""
    try:
        import torch
    except ImportError:
        raise BackendUnavailable("TensorRT engines need PyTorch with CUDA here (for the GPU and device memory)",
                                 hint=GPU_HINT) from None
    if not torch.cuda.is_available():
        raise BackendUnavailable("no CUDA GPU is available to PyTorch here; TensorRT engines are built and run on one",
                                 hint=GPU_HINT + " (or decode with --backend onnxruntime on CPU)")
    idx = device_index(device)
    if idx >= torch.cuda.device_count():  # torch would raise a bare AssertionError
        raise BackendUnavailable(f"there is no CUDA device {idx}: PyTorch sees {torch.cuda.device_count()}",
                                 hint="use --device cuda, or cuda:N with N below that count (CUDA_VISIBLE_DEVICES decides which)")
    p = torch.cuda.get_device_properties(idx)
    uuid = getattr(p, "uuid", None)
    return {"name": p.name, "compute_capability": f"{p.major}.{p.minor}", "index": idx,
            "total_memory_gb": round(p.total_memory / 2**30, 1), "uuid": str(uuid) if uuid is not None else None,
            "cuda": torch.version.cuda}


def select_gpu(device: int | str | None = 0) -> dict[str, Any]:
    """Make `device` the current CUDA device (TensorRT builds and runs on the current one); -> gpu_info."""
    info = gpu_info(device)
    import torch

    torch.cuda.set_device(info["index"])
    return info


def current_runtime(device: int | str | None = 0, trt=None) -> RuntimeInfo:
    trt = trt or import_tensorrt()
    gpu = gpu_info(device)
    return RuntimeInfo(str(trt.__version__), gpu["name"], gpu["compute_capability"])


def compatibility_problems(meta: dict[str, Any], runtime: RuntimeInfo) -> list[str]:
    """Why a plan described by engine.json cannot be loaded on `runtime` (empty: it can). Pure.

    A serialized TensorRT plan is specific to the TensorRT version that built it (unless built
    version-compatible, which transduce does not do: the lean runtime is slower) and to the GPU:
    kernels are compiled for one compute capability and tactics timed on one model, so both the
    compute capability and the GPU name must match.
    """
    problems = []
    built = str(meta.get("tensorrt", {}).get("version"))
    if built != runtime.tensorrt_version:
        problems.append(f"it was built with TensorRT {built} and this is TensorRT {runtime.tensorrt_version} "
                        "(a plan loads only in the TensorRT version that built it)")
    gpu = meta.get("gpu", {})
    cc, name = str(gpu.get("compute_capability")), str(gpu.get("name"))
    if cc != runtime.compute_capability:
        problems.append(f"it was built for compute capability {cc} ({name}) and this GPU, {runtime.gpu_name}, "
                        f"has compute capability {runtime.compute_capability}")
    elif name != runtime.gpu_name:
        problems.append(f"it was built on a {name} and this GPU is a {runtime.gpu_name} (TensorRT times and picks "
                        "kernels for one GPU model)")
    return problems


def rebuild_command(engine_dir: str, meta: dict[str, Any] | None = None) -> str:
    """The command that rebuilds `engine_dir`: from the recorded artifact, or from the engine dir itself."""
    artifact = (meta or {}).get("artifact")
    artifact = artifact.get("path") if isinstance(artifact, dict) else None
    if not isinstance(artifact, str) or not artifact or not os.path.isfile(os.path.join(artifact, contract.MANIFEST_FILE)):
        artifact = engine_dir if os.path.isfile(os.path.join(engine_dir, contract.MANIFEST_FILE)) else "ARTIFACT_DIR"
    return f"transduce build {artifact} --out {engine_dir} --force"


def _refuse(engine_dir: str, meta: dict[str, Any] | None, what: str) -> ArtifactError:
    return ArtifactError(f"engine directory {engine_dir!r}: {what}",
                         hint=f"rebuild the engines with: {rebuild_command(engine_dir, meta)}")


def read_engine_manifest(engine_dir: str | os.PathLike, check_runtime: bool = True, verify_hashes: bool = True,
                         runtime: RuntimeInfo | None = None, device: int | str | None = 0) -> dict[str, Any]:
    """Read and check ENGINE_DIR/engine.json; raise ArtifactError naming the rebuild command.

    Checks, in order: the directory and engine.json exist and parse; kind and engine format version;
    the contract version; every file engine.json lists exists with its size (and sha256 unless
    verify_hashes=False), the plans included; the copied artifact manifest is a valid artifact of the
    same contract version whose graphs are the ones the plans were built from; then, with
    check_runtime, that this TensorRT version and this GPU are the ones the plans were built for
    (`runtime` injects them; by default they are read from tensorrt and torch.cuda for `device`, the GPU
    that will run the plans, which raises BackendUnavailable where either is missing).
    """
    engine_dir = os.path.abspath(os.fspath(engine_dir))
    path = os.path.join(engine_dir, ENGINE_MANIFEST)
    require_directory(engine_dir, ArtifactError, "a TensorRT engine directory", "engine directory",
                      "give the directory transduce build wrote (--out)",
                      f"build one with: transduce build ARTIFACT_DIR --out {engine_dir}")
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(engine_dir, contract.MANIFEST_FILE)):
            raise ArtifactError(f"{engine_dir!r} is an exported artifact, not a TensorRT engine directory",
                                hint=f"build engines from it with: transduce build {engine_dir} --out ENGINE_DIR, "
                                     "then decode with --backend tensorrt ENGINE_DIR")
        if contract.is_model_dir(engine_dir):
            raise ArtifactError(f"{engine_dir!r} is a model directory, not a TensorRT engine directory",
                                hint=f"export it, then build engines: transduce export {engine_dir} ARTIFACT_DIR && "
                                     "transduce build ARTIFACT_DIR --out ENGINE_DIR")
        raise ArtifactError(f"{path} is missing: {engine_dir!r} is not a TensorRT engine directory",
                            hint="build one with: transduce build ARTIFACT_DIR --out ENGINE_DIR")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise _refuse(engine_dir, None, f"{ENGINE_MANIFEST} is unreadable or not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("kind") != ENGINE_KIND:
        raise _refuse(engine_dir, None, f"{ENGINE_MANIFEST} is not a transduce engine manifest")
    if meta.get("engine_format_version") != ENGINE_FORMAT_VERSION:
        raise _refuse(engine_dir, meta, f"it has engine format version {meta.get('engine_format_version')}; "
                                        f"this transduce reads version {ENGINE_FORMAT_VERSION}")
    if meta.get("contract_version") != contract.CONTRACT_VERSION:
        raise _refuse(engine_dir, meta, f"it was built for IO contract version {meta.get('contract_version')}; "
                                        f"this transduce uses version {contract.CONTRACT_VERSION}")
    for key in ("artifact", "tensorrt", "gpu", "profiles"):  # what the checks below and the backend read
        if not isinstance(meta.get(key), dict):
            raise _refuse(engine_dir, meta, f"{ENGINE_MANIFEST} has no {key!r} record (an object), or another kind of value")
    files = meta.get("files")
    required = {ENCODER_PLAN, STEP_PLAN, contract.MANIFEST_FILE, contract.ENCODER_FILE, contract.STEP_FILE}
    if not isinstance(files, dict) or not required <= set(files):
        raise _refuse(engine_dir, meta, f"{ENGINE_MANIFEST} does not list {sorted(required)}")
    for name, info in files.items():
        problem = contract.listed_file_problem(engine_dir, name, info, verify_hashes, listed_in=ENGINE_MANIFEST,
                                               changed="after the build")
        if problem:
            raise _refuse(engine_dir, meta, problem)
    try:  # the backend chooses its profiles from this record
        plan = plan_from_meta(meta)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, EngineError) as e:
        raise _refuse(engine_dir, meta, f"{ENGINE_MANIFEST} has an unreadable profiles record ({type(e).__name__}: {e})") from None
    if not (plan.encoder and plan.decoder_step) or any(p.cache_len is None for p in plan.decoder_step):
        raise _refuse(engine_dir, meta, f"{ENGINE_MANIFEST} records no encoder or no decoder step profiles, or a step "
                                        "profile without its cache length")
    sources = meta.get("sources")
    if not isinstance(sources, dict) or not all(isinstance(v, dict) for v in sources.values()):
        raise _refuse(engine_dir, meta, f"{ENGINE_MANIFEST} does not record the graphs the plans were built from")
    try:
        artifact = contract.read_manifest(engine_dir, verify_hashes=False)
    except ArtifactError as e:
        raise _refuse(engine_dir, meta, f"its copy of the artifact is not usable ({e.args[0]})") from None
    for graph, (onnx_name, _) in GRAPHS.items():
        want = sources.get(onnx_name, {}).get("sha256")
        have = artifact["files"].get(onnx_name, {}).get("sha256")
        if not want or want != have:
            raise _refuse(engine_dir, meta, f"{contract.MANIFEST_FILE} describes another {onnx_name} than the one "
                                            f"{graph} was built from")
    if artifact.get("precision") != meta.get("precision"):
        raise _refuse(engine_dir, meta, f"engine precision {meta.get('precision')} differs from the artifact's "
                                        f"{artifact.get('precision')}")
    if check_runtime:
        runtime = runtime or current_runtime(device)
        problems = compatibility_problems(meta, runtime)
        if problems:
            raise _refuse(engine_dir, meta, "cannot be loaded here: " + "; ".join(problems))
    return meta


# -- building (TensorRT; runs only where TensorRT and a GPU are) ---------------------------------


def _check_destination(artifact_dir: str, out_dir: str, force: bool) -> bool:
    """Refuse an --out that cannot take the engines; -> whether it replaces an existing engine directory."""
    real_out, real_art = os.path.realpath(out_dir), os.path.realpath(artifact_dir)
    out_is_engine = os.path.isfile(os.path.join(out_dir, ENGINE_MANIFEST))
    if real_out == real_art and not out_is_engine:
        raise EngineError(f"the output directory {out_dir!r} is the artifact directory",
                          hint="choose another --out directory for the engines")
    if real_art.startswith(real_out + os.sep):
        raise EngineError(f"the output directory {out_dir!r} contains the artifact {artifact_dir!r}",
                          hint="choose another --out directory for the engines")
    if real_out.startswith(real_art + os.sep):
        raise EngineError(f"the output directory {out_dir!r} is inside the artifact {artifact_dir!r} (exporting the "
                          "artifact again would delete the engines)", hint="choose an --out directory beside the artifact")
    check_creatable(real_out, EngineError, f"the output directory {out_dir!r}")  # nothing is created yet
    return check_replaceable(out_dir, force, is_engine_dir, "an engine directory", "engine directories", EngineError,
                             "--out directory")


def is_engine_dir(directory: str) -> bool:
    """Whether transduce build wrote directory (its engine.json says so, or is damaged beside a plan)."""
    return marked_as(directory, ENGINE_MANIFEST, "kind", ENGINE_KIND, ENCODER_PLAN)


def _network_flags(trt) -> int:
    """STRONGLY_TYPED: required on TensorRT 10 for graph-defined precision, ignored (always on) in 11."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if flag is None:
        raise BackendUnavailable(f"TensorRT {trt.__version__} has no strongly typed networks", hint=GPU_HINT)
    return 1 << int(flag)


_PROCESS_LOGGERS: dict[int, Any] = {}  # id(tensorrt module) -> (module, the process's one trt.ILogger)
_PROCESS_LOGGERS_LOCK = threading.Lock()


class TrtLog:
    """What one build or one backend sees of TensorRT's log: the errors logged while it lives (for
    EngineError messages) and `log`, where warnings and errors go. TensorRT keeps a single logger for
    the whole process (a second builder or runtime given another one keeps the first and warns), so every
    builder, parser and runtime here gets the same trt.ILogger, `ilogger`, which hands each message to
    every live TrtLog; with two of them alive at once (a build, then a backend, in one process) each also
    sees the other's messages."""

    def __init__(self, ilogger, log: Log):
        self.ilogger = ilogger
        self.log = log
        self.errors: collections.deque[str] = collections.deque(maxlen=64)

    def recent(self, n: int = 8) -> str:
        with self.ilogger.lock:
            return "\n".join(list(self.errors)[-n:])


def _process_logger(trt):
    with _PROCESS_LOGGERS_LOCK:
        entry = _PROCESS_LOGGERS.get(id(trt))
        if entry is not None and entry[0] is trt:
            return entry[1]

        class _Logger(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)
                self.views: weakref.WeakSet[TrtLog] = weakref.WeakSet()
                self.lock = threading.Lock()

            def log(self, severity, msg):  # called from TensorRT's threads; must not raise
                try:
                    sev = trt.ILogger.Severity
                    error = severity in (sev.ERROR, sev.INTERNAL_ERROR)
                    if not error and severity != sev.WARNING:
                        return
                    with self.lock:
                        views = list(self.views)
                        for view in views:
                            if error:
                                view.errors.append(str(msg))
                except Exception:  # noqa: BLE001 - an exception here would abort TensorRT
                    return
                for view in views:  # one sink failing (a closed pipe) must not keep it from the others
                    try:
                        view.log(f"[tensorrt] {'error' if error else 'warning'}: {msg}")
                    except Exception:  # noqa: BLE001
                        pass

        logger = _Logger()
        _PROCESS_LOGGERS[id(trt)] = (trt, logger)
        return logger


def make_logger(trt, log: Log) -> TrtLog:
    """A TrtLog on the process's TensorRT logger: pass its `ilogger` to trt.Builder / OnnxParser / Runtime."""
    ilogger = _process_logger(trt)
    view = TrtLog(ilogger, log)
    with ilogger.lock:
        ilogger.views.add(view)
    return view


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


def parser_errors(parser) -> list[str]:
    """Every error of a trt.OnnxParser, with node index, name and operator where this TensorRT has them."""
    out = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        parts = []
        with contextlib.suppress(Exception):
            if e.node() >= 0:  # -1: an error of the whole graph, not of one node
                parts.append(f"node {e.node()}")
        for attr, fmt in (("node_name", "{!r}"), ("node_operator", "op {}")):
            fn = getattr(e, attr, None)
            if fn is not None:
                with contextlib.suppress(Exception):
                    v = fn()
                    if v:
                        parts.append(fmt.format(v))
        code = ""
        with contextlib.suppress(Exception):
            c = e.code()
            code = str(getattr(c, "name", None) or c).split(".")[-1]
        where = ", ".join(parts) if parts else "the graph"
        out.append(f"{where}{f' [{code}]' if code else ''}: {e.desc()}")
    return out


def _dtype_name(dt) -> str:
    """trt.DataType -> contract dtype name (float32, float16, bfloat16, int64, int32, bool)."""
    name = getattr(dt, "name", str(dt)).split(".")[-1].upper()
    return {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32",
            "BOOL": "bool", "INT8": "int8", "UINT8": "uint8"}.get(name, name.lower())


def check_io(names_dtypes: dict[str, str], specs: list[contract.TensorSpec], precision: str, what: str) -> list[str]:
    """Problems of a network's or engine's IO ({name: dtype}) against the contract's specs. Pure."""
    problems = []
    want = {s.name: contract.resolve_dtype(s, precision) for s in specs}
    missing = sorted(set(want) - set(names_dtypes))
    extra = sorted(set(names_dtypes) - set(want))
    if missing:
        problems.append(f"{what} lacks {missing}")
    if extra:
        problems.append(f"{what} has unexpected tensors {extra}")
    for name in sorted(set(want) & set(names_dtypes)):
        if names_dtypes[name] != want[name]:
            problems.append(f"{what} {name} is {names_dtypes[name]}, the contract says {want[name]} ({precision})")
    return problems


def _network_io(network) -> tuple[dict[str, str], dict[str, str]]:
    ins = {network.get_input(i).name: _dtype_name(network.get_input(i).dtype) for i in range(network.num_inputs)}
    outs = {network.get_output(i).name: _dtype_name(network.get_output(i).dtype) for i in range(network.num_outputs)}
    return ins, outs


def engine_io(trt, engine) -> tuple[dict[str, str], dict[str, str]]:
    """({input: dtype}, {output: dtype}) of a deserialized engine (num_io_tensors, get_tensor_name/mode/dtype)."""
    ins, outs = {}, {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        mode = engine.get_tensor_mode(name)
        (ins if mode == trt.TensorIOMode.INPUT else outs)[name] = _dtype_name(engine.get_tensor_dtype(name))
    return ins, outs


def check_engine(trt, engine, graph: str, config: dict[str, Any], precision: str,
                 profiles: Sequence[ProfileSpec]) -> list[str]:
    """Problems of a deserialized engine against the contract and the profiles it should have."""
    ins, outs = engine_io(trt, engine)
    problems = check_io(ins, graph_inputs(graph, config), precision, f"{graph} engine input")
    problems += check_io(outs, graph_outputs(graph, config), precision, f"{graph} engine output")
    for t in graph_outputs(graph, config):  # the runtime sizes its output buffers by the contract
        if t.name not in outs:
            continue
        have = tuple(int(d) for d in engine.get_tensor_shape(t.name))  # -1 on dynamic axes
        dims = contract.axis_dims(t, config)  # dynamic axes by name
        if len(have) != len(dims) or any(isinstance(w, int) and h != w for h, w in zip(have, dims)):
            problems.append(f"{graph} engine output {t.name} has shape {have}, the contract says {dims}")
    if engine.num_optimization_profiles != len(profiles):
        problems.append(f"{graph} engine has {engine.num_optimization_profiles} optimization profiles, "
                        f"engine.json describes {len(profiles)}")
        return problems
    for i, spec in enumerate(profiles):
        for name, want in profile_shapes(spec, graph, config).items():
            if name not in ins:
                continue
            have = tuple(tuple(int(d) for d in s) for s in engine.get_tensor_profile_shape(name, i))
            if have != want:
                problems.append(f"{graph} engine profile {i} ({spec.name}) has {name} min/opt/max {have}, "
                                f"engine.json says {want}")
    return problems


def _read_timing_cache(path: str | None, log: Log) -> bytes:
    if not path or not os.path.isfile(path):
        return b""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        log(f"timing cache {path} is unreadable ({e}); starting from an empty cache")
        return b""
    log(f"timing cache: loaded {len(data):,} bytes from {path}")
    return data


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
        return "link"
    except OSError:
        shutil.copy2(src, dst)
        return "copy"


def _file_entries(directory: str, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in sorted(names):
        path = os.path.join(directory, name)
        out[name] = contract.file_entry(path)
    return out


def _tool_versions(trt) -> dict[str, str]:
    import platform

    import transduce

    versions = {"transduce": transduce.__version__, "tensorrt": str(trt.__version__), "python": platform.python_version()}
    with contextlib.suppress(Exception):
        import torch

        versions["torch"] = torch.__version__
        versions["cuda"] = str(torch.version.cuda)
    return versions


def build_engines(artifact_dir: str | os.PathLike, out_dir: str | os.PathLike, max_batch: int = DEFAULT_MAX_BATCH,
                  max_src_len: int | None = None, max_tgt_len: int | None = None, opt_batch: int | None = None,
                  opt_src_len: int | None = None, opt_tgt_len: int | None = None, beam: int = DEFAULT_BEAM,
                  workspace_gb: float = DEFAULT_WORKSPACE_GB, timing_cache: str | os.PathLike | None = None,
                  force: bool = False, profiles: str = "auto", tf32: bool = False, device: int | str = 0,
                  progress: bool = True, log: Log | None = None, *, _trt=None,
                  _gpu: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build encoder.plan and decoder_step.plan for an artifact into OUT_DIR; -> engine.json's content.

    See the module docstring. Raises ArtifactError for a bad artifact, EngineError for bad limits, a
    parser or build failure or an unusable output path, BackendUnavailable without TensorRT or a GPU.
    Limits are checked before TensorRT is imported, so argument errors show on any machine.
    `_trt` and `_gpu` inject a TensorRT module and GPU description (tests only).
    """
    log = log or _quiet
    t_start = time.perf_counter()
    artifact_dir, out_dir = os.path.abspath(os.fspath(artifact_dir)), os.path.abspath(os.fspath(out_dir))
    manifest = contract.read_manifest(artifact_dir, verify_hashes=True)
    config, precision = manifest["model"], manifest["precision"]
    if contract.quantization(manifest):
        raise EngineError(f"{artifact_dir} has {contract.quantization(manifest)} graphs for ONNX Runtime's CPU provider "
                          "(transduce export --quantize); TensorRT engines are built from an unquantized export",
                          hint=f"transduce export MODEL_DIR OUT_DIR --precision {precision} (without --quantize), then build from it")
    replaces = _check_destination(artifact_dir, out_dir, force)  # an existing engine directory (not an empty one)
    plan = derive_profiles(config, max_batch=max_batch, beam=beam, max_src_len=max_src_len, max_tgt_len=max_tgt_len,
                           opt_batch=opt_batch, opt_src_len=opt_src_len, opt_tgt_len=opt_tgt_len, profiles=profiles)
    if not (isinstance(workspace_gb, (int, float)) and math.isfinite(workspace_gb) and workspace_gb > 0):
        raise EngineError(f"--workspace-gb must be a number > 0, got {workspace_gb}", hint="for example --workspace-gb 4")
    timing_cache = os.path.abspath(os.fspath(timing_cache)) if timing_cache else None
    if timing_cache:  # before the builds, not after them
        if os.path.isdir(timing_cache):
            raise EngineError(f"--timing-cache {timing_cache!r} is a directory",
                              hint="give a file path, e.g. --timing-cache runs/trt.cache")
        check_creatable(timing_cache, EngineError, f"--timing-cache {timing_cache!r}")
        out_real = os.path.realpath(out_dir)
        if os.path.commonpath([os.path.realpath(timing_cache), out_real]) == out_real:
            # written while the new directory is still being built: it would make --out appear during the
            # run (the build then discarded) or land in the engine directory this build replaces
            raise EngineError(f"--timing-cache {timing_cache!r} is inside --out {out_dir!r}",
                              hint="keep it outside the engine directory, e.g. --timing-cache runs/trt.cache")
    device_index(device)  # its spelling, before TensorRT is looked for
    trt = _trt or import_tensorrt()
    gpu = _gpu or select_gpu(device)
    logger = make_logger(trt, log)
    for graph, specs in (("encoder", plan.encoder), ("decoder_step", plan.decoder_step)):
        log(f"{graph}: " + "; ".join(f"profile {p.name}: " + ", ".join(
            f"{axis} {r.min}/{r.opt}/{r.max}" for axis, r in (("batch", p.batch), ("src_len", p.src_len),
                                                               ("cache_len", p.cache_len)) if r is not None)
            for p in specs))
    with atomic_output(out_dir, replaces, EngineError, "the engine directory",
                       hint="choose an --out path you can write to, on a disk with space") as tmp:
        builder = trt.Builder(logger.ilogger)
        cache_bytes = _read_timing_cache(timing_cache, log)
        timing = None
        cache_loaded = bool(cache_bytes)
        cache_rejected = ""  # why TensorRT refused the file's cache: then the file is kept, not overwritten
        graphs_meta: dict[str, Any] = {}
        keep_alive = []  # parsers own the weights until the build is done
        for graph, (onnx_name, plan_name) in GRAPHS.items():
            onnx_path = os.path.join(artifact_dir, onnx_name)
            network = builder.create_network(_network_flags(trt))
            parser = trt.OnnxParser(network, logger.ilogger)
            keep_alive += [network, parser]
            log(f"{graph}: parsing {onnx_name}")
            if not parser.parse_from_file(onnx_path):
                errors = parser_errors(parser) or [logger.recent() or "no error reported"]
                raise EngineError(f"TensorRT's ONNX parser rejected {onnx_path} ({len(errors)} error(s)):\n  "
                                  + "\n  ".join(errors),
                                  hint="re-export the artifact (transduce export ... --force); if it persists, "
                                       "the graph uses an operator or type this TensorRT does not support")
            ins, outs = _network_io(network)
            problems = check_io(ins, graph_inputs(graph, config), precision, f"{onnx_name} input")
            problems += check_io(outs, graph_outputs(graph, config), precision, f"{onnx_name} output")
            if problems:
                raise EngineError(f"{onnx_path} does not follow the IO contract as TensorRT parses it: "
                                  + "; ".join(problems), hint=contract.rebuild_hint(artifact_dir, manifest))
            bconfig = builder.create_builder_config()
            bconfig.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
            if not tf32 and hasattr(trt.BuilderFlag, "TF32"):
                bconfig.clear_flag(trt.BuilderFlag.TF32)
            if timing is None:
                timing = bconfig.create_timing_cache(cache_bytes)
                if timing is None:  # unreadable bytes (a truncated file, another format): no cache object at all
                    log(f"timing cache {timing_cache} is not one this TensorRT can read "
                        f"({logger.recent(1) or 'no error reported'}); starting from an empty one")
                    cache_loaded = False
                    cache_rejected = "is not one this TensorRT can read"
                    timing = bconfig.create_timing_cache(b"")
            if not bconfig.set_timing_cache(timing, False):
                log(f"timing cache {timing_cache} was made on another GPU or TensorRT version; "
                    "starting from an empty one")
                cache_loaded = False
                cache_rejected = "was made on another GPU or TensorRT version"
                timing = bconfig.create_timing_cache(b"")
                bconfig.set_timing_cache(timing, False)
            monitor = None
            if hasattr(trt, "IProgressMonitor"):
                monitor = make_progress_monitor(trt, graph, enabled=progress, log=log)
                bconfig.progress_monitor = monitor
            for spec in plan.profiles(graph):
                profile = builder.create_optimization_profile()
                for name, (mn, opt, mx) in profile_shapes(spec, graph, config).items():
                    profile.set_shape(name, mn, opt, mx)
                if bconfig.add_optimization_profile(profile) < 0:
                    raise EngineError(f"TensorRT rejected optimization profile {spec.to_dict()} of {graph}: "
                                      f"{logger.recent() or 'invalid profile'}")
            log(f"{graph}: building ({precision}, strongly typed, {len(plan.profiles(graph))} profile(s), "
                f"workspace {workspace_gb:g} GB)")
            t0 = time.perf_counter()
            try:
                serialized = builder.build_serialized_network(network, bconfig)
            finally:
                if monitor is not None:
                    monitor.close()
            seconds = time.perf_counter() - t0
            if serialized is None:
                raise EngineError(f"TensorRT could not build {onnx_name}:\n{logger.recent() or 'no error reported'}",
                                  hint="see the TensorRT errors above; a larger --workspace-gb or narrower "
                                       "limits (--max-batch, --max-src-len, --max-tgt-len) may help")
            write_bytes_atomic(os.path.join(tmp, plan_name), serialized)
            del serialized
            graphs_meta[graph] = {"source": onnx_name, "plan": plan_name, "build_seconds": round(seconds, 2),
                                  "profiles": len(plan.profiles(graph))}
            log(f"{graph}: built in {seconds:.1f} s")
        del keep_alive
        if timing_cache and cache_rejected:
            log(f"timing cache: not saved; {timing_cache} {cache_rejected} and is left as it is "
                "(give each GPU and TensorRT version its own --timing-cache file, or delete this one)")
        elif timing_cache and timing is not None:
            try:  # a side product: failing to save it must not throw the engines away
                write_bytes_atomic(timing_cache, timing.serialize())
                log(f"timing cache: saved to {timing_cache}")
            except OSError as e:
                log(f"warning: could not save the timing cache to {timing_cache} ({e}); the engines are kept")
        # the plans must load and match the contract and profiles before they replace anything
        runtime = trt.Runtime(logger.ilogger)
        for graph, (_, plan_name) in GRAPHS.items():
            with open(os.path.join(tmp, plan_name), "rb") as f:
                engine = runtime.deserialize_cuda_engine(f.read())
            if engine is None:
                raise EngineError(f"the freshly built {plan_name} does not deserialize: "
                                  f"{logger.recent() or 'no error reported'}")
            problems = check_engine(trt, engine, graph, config, precision, plan.profiles(graph))
            if problems:
                raise EngineError(f"the built {plan_name} does not match the contract: " + "; ".join(problems))
            del engine
        artifact_files = [contract.MANIFEST_FILE] + sorted(manifest["files"])
        how = {_link_or_copy(os.path.join(artifact_dir, n), os.path.join(tmp, n)) for n in artifact_files}
        files = _file_entries(tmp, artifact_files + [ENCODER_PLAN, STEP_PLAN])
        meta = {
            "kind": ENGINE_KIND,
            "engine_format_version": ENGINE_FORMAT_VERSION,
            "contract_version": contract.CONTRACT_VERSION,
            "precision": precision,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "build_seconds": {"total": round(time.perf_counter() - t_start, 2),
                              **{g: m["build_seconds"] for g, m in graphs_meta.items()}},
            "tensorrt": {"version": str(trt.__version__), "strongly_typed": True, "tf32": bool(tf32),
                         "workspace_gb": workspace_gb, "timing_cache": timing_cache,
                         "timing_cache_loaded": cache_loaded, "version_compatible": False,
                         "hardware_compatibility": "none"},
            "gpu": gpu,
            "limits": plan.limits,
            "profiles": {"encoder": [p.to_dict() for p in plan.encoder],
                         "decoder_step": [p.to_dict() for p in plan.decoder_step]},
            "graphs": graphs_meta,
            "artifact": {"path": artifact_dir, "contract_version": manifest["contract_version"],
                         "precision": precision, "opset": manifest.get("opset"),
                         "manifest_sha256": files[contract.MANIFEST_FILE]["sha256"],
                         "copied_as": "hard links" if how == {"link"} else "copies" if how == {"copy"} else "links and copies"},
            "sources": {onnx: dict(files[onnx]) for onnx, _ in GRAPHS.values()},
            "tools": _tool_versions(trt),
            "files": files,
        }
        write_json(os.path.join(tmp, ENGINE_MANIFEST), meta)
    log(f"wrote {out_dir} in {time.perf_counter() - t_start:.1f} s")
    return meta


def plan_from_meta(meta: dict[str, Any]) -> EnginePlan:
    """The EnginePlan recorded in engine.json."""
    return EnginePlan.from_dict({"limits": meta.get("limits", {}), **meta["profiles"]})


def summary(out_dir: str, meta: dict[str, Any]) -> str:
    """A few lines for the CLI: files and sizes, profiles, versions, time."""
    lines = [f"engines {out_dir} ({meta['precision']}, TensorRT {meta['tensorrt']['version']}, "
             f"{meta['gpu']['name']} sm {meta['gpu']['compute_capability']})"]
    for name in (ENCODER_PLAN, STEP_PLAN):
        lines.append(f"  {name:<20} {meta['files'][name]['bytes']:>12,} bytes")
    for graph in GRAPHS:
        for p in meta["profiles"][graph]:
            axes = ", ".join(f"{a} {v[0]}/{v[1]}/{v[2]}" for a, v in p.items() if a != "name")
            lines.append(f"  {graph:<12} profile {p['name']:<10} {axes}")
    lines.append(f"built in {meta['build_seconds']['total']:.1f} s")
    return "\n".join(lines)
