"""The front end's side of `transduce serve --engine process`: a DecodeService whose decode thread, running batch
and backend are in an engine process of their own (engine_core.py), so decoding never waits for the interpreter
lock that HTTP, JSON, tokenizing and detokenizing hold here.

EngineClient keeps DecodeService's intake (submit's checks and tokenizing, the options, score's checks) and
replaces its queue: a checked request goes to the first engine process with fewer rows under way than
fill_rows, else to the one with the fewest (one wide batch steps rows more cheaply than two narrow ones), down its
pipe as token ids and plain fields (wire.py; the submits of one turn of the event loop in one frame). Its frames
(one per decode step, every request's events by id) are read on the event loop once a request has come from one
(a reader of the pipe's file descriptor: no thread wakes and hands each frame over), before then by a reader
thread per engine; either makes the Translations from the token ids and hands the step's events to the requests'
sinks, exactly as the decode thread does in-process. The 429 counts the engines' queues as last told and the
submits not yet taken that will wait. An engine dying makes alive() false (healthz 503) and fails its work (503).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections import deque
from typing import Any

from transduce.errors import TransduceError
from transduce.runtime.decoding import DecodingOptions
from transduce.runtime.translator import Score, Translator
from transduce.serve import engine_core, wire
from transduce.serve.options import Kept, request_defaults
from transduce.serve.outbox import Outbox
from transduce.serve.requests import deliver, waiting
from transduce.serve.service import DecodeService, Event, Request, ServeError, ServiceOptions

START_TIMEOUT_S = 600.0  # loading and warming up a large artifact on a slow disk
FRAMES_PER_READ = 16  # frames read per wake-up of the event loop, at most (the rest at its next turn)


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


class _Engine:
    """One engine process as the front end holds it: the process, its pipe, what reads its frames (a thread, then
    an event loop), the submits not sent yet, and what it has under way."""

    def __init__(self, number: int, client: EngineClient):
        self.number, self.client = number, client
        self.process = self.conn = self.reader = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop reading its frames, once handed over
        self.ended = False  # its frames ended: its pipe closed, or it said it stopped
        self.handover = False  # an event loop asked the reader thread to stop
        self.wake_r = self.wake_w = -1  # a pipe that wakes the reader thread for the handover
        self.outbox: Outbox | None = None  # the frames to it (never waited for on the event loop)
        self.pending: list[tuple] = []  # submits not sent yet: one frame for those of one turn of the event loop
        self.sent = self.seen = self.depth = 0  # submits sent, seen by the engine; its queue's depth, as last told
        self.rows = 0  # decoding rows of the requests sent to it and not finished, at most (a beam of k: k each)
        self.untaken: deque[int] = deque()  # the rows of each submit it has not seen yet, in order

    def spawn(self) -> None:
        c = self.client
        ctx = multiprocessing.get_context("spawn")  # never forked: the parent may hold torch's or ORT's threads
        self.conn, theirs = ctx.Pipe(duplex=True)
        self.outbox = Outbox(self.conn)
        self.wake_r, self.wake_w = os.pipe()
        self.process = ctx.Process(target=engine_core.main, name=f"transduce-engine-{self.number}", daemon=True,
                                   args=(theirs, c.path, c.spec, c.options, c.metrics is not None, c.identity_of,
                                         c.cores(self.number)))
        self.process.start()
        theirs.close()

    def reading(self) -> bool:
        """Whether its frames are still read (the reader ends when the pipe does)."""
        if self.loop is not None or self.handover:  # (read by an event loop, or about to be)
            return not self.ended
        return self.reader is not None and self.reader.is_alive()

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive() and self.reading()

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)

    def await_ready(self) -> dict[str, Any]:
        end = time.monotonic() + START_TIMEOUT_S
        while not self.conn.poll(0.1):
            if not self.process.is_alive():
                raise EngineFailed(f"the engine process exited with {self.process.exitcode} while loading",
                                   hint="see the messages above")
            if time.monotonic() > end:
                self.process.kill()
                raise EngineFailed(f"the engine process was not ready in {START_TIMEOUT_S:g} s")
        message = wire.loads(self.conn.recv_bytes())
        if message[0] == "failed":  # the engine's own error (a bad artifact: exit 2), with its message and hint
            self.process.join(timeout=10)
            raise wire.load_error(*message[1:], EngineFailed)
        return message[1]

    def send(self, message: tuple, timeout: float | None = None) -> None:
        self.outbox.send(wire.dumps(message), timeout)

    def send_pending(self) -> None:
        """The submits made since the last frame, in one frame."""
        with self.client._lock:
            pending, self.pending = self.pending, []
            if pending:
                try:
                    self.send(("submit", pending))
                except OSError:  # the engine is gone: its reader fails them
                    pass

    def stop(self) -> None:
        if self.process is not None and self.process.is_alive():
            try:
                self.send(("stop",), timeout=10.0)  # (a wedged engine is killed below)
            except OSError:
                pass
            self.process.join(timeout=10)
        self.kill()
        if self.reader is not None:
            self.reader.join(timeout=10)
        if self.wake_w >= 0 and (self.reader is None or not self.reader.is_alive()):
            os.close(self.wake_r)
            os.close(self.wake_w)
            self.wake_r = self.wake_w = -1
            self.outbox.close()


class EngineClient(DecodeService):
    """A DecodeService over `engines` engine processes (see the module): start() spawns them and waits until they
    are warm. Each request goes where _route says."""

    def __init__(self, path: str, spec, options: ServiceOptions | None = None, metrics=None, identity=None,
                 engines: int = 1, crowded: int = 0):
        # no running batch nor decode thread here: DecodeService.__init__ is not run
        self.path, self.spec, self.options, self.metrics = path, spec, options or ServiceOptions(), metrics
        self.identity_of, self.identity = identity, None
        self.translator: Translator | None = None
        self.draining = self.ready = self._stop = False
        self.thread_error: BaseException | None = None
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop reading the engines' frames (_home)
        self._homing = threading.Lock()
        self.loop_reads = False  # set by a server whose one event loop lives as long as it (serve): it reads them
        self._requests: dict[int, Request] = {}  # under way in an engine, by id
        self._where: dict[int, _Engine] = {}  # the engine each of them went to
        self._replies: dict[int, tuple[_Engine, concurrent.futures.Future]] = {}  # a job's engine and answer
        self._jobs_ids = itertools.count(1)
        self._attention: tuple | None = None
        self.engines = [_Engine(n, self) for n in range(engines)]
        self._pinned: _Engine | None = None  # where the warm-up goes
        # each engine's byte, set while it has work (engine_core.Cores): with several engines sharing the cores
        self._busy = multiprocessing.get_context("spawn").Array("b", engines, lock=False) \
            if crowded and engines > 1 else None
        self.crowded = crowded

    def cores(self, number: int) -> engine_core.Cores | None:
        """How engine `number` shares the cores with the others (None: its threads are its own)."""
        return None if self._busy is None else engine_core.Cores(self._busy, number, self.crowded)

    # -- starting and stopping -----------------------------------------------------------------------------
    def start(self, warmup: bool = True) -> None:
        # the engines ignore SIGTERM, which is how multiprocessing ends daemonic children at exit: ended here first
        atexit.register(self._kill)
        try:
            for e in self.engines:  # all load at once
                e.spawn()
            infos = [e.await_ready() for e in self.engines]
            self._started(infos[0])
            for e in self.engines:
                self._read_in_thread(e)
            if warmup:  # the whole path, both processes, once per engine before readyz says yes
                for e in self.engines:
                    self._warm(e)
        except BaseException:
            self._kill()
            for e in self.engines:  # (their readers and pipes)
                e.stop()
            raise
        self.ready = True

    def _started(self, info: dict[str, Any]) -> None:
        from transduce.formats.model_config import ModelConfig
        from transduce.models.tokenizer import Tokenizer

        self.identity, self._attention = info["identity"], info["attention"]
        if self.identity is not None and len(self.engines) > 1:
            self.identity = {**self.identity, "engines": len(self.engines)}
        config = ModelConfig(**info["config"])
        self.translator = Translator(RemoteBackend(info, config), Tokenizer.from_bytes(info["tokenizer"]),
                                     defaults=DecodingOptions(**info["defaults"]))  # the model's, as loaded there
        self.defaults = request_defaults(self.translator.defaults, self.options)
        self._made_options = Kept()  # decoding_options' made
        self._wire_forms = Kept()  # _wired's: by the options' id, with the options (alive: the id stays theirs)

    def _warm(self, engine: _Engine) -> None:
        """The warm-up request through `engine` (before the server takes requests)."""
        self._pinned = engine
        try:
            self.translate(["warm up"], self.warmup_options())
        finally:
            self._pinned = None

    def _kill(self) -> None:
        for e in self.engines:
            e.kill()

    stopped = "engine process stopped"  # what /healthz says when not alive()

    def alive(self) -> bool:
        return self.thread_error is None and all(e.alive() for e in self.engines)

    def stop(self, grace: float = 0.0) -> None:
        """Stop admitting; let what runs finish for up to `grace` seconds, then stop the engine processes (the
        requests still under way get their 503)."""
        self.draining = True
        end = time.monotonic() + grace
        while time.monotonic() < end and self._requests and self.alive():
            time.sleep(0.01)
        self._stop = True
        self._home(None)
        for e in self.engines:
            e.stop()
        atexit.unregister(self._kill)

    # -- the intake's end: requests and jobs down the pipes ------------------------------------------------
    def queue_depth(self) -> int:
        """Requests waiting (under the lock): each engine's queue as last told, its untaken submits that will wait."""
        return sum(e.depth + len(e.untaken) if e.depth or not e.untaken else
                   waiting(e.untaken, e.rows - sum(e.untaken), self.options.max_rows) for e in self.engines)

    def _check_attention(self) -> None:
        if self._attention is not None:
            raise ServeError(self._attention[0], 400, self._attention[1])

    def _enqueue(self, req: Request) -> Request:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a caller in a thread of its own
            loop = None
        if self.loop_reads and self._loop is not loop:
            self._home(loop)
        with self._lock:
            self._check_running()
            engine = self._pinned or self._route()
            if not self._taken_in(req, self.queue_depth(), engine.rows + req.rows <= self.options.max_rows):
                return req
            self._requests[req.id], self._where[req.id] = req, engine
            engine.sent += 1
            engine.rows += req.rows
            engine.untaken.append(req.rows)
            texts = req.texts if req.options.replace_unknowns else None
            engine.pending.append((req.id, req.created, req.timeout, req.stream, len(req.translations), req.todo,
                                   wire.array(req.src), wire.array(req.lens), req.prepared, texts, req.prefixes,
                                   self._wired(req.options)))
            first = len(engine.pending) == 1
        if first:
            if loop is None:  # at once
                engine.send_pending()
            else:  # after the other callbacks of this turn of the loop, with the submits they make
                loop.call_soon(engine.send_pending)
        return req

    def _wired(self, opts: DecodingOptions) -> tuple:
        """wire.options(opts), made once per options object (decoding_options gives the same one for the same
        request options)."""
        return self._wire_forms.made(id(opts), lambda: (opts, wire.options(opts)))[1]

    def _route(self) -> _Engine:
        """The engine a request goes to: the first with fewer rows under way than fill_rows (one engine's wide
        batch costs less per row than two narrow ones), else the one with the fewest."""
        fill = self.options.fill_rows
        for e in self.engines if fill else ():
            if e.rows < fill:
                return e
        return min(self.engines, key=lambda e: e.rows)

    def cancel(self, req: Request, error: ServeError) -> None:
        engine = self._where.get(req.id)
        if engine is not None and not req.finished.is_set() and engine.alive():
            engine.send_pending()  # its submit first
            engine.send(("cancel", req.id, wire.error(error)))

    def cut(self, error: ServeError) -> list[Request]:
        cut = [r for r in list(self._requests.values()) if not r.finished.is_set()]
        for e in self.engines:
            if e.alive():
                e.send_pending()
                e.send(("cut", wire.error(error)))
        return cut

    def _score_job(self, pairs: tuple[list, list], opts: DecodingOptions) -> concurrent.futures.Future:
        got = self._job(min(self.engines, key=lambda e: e.rows), "score", pairs, wire.options(opts))
        scores: concurrent.futures.Future = concurrent.futures.Future()

        def made(f: concurrent.futures.Future) -> None:
            try:
                if not scores.done():  # (its caller may have given up)
                    scores.set_result([Score(tuple(t), lp, s, tuple(tlp), cut) for t, lp, s, tlp, cut in f.result()])
            except Exception as e:  # noqa: BLE001 - the engine's error (or a reply not as expected): the caller's
                scores.set_exception(e)

        got.add_done_callback(made)
        return scores

    def engine_metrics(self) -> bytes:
        """The engine processes' Prometheus exposition (their registries: the decode threads' metrics), summed."""
        from transduce.serve.metrics import merged

        summed = self._call(self.engines[0], "metrics", timeout=10.0)
        for e in self.engines[1:]:
            summed = merged(summed.decode(), self._call(e, "metrics", timeout=10.0).decode())
        return summed

    def _call(self, engine: _Engine, kind: str, *args, timeout: float | None = None) -> Any:
        return self._job(engine, kind, *args).result(timeout)

    def _job(self, engine: _Engine, kind: str, *args) -> concurrent.futures.Future:
        """A job sent to `engine` -> the future of its reply."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check_running()
            job = next(self._jobs_ids)
            self._replies[job] = (engine, done)
            engine.send((kind, job, *args))
        return done

    def _check_running(self) -> None:
        if self.thread_error is not None or not all(e.reading() for e in self.engines):
            raise ServeError("the engine process has stopped", 503, hint="see the server's log; restart it")

    # -- reading the engines' frames: a thread each, then the event loop ---------------------------------------
    def _read_in_thread(self, engine: _Engine) -> None:
        engine.handover = False
        engine.reader = threading.Thread(target=self._read, args=(engine,), daemon=True,
                                         name=f"transduce-engine-reader-{engine.number}")
        engine.reader.start()

    def _read(self, engine: _Engine) -> None:
        """The reader thread: the engine's frames until its pipe ends, or until an event loop takes them over."""
        conn = engine.conn
        try:
            while not engine.handover:  # asked for: the next frame is the loop's to read
                if conn in multiprocessing.connection.wait([conn, engine.wake_r]):
                    if self._frame(engine, conn.recv_bytes()):
                        break
            else:
                os.read(engine.wake_r, 1)  # the handover's wake-up (written right after the flag)
                return
        except BaseException as e:  # noqa: BLE001 - recorded: healthz reports it
            self._ended(engine, e)
        else:
            self._ended(engine, None)

    def _home(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """The engines' frames read on `loop`, the caller's (a frame wakes it, not a thread that then wakes it); for
        a caller with none (None), on the loop reading them while it runs, else by reader threads again."""
        with self._homing:
            now = self._loop
            if now is loop or (now is not None and now.is_running()):  # a running loop keeps them
                return
            for e in self.engines:
                if e.loop is not None and not e.ended:  # its loop has stopped
                    try:
                        e.loop.remove_reader(e.conn.fileno())
                    except Exception:  # noqa: BLE001 - a closed loop has forgotten it already
                        pass
                    e.loop = None
                    self._read_in_thread(e)
                    e.outbox.attach(None)  # what waited for that loop is written from here
            self._loop = loop
            for e in self.engines if loop is not None else ():  # each reader thread hands over between two frames
                if not e.reading():
                    continue
                e.handover = True
                os.write(e.wake_w, b"h")
                e.reader.join()
                if e.ended:
                    continue
                try:
                    loop.add_reader(e.conn.fileno(), self._readable, e)
                except NotImplementedError:  # a loop that cannot watch a pipe (Windows'): threads keep reading
                    self._read_in_thread(e)
                    continue
                e.loop = loop
                os.set_blocking(e.conn.fileno(), True)  # uvloop's (libuv's) poll made it non-blocking
                e.outbox.attach(loop)

    def _readable(self, engine: _Engine) -> None:
        """On the event loop: the frames that have arrived (a few at a time: the loop's other work goes on)."""
        conn = engine.conn
        try:
            for _ in range(FRAMES_PER_READ):
                if not conn.poll():
                    return
                if self._frame(engine, conn.recv_bytes()):
                    break
            else:
                return
            ended = None
        except Exception as e:  # noqa: BLE001 - recorded: healthz reports it
            ended = e
        engine.loop.remove_reader(conn.fileno())
        self._ended(engine, ended)

    def _frame(self, engine: _Engine, data: bytes) -> bool:
        """One frame from `engine` -> whether it said it stopped."""
        message = wire.loads(data)
        if message[0] == "step":
            self._step_frame(engine, *message[1:])
        elif message[0] == "reply":
            _, job, ok, value = message
            _, done = self._replies.pop(job, (None, None))
            if done is not None and not done.done():  # (one whose caller gave up is cancelled already)
                done.set_result(value) if ok else done.set_exception(wire.unerror(value))
        return message[0] == "stopped"

    def _ended(self, engine: _Engine, error: BaseException | None) -> None:
        """`engine`'s frames have ended (with `error`, or it stopped): its requests and jobs get their 503."""
        engine.ended = True
        if isinstance(error, (EOFError, OSError)):
            error = EngineFailed(f"the engine process ended ({type(error).__name__})")
        if error is not None:
            self.thread_error = error
        self._fail_all(ServeError("the engine process stopped before this request finished", 503,
                                  hint="see the server's log; send it again (to another replica)"), engine)

    def _step_frame(self, engine: _Engine, seen: int, depth: int, events: list) -> None:
        with self._lock:
            engine.seen, engine.depth = seen, depth  # (the queue's gauge is the engine's)
            while engine.untaken and len(engine.untaken) > engine.sent - seen:
                engine.untaken.popleft()
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
            elif kind == "error":
                data = req.error = wire.unerror(data)
            if kind in ("done", "error"):
                self._requests.pop(rid, None)
                self._where.pop(rid, None)
                engine.rows -= req.rows
                req.finished.set()
            out.append((req, kind, data))
        deliver(out)

    def _translation(self, req: Request, i: int, result: list) -> Any:
        t = req.translations[i] = self.translator.translation(
            wire.unresult(result), req.prepared[i], req.texts[i] if req.options.replace_unknowns else None)
        return t

    def _fail_all(self, error: ServeError, engine: _Engine | None = None) -> None:
        """Every request under way and every job's reply awaited (in `engine`, where given) fails with `error`."""
        with self._lock:
            held = [r for r in self._requests.values() if engine is None or self._where.get(r.id) is engine]
            for r in held:
                self._requests.pop(r.id, None)
                self._where.pop(r.id, None)
            jobs = [j for j, (e, _) in self._replies.items() if engine is None or e is engine]
            replies = [self._replies.pop(j)[1] for j in jobs]
        for done in replies:
            if not done.done():
                done.set_exception(error)
        out: list[Event] = []
        for req in held:
            if not req.finished.is_set():
                req.error = error
                req.finished.set()
                out.append((req, "error", error))
        deliver(out)

