"""Attention weights from the model's forward: normalised, masked, trimmed and labelled; the PNG figures."""

from __future__ import annotations

import numpy as np
import pytest

from transduce.errors import InputError
from transduce.inspect.attention import (
    ATTENTION_KINDS,
    attention_weights,
    resolve_token,
    sentence_attention,
    sentences_attention,
    write_attention_figures,
    write_token_figure,
)

SOURCES = ["seven", "three hundred and forty-two thousand, one hundred and nine", "twenty-one"]
TARGETS = ["sept", "trois cent quarante-deux mille cent neuf", "vingt et un"]


@pytest.fixture(scope="module")
def padded_batch(tiny_model, tiny_tokenizer):
    """Three sources of different lengths, right-padded, with teacher-forced targets of different lengths."""
    cfg = tiny_model.cfg
    src = [tiny_tokenizer.encode(s) + [cfg.eos_id] for s in SOURCES]
    tgt = [[cfg.bos_id] + tiny_tokenizer.encode(t) for t in TARGETS]
    src_ids = np.full((3, max(map(len, src))), cfg.pad_id, dtype=np.int64)
    tgt_in = np.full((3, max(map(len, tgt))), cfg.pad_id, dtype=np.int64)
    for i, (s, t) in enumerate(zip(src, tgt, strict=True)):
        src_ids[i, : len(s)] = s
        tgt_in[i, : len(t)] = t
    lengths = np.array([len(s) for s in src], dtype=np.int64)
    assert len(set(lengths)) == 3 and len({len(t) for t in tgt}) == 3  # the batch really is padded
    return src_ids, lengths, tgt_in


def test_weights_sum_to_one_over_keys(tiny_model, padded_batch):
    weights = attention_weights(tiny_model, *padded_batch)
    for kind in ATTENTION_KINDS:
        assert len(weights[kind]) == 2  # one per layer
        for w in weights[kind]:
            assert w.dtype == np.float32 and w.shape[:2] == (3, tiny_model.cfg.n_heads)
            np.testing.assert_allclose(w.sum(axis=-1), 1.0, atol=1e-5)


def test_padded_source_keys_get_exactly_zero(tiny_model, padded_batch):
    src_ids, lengths, tgt_in = padded_batch
    weights = attention_weights(tiny_model, src_ids, lengths, tgt_in)
    for kind in ("encoder", "cross"):
        for w in weights[kind]:
            for b, n in enumerate(lengths):
                assert np.all(w[b, :, :, n:] == 0.0), kind
                assert np.all(w[b, :, :, :n].sum(-1) > 0.99)


def test_future_positions_get_exactly_zero(tiny_model, padded_batch):
    weights = attention_weights(tiny_model, *padded_batch)
    t = padded_batch[2].shape[1]
    future = np.triu(np.ones((t, t), dtype=bool), k=1)
    for w in weights["decoder_self"]:
        assert np.all(w[:, :, future] == 0.0)
        assert np.all(w[:, :, ~future] > 0.0)  # the model's softmax: every visible key gets some weight


def test_dropout_is_off_and_mode_restored(tiny_model, tiny_tokenizer, padded_batch):
    tiny_model.train()
    try:
        a = attention_weights(tiny_model, *padded_batch)
        b = attention_weights(tiny_model, *padded_batch)
        assert tiny_model.training
        sentence_attention(tiny_model, tiny_tokenizer, SOURCES[0])  # greedy decoding, then teacher forcing
        assert tiny_model.training
    finally:
        tiny_model.eval()
    for kind in ATTENTION_KINDS:
        for wa, wb in zip(a[kind], b[kind], strict=True):
            np.testing.assert_array_equal(wa, wb)


def test_batch_maps_are_trimmed_and_match_single_sentences(tiny_model, tiny_tokenizer):
    batch = sentences_attention(tiny_model, tiny_tokenizer, SOURCES, TARGETS)
    for source, target, maps in zip(SOURCES, TARGETS, batch, strict=True):
        alone = sentence_attention(tiny_model, tiny_tokenizer, source, target)
        s, t = len(maps.source_ids), len(maps.predicted_ids)
        for kind, shape in (("encoder", (s, s)), ("decoder_self", (t, t)), ("cross", (t, s))):
            for w_batch, w_alone in zip(maps.layers(kind), alone.layers(kind), strict=True):
                assert w_batch.shape == (tiny_model.cfg.n_heads, *shape)
                np.testing.assert_allclose(w_batch, w_alone, atol=1e-5)


def test_teacher_forced_axes_and_special_labels(tiny_model, tiny_tokenizer):
    cfg = tiny_model.cfg
    maps = sentence_attention(tiny_model, tiny_tokenizer, SOURCES[1], TARGETS[1])
    target_ids = tiny_tokenizer.encode(TARGETS[1])
    assert maps.teacher_forced and maps.target_text == TARGETS[1]
    assert maps.source_ids == tuple(tiny_tokenizer.encode(SOURCES[1]) + [cfg.eos_id])
    assert maps.predicted_ids == tuple(target_ids + [cfg.eos_id])
    assert maps.decoder_input_ids == tuple([cfg.bos_id] + target_ids)
    assert maps.source_labels[-1] == "<eos>" and maps.predicted_labels[-1] == "<eos>"
    assert maps.decoder_input_labels[0] == "<bos>"
    assert not any("\u2581" in label for label in maps.source_labels)  # word marks are not shown
    assert maps.axes("encoder")[:2] == (maps.source_labels, maps.source_labels)
    assert maps.axes("decoder_self")[:2] == (maps.predicted_labels, maps.decoder_input_labels)
    assert maps.axes("cross")[:2] == (maps.predicted_labels, maps.source_labels)


