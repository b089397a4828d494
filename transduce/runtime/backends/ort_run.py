"""One decoding run of the ONNX Runtime backend: its buffers and the IO bindings of the step sessions onto them.

Every tensor the step graph reads or writes lives in a buffer allocated once per run: the self-attention
cache (every layer's K and V in one buffer), the cross-attention K/V gathered for the current rows, the
tokens and positions, and the outputs (log_probs, new K/V, and the fused graph's top-k). Inputs and
outputs are bound by pointer, once per row count and session, so a step allocates nothing of cache size.
Big buffers come from the backend's memory pool and go back to it when the run ends (release).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transduce.errors import InputError
from transduce.formats.model_config import ModelConfig
from transduce.runtime.backends.base import FIRST_CACHE_SLOTS
from transduce.runtime.backends.ort_slots import PooledCross

LAST_STEP = "last step"  # the key of RunState.bindings' entry for the last step's (key, session, binding, fused)
MAX_BINDINGS = 16  # a run's bindings of other row counts kept (rows that finish leave one behind each)
# A running batch's cache rows are trimmed to twice the rows in use once a quarter or fewer of them are (a burst
# has passed), never below this many; its slots likewise, never below FIRST_CACHE_SLOTS (RunState.trim).
TRIM_MIN_ROWS = 64


@dataclass(frozen=True)
class StepLayout:
    """The step graph's tensor names for one model, in the contract's order (key_0, value_0, key_1, ...), and
    the sizes of its per-row tensors."""

    cache_names: list[str]  # past_*: the cache, read
    new_names: list[str]  # new_*: this step's K/V (standard graph)
    present_names: list[str]  # present_*: the cache, written in place (fused graph)
    cross_names: list[str]
    heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: ModelConfig) -> StepLayout:
        n = config.decoder_layers
        return cls(layer_names("past", n), layer_names("new", n), layer_names("present", n), layer_names("cross", n),
                   config.n_heads, config.head_dim, config.vocab_size)


def layer_names(kind: str, layers: int) -> list[str]:
    """The per-layer tensor names of a step graph in the contract's order: kind_key_0, kind_value_0, kind_key_1..."""
    return [f"{kind}_{kv}_{i}" for i in range(layers) for kv in ("key", "value")]


def bind_step(binding, mem, fused: bool, *, tokens, positions, cross: dict[str, Any], cache: Sequence[Any],
              log_probs, new: Sequence[Any] = (), topk: tuple | None = None) -> None:
    """Bind every input and output of one run of a step graph by pointer (mem.bind): the standard graph's
    (decoder_step.onnx: past_* read, this step's K/V written to `new`) or the fused one's (decoder_step.ort.onnx:
    its attention writes slot `positions` of the cache itself, so present_* are bound onto the past_* buffers,
    and it picks the top-k: topk = (k, ban bias, values, ids)). cache, new: one buffer per layer's K and V, in
    the contract's order; cross: cross_* and src_lengths. The one place either graph is bound: the backend's
    runs and the export's validation of the fused graph (verify.graph_runners) go through it."""
    layers = len(cache) // 2
    mem.bind(binding, "tokens", tokens, True)
    mem.bind(binding, "positions", positions, True)
    for name, arr in cross.items():
        mem.bind(binding, name, arr, True)
    for name, arr in zip(layer_names("past", layers), cache, strict=True):
        mem.bind(binding, name, arr, True)
    mem.bind(binding, "log_probs", log_probs, False)
    if fused:
        k, bias, values, ids = topk
        for name, arr in zip(layer_names("present", layers), cache, strict=True):
            mem.bind(binding, name, arr, False)
        mem.bind(binding, "topk_k", k, True)
        mem.bind(binding, "topk_bias", bias, True)
        mem.bind(binding, "topk_values", values, False)
        mem.bind(binding, "topk_ids", ids, False)
    else:
        for name, arr in zip(layer_names("new", layers), new, strict=True):
            mem.bind(binding, name, arr, False)


def cross_rows(row_src: np.ndarray, per_source: bool) -> np.ndarray:
    """The encoder rows the step's cross K/V inputs hold: one per decoding row, or, where the fused graph may
    group them (per_source), one per source when the rows come in equal blocks of one source each (beam
    search's beams: the graph attends source r // block for row r)."""
    if not per_source or len(row_src) < 2:
        return row_src
    block = int(np.argmax(row_src != row_src[0])) or len(row_src)
    if block > 1 and len(row_src) % block == 0:
        sources = row_src[::block]
        if (row_src.reshape(-1, block) == sources[:, None]).all():
            return sources
    return row_src


