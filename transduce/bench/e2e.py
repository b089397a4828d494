"""The end-to-end cells: the demo task's held-out sentences as text, translated by every system with its own
defaults, as a user would call it.

The forced cells (cells.py) time exactly --steps tokens per sentence, which isolates the decoder step. These time
what a user gets: natural stopping (EOS ends a sentence, at most source tokens + 50), each system's defaults
otherwise (ours: DecodingOptions, length penalty gnmt 0.6; CTranslate2: translate_batch's, length penalty 1), and
tokenisation and detokenisation inside the timed call (the worker's translate op, worker.py). Per search mode of the
run (--modes), two shapes, each one timing:
  all  the whole list in one call (ours: Translator.translate, batched by its token budget; CTranslate2:
       translate_batch, max_batch_size 0, its inter settings in --threads parts): sentences/s
  one  a loop of one-sentence calls: ms per sentence
A timing is interleaved and rotated round by round as the forced cells are (cells.interleaved). In a beam mode ours
run twice a round: under our default stopping rule (heuristic) and under CTranslate2's (k-finished, patience 1:
the matched rules); CTranslate2 runs once a round under its own, and both rows' ratios (stats.ct2_ratios, per round,
to its fastest setting) are to those same measurements. Each row also gives the backend.step calls of one pass
(ours; one at a time each call is one sentence's), the outputs identical to CTranslate2's default setting's (text
equality, same shape) and their BLEU against the references.

Only the demo size gets these cells: the other sizes' weights are random (RANDOM_WEIGHTS).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from transduce.bench.cells import interleaved
from transduce.bench.config import BenchConfig, beam_of
from transduce.bench.cpu import cpu_sample, foreign_cpu_share, settle
from transduce.bench.ctranslate2.settings import CT2_INT8, ct2_cell_repeats, ct2_system_name, is_ct2
from transduce.bench.stats import ct2_ratios, e2e_stats
from transduce.bench.workers import Worker, WorkerError
from transduce.errors import TransduceError

E2E_SIZE = "demo"
SHAPES = {"all": "all at once", "one": "one at a time"}
MATCHED_RULE = "k-finished"  # CTranslate2's rule (beam_size x patience finished hypotheses, patience 1), by our name
CT2_RULE = "k-finished, patience 1 (its own rule)"
RANDOM_WEIGHTS = ("its weights are random, so a sentence never stops before its maximum length (source tokens + 50) "
                  "and BLEU against references means nothing")


@dataclass(frozen=True)
class Entry:
    """What one interleaved measurement runs: a system under a stopping rule (None: the system's own default)."""
    system: str
    rule: str | None = None

    @property
    def key(self) -> str:
        return self.system if self.rule is None else f"{self.system} ({self.rule})"

    @property
    def ours(self) -> bool:
        return not is_ct2(self.system) and self.system != CT2_INT8


def our_default_rule() -> str:
    from transduce.runtime.decoding import DecodingOptions

    return DecodingOptions().early_stopping


def e2e_plan(cfg: BenchConfig) -> dict[str, Any]:
    """bench.json's "e2e" before any timing: whether the run has end-to-end cells (else why not), and the sizes
    that get none and why; run_e2e adds the cells."""
    plan: dict[str, Any] = {"size": E2E_SIZE, "run": False, "cells": [],
                            "sizes_without": {s: RANDOM_WEIGHTS for s in cfg.sizes if s != E2E_SIZE}}
    if not cfg.e2e:
        plan["why_not"] = "turned off (--no-e2e)"
    elif E2E_SIZE not in cfg.sizes:
        plan["why_not"] = f"they run on the {E2E_SIZE} size only, which is not among --sizes"
    else:
        plan["run"] = True
    return plan


def run_e2e(prepared, cfg: BenchConfig, workers: dict[str, Worker], active: list[str], cpu: tuple[bool, bool],
            e2e: dict[str, Any], log) -> None:
    """Every end-to-end cell of the demo size into e2e["cells"] (e2e: e2e_plan's); a failure to read the held-out
    sentences is recorded in e2e["error"], not raised: the forced cells are measured already."""
    import sacrebleu

    from transduce.bench.gates import check_languages, held_out_pairs

    try:
        pairs = held_out_pairs(prepared, cfg.e2e_sentences)
    except (TransduceError, OSError) as e:
        e2e["error"] = f"the held-out sentences could not be read: {e}"
        log(f"[{E2E_SIZE}] no end-to-end cells: {e2e['error']}")
        return
    texts, refs = [s for s, _ in pairs], [r for _, r in pairs]
    try:
        langs = check_languages(prepared.model_dir)
    except (TransduceError, OSError):  # no tokenizer to read here: the workers load theirs (and say what fails)
        langs = None
    if langs is not None:  # every system given the codes as its users give them (worker.py, the translate op)
        e2e["languages"] = {"source": langs.source, "target": langs.target}
        log(f"[{E2E_SIZE}] a multilingual model: {langs.source} -> {langs.target}")
    valid_tsv = os.path.join(os.path.dirname(prepared.model_dir), "data", "valid.tsv")
    e2e.update(sentences=len(texts), trained=prepared.trained, our_default_rule=our_default_rule(),
               source=valid_tsv if os.path.isfile(valid_tsv) else "the demo corpus's held-out sentences (generated)")
    reference = ct2_system_name("default") if ct2_system_name("default") in active else next(
        (n for n in active if is_ct2(n)), None)
    for mode in cfg.modes:
        beam = beam_of(mode)
        for shape in SHAPES:
            cells = _timed_shape(mode, beam, shape, texts, workers, active, cfg, cpu, log,
                                 None if langs is None else asdict(langs))
            for cell in cells:
                _judge(cell, refs, reference, sacrebleu)
                _log_cell(cell, log)
            e2e["cells"] += cells


def _entries(active: list[str], beam: int) -> list[Entry]:
    """Each system under its own rule; ours also under CTranslate2's in a beam mode (greedy search has no rule)."""
    out = [Entry(n) for n in active]
    if beam > 1:
        out += [Entry(n, MATCHED_RULE) for n in active if Entry(n).ours]
    return out


def _timed_shape(mode: str, beam: int, shape: str, texts: list[str], workers: dict[str, Worker], active: list[str],
                 cfg: BenchConfig, cpu: tuple[bool, bool], log, languages: dict | None = None) -> list[dict[str, Any]]:
    """One timing of a mode and shape -> its cells: the default rules' and, in a beam mode, the matched rules'.
    languages: a multilingual model's codes (gates.Languages as a dict), for every system."""
    one = shape == "one"
    # a CTranslate2 setting that repeats another here is not timed (one sentence a call: inter is 1thread)
    repeats = ct2_cell_repeats(active, cfg.threads, 1 if one else len(texts), *cpu)
    entries = [e for e in _entries(active, beam) if e.system not in repeats]
    head = f"[{E2E_SIZE}] end to end, {mode} {SHAPES[shape]}: "
    log(head + f"{', '.join(e.key for e in entries)} x {cfg.repeats} rounds, {len(texts)} sentences")
    raw: dict[str, dict[str, Any]] = {e.key: {"seconds": [], "order": [], "calls": [], "steps": None,
                                              "outputs": None, "outputs_varied": False} for e in entries}
    by_key = {e.key: e for e in entries}
    failed: dict[str, str] = {}

    def measure(key: str, record: bool, position: int) -> None:
        e, w = by_key[key], workers[by_key[key].system]
        try:
            reply = w.call({"op": "translate", "texts": texts, "beam": beam, "early_stopping": e.rule,
                            "one_at_a_time": one, "min_seconds": cfg.min_seconds, "languages": languages})
            settle(w.proc.pid)
        except WorkerError as err:
            failed[key] = str(err)
            log(head + f"{key} failed: {err}")
            return
        r = raw[key]
        if r["outputs"] is not None and reply["outputs"] != r["outputs"]:
            r["outputs_varied"] = True  # the identical counts and BLEU are the last pass's
        r["outputs"], r["steps"] = reply["outputs"], reply.get("steps")
        if record:
            r["seconds"].append(reply["seconds"])
            r["order"].append(position)
            r["calls"].append(reply.get("calls", 1))

    pids = [os.getpid()] + [w.proc.pid for w in workers.values() if w.proc.poll() is None]
    before = cpu_sample(pids)
    interleaved(list(by_key), cfg, measure, failed)
    share = foreign_cpu_share(before, cpu_sample(pids))
    for key, msg in failed.items():
        raw[key]["error"] = msg
    rows = ["default"] + (["matched"] if beam > 1 else [])
    return [_cell(mode, beam, shape, row, len(texts), entries, raw, repeats, share, cfg) for row in rows]


def _cell(mode: str, beam: int, shape: str, row: str, sentences: int, entries: list[Entry],
          raw: dict[str, dict[str, Any]], repeats: dict[str, str], share: float | None,
          cfg: BenchConfig) -> dict[str, Any]:
    """One row set of a timing: ours under the row's rule beside every CTranslate2 setting, and the ratios."""
    rule = None if row == "default" else MATCHED_RULE
    mine = [e for e in entries if not e.ours or e.rule == rule]
    runs = {e.system: raw[e.key] for e in mine}
    cell: dict[str, Any] = {"mode": mode, "beam": beam, "shape": shape, "rules": row, "sentences": sentences,
                            "repeats": cfg.repeats,
                            "early_stopping": {"ours": rule or our_default_rule(), "ctranslate2": CT2_RULE},
                            "foreign_cpu_share": share, "systems": {}}
    if beam == 1:
        cell["early_stopping"] = {}  # greedy search has no stopping rule beyond EOS
    if repeats:
        cell["not_timed"] = repeats
    for e in mine:
        r = runs[e.system]
        cell["systems"][e.system] = {"stats": e2e_stats(r["seconds"], sentences), "raw": r}
    cell.update(ct2_ratios(runs, list(runs), key="seconds"))
    return cell


def _judge(cell: dict[str, Any], refs: list[str], reference: str | None, sacrebleu) -> None:
    """Each system's outputs against the references (BLEU) and CTranslate2's default setting's (identical), then
    the outputs are dropped from the cell (bench.json keeps the counts only)."""
    theirs = cell["systems"].get(reference, {}).get("raw", {}).get("outputs") if reference else None
    if theirs is not None:
        cell["identical_to"] = reference
    for x in cell["systems"].values():
        out = x["raw"].get("outputs")
        if out is None:
            continue
        x["bleu"] = float(sacrebleu.corpus_bleu(out, [refs]).score)
        if theirs is not None:
            x["identical"] = sum(a == b for a, b in zip(out, theirs, strict=True))
        if x["raw"].get("steps") is not None:
            x["steps_per_pass"] = x["raw"]["steps"]
    for x in cell["systems"].values():
        x["raw"] = {k: v for k, v in x["raw"].items() if k not in ("outputs", "steps")}


def _log_cell(cell: dict[str, Any], log) -> None:
    """One line per cell: each system's rate, its ratio to CTranslate2, BLEU and identical outputs."""
    parts = []
    for name, x in cell["systems"].items():
        if cell["rules"] == "matched" and not Entry(name).ours:
            continue  # the default rows' measurements, logged with them
        st = x["stats"]
        if not st:
            parts.append(f"{name} failed")
            continue
        rate = (f"{st['sentences_per_s']['median']:.0f} sent/s" if cell["shape"] == "all"
                else f"{st['ms_per_sentence']['median']:.2f} ms/sent")
        r = cell["ratios"].get(name)
        parts.append(f"{name} {rate}" + (f" ({r['median']:.2f}x {r['vs']})" if r else "")
                     + (f" BLEU {x['bleu']:.1f}" if "bleu" in x else "")
                     + (f" = {x['identical']}/{cell['sentences']}" if "identical" in x else ""))
    rules = f", {cell['rules']} rules" if cell["beam"] > 1 else ""
    log(f"[{E2E_SIZE}] end to end, {cell['mode']} {SHAPES[cell['shape']]}{rules}: " + ", ".join(parts))
