"""A request on its way through the decode service (service.py), and the events the service hands its sink."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from transduce.runtime.decoding import DecodingOptions
from transduce.runtime.decoding.running import Admission, stacked
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
        self.start = 0  # the cohort's number of its first sentence (a cohort may hold several requests)
        self.left = 0  # its sentences still decoding in the running batch
        self.counted = False  # its rows count in the service's rows taken (queued or running)
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


def waiting(queued: Iterable[int], running: int, max_rows: int) -> int:
    """Of the requests queued, in order (their rows), how many the next admission leaves waiting: those from the
    first that does not fit the rows free beside `running` on (the first into an empty batch joins whatever its
    rows). What the 429 counts: requests a batch takes at once are not waiting."""
    free, joining, count = max_rows - running, 0, 0
    for rows in queued:
        if joining == count and (rows <= free or not (running or joining)):
            free -= rows
            joining += 1
        count += 1
    return count - joining


def runs(group: list[Request]) -> list[list[Request]]:
    """An admission's requests as the cohorts they join: consecutive beam-search requests with the same options
    share one (its per-step bookkeeping is numpy over all their sentences, not a cohort's each: every sentence
    decodes as it would alone), every other request has its own (a greedy one's steps are cheapest alone)."""
    out: list[list[Request]] = []
    for req in group:
        opts = req.options
        last = out[-1][0].options if out else None
        if opts.beam_size > 1 and last is not None and last.beam_size > 1 and (last is opts or last == opts):
            out[-1].append(req)
        else:
            out.append([req])
    return out


def admission(run: list[Request], pad_id: int, on_tokens=None) -> Admission:
    """The Admission of one cohort's requests: their sentences in order, each keyed by its number in its
    request (its random draws), with its prefix."""
    if len(run) == 1:
        req = run[0]
        return Admission(req.src, req.lens, req.options, on_tokens=on_tokens, keys=np.array(req.todo),
                         prefixes=None if req.prefixes is None else [req.prefixes[i] for i in req.todo])
    src, lens = stacked([(req.src, req.lens) for req in run], pad_id)
    prefixes = None
    if any(req.prefixes is not None for req in run):
        prefixes = [req.prefixes[i] if req.prefixes is not None else () for req in run for i in req.todo]
    return Admission(src, lens, run[0].options,
                     keys=np.concatenate([np.array(req.todo) for req in run]), prefixes=prefixes)


class UnderWay:
    """The requests in the running batch, by cohort (several beam-search requests may share one: `runs`); the
    decode thread's alone."""

    def __init__(self):
        self._by: dict[Any, list[Request]] = {}

    def __bool__(self) -> bool:
        return bool(self._by)

    def __contains__(self, cohort) -> bool:
        return cohort in self._by

    def add(self, cohort, run: list[Request]) -> None:
        """A cohort's requests, its sentences numbered from the first request's on."""
        start = 0
        for req in run:
            req.cohort, req.start, req.left = cohort, start, len(req.todo)
            start += req.left
        self._by[cohort] = list(run)

    def member(self, cohort, s: int) -> Request | None:
        """The request under way whose sentences include the cohort's sentence s (None: none is)."""
        members = self._by.get(cohort)
        if members is None:
            return None
        if len(members) == 1:
            return members[0]
        for req in members:
            if req.start <= s < req.start + len(req.todo):
                return req
        return None

    def leave(self, req: Request) -> bool:
        """`req` is no longer under way (finished or dropped) -> whether it was."""
        members = self._by.get(req.cohort) if req.cohort is not None else None
        if members is None or req not in members:
            return False
        members.remove(req)
        if not members:
            del self._by[req.cohort]
        return True

    def pop(self, *cohorts) -> list[Request]:
        """The requests of cohorts that left the batch whole (none for a cohort that had none)."""
        return [req for cohort in cohorts for req in self._by.pop(cohort, ())]

    def requests(self) -> list[Request]:
        return [req for members in list(self._by.values()) for req in members]

    def clear(self) -> None:
        self._by.clear()
