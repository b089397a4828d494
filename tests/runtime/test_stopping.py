"""Beam search's stopping rules (DecodingOptions.early_stopping) against their definitions: a plain, one
sentence at a time beam search written from offline.py's docstring, stepping the model's full forward pass
over each prefix, gives the hypotheses, scores and step counts that the vectorised search must give."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transduce.errors import InputError
from transduce.models.config import ModelConfig
from transduce.models.transformer import Transformer
from transduce.runtime.backends.topk import banned_ids
from transduce.runtime.backends.torch_backend import TorchBackend
from transduce.runtime.decoding import DecodingOptions, decode
from transduce.runtime.decoding.options import EARLY_STOPPING, max_lengths


@pytest.fixture(scope="module")
def eos_prone():
    """A vocabulary of 10 with sharpened embeddings: EOS competes with the words at every step, so the rules
    stop at different steps."""
    torch.manual_seed(2)
    cfg = ModelConfig(vocab_size=10, encoder_layers=1, decoder_layers=2, d_model=16, n_heads=2, d_ff=32,
                      dropout=0.0, max_positions=24)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.embed.weight.mul_(2.0)
    return model


class Counting(TorchBackend):
    """The torch backend, counting its decoder steps."""

    steps = 0

    def step(self, state, tokens, k, ban_eos=False):
        self.steps += 1
        return super().step(state, tokens, k, ban_eos)


def reference(model, src: list[int], opts: DecodingOptions) -> tuple[list[tuple], int]:
    """The k-beam search of the docstring for one sentence -> (score, tokens, finished) best first (nbest of
    them), and the steps it took."""
    cfg = model.cfg
    k, kk = opts.beam_size, min(2 * opts.beam_size, cfg.vocab_size)
    max_len = int(max_lengths(np.array([len(src)]), opts, cfg.max_positions)[0])
    src_t, lens = torch.tensor([src]), torch.tensor([len(src)])
    beams: list[tuple[tuple[int, ...], float]] = [((), 0.0)]  # (tokens, raw score)
    final: list[tuple[float, tuple[int, ...], bool]] = []
    for t in range(max_len):
        cands = []
        for toks, raw in beams:
            with torch.no_grad():
                lp = torch.log_softmax(model(src_t, lens, torch.tensor([[cfg.bos_id, *toks]])), -1)[0, -1].double()
            for b in banned_ids(cfg, t + 1 < opts.min_length):
                lp[b] = -np.inf
            vals, ids = lp.topk(kk)
            cands += [(raw + v, toks, j) for v, j in zip(vals.tolist(), ids.tolist(), strict=True)]
        cands.sort(key=lambda c: -c[0])  # stable: beam order, then rank, among equal scores
        for raw, toks, j in cands[:k]:
            if j == cfg.eos_id and np.isfinite(raw):
                final.append((raw / opts.penalty(t + 1), toks, True))
        beams = [(toks + (j,), raw) for raw, toks, j in cands if j != cfg.eos_id][:k]
        if t + 1 == max_len:
            final += [(raw / opts.penalty(t + 1), toks, False) for toks, raw in beams if np.isfinite(raw)]
            break
        best_live = beams[0][1]
        kth = sorted((f[0] for f in final), reverse=True)[k - 1] if len(final) >= k else None
        if opts.early_stopping == "k-finished" and len(final) >= opts.finished_needed:
            break
        if opts.early_stopping == "heuristic" and kth is not None and best_live / opts.penalty(t + 1) <= kth:
            break
        if opts.early_stopping == "exact" and kth is not None and best_live / opts.penalty(max_len) <= kth:
            break
    final.sort(key=lambda f: (-f[0], not f[2]))
    return final[: opts.nbest], t + 1


SOURCES = [[4, 5, 6, 2], [7, 2], [8, 4, 9, 5, 6, 7, 2], [5, 5, 2], [9, 8, 7, 6, 2]]
CASES = [dict(beam_size=2), dict(beam_size=4, nbest=2), dict(beam_size=3, length_penalty=1.0,
                                                                length_penalty_form="plain"),
         dict(beam_size=4, length_penalty=0.0, length_penalty_form="none", patience=2.0),
         dict(beam_size=4, min_length=3, patience=0.5)]


@pytest.mark.parametrize("rule", EARLY_STOPPING)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_rule_decodes_as_its_definition(eos_prone, rule, case):
    opts = DecodingOptions(max_len_a=0.5, max_len_b=8, early_stopping=rule, **CASES[case])
    for src in SOURCES:
        backend = Counting(eos_prone)
        got = decode(backend, np.array([src]), np.array([len(src)]), opts)[0]
        want, steps = reference(eos_prone, src, opts)
        assert [h.tokens for h in got.hypotheses] == [w[1] for w in want], (src, rule)
        assert [h.finished for h in got.hypotheses] == [w[2] for w in want]
        np.testing.assert_allclose([h.score for h in got.hypotheses], [w[0] for w in want], atol=1e-4)
        assert backend.steps == steps, (src, rule)


def test_the_rules_stop_at_different_steps_and_exact_never_scores_lower(eos_prone):
    """Not a vacuous comparison: on these sentences k-finished stops first and exact last, and exact's best
    is never below the others' (it returns the provably best k of its beam)."""
    steps = {}
    for rule in EARLY_STOPPING:
        opts = DecodingOptions(beam_size=4, max_len_a=0.5, max_len_b=8, early_stopping=rule)
        steps[rule] = [reference(eos_prone, src, opts)[1] for src in SOURCES]
        if rule == "exact":
            for src in SOURCES:
                exact = reference(eos_prone, src, opts)[0][0][0]
                for other in ("k-finished", "heuristic"):
                    o = DecodingOptions(beam_size=4, max_len_a=0.5, max_len_b=8, early_stopping=other)
                    assert reference(eos_prone, src, o)[0][0][0] <= exact + 1e-9
    assert sum(steps["k-finished"]) < sum(steps["heuristic"]) < sum(steps["exact"]), steps
    assert all(a <= b <= c for a, b, c in zip(steps["k-finished"], steps["heuristic"], steps["exact"], strict=True))


def test_a_batch_stops_each_sentence_by_its_own_rule(eos_prone):
    """Sentences decoded together give what each gives alone, under every rule."""
    src = np.zeros((len(SOURCES), max(map(len, SOURCES))), np.int64)
    for i, s in enumerate(SOURCES):
        src[i, : len(s)] = s
    lens = np.array([len(s) for s in SOURCES])
    for rule in EARLY_STOPPING:
        opts = DecodingOptions(beam_size=3, nbest=3, max_len_a=0.5, max_len_b=8, early_stopping=rule)
        together = decode(TorchBackend(eos_prone), src, lens, opts)
        for i, s in enumerate(SOURCES):
            alone = decode(TorchBackend(eos_prone), np.array([s]), np.array([len(s)]), opts)[0]
            assert [h.tokens for h in together[i].hypotheses] == [h.tokens for h in alone.hypotheses]


def test_stopping_options_are_checked():
    assert DecodingOptions().early_stopping == "heuristic"
    with pytest.raises(InputError, match="early_stopping must be one of heuristic, k-finished, exact, got 'never'"):
        DecodingOptions(early_stopping="never")
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(InputError, match="patience"):
            DecodingOptions(patience=bad)
    assert DecodingOptions(beam_size=4, patience=1.5).finished_needed == 6
    assert DecodingOptions(beam_size=1, patience=0.1).finished_needed == 1
