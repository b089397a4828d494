"""Marian / OPUS-MT import: the imported model computes what Hugging Face's MarianMTModel computes (teacher-forced
log-probs within 1e-5 in fp32, greedy token for token), tokenizes as MarianTokenizer, and exports to ONNX with
100% parity."""

from __future__ import annotations

import json
import os

import pytest
import torch
from compare import hf_generate, ours_decode, teacher_forced_error

from transduce.models.checkpoint import load_model_dir

MAX_NEW = 24


def _hf(path):
    from transformers import MarianMTModel, MarianTokenizer

    model = MarianMTModel.from_pretrained(path).eval()
    tok = MarianTokenizer(source_spm=f"{path}/source.spm", target_spm=f"{path}/target.spm", vocab=f"{path}/vocab.json")
    return model, tok


def _ids(tok, pairs):
    src = [tok.encode(s) + [tok.eos_id] for s, _ in pairs]
    tgt = [tok.encode(t) + [tok.eos_id] for _, t in pairs]
    return src, tgt


def test_tokenizer_is_marians(marian_swish, marian_swish_imported, demo_pairs):
    model, tok, _ = load_model_dir(marian_swish_imported)
    hf, hf_tok = _hf(marian_swish)
    for s, _ in demo_pairs + [(">>fr<< three hundred", ""), ("a ☃ b", "")]:
        assert tok.encode(s) + [tok.eos_id] == hf_tok(s)["input_ids"], s
    ids = hf_tok(demo_pairs[0][1])["input_ids"]
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.unk_id in tok.encode("a ☃ b")  # an unknown character is <unk>, as in Marian


@pytest.mark.parametrize("which", ["marian_swish", "marian_relu"])
def test_teacher_forced_log_probs_match_hugging_face(which, request, tmp_path, demo_pairs):
    from transduce.importers import import_model

    path = request.getfixturevalue(which)
    out = import_model("marian", path, tmp_path / "model")
    model, tok, cfg = load_model_dir(out)
    hf, _ = _hf(path)
    mc = cfg["model"]
    assert mc["activation"] == ("swish" if which == "marian_swish" else "relu")
    assert mc["position_layout"] == "halves" and mc["final_logits_bias"] and mc["bos_id"] == mc["pad_id"]
    src, tgt = _ids(tok, demo_pairs)
    err = teacher_forced_error(model, hf, src, tgt, mc["bos_id"])
    print(f"marian {which}: max teacher-forced log-prob error vs HF {err:.3g}")
    assert err < 1e-5


def test_greedy_is_hugging_faces_token_for_token(marian_swish, marian_swish_imported, demo_pairs):
    model, tok, _ = load_model_dir(marian_swish_imported)
    hf, _ = _hf(marian_swish)
    src, _ = _ids(tok, demo_pairs)
    theirs = hf_generate(hf, src, tok.eos_id, num_beams=1, max_new_tokens=MAX_NEW)
    ours = ours_decode(model, src, beam_size=1, max_len_a=0, max_len_b=MAX_NEW)
    assert ours == theirs
    assert any(len(o) > 2 for o in ours)  # the random model says something


def test_imported_model_exports_with_full_parity(marian_swish_imported, demo_pairs, tmp_path):
    from transduce.exporter.onnx_export import export_artifact
    from transduce.runtime.spec import BackendSpec
    from transduce.verify.parity import parity_for_artifact

    art = tmp_path / "artifact"
    manifest = export_artifact(marian_swish_imported, art)
    assert "decoder_step.ort.onnx" in manifest["files"]  # the ONNX Runtime step graph honours swish and the bias
    src = tmp_path / "src.txt"
    src.write_text("\n".join(s for s, _ in demo_pairs) + "\n")
    report = parity_for_artifact(str(art), BackendSpec(model_dir=marian_swish_imported), input_path=str(src),
                                 sentences=12, beam_size=4)
    assert report.passed, report.to_dict()
    assert [(c.mode, c.identical) for c in report.sequences] == [("greedy", 12), ("beam4", 12)]


def test_decoding_detokenizes_as_marian(marian_swish, marian_swish_imported, demo_pairs):
    from transduce.runtime.translator import Translator

    _, hf_tok = _hf(marian_swish)
    tr = Translator.from_model_dir(marian_swish_imported)
    out = tr.translate([s for s, _ in demo_pairs[:4]], beam_size=1)
    for o in out:
        assert o.text == hf_tok.decode(list(o.tokens), skip_special_tokens=True)
    assert any(o.text for o in out)


