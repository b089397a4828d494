"""The benchmark: every system on identical weights and identical inputs, interleaved, in one run.

Per model size:
 1. prepare: model directory, ONNX artifact, CTranslate2 conversion (models.prepare; cached).
 2. check (gates.py): CTranslate2's greedy output must equal ours token for token (held-out sentences of the
    demo task, natural stopping; and random inputs at the benchmark's forced length). If any sentence
    differs, CTranslate2 is not timed for this size and the report says where it diverged.
 3. time, cell by cell (decoding mode x batch size; cells.py): one warm-up per system, then `repeats` rounds;
    in each round every system runs once, in an order rotated by one each round (A B C, B C A, ...), so
    drift of the machine between runs (docs/design/bench.md) hits all systems alike. Each system measures
      decode   the whole forced-length decode of the batch: src_len encoder positions (EOS included),
               exactly `steps` generated tokens per sentence (EOS banned until then, the maximum length
               `steps`: our min_length steps+1 / max_len_b steps, CTranslate2's min = max = steps);
      first    the same with one step (encoder + one step);
      direct   (our backends) backend.encode alone and `steps` calls of backend.step at batch x beam rows.
    decode and first are each the median of back-to-back calls filling `min_seconds` (one call for
    slower cells), and a system is measured only once the last one's threads are idle (cpu.settle()).
    Derived for every system alike: step = (decode - first) / (steps - 1), encoder ~ first - step.
    Throughput: target tokens / s = batch x steps / decode (beam search counts the best hypothesis
    only), sentences / s = batch / decode.
    Quantized rows (`quantize`, e.g. onnxruntime-int8): ONNX Runtime on a quantized export of the same
    weights, timed only if gates.quality_gate() passes on the demo size (BLEU within QUALITY_GATE_BLEU; the
    demo size runs first, and other sizes are quantized only after it passed).
 4. ratios (stats.py): per round, our throughput / the fastest CTranslate2 setting's (the one with the lower
    median decode time in that cell), from the same round; the median over rounds and its min and max.
 5. end to end (e2e.py; the demo size only, unless --no-e2e): the held-out sentences as text, translated with
    each system's defaults all at once and one at a time, timed and compared in the same way.

Every system lives in its own worker process (workers.py, worker.py); the machine's ceilings (ceilings.py) are
measured at the start and at the end of the run, and the GPU's (gpu_ceilings.py) at the end where a GPU system ran.
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from transduce.bench.cells import log_cell, timed_cell
from transduce.bench.config import OUR_BACKENDS, BenchConfig, beam_of, quantized_system
from transduce.bench.cpu import cpu_sample, foreign_cpu_share, machine_info
from transduce.bench.ctranslate2.settings import (
    CT2_INT8,
    CT2_SETTINGS,
    ct2_cpu,
    ct2_inter_threads,
    ct2_setting,
    ct2_settings_run,
    ct2_system_name,
    ct2_threads,
    is_ct2,
)
from transduce.bench.e2e import E2E_SIZE, e2e_plan, run_e2e
from transduce.bench.gates import divergence_text, equality_checks, quality_gate
from transduce.bench.gpu_ceilings import add_gpu_ceilings
from transduce.bench.inputs import id_limit, random_sources
from transduce.bench.workers import Worker, WorkerError
from transduce.errors import BackendUnavailable, TransduceError


def check_paths_and_lengths(cfg: BenchConfig) -> str:
    """Before any work: the output and cache directories do not overlap wrongly, a given --model-dir is a
    model, --src-len and --steps fit every size's model, and then the directories are made writable (none is
    made for options that are refused). -> the cache dir."""
    from transduce.bench import models
    from transduce.io.paths import make_writable_dir

    cache = cfg.cache_dir or os.path.join(cfg.out_dir, "models")
    real_out, real_cache = os.path.realpath(cfg.out_dir), os.path.realpath(cache)
    if real_out.startswith(real_cache + os.sep):  # CACHE/<size>/... are replaced whole when prepared again
        raise TransduceError(f"--out {cfg.out_dir!r} is inside --cache-dir {cfg.cache_dir!r}, where prepared models "
                             "and exports go", hint="choose an --out outside the cache")
    # CACHE/<size>/{model,artifact,...} are the bench's to replace: none may be a model or export of the user's
    # (--cache-dir runs would make CACHE/demo the demo's own directory)
    theirs = [p for p in (cfg.model_dir, cfg.artifact_dir, models.DEMO_MODEL_DIR) if p]
    for size in cfg.sizes:
        mine = os.path.realpath(os.path.join(cache, size))
        for p in theirs:
            real = os.path.realpath(p)
            if real == mine or real.startswith(mine + os.sep):
                raise TransduceError(f"--cache-dir {cache!r} would put the bench's {size} models in {mine}, which "
                                     f"holds {p}: the bench replaces what is in its cache",
                                     hint="choose a --cache-dir of its own (the default is OUT/models)")
    if cfg.model_dir:
        models.check_model_dir(cfg.model_dir)
    if cfg.artifact_dir:
        demo_model = models.demo_model_dir(cfg.model_dir)
        if demo_model is None:
            raise TransduceError(f"--artifact-dir {cfg.artifact_dir} needs the model it was exported from",
                                 hint="give it with --model-dir (without a trained demo model, the bench makes a "
                                      "random one)")
        models.check_artifact(cfg.artifact_dir, demo_model)
    for size in cfg.sizes:
        limit = models.max_positions(size, cfg.model_dir if size == "demo" else None)
        for value, option in ((cfg.src_len, "--src-len"), (cfg.steps, "--steps")):
            if value > limit:
                raise TransduceError(f"{option} {value} exceeds the {size} model's max_positions ({limit})",
                                     hint=f"use {option} {limit} or less")
    # made last: options refused above leave no directory behind
    make_writable_dir(cfg.out_dir, "--out")
    make_writable_dir(os.path.join(cfg.out_dir, "logs"), "--out's logs directory")
    make_writable_dir(cache, "--cache-dir")
    return cache


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole run: every size, cell by cell, and the machine's ceilings around them -> bench.json's content.

    One bench per cache directory: its lock (io.locks) is held for the whole run, since what it prepares
    there (each size's model, exports and conversion, which go together) is read until the run ends, not only
    while it is written; a second bench sharing the cache is refused at once, naming the process (two benches
    at once would skew each other's timings anyway)."""
    from transduce.io.locks import output_lock

    cache = check_paths_and_lengths(cfg)
    with output_lock(cache, "the bench's cache of prepared models (--cache-dir)"):
        return _run(cfg, cache, log)


