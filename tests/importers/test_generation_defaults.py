"""An imported model decodes by default as its source framework does: the Hugging Face model's generation_config.json
(or fairseq-generate's defaults) become the model directory's decoding defaults, carried into its export, so that
Translator.translate(), `transduce decode` and `transduce serve` with no options give what HF's default
model.generate(**inputs) gives; every option given still overrides them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from compare import hf_generate

from transduce.formats.model_dir import ModelDir

MAX_LENGTH = 16  # short, so that some of the random model's outputs reach it and end with the forced EOS


def _opus_like(src, dst, num_beams: int, **extra) -> str:
    """A copy of a tiny Marian directory with an OPUS-MT-like generation_config.json."""
    shutil.copytree(src, dst)
    vocab = json.loads((dst / "vocab.json").read_text())
    pad = vocab["<pad>"]
    gen = {"bad_words_ids": [[pad]], "decoder_start_token_id": pad, "eos_token_id": 0, "forced_eos_token_id": 0,
           "max_length": MAX_LENGTH, "num_beams": num_beams, "pad_token_id": pad, **extra}
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return str(dst)


def _hf_default(path, src_ids, eos):
    """HF's own default decoding of each source (from_pretrained reads generation_config.json), one at a time."""
    from transformers import AutoModelForSeq2SeqLM

    hf = AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    return hf_generate(hf, src_ids, eos)


def _agreement(ours, theirs) -> int:
    return sum(o == t for o, t in zip(ours, theirs, strict=True))


@pytest.fixture(scope="module")
def opus_like(marian_swish, tmp_path_factory):
    """opus_like(num_beams) -> (an OPUS-MT-like copy of the tiny Marian (_opus_like), its import, the import's
    export), made once per beam size for this module's tests, which only read them."""
    from transduce.exporter.onnx_export import export_artifact
    from transduce.importers import import_model

    made: dict[int, tuple[str, str, str]] = {}

    def make(num_beams: int) -> tuple[str, str, str]:
        if num_beams not in made:
            root = tmp_path_factory.mktemp(f"opus-like-{num_beams}")
            hf_dir = _opus_like(marian_swish, root / "hf", num_beams)
            out = import_model("marian", hf_dir, root / "model")
            export_artifact(out, root / "artifact")
            made[num_beams] = hf_dir, str(out), str(root / "artifact")
        return made[num_beams]

    return make


@pytest.mark.parametrize("num_beams", [4, 6])
def test_default_decoding_is_hugging_faces_default_generate(opus_like, demo_pairs, num_beams):
    from transduce.inspect.report import inspect_path
    from transduce.runtime.api import load
    from transduce.runtime.translator import Translator

    hf_dir, out, art = opus_like(num_beams)
    defaults = ModelDir.load(out).decoding_defaults
    assert defaults.overrides() == {
        "beam_size": num_beams, "length_penalty": 1.0, "length_penalty_form": "plain", "early_stopping": "heuristic",
        "max_len_a": 0.0, "max_len_b": MAX_LENGTH - 1, "min_length": 0, "forced_eos": True,
        "no_repeat_ngram_size": 0, "repetition_penalty": 1.0, "suppress": ((101,),)}
    texts = [s for s, _ in demo_pairs]
    tr = Translator.from_model_dir(out)
    src = [tr.tokenizer.encode(t) + [tr.config.eos_id] for t in texts]
    theirs = _hf_default(hf_dir, src, tr.config.eos_id)
    assert any(len(t) == MAX_LENGTH - 2 for t in theirs)  # some reach max_length: EOS forced there
    ours = [list(r.tokens) for r in tr.translate(texts)]
    print(f"marian beam {num_beams}, torch: {_agreement(ours, theirs)}/{len(texts)} equal to HF's generate()")
    assert ours == theirs
    # the paper's options where the user asks for them: every option given overrides the model's
    greedy = [list(r.tokens) for r in tr.translate(texts, beam_size=1)]
    hf_greedy = [t[:MAX_LENGTH - 2] for t in hf_generate(
        __import__("transformers").AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval(), src, 0, num_beams=1)]
    assert greedy == hf_greedy
    for path in (out, art):  # inspect shows them, the export's from its copy of config.json
        shown = inspect_path(path)["decoding_defaults"]
        assert (shown["source"], shown["beam_size"]) == ("generation_config.json", num_beams), shown
    ort = [list(r.tokens) for r in load(art).translate(texts)]
    print(f"marian beam {num_beams}, onnxruntime: {_agreement(ort, theirs)}/{len(texts)} equal to HF's generate()")
    assert ort == theirs


