"""An exported artifact's manifest.json: read and checked here (transduce.exporter.onnx_export writes it).

The manifest records `kind` ("transduce-artifact"), `contract_version` (the runtime refuses another
version, naming the command that rebuilds the artifact), `precision`, `opset`, `ort_step_graph` (false:
exported with --no-ort-step; absent in older manifests), `model` (the ModelConfig dict), `source_model`
{path, weights_sha256, config_sha256}, `dynamic_axes` {axis: [min, max or null]} (see
contract.dynamic_axis_ranges), `static_axes`, `graphs` {file: inputs, outputs, op_histogram, ...},
`validation` {engine, tolerances, cases, errors: [{graph, output, max_abs, max_rel, atol, rtol, passed}]},
`tools`, `export_seconds`, and `files` {name: {sha256, bytes}} for every other file of the directory (the
graphs, any external-data file, and config.json and tokenizer.json copied from the model directory: the copy
of config.json carries the model's decoding defaults, formats.decoding_defaults). An
artifact exported with --quantize int8 also has `quantization` {method, graphs, ops, bytes (the quantized
graphs' sizes), validation (rows {graph, output, max_abs, rel_rms, rel_rms_limit, passed, worst_case}), ...}:
its encoder.onnx and decoder_step.ort.onnx have int8 weights (same IO), for ONNX Runtime's CPU provider
only; `graphs` describes them before quantization.

read_manifest checks the manifest's own fields, that it lists every graph file of the directory (a deleted
decoder_step.ort.onnx entry would otherwise leave every sha256 right and decoding on the slower
decoder_step.onnx), every file it lists (size, and sha256 with verify_hashes), and its model config against the
copy of config.json it lists: no hash covers the manifest itself. What needs the graphs read (their IO against
the contract, their quantization) is the runtime's (transduce.runtime.checks.check_artifact).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from transduce.errors import ArtifactError, ConfigError
from transduce.formats.contract import (
    CONTRACT_VERSION,
    ENCODER_FILE,
    GRAPH_FILES,
    ORT_STEP_FILE,
    STEP_FILE,
    dynamic_axis_ranges,
    static_axis_sizes,
)
from transduce.formats.decoding_defaults import DecodingDefaults, read_defaults
from transduce.formats.kinds import ARTIFACT_KIND, ENGINE_MANIFEST_FILE, MANIFEST_FILE, MODEL_CONFIG_FILE, is_model_dir
from transduce.formats.model_config import DEVIATION_FIELDS, ModelConfig
from transduce.formats.model_dir import TOKENIZER_FILE
from transduce.io.atomic import write_json
from transduce.io.files import listed_file_problem
from transduce.io.paths import require_directory
from transduce.io.pinned import ATTEMPTS, PinnedDir, Replaced, await_replacement, read_pinned

PRECISIONS = ("fp32", "fp16", "bf16")
QUANTIZATION_METHODS = ("int8",)  # export --quantize (transduce/exporter/quantize.py)
QUANTIZED_FILES = (ENCODER_FILE, ORT_STEP_FILE)  # the graphs a quantized artifact has quantized
# what ONNX Runtime's quantize_dynamic makes of MatMul and Gemm: one of these is in every graph it quantized
QUANTIZED_OP_TYPES = ("MatMulInteger", "DynamicQuantizeMatMul", "DynamicQuantizeLinear", "QGemm")
# what every artifact lists: the graphs the runtime loads, the tokenizer, and the copy of config.json whose
# model config must be the manifest's (model_config_problem)
REQUIRED_FILES = (ENCODER_FILE, STEP_FILE, TOKENIZER_FILE, MODEL_CONFIG_FILE)


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
    if m.get("ort_step_graph") is False:  # older manifests do not record it: they cannot tell
        options.append("--no-ort-step")
    extra = "".join(f" {o}" for o in options)
    if os.path.isfile(os.path.join(artifact_dir, ENGINE_MANIFEST_FILE)):
        return (f"{artifact_dir} is an engine directory: export the model again, then build its engines again: "
                f"transduce export {model} --out ARTIFACT_DIR --force{extra} && "
                f"transduce build ARTIFACT_DIR --out {artifact_dir} --force")
    return f"rebuild the artifact with: transduce export {model} --out {artifact_dir} --force{extra}"


def quantization(manifest: dict[str, Any]) -> str | None:
    """The artifact's quantization ("int8": `transduce export --quantize int8`), None if it has none."""
    q = manifest.get("quantization")
    return q.get("method") if isinstance(q, dict) else None


def cpu_step_graph(manifest: dict[str, Any]) -> str:
    """The decoder step graph ONNX Runtime decodes an artifact with on its CPU provider: the fused ORT_STEP_FILE
    where the manifest lists it, else STEP_FILE (on its CUDA and TensorRT providers, STEP_FILE always). Loading
    refuses a directory that holds ORT_STEP_FILE unlisted (unlisted_graph_problem)."""
    files = manifest.get("files")
    return ORT_STEP_FILE if isinstance(files, dict) and ORT_STEP_FILE in files else STEP_FILE


