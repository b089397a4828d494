"""The reference model against the paper's formulas."""

from __future__ import annotations

import math

import pytest
import torch

from transduce.errors import ConfigError
from transduce.models.config import ModelConfig, preset
from transduce.models.transformer import Transformer, masked_softmax, sinusoidal_table


def test_positional_encoding_matches_formula():
    pe = sinusoidal_table(50, 16)
    for pos in (0, 1, 7, 49):
        for i in range(8):
            angle = pos / (10000 ** (2 * i / 16))
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_masked_keys_get_exactly_zero_weight_and_no_nan():
    scores = torch.randn(2, 3, 4, 5) * 100
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)[:, None, None, :]
    w = masked_softmax(scores, mask)
    assert not torch.isnan(w).any()
    assert (w[0][..., ~mask[0, 0, 0]] == 0).all()
    assert torch.allclose(w.sum(-1), torch.ones(2, 3, 4))
    # a fully masked row is uniform, not NaN, also in half precision
    w16 = masked_softmax(scores.half(), mask)
    assert not torch.isnan(w16).any()
    assert torch.allclose(w16[1], torch.full_like(w16[1], 0.2))


def test_attention_weights_respect_padding_and_future(tiny_model):
    cfg = tiny_model.cfg
    src = torch.randint(4, cfg.vocab_size, (2, 6))
    lens = torch.tensor([6, 3])
    tgt = torch.randint(4, cfg.vocab_size, (2, 5))
    with torch.no_grad():
        _, att = tiny_model(src, lens, tgt, return_attention=True)
    for w in att["encoder"] + att["cross"]:
        assert torch.allclose(w.sum(-1), torch.ones_like(w.sum(-1)), atol=1e-6)
        assert (w[1, ..., 3:] == 0).all()  # padded keys of the short source
    for w in att["decoder_self"]:
        assert (w.triu(diagonal=1) == 0).all()  # no weight on future positions
        assert not torch.isnan(w).any()


def test_base_parameter_count_close_to_paper():
    n = Transformer(preset("base", 37000)).num_parameters()
    assert abs(n - 65e6) / 65e6 < 0.05, n  # the paper: 65M


def test_shared_embeddings_are_one_tensor(tiny_model):
    names = [k for k in tiny_model.state_dict() if "embed" in k or "out_proj.weight" == k]
    assert names == ["embed.weight"]
    unshared = Transformer(tiny_model.cfg.replace(share_embeddings=False))
    assert {"embed.weight", "src_embed.weight", "out_proj.weight"} <= set(unshared.state_dict())


@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_steps_reproduce_full_forward(tiny_model, norm_first):
    torch.manual_seed(1)
    model = tiny_model if not norm_first else Transformer(tiny_model.cfg.replace(norm_first=True)).eval()
    cfg = model.cfg
    b, s, t = 3, 9, 7
    src = torch.randint(4, cfg.vocab_size, (b, s))
    lens = torch.tensor([9, 4, 1])  # padded batch, one source of a single token
    tgt = torch.randint(4, cfg.vocab_size, (b, t))
    with torch.no_grad():
        full = torch.log_softmax(model(src, lens, tgt), -1)
        _, ck, cv = model.encode(src, lens)
        cap = t + 3
        shape = (b, cfg.n_heads, cap, cfg.head_dim)
        pk = [torch.full(shape, 123.0) for _ in range(cfg.decoder_layers)]  # garbage in unused slots
        pv = [torch.full(shape, -55.0) for _ in range(cfg.decoder_layers)]
        for i in range(t):
            lp, nk, nv = model.decode_step(tgt[:, i], torch.full((b,), i), lens, pk, pv, ck, cv)
            torch.testing.assert_close(lp, full[:, i], atol=1e-5, rtol=0)
            for layer in range(cfg.decoder_layers):
                pk[layer][:, :, i : i + 1] = nk[layer]
                pv[layer][:, :, i : i + 1] = nv[layer]


def test_post_norm_is_the_default_and_dropout_applies_in_training(tiny_model):
    assert tiny_model.cfg.norm_first is False
    m = Transformer(tiny_model.cfg)
    src = torch.randint(4, m.cfg.vocab_size, (2, 5))
    lens = torch.tensor([5, 5])
    tgt = torch.randint(4, m.cfg.vocab_size, (2, 4))
    m.train()
    assert not torch.equal(m(src, lens, tgt), m(src, lens, tgt))
    m.eval()
    assert torch.equal(m(src, lens, tgt), m(src, lens, tgt))


def test_invalid_config_is_a_clear_error():
    with pytest.raises(ConfigError, match="divisible"):
        ModelConfig(vocab_size=100, d_model=30, n_heads=4)
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("huge", 100)
    with pytest.raises(ConfigError, match="max_positions must be <= 65,536"):
        ModelConfig(vocab_size=100, max_positions=10**12)
    with pytest.raises(ConfigError, match="vocab_size must be < 2"):
        ModelConfig(vocab_size=2**40)
    for bad in (None, 3, "abc", [1]):  # a damaged config.json's "model"
        with pytest.raises(ConfigError, match="the model config must be a JSON object"):
            ModelConfig.from_dict(bad)
