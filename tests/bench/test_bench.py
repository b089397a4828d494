"""transduce bench: the CTranslate2 conversion (token-identical greedy output), the harness's reports in
--quick mode, the ratio arithmetic and the ceilings. No timing assertions: these only check the instrument."""

from __future__ import annotations

import copy
import json
import os
import sys

import numpy as np
import pytest

from tests.bench.conftest import require_ct2
from transduce.bench import ceilings
from transduce.bench.config import BenchConfig, beam_of
from transduce.bench.stats import cell_stats, summary, throughput_ratios
from transduce.errors import TransduceError
from transduce.formats.artifact import read_manifest


# -- the CTranslate2 conversion --------------------------------------------------------------------
def test_ct2_greedy_equals_ours_token_for_token(tiny_model_dir, tiny_ct2_dir, tiny_tokenizer, small_corpus):
    from transduce.bench.ctranslate2.check import check_greedy_equality

    _, valid = small_corpus
    sources = [tiny_tokenizer.encode(s) for s, _ in valid[:12]]
    natural = check_greedy_equality(tiny_model_dir, tiny_ct2_dir, sources, "held-out")
    assert natural.passed, natural.summary()
    # the same function, not just the same argmax: log-probs agree on our paths and on random targets
    assert natural.max_abs_logprob_diff < 1e-4 and natural.max_abs_logprob_diff_random < 1e-4
    assert natural.logprob_tolerance_exceeded == 0

    rng = np.random.default_rng(0)
    random_src = rng.integers(4, tiny_tokenizer.vocab_size, size=(3, 9)).tolist()
    forced = check_greedy_equality(tiny_model_dir, tiny_ct2_dir, random_src, "forced", forced_steps=12)
    assert forced.passed, forced.summary()
    assert forced.mode == "forced-12"


def test_ct2_check_at_the_edges(tiny_model_dir, tiny_ct2_dir, tmp_path):
    """Forced to max_positions tokens (CTranslate2's score_batch appends </s>: one position too many),
    and a model whose greedy output is empty (CTranslate2 must be allowed to end at once, as ours is)."""
    import torch

    from transduce.bench.ctranslate2.check import check_greedy_equality
    from transduce.bench.ctranslate2.convert import convert_to_ctranslate2
    from transduce.models.checkpoint import load_model_dir, save_model_dir

    model, tok, cfg = load_model_dir(tiny_model_dir)
    top = model.cfg.max_positions
    forced = check_greedy_equality(tiny_model_dir, tiny_ct2_dir, [[5, 6, 7]], "forced", forced_steps=top)
    assert forced.passed, forced.summary()
    with torch.no_grad():  # the last LayerNorm's output is the EOS embedding's direction: EOS first
        norm = model.decoder_layers[-1].norm3
        e = model.embed.weight[model.cfg.eos_id]
        norm.weight.mul_(0.0)
        norm.bias.copy_(e / e.norm() * 5.0)
    save_model_dir(str(tmp_path / "eos"), model, tok)
    ct2 = convert_to_ctranslate2(str(tmp_path / "eos"), str(tmp_path / "eos-ct2"))
    natural = check_greedy_equality(str(tmp_path / "eos"), ct2, [[5, 6, 7], [8, 9]], "empty outputs")
    assert natural.passed, natural.summary()


def test_ct2_conversion_is_reused_while_the_weights_match(tiny_model_dir, tiny_ct2_dir):
    from transduce.bench.ctranslate2.convert import SOURCE_FILE, convert_to_ctranslate2, is_current

    assert is_current(tiny_ct2_dir, tiny_model_dir)
    before = os.path.getmtime(os.path.join(tiny_ct2_dir, SOURCE_FILE))
    convert_to_ctranslate2(tiny_model_dir, tiny_ct2_dir)
    assert os.path.getmtime(os.path.join(tiny_ct2_dir, SOURCE_FILE)) == before


def test_ct2_vocabulary_is_ours_in_id_order(tiny_ct2_dir, tiny_tokenizer):
    from transduce.bench.ctranslate2.convert import ct2_vocab

    vocab = ct2_vocab(tiny_ct2_dir)
    assert vocab[:4] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert vocab == [tiny_tokenizer.id_to_token(i) for i in range(tiny_tokenizer.vocab_size)]


def test_check_reports_where_other_weights_diverge(tmp_path, tiny_model, tiny_tokenizer, tiny_model_dir, small_corpus):
    """A CTranslate2 model of different weights must fail the check and say where."""
    require_ct2()
    import torch

    from transduce.bench.ctranslate2.check import check_greedy_equality
    from transduce.bench.ctranslate2.convert import convert_to_ctranslate2
    from transduce.models.checkpoint import save_model_dir

    other = copy.deepcopy(tiny_model)
    with torch.no_grad():
        other.decoder_layers[-1].ffn.w2.bias.add_(torch.linspace(-3, 3, other.cfg.d_model))
        other.embed.weight.mul_(-1.0)
    save_model_dir(tmp_path / "other", other, tiny_tokenizer)
    ct2_dir = convert_to_ctranslate2(tmp_path / "other", tmp_path / "other-ct2")
    _, valid = small_corpus
    sources = [tiny_tokenizer.encode(s) for s, _ in valid[:6]]
    report = check_greedy_equality(tiny_model_dir, ct2_dir, sources, "other weights")
    assert not report.passed
    d = report.divergences[0]
    assert d.position >= 0 and (d.ours != d.theirs)
    assert "first divergence" in report.summary()


def test_check_catches_a_shifted_position_table(tmp_path, tiny_model_dir, tiny_tokenizer, small_corpus, monkeypatch):
    """Fairseq's sinusoidal table starts at offset padding_idx + 1; given that table, the check must fail."""
    require_ct2()
    from transduce.bench.ctranslate2 import convert as ce
    from transduce.bench.ctranslate2.check import check_greedy_equality

    ours = ce.sinusoidal_table_np
    monkeypatch.setattr(ce, "sinusoidal_table_np", lambda n, d: ours(n + 2, d)[2:])
    wrong = ce.convert_to_ctranslate2(tiny_model_dir, tmp_path / "shifted", force=True)
    _, valid = small_corpus
    sources = [tiny_tokenizer.encode(s) for s, _ in valid[:4]]
    report = check_greedy_equality(tiny_model_dir, wrong, sources, "shifted", forced_steps=6)
    assert not report.passed
    assert report.logprob_tolerance_exceeded > 0 and report.max_abs_logprob_diff_random > 1e-3


