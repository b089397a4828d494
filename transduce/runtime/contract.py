"""The IO contract between the exporter, the engine builder and the runtime, written once.

An artifact directory holds two graphs (and an optional third) and a manifest:

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
                                                                positions[b] written; bound onto the input (unbound: slots past positions[b] undefined)
         topk_values    (batch, k)                      float32 the k best of log_probs + topk_bias
         topk_ids       (batch, k)                      int64   their ids, best first (ties: lower id)

"float" is the graph's precision (manifest "precision": fp32, fp16 or bf16).

Why this cache design. The runtime owns a self-attention cache preallocated to the batch's maximum
target length, (batch, heads, cache_len, head_dim) per layer and per K/V. Each step the graph reads
the whole buffer (masked by `positions`) and returns only the new position's K/V; the runtime writes
those (batch*heads*head_dim values per tensor) into slot `position`. Nothing of cache size is
allocated, concatenated or copied per step, by the graph or by the runtime, except the gather of
rows on a beam reorder. The alternatives:
- Concat inside the graph (Optimum, CTranslate2) returns a new cache of length t+1 each step: a
  full copy of the cache per step and per layer, and a new output allocation each step.
- An in-place max-length buffer updated by the graph needs ONNX TensorScatter (opset 24), which
  ONNX Runtime 1.31 cannot load, or a ScatterND whose output is a new tensor anyway.
- A cache in (cache_len, batch, heads, head_dim) order would let slot t be written by pointer, but
  attention would then transpose the whole cache inside the graph every step.
The cost of this design is that attention scores are computed over cache_len slots instead of the t
filled ones (a (batch, heads, 1, cache_len) product, small next to the projections), and in exchange
every step has the same input shapes, so an engine's step can be captured once in a CUDA graph.
Measured with scripts/cache_layouts.py on 2026-11-22: ONNX Runtime 1.31.1, CPU provider, 2 threads,
random weights, a 20-token source, 40 steps from an empty cache; ms/step as median (min) of 25
interleaved repeats, on a shared 2-core machine at load average ~5 (absolute times are inflated):
                     ours, C=40     ours, C=80     concat (Optimum / CTranslate2)
  tiny, batch 1      1.45 (0.73)    1.39 (0.65)    1.57 (0.85)
  tiny, batch 16     3.03 (2.20)    4.13 (2.65)    3.67 (2.30)
  base, batch 1      24.7 (19.9)    24.4 (20.1)    23.4 (20.1)
  base, batch 16     44.0 (33.2)    49.4 (34.8)    43.7 (34.1)
(tiny: 2+2 layers, d_model 128, 4 heads, d_ff 512, vocab 400; base: 6+6 layers, d_model 512,
8 heads, d_ff 2048, vocab 8000; C is the preallocated capacity.) On CPU the two designs cost the
same within the noise (two earlier runs at similar load agree on that, not on the exact figures):
a step is dominated by the projections and the vocabulary matmul, not by the cache. Scoring masked
slots shows only for the tiny model at batch 16 (C=80 vs C=40). What the design buys is fixed
shapes and no per-step allocation, which matter for TensorRT engines and CUDA graphs, not here.

The manifest (manifest.json) records `contract_version`; the runtime refuses any other version
with a message naming the command that rebuilds the artifact. The exporter
(transduce/exporter/onnx_export.py) also writes: `kind`, `precision`, `opset`, `ort_step_graph` (false:
exported with `--no-ort-step`; absent before 2026-11-25), `model` (the
ModelConfig dict), `source_model` {path, weights_sha256, config_sha256}, `dynamic_axes`
{axis: [min, max or null]} (see dynamic_axis_ranges), `static_axes`, `graphs` {file: inputs,
outputs, op_histogram, ...}, `validation` {engine, tolerances, cases, errors: [{graph, output,
max_abs, max_rel, atol, rtol, passed}]}, `tools`, `export_seconds`, and `files` {name: {sha256,
bytes}} for every other file of the directory (the graphs, any external-data file, and config.json
and tokenizer.json copied from the model directory). An artifact exported with `--quantize int8`
also has `quantization` {method, graphs, ops, bytes (the quantized graphs' sizes), validation (rows
{graph, output, max_abs, rel_rms, rel_rms_limit, passed, worst_case}), ...} (transduce/exporter/quantize.py): its encoder.onnx and
decoder_step.ort.onnx have int8 weights (same IO), for ONNX Runtime's CPU provider only; `graphs`
describes them before quantization.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from transduce.errors import ArtifactError

CONTRACT_VERSION = 2  # 2: decoder_step.ort.onnx takes cross K/V per source and outputs the top-k
ENCODER_FILE = "encoder.onnx"
STEP_FILE = "decoder_step.onnx"
ORT_STEP_FILE = "decoder_step.ort.onnx"  # optional: fp32 post-norm models (transduce/exporter/ort_step.py)
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"  # copied from the model directory; listed, so its hash is checked at load
ARTIFACT_KIND = "transduce-artifact"
PRECISIONS = ("fp32", "fp16", "bf16")
QUANTIZATION_METHODS = ("int8",)  # export --quantize (transduce/exporter/quantize.py)
# numpy / ONNX element type names of the graph's float tensors, per precision
FLOAT_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
ENGINE_MANIFEST_FILE = "engine.json"  # marks an engine directory (transduce build; transduce/exporter/engine.py)


def rebuild_hint(artifact_dir: str, manifest: Any = None) -> str:
    """The hint of a refused artifact: the export command that makes it again with the options it was made
    with (its model, precision, quantization, no fused step graph), as far as a parsed `manifest` tells;
    for an engine directory, which export refuses to replace, the export and then the build."""
    m = manifest if isinstance(manifest, dict) else {}
    source = m.get("source_model")
    model = source.get("path") if isinstance(source, dict) else None
    model = model if isinstance(model, str) and os.path.isdir(model) else "MODEL_DIR"
    options = []
    precision = m.get("precision")
    if precision in PRECISIONS and precision != "fp32":
        options.append(f"--precision {precision}")
    quantized = quantization(m)
    if quantized in QUANTIZATION_METHODS and precision == "fp32":  # another is a hand edit: no option repeats it
        options.append(f"--quantize {quantized}")
    if m.get("ort_step_graph") is False:  # recorded by export since 2026-11-25; older manifests cannot tell
        options.append("--no-ort-step")
    extra = "".join(f" {o}" for o in options)
    if os.path.isfile(os.path.join(artifact_dir, ENGINE_MANIFEST_FILE)):
        return (f"{artifact_dir} is an engine directory: export the model again, then build its engines again: "
                f"transduce export {model} ARTIFACT_DIR --force{extra} && "
                f"transduce build ARTIFACT_DIR --out {artifact_dir} --force")
    return f"rebuild the artifact with: transduce export {model} {artifact_dir} --force{extra}"


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


# Axes that vary at run time; the others are fixed by the model config.
DYNAMIC_AXES = ("batch", "src_len", "cache_len")
ORT_STEP_AXES = ("sources", "k")  # the ONNX Runtime step graph's own run-time axes


def dynamic_axis_ranges(config: dict[str, Any]) -> dict[str, tuple[int, int | None]]:
    """Inclusive (min, max) of each dynamic axis for a model config; max None means unbounded.

    The graphs accept batch >= 1, 1 <= src_len <= max_positions and 1 <= cache_len <= max_positions
    (positions index a table of max_positions rows). The manifest records these as
    "dynamic_axes": {axis: [min, max or null]}.
    """
    p = config["max_positions"]
    return {"batch": (1, None), "src_len": (1, p), "cache_len": (1, p)}


def static_axis_sizes(config: dict[str, Any]) -> dict[str, int]:
    """Sizes of the fixed axes for a model config (a ModelConfig.to_dict())."""
    return {
        "heads": config["n_heads"],
        "head_dim": config["d_model"] // config["n_heads"],
        "d_model": config["d_model"],
        "vocab": config["vocab_size"],
        "one": 1,
    }


def axis_dims(spec: TensorSpec, config: dict[str, Any]) -> tuple[int | str, ...]:
    """A tensor's dims as a graph declares them: run-time axes by name, fixed ones by size."""
    sizes = static_axis_sizes(config)
    return tuple(a if a in DYNAMIC_AXES + ORT_STEP_AXES else sizes[a] for a in spec.axes)


