"""Greedy and beam search over the backend protocol, checked against exhaustive search."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch

from transduce.errors import InputError
from transduce.models.config import ModelConfig
from transduce.models.transformer import Transformer
from transduce.runtime.backends.torch_backend import TorchBackend
from transduce.runtime.decoding import DecodingOptions, decode


def test_runtime_import_loads_no_framework():
    code = (
        "import sys, transduce.runtime, transduce.formats.contract, transduce.runtime.decoding;"
        "bad=[m for m in ('torch','onnxruntime','tensorrt','onnx') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture(scope="module")
def micro():
    """Vocabulary of 7 (4 specials + 3 words): every output sequence of length <= 4 can be enumerated."""
    torch.manual_seed(4)
    cfg = ModelConfig(vocab_size=7, encoder_layers=1, decoder_layers=2, d_model=16, n_heads=2, d_ff=32,
                      dropout=0.0, max_positions=16)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # sharpen the distributions so EOS and words compete
        model.embed.weight.mul_(4.0)
    return model


def _sequence_log_prob(model, src, lens, seq):
    tgt = torch.tensor([[model.cfg.bos_id] + seq[:-1]])
    with torch.no_grad():
        lp = torch.log_softmax(model(src, lens, tgt), -1)[0]
    return float(sum(lp[i, t] for i, t in enumerate(seq)))


@pytest.mark.parametrize("form,alpha", [("gnmt", 0.6), ("plain", 1.0), ("none", 0.0)])
def test_wide_beam_equals_exhaustive_search(micro, form, alpha):
    cfg = micro.cfg
    src = torch.tensor([[4, 5, 6, 2]])
    lens = torch.tensor([4])
    max_len = 4
    # the exact rule: the provably best hypotheses of the beam, which a beam this wide makes the best of all
    opts = DecodingOptions(beam_size=64, length_penalty=alpha, length_penalty_form=form, max_len_a=0.0,
                           max_len_b=max_len, nbest=5, early_stopping="exact")
    words = [cfg.unk_id, 4, 5, 6]  # what may be generated besides EOS (PAD and BOS never are)
    candidates = []
    for n in range(max_len):  # finished: n words + EOS
        for seq in itertools.product(words, repeat=n):
            s = list(seq) + [cfg.eos_id]
            candidates.append((_sequence_log_prob(micro, src, lens, s) / opts.penalty(len(s)), tuple(seq)))
    for seq in itertools.product(words, repeat=max_len):  # cut at max length without EOS
        candidates.append((_sequence_log_prob(micro, src, lens, list(seq)) / opts.penalty(max_len), tuple(seq)))
    candidates.sort(reverse=True)
    result = decode(TorchBackend(micro), src.numpy(), lens.numpy(), opts)[0]
    assert [h.tokens for h in result.hypotheses] == [c[1] for c in candidates[:5]]
    np.testing.assert_allclose([h.score for h in result.hypotheses], [c[0] for c in candidates[:5]], atol=1e-5)


def test_narrow_beam_never_beats_exhaustive(micro):
    src, lens = np.array([[5, 4, 2]]), np.array([3])
    wide = decode(TorchBackend(micro), src, lens, DecodingOptions(beam_size=64, max_len_a=0, max_len_b=4))[0]
    for k in (1, 2, 3):
        narrow = decode(TorchBackend(micro), src, lens, DecodingOptions(beam_size=k, max_len_a=0, max_len_b=4))[0]
        assert narrow.best.score <= wide.best.score + 1e-9


def test_beam_one_is_greedy(tiny_model):
    rng = np.random.default_rng(0)
    src = rng.integers(4, tiny_model.cfg.vocab_size, (5, 8))
    lens = np.array([8, 6, 3, 1, 8])
    for i, n in enumerate(lens):
        src[i, n - 1] = 2
        src[i, n:] = 0
    backend = TorchBackend(tiny_model)
    greedy = decode(backend, src, lens, DecodingOptions(beam_size=1, length_penalty=0.0, max_len_b=10))
    beam1 = decode(backend, src, lens, DecodingOptions(beam_size=1, length_penalty=0.0, max_len_b=10), search="beam")
    beam = decode(backend, src, lens, DecodingOptions(beam_size=2, length_penalty=0.0, max_len_b=10))
    for g, b1, b in zip(greedy, beam1, beam, strict=True):
        assert g.best.tokens == b1.best.tokens
        np.testing.assert_allclose(g.best.token_log_probs, b1.best.token_log_probs, atol=1e-6)
        assert b.best.score >= g.best.score - 1e-6  # a wider beam finds at least as good


def test_min_length_and_max_length(tiny_model):
    backend = TorchBackend(tiny_model)
    src, lens = np.array([[5, 6, 2]]), np.array([3])
    for beam in (1, 3):
        res = decode(backend, src, lens, DecodingOptions(beam_size=beam, min_length=6, max_len_b=7))[0]
        h = res.best
        assert len(h.token_log_probs) >= 6
        assert len(h.token_log_probs) <= 7 + 2  # max length = 1 * (3 - 1) + 7 = 9 tokens
        assert np.isclose(sum(h.token_log_probs), h.log_prob)


def test_forced_options_decode_exactly_that_many_tokens(tiny_model):
    """Whatever the source length, every hypothesis has exactly `steps` tokens and none ended."""
    backend = TorchBackend(tiny_model)
    src, lens = np.array([[5, 6, 2, 0, 0, 0], [5, 6, 7, 8, 9, 2]]), np.array([3, 6])
    for beam in (1, 3):
        for res in decode(backend, src, lens, DecodingOptions.forced(5, beam_size=beam, nbest=beam)):
            assert [len(h.tokens) for h in res.hypotheses] == [5] * beam
            assert not any(h.finished for h in res.hypotheses)


def test_invalid_options(tiny_model):
    with pytest.raises(InputError, match="nbest"):
        DecodingOptions(beam_size=2, nbest=3)
    with pytest.raises(InputError, match="length_penalty_form must be one of gnmt, plain, none, got 'wu'"):
        DecodingOptions(length_penalty_form="wu")
    # each negative one named alone, by its parameter name (the error's params: a CLI spells them as flags)
    for name in ("length_penalty", "min_length", "max_len_a", "max_len_b"):
        with pytest.raises(InputError, match=f"^{name} must be >= 0, got -1") as e:
            DecodingOptions(**{name: -1})
        assert e.value.params == (name,)
    with pytest.raises(InputError, match="beam_size must be >= 1, got 0") as e:
        DecodingOptions(beam_size=0)
    assert e.value.spelled({"beam_size": "--beam"}).startswith("--beam must be >= 1, got 0")
    # a NaN or infinite alpha scores every hypothesis NaN or 0, an infinite max_len_a cuts every one to a token
    for bad, says in ((dict(length_penalty=float("nan")), "length_penalty must be a finite number"),
                      (dict(length_penalty=float("inf")), "length_penalty must be a finite number"),
                      (dict(max_len_a=float("inf")), "max_len_a must be a finite number"),
                      (dict(beam_size=2.5), "beam_size must be an integer"),
                      (dict(nbest=True), "nbest must be an integer"),
                      (dict(min_length=2.5), "min_length must be an integer"),
                      (dict(max_len_b="5"), "max_len_b must be an integer")):
        with pytest.raises(InputError, match=says):
            DecodingOptions(**bad)
    assert DecodingOptions(beam_size=np.int64(2), max_len_a=np.float32(1.5)).beam_size == 2
    backend = TorchBackend(tiny_model)
    with pytest.raises(InputError, match="search must be"):
        decode(backend, np.array([[5, 2]]), np.array([2]), DecodingOptions(), search="bogus")
    assert decode(backend, np.zeros((0, 3), np.int64), np.zeros(0, np.int64), DecodingOptions()) == []


def test_lengths_that_are_not_the_batchs_are_refused(tiny_model):
    """One length per row, each 1..width: a backend would otherwise drop a sentence or read padding."""
    backend = TorchBackend(tiny_model)
    src = np.array([[5, 6, 2], [7, 2, 0]])
    for ids, lengths, says in ((src, np.array([3]), r"one length per row of src_ids \(2\), got shape \(1,\)"),
                               (src, np.array([3, 4]), r"src_lengths\[1\] is 4: each length must be 1..3"),
                               (src, np.array([0, 2]), r"src_lengths\[0\] is 0"),
                               (src[0], np.array([3]), r"must be a \(batch, length\) array, got shape \(3,\)")):
        with pytest.raises(InputError, match=says):
            decode(backend, ids, lengths, DecodingOptions(beam_size=1))
    assert len(decode(backend, src, np.array([3, 2]), DecodingOptions(beam_size=1, max_len_b=2))) == 2


def test_max_length_is_the_formula_exactly():
    """ceil(a * source tokens + b), without a step more where a * n lands just above an integer in floating
    point (1.1 * 50 is 55.000000000000007)."""
    from fractions import Fraction
    from math import ceil

    from transduce.runtime.decoding import max_lengths

    for a in (1.1, 1.2, 1.3, 0.7, 0.1, 0.3):
        n = np.arange(1, 200)
        got = max_lengths(n + 1, DecodingOptions(max_len_a=a, max_len_b=5), 10_000)
        want = [ceil(Fraction(str(a)) * int(k) + 5) for k in n]
        assert got.tolist() == want, a
    # a max_len_a just above an integer still counts: 1.0000001 * 4 + 5 = 9.0000004 -> 10
    assert max_lengths(np.array([5]), DecodingOptions(max_len_a=1.0000001, max_len_b=5), 100).tolist() == [10]
    # a float32 option stands for its shortest decimal: np.float32(1.1) is 1.100000024 in float64, which
    # times 50 would give 56; a float64 one is taken as it is
    assert max_lengths(np.array([51]), DecodingOptions(max_len_a=np.float32(1.1), max_len_b=0), 100).tolist() == [55]
    assert DecodingOptions(length_penalty=np.float16(0.6)).length_penalty == 0.6
    assert DecodingOptions(max_len_a=np.float64(1.0000001)).max_len_a == 1.0000001


def test_a_huge_max_length_is_the_models_cap():
    """A max_len_a or max_len_b far past the model (meaning 'as long as it allows') gives max_positions,
    not an int64 overflow clipped to one token."""
    from transduce.runtime.decoding import max_lengths

    src = np.array([3, 10, 2])
    for opts in (DecodingOptions(max_len_b=10**30), DecodingOptions(max_len_b=10**400),
                 DecodingOptions(max_len_a=1e300), DecodingOptions(max_len_a=1e300, max_len_b=10**30),
                 DecodingOptions(max_len_a=0, max_len_b=2**63)):
        assert max_lengths(src, opts, 256).tolist() == [256, 256, 256], opts
    assert max_lengths(src, DecodingOptions(max_len_a=0, max_len_b=255), 256).tolist() == [255, 255, 255]
    # a source of EOS alone: a * 0 + b
    assert max_lengths(np.array([3, 1]), DecodingOptions(max_len_a=1e300, max_len_b=0), 256).tolist() == [256, 1]


@pytest.mark.parametrize("vector_from", [10**9, 1], ids=["loop", "arrays"])
def test_stay_in_place_keeps_first_children_in_their_parents_rows(monkeypatch, vector_from):
    """Each sentence's slot order is a permutation; the first child of every parent whose row is in the
    sentence's block keeps that row, so a reorder moves only the other children (the minimum). Both ways
    of working it out (a loop for few sentences, flat arrays for many)."""
    from transduce.runtime.decoding import search
    from transduce.runtime.decoding.search import _stay_in_place

    monkeypatch.setattr(search, "STAY_VECTOR_FROM", vector_from)
    rng = np.random.default_rng(0)
    nones = 0
    for ns, nb in [(1, 4), (16, 4), (3, 2), (5, 1), (40, 4), (30, 8)]:
        for _ in range(50):
            # parents mostly in the sentence's own block, sometimes elsewhere (after sentences were dropped)
            parents = np.sort(rng.integers(0, nb, (ns, nb)), axis=1) + (np.arange(ns) * nb)[:, None]
            parents[rng.random((ns, nb)) < 0.1] += nb
            perm = _stay_in_place(parents, nb)
            if perm is None:  # every beam keeps its slot
                perm = np.tile(np.arange(nb), (ns, 1))  # checked as such below (rows moved: the minimum)
                nones += 1
            assert (np.sort(perm, axis=1) == np.arange(nb)).all()
            new = np.take_along_axis(parents, perm, axis=1).ravel()
            moved = int((new != np.arange(ns * nb)).sum())
            in_block = [{p - i * nb for p in row if 0 <= p - i * nb < nb} for i, row in enumerate(parents.tolist())]
            assert moved == ns * nb - sum(len(s) for s in in_block)
    assert nones > 0  # the identity (None) came up and was checked
    # beams 0 and 3 in their parents' rows, 1 and 2 fill 1, 2
    assert _stay_in_place(np.array([[0, 0, 0, 3]]), 4) is None
    assert _stay_in_place(np.array([[0, 0, 1, 3]]), 4).tolist() == [[0, 2, 1, 3]]  # beam 2 to its parent's row 1


def test_stay_in_place_loop_and_arrays_agree(monkeypatch):
    """The flat-array slot order equals the loop's on shuffled parents, some outside their block."""
    from transduce.runtime.decoding import search
    from transduce.runtime.decoding.search import _stay_in_place, _stay_in_place_arrays

    monkeypatch.setattr(search, "STAY_VECTOR_FROM", 10**9)
    rng = np.random.default_rng(1)
    for ns, nb in [(1, 4), (30, 4), (100, 2), (50, 1), (40, 8)]:
        for _ in range(100):
            parents = rng.integers(0, nb, (ns, nb)) + (np.arange(ns) * nb)[:, None]
            parents[rng.random((ns, nb)) < 0.1] += nb
            loop = _stay_in_place(parents, nb)
            arrays = _stay_in_place_arrays(parents, nb)
            assert (loop is None) == (arrays is None)
            if loop is not None:
                assert loop.tolist() == arrays.tolist()


