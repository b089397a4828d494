"""Repetition control: a step's log-probs adjusted by what the hypothesis already holds, before the search
picks from them (DecodingOptions.no_repeat_ngram_size, repetition_penalty).

  no_repeat_ngram_size n   a token that would complete an n-gram already in the hypothesis gets -inf
                           (Hugging Face's and CTranslate2's rule; n = 1: no token twice);
  suppress                 token sequences no output may hold: one token gets -inf always, a longer
                           sequence's last token -inf where the hypothesis ends with the rest (CTranslate2's
                           suppress_sequences; the options hold them as token ids by then: Translator.resolved);
  repetition_penalty p     the log-prob of every token already in the hypothesis is multiplied by p (log-probs
                           are <= 0, so p > 1 makes them less likely): Hugging Face's repetition_penalty as its
                           beam search applies it, to log-probs (on logits, as its greedy search and CTranslate2
                           apply it, the same p penalises differently).
The search then runs on the adjusted log-probs: its scores, and the log_prob it reports, are theirs (as Hugging
Face's are); `transduce score` gives the model's own. Needs the step's full log-probs (FullOutputs).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from transduce.runtime.decoding.options import DecodingOptions


def adjusted(log_probs: np.ndarray, history: np.ndarray, options: DecodingOptions) -> np.ndarray:
    """(R, V) log-probs of the next token and (R, t) the tokens each row's hypothesis holds -> an adjusted copy."""
    out = np.array(log_probs, dtype=np.float32, copy=True)
    t = history.shape[1]
    rows = np.arange(len(out))[:, None]
    if options.repetition_penalty != 1.0 and t:  # first: the bans below must stay -inf whatever the penalty
        out[rows, history] = out[rows, history] * np.float32(options.repetition_penalty)
    for seq in options.suppress:
        if isinstance(seq, str):
            raise TypeError("suppress holds text: the translator turns it into token ids (Translator.resolved)")
        if len(seq) == 1:
            out[:, seq[0]] = -np.inf
        elif t >= len(seq) - 1:
            out[(history[:, t - len(seq) + 1:] == seq[:-1]).all(axis=1), seq[-1]] = -np.inf
    if t == 0:
        return out
    n = options.no_repeat_ngram_size
    if n == 1:
        out[rows, history] = -np.inf
    elif n > 1 and t >= n:
        windows = sliding_window_view(history, n, axis=1)  # (R, t - n + 1, n): every n-gram so far
        suffix = history[:, t - n + 1:]  # (R, n - 1): what the next token would complete
        r, j = np.nonzero((windows[:, :, :-1] == suffix[:, None, :]).all(axis=2))
        out[r, windows[r, j, -1]] = -np.inf
    return out
