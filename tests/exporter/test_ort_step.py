"""decoder_step.ort.onnx: built for fp32 post-norm models, validated like the other graphs, refused otherwise."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from transduce.errors import ExportError
from transduce.exporter import ort_step
from transduce.formats import contract
from transduce.formats.artifact import read_manifest, rebuild_hint


def test_fp32_artifact_has_a_validated_ort_step_graph(artifact_fp32):
    m = artifact_fp32.manifest
    g = m["graphs"][contract.ORT_STEP_FILE]
    assert contract.ORT_STEP_FILE in m["files"]
    assert {f"com.microsoft::{op}" for op in ("GroupQueryAttention", "MultiHeadAttention")} <= set(g["op_histogram"])
    # residual + norm as Add + LayerNormalization (ONNX Runtime's CPU SkipLayerNormalization is slower)
    assert ("LayerNormalization" in g["op_histogram"]
            and "com.microsoft::SkipLayerNormalization" not in g["op_histogram"])
    assert g["opsets"]["com.microsoft"] == 1 and g["runtime"].startswith("onnxruntime only")
    outputs = [o["name"] for o in g["outputs"]]
    assert outputs[:2] == ["log_probs", "present_key_0"] and outputs[-2:] == ["topk_values", "topk_ids"]
    # the standard step's inputs (cross K/V and src_lengths per source), then the top-k's
    inputs = {i["name"]: i for i in g["inputs"]}
    assert list(inputs) == [i["name"] for i in m["graphs"][contract.STEP_FILE]["inputs"]] + ["topk_k", "topk_bias"]
    assert inputs["cross_key_0"]["axes"][0] == inputs["src_lengths"]["axes"][0] == "sources"
    assert inputs["tokens"]["axes"] == ["batch"]
    assert g["nodes"] < m["graphs"][contract.STEP_FILE]["nodes"]
    rows = [r for r in m["validation"]["errors"] if r["graph"] == "decoder_step.ort"]
    # new_*: the slot each row wrote; present_*: the whole cache after the in-place write (IO binding,
    # present bound onto past, as the runtime runs it)
    assert {r["output"] for r in rows} == ({"log_probs", "topk_values", "topk_ids"}
                                           | {f"{p}_{kv}_{i}" for p in ("new", "present") for i in range(2)
                                              for kv in ("key", "value")})
    assert all(r["passed"] and r["max_abs"] < 1e-4 for r in rows)


def test_the_validation_runs_the_ort_step_in_place_and_checks_the_whole_cache(artifact_fp32, tiny_model):
    """ArtifactRunner runs decoder_step.ort.onnx with present_* bound onto the past_* buffers, like the
    runtime: the caller's arrays are left alone, the returned cache has slot positions[b] written and
    every other slot as it was; a graph that also wrote another slot fails the export's validation."""
    from transduce.verify.graph_runners import ArtifactRunner
    from transduce.verify.validate import _eager_step

    cfg = tiny_model.cfg
    rng = np.random.default_rng(7)
    runner = ArtifactRunner(artifact_fp32.path)
    src = rng.integers(4, cfg.vocab_size, (3, 6))
    lengths = np.array([6, 2, 4])
    enc = runner.encode(src, lengths)
    cross = [enc[f"cross_{kv}_{i}"] for i in range(cfg.decoder_layers) for kv in ("key", "value")]
    past = [rng.standard_normal((3, cfg.n_heads, 7, cfg.head_dim)).astype(np.float32) for _ in cross]
    before = [a.copy() for a in past]
    tokens, positions = np.array([5, 9, 11]), np.array([0, 4, 6])
    out = runner.step(tokens, positions, lengths, past, cross, graph="decoder_step.ort")
    for a, b in zip(past, before):
        np.testing.assert_array_equal(a, b)  # the caller's past is not the buffer written
    ref = _eager_step(tiny_model, tokens, positions, lengths, past, cross)
    rows = np.arange(3)
    for i, nm in enumerate(f"{kv}_{j}" for j in range(cfg.decoder_layers) for kv in ("key", "value")):
        cache = out[f"present_{nm}"]
        np.testing.assert_allclose(cache[rows, :, positions], ref[f"new_{nm}"][:, :, 0], atol=1e-5)
        untouched = cache.copy()
        untouched[rows, :, positions] = past[i][rows, :, positions]
        np.testing.assert_array_equal(untouched, past[i])
        np.testing.assert_array_equal(out[f"new_{nm}"][:, :, 0], cache[rows, :, positions])


