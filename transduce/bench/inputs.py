"""The benchmark's inputs: random source ids, and a batch of sources as our encoder takes it (numpy only: the
worker processes use it too)."""

from __future__ import annotations

import numpy as np


def id_limit(config: dict) -> int:
    """One past the largest id the bench draws at random: a trailing pad row (Marian's) is left out, as
    CTranslate2's own converter drops it from the vocabulary."""
    vocab = config["vocab_size"]
    return vocab - 1 if config.get("pad_id") == vocab - 1 else vocab


def random_sources(rng: np.random.Generator, batch: int, src_len: int, vocab_size: int) -> list[list[int]]:
    """batch sources of src_len - 1 non-special ids below vocab_size (id_limit; the EOS is appended by each
    system)."""
    return rng.integers(4, vocab_size, size=(batch, src_len - 1)).tolist()


def padded_sources(sources: list[list[int]], pad_id: int, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Sources without EOS -> our encoder's input: each with its EOS appended, padded to the longest -> (ids,
    lengths)."""
    s = max(len(x) for x in sources) + 1
    ids = np.full((len(sources), s), pad_id, dtype=np.int64)
    for r, x in enumerate(sources):
        ids[r, : len(x)] = x
        ids[r, len(x)] = eos_id
    return ids, np.array([len(x) + 1 for x in sources], dtype=np.int64)
