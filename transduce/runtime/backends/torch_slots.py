"""The torch backend's cross K/V of a run: a slot pool of its sources and the per-row view the step reads
(bookkeeping in slots.SlotTable).

A run starts on the encoder's own outputs as its pool (nothing copied); while row r decodes slot r for every
row the step reads the pool itself. Once rows and slots part (beams, finished rows compacted, admissions), the
step reads a per-row buffer, allocated once with room for the state's rows, in which only the rows whose slot
changed are rewritten. `copied` counts the bytes every write and growth has copied (what tests check).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transduce.runtime.backends.base import renumbered_sources
from transduce.runtime.backends.slots import SlotTable, is_prefix_identity


class CrossSlots:
    def __init__(self, torch, cross_k: list, cross_v: list, src_lengths, most_width: int):
        """The pool over an encoder batch's outputs, per layer (B, H, S, Dh), and its (B,) source lengths."""
        self.torch = torch
        self.pool = [t for pair in zip(cross_k, cross_v, strict=True) for t in pair]  # key_0, value_0, key_1, ...
        self.pool_len = src_lengths
        self.table = SlotTable(src_lengths.cpu().numpy(), cross_k[0].shape[2])
        self.most_width = max(int(most_width), self.table.width)
        self.rows: list[Any] = []  # the per-row buffers (row capacity, H, width, Dh), allocated when first needed
        self.rows_len = None  # (row capacity,)
        self.row_src = np.array([-1])  # each row's source (the protocol's numbering), as last bound
        self.row_slot = np.array([-1])  # and its slot
        self.copied = 0  # bytes copied into the pool and the per-row buffers (tests count them)
        # what the step reads: per layer (R, H, w, Dh) views, and (R,) source lengths
        self.cross_k: list[Any] = []
        self.cross_v: list[Any] = []
        self.src_lengths = None

    def bind(self, row_src: np.ndarray, row_capacity: int) -> None:
        """The step's cross K/V for rows decoding the protocol's sources row_src: views of the pool where row r
        decodes slot r, else of the per-row buffer with the rows whose slot changed rewritten."""
        row_slot = self.table.row_slots(row_src)
        self.row_src = row_src.copy()
        if np.array_equal(row_slot, self.row_slot):
            return
        self.row_slot = row_slot
        n, w = len(row_slot), self.table.live_width(row_slot)
        if is_prefix_identity(row_slot):
            tensors, lengths = self.pool, self.pool_len
        else:
            self._rows_for(max(n, row_capacity))
            stale = self.table.stale_rows(row_slot)
            if stale.size:
                self._write_rows(stale, row_slot[stale])
            tensors, lengths = self.rows, self.rows_len
        views = [t[:n, :, :w] for t in tensors]
        self.cross_k, self.cross_v = views[0::2], views[1::2]
        self.src_lengths = lengths[:n]

    def _long(self, a: np.ndarray):
        return self.torch.from_numpy(np.ascontiguousarray(a, np.int64)).to(self.pool_len.device)

    def _rows_for(self, capacity: int) -> None:
        """A per-row buffer of `capacity` rows at the pool's width at least (grown geometrically; its rows
        keep what they hold)."""
        have = self.rows[0].shape if self.rows else (0, 0, 0, 0)
        width = self.table.width
        if have[0] >= capacity and have[2] == width:
            return
        cap = max(capacity, 2 * have[0]) if have[0] < capacity else have[0]
        torch, old, old_len = self.torch, self.rows, self.rows_len
        self.rows = [t.new_zeros((cap, t.shape[1], width, t.shape[3])) for t in self.pool]
        self.rows_len = self.pool_len.new_zeros((cap,))
        if old:
            with torch.inference_mode():
                for new, o in zip(self.rows, old, strict=True):
                    new[: o.shape[0], :, : o.shape[2]].copy_(o)
                    self.copied += o.nbytes
                self.rows_len[: old_len.shape[0]].copy_(old_len)
        self.table.hold_rows(cap)

    def _write_rows(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Rows `rows` of the per-row buffer take the K/V of pool slots `slots`."""
        dst, src = self._long(rows), self._long(slots)
        with self.torch.inference_mode():
            for buf, pool in zip(self.rows, self.pool, strict=True):
                buf.index_copy_(0, dst, pool.index_select(0, src))
                self.copied += pool[0].nbytes * len(rows)
            self.rows_len.index_copy_(0, dst, self.pool_len.index_select(0, src))
        self.table.held[rows] = slots

    def admit(self, cross_k: list, cross_v: list, src_lengths) -> np.ndarray:
        """New sources (an encoder batch's outputs) into free slots, beside those the rows decode (renumbered
        as the protocol says: theirs ascending, then the new ones) -> the rows' sources in the new numbering,
        the rows that exist then one per new source (for bind)."""
        row_src = self.row_src
        kept, inverse = renumbered_sources(row_src)
        lengths = src_lengths.cpu().numpy()
        width = int(lengths.max()) if len(lengths) else 1
        slots, n_slots, n_width = self.table.admit(row_src, lengths, width, max(self.most_width, width))
        self._grow_pool(n_slots, n_width)
        new = [t for pair in zip(cross_k, cross_v, strict=True) for t in pair]
        idx = self._long(slots)
        with self.torch.inference_mode():
            for pool, t in zip(self.pool, new, strict=True):
                part = t[:, :, :width]
                pool[:, :, :width].index_copy_(0, idx, part)
                pool[:, :, width:].index_fill_(0, idx, 0)  # the padding past the new source: zeros, as encode's
                self.copied += pool[0].nbytes * len(slots)
            self.pool_len.index_copy_(0, idx, src_lengths)
        self.row_slot = np.array([-1])  # bound again
        return np.concatenate([inverse, len(kept) + np.arange(len(slots))])

    def _grow_pool(self, slots: int, width: int) -> None:
        """The pool reallocated for more slots or a wider source (geometrically: SlotTable.admit), contents kept."""
        have = self.pool[0].shape
        if have[0] >= slots and have[2] >= width:
            return
        torch = self.torch
        old, old_len = self.pool, self.pool_len
        self.pool = [t.new_zeros((max(slots, have[0]), t.shape[1], max(width, have[2]), t.shape[3])) for t in old]
        self.pool_len = old_len.new_zeros((max(slots, have[0]),))
        with torch.inference_mode():
            for new, o in zip(self.pool, old, strict=True):
                new[: o.shape[0], :, : o.shape[2]].copy_(o)
                self.copied += o.nbytes
            self.pool_len[: old_len.shape[0]].copy_(old_len)
