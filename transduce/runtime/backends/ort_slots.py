"""The ONNX Runtime backend's cross K/V of a running batch: a slot pool of its sources (bookkeeping in
slots.SlotTable) and the per-row buffers its step graphs are bound to.

The step graphs take cross_* per row (or, on the fused graph, per source for rows in equal blocks:
ort_run.cross_rows), bound by pointer; so the bound buffers keep a per-entry layout, allocated once with room
for the state's rows at the pool's width, and only the entries whose slot changed are rewritten in place (an
admitted row, a row that took another's place when rows finished). Their addresses stay, so the IO bindings
stay valid until the entry count or the buffers change. The pool starts as the encoder's own outputs (nothing
copied); an admission writes its sources into free slots. `copied` counts the bytes written (tests check it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transduce.runtime.backends.base import renumbered_sources
from transduce.runtime.backends.slots import SlotTable

NARROW_STEP = 16  # a narrowed pool's width is a multiple of this


class PooledCross:
    def __init__(self, mem, enc: dict[str, Any], cross_names: list[str]):
        """The pool over an encoder batch's outputs: cross_* (B, H, S, Dh) and src_lengths (B,)."""
        self.mem = mem
        self.cross_names = list(cross_names)
        self.pool = {name: enc[name] for name in self.cross_names + ["src_lengths"]}
        self.table = SlotTable(np.asarray(mem.to_numpy(enc["src_lengths"])), enc[self.cross_names[0]].shape[2])
        self.rows: dict[str, Any] = {}  # the per-entry buffers, name -> (entry capacity, H, width, Dh) / (capacity,)
        self.entry_slot = np.array([-1])  # the slot each bound entry holds
        self.bound: dict[str, Any] = {}  # name -> the bound views, the first len(entry_slot) entries
        self.copied = 0  # bytes written into the pool and the per-entry buffers
        self.allocations = 0  # times the per-entry buffers were (re)allocated: bindings onto older ones are stale

    def sources(self) -> int:
        """How many sources the protocol's numbering has now."""
        return len(self.table.slot_of)

    def bind(self, entries: np.ndarray, capacity: int, owned: list) -> bool:
        """The bound cross K/V for entries decoding the protocol's sources `entries`, rewriting only the entries
        whose slot changed -> whether the bound views changed (their entry count, or the buffers themselves:
        then `allocations` counts one more)."""
        slot = self.table.row_slots(entries)
        if np.array_equal(slot, self.entry_slot):
            return False
        self._narrow(self.table.live_width(slot), owned)
        n = len(slot)
        grown = self._entries_for(max(n, capacity), owned)
        self.allocations += grown
        changed = grown or n != len(self.entry_slot) or not self.bound
        stale = self.table.stale_rows(slot)
        if stale.size:
            self._write(stale, slot[stale])
        self.entry_slot = slot
        if changed:
            self.bound = {name: buf[:n] for name, buf in self.rows.items()}
        return changed

    def of_rows(self, row_src: np.ndarray) -> dict[str, np.ndarray]:
        """Host copies of the cross K/V and source lengths of rows decoding sources row_src (a step on numpy
        feeds: the attention step graph)."""
        slots = self.table.row_slots(row_src)
        return {name: np.ascontiguousarray(np.asarray(self.mem.to_numpy(t))[slots]) for name, t in self.pool.items()}

    def admit(self, row_src: np.ndarray, enc: dict[str, Any], most_width: int, owned: list) -> np.ndarray:
        """New sources into free slots beside those rows decode (row_src, the protocol's numbering) -> each row's
        source in the new numbering (theirs ascending, then the new ones), the new rows after, one per source."""
        mem = self.mem
        kept, inverse = renumbered_sources(row_src)
        lengths = np.asarray(mem.to_numpy(enc["src_lengths"]))
        width = int(lengths.max())
        slots, n_slots, n_width = self.table.admit(row_src, lengths, width, max(most_width, width))
        self._grow_pool(n_slots, n_width, owned)
        for name in self.cross_names:
            mem.put_rows(self.pool[name], slots, enc[name][:, :, :width])
            self.copied += self.pool[name][0].nbytes * len(slots)
        mem.put_rows(self.pool["src_lengths"], slots, enc["src_lengths"])
        self.entry_slot = np.array([-1])  # bound again
        return np.concatenate([inverse, len(kept) + np.arange(len(slots))])

    def _new_like(self, name: str, rows: int, width: int, owned: list):
        mem = self.mem
        if name == "src_lengths":
            return mem.from_numpy(np.zeros(rows, np.int64))
        t = self.pool[name]
        return mem.zeros((rows, t.shape[1], width, t.shape[3]), owned)

    def _entries_for(self, capacity: int, owned: list) -> bool:
        """Per-entry buffers of `capacity` entries at the pool's width (doubled when more are needed), what
        they hold kept -> whether they were (re)allocated."""
        width = self.table.width
        have = self.rows.get(self.cross_names[0])
        if have is not None and have.shape[0] >= capacity and have.shape[2] == width:
            return False
        if have is None or have.shape[0] >= capacity:
            cap = capacity if have is None else have.shape[0]
        else:
            cap = max(capacity, 2 * have.shape[0])
        old, self.rows = self.rows, {name: self._new_like(name, cap, width, owned) for name in self.pool}
        for name, o in old.items():
            self.mem.put_rows(self.rows[name], np.arange(o.shape[0]), o if o.ndim == 1 else o[:, :, :width])
            self.mem.free(o, owned)
            self.copied += o.nbytes
        self.table.hold_rows(cap)
        return True

    def _grow_pool(self, slots: int, width: int, owned: list) -> None:
        """The pool reallocated for more slots or a wider source, contents kept (SlotTable.admit grows it
        geometrically)."""
        have = self.pool[self.cross_names[0]].shape
        if have[0] >= slots and have[2] >= width:
            return
        self._repool(list(self.pool), max(slots, have[0]), max(width, have[2]), owned)

    def _repool(self, names: list[str], slots: int, width: int, owned: list) -> None:
        """The pool's `names` reallocated at `slots` slots of `width` positions, contents kept (cut where
        narrower)."""
        for name in names:
            o = self.pool[name]
            self.pool[name] = self._new_like(name, slots, width, owned)
            self.mem.put_rows(self.pool[name], np.arange(o.shape[0]), o if o.ndim == 1 else o[:, :, :width])
            self.mem.free(o, owned)
            self.copied += o.nbytes

    def _narrow(self, live: int, owned: list) -> None:
        """The pool cut to the width of the sources rows decode now (`live`, rounded up to NARROW_STEP) where it is
        at least twice that: a long source that has left would otherwise have every later step read its width
        for every row until the batch empties. The per-entry buffers follow (_entries_for: new buffers, so the
        bindings are made again); the free slots' K/V past the width are dropped (a slot is written whole when
        it is taken)."""
        width = -(-max(live, 1) // NARROW_STEP) * NARROW_STEP
        if self.table.width < 2 * width:
            return
        self._repool(self.cross_names, self.pool[self.cross_names[0]].shape[0], width, owned)
        self.table.width = width

    def _write(self, entries: np.ndarray, slots: np.ndarray) -> None:
        """Entries `entries` of the per-entry buffers take the K/V of pool slots `slots`."""
        mem = self.mem
        for name, buf in self.rows.items():
            mem.put_rows(buf, entries, mem.take(self.pool[name], slots))
            self.copied += buf[0].nbytes * len(entries) if name != "src_lengths" else 0
        self.table.held[entries] = slots
