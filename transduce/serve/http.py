"""The server's HTTP protocol: uvicorn's httptools protocol with a deadline on each request's arrival, and its
writes coalesced into one socket write per turn of the event loop (uvicorn writes a response's head and body
apart: two system calls, and two segments for the client to read, per answer)."""

from __future__ import annotations


class CorkedTransport:
    """A transport whose writes wait for the end of the event loop's current turn, then go out as one. Closing
    sends what waits first; everything else is the wrapped transport's."""

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport, loop):
        self._transport, self._loop = transport, loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def http_protocol(timeout: float):
    """uvicorn's httptools protocol over a CorkedTransport, with a deadline on each request's arrival: a
    connection that opens and sends nothing is closed after `timeout` seconds, and one that sends part of a
    request (its headers or its body) and stalls, or trickles it, is answered 408 and closed. The app learns
    through the scope's extensions that the deadline is held here (asgi.DEADLINE_HELD) and gets a future done
    when the client disconnects (asgi.DISCONNECTED), instead of a task per request on the receive channel. Idle
    connections between requests are uvicorn's keep-alive timeout's."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from transduce.serve.asgi import DEADLINE_HELD, DISCONNECTED

    def answer(what: str) -> bytes:
        body = (b'{"error": {"message": "the request %s did not arrive within %g s", "status": 408, "hint": '
                b'"send the whole request at once"}}' % (what.encode(), timeout))
        return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body))

    late = {False: answer("headers"), True: answer("body")}  # by whether the headers had come

    class Protocol(HttpToolsProtocol):
        _deadline = None
        _begun = False  # bytes of a request have come
        _headers = False  # and all its headers
        def connection_made(self, transport) -> None:
            self._gones: list = []  # the futures for a disconnect of the requests not answered yet, oldest first
            super().connection_made(CorkedTransport(transport, self.loop))
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._begun, self._headers = True, False
            gone = self.loop.create_future()
            self._gones.append(gone)
            self.scope["extensions"] = {DEADLINE_HELD: True, DISCONNECTED: gone}
            self._arm()

        def on_headers_complete(self) -> None:
            self._headers = True
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()  # it has all arrived
            self._begun = False
            super().on_message_complete()

        def on_response_complete(self) -> None:
            if self._begun and len(self._gones) == 1:  # the request arriving was answered before its body
                self._disarm()  # came (a 413 on its declared length): nothing more to wait for
                self._begun = False
            if self._gones:
                self._gones.pop(0)
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            for gone in self._gones:
                if not gone.done():
                    gone.set_result(None)
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(timeout, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                if self._begun:
                    self.transport.write(late[self._headers])
                self.transport.close()

    return Protocol
