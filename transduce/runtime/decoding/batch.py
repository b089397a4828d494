"""Id lists as one padded batch: the encoder's sources, teacher-forced targets (one helper for every caller)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pad_ids(rows: Sequence[Sequence[int]], pad: int, *, lead: int | None = None,
            end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each id list with `lead` before it (a target's BOS) and `end` after it (a source's EOS) where given, padded
    with `pad` to the longest (at least one column) -> (B, T) int64 ids and (B,) int64 lengths, lead and end
    included."""
    extra = (lead is not None) + (end is not None)
    lengths = np.array([len(r) + extra for r in rows], dtype=np.int64)
    out = np.full((len(rows), max(int(lengths.max(initial=0)), 1)), pad, dtype=np.int64)
    first = int(lead is not None)
    for i, r in enumerate(rows):
        if lead is not None:
            out[i, 0] = lead
        out[i, first: first + len(r)] = r
        if end is not None:
            out[i, first + len(r)] = end
    return out, lengths
