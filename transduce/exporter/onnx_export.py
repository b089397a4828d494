"""`transduce export`: a model directory -> a self-describing artifact directory.

  OUT_DIR/
    encoder.onnx        Transformer.encode, exactly per transduce/formats/contract.py
    decoder_step.onnx   Transformer.decode_step: one graph for every step, past length 0 included
    decoder_step.attn.onnx  the same step that also gives the cross-attention (alignments read it); one trace
                        writes both, decoder_step.onnx being this graph less that output and the nodes only
                        it reads (the same nodes and weights as a trace of its own)
    decoder_step.ort.onnx  fp32 post-norm models: the same step with ONNX Runtime's fused contrib ops,
                        built from the weights (transduce/exporter/ort_step.py), validated like the others;
                        left out with ort_step_graph=False (`--no-ort-step`); its weights always inline,
                        so it is not made for a model whose step weights pass 1.8 GB (protobuf's 2 GB limit)
    (encoder.onnx and decoder_step.onnx: a graph whose weights pass 1.5 GB, torch.onnx's threshold below
    protobuf's 2 GB limit, keeps them in <name>.data beside it, listed and hashed in the manifest)
    config.json         copied from the model directory, with
    tokenizer.json      ... the tokenizer: the artifact is all a runtime needs
    manifest.json       kind, contract_version, precision, opset, tool versions, the model config, the
                        source model and its weights' sha256, the dynamic axes and their ranges, per
                        graph its IO and op histogram, the validation errors, export time, and
                        files = {name: {sha256, bytes}} for every other file (read_manifest
                        checks them)

`export_artifact` loads the model strictly (checkpoint.load_model_dir), traces both graphs, checks
them (transduce/verify/graph_checks.py: ONNX checker, shape inference, the IO contract, TensorRT's
operator list, the fp32 islands of fp16/bf16 graphs), validates them numerically against the eager
fp32 model, and only then renames the finished directory into place (`atomic_directory`): a failure
at any point leaves no artifact, and an existing OUT_DIR is replaced only with force=True.

torch.onnx.export with dynamo=True (torch.export) and dynamic shapes from the contract's axes, opset 18 by
default (17..23 allowed); fp16/bf16 graphs are traced from a cast copy of the model and keep fp32 islands
(LayerNorm, softmax, log_softmax, the residual sums) for strongly typed TensorRT builds. Why these choices,
with the measurements: docs/design/exporter.md.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import logging
import os
import platform
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transduce.errors import CheckpointError, ExportError, TransduceError
from transduce.formats import contract
from transduce.formats.artifact import PRECISIONS, artifact_manifest, quantization, read_manifest, write_manifest
from transduce.formats.kinds import (
    ENGINE_MANIFEST_FILE,
    MANIFEST_FILE,
    MODEL_CONFIG_FILE,
    WEIGHTS_FILE,
    is_artifact_dir,
)
from transduce.formats.model_config import ModelConfig
from transduce.formats.model_dir import TOKENIZER_FILE, ModelDir, weights_sha256
from transduce.formats.weights import weight_shapes
from transduce.io.atomic import atomic_output
from transduce.io.files import file_entries
from transduce.io.locks import output_lock
from transduce.io.paths import check_free_space, check_replaceable

DEFAULT_OPSET = 18
MIN_OPSET, MAX_OPSET = 17, 23
MIN_MAX_POSITIONS = 4  # trace sizes must be distinct and >= 2 (graphs.trace_sizes)
# Room for what an export writes besides the weights: the graphs' nodes, the manifest (a few MB at most)
OTHER_EXPORT_BYTES = 16 * 2**20
EXPORTER = "torch.onnx.export(dynamo=True) (torch.export, onnxscript optimizer)"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # torch.onnx colours its error messages

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# -- checks before any work ----------------------------------------------------------------------


def onnxruntime_version() -> str:
    """The installed onnxruntime's version, read from its package metadata (importing it takes seconds)."""
    from importlib import metadata

    for package in ("onnxruntime", "onnxruntime-gpu"):  # the `cpu` and the `gpu` extra's
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def check_options(precision: str, opset: int) -> None:
    if precision not in PRECISIONS:
        raise ExportError(f"unknown precision {precision!r}", hint=f"choose one of {', '.join(PRECISIONS)}")
    if not MIN_OPSET <= int(opset) <= MAX_OPSET:
        raise ExportError(
            f"opset {opset} is not supported: transduce exports opsets {MIN_OPSET}..{MAX_OPSET} (LayerNormalization "
            f"needs >= {MIN_OPSET}; {MAX_OPSET} is the newest its graphs are checked with; onnxruntime "
            f"{onnxruntime_version()} is installed)",
            hint=f"use --opset {DEFAULT_OPSET} (the default)",
        )


