"""The IO contract between the exporter, the engine builder and the runtime, written once.

An artifact directory holds two graphs (and optional others) and a manifest (transduce.formats.artifact):

  encoder.onnx       once per batch of sources
    in   src_ids        (batch, src_len)                int64   source token ids, right-padded
         src_lengths    (batch,)                        int64   real tokens per row (EOS included)
    out  memory         (batch, src_len, d_model)       float   encoder output (for parity and inspection)
         cross_key_{i}  (batch, heads, src_len, head_dim) float  decoder layer i's cross-attention K
         cross_value_{i}(batch, heads, src_len, head_dim) float  ... and V, computed here once, never per step

  decoder_step.onnx  one target position for every row; the same graph for every step, the first included
    in   tokens         (batch,)                        int64   the current token of each row (BOS at step 0)
         positions      (batch,)                        int64   its position = number of steps already cached
         src_lengths    (batch,)                        int64   as for the encoder
         past_key_{i}   (batch, heads, cache_len, head_dim) float  self-attention cache of layer i; slots
         past_value_{i} (batch, heads, cache_len, head_dim) float  >= positions[b] are ignored (cache_len >= 1)
         cross_key_{i}, cross_value_{i}                 float   the encoder's outputs (rows expanded for beams)
    out  log_probs      (batch, vocab)                  float32 log-softmax of the next token, always fp32
         new_key_{i}    (batch, heads, 1, head_dim)     float   this step's K and V of layer i, which the
         new_value_{i}  (batch, heads, 1, head_dim)     float   runtime writes into slot positions[b]

  decoder_step.ort.onnx  optional, fp32 post-norm models only: the same step built with ONNX Runtime's
                     contrib ops (fused attention that writes the cache slot itself); ONNX Runtime only,
                     see transduce/exporter/ort_step.py. Artifacts without it decode with decoder_step.onnx.
    in   the step's inputs, except that src_lengths and cross_key_{i}/cross_value_{i} have `sources`
         rows, a divisor of batch: row b attends source b // (batch / sources). With sources = batch
         it is the standard graph's step; beam search passes each sentence's K/V once for its beams.
         topk_k         (1,)                            int64   how many candidates
         topk_bias      (vocab,)                        float32 added to log_probs before the top-k:
                                                                -inf bans an id
    out  log_probs      (batch, vocab)                  float32 as the standard graph's
         present_key_{i}, present_value_{i} (batch, heads, cache_len, head_dim) the cache with slot
                                                positions[b] written; bound onto the input (unbound: slots past
                                                positions[b] undefined)
         topk_values    (batch, k)                      float32 the k best of log_probs + topk_bias
         topk_ids       (batch, k)                      int64   their ids, best first (ties: lower id)

  decoder_step.attn.onnx  optional (artifacts exported before it have none): the standard step graph with
                     one more output, read only when alignments are asked for (decoding without them never
                     runs it)
    in   the standard step's inputs
    out  the standard step's outputs, then
         attention      (batch, layers, src_len)        float32 each decoder layer's cross-attention weights
                                                                averaged over the heads (0 past src_lengths)

"float" is the graph's precision (the manifest's "precision": fp32, fp16 or bf16).

The runtime owns the self-attention cache, preallocated to the batch's longest target: each step the graph
reads the whole buffer (masked by `positions`) and returns only the new position's K/V, which the runtime
writes into slot `position`. Nothing of cache size is allocated or copied per step, and every step has the
same input shapes (an engine's step can be captured in a CUDA graph). Why this layout, and what the
alternatives cost: docs/design/kv-cache.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transduce.formats.dtypes import precision_dtype
from transduce.formats.model_config import ModelConfig

CONTRACT_VERSION = 2  # 2: decoder_step.ort.onnx takes cross K/V per source and outputs the top-k
ENCODER_FILE = "encoder.onnx"
STEP_FILE = "decoder_step.onnx"
ORT_STEP_FILE = "decoder_step.ort.onnx"  # optional: fp32 post-norm models (transduce/exporter/ort_step.py)
# optional, and new within contract version 2: an artifact without it loads and decodes as before, only
# alignments need it (the runtime asks for a re-export then), so the version did not change for it
ATTN_STEP_FILE = "decoder_step.attn.onnx"
# every graph file an export writes (transduce/exporter/onnx_export.py): an artifact must list each it holds
GRAPH_FILES = (ENCODER_FILE, STEP_FILE, ORT_STEP_FILE, ATTN_STEP_FILE)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    axes: tuple[str, ...]  # symbolic axis names, outermost first
    dtype: str  # "int64", "float32", or "float" (the graph's precision)


def _per_layer(prefix: str, axes: tuple[str, ...], n_layers: int) -> list[TensorSpec]:
    specs = []
    for i in range(n_layers):
        specs.append(TensorSpec(f"{prefix}_key_{i}", axes, "float"))
        specs.append(TensorSpec(f"{prefix}_value_{i}", axes, "float"))
    return specs


CROSS_AXES = ("batch", "heads", "src_len", "head_dim")
CACHE_AXES = ("batch", "heads", "cache_len", "head_dim")
NEW_AXES = ("batch", "heads", "one", "head_dim")


def encoder_inputs() -> list[TensorSpec]:
    return [TensorSpec("src_ids", ("batch", "src_len"), "int64"), TensorSpec("src_lengths", ("batch",), "int64")]


def encoder_outputs(decoder_layers: int) -> list[TensorSpec]:
    return [TensorSpec("memory", ("batch", "src_len", "d_model"), "float")] + _per_layer(
        "cross", CROSS_AXES, decoder_layers
    )


def step_inputs(decoder_layers: int) -> list[TensorSpec]:
    return (
        [
            TensorSpec("tokens", ("batch",), "int64"),
            TensorSpec("positions", ("batch",), "int64"),
            TensorSpec("src_lengths", ("batch",), "int64"),
        ]
        + _per_layer("past", CACHE_AXES, decoder_layers)
        + _per_layer("cross", CROSS_AXES, decoder_layers)
    )


def step_outputs(decoder_layers: int) -> list[TensorSpec]:
    return [TensorSpec("log_probs", ("batch", "vocab"), "float32")] + _per_layer("new", NEW_AXES, decoder_layers)


def attn_step_outputs(decoder_layers: int) -> list[TensorSpec]:
    """Outputs of the optional attention step graph: the step's, and every layer's head-averaged
    cross-attention weights."""
    return step_outputs(decoder_layers) + [TensorSpec("attention", ("batch", "layers", "src_len"), "float32")]


def ort_step_inputs(decoder_layers: int) -> list[TensorSpec]:
    """Inputs of the optional ONNX Runtime step graph: the step's, with cross K/V and src_lengths per
    source (a divisor of the rows), and the top-k's k and additive bias."""
    per_source = [TensorSpec(s.name, ("sources",) + s.axes[1:], s.dtype)
                  if s.name == "src_lengths" or s.name.startswith("cross_") else s for s in step_inputs(decoder_layers)]
    return per_source + [TensorSpec("topk_k", ("one",), "int64"), TensorSpec("topk_bias", ("vocab",), "float32")]