@dataclass
class RunState:
    layout: StepLayout
    mem: Any  # the backend's NumpyMemory or TorchCudaMemory
    enc: dict[str, Any]  # encoder outputs (B rows)
    rows: int  # current number of decoding rows
    capacity: int
    cache: Any  # every layer's self-attention K and V in one buffer: (2L, R_max, H, C, Dh), in the
    # contract's order (key_0, value_0, key_1, ...); cache[i, :rows] is what past_<i> is bound to
    cross_rows: np.ndarray = field(default_factory=lambda: np.array([-1]))  # encoder rows the cross K/V hold
    cross: dict[str, Any] = field(default_factory=dict)  # name -> (R, ...) gathered cross K/V + src_lengths
    outputs: dict[str, Any] = field(default_factory=dict)  # name -> preallocated output buffer (R_max, ...)
    tokens: Any = None  # (R_max,) int64 input buffers, rewritten in place each step
    positions: Any = None
    row_src_given: bytes | None = None  # the row_src last given, as bytes (decoding passes it again while unchanged)
    bindings: dict = field(default_factory=dict)  # (rows, cross entries, session, k, ban_eos) -> IOBinding, bound once;
    # LAST_STEP -> the last step's (key, session, binding, fused graph)
    topk: dict = field(default_factory=dict)  # k -> (values, ids) (R_max, k) buffers of the fused graph's top-k
    owned: list = field(default_factory=list)  # pooled memory of this run, given back by release()
    position: int = 0  # filled slots: every row's while row_pos is None, else the most any row has
    row_pos: np.ndarray | None = None  # (R,) each row's position once rows differ (a running batch's admit)
    # a run of one source kept for the next (SpareRuns): its cross K/V are written in place into buffers of a
    # rounded-up width, so that the next run's bindings still point at them
    recyclable: bool = False
    # the sources' cross K/V in a slot pool and the per-entry buffers bound from it (ort_slots), from the first
    # gather that is not a one-source run's in-place write
    pooled: PooledCross | None = None
    pooled_allocations: int = 0  # the pool's per-entry buffer allocations the bindings were made onto

    @classmethod
    def allocate(cls, layout: StepLayout, mem, enc: dict[str, Any], rows: int, capacity: int,
                 slots: int | None = None) -> RunState:
        """A run's buffers for `rows` rows and `capacity` cache slots (cross K/V not gathered yet), `slots` of
        them allocated now (None: all; reserve() adds more as positions reach them)."""
        owned: list = []
        slots = capacity if slots is None else min(slots, capacity)
        cache = mem.zeros((len(layout.cache_names), rows, layout.heads, slots, layout.head_dim), owned)
        state = cls(layout, mem, enc, rows, capacity, cache, owned=owned)
        state.alloc_step_buffers(rows)
        return state

    def reserve(self, position: int) -> None:
        """Room in the cache for slot `position` (below the capacity): the allocated slots doubled (within the
        capacity), the filled ones kept, the rest zeroed; the bindings made again."""
        old = self.cache
        if position < old.shape[3]:
            return
        slots = min(self.capacity, max(2 * old.shape[3], position + 1))
        self.cache = self.mem.zeros(tuple(old.shape[:3]) + (slots,) + tuple(old.shape[4:]), self.owned)
        self.mem.copy_slots(self.cache, old, self.rows)
        self.mem.free(old, self.owned)
        self.bindings.clear()

    def alloc_step_buffers(self, rows: int) -> None:
        mem, lay = self.mem, self.layout
        self.outputs = {"log_probs": mem.empty((rows, lay.vocab), np.float32, self.owned),
                        # every layer's new K and V in one buffer, like the cache: (2L, R_max, H, 1, Dh)
                        "new": mem.empty((len(lay.new_names), rows, lay.heads, 1, lay.head_dim), None, self.owned)}
        self.tokens = mem.from_numpy(np.zeros(rows, np.int64))
        self.positions = mem.from_numpy(np.zeros(rows, np.int64))
        self.topk.clear()
        self.bindings.clear()

    def gather_cross(self, row_src: np.ndarray, per_source: bool) -> None:
        """The cross K/V of rows decoding sources row_src (see cross_rows), rewritten in place only for the
        entries whose source changed (ort_slots.PooledCross)."""
        given = row_src.tobytes()  # a content check as cheap as an identity one
        if given == self.row_src_given:
            return  # decoding passes the same rows again while they are unchanged
        n = self.pooled.sources() if self.pooled is not None else len(self.enc["src_lengths"])
        if row_src.size and (row_src.min() < 0 or row_src.max() >= n):
            raise InputError(f"row_src names sentences {row_src.min()}..{row_src.max()}; "
                             f"the batch has {n} (0..{n - 1})")
        self.row_src_given = given
        rows = cross_rows(row_src, per_source)
        if self.pooled is None:
            if np.array_equal(rows, self.cross_rows):
                return
            if self.recyclable and len(rows) == 1 and self._cross_in_place(rows):
                return
            self._new_pool()
        if self.pooled.bind(rows, self.cache.shape[1], self.owned):
            self.cross = self.pooled.bound
            if self.pooled.allocations != self.pooled_allocations:  # new buffers: every binding is stale
                self.pooled_allocations = self.pooled.allocations
                self.bindings.clear()
            else:  # another entry count: the bindings of each count stay valid (its key), not the last step's
                self.bindings.pop(LAST_STEP, None)
        self.cross_rows = rows.copy()

    def _new_pool(self) -> None:
        """The sources' cross K/V in a slot pool from now on (its buffers not allocated yet)."""
        self.pooled = PooledCross(self.mem, self.enc, self.layout.cross_names)
        self.pooled_allocations = 0

    def of_rows(self, row_src: np.ndarray) -> dict[str, np.ndarray]:
        """Host copies of the cross K/V and source lengths of rows decoding sources row_src."""
        if self.pooled is not None:
            return self.pooled.of_rows(row_src)
        return {name: np.ascontiguousarray(np.asarray(self.mem.to_numpy(self.enc[name]))[row_src])
                for name in self.layout.cross_names + ["src_lengths"]}

    def _cross_in_place(self, rows: np.ndarray) -> bool:
        """A one-source run's cross K/V written into its buffers of width SpareRuns.width (the padding is
        masked by the source's length, as a running batch's padding is), allocated once: -> False where they
        cannot be (another width), after which they are gathered as for any run."""
        first = self.enc[self.layout.cross_names[0]]
        width = first.shape[2]
        held = self.cross.get(self.layout.cross_names[0])
        if held is None:
            padded = SpareRuns.width(width)
            for name in self.layout.cross_names:
                self.cross[name] = np.zeros((1, first.shape[1], padded, first.shape[3]), first.dtype)
            self.cross["src_lengths"] = np.zeros(1, np.int64)
            self.bindings.clear()
        elif held.shape[0] != 1 or not width <= held.shape[2] <= SpareRuns.width(width):
            return False
        for name in self.layout.cross_names:
            self.cross[name][:, :, :width] = self.enc[name][rows]
        self.cross["src_lengths"][:] = self.enc["src_lengths"][rows]
        self.cross_rows = rows.copy()
        return True

    def reuse(self, enc: dict[str, Any], rows: int) -> None:
        """This spare run made the state of a new run of `rows` rows over `enc` (one source): the buffers and
        bindings are kept, the rest starts again (the step graph reads only the cache slots it wrote)."""
        self.enc, self.rows, self.position, self.row_pos = enc, rows, 0, None
        self.row_src_given, self.cross_rows, self.pooled = None, np.array([-1]), None

    def binding(self, session, fused: bool, k: int, ban_eos: bool, topk_k: np.ndarray, ban_bias: np.ndarray):
        """The IOBinding of the current row count on `session`; every tensor is bound by pointer once.

        The buffers' contents change in place between runs (tokens, positions, cache slots and rows),
        their addresses do not, so a binding is kept for its row count and cross K/V entry count until the
        buffers change. The fused graph's also binds its top-k (k, the ban bias and the outputs).
        """
        r = self.rows
        n = len(self.cross_rows)
        key = (r, n, id(session), k, ban_eos) if fused else (r, n, id(session))
        b = self.bindings.get(key)
        if b is not None:
            return b
        b = session.io_binding()
        layers = range(len(self.layout.cache_names))
        topk = None
        if fused:
            values, ids = self.topk_buffers(k)
            topk = (topk_k, ban_bias, values[:r], ids[:r])
        bind_step(b, self.mem, fused, tokens=self.tokens[:r], positions=self.positions[:r], cross=self.cross,
                  cache=[self.cache[i, :r] for i in layers], log_probs=self.outputs["log_probs"][:r],
                  new=[] if fused else [self.outputs["new"][i, :r] for i in layers], topk=topk)
        self.bindings[key] = b
        return b

    def topk_buffers(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The fused graph's (R_max, k) top-k outputs (host memory: it runs on the CPU provider only)."""
        bufs = self.topk.get(k)
        if bufs is None:
            n = self.outputs["log_probs"].shape[0]
            bufs = self.topk[k] = (np.empty((n, k), np.float32), np.empty((n, k), np.int64))
        return bufs

    def keep_rows(self, rows: np.ndarray) -> bool:
        """Row i continues row rows[i]: in place, only the rows whose content changes move, and only their
        filled slots. The buffers grow first where there are more rows than allocated: -> whether they did."""
        grew = len(rows) > self.cache.shape[1]
        if grew:
            self.grow(len(rows))
        if len(rows) and rows.view(np.uint64).max() >= self.rows:  # one pass: a negative row is huge as uint64
            raise InputError(f"reorder takes rows 0..{self.rows - 1} of the state, got {rows.min()}..{rows.max()}")
        moved = np.flatnonzero(rows != np.arange(len(rows)))  # rows whose content changes
        if moved.size and self.position:
            self.mem.move_rows(self.cache, moved, rows[moved], self.position)
        if len(rows) != self.rows and len(self.bindings) > MAX_BINDINGS:
            self.bindings.clear()  # those of other row counts stay valid (their buffers are the same): a few are kept
        self.rows = len(rows)
        return grew

    def rows_moved(self, rows: np.ndarray) -> None:
        """Per-row positions follow a reorder; back to one position once every row is at the same one."""
        if self.row_pos is not None:
            self.row_pos = self.row_pos[rows]
            if self.row_pos.size and (self.row_pos == self.row_pos[0]).all():
                self.position, self.row_pos = int(self.row_pos[0]), None

    def admit(self, enc: dict[str, Any], per_source: bool, most_width: int) -> None:
        """One new row per source of `enc` after the current rows, at position 0: its sources written into free
        slots of the pool (ort_slots.PooledCross; renumbered as backends.base.renumbered_sources says), only the
        new rows' cross K/V written into the bound buffers."""
        if self.pooled is None:
            self._new_pool()
        row_src = self.pooled.admit(np.frombuffer(self.row_src_given, np.int64), enc, most_width, self.owned)
        self.enc = {}  # the pool holds what the step reads from now on
        n_new = len(row_src) - self.rows
        total = self.rows + n_new
        if total > self.cache.shape[1]:  # doubled: rows admitted one request at a time copy the cache rarely
            self.grow(max(total, 2 * self.cache.shape[1]))
        before = self.row_pos if self.row_pos is not None else np.full(self.rows, self.position, np.int64)
        self.row_pos = np.concatenate([before, np.zeros(n_new, np.int64)])
        if not self.row_pos.any():
            self.row_pos = None
        self.rows = total
        self.bindings.pop(LAST_STEP, None)  # those of each row count stay valid until the buffers change
        if len(self.bindings) > MAX_BINDINGS:
            self.bindings.clear()
        self.recyclable = False  # its cross K/V are several sources' from now on
        self.row_src_given = None  # bound again: only the new rows are written
        self.gather_cross(row_src, per_source)

    def trim(self) -> bool:
        """The memory a burst left behind given back (TRIM_MIN_ROWS): the cache's rows cut to twice the rows in
        use where a quarter or fewer are, its slots to twice the filled ones where a quarter or fewer are filled
        (a long sentence has left), the contents kept -> whether the buffers changed (the bindings are made again).
        A server's running batch otherwise keeps its widest moment's cache for as long as rows keep it alive."""
        have_rows, have_slots = self.cache.shape[1], self.cache.shape[3]
        filled = self.position if self.row_pos is None else int(self.row_pos.max(initial=0))
        rows, slots = have_rows, have_slots
        if have_rows > TRIM_MIN_ROWS and 4 * self.rows <= have_rows:
            rows = max(TRIM_MIN_ROWS, 2 * self.rows)
        if have_slots > FIRST_CACHE_SLOTS and 4 * filled <= have_slots:
            slots = max(FIRST_CACHE_SLOTS, 2 * filled)
        if (rows, slots) == (have_rows, have_slots):
            return False
        old = self.cache
        self.cache = self.mem.zeros((old.shape[0], rows, old.shape[2], slots, old.shape[4]), self.owned)
        self.mem.copy_filled(self.cache, old, self.rows, filled)
        self.mem.free(old, self.owned)
        if rows != have_rows:
            old_outputs = list(self.outputs.values())
            self.alloc_step_buffers(rows)  # clears the bindings and the top-k buffers
            for buf in old_outputs:
                self.mem.free(buf, self.owned)
        self.bindings.clear()
        return True

    def grow(self, rows: int) -> None:
        """More rows than allocated (beam expansion after step 0): reallocate once, keep contents."""
        mem = self.mem
        old, old_outputs = self.cache, list(self.outputs.values())
        self.cache = mem.empty((old.shape[0], rows) + tuple(old.shape[2:]), owned=self.owned)
        mem.copy_rows(self.cache, old)  # the old rows, the new ones zeroed: each byte written once
        self.alloc_step_buffers(rows)  # clears the bindings and the top-k buffers
        for buf in [old] + old_outputs:
            mem.free(buf, self.owned)

    def release(self) -> None:
        """The run is over: its buffers go back to the pool for the next run (the state is dead)."""
        self.bindings.clear()
        self.cross = {}
        self.pooled = None
        self.outputs.clear()
        self.topk.clear()
        self.cache = None
        self.mem.release(self.owned)


class SpareRuns:
    """Runs of one source (a sentence decoded alone: greedy, or beam search's beams of it), kept once they end
    with their buffers and IO bindings, for the next such run: binding ~20 tensors costs ~60 us a run, a tenth of
    a short sentence's greedy decode. A spare serves a run whose cache fits its capacity and whose source width
    rounds up to its cross K/V's (width()); a few are kept, the least recently used given back first."""

    KEEP = 3
    MAX_BYTES = 16 << 20  # runs whose cache is bigger are not kept (their binding is a small part of their time)
    WIDTH_STEP = 16  # cross K/V widths are rounded up to a multiple of this
    CAPACITY_STEP = 64  # and cache capacities

    def __init__(self) -> None:
        self._runs: list[RunState] = []
        self._lock = threading.Lock()

    @classmethod
    def width(cls, width: int) -> int:
        return -(-width // cls.WIDTH_STEP) * cls.WIDTH_STEP

    @classmethod
    def capacity(cls, capacity: int, max_positions: int) -> int:
        """The capacity a recyclable run allocates: rounded up, within the model's positions."""
        return max(capacity, min(-(-capacity // cls.CAPACITY_STEP) * cls.CAPACITY_STEP, max_positions))

    def take(self, enc: dict[str, Any], rows: int, capacity: int, cross_name: str) -> RunState | None:
        """A spare that can run `rows` rows over `enc` (one source) up to `capacity` slots, made ready; else None."""
        width = enc[cross_name].shape[2]
        with self._lock:
            for i in range(len(self._runs) - 1, -1, -1):
                st = self._runs[i]
                held = st.cross[cross_name].shape[2]
                if st.cache.shape[1] >= rows and st.capacity >= capacity and width <= held <= self.width(width):
                    del self._runs[i]
                    st.reuse(enc, rows)
                    return st
        return None

    def give(self, state: RunState) -> bool:
        """Keep an ended run (-> True) if it is one source's, small, and on host memory; else the caller
        releases it."""
        if not state.recyclable or state.cache is None or state.cache.nbytes > self.MAX_BYTES or len(state.cross) == 0:
            return False
        state.enc = {}  # the encoder results of the run that ended are not kept alive
        with self._lock:
            self._runs.append(state)
            dropped = self._runs[: -self.KEEP]
            del self._runs[: -self.KEEP]
        for st in dropped:
            st.release()
        return True

    def clear(self) -> None:
        with self._lock:
            runs, self._runs = self._runs, []
        for st in runs:
            st.release()
