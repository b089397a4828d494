"""`transduce inspect` on model, artifact and engine directories, and its errors on anything else."""

from __future__ import annotations

import io
import json
import os

import pytest
from click.testing import CliRunner

from transduce.cli import main
from transduce.errors import ArtifactError, CheckpointError, TransduceError
from transduce.inspect import inspect_path, render_report
from transduce.inspect.parameters import classify_parameter
from transduce.inspect.report import RUNTIME_OK_UNHASHED


def _rendered(report) -> str:
    from rich.console import Console

    out = io.StringIO()
    render_report(report, Console(file=out, width=140, color_system=None))
    return out.getvalue()


def _cli(*args):
    return CliRunner().invoke(main, list(args))


# -- model directories -----------------------------------------------------------------------------


def test_model_dir_parameters_match_the_model(tiny_model_dir, tiny_model, tiny_tokenizer):
    report = inspect_path(tiny_model_dir)
    cfg = tiny_model.cfg
    params = report["parameters"]
    assert report["kind"] == "model" and report["problems"] == []
    assert report["config"] == cfg.to_dict()
    assert params["total"] == tiny_model.num_parameters()
    assert sum(c["parameters"] for c in params["components"].values()) == params["total"]
    assert params["components"]["embeddings"]["parameters"] == cfg.vocab_size * cfg.d_model  # shared, stored once
    d, f = cfg.d_model, cfg.d_ff
    attention, ffn, norm = 4 * (d * d + d), d * f + f + f * d + d, 2 * d
    assert params["layers"]["encoder"] == [attention + ffn + 2 * norm] * cfg.encoder_layers
    assert params["layers"]["decoder"] == [2 * attention + ffn + 3 * norm] * cfg.decoder_layers
    assert params["components"]["decoder"]["kinds"]["decoder cross-attention"] == attention * cfg.decoder_layers
    assert params["dtypes"] == {"float32": params["total"]}
    assert report["tokenizer"]["vocab_size"] == tiny_tokenizer.vocab_size
    files = {f["name"]: f for f in report["files"]}
    assert set(files) == {"config.json", "model.safetensors", "tokenizer.json"}
    assert files["model.safetensors"]["bytes"] == os.path.getsize(os.path.join(tiny_model_dir, "model.safetensors"))


def test_model_dir_verify_and_render(tiny_model_dir):
    report = inspect_path(tiny_model_dir, verify=True)
    assert {f["name"]: f["sha256_ok"] for f in report["files"]} == {
        "config.json": None, "model.safetensors": True, "tokenizer.json": True}
    text = _rendered(report)
    for expected in ("model config", "d_model", "decoder cross-attention", "tokenizer", "model.safetensors", "ok"):
        assert expected in text


def test_model_dir_with_a_damaged_weights_file_is_reported(tiny_model_dir, tmp_path):
    import shutil

    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    (path / "model.safetensors").write_bytes(b"\xff" * 16)
    report = inspect_path(path)
    assert report["parameters"] is None
    assert any("safetensors header" in p for p in report["problems"])
    assert any("16 bytes, recorded" in p for p in report["problems"])


def test_model_dir_that_loading_would_refuse_is_reported(tiny_model_dir, tmp_path):
    """A config whose model has other weights than the file, and unrecorded files: problems, as the loader says."""
    import shutil

    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model"]["decoder_layers"] += 1
    cfg["model"]["d_ff"] *= 2
    cfg["files"]["tokenizer.json"] = None
    (path / "config.json").write_text(json.dumps(cfg))
    problems = inspect_path(path)["problems"]
    assert any(p.startswith("weights missing for this config: decoder_layers.2.") for p in problems), problems
    assert any(p.startswith("weights of other shapes than the config's: encoder_layers.0.ffn.w1.weight")
               for p in problems)
    assert any("does not record tokenizer.json" in p for p in problems)
    assert any(p.startswith("config.json's model config is not the one the weights were saved with: decoder_layers 3 "
                            "(saved with the weights: 2)") for p in problems), problems
    os.symlink(path / "nowhere", path / "dangling")
    assert any("is a link to nothing" in p for p in inspect_path(path)["problems"])


