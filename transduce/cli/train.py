"""`transduce train` (click only; the work is done by transduce.training.train.train_from_files)."""

from __future__ import annotations

import json
import os
import sys

import click

from transduce.cli.errors import cli_errors, deprecated
from transduce.errors import TransduceError


def _parse_overrides(items: tuple[str, ...]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise TransduceError(f"--set expects FIELD=VALUE, got {item!r}", hint="for example --set d_model=256")
        k, v = item.split("=", 1)
        if v.strip().lower() in ("true", "false"):  # Python's spelling too: --set norm_first=True
            v = v.strip().lower()
        try:
            out[k.strip()] = json.loads(v)
        except ValueError:
            out[k.strip()] = v
    return out


@click.command()
@click.option("--data", type=click.Path(),
              help="Training corpus: TSV (source<TAB>target). Default: the embedded demo corpus.")
@click.option("--source", "src_file", type=click.Path(), help="Training sources (with --target, two aligned files).")
@click.option("--target", "tgt_file", type=click.Path(), help="Training targets, aligned with --source.")
@click.option("--valid", type=click.Path(),
              help="Held-out TSV. Default: the last --valid-size pairs of --data or --source/--target "
                   "(the embedded corpus has its own 400).")
@click.option("--valid-size", default=300, show_default=True,
              help="Held-out pairs taken from --data or --source/--target if --valid is absent "
                   "(not for the embedded corpus).")
@click.option("--out", "out_dir", required=True, type=click.Path(),
              help="Model directory to write (and to resume from).")
@click.option("--preset", default="tiny", show_default=True, type=click.Choice(["tiny", "base", "big"]),
              help="Model shape: the paper's base (6+6 layers, d_model 512) or big, or tiny (2+2, d_model 128).")
@click.option("--set", "overrides", multiple=True,
              help="Override a model config field, e.g. --set d_model=256 (repeatable).")
@click.option("--vocab-size", default=8000, show_default=True, help="BPE vocabulary to learn.")
@click.option("--max-steps", default=100_000, show_default=True,
              help="Optimizer steps (the paper's base model: 100,000 with --warmup 4000). Ctrl-C or SIGTERM saves "
                   "the last whole step; --resume continues, and may raise --max-steps.")
@click.option("--warmup", default=4000, show_default=True, help="Warmup steps of the learning-rate schedule.")
@click.option("--lr-scale", default=1.0, show_default=True, help="Constant factor of the learning-rate schedule.")
@click.option("--max-tokens", default=4096, show_default=True,
              help="Padded tokens per side of each batch: the global batch, which the ranks of a run on several "
                   "processes share (as the paper's 8 GPUs shared ~25,000).")
@click.option("--accumulate", default=1, show_default=True,
              help="Run each rank's share of a batch in this many parts, one after the other (gradient "
                   "accumulation: the same step in less memory).")
@click.option("--label-smoothing", default=0.1, show_default=True, help="epsilon_ls of the smoothed loss.")
@click.option("--clip-norm", default=0.0, show_default=True, help="Clip gradients to this global norm (0: off).")
@click.option("--eval-every", default=500, show_default=True,
              help="Steps between validations (loss, exact match, BLEU on the held-out pairs).")
@click.option("--save-every", default=1000, show_default=True, help="Steps between checkpoints (one is saved at "
              "the end, and on Ctrl-C or SIGTERM).")
@click.option("--eval-sentences", default=200, show_default=True,
              help="Held-out sentences decoded for BLEU and exact match.")
@click.option("--seed", default=1, show_default=True, help="Seed of the initial weights, dropout and batch order.")
@click.option("--threads", default=0, show_default=True, help="Torch threads (0: torch's default).")
@click.option("--device", default="cpu", show_default=True,
              help="Train on cpu, cuda or cuda:N (on several processes, cuda: each rank takes its local GPU).")
@click.option("--nproc", default=1, show_default=True,
              help="Train on this many processes of this machine (data parallel: one GPU each with --device cuda, "
                   "gloo on CPUs), started as torchrun starts them; for several machines run torchrun yourself.")
@click.option("--collective-timeout", default=1800.0, show_default=True,
              help="Seconds a rank waits for the others before the run fails (several processes).")
@click.option("--stream", is_flag=True,
              help="Read --data or --source/--target from disk a window at a time instead of whole (corpora of "
                   "millions of lines).")
@click.option("--stream-window", default=100_000, show_default=True,
              help="Pairs per window with --stream: read, sorted by length and cut into batches together.")
@click.option("--resume", is_flag=True, help="Continue the run saved in --out (model, optimizer, schedule, RNG).")
@click.option("--force", is_flag=True, help="Replace the model directory at --out (never a directory of other files).")
@click.option("--quiet", is_flag=True,
              help="No progress bar (on a terminal) or progress lines (every 30 s, elsewhere) on stderr; the "
                   "validation lines, warnings and errors still print.")
@click.option("--no-progress", is_flag=True, help="Deprecated: use --quiet (the same).")
@cli_errors
def train(data, src_file, tgt_file, valid, valid_size, out_dir, preset, overrides, vocab_size, max_steps, warmup,
          lr_scale, max_tokens, accumulate, label_smoothing, clip_norm, eval_every, save_every, eval_sentences, seed,
          threads, device, nproc, collective_timeout, stream, stream_window, resume, force, quiet, no_progress):
    """Train the reference Transformer on parallel text and write a model directory.

    Ctrl-C or SIGTERM lets the current step finish, saves a checkpoint of it and stops (exit status 130 or 143);
    a second one stops at once, without a checkpoint.

    Under torchrun, or with --nproc N, the run is data parallel: every rank takes its share of each batch, and
    rank 0 alone validates, logs and writes the checkpoints (which --resume continues exactly on as many ranks)."""
    from transduce.training.config import TrainConfig
    from transduce.training.stopping import TrainingStopped
    from transduce.training.train import train_from_files

    if no_progress:  # kept for one release
        deprecated("--no-progress", "--quiet")

    cfg = TrainConfig(preset=preset, model_overrides=_parse_overrides(overrides), vocab_size=vocab_size,
                      max_steps=max_steps, warmup=warmup, lr_scale=lr_scale, max_tokens=max_tokens,
                      accumulate=accumulate, label_smoothing=label_smoothing, clip_norm=clip_norm,
                      eval_every=eval_every, save_every=save_every, eval_sentences=eval_sentences, seed=seed,
                      threads=threads, device=device, stream=stream, stream_window=stream_window,
                      collective_timeout=collective_timeout)
    if nproc != 1:
        from transduce.training.launch import launch

        sys.exit(launch(_command_line(click.get_current_context(), drop=("nproc",)), nproc, device, threads,
                        collective_timeout, log=lambda m: click.echo(m, err=True)))
    from transduce.training.launch import watch_launcher

    watch_launcher()  # a rank of `--nproc N` ends with its launcher (where the OS does not see to it)
    try:
        summary = train_from_files(out_dir, cfg, data=data, source=src_file, target=tgt_file, valid=valid,
                                   valid_size=valid_size, resume=resume, progress=not (quiet or no_progress),
                                   force=force, log=lambda m: click.echo(m, err=True))  # stdout: the JSON alone
    except TrainingStopped as e:  # it said what it saved and where: no click "Aborted!", the signal's status
        sys.exit(128 + e.signum)
    if os.environ.get("RANK", "0") == "0":  # a run on several processes: rank 0 prints it, once
        click.echo(json.dumps(summary, indent=2))


def _command_line(ctx: click.Context, drop: tuple[str, ...]) -> list[str]:
    """The options this command was given (not their defaults), spelled again for the ranks' command lines."""
    args: list[str] = []
    for param in ctx.command.params:
        if param.name in drop or ctx.get_parameter_source(param.name) is click.core.ParameterSource.DEFAULT:
            continue
        flag, value = param.opts[0], ctx.params[param.name]
        if isinstance(param, click.Option) and param.is_flag:
            args += [flag] if value else []
        elif isinstance(param, click.Option) and param.multiple:
            for item in value:
                args += [flag, str(item)]
        else:
            args += [flag, str(value)]
    return args


COMMANDS = [train]