# -- the harness in --quick mode -------------------------------------------------------------------
def test_quick_bench_writes_json_markdown_png(tmp_path, tiny_model_dir, tiny_artifact_dir):
    from click.testing import CliRunner

    from transduce.cli import main

    try:
        import ctranslate2  # noqa: F401

        backends = "torch,torch-cuda,onnxruntime,ctranslate2"
    except ImportError:
        backends = "torch,torch-cuda,onnxruntime"
    import torch

    cuda = torch.cuda.is_available()
    out = tmp_path / "bench"
    res = CliRunner().invoke(main, ["bench", "--quick", "--model-dir", tiny_model_dir, "--artifact-dir",
                                    tiny_artifact_dir, "--out", str(out), "--threads", "1", "--batches", "1,2",
                                    "--repeats", "1", "--steps", "3", "--src-len", "5", "--check-sentences", "4",
                                    "--backends", backends])
    assert res.exit_code == 0, res.output
    with open(out / "bench.json", encoding="utf-8") as f:
        result = json.load(f)
    assert result["format"] == "transduce-bench" and result["config"]["quick"]
    assert result["ceilings"]["bandwidth_gbs"] > 0 and result["ceilings"]["matmul_gflops"] > 0
    (size,) = result["sizes"]
    assert size["size"] == "demo" and size["model"]["artifact_dir"] == os.path.abspath(tiny_artifact_dir)
    assert [(c["mode"], c["batch"]) for c in size["cells"]] == [("greedy", 1), ("greedy", 2), ("beam2", 1),
                                                                ("beam2", 2)]
    timed = [n for n, s in size["systems"].items() if s["status"] == "ok"]
    assert {"torch", "onnxruntime"} <= set(timed)
    if cuda:  # on the GPU: timed, with its device named, and given no ratio to CTranslate2 on the CPU
        assert "torch-cuda" in timed and size["systems"]["torch-cuda"]["info"]["gpu"]
    else:  # where CUDA is missing: skipped, saying so, and the rest is timed
        assert size["systems"]["torch-cuda"]["status"] == "skipped"
        assert "sees no usable CUDA GPU" in size["systems"]["torch-cuda"]["reason"]
    if "ctranslate2" in backends:
        assert size["checks"] and all(c["passed"] for c in size["checks"])
        from transduce.bench.cpu import cpu_above_avx2

        assert "ctranslate2" in timed
        # avx2 caps oneDNN below what the CPU has, or repeats the default setting (and is not timed)
        assert ("ctranslate2-avx2" in timed) == cpu_above_avx2()
        if cpu_above_avx2():
            assert size["systems"]["ctranslate2-avx2"]["env"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
        assert "ctranslate2-1thread" not in size["systems"]  # at --threads 1 it is the default setting
        assert "ctranslate2-nomkl-1thread" not in size["systems"]  # ... and this one nomkl
        from transduce.bench.cpu import cpu_is_intel

        # nomkl is the default setting on a CPU that is not Intel's (CTranslate2 uses MKL on Intel's only)
        assert ("ctranslate2-nomkl" in timed) == cpu_is_intel()
    for cell in size["cells"]:
        assert set(cell["systems"]) == set(timed)
        for name, s in cell["systems"].items():
            st = s["stats"]
            assert st["decode_ms"]["n"] == 1 and st["tokens_per_s"]["median"] > 0, name
            assert st["first_ms"]["median"] > 0
            if not name.startswith("ctranslate2"):
                assert st["step_ms_direct"]["median"] > 0
        assert cell["floor"]["seconds"] > 0
        if "ctranslate2" in backends:
            assert set(cell["ratios"]) == {"torch", "onnxruntime"}
            assert all(r["median"] > 0 and r["vs"].startswith("ctranslate2") for r in cell["ratios"].values())
    md = (out / "bench.md").read_text(encoding="utf-8")
    assert "| mode | batch | system | decode ms |" in md and "Machine ceilings" in md and "*floor*" in md
    assert ("§ on the GPU" in md) == cuda
    # ONNX Runtime's thread rules, as the backend applies them (at --threads 1: one thread throughout)
    assert "ONNX Runtime's threads: steps 1 always; encoder 1; every batch whole." in md
    # end to end: the quick preset's 8 held-out sentences, both shapes, both rules in beam2; first in the report
    e2e = result["e2e"]
    assert list(result).index("e2e") < list(result).index("sizes")
    assert e2e["run"] and e2e["sentences"] == 8 and e2e["trained"] is False  # the tiny model's weights are random
    assert [(c["mode"], c["shape"], c["rules"]) for c in e2e["cells"]] == [
        ("greedy", "all", "default"), ("greedy", "one", "default"), ("beam2", "all", "default"),
        ("beam2", "all", "matched"), ("beam2", "one", "default"), ("beam2", "one", "matched")]
    for cell in e2e["cells"]:
        assert {"torch", "onnxruntime"} <= set(cell["systems"])
        for name in ("torch", "onnxruntime"):
            x = cell["systems"][name]
            assert x["stats"]["pass_ms"]["n"] == 1 and x["steps_per_pass"] > 0 and 0 <= x["bleu"] <= 100
        if "ctranslate2" in backends:
            assert set(cell["ratios"]) == {"torch", "onnxruntime"} and cell["identical_to"] == "ctranslate2"
            assert all(r["median"] > 0 and r["vs"].startswith("ctranslate2") for r in cell["ratios"].values())
            assert all(0 <= x["identical"] <= 8 for x in cell["systems"].values())
    assert md.index("## End to end") < md.index("## Machine ceilings") < md.index("| mode | batch | system |")
    assert "The demo model is untrained (random weights)" in md
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_each_skipped_system_gives_its_own_reason(tmp_path, tiny_model_dir, tiny_artifact_dir, monkeypatch):
    """A failed CTranslate2 check skips CTranslate2 with that reason, whatever the quantized rows before it
    were skipped for (they shared one variable)."""
    require_ct2()
    from click.testing import CliRunner

    from transduce.bench import harness, models
    from transduce.cli import main

    checks, prepare = harness.equality_checks, models.prepare

    def failed_checks(*args):
        return [{**c, "passed": False} for c in checks(*args)]

    monkeypatch.setattr(harness, "equality_checks", failed_checks)
    monkeypatch.setattr(harness, "quality_gate",
                        lambda prepared, q, cfg, log: {"passed": False, "reason": "the int8 gate"})
    monkeypatch.setattr(models, "prepare", lambda *a, **k: prepare(*a, **{**k, "quantize": []}))  # no int8 export
    out = tmp_path / "bench"
    res = CliRunner().invoke(main, ["bench", "--quick", "--model-dir", tiny_model_dir, "--artifact-dir",
                                    tiny_artifact_dir, "--out", str(out), "--threads", "1", "--batches", "1",
                                    "--modes", "greedy", "--repeats", "1", "--steps", "2", "--src-len", "4",
                                    "--no-ceilings",
                                    "--backends", "onnxruntime,ctranslate2", "--quantize", "int8"])
    assert res.exit_code == 0, res.output
    (size,) = json.loads((out / "bench.json").read_text())["sizes"]
    assert size["systems"]["onnxruntime-int8"]["reason"] == "the int8 gate"
    ct2 = [n for n in size["systems"] if n.startswith("ctranslate2")]
    assert "ctranslate2" in ct2
    for name in ct2:
        assert size["systems"][name]["status"] == "skipped"
        assert size["systems"][name]["reason"].startswith("greedy output differs from ours: demo: ")
    # CTranslate2's int8 runs the same conversion: skipped for the same reason
    assert size["systems"]["ct2-int8"]["reason"] == size["systems"]["ctranslate2"]["reason"]


def test_a_conversion_ctranslate2_cannot_load_skips_it_and_times_the_rest(tmp_path, tiny_model_dir, tiny_artifact_dir,
                                                                          monkeypatch):
    require_ct2()
    import ctranslate2
    from click.testing import CliRunner

    from transduce.cli import main

    def refused(*args, **kwargs):
        raise RuntimeError("Unsupported model binary version. This executable supports models with binary version v6")

    monkeypatch.setattr(ctranslate2, "Translator", refused)  # in this process only: the check's load
    out = tmp_path / "bench"
    res = CliRunner().invoke(main, ["bench", "--quick", "--model-dir", tiny_model_dir, "--artifact-dir",
                                    tiny_artifact_dir, "--out", str(out), "--threads", "1", "--batches", "1",
                                    "--modes", "greedy", "--repeats", "1", "--steps", "2", "--src-len", "4",
                                    "--no-ceilings",
                                    "--backends", "onnxruntime,ctranslate2"])
    assert res.exit_code == 0, res.output
    (size,) = json.loads((out / "bench.json").read_text())["sizes"]
    assert size["systems"]["ctranslate2"]["status"] == "skipped"
    assert "cannot load its conversion" in size["systems"]["ctranslate2"]["reason"]
    assert size["cells"][0]["systems"]["onnxruntime"]["stats"]["tokens_per_s"]["median"] > 0


def test_a_failed_report_write_prints_the_measurements(tmp_path, tiny_model_dir, tiny_artifact_dir, monkeypatch):
    """A disk that fills up after the run: the table goes to stdout and the whole result to stderr, not lost."""
    import errno

    from click.testing import CliRunner

    from transduce.bench import report
    from transduce.cli import main

    def full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(report, "write_json_atomic", full)
    out = tmp_path / "bench"
    res = CliRunner().invoke(main, ["bench", "--quick", "--model-dir", tiny_model_dir, "--artifact-dir",
                                    tiny_artifact_dir, "--out", str(out), "--threads", "1", "--batches", "1",
                                    "--modes", "greedy", "--repeats", "1", "--steps", "2", "--src-len", "4",
                                    "--no-ceilings",
                                    "--backends", "onnxruntime"])
    assert res.exit_code == 2
    assert "cannot write the bench report" in res.stderr and "none of the report files was written" in res.stderr
    assert "| onnxruntime" in res.stdout or "onnxruntime |" in res.stdout
    result = json.loads(res.stderr.split("as bench.json would have held it:\n", 1)[1].split("\nerror:", 1)[0])
    assert result["sizes"][0]["cells"][0]["systems"]["onnxruntime"]["stats"]["tokens_per_s"]["median"] > 0
    assert not (out / "bench.json").exists()


# -- arithmetic ------------------------------------------------------------------------------------
DEMO_SIZE = {"size": "demo", "model": {"config": {"encoder_layers": 2, "decoder_layers": 2, "d_model": 128,
                                                "n_heads": 4, "d_ff": 512, "vocab_size": 372}, "description": "x"}}


def test_ratios_to_ctranslate2_are_for_our_cpu_systems_only():
    """Per round, against the fastest CTranslate2 setting in the cell; the GPU systems (CTranslate2 runs on the
    CPU here) get none, and the settings are compared with each other."""
    from transduce.bench.stats import ct2_ratios

    raw = {"torch": {"decode": [0.4, 0.5]}, "onnxruntime": {"decode": [0.1, 0.2]}, "tensorrt": {"decode": [0.01, 0.01]},
           "torch-cuda": {"decode": [0.05, 0.05]}, "ctranslate2": {"decode": [0.3, 0.3]},
           "ctranslate2-avx2": {"decode": [0.2, 0.2]}}
    out = ct2_ratios(raw, list(raw))
    assert out["ct2_best"] == "ctranslate2-avx2" and set(out["ratios"]) == {"torch", "onnxruntime"}
    assert (out["ratios"]["onnxruntime"]["per_round"] == pytest.approx([2.0, 1.0])
            and out["ratios"]["onnxruntime"]["vs"] == "ctranslate2-avx2")
    assert out["ct2_settings_ratio"]["ctranslate2"]["per_round"] == pytest.approx([1.5, 1.5])
    assert ct2_ratios({"torch": {"decode": [0.4]}}, ["torch"]) == {"ratios": {}}


def test_ctranslate2_settings_within_the_thread_budget():
    """1thread runs CTranslate2 on one of the budget's threads; a setting that would repeat another's
    configuration (1thread at --threads 1 is the default) is not timed twice."""
    from transduce.bench.ctranslate2.settings import ct2_setting, ct2_settings_run, ct2_threads

    assert ct2_setting("ctranslate2") == "default" and ct2_setting("ctranslate2-1thread") == "1thread"
    assert [ct2_threads(s, 2) for s in ("default", "avx2", "1thread")] == [2, 2, 1]
    assert ct2_threads("1thread", 1) == 1 and ct2_threads("default", 4) == 4
    assert ct2_settings_run(["default", "avx2", "1thread"], 2, above_avx2=True) == ["default", "avx2", "1thread"]
    assert ct2_settings_run(["default", "avx2", "1thread"], 1, above_avx2=True) == ["default", "avx2"]
    assert ct2_settings_run(["1thread", "default"], 1, above_avx2=True) == ["1thread"]
    assert ct2_settings_run(["avx2", "1thread"], 1, above_avx2=True) == ["avx2", "1thread"]  # another environment: kept
    assert BenchConfig().ct2_settings == ["default", "avx2", "1thread", "nomkl", "nomkl-1thread", "inter",
                                          "nomkl-inter"]


def test_ctranslate2_inter_settings_decode_a_batch_in_parts():
    """inter: CTranslate2 decodes a batch as --threads sub-batches at once, one thread each (our ONNX Runtime
    backend decodes a small model's batch in parts too); the worker asks for that many sub-batches, and the
    output is CTranslate2's forced decode all the same."""
    from transduce.bench.ctranslate2.settings import ct2_inter_threads, ct2_threads

    assert [ct2_inter_threads(s, 2) for s in ("default", "1thread", "inter", "nomkl-inter")] == [1, 1, 2, 2]
    assert ct2_threads("inter", 2) == ct2_threads("nomkl-inter", 4) == 1


def test_an_inter_setting_at_batch_1_repeats_its_one_thread_setting():
    """One sentence is one sub-batch on one thread: in a batch-1 cell inter is 1thread (and nomkl-inter
    nomkl-1thread), so only the first of each is timed there; from batch 2 on they differ."""
    from transduce.bench.ctranslate2.settings import ct2_cell_repeats, ct2_sub_batches

    assert [ct2_sub_batches("inter", 2, b) for b in (1, 2, 3, 16)] == [1, 2, 2, 2]
    assert ct2_sub_batches("inter", 4, 5) == 3 and ct2_sub_batches("default", 2, 16) == 1  # parts of 2: 2, 2, 1
    names = ["torch", "onnxruntime", "ctranslate2", "ctranslate2-1thread", "ctranslate2-nomkl-1thread",
             "ctranslate2-inter", "ctranslate2-nomkl-inter"]
    intel = {"intel": True, "above_avx2": True}  # an Intel CPU: nomkl differs from the default there
    assert ct2_cell_repeats(names, 2, 1, **intel) == {"ctranslate2-inter": "ctranslate2-1thread",
                                                      "ctranslate2-nomkl-inter": "ctranslate2-nomkl-1thread"}
    assert ct2_cell_repeats(names, 2, 2, **intel) == ct2_cell_repeats(names, 2, 16, **intel) == {}
    assert ct2_cell_repeats(["ctranslate2-inter", "ctranslate2-1thread"], 2, 1, **intel) == {
        "ctranslate2-1thread": "ctranslate2-inter"}  # the first one named is timed
    # as the settings amount to on the CPU: off Intel's CPUs an unset CT2_USE_MKL is 0 (nomkl-1thread = 1thread)
    amd = ["ctranslate2-nomkl-1thread", "ctranslate2-inter"]
    assert ct2_cell_repeats(amd, 2, 1, intel=False, above_avx2=True) == {
        "ctranslate2-inter": "ctranslate2-nomkl-1thread"}
    assert ct2_cell_repeats(amd, 2, 1, intel=True, above_avx2=True) == {}  # MKL against oneDNN on Intel's


def test_the_report_names_the_settings_not_timed_in_a_cell():
    from transduce.bench.report import _size_section

    stats = {"stats": {"decode_ms": {"median": 5.0, "min": 4.0, "max": 6.0, "n": 3},
                       "tokens_per_s": {"median": 6400.0, "min": 5000.0, "max": 8000.0, "n": 3},
                       "sentences_per_s": {"median": 200.0}}, "raw": {}}
    cells = [{"mode": m, "beam": 1, "batch": 1, "steps": 32, "systems": {"ctranslate2-1thread": stats}, "ratios": {},
              "not_timed": {"ctranslate2-inter": "ctranslate2-1thread"}} for m in ("greedy", "beam4")]
    size = {**DEMO_SIZE, "systems": {"ctranslate2-1thread": {"status": "ok"}, "ctranslate2-inter": {"status": "ok"}},
            "cells": cells}
    text = "\n".join(_size_section(size, {"steps": 32}))
    assert ("ctranslate2-inter is not timed at greedy batch 1, beam4 batch 1: there it runs as ctranslate2-1thread "
            "does") in text


def test_ctranslate2_worker_with_inter_threads_splits_the_batch(tiny_ct2_dir, monkeypatch):
    pytest.importorskip("ctranslate2")
    from transduce.bench import worker

    calls = []
    w = worker._CTranslate2(tiny_ct2_dir, 1, inter_threads=2)
    real = w.translator
    monkeypatch.setattr(w, "translator", type("T", (), {"translate_batch": lambda self, tokens, **kw: (
        calls.append(kw["max_batch_size"]), real.translate_batch(tokens, **kw))[1]})())
    assert w.info["inter_threads"] == 2
    reply = w.decode([[5, 6, 7], [6, 7], [7, 8, 9], [9]], beam=2, steps=3)
    assert reply["tokens"] == 12 and calls == [2]
    one = worker._CTranslate2(tiny_ct2_dir, 1)
    monkeypatch.setattr(one, "translator", type("T", (), {"translate_batch": lambda self, tokens, **kw: (
        calls.append(kw["max_batch_size"]), real.translate_batch(tokens, **kw))[1]})())
    one.decode([[5, 6, 7], [6, 7]], beam=1, steps=2)
    assert calls == [2, 0]


def test_ctranslate2_settings_resolve_mkl_as_ctranslate2_does():
    """Without CT2_USE_MKL CTranslate2 uses MKL on Intel CPUs only: there nomkl is a setting of its own
    (MKL on two threads was 4-10x slower than oneDNN on an Intel Xeon), elsewhere it repeats the default."""
    from transduce.bench.ctranslate2.settings import (
        DEFAULT_CT2_SETTINGS,
        ct2_effective_env,
        ct2_setting,
        ct2_settings_run,
    )

    assert ct2_setting("ctranslate2-nomkl-1thread") == "nomkl-1thread"
    assert ct2_effective_env("default", intel=True)["CT2_USE_MKL"] == "1"
    assert ct2_effective_env("default", intel=False)["CT2_USE_MKL"] == "0"
    assert ct2_settings_run(DEFAULT_CT2_SETTINGS, 2, intel=True, above_avx2=True) == DEFAULT_CT2_SETTINGS
    assert ct2_settings_run(DEFAULT_CT2_SETTINGS, 2, intel=False, above_avx2=True) == ["default", "avx2", "1thread",
                                                                                      "inter"]
    assert ct2_settings_run(DEFAULT_CT2_SETTINGS, 1, intel=True, above_avx2=True) == ["default", "avx2", "nomkl"]
    assert ct2_settings_run(["mkl", "default"], 2, intel=True) == ["mkl"]
    assert ct2_settings_run(["mkl", "default"], 2, intel=False) == ["mkl", "default"]
    # ONEDNN_MAX_CPU_ISA=AVX2 on a CPU with nothing above AVX2 (this project's AMD EPYC) caps nothing
    assert ct2_effective_env("avx2", intel=False, above_avx2=False) == ct2_effective_env("default", intel=False)
    assert ct2_settings_run(DEFAULT_CT2_SETTINGS, 2, intel=False, above_avx2=False) == ["default", "1thread", "inter"]
    assert ct2_settings_run(["avx2", "default"], 2, intel=False, above_avx2=False) == ["avx2"]


def test_cpu_facts_from_proc_cpuinfo(monkeypatch, tmp_path):
    """Vendor, model and flags of the first CPU; where /proc/cpuinfo cannot be read, not Intel's and (so that both
    are timed) possibly above AVX2."""
    import builtins

    from transduce.bench import cpu
    from transduce.bench.ctranslate2 import settings as ct2_settings

    text = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu avx avx2 fma "
            "avx512f avx512bw\n\nprocessor\t: 1\nvendor_id\t: GenuineIntel\nflags\t\t: fpu\n")
    (tmp_path / "cpuinfo").write_text(text)
    real_open = builtins.open

    def fake_open(path, *a, **k):
        return real_open(tmp_path / "cpuinfo" if path == "/proc/cpuinfo" else path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert cpu.cpuinfo() == {"vendor": "GenuineIntel", "model": "Intel(R) Xeon(R)",
                             "flags": {"fpu", "avx", "avx2", "fma", "avx512f", "avx512bw"}}
    assert cpu.cpu_is_intel() and cpu.cpu_above_avx2()
    (tmp_path / "cpuinfo").write_text(text.replace("GenuineIntel", "AuthenticAMD").replace(" avx512f avx512bw", ""))
    assert not cpu.cpu_is_intel() and not cpu.cpu_above_avx2()
    (tmp_path / "cpuinfo").unlink()
    assert cpu.cpuinfo() is None and not cpu.cpu_is_intel() and cpu.cpu_above_avx2()
    # ct2_settings_run reads /proc/cpuinfo once for both questions
    (tmp_path / "cpuinfo").write_text(text)
    opened = []
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: opened.append(path) or fake_open(path, *a, **k))
    assert ct2_settings.ct2_settings_run(["default", "avx2", "nomkl"], 2) == ["default", "avx2", "nomkl"]
    assert opened.count("/proc/cpuinfo") == 1