def test_a_config_edit_that_keeps_the_shapes_is_reported(tiny_model_dir, tmp_path):
    """n_heads changes no weight's shape: only the config saved in the weights' metadata tells (load refuses it)."""
    import shutil

    from transduce.models.checkpoint import load_model_dir

    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    before = cfg["model"]["n_heads"]
    cfg["model"]["n_heads"] = before * 2
    (path / "config.json").write_text(json.dumps(cfg))
    want = f"config.json's model config is not the one the weights were saved with: n_heads {before * 2}"
    assert [p for p in inspect_path(path)["problems"] if p.startswith(want)], inspect_path(path)["problems"]
    with pytest.raises(CheckpointError, match=want):
        load_model_dir(path)


def test_json_output_is_the_report(tiny_model_dir):
    result = _cli("inspect", tiny_model_dir, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == json.loads(json.dumps(inspect_path(tiny_model_dir)))


def test_table_output(tiny_model_dir):
    result = _cli("inspect", tiny_model_dir)
    assert result.exit_code == 0, result.output
    assert "parameters" in result.output and "encoder self-attention" in result.output


def test_table_output_into_a_pipe_is_not_cut_to_80_columns(demo_model_dir):
    """Not a terminal (a file, a pipe, CliRunner): 140 columns, so file names are written whole."""
    result = _cli("inspect", demo_model_dir)
    assert result.exit_code == 0, result.output
    assert "training/optimizer.safetensors" in result.output


# -- artifact directories ----------------------------------------------------------------------------


def test_artifact_graphs(artifact_dir, artifact_sizes):
    vocab, d_model = artifact_sizes
    report = inspect_path(artifact_dir)
    assert report["kind"] == "artifact" and report["problems"] == [] and report["runtime_check"] == "ok"
    assert report["manifest"]["precision"] == "fp32" and "files" not in report["manifest"]
    assert report["config"]["d_model"] == d_model
    enc, step = report["graphs"]["encoder.onnx"], report["graphs"]["decoder_step.onnx"]
    assert enc["inputs"] == [{"name": "src_ids", "dtype": "int64", "shape": ["batch", "src_len"]},
                             {"name": "src_lengths", "dtype": "int64", "shape": ["batch"]}]
    cross = ["batch", 2, "src_len", d_model // 2]
    assert enc["outputs"] == [{"name": "memory", "dtype": "float32", "shape": ["batch", "src_len", d_model]},
                              {"name": "cross_key_0", "dtype": "float32", "shape": cross},
                              {"name": "cross_value_0", "dtype": "float32", "shape": cross}]
    assert enc["opsets"] == {"ai.onnx": 17}
    assert enc["ops"] == {"Constant": 1, "Gather": 1, "Identity": 1, "MatMul": 1, "Reshape": 1, "Transpose": 1}
    assert step["ops"] == {"MatMul": 2, "Constant": 1, "Gather": 1, "Identity": 1, "LogSoftmax": 1, "Relu": 1,
                           "Reshape": 1, "Transpose": 1}
    # the opaque "onnx::MatMul_7" is classified by its consumer node's name (the module path)
    assert enc["parameters"]["components"]["encoder"]["kinds"] == {"encoder self-attention": d_model * d_model}
    assert enc["parameters"]["components"]["embeddings"]["parameters"] == vocab * d_model
    assert step["parameters"]["layers"]["decoder"] == [d_model * d_model]
    text = _rendered(report)
    for expected in ("graph encoder.onnx", "src_len", "LogSoftmax ×1", "ai.onnx 17", "runtime", "fp32"):
        assert expected in text


def test_model_dir_with_a_hand_edited_training_record(tiny_model_dir, edited_copy):
    path = edited_copy(tiny_model_dir, "model", "config.json", lambda cfg: cfg.update(training=[1, 2]))
    report = inspect_path(path)
    assert any("training record is not an object" in p for p in report["problems"])
    assert "config.json" in _rendered(report)  # rendered, not an AttributeError


def test_artifact_listing_files_outside_itself(artifact_dir):
    """A hand-edited manifest naming /etc/hostname or ../x: a problem, never read or hashed."""
    path = os.path.join(artifact_dir, "manifest.json")
    manifest = json.loads(open(path, encoding="utf-8").read())
    manifest["files"]["/etc/hostname"] = {"sha256": "0" * 64, "bytes": 3}
    manifest["files"]["../model/model.safetensors"] = {"sha256": "0" * 64, "bytes": 3}
    elsewhere = os.path.join(os.path.dirname(artifact_dir), "elsewhere.onnx")
    with open(elsewhere, "wb") as f:
        f.write(b"not a graph")
    manifest["files"]["../elsewhere.onnx"] = {"sha256": "0" * 64, "bytes": 11}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    report = inspect_path(artifact_dir)
    outside = [p for p in report["problems"] if "not a file name inside" in p]
    assert ("../elsewhere.onnx" not in report["graphs"]
            and not any("elsewhere.onnx cannot be read" in p for p in report["problems"]))
    assert len(outside) == 3 and not any("/etc/hostname has" in p or "listed but missing" in p
                                         for p in report["problems"])
    assert "not a file name inside" in report["runtime_check"]


def test_artifact_with_a_changed_graph(artifact_dir):
    with open(os.path.join(artifact_dir, "decoder_step.onnx"), "ab") as f:
        f.write(b"\x00")
    report = inspect_path(artifact_dir)
    assert "bytes" in report["runtime_check"]  # the runtime would refuse it
    assert any("decoder_step.onnx" in p and "recorded" in p for p in report["problems"])


def test_artifact_with_an_unreadable_graph(artifact_dir):
    with open(os.path.join(artifact_dir, "encoder.onnx"), "wb") as f:
        f.write(b"not a protobuf at all \xff\xff\xff")
    report = inspect_path(artifact_dir)
    assert "encoder.onnx" not in report["graphs"] and "decoder_step.onnx" in report["graphs"]
    assert any("cannot be read as ONNX" in p for p in report["problems"])


def test_artifact_of_another_contract_version_is_still_shown(artifact_dir):
    path = os.path.join(artifact_dir, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["contract_version"] = 99
    with open(path, "w") as f:
        json.dump(manifest, f)
    report = inspect_path(artifact_dir)
    assert report["manifest"]["contract_version"] == 99 and "version 99" in report["runtime_check"]
    assert set(report["graphs"]) == {"encoder.onnx", "decoder_step.onnx"}
    assert report["problems"] == []
    result = _cli("inspect", artifact_dir)  # no problem listed, but the runtime would refuse it
    assert result.exit_code == 1 and "version 99" in result.output


def test_runtime_checks_that_could_not_run_do_not_fail_inspect():
    from transduce.cli.inspect import runtime_accepts

    assert runtime_accepts({"runtime_check": "ok"}) and runtime_accepts({"kind": "model"})
    assert runtime_accepts({"runtime_check": "not checked (No module named 'tensorrt')"})
    assert not runtime_accepts({"runtime_check": "artifact contract version 99, this runtime reads 2"})


# -- engine directories -----------------------------------------------------------------------------


def test_engine_dir(engine_dir):
    report = inspect_path(engine_dir, verify=True)
    assert report["kind"] == "engine" and report["problems"] == []
    assert report["built_for"] == {"tensorrt_version": "10.3.0", "gpu": "NVIDIA H100 80GB HBM3",
                                   "compute_capability": "9.0", "cuda_version": "12.4", "precision": "fp32"}
    assert report["runtime_check"] == "ok"  # the TensorRT backend's reader accepts the directory's files
    assert report["engine"]["profiles"]["decoder_step"][0]["cache_len"] == [1, 32, 128]
    assert report["manifest"]["kind"] == "transduce-artifact" and report["config"] == report["manifest"]["model"]
    assert set(report["graphs"]) == {"encoder.onnx", "decoder_step.onnx"}  # the copy of the artifact
    files = {f["name"]: f for f in report["files"]}
    assert (files["encoder.plan"]["bytes"], files["encoder.plan"]["sha256_ok"]) == (1000, True)
    assert files["engine.json"]["sha256_ok"] is None
    text = _rendered(report)
    for expected in ("built for", "NVIDIA H100 80GB HBM3", "10.3.0", "engine.json: profiles.decoder_step",
                     "cache_len", "decoder_step.plan", "graph encoder.onnx"):
        assert expected in text


def test_engine_json_of_another_shape_is_shown_generically(tmp_path):
    (tmp_path / "engine.json").write_text(json.dumps({
        "trt_version": "11.0", "device": {"name": "NVIDIA L4", "sm": [8, 9]}, "precision": "bf16",
        "profiles": [{"batch": [1, 4, 8]}], "files": [{"name": "model.plan", "bytes": 5}]}))
    report = inspect_path(tmp_path)
    assert report["built_for"] == {"tensorrt_version": "11.0", "gpu": "NVIDIA L4", "compute_capability": [8, 9],
                                   "precision": "bf16"}
    assert report["runtime_check"].startswith("engine directory")  # the runtime would refuse it
    assert report["problems"] == [f"{tmp_path / 'model.plan'} is listed but missing"]
    assert "engine.json: profiles" in _rendered(report)


def test_engine_with_a_changed_plan(engine_dir):
    """Same size, other bytes: only the sha256 tells. A small directory's sums are compared unasked, as the
    TensorRT backend compares them at every load; without them compared, the report says so, never "ok"."""
    with open(os.path.join(engine_dir, "encoder.plan"), "wb") as f:
        f.write(b"\x02" * 1000)
    unhashed = inspect_path(engine_dir, verify=False)
    assert unhashed["runtime_check"] == RUNTIME_OK_UNHASHED and unhashed["hashes"]["checked"] is False
    for report in (inspect_path(engine_dir), inspect_path(engine_dir, verify=True)):
        assert "encoder.plan does not match its sha256" in report["runtime_check"]
        assert any("encoder.plan does not match its recorded sha256" in p for p in report["problems"])
    assert _cli("inspect", engine_dir).exit_code == 1


def test_engine_file_path_stands_for_its_directory(engine_dir):
    assert inspect_path(os.path.join(engine_dir, "engine.json"))["path"] == os.path.abspath(engine_dir)


def test_engine_with_a_missing_plan(engine_dir):
    os.remove(os.path.join(engine_dir, "encoder.plan"))
    report = inspect_path(engine_dir)
    assert any("encoder.plan is listed but missing" in p for p in report["problems"])
    result = _cli("inspect", engine_dir)
    assert result.exit_code == 1 and "problems" in result.output and "missing" in result.output
    result = _cli("inspect", engine_dir, "--json")
    assert result.exit_code == 1 and json.loads(result.output)["problems"]


# -- anything else: a clear error -----------------------------------------------------------------------


def test_nonexistent_path(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(TransduceError, match="does not exist"):
        inspect_path(missing)
    result = _cli("inspect", missing)
    assert result.exit_code == 2 and missing in result.output and "Traceback" not in result.output


def test_directory_of_no_known_kind(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    result = _cli("inspect", str(tmp_path))
    assert result.exit_code == 2
    assert str(tmp_path) in result.output and "config.json" in result.output and "manifest.json" in result.output


def test_a_plain_file(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\x00")
    result = _cli("inspect", str(path))
    assert result.exit_code == 2 and "is a file" in result.output and str(path) in result.output


@pytest.mark.parametrize("content", ["{ truncated", "[1, 2]", '{"format": "something-else"}'])
def test_corrupt_model_config(tiny_model_dir, tmp_path, content):
    import shutil

    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    (path / "config.json").write_text(content)
    with pytest.raises(CheckpointError):
        inspect_path(path)
    result = _cli("inspect", str(path))
    assert result.exit_code == 2 and "config.json" in result.output and str(path) in result.output


@pytest.mark.parametrize("content", ["{ truncated", '"a string"', '{"kind": "something-else"}'])
def test_corrupt_manifest(artifact_dir, content):
    with open(os.path.join(artifact_dir, "manifest.json"), "w") as f:
        f.write(content)
    with pytest.raises(ArtifactError):
        inspect_path(artifact_dir)
    result = _cli("inspect", artifact_dir, "--json")
    assert result.exit_code == 2 and "manifest.json" in result.output and artifact_dir in result.output


def test_corrupt_engine_json(engine_dir):
    with open(os.path.join(engine_dir, "engine.json"), "w") as f:
        f.write("{")
    result = _cli("inspect", engine_dir)
    assert result.exit_code == 2 and "engine.json is not valid JSON" in result.output


@pytest.mark.parametrize("name, expected", [
    ("encoder_layers.3.self_attn.q_proj.weight", ("encoder", "encoder self-attention", ("encoder", 3))),
    ("decoder_layers.0.cross_attn.out_proj.bias", ("decoder", "decoder cross-attention", ("decoder", 0))),
    ("decoder_layers.1.norm3.weight", ("decoder", "decoder layer norm", ("decoder", 1))),
    ("/decoder_layers.1/ffn/w2/MatMul", ("decoder", "decoder feed-forward", ("decoder", 1))),
    ("encoder_norm.bias", ("encoder", "encoder final layer norm", None)),
    ("embed.weight", ("embeddings", "embedding (target, or shared)", None)),
    ("src_embed.weight", ("embeddings", "source embedding", None)),
    ("out_proj.weight", ("embeddings", "output projection", None)),
    ("pe", ("embeddings", "positional encoding table", None)),
    # mBART's learned tables and embedding norms, in weights and in a graph's node names
    ("encoder_positions.weight", ("embeddings", "encoder positional embedding (learned)", None)),
    ("/decoder_positions/Gather", ("embeddings", "decoder positional embedding (learned)", None)),
    ("decoder_embed_norm.bias", ("embeddings", "decoder embedding layer norm", None)),
    # a dynamo-exported graph's constant, by its consumer's scope: the table lifted as buffer b_model_pe
    ("node_GatherND_16 : transduce.exporter.graphs.EncoderGraph/index: aten.index.Tensor b_model_pe",
     ("embeddings", "positional encoding table", None)),
    ("node_Add_3 : x b_model_pex", ("other", "other", None)),
    ("onnx::MatMul_12", ("other", "other", None)),
])
def test_classify_parameter(name, expected):
    assert classify_parameter(name) == expected


@pytest.mark.slow
def test_artifact_from_the_exporter(tiny_artifact_dir, tiny_model):
    """On a real export: the contract's IO with symbolic dims, op histograms, parameters found by scope."""
    from transduce.formats import contract

    cfg = tiny_model.cfg
    report = inspect_path(tiny_artifact_dir, verify=True)
    assert report["problems"] == [] and report["runtime_check"] == "ok"
    assert report["config"] == cfg.to_dict() and report["tokenizer"]["vocab_size"] == cfg.vocab_size
    sizes = contract.static_axis_sizes(cfg)
    expected = {
        "encoder.onnx": (contract.encoder_inputs(), contract.encoder_outputs(cfg.decoder_layers)),
        "decoder_step.onnx": (contract.step_inputs(cfg.decoder_layers), contract.step_outputs(cfg.decoder_layers)),
    }
    for name, (inputs, outputs) in expected.items():
        graph = report["graphs"][name]
        for got, specs in ((graph["inputs"], inputs), (graph["outputs"], outputs)):
            assert [v["name"] for v in got] == [s.name for s in specs]
            assert [v["shape"] for v in got] == [[sizes.get(a, a) for a in s.axes] for s in specs]
        assert graph["nodes"] == sum(graph["ops"].values()) > 0 and graph["ops"].get("MatMul", 0) > 0
        params = graph["parameters"]
        other = params["components"].get("other", {"parameters": 0})["parameters"]
        assert other < 0.01 * params["total"]  # weights are attributed to their modules
        # the sinusoidal table, a nameless constant in the graph, is found by its consumer's FX node (with the
        # index constants of the same op, as every module's nodes count theirs)
        table = params["components"]["embeddings"]["kinds"]["positional encoding table"]
        assert 0 <= table - cfg.max_positions * cfg.d_model < 16
    assert "encoder" in report["graphs"]["encoder.onnx"]["parameters"]["components"]
    assert "encoder" not in report["graphs"]["decoder_step.onnx"]["parameters"]["components"]
    assert all(f["sha256_ok"] for f in report["files"] if f["sha256"])


def test_an_export_without_its_manifest_is_named_as_such(tiny_artifact_dir, tmp_path):
    """Not reported as a model directory missing its weights: the graphs beside the copied config.json say
    what it is."""
    import shutil

    half = tmp_path / "half"
    shutil.copytree(tiny_artifact_dir, half)
    os.remove(half / "manifest.json")
    with pytest.raises(ArtifactError, match="holds an export's ONNX graphs but no manifest.json"):
        inspect_path(str(half))
    r = CliRunner().invoke(main, ["inspect", str(half)])
    assert r.exit_code == 2 and "transduce export MODEL_DIR --out OUT_DIR --force" in r.stderr
