"""NLLB-200, M2M100 and mBART-50 import: tiny trained models (multilingual_models) import to models whose tokenizer
gives Hugging Face's ids (the source language's code first), whose log-probs are HF's, and whose greedy and beam
translations on torch and ONNX Runtime, forced into the target language, are HF generate's with the same explicit
options."""

from __future__ import annotations

import pytest
from compare import hf_generate, teacher_forced_error
from multilingual_models import LANGS, hf_tokenizer, shared_build, shared_export

from transduce.errors import InputError
from transduce.models.checkpoint import load_model_dir

FAMILIES = ("nllb", "m2m100", "mbart")
CODES = {"nllb": 202, "m2m100": 100, "mbart": 52}  # the tokenizers' language codes
MAX_NEW = 20


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(family, its Hugging Face directory, the imported model directory), shared with the run's other modules:
    the tests read them and never change them."""
    model_dir, _ = shared_export(request.param, tmp_path_factory)
    return request.param, shared_build(request.param, tmp_path_factory), model_dir


@pytest.fixture(scope="module")
def artifact(family, tmp_path_factory) -> str:
    """The family's imported model exported to ONNX, once per run: the tests read it and never change it."""
    return shared_export(family[0], tmp_path_factory)[1]


def _hf(fam, hf_dir):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval(), hf_tokenizer(fam, hf_dir)


def _as_hugging_face(fam, hf, src, tok, tr, texts, target, beams, backend):
    """Our translations into `target` with beams, asserted equal token for token to HF generate's with the same
    explicit options -> ours."""
    theirs = hf_generate(hf, src, tok.eos_id, num_beams=beams, max_new_tokens=MAX_NEW,
                         forced_bos_token_id=tok.languages[target])
    ours = tr.translate(texts, beam_size=beams, length_penalty=1.0, length_penalty_form="plain", max_len_a=0,
                        max_len_b=MAX_NEW, target_lang=target)
    equal = sum(list(o.tokens) == t for o, t in zip(ours, theirs))
    print(f"{fam} beam {beams}: {equal}/{len(texts)} equal to Hugging Face's generate ({backend})")
    assert equal == len(texts)
    return ours


def _code_id(hf_tok, fam, lang):
    return hf_tok.get_lang_id(lang) if fam == "m2m100" else hf_tok.convert_tokens_to_ids(lang)


def test_tokenizer_and_languages_are_hugging_faces(family, demo_pairs):
    fam, hf_dir, out = family
    _, tok, cfg = load_model_dir(out)
    _, hf_tok = _hf(fam, hf_dir)
    en, fr = LANGS[fam]
    assert tok.default_source_lang == en and tok.default_target_lang is None
    assert tok.languages[fr] == _code_id(hf_tok, fam, fr) and len(tok.languages) == CODES[fam]
    mc = cfg["model"]
    assert mc["norm_first"] and (mc["bos_id"], mc["eos_id"]) == (2, 2)
    assert mc["position_offset"] == (0 if fam == "mbart" else 2)  # mBART's offset is in its learned table's rows
    for s, t in demo_pairs:
        assert [tok.languages[en]] + tok.encode(s) + [tok.eos_id] == hf_tok(s)["input_ids"], s
        hf_tok.src_lang = fr
        assert [tok.languages[fr]] + tok.encode(t) + [tok.eos_id] == hf_tok(t)["input_ids"], t
        hf_tok.src_lang = en
    ids = hf_tok(demo_pairs[0][1])["input_ids"]  # the language code is never text (M2M100's HF decode keeps it)
    assert tok.decode(ids) == hf_tok.decode(ids[1:], skip_special_tokens=True) == demo_pairs[0][1]


def test_log_probs_greedy_and_beam_are_hugging_faces(family, demo_pairs):
    """Teacher-forced log-probs within 1e-5, and the Translator's greedy and beam-4 outputs (target_lang) are
    generate's with forced_bos_token_id, token for token, on torch."""
    from transduce.runtime.translator import Translator

    fam, hf_dir, out = family
    model, tok, cfg = load_model_dir(out)
    hf, hf_tok = _hf(fam, hf_dir)
    en, fr = LANGS[fam]
    src = [hf_tok(s)["input_ids"] for s, _ in demo_pairs]
    hf_tok.src_lang = fr
    tgt = [hf_tok(t)["input_ids"] for _, t in demo_pairs]
    hf_tok.src_lang = en
    err = teacher_forced_error(model, hf, src, tgt, cfg["model"]["bos_id"])
    assert err < 1e-5, err
    tr = Translator.from_model_dir(out)
    texts = [s for s, _ in demo_pairs]
    for beams in (1, 4):
        ours = _as_hugging_face(fam, hf, src, tok, tr, texts, fr, beams, "torch")
        assert all(o.tokens[0] == tok.languages[fr] and o.text == tok.decode(o.tokens[1:]) for o in ours)
    assert any(o.text == t for o, (_, t) in zip(ours, demo_pairs)) and len({o.text for o in ours}) > 4  # it learnt
    into_en = tr.translate(texts, beam_size=1, target_lang=en)  # the target language decides the output
    assert sum(a.text != b.text for a, b in zip(into_en, ours)) >= len(texts) // 4


