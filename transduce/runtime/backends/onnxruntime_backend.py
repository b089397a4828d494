"""The ONNX Runtime backend: sessions over an artifact's two graphs, with IO binding onto buffers it owns.

Every tensor the step graph reads or writes lives in a buffer allocated once per decoding run:
the self-attention cache (rows, heads, capacity, head_dim) per layer, the cross-attention K/V
gathered for the current rows, and the outputs (log_probs, new K/V). Inputs and outputs are bound
by pointer (IOBinding), so a step allocates nothing of cache size; after the run the new K/V are
written into slot `position` of the cache. A beam reorder gathers the filled slots of the selected
rows into a second cache buffer and swaps the two.

Device memory: on CPU the buffers are numpy arrays; with the CUDA or TensorRT execution provider
they are torch CUDA tensors (the only way here to get device memory and small kernels for the slot
write, the gather and the top-k without a host round trip; torch is imported only then).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transduce.errors import BackendUnavailable
from transduce.runtime import contract
from transduce.runtime.backends.base import banned_ids, numpy_topk

PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


def _import_ort():
    try:
        import onnxruntime as ort
    except ImportError:
        raise BackendUnavailable(
            "the onnxruntime backend needs the onnxruntime package",
            hint="pip install 'transduce[cpu]' (or onnxruntime-gpu via 'transduce[gpu]')",
        ) from None
    return ort


# Below this much arithmetic per decoding row and step (MFLOP), one intra-op thread is faster than
# two: ONNX Runtime's thread-pool synchronisation costs more than it saves on small matrices.
# Measured on the 2-core CI machine, demo model (0.9 MFLOP/row/step), ms per step at 1 / 2 threads:
# batch 1 greedy 0.39 / 0.75, batch 1 beam 4 0.69 / 1.51, batch 16 greedy 1.15 / 1.88; the base
# shape (46 MFLOP/row/step) is faster with 2 (batch 1 greedy 7.5 vs 9.2 ms).
SMALL_STEP_MFLOP = 5.0


def step_mflop_per_row(config: dict[str, Any]) -> float:
    """Multiply-adds x 2 of one decoder step for one row: the decoder's projections and the logits."""
    d, ff, n = config["d_model"], config["d_ff"], config["decoder_layers"]
    return 2.0 * (n * (4 * d * d + 2 * d * ff) + config["vocab_size"] * d) / 1e6


def intra_op_threads(config: dict[str, Any], budget: int) -> int:
    """Threads to use within a budget (0: ONNX Runtime's default): one for small models."""
    if budget != 1 and step_mflop_per_row(config) < SMALL_STEP_MFLOP:
        return 1
    return budget


@dataclass
class _State:
    enc: dict[str, Any]  # encoder outputs (B rows)
    rows: int  # current number of decoding rows
    capacity: int
    row_src: np.ndarray
    caches: list[Any]  # [past_key_0, past_value_0, ...] each (R_max, H, C, Dh)
    spare: list[Any]  # the second buffer of each cache, for reorders
    cross: dict[str, Any] = field(default_factory=dict)  # name -> (R, ...) gathered cross K/V + src_lengths
    outputs: dict[str, Any] = field(default_factory=dict)  # name -> preallocated output buffer (R_max, ...)
    tokens: Any = None  # (R_max,) int64 input buffers, rewritten in place each step
    positions: Any = None
    bindings: dict = field(default_factory=dict)  # (rows, cache buffer set) -> IOBinding, bound once
    position: int = 0


