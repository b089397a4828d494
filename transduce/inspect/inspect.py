"""`transduce inspect`: what a model, artifact or engine directory holds, as a report dict.

The kind of directory is recognised by its description file:
  engine.json     an engine directory (transduce/build/builder.py): engine.json shown generically, the
                  TensorRT version, GPU and compute capability it was built for picked out, and the copy
                  of the artifact it holds shown as for an artifact
  manifest.json   an exported artifact (kind "transduce-artifact", see transduce/formats/contract.py):
                  manifest figures, and for each ONNX graph its inputs and outputs (symbolic dims by name),
                  opsets, op histogram and parameter count from the initializers
  config.json     a model directory (transduce/models/checkpoint.py): config, parameter count from the
                  safetensors header (the model is not built), tokenizer size, training summary
(checked in that order: an engine directory holds a copy of the artifact's manifest, an artifact a copy
of the model's config.json). Artifacts and engines are also passed to the runtime's own readers
(contract.read_manifest, engine.read_engine_manifest without the TensorRT/GPU comparison), whose
verdict is reported, not raised.

A missing path, a directory of none of these kinds, or an unreadable description file is a
TransduceError. Everything else that is wrong (a missing or resized file, an unreadable graph or
weights file) is listed under "problems" and the rest of the report is still given. sha256 sums are
compared only with verify=True (they read every byte).

The report is plain JSON-serialisable data (`--json` prints it as is); `render_report` prints it as
rich tables.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

from transduce.errors import ArtifactError, CheckpointError, TransduceError
from transduce.formats.engine import ENGINE_MANIFEST as ENGINE_FILE
from transduce.formats.kinds import MANIFEST_FILE, MODEL_CONFIG_FILE
from transduce.formats.model_dir import TOKENIZER_FILE

KINDS = {ENGINE_FILE: "engine", MANIFEST_FILE: "artifact", MODEL_CONFIG_FILE: "model"}
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
# engine.json keys naming what an engine was built for, first match wins (searched two levels deep)
BUILT_FOR_KEYS = {
    "tensorrt_version": ("tensorrt_version", "trt_version", "tensorrt"),
    "gpu": ("gpu_name", "gpu", "device_name", "device"),
    "compute_capability": ("compute_capability", "sm", "cc"),
    "cuda_version": ("cuda_version", "cuda"),
    "driver_version": ("driver_version", "driver"),
    "precision": ("precision",),
}


# -- entry point -------------------------------------------------------------------------------------


def _export_without_manifest(path: str) -> bool:
    """An export's graphs beside a config.json, with no weights of a model directory: an artifact that lost
    its manifest (export writes the manifest into its temporary directory before the rename)."""
    from transduce.formats.contract import ENCODER_FILE, STEP_FILE

    return (not os.path.exists(os.path.join(path, "model.safetensors"))
            and any(os.path.isfile(os.path.join(path, f)) for f in (ENCODER_FILE, STEP_FILE)))


def detect_kind(path: str | os.PathLike) -> tuple[str, str]:
    """-> (kind, directory). A path to one of the description files stands for its directory."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise TransduceError(f"{path!r} does not exist",
                             hint="give a model directory, an exported artifact or an engine directory")
    if os.path.isfile(path) and os.path.basename(path) in KINDS:
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise TransduceError(f"{path!r} is a file, not a model, artifact or engine directory",
                             hint="give the directory that holds config.json, manifest.json or engine.json")
    for name, kind in KINDS.items():
        if os.path.isfile(os.path.join(path, name)):
            if kind == "model" and _export_without_manifest(path):
                raise ArtifactError(f"{path!r} holds an export's ONNX graphs but no {MANIFEST_FILE}: an incomplete "
                                    "or hand-copied export (its config.json is the model's, copied beside them)",
                                    hint="export it again with: transduce export MODEL_DIR OUT_DIR --force")
            return kind, path
    raise TransduceError(
        f"{path!r} is not a model, artifact or engine directory: it holds none of "
        f"{MODEL_CONFIG_FILE} (model), {MANIFEST_FILE} (exported artifact), {ENGINE_FILE} (TensorRT engine)",
        hint="make one with: transduce train, transduce export, or the engine builder",
    )


