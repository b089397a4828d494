"""The bookkeeping of a running batch's cross K/V slot pool, shared by the backends that admit rows.

A state keeps every live source's cross K/V in a pool of `slots` source slots, each `width` positions wide
(zero-padded past the source's length, masked by it). A source keeps its slot from its admission until no row
decodes it; a later admission writes its sources into free slots, so an admission copies only the new sources'
K/V. The pool grows geometrically (more slots, a wider source), never by one admission's worth.

The step graphs read cross K/V per row, so each row's K/V are also held in a per-row buffer; `held` says which
slot each buffer row holds, and a reorder or an admission rewrites only the rows whose slot changed (beams of
one source permuted among themselves move nothing). The protocol's source numbering (base.renumbered_sources:
after an admission the sources its rows decode, ascending, then the new ones) maps to slots through `slot_of`.
Framework-free: the backends do the copies this table asks for.
"""

from __future__ import annotations

import numpy as np

from transduce.errors import InputError
from transduce.runtime.backends.base import renumbered_sources


class SlotTable:
    def __init__(self, lengths: np.ndarray, width: int):
        """A pool holding the sources of one encoder batch in slots 0..n-1 (lengths: each one's length)."""
        lengths = np.asarray(lengths, np.int64)
        self.slots = len(lengths)  # source slots the pool holds
        self.width = int(width)  # positions per slot
        self.slot_of = np.arange(len(lengths), dtype=np.int64)  # the protocol's source index -> its slot
        self.slot_len = lengths.copy()  # (slots,) the length of the source in each slot (0: free)
        self.held = np.full(0, -1, np.int64)  # (row buffer rows,) the slot each per-row buffer row holds (-1: none)

    def row_slots(self, row_src: np.ndarray) -> np.ndarray:
        """Each row's slot, for rows decoding the protocol's sources row_src (InputError for an unknown one)."""
        row_src = np.asarray(row_src, np.int64)
        n = len(self.slot_of)
        if row_src.size and (row_src.min() < 0 or row_src.max() >= n):
            raise InputError(f"row_src names sentences {row_src.min()}..{row_src.max()}; the batch has {n} "
                             f"(0..{n - 1})")
        return self.slot_of[row_src]

    def admit(self, row_src: np.ndarray, lengths: np.ndarray, width: int, most_width: int
              ) -> tuple[np.ndarray, int, int]:
        """New sources of these lengths (padded to `width`) join beside the ones rows decode (row_src, the
        protocol's numbering) -> (their slots, the pool's slot count and width from now on). The slots no row
        decodes are free and taken first, lowest first; only when they are too few does the pool grow, to
        twice its slots at least; a wider source grows the width to twice (within most_width) at least."""
        kept, _ = renumbered_sources(row_src)
        live = self.slot_of[kept]
        n_new = len(lengths)
        used = np.zeros(self.slots, bool)
        used[live] = True
        free = np.flatnonzero(~used)
        slots = self.slots
        if len(free) < n_new:
            slots = max(len(live) + n_new, 2 * self.slots)
            free = np.concatenate([free, np.arange(self.slots, slots)])
        new = free[:n_new].astype(np.int64)
        if slots > self.slots:
            self.slot_len = np.concatenate([self.slot_len, np.zeros(slots - self.slots, np.int64)])
        self.slot_len[free] = 0
        self.slot_len[new] = np.asarray(lengths, np.int64)
        # a freed slot's old K/V are not what it holds from now on (held names slots below the old count only)
        self.held[(self.held >= 0) & ~used[self.held]] = -1
        self.slot_of = np.concatenate([live, new])
        grown = self.width if width <= self.width else max(int(width), min(2 * self.width, int(most_width)))
        self.slots, self.width = slots, grown
        return new, slots, grown

    def live_width(self, row_slot: np.ndarray) -> int:
        """The widest source these rows decode: how much of the pool's width a step reads."""
        return int(self.slot_len[row_slot].max()) if len(row_slot) else 1

    def stale_rows(self, row_slot: np.ndarray) -> np.ndarray:
        """The per-row buffer's rows (of the first len(row_slot)) that do not hold their row's slot yet."""
        return np.flatnonzero(self.held[: len(row_slot)] != row_slot)

    def hold_rows(self, rows: int) -> None:
        """The per-row buffer now has `rows` rows (grown: the new rows hold nothing)."""
        if rows > len(self.held):
            self.held = np.concatenate([self.held, np.full(rows - len(self.held), -1, np.int64)])


def is_prefix_identity(row_slot: np.ndarray) -> bool:
    """Whether row r reads slot r for every row: the rows can read the pool itself, no per-row copy."""
    return bool((row_slot == np.arange(len(row_slot))).all())
