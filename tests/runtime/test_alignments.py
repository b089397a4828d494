"""Alignments (return_attention): each output token's cross-attention over the source, from the alignment layer
averaged over its heads, kept by greedy and beam search (following beam search's back-pointers); checked
against the model's teacher-forced forward pass over each hypothesis, between torch and ONNX Runtime's
attention step graph, in any batch and beside cohorts that keep none."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from transduce.errors import BackendUnavailable, InputError
from transduce.formats import contract
from transduce.runtime.api import load
from transduce.runtime.backends.base import alignment_layer
from transduce.runtime.backends.torch_backend import TorchBackend
from transduce.runtime.decoding import DecodingOptions, decode
from transduce.runtime.decoding.running import RunningBatch


def _batch(cfg, n, seed):
    rng = np.random.default_rng(seed)
    lens = rng.integers(3, 9, n)
    src = np.full((n, int(lens.max())), cfg.pad_id, np.int64)
    for i, m in enumerate(lens):
        src[i, : m - 1] = rng.integers(4, cfg.vocab_size, m - 1)
        src[i, m - 1] = cfg.eos_id
    return src, lens


def teacher_forced_attention(model, src: np.ndarray, length: int, tokens: list[int], layer: int) -> np.ndarray:
    """The full forward pass over BOS + tokens: the chosen layer's cross-attention averaged over the heads,
    (len(tokens), length): row t is what the step that chose tokens[t] attended."""
    tgt_in = torch.tensor([[model.cfg.bos_id, *tokens[:-1]]])
    with torch.inference_mode():
        _, weights = model(torch.from_numpy(src[None, :length]), torch.tensor([length]), tgt_in,
                           return_attention=True)
    return weights["cross"][layer][0].mean(dim=0).numpy()


def _backend(name, tiny_model, tiny_artifact_dir):
    return TorchBackend(tiny_model) if name == "torch" else load(tiny_artifact_dir, threads=1).backend


def test_alignment_layer_counts_from_the_last():
    assert alignment_layer(-2, 6) == 4 and alignment_layer(-1, 6) == 5 and alignment_layer(2, 6) == 2
    assert alignment_layer(-2, 1) == 0  # a one-layer decoder: its only layer
    with pytest.raises(InputError, match="alignment_layer 6 is past"):
        alignment_layer(6, 6)


@pytest.mark.parametrize("name", ["torch", "onnxruntime"])
@pytest.mark.parametrize("beam", [1, 3])
def test_attention_follows_each_hypothesis(tiny_model, tiny_artifact_dir, name, beam):
    """Every hypothesis's attention is the teacher-forced attention over its own tokens (EOS included), rows
    sum to 1 over the source, nothing is kept for padding, and its alignment is each row's argmax."""
    backend = _backend(name, tiny_model, tiny_artifact_dir)
    cfg = backend.config
    src, lens = _batch(cfg, 5, seed=3)
    opts = DecodingOptions(beam_size=beam, nbest=beam, max_len_b=7, return_attention=True)
    layer = alignment_layer(opts.alignment_layer, cfg.decoder_layers)
    results = decode(backend, src, lens, opts)
    seen_finished = False
    for i, r in enumerate(results):
        for h in r.hypotheses:
            tokens = list(h.tokens) + ([cfg.eos_id] if h.finished else [])
            seen_finished = seen_finished or h.finished
            assert h.attention.shape == (len(tokens), lens[i])  # the source's real positions only
            np.testing.assert_allclose(h.attention.sum(axis=1), 1.0, atol=1e-5)
            want = teacher_forced_attention(tiny_model, src[i], int(lens[i]), tokens, layer)
            np.testing.assert_allclose(h.attention, want, atol=1e-4)
            assert h.alignment() == tuple((int(s), t) for t, s in enumerate(want[: len(h.tokens)].argmax(1)))
    assert seen_finished or beam == 1


def test_torch_and_onnxruntime_attention_agree(tiny_model, tiny_artifact_dir):
    src, lens = _batch(tiny_model.cfg, 4, seed=5)
    for beam in (1, 2):
        opts = DecodingOptions(beam_size=beam, max_len_b=6, return_attention=True, alignment_layer=0)
        eager = decode(TorchBackend(tiny_model), src, lens, opts)
        ort = decode(load(tiny_artifact_dir, threads=1).backend, src, lens, opts)
        for a, b in zip(eager, ort, strict=True):
            assert a.best.tokens == b.best.tokens
            np.testing.assert_allclose(a.best.attention, b.best.attention, atol=1e-4)


