"""The TensorRT backend's rows in a running batch: sources admitted into a slot pool of the run's encoder
results (slots.SlotTable) as far as the step engine's optimization profiles allow, and rows at their own
positions.

The step engine takes one source length for all rows of a run, within its profiles' ranges: the pool's width is
that length, grown (doubled, within the widest source a profile takes beside the run's cache) when a wider source
is admitted. `admits` says whether a source length fits beside a run's cache; where not, the running batch keeps
those sentences until it is empty (the protocol's default). Rows chunk as a batch does, so any row count fits.
Imports no framework (the backend module is imported where TensorRT and torch are missing).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from transduce.errors import EngineError
from transduce.formats.profiles import choose_chunks
from transduce.runtime.backends.base import renumbered_sources


def _takes(backend, width: int, capacity: int) -> bool:
    """Whether a step profile takes sources `width` wide beside a cache of `capacity` slots."""
    try:
        choose_chunks(1, backend.plan.decoder_step, width, capacity)
    except EngineError:
        return False
    return True


def admits(backend, state, src_len: int) -> bool:
    return _takes(backend, max(state.enc.src_len, int(src_len)), state.capacity)


def admit(backend, state, enc) -> None:
    """`enc`'s sources into free slots of the state's pool (grown where too few or too narrow), one new row each
    at position 0; the cache grows (doubled) only past its row capacity."""
    if not admits(backend, state, enc.src_len):
        raise EngineError(f"sources of {enc.src_len} tokens do not fit the running batch's step profiles beside "
                          f"its cache of {state.capacity} slots", hint="admit them once the running batch is empty")
    torch, pool = backend.torch, state.enc
    width = enc.src_len
    need = max(pool.src_len, width)
    most = max(p.src_len.max for p in backend.plan.decoder_step)
    if width > pool.src_len and not _takes(backend, max(need, min(2 * pool.src_len, most)), state.capacity):
        most = need  # doubled, the width would leave every profile: just as wide as needed
    kept, inverse = renumbered_sources(state.given)
    slots, n_slots, n_width = state.slots.admit(state.given, np.full(enc.batch, width), width, most)
    n_new = enc.batch
    with backend._on_stream():
        if n_slots > pool.batch or n_width > pool.src_len:
            pool = state.enc = _grown(backend, pool, n_slots, n_width)
        idx = backend._to_device(slots, torch.long)
        for name in backend.cross_names:
            t = pool.cross[name]
            t[:, :, :width].index_copy_(0, idx, enc.cross[name])
            if width < t.shape[2]:
                t[:, :, width:].index_fill_(0, idx, 0)  # the padding past the new sources: zeros, as encode's
        pool.src_lengths.index_copy_(0, idx, enc.src_lengths)
        total = state.rows + n_new
        if total > state.row_cap:
            old, rows = state.cache, state.rows
            backend._allocate(state, max(total, 2 * state.row_cap))
            state.cache[:, :rows].copy_(old[:, :rows])
    before = state.row_pos if state.row_pos is not None else np.full(state.rows, state.position, np.int64)
    state.row_pos = np.concatenate([before, np.zeros(n_new, np.int64)])
    if not state.row_pos.any():
        state.position, state.row_pos = 0, None
    state.rows = total
    state.row_src = np.array([-1])  # bound again
    backend._gather_cross(state, np.concatenate([inverse, len(kept) + np.arange(n_new)]))


def _grown(backend, pool, slots: int, width: int) -> Any:
    """The pool reallocated with `slots` slots `width` wide (aligned, zeroed), its sources kept."""
    cross = {}
    for name in backend.cross_names:
        t = pool.cross[name]
        cross[name] = backend._zeros((slots, t.shape[1], width, t.shape[3]), t.dtype)
        cross[name][: pool.batch, :, : pool.src_len].copy_(t)
    lengths = backend._zeros((slots,), pool.src_lengths.dtype)
    lengths[: pool.batch].copy_(pool.src_lengths)
    return dataclasses.replace(pool, memory=None, cross=cross, src_lengths=lengths, batch=slots, src_len=width)


def rows_moved(state, rows: np.ndarray) -> None:
    """Per-row positions follow a reorder; back to one position once every row is at the same one."""
    if state.row_pos is not None:
        state.row_pos = state.row_pos[rows]
        if state.row_pos.size and (state.row_pos == state.row_pos[0]).all():
            state.position, state.row_pos = int(state.row_pos[0]), None


def write_slots(torch, state, new_names: list[str], rows: int, p: int, each: np.ndarray | None) -> None:
    """The step's new K/V into the cache in place: slot p of every row, or each row's own slot each[r]."""
    if each is None:
        for cache, name in zip(state.caches, new_names, strict=True):
            cache[:rows, :, p : p + 1].copy_(state.outputs[name][:rows])
        return
    every = torch.arange(rows, device=state.cache.device)
    positions = torch.from_numpy(np.ascontiguousarray(each, np.int64)).to(state.cache.device)
    for cache, name in zip(state.caches, new_names, strict=True):
        cache[every, :, positions] = state.outputs[name][:rows, :, 0].to(cache.dtype)
