"""The CTranslate2 conversion of imported multilingual models (M2M100 and NLLB-200: pre-norm with final stack norms,
fairseq's sinusoidal positions; mBART-50: learned positions, the embedding LayerNorm, gelu): CTranslate2 decodes
them as ours does with the language codes given as it takes them (the source code first in the source, the target
code as target_prefix), and the bench's token-equality gate passes them those codes."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from tests.bench.conftest import require_ct2

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "importers"))

FAMILIES = ("m2m100", "nllb", "mbart")


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    """(family, the imported model directory, its ONNX artifact, its CTranslate2 conversion), once per family."""
    require_ct2()
    pytest.importorskip("transformers", reason="the import extra is not installed")
    pytest.importorskip("sentencepiece", reason="the import extra is not installed")
    from multilingual_models import shared_export

    from transduce.bench.ctranslate2.convert import convert_to_ctranslate2

    model_dir, artifact = shared_export(request.param, tmp_path_factory)  # shared with the run's other modules
    ct2 = convert_to_ctranslate2(model_dir, str(tmp_path_factory.mktemp(request.param) / "ct2"))
    return request.param, model_dir, artifact, ct2


def _sources_and_prefix(family: str, model_dir: str) -> tuple[list[list[int]], list[int]]:
    """The demo sentences as ids after the English code, and the French code as the target prefix."""
    from hf_models import demo_sentences
    from multilingual_models import LANGS

    from transduce.models.checkpoint import load_tokenizer

    tok = load_tokenizer(model_dir)
    en, fr = LANGS[family]
    return [[tok.languages[en]] + tok.encode(s) for s, _ in demo_sentences(12, seed=5)], [tok.languages[fr]]


def test_the_conversion_has_the_models_structure(converted):
    """What the config says is what CTranslate2 was given: pre-norm, the embedding LayerNorm, the activation."""
    import json

    from transduce.formats.model_dir import model_config

    family, model_dir, _, ct2_dir = converted
    cfg = model_config(model_dir)
    assert cfg.norm_first and (cfg.positions == "learned") == (family == "mbart") == cfg.layernorm_embedding
    ct2_cfg = json.loads(open(os.path.join(ct2_dir, "config.json")).read())
    assert ct2_cfg["layer_norm_epsilon"] == cfg.layer_norm_eps and ct2_cfg["add_source_eos"]


def test_greedy_equals_ours_with_the_language_codes(converted):
    """Natural and forced greedy decoding: every output token-identical, log-probs within the check's tolerance,
    each output beginning with the target language's code."""
    from transduce.bench.ctranslate2.check import check_greedy_equality

    family, model_dir, _, ct2_dir = converted
    sources, prefix = _sources_and_prefix(family, model_dir)
    for forced in (None, 12):
        report = check_greedy_equality(model_dir, ct2_dir, sources, family, forced_steps=forced, target_prefix=prefix)
        print(report.summary())
        assert report.passed, report.summary()
        assert report.equal == len(sources) and "target prefix" in report.mode
    # not a vacuous equality: the outputs differ from sentence to sentence, in French
    from transduce.bench.ctranslate2.convert import ct2_translate_ids, ct2_vocab, load_translator

    got = ct2_translate_ids(load_translator(ct2_dir), ct2_vocab(ct2_dir), sources, max_length=40,
                            target_prefix=prefix)
    assert all(g[0] == prefix[0] for g in got) and len({tuple(g) for g in got}) > len(sources) // 2


def test_beam_log_probs_equal_ours_with_the_language_codes(converted):
    """Beam 4 under CTranslate2's stopping rule: CTranslate2 scores our beam outputs as we do; the outputs
    themselves may differ where the two searches' rules do (so they do on the post-norm demo model as well), so
    their count is reported, not required."""
    from transduce.bench.ctranslate2.check import check_greedy_equality

    family, model_dir, _, ct2_dir = converted
    sources, prefix = _sources_and_prefix(family, model_dir)
    report = check_greedy_equality(model_dir, ct2_dir, sources, family, beam_size=4, target_prefix=prefix)
    print(report.summary())
    assert "beam 4" in report.mode and "beam outputs token-identical" in report.summary()
    assert report.logprob_tolerance_exceeded == 0 and report.max_abs_logprob_diff < 1e-4, report.summary()
    assert report.equal >= len(sources) // 2, report.summary()