def test_attention_does_not_change_the_search(tiny_artifact_dir):
    backend = load(tiny_artifact_dir, threads=1).backend
    src, lens = _batch(backend.config, 6, seed=7)
    for beam in (1, 4):
        plain = decode(backend, src, lens, DecodingOptions(beam_size=beam, max_len_b=8))
        kept = decode(backend, src, lens, DecodingOptions(beam_size=beam, max_len_b=8, return_attention=True))
        assert [r.best.tokens for r in plain] == [r.best.tokens for r in kept]
        assert all(r.best.attention is None for r in plain)


@pytest.mark.parametrize("name", ["torch", "onnxruntime"])
def test_a_sentences_attention_is_the_same_in_any_batch(tiny_model, tiny_artifact_dir, name):
    backend = _backend(name, tiny_model, tiny_artifact_dir)
    src, lens = _batch(backend.config, 5, seed=11)
    opts = DecodingOptions(beam_size=2, max_len_b=6, return_attention=True)
    together = decode(backend, src, lens, opts)
    for i, r in enumerate(together):
        alone = decode(backend, src[i: i + 1, : lens[i]], lens[i: i + 1], opts)[0]
        assert r.best.tokens == alone.best.tokens
        np.testing.assert_allclose(r.best.attention, alone.best.attention, atol=1e-5)


@pytest.mark.parametrize("name", ["torch", "onnxruntime"])
def test_a_running_batch_steps_cohorts_with_and_without_attention_together(tiny_model, tiny_artifact_dir, name):
    """A cohort that keeps attention admitted beside one that does not (at a later step): both decode as they
    do alone; only the first has attention."""
    backend = _backend(name, tiny_model, tiny_artifact_dir)
    src, lens = _batch(backend.config, 4, seed=13)
    with_att = DecodingOptions(beam_size=2, max_len_b=6, return_attention=True)
    without = DecodingOptions(beam_size=1, max_len_b=9)
    batch = RunningBatch(backend, capacity=backend.config.max_positions)
    first = batch.admit(src[:2], lens[:2], without)
    batch.step()
    second = batch.admit(src[2:, : lens[2:].max()], lens[2:], with_att)
    out = batch.run_until_empty()
    for cohort, part, opts in ((first, slice(0, 2), without), (second, slice(2, 4), with_att)):
        alone = decode(backend, src[part], lens[part], opts)
        got = dict(out[cohort] + ([] if cohort is second else []))
        for j, r in enumerate(alone):
            if j not in got:  # finished at the first step, collected before run_until_empty
                continue
            assert got[j].best.tokens == r.best.tokens
            if opts.return_attention:
                np.testing.assert_allclose(got[j].best.attention, r.best.attention, atol=1e-5)
            else:
                assert got[j].best.attention is None


def test_an_artifact_without_the_attention_graph_decodes_but_refuses_alignments(tiny_artifact_dir, tmp_path):
    """An artifact exported before the attention step graph (its file and manifest entry removed) loads and
    decodes; asking it for alignments is a BackendUnavailable naming the export command."""
    old = tmp_path / "old"
    shutil.copytree(tiny_artifact_dir, old)
    os.remove(old / contract.ATTN_STEP_FILE)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["files"][contract.ATTN_STEP_FILE]
    manifest["graphs"].pop(contract.ATTN_STEP_FILE, None)
    (old / "manifest.json").write_text(json.dumps(manifest))
    tr = load(str(old), threads=1)
    assert tr.translate(["one two"], beam_size=1)[0].text is not None
    with pytest.raises(BackendUnavailable, match="has no decoder_step.attn.onnx") as info:
        tr.translate(["one two"], return_attention=True)
    assert "transduce export" in info.value.hint


