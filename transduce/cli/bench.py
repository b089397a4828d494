"""`transduce bench` (click only; the work is done by transduce.bench.harness and transduce.bench.report)."""

from __future__ import annotations

import json
import os

import click

from transduce.bench.ctranslate2.settings import DEFAULT_CT2_SETTINGS
from transduce.cli.errors import QUIET_HELP, cli_errors
from transduce.errors import InputError, TransduceError
from transduce.exporter.quantize import METHODS as QUANTIZE_METHODS


def _csv(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [x.strip() for x in value.split(",") if x.strip()]


def _ints(value: str | None) -> list[int] | None:
    items = _csv(value)
    if items is None:
        return None
    try:
        return [int(x) for x in items]
    except ValueError:
        raise TransduceError(f"--batches takes comma-separated integers, got {value!r}") from None


def _engines(items: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise TransduceError(f"--engine expects SIZE=DIR, got {item!r}",
                                 hint="for example --engine demo=runs/demo/engine")
        size, path = item.split("=", 1)
        out[size.strip()] = path.strip()
    return out


REPORT_FILES = ("bench.json", "bench.md", "bench.png")  # what transduce.bench.report.write_reports writes


def _check_reports(out_dir: str, force: bool) -> None:
    """An earlier run's report in --out is replaced only with --force (checked before the run, not after)."""
    found = [name for name in REPORT_FILES if os.path.isfile(os.path.join(out_dir, name))]
    if found and not force:
        raise TransduceError(f"--out {out_dir!r} already holds a bench report ({', '.join(found)})",
                             hint="pass --force to replace it, or choose another --out")


@click.command("bench")
@click.option("--model-dir", type=click.Path(), help="The demo-size model (default runs/demo/model; if absent, a "
              "random model of the demo's shape).")
@click.option("--artifact-dir", type=click.Path(),
              help="An existing ONNX export of --model-dir (else exported once into the cache).")
@click.option("--sizes", help="Model sizes: demo, base, opus-mt (an OPUS-MT-shaped Marian, imported; needs the "
              "import extra).  "
              "[default: demo,base; --quick: demo]")
@click.option("--backends", help="Systems: torch, onnxruntime, ctranslate2; on a GPU torch-cuda (eager PyTorch), "
              "torch-cuda-graph (its step in CUDA graphs), each also at -fp16 or -bf16 (torch-cuda-graph-fp16 ...), "
              "and tensorrt (with --engine); the GPU ones are skipped with the reason where CUDA is missing.  "
              "[default: torch,onnxruntime,ctranslate2]")
@click.option("--batches", help="Batch sizes.  [default: 1,16; --quick: 1,4]")
@click.option("--modes", help="greedy and/or beamN.  [default: greedy,beam4; --quick: greedy,beam2]")
@click.option("--repeats", type=int, help="Timed rounds per cell after the warm-up.  [default: 5; --quick: 2]")
@click.option("--warmup", type=int, help="Warm-up rounds per cell.  [default: 1]")
@click.option("--min-seconds", type=float, help="One measurement: the median of back-to-back calls filling this "
              "long (one call for slower cells).  [default: 0.2; --quick: 0]")
@click.option("--steps", type=int, help="Generated tokens per sentence, forced.  [default: 32; --quick: 6]")
@click.option("--src-len", type=int, help="Encoder positions per sentence, EOS included.  [default: 32; --quick: 8]")
@click.option("--threads", default=2, show_default=True, help="Threads of every system.")
@click.option("--ct2-settings", help="CTranslate2 environments to time, each in its own process: default, avx2 "
              "(ONEDNN_MAX_CPU_ISA=AVX2), mkl (CT2_USE_MKL=1), nomkl (CT2_USE_MKL=0), 1thread (intra_threads 1), "
              "nomkl-1thread, inter (a batch in --threads sub-batches at once, one thread each), nomkl-inter; one that "
              "amounts to another on this CPU is timed once (CTranslate2 uses MKL by default on Intel CPUs only; avx2 "
              "caps nothing on a CPU without AVX-512, AVX-VNNI or AMX).  "
              f"[default: {','.join(DEFAULT_CT2_SETTINGS)}]")
@click.option("--engine", "engines", multiple=True, help="SIZE=DIR: a TensorRT engine directory of that size's model "
              "(timed when CUDA is available). Repeatable.")
@click.option("--quantize", "quantize", multiple=True, type=click.Choice(QUANTIZE_METHODS),
              help="Also time ONNX Runtime on an export quantized this way (transduce export --quantize), if its "
                   "BLEU on the demo data is within 0.5 of fp32's. Repeatable.")
@click.option("--check-sentences", type=int, help="Held-out demo sentences in the CTranslate2 equality check and "
              "the --quantize BLEU gate.  [default: 100]")
@click.option("--e2e-sentences", type=int, help="Held-out demo sentences in the end-to-end cells (text in, text out, "
              "each system's defaults; all of them where there are fewer).  [default: 300; --quick: 8]")
@click.option("--no-e2e", is_flag=True, help="Skip the end-to-end cells (the demo size's held-out sentences "
              "translated all at once and one at a time).")
@click.option("--no-ceilings", is_flag=True, help="Skip measuring memory bandwidth and matmul rate, the CPU's and "
              "the GPU's (no floors).")
@click.option("--cache-dir", type=click.Path(),
              help="Where prepared models, exports and conversions go.  [default: OUT/models]")
@click.option("--out", "out_dir", default="runs/bench", show_default=True, type=click.Path(),
              help="Writes bench.json, bench.md and bench.png here (an earlier report is replaced only with --force).")
@click.option("--force", is_flag=True, help="Replace the report already in --out.")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@click.option("--quick", is_flag=True, help="A fast smoke run (demo size, 6 steps, 2 rounds): checks the "
              "instrument, not a measurement.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random source sentences every cell decodes.")
@cli_errors
def bench(model_dir, artifact_dir, sizes, backends, batches, modes, repeats, warmup, min_seconds, steps, src_len,
          threads, ct2_settings, engines, quantize, check_sentences, e2e_sentences, no_e2e, no_ceilings, cache_dir,
          out_dir, force, quiet, quick, seed):
    """Benchmark our backends against CTranslate2 on identical weights: encoder and per-step latency,
    tokens/s and sentences/s at each batch size, greedy and beam search, with the machine's ceilings; and end to
    end, the demo task's held-out sentences translated with each system's defaults, all at once and one at a time.

    CTranslate2 is timed only after its greedy output matched ours token for token.
    """
    from transduce.bench.config import BenchConfig
    from transduce.bench.harness import run_bench
    from transduce.bench.report import markdown, write_reports

    if no_e2e and e2e_sentences is not None:
        raise InputError("--e2e-sentences sizes the end-to-end cells, which --no-e2e leaves out",
                         hint="give one of the two")
    options = dict(sizes=_csv(sizes), backends=_csv(backends), batches=_ints(batches), modes=_csv(modes),
                   repeats=repeats, warmup=warmup, min_seconds=min_seconds, steps=steps, src_len=src_len,
                   threads=threads, ct2_settings=_csv(ct2_settings), check_sentences=check_sentences,
                   model_dir=model_dir, artifact_dir=artifact_dir, cache_dir=cache_dir, out_dir=out_dir,
                   engines=_engines(engines), e2e=not no_e2e, e2e_sentences=e2e_sentences,
                   ceilings=not no_ceilings, seed=seed, quantize=list(quantize) or None)
    given = {k: v for k, v in options.items() if v is not None}
    cfg = BenchConfig.quick_preset(**given) if quick else BenchConfig(**given)
    _check_reports(cfg.out_dir, force)
    result = run_bench(cfg, log=(lambda msg: None) if quiet else (lambda msg: click.echo(msg, err=True)))
    try:
        paths = write_reports(result, cfg.out_dir)
    except TransduceError:
        # the run's measurements are not lost with the files: the table on stdout, the whole result on stderr
        click.echo(markdown(result))
        click.echo("the bench's result, as bench.json would have held it:\n" + json.dumps(result, indent=1), err=True)
        raise
    click.echo(f"wrote {paths['json']}, {paths['md']}, {paths['png']}")


COMMANDS = [bench]