def test_onnx_runtime_decodes_as_hugging_face_and_parity_passes(family, artifact, demo_pairs, tmp_path, monkeypatch):
    from transduce.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend
    from transduce.runtime.spec import BackendSpec
    from transduce.runtime.translator import Translator
    from transduce.verify.parity import parity_for_artifact

    fam, hf_dir, out = family
    _, tok, _ = load_model_dir(out)
    hf, hf_tok = _hf(fam, hf_dir)
    fr = LANGS[fam][1]
    tr = Translator(OnnxRuntimeBackend(artifact), tok)
    texts = [s for s, _ in demo_pairs]
    src = [hf_tok(s)["input_ids"] for s in texts]
    for beams in (1, 4):
        _as_hugging_face(fam, hf, src, tok, tr, texts, fr, beams, "ONNX Runtime")
    (tmp_path / "src.txt").write_text("\n".join(texts[:8]) + "\n")
    with pytest.raises(InputError, match="target_lang is required"):
        parity_for_artifact(artifact, BackendSpec(model_dir=out), input_path=str(tmp_path / "src.txt"), sentences=8)
    report = parity_for_artifact(artifact, BackendSpec(model_dir=out), input_path=str(tmp_path / "src.txt"),
                                 sentences=8, beam_size=4, target_lang=fr)
    assert report.passed, report.to_dict()
    # the sources begin with the source language's code and every output with the target's, as decoding's
    from transduce.verify import parity as parity_module

    en_code, fr_code = tok.languages[LANGS[fam][0]], tok.languages[fr]
    firsts, outputs, first_lps = [], [], []
    real_encode, real_decode = tr.backend.encode, parity_module.decode

    def encode(src, lens):
        firsts.extend(src[:, 0].tolist())
        return real_encode(src, lens)

    def decode(*args, **kwargs):
        results = real_decode(*args, **kwargs)
        outputs.extend(r.best.tokens[0] for r in results)
        first_lps.extend(r.best.token_log_probs[0] for r in results)
        return results

    monkeypatch.setattr(tr.backend, "encode", encode)
    monkeypatch.setattr(parity_module, "decode", decode)
    report = parity_module.run_parity(tr.backend, tr.backend, tok, texts[:3], beam_size=2,
                                      source_lang=LANGS[fam][0], target_lang=fr)
    assert report.passed and set(firsts) == {en_code} and set(outputs) == {fr_code} and len(outputs) == 5 * 3
    # and the code counted at log-prob 0 in both searches, as decoding counts it
    assert set(first_lps) == {0.0}


def test_score_places_the_language_codes_as_decoding_does(family, demo_pairs, tmp_path):
    """A translation's score given back by score() with the same languages: the source code first, the target
    code forced and counted at log-prob 0, as decoding counts it (before, the pair was scored without its
    codes); the target language is needed as decoding needs it."""
    from transduce.runtime.translator import Translator

    fam, _, out = family
    tr = Translator.from_model_dir(out)
    en, fr = LANGS[fam]
    texts = [s for s, _ in demo_pairs[:6]]
    done = tr.translate(texts, beam_size=1, source_lang=en, target_lang=fr)
    scores = tr.score(texts, [t.text for t in done], source_lang=en, target_lang=fr)
    compared = 0
    for t, s in zip(done, scores, strict=True):
        assert s.tokens[0] == tr.tokenizer.languages[fr] and s.token_log_probs[0] == 0
        if s.tokens == t.tokens and t.nbest[0].finished:  # the text gives back its tokens
            assert s.log_prob == pytest.approx(t.nbest[0].log_prob, abs=1e-4)
            assert s.score == pytest.approx(t.score, abs=1e-4)
            compared += 1
    assert compared >= 3
    with pytest.raises(InputError, match="target_lang is required"):
        tr.score(texts[:1], [done[0].text])
    # an over-long target: its own tokens counted, the forced code apart
    limit = tr.config.max_positions - 2
    long = " ".join(["seven"] * tr.config.max_positions)
    own = len(tr.tokenizer.encode_target(long))
    with pytest.raises(InputError, match=f"target line 1 has {own} tokens; this model takes at most {limit} after "
                                         "its language code"):
        tr.score(texts[:1], [long], source_lang=en, target_lang=fr)


