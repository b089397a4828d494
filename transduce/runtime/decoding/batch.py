"""Id lists as one padded batch: the encoder's sources, teacher-forced targets (one helper for every caller)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pad_ids(rows: Sequence[Sequence[int]], pad: int, *, lead: int | None = None,
            end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each id list with `lead` before it (a target's BOS) and `end` after it (a source's EOS) where given, padded
    with `pad` to the longest (at least one column) -> (B, T) int64 ids and (B,) int64 lengths, lead and end
    included."""
    head, tail = [] if lead is None else [lead], [] if end is None else [end]
    lengths = [len(r) + len(head) + len(tail) for r in rows]
    width = max(max(lengths, default=0), 1)
    flat: list[int] = []  # one list made into an array at once: a server pads every request, most of one row
    for r, n in zip(rows, lengths, strict=True):
        flat += head
        flat += r.tolist() if isinstance(r, np.ndarray) else r
        flat += tail
        flat += [pad] * (width - n)
    return np.array(flat, dtype=np.int64).reshape(len(rows), width), np.array(lengths, dtype=np.int64)
