"""bench.md's "End to end" section (the end-to-end cells, e2e.py): one row a system and stopping rule, the two
shapes side by side, then what the rows mean and the sizes that have none."""

from __future__ import annotations

from typing import Any

from transduce.bench.config import GPU_SYSTEMS
from transduce.bench.ctranslate2.settings import CT2_INT8, is_ct2

_HEAD = ["| search | stopping | system | sentences/s, all at once | ours ÷ CT2 | ms/sentence, one at a time "
         "| ours ÷ CT2 | steps/sentence, one at a time | step calls a pass, all at once | = CT2 outputs | BLEU |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]


def e2e_section(e2e: dict[str, Any] | None) -> list[str]:
    """The section (an earlier bench.json without end-to-end cells: nothing)."""
    if e2e is None:
        return []
    lines = ["## End to end", ""]
    if not e2e.get("run"):
        lines += [f"No end-to-end cells: {e2e.get('why_not', 'not run')}.", ""]
    elif e2e.get("error"):
        lines += [f"No end-to-end cells: {e2e['error']}.", ""]
    elif e2e.get("cells"):
        lines += _intro(e2e)
        lines += _table(e2e["cells"])
        lines += _notes(e2e)
    for size, why in e2e.get("sizes_without", {}).items():
        lines += [f"The {size} size gets no end-to-end cells: {why}.", ""]
    return lines


def _intro(e2e: dict[str, Any]) -> list[str]:
    n = e2e["sentences"]
    lines = [f"The {e2e['size']} model on its first {n} held-out sentences ({e2e.get('source', '?')}), as text, "
             "translated with each system's defaults, as a user calls it: natural stopping (EOS, at most source "
             "tokens + 50), tokenisation and detokenisation inside the timed call; ours `Translator.translate` "
             "(length penalty gnmt 0.6, batches of at most 4,096 tokens), CTranslate2 `translate_batch` with our "
             "tokenizer (length penalty 1, max_batch_size 0, its inter settings in parts; the tokens our search never "
             "proposes suppressed, as in the forced cells). *All at once*: the whole list in one call; *one at a "
             "time*: a loop of one-sentence calls. Each shape is timed as the forced cells are (warm-up, then rounds "
             "in a rotated order, one pass a measurement, or the median of passes filling --min-seconds); the rates "
             "are at the median pass."]
    lines.append("")
    lines.append(f"Stopping: greedy search stops at EOS. In beam search ours use their default "
                 f"(`{e2e.get('our_default_rule', 'heuristic')}`) in the first rows, and CTranslate2's rule "
                 "(`k-finished`: stop once beam size × patience 1 hypotheses have finished) in the *matched* rows; "
                 "CTranslate2 always uses its own, timed once a round, and both rows' ratios are to those same "
                 "measurements. `ours ÷ CT2`: the fastest CTranslate2 setting's time for a pass ÷ ours, per round "
                 "(above 1: ours is faster), median [min–max]. Steps: our backend.step calls in one pass (one at a "
                 "time, each is one sentence's; all at once, each is a batch's, every part's counted where a batch is "
                 "decoded in parts). `= CT2 outputs`: translations identical (as text) to CTranslate2's default "
                 "setting's in the same shape. BLEU: sacrebleu's corpus BLEU against the references.")
    lines.append("")
    if not e2e.get("trained", True):
        lines += ["**The demo model is untrained (random weights): its sentences run to their maximum length and BLEU "
                  "means nothing; run `transduce demo` first for figures that do.**", ""]
    return lines


def _table(cells: list[dict[str, Any]]) -> list[str]:
    """A row for each (mode, rules, system): its all-at-once and one-at-a-time figures side by side."""
    groups: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["mode"], c["rules"]), {})[c["shape"]] = c
    lines = list(_HEAD)
    for (mode, rules), shapes in groups.items():
        names: list[str] = []
        for c in shapes.values():
            names += [n for n in list(c["systems"]) + list(c.get("not_timed", {})) if n not in names]
        for name in names:
            theirs = is_ct2(name) or name == CT2_INT8
            if rules == "matched" and theirs:
                continue  # the same measurements as in the default rows above
            lines.append(_row(mode, rules, name, theirs, shapes))
    lines.append("")
    return lines


