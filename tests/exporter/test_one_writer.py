"""Before an export does any work: OUT_DIR's lock (a second export into it is refused at once), what killed exports
left beside it removed, and the disk space it needs (io.locks, io.paths)."""

from __future__ import annotations

import os
import re
import time

import pytest

from tests.io.test_locks import abandoned_copy, lock_held_elsewhere, other_host_prefix
from transduce.errors import CheckpointError, ExportError
from transduce.exporter import onnx_export
from transduce.io.reaping import interrupted_replace_hint, tmp_prefix
from transduce.models.transformer import Transformer


def _must_not_load(model_dir):
    raise AssertionError("the model was loaded")


def test_a_second_export_into_one_out_dir_is_refused_at_once(tiny_model_dir, tmp_path, monkeypatch):
    """Before the model is loaded (and traced for a minute at the base size), naming the export that runs; its
    temporary copy is left alone."""
    monkeypatch.setattr(onnx_export, "load_model", _must_not_load)
    out = tmp_path / "art"
    with lock_held_elsewhere(out) as pid:
        theirs = abandoned_copy(tmp_path, f"{tmp_prefix('art')}{pid}-running")  # the first export's, being written
        t0 = time.monotonic()
        with pytest.raises(ExportError, match=f"the artifact '{out}' is being written by PID {pid}"):
            onnx_export.export_artifact(tiny_model_dir, out, force=True)
        assert time.monotonic() - t0 < 1
        assert sorted(os.listdir(tmp_path)) == sorted([theirs, ".art.lock"])
        assert os.path.isfile(tmp_path / theirs / "sub" / "graph.onnx")


def test_an_export_removes_what_killed_exports_left_when_it_starts(tiny_model_dir, tmp_path, monkeypatch):
    """A kill -9 leaves the hidden copy an export was writing: the next export into the same OUT_DIR removes it
    as it starts, however recent and whatever its PID (before the lock: only after an hour, if the PID was gone).
    Another host's copy stays, and so does a previous artifact moved aside while OUT_DIR is missing (the hint of
    a missing OUT_DIR points at it)."""
    live = os.getppid()  # a running process: a PID taken again since
    killed = abandoned_copy(tmp_path, f"{tmp_prefix('out')}{live}-killed")
    other_host = abandoned_copy(tmp_path, f"{other_host_prefix('out')}{live}-theirs")
    previous = abandoned_copy(tmp_path, f"{tmp_prefix('out', 'old')}{live}-moved")
    seen = []

    def loading(model_dir):  # the export has started: its first work
        seen.append(sorted(os.listdir(tmp_path)))
        raise CheckpointError("stopped here by the test")

    monkeypatch.setattr(onnx_export, "load_model", loading)
    with pytest.raises(CheckpointError, match="stopped here"):
        onnx_export.export_artifact(tiny_model_dir, tmp_path / "out")
    assert seen == [sorted([other_host, previous, ".out.lock"])] and killed not in os.listdir(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([other_host, previous])
    assert previous in interrupted_replace_hint(tmp_path / "out")


def test_an_export_the_disk_has_no_room_for_is_refused_before_loading(tiny_model_dir, tmp_path, monkeypatch):
    from transduce.io import paths

    monkeypatch.setattr(paths, "free_bytes", lambda path: 123_456)
    monkeypatch.setattr(onnx_export, "load_model", _must_not_load)
    out = tmp_path / "out"
    with pytest.raises(ExportError) as e:
        onnx_export.export_artifact(tiny_model_dir, out, quantize="int8")
    assert re.search(rf"the export needs about [\d.]+ MB on the disk of '{out}', which has 123.5 KB free",
                     str(e.value)), str(e.value)
    assert "free some disk space" in e.value.hint and os.listdir(tmp_path) == []


def test_the_disk_space_estimate_covers_an_export(artifact_fp32, tiny_model):
    """export_bytes: at least what the export wrote, and not more than its allowance for nodes and the manifest
    above it; the graphs' weights are the model's, the embedding and the positional table in both."""
    cfg = tiny_model.cfg
    encoder, step = onnx_export.graph_weights(cfg)
    assert encoder + step == tiny_model.num_parameters() + cfg.vocab_size * cfg.d_model + 2 * cfg.max_positions * (
        cfg.d_model)
    learned = cfg.replace(positions="learned", layernorm_embedding=True)  # mBART's tables are weights, one per graph
    encoder, step = onnx_export.graph_weights(learned)
    assert encoder + step == Transformer(learned).num_parameters() + cfg.vocab_size * cfg.d_model
    written = sum(f["bytes"] for f in artifact_fp32.manifest["files"].values()) + os.path.getsize(
        os.path.join(artifact_fp32.path, "manifest.json"))
    estimate = onnx_export.export_bytes(cfg, "fp32")
    assert written <= estimate <= written + onnx_export.OTHER_EXPORT_BYTES
    assert onnx_export.export_bytes(cfg, "fp32", ort_step_graph=False) < estimate < onnx_export.export_bytes(
        cfg, "fp32", quantize="int8")


def test_the_opset_refusal_names_the_installed_onnxruntime(monkeypatch):
    """Read from the package's metadata, not a release written into the message."""
    from importlib import metadata

    with pytest.raises(ExportError, match="opset 99 is not supported") as e:
        onnx_export.check_options("fp32", 99)
    assert f"onnxruntime {metadata.version('onnxruntime')} is installed" in str(e.value)
    assert e.value.hint == f"use --opset {onnx_export.DEFAULT_OPSET} (the default)"
    versions = {"onnxruntime-gpu": "1.40.1"}  # the `gpu` extra's package

    def version(name):
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(metadata, "version", version)
    with pytest.raises(ExportError, match="onnxruntime 1.40.1 is installed"):
        onnx_export.check_options("fp32", 16)
