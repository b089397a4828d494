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
