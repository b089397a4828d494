"""The front end's side of the decode thread's messages: one hand-over per step into the event loop, each
request's events queued on its Waiter, and streamed text detokenised incrementally.

The decode thread calls a LoopSink with every event of one step (service.py); the sink schedules one dispatch
on the event loop (call_soon_threadsafe; an engine's frame read on the loop is dispatched at once), which
appends each event to its request's Waiter and wakes the coroutine waiting there. A request's coroutine waits
on its Waiter and on the client's connection at once (the ASGI receive channel's http.disconnect), so nothing
polls.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections import deque
from typing import Any


class ClientLeft(Exception):
    """The client disconnected while its request was under way."""


class LoopSink:
    """A DecodeService sink that hands each step's events to one event loop (made on that loop's thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.thread = threading.get_ident()  # the loop's

    def __call__(self, events: list) -> None:  # on the decode thread, or the loop's (an engine's frames read there)
        if threading.get_ident() == self.thread:
            _dispatch(events)  # no wake-up of the loop through its self-pipe, no turn of it waited for
            return
        try:
            self.loop.call_soon_threadsafe(_dispatch, events)
        except RuntimeError:  # the event loop has closed (the server stopped): nobody waits for them
            pass


def _dispatch(events: list) -> None:
    for req, kind, data in events:
        waiter = req.waiter
        if waiter is not None:
            waiter.push(kind, data)


class Waiter:
    """One request's events in the event loop, and the coroutine waiting for them."""

    __slots__ = ("events", "_wake")

    def __init__(self):
        self.events: deque[tuple[str, Any]] = deque()
        self._wake: asyncio.Future | None = None

    def push(self, kind: str, data: Any) -> None:
        self.events.append((kind, data))
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def wait(self, gone: asyncio.Future, timeout: float | None = None) -> bool:
        """Until an event is queued (True), `timeout` passes (False) or `gone` (the client's disconnect) is done
        (ClientLeft)."""
        if self.events:
            return True
        if gone.done():
            raise ClientLeft
        wake = self._wake = asyncio.get_running_loop().create_future()

        def woken(_: Any) -> None:
            if not wake.done():
                wake.set_result(None)

        gone.add_done_callback(woken)
        try:
            if timeout is None:
                await wake
            else:
                try:
                    await asyncio.wait_for(wake, timeout)
                except TimeoutError:
                    return False
        finally:
            gone.remove_done_callback(woken)
            self._wake = None
        if self.events:
            return True
        raise ClientLeft


WINDOW_LOOK = 8  # tokens in a whole decode's window before an anchor is looked for
_OPEN_ENTITY = re.compile(r"&#?[0-9A-Za-z]*$")  # the start of an XML entity (Moses escapes "&", "|", quotes...)
# "@-@" as a word may be Moses' split hyphen, written "-" with the words on both sides joined: until the word after
# it has come, it (spelt in pieces) and the space before it are not sure
_OPEN_HYPHEN = re.compile(r" ?@(?:-@?)?$")


class IncrementalText:
    """A sentence's text as its tokens arrive: add(token) -> the token events ready, (token, the text it adds),
    finish() -> those still held once the sentence has ended; their texts concatenated are the tokenizer's decode
    of every token.

    Each add decodes a short window of the last tokens twice (the text already given out of it, and the text with
    the new token) and gives the difference, so a sentence costs O(its length) in all, where decoding everything
    so far at each token would be quadratic. The window starts at a token already given out: a decoder that drops
    the word-boundary space of the first piece it decodes (SentencePiece's "▁", Metaspace) drops it from both
    decodes alike. New text is held back while it ends in U+FFFD (a byte-level piece of a character not yet
    complete) or does not extend the old (a decoder that rewrites earlier text). A tokenizer that says it is not
    prefix_stable (Moses' detokenizer writes a token by the ones after it: a straight quote opens or closes by
    their count, a word's space by the next token, and unescapes the entities subword pieces spell in parts) is
    decoded whole at each token instead, and each token's event waits for the next token or the sentence's end: its
    text is what the two decodes agree on, less an entity not yet closed or a split hyphen's start. "Whole" starts
    at the tokenizer's last stream_anchor (where it has one: a place its decode carries nothing over), looked
    for every few tokens, so that a sentence costs O(its length) there too, but for stretches with no anchor
    (inside quotes)."""

    __slots__ = ("tokenizer", "ids", "start", "read", "whole", "given", "held", "last", "anchor", "look")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window's first token
        self.read = 0  # tokens whose text has been given out
        self.whole = not getattr(tokenizer, "prefix_stable", True)  # decoded whole, each event a token late
        self.given = ""  # (whole) the text given out, from the window's start
        self.held: int | None = None  # (whole) the token whose event waits for the next one
        self.last = ""  # (whole) the decode of the window's tokens so far
        self.anchor = getattr(tokenizer, "stream_anchor", None) if self.whole else None
        self.look = WINDOW_LOOK  # (whole) the window's length in tokens at which an anchor is looked for next

    def add(self, token: int) -> list[tuple[int, str]]:
        self.ids.append(token)
        if self.whole:
            return self._add_whole(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.start:self.read]) if self.read > self.start else ""
        after = decode(self.ids[self.start:])
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return [(token, "")]
        self.start, self.read = self.read, len(self.ids)
        return [(token, after[len(before):])]

    def _add_whole(self, token: int) -> list[tuple[int, str]]:
        now = self.tokenizer.decode(self.ids[self.start:])
        out = []
        if self.held is not None:
            sure = os.path.commonprefix([self.last, now])
            open_ = _OPEN_ENTITY.search(sure) or _OPEN_HYPHEN.search(sure)  # see their comments
            out.append((self.held, self._give(sure[:open_.start()] if open_ else sure)))
        self.held, self.last = token, now
        if self.anchor is not None and len(self.ids) - self.start >= self.look:
            self._move_window()
        return out

    def _move_window(self) -> None:
        """The window's start moved to the tokenizer's anchor, where the text before it has been given out: what
        follows decodes alone as it does after the rest. Looked for again WINDOW_LOOK tokens on (a look costs
        about what decoding the window once does, and the window is decoded at every token)."""
        window = self.ids[self.start:]
        k = self.anchor(window)
        if k:
            head = self.tokenizer.decode(window[:k]) + " "
            if self.given.startswith(head) and self.last.startswith(head):
                self.start += k
                self.given, self.last = self.given[len(head):], self.last[len(head):]
        self.look = len(self.ids) - self.start + WINDOW_LOOK

    def finish(self) -> list[tuple[int, str]]:
        """The event still held (a whole decoder's last token), with the rest of the text. Where the end rewrote
        text already given out (Moses: a split hyphen "@-@" that joins a word given out already, a straight quote
        among them, which then no longer counts as one), what follows their common start comes again: the texts
        then repeat a little rather than lose the end."""
        if self.held is None:
            return []
        held, self.held = self.held, None
        if not self.last.startswith(self.given):  # (text given out that the end rewrote: the rest is not lost)
            self.given = os.path.commonprefix([self.given, self.last])
        return [(held, self._give(self.last))]

    def _give(self, text: str) -> str:
        """What `text` adds to the text given out (none where it does not extend it)."""
        if len(text) <= len(self.given) or not text.startswith(self.given):
            return ""
        added, self.given = text[len(self.given):], text
        return added
