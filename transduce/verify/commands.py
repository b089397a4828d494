"""`transduce parity` (a thin wrapper over transduce.verify.parity)."""

from __future__ import annotations

import sys

import click

from transduce.cli_errors import cli_errors
from transduce.errors import InputError
from transduce.formats.paths import check_output_file
from transduce.runtime.commands import BACKEND_CHOICE


@click.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--model", "model_dir", type=click.Path(),
              help="The eager reference model (default: the one the artifact names).")
@click.option("--data", type=click.Path(),
              help="TSV of source<TAB>reference (default: the embedded demo's held-out set).")
@click.option("--input", "input_path", type=click.Path(),
              help="Plain sources, one per line (teacher-forced on the reference model's greedy output).")
@click.option("-n", "--sentences", default=200, show_default=True, help="Sentences to check.")
@click.option("--backend", default="onnxruntime", show_default=True, type=BACKEND_CHOICE)
@click.option("--device", default="cpu", show_default=True,
              help="Where the checked backend runs (tensorrt: always a GPU).")
@click.option("--reference-device", default="cpu", show_default=True, help="Where the eager reference model runs.")
@click.option("--beam", default=4, show_default=True)
@click.option("--nbest", default=1, show_default=True)
@click.option("--json", "json_path", type=click.Path(), help="Write the JSON report here.")
@cli_errors
def parity(artifact_dir, model_dir, data, input_path, sentences, backend, device, reference_device, beam, nbest,
           json_path):
    """Check an artifact (or engine) against eager PyTorch: teacher-forced errors, greedy and beam sequences.

    Exits 1 when parity fails, so it can gate CI.
    """
    from transduce.verify.parity import parity_for_artifact

    if json_path is not None:
        check_output_file(json_path, "--json", stdout=False)  # before the run, not after it
    report = parity_for_artifact(artifact_dir, model_dir=model_dir, data=data, input_path=input_path,
                                 sentences=sentences, backend=backend, device=device, beam=beam, nbest=nbest,
                                 reference_device=reference_device)
    report.print()
    if json_path is not None:
        from transduce.formats.atomic import write_json_atomic

        try:
            write_json_atomic(json_path, report.to_dict())
        except OSError as e:
            raise InputError(f"cannot write --json {json_path!r}: {e}", hint="choose another path") from None
    sys.exit(0 if report.passed else 1)


COMMANDS = [parity]
