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
hypothesis, and the first k non-EOS continuations become the next beams. A sentence is done once it
has k finished hypotheses and no live beam can beat the k-th of them: a live beam's raw score only
falls, so its best possible normalised score is raw / lp(max_len) (alpha >= 0). Rows of finished
sentences are dropped from the backend at the next reorder.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import threading
from dataclasses import dataclass

import numpy as np

from transduce.errors import InputError
from transduce.runtime.backends.base import Backend, usable_cpus

LENGTH_PENALTIES = ("gnmt", "plain", "none")


@dataclass(frozen=True)
class DecodingOptions:
    beam_size: int = 4  # k; 1 is greedy search
    length_penalty: float = 0.6  # alpha
    length_penalty_form: str = "gnmt"  # "gnmt", "plain" or "none"
    max_len_a: float = 1.0  # max length = a * source length + b
    max_len_b: int = 50
    min_length: int = 0  # EOS is forbidden before this many tokens (EOS included in the count)
    nbest: int = 1  # hypotheses returned per sentence (<= beam_size)

    def __post_init__(self) -> None:
        # messages name the parameters as Python spells them (params=: a command line spells its flags)
        for name in ("beam_size", "nbest", "min_length", "max_len_b"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise InputError(f"{name} must be an integer, got {v!r}", params=(name,))
        for name in ("length_penalty", "max_len_a"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(v):
                raise InputError(f"{name} must be a finite number, got {v!r}", params=(name,))
            if isinstance(v, np.floating) and np.finfo(v).precision < 15:
                # the decimal a float32 or float16 stands for (np.float32(1.1) is 1.100000024, whose
                # maximum length for 50 source tokens would be 56, not 55)
                object.__setattr__(self, name, float(str(v)))
        if self.beam_size < 1:
            raise InputError(f"beam_size must be >= 1, got {self.beam_size}", hint="1 is greedy search",
                             params=("beam_size",))
        if not 1 <= self.nbest <= self.beam_size:
            raise InputError(f"nbest must be between 1 and beam_size ({self.beam_size}), got {self.nbest}",
                             hint="a search returns at most as many hypotheses as its beam holds",
                             params=("nbest", "beam_size"))
        if self.length_penalty_form not in LENGTH_PENALTIES:
            raise InputError(f"length_penalty_form must be one of {', '.join(LENGTH_PENALTIES)}, got "
                             f"{self.length_penalty_form!r}", params=("length_penalty_form",))
        for name in ("length_penalty", "min_length", "max_len_a", "max_len_b"):
            if getattr(self, name) < 0:
                raise InputError(f"{name} must be >= 0, got {getattr(self, name)}", params=(name,))

    def model_warnings(self, vocab_size: int, max_positions: int) -> list[tuple[str, tuple[str, ...]]]:
        """What these options do on a model of that vocabulary and max_positions that was likely not meant:
        a beam wider than the vocabulary, a min_length past the maximum length of some sentences (those
        end there, unfinished: forced() asks for exactly that). -> (message, parameters it names) each."""
        found = []
        if self.beam_size > vocab_size:
            found.append((f"beam_size {self.beam_size} is wider than the vocabulary ({vocab_size} tokens): each "
                          f"sentence carries up to {self.beam_size} hypotheses a step, {self.beam_size}x the work "
                          "of greedy search", ("beam_size",)))
        # each source length's maximum target length (sources of 1 .. max_positions - 1 tokens, EOS
        # excluded): the shortest sources whose maximum is below min_length are cut there
        sources = np.arange(1, max_positions, dtype=np.int64)
        reach = np.flatnonzero(max_lengths(sources + 1, self, max_positions) >= self.min_length)
        if sources.size and (not reach.size or reach[0] > 0):
            formula = f"{self.max_len_a:g} x source tokens + {self.max_len_b}, at most {max_positions}"
            found.append((f"min_length {self.min_length} is more than any sentence's maximum length ({formula}): "
                          "every translation is cut there, unfinished" if not reach.size else
                          f"min_length {self.min_length} is more than the maximum length of sentences of up to "
                          f"{int(sources[reach[0] - 1])} source tokens ({formula}): they are cut there, unfinished",
                          ("min_length",)))
        return found

    @classmethod
    def forced(cls, steps: int, beam_size: int = 1, **options) -> DecodingOptions:
        """Exactly `steps` tokens per sentence, whatever the source (EOS banned until then, and the
        maximum length then; capped by the model's max_positions): every system compared does the same
        work (`transduce bench`, CTranslate2's min = max decoding length)."""
        return cls(beam_size=beam_size, min_length=steps + 1, max_len_a=0.0, max_len_b=steps, **options)

    def penalty(self, length: int | np.ndarray) -> float | np.ndarray:
        if self.length_penalty_form == "none" or self.length_penalty == 0:
            return np.ones_like(length, dtype=np.float64) if isinstance(length, np.ndarray) else 1.0
        if self.length_penalty_form == "gnmt":
            return ((5.0 + length) / 6.0) ** self.length_penalty
        if isinstance(length, np.ndarray):
            return np.maximum(length, 1) ** self.length_penalty
        return max(length, 1) ** self.length_penalty


@dataclass(frozen=True)
class Hypothesis:
    tokens: tuple[int, ...]  # generated ids, without EOS
    score: float  # log_prob / length penalty
    log_prob: float  # sum of token log-probs, EOS included
    token_log_probs: tuple[float, ...]  # one per generated token, EOS included when finished
    finished: bool  # False if cut at the maximum length


@dataclass(frozen=True)
class DecodeResult:
    hypotheses: tuple[Hypothesis, ...]  # best first, at most nbest

    @property
    def best(self) -> Hypothesis:
        return self.hypotheses[0]


def max_lengths(src_lengths: np.ndarray, options: DecodingOptions, max_positions: int) -> np.ndarray:
    """Per-sentence maximum target length in tokens (EOS included); src_lengths include the source EOS."""
    # capped at max_positions before the int64 cast: a huge a or b (meaning "as long as the model allows")
    # would otherwise overflow to garbage, then clip to 1; b is capped first, exactly (a * (len - 1) >= 0)
    b = float(min(options.max_len_b, max_positions))
    x = np.minimum(options.max_len_a * (np.asarray(src_lengths, dtype=np.float64) - 1) + b, float(max_positions))
    # less a relative 1e-9 first: 1.1 * 50 is 55.000000000000007 in floating point, whose ceiling would add a step
    n = np.ceil(x - 1e-9 * np.maximum(1.0, np.abs(x))).astype(np.int64)
    return np.clip(n, 1, max_positions)


def decode(backend: Backend, src_ids: np.ndarray, src_lengths: np.ndarray, options: DecodingOptions,
           search: str = "auto") -> list[DecodeResult]:
    """Decode one padded batch. src_ids (B, S) int64, src_lengths (B,) int64 (EOS included).

    search: "auto" (greedy for beam_size 1, else beam), "greedy" or "beam" (beam search even for k=1).
    """
    if search not in ("auto", "greedy", "beam"):
        raise InputError(f"search must be 'auto', 'greedy' or 'beam', got {search!r}")
    src_ids = np.ascontiguousarray(src_ids, dtype=np.int64)
    src_lengths = np.ascontiguousarray(src_lengths, dtype=np.int64)
    _check_batch(src_ids, src_lengths)
    if len(src_ids) == 0:
        return []
    greedy = search == "greedy" or (search == "auto" and options.beam_size == 1)
    search = "greedy" if greedy else "beam"  # resolved once, for every part
    parts = backend.shards(len(src_ids), 1 if greedy else options.beam_size)
    if parts and len(parts) > 1:
        return _decode_in_parts(parts, src_ids, src_lengths, options, search)
    return _decode_one(backend, src_ids, src_lengths, options, search)


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
                search: str) -> list[DecodeResult]:
    """One batch (or part) with the search decode resolved: "greedy" or "beam"."""
    encoded = backend.encode(src_ids, src_lengths)
    lens = max_lengths(src_lengths, options, backend.config["max_positions"])
    if search == "greedy":
        return _greedy(backend, encoded, lens, options)
    return _beam(backend, encoded, lens, options)


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
                     search: str) -> list[DecodeResult]:
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
                                                     options, search))
        except RuntimeError:  # the interpreter is shutting down (atexit): no new threads; the rest in this one
            pass
    try:
        first = _decode_one(parts[0], src_ids[index[0]], src_lengths[index[0]], options, search)
    finally:
        concurrent.futures.wait(futures)  # no part runs on once this returns or raises
    rest = [_decode_one(parts[j], src_ids[index[j]], src_lengths[index[j]], options, search)
            for j in range(1 + len(futures), n)]
    results: list[DecodeResult | None] = [None] * len(src_ids)
    for idx, got in zip(index, [first] + [f.result() for f in futures] + rest, strict=True):
        for i, r in zip(idx.tolist(), got, strict=True):
            results[i] = r
    return results  # type: ignore[return-value]


