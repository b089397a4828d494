"""One bench per cache directory: the cache's lock is held for the whole run (what it prepares there is read until
the run ends), and every item in it is written under its own lock, so a killed bench's half-written copies go when
the next one prepares that item."""

from __future__ import annotations

import os
import time

import pytest

from tests.io.test_locks import abandoned_copy, lock_held_elsewhere
from transduce.bench.config import BenchConfig
from transduce.errors import TransduceError
from transduce.io.reaping import tmp_prefix


def _must_not(*args, **kwargs):
    raise AssertionError("the bench started working")


def test_a_second_bench_sharing_the_cache_is_refused_at_once(tmp_path, tiny_model_dir, monkeypatch):
    """Before it measures the machine, starts its workers or prepares anything; the first bench's cache is left
    as it is."""
    from transduce.bench import ceilings, harness, models, workers

    monkeypatch.setattr(models, "prepare", _must_not)
    monkeypatch.setattr(ceilings, "measure_ceilings", _must_not)
    monkeypatch.setattr(workers.Worker, "__init__", _must_not)
    cache = tmp_path / "cache"
    (cache / "demo" / "artifact").mkdir(parents=True)
    (cache / "demo" / "artifact" / "manifest.json").write_text("the first bench's export")
    cfg = BenchConfig(sizes=["demo"], backends=["onnxruntime"], batches=[1], modes=["greedy"], steps=2, src_len=4,
                      threads=1, out_dir=str(tmp_path / "out"), cache_dir=str(cache), model_dir=tiny_model_dir)
    with lock_held_elsewhere(cache) as pid:
        t0 = time.monotonic()
        with pytest.raises(TransduceError, match=f"cache of prepared models \\(--cache-dir\\) '{cache}' is being "
                                                 f"written by PID {pid}"):
            harness.run_bench(cfg, log=lambda message: None)
        assert time.monotonic() - t0 < 1
    assert (cache / "demo" / "artifact" / "manifest.json").read_text() == "the first bench's export"
    assert sorted(os.listdir(tmp_path)) == ["cache", "out"]  # its lock file gone with it


def test_a_cached_conversion_is_written_under_its_lock(tmp_path, tiny_model_dir):
    """A conversion into a directory another process converts into is refused; the next one removes the copy a
    killed conversion left (recent, of a live-looking PID)."""
    pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed (pip install 'transduce[bench]')")
    from transduce.bench.ctranslate2.convert import convert_to_ctranslate2, is_current

    out = tmp_path / "ctranslate2"
    with lock_held_elsewhere(out) as pid:
        with pytest.raises(TransduceError, match=f"the CTranslate2 conversion '{out}' is being written by PID {pid}"):
            convert_to_ctranslate2(tiny_model_dir, out)
    killed = abandoned_copy(tmp_path, f"{tmp_prefix('ctranslate2')}{os.getppid()}-killed")
    convert_to_ctranslate2(tiny_model_dir, out)
    assert is_current(str(out), tiny_model_dir) and os.listdir(tmp_path) == ["ctranslate2"], killed


def test_the_benchs_random_model_is_written_under_its_lock(tmp_path, monkeypatch):
    from transduce.bench import models

    path = tmp_path / "model"
    made = []
    with lock_held_elsewhere(path) as pid:
        with pytest.raises(TransduceError, match=f"the bench's random model '{path}' is being written by PID {pid}"):
            models._own_model(str(path), made.append, log=lambda message: None)
    killed = abandoned_copy(tmp_path, f"{tmp_prefix('model')}{os.getppid()}-killed")
    models._own_model(str(path), made.append, log=lambda message: None)
    assert made == [str(path)] and killed not in os.listdir(tmp_path)
