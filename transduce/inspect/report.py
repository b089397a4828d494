"""`transduce inspect`: what a model, artifact or engine directory holds, as a report dict.

The kind of directory is recognised by its description file (transduce.formats.kinds.detect_kind):
  engine.json     an engine directory (transduce/build/builder.py): engine.json shown generically, the
                  TensorRT version, GPU and compute capability it was built for picked out, and the copy
                  of the artifact it holds shown as for an artifact
  manifest.json   an exported artifact (kind "transduce-artifact", see transduce/formats/contract.py):
                  manifest figures, and for each ONNX graph its inputs and outputs (symbolic dims by name),
                  opsets, op histogram and parameter count from the initializers (transduce.inspect.graphs)
  config.json     a model directory (transduce/models/checkpoint.py): config, parameter count from the
                  safetensors header (the model is not built), tokenizer size, training summary
An artifact's report also says which decoder step graph ONNX Runtime decodes it with on the CPU, and why
("step_graph": the fused decoder_step.ort.onnx where the manifest lists it, else decoder_step.onnx).
Artifacts and engines also go through the checks the runtime makes before it loads them, the same
functions (transduce.runtime.checks: check_artifact, which reads the graphs' headers for their IO and
quantization; check_engine_dir, without the TensorRT/GPU comparison), whose verdict is reported as
"runtime_check", not raised.

A missing path, a directory of none of these kinds, or an unreadable description file is a
TransduceError. Everything else that is wrong (a missing or resized file, an unreadable graph or
weights file) is listed under "problems" and the rest of the report is still given.

sha256 sums read every byte: verify=True compares them, verify=False does not, and verify=None (the
default) compares them when the recorded files total at most AUTO_VERIFY_BYTES. The runtime compares them at
every load, so a report that says nothing of them would pass a changed file the runtime refuses; above that
size inspect stays quick, and its report says the sums were not compared ("hashes", and "runtime_check" is
RUNTIME_OK_UNHASHED instead of "ok").

The report is plain JSON-serialisable data (`--json` prints it as is); transduce.inspect.render prints it
as rich tables.
"""

from __future__ import annotations

import os
from typing import Any

from transduce.errors import ArtifactError, CheckpointError, TransduceError
from transduce.formats.artifact import cpu_step_graph
from transduce.formats.contract import ENCODER_FILE, ORT_STEP_FILE, STEP_FILE
from transduce.formats.decoding_defaults import read_defaults
from transduce.formats.kinds import (
    ARTIFACT_KIND,
    DESCRIPTION_FILES,
    ENGINE_MANIFEST_FILE,
    MANIFEST_FILE,
    MODEL_CONFIG_FILE,
    WEIGHTS_FILE,
    detect_kind,
)
from transduce.formats.model_config import ModelConfig
from transduce.formats.model_dir import TOKENIZER_FILE, WEIGHTS_CONFIG_KEY, read_config, saved_config_mismatch
from transduce.formats.weights import layout_mismatches, read_safetensors_header
from transduce.inspect.graphs import graphs_report
from transduce.inspect.parameters import count_parameters
from transduce.io.files import inside_name, read_json_object, sha256_file
from transduce.runtime.checks import check_artifact, check_engine_dir

# engine.json keys naming what an engine was built for, first match wins (searched two levels deep)
BUILT_FOR_KEYS = {
    "tensorrt_version": ("tensorrt_version", "trt_version", "tensorrt"),
    "gpu": ("gpu_name", "gpu", "device_name", "device"),
    "compute_capability": ("compute_capability", "sm", "cc"),
    "cuda_version": ("cuda_version", "cuda"),
    "driver_version": ("driver_version", "driver"),
    "precision": ("precision",),
}
# verify=None hashes the recorded files when they total at most this: about a second of sha256 (the runtime
# hashes them at every load anyway); above it inspect reads sizes only unless asked (--verify)
AUTO_VERIFY_BYTES = 1 << 30
# runtime_check when every check passed but the sha256 sums were not compared
RUNTIME_OK_UNHASHED = "ok as far as checked: the files' sha256 were not compared (pass --verify)"


# -- entry point -------------------------------------------------------------------------------------


