"""The ONNX graphs of an artifact (or of the artifact copy in an engine directory), as `transduce inspect`
reports them: inputs and outputs (symbolic dims by name), opsets, op histogram and parameter count from the
initializers. onnx is imported by the functions that read a graph, not by this module.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

from transduce.formats.contract import ENCODER_FILE, STEP_FILE
from transduce.formats.dtypes import onnx_type
from transduce.inspect.parameters import classify_parameter, count_parameters
from transduce.io.files import inside_name

GRAPH_ORDER = {ENCODER_FILE: 0, STEP_FILE: 1}  # the contract's graphs first, the others by name


def _value_info(value) -> dict[str, Any]:
    """An ONNX graph input/output -> {name, dtype, shape}; dims by value, by symbolic name, or "?"."""
    t = value.type
    if not t.HasField("tensor_type"):
        return {"name": value.name, "dtype": t.WhichOneof("value") or "?", "shape": None}
    tt = t.tensor_type
    shape = None
    if tt.HasField("shape"):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
    return {"name": value.name, "dtype": onnx_type(tt.elem_type), "shape": shape}


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
        triples.append((name, list(init.dims), onnx_type(init.data_type)))
    return count_parameters(triples)


def onnx_report(path: str) -> dict[str, Any]:
    """Inputs, outputs, opsets, op histogram and parameters of one ONNX file (external data is not loaded)."""
    import onnx

    from transduce.verify.opcheck import op_name

    model = onnx.load(path, load_external_data=False)
    graph = model.graph
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


def graphs_report(directory: str, recorded: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """onnx_report of every .onnx file in the directory or listed in the manifest (unreadable ones noted)."""
    found = {n for n in os.listdir(directory) if n.endswith(".onnx")}
    found |= {n for n in recorded if inside_name(n) and n.endswith(".onnx")}  # files_report names the others
    graphs = {}
    for name in sorted(found, key=lambda n: (GRAPH_ORDER.get(n, 2), n)):
        fpath = os.path.join(directory, name)
        if not os.path.isfile(fpath):
            continue  # listed but missing: files_report says so
        try:
            graphs[name] = onnx_report(fpath)
        except Exception as e:  # onnx raises protobuf DecodeError and others on a corrupt file
            problems.append(f"{fpath} cannot be read as ONNX ({type(e).__name__}: {e})")
    return graphs
