"""fp16 / bf16 artifacts: contract dtypes, the fp32 islands, where they run, and their recorded errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
from onnx import TensorProto

from transduce.formats import contract
from transduce.formats.dtypes import PRECISION_DTYPES

ISLANDS = ("LayerNormalization", "Softmax", "LogSoftmax")
ELEM = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


@pytest.fixture(params=["fp16", "bf16"])
def reduced(request):
    return request.param, request.getfixturevalue(f"artifact_{request.param}")


def _typed(model):
    """Shape-infer a graph; -> {value name: elem_type}."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {t.name: t.data_type for t in inferred.graph.initializer}
    for v in list(inferred.graph.input) + list(inferred.graph.output) + list(inferred.graph.value_info):
        types[v.name] = v.type.tensor_type.elem_type
    return inferred, types


def test_contract_dtypes(reduced):
    import onnx

    precision, art = reduced
    assert art.manifest["precision"] == precision
    for name in (contract.ENCODER_FILE, contract.STEP_FILE):
        model = onnx.load(os.path.join(art.path, name))
        for v in list(model.graph.input) + list(model.graph.output):
            elem = v.type.tensor_type.elem_type
            if v.name in ("src_ids", "src_lengths", "tokens", "positions"):
                assert elem == TensorProto.INT64, v.name
            elif v.name == "log_probs":
                assert elem == TensorProto.FLOAT, "log_probs must stay fp32"
            else:
                assert elem == ELEM[precision], v.name
    spec = {s["name"]: s["dtype"] for s in art.manifest["graphs"][contract.STEP_FILE]["outputs"]}
    assert spec["log_probs"] == "float32" and spec["new_key_0"] == PRECISION_DTYPES[precision]


def test_fp32_islands_are_kept(reduced):
    """LayerNorm, softmax and log_softmax read fp32; the weights of the big matmuls are in the low precision."""
    import onnx

    precision, art = reduced
    seen = set()
    for name in (contract.ENCODER_FILE, contract.STEP_FILE):
        inferred, types = _typed(onnx.load(os.path.join(art.path, name)))
        for node in inferred.graph.node:
            if node.op_type in ISLANDS:
                seen.add(node.op_type)
                assert types[node.input[0]] == TensorProto.FLOAT, f"{name}: {node.op_type} {node.name}"
                if node.op_type == "LayerNormalization":
                    assert all(types[i] == TensorProto.FLOAT for i in node.input[1:])
            if node.op_type in ("MatMul", "Gemm"):
                assert types[node.input[0]] == ELEM[precision], f"{name}: {node.op_type} {node.name} is not {precision}"
        big = [t for t in inferred.graph.initializer if np.prod(t.dims) >= 1024]
        assert big and all(t.data_type == ELEM[precision] for t in big), name
    assert seen == set(ISLANDS)


def test_broken_island_is_detected():
    """precision_problems (run on every export) flags a LayerNormalization on fp16 input."""
    import onnx
    from onnx import helper, numpy_helper

    from transduce.verify.graph_checks import precision_problems

    w = numpy_helper.from_array(np.ones(4, np.float16), "w")
    g = helper.make_graph([helper.make_node("LayerNormalization", ["x", "w"], ["y"], axis=-1, name="ln")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 4])], initializer=[w])
    model = onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    problems = precision_problems(model, "fp16")
    assert len(problems) == 1 and "LayerNormalization" in problems[0] and "FLOAT16" in problems[0]
    assert precision_problems(model, "fp32") == []


def test_fp16_runs_on_onnxruntime_cpu(artifact_fp16, one_layer_model):
    import torch

    from transduce.verify.graph_runners import ArtifactRunner
    from transduce.verify.tolerances import POLICIES

    runner = ArtifactRunner(artifact_fp16.path)
    assert (runner.evaluator == "onnxruntime"
            and artifact_fp16.manifest["validation"]["engine"].startswith("onnxruntime"))
    model = one_layer_model
    cfg = model.cfg
    rng = np.random.default_rng(0)
    src, lengths = rng.integers(4, cfg.vocab_size, (2, 12)), np.array([12, 3])
    enc = runner.encode(src, lengths)
    assert enc["memory"].dtype == np.float16
    with torch.inference_mode():
        memory, ck, cv = model.encode(torch.from_numpy(src), torch.from_numpy(lengths))
    atol, rtol = POLICIES["fp16"].outputs["memory"]
    np.testing.assert_allclose(enc["memory"].astype(np.float32), memory.numpy(), atol=atol, rtol=rtol)
    cross = [t.numpy() for kv in zip(ck, cv) for t in kv]
    past = [np.zeros((2, cfg.n_heads, 4, cfg.head_dim), np.float32) for _ in cross]
    out = runner.step(np.array([cfg.bos_id] * 2), np.zeros(2, np.int64), lengths, past, cross)
    assert out["log_probs"].dtype == np.float32 and out["new_key_0"].dtype == np.float16
    with torch.inference_mode():
        lp, _, _ = model.decode_step(torch.tensor([cfg.bos_id] * 2), torch.zeros(2, dtype=torch.long),
                                          torch.from_numpy(lengths), [torch.from_numpy(a) for a in past[0::2]],
                                          [torch.from_numpy(a) for a in past[1::2]], ck, cv)
    atol, rtol = POLICIES["fp16"].outputs["log_probs"]
    np.testing.assert_allclose(out["log_probs"], lp.numpy(), atol=atol, rtol=rtol)


def test_bf16_engine_is_recorded(artifact_bf16):
    """ONNX Runtime's CPU provider has no bf16 arithmetic kernels: validation ran on onnx's
    ReferenceEvaluator, and the manifest says why. (If a later ONNX Runtime runs bf16, it is used.)"""
    from transduce.verify.graph_runners import ort_unavailable_reason

    val = artifact_bf16.manifest["validation"]
    reason = ort_unavailable_reason(os.path.join(artifact_bf16.path, contract.ENCODER_FILE))
    if reason is None:
        assert val["engine"].startswith("onnxruntime")
    else:
        assert val["engine"] == "onnx.reference.ReferenceEvaluator"
        assert "NOT_IMPLEMENTED" in val["engine_reason"]


def test_reduced_precision_errors_are_recorded(reduced):
    """Errors are recorded per output, within the precision's tolerances and above fp32 noise."""
    from transduce.verify.tolerances import POLICIES, output_kind

    precision, art = reduced
    rows = {r["output"]: r for r in art.manifest["validation"]["errors"]}
    n = art.manifest["model"]["decoder_layers"]
    assert set(rows) == {s.name for s in contract.encoder_outputs(n) + contract.attn_step_outputs(n)}
    for name, r in rows.items():
        atol, rtol = POLICIES[precision].outputs[output_kind(name)]
        assert r["passed"] and (r["atol"], r["rtol"]) == (atol, rtol)
        assert r["max_abs"] > 1e-5, name  # the rounding shows: the graph really computes in low precision
    assert art.manifest["validation"]["tolerances"]["log_probs"] == {
        "atol": POLICIES[precision].outputs["log_probs"][0], "rtol": POLICIES[precision].outputs["log_probs"][1]}
