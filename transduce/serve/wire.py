"""What crosses between the front end and an engine process (--engine process): plain values only.

Messages are pickled tuples of None, bools, numbers, strings, bytes, lists, tuples and dicts, read back by an
unpickler that refuses every class and function (`loads`): a frame names no code to run, even between our own two
processes. Arrays cross as (dtype, shape, bytes), decoding options as their fields' values, a finished sentence
as its DecodeResult's hypotheses, an error as (status, message, hint, params, sentence, retry_after). Client text
never reaches the engine: it gets token ids, and sends token ids back.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np

from transduce.errors import TransduceError
from transduce.runtime.decoding import DecodingOptions
from transduce.runtime.decoding.options import DecodeResult, Hypothesis
from transduce.serve.options import ServeError


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # only plain values cross: no class or function is looked up
        raise pickle.UnpicklingError(f"a frame named {module}.{name}: only plain values cross between the processes")


def dumps(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return _PlainUnpickler(io.BytesIO(data)).load()


def array(a: np.ndarray | None) -> tuple | None:
    return None if a is None else (a.dtype.str, a.shape, a.tobytes())


def unarray(given: tuple | None) -> np.ndarray | None:
    if given is None:
        return None
    dtype, shape, data = given
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()


FIELDS = DecodingOptions.names()  # a request's options cross as their values, in this order


def options(opts: DecodingOptions) -> tuple:
    """A request's (resolved) decoding options as their fields' values, whatever fields DecodingOptions has."""
    return tuple(getattr(opts, name) for name in FIELDS)


def unoptions(given: tuple) -> DecodingOptions:
    return DecodingOptions(**dict(zip(FIELDS, given, strict=True)))


def result(r: DecodeResult) -> list[tuple]:
    return [(h.tokens, h.score, h.log_prob, h.token_log_probs, h.finished, array(h.attention)) for h in r.hypotheses]


def unresult(given: list[tuple]) -> DecodeResult:
    return DecodeResult(tuple(Hypothesis(tuple(t), s, lp, tuple(tlp), fin, unarray(att))
                              for t, s, lp, tlp, fin, att in given))


def error(e: BaseException) -> tuple:
    if isinstance(e, ServeError):
        status, retry = e.status, e.retry_after
    else:  # a backend's own exception: the server's failure, said with its type
        status, retry = 500, None
    message = str(e.args[0]) if e.args else type(e).__name__
    if not isinstance(e, TransduceError) and type(e).__name__ not in message:  # ours say what they are
        message = f"{type(e).__name__}: {message}"
    return (status, message, getattr(e, "hint", None), tuple(getattr(e, "params", ())), getattr(e, "sentence", None),
            retry)


def unerror(given: tuple) -> ServeError:
    status, message, hint, params, sentence, retry = given
    e = ServeError(message, status, hint, retry_after=retry)
    e.params = tuple(params)
    if sentence is not None:
        e.sentence = sentence  # type: ignore[attr-defined]
    return e


def load_error(kind: str, error: tuple, failed: type[TransduceError]) -> TransduceError:
    """The engine's own error while loading (a bad artifact: the command's exit 2), as its class where it is one of
    transduce's, with its message and hint; else as `failed`."""
    from transduce import errors

    _, text, hint, params, _, _ = error
    cls = getattr(errors, kind, None)
    try:
        made = cls(text, hint, params=params)
    except TypeError:  # not one of transduce's errors, or one with a signature of its own
        made = None
    if not isinstance(made, TransduceError):
        made = failed(f"the engine process failed to load: {text}", hint)
    return made