def test_a_model_without_generation_config_takes_config_json_keys_then_hf_defaults(marian_swish, tmp_path):
    from transduce.importers import import_model

    shutil.copytree(marian_swish, tmp_path / "old")
    (tmp_path / "old" / "generation_config.json").unlink()
    cfg = json.loads((tmp_path / "old" / "config.json").read_text())
    cfg.update(num_beams=6, max_length=512)  # an older OPUS-MT config.json
    (tmp_path / "old" / "config.json").write_text(json.dumps(cfg))
    defaults = ModelDir.load(import_model("marian", tmp_path / "old", tmp_path / "m")).decoding_defaults
    assert (defaults.source, defaults.beam_size, defaults.max_len_b, defaults.early_stopping) == (
        "config.json", 6, 511, "heuristic")
    # nothing set anywhere: HF's GenerationConfig defaults (greedy, max_length 20)
    defaults = ModelDir.load(import_model("marian", marian_swish, tmp_path / "m2")).decoding_defaults
    assert (defaults.beam_size, defaults.max_len_b, defaults.forced_eos) == (1, 19, False)


def test_keys_transduce_cannot_honour_are_named_and_bad_values_refused(marian_swish, tmp_path):
    from transduce.errors import ImportCheckpointError, TransduceWarning
    from transduce.importers import import_model

    hf_dir = _opus_like(marian_swish, tmp_path / "hf", 4, do_sample=True, early_stopping=True)
    with pytest.warns(TransduceWarning, match=r"do_sample = True not carried over"):
        out = import_model("marian", hf_dir, tmp_path / "m")
    assert ModelDir.load(out).decoding_defaults.early_stopping == "k-finished"
    for key, value, match in (("num_beams", 0, "num_beams must be an integer >= 1"),
                              ("forced_eos_token_id", 5, "is not the model's EOS"),
                              ("bad_words_ids", [[1000]], "bad_words_ids must be lists of token ids")):
        bad = _opus_like(marian_swish, tmp_path / f"bad-{key}", 4)
        gen = json.loads((tmp_path / f"bad-{key}" / "generation_config.json").read_text())
        (tmp_path / f"bad-{key}" / "generation_config.json").write_text(json.dumps({**gen, key: value}))
        with pytest.raises(ImportCheckpointError, match=match):
            import_model("marian", bad, tmp_path / "out")


