"""Edited copies of an exported artifact for the tests (importable: tests/ is on sys.path)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def perturb_one_weight(artifact_dir: str, out_dir, delta: float = 0.1) -> str:
    """A copy of the artifact with one weight of the step graph changed and the manifest re-hashed.

    The weight: one element of the last decoder layer's last LayerNorm bias, which every log-prob sees.
    """
    import onnx
    from onnx import numpy_helper

    from transduce.io.files import file_entry

    shutil.copytree(artifact_dir, out_dir)
    art = str(out_dir)
    path = os.path.join(art, "decoder_step.onnx")
    model = onnx.load(path)
    name = f"decoder_layers.{_n_layers(model) - 1}.norm3.bias"
    init = next(t for t in model.graph.initializer if t.name.endswith(name))
    arr = numpy_helper.to_array(init).copy()
    arr.flat[0] += delta
    init.CopyFrom(numpy_helper.from_array(arr, init.name))
    onnx.save(model, path)
    manifest = json.loads(open(os.path.join(art, "manifest.json")).read())
    manifest["files"]["decoder_step.onnx"] = file_entry(path)
    open(os.path.join(art, "manifest.json"), "w").write(json.dumps(manifest))
    return art


def _n_layers(model) -> int:
    return sum(1 for i in model.graph.input if i.name.startswith("past_key_"))


# -- what the runtime refuses -------------------------------------------------------------------------------
# Each edit below makes a copy of a sound export that the runtime refuses to load (transduce.runtime.checks,
# run by every backend over an artifact); `transduce inspect` runs the same checks and must exit 1 for each
# (2 where the directory is no longer recognisable as an artifact at all). tests/runtime/test_backends.py
# holds the runtime to the table, tests/inspect/test_inspect_agrees_with_runtime.py holds inspect to it.


@dataclass(frozen=True)
class Refusal:
    name: str
    edit: Callable[[str], None]  # changes the copy in place
    says: str  # a regex the runtime's error matches
    inspect_exit: int = 1


def edit_json(directory: str, name: str, edit: Callable[[Any], None]) -> None:
    """edit(obj) changes the JSON file `name` of `directory` in place."""
    path = os.path.join(directory, name)
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    edit(obj)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)


def rehash(directory: str, *names: str) -> None:
    """Record the files `names` in the manifest as they are now: a change only the runtime's other checks see."""
    from transduce.io.files import file_entry

    edit_json(directory, "manifest.json",
              lambda m: m["files"].update({n: file_entry(os.path.join(directory, n)) for n in names}))


def _manifest(edit: Callable[[dict], Any]) -> Callable[[str], None]:
    return lambda art: edit_json(art, "manifest.json", edit)


def _model(**changes) -> Callable[[str], None]:
    """The manifest's model config edited by hand, its copy of config.json left as it was."""
    return _manifest(lambda m: m["model"].update({k: v(m["model"]) for k, v in changes.items()}))


def _other_export(**changes) -> Callable[[str], None]:
    """The model config edited in the manifest and in config.json alike (re-hashed): as if the graphs were
    another model's; only their inputs and outputs tell."""
    def edit(art: str) -> None:
        _model(**changes)(art)
        edit_json(art, "config.json", lambda c: c["model"].update({k: v(c["model"]) for k, v in changes.items()}))
        rehash(art, "config.json")

    return edit


def _graph(name: str, change: Callable[[Any], None]) -> Callable[[str], None]:
    """An ONNX graph changed with onnx and re-hashed in the manifest."""
    def edit(art: str) -> None:
        import onnx

        path = os.path.join(art, name)
        model = onnx.load(path)
        change(model)
        onnx.save(model, path)
        rehash(art, name)

    return edit


def _fixed_batch(model) -> None:
    """The first input's batch axis fixed at 1: a graph exported for one batch size, which would fail at the
    first batch of 2 inside ONNX Runtime."""
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    dim.Clear()
    dim.dim_value = 1


def _quantized_op(model) -> None:
    from onnx import helper

    model.graph.node.append(helper.make_node("MatMulInteger", ["src_ids", "src_ids"], ["unused"]))


def _write(name: str, data: bytes, hashed: bool = False) -> Callable[[str], None]:
    def edit(art: str) -> None:
        with open(os.path.join(art, name), "wb") as f:
            f.write(data)
        if hashed:
            rehash(art, name)

    return edit


def _remove(name: str) -> Callable[[str], None]:
    return lambda art: os.remove(os.path.join(art, name))


def _truncate(name: str) -> Callable[[str], None]:
    def edit(art: str) -> None:
        with open(os.path.join(art, name), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(art, name)) // 2)

    return edit


def flip_a_weight_byte(art: str, name: str = "encoder.onnx") -> None:
    """One byte inside a weight of graph `name` changed, its size and its header (inputs, outputs, ops) as
    they were: only the sha256 tells."""
    import onnx
    from onnx import numpy_helper

    path = os.path.join(art, name)
    weight = max(onnx.load(path).graph.initializer, key=lambda t: numpy_helper.to_array(t).nbytes)
    raw = numpy_helper.to_array(weight).tobytes()
    with open(path, "rb") as f:
        data = bytearray(f.read())
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0, "the weight's bytes are not stored once, as they are"
    data[at + len(raw) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))