def resolve_dtype(spec: TensorSpec, precision: str) -> str:
    return FLOAT_DTYPE[precision] if spec.dtype == "float" else spec.dtype


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(path: str | os.PathLike) -> dict[str, Any]:
    """{"sha256", "bytes"} of one file: how every manifest (model, artifact, engine) records a file."""
    return {"sha256": sha256_file(path), "bytes": os.path.getsize(path)}


def inside_name(name: Any) -> bool:
    """Whether a file name a manifest lists stays inside its directory: relative, without '..'."""
    return (isinstance(name, str) and bool(name) and not os.path.isabs(name)
            and ".." not in name.replace("\\", "/").split("/"))


def listed_file_problem(directory: str, name: Any, entry: Any, verify_hash: bool = True,
                        listed_in: str = "the manifest", changed: str = "after it was written") -> str | None:
    """Why a file a manifest lists ({name: {"sha256", "bytes"}}) is not what it recorded (None: it is). The
    name must stay inside `directory` (a relative path without '..': a hand-edited manifest must not make
    a reader hash or load /etc/passwd), the entry must carry both fields, and the file must be readable."""
    if not inside_name(name):
        return f"{listed_in} lists {name!r}, which is not a file name inside {directory}"
    if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or not isinstance(entry.get("sha256"), str):
        return f"{listed_in} does not give {name} as {{sha256, bytes}}"
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return f"{path} is missing"
    try:
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            return f"{path} has {size} bytes, {listed_in} says {entry['bytes']}: it was truncated or changed {changed}"
        if verify_hash and sha256_file(path) != entry["sha256"]:
            return f"{path} does not match its sha256 in {listed_in}: it was changed {changed}"
    except OSError as e:
        return f"{path} cannot be read ({e.strerror})"
    return None


