"""A corpus too big to hold, streamed from disk (`transduce train --stream`): read a window of pairs at a time,
each window sorted by length and cut into token-budget batches as a corpus held in memory is (data.make_batches).

Epoch e visits the windows in the order epoch_order(windows, seed, e), and a window's batches in an order drawn
from (seed, e, window): a position (epoch, window, batch) is all a checkpoint needs to continue exactly, and every
rank, reading and encoding each window itself, cuts the same global batches. What memory holds: one window's pairs
and token ids per rank, the held-out pairs, and the index (a byte offset per window, io.parallel). Pairs of
two windows never share a batch, so the batches are not those of the same corpus held whole.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

from transduce.errors import DataError
from transduce.io.parallel import CorpusIndex, read_pairs
from transduce.training.checks import add_to_fingerprint
from transduce.training.data import Example, encode_pairs, epoch_order, make_batches


class StreamedCorpus:
    """The training pairs of an indexed corpus: its first `pairs` (those after them are held out)."""

    def __init__(self, index: CorpusIndex, pairs: int):
        self.index, self.pairs = index, pairs
        self.sha256: str | None = None  # the pairs' fingerprint (checks.pairs_sha256), once a pass computed it
        self.overlap = 0  # held-out pairs that are also training pairs, counted by that pass

    def __len__(self) -> int:
        return self.pairs

    @property
    def windows(self) -> int:
        return -(-self.pairs // self.index.window)

    def window(self, w: int) -> list[tuple[str, str]]:
        first = w * self.index.window
        return read_pairs(self.index, first, min(self.index.window, self.pairs - first))

    def sentences(self, valid_pairs: list[tuple[str, str]] = ()) -> Iterator[str]:
        """Every training pair's source and target, in corpus order (what the tokenizer is trained on); the same
        pass computes `sha256` and counts `overlap` with `valid_pairs`."""
        h = hashlib.sha256()
        held = [(s.strip(), t.strip()) for s, t in valid_pairs]
        wanted, seen = set(held), set()
        for w in range(self.windows):
            for src, tgt in self.window(w):
                add_to_fingerprint(h, src, tgt)
                if (src, tgt) in wanted:
                    seen.add((src, tgt))
                yield src
                yield tgt
        self.sha256 = h.hexdigest()
        self.overlap = sum(pair in seen for pair in held)

    def fingerprint(self, valid_pairs: list[tuple[str, str]] = ()) -> str:
        """The pairs' fingerprint, reading them once more unless a pass over them computed it already."""
        if self.sha256 is None:
            for _ in self.sentences(valid_pairs):
                pass
        return self.sha256

    def describe(self) -> str:
        return f"{self.pairs} training pairs streamed in {self.windows} windows of up to {self.index.window}"


class StreamBatches:
    """The batches of a StreamedCorpus (see the module's docstring); a batch source as data.Batches is."""

    def __init__(self, corpus: StreamedCorpus, tokenizer, max_positions: int, max_tokens: int, seed: int):
        self.corpus, self.tokenizer, self.max_positions = corpus, tokenizer, max_positions
        self.max_tokens, self.seed = max_tokens, seed
        self.dropped = 0  # pairs longer than max_positions, in the windows read so far

    def epoch(self, epoch: int, window: int = 0, batch: int = 0) -> Iterator[tuple[int, int, list[Example]]]:
        """The batches of `epoch` from position (window, batch) on, each as (window, batch, its examples)."""
        order = epoch_order(self.corpus.windows, self.seed, epoch)
        any_batch = False
        for wpos in range(window, len(order)):
            pairs = self.corpus.window(order[wpos])
            examples, kept = encode_pairs(self.tokenizer, pairs, self.max_positions)
            self.dropped += len(pairs) - len(kept)
            batches = make_batches(examples, self.max_tokens)
            border = list(range(len(batches)))
            random.Random(f"{self.seed}/{epoch}/{order[wpos]}").shuffle(border)
            for b in range(batch if wpos == window else 0, len(border)):
                any_batch = True
                yield wpos, b, [examples[i] for i in batches[border[b]]]
        if not any_batch and window == 0 and batch == 0:
            raise DataError("no training pair fits the model's max_positions")

    def describe(self) -> str:
        return self.corpus.describe()
