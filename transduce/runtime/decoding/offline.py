"""Greedy and beam search, written once over the backend protocol (numpy bookkeeping only).

Lengths count generated tokens including the final EOS. The maximum length of sentence i is
ceil(max_len_a * src_len_i + max_len_b) (the paper: input length + 50; src_len without EOS), capped by
the model's max_positions. A hypothesis that reaches it without EOS is returned with finished=False.

Scores: `log_prob` is the sum of the token log-probs (EOS included); `score` = log_prob / lp(length)
with lp the length penalty: "gnmt" ((5 + len) / 6) ** alpha (Wu et al., 2016; alpha 0.6 as in the
paper), "plain" len ** alpha, or "none". Greedy uses the same score formula, so beam 1 with alpha 0
is greedy search exactly.

Beam search keeps for each sentence k live beams and a list of finished hypotheses. Each step, the
2k best continuations over all k beams are ranked; an EOS among the first k becomes a finished
hypothesis, and the first k non-EOS continuations become the next beams. When a sentence is done is
`early_stopping`'s rule (and at its maximum length in any case, its live beams returned unfinished):
  - "heuristic" (the default; Hugging Face's early_stopping=False): once it has k finished hypotheses and the
    best live beam, normalised at its current length, does not beat the k-th of them.
  - "k-finished" (CTranslate2, fairseq, Hugging Face's early_stopping=True): once it has round(k x patience)
    finished hypotheses, whatever the live beams could still reach.
  - "exact": once it has k finished hypotheses and no live beam can beat the k-th of them: a live beam's raw
    score only falls, so its best possible normalised score is raw / lp(max_len) (alpha >= 0). The k best
    hypotheses of the beam, provably, at the cost of steps past the point where the other rules stop.
Rows of finished sentences are dropped from the backend at the next reorder.

The search itself is search.py's, run by running.py's running batch: decode() admits a whole batch at once
and runs it until it is empty; a server admits sentences at any step boundary into the same machine.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Sequence

import numpy as np

from transduce.errors import BackendUnavailable, InputError
from transduce.runtime.backends.base import Backend, FullOutputs, Shards, has_capability
from transduce.runtime.decoding.options import DecodeResult, DecodingOptions
from transduce.runtime.decoding.running import RunningBatch
from transduce.runtime.devices import usable_cpus


def decode(backend: Backend, src_ids: np.ndarray, src_lengths: np.ndarray, options: DecodingOptions,
           search: str = "auto", keys: np.ndarray | None = None,
           prefixes: Sequence[Sequence[int]] | None = None) -> list[DecodeResult]:
    """Decode one padded batch. src_ids (B, S) int64, src_lengths (B,) int64 (EOS included).

    search: "auto" (greedy for beam_size 1, else beam), "greedy" or "beam" (beam search even for k=1).
    keys: (B,) each sentence's key of its random draws when sampling (its number in the caller's input, so that
    its sample does not depend on the batch it is decoded in); None: 0 .. B-1. prefixes: B target prefixes
    (token ids; empty: none) each sentence's first steps are forced through; its hypotheses begin with it and
    their log-probs count its tokens (None: none).
    """
    if search not in ("auto", "greedy", "beam"):
        raise InputError(f"search must be 'auto', 'greedy' or 'beam', got {search!r}")
    src_ids = np.ascontiguousarray(src_ids, dtype=np.int64)
    src_lengths = np.ascontiguousarray(src_lengths, dtype=np.int64)
    _check_batch(src_ids, src_lengths)
    keys = np.arange(len(src_ids)) if keys is None else np.asarray(keys, np.int64)
    if keys.shape != (len(src_ids),):
        raise InputError(f"keys must hold one key per row of src_ids ({len(src_ids)}), got shape {keys.shape}")
    if len(src_ids) == 0:
        return []
    greedy = search == "greedy" or (search == "auto" and options.beam_size == 1)
    search = "greedy" if greedy else "beam"  # resolved once, for every part
    shards = has_capability(backend, Shards)
    parts = backend.shards(len(src_ids), 1 if greedy else options.beam_size) if shards else None
    if parts and len(parts) > 1:
        return _decode_in_parts(parts, src_ids, src_lengths, options, search, keys, prefixes)
    return _decode_one(backend, src_ids, src_lengths, options, search, keys, prefixes)


def _check_batch(src_ids: np.ndarray, src_lengths: np.ndarray) -> None:
    """A padded batch whose lengths are its rows': one per row, each 1..width (a backend would otherwise
    drop sentences or read padding, silently)."""
    if src_ids.ndim != 2:
        raise InputError(f"src_ids must be a (batch, length) array, got shape {src_ids.shape}")
    if src_lengths.shape != (len(src_ids),):
        raise InputError(f"src_lengths must hold one length per row of src_ids ({len(src_ids)}), got shape "
                         f"{src_lengths.shape}")
    bad = np.flatnonzero((src_lengths < 1) | (src_lengths > src_ids.shape[1]))
    if bad.size:
        raise InputError(f"src_lengths[{bad[0]}] is {src_lengths[bad[0]]}: each length must be 1..{src_ids.shape[1]} "
                         "(the padded width), EOS included")


def _decode_one(backend: Backend, src_ids: np.ndarray, src_lengths: np.ndarray, options: DecodingOptions,
                search: str, keys: np.ndarray, prefixes: Sequence[Sequence[int]] | None = None) -> list[DecodeResult]:
    """One batch (or part) with the search decode resolved: "greedy" or "beam"."""
    batch = RunningBatch(backend)
    cohort = batch.admit(src_ids, src_lengths, options, search, keys=keys, prefixes=prefixes)
    results = batch.run_until_empty()
    return [r for _, r in sorted(results[cohort], key=lambda ir: ir[0])]


_PARTS_POOL: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # (threads, pool): the parts after
# the first are decoded there (made when first needed, and again with more threads if a decode needs more)
_PARTS_POOL_LOCK = threading.Lock()


def _forget_parts_pool() -> None:
    """In a forked child: the parent's pool threads do not exist here (submitting to it would hang)."""
    global _PARTS_POOL, _PARTS_POOL_LOCK
    _PARTS_POOL, _PARTS_POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parts_pool)


