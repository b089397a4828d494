"""`transduce demo`: the pipeline on the embedded corpus, reusing whatever earlier runs left in the workdir.

workdir/data/{train,valid}.tsv   the embedded English -> French number corpus (transduce.models.corpus)
workdir/model/                    the tiny model (trained here unless a valid one exists)
workdir/artifact/                 its ONNX export (exported here unless a valid one of this model exists)
Then: held-out sentences decoded with ONNX Runtime (greedy and beam 4) and a parity report against
eager PyTorch.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

from transduce.errors import CheckpointError, InputError, TransduceError
from transduce.training.config import TrainConfig

# Tuned so the tiny model learns the task on 2 CPU cores in about three minutes, at half the schedule's learning
# rate, which ends every seed and device near the same quality (figures: docs/benchmarks.md, the demo model).
DEMO_TRAIN = TrainConfig(
    preset="tiny", vocab_size=400, max_steps=600, warmup=300, lr_scale=0.5, max_tokens=3000,
    eval_every=300, save_every=300, eval_sentences=300, seed=1,
)
DEMO_TRAIN_PAIRS = 19_000  # drawn numbers; the 0..999 lexicon comes on top
DEMO_VALID_PAIRS = 300


def demo_data(workdir: str, log=print) -> tuple[list, list]:
    """The demo's corpus in workdir/data, generated there unless it is already (and readably) there."""
    from transduce.io.parallel import read_parallel, write_tsv
    from transduce.models.corpus import demo_corpus

    data_dir = os.path.join(workdir, "data")
    train_tsv, valid_tsv = os.path.join(data_dir, "train.tsv"), os.path.join(data_dir, "valid.tsv")
    if os.path.isfile(train_tsv) and os.path.isfile(valid_tsv):
        try:
            return read_parallel(train_tsv), read_parallel(valid_tsv)
        except TransduceError as e:  # the demo's own files, damaged: made again, as a missing one would be
            log(f"cannot reuse the demo data in {data_dir} ({e.args[0]}); generating it again")
    os.makedirs(data_dir, exist_ok=True)
    train, valid = demo_corpus(DEMO_TRAIN_PAIRS, DEMO_VALID_PAIRS)
    write_tsv(train_tsv + ".tmp", train)
    write_tsv(valid_tsv + ".tmp", valid)
    os.replace(train_tsv + ".tmp", train_tsv)
    os.replace(valid_tsv + ".tmp", valid_tsv)
    return read_parallel(train_tsv), read_parallel(valid_tsv)


def check_demo_options(workdir: str, steps: int | None, show: int, device: str = "cpu") -> None:
    """Before any work: the options make sense and the workdir can hold the data, model and artifact."""
    from transduce.io.paths import make_writable_dir
    from transduce.training.checks import training_device

    if steps is not None and steps < 1:
        raise InputError(f"--steps must be >= 1, got {steps}")
    training_device(device)  # a ConfigError saying why it cannot be used
    if show < 0:
        raise InputError(f"show must be >= 0, got {show}", params=("show",))
    make_writable_dir(workdir or ".", "--workdir", InputError)
    for name in ("data", "model", "artifact"):
        path = os.path.join(workdir, name)
        if os.path.lexists(path) and not os.path.isdir(path):
            raise InputError(f"{path} is not a directory: the demo keeps its {name} there",
                             hint=f"move {path} away, or choose another --workdir")


