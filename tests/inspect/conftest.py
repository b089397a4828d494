"""Fixtures for `transduce inspect`: an artifact directory and an engine directory made by hand.

The artifact is two small ONNX graphs built with onnx.helper, with the IO contract's inputs and outputs
(transduce/formats/contract.py), plus a manifest in the exporter's format, so these tests do not depend on
the exporter (some also inspect a real export: tests/conftest.py's tiny_artifact_dir). The engine directory
is a copy of that artifact with two dummy plans and an engine.json in the TensorRT builder's format, so no
TensorRT is needed.
"""

from __future__ import annotations

import json
import os

import pytest

from transduce.formats import contract

VOCAB, D_MODEL, HEADS = 50, 8, 2
# A name that says nothing, consumed by a node whose name holds the module path (as torch.onnx writes them).
OPAQUE_WEIGHT = "onnx::MatMul_7"


def _file_entries(directory: str, names: list[str]) -> dict:
    from transduce.io.files import sha256_file

    return {n: {"sha256": sha256_file(os.path.join(directory, n)), "bytes": os.path.getsize(os.path.join(directory, n))}
            for n in names}


def _heads(source: str, out: str, shape: list[int], perm: list[int] | None = None) -> list:
    """Nodes that reshape `source` to `shape` (0: that dim as it is), then transpose it by `perm`, into `out`."""
    import numpy as np
    from onnx import helper, numpy_helper

    nodes = [helper.make_node("Constant", [], [out + "_shape"],
                              value=numpy_helper.from_array(np.array(shape, np.int64))),
             helper.make_node("Reshape", [source, out + "_shape"], [out + ("_split" if perm else "")])]
    if perm:
        nodes.append(helper.make_node("Transpose", [out + "_split"], [out], perm=perm))
    return nodes


