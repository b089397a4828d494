"""The TensorRT backend: an engine directory's two plans, run with the tensor-address API on one CUDA stream.

Runs only where TensorRT >= 10, a CUDA build of PyTorch and an NVIDIA GPU are (`pip install
'transduce[gpu]'`); elsewhere constructing it raises BackendUnavailable with the reason. Device memory is
torch CUDA tensors bound by address (`set_tensor_address`); the engines and every torch op of the backend
(copies, slot writes, gathers, top-k) run on the backend's own CUDA stream, and only the chosen token ids
and their log-probs come back to the host.

A decoding run (`begin` .. `end`) allocates its buffers once: the self-attention cache (one buffer of
every layer's K and V, whose per-layer views the step engine binds; beam reorders move rows within it in
place), the step's outputs (new K/V are copied into slot `position` after each run), tokens and
positions, and gathered cross K/V once the row -> source mapping is no longer the identity. The buffers
are reallocated once when beam search grows the rows after step 0. A running batch admits rows into a run
(tensorrt_admit: their sources into free slots of the run's encoder results, each row at its own position)
where the step profiles take the widened source length beside the run's cache (AdmitsWithin).

Profiles: one execution context per optimization profile of engine.json (tensorrt_runner.py); each run
picks the profile for its shapes, a batch wider than every profile runs in chunks of rows, and a source
or cache longer than the engines were built for is an EngineError naming the `transduce build` flag.

CUDA graphs (cuda_graph=True): a step run in one chunk is captured per (profile, shapes, addresses) right
after a normal run with those shapes, and replayed while they hold (rows, capacity, source length and
buffers unchanged). A failed capture switches graphs off for the backend, with a warning. The bookkeeping
is cuda_graphs.GraphSet's, shared with the eager backend's CUDA graphs.

The tests run it against a test double of TensorRT on the CPU, and for real on a GPU
(tests/runtime/test_tensorrt_backend.py).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transduce.errors import BackendUnavailable, EngineError
from transduce.formats import engine as engine_format
from transduce.formats.profiles import choose_chunks
from transduce.runtime.backends import tensorrt_support as trt_support
from transduce.runtime.backends.base import Backend
from transduce.runtime.backends.cuda_graphs import CudaCapturer, GraphSet, GraphStats
from transduce.runtime.backends.slots import SlotTable
from transduce.runtime.backends.tensorrt_admit import admit, admits, rows_moved, write_slots
from transduce.runtime.backends.tensorrt_runner import ALIGN, EngineRunner, freeze
from transduce.runtime.backends.topk import banned_ids
from transduce.runtime.backends.torch_cache import move_rows_torch
from transduce.runtime.checks import check_engine_dir


def _torch():
    try:
        import torch
    except ImportError:
        raise BackendUnavailable("the tensorrt backend needs PyTorch (for CUDA device memory and streams)",
                                 hint=trt_support.GPU_HINT) from None
    return torch


@dataclass
class _Encoded:
    memory: Any  # (B, S, D)
    cross: dict[str, Any]  # cross_key_i / cross_value_i -> (B, H, S, Dh)
    src_lengths: Any  # (B,) on the device, in the step engine's dtype
    batch: int
    src_len: int


@dataclass
class _State:
    enc: _Encoded
    rows: int  # current decoding rows
    row_cap: int  # rows the buffers hold
    capacity: int  # cache slots
    row_src: np.ndarray  # the slot of enc's each row's cross K/V are bound from ([-1]: to bind again)
    slots: SlotTable  # enc's sources as a slot pool (tensorrt_admit): the protocol's numbering -> slots
    cache: Any = None  # every layer's K and V: (2 x layers, row_cap, H, C, Dh)
    caches: list[Any] = field(default_factory=list)  # its views past_key_0, past_value_0, ... (row_cap, H, C, Dh)
    outputs: dict[str, Any] = field(default_factory=dict)  # log_probs, new_* (row_cap, ...)
    tokens: Any = None  # (row_cap,) device
    tokens_host: Any = None  # (row_cap,) pinned host
    positions: Any = None  # (row_cap,) device
    cross: dict[str, Any] = field(default_factory=dict)  # bound cross K/V + "src_lengths": enc's or gathered
    cross_buf: dict[str, Any] | None = None  # gather destinations (row_cap rows), allocated when first needed
    position: int = 0  # filled slots: every row's while row_pos is None, else the most any row has
    row_pos: np.ndarray | None = None  # (R,) each row's position once rows differ (admit)
    given: np.ndarray = field(default_factory=lambda: np.array([-1]))  # each row's source, as last given
    graphs: GraphSet | None = None  # the step's graphs over this run's buffers (cuda_graph=True)


class TensorRTBackend(Backend):
    name = "tensorrt"

    def __init__(self, engine_dir: str | os.PathLike, device: str = "cuda", cuda_graph: bool = False,
                 verify: bool = True, log=None, *, _trt=None, _runtime: engine_format.RuntimeInfo | None = None):
        """Load ENGINE_DIR (written by `transduce build`). device: "cuda" or "cuda:N".

        verify: check every file's sha256 against engine.json (a tampered plan is refused).
        `_trt` / `_runtime` inject a TensorRT module and runtime identity (tests only; with an injected
        module device="cpu" is accepted so the test double can run on host memory).
        """
        # the directory's mistakes first (no such directory, an artifact or model given instead, an edited
        # description; `transduce inspect` runs the same checks): they are what to fix before TensorRT, CUDA or
        # PyTorch being missing here matters. The files are held open: the plans loaded are the ones checked.
        self.engine = check_engine_dir(engine_dir, verify_hashes=False)
        self.engine_dir = self.engine.path
        torch = _torch()
        self.torch = torch
        self._log = log or (lambda msg: None)
        trt = _trt or trt_support.import_tensorrt()
        self.trt = trt
        if str(device) == "cpu" and _trt is not None:
            self.device = torch.device("cpu")
        else:
            idx = trt_support.device_index(device)
            if not torch.cuda.is_available():
                raise BackendUnavailable("the tensorrt backend needs a CUDA GPU and PyTorch sees none here",
                                         hint=trt_support.GPU_HINT + " (or decode with backend onnxruntime on the CPU)",
                                         params=("backend",))
            self.device = torch.device("cuda", idx)
        self.on_cuda = self.device.type == "cuda"
        if _runtime is None:
            _runtime = trt_support.current_runtime(self.device.index or 0, trt)
        if verify:
            self.engine.verify_files()  # every sha256, on the files already open
        self.engine.check_runtime(_runtime)  # the TensorRT version and GPU the plans were built for
        self.meta = self.engine.meta
        # the engine directory holds the artifact: tokenizer, manifest (parity and `load` read it)
        self.artifact = self.engine.artifact
        self.config = self.artifact.config
        self.precision = self.artifact.precision
        self.plan = self.engine.plan
        cfg = self.config
        self.n_layers = cfg.decoder_layers
        self.heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.vocab = cfg.vocab_size
        self.cache_names = [f"past_{kv}_{i}" for i in range(self.n_layers) for kv in ("key", "value")]
        self.new_names = [f"new_{kv}_{i}" for i in range(self.n_layers) for kv in ("key", "value")]
        self.cross_names = [f"cross_{kv}_{i}" for i in range(self.n_layers) for kv in ("key", "value")]
        self.graph_stats = GraphStats(enabled=bool(cuda_graph) and self.on_cuda)
        if self.on_cuda:
            torch.cuda.set_device(self.device)
            self.stream = torch.cuda.Stream(device=self.device)
            self.stream_handle = int(self.stream.cuda_stream)
            self._capturer = CudaCapturer(torch, self.stream)
        else:
            self.stream, self.stream_handle, self._capturer = None, 0, None
        rebuild = engine_format.rebuild_command(self.engine_dir, self.meta)
        self._logger = trt_support.make_logger(trt, self._log)
        self._runtime = trt.Runtime(self._logger.ilogger)
        self._enc = EngineRunner(trt, torch, self._runtime, self._logger, self.engine.files, engine_format.ENCODER_PLAN,
                                 "encoder", self.plan.encoder, cfg, self.precision, rebuild)
        self._step = EngineRunner(trt, torch, self._runtime, self._logger, self.engine.files, engine_format.STEP_PLAN,
                                  "decoder_step", self.plan.decoder_step, cfg, self.precision, rebuild)
        for name in self.cross_names:  # the encoder's outputs are the step's inputs, bound as they are
            if self._enc.dtypes[name] != self._step.dtypes[name]:
                raise EngineError(f"{name}: the encoder engine writes {self._enc.dtypes[name]}, the step engine reads "
                                  f"{self._step.dtypes[name]}", hint=f"rebuild the engines with: {rebuild}")
        self.float_dtype = self._step.dtypes[self.cache_names[0]]
        with self._on_stream():  # made on the stream that uses them (a side stream does not wait for the default one)
            self._placeholder = self._zeros((16,), torch.uint8)
            self._banned = {flag: torch.tensor(banned_ids(cfg, flag), dtype=torch.long, device=self.device)
                            for flag in (False, True)}
        self._sync()

    # -- plumbing ---------------------------------------------------------------------------------
    def _on_stream(self):
        return self.torch.cuda.stream(self.stream) if self.on_cuda else contextlib.nullcontext()

    def _ptr(self, t) -> int:
        """A tensor's address for TensorRT: an empty tensor still needs a valid address of >= 1 byte."""
        if t.numel() == 0:
            return int(self._placeholder.data_ptr())
        assert t.is_contiguous()
        return int(t.data_ptr())

    def _empty(self, shape, dtype):
        """A contiguous tensor starting at a multiple of ALIGN bytes on any device. torch's CUDA allocator
        aligns to 512 bytes, so on a GPU this is a plain allocation of the exact size; its CPU allocator
        aligns to 64 (the test double runs on the CPU): there, ALIGN more bytes and an aligned start."""
        t = self.torch.empty(tuple(shape), dtype=dtype, device=self.device)
        if t.data_ptr() % ALIGN == 0:
            return t
        n = t.numel() * dtype.itemsize
        raw = self.torch.empty(n + ALIGN, dtype=self.torch.uint8, device=self.device)
        start = -int(raw.data_ptr()) % ALIGN
        return raw[start : start + n].view(dtype).view(tuple(shape))

    def _zeros(self, shape, dtype):
        return self._empty(shape, dtype).zero_()

    def _to_device(self, a: np.ndarray, dtype):
        a = np.ascontiguousarray(a)
        t = self._empty(a.shape, dtype)
        t.copy_(self.torch.from_numpy(a))
        return t

    def _chunk_addresses(self, inputs: dict[str, Any], outputs: dict[str, Any], a: int, b: int):
        """Addresses of rows a:b of each input and output tensor (row-major, rows first) for one run.

        Rows a:b of a buffer start a * row bytes in, which need not be ALIGN-aligned when a batch runs in
        chunks: such a slice is staged through an aligned scratch tensor, an input's copied in now (the
        staged inputs' scratch tensors are `keep`), an output's copied back after the run (`copy_back`:
        (slice, scratch) pairs, to copy on the stream after the run). Aligned slices, every slice of a
        one-chunk run among them, are bound in place. Called on the backend's stream (`_on_stream`):
        scratch memory freed after the call is reused by the caching allocator only for later work on
        that stream, queued after the run."""
        addresses, keep, copy_back = {}, [], []
        for name, t in {**inputs, **outputs}.items():
            v = t[a:b]
            if v.numel() and v.data_ptr() % ALIGN:
                scratch = self._empty(v.shape, v.dtype)
                if name in inputs:
                    keep.append(scratch.copy_(v))
                else:
                    copy_back.append((v, scratch))
                v = scratch
            addresses[name] = self._ptr(v)
        return addresses, keep, copy_back

    def _sync(self) -> None:
        if self.on_cuda:
            self.stream.synchronize()

    # -- encoder ----------------------------------------------------------------------------------
    def encode(self, src_ids: np.ndarray, src_lengths: np.ndarray) -> _Encoded:
        src_ids = np.ascontiguousarray(src_ids, np.int64)
        batch, src_len = src_ids.shape
        chunks = choose_chunks(batch, self.plan.encoder, src_len)
        d, h, dh = self.config.d_model, self.heads, self.head_dim
        dt = self._enc.dtypes
        with self._on_stream():
            ids = self._to_device(src_ids, dt["src_ids"])
            lens = self._to_device(np.asarray(src_lengths, np.int64), dt["src_lengths"])
            outs = {"memory": self._empty((batch, src_len, d), dt["memory"])}
            for name in self.cross_names:
                outs[name] = self._empty((batch, h, src_len, dh), dt[name])
            for a, b, prof in chunks:
                n = b - a
                shapes = {"src_ids": (n, src_len), "src_lengths": (n,)}
                out_shapes = {name: (n,) + tuple(t.shape[1:]) for name, t in outs.items()}
                addresses, keep, copy_back = self._chunk_addresses({"src_ids": ids, "src_lengths": lens}, outs, a, b)
                self._enc.run(prof, shapes, addresses, out_shapes, self.stream_handle)
                for dst, scratch in copy_back:
                    dst.copy_(scratch)
            step_lens = lens
            if lens.dtype != self._step.dtypes["src_lengths"]:
                step_lens = self._empty(lens.shape, self._step.dtypes["src_lengths"]).copy_(lens)
        memory = outs.pop("memory")
        return _Encoded(memory, outs, step_lens, batch, src_len)

    def encoder_outputs(self, enc: _Encoded) -> dict[str, np.ndarray]:
        with self._on_stream():
            out = {"memory": enc.memory.float().cpu().numpy()}
            for name in self.cross_names:
                out[name] = enc.cross[name].float().cpu().numpy()
        return out

    # -- decoding run -----------------------------------------------------------------------------
    def begin(self, enc: _Encoded, row_src: np.ndarray, capacity: int) -> _State:
        cap = max(int(capacity), 1)
        choose_chunks(1, self.plan.decoder_step, enc.src_len, cap)  # refuse a cache the engines cannot take
        rows = len(row_src)
        state = _State(enc=enc, rows=rows, row_cap=0, capacity=cap, row_src=np.array([-1]),
                       slots=SlotTable(np.full(enc.batch, enc.src_len), enc.src_len))
        with self._on_stream():
            self._allocate(state, rows)
        self._gather_cross(state, np.asarray(row_src, np.int64))
        return state

    def _stacked_zeros(self, n: int, shape: tuple[int, ...]):
        """(n, *shape) zeros in one buffer whose n tensors are each contiguous and start 256 bytes apart
        (or a multiple) from an ALIGN-aligned start: TensorRT wants every tensor address ALIGN-aligned
        (the first axis' stride is padded where shape's bytes are not a multiple of ALIGN)."""
        numel = int(np.prod(shape))
        per_align = max(1, ALIGN // self.float_dtype.itemsize)  # elements per ALIGN bytes
        stride = -(-numel // per_align) * per_align
        flat = self._zeros((n * stride,), self.float_dtype)
        return flat.view(n, stride)[:, :numel].unflatten(1, tuple(shape))

    def _allocate(self, state: _State, rows: int) -> None:
        """(Re)allocate every per-row buffer, the cache included, for `rows` rows."""
        torch = self.torch
        state.cache = self._stacked_zeros(len(self.cache_names), (rows, self.heads, state.capacity, self.head_dim))
        state.caches = list(state.cache.unbind(0))  # contiguous views, bound to the engine by address
        dt = self._step.dtypes
        state.outputs = {"log_probs": self._empty((rows, self.vocab), dt["log_probs"])}
        for name in self.new_names:
            state.outputs[name] = self._empty((rows, self.heads, 1, self.head_dim), dt[name])
        state.tokens = self._zeros((rows,), dt["tokens"])
        state.positions = self._zeros((rows,), dt["positions"])
        state.tokens_host = torch.zeros(rows, dtype=dt["tokens"], pin_memory=self.on_cuda)
        state.cross_buf = None  # gathered cross K/V must be gathered again into buffers of the new size
        state.row_src = np.array([-1])
        state.row_cap = rows
        if self.cuda_graph:  # new buffers: the graphs of the old ones must not be replayed
            state.graphs = GraphSet(self._capturer, self.graph_stats, "TensorRT step")

    def _gather_cross(self, state: _State, row_src: np.ndarray) -> None:
        """Bind the encoder's cross K/V for rows decoding sources row_src: as they are where row r decodes
        slot r of the pool, else gathered per row into this run's own buffers (only when the mapping changes)."""
        state.given = row_src = np.asarray(row_src, np.int64)
        slots = state.slots.row_slots(row_src)
        if np.array_equal(slots, state.row_src):
            return
        enc, torch = state.enc, self.torch
        n = len(slots)
        if np.array_equal(slots, np.arange(n)):
            state.cross = {name: enc.cross[name][:n] for name in self.cross_names}
            state.cross["src_lengths"] = enc.src_lengths[:n]
        else:
            with self._on_stream():
                buf = state.cross_buf
                if buf is None or buf["src_lengths"].shape[0] < n or buf[self.cross_names[0]].shape[2] != enc.src_len:
                    rows = max(n, state.row_cap)
                    state.cross_buf = {name: self._empty((rows,) + tuple(enc.cross[name].shape[1:]),
                                                         enc.cross[name].dtype) for name in self.cross_names}
                    state.cross_buf["src_lengths"] = self._empty((rows,), enc.src_lengths.dtype)
                idx = self._to_device(slots, torch.long)
                for name in self.cross_names:
                    torch.index_select(enc.cross[name], 0, idx, out=state.cross_buf[name][:n])
                torch.index_select(enc.src_lengths, 0, idx, out=state.cross_buf["src_lengths"][:n])
            state.cross = state.cross_buf
        state.row_src = slots

    def _step_io(self, state: _State, a: int, b: int):
        """Shapes, addresses and output shapes of the step engine's run over rows a:b (plus the chunk's
        staging, see _chunk_addresses)."""
        n, c, s = b - a, state.capacity, state.enc.src_len
        h, dh = self.heads, self.head_dim
        shapes = {"tokens": (n,), "positions": (n,), "src_lengths": (n,)}
        inputs = {"tokens": state.tokens, "positions": state.positions, "src_lengths": state.cross["src_lengths"]}
        for name, t in zip(self.cache_names, state.caches, strict=True):
            shapes[name] = (n, h, c, dh)
            inputs[name] = t
        for name in self.cross_names:
            shapes[name] = (n, h, s, dh)
            inputs[name] = state.cross[name]
        out_shapes = {"log_probs": (n, self.vocab)}
        out_shapes.update({name: (n, h, 1, dh) for name in self.new_names})
        outputs = {name: state.outputs[name] for name in out_shapes}
        addresses, keep, copy_back = self._chunk_addresses(inputs, outputs, a, b)
        return shapes, addresses, out_shapes, keep, copy_back

    def _launch(self, state: _State, prof: int, shapes, addresses, out_shapes, single_chunk: bool) -> None:
        """Run the step engine once: replayed from a captured CUDA graph where one is valid, else
        execute_async_v3 (cuda_graphs.GraphSet decides; only a run bound in place in one chunk is captured)."""

        def body():
            self._step.run(prof, shapes, addresses, out_shapes, self.stream_handle)

        if not self.cuda_graph:
            body()
            return
        state.graphs.run((prof, freeze(shapes), freeze(addresses)), body, capturable=single_chunk)

    @property
    def cuda_graph(self) -> bool:
        """Whether steps are captured: asked for, on a GPU, and no capture has failed."""
        return self.graph_stats.enabled

    @property
    def graph_captures(self) -> int:
        return self.graph_stats.captures

    @property
    def graph_replays(self) -> int:
        return self.graph_stats.replays

    @property
    def graph_error(self) -> str | None:
        return self.graph_stats.error

    def _run(self, state: _State, tokens: np.ndarray) -> None:
        each = state.row_pos  # None: every row at `position`
        p = state.position if each is None else int(each.max())
        if p >= state.capacity:
            raise IndexError(f"cache capacity {state.capacity} exhausted at position {p}")
        r = state.rows
        tokens = np.asarray(tokens)
        if tokens.shape != (r,):
            raise ValueError(f"expected {r} tokens, got shape {tokens.shape}")
        chunks = choose_chunks(r, self.plan.decoder_step, state.enc.src_len, state.capacity)
        with self._on_stream():
            state.tokens_host[:r].numpy()[:] = tokens
            state.tokens[:r].copy_(state.tokens_host[:r], non_blocking=self.on_cuda)
            if each is None:
                state.positions[:r].fill_(p)
            else:
                state.positions[:r].copy_(self.torch.from_numpy(each).to(state.positions.dtype), non_blocking=False)
            for a, b, prof in chunks:
                shapes, addresses, out_shapes, keep, copy_back = self._step_io(state, a, b)
                # staged (scratch) addresses are new every step: only a run bound in place is captured
                self._launch(state, prof, shapes, addresses, out_shapes, len(chunks) == 1 and not (keep or copy_back))
                for dst, scratch in copy_back:
                    dst.copy_(scratch)
            write_slots(self.torch, state, self.new_names, r, p, each)
        state.position = p + 1
        if each is not None:
            state.row_pos = each + 1

    def step(self, state: _State, tokens: np.ndarray, k: int, ban_eos: bool = False) -> tuple[np.ndarray, np.ndarray]:
        self._run(state, tokens)
        torch = self.torch
        r = state.rows
        with self._on_stream():
            lp = state.outputs["log_probs"][:r]
            lp.index_fill_(1, self._banned[bool(ban_eos)], float("-inf"))  # the buffer is rewritten next step
            vals, ids = torch.topk(lp, min(int(k), self.vocab), dim=-1)
            # one device->host copy: ids < vocab_size < 2**24 are exact in float32
            both = torch.stack([vals.float(), ids.float()]).cpu().numpy()
        return both[0].astype(np.float32), both[1].astype(np.int64)

    def last_log_probs(self, state: _State) -> np.ndarray:
        """The last step's full log-probs (its banned ids at -inf), copied to the host."""
        with self._on_stream():
            return state.outputs["log_probs"][: state.rows].float().cpu().numpy()

    def step_log_probs(self, state: _State, tokens: np.ndarray) -> np.ndarray:
        self._run(state, tokens)
        with self._on_stream():
            return state.outputs["log_probs"][: state.rows].float().cpu().numpy().copy()

    def reorder(self, state: _State, rows: np.ndarray, row_src: np.ndarray) -> None:
        """Row i continues row rows[i]: in place, only the rows whose source changed move, and only their
        filled slots, all layers at once; the sources are gathered before anything is written (a source
        may be a destination too)."""
        torch = self.torch
        rows = np.asarray(rows, np.int64)
        n, p = len(rows), state.position if state.row_pos is None else int(state.row_pos.max())
        with self._on_stream():
            if n > state.row_cap:  # beams expand after step 0: a new cache, gathered into directly
                old, old_rows = state.cache, state.rows
                self._allocate(state, n)
                state.cache.copy_(old[:, :old_rows].index_select(1, self._to_device(rows, torch.long)))
            else:
                moved = np.flatnonzero(rows != np.arange(n))
                if moved.size and p:
                    idx = self._to_device(np.concatenate([moved, rows[moved]]), torch.long)  # one copy to the device
                    move_rows_torch(state.cache, idx[: moved.size], idx[moved.size:], p)
        state.rows = n
        rows_moved(state, rows)
        self._gather_cross(state, np.asarray(row_src, np.int64))

    def admits(self, state: _State, rows: int, src_len: int) -> bool:
        """Whether `rows` sources of src_len tokens join `state` now: the pool widened to them must be a source
        length a step profile takes beside the run's cache (rows are run in chunks: any count fits)."""
        return admits(self, state, src_len)

    def admit(self, state: _State, enc: _Encoded) -> None:
        """New rows at position 0 for `enc`'s sources after the state's, their K/V written into free slots of
        the pool (tensorrt_admit.admit)."""
        admit(self, state, enc)


def open_backend(path: str, spec) -> TensorRTBackend:
    """The registry's loader: the engine directory at `path` on spec.device's GPU (TensorRT runs on CUDA only, so
    the default device cpu means the default GPU; parity keeps its torch reference on the CPU)."""
    from transduce.runtime.devices import parse_device

    _, index = parse_device(spec.device, runs="the tensorrt backend runs")
    return TensorRTBackend(path, device="cuda" if index is None else f"cuda:{index}", cuda_graph=spec.cuda_graph,
                           verify=spec.verify)