def test_unsupported_config_is_refused_naming_the_field(marian_swish, tmp_path):
    import shutil

    from transduce.errors import ImportCheckpointError
    from transduce.importers import import_model

    for field, value, match in (("activation_function", "gelu_new", "activation_function 'gelu_new'"),
                                ("normalize_before", True, "normalize_before = True")):
        bad = tmp_path / f"bad-{field}"
        shutil.copytree(marian_swish, bad)
        cfg = json.loads((bad / "config.json").read_text())
        cfg[field] = value
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ImportCheckpointError, match=match):
            import_model("marian", bad, tmp_path / "out")
        assert not os.path.exists(tmp_path / "out")


def test_missing_extra_and_misshaped_tensors_are_named(marian_swish, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from transduce.errors import ImportCheckpointError
    from transduce.importers import import_model

    def edited(name, edit):
        d = tmp_path / name
        shutil.copytree(marian_swish, d)
        t = load_file(d / "model.safetensors")
        edit(t)
        save_file(t, d / "model.safetensors")
        return d

    cases = [(lambda t: t.pop("model.decoder.layers.1.fc2.bias"), "lacks the tensor model.decoder.layers.1.fc2.bias"),
             (lambda t: t.update({"model.encoder.layernorm_embedding.weight": torch.ones(32)}),
              "no place for: model.encoder.layernorm_embedding.weight"),
             (lambda t: t.update({"model.encoder.layers.0.fc1.weight": torch.ones(64, 31)}),
              r"model.encoder.layers.0.fc1.weight has shape \[64, 31\]")]
    for i, (edit, match) in enumerate(cases):
        with pytest.raises(ImportCheckpointError, match=match):
            import_model("marian", edited(f"case{i}", edit), tmp_path / "out")
        assert not os.path.exists(tmp_path / "out")


def test_pickled_weights_load_only_tensors(marian_swish, tmp_path):
    import shutil

    from safetensors.torch import load_file

    from transduce.errors import ImportCheckpointError
    from transduce.importers import import_model

    d = tmp_path / "bin"
    shutil.copytree(marian_swish, d)
    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    os.remove(d / "model.safetensors")
    model, _, _ = load_model_dir(import_model("marian", d, tmp_path / "ok"))
    assert model.cfg.activation == "swish"

    class Payload:  # what an unsafe unpickle would run
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    torch.save({"model.shared.weight": Payload()}, d / "pytorch_model.bin")
    with pytest.raises(ImportCheckpointError, match=r"pickles the class posix.system, which transduce does not"):
        import_model("marian", d, tmp_path / "out")
    # a newer pickle protocol's opcodes are refused too (torch cannot say which class it would have built)
    torch.save({"model.shared.weight": Payload()}, d / "pytorch_model.bin", pickle_protocol=4)
    with pytest.warns(UserWarning, match="pickle protocol 4"), pytest.raises(ImportCheckpointError, match="pickles"):
        import_model("marian", d, tmp_path / "out")
    assert not os.path.exists(tmp_path / "pwned") and not os.path.exists(tmp_path / "out")


def test_cli_import(marian_swish, tmp_path):
    from click.testing import CliRunner

    from transduce.cli import main

    out = tmp_path / "m"
    r = CliRunner().invoke(main, ["import", "marian", marian_swish, "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "deviations from the paper" in r.output and "'activation': 'swish'" in r.output
    r = CliRunner().invoke(main, ["import", "marian", marian_swish, "--out", str(out)])
    assert r.exit_code == 2 and "--force" in r.output, r.output
    r = CliRunner().invoke(main, ["import", "marian", marian_swish, "--out", str(out), "--force", "--quiet"])
    assert r.exit_code == 0 and r.output == "", r.output


@pytest.mark.parametrize("alpha", [1.0, 0.6])
def test_beam_with_the_plain_length_penalty_is_hugging_faces_here(marian_swish, marian_swish_imported, demo_pairs,
                                                                  alpha):
    """Beam search with length_penalty_form "plain" (score / length^alpha) picks HF's beam-search output on these
    sentences. Not a guarantee in general: HF stops a sentence's search by its own rule (early_stopping), which
    can differ from transduce's when a better hypothesis could still come (docs in transduce.importers)."""
    model, tok, _ = load_model_dir(marian_swish_imported)
    hf, _ = _hf(marian_swish)
    src, _ = _ids(tok, demo_pairs)
    theirs = hf_generate(hf, src, tok.eos_id, num_beams=4, length_penalty=alpha, max_new_tokens=MAX_NEW)
    ours = ours_decode(model, src, beam_size=4, length_penalty=alpha, length_penalty_form="plain", max_len_a=0,
                       max_len_b=MAX_NEW)
    assert ours == theirs


def test_inspect_and_attention_work_on_an_imported_model(marian_swish_imported, tmp_path):
    from click.testing import CliRunner

    from transduce.cli import main
    from transduce.inspect.report import inspect_path

    report = inspect_path(marian_swish_imported)
    assert not report.get("problems"), report.get("problems")
    assert report["config"]["activation"] == "swish" and report["tokenizer"]["vocab_size"] == 102
    r = CliRunner().invoke(main, ["attention", marian_swish_imported, "three hundred and two", "--out",
                                  str(tmp_path / "att")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "att" / "cross_layer2.png").is_file()


def test_ctranslate2_conversion_of_an_imported_model_decodes_as_ours(marian_swish_imported, demo_pairs, tmp_path):
    """The bench's CTranslate2 converter honours swish, the [sin | cos] table, final_logits_bias and the pad start
    token: greedy token for token and log-probs within 1e-4 (the bench's check)."""
    pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed (pip install 'transduce[bench]')")
    from transduce.bench.ctranslate2.check import check_greedy_equality
    from transduce.bench.ctranslate2.convert import convert_to_ctranslate2, suppressed

    ct2 = convert_to_ctranslate2(marian_swish_imported, tmp_path / "ct2")
    assert suppressed(ct2) == [["<pad>"]]  # Marian's start token is its pad: nothing else is banned
    _, tok, _ = load_model_dir(marian_swish_imported)
    report = check_greedy_equality(marian_swish_imported, ct2, [tok.encode(s) for s, _ in demo_pairs], "marian")
    assert report.passed, report.summary()
    assert report.max_abs_logprob_diff < 1e-4 and report.max_abs_logprob_diff_random < 1e-4


def test_ctranslate2s_own_converter_agrees_token_for_token(marian_swish, marian_swish_imported, demo_pairs, tmp_path):
    """ct2-transformers-converter on the same Hugging Face directory (it drops the pad row and starts from a zero
    embedding, which Marian's pad row is) gives our greedy output, token for token."""
    ctranslate2 = pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed")
    from ctranslate2.converters import TransformersConverter

    TransformersConverter(marian_swish).convert(str(tmp_path / "ct2"))
    model, tok, _ = load_model_dir(marian_swish_imported)
    src = [tok.encode(s) + [tok.eos_id] for s, _ in demo_pairs]
    ours = ours_decode(model, src, beam_size=1, max_len_a=0, max_len_b=MAX_NEW)
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    res = translator.translate_batch([[tok.source.vocab[i] for i in s] for s in src], beam_size=1,
                                     max_decoding_length=MAX_NEW)
    assert [r.hypotheses[0] for r in res] == [[tok.target.vocab[i] for i in o] for o in ours]


@pytest.mark.parametrize("safe", [True, False])
def test_sharded_weights_import_as_one_file_does(marian_swish, marian_swish_imported, tmp_path, safe):
    """save_pretrained(max_shard_size=...): model.safetensors.index.json (or pytorch_model.bin.index.json, read
    without unpickling code) and its shards give the same model as the one file."""
    import shutil

    from safetensors.torch import load_file
    from transformers import MarianMTModel

    from transduce.importers import import_model

    d = tmp_path / "sharded"
    shutil.copytree(marian_swish, d)
    os.remove(d / "model.safetensors")
    MarianMTModel.from_pretrained(marian_swish).save_pretrained(d, max_shard_size="40KB")
    index = d / "model.safetensors.index.json"
    if not safe:  # transformers 5 writes safetensors only: the shards as pickles, as older versions wrote them
        doc = json.loads(index.read_text())
        for shard in set(doc["weight_map"].values()):
            torch.save(load_file(d / shard), d / shard.replace(".safetensors", ".bin"))
            os.remove(d / shard)
        doc["weight_map"] = {k: v.replace(".safetensors", ".bin") for k, v in doc["weight_map"].items()}
        os.remove(index)
        index = d / "pytorch_model.bin.index.json"
        index.write_text(json.dumps(doc))
    assert index.is_file() and len(set(json.loads(index.read_text())["weight_map"].values())) > 1
    out = import_model("marian", d, tmp_path / "model")
    ours, one = load_file(f"{out}/model.safetensors"), load_file(f"{marian_swish_imported}/model.safetensors")
    assert ours.keys() == one.keys() and all(torch.equal(ours[k], one[k]) for k in ours)


def test_shared_vocabulary_with_an_untied_projection_decodes_as_hugging_face(demo_pairs, tmp_path):
    """share_encoder_decoder_embeddings with tie_word_embeddings false (one embedding for both stacks, a projection
    of its own): imported with the projection, its greedy and default decodes are HF's on torch and ONNX Runtime."""
    from hf_models import marian_dir
    from test_generation_defaults import _hf_default, _opus_like

    from transduce.exporter.onnx_export import export_artifact
    from transduce.importers import import_model
    from transduce.runtime.api import load
    from transduce.runtime.translator import Translator

    base = marian_dir(str(tmp_path / "base"), seed=4, share_encoder_decoder_embeddings=True,
                      tie_word_embeddings=False)
    hf_dir = _opus_like(tmp_path / "base", tmp_path / "hf", 4)
    hf, _ = _hf(hf_dir)
    assert not torch.equal(hf.lm_head.weight, hf.model.shared.weight)  # HF's projection is its own
    out = import_model("marian", hf_dir, tmp_path / "model")
    model, tok, cfg = load_model_dir(out)
    assert cfg["model"]["share_embeddings"] and cfg["model"]["untied_output"]
    assert torch.equal(model.output_weight(), hf.lm_head.weight) and torch.equal(model.embed.weight,
                                                                                 hf.model.shared.weight)
    texts = [s for s, _ in demo_pairs]
    src, tgt = _ids(tok, demo_pairs)
    assert teacher_forced_error(model, hf, src, tgt, cfg["model"]["bos_id"]) < 1e-5
    greedy = hf_generate(hf, src, tok.eos_id, num_beams=1, max_new_tokens=MAX_NEW)
    default = _hf_default(hf_dir, src, tok.eos_id)
    art = tmp_path / "artifact"
    export_artifact(out, art)
    for tr in (Translator.from_model_dir(out), load(art)):  # torch, then ONNX Runtime
        assert [list(r.tokens) for r in tr.translate(texts, beam_size=1, max_len_a=0, max_len_b=MAX_NEW)] == greedy
        assert [list(r.tokens) for r in tr.translate(texts)] == default
    assert base and any(len(t) > 2 for t in greedy)


def _without_codes(src, dst):
    """A copy of a tiny Marian directory whose vocabulary has no language code (">>fr<<" renamed to a piece)."""
    import shutil

    shutil.copytree(src, dst)
    vocab = json.loads((dst / "vocab.json").read_text())
    vocab["\u2581zzzz"] = vocab.pop(">>fr<<")
    (dst / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    return str(dst)


def test_marian_tokenizer_edge_cases(marian_swish, marian_swish_imported, tmp_path):
    """A leading >>code<< is split off as MarianTokenizer does, in a source or a target, whether or not the
    vocabulary has codes (one it lacks is <unk>); a code after leading whitespace is what HF gives the stripped
    text (HF's own takes it as text, unlike the same line stripped); the spellings </s>, <pad> and <unk> in text
    are text (HF's with split_special_tokens: its default makes them EOS, PAD and UNK inside a source)."""
    from transformers import MarianTokenizer

    from transduce.importers import import_model

    plain = _without_codes(marian_swish, tmp_path / "hf")
    for hf_dir, out in ((marian_swish, marian_swish_imported), (plain, import_model("marian", plain,
                                                                                    tmp_path / "model"))):
        _, tok, _ = load_model_dir(out)
        files = dict(source_spm=f"{hf_dir}/source.spm", target_spm=f"{hf_dir}/target.spm",
                     vocab=f"{hf_dir}/vocab.json")
        hf_tok = MarianTokenizer(**files)
        as_text = MarianTokenizer(**files, split_special_tokens=True)
        for s in (">>fr<< seven", ">>fra<< seven", ">>fr<<", "seven >>fr<< eight", ">>fr<<>>fr<< x"):
            assert tok.encode(s) + [tok.eos_id] == hf_tok(s)["input_ids"], (hf_dir, s)
            # a target (a translation scored, a prefix) too: HF's target side splits the code off as well
            assert tok.encode_target(s) + [tok.eos_id] == hf_tok(text_target=s)["input_ids"], (hf_dir, s)
        assert tok.encode(">>fra<< seven")[0] == tok.unk_id
        for s in (" >>fr<< seven", "\t>>fr<<seven"):
            assert tok.encode(s) + [tok.eos_id] == hf_tok(s.strip())["input_ids"], (hf_dir, s)
        for s in ("seven </s> eight", "seven <pad>", "<unk> seven", "seven</s>"):
            ours = tok.encode(s) + [tok.eos_id]
            assert ours == as_text(s)["input_ids"] and ours != hf_tok(s)["input_ids"], (hf_dir, s)
            assert tok.eos_id not in ours[:-1] and tok.pad_id not in ours
