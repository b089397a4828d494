"""`transduce build` (click only; the work is done by transduce.build.builder.build_engines)."""

from __future__ import annotations

import click

from transduce.cli.errors import QUIET_HELP, cli_errors, log_lines
from transduce.formats.profiles import PROFILE_MODES


@click.command("build")
@click.argument("artifact_dir", type=click.Path())
@click.option("--out", "out_dir", metavar="ENGINE_DIR", required=True, type=click.Path(),
              help="Engine directory to write.")
@click.option("--max-batch", default=16, show_default=True, type=int, help="Most sentences per batch.")
@click.option("--beam", default=4, show_default=True, type=int,
              help="Largest beam to decode with: the step engine takes max-batch x beam rows.")
@click.option("--max-src-len", default=None, type=int,
              help="Longest source in tokens, EOS included. [default: min(128, max_positions)]")
@click.option("--max-tgt-len", default=None, type=int,
              help="Longest target (cache capacity). [default: min(max-src-len + 50, max_positions)]")
@click.option("--opt-batch", default=None, type=int, help="Batch the kernels are tuned for. [default: max-batch / 2]")
@click.option("--opt-src-len", default=None, type=int, help="Source length tuned for. [default: max-src-len / 2]")
@click.option("--opt-tgt-len", default=None, type=int, help="Cache length tuned for. [default: max-tgt-len / 2]")
@click.option("--profiles", default="auto", show_default=True, type=click.Choice(PROFILE_MODES),
              help="Optimization profiles: auto (two from --max-batch 8 on: latency and throughput), single, split.")
@click.option("--workspace-gb", default=4.0, show_default=True, type=float, help="TensorRT workspace memory limit.")
@click.option("--timing-cache", type=click.Path(),
              help="Timing cache file: read if present, written back after the build.")
@click.option("--tf32", is_flag=True, help="Allow TF32 matmuls in fp32 graphs (faster on Ampere+, breaks fp32 parity).")
@click.option("--device", default="cuda", show_default=True, help="CUDA device to build on (cuda or cuda:N).")
@click.option("--force", is_flag=True, help="Replace --out if it is an existing engine directory.")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@cli_errors
def build(artifact_dir, out_dir, max_batch, beam, max_src_len, max_tgt_len, opt_batch, opt_src_len, opt_tgt_len,
          profiles, workspace_gb, timing_cache, tf32, device, force, quiet):
    """Build TensorRT engines for an exported ARTIFACT_DIR into --out ENGINE_DIR (needs TensorRT and a GPU).

    The engines accept batches up to --max-batch sentences (x --beam rows for the decoder step), sources
    up to --max-src-len tokens and targets up to --max-tgt-len; decode with `transduce decode ENGINE_DIR
    --backend tensorrt`. Engines are specific to this GPU and TensorRT version: elsewhere they are
    refused with the command that rebuilds them.
    """
    from transduce.build.builder import build_engines, summary

    log = log_lines(quiet, "build")
    meta = build_engines(artifact_dir, out_dir, max_batch=max_batch, beam=beam, max_src_len=max_src_len,
                         max_tgt_len=max_tgt_len, opt_batch=opt_batch, opt_src_len=opt_src_len,
                         opt_tgt_len=opt_tgt_len, profiles=profiles, workspace_gb=workspace_gb,
                         timing_cache=timing_cache, tf32=tf32, device=device, force=force, progress=not quiet,
                         log=log)
    click.echo(summary(out_dir, meta))


COMMANDS = [build]
