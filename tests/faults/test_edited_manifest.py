"""Faults made by hand, run as a user meets them: the command line in a process of its own.

A manifest.json whose digests all still match but whose list of files was edited: with the fused step graph's
entry deleted, every file it lists is as recorded, and ONNX Runtime would decode with the slower
decoder_step.onnx, unasked. Loading refuses it (transduce.formats.artifact.unlisted_graph_problem), naming the
file, before anything is read or written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
from artifact_edits import edit_json

from transduce.formats.contract import ORT_STEP_FILE
from transduce.formats.kinds import MANIFEST_FILE
from transduce.io.files import file_entry


def _snapshot(directory) -> dict[str, tuple[int, int, str]]:
    """Every file under `directory`: (bytes, mtime in ns, sha256)."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            st = os.stat(path)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(path, directory)] = (st.st_size, st.st_mtime_ns, digest)
    return out


def _entry_only(m: dict) -> None:
    del m["files"][ORT_STEP_FILE]


def _as_if_no_ort_step(m: dict) -> None:
    """Every trace of the fused graph deleted from the manifest, as an export with --no-ort-step writes it."""
    del m["files"][ORT_STEP_FILE]
    del m["graphs"][ORT_STEP_FILE]
    m["ort_step_graph"] = False


@pytest.mark.parametrize("edit", [_entry_only, _as_if_no_ort_step], ids=["files entry", "every trace"])
def test_decode_refuses_a_manifest_edited_to_leave_out_the_fused_step_graph(tiny_artifact_dir, tmp_path, edit):
    art = tmp_path / "artifact"
    shutil.copytree(tiny_artifact_dir, art)
    edit_json(str(art), MANIFEST_FILE, edit)
    files = json.loads((art / MANIFEST_FILE).read_text())["files"]
    assert ORT_STEP_FILE not in files and (art / ORT_STEP_FILE).is_file()
    for name, recorded in files.items():  # only the list was edited: every digest it holds still matches
        assert file_entry(str(art / name)) == recorded, name
    before = _snapshot(art)
    out = tmp_path / "out.txt"
    r = subprocess.run([sys.executable, "-m", "transduce.cli", "decode", str(art), "--out", str(out),
                        "--beam-size", "1", "--max-len-b", "2"], input="one\ntwo\n", capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {art / ORT_STEP_FILE} is not listed in {art / MANIFEST_FILE}: the manifest was edited "
                      "after export, or the export is incomplete; unlisted, it would go unchecked and ONNX Runtime "
                      "would decode with the slower decoder_step.onnx"], r.stderr
    assert "hint: rebuild the artifact with: transduce export " in r.stderr and f"--out {art} --force" in r.stderr
    assert r.stdout == "" and not out.exists()
    assert _snapshot(art) == before  # nothing written, moved or removed in the artifact
    assert sorted(os.listdir(tmp_path)) == ["artifact"]
