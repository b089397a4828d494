"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

Encoder and decoder stacks of N layers; post-norm residual sublayers LayerNorm(x + Dropout(Sublayer(x)));
multi-head scaled dot-product attention softmax(QK^T / sqrt(d_k)) V with padding masks and the
decoder's subsequent mask; position-wise FFN max(0, x W1 + b1) W2 + b2; sinusoidal positional
encoding; embeddings multiplied by sqrt(d_model) and shared with the pre-softmax projection.

Besides the teacher-forced `forward`, the model has an explicit incremental-decoding API whose cache
is plain tensors (the exporter traces exactly these two functions):
  `encode(src_ids, src_lengths)` -> memory and each decoder layer's cross-attention K/V, once per source;
  `decode_step(tokens, positions, src_lengths, past_keys, past_values, cross_keys, cross_values)`
      -> fp32 log-probs for the next token and this step's self-attention K/V (one position).
The self-attention cache is a buffer of capacity C >= 1 owned by the caller; slots at or beyond a
row's position are ignored by a mask, so the caller preallocates it and writes each step's K/V
into slot `position` in place (see transduce/formats/contract.py).

Deviations from the paper, all of them here:
- `max_positions` caps the sinusoidal table (the paper's encoding is defined for any position).
- Linear layers have biases and Xavier-uniform init; embeddings are N(0, d_model^-0.5) (the paper
  states neither).
- LayerNorm epsilon is 1e-5 (unstated in the paper).
- `norm_first=True` (not the paper's default) gives pre-norm blocks x + Dropout(Sublayer(LayerNorm(x)))
  with a final LayerNorm on each stack.
- Masked attention scores are set to the dtype's lowest finite value (not -inf, not -1e9), so a fully
  masked row gives a uniform distribution instead of NaN, and masked keys get exactly zero weight.
- Softmax, its masking, LayerNorm and the post-norm residual sums run in fp32 whatever the weights'
  dtype (no-ops for fp32 weights; they keep fp16/bf16 graphs from overflowing).

Deviations of imported models (Marian/OPUS-MT, FSMT, fairseq), each a ModelConfig field whose default is the
paper's: `activation` (gelu, swish), `position_layout` ([sin | cos] halves), `position_frequencies` (fairseq's
exp(-i ln(10000) / (d/2 - 1))), `position_offset` (fairseq's padding_idx + 1), `scale_embedding` (off),
`final_logits_bias` (a bias on the projection), `src_vocab_size` (a source vocabulary of its own), `tie_output`
(the projection is the target embedding while the source one is separate), `untied_output` (the projection is its
own matrix while both stacks share one embedding), `positions` (learned tables, one per stack, in place of the
sinusoidal one: mBART), `layernorm_embedding` (a LayerNorm on embeddings + positions: mBART), and `bos_id` (the
decoder's start token: EOS for fairseq, FSMT, M2M100 and mBART, pad for Marian).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transduce.models.config import ModelConfig


def sinusoidal_table(n_positions: int, d_model: int, layout: str = "interleaved", frequencies: str = "paper",
                     offset: int = 0) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)) (the paper).

    layout "halves": sin in the first d/2 columns, cos in the last (Marian, fairseq); frequencies "fairseq":
    exp(-i ln(10000) / (d/2 - 1)) instead of 10000^(-2i/d); row p is position p + offset (fairseq: pad + 1).
    """
    half = d_model // 2
    pos = torch.arange(offset, offset + n_positions, dtype=torch.float64)[:, None]  # (P, 1)
    i = torch.arange(half, dtype=torch.float64)  # (D/2,)
    if frequencies == "fairseq":
        angle = pos * torch.exp(i * -(math.log(10000.0) / (half - 1)))  # (P, D/2)
    else:
        angle = pos / torch.pow(10000.0, 2 * i / d_model)  # (P, D/2)
    if layout == "halves":
        return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).float()
    pe = torch.zeros(n_positions, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe.float()


def positional_table(cfg: ModelConfig) -> Tensor:
    """The model's positional table (max_positions, d_model), as its config lays it out."""
    return sinusoidal_table(cfg.max_positions, cfg.d_model, cfg.position_layout, cfg.position_frequencies,
                            cfg.position_offset)


ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu}  # gelu: the erf form (HF's and fairseq's "gelu")


