"""The decode thread's admissions: queued requests into the running batch, as DecodeService (service.py) makes them.

Requests join at a step boundary, several at once (one encoder run, one backend admission, a cohort each: beam
requests with the same options share one), held back while too few wait beside a wide batch (TGI's rule), their
sources encoded between two steps. With ServiceOptions.encode_aside, where the backend can (base.EncodesAside: ONNX
Runtime on the CPU) and a batch is running, the group's sources are encoded on a thread of their own (AsideEncoder)
while the decode thread goes on stepping the running rows, and the group joins at the first step boundary after
its encoding is done: the running rows never stall for an arrival's encoder, which takes a core the decode thread
does not use (where none is spare, as on two cores shared with the front end, it costs throughput: not the
default). A request cancelled or past its deadline meanwhile is answered at once, and its rows leave the batch as
soon as they join.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from transduce.errors import TransduceError
from transduce.runtime.backends.base import EncodesAside, has_capability
from transduce.runtime.decoding.running import Admission
from transduce.serve.options import ServeError
from transduce.serve.requests import Request, admission, runs


class AsideEncoder:
    """One thread that encodes admissions' sources beside the decode thread's steps (backend.encode_aside)."""

    def __init__(self, backend: Any):
        self.backend = backend
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="transduce-encoder")

    def submit(self, src_ids, src_lengths) -> concurrent.futures.Future:
        return self._pool.submit(self.backend.encode_aside, src_ids, src_lengths)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def aside_encoder(backend: Any, wanted: bool) -> AsideEncoder | None:
    """The AsideEncoder where it is wanted (ServiceOptions.encode_aside) and the backend encodes aside, else None."""
    if not wanted or not has_capability(backend, EncodesAside) or not backend.encodes_aside:
        return None
    return AsideEncoder(backend)


class Admitting:
    """DecodeService's admissions (a mixin: the service's queue, lock, running batch and failure paths)."""

    # an admission whose sources encode aside: its requests, their cohort runs and admissions, and the encoding
    _aside: tuple[list[Request], list[list[Request]], list[Admission], concurrent.futures.Future] | None = None
    _encoder: AsideEncoder | None = None

    def _may_encode_aside(self) -> bool:
        """Whether a spare core may encode beside the steps now (an engine sharing the cores says no while crowded)."""
        return True

    def _admit(self) -> None:
        """Queued requests into the running batch, oldest first, while their rows fit: all that fit now in one
        admission (one encoder run, one backend admission, a cohort each). The lock is held only to take them
        off the queue: their encoder runs outside it (aside, while the batch steps, where it can)."""
        if self._aside is not None and not self._join_aside():
            return  # its encoder still runs beside the steps: the queue waits for it
        opts, batch = self.options, self.batch
        while True:
            with self._lock:
                if self._running and opts.scheduler != "continuous":
                    return  # static and single: the batch runs to completion first
                if not self._queue or not batch.can_admit(self._queue[0].src):
                    break
                if self._running and self._holds_back():
                    break
                if not self._running and opts.max_wait_ms > 0:
                    waited = (time.monotonic() - self._queue[0].created) * 1000
                    if waited < opts.max_wait_ms and sum(r.rows for r in self._queue) < opts.max_rows:
                        self._lock.wait(timeout=(opts.max_wait_ms - waited) / 1000)
                        return
                group = self._take(batch.reserved_rows())
                if not group:
                    break  # the first waits for rows to be freed
                self._admitting = group
            if self._running and self._encoder is not None and self._may_encode_aside():
                cohort_runs, admissions = self._admissions(group)
                self._aside = (group, cohort_runs, admissions, self._encoder.submit(*batch.sources(admissions)))
                break
            try:
                self._admit_group(group)
            finally:
                self._admitting = []
            if opts.scheduler == "single" and self._running:
                break
        if self.metrics:
            self.metrics.queue_depth.set(len(self._queue))

    def _join_aside(self) -> bool:
        """The admission encoding aside joins the batch once its encoding is done (at once, waiting for it, where
        nothing else runs) -> whether it has (False: it is still encoding)."""
        group, cohort_runs, admissions, encoding = self._aside
        if self._running and not encoding.done():
            return False
        self._aside = None
        try:
            try:
                encoded = encoding.result()
            except Exception as e:  # noqa: BLE001 - only these requests fail: the state was not touched
                for req in group:
                    self._fail(req, ServeError(f"encoding failed: {type(e).__name__}: {e}", 500))
                return True
            self._admit_group(group, (cohort_runs, admissions), encoded)
            for req in group:  # cancelled or past its deadline while it encoded: answered already, its rows go now
                if req.finished.is_set():
                    self._leave_batch(req)
                    if req in self._fresh:  # no first token to time
                        self._fresh.remove(req)
        finally:
            self._admitting = []
        return True

    def _holds_back(self) -> bool:
        """Under the lock, with a batch running: whether the queued requests wait for more to join with (TGI's
        rule): their rows are under join_ratio of the running rows and the oldest has waited under join_steps
        steps. Every admission costs an encoder run and the state's bookkeeping whatever its size: a few at a time
        beside a full batch cost more than the steps they wait."""
        opts, batch = self.options, self.batch
        if not opts.join_ratio or batch.steps - self._queue[0].queued_step >= opts.join_steps:
            return False
        return sum(r.rows for r in self._queue) < opts.join_ratio * batch.rows

    def _take(self, rows: int) -> list[Request]:
        """Off the queue (under the lock), oldest first: the requests whose rows fit beside `rows` taken (the
        first one alone into an empty batch, whatever its rows). One only for the single scheduler, and where the
        backend has fixed ranges (each is checked against the state as it is)."""
        group: list[Request] = []
        one = self.options.scheduler == "single" or self.batch.within
        while self._queue and not (one and group):
            req = self._queue[0]
            if (self._running or group) and rows + req.rows > self.options.max_rows:
                break
            group.append(self._queue.popleft())
            rows += req.rows
        return group

    def _admissions(self, group: list[Request]) -> tuple[list[list[Request]], list[Admission]]:
        """The group's cohort runs (requests.runs) and the Admission of each."""
        cohort_runs = runs(group)
        pad = self.translator.config.pad_id
        return cohort_runs, [admission(run, pad, self._token_listener(run[0])) for run in cohort_runs]

    def _admit_group(self, group: list[Request], made: tuple | None = None, encoded: Any = None) -> None:
        """The requests' cohorts into the running batch at once (made: their cohort runs and admissions, and
        encoded their sources' encoding, where made already); refused whole (nothing changed), each is tried
        alone, so that one that cannot join fails alone."""
        batch = self.batch
        cohort_runs, admissions = made or self._admissions(group)
        try:
            cohorts = batch.admit_many(admissions, encoded)
        except TransduceError as e:  # refused before the state changed (capacity, a backend without admit)
            if len(group) > 1:
                for req in group:
                    self._admit_group([req])
                return
            self._fail(group[0], ServeError(e.args[0], 503, e.hint))
            return
        except Exception as e:  # noqa: BLE001 - the backend failed part way: the batch cannot be trusted
            for req in group:
                self._fail(req, ServeError(f"admitting failed: {type(e).__name__}: {e}", 500))
            self._fail_running(batch.abort(), ServeError(f"decoding failed: {type(e).__name__}", 500))
            return
        for run, cohort in zip(cohort_runs, cohorts, strict=True):
            self._running.add(cohort, run)
            if run[0].options.beam_size == 1:
                self._fresh.extend(run)
        if self.metrics:
            sentences = sum(len(req.todo) for req in group)
            self.metrics.admitted.inc(sentences)
            self.metrics.admission.observe(sentences)

    def _token_listener(self, req: Request):
        """on_tokens for a streamed greedy request (else None): the step's tokens as they are, into the outbox."""
        if req.options.beam_size != 1 or not req.stream or req.sink is None:
            return None

        def on_tokens(sentences, tokens) -> None:
            self._outbox.append((req, "tokens", (sentences.tolist(), tokens.tolist())))

        return on_tokens

    def _leave_batch(self, req: Request) -> None:
        """`req`'s rows out of the running batch now, where it has some (the whole cohort, or its sentences where
        other requests share it)."""
        if self._running.leave(req):
            self.batch.cancel(req.cohort, range(req.start, req.start + len(req.todo)) if req.cohort in self._running
                              else None)
            if self.metrics:
                self.metrics.live_rows.set(self.batch.rows)
