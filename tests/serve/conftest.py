"""Fixtures of the server's tests: an artifact whose forced decodes take long enough to be caught under way, and
real `transduce serve` processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("orjson")
pytest.importorskip("httpx")

import background  # noqa: E402 - tests/background.py

from tests.conftest import TINY, make_tiny_tokenizer, seeded_model  # noqa: E402

KEY = "s3cret-key-for-tests"
# a forced decode of 500 tokens for every row of a full batch: about a second of one core on the tiny model (too
# short to outlast a deadline for sure), over 10 s on the wide one (wide_artifact_dir)
SLOW = {"min_length": 501, "max_len_a": 0, "max_len_b": 500, "beam_size": 8}
# the tiny model's layers 16 times as wide: each decoding step of a full batch about 10 times as long (one encoder
# layer: it runs once per request, and tracing it for the export takes seconds)
WIDE = {**TINY, "encoder_layers": 1, "d_model": 512, "n_heads": 8, "d_ff": 2048, "max_positions": 512}


def _export_seeded(path: str, shape: dict) -> None:
    """A seeded model of `shape` with the tiny tokenizer, saved beside `path` and exported there (fp32)."""
    from transduce.exporter.onnx_export import export_artifact
    from transduce.models.checkpoint import save_model_dir

    tokenizer = make_tiny_tokenizer()
    model_dir = os.path.join(os.path.dirname(path), "model")
    save_model_dir(model_dir, seeded_model(tokenizer, 1, **shape), tokenizer)
    export_artifact(model_dir, path)


def export_long_artifact(path: str, paths=None) -> None:
    _export_seeded(path, {**TINY, "max_positions": 512})


def export_wide_artifact(path: str, paths=None) -> None:
    _export_seeded(path, WIDE)


def _built(request, tmp_path_factory, name: str, export) -> str:
    """The export the background process made for fixture `name`, or one made here where it made none."""
    path = background.built(request, name)
    if path is None:
        path = str(tmp_path_factory.mktemp(name) / "artifact")
        export(path)
    return path


@pytest.fixture(scope="session")
def long_artifact_dir(request, tmp_path_factory):
    """The tiny model's shape with 512 positions, seeded and exported (fp32)."""
    return _built(request, tmp_path_factory, "long_artifact_dir", export_long_artifact)


@pytest.fixture(scope="session")
def wide_artifact_dir(request, tmp_path_factory):
    """The wide model (WIDE), seeded and exported (fp32): its SLOW requests outlast a deadline of seconds."""
    return _built(request, tmp_path_factory, "wide_artifact_dir", export_wide_artifact)


def sse_events(body: str) -> list[tuple[str, dict]]:
    """A Server-Sent Events answer's events as (kind, data), its keep-alive comments left out."""
    import json

    out = []
    for block in body.strip().split("\n\n"):
        if block.startswith(":"):  # a keep-alive comment
            continue
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def post_to_app(app, path: str, body: dict, on_send=None) -> list[dict]:
    """`body` posted to the ASGI `app` at `path`, run in an event loop of its own until the app returns -> the
    messages it sent (on_send(sent) after each one)."""
    import asyncio

    import orjson

    sent: list[dict] = []
    received = [{"type": "http.request", "more_body": False, "body": orjson.dumps(body)}]

    async def receive():
        return received.pop(0) if received else await asyncio.Event().wait()

    async def send(message):
        sent.append(message)
        if on_send is not None:
            on_send(sent)

    asyncio.run(app({"type": "http", "method": "POST", "path": path, "headers": []}, receive, send))
    return sent


def sent_body(sent: list[dict]) -> str:
    """The body of an answer's messages (post_to_app's), as text."""
    return b"".join(m.get("body", b"") for m in sent).decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `transduce serve` process; its output goes to `log`. Its engine is a thread unless `args` name one (the
    tests that need the engine process, the default, name it: test_engine.py runs the behaviour tests that matter
    across the pipe again; spawning one per test would cost the suite a minute)."""

    def __init__(self, artifact: str, tmp_path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"server-{self.port}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "transduce.cli", "serve", artifact, "--port",
                                          str(self.port), "--threads", "1",
                                          *([] if "--engine" in args else ["--engine", "thread"]), *args],
                                         stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, headers=None, timeout: float = 90.0) -> None:
        import httpx

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/readyz", headers=headers, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the server did not get ready:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def _limited_server(artifact: str, tmp_path_factory, *args: str) -> Iterator[Server]:
    """A server of `artifact` with bearer auth, a queue of 4, 64 rows, 8 sentences and 4 KiB per request (and
    `args`)."""
    tmp = tmp_path_factory.mktemp("server")
    key = tmp / "key"
    key.write_text(KEY + "\n")
    s = Server(artifact, tmp, "--api-key-file", str(key), "--max-queue", "4", "--max-rows", "64",
               "--max-sentences", "8", "--max-body-bytes", "4096", "--default-beam-size", "2", *args)
    try:
        s.wait_ready(headers={"Authorization": f"Bearer {KEY}"})
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def server(long_artifact_dir, tmp_path_factory):
    """One server of the tiny model (512 positions) for the module."""
    with _limited_server(long_artifact_dir, tmp_path_factory) as s:
        yield s


@pytest.fixture(scope="module")
def wide_server(wide_artifact_dir, tmp_path_factory):
    """The same server of the wide model: for the tests that need a request still under way seconds later."""
    with _limited_server(wide_artifact_dir, tmp_path_factory) as s:
        yield warmed(s)


def warmed(s: Server) -> Server:
    """`s` once a full batch has run on it: ONNX Runtime's first run of 64 rows takes half a second of CPU
    (seconds on a busy machine), which a test's deadline should not have to cover."""
    import httpx

    r = httpx.post(s.url + "/v1/translate", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"text": ["one two three"] * 8, "beam_size": 8, "max_len_b": 2})
    assert r.status_code == 200, r.text
    return s
