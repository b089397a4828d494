"""One cell of the benchmark (a decoding mode at a batch size): its interleaved rounds, the CTranslate2 settings
that repeat another there, and its statistics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from transduce.bench.config import GPU_SYSTEMS, BenchConfig
from transduce.bench.cpu import settle
from transduce.bench.ctranslate2.settings import CT2_INT8, ct2_cell_repeats, is_ct2
from transduce.bench.stats import cell_stats, ct2_ratios
from transduce.bench.workers import Worker, WorkerError


def timed_cell(workers: dict[str, Worker], active: list[str], src: list[list[int]], beam: int, cfg: BenchConfig,
               cpu: tuple[bool, bool], log) -> dict[str, Any]:
    """One cell's measurements, stats and ratios. A CTranslate2 setting that repeats another in this cell
    (ct2_cell_repeats) is not timed, unless the one it repeats fails there: then the whole cell is timed
    again with it standing in and without what failed, and the ratios are over that second timing, whose
    rounds pair with each other."""
    batch = len(src)
    repeats = ct2_cell_repeats(active, cfg.threads, batch, *cpu)
    timed = [n for n in active if n not in repeats]
    log(f"{', '.join(timed)} x {cfg.repeats} rounds")
    if repeats:
        log("not timed, repeating another here: " + ", ".join(f"{n} (= {r})" for n, r in repeats.items()))
    raw = _time_cell(workers, timed, src, beam, cfg, log)
    paired = timed  # the systems whose rounds the ratios pair: those of one timing
    stand_ins = {n: r for n, r in repeats.items() if "error" in raw[r]}
    # timed again: the stand-ins and the CPU systems that did not fail (the GPU ones get no ratios)
    again = [n for n in active if n not in GPU_SYSTEMS and (n in stand_ins or (n in timed and "error" not in raw[n]))]
    if stand_ins and any(not is_ct2(n) and n != CT2_INT8 for n in again):
        log("timed again, " + ", ".join(f"{n} in place of {r}, which failed" for n, r in stand_ins.items()))
        raw.update(_time_cell(workers, again, src, beam, cfg, log))
        paired = again  # what failed in the first timing has no rounds paired with the second's
        timed = [n for n in active if n in timed or n in stand_ins]
    else:
        stand_ins = {}  # nothing of ours left to pair with a stand-in
    cell: dict[str, Any] = {"batch": batch, "src_len": cfg.src_len, "steps": cfg.steps, "repeats": cfg.repeats,
                            "systems": {}, "ratios": {}}
    not_timed = {n: r for n, r in repeats.items() if n not in stand_ins}
    if not_timed:
        cell["not_timed"] = not_timed  # {system: the system it repeats in this cell}
    if stand_ins:
        cell["stand_ins"] = stand_ins  # {system: the failed system it was timed in place of}
        cell["timed_again"] = paired  # the systems of the second timing, over which the ratios are
    for name in timed:
        cell["systems"][name] = {"stats": cell_stats(raw[name], batch, cfg.steps), "raw": raw[name]}
    cell.update(ct2_ratios(raw, paired))
    return cell


def _time_cell(workers: dict[str, Worker], names: list[str], src: list[list[int]], beam: int, cfg: BenchConfig,
               log) -> dict[str, dict[str, list]]:
    """Warm-up, then cfg.repeats rounds, each system once a round in an order rotated by one each round; a
    system that fails keeps the rounds it completed and is left out of the rest (raw[name]["error"])."""
    raw: dict[str, dict[str, list]] = {n: {"decode": [], "first": [], "direct_encode": [], "direct_step": [],
                                           "order": [], "calls": []} for n in names}
    failed: dict[str, str] = {}

    def measure(name: str, record: bool, position: int) -> None:
        w = workers[name]
        try:
            d = w.call({"op": "decode", "src": src, "beam": beam, "steps": cfg.steps, "min_seconds": cfg.min_seconds})
            settle(w.proc.pid)
            f = w.call({"op": "decode", "src": src, "beam": beam, "steps": 1, "min_seconds": cfg.min_seconds})
            settle(w.proc.pid)
            direct = None
            if not is_ct2(name) and name != CT2_INT8:  # CTranslate2 has no direct step timing
                direct = w.call({"op": "direct", "src": src, "beam": beam, "steps": cfg.steps})
                settle(w.proc.pid)
        except WorkerError as e:
            failed[name] = str(e)
            log(f"{name} failed: {e}")
            return
        if record:
            raw[name]["decode"].append(d["seconds"])
            raw[name]["first"].append(f["seconds"])
            raw[name]["order"].append(position)
            raw[name]["calls"].append(d.get("calls", 1))  # decode calls behind each decode median
            if direct is not None:
                raw[name]["direct_encode"].append(direct["encode_seconds"])
                raw[name]["direct_step"].append(float(np.mean(direct["step_seconds"])))

    interleaved(names, cfg, measure, failed)
    for n, msg in failed.items():
        raw[n]["error"] = msg  # type: ignore[assignment]
    return raw


def interleaved(names: list[str], cfg: BenchConfig, measure: Callable[[str, bool, int], None],
                failed: dict[str, str]) -> None:
    """cfg.warmup rounds, then cfg.repeats recorded ones: each round calls measure(name, record, position) once for
    every name not in `failed` (which measure fills), in an order rotated by one each round (A B C, B C A, ...)."""
    for _ in range(cfg.warmup):
        for i, n in enumerate(names):
            if n not in failed:
                measure(n, False, i)
    for r in range(cfg.repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for i, n in enumerate(order):
            if n not in failed:
                measure(n, True, i)


def log_cell(cell: dict[str, Any], size: str, log) -> None:
    """One line per cell: each system's tokens/s, the ratios, and what other processes took meanwhile."""
    parts = []
    for name, s in cell["systems"].items():
        tps = s["stats"].get("tokens_per_s")
        if tps:
            parts.append(f"{name} {tps['median']:.0f} tok/s")
    for name, r in cell["ratios"].items():
        parts.append(f"{name}/{r['vs']} {r['median']:.2f}x")
    if cell.get("foreign_cpu_share") is not None:
        parts.append(f"other processes used {100 * cell['foreign_cpu_share']:.0f}% of the CPUs meanwhile")
    log(f"[{size}] {cell['mode']} batch {cell['batch']}: " + ", ".join(parts))