def ensure_demo_model(workdir: str, retrain: bool = False, steps: int | None = None, log=print,
                      device: str = "cpu", progress: bool = True) -> str:
    """Train the demo model into workdir/model (on `device`) unless a loadable one is there. Returns its path."""
    from transduce.formats.model_dir import read_config
    from transduce.models.checkpoint import load_model_dir
    from transduce.training.train import train

    model_dir = os.path.join(workdir, "model")
    if not retrain and os.path.isdir(model_dir):
        try:
            load_model_dir(model_dir)
            trained = (read_config(model_dir).get("training") or {}).get("step")
        except CheckpointError as e:
            log(f"cannot reuse {model_dir} ({e}); training again")
        else:
            if steps is not None and trained != steps:  # the user asked for another model than this one
                done = f"trained for {trained} steps" if trained is not None else "with no step count recorded"
                raise InputError(f"--steps {steps}: the demo model in {model_dir} is there already, {done}, and the "
                                 "demo reuses it",
                                 hint=f"add --retrain to train a new one for {steps} steps")
            log(f"reusing the demo model in {model_dir} (pass --retrain to train again"
                + (f"; --device {device} is where it trains)" if device != "cpu" else ")"))
            return model_dir
    train_pairs, valid_pairs = demo_data(workdir, log=log)
    cfg = DEMO_TRAIN if steps is None else replace(DEMO_TRAIN, max_steps=steps, save_every=steps,
                                                   eval_every=max(steps // 2, 1))
    cfg = replace(cfg, device=device)
    t0 = time.perf_counter()
    summary = train(train_pairs, valid_pairs, model_dir, cfg, log=log, force=True,  # the demo's own model
                    progress=progress)
    log(f"trained in {time.perf_counter() - t0:.0f}s on {device}: exact match {100 * summary['exact_match']:.1f}%, "
        f"BLEU {summary['bleu']:.1f} on {cfg.eval_sentences} held-out sentences")
    return model_dir


def show_translations(rows: list[tuple[str, str, str]], title: str, show: int, quiet: bool = False) -> dict[str, float]:
    """Print (source, reference, hypothesis) rows (not when quiet) and return exact match and BLEU over all rows."""
    import sacrebleu
    from rich.table import Table

    from transduce._console import console as make_console

    table = Table(title=title, show_lines=False)
    table.add_column("source (en)")
    table.add_column("reference (fr)")
    table.add_column("transduce (fr)")
    table.add_column("", justify="center")
    for src, ref, hyp in rows[:show]:
        table.add_row(src, ref, hyp, "[green]=[/]" if hyp == ref else "[red]x[/]")
    exact = sum(h == r for _, r, h in rows) / max(len(rows), 1)
    bleu = sacrebleu.corpus_bleu([h for _, _, h in rows], [[r for _, r, _ in rows]]).score
    if quiet:
        return {"exact_match": exact, "bleu": bleu}
    console = make_console()
    if show:
        console.print(table)
    console.print(f"{title}: exact match {100 * exact:.1f}%, BLEU {bleu:.1f} over {len(rows)} held-out sentences")
    return {"exact_match": exact, "bleu": bleu}


def ensure_demo_artifact(workdir: str, model_dir: str, log=print) -> str:
    """Export the demo model into workdir/artifact unless a valid export of these weights is there."""
    from transduce.exporter.onnx_export import export_artifact, reuse_refusal

    art = os.path.join(workdir, "artifact")
    if os.path.isdir(art):
        why = reuse_refusal(art, model_dir)
        if why is None:
            log(f"reusing the ONNX artifact in {art}")
            return art
        log(f"not reusing {art}: {why}; exporting again")
    t0 = time.perf_counter()
    manifest = export_artifact(model_dir, art, force=True, log=lambda m: log(f"[export] {m}"))
    worst = max(r["max_abs"] for r in manifest["validation"]["errors"] if r["output"] == "log_probs")
    log(f"exported {art} in {time.perf_counter() - t0:.0f}s (log-prob max abs error vs eager: {worst:.1e})")
    return art


def run_demo(workdir: str = "runs/demo", retrain: bool = False, steps: int | None = None, show: int = 12,
             parity_sentences: int = 100, device: str = "cpu", quiet: bool = False) -> dict:
    """Train (on `device`) unless a demo model is there, export, decode the held-out set with ONNX Runtime on
    the CPU, and check parity; -> {"greedy": metrics, "beam 4": metrics, "parity": passed}. quiet: print
    nothing (no lines, tables or progress bar; warnings still go where the caller sends them)."""
    from transduce.runtime.api import load
    from transduce.runtime.spec import BackendSpec
    from transduce.verify.parity import parity_for_artifact

    check_demo_options(workdir, steps, show, device)
    log = (lambda _: None) if quiet else print
    model_dir = ensure_demo_model(workdir, retrain=retrain, steps=steps, device=device, log=log, progress=not quiet)
    artifact = ensure_demo_artifact(workdir, model_dir, log=log)
    _, valid = demo_data(workdir)
    translator = load(artifact, backend="onnxruntime")
    sources = [s for s, _ in valid]
    refs = [t for _, t in valid]
    results = {}
    for beam in (1, 4):
        # an untimed call first, over the same batches: the first runs of each batch shape allocate
        # and first touch their buffers (ONNX Runtime's arena, the backend's pooled caches), which
        # made one cold call over the 300 sentences about 2-3x slower than the calls after it
        translator.translate(sources, beam_size=beam)
        t0 = time.perf_counter()
        out = translator.translate(sources, beam_size=beam)
        dt = time.perf_counter() - t0
        name = "greedy" if beam == 1 else f"beam {beam}"
        results[name] = show_translations(
            [(s, translator.tokenizer.normalize(r), o.text) for s, r, o in zip(sources, refs, out)],
            f"ONNX Runtime, {name} ({len(sources) / dt:.0f} sentences/s)", show if beam == 1 else 0, quiet=quiet,
        )
    valid_tsv = os.path.join(workdir, "data", "valid.tsv")
    report = parity_for_artifact(artifact, BackendSpec(model_dir=model_dir), data=valid_tsv, sentences=parity_sentences)
    if not quiet:
        report.print()
    results["parity"] = report.passed
    return results