def _export_without_manifest(path: str) -> bool:
    """An export's graphs beside a config.json, with no weights of a model directory: an artifact that lost
    its manifest (export writes the manifest into its temporary directory before the rename)."""
    return (not os.path.exists(os.path.join(path, WEIGHTS_FILE))
            and any(os.path.isfile(os.path.join(path, f)) for f in (ENCODER_FILE, STEP_FILE)))


def resolve_directory(path: str | os.PathLike) -> tuple[str, str]:
    """-> (kind, directory). A path to one of the description files stands for its directory."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise TransduceError(f"{path!r} does not exist",
                             hint="give a model directory, an exported artifact or an engine directory")
    if os.path.isfile(path) and os.path.basename(path) in DESCRIPTION_FILES.values():
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise TransduceError(f"{path!r} is a file, not a model, artifact or engine directory",
                             hint="give the directory that holds config.json, manifest.json or engine.json")
    kind = detect_kind(path)
    if kind is None:
        raise TransduceError(
            f"{path!r} is not a model, artifact or engine directory: it holds none of {MODEL_CONFIG_FILE} (model), "
            f"{MANIFEST_FILE} (exported artifact), {ENGINE_MANIFEST_FILE} (TensorRT engine)",
            hint="make one with: transduce train, transduce export, or the engine builder",
        )
    if kind == "model" and _export_without_manifest(path):
        raise ArtifactError(f"{path!r} holds an export's ONNX graphs but no {MANIFEST_FILE}: an incomplete "
                            "or hand-copied export (its config.json is the model's, copied beside them)",
                            hint="export it again with: transduce export MODEL_DIR --out OUT_DIR --force")
    return kind, path


def inspect_path(path: str | os.PathLike, verify: bool | None = None) -> dict[str, Any]:
    """The report of a model, artifact or engine directory (see the module docstring; verify: whether sha256
    sums are compared, None: when the recorded files are small)."""
    kind, directory = resolve_directory(path)
    inspect_kind = {"model": inspect_model_dir, "artifact": inspect_artifact_dir, "engine": inspect_engine_dir}
    return inspect_kind[kind](directory, verify=verify)


# -- reading files ------------------------------------------------------------------------------------


def tokenizer_report(path: str, problems: list[str]) -> dict[str, Any] | None:
    """Vocabulary size of the tokenizer.json in `path`, if there is one (problems noted, not raised)."""
    from transduce.models.tokenizer import Tokenizer

    fpath = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(fpath):
        return None
    try:
        return {"file": TOKENIZER_FILE, "vocab_size": Tokenizer.from_file(fpath).vocab_size}
    except CheckpointError as e:
        problems.append(str(e))
        return {"file": TOKENIZER_FILE, "vocab_size": None}


def recorded_files(files: Any) -> dict[str, dict[str, Any]]:
    """A description file's "files" entry ({name: {sha256, bytes}} or a list of {name|path, ...}) as a dict."""
    if isinstance(files, dict):
        return {str(k): (v if isinstance(v, dict) else {}) for k, v in files.items()}
    if isinstance(files, list):
        out = {}
        for entry in files:
            if isinstance(entry, dict) and (entry.get("name") or entry.get("path")):
                out[str(entry.get("name") or entry.get("path"))] = entry
            elif isinstance(entry, str):
                out[entry] = {}
        return out
    return {}