def _run(cfg: BenchConfig, cache: str, log: Callable[[str], None]) -> dict[str, Any]:
    """run_bench's work, with the cache locked."""
    from transduce.bench import ceilings as ceil

    logs = os.path.join(cfg.out_dir, "logs")  # made writable by check_paths_and_lengths
    started = time.time()
    result: dict[str, Any] = {
        "format": "transduce-bench", "format_version": 1,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": asdict(cfg), "machine": machine_info(), "e2e": e2e_plan(cfg), "sizes": [],
    }
    ct2_missing = _missing_packages(cfg, log)
    copy_mib, matmul_n = (32, 512) if cfg.quick else (256, 1536)
    ceilings_runs: list[tuple[str, Any]] = []

    def measure_ceilings(when: str) -> None:
        if cfg.ceilings:
            log(f"[ceilings] measuring memory bandwidth and matmul rate ({when})")
            ceilings_runs.append((when, ceil.measure_ceilings(cfg.threads, copy_mib, matmul_n)))

    measure_ceilings("start")
    # workers: one per system, started together (imports overlap), loaded per size
    workers: dict[str, Worker] = {}
    gates: dict[str, dict[str, Any]] = {}  # quantization -> the demo size's quality gate (see quality_gate)
    try:
        for n in _system_names(cfg, ct2_missing):
            env = CT2_SETTINGS[ct2_setting(n)].env() if is_ct2(n) else {}
            workers[n] = Worker(n, env, os.path.join(logs, f"worker-{n}.log"))
        for i, size in enumerate(cfg.sizes):
            result["sizes"].append(_run_size(size, cfg, cache, workers, ct2_missing, log, gates, result["e2e"]))
            if i + 1 < len(cfg.sizes):
                measure_ceilings(f"after {size}")
    finally:
        for w in workers.values():
            w.close()
    if not any(s["cells"] for s in result["sizes"]):
        reasons = sorted({f"{name}: {info['reason']}" for s in result["sizes"] for name, info in s["systems"].items()
                          if info.get("status") == "skipped"})
        raise TransduceError("nothing was timed: every system was skipped"
                             + (" (" + "; ".join(reasons) + ")" if reasons else ""),
                             hint="see the reasons above; `transduce bench --help` lists the systems")
    measure_ceilings("end")
    if cfg.ceilings:
        _add_floors(result, cfg, ceilings_runs)
        # the GPU's own, once its systems' workers are gone (nothing else on the GPU); only where one ran
        add_gpu_ceilings(result, cfg.src_len, cfg.steps, cfg.quick, log)
    result["seconds"] = round(time.time() - started, 1)
    return result


