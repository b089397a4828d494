"""A request on its way through the decode service (service.py), and the events the service hands its sink."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from transduce.runtime.decoding import DecodingOptions
from transduce.runtime.translator import Translation
from transduce.serve.options import ServeError

Event = tuple["Request", str, Any]
Sink = Callable[[list[Event]], None]  # called on the decode thread with one step's events


class Ended:
    """A request's end, as threading.Event's is_set / set / wait, whose Event (a lock and a condition: a few
    microseconds to make) is made only for a caller that waits: the decode thread, an engine process and an
    event loop only set and read it, for every request."""

    __slots__ = ("_set", "_event")
    _lock = threading.Lock()  # one for all: held only to set the flag or hand out the Event

    def __init__(self):
        self._set = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with Ended._lock:
            self._set = True
            event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        with Ended._lock:
            if self._set:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)


class Request:
    """One client's sentences on their way through the service (fields written by the decode thread)."""

    _ids = itertools.count(1)

    def __init__(self, n: int, options: DecodingOptions, timeout: float, sink: Sink | None = None,
                 stream: bool = False, waiter: Any = None):
        self.id = next(self._ids)
        self.options = options
        self.created = time.monotonic()
        self.timeout = timeout  # seconds it may take, as asked
        self.deadline = self.created + timeout  # time.monotonic() past which it is dropped
        self.sink = sink  # where its events go (None: nowhere; translate() waits on `finished`)
        self.stream = stream  # whether it gets "tokens" and "translation" events, not only "done" or "error"
        self.waiter = waiter  # the front end's own state for it; the service never reads it
        self.first_token: float | None = None  # when its first token (or result) was produced
        self.translations: list[Translation | None] = [None] * n
        self.todo: list[int] = []  # its sentences the model decodes (the others are blank)
        self.src: np.ndarray | None = None
        self.lens: np.ndarray | None = None
        self.prepared: list = []
        self.texts: list[str] = []  # its sentences as given (replace_unknowns reads their tokens' text)
        self.prefixes: list[list[int]] | None = None  # each sentence's target prefix (token ids), if given
        self.cohort = None
        self.queued_step = 0  # the running batch's step count when it was queued
        self.error: ServeError | None = None
        self.finished = Ended()

    @property
    def rows(self) -> int:
        """The most rows it takes in the running batch."""
        return len(self.todo) * (1 if self.options.beam_size == 1 else self.options.beam_size)


def deliver(events: list[Event]) -> None:
    """A step's events to their requests' sinks, one call per sink (one sink per front end, usually: then the
    list goes as it is); a request without a sink is skipped."""
    if not events:
        return
    sink = events[0][0].sink
    if sink is not None and all(e[0].sink is sink for e in events):
        sink(events)
        return
    by_sink: dict[int, list[Event]] = {}
    for e in events:
        if e[0].sink is not None:
            by_sink.setdefault(id(e[0].sink), []).append(e)
    for group in by_sink.values():
        group[0][0].sink(group)
