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


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int  # tokenizer vocabulary (shared by source and target)
    encoder_layers: int = 6  # N in the paper, encoder stack
    decoder_layers: int = 6  # N in the paper, decoder stack
    d_model: int = 512  # model width; embeddings, residual stream, attention output
    n_heads: int = 8  # h; d_k = d_v = d_model / h
    d_ff: int = 2048  # inner width of the position-wise FFN
    dropout: float = 0.1  # P_drop on each sublayer's output and on embeddings + PE (the paper's two places)
    max_positions: int = 256  # rows of the sinusoidal table: longest source or target, in tokens
    norm_first: bool = False  # False: post-norm LayerNorm(x + Sublayer(x)) as in the paper; True: pre-norm
    layer_norm_eps: float = 1e-5  # LayerNorm epsilon (not given in the paper; PyTorch's default)
    share_embeddings: bool = True  # one matrix for source and target embeddings and the pre-softmax projection
    pad_id: int = 0  # padding token id
    bos_id: int = 1  # begin-of-sentence, fed to the decoder at step 0
    eos_id: int = 2  # end-of-sentence, appended to sources and generated last
    unk_id: int = 3  # unknown token

    def __post_init__(self) -> None:
        problems = []
        for f in dataclasses.fields(self):  # a hand-edited config.json or a --set value of the wrong type
            v = getattr(self, f.name)
            if f.type == "bool":
                ok, what, example = isinstance(v, bool), "true or false", str(f.default).lower()
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
        if len(set(specials)) != 4 or not all(0 <= s < self.vocab_size for s in specials):
            problems.append(f"special ids {specials} must be distinct and < vocab_size")
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

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
