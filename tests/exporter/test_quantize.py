"""transduce export --quantize int8: ONNX Runtime dynamic quantization of the encoder and the ONNX
Runtime step graph, its per-tensor validation, and the places that must refuse a quantized artifact."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from click.testing import CliRunner

from transduce.build.builder import build_engines
from transduce.errors import BackendUnavailable, EngineError, ExportError
from transduce.exporter import quantize
from transduce.exporter.onnx_export import export_artifact
from transduce.formats import contract
from transduce.formats.artifact import QUANTIZED_OP_TYPES, quantization
from transduce.verify import validate
from transduce.verify.tolerances import POLICIES


@pytest.fixture
def artifact_int8(tiny_int8_artifact):
    """tests/conftest.py's int8 export of tiny_model_dir (shared with the runtime tests)."""
    return tiny_int8_artifact


def test_int8_export_quantizes_the_onnx_runtime_graphs_only(artifact_int8, artifact_fp32):
    path, m = artifact_int8
    q = m["quantization"]
    assert quantization(m) == "int8" and quantization(artifact_fp32.manifest) is None
    assert q["graphs"] == [contract.ENCODER_FILE, contract.ORT_STEP_FILE] and q["unquantized"] == [contract.STEP_FILE]
    import onnx

    for name in q["graphs"]:  # every MatMul/Gemm weight became int8; float ones multiply activations only
        ops = q["ops"][name]
        assert ops.get("DynamicQuantizeMatMul", 0) + ops.get("MatMulInteger", 0) > 0, ops
        graph = onnx.load(os.path.join(path, name)).graph
        weights = {t.name for t in graph.initializer}
        assert not [n.name for n in graph.node if n.op_type in ("MatMul", "Gemm") and set(n.input) & weights]
        assert m["files"][name]["bytes"] < artifact_fp32.manifest["files"][name]["bytes"]
        # `graphs` describes the graphs as exported (fp32), `quantization` the int8 ones
        assert m["graphs"][name]["bytes"] == artifact_fp32.manifest["graphs"][name]["bytes"]
        assert q["bytes"][name] == m["files"][name]["bytes"]
        assert set(ops) & set(QUANTIZED_OP_TYPES)  # what parity checks a quantization claim by
    assert m["files"][contract.STEP_FILE]["sha256"] == artifact_fp32.manifest["files"][contract.STEP_FILE]["sha256"]
    # the fp32 graphs were validated as usual, the int8 ones per tensor, and both passed
    assert all(r["passed"] for r in m["validation"]["errors"])
    rows = q["validation"]["errors"]
    # the attention step graph is not quantized (it is validated again beside the quantized ones)
    assert {r["graph"] for r in rows} == {"encoder", "decoder_step", "decoder_step.ort", "decoder_step.attn"}
    assert all(r["passed"] and r["rel_rms"] <= r["rel_rms_limit"] for r in rows)
    assert any(r["rel_rms"] > 1e-4 for r in rows if r["graph"] == "encoder")  # really quantized
    assert "relative_rms" in q["validation"]["tolerances"]["memory"]


def test_int8_artifact_steps_close_to_eager(artifact_int8, tiny_model):
    """Teacher-forced through the backend (the fused int8 step graph writing its cache): the log-probs
    are eager's plus int8 noise, per tensor within the export's limit, and decoding runs."""
    from transduce.runtime.api import make_backend
    from transduce.runtime.backends.torch_backend import TorchBackend
    from transduce.runtime.decoding import DecodingOptions, decode, teacher_forced_log_probs

    be = make_backend(artifact_int8[0], "onnxruntime")
    assert be.fused
    rng = np.random.default_rng(4)
    v = be.config.vocab_size
    src = rng.integers(4, v, size=(6, 9)).astype(np.int64)
    src[:, -1] = be.config.eos_id
    lens = np.full(6, 9, np.int64)
    prefix = np.concatenate([np.full((6, 1), be.config.bos_id), rng.integers(4, v, size=(6, 7))], axis=1)
    got = teacher_forced_log_probs(be, src, lens, prefix)
    want = teacher_forced_log_probs(TorchBackend(tiny_model), src, lens, prefix)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 1e-5 < rel < POLICIES["int8"].relative_rms["log_probs"]
    opts = DecodingOptions(beam_size=2, min_length=3, max_len_b=8)
    assert all(len(r.best.tokens) >= 2 for r in decode(be, src, lens, opts))