def inspect_path(path: str | os.PathLike, verify: bool = False) -> dict[str, Any]:
    """The report of a model, artifact or engine directory (see the module docstring)."""
    kind, directory = detect_kind(path)
    inspect_kind = {"model": inspect_model_dir, "artifact": inspect_artifact_dir, "engine": inspect_engine_dir}
    return inspect_kind[kind](directory, verify=verify)


# -- reading files ------------------------------------------------------------------------------------


def read_json_file(path: str, error=TransduceError) -> dict[str, Any]:
    """A JSON object from a file, or `error` saying the file is unreadable, not JSON or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise error(f"{path} cannot be read ({e.strerror})") from None
    except ValueError as e:
        raise error(f"{path} is not valid JSON ({e}); the file is truncated or corrupt") from None
    if not isinstance(data, dict):
        raise error(f"{path} does not hold a JSON object (found {type(data).__name__}); the file is corrupt")
    return data


def read_safetensors_header(path: str) -> tuple[dict[str, tuple[str, list[int]]], dict[str, str]]:
    """({tensor name: (dtype, shape)}, the metadata) from a safetensors file's JSON header, without reading
    the tensors."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(f"header length {n} exceeds the file size {size}")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    return ({name: (SAFETENSORS_DTYPES.get(meta["dtype"], str(meta["dtype"]).lower()), list(meta["shape"]))
             for name, meta in header.items()}, metadata if isinstance(metadata, dict) else {})


def tokenizer_report(path: str, problems: list[str]) -> dict[str, Any] | None:
    """Vocabulary size of the tokenizer.json in `path`, if there is one (problems noted, not raised)."""
    from transduce.tokenizer import Tokenizer

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


