"""Importing by Hugging Face Hub name: with no network (HF_HUB_OFFLINE=1), a model in a cache laid out as
huggingface_hub lays one out (models--org--name/blobs, snapshots/<commit>/ links to the blobs, refs/<branch>) imports
by its name, at a branch or a commit, from HF_HUB_CACHE or HF_HOME/hub; a name or revision the cache lacks is an
error naming the cache and HF_HUB_OFFLINE (exit 2)."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from click.testing import CliRunner

from transduce.cli import main
from transduce.models.checkpoint import load_model_dir

NAME = "Helsinki-NLP/opus-mt-tiny-en-fr"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(cache, model_dir, name=NAME, commit=COMMIT, branch="main"):
    """`model_dir`'s files in a Hugging Face cache at `cache` as snapshot_download leaves them: each file a blob
    named by its hash, linked from snapshots/<commit>/ by a relative link; refs/<branch> holds the commit."""
    repo = cache / ("models--" + name.replace("/", "--"))
    for sub in ("blobs", f"snapshots/{commit}", "refs"):
        (repo / sub).mkdir(parents=True, exist_ok=True)
    for f in sorted(os.listdir(model_dir)):
        data = open(os.path.join(model_dir, f), "rb").read()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", repo / "snapshots" / commit / f)
    (repo / "refs" / branch).write_text(commit)  # no newline, as huggingface_hub writes it
    return repo


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network: HF_HUB_OFFLINE=1, HF_HUB_CACHE at an empty cache -> its path."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return cache


def _same_model(a, b):
    ma, ta, ca = load_model_dir(a)
    mb, tb, cb = load_model_dir(b)
    assert ca["model"] == cb["model"] and tb.spec == ta.spec
    sa, sb = ma.state_dict(), mb.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    return cb


def test_a_cached_hub_name_imports_with_no_network(marian_swish, marian_swish_imported, offline, tmp_path):
    from transduce.importers import import_model

    fake_cache(offline, marian_swish)
    out = import_model("marian", NAME, tmp_path / "by-name")
    cfg = _same_model(marian_swish_imported, out)
    imported = cfg["training"]["imported"]
    assert (imported["hub"], imported["revision"]) == (NAME, COMMIT)
    assert imported["source"].startswith(str(offline))
    # a commit hash as the revision, through the CLI
    r = CliRunner().invoke(main, ["import", "marian", NAME, "--out", str(tmp_path / "by-commit"), "--revision",
                                  COMMIT, "--quiet"])
    assert r.exit_code == 0, r.output
    _same_model(marian_swish_imported, tmp_path / "by-commit")


def test_hf_home_is_the_cache_without_hf_hub_cache(marian_swish, offline, monkeypatch, tmp_path):
    from transduce.importers import import_model

    monkeypatch.delenv("HF_HUB_CACHE")
    fake_cache(tmp_path / "hf-home" / "hub", marian_swish, branch="v2")
    out = import_model("marian", NAME, tmp_path / "model", revision="v2")
    assert load_model_dir(out)[2]["training"]["imported"]["revision"] == COMMIT


def test_a_name_or_revision_the_cache_lacks_is_a_clear_error(marian_swish, offline, tmp_path):
    fake_cache(offline, marian_swish)
    runner = CliRunner()
    for extra, what in (([], "Helsinki-NLP/opus-mt-xx-yy is not in"),
                        (["--revision", "v9"], f"{NAME} at revision 'v9' is not in")):
        name = "Helsinki-NLP/opus-mt-xx-yy" if not extra else NAME
        r = runner.invoke(main, ["import", "marian", name, "--out", str(tmp_path / "m"), *extra])
        assert r.exit_code == 2, r.output
        assert f"is not a local directory, and {what} the Hugging Face cache ({offline}), and HF_HUB_OFFLINE is " \
               "set" in r.output, r.output
        assert "HF_HUB_CACHE" in r.output and "Traceback" not in r.output
        assert not (tmp_path / "m").exists()


def test_revision_with_a_local_directory_is_refused(marian_swish, tmp_path):
    r = CliRunner().invoke(main, ["import", "marian", marian_swish, "--out", str(tmp_path / "m"), "--revision", "v1"])
    assert r.exit_code == 2 and "--revision applies to a Hugging Face Hub name" in r.output, r.output


def test_only_the_files_the_family_reads_are_fetched(monkeypatch, tmp_path):
    """snapshot_download is asked for the family's files and safetensors weights, and for the pickled weights only
    where the snapshot has no safetensors."""
    import huggingface_hub

    from transduce.importers import hub

    calls = []

    def fake_download(name, revision, cache_dir, local_files_only, allow_patterns):
        calls.append(allow_patterns)
        snap = tmp_path / "snap" / COMMIT
        snap.mkdir(parents=True, exist_ok=True)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    path, record = hub.snapshot("marian", NAME)
    assert record == {"hub": NAME, "revision": COMMIT} and path.endswith(COMMIT)
    assert len(calls) == 2 and "source.spm" in calls[0] and "model.safetensors" in calls[0]
    assert "pytorch_model.bin" in calls[1] and not any(p.endswith((".h5", ".ot", ".msgpack")) for p in calls[0])
    (tmp_path / "snap" / COMMIT / "model.safetensors").write_bytes(b"")
    calls.clear()
    hub.snapshot("nllb", NAME)
    assert len(calls) == 1 and "sentencepiece.bpe.model" in calls[0]