def test_cli_export_quantize_prints_the_int8_errors(tiny_model_dir, tmp_path, copied_graphs):
    from transduce.cli import main

    res = CliRunner().invoke(main, ["export", tiny_model_dir, str(tmp_path / "q"), "--quantize", "int8", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "fp32, int8 weights" in res.output and "relative RMS error against eager" in res.output


def test_quantize_needs_fp32_and_the_onnx_runtime_step_graph(tiny_model, tiny_model_dir, tmp_path):
    cfg = tiny_model.cfg
    assert quantize.unsupported_reason("int8", cfg, "fp32") is None
    assert "fp32" in quantize.unsupported_reason("int8", cfg, "fp16")
    assert "post-norm" in quantize.unsupported_reason("int8", cfg.replace(norm_first=True), "fp32")
    assert "unknown quantization" in quantize.unsupported_reason("int4", cfg, "fp32")
    with pytest.raises(ExportError, match="cannot quantize"):
        export_artifact(tiny_model_dir, tmp_path / "fp16", precision="fp16", quantize="int8")
    assert not (tmp_path / "fp16").exists()


def test_quantize_refuses_an_encoder_torch_onnx_writes_external_data_for(artifact_fp32):
    """Told before the export runs: an encoder whose weights pass torch.onnx's 1.5 GiB goes to an external data
    file, which quantization cannot take. The estimate is a lower bound of the graph's weights, so it never
    refuses a model whose encoder stays inline."""
    import onnx
    from onnx import numpy_helper

    from transduce.formats.model_config import ModelConfig

    config = ModelConfig.from_dict(artifact_fp32.manifest["model"])
    big = config.replace(vocab_size=8000, d_model=1024, n_heads=16, d_ff=4096, encoder_layers=40, decoder_layers=1)
    assert "encoder.onnx's weights (at least 1.9 GiB) pass the 1.5 GiB" in quantize.unsupported_reason(
        "int8", big, "fp32")
    assert quantize.unsupported_reason("int8", big.replace(encoder_layers=24), "fp32") is None
    graph = onnx.load(os.path.join(artifact_fp32.path, "encoder.onnx")).graph
    stored = sum(numpy_helper.to_array(t).nbytes for t in graph.initializer)
    assert quantize.encoder_weight_bytes(config) <= stored


def test_int8_validation_fails_a_wrong_tensor_and_leaves_nothing(tiny_model_dir, tmp_path, copied_graphs, monkeypatch):
    monkeypatch.setitem(POLICIES, "int8", dataclasses.replace(
        POLICIES["int8"], relative_rms={k: 1e-6 for k in POLICIES["int8"].relative_rms}))
    with pytest.raises(ExportError, match="relative RMS error"):
        export_artifact(tiny_model_dir, tmp_path / "bad", quantize="int8")
    assert not os.path.exists(tmp_path / "bad")


def test_relative_rms_criterion_separates_noise_from_a_wrong_tensor():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(4, 8, 16))
    table = validate.ErrorTable("int8")
    table.add("encoder", "noise", {"memory": ref + 0.05 * rng.normal(size=ref.shape)}, {"memory": ref})
    assert not table.failures()
    table.add("encoder", "wrong", {"memory": rng.permutation(ref.ravel()).reshape(ref.shape)}, {"memory": ref})
    (row,) = table.failures()
    assert row["rel_rms"] > 1.0 and row["rel_rms_limit"] == POLICIES["int8"].relative_rms["memory"]
    assert row["worst_case"] == "wrong" and "atol" not in row


def test_log_probs_are_judged_without_their_offset():
    """Log-probs sit near -log V: compared as they are, two unrelated near-flat distributions would be
    close in relative terms. Each row's mean is taken out first, so they fail at the real limit."""
    rng = np.random.default_rng(1)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    ref = log_softmax(rng.normal(size=(6, 8000)))
    other = log_softmax(rng.normal(size=(6, 8000)))
    assert np.linalg.norm(other - ref) / np.linalg.norm(ref) < 0.25  # what a plain relative RMS would see
    table = validate.ErrorTable("int8")
    table.add("decoder_step.ort", "noise",
              {"log_probs": log_softmax(np.log(np.exp(ref)) + 0.03 * rng.normal(size=ref.shape))},
              {"log_probs": ref})
    assert not table.failures()
    table.add("decoder_step.ort", "unrelated", {"log_probs": other}, {"log_probs": ref})
    (row,) = table.failures()
    assert row["rel_rms"] > 1.0 and row["rel_rms_limit"] == POLICIES["int8"].relative_rms["log_probs"]


def test_gpu_paths_refuse_an_int8_artifact(artifact_int8, tmp_path, monkeypatch):
    import onnxruntime

    from transduce.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

    monkeypatch.setattr(onnxruntime, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(BackendUnavailable, match="CPU provider only") as e:
        OnnxRuntimeBackend(artifact_int8[0], provider="cuda")
    assert "without --quantize" in e.value.hint
    with pytest.raises(EngineError, match="unquantized export"):
        build_engines(artifact_int8[0], tmp_path / "engine")
    assert not (tmp_path / "engine").exists()


def test_parity_holds_an_int8_artifact_to_the_int8_policy(artifact_int8):
    from transduce.verify.parity import parity_for_artifact

    report = parity_for_artifact(artifact_int8[0], sentences=12, beam_size=2)
    assert report.precision == "int8" and "(int8)" in report.candidate
    log_probs = next(s for s in report.teacher_forced if s.name.startswith("log_probs"))
    assert log_probs.atol == 1.0 and log_probs.max_abs > 1e-4  # int8's tolerance, and really int8 errors
    # (the tiny model's random weights are no subject for the verdict: near-ties everywhere, log-probs that
    # int8 moves by more than the policy allows; a trained model's int8 export passes it:)


def test_an_int8_export_of_a_trained_model_passes_the_int8_policy(demo_model_dir, tmp_path):
    from transduce.verify.parity import parity_for_artifact

    export_artifact(demo_model_dir, tmp_path / "int8", quantize="int8")
    report = parity_for_artifact(str(tmp_path / "int8"), sentences=24, beam_size=4)
    assert report.precision == "int8" and report.passed, report.to_dict()
    assert report.sequences[0].identical >= 23  # greedy: what the policy's comment says of the demo model