def files_report(directory: str, recorded: dict[str, dict[str, Any]], verify: bool,
                 problems: list[str]) -> list[dict[str, Any]]:
    """Every file in the directory and every recorded one: actual and recorded size, sha256 check if verify."""
    from transduce.formats.files import inside_name, sha256_file

    present = set()
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            if not name.startswith("."):
                present.add(os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/"))
    rows = []
    for name in [n for n in recorded if not inside_name(n)]:
        problems.append(f"the manifest lists {name!r}, which is not a file name inside {directory}")
    for name in sorted(present | {n for n in recorded if inside_name(n)}):
        fpath = os.path.join(directory, name)
        meta = recorded.get(name, {})
        readable = name in present and os.path.exists(fpath)  # a dangling symlink is present, not readable
        row = {"name": name, "bytes": os.path.getsize(fpath) if readable else None,
               "recorded_bytes": meta.get("bytes"), "sha256": meta.get("sha256"), "sha256_ok": None}
        if name in present and not readable:
            problems.append(f"{fpath} is a link to nothing")
        elif name not in present:
            problems.append(f"{fpath} is listed but missing")
        elif row["recorded_bytes"] is not None and row["recorded_bytes"] != row["bytes"]:
            problems.append(f"{fpath} has {row['bytes']} bytes, recorded {row['recorded_bytes']}: truncated or replaced")
        elif verify and row["sha256"]:
            try:
                row["sha256_ok"] = sha256_file(fpath) == row["sha256"]
            except OSError as e:
                problems.append(f"{fpath} cannot be read ({e.strerror})")
            else:
                if not row["sha256_ok"]:
                    problems.append(f"{fpath} does not match its recorded sha256: it was changed")
        rows.append(row)
    return rows


# -- parameter counts ---------------------------------------------------------------------------------

_SEP = r"[./]"  # module paths appear as "encoder_layers.0.ffn" in weights, "/encoder_layers.0/ffn/" in node names
_LAYER = re.compile(rf"(encoder|decoder)_layers{_SEP}(\d+){_SEP}([A-Za-z_]+\d*)")
_SUBLAYER = {"self_attn": "self-attention", "cross_attn": "cross-attention", "ffn": "feed-forward"}


def classify_parameter(name: str) -> tuple[str, str, tuple[str, int] | None]:
    """A weight name (or an ONNX node name holding the module path) -> (component, kind, (stack, layer)).

    component is embeddings, encoder, decoder or other; kind names the layer kind, e.g. "decoder cross-attention".
    """
    m = _LAYER.search(name)
    if m:
        stack, layer, sub = m.group(1), int(m.group(2)), m.group(3)
        kind = "layer norm" if sub.startswith("norm") else _SUBLAYER.get(sub, sub)
        return stack, f"{stack} {kind}", (stack, layer)
    if m := re.search(rf"(?:^|{_SEP})(encoder|decoder)_norm(?:{_SEP}|$)", name):
        return m.group(1), f"{m.group(1)} final layer norm", None
    if re.search(rf"(?:^|{_SEP})src_embed(?:{_SEP}|$)", name):
        return "embeddings", "source embedding", None
    if re.search(rf"(?:^|{_SEP})embed(?:{_SEP}|$)", name):
        return "embeddings", "embedding (target, or shared)", None
    if re.search(rf"(?:^|{_SEP})out_proj(?:{_SEP}|$)", name):
        return "embeddings", "output projection", None
    # the buffer `pe`, by its module path or as torch.export lifts it into a graph (b_pe, b_model_pe)
    if re.search(rf"(?:^|{_SEP})pe(?:{_SEP}|$)", name) or re.search(r"(?:^|[^\w])b_(?:model_)?pe\b", name):
        return "embeddings", "positional encoding table", None
    return "other", "other", None


def count_parameters(tensors: Iterable[tuple[str, list[int], str]]) -> dict[str, Any]:
    """(name, shape, dtype) triples -> total, per component with its layer kinds, per layer, and by dtype.

    {"total": n, "components": {"encoder": {"parameters": n, "kinds": {"encoder self-attention": n, ...}}, ...},
     "layers": {"encoder": [n per layer], "decoder": [...]}, "dtypes": {"float32": n}}
    """
    total, components, dtypes = 0, Counter(), Counter()
    kinds: dict[str, Counter] = {}
    layers: dict[str, Counter] = {"encoder": Counter(), "decoder": Counter()}
    for name, shape, dtype in tensors:
        n = 1
        for d in shape:
            n *= int(d)
        component, kind, layer = classify_parameter(name)
        total += n
        components[component] += n
        kinds.setdefault(component, Counter())[kind] += n
        dtypes[dtype] += n
        if layer is not None:
            layers[layer[0]][layer[1]] += n
    return {
        "total": total,
        "components": {c: {"parameters": n, "kinds": dict(kinds[c].most_common())} for c, n in components.most_common()},
        "layers": {stack: [c[i] for i in range(max(c) + 1)] if c else [] for stack, c in layers.items()},
        "dtypes": dict(dtypes.most_common()),
    }


# -- model directories ---------------------------------------------------------------------------------


def inspect_model_dir(directory: str, verify: bool = False) -> dict[str, Any]:
    """Report of a model directory; the weights are counted from the safetensors header only."""
    from transduce.formats.kinds import WEIGHTS_FILE
    from transduce.formats.model_dir import TOKENIZER_FILE, WEIGHTS_CONFIG_KEY, read_config

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
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)):
            problems.append(f"config.json does not record {name} with its bytes and sha256: loading refuses it")
    vocab = (report["tokenizer"] or {}).get("vocab_size")
    if vocab is not None and vocab != report["config"].get("vocab_size"):
        problems.append(f"the tokenizer has {vocab} tokens but the config says {report['config'].get('vocab_size')}")
    report["files"] = files_report(directory, recorded_files(cfg.get("files")), verify, problems)
    report["problems"] = problems
    return report