def test_bench_help_names_every_ctranslate2_setting_and_the_default():
    """--ct2-settings' help lists every setting the harness knows, and the default it really uses."""
    from click.testing import CliRunner

    from transduce.bench.ctranslate2.settings import CT2_SETTINGS, DEFAULT_CT2_SETTINGS
    from transduce.cli import main

    res = CliRunner().invoke(main, ["bench", "--help"], terminal_width=10_000)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for name in CT2_SETTINGS:
        assert f" {name} " in text or f" {name}," in text or f" {name};" in text, name
    assert f"[default: {','.join(DEFAULT_CT2_SETTINGS)}]" in text


def test_throughput_ratios_pair_rounds():
    # our seconds per round, theirs per round: ratio = their seconds / ours (our throughput / theirs)
    r = throughput_ratios([1.0, 2.0, 4.0], [2.0, 2.0, 2.0])
    assert r["per_round"] == [2.0, 1.0, 0.5]
    assert r["median"] == 1.0 and r["min"] == 0.5 and r["max"] == 2.0 and r["n"] == 3
    assert throughput_ratios([], []) is None
    assert summary([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}


class _FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


@pytest.mark.parametrize("busy_until, expected", [(0.0, (0.05, 0.07)), (0.2, (0.23, 0.26)), (5.0, (1.0, 1.02))])
def test_settle_waits_until_the_worker_stops_using_cpu(monkeypatch, busy_until, expected):
    """A worker whose pool still spins (its CPU ticks advance) is waited for until its ticks stand
    still for SETTLE_QUIET_SECONDS, never past SETTLE_MAX_SECONDS."""
    from transduce.bench import cpu

    clock = _FakeClock()
    monkeypatch.setattr(cpu, "process_ticks", lambda pid: round(min(clock.t, busy_until) * 100))
    waited = cpu.settle(123, clock=clock, sleep=clock.sleep)
    assert expected[0] <= waited <= expected[1]


def test_settle_without_proc_waits_a_fixed_time(monkeypatch):
    from transduce.bench import cpu

    clock = _FakeClock()
    monkeypatch.setattr(cpu, "process_ticks", lambda pid: None)
    assert cpu.settle(123, clock=clock, sleep=clock.sleep) == pytest.approx(cpu.SETTLE_BLIND_SECONDS)
    assert cpu.process_ticks(os.getpid()) is None or cpu.process_ticks(os.getpid()) >= 0


def test_quantized_rows_config_and_names():
    from transduce.bench.config import quantized_system

    assert BenchConfig(quantize=["int8"]).quantize == ["int8"]
    with pytest.raises(TransduceError, match="unknown quantization"):
        BenchConfig(quantize=["int4"])
    with pytest.raises(TransduceError, match="keep onnxruntime"):
        BenchConfig(quantize=["int8"], backends=["torch"])
    with pytest.raises(TransduceError, match="needs the demo size"):
        BenchConfig(quantize=["int8"], sizes=["base"])
    cfg = BenchConfig(quantize=["int8", "int8"], sizes=["base", "demo"])
    assert cfg.quantize == ["int8"] and cfg.sizes == ["demo", "base"]  # the gate runs first
    assert quantized_system("onnxruntime-int8") == "int8"
    assert quantized_system("onnxruntime") is None and quantized_system("ctranslate2-avx2") is None


@pytest.mark.parametrize("quantized_text, passed", [("a b c d e f", True), ("a b x y e f", False)])
def test_quality_gate_compares_bleu_with_fp32(monkeypatch, tmp_path, quantized_text, passed):
    _run_gate(monkeypatch, tmp_path, {"int8": quantized_text}, passed)


def test_quality_gate_threshold_is_half_a_bleu_point(monkeypatch, tmp_path):
    """99 identical sentences and one that differs: BLEU drops by less than 0.5 for a one-word change in
    a long corpus and by more for a wholly different sentence (threshold, not just 'equal or not')."""
    from transduce.bench import gates

    long = " ".join(f"w{i}" for i in range(12))
    refs = [long] * 100
    gate = _run_gate(monkeypatch, tmp_path, {"int8": [long] * 99 + [long.replace("w5", "x")]}, True, refs)
    assert 0 < gate["bleu_fp32"] - gate["bleu_int8"] <= gates.QUALITY_GATE_BLEU
    gate = _run_gate(monkeypatch, tmp_path, {"int8": [long] * 97 + ["zz yy"] * 3}, False, refs)
    assert gate["bleu_fp32"] - gate["bleu_int8"] > gates.QUALITY_GATE_BLEU and "below fp32" in gate["reason"]


def test_quality_gate_refuses_an_untrained_demo_model(monkeypatch, tmp_path):
    gate = _run_gate(monkeypatch, tmp_path, {"int8": "a b c d e f"}, False, trained=False)
    assert "untrained" in gate["reason"] and "bleu_fp32" not in gate


def _run_gate(monkeypatch, tmp_path, texts, passed, refs=None, trained=True):
    """The int8 rows are timed only if BLEU on the demo data is at most 0.5 below fp32's."""
    from types import SimpleNamespace

    from transduce.bench import gates
    from transduce.runtime import api

    refs = refs or ["a b c d e f", "a b c d e f"]
    pairs = [(f"s{i}", r) for i, r in enumerate(refs)]
    monkeypatch.setattr(gates, "held_out_pairs", lambda prepared, n: pairs[:n])

    class FakeTranslator:
        def __init__(self, out):
            self.out = out

        def translate(self, sources, beam_size, truncate):
            assert beam_size == 4 and truncate
            outs = self.out if isinstance(self.out, list) else [self.out] * len(sources)
            return [SimpleNamespace(text=t) for t in outs]

    texts = {"fp32": refs, **texts}
    monkeypatch.setattr(api, "load", lambda path, threads: FakeTranslator(texts[os.path.basename(path)]))
    prepared = SimpleNamespace(artifact_dir=str(tmp_path / "fp32"), quantized_dirs={"int8": str(tmp_path / "int8")},
                               size="demo", trained=trained, quantize_errors={})
    gate = gates.quality_gate(prepared, "int8", BenchConfig(check_sentences=len(refs)), log=lambda m: None)
    assert gate["passed"] is passed and gate["sentences"] == len(refs)
    if trained:
        assert gate["bleu_fp32"] == 100.0
    return gate


class FakeWorker:
    """A bench worker that answers at once: `seconds` per 8-step decode; dies from its `die_at`-th call."""

    def __init__(self, seconds, die_at=None):
        import types

        self.seconds, self.die_at, self.calls = seconds, die_at, 0
        self.proc = types.SimpleNamespace(pid=os.getpid())

    def call(self, req):
        from transduce.bench.workers import WorkerError

        self.calls += 1
        if self.die_at is not None and self.calls >= self.die_at:
            raise WorkerError("the onnxruntime worker died (exit status -9)")
        if req["op"] == "direct":
            return {"encode_seconds": 0.001, "step_seconds": [0.001] * req["steps"]}
        return {"seconds": self.seconds * req["steps"] / 8, "calls": 1}


def test_a_system_failing_after_some_rounds_is_marked(monkeypatch):
    """Its rounds so far are kept; bench.md marks its row and says over how many rounds it is."""
    from transduce.bench import cells
    from transduce.bench.cells import _time_cell
    from transduce.bench.report import _size_section
    from transduce.bench.stats import ct2_ratios

    monkeypatch.setattr(cells, "settle", lambda pid, **k: 0.0)

    cfg = BenchConfig(sizes=["demo"], backends=["onnxruntime", "ctranslate2"], batches=[1], modes=["greedy"],
                      repeats=5, warmup=1, steps=8, src_len=8, ceilings=False)
    workers = {"onnxruntime": FakeWorker(0.010, die_at=10), "ctranslate2": FakeWorker(0.012)}  # dies in round 3
    raw = _time_cell(workers, list(workers), [[5, 6, 7]], 1, cfg, log=lambda m: None)
    cell = {"mode": "greedy", "beam": 1, "batch": 1, "src_len": 8, "steps": 8, "repeats": 5, "systems": {},
            "ratios": {}, "foreign_cpu_share": 0.0}
    for n in workers:
        cell["systems"][n] = {"stats": cell_stats(raw[n], 1, 8), "raw": raw[n]}
    cell.update(ct2_ratios(raw, list(workers)))
    size = {**DEMO_SIZE, "systems": {n: {"status": "ok"} for n in workers}, "cells": [cell]}
    md = "\n".join(_size_section(size, {"steps": 8}))
    assert "| greedy | 1 | onnxruntime* |" in md
    assert "onnxruntime (greedy, batch 1): failed after 2 of 5 rounds (the onnxruntime worker died" in md
    assert "(exit status -9)); its figures are over those and so is its ratio" in md
    # CTranslate2 failing part-way: its row is marked, and so is our ratio to it (over its rounds)
    workers = {"onnxruntime": FakeWorker(0.010), "ctranslate2": FakeWorker(0.012, die_at=7)}
    raw = _time_cell(workers, list(workers), [[5, 6, 7]], 1, cfg, log=lambda m: None)
    cell = {**cell, "systems": {n: {"stats": cell_stats(raw[n], 1, 8), "raw": raw[n]} for n in workers}, "ratios": {}}
    cell.update(ct2_ratios(raw, list(workers)))
    md = "\n".join(_size_section({**size, "cells": [cell]}, {"steps": 8}))
    assert "| greedy | 1 | ctranslate2* |" in md
    row = next(line for line in md.splitlines() if line.startswith("| greedy | 1 | onnxruntime |"))
    assert "vs ctranslate2*" in row


def test_a_repeated_setting_is_timed_only_in_place_of_a_failed_one(monkeypatch, tmp_path):
    """At --threads 2 and batch 1, inter is 1thread: it is not timed beside it, and the report and the plot
    say so; if 1thread fails in that cell, the cell is timed again with inter in its place, so that our
    ratio is to rounds paired with ours. From batch 2 on both are timed."""
    from transduce.bench import cells
    from transduce.bench.report import _size_section, plot

    monkeypatch.setattr(cells, "settle", lambda pid, **k: 0.0)
    cfg = BenchConfig(sizes=["demo"], backends=["onnxruntime", "ctranslate2"], batches=[1], modes=["greedy"],
                      repeats=3, warmup=1, steps=8, src_len=8, ceilings=False, threads=2,
                      ct2_settings=["1thread", "inter"])
    amd = (False, True)  # not Intel's, above AVX2
    names = ["onnxruntime", "ctranslate2-1thread", "ctranslate2-inter"]
    logged = []

    def cell_of(workers, src):
        c = cells.timed_cell(workers, names, src, 1, cfg, amd, logged.append)
        return {"mode": "greedy", "beam": 1, **c}

    workers = {"onnxruntime": FakeWorker(0.010), "ctranslate2-1thread": FakeWorker(0.012),
               "ctranslate2-inter": FakeWorker(0.011)}
    cell = cell_of(workers, [[5, 6, 7]])
    assert list(cell["systems"]) == ["onnxruntime", "ctranslate2-1thread"] and workers["ctranslate2-inter"].calls == 0
    assert cell["not_timed"] == {"ctranslate2-inter": "ctranslate2-1thread"} and "stand_ins" not in cell
    assert cell["ratios"]["onnxruntime"]["vs"] == "ctranslate2-1thread"
    assert cell["ratios"]["onnxruntime"]["median"] == pytest.approx(1.2)
    assert "not timed, repeating another here: ctranslate2-inter (= ctranslate2-1thread)" in logged
    wide = cell_of(workers, [[5, 6, 7], [8, 9]])  # batch 2: two sub-batches, inter is itself
    assert list(wide["systems"]) == names and "not_timed" not in wide

    # 1thread, the fastest, fails in its second round: timed again without it, inter standing in; the
    # ratios are over that second timing, not to 1thread's one round from the first
    workers = {"onnxruntime": FakeWorker(0.010), "ctranslate2-1thread": FakeWorker(0.005, die_at=5),
               "ctranslate2-inter": FakeWorker(0.011)}
    failed = cell_of(workers, [[5, 6, 7]])
    assert failed["stand_ins"] == {"ctranslate2-inter": "ctranslate2-1thread"} and "not_timed" not in failed
    assert list(failed["systems"]) == names
    assert failed["systems"]["ctranslate2-1thread"]["raw"]["error"].startswith("the onnxruntime worker died")
    assert len(failed["systems"]["ctranslate2-1thread"]["raw"]["decode"]) == 1
    assert len(failed["systems"]["onnxruntime"]["raw"]["decode"]) == 3  # the second timing's, not 3 + 3
    assert failed["ratios"]["onnxruntime"]["vs"] == "ctranslate2-inter" and failed["ct2_best"] == "ctranslate2-inter"
    assert failed["ratios"]["onnxruntime"]["median"] == pytest.approx(1.1)
    assert failed["timed_again"] == ["onnxruntime", "ctranslate2-inter"]
    assert "timed again, ctranslate2-inter in place of ctranslate2-1thread, which failed" in logged

    # ... and so is any other setting that failed in the first timing (here the default, the fastest)
    workers = {"onnxruntime": FakeWorker(0.010), "ctranslate2": FakeWorker(0.004, die_at=5),
               "ctranslate2-1thread": FakeWorker(0.012, die_at=3), "ctranslate2-inter": FakeWorker(0.011)}
    c = cells.timed_cell(workers, ["onnxruntime", "ctranslate2"] + names[1:], [[5, 6, 7]], 1, cfg, amd, logged.append)
    assert c["stand_ins"] == {"ctranslate2-inter": "ctranslate2-1thread"} and workers["ctranslate2"].calls == 5
    assert c["ct2_best"] == "ctranslate2-inter" and c["ratios"]["onnxruntime"]["median"] == pytest.approx(1.1)
    # with nothing of ours left to pair with, it is not timed at all
    workers = {"onnxruntime": FakeWorker(0.010, die_at=8), "ctranslate2-1thread": FakeWorker(0.012, die_at=3),
               "ctranslate2-inter": FakeWorker(0.011)}
    unpaired = cell_of(workers, [[5, 6, 7]])
    assert "stand_ins" not in unpaired and unpaired["not_timed"] == {"ctranslate2-inter": "ctranslate2-1thread"}
    assert workers["ctranslate2-inter"].calls == 0 and unpaired["ratios"] == {}

    size = {**DEMO_SIZE, "systems": {n: {"status": "ok"} for n in names}, "cells": [cell, wide, failed]}
    md = "\n".join(_size_section(size, {"steps": 8}))
    assert "ctranslate2-inter is not timed at greedy batch 1: there it runs as ctranslate2-1thread does" in md
    assert "none of our systems was left" not in md
    # where the setting it repeats failed and nothing of ours was left, the note says so
    unpaired.update(mode="beam4", batch=16)
    also = "\n".join(_size_section({**size, "cells": [cell, unpaired]}, {"steps": 8}))
    assert ("ctranslate2-inter is not timed at greedy batch 1, beam4 batch 16: there it runs as ctranslate2-1thread "
            "does") in also
    assert ("ctranslate2-1thread failed at beam4 batch 16, and none of our systems was left there to time "
            "ctranslate2-inter against in its place.") in also
    assert "ctranslate2-inter is timed at greedy batch 1 in place of ctranslate2-1thread, which failed there" in md
    assert ("ctranslate2-1thread (greedy, batch 1): failed after 1 of 3 rounds (the onnxruntime worker died (exit "
            "status -9)); its figures are over those; no ratio: the cell was timed again without it") in md
    import matplotlib.axes

    notes = []
    annotate = matplotlib.axes.Axes.annotate
    monkeypatch.setattr(matplotlib.axes.Axes, "annotate",
                        lambda ax, text, *a, **k: notes.append(text) or annotate(ax, text, *a, **k))
    unpaired = {**unpaired, "mode": "beam2"}  # a panel of its own, where 1thread has no round at all
    plot({"config": {"threads": 2, "steps": 8}, "sizes": [{**size, "cells": [cell, wide, failed, unpaired]}]},
         str(tmp_path / "bench.png"))
    assert notes == ["= 1thread", "failed"]  # inter's empty slot at greedy batch 1, 1thread's at beam2 batch 1
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_the_encoder_thread_rule_reads_plainly():
    from transduce.bench.worker import encoder_threads_rule

    assert encoder_threads_rule(1, 66) == "1"
    assert encoder_threads_rule(2, 66) == "1 below 66 source tokens per run, 2 from there"  # the demo model
    assert encoder_threads_rule(2, 2) == "1 for a run of one source token, 2 from two"  # the base model
    assert encoder_threads_rule(4, 1) == "4 always"


def test_a_hung_worker_is_stopped(tmp_path):
    import signal

    from transduce.bench.workers import Worker, WorkerError

    w = Worker("onnxruntime", {}, str(tmp_path / "worker.log"))
    try:
        os.kill(w.proc.pid, signal.SIGSTOP)
        with pytest.raises(WorkerError, match="did not answer 'quit' in 0.5 s and was stopped"):
            w.call({"op": "quit"}, timeout=0.5)
        assert w.proc.poll() is not None
    finally:
        w.close()


def test_cell_stats_derives_step_and_encoder():
    raw = {"decode": [0.40, 0.44, 0.42], "first": [0.05, 0.06, 0.04], "direct_encode": [0.01], "direct_step": [0.012],
           "calls": [1, 2, 1]}
    st = cell_stats(raw, batch=4, steps=11)
    assert st["calls_per_measurement"]["median"] == 1 and st["calls_per_measurement"]["max"] == 2
    assert st["decode_ms"]["median"] == pytest.approx(420.0)
    assert st["tokens_per_s"]["median"] == pytest.approx(4 * 11 / 0.42)
    assert st["sentences_per_s"]["max"] == pytest.approx(4 / 0.40)
    assert st["step_ms_derived"] == pytest.approx((420.0 - 50.0) / 10)
    assert st["encoder_ms_derived"] == pytest.approx(50.0 - 37.0)
    assert st["step_ms_direct"]["median"] == pytest.approx(12.0)


def test_config_validation_and_modes():
    assert beam_of("greedy") == 1 and beam_of("beam4") == 4
    with pytest.raises(ValueError):
        beam_of("beam")
    for bad, says in ((dict(steps=1), "--steps"), (dict(modes=["sampling"]), "unknown mode"),
                      (dict(backends=["tf"]), "unknown backend"),
                      (dict(batches=[0]), "--batches must be between 1 and 4096, got 0"),
                      (dict(batches=[]), "--batches .* got none"), (dict(threads=0), "--threads .* got 0"),
                      (dict(threads=5000), "--threads must be between 1 and 1024, got 5000"),
                      (dict(batches=[10**12]), "between 1 and 4096"),
                      (dict(ct2_settings=["fast"]), "CTranslate2 setting"),
                      (dict(sizes=["huge"]), "unknown model size"), (dict(sizes=[]), "--sizes names nothing"),
                      (dict(modes=[]), "--modes names nothing"), (dict(backends=[]), "--backends names nothing"),
                      (dict(backends=["tensorrt"]), "give --engine"), (dict(seed=-1), "--seed"),
                      (dict(min_seconds=float("nan")), "--min-seconds"), (dict(check_sentences=0), "--check-sentences"),
                      (dict(engines={"bogus": "."}), "'bogus' is not among the sizes"),
                      (dict(engines={"demo": "/nonexistent/e"}), "no such directory"),
                      (dict(sizes=["base"], model_dir="m"), "keep demo in --sizes"),
                      (dict(backends=["ctranslate2"], ct2_settings=[]), "--ct2-settings names nothing")):
        with pytest.raises(TransduceError, match=says):
            BenchConfig(**bad)
    q = BenchConfig.quick_preset(repeats=3)
    assert q.quick and q.repeats == 3 and q.sizes == ["demo"]
    twice = BenchConfig(sizes=["demo", "demo"], batches=[1, 1, 2], backends=["torch", "torch"], modes=["greedy"] * 2)
    assert (twice.sizes, twice.batches, twice.backends, twice.modes) == (["demo"], [1, 2], ["torch"], ["greedy"])


def test_paths_lengths_and_inputs_are_checked_before_any_work(tmp_path, tiny_model_dir, tiny_artifact_dir):
    """Each refused before a worker starts or anything is prepared (the cache stays empty)."""
    from transduce.bench.harness import run_bench

    (tmp_path / "afile").write_text("x")
    cache = tmp_path / "cache"
    base = dict(sizes=["demo"], backends=["torch"], model_dir=tiny_model_dir, cache_dir=str(cache), ceilings=False)
    cases = [
        (dict(out_dir=str(tmp_path / "afile")), "--out .* cannot be created"),
        (dict(out_dir=str(tmp_path / "afile" / "sub")), "--out .* cannot be created"),
        (dict(out_dir=str(cache / "demo")), "inside --cache-dir"),
        (dict(src_len=300), "--src-len 300 exceeds the demo model's max_positions"),
        (dict(steps=257), "--steps 257 exceeds"),
        (dict(model_dir=tiny_artifact_dir),
         "--model-dir [^:]*: '[^']*' is an ONNX export .transduce export., not a model directory"),
        (dict(model_dir=str(tmp_path)), "config.json is missing"),
        (dict(sizes=["base", "demo"], artifact_dir=str(tmp_path / "missing")), "--artifact-dir .* does not exist"),
    ]
    for extra, says in cases:
        cfg = BenchConfig(**{**base, "out_dir": str(tmp_path / "out"), **extra})
        with pytest.raises(TransduceError, match=says):
            run_bench(cfg, log=lambda m: None)
    assert not os.path.exists(cache) and not os.path.exists(tmp_path / "out")  # refused: no directory made
    # without matplotlib (the bench extra's) the run would be lost at its end, where it draws bench.png
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "matplotlib", None)
        with pytest.raises(TransduceError, match="matplotlib is not installed"):
            run_bench(BenchConfig(**{**base, "out_dir": str(tmp_path / "out")}), log=lambda m: None)
    assert not os.path.exists(cache / "demo")


