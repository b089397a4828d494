"""The front end's side of `transduce serve --engine process`: a DecodeService whose decode thread, running batch
and backend are in an engine process of their own (engine_core.py), so decoding never waits for the interpreter
lock that HTTP, JSON, tokenizing and detokenizing hold here.

EngineClient keeps DecodeService's intake (submit's checks and tokenizing, the options, score's checks) and
replaces its queue: a checked request goes down the pipe as token ids and plain fields (wire.py), and one reader
thread takes the engine's frames (one per decode step, every request's events by id), makes the Translations from
the token ids and hands the step's events to the requests' sinks, exactly as the decode thread does in-process.
The queue's depth for the 429 is the engine's last reported depth plus the submits it had not yet seen. The engine
process dying makes alive() false (healthz 503) and fails every request under way with a 503.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import multiprocessing
import threading
import time
from typing import Any

from transduce.errors import TransduceError
from transduce.runtime.decoding import DecodingOptions
from transduce.runtime.translator import Score, Translator
from transduce.serve import engine_core, wire
from transduce.serve.options import request_defaults
from transduce.serve.requests import deliver
from transduce.serve.service import DecodeService, Event, Request, ServeError, ServiceOptions

START_TIMEOUT_S = 600.0  # loading and warming up a large artifact on a slow disk


class EngineFailed(TransduceError):
    """The engine process could not load the artifact, or ended."""


class RemoteBackend:
    """The engine process's backend as the front end's Translator sees it: its description, no model."""

    artifact = None

    def __init__(self, info: dict[str, Any], config):
        self.name, self.device, self.precision, self.cuda_graph = (info["name"], info["device"], info["precision"],
                                                                   info["cuda_graph"])
        self.config = config

    def _elsewhere(self, *args, **kwargs):
        raise RuntimeError("the model runs in the engine process, not the front end")

    encode = begin = step = reorder = end = _elsewhere


class EngineClient(DecodeService):
    """A DecodeService over an engine process (see the module): start() spawns it and waits until it is warm."""

    def __init__(self, path: str, spec, options: ServiceOptions | None = None, metrics=None, identity=None):
        # no running batch nor decode thread here: DecodeService.__init__ is not run
        self.path, self.spec, self.options, self.metrics = path, spec, options or ServiceOptions(), metrics
        self.identity_of, self.identity = identity, None
        self.translator: Translator | None = None
        self.draining = self.ready = self._stop = False
        self.thread_error: BaseException | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._requests: dict[int, Request] = {}  # under way in the engine, by id
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._jobs_ids = itertools.count(1)
        self._sent = self._seen = self._depth = 0
        self._attention: tuple | None = None
        self.process = self._conn = self._reader = None
        self.pid: int | None = None

    # -- starting and stopping -----------------------------------------------------------------------------
    def start(self, warmup: bool = True) -> None:
        ctx = multiprocessing.get_context("spawn")  # never forked: the parent may hold torch's or ORT's threads
        self._conn, theirs = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=engine_core.main, name="transduce-engine", daemon=True,
                                   args=(theirs, self.path, self.spec, self.options, self.metrics is not None,
                                         self.identity_of))
        self.process.start()
        theirs.close()
        # the engine ignores SIGTERM, which is how multiprocessing ends daemonic children at exit: ended here first
        atexit.register(self._kill)
        try:
            self._started()
            if warmup:  # the whole path, both processes, once before readyz says yes
                self.translate(["warm up"], self.warmup_options())
        except BaseException:
            self._kill()
            raise
        self.ready = True

    def _started(self) -> None:
        from transduce.formats.model_config import ModelConfig

        info = self._await_ready()
        self.pid, self.identity, self._attention = info["pid"], info["identity"], info["attention"]
        config = ModelConfig(**info["config"])
        self.translator = Translator(RemoteBackend(info, config), _tokenizer(info["tokenizer"]),
                                     defaults=DecodingOptions(**info["defaults"]))  # the model's, as loaded there
        self.defaults = request_defaults(self.translator.defaults, self.options)
        self._reader = threading.Thread(target=self._read, name="transduce-engine-reader", daemon=True)
        self._reader.start()

    def _kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)

    def _await_ready(self) -> dict[str, Any]:
        end = time.monotonic() + START_TIMEOUT_S
        while not self._conn.poll(0.1):
            if not self.process.is_alive():
                raise EngineFailed(f"the engine process exited with {self.process.exitcode} while loading",
                                   hint="see the messages above")
            if time.monotonic() > end:
                self.process.kill()
                raise EngineFailed(f"the engine process was not ready in {START_TIMEOUT_S:g} s")
        message = wire.loads(self._conn.recv_bytes())
        if message[0] == "failed":  # the engine's own error (a bad artifact: exit 2), with its message and hint
            self.process.join(timeout=10)
            _, kind, (_, text, hint, params, _, _) = message
            from transduce import errors

            cls = getattr(errors, kind, None)
            try:
                error = cls(text, hint, params=params)
            except TypeError:  # not one of transduce's errors, or one with a signature of its own
                error = EngineFailed(f"the engine process failed to load: {text}", hint)
            if not isinstance(error, TransduceError):
                error = EngineFailed(f"the engine process failed to load: {text}", hint)
            raise error
        return message[1]

    stopped = "engine process stopped"  # what /healthz says when not alive()

    def alive(self) -> bool:
        return (self.process is not None and self.process.is_alive() and self._reader is not None
                and self._reader.is_alive() and self.thread_error is None)

    def stop(self, grace: float = 0.0) -> None:
        """Stop admitting; let what runs finish for up to `grace` seconds, then stop the engine process (the
        requests still under way get its 503)."""
        self.draining = True
        end = time.monotonic() + grace
        while time.monotonic() < end and self._requests and self.alive():
            time.sleep(0.01)
        self._stop = True
        if self.process is None:
            return
        if self.process.is_alive():
            try:
                self._send(("stop",))
            except OSError:
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=10)
        atexit.unregister(self._kill)

    # -- the intake's end: requests and jobs down the pipe -------------------------------------------------
    def queue_depth(self) -> int:
        return self._depth + self._sent - self._seen

    def _check_attention(self) -> None:
        if self._attention is not None:
            raise ServeError(self._attention[0], 400, self._attention[1])

    def _enqueue(self, req: Request) -> Request:
        with self._lock:
            self._check_running()
            if not self._taken_in(req, self.queue_depth()):
                return req
            self._requests[req.id] = req
            self._sent += 1
            texts = req.texts if req.options.replace_unknowns else None
            self._send(("submit", req.id, req.created, req.timeout, req.stream, len(req.translations), req.todo,
                        wire.array(req.src), wire.array(req.lens), req.prepared, texts, req.prefixes,
                        wire.options(req.options)))
        return req

    def cancel(self, req: Request, error: ServeError) -> None:
        if not req.finished.is_set() and self.alive():
            self._send(("cancel", req.id, wire.error(error)))

    def cut(self, error: ServeError) -> list[Request]:
        cut = [r for r in list(self._requests.values()) if not r.finished.is_set()]
        if self.alive():
            self._send(("cut", wire.error(error)))
        return cut

    def _scored(self, pairs: tuple[list, list], opts: DecodingOptions) -> list[Score]:
        got = self._call("score", pairs, wire.options(opts))
        return [Score(tuple(t), lp, s, tuple(tlp), cut) for t, lp, s, tlp, cut in got]

    def engine_metrics(self) -> bytes:
        """The engine process's Prometheus exposition (its registry: the decode thread's metrics)."""
        return self._call("metrics", timeout=10.0)

    def _call(self, kind: str, *args, timeout: float | None = None) -> Any:
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check_running()
            job = next(self._jobs_ids)
            self._replies[job] = done
            self._send((kind, job, *args))
        return done.result(timeout)

    def _check_running(self) -> None:
        if self.thread_error is not None or not self.alive():
            raise ServeError("the engine process has stopped", 503, hint="see the server's log; restart it")

    def _send(self, message: tuple) -> None:
        data = wire.dumps(message)
        with self._send_lock:
            self._conn.send_bytes(data)

    # -- the reader thread: the engine's frames into the requests' sinks ----------------------------------
    def _read(self) -> None:
        try:
            while True:
                message = wire.loads(self._conn.recv_bytes())
                if message[0] == "step":
                    self._step_frame(*message[1:])
                elif message[0] == "reply":
                    _, job, ok, value = message
                    done = self._replies.pop(job, None)
                    if done is not None:
                        done.set_result(value) if ok else done.set_exception(wire.unerror(value))
                elif message[0] == "stopped":
                    break
        except (EOFError, OSError) as e:
            self.thread_error = EngineFailed(f"the engine process ended ({type(e).__name__})")
        except BaseException as e:  # noqa: BLE001 - recorded: healthz reports it
            self.thread_error = e
        finally:
            self._fail_all(ServeError("the engine process stopped before this request finished", 503,
                                      hint="see the server's log; send it again (to another replica)"))

    def _step_frame(self, seen: int, depth: int, events: list) -> None:
        self._seen, self._depth = seen, depth  # (the queue's gauge is the engine's)
        out: list[Event] = []
        for rid, kind, data in events:
            req = self._requests.get(rid)
            if req is None:
                continue
            if kind == "translation":
                out.append((req, kind, (data[0], self._translation(req, *data))))
                continue
            if kind == "done":
                for i, result in data:
                    self._translation(req, i, result)
                self._requests.pop(rid, None)
                req.finished.set()
            elif kind == "error":
                data = req.error = wire.unerror(data)
                self._requests.pop(rid, None)
                req.finished.set()
            out.append((req, kind, data))
        deliver(out)

    def _translation(self, req: Request, i: int, result: list) -> Any:
        t = req.translations[i] = self.translator.translation(
            wire.unresult(result), req.prepared[i], req.texts[i] if req.options.replace_unknowns else None)
        return t

    def _fail_all(self, error: ServeError) -> None:
        with self._lock:
            held, self._requests = list(self._requests.values()), {}
            replies, self._replies = list(self._replies.values()), {}
        for done in replies:
            done.set_exception(error)
        out: list[Event] = []
        for req in held:
            if not req.finished.is_set():
                req.error = error
                req.finished.set()
                out.append((req, "error", error))
        deliver(out)


def _tokenizer(data: bytes):
    """The engine's tokenizer from its file's bytes (read through a file: a pair of tokenizers or one)."""
    import os
    import tempfile

    from transduce.models.tokenizer import Tokenizer

    fd, path = tempfile.mkstemp(suffix=".json", prefix="transduce-tokenizer-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return Tokenizer.from_file(path)
    finally:
        os.unlink(path)
