"""UTF-8 text input, line by line: what every command reads sentences and corpora with."""

from __future__ import annotations

import os
from collections.abc import Iterator

from transduce.errors import TransduceError


def read_lines(path: str | os.PathLike, error: type[TransduceError], what: str = "input file") -> list[str]:
    """All of iter_lines(path, error, what)."""
    return list(iter_lines(path, error, what))


def iter_lines(path: str | os.PathLike, error: type[TransduceError], what: str = "input file") -> Iterator[str]:
    """A UTF-8 text file ("-": stdin) line by line, each as soon as it has been read (a pipe's lines as
    they arrive): split at "\n" only (a "\r" before it is dropped; Unicode's other line breaks, such as
    U+2028 or form feed, stay inside their line, as `wc -l` counts), a leading byte-order mark dropped,
    no empty last line for the final newline. Unreadable input is `error` naming the file (and the line
    of an invalid byte), raised when that line is reached."""
    for _, _, line in iter_lines_at(path, error, what):
        yield line


def iter_lines_at(path: str | os.PathLike, error: type[TransduceError], what: str = "input file", offset: int = 0,
                  first_line: int = 1) -> Iterator[tuple[int, int, str]]:
    """iter_lines from byte `offset` of a file on (a line's start, which a previous read gave; 0 for stdin),
    as (the line's byte offset, its number, counted from `first_line` there, the line): what a corpus read
    window by window seeks back to."""
    import sys

    stdin = os.fspath(path) == "-"
    name = "standard input" if stdin else repr(os.fspath(path))

    def unreadable(e: OSError) -> TransduceError:
        if isinstance(e, FileNotFoundError):
            return error(f"{what} {name} does not exist")
        if isinstance(e, IsADirectoryError):
            return error(f"{what} {name} is a directory", hint="give a text file, one sentence per line")
        return error(f"cannot read {what} {name}: {e.strerror}")

    if stdin and sys.stdin is None:  # fd 0 closed (a daemon's, `<&-`)
        raise error(f"standard input (the {what} '-') is closed", hint=f"give the {what}'s path")
    try:
        f = sys.stdin.buffer if stdin else open(path, "rb")  # noqa: SIM115 (closed below)
        if offset:
            f.seek(offset)
    except OSError as e:
        raise unreadable(e) from None
    try:
        n = first_line - 1
        while True:
            at = offset
            try:
                raw = f.readline()
            except OSError as e:
                raise unreadable(e) from None
            if not raw:
                return
            n += 1
            offset += len(raw)
            if at == 0 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
                if not raw:  # a byte-order mark alone: no lines
                    return
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{what} {name} is not UTF-8 text: line {n} has an invalid byte ({e.reason})",
                            hint="convert it, e.g. iconv -f LATIN1 -t UTF-8") from None
            if line.endswith("\n"):
                line = line[:-1]
            yield at, n, line[:-1] if line.endswith("\r") else line
    finally:
        if not stdin:
            f.close()
