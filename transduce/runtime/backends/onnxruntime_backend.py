"""The ONNX Runtime backend: sessions over an artifact's graphs, with IO binding onto buffers it owns.

Every tensor the step graph reads or writes lives in a buffer allocated once per decoding run and bound by
pointer (ort_run.py), so a step allocates nothing of cache size; after a run of the standard step graph
the new K/V are written into slot `position` of the cache. A beam reorder moves, in place, only the rows
whose source row changed and only their filled slots.

Two step graphs. Artifacts of fp32 post-norm models (unless exported with --no-ort-step) carry
decoder_step.ort.onnx besides the standard decoder_step.onnx: the same step with ONNX Runtime's fused
contrib ops, whose attention writes the new K/V into the cache itself (its present_* outputs are bound
onto the cache buffers), which picks the top-k itself, and which reads each source's cross K/V once for
all its beams. On the CPU it serves every row count of such models, of every size (see
transduce/exporter/ort_step.py). `fused=False` keeps to the standard graph; `only_step_graph` pins one of
the two (parity checks each).

On the CPU the backend tunes itself when it loads (ort_cpu_policy.py; why each rule is what it is, with
its measurements, is in docs/design/onnxruntime-cpu.md): a small model gets a one-thread step session and
one with the whole thread budget, and which serves which row count is measured (`wide_steps`); small
encoder runs take a one-thread encoder session; a small model's batch may be decoded in parts at the
same time (`shards`); a server's engines that share the cores run it on fewer threads while more than one of
them decodes (`limit_threads`). `tuning()` reports what it chose.

Device memory (ort_memory.py): numpy arrays on the CPU, torch CUDA tensors with the CUDA or TensorRT
execution provider.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from transduce.errors import BackendUnavailable
from transduce.formats import contract
from transduce.formats.artifact import Artifact, cpu_step_graph
from transduce.formats.dtypes import PRECISION_DTYPES
from transduce.runtime.backends.base import FIRST_CACHE_SLOTS, Backend
from transduce.runtime.backends.ort_cpu_policy import (
    SHARD_MIN_PART_ROWS,
    SHARD_MIN_ROWS,
    WIDE_STEPS,
    bounded_spin,
    encoder_runs,
    intra_op_threads,
    narrow_encoder_run,
    narrow_encoder_tokens,
    pool_spin_us,
    time_one_row,
    wide_from_rows,
    wide_rule,
)
from transduce.runtime.backends.ort_memory import NumpyMemory, TorchCudaMemory
from transduce.runtime.backends.ort_run import LAST_STEP, RunState, SpareRuns, StepLayout
from transduce.runtime.backends.ort_sessions import OPTIMIZATION_LEVELS, PROVIDERS, SessionMaker, gpu_provider_options
from transduce.runtime.backends.ort_threads import ThreadChoices
from transduce.runtime.backends.ort_topk import OrtTopK
from transduce.runtime.backends.topk import ban_bias, banned_ids
from transduce.runtime.checks import check_artifact
from transduce.runtime.devices import parse_device, quota_threads, usable_cpus


def _import_ort():
    try:
        import onnxruntime as ort
    except ImportError:
        raise BackendUnavailable(
            "the onnxruntime backend needs the onnxruntime package",
            hint="pip install 'transduce[cpu]' (or onnxruntime-gpu via 'transduce[gpu]')",
        ) from None
    return ort


class OnnxRuntimeBackend(ThreadChoices, Backend):
    name = "onnxruntime"

    def __init__(self, artifact: str | os.PathLike | Artifact, provider: str = "cpu", threads: int = 0,
                 verify: bool = True, optimization: str = "all", provider_options: dict | None = None,
                 fused: bool = True, wide_steps: str = "auto", shards: bool = True, device_index: int = 0):
        """artifact: its directory, or the Artifact already loaded. device_index: the GPU (CUDA ordinal) the
        CUDA and TensorRT providers, and the buffers, are on. verify: check every file's sha256 against the
        manifest (checks.check_artifact). The other options: registry.OnnxRuntimeOptions."""
        if wide_steps not in WIDE_STEPS:
            raise BackendUnavailable(f"unknown wide_steps {wide_steps!r}",
                                     hint=f"choose one of {', '.join(WIDE_STEPS)}", params=("wide_steps",))
        # the directory's mistakes first (`transduce inspect` runs the same checks): they are what to fix
        # before onnxruntime being missing here matters
        self.artifact = check_artifact(artifact, verify_hashes=verify)
        ort = _import_ort()
        self.ort = ort
        self.config = self.artifact.config
        self.precision = self.artifact.precision
        self.quantization = self.artifact.quantization
        wanted = self._place(provider, device_index)
        if not self.on_device:  # ONNX Runtime's default pool, one thread per core, outgrows a container's quota
            threads = quota_threads(threads)
        if optimization not in OPTIMIZATION_LEVELS:
            raise BackendUnavailable(f"unknown onnxruntime optimization level {optimization!r}",
                                     hint=f"choose one of {', '.join(OPTIMIZATION_LEVELS)}", params=("optimization",))
        self.bounded_spin = bounded_spin(ort)
        self.pool_spin_us = pool_spin_us(self.config, self.bounded_spin)  # idle spinning per pool, us
        self.threads = intra_op_threads(self.config, threads)  # the step's threads at small row counts
        self._encoder_threads = threads
        self.layout = StepLayout.of(self.config)
        # each encoder output's source axis (an encoding in runs pads each run's outputs on it)
        self._src_axis = {t.name: t.axes.index("src_len") for t in contract.encoder_outputs(self.config.decoder_layers)}
        self.float_dtype = np.dtype(PRECISION_DTYPES[self.precision]) if self.precision != "bf16" else None
        self._mem = (TorchCudaMemory(self.precision, self.device_index) if self.on_device
                     else NumpyMemory(self.precision, ort))
        self._sessions = SessionMaker(ort, self.artifact, optimization)
        self._load_sessions(wanted, threads, fused, provider_options or {})
        self._topk: OrtTopK | None = None  # the standard graph's top-k session (made when first needed)
        self._attention = None  # the attention step graph's session (made when alignments are first asked for)
        # the fused graph's top-k inputs: k, and the additive bias banning PAD, BOS (and EOS)
        self._topk_k: dict[int, np.ndarray] = {}
        self._ban_bias = {ban: ban_bias(self.config, ban) for ban in (False, True)}
        self._pinned: str | None = None  # a step graph every row count runs on (only_step_graph)
        self._limit: int | None = None  # intra-op threads meanwhile (limit_threads); None: the whole budget
        self._at = {}  # the sessions run at a limit, by its thread count (ort_sessions.ThreadSessions)
        self._spares = SpareRuns()  # ended one-sentence runs, kept for the next
        self._choose_wide_steps(wide_steps)
        # parts a large enough batch is decoded in (1: never): a small model's (it has a wide step session), on
        # the fused graph, and not for quantized graphs, whose rows' results depend on the rows beside them
        partable = shards and self.fused and self.decoder_wide is not self.decoder and not self.artifact.quantization
        self.shard_count = (threads or usable_cpus()) if partable else 1
        self._shard_views: list[OnnxRuntimeBackend] | None = None  # made when first needed
        self._shard_lock = threading.Lock()

    def _place(self, provider: str, device_index: int) -> list[str]:
        """Check the provider and set where the backend runs: -> the execution providers its sessions ask for."""
        ort = self.ort
        if provider not in PROVIDERS:
            raise BackendUnavailable(f"unknown onnxruntime provider {provider!r}",
                                     hint=f"choose one of {sorted(PROVIDERS)}", params=("provider",))
        wanted = PROVIDERS[provider]
        if wanted[0] not in ort.get_available_providers():
            raise BackendUnavailable(
                f"{wanted[0]} is not available in this onnxruntime ({ort.get_available_providers()})",
                hint="install onnxruntime-gpu for CUDA/TensorRT providers, or decode on device cpu",
                params=("device",),
            )
        if provider != "cpu" and self.artifact.quantization:
            raise BackendUnavailable(
                f"{self.artifact.path} has {self.artifact.quantization} graphs (transduce export --quantize), "
                f"which run on ONNX Runtime's CPU provider only, not {provider}",
                hint="decode it on device cpu, or export again without --quantize for the GPU", params=("device",))
        self.provider = provider
        self.on_device = provider != "cpu"
        self.device_index = device_index if self.on_device else 0
        self.device = f"cuda:{self.device_index}" if self.on_device else "cpu"
        return wanted

    def _load_sessions(self, wanted: list[str], threads: int, fused: bool, provider_options: dict) -> None:
        """The encoder session and the step sessions (a wide one besides for small models on the CPU)."""
        enc_opts, dec_opts = self._provider_options(self.provider, provider_options)
        spin = self.pool_spin_us
        # the encoder always gets the whole budget: it runs over every source token at once
        self.encoder = self._sessions.make(contract.ENCODER_FILE, threads, spin["encoder"],
                                           [(p, enc_opts.get(p, {})) for p in wanted])
        self.encoder_narrow = self.encoder  # for small runs (narrow_encoder_run), made when first needed
        self.fused = fused and self._fused_graph_usable()
        graph = contract.ORT_STEP_FILE if self.fused else contract.STEP_FILE
        self.decoder = self._sessions.make(graph, self.threads, spin["steps"],
                                           [(p, dec_opts.get(p, {})) for p in wanted], unfused=not self.on_device)
        self.decoder_wide = self.decoder
        if self.threads != threads and not self.on_device:
            self.decoder_wide = self._sessions.make(graph, threads, spin["steps"])
        self._standard = None if self.fused else self.decoder  # decoder_step.onnx, when pinned to it

    def _choose_wide_steps(self, wide_steps: str) -> None:
        """The row count from which a step runs on decoder_wide, and how that was decided (`wide_steps`)."""
        self._wide_from = wide_from_rows(self.config)
        self.wide_steps: dict[str, Any] = {"option": wide_steps, "rule": "rows"}
        if self.decoder_wide is self.decoder:
            return
        if wide_steps == "auto":
            self.wide_steps.update(self._time_one_row_steps())
            self.wide_steps["rule"] = wide_rule(self.wide_steps["one_row_us"])
        else:
            self.wide_steps["rule"] = wide_steps
        if self.wide_steps["rule"] == "always":
            self._wide_from = 1

    def _fused_graph_usable(self) -> bool:
        """Whether the step sessions run the artifact's ONNX Runtime step graph (ort_step.py): on the
        CPU provider, when the artifact has one."""
        return not self.on_device and cpu_step_graph(self.artifact.manifest) == contract.ORT_STEP_FILE

    def _provider_options(self, provider: str, user: dict) -> tuple[dict, dict]:
        """Per-session provider options for the encoder and the step session (ort_sessions.gpu_provider_options);
        on the CPU the user's ({provider: {option: value}}) alone."""
        if provider == "cpu":
            return user, user
        return gpu_provider_options(provider, user, self.device_index, self._mem.stream.cuda_stream, self.precision,
                                    self.config, self.artifact.manifest["files"][contract.STEP_FILE]["sha256"])

    def tuning(self) -> dict[str, Any]:
        """What this backend chose when it loaded: threads per session, which step session serves which row
        count (and the one-row timings that decided it), its pools' idle spinning, and when it decodes a batch
        in parts; and the threads it is limited to meanwhile (limit_threads; None: its budget)."""
        return {"threads": self._encoder_threads, "step_threads": self.threads, "inter_op_threads": 1,
                "wide_session": self.decoder_wide is not self.decoder, "wide_from_rows": self._wide_from,
                "wide_steps": copy.deepcopy(self.wide_steps),
                "narrow_encoder_tokens": narrow_encoder_tokens(self.config),
                "bounded_spin": self.bounded_spin, "pool_spin_us": dict(self.pool_spin_us),
                "shard_count": self.shard_count, "shard_min_rows": SHARD_MIN_ROWS,
                "shard_min_part_rows": SHARD_MIN_PART_ROWS, "step_graph": self.step_graphs()[0],
                "thread_limit": self._limit}

    def wide_rows_threshold(self) -> int:
        """Row count from which a step runs on the whole thread budget (decoder_wide)."""
        return self._wide_from

    def _time_one_row_steps(self) -> dict[str, Any]:
        """A one-row step run back to back on the one-thread session and on the budget's (time_one_row), at
        the middle of a 32-slot cache over a 16-token source of zeros: {"one_row_us": {"narrow": us, "wide": us}}."""
        lay, src = self.layout, 16
        position = min(16, self.config.max_positions - 1)  # a slot the positional table has
        enc: dict[str, Any] = {name: self._mem.from_numpy(np.zeros((1, lay.heads, src, lay.head_dim), self.float_dtype))
                               for name in lay.cross_names}
        enc["src_lengths"] = np.array([src], np.int64)
        state = self.begin(enc, np.zeros(1, np.int64), 32)
        try:
            self._mem.fill(state.tokens, self.config.bos_id, 1)
            self._mem.fill(state.positions, position, 1)
            runs = {name: functools.partial(session.run_with_iobinding, self._binding_for(state, session))
                    for name, session in (("narrow", self.decoder), ("wide", self.decoder_wide))}
            return {"one_row_us": time_one_row(runs)}
        finally:
            self.end(state)

    # -- step graphs --------------------------------------------------------------------------------
    def step_graphs(self) -> list[str]:
        """The step graph files this backend decodes with (parity checks each one)."""
        return [contract.ORT_STEP_FILE, contract.STEP_FILE] if self.fused else [contract.STEP_FILE]

    @contextlib.contextmanager
    def only_step_graph(self, graph: str | None) -> Iterator[None]:
        """Meanwhile run every step, whatever its row count, on one step graph (one of step_graphs(); None:
        as the backend chooses)."""
        if graph is not None and graph not in self.step_graphs():
            raise ValueError(f"{graph!r} is not one of this backend's step graphs {self.step_graphs()}")
        before = self._pinned
        self._pinned = before if graph is None else graph
        try:
            yield
        finally:
            self._pinned = before

    def _pinned_to_standard(self) -> bool:
        """Whether an artifact with the fused graph is meanwhile run on the standard one only."""
        return self.fused and self._pinned == contract.STEP_FILE

    def _session_for(self, rows: int):
        if self._pinned_to_standard():
            if self._standard is None:
                self._standard = self._sessions.make(contract.STEP_FILE, self.threads, self.pool_spin_us["steps"])
            return self._standard
        if self._limit is not None:
            sessions = self._at[self._limit]
            return sessions.decoder_wide if rows >= self._wide_from else sessions.decoder
        return self.decoder_wide if rows >= self._wide_from else self.decoder

    def _writes_cache(self, session) -> bool:
        """Whether a step session runs the fused graph (it writes the cache slot itself)."""
        return self.fused and session is not self._standard

    # -- encoder ----------------------------------------------------------------------------------
    def _encoder_for(self, tokens: int):
        """The encoder session for a run over `tokens` source positions: one thread for small runs."""
        if self._encoder_threads == 1 or not narrow_encoder_run(self.config, tokens):
            return self.encoder if self._limit is None else self._at[self._limit].encoder
        return self._one_thread_encoder()

    def _one_thread_encoder(self):
        """The encoder's one-thread session (made once, when first needed; the encoder itself at a budget of 1)."""
        if self.encoder_narrow is self.encoder and self._encoder_threads != 1:
            self.encoder_narrow = self._sessions.make(contract.ENCODER_FILE, 1, 0)
        return self.encoder_narrow

    def encode(self, src_ids: np.ndarray, src_lengths: np.ndarray) -> dict[str, Any]:
        feeds = {"src_ids": np.ascontiguousarray(src_ids, np.int64),
                 "src_lengths": np.ascontiguousarray(src_lengths, np.int64)}
        if not self.on_device:
            # not on quantized graphs: their activations' scales are per run, so a run's rows would encode otherwise
            runs = None if self.quantization else encoder_runs(feeds["src_lengths"])
            return self._encode_cpu(feeds) if runs is None else self._encode_in_runs(feeds, runs)
        binding = self.encoder.io_binding()
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)
        for o in self.encoder.get_outputs():
            binding.bind_output(o.name, "cuda", self.device_index)
        self.encoder.run_with_iobinding(binding)
        outs = {o.name: self._mem.from_ortvalue(v)
                for o, v in zip(self.encoder.get_outputs(), binding.get_outputs(), strict=True)}
        binding.clear_binding_outputs()
        outs["src_lengths"] = self._mem.from_numpy(feeds["src_lengths"])
        return outs

    def _encode_cpu(self, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
        session = self._encoder_for(feeds["src_ids"].size)
        names = [o.name for o in session.get_outputs()]
        outs = dict(zip(names, session.run(names, feeds), strict=True))
        outs["src_lengths"] = feeds["src_lengths"]
        return outs

    def _encode_in_runs(self, feeds: dict[str, np.ndarray], runs: list[np.ndarray]) -> dict[str, Any]:
        """The batch encoded in runs of its rows (ort_cpu_policy.encoder_runs), each padded to its own longest,
        put together as one run's outputs would be, the positions past a run's width zeros (every reader masks
        the positions past a source's length)."""
        src_ids, lengths = feeds["src_ids"], feeds["src_lengths"]
        batch, width = src_ids.shape
        outs: dict[str, Any] = {}
        for rows in runs:
            w = int(lengths[rows].max())
            part = self._encode_cpu({"src_ids": np.ascontiguousarray(src_ids[rows, :w]), "src_lengths": lengths[rows]})
            for name, arr in part.items():
                if name == "src_lengths":
                    continue
                axis = self._src_axis[name]
                if name not in outs:
                    shape = list(arr.shape)
                    shape[0], shape[axis] = batch, width
                    outs[name] = np.zeros(shape, arr.dtype)
                outs[name][(rows,) + (slice(None),) * (axis - 1) + (slice(0, w),)] = arr
        outs["src_lengths"] = lengths
        return outs

    def encoder_outputs(self, enc: dict[str, Any]) -> dict[str, np.ndarray]:
        names = {o.name for o in self.encoder.get_outputs()}
        return {k: self._mem.to_numpy(v).astype(np.float32) for k, v in enc.items()
                if k != "src_lengths" and k in names}

    # -- decoding run -----------------------------------------------------------------------------
    def begin(self, enc: dict[str, Any], row_src: np.ndarray, capacity: int) -> RunState:
        capacity = max(int(capacity), 1)
        # one sentence on the fused graph: a spare run's buffers and bindings (SpareRuns), else new ones that are
        # kept when it ends
        recycle = len(row_src) == 1 and self.fused and not self.on_device and self._pinned is None
        state = self._spares.take(enc, 1, capacity, self.layout.cross_names[0]) if recycle else None
        if state is None:
            if recycle:
                capacity = SpareRuns.capacity(capacity, self.config.max_positions)
            # on the CPU a few slots first, more as positions reach them: a server's runs take the model's
            # max_positions as their capacity, and most sentences end long before it
            slots = None if self.on_device else FIRST_CACHE_SLOTS
            state = RunState.allocate(self.layout, self._mem, enc, len(row_src), capacity, slots)
            state.recyclable = recycle
        self._gather_cross(state, np.asarray(row_src, np.int64))
        return state

    def _gather_cross(self, state: RunState, row_src: np.ndarray) -> None:
        # the fused graph reads each source's cross K/V once for all its beams (ort_run.cross_rows)
        state.gather_cross(row_src, per_source=self.fused and not self._pinned_to_standard())

    def _binding_for(self, state: RunState, session, k: int = 1, ban_eos: bool = False):
        """The IOBinding of the state's current row count on `session` (RunState.binding)."""
        return state.binding(session, self._writes_cache(session), k, ban_eos,
                             self._topk_k.setdefault(k, np.array([k], np.int64)), self._ban_bias[ban_eos])

    def _run(self, state: RunState, tokens: np.ndarray, k: int = 1, ban_eos: bool = False) -> bool:
        """One step; True when it ran the fused graph (its top-k outputs hold this step's k best)."""
        each = state.row_pos  # None: every row at `position`
        p = state.position if each is None else int(each.max())
        if p >= state.capacity:
            raise IndexError(f"cache capacity {state.capacity} exhausted at position {p}")
        state.reserve(p)
        r = state.rows
        mem = self._mem
        mem.fill(state.tokens, tokens, r)
        mem.fill(state.positions, p if each is None else each, r)
        # the previous step's session and binding, while they still apply: a step usually repeats the
        # last one's rows and k, and every Python call costs several microseconds here, right after a
        # run has streamed the weights through the caches (kept in `bindings`, so whatever clears
        # those clears this too)
        key = (r, k, ban_eos, self._pinned, self._limit)
        last = state.bindings.get(LAST_STEP)
        if last is not None and last[0] == key:
            _, session, binding, fused = last
        else:
            session = self._session_for(r)
            binding = self._binding_for(state, session, k, ban_eos)
            fused = self._writes_cache(session)
            state.bindings[LAST_STEP] = (key, session, binding, fused)
        session.run_with_iobinding(binding)
        if not fused and each is None:
            mem.write_slot(state.cache, state.outputs["new"], r, p)
        elif not fused:
            mem.write_slots(state.cache, state.outputs["new"], r, each)
        state.position = p + 1
        if each is not None:
            state.row_pos = each + 1
        return fused

    def step(self, state: RunState, tokens: np.ndarray, k: int, ban_eos: bool = False) -> tuple[np.ndarray, np.ndarray]:
        k = min(k, self.config.vocab_size)
        if self._run(state, tokens, k, ban_eos):
            values, ids = state.topk[k]
            return values[: state.rows].copy(), ids[: state.rows].copy()
        log_probs = state.outputs["log_probs"][: state.rows]
        if k > 1 and not self.on_device:
            if self._topk is None:
                self._topk = OrtTopK(self.ort, self.config, self._ban_bias)
            return self._topk(state.outputs["log_probs"], state.rows, k, ban_eos)
        return self._mem.topk(log_probs, k, banned_ids(self.config, ban_eos))

    def last_log_probs(self, state: RunState) -> np.ndarray:
        """The last step's full log-probs, as its run wrote them (a view on the CPU, valid until the next step)."""
        return self._mem.to_numpy(state.outputs["log_probs"][: state.rows])

    def step_log_probs(self, state: RunState, tokens: np.ndarray) -> np.ndarray:
        self._run(state, tokens)
        return self._mem.to_numpy(state.outputs["log_probs"][: state.rows]).copy()

    # -- attention (alignments) ----------------------------------------------------------------------
    def attention_problem(self) -> str | None:
        if contract.ATTN_STEP_FILE not in self.artifact.manifest["files"]:
            return (f"{self.artifact.path} has no {contract.ATTN_STEP_FILE} (it was exported before transduce "
                    "exported one), which alignments are read from")
        return None

    def step_attention(self, state: RunState, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A step on the attention step graph (contract.ATTN_STEP_FILE), run on numpy feeds gathered from the
        state (a step that asks for alignments is not the fast path), its K/V written into the cache as the
        standard graph's are -> the full log-probs and every layer's head-averaged cross-attention (R, layers, S)."""
        session = self._attention_session()
        each = state.row_pos
        p = state.position if each is None else int(each.max())
        if p >= state.capacity:
            raise IndexError(f"cache capacity {state.capacity} exhausted at position {p}")
        state.reserve(p)
        r, mem, lay = state.rows, self._mem, self.layout
        feeds = {"tokens": np.ascontiguousarray(tokens, np.int64),
                 "positions": np.full(r, p, np.int64) if each is None else np.ascontiguousarray(each, np.int64),
                 **state.of_rows(np.frombuffer(state.row_src_given, np.int64))}  # every row's, as last given
        for i, name in enumerate(lay.cache_names):
            feeds[name] = np.ascontiguousarray(mem.to_numpy(state.cache[i, :r]))
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
        new = mem.from_numpy(np.stack([got[name] for name in lay.new_names]))  # (2L, R, H, 1, Dh)
        if each is None:
            mem.write_slot(state.cache, new, r, p)
        else:
            mem.write_slots(state.cache, new, r, each)
        state.position = p + 1
        if each is not None:
            state.row_pos = each + 1
        return got["log_probs"], got["attention"]

    def _attention_session(self):
        """The attention step graph's session on the CPU, made when first needed."""
        if self._attention is None:
            problem = self.attention_problem()
            if problem:
                raise BackendUnavailable(problem, hint=self.artifact.rebuild_hint())
            self._attention = self._sessions.make(contract.ATTN_STEP_FILE, self.threads, self.pool_spin_us["steps"])
        return self._attention

    def reorder(self, state: RunState, rows: np.ndarray, row_src: np.ndarray) -> None:
        rows = np.asarray(rows, np.int64)
        changed = state.keep_rows(rows)
        state.rows_moved(rows)
        if not self.on_device and not state.recyclable:  # (on a device the cache holds its whole capacity)
            changed = state.trim() or changed
        if changed and self._topk is not None:
            self._topk.bindings.clear()  # they point into the log-probs buffer the state has just given back
        self._gather_cross(state, np.asarray(row_src, np.int64))

    def admit(self, state: RunState, enc: dict[str, Any]) -> None:
        """New rows at position 0 for `enc`'s sources, after the state's (RunState.admit)."""
        state.admit(enc, per_source=self.fused and not self._pinned_to_standard(),
                    most_width=self.config.max_positions)
        if self._topk is not None:
            self._topk.bindings.clear()  # the buffers may have grown

    def end(self, state: RunState) -> None:
        """The run is over: its buffers go back to the pool for the next run (the state is dead)."""
        if self._topk is not None:
            self._topk.bindings.clear()  # they point into buffers that are about to be reused
        if self._pinned is not None or not self._spares.give(state):
            state.release()


def open_backend(path: str, spec) -> OnnxRuntimeBackend:
    """The registry's loader: the artifact at `path` on the execution provider of spec.device (or the options'
    provider), with spec's threads and the backend's own options (registry.OnnxRuntimeOptions)."""
    from transduce.runtime.backends.registry import OnnxRuntimeOptions

    kind, index = parse_device(spec.device, runs="the onnxruntime backend runs")
    options = dataclasses.asdict(spec.options or OnnxRuntimeOptions())
    provider = options.pop("provider") or kind
    if provider != "cpu":  # its CUDA buffers, stream and providers on that GPU ("cuda": the first, as ORT's default)
        options["device_index"] = index or 0
    return OnnxRuntimeBackend(path, provider=provider, threads=spec.threads, verify=spec.verify, **options)
