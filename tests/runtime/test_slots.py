"""The running batch's cross K/V slot pool (backends.slots, torch_slots) and the torch backend's in-place
reorders: an admission copies its own sources' K/V only, freed slots are reused, a wider source grows the
pool, beams move within preallocated buffers; and every sentence still decodes as it would alone."""

from __future__ import annotations

import numpy as np

from tests.conftest import sources_of_lengths
from transduce.runtime.backends.base import renumbered_sources
from transduce.runtime.backends.slots import SlotTable
from transduce.runtime.backends.torch_backend import TorchBackend
from transduce.runtime.decoding import DecodingOptions, decode
from transduce.runtime.decoding.running import RunningBatch

GREEDY = DecodingOptions(beam_size=1, max_len_a=0, max_len_b=30, min_length=30)  # runs its whole length
BEAM = DecodingOptions(beam_size=3, nbest=2, max_len_b=12)


def _assert_same(got, want):
    assert [h.tokens for h in got.hypotheses] == [h.tokens for h in want.hypotheses]
    np.testing.assert_allclose([h.score for h in got.hypotheses], [h.score for h in want.hypotheses], atol=1e-5)


def _one_slot_bytes(state) -> int:
    """The bytes of one source's cross K/V in the pool, every layer's key and value."""
    return sum(t[0].nbytes for t in state.cross.pool)


def test_the_table_reuses_freed_slots_and_grows_only_when_full():
    table = SlotTable(np.array([3, 5, 4]), 5)
    # rows decode sources 0 and 2 (source 1 finished): the new source takes slot 1, the pool does not grow
    slots, n, width = table.admit(np.array([0, 0, 2]), np.array([4]), 4, 64)
    assert slots.tolist() == [1] and (n, width) == (3, 5)
    assert table.slot_of.tolist() == [0, 2, 1]  # the protocol's sources 0, 1 (was 2), 2 (new)
    assert table.row_slots(np.array([0, 1, 2])).tolist() == [0, 2, 1]
    # two more while every slot is live: twice the slots; a wider source: twice the width
    slots, n, width = table.admit(np.array([0, 1, 2]), np.array([3, 7]), 7, 64)
    assert slots.tolist() == [3, 4] and (n, width) == (6, 10)
    assert table.slot_len.tolist() == [3, 4, 4, 3, 7, 0]


def test_a_reused_slot_is_written_again_into_rows_that_held_it():
    table = SlotTable(np.array([3, 5]), 5)
    table.hold_rows(2)
    table.held[:] = [0, 1]  # the per-row buffer holds slots 0 and 1
    table.admit(np.array([0]), np.array([2]), 2, 64)  # source 1 left: its slot 1 now holds the new source
    assert table.stale_rows(table.row_slots(np.array([0, 1]))).tolist() == [1]


def test_renumbered_sources_are_the_rows_sources_ascending_and_each_rows_index_among_them():
    rng = np.random.default_rng(4)
    for row_src in [np.array([5, 5, 2, 9, 2, 0]), np.array([3]), *(rng.integers(0, 40, rng.integers(1, 60))
                                                                  for _ in range(20))]:
        kept, inverse = renumbered_sources(row_src)
        want_kept, want_inverse = np.unique(row_src, return_inverse=True)
        assert kept.tolist() == want_kept.tolist() and inverse.tolist() == want_inverse.tolist()
        assert kept.dtype == inverse.dtype == np.int64
    kept, inverse = renumbered_sources(np.zeros(0, np.int64))
    assert kept.size == inverse.size == 0


def test_admitting_one_sentence_copies_one_sources_kv(tiny_model):
    """Into a batch of 8 sentences, each admission writes one slot of K/V into the pool and one row into the
    per-row buffer: nothing of the other sentences is copied, and no buffer is reallocated once it has room."""
    backend = TorchBackend(tiny_model)
    cfg = backend.config
    rng = np.random.default_rng(1)
    batch = RunningBatch(backend, capacity=cfg.max_positions)
    batch.admit(*sources_of_lengths(cfg, [6, 9, 4, 7, 8, 5, 9, 3], rng), GREEDY)
    batch.step()
    batch.admit(*sources_of_lengths(cfg, [5], rng), GREEDY)  # the pool doubles to 16 slots once
    batch.step()
    cross = batch.state.cross
    pointers = [t.data_ptr() for t in cross.pool + cross.rows + batch.state.cache_k]
    one = _one_slot_bytes(batch.state)
    for _ in range(3):
        before = cross.copied
        batch.admit(*sources_of_lengths(cfg, [7], rng), GREEDY)
        batch.step()
        assert one <= cross.copied - before <= 2 * one  # its slot in the pool (and its row of the per-row buffer)
    assert [t.data_ptr() for t in cross.pool + cross.rows + batch.state.cache_k] == pointers