def check_quantize(quantize: str, config: ModelConfig, precision: str) -> None:
    """Refuse a quantization this model and precision cannot have (quantize.unsupported_reason)."""
    from transduce.exporter import quantize as q

    reason = q.unsupported_reason(quantize, config, precision)
    if reason:
        raise ExportError(f"cannot quantize: {reason}",
                          hint="--quantize int8 needs --precision fp32 and a post-norm model")


def check_out_path(model_dir: str, out_dir: str) -> None:
    """Refuse an OUT_DIR over or inside the model directory: checked before OUT_DIR's lock is taken (beside it)."""
    real_out, real_model = os.path.realpath(out_dir), os.path.realpath(model_dir)
    if real_out == real_model or real_model.startswith(real_out + os.sep):
        raise ExportError(f"the output directory {out_dir!r} would replace the model directory {model_dir!r}",
                          hint="choose another output directory")
    if real_out.startswith(real_model + os.sep):  # the next checkpoint of that model would delete it
        raise ExportError(f"the output directory {out_dir!r} is inside the model directory {model_dir!r}",
                          hint="choose an output directory outside it")


def check_destination(model_dir: str, out_dir: str, force: bool) -> bool:
    """Refuse an existing OUT_DIR without force, and never replace something that is not an artifact."""
    check_out_path(model_dir, out_dir)
    if os.path.isfile(os.path.join(out_dir, ENGINE_MANIFEST_FILE)):  # an engine directory holds a manifest copy
        raise ExportError(f"{out_dir!r} is an engine directory (transduce build); --force replaces only artifacts",
                          hint="choose another output directory")
    return check_replaceable(out_dir, force, is_artifact_dir, "an artifact directory", "artifacts", ExportError)


def graph_weights(cfg: ModelConfig) -> tuple[int, int]:
    """The weight elements of encoder.onnx and of decoder_step.onnx: each holds the positional table and its
    embedding; the encoder also the decoder layers' cross-attention K/V projections, the step graph the rest of
    the decoder (and the output projection of a model without shared embeddings)."""
    import math

    # the sinusoidal table is a constant of each graph; learned ones are weights (encoder_/decoder_positions)
    encoder = step = cfg.max_positions * cfg.d_model if cfg.positions == "sinusoidal" else 0
    for name, shape in weight_shapes(cfg).items():
        n = math.prod(shape)
        in_encoder = ".cross_attn.k_proj." in name or ".cross_attn.v_proj." in name or name.startswith(
            ("encoder", "src_embed"))
        encoder += n if in_encoder or (name == "embed.weight" and cfg.share_embeddings) else 0
        step += 0 if in_encoder else n
    return encoder, step


def export_bytes(cfg: ModelConfig, precision: str, quantize: str | None = None, ort_step_graph: bool = True,
                 copied: int = 0) -> int:
    """An estimate of the most bytes an export has on the disk at once: both graphs' weights at the precision,
    decoder_step.ort.onnx's where it is built, the larger int8 copy written beside its graph while quantizing,
    the `copied` bytes (config, tokenizer), and OTHER_EXPORT_BYTES."""
    from transduce.exporter import ort_step
    from transduce.exporter import quantize as q

    need = (4 if precision == "fp32" else 2) * sum(graph_weights(cfg)) + copied + OTHER_EXPORT_BYTES
    if ort_step_graph and ort_step.unsupported_reason(cfg, precision) is None:
        need += ort_step.weight_bytes(cfg)
        if quantize and q.unsupported_reason(quantize, cfg, precision) is None:
            need += q.copy_bytes(cfg)
    return need


