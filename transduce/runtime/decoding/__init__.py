"""The decoding engine: options and results, the search (greedy and beam, written once over the backend
protocol), the running batch that steps every live row of every cohort at once, and the offline driver.

  options   DecodingOptions, Hypothesis, DecodeResult and the maximum length formula
  search    greedy and beam search over one cohort of sentences (numpy bookkeeping only)
  running   the running batch: cohorts admitted at any step boundary, one backend state
  offline   decode(): one padded batch admitted whole and run until it is empty; teacher forcing
  batch     id lists as one padded batch (the one padding helper)
"""

from transduce.runtime.decoding.offline import decode, teacher_forced_log_probs
from transduce.runtime.decoding.options import (
    LENGTH_PENALTIES,
    DecodeResult,
    DecodingOptions,
    Hypothesis,
    max_lengths,
)

__all__ = ["LENGTH_PENALTIES", "DecodeResult", "DecodingOptions", "Hypothesis", "decode", "max_lengths",
           "teacher_forced_log_probs"]