def test_prepare_fills_the_config_in_and_survives_a_refused_conversion(tmp_path, tiny_model_dir, tiny_artifact_dir,
                                                                       edited_copy, monkeypatch):
    """A config.json without its defaulted fields is read whole (the report and floors read them all); a
    model CTranslate2's converter refuses (pre-norm, ...) is still prepared, CTranslate2 then not timed."""
    from transduce.bench import models
    from transduce.bench.ctranslate2 import convert as ctranslate2_export

    m = edited_copy(tiny_model_dir, "m", "config.json", lambda cfg: cfg["model"].pop("pad_id"))

    def refuse(*args, **kwargs):
        raise TransduceError("only post-norm models (norm_first=False) are converted to CTranslate2 here")

    monkeypatch.setattr(ctranslate2_export, "convert_to_ctranslate2", refuse)
    logged = []
    p = models.prepare("demo", str(tmp_path / "cache"), model_dir=str(m), artifact_dir=tiny_artifact_dir,
                       log=logged.append)
    assert p.config.pad_id == 0 and p.config.max_positions > 0
    assert p.ct2_dir is None and "only post-norm models" in p.ct2_error
    assert any("CTranslate2 is NOT timed" in line for line in logged)


def test_a_given_artifact_must_be_an_fp32_export_of_the_model(tmp_path, tiny_model_dir, tiny_artifact_dir,
                                                              edited_copy):
    from transduce.bench.models import check_artifact

    check_artifact(tiny_artifact_dir, tiny_model_dir)
    with pytest.raises(TransduceError, match="--artifact-dir .* does not exist|is missing|not an artifact"):
        check_artifact(str(tmp_path / "missing"), tiny_model_dir)
    other = edited_copy(tiny_model_dir, "other", "config.json",
                        lambda cfg: cfg["files"]["model.safetensors"].update(sha256="0" * 64))
    with pytest.raises(TransduceError, match="export of other weights"):
        check_artifact(tiny_artifact_dir, str(other))
    fp16 = edited_copy(tiny_artifact_dir, "fp16", "manifest.json", lambda m: m.update(precision="fp16"))
    with pytest.raises(TransduceError, match="is a fp16 export; the bench times fp32"):
        check_artifact(str(fp16), tiny_model_dir)


