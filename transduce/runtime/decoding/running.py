"""The running batch: one backend state whose rows belong to cohorts of sentences admitted at any step
boundary, every live row stepped once per step, finished sentences retired at once (their rows freed).

Offline decoding (decoding.decode) admits a whole batch as one cohort and runs it until it is empty: the
backend then sees the calls the search always made. A server admits each request's sentences as a cohort
while others are decoding: their encoder runs, their rows join the state at position 0 (backend.admit)
beside rows further on, with their own options (beam size, lengths, length penalty). One step serves all
of them: the backend's top-k is asked for the most candidates any cohort reads, and a cohort whose
minimum length still bans EOS while another's does not reads its candidates with EOS taken out.

Capacity: a state is allocated for `capacity` positions per row (offline: the batch's longest maximum
length); a cohort whose maximum length does not fit is refused (CapacityError), never cut short. Rows are
the backend's to grow; the scheduler above bounds them (reserved_rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from transduce.errors import BackendUnavailable, TransduceError
from transduce.runtime.backends.base import (
    AdmitsRows,
    AdmitsWithin,
    Backend,
    KeepsLogProbs,
    alignment_layer,
    has_capability,
    renumbered_sources,
    require_attention,
)
from transduce.runtime.backends.topk import banned_ids, numpy_topk
from transduce.runtime.decoding.options import DecodeResult, DecodingOptions, max_lengths
from transduce.runtime.decoding.search import BeamCohort, Cohort, GreedyCohort, TokenListener

Finished = list[tuple[Cohort, int, DecodeResult]]  # (cohort, its sentence index, result) as sentences finish


@dataclass(frozen=True, eq=False)
class Admission:
    """One cohort's sentences and options, as RunningBatch.admit takes them (admit_many takes several)."""

    src_ids: np.ndarray  # (B, S) padded source ids, EOS included
    src_lengths: np.ndarray  # (B,)
    options: DecodingOptions
    search: str = "auto"  # "auto" (greedy for beam_size 1), "greedy" or "beam"
    on_tokens: TokenListener | None = None  # greedy only: each step's new tokens
    keys: np.ndarray | None = None  # each sentence's key of its random draws (None: 0, 1, ...)
    prefixes: Sequence[Sequence[int]] | None = None  # each sentence's forced target prefix (None: none)


class CapacityError(TransduceError):
    """Sentences that the running batch cannot take now (the scheduler waits or refuses, never truncates)."""


