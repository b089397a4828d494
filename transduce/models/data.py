"""Parallel corpora and token-count batching.

A corpus is a TSV file (source<TAB>target per line) or two aligned text files. Batches are built
the paper's way: sentence pairs sorted by length into buckets, each batch filled up to a token
budget; the batch order is shuffled per epoch from (seed, epoch), so a resumed run replays the same
sequence of batches without saving any iterator state beyond (epoch, index).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from transduce.errors import DataError


def read_parallel(source: str | os.PathLike, target: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """Read a TSV corpus (target=None) or two aligned files (UTF-8, lines split as _io.read_lines does).
    Blank TSV lines are skipped; a malformed line or an empty side is an error, named by number."""
    from transduce._io import read_lines

    source = os.fspath(source)
    pairs: list[tuple[str, str]] = []
    if target is None:
        for n, line in enumerate(read_lines(source, DataError, "corpus file"), 1):
            if not line.strip():
                continue
            parts = line.split("\t")
            if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
                got = f"{len(parts)} fields" if len(parts) != 2 else f"an empty {'source' if not parts[0].strip() else 'target'}"
                raise DataError(
                    f"{source}:{n}: expected 'source<TAB>target' with both sides non-empty, got {got}",
                    hint="give a TSV with exactly one tab per line, or two aligned files",
                )
            pairs.append((parts[0].strip(), parts[1].strip()))
    else:
        src_lines, tgt_lines = read_lines(source, DataError, "corpus file"), read_lines(target, DataError, "corpus file")
        if len(src_lines) != len(tgt_lines):
            raise DataError(
                f"{source} has {len(src_lines)} lines but {os.fspath(target)} has {len(tgt_lines)}: "
                "the files are not aligned"
            )
        for n, (s, t) in enumerate(zip(src_lines, tgt_lines), 1):
            if not s.strip() or not t.strip():
                side, path = ("source", source) if not s.strip() else ("target", target)
                raise DataError(f"{os.fspath(path)}:{n}: empty {side} sentence",
                                hint="every line of --source and --target is one sentence: remove or fill it in both files")
            pairs.append((s.strip(), t.strip()))
    if not pairs:
        raise DataError(f"corpus {source!r} has no sentence pairs")
    return pairs


def write_tsv(path: str | os.PathLike, pairs: list[tuple[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for s, t in pairs:
            f.write(f"{s}\t{t}\n")


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
