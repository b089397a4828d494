"""The engine process of `transduce serve --engine process`: the artifact's backend, a running batch and the
decode thread (a DecodeService) in a process of their own, so decoding never waits for the interpreter lock the
HTTP side holds. It is spawned (a fresh interpreter: no torch or ONNX Runtime threads forked), loads the artifact
itself with the server's BackendSpec, and talks to the front end (engine.py) over one pipe in wire.py's plain
frames. The decode thread reads the pipe itself, between two steps (and waits on it when idle): submits (token
ids, options, deadline), cancels, cuts, score and metrics jobs, stop; it sends one frame per step with every
request's events and the queue's depth. No other thread takes the interpreter lock from it, and a submit reaches
the running batch with no thread hand-off. The process ignores SIGINT and SIGTERM (the front end drains, then
tells it to stop) and exits when its parent is gone.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from transduce.serve import wire
from transduce.serve.options import Kept
from transduce.serve.service import DecodeService, Request, ServeError


@dataclass(frozen=True)
class Cores:
    """How engine processes on one CPU share its cores: each loads with the whole thread budget and decodes on it
    while no other engine decodes, and on `crowded` threads while another one does too (SharesCores). `busy` is one
    byte per engine in shared memory, set by each engine's decode thread while it has work."""

    busy: Any  # multiprocessing's shared Array of bytes, one per engine
    index: int  # this engine's byte
    crowded: int  # intra-op threads while another engine decodes


def _remote(events: list) -> None:
    """The sink of a request from the front end: never called (EngineService._flush sends the frames)."""


class EngineService(DecodeService):
    """A DecodeService whose intake is the pipe and whose step messages go down it as frames of request ids and
    plain values."""

    def __init__(self, translator, options, metrics, send, conn):
        super().__init__(translator, options, metrics)
        self.cores: Cores | None = None  # how it shares the cores (set by main: _sharing); None: its own threads
        self._crowded = False  # whether its backend runs on cores.crowded threads now
        self.send = send  # one frame to the front end (thread-safe)
        self.conn = conn  # the pipe from the front end, read by the decode thread only
        self.requests: dict[int, Request] = {}  # the front end's request id -> its request here
        self.seen = 0  # submits received: the front end's queue depth counts those it sent and we had not
        self._told = (0, 0)  # (seen, queue depth) of the last frame
        self._options = Kept()  # submits' options as sent (their values) -> their DecodingOptions
        self._spun = True  # this idle time's polling is done (set again by each message)

    def _intake(self) -> None:
        try:
            while self.conn.poll():
                self.handle(wire.loads(self.conn.recv_bytes()))
        except (EOFError, OSError):  # the front end is gone: nobody waits for anything here
            os._exit(0)
        if self.cores is not None:
            self._share_cores(bool(self._running or self._queue or self._jobs or self._aside))

    def _share_cores(self, busy: bool) -> None:
        """Say whether this engine has work, and run on the crowded thread count while another one has too."""
        cores = self.cores
        cores.busy[cores.index] = busy
        crowded = busy and any(b for i, b in enumerate(cores.busy) if i != cores.index)
        if crowded != self._crowded:
            self._crowded = crowded
            self.translator.backend.limit_threads(cores.crowded if crowded else None)

    def _may_encode_aside(self) -> bool:
        return not self._crowded  # another engine decoding takes the core the encoding would

    def _idle(self) -> None:
        if self.cores is not None:
            self._share_cores(False)
        self._lock.release()  # nobody else takes it here, but a wait never holds it
        try:
            if not self._spun:  # once after each piece of work: polled, not slept on (ServiceOptions.idle_spin_ms)
                self._spun = True
                end = time.monotonic() + self.options.idle_spin_ms / 1000
                while time.monotonic() < end:
                    if self.conn.poll(0):
                        return
            self.conn.poll(0.05)
        except (EOFError, OSError):
            os._exit(0)
        finally:
            self._lock.acquire()

    def handle(self, message: tuple) -> None:
        """One message from the front end, on the decode thread between two steps."""
        self._spun = False  # work: the next idle wait polls first
        kind = message[0]
        if kind == "submit":
            for submit in message[1]:
                self.take(submit)
        elif kind == "cancel":
            req = self.requests.get(message[1])
            if req is not None:
                self.cancel(req, wire.unerror(message[2]))
        elif kind == "cut":
            self.cut(wire.unerror(message[1]))
        elif kind == "score":
            self._score(*message[1:])
        elif kind == "metrics":
            text = self.metrics.exposition()[0] if self.metrics is not None else b""
            self.send(("reply", message[1], True, text))
        elif kind == "stop":
            with self._lock:
                self._stop = True

    def _score(self, job: int, pairs, options: dict) -> None:
        """A score job, here on the decode thread between two steps."""
        try:
            scores = self.translator.score_prepared(pairs, wire.unoptions(options))
            self.send(("reply", job, True,
                       [(s.tokens, s.log_prob, s.score, s.token_log_probs, s.truncated) for s in scores]))
        except Exception as e:  # noqa: BLE001 - the front end raises it for its caller
            self.send(("reply", job, False, wire.error(e)))

    def _options_of(self, given: tuple) -> Any:
        """A submit's DecodingOptions, made (and checked) once per distinct set of values: most requests share a
        few."""
        return self._options.made(given, lambda: wire.unoptions(given))

    def _translated(self, req: Request, i: int, result) -> Any:
        return wire.result(result)  # the front end makes the Translation (detokenising is its work)

    def _flush(self) -> None:
        out, self._outbox = self._outbox, []
        if not self.ready:  # its own warm-up: the front end hears nothing before "ready"
            return
        told = (self.seen, len(self._queue))
        if not out and told == self._told:
            return
        self._told = told
        events = []
        for req, kind, data in out:
            if kind == "done":  # a request that does not stream gets its results with it
                data = [] if req.stream else [(i, t) for i, t in enumerate(req.translations) if t is not None]
            elif kind == "error":
                data = wire.error(data)
            if kind in ("done", "error"):
                self.requests.pop(req.waiter, None)
            events.append((req.waiter, kind, data))
        self.send(("step", *told, events))

    def take(self, message: tuple) -> None:
        """A submit from the front end into the queue (its 429, should the queue have filled meanwhile, sent)."""
        (rid, created, timeout, stream, n, todo, src, lens, prepared, texts, prefixes, options) = message
        req = Request(n, self._options_of(options), timeout, _remote, stream, waiter=rid)
        req.id, req.created, req.deadline = rid, created, created + timeout  # one clock: CLOCK_MONOTONIC
        req.todo, req.src, req.lens, req.prepared, req.prefixes = todo, wire.unarray(src), wire.unarray(lens), \
            prepared, prefixes
        req.texts = texts if texts is not None else [""] * n
        self.requests[rid] = req
        self.seen += 1
        try:
            self._enqueue(req)
        except ServeError as e:
            self.requests.pop(rid, None)
            self.send(("step", self.seen, len(self._queue), [(rid, "error", wire.error(e))]))