class _Parted:
    """A backend whose shards() deals batches out to views of a torch backend (one may fail), recording which
    sentences each view decoded and in which thread."""

    def __init__(self, model, views=2, fail_view=None):
        self.inner = TorchBackend(model)
        self.config = self.inner.config
        self.seen: list[tuple[int, tuple[int, ...], str]] = []
        outer = self

        class View:
            def __init__(self, j):
                self.j, self.config = j, outer.config

            def encode(self, src_ids, src_lengths):
                import threading

                outer.seen.append((self.j, tuple(src_ids[:, 0].tolist()), threading.current_thread().name))
                if self.j == fail_view:
                    raise RuntimeError(f"view {self.j} failed")
                return outer.inner.encode(src_ids, src_lengths)

            def __getattr__(self, name):
                return getattr(outer.inner, name)

        self.views = [View(j) for j in range(views)]

    def shards(self, batch, beam):
        return self.views if batch >= 2 else None

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_batch_in_parts_decodes_as_the_whole(tiny_model):
    """A backend offering parts gets its sentences dealt round-robin (sentence i to part i % n), each part
    decoded at the same time (the first in the calling thread), and the results back in the batch's order,
    equal to decoding the batch whole."""
    import threading

    rng = np.random.default_rng(7)
    cfg = tiny_model.cfg
    src = rng.integers(4, cfg.vocab_size, size=(5, 6))
    src[:, 0] = np.arange(10, 15)  # sentence i starts with 10 + i: the views record who decoded what
    lens = np.array([6, 3, 5, 2, 4])
    for i, n in enumerate(lens):
        src[i, n - 1], src[i, n:] = cfg.eos_id, cfg.pad_id
    for opts in (DecodingOptions(beam_size=1, max_len_b=7), DecodingOptions(beam_size=3, nbest=2, max_len_b=7)):
        parted = _Parted(tiny_model, views=3)
        got, want = decode(parted, src, lens, opts), decode(TorchBackend(tiny_model), src, lens, opts)
        # torch's own results move in the last bits with the batch beside a sentence (the ONNX Runtime backend's
        # do not, and its parts decode bit for bit as the whole: tests/runtime/test_onnxruntime_backend.py)
        assert [[h.tokens for h in r.hypotheses] for r in got] == [[h.tokens for h in r.hypotheses] for r in want]
        np.testing.assert_allclose([h.score for r in got for h in r.hypotheses],
                                   [h.score for r in want for h in r.hypotheses], rtol=1e-5)
        assert sorted((j, first) for j, first, _ in parted.seen) == [(0, (10, 13)), (1, (11, 14)), (2, (12,))]
        threads = {j: name for j, _, name in parted.seen}
        assert threads[0] == threading.current_thread().name and threads[1] != threads[0] != threads[2]
    one = _Parted(tiny_model, views=3)
    decode(one, src[:1], lens[:1], DecodingOptions(beam_size=2, max_len_b=5))  # shards() says no: decoded whole
    assert one.seen == []


