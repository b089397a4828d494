"""The parity library's judgement: error statistics, sequence scores, and divergences classified by the
reference model's own margin (greedy: the diverging step; beam search: whole-sequence scores)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from artifact_edits import perturb_one_weight
from click.testing import CliRunner

from transduce.cli import main
from transduce.errors import ArtifactError, InputError
from transduce.runtime.backends.torch_backend import TorchBackend
from transduce.runtime.decoding import DecodeResult, DecodingOptions, Hypothesis, decode
from transduce.runtime.spec import BackendSpec
from transduce.verify.parity import (
    ParityReport,
    _compare_sequences,
    _margin,
    error_stats,
    parity_for_artifact,
    run_parity,
)
from transduce.verify.tolerances import POLICIES, Tolerance

TOL = Tolerance(1e-4, 0.0)


def test_error_statistics():
    ref = np.linspace(-3.0, 0.0, 1000)
    got = ref.copy()
    got[::100] += 5e-5  # within atol
    s = error_stats("x", ref, got, TOL)
    assert s.passed and s.count == 1000 and math.isclose(s.max_abs, 5e-5, rel_tol=1e-6)
    assert math.isclose(s.mean_abs, 5e-5 * 10 / 1000, rel_tol=1e-6)
    assert s.p99_abs == pytest.approx(np.percentile(np.abs(got - ref), 99))
    got[3] += 1e-3
    assert error_stats("x", ref, got, TOL).failing == 1


def test_a_nan_fails_wherever_it_is_and_equal_infinities_match():
    ref = np.array([-1.0, -np.inf, -2.0])
    assert error_stats("x", ref, ref.copy(), TOL).passed  # -inf == -inf: a masked log-prob on both sides
    both = np.array([-1.0, np.nan, -2.0])
    s = error_stats("x", both, both.copy(), TOL)
    assert s.failing == 1 and s.max_abs == math.inf  # a reference that computes NaN checks nothing
    s = error_stats("x", ref, np.array([-1.0, -np.inf, np.nan]), TOL)
    assert s.failing == 1 and s.max_abs == math.inf  # not the 0.0 of the finite elements
    s = error_stats("x", np.array([np.nan, np.nan]), np.array([np.nan, np.nan]), TOL)
    assert s.failing == 2 and s.max_abs == math.inf


def _hyp(tokens, log_prob, finished=True, alpha=0.6):
    n = len(tokens) + (1 if finished else 0)
    penalty = DecodingOptions(length_penalty=alpha).penalty(n)
    return Hypothesis(tuple(tokens), log_prob / penalty, log_prob, (log_prob / n,) * n, finished)


def _check(ref_hyps, cand_hyps, policy="fp32", **kw):
    return _compare_sequences("beam4", None, [], [DecodeResult(tuple(ref_hyps))], [DecodeResult(tuple(cand_hyps))],
                              POLICIES[policy], {}, **kw)


def test_sequence_scores_are_held_to_the_tolerance_per_token():
    """A 40-token sentence may carry the per-token error a short one may: its log-prob sums differ by
    up to 40 x score_atol; more fails."""
    tokens = list(range(5, 45))
    ref = _hyp(tokens, -20.0)
    ok = _check([ref], [_hyp(tokens, -20.0 + 41 * 0.9e-4)])
    assert ok.passed and ok.max_token_score_diff == pytest.approx(0.9e-4) and ok.max_score_diff > 1e-4
    bad = _check([ref], [_hyp(tokens, -20.0 + 41 * 2e-4)])
    assert not bad.passed and bad.max_token_score_diff == pytest.approx(2e-4)


def test_a_nan_score_in_any_nbest_entry_fails():
    ref = [_hyp([5, 6], -1.0), _hyp([5, 7], -2.0)]
    for broken in (0, 1):
        cand = list(ref)
        cand[broken] = dataclasses.replace(cand[broken], score=math.nan, log_prob=math.nan)
        check = _check(ref, cand)
        assert check.identical == 1 and not check.passed and check.max_score_diff == math.inf, broken


def test_fewer_hypotheses_is_a_divergence_not_a_crash():
    ref = [_hyp([5, 6], -1.0), _hyp([5, 7], -2.0)]
    check = _check(ref, ref[:1])
    (d,) = check.divergences
    assert not check.passed and d.measure == "count" and d.rank == 1 and not d.near_tie
    assert "another number of hypotheses" in _printed(check)


def _printed(check) -> str:
    from rich.console import Console

    report = ParityReport("cand", "ref", "fp32", check.sentences, sequences=[check])
    console = Console(record=True, width=200)
    report.print(console)
    return console.export_text()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return TorchBackend.from_model_dir(tiny_model_dir)


def _sources(tokenizer, texts, eos):
    return [np.array(tokenizer.encode(t) + [eos], dtype=np.int64) for t in texts]


@pytest.mark.parametrize("options", [DecodingOptions(beam_size=4, nbest=2),
                                     DecodingOptions(beam_size=4, nbest=2, max_len_a=0.0, max_len_b=3)],
                         ids=["finished", "cut-at-max-length"])
def test_beam_divergences_are_judged_by_the_references_sequence_scores(reference, tiny_tokenizer, options):
    """A candidate whose best is the reference's second best: the margin is the difference of the two
    hypotheses' scores as the search computed them (the reference model re-scores both); near-tie or bug by
    tie_margin; a candidate better by the reference's own score is explained, and so is one that parts from
    the reference's at a near-tie (the step's log-prob gap within tie_margin), whatever the gap at the end."""
    eos = reference.config.eos_id
    judged = 0
    for src in _sources(tiny_tokenizer, ["three hundred and two", "seven", "forty-one thousand"], eos):
        (r,) = decode(reference, src[None], np.array([len(src)]), options)
        best, second = r.hypotheses
        if best.tokens == second.tokens:
            continue
        gap = best.score - second.score
        assert gap >= 0
        rows = [(src, len(src))]
        step = next((j for j, (x, y) in enumerate(zip(best.tokens, second.tokens, strict=False)) if x != y),
                    min(len(best.tokens), len(second.tokens)))
        token = [t[step] if step < len(t) else None for t in (best.tokens, second.tokens)]
        branch = abs(_margin(reference, src, len(src), best.tokens[:step], *token, reference.config.bos_id, eos))
        cases = [(gap + 1e-3, True, "sequence", gap), (min(gap, branch) / 2, False, "sequence", gap)]
        if branch < gap:  # a near-tie where the two branch explains a larger gap at the end
            cases.append(((branch + gap) / 2, True, "step", branch))
        for tie_margin, near_tie, measure, margin in cases:
            policy = dataclasses.replace(POLICIES["fp32"], tie_margin=tie_margin)
            check = _compare_sequences("beam4", reference, rows, [r], [DecodeResult((second, best))], policy,
                                       reference.config, options)
            (d,) = check.divergences
            assert d.measure == measure and d.rank == 0 and d.step == step
            assert abs(d.margin) == pytest.approx(margin, abs=1e-4)
            assert d.near_tie is near_tie and check.passed is False  # agreement 0 < 1.0 either way
        swapped = _compare_sequences("beam4", reference, rows, [DecodeResult((second,))], [DecodeResult((best,))],
                                     dataclasses.replace(POLICIES["fp32"], tie_margin=0.0), reference.config, options)
        (d,) = swapped.divergences
        assert d.margin == pytest.approx(-gap, abs=1e-4) and d.near_tie
        judged += 1
    assert judged >= 2


def test_greedy_divergences_are_judged_at_their_step(reference, tiny_tokenizer):
    eos = reference.config.eos_id
    (src,) = _sources(tiny_tokenizer, ["three hundred and two"], eos)
    (r,) = decode(reference, src[None], np.array([len(src)]), DecodingOptions(beam_size=1))
    tokens = r.best.tokens
    assert len(tokens) >= 2
    other = (tokens[0], (tokens[1] + 1) % reference.config.vocab_size)
    cand = DecodeResult((_hyp(other, -1.0),))
    check = _compare_sequences("greedy", reference, [(src, len(src))], [r], [cand], POLICIES["fp32"], reference.config,
                               None, [7])
    (d,) = check.divergences
    assert d.measure == "step" and d.step == 1 and d.sentence == 7 and d.margin >= 0
    assert d.reference_token == tokens[1] and d.candidate_token == other[1]


def test_divergences_name_the_sentence_given(reference, tiny_artifact_dir, tiny_tokenizer):
    """Sentences are numbered as given (empty ones are dropped from the check, not from the numbering)."""
    from transduce.runtime.api import make_backend

    class Shifted:  # the ONNX Runtime backend with its log-probs of one token raised: its choices change
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def step_log_probs(self, state, tokens):
            lp = self.inner.step_log_probs(state, tokens).copy()
            lp[:, 10] += 5.0
            return lp

    cand = Shifted(make_backend(tiny_artifact_dir, "onnxruntime"))
    report = run_parity(reference, cand, tiny_tokenizer, ["", "three hundred", "   ", "seven"], beam_size=2)
    assert report.sentences == 2 and not report.passed
    assert {d.sentence for s in report.sequences for d in s.divergences} <= {1, 3}
    payload = json.dumps(report.to_dict(), allow_nan=False)  # strict JSON: non-finite numbers as strings
    assert json.loads(payload)["passed"] is False


def test_report_json_has_no_bare_infinities():
    s = error_stats("x", np.array([np.nan]), np.array([1.0]), TOL)
    d = ParityReport("c", "r", "fp32", 1, teacher_forced=[s]).to_dict()
    assert d["teacher_forced"][0]["max_abs"] == "inf"
    json.dumps(d, allow_nan=False)


def test_the_table_prints_tolerances_as_they_are():
    from rich.console import Console

    s = error_stats("log_probs", np.zeros(3), np.zeros(3), POLICIES["int8"].outputs["log_probs"])
    console = Console(record=True, width=200)
    ParityReport("c", "r", "int8", 1, teacher_forced=[s]).print(console)
    assert "1 / 0.25" in console.export_text()  # not "1e+00 / 2e-01"


def test_an_unknown_precision_is_refused(reference, tiny_tokenizer):
    with pytest.raises(InputError, match="no parity policy for precision 'int4'"):
        run_parity(reference, reference, tiny_tokenizer, ["one"], precision="int4")


def test_the_manifests_quantization_claim_is_checked(tiny_artifact_dir, tiny_model_dir, edited_copy):
    """The manifest picks the policy; it is the one file no hash covers, so its claim must match the graphs."""
    claimed = edited_copy(tiny_artifact_dir, "claimed", "manifest.json",
                          lambda m: m.update(quantization={"method": "int8"}))
    with pytest.raises(ArtifactError, match="says int8 quantization, but encoder.onnx has no quantized operator"):
        parity_for_artifact(str(claimed), BackendSpec(model_dir=tiny_model_dir), sentences=2)
    unknown = edited_copy(tiny_artifact_dir, "unknown", "manifest.json",
                          lambda m: m.update(quantization={"method": "int4"}))
    r = CliRunner().invoke(main, ["parity", str(unknown), "--model", tiny_model_dir, "-n", "2"])
    assert r.exit_code == 2 and "quantization 'int4', which parity has no tolerances for" in r.stderr, r.output
    assert "Traceback" not in r.output


def test_the_cli_exits_1_when_parity_fails(demo_artifact_dir, demo_model_dir, tmp_path):
    bad = perturb_one_weight(demo_artifact_dir, tmp_path / "bad")
    out = tmp_path / "report.json"
    r = CliRunner().invoke(main, ["parity", str(bad), "--model", demo_model_dir, "-n", "6", "--json", str(out)])
    assert r.exit_code == 1, r.output
    assert "PARITY FAILED" in r.stdout and json.loads(out.read_text())["passed"] is False
