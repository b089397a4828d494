"""`transduce attention`: the PNG files it writes, and its errors."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from transduce.cli import main

SOURCE, TARGET = "three hundred and forty-two", "trois cent quarante-deux"


def _cli(*args):
    return CliRunner().invoke(main, list(args))


def test_writes_every_layer_and_the_token_figure(tiny_model_dir, tiny_model, tmp_path):
    from matplotlib.image import imread

    out = tmp_path / "maps"
    result = _cli("attention", tiny_model_dir, SOURCE, "--target", TARGET, "--out", str(out),
                  "--token", "cent", "--token-attention", "cross", "--layer", "1", "--dpi", "50")
    assert result.exit_code == 0, result.output
    cfg = tiny_model.cfg
    names = sorted(os.listdir(out))
    assert len(names) == cfg.encoder_layers + 2 * cfg.decoder_layers + 1
    assert [n for n in names if n.startswith("token_")] == ["token_cross_layer1_pos1.png"]  # "cent" predicted at 1
    for name in names:
        assert f"wrote {out / name}" in result.output
        with open(out / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        image = imread(out / name)
        assert image.ndim == 3 and min(image.shape[:2]) > 100
    assert "<eos>" in result.output and f"target (given): {TARGET}" in result.output


@pytest.mark.parametrize("args, message", [
    (["--token", "nope"], "'nope' is not in the sequence"),
    (["--token", "99"], "token index 99 is out of range"),
    (["--layer", "0"], "--layer counts from 1"),
    (["--layer", "3"], "layer 3 (counted from 1) is out of range: the model has 2 layers"),
    (["--dpi", "30000"], "--dpi must be between 20 and 1200"),
])
def test_bad_choices_fail_before_writing(tiny_model_dir, tmp_path, args, message):
    out = tmp_path / "maps"
    result = _cli("attention", tiny_model_dir, SOURCE, "--target", TARGET, "--out", str(out), *args)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_missing_model_dir(tmp_path):
    missing = str(tmp_path / "no-model")
    result = _cli("attention", missing, SOURCE, "--out", str(tmp_path / "maps"))
    assert result.exit_code == 2 and missing in result.output


def test_empty_source(tiny_model_dir, tmp_path):
    result = _cli("attention", tiny_model_dir, " ", "--out", str(tmp_path / "maps"))
    assert result.exit_code == 2 and "empty" in result.output


def test_an_output_that_cannot_be_written_is_an_error(tiny_model_dir, tmp_path):
    out = tmp_path / "maps"
    (out / "decoder_self_layer1.png").mkdir(parents=True)  # a directory where a figure goes
    result = _cli("attention", tiny_model_dir, SOURCE, "--out", str(out), "--dpi", "30")
    assert result.exit_code == 2 and "cannot write" in result.output and "decoder_self_layer1.png" in result.output
    assert "Traceback" not in result.output and not [n for n in os.listdir(out) if ".tmp-" in n]


def test_without_matplotlib_it_is_a_clear_error_before_loading(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    result = _cli("attention", str(tmp_path / "no-model"), SOURCE, "--out", str(tmp_path / "maps"))
    assert result.exit_code == 2, result.output
    assert "matplotlib is not installed" in result.stderr and "pip install matplotlib" in result.stderr
    assert not os.path.exists(tmp_path / "maps")
