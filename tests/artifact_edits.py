"""Edited copies of an exported artifact for the tests (importable: tests/ is on sys.path)."""

from __future__ import annotations

import json
import os
import shutil


def perturb_one_weight(artifact_dir: str, out_dir, delta: float = 0.1) -> str:
    """A copy of the artifact with one weight of the step graph changed and the manifest re-hashed.

    The weight: one element of the last decoder layer's last LayerNorm bias, which every log-prob sees.
    """
    import onnx
    from onnx import numpy_helper

    from transduce.formats.files import file_entry

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
