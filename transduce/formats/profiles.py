"""The optimization profiles of a TensorRT build: derived from the limits a user declares, recorded in
engine.json, and used at run time to split a batch over them. Pure: no TensorRT, no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transduce.errors import EngineError
from transduce.formats.contract import (
    TensorSpec,
    encoder_inputs,
    encoder_outputs,
    static_axis_sizes,
    step_inputs,
    step_outputs,
)
from transduce.formats.model_config import ModelConfig

GRAPH_NAMES = ("encoder", "decoder_step")
PROFILE_MODES = ("auto", "single", "split")
# Default limits (the CLI's): 16 sentences x beam 4 = 64 decoder rows, sources up to 128 tokens (EOS
# included), targets up to max_src_len + 50 (the paper's "input length + 50", decoding.max_lengths).
DEFAULT_MAX_BATCH = 16


DEFAULT_BEAM = 4


DEFAULT_MAX_SRC_LEN = 128


DEFAULT_TGT_MARGIN = 50


# "auto" profiles: a latency profile for up to SMALL_BATCH sentences next to a throughput profile,
# once max_batch is at least SPLIT_MIN_BATCH (below that one profile's range is narrow enough).
SMALL_BATCH = 2


SPLIT_MIN_BATCH = 8


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
        if graph not in GRAPH_NAMES:
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


def derive_profiles(config: ModelConfig, max_batch: int = DEFAULT_MAX_BATCH, beam: int = DEFAULT_BEAM,
                    max_src_len: int | None = None, max_tgt_len: int | None = None, opt_batch: int | None = None,
                    opt_src_len: int | None = None, opt_tgt_len: int | None = None,
                    profiles: str = "auto") -> EnginePlan:
    """The optimization profiles of both engines, from the limits a user declares (pure, no TensorRT).

    Axes (transduce/formats/contract.py): the encoder's batch is sentences; the step graph's batch is
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
    limit = int(config.max_positions)
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
    opt_src_len = (max(1, max_src_len // 2) if opt_src_len is None
                   else _positive("opt source length", "--opt-src-len", opt_src_len))
    opt_tgt_len = (max(1, max_tgt_len // 2) if opt_tgt_len is None
                   else _positive("opt target length", "--opt-tgt-len", opt_tgt_len))
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
            ProfileSpec("throughput", AxisRange(SMALL_BATCH * beam + 1, large_opt * beam, max_batch * beam),
                        src, cache),
        )
    limits = {"max_batch": max_batch, "beam": beam, "max_rows": max_batch * beam, "max_src_len": max_src_len,
              "max_tgt_len": max_tgt_len, "opt_batch": opt_batch, "opt_src_len": opt_src_len,
              "opt_tgt_len": opt_tgt_len, "profiles": profiles, "max_positions": limit}
    return EnginePlan(limits, enc, step)


def graph_inputs(graph: str, config: ModelConfig) -> list[TensorSpec]:
    n = config.decoder_layers
    return encoder_inputs() if graph == "encoder" else step_inputs(n)


def graph_outputs(graph: str, config: ModelConfig) -> list[TensorSpec]:
    n = config.decoder_layers
    return encoder_outputs(n) if graph == "encoder" else step_outputs(n)


def profile_shapes(spec: ProfileSpec, graph: str, config: ModelConfig) -> dict[str, tuple[tuple[int, ...], ...]]:
    """{input name: (min shape, opt shape, max shape)} of one profile, per the contract's axes."""
    fixed = static_axis_sizes(config)
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
                        raise EngineError(f"profile {spec.name!r} has no {axis} range, "
                                          f"which {graph} input {t.name} needs")
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
                              hint=f"rebuild with transduce build ... --max-src-len {src_len} --force, "
                                   "or shorten the input")
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


def ort_tensorrt_profile_options(spec: ProfileSpec, graph: str, config: ModelConfig) -> dict[str, str]:
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


def plan_from_meta(meta: dict[str, Any]) -> EnginePlan:
    """The EnginePlan recorded in engine.json."""
    return EnginePlan.from_dict({"limits": meta.get("limits", {}), **meta["profiles"]})