def test_language_options_are_checked(family):
    from transduce.runtime.translator import Translator

    fam, _, out = family
    tr = Translator.from_model_dir(out)
    with pytest.raises(InputError, match="target_lang is required") as e:
        tr.translate(["seven"], beam_size=1)
    assert e.value.params == ("target_lang",) and f"({len(tr.tokenizer.languages)} languages)" in e.value.hint
    with pytest.raises(InputError, match="target_lang 'xx_Yyyy' is not one of this model's languages"):
        tr.translate(["seven"], target_lang="xx_Yyyy")
    with pytest.raises(InputError, match="source_lang 'klingon'"):
        tr.translate(["seven"], target_lang=LANGS[fam][1], source_lang="klingon")


def test_replace_unknowns_counts_the_text_after_the_source_language_code(family):
    """A multilingual source begins with its language code, which the text's own pieces lack: each <unk> takes the
    piece its attention peaks on counted after the code (one on the code is dropped), and the forced target code,
    never text, stays out of the replaced text."""
    from transduce.runtime.translator import Translator

    fam, _, out = family
    tr = Translator.from_model_dir(out)
    tok, unk = tr.tokenizer, tr.config.unk_id
    text = "seven \u2603 two"
    pieces = tok.source_pieces(text)
    got = tr.translate([text], beam_size=1, max_len_b=6, target_lang=LANGS[fam][1], prefixes=[[unk] * 3],
                       replace_unknowns=True)[0]
    code = tok.languages[LANGS[fam][1]]
    assert got.tokens[:4] == (code, unk, unk, unk)  # positions count the model's tokens, the codes included
    source_of = {j: s for s, j in got.alignment}
    want = [pieces[source_of[j] - 1] if i == unk else tok.id_to_token(i)
            for j, i in enumerate(got.tokens) if i != code and (i != unk or source_of.get(j, 0) >= 1)]
    assert got.text == tok.decode_pieces(want)
    assert tok.id_to_token(code) not in got.text


def test_a_model_without_languages_refuses_them(marian_swish_imported):
    from transduce.runtime.translator import Translator

    tr = Translator.from_model_dir(marian_swish_imported)
    with pytest.raises(InputError, match="this model has no language codes") as e:
        tr.translate(["seven"], target_lang="fr")
    assert e.value.params == ("target_lang",)