def _present_files(directory: str) -> set[str]:
    """Every file under `directory` ("/"-separated relative names), hidden files and folders left out."""
    present = set()
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            if not name.startswith("."):
                present.add(os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/"))
    return present


def _file_problem(fpath: str, row: dict[str, Any], present: bool, readable: bool, verify: bool) -> str | None:
    """What is wrong with one file of the files report (None: nothing); sets row["sha256_ok"] if verify."""
    if present and not readable:
        return f"{fpath} is a link to nothing"
    if not present:
        return f"{fpath} is listed but missing"
    if row["recorded_bytes"] is not None and row["recorded_bytes"] != row["bytes"]:
        return f"{fpath} has {row['bytes']} bytes, recorded {row['recorded_bytes']}: truncated or replaced"
    if verify and row["sha256"]:
        try:
            row["sha256_ok"] = sha256_file(fpath) == row["sha256"]
        except OSError as e:
            return f"{fpath} cannot be read ({e.strerror})"
        if not row["sha256_ok"]:
            return f"{fpath} does not match its recorded sha256: it was changed"
    return None


def files_report(directory: str, recorded: dict[str, dict[str, Any]], verify: bool,
                 problems: list[str]) -> list[dict[str, Any]]:
    """Every file in the directory and every recorded one: actual and recorded size, sha256 check if verify."""
    present = _present_files(directory)
    for name in [n for n in recorded if not inside_name(n)]:
        problems.append(f"the manifest lists {name!r}, which is not a file name inside {directory}")
    rows = []
    for name in sorted(present | {n for n in recorded if inside_name(n)}):
        fpath = os.path.join(directory, name)
        meta = recorded.get(name, {})
        readable = name in present and os.path.exists(fpath)  # a dangling symlink is present, not readable
        row = {"name": name, "bytes": os.path.getsize(fpath) if readable else None,
               "recorded_bytes": meta.get("bytes"), "sha256": meta.get("sha256"), "sha256_ok": None}
        problem = _file_problem(fpath, row, name in present, readable, verify)
        if problem:
            problems.append(problem)
        rows.append(row)
    return rows


def hashing(directory: str, recorded: dict[str, dict[str, Any]], verify: bool | None) -> dict[str, Any]:
    """Whether the sha256 sums of the recorded files are compared (verify, or None: when they total at most
    AUTO_VERIFY_BYTES) -> the report's "hashes": {checked, bytes (the recorded files' total), note}."""
    total = 0
    for name in recorded:
        fpath = os.path.join(directory, name) if inside_name(name) else None
        if fpath and os.path.isfile(fpath):
            total += os.path.getsize(fpath)
    if verify is not None:
        note = "compared (--verify)" if verify else "not compared (--no-verify)"
        return {"checked": verify, "bytes": total, "note": note}
    small = total <= AUTO_VERIFY_BYTES
    size = (f"{total / 2**20:.1f} MiB of recorded files, {'within' if small else 'over'} the "
            f"{AUTO_VERIFY_BYTES / 2**30:.0f} GiB inspect hashes unasked")
    note = f"compared ({size})" if small else f"not compared ({size}): pass --verify"
    return {"checked": small, "bytes": total, "note": note}


# -- model directories ---------------------------------------------------------------------------------


def inspect_model_dir(directory: str, verify: bool | None = None) -> dict[str, Any]:
    """Report of a model directory; the weights are counted from the safetensors header only."""
    cfg = read_config(directory)  # CheckpointError on a corrupt or foreign config.json
    problems: list[str] = []
    report: dict[str, Any] = {
        "kind": "model",
        "path": directory,
        "format": cfg.get("format"),
        "format_version": cfg.get("format_version"),
        "config": cfg.get("model", {}),
        "parameters": None,
        "tokenizer": tokenizer_report(directory, problems),
        "training": cfg.get("training") if isinstance(cfg.get("training"), dict) else {},
        "decoding_defaults": decoding_defaults_report(cfg),
    }
    if "training" in cfg and not isinstance(cfg["training"], dict):
        problems.append(f"{os.path.join(directory, MODEL_CONFIG_FILE)}: its training record is not an object")
    wpath = os.path.join(directory, WEIGHTS_FILE)
    header, metadata = None, {}
    if os.path.isfile(wpath):
        try:
            header, metadata = read_safetensors_header(wpath)
            report["parameters"] = count_parameters((k, shape, dt) for k, (dt, shape) in header.items())
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{wpath} has no readable safetensors header ({e})")
    problems.extend(weights_against_config(report["config"], header, metadata.get(WEIGHTS_CONFIG_KEY)))
    files = cfg.get("files")
    for name in (WEIGHTS_FILE, TOKENIZER_FILE):  # what loading checks every file against
        entry = files.get(name) if isinstance(files, dict) else None
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str)):
            problems.append(f"config.json does not record {name} with its bytes and sha256: loading refuses it")
    vocab = (report["tokenizer"] or {}).get("vocab_size")
    if vocab is not None and vocab != report["config"].get("vocab_size"):
        problems.append(f"the tokenizer has {vocab} tokens but the config says {report['config'].get('vocab_size')}")
    recorded = recorded_files(cfg.get("files"))
    report["hashes"] = hashing(directory, recorded, verify)
    report["files"] = files_report(directory, recorded, report["hashes"]["checked"], problems)
    report["problems"] = problems
    return report


