"""The model config's deviations for imported models: defaults are the paper's (old configs read unchanged),
other values are honoured by the torch model, bad ones refused naming the field."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from transduce.errors import ConfigError
from transduce.formats.model_config import ModelConfig
from transduce.formats.weights import weight_shapes
from transduce.models.transformer import Transformer, sinusoidal_table

DEVIATIONS = dict(activation="gelu", position_layout="halves", position_frequencies="fairseq", position_offset=2,
                  scale_embedding=False, final_logits_bias=True, src_vocab_size=50, share_embeddings=False,
                  tie_output=True, bos_id=2)


def test_old_configs_read_with_the_papers_defaults():
    old = {"vocab_size": 100, "encoder_layers": 1, "decoder_layers": 1, "d_model": 16, "n_heads": 2, "d_ff": 32,
           "dropout": 0.1, "max_positions": 32, "norm_first": False, "layer_norm_eps": 1e-5,
           "share_embeddings": True, "pad_id": 0, "bos_id": 1, "eos_id": 2, "unk_id": 3}
    cfg = ModelConfig.from_dict(old)
    assert cfg.deviations() == {} and cfg.activation == "relu" and cfg.position_layout == "interleaved"
    assert cfg.scale_embedding and not cfg.final_logits_bias and cfg.source_vocab_size == 100
    # the paper's table is unchanged: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)
    pe = sinusoidal_table(5, 8)
    assert pe[3, 2].item() == pytest.approx(math.sin(3 / 10000 ** (2 / 8)), abs=1e-7)
    assert pe[3, 3].item() == pytest.approx(math.cos(3 / 10000 ** (2 / 8)), abs=1e-7)
    assert list(weight_shapes(cfg)) == list(Transformer(cfg).state_dict())
    assert cfg.positions == "sinusoidal" and not cfg.layernorm_embedding
    assert not any("positions" in k or "embed_norm" in k for k in Transformer(cfg).state_dict())


def test_an_old_configs_model_embeds_as_the_papers():
    """Without the mBART fields a model's embedding is still E[ids] * sqrt(d) + the sinusoidal table (a buffer,
    no weight), so old model directories decode as before."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, encoder_layers=1, decoder_layers=1, d_model=16, n_heads=2, d_ff=32,
                      max_positions=32, dropout=0.0)
    model = Transformer(cfg).eval()
    ids = torch.tensor([[5, 6, 7]])
    want = model.embed.weight[ids] * 4.0 + sinusoidal_table(32, 16)[:3]
    torch.testing.assert_close(model._embed(model.embed, ids, torch.arange(3), "encoder"), want, rtol=0, atol=0)