REFUSALS = [
    # the manifest's own fields
    Refusal("contract version", _manifest(lambda m: m.update(contract_version=999)), "contract version 999"),
    Refusal("contract version as a float", _manifest(lambda m: m.update(contract_version=2.0)),
            "contract version 2.0"),
    Refusal("unknown precision", _manifest(lambda m: m.update(precision="fp8")), "unknown precision 'fp8'"),
    Refusal("no model config", _manifest(lambda m: m.pop("model")), "no model config"),
    Refusal("a model field missing", _manifest(lambda m: m["model"].pop("eos_id")), "its model config lacks eos_id"),
    Refusal("an invalid model config", _model(n_heads=lambda c: 0), "n_heads must be >= 1"),
    Refusal("an eos_id past the vocabulary", _model(eos_id=lambda c: 5000), "must be distinct and < vocab_size"),
    Refusal("tokenizer.json unlisted", _manifest(lambda m: m["files"].pop("tokenizer.json")),
            "does not list encoder.onnx, decoder_step.onnx, tokenizer.json and config.json"),
    Refusal("config.json unlisted", _manifest(lambda m: m["files"].pop("config.json")),
            "does not list encoder.onnx, decoder_step.onnx, tokenizer.json and config.json"),
    Refusal("the fused step graph unlisted, every digest right",
            _manifest(lambda m: (m["files"].pop("decoder_step.ort.onnx"), m["graphs"].pop("decoder_step.ort.onnx"))),
            r"decoder_step.ort.onnx is not listed in .*manifest.json: the manifest was edited after export"),
    Refusal("a file entry without its sha256 and bytes",
            _manifest(lambda m: m["files"].update({"tokenizer.json": None})), "does not give tokenizer.json as"),
    Refusal("a listed file outside the directory",
            _manifest(lambda m: m["files"].update({"../x.onnx": {"sha256": "0" * 64, "bytes": 3}})),
            "not a file name inside"),
    # the manifest's model config against its copy of config.json, which it hashes
    Refusal("d_model edited in the manifest", _model(d_model=lambda c: c["d_model"] * 2),
            r"its model config is not the one in config.json.*d_model 64 vs 32"),
    Refusal("n_heads edited in the manifest", _model(n_heads=lambda c: c["n_heads"] * 2),
            r"not the one in config.json.*n_heads 8 vs 4"),
    Refusal("norm_first edited in the manifest (no graph IO shows it)", _model(norm_first=lambda c: True),
            r"not the one in config.json.*norm_first True vs False"),
    Refusal("config.json not JSON", _write("config.json", b"{ truncated", hashed=True),
            r"config.json, is unreadable or not JSON"),
    # the graphs against the contract for the manifest's precision and model config
    Refusal("precision", _manifest(lambda m: m.update(precision="fp16")),
            r"encoder.onnx does not match its manifest \(fp16.*float32"),
    Refusal("n_heads of another export", _other_export(n_heads=lambda c: c["n_heads"] * 2),
            r"encoder.onnx does not match its manifest.*dims"),
    Refusal("d_model of another export", _other_export(d_model=lambda c: c["d_model"] * 2),
            r"encoder.onnx does not match its manifest.*output memory has dims"),
    Refusal("decoder layers of another export", _other_export(decoder_layers=lambda c: c["decoder_layers"] + 1),
            r"encoder.onnx does not match its manifest.*outputs lack \['cross_key_2'"),
    Refusal("a graph for one batch size", _graph("encoder.onnx", _fixed_batch),
            r"encoder.onnx does not match its manifest.*input src_ids has dims \[1, "),
    Refusal("a graph that is not ONNX", _write("encoder.onnx", b"not a protobuf at all \xff\xff\xff", hashed=True),
            "encoder.onnx cannot be read as an ONNX model"),
    Refusal("quantization claimed", _manifest(lambda m: m.update(quantization={"method": "int8"})),
            "says int8 quantization, but encoder.onnx has no quantized operator"),
    Refusal("quantized ops the manifest does not record", _graph("encoder.onnx", _quantized_op),
            r"encoder.onnx has quantized operators \(MatMulInteger\), but its manifest records no quantization"),
    # the files, against their sizes and sha256 sums
    Refusal("a byte changed in a weight", flip_a_weight_byte, "encoder.onnx does not match its sha256"),
    Refusal("a graph missing", _remove("encoder.onnx"), "encoder.onnx is missing"),
    Refusal("a graph truncated", _truncate("decoder_step.onnx"), r"decoder_step.onnx has \d+ bytes"),
    # no longer an artifact at all: inspect cannot read it as one either
    Refusal("manifest.json not JSON", _write("manifest.json", b"{ truncated"), "unreadable or not JSON", 2),
    Refusal("manifest.json of another kind", _manifest(lambda m: m.update(kind="something-else")),
            "is not a transduce artifact manifest", 2),
    Refusal("manifest.json removed", _remove("manifest.json"), "manifest.json is missing", 2),
]


def refused_copy(artifact_dir: str, out_dir, refusal: Refusal) -> str:
    """A copy of a sound artifact at out_dir with `refusal`'s edit made."""
    shutil.copytree(artifact_dir, out_dir)
    refusal.edit(str(out_dir))
    return str(out_dir)
