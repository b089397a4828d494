"""The decode service: a bounded queue of requests and one decode thread driving a running batch over one backend.

A request's sentences are checked and tokenized by the caller (translator.prepare: the command line's messages),
then wait in the queue; the decode thread admits them into the running batch at the next step boundary where
their rows fit (`max_rows`, counting the k rows a beam takes: a cohort per request, beam requests admitted
together with the same options sharing one), steps every live row, and hands each finished sentence to its
request. Deadlines and cancellations (a client that left) are seen at every step boundary: the request's rows
leave the batch at once. Nothing a request carries reaches the decode thread unchecked; an error inside a step
fails the requests then running (never anyone else's), and the thread goes on with a fresh batch.

Messages leave the decode thread once per step: every event of that step in one list per `sink` (the front end's
callable, called on the decode thread; it must not block). An event is (request, kind, data): "done" (None) or
"error" (a ServeError) for every request; one with stream=True also gets "tokens" (greedy: the cohort's sentences
that stepped and their new token ids, EOS included, as two lists) and "translation" ((sentence, Translation)) as
its sentences finish; one that does not stream costs nothing per token. The lock is held only to move requests
between the queue and lists, never across a model call: submit() (in the event loop) waits for no step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from transduce.errors import InputError, TransduceError
from transduce.runtime.backends.base import alignment_layer, require_attention
from transduce.runtime.decoding import DecodingOptions
from transduce.runtime.decoding.running import RunningBatch
from transduce.runtime.translator import Score, Translation, Translator, _sentences
from transduce.serve.admitting import Admitting, aside_encoder
from transduce.serve.options import (
    SCHEDULERS,
    Kept,
    ServeError,
    ServiceOptions,
    options_key,
    request_defaults,
    request_options,
)
from transduce.serve.requests import Event, Request, Sink, UnderWay, deliver, waiting

__all__ = ["SCHEDULERS", "DecodeService", "Request", "ServeError", "ServiceOptions", "Sink"]

FIRST = 0  # the number of a request's first sentence in messages and error bodies: its index in `text`
OPTION_FIELDS = DecodingOptions.names()  # a request's decoding options: DecodingOptions' fields
SCORE_OPTION_FIELDS = ("length_penalty", "length_penalty_form", "source_lang", "target_lang")  # a score request's


class DecodeService(Admitting):
    def __init__(self, translator: Translator, options: ServiceOptions | None = None, metrics=None):
        self.translator = translator
        self.options = options or ServiceOptions()
        self.metrics = metrics  # a ServeMetrics, or None
        self.defaults = request_defaults(translator.defaults, self.options)
        self._made_options = Kept()  # decoding_options' made
        self.batch = RunningBatch(translator.backend, capacity=translator.config.max_positions)
        self._lock = threading.Condition()
        self._queue: deque[Request] = deque()
        self._cancelled: list[tuple[Request, ServeError]] = []
        self._running = UnderWay()  # the requests in the running batch, by cohort
        self._rows_in = 0  # the rows of the requests queued and running (a beam's k per sentence)
        self._admitting: list[Request] = []  # taken off the queue, their encoder running (outside the lock, or aside)
        self._encoder = aside_encoder(translator.backend, self.options.encode_aside)  # None: inline
        self._fresh: list[Request] = []  # admitted since the last step: their first step gives their first token
        self._outbox: list[Event] = []  # this step's events (decode thread only), sent by _flush
        self._jobs: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []  # run between two steps
        self._ended = False  # the decode thread has failed what it held and is ending
        self._stop = self.draining = self.ready = False
        self.thread_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="transduce-decode", daemon=True)

    # -- the callers' side (any thread but the decode thread) ------------------------------------------------
    def start(self, warmup: bool = True) -> None:
        self._thread.start()
        if warmup:  # one sentence through the whole path before readyz says yes
            self.translate(["warm up"], self.warmup_options())
        self.ready = True

    def warmup_options(self) -> dict[str, Any]:
        """The warm-up request's options: a short beam, and a target language where a multilingual model needs one
        and has no default."""
        tok = self.translator.tokenizer
        languages = getattr(tok, "languages", None)
        target = {"target_lang": next(iter(languages))} if languages and not tok.default_target_lang else {}
        return {"beam_size": 2, "max_len_b": 2, **target}

    def alive(self) -> bool:
        return self._thread.is_alive() and self.thread_error is None

    stopped = "decode thread stopped"  # what /healthz says when not alive()

    def queue_depth(self) -> int:
        return len(self._queue)

    def submit(self, texts: Any, options: dict | None = None, truncate: bool = False, timeout: float | None = None,
               sink: Sink | None = None, prefixes: Any = None, *, stream: bool = False, waiter: Any = None) -> Request:
        """Check and tokenize `texts`, queue them -> the Request (InputError for bad input, ServeError when the
        service cannot take it now). Cheap enough for an event loop: tokenizing, and the lock for a moment.
        sink, stream, waiter: see Request; sentences are numbered from FIRST in messages."""
        if self.draining or self._stop:
            raise ServeError("the server is shutting down", 503, hint="retry on another replica")
        texts = list(_sentences(texts, "text"))
        if not texts:
            raise InputError("text is empty: give at least one sentence", params=("text",))
        if len(texts) > self.options.max_sentences:
            raise InputError(f"text has {len(texts)} sentences; this server takes at most {self.options.max_sentences} "
                             "per request", hint="split them over several requests", params=("text",))
        opts = self.decoding_options(options or {})
        timeout = self.options.request_timeout if timeout is None else timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InputError(f"timeout must be a number of seconds > 0, got {timeout!r}", params=("timeout",))
        if not isinstance(truncate, bool):
            raise InputError(f"truncate must be true or false, got {truncate!r}", params=("truncate",))
        tr = self.translator
        if opts.attention:  # alignments the model or backend cannot give: the client's to change (400)
            alignment_layer(opts.alignment_layer, tr.config.decoder_layers)
            self._check_attention()
        prepared = tr.prepare(texts, truncate, FIRST, warn=False, max_input_length=opts.max_input_length,
                              options=opts)
        req = Request(len(texts), opts, timeout, sink, stream, waiter)
        req.prepared, req.texts = prepared, texts
        req.prefixes = tr.target_prefixes(prefixes, prepared, opts, FIRST, field="prefix")  # and the target language
        for i, (text, item) in enumerate(zip(texts, prepared, strict=True)):
            if tr.is_blank(text, item[0]):
                req.translations[i] = tr.translation(None, item)
            else:
                req.todo.append(i)
        if req.rows > self.options.max_rows:
            raise InputError(f"text needs {req.rows} decoding rows ({len(req.todo)} sentences x beam "
                             f"{opts.beam_size}); this server decodes at most {self.options.max_rows} at once",
                             hint="send fewer sentences per request, or a narrower beam", params=("text",))
        if req.todo:
            req.src, req.lens = tr.padded([prepared[i] for i in req.todo])
        return self._enqueue(req)

    def _check_attention(self) -> None:
        """A 400 ServeError unless the backend gives the attention alignments are read from."""
        try:
            require_attention(self.translator.backend)
        except TransduceError as e:
            raise ServeError(e.args[0], 400, e.hint) from None

    def _enqueue(self, req: Request) -> Request:
        """A checked, tokenized request into the queue (a 429 ServeError when it is full); its blank sentences
        are told at once, and a request of blank sentences only is done here."""
        with self._lock:
            queued = len(self._queue)
            if queued >= self.options.max_queue:  # those the next admission takes are not waiting
                rows = [r.rows for r in self._queue]
                queued = waiting(rows, self._rows_in - sum(rows), self.options.max_rows)
            if not self._taken_in(req, queued, self._rows_in + req.rows <= self.options.max_rows):
                return req
            self._rows_in, req.counted = self._rows_in + req.rows, True
            req.queued_step = self.batch.steps
            self._queue.append(req)
            if self.metrics:
                self.metrics.queue_depth.set(len(self._queue))
            self._lock.notify()
        return req

    def _taken_in(self, req: Request, waiting: int, fits: bool) -> bool:
        """Under the lock: the 429 ServeError where `waiting` requests fill the queue and this one would wait too
        (its rows do not `fit` beside those queued and running: a burst the batch takes at once is no overload);
        else its blank sentences told at once -> whether it has sentences to decode (False: blank only)."""
        if waiting >= self.options.max_queue and not fits:
            if self.metrics:
                self.metrics.rejected.inc()
            raise ServeError(f"the queue is full ({self.options.max_queue} requests waiting)", 429,
                             hint="retry later", retry_after=1.0)
        if req.stream and req.sink is not None:  # blank lines are translated already: said first
            said: list[Event] = [(req, "translation", (i, t)) for i, t in enumerate(req.translations) if t is not None]
            if said:
                req.sink(said)
        if not req.todo:  # only blank lines: answered at once
            self._finish(req)
            if req.sink is not None:
                req.sink([(req, "done", None)])
            return False
        return True

    def decoding_options(self, given: dict) -> DecodingOptions:
        """The request's decoding options (InputError naming the field), made once per distinct set given."""
        return self._made_options.made(options_key(given), lambda: request_options(
            self.translator, self.defaults, given, OPTION_FIELDS))

    def cancel(self, req: Request, error: ServeError) -> None:
        """Drop a request (its client left, or its caller gave up) at the next step boundary."""
        with self._lock:
            if not req.finished.is_set():
                self._cancelled.append((req, error))
                self._lock.notify()

    def cut(self, error: ServeError) -> list[Request]:
        """Fail every request queued or under way with `error` at the next step boundary (a server that stops
        before they finish) -> them."""
        with self._lock:
            cut = [r for r in [*self._queue, *self._running.requests(), *self._admitting]
                   if r is not None and not r.finished.is_set()]
            self._cancelled.extend((r, error) for r in cut)
            self._lock.notify()
        return cut

    def translate(self, texts: Any, options: dict | None = None, truncate: bool = False,
                  timeout: float | None = None) -> list[Translation]:
        """Blocking: the translations of `texts` (a ServeError if it failed), for callers in their own thread."""
        req = self.submit(texts, options, truncate, timeout)
        req.finished.wait()
        if req.error is not None:
            raise req.error
        return req.translations  # type: ignore[return-value]

    def score(self, sources: Any, targets: Any, options: dict | None = None, truncate: bool = False) -> list[Score]:
        """Blocking: each target's teacher-forced Score (Translator.score), worked out on the decode thread between
        two steps of the running batch (the backend is the decode thread's alone). options: the length penalty's
        fields only. InputError for bad input, ServeError when the service cannot take it."""
        return self._score_job(*self._score_pairs(sources, targets, options, truncate)).result()

    async def score_async(self, sources: Any, targets: Any, options: dict | None = None,
                          truncate: bool = False) -> list[Score]:
        """score() for an event loop: checked and tokenized on it, then awaited without a thread of its own (as
        many score requests under way as arrive, none holding a worker thread while the decode thread gets to it)."""
        return await asyncio.wrap_future(self._score_job(*self._score_pairs(sources, targets, options, truncate)))

    def _score_pairs(self, sources: Any, targets: Any, options: dict | None, truncate: bool) -> tuple[tuple, Any]:
        """A score request checked and tokenized -> (the pairs, their DecodingOptions) (InputError, ServeError)."""
        if self.draining or self._stop:
            raise ServeError("the server is shutting down", 503, hint="retry on another replica")
        opts = request_options(self.translator, self.defaults, dict(options or {}), SCORE_OPTION_FIELDS)
        if not isinstance(truncate, bool):
            raise InputError(f"truncate must be true or false, got {truncate!r}", params=("truncate",))
        sources, targets = list(_sentences(sources, "source")), list(_sentences(targets, "target"))
        if len(sources) != len(targets):
            raise InputError(f"source has {len(sources)} sentences and target {len(targets)}",
                             hint="give one target per source", params=("target",))
        if len(sources) > self.options.max_sentences:
            raise InputError(f"source has {len(sources)} sentences; this server takes at most "
                             f"{self.options.max_sentences} per request", params=("source",))
        return self.translator.prepare_pairs(sources, targets, truncate, FIRST, opts, warn=False), opts

    def _score_job(self, pairs: tuple[list, list], opts: DecodingOptions) -> concurrent.futures.Future:
        """Translator.score_prepared queued for the decode thread, between two steps -> its future."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._ended:
                raise ServeError("the decode thread has stopped", 503, hint="see the server's log")
            self._jobs.append((lambda: self.translator.score_prepared(pairs, opts), done))
            self._lock.notify()
        return done

    def _run_jobs(self) -> None:
        """The jobs queued for the decode thread, each with its future's result or exception."""
        with self._lock:
            jobs, self._jobs = self._jobs, []
        for job, done in jobs:
            if not done.set_running_or_notify_cancel():  # its caller gave up (a cancelled score request)
                continue
            try:
                done.set_result(job())
            except Exception as e:  # noqa: BLE001 - the caller's to raise (an InputError names its pair)
                done.set_exception(e)

    def stop(self, grace: float = 0.0) -> None:
        """Stop admitting; let what runs finish for up to `grace` seconds, fail the rest, end the thread."""
        self.draining = True
        end = time.monotonic() + grace
        while time.monotonic() < end and (self._queue or self._running or self._admitting) and self.alive():
            time.sleep(0.01)
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    # -- the decode thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                self._intake()
                with self._lock:
                    if self._stop:
                        break
                    cancelled, self._cancelled = self._cancelled, []
                    if not (self._running or self._queue or self._jobs or cancelled or self._aside):
                        self._idle()
                        continue
                for req, error in cancelled:
                    self._drop(req, error)
                self._expire(time.monotonic())
                self._admit()
                if self._jobs:
                    self._run_jobs()
                if self._running:
                    self._step()
                self._flush()
        except BaseException as e:  # noqa: BLE001 - recorded: healthz and check_health report it
            self.thread_error = e
            raise
        finally:
            self._fail_all(ServeError("the server stopped before this request finished", 503))
            self._flush()
            self.batch.abort()  # the backend's buffers back
            if self._encoder is not None:
                self._encoder.close()

    def _intake(self) -> None:
        """Between two steps, before anything else: what arrived for the decode thread (in-process, submit() and
        cancel() put it under the lock already)."""

    def _idle(self) -> None:
        """Nothing to do (under the lock): wait for a submit, a cancellation or a job, or 50 ms."""
        self._lock.wait(timeout=0.05)

    def _emit(self, req: Request, kind: str, data: Any) -> None:
        """An event for `req`'s sink, sent with the rest of this step's (decode thread only)."""
        if req.sink is not None:
            self._outbox.append((req, kind, data))

    def _flush(self) -> None:
        """This step's events out: one call per sink (one sink per front end)."""
        if self._outbox:
            out, self._outbox = self._outbox, []
            deliver(out)

    def _first_token(self, req: Request) -> None:
        req.first_token = time.monotonic()
        if self.metrics:
            self.metrics.ttft.observe(req.first_token - req.created)

    def _step(self) -> None:
        batch = self.batch
        rows = batch.rows
        try:
            finished = batch.step()
        except Exception as e:  # noqa: BLE001 - the running requests fail; the service goes on
            self._fail_running(batch.abort(), ServeError(f"decoding failed: {type(e).__name__}: {e}", 500))
            return
        for req in self._fresh:  # a greedy request's first step gave each of its sentences a token
            if req.first_token is None:
                self._first_token(req)
        self._fresh.clear()
        for cohort, e in batch.failed:
            self._fail_running([cohort], ServeError(f"decoding failed: {type(e).__name__}: {e}", 500))
        if self.metrics:
            self.metrics.batch_rows.observe(rows)
            self.metrics.live_rows.set(batch.rows)
        for cohort, s, result in finished:
            req = self._running.member(cohort, s)
            if req is None:
                continue
            i = req.todo[s - req.start]
            req.translations[i] = self._translated(req, i, result)
            if req.first_token is None:
                self._first_token(req)
            if self.metrics:
                self.metrics.finished.inc()
                self.metrics.tokens.inc(len(result.best.tokens) + result.best.finished)
            if req.stream:
                self._emit(req, "translation", (i, req.translations[i]))
            req.left -= 1
            if not req.left:  # its last sentence
                self._running.leave(req)
                self._finish(req)
                self._emit(req, "done", None)

    def _fail_running(self, cohorts, error: ServeError) -> None:
        for req in self._running.pop(*cohorts):  # cohorts dropped from the batch: each of their requests fails
            self._fail(req, error)

    def _translated(self, req: Request, i: int, result) -> Any:
        """Sentence i's finished DecodeResult as the request keeps and streams it: its Translation."""
        return self.translator.translation(result, req.prepared[i],
                                           req.texts[i] if req.options.replace_unknowns else None)

    def _expire(self, now: float) -> None:
        with self._lock:
            late = [r for r in [*self._queue, *self._running.requests(), *self._admitting]
                    if now > r.deadline and not r.finished.is_set()]  # one answered while it encodes aside waits
        for req in late:
            if self.metrics:
                self.metrics.timed_out.inc()
            self._drop(req, ServeError(f"the request passed its deadline of {req.timeout:.3g} s", 504,
                                       hint="raise its timeout"))

    def _drop(self, req: Request, error: ServeError) -> None:
        with self._lock:
            if queued := req in self._queue:
                self._queue.remove(req)
        if queued and self.metrics:
            self.metrics.queue_depth.set(len(self._queue))
        self._leave_batch(req)
        self._fail(req, error)

    def _fail(self, req: Request, error: ServeError) -> None:
        """Decode thread only: `req` ends with `error` (told with this step's events)."""
        if req.finished.is_set():
            return
        req.error = error
        self._finish(req, False)
        self._emit(req, "error", error)

    def _finish(self, req: Request, done: bool = True) -> None:
        if self.metrics and done:
            self.metrics.latency.observe(time.monotonic() - req.created)
        if req.counted:  # its rows no longer queued nor running
            with self._lock:
                self._rows_in, req.counted = self._rows_in - req.rows, False
        req.finished.set()

    def _fail_all(self, error: ServeError) -> None:
        with self._lock:
            held = [*self._queue, *self._running.requests(), *self._admitting, *(r for r, _ in self._cancelled)]
            self._queue.clear()
            self._running.clear()
            self._cancelled.clear()
            for _, done in self._jobs:
                if not done.done():  # (one whose caller gave up is cancelled already)
                    done.set_exception(error)
            self._jobs.clear()
            self._ended = True  # no job may wait for this thread now
        for req in held:
            self._fail(req, error)
