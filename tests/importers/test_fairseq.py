"""fairseq import, without fairseq: a checkpoint in fairseq's layout (the tiny FSMT model's weights, which are
fairseq's renamed) with its dictionaries and subword-nmt codes imports to a model that computes what
FSMTForConditionalGeneration computes, with the same token ids."""

from __future__ import annotations

import pytest
from compare import hf_generate, ours_decode, teacher_forced_error

from transduce.models.checkpoint import load_model_dir


def test_fairseq_checkpoint_matches_the_same_weights_in_hugging_face(fsmt, fairseq_imported, demo_pairs):
    from transformers import FSMTForConditionalGeneration, FSMTTokenizer

    model, tok, cfg = load_model_dir(fairseq_imported)
    hf, hf_tok = FSMTForConditionalGeneration.from_pretrained(fsmt).eval(), FSMTTokenizer.from_pretrained(fsmt)
    mc = cfg["model"]
    assert (mc["bos_id"], mc["eos_id"], mc["position_offset"], mc["position_frequencies"]) == (2, 2, 2, "fairseq")
    src = [tok.encode(s) + [tok.eos_id] for s, _ in demo_pairs]
    assert src == [hf_tok(s)["input_ids"] for s, _ in demo_pairs]  # subword-nmt pieces, the same ids
    assert "@@" in "".join(tok.tokens(demo_pairs[0][0]))
    tgt = [tok.target.encode(t) + [tok.eos_id] for _, t in demo_pairs]
    err = teacher_forced_error(model, hf, src, tgt, mc["bos_id"])
    print(f"fairseq: max teacher-forced log-prob error vs HF FSMT {err:.3g}")
    assert err < 1e-5
    greedy = ours_decode(model, src, beam_size=1, max_len_a=0, max_len_b=24)
    assert greedy == hf_generate(hf, src, tok.eos_id, num_beams=1, max_new_tokens=24, max_length=None)
    assert tok.decode(tgt[0]) == demo_pairs[0][1]  # "@@ " joined, Moses-detokenized


@pytest.mark.parametrize("arg, value, match", [
    ("encoder_normalize_before", True, "encoder_normalize_before = True is not supported"),
    ("activation_fn", "tanh", "activation_fn 'tanh'"),
    ("encoder_learned_pos", True, "encoder_learned_pos = True"),
])
def test_unsupported_arguments_are_refused(fsmt, tmp_path, arg, value, match):
    from hf_models import fairseq_dir_from_fsmt

    from transduce.errors import ImportCheckpointError
    from transduce.importers import import_model

    src = fairseq_dir_from_fsmt(fsmt, str(tmp_path / "ckpt"), **{arg: value})
    with pytest.raises(ImportCheckpointError, match=match):
        import_model("fairseq", src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_fairseq_model_with_a_sentencepiece_model_encodes_as_fairseq_does(fsmt, tmp_path, demo_pairs):
    """fairseq with --bpe sentencepiece: no subword-nmt codes, a *.model beside dict.SRC/TGT.txt (listing the pieces);
    a sentence's ids are its SentencePiece pieces looked up in the dictionary (after fairseq's 4 specials), EOS
    last, and decoding joins the pieces back into the sentence."""
    import os

    import sentencepiece as spm
    from hf_models import fairseq_dir_from_fsmt, train_spm

    from transduce.importers import import_model

    src = fairseq_dir_from_fsmt(fsmt, str(tmp_path / "ckpt"), bpe="sentencepiece")
    os.remove(os.path.join(src, "bpecodes"))
    model_file = train_spm(str(tmp_path), [s for p in demo_pairs for s in p], vocab_size=40)
    os.rename(model_file, os.path.join(src, "sentencepiece.bpe.model"))
    sp = spm.SentencePieceProcessor(model_file=os.path.join(src, "sentencepiece.bpe.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.id_to_piece(i) not in ("<unk>", "</s>")]
    for lang in ("en", "fr"):
        with open(os.path.join(src, f"dict.{lang}.txt"), "w", encoding="utf-8") as f:
            f.write("".join(f"{p} {100 - i}\n" for i, p in enumerate(pieces)))
    _, tok, _ = load_model_dir(import_model("fairseq", src, tmp_path / "model"))
    index = {p: i + 4 for i, p in enumerate(pieces)}  # fairseq's <s> <pad> </s> <unk> come first
    for s, t in demo_pairs:
        assert tok.encode(s) + [tok.eos_id] == [index[p] for p in sp.encode_as_pieces(s)] + [2]
        ids = [index[p] for p in sp.encode_as_pieces(t)]
        assert tok.target.encode(t) == ids
        assert tok.decode(ids) == t