@pytest.mark.parametrize("fail_view", [0, 1])
def test_an_error_in_a_part_is_raised_when_every_part_has_stopped(tiny_model, fail_view):
    parted = _Parted(tiny_model, views=2, fail_view=fail_view)
    src = np.array([[5, 6, 2], [6, 5, 2], [4, 2, 0]])
    with pytest.raises(RuntimeError, match=f"view {fail_view} failed"):
        decode(parted, src, np.array([3, 3, 2]), DecodingOptions(beam_size=2, max_len_b=4))
    assert sorted(j for j, _, _ in parted.seen) == [0, 1]  # the other part was decoded too


def test_parts_are_submitted_before_another_decode_can_replace_the_pool(tiny_model, monkeypatch):
    """A decode on another thread that needs more parts than the pool has threads replaces (and shuts down) the
    pool: one that had just taken the old pool must not submit to it after that. Played deterministically: the
    replacement happens the moment the pool's lock is let go."""
    import concurrent.futures
    import threading

    from transduce.runtime.decoding import offline as decoding

    class ReplaceOnRelease:
        def __init__(self):
            self.lock, self.replaced = threading.Lock(), False

        def __enter__(self):
            self.lock.__enter__()

        def __exit__(self, *exc):
            self.lock.__exit__(*exc)
            if not self.replaced:  # what a decode needing a bigger pool does on another thread, just now
                self.replaced = True
                old = decoding._PARTS_POOL
                decoding._PARTS_POOL = (64, concurrent.futures.ThreadPoolExecutor(64))
                old[1].shutdown(wait=False)

    monkeypatch.setattr(decoding, "_PARTS_POOL", None)
    monkeypatch.setattr(decoding, "_PARTS_POOL_LOCK", ReplaceOnRelease())
    src = np.array([[5, 6, 2], [6, 5, 2], [4, 2, 0]])
    parted = _Parted(tiny_model, views=3)
    got = decode(parted, src, np.array([3, 3, 2]), DecodingOptions(beam_size=1, max_len_b=4))
    assert len(got) == 3 and sorted(j for j, _, _ in parted.seen) == [0, 1, 2]
    decoding._PARTS_POOL[1].shutdown()