def decoding_defaults_report(cfg: dict[str, Any]) -> dict[str, Any]:
    """The options a decode naming none takes beyond the paper's (an imported model's framework's: their
    source and values); {} for the paper's. Malformed ones were refused by loading already."""
    defaults = read_defaults(cfg)
    return {} if defaults is None else {"source": defaults.source, **defaults.overrides()}


def weights_against_config(config: dict[str, Any], header: dict[str, tuple[str, list[int]]] | None,
                           saved_config: Any = None) -> list[str]:
    """What loading would refuse: a config that is not the one saved in the weights' metadata (`saved_config`,
    JSON), or weights (from the safetensors header) whose names or shapes are not the ones that config's model
    has (formats.weights.layout_mismatches: computed from the config, no model built). `config` is one
    read_config has accepted as a ModelConfig."""
    cfg = ModelConfig.from_dict(config)
    mismatch = saved_config_mismatch(saved_config, cfg)
    problems = [mismatch] if mismatch else []
    if header is not None:
        problems.extend(layout_mismatches({name: shape for name, (_, shape) in header.items()}, cfg))
    return problems


# -- artifact and engine directories -----------------------------------------------------------------------


def _model_config_in(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The model config inside a manifest: the first top-level object with a d_model field."""
    for key in ("model", "config", "model_config"):
        if isinstance(doc.get(key), dict) and "d_model" in doc[key]:
            return doc[key]
    return next((v for v in doc.values() if isinstance(v, dict) and "d_model" in v), None)


def inspect_artifact_dir(directory: str, verify: bool | None = None) -> dict[str, Any]:
    """Report of an exported artifact: manifest figures, each ONNX graph, the runtime's verdict on it."""
    path = os.path.join(directory, MANIFEST_FILE)
    manifest = read_json_object(path, ArtifactError)
    if manifest.get("kind") != ARTIFACT_KIND:
        raise ArtifactError(f"{path} is not a transduce artifact manifest (kind {manifest.get('kind')!r}, "
                            f"expected {ARTIFACT_KIND!r})")
    problems: list[str] = []
    recorded = recorded_files(manifest.get("files"))
    report: dict[str, Any] = {
        "kind": "artifact",
        "path": directory,
        "manifest": {k: v for k, v in manifest.items() if k != "files"},
        "config": _model_config_in(manifest),
        "tokenizer": tokenizer_report(directory, problems),
        "graphs": graphs_report(directory, recorded, problems),
    }
    try:  # the copy of config.json carries the model's decoding defaults
        report["decoding_defaults"] = decoding_defaults_report(read_json_object(
            os.path.join(directory, MODEL_CONFIG_FILE), ArtifactError))
    except TransduceError as e:
        problems.append(str(e))
    report["hashes"] = hashing(directory, recorded, verify)
    report["runtime_check"] = runtime_verdict(check_artifact, directory, report["hashes"]["checked"])
    report["step_graph"] = step_graph_report(manifest, report["runtime_check"])
    report["files"] = files_report(directory, recorded, report["hashes"]["checked"], problems)
    report["problems"] = problems
    return report


def step_graph_report(manifest: dict[str, Any], runtime_check: str) -> dict[str, Any]:
    """Which decoder step graph ONNX Runtime decodes the artifact with on the CPU, and why: {"provider",
    "graph" (None where the runtime refuses the artifact), "why"}. The choice is the backend's own
    (formats.artifact.cpu_step_graph); the CUDA and TensorRT providers always run decoder_step.onnx."""
    from transduce.exporter.ort_step import unsupported_reason

    out: dict[str, Any] = {"provider": "onnxruntime cpu", "graph": None, "why": ""}
    if not (runtime_check in ("ok", RUNTIME_OK_UNHASHED) or runtime_check.startswith("not checked")):
        out["why"] = "none: the runtime refuses this artifact (see its runtime check)"
        return out
    out["graph"] = cpu_step_graph(manifest)
    try:
        unsupported = unsupported_reason(ModelConfig.from_dict(manifest.get("model")), manifest.get("precision"))
    except (TransduceError, TypeError, ValueError):  # a manifest the runtime did not read: no reason to give
        unsupported = None
    if out["graph"] == ORT_STEP_FILE:
        out["why"] = "fused, listed in the manifest"
    elif manifest.get("ort_step_graph") is False:
        out["why"] = "this export has no fused step graph (exported with --no-ort-step)"
    elif unsupported:
        out["why"] = f"this export has no fused step graph: {unsupported}"
    elif "ort_step_graph" not in manifest:
        out["why"] = "this export has no fused step graph (an older export, whose manifest does not say why)"
    else:
        out["why"] = (f"the manifest lists no {ORT_STEP_FILE} though it records an export with one: the manifest "
                      f"was edited or the file removed (export again for the faster fused step graph)")
    return out


def runtime_verdict(check, directory: str, hashed: bool) -> str:
    """What the runtime's own check (transduce.runtime.checks) says of the directory: "ok",
    RUNTIME_OK_UNHASHED when it passed without comparing sha256 sums, or why the runtime would refuse it
    (the first line of the error, whatever TransduceError it is)."""
    try:
        check(directory, verify_hashes=hashed)
    except TransduceError as e:
        return str(e).split("\n")[0]
    return "ok" if hashed else RUNTIME_OK_UNHASHED


def _has_objects(value: Any) -> bool:
    return isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value)


