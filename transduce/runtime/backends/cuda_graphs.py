"""CUDA graphs for the backends that capture their work (TensorRT's step, eager PyTorch's encoder and step).

A graph replays kernels on the addresses they were captured with, in one launch instead of one per kernel.
What the backends share is written here once:
  - `GraphSet`: the graphs of one set of buffers, keyed by what a run binds (shapes, addresses, options).
    A key's first run is a normal one (lazy set-up such as cuBLAS workspaces or TensorRT's shape-dependent
    work must not happen under capture), its second is captured and replayed, every later one replayed. A
    run that cannot be captured (rows staged through scratch memory) runs normally and makes the next
    capture wait for another warm run. At most `max_graphs` are kept, the least recently used dropped.
    A capture that fails switches graphs off for the whole backend (`GraphStats`), with a warning, and
    the run goes on without them: a backend never fails a decode because a graph could not be made.
  - `CudaCapturer`: the capture itself, on the backend's own stream.
  - `row_bucket`, `length_bucket`: rounding that lets one capture serve steps whose rows change (beams
    finishing, a running batch admitting) and batches of other shapes.
No framework is imported here: a capturer is handed the backend's torch module and stream, and the tests
hand a double that replays on the CPU (tests/cuda_graph_fake.py).
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

MAX_GRAPHS = 16  # graphs kept per GraphSet (each holds a few kernels' parameters in host and device memory)


def row_bucket(n: int) -> int:
    """Rows a capture is made for: the next power of two up to 64, then the next multiple of 64
    (1, 2, 4, 8, 16, 32, 64, 128, 192, ...): rows that shrink or grow within a bucket replay its graph."""
    if n < 1:
        raise ValueError(f"rows must be >= 1, got {n}")
    if n <= 64:
        return 1 << (n - 1).bit_length()
    return -(-n // 64) * 64


def length_bucket(n: int, step: int, limit: int) -> int:
    """A source length or cache capacity rounded up to a multiple of `step`, at most `limit` (the model's
    max_positions) unless n itself is larger."""
    if n < 1:
        raise ValueError(f"length must be >= 1, got {n}")
    return max(n, min(-(-n // step) * step, limit))


class Graph(Protocol):
    def replay(self) -> None: ...


class Capturer(Protocol):
    def capture(self, body: Callable[[], Any]) -> Graph:
        """Record what `body` issues into a graph, without running it; the capture is ended even when body
        raises (an open capture poisons the stream)."""
        ...


@dataclass
class GraphStats:
    """One backend's graphs: whether it still captures, and what it did (tuning(), tests, the bench)."""

    enabled: bool = True
    captures: int = 0
    replays: int = 0
    error: str | None = None  # why capturing was switched off

    def to_dict(self) -> dict[str, Any]:
        return {"cuda_graph": self.enabled, "graph_captures": self.captures, "graph_replays": self.replays,
                "graph_error": self.error}


class GraphSet:
    """The captured graphs of one set of buffers (see the module's docstring for when a run is captured)."""

    def __init__(self, capturer: Capturer, stats: GraphStats, what: str, max_graphs: int = MAX_GRAPHS,
                 warm_keys: int = 1):
        """warm_keys: how many keys of normal runs are remembered as warm. 1 where a run with another key
        undoes the warm-up (a TensorRT context's input shapes); more where each key has buffers of its own."""
        self.capturer, self.stats, self.what = capturer, stats, what
        self.max_graphs, self.warm_keys = max_graphs, warm_keys
        self._graphs: collections.OrderedDict[Hashable, Graph] = collections.OrderedDict()
        self._warm: collections.OrderedDict[Hashable, None] = collections.OrderedDict()  # keys run normally

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, body: Callable[[], Any], capturable: bool = True) -> None:
        """Issue `body`'s work: replayed from the graph of `key`, captured now, or run as it is."""
        stats = self.stats
        if not (stats.enabled and capturable):
            self._warm.clear()
            body()
            return
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            graph.replay()
            stats.replays += 1
            return
        if key not in self._warm:
            body()
            self._warm[key] = None
            while len(self._warm) > self.warm_keys:
                self._warm.popitem(last=False)
            return
        del self._warm[key]
        try:
            graph = self.capturer.capture(body)
        except Exception as e:  # noqa: BLE001 - any capture failure means: go on without graphs
            stats.enabled = False
            stats.error = f"{type(e).__name__}: {e}"
            warnings.warn(f"the {self.what} could not be captured in a CUDA graph ({stats.error}); continuing "
                          "without CUDA graphs", stacklevel=3)
            body()
            return
        if len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        self._graphs[key] = graph
        stats.captures += 1
        graph.replay()
        stats.replays += 1


class CudaCapturer:
    """Captures on `stream` (a torch.cuda.Stream), into `pool` (the id of a torch.cuda.MemPool the backend
    keeps alive, shared by its graphs: their intermediates die within the graph, so graphs that never run at
    the same time can share the memory; None: each graph its own pool). torch counts a pool's users by its
    live graphs, in the device allocator and (torch 2.11) the pinned host allocator alike: once every graph
    of a pool is gone, the next capture into it fails an internal assert (`use_count > 0`), MemPool or not.
    So a one-op graph is captured into the pool first and held for the capturer's life (`_keeper`).

    Not `with torch.cuda.graph(...)`: its entry synchronizes the device and empties torch's caching allocator
    (torch.cuda.empty_cache) on every capture, and backends capture again whenever a bucket is new, so every
    later allocation would go back to cudaMalloc. "thread_local": CUDA calls of other threads (another
    backend, a data loader) during the capture neither fail it nor are captured."""

    def __init__(self, torch, stream, pool=None):
        self.torch, self.stream, self.pool = torch, stream, pool
        self._keeper: tuple | None = None  # (graph, its tensor): the pool's user that is never dropped

    def capture(self, body: Callable[[], Any]) -> Graph:
        if self.pool is not None and self._keeper is None:
            tick = self.torch.zeros(1, device=self.stream.device)
            self._keeper = (self._capture(lambda: tick.add_(1)), tick)
        return self._capture(body)

    def _capture(self, body: Callable[[], Any]) -> Graph:
        torch = self.torch
        graph = torch.cuda.CUDAGraph()
        self.stream.synchronize()  # the graph starts from finished work, as the warm run left it
        error: BaseException | None = None
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                body()
            except BaseException as e:  # noqa: BLE001 - raised below, once the capture is ended
                error = e
            try:
                graph.capture_end()
            except BaseException as e:  # noqa: BLE001 - an invalidated capture: the first cause is the one to tell
                self._end_allocating(graph)
                error = error or e
        if error is not None:
            raise error
        return graph

    def _end_allocating(self, graph) -> None:
        """After a capture_end that raised, tell torch's allocator the capture is over: it would otherwise go on
        counting it as under way, and its next empty_cache (or out-of-memory retry) fails an internal assert."""
        end = getattr(self.torch._C, "_cuda_endAllocateToPool", None)
        if end is None:
            return
        try:
            end(self.stream.device.index, self.pool if self.pool is not None else graph.pool())
        except Exception:  # noqa: BLE001 - best effort: the capture's own error is what gets raised
            pass
