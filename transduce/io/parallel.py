"""Parallel corpora on disk: a TSV file (source<TAB>target per line) or two aligned text files (UTF-8, lines
split as transduce.io.text reads them), read whole (read_parallel) or, for a corpus too big to hold, indexed
once (index_parallel) and read window by window from its byte offsets (read_pairs)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from transduce.errors import DataError
from transduce.io.text import iter_lines_at


def read_parallel(source: str | os.PathLike, target: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """Read a TSV corpus (target=None) or two aligned files (UTF-8, lines split as text.read_lines does).
    Blank TSV lines are skipped; a malformed line or an empty side is an error, named by number."""
    pairs = [pair for _, pair in _pairs(os.fspath(source), target and os.fspath(target))]
    if not pairs:
        raise DataError(f"corpus {os.fspath(source)!r} has no sentence pairs")
    return pairs


def write_tsv(path: str | os.PathLike, pairs: list[tuple[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for s, t in pairs:
            f.write(f"{s}\t{t}\n")


def _tsv_pair(line: str, n: int, source: str) -> tuple[str, str] | None:
    """A TSV line as a pair (None for a blank line), or the DataError naming it."""
    if not line.strip():
        return None
    parts = line.split("\t")
    if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
        got = (f"{len(parts)} fields" if len(parts) != 2
               else f"an empty {'source' if not parts[0].strip() else 'target'}")
        raise DataError(f"{source}:{n}: expected 'source<TAB>target' with both sides non-empty, got {got}",
                        hint="give a TSV with exactly one tab per line, or two aligned files")
    return parts[0].strip(), parts[1].strip()


def _aligned_pair(s: str, t: str, n: int, source: str, target: str) -> tuple[str, str]:
    if not s.strip() or not t.strip():
        side, path = ("source", source) if not s.strip() else ("target", target)
        raise DataError(f"{path}:{n}: empty {side} sentence",
                        hint="every line of --source and --target is one sentence: remove or fill it in both files")
    return s.strip(), t.strip()


def _pairs(source: str, target: str | None, at: tuple[int, int, int] = (1, 0, 0),
           ) -> Iterator[tuple[tuple[int, int, int], tuple[str, str]]]:
    """The corpus's pairs from `at` on ((line number, source byte offset, target byte offset) of a line start), each
    with the `at` of its line, checked as read_parallel checks them."""
    line, src_at, tgt_at = at
    if target is None:
        for offset, n, text in iter_lines_at(source, DataError, "corpus file", src_at, line):
            pair = _tsv_pair(text, n, source)
            if pair is not None:
                yield (n, offset, 0), pair
        return
    sources = iter_lines_at(source, DataError, "corpus file", src_at, line)
    targets = iter_lines_at(target, DataError, "corpus file", tgt_at, line)
    n = line - 1
    for s_at, n, s in sources:
        t_next = next(targets, None)
        if t_next is None:
            _not_aligned(source, n + sum(1 for _ in sources), target, n - 1)
        t_at, _, t = t_next
        yield (n, s_at, t_at), _aligned_pair(s, t, n, source, target)
    rest = sum(1 for _ in targets)
    if rest:
        _not_aligned(source, n, target, n + rest)


def _not_aligned(source: str, source_lines: int, target: str, target_lines: int) -> None:
    raise DataError(f"{source} has {source_lines} lines but {target} has {target_lines}: the files are not aligned")


@dataclass(frozen=True)
class CorpusIndex:
    """Where every `window`-th pair of a corpus starts: (line number, source byte offset, target byte offset) of
    pairs 0, window, 2 * window, ...; `pairs` in all. What reading a window of it (read_pairs) seeks to."""

    source: str
    target: str | None
    pairs: int
    window: int
    starts: tuple[tuple[int, int, int], ...]


def index_parallel(source: str | os.PathLike, target: str | os.PathLike | None = None,
                   window: int = 100_000) -> CorpusIndex:
    """One pass over a corpus (as read_parallel reads it, with the same checks and errors), keeping only where
    each window of `window` pairs starts: memory for the offsets, not the text."""
    source, target = os.fspath(source), target and os.fspath(target)
    if source == "-" or target == "-":
        raise DataError("a streamed corpus is read from files it can seek in, not from standard input",
                        hint="write it to a file first")
    starts, n = [], 0
    for at, _ in _pairs(source, target):
        if n % window == 0:
            starts.append(at)
        n += 1
    if not n:
        raise DataError(f"corpus {source!r} has no sentence pairs")
    return CorpusIndex(source, target, n, window, tuple(starts))


def read_pairs(index: CorpusIndex, first: int, count: int) -> list[tuple[str, str]]:
    """Pairs first .. first + count - 1 of an indexed corpus (fewer at its end), read from the start of the window
    that holds `first`."""
    if count <= 0 or first >= index.pairs:
        return []
    w = first // index.window
    skip, out = first - w * index.window, []
    for _, pair in _pairs(index.source, index.target, index.starts[w]):
        if skip:
            skip -= 1
            continue
        out.append(pair)
        if len(out) == count:
            break
    return out