class OnnxRuntimeBackend:
    name = "onnxruntime"

    def __init__(self, artifact_dir: str | os.PathLike, provider: str = "cpu", threads: int = 0,
                 verify: bool = True, optimization: str = "all", provider_options: dict | None = None):
        ort = _import_ort()
        self.ort = ort
        self.artifact_dir = os.fspath(artifact_dir)
        self.manifest = contract.read_manifest(self.artifact_dir, verify_hashes=verify)
        self.config = self.manifest["model"]
        self.precision = self.manifest["precision"]
        if provider not in PROVIDERS:
            raise BackendUnavailable(f"unknown onnxruntime provider {provider!r}", hint=f"choose one of {sorted(PROVIDERS)}")
        wanted = PROVIDERS[provider]
        if wanted[0] not in ort.get_available_providers():
            raise BackendUnavailable(
                f"{wanted[0]} is not available in this onnxruntime ({ort.get_available_providers()})",
                hint="install onnxruntime-gpu for CUDA/TensorRT providers, or use --device cpu",
            )
        self.provider = provider
        self.on_device = provider != "cpu"
        so = ort.SessionOptions()
        self.threads = intra_op_threads(self.config, threads)
        if self.threads:
            so.intra_op_num_threads = self.threads
            so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = {
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        }[optimization]
        self._mem = _TorchCudaMemory(self.precision) if self.on_device else _NumpyMemory(self.precision)
        enc_opts, dec_opts = self._provider_options(provider, provider_options or {})
        try:
            self.encoder = ort.InferenceSession(os.path.join(self.artifact_dir, contract.ENCODER_FILE), so,
                                                providers=[(p, enc_opts.get(p, {})) for p in wanted])
            self.decoder = ort.InferenceSession(os.path.join(self.artifact_dir, contract.STEP_FILE), so,
                                                providers=[(p, dec_opts.get(p, {})) for p in wanted])
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph classes
            raise BackendUnavailable(f"onnxruntime could not load {self.artifact_dir}: {e}",
                                     hint=contract.REBUILD_HINT.format(out=self.artifact_dir)) from None
        self.n_layers = self.config["decoder_layers"]
        self.heads = self.config["n_heads"]
        self.head_dim = self.config["d_model"] // self.heads
        self.float_dtype = np.dtype(contract.FLOAT_DTYPE[self.precision]) if self.precision != "bf16" else None
        self.cache_names = [f"past_{kv}_{i}" for i in range(self.n_layers) for kv in ("key", "value")]
        self.new_names = [f"new_{kv}_{i}" for i in range(self.n_layers) for kv in ("key", "value")]
        self.cross_names = [f"cross_{kv}_{i}" for i in range(self.n_layers) for kv in ("key", "value")]

    def _provider_options(self, provider: str, user: dict) -> tuple[dict, dict]:
        """Per-session provider options for the encoder and the step session.

        CUDA: TF32 off for fp32 graphs (it breaks fp32 parity on Ampere and newer), and ORT runs on the
        same CUDA stream as the torch ops that write the cache, so they are ordered explicitly.
        TensorRT EP: one explicit optimization profile per graph (without one the EP rebuilds its engine
        whenever cache_len or the row count leaves the shapes it has seen) and an on-disk engine cache.
        Never trt_fp16_enable: the graphs carry their precision, and ORT builds strongly typed networks
        only with it off. `user` ({provider: {option: value}}) overrides all of these.
        """
        if provider == "cpu":
            return user, user
        cuda = {"device_id": "0", "user_compute_stream": str(self._mem.stream.cuda_stream)}
        if self.precision == "fp32":
            cuda["use_tf32"] = "0"
        enc = {"CUDAExecutionProvider": dict(cuda)}
        dec = {"CUDAExecutionProvider": dict(cuda)}
        if provider == "tensorrt":
            from transduce.exporter.engine import derive_profiles, ort_tensorrt_profile_options

            plan = derive_profiles(self.config, profiles="single")
            cache = os.path.join(os.path.expanduser("~"), ".cache", "transduce", "ort-trt",
                                 self.manifest["files"][contract.STEP_FILE]["sha256"][:16])
            base = {"device_id": "0", "trt_engine_cache_enable": "1", "trt_engine_cache_path": cache,
                    "trt_timing_cache_enable": "1", "trt_timing_cache_path": cache,
                    "user_compute_stream": str(self._mem.stream.cuda_stream)}
            enc["TensorrtExecutionProvider"] = {**base, **ort_tensorrt_profile_options(plan.profiles("encoder")[0], "encoder", self.config)}
            dec["TensorrtExecutionProvider"] = {**base, **ort_tensorrt_profile_options(plan.profiles("decoder_step")[0], "decoder_step", self.config)}
        for p, opts in user.items():
            enc.setdefault(p, {}).update(opts)
            dec.setdefault(p, {}).update(opts)
        return enc, dec

    # -- encoder ----------------------------------------------------------------------------------
    def encode(self, src_ids: np.ndarray, src_lengths: np.ndarray) -> dict[str, Any]:
        feeds = {"src_ids": np.ascontiguousarray(src_ids, np.int64), "src_lengths": np.ascontiguousarray(src_lengths, np.int64)}
        if not self.on_device:
            names = [o.name for o in self.encoder.get_outputs()]
            outs = dict(zip(names, self.encoder.run(names, feeds)))
            outs["src_lengths"] = feeds["src_lengths"]
            return outs
        binding = self.encoder.io_binding()
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)
        for o in self.encoder.get_outputs():
            binding.bind_output(o.name, "cuda", 0)
        self.encoder.run_with_iobinding(binding)
        outs = {o.name: self._mem.from_ortvalue(v) for o, v in zip(self.encoder.get_outputs(), binding.get_outputs())}
        binding.clear_binding_outputs()
        outs["src_lengths"] = self._mem.from_numpy(feeds["src_lengths"])
        return outs

    def encoder_outputs(self, enc: dict[str, Any]) -> dict[str, np.ndarray]:
        return {k: self._mem.to_numpy(v).astype(np.float32) for k, v in enc.items() if k != "src_lengths" and k in
                {o.name for o in self.encoder.get_outputs()}}

    # -- decoding run -----------------------------------------------------------------------------
    def begin(self, enc: dict[str, Any], row_src: np.ndarray, capacity: int) -> _State:
        rows = len(row_src)
        cap = max(int(capacity), 1)
        shape = (rows, self.heads, cap, self.head_dim)
        mem = self._mem
        state = _State(
            enc=enc, rows=rows, capacity=cap, row_src=np.array([-1]),
            caches=[mem.zeros(shape) for _ in self.cache_names],
            spare=[mem.zeros(shape) for _ in self.cache_names],
        )
        self._alloc_step_buffers(state, rows)
        self._gather_cross(state, np.asarray(row_src, np.int64))
        return state

    def _alloc_step_buffers(self, state: _State, rows: int) -> None:
        mem = self._mem
        state.outputs = {"log_probs": mem.empty((rows, self.config["vocab_size"]), np.float32)}
        for name in self.new_names:
            state.outputs[name] = mem.empty((rows, self.heads, 1, self.head_dim))
        state.tokens = mem.from_numpy(np.zeros(rows, np.int64))
        state.positions = mem.from_numpy(np.zeros(rows, np.int64))
        state.bindings.clear()

    def _gather_cross(self, state: _State, row_src: np.ndarray) -> None:
        if np.array_equal(row_src, state.row_src):
            return
        enc = state.enc
        mem = self._mem
        for name in self.cross_names:
            state.cross[name] = mem.take(enc[name], row_src)
        state.cross["src_lengths"] = mem.take(enc["src_lengths"], row_src)
        state.row_src = row_src.copy()
        state.bindings.clear()

    def _binding_for(self, state: _State):
        """The IOBinding of the current rows and cache buffer set; every tensor is bound by pointer once.

        The buffers' contents change in place between runs (tokens, positions, cache slots), their
        addresses do not, so a binding is reused until the rows, the cross K/V or the buffers change.
        A beam reorder alternates between two cache buffer sets: two bindings.
        """
        r = state.rows
        key = (r, id(state.caches[0]))
        b = state.bindings.get(key)
        if b is None:
            mem = self._mem
            b = self.decoder.io_binding()
            mem.bind(b, "tokens", state.tokens[:r], True)
            mem.bind(b, "positions", state.positions[:r], True)
            for name, arr in state.cross.items():
                mem.bind(b, name, arr, True)
            for name, arr in zip(self.cache_names, state.caches):
                mem.bind(b, name, arr[:r], True)
            for name, arr in state.outputs.items():
                mem.bind(b, name, arr[:r], False)
            state.bindings[key] = b
        return b

    def _run(self, state: _State, tokens: np.ndarray) -> None:
        p = state.position
        if p >= state.capacity:
            raise IndexError(f"cache capacity {state.capacity} exhausted at position {p}")
        r = state.rows
        mem = self._mem
        mem.fill(state.tokens, tokens, r)
        mem.fill(state.positions, p, r)
        self.decoder.run_with_iobinding(self._binding_for(state))
        for cache, name in zip(state.caches, self.new_names):
            mem.write_slot(cache, state.outputs[name], r, p)
        state.position = p + 1

    def step(self, state: _State, tokens: np.ndarray, k: int, ban_eos: bool = False) -> tuple[np.ndarray, np.ndarray]:
        self._run(state, tokens)
        return self._mem.topk(state.outputs["log_probs"][: state.rows], k, banned_ids(self.config, ban_eos))

    def step_log_probs(self, state: _State, tokens: np.ndarray) -> np.ndarray:
        self._run(state, tokens)
        return self._mem.to_numpy(state.outputs["log_probs"][: state.rows]).copy()

    def reorder(self, state: _State, rows: np.ndarray, row_src: np.ndarray) -> None:
        rows = np.asarray(rows, np.int64)
        if len(rows) > state.caches[0].shape[0]:
            self._grow(state, len(rows))
        p = state.position
        for i in range(len(state.caches)):
            self._mem.gather_rows(state.caches[i], rows, p, state.spare[i])
            state.caches[i], state.spare[i] = state.spare[i], state.caches[i]
        if len(rows) != state.rows:
            state.bindings.clear()
        state.rows = len(rows)
        self._gather_cross(state, np.asarray(row_src, np.int64))

    def _grow(self, state: _State, rows: int) -> None:
        """More rows than allocated (beam expansion after step 0): reallocate once, keep contents."""
        mem = self._mem
        for i, cache in enumerate(state.caches):
            bigger = mem.zeros((rows,) + tuple(cache.shape[1:]))
            mem.copy_rows(bigger, cache)
            state.caches[i] = bigger
            state.spare[i] = mem.zeros(tuple(bigger.shape))
        self._alloc_step_buffers(state, rows)


