"""`transduce serve`: uvicorn in front of the backend and its decode thread, which run in engine processes of
their own (--engine process, the default: serve.engine) or in a thread of the server's process (--engine thread).

SIGTERM and Ctrl-C drain: readyz answers 503, uvicorn stops accepting connections, the requests under way
finish within the grace period (the decode thread keeps stepping them), then the process exits 0. A second
Ctrl-C ends it at once."""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any

from transduce.errors import BackendUnavailable, InputError, TransduceWarning
from transduce.runtime.spec import BackendSpec
from transduce.serve.planning import plan_engines
from transduce.serve.service import DecodeService, ServeError, ServiceOptions


def import_serving():
    """uvicorn (with uvloop and httptools, which the server selects) and orjson, or a BackendUnavailable saying
    how to get them."""
    try:
        import httptools  # noqa: F401
        import orjson  # noqa: F401
        import uvicorn
        import uvloop  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(f"transduce serve needs {e.name}", hint="pip install 'transduce[serve]'") from None
    return uvicorn


def read_api_key(path: str) -> str:
    """The bearer token in `path` (surrounding whitespace dropped); refused if empty."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except OSError as e:
        raise InputError(f"cannot read --api-key-file {path!r}: {e.strerror}", params=("api_key_file",)) from None
    if not key:
        raise InputError(f"--api-key-file {path!r} is empty", hint="write the key on its first line",
                         params=("api_key_file",))
    return key


def identity(translator, spec: BackendSpec, path: str, scheduler: str = "continuous") -> dict[str, Any]:
    """What GET /v1/models says about the model a server decodes with: the backend the spec opened and the
    artifact it loaded."""
    be = translator.backend
    artifact = be.artifact
    return {"id": os.path.basename(os.path.abspath(path)), "object": "model", "backend": spec.backend,
            "scheduler": scheduler, "device": str(be.device), "manifest_sha256": artifact.manifest_sha256,
            "precision": be.precision, "cuda_graph": bool(be.cuda_graph),
            "contract_version": artifact.manifest.get("contract_version"), "kind": artifact.manifest.get("kind"),
            "model": {k: getattr(be.config, k) for k in ("vocab_size", "d_model", "encoder_layers", "decoder_layers",
                                                         "n_heads", "max_positions")}}


ENGINES = ("thread", "process")  # where the decode loop runs: a thread of the server, or a process of its own
MAX_ENGINES = 64  # engine processes, at most (each loads the model)


def build_service(path: str, spec: BackendSpec | None = None, options: ServiceOptions | None = None,
                  metrics: bool = True, engine: str = "thread", engines: int = 1) -> tuple[DecodeService, dict]:
    """The decode service over an artifact (or engine) directory with the backend `spec` names, started and
    warmed up -> it, its identity. engine: "thread" (the decode thread beside the HTTP front end) or "process"
    (the backend and decode loop in spawned engine processes, `engines` of them: serve.engine)."""
    from transduce.runtime.api import load
    from transduce.serve.metrics import ServeMetrics

    # requests are tokenized on the event loop, one at a time: the tokenizers library's thread pool would spend
    # more CPU (twice as much for 16 sentences) on the cores the model decodes on, to save a little wait
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    spec = spec or BackendSpec()
    if engine == "process":
        from transduce.serve.engine import EngineClient
        from transduce.serve.metrics import EngineMetrics

        watched = EngineMetrics() if metrics else None
        plan = plan_engines(path, spec, engines)
        if plan.note:
            warnings.warn(TransduceWarning(plan.note), stacklevel=2)
        client = EngineClient(path, plan.spec, options, watched, identity, plan.count, plan.crowded)
        if watched is not None:
            watched.engine = client
        client.start()
        return client, client.identity
    translator = load(path, spec)
    service = DecodeService(translator, options, ServeMetrics() if metrics else None)
    service.start()
    return service, identity(translator, spec, path, service.options.scheduler)


def check_engines(engine: str, engines: int) -> None:
    """--engine and --engines: an InputError naming the one that is wrong."""
    if engine not in ENGINES:
        raise InputError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}", params=("engine",))
    if isinstance(engines, bool) or not isinstance(engines, int) or not 0 <= engines <= MAX_ENGINES:
        raise InputError(f"engines must be an integer 0..{MAX_ENGINES} (0: auto), got {engines!r}",
                         params=("engines",))
    if engines > 1 and engine != "process":
        raise InputError(f"engines {engines}: several engines are processes of their own",
                         hint="add --engine process", params=("engines",))


def serve(path: str, spec: BackendSpec | None = None, host: str = "127.0.0.1", port: int = 8000,
          options: ServiceOptions | None = None, api_key_file: str | None = None, grace: float = 30.0,
          max_body_bytes: int = 1 << 20, quiet: bool = False, log=print, read_timeout: float = 10.0,
          keep_alive: float = 5.0, languages: str | None = None, engine: str = "process", engines: int = 0) -> int:
    """Serve until SIGTERM or Ctrl-C, then drain -> the exit status (0). read_timeout: seconds a request's headers,
    then its body, may take to arrive (408 and the connection closed past it); keep_alive: seconds an idle
    connection is kept open; languages: "SRC:TGT", the model's pair for LibreTranslate's routes; engine: see
    build_service."""
    uvicorn = import_serving()
    from transduce.serve.app import create_app
    from transduce.serve.http import http_protocol
    from transduce.serve.libre import Languages

    # before the model loads: a mistake costs no wait
    check_listening(host, port, grace, max_body_bytes, read_timeout, keep_alive)
    check_engines(engine, engines)
    pair = Languages.parse(languages) if languages is not None else None
    api_key = read_api_key(api_key_file) if api_key_file else None
    started = time.monotonic()
    service, ident = build_service(path, spec, options, engine=engine, engines=engines)
    if engine == "process":  # uvicorn's loop lives as long as the server: it reads the engines' frames
        service.loop_reads = True
    app = create_app(service, ident, api_key, max_body_bytes, read_timeout,
                     pair or Languages.of(service.translator.tokenizer))
    # uvicorn's own limit only backs ours up: at --grace the requests still under way are answered 503 (_Drain),
    # and their answers need a moment to go out
    config = uvicorn.Config(app, host=host, port=port, log_level="warning" if quiet else "info",
                            timeout_graceful_shutdown=grace + CUT_ANSWER_S, lifespan="off", access_log=not quiet,
                            loop="uvloop", http=http_protocol(read_timeout),
                            timeout_keep_alive=keep_alive, ws="none")  # an Upgrade: websocket is plain HTTP here
    drain = _Drain(service, grace, log)
    server = _server(config, drain)
    if not quiet:
        log(f"transduce serve: {ident['id']} on {ident['backend']} ({ident['device']}), ready in "
            f"{time.monotonic() - started:.1f} s; http://{host}:{port}/v1/translate")
    try:
        server.run()  # returns once the connections under way are answered
    finally:
        drain.done()
        service.stop(grace=0)
    if drain.cut:
        log(f"transduce serve: stopped with {drain.cut} request(s) cut short (503), exiting 1")
        return 1
    if not quiet:
        log("transduce serve: drained, exiting")
    return 0


def check_listening(host: str, port: int, grace: float, max_body_bytes: int, read_timeout: float = 10.0,
                    keep_alive: float = 5.0) -> None:
    """The listening options, and the address free: an InputError naming the parameter otherwise."""
    import math
    import socket

    for name, v in (("read_timeout", read_timeout), ("keep_alive", keep_alive)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise InputError(f"{name} must be a number of seconds > 0, got {v!r}", params=(name,))
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InputError(f"port must be 0..65535, got {port!r}", params=("port",))
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise InputError(f"max_body_bytes must be an integer >= 1, got {max_body_bytes!r}", params=("max_body_bytes",))
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace < math.inf:
        raise InputError(f"grace must be a number of seconds >= 0, got {grace!r}", params=("grace",))
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise InputError(f"host {host!r} is not an address of this machine: {e.strerror}", params=("host",)) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
        try:
            s.bind(address)
        except OSError as e:
            raise InputError(f"cannot listen on {host}:{port}: {e.strerror}",
                             hint="another server may hold that port: choose another one", params=("port",)) from None


CUT_ANSWER_S = 5.0  # seconds the 503 answers of requests cut at the end of the grace period get to go out


class _Drain:
    """SIGTERM or Ctrl-C: the first starts the drain (readyz fails, nothing new is admitted) and gives the
    requests under way `grace` seconds; then, or at a second signal, those still running are cut: each answered
    503 (a stream gets its `error` event), one log line each, and the exit status is 1."""

    def __init__(self, service: DecodeService, grace: float, log):
        self.service, self.grace, self.log = service, grace, log
        self.signals = 0
        self.cut = 0
        self.until: float | None = None
        self._timer: threading.Timer | None = None

    def signalled(self) -> bool:
        """Take a signal in -> whether it is the first (the server is then to stop accepting)."""
        self.signals += 1
        if self.signals > 1:
            self.cut_short("a second signal stopped the server")
            return False
        self.service.draining = True
        self.until = time.monotonic() + self.grace + CUT_ANSWER_S + 10
        self._timer = threading.Timer(self.grace, self.cut_short, (f"its --grace of {self.grace:g} s ended",))
        self._timer.daemon = True
        self._timer.start()
        return True

    def cut_short(self, why: str) -> None:
        error = ServeError(f"the server stopped before this request finished: {why}", 503,
                           hint="send it again (to another replica)")
        for req in self.service.cut(error):
            self.cut += 1
            self.log(f"transduce serve: request {req.id} cut short ({len(req.translations)} sentence(s)): {why}")

    def done(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def term_deadline(self) -> float | None:
        """For the command's SIGTERM watchdog: when the drain will be over at the latest."""
        return self.until


def _server(config, drain: _Drain):
    """A uvicorn.Server whose signal handler is the drain's (see _Drain), and whose exit is the drain's status,
    not the signal raised again (uvicorn's own way)."""
    import uvicorn

    class Handler:
        def __call__(self, sig, frame):
            if drain.signalled():
                uvicorn.Server.handle_exit(server, sig, frame)  # stop accepting; wait for the connections
            server._captured_signals.clear()

        def term_deadline(self) -> float | None:
            return drain.term_deadline()

    server = uvicorn.Server(config)
    server.handle_exit = Handler()  # what capture_signals installs for SIGINT and SIGTERM
    return server
