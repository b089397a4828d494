"""Random sampling over the backend's top-k candidates, with draws that depend only on (seed, sentence, step).

The backend hands each row its K most likely next tokens (K = sampling_topk, or the whole vocabulary for 0) as
log-probs, best first. Sampling divides them by the temperature, keeps the fewest best whose probabilities add up
to at least sampling_topp (at least one), and draws from what is left, renormalised:
  - one token per row (random sampling, beam_size 1): by inverse CDF, one uniform draw per row;
  - kk distinct tokens per row (beam search's candidates): the Gumbel-top-kk trick (Kool et al., 2019), one draw
    per candidate, so candidates are drawn without replacement in proportion to their probability; they come back
    in the order drawn, and the beam search then ranks them by score as it ranks the best ones.
The draws are a counter-based generator (SplitMix64's finaliser over the seed, the sentence's key, the step and
the lane), so a sentence's draws are the same whatever was decoded beside it, in whatever batch or order, on
every backend: batch invariance, which a stateful generator shared by the batch would break. The scores
reported are the model's log-probs of the tokens drawn (not the tempered ones).
"""

from __future__ import annotations

import numpy as np

from transduce.runtime.decoding.options import DecodingOptions

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def uniforms(seed: int, keys: np.ndarray, step: int, lanes: int) -> np.ndarray:
    """(len(keys), lanes) float64 draws in (0, 1): a function of (seed, key, step, lane) only."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as it is meant to
        z = _mix(np.full(len(keys), seed, np.uint64) + _GOLDEN)
        z = _mix(z + np.asarray(keys, np.uint64) * _GOLDEN)
        z = _mix(z + np.full(len(keys), step, np.uint64) * _GOLDEN)
        z = _mix(z[:, None] + (np.arange(lanes, dtype=np.uint64) + np.uint64(1)) * _GOLDEN)
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def candidates(options: DecodingOptions, vocab_size: int) -> int:
    """Candidates a sampling row reads from the backend: sampling_topk, or the whole vocabulary for 0."""
    return vocab_size if options.sampling_topk == 0 else min(options.sampling_topk, vocab_size)


def _weights(vals: np.ndarray, options: DecodingOptions) -> np.ndarray:
    """(R, K) log-probs, best first -> unnormalised probabilities at the temperature, zero past the top-p cut."""
    logits = vals.astype(np.float64) / options.sampling_temperature
    w = np.exp(logits - logits[:, :1])  # the first is each row's largest: no overflow (-inf rows: banned, all 0)
    w[~np.isfinite(w)] = 0.0
    if options.sampling_topp < 1.0:
        total = w.sum(axis=1, keepdims=True)
        before = np.cumsum(w, axis=1) - w  # probability of the candidates before each
        w[before >= options.sampling_topp * total] = 0.0  # the first always stays (before = 0)
    return w


def draw_one(vals: np.ndarray, options: DecodingOptions, u: np.ndarray) -> np.ndarray:
    """(R, K) log-probs, best first, and (R,) uniforms -> (R,) the index of each row's draw."""
    w = _weights(vals, options)
    cum = np.cumsum(w, axis=1)
    pick = (cum <= (u * cum[:, -1])[:, None]).sum(axis=1)  # the first whose cumulative weight passes u
    return np.minimum(pick, vals.shape[1] - 1)


def draw_many(vals: np.ndarray, options: DecodingOptions, u: np.ndarray, kk: int) -> np.ndarray:
    """(R, K) log-probs, best first, and (R, K) uniforms -> (R, kk) distinct candidate indices in the order drawn
    (Gumbel-top-kk); candidates of zero weight come last, best first."""
    w = _weights(vals, options)
    with np.errstate(divide="ignore"):
        keys = np.log(w) - np.log(-np.log(u))  # log weight + Gumbel noise; -inf for zero weights
    keys = np.where(np.isfinite(keys), keys, -np.inf)
    order = np.argsort(-keys, axis=1, kind="stable")
    return order[:, :kk]