def test_parts_after_fork_and_at_exit(monkeypatch):
    """The parts' pool survives neither a fork (its threads are the parent's) nor the interpreter's shutdown
    (no new futures then): a decode in parts must still finish in a forked child and in an atexit handler.
    The parts' decoding is a stand-in (no framework in the forked child: only the pool is under test)."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    from transduce.runtime.decoding import offline as decoding

    def one(backend, src_ids, src_lengths, options, search, keys, prefixes=None):  # a sentence's result: its first id
        return src_ids[:, 0].tolist()

    monkeypatch.setattr(decoding, "_decode_one", one)
    parts, src, lens = [object(), object()], np.arange(5)[:, None], np.ones(5, np.int64)
    assert decoding._decode_in_parts(parts, src, lens, None, "auto", np.arange(5)) == [0, 1, 2, 3, 4]  # pool made
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        signal.alarm(30)  # a hang shows as a failed status, not a stuck suite
        try:
            os._exit(0 if decoding._decode_in_parts(parts, src, lens, None, "auto", np.arange(5)) == [0, 1, 2, 3, 4]
                     else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert status == 0, f"child status {status}"

    script = textwrap.dedent("""
        import atexit
        import numpy as np
        from transduce.runtime.decoding import offline as decoding
        def one(backend, src_ids, src_lengths, options, search, keys, prefixes=None):
            return src_ids[:, 0].tolist()
        decoding._decode_one = one
        def at_exit():
            print(decoding._decode_in_parts([None, None], np.arange(4)[:, None], np.ones(4, np.int64), None, "auto",
                                            np.arange(4)))
        atexit.register(at_exit)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[0, 1, 2, 3]", out.stderr