def _missing_packages(cfg: BenchConfig, log) -> str | None:
    """Refuses a run without matplotlib; -> why CTranslate2 is skipped where it was asked for and is not
    installed (None: it is, or it was not asked for)."""
    try:  # the plot is one of the three reports: without it the run would be lost at its very end
        import matplotlib  # noqa: F401
    except ImportError:
        raise TransduceError("matplotlib is not installed: the bench draws its plot (bench.png) with it",
                             hint="pip install 'transduce[bench]'") from None
    if "ctranslate2" not in cfg.backends:
        return None
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        ct2_missing = "ctranslate2 is not installed (pip install 'transduce[bench]')"
        log(f"[bench] {ct2_missing}: CTranslate2 is skipped")
        return ct2_missing
    return None


def _system_names(cfg: BenchConfig, ct2_missing: str | None) -> list[str]:
    """The run's systems, one worker each: ours, the quantized rows, TensorRT, CTranslate2's settings."""
    names = [b for b in cfg.backends if b in OUR_BACKENDS and b != "tensorrt"]  # tensorrt: once, with engines
    names += [f"onnxruntime-{q}" for q in cfg.quantize]
    if "tensorrt" in cfg.backends or cfg.engines:
        names.append("tensorrt")
    if "ctranslate2" in cfg.backends and not ct2_missing:
        names += [ct2_system_name(s) for s in ct2_settings_run(cfg.ct2_settings, cfg.threads)]
        if "int8" in cfg.quantize:
            names.append(CT2_INT8)
    return names


def _add_floors(result: dict[str, Any], cfg: BenchConfig, ceilings_runs: list[tuple[str, Any]]) -> None:
    """The run's ceilings into `result`, and each cell's floor under the best of them."""
    from transduce.bench import ceilings as ceil

    # the best of the run's measurements: contention only ever lowers them
    result["ceilings"] = {"runs": [{"when": when, **c.to_dict()} for when, c in ceilings_runs],
                          "bandwidth_gbs": max(c.bandwidth_gbs for _, c in ceilings_runs),
                          "matmul_gflops": max(c.matmul_gflops for _, c in ceilings_runs),
                          "threads": cfg.threads}
    best = ceil.Ceilings(result["ceilings"]["bandwidth_gbs"], result["ceilings"]["matmul_gflops"], cfg.threads, {})
    for s in result["sizes"]:
        for c in s.get("cells", []):
            c["floor"] = ceil.decode_floor(s["model"]["config"], best, c["batch"], c["beam"], cfg.src_len, cfg.steps)
            c["floor"]["decode_ms"] = c["floor"]["seconds"] * 1e3


