"""The backend protocol: what decoding, parity and the bench need from a framework, and nothing more.

A backend owns the device memory of one decoding run:
  encode(src_ids, src_lengths)        -> an opaque encoder result (cross K/V per decoder layer)
  begin(encoded, row_src, capacity)   -> a state: the self-attention cache preallocated to `capacity`
                                         positions for len(row_src) rows; row r decodes source row_src[r]
  step(state, tokens, k, ban_eos)     -> top-k (log-probs, token ids) of the next token for every row,
                                         as numpy (R, k); the step's K/V are written into the cache in place
  step_log_probs(state, tokens)       -> the full (R, vocab) fp32 log-probs (parity, tests); same side effects
  reorder(state, rows, row_src)       -> keep/duplicate rows: row i of the new state is row rows[i] of the
                                         old one (beam selection, finished rows dropped); row_src is the
                                         new rows' source index, cross K/V are re-gathered only if it changed
  admit(state, encoded)               -> (optional: a running batch) one new row per source of `encoded`, after
                                         the state's rows, at position 0 beside rows further on; the state's
                                         sources become those its rows decode, ascending, then encoded's
                                         (renumbered_sources); cross K/V of every width share the state,
                                         padded and masked by source length. A backend without it decodes a
                                         running batch only from empty (the scheduler waits for that)
  end(state)                          -> the run is over, its buffers may be reused by the next run (the
                                         state is not used again); decoding calls it after every run
  shards(batch, beam)                 -> None, or backends (views of this one) that decode parts of a batch
                                         faster at the same time than this one decodes it whole; decoding
                                         then deals the sentences out to them and runs one search per part,
                                         each in its own thread. Offered only where a sentence's results do
                                         not depend on the sentences decoded beside it.
  step_graphs() / only_step_graph(g)  -> the step graph files a backend decodes with, and a context in which
                                         it runs every step on one of them (parity checks each)
  tuning()                            -> what the backend chose when it loaded (threads, sessions, parts),
                                         as JSON-ready values for reports

Tokens and token ids cross the protocol as numpy int64 arrays; everything else stays on the backend's
device. PAD and BOS are never proposed by `step` (their log-probs are excluded from the top-k), and EOS
is excluded when ban_eos is set (minimum length).

Backends subclass `Backend` (a Protocol with defaults for its optional members, as Polygraphy's runners
share a base): every member a caller uses is declared here, and callers use nothing else.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np


class Backend(Protocol):
    name: str
    config: dict[str, Any]  # the model config (ModelConfig.to_dict())
    device: Any  # where its buffers are: "cpu", "cuda:N" or a torch.device
    artifact_dir: str | None = None  # the directory it loaded (with the tokenizer); None for the eager model
    manifest: dict[str, Any] | None = None  # that directory's manifest.json; None for the eager model

    def encode(self, src_ids: np.ndarray, src_lengths: np.ndarray) -> Any: ...

    def begin(self, encoded: Any, row_src: np.ndarray, capacity: int) -> Any: ...

    def step(self, state: Any, tokens: np.ndarray, k: int, ban_eos: bool = False) -> tuple[np.ndarray, np.ndarray]:
        ...

    def step_log_probs(self, state: Any, tokens: np.ndarray) -> np.ndarray: ...

    def reorder(self, state: Any, rows: np.ndarray, row_src: np.ndarray) -> None: ...

    def encoder_outputs(self, encoded: Any) -> dict[str, np.ndarray]: ...

    def end(self, state: Any) -> None:
        """The run is over (its state is not used again). By default nothing to hand back."""

    def admit(self, state: Any, encoded: Any) -> None:
        """Add a row for each source of `encoded` to a running state (see the module's docstring); by default
        this backend cannot (admits_rows is False)."""
        from transduce.errors import BackendUnavailable

        raise BackendUnavailable(f"the {self.name} backend cannot add sentences to a running batch",
                                 hint="a running batch on it admits sentences only when it is empty")

    def shards(self, batch: int, beam: int) -> list[Backend] | None:
        """Backends to decode a batch's parts with at the same time, or None (the default) to decode it whole."""
        return None

    def step_graphs(self) -> list[str]:
        """The step graph files this backend decodes with, where it has several to check (default: none)."""
        return []

    @contextlib.contextmanager
    def only_step_graph(self, graph: str | None) -> Iterator[None]:
        """Meanwhile run every step on `graph`, one of step_graphs() (None: as the backend chooses)."""
        if graph is not None and graph not in self.step_graphs():
            raise ValueError(f"{graph!r} is not one of this backend's step graphs {self.step_graphs()}")
        yield

    def tuning(self) -> dict[str, Any]:
        """What the backend chose when it loaded (JSON-ready; default: nothing to report)."""
        return {}


def missing_members(backend: Any) -> list[str]:
    """The members of the protocol that `backend` lacks (a backend written without subclassing Backend, which
    gives the optional ones their defaults)."""
    declared = [n for n in vars(Backend) if not n.startswith("_")] + list(Backend.__annotations__)
    return sorted(n for n in set(declared) if not hasattr(backend, n))


def admits_rows(backend: Any) -> bool:
    """Whether `backend` implements admit (its states take rows at different positions)."""
    own = getattr(type(backend), "admit", None)
    return own is not None and own is not Backend.admit


def renumbered_sources(row_src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sources a state's rows decode, ascending (the state's sources after an admit, before the new
    ones), and each row's index among them."""
    kept, inverse = np.unique(np.asarray(row_src, np.int64), return_inverse=True)
    return kept, inverse.reshape(-1).astype(np.int64)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, as under taskset or a container's
    cpuset), not the machine's count: what parts of a batch decoded at once can really use."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on this OS (macOS, Windows)
        return os.cpu_count() or 1