def test_a_step_that_changes_another_cache_slot_fails_the_validation(artifact_fp32, tiny_model, monkeypatch):
    """The export's validation compares the whole cache the ONNX Runtime graph leaves behind: a step
    that also changed a slot other than positions[b] (here: the next one, by 0.01) is refused."""
    from transduce.verify import graph_runners, validate

    step = graph_runners.ArtifactRunner.step

    def clobbering_step(self, tokens, positions, *args, graph="decoder_step", **kwargs):
        out = step(self, tokens, positions, *args, graph=graph, **kwargs)
        if graph == "decoder_step.ort":
            cache = out["present_value_1"]
            row = int(np.argmin(positions))
            if positions[row] + 1 < cache.shape[2]:
                cache[row, :, positions[row] + 1] += 0.01
        return out

    monkeypatch.setattr(graph_runners.ArtifactRunner, "step", clobbering_step)
    with pytest.raises(ExportError, match=r"decoder_step\.ort present_value_1") as e:
        validate.validate_graphs(artifact_fp32.path, tiny_model, "fp32")
    assert "new_value_1" not in str(e.value) and "log_probs" not in str(e.value)


def test_not_built_for_reduced_precision_or_pre_norm(artifact_fp16, tiny_model):
    assert contract.ORT_STEP_FILE not in os.listdir(artifact_fp16.path)
    assert contract.ORT_STEP_FILE not in artifact_fp16.manifest["graphs"]
    cfg = tiny_model.cfg
    assert ort_step.unsupported_reason(cfg, "fp32") is None
    assert "fp32" in ort_step.unsupported_reason(cfg, "fp16")
    assert "post-norm" in ort_step.unsupported_reason(cfg.replace(norm_first=True), "fp32")
    assert "sinusoidal positions" in ort_step.unsupported_reason(cfg.replace(positions="learned"), "fp32")
    assert "embedding layer norm" in ort_step.unsupported_reason(cfg.replace(layernorm_embedding=True), "fp32")
    # onnxruntime's attention kernels refuse a head size that is not a multiple of 8 when they run
    assert "head size that is a multiple of 8, and this model's is 6" in ort_step.unsupported_reason(
        cfg.replace(d_model=24, n_heads=4), "fp32")
    base = cfg.replace(d_model=512, d_ff=2048, decoder_layers=6, vocab_size=8000)
    assert ort_step.unsupported_reason(base, "fp32") is None  # built at every size that fits one ONNX file
    huge = base.replace(d_model=4096, d_ff=16384, decoder_layers=24, vocab_size=32000)
    assert "2 GB" in ort_step.unsupported_reason(huge, "fp32")