def length_mask(lengths: Tensor, size: int | Tensor) -> Tensor:
    """(B,) lengths -> (B, size) bool, True where the position is < length (a real token)."""
    positions = torch.arange(size, device=lengths.device)  # (size,)
    return positions[None, :] < lengths[:, None]


def masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the last axis in fp32 where `mask` is True; masked entries get exactly 0.

    A fully masked row gives a uniform distribution, never NaN.
    """
    scores = scores.float()
    scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    return torch.softmax(scores, dim=-1)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm computed in fp32 and cast back to the input's dtype."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight.float() if self.weight is not None else None
        b = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


class MultiHeadAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def _split(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)

    def _merge(self, x: Tensor) -> Tensor:
        b, _, t, _ = x.shape
        return x.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)  # (B, T, D)

    def query(self, x: Tensor) -> Tensor:
        """(B, T, D) -> queries already scaled by 1/sqrt(d_k): (B, H, T, Dh)."""
        return self._split(self.q_proj(x)) * (1.0 / math.sqrt(self.head_dim))

    def key_value(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(B, T, D) -> K, V each (B, H, T, Dh)."""
        return self._split(self.k_proj(x)), self._split(self.v_proj(x))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """q (B,H,Tq,Dh), k/v (B,H,Tk,Dh), mask broadcastable to (B,H,Tq,Tk) -> out (B,Tq,D), weights."""
        weights = masked_softmax(q @ k.transpose(-2, -1), mask)  # (B, H, Tq, Tk) fp32
        out = weights.to(v.dtype) @ v  # (B, H, Tq, Dh)
        return self.out_proj(self._merge(out)), weights

    def forward(self, x_q: Tensor, x_kv: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self.key_value(x_kv)
        return self.attend(self.query(x_q), k, v, mask)

    def _step_linear(self, x: Tensor, projections: list[nn.Linear], scale_first: bool) -> list[Tensor]:
        """One position's projections, each reshaped to heads (B, 1, D) -> (B, H, 1, Dh) (one position:
        a reshape, no transpose: 12 fewer graph nodes per step of the demo model); the first one
        scaled by 1/sqrt(d_k) if scale_first."""
        outs = [p(x) for p in projections]
        if scale_first:
            outs[0] = outs[0] * (1.0 / math.sqrt(self.head_dim))
        return [o.reshape(x.shape[0], self.n_heads, 1, self.head_dim) for o in outs]  # (B, H, 1, Dh)

    def step_cross(self, x: Tensor, k: Tensor, v: Tensor, mask: Tensor,
                   need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Attention of one position over precomputed K/V: x (B,1,D), k/v (B,H,S,Dh) -> (B,1,D), and with
        need_weights its weights averaged over the heads, (B, S) fp32."""
        (q,) = self._step_linear(x, [self.q_proj], scale_first=True)
        weights = masked_softmax(q @ k.transpose(-2, -1), mask)  # (B, H, 1, S)
        out = weights.to(v.dtype) @ v  # (B, H, 1, Dh)
        out = self.out_proj(out.reshape(x.shape[0], 1, -1))  # (B, 1, D)
        # the heads' sum over their count, not mean(): ONNX's ReduceMean takes its axes as an input from opset 18
        # on, and the exporter's conversion down to opset 17 cannot move it back (ReduceSum's has been one since 13)
        return (out, weights[:, :, 0].sum(dim=1) / weights.shape[1]) if need_weights else out

    def step(
        self, x: Tensor, k_cache: Tensor, v_cache: Tensor, cache_mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention of one new position over the cached ones plus itself.

        x (B,1,D); k_cache/v_cache (B,H,C,Dh); cache_mask (B,1,1,C) True for filled slots.
        Returns out (B,1,D) and this position's k, v (B,H,1,Dh). The cache is only read: scores
        over the cache and over the new key are computed apart and softmaxed together, so
        nothing of cache size is concatenated or copied.
        """
        q, k_new, v_new = self._step_linear(x, [self.q_proj, self.k_proj, self.v_proj], scale_first=True)
        s_cache = q @ k_cache.transpose(-2, -1)  # (B, H, 1, C)
        s_self = (q * k_new).sum(dim=-1, keepdim=True)  # (B, H, 1, 1)
        self_mask = torch.ones_like(cache_mask[..., :1])  # (B, 1, 1, 1)
        weights = masked_softmax(
            torch.cat([s_cache, s_self], dim=-1), torch.cat([cache_mask, self_mask], dim=-1)
        )  # (B, H, 1, C+1)
        c = k_cache.shape[2]
        w_cache, w_self = weights[..., :c].to(v_cache.dtype), weights[..., c:].to(v_new.dtype)
        out = w_cache @ v_cache + w_self * v_new  # (B, H, 1, Dh)
        return self.out_proj(out.reshape(x.shape[0], 1, -1)), k_new, v_new  # (B, 1, D)


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (or gelu / swish in place of max(0, .): cfg.activation)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.act(self.w1(x)))


class _Block(nn.Module):
    """Residual wiring shared by encoder and decoder layers (post-norm, or pre-norm if norm_first)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm_first = cfg.norm_first
        self.drop = nn.Dropout(cfg.dropout)

    def _pre(self, x: Tensor, norm: LayerNorm) -> Tensor:
        return norm(x) if self.norm_first else x

    def _post(self, x: Tensor, y: Tensor, norm: LayerNorm) -> Tensor:
        if self.norm_first:
            return x + self.drop(y)
        return norm(x.float() + self.drop(y).float()).to(x.dtype)  # LayerNorm(x + Dropout(Sublayer(x)))


class EncoderLayer(_Block):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.self_attn = MultiHeadAttention(cfg)
        self.ffn = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.norm2 = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor, src_mask: Tensor) -> tuple[Tensor, Tensor]:
        h = self._pre(x, self.norm1)
        a, weights = self.self_attn(h, h, src_mask)
        x = self._post(x, a, self.norm1)
        x = self._post(x, self.ffn(self._pre(x, self.norm2)), self.norm2)
        return x, weights


class DecoderLayer(_Block):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.self_attn = MultiHeadAttention(cfg)
        self.cross_attn = MultiHeadAttention(cfg)
        self.ffn = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.norm2 = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.norm3 = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def _ffn_block(self, x: Tensor) -> Tensor:
        return self._post(x, self.ffn(self._pre(x, self.norm3)), self.norm3)

    def forward(
        self, x: Tensor, tgt_mask: Tensor, cross_k: Tensor, cross_v: Tensor, src_mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        h = self._pre(x, self.norm1)
        a, self_weights = self.self_attn(h, h, tgt_mask)
        x = self._post(x, a, self.norm1)
        q = self.cross_attn.query(self._pre(x, self.norm2))
        c, cross_weights = self.cross_attn.attend(q, cross_k, cross_v, src_mask)
        x = self._post(x, c, self.norm2)
        return self._ffn_block(x), self_weights, cross_weights

    def step(
        self,
        x: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        cache_mask: Tensor,
        cross_k: Tensor,
        cross_v: Tensor,
        src_mask: Tensor,
        weights: list[Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One position; where `weights` is a list, the cross-attention's head-averaged weights (B, S) are
        appended to it (the step's outputs stay the same)."""
        a, k_new, v_new = self.self_attn.step(self._pre(x, self.norm1), k_cache, v_cache, cache_mask)
        x = self._post(x, a, self.norm1)
        h = self._pre(x, self.norm2)
        if weights is None:
            c = self.cross_attn.step_cross(h, cross_k, cross_v, src_mask)
        else:
            c, w = self.cross_attn.step_cross(h, cross_k, cross_v, src_mask, need_weights=True)
            weights.append(w)
        x = self._post(x, c, self.norm2)
        return self._ffn_block(x), k_new, v_new


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)  # target (and shared) embedding
        if not cfg.share_embeddings:
            self.src_embed = nn.Embedding(cfg.source_vocab_size, cfg.d_model)
        if not cfg.output_tied:
            self.out_proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.final_logits_bias:
            self.final_logits_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        if cfg.positions == "learned":  # a table per stack, weights (the sinusoidal one is computed, no weight)
            self.encoder_positions = nn.Embedding(cfg.max_positions, cfg.d_model)
            self.decoder_positions = nn.Embedding(cfg.max_positions, cfg.d_model)
        else:
            self.register_buffer("pe", positional_table(cfg), persistent=False)
        if cfg.layernorm_embedding:
            self.encoder_embed_norm = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
            self.decoder_embed_norm = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        if cfg.norm_first:
            self.encoder_norm = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
            self.decoder_norm = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for m in self.modules():
            if isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=self.cfg.d_model**-0.5)

    # -- pieces ---------------------------------------------------------------------------------
    def _embed(self, table: nn.Embedding, ids: Tensor, positions: Tensor, stack: str) -> Tensor:
        """ids (B, T), positions (B, T) or (T,) -> Dropout(E[ids] * sqrt(d_model) + PE[positions])
        (E[ids] unscaled without scale_embedding; PE the stack's learned table with learned positions; the sum
        layer-normed first with layernorm_embedding). stack: "encoder" or "decoder"."""
        e = table(ids) * math.sqrt(self.cfg.d_model) if self.cfg.scale_embedding else table(ids)
        if self.cfg.positions == "learned":
            pe = getattr(self, f"{stack}_positions")(positions)
        else:
            pe = self.pe[positions]
        x = e + pe.to(table.weight.dtype)
        if self.cfg.layernorm_embedding:
            x = getattr(self, f"{stack}_embed_norm")(x)
        return self.drop(x)  # (B, T, D)

    def output_weight(self) -> Tensor:
        """The pre-softmax projection's weight (V, D): the (target) embedding, or a matrix of its own."""
        return self.embed.weight if self.cfg.output_tied else self.out_proj.weight

    def _logits(self, x: Tensor) -> Tensor:
        bias = self.final_logits_bias if self.cfg.final_logits_bias else None
        return F.linear(x, self.output_weight(), bias)  # (B, T, V)

    def _src_embed(self) -> nn.Embedding:
        return self.embed if self.cfg.share_embeddings else self.src_embed

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- full (teacher-forced) passes -----------------------------------------------------------
    def encode_memory(self, src_ids: Tensor, src_lengths: Tensor,
                      keep_weights: bool = True) -> tuple[Tensor, list[Tensor]]:
        """src_ids (B, S), src_lengths (B,) -> memory (B, S, D) and each layer's attention weights (none
        unless keep_weights: each layer's (B, H, S, S) would otherwise live until the stack is done)."""
        s = src_ids.shape[1]
        x = self._embed(self._src_embed(), src_ids, torch.arange(s, device=src_ids.device), "encoder")
        src_mask = length_mask(src_lengths, s)[:, None, None, :]  # (B, 1, 1, S)
        weights = []
        for layer in self.encoder_layers:
            x, w = layer(x, src_mask)
            if keep_weights:
                weights.append(w)
        if self.cfg.norm_first:
            x = self.encoder_norm(x)
        return x, weights

    def cross_key_values(self, memory: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """memory (B, S, D) -> each decoder layer's cross-attention K and V, (B, H, S, Dh)."""
        kv = [layer.cross_attn.key_value(memory) for layer in self.decoder_layers]
        return [k for k, _ in kv], [v for _, v in kv]

    def forward(
        self, src_ids: Tensor, src_lengths: Tensor, tgt_in: Tensor, return_attention: bool = False
    ) -> Tensor | tuple[Tensor, dict[str, list[Tensor]]]:
        """Teacher forcing: tgt_in (B, T) starts with BOS -> logits (B, T, V).

        With return_attention=True also returns the attention weights of every layer:
        {"encoder": [(B,H,S,S)], "decoder_self": [(B,H,T,T)], "cross": [(B,H,T,S)]}.
        """
        memory, enc_weights = self.encode_memory(src_ids, src_lengths)
        cross_k, cross_v = self.cross_key_values(memory)
        b, t = tgt_in.shape
        s = src_ids.shape[1]
        x = self._embed(self.embed, tgt_in, torch.arange(t, device=tgt_in.device), "decoder")
        causal = torch.ones(t, t, dtype=torch.bool, device=tgt_in.device).tril()  # (T, T)
        tgt_mask = causal[None, None]  # (1, 1, T, T): subsequent mask
        src_mask = length_mask(src_lengths, s)[:, None, None, :]  # (B, 1, 1, S)
        self_ws, cross_ws = [], []
        for layer, k, v in zip(self.decoder_layers, cross_k, cross_v):
            x, sw, cw = layer(x, tgt_mask, k, v, src_mask)
            self_ws.append(sw)
            cross_ws.append(cw)
        if self.cfg.norm_first:
            x = self.decoder_norm(x)
        logits = self._logits(x)
        if return_attention:
            return logits, {"encoder": enc_weights, "decoder_self": self_ws, "cross": cross_ws}
        return logits

    # -- incremental decoding (what the exporter traces) ----------------------------------------
    def encode(self, src_ids: Tensor, src_lengths: Tensor) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Once per source: memory (B, S, D) and per decoder layer cross K, V (B, H, S, Dh)."""
        memory, _ = self.encode_memory(src_ids, src_lengths, keep_weights=False)
        cross_k, cross_v = self.cross_key_values(memory)
        return memory, cross_k, cross_v

    def decode_step(
        self,
        tokens: Tensor,
        positions: Tensor,
        src_lengths: Tensor,
        past_keys: list[Tensor],
        past_values: list[Tensor],
        cross_keys: list[Tensor],
        cross_values: list[Tensor],
        return_attention: bool = False,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]] | tuple[Tensor, list[Tensor], list[Tensor], Tensor]:
        """One target position for every row.

        tokens (B,) the current token; positions (B,) its position (= number of cached steps);
        src_lengths (B,); past_keys/past_values per layer (B, H, C, Dh) with slots < position
        filled (C >= 1; other slots are ignored); cross_keys/values per layer (B, H, S, Dh).
        Returns log_probs (B, V) fp32 and per layer this step's key and value (B, H, 1, Dh),
        which the caller writes into slot `position` of its cache. With return_attention also every decoder
        layer's cross-attention weights averaged over the heads, (B, layers, S) fp32 (zero past src_lengths).
        """
        x = self._embed(self.embed, tokens[:, None], positions[:, None], "decoder")  # (B, 1, D)
        cap = past_keys[0].shape[2]
        cache_mask = length_mask(positions, cap)[:, None, None, :]  # (B, 1, 1, C)
        src_mask = length_mask(src_lengths, cross_keys[0].shape[2])[:, None, None, :]  # (B, 1, 1, S)
        new_keys, new_values = [], []
        weights: list[Tensor] | None = [] if return_attention else None
        for i, layer in enumerate(self.decoder_layers):
            x, k, v = layer.step(
                x, past_keys[i], past_values[i], cache_mask, cross_keys[i], cross_values[i], src_mask, weights
            )
            new_keys.append(k)
            new_values.append(v)
        if self.cfg.norm_first:
            x = self.decoder_norm(x)
        log_probs = torch.log_softmax(self._logits(x[:, 0]).float(), dim=-1)  # (B, V) fp32
        if weights is not None:
            return log_probs, new_keys, new_values, torch.stack(weights, dim=1)
        return log_probs, new_keys, new_values
