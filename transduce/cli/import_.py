"""The importer's subcommand (click only; the work is done by transduce.importers)."""

from __future__ import annotations

import click

from transduce.cli.errors import QUIET_HELP, cli_errors
from transduce.importers import FAMILIES


@click.command("import")
@click.argument("family", type=click.Choice(FAMILIES))
@click.argument("src", type=click.Path())
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Model directory to write.")
@click.option("--force", is_flag=True, help="Replace --out if it is an existing model directory.")
@click.option("--revision", default=None,
              help="With a Hub name as SRC: the branch, tag or commit to import (default: main).")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@cli_errors()
def import_(family, src, out_dir, force, revision, quiet):
    """Import the pretrained FAMILY model in SRC into the model directory --out, as transduce train writes one:
    then export, build, decode, parity, bench, inspect and attention work on it unchanged. SRC: a Hugging Face
    MarianMTModel, FSMTForConditionalGeneration, M2M100ForConditionalGeneration (m2m100, nllb) or mBART-50's
    MBartForConditionalGeneration (mbart) directory, or a fairseq transformer's directory (checkpoint, dict.SRC.txt,
    dict.TGT.txt, bpecodes or a SentencePiece model); or a Hugging Face Hub name (org/name), taken from the Hugging
    Face cache (HF_HUB_CACHE, HF_HOME; HF_HUB_OFFLINE=1: only the cache) or downloaded into it, only the files the
    family needs; see docs/importing.md. Tensors are checked by name and shape, pickles read without running code,
    and nothing is written unless everything imports."""
    from transduce.importers import import_model
    from transduce.models.checkpoint import load_model_dir

    out = import_model(family, src, out_dir, force=force, revision=revision)
    if not quiet:
        model, _, _ = load_model_dir(out)
        dev = model.cfg.deviations()
        click.echo(f"imported {family} {src} -> {out}: {model.num_parameters():,} parameters, vocabulary "
                   f"{model.cfg.vocab_size}" + (f"; deviations from the paper: {dev}" if dev else ""))


COMMANDS = [import_]
