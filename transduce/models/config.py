"""The paper's presets of the reference model's configuration (ModelConfig: transduce.formats.model_config)."""

from __future__ import annotations

import dataclasses
from typing import Any

from transduce.errors import ConfigError
from transduce.formats.model_config import ModelConfig

__all__ = ["ModelConfig", "PRESETS", "preset"]


# The paper's Table 3 rows, and a tiny one for tests and the demo. vocab_size is filled in
# from the tokenizer; 37000 is the paper's shared En-De BPE vocabulary.
PRESETS: dict[str, dict[str, Any]] = {
    "base": dict(encoder_layers=6, decoder_layers=6, d_model=512, n_heads=8, d_ff=2048, dropout=0.1),
    "big": dict(encoder_layers=6, decoder_layers=6, d_model=1024, n_heads=16, d_ff=4096, dropout=0.3),
    "tiny": dict(encoder_layers=2, decoder_layers=2, d_model=128, n_heads=4, d_ff=512, dropout=0.1),
}


def preset(name: str, vocab_size: int, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """A preset with `overrides` (--set) applied; vocab_size comes from the tokenizer."""
    overrides = overrides or {}
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}", hint=f"choose one of {sorted(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(f"unknown model config field(s) {unknown}", hint=f"--set takes one of {sorted(fields)}")
    if "vocab_size" in overrides:
        raise ConfigError("vocab_size comes from the tokenizer", hint="use --vocab-size instead of --set vocab_size")
    return ModelConfig(vocab_size=vocab_size, **{**PRESETS[name], **overrides})
