"""Parallel corpora on disk: a TSV file (source<TAB>target per line) or two aligned text files (UTF-8, lines
split as transduce.formats.text reads them)."""

from __future__ import annotations

import os

from transduce.errors import DataError
from transduce.formats.text import read_lines


def read_parallel(source: str | os.PathLike, target: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """Read a TSV corpus (target=None) or two aligned files (UTF-8, lines split as text.read_lines does).
    Blank TSV lines are skipped; a malformed line or an empty side is an error, named by number."""
    source = os.fspath(source)
    pairs: list[tuple[str, str]] = []
    if target is None:
        for n, line in enumerate(read_lines(source, DataError, "corpus file"), 1):
            if not line.strip():
                continue
            parts = line.split("\t")
            if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
                got = (f"{len(parts)} fields" if len(parts) != 2
                       else f"an empty {'source' if not parts[0].strip() else 'target'}")
                raise DataError(
                    f"{source}:{n}: expected 'source<TAB>target' with both sides non-empty, got {got}",
                    hint="give a TSV with exactly one tab per line, or two aligned files",
                )
            pairs.append((parts[0].strip(), parts[1].strip()))
    else:
        src_lines, tgt_lines = (read_lines(source, DataError, "corpus file"),
                                read_lines(target, DataError, "corpus file"))
        if len(src_lines) != len(tgt_lines):
            raise DataError(
                f"{source} has {len(src_lines)} lines but {os.fspath(target)} has {len(tgt_lines)}: "
                "the files are not aligned"
            )
        for n, (s, t) in enumerate(zip(src_lines, tgt_lines), 1):
            if not s.strip() or not t.strip():
                side, path = ("source", source) if not s.strip() else ("target", target)
                raise DataError(f"{os.fspath(path)}:{n}: empty {side} sentence",
                                hint="every line of --source and --target is one sentence: "
                                     "remove or fill it in both files")
            pairs.append((s.strip(), t.strip()))
    if not pairs:
        raise DataError(f"corpus {source!r} has no sentence pairs")
    return pairs


def write_tsv(path: str | os.PathLike, pairs: list[tuple[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for s, t in pairs:
            f.write(f"{s}\t{t}\n")