def numpy_topk(log_probs: np.ndarray, k: int, banned: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of each row of a (R, V) float32 array, best first, with `banned` ids excluded."""
    lp = log_probs
    if banned:
        lp = lp.copy()
        lp[:, banned] = -np.inf
    if k == 1:  # greedy: plain indexing, a few microseconds cheaper per step than take_along_axis
        ids = lp.argmax(axis=1)
        return lp[np.arange(len(ids)), ids][:, None].astype(np.float32), ids[:, None].astype(np.int64)
    part = np.argpartition(-lp, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(lp, part, axis=1), axis=1, kind="stable")
    ids = np.take_along_axis(part, order, axis=1)
    return np.take_along_axis(lp, ids, axis=1).astype(np.float32), ids.astype(np.int64)


def banned_ids(config: dict[str, Any], ban_eos: bool) -> list[int]:
    """PAD and the start token are never generated; a start token that is EOS (imported fairseq and FSMT models
    start from EOS) stays allowed but where ban_eos asks."""
    ids = [config["pad_id"]]
    if config["bos_id"] not in (config["pad_id"], config["eos_id"]):
        ids.append(config["bos_id"])
    if ban_eos:
        ids.append(config["eos_id"])
    return ids


def ban_bias(config: dict[str, Any], ban_eos: bool) -> np.ndarray:
    """(V,) float32 added to the log-probs before a top-k: -inf at the banned ids, 0 elsewhere."""
    b = np.zeros(config["vocab_size"], np.float32)
    b[banned_ids(config, ban_eos)] = -np.inf
    return b


def move_rows_torch(cache, dst, src, p: int) -> None:
    """Beam reorder of a torch cache (2 x layers, rows, heads, capacity, head_dim), in place: rows `dst`
    take the first p slots of rows `src` (index tensors on the cache's device), for every layer at once.
    The sources are gathered before anything is written, so a source may be a destination too."""
    filled = cache[:, :, :, :p]  # a view: index_copy_ writes through it
    filled.index_copy_(1, dst, filled.index_select(1, src))