class _NumpyMemory:
    """Host buffers for the CPU execution provider."""

    def __init__(self, precision: str):
        if precision == "bf16":
            raise BackendUnavailable("bf16 artifacts cannot be decoded on the CPU onnxruntime backend (numpy has no bfloat16)",
                                     hint="export with --precision fp32 or fp16 for CPU decoding")
        self.dtype = np.dtype(contract.FLOAT_DTYPE[precision])

    def zeros(self, shape):
        return np.zeros(shape, self.dtype)

    def empty(self, shape, dtype=None):
        return np.empty(shape, dtype or self.dtype)

    def from_numpy(self, a):
        return a

    def to_numpy(self, a):
        return a

    def take(self, a, idx):
        return np.ascontiguousarray(np.take(a, idx, axis=0))

    def bind(self, binding, name, arr, is_input):
        assert arr.flags.c_contiguous, name  # bound by pointer
        (binding.bind_input if is_input else binding.bind_output)(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)

    def fill(self, buf, values, rows):
        buf[:rows] = values

    def write_slot(self, cache, new, rows, p):
        cache[:rows, :, p] = new[:rows, :, 0]  # (R, H, Dh) into slot p

    def gather_rows(self, src, rows, p, dst):
        # whole rows, filled or not: a contiguous destination is ~9x faster than gathering only the
        # filled slots into a strided one (measured: 32 us vs 282 us for 64 rows of the demo model)
        np.take(src, rows, axis=0, out=dst[: len(rows)], mode="clip")

    def copy_rows(self, dst, src):
        dst[: src.shape[0]] = src

    def topk(self, log_probs, k, banned):
        log_probs[:, banned] = -np.inf  # our output buffer: overwritten by the next run anyway
        return numpy_topk(log_probs, k, [])


