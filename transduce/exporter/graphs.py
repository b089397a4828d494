"""The two traced functions as modules whose inputs and outputs are exactly the contract's.

`EncoderGraph` wraps `Transformer.encode` and `StepGraph` wraps `Transformer.decode_step`; they only
flatten the per-layer lists into the contract's order (key_0, value_0, key_1, value_1, ...).
`example_inputs` and `dynamic_shapes` give torch.export what it needs to keep batch, src_len and
cache_len symbolic. Imported only by the exporter (it imports torch).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from transduce.formats import contract
from transduce.formats.dtypes import precision_dtype
from transduce.models.config import ModelConfig


def torch_dtype(precision: str) -> torch.dtype:
    """The torch dtype of a precision's float tensors (torch names them as numpy does)."""
    return getattr(torch, precision_dtype(precision))


def interleave(keys: list[Tensor], values: list[Tensor]) -> list[Tensor]:
    """[k0, k1], [v0, v1] -> [k0, v0, k1, v1] (the contract's per-layer order)."""
    return [t for kv in zip(keys, values) for t in kv]


class EncoderGraph(nn.Module):
    """src_ids (B, S), src_lengths (B,) -> memory (B, S, D), cross_key_0, cross_value_0, ... (B, H, S, Dh)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, src_ids: Tensor, src_lengths: Tensor) -> tuple[Tensor, ...]:
        memory, cross_k, cross_v = self.model.encode(src_ids, src_lengths)
        return (memory, *interleave(cross_k, cross_v))


class StepGraph(nn.Module):
    """tokens, positions, src_lengths (B,); past = [past_key_0, past_value_0, ...] (B, H, C, Dh);
    cross = [cross_key_0, cross_value_0, ...] (B, H, S, Dh) -> log_probs (B, V) fp32, new_key_0,
    new_value_0, ... (B, H, 1, Dh)."""

    attention = False  # AttentionStepGraph: every decoder layer's cross-attention too

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self, tokens: Tensor, positions: Tensor, src_lengths: Tensor, past: list[Tensor], cross: list[Tensor]
    ) -> tuple[Tensor, ...]:
        log_probs, new_k, new_v, *attention = self.model.decode_step(
            tokens, positions, src_lengths, past[0::2], past[1::2], cross[0::2], cross[1::2],
            return_attention=self.attention,
        )
        return (log_probs, *interleave(new_k, new_v), *attention)


class AttentionStepGraph(StepGraph):
    """StepGraph's inputs and outputs, then attention (B, layers, S) fp32: every decoder layer's cross-attention
    weights averaged over the heads (contract.ATTN_STEP_FILE; alignments read it)."""

    attention = True


def trace_sizes(cfg: ModelConfig) -> dict[str, int]:
    """Sizes of the dynamic axes in the example inputs: distinct and >= 2, so torch.export neither
    specializes an axis to 0/1 nor unifies two axes that happen to have the same size."""
    p = cfg.max_positions
    return {"batch": 2, "src_len": min(p, 7), "cache_len": min(p - 1, 6)}


def example_inputs(cfg: ModelConfig, precision: str) -> tuple[tuple, tuple]:
    """(encoder args, step args) for tracing, the float ones in the graph's precision."""
    g = torch.Generator().manual_seed(0)
    dt = torch_dtype(precision)
    n = trace_sizes(cfg)
    b, s, c, h, dh = n["batch"], n["src_len"], n["cache_len"], cfg.n_heads, cfg.head_dim

    def ids(*shape: int, vocab: int = cfg.vocab_size) -> Tensor:
        return torch.randint(4, vocab, shape, generator=g)

    def kv(length: int) -> list[Tensor]:
        return [torch.randn(b, h, length, dh, generator=g).to(dt) for _ in range(2 * cfg.decoder_layers)]

    src_lengths = torch.tensor([s] + [1] * (b - 1))
    encoder_args = (ids(b, s, vocab=cfg.source_vocab_size), src_lengths)
    step_args = (ids(b), torch.tensor([c - 1] + [0] * (b - 1)), src_lengths, kv(c), kv(s))
    return encoder_args, step_args


def dynamic_shapes(cfg: ModelConfig) -> tuple[dict, dict]:
    """torch.export dynamic shapes of (encoder, step), built from the contract's axes and ranges."""
    from torch.export import Dim

    ranges = contract.dynamic_axis_ranges(cfg)
    dims = {name: Dim(name, min=lo, max=hi) if hi is not None else Dim(name, min=lo)
            for name, (lo, hi) in ranges.items()}

    def spec(ts: contract.TensorSpec) -> dict[int, Dim]:
        return {i: dims[axis] for i, axis in enumerate(ts.axes) if axis in dims}

    enc = {ts.name: spec(ts) for ts in contract.encoder_inputs()}
    step_specs = contract.step_inputs(cfg.decoder_layers)
    step = {ts.name: spec(ts) for ts in step_specs[:3]}
    step["past"] = [spec(ts) for ts in step_specs if ts.name.startswith("past_")]
    step["cross"] = [spec(ts) for ts in step_specs if ts.name.startswith("cross_")]
    return enc, step