def test_slots_of_finished_sentences_are_reused(tiny_model):
    backend = TorchBackend(tiny_model)
    cfg = backend.config
    rng = np.random.default_rng(2)
    batch = RunningBatch(backend, capacity=cfg.max_positions)
    short = DecodingOptions(beam_size=1, max_len_a=0, max_len_b=2)
    batch.admit(*sources_of_lengths(cfg, [5, 6], rng), short)
    long_src, long_lens = sources_of_lengths(cfg, [7], rng)
    long = batch.admit(long_src, long_lens, GREEDY)
    slots = batch.state.cross.pool[0].shape[0]
    batch.step()
    batch.step()  # the two short sentences finish: their slots are free
    assert batch.cohorts == [long]
    late_src, late_lens = sources_of_lengths(cfg, [4, 6], rng)
    late = batch.admit(late_src, late_lens, BEAM)
    table = batch.state.cross.table
    assert batch.state.cross.pool[0].shape[0] == slots  # no new slot: the freed ones were taken
    assert sorted(table.slot_of[1:].tolist()) == [0, 1] and table.slot_of[0] == 2
    out = batch.run_until_empty()
    _assert_same(out[long][0][1], decode(backend, long_src, long_lens, GREEDY)[0])
    for s, res in out[late]:
        _assert_same(res, decode(backend, late_src[s: s + 1, : late_lens[s]], late_lens[s: s + 1], BEAM)[0])


def test_a_wider_source_grows_the_pool_and_decodes_as_alone(tiny_model):
    backend = TorchBackend(tiny_model)
    cfg = backend.config
    rng = np.random.default_rng(3)
    batch = RunningBatch(backend, capacity=cfg.max_positions)
    first_src, first_lens = sources_of_lengths(cfg, [4, 5], rng)
    first = batch.admit(first_src, first_lens, BEAM)
    assert batch.state.cross.pool[0].shape[2] == 5
    batch.step()
    wide_src, wide_lens = sources_of_lengths(cfg, [17], rng)
    wide = batch.admit(wide_src, wide_lens, BEAM)
    assert batch.state.cross.pool[0].shape[2] >= 17
    out = batch.run_until_empty()
    _assert_same(out[wide][0][1], decode(backend, wide_src, wide_lens, BEAM)[0])
    for s, res in out[first]:
        _assert_same(res, decode(backend, first_src[s: s + 1, : first_lens[s]], first_lens[s: s + 1], BEAM)[0])


def test_beams_reorder_in_place(tiny_model):
    """Beam search's reorders move rows within the cache and its spare buffer: no tensor is reallocated once
    the beams have widened, and the cross K/V of beams of one source are not copied at all."""
    backend = TorchBackend(tiny_model)
    cfg = backend.config
    src, lens = sources_of_lengths(cfg, [6, 8], np.random.default_rng(4))
    opts = DecodingOptions(beam_size=4, nbest=4, max_len_b=20, min_length=20)
    state = backend.begin(backend.encode(src, lens), np.arange(2), 21)
    backend.step(state, np.full(2, cfg.bos_id), 4)
    backend.reorder(state, np.repeat(np.arange(2), 4), np.repeat(np.arange(2), 4))  # the beams widen
    pointers = [t.data_ptr() for t in state.cache_k + state.cache_v + [state.spare]]
    copied = state.cross.copied
    rng = np.random.default_rng(5)
    for _ in range(10):
        backend.step(state, rng.integers(4, cfg.vocab_size, 8), 4)
        rows = np.concatenate([rng.integers(0, 4, 4), rng.integers(4, 8, 4)])  # within each sentence's beams
        backend.reorder(state, rows, np.repeat(np.arange(2), 4))
    assert [t.data_ptr() for t in state.cache_k + state.cache_v + [state.spare]] == pointers
    assert state.cross.copied == copied
    # and a search through those reorders decodes as before
    got = decode(backend, src, lens, opts)
    for s in range(2):
        _assert_same(got[s], decode(backend, src[s: s + 1, : lens[s]], lens[s: s + 1], opts)[0])