def test_max_positions_of_a_minimal_model_config(tiny_model_dir, edited_copy):
    """config.json may leave defaulted fields out (max_positions 256)."""
    from transduce.bench.models import max_positions

    m = edited_copy(tiny_model_dir, "m", "config.json", lambda cfg: cfg["model"].pop("max_positions"))
    assert max_positions("demo", str(m)) == 256


def test_the_bench_remakes_its_own_cached_model_when_broken(tmp_path, tiny_model_dir):
    import shutil

    from transduce.bench.models import BENCH_NOTE, _own_model

    path, made, logged = str(tmp_path / "model"), [], []

    def make(p):  # a model the bench made: its training record says so
        made.append(p)
        shutil.copytree(tiny_model_dir, p, dirs_exist_ok=True)
        cfg = json.loads((tmp_path / "model" / "config.json").read_text())
        cfg["training"] = {"note": f"random weights (seed 0) {BENCH_NOTE}"}
        (tmp_path / "model" / "config.json").write_text(json.dumps(cfg))

    assert _own_model(path, make, logged.append) == path and len(made) == 1  # absent: made
    assert _own_model(path, make, logged.append) == path and len(made) == 1 and not logged  # complete: reused
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.truncate(1000)
    _own_model(path, make, logged.append)
    assert len(made) == 2 and "remaking the cached model" in logged[0] and "1000 bytes" in logged[0]