def weights_against_config(config: dict[str, Any], header: dict[str, tuple[str, list[int]]] | None,
                           saved_config: str | None = None) -> list[str]:
    """What loading would refuse: a config that is not a valid ModelConfig, one that is not the config saved
    in the weights' metadata (`saved_config`, JSON), or weights (from the safetensors header) whose names or
    shapes are not the ones that config's model has. The model is built on torch's meta device: no memory,
    no weights read."""
    from transduce.errors import ConfigError
    from transduce.formats.model_dir import saved_config_mismatch
    from transduce.models.config import ModelConfig

    try:
        cfg = ModelConfig.from_dict(config)
    except ConfigError as e:
        return [str(e)]
    mismatch = saved_config_mismatch(saved_config, cfg)
    problems = [mismatch] if mismatch else []
    if header is None:
        return problems
    import torch

    from transduce.models.transformer import Transformer

    with torch.device("meta"):
        expected = {k: list(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    missing, extra = sorted(set(expected) - set(header)), sorted(set(header) - set(expected))
    if missing:
        problems.append(f"weights missing for this config: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    if extra:
        problems.append(f"weights this config's model does not have: {', '.join(extra[:5])}" + (" ..." if len(extra) > 5 else ""))
    wrong = [f"{k} {list(header[k][1])} (config: {expected[k]})" for k in expected if k in header and list(header[k][1]) != expected[k]]
    if wrong:
        problems.append("weights of other shapes than the config's: " + "; ".join(wrong[:3]) + (" ..." if len(wrong) > 3 else ""))
    return problems


# -- ONNX graphs and artifacts ---------------------------------------------------------------------------


def _elem_type_name(elem_type: int) -> str:
    import onnx

    name = onnx.TensorProto.DataType.Name(elem_type).lower()
    return {"float": "float32", "double": "float64"}.get(name, name)


def _value_info(value) -> dict[str, Any]:
    """An ONNX graph input/output -> {name, dtype, shape}; dims by value, by symbolic name, or "?"."""
    t = value.type
    if not t.HasField("tensor_type"):
        return {"name": value.name, "dtype": t.WhichOneof("value") or "?", "shape": None}
    tt = t.tensor_type
    shape = None
    if tt.HasField("shape"):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
    return {"name": value.name, "dtype": _elem_type_name(tt.elem_type), "shape": shape}


def _nodes(graph) -> Iterable:
    """Every node of a graph and of its subgraphs (If/Loop/Scan bodies)."""
    from transduce.verify.opcheck import iter_nodes

    return iter_nodes(graph)


def _node_scope(node) -> str:
    """What a node says about the module it comes from: its name ("/encoder_layers.0/ffn/w1/MatMul" from the
    TorchScript exporter), its "namespace" metadata ("...m.encoder_layers.0.ffn.w1: ...Linear/..." from dynamo)
    and the lifted parameters and buffers its FX node reads ("%b_model_pe": the buffer model.pe)."""
    meta = {p.key: p.value for p in node.metadata_props}
    lifted = re.findall(r"%([bp]_\w+)", meta.get("pkg.torch.onnx.fx_node", ""))
    return " ".join([node.name, meta.get("namespace", ""), *lifted]).strip()


def _initializer_scopes(graph) -> dict[str, str]:
    """Initializer name -> the scope of the first node that consumes it, looking through Identity nodes."""
    consumers: dict[str, list] = {}
    for node in _nodes(graph):
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def scope(name: str, hops: int = 0) -> str:
        node = (consumers.get(name) or [None])[0]
        if node is None:
            return ""
        if node.op_type == "Identity" and node.output and hops < 8:
            return scope(node.output[0], hops + 1) or _node_scope(node)
        return _node_scope(node)

    return {init.name: scope(init.name) for init in graph.initializer}


def _graph_parameters(graph) -> dict[str, Any]:
    """Parameter counts from the initializers; a name that says nothing is classified by its consumer node."""
    scopes = _initializer_scopes(graph)
    triples = []
    for init in graph.initializer:
        name = init.name
        if classify_parameter(name)[0] == "other" and scopes.get(name):
            name = scopes[name]
        triples.append((name, list(init.dims), _elem_type_name(init.data_type)))
    return count_parameters(triples)


def onnx_report(path: str) -> dict[str, Any]:
    """Inputs, outputs, opsets, op histogram and parameters of one ONNX file (external data is not loaded)."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    graph = model.graph
    from transduce.verify.opcheck import op_name

    ops = Counter(op_name(n) for n in _nodes(graph))
    return {
        "file": os.path.basename(path),
        "bytes": os.path.getsize(path),
        "ir_version": model.ir_version,
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "opsets": {(op.domain or "ai.onnx"): op.version for op in model.opset_import},
        "inputs": [_value_info(v) for v in graph.input],
        "outputs": [_value_info(v) for v in graph.output],
        "nodes": sum(ops.values()),
        "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "functions": {f.name: len(f.node) for f in model.functions},
        "external_data": any(i.data_location == onnx.TensorProto.EXTERNAL for i in graph.initializer),
        "parameters": _graph_parameters(graph),
    }


def _model_config_in(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The model config inside a manifest: the first top-level object with a d_model field."""
    for key in ("model", "config", "model_config"):
        if isinstance(doc.get(key), dict) and "d_model" in doc[key]:
            return doc[key]
    return next((v for v in doc.values() if isinstance(v, dict) and "d_model" in v), None)


def inspect_artifact_dir(directory: str, verify: bool = False) -> dict[str, Any]:
    """Report of an exported artifact: manifest figures, each ONNX graph, the runtime's verdict on it."""
    from transduce.formats.artifact import read_manifest
    from transduce.formats.kinds import ARTIFACT_KIND

    path = os.path.join(directory, MANIFEST_FILE)
    manifest = read_json_file(path, ArtifactError)
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
    try:
        read_manifest(directory, verify_hashes=verify)
        report["runtime_check"] = "ok"
    except ArtifactError as e:
        report["runtime_check"] = str(e).split("\n")[0]
    report["files"] = files_report(directory, recorded, verify, problems)
    report["problems"] = problems
    return report


def graphs_report(directory: str, recorded: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """onnx_report of every .onnx file in the directory or listed in the manifest (unreadable ones noted)."""
    from transduce.formats.contract import ENCODER_FILE, STEP_FILE
    from transduce.formats.files import inside_name

    found = {n for n in os.listdir(directory) if n.endswith(".onnx")}
    found |= {n for n in recorded if inside_name(n) and n.endswith(".onnx")}  # files_report names the others
    names = sorted(found, key=lambda n: ({ENCODER_FILE: 0, STEP_FILE: 1}.get(n, 2), n))
    graphs = {}
    for name in names:
        fpath = os.path.join(directory, name)
        if not os.path.isfile(fpath):
            continue  # listed but missing: files_report says so
        try:
            graphs[name] = onnx_report(fpath)
        except Exception as e:  # onnx raises protobuf DecodeError and others on a corrupt file
            problems.append(f"{fpath} cannot be read as ONNX ({type(e).__name__}: {e})")
    return graphs


# -- engine directories ----------------------------------------------------------------------------------


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


def inspect_engine_dir(directory: str, verify: bool = False) -> dict[str, Any]:
    """Report of a TensorRT engine directory: engine.json shown generically, what it was built for picked
    out, and the copy of the artifact it holds (manifest, ONNX graphs) where there is one."""
    path = os.path.join(directory, ENGINE_FILE)
    engine = read_json_file(path, ArtifactError)
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
            report["manifest"] = {k: v for k, v in read_json_file(mpath, ArtifactError).items() if k != "files"}
            report["config"] = report["config"] or _model_config_in(report["manifest"])
        except ArtifactError as e:
            problems.append(str(e))
    report["runtime_check"] = engine_runtime_check(directory, verify)
    report["files"] = files_report(directory, recorded, verify, problems)
    report["problems"] = problems
    return report


def engine_runtime_check(directory: str, verify: bool) -> str:
    """The TensorRT backend's own reader on the directory, without comparing the TensorRT version and GPU it
    was built for with this machine's: "ok", or why the runtime would refuse it."""
    try:
        from transduce.formats.engine import read_engine_manifest
    except ImportError as e:
        return f"not checked ({e})"
    try:
        read_engine_manifest(directory, verify_hashes=verify)
    except TransduceError as e:
        return str(e).split("\n")[0]
    return "ok"


# -- rendering ----------------------------------------------------------------------------------------------


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


def _compact(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(", ", ": "))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def flatten(doc: dict[str, Any], prefix: str = "", depth: int = 2,
            tables: list | None = None) -> list[tuple[str, str]]:
    """Nested objects -> (dotted key, compact value) rows, objects expanded `depth` levels.

    With `tables` (a list), a list of objects (engine profiles, validation errors) is appended to it as
    (dotted key, list) to be shown as a table of its own, and its row says so.
    """
    rows = []
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and depth > 0:
            rows.extend(flatten(value, name + ".", depth - 1, tables))
        elif tables is not None and isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables.append((name, value))
            rows.append((name, f"{len(value)} entries, below"))
        else:
            rows.append((name, _compact(value)))
    return rows


def _records_table(title: str, records: list[dict[str, Any]]):
    """A list of objects as a table: one row each, one column per key (in order of appearance)."""
    from rich.table import Table

    columns = list(dict.fromkeys(k for r in records for k in r))
    cells = [[_compact(r[c], 60) if c in r else "" for c in columns] for r in records]
    table = Table(box=None, padding=(0, 1))
    for i, col in enumerate(columns):
        short = max(len(col), *(len(row[i]) for row in cells)) <= 16  # names and numbers: never folded
        table.add_column(_plain(col), no_wrap=short, overflow="ellipsis" if short else "fold")
    for row in cells:
        table.add_row(*(_plain(c) for c in row))
    return _titled(title, table)


def _key_value_table(title: str, rows: list[tuple[str, str]]):
    from rich.table import Table

    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="cyan", no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(_plain(key), _plain(value))
    return _titled(title, table)


def _titled(title: str, renderable):
    """A section: its title on a line of its own (never wrapped to the table's width), then the table."""
    from rich.console import Group
    from rich.text import Text

    return Group(Text(title, style="bold italic"), renderable)


def _plain(value: Any):
    """Text shown as is: values from description files are never read as rich markup."""
    from rich.text import Text

    return value if isinstance(value, Text) else Text(str(value))


def _parameters_table(title: str, params: dict[str, Any]):
    from rich.table import Table

    total = params["total"] or 1
    table = Table(box=None, padding=(0, 2))
    table.add_column("group", style="cyan")
    table.add_column("parameters", justify="right")
    table.add_column("share", justify="right")
    for name, component in params["components"].items():
        n = component["parameters"]
        table.add_row(_plain(name), f"{n:,}", f"{100 * n / total:.1f}%", style="bold")
        for kind, k in component["kinds"].items():
            if kind != name:
                table.add_row(_plain(f"  {kind}"), f"{k:,}", f"{100 * k / total:.1f}%")
    for stack, per_layer in params["layers"].items():
        if per_layer:
            table.add_row(f"{stack} per layer", " / ".join(f"{n:,}" for n in per_layer), "")
    table.add_row("total", f"{params['total']:,}", ", ".join(f"{k} {v:,}" for k, v in params["dtypes"].items()),
                  style="bold")
    return _titled(title, table)


def _io_table(title: str, graph: dict[str, Any]):
    from rich.table import Table

    table = Table(box=None, padding=(0, 2))
    for col in ("", "name", "dtype", "shape"):
        table.add_column(col, style="cyan" if col == "name" else None)
    for side in ("inputs", "outputs"):
        for v in graph[side]:
            shape = "?" if v["shape"] is None else "(" + ", ".join(str(d) for d in v["shape"]) + ")"
            table.add_row(side[:-1], _plain(v["name"]), _plain(v["dtype"]), _plain(shape))
    return _titled(title, table)


def _files_table(files: list[dict[str, Any]], title: str = "files"):
    from rich.table import Table

    table = Table(box=None, padding=(0, 2))
    for col in ("name", "bytes", "size", "recorded", "sha256"):
        table.add_column(col, justify="right" if col in ("bytes", "size") else "left")
    for f in files:
        sha = {True: "[green]ok[/]", False: "[red]MISMATCH[/]", None: "not checked" if f["sha256"] else "-"}
        recorded = ("-" if f["recorded_bytes"] is None else "[red]missing[/]" if f["bytes"] is None
                    else "yes" if f["recorded_bytes"] == f["bytes"] else "[red]differs[/]")
        table.add_row(_plain(f["name"]), "-" if f["bytes"] is None else f"{f['bytes']:,}", _human_bytes(f["bytes"]),
                      recorded, sha[f["sha256_ok"]])
    return _titled(title, table)


def render_report(report: dict[str, Any], console=None) -> None:
    """Print a report as rich tables (to `console`, default stdout)."""
    from rich.text import Text

    from transduce._console import console as make_console

    console = console or make_console()  # 140 columns into a file or pipe: names are not cut to fit 80
    console.print(Text.assemble((report["kind"], "bold"), " ", report["path"]))
    sections = []
    if report["kind"] == "engine" and report.get("built_for"):
        sections.append(_key_value_table("built for", [(k, _compact(v)) for k, v in report["built_for"].items()]))
    if report.get("config"):
        sections.append(_key_value_table("model config", flatten(report["config"])))
    if report.get("tokenizer"):
        sections.append(_key_value_table("tokenizer", [("vocab_size", str(report["tokenizer"]["vocab_size"]))]))
    if report.get("parameters"):
        sections.append(_parameters_table("parameters (from model.safetensors)", report["parameters"]))
    if report.get("training"):
        sections.append(_key_value_table("training", flatten(report["training"], depth=1)))
    for name, graph in (report.get("graphs") or {}).items():
        sections.extend(_graph_sections(name, graph))
    for key, title in (("manifest", "manifest"), ("engine", ENGINE_FILE)):
        if report.get(key):
            sections.extend(_document_sections(title, report[key], report))
    if "runtime_check" in report:
        ok = report["runtime_check"] == "ok"
        rows = [("loads", Text(report["runtime_check"], style="green" if ok else "red"))]
        if report["kind"] == "engine":
            rows.append(("checked", "files and formats, not whether this machine has the TensorRT and GPU"))
        sections.append(_key_value_table("runtime", rows))
    sections.append(_files_table(report["files"]))
    for section in sections:
        console.print()
        console.print(section)
    if report["problems"]:
        console.print()
        console.print("[bold red]problems[/]")
        for problem in report["problems"]:
            console.print(Text.assemble("  ", ("-", "red"), " ", problem), highlight=False)


def _document_sections(title: str, doc: dict[str, Any], report: dict[str, Any]) -> list:
    """A manifest or engine.json: its figures as key/value rows, its lists of objects as tables.

    Left out here (they are in the JSON report): the model config and, when the graphs were read from
    their files, the manifest's own per-graph summaries, both shown in their own sections.
    """
    skip = {k for k, v in doc.items() if v == report.get("config")}
    if title == "manifest" and report.get("graphs"):
        skip.add("graphs")
    tables: list = []
    rows = flatten({k: v for k, v in doc.items() if k not in skip}, tables=tables)
    return [_key_value_table(title, rows)] + [_records_table(f"{title}: {name}", records) for name, records in tables]


def _graph_sections(name: str, graph: dict[str, Any]) -> list:
    """The tables of one ONNX graph: summary, inputs/outputs, op histogram, parameters."""
    summary = [
        ("file size", f"{_human_bytes(graph['bytes'])} ({graph['bytes']:,} bytes)"),
        ("opsets", ", ".join(f"{d} {v}" for d, v in graph["opsets"].items())),
        ("ir_version", str(graph["ir_version"])),
        ("producer", graph["producer"] or "-"),
        ("nodes", f"{graph['nodes']:,}"),
        ("ops", ", ".join(f"{op} ×{n}" for op, n in graph["ops"].items())),
    ]
    if graph["functions"]:
        summary.append(("functions", ", ".join(f"{f} ({n} nodes)" for f, n in graph["functions"].items())))
    if graph["external_data"]:
        summary.append(("weights", "external data file"))
    return [
        _key_value_table(f"graph {name}", summary),
        _io_table(f"{name}: inputs and outputs", graph),
        _parameters_table(f"{name}: parameters (initializers)", graph["parameters"]),
    ]
