"""Bad input through the CLI: a clear message, exit status 2, no traceback, and no artifact left behind."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from transduce.cli import main


def _export(*args: str):
    model_dir, out, *rest = args  # the positional OUT_DIR is deprecated: --out
    result = CliRunner().invoke(main, ["export", model_dir, "--out", out, *rest, "--quiet"])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def _fail(*args: str, match: str) -> str:
    result = _export(*args)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and match in result.output, result.output
    return result.output


def test_missing_model_dir(tmp_path):
    _fail(str(tmp_path / "nope"), str(tmp_path / "out"), match="does not exist")
    assert not (tmp_path / "out").exists()


def test_not_a_model_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    _fail(str(tmp_path / "empty"), str(tmp_path / "out"), match="config.json is missing")
    (tmp_path / "empty" / "config.json").mkdir()  # there, but not a file
    _fail(str(tmp_path / "empty"), str(tmp_path / "out"), match="config.json is not a file")


def test_truncated_weights(model_copy, tmp_path):
    path = os.path.join(model_copy, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    _fail(model_copy, str(tmp_path / "out"), match="truncated")
    assert not (tmp_path / "out").exists()


def test_corrupt_config(model_copy, tmp_path):
    with open(os.path.join(model_copy, "config.json"), "w") as f:
        f.write('{"format": "transduce-model", ')
    _fail(model_copy, str(tmp_path / "out"), match="not valid JSON")


def test_config_that_does_not_match_the_weights(model_copy, tmp_path):
    path = os.path.join(model_copy, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["model"]["d_ff"] *= 2
    with open(path, "w") as f:
        json.dump(cfg, f)
    out = _fail(model_copy, str(tmp_path / "out"), match="does not match config.json")
    assert "other shapes than the config" in out
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_force(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for force in ([], ["--force"]):  # what --force could not replace is said first, not "pass --force"
        output = _fail(tiny_model_dir, str(out), *force, match="not an artifact directory")
        assert "--force replaces only artifacts" in output
    assert (out / "keep.txt").read_text() == "mine"
    engine = tmp_path / "engine"  # an engine directory holds a copy of the artifact's manifest.json
    engine.mkdir()
    for name in ("engine.json", "manifest.json", "encoder.plan"):
        (engine / name).write_text("{}")
    _fail(tiny_model_dir, str(engine), "--force", match="is an engine directory")
    assert sorted(os.listdir(engine)) == ["encoder.plan", "engine.json", "manifest.json"]


def test_output_over_the_model_dir(model_copy):
    _fail(model_copy, model_copy, "--force", match="would replace the model directory")
    assert os.path.isfile(os.path.join(model_copy, "model.safetensors"))
    # inside it, the next training checkpoint (which replaces the model directory) would delete it
    _fail(model_copy, os.path.join(model_copy, "artifact"), match="is inside the model directory")
    assert not os.path.exists(os.path.join(model_copy, "artifact"))


def test_unwritable_output_path(tiny_model_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a directory")
    _fail(tiny_model_dir, str(blocker / "out"), match="cannot be created")


def test_unsupported_opset_and_precision(tiny_model_dir, tmp_path):
    _fail(tiny_model_dir, str(tmp_path / "out"), "--opset", "16", match="opset 16 is not supported")
    _fail(tiny_model_dir, str(tmp_path / "out"), "--opset", "24", match="opset 24 is not supported")
    result = _export(tiny_model_dir, str(tmp_path / "out"), "--precision", "int8")
    assert result.exit_code == 2 and "int8" in result.output  # click's own usage error
    assert not (tmp_path / "out").exists()


def test_failed_validation_leaves_no_artifact(tiny_model_dir, tmp_path, copied_graphs, monkeypatch):
    """Out of tolerance: ExportError, exit 2, no OUT_DIR, no temporary directory; an old artifact survives."""
    import dataclasses

    from transduce.verify.tolerances import POLICIES, Tolerance

    tight = {k: Tolerance(1e-12, 0.0) for k in ("memory", "cross_kv", "log_probs", "new_kv", "attention")}
    monkeypatch.setitem(POLICIES, "fp32", dataclasses.replace(POLICIES["fp32"], outputs=tight))
    out = tmp_path / "out"
    output = _fail(tiny_model_dir, str(out), match="do not match eager PyTorch")
    assert "log_probs" in output and "nothing was written" in output
    assert sorted(os.listdir(tmp_path)) == []

    old = tmp_path / "old"
    old.mkdir()
    (old / "manifest.json").write_text('{"kind": "transduce-artifact", "note": "old"}')
    _fail(tiny_model_dir, str(old), "--force", match="do not match eager PyTorch")
    assert os.listdir(old) == ["manifest.json"] and sorted(os.listdir(tmp_path)) == ["old"]
    assert "old" in (old / "manifest.json").read_text()


def test_wrong_graph_is_caught_by_validation(artifact_fp32, tiny_model_dir, tmp_path, monkeypatch):
    """A step graph whose weights differ slightly from the model's fails validation: nothing written."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from transduce.exporter import onnx_export

    def export_perturbed(model, directory, precision, opset, log=None, ort_step_graph=True):
        shutil.copyfile(os.path.join(artifact_fp32.path, "encoder.onnx"), os.path.join(directory, "encoder.onnx"))
        step = onnx.load(os.path.join(artifact_fp32.path, "decoder_step.onnx"))
        init = next(t for t in step.graph.initializer if t.name.endswith("embed.weight"))
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.001), init.name))
        onnx.save(step, os.path.join(directory, "decoder_step.onnx"))
        return {"encoder": 0.0, "decoder_step": 0.0}

    monkeypatch.setattr(onnx_export, "export_graphs", export_perturbed)
    output = _fail(tiny_model_dir, str(tmp_path / "out"), match="do not match eager PyTorch")
    assert "decoder_step log_probs" in output
    assert not (tmp_path / "out").exists()


