"""FSMT import: separate source and target vocabularies and embeddings, fairseq's positions, decoding from EOS;
the imported model computes what FSMTForConditionalGeneration computes and tokenizes as FSMTTokenizer."""

from __future__ import annotations

import json

import pytest
from compare import hf_generate, ours_decode, teacher_forced_error

from transduce.models.checkpoint import load_model_dir

MAX_NEW = 24


def _hf(path):
    from transformers import FSMTForConditionalGeneration, FSMTTokenizer

    return FSMTForConditionalGeneration.from_pretrained(path).eval(), FSMTTokenizer.from_pretrained(path)


def test_config_and_tokenizer_are_fsmts(fsmt, fsmt_imported, demo_pairs):
    model, tok, cfg = load_model_dir(fsmt_imported)
    _, hf_tok = _hf(fsmt)
    mc = cfg["model"]
    assert mc["src_vocab_size"] != mc["vocab_size"] and not mc["share_embeddings"] and not mc["tie_output"]
    assert (mc["position_frequencies"], mc["position_offset"], mc["bos_id"]) == ("fairseq", 2, mc["eos_id"])
    for s, _ in demo_pairs + [("“Twenty-one” — 21 …", "")]:
        assert tok.encode(s) + [tok.eos_id] == hf_tok(s)["input_ids"], s
    ids = [tok.target.ids.get(p, tok.unk_id) for p in tok.target.pieces(demo_pairs[0][1])]
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True) == demo_pairs[0][1]


def test_teacher_forced_log_probs_and_greedy_match_hugging_face(fsmt, fsmt_imported, demo_pairs):
    model, tok, cfg = load_model_dir(fsmt_imported)
    hf, _ = _hf(fsmt)
    src = [tok.encode(s) + [tok.eos_id] for s, _ in demo_pairs]
    tgt = [tok.target.encode(t) + [tok.eos_id] for _, t in demo_pairs]
    err = teacher_forced_error(model, hf, src, tgt, cfg["model"]["bos_id"])
    print(f"fsmt: max teacher-forced log-prob error vs HF {err:.3g}")
    assert err < 1e-5
    theirs = hf_generate(hf, src, tok.eos_id, num_beams=1, max_new_tokens=MAX_NEW, max_length=None)
    assert ours_decode(model, src, beam_size=1, max_len_a=0, max_len_b=MAX_NEW) == theirs


def test_imported_fsmt_exports_with_full_parity(fsmt_imported, demo_pairs, tmp_path):
    from transduce.exporter.onnx_export import export_artifact
    from transduce.runtime.spec import BackendSpec
    from transduce.verify.parity import parity_for_artifact

    art = tmp_path / "artifact"
    export_artifact(fsmt_imported, art)
    src = tmp_path / "src.txt"
    src.write_text("\n".join(s for s, _ in demo_pairs[:8]) + "\n")
    report = parity_for_artifact(str(art), BackendSpec(model_dir=fsmt_imported), input_path=str(src), sentences=8,
                                 beam_size=4)
    assert report.passed, report.to_dict()
    assert [(c.mode, c.identical) for c in report.sequences] == [("greedy", 8), ("beam4", 8)]


def test_altered_position_table_is_refused(fsmt, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from transduce.errors import ImportCheckpointError
    from transduce.importers import import_model

    d = tmp_path / "learned"
    shutil.copytree(fsmt, d)
    t = load_file(d / "model.safetensors")
    t["model.encoder.embed_positions.weight"][5] += 0.1  # learned (trained) positions
    save_file(t, d / "model.safetensors")
    with pytest.raises(ImportCheckpointError, match="embed_positions.weight is not the sinusoidal one"):
        import_model("fsmt", d, tmp_path / "out")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "fsmt"


def test_a_served_stream_of_an_imported_fsmt_model_adds_up_to_its_translations(fsmt_imported, demo_pairs):
    """FSMT's target is Moses-detokenized BPE: streamed through the app, each sentence's token texts (decoded from
    the tokenizer's anchors, not the whole sentence at each token) add up to its translation."""
    from tests.serve.conftest import post_to_app, sent_body, sse_events
    from transduce.runtime.translator import Translator
    from transduce.serve.app import create_app
    from transduce.serve.service import DecodeService, ServiceOptions

    texts = [s for s, _ in demo_pairs[:6]]
    service = DecodeService(Translator.from_model_dir(fsmt_imported), ServiceOptions())
    service.start()
    try:
        sent = post_to_app(create_app(service, {"id": "fsmt"}), "/v1/translate",
                           {"text": texts, "beam_size": 1, "stream": True})
    finally:
        service.stop()
    events = sse_events(sent_body(sent))
    done = events[-1][1]["translations"]
    assert max(len(t["tokens"]) for t in done) > 16  # long enough for the stream's window to move on
    for i, translation in enumerate(done):
        tokens = [d for kind, d in events if kind == "token" and d["sentence"] == i]
        assert [d["token"] for d in tokens] == translation["tokens"]
        assert "".join(d["text"] for d in tokens) == translation["text"]