@dataclass(frozen=True, eq=False)
class Artifact:
    """An exported artifact, read and checked once (Artifact.load): its manifest, its model config and its
    files, held open (io.pinned) so that what a backend loads is exactly what was checked, even while
    `transduce export --force` replaces the directory."""

    path: str  # the directory, as given
    manifest: dict[str, Any]  # manifest.json as written
    config: ModelConfig
    files: PinnedDir
    manifest_sha256: str  # of manifest.json's bytes as read
    # the model's decoding defaults, from the artifact's copy of config.json (None: the paper's)
    decoding_defaults: DecodingDefaults | None = None

    @classmethod
    def load(cls, path: str | os.PathLike, verify_hashes: bool = True) -> Artifact:
        """Read and check an artifact (the module's docstring); ArtifactError naming the command that rebuilds
        it, or saying that it was replaced under every read (another process exporting into it)."""
        path = os.fspath(path)
        if not await_replacement(path):  # a replace under way: between its two renames
            _require_artifact_dir(path)
        try:
            return read_pinned(path, lambda pinned: _read(pinned, verify_hashes))
        except Replaced:
            raise ArtifactError(f"{path!r} was replaced while it was being loaded, {ATTEMPTS} times (another process "
                                "is exporting into it)", hint="load it again once that export is done") from None

    @classmethod
    def read(cls, pinned: PinnedDir, verify_hashes: bool = True) -> Artifact:
        """The artifact in a directory already held open (an engine directory's copy of its artifact)."""
        return _read(pinned, verify_hashes)

    @property
    def precision(self) -> str:
        return self.manifest["precision"]

    @property
    def quantization(self) -> str | None:
        return quantization(self.manifest)

    def lists(self, name: str) -> bool:
        """Whether the manifest lists file `name` (the ONNX Runtime step graph is optional)."""
        return name in self.manifest["files"]

    def file(self, name: str) -> str:
        """A path of the artifact's file `name` as it was checked, for a library that opens files by name."""
        return self.files.path_of(name)

    def graph_file(self, name: str) -> str:
        """file(name) for an ONNX graph: one whose weights are in files beside it (name.data) is named within the
        held directory, where a library finds those files too."""
        if any(f.startswith(name + ".") for f in self.manifest["files"]):
            return os.path.join(self.files.directory_path(), name)
        return self.file(name)

    def rebuild_hint(self) -> str:
        return rebuild_hint(self.path, self.manifest)


def read_manifest(artifact_dir: str | os.PathLike, verify_hashes: bool = True) -> dict[str, Any]:
    """Read and check an artifact's manifest (Artifact.load); raise ArtifactError naming the rebuild command."""
    return Artifact.load(artifact_dir, verify_hashes).manifest


def _require_artifact_dir(artifact_dir: str) -> None:
    require_directory(artifact_dir, ArtifactError, "an artifact directory", "artifact directory",
                      "give the directory transduce export wrote",
                      f"export one with: transduce export MODEL_DIR --out {artifact_dir}")


def _missing_manifest(pinned: PinnedDir) -> ArtifactError:
    """Why a directory without manifest.json is not an artifact, and what to do."""
    artifact_dir = pinned.path
    path = pinned.display(MANIFEST_FILE)
    # an export keeps a copy of config.json beside its graphs: with the graphs, it is an export that lost its
    # manifest, not a model directory
    graphs = any(pinned.is_file(g) for g in (ENCODER_FILE, STEP_FILE))
    if is_model_dir(artifact_dir) and not graphs:
        return ArtifactError(f"{artifact_dir!r} is a model directory, not an exported artifact",
                             hint=f"export it first: transduce export {artifact_dir} --out ARTIFACT_DIR, "
                                  "then use ARTIFACT_DIR")
    if not os.listdir(pinned.directory_path()):
        lost = rebuild_hint(artifact_dir)
    elif graphs or pinned.is_file(TOKENIZER_FILE):  # an export that lost its manifest
        lost = ("export into a new directory: transduce export MODEL_DIR --out NEW_DIR (--force replaces only "
                f"artifacts, and {artifact_dir} has lost its manifest: remove it to reuse its name)")
    else:
        lost = "give the directory transduce export wrote (it holds manifest.json)"
    return ArtifactError(f"{path} is missing: {artifact_dir!r} is not an exported artifact", hint=lost)


