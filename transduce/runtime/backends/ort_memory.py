"""Device memory of the ONNX Runtime backend: the buffers a decoding run binds to its sessions, and the
small operations on them between runs (slot writes, row moves, gathers, top-k).

On the CPU the buffers are numpy arrays (NumpyMemory); with the CUDA or TensorRT execution provider they
are torch CUDA tensors (TorchCudaMemory: the only way here to get device memory and small kernels for the
slot write, the gather and the top-k without a host round trip; torch is imported only then). Both have
the same methods, which the backend calls without knowing which it holds.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np

from transduce.errors import BackendUnavailable
from transduce.formats.dtypes import PRECISION_DTYPES
from transduce.runtime.backends.topk import numpy_topk
from transduce.runtime.backends.torch_cache import move_rows_torch
from transduce.runtime.devices import torch_device


class NumpyMemory:
    """Host buffers for the CPU execution provider, big ones pooled across runs."""

    def __init__(self, precision: str, ort=None):
        if precision == "bf16":
            raise BackendUnavailable("bf16 artifacts cannot be decoded on the CPU onnxruntime backend "
                                     "(numpy has no bfloat16)",
                                     hint="export with --precision fp32 or fp16 for CPU decoding")
        self.dtype = np.dtype(PRECISION_DTYPES[precision])
        self._free: list[np.ndarray] = []  # flat byte buffers of finished runs, largest first
        self._lock = threading.Lock()  # the pool is shared by the parts of a batch decoded at once (shards)
        # Binding goes straight to the IOBinding's native methods with one host OrtDevice made here, which the
        # Python wrapper would resolve from its name at every call (docs/design/onnxruntime-cpu.md, "Device memory").
        # None: the public wrapper (an onnxruntime without these internals, or after a native call refused).
        try:
            self._host = ort.OrtDevice.make("cpu", 0)._get_c_device()
        except Exception:  # noqa: BLE001 - any onnxruntime without this internal keeps the public path
            self._host = None

    # Buffers of at least POOL_MIN_BYTES come from a pool of the memory of earlier runs: first touching fresh
    # pages costs more than reusing them; smaller ones are left to malloc (docs/design/onnxruntime-cpu.md,
    # "Device memory").
    POOL_MIN_BYTES = 1 << 22
    POOL_MAX_BYTES = 1 << 30  # what the pool keeps between runs, at most

    def _pooled(self, shape, dtype, owned):
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if owned is None or nbytes < self.POOL_MIN_BYTES:
            return None
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.nbytes <= 4 * nbytes]
            flat = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes)) if fits else None
        if flat is None:
            flat = np.empty(nbytes, np.uint8)
        owned.append(flat)
        return flat[:nbytes].view(dtype).reshape(shape)

    def free(self, arr, owned):
        """Back to the pool now: a pooled buffer of this run that nothing uses any more."""
        flat = arr.base
        for i, b in enumerate(owned):
            if b is flat:
                with self._lock:
                    self._free.append(owned.pop(i))
                return

    def release(self, owned):
        with self._lock:
            self._free.extend(owned)
            owned.clear()
            self._free.sort(key=lambda b: -b.nbytes)
            total = 0
            for i, b in enumerate(self._free):
                total += b.nbytes
                if total > self.POOL_MAX_BYTES:
                    del self._free[i:]
                    break

    def zeros(self, shape, owned=None):
        a = self._pooled(shape, self.dtype, owned)
        if a is None:
            return np.zeros(shape, self.dtype)
        a.fill(0)
        return a

    def empty(self, shape, dtype=None, owned=None):
        a = self._pooled(shape, dtype or self.dtype, owned)
        return np.empty(shape, dtype or self.dtype) if a is None else a

    def from_numpy(self, a):
        return a

    def to_numpy(self, a):
        return a

    def take(self, a, idx, owned=None):
        out = self.empty((len(idx),) + a.shape[1:], a.dtype, owned)
        # mode="clip": written straight into `out` ("raise" goes through a temporary of its size); the
        # indices are rows of `a` already
        return np.take(a, idx, axis=0, out=out, mode="clip")

    def bind(self, binding, name, arr, is_input):
        assert arr.flags.c_contiguous, name  # bound by pointer
        native = getattr(binding, "_iobinding", None) if self._host is not None else None
        if native is not None:
            try:
                bind = native.bind_input if is_input else native.bind_output
                bind(name, self._host, arr.dtype, list(arr.shape), arr.ctypes.data)
                return
            except Exception:  # noqa: BLE001 - another signature or internal: the public wrapper from now on
                self._host = None
        bind = binding.bind_input if is_input else binding.bind_output
        bind(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)

    def fill(self, buf, values, rows):
        buf[:rows] = values

    def write_slot(self, cache, new, rows, p):
        cache[:, :rows, :, p] = new[:, :rows, :, 0]  # (2L, R, H, Dh) into slot p

    # Below this many bytes moved in all, one fancy-indexing assignment over the whole cache is faster than one
    # per layer's K or V: it saves the per-call overhead (docs/design/onnxruntime-cpu.md, "Device memory").
    MOVE_WHOLE_MAX_BYTES = 1 << 20

    def move_rows(self, cache, dst, src, p):
        if len(dst) * p * cache.strides[3] * cache.shape[0] * cache.shape[2] <= self.MOVE_WHOLE_MAX_BYTES:
            cache[:, dst, :, :p] = cache[:, src, :, :p]
            return
        # one layer's K or V at a time: numpy's fast path for an index array on the first axis (about twice
        # as fast as indexing the second axis of the whole buffer). The right side is gathered first.
        for c in cache:
            c[dst, :, :p] = c[src, :, :p]

    def copy_rows(self, dst, src):
        """dst's first rows take src's whole rows; the rest are zeroed (dst is a fresh buffer, its contents any)."""
        dst[:, : src.shape[1]] = src
        dst[:, src.shape[1]:] = 0

    def copy_slots(self, dst, src, rows: int):
        """The first `rows` rows of dst (2L, R, H, C, Dh), a zeroed buffer with more slots, take src's slots."""
        dst[:, :rows, :, : src.shape[3]] = src[:, :rows]

    def copy_filled(self, dst, src, rows: int, filled: int):
        """The first `rows` rows and `filled` slots of dst (2L, R, H, C, Dh), a zeroed buffer, take src's."""
        dst[:, :rows, :, :filled] = src[:, :rows, :, :filled]

    def put_rows(self, dst, rows, src):
        """Rows `rows` of dst take src's, in place: (n,) lengths, or (n, H, S, Dh) K/V as wide as dst or
        narrower (dst's positions past them zeroed: padding, as the encoder's)."""
        if dst.ndim == 1:
            dst[rows] = src
            return
        width = src.shape[2]
        dst[rows, :, :width] = src
        if width < dst.shape[2]:
            dst[rows, :, width:] = 0

    def write_slots(self, cache, new, rows, positions):
        """Row r's new K/V into its own slot positions[r] (rows at different positions: a running batch)."""
        cache[:, np.arange(rows), :, positions] = new[:, :rows, :, 0].transpose(1, 0, 2, 3)

    def topk(self, log_probs, k, banned):
        log_probs[:, banned] = -np.inf  # our output buffer: overwritten by the next run anyway
        return numpy_topk(log_probs, k, [])


