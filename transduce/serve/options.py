"""The service's options and the error a request gets when the service cannot answer it with translations."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transduce.errors import InputError, TransduceError
from transduce.runtime.decoding.options import DecodingOptions, documented

SCHEDULERS = ("continuous", "static", "single")
OPTIONS_KEPT = 256  # distinct sets of a request's options kept made


class ServeError(TransduceError):
    """A request the service cannot answer with translations: `status` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int, hint: str | None = None, *, retry_after: float | None = None):
        super().__init__(message, hint)
        self.status = status
        self.retry_after = retry_after


@dataclass(frozen=True)
class ServiceOptions:
    max_rows: int = documented(256, "Decoding rows at once in the running batch (a beam of k takes k per sentence).")
    max_queue: int = documented(64, "Requests waiting for rows; past it a request whose rows do not fit either is "
                                    "answered 429 with Retry-After.")
    max_wait_ms: float = documented(0.0, "An idle batch waits this long after an arrival for others to start with it.")
    join_ratio: float = documented(0.5, "While the batch runs, queued requests join it once their rows reach this "
                                        "share of its rows (0: at every step)...")
    join_steps: int = documented(8, "...or once the oldest has waited this many decoder steps.")
    fill_rows: int = documented(64, "With several engines (--engines), a request goes to the first engine with fewer "
                                     "rows under way than this (a batch this wide steps its rows about as cheaply as "
                                     "a wider one), else to the one with the fewest (0: always the fewest).")
    max_sentences: int = documented(64, "Sentences per request, at most.")
    request_timeout: float = documented(60.0, "Seconds a request may take when it names no timeout of its own (504 "
                                           "past it).")
    # None: the model's (its decoding defaults: an imported model's framework's, else the paper's 4)
    default_beam_size: int | None = documented(None, "Beam size of requests that name none (1 = greedy; not given: "
                                                     "the model's default, 4 for a model transduce trained).")
    encode_aside: bool = documented(False, "Encode arriving requests on a thread of their own while the running batch "
                                           "steps (where the backend can: ONNX Runtime on the CPU), so that the "
                                           "running rows do not wait for an arrival's encoder: a lower p99 where a "
                                           "core is spare; by default they are encoded between two steps.")
    idle_spin_ms: float = documented(2.0, "An engine process (--engine process) that runs out of work polls its pipe "
                                          "this long before it sleeps, so a request that comes soon after is taken "
                                          "at once and on warm caches, not after a sleeping process's wake-up (0: "
                                          "it sleeps at once).")
    scheduler: str = documented("continuous", "continuous: admit sentences at every decoder step; static: only into an "
                                           "empty batch, run to completion (a dynamic batcher's way); single: one "
                                           "request at a time. The last two are for comparison (transduce loadtest).",
                             choices=SCHEDULERS)

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise InputError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}",
                             params=("scheduler",))
        for name in ("max_rows", "max_queue", "max_sentences", "default_beam_size"):
            v = getattr(self, name)
            if v is None and name == "default_beam_size":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{name} must be an integer >= 1, got {v!r}", params=(name,))
        for name in ("join_steps", "fill_rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InputError(f"{name} must be an integer >= 0, got {v!r}", params=(name,))
        for name in ("max_wait_ms", "join_ratio", "request_timeout", "idle_spin_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise InputError(f"{name} must be a number >= 0, got {v!r}", params=(name,))
        if not self.request_timeout > 0:  # every request would time out at once
            raise InputError(f"request_timeout must be a number of seconds > 0, got {self.request_timeout!r}",
                             params=("request_timeout",))
        if self.default_beam_size is not None and self.default_beam_size > self.max_rows:
            # a request naming no beam could never be decoded
            raise InputError(f"default_beam_size {self.default_beam_size} takes more rows than max_rows "
                             f"({self.max_rows}) holds: every request naming no beam would be refused",
                             hint="a smaller default beam, or more rows", params=("default_beam_size", "max_rows"))


def request_defaults(model: DecodingOptions, options: ServiceOptions) -> DecodingOptions:
    """What a request's options go over: the model's defaults, with the server's default beam where it sets one
    (InputError where that beam takes more rows than the running batch holds)."""
    if options.default_beam_size is not None:
        model = dataclasses.replace(model, beam_size=options.default_beam_size,
                                    nbest=min(model.nbest, options.default_beam_size))
    if model.beam_size > options.max_rows:
        raise InputError(f"the model's default beam size ({model.beam_size}) takes more rows than max_rows "
                         f"({options.max_rows}) holds: every request naming no beam would be refused",
                         hint="set default_beam_size, or more rows", params=("default_beam_size", "max_rows"))
    return model


def request_options(translator, defaults: DecodingOptions, given: dict, fields: tuple[str, ...]) -> DecodingOptions:
    """A request's decoding options over `defaults` (the Translator's checks): InputError naming the field for one
    not among `fields`, an invalid one, or a length penalty whose normalisation overflows."""
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise InputError(f"unknown option {unknown[0]!r}", hint=f"options: {', '.join(fields)}", params=(unknown[0],))
    opts = translator.options(given, "the request", defaults)
    try:  # the normalisation of the longest translation must be a number (a huge alpha overflows)
        ok = math.isfinite(opts.penalty(translator.config.max_positions))
    except OverflowError:
        ok = False
    if not ok:
        raise InputError(f"length_penalty {opts.length_penalty} overflows the length normalisation",
                         hint="use a length penalty of a few units at most", params=("length_penalty",))
    return opts


def options_key(given: dict) -> tuple:
    """A request's options as a key of what is made of them, their values' types in it (True == 1 and 4.0 == 4 in
    Python, but they are not the same options)."""
    return tuple((name, type(v), v) for name, v in given.items())


class Kept(dict):
    """What is made once per key (a request's options, most requests sharing a few), at most OPTIONS_KEPT of them
    (emptied when full)."""

    def made(self, key, make: Callable[[], Any]) -> Any:
        """make()'s value for `key`, made once; a key that does not hash is made each time."""
        try:
            got = self.get(key)
        except TypeError:
            return make()
        if got is None:
            if len(self) >= OPTIONS_KEPT:
                self.clear()
            got = self[key] = make()
        return got