def _read(pinned: PinnedDir, verify_hashes: bool) -> Artifact:
    """The checks of Artifact.load, every file read through `pinned`."""
    artifact_dir = pinned.path
    hint = rebuild_hint(artifact_dir)
    path = pinned.display(MANIFEST_FILE)
    if not pinned.is_file(MANIFEST_FILE):
        raise _missing_manifest(pinned)
    try:
        raw = pinned.read_bytes(MANIFEST_FILE)
        manifest = json.loads(raw.decode("utf-8"))
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
    missing = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in {*model, *DEVIATION_FIELDS}]
    if missing:  # the exporter writes every field; a default would guess (an eos_id, say), but not a deviation's
        raise ArtifactError(f"{path}: its model config lacks {', '.join(missing)}", hint=hint)
    try:  # and valid: n_heads 0 or an eos_id past the vocabulary would fail later, unnamed
        config = ModelConfig.from_dict(model)
    except ConfigError as e:
        raise ArtifactError(f"{path}: its model config is not valid: {e}", hint=hint) from None
    files = manifest.get("files")
    if not isinstance(files, dict) or not set(REQUIRED_FILES) <= set(files):
        raise ArtifactError(f"{path} does not list {', '.join(REQUIRED_FILES[:-1])} and {REQUIRED_FILES[-1]}",
                            hint=hint)
    problem = unlisted_graph_problem(pinned, files, path)
    if problem:
        raise ArtifactError(problem, hint=hint)
    for name, meta in files.items():
        problem = listed_file_problem(pinned, name, meta, verify_hashes, listed_in=path, changed="after export")
        if problem:
            raise ArtifactError(problem, hint=hint)
    problem = model_config_problem(pinned, config)
    if problem:
        raise ArtifactError(f"{path}: {problem}", hint=hint)
    try:  # model_config_problem read it: a JSON object
        defaults = read_defaults(pinned.read_json(MODEL_CONFIG_FILE))
    except ConfigError as e:
        raise ArtifactError(f"{pinned.display(MODEL_CONFIG_FILE)}: {e}", hint=hint) from None
    return Artifact(artifact_dir, manifest, config, pinned, hashlib.sha256(raw).hexdigest(), defaults)


def unlisted_graph_problem(pinned: PinnedDir, files: dict[str, Any], listed_in: str) -> str | None:
    """Why the directory holds a graph file an export writes (contract.GRAPH_FILES) that its manifest does not
    list (None: it lists every one it holds). Such a file is never checked, and the runtime goes by the list:
    a manifest whose decoder_step.ort.onnx entry was deleted, every other sha256 still right, would decode on
    ONNX Runtime's CPU provider with the slower decoder_step.onnx, unasked."""
    for name in GRAPH_FILES:
        if name not in files and pinned.is_file(name):
            effect = (f"; unlisted, it would go unchecked and ONNX Runtime would decode with the slower {STEP_FILE}"
                      if name == ORT_STEP_FILE else "")
            return (f"{pinned.display(name)} is not listed in {listed_in}: the manifest was edited after export, "
                    f"or the export is incomplete{effect}")
    return None


def model_config_problem(pinned: PinnedDir, config: ModelConfig) -> str | None:
    """Why the manifest's model config (a valid one) is not the one in the artifact's copy of config.json (None:
    it is). The manifest is the one file of the artifact no hash covers, but it hashes that copy: a model
    config edited in the manifest alone (n_heads, norm_first, an eos_id: fields the graphs' IO may not show)
    would decode with another model than the graphs hold. Defaults are filled in on both sides."""
    cpath = pinned.display(MODEL_CONFIG_FILE)
    try:
        copied = pinned.read_json(MODEL_CONFIG_FILE)
    except (OSError, ValueError) as e:
        return f"its copy of the model's config, {cpath}, is unreadable or not JSON ({e})"
    try:
        theirs = ModelConfig.from_dict(copied.get("model") if isinstance(copied, dict) else None).to_dict()
    except ConfigError as e:
        return f"its copy of the model's config, {cpath}, has no valid model config ({e})"
    ours = config.to_dict()
    diff = [f"{k} {ours[k]!r} vs {theirs[k]!r}" for k in ours if ours[k] != theirs[k]]
    if diff:
        return (f"its model config is not the one in {MODEL_CONFIG_FILE}, whose sha256 it records "
                f"(manifest vs {MODEL_CONFIG_FILE}: {'; '.join(diff[:4])}): the manifest was edited after export")
    return None


def artifact_manifest(precision: str, opset: int, ort_step_graph: bool, export_seconds: dict[str, float],
                      exporter: str, tools: dict[str, str], model: ModelConfig, source_model: dict[str, Any],
                      graphs: dict[str, Any], tensorrt_ops: dict[str, Any], validation: dict[str, Any],
                      quantization: dict[str, Any] | None, files: dict[str, Any]) -> dict[str, Any]:
    """manifest.json's content for an export (the fields: this module's docstring)."""
    return {
        "kind": ARTIFACT_KIND,
        "contract_version": CONTRACT_VERSION,
        "precision": precision,
        "opset": opset,
        "ort_step_graph": bool(ort_step_graph),  # False: --no-ort-step, which a rebuild hint repeats
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "export_seconds": export_seconds,
        "exporter": exporter,
        "tools": tools,
        "model": model.to_dict(),
        "model_config_file": MODEL_CONFIG_FILE,
        "tokenizer": TOKENIZER_FILE,
        "source_model": source_model,
        "dynamic_axes": {k: list(v) for k, v in dynamic_axis_ranges(model).items()},
        "static_axes": static_axis_sizes(model),
        "graphs": graphs,
        "tensorrt_ops": tensorrt_ops,
        "validation": validation,
        **({"quantization": quantization} if quantization else {}),
        "files": files,
    }


def write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    write_json(os.path.join(directory, MANIFEST_FILE), manifest)
