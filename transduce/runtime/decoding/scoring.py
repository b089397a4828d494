"""Teacher-forced scores: the log-probs a model gives to given targets, token by token (Translator.score,
`transduce score`, the server's /v1/score).

A target's tokens are fed to the decoder as decoding would have produced them (BOS, then each token), and the
log-prob of the next token is read from each step's full log-probs: the sum, EOS included, is what decode
reports as a hypothesis's log_prob when it produces that target. Rows leave the state as their targets end.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from transduce.errors import BackendUnavailable, InputError
from transduce.runtime.backends.base import Backend, FullOutputs, has_capability
from transduce.runtime.decoding.batch import pad_ids


def score_ids(backend: Backend, src_ids: np.ndarray, src_lengths: np.ndarray,
              targets: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """(B, S) sources with their (B,) lengths (EOS included) and B targets (token ids, EOS excluded) -> each
    target's token log-probs, float32, EOS's last (len + 1 each)."""
    if not has_capability(backend, FullOutputs):
        raise BackendUnavailable(f"the {backend.name} backend gives no full log-probs (step_log_probs) to score with")
    cfg = backend.config
    if len(targets) != len(src_ids):
        raise InputError(f"{len(targets)} targets for {len(src_ids)} sources: give one target per source")
    if len(src_ids) == 0:
        return []
    out, lengths = pad_ids(targets, cfg.pad_id, end=cfg.eos_id)  # (B, T) what each step predicts, EOS last
    if int(lengths.max()) > cfg.max_positions:
        raise InputError(f"a target of {int(lengths.max()) - 1} tokens does not fit the model's {cfg.max_positions} "
                         "positions (EOS included)", hint="score shorter targets")
    fed = np.full_like(out, cfg.pad_id)  # what each step reads: BOS, then the target's tokens
    fed[:, 0] = cfg.bos_id
    fed[:, 1:] = out[:, :-1]
    log_probs = np.zeros(out.shape, np.float32)
    encoded = backend.encode(np.ascontiguousarray(src_ids, np.int64), np.ascontiguousarray(src_lengths, np.int64))
    state = backend.begin(encoded, np.arange(len(out)), out.shape[1])
    try:
        rows = np.arange(len(out))  # the sentence of each live row
        for t in range(out.shape[1]):
            full = backend.step_log_probs(state, np.ascontiguousarray(fed[rows, t]))
            log_probs[rows, t] = full[np.arange(len(rows)), out[rows, t]]
            keep = np.flatnonzero(lengths[rows] > t + 1)
            if keep.size == 0:
                break
            if keep.size < len(rows):
                rows = rows[keep]
                backend.reorder(state, keep, rows)
    finally:
        backend.end(state)
    return [log_probs[i, : lengths[i]] for i in range(len(out))]
