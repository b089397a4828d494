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

    def admit_many(self, admissions: Sequence[Admission]) -> list[Cohort]:
        """A cohort for each admission (admit's arguments), all joining at the next step: their sources encoded
        in one batch (padded to the widest) and added to the state at once, one encoder run and one admission of
        the backend however many there are. Refused whole (nothing changed) where any one does not fit."""
        backend, cfg = self.backend, self.backend.config
        cohorts, lens = zip(*(self._cohort(a) for a in admissions), strict=True)
        src_ids, src_lengths = _stacked(admissions, cfg.pad_id)
        longest = max(int(x.max()) for x in lens)
        if self.state is not None and not self.cohorts:
            self._end()
        if self.state is None:
            encoded = backend.encode(src_ids, src_lengths)
            self.state_capacity = self.capacity or longest
            self.state = backend.begin(encoded, np.arange(len(src_lengths)), self.state_capacity)
            base = 0
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
            encoded = backend.encode(src_ids, src_lengths)
            kept, _ = renumbered_sources(self._row_sources())
            backend.admit(self.state, encoded)
            for c in self.cohorts:
                c.src_of = np.searchsorted(kept, c.src_of)  # sentences already retired get any index
                c.src_identity = False
            base = len(kept)
        for c in cohorts:
            n = len(c.src_of)
            c.src_of, c.src_identity = base + np.arange(n), base == 0
            base += n
        self.cohorts.extend(cohorts)
        return list(cohorts)

    def _cohort(self, a: Admission) -> tuple[Cohort, np.ndarray]:
        """The admission's cohort (its src_of a placeholder of its length) and its sentences' maximum lengths."""
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
        cohort.src_of = np.arange(len(a.src_lengths))
        return cohort, lens

    def _row_sources(self) -> np.ndarray:
        """The state's source of every row, cohort after cohort."""
        parts = [c.src_of[c.row_sent] for c in self.cohorts]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def step(self) -> Finished:
        """One step of every live row -> the sentences that finished in it. A cohort whose search raises beside
        others is dropped and listed in `failed` (alone, its error is raised, as offline decoding's is)."""
        cohorts, backend = self.cohorts, self.backend
        self.failed = []
        if not cohorts:
            return []
        if len(cohorts) == 1:  # offline decoding's every step: the search's own calls, nothing around them
            return self._step_one(cohorts[0])
        eos, vocab = backend.config.eos_id, backend.config.vocab_size
        bans = [c.ban_eos for c in cohorts]
        kk = max(c.kk for c in cohorts)
        mixed = any(bans) and not all(bans)  # then EOS is taken out here, for the cohorts that ban it
        tokens = cohorts[0].tokens if len(cohorts) == 1 else np.concatenate([c.tokens for c in cohorts])
        forced = [c.forced_ids() for c in cohorts]
        vals, ids, full, att = self._run_step(tokens, min(kk + mixed, vocab), bans[0] and not mixed,
                                              any(f is not None or c.adjusts for f, c in zip(forced, cohorts)),
                                              any(c.attention_layer >= 0 for c in cohorts))
        self.steps += 1
        finished: Finished = []
        starts = []  # each cohort's first row in the state that stepped
        changed = False
        off = 0
        for c, ban, f in zip(cohorts, bans, forced, strict=True):
            r = c.rows
            v, i = (vals, ids) if len(cohorts) == 1 else (vals[off: off + r], ids[off: off + r])
            if mixed and ban:
                v, i = _without_eos(v, i, c.kk, eos)
            elif v.shape[1] != c.kk:
                v, i = v[:, : c.kk], i[:, : c.kk]
            starts.append((off, r))
            try:
                rows = None if full is None else full[off: off + r]
                a = None if att is None or c.attention_layer < 0 else att[off: off + r]
                c.advance(v, i, None if f is None else (f, _chosen(rows, f)), rows, a)
            except Exception as e:  # noqa: BLE001 - this cohort's own failure: it leaves, the others go on
                self.failed.append((c, e))
                c.rows, c.moved, c.done = 0, np.zeros(0, np.int64), []
            changed = changed or c.moved is not None
            if c.done:
                finished.extend((c, s, res) for s, res in c.done)
                c.done = []
            off += r
        self.cohorts = [c for c in cohorts if c.rows]
        if not self.cohorts:
            self._end()
        elif changed:  # the rows that go on, cohort after cohort
            moves = [off + (np.arange(r) if c.moved is None else c.moved)
                     for c, (off, r) in zip(cohorts, starts, strict=True)]
            backend.reorder(self.state, moves[0] if len(moves) == 1 else np.concatenate(moves), self._row_sources())
        return finished

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
        vals, ids, full, att = self._run_step(c.tokens, c.kk, c.ban_eos, forced is not None or c.adjusts,
                                              c.attention_layer >= 0)
        self.steps += 1
        c.advance(vals, ids, None if forced is None else (forced, _chosen(full, forced)), full, att)
        finished: Finished = []
        if c.done:
            finished = [(c, s, res) for s, res in c.done]
            c.done = []
        if not c.rows:
            self.cohorts = []
            self._end()
        elif c.moved is not None:
            self.backend.reorder(self.state, c.moved, c.row_sent if c.src_identity else c.src_of[c.row_sent])
        return finished

    def cancel(self, cohort: Cohort) -> None:
        """Drop a cohort's rows now (a request past its deadline, or whose client left): its results are lost."""
        if cohort not in self.cohorts:
            return
        keep, off = [], 0
        for c in self.cohorts:
            if c is not cohort:
                keep.append(off + np.arange(c.rows))
            off += c.rows
        self.cohorts = [c for c in self.cohorts if c is not cohort]
        if not self.cohorts:
            self._end()
        else:
            self.backend.reorder(self.state, np.concatenate(keep), self._row_sources())

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


def _stacked(admissions: Sequence[Admission], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The admissions' sources as one padded batch (B, S) and their lengths (B,)."""
    if len(admissions) == 1:
        return np.asarray(admissions[0].src_ids), np.asarray(admissions[0].src_lengths)
    width = max(np.shape(a.src_ids)[1] for a in admissions)
    rows = sum(len(a.src_lengths) for a in admissions)
    ids = np.full((rows, width), pad_id, dtype=np.asarray(admissions[0].src_ids).dtype)
    off = 0
    for a in admissions:
        b, w = np.shape(a.src_ids)
        ids[off: off + b, :w] = a.src_ids
        off += b
    return ids, np.concatenate([np.asarray(a.src_lengths) for a in admissions])


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
