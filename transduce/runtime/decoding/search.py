"""Greedy and beam search over one cohort: sentences admitted into a running batch together, with the same
options, decoded in step with each other (numpy bookkeeping only; the rules are in decoding.py's docstring).

A cohort does not call the backend. The running batch (running.py) steps every live row of every cohort at
once and hands each cohort its rows' candidates; the cohort advances its search and says which of its rows
continue (`moved`: its local rows of the state that just stepped, None while they are unchanged) and which
of its sentences each continuing row decodes (`row_sent`), and it leaves each finished sentence's result in
`done` until the running batch collects it. Offline decoding is one cohort admitted alone, so the backend
sees exactly the calls that the search made before it ran in a running batch.

A server's commonest cohort is one sentence decoded greedily with none of the options that read more than the
best candidate (`solo`): the running batch advances those from its rows' best candidates as plain numbers
(GreedyCohort.advance_solo), without a numpy slice of its own each step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from transduce.errors import InputError
from transduce.formats.model_config import ModelConfig
from transduce.runtime.backends.topk import banned_ids, numpy_topk
from transduce.runtime.decoding import sampling
from transduce.runtime.decoding.options import DecodeResult, DecodingOptions, Hypothesis
from transduce.runtime.decoding.repetition import adjusted

# on_tokens(sentences, tokens): after each greedy step, the cohort's sentences that stepped and their new
# tokens (EOS included): a server streams them as they are produced
TokenListener = Callable[[np.ndarray, np.ndarray], None]


class Cohort:
    """What the running batch needs of a search: rows, this step's inputs, and advance()."""

    kk: int  # candidates per row this search reads each step
    rows: int  # live rows, in the state's row order within the cohort's block
    tokens: np.ndarray  # (rows,) the tokens the next step reads
    row_sent: np.ndarray  # (rows,) the cohort's sentence each row decodes
    moved: np.ndarray | None  # after advance: local rows of the last step that continue (None: all, unchanged)
    done: list[tuple[int, DecodeResult]]  # finished sentences not collected yet
    solo = False  # one greedy sentence that reads only its best candidate: advance_solo steps it
    # return_attention: each sentence's source length (EOS included; the running batch sets it) and the decoder
    # layer whose attention it keeps (-1: it keeps none)
    src_len: np.ndarray | None = None
    attention_layer = -1

    def __init__(self, max_len: np.ndarray, options: DecodingOptions, cfg: ModelConfig, keys: np.ndarray | None = None,
                 prefixes: Sequence[Sequence[int]] | None = None):
        """keys: each sentence's key of its random draws (sampling.py; its number in its input or request),
        None: 0, 1, ... prefixes: each sentence's target prefix (token ids; None or empty: none), which its
        first steps are forced through."""
        self.max_len = max_len
        self.options = options
        self.eos = cfg.eos_id
        self.n = len(max_len)
        self.keys = np.arange(self.n) if keys is None else np.asarray(keys, np.int64)
        self.prefix, self.prefix_steps = _prefix_table(prefixes, max_len)
        self.cfg = cfg
        self.adjusts = options.adjusts  # it reads each step's full log-probs, adjusted by the outputs so far
        self.t = 0  # steps made
        self.done = []
        self.moved = None

    @property
    def ban_eos(self) -> bool:
        return self.t + 1 < self.options.min_length

    def reserved_rows(self) -> int:
        """The most rows this cohort can take from now on."""
        return self.rows

    def forced_ids(self) -> np.ndarray | None:
        """(rows,) the token each row is forced to take this step (its sentence's prefix; EOS at its maximum
        length with forced_eos), -1 where it is free; None while no row is forced."""
        t = self.t
        forced = self.prefix[self.row_sent, t] if t < self.prefix_steps else None
        if self.options.forced_eos:
            last = self.max_len[self.row_sent] == t + 1
            if last.any():
                forced = np.where(last, self.eos, -1 if forced is None else forced)
        return forced if forced is not None and (forced >= 0).any() else None

    def _forced_lp(self, forced: np.ndarray, forced_lp: np.ndarray, step: int) -> np.ndarray:
        """The log-probs forced tokens count: the model's, but 0 for forced_eos's EOS (Hugging Face's
        forced_eos_token_id leaves it the only token, at log-prob 0) and, with target_lang, for the first step's
        token (step 0), the target language's code (as forced_bos_token_id)."""
        if step == 0 and self.options.target_lang:
            forced_lp = np.where(forced >= 0, 0.0, forced_lp)
        return np.where(forced == self.eos, 0.0, forced_lp) if self.options.forced_eos else forced_lp

    def advance(self, vals: np.ndarray, ids: np.ndarray, forced: tuple[np.ndarray, np.ndarray] | None = None,
                full: np.ndarray | None = None, attention: np.ndarray | None = None) -> None:
        """This step's candidates of every row (kk each, best first); forced: forced_ids() and the log-prob the
        step gave each row's forced token; full: where the cohort adjusts, the rows' full log-probs;
        attention: where it keeps attention (attention_layer >= 0), every layer's (rows, layers, S)."""
        raise NotImplementedError

    def _attention_of(self, sentences: np.ndarray, steps: list[np.ndarray]) -> list[np.ndarray]:
        """Each sentence's (T, source length) attention from `steps`: step u's (len(sentences), S_u) rows."""
        return [np.stack([a[j, : int(self.src_len[s])] for a in steps]).astype(np.float32)
                for j, s in enumerate(sentences.tolist())]

    def _adjusted(self, full: np.ndarray, history: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This step's candidates from the full log-probs adjusted by each row's output so far (repetition.py)."""
        return numpy_topk(adjusted(full, history, self.options), self.kk, banned_ids(self.cfg, self.ban_eos))


class GreedyCohort(Cohort):
    """Greedy search; per step a handful of numpy operations on (rows,) arrays, fewer while every sentence
    is still decoding (slices instead of fancy indexing) and before any can end."""

    kk = 1

    def __init__(self, max_len: np.ndarray, options: DecodingOptions, cfg: ModelConfig,
                 on_tokens: TokenListener | None = None, keys: np.ndarray | None = None,
                 prefixes: Sequence[Sequence[int]] | None = None):
        super().__init__(max_len, options, cfg, keys, prefixes)
        if options.sampling:  # random sampling: the draw among this many candidates a row
            self.kk = sampling.candidates(options, cfg.vocab_size)
        n = self.n
        # one sentence (a server's commonest cohort): its length read once, not reduced twice
        first, cap = (max_len.item(),) * 2 if n == 1 else (int(max_len.min()), int(max_len.max()))
        self.on_tokens = on_tokens
        self.row_sent = np.arange(n)  # sentence of each row (`live`)
        self.rows = n
        self.everyone = True  # row_sent is arange(n)
        self.live_max = max_len  # max_len[row_sent]
        self.first_end = first  # no row reaches its maximum length before this step count
        self.tokens = np.full(n, cfg.bos_id, dtype=np.int64)
        self.out_tok = np.zeros((n, cap), dtype=np.int64)
        self.out_lp = np.zeros((n, cap), dtype=np.float32)
        self.atts: list[tuple[np.ndarray, np.ndarray]] = []  # return_attention: each step's (row_sent, (rows, S))
        # one sentence whose step needs its best candidate only: no draw, prefix, forced EOS, ban on EOS (minimum
        # length), adjusted log-probs or attention
        self.solo = n == 1 and not (options.sampling or options.adjusts or options.attention or options.forced_eos
                                    or self.prefix_steps or options.min_length > 1)

    def advance(self, vals: np.ndarray, ids: np.ndarray, forced: tuple[np.ndarray, np.ndarray] | None = None,
                full: np.ndarray | None = None, attention: np.ndarray | None = None) -> None:
        t, live = self.t, self.row_sent
        if attention is not None and self.attention_layer >= 0:
            self.atts.append((live, np.ascontiguousarray(attention[:, self.attention_layer])))
        if full is not None and self.adjusts:
            vals, ids = self._adjusted(full, self.out_tok[live, :t])
        self.t += 1
        self.moved = None
        if self.options.sampling:  # each row's draw
            u = sampling.uniforms(self.options.seed, self.keys[live], t, 1)[:, 0]
            pick = sampling.draw_one(vals, self.options, u)[:, None]
            vals, ids = np.take_along_axis(vals, pick, axis=1), np.take_along_axis(ids, pick, axis=1)
        tok, lp = ids[:, 0], vals[:, 0]
        if forced is not None:  # rows still in their prefix (or at their last step, forced_eos) take its token
            f_ids, f_lp = forced[0], self._forced_lp(*forced, t)
            tok, lp = np.where(f_ids >= 0, f_ids, tok), np.where(f_ids >= 0, f_lp, lp)
        if self.everyone:
            self.out_tok[:, t] = tok
            self.out_lp[:, t] = lp
        else:
            self.out_tok[live, t] = tok
            self.out_lp[live, t] = lp
        if self.on_tokens is not None:
            self.on_tokens(live, tok)
        eos = tok == self.eos
        if t + 1 >= self.first_end:
            done = eos | (t + 1 >= self.live_max)
        elif eos.any():
            done = eos
        else:  # the common step: nobody ends
            self.tokens = tok
            return
        if done.any():
            for i, ended in zip(live[done].tolist(), eos[done].tolist(), strict=True):
                self.done.append((i, self._result(i, t + 1, ended)))
            keep = np.flatnonzero(~done)
            self.row_sent, tok = live[keep], tok[keep]
            self.everyone, self.live_max = False, self.max_len[self.row_sent]
            self.first_end = int(self.live_max.min()) if keep.size else 0
            self.rows = len(keep)
            self.moved = keep
        self.tokens = tok

    def advance_solo(self, tok: int, lp: float) -> bool:
        """advance() of a solo cohort from its row's best candidate (token id, log-prob) -> whether its sentence
        finished (its result in `done`, its row gone). Its `tokens` are not kept up to date: the running batch
        holds every row's next token (RunningBatch.tokens)."""
        t = self.t
        self.t = t + 1
        self.out_tok[0, t] = tok
        self.out_lp[0, t] = lp
        if self.on_tokens is not None:
            self.on_tokens(self.row_sent, np.array([tok], np.int64))
        ended = tok == self.eos
        if not ended and t + 1 < self.first_end:
            return False
        self.done.append((0, self._result(0, t + 1, ended)))
        self.row_sent = self.moved = np.zeros(0, np.int64)
        self.everyone, self.live_max, self.first_end, self.rows = False, self.max_len[:0], 0, 0
        self.tokens = self.row_sent
        return True

    def _result(self, i: int, m: int, ended: bool) -> DecodeResult:
        raw = float(self.out_lp[i, :m].astype(np.float64).sum())
        toks = self.out_tok[i, : m - 1] if ended else self.out_tok[i, :m]
        attention = None
        if self.attention_layer >= 0:  # sentence i's row of each step (row_sent stays ascending)
            steps = [a[np.searchsorted(live, i)][None] for live, a in self.atts[:m]]
            attention = self._attention_of(np.array([i]), steps)[0]
        hyp = Hypothesis(tuple(toks.tolist()), raw / self.options.penalty(m), raw,
                         tuple(self.out_lp[i, :m].tolist()), ended, attention)
        return DecodeResult((hyp,))


class BeamCohort(Cohort):
    """Beam search; per step a handful of numpy operations whatever the cohort (the common step: no EOS near
    the top, nothing finished). Histories are back-pointers, followed only for the hypotheses that finish."""

    def __init__(self, max_len: np.ndarray, options: DecodingOptions, cfg: ModelConfig, keys: np.ndarray | None = None,
                 prefixes: Sequence[Sequence[int]] | None = None):
        super().__init__(max_len, options, cfg, keys, prefixes)
        n, k = self.n, options.beam_size
        self.k = k
        self.ranked = min(2 * k, cfg.vocab_size)  # candidates ranked per row: 2k leaves k non-EOS even if k rows end
        self.kk = self.ranked  # candidates read per row: those ranked, or with sampling those they are drawn from
        if options.sampling:
            self.kk = sampling.candidates(options, cfg.vocab_size)
            self.ranked = min(self.ranked, self.kk)
        self.sent = np.arange(n)  # live sentences, in row-block order
        self.nb = 1  # beams per live sentence (1 at step 0: all beams would be identical)
        self.rank: np.ndarray | None = None  # (sentences, nb) each row's beam rank by score (None: rank = slot)
        self.row_sent = self.sent
        self.rows = n
        self.scores = np.zeros((n, 1), dtype=np.float64)  # raw beam scores (sentences, nb)
        self.tokens = np.full(n, cfg.bos_id, dtype=np.int64)
        self.final: list[list[Hypothesis]] = [[] for _ in range(n)]
        self.lp_max = options.penalty(max_len.astype(np.float64))
        self.first_max = int(max_len.min())  # no sentence reaches its maximum length before this
        self.rule = options.early_stopping
        self.need = options.finished_needed if self.rule == "k-finished" else k  # finished hypotheses it waits for
        self.kth = np.full(n, -np.inf)  # score of each sentence's k-th best finished hypothesis (-inf: fewer)
        self.any_kth = False  # whether any sentence has `need` finished hypotheses yet
        self.offsets: dict[tuple[int, int], np.ndarray] = {}  # (ns, w) -> (ns, 1) first flat index per sentence
        # back-pointers: after step u, row r holds token toks[u][r] (log-prob lps[u][r]) and continues
        # row parents[u][r] of the state after step u - 1
        self.history = np.zeros((n, 0), np.int64)  # (rows, t) each row's tokens, where the cohort adjusts
        self.parents: list[np.ndarray] = []
        self.toks: list[np.ndarray] = []
        self.lps: list[np.ndarray] = []
        self.atts: list[np.ndarray] = []  # return_attention: step u's (rows, S) of the state that made it

    def reserved_rows(self) -> int:
        return len(self.sent) * self.k

    def drop(self, sentences: np.ndarray) -> np.ndarray:
        """Between two steps: `sentences` leave now (their results are lost) -> the local rows that stay, in
        order. The last step's back-pointers follow the rows that stay (those before it are untouched)."""
        keep = np.flatnonzero(~np.isin(self.row_sent, sentences))
        live = ~np.isin(self.sent, sentences)
        self.sent, self.scores = self.sent[live], self.scores[live]
        if self.rank is not None:
            self.rank = self.rank[live]
        self.row_sent, self.tokens = self.row_sent[keep], self.tokens[keep]
        if self.parents:
            self.parents[-1], self.toks[-1], self.lps[-1] = (self.parents[-1][keep], self.toks[-1][keep],
                                                             self.lps[-1][keep])
        if self.adjusts:
            self.history = self.history[keep]
        for s in np.asarray(sentences).tolist():
            self.final[s] = []
        self.rows, self.moved = len(keep), None
        return keep

    def _finish(self, ss: np.ndarray, rows: np.ndarray, t: int, raws: np.ndarray, last_tok: np.ndarray,
                last_lp: np.ndarray, finished: bool) -> None:
        """New hypotheses of sentences ss: rows of the state that made step t, plus one token each."""
        m = len(rows)
        hist_tok = np.empty((m, t + 1), np.int64)
        hist_lp = np.empty((m, t + 1), np.float32)
        hist_tok[:, t], hist_lp[:, t] = last_tok, last_lp
        keep = self.attention_layer >= 0
        hist_att = [self.atts[t][rows]] if keep else []  # newest first: step t's, by the row that made it
        for u in range(t - 1, -1, -1):  # follow the back-pointers of all of them at once
            hist_tok[:, u], hist_lp[:, u] = self.toks[u][rows], self.lps[u][rows]
            rows = self.parents[u][rows]
            if keep:  # token u was chosen from the attention of the row it continued at step u
                hist_att.append(self.atts[u][rows])
        attention = self._attention_of(ss, hist_att[::-1]) if keep else [None] * m
        penalty = self.options.penalty(t + 1)
        for i, s in enumerate(ss.tolist()):
            ts = hist_tok[i, :t] if finished else hist_tok[i]
            raw = float(raws[i])
            hyps = self.final[s]
            hyps.append(Hypothesis(tuple(ts.tolist()), raw / penalty, raw, tuple(hist_lp[i].tolist()), finished,
                                   attention[i]))
            if len(hyps) >= self.need:
                # k-finished reads only that there are enough; the other rules the k-th best score
                self.kth[s] = (np.inf if self.rule == "k-finished" else
                               sorted((h.score for h in hyps), reverse=True)[self.k - 1])
                self.any_kth = True

    def advance(self, vals: np.ndarray, ids: np.ndarray, forced: tuple[np.ndarray, np.ndarray] | None = None,
                full: np.ndarray | None = None, attention: np.ndarray | None = None) -> None:
        t, kk, sent = self.t, self.ranked, self.sent
        if attention is not None and self.attention_layer >= 0:
            self.atts.append(np.ascontiguousarray(attention[:, self.attention_layer]))  # not a view of every layer's
        if full is not None and self.adjusts:
            vals, ids = self._adjusted(full, self.history)
        self.t += 1
        if forced is not None:  # a row in its prefix has one candidate, the prefix's token: one live beam
            f_ids, f_lp = forced[0], self._forced_lp(*forced, t)
            rows = np.flatnonzero(f_ids >= 0)
            vals, ids = vals.copy(), ids.copy()
            vals[rows, 0], ids[rows, 0], vals[rows, 1:] = f_lp[rows], f_ids[rows], -np.inf
        if self.options.sampling:  # each row's candidates drawn, not taken best first
            # a row's draws are its sentence's lanes of its beam's rank: not its slot, which the sentences beside it
            # can shift (_stay_in_place)
            width = vals.shape[1]
            u = sampling.uniforms(self.options.seed, self.keys[sent], t, self.nb * width).reshape(-1, self.nb, width)
            if self.rank is not None:
                u = np.take_along_axis(u, self.rank[:, :, None], axis=1)
            u = u.reshape(-1, width)
            pick = sampling.draw_many(vals, self.options, u, kk)
            vals, ids = np.take_along_axis(vals, pick, axis=1), np.take_along_axis(ids, pick, axis=1)
        n_row, n_tok, n_lp, n_score, ended = _next_beams(self.scores, vals, ids, self.nb, kk, self.k, self.eos,
                                                         self.offsets)
        nb_next = n_row.shape[1]
        if ended is not None:  # EOS among the k best continuations: finished hypotheses
            fs, f, raws = ended
            self._finish(sent[fs], f // kk, t, raws, ids.reshape(-1)[f], vals.reshape(-1)[f], True)
        # which sentences are done: cut at the maximum length, or early_stopping's rule (offline.py)
        done = None
        if t + 1 >= self.first_max:
            at_max = t + 1 >= self.max_len[sent]  # (ns,)
            fs, fj = np.nonzero(at_max[:, None] & np.isfinite(n_score))  # live beams: unfinished hypotheses
            if fs.size:
                self._finish(sent[fs], n_row[fs, fj], t, n_score[fs, fj], n_tok[fs, fj], n_lp[fs, fj], False)
            done = at_max
        if self.any_kth:
            k_done = self.kth[sent]
            if self.rule == "k-finished":
                beaten = k_done == np.inf
            else:  # the best live beam at its best reachable score (exact) or at its current length (heuristic)
                best = n_score[:, 0] / (self.lp_max[sent] if self.rule == "exact" else self.options.penalty(t + 1))
                beaten = np.isfinite(k_done) & ~(best > k_done)
            done = beaten if done is None else done | beaten
        if done is not None and done.any():
            for s in sent[done].tolist():
                hyps = self.final[s]
                hyps.sort(key=lambda h: (-h.score, not h.finished))
                self.done.append((s, DecodeResult(tuple(hyps[: self.options.nbest]))))
                self.final[s] = []
            if done.all():
                self.sent, self.rows, self.moved = sent[:0], 0, np.zeros(0, np.int64)
                self.row_sent, self.tokens = self.sent, np.zeros(0, np.int64)
                return
            keep = np.flatnonzero(~done)
            n_row, n_tok, n_lp, n_score = n_row[keep], n_tok[keep], n_lp[keep], n_score[keep]
            sent = self.sent = sent[keep]
        self.rank = None
        if nb_next > 1:  # beams in their parents' rows where they can be: fewer rows for reorder to move
            perm = _stay_in_place(n_row, nb_next)
            self.rank = perm  # the beams are in rank order before it
            if perm is not None:
                idx = perm + np.arange(0, n_row.size, nb_next)[:, None]  # flat
                n_row, n_tok = n_row.ravel()[idx], n_tok.ravel()[idx]
                n_lp, n_score = n_lp.ravel()[idx], n_score.ravel()[idx]
        if self.nb != nb_next or len(self.row_sent) != n_row.size:
            self.row_sent = np.repeat(sent, nb_next)
        self.nb = nb_next
        rows = n_row.reshape(-1)
        self.tokens = n_tok.reshape(-1)
        self.scores = n_score
        self.parents.append(rows)
        self.toks.append(self.tokens)
        if self.adjusts:  # each row's output so far, kept only where it is read every step
            self.history = np.concatenate([self.history[rows], self.tokens[:, None]], axis=1)
        self.lps.append(n_lp.reshape(-1))
        self.rows = len(rows)
        self.moved = rows  # beam search reorders every step (the backend moves only the rows that change)


def _prefix_table(prefixes: Sequence[Sequence[int]] | None, max_len: np.ndarray) -> tuple[np.ndarray, int]:
    """(sentences, longest prefix) token table, -1 past each prefix, and the longest prefix's length (0: none)."""
    if prefixes is None:
        return np.full((len(max_len), 1), -1, np.int64), 0
    lengths = np.array([len(p) for p in prefixes], np.int64)
    if not lengths.any():
        return np.full((len(max_len), 1), -1, np.int64), 0
    if len(prefixes) != len(max_len):
        raise InputError(f"{len(prefixes)} prefixes for {len(max_len)} sentences: give one per sentence (or none)")
    over = np.flatnonzero(lengths > max_len)
    if over.size:
        i = int(over[0])
        raise InputError(f"a prefix of {lengths[i]} tokens is longer than its sentence's maximum length "
                         f"({max_len[i]})", hint="shorten it, or raise max_len_b", params=("prefix",))
    table = np.full((len(max_len), int(lengths.max())), -1, np.int64)
    for i, p in enumerate(prefixes):
        table[i, : len(p)] = p
    return table, int(lengths.max())


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


# Sentences from which _stay_in_place works on flat arrays: below it, its Python loop is faster (a dozen numpy
# calls cost ~13 us, the loop ~0.7 us a sentence); at 256 sentences of 4 beams the loop took 0.19 ms, the arrays 0.03
STAY_VECTOR_FROM = 20


def _stay_in_place(parents: np.ndarray, nb: int) -> np.ndarray | None:
    """Slot order for each sentence's next beams: (ns, nb) parent rows -> (ns, nb) beam per slot, or None
    where every beam keeps its slot (the order is the identity: nothing to rearrange).

    Sentence i's next beams take rows i*nb .. i*nb+nb-1. The first beam continuing a parent whose row
    is among them takes that row (its cache is already there: the backend's reorder copies nothing
    for it); the other beams fill the remaining rows in score order. Beam order within a sentence
    means nothing to the search (the candidates of all beams are ranked together; only exactly equal
    scores are ordered by it, for every backend alike), so this only changes which rows a reorder
    moves: with beam 4, from most rows to the duplicated parents' children.
    """
    if len(parents) >= STAY_VECTOR_FROM:
        return _stay_in_place_arrays(parents, nb)
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


def _stay_in_place_arrays(parents: np.ndarray, nb: int) -> np.ndarray | None:
    """_stay_in_place on flat arrays: the same slot order, for many sentences."""
    flat = parents.reshape(-1)
    n = flat.size
    beams = np.arange(n)
    inside = np.flatnonzero((flat >= beams - beams % nb) & (flat < beams - beams % nb + nb))  # parent in block
    # the first beam (in score order) continuing each in-block parent keeps that parent's row
    rows, first = np.unique(flat[inside], return_index=True)
    keepers = inside[first]
    perm = np.empty(n, np.int64)
    perm[rows] = keepers % nb
    # the other beams fill the other rows, both in order: a sentence has as many of each
    free = np.ones(n, bool)
    free[rows] = False
    rest = np.ones(n, bool)
    rest[keepers] = False
    perm[free] = beams[rest] % nb
    return None if (perm == beams % nb).all() else perm.reshape(parents.shape)
