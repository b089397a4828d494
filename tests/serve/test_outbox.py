"""The front end's writes to an engine's pipe: whole frames, in order, and never a wait on the event loop."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time

import pytest
import uvloop

from transduce.serve.outbox import Outbox, header

FRAME = 300_000  # bytes: more than a socket pair holds


def _frames(n: int) -> list[bytes]:
    return [bytes([i]) * (FRAME + i) for i in range(n)]


def _read(conn, n: int, into: list) -> threading.Thread:
    t = threading.Thread(target=lambda: into.extend(conn.recv_bytes() for _ in range(n)), daemon=True)
    t.start()
    return t


def test_frames_are_what_connection_reads():
    ours, theirs = multiprocessing.Pipe()
    box = Outbox(ours)
    got: list[bytes] = []
    reader = _read(theirs, 3, got)
    for data in (b"", b"x", b"y" * 70_000):
        box.send(data)
    reader.join(timeout=30)
    assert got == [b"", b"x", b"y" * 70_000]
    assert header(5) == b"\0\0\0\x05" and header(1 << 31) == b"\xff\xff\xff\xff" + (1 << 31).to_bytes(8, "big")


def test_on_the_loop_a_send_never_waits_and_the_rest_goes_out_as_the_pipe_drains():
    """Attached to a loop, sends larger than the pipe return at once (nothing reads yet); once something reads,
    the loop's writer callback writes the rest: every frame whole and in order, then the callback is removed."""
    ours, theirs = multiprocessing.Pipe()
    box, frames, got = Outbox(ours), _frames(4), []

    async def main():
        box.attach(asyncio.get_running_loop())
        for f in frames:
            box.send(f)  # would block here before: nobody reads
        waiting = box.pending()
        reader = _read(theirs, len(frames), got)
        while box.pending():
            await asyncio.sleep(0.01)
        await asyncio.to_thread(reader.join, 30)
        return waiting

    for factory in (asyncio.new_event_loop, uvloop.new_event_loop):
        got.clear()
        with asyncio.Runner(loop_factory=factory) as runner:
            waiting = runner.run(main())
        assert waiting > FRAME and got == frames and box.watching is None
        assert ours.poll(0) is False and os.get_blocking(ours.fileno())  # reads still wait
    box.close()


def test_what_waits_for_a_stopped_loop_is_written_when_threads_take_over():
    ours, theirs = multiprocessing.Pipe()
    box, frames, got = Outbox(ours), _frames(3), []
    loop = uvloop.new_event_loop()
    box.attach(loop)
    for f in frames:
        box.send(f)
    assert box.pending()  # the loop never ran: its callback never wrote
    loop.close()
    reader = _read(theirs, len(frames), got)
    box.attach(None)  # waits here, in this thread, as the reader drains the pipe
    reader.join(timeout=30)
    assert got == frames and box.pending() == 0 and box.watching is None


def test_senders_in_threads_wait_for_the_pipe_and_their_frames_stay_whole():
    ours, theirs = multiprocessing.Pipe()
    box, got = Outbox(ours), []
    per = {n: [bytes([n]) * (FRAME // 3 + k) for k in range(5)] for n in range(4)}
    senders = [threading.Thread(target=lambda n=n: [box.send(f) for f in per[n]]) for n in per]
    for s in senders:
        s.start()
    reader = _read(theirs, 20, got)
    for s in senders:
        s.join(timeout=30)
    reader.join(timeout=30)
    for n, frames in per.items():  # each sender's frames whole, in its order
        assert [f for f in got if f[0] == n] == frames


def test_what_waits_for_a_stopped_loop_is_dropped_where_the_engine_has_gone():
    """Handing back to threads writes what waited; an engine gone meanwhile takes nothing, and nothing raises (the
    server's stop goes on to the other engines)."""
    ours, theirs = multiprocessing.Pipe()
    box = Outbox(ours)
    loop = uvloop.new_event_loop()
    box.attach(loop)
    box.send(b"s" * 1_000_000)
    loop.close()
    theirs.close()
    box.attach(None)
    assert box.pending() == 0


def test_a_thread_waits_for_a_pipe_nobody_reads_only_until_its_timeout():
    ours, _theirs = multiprocessing.Pipe()
    box = Outbox(ours)
    with pytest.raises(TimeoutError):
        box.send(b"s" * 1_000_000, timeout=0.2)
    assert box.pending() == 0


def test_closing_an_outbox_the_loop_watches_removes_the_watch_first():
    """Closed while the reading loop (in its own thread) waits to write: the loop stops watching the descriptor
    (a closed one watched would wake it at every turn)."""
    ours, _theirs = multiprocessing.Pipe()
    box, calls = Outbox(ours), []
    loop = uvloop.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    writable = box._writable
    box._writable = lambda: (calls.append(1), writable())
    box.attach(loop)
    box.send(b"s" * 1_000_000)
    assert box.watching is loop
    time.sleep(0.1)  # its writer callback is added on the loop
    box.close()
    time.sleep(0.3)
    before = len(calls)
    time.sleep(0.3)
    loop.call_soon_threadsafe(loop.stop)
    runner.join(timeout=10)
    loop.close()
    assert len(calls) - before < 5, len(calls) - before