def ort_step_outputs(decoder_layers: int) -> list[TensorSpec]:
    """Outputs of the optional ONNX Runtime step graph: log_probs, each layer's cache with slot
    `positions[b]` written (bound onto the input cache buffers, the write happens in place), and the
    top-k of log_probs + topk_bias."""
    return ([TensorSpec("log_probs", ("batch", "vocab"), "float32")] + _per_layer("present", CACHE_AXES, decoder_layers)
            + [TensorSpec("topk_values", ("batch", "k"), "float32"), TensorSpec("topk_ids", ("batch", "k"), "int64")])


def graph_io(graph_file: str, decoder_layers: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of one of the artifact's graph files."""
    if graph_file == ENCODER_FILE:
        return encoder_inputs(), encoder_outputs(decoder_layers)
    if graph_file == STEP_FILE:
        return step_inputs(decoder_layers), step_outputs(decoder_layers)
    if graph_file == ORT_STEP_FILE:
        return ort_step_inputs(decoder_layers), ort_step_outputs(decoder_layers)
    if graph_file == ATTN_STEP_FILE:
        return step_inputs(decoder_layers), attn_step_outputs(decoder_layers)
    raise KeyError(graph_file)


# Axes that vary at run time; the others are fixed by the model config.
DYNAMIC_AXES = ("batch", "src_len", "cache_len")
ORT_STEP_AXES = ("sources", "k")  # the ONNX Runtime step graph's own run-time axes


def dynamic_axis_ranges(config: ModelConfig) -> dict[str, tuple[int, int | None]]:
    """Inclusive (min, max) of each dynamic axis for a model config; max None means unbounded.

    The graphs accept batch >= 1, 1 <= src_len <= max_positions and 1 <= cache_len <= max_positions
    (positions index a table of max_positions rows). The manifest records these as
    "dynamic_axes": {axis: [min, max or null]}.
    """
    p = config.max_positions
    return {"batch": (1, None), "src_len": (1, p), "cache_len": (1, p)}


def static_axis_sizes(config: ModelConfig) -> dict[str, int]:
    """Sizes of the fixed axes for a model config."""
    return {
        "heads": config.n_heads,
        "head_dim": config.head_dim,
        "d_model": config.d_model,
        "vocab": config.vocab_size,
        "layers": config.decoder_layers,
        "one": 1,
    }


def axis_dims(spec: TensorSpec, config: ModelConfig) -> tuple[int | str, ...]:
    """A tensor's dims as a graph declares them: run-time axes by name, fixed ones by size."""
    sizes = static_axis_sizes(config)
    return tuple(a if a in DYNAMIC_AXES + ORT_STEP_AXES else sizes[a] for a in spec.axes)


def resolve_dtype(spec: TensorSpec, precision: str) -> str:
    return precision_dtype(precision) if spec.dtype == "float" else spec.dtype


def _dim_differs(dim: Any, want: int | str) -> bool:
    """Whether a declared dim (size, axis name, -1 or None) is not the contract's fixed size or dynamic axis."""
    if dim is None:
        return False
    dynamic = isinstance(dim, str) or dim < 0
    if isinstance(want, int):
        return dynamic or dim != want
    return not dynamic


def io_mismatches(what: str, got: Sequence[tuple[str, str, Sequence[Any] | None]], specs: Sequence[TensorSpec],
                  precision: str, config: ModelConfig, ordered: bool = True, exact: bool = False) -> list[str]:
    """How the inputs or outputs of a graph or engine (`got`: (name, dtype, dims) triples) differ from the
    contract's `specs` for `precision` and the model config; empty when they agree. `what` names them in the
    messages ("input", "encoder engine output").

    ordered: their order is the contract's too (an ONNX graph's; an engine's IO is a set). dims: as the graph
    declares them, sizes, axis names or -1 for a dynamic axis (TensorRT's spelling); None where not known (not
    compared). exact: every dim as the contract writes it, symbolic axes by name (the exporter's check of what it
    wrote); otherwise each fixed axis of the contract must have its size, and each dynamic one must be dynamic
    (a graph exported for one batch size is refused); the names of dynamic axes are not compared."""
    names, want_names = [g[0] for g in got], [s.name for s in specs]
    missing = [n for n in want_names if n not in names]
    extra = [n for n in names if n not in want_names]
    problems = []
    if missing:
        problems.append(f"{what}s lack {missing}")
    if extra:
        problems.append(f"{what}s have unexpected tensors {extra}")
    if ordered and not problems and names != want_names:
        problems.append(f"{what}s are in the order {names}, the contract says {want_names}")
    by_name = {s.name: s for s in specs}
    for name, dtype, dims in got:
        spec = by_name.get(name)
        if spec is None:
            continue
        want = resolve_dtype(spec, precision)
        if dtype != want:
            problems.append(f"{what} {name} is {dtype}, the contract says {want} ({precision})")
        if dims is None:
            continue
        want_dims = axis_dims(spec, config)
        if exact:
            differ = tuple(dims) != tuple(want_dims)
        else:
            differ = len(dims) != len(want_dims) or any(_dim_differs(d, w) for d, w in zip(dims, want_dims))
        if differ:
            problems.append(f"{what} {name} has dims {list(dims)}, the contract says {list(want_dims)}")
    return problems