class _TorchCudaMemory:
    """CUDA buffers (torch tensors) for the CUDA and TensorRT execution providers."""

    _DT = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

    def __init__(self, precision: str):
        try:
            import torch
        except ImportError:
            raise BackendUnavailable("device decoding with onnxruntime needs torch for CUDA buffers") from None
        if not torch.cuda.is_available():
            raise BackendUnavailable("CUDA is not available here", hint="use --device cpu")
        if precision == "bf16":
            raise BackendUnavailable("bf16 artifacts are decoded by the tensorrt backend, not onnxruntime's IO binding",
                                     hint="use --backend tensorrt, or export fp16/fp32 for onnxruntime")
        self.torch = torch
        self.dtype = getattr(torch, self._DT[precision])
        self.device = torch.device("cuda", 0)
        # ORT runs on this stream (user_compute_stream) and so do our cache writes, gathers and top-k:
        # it becomes the current torch stream of this thread, which orders them without syncs.
        self.stream = torch.cuda.Stream(self.device)
        torch.cuda.set_stream(self.stream)
        self._np_of = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}

    def zeros(self, shape):
        return self.torch.zeros(shape, dtype=self.dtype, device=self.device)

    def empty(self, shape, dtype=None):
        dt = self.torch.float32 if dtype is np.float32 or dtype == self.torch.float32 else self.dtype
        return self.torch.empty(shape, dtype=dt, device=self.device)

    def from_numpy(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)

    def from_ortvalue(self, v):
        """A device OrtValue -> a torch tensor on the device (copied once, so ORT can free its buffer)."""
        return self.torch.from_dlpack(v).clone()

    def to_numpy(self, t):
        return t.float().cpu().numpy() if t.dtype == self.torch.bfloat16 else t.cpu().numpy()

    def take(self, t, idx):
        return t.index_select(0, self.from_numpy(np.asarray(idx, np.int64))).contiguous()

    def bind(self, binding, name, t, is_input):
        assert t.is_contiguous(), name  # bound by pointer
        np_dtype = self._np_of[t.dtype]
        (binding.bind_input if is_input else binding.bind_output)(name, "cuda", 0, np_dtype, list(t.shape), t.data_ptr())

    def fill(self, buf, values, rows):
        if isinstance(values, np.ndarray):
            buf[:rows].copy_(self.torch.from_numpy(np.ascontiguousarray(values, np.int64)), non_blocking=True)
        else:
            buf[:rows].fill_(values)

    def write_slot(self, cache, new, rows, p):
        cache[:rows, :, p : p + 1].copy_(new[:rows])

    def gather_rows(self, src, rows, p, dst):
        idx = self.from_numpy(np.asarray(rows, np.int64))
        dst[: len(rows), :, :p] = src[:, :, :p].index_select(0, idx)

    def copy_rows(self, dst, src):
        dst[: src.shape[0]].copy_(src)

    def topk(self, log_probs, k, banned):
        log_probs[:, banned] = float("-inf")  # our output buffer: overwritten by the next run anyway
        vals, ids = log_probs.topk(min(k, log_probs.shape[1]), dim=-1)
        return vals.float().cpu().numpy(), ids.cpu().numpy()
