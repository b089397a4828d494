"""transduce bench's end-to-end cells: the worker's translate op, the step count, the cells' rounds, ratios and
comparisons, their table and the options. No timing assertions: these only check the instrument."""

from __future__ import annotations

import os

import pytest

from transduce.bench.config import BenchConfig
from transduce.errors import TransduceError

TEXTS = ["two hundred and five", "three", "seventy-one thousand, two hundred and five", "forty-two"]


# -- the worker's translate op ----------------------------------------------------------------------
@pytest.mark.parametrize("beam, rule", [(1, None), (3, None), (3, "k-finished")])
def test_our_translate_op_is_translator_translate_and_counts_its_steps(tiny_artifact_dir, tiny_model_dir, beam, rule):
    """Outputs as Translator.translate gives them (with the rule asked for); one at a time, each sentence's steps
    are its tokens, plus EOS where it finished (the search takes one step a token)."""
    from transduce.bench.worker import _Ours
    from transduce.runtime.api import load

    w = _Ours("onnxruntime", tiny_artifact_dir, tiny_model_dir, 1)
    cls_step = type(w.backend).__dict__["step"]
    fields = {"beam_size": beam} | ({"early_stopping": rule} if rule else {})
    expected = [load(tiny_artifact_dir, threads=1).translate([x], **fields)[0] for x in TEXTS]
    one = w.translate(TEXTS, beam, rule, one_at_a_time=True)
    assert one["outputs"] == [t.text for t in expected]
    best = sum(len(t.tokens) + t.nbest[0].finished for t in expected)
    # greedy search ends with its one hypothesis; beam search may search on past its best one
    assert one["steps"] == best if beam == 1 else one["steps"] >= best
    whole = w.translate(TEXTS, beam, rule, one_at_a_time=False)
    assert whole["outputs"] == one["outputs"] and 0 < whole["steps"] <= one["steps"]
    assert whole["seconds"] > 0
    assert type(w.backend).__dict__["step"] is cls_step and "step" not in vars(w.backend)  # the count is undone


def test_step_counting_covers_the_views_a_batch_is_dealt_to_and_leaves_none_patched():
    """A batch dealt out to copies of the backend (onnxruntime's shards, made while counting) is counted in full,
    and neither the backend nor a copy keeps the counting wrapper (a copy of a patched instance would)."""
    import copy

    from transduce.bench.worker import counted_steps

    class Backend:
        def __init__(self):
            self.views = None

        def step(self, state, tokens, k, ban_eos=False):
            return self

        def shards(self, batch, beam):
            if self.views is None:
                self.views = [copy.copy(self), copy.copy(self)]
            return self.views

    be = Backend()
    with counted_steps(be) as steps:
        be.step(None, None, 1)
        views = be.shards(4, 1)
        assert [v.step(None, None, 1) for v in views] == views  # each view steps as itself
        assert steps() == 3
    assert Backend.__dict__["step"].__name__ == "step"
    assert all("step" not in vars(x) for x in (be, *views))
    with counted_steps(be) as steps:
        pass
    assert steps() == 0


def test_ctranslate2_translate_op_matches_ours_one_at_a_time(tiny_ct2_dir, tiny_artifact_dir, tiny_model_dir):
    """Greedy, one sentence a call (the same maximum length for both): CTranslate2's texts are ours, on weights
    whose greedy output the bench checked token for token; CTranslate2 takes no stopping rule of ours."""
    from transduce.bench.worker import _CTranslate2, _Ours

    theirs = _CTranslate2(tiny_ct2_dir, 1, model_dir=tiny_model_dir).translate(TEXTS, 1, None, one_at_a_time=True)
    ours = _Ours("onnxruntime", tiny_artifact_dir, tiny_model_dir, 1).translate(TEXTS, 1, None, one_at_a_time=True)
    assert theirs["outputs"] == ours["outputs"] and "steps" not in theirs
    with pytest.raises(RuntimeError, match="early_stopping must be null"):
        _CTranslate2(tiny_ct2_dir, 1, model_dir=tiny_model_dir).translate(TEXTS, 2, "heuristic", False)
    with pytest.raises(RuntimeError, match="needs the model's tokenizer"):
        _CTranslate2(tiny_ct2_dir, 1).translate(TEXTS, 1, None, False)