def _encoder_graph():
    """The contract's encoder for one decoder layer (tests/inspect reads graphs; nothing runs them):
    memory (batch, src_len, d_model) = embed[src_ids] @ W_q, and the cross K/V its heads
    (batch, heads, src_len, head_dim); src_lengths unused."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    embed = numpy_helper.from_array(rng.standard_normal((VOCAB, D_MODEL)).astype(np.float32), "embed.weight")
    w_q = numpy_helper.from_array(rng.standard_normal((D_MODEL, D_MODEL)).astype(np.float32), OPAQUE_WEIGHT)
    nodes = [
        helper.make_node("Gather", ["embed.weight", "src_ids"], ["x"], name="/embed/Gather"),
        helper.make_node("MatMul", ["x", OPAQUE_WEIGHT], ["memory"], name="/encoder_layers.0/self_attn/q_proj/MatMul"),
        *_heads("memory", "cross_key_0", [0, 0, HEADS, D_MODEL // HEADS], [0, 2, 1, 3]),
        helper.make_node("Identity", ["cross_key_0"], ["cross_value_0"]),
    ]
    cross = ["batch", HEADS, "src_len", D_MODEL // HEADS]
    graph = helper.make_graph(
        nodes, "encoder",
        [helper.make_tensor_value_info("src_ids", TensorProto.INT64, ["batch", "src_len"]),
         helper.make_tensor_value_info("src_lengths", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("memory", TensorProto.FLOAT, ["batch", "src_len", D_MODEL]),
         helper.make_tensor_value_info("cross_key_0", TensorProto.FLOAT, cross),
         helper.make_tensor_value_info("cross_value_0", TensorProto.FLOAT, cross)],
        [embed, w_q],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="hand-made")


def _step_graph():
    """The contract's step for one decoder layer: log_probs (batch, vocab) =
    LogSoftmax(relu(embed[tokens] @ W1) @ embed^T), and this step's K/V (batch, heads, 1, head_dim) the
    embedding's heads; the cache, positions, lengths and cross K/V are read by nothing."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    embed = numpy_helper.from_array(rng.standard_normal((VOCAB, D_MODEL)).astype(np.float32), "embed.weight")
    w1 = numpy_helper.from_array(rng.standard_normal((D_MODEL, D_MODEL)).astype(np.float32),
                                 "decoder_layers.0.ffn.w1.weight")
    nodes = [
        helper.make_node("Gather", ["embed.weight", "tokens"], ["x"]),
        helper.make_node("MatMul", ["x", "decoder_layers.0.ffn.w1.weight"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Transpose", ["embed.weight"], ["et"], perm=[1, 0]),
        helper.make_node("MatMul", ["r", "et"], ["logits"]),
        helper.make_node("LogSoftmax", ["logits"], ["log_probs"], axis=-1),
        *_heads("x", "new_key_0", [0, HEADS, 1, D_MODEL // HEADS]),
        helper.make_node("Identity", ["new_key_0"], ["new_value_0"]),
    ]
    per_layer = [helper.make_tensor_value_info(f"{kind}_{kv}_0", TensorProto.FLOAT,
                                               ["batch", HEADS, axis, D_MODEL // HEADS])
                 for kind, axis in (("past", "cache_len"), ("cross", "src_len")) for kv in ("key", "value")]
    graph = helper.make_graph(
        nodes, "decoder_step",
        [helper.make_tensor_value_info(name, TensorProto.INT64, ["batch"])
         for name in ("tokens", "positions", "src_lengths")] + per_layer,
        [helper.make_tensor_value_info("log_probs", TensorProto.FLOAT, ["batch", VOCAB])]
        + [helper.make_tensor_value_info(f"new_{kv}_0", TensorProto.FLOAT, ["batch", HEADS, 1, D_MODEL // HEADS])
           for kv in ("key", "value")],
        [embed, w1],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="hand-made")


@pytest.fixture
def artifact_sizes():
    """(vocab, d_model) of the hand-made artifact."""
    return VOCAB, D_MODEL


@pytest.fixture
def artifact_dir(tmp_path):
    """An artifact directory: encoder.onnx and decoder_step.onnx with the contract's IO, tokenizer.json,
    config.json and a manifest: one the runtime's checks accept (transduce.runtime.checks.check_artifact)."""
    import onnx

    from transduce.formats.contract import CONTRACT_VERSION
    from transduce.formats.kinds import ARTIFACT_KIND, MODEL_FORMAT
    from transduce.formats.model_config import CONFIG_FORMAT_VERSION
    from transduce.models.config import ModelConfig

    path = tmp_path / "artifact"
    path.mkdir()
    for name, model in (("encoder.onnx", _encoder_graph()), ("decoder_step.onnx", _step_graph())):
        onnx.checker.check_model(model)
        onnx.save(model, str(path / name))
    from transduce.bench.models import synthetic_tokenizer

    synthetic_tokenizer(VOCAB).save(path / "tokenizer.json")
    model = ModelConfig(vocab_size=VOCAB, encoder_layers=1, decoder_layers=1, d_model=D_MODEL, n_heads=HEADS, d_ff=16,
                        max_positions=32).to_dict()  # every field, as the exporter writes it
    # the model directory's config.json, copied as export copies it: the manifest's model config must be its
    (path / "config.json").write_text(json.dumps({"format": MODEL_FORMAT, "format_version": CONFIG_FORMAT_VERSION,
                                                  "model": model}))
    manifest = {
        "kind": ARTIFACT_KIND,
        "contract_version": CONTRACT_VERSION,
        "precision": "fp32",
        "opset": 17,
        "tools": {"torch": "2.13.0", "onnx": onnx.__version__},
        "model": model,
        "files": _file_entries(str(path), ["encoder.onnx", "decoder_step.onnx", "tokenizer.json", "config.json"]),
        "dynamic_axes": {"batch": [1, 64], "src_len": [1, 32], "cache_len": [1, 32]},
        "validation": {"errors": []},
    }
    (path / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return str(path)


@pytest.fixture
def engine_dir(artifact_dir, tmp_path):
    """An engine directory as `transduce build` writes one (transduce/build/builder.py), by hand: a copy of
    the artifact, two dummy plans, and an engine.json with the builder's fields (TensorRT is not needed)."""
    import shutil

    path = tmp_path / "engine"
    shutil.copytree(artifact_dir, path)
    (path / "encoder.plan").write_bytes(b"\x00" * 1000)
    (path / "decoder_step.plan").write_bytes(b"\x01" * 3000)
    names = ["manifest.json", "encoder.onnx", "decoder_step.onnx", "encoder.plan", "decoder_step.plan"]
    files = _file_entries(str(path), names)
    profile = {"name": "all", "batch": [1, 8, 64], "src_len": [1, 32, 128]}
    engine = {
        "kind": "transduce-engine",
        "engine_format_version": 1,
        "contract_version": contract.CONTRACT_VERSION,
        "precision": "fp32",
        "created": "2026-01-01T00:00:00+00:00",
        "build_seconds": {"total": 61.2, "encoder": 20.5, "decoder_step": 40.1},
        "tensorrt": {"version": "10.3.0", "strongly_typed": True, "tf32": False, "workspace_gb": 4.0},
        "gpu": {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "index": 0, "total_memory_gb": 79.2,
                "cuda": "12.4"},
        "limits": {"max_batch": 64, "max_src_len": 128},
        "profiles": {"encoder": [profile], "decoder_step": [dict(profile, cache_len=[1, 32, 128])]},
        "artifact": {"path": artifact_dir, "contract_version": contract.CONTRACT_VERSION, "precision": "fp32",
                     "opset": 17, "manifest_sha256": files["manifest.json"]["sha256"]},
        "sources": {n: files[n] for n in ("encoder.onnx", "decoder_step.onnx")},
        "tools": {"transduce": "0.1.0", "tensorrt": "10.3.0"},
        "files": files,
    }
    (path / "engine.json").write_text(json.dumps(engine, indent=2))
    return str(path)