def test_greedy_rows_are_labelled_by_the_token_predicted_there(tiny_model, tiny_tokenizer):
    """Row t of the decoder maps is the position whose argmax is predicted_ids[t] (the greedy decode)."""
    import torch

    cfg = tiny_model.cfg
    maps = sentence_attention(tiny_model, tiny_tokenizer, SOURCES[2])
    assert not maps.teacher_forced and maps.decoder_input_ids[0] == cfg.bos_id
    assert maps.decoder_input_ids[1:] == maps.predicted_ids[:-1]
    with torch.inference_mode():
        logits = tiny_model(torch.tensor([maps.source_ids]), torch.tensor([len(maps.source_ids)]),
                            torch.tensor([maps.decoder_input_ids]))[0]
        logits[:, [cfg.pad_id, cfg.bos_id]] = float("-inf")  # never proposed by the decoder
    assert tuple(logits.argmax(-1).tolist()) == maps.predicted_ids


def test_bad_inputs_are_input_errors(tiny_model, tiny_tokenizer):
    with pytest.raises(InputError, match="empty"):
        sentence_attention(tiny_model, tiny_tokenizer, "   ")
    with pytest.raises(InputError, match="at most 64"):
        sentence_attention(tiny_model, tiny_tokenizer, "seven " * 80)
    with pytest.raises(InputError, match="src_lengths"):
        attention_weights(tiny_model, np.ones((1, 3)), np.array([4]), np.ones((1, 2)))


def test_resolve_token():
    labels = ("three", "hundred", "and", "for", "·ty", "<eos>")
    assert resolve_token(None, labels) == 0
    assert resolve_token(2, labels) == 2
    assert resolve_token("4", labels) == 4
    assert resolve_token("-1", labels) == 5
    assert resolve_token("hundred", labels) == 1
    assert resolve_token("ty", labels) == 4 and resolve_token("·ty", labels) == 4
    assert resolve_token("<eos>", labels) == 5
    with pytest.raises(InputError, match="out of range"):
        resolve_token(6, labels)
    with pytest.raises(InputError, match="'seven' is not in the sequence"):
        resolve_token("seven", labels)


def _assert_png(path: str) -> tuple[int, int]:
    from PIL import Image

    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and min(im.size) > 100
        return im.size


def test_figure_count_and_token_figure(tiny_model, tiny_tokenizer, tmp_path):
    maps = sentence_attention(tiny_model, tiny_tokenizer, SOURCES[1], TARGETS[1])
    index = maps.predicted_labels.index("cent")
    paths = write_attention_figures(maps, tmp_path / "maps", token="cent", token_kind="cross", token_layer=0, dpi=60)
    expected = [f"{k}_layer{i}.png" for k in ATTENTION_KINDS for i in (1, 2)] + [f"token_cross_layer1_pos{index}.png"]
    assert sorted(p.name for p in (tmp_path / "maps").iterdir()) == sorted(expected)
    assert [p.rsplit("/", 1)[-1] for p in paths] == expected
    for path in paths:
        _assert_png(path)


def test_token_figure_of_a_source_token_by_name(tiny_model, tiny_tokenizer, tmp_path):
    maps = sentence_attention(tiny_model, tiny_tokenizer, SOURCES[1], TARGETS[1])
    path = write_token_figure(maps, str(tmp_path), token="hundred", dpi=60)  # encoder, last layer by default
    assert path.endswith(f"token_encoder_layer2_pos{maps.source_labels.index('hundred')}.png")
    _assert_png(path)
    with pytest.raises(InputError, match="not in the sequence"):  # a source token is no decoder position
        write_attention_figures(maps, tmp_path / "bad", token="hundred", token_kind="cross")
    with pytest.raises(InputError, match=r"layer 3 \(counted from 1\) is out of range"):
        write_attention_figures(maps, tmp_path / "bad", token_layer=2)
    assert not (tmp_path / "bad").exists()  # checked before anything is written


def test_heatmaps_of_layers_the_model_lacks_are_removed_with_a_warning(tiny_model, tiny_tokenizer, tmp_path):
    """A deeper model's run left encoder_layer3.png etc. in --out: they would read as this model's figures."""
    maps = sentence_attention(tiny_model, tiny_tokenizer, SOURCES[0], TARGETS[0])
    out = tmp_path / "maps"
    out.mkdir()
    stale = ["encoder_layer3.png", "cross_layer7.png"]
    kept = ["encoder_layer3.txt", "notes.png", "token_cross_layer3_pos1.png"]  # not heatmaps this run replaces
    for name in stale + kept:
        (out / name).write_bytes(b"old")
    with pytest.warns(UserWarning, match=r"removed 2 heatmap\(s\) .*cross_layer7\.png, encoder_layer3\.png"):
        paths = write_attention_figures(maps, out, dpi=60)
    names = {p.name for p in out.iterdir()}
    assert not names & set(stale) and set(kept) <= names
    assert {p.rsplit("/", 1)[-1] for p in paths} <= names
