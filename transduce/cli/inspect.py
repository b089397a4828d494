"""`transduce attention` and `transduce inspect`: option parsing only; the work is in the library modules."""

from __future__ import annotations

import json
import os
import re
import sys

import click

from transduce.cli.errors import QUIET_HELP, cli_errors
from transduce.errors import InputError, TransduceError

MIN_DPI, MAX_DPI = 20, 1200  # a heatmap grid at 30,000 dpi ran out of memory

# CLI spelling -> the key of the model's attention dict (transduce.inspect.attention.ATTENTION_KINDS)
TOKEN_ATTENTION = {"encoder": "encoder", "decoder-self": "decoder_self", "cross": "cross"}
# the figures attention writes: KIND_layerN.png (heatmaps) and token_KIND_layerN_posM.png (the line figure)
FIGURE_NAME = re.compile(r"_layer[0-9]+(_pos[0-9]+)?\.png$")


def _check_figures(out_dir: str, force: bool) -> None:
    """An earlier run's figures in --out are replaced only with --force (other files there are left alone)."""
    try:
        found = sorted(n for n in os.listdir(out_dir)
                       if FIGURE_NAME.search(n) and os.path.isfile(os.path.join(out_dir, n)))
    except OSError:  # absent (made when written) or not a directory: writing says so
        return
    if found and not force:
        raise InputError(f"--out {out_dir!r} already holds attention figures ({found[0]}"
                         f"{f' and {len(found) - 1} more' if len(found) > 1 else ''})",
                         hint="pass --force to replace them, or choose another --out")


@click.command("attention")
@click.argument("model_dir", type=click.Path())
@click.argument("source")
@click.option("--target", default=None,
              help="Teacher-force the model on this target instead of decoding greedily.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory for the PNG files (created if needed; earlier figures there are replaced only with "
                   "--force).")
@click.option("--token", default=None,
              help="Query token of the line figure: a 0-based index or a token as labelled. Default: the first.")
@click.option("--token-attention", type=click.Choice(list(TOKEN_ATTENTION)), default="encoder", show_default=True,
              help="Attention of the line figure: encoder self-attention of a source token, or decoder "
                   "self-attention / encoder-decoder attention of a decoder position (named by the token it predicts).")
@click.option("--layer", type=int, default=None, help="Layer of the line figure, counted from 1. Default: the last.")
@click.option("--dpi", default=110, show_default=True, help="Resolution of the PNG files.")
@click.option("--force", is_flag=True, help="Replace the figures of an earlier run in --out.")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@cli_errors
def attention(model_dir, source, target, out_dir, token, token_attention, layer, dpi, force, quiet):
    """Draw the attention of the eager model on SOURCE: every layer's heads as heatmaps (encoder
    self-attention, decoder self-attention, encoder-decoder attention) and one query token's attention
    as lines, one colour per head, as in the paper's Figure 3."""
    from transduce.inspect.attention import sentence_attention, write_attention_figures
    from transduce.models.checkpoint import load_model_dir

    if layer is not None and layer < 1:
        raise InputError(f"--layer counts from 1, got {layer}")
    if not MIN_DPI <= dpi <= MAX_DPI:
        raise InputError(f"--dpi must be between {MIN_DPI} and {MAX_DPI}, got {dpi}",
                         hint="a figure is a few inches wide: 1200 dpi is already print quality")
    _check_figures(out_dir, force)
    try:  # before the model loads: the figures are the command's whole output
        import matplotlib  # noqa: F401
    except ImportError:
        raise TransduceError("matplotlib is not installed: transduce attention draws its figures with it",
                             hint="pip install matplotlib (or pip install 'transduce[dev]')") from None
    model, tokenizer, _ = load_model_dir(model_dir)
    maps = sentence_attention(model, tokenizer, source, target)
    paths = write_attention_figures(maps, out_dir, token=token, token_kind=TOKEN_ATTENTION[token_attention],
                                    token_layer=-1 if layer is None else layer - 1, dpi=dpi)
    click.echo(f"source: {' '.join(maps.source_labels)}")
    click.echo(f"{'target (given)' if maps.teacher_forced else 'greedy'}: {maps.target_text}")
    for path in paths:
        click.echo(f"wrote {path}")


@click.command("inspect")
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (for scripts).")
@click.option("--verify/--no-verify", default=None,
              help="Compare each file's sha256 with the recorded one (reads every byte), or not. "
                   "Default: when the recorded files total at most 1 GiB.")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@cli_errors
def inspect(path, as_json, verify, quiet):
    """Show what a model directory, an exported artifact or an engine directory holds: config, parameters
    by component, tokenizer size, graph inputs/outputs, opsets, op histograms, files and build figures.

    Artifacts and engine directories go through the checks the runtime makes before it loads them (the same
    code); for an engine directory, all but whether this machine has its TensorRT version and GPU.

    Exit status 0 for a sound directory; 1 when the report lists problems (e.g. a missing or truncated
    file, a changed one when the sha256 sums are compared, an unreadable graph or header) or the runtime
    would refuse the directory; 2 for a path that is none of the three or whose description file cannot be
    read. Without the sha256 sums compared (--no-verify, or over 1 GiB without --verify) a changed file
    passes, and the report says the sums were not compared."""
    from transduce.inspect import inspect_path, render_report

    report = inspect_path(path, verify=verify)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        render_report(report)
    if report.get("problems") or not runtime_accepts(report):
        sys.exit(1)


def runtime_accepts(report: dict) -> bool:
    """False when the report's runtime check says the runtime would refuse the directory (not when it says
    the directory could not be checked, "not checked (why)", or passed without its sha256 sums compared)."""
    from transduce.inspect.report import RUNTIME_OK_UNHASHED

    check = report.get("runtime_check", "ok")
    return check in ("ok", RUNTIME_OK_UNHASHED) or check.startswith("not checked")


COMMANDS = [attention, inspect]