def test_admitting_one_sentence_on_onnxruntime_writes_its_rows_only(tiny_artifact_dir):
    """ONNX Runtime's step graphs are bound to per-row cross K/V: an admission writes its source's slot in the
    pool and its row in the bound buffers, whose addresses stay (the bindings stay valid but for the row count)."""
    from transduce.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend(tiny_artifact_dir, threads=1)
    cfg = backend.config
    rng = np.random.default_rng(6)
    batch = RunningBatch(backend, capacity=cfg.max_positions)
    batch.admit(*sources_of_lengths(cfg, [6, 9, 4, 7, 8, 5, 9, 3], rng), GREEDY)
    batch.step()
    batch.admit(*sources_of_lengths(cfg, [5], rng), GREEDY)  # the pool and the row buffers double once
    batch.step()
    pooled = batch.state.pooled

    def addresses():
        return [a.__array_interface__["data"][0] for a in [*pooled.pool.values(), *pooled.rows.values()]]

    pointers = addresses()
    one = sum(pooled.pool[name][0].nbytes for name in pooled.cross_names)
    for _ in range(3):
        before = pooled.copied
        batch.admit(*sources_of_lengths(cfg, [7], rng), GREEDY)
        batch.step()
        assert pooled.copied - before == 2 * one  # its slot in the pool, its row of the bound buffers
    assert addresses() == pointers
    batch.abort()


def test_a_long_source_that_leaves_narrows_the_onnxruntime_pool_to_the_sources_still_decoded(tiny_artifact_dir):
    """One long source widens the pool, and every step reads the pool's width for every row: once it has left,
    the pool and the bound buffers narrow to the sources rows still decode (the steps read them at that width),
    and those sentences decode as they would alone."""
    from transduce.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend(tiny_artifact_dir, threads=1)
    cfg = backend.config
    rng = np.random.default_rng(8)
    batch = RunningBatch(backend, capacity=cfg.max_positions)
    src, lens = sources_of_lengths(cfg, [6, 9, 4], rng)
    short = batch.admit(src, lens, GREEDY)
    batch.step()
    long = batch.admit(*sources_of_lengths(cfg, [48], rng), GREEDY)
    batch.step()
    pooled = batch.state.pooled
    assert pooled.table.width >= 48 and all(b.shape[2] >= 48 for b in pooled.bound.values() if b.ndim == 4)
    batch.cancel(long)
    out = {s: res for _, s, res in batch.step()}
    assert pooled.table.width == 16  # the widest left is 9 tokens: one step of 16
    assert all(b.shape[2] == 16 for b in pooled.bound.values() if b.ndim == 4)
    assert all(p.shape[2] == 16 for n, p in pooled.pool.items() if n != "src_lengths")
    while batch.cohorts:
        for cohort, s, res in batch.step():
            assert cohort is short
            out[s] = res
    for s in range(3):
        _assert_same(out[s], decode(backend, src[s: s + 1, : lens[s]], lens[s: s + 1], GREEDY)[0])


def test_onnxruntime_bindings_outlive_admissions_to_row_counts_bound_before(tiny_artifact_dir, monkeypatch):
    """A step's IO binding is kept for its row count (and cross K/V entry count) across admissions and
    retirements while the buffers stay: a batch going back to row counts it has run binds nothing again, and
    its sentences still decode as alone."""
    from transduce.runtime.backends import ort_memory
    from transduce.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend(tiny_artifact_dir, threads=1)
    cfg = backend.config
    rng = np.random.default_rng(7)
    batch = RunningBatch(backend, capacity=cfg.max_positions)
    src, lens = sources_of_lengths(cfg, [6, 9, 4, 7], rng)
    first = batch.admit(src, lens, GREEDY)

    def cycle():  # one more row for a step, then back to four
        late = batch.admit(*sources_of_lengths(cfg, [5], rng), GREEDY)
        batch.step()
        batch.cancel(late)
        batch.step()

    cycle()  # the buffers grow once: both row counts bound again
    binds, bind = [], ort_memory.NumpyMemory.bind
    monkeypatch.setattr(ort_memory.NumpyMemory, "bind", lambda self, *a: (binds.append(a[1]), bind(self, *a)))
    cycle()
    cycle()
    assert binds == []
    monkeypatch.undo()
    got = dict(batch.run_until_empty()[first])
    for s in range(4):
        _assert_same(got[s], decode(backend, src[s: s + 1, : lens[s]], lens[s: s + 1], GREEDY)[0])