def _greedy(backend: Backend, encoded, max_len: np.ndarray, options: DecodingOptions) -> list[DecodeResult]:
    """Greedy search; per step a handful of numpy operations on (rows,) arrays, fewer while every
    sentence is still decoding (slices instead of fancy indexing) and before any can end."""
    cfg = backend.config
    eos_id = cfg["eos_id"]
    n = len(max_len)
    cap = int(max_len.max())
    state = backend.begin(encoded, np.arange(n), cap)
    live = np.arange(n)  # sentence of each row
    everyone = True  # live is arange(n)
    live_max = max_len  # max_len[live]
    first_end = int(max_len.min())  # no row reaches its maximum length before this step count
    tokens = np.full(n, cfg["bos_id"], dtype=np.int64)
    out_tok = np.zeros((n, cap), dtype=np.int64)
    out_lp = np.zeros((n, cap), dtype=np.float32)
    length = np.zeros(n, dtype=np.int64)
    finished = np.zeros(n, dtype=bool)
    for t in range(cap):
        vals, ids = backend.step(state, tokens, 1, ban_eos=t + 1 < options.min_length)
        tok = ids[:, 0]
        if everyone:
            out_tok[:, t] = tok
            out_lp[:, t] = vals[:, 0]
        else:
            out_tok[live, t] = tok
            out_lp[live, t] = vals[:, 0]
        eos = tok == eos_id
        if t + 1 >= first_end:
            done = eos | (t + 1 >= live_max)
        elif eos.any():
            done = eos
        else:  # the common step: nobody ends
            tokens = tok
            continue
        finished[live[eos]] = True
        length[live[done]] = t + 1
        if done.all():
            break
        if done.any():
            keep = np.flatnonzero(~done)
            live, tok = live[keep], tok[keep]
            everyone, live_max = False, max_len[live]
            first_end = int(live_max.min())
            backend.reorder(state, keep, live)
        tokens = tok
    backend.end(state)
    results = []
    # whole rows to Python at once (tolist: ~3x faster than a generator of int()/float() per element)
    per_row = zip(length.tolist(), out_tok.tolist(), out_lp.tolist(), finished.tolist(), strict=True)
    for i, (m, tok_row, lp_row, ended) in enumerate(per_row):
        raw = float(out_lp[i, :m].astype(np.float64).sum())
        toks = tok_row[: m - 1] if ended else tok_row[:m]
        hyp = Hypothesis(tuple(toks), raw / options.penalty(m), raw, tuple(lp_row[:m]), ended)
        results.append(DecodeResult((hyp,)))
    return results


