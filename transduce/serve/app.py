"""The HTTP API (FastAPI): it checks requests, hands them to the decode service through a worker thread and
waits for their events; the event loop never runs model code.

  POST /v1/translate   {"text": [...], "prefix", options, "truncate", "timeout", "stream"} -> translations, or with
                       "stream": true Server-Sent Events: "token" (greedy), "translation" (each sentence as it
                       finishes), then "done" with the whole answer, or "error"
  POST /v1/score       {"source": [...], "target": [...], "length_penalty", "length_penalty_form", "truncate"}
                       -> each target's teacher-forced score: {"scores": [{"log_prob", "score", ...}]}
  GET  /v1/models      the artifact's identity
  GET  /healthz        the process and its decode thread are alive (no auth)
  GET  /readyz         loaded, warmed up and not draining
  GET  /metrics        Prometheus exposition

Errors are JSON {"error": {"message", "hint", "field", "sentence"}} with the command line's messages: 400 for
bad input, 401 without a valid bearer token (--api-key-file), 413 for a body over the limit, 429 with
Retry-After when the queue is full, 503 while draining, 504 past the request's deadline.
"""

import asyncio
import hmac
import json
import logging
from typing import Any

from transduce.errors import InputError, TransduceError
from transduce.serve.service import OPTION_FIELDS, SCORE_OPTION_FIELDS, DecodeService, ServeError

REQUEST_FIELDS = ("text", "prefix", "truncate", "timeout", "stream") + OPTION_FIELDS
SCORE_FIELDS = ("source", "target", "truncate") + SCORE_OPTION_FIELDS
DISCONNECT_POLL_S = 0.05  # how often a waiting request checks that its client is still there
SSE_KEEPALIVE_S = 1.0  # a stream with no event for this long gets a comment line
ROUTES = "POST /v1/translate, /v1/score; GET /v1/models, /healthz, /readyz, /metrics"


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


def translation_json(t, matrix: bool = False) -> dict[str, Any]:
    """A Translation as the API answers it; with alignments (return_attention or replace_unknowns) each candidate's
    "alignment", [[source, target], ...], and with matrix (return_attention) its "attention" rows too."""
    out = {"text": t.text, "score": t.score, "tokens": list(t.tokens), "source_tokens": t.source_tokens,
           "unknown": t.unknown, "truncated": t.truncated, "empty": t.empty,
           "nbest": [_candidate_json(c, matrix) for c in t.nbest]}
    if t.attention is not None:
        out["alignment"] = out["nbest"][0]["alignment"]
        if matrix:
            out["attention"] = out["nbest"][0]["attention"]
    return out


def _candidate_json(c, matrix: bool) -> dict[str, Any]:
    out = {"text": c.text, "score": c.score, "log_prob": c.log_prob, "finished": c.finished, "tokens": list(c.tokens)}
    if c.attention is not None:
        out["alignment"] = [list(pair) for pair in c.alignment]
        if matrix:
            out["attention"] = c.attention.round(6).tolist()
    return out


