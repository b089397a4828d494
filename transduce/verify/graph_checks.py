"""Structural checks of exported graphs, run on every export before anything is written in place:
onnx.checker with full_check, strict shape inference, the IO contract (names, order, dtypes, axis names
and sizes; transduce/formats/contract.py), the opset, no control flow and no training or random ops, the
reduced-precision islands, and TensorRT's operator list (transduce/verify/opcheck.py)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from transduce.errors import ExportError
from transduce.formats import contract
from transduce.formats.dtypes import onnx_type
from transduce.formats.model_config import ModelConfig
from transduce.verify import opcheck
from transduce.verify.graph_runners import ort_unavailable_reason

# No control flow (one straight-line step graph), nothing that only makes sense in training.
FORBIDDEN_OPS = frozenset({"If", "Loop", "Scan", "Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform",
                           "RandomUniformLike", "Bernoulli", "Multinomial"})


# Ops whose first input must stay fp32 in fp16/bf16 graphs (the model computes them in fp32).
FP32_ISLAND_OPS = ("LayerNormalization", "Softmax", "LogSoftmax")


def _value_specs(values) -> list[tuple[str, str, tuple]]:
    """[(name, dtype name, dims)] of graph inputs/outputs; dims are ints or axis-name strings."""
    out = []
    for v in values:
        tt = v.type.tensor_type
        dims = tuple(d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else "?")
                     for d in tt.shape.dim)
        out.append((v.name, onnx_type(tt.elem_type), dims))
    return out


def contract_problems(model, inputs: list[contract.TensorSpec], outputs: list[contract.TensorSpec],
                      config: ModelConfig, precision: str) -> list[str]:
    """Differences between a graph's inputs/outputs and the contract's (empty when it conforms)."""
    return (contract.io_mismatches("input", _value_specs(model.graph.input), inputs, precision, config, exact=True)
            + contract.io_mismatches("output", _value_specs(model.graph.output), outputs, precision, config,
                                     exact=True))


def _value_types(model) -> dict[str, int]:
    """name -> elem_type for every typed value of a shape-inferred graph."""
    types = {init.name: init.data_type for init in model.graph.initializer}
    for v in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        types[v.name] = v.type.tensor_type.elem_type
    for node in model.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    types[node.output[0]] = a.t.data_type
    return types


def precision_problems(inferred_model, precision: str) -> list[str]:
    """In fp16/bf16 graphs, LayerNormalization, Softmax and LogSoftmax must read fp32 (the fp32 islands).

    `inferred_model` must carry shape-inference value_info. Empty list when the islands are intact.
    """
    from onnx import TensorProto

    if precision == "fp32":
        return []
    types = _value_types(inferred_model)
    problems = []
    for node in inferred_model.graph.node:
        if node.op_type in FP32_ISLAND_OPS:
            t = types.get(node.input[0])
            if t != TensorProto.FLOAT:
                name = TensorProto.DataType.Name(t) if t else "unknown"
                problems.append(f"{node.op_type} node {node.name!r} reads {name}, not FLOAT")
    return problems


def check_graph(path: str, graph: str, config: ModelConfig, precision: str, opset: int) -> dict[str, Any]:
    """Structural checks of one exported graph ('encoder', 'decoder_step' or 'decoder_step.attn'); ExportError on
    any failure.

    Returns the manifest's record of the graph (IO, opset, node count, op histogram, weight bytes).
    """
    import onnx

    files = {"encoder": contract.ENCODER_FILE, "decoder_step": contract.STEP_FILE,
             "decoder_step.attn": contract.ATTN_STEP_FILE}
    inputs, outputs = contract.graph_io(files[graph], config.decoder_layers)
    name = os.path.basename(path)
    try:
        onnx.checker.check_model(path, full_check=True)
        proto = onnx.load(path, load_external_data=False)
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    except Exception as e:  # ValidationError, InferenceError, protobuf's DecodeError for an unreadable file
        raise ExportError(f"{name} fails the ONNX checker or shape inference: {type(e).__name__}: {e}") from None
    problems = contract_problems(inferred, inputs, outputs, config, precision)
    opsets = {o.domain or "ai.onnx": o.version for o in proto.opset_import}
    if opsets.get("ai.onnx") != opset:
        problems.append(f"opset is {opsets.get('ai.onnx')}, {opset} was asked for (opsets: {opsets})")
    hist = opcheck.op_histogram(proto)
    bad = sorted(op for op in hist if op in FORBIDDEN_OPS)
    if bad:
        problems.append(f"control-flow or training ops in the graph: {bad}")
    problems += precision_problems(inferred, precision)
    if problems:
        raise ExportError(f"{name} does not conform:\n  " + "\n  ".join(problems),
                          hint="this is a bug in the exporter or the model code; nothing was written")
    opcheck.check_tensorrt_support(proto, name)
    weights = list(proto.graph.initializer)
    return {
        "inputs": [{"name": s.name, "axes": list(s.axes), "dtype": contract.resolve_dtype(s, precision)}
                   for s in inputs],
        "outputs": [{"name": s.name, "axes": list(s.axes), "dtype": contract.resolve_dtype(s, precision)}
                    for s in outputs],
        "opset": opset,
        "ir_version": proto.ir_version,
        "nodes": sum(hist.values()),
        "op_histogram": hist,
        "initializers": len(weights),
        "weight_bytes": sum(_tensor_bytes(t) for t in weights),
    }


def check_ort_step_graph(path: str, config: ModelConfig) -> dict[str, Any]:
    """Structural checks of decoder_step.ort.onnx (the IO contract, that ONNX Runtime loads it); its
    record for the manifest. No TensorRT operator check: its contrib ops are ONNX Runtime's own."""
    import onnx

    name = os.path.basename(path)
    proto = onnx.load(path)
    inputs, outputs = contract.graph_io(contract.ORT_STEP_FILE, config.decoder_layers)
    problems = contract_problems(proto, inputs, outputs, config, "fp32")
    reason = ort_unavailable_reason(path)
    if reason:
        problems.append(reason)
    if problems:
        raise ExportError(f"{name} does not conform:\n  " + "\n  ".join(problems),
                          hint="this is a bug in the exporter (transduce/exporter/ort_step.py); nothing was written")
    hist = opcheck.op_histogram(proto)
    return {
        "inputs": [{"name": s.name, "axes": list(s.axes), "dtype": contract.resolve_dtype(s, "fp32")} for s in inputs],
        "outputs": [{"name": s.name, "axes": list(s.axes), "dtype": contract.resolve_dtype(s, "fp32")}
                    for s in outputs],
        "opsets": {o.domain or "ai.onnx": o.version for o in proto.opset_import},
        "runtime": "onnxruntime only (com.microsoft contrib ops)",
        "nodes": sum(hist.values()),
        "op_histogram": hist,
        "initializers": len(proto.graph.initializer),
        "weight_bytes": sum(_tensor_bytes(t) for t in proto.graph.initializer),
    }


def _tensor_bytes(t) -> int:
    from onnx import helper

    return int(np.prod(t.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
