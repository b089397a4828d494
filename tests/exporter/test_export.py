"""End-to-end export of the tiny model: the CLI, the artifact's files, the manifest, the graphs' IO."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import numpy as np
import pytest

from transduce.errors import ArtifactError
from transduce.formats import contract
from transduce.formats.artifact import read_manifest
from transduce.formats.kinds import ARTIFACT_KIND
from transduce.formats.model_config import ModelConfig
from transduce.io.files import sha256_file


def test_export_copies_the_config_and_tokenizer_it_loaded(tiny_model_dir, tmp_path):
    """The artifact's config.json and tokenizer.json are the bytes the model was loaded with, read at
    once: a model directory that changes meanwhile (a checkpoint saved into it) is an error."""
    from transduce.errors import CheckpointError
    from transduce.exporter.onnx_export import load_model, load_source, read_copied_files
    from transduce.io.atomic import atomic_directory

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    source = load_source(str(model_dir))
    load_model(source)
    copied = read_copied_files(source)
    tokenizer = (model_dir / "tokenizer.json").read_bytes()
    assert copied["tokenizer.json"] == tokenizer
    with atomic_directory(str(model_dir)) as tmp:  # a checkpoint saved over it: another copy, renamed into place
        shutil.copytree(tiny_model_dir, tmp, dirs_exist_ok=True)
        open(os.path.join(tmp, "tokenizer.json"), "wb").write(tokenizer.replace(b'"<unk>"', b'"<UNK>"'))
    assert read_copied_files(source) == copied  # the copy the model was loaded from, held open
    # a tokenizer.json that is not the one config.json records (a file rewritten in place meanwhile)
    with pytest.raises(CheckpointError, match="changed while it was being read"):
        read_copied_files(load_source(str(model_dir)))


def test_export_writes_an_artifact(artifact_fp32):
    names = set(os.listdir(artifact_fp32.path))
    assert names == {"encoder.onnx", "decoder_step.onnx", "decoder_step.ort.onnx", "decoder_step.attn.onnx",
                     "manifest.json", "config.json",
                     "tokenizer.json"}
    parent = os.path.dirname(artifact_fp32.path)
    assert not [n for n in os.listdir(parent) if ".tmp-" in n], "a temporary directory was left behind"


def test_cli_export(artifact_fp32, tiny_model_dir, tmp_path, copied_graphs):
    """`transduce export` (tracing replaced by a copy of the session's graphs; loading, checks,
    validation and the manifest run): exit 0, a summary on stdout, progress on stderr."""
    from click.testing import CliRunner

    from transduce.cli import main

    out = tmp_path / "art"
    result = CliRunner().invoke(main, ["export", tiny_model_dir, str(out)])
    assert result.exit_code == 0, result.output
    assert "[export] validating against eager PyTorch" in result.output
    assert "log_probs" in result.output and "exported in" in result.output
    columns = {line.index(" max abs ") for line in result.output.splitlines() if " max abs " in line}
    assert len(columns) == 1, result.output  # one column, whatever the longest output group's name
    assert read_manifest(out)["graphs"] == artifact_fp32.manifest["graphs"]


def test_manifest_describes_the_export(artifact_fp32, tiny_model_dir):
    import onnx
    import onnxruntime
    import torch

    from transduce.formats.model_dir import read_config

    m = artifact_fp32.manifest
    cfg = read_config(tiny_model_dir)
    assert m["kind"] == ARTIFACT_KIND and m["contract_version"] == contract.CONTRACT_VERSION
    assert m["precision"] == "fp32" and m["opset"] == 18
    assert m["tools"]["torch"] == torch.__version__ and m["tools"]["onnx"] == onnx.__version__
    assert m["tools"]["onnxruntime"] == onnxruntime.__version__ and m["tools"]["transduce"]
    assert m["model"] == cfg["model"]
    assert m["source_model"]["path"] == os.path.abspath(tiny_model_dir)
    assert m["source_model"]["weights_sha256"] == sha256_file(os.path.join(tiny_model_dir, "model.safetensors"))
    p = cfg["model"]["max_positions"]
    assert m["dynamic_axes"] == {"batch": [1, None], "src_len": [1, p], "cache_len": [1, p]}
    assert m["export_seconds"]["total"] > 0
    assert m["tensorrt_ops"]["source"].startswith("Source: onnx/onnx-tensorrt")
    for name in ("encoder.onnx", "decoder_step.onnx"):
        g = m["graphs"][name]
        assert g["nodes"] == sum(g["op_histogram"].values()) and g["external_data"] == []
        model = onnx.load(os.path.join(artifact_fp32.path, name))
        assert g["op_histogram"] == dict(Counter(n.op_type for n in model.graph.node))
    # the copies make the artifact self-contained
    for name in ("config.json", "tokenizer.json"):
        with (open(os.path.join(tiny_model_dir, name), "rb") as a,
              open(os.path.join(artifact_fp32.path, name), "rb") as b):
            assert a.read() == b.read()


def test_manifest_hashes_every_file(artifact_fp32, tmp_path):
    m = artifact_fp32.manifest
    on_disk = sorted(n for n in os.listdir(artifact_fp32.path) if n != "manifest.json")
    assert sorted(m["files"]) == on_disk
    for name, meta in m["files"].items():
        path = os.path.join(artifact_fp32.path, name)
        assert meta == {"sha256": sha256_file(path), "bytes": os.path.getsize(path)}
    read_manifest(artifact_fp32.path)  # verifies every hash
    bad = tmp_path / "tampered"
    shutil.copytree(artifact_fp32.path, bad)
    data = bytearray((bad / "encoder.onnx").read_bytes())
    data[-10] ^= 0xFF
    (bad / "encoder.onnx").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256"):
        read_manifest(bad)


def test_validation_is_recorded(artifact_fp32):
    from transduce.verify.tolerances import POLICIES

    val = artifact_fp32.manifest["validation"]
    assert val["engine"].startswith("onnxruntime")
    rows = {r["output"]: r for r in val["errors"]}
    n = artifact_fp32.manifest["model"]["decoder_layers"]
    expected = {s.name for s in contract.encoder_outputs(n) + contract.step_outputs(n)}
    # the latter of decoder_step.ort.onnx: its top-k and the whole cache its in-place write leaves
    # and the attention step graph's own output, attention
    assert set(rows) == (expected | {"topk_values", "topk_ids", "attention"}
                         | {s.name for s in contract.ort_step_outputs(n)})
    for r in rows.values():
        assert r["passed"] and 0 <= r["max_abs"] <= r["atol"]
    assert rows["log_probs"]["atol"] == POLICIES["fp32"].outputs["log_probs"][0] == 1e-4
    cases = {c["name"]: c for c in val["cases"]}
    assert cases["batch1"]["past_lengths"] == [0, 1, 2, 5, 11] and cases["batch1"]["cache_len_1"]
    assert cases["padded"]["batch"] > 1 and min(cases["padded"]["src_lengths"]) == 1
    p = artifact_fp32.manifest["model"]["max_positions"]
    assert cases["longest"]["src_len"] == p and cases["longest"]["cache_len"] == p


def test_graphs_follow_the_contract(artifact_fp32):
    import onnx

    from transduce.verify.graph_checks import contract_problems

    cfg = ModelConfig.from_dict(artifact_fp32.manifest["model"])
    n = cfg.decoder_layers
    enc = onnx.load(os.path.join(artifact_fp32.path, "encoder.onnx"))
    step = onnx.load(os.path.join(artifact_fp32.path, "decoder_step.onnx"))
    assert contract_problems(enc, contract.encoder_inputs(), contract.encoder_outputs(n), cfg, "fp32") == []
    assert contract_problems(step, contract.step_inputs(n), contract.step_outputs(n), cfg, "fp32") == []
    past = next(v for v in step.graph.input if v.name == "past_key_0")
    dims = [d.dim_param or d.dim_value for d in past.type.tensor_type.shape.dim]
    assert dims == ["batch", cfg.n_heads, "cache_len", cfg.head_dim]
    # and a graph that breaks it is caught
    assert contract_problems(enc, contract.encoder_inputs(), contract.encoder_outputs(n), cfg, "fp16")
    assert contract_problems(step, contract.encoder_inputs(), contract.encoder_outputs(n), cfg, "fp32")


def test_one_straight_line_step_graph(artifact_fp32):
    for name, g in artifact_fp32.manifest["graphs"].items():
        ops = set(g["op_histogram"])
        assert not ops & {"If", "Loop", "Scan", "Dropout", "RandomUniformLike", "RandomNormalLike"}, name
        assert "Constant" not in ops and "Identity" not in ops  # constants folded into initializers
        assert "LayerNormalization" in ops  # opset >= 17: one node, not a decomposition
    onnx_files = [n for n in os.listdir(artifact_fp32.path) if n.endswith(".onnx")]
    assert sorted(onnx_files) == ["decoder_step.attn.onnx", "decoder_step.onnx", "decoder_step.ort.onnx",
                                  "encoder.onnx"]


def test_the_lowest_opset_exports_every_graph_at_it(artifact_fp32, tiny_model_dir, tmp_path):
    """--opset 17, the lowest taken: every graph at 17 (torch exports at 18 and converts down: the attention step's
    head average must be convertible), validated, and decoding as the default opset's artifact."""
    import onnx

    from transduce.exporter.onnx_export import export_artifact
    from transduce.runtime.api import load

    manifest = export_artifact(tiny_model_dir, tmp_path / "o17", opset=17)
    for name in ("encoder.onnx", "decoder_step.onnx", "decoder_step.attn.onnx", "decoder_step.ort.onnx"):
        model = onnx.load(str(tmp_path / "o17" / name))
        assert {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")} == {17}, name
    assert manifest["opset"] == 17 and all(r["passed"] for r in manifest["validation"]["errors"])
    texts = ["one two three", "four"]
    ours, default = load(str(tmp_path / "o17")), load(artifact_fp32.path)
    assert [t.text for t in ours.translate(texts)] == [t.text for t in default.translate(texts)]
    got = ours.translate(texts, beam_size=1, return_attention=True)
    want = default.translate(texts, beam_size=1, return_attention=True)
    assert all(np.allclose(a.attention, b.attention, atol=1e-6) for a, b in zip(got, want, strict=True))


def test_the_step_graph_is_the_attention_steps_trace_less_its_attention(artifact_fp32, tiny_model, tmp_path):
    """decoder_step.onnx comes from the attention step's trace, its attention output and the nodes only it reads
    dropped: the nodes (op for op, with their attributes), weights and outputs of a trace of the step alone, and
    its own doc string and metadata."""
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from transduce.exporter import graphs
    from transduce.exporter.onnx_export import export_graph

    cfg = tiny_model.cfg
    n = cfg.decoder_layers
    _, step_args = graphs.example_inputs(cfg, "fp32")
    _, shapes = graphs.dynamic_shapes(cfg)
    alone = str(tmp_path / "alone.onnx")
    export_graph(graphs.StepGraph(tiny_model).eval(), step_args, shapes, [s.name for s in contract.step_inputs(n)],
                 [s.name for s in contract.step_outputs(n)], alone, 18)
    ours = onnx.load(os.path.join(artifact_fp32.path, "decoder_step.onnx"))
    traced = onnx.load(alone)

    def nodes(m):
        return [(x.op_type, x.domain, [(a.name, helper.get_attribute_value(a)) for a in x.attribute])
                for x in m.graph.node]

    def weights(m):
        return [numpy_helper.to_array(t) for t in m.graph.initializer]

    assert nodes(ours) == nodes(traced)
    assert len(weights(ours)) == len(weights(traced))
    assert all(np.array_equal(a, b) for a, b in zip(weights(ours), weights(traced), strict=True))
    assert [o.name for o in ours.graph.output] == [s.name for s in contract.step_outputs(n)]
    props = {p.key: p.value for p in ours.metadata_props}
    assert props["transduce.graph"] == "decoder_step" and ours.doc_string.startswith("transduce decoder_step graph")
    rng = np.random.default_rng(0)
    b, c, s = 3, 5, 7
    feeds = {"tokens": rng.integers(4, cfg.vocab_size, b), "positions": np.full(b, c),
             "src_lengths": np.array([s, 2, 1])}
    for spec in contract.step_inputs(n)[3:]:
        feeds[spec.name] = rng.standard_normal((b, cfg.n_heads, c if spec.name.startswith("past") else s,
                                                cfg.head_dim)).astype(np.float32)
    got = ort.InferenceSession(os.path.join(artifact_fp32.path, "decoder_step.onnx")).run(None, feeds)
    want = ort.InferenceSession(alone).run(None, feeds)
    assert all(np.array_equal(x, y) for x, y in zip(got, want, strict=True))


@pytest.mark.parametrize("batch,src_len,cache_len", [(1, 1, 1), (1, 64, 64), (5, 3, 1), (4, 17, 30), (9, 2, 5)])
def test_dynamic_axes_are_dynamic(artifact_fp32, tiny_model, batch, src_len, cache_len):
    """ONNX Runtime runs both graphs at sizes other than the traced ones (2, 7, 6), ends of the ranges included."""
    import torch

    from transduce.verify.graph_runners import ArtifactRunner

    runner = ArtifactRunner(artifact_fp32.path)
    rng = np.random.default_rng(batch * 100 + src_len)
    cfg = tiny_model.cfg
    src = rng.integers(4, cfg.vocab_size, (batch, src_len))
    lengths = rng.integers(1, src_len + 1, batch)
    lengths[0] = src_len
    got = runner.encode(src, lengths)
    with torch.inference_mode():
        memory, ck, cv = tiny_model.encode(torch.from_numpy(src), torch.from_numpy(lengths))
    assert got["memory"].shape == (batch, src_len, cfg.d_model)
    np.testing.assert_allclose(got["memory"], memory.numpy(), atol=1e-4)
    cross = [t.numpy() for kv in zip(ck, cv) for t in kv]
    shape = (batch, cfg.n_heads, cache_len, cfg.head_dim)
    past = [rng.standard_normal(shape).astype(np.float32) for _ in cross]
    tokens = rng.integers(4, cfg.vocab_size, batch)
    positions = rng.integers(0, cache_len, batch)
    out = runner.step(tokens, positions, lengths, past, cross)
    t = torch.from_numpy
    with torch.inference_mode():
        lp, nk, _ = tiny_model.decode_step(t(tokens), t(positions), t(lengths), [t(a) for a in past[0::2]],
                                           [t(a) for a in past[1::2]], ck, cv)
    assert (out["log_probs"].shape == (batch, cfg.vocab_size)
            and out["new_key_0"].shape == (batch, cfg.n_heads, 1, cfg.head_dim))
    np.testing.assert_allclose(out["log_probs"], lp.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(out["new_key_1"], nk[1].numpy(), atol=1e-4)


def test_export_replaces_an_artifact_only_with_force(artifact_fp32, tmp_path, copied_graphs):
    """--force swaps a complete new artifact in for an old one."""
    from click.testing import CliRunner

    from transduce.cli import main

    model_dir = artifact_fp32.manifest["source_model"]["path"]
    theirs = tmp_path / "webapp"  # a manifest.json that is not ours: never replaced
    theirs.mkdir()
    (theirs / "manifest.json").write_text(json.dumps({"name": "app"}))
    result = CliRunner().invoke(main, ["export", model_dir, str(theirs), "--force", "--quiet"])
    assert result.exit_code == 2 and "is not an artifact directory" in result.output, result.output
    assert os.listdir(theirs) == ["manifest.json"]
    out = tmp_path / "art"
    out.mkdir()
    old = {"kind": ARTIFACT_KIND, "note": "old"}
    (out / "manifest.json").write_text(json.dumps(old))
    result = CliRunner().invoke(main, ["export", model_dir, str(out), "--quiet"])
    assert result.exit_code == 2 and "already exists" in result.output and "--force" in result.output
    assert json.loads((out / "manifest.json").read_text()) == old
    result = CliRunner().invoke(main, ["export", model_dir, str(out), "--force", "--quiet"])
    assert result.exit_code == 0, result.output
    assert read_manifest(out)["kind"] == ARTIFACT_KIND


def test_external_data_is_checked_validated_and_hashed(artifact_fp32, tiny_model_dir, tmp_path, monkeypatch):
    """Graphs saved with external weights (what torch.onnx does above 1.5 GB) go through the same
    checks and validation, and their .data files are listed in the manifest with their hashes."""
    import onnx

    from transduce.exporter import onnx_export

    def export_external(model, directory, precision, opset, log=None, ort_step_graph=True):
        for name in ("encoder.onnx", "decoder_step.onnx"):
            proto = onnx.load(os.path.join(artifact_fp32.path, name))
            # like torch.onnx's saver (onnx_ir, size_threshold_bytes=256): tensors under 256 bytes stay
            # inline, so the shape-carrying constants (axes, shapes) stay readable by shape inference
            onnx.save(proto, os.path.join(directory, name), save_as_external_data=True, location=f"{name}.data",
                      size_threshold=256)
        return {"encoder": 0.0, "decoder_step": 0.0}

    monkeypatch.setattr(onnx_export, "export_graphs", export_external)
    out = tmp_path / "art"
    manifest = onnx_export.export_artifact(tiny_model_dir, out)
    assert manifest["graphs"]["encoder.onnx"]["external_data"] == ["encoder.onnx.data"]
    assert {"encoder.onnx.data", "decoder_step.onnx.data"} <= set(manifest["files"])
    whole = artifact_fp32.manifest["files"]["encoder.onnx"]["bytes"]
    assert manifest["files"]["encoder.onnx"]["bytes"] + manifest["files"]["encoder.onnx.data"]["bytes"] > whole
    assert manifest["files"]["encoder.onnx.data"]["bytes"] > whole // 3
    assert all(r["passed"] for r in manifest["validation"]["errors"])
    read_manifest(out)
    data = out / "encoder.onnx.data"  # the weights: a changed byte or a lost file is refused, as a graph's is
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    with pytest.raises(ArtifactError, match="encoder.onnx.data"):
        read_manifest(out)
    data.unlink()
    with pytest.raises(ArtifactError, match="encoder.onnx.data"):
        read_manifest(out)


def test_reuse_refusal_says_why_an_export_cannot_be_reused(tmp_path, tiny_model_dir, tiny_artifact_dir, edited_copy):
    """The demo and the bench reuse an export only while it is a current fp32, unquantized (or as asked) export
    of the same weights; otherwise the reason is given (and they export again)."""
    from transduce.exporter import ort_step
    from transduce.exporter.onnx_export import reuse_refusal
    from transduce.formats import contract

    assert reuse_refusal(tiny_artifact_dir, tiny_model_dir) is None
    assert "quantization is none, not int8" in reuse_refusal(tiny_artifact_dir, tiny_model_dir, quantize="int8")
    other = edited_copy(tiny_artifact_dir, "other", "manifest.json",
                        lambda m: m["source_model"].update(weights_sha256="0" * 64))
    assert "exported from other weights" in reuse_refusal(other, tiny_model_dir)
    fp16 = edited_copy(tiny_artifact_dir, "fp16", "manifest.json", lambda m: m.update(precision="fp16"))
    assert "it is fp16, not fp32" in reuse_refusal(fp16, tiny_model_dir)
    old = edited_copy(tiny_artifact_dir, "old", "manifest.json",
                      lambda m: m["graphs"][contract.ORT_STEP_FILE].update(revision=ort_step.REVISION - 1))
    assert "older than this exporter's" in reuse_refusal(old, tiny_model_dir)
    (tmp_path / "empty").mkdir()
    assert "not a valid artifact" in reuse_refusal(tmp_path / "empty", tiny_model_dir)