def test_translations_carry_alignments_as_pharaoh_pairs(tiny_artifact_dir):
    """Translator: each candidate's alignment is its attention's argmax per output token (EOS excluded), pairs
    whose source is the source's EOS left out; without return_attention there is none."""
    tr = load(tiny_artifact_dir, threads=1)
    texts = ["one two three", "four hundred and five", ""]
    out = tr.translate(texts, beam_size=2, nbest=2, max_len_b=6, return_attention=True)
    for t in out[:2]:
        for c in t.nbest:
            assert c.attention.shape == (len(c.tokens) + c.finished, t.source_tokens + 1)
            peaks = c.attention[: len(c.tokens)].argmax(axis=1)
            assert c.alignment == tuple((int(s), j) for j, s in enumerate(peaks) if s < t.source_tokens)
            assert c.pharaoh() == " ".join(f"{s}-{j}" for s, j in c.alignment)
        assert t.alignment == t.nbest[0].alignment
    assert out[2].empty and out[2].alignment == () and out[2].attention is None
    plain = tr.translate(texts[:1], beam_size=2, max_len_b=6)[0]
    assert plain.attention is None and plain.alignment == () and plain.text == out[0].text


def test_replace_unknowns_copies_the_aligned_source_tokens_text(tiny_artifact_dir):
    """<unk> outputs (forced here as the prefix) become the text of the source token their attention peaks on (an
    unknown character kept from the source as it was typed)."""
    tr = load(tiny_artifact_dir, threads=1)
    unk = tr.config.unk_id
    text = "one ☃ two"
    pieces = tr.tokenizer.source_pieces(text)
    assert pieces == ["▁one", "▁", "☃", "▁two"]  # the unknown character's own text, after its word's "▁"
    got = tr.translate([text], beam_size=1, max_len_b=4, prefixes=[[unk] * 3], replace_unknowns=True)[0]
    assert got.tokens[:3] == (unk,) * 3
    source_of = {j: s for s, j in got.alignment}
    assert source_of[2] == 2  # the tiny model's attention: the third <unk> peaks on the snowman
    want = [pieces[source_of[j]] if i == unk else tr.tokenizer.id_to_token(i)
            for j, i in enumerate(got.tokens) if i != unk or j in source_of]
    assert got.text == tr.tokenizer.decode_pieces(want) and "☃" in got.text
    plain = tr.translate([text], beam_size=1, max_len_b=4, prefixes=[[unk] * 3])[0]
    assert plain.text == tr.tokenizer.decode(got.tokens) and plain.text != got.text


def test_replaced_unknowns_on_a_constructed_alignment(tiny_artifact_dir):
    """Translator.replaced_unknowns: each <unk> takes its aligned source piece; one without a pair is dropped."""
    tr = load(tiny_artifact_dir, threads=1)
    tok, unk = tr.tokenizer, tr.config.unk_id
    pieces = tok.source_pieces("☃ two ❄")
    assert pieces == ["▁", "☃", "▁two", "▁", "❄"]
    two = tok.encode("two")
    assert tr.replaced_unknowns([unk, *two, unk], {0: 4, len(two) + 1: 1}, pieces) == "❄ two☃"
    assert tr.replaced_unknowns([unk, *two, unk], {0: 4}, pieces) == "❄ two"  # the last <unk> has no pair


def test_cli_decode_writes_alignments(tiny_artifact_dir, tmp_path):
    """decode --alignments: 'text ||| pairs' per line (after the score with --scores, and in n-best lines),
    the pairs the Python API gives."""
    from click.testing import CliRunner

    from transduce.cli import main

    texts = ["one two three", "", "twelve"]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n")
    run = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--input", str(src), "--alignments", "--quiet",
                                    "--beam-size", "2", "--max-len-b", "6", "--threads", "1"])
    assert run.exit_code == 0, run.output
    want = load(tiny_artifact_dir, threads=1).translate(texts, beam_size=2, max_len_b=6, return_attention=True)
    lines = run.output.splitlines()
    assert lines == [f"{t.text} ||| {t.nbest[0].pharaoh()}" for t in want]
    assert lines[0].split(" ||| ")[1] and lines[1] == " ||| "
    for pair in lines[0].split(" ||| ")[1].split():
        s, j = map(int, pair.split("-"))
        assert 0 <= s < want[0].source_tokens and 0 <= j < len(want[0].tokens)
    run = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--input", str(src), "--alignments", "--scores",
                                    "--quiet", "--beam-size", "2", "--max-len-b", "6", "--nbest", "2"])
    assert run.exit_code == 0, run.output
    first = run.output.splitlines()[0].split(" ||| ")
    assert len(first) == 4 and first[0] == "0" and first[3] == want[0].nbest[0].pharaoh()