def _beam(backend: Backend, encoded, max_len: np.ndarray, options: DecodingOptions) -> list[DecodeResult]:
    """Beam search; per step a handful of numpy operations whatever the batch (the common step: no
    EOS near the top, nothing finished). Histories are back-pointers, followed only for the
    hypotheses that finish."""
    cfg = backend.config
    eos = cfg["eos_id"]
    k = options.beam_size
    n = len(max_len)
    cap = int(max_len.max())
    state = backend.begin(encoded, np.arange(n), cap)
    sent = np.arange(n)  # live sentences, in row-block order
    nb = 1  # beams per live sentence (1 at step 0: all beams would be identical)
    row_src = sent  # source sentence of each row
    scores = np.zeros((n, 1), dtype=np.float64)  # raw beam scores (sentences, nb)
    tokens = np.full(n, cfg["bos_id"], dtype=np.int64)
    final: list[list[Hypothesis]] = [[] for _ in range(n)]
    lp_max = options.penalty(max_len.astype(np.float64))
    first_max = int(max_len.min())  # no sentence reaches its maximum length before this
    kth = np.full(n, -np.inf)  # score of each sentence's k-th best finished hypothesis (-inf: fewer than k)
    any_kth = False  # whether any sentence has k finished hypotheses yet (kth then has a finite entry)
    offsets: dict[tuple[int, int], np.ndarray] = {}  # (ns, w) -> (ns, 1) first flat index of each sentence's block
    # back-pointers: after step u, row r holds token toks[u][r] (log-prob lps[u][r]) and continues
    # row parents[u][r] of the state after step u - 1
    parents: list[np.ndarray] = []
    toks: list[np.ndarray] = []
    lps: list[np.ndarray] = []

    def finish(ss: np.ndarray, rows: np.ndarray, t: int, raws: np.ndarray, last_tok: np.ndarray,
               last_lp: np.ndarray, finished: bool) -> None:
        """New hypotheses of sentences ss: rows of the state that made step t, plus one token each."""
        nonlocal any_kth
        m = len(rows)
        hist_tok = np.empty((m, t + 1), np.int64)
        hist_lp = np.empty((m, t + 1), np.float32)
        hist_tok[:, t], hist_lp[:, t] = last_tok, last_lp
        for u in range(t - 1, -1, -1):  # follow the back-pointers of all of them at once
            hist_tok[:, u], hist_lp[:, u] = toks[u][rows], lps[u][rows]
            rows = parents[u][rows]
        penalty = options.penalty(t + 1)
        for i, s in enumerate(ss.tolist()):
            ts = hist_tok[i, :t] if finished else hist_tok[i]
            raw = float(raws[i])
            final[s].append(Hypothesis(tuple(ts.tolist()), raw / penalty, raw, tuple(hist_lp[i].tolist()), finished))
            if len(final[s]) >= k:
                kth[s] = sorted((h.score for h in final[s]), reverse=True)[k - 1]
                any_kth = True

    kk = min(2 * k, cfg["vocab_size"])  # candidates per row: 2k leaves k non-EOS even if k rows end
    for t in range(cap):
        vals, ids = backend.step(state, tokens, kk, ban_eos=t + 1 < options.min_length)
        n_row, n_tok, n_lp, n_score, ended = _next_beams(scores, vals, ids, nb, kk, k, eos, offsets)
        nb_next = n_row.shape[1]
        if ended is not None:  # EOS among the k best continuations: finished hypotheses
            fs, f, raws = ended
            finish(sent[fs], f // kk, t, raws, ids.reshape(-1)[f], vals.reshape(-1)[f], True)

        # which sentences are done: cut at the maximum length, or no live beam can beat the k-th finished
        done = None
        if t + 1 >= first_max:
            at_max = t + 1 >= max_len[sent]  # (ns,)
            fs, fj = np.nonzero(at_max[:, None] & np.isfinite(n_score))  # live beams: unfinished hypotheses
            if fs.size:
                finish(sent[fs], n_row[fs, fj], t, n_score[fs, fj], n_tok[fs, fj], n_lp[fs, fj], False)
            done = at_max
        if any_kth:
            k_done = kth[sent]
            beaten = np.isfinite(k_done) & ~(n_score[:, 0] / lp_max[sent] > k_done)
            done = beaten if done is None else done | beaten
        if done is not None and done.any():
            if done.all():
                break
            keep = np.flatnonzero(~done)
            n_row, n_tok, n_lp, n_score = n_row[keep], n_tok[keep], n_lp[keep], n_score[keep]
            sent = sent[keep]
        if nb_next > 1:  # beams in their parents' rows where they can be: fewer rows for reorder to move
            perm = _stay_in_place(n_row, nb_next)
            if perm is not None:
                idx = perm + np.arange(0, n_row.size, nb_next)[:, None]  # flat
                n_row, n_tok = n_row.ravel()[idx], n_tok.ravel()[idx]
                n_lp, n_score = n_lp.ravel()[idx], n_score.ravel()[idx]
        if nb != nb_next or len(row_src) != n_row.size:
            row_src = np.repeat(sent, nb_next)
        nb = nb_next
        rows = n_row.reshape(-1)
        tokens = n_tok.reshape(-1)
        scores = n_score
        parents.append(rows)
        toks.append(tokens)
        lps.append(n_lp.reshape(-1))
        backend.reorder(state, rows, row_src)

    backend.end(state)
    results = []
    for hyps in final:
        hyps.sort(key=lambda h: (-h.score, not h.finished))
        results.append(DecodeResult(tuple(hyps[: options.nbest])))
    return results


def _next_beams(scores: np.ndarray, vals: np.ndarray, ids: np.ndarray, nb: int, kk: int, k: int, eos: int,
                offsets: dict[tuple[int, int], np.ndarray]):
    """The next beams of every live sentence from this step's candidates (kk per row, `vals` / `ids`) and the
    beams' raw scores (sentences, nb): the k best continuations that do not end the sentence. -> their rows
    of the state that just stepped, tokens, log-probs and raw scores, each (sentences, min(k, nb * kk)), and
    the continuations among each sentence's k best that are EOS, as (sentence index, flat candidate index,
    raw score), or None."""
    ns = len(scores)
    w = nb * kk
    cand = (scores[:, :, None] + vals.reshape(ns, nb, kk)).reshape(-1)  # (ns * w,) flat
    order = (-cand.reshape(ns, w)).argsort(axis=1, kind="stable")  # (ns, w) best first
    if ns == 1:
        flat = order  # flat candidate index = row * kk + j
    else:
        off = offsets.get((ns, w))
        if off is None:
            off = offsets[(ns, w)] = np.arange(0, ns * w, w)[:, None]
        flat = order + off
    nb_next = min(k, w)
    ended = None
    if (ids.reshape(-1)[flat[:, :k]] == eos).any():  # next beams skip EOS
        c_score, c_tok = cand[flat], ids.reshape(-1)[flat]
        is_eos = c_tok == eos
        fs, fj = np.nonzero(is_eos[:, :k] & np.isfinite(c_score[:, :k]))
        if fs.size:
            ended = (fs, flat[fs, fj], c_score[fs, fj])
        rank = np.where(is_eos, np.arange(w) + w, np.arange(w))
        pick = np.argsort(rank, axis=1, kind="stable")[:, :nb_next]  # (ns, nb_next)
        sel = np.take_along_axis(flat, pick, axis=1)
        n_score = cand[sel]
        n_score[np.take_along_axis(is_eos, pick, axis=1)] = -np.inf  # only if fewer than k non-EOS exist
    else:
        sel = flat[:, :nb_next]
        n_score = cand[sel]
    return sel // kk, ids.reshape(-1)[sel], vals.reshape(-1)[sel], n_score, ended


def _stay_in_place(parents: np.ndarray, nb: int) -> np.ndarray | None:
    """Slot order for each sentence's next beams: (ns, nb) parent rows -> (ns, nb) beam per slot, or None
    where every beam keeps its slot (the order is the identity: nothing to rearrange).

    Sentence i's next beams take rows i*nb .. i*nb+nb-1. The first beam continuing a parent whose row
    is among them takes that row (its cache is already there: the backend's reorder copies nothing
    for it); the other beams fill the remaining rows in score order. Beam order within a sentence
    means nothing to the search (the candidates of all beams are ranked together; only exactly equal
    scores are ordered by it, for every backend alike), so this only changes which rows a reorder
    moves: with beam 4, from most rows to the duplicated parents' children. A Python loop: a vectorised
    numpy version (a dozen calls) took over twice as long at 16 sentences of 4 beams.
    """
    perm = []
    ident = list(range(nb))
    same = True
    for i, row in enumerate(parents.tolist()):
        base = i * nb
        slots: list[int | None] = [None] * nb
        rest = []
        for b, parent in enumerate(row):
            local = parent - base
            if 0 <= local < nb and slots[local] is None:
                slots[local] = b
            else:
                rest.append(b)
        it = iter(rest)
        order = [b if b is not None else next(it) for b in slots]
        same = same and order == ident
        perm.append(order)
    return None if same else np.array(perm, dtype=np.int64)


def teacher_forced_log_probs(backend: Backend, src_ids: np.ndarray, src_lengths: np.ndarray,
                             tgt_in: np.ndarray) -> np.ndarray:
    """Step the backend over given target prefixes: (B, T) tokens -> (B, T, V) log-probs."""
    encoded = backend.encode(np.ascontiguousarray(src_ids, np.int64), np.ascontiguousarray(src_lengths, np.int64))
    b, t = tgt_in.shape
    state = backend.begin(encoded, np.arange(b), max(t, 1))
    out = [backend.step_log_probs(state, np.ascontiguousarray(tgt_in[:, i], np.int64)) for i in range(t)]
    backend.end(state)
    return np.stack(out, axis=1)
