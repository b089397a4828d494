"""What the runtime checks of an artifact or an engine directory before it loads anything heavy, in one place:
the backends call these (every load of an artifact or engine directory), and so does `transduce inspect`,
which reports what they raise: inspect refuses what the runtime refuses.

check_artifact: the manifest (formats.artifact.Artifact.load: its fields, that it lists every graph file the
directory holds, every file it lists with its size and, with verify_hashes, its sha256, its model config
against the copy of config.json it lists), then each
graph the runtime may load, read from its header: its declared inputs and outputs against the IO contract
for the manifest's precision and model config, and whether it holds quantized ops as the manifest says.
check_engine_dir: engine.json and the copy of the artifact the directory holds
(formats.engine.EngineDir.load; with `runtime`, the TensorRT version and GPU too).

The graphs' headers are read from the protobuf wire format directly (read_graph_header): an export keeps
its weights inline below 1.5 GB, and onnx.load would read and copy every weight at each load to learn the
names, dtypes and dims of a few dozen tensors; this reads those and skips over the weights' bytes.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from transduce.errors import ArtifactError
from transduce.formats import contract
from transduce.formats.artifact import QUANTIZATION_METHODS, QUANTIZED_FILES, QUANTIZED_OP_TYPES, Artifact
from transduce.formats.dtypes import onnx_type
from transduce.formats.engine import EngineDir, RuntimeInfo

# the graphs a backend may load, each checked when the manifest lists it (the ONNX Runtime step graph is optional)
RUNTIME_GRAPHS = contract.GRAPH_FILES

# protobuf wire types (the ones ONNX's messages use) and the ONNX field numbers read here (onnx/onnx.proto)
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_MODEL_GRAPH = 7
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_INPUT, _GRAPH_OUTPUT = 1, 5, 11, 12
_NODE_OP_TYPE = 4
_TENSOR_NAME = 8
_VALUE_NAME, _VALUE_TYPE = 1, 2
_TYPE_TENSOR = 1
_TENSOR_ELEM_TYPE, _TENSOR_SHAPE = 1, 2
_SHAPE_DIM = 1
_DIM_VALUE, _DIM_PARAM = 1, 2

IOTriple = tuple[str, str, Any]  # (name, dtype, dims: a tuple of sizes and axis names (None: unknown), or None)


@dataclass(frozen=True)
class GraphHeader:
    """What an ONNX graph declares: its inputs (initializers left out, as ONNX Runtime leaves them out) and
    outputs as (name, dtype, dims), and the op types of its top-level nodes."""

    inputs: list[IOTriple]
    outputs: list[IOTriple]
    op_types: frozenset[str]


# -- reading a graph's header --------------------------------------------------------------------------


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("a varint runs past its message or past 10 bytes")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf, start: int, end: int) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of each field of the message in buf[start:end]: an int for a varint,
    the (start, end) of a length-delimited field's bytes, None for a fixed-size one."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _varint(buf, pos, end)
        elif wire == _LEN:
            size, pos = _varint(buf, pos, end)
            value, pos = (pos, pos + size), pos + size
        elif wire in (_FIXED64, _FIXED32):
            value, pos = None, pos + (8 if wire == _FIXED64 else 4)
        else:
            raise ValueError(f"wire type {wire}, which no ONNX message uses")
        if pos > end:
            raise ValueError("a field runs past the end of its message")
        yield number, wire, value


def _submessages(buf, span: tuple[int, int], number: int) -> Iterator[tuple[int, int]]:
    """The spans of the length-delimited fields `number` of a message."""
    return (v for n, w, v in _fields(buf, *span) if n == number and w == _LEN)


def _text(buf, span: tuple[int, int]) -> str:
    return bytes(buf[span[0] : span[1]]).decode("utf-8", "replace")


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _dim(buf, span: tuple[int, int]) -> int | str | None:
    for n, w, v in _fields(buf, *span):
        if n == _DIM_VALUE and w == _VARINT:
            return _signed(v)
        if n == _DIM_PARAM and w == _LEN:
            return _text(buf, v)
    return None


def _value_info(buf, span: tuple[int, int]) -> IOTriple:
    """A ValueInfoProto -> (name, dtype, dims); a value that is not a tensor gets dtype "not a tensor"."""
    name, dtype, dims = "", "not a tensor", None
    for n, w, v in _fields(buf, *span):
        if n == _VALUE_NAME and w == _LEN:
            name = _text(buf, v)
        elif n == _VALUE_TYPE and w == _LEN:
            for tensor in _submessages(buf, v, _TYPE_TENSOR):
                elem = 0
                for tn, tw, tv in _fields(buf, *tensor):
                    if tn == _TENSOR_ELEM_TYPE and tw == _VARINT:
                        elem = tv
                    elif tn == _TENSOR_SHAPE and tw == _LEN:  # repeated shape fields merge: their dims add up
                        dims = (dims or ()) + tuple(_dim(buf, d) for d in _submessages(buf, tv, _SHAPE_DIM))
                dtype = onnx_type(elem)
    return name, dtype, dims


def _graph_header(buf, size: int) -> GraphHeader:
    graphs = list(_submessages(buf, (0, size), _MODEL_GRAPH))
    if not graphs:
        raise ValueError("it holds no graph")
    inputs, outputs, initializers, ops = [], [], set(), set()
    for graph in graphs:  # a message repeated merges: its repeated fields add up
        for n, w, v in _fields(buf, *graph):
            if w != _LEN:
                continue
            if n == _GRAPH_INPUT:
                inputs.append(_value_info(buf, v))
            elif n == _GRAPH_OUTPUT:
                outputs.append(_value_info(buf, v))
            elif n == _GRAPH_INITIALIZER:  # its name only: its data is skipped over
                initializers.update(_text(buf, s) for s in _submessages(buf, v, _TENSOR_NAME))
            elif n == _GRAPH_NODE:
                ops.update(_text(buf, s) for s in _submessages(buf, v, _NODE_OP_TYPE))
    return GraphHeader([i for i in inputs if i[0] not in initializers], outputs, frozenset(ops))


def read_graph_header(path: str) -> GraphHeader:
    """The inputs, outputs and op types an ONNX file declares, its weights skipped (see the module docstring);
    ValueError for a file that is not an ONNX model, OSError for one that cannot be read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError("it is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _graph_header(buf, size)


# -- the checks ---------------------------------------------------------------------------------------------


def check_graph_io(artifact: Artifact, graph_file: str, inputs: Sequence[IOTriple],
                   outputs: Sequence[IOTriple]) -> None:
    """Refuse a graph whose inputs and outputs (name, dtype, dims) are not the contract's for the manifest's
    precision and model config (a graph swapped in from another export, a hand-edited manifest)."""
    config, precision = artifact.config, artifact.precision
    want_in, want_out = contract.graph_io(graph_file, config.decoder_layers)
    problems = contract.io_mismatches("input", inputs, want_in, precision, config)
    problems += contract.io_mismatches("output", outputs, want_out, precision, config)
    if problems:
        raise ArtifactError(f"{artifact.files.display(graph_file)} does not match its manifest "
                            f"({precision}, {config.decoder_layers} decoder layers): "
                            + "; ".join(problems[:4]), hint=artifact.rebuild_hint())


def check_quantization(artifact: Artifact, graph_file: str, op_types: frozenset[str]) -> None:
    """Refuse a graph whose quantized operators are not what the manifest says: the backend keeps quantized
    graphs off the GPU providers and off decoding a batch in parts on the manifest's word. A claim of a method
    this transduce does not know (a hand edit) is left to what reads it (parity refuses it)."""
    method = artifact.quantization
    found = sorted(op_types & set(QUANTIZED_OP_TYPES))
    listed = method is not None and graph_file in QUANTIZED_FILES
    if found and not listed:
        records = ("no quantization" if method is None
                   else f"{method} quantization of {' and '.join(QUANTIZED_FILES)} only")
        says = f"{graph_file} has quantized operators ({', '.join(found)}), but its manifest records {records}"
    elif not found and listed and method in QUANTIZATION_METHODS:
        says = (f"its manifest says {method} quantization, but {graph_file} has no quantized operator "
                f"({', '.join(QUANTIZED_OP_TYPES)})")
    else:
        return
    raise ArtifactError(f"{artifact.path}: {says}", hint=artifact.rebuild_hint())


def check_artifact(artifact: str | os.PathLike | Artifact, verify_hashes: bool = True) -> Artifact:
    """Every check the runtime makes of an artifact before loading its graphs (the module docstring), on the
    files Artifact.load holds open -> the Artifact. Raises ArtifactError naming the export command that makes
    it again."""
    if not isinstance(artifact, Artifact):
        artifact = Artifact.load(artifact, verify_hashes=verify_hashes)
    for graph_file in (g for g in RUNTIME_GRAPHS if artifact.lists(g)):
        try:
            header = read_graph_header(artifact.file(graph_file))
        except (OSError, ValueError) as e:
            raise ArtifactError(f"{artifact.files.display(graph_file)} cannot be read as an ONNX model ({e})",
                                hint=artifact.rebuild_hint()) from None
        check_graph_io(artifact, graph_file, header.inputs, header.outputs)
        check_quantization(artifact, graph_file, header.op_types)
    return artifact


def check_engine_dir(engine_dir: str | os.PathLike, verify_hashes: bool = True,
                     runtime: RuntimeInfo | None = None) -> EngineDir:
    """Every check the TensorRT backend makes of an engine directory before TensorRT loads its plans (with
    `runtime`, the TensorRT version and GPU they were built for too) -> the EngineDir (engine.json, and the
    copy of the artifact it holds). The copy's graphs are not read: the plans run, and TensorRT checks their
    IO when it loads them (tensorrt_runner.py)."""
    return EngineDir.load(engine_dir, verify_hashes=verify_hashes, runtime=runtime)