def check_disk_space(source: ModelDir, out_dir: str, precision: str, quantize: str | None,
                     ort_step_graph: bool) -> None:
    """Refuse an export the disk of OUT_DIR has no room for (export_bytes), before the model is even loaded."""
    try:
        copied = sum(source.files.size(n) for n in (MODEL_CONFIG_FILE, TOKENIZER_FILE))
    except OSError:  # loading the model says what is wrong with it
        return
    check_free_space(out_dir, export_bytes(source.config, precision, quantize, ort_step_graph, copied), "the export",
                     ExportError)


def load_source(model_dir: str) -> ModelDir:
    """The model directory, read once and held open: its weights, config and tokenizer are read from one copy."""
    try:
        return ModelDir.load(model_dir)
    except OSError as e:
        raise CheckpointError(f"cannot read the model directory {model_dir!r}: {e}") from None


def load_model(source: str | ModelDir):
    """checkpoint.load_model_dir with OS errors (unreadable files) as CheckpointError."""
    from transduce.models.checkpoint import load_model_dir

    try:
        return load_model_dir(source)
    except OSError as e:
        path = source.path if isinstance(source, ModelDir) else source
        raise CheckpointError(f"cannot read the model directory {path!r}: {e}") from None


def read_copied_files(source: ModelDir) -> dict[str, bytes]:
    """The bytes of the model directory's config.json and tokenizer.json from the copy the model was loaded from
    (the directory is held open: a checkpoint that replaces it meanwhile is not read), checked against what
    config.json records: a file rewritten in place meanwhile is an error."""
    import json

    try:
        out = {name: source.files.read_bytes(name) for name in (MODEL_CONFIG_FILE, TOKENIZER_FILE)}
    except OSError as e:
        raise CheckpointError(f"cannot read the model directory {source.path!r}: {e}") from None
    try:
        same_config = json.loads(out[MODEL_CONFIG_FILE]) == source.description
    except ValueError:
        same_config = False
    same_tokenizer = (hashlib.sha256(out[TOKENIZER_FILE]).hexdigest()
                      == source.description["files"][TOKENIZER_FILE]["sha256"])
    if not (same_config and same_tokenizer):
        raise CheckpointError(f"the model directory {source.path!r} changed while it was being read (a file "
                              "rewritten in place?)", hint="export it again once nothing writes to it")
    return out