def test_the_bench_never_replaces_a_model_it_did_not_make(tmp_path, tiny_model_dir):
    """A trained model where the cache keeps its random one (a --cache-dir that holds the user's runs), even
    one this version cannot load, is refused and left as it is; an empty directory is the bench's to fill."""
    import shutil

    from transduce.bench.models import _own_model
    from transduce.errors import TransduceError

    theirs = tmp_path / "theirs"
    shutil.copytree(tiny_model_dir, theirs)
    cfg = json.loads((theirs / "config.json").read_text())
    cfg["format_version"] = 99  # written by a later transduce
    (theirs / "config.json").write_text(json.dumps(cfg))
    before = {p.name: p.read_bytes() for p in theirs.iterdir() if p.is_file()}
    made = []
    with pytest.raises(TransduceError, match="holds a model it did not make"):
        _own_model(str(theirs), made.append, lambda m: None)
    assert not made and {p.name: p.read_bytes() for p in theirs.iterdir() if p.is_file()} == before
    (tmp_path / "empty").mkdir()
    _own_model(str(tmp_path / "empty"), made.append, lambda m: None)
    assert made == [str(tmp_path / "empty")]


def test_a_cache_dir_holding_the_users_models_is_refused(tmp_path, tiny_model_dir, monkeypatch):
    """--cache-dir runs would make CACHE/demo the demo's own run directory: refused before any work."""
    from transduce.bench.config import BenchConfig
    from transduce.bench.harness import run_bench
    from transduce.errors import TransduceError

    monkeypatch.chdir(tmp_path)  # runs/demo/model is relative to the working directory
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    with pytest.raises(TransduceError, match="would put the bench's demo models in"):
        run_bench(BenchConfig(sizes=["demo"], backends=["torch"], cache_dir="runs", out_dir="out", ceilings=False),
                  log=lambda m: None)
    with pytest.raises(TransduceError, match="which holds .*m1"):
        run_bench(BenchConfig(sizes=["demo"], backends=["torch"], cache_dir=str(tmp_path / "c"), out_dir="out",
                              model_dir=str(tmp_path / "c" / "demo" / "m1"), ceilings=False), log=lambda m: None)
    assert not os.path.exists(tmp_path / "runs" / "demo" / "model")


