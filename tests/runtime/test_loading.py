"""Loading an artifact while `transduce export --force` replaces it: a load gives the old artifact, the new one, or
a clear error saying it was replaced under every try; never parts of both, never a checksum error."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import TINY, saved_model_dir, seeded_model
from transduce.errors import ArtifactError
from transduce.formats import artifact as artifact_format
from transduce.io.atomic import atomic_directory
from transduce.runtime.api import load

SENTENCES = ["one two three", "four hundred and five", "twelve"]


@pytest.fixture(scope="module")
def other_artifact_dir(tmp_path_factory, tiny_tokenizer):
    """Another model of the tiny shape (other seeded weights), exported."""
    from transduce.exporter.onnx_export import export_artifact

    model_dir = saved_model_dir(tmp_path_factory, "other", seeded_model(tiny_tokenizer, 5, **TINY), tiny_tokenizer)
    path = tmp_path_factory.mktemp("other-artifact") / "artifact"
    export_artifact(model_dir, path)
    return str(path)


def _signature(translator) -> tuple:
    """What a model says of the sentences: tokens and scores of greedy and beam search (scores to 1e-4, where
    a model mixed of two exports differs from both)."""
    out = []
    for beam in (1, 2):
        out += [(t.tokens, round(t.score, 4)) for t in translator.translate(SENTENCES, beam_size=beam, max_len_b=8)]
    return tuple(out)


def _replace(final: str, source: str) -> None:
    """What `transduce export --force` does once its copy is complete: atomic_directory's two renames, then the
    previous copy removed."""
    with atomic_directory(final) as tmp:
        shutil.copytree(source, tmp, dirs_exist_ok=True)


@pytest.fixture(scope="module")
def signatures(tiny_artifact_dir, other_artifact_dir):
    a, b = _signature(load(tiny_artifact_dir, threads=1)), _signature(load(other_artifact_dir, threads=1))
    assert a != b
    return a, b


def test_a_directory_replaced_after_its_files_were_opened_is_loaded_as_it_was(tmp_path, tiny_artifact_dir,
                                                                               other_artifact_dir, signatures,
                                                                               monkeypatch):
    """Replaced (and its old copy removed) between the checks and the sessions: the sessions still read the files
    the checks read."""
    from transduce.runtime import checks

    art = str(tmp_path / "artifact")
    shutil.copytree(tiny_artifact_dir, art)
    real, done = checks.read_graph_header, []

    def replace_first(path):  # runs once every listed file is open
        if not done:
            done.append(_replace(art, other_artifact_dir))
        return real(path)

    monkeypatch.setattr(checks, "read_graph_header", replace_first)
    assert _signature(load(art, threads=1)) == signatures[0] and done
    assert _signature(load(art, threads=1)) == signatures[1]  # a new load reads the new copy


def test_a_directory_replaced_while_its_files_are_checked_is_read_again(tmp_path, tiny_artifact_dir,
                                                                         other_artifact_dir, signatures, monkeypatch):
    """Replaced after the manifest was read, before every file was opened (the old copy removed): the load
    starts again from the name and gives the new artifact whole. Replaced under every try: a clear error."""
    art = str(tmp_path / "artifact")
    shutil.copytree(tiny_artifact_dir, art)
    real, seen = artifact_format.listed_file_problem, []

    def replace_once(pinned, name, *args, **kwargs):
        if not seen:
            seen.append(_replace(art, other_artifact_dir))
        return real(pinned, name, *args, **kwargs)

    monkeypatch.setattr(artifact_format, "listed_file_problem", replace_once)
    assert _signature(load(art, threads=1)) == signatures[1]

    def replace_always(pinned, name, *args, **kwargs):
        seen.append(_replace(art, (other_artifact_dir, tiny_artifact_dir)[len(seen) % 2]))
        return real(pinned, name, *args, **kwargs)

    monkeypatch.setattr(artifact_format, "listed_file_problem", replace_always)
    with pytest.raises(ArtifactError, match="was replaced while it was being loaded, 5 times") as e:
        load(art, threads=1)
    assert "load it again once that export is done" in e.value.hint


WRITER = textwrap.dedent("""
    import os, shutil, sys
    from transduce.io.atomic import atomic_directory
    final, a, b, stop = sys.argv[1:5]
    n = 0
    while not os.path.exists(stop):
        with atomic_directory(final) as tmp:
            shutil.copytree(a if n % 2 else b, tmp, dirs_exist_ok=True)
        n += 1
    print(n)
""")


def test_loads_during_alternating_replacements_give_one_model_or_the_other(tmp_path, tiny_artifact_dir,
                                                                           other_artifact_dir, signatures):
    """A writer process replaces the directory with one export, then the other, as fast as it can, while this
    one loads it again and again: every load decodes as one of the two models, or says it was replaced under
    every try; none mixes them (scores that neither model gives) or fails a checksum."""
    art, stop = str(tmp_path / "artifact"), tmp_path / "stop"
    shutil.copytree(tiny_artifact_dir, art)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, art, tiny_artifact_dir, other_artifact_dir, str(stop)],
                              stdout=subprocess.PIPE, text=True)
    got, replaced = {"a": 0, "b": 0}, 0
    try:
        end = time.monotonic() + 15
        while time.monotonic() < end and sum(got.values()) + replaced < 150:
            try:
                sig = _signature(load(art, threads=1))
            except ArtifactError as e:  # replaced under every one of its tries: said so, nothing else
                assert "was replaced while it was being loaded" in str(e), e
                replaced += 1
                continue
            assert sig in signatures, "a load decoded as neither model: it mixed the two exports"
            got["a" if sig == signatures[0] else "b"] += 1
    finally:
        stop.touch()
        writes = int(writer.communicate(timeout=60)[0] or 0)
    assert writes > 20 and got["a"] and got["b"], (writes, got, replaced)