def test_model_warnings_name_what_the_model_cannot_honour():
    """A beam wider than the vocabulary; a min_length past the maximum length of every sentence, or of the
    shortest ones (counted exactly as max_lengths counts); nothing for the defaults or forced()."""
    assert DecodingOptions().model_warnings(200, 64) == []
    [(says, params)] = DecodingOptions(beam_size=300).model_warnings(200, 64)
    assert says.startswith("beam_size 300 is wider than the vocabulary (200 tokens)") and params == ("beam_size",)
    [(says, params)] = DecodingOptions(min_length=1000).model_warnings(200, 64)
    assert says == ("min_length 1000 is more than any sentence's maximum length (1 x source tokens + 50, at most "
                    "64): every translation is cut there, unfinished") and params == ("min_length",)
    # 1 x n + 50 >= 55 from n = 5 source tokens on
    [(says, _)] = DecodingOptions(min_length=55).model_warnings(200, 256)
    assert "the maximum length of sentences of up to 4 source tokens (1 x source tokens + 50, at most 256)" in says
    assert DecodingOptions(min_length=51).model_warnings(200, 256) == []
    # forced(): EOS banned to the end on purpose; the warning says so (the bench calls decode(), which gives none)
    assert "every translation is cut there" in DecodingOptions.forced(5).model_warnings(200, 64)[0][0]


