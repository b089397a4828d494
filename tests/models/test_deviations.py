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


@pytest.mark.parametrize("field, value, match", [
    ("activation", "gelu_new", "activation must be one of relu, gelu, swish, got 'gelu_new'"),
    ("position_layout", "learned", "position_layout must be one of interleaved, halves"),
    ("src_vocab_size", 50, "src_vocab_size \\(50\\) differs from vocab_size"),
    ("tie_output", True, "tie_output applies only without share_embeddings"),
    ("bos_id", 3, "special ids"),
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
