"""The token-equality check: CTranslate2's greedy output on its conversion (convert.py) must equal
ours token for token, and its log-probs ours within a tolerance, before CTranslate2 is timed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from transduce.bench.ctranslate2.convert import ct2_translate_ids, ct2_vocab, load_translator, suppressed
from transduce.bench.inputs import id_limit
from transduce.formats.model_config import ModelConfig
from transduce.runtime.decoding.batch import pad_ids

# Log-prob agreement demanded besides token equality: loose enough for fp32 reorderings, tight enough for a
# structural mistake in the conversion; what each gives: docs/design/bench.md, "The token-equality check".
LOGPROB_ATOL = 1e-4
LOGPROB_RTOL = 1e-4
RANDOM_TARGET_LEN = 16


@dataclass
class Divergence:
    sentence: int  # index in the checked set
    position: int  # first generated position that differs
    ours: int | None  # our token there (None: we had ended)
    theirs: int | None
    ours_tokens: list[int]
    theirs_tokens: list[int]
    margin: float | None = None  # our log-prob gap between the two tokens at that step (a near-tie if tiny)


@dataclass
class EqualityReport:
    label: str
    sentences: int
    equal: int
    mode: str  # "natural" (EOS ends) or "forced-N" (N steps, EOS banned), then ", beam K", ", target prefix [ids]"
    max_abs_logprob_diff: float | None = None  # CTranslate2 score_batch vs our teacher-forced log-probs, greedy paths
    max_abs_logprob_diff_random: float | None = None  # the same on random target sequences (any context)
    logprob_tolerance_exceeded: int = 0  # tokens where |diff| > LOGPROB_ATOL + LOGPROB_RTOL * |ours|
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.equal == self.sentences and self.logprob_tolerance_exceeded == 0

    def summary(self) -> str:
        search = "beam" if ", beam " in self.mode else "greedy"
        s = f"{self.label}: {self.equal}/{self.sentences} {search} outputs token-identical ({self.mode})"
        if self.max_abs_logprob_diff is not None:
            s += f", max |log-prob diff| on our {search} path {self.max_abs_logprob_diff:.2e}"
        if self.max_abs_logprob_diff_random is not None:
            s += f", on random targets {self.max_abs_logprob_diff_random:.2e}"
        if self.logprob_tolerance_exceeded:
            s += (f"; {self.logprob_tolerance_exceeded} log-probs differ by more than {LOGPROB_ATOL:g} + "
                  f"{LOGPROB_RTOL:g}|lp|")
        if self.divergences:
            d = self.divergences[0]
            s += (f"; first divergence: sentence {d.sentence}, position {d.position}: ours {d.ours}, "
                  f"CTranslate2 {d.theirs}")
            if d.margin is not None:
                s += f" (our log-prob margin between them {d.margin:.2e})"
        return s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        for dv in d["divergences"]:
            dv["ours_tokens"] = dv["ours_tokens"][:64]
            dv["theirs_tokens"] = dv["theirs_tokens"][:64]
        return d


def check_greedy_equality(model_dir: str, ct2_dir: str, sources: list[list[int]], label: str,
                          forced_steps: int | None = None, threads: int = 1, batch_size: int = 16,
                          translator=None, backend=None, beam_size: int = 1,
                          target_prefix: Sequence[int] = ()) -> EqualityReport:
    """Greedy-decode `sources` (our ids, without EOS) with our torch backend and with CTranslate2.

    forced_steps=None: natural decoding (EOS ends; our maximum length src_len + 50 per sentence,
    CTranslate2's max_decoding_length set to the same per batch of equal caps). forced_steps=N: both
    produce exactly N tokens (our min_length N+1 bans EOS throughout, CTranslate2's min = max = N).
    Also scores our greedy outputs with CTranslate2 (score_batch) against our teacher-forced log-probs.
    beam_size > 1: beam search instead, under CTranslate2's stopping rule (k-finished, patience 1) and no length
    penalty on both sides. target_prefix: the ids every output is forced to begin with on both sides (a
    multilingual model's target language code, CTranslate2's target_prefix; the sources then begin with the source
    language's code, as our Translator places it).
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # a correctness check: few threads avoid OpenMP stalls on a shared machine
    try:
        pair = _Pair(backend or _torch_backend(model_dir), translator or load_translator(ct2_dir, threads),
                     ct2_vocab(ct2_dir), batch_size, suppressed(ct2_dir), tuple(target_prefix))
        return _check(pair, sources, label, forced_steps, beam_size)
    finally:
        torch.set_num_threads(previous)


def _torch_backend(model_dir: str):
    from transduce.runtime.backends.torch_backend import TorchBackend

    return TorchBackend.from_model_dir(model_dir)


def _check(pair: _Pair, sources, label, forced_steps, beam_size) -> EqualityReport:
    from transduce.runtime.decoding import DecodingOptions

    rule = {"early_stopping": "k-finished"} if beam_size > 1 else {}  # CTranslate2's rule, patience 1
    if forced_steps is not None:
        opts = DecodingOptions.forced(forced_steps, beam_size=beam_size, length_penalty=0.0, **rule)
        mode = f"forced-{forced_steps}"
    else:
        opts = DecodingOptions(beam_size=beam_size, length_penalty=0.0, **rule)
        mode = "natural"
    mode += f", beam {beam_size}" if beam_size > 1 else ""
    mode += f", target prefix {list(pair.target_prefix)}" if pair.target_prefix else ""
    caps, ours, theirs = _greedy_outputs(pair, sources, opts, forced_steps)
    diffs = _LogprobDiffs()
    tf_rows, max_diff = _score_greedy_paths(pair, sources, ours, caps, forced_steps, diffs)
    max_random = _score_random_targets(pair, sources, diffs)
    report = EqualityReport(label, len(sources), 0, mode)
    for n, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a == b:
            report.equal += 1
        else:
            report.divergences.append(_divergence(n, a, b, tf_rows[n]))
    report.max_abs_logprob_diff = max_diff
    report.max_abs_logprob_diff_random = max_random
    report.logprob_tolerance_exceeded = diffs.exceeded
    return report


@dataclass
class _Pair:
    """Our backend and CTranslate2's translator on the same weights, fed the same sources a chunk at a time."""
    backend: Any
    translator: Any
    vocab: list[str]  # CTranslate2's tokens in our id order
    batch_size: int
    suppress: list[list[str]] | None = None  # the tokens our search never proposes (None: SUPPRESS)
    target_prefix: tuple[int, ...] = ()  # the tokens every output begins with (a target language's code)

    @property
    def cfg(self) -> ModelConfig:
        return self.backend.config

    def padded(self, batch: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Our encoder's input: each source with its EOS, padded -> (ids, lengths)."""
        return pad_ids(batch, self.cfg.pad_id, end=self.cfg.eos_id)

    def chunks(self, n: int):
        """Indices 0..n-1 in chunks of batch_size."""
        for j in range(0, n, self.batch_size):
            yield list(range(j, min(j + self.batch_size, n)))

    def score(self, sources: list[list[int]], targets: list[list[int]]):
        """CTranslate2's log-probs of `targets` (our ids) after `sources` (score_batch appends </s> to both)."""
        return self.translator.score_batch([[self.vocab[x] for x in src] for src in sources],
                                           [[self.vocab[x] for x in tgt] for tgt in targets])


class _LogprobDiffs:
    """CTranslate2's log-probs against ours, compared over their common prefix; counts those outside the
    tolerance (LOGPROB_ATOL + LOGPROB_RTOL * |ours|)."""

    def __init__(self) -> None:
        self.exceeded = 0

    def compare(self, ours_lp: np.ndarray, their_lp: np.ndarray) -> float:
        """-> the largest |difference| (0 for nothing to compare)."""
        k = min(len(ours_lp), len(their_lp))
        if not k:
            return 0.0
        d = np.abs(their_lp[:k] - ours_lp[:k])
        self.exceeded += int((d > LOGPROB_ATOL + LOGPROB_RTOL * np.abs(ours_lp[:k])).sum())
        return float(d.max())


def _greedy_outputs(pair: _Pair, sources, opts, forced_steps) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """Greedy decoding of every source by both -> (our length cap per source, our outputs, CTranslate2's)."""
    from transduce.runtime.decoding import decode, max_lengths

    cfg = pair.cfg
    # group by our maximum length so CTranslate2 gets the same cap (it takes one per batch)
    caps = [forced_steps if forced_steps is not None else
            int(max_lengths(np.array([len(x) + 1]), opts, cfg.max_positions)[0]) for x in sources]
    ours: list[list[int]] = [[] for _ in sources]
    theirs: list[list[int]] = [[] for _ in sources]
    for cap in sorted(set(caps)):
        idx = [i for i, c in enumerate(caps) if c == cap]
        for j in range(0, len(idx), pair.batch_size):
            chunk = idx[j: j + pair.batch_size]
            src, lens = pair.padded([sources[i] for i in chunk])
            prefixes = [list(pair.target_prefix)] * len(chunk) if pair.target_prefix else None
            for i, res in zip(chunk, decode(pair.backend, src, lens, opts, prefixes=prefixes), strict=True):
                ours[i] = list(res.best.tokens)
            # CTranslate2's min_decoding_length counts tokens before EOS, ours EOS included: natural decoding
            # allows an empty output in both (0), forced decoding bans EOS for `forced_steps` tokens
            got = ct2_translate_ids(pair.translator, pair.vocab, [sources[i] for i in chunk],
                                    beam_size=opts.beam_size, max_length=cap,
                                    min_length=forced_steps if forced_steps is not None else 0,
                                    suppress=pair.suppress, target_prefix=pair.target_prefix)
            for i, g in zip(chunk, got, strict=True):
                theirs[i] = g
    return caps, ours, theirs


def _score_greedy_paths(pair: _Pair, sources, ours, caps, forced_steps,
                        diffs: _LogprobDiffs) -> tuple[dict[int, np.ndarray], float]:
    """CTranslate2's log-probs of our greedy paths against ours (teacher-forced), EOS included where we ended on
    it -> (our teacher-forced log-probs per source, the largest |difference|)."""
    from transduce.runtime.decoding import teacher_forced_log_probs

    cfg = pair.cfg
    tf_rows: dict[int, np.ndarray] = {}
    max_diff = 0.0
    for chunk in pair.chunks(len(sources)):
        tgts = [ours[i] + ([cfg.eos_id] if forced_steps is None and len(ours[i]) < caps[i] else []) for i in chunk]
        t = max(max(len(x) for x in tgts), 1)
        tgt_in = np.full((len(chunk), t), cfg.pad_id, dtype=np.int64)
        tgt_in[:, 0] = cfg.bos_id
        for r, x in enumerate(tgts):
            tgt_in[r, 1: len(x)] = x[:-1]
        s_ids, s_lens = pair.padded([sources[i] for i in chunk])
        tf = teacher_forced_log_probs(pair.backend, s_ids, s_lens, tgt_in)  # (B, T, V)
        # score_batch appends </s>: a target of max_positions tokens would need one position more than
        # the model has, so it scores at most max_positions - 1 (compare() takes the common prefix)
        scored = pair.score([sources[i] for i in chunk], [ours[i][: cfg.max_positions - 1] for i in chunk])
        for r, (i, x, sc) in enumerate(zip(chunk, tgts, scored, strict=True)):
            tf_rows[i] = tf[r]
            if not x:
                continue
            ours_lp = tf[r, np.arange(len(x)), x]
            their_lp = np.array(sc.log_probs, dtype=np.float64)  # one per target token, plus </s>
            if len(ours[i]) > cfg.max_positions - 1:  # scored cut short: its last one is </s>'s, not ours
                their_lp = their_lp[: cfg.max_positions - 1]
            max_diff = max(max_diff, diffs.compare(ours_lp, their_lp))
    return tf_rows, max_diff


def _score_random_targets(pair: _Pair, sources, diffs: _LogprobDiffs) -> float:
    """The same comparison on random targets, where every position sees a context greedy search would not
    produce -> the largest |difference|."""
    from transduce.runtime.decoding import teacher_forced_log_probs

    cfg = pair.cfg
    rng = np.random.default_rng(0)
    max_random = 0.0
    length = max(1, min(RANDOM_TARGET_LEN, cfg.max_positions - 1))
    for chunk in pair.chunks(len(sources)):
        tgt = rng.integers(4, id_limit(cfg), size=(len(chunk), length))
        tgt_in = np.concatenate([np.full((len(chunk), 1), cfg.bos_id), tgt], axis=1)
        s_ids, s_lens = pair.padded([sources[i] for i in chunk])
        tf = teacher_forced_log_probs(pair.backend, s_ids, s_lens, tgt_in)  # (B, L+1, V)
        ours_lp = np.concatenate([np.take_along_axis(tf[:, :length], tgt[:, :, None], axis=2)[..., 0],
                                  tf[:, length, cfg.eos_id][:, None]], axis=1)
        scored = pair.score([sources[i] for i in chunk], tgt.tolist())
        for r, sc in enumerate(scored):
            max_random = max(max_random, diffs.compare(ours_lp[r], np.array(sc.log_probs, dtype=np.float64)))
    return max_random


def _divergence(n: int, a: list[int], b: list[int], tf_row: np.ndarray) -> Divergence:
    """Where our output `a` and CTranslate2's `b` for sentence n first differ, with our log-prob margin between
    the two tokens there (tf_row: our teacher-forced log-probs along our path)."""
    pos = next(t for t in range(max(len(a), len(b))) if t >= len(a) or t >= len(b) or a[t] != b[t])
    ta = a[pos] if pos < len(a) else None
    tb = b[pos] if pos < len(b) else None
    margin = None
    if ta is not None and tb is not None and pos < len(tf_row):
        margin = float(tf_row[pos, ta] - tf_row[pos, tb])
    return Divergence(n, pos, ta, tb, a, b, margin)
