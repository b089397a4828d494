"""The closed-loop load generator of `transduce loadtest --connections`: N keep-alive connections spread over P
processes, each sending its next request as soon as its last one is answered.

A Python client is slow next to a server answering a request in a millisecond, so this one is lean: raw asyncio
streams speaking HTTP/1.1 with keep-alive, every request's bytes encoded once before the load starts, no SSE
(answers come whole, as `wrk` sees them), and the connections spread over several generator processes
(`processes`) so that one interpreter's GIL is not the limit. Every process records each request as (start,
end, status, tokens) on the system-wide monotonic clock; the parent merges the records and counts, as wrk
does, the requests answered inside the measured window (after the warm-up) only.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

# (start, end, status, tokens): times on time.monotonic(); status an HTTP status, or the name of what went wrong
# ("timeout", "ConnectionResetError", ...); tokens of the translations answered (0 unless status 200)
Record = tuple[float, float, int | str, int]


@dataclass(frozen=True)
class ClosedLoop:
    """One closed-loop window: `connections` over `processes` generator processes, `warmup` seconds not counted,
    then `duration` seconds measured; `timeout`: seconds one request may take (client side)."""

    connections: int
    processes: int
    duration: float
    warmup: float
    timeout: float


@dataclass(frozen=True)
class Part:
    """What one generator process runs: its share of the connections, the encoded requests it rotates over (each
    connection from its own offset) and where to send them."""

    host: str
    port: int
    tls: bool
    connections: int
    first_connection: int
    requests: tuple[bytes, ...]
    timeout: float


def encode_requests(url: str, bodies: list[dict], headers: dict[str, str]) -> tuple[bytes, ...]:
    """Each body as the whole HTTP/1.1 request that posts it to `url`'s /v1/translate, keep-alive."""
    u = urlsplit(url)
    host = u.netloc
    path = u.path.rstrip("/") + "/v1/translate"
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json", "Accept: application/json",
             *(f"{k}: {v}" for k, v in headers.items())]
    head = "\r\n".join(lines)
    out = []
    for body in bodies:
        data = json.dumps(body).encode()
        out.append(f"{head}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return tuple(out)


def split_connections(connections: int, processes: int) -> list[tuple[int, int]]:
    """(first connection, connections) for each process that gets any: as even as they divide."""
    used = min(connections, processes)
    out, first = [], 0
    for i in range(used):
        n = connections // used + (i < connections % used)
        out.append((first, n))
        first += n
    return out


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool, float | None]:
    """One HTTP/1.1 response off `reader` -> its status, its body, whether the server keeps the connection open,
    and its Retry-After in seconds (None: none, or not a number of seconds). Content-Length, chunked transfer
    encoding and bodies that end with the connection are read."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head[:-4].decode("latin-1").split("\r\n")
    version, status = status_line.split(" ", 2)[:2]
    fields = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip().lower()
    keep = fields.get("connection") != "close" and version == "HTTP/1.1"
    if "chunked" in fields.get("transfer-encoding", ""):
        chunks = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields, then the blank line
                    pass
                break
            chunks.append((await reader.readexactly(size + 2))[:-2])
        body = b"".join(chunks)
    elif "content-length" in fields:
        body = await reader.readexactly(int(fields["content-length"]))
    else:
        body, keep = await reader.read(), False
    retry = fields.get("retry-after", "")
    return int(status), body, keep, float(retry) if retry.isdigit() else None


def _tokens(body: bytes) -> int:
    """The tokens of a 200 answer's translations (0 where it is not the translate API's JSON)."""
    try:
        return sum(len(t["tokens"]) for t in json.loads(body)["translations"])
    except (ValueError, KeyError, TypeError):
        return 0


async def _connection(part: Part, index: int, end_at: float, out: list[Record]) -> None:
    """One connection's closed loop until `end_at`: a request, its answer, the next request at once; after a 429,
    once its Retry-After has passed (as a client that follows the server's word: resending at once would make the
    load a stream of refusals that cost the server what its queue was protecting)."""
    reader = writer = None
    i = index * 7919  # each connection from its own place in the rotation
    while time.monotonic() < end_at:
        request = part.requests[i % len(part.requests)]
        i += 1
        start = time.monotonic()
        try:
            if writer is None:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(part.host, part.port, ssl=ssl.create_default_context() if part.tls
                                            else None), part.timeout)
            writer.write(request)
            status, body, keep, retry_after = await asyncio.wait_for(read_response(reader), part.timeout)
        except Exception as e:  # noqa: BLE001 - a broken connection or a timeout is a failed request, counted
            timed_out = isinstance(e, (asyncio.TimeoutError, TimeoutError))
            out.append((start, time.monotonic(), "timeout" if timed_out else type(e).__name__, 0))
            if writer is not None:
                writer.close()
            reader = writer = None
            await asyncio.sleep(0.01)  # a server that refuses connections is not hammered in a busy loop
            continue
        out.append((start, time.monotonic(), status, _tokens(body) if status == 200 else 0))
        if not keep:
            writer.close()
            reader = writer = None
        if status == 429 and retry_after:
            await asyncio.sleep(max(0.0, min(retry_after, end_at - time.monotonic())))
    if writer is not None:
        writer.close()


async def _run_part(part: Part, end_at: float) -> list[Record]:
    out: list[Record] = []
    await asyncio.gather(*(_connection(part, part.first_connection + c, end_at, out)
                           for c in range(part.connections)))
    return out


def _child(part: Part, pipe) -> None:
    """A generator process: say it is ready, wait for the time to stop at, run, send the records back."""
    pipe.send("ready")
    end_at = pipe.recv()
    pipe.send(asyncio.run(_run_part(part, end_at)))
    pipe.close()


def run_closed_loop(url: str, requests: tuple[bytes, ...], load: ClosedLoop, during=None) -> tuple[list[Record],
                                                                                                     float, float]:
    """`load` on the server at `url`, the encoded `requests` rotated over -> every process's records merged, and
    the measured window (start, end) on time.monotonic(). `during(window_start, window_end)`, if given, runs in
    this process while the load goes on (it reads the server's CPU time at the window's edges)."""
    u = urlsplit(url)
    tls = u.scheme == "https"
    port = u.port or (443 if tls else 80)
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    procs, pipes = [], []
    for first, n in split_connections(load.connections, load.processes):
        here, there = ctx.Pipe()
        part = Part(u.hostname or "127.0.0.1", port, tls, n, first, requests, load.timeout)
        p = ctx.Process(target=_child, args=(part, there), daemon=True)
        p.start()
        there.close()  # the child's end: only the child holds it now, so its death reads as EOF here
        procs.append(p)
        pipes.append(here)
    try:
        for pipe in pipes:
            _receive(pipe)  # "ready"
        start = time.monotonic() + load.warmup
        end = start + load.duration
        for pipe in pipes:
            pipe.send(end)
        if during is not None:
            during(start, end)
        parts = [_receive(pipe) for pipe in pipes]
    finally:
        for p in procs:
            p.join(timeout=load.timeout + 10)
            if p.is_alive():
                p.kill()
    return merge(parts), start, end


def _receive(pipe):
    """The next message of a generator process; a RuntimeError where it died (its traceback is on stderr)."""
    try:
        return pipe.recv()
    except EOFError:
        raise RuntimeError("a load generator process exited before sending its records") from None


def merge(parts: list[list[Record]]) -> list[Record]:
    """The records of every generator process as one list, in the order the requests were sent."""
    return sorted((r for part in parts for r in part), key=lambda r: r[0])


def in_window(records: list[Record], start: float, end: float) -> list[Record]:
    """The requests answered (or failed) inside [start, end]: what the window counts, as wrk counts."""
    return [r for r in records if start <= r[1] <= end]


def errors_by_status(statuses: Iterable[int | str]) -> dict[str, int]:
    """How many requests ended otherwise than 200, by status (or by what went wrong), e.g. {"429": 3}."""
    out: dict[str, int] = {}
    for s in statuses:
        if s != 200:
            out[str(s)] = out.get(str(s), 0) + 1
    return dict(sorted(out.items()))
