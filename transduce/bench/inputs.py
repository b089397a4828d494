"""The benchmark's inputs: random source ids (numpy only: the worker processes use it too)."""

from __future__ import annotations

import numpy as np


def id_limit(config) -> int:
    """One past the largest id the bench draws at random (config: a ModelConfig): a trailing pad row (Marian's) is
    left out, as CTranslate2's own converter drops it from the vocabulary."""
    vocab = config.vocab_size
    return vocab - 1 if config.pad_id == vocab - 1 else vocab


def random_sources(rng: np.random.Generator, batch: int, src_len: int, vocab_size: int) -> list[list[int]]:
    """batch sources of src_len - 1 non-special ids below vocab_size (id_limit; the EOS is appended by each
    system)."""
    return rng.integers(4, vocab_size, size=(batch, src_len - 1)).tolist()
