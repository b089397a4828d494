"""`transduce inspect` says which decoder step graph ONNX Runtime decodes an artifact with on the CPU, and why:
the one the loaded backend reports (its tuning()'s step_graph), for real exports with and without the fused graph."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from artifact_edits import edit_json
from click.testing import CliRunner

from transduce.cli import main
from transduce.formats.contract import ORT_STEP_FILE, STEP_FILE
from transduce.formats.kinds import MANIFEST_FILE
from transduce.inspect import inspect_path
from transduce.runtime.api import make_backend

ROW = re.compile(r"^ *step graph \(ONNX Runtime, CPU\) +(.+?) *$", re.MULTILINE)


@pytest.fixture(scope="module")
def no_ort_step_artifact(tmp_path_factory, tiny_model_dir) -> str:
    """The tiny model exported with --no-ort-step."""
    from transduce.exporter.onnx_export import export_artifact

    path = tmp_path_factory.mktemp("no-ort-step") / "artifact"
    export_artifact(tiny_model_dir, path, ort_step_graph=False)
    return str(path)


def _without_the_fused_graph(tiny_artifact_dir: str, art) -> str:
    """A copy whose decoder_step.ort.onnx was removed, file and manifest entries (ort_step_graph still true)."""
    shutil.copytree(tiny_artifact_dir, art)
    (art / ORT_STEP_FILE).unlink()

    def edit(m):
        del m["files"][ORT_STEP_FILE]
        del m["graphs"][ORT_STEP_FILE]

    edit_json(str(art), MANIFEST_FILE, edit)
    return str(art)


def _inspected(path: str) -> tuple[dict, str]:
    """The JSON report's step_graph and the table's step graph row, both from the command line."""
    as_json = CliRunner().invoke(main, ["inspect", path, "--json"])
    text = CliRunner().invoke(main, ["inspect", path])
    assert as_json.exit_code == 0 and text.exit_code == 0, as_json.output + text.output
    row = ROW.search(text.stdout)
    assert row, text.stdout
    return json.loads(as_json.stdout)["step_graph"], row.group(1)


def test_inspect_names_the_fused_step_graph_of_a_normal_export(tiny_artifact_dir):
    step, row = _inspected(tiny_artifact_dir)
    assert step == {"provider": "onnxruntime cpu", "graph": ORT_STEP_FILE, "why": "fused, listed in the manifest"}
    assert row == f"{ORT_STEP_FILE}: fused, listed in the manifest"
    assert make_backend(tiny_artifact_dir, "onnxruntime").tuning()["step_graph"] == ORT_STEP_FILE


def test_inspect_names_the_standard_step_graph_of_a_no_ort_step_export(no_ort_step_artifact):
    step, row = _inspected(no_ort_step_artifact)
    why = "this export has no fused step graph (exported with --no-ort-step)"
    assert step == {"provider": "onnxruntime cpu", "graph": STEP_FILE, "why": why}
    assert row == f"{STEP_FILE}: {why}"
    assert make_backend(no_ort_step_artifact, "onnxruntime").tuning()["step_graph"] == STEP_FILE


def test_inspect_says_when_the_fused_step_graph_was_removed_by_hand(tiny_artifact_dir, tmp_path):
    """File and entries removed, the manifest still recording an export with it: the runtime loads what is
    listed (decoder_step.onnx), and inspect says why it is not the fused graph."""
    art = _without_the_fused_graph(tiny_artifact_dir, tmp_path / "a")
    step, row = _inspected(art)
    assert step["graph"] == STEP_FILE and row.startswith(f"{STEP_FILE}: the manifest lists no {ORT_STEP_FILE} though "
                                                         "it records an export with one")
    assert make_backend(art, "onnxruntime").tuning()["step_graph"] == STEP_FILE


def test_inspect_names_no_step_graph_where_the_runtime_refuses(tiny_artifact_dir, tmp_path):
    """The fused graph's entry deleted with the file left in place: refused (tests/faults/test_edited_manifest.py),
    and inspect names no step graph."""
    art = tmp_path / "a"
    shutil.copytree(tiny_artifact_dir, art)
    edit_json(str(art), MANIFEST_FILE, lambda m: m["files"].pop(ORT_STEP_FILE))
    report = inspect_path(art)
    assert report["runtime_check"].startswith(f"{art / ORT_STEP_FILE} is not listed in {art / MANIFEST_FILE}")
    assert report["step_graph"]["graph"] is None and "refuses" in report["step_graph"]["why"]