def test_learned_positions_and_the_embedding_norm():
    """mBART's: each stack reads its own learned table at row p for position p, and layer-norms the sum."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, encoder_layers=1, decoder_layers=1, d_model=16, n_heads=2, d_ff=32,
                      max_positions=32, dropout=0.0, norm_first=True, positions="learned", layernorm_embedding=True)
    model = Transformer(cfg).eval()
    assert list(weight_shapes(cfg)) == list(model.state_dict()) and not hasattr(model, "pe")
    with torch.no_grad():
        for m in (model.encoder_embed_norm, model.decoder_embed_norm):
            m.weight.normal_()
            m.bias.normal_()
    ids = torch.tensor([[5, 6, 7]])
    for stack in ("encoder", "decoder"):
        table, norm = getattr(model, f"{stack}_positions").weight, getattr(model, f"{stack}_embed_norm")
        want = torch.nn.functional.layer_norm(model.embed.weight[ids] * 4.0 + table[:3], (16,), norm.weight,
                                              norm.bias, 1e-5)
        got = model._embed(model.embed, ids, torch.arange(3), stack)
        torch.testing.assert_close(got, want)
    # the incremental step reads the decoder's table at the step's position, as the full pass does
    src, lengths = torch.tensor([[4, 5, 6, 2]]), torch.tensor([4])
    tgt = torch.tensor([[2, 9, 11]])
    with torch.no_grad():
        full = torch.log_softmax(model(src, lengths, tgt), dim=-1)[0]
        _, ck, cv = model.encode(src, lengths)
        keys = [torch.zeros(1, 2, 3, 8) for _ in range(1)]
        values = [torch.zeros(1, 2, 3, 8) for _ in range(1)]
        for t in range(3):
            lp, k, v = model.decode_step(tgt[:, t], torch.tensor([t]), lengths, keys, values, ck, cv)
            keys[0][:, :, t:t + 1], values[0][:, :, t:t + 1] = k[0], v[0]
            torch.testing.assert_close(lp[0], full[t], rtol=0, atol=1e-5)

    with pytest.raises(ConfigError, match="with learned positions they keep their defaults"):
        cfg.replace(position_offset=2)  # the offset describes the sinusoidal table; a learned one's rows are its own


@pytest.mark.parametrize("field, value, match", [
    ("activation", "gelu_new", "activation must be one of relu, gelu, swish, got 'gelu_new'"),
    ("position_layout", "learned", "position_layout must be one of interleaved, halves"),
    ("src_vocab_size", 50, "src_vocab_size \\(50\\) differs from vocab_size"),
    ("tie_output", True, "tie_output applies only without share_embeddings"),
    ("bos_id", 3, "special ids"),
    ("positions", "rotary", "positions must be one of sinusoidal, learned"),
    ("layernorm_embedding", 1, "layernorm_embedding must be true or false"),
])
def test_bad_values_are_refused_naming_the_field(field, value, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(vocab_size=100, **{field: value})


def test_position_tables_of_marian_and_fairseq():
    d = 8
    halves = sinusoidal_table(4, d, layout="halves")  # Marian: [sin | cos], the paper's frequencies, from 0
    for pos in range(4):
        for i in range(d // 2):
            assert halves[pos, i].item() == pytest.approx(math.sin(pos / 10000 ** (2 * i / d)), abs=1e-6)
            assert halves[pos, d // 2 + i].item() == pytest.approx(math.cos(pos / 10000 ** (2 * i / d)), abs=1e-6)
    fair = sinusoidal_table(4, d, layout="halves", frequencies="fairseq", offset=2)  # fairseq, padding_idx 1
    for pos in range(4):
        for i in range(d // 2):
            angle = (pos + 2) * math.exp(-i * math.log(10000) / (d // 2 - 1))
            assert fair[pos, i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert fair[pos, d // 2 + i].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_the_model_honours_each_deviation():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, encoder_layers=1, decoder_layers=1, d_model=16, n_heads=2, d_ff=32,
                      max_positions=32, dropout=0.0, **DEVIATIONS)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_()
    assert list(weight_shapes(cfg)) == list(model.state_dict())
    assert model.src_embed.weight.shape == (50, 16) and not hasattr(model, "out_proj")
    src = torch.randint(4, 50, (1, 5))  # source ids past the target vocabulary
    memory, _ = model.encode_memory(src, torch.tensor([5]))
    x = torch.tensor([[2]])
    # by hand: E[2] unscaled + the fairseq table's row for position 0; one post-norm layer with gelu
    emb = model.embed.weight[2] + sinusoidal_table(1, 16, "halves", "fairseq", 2)[0]
    layer = model.decoder_layers[0]
    with torch.no_grad():
        h = layer.norm1(emb + layer.self_attn(emb[None, None], emb[None, None], torch.ones(1, 1, 1, 1, dtype=bool))[0])
        k, v = layer.cross_attn.key_value(memory)
        c, _ = layer.cross_attn.attend(layer.cross_attn.query(h), k, v, torch.ones(1, 1, 1, 5, dtype=bool))
        h = layer.norm2(h + c)
        h = layer.norm3(h + layer.ffn.w2(torch.nn.functional.gelu(layer.ffn.w1(h))))
        want = h[0, 0] @ model.embed.weight.T + model.final_logits_bias
        got = model(src, torch.tensor([5]), x)[0, 0]
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)


def test_an_old_model_directory_loads_and_decodes_as_before(tiny_model_dir, tmp_path):
    """A model directory written before positions, layernorm_embedding and untied_output existed (its config.json
    without them) loads with the paper's values, the same weights, and decodes token for token as with them spelt
    out."""
    import json
    import shutil

    from transduce.models.checkpoint import load_model_dir
    from transduce.runtime.translator import Translator

    old = shutil.copytree(tiny_model_dir, tmp_path / "old")
    config = json.loads((old / "config.json").read_text())
    assert config["model"].pop("positions") == "sinusoidal" and config["model"].pop("layernorm_embedding") is False
    assert config["model"].pop("untied_output") is False
    (old / "config.json").write_text(json.dumps(config))
    model, _, _ = load_model_dir(str(old))
    assert model.cfg.positions == "sinusoidal" and not model.cfg.layernorm_embedding and hasattr(model, "pe")
    texts = ["a b c", "b c d e", "c"]
    results = []
    for directory in (tiny_model_dir, old):
        tr = Translator.from_model_dir(str(directory))
        results.append([[list(o.tokens) for o in tr.translate(texts, beam_size=b, max_len_b=8)] for b in (1, 4)])
    assert results[0] == results[1] and any(results[0][0])


def test_an_untied_projection_over_shared_embeddings_is_its_own_matrix():
    """untied_output: both stacks share one embedding, the projection is out_proj (Marian, tie_word_embeddings
    false); the weight layout lists it where the model's state_dict does."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, encoder_layers=1, decoder_layers=1, d_model=16, n_heads=2, d_ff=32,
                      max_positions=32, dropout=0.0, untied_output=True)
    model = Transformer(cfg).eval()
    assert list(weight_shapes(cfg)) == list(model.state_dict()) and not hasattr(model, "src_embed")
    assert model.output_weight() is model.out_proj.weight and cfg.deviations() == {"untied_output": True}
    assert model._src_embed() is model.embed
    src = torch.randint(4, 40, (1, 5))
    with torch.no_grad():
        got = model(src, torch.tensor([5]), torch.tensor([[1]]))
        model.out_proj.weight.copy_(model.embed.weight)
        tied = model(src, torch.tensor([5]), torch.tensor([[1]]))
    assert not torch.allclose(got, tied) and ModelConfig(vocab_size=40).output_tied
    with pytest.raises(ConfigError, match="untied_output applies only with share_embeddings"):
        ModelConfig(vocab_size=40, share_embeddings=False, untied_output=True)
