"""Target prefixes (decode's `prefixes`, translate(prefixes=), --prefix, the server's "prefix"): decoding is
forced through each sentence's prefix, then searches on; checked against teacher forcing over the prefix and a
greedy search written here from the model's full log-probs, on every backend and step graph, and in batches
whose sentences are at different forced lengths."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from tests.conftest import random_sources
from transduce.cli import main
from transduce.errors import InputError
from transduce.formats import contract
from transduce.runtime.api import load
from transduce.runtime.backends.base import only_step_graph
from transduce.runtime.backends.topk import banned_ids
from transduce.runtime.backends.torch_backend import TorchBackend
from transduce.runtime.decoding import DecodingOptions, decode, max_lengths, teacher_forced_log_probs

TEXTS = ["one two three", "four hundred and five", "twelve", "seven thousand and one", "nine"]


def _batch(cfg, n, seed):
    """Random sources and prefixes of 0-4 tokens (none for the first sentence)."""
    src, lens, rng = random_sources(cfg, n, seed)
    prefixes = [rng.integers(4, cfg.vocab_size, int(p)).tolist() for p in rng.integers(0, 5, n)]
    prefixes[0] = []
    return src, lens, prefixes


def reference_greedy(model, src, length, prefix, opts) -> tuple[list[int], list[float]]:
    """Greedy search from the definition: the prefix's tokens first, then each step's best non-banned token
    of the full forward pass over everything so far, until EOS or the maximum length."""
    cfg = model.cfg
    ref = TorchBackend(model)
    max_len = int(max_lengths(np.array([length]), opts, cfg.max_positions)[0])
    toks, lps = [], []
    for t in range(max_len):
        lp = teacher_forced_log_probs(ref, src[None, :length], np.array([length]),
                                      np.array([[cfg.bos_id, *toks]]))[0, -1]
        if t < len(prefix):
            tok = prefix[t]
        else:
            allowed = lp.copy()
            allowed[banned_ids(cfg, t + 1 < opts.min_length)] = -np.inf
            tok = int(allowed.argmax())
        toks.append(tok)
        lps.append(float(lp[tok]))
        if tok == cfg.eos_id:
            break
    return toks, lps


@pytest.mark.parametrize("name", ["torch", "onnxruntime", "onnxruntime-standard"])
def test_greedy_goes_through_each_prefix_then_searches_on(tiny_model, tiny_artifact_dir, name):
    backend = TorchBackend(tiny_model) if name == "torch" else load(tiny_artifact_dir, threads=1).backend
    cfg = backend.config
    src, lens, prefixes = _batch(cfg, 6, seed=1)
    opts = DecodingOptions(beam_size=1, max_len_b=9, min_length=3)
    with only_step_graph(backend, contract.STEP_FILE if name.endswith("standard") else None):
        results = decode(backend, src, lens, opts, prefixes=prefixes)
    for i, r in enumerate(results):
        toks, lps = reference_greedy(tiny_model, src[i], int(lens[i]), prefixes[i], opts)
        got = list(r.best.tokens) + ([cfg.eos_id] if r.best.finished else [])
        assert got == toks, i
        np.testing.assert_allclose(r.best.token_log_probs, lps, atol=1e-4)
        assert r.best.log_prob == pytest.approx(sum(lps), abs=1e-3)


@pytest.mark.parametrize("beam", [1, 3])
def test_a_sentences_prefixed_decode_is_the_same_in_any_batch(tiny_artifact_dir, beam):
    """Sentences at different forced lengths side by side (some without a prefix) decode as each does alone;
    every hypothesis begins with its prefix; beam search's n-best are distinct."""
    backend = load(tiny_artifact_dir, threads=1).backend
    src, lens, prefixes = _batch(backend.config, 7, seed=2)
    opts = DecodingOptions(beam_size=beam, nbest=beam, max_len_b=8)
    together = decode(backend, src, lens, opts, prefixes=prefixes)
    for i, r in enumerate(together):
        alone = decode(backend, src[i: i + 1, : lens[i]], lens[i: i + 1], opts, prefixes=[prefixes[i]])[0]
        assert [h.tokens for h in r.hypotheses] == [h.tokens for h in alone.hypotheses]
        assert all(list(h.tokens[: len(prefixes[i])]) == prefixes[i] for h in r.hypotheses)
        assert len({h.tokens for h in r.hypotheses}) == len(r.hypotheses)


def test_beam_outputs_with_a_prefix_score_as_teacher_forcing_does(demo_artifact_dir):
    """The trained demo model, beam 4: each finished hypothesis's log_prob (prefix included) is its
    teacher-forced score; the text begins with the prefix."""
    tr = load(demo_artifact_dir, threads=1)
    plain = tr.translate(TEXTS, beam_size=1)
    prefixes = [" ".join(t.text.split()[:1]) for t in plain]
    out = tr.translate(TEXTS, beam_size=4, nbest=2, prefixes=prefixes)
    for t, p in zip(out, prefixes, strict=True):
        assert t.text.startswith(p)
        finished = [c for c in t.nbest if c.finished]
        scores = tr.score([TEXTS[out.index(t)]] * len(finished), [c.text for c in finished])
        for c, s in zip(finished, scores, strict=True):
            assert s.log_prob == pytest.approx(c.log_prob, abs=1e-4)