def test_the_bench_gate_passes_the_language_codes(converted):
    """`transduce bench --model-dir` on an imported multilingual model: the gate's held-out and random sources
    begin with the model's default source language's code, both outputs with a target's, and it passes."""
    from transduce.bench.config import BenchConfig
    from transduce.bench.gates import check_languages, equality_checks
    from transduce.bench.models import PreparedModel
    from transduce.formats.model_dir import model_config
    from transduce.models.checkpoint import load_tokenizer

    family, model_dir, _, ct2_dir = converted
    tok = load_tokenizer(model_dir)
    langs = check_languages(model_dir)
    assert langs.source == tok.default_source_lang and langs.target != langs.source
    assert langs.source_lead == (tok.languages[langs.source],) and langs.target_prefix == (tok.languages[langs.target],)
    prepared = PreparedModel("demo", model_dir, "", ct2_dir, model_config(model_dir), family, True)
    logs: list[str] = []
    cfg = BenchConfig(check_sentences=12, check_inputs=4, steps=12, src_len=12)
    checks = equality_checks(prepared, cfg, logs.append)
    assert [c["mode"] for c in checks] == [f"natural, target prefix {list(langs.target_prefix)}",
                                           f"forced-12, target prefix {list(langs.target_prefix)}"]
    assert all(c["passed"] for c in checks), logs
    assert any(f"begin with {langs.source}'s code" in line for line in logs)


def test_a_model_of_one_language_pair_has_no_codes_in_the_gate(tiny_model_dir):
    from transduce.bench.gates import check_languages

    assert check_languages(tiny_model_dir) is None


def test_separate_vocabularies_are_refused_with_the_reason(tiny_model_dir, tmp_path):
    """What cannot be mapped (a source vocabulary of its own) is refused before any weight is read."""
    import json
    import shutil

    require_ct2()
    from transduce.bench.ctranslate2.convert import convert_to_ctranslate2
    from transduce.errors import TransduceError

    model_dir = tmp_path / "separate"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["model"].update(src_vocab_size=config["model"]["vocab_size"] + 4, share_embeddings=False)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(TransduceError, match="one vocabulary for source and target") as e:
        convert_to_ctranslate2(model_dir, tmp_path / "ct2")
    assert "other systems" in e.value.hint and not (tmp_path / "ct2").exists()


def test_the_end_to_end_translate_op_gives_both_systems_the_language_codes(converted):
    """The bench's end-to-end cells on a multilingual model: ours with source_lang and target_lang, CTranslate2
    with the source's code first and the target's as target_prefix, as their users give them: the same greedy
    translations as Translator.translate's with those languages."""
    from hf_models import demo_sentences

    from transduce.bench.gates import check_languages
    from transduce.bench.worker import _CTranslate2, _Ours

    family, model_dir, artifact, ct2_dir = converted

    texts = [s for s, _ in demo_sentences(8, seed=7)]
    langs = dataclasses.asdict(check_languages(model_dir))
    ours = _Ours("onnxruntime", artifact, model_dir, 1)
    theirs = _CTranslate2(ct2_dir, 1, model_dir=model_dir)
    want = None
    for one in (False, True):
        a = ours.translate(texts, 1, None, one, langs)["outputs"]
        b = theirs.translate(texts, 1, None, one, langs)["outputs"]
        if want is None:
            want = ours._translator.translate(texts, beam_size=1, source_lang=langs["source"],
                                              target_lang=langs["target"])
        assert a == [t.text for t in want]
        # the same where ours ended by itself (at the maximum length the two count the forced code apart)
        ended = [i for i, t in enumerate(want) if t.nbest[0].finished]
        assert len(ended) >= 4 and [a[i] for i in ended] == [b[i] for i in ended]
