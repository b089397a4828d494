"""`transduce inspect` exits 1 whenever the runtime would refuse the directory: it runs the runtime's own load
checks (transduce.runtime.checks), and says what it did not check instead of claiming success."""

from __future__ import annotations

import json
import os
import re

import pytest
from artifact_edits import REFUSALS, flip_a_weight_byte, refused_copy
from click.testing import CliRunner

from transduce.cli import main
from transduce.errors import ArtifactError, TransduceError
from transduce.inspect import inspect_path
from transduce.inspect.report import RUNTIME_OK_UNHASHED
from transduce.runtime.api import load

LOADS_OK = re.compile(r"^ *loads +ok *$", re.MULTILINE)  # the runtime section's verdict, checked whole


def _inspect(*args):
    return CliRunner().invoke(main, ["inspect", *map(str, args)])


def test_a_sound_export_passes(tiny_artifact_dir):
    report = inspect_path(tiny_artifact_dir)
    assert report["runtime_check"] == "ok" and report["hashes"]["checked"] and report["problems"] == []
    result = _inspect(tiny_artifact_dir)
    assert result.exit_code == 0, result.output
    assert LOADS_OK.search(result.output)


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: r.name)
def test_inspect_refuses_what_the_runtime_refuses(tiny_artifact_dir, tmp_path, refusal):
    """Each refusal of the runtime (tests/artifact_edits.py): inspect exits 1 and its verdict is the runtime's
    own error, or exits 2 where the directory is no artifact any more."""
    art = refused_copy(tiny_artifact_dir, tmp_path / "a", refusal)
    with pytest.raises(ArtifactError, match=refusal.says) as refused:
        load(art)
    result = _inspect(art, "--json")
    assert result.exit_code == refusal.inspect_exit, result.output
    if refusal.inspect_exit == 1:
        assert json.loads(result.stdout)["runtime_check"] == str(refused.value).split("\n")[0]
    else:
        with pytest.raises(TransduceError):
            inspect_path(art)


def test_a_changed_weight_is_found_unless_the_hashes_are_not_compared(tiny_artifact_dir, tmp_path, monkeypatch):
    """A byte changed inside encoder.onnx's weights (size and header as they were): the runtime refuses it, so
    inspect compares the sums of a small artifact unasked; where it does not compare them (--no-verify, or
    files past AUTO_VERIFY_BYTES) it says so, and never that the runtime loads the directory."""
    import shutil

    from transduce.inspect import report as report_module

    art = tmp_path / "a"
    shutil.copytree(tiny_artifact_dir, art)
    flip_a_weight_byte(str(art))
    with pytest.raises(ArtifactError, match="encoder.onnx does not match its sha256"):
        load(art)
    result = _inspect(art)
    assert result.exit_code == 1 and "encoder.onnx does not match its recorded sha256" in result.output
    skipped = _inspect(art, "--no-verify")
    assert skipped.exit_code == 0, skipped.output
    assert "were not compared (pass --verify)" in skipped.output and not LOADS_OK.search(skipped.output)
    monkeypatch.setattr(report_module, "AUTO_VERIFY_BYTES", 1000)
    report = inspect_path(art)
    assert report["runtime_check"] == RUNTIME_OK_UNHASHED and not report["hashes"]["checked"]
    assert "pass --verify" in report["hashes"]["note"]
    assert _inspect(art, "--verify").exit_code == 1


def test_an_engine_directory_with_an_edited_manifest(engine_dir, artifact_sizes):
    """The artifact copy in an engine directory: its manifest's d_model edited by hand, its size kept. engine.json
    hashes the manifest, and the manifest's model config must be its copy of config.json's: inspect and the
    TensorRT backend (before TensorRT loads anything) refuse it, without the sums compared too."""
    import tensorrt_fake as fake  # tests/ is on sys.path

    from transduce.formats.engine import RuntimeInfo
    from transduce.runtime.backends.tensorrt_backend import TensorRTBackend

    _, d_model = artifact_sizes
    path = os.path.join(engine_dir, "manifest.json")
    text = open(path, encoding="utf-8").read()
    assert text.count(f'"d_model": {d_model},') == 1
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(f'"d_model": {d_model},', f'"d_model": {d_model - 2},'))
    here = RuntimeInfo("10.3.0", "NVIDIA H100 80GB HBM3", "9.0")  # what the engine_dir fixture was built for
    for verify, says in ((True, "manifest.json does not match its sha256"),
                         (False, "its model config is not the one in config.json")):
        with pytest.raises(ArtifactError, match="its model config is not the one in config.json") as refused:
            TensorRTBackend(engine_dir, device="cpu", verify=verify, _trt=fake, _runtime=here)
        report = inspect_path(engine_dir, verify=verify)
        assert says in report["runtime_check"]
        if not verify:
            assert report["runtime_check"] == str(refused.value).split("\n")[0]
        assert _inspect(engine_dir, "--verify" if verify else "--no-verify").exit_code == 1