def test_bad_prefixes_are_refused_naming_the_sentence(tiny_artifact_dir):
    tr = load(tiny_artifact_dir, threads=1)
    for prefixes, says in [
        (["\u2603\u2603"] + [None] * 4, "the prefix of sentence 1 has characters the tokenizer does not know"),
        ([None, [tr.config.eos_id]] + [None] * 3, "the prefix of sentence 2 has token id 2, which is special"),
        ([None, None, [10**6], None, None], "outside the vocabulary"),
        ([None, None, None, "two " * 80, None], "the prefix of sentence 4 has 80 tokens, more than its maximum"),
        ([None, None, None, None, 3.5], "the prefix of sentence 5 is float"),
        ([None], "prefixes has 1 prefixes for 5 sentences"),
        ("two", "prefixes must be a list"),
        ({"two": 1}, "prefixes must be a list .*, got dict"),
        ({"two"}, "prefixes must be a list .*, got set"),
    ]:
        with pytest.raises(InputError, match=says):
            tr.translate(TEXTS, beam_size=2, prefixes=prefixes)
    as_ids = [None, np.array([5, 6]), [np.int64(7)], None, None]
    assert [t.tokens[:2] for t in tr.translate(TEXTS, beam_size=1, max_len_b=4, prefixes=as_ids)][1:3] == \
        [(5, 6), (7,) + tr.translate([TEXTS[2]], beam_size=1, max_len_b=4, prefixes=[[7]])[0].tokens[1:2]]
    for prefixes, says in (([None] * 3, "prefixes has 3 entries: text 4 has none"),
                           ([None] * 7, "prefixes has 7 entries for 5 texts")):
        with pytest.raises(InputError, match=says):
            list(tr.translate_stream(TEXTS, 2, beam_size=1, max_len_b=4, prefixes=prefixes))
    with pytest.raises(InputError, match="prefixes must be a list .*, got generator"):
        tr.translate_stream(TEXTS, 2, prefixes=(p for p in [None] * 5))


def test_decode_command_takes_a_prefix_file(tiny_artifact_dir, tmp_path):
    tr = load(tiny_artifact_dir, threads=1)
    prefixes = ["two", "", "three four", "", ""]
    want = [t.text for t in tr.translate(TEXTS, beam_size=2, max_len_b=6, prefixes=prefixes)]
    (tmp_path / "in").write_text("".join(t + "\n" for t in TEXTS))
    (tmp_path / "pre").write_text("".join(p + "\n" for p in prefixes))
    r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--input", str(tmp_path / "in"), "--prefix",
                                  str(tmp_path / "pre"), "--beam-size", "2", "--max-len-b", "6"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == want
    (tmp_path / "pre").write_text("two\n")
    r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--input", str(tmp_path / "in"), "--prefix",
                                  str(tmp_path / "pre")])
    assert r.exit_code == 2 and "--prefix has 1 lines and the input 5" in r.stderr


@pytest.mark.parametrize("name", ["torch", "onnxruntime"])
@pytest.mark.parametrize("beam", [1, 3])
def test_forced_eos_ends_every_hypothesis_at_the_maximum_length(tiny_model, tiny_artifact_dir, name, beam):
    """Without forced_eos, hypotheses that reach the maximum length are cut there unfinished (that many tokens);
    with it every hypothesis is finished, those at the maximum length by an EOS (one token fewer) counted at
    log-prob 0, as Hugging Face's forced_eos_token_id counts it; greedy search (which never ends by itself on the
    tiny random model) keeps the tokens before it. The same with prefixes, and in any batch."""
    backend = TorchBackend(tiny_model) if name == "torch" else load(tiny_artifact_dir, threads=1).backend
    src, lens, prefixes = _batch(backend.config, 5, seed=5)
    base = dict(beam_size=beam, nbest=beam, max_len_a=0.0, max_len_b=6)
    cut = decode(backend, src, lens, DecodingOptions(**base), prefixes=prefixes)
    ended = decode(backend, src, lens, DecodingOptions(**base, forced_eos=True), prefixes=prefixes)
    assert all(len(h.tokens) == 6 for r in cut for h in r.hypotheses if not h.finished)
    assert any(not h.finished for r in cut for h in r.hypotheses)
    for c, e in zip(cut, ended, strict=True):
        assert all(h.finished for h in e.hypotheses)
        for h in e.hypotheses:
            if len(h.tokens) == 5:  # ended at the maximum length: EOS forced, at 0
                assert h.token_log_probs[-1] == 0.0
            assert h.log_prob == pytest.approx(sum(h.token_log_probs), abs=1e-4)
        if beam == 1:  # greedy never ends by itself here: the same tokens, then EOS
            assert len(e.best.tokens) == 5 and e.best.tokens == c.best.tokens[:5]
    alone = [decode(backend, src[i: i + 1, : lens[i]], lens[i: i + 1], DecodingOptions(**base, forced_eos=True),
                    prefixes=[prefixes[i]])[0] for i in range(5)]
    assert [[h.tokens for h in r.hypotheses] for r in alone] == [[h.tokens for h in r.hypotheses] for r in ended]
    with pytest.raises(InputError, match="forced_eos must be true or false"):
        DecodingOptions(forced_eos="yes")