def quantization(manifest: dict[str, Any]) -> str | None:
    """The artifact's quantization ("int8": `transduce export --quantize int8`), None if it has none."""
    q = manifest.get("quantization")
    return q.get("method") if isinstance(q, dict) else None


MODEL_FORMAT = "transduce-model"  # config.json's "format" in a model directory (and in an artifact's copy)
MODEL_CONFIG_FILE = "config.json"  # a model directory's config (transduce/models/checkpoint.py)
WEIGHTS_FILE = "model.safetensors"  # ... and its weights


def is_model_dir(directory: str) -> bool:
    """Whether directory looks like a model directory (transduce train): a model's config.json and weights."""
    if not os.path.isfile(os.path.join(directory, WEIGHTS_FILE)):
        return False
    try:
        with open(os.path.join(directory, MODEL_CONFIG_FILE), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and cfg.get("format") == MODEL_FORMAT


def is_artifact_dir(directory: str) -> bool:
    """Whether transduce export wrote directory (its manifest says so, or is damaged beside an encoder.onnx);
    an engine directory, which holds a copy of its artifact's manifest, is one too."""
    from transduce._io import marked_as

    return marked_as(directory, MANIFEST_FILE, "kind", ARTIFACT_KIND, ENCODER_FILE)


def read_manifest(artifact_dir: str | os.PathLike, verify_hashes: bool = True) -> dict[str, Any]:
    """Read and check an artifact's manifest; raise ArtifactError naming the rebuild command."""
    artifact_dir = os.fspath(artifact_dir)
    hint = rebuild_hint(artifact_dir)
    path = os.path.join(artifact_dir, MANIFEST_FILE)
    from transduce._io import require_directory

    require_directory(artifact_dir, ArtifactError, "an artifact directory", "artifact directory",
                      "give the directory transduce export wrote", f"export one with: transduce export MODEL_DIR {artifact_dir}")
    if not os.path.isfile(path):
        if is_model_dir(artifact_dir):
            raise ArtifactError(f"{artifact_dir!r} is a model directory, not an exported artifact",
                                hint=f"export it first: transduce export {artifact_dir} ARTIFACT_DIR, then use ARTIFACT_DIR")
        raise ArtifactError(f"{path} is missing: {artifact_dir!r} is not an exported artifact",
                            hint="export into a new directory: transduce export MODEL_DIR NEW_DIR (--force replaces "
                                 f"only artifacts, and {artifact_dir} has lost its manifest: remove it to reuse its name)"
                            if os.listdir(artifact_dir) else hint)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{path} is unreadable or not JSON ({e})", hint=hint) from None
    if not isinstance(manifest, dict) or manifest.get("kind") != ARTIFACT_KIND:
        raise ArtifactError(f"{path} is not a transduce artifact manifest", hint=hint)
    hint = rebuild_hint(artifact_dir, manifest)
    version = manifest.get("contract_version")
    if type(version) is not int or version != CONTRACT_VERSION:  # a string "2" or 2.0 too: its repr says why
        raise ArtifactError(
            f"{artifact_dir!r} was exported for IO contract version {version!r}; "
            f"this transduce reads version {CONTRACT_VERSION}",
            hint=hint,
        )
    if manifest.get("precision") not in PRECISIONS:
        raise ArtifactError(f"{path}: unknown precision {manifest.get('precision')!r}", hint=hint)
    model = manifest.get("model")
    if not isinstance(model, dict):
        raise ArtifactError(f"{path}: no model config", hint=hint)
    from transduce.errors import ConfigError
    from transduce.models.config import ModelConfig

    missing = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in model]
    if missing:  # the exporter writes every field; a default would guess (an eos_id, say)
        raise ArtifactError(f"{path}: its model config lacks {', '.join(missing)}", hint=hint)
    try:  # and valid: n_heads 0 or an eos_id past the vocabulary would fail later, unnamed
        ModelConfig.from_dict(model)
    except ConfigError as e:
        raise ArtifactError(f"{path}: its model config is not valid: {e}", hint=hint) from None
    files = manifest.get("files")
    if not isinstance(files, dict) or not {ENCODER_FILE, STEP_FILE, TOKENIZER_FILE} <= set(files):
        raise ArtifactError(f"{path} does not list {ENCODER_FILE}, {STEP_FILE} and {TOKENIZER_FILE}", hint=hint)
    for name, meta in files.items():
        problem = listed_file_problem(artifact_dir, name, meta, verify_hashes, listed_in=path, changed="after export")
        if problem:
            raise ArtifactError(problem, hint=hint)
    return manifest


