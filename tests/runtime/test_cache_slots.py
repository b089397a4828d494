"""The ONNX Runtime backend's cache on the CPU, and the torch backend's: a run allocates a few slots first and
doubles them as positions reach them (within its capacity), and decodes exactly as with every slot allocated at
once; the torch backend's step reads the filled slots only."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import sources_of_lengths
from transduce.formats import contract
from transduce.runtime.backends import onnxruntime_backend as orb
from transduce.runtime.backends import torch_backend as tb
from transduce.runtime.decoding import DecodingOptions, decode
from transduce.runtime.decoding.running import RunningBatch

OPTIONS = [DecodingOptions(beam_size=1, max_len_b=30), DecodingOptions(beam_size=3, nbest=2, max_len_b=25),
           DecodingOptions(beam_size=1, min_length=20, max_len_b=30)]


def _interleaved(backend, capacity):
    """Three requests admitted at steps 0, 4 and 9 into one running batch (rows at different positions) -> their
    results and the slots each state's cache had, step by step."""
    rng = np.random.default_rng(7)
    requests = [(0, *sources_of_lengths(backend.config, [5, 12], rng), OPTIONS[0]),
                (4, *sources_of_lengths(backend.config, [9], rng), OPTIONS[1]),
                (9, *sources_of_lengths(backend.config, [3, 7, 4], rng), OPTIONS[2])]
    batch, cohorts, results, slots = RunningBatch(backend, capacity=capacity), [], {}, []
    while requests or batch.cohorts:
        while requests and requests[0][0] <= batch.steps:
            _, src, lens, opts = requests.pop(0)
            cohorts.append(batch.admit(src, lens, opts))
        slots.append(_slots(batch.state))
        for c, s, res in batch.step():
            results[(cohorts.index(c), s)] = res
    return [results[k] for k in sorted(results)], slots


def _slots(state) -> int:
    """The cache slots a state has allocated (either backend's)."""
    return state.cache.shape[3] if hasattr(state, "cache") else state.cache_k[0].shape[2]


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert [h.tokens for h in x.hypotheses] == [h.tokens for h in y.hypotheses]
        # within float error: the standard graph's softmax sums over every allocated slot (the masked ones add
        # zeros, in another order), as offline decoding's run and a server's differ in capacity already
        np.testing.assert_allclose([h.score for h in x.hypotheses], [h.score for h in y.hypotheses], atol=1e-5)


def _grows_and_decodes_alike(be, module, monkeypatch):
    """A running batch and offline decoding on `be` with every slot allocated at once, then with 2 slots first
    (module.FIRST_CACHE_SLOTS): the slots double as positions reach them, and the results are the same."""
    cfg = be.config
    whole, slots = _interleaved(be, cfg.max_positions)
    assert set(slots) == {cfg.max_positions}  # the tiny model's 64 positions: all allocated at once
    src, lens = sources_of_lengths(cfg, [6, 14, 3], np.random.default_rng(1))
    offline = [decode(be, src, lens, o) for o in OPTIONS]
    monkeypatch.setattr(module, "FIRST_CACHE_SLOTS", 2)
    grown, slots = _interleaved(be, cfg.max_positions)
    assert slots[0] == 2 and max(slots) > 16 and slots == sorted(slots)  # doubled as positions reached them
    assert all(s in (2, 4, 8, 16, 32, 64) for s in slots)
    _same(grown, whole)
    for o, want in zip(OPTIONS, offline, strict=True):
        _same(decode(be, src, lens, o), want)


@pytest.mark.parametrize("graph", [contract.ORT_STEP_FILE, contract.STEP_FILE])
def test_slots_double_as_positions_reach_them_and_decode_alike(tiny_artifact_dir, monkeypatch, graph):
    be = orb.OnnxRuntimeBackend(tiny_artifact_dir, threads=1)
    with be.only_step_graph(graph):
        _grows_and_decodes_alike(be, orb, monkeypatch)


def test_the_torch_backend_grows_its_slots_and_decodes_alike(tiny_model, monkeypatch):
    _grows_and_decodes_alike(tb.TorchBackend(tiny_model), tb, monkeypatch)


def test_reserve_keeps_the_filled_slots_and_stops_at_the_capacity(tiny_artifact_dir, monkeypatch):
    monkeypatch.setattr(orb, "FIRST_CACHE_SLOTS", 4)
    be = orb.OnnxRuntimeBackend(tiny_artifact_dir, threads=1)
    src, lens = sources_of_lengths(be.config, [5, 8], np.random.default_rng(2))
    state = be.begin(be.encode(src, lens), np.arange(2), 10)
    assert state.cache.shape[3] == 4 and state.capacity == 10
    for t in range(4):
        be.step_log_probs(state, np.full(2, be.config.bos_id if t == 0 else 5))
    filled = state.cache.copy()
    be.step_log_probs(state, np.full(2, 6))  # position 4: slots 4 -> 8
    assert state.cache.shape[3] == 8
    np.testing.assert_array_equal(state.cache[:, :2, :, :4], filled[:, :2])
    for _ in range(4):  # positions 5..8: 8 -> 10, the capacity, not 16
        be.step_log_probs(state, np.full(2, 6))
    assert state.cache.shape[3] == 10
    be.step_log_probs(state, np.full(2, 6))
    with pytest.raises(IndexError, match="capacity 10 exhausted at position 10"):
        be.step_log_probs(state, np.full(2, 6))
    be.end(state)