def test_a_logs_entry_that_is_a_file_is_a_clear_error(tmp_path, tiny_model_dir):
    from transduce.bench.config import BenchConfig
    from transduce.bench.harness import run_bench
    from transduce.errors import TransduceError

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "logs").write_text("x")
    with pytest.raises(TransduceError, match="logs directory"):
        run_bench(BenchConfig(sizes=["demo"], backends=["torch"], cache_dir=str(tmp_path / "c"),
                              out_dir=str(tmp_path / "out"), model_dir=tiny_model_dir, ceilings=False),
                  log=lambda m: None)


def test_a_conversion_by_another_ctranslate2_is_not_current(tmp_path, tiny_model_dir, tiny_ct2_dir):
    import shutil

    from transduce.bench.ctranslate2.convert import SOURCE_FILE, is_current

    copy_dir = tmp_path / "ct2"
    shutil.copytree(tiny_ct2_dir, copy_dir)
    assert is_current(str(copy_dir), tiny_model_dir)
    src = json.loads((copy_dir / SOURCE_FILE).read_text())
    src["ctranslate2"] = "99.0.0"
    (copy_dir / SOURCE_FILE).write_text(json.dumps(src))
    assert not is_current(str(copy_dir), tiny_model_dir)


def test_tokens_per_second_is_the_rate_at_the_median_time():
    """With an even number of rounds too: the row's tokens/s matches the decode time beside it."""
    st = cell_stats({"decode": [0.010, 0.020]}, batch=16, steps=32)
    assert st["decode_ms"]["median"] == pytest.approx(15.0)
    assert st["tokens_per_s"]["median"] == pytest.approx(16 * 32 / 0.015)
    assert st["tokens_per_s"]["max"] == pytest.approx(16 * 32 / 0.010)
    assert st["sentences_per_s"]["median"] == pytest.approx(16 / 0.015)


def test_ct2_conversion_is_redone_when_a_file_is_damaged(tmp_path, tiny_model_dir, tiny_ct2_dir):
    import shutil

    from transduce.bench.ctranslate2.convert import is_current

    for damage in ("truncate", "delete"):
        copy_dir = tmp_path / damage
        shutil.copytree(tiny_ct2_dir, copy_dir)
        assert is_current(str(copy_dir), tiny_model_dir)
        if damage == "truncate":
            with open(copy_dir / "model.bin", "r+b") as f:
                f.truncate(1000)
        else:
            os.remove(next(p for p in copy_dir.iterdir() if p.name.endswith("vocabulary.json")))
        assert not is_current(str(copy_dir), tiny_model_dir)


# -- ceilings --------------------------------------------------------------------------------------
def test_ceilings_and_floors_are_positive():
    c = ceilings.measure_ceilings(threads=1, copy_mib=8, matmul_n=128, repeats=2)
    assert c.bandwidth_gbs > 0 and c.matmul_gflops > 0
    assert all(v > 0 for v in c.detail.values()) and "numpy_matmul_gflops" in c.detail
    base = dict(vocab_size=8000, encoder_layers=6, decoder_layers=6, d_model=512, n_heads=8, d_ff=2048)
    # 6 x (6 D^2 + 2 D d_ff) + V D, plus biases and norms
    assert 26.1e6 < ceilings.decoder_step_weights(base) < 26.2e6
    one = ceilings.step_floor(base, c, rows=1, src_len=32, position=16)
    many = ceilings.step_floor(base, c, rows=64, src_len=32, position=16)
    assert 0 < one["seconds"] <= many["seconds"] and one["bytes"] > 4 * 25e6
    fl = ceilings.decode_floor(base, c, batch=16, beam=4, src_len=32, steps=32)
    assert fl["seconds"] > fl["encoder_seconds"] > 0 and fl["step_bound"] in ("memory", "compute")


def test_numpy_matmul_runs_on_the_bench_thread_count(monkeypatch):
    """numpy's BLAS pool is sized when it loads: its matmul is timed in a child started with `threads`."""
    import subprocess

    seen = {}
    run = subprocess.run

    def spy(cmd, env=None, **kw):
        seen.update(env)
        return run(cmd, env=env, **kw)

    monkeypatch.setattr(subprocess, "run", spy)
    assert ceilings.numpy_matmul_gflops(1, 64, 1) > 0
    assert all(seen[var] == "1" for var in ceilings.BLAS_THREAD_VARS)
    monkeypatch.setattr(ceilings, "_NUMPY_MATMUL", "raise SystemExit(3)")
    assert ceilings.numpy_matmul_gflops(1, 64, 1) is None