def main(conn, path: str, spec, options, metrics: bool, identity, cores: Cores | None = None) -> None:
    """The engine process: load, warm up, say ready (or why it could not), then serve the front end's messages
    until it says stop or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the front end drains
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _watch_parent(os.getppid())
    lock = threading.Lock()

    def send(message: tuple) -> None:
        data = wire.dumps(message)
        with lock:
            conn.send_bytes(data)

    try:
        from transduce.formats.model_dir import TOKENIZER_FILE
        from transduce.runtime.api import load
        from transduce.serve.metrics import ServeMetrics

        translator = load(path, spec)
        service = EngineService(translator, options, ServeMetrics() if metrics else None, send, conn)
        service.cores = _sharing(translator, cores, service.warmup_options())
        service.start()
        info = _info(translator, spec, path, options, identity, TOKENIZER_FILE)
    except BaseException as e:  # noqa: BLE001 - the front end reports it: the command's message and exit 2
        send(("failed", type(e).__name__, wire.error(e)))
        return
    send(("ready", info))
    service._thread.join()  # until the front end says stop (or the decode thread fails: its requests get 503s)
    send(("stopped",))


def _sharing(translator, cores: Cores | None, warmup: dict[str, Any]) -> Cores | None:
    """`cores` where the backend can run on fewer threads and its steps run faster on more, after a warm-up of the
    sessions it runs on while crowded (the first request that meets another engine at work waits for none of
    it); else None, and a backend whose steps run on one thread anyway keeps to the crowded share (the front end
    needs the rest when many requests arrive)."""
    from transduce.runtime.backends.base import SharesCores

    be = translator.backend
    if cores is None or not isinstance(be, SharesCores):
        return None
    be.limit_threads(cores.crowded)
    if not be.threaded_steps:
        return None
    try:
        translator.translate(["warm up"], **warmup)
    finally:
        be.limit_threads(None)
    return cores


def _info(translator, spec, path: str, options, identity, tokenizer_file: str) -> dict[str, Any]:
    """What the front end needs of the loaded model: its config, tokenizer file, identity, backend description and
    whether it gives attention (the 400 for return_attention is the front end's to answer)."""
    import dataclasses

    from transduce.errors import TransduceError
    from transduce.runtime.backends.base import require_attention

    be = translator.backend
    try:
        require_attention(be)
        attention = None
    except TransduceError as e:
        attention = (e.args[0], e.hint)
    with open(be.artifact.file(tokenizer_file), "rb") as f:  # the file as checked (its path may be our own fd)
        tokenizer = f.read()
    return {"config": {f.name: getattr(be.config, f.name) for f in dataclasses.fields(be.config)},
            "tokenizer": tokenizer, "attention": attention,
            "defaults": {name: getattr(translator.defaults, name) for name in translator.defaults.names()},
            "identity": identity(translator, spec, path, options.scheduler) if identity is not None else None,
            "name": be.name,
            "device": str(be.device), "precision": be.precision, "cuda_graph": bool(be.cuda_graph), "pid": os.getpid()}


def _watch_parent(parent: int) -> None:
    """A thread that ends this process once its parent has gone (its parent id changes): never left orphaned,
    even where the pipe's other end is held by someone else."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="transduce-engine-parent", daemon=True).start()