def test_untraceable_model_is_an_export_error(tmp_path):
    """A model torch.export cannot trace (data-dependent control flow) gives an ExportError, no file."""
    import torch
    from torch.export import Dim

    from transduce.errors import ExportError
    from transduce.exporter.onnx_export import export_graph

    class DataDependent(torch.nn.Module):
        def forward(self, x):
            return x * 2 if int(x.sum()) > 0 else x

    path = tmp_path / "bad.onnx"
    with pytest.raises(ExportError, match="torch.onnx could not export bad.onnx") as info:
        export_graph(DataDependent(), (torch.ones(2, 3),), {"x": {0: Dim("batch")}}, ["x"], ["y"], str(path), 18)
    assert "\x1b[" not in str(info.value)
    assert not path.exists()


def test_a_wrong_attention_graph_is_caught_by_validation(artifact_fp32, tiny_model_dir, tmp_path, monkeypatch):
    """decoder_step.attn.onnx is validated against eager PyTorch as the others are: one whose cross-attention
    query's input differs slightly (the first decoder layer's norm1 scale) fails, naming its attention output, and
    nothing is written."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from transduce.exporter import onnx_export

    def export_perturbed(model, directory, precision, opset, log=None, ort_step_graph=True):
        for name in ("encoder.onnx", "decoder_step.onnx"):
            shutil.copyfile(os.path.join(artifact_fp32.path, name), os.path.join(directory, name))
        step = onnx.load(os.path.join(artifact_fp32.path, "decoder_step.attn.onnx"))
        init = next(t for t in step.graph.initializer if t.name.endswith("decoder_layers.0.norm1.weight"))
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.05), init.name))
        onnx.save(step, os.path.join(directory, "decoder_step.attn.onnx"))
        return {"encoder": 0.0, "decoder_step": 0.0, "decoder_step.attn": 0.0}

    monkeypatch.setattr(onnx_export, "export_graphs", export_perturbed)
    output = _fail(tiny_model_dir, str(tmp_path / "out"), match="do not match eager PyTorch")
    assert "decoder_step.attn attention" in output
    assert not (tmp_path / "out").exists()
