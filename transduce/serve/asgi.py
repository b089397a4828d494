"""The HTTP plumbing of the server's raw ASGI app: reading a body under a size limit and a deadline, JSON in and
out (orjson), the error shape, and the disconnect watch.

Errors are JSON {"error": {"message", "status", "hint", "field", "sentence"}}; "sentence" is the index of the
sentence in the request's list, counted from 0 as the stream events count them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from transduce.errors import TransduceError
from transduce.runtime.decoding.options import nesting_depth
from transduce.serve.options import ServeError
from transduce.serve.stream import ClientLeft

JSON = [(b"content-type", b"application/json")]
CLOSE = (b"connection", b"close")
_OPTS = orjson.OPT_SERIALIZE_NUMPY
# Lists and objects a request field may nest (the deepest the API takes is 2: prefixes and suppress as token-id
# lists): deeper, a field is refused before anything reads it (a value hundreds deep exhausts the stack of every
# recursive check, repr and hash that meets it)
MAX_FIELD_DEPTH = 8


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=_OPTS)


def error_body(e: TransduceError, status: int) -> dict[str, Any]:
    err: dict[str, Any] = {"message": str(e.args[0]) if e.args else type(e).__name__, "status": status}
    if e.hint:
        err["hint"] = e.hint
    sentence = getattr(e, "sentence", None)
    if sentence is not None:
        err["field"], err["sentence"] = getattr(e, "field", "text"), sentence
    elif e.params:
        err["field"] = e.params[0].split("=")[0]
    return {"error": err}


async def send_json(send, status: int, body: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = body if isinstance(body, bytes) else dumps(body)
    await send({"type": "http.response.start", "status": status,
                "headers": [*JSON, (b"content-length", str(len(data)).encode()), *(headers or ())]})
    await send({"type": "http.response.body", "body": data})


async def send_error(send, e: TransduceError, status: int) -> None:
    headers = []
    if isinstance(e, ServeError) and e.retry_after is not None:
        headers.append((b"retry-after", str(max(1, round(e.retry_after))).encode()))
    if status in (408, 413):  # the rest of the body is not read: the connection cannot carry another request
        headers.append(CLOSE)
    await send_json(send, status, error_body(e, status), headers)


def header(scope, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


# scope["extensions"] keys our HTTP protocol (http.py) sets: it enforces the whole request's arrival deadline
# itself, and gives a future done when the client disconnects (no task per request waits on the receive channel)
DEADLINE_HELD = "transduce.deadline_held"
DISCONNECTED = "transduce.disconnected"


async def read_body(scope, receive, limit: int, timeout: float) -> bytes:
    """The request's body: ServeError 413 past `limit` bytes, 408 when it has not all arrived within `timeout`
    seconds of the headers (a client that stalls or trickles it; where the HTTP protocol holds that deadline, it
    answers the 408 and closes the connection, and this sees the client leave); ClientLeft when the client went
    away."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ServeError(f"the request body has {int(declared)} bytes; this server takes at most {limit}", 413,
                         hint="send fewer or shorter sentences per request")
    if scope.get("extensions", {}).get(DEADLINE_HELD):
        return await _body(receive, limit)
    try:
        async with asyncio.timeout(timeout):
            return await _body(receive, limit)
    except TimeoutError:
        raise ServeError(f"the request body did not arrive within {timeout:g} s", 408,
                         hint="send the whole body at once, right after the headers") from None


async def _body(receive, limit: int) -> bytes:
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientLeft
    body = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise _too_big(limit)
        return body
    chunks, size = [body], len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientLeft
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_big(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_big(limit: int) -> ServeError:
    return ServeError(f"the request body is over {limit} bytes", 413,
                      hint="send fewer or shorter sentences per request")


def too_deep(obj: dict[str, Any]) -> str | None:
    """The first field of `obj` whose value nests lists or objects more than MAX_FIELD_DEPTH deep (None: none)."""
    return next((name for name, value in obj.items()
                 if nesting_depth(value, MAX_FIELD_DEPTH + 1) > MAX_FIELD_DEPTH), None)


def json_object(body: bytes, fields: tuple[str, ...], required: tuple[str, ...]) -> dict[str, Any]:
    """The body's JSON object, its fields checked by name against `fields`, `required` there (ServeError 400)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ServeError(f"the request body is not JSON: {e}", 400, hint='send {"text": ["a sentence"]}') from None
    if not isinstance(obj, dict):
        raise ServeError(f"the request body must be a JSON object, got {type(obj).__name__}", 400,
                         hint='send {"text": ["a sentence"]}')
    unknown = sorted(set(obj) - set(fields))
    if unknown:
        e = ServeError(f"unknown field {unknown[0]!r}", 400, hint=f"fields: {', '.join(fields)}")
        e.params = (unknown[0],)
        raise e
    deep = too_deep(obj)
    if deep is not None:
        e = ServeError(f"{deep} nests lists or objects more than {MAX_FIELD_DEPTH} deep", 400,
                       hint="no field of this API takes more than 2")
        e.params = (deep,)
        raise e
    for name in required:
        if name not in obj:
            example = ", ".join(f'"{n}": ["a sentence"]' for n in required)
            e = ServeError(f"the field {name!r} (a list of sentences) is missing", 400, hint=f"send {{{example}}}")
            e.params = (name,)
            raise e
    return obj


def watch_disconnect(scope, receive) -> asyncio.Future:
    """A future done when the client disconnects, once the request's body has been read: our HTTP protocol's
    (DISCONNECTED), else a task that waits on the receive channel, which then has nothing but http.disconnect
    (or the response's completion) to give. Give it to `unwatch` when the request is done."""
    given = scope.get("extensions", {}).get(DISCONNECTED)
    if given is not None:
        return given
    return asyncio.get_running_loop().create_task(_disconnected(receive))


def unwatch(gone: asyncio.Future) -> None:
    if isinstance(gone, asyncio.Task):  # (the protocol's future is its connection's, left as it is)
        gone.cancel()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
