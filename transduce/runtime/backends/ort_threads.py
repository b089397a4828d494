"""The ONNX Runtime backend's choices of threads on the CPU that change while it decodes: a batch decoded in parts
on one-thread views of the backend (Shards), fewer threads meanwhile while other work shares the cores
(SharesCores), and sources encoded on one thread beside the steps (EncodesAside). A mixin of OnnxRuntimeBackend,
whose sessions and tuning it reads."""

from __future__ import annotations

import copy
import sys
from typing import Any

from transduce.formats import contract
from transduce.runtime.backends.base import Backend
from transduce.runtime.backends.ort_cpu_policy import shard_parts
from transduce.runtime.backends.ort_run import SpareRuns
from transduce.runtime.backends.ort_sessions import ThreadSessions
from transduce.runtime.devices import usable_cpus


class ThreadChoices:
    """limit_threads, shards and their sessions (on an OnnxRuntimeBackend)."""

    _limit: int | None
    threads: int
    _at: dict[int, ThreadSessions]
    _pinned: str | None
    _shard_views: Any
    _shard_lock: Any
    _aside_view: Any = None  # the one-thread view encode_aside runs on (made when first needed)

    @property
    def threaded_steps(self) -> bool:
        """Whether its steps run on more than one thread where it has them (not a small model's: ort_cpu_policy)."""
        return self.threads != 1

    # -- fewer threads meanwhile (SharesCores) ----------------------------------------------------------------
    def limit_threads(self, n: int | None) -> None:
        """Meanwhile run on at most `n` intra-op threads (None: the budget it loaded with), on sessions of their own
        made by the first call that asks for that many (a caller makes them before it is busy); on the CPU only."""
        if n is None or self.on_device or n >= (self._encoder_threads or usable_cpus()):
            self._limit = None
            return
        if n not in self._at:
            self._at[n] = self._sessions_at(n)
        self._limit = n

    def _sessions_at(self, n: int) -> ThreadSessions:
        """The encoder and step sessions of a limit of `n` threads (n below the budget): a small model's one-thread
        step session serves it as it is."""
        graph = contract.ORT_STEP_FILE if self.fused else contract.STEP_FILE
        spin = self.pool_spin_us
        encoder = self._one_thread_encoder() if n == 1 else self._sessions.make(contract.ENCODER_FILE, n,
                                                                                spin["encoder"])
        decoder = self.decoder if self.threads == 1 else self._sessions.make(graph, n, spin["steps"])
        wide = decoder if n == 1 or self.decoder_wide is self.decoder else self._sessions.make(graph, n, spin["steps"])
        return ThreadSessions(encoder, decoder, wide)

    # -- encoding beside the steps (EncodesAside) -------------------------------------------------------------
    @property
    def encodes_aside(self) -> bool:
        """On the CPU: its encoder writes fresh arrays, never a run's buffers (on a GPU both share a stream)."""
        return not self.on_device

    def encode_aside(self, src_ids, src_lengths) -> Any:
        """encode() on the one-thread encoder session, from a thread of the caller's while the decode thread
        steps on its own sessions (a view's: ONNX Runtime runs sessions from several threads at once)."""
        view = self._aside_view
        if view is None:
            with self._shard_lock:
                if self._aside_view is None:
                    self._aside_view = self._one_thread_view()
                view = self._aside_view
        return view.encode(src_ids, src_lengths)

    # -- a batch in parts ---------------------------------------------------------------------------
    def shards(self, batch: int, beam: int) -> list[Backend] | None:
        """One-thread views of this backend that decoding.decode deals a batch out to (ort_cpu_policy.shard_parts:
        a small model's batch of two sentences or more and SHARD_MIN_ROWS rows or more, every part at least
        SHARD_MIN_PART_ROWS rows), or None to decode it whole; never while a step graph is pinned
        (only_step_graph). Offered on the fused step graph only, which gives a row the same results whatever
        rows run beside it, so the parts decode bit for bit as the whole batch would."""
        n = shard_parts(self.shard_count, batch, beam)
        if n < 2 or self._pinned is not None:
            return None
        with self._shard_lock:
            if self._shard_views is None:
                self._shard_views = [self._one_thread_view() for _ in range(self.shard_count)]
        return self._shard_views[:n]

    def _one_thread_view(self) -> ThreadChoices:
        """This backend on its one-thread sessions only: it shares their weights, the memory pool and the top-k
        session with this one and with the other views, and each decodes a part of a batch in its own thread
        (ONNX Runtime runs one session from several threads at once; a one-thread session runs in the caller's)."""
        view = copy.copy(self)
        view.encoder = view.encoder_narrow = self._one_thread_encoder()
        view._encoder_threads = 1
        view._limit = None  # a view runs on one thread already
        view.decoder_wide = self.decoder  # the one-thread step session, at every row count
        view._wide_from = sys.maxsize
        view.threads = 1
        view.shard_count, view._shard_views = 1, None
        view._spares = SpareRuns()  # its own: a view decodes in a thread of its own
        return view