def test_id_lists_pad_into_one_batch_with_their_lead_and_end():
    """The one padding helper: sources get their EOS, teacher-forced targets their BOS; lengths count them."""
    from transduce.runtime.decoding.batch import pad_ids

    ids, lens = pad_ids([[5, 6], [7], []], 0, end=2)
    assert ids.tolist() == [[5, 6, 2], [7, 2, 0], [2, 0, 0]] and lens.tolist() == [3, 2, 1] and ids.dtype == np.int64
    ids, lens = pad_ids([[5, 6], []], 9, lead=1)
    assert ids.tolist() == [[1, 5, 6], [1, 9, 9]] and lens.tolist() == [3, 1]
    ids, lens = pad_ids([[], []], 0)
    assert ids.shape == (2, 1) and lens.tolist() == [0, 0]  # at least one column


def test_max_lengths_of_a_few_sentences_equal_those_of_many():
    """The few-sentence path (Python floats) gives what the array path gives, at awkward a and b."""
    from transduce.runtime.decoding import max_lengths

    rng = np.random.default_rng(0)
    for a in (0.0, 1.0, 1.1, 1.3, 2.7, 1e300):
        for b in (0, 5, 50, 10**9):
            opts = DecodingOptions(max_len_a=a, max_len_b=b)
            lens = rng.integers(1, 300, 3)
            for positions in (16, 256):
                many = max_lengths(np.concatenate([lens] * 3), opts, positions)[:3]
                assert max_lengths(lens, opts, positions).tolist() == many.tolist()


def test_options_made_once_still_refuse_what_equals_a_valid_value():
    """DecodingOptions.of keeps the options it made; True (== 1) and 4.0 (== 4) are still refused after 1 and 4
    were made, and an unhashable value gets its own message."""
    assert DecodingOptions.of({"beam_size": 4}, "t()") is DecodingOptions.of({"beam_size": 4}, "t()")
    DecodingOptions.of({"beam_size": 1}, "t()")
    for bad in (True, 4.0, [4]):
        with pytest.raises(InputError, match="beam_size must be an integer"):
            DecodingOptions.of({"beam_size": bad}, "t()")
    DecodingOptions.of({"suppress": ((1,),)}, "t()")
    for bad in (((True,),), ((1.0,),)):  # equal to ((1,),) as Python compares them
        with pytest.raises(InputError, match="each sequence is a non-blank text"):
            DecodingOptions.of({"suppress": bad}, "t()")
    with pytest.raises(TypeError, match="t\\(\\) got unexpected option\\(s\\) beem"):
        DecodingOptions.of({"beem": 4}, "t()")