def _run_size(size: str, cfg: BenchConfig, cache: str, workers: dict[str, Worker], ct2_missing: str | None,
              log, gates: dict[str, dict[str, Any]], e2e: dict[str, Any]) -> dict[str, Any]:
    """One model size; `gates` holds the quantized exports' quality gates, set by the demo size; `e2e` (e2e_plan's)
    gets the end-to-end cells, on the demo size."""
    from transduce.bench.models import prepare

    log(f"[{size}] preparing the model, its ONNX export and its CTranslate2 conversion")
    model_dir = cfg.model_dir if size == "demo" else None
    want_ct2 = any(is_ct2(n) for n in workers)
    prepared = prepare(size, cache, model_dir=model_dir, with_ct2=want_ct2,
                       artifact_dir=cfg.artifact_dir if size == "demo" else None, log=lambda m: log(f"[{size}] {m}"),
                       # the other sizes' quantized exports only once the demo size's gate passed
                       quantize=[q for q in cfg.quantize if size == "demo" or gates.get(q, {}).get("passed")])
    entry: dict[str, Any] = {
        "size": size,
        "model": {"description": prepared.description, "trained": prepared.trained, "config": prepared.config.to_dict(),
                  "model_dir": prepared.model_dir, "artifact_dir": prepared.artifact_dir,
                  "ct2_dir": prepared.ct2_dir, "notes": prepared.notes},
        "systems": {}, "checks": [], "cells": [], "quality_gates": {},
    }
    cpu = ct2_cpu()  # what the CTranslate2 settings amount to here, read once for the size's cells
    if size == "demo":
        for q in cfg.quantize:
            gates[q] = entry["quality_gates"][q] = quality_gate(prepared, q, cfg, log)
    if ct2_missing:
        for s in ct2_settings_run(cfg.ct2_settings, cfg.threads, *cpu):
            entry["systems"][ct2_system_name(s)] = {"status": "skipped", "reason": ct2_missing}
    ct2_skip = _ct2_skip(size, prepared, cfg, entry, log) if want_ct2 else None
    active = _load_systems(size, prepared, cfg, workers, gates, entry, ct2_skip, log)
    if not active:
        log(f"[{size}] nothing to time: every system was skipped")
        return entry
    _time_cells(size, prepared, cfg, workers, active, cpu, entry, log)
    if size == E2E_SIZE and e2e["run"]:
        run_e2e(prepared, cfg, workers, active, cpu, e2e, log)
    return entry


def _ct2_skip(size: str, prepared, cfg: BenchConfig, entry: dict[str, Any], log) -> str | None:
    """Why CTranslate2 is not timed for this size (None: it is): its conversion failed, it refused to load it,
    or its greedy output differs from ours (the checks go into entry["checks"])."""
    if prepared.ct2_error:
        return prepared.ct2_error
    skip = None
    log(f"[{size}] checking CTranslate2's greedy output against ours, token for token")
    try:
        entry["checks"] = equality_checks(prepared, cfg, log)
    except BackendUnavailable as e:  # CTranslate2 refusing its conversion (load_translator): time the others
        entry["checks"], skip = [], e.args[0]
        log(f"[{size}] CTranslate2 is NOT timed: {skip}")
    bad = [c for c in entry["checks"] if not c["passed"]]
    if bad:
        skip = "greedy output differs from ours: " + "; ".join(divergence_text(c) for c in bad)
        log(f"[{size}] CTranslate2 is NOT timed: {skip}")
    return skip


