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


def _paper_forward(model: Transformer, src: torch.Tensor, src_len: int, tgt_in: torch.Tensor) -> torch.Tensor:
    """One sentence through the paper's formulas, written out from the weights with plain tensor ops (no
    module's forward): embeddings x sqrt(d_model) + PE; per sublayer LayerNorm(x + Sublayer(x)); attention
    softmax(QK^T / sqrt(d_k))V per head, over the real source tokens only, and for decoder self-attention
    over positions <= the query's; FFN max(0, xW1 + b1)W2 + b2; logits x E^T with the shared embedding E."""
    cfg = model.cfg
    d, h = cfg.d_model, cfg.n_heads
    dk = d // h
    pe = torch.zeros(512, d)
    for pos in range(512):
        for i in range(0, d, 2):
            pe[pos, i] = math.sin(pos / 10000 ** (i / d))
            pe[pos, i + 1] = math.cos(pos / 10000 ** (i / d))

    def linear(lin, x):
        return x @ lin.weight.T + lin.bias

    def norm(ln, x):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + cfg.layer_norm_eps) * ln.weight + ln.bias

    def attention(att, xq, xkv, allowed):  # allowed[i, j]: query i may see key j
        heads = []
        for j in range(h):
            cols = slice(j * dk, (j + 1) * dk)
            q, k, v = (linear(att.q_proj, xq)[:, cols], linear(att.k_proj, xkv)[:, cols],
                       linear(att.v_proj, xkv)[:, cols])
            scores = (q @ k.T / math.sqrt(dk)).masked_fill(~allowed, float("-inf"))
            heads.append(torch.softmax(scores, -1) @ v)
        return linear(att.out_proj, torch.cat(heads, -1))

    def ffn(f, x):
        return linear(f.w2, torch.clamp(linear(f.w1, x), min=0))

    x = model.embed.weight[src[:src_len]] * math.sqrt(d) + pe[:src_len]
    everything = torch.ones(src_len, src_len, dtype=torch.bool)
    for layer in model.encoder_layers:
        x = norm(layer.norm1, x + attention(layer.self_attn, x, x, everything))
        x = norm(layer.norm2, x + ffn(layer.ffn, x))
    memory, t = x, len(tgt_in)
    y = model.embed.weight[tgt_in] * math.sqrt(d) + pe[:t]
    subsequent = torch.ones(t, t, dtype=torch.bool).tril()
    to_source = torch.ones(t, src_len, dtype=torch.bool)
    for layer in model.decoder_layers:
        y = norm(layer.norm1, y + attention(layer.self_attn, y, y, subsequent))
        y = norm(layer.norm2, y + attention(layer.cross_attn, y, memory, to_source))
        y = norm(layer.norm3, y + ffn(layer.ffn, y))
    return y @ model.embed.weight.T


def test_the_model_is_the_papers_formulas(tiny_model):
    """An independent reference: a padded batch through the model equals each sentence through the paper's
    formulas written out from its weights (post-norm, scaling, masks, shared embeddings): swapped norms, a
    misplaced residual, a missing sqrt(d_model) or a leaking pad would all fail this."""
    torch.manual_seed(0)
    v = tiny_model.cfg.vocab_size
    lengths = [7, 3, 5]
    src = torch.randint(4, v, (3, 7))
    for i, n in enumerate(lengths):
        src[i, n:] = torch.randint(4, v, (7 - n,))  # garbage, not pad: only the lengths may hide it
    tgt_in = torch.randint(4, v, (3, 6))
    tgt_in[:, 0] = tiny_model.cfg.bos_id
    was_training = tiny_model.training
    tiny_model.eval()  # no dropout
    try:
        with torch.no_grad():
            logits = tiny_model(src, torch.tensor(lengths), tgt_in)
    finally:
        tiny_model.train(was_training)
    with torch.no_grad():
        for i, n in enumerate(lengths):
            want = _paper_forward(tiny_model, src[i], n, tgt_in[i])
            torch.testing.assert_close(logits[i], want, atol=2e-4, rtol=1e-4)
