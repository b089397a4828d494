"""The statistics of one cell: each system's summaries over rounds, and per-round ratios to CTranslate2."""

from __future__ import annotations

import statistics
from typing import Any

from transduce.bench.config import GPU_SYSTEMS, quantized_system
from transduce.bench.ctranslate2.settings import CT2_INT8, is_ct2


def summary(values: list[float]) -> dict[str, float] | None:
    """Median, min, max and count of `values` (None for none)."""
    if not values:
        return None
    return {"median": float(statistics.median(values)), "min": float(min(values)), "max": float(max(values)),
            "n": len(values)}


def throughput_ratios(ours: list[float], theirs: list[float]) -> dict[str, Any] | None:
    """Per-round ratios of our throughput to theirs = their seconds / our seconds, same round."""
    # a system that failed part-way has fewer rounds: the pairs are those both lasted
    pairs = [(a, b) for a, b in zip(ours, theirs, strict=False) if a and b]
    if not pairs:
        return None
    per_round = [b / a for a, b in pairs]
    return {"per_round": per_round, **summary(per_round)}


def ct2_ratios(raw: dict[str, dict[str, list]], active: list[str], key: str = "decode") -> dict[str, Any]:
    """One cell's ratios to CTranslate2 (its fastest setting there): {"ratios": {system: ...}} for our CPU
    systems (the GPU ones get none: CTranslate2 runs on the CPU here), plus "ct2_best" and, with several
    settings timed, "ct2_settings_ratio" (the fastest's throughput over each other's); {"ratios": {}}
    when no CTranslate2 setting was timed. An int8 row is held against CTranslate2's own int8 (CT2_INT8), never
    its fp32: no ratio where that was not timed. key: the per-round seconds in each system's raw (the forced
    decode's "decode"; the end-to-end cells' "seconds": a pass over their sentences)."""
    out: dict[str, Any] = {"ratios": {}}
    ct2_names = [n for n in active if is_ct2(n) and raw[n][key]]
    if not ct2_names:
        return out
    best = min(ct2_names, key=lambda n: statistics.median(raw[n][key]))
    out["ct2_best"] = best
    for n in active:
        if not is_ct2(n) and n not in GPU_SYSTEMS and n != CT2_INT8:
            vs = best
            if quantized_system(n) == "int8":
                if CT2_INT8 not in active or not raw[CT2_INT8][key]:
                    continue
                vs = CT2_INT8
            r = throughput_ratios(raw[n][key], raw[vs][key])
            if r:
                out["ratios"][n] = {"vs": vs, **r}
    if len(ct2_names) > 1:
        out["ct2_settings_ratio"] = {n: throughput_ratios(raw[best][key], raw[n][key])
                                     for n in ct2_names if n != best}
    return out


def cell_stats(raw: dict[str, Any], batch: int, steps: int) -> dict[str, Any]:
    """Summaries of one system's measurements in one cell (times in ms)."""
    dec = raw.get("decode", [])
    first = raw.get("first", [])
    out: dict[str, Any] = {}
    if dec:
        out["decode_ms"] = summary([t * 1e3 for t in dec])
        # throughput at the median decode time (with an even count of rounds the median of the per-round
        # rates is not the rate at the median time shown beside it); min and max are the rounds' own
        for key, work in (("tokens_per_s", batch * steps), ("sentences_per_s", batch)):
            out[key] = summary([work / t for t in dec])
            out[key]["median"] = float(work / statistics.median(dec))
    if first:
        out["first_ms"] = summary([t * 1e3 for t in first])
    if dec and first:
        step = (statistics.median(dec) - statistics.median(first)) / (steps - 1)
        out["step_ms_derived"] = step * 1e3
        out["encoder_ms_derived"] = (statistics.median(first) - step) * 1e3
    if raw.get("calls"):
        out["calls_per_measurement"] = summary([float(c) for c in raw["calls"]])
    if raw.get("direct_encode"):
        out["encoder_ms_direct"] = summary([t * 1e3 for t in raw["direct_encode"]])
        out["step_ms_direct"] = summary([t * 1e3 for t in raw["direct_step"]])
    return out


def e2e_stats(seconds: list[float], sentences: int) -> dict[str, Any]:
    """Summaries of one system's passes over an end-to-end cell's sentences (one pass a round): the pass in ms,
    sentences/s (the rate at the median time, as in cell_stats) and ms per sentence; {} for no pass."""
    if not seconds:
        return {}
    out = {"pass_ms": summary([t * 1e3 for t in seconds]),
           "sentences_per_s": summary([sentences / t for t in seconds]),
           "ms_per_sentence": summary([t * 1e3 / sentences for t in seconds])}
    out["sentences_per_s"]["median"] = float(sentences / statistics.median(seconds))
    return out
