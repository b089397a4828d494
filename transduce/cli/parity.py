"""`transduce parity` (a thin wrapper over transduce.verify.parity)."""

from __future__ import annotations

import sys

import click

from transduce.cli.errors import QUIET_HELP, cli_errors, renamed
from transduce.cli.options import backend_options, dataclass_options, renamed_option
from transduce.io.paths import check_output, write_error
from transduce.runtime.decoding.options import DecodingOptions


@click.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--data", type=click.Path(),
              help="TSV of source<TAB>reference (default: the embedded demo's held-out set).")
@click.option("--input", "input_path", type=click.Path(),
              help="Plain sources, one per line (teacher-forced on the reference model's greedy output).")
@click.option("-n", "--sentences", default=200, show_default=True, help="Sentences to check.")
@click.option("--reference-device", default="cpu", show_default=True, help="Where the eager reference model runs.")
@renamed_option("--beam-size", "--beam", "beam_size", default=None, type=int,
                help="Beam size of the beam-search check (greedy search is always checked).  [default: 4]")
@click.option("--nbest", default=1, show_default=True,
              help="Hypotheses per sentence the beam-search check compares, best first.")
@click.option("--out", "out_path", metavar="FILE", type=click.Path(),
              help="Also write the report here, as JSON (an existing file is replaced only with --force).")
@click.option("--json", "old_json", type=click.Path(), hidden=True, help="Deprecated spelling of --out.")
@click.option("--force", is_flag=True, help="Replace an existing --out file.")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@cli_errors
@backend_options(model_help="The eager reference model (default: the one the artifact names).")
@dataclass_options(DecodingOptions, "langs", only=("source_lang", "target_lang"))
def parity(artifact_dir, data, input_path, sentences, reference_device, beam_size, deprecated_beam_size, nbest,
           out_path, old_json, force, quiet, spec, langs):
    """Check an artifact (or engine) against eager PyTorch: teacher-forced errors, greedy and beam sequences.

    The report goes to stdout (and, as JSON, to --out). Exits 1 when parity fails, so it can gate CI.
    """
    from transduce.verify.parity import parity_for_artifact

    beam_size = renamed(beam_size, deprecated_beam_size, "--beam-size", "--beam")
    out_path = renamed(out_path, old_json, "--out", "--json")
    if out_path is not None:
        check_output(out_path, "--out", force, stdout=False)  # before the run, not after it
    report = parity_for_artifact(artifact_dir, spec, data=data, input_path=input_path, sentences=sentences,
                                 beam_size=4 if beam_size is None else beam_size, nbest=nbest,
                                 reference_device=reference_device, source_lang=langs.source_lang,
                                 target_lang=langs.target_lang)
    report.print()
    if out_path is not None:
        from transduce.io.atomic import write_json_atomic

        try:
            write_json_atomic(out_path, report.to_dict())
        except OSError as e:
            raise write_error("--out", out_path, e) from None
    sys.exit(0 if report.passed else 1)


COMMANDS = [parity]
