"""The bench's opus-mt size, prepared at a tiny shape (a Hugging Face MarianMTModel built locally, imported, exported,
converted by CTranslate2's own converter, token-identical to ours), and the int8 rows held against CTranslate2's own
int8. No timing assertions."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

TINY = dict(d_model=32, encoder_layers=2, decoder_layers=2, heads=4, d_ff=64, vocab_size=1500)


@pytest.fixture(scope="module")
def opus_prepared(tmp_path_factory):
    pytest.importorskip("transformers", reason="the import extra is not installed")
    pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed")
    from transduce.bench.models import prepare

    cache = str(tmp_path_factory.mktemp("bench-cache"))
    logs: list[str] = []
    return prepare("opus-mt", cache, shape=TINY, log=logs.append), cache, logs


def test_opus_mt_prepares_an_imported_marian_with_ctranslate2s_own_conversion(opus_prepared):
    prepared, cache, _ = opus_prepared
    hf = os.path.join(cache, "opus-mt", "hf")
    hf_cfg = json.loads(open(os.path.join(hf, "config.json")).read())
    assert hf_cfg["model_type"] == "marian" and hf_cfg["activation_function"] == "swish"
    vocab = json.loads(open(os.path.join(hf, "vocab.json")).read())
    assert len(vocab) == 1500 and vocab["<pad>"] == 1499 and "<placeholder_0>" in vocab  # padded to the size
    c = prepared.config
    assert (c.vocab_size, c.d_model, c.encoder_layers, c.activation, c.position_layout) == (
        1500, 32, 2, "swish", "halves")
    assert os.path.isfile(os.path.join(prepared.artifact_dir, "manifest.json"))
    source = json.loads(open(os.path.join(prepared.ct2_dir, "transduce_source.json")).read())
    assert source["converter"] == "ctranslate2.converters.TransformersConverter"
    assert source["hf_dir"] == os.path.abspath(hf) and prepared.ct2_error is None
    from transduce.bench.ctranslate2.convert import ct2_vocab

    assert len(ct2_vocab(prepared.ct2_dir)) == 1499  # its converter drops Marian's pad row


def test_opus_mt_greedy_is_ctranslate2s_token_for_token(opus_prepared):
    from transduce.bench.ctranslate2.check import check_greedy_equality
    from transduce.bench.inputs import id_limit, random_sources

    prepared, _, _ = opus_prepared
    assert id_limit(prepared.config) == 1499  # the random ids never reach the pad CTranslate2 does not have
    src = random_sources(np.random.default_rng(3), 6, 10, id_limit(prepared.config))
    for forced in (None, 12):
        report = check_greedy_equality(prepared.model_dir, prepared.ct2_dir, src, "opus-mt", forced_steps=forced)
        assert report.passed, report.summary()


def test_opus_mt_is_reused_from_the_cache(opus_prepared):
    from transduce.bench.models import prepare

    prepared, cache, _ = opus_prepared
    again: list[str] = []
    same = prepare("opus-mt", cache, shape=TINY, log=again.append)
    assert same.model_dir == prepared.model_dir and not any("building" in m or "importing" in m for m in again)
    assert not any(m.startswith("exporting") for m in again)


def test_int8_rows_are_held_against_ctranslate2s_own_int8():
    from transduce.bench.ctranslate2.settings import CT2_INT8
    from transduce.bench.stats import ct2_ratios

    raw = {"onnxruntime": {"decode": [0.2, 0.2]}, "onnxruntime-int8": {"decode": [0.1, 0.1]},
           "ctranslate2": {"decode": [0.4, 0.4]}, CT2_INT8: {"decode": [0.25, 0.3]}}
    out = ct2_ratios(raw, list(raw))
    assert out["ct2_best"] == "ctranslate2"  # CTranslate2's int8 is never fp32's reference
    assert out["ratios"]["onnxruntime"]["vs"] == "ctranslate2"
    assert out["ratios"]["onnxruntime-int8"]["vs"] == CT2_INT8
    assert out["ratios"]["onnxruntime-int8"]["per_round"] == pytest.approx([2.5, 3.0])
    assert CT2_INT8 not in out["ratios"]
    del raw[CT2_INT8]  # without CTranslate2's int8 no int8 ratio, rather than one against its fp32
    assert "onnxruntime-int8" not in ct2_ratios(raw, list(raw))["ratios"]


def test_the_report_names_the_int8_rows_reference():
    from transduce.bench.ctranslate2.settings import CT2_INT8
    from transduce.bench.report import _Marks, _system_row
    from transduce.bench.stats import cell_stats, ct2_ratios

    raw = {"onnxruntime-int8": {"decode": [0.1, 0.1], "first": [0.02, 0.02]},
           "ctranslate2": {"decode": [0.4, 0.4], "first": [0.05, 0.05]},
           CT2_INT8: {"decode": [0.25, 0.3], "first": [0.04, 0.04]}}
    cell = {"mode": "greedy", "batch": 1, "steps": 4, "systems": {n: {"stats": cell_stats(r, 1, 4), "raw": r}
                                                                 for n, r in raw.items()}, **ct2_ratios(raw, list(raw))}
    row = _system_row(cell, "onnxruntime-int8", cell["systems"]["onnxruntime-int8"], None, "", _Marks())
    assert f"vs {CT2_INT8} (int8)" in row and "(fp32)" not in row


def test_int8_run_loads_ctranslate2_with_compute_type_int8(opus_prepared):
    from transduce.bench import harness
    from transduce.bench.config import BenchConfig
    from transduce.bench.ctranslate2.settings import CT2_INT8
    from transduce.bench.worker import _load

    prepared, _, _ = opus_prepared
    cfg = BenchConfig(quantize=["int8"], backends=["onnxruntime", "ctranslate2"], ct2_settings=["default"])
    assert CT2_INT8 in harness._system_names(cfg, None)
    assert CT2_INT8 not in harness._system_names(BenchConfig(backends=["onnxruntime", "ctranslate2"]), None)
    req, why = harness._load_request(CT2_INT8, "opus-mt", prepared, cfg, {}, {})
    assert why is None and req["compute_type"] == "int8" and req["path"] == prepared.ct2_dir
    system = _load(req)
    assert system.translator.compute_type.startswith("int8")
    assert system.decode([[5, 6, 7]], beam=1, steps=3)["tokens"] == 3