def test_a_wrong_ort_step_graph_fails_the_export(artifact_fp32, tiny_model_dir, tmp_path, monkeypatch):
    """The numeric validation covers the fused graph: one LayerNorm gain off by 1% fails the export,
    naming decoder_step.ort, and leaves nothing behind."""
    import onnx
    from onnx import numpy_helper

    from transduce.exporter import onnx_export
    from transduce.exporter.onnx_export import export_artifact

    def fake_export_graphs(model, directory, precision, opset, log=None, ort_step_graph=True):
        for name in ("encoder.onnx", "decoder_step.onnx"):
            shutil.copyfile(os.path.join(artifact_fp32.path, name), os.path.join(directory, name))
        proto = onnx.load(os.path.join(artifact_fp32.path, contract.ORT_STEP_FILE))
        init = next(t for t in proto.graph.initializer if t.name == "decoder_layers.1.norm3.weight")
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.01), init.name))
        onnx.save(proto, os.path.join(directory, contract.ORT_STEP_FILE))
        return {}

    monkeypatch.setattr(onnx_export, "export_graphs", fake_export_graphs)
    out = tmp_path / "art"
    with pytest.raises(ExportError, match=r"decoder_step\.ort log_probs"):
        export_artifact(tiny_model_dir, out)
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_no_ort_step_leaves_the_graph_out(artifact_fp32, tiny_model_dir, tmp_path, copied_graphs):
    """`transduce export --no-ort-step`: no decoder_step.ort.onnx in the files or the manifest; the ONNX
    Runtime backend decodes it with decoder_step.onnx, as the full artifact's standard graph does; the
    manifest records the choice, which the rebuild hint repeats."""
    from click.testing import CliRunner

    from transduce.cli import main
    from transduce.runtime.api import make_backend
    from transduce.runtime.decoding import DecodingOptions, decode

    out = tmp_path / "slim"
    result = CliRunner().invoke(main, ["export", tiny_model_dir, str(out), "--no-ort-step"])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    assert contract.ORT_STEP_FILE not in os.listdir(out)
    assert contract.ORT_STEP_FILE not in manifest["files"] and contract.ORT_STEP_FILE not in manifest["graphs"]
    assert not any(row["graph"] == "decoder_step.ort" for row in manifest["validation"]["errors"])
    assert manifest["ort_step_graph"] is False and artifact_fp32.manifest["ort_step_graph"] is True
    assert rebuild_hint(str(out), manifest).endswith("--force --no-ort-step")  # a rebuild keeps it out
    slim, full = make_backend(out, "onnxruntime"), make_backend(artifact_fp32.path, "onnxruntime")
    assert not slim.fused and slim.step_graphs() == [contract.STEP_FILE]
    src = np.array([[5, 6, 7, slim.config.eos_id]], np.int64)
    opts = DecodingOptions(beam_size=2, max_len_a=0.0, max_len_b=6)
    with full.only_step_graph(contract.STEP_FILE):
        want = decode(full, src, np.array([4]), opts)
    assert decode(slim, src, np.array([4]), opts) == want


def test_no_ort_step_refuses_quantize(tiny_model_dir, tmp_path):
    from transduce.exporter.onnx_export import export_artifact

    with pytest.raises(ExportError, match="ort_step_graph=False leaves out") as e:  # Python's names from Python
        export_artifact(tiny_model_dir, tmp_path / "q", quantize="int8", ort_step_graph=False)
    assert e.value.hint == "drop one of the two options"
    assert not (tmp_path / "q").exists()


def test_export_graphs_builds_no_ort_step_graph_when_told(tiny_model, tmp_path, monkeypatch):
    """export_graphs itself (tracing stubbed) skips ort_step.build_ort_step with ort_step_graph=False."""
    from transduce.exporter import onnx_export

    def must_not_build(model, opset):
        raise AssertionError("build_ort_step called")

    monkeypatch.setattr(onnx_export, "export_graph", lambda *args, **kwargs: None)
    monkeypatch.setattr(ort_step, "build_ort_step", must_not_build)
    seconds = onnx_export.export_graphs(tiny_model, str(tmp_path), "fp32", 18, ort_step_graph=False)
    assert set(seconds) == {"encoder", "decoder_step"} and not os.listdir(tmp_path)
    with pytest.raises(AssertionError, match="build_ort_step called"):
        onnx_export.export_graphs(tiny_model, str(tmp_path), "fp32", 18)


def test_stale_reason_names_an_older_or_missing_ort_step_graph(artifact_fp32):
    """The bench and the demo export again an artifact whose decoder_step.ort.onnx is of an older revision
    (or left out) than this exporter builds; models that cannot have one are never stale."""
    import copy

    m = artifact_fp32.manifest
    assert m["graphs"][contract.ORT_STEP_FILE]["revision"] == ort_step.REVISION and ort_step.stale_reason(m) is None
    old = copy.deepcopy(m)
    del old["graphs"][contract.ORT_STEP_FILE]["revision"]  # written before revisions were recorded: 1
    assert ort_step.stale_reason(old) == (
        f"its decoder_step.ort.onnx is revision 1, older than this exporter's {ort_step.REVISION}")
    slim = copy.deepcopy(m)
    del slim["files"][contract.ORT_STEP_FILE]
    assert "exported with --no-ort-step" in ort_step.stale_reason(slim)
    for edit in ({"precision": "fp16"}, {"model": {**m["model"], "norm_first": True}}):
        assert ort_step.stale_reason({**slim, **edit}) is None
