"""The model's configuration: one frozen dataclass, a field per hyperparameter, stored in config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from transduce.errors import ConfigError

# Bumped when the meaning of a field changes; config.json records it and loading checks it.
CONFIG_FORMAT_VERSION = 1


# The longest sequence a model may be configured for: its attention is quadratic in length (one
# 65,536-token self-attention is a 16 GB score matrix per head in fp32), so a larger value is a typo.
MAX_POSITIONS = 65_536

# The fields of imported models' deviations, each defaulting to the paper's: a config written before one of them
# existed describes the paper's model there, so its absence reads as the default (never so for the other fields).
DEVIATION_FIELDS = ("activation", "position_layout", "position_frequencies", "position_offset", "scale_embedding",
                    "final_logits_bias", "src_vocab_size", "tie_output", "untied_output", "positions",
                    "layernorm_embedding")

# Values of the string fields; anything else is refused naming the field (an imported checkpoint with another
# value is not this model, and is never imported half-right).
CHOICES = {
    "activation": ("relu", "gelu", "swish"),
    "position_layout": ("interleaved", "halves"),
    "position_frequencies": ("paper", "fairseq"),
    "positions": ("sinusoidal", "learned"),
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int  # tokenizer vocabulary (shared by source and target)
    encoder_layers: int = 6  # N in the paper, encoder stack
    decoder_layers: int = 6  # N in the paper, decoder stack
    d_model: int = 512  # model width; embeddings, residual stream, attention output
    n_heads: int = 8  # h; d_k = d_v = d_model / h
    d_ff: int = 2048  # inner width of the position-wise FFN
    dropout: float = 0.1  # P_drop on each sublayer's output and on embeddings + PE (the paper's two places)
    max_positions: int = 256  # rows of the positional table(s): longest source or target, in tokens
    norm_first: bool = False  # False: post-norm LayerNorm(x + Sublayer(x)) as in the paper; True: pre-norm
    layer_norm_eps: float = 1e-5  # LayerNorm epsilon (not given in the paper; PyTorch's default)
    share_embeddings: bool = True  # one matrix for source and target embeddings and the pre-softmax projection
    pad_id: int = 0  # padding token id
    bos_id: int = 1  # begin-of-sentence, fed to the decoder at step 0
    eos_id: int = 2  # end-of-sentence, appended to sources and generated last
    unk_id: int = 3  # unknown token
    # Deviations of imported models (Marian/OPUS-MT, FSMT, fairseq, M2M100/NLLB, mBART); each default is the paper's.
    activation: str = "relu"  # FFN nonlinearity: relu (paper, fairseq, FSMT), gelu (erf), swish (x*sigmoid(x), OPUS-MT)
    position_layout: str = "interleaved"  # sinusoid columns: interleaved sin/cos (paper) or [sin | cos] halves
    position_frequencies: str = "paper"  # 10000^(-2i/d_model) (paper, Marian) or exp(-i*ln(10000)/(d/2-1)) (fairseq)
    position_offset: int = 0  # position of a sequence's first token in the table (fairseq: padding_idx + 1)
    scale_embedding: bool = True  # multiply embeddings by sqrt(d_model) (the paper; Marian's config may turn it off)
    final_logits_bias: bool = False  # a bias on the pre-softmax projection (Marian's final_logits_bias)
    src_vocab_size: int = 0  # source vocabulary when it is not the target's (FSMT, fairseq); 0: vocab_size
    tie_output: bool = False  # without share_embeddings: the projection is the target embedding (else its own)
    positions: str = "sinusoidal"  # the fixed table (paper) or a learned table per stack, row p = position p (mBART)
    layernorm_embedding: bool = False  # a LayerNorm on embeddings + positions, before dropout, in both stacks (mBART)
    untied_output: bool = False  # with share_embeddings: the projection is a matrix of its own (Marian, untied)

    def __post_init__(self) -> None:
        problems = []
        for f in dataclasses.fields(self):  # a hand-edited config.json or a --set value of the wrong type
            v = getattr(self, f.name)
            if f.type == "bool":
                ok, what, example = isinstance(v, bool), "true or false", str(f.default).lower()
            elif f.type == "str":
                ok, what, example = v in CHOICES[f.name], "one of " + ", ".join(CHOICES[f.name]), f.default
            else:  # int, float (an int is a float here); a bool is neither
                ok = isinstance(v, (int, float) if f.type == "float" else int) and not isinstance(v, bool)
                what, example = ("a number" if f.type == "float" else "an integer"), f.default
            if not ok:
                raise ConfigError(f"invalid model config: {f.name} must be {what}, got {v!r}",
                                  hint=f"for example --set {f.name}={example}"
                                  if f.default is not dataclasses.MISSING else None)
        if self.vocab_size < 4:
            problems.append(f"vocab_size must be >= 4 (the specials), got {self.vocab_size}")
        if self.n_heads >= 1 and self.d_model % self.n_heads:  # n_heads < 1 is reported below
            problems.append(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.d_model % 2:
            problems.append(f"d_model ({self.d_model}) must be even for the sinusoidal encoding")
        for name in ("encoder_layers", "decoder_layers", "d_model", "n_heads", "d_ff", "max_positions"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        # upper bounds where a typo would otherwise fail late, in an allocation or a library's int32
        if self.max_positions > MAX_POSITIONS:
            problems.append(f"max_positions must be <= {MAX_POSITIONS:,} (the sinusoidal table and the attention "
                            f"over that many tokens), got {self.max_positions:,}")
        if self.vocab_size >= 2**31:
            problems.append(f"vocab_size must be < 2**31, got {self.vocab_size:,}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 < self.layer_norm_eps < 1.0:  # NaN fails this too
            problems.append(f"layer_norm_eps must be in (0, 1), got {self.layer_norm_eps}")
        specials = (self.pad_id, self.bos_id, self.eos_id, self.unk_id)
        # bos_id is the decoder's start token: an imported model may start from EOS (fairseq, FSMT) or pad (Marian)
        if (len({self.pad_id, self.eos_id, self.unk_id}) != 3 or self.bos_id == self.unk_id
                or not all(0 <= s < min(self.vocab_size, self.source_vocab_size) for s in specials)):
            problems.append(f"special ids {specials} must be distinct and < vocab_size (bos_id, the decoder's "
                            "start token, may be eos_id or pad_id)")
        if self.src_vocab_size and self.share_embeddings and self.src_vocab_size != self.vocab_size:
            problems.append(f"src_vocab_size ({self.src_vocab_size}) differs from vocab_size ({self.vocab_size}): "
                            "the embeddings cannot be shared (share_embeddings must be false)")
        if self.src_vocab_size < 0 or self.src_vocab_size >= 2**31:
            problems.append(f"src_vocab_size must be 0 (vocab_size) or a vocabulary size, got {self.src_vocab_size}")
        if self.tie_output and self.share_embeddings:
            problems.append("tie_output applies only without share_embeddings (shared embeddings tie the projection)")
        if self.untied_output and not self.share_embeddings:
            problems.append("untied_output applies only with share_embeddings (without them tie_output false unties "
                            "the projection)")
        if self.position_offset < 0 or self.position_offset > MAX_POSITIONS:
            problems.append(f"position_offset must be in [0, {MAX_POSITIONS:,}], got {self.position_offset}")
        if self.positions == "learned" and (self.position_offset, self.position_layout, self.position_frequencies) != (
                0, "interleaved", "paper"):
            problems.append("position_offset, position_layout and position_frequencies describe the sinusoidal "
                            "table: with learned positions they keep their defaults (row p is position p)")
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def source_vocab_size(self) -> int:
        """The source side's vocabulary (the target's, vocab_size, unless src_vocab_size says otherwise)."""
        return self.src_vocab_size or self.vocab_size

    @property
    def output_tied(self) -> bool:
        """Whether the pre-softmax projection is the (target) embedding matrix; else it is out_proj.weight."""
        return self.tie_output if not self.share_embeddings else not self.untied_output

    def deviations(self) -> dict[str, Any]:
        """The fields of the imported models' deviations that differ from the paper's default, {name: value}."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name in DEVIATION_FIELDS and getattr(self, f.name) != f.default}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"the model config must be a JSON object of fields, got {type(d).__name__} {d!r:.60}",
                              hint="the model directory's config.json is damaged: train or copy it again")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown model config fields: {unknown}")
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"incomplete model config: {e}") from None

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)