def _decode_in_parts(parts: list[Backend], src_ids: np.ndarray, src_lengths: np.ndarray, options: DecodingOptions,
                     search: str, keys: np.ndarray,
                     prefixes: Sequence[Sequence[int]] | None = None) -> list[DecodeResult]:
    """The batch's sentences dealt round-robin to the backend's parts (sentence i to part i % n: a batch sorted
    by length gives each part a like share), each part decoded by the same search, at the same time: the
    first in this thread, the others in a pool's threads. Each sentence is decoded exactly as in one batch
    (the same padded source width; a backend offers parts only where a row's results do not depend on the
    rows beside it), and the results come back in the batch's order. An error in any part is raised once
    every part has stopped."""
    global _PARTS_POOL
    n = min(len(parts), len(src_ids))
    index = [np.arange(j, len(src_ids), n) for j in range(n)]
    futures: list[concurrent.futures.Future] = []
    with _PARTS_POOL_LOCK:  # held while submitting: a decode on another thread may replace the pool meanwhile
        try:
            if _PARTS_POOL is None or _PARTS_POOL[0] < n - 1:
                if _PARTS_POOL is not None:
                    _PARTS_POOL[1].shutdown(wait=False)  # its threads end once idle; submitted work still runs
                size = max(n - 1, usable_cpus())
                pool = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="transduce-decode-part")
                _PARTS_POOL = (size, pool)
            for j in range(1, n):
                futures.append(_PARTS_POOL[1].submit(_decode_one, parts[j], src_ids[index[j]], src_lengths[index[j]],
                                                     options, search, keys[index[j]], _part(prefixes, index[j])))
        except RuntimeError:  # the interpreter is shutting down (atexit): no new threads; the rest in this one
            pass
    try:
        first = _decode_one(parts[0], src_ids[index[0]], src_lengths[index[0]], options, search, keys[index[0]],
                            _part(prefixes, index[0]))
    finally:
        concurrent.futures.wait(futures)  # no part runs on once this returns or raises
    rest = [_decode_one(parts[j], src_ids[index[j]], src_lengths[index[j]], options, search, keys[index[j]],
                        _part(prefixes, index[j]))
            for j in range(1 + len(futures), n)]
    results: list[DecodeResult | None] = [None] * len(src_ids)
    for idx, got in zip(index, [first] + [f.result() for f in futures] + rest, strict=True):
        for i, r in zip(idx.tolist(), got, strict=True):
            results[i] = r
    return results  # type: ignore[return-value]


def _part(prefixes: Sequence[Sequence[int]] | None, index: np.ndarray) -> list | None:
    return None if prefixes is None else [prefixes[i] for i in index.tolist()]


def teacher_forced_log_probs(backend: Backend, src_ids: np.ndarray, src_lengths: np.ndarray,
                             tgt_in: np.ndarray) -> np.ndarray:
    """Step the backend over given target prefixes: (B, T) tokens -> (B, T, V) log-probs (FullOutputs)."""
    if not isinstance(backend, FullOutputs):
        raise BackendUnavailable(f"the {backend.name} backend gives no full log-probs (step_log_probs)")
    encoded = backend.encode(np.ascontiguousarray(src_ids, np.int64), np.ascontiguousarray(src_lengths, np.int64))
    b, t = tgt_in.shape
    state = backend.begin(encoded, np.arange(b), max(t, 1))
    out = [backend.step_log_probs(state, np.ascontiguousarray(tgt_in[:, i], np.int64)) for i in range(t)]
    backend.end(state)
    return np.stack(out, axis=1)
