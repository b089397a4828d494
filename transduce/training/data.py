"""Token-count batching of a parallel corpus (read by transduce.io.parallel) for training.

Batches are built the paper's way: sentence pairs sorted by length into buckets, each batch filled up to a token
budget; the batch order is shuffled per epoch from (seed, epoch), so a resumed run replays the same
sequence of batches without saving any iterator state beyond (epoch, index). A corpus too big to hold is batched
the same way window by window (training.stream).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    src: tuple[int, ...]  # source ids + EOS
    tgt: tuple[int, ...]  # target ids (no BOS / EOS)


def encode_pairs(tokenizer, pairs: list[tuple[str, str]], max_positions: int) -> tuple[list[Example], list[int]]:
    """Tokenize pairs; drop those that do not fit max_positions. Returns (examples, kept pair indices)."""
    srcs = tokenizer.encode_batch([s for s, _ in pairs])
    tgts = tokenizer.encode_batch([t for _, t in pairs])
    out, kept = [], []
    for i, (s, t) in enumerate(zip(srcs, tgts)):
        if len(s) + 1 > max_positions or len(t) + 1 > max_positions or not s or not t:
            continue
        out.append(Example(tuple(s) + (tokenizer.eos_id,), tuple(t)))
        kept.append(i)
    return out, kept


def make_batches(examples: list[Example], max_tokens: int) -> list[list[int]]:
    """Indices of examples grouped into batches of at most max_tokens (padded) tokens per side."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].src), len(examples[i].tgt) + 1))
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        n = max(len(examples[i].src), len(examples[i].tgt) + 1)
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def epoch_order(n_batches: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n_batches))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def target_tokens(examples: list[Example]) -> int:
    """The tokens the loss is a mean over: each target's, and its EOS."""
    return sum(len(e.tgt) + 1 for e in examples)


class Batches:
    """The batches of a corpus held in memory: cut once (make_batches), shuffled per epoch (epoch_order). Every
    batch source has `epoch` and `describe`; a position in it is (epoch, window, batch), the window always 0 here."""

    def __init__(self, examples: list[Example], max_tokens: int, seed: int):
        self.examples, self.seed = examples, seed
        self.batches = make_batches(examples, max_tokens)

    def epoch(self, epoch: int, window: int = 0, batch: int = 0) -> Iterator[tuple[int, int, list[Example]]]:
        """The batches of `epoch` from position (window, batch) on, each as (window, batch, its examples)."""
        order = epoch_order(len(self.batches), self.seed, epoch)
        for b in range(batch, len(order)):
            yield 0, b, [self.examples[i] for i in self.batches[order[b]]]

    def describe(self) -> str:
        return f"{len(self.examples)} training pairs in {len(self.batches)} batches"


def collate(examples: list[Example], pad_id: int, bos_id: int, eos_id: int):
    """-> src_ids (B,S), src_lengths (B,), tgt_in (B,T) = BOS + y, tgt_out (B,T) = y + EOS (torch)."""
    import torch

    b = len(examples)
    s = max(len(e.src) for e in examples)
    t = max(len(e.tgt) for e in examples) + 1
    src = torch.full((b, s), pad_id, dtype=torch.long)
    tgt_in = torch.full((b, t), pad_id, dtype=torch.long)
    tgt_out = torch.full((b, t), pad_id, dtype=torch.long)
    lengths = torch.zeros(b, dtype=torch.long)
    for i, e in enumerate(examples):
        src[i, : len(e.src)] = torch.tensor(e.src)
        lengths[i] = len(e.src)
        tgt_in[i, : len(e.tgt) + 1] = torch.tensor((bos_id,) + e.tgt)
        tgt_out[i, : len(e.tgt) + 1] = torch.tensor(e.tgt + (eos_id,))
    return src, lengths, tgt_in, tgt_out