def test_translate_op_over_the_pipe(tmp_path, tiny_artifact_dir, tiny_model_dir):
    """The protocol: a measurement's median, its calls and the outputs come back; a bad rule is an error reply."""
    from transduce.bench.workers import Worker, WorkerError

    w = Worker("onnxruntime", {}, str(tmp_path / "worker.log"))
    try:
        w.call({"op": "load", "system": "onnxruntime", "path": tiny_artifact_dir, "model_dir": tiny_model_dir,
                "threads": 1})
        reply = w.call({"op": "translate", "texts": TEXTS, "beam": 2, "early_stopping": "k-finished",
                        "one_at_a_time": True, "min_seconds": 0.0})
        assert reply["calls"] == 1 and reply["seconds"] > 0 and len(reply["outputs"]) == len(TEXTS)
        assert reply["steps"] >= len(TEXTS)
        with pytest.raises(WorkerError, match="early_stopping must be one of"):
            w.call({"op": "translate", "texts": TEXTS, "beam": 2, "early_stopping": "soon", "one_at_a_time": False})
    finally:
        w.close()


# -- the cells ----------------------------------------------------------------------------------------
class _Proc:
    pid = os.getpid()

    def poll(self):
        return None


class FakeTranslator:
    """A worker answering translate requests: `seconds` a pass; ours translate the references under their default
    rule and drop the last word of the first sentence under k-finished; it records what it was asked."""

    def __init__(self, seconds: float, refs: list[str], ours: bool):
        self.seconds, self.refs, self.ours = seconds, refs, ours
        self.proc = _Proc()
        self.asked: list[tuple] = []

    def call(self, req, timeout=None):
        assert req["op"] == "translate"
        self.asked.append((req["beam"], req["early_stopping"], req["one_at_a_time"]))
        out = list(self.refs[: len(req["texts"])])
        if not self.ours or req["early_stopping"] == "k-finished":
            out[0] = out[0].rsplit(" ", 1)[0]  # CTranslate2's rule cuts one short here
        reply = {"seconds": self.seconds, "calls": 1, "outputs": out}
        return reply | ({"steps": 7 * len(out)} if self.ours else {})


def _run_cells(monkeypatch, tmp_path, names_seconds: dict[str, float], modes=("greedy", "beam4"), threads=2):
    from transduce.bench import e2e
    from transduce.bench.gates import held_out_pairs

    monkeypatch.setattr(e2e, "settle", lambda pid, **k: 0.0)
    prepared = type("P", (), {"model_dir": str(tmp_path / "model"), "trained": True, "size": "demo"})()
    cfg = BenchConfig(sizes=["demo", "base"], backends=["onnxruntime", "ctranslate2"], modes=list(modes),
                      repeats=3, warmup=1, e2e_sentences=5, threads=threads, ceilings=False)
    refs = [r for _, r in held_out_pairs(prepared, 5)]
    workers = {n: FakeTranslator(s, refs, not n.startswith("ctranslate2")) for n, s in names_seconds.items()}
    plan = e2e.e2e_plan(cfg)
    e2e.run_e2e(prepared, cfg, workers, list(workers), (False, False), plan, log=lambda m: None)
    return plan, workers


def test_cells_time_both_shapes_and_both_rules_against_the_same_ctranslate2_rounds(monkeypatch, tmp_path):
    plan, workers = _run_cells(monkeypatch, tmp_path, {"onnxruntime": 0.010, "ctranslate2": 0.020,
                                                       "ctranslate2-1thread": 0.015, "ctranslate2-inter": 0.030})
    assert plan["run"] and plan["sentences"] == 5 and plan["sizes_without"].keys() == {"base"}
    assert [(c["mode"], c["shape"], c["rules"]) for c in plan["cells"]] == [
        ("greedy", "all", "default"), ("greedy", "one", "default"), ("beam4", "all", "default"),
        ("beam4", "all", "matched"), ("beam4", "one", "default"), ("beam4", "one", "matched")]
    # warm-up + 3 rounds of each timing; ours twice a round in beam4 (their rule, then CTranslate2's)
    asked = workers["onnxruntime"].asked
    assert asked.count((1, None, False)) == 4 and asked.count((4, None, True)) == 4
    assert asked.count((4, "k-finished", False)) == 4 and asked.count((1, "k-finished", False)) == 0
    assert all(rule is None for n, w in workers.items() if n.startswith("ctranslate2") for _, rule, _ in w.asked)
    # one sentence a call, inter is 1thread: not timed there
    assert not any(one for _, _, one in workers["ctranslate2-inter"].asked)
    for c in plan["cells"]:
        r = c["ratios"]["onnxruntime"]
        assert r["vs"] == "ctranslate2-1thread" and r["median"] == pytest.approx(1.5) and r["n"] == 3
        assert ("ctranslate2-inter" in c.get("not_timed", {})) == (c["shape"] == "one")
        x = c["systems"]["onnxruntime"]
        assert x["steps_per_pass"] == 35 and "outputs" not in x["raw"] and c["identical_to"] == "ctranslate2"
        matched = c["rules"] == "matched"
        assert x["identical"] == (5 if matched else 4) and (x["bleu"] < 100) == matched
        assert c["systems"]["ctranslate2"]["identical"] == 5
        if c["shape"] == "all":
            assert x["stats"]["sentences_per_s"]["median"] == pytest.approx(500.0)
        else:
            assert x["stats"]["ms_per_sentence"]["median"] == pytest.approx(2.0)
    assert plan["cells"][3]["early_stopping"]["ours"] == "k-finished"
    assert plan["cells"][2]["early_stopping"]["ours"] == "heuristic"


