"""Random sampling (DecodingOptions.sampling_*, seed) against its definition: a sampler written here from the
model's full log-probs (teacher forcing over the sampled prefix) must draw what decoding drew, on every
backend; draws follow the tempered, cut distribution; a sentence's sample does not depend on its batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.conftest import random_sources
from transduce.errors import InputError
from transduce.formats import contract
from transduce.runtime.api import make_backend
from transduce.runtime.backends.topk import banned_ids
from transduce.runtime.backends.torch_backend import TorchBackend
from transduce.runtime.decoding import DecodingOptions, decode, sampling, teacher_forced_log_probs


def _sources(cfg, n, seed):
    src, lens, _ = random_sources(cfg, n, seed, high=9)
    return src, lens


def reference_draw(log_probs: np.ndarray, opts: DecodingOptions, u: float, banned: list[int]) -> int:
    """The token the definition draws from one step's full log-probs with the uniform u: the top-k (k =
    sampling_topk, 0 = all) at the temperature, the fewest best whose probabilities reach top-p, renormalised,
    then the first whose cumulative probability passes u."""
    lp = log_probs.astype(np.float64).copy()
    lp[banned] = -np.inf
    order = np.argsort(-lp, kind="stable")
    if opts.sampling_topk:
        order = order[: opts.sampling_topk]
    p = np.exp(lp[order] / opts.sampling_temperature - np.max(lp[order] / opts.sampling_temperature))
    p /= p.sum()
    kept, total = [], 0.0
    for i, q in zip(order, p, strict=True):
        if total >= opts.sampling_topp:
            break
        kept.append((i, q))
        total += q
    cum = np.cumsum([q for _, q in kept])
    return int(kept[int(np.searchsorted(cum, u * cum[-1], side="right"))][0])


@pytest.fixture(scope="module")
def backends(tiny_model, tiny_artifact_dir):
    ort = make_backend(tiny_artifact_dir, "onnxruntime")
    return {"torch": TorchBackend(tiny_model), "onnxruntime": ort}


@pytest.mark.parametrize("name", ["torch", "onnxruntime", "onnxruntime-standard"])
@pytest.mark.parametrize("given", [dict(sampling_topk=0), dict(sampling_topk=5, sampling_temperature=0.7),
                                   dict(sampling_topk=0, sampling_topp=0.6, sampling_temperature=1.5, seed=9)])
def test_each_sampled_token_is_the_definitions_draw(backends, tiny_model, name, given):
    """Every token decoding drew is the token reference_draw picks from the full log-probs of the prefix
    drawn so far, with the same uniform; scores are the model's log-probs of the drawn tokens."""
    from transduce.runtime.backends.base import only_step_graph

    backend = backends[name.split("-")[0]]
    cfg = backend.config
    opts = DecodingOptions(beam_size=1, max_len_b=6, min_length=2, **given)
    src, lens = _sources(cfg, 5, seed=3)
    keys = np.array([4, 0, 7, 1, 2])
    graph = contract.STEP_FILE if name.endswith("standard") else None
    with only_step_graph(backend, graph):
        results = decode(backend, src, lens, opts, keys=keys)
    ref = TorchBackend(tiny_model)
    for i, r in enumerate(results):
        h = r.best
        toks = list(h.tokens) + ([cfg.eos_id] if h.finished else [])
        tgt_in = np.array([[cfg.bos_id, *toks[:-1]]])
        lp = teacher_forced_log_probs(ref, src[i: i + 1], lens[i: i + 1], tgt_in)[0]
        for t, tok in enumerate(toks):
            u = sampling.uniforms(opts.seed, keys[i: i + 1], t, 1)[0, 0]
            want = reference_draw(lp[t], opts, u, banned_ids(cfg, t + 1 < opts.min_length))
            assert tok == want, (i, t)
        np.testing.assert_allclose(h.token_log_probs, lp[np.arange(len(toks)), toks], atol=1e-4)


def test_draws_follow_the_tempered_cut_distribution():
    """20,000 draws of one row (different keys) land on each candidate in proportion to its probability at
    the temperature within top-p (total variation under 0.02); Gumbel-top-k's first draw likewise, and its
    draws are distinct candidates."""
    vals = np.log(np.array([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]]))
    opts = DecodingOptions(beam_size=1, sampling_topk=0, sampling_topp=0.85, sampling_temperature=0.8)
    tempered = np.exp(vals[0] / 0.8) / np.exp(vals[0] / 0.8).sum()
    keep = int(np.searchsorted(np.cumsum(tempered), 0.85) + 1)  # the fewest best reaching 0.85
    p = np.r_[tempered[:keep], np.zeros(6 - keep)]
    p /= p.sum()
    n = 20_000
    keys = np.arange(n)
    u = sampling.uniforms(5, keys, 3, 6)
    one = sampling.draw_one(np.repeat(vals, n, 0), opts, u[:, 0])
    many = sampling.draw_many(np.repeat(vals, n, 0), opts, u, 3)
    for got in (one, many[:, 0]):
        freq = np.bincount(got, minlength=6) / n
        assert 0.5 * np.abs(freq - p).sum() < 0.02, (freq, p)
    assert (np.sort(many, axis=1)[:, 1:] != np.sort(many, axis=1)[:, :-1]).all()