def test_cli_decode_and_serve_take_the_models_defaults_and_the_users_options_over_them(opus_like, demo_pairs,
                                                                                       tmp_path):
    from click.testing import CliRunner

    from transduce.cli import main
    from transduce.runtime.api import load
    from transduce.serve.service import DecodeService, ServiceOptions

    _, _, art = opus_like(6)
    texts = [s for s, _ in demo_pairs[:6]]
    tr = load(art)
    assert tr.defaults.beam_size == 6 and tr.defaults.max_len_b == MAX_LENGTH - 1
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(texts) + "\n")
    r = CliRunner().invoke(main, ["decode", str(art), "--input", str(inp), "--quiet"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [t.text for t in tr.translate(texts)]
    # --nbest 5 is valid over the model's beam of 6 (not over the paper's 4), and --beam-size 1 overrides it
    r = CliRunner().invoke(main, ["decode", str(art), "--input", str(inp), "--quiet", "--nbest", "5"])
    assert r.exit_code == 0 and len(r.stdout.splitlines()) == 5 * len(texts), r.output
    r = CliRunner().invoke(main, ["decode", str(art), "--input", str(inp), "--quiet", "--beam-size", "1"])
    assert r.stdout.splitlines() == [t.text for t in tr.translate(texts, beam_size=1)]
    service = DecodeService(tr, ServiceOptions())
    assert service.decoding_options({}).beam_size == 6
    assert service.decoding_options({"beam_size": 2}).beam_size == 2
    assert DecodeService(tr, ServiceOptions(default_beam_size=3)).decoding_options({}).max_len_b == MAX_LENGTH - 1
    from transduce.runtime.spec import BackendSpec
    from transduce.serve.server import build_service

    remote, _ = build_service(str(art), BackendSpec(threads=1), engine="process")  # the engine in its own process
    try:
        assert remote.decoding_options({}) == service.decoding_options({})
        assert [t.text for t in remote.translate(texts)] == [t.text for t in tr.translate(texts)]
    finally:
        remote.stop()


def test_a_trained_model_keeps_the_papers_defaults(tiny_model_dir):
    from transduce.inspect.report import inspect_path
    from transduce.runtime.decoding import DecodingOptions
    from transduce.runtime.translator import Translator

    assert ModelDir.load(tiny_model_dir).decoding_defaults is None
    assert inspect_path(tiny_model_dir)["decoding_defaults"] == {}
    assert Translator.from_model_dir(tiny_model_dir).defaults == DecodingOptions()


def test_fsmt_default_decoding_is_hugging_faces(fsmt, demo_pairs, tmp_path):
    from transduce.importers import import_model
    from transduce.runtime.translator import Translator

    hf_dir = tmp_path / "hf"
    shutil.copytree(fsmt, hf_dir)
    gen = json.loads((hf_dir / "generation_config.json").read_text())
    gen.update(num_beams=5, early_stopping=True, max_length=MAX_LENGTH)  # facebook/wmt19-*'s, shorter
    (hf_dir / "generation_config.json").write_text(json.dumps(gen))
    tr = Translator.from_model_dir(import_model("fsmt", hf_dir, tmp_path / "model"))
    texts = [s for s, _ in demo_pairs]
    src = [tr.tokenizer.encode(t) + [tr.config.eos_id] for t in texts]
    theirs = _hf_default(str(hf_dir), src, tr.config.eos_id)
    ours = [list(r.tokens) for r in tr.translate(texts)]
    print(f"fsmt beam 5 k-finished, torch: {_agreement(ours, theirs)}/{len(texts)} equal to HF's generate()")
    assert ours == theirs


def test_fairseq_imports_decode_with_fairseqs_generation_defaults(fsmt, fairseq_imported, demo_pairs):
    """fairseq-generate's defaults (beam 5, lenpen 1, a sentence done once 5 hypotheses finished, at most 200
    tokens then EOS, min_len 1), with HF's FSMT (fairseq's model) under the same rule as the reference."""
    from transformers import FSMTForConditionalGeneration

    from transduce.runtime.translator import Translator

    tr = Translator.from_model_dir(fairseq_imported)
    assert (tr.defaults.beam_size, tr.defaults.early_stopping, tr.defaults.length_penalty_form,
            tr.defaults.max_len_b, tr.defaults.min_length) == (5, "k-finished", "plain", 201, 2)
    texts = [s for s, _ in demo_pairs]
    src = [tr.tokenizer.encode(t) + [tr.config.eos_id] for t in texts]
    hf = FSMTForConditionalGeneration.from_pretrained(fsmt).eval()
    # fairseq caps the length at the model's positions less one, then forces EOS: 64 tokens here (HF's
    # max_length counts the start token)
    limit = min(200, tr.config.max_positions - 1) + 1
    with torch.no_grad():
        theirs = hf_generate(hf, src, tr.config.eos_id, num_beams=5, early_stopping=True, length_penalty=1.0,
                             max_length=limit + 1, min_length=2, forced_eos_token_id=tr.config.eos_id)
    ours = [list(r.tokens) for r in tr.translate(texts)]
    print(f"fairseq beam 5 k-finished, torch: {_agreement(ours, theirs)}/{len(texts)} equal to the reference")
    assert ours == theirs