def on_stream(method):
    """A TorchCudaMemory method run with the memory's stream current, and only meanwhile: ORT runs on
    that stream (user_compute_stream), so the cache writes, gathers and reads back are ordered with its
    runs, and the caller's own current stream is left as it was (two backends each keep their own)."""

    @functools.wraps(method)
    def on_stream(self, *args, **kwargs):
        with self.torch.cuda.stream(self.stream):
            return method(self, *args, **kwargs)

    return on_stream


class TorchCudaMemory:
    """CUDA buffers (torch tensors) for the CUDA and TensorRT execution providers; every kernel, copy
    and allocation on the backend's own stream (see on_stream)."""


    def __init__(self, precision: str, index: int = 0):
        try:
            import torch
        except ImportError:
            raise BackendUnavailable("device decoding with onnxruntime needs torch for CUDA buffers") from None
        # a GPU this torch sees (ORT numbers them alike, both following CUDA_VISIBLE_DEVICES), or BackendUnavailable
        torch_device(f"cuda:{index}", error=BackendUnavailable, runs="the onnxruntime backend runs")
        if precision == "bf16":
            raise BackendUnavailable("bf16 artifacts are decoded by the tensorrt backend, not onnxruntime's IO "
                                     "binding", hint="use backend tensorrt, or export fp16/fp32 for onnxruntime",
                                     params=("backend",))
        self.torch = torch
        self.dtype = getattr(torch, PRECISION_DTYPES[precision])
        self.index = index
        self.device = torch.device("cuda", index)
        # ORT runs on this stream (user_compute_stream) and so do our cache writes, gathers and top-k,
        # each made current only while it runs (not set for the thread: that would move the caller's
        # own torch work onto it, and a second backend would take it over for both)
        self.stream = torch.cuda.Stream(self.device)

    # torch's CUDA caching allocator pools device memory already: `owned` is unused
    def release(self, owned):
        owned.clear()

    def free(self, t, owned):
        pass

    @on_stream
    def zeros(self, shape, owned=None):
        return self.torch.zeros(shape, dtype=self.dtype, device=self.device)

    @on_stream
    def empty(self, shape, dtype=None, owned=None):
        dt = self.torch.float32 if dtype is np.float32 or dtype == self.torch.float32 else self.dtype
        return self.torch.empty(shape, dtype=dt, device=self.device)

    @on_stream
    def from_numpy(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)

    @on_stream
    def from_ortvalue(self, v):
        """A device OrtValue -> a torch tensor on the device (copied once, so ORT can free its buffer)."""
        return self.torch.from_dlpack(v).clone()

    @on_stream
    def to_numpy(self, t):
        return t.float().cpu().numpy() if t.dtype == self.torch.bfloat16 else t.cpu().numpy()

    @on_stream
    def take(self, t, idx, owned=None):
        return t.index_select(0, self.from_numpy(np.asarray(idx, np.int64))).contiguous()

    def bind(self, binding, name, t, is_input):
        assert t.is_contiguous(), name  # bound by pointer
        np_dtype = np.dtype(str(t.dtype).removeprefix("torch."))  # float32, float16, int64: numpy's names too
        bind = binding.bind_input if is_input else binding.bind_output
        bind(name, "cuda", self.index, np_dtype, list(t.shape), t.data_ptr())

    @on_stream
    def fill(self, buf, values, rows):
        if isinstance(values, np.ndarray):
            buf[:rows].copy_(self.torch.from_numpy(np.ascontiguousarray(values, np.int64)), non_blocking=True)
        else:
            buf[:rows].fill_(values)

    @on_stream
    def write_slot(self, cache, new, rows, p):
        cache[:, :rows, :, p : p + 1].copy_(new[:, :rows])

    @on_stream
    def move_rows(self, cache, dst, src, p):
        move_rows_torch(cache, self.from_numpy(dst), self.from_numpy(src), p)

    @on_stream
    def copy_rows(self, dst, src):
        dst[:, : src.shape[1]].copy_(src)
        dst[:, src.shape[1]:].fill_(0)

    @on_stream
    def copy_slots(self, dst, src, rows: int):
        dst[:, :rows, :, : src.shape[3]].copy_(src[:, :rows])

    @on_stream
    def copy_filled(self, dst, src, rows: int, filled: int):
        dst[:, :rows, :, :filled].copy_(src[:, :rows, :, :filled])

    @on_stream
    def put_rows(self, dst, rows, src):
        idx = self.from_numpy(np.asarray(rows, np.int64))
        if dst.dim() == 1:
            dst.index_copy_(0, idx, src.to(dst.dtype))
            return
        width = src.shape[2]
        dst[:, :, :width].index_copy_(0, idx, src)  # a view: index_copy_ writes through it
        if width < dst.shape[2]:
            dst[:, :, width:].index_fill_(0, idx, 0)

    @on_stream
    def write_slots(self, cache, new, rows, positions):
        every = self.torch.arange(rows, device=self.device)
        cache[:, every, :, self.from_numpy(positions)] = new[:, :rows, :, 0].transpose(0, 1)

    @on_stream
    def topk(self, log_probs, k, banned):
        log_probs[:, banned] = float("-inf")  # our output buffer: overwritten by the next run anyway
        vals, ids = log_probs.topk(min(k, log_probs.shape[1]), dim=-1)
        return vals.float().cpu().numpy(), ids.cpu().numpy()
