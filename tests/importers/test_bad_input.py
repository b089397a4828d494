"""Bad checkpoints given to `transduce import` get an `error:` naming what is wrong and what to do (exit 2), never a
traceback: a config.json missing a key or not an object, a list where one id is needed, fairseq arguments
missing a key or asking for a multilingual model, NaN weights, a directory of another family."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from transduce.cli import main


def _import(family, src, out):
    r = CliRunner().invoke(main, ["import", family, str(src), "--out", str(out), "--quiet"])
    assert r.exit_code == 2 and r.stderr.startswith("error: "), (r.exit_code, r.output, r.exception)
    assert not out.exists()
    return r.stderr


def _edited_config(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(edit(cfg)))
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda c: {k: v for k, v in c.items() if k != "d_model"}, "config.json lacks d_model"),
    (lambda c: [c], "config.json holds a JSON list, not an object"),
    (lambda c: {**c, "eos_token_id": [0, 5]}, "eos_token_id must be an integer >= 0, got [0, 5]"),
    (lambda c: {**c, "encoder_layers": "two"}, "encoder_layers must be an integer >= 0, got 'two'"),
])
def test_a_broken_config_json_is_an_error_naming_the_key(marian_swish, tmp_path, edit, message):
    stderr = _import("marian", _edited_config(marian_swish, tmp_path / "hf", edit), tmp_path / "out")
    assert message in stderr and "--set" not in stderr  # import has no --set


def test_a_config_transduce_cannot_build_is_said_of_the_checkpoint(marian_swish, tmp_path):
    stderr = _import("marian", _edited_config(marian_swish, tmp_path / "hf",
                                              lambda c: {**c, "encoder_attention_heads": 5,
                                                         "decoder_attention_heads": 5}), tmp_path / "out")
    assert "its config describes a model transduce cannot build" in stderr and "--set" not in stderr


def test_nan_weights_are_refused_naming_the_tensor(marian_swish, tmp_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(marian_swish, tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    weights["model.decoder.layers.1.fc1.weight"][3, 4] = float("nan")
    weights["model.decoder.layers.1.fc1.weight"][0, 0] = float("inf")
    save_file(weights, tmp_path / "hf" / "model.safetensors")
    stderr = _import("marian", tmp_path / "hf", tmp_path / "out")
    assert "tensor model.decoder.layers.1.fc1.weight holds 2 NaN or infinite value(s)" in stderr


def test_a_directory_of_another_family_says_which_it_looks_like(fsmt, marian_swish, fairseq_imported, tmp_path):
    stderr = _import("marian", fsmt, tmp_path / "out")
    assert "looks like an FSMT checkpoint, not a marian one" in stderr and f"transduce import fsmt {fsmt}" in stderr
    stderr = _import("fsmt", marian_swish, tmp_path / "out")
    assert "looks like a Marian checkpoint" in stderr and "transduce import marian" in stderr


def _fairseq_checkpoint(fsmt, directory, edit):
    from hf_models import fairseq_dir_from_fsmt

    src = fairseq_dir_from_fsmt(fsmt, str(directory))
    path = directory / "checkpoint_best.pt"
    ckpt = torch.load(path, weights_only=False)  # the test's own file
    edit(ckpt["args"])
    torch.save(ckpt, path)
    return src


@pytest.mark.parametrize("edit, message", [
    (lambda a: delattr(a, "encoder_layers"), "lacks encoder_layers"),
    (lambda a: setattr(a, "task", "translation_multi_simple_epoch"),
     "task 'translation_multi_simple_epoch' is not supported"),
    (lambda a: setattr(a, "encoder_langtok", "src"), "encoder_langtok = 'src' is not supported"),
    (lambda a: setattr(a, "lang_pairs", "en-fr,fr-en"), "lang_pairs = 'en-fr,fr-en' is not supported"),
])
def test_fairseq_arguments_missing_or_multilingual_are_refused_naming_them(fsmt, tmp_path, edit, message):
    stderr = _import("fairseq", _fairseq_checkpoint(fsmt, tmp_path / "ckpt", edit), tmp_path / "out")
    assert message in stderr
