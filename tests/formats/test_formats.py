"""The formats layer: the weight-name layout, the kinds of directory, the dtype table, the IO check."""

from __future__ import annotations

import json

import pytest

from transduce.errors import CheckpointError
from transduce.formats import contract
from transduce.formats.dtypes import ONNX_TYPES, onnx_type, ort_type, tensorrt_type
from transduce.formats.kinds import detect_kind, is_artifact_dir, is_engine_dir, is_model_dir
from transduce.formats.model_config import ModelConfig
from transduce.formats.weights import WEIGHTS_LAYOUT_VERSION, layout_mismatches, weight_shapes


@pytest.mark.parametrize("fields", [{}, {"norm_first": True}, {"share_embeddings": False},
                                    {"encoder_layers": 1, "decoder_layers": 3, "d_ff": 24}])
def test_weight_layout_is_the_models_state_dict(fields):
    """The layout computed without torch names and shapes exactly what the Transformer holds, in its order."""
    import torch

    from transduce.models.transformer import Transformer

    cfg = ModelConfig(**{"vocab_size": 50, "d_model": 16, "n_heads": 2, "d_ff": 32, "encoder_layers": 2,
                         "decoder_layers": 2, **fields})
    with torch.device("meta"):
        state = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    assert list(weight_shapes(cfg).items()) == list(state.items())
    assert layout_mismatches(state, cfg) == []


def test_layout_mismatches_name_what_differs():
    cfg = ModelConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=32, encoder_layers=1, decoder_layers=1)
    shapes = dict(weight_shapes(cfg))
    del shapes["decoder_layers.0.ffn.w1.bias"]
    shapes["extra.weight"] = (1,)
    shapes["embed.weight"] = (51, 16)
    problems = layout_mismatches(shapes, cfg)
    assert problems == ["weights missing for this config: decoder_layers.0.ffn.w1.bias",
                        "weights this config's model does not have: extra.weight",
                        "weights of other shapes than the config's: embed.weight [51, 16] (config: [50, 16])"]


def test_another_weight_layout_version_is_refused(tiny_model_dir, tmp_path):
    import shutil

    from transduce.formats.model_dir import read_config

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["weights_layout_version"] == WEIGHTS_LAYOUT_VERSION
    del cfg["weights_layout_version"]  # written before the layout was versioned: version 1
    (d / "config.json").write_text(json.dumps(cfg))
    assert read_config(str(d))["model"] == cfg["model"]
    cfg["weights_layout_version"] = WEIGHTS_LAYOUT_VERSION + 1
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="weights_layout_version"):
        read_config(str(d))


def _make(tmp_path, name: str, files: dict[str, str]) -> str:
    """A directory `name` holding `files` ({name: text})."""
    d = tmp_path / name
    d.mkdir()
    for fname, text in files.items():
        (d / fname).write_text(text)
    return str(d)


def test_detect_kind_by_description_file(tmp_path):
    def make(name, files):
        return _make(tmp_path, name, files)

    model = make("model", {"config.json": '{"format": "transduce-model"}', "model.safetensors": ""})
    artifact = make("artifact", {"config.json": '{"format": "transduce-model"}',
                                 "manifest.json": '{"kind": "transduce-artifact"}'})
    engine = make("engine", {"config.json": "{}", "manifest.json": '{"kind": "transduce-artifact"}',
                             "engine.json": '{"kind": "transduce-engine"}'})
    other = make("other", {"notes.txt": "x"})
    assert [detect_kind(d) for d in (model, artifact, engine, other)] == ["model", "artifact", "engine", None]
    assert is_model_dir(model) and not is_model_dir(artifact) and not is_model_dir(engine)
    assert is_artifact_dir(artifact) and not is_artifact_dir(engine) and is_engine_dir(engine)


def test_force_replaces_what_transduce_wrote_even_damaged(tmp_path):
    """A marker file that says so, or one that is not JSON beside a file only such a directory has;
    never someone else's JSON file of the same name, nor an export or engine directory as a model."""
    from transduce.formats.kinds import is_engine_dir
    from transduce.formats.kinds import is_model_dir as is_our_model_dir

    _is_artifact = is_artifact_dir

    model = '{"format": "transduce-model"}'
    cases = [
        (_is_artifact, {"manifest.json": '{"kind": "transduce-artifact"}'}, True),
        (_is_artifact, {"manifest.json": "{ truncated", "encoder.onnx": "x"}, True),
        (_is_artifact, {"manifest.json": "{ truncated"}, False),
        (_is_artifact, {"manifest.json": '{"name": "my web app"}', "encoder.onnx": "x"}, False),
        (is_engine_dir, {"engine.json": '{"kind": "transduce-engine"}'}, True),
        (is_engine_dir, {"engine.json": "", "encoder.plan": "x"}, True),
        (is_engine_dir, {"engine.json": '{"kind": "transduce-artifact"}'}, False),
        (is_our_model_dir, {"config.json": model}, True),  # its weights lost: still ours to replace
        (is_our_model_dir, {"config.json": "{ trunc", "model.safetensors": "x"}, True),
        (is_our_model_dir, {"config.json": model, "manifest.json": "{}"}, False),  # an export's copy
        (is_our_model_dir, {"config.json": model, "engine.json": "{}"}, False),
        (is_our_model_dir, {"config.json": '{"format": "huggingface"}', "model.safetensors": "x"}, False),
    ]
    for i, (is_kind, files, want) in enumerate(cases):
        assert is_kind(_make(tmp_path, f"d{i}", files)) is want, (is_kind.__name__, files)


def test_the_dtype_table_agrees_with_the_tools():
    from onnx import helper

    for number, name in ONNX_TYPES.items():
        if number in (0, 8):  # undefined, string: no numpy dtype
            continue
        np_name = helper.tensor_dtype_to_np_dtype(number).name
        assert onnx_type(number) == name == np_name, (number, np_name)
    assert ort_type("tensor(float16)") == "float16" and ort_type("tensor(weird)") == "tensor(weird)"
    assert tensorrt_type("DataType.BF16") == "bfloat16" and tensorrt_type("HALF") == "float16"


def test_io_check_of_a_graph_and_of_an_engine():
    config = ModelConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=32, encoder_layers=1, decoder_layers=1)
    specs = contract.encoder_outputs(1)
    good = [(s.name, contract.resolve_dtype(s, "fp16"), contract.axis_dims(s, config)) for s in specs]
    assert contract.io_mismatches("output", good, specs, "fp16", config, exact=True) == []
    swapped = [good[1], good[0]] + good[2:]
    assert contract.io_mismatches("output", swapped, specs, "fp16", config)[0].startswith("outputs are in the order")
    assert contract.io_mismatches("output", swapped, specs, "fp16", config, ordered=False) == []
    one_batch = [("memory", "float16", (1, "src_len", 16))] + good[1:]  # exported for one batch size
    assert contract.io_mismatches("output", one_batch, specs, "fp16", config) == [
        "output memory has dims [1, 'src_len', 16], the contract says ['batch', 'src_len', 16]"]
    engine = [("memory", "float32", (-1, -1, 16))] + good[1:2]
    assert contract.io_mismatches("engine output", engine, specs, "fp16", config, ordered=False) == [
        "engine outputs lack ['cross_value_0']", "engine output memory is float32, the contract says float16 (fp16)"]
