"""The running batch: sentences admitted at any step boundary beside sentences further on, retired as they
finish, each decoded as it would be alone (batch invariance), over the torch and ONNX Runtime backends."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import sources_of_lengths
from transduce.errors import BackendUnavailable
from transduce.runtime.backends.torch_backend import TorchBackend
from transduce.runtime.decoding import DecodingOptions, decode
from transduce.runtime.decoding.running import Admission, CapacityError, RunningBatch

OPTIONS = [DecodingOptions(beam_size=1, max_len_b=12),
           DecodingOptions(beam_size=3, nbest=2, max_len_b=9, length_penalty=1.0, length_penalty_form="plain"),
           DecodingOptions(beam_size=1, min_length=6, max_len_a=0.5, max_len_b=8),
           DecodingOptions(beam_size=4, nbest=4, min_length=3, max_len_b=10, length_penalty_form="none"),
           DecodingOptions(beam_size=2, max_len_b=15)]


def _requests(cfg: dict, count: int = 14, seed: int = 3):
    """(admit at step, src, lengths, options) of requests of 1-3 sentences of mixed lengths and options."""
    rng = np.random.default_rng(seed)
    out = []
    for j in range(count):
        lengths = rng.integers(2, 21, rng.integers(1, 4)).tolist()
        out.append((int(rng.integers(0, 25)), *sources_of_lengths(cfg, lengths, rng), OPTIONS[j % len(OPTIONS)]))
    return sorted(out, key=lambda r: r[0])


def _interleaved(backend, requests, capacity: int, together: bool = False):
    """Every request admitted at its step into one running batch -> its results, in its sentences' order,
    and the most rows the batch held at once. together: the requests of one step in one admission."""
    batch = RunningBatch(backend, capacity=capacity)
    pending, cohorts, results, most = list(requests), [], {}, 0
    while pending or batch.cohorts:
        arrived = []
        while pending and pending[0][0] <= batch.steps:
            arrived.append(pending.pop(0))
        if together and arrived:
            cohorts.extend(batch.admit_many([Admission(src, lens, opts) for _, src, lens, opts in arrived]))
        else:
            cohorts.extend(batch.admit(src, lens, opts) for _, src, lens, opts in arrived)
        for c in cohorts[len(cohorts) - len(arrived):]:
            results[c] = {}
        most = max(most, batch.rows)
        if not batch.cohorts:  # nothing running until the next arrival: the clock moves on
            batch.steps = pending[0][0]
            continue
        for cohort, s, res in batch.step():
            results[cohort][s] = res
    return [[results[c][s] for s in range(len(results[c]))] for c in cohorts], most


def _assert_same(got, want):
    assert [h.tokens for h in got.hypotheses] == [h.tokens for h in want.hypotheses]
    assert [h.finished for h in got.hypotheses] == [h.finished for h in want.hypotheses]
    np.testing.assert_allclose([h.score for h in got.hypotheses], [h.score for h in want.hypotheses], atol=1e-5)
    np.testing.assert_allclose([h.log_prob for h in got.hypotheses], [h.log_prob for h in want.hypotheses], atol=1e-5)


@pytest.fixture(scope="module", params=["torch", "torch-graph", "onnxruntime", "onnxruntime-standard-step"])
def backend(request, tiny_model, tiny_artifact_dir):
    if request.param == "torch":
        yield TorchBackend(tiny_model)
        return
    if request.param == "torch-graph":  # static slabs and their graphs, replayed on the CPU by the double
        from cuda_graph_fake import HostCapturer

        from transduce.runtime.backends.torch_graph_backend import TorchGraphBackend

        yield TorchGraphBackend(tiny_model, "cpu", _capturer=HostCapturer())
        return
    from transduce.formats import contract
    from transduce.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

    be = OnnxRuntimeBackend(tiny_artifact_dir, threads=1)
    if request.param == "onnxruntime":
        assert be.step_graphs()[0] == contract.ORT_STEP_FILE  # the fused graph: per-row positions in GQA
        yield be
        return
    with be.only_step_graph(contract.STEP_FILE):  # the standard graph: the backend writes each row's slot
        yield be


def test_interleaved_requests_decode_as_each_sentence_alone(backend):
    """Requests of mixed lengths, beam sizes, minimum lengths and length penalties admitted at different steps:
    each sentence's hypotheses are those of decoding it alone (tokens identical, scores within 1e-5)."""
    cfg = backend.config
    requests = _requests(cfg)
    got, most = _interleaved(backend, requests, capacity=cfg.max_positions)
    assert most > 8  # many sentences really ran side by side
    for (_, src, lens, opts), results in zip(requests, got, strict=True):
        assert len(results) == len(lens)
        for i, res in enumerate(results):
            alone = decode(backend, src[i: i + 1, : lens[i]], lens[i: i + 1], opts)[0]
            _assert_same(res, alone)


