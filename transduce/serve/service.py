"""The decode service: a bounded queue of requests and one decode thread driving a running batch over one backend.

A request's sentences are checked and tokenized by the caller (translator.prepare: the command line's messages),
then wait in the queue; the decode thread admits them as one cohort into the running batch at the next step
boundary where its rows fit (`max_rows`, counting the k rows a beam takes), steps every live row, and hands each
finished sentence to its request. Deadlines and cancellations (a client that left) are seen at every step
boundary: the request's rows leave the batch at once. Nothing a request carries reaches the decode thread
unchecked, and an error inside a step fails the requests then running (never anyone else's), after which the
thread goes on with a fresh batch.

Events reach a request's `listener(kind, data)` on the decode thread: "token" (greedy: sentence, token id,
text so far), "translation" (sentence, Translation), "done" (None) or "error" (a ServeError). The HTTP layer
turns them into its answers; it must not block.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from transduce.errors import InputError, TransduceError
from transduce.runtime.backends.base import alignment_layer, require_attention
from transduce.runtime.decoding import DecodingOptions
from transduce.runtime.decoding.options import documented
from transduce.runtime.decoding.running import RunningBatch
from transduce.runtime.prefixes import prefix_ids
from transduce.runtime.translator import Score, Translation, Translator, _sentences

Listener = Callable[[str, Any], None]
SCHEDULERS = ("continuous", "static", "single")
OPTION_FIELDS = DecodingOptions.names()  # a request's decoding options: DecodingOptions' fields
SCORE_OPTION_FIELDS = ("length_penalty", "length_penalty_form")  # the options a score request reads


class ServeError(TransduceError):
    """A request the service cannot answer with translations: `status` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int, hint: str | None = None, *, retry_after: float | None = None):
        super().__init__(message, hint)
        self.status = status
        self.retry_after = retry_after