def _load_systems(size: str, prepared, cfg: BenchConfig, workers: dict[str, Worker], gates: dict[str, dict[str, Any]],
                  entry: dict[str, Any], ct2_skip: str | None, log) -> list[str]:
    """Each worker loads its system for this size, or is skipped with the reason (entry["systems"]); ct2_skip:
    why CTranslate2 is not timed (None: it is) -> the systems loaded."""
    active = []
    for name, w in workers.items():
        if (is_ct2(name) or name == CT2_INT8) and ct2_skip is not None:
            entry["systems"][name] = {"status": "skipped", "reason": ct2_skip}
            continue
        req, reason = _load_request(name, size, prepared, cfg, gates, entry)
        if req is None:
            entry["systems"][name] = {"status": "skipped", "reason": reason}
            continue
        try:
            info = w.call(req)
            entry["systems"][name] = {"status": "ok", "info": info.get("info", {}), "env": w.env_changes}
            active.append(name)
        except WorkerError as e:
            entry["systems"][name] = {"status": "skipped", "reason": str(e)}
            log(f"[{size}] {name} is skipped: {e}")
    return active


def _load_request(name: str, size: str, prepared, cfg: BenchConfig, gates: dict[str, dict[str, Any]],
                  entry: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The load request of system `name` for this size -> (request, None), or (None, why it is skipped). A
    quantized row on a size after the demo records the demo size's gate in entry["quality_gates"]."""
    if is_ct2(name):
        return {"op": "load", "system": "ctranslate2", "path": prepared.ct2_dir, "model_dir": prepared.model_dir,
                "threads": ct2_threads(ct2_setting(name), cfg.threads),
                "inter_threads": ct2_inter_threads(ct2_setting(name), cfg.threads)}, None
    if name == CT2_INT8:  # its default setting, with CTranslate2's int8 weights and GEMMs
        return {"op": "load", "system": "ctranslate2", "path": prepared.ct2_dir, "model_dir": prepared.model_dir,
                "threads": cfg.threads, "inter_threads": 1, "compute_type": "int8"}, None
    q = quantized_system(name)
    if q:
        gate = gates.get(q)
        if gate is None or not gate["passed"]:
            return None, gate["reason"] if gate else "its quality gate (BLEU on the demo data) did not run"
        if q in prepared.quantize_errors:
            return None, f"its export failed: {prepared.quantize_errors[q]}"
        if size != "demo":
            entry["quality_gates"][q] = {**gate, "from": "demo"}
        return {"op": "load", "system": "onnxruntime", "path": prepared.quantized_dirs[q],
                "model_dir": prepared.model_dir, "threads": cfg.threads}, None
    if name == "tensorrt":
        if size not in cfg.engines:
            return None, f"no TensorRT engine given for {size} (--engine {size}=DIR)"
        return {"op": "load", "system": "tensorrt", "path": cfg.engines[size], "model_dir": prepared.model_dir,
                "threads": cfg.threads}, None
    return {"op": "load", "system": name, "path": prepared.artifact_dir, "model_dir": prepared.model_dir,
            "threads": cfg.threads}, None


def _time_cells(size: str, prepared, cfg: BenchConfig, workers: dict[str, Worker], active: list[str],
                cpu: tuple[bool, bool], entry: dict[str, Any], log) -> None:
    """Every cell (mode x batch) of this size into entry["cells"], each with the CPU time other processes took
    while it was timed."""
    rng = np.random.default_rng(cfg.seed)
    for mode in cfg.modes:
        beam = beam_of(mode)
        for batch in cfg.batches:
            src = random_sources(rng, batch, cfg.src_len, id_limit(prepared.config))
            # live workers only: a dead one's pid cannot be read, which would void every later cell's sample
            pids = [os.getpid()] + [w.proc.pid for w in workers.values() if w.proc.poll() is None]
            before = cpu_sample(pids)
            head = f"[{size}] {mode} batch {batch}: "
            cell = {"mode": mode, "beam": beam,
                    **timed_cell(workers, active, src, beam, cfg, cpu, functools.partial(_prefixed, log, head))}
            cell["foreign_cpu_share"] = foreign_cpu_share(before, cpu_sample(pids))
            entry["cells"].append(cell)
            log_cell(cell, size, log)


def _prefixed(log, head: str, message: str) -> None:
    log(head + message)
