"""`transduce demo` (click only; the work is done by transduce.demo.pipeline.run_demo)."""

from __future__ import annotations

import sys

import click

from transduce.cli_errors import cli_errors


@click.command()
@click.option("--workdir", default="runs/demo", show_default=True, type=click.Path(),
              help="Where data, model and artifacts go.")
@click.option("--retrain", is_flag=True, help="Train again even if a demo model exists.")
@click.option("--steps", default=None, type=int, help="Training steps (default: the demo's).")
@click.option("--show", default=12, show_default=True, help="Held-out examples to print.")
@click.option("--device", default="cpu", show_default=True,
              help="Train on cpu, cuda or cuda:N (decoding and parity run on the CPU).")
@cli_errors
def demo(workdir, retrain, steps, show, device):
    """The whole pipeline on the embedded corpus (English -> French number words)."""
    from transduce.demo.pipeline import run_demo

    results = run_demo(workdir, retrain=retrain, steps=steps, show=show, device=device)
    sys.exit(0 if results.get("parity", True) else 1)


COMMANDS = [demo]
