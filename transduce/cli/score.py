"""`transduce score`: teacher-forced log-probs of given translations (a thin wrapper over Translator.score)."""

from __future__ import annotations

import click

from transduce.cli.errors import QUIET_HELP, cli_errors
from transduce.cli.options import backend_options, dataclass_options
from transduce.errors import InputError
from transduce.io.paths import check_output, write_error
from transduce.runtime.decoding.options import DecodingOptions


@click.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--input", "input_path", default=None,
              help="Pairs, one per line: source TAB target ('-' = stdin).  [default: -, unless --source is given]")
@click.option("--source", "source_path", default=None, help="Source sentences, one per line (with --target).")
@click.option("--target", "target_path", default=None, help="Their translations, one per line (with --source).")
@click.option("--out", "out_path", default="-", show_default=True,
              help="Where the scores go: a file (written whole or not at all; an existing one is replaced only with "
                   "--force) or '-', standard output.")
@click.option("--force", is_flag=True, help="Replace an existing --out file.")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@click.option("--normalized", is_flag=True,
              help="Write the length-normalised score (log-prob / length penalty, as decode --scores) instead.")
@click.option("--tokens", is_flag=True, help="Append each token's log-prob, EOS's last: 'score<TAB>lp lp ...'.")
@click.option("--truncate", is_flag=True, help="Cut over-long sources and targets to the model's maximum.")
@cli_errors
@backend_options(model_help="Model directory for --backend torch (default: the one the artifact names).")
@dataclass_options(DecodingOptions, "decoding", only=("length_penalty", "length_penalty_form", "source_lang",
                                                      "target_lang"))
def score(artifact_dir, input_path, source_path, target_path, out_path, force, quiet, normalized, tokens, truncate,
          spec, decoding):
    """Score translations: each target's log-prob given its source, one line per pair, as decode would
    score that output (the sum of its tokens' log-probs, EOS included). Typical uses: filtering a corpus,
    reranking n-best lists. Pairs come as one TSV (--input) or two aligned files (--source, --target)."""
    from transduce.io.text import read_lines
    from transduce.runtime.api import load

    sources, targets = _pairs(input_path, source_path, target_path, read_lines)
    check_output(out_path, "--out", force)
    scores = load(artifact_dir, spec).score(sources, targets, decoding, truncate=truncate)
    lines = []
    for s in scores:
        value = s.score if normalized else s.log_prob
        lines.append(f"{value:.6f}" + ("\t" + " ".join(f"{v:.6f}" for v in s.token_log_probs) if tokens else "") + "\n")
    _write("".join(lines), out_path)


def _pairs(input_path, source_path, target_path, read_lines) -> tuple[list[str], list[str]]:
    """The (sources, targets) of --input's TSV or of --source and --target, every problem an InputError."""
    if (source_path is None) != (target_path is None):
        raise InputError("--source and --target go together", hint="give both, or one TSV file with --input")
    if source_path is not None:
        if input_path is not None:
            raise InputError("give pairs as --input or as --source and --target, not both")
        sources, targets = read_lines(source_path, InputError, "--source file"), read_lines(target_path, InputError,
                                                                                            "--target file")
        if len(sources) != len(targets):
            raise InputError(f"--source has {len(sources)} lines and --target {len(targets)}",
                             hint="give one translation per source line")
        return sources, targets
    sources, targets = [], []
    for n, line in enumerate(read_lines(input_path or "-", InputError), 1):
        source, tab, target = line.partition("\t")
        if not tab or "\t" in target:
            raise InputError(f"input line {n} has {line.count(chr(9))} tabs: each line is source TAB target",
                             hint="or give the sides as two files: --source and --target")
        sources.append(source)
        targets.append(target)
    return sources, targets


def _write(text: str, out_path: str) -> None:
    import sys

    if out_path == "-":
        sys.stdout.write(text)
        return
    from transduce.io.atomic import atomic_file

    with atomic_file(out_path, error=lambda e: write_error("--out", out_path, e)) as f:
        f.write(text.encode("utf-8"))


COMMANDS = [score]
