"""`transduce decode` (a thin wrapper over the runtime library)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import sys
import time

import click

from transduce.cli.errors import QUIET_HELP, cli_errors, command_names, renamed, warning_text
from transduce.cli.options import backend_options, decoding_options, renamed_option
from transduce.errors import InputError, TruncatedInput
from transduce.io.paths import check_output, write_error, written_in_place

LOG_EVERY_S = 30.0  # stderr not a terminal (a log file, a CI job): a progress line this often


def _written_over(input_path: str, output_path: str) -> bool:
    """Whether writing --out writes the --input file in place (a link, say, to it; a regular file --out is
    written beside and renamed, so the input being read stays whole)."""
    if output_path == "-" or not written_in_place(output_path):
        return False
    try:  # standard input may be that file too (< in.txt)
        read = os.fstat(sys.stdin.fileno()) if input_path == "-" else os.stat(input_path)
        return os.path.samestat(read, os.stat(output_path))
    except (OSError, ValueError, AttributeError):  # missing or closed: reading or writing says so
        return False


class Progress:
    """decode's progress on stderr, as the Translator's progress(sentences, tokens): a bar on a terminal
    (sentences/s, tokens/s), else a line every LOG_EVERY_S (and one at the end, if any was written)."""

    def __init__(self, total: int | None, stream=None, clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.start = self.last = clock()
        self.total = total
        self.sentences = self.tokens = 0
        self.logged: int | None = None  # sentences done at the last line written
        self.bar = None
        if _is_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="decode", unit=" sentences", file=self.stream, dynamic_ncols=True,
                            mininterval=0.5)

    def __call__(self, sentences: int, tokens: int) -> None:
        self.sentences += sentences
        self.tokens += tokens
        now = self.clock()
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.tokens / max(now - self.start, 1e-9):,.0f} tokens/s", refresh=False)
            self.bar.update(sentences)
        elif now - self.last >= LOG_EVERY_S:
            self.last = now
            self._line(now)

    def _line(self, now: float) -> None:
        self.logged = self.sentences
        took = max(now - self.start, 1e-9)
        of = f" of {self.total:,}" if self.total is not None else ""
        click.echo(f"[decode] {self.sentences:,}{of} sentences in {took:.0f} s: {self.sentences / took:,.1f} "
                   f"sentences/s, {self.tokens / took:,.0f} tokens/s", file=self.stream)

    def above(self, stream=None):
        """A context to write a line to `stream` (stderr; stdout where it is the same terminal) in: the bar
        is cleared first and drawn again after."""
        if self.bar is None or not _is_terminal(stream if stream is not None else self.stream):
            return contextlib.nullcontext()
        return self.bar.external_write_mode(file=self.stream)

    def close(self, finished: bool) -> None:
        if self.bar is not None:
            self.bar.close()
        elif finished and self.logged is not None and self.logged != self.sentences:
            self._line(self.clock())


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class _LineWarnings:
    """The warnings recorded while decoding (`caught`), printed in input order: a line's beside its
    translation, whether they come from encoding the whole part (truncation) or from its result
    (unknown characters); the others (the options') at the next flush."""

    def __init__(self, caught: list, names: dict[str, str], progress: Progress | None):
        self.caught, self.names, self.progress = caught, names, progress
        self.pending: list = []

    def say(self, text: str) -> None:
        with self.progress.above() if self.progress is not None else contextlib.nullcontext():
            click.secho(f"warning: {text}", fg="yellow", err=True)

    def flush(self, line: int | None) -> None:
        """Print the recorded warnings of lines up to `line` (None: all of them) and those of no line."""
        self.pending.extend(self.caught)
        self.caught.clear()
        later = []
        for w in self.pending:
            n = w.message.line if isinstance(w.message, TruncatedInput) else None
            if line is None or n is None or n <= line:
                self.say(warning_text(w.message, self.names))
            else:
                later.append(w)
        self.pending[:] = later


@click.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--input", "input_path", default="-", show_default=True, help="Sentences, one per line ('-' = stdin).")
@click.option("--out", "out_path", default=None,
              help="Where the translations go: a file (written whole or not at all; an existing one is replaced "
                   "only with --force) or '-', standard output.  [default: -]")
@click.option("--output", "old_output", default=None, hidden=True, help="Deprecated spelling of --out.")
@click.option("--force", is_flag=True, help="Replace an existing --out file.")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@renamed_option("--max-batch-tokens", "--batch-tokens", "max_batch_tokens", default=None, type=int,
                help="Budget of rows x beam x source tokens per batch.  [default: 4096]")
@click.option("--truncate", is_flag=True, help="Cut over-long lines to the model's maximum instead of failing.")
@click.option("--scores", is_flag=True, help="Append the score to each line: 'text ||| score'.")
@click.option("--alignments", is_flag=True,
              help="Append each line's alignment in Pharaoh format, source-target token positions from 0 (as "
                   "fast_align and Marian write them): 'text ||| 0-0 2-1 1-2' (after the score with --scores or "
                   "--nbest). Implies --return-attention; docs/cli.md, \"Alignments\".")
@click.option("--prefix", "prefix_path", default=None,
              help="Target prefixes, one per input line (an empty line: none): each translation begins with its "
                   "line's prefix and decoding goes on from there (interactive translation, a fixed opening).")
@click.option("--chunk-lines", default=0, show_default=True,
              help="Decode the input this many lines at a time, each part's output written as soon as it is done "
                   "(memory bounded by one part; 1 answers a pipe line by line). 0: the whole input at once.")
@cli_errors(names={"prefixes": "--prefix"})
@backend_options(model_help="Model directory for --backend torch (default: the one the artifact names).",
                 threads_help="Threads (0: the framework's default). ONNX Runtime on the CPU decodes a small "
                              "model's larger batches in this many parts at the same time, one thread each.")
@decoding_options(helps={"nbest": "Hypotheses per sentence (written as 'i ||| text ||| score')."},
                  given_into="decoding_given")
def decode(artifact_dir, input_path, out_path, old_output, force, quiet, max_batch_tokens, deprecated_max_batch_tokens,
           truncate, scores, alignments, prefix_path, chunk_lines, spec, decoding, decoding_given):
    """Translate lines with an exported artifact (or engine directory for --backend tensorrt).

    Decoding options not given are the model's defaults: an imported model's are its source framework's
    (docs/importing.md), a trained model's the paper's (the defaults shown).

    The output has one line per input line (--nbest N: N lines 'i ||| text ||| score'); stdout holds the
    translations only. A file --out is whole or not at all: written beside it and renamed into place at
    the end. Progress goes to stderr: a bar on a terminal, else a line every 30 s (--quiet: neither).
    """
    import itertools
    import warnings

    from transduce.io.text import iter_lines
    from transduce.runtime.api import load

    out_path = renamed(out_path, old_output, "--out", "--output")
    out_path = "-" if out_path is None else out_path
    max_batch_tokens = renamed(max_batch_tokens, deprecated_max_batch_tokens, "--max-batch-tokens", "--batch-tokens")
    max_batch_tokens = 4096 if max_batch_tokens is None else max_batch_tokens
    _check_counts(chunk_lines, max_batch_tokens)
    if alignments:
        decoding_given = {**decoding_given, "return_attention": True}
    if chunk_lines and _written_over(input_path, out_path):  # what --force could not allow is said first
        raise InputError(f"--out {out_path!r} leads to the file the input is read from: "
                         "with --chunk-lines it would be overwritten while its later lines are still to be read",
                         hint="give another --out, or leave out --chunk-lines (the whole input is then read first)")
    check_output(out_path, "--out", force)
    lines = iter_lines(input_path, InputError)
    # the first part is read before the model loads: its input errors (all of them, without --chunk-lines) come first
    first = list(lines) if chunk_lines == 0 else list(itertools.islice(lines, chunk_lines))
    prefixes = None if prefix_path is None else list(iter_lines(prefix_path, InputError, "--prefix file"))
    if prefixes is not None and chunk_lines == 0 and len(prefixes) != len(first):
        raise InputError(f"--prefix has {len(prefixes)} lines and the input {len(first)}",
                         hint="give one prefix line per input line (an empty one for none)")
    translator = load(artifact_dir, spec, max_batch_tokens=max_batch_tokens)
    decoding = translator.options(decoding_given, "decode")  # the flags given over the model's defaults
    part = chunk_lines or max(len(first), 1)
    progress = None if quiet else Progress(None if chunk_lines else len(first))
    finished = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = translator.translate_stream(itertools.chain(first, lines), part, options=decoding,
                                                  truncate=truncate, progress=progress, prefixes=prefixes)
            said = _LineWarnings(caught, command_names(click.get_current_context().command), progress)
            said.flush(0)  # the options' warnings (a beam wider than the vocabulary) before decoding
            # the first part is decoded before the output is opened: an error in it (all of them, without
            # --chunk-lines) leaves a file, or what a link, FIFO or device --out leads to, as it was
            head = next(results, None)
            results = itertools.chain([] if head is None else [head], results)
            _write_output(out_path, results, said, _Fields(decoding.nbest, scores, alignments), part, progress)
        finished = True
    finally:
        if progress is not None:
            progress.close(finished)


def _check_counts(chunk_lines: int, max_batch_tokens: int) -> None:
    if chunk_lines < 0:
        raise InputError(f"--chunk-lines must be >= 0, got {chunk_lines}", hint="0 decodes the whole input at once")
    if max_batch_tokens < 1:
        raise InputError(f"--max-batch-tokens must be >= 1, got {max_batch_tokens}",
                         hint="a batch holds sentences x beam x source tokens up to this budget")


@dataclasses.dataclass(frozen=True)
class _Fields:
    """What each output line holds besides the text: the n-best number and score (nbest > 1), the score, the
    alignment."""

    nbest: int = 1
    scores: bool = False
    alignments: bool = False

    def line(self, i: int, c) -> str:
        """Candidate c of input line i's output line."""
        fields = [str(i), c.text, f"{c.score:.4f}"] if self.nbest > 1 else [c.text] + (
            [f"{c.score:.4f}"] if self.scores else [])
        if self.alignments:
            fields.append(c.pharaoh())
        return " ||| ".join(fields) + "\n"


def _write_output(out_path: str, results, said: _LineWarnings, fields: _Fields, part: int,
                  progress: Progress | None) -> None:
    """The translations to standard output ('-') or, whole or not at all, to the file out_path."""
    if out_path == "-":
        def write(text: str) -> None:
            try:
                with progress.above(sys.stdout) if progress is not None else contextlib.nullcontext():
                    sys.stdout.write(text)
                if text == "":
                    sys.stdout.flush()
            except BrokenPipeError:
                raise  # the reader went away (| head): click exits quietly
            except OSError as e:
                raise InputError(f"cannot write the translations to standard output: {e.strerror or e}",
                                 hint="free disk space, or give --out FILE" if e.errno in (errno.ENOSPC, errno.EDQUOT)
                                 else "give --out FILE") from None

        _write_translations(results, said, fields, part, write)
        return
    from transduce.io.atomic import atomic_file

    def cannot_write(e: OSError) -> InputError:  # an OSError from decoding is not one of these
        return write_error("--out", out_path, e)

    with atomic_file(out_path, error=cannot_write) as f:
        def write(text: str) -> None:
            try:
                f.write(text.encode("utf-8"))
            except OSError as e:
                raise cannot_write(e) from None

        _write_translations(results, said, fields, part, write)


def _write_translations(results, said: _LineWarnings, fields: _Fields, part: int, write) -> None:
    """Write each translation's line(s) as it comes, with its warnings on stderr, in line order (a part's
    warnings are recorded before its first line is written); write("") after every part of `part` lines and
    at the end: a flush."""
    for i, r in enumerate(results):
        said.flush(i + 1)
        if r.unknown:
            said.say(f"input line {i + 1}: {r.unknown} token(s) unknown to the tokenizer became <unk>")
        # nbest lines for every input, a blank one included (its one empty candidate, repeated)
        cands = (r.nbest * fields.nbest if r.empty else r.nbest) if fields.nbest > 1 else r.nbest[:1]
        write("".join(fields.line(i, c) for c in cands))
        if (i + 1) % part == 0:
            write("")
    said.flush(None)
    write("")


COMMANDS = [decode]