def test_requests_arriving_together_join_in_one_admission_and_decode_as_alone(backend):
    """Requests that arrive at the same step join in one admission (one encoder batch, padded to the widest
    source; one backend admission), into an empty batch or a running one: each sentence decodes as alone."""
    cfg = backend.config
    requests = [(step // 3 * 4, src, lens, opts) for step, src, lens, opts in _requests(cfg, count=16, seed=5)]
    assert len({r[0] for r in requests}) < len(requests) - 4  # many arrive together
    got, _ = _interleaved(backend, requests, capacity=cfg.max_positions, together=True)
    for (_, src, lens, opts), results in zip(requests, got, strict=True):
        for i, res in enumerate(results):
            _assert_same(res, decode(backend, src[i: i + 1, : lens[i]], lens[i: i + 1], opts)[0])


def test_offline_decode_is_one_cohort_run_until_empty(tiny_model):
    """decode() and a running batch admitting the whole batch at once give the same results, bit for bit."""
    backend = TorchBackend(tiny_model)
    cfg = backend.config
    src, lens = sources_of_lengths(cfg, [5, 9, 3, 14], np.random.default_rng(1))
    for opts in OPTIONS:
        batch = RunningBatch(backend)
        cohort = batch.admit(src, lens, opts)
        out = batch.run_until_empty()[cohort]
        assert sorted(s for s, _ in out) == [0, 1, 2, 3] and batch.state is None and batch.rows == 0
        assert [r for _, r in sorted(out, key=lambda x: x[0])] == decode(backend, src, lens, opts)


def test_rows_are_retired_as_sentences_finish_and_freed_on_cancel(tiny_model):
    backend = TorchBackend(tiny_model)
    cfg = backend.config
    rng = np.random.default_rng(2)
    batch = RunningBatch(backend, capacity=cfg.max_positions)
    short = batch.admit(*sources_of_lengths(cfg, [3, 4], rng), DecodingOptions(beam_size=1, max_len_a=0, max_len_b=2))
    long = batch.admit(*sources_of_lengths(cfg, [6], rng), DecodingOptions(beam_size=3, max_len_a=0, max_len_b=30,
                                                               min_length=31))
    assert batch.rows == 3 and batch.reserved_rows() == 2 + 3
    batch.step()
    assert batch.rows == 2 + 3  # the beam widened to k rows after its first step
    finished = batch.step()  # the short cohort reaches its maximum length of 2 tokens
    assert sorted((c is short, s) for c, s, _ in finished) == [(True, 0), (True, 1)]
    assert batch.cohorts == [long] and batch.rows == 3
    late = batch.admit(*sources_of_lengths(cfg, [4], rng), DecodingOptions(beam_size=2, max_len_b=30))
    assert batch.rows == 3 + 1  # its one row at position 0 beside rows at position 2
    batch.step()
    assert batch.rows == 3 + 2
    batch.cancel(long)  # its rows leave at once, the others go on
    assert batch.cohorts == [late] and batch.rows == 2
    batch.step()
    assert batch.rows == 2
    batch.cancel(late)
    assert batch.cohorts == [] and batch.state is None


@pytest.mark.parametrize("opts", [DecodingOptions(beam_size=3, nbest=2, max_len_b=14),
                                  DecodingOptions(beam_size=2, no_repeat_ngram_size=2, max_len_b=14)])
def test_sentences_dropped_from_a_beam_cohort_leave_and_the_rest_decode_as_alone(backend, opts):
    """A beam cohort's sentences dropped between steps (a server's request that shares the cohort, gone): their
    rows leave the batch at once, the cohort's other sentences (and the cohorts beside it) decode as alone,
    back-pointers and per-row history followed through the rows that stayed."""
    cfg = backend.config
    rng = np.random.default_rng(8)
    src, lens = sources_of_lengths(cfg, [5, 9, 3, 7, 6], rng)
    other_src, other_lens = sources_of_lengths(cfg, [4], rng)
    batch = RunningBatch(backend, capacity=cfg.max_positions)
    cohort, other = batch.admit_many([Admission(src, lens, opts), Admission(other_src, other_lens, opts)])
    results = {cohort: {}, other: {}}
    for step in range(40):
        if step == 2:
            rows = batch.rows
            batch.cancel(cohort, [1, 3])
            assert batch.rows == rows - 2 * opts.beam_size and set(cohort.row_sent.tolist()) == {0, 2, 4}
        if step == 4:
            batch.cancel(cohort, [0])
        for c, s, res in batch.step():
            results[c][s] = res
        if not batch.cohorts:
            break
    assert sorted(results[cohort]) == [2, 4] and sorted(results[other]) == [0]
    for s in (2, 4):
        _assert_same(results[cohort][s], decode(backend, src[s: s + 1, : lens[s]], lens[s: s + 1], opts)[0])
    _assert_same(results[other][0], decode(backend, other_src, other_lens, opts)[0])


def test_what_does_not_fit_is_refused_not_truncated(tiny_model):
    backend = TorchBackend(tiny_model)
    cfg = backend.config
    rng = np.random.default_rng(5)
    batch = RunningBatch(backend)  # offline: the first cohort's maximum length is the state's capacity
    batch.admit(*sources_of_lengths(cfg, [4], rng), DecodingOptions(beam_size=1, max_len_a=0, max_len_b=5))
    with pytest.raises(CapacityError, match="maximum length of 9 tokens does not fit the running batch's 5"):
        batch.admit(*sources_of_lengths(cfg, [4], rng), DecodingOptions(beam_size=1, max_len_a=0, max_len_b=9))
    assert len(batch.cohorts) == 1  # the refused cohort left nothing behind
    batch.run_until_empty()


def test_a_backend_without_admit_decodes_from_empty_only(tiny_model):
    from transduce.runtime.backends.base import AdmitsRows

    class NoAdmit(TorchBackend):
        admit = None  # as a backend without the AdmitsRows capability

    assert not isinstance(NoAdmit(tiny_model), AdmitsRows)

    backend = NoAdmit(tiny_model)
    cfg = backend.config
    rng = np.random.default_rng(6)
    batch = RunningBatch(backend, capacity=cfg.max_positions)
    assert batch.can_admit()
    first = batch.admit(*sources_of_lengths(cfg, [4], rng), DecodingOptions(beam_size=1, max_len_b=3))
    assert not batch.can_admit()
    with pytest.raises(BackendUnavailable, match="cannot add sentences to a running batch"):
        batch.admit(*sources_of_lengths(cfg, [4], rng), DecodingOptions(beam_size=1))
    out = batch.run_until_empty()
    assert list(out) == [first] and batch.can_admit()


@pytest.mark.filterwarnings("ignore:overflow encountered in power:RuntimeWarning")
def test_a_cohort_whose_search_fails_leaves_and_the_others_go_on(tiny_model):
    """A length penalty whose normalisation overflows fails that cohort's search (as it fails offline decoding);
    beside others it is dropped and named in `failed`, and their results are untouched."""
    backend = TorchBackend(tiny_model)
    cfg = backend.config
    rng = np.random.default_rng(8)
    good_src, good_lens = sources_of_lengths(cfg, [5, 7], rng)
    good_opts = DecodingOptions(beam_size=2, max_len_b=6)
    batch = RunningBatch(backend, capacity=cfg.max_positions)
    bad = batch.admit(*sources_of_lengths(cfg, [4], rng),
                      DecodingOptions(beam_size=2, max_len_b=3, length_penalty=1e300))
    good = batch.admit(good_src, good_lens, good_opts)
    got, failed = {}, []
    while batch.cohorts:
        for c, s, res in batch.step():
            got[(c, s)] = res
        failed += batch.failed
    assert [(c, type(e)) for c, e in failed] == [(bad, OverflowError)]
    assert all(c is good for c, _ in got)
    for s, want in enumerate(decode(backend, good_src, good_lens, good_opts)):
        _assert_same(got[(good, s)], want)


def test_a_solo_cohort_whose_listener_fails_leaves_and_the_others_go_on(tiny_model):
    """A one-sentence greedy cohort stepped as a solo one whose token listener raises is dropped and named in
    `failed`, as any cohort whose search fails; the one beside it decodes as alone."""
    backend = TorchBackend(tiny_model)
    cfg = backend.config
    rng = np.random.default_rng(9)
    good_src, good_lens = sources_of_lengths(cfg, [5], rng)
    opts = DecodingOptions(beam_size=1, max_len_b=6)

    def broken(sentences, tokens):
        raise RuntimeError("the listener failed")

    batch = RunningBatch(backend, capacity=cfg.max_positions)
    bad = batch.admit(*sources_of_lengths(cfg, [4], rng), opts, on_tokens=broken)
    good = batch.admit(good_src, good_lens, opts)
    assert bad.solo and good.solo
    got, failed = {}, []
    while batch.cohorts:
        for c, s, res in batch.step():
            got[(c, s)] = res
        failed += batch.failed
    assert [(c, type(e)) for c, e in failed] == [(bad, RuntimeError)]
    assert list(got) == [(good, 0)]
    _assert_same(got[(good, 0)], decode(backend, good_src, good_lens, opts)[0])


def _one_sentence_requests(cfg, count: int = 24, seed: int = 11):
    """(admit at step, src, lengths, options, prefixes) of one-sentence requests, most greedy with nothing but the
    best candidate to read (solo cohorts), beside greedy ones that ban EOS, force a prefix or draw, and beams."""
    rng = np.random.default_rng(seed)
    kinds = [DecodingOptions(beam_size=1, max_len_b=12)] * 4 + [
        DecodingOptions(beam_size=1, min_length=5, max_len_b=9),
        DecodingOptions(beam_size=1, sampling_topk=5, seed=3, max_len_b=10),
        DecodingOptions(beam_size=1, max_len_a=0.0, max_len_b=3),
        DecodingOptions(beam_size=2, max_len_b=8)]
    out = []
    for j in range(count):
        lengths = [int(rng.integers(2, 21))]
        prefixes = [[5, 6]] if j % 5 == 4 else None
        out.append((int(rng.integers(0, 20)), *sources_of_lengths(cfg, lengths, rng), kinds[j % len(kinds)], prefixes))
    return sorted(out, key=lambda r: r[0])


def _one_sentence_run(backend, requests, solo: bool):
    """_interleaved over one-sentence requests, each admitted with a token listener;
    solo=False steps every cohort through advance() -> results, each cohort's streamed tokens, solo cohorts."""
    batch = RunningBatch(backend, capacity=backend.config.max_positions)
    pending, results, streamed, solos = list(enumerate(requests)), {}, {}, 0
    while pending or batch.cohorts:
        while pending and pending[0][1][0] <= batch.steps:
            j, (_, src, lens, opts, prefixes) = pending.pop(0)
            streamed[j] = []
            c = batch.admit(src, lens, opts, on_tokens=lambda s, t, j=j: streamed[j].extend(t.tolist()),
                            prefixes=prefixes)
            solos += c.solo
            c.solo, c.j = c.solo and solo, j
        if not batch.cohorts:
            batch.steps = pending[0][1][0]
            continue
        for c, _, res in batch.step():
            results[c.j] = res
    return [results[j] for j in range(len(requests))], [streamed[j] for j in range(len(requests))], solos


@pytest.mark.parametrize("which", ["torch", "onnxruntime"])
def test_solo_cohorts_decode_as_through_the_general_path(which, tiny_model, tiny_artifact_dir):
    """One-sentence greedy cohorts that read only their best candidate are stepped together (advance_solo)
    beside cohorts that ban EOS, force a prefix, draw or search beams: every result, bit for bit, and every
    streamed token is what stepping each through advance() gives, and each sentence decodes as alone."""
    if which == "torch":
        backend = TorchBackend(tiny_model)
    else:
        from transduce.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

        backend = OnnxRuntimeBackend(tiny_artifact_dir, threads=1)
    requests = _one_sentence_requests(backend.config)
    fast, fast_streamed, solos = _one_sentence_run(backend, requests, solo=True)
    slow, slow_streamed, _ = _one_sentence_run(backend, requests, solo=False)
    assert 8 <= solos < len(requests)  # solo cohorts beside others
    assert fast == slow and fast_streamed == slow_streamed
    for (_, src, lens, opts, prefixes), res, tokens in zip(requests, fast, fast_streamed, strict=True):
        if opts.beam_size == 1:  # a beam search streams nothing
            assert list(res.best.tokens) + [backend.config.eos_id] * res.best.finished == tokens
        _assert_same(res, decode(backend, src, lens, opts, prefixes=prefixes)[0])


def test_ended_solo_rows_are_filled_from_the_end_and_every_sentence_decodes_as_alone(backend, monkeypatch):
    """One-sentence greedy cohorts ending at different steps: the rows past the new end move into the ended rows'
    places, the rest stay (each reorder moves no more rows than ended, where shifting moved every later row),
    and each sentence, admitted in groups at several steps, decodes as alone; a two-sentence cohort among them
    (not solo: it shifts when it shrinks) changes nothing in the results."""
    cfg = backend.config
    rng = np.random.default_rng(5)
    moves, reorder = [], backend.reorder

    def counted(state, rows, row_src):
        moves.append((int(np.count_nonzero(rows != np.arange(len(rows)))), len(rows)))
        return reorder(state, rows, row_src)

    monkeypatch.setattr(backend, "reorder", counted)
    batch = RunningBatch(backend, capacity=cfg.max_positions)
    sources, results, before = {}, {}, 0
    for group in range(4):
        admissions = []
        for _ in range(8):
            src, lens = sources_of_lengths(cfg, [int(rng.integers(2, 15))], rng)
            admissions.append(Admission(src, lens, DecodingOptions(beam_size=1, max_len_a=0.0,
                                                                   max_len_b=int(rng.integers(1, 14)))))
        if group == 3:  # beside the solo ones: one cohort of two sentences
            src, lens = sources_of_lengths(cfg, [4, 9], rng)
            admissions.append(Admission(src, lens, DecodingOptions(beam_size=1, max_len_a=0.0, max_len_b=6)))
        for c, a in zip(batch.admit_many(admissions), admissions, strict=True):
            sources[c] = a
        before = batch.rows
        for _ in range(3):
            start = len(moves)
            for c, s, res in batch.step():
                results[(c, s)] = res
            if len(moves) > start and all(c.solo for c in batch.cohorts):
                moved, rows = moves[-1]
                assert moved <= before - rows, (moved, before, rows)
            before = batch.rows
    while batch.cohorts:
        for c, s, res in batch.step():
            results[(c, s)] = res
    assert any(m for m, _ in moves) and len(results) == 4 * 8 + 2
    for (c, s), res in results.items():
        a = sources[c]
        _assert_same(res, decode(backend, a.src_ids[s: s + 1, : a.src_lengths[s]], a.src_lengths[s: s + 1],
                                 a.options)[0])