@dataclass(frozen=True)
class ServiceOptions:
    max_rows: int = documented(256, "Decoding rows at once in the running batch (a beam of k takes k per sentence).")
    max_queue: int = documented(64, "Requests waiting for rows; past it the server answers 429 with Retry-After.")
    max_wait_ms: float = documented(0.0, "An idle batch waits this long after an arrival for others to start with it.")
    max_sentences: int = documented(64, "Sentences per request, at most.")
    request_timeout: float = documented(60.0, "Seconds a request may take when it names no timeout of its own (504 "
                                           "past it).")
    # None: the model's (its decoding defaults: an imported model's framework's, else the paper's 4)
    default_beam_size: int | None = documented(None, "Beam size of requests that name none (1 = greedy; not given: "
                                                     "the model's default, 4 for a model transduce trained).")
    scheduler: str = documented("continuous", "continuous: admit sentences at every decoder step; static: only into an "
                                           "empty batch, run to completion (a dynamic batcher's way); single: one "
                                           "request at a time. The last two are for comparison (transduce loadtest).",
                             choices=SCHEDULERS)

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise InputError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}",
                             params=("scheduler",))
        for name in ("max_rows", "max_queue", "max_sentences", "default_beam_size"):
            v = getattr(self, name)
            if v is None and name == "default_beam_size":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{name} must be an integer >= 1, got {v!r}", params=(name,))
        for name in ("max_wait_ms", "request_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise InputError(f"{name} must be a number >= 0, got {v!r}", params=(name,))
        if not self.request_timeout > 0:  # every request would time out at once
            raise InputError(f"request_timeout must be a number of seconds > 0, got {self.request_timeout!r}",
                             params=("request_timeout",))
        if self.default_beam_size is not None and self.default_beam_size > self.max_rows:
            # a request naming no beam could never be decoded
            raise InputError(f"default_beam_size {self.default_beam_size} takes more rows than max_rows "
                             f"({self.max_rows}) holds: every request naming no beam would be refused",
                             hint="a smaller default beam, or more rows", params=("default_beam_size", "max_rows"))


class Request:
    """One client's sentences on their way through the service (fields written by the decode thread)."""

    _ids = itertools.count(1)

    def __init__(self, n: int, options: DecodingOptions, timeout: float, listener: Listener | None):
        self.id = next(self._ids)
        self.options = options
        self.created = time.monotonic()
        self.timeout = timeout  # seconds it may take, as asked
        self.deadline = self.created + timeout  # time.monotonic() past which it is dropped
        self.listener = listener
        self.first_token: float | None = None  # when its first token (or result) was produced
        self.translations: list[Translation | None] = [None] * n
        self.todo: list[int] = []  # its sentences the model decodes (the others are blank)
        self.src: np.ndarray | None = None
        self.lens: np.ndarray | None = None
        self.prepared: list = []
        self.texts: list[str] = []  # its sentences as given (replace_unknowns reads their tokens' text)
        self.prefixes: list[list[int]] | None = None  # each sentence's target prefix (token ids), if given
        self.cohort = None
        self.error: ServeError | None = None
        self.finished = threading.Event()

    @property
    def rows(self) -> int:
        """The most rows it takes in the running batch."""
        return len(self.todo) * (1 if self.options.beam_size == 1 else self.options.beam_size)

    def emit(self, kind: str, data: Any) -> None:
        if self.listener is not None:
            self.listener(kind, data)


class DecodeService:
    def __init__(self, translator: Translator, options: ServiceOptions | None = None, metrics=None):
        self.translator = translator
        self.options = options or ServiceOptions()
        self.metrics = metrics  # a ServeMetrics, or None
        # what a request's options go over: the model's defaults, with the server's default beam if it sets one
        self.defaults = translator.defaults
        if self.options.default_beam_size is not None:
            self.defaults = dataclasses.replace(self.defaults, beam_size=self.options.default_beam_size,
                                                nbest=min(self.defaults.nbest, self.options.default_beam_size))
        if self.defaults.beam_size > self.options.max_rows:
            raise InputError(f"the model's default beam size ({self.defaults.beam_size}) takes more rows than "
                             f"max_rows ({self.options.max_rows}) holds: every request naming no beam would be "
                             "refused", hint="set default_beam_size, or more rows",
                             params=("default_beam_size", "max_rows"))
        self.batch = RunningBatch(translator.backend, capacity=translator.config.max_positions)
        self._lock = threading.Condition()
        self._queue: deque[Request] = deque()
        self._cancelled: list[tuple[Request, ServeError]] = []
        self._running: dict[Any, Request] = {}  # cohort -> request
        self._jobs: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []  # run between two steps
        self._ended = False  # the decode thread has failed what it held and is ending
        self._stop = False
        self.draining = False
        self.ready = False
        self.thread_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="transduce-decode", daemon=True)

    # -- the callers' side (any thread but the decode thread) ------------------------------------------------
    def start(self, warmup: bool = True) -> None:
        self._thread.start()
        if warmup:  # one sentence through the whole path before readyz says yes
            self.translate(["warm up"], {"beam_size": 2, "max_len_b": 2})
        self.ready = True

    def alive(self) -> bool:
        return self._thread.is_alive() and self.thread_error is None

    def queue_depth(self) -> int:
        return len(self._queue)

    def submit(self, texts: Any, options: dict | None = None, truncate: bool = False, timeout: float | None = None,
               listener: Listener | None = None, prefixes: Any = None) -> Request:
        """Check and tokenize `texts`, queue them -> the Request (InputError for bad input, ServeError when the
        service cannot take it now)."""
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
            try:
                require_attention(tr.backend)
            except TransduceError as e:
                raise ServeError(e.args[0], 400, e.hint) from None
        prepared = tr.prepare(texts, truncate, warn=False, max_input_length=opts.max_input_length)
        req = Request(len(texts), opts, timeout, listener)
        req.prepared, req.texts = prepared, texts
        if prefixes is not None:
            req.prefixes = prefix_ids(tr.tokenizer, tr.config, prefixes, [len(p[0]) for p in prepared], opts,
                                      field="prefix")
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
        with self._lock:
            if len(self._queue) >= self.options.max_queue:
                if self.metrics:
                    self.metrics.rejected.inc()
                raise ServeError(f"the queue is full ({self.options.max_queue} requests waiting)", 429,
                                 hint="retry later", retry_after=1.0)
            for i, t in enumerate(req.translations):  # blank lines are translated already: said first
                if t is not None:
                    req.emit("translation", {"sentence": i, "translation": t})
            if not req.todo:  # only blank lines: answered at once
                self._finish(req)
                return req
            self._queue.append(req)
            if self.metrics:
                self.metrics.queue_depth.set(len(self._queue))
            self._lock.notify()
        return req

    def decoding_options(self, given: dict) -> DecodingOptions:
        """The request's decoding options (InputError naming the field for an unknown or invalid one)."""
        unknown = sorted(set(given) - set(OPTION_FIELDS))
        if unknown:
            raise InputError(f"unknown option {unknown[0]!r}", hint=f"options: {', '.join(OPTION_FIELDS)}",
                             params=(unknown[0],))
        opts = self.translator.options(given, "the request", self.defaults)
        try:  # the normalisation of the longest translation must be a number (a huge alpha overflows)
            ok = math.isfinite(opts.penalty(self.translator.config.max_positions))
        except OverflowError:
            ok = False
        if not ok:
            raise InputError(f"length_penalty {opts.length_penalty} overflows the length normalisation",
                             hint="use a length penalty of a few units at most", params=("length_penalty",))
        return opts

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
            cut = [r for r in list(self._queue) + list(self._running.values()) if not r.finished.is_set()]
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
        if self.draining or self._stop:
            raise ServeError("the server is shutting down", 503, hint="retry on another replica")
        given = dict(options or {})
        unknown = sorted(set(given) - set(SCORE_OPTION_FIELDS))
        if unknown:
            raise InputError(f"unknown option {unknown[0]!r}", hint=f"options: {', '.join(SCORE_OPTION_FIELDS)}",
                             params=(unknown[0],))
        opts = self.decoding_options(given)
        if not isinstance(truncate, bool):
            raise InputError(f"truncate must be true or false, got {truncate!r}", params=("truncate",))
        sources, targets = list(_sentences(sources, "source")), list(_sentences(targets, "target"))
        if len(sources) > self.options.max_sentences:
            raise InputError(f"source has {len(sources)} sentences; this server takes at most "
                             f"{self.options.max_sentences} per request", params=("source",))
        pairs = self.translator.prepare_pairs(sources, targets, truncate)  # here: only the model's work waits
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._ended:
                raise ServeError("the decode thread has stopped", 503, hint="see the server's log")
            self._jobs.append((lambda: self.translator.score_prepared(pairs, opts), done))
            self._lock.notify()
        return done.result()

    def _run_jobs(self) -> None:
        """The jobs queued for the decode thread, each with its future's result or exception."""
        with self._lock:
            jobs, self._jobs = self._jobs, []
        for job, done in jobs:
            try:
                done.set_result(job())
            except Exception as e:  # noqa: BLE001 - the caller's to raise (an InputError names its pair)
                done.set_exception(e)

    def stop(self, grace: float = 0.0) -> None:
        """Stop admitting; let what runs finish for up to `grace` seconds, fail the rest, end the thread."""
        self.draining = True
        end = time.monotonic() + grace
        while time.monotonic() < end and (self._queue or self._running) and self.alive():
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
                with self._lock:
                    if self._stop:
                        break
                    self._settle_cancellations()
                    self._expire(time.monotonic())
                    if not self._running and not self._queue and not self._jobs:
                        self._lock.wait(timeout=0.05)
                        continue
                    self._admit()
                if self._jobs:
                    self._run_jobs()
                if self._running:
                    self._step()
        except BaseException as e:  # noqa: BLE001 - recorded: healthz and check_health report it
            self.thread_error = e
            raise
        finally:
            self._fail_all(ServeError("the server stopped before this request finished", 503))
            self.batch.abort()  # the backend's buffers back

    def _admit(self) -> None:
        """Queued requests into the running batch, oldest first, while their rows fit (called under the lock)."""
        opts, batch = self.options, self.batch
        if self._running and opts.scheduler != "continuous":
            return  # static and single: the batch runs to completion first
        if not self._running and self._queue and opts.max_wait_ms > 0:
            waited = (time.monotonic() - self._queue[0].created) * 1000
            if waited < opts.max_wait_ms and sum(r.rows for r in self._queue) < opts.max_rows:
                self._lock.wait(timeout=(opts.max_wait_ms - waited) / 1000)
                return
        while self._queue and batch.can_admit():
            req = self._queue[0]
            if self._running and batch.reserved_rows() + req.rows > opts.max_rows:
                break  # it waits for rows to be freed
            self._queue.popleft()
            on_tokens = self._token_listener(req) if req.options.beam_size == 1 and req.listener else None
            try:
                req.cohort = batch.admit(req.src, req.lens, req.options, on_tokens=on_tokens,
                                          keys=np.array(req.todo), prefixes=None if req.prefixes is None else
                                          [req.prefixes[i] for i in req.todo])
            except TransduceError as e:  # refused before the state changed (capacity, a backend without admit)
                self._fail(req, ServeError(e.args[0], 503, e.hint))
                continue
            except Exception as e:  # noqa: BLE001 - the backend failed part way: the batch cannot be trusted
                self._fail(req, ServeError(f"admitting failed: {type(e).__name__}: {e}", 500))
                for cohort in batch.abort():
                    self._fail(self._running.pop(cohort), ServeError(f"decoding failed: {type(e).__name__}", 500))
                continue
            self._running[req.cohort] = req
            if self.metrics:
                self.metrics.admitted.inc(len(req.todo))
            if opts.scheduler == "single":
                break
        if self.metrics:
            self.metrics.queue_depth.set(len(self._queue))

    def _token_listener(self, req: Request):
        tok = self.translator.tokenizer
        eos = self.translator.config.eos_id
        so_far: dict[int, list[int]] = {}

        def on_tokens(sentences: np.ndarray, tokens: np.ndarray) -> None:
            if req.first_token is None:
                self._first_token(req)
            for s, t in zip(sentences.tolist(), tokens.tolist(), strict=True):
                if t == eos:
                    continue
                ids = so_far.setdefault(s, [])
                ids.append(t)
                req.emit("token", {"sentence": req.todo[s], "token": t, "text": tok.decode(ids)})

        return on_tokens

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
            for cohort in batch.abort():
                req = self._running.pop(cohort, None)
                if req is not None:
                    self._fail(req, ServeError(f"decoding failed: {type(e).__name__}: {e}", 500))
            return
        for cohort, e in batch.failed:
            req = self._running.pop(cohort, None)
            if req is not None:
                self._fail(req, ServeError(f"decoding failed: {type(e).__name__}: {e}", 500))
        if self.metrics:
            self.metrics.batch_rows.observe(rows)
            self.metrics.live_rows.set(batch.rows)
        for cohort, s, result in finished:
            req = self._running.get(cohort)
            if req is None:
                continue
            i = req.todo[s]
            req.translations[i] = self.translator.translation(
                result, req.prepared[i], req.texts[i] if req.options.replace_unknowns else None)
            if req.first_token is None:
                self._first_token(req)
            if self.metrics:
                self.metrics.finished.inc()
                self.metrics.tokens.inc(len(result.best.tokens) + result.best.finished)
            req.emit("translation", {"sentence": i, "translation": req.translations[i]})
        for cohort in {c for c, _, _ in finished} - set(batch.cohorts):  # requests whose last sentence finished
            req = self._running.pop(cohort, None)
            if req is not None:
                with self._lock:
                    self._finish(req)

    def _settle_cancellations(self) -> None:
        for req, error in self._cancelled:
            self._drop(req, error)
        self._cancelled.clear()

    def _expire(self, now: float) -> None:
        for req in [r for r in list(self._queue) + list(self._running.values()) if now > r.deadline]:
            if self.metrics:
                self.metrics.timed_out.inc()
            self._drop(req, ServeError(f"the request passed its deadline of {req.timeout:.3g} s", 504,
                                       hint="raise its timeout"))

    def _drop(self, req: Request, error: ServeError) -> None:
        if req in self._queue:
            self._queue.remove(req)
            if self.metrics:
                self.metrics.queue_depth.set(len(self._queue))
        if req.cohort is not None and self._running.pop(req.cohort, None) is not None:
            self.batch.cancel(req.cohort)
            if self.metrics:
                self.metrics.live_rows.set(self.batch.rows)
        self._fail(req, error)

    def _fail(self, req: Request, error: ServeError) -> None:
        if req.finished.is_set():
            return
        req.error = error
        req.finished.set()
        req.emit("error", error)

    def _finish(self, req: Request) -> None:
        if self.metrics:
            self.metrics.latency.observe(time.monotonic() - req.created)
        req.finished.set()
        req.emit("done", None)

    def _fail_all(self, error: ServeError) -> None:
        with self._lock:
            for req in list(self._queue) + list(self._running.values()) + [r for r, _ in self._cancelled]:
                self._fail(req, error)
            self._queue.clear()
            self._running.clear()
            self._cancelled.clear()
            for _, done in self._jobs:
                done.set_exception(error)
            self._jobs.clear()
            self._ended = True  # no job may wait for this thread now
