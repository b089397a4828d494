"""`transduce decode` (a thin wrapper over the runtime library)."""

from __future__ import annotations

import sys

import click

from transduce.cli_errors import cli_errors
from transduce.errors import InputError, TruncatedInput
from transduce.formats.paths import check_output_file
from transduce.runtime.api import BACKENDS

BACKEND_CHOICE = click.Choice(BACKENDS)


def _written_over(input_path: str, output_path: str) -> bool:
    """Whether writing --output writes the --input file in place (a link, say, to it; a regular file
    --output is written beside and renamed, so the input being read stays whole)."""
    import os

    from transduce.formats.paths import written_in_place

    if output_path == "-" or not written_in_place(output_path):
        return False
    try:  # standard input may be that file too (< in.txt)
        read = os.fstat(sys.stdin.fileno()) if input_path == "-" else os.stat(input_path)
        return os.path.samestat(read, os.stat(output_path))
    except (OSError, ValueError, AttributeError):  # missing or closed: reading or writing says so
        return False


@click.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--input", "input_path", default="-", show_default=True, help="Sentences, one per line ('-' = stdin).")
@click.option("--output", "output_path", default="-", show_default=True, help="Where translations go ('-' = stdout).")
@click.option("--backend", default="onnxruntime", show_default=True, type=BACKEND_CHOICE)
@click.option("--device", default="cpu", show_default=True,
              help="cpu, cuda or cuda:N (cuda: the first GPU for onnxruntime; tensorrt: always a GPU, "
                   "cpu meaning the default one).")
@click.option("--beam", default=4, show_default=True, help="Beam size (1 = greedy).")
@click.option("--nbest", default=1, show_default=True,
              help="Hypotheses per sentence (written as 'i ||| text ||| score').")
@click.option("--length-penalty", default=0.6, show_default=True, help="alpha of ((5+len)/6)^alpha.")
@click.option("--length-penalty-form", default="gnmt", show_default=True, type=click.Choice(["gnmt", "plain", "none"]))
@click.option("--max-len-b", default=50, show_default=True, help="Max output length = source length + this.")
@click.option("--min-length", default=0, show_default=True)
@click.option("--batch-tokens", default=4096, show_default=True,
              help="Budget of rows x beam x source tokens per batch.")
@click.option("--threads", default=0, show_default=True,
              help="Threads (0: the framework's default). ONNX Runtime on the CPU decodes a small model's larger "
                   "batches in this many parts at the same time, one thread each.")
@click.option("--truncate", is_flag=True, help="Cut over-long lines to the model's maximum instead of failing.")
@click.option("--scores", is_flag=True, help="Append the score to each line: 'text ||| score'.")
@click.option("--model", "model_dir", type=click.Path(),
              help="Model directory for --backend torch (default: the one the artifact names).")
@click.option("--chunk-lines", default=0, show_default=True,
              help="Decode the input this many lines at a time, each part's output written as soon as it is done "
                   "(memory bounded by one part; 1 answers a pipe line by line). 0: the whole input at once.")