def test_cli_decode_and_score_take_the_languages(family, artifact, tmp_path):
    from click.testing import CliRunner

    from transduce.cli import main
    from transduce.runtime.api import load

    fam = family[0]
    (tmp_path / "in.txt").write_text("seven\n")
    args = ["decode", artifact, "--input", str(tmp_path / "in.txt"), "--beam-size", "1"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "--target-lang is required" in r.output, r.output
    r = CliRunner().invoke(main, args + ["--target-lang", LANGS[fam][1]])
    assert r.exit_code == 0, r.output
    # score takes the languages too: the translation scored as decode --scores scored it
    translation = r.output.strip()
    (tmp_path / "pairs.tsv").write_text(f"seven\t{translation}\n")
    args = ["score", artifact, "--input", str(tmp_path / "pairs.tsv")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "--target-lang is required" in r.output, r.output
    r = CliRunner().invoke(main, args + ["--source-lang", LANGS[fam][0], "--target-lang", LANGS[fam][1]])
    assert r.exit_code == 0, r.output
    want = load(artifact).score(["seven"], [translation], source_lang=LANGS[fam][0],
                                                  target_lang=LANGS[fam][1])[0]
    assert float(r.output) == pytest.approx(want.log_prob, abs=1e-5) and want.token_log_probs[0] == 0
    # and parity: the codes as decoding places them
    args = ["parity", artifact, "--input", str(tmp_path / "in.txt"), "-n", "1", "--beam-size", "2"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "--target-lang is required" in r.output, r.output
    r = CliRunner().invoke(main, args + ["--target-lang", LANGS[fam][1]])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_libretranslate_route_takes_the_models_codes_and_iso_codes(family, artifact, engine):
    """LibreTranslate's /translate on a multilingual model, served with the engine in its thread or its own
    process (both warm up naming a target, which the model needs): its own codes or the two-letter ones clients
    send select the source and target languages (the same translation as target_lang offline); /languages lists
    the model's codes; a language it lacks is LibreTranslate's 400."""
    from starlette.testclient import TestClient

    from transduce.runtime.api import load
    from transduce.runtime.spec import BackendSpec
    from transduce.serve.app import create_app
    from transduce.serve.server import build_service

    fam = family[0]
    source, target = LANGS[fam]
    service, identity = build_service(artifact, BackendSpec(threads=1), engine=engine)
    offline = load(artifact, threads=1)
    try:
        client = TestClient(create_app(service, identity))
        want = offline.translate(["seven"], target_lang=target)[0].text
        for src, tgt in ((source, target), ("en", "fr"), ("auto", "fr")):
            r = client.post("/translate", json={"q": "seven", "source": src, "target": tgt})
            assert r.status_code == 200 and r.json()["translatedText"] == want, (src, tgt, r.text)
        assert r.json()["detectedLanguage"]["language"] == source
        back = offline.translate(["sept"], source_lang=target, target_lang=source)[0].text
        r = client.post("/translate", data={"q": "sept", "source": "fr", "target": "en"})
        assert r.status_code == 200 and r.json()["translatedText"] == back, r.text
        r = client.post("/translate", json={"q": "seven", "source": "en", "target": "xx"})
        assert r.status_code == 400 and r.json() == {"error": "xx is not supported"}
        listing = {row["code"]: row for row in client.get("/languages").json()}
        assert {source, target} <= set(listing) and target in listing[source]["targets"]
        assert listing[source]["name"] == "English"
        # /v1/score takes the languages as offline score() does (the codes placed, the target's counted at 0)
        r = client.post("/v1/score", json={"source": ["seven"], "target": [want], "source_lang": source,
                                           "target_lang": target})
        scored = offline.score(["seven"], [want], source_lang=source, target_lang=target)[0]
        assert r.status_code == 200 and r.json()["scores"][0]["tokens"] == list(scored.tokens), r.text
        assert r.json()["scores"][0]["log_prob"] == pytest.approx(scored.log_prob, abs=1e-5)
    finally:
        service.stop()


def test_mbart_has_learned_positions_and_embedding_norms(family):
    """mBART's deviations: a learned table per stack (HF's rows from its offset 2 on) and a LayerNorm on
    embeddings + positions in both stacks, as weights of the model directory."""
    from transformers import AutoModelForSeq2SeqLM

    fam, hf_dir, out = family
    if fam != "mbart":  # the family fixture's other instances: skipped, never rebuilt
        pytest.skip("mBART's own layout")
    model, _, cfg = load_model_dir(out)
    hf = AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    assert model.cfg.deviations() == {"activation": "gelu", "positions": "learned", "layernorm_embedding": True}
    assert not hasattr(model, "pe")
    for stack in ("encoder", "decoder"):
        theirs = getattr(hf.model, stack)
        assert (getattr(model, f"{stack}_positions").weight == theirs.embed_positions.weight[2:]).all()
        assert (getattr(model, f"{stack}_embed_norm").weight == theirs.layernorm_embedding.weight).all()


def test_mbart_cc25_tokenizer_is_refused(family, tmp_path):
    import json
    import shutil

    from transduce.errors import ImportCheckpointError
    from transduce.importers import import_model

    fam, hf_dir, _ = family
    if fam != "mbart":
        pytest.skip("mBART's own check")
    src = shutil.copytree(hf_dir, tmp_path / "cc25")
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "tokenizer_class": "MBartTokenizer"}))
    with pytest.raises(ImportCheckpointError, match="MBartTokenizer, mBART-cc25's") as e:
        import_model("mbart", src, tmp_path / "out")
    assert "MBart50Tokenizer" in e.value.hint and not (tmp_path / "out").exists()


def test_generation_configs_forced_bos_is_the_default_target_language(family, tmp_path):
    """generation_config.json's forced_bos_token_id (what HF's generate forces when asked nothing) is the imported
    model's default target language, as config.json's is, without a warning; decoding with no target_lang then
    translates into it."""
    import json
    import shutil
    import warnings

    from transduce.importers import import_model
    from transduce.runtime.translator import Translator

    fam, hf_dir, out = family
    _, tok, _ = load_model_dir(out)
    fr = LANGS[fam][1]
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    gen_path = src / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen["forced_bos_token_id"] = tok.languages[fr]
    gen_path.write_text(json.dumps(gen))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        imported = import_model(fam, src, tmp_path / "model")
    _, tok2, _ = load_model_dir(imported)
    assert tok2.default_target_lang == fr
    tr = Translator.from_model_dir(imported)
    want = tr.translate(["seven", "eight"], beam_size=1, target_lang=fr)
    assert [o.tokens for o in tr.translate(["seven", "eight"], beam_size=1)] == [o.tokens for o in want]
    gen["forced_bos_token_id"] = 5  # a piece, not a language code: said, not taken as a language
    gen_path.write_text(json.dumps(gen))
    with pytest.warns(UserWarning, match="forced_bos_token_id = 5 .*not carried over"):
        imported = import_model(fam, src, tmp_path / "model2")
    assert load_model_dir(imported)[1].default_target_lang is None
