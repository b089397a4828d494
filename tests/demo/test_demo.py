"""transduce.demo: its option checks and its own data (the whole demo runs in the quickstart, not here)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from transduce.cli import main
from transduce.demo import pipeline as demo
from transduce.errors import InputError
from transduce.formats.artifact import read_manifest


@pytest.mark.parametrize("setup, args, says", [
    (None, ["--steps", "0"], "--steps must be >= 1, got 0"),
    (None, ["--show", "-1"], "--show must be >= 0"),
    ("workdir-file", [], "cannot be created"),
    ("model-file", [], "model is not a directory"),
    (None, ["--device", "tpu"], "--device 'tpu': training runs on cpu or cuda"),
    (None, ["--device", "meta"], "training runs on cpu or cuda"),
    (None, ["--device", "cuda:9"], "cuda:9"),  # no such GPU, or no CUDA at all
])
def test_bad_options_fail_before_any_work(tmp_path, setup, args, says):
    workdir = tmp_path / "w"
    if setup == "workdir-file":
        workdir.write_text("x")
    elif setup == "model-file":
        workdir.mkdir()
        (workdir / "model").write_text("x")
    result = CliRunner().invoke(main, ["demo", "--workdir", str(workdir), *args])
    assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output, result.output
    assert not (workdir / "data").exists()


def test_damaged_demo_data_is_generated_again(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "DEMO_TRAIN_PAIRS", 20)
    monkeypatch.setattr(demo, "DEMO_VALID_PAIRS", 5)
    train, valid = demo.demo_data(str(tmp_path))
    (tmp_path / "data" / "train.tsv").write_bytes(b"\xff\xfe not UTF-8\n")
    logged = []
    again, valid_again = demo.demo_data(str(tmp_path), log=logged.append)
    assert (again, valid_again) == (train, valid) and "generating it again" in logged[0]


def test_check_demo_options_accepts_the_defaults(tmp_path):
    demo.check_demo_options(str(tmp_path / "w"), None, 12)
    with pytest.raises(InputError):
        demo.check_demo_options(str(tmp_path / "w"), 5, -3)


@pytest.mark.filterwarnings("ignore:warmup .* >= max_steps")  # a one-step training, on purpose
def test_a_damaged_demo_model_is_trained_again(tmp_path, monkeypatch, tiny_model_dir):
    """Its weights lost: still the demo's own model directory, replaced by a new one (not refused)."""
    import shutil

    monkeypatch.setattr(demo, "DEMO_TRAIN_PAIRS", 40)
    monkeypatch.setattr(demo, "DEMO_VALID_PAIRS", 4)
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    (tmp_path / "model" / "model.safetensors").unlink()
    logged = []
    model_dir = demo.ensure_demo_model(str(tmp_path), steps=1, log=logged.append)
    assert "training again" in logged[0] and (tmp_path / "model" / "model.safetensors").is_file()
    from transduce.formats.model_dir import verify_model_dir

    verify_model_dir(model_dir)


def test_steps_for_a_demo_model_that_is_there_asks_for_retrain(tmp_path, tiny_model_dir):
    """--steps N names a model trained N steps: the one there (trained for others) is not silently reused."""
    import json
    import shutil

    from transduce.formats.model_dir import read_config

    shutil.copytree(tiny_model_dir, tmp_path / "model")
    trained = (read_config(str(tmp_path / "model")).get("training") or {}).get("step")
    logged = []
    assert demo.ensure_demo_model(str(tmp_path), log=logged.append) == str(tmp_path / "model")
    assert "reusing the demo model" in logged[0]
    done = f"trained for {trained} steps" if trained is not None else "with no step count recorded"
    with pytest.raises(InputError, match=f"--steps 7: the demo model in .* there already, {done}") as e:
        demo.ensure_demo_model(str(tmp_path), steps=7, log=logged.append)
    assert "--retrain" in e.value.hint
    if trained is not None:  # the same step count: reused
        assert demo.ensure_demo_model(str(tmp_path), steps=trained, log=logged.append)
    assert json.loads((tmp_path / "model" / "config.json").read_text())  # untouched


@pytest.mark.gpu
def test_the_demo_model_trains_on_the_gpu(tmp_path, monkeypatch):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU available to PyTorch")
    monkeypatch.setattr(demo, "DEMO_TRAIN_PAIRS", 40)
    monkeypatch.setattr(demo, "DEMO_VALID_PAIRS", 4)
    logged = []
    model_dir = demo.ensure_demo_model(str(tmp_path), steps=2, log=logged.append, device="cuda")
    assert any("on cuda" in line for line in logged), logged
    from transduce.formats.model_dir import verify_model_dir
    from transduce.models.checkpoint import load_model_dir

    verify_model_dir(model_dir)
    model = load_model_dir(model_dir)[0]  # saved as CPU tensors
    assert next(model.parameters()).device.type == "cpu"


def test_an_artifact_with_an_older_ort_step_graph_is_exported_again(tmp_path, tiny_model_dir, tiny_artifact_dir):
    """The demo reuses an export of its model's weights unless its decoder_step.ort.onnx is older than this
    exporter's (the demo shows today's decoding)."""
    import json
    import shutil

    from transduce.exporter import ort_step
    from transduce.formats import contract

    shutil.copytree(tiny_artifact_dir, tmp_path / "artifact")
    logged = []
    assert demo.ensure_demo_artifact(str(tmp_path), tiny_model_dir, log=logged.append) == str(tmp_path / "artifact")
    assert logged == [f"reusing the ONNX artifact in {tmp_path / 'artifact'}"]
    path = tmp_path / "artifact" / "manifest.json"
    m = json.loads(path.read_text())
    m["graphs"][contract.ORT_STEP_FILE]["revision"] = ort_step.REVISION - 1
    path.write_text(json.dumps(m))
    demo.ensure_demo_artifact(str(tmp_path), tiny_model_dir, log=logged.append)
    assert "older than this exporter's" in logged[1] and "exporting again" in logged[1]
    assert read_manifest(tmp_path / "artifact")["graphs"][contract.ORT_STEP_FILE]["revision"] == ort_step.REVISION