@cli_errors
def decode(artifact_dir, input_path, output_path, backend, device, beam, nbest, length_penalty, length_penalty_form,
           max_len_b, min_length, batch_tokens, threads, truncate, scores, model_dir, chunk_lines):
    """Translate lines with an exported artifact (or engine directory for --backend tensorrt).

    The output has one line per input line (--nbest N: N lines 'i ||| text ||| score'). A file --output
    is whole or not at all: written beside it and renamed into place at the end.
    """
    import itertools
    import warnings

    from transduce.formats.text import iter_lines
    from transduce.runtime.api import load
    from transduce.runtime.decoding import DecodingOptions

    if chunk_lines < 0:
        raise InputError(f"--chunk-lines must be >= 0, got {chunk_lines}", hint="0 decodes the whole input at once")
    if threads < 0:
        raise InputError(f"--threads must be >= 0, got {threads}", hint="0: the framework's default")
    if batch_tokens < 1:
        raise InputError(f"--batch-tokens must be >= 1, got {batch_tokens}",
                         hint="a batch holds sentences x beam x source tokens up to this budget")
    # the decoding options' errors before any input is read (a pipe may be slow to end) or the model loads
    DecodingOptions(beam_size=beam, nbest=nbest, length_penalty=length_penalty, length_penalty_form=length_penalty_form,
                    max_len_b=max_len_b, min_length=min_length)
    check_output_file(output_path)
    if chunk_lines and _written_over(input_path, output_path):
        raise InputError(f"--output {output_path!r} leads to the file the input is read from: "
                         "with --chunk-lines it would be overwritten while its later lines are still to be read",
                         hint="give another --output, or leave out --chunk-lines (the whole input is then read first)")
    lines = iter_lines(input_path, InputError)
    # the first part is read before the model loads: its input errors (all of them, without --chunk-lines) come first
    first = list(lines) if chunk_lines == 0 else list(itertools.islice(lines, chunk_lines))
    translator = load(artifact_dir, backend=backend, device=device, threads=threads, model_dir=model_dir,
                      max_batch_tokens=batch_tokens)
    part = chunk_lines or max(len(first), 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = translator.translate_stream(
            itertools.chain(first, lines), part, beam_size=beam, nbest=nbest, length_penalty=length_penalty,
            length_penalty_form=length_penalty_form, max_len_b=max_len_b, min_length=min_length, truncate=truncate)
        # the first part is decoded before the output is opened: an error in it (all of them, without
        # --chunk-lines) leaves a file, or what a link, FIFO or device --output leads to, as it was
        head = next(results, None)
        results = itertools.chain([] if head is None else [head], results)
        if output_path == "-":
            def write(text: str) -> None:
                try:
                    sys.stdout.write(text)
                    if text == "":
                        sys.stdout.flush()
                except BrokenPipeError:
                    raise  # the reader went away (| head): click exits quietly
                except OSError as e:
                    raise InputError(f"cannot write the translations to standard output: {e}",
                                     hint="free disk space, or give --output") from None

            _write_translations(results, caught, nbest, scores, part, write)
        else:  # whole or not at all: a temporary file beside it, renamed into place
            from transduce.formats.atomic import atomic_file

            def cannot_write(e: OSError) -> InputError:  # an OSError from decoding is not one of these
                return InputError(f"cannot write --output {output_path!r}: {e}",
                                  hint="free disk space or choose another --output")

            with atomic_file(output_path, error=cannot_write) as f:
                def write(text: str) -> None:
                    try:
                        f.write(text.encode("utf-8"))
                    except OSError as e:
                        raise cannot_write(e) from None

                _write_translations(results, caught, nbest, scores, part, write)


def _write_translations(results, caught: list, nbest: int, scores: bool, part: int, write) -> None:
    """Write each translation's line(s) as it comes, with the warnings recorded meanwhile (`caught`) on
    stderr, in line order (a part's warnings are recorded before its first line is written); write("")
    after every part of `part` lines and at the end: a flush."""
    pending: list = []

    def warn(line: int | None) -> None:
        """Print the recorded warnings of lines up to `line` (None: all of them)."""
        pending.extend(caught)
        caught.clear()
        later = []
        for w in pending:
            n = w.message.line if isinstance(w.message, TruncatedInput) else None
            if line is None or n is None or n <= line:
                click.secho(f"warning: {w.message}", fg="yellow", err=True)
            else:
                later.append(w)
        pending[:] = later

    for i, r in enumerate(results):
        warn(i + 1)
        if r.unknown:
            click.secho(f"warning: input line {i + 1}: {r.unknown} token(s) unknown to the tokenizer became <unk>",
                        fg="yellow", err=True)
        if nbest > 1:
            # nbest lines for every input, a blank one included (its one empty candidate, repeated)
            write("".join(f"{i} ||| {c.text} ||| {c.score:.4f}\n" for c in (r.nbest * nbest if r.empty else r.nbest)))
        else:
            write(f"{r.text} ||| {r.score:.4f}\n" if scores else f"{r.text}\n")
        if (i + 1) % part == 0:
            write("")
    warn(None)
    write("")


COMMANDS = [decode]