def test_the_torch_backend_keeps_filled_slots_reads_only_them_and_stops_at_the_capacity(tiny_model, monkeypatch):
    monkeypatch.setattr(tb, "FIRST_CACHE_SLOTS", 4)
    be = tb.TorchBackend(tiny_model)
    read = []
    step = be.model.decode_step
    monkeypatch.setattr(be.model, "decode_step", lambda *a, **k: read.append(a[3][0].shape[2]) or step(*a, **k))
    src, lens = sources_of_lengths(be.config, [5, 8], np.random.default_rng(2))
    state = be.begin(be.encode(src, lens), np.arange(2), 10)
    assert _slots(state) == 4 and state.capacity == 10
    for t in range(4):
        be.step_log_probs(state, np.full(2, be.config.bos_id if t == 0 else 5))
    filled = [c.clone() for c in state.cache_k + state.cache_v]
    be.step_log_probs(state, np.full(2, 6))  # position 4: slots 4 -> 8
    assert _slots(state) == 8
    for before, now in zip(filled, state.cache_k + state.cache_v, strict=True):
        np.testing.assert_array_equal(now[:2, :, :4].numpy(), before[:2].numpy())
    for _ in range(4):  # positions 5..8: 8 -> 10, the capacity, not 16
        be.step_log_probs(state, np.full(2, 6))
    assert _slots(state) == 10
    be.step_log_probs(state, np.full(2, 6))
    assert read == [1, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # the slots filled before each step (one at least), not all
    with pytest.raises(IndexError, match="capacity 10 exhausted at position 10"):
        be.step_log_probs(state, np.full(2, 6))
    be.end(state)


def _burst(backend):
    """One long sentence (min_length 40) at step 0, twelve short ones joining at step 36 and outliving it -> the
    results by (request, sentence), and the cache's (rows allocated, slots) before each step."""
    cfg = backend.config
    rng = np.random.default_rng(3)
    long = (0, *sources_of_lengths(cfg, [7], rng), DecodingOptions(beam_size=1, min_length=40, max_len_b=45))
    short = (36, *sources_of_lengths(cfg, [3 + i % 5 for i in range(12)], rng),
             DecodingOptions(beam_size=1, min_length=8, max_len_b=14))
    requests = [long, short]
    batch, cohorts, results, shapes = RunningBatch(backend, capacity=cfg.max_positions), [], {}, []
    while requests or batch.cohorts:
        while requests and requests[0][0] <= batch.steps:
            _, src, lens, opts = requests.pop(0)
            cohorts.append(batch.admit(src, lens, opts))
        shapes.append((batch.state.cache.shape[1], batch.state.cache.shape[3]))
        for c, s, res in batch.step():
            results[(cohorts.index(c), s)] = res
    return [results[k] for k in sorted(results)], shapes


def test_a_burst_s_rows_and_a_long_sentence_s_slots_are_given_back(tiny_artifact_dir, monkeypatch):
    """Once a quarter or fewer of the cache's rows are in use, or of its slots filled, they are cut to twice what
    is (not below the first allocation), and the batch decodes as it did without."""
    from transduce.runtime.backends import ort_run

    be = orb.OnnxRuntimeBackend(tiny_artifact_dir, threads=1)
    for module in (orb, ort_run):
        monkeypatch.setattr(module, "FIRST_CACHE_SLOTS", 4)
    monkeypatch.setattr(ort_run, "TRIM_MIN_ROWS", 2)
    trimmed, shapes = _burst(be)
    rows, slots = zip(*shapes, strict=True)
    assert max(slots) == 64 and 8 <= slots[-1] <= 32  # the long one's 64, cut to twice the short ones' filled
    assert max(rows) == 13 and 2 <= rows[-1] <= 6  # the twelve joined, then most left
    monkeypatch.setattr(ort_run, "TRIM_MIN_ROWS", 10**6)
    monkeypatch.setattr(ort_run, "FIRST_CACHE_SLOTS", 10**6)  # never trimmed
    kept, shapes = _burst(be)
    assert max(r for r, _ in shapes) == shapes[-1][0] and shapes[-1][1] == 64
    _same(trimmed, kept)
