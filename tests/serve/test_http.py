"""The server's HTTP protocol's coalesced writes (its header deadline is tested over real sockets in test_front)."""

from __future__ import annotations

import asyncio

from transduce.serve.http import CorkedTransport


class Recorded:  # a transport that records its writes
    def __init__(self):
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data):
        assert not self.closed
        self.writes.append(bytes(data))

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def get_write_buffer_size(self):
        return 0

    def get_extra_info(self, name):
        return ("127.0.0.1", 1) if name == "peername" else None


def test_writes_of_one_turn_go_out_as_one_write_after_it():
    async def run():
        raw = Recorded()
        t = CorkedTransport(raw, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"{}")
        assert raw.writes == [] and t.get_write_buffer_size() == 21  # nothing yet: the turn has not ended
        await asyncio.sleep(0)
        assert raw.writes == [b"HTTP/1.1 200 OK\r\n\r\n{}"]
        t.writelines([b"a", b"b"])
        await asyncio.sleep(0)
        assert raw.writes[1:] == [b"ab"]
        assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the wrapped transport's
        return raw

    asyncio.run(run())


def test_close_sends_what_waits_first_and_a_closed_transport_gets_nothing():
    async def run():
        raw = Recorded()
        t = CorkedTransport(raw, asyncio.get_running_loop())
        t.write(b"last words")
        t.close()
        assert raw.writes == [b"last words"] and raw.closed
        t.write(b"too late")
        await asyncio.sleep(0)  # the flush finds the transport closing: no write
        assert raw.writes == [b"last words"] and t.is_closing()

    asyncio.run(run())