def _find_key(doc: Any, names: tuple[str, ...], depth: int = 2) -> Any:
    """The value of the first key in `names` at this level, else in nested objects (`depth` levels down).

    A key whose value is an object stands for that object's "name" or "version" ("gpu": {"name": "NVIDIA
    H100", ...}, "tensorrt": {"version": "10.3.0", ...}).
    """
    if not isinstance(doc, dict) or depth < 0:
        return None
    for name in names:
        value = doc.get(name)
        if isinstance(value, dict):
            value = value.get("name", value.get("version"))
        if value is not None and not isinstance(value, dict) and not _has_objects(value):
            return value
    for value in doc.values():
        found = _find_key(value, names, depth - 1)
        if found is not None:
            return found
    return None


def inspect_engine_dir(directory: str, verify: bool | None = None) -> dict[str, Any]:
    """Report of a TensorRT engine directory: engine.json shown generically, what it was built for picked
    out, and the copy of the artifact it holds (manifest, ONNX graphs) where there is one."""
    engine = read_json_object(os.path.join(directory, ENGINE_MANIFEST_FILE), ArtifactError)
    problems: list[str] = []
    recorded = recorded_files(engine.get("files"))
    report: dict[str, Any] = {
        "kind": "engine",
        "path": directory,
        "built_for": {k: v for k, names in BUILT_FOR_KEYS.items() if (v := _find_key(engine, names)) is not None},
        "engine": {k: v for k, v in engine.items() if k != "files"},
        "config": _model_config_in(engine),
        "tokenizer": tokenizer_report(directory, problems),
        "graphs": graphs_report(directory, recorded, problems),
    }
    mpath = os.path.join(directory, MANIFEST_FILE)
    if os.path.isfile(mpath):
        try:
            report["manifest"] = {k: v for k, v in read_json_object(mpath, ArtifactError).items() if k != "files"}
            report["config"] = report["config"] or _model_config_in(report["manifest"])
        except ArtifactError as e:
            problems.append(str(e))
    report["hashes"] = hashing(directory, recorded, verify)
    # the TensorRT backend's checks, without comparing the TensorRT version and GPU the plans were built for
    # with this machine's (runtime=None)
    report["runtime_check"] = runtime_verdict(check_engine_dir, directory, report["hashes"]["checked"])
    report["files"] = files_report(directory, recorded, report["hashes"]["checked"], problems)
    report["problems"] = problems
    return report