def test_a_direct_timing_hands_its_buffers_back(tiny_artifact_dir):
    """The bench's encoder/step timing ends its run as decode does (the backend's buffer pool keeps them)."""
    from transduce.bench.worker import _Ours

    w = _Ours("onnxruntime", tiny_artifact_dir, None, 1)
    ended = []
    end = w.backend.end
    w.backend.end = lambda state: (ended.append(state), end(state))
    w.direct([[5, 6, 7], [8, 9]], 2, 3)
    assert len(ended) == 1


def test_synthetic_tokenizer_has_the_base_vocabulary():
    from transduce.bench.models import BASE_VOCAB, synthetic_tokenizer

    tok = synthetic_tokenizer(BASE_VOCAB)
    assert tok.vocab_size == BASE_VOCAB
    assert [tok.id_to_token(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert tok.encode("w4 w7999 zzz") == [4, 7999, 3]


def test_a_measurement_repeats_short_calls_and_reports_their_median():
    from transduce.bench.worker import MAX_CALLS, repeated

    times = iter([0.05, 0.01, 0.02, 0.03, 0.04, 0.2])
    reply = repeated(lambda: {"seconds": next(times), "tokens": 7}, min_seconds=0.1)
    assert reply == {"seconds": pytest.approx(0.025), "calls": 4, "tokens": 7}  # 0.05 + 0.01 + 0.02 + 0.03 >= 0.1
    assert repeated(lambda: {"seconds": 0.5}, min_seconds=0.1)["calls"] == 1
    assert repeated(lambda: {"seconds": 0.0}, min_seconds=1.0)["calls"] == MAX_CALLS
    assert repeated(lambda: {"seconds": 0.01}, min_seconds=0.0)["calls"] == 1


def test_quantized_rows_get_no_fp32_floor_percentage():
    """The floors are derived for fp32 weights: an int8 row faster than the floor is not reported as the
    ceilings being under-measured (†), it gets no floor% and its own note (‡); an fp32 row faster than
    the floor still gets the dagger."""
    from transduce.bench.report import _size_section

    def stats(decode_ms):
        one = {"median": decode_ms, "min": decode_ms, "max": decode_ms, "n": 1}
        tps = {"median": 32 / decode_ms * 1e3, "min": 32 / decode_ms * 1e3, "max": 32 / decode_ms * 1e3, "n": 1}
        return {"stats": {"decode_ms": one, "tokens_per_s": tps, "sentences_per_s": tps, "first_ms": one}, "raw": {}}

    cell = {"mode": "greedy", "beam": 1, "batch": 1, "src_len": 32, "steps": 32, "ratios": {}, "ct2_best": None,
            "ct2_settings_ratio": {}, "foreign_cpu_share": 0.0,
            "floor": {"decode_ms": 100.0, "seconds": 0.1, "step_seconds": 0.003, "step_bound": "memory",
                      "encoder_seconds": 0.004},
            "systems": {"onnxruntime": stats(200.0), "onnxruntime-int8": stats(80.0)}}
    size = {"size": "base", "model": {"config": {"encoder_layers": 6, "decoder_layers": 6, "d_model": 512, "n_heads": 8,
                                                 "d_ff": 2048, "vocab_size": 8000}, "description": "random"},
            "systems": {"onnxruntime": {"status": "ok"}, "onnxruntime-int8": {"status": "ok"}}, "cells": [cell]}
    text = "\n".join(_size_section(size, {"steps": 32}))
    rows = {line.split("|")[3].strip(): line.split("|")[10].strip() for line in text.splitlines()
            if line.startswith("| greedy | 1 |") and "*floor*" not in line}
    assert rows == {"onnxruntime": "50%", "onnxruntime-int8": "n/a‡"}
    assert "‡ the floors are for fp32 weights" in text and "†" not in text

    cell["systems"]["onnxruntime"] = stats(90.0)  # fp32 faster than its floor: the ceilings were under-measured
    text = "\n".join(_size_section(size, {"steps": 32}))
    assert "111%†" in text and "† measured faster than the floor" in text

    # GPU systems: neither the CPU's floor nor a ratio to CTranslate2 on the CPU applies, whatever their speed
    cell["systems"] = {"tensorrt": stats(1.0), "torch-cuda": stats(300.0)}
    size["systems"] = {"tensorrt": {"status": "ok"}, "torch-cuda": {"status": "ok"}}
    text = "\n".join(_size_section(size, {"steps": 32}))
    rows = {line.split("|")[3].strip(): (line.split("|")[10].strip(), line.split("|")[11].strip())
            for line in text.splitlines() if line.startswith("| greedy | 1 |") and "*floor*" not in line}
    assert rows == {"tensorrt": ("GPU§", "GPU§"), "torch-cuda": ("GPU§", "GPU§")}
    assert "§ on the GPU" in text and "†" not in text


def test_the_report_says_how_onnxruntime_steps_use_the_threads():
    """The ONNX Runtime line names the step rule, and the one-row timings the backend chose it by."""
    from transduce.bench.report import _size_section

    size = {"size": "demo", "model": {"config": {"encoder_layers": 2, "decoder_layers": 2, "d_model": 128, "n_heads": 4,
                                                 "d_ff": 512, "vocab_size": 372}, "description": "trained"},
            "systems": {"onnxruntime": {"status": "ok", "info": {
                "step_threads_rule": "2 always",
                "encoder_threads_rule": "1 below 66 source tokens per run, 2 from there",
                "wide_steps": {"option": "auto", "rule": "always", "one_row_us": {"narrow": 97.3, "wide": 83.9}},
                "parts_rule": "a batch of 2 sentences or more and 8 rows or more in 2 parts at the same time"}}},
            "cells": []}
    text = "\n".join(_size_section(size, {"steps": 32}))
    assert ("ONNX Runtime's threads: steps 2 always (chosen when the backend loaded: a one-row step took 97.3 us on "
            "one thread, 83.9 us on the budget's); encoder 1 below 66 source tokens per run, 2 from there; a batch of "
            "2 sentences or more and 8 rows or more in 2 parts at the same time.") in text
    size["systems"]["onnxruntime"]["info"]["wide_steps"] = {"option": "rows", "rule": "rows"}
    assert "ONNX Runtime's threads: steps 2 always; encoder" in "\n".join(_size_section(size, {"steps": 32}))


def test_a_cached_artifact_with_an_older_ort_step_graph_is_exported_again(tmp_path, tiny_model_dir, tiny_artifact_dir,
                                                                           edited_copy):
    """The bench times this exporter's step graph: a cached export of the same weights whose
    decoder_step.ort.onnx is of an older revision is exported again, with the reason logged."""
    from transduce.bench.models import ensure_artifact
    from transduce.exporter import ort_step
    from transduce.formats import contract

    old = edited_copy(tiny_artifact_dir, "old", "manifest.json",
                      lambda m: m["graphs"][contract.ORT_STEP_FILE].pop("revision"))
    logged = []
    fresh = str(tmp_path / "fresh")
    assert ensure_artifact(tiny_model_dir, [str(old), fresh], log=logged.append) == fresh
    assert any("not timing" in m and "revision 1" in m for m in logged), logged
    assert read_manifest(fresh)["graphs"][contract.ORT_STEP_FILE]["revision"] == ort_step.REVISION
    assert ensure_artifact(tiny_model_dir, [tiny_artifact_dir, fresh], log=logged.append) == tiny_artifact_dir


def test_the_report_names_only_the_ctranslate2_settings_timed():
    """Settings left out because they repeat another on this CPU (nomkl-1thread and nomkl-inter off Intel's
    CPUs) are not named in the report's thread line."""
    from dataclasses import asdict

    from transduce.bench.report import markdown

    model = {"config": {"encoder_layers": 2, "decoder_layers": 2, "d_model": 128, "n_heads": 4, "d_ff": 512,
                        "vocab_size": 372}, "description": "trained"}
    timed = ("ctranslate2", "ctranslate2-avx2", "ctranslate2-1thread", "ctranslate2-inter")
    result = {"config": asdict(BenchConfig(threads=2)), "machine": {}, "date": "2026-11-25", "ceilings": None,
              "sizes": [{"size": "demo", "model": model, "systems": {n: {"status": "ok", "info": {}} for n in timed},
                         "cells": []}]}
    text = markdown(result)
    assert ("CTranslate2 intra_threads 2 (1 in its 1thread and inter settings), inter_threads 1 (2 in its inter "
            "setting, a batch decoded as 2 sub-batches") in text
    assert "nomkl" not in text