def test_the_report_puts_the_end_to_end_table_first(monkeypatch, tmp_path):
    from transduce.bench.report import markdown
    from transduce.bench.report_e2e import e2e_section

    plan, _ = _run_cells(monkeypatch, tmp_path, {"onnxruntime": 0.010, "ctranslate2": 0.020,
                                                 "ctranslate2-1thread": 0.015, "ctranslate2-inter": 0.030})
    text = "\n".join(e2e_section(plan))
    assert "| greedy | EOS | onnxruntime | 500 | 1.50 [1.50–1.50] | 2.00 | 1.50 [1.50–1.50] | 7.0 | 35 | 4/5 |" in text
    assert "| beam4 | k-finished (matched) | onnxruntime | 500 | 1.50 [1.50–1.50] | 2.00 |" in text
    assert "| beam4 | heuristic (default) | onnxruntime |" in text
    assert "| beam4 | k-finished (its own) | ctranslate2-inter | 167 | – | = ctranslate2-1thread | not timed |" in text
    assert text.count("| ctranslate2 |") == 2  # once a mode: the matched rows are ours only
    assert "The base size gets no end-to-end cells: its weights are random" in text
    result = {"config": {"src_len": 8, "steps": 8, "warmup": 1, "repeats": 3, "threads": 2},
              "machine": {}, "date": "now", "e2e": plan,
              "sizes": [{"size": "demo", "model": {"description": "d", "config": {
                  "encoder_layers": 1, "decoder_layers": 1, "d_model": 8, "n_heads": 1, "d_ff": 8, "vocab_size": 9}},
                         "systems": {}, "cells": []}]}
    md = markdown(result)
    assert md.index("## End to end") < md.index("## demo")
    assert "## End to end" not in markdown({**result, "e2e": None})  # an earlier run's bench.json


def test_the_report_says_why_there_are_no_cells():
    from transduce.bench.e2e import e2e_plan
    from transduce.bench.report_e2e import e2e_section

    off = "\n".join(e2e_section(e2e_plan(BenchConfig(sizes=["demo", "base"], e2e=False))))
    assert "No end-to-end cells: turned off (--no-e2e)." in off and "The base size gets no" in off
    base = "\n".join(e2e_section(e2e_plan(BenchConfig(sizes=["base"]))))
    assert "they run on the demo size only, which is not among --sizes" in base
    untrained = {**e2e_plan(BenchConfig(sizes=["demo"])), "sentences": 3, "trained": False, "cells": [
        {"mode": "greedy", "beam": 1, "shape": "all", "rules": "default", "sentences": 3, "systems": {}, "ratios": {}}]}
    assert "The demo model is untrained (random weights)" in "\n".join(e2e_section(untrained))


# -- the options ------------------------------------------------------------------------------------
def test_e2e_options_are_checked():
    for bad in (0, -1, 10**6):
        with pytest.raises(TransduceError, match="--e2e-sentences must be between 1 and 10000"):
            BenchConfig(e2e_sentences=bad)
    assert BenchConfig.quick_preset().e2e_sentences == 8 and BenchConfig().e2e_sentences == 300
    assert BenchConfig.quick_preset(e2e_sentences=3).e2e_sentences == 3 and not BenchConfig(e2e=False).e2e


@pytest.mark.parametrize("args, says", [(["--e2e-sentences", "0"], "--e2e-sentences must be between 1 and"),
                                        (["--e2e-sentences", "many"], "'many' is not a valid integer"),
                                        (["--e2e-sentences", "5", "--no-e2e"], "which --no-e2e leaves out")])
def test_bad_e2e_options_are_a_clear_error(tmp_path, args, says):
    from click.testing import CliRunner

    from transduce.cli import main

    res = CliRunner().invoke(main, ["bench", "--quick", "--out", str(tmp_path / "b"), *args])
    assert res.exit_code == 2, res.output
    assert "rror" in res.output and says in res.output
    assert not os.path.exists(tmp_path / "b")