class BearerAuth:
    """ASGI middleware: every path but /healthz needs `Authorization: Bearer <key>` (401 otherwise). The key is
    compared in constant time and never written anywhere."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/healthz":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {"message": "a valid bearer token is required", "status": 401,
                                     "hint": "send Authorization: Bearer <the key in the server's --api-key-file>"}})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body.encode()})


def create_app(service: DecodeService, identity: dict[str, Any], api_key: str | None = None,
               max_body_bytes: int = 1 << 20):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(title="transduce", docs_url=None, redoc_url=None, openapi_url=None)
    if api_key is not None:
        app.add_middleware(BearerAuth, key=api_key)
    metrics = service.metrics

    def failed(e: TransduceError, status: int) -> JSONResponse:
        headers = {}
        if isinstance(e, ServeError) and e.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(e.retry_after)))
        if metrics and 400 <= status < 500 and status not in (429, 499):
            metrics.bad.inc()
        return JSONResponse(error_body(e, status), status_code=status, headers=headers)

    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """404 and 405 in the documented error shape, not the framework's {"detail"}."""
        if exc.status_code == 404:
            e = ServeError(f"no such endpoint: {request.method} {request.url.path}", 404, hint=ROUTES)
        elif exc.status_code == 405:
            e = ServeError(f"{request.method} is not allowed on {request.url.path}", 405, hint=ROUTES)
        else:
            e = ServeError(str(exc.detail), exc.status_code)
        return failed(e, exc.status_code)

    @app.get("/healthz")
    async def healthz():
        ok = service.alive()
        return JSONResponse({"status": "ok" if ok else "decode thread stopped"}, status_code=200 if ok else 503)

    @app.get("/readyz")
    async def readyz():
        ready = service.ready and service.alive() and not service.draining
        why = "ready" if ready else "draining" if service.draining else "not ready"
        return JSONResponse({"status": why}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            return Response("metrics are off\n", status_code=404)
        body, kind = metrics.exposition()
        return Response(body, media_type=kind)

    @app.get("/v1/models")
    async def models():
        return {"data": [identity]}

    _add_score_route(app, service, failed, max_body_bytes)

    @app.post("/v1/translate")
    async def translate(request: Request):
        try:
            body = await _read_json(request, max_body_bytes)
        except ServeError as e:
            return failed(e, e.status)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def listener(kind: str, data: Any) -> None:  # on the decode thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, data))
            except RuntimeError:  # the event loop has closed (the server stopped): nobody waits for it
                pass

        options = {k: body[k] for k in OPTION_FIELDS if k in body}
        try:
            req = await run_in_threadpool(service.submit, body.get("text"), options, body.get("truncate", False),
                                          body.get("timeout"), listener, body.get("prefix"))
        except InputError as e:
            return failed(e, 400)
        except ServeError as e:
            return failed(e, e.status)
        if body.get("stream"):
            return StreamingResponse(_sse(service, req, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        while True:
            try:
                kind, data = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    _client_left(service, req)
                    return Response(status_code=499)
                continue
            if kind == "done":
                return {"translations": [translation_json(t, req.options.return_attention) for t in req.translations]}
            if kind == "error":
                return failed(data, data.status)

    return app


def _add_score_route(app, service: DecodeService, failed, max_body_bytes: int) -> None:
    """POST /v1/score: the pairs' teacher-forced scores, worked out on the decode thread (service.score)."""
    from fastapi import Request
    from starlette.concurrency import run_in_threadpool

    @app.post("/v1/score")
    async def score(request: Request):
        try:
            body = await _read_json(request, max_body_bytes, SCORE_FIELDS, ("source", "target"))
            scores = await run_in_threadpool(service.score, body["source"], body["target"],
                                             {k: body[k] for k in SCORE_OPTION_FIELDS if k in body},
                                             body.get("truncate", False))
        except InputError as e:
            return failed(e, 400)
        except ServeError as e:
            return failed(e, e.status)
        except Exception as e:  # noqa: BLE001 - the backend failed: the documented error shape, not a bare 500
            logging.getLogger("uvicorn.error").exception("a score request failed")
            return failed(ServeError(f"scoring failed: {type(e).__name__}: {e}", 500), 500)
        return {"scores": [{"log_prob": s.log_prob, "score": s.score, "tokens": list(s.tokens),
                            "token_log_probs": list(s.token_log_probs), "truncated": s.truncated} for s in scores]}


def _client_left(service: DecodeService, req) -> None:
    if service.metrics:
        service.metrics.cancelled.inc()
    # uvicorn's access log never sees a response that had no client to go to: one line here instead
    logging.getLogger("uvicorn.error").info("request %d: the client left before its answer; its %d sentence(s) "
                                            "were cancelled (499)", req.id, len(req.translations))
    service.cancel(req, ServeError("the client disconnected", 499))


async def _read_json(request, limit: int, fields: tuple[str, ...] = REQUEST_FIELDS,
                     required: tuple[str, ...] = ("text",)) -> dict[str, Any]:
    """The request's JSON object, its fields checked by name against `fields`, `required` there (ServeError 400
    or 413)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ServeError(f"the request body has {declared} bytes; this server takes at most {limit}", 413,
                         hint="send fewer or shorter sentences per request")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ServeError(f"the request body is over {limit} bytes", 413,
                             hint="send fewer or shorter sentences per request")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise ServeError(f"the request body is not JSON: {e}", 400, hint='send {"text": ["a sentence"]}') from None
    if not isinstance(body, dict):
        raise ServeError(f"the request body must be a JSON object, got {type(body).__name__}", 400,
                         hint='send {"text": ["a sentence"]}')
    unknown = sorted(set(body) - set(fields))
    if unknown:
        e = ServeError(f"unknown field {unknown[0]!r}", 400, hint=f"fields: {', '.join(fields)}")
        e.params = (unknown[0],)
        raise e
    for name in required:
        if name not in body:
            example = ", ".join(f'"{n}": ["a sentence"]' for n in required)
            e = ServeError(f"the field {name!r} (a list of sentences) is missing", 400, hint=f"send {{{example}}}")
            e.params = (name,)
            raise e
    if not isinstance(body.get("stream", False), bool):
        e = ServeError(f"stream must be true or false, got {body['stream']!r}", 400)
        e.params = ("stream",)
        raise e
    return body


async def _sse(service: DecodeService, req, events: asyncio.Queue):
    """The request's events as Server-Sent Events; a client that leaves cancels the request."""
    try:
        while True:
            try:
                kind, data = await asyncio.wait_for(events.get(), SSE_KEEPALIVE_S)
            except TimeoutError:  # a comment line: proxies keep the stream open, and a client that left is seen
                yield ": keep-alive\n\n"
                continue
            if kind == "token":
                yield _event("token", data)
            elif kind == "translation":
                yield _event("translation", {"sentence": data["sentence"],
                                             "translation": translation_json(data["translation"],
                                                                             req.options.return_attention)})
            elif kind == "done":
                yield _event("done", {"translations": [translation_json(t, req.options.return_attention)
                                                       for t in req.translations]})
                return
            else:
                yield _event("error", error_body(data, data.status))
                return
    finally:
        if not req.finished.is_set():
            _client_left(service, req)


def _event(kind: str, data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"