def test_uniforms_depend_on_seed_key_step_and_lane_only():
    a = sampling.uniforms(3, np.array([5, 9]), 4, 3)
    assert a.shape == (2, 3) and ((a > 0) & (a < 1)).all()
    np.testing.assert_array_equal(a[1], sampling.uniforms(3, np.array([9]), 4, 3)[0])  # whatever is beside it
    for other in (sampling.uniforms(4, np.array([5, 9]), 4, 3), sampling.uniforms(3, np.array([5, 9]), 5, 3),
                  sampling.uniforms(3, np.array([6, 10]), 4, 3)):
        assert not np.isin(a, other).any()
    big = sampling.uniforms(0, np.arange(50_000), 0, 1)[:, 0]
    assert abs(big.mean() - 0.5) < 0.01 and abs(np.quantile(big, 0.1) - 0.1) < 0.01


@pytest.mark.parametrize("beam", [1, 4])
def test_a_sentences_sample_is_the_same_in_any_batch_and_on_every_backend(backends, beam):
    """Decoded together, in another order, or alone, each sentence (by its key) gets the same sample, on torch
    and on ONNX Runtime; another seed gives other samples; beam search's sampled candidates give distinct
    n-best hypotheses."""
    cfg = backends["torch"].config
    opts = DecodingOptions(beam_size=beam, nbest=beam, max_len_b=8, sampling_topk=0, sampling_temperature=1.3)
    src, lens = _sources(cfg, 6, seed=4)
    keys = np.arange(10, 16)

    def tokens(results):
        return [[h.tokens for h in r.hypotheses] for r in results]

    together = tokens(decode(backends["torch"], src, lens, opts, keys=keys))
    flipped = tokens(decode(backends["torch"], src[::-1], lens[::-1], opts, keys=keys[::-1]))[::-1]
    alone = [tokens(decode(backends["torch"], src[i: i + 1, : lens[i]], lens[i: i + 1], opts, keys=keys[i: i + 1]))[0]
             for i in range(6)]
    assert together == flipped == alone
    assert tokens(decode(backends["onnxruntime"], src, lens, opts, keys=keys)) == together
    other = tokens(decode(backends["torch"], src, lens, dataclasses.replace(opts, seed=1), keys=keys))
    assert other != together
    if beam > 1:
        assert all(len(set(hyps)) == len(hyps) for hyps in together)


def test_translate_keys_a_sentence_by_its_line(tiny_artifact_dir):
    """translate() draws for each text by its number in the input: a text translated with others, or alone at
    its line number (first_line), or through translate_stream in chunks, gets the same sample."""
    from transduce.runtime.api import load

    tr = load(tiny_artifact_dir)
    texts = ["the cat sat", "a dog", "", "the house is red and the cat is black"]
    kw = dict(beam_size=1, sampling_topk=0, sampling_temperature=1.5, seed=3, max_len_b=8)
    whole = [t.text for t in tr.translate(texts, **kw)]
    alone = [tr.translate([t], first_line=i + 1, **kw)[0].text for i, t in enumerate(texts)]
    streamed = [t.text for t in tr.translate_stream(texts, chunk_lines=1, **kw)]
    assert whole == alone == streamed


@pytest.mark.parametrize("given, match", [
    (dict(sampling_topk=-1), "sampling_topk must be >= 0"),
    (dict(sampling_topk=0, sampling_topp=0.0), r"sampling_topp must be in \(0, 1\]"),
    (dict(sampling_topk=0, sampling_topp=1.5), r"sampling_topp must be in \(0, 1\]"),
    (dict(sampling_topk=0, sampling_temperature=-1.0), "sampling_temperature must be > 0"),
    (dict(sampling_topk=0, sampling_temperature=float("inf")), "sampling_temperature must be a finite number"),
    (dict(sampling_topp=0.9), "sampling_topp applies to sampling, which is off"),
    (dict(sampling_temperature=0.5), "sampling_temperature applies to sampling, which is off"),
    (dict(sampling_topk=0, seed=-1), "seed must be in 0"),
    (dict(sampling_topk=0, seed=1.5), "seed must be an integer"),
])
def test_bad_sampling_options_are_refused_naming_the_option(given, match):
    with pytest.raises(InputError, match=match):
        DecodingOptions(**given)
