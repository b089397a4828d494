"""The front end's writes to an engine process's pipe, which never make the event loop wait.

The event loop that reads an engine's frames must never block writing to it: an engine blocked sending a large
step frame reads nothing until that frame is read, so a loop blocked on a full pipe would wait for it forever.
An Outbox frames each message as multiprocessing's Connection.recv_bytes reads it and writes what the pipe takes
at once (MSG_DONTWAIT, leaving the descriptor's own blocking mode alone); what is left waits in order for the
pipe to drain: on the reading event loop (a writer callback), or, while threads read the frames, in the sender's
thread. Where the pipe is not a socket (Windows' named pipes), messages are sent as before, waiting.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
import time
from typing import Any

POLL_MS = 50  # how long a sender's thread waits for the pipe before it looks again for a loop that took over
HANDBACK_WAIT_S = 10.0  # how long a hand-back waits for an engine to read what was left (a wedged one is killed)


def _socket_of(conn: Any) -> socket.socket | None:
    """`conn`'s descriptor as a socket (a duplicate of it) for writes that do not wait; None where it is not one."""
    if not hasattr(socket, "MSG_DONTWAIT"):
        return None
    try:
        sock = socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
    except (OSError, AttributeError, ValueError):
        return None
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) != socket.SOCK_STREAM:
        sock.close()
        return None
    return sock


def header(n: int) -> bytes:
    """The length prefix Connection.recv_bytes reads before `n` bytes."""
    return struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!i", -1) + struct.pack("!Q", n)


class Outbox:
    """Framed messages to one engine process (see the module). `attach` names the event loop reading the engine's
    frames (None: threads read them)."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.sock = _socket_of(conn)
        self.fd = self.sock.fileno() if self.sock is not None else -1  # (kept: a closed socket's reads -1)
        self.lock = threading.Lock()  # one writer at a time: frames go out whole and in order
        self.out = bytearray()  # framed bytes not written yet
        self.loop: asyncio.AbstractEventLoop | None = None
        self.watching: asyncio.AbstractEventLoop | None = None  # the loop with a writer callback for `out`

    def send(self, data: bytes, timeout: float | None = None) -> None:
        """One message's bytes, framed; OSError where the engine has gone (TimeoutError where a thread waited
        `timeout` seconds for it to read)."""
        if self.sock is None:
            with self.lock:
                self.conn.send_bytes(data)
            return
        with self.lock:
            self.out += header(len(data))
            self.out += data
            self._write(None if timeout is None else time.monotonic() + timeout)

    def pending(self) -> int:
        """Bytes waiting for the pipe to drain."""
        return len(self.out)

    def _write(self, deadline: float | None = None) -> None:
        """`out` into the pipe (the lock held): what it takes at once; the rest is left to the reading loop's writer
        callback, or waited for here where threads read the frames (waiting then stalls nobody), until `deadline`
        (TimeoutError). An engine gone (OSError) takes nothing more: `out` is dropped."""
        if self.watching is not None:  # the loop's callback writes, in order
            return
        while not self._drain():
            loop = self.loop
            if loop is not None:
                self._watch(loop)
                return
            if deadline is not None and time.monotonic() > deadline:
                self.out.clear()
                raise TimeoutError("the engine process read nothing for too long")
            socket_wait(self.sock, POLL_MS)

    def _drain(self) -> bool:
        """As much of `out` as the pipe takes now (the lock held) -> whether all of it went; OSError where the
        engine has gone (`out` dropped: it takes nothing more)."""
        while self.out:
            try:
                del self.out[:self.sock.send(self.out, socket.MSG_DONTWAIT)]
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                self.out.clear()
                raise
        return True

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.call_soon_threadsafe(self._add_writer, loop)
            self.watching = loop
        except RuntimeError:  # the loop has closed: attach(None) writes what is left
            pass

    def _add_writer(self, loop: asyncio.AbstractEventLoop) -> None:
        with self.lock:
            if self.watching is not loop:  # handed back meanwhile
                return
            loop.add_writer(self.fd, self._writable)
            os.set_blocking(self.fd, True)  # uvloop's (libuv's) poll made it non-blocking: reads wait

    def _writable(self) -> None:
        """On the event loop: the pipe has room for (some of) `out`."""
        with self.lock:
            if self.watching is None:
                return
            try:
                if not self._drain():  # full again: called again
                    return
            except OSError:  # the engine has gone: its reader fails what it had
                pass
            self._unwatch()

    def _unwatch(self) -> None:
        loop, self.watching = self.watching, None
        self._forget(loop)

    def _forget(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """`loop` no longer watches the descriptor."""
        if loop is not None:
            try:
                loop.remove_writer(self.fd)
            except Exception:  # noqa: BLE001 - a closed loop has forgotten it already
                pass

    def attach(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """The event loop now reading the engine's frames, or None (that loop has stopped): threads read them again,
        and what waited for the loop's callback is written here (dropped where the engine has gone, or reads
        nothing for HANDBACK_WAIT_S: its reader fails its requests)."""
        self.loop = loop  # first, unlocked: a sender waiting in its thread sees it and hands over
        if self.sock is None:
            return
        with self.lock:
            if loop is None:
                self._unwatch()
                os.set_blocking(self.fd, True)
            if self.out:
                try:
                    self._write(time.monotonic() + HANDBACK_WAIT_S)
                except OSError:
                    pass

    def close(self) -> None:
        """The socket closed, once no loop watches it (a watched descriptor closed would wake the loop for ever)."""
        if self.sock is None:
            return
        with self.lock:
            self.out.clear()
            loop, self.watching = self.watching, None
        if loop is not None and loop.is_running():
            try:
                loop.call_soon_threadsafe(self._close_on, loop)
                return
            except RuntimeError:  # closed meanwhile
                pass
        self._close_on(loop)

    def _close_on(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._forget(loop)
        self.sock.close()


def socket_wait(sock: socket.socket, ms: int) -> None:
    """Until `sock` can be written to, or `ms` have passed."""
    import select

    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    poller.poll(ms)
