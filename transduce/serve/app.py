"""The HTTP API, a raw ASGI app: it checks requests, submits them to the decode service in the event loop and
waits for their events; the event loop never runs model code.

  POST /v1/translate   {"text": [...], "prefix", options, "truncate", "timeout", "stream"} -> translations, or with
                       "stream": true Server-Sent Events: "token" (greedy: the text each token adds),
                       "translation" (each sentence as it finishes), then "done" with the whole answer, or "error"
  POST /v1/score       {"source": [...], "target": [...], "length_penalty", "length_penalty_form", "source_lang",
                        "target_lang", "truncate"}
                       -> each target's teacher-forced score: {"scores": [{"log_prob", "score", ...}]}
  POST /translate      LibreTranslate's request and answer (libre.py); GET /languages its language list
  GET  /v1/models      the artifact's identity
  GET  /healthz        the process and its decode thread are alive (no auth)
  GET  /readyz         loaded, warmed up and not draining
  GET  /metrics        Prometheus exposition

Errors are JSON {"error": {"message", "hint", "field", "sentence"}} with the command line's messages: 400 for
bad input, 401 without a valid bearer token (--api-key-file), 404 and 405, 408 for a body that does not arrive
in time, 413 for a body over the limit, 429 with Retry-After when the queue is full, 503 while draining, 504
past the request's deadline. A request that does not stream costs the event loop: reading its body, one orjson
parse, tokenizing in submit, one wake-up when the decode thread's step message says it is done, one orjson
dump; its client's disconnect is seen from the ASGI receive channel, never polled.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from transduce.errors import InputError, TransduceError
from transduce.serve import libre
from transduce.serve.asgi import (
    dumps,
    error_body,
    json_object,
    read_body,
    send_error,
    send_json,
    unwatch,
    watch_disconnect,
)
from transduce.serve.service import OPTION_FIELDS, SCORE_OPTION_FIELDS, DecodeService, ServeError
from transduce.serve.stream import ClientLeft, IncrementalText, LoopSink, Waiter

REQUEST_FIELDS = ("text", "prefix", "truncate", "timeout", "stream") + OPTION_FIELDS
SCORE_FIELDS = ("source", "target", "truncate") + SCORE_OPTION_FIELDS
SSE_KEEPALIVE_S = 1.0  # a stream with no event for this long gets a comment line
ROUTES = "POST /v1/translate, /v1/score; GET /v1/models, /healthz, /readyz, /metrics"
OPEN_PATHS = ("/healthz", "/languages")  # answered without the bearer token
READ_TIMEOUT_S = 10.0


def translation_json(t, matrix: bool = False) -> dict[str, Any]:
    """A Translation as the API answers it; with alignments (return_attention or replace_unknowns) each candidate's
    "alignment", [[source, target], ...], and with matrix (return_attention) its "attention" rows too."""
    out = {"text": t.text, "score": t.score, "tokens": t.tokens, "source_tokens": t.source_tokens,
           "unknown": t.unknown, "truncated": t.truncated, "empty": t.empty,
           "nbest": [_candidate_json(c, matrix) for c in t.nbest]}
    if t.attention is not None:
        out["alignment"] = out["nbest"][0]["alignment"]
        if matrix:
            out["attention"] = out["nbest"][0]["attention"]
    return out


def _candidate_json(c, matrix: bool) -> dict[str, Any]:
    out = {"text": c.text, "score": c.score, "log_prob": c.log_prob, "finished": c.finished, "tokens": c.tokens}
    if c.attention is not None:
        out["alignment"] = c.alignment
        if matrix:
            out["attention"] = c.attention.round(6)
    return out


class App:
    """The ASGI app over one DecodeService."""

    def __init__(self, service: DecodeService, identity: dict[str, Any], api_key: str | None = None,
                 max_body_bytes: int = 1 << 20, read_timeout: float = READ_TIMEOUT_S,
                 languages: libre.Languages | None = None):
        self.service, self.identity = service, identity
        self.key = api_key.encode() if api_key is not None else None
        self.max_body_bytes, self.read_timeout = max_body_bytes, read_timeout
        self.languages = languages if languages is not None else libre.Languages.of(service.translator.tokenizer)
        self.metrics = service.metrics
        self._sink: LoopSink | None = None
        self.routes = {"/v1/translate": {"POST": self.translate}, "/v1/score": {"POST": self.score},
                       "/v1/models": {"GET": self.models}, "/healthz": {"GET": self.healthz},
                       "/readyz": {"GET": self.readyz}, "/metrics": {"GET": self.prometheus},
                       "/translate": {"POST": self.libre_translate}, "/languages": {"GET": self.libre_languages}}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        methods = self.routes.get(path)
        if self.key is not None and path not in OPEN_PATHS and not self.authorized(scope):
            if path != "/translate":  # LibreTranslate's clients may send the key in the body instead
                return await _unauthorized(send)
            scope = {**scope, "transduce.auth": False}
        if methods is None:
            return await self.failed(send, ServeError(f"no such endpoint: {method} {path}", 404, hint=ROUTES), 404)
        handler = methods.get(method)
        if handler is None:
            return await self.failed(send, ServeError(f"{method} is not allowed on {path}", 405, hint=ROUTES), 405)
        await handler(scope, receive, send)

    def authorized(self, scope) -> bool:
        """Whether the request carries `Authorization: Bearer <key>` (compared in constant time)."""
        given = b""
        for k, v in scope["headers"]:
            if k == b"authorization":
                given = v
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    def key_matches(self, key: Any) -> bool:
        return isinstance(key, str) and hmac.compare_digest(key.encode(), self.key)

    async def failed(self, send, e: TransduceError, status: int) -> None:
        if self.metrics and 400 <= status < 500 and status not in (429, 499):
            self.metrics.bad.inc()
        await send_error(send, e, status)

    def sink(self) -> LoopSink:
        """The decode thread's way into this event loop (made on the first request: the loop runs by then)."""
        if self._sink is None or self._sink.loop is not asyncio.get_running_loop():
            self._sink = LoopSink(asyncio.get_running_loop())
        return self._sink

    # -- small routes ----------------------------------------------------------------------------------------
    async def healthz(self, scope, receive, send) -> None:
        ok = self.service.alive()
        await send_json(send, 200 if ok else 503, {"status": "ok" if ok else self.service.stopped})

    async def readyz(self, scope, receive, send) -> None:
        s = self.service
        ready = s.ready and s.alive() and not s.draining
        why = "ready" if ready else "draining" if s.draining else "not ready"
        await send_json(send, 200 if ready else 503, {"status": why})

    async def prometheus(self, scope, receive, send) -> None:
        if self.metrics is None:
            body, kind = b"metrics are off\n", "text/plain"
            status = 404
        else:
            # in a thread: with --engine process it waits for the engines' figures, which the event loop reads
            (body, kind), status = await asyncio.to_thread(self.metrics.exposition), 200
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", kind.encode()), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def models(self, scope, receive, send) -> None:
        await send_json(send, 200, {"data": [self.identity]})

    # -- the translation routes ------------------------------------------------------------------------------
    async def body(self, scope, receive, send, fields, required) -> dict[str, Any] | None:
        """The request's JSON object, or None once an error has been answered."""
        try:
            return json_object(await read_body(scope, receive, self.max_body_bytes, self.read_timeout), fields,
                               required)
        except ServeError as e:
            await self.failed(send, e, e.status)
        except ClientLeft:
            pass
        return None

    async def translate(self, scope, receive, send) -> None:
        body = await self.body(scope, receive, send, REQUEST_FIELDS, ("text",))
        if body is None:
            return
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            e = ServeError(f"stream must be true or false, got {stream!r}", 400)
            e.params = ("stream",)
            return await self.failed(send, e, 400)
        options = {k: body[k] for k in OPTION_FIELDS if k in body}
        waiter = Waiter()
        try:
            req = self.service.submit(body["text"], options, body.get("truncate", False), body.get("timeout"),
                                      self.sink(), body.get("prefix"), stream=stream, waiter=waiter)
        except InputError as e:
            return await self.failed(send, e, 400)
        except ServeError as e:
            return await self.failed(send, e, e.status)
        gone = watch_disconnect(scope, receive)
        try:
            if stream:
                await self._stream(req, waiter, gone, send)
                return
            try:
                await waiter.wait(gone)
            except ClientLeft:
                return self.client_left(req)
            kind, data = waiter.events.popleft()
            if kind == "error":
                return await self.failed(send, data, data.status)
            matrix = req.options.return_attention
            await send_json(send, 200, {"translations": [translation_json(t, matrix) for t in req.translations]})
        finally:
            unwatch(gone)

    async def _stream(self, req, waiter: Waiter, gone: asyncio.Future, send) -> None:
        """The request's events as Server-Sent Events, several to a write when a step gave several."""
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache")]})
        texts: dict[int, IncrementalText] = {}
        tokenizer, eos = self.service.translator.tokenizer, self.service.translator.config.eos_id
        matrix = req.options.return_attention
        while True:
            try:
                if not await waiter.wait(gone, SSE_KEEPALIVE_S):  # a comment line keeps proxies' streams open
                    await send({"type": "http.response.body", "body": b": keep-alive\n\n", "more_body": True})
                    continue
            except ClientLeft:
                return self.client_left(req)
            out, last = [], False
            while waiter.events and not last:
                kind, data = waiter.events.popleft()
                if kind == "tokens":
                    for s, t in zip(*data, strict=True):
                        if t != eos:
                            i = req.todo[s]
                            for token, text in texts.setdefault(i, IncrementalText(tokenizer)).add(t):
                                out.append(_event(b"token", {"sentence": i, "token": token, "text": text}))
                elif kind == "translation":
                    for token, text in texts[data[0]].finish() if data[0] in texts else ():
                        out.append(_event(b"token", {"sentence": data[0], "token": token, "text": text}))
                    out.append(_event(b"translation", {"sentence": data[0],
                                                       "translation": translation_json(data[1], matrix)}))
                elif kind == "done":
                    out.append(_event(b"done", {"translations": [translation_json(t, matrix)
                                                                 for t in req.translations]}))
                    last = True
                else:  # the tokens of the sentences cut short, then why
                    for i, text in texts.items():
                        out.extend(_event(b"token", {"sentence": i, "token": token, "text": t})
                                   for token, t in text.finish())
                    out.append(_event(b"error", error_body(data, data.status)))
                    last = True
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": not last})
            if last:
                return

    def client_left(self, req) -> None:
        if self.metrics:
            self.metrics.cancelled.inc()
        # the access log never sees a response that had no client to go to: one line here instead
        logging.getLogger("uvicorn.error").info("request %d: the client left before its answer; its %d sentence(s) "
                                                "were cancelled (499)", req.id, len(req.translations))
        self.service.cancel(req, ServeError("the client disconnected", 499))

    async def score(self, scope, receive, send) -> None:
        """POST /v1/score: the pairs' teacher-forced scores, worked out on the decode thread (service.score)."""
        body = await self.body(scope, receive, send, SCORE_FIELDS, ("source", "target"))
        if body is None:
            return
        try:
            scores = await self.service.score_async(body["source"], body["target"],
                                                    {k: body[k] for k in SCORE_OPTION_FIELDS if k in body},
                                                    body.get("truncate", False))
        except InputError as e:
            return await self.failed(send, e, 400)
        except ServeError as e:
            return await self.failed(send, e, e.status)
        except Exception as e:  # noqa: BLE001 - the backend failed: the documented error shape, not a bare 500
            logging.getLogger("uvicorn.error").exception("a score request failed")
            return await self.failed(send, ServeError(f"scoring failed: {type(e).__name__}: {e}", 500), 500)
        await send_json(send, 200, {"scores": [{"log_prob": s.log_prob, "score": s.score, "tokens": s.tokens,
                                                "token_log_probs": s.token_log_probs, "truncated": s.truncated}
                                               for s in scores]})

    async def libre_translate(self, scope, receive, send) -> None:
        await libre.translate(self, scope, receive, send)

    async def libre_languages(self, scope, receive, send) -> None:
        await send_json(send, 200, self.languages.listing())


def create_app(service: DecodeService, identity: dict[str, Any], api_key: str | None = None,
               max_body_bytes: int = 1 << 20, read_timeout: float = READ_TIMEOUT_S,
               languages: libre.Languages | None = None) -> App:
    return App(service, identity, api_key, max_body_bytes, read_timeout, languages)


def _event(kind: bytes, data: Any) -> bytes:
    return b"event: " + kind + b"\ndata: " + dumps(data) + b"\n\n"


async def _unauthorized(send) -> None:
    body = dumps({"error": {"message": "a valid bearer token is required", "status": 401,
                            "hint": "send Authorization: Bearer <the key in the server's --api-key-file>"}})
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive, send) -> None:
    """The lifespan protocol, for servers that speak it (transduce serve turns it off): nothing to set up."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
