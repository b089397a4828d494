"""Exported artifacts, one per precision, built once per session.

fp32: the tiny random model (tiny_model_dir, 2+2 layers), tests/conftest.py's tiny_artifact_dir.
fp16 and bf16: a 1+1-layer version of it. Tracing with torch.export is the slow part (about 4 s per layer and graph on
2 cores), so every test shares these and the reduced-precision ones have one layer per stack: they
still hold every fp32 island (encoder and decoder LayerNorm, self- and cross-attention softmax,
log_softmax) and every residual cast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from transduce.formats.artifact import read_manifest


@dataclass(frozen=True)
class Exported:
    path: str
    manifest: dict


@pytest.fixture(scope="session")
def artifact_fp32(tiny_artifact_dir) -> Exported:
    """tests/conftest.py's export of tiny_model_dir (shared with the engine and runtime tests)."""

    return Exported(tiny_artifact_dir, read_manifest(tiny_artifact_dir))


@pytest.fixture
def copied_graphs(artifact_fp32, monkeypatch):
    """Make export_artifact copy the session's fp32 graphs instead of tracing (fast); the rest runs."""
    import shutil

    from transduce.exporter import onnx_export

    def fake_export_graphs(model, directory, precision, opset, log=None, ort_step_graph=True):
        names = (["encoder.onnx", "decoder_step.onnx", "decoder_step.attn.onnx"]
                 + (["decoder_step.ort.onnx"] if ort_step_graph else []))
        for name in names:
            shutil.copyfile(os.path.join(artifact_fp32.path, name), os.path.join(directory, name))
        return {name.removesuffix(".onnx"): 0.0 for name in names}

    monkeypatch.setattr(onnx_export, "export_graphs", fake_export_graphs)


ONE_LAYER = dict(encoder_layers=1, decoder_layers=1, d_model=32, n_heads=4, d_ff=64, dropout=0.1, max_positions=64)


@pytest.fixture(scope="session")
def one_layer_model(tiny_tokenizer):
    """A 1+1-layer Transformer with seeded random weights (eval mode)."""
    from tests.conftest import seeded_model

    return seeded_model(tiny_tokenizer, 1, **ONE_LAYER)


@pytest.fixture(scope="session")
def one_layer_model_dir(tmp_path_factory, one_layer_model, tiny_tokenizer):
    from tests.conftest import saved_model_dir

    return saved_model_dir(tmp_path_factory, "one_layer", one_layer_model, tiny_tokenizer)


def _export(tmp_path_factory, model_dir: str, precision: str) -> Exported:
    """Through the library; the CLI is tested with copied graphs (test_export.py, test_bad_inputs.py)."""
    from transduce.exporter.onnx_export import export_artifact

    out = str(tmp_path_factory.mktemp("export") / f"art_{precision}")
    return Exported(out, export_artifact(model_dir, out, precision=precision))


@pytest.fixture(scope="session")
def artifact_fp16(tmp_path_factory, one_layer_model_dir) -> Exported:
    return _export(tmp_path_factory, one_layer_model_dir, "fp16")


@pytest.fixture(scope="session")
def artifact_bf16(tmp_path_factory, one_layer_model_dir) -> Exported:
    return _export(tmp_path_factory, one_layer_model_dir, "bf16")


@pytest.fixture
def model_copy(tmp_path, tiny_model_dir) -> str:
    """A private copy of the tiny model directory, to damage."""
    import shutil

    dst = str(tmp_path / "model")
    shutil.copytree(tiny_model_dir, dst)
    return dst


def graph_path(exported: Exported, name: str) -> str:
    return os.path.join(exported.path, name)
