"""Does TensorRT's ONNX parser take every node of a graph? Checked on every export.

The list of supported operators is tensorrt_onnx_ops.txt beside this file, copied from
onnx/onnx-tensorrt's docs/operators.md (its header names the version and date). A node fails the
check when its operator is not on the list, when it is in any domain other than the default ONNX
one (com.microsoft contrib ops, torch's custom domains: TensorRT parses none of them), or when it
breaks one of the restrictions below, taken from the same table's "Restrictions" column (only the
ones an exported Transformer can run into; constant folding normally satisfies them).

`onnx` is imported only by the functions that load a graph from a path.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from typing import Any

from transduce.errors import ExportError

OPS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tensorrt_onnx_ops.txt")
DEFAULT_DOMAINS = ("", "ai.onnx")

_REDUCE_OPS = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
               "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare")
# op type -> input index that must be a build-time constant (an initializer or a Constant node's output)
CONSTANT_INPUTS: dict[str, int] = {
    **{op: 1 for op in _REDUCE_OPS},  # "`axes` must be an initializer"
    "Squeeze": 1,  # "`axes` must be resolvable to a constant"
    "Unsqueeze": 1,
    "CumSum": 1,  # "`axis` must be a build-time constant"
    "OneHot": 1,  # "`depth` must be a build-time constant"
    "TopK": 1,  # "`K` input must be less than 3840" (checkable only when constant)
    "Dropout": 2,  # "`is_training` must be an initializer and evaluate to False"
}


@functools.lru_cache(maxsize=4)
def supported_ops(path: str = OPS_FILE) -> frozenset[str]:
    """The operator names listed in an ops file (one per line, '#' starts a comment)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.split("#", 1)[0].strip() for line in f]
    except OSError as e:
        raise ExportError(f"cannot read the TensorRT operator list {path}: {e.strerror}",
                          hint="reinstall transduce (the file is package data)") from None
    ops = frozenset(line for line in lines if line)
    if not ops:
        raise ExportError(f"the TensorRT operator list {path} is empty")
    return ops


def ops_source(path: str = OPS_FILE) -> str:
    """The 'Source:' sentence of the ops file's header, for the manifest."""
    with open(path, encoding="utf-8") as f:
        header = [line[1:].strip() for line in f if line.startswith("#")]
    text = " ".join(h for h in header if h)
    start = text.find("Source:")
    end = text.find(";", text.find("Copied on"))
    return text[start:end] if start >= 0 and end > start else text[:300]


def iter_nodes(graph) -> Any:
    """Every node of an onnx GraphProto, subgraphs (If/Loop/Scan bodies) included."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from iter_nodes(attr.g)
            for g in attr.graphs:
                yield from iter_nodes(g)


def op_name(node) -> str:
    """'Op' for the default domain, 'domain::Op' otherwise."""
    return node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}::{node.op_type}"


def op_histogram(model) -> dict[str, int]:
    """{op: count} over the main graph, its subgraphs and its local functions, most frequent first."""
    counts = Counter(op_name(n) for n in iter_nodes(model.graph))
    for fn in model.functions:
        counts.update(op_name(n) for n in fn.node)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _constant_names(graph) -> set[str]:
    names = {init.name for init in graph.initializer}
    names.update(o for n in graph.node if n.op_type == "Constant" for o in n.output)
    return names


def unsupported_nodes(model, supported: frozenset[str] | None = None) -> list[str]:
    """Human-readable problems, one per offending node (empty when TensorRT can parse the graph)."""
    supported = supported_ops() if supported is None else supported
    problems = []
    if model.functions:
        names = ", ".join(f"{f.domain}::{f.name}" for f in model.functions)
        problems.append(f"the graph defines local functions ({names}); TensorRT parses only plain ONNX nodes")
    constants = _constant_names(model.graph)
    for node in iter_nodes(model.graph):
        label = f"{op_name(node)} node {node.name!r}"
        if node.domain not in DEFAULT_DOMAINS or node.op_type not in supported:
            problems.append(f"{label}: operator not supported by TensorRT's ONNX parser")
            continue
        idx = CONSTANT_INPUTS.get(node.op_type)
        if idx is not None and len(node.input) > idx and node.input[idx] and node.input[idx] not in constants:
            problems.append(f"{label}: input {idx} ({node.input[idx]!r}) must be a constant for TensorRT")
        if node.op_type == "LayerNormalization" and any(o for o in node.output[1:]):
            problems.append(f"{label}: only the first output (Y) is supported by TensorRT")
    return problems


def check_tensorrt_support(model, graph_name: str, supported: frozenset[str] | None = None) -> dict[str, int]:
    """Raise ExportError if TensorRT cannot parse a node of `model`; return its op histogram."""
    problems = unsupported_nodes(model, supported)
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise ExportError(
            f"{graph_name} has {len(problems)} node(s) TensorRT's ONNX parser does not support:\n  {shown}",
            hint=f"change the model code so the exporter emits supported operators (list: {OPS_FILE})",
        )
    return op_histogram(model)


def check_file(path: str | os.PathLike) -> list[str]:
    """unsupported_nodes() of an .onnx file (weights are not loaded)."""
    import onnx

    return unsupported_nodes(onnx.load(os.fspath(path), load_external_data=False))