_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
              "tensor(int64)": "int64", "tensor(int32)": "int32"}


def io_mismatches(graph_inputs, graph_outputs, inputs: list[TensorSpec], outputs: list[TensorSpec],
                  precision: str, config: dict[str, Any], exact: bool = False) -> list[str]:
    """How a graph's IO differs from the contract: its inputs and outputs as (name, dtype, dims) triples,
    against the specs for `precision` and the model config. Empty: they agree. exact: every dim as the
    contract writes it, symbolic axes by name (the exporter's check of what it wrote); otherwise the
    fixed sizes both sides state, and no fixed size where the contract has a dynamic axis (a graph exported
    for one batch size); symbolic names are not compared (what ONNX Runtime reports of a loaded graph varies)."""
    problems = []
    for kind, got, specs in (("input", graph_inputs, inputs), ("output", graph_outputs, outputs)):
        names, want_names = [g[0] for g in got], [sp.name for sp in specs]
        if names != want_names:
            problems.append(f"{kind}s are {names}, the contract says {want_names}")
            continue
        for (name, dtype, dims), spec in zip(got, specs):
            want = resolve_dtype(spec, precision)
            if dtype != want:
                problems.append(f"{kind} {name} is {dtype}, the contract says {want}")
            want_dims = axis_dims(spec, config)
            if exact:
                differ = tuple(dims) != tuple(want_dims)
            else:
                differ = len(dims) != len(want_dims) or any(
                    isinstance(d, int) and (isinstance(w, str) or d != w) for d, w in zip(dims, want_dims))
            if differ:
                problems.append(f"{kind} {name} has dims {list(dims)}, the contract says {list(want_dims)}")
    return problems


def check_session_io(session, inputs: list[TensorSpec], outputs: list[TensorSpec], precision: str,
                     manifest: dict[str, Any], label: str, artifact_dir: str) -> None:
    """Refuse an ONNX Runtime session whose graph's IO is not the contract's for the manifest's
    precision and model (a graph swapped in from another export, a hand-edited manifest)."""
    def triples(args):
        return [(a.name, _ORT_TYPES.get(a.type, a.type), tuple(a.shape)) for a in args]

    problems = io_mismatches(triples(session.get_inputs()), triples(session.get_outputs()), inputs, outputs,
                             precision, manifest["model"])
    if problems:
        raise ArtifactError(f"{os.path.join(artifact_dir, label)} does not match its manifest ({precision}, "
                            f"{manifest['model'].get('decoder_layers')} decoder layers): " + "; ".join(problems[:4]),
                            hint=rebuild_hint(artifact_dir, manifest))
