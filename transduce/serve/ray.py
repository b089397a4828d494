"""The server as a Ray Serve deployment: each replica owns one backend, its decode thread and running batch, and
answers the same HTTP API as `transduce serve` (app.py); Ray routes requests between replicas.

    serve run transduce.serve.ray:app artifact=/path/to/artifact replicas=2
    transduce serve /path/to/artifact --ray --replicas 2 [--address ray://head:10001]

Backpressure: Ray's max_ongoing_requests per replica (past it requests wait in Ray's queue) and
max_queued_requests (past it Ray answers 503); inside a replica the service's own queue and 429 as well.
autoscaling_config (min_replicas, max_replicas, target_ongoing_requests, ...) replaces a fixed replica count.
check_health fails once the replica's decode thread has stopped, and Ray replaces the replica.

On a cluster (`ray start --head` on one machine, `ray start --address HEAD:6379` on the others) the artifact
directory must be at the same path on every node; a replica of a backend on a GPU (device cuda, or an engine
directory's) gets one (num_gpus=1) unless num_gpus says otherwise.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any

from transduce.errors import BackendUnavailable, InputError
from transduce.runtime.backends.registry import entry
from transduce.runtime.spec import BackendSpec, typed_value
from transduce.serve.service import ServiceOptions

REPLICA_HEADER = "x-transduce-replica"  # which replica answered: host:pid


def _import_ray():
    try:
        from ray import serve
    except ImportError:
        raise BackendUnavailable("the Ray Serve deployment needs ray[serve]",
                                 hint="pip install 'transduce[serve]'") from None
    return serve


class ReplicaHeader:
    """ASGI middleware: every HTTP answer says which replica gave it."""

    def __init__(self, app, replica: str):
        self.app, self.value = app, replica.encode()

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER.encode(), self.value)]}
            await send(message)

        return await self.app(scope, receive, tagged if scope["type"] == "http" else send)


def _deployment_class():
    serve = _import_ray()

    @serve.ingress()
    class Translate:
        """One replica: a decode service and the HTTP API over it (built after the constructor)."""

        def __init__(self, artifact: str, spec: dict | None = None, options: dict | None = None, grace: float = 30.0,
                     api_key_file: str | None = None, max_body_bytes: int = 1 << 20, read_timeout: float = 10.0,
                     languages: str | None = None):
            """spec and options: a BackendSpec's and ServiceOptions' fields (plain values: Ray sends them);
            languages: "SRC:TGT", the model's pair for LibreTranslate's routes."""
            from transduce.serve.server import build_service, read_api_key

            self.grace, self.read_timeout, self.languages = grace, read_timeout, languages
            # the key is read here, on the replica's node: it never travels in Ray's deployment config
            self.api_key = read_api_key(api_key_file) if api_key_file else None
            self.max_body_bytes = max_body_bytes
            self.service, self.identity = build_service(artifact, BackendSpec.from_mapping(spec or {}),
                                                        ServiceOptions(**(options or {})))
            self.replica = f"{socket.gethostname()}:{os.getpid()}"

        def __serve_build_asgi_app__(self):
            from transduce.serve.app import create_app
            from transduce.serve.libre import Languages

            pair = (Languages.parse(self.languages) if self.languages
                    else Languages.of(self.service.translator.tokenizer))
            return ReplicaHeader(create_app(self.service, self.identity, self.api_key, self.max_body_bytes,
                                            self.read_timeout, pair), self.replica)

        def check_health(self) -> None:
            if not self.service.alive():
                raise RuntimeError(f"the decode thread of replica {self.replica} stopped: "
                                   f"{self.service.thread_error!r}")

        def __del__(self):
            service = getattr(self, "service", None)
            if service is not None:
                service.stop(grace=self.grace)

    return Translate


def build_app(artifact: str, spec: BackendSpec | None = None, options: ServiceOptions | None = None,
              replicas: int = 1, max_ongoing_requests: int = 64, max_queued_requests: int = 256,
              autoscaling_config: dict[str, Any] | None = None, num_cpus: float = 1.0, num_gpus: float | None = None,
              name: str = "transduce", grace: float = 30.0, api_key_file: str | None = None,
              max_body_bytes: int = 1 << 20, read_timeout: float = 10.0, languages: str | None = None):
    """The Ray Serve application: `replicas` copies (or autoscaling_config's) of one deployment over `artifact`,
    each decoding with the backend `spec` names (num_gpus: one per replica where it runs on a GPU, unless
    given). api_key_file: bearer auth, the file read by each replica (at the same path on every node)."""
    serve = _import_ray()
    spec = spec or BackendSpec()
    if num_gpus is None:
        num_gpus = 1.0 if spec.device.startswith("cuda") or entry(spec.backend).opens == "engine" else 0.0
    scaling = {"autoscaling_config": autoscaling_config} if autoscaling_config else {"num_replicas": int(replicas)}
    deployment = serve.deployment(_deployment_class(), name=name, max_ongoing_requests=max_ongoing_requests,
                                  max_queued_requests=max_queued_requests, health_check_period_s=5,
                                  ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus}, **scaling)
    return deployment.bind(os.path.abspath(artifact), spec.to_mapping(),
                           dataclasses.asdict(options or ServiceOptions()), grace,
                           os.path.abspath(api_key_file) if api_key_file else None, max_body_bytes, read_timeout,
                           languages)


# the application's own settings in `serve run ... key=value` (the BackendSpec's and ServiceOptions' fields too)
APP_SETTINGS = {"replicas": int, "max_ongoing_requests": int, "max_queued_requests": int, "max_body_bytes": int,
                "num_cpus": float, "num_gpus": float, "grace": float, "name": str, "api_key_file": str,
                "read_timeout": float, "languages": str}


def app(args: dict[str, str]):
    """The application builder of `serve run transduce.serve.ray:app artifact=DIR [key=value ...]`: the backend
    (BackendSpec's fields: backend, device, threads, precision, cuda_graph, ...), the service's options
    (ServiceOptions' fields: max_rows, max_queue, ...) and the application's (APP_SETTINGS)."""
    artifact, spec, options, settings = app_settings(args)
    return build_app(artifact, spec, options, **settings)


def app_settings(args: dict[str, str]) -> tuple[str, BackendSpec, ServiceOptions, dict[str, Any]]:
    """`serve run`'s key=value strings -> the artifact, the BackendSpec, the ServiceOptions and the application's
    own settings, each value as its field's type (InputError naming a key that is unknown or a value that is not
    its type)."""
    args = dict(args)
    if "artifact" not in args:
        raise BackendUnavailable("serve run transduce.serve.ray:app needs artifact=DIR",
                                 hint="serve run transduce.serve.ray:app artifact=/path/to/artifact")
    artifact = args.pop("artifact")
    service_fields = {f.name: f.type for f in dataclasses.fields(ServiceOptions)}
    spec_fields = [f.name for f in dataclasses.fields(BackendSpec) if f.name != "options"]
    options = ServiceOptions(**{k: typed_value(k, service_fields[k], args.pop(k)) for k in list(args)
                                if k in service_fields})
    spec = BackendSpec.from_mapping({k: args.pop(k) for k in list(args) if k in spec_fields})
    unknown = sorted(set(args) - set(APP_SETTINGS))
    if unknown:
        raise InputError(f"unknown setting {unknown[0]!r}", params=(unknown[0],),
                         hint="settings: artifact, " + ", ".join([*spec_fields, *service_fields, *APP_SETTINGS]))
    return artifact, spec, options, {k: typed_value(k, APP_SETTINGS[k].__name__, v) for k, v in args.items()}


def run_ray(artifact: str, spec: BackendSpec | None = None, host: str = "127.0.0.1", port: int = 8000,
            options: ServiceOptions | None = None, replicas: int = 1, address: str | None = None, quiet: bool = False,
            log=print, grace: float = 30.0, api_key_file: str | None = None, max_body_bytes: int = 1 << 20,
            read_timeout: float = 10.0, languages: str | None = None) -> int:
    """`transduce serve --ray`: the deployment on a local Ray (or the cluster at `address`) until Ctrl-C or
    SIGTERM, then Serve shut down -> 0."""
    import signal

    serve = _import_ray()
    import ray

    class Stop:
        """The signal handler: stop serving; the command's SIGTERM watchdog gives Serve's shutdown its time."""

        until: float | None = None

        def __call__(self, sig, frame) -> None:
            self.until = time.monotonic() + 60

        def term_deadline(self) -> float | None:
            return self.until

    stop = Stop()
    previous = {}
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=not quiet)
        # after ray.init, which installs handlers of its own (its SIGTERM one aborts the process)
        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        _check_room(ray, spec or BackendSpec(), replicas, address)
        serve.start(http_options={"host": host, "port": port})
        if api_key_file:
            from transduce.serve.server import read_api_key

            read_api_key(api_key_file)  # refused here, before any replica starts, if it cannot be read
        serve._run(build_app(artifact, spec, options, replicas, grace=grace, api_key_file=api_key_file,
                             max_body_bytes=max_body_bytes, read_timeout=read_timeout, languages=languages),
                   name="transduce", route_prefix="/", _blocking=False)
        if not _until_running(serve, stop, log, quiet):
            return 1  # a signal came while the replicas were starting
        if not quiet:
            log(f"transduce serve --ray: {replicas} replica(s) of {artifact} on http://{host}:{port}/v1/translate")
        while stop.until is None:
            time.sleep(0.2)
    finally:
        if ray.is_initialized():  # a failed ray.init leaves nothing to shut down
            serve.shutdown()
        ray.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _check_room(ray, spec: BackendSpec, replicas: int, address: str | None) -> None:
    """Refuse, before anything is deployed, replicas that this Ray cannot place: each takes one CPU (and a GPU
    where its backend runs on one), and a replica that cannot be placed waits forever."""
    have = ray.cluster_resources()
    gpus = 1.0 if spec.device.startswith("cuda") or entry(spec.backend).opens == "engine" else 0.0
    where = f"the Ray cluster at {address}" if address else "this machine's Ray"
    for kind, each in (("CPU", 1.0), ("GPU", gpus)):
        need, got = replicas * each, have.get(kind, 0.0)
        if need > got:
            raise InputError(f"--replicas {replicas} need {need:g} {kind}s (one per replica); {where} has {got:g}",
                             hint=f"give --replicas {int(got // each) if each else 0} or fewer, or a larger cluster "
                                  "(--address)", params=("replicas",))


READY_TIMEOUT_S = 600.0  # replicas that are not running by then (loading, or waiting for resources) are an error
READY_LOG_S = 15.0  # while they start, a line this often saying what they wait for


def _until_running(serve, stop, log, quiet: bool) -> bool:
    """Wait for the application's replicas, saying what they wait for; -> False if a signal came meanwhile (a
    TransduceError if deploying failed or took past READY_TIMEOUT_S)."""
    from transduce.errors import TransduceError

    start = last = time.monotonic()
    while stop.until is None:
        app = serve.status().applications.get("transduce")
        state = str(getattr(app, "status", "")) if app is not None else ""
        if state.endswith("RUNNING"):
            return True
        message = getattr(app, "message", "") if app is not None else ""
        if state.endswith("DEPLOY_FAILED"):
            raise TransduceError(f"the Ray Serve deployment failed: {message}", hint="see the replicas' log above")
        now = time.monotonic()
        if now - start > READY_TIMEOUT_S:
            raise TransduceError(f"the replicas were not running after {READY_TIMEOUT_S:.0f} s ({state}: {message})",
                                 hint="check the cluster's free CPUs and GPUs (ray status)")
        if not quiet and now - last >= READY_LOG_S:
            last = now
            log(f"transduce serve --ray: waiting for the replicas ({state or 'deploying'}{': ' if message else ''}"
                f"{message})")
        time.sleep(0.2)
    return False
