"""TensorRT operator support: the list in the repo, the exported graphs, and graphs that must be rejected."""

from __future__ import annotations

import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from transduce.errors import ExportError
from transduce.formats.model_config import ModelConfig
from transduce.verify import opcheck


def _graph(nodes, inputs, outputs, initializers=(), opset=18):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)])


def _vi(name, dtype=TensorProto.FLOAT, shape=(2, 3)):
    return helper.make_tensor_value_info(name, dtype, list(shape))


def test_ops_list_is_the_onnx_tensorrt_table():
    ops = opcheck.supported_ops()
    with open(opcheck.OPS_FILE, encoding="utf-8") as f:
        header = f.read(600)
    assert "onnx/onnx-tensorrt" in header and "docs/operators.md" in header and "TensorRT 10.15" in header
    assert {"MatMul", "Gemm", "LayerNormalization", "Softmax", "LogSoftmax", "Where", "GatherND", "Cast"} <= ops
    assert not {"Unique", "BitShift", "ConcatFromSequence", "SequenceAt", "MatMulInteger"} & ops  # the "N" rows
    assert len(ops) > 120


def test_exported_graphs_pass(artifact_fp32):
    for name in ("encoder.onnx", "decoder_step.onnx"):
        assert opcheck.check_file(os.path.join(artifact_fp32.path, name)) == [], name
    assert artifact_fp32.manifest["tensorrt_ops"]["unsupported"] == []


def test_unsupported_op_is_rejected():
    model = _graph([helper.make_node("Relu", ["x"], ["h"], name="ok"),
                    helper.make_node("Unique", ["h"], ["y"], name="bad")],
                   [_vi("x")], [_vi("y", shape=(None,))])
    problems = opcheck.unsupported_nodes(model)
    assert len(problems) == 1 and "Unique" in problems[0] and "'bad'" in problems[0]
    with pytest.raises(ExportError, match="Unique node 'bad'"):
        opcheck.check_tensorrt_support(model, "test.onnx")


def test_contrib_domain_op_is_rejected():
    """A known op name in another domain (com.microsoft) is not TensorRT's op."""
    model = _graph([helper.make_node("Gelu", ["x"], ["y"], domain="com.microsoft", name="ms_gelu")],
                   [_vi("x")], [_vi("y")])
    problems = opcheck.unsupported_nodes(model)
    assert problems and "com.microsoft::Gelu" in problems[0]


def test_ops_inside_subgraphs_are_checked():
    body = helper.make_graph([helper.make_node("Unique", ["x"], ["u"], name="inner")], "then", [],
                             [_vi("u", shape=(None,))])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["u2"])], "else", [], [_vi("u2", shape=(None,))])
    model = _graph([helper.make_node("If", ["c"], ["y"], then_branch=body, else_branch=other, name="if")],
                   [_vi("c", TensorProto.BOOL, ()), _vi("x")], [_vi("y", shape=(None,))])
    assert any("Unique" in p for p in opcheck.unsupported_nodes(model))
    assert opcheck.op_histogram(model)["Unique"] == 1


def test_non_constant_axes_are_rejected():
    """TensorRT: ReduceSum's axes must be an initializer."""
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    ok = _graph([helper.make_node("ReduceSum", ["x", "axes"], ["y"], name="r")], [_vi("x")], [_vi("y", shape=(2, 1))],
                [axes])
    bad = _graph([helper.make_node("ReduceSum", ["x", "ax"], ["y"], name="r")],
                 [_vi("x"), _vi("ax", TensorProto.INT64, (1,))], [_vi("y", shape=(2, 1))])
    assert opcheck.unsupported_nodes(ok) == []
    assert "must be a constant" in opcheck.unsupported_nodes(bad)[0]


def test_export_checks_fail_on_an_unsupported_op(artifact_fp32, monkeypatch):
    """check_graph (run on every export) raises when an exported op is missing from the list."""
    from transduce.verify import graph_checks

    ops = opcheck.supported_ops() - {"LogSoftmax"}
    monkeypatch.setattr(opcheck, "supported_ops", lambda path=opcheck.OPS_FILE: ops)
    config = ModelConfig.from_dict(artifact_fp32.manifest["model"])
    graph_checks.check_graph(os.path.join(artifact_fp32.path, "encoder.onnx"), "encoder", config, "fp32", 18)
    with pytest.raises(ExportError, match="LogSoftmax"):
        graph_checks.check_graph(os.path.join(artifact_fp32.path, "decoder_step.onnx"), "decoder_step", config,
                                 "fp32", 18)


def test_checker_failure_is_an_export_error(artifact_fp32, tmp_path):
    """A graph the ONNX checker rejects (here: a truncated file) is an ExportError, not a traceback."""
    from transduce.verify import graph_checks

    src = os.path.join(artifact_fp32.path, "encoder.onnx")
    bad = tmp_path / "encoder.onnx"
    bad.write_bytes(open(src, "rb").read()[:5000])
    with pytest.raises(ExportError, match="fails the ONNX checker"):
        graph_checks.check_graph(str(bad), "encoder", ModelConfig.from_dict(artifact_fp32.manifest["model"]), "fp32",
                                 18)
