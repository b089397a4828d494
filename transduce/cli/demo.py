"""`transduce demo` (click only; the work is done by transduce.demo.pipeline.run_demo)."""

from __future__ import annotations

import sys

import click

from transduce.cli.errors import cli_errors


@click.command()
@click.option("--workdir", default="runs/demo", show_default=True, type=click.Path(),
              help="Where data, model and artifacts go: a workspace, reused by the next run (not an output "
                   "that --force replaces: --retrain starts again).")
@click.option("--retrain", is_flag=True, help="Train again even if a demo model exists.")
@click.option("--steps", default=None, type=int, help="Training steps (default: the demo's).")
@click.option("--show", default=12, show_default=True, help="Held-out examples to print.")
@click.option("--device", default="cpu", show_default=True,
              help="Train on cpu, cuda or cuda:N (decoding and parity run on the CPU).")
@click.option("--quiet", is_flag=True,
              help="Print nothing but warnings and errors (the exit status says whether parity passed).")
@cli_errors
def demo(workdir, retrain, steps, show, device, quiet):
    """The whole pipeline on the embedded corpus (English -> French number words)."""
    from transduce.demo.pipeline import run_demo
    from transduce.training.stopping import TrainingStopped

    try:
        results = run_demo(workdir, retrain=retrain, steps=steps, show=show, device=device, quiet=quiet)
    except TrainingStopped as e:  # the model's training saved and said so: no click "Aborted!", the signal's status
        sys.exit(128 + e.signum)
    sys.exit(0 if results.get("parity", True) else 1)


COMMANDS = [demo]
