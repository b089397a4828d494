"""Eager PyTorch on CUDA with its encoder and every decoder step replayed from CUDA graphs.

Eager PyTorch on a GPU is bound by launching kernels from Python: a step launches a few hundred of them and
takes milliseconds whatever the rows. A CUDA graph replays them in one launch. A graph reads and writes the
addresses it was captured with, so this backend decodes in static buffers:

- A *slab* holds everything one step binds, for one (rows, cache capacity, source length) bucket: tokens
  and positions (one upload per step), source lengths, the self-attention cache (every layer's K and V in
  one buffer, written in place by the graph at each row's own position), cross K/V, the banned ids' bias,
  and the outputs (top-k values and ids, or the full log-probs). Its graphs (one per top-k width) belong
  to it: a slab's buffers never move, so a graph of it stays valid for the slab's life.
- Rows, capacity and source length are rounded up (cuda_graphs.row_bucket, length_bucket): steps whose rows
  change (beams finishing, a running batch admitting or retiring) and batches of other shapes replay the
  same graphs. Padding rows decode PAD at position 0 against a 1-token source; nobody reads them. A run
  also takes an idle slab of up to twice its capacity and source width (the extra slots are masked).
- Rows that outgrow a slab, or shrink to a quarter of it, move to a slab of their bucket (the filled cache
  slots are copied); a beam reorder within a slab moves only the rows whose history changed, in place.
- Slabs are pooled on the backend across runs (`end` hands one back; a state dropped without `end` frees
  its slab too); at most MAX_FREE_SLABS idle ones (and MAX_FREE_BYTES in them) are kept, the least recently
  used dropped with its graphs.
- The encoder runs in slabs of (batch, source length) buckets too; its outputs are copied out, so a later
  encode cannot overwrite a batch still decoding.

Every run goes through cuda_graphs.GraphSet (shared with the TensorRT backend): a bucket's first run is
normal, its second is captured and replayed, later ones replayed; a failed capture turns graphs off with a
warning. Only the top-k values and ids come back to the host each step. Precision: fp32, fp16 or bf16
weights (TorchBackend). The tests run it on the CPU with a capturer that replays the recorded Python
function (tests/cuda_graph_fake.py), and on a GPU for real.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transduce.errors import BackendUnavailable
from transduce.runtime.backends.base import renumbered_sources
from transduce.runtime.backends.cuda_graphs import CudaCapturer, GraphSet, GraphStats, length_bucket, row_bucket
from transduce.runtime.backends.topk import ban_bias
from transduce.runtime.backends.torch_backend import TorchBackend, merge_padded
from transduce.runtime.backends.torch_cache import move_rows_torch

SRC_STEP = 16  # source lengths are captured in multiples of this many positions
CAPACITY_STEP = 32  # and cache capacities in multiples of this many slots
MAX_FREE_SLABS = 8  # idle step slabs kept for later runs (each holds a cache and its graphs)
MAX_FREE_BYTES = 2 << 30  # and at most this much memory in them (a base-sized slab of 64 rows is ~0.4 GB)
MAX_ENCODER_SLABS = 8


@dataclass(eq=False)
class _Slab:
    """The static buffers of one step bucket, key = (rows, capacity, source length), and their graphs."""

    key: tuple[int, int, int]
    io: Any  # (2, R) long: each row's token, then its position
    io_host: Any  # (2, R) long on the host (pinned on a GPU): staged there, one copy up per step
    src_lengths: Any  # (R,) long
    cache: Any  # (2L, R, H, C, Dh): layer i's keys at 2i, its values at 2i + 1
    cross: Any  # (2L, R, H, S, Dh), the same layout
    ban: Any  # (V,) fp32: -inf at the ids a step may not propose
    log_probs: Any  # (R, V) fp32: step_log_probs' output
    graphs: GraphSet
    views: tuple = ()  # per-layer views of cache and cross: (keys, values, cross keys, cross values)
    top: dict[int, Any] = field(default_factory=dict)  # k -> (R, 2, k) fp32: values and ids (exact below 2**24)
    ban_eos: bool | None = None  # which bias `ban` holds
    owner: Any = None  # weakref.ref to the state decoding in it; None while idle


@dataclass(eq=False)
class _EncoderSlab:
    key: tuple[int, int]  # (batch, source length)
    ids: Any  # (B, S) long
    lengths: Any  # (B,) long
    memory: Any  # (B, S, D)
    cross: Any  # (B, 2L, H, S, Dh)
    graphs: GraphSet


@dataclass
class _Encoded:
    memory: Any  # (B, S, D), S a bucket of the longest source
    cross: Any  # (B, 2L, H, S, Dh)
    src_lengths: Any  # (B,) long
    src_len: int  # the batch's own source length (encoder_outputs reports that many positions)


@dataclass(eq=False)
class _State:
    enc: _Encoded
    capacity: int  # cache slots asked for: a row at this position cannot step
    rows: int = 0
    slab: _Slab | None = None
    row_src: np.ndarray = field(default_factory=lambda: np.array([-1]))  # what the slab's cross K/V hold
    row_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (rows,) each row's position


class TorchGraphBackend(TorchBackend):
    """The eager model under CUDA graphs (the module's docstring); `_capturer`: a test double for the CPU."""

    # not KeepsLogProbs: a graph that picks the top-k keeps no full log-probs (a search that needs them steps with
    # step_log_probs); None hides the eager backend's method from the capability's isinstance
    last_log_probs = None

    def __init__(self, model, device: str = "cuda", precision: str = "fp32", *, _capturer=None):
        super().__init__(model, device, precision)
        torch = self.torch
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)
            # the weights may still be in flight on the default stream (a model given on the GPU, cast to a copy)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.device(self.device):
                self._pool = torch.cuda.MemPool()  # held for the backend's life: its graphs' one memory pool
            self.capturer = CudaCapturer(torch, self.stream, self._pool.id)
        elif _capturer is not None:
            self.stream, self.capturer = None, _capturer
        else:
            raise BackendUnavailable("CUDA graphs need a CUDA device, and this torch backend runs on the CPU",
                                     hint="run it on device cuda, or without cuda_graph", params=("cuda_graph",))
        cfg = self.config
        self.layers, self.heads = cfg.decoder_layers, cfg.n_heads
        self.head_dim, self.vocab = cfg.head_dim, cfg.vocab_size
        self.stats = GraphStats()
        self._slabs: list[_Slab] = []  # least recently taken first
        self._encoders: collections.OrderedDict[tuple, _EncoderSlab] = collections.OrderedDict()
        with self._work():
            self._bans = {flag: torch.from_numpy(ban_bias(cfg, flag)).to(self.device) for flag in (False, True)}

    @contextlib.contextmanager
    def _work(self):
        """Every op of the backend: on its own stream (graphs are captured on it), in inference mode."""
        torch = self.torch
        on_stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with on_stream, torch.inference_mode():
            yield

    def _zeros(self, shape, dtype=None):
        return self.torch.zeros(shape, dtype=dtype or self.dtype, device=self.device)

    @property
    def cuda_graph(self) -> bool:
        """Whether runs are captured (no capture has failed)."""
        return self.stats.enabled

    def tuning(self) -> dict[str, Any]:
        idle = sum(1 for s in self._slabs if not _busy(s))
        return {"precision": self.precision, **self.stats.to_dict(), "step_slabs": len(self._slabs),
                "idle_step_slabs": idle, "encoder_slabs": len(self._encoders)}

    # -- encoder ----------------------------------------------------------------------------------
    def encode(self, src_ids: np.ndarray, src_lengths: np.ndarray) -> _Encoded:
        src_ids = np.ascontiguousarray(src_ids, np.int64)
        b, s = src_ids.shape
        slab = self._encoder_slab((row_bucket(b), length_bucket(s, SRC_STEP, self.config.max_positions)))
        ids = np.full(slab.key, self.config.pad_id, np.int64)
        ids[:b, :s] = src_ids
        lengths = np.ones(slab.key[0], np.int64)  # padding rows: one position, so their softmax has a key
        lengths[:b] = src_lengths
        torch = self.torch
        with self._work():
            slab.ids.copy_(torch.from_numpy(ids))
            slab.lengths.copy_(torch.from_numpy(lengths))
            slab.graphs.run("encode", lambda: self._encode_body(slab))
            return _Encoded(slab.memory[:b].clone(), slab.cross[:b].clone(), slab.lengths[:b].clone(), s)

    def _encode_body(self, slab: _EncoderSlab) -> None:
        memory, keys, values = self.model.encode(slab.ids, slab.lengths)
        slab.memory.copy_(memory)
        slab.cross.copy_(self.torch.stack(_interleaved(keys, values), dim=1))

    def _encoder_slab(self, key: tuple[int, int]) -> _EncoderSlab:
        slab = self._encoders.get(key)
        if slab is not None:
            self._encoders.move_to_end(key)
            return slab
        b, s = key
        with self._work():
            slab = _EncoderSlab(key, self._zeros(key, self.torch.long), self._zeros((b,), self.torch.long),
                                self._zeros((b, s, self.config.d_model)),
                                self._zeros((b, 2 * self.layers, self.heads, s, self.head_dim)),
                                GraphSet(self.capturer, self.stats, "encoder", warm_keys=1))
        if len(self._encoders) >= MAX_ENCODER_SLABS:
            self._encoders.popitem(last=False)
        self._encoders[key] = slab
        return slab

    def encoder_outputs(self, enc: _Encoded) -> dict[str, np.ndarray]:
        s = enc.src_len
        with self._work():  # read on the stream that wrote them
            out = {"memory": enc.memory[:, :s].float().cpu().numpy()}
            for i in range(self.layers):
                out[f"cross_key_{i}"] = enc.cross[:, 2 * i, :, :s].float().cpu().numpy()
                out[f"cross_value_{i}"] = enc.cross[:, 2 * i + 1, :, :s].float().cpu().numpy()
        return out

    # -- slabs ------------------------------------------------------------------------------------
    def _key(self, rows: int, state: _State) -> tuple[int, int, int]:
        cap = length_bucket(state.capacity, CAPACITY_STEP, self.config.max_positions)
        return row_bucket(rows), cap, int(state.enc.cross.shape[3])

    def _fits(self, slab: _Slab, rows: int, state: _State) -> bool:
        """Whether `rows` rows of `state` stay in `slab`: capacity and source width at least the state's, and
        rows within its own, but not shrunk to a quarter of a large one (each padding row costs work every step)."""
        want = self._key(rows, state)
        r = slab.key[0]
        return _holds(slab.key, want) and rows <= r and (rows > r // 4 or r <= 8)

    def _take(self, key: tuple[int, int, int], state: _State) -> _Slab:
        """An idle slab for `key` (or a new one) for `state`: of its rows, with the capacity and source width
        or up to twice them (masked slots cost less than a capture), the smallest such."""
        fits = [s for s in self._slabs if not _busy(s) and s.key[0] == key[0] and _holds(s.key, key, 2)]
        slab = min(fits, key=_bytes, default=None)
        if slab is None:
            slab = self._new_slab(key)
        else:
            self._slabs.remove(slab)
        slab.owner = weakref.ref(state)
        self._slabs.append(slab)
        self._trim()
        return slab

    def _trim(self) -> None:
        """Drop the least recently taken idle slabs beyond MAX_FREE_SLABS or MAX_FREE_BYTES (their graphs too)."""
        idle = [s for s in self._slabs if not _busy(s)]
        while idle and (len(idle) > MAX_FREE_SLABS or sum(_bytes(s) for s in idle) > MAX_FREE_BYTES):
            self._slabs.remove(idle.pop(0))

    def _new_slab(self, key: tuple[int, int, int]) -> _Slab:
        torch = self.torch
        r, c, s = key
        with self._work():
            io_host = torch.zeros((2, r), dtype=torch.long, pin_memory=self.device.type == "cuda")
            slab = _Slab(key, self._zeros((2, r), torch.long), io_host, self._zeros((r,), torch.long),
                         self._zeros((2 * self.layers, r, self.heads, c, self.head_dim)),
                         self._zeros((2 * self.layers, r, self.heads, s, self.head_dim)),
                         self._zeros((self.vocab,), torch.float32), self._zeros((r, self.vocab), torch.float32),
                         GraphSet(self.capturer, self.stats, "decoder step", warm_keys=4))
        slab.views = (list(slab.cache[0::2]), list(slab.cache[1::2]), list(slab.cross[0::2]), list(slab.cross[1::2]))
        return slab

    def _move(self, state: _State, rows: int, src_rows: np.ndarray) -> None:
        """Into a slab of `rows` rows' bucket: its first len(src_rows) rows take the filled cache slots of the
        current slab's rows src_rows (none for a new state)."""
        old, p = state.slab, _filled(state)
        slab = self._take(self._key(rows, state), state)
        if old is not None:
            if p and len(src_rows):
                with self._work():
                    moved = old.cache[:, :, :, :p].index_select(1, self._long(src_rows))
                    slab.cache[:, : len(src_rows), :, :p].copy_(moved)
            old.owner = None
            self._trim()
        state.slab, state.row_src = slab, np.array([-1])

    def _gather(self, state: _State, row_src: np.ndarray) -> None:
        """The slab's cross K/V and source lengths for rows decoding sources row_src (when that changed)."""
        row_src = np.asarray(row_src, np.int64)
        if np.array_equal(row_src, state.row_src):
            return
        slab, enc, n, width = state.slab, state.enc, len(row_src), state.enc.cross.shape[3]
        with self._work():
            idx = self._long(row_src)
            # a wider slab's positions past the sources keep what they held: finite, and masked by src_lengths
            slab.cross[:, :n, :, :width].copy_(enc.cross.index_select(0, idx).transpose(0, 1))
            slab.src_lengths[:n].copy_(enc.src_lengths.index_select(0, idx))
            slab.src_lengths[n:].fill_(1)
        state.row_src = row_src.copy()

    # -- decoding run -----------------------------------------------------------------------------
    def begin(self, enc: _Encoded, row_src: np.ndarray, capacity: int) -> _State:
        rows = len(row_src)
        state = _State(enc, max(int(capacity), 1), rows, row_pos=np.zeros(rows, np.int64))
        self._move(state, rows, np.zeros(0, np.int64))
        self._gather(state, row_src)
        return state

    def end(self, state: _State) -> None:
        if state.slab is not None:
            state.slab.owner = None
            state.slab = None
            self._trim()

    def _run(self, state: _State, tokens: np.ndarray, k: int, ban_eos: bool = False) -> None:
        r, slab = state.rows, state.slab
        tokens = np.asarray(tokens)
        if tokens.shape != (r,):
            raise ValueError(f"expected {r} tokens, got shape {tokens.shape}")
        if r and int(state.row_pos.max()) >= state.capacity:
            raise IndexError(f"cache capacity {state.capacity} exhausted at position {int(state.row_pos.max())}")
        host = slab.io_host.numpy()
        host[0, :r], host[0, r:] = tokens, self.config.pad_id
        host[1, :r], host[1, r:] = state.row_pos, 0
        with self._work():
            slab.io.copy_(slab.io_host, non_blocking=True)  # the last step's read-back waited for the last copy
            if k:
                if slab.ban_eos is not ban_eos:
                    slab.ban.copy_(self._bans[ban_eos])
                    slab.ban_eos = ban_eos
                if k not in slab.top:
                    slab.top[k] = self._zeros((slab.key[0], 2, k), self.torch.float32)
            slab.graphs.run(k, lambda: self._step_body(slab, k))
        state.row_pos = state.row_pos + 1

    def _step_body(self, slab: _Slab, k: int) -> None:
        """One step of every row of the slab, on its buffers only (this is what a graph replays)."""
        torch = self.torch
        positions = slab.io[1]
        keys, values, cross_keys, cross_values = slab.views
        lp, new_keys, new_values = self.model.decode_step(slab.io[0], positions, slab.src_lengths, keys, values,
                                                          cross_keys, cross_values)
        new = torch.stack(_interleaved(new_keys, new_values))  # (2L, R, H, 1, Dh)
        slab.cache.scatter_(3, positions.view(1, -1, 1, 1, 1).expand_as(new), new)  # each row's own slot
        if k == 0:
            slab.log_probs.copy_(lp)
            return
        vals, ids = torch.topk(lp + slab.ban, k, dim=-1)
        slab.top[k][:, 0].copy_(vals)
        slab.top[k][:, 1].copy_(ids)

    def step(self, state: _State, tokens: np.ndarray, k: int, ban_eos: bool = False) -> tuple[np.ndarray, np.ndarray]:
        k = min(int(k), self.vocab)
        self._run(state, tokens, k, bool(ban_eos))
        with self._work():
            both = state.slab.top[k][: state.rows].cpu().numpy()  # one copy down: values and ids
        return both[:, 0].astype(np.float32), both[:, 1].astype(np.int64)

    def attention_problem(self) -> str | None:
        # its captured step has no attention output; a second capture for it is not worth it for now
        return "the torch backend under CUDA graphs does not give attention weights, which alignments are read from"

    def step_attention(self, state: _State, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError(self.attention_problem())

    def step_log_probs(self, state: _State, tokens: np.ndarray) -> np.ndarray:
        self._run(state, tokens, 0)
        with self._work():
            return state.slab.log_probs[: state.rows].cpu().numpy().copy()

    def reorder(self, state: _State, rows: np.ndarray, row_src: np.ndarray) -> None:
        rows = np.asarray(rows, np.int64)
        n, p = len(rows), _filled(state)
        if not self._fits(state.slab, n, state):
            self._move(state, n, rows)
        else:
            moved = np.flatnonzero(rows != np.arange(n))
            if moved.size and p:
                with self._work():
                    idx = self._long(np.concatenate([moved, rows[moved]]))  # one copy to the device
                    move_rows_torch(state.slab.cache, idx[: moved.size], idx[moved.size:], p)
        state.rows, state.row_pos = n, state.row_pos[rows]
        self._gather(state, row_src)

    def admit(self, state: _State, enc: _Encoded) -> None:
        """New rows at position 0 for `enc`'s sources after the state's (see TorchBackend.admit)."""
        kept, inverse = renumbered_sources(state.row_src[: state.rows])
        old, n_new = state.enc, len(enc.src_lengths)
        with self._work():
            keep = self._long(kept)
            state.enc = _Encoded(merge_padded(old.memory, keep, enc.memory, 1),
                                 merge_padded(old.cross, keep, enc.cross, 3),
                                 self.torch.cat([old.src_lengths.index_select(0, keep), enc.src_lengths]),
                                 max(old.src_len, enc.src_len))
        rows = state.rows + n_new
        if not self._fits(state.slab, rows, state):
            self._move(state, rows, np.arange(state.rows))
        state.rows, state.row_pos = rows, np.concatenate([state.row_pos, np.zeros(n_new, np.int64)])
        state.row_src = np.array([-1])  # the merged results: gathered again
        self._gather(state, np.concatenate([inverse, len(kept) + np.arange(n_new)]))


def _interleaved(keys: list, values: list) -> list:
    """[k0, v0, k1, v1, ...]: the layout of a slab's cache and cross buffers."""
    return [t for pair in zip(keys, values, strict=True) for t in pair]


def _holds(have: tuple[int, int, int], want: tuple[int, int, int], most: int = 0) -> bool:
    """Whether a slab of key `have` takes a state of key `want`: capacity and source width at least want's
    (and at most `most` times them, when given)."""
    return all(w <= h and (not most or h <= most * w) for h, w in zip(have[1:], want[1:], strict=True))


def _bytes(slab: _Slab) -> int:
    return sum(t.numel() * t.element_size() for t in (slab.cache, slab.cross, slab.log_probs))


def _busy(slab: _Slab) -> bool:
    return slab.owner is not None and slab.owner() is not None


def _filled(state: _State) -> int:
    """Cache slots holding something for some row: what a move copies."""
    return int(state.row_pos.max()) if state.rows else 0