def _row(mode: str, rules: str, name: str, theirs: bool, shapes: dict[str, dict[str, Any]]) -> str:
    some = next(iter(shapes.values()))
    if some["beam"] == 1:
        stopping = "EOS"
    elif theirs:
        stopping = "k-finished (its own)"
    else:
        stopping = some["early_stopping"]["ours"] + (" (matched)" if rules == "matched" else " (default)")
    a, o = shapes.get("all"), shapes.get("one")
    rate_all, ratio_all = _figures(a, name, "sentences_per_s", "{:.0f}")
    rate_one, ratio_one = _figures(o, name, "ms_per_sentence", "{:.2f}")
    steps_one = _steps(o, name, per_sentence=True)
    steps_all = _steps(a, name, per_sentence=False)
    same = _by_shape(a, o, name, lambda c, x: f"{x['identical']}/{c['sentences']}" if "identical" in x else None)
    if name == (a or o or {}).get("identical_to"):
        same = "reference"
    bleu = _by_shape(a, o, name, lambda c, x: f"{x['bleu']:.2f}" if "bleu" in x else None)
    varied = any(c and c["systems"].get(name, {}).get("raw", {}).get("outputs_varied") for c in (a, o))
    return (f"| {mode} | {stopping} | {name}{'~' if varied else ''} | {rate_all} | {ratio_all} | {rate_one} | "
            f"{ratio_one} | {steps_one} | {steps_all} | {same} | {bleu} |")


def _figures(cell: dict[str, Any] | None, name: str, key: str, fmt: str) -> tuple[str, str]:
    """(the rate at the median pass, the ratio to CTranslate2) of a system in a cell, as shown."""
    if cell is None:
        return "–", "–"
    if name in cell.get("not_timed", {}):
        return f"= {cell['not_timed'][name]}", "not timed"
    x = cell["systems"].get(name)
    if x is None:
        return "–", "–"
    if not x["stats"]:
        return f"failed: {str(x['raw'].get('error', 'no measurement')).splitlines()[0][:60]}", "–"
    rate = fmt.format(x["stats"][key]["median"])
    r = cell["ratios"].get(name)
    if r:
        ratio = f"{r['median']:.2f} [{r['min']:.2f}–{r['max']:.2f}]"
        if r["vs"] == CT2_INT8:
            ratio += " vs int8"
    elif name == cell.get("ct2_best"):
        ratio = "fastest CT2" if cell.get("ct2_settings_ratio") else "CT2"
    elif name in GPU_SYSTEMS:
        ratio = "GPU (none)"
    else:
        ratio = "–"
    if x["raw"].get("error"):
        rate += f" (failed after {len(x['raw']['seconds'])} rounds)"
    return rate, ratio


def _steps(cell: dict[str, Any] | None, name: str, per_sentence: bool) -> str:
    x = (cell or {}).get("systems", {}).get(name, {})
    if "steps_per_pass" not in x:
        return "–"
    return f"{x['steps_per_pass'] / cell['sentences']:.1f}" if per_sentence else f"{x['steps_per_pass']}"


def _by_shape(a: dict[str, Any] | None, o: dict[str, Any] | None, name: str, show) -> str:
    """A figure of both shapes: once where they agree, "all / one" where they differ."""
    got = [show(c, c["systems"][name]) if c and name in c["systems"] else None for c in (a, o)]
    if got[0] == got[1] or got[1] is None:
        return got[0] or "–"
    if got[0] is None:
        return got[1]
    return f"{got[0]} / {got[1]} one at a time"


def _notes(e2e: dict[str, Any]) -> list[str]:
    lines = []
    cells = e2e["cells"]
    if any(x["raw"].get("outputs_varied") for c in cells for x in c["systems"].values()):
        lines += ["~ its outputs differed between passes: the identical counts and BLEU are its last pass's.", ""]
    not_timed = sorted({(n, r) for c in cells for n, r in c.get("not_timed", {}).items()})
    for name, other in not_timed:
        lines += [f"{name} is not timed where it runs as {other} does (one at a time, one sentence is one sub-batch "
                  "on one thread): timing one configuration twice would let the faster of two identical runs stand "
                  "as CTranslate2's best.", ""]
    loads = [c["foreign_cpu_share"] for c in cells if c.get("foreign_cpu_share") is not None]
    if loads and max(loads) > 0.25:
        lines += [f"Other processes used up to {100 * max(loads):.0f}% of the machine's CPU time while these were "
                  "timed: the absolute figures are not representative.", ""]
    return lines