class RunningBatch:
    def __init__(self, backend: Backend, capacity: int | None = None):
        """capacity: cache positions per row of each state (None: the first cohort's longest maximum length,
        as offline decoding allocates; a server passes the model's max_positions)."""
        self.backend = backend
        self.admits = has_capability(backend, AdmitsRows)  # rows join a running state (else only an empty batch)
        self.within = has_capability(backend, AdmitsWithin)  # and the backend says which ones fit it now
        self.capacity = capacity
        self.state = None
        self.state_capacity = 0
        self.cohorts: list[Cohort] = []  # in the state's row-block order
        # every row's token for the next step and its source in the backend state (the protocol's numbering),
        # in row order: kept here for all cohorts at once (a solo cohort's own `tokens` go stale)
        self.tokens = np.zeros(0, np.int64)
        self.row_src = np.zeros(0, np.int64)
        self.steps = 0  # steps run (all states)
        self.failed: list[tuple[Cohort, Exception]] = []  # cohorts whose search failed in the last step (dropped)

    @property
    def rows(self) -> int:
        return sum(c.rows for c in self.cohorts)

    def reserved_rows(self) -> int:
        """The most rows the live cohorts can take (beam search: k per unfinished sentence)."""
        return sum(c.reserved_rows() for c in self.cohorts)

    def can_admit(self, src_ids: np.ndarray | None = None) -> bool:
        """Whether a cohort (of the padded batch src_ids, where given) can join now: the batch is empty, or the
        backend admits rows into a running state (and, where it has fixed ranges, these ones now)."""
        if not self.cohorts:
            return True
        if not self.admits:
            return False
        return src_ids is None or self._fits(src_ids)

    def _fits(self, src_ids: np.ndarray) -> bool:
        """Whether a backend with fixed ranges (AdmitsWithin) takes src_ids' sentences into the running state."""
        return not self.within or self.state is None or self.backend.admits(self.state, *np.shape(src_ids))

    def admit(self, src_ids: np.ndarray, src_lengths: np.ndarray, options: DecodingOptions, search: str = "auto",
              on_tokens: TokenListener | None = None, keys: np.ndarray | None = None,
              prefixes: Sequence[Sequence[int]] | None = None) -> Cohort:
        """A cohort of the padded batch src_ids (B, S) / src_lengths (B,) (EOS included), decoded from the next
        step on. search: "auto" (greedy for beam_size 1), "greedy" or "beam". on_tokens: greedy only. keys: each
        sentence's key of its random draws (its number in its input or request; None: 0, 1, ...). prefixes: each
        sentence's target prefix (token ids), which its first steps are forced through (None: none)."""
        return self.admit_many([Admission(src_ids, src_lengths, options, search, on_tokens, keys, prefixes)])[0]

    def sources(self, admissions: Sequence[Admission]) -> tuple[np.ndarray, np.ndarray]:
        """The admissions' sources as admit_many encodes them: one padded batch (B, S) and its lengths (B,)."""
        return stacked([(a.src_ids, a.src_lengths) for a in admissions], self.backend.config.pad_id)

    def admit_many(self, admissions: Sequence[Admission], encoded: Any = None) -> list[Cohort]:
        """A cohort for each admission (admit's arguments), all joining at the next step: their sources encoded
        in one batch (padded to the widest) and added to the state at once, one encoder run and one admission of
        the backend however many there are. Refused whole (nothing changed) where any one does not fit.
        encoded: the backend's encoding of sources(admissions), made beforehand (encode_aside, on a thread of
        the caller's while steps ran); None: encoded here."""
        backend = self.backend
        cohorts, lens = zip(*(self._cohort(a) for a in admissions), strict=True)
        src_ids, src_lengths = self.sources(admissions)
        longest = max(int(x.max()) for x in lens)
        if self.state is not None and not self.cohorts:
            self._end()
        tokens = [c.tokens for c in cohorts]
        if self.state is None:
            if encoded is None:
                encoded = backend.encode(src_ids, src_lengths)
            self.state_capacity = self.capacity or longest
            self.row_src = np.arange(len(src_lengths))
            self.state = backend.begin(encoded, self.row_src, self.state_capacity)
            self.tokens = tokens[0] if len(tokens) == 1 else np.concatenate(tokens)
        else:
            if longest > self.state_capacity:
                raise CapacityError(f"a maximum length of {longest} tokens does not fit the running batch's "
                                    f"{self.state_capacity} positions", hint="admit it once the batch is empty")
            if not self.admits:
                raise BackendUnavailable(f"the {backend.name} backend cannot add sentences to a running batch",
                                         hint="admit them once the running batch is empty (can_admit says when)")
            if not self._fits(src_ids):
                raise CapacityError(f"sources of {np.shape(src_ids)[1]} tokens do not fit the {backend.name} "
                                    "backend's running batch now", hint="admit them once the running batch is "
                                    "empty (can_admit(src_ids) says when)")
            if encoded is None:
                encoded = backend.encode(src_ids, src_lengths)
            kept, inverse = renumbered_sources(self.row_src)
            backend.admit(self.state, encoded)
            # the state's sources now: those its rows decode, ascending, then the new ones (one row each)
            self.row_src = np.concatenate([inverse, len(kept) + np.arange(len(src_lengths))])
            self.tokens = np.concatenate([self.tokens, *tokens])
        self.cohorts.extend(cohorts)
        return list(cohorts)

    def _cohort(self, a: Admission) -> tuple[Cohort, np.ndarray]:
        """The admission's cohort and its sentences' maximum lengths."""
        backend, cfg = self.backend, self.backend.config
        options = a.options
        greedy = a.search == "greedy" or (a.search == "auto" and options.beam_size == 1)
        lens = max_lengths(a.src_lengths, options, cfg.max_positions)
        cohort: Cohort = (GreedyCohort(lens, options, cfg, a.on_tokens, a.keys, a.prefixes) if greedy
                          else BeamCohort(lens, options, cfg, a.keys, a.prefixes))
        if options.attention:  # refused here, before it joins, where the backend cannot give attention
            require_attention(backend)
            cohort.attention_layer = alignment_layer(options.alignment_layer, cfg.decoder_layers)
            cohort.src_len = np.asarray(a.src_lengths, np.int64)
        return cohort, lens

    def step(self) -> Finished:
        """One step of every live row -> the sentences that finished in it. A cohort whose search raises beside
        others is dropped and listed in `failed` (alone, its error is raised, as offline decoding's is)."""
        cohorts = self.cohorts
        self.failed = []
        if not cohorts:
            return []
        if len(cohorts) == 1:  # offline decoding's every step: the search's own calls, nothing around them
            return self._step_one(cohorts[0])
        vocab = self.backend.config.vocab_size
        general = [c for c in cohorts if not c.solo]  # solo cohorts read their best candidate only, never ban EOS
        bans = [c.ban_eos for c in general]
        kk = max((c.kk for c in general), default=1)
        mixed = any(bans) and (len(general) < len(cohorts) or not all(bans))  # then EOS is taken out here
        forced = [c.forced_ids() for c in general]
        vals, ids, full, att = self._run_step(self.tokens, min(kk + mixed, vocab), any(bans) and not mixed,
                                              any(f is not None or c.adjusts for f, c in zip(forced, general)),
                                              any(c.attention_layer >= 0 for c in general))
        self.steps += 1
        best_tok, best_lp = ids[:, 0].tolist(), vals[:, 0].tolist()
        finished: Finished = []
        keep: list[int] = []  # the rows that go on, cohort after cohort
        tokens: list[int] = []  # and their next tokens
        changed = False
        holes: list[int] = []  # the rows of solo cohorts that ended
        shifted = False  # a cohort other than a solo one changed its rows
        off = 0
        forced_of = iter(forced)
        for c in cohorts:
            r = c.rows
            if c.solo:
                if self._advance_solo(c, best_tok[off], best_lp[off]):
                    keep.append(off)
                    tokens.append(best_tok[off])
                else:
                    changed = True
                    holes.append(off)
            else:
                self._advance(c, off, vals, ids, full, att, mixed, next(forced_of))
                if c.moved is not None:
                    changed = shifted = True
                if c.rows:
                    keep.extend(range(off, off + r) if c.moved is None else (off + c.moved).tolist())
                    tokens.extend(c.tokens.tolist())
            if c.done:
                finished.extend((c, s, res) for s, res in c.done)
                c.done = []
            off += r
        self.cohorts = [c for c in cohorts if c.rows]
        if not self.cohorts:
            self._end()
            return finished
        if changed:
            rows = np.array(keep, np.int64)
            toks = np.array(tokens, np.int64)
            if not shifted:
                rows, toks = self._fill_holes(holes, rows, toks)
            self.row_src = self.row_src[rows]  # a row that goes on decodes the source of the row it continues
            self.backend.reorder(self.state, rows, self.row_src)
            self.tokens = toks
        else:
            self.tokens = np.array(tokens, np.int64)
        return finished

    def _fill_holes(self, holes: list[int], rows: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where only solo cohorts ended (`holes`, their rows; `rows`, the rows that go on, ascending, self.cohorts
        in their order): the rows past the new end moved into the holes below it, every other row left where it
        is, rather than every row after a hole shifted down (the backend moves only the rows whose content
        changes) -> (rows, tokens) in the new order, self.cohorts put in it. Where a cohort other than a solo one
        would have to move: (rows, tokens) as they are."""
        n = len(rows)
        tail = np.flatnonzero(rows >= n)  # positions in `rows` of the rows past the new end
        if not tail.size:
            return rows, tokens
        firsts = np.cumsum([0] + [c.rows for c in self.cohorts[:-1]])  # each cohort's first position in `rows`
        owner = np.searchsorted(firsts, tail, side="right") - 1  # the cohort each of them belongs to
        moving = [self.cohorts[i] for i in owner.tolist()]
        if not all(c.solo for c in moving):
            return rows, tokens
        below = [h for h in holes if h < n]  # as many as the rows past the end
        order = np.arange(n)
        order[below] = rows[tail]
        placed = dict(zip(rows[firsts].tolist(), self.cohorts))  # each cohort by its first row, in the new order
        for h, r, c in zip(below, rows[tail].tolist(), moving):
            del placed[r]
            placed[h] = c
        self.cohorts = [placed[r] for r in sorted(placed)]
        return order, tokens[np.searchsorted(rows, order)]

    def _advance_solo(self, c: Cohort, tok: int, lp: float) -> bool:
        """A solo cohort advanced from its row's best candidate -> whether its row goes on; a failure of its search
        (or of its token listener) drops it (listed in `failed`), the others go on."""
        try:
            return not c.advance_solo(tok, lp)
        except Exception as e:  # noqa: BLE001 - this cohort's own failure: it leaves, the others go on
            self.failed.append((c, e))
            c.rows, c.moved, c.done = 0, np.zeros(0, np.int64), []
            return False

    def _advance(self, c: Cohort, off: int, vals: np.ndarray, ids: np.ndarray, full: np.ndarray | None,
                 att: np.ndarray | None, mixed: bool, forced: np.ndarray | None) -> None:
        """A cohort other than a solo one advanced from its rows' (from `off`) candidates of a step of several
        cohorts; a failure of its search drops it (listed in `failed`), the others go on."""
        r = c.rows
        v, i = vals[off: off + r], ids[off: off + r]
        if mixed and c.ban_eos:
            v, i = _without_eos(v, i, c.kk, self.backend.config.eos_id)
        elif v.shape[1] != c.kk:
            v, i = v[:, : c.kk], i[:, : c.kk]
        try:
            rows = None if full is None else full[off: off + r]
            a = None if att is None or c.attention_layer < 0 else att[off: off + r]
            c.advance(v, i, None if forced is None else (forced, _chosen(rows, forced)), rows, a)
        except Exception as e:  # noqa: BLE001 - this cohort's own failure: it leaves, the others go on
            self.failed.append((c, e))
            c.rows, c.moved, c.done = 0, np.zeros(0, np.int64), []

    def _run_step(self, tokens: np.ndarray, k: int, ban_eos: bool, full: bool, attention: bool = False):
        """One step of every row -> its top-k (values, ids) and, where `full` (a row is forced through its
        prefix or adjusted: its tokens' log-probs are needed, whatever their rank), the full (R, V) log-probs, else
        None; and where `attention` (a cohort keeps it: one step for every row on the attention step), every
        layer's head-averaged cross-attention (R, layers, S), else None."""
        if attention:
            log_probs, att = self.backend.step_attention(self.state, tokens)
            return *numpy_topk(log_probs, k, banned_ids(self.backend.config, ban_eos)), log_probs, att
        if not full:
            return *self.backend.step(self.state, tokens, k, ban_eos=ban_eos), None, None
        if has_capability(self.backend, KeepsLogProbs):  # the backend's own top-k for the rows that take it as is
            vals, ids = self.backend.step(self.state, tokens, k, ban_eos=ban_eos)
            return vals, ids, self.backend.last_log_probs(self.state), None
        log_probs = self.backend.step_log_probs(self.state, tokens)
        return *numpy_topk(log_probs, k, banned_ids(self.backend.config, ban_eos)), log_probs, None

    def _step_one(self, c: Cohort) -> Finished:
        forced = c.forced_ids()
        vals, ids, full, att = self._run_step(self.tokens, c.kk, c.ban_eos, forced is not None or c.adjusts,
                                              c.attention_layer >= 0)
        self.steps += 1
        c.advance(vals, ids, None if forced is None else (forced, _chosen(full, forced)), full, att)
        finished: Finished = []
        if c.done:
            finished = [(c, s, res) for s, res in c.done]
            c.done = []
        self.tokens = c.tokens
        if not c.rows:
            self.cohorts = []
            self._end()
        elif c.moved is not None:
            self.row_src = self.row_src[c.moved]
            self.backend.reorder(self.state, c.moved, self.row_src)
        return finished

    def cancel(self, cohort: Cohort, sentences: Sequence[int] | None = None) -> None:
        """Drop a cohort's rows now (a request past its deadline, or whose client left): its results are lost.
        sentences: only these of its sentences (a beam cohort's; None: all of them)."""
        if cohort not in self.cohorts:
            return
        keep, off = [], 0
        for c in self.cohorts:
            r = c.rows
            if c is not cohort:
                keep.extend(range(off, off + r))
            elif sentences is not None:
                keep.extend((off + c.drop(np.asarray(sentences, np.int64))).tolist())
            off += r
        self.cohorts = [c for c in self.cohorts if c.rows and (c is not cohort or sentences is not None)]
        if not self.cohorts:
            self._end()
        else:
            rows = np.array(keep, np.int64)
            self.tokens, self.row_src = self.tokens[rows], self.row_src[rows]
            self.backend.reorder(self.state, rows, self.row_src)

    def run_until_empty(self) -> dict[Cohort, list[tuple[int, DecodeResult]]]:
        """Step until every cohort is done -> each cohort's (sentence, result) pairs, in finishing order."""
        out: dict[Cohort, list[tuple[int, DecodeResult]]] = {c: [] for c in self.cohorts}
        while self.cohorts:
            for c, s, res in self.step():
                out[c].append((s, res))
        return out

    def abort(self) -> list[Cohort]:
        """After an error: every cohort dropped and the state given back (as far as the backend can) -> them."""
        dropped, self.cohorts = self.cohorts, []
        try:
            self._end()
        except Exception:  # noqa: BLE001 - the backend already failed; its state is dropped either way
            self.state = None
        return dropped

    def _end(self) -> None:
        if self.state is not None:
            state, self.state = self.state, None
            self.backend.end(state)


def stacked(sources: Sequence[tuple[np.ndarray, np.ndarray]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Padded batches of sources, each (padded ids (B, S), lengths (B,)), as one padded batch (B, S) and its
    lengths (B,): the widest's width, the rest padded with pad_id."""
    if len(sources) == 1:
        return np.asarray(sources[0][0]), np.asarray(sources[0][1])
    width = max(np.shape(ids)[1] for ids, _ in sources)
    rows = sum(len(lengths) for _, lengths in sources)
    out = np.full((rows, width), pad_id, dtype=np.asarray(sources[0][0]).dtype)
    off = 0
    for ids, _ in sources:
        b, w = np.shape(ids)
        out[off: off + b, :w] = ids
        off += b
    return out, np.concatenate([np.asarray(lengths) for _, lengths in sources])


def _chosen(log_probs: np.ndarray, forced: np.ndarray) -> np.ndarray:
    """(R,) the log-prob of each row's forced token (any value where it has none: forced -1)."""
    return log_probs[np.arange(len(forced)), np.maximum(forced, 0)]


def _without_eos(vals: np.ndarray, ids: np.ndarray, k: int, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best candidates of each row other than EOS, from a top-(k + 1) taken with EOS allowed: what a
    step with EOS banned gives (an EOS still among the first k, on a vocabulary that small, scores -inf)."""
    is_eos = ids == eos
    order = np.argsort(is_eos, axis=1, kind="stable")[:, :k]
    v, i = np.take_along_axis(vals, order, axis=1), np.take_along_axis(ids, order, axis=1)
    return np.where(i == eos, np.float32(-np.inf), v), i