# -- tracing -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _torch_onnx_quiet():
    """Silence torch.onnx's progress prints, warnings and logging; yield the captured stdout."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export", "onnxscript")]
    levels = [lg.level for lg in loggers]
    buf = io.StringIO()
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(buf):
            warnings.simplefilter("ignore")
            yield buf
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@dataclass(frozen=True)
class GraphFile:
    """A graph file export_graph writes: where, and what it says of itself."""

    path: str
    doc: str = ""  # the model's doc_string
    metadata: dict[str, str] = field(default_factory=dict)  # added to the model's metadata_props


def export_graph(module, args: tuple, dynamic_shapes: dict, input_names: list[str], output_names: list[str],
                 path: str, opset: int, doc: str = "", metadata: dict[str, str] | None = None,
                 pruned: GraphFile | None = None) -> None:
    """torch.onnx.export (dynamo) of one module to `path`; weights go to `path`.data above 1.5 GB. `pruned`: the
    same trace less its last output, and the nodes only that output reads, written there too (what tracing a
    module without that output gives, node for node and weight for weight, at one trace's cost)."""
    import torch

    label = os.path.basename(path)
    with _torch_onnx_quiet() as captured:
        try:
            program = torch.onnx.export(
                module, args, input_names=input_names, output_names=output_names, opset_version=opset,
                dynamo=True, dynamic_shapes=dynamic_shapes, optimize=True, verbose=False,
            )
        except Exception as e:  # torch.export / torch.onnx raise many unrelated classes
            detail = "\n".join(_ANSI.sub("", str(e)).strip().splitlines()[:12])
            raise ExportError(
                f"torch.onnx could not export {label}: {type(e).__name__}: {detail}\n{captured.getvalue()[-2000:]}",
                hint="the model code must be traceable by torch.export with symbolic batch/src_len/cache_len",
            ) from None
    first = GraphFile(path, doc, dict(metadata or {}))
    _save(program, first)
    if pruned is not None:
        from onnx_ir.passes.common import RemoveUnusedNodesPass

        program.model.graph.outputs.pop()
        RemoveUnusedNodesPass()(program.model)
        for key in first.metadata.keys() - pruned.metadata.keys():  # the second file says only its own
            program.model.metadata_props.pop(key, None)
        _save(program, pruned)


def _save(program, graph: GraphFile) -> None:
    """An ONNXProgram written to graph.path with its doc string and metadata."""
    program.model.doc_string = graph.doc
    program.model.metadata_props.update(graph.metadata)
    program.save(graph.path)


def export_graphs(model, directory: str, precision: str, opset: int, log: Log = _quiet,
                  ort_step_graph: bool = True) -> dict[str, float]:
    """Write encoder.onnx, decoder_step.attn.onnx and decoder_step.onnx for `model` (fp32, eval) in `precision`,
    and decoder_step.ort.onnx where ort_step can build it (unless ort_step_graph is False); -> seconds per trace
    (the step's writes both step graphs) and for the ONNX Runtime step graph."""
    from transduce.exporter import graphs, ort_step

    cfg = model.cfg
    traced = model if precision == "fp32" else copy.deepcopy(model).to(graphs.torch_dtype(precision))
    traced.eval()
    enc_args, step_args = graphs.example_inputs(cfg, precision)
    enc_shapes, step_shapes = graphs.dynamic_shapes(cfg)
    n = cfg.decoder_layers
    seconds = {}

    def graph_file(name: str, filename: str) -> GraphFile:
        return GraphFile(
            os.path.join(directory, filename),
            f"transduce {name} graph, IO contract version {contract.CONTRACT_VERSION}, {precision}",
            {"transduce.graph": name, "transduce.contract_version": str(contract.CONTRACT_VERSION),
             "transduce.precision": precision})

    def trace(name: str, module, args: tuple, shapes: dict, ins: list, outs: list, graph: GraphFile,
              pruned: GraphFile | None = None) -> None:
        log(f"tracing {os.path.basename(graph.path)}{' and ' + os.path.basename(pruned.path) if pruned else ''} "
            f"({precision}, opset {opset})")
        t0 = time.perf_counter()
        export_graph(module.eval(), args, shapes, [s.name for s in ins], [s.name for s in outs], graph.path, opset,
                     graph.doc, graph.metadata, pruned)
        seconds[name] = round(time.perf_counter() - t0, 2)

    trace("encoder", graphs.EncoderGraph(traced), enc_args, enc_shapes, contract.encoder_inputs(),
          contract.encoder_outputs(n), graph_file("encoder", contract.ENCODER_FILE))
    # one trace of the step that gives the cross-attention writes the step without it too (its last output)
    trace("decoder_step", graphs.AttentionStepGraph(traced), step_args, step_shapes, contract.step_inputs(n),
          contract.attn_step_outputs(n), graph_file("decoder_step.attn", contract.ATTN_STEP_FILE),
          graph_file("decoder_step", contract.STEP_FILE))
    if ort_step_graph and ort_step.unsupported_reason(cfg, precision) is None:
        import onnx

        log(f"building {contract.ORT_STEP_FILE} (ONNX Runtime contrib ops)")
        t0 = time.perf_counter()
        onnx.save(ort_step.build_ort_step(model, opset), os.path.join(directory, contract.ORT_STEP_FILE))
        seconds["decoder_step.ort"] = round(time.perf_counter() - t0, 2)
    return seconds


# -- the artifact --------------------------------------------------------------------------------


def tool_versions() -> dict[str, str]:
    import numpy
    import onnx
    import onnxruntime
    import onnxscript
    import torch

    import transduce

    return {"transduce": transduce.__version__, "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "onnxscript": onnxscript.__version__,
            "numpy": numpy.__version__, "python": platform.python_version()}


def _listed_files(directory: str) -> dict[str, dict[str, Any]]:
    """{name: {sha256, bytes}} of every file in the directory but the manifest."""
    return file_entries(directory, [n for n in os.listdir(directory)
                                    if n != MANIFEST_FILE and os.path.isfile(os.path.join(directory, n))])


def export_artifact(model_dir: str | os.PathLike, out_dir: str | os.PathLike, force: bool = False,
                    opset: int = DEFAULT_OPSET, precision: str = "fp32", log: Log | None = None,
                    quantize: str | None = None, ort_step_graph: bool = True) -> dict[str, Any]:
    """Export MODEL_DIR to the artifact OUT_DIR (see the module docstring); -> the manifest.

    ort_step_graph=False leaves out decoder_step.ort.onnx (a second copy of the decoder's weights):
    for artifacts that are built into TensorRT engines or decoded on CUDA only; ONNX Runtime on CPU
    decodes them with decoder_step.onnx, more slowly.

    Raises CheckpointError for a bad model directory and ExportError for everything else (output
    exists, unwritable, tracing failed, a check or the numeric validation failed); nothing is left
    at OUT_DIR then (an existing artifact is kept unless the new one is complete).

    One export into OUT_DIR at a time: OUT_DIR's lock (io.locks) is taken before the model is loaded, and
    another export into it is refused at once, naming the process. So is an export the disk has no room for
    (export_bytes).
    """
    log = log or _quiet
    t_start = time.perf_counter()
    model_dir, out_dir = os.path.abspath(os.fspath(model_dir)), os.path.abspath(os.fspath(out_dir))
    check_options(precision, opset)
    if quantize and not ort_step_graph:
        raise ExportError(f"quantize {quantize!r} quantizes {contract.ORT_STEP_FILE}, which ort_step_graph=False "
                          "leaves out", hint="drop one of the two options", params=("quantize", "ort_step_graph=False"))
    check_out_path(model_dir, out_dir)  # before the lock: OUT_DIR over the model directory would take training's
    with output_lock(out_dir, "the artifact", ExportError):
        replaces = check_destination(model_dir, out_dir, force)  # an existing artifact (not an empty directory)
        source = load_source(model_dir)
        check_disk_space(source, out_dir, precision, quantize, ort_step_graph)
        manifest = _export(source, out_dir, replaces, int(opset), precision, log, quantize, ort_step_graph, t_start)
    log(f"wrote {out_dir} in {time.perf_counter() - t_start:.1f} s")
    return manifest


def _export(source: ModelDir, out_dir: str, replaces: bool, opset: int, precision: str, log: Log,
            quantize: str | None, ort_step_graph: bool, t_start: float) -> dict[str, Any]:
    """export_artifact's work, once OUT_DIR is locked and checked: load, trace, check, validate, write."""
    from transduce.verify import validate
    from transduce.verify.graph_checks import check_graph, check_ort_step_graph

    model, _, cfg = load_model(source)
    copied = read_copied_files(source)
    config = model.cfg
    if quantize:
        check_quantize(quantize, config, precision)
    if model.cfg.max_positions < MIN_MAX_POSITIONS:
        raise ExportError(f"max_positions is {model.cfg.max_positions}; export needs >= {MIN_MAX_POSITIONS}")
    with atomic_output(out_dir, replaces, ExportError, "the artifact",
                       hint="choose an output path you can write to, on a disk with space") as tmp:
        trace_s = export_graphs(model, tmp, precision, opset, log, ort_step_graph=ort_step_graph)
        log("checking graphs (ONNX checker, shape inference, IO contract, TensorRT ops)")
        t0 = time.perf_counter()
        graph_info = {
            contract.ENCODER_FILE: check_graph(os.path.join(tmp, contract.ENCODER_FILE), "encoder",
                                                        config, precision, opset),
            contract.STEP_FILE: check_graph(os.path.join(tmp, contract.STEP_FILE), "decoder_step",
                                                     config, precision, opset),
        }
        if os.path.exists(os.path.join(tmp, contract.ATTN_STEP_FILE)):  # export_graphs writes it; checked as it is
            graph_info[contract.ATTN_STEP_FILE] = check_graph(os.path.join(tmp, contract.ATTN_STEP_FILE),
                                                              "decoder_step.attn", config, precision, opset)
        if os.path.exists(os.path.join(tmp, contract.ORT_STEP_FILE)):
            from transduce.exporter.ort_step import REVISION

            graph_info[contract.ORT_STEP_FILE] = {**check_ort_step_graph(
                os.path.join(tmp, contract.ORT_STEP_FILE), config), "revision": REVISION}
        check_s = time.perf_counter() - t0
        log("validating against eager PyTorch")
        t0 = time.perf_counter()
        validation = validate.validate_graphs(tmp, model, precision, log=log)
        validation["seconds"] = round(time.perf_counter() - t0, 2)
        quantization = None
        graph_bytes = {name: os.path.getsize(os.path.join(tmp, name)) for name in graph_info}  # before quantization
        if quantize:  # the fp32 graphs are validated above; then quantized, and validated again
            from transduce.exporter import quantize as q

            log(f"quantizing {', '.join(q.QUANTIZED_FILES)} ({quantize}, ONNX Runtime dynamic quantization)")
            t0 = time.perf_counter()
            quantization = q.quantize_graphs(tmp, quantize)
            log(f"validating the {quantize} graphs against eager PyTorch")
            quantization["validation"] = validate.validate_graphs(tmp, model, precision, log=log, tolerances=quantize)
            quantization["seconds"] = round(time.perf_counter() - t0, 2)
            quantization["bytes"] = {name: os.path.getsize(os.path.join(tmp, name)) for name in q.QUANTIZED_FILES}
        for name, data in copied.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        files = _listed_files(tmp)
        for name, info in graph_info.items():
            info["bytes"] = graph_bytes[name]  # `graphs` describes the graphs as exported, before any quantization
            info["external_data"] = sorted(f for f in files if f.startswith(name + ".") and f != name)
        manifest = artifact_manifest(
            precision=precision, opset=opset, ort_step_graph=ort_step_graph,
            export_seconds={"total": round(time.perf_counter() - t_start, 2), "trace": trace_s,
                            "check": round(check_s, 2), "validate": validation["seconds"]},
            exporter=EXPORTER, tools=tool_versions(), model=config,
            source_model={"path": source.path, "weights_sha256": cfg["files"][WEIGHTS_FILE]["sha256"],
                          "config_sha256": hashlib.sha256(copied[MODEL_CONFIG_FILE]).hexdigest()},
            graphs=graph_info, tensorrt_ops={"source": _ops_source(), "unsupported": []}, validation=validation,
            quantization=quantization, files=files)
        write_manifest(tmp, manifest)
    return manifest


def reuse_refusal(artifact_dir: str | os.PathLike, model_dir: str | os.PathLike,
                  quantize: str | None = None) -> str | None:
    """Why artifact_dir cannot stand for a fresh fp32 export of model_dir (quantized with `quantize`, or not
    at all) by this exporter; None when it can be reused as it is. The demo and the bench export once and
    reuse the export while this holds."""
    from transduce.exporter import ort_step

    try:
        manifest = read_manifest(artifact_dir)
    except TransduceError as e:
        return f"it is not a valid artifact ({e.args[0]})"
    if manifest.get("source_model", {}).get("weights_sha256") != weights_sha256(model_dir):
        return f"it was exported from other weights than {os.fspath(model_dir)}'s"
    if manifest.get("precision") != "fp32":
        return f"it is {manifest.get('precision')}, not fp32"
    if quantization(manifest) != quantize:
        return f"its quantization is {quantization(manifest) or 'none'}, not {quantize or 'none'}"
    # without decoder_step.ort.onnx (--no-ort-step) though the model can have it, or with an older one than
    # this exporter builds (ONNX Runtime would decode with another step graph than today's)
    return ort_step.stale_reason(manifest)


def _ops_source() -> str:
    from transduce.verify import opcheck

    return opcheck.ops_source()
