"""Repetition control (no_repeat_ngram_size, repetition_penalty) against brute-force definitions, on every
backend and step graph and in a running batch beside cohorts without it; max_input_length."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from tests.conftest import random_sources
from transduce.errors import InputError
from transduce.formats import contract
from transduce.runtime.api import load
from transduce.runtime.backends.base import only_step_graph
from transduce.runtime.backends.topk import banned_ids
from transduce.runtime.backends.torch_backend import TorchBackend
from transduce.runtime.decoding import DecodingOptions, decode, max_lengths, teacher_forced_log_probs
from transduce.runtime.decoding.repetition import adjusted
from transduce.runtime.decoding.running import RunningBatch


def _sources(cfg, n, seed):
    src, lens, _ = random_sources(cfg, n, seed, high=8)
    return src, lens


def _ngrams(tokens, n):
    return [tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)]


def test_adjusted_bans_what_would_repeat_an_ngram_and_penalises_seen_tokens():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3):
        for _ in range(50):
            history = rng.integers(0, 6, (4, int(rng.integers(0, 9))))
            lp = np.log(rng.dirichlet(np.ones(8), 4)).astype(np.float32)
            suppress = ((7,), (3, 5), (1, 2, 4))
            got = adjusted(lp, history, DecodingOptions(no_repeat_ngram_size=n, repetition_penalty=1.5,
                                                        suppress=suppress))
            for r in range(4):
                h = history[r].tolist()
                for w in range(8):
                    want = lp[r, w] * np.float32(1.5) if w in h else lp[r, w]
                    if len(h) >= n - 1 and tuple(h[len(h) - n + 1:] + [w]) in _ngrams(h, n):
                        want = -np.inf
                    if any(tuple(h[len(h) - len(q) + 1:] + [w]) == q for q in suppress if len(h) >= len(q) - 1):
                        want = -np.inf  # whatever the penalty would make of it
                    assert got[r, w] == want, (n, h, w)


@pytest.mark.parametrize("name", ["torch", "onnxruntime", "onnxruntime-standard"])
@pytest.mark.parametrize("beam", [1, 3])
def test_no_output_repeats_an_ngram(tiny_model, tiny_artifact_dir, name, beam):
    """The tiny random model repeats tokens freely; with no_repeat_ngram_size 2 no hypothesis holds a bigram
    twice, with 1 no token twice (EOS aside), whatever the backend."""
    backend = TorchBackend(tiny_model) if name == "torch" else load(tiny_artifact_dir, threads=1).backend
    src, lens = _sources(backend.config, 5, seed=1)
    free = decode(backend, src, lens, DecodingOptions(beam_size=beam, max_len_b=12))
    assert any(len(set(_ngrams(r.best.tokens, 2))) < len(_ngrams(r.best.tokens, 2)) for r in free)  # it does repeat
    for n in (1, 2):
        opts = DecodingOptions(beam_size=beam, nbest=beam, max_len_b=12, no_repeat_ngram_size=n)
        with only_step_graph(backend, contract.STEP_FILE if name.endswith("standard") else None):
            results = decode(backend, src, lens, opts)
        for r in results:
            for h in r.hypotheses:
                assert len(set(_ngrams(h.tokens, n))) == len(_ngrams(h.tokens, n)), (n, h.tokens)


def test_greedy_with_a_repetition_penalty_is_the_definitions(tiny_model):
    """Each step takes the best token of the full log-probs with those of the tokens already output multiplied
    by the penalty; the reported log-probs are the adjusted ones."""
    backend = TorchBackend(tiny_model)
    cfg = backend.config
    src, lens = _sources(cfg, 4, seed=2)
    opts = DecodingOptions(beam_size=1, max_len_b=10, repetition_penalty=1.8)
    for i, r in enumerate(decode(backend, src, lens, opts)):
        toks, lps = [], []
        for _ in range(int(max_lengths(lens[i: i + 1], opts, cfg.max_positions)[0])):
            lp = teacher_forced_log_probs(backend, src[i: i + 1], lens[i: i + 1], np.array([[cfg.bos_id, *toks]]))
            lp = lp[0, -1].astype(np.float32)
            lp[toks] = lp[toks] * np.float32(1.8)
            lp[banned_ids(cfg, False)] = -np.inf
            toks.append(int(lp.argmax()))
            lps.append(float(lp[toks[-1]]))
            if toks[-1] == cfg.eos_id:
                break
        assert list(r.best.tokens) + ([cfg.eos_id] if r.best.finished else []) == toks
        np.testing.assert_allclose(r.best.token_log_probs, lps, atol=1e-4)


def test_a_cohort_that_adjusts_beside_one_that_does_not_decodes_as_alone(tiny_artifact_dir, monkeypatch):
    """Each cohort decodes as alone; the step stays the backend's own (its top-k for the cohort that takes it as
    is, its last full log-probs for the one that adjusts): no step_log_probs, whose host top-k breaks ties its own
    way."""
    backend = load(tiny_artifact_dir, threads=1).backend
    monkeypatch.setattr(backend, "step_log_probs", lambda *a: pytest.fail("a second kind of step"))
    src, lens = _sources(backend.config, 6, seed=3)
    plain, ngram = DecodingOptions(beam_size=2, max_len_b=10), DecodingOptions(beam_size=1, max_len_b=10,
                                                                               no_repeat_ngram_size=2)
    batch = RunningBatch(backend, capacity=backend.config.max_positions)
    a = batch.admit(src[:3], lens[:3], plain)
    batch.step()
    b = batch.admit(src[3:], lens[3:], ngram)
    out = batch.run_until_empty()
    for cohort, (s, n, opts) in ((a, (src[:3], lens[:3], plain)), (b, (src[3:], lens[3:], ngram))):
        got = [r.best.tokens for _, r in sorted(out[cohort], key=lambda x: x[0])]
        assert got == [r.best.tokens for r in decode(backend, s, n, opts)]


def test_max_input_length_refuses_or_cuts_longer_sources(tiny_artifact_dir):
    tr = load(tiny_artifact_dir, threads=1)
    with pytest.raises(InputError, match="input line 2 has .* tokens; max_input_length is 2"):
        tr.translate(["one", "four hundred and five"], max_input_length=2)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        cut = tr.translate(["one", "four hundred and five"], max_input_length=2, truncate=True, beam_size=1)
    assert not cut[0].truncated and cut[1].truncated and cut[1].source_tokens == 2


@pytest.mark.parametrize("given, says", [(dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be >= 0"),
                                         (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
                                         (dict(repetition_penalty=float("nan")), "must be a finite number"),
                                         (dict(max_input_length=-1), "max_input_length must be >= 0")])
def test_bad_repetition_options_are_refused(given, says):
    with pytest.raises(InputError, match=says):
        DecodingOptions(**given)


def _holds(tokens, seq) -> bool:
    return any(tuple(tokens[i: i + len(seq)]) == tuple(seq) for i in range(len(tokens) - len(seq) + 1))


@pytest.mark.parametrize("name", ["torch", "onnxruntime"])
@pytest.mark.parametrize("beam", [1, 3])
def test_suppressed_sequences_never_appear(tiny_model, tiny_artifact_dir, name, beam):
    """The sequences the free decode produced most (a token, a bigram) appear in no hypothesis once suppressed,
    given as token ids or as text; the rest of the vocabulary stays free."""
    tr = load(tiny_artifact_dir, backend=name, threads=1)
    texts = ["one two three", "four hundred and five", "twelve", "seven thousand and one"]
    free = tr.translate(texts, beam_size=beam, max_len_b=10)
    tokens = [t for r in free for t in r.tokens]
    top = max(set(tokens), key=tokens.count)
    bigrams = [b for r in free for b in _ngrams(r.tokens, 2) if top not in b]
    assert bigrams, "the free decode has no bigram to suppress"
    pair = max(set(bigrams), key=bigrams.count)
    out = tr.translate(texts, beam_size=beam, nbest=beam, max_len_b=10, suppress=[[top], list(pair)])
    assert not any(top in c.tokens or _holds(c.tokens, pair) for r in out for c in r.nbest)
    # as text: the most produced token whose text tokenizes back to it (a piece inside a word may not)
    spelt = [t for t in sorted(set(tokens), key=tokens.count, reverse=True)
             if tr.tokenizer.encode_target(tr.tokenizer.decode([t])) == [t]]
    assert spelt
    out = tr.translate(texts, beam_size=beam, max_len_b=10, suppress=[tr.tokenizer.decode([spelt[0]])])
    assert not any(spelt[0] in r.tokens for r in out)


def test_bad_suppress_values_are_refused_naming_it(tiny_artifact_dir):
    tr = load(tiny_artifact_dir, threads=1)
    for bad, says in (("the", "suppress must be a list of sequences"), ([""], "each sequence is a non-blank text"),
                      ([[]], "each sequence is a non-blank text"), ([[10**6]], "is no token sequence"),
                      (["\u2603"], "has characters the tokenizer does not know")):
        with pytest.raises(InputError, match=says) as e:
            tr.translate(["one"], suppress=bad)
        assert e.value.params == ("suppress",)
