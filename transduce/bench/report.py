"""bench.json (everything measured), bench.md (tables), bench.png (throughput by batch size and system: plot.py)."""

from __future__ import annotations

import json
import os
from typing import Any

from transduce.bench.config import GPU_SYSTEMS, quantized_system
from transduce.bench.ctranslate2.settings import CT2_INT8, ct2_setting, is_ct2
from transduce.bench.plot import plot
from transduce.bench.report_e2e import e2e_section
from transduce.bench.report_gpu import (
    floor_row,
    gpu_ceilings_section,
    gpu_floor_rows,
    gpu_row_floor,
    graph_speedup_table,
)
from transduce.errors import TransduceError
from transduce.io.atomic import write_json_atomic, write_text_atomic


def _ms(s: dict[str, float] | None, digits: int = 1) -> str:
    if not s:
        return "–"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def _digits(ms: float) -> int:
    return 2 if ms < 10 else 1 if ms < 1000 else 0


def markdown(result: dict[str, Any]) -> str:
    """bench.md: how the run was made, the end-to-end cells, the machine's ceilings, then each size's checks and
    tables."""
    cfg = result["config"]
    lines = _intro(result)
    lines += e2e_section(result.get("e2e"))  # what users feel, before the forced cells that isolate the step
    c = result.get("ceilings")
    if c:
        lines += _ceilings_section(c)
    if result.get("gpu_ceilings"):
        lines += gpu_ceilings_section(result["gpu_ceilings"])
    for s in result["sizes"]:
        lines += _size_section(s, cfg)
    return "\n".join(lines) + "\n"


def _intro(result: dict[str, Any]) -> list[str]:
    """The machine, the versions, the threads, the work and the timing method, and warnings about the run."""
    cfg = result["config"]
    m = result["machine"]
    v = m.get("versions", {})
    lines = ["# transduce bench", ""]
    lines.append(f"{result['date']}, {result.get('seconds', '?')} s. Machine: {m.get('cpu') or '?'} "
                 f"({m.get('logical_cpus')} logical CPUs; ISA {', '.join(m.get('isa', [])) or '?'}; "
                 f"1-min load average at start {_num(m.get('load_average_1min_at_start'), '{:.2f}')}).")
    lines.append(f"Versions: {', '.join(f'{k} {x}' for k, x in v.items())}.")
    lines.append("")
    lines.append(_threads_line(result))
    lines.append(f"Work: random source ids, {cfg['src_len']} encoder positions per sentence (EOS included); exactly "
                 f"{cfg['steps']} generated tokens per sentence (EOS banned, maximum length {cfg['steps']}), so every "
                 "system does the same work. Throughput counts the best hypothesis' tokens.")
    lines.append(f"Timing: {cfg['warmup']} warm-up, then {cfg['repeats']} rounds; each round runs every system once, "
                 "in an order rotated each round, after the last one's threads went idle; one measurement is the "
                 f"median of back-to-back calls filling {cfg.get('min_seconds', 0):g} s (one call for slower cells). "
                 "Shown: median [min–max] over rounds. `step` = (decode − first) / "
                 "(steps − 1) and `enc≈` = first − step are derived alike for every system; `first` is a decode of "
                 "one step, whose step runs on one beam per sentence: in beam cells `enc≈` is the encoder less the "
                 "difference between a step at batch × beam rows and one at batch rows, so it reads low there (the "
                 "encoder timed directly is in the last table), and it can come out negative when noise exceeds the "
                 "encoder's cost. Ratios: our tokens/s ÷ the fastest CTranslate2 setting's in that cell, per round "
                 "(same round, so machine drift cancels), median [min–max].")
    loads = [c["foreign_cpu_share"] for s in result["sizes"] for c in s["cells"]
             if c.get("foreign_cpu_share") is not None]
    if loads and max(loads) > 0.25:
        lines.append("")
        lines.append(f"**Warning: other processes used up to {100 * max(loads):.0f}% of this machine's CPU time while "
                     "it was being timed (column `other CPU`). Absolute timings of this run are not representative; "
                     "ratios from the same round are less affected, not immune.**")
    if cfg.get("quick"):
        lines.append("")
        lines.append("**Quick (smoke) run: few steps and rounds; not a measurement to quote.**")
    lines.append("")
    return lines


def _threads_line(result: dict[str, Any]) -> str:
    """Each system's threads, naming the CTranslate2 settings timed that use them otherwise."""
    cfg = result["config"]
    # the settings timed: ct2_settings_run leaves out those that repeat another on this CPU (nomkl* off Intel)
    timed = {ct2_setting(n) for s in result["sizes"] for n in s.get("systems", {}) if is_ct2(n)}
    ct2 = ([s for s in cfg.get("ct2_settings", []) if s in timed]
           if "ctranslate2" in cfg.get("backends", []) and cfg["threads"] > 1 else [])
    one = [s for s in ct2 if s.endswith("1thread")]
    inter = [s for s in ct2 if s.endswith("inter")]

    def settings(names: list[str]) -> str:
        return f"{' and '.join(names)} setting{'s' if len(names) > 1 else ''}"

    one_thread = f" (1 in its {settings(one + inter)})" if one or inter else ""
    inter_text = (f"inter_threads 1 ({cfg['threads']} in its {settings(inter)}, "
                  f"a batch decoded as {cfg['threads']} sub-batches at the same time, max_batch_size = batch / "
                  f"{cfg['threads']})" if inter else "inter_threads 1")
    return (f"Threads: at most {cfg['threads']} per system (torch.set_num_threads({cfg['threads']}); ONNX Runtime "
            f"intra_op {cfg['threads']}, inter_op 1, with one thread where the work is small and a small model's "
            f"larger batches in {cfg['threads']} parts at the same time on one thread each (each size's rule "
            f"below); CTranslate2 intra_threads {cfg['threads']}{one_thread}, {inter_text}, compute_type "
            "float32). Every system runs in its own process.")


def _ceilings_section(c: dict[str, Any]) -> list[str]:
    """The ceilings measured in the run, and the best of them, which the floors use."""
    lines = ["## Machine ceilings", ""]
    lines.append("| measured | memory bandwidth GB/s (read+write) | fp32 matmul GFLOP/s |")
    lines.append("|---|---|---|")
    for i, run in enumerate(c["runs"]):
        d = run["detail"]
        bw = ", ".join(f"{k.replace('_gbs', '')} {x:.1f}" for k, x in d.items() if k.endswith("_gbs"))
        fl = ", ".join(f"{k.replace('_gflops', '')} {x:.1f}" for k, x in d.items() if k.endswith("_gflops"))
        lines.append(f"| {run.get('when', i)} | {bw} | {fl} |")
    lines.append(f"| **used for floors** | **{c['bandwidth_gbs']:.1f}** | **{c['matmul_gflops']:.1f}** |")
    lines.append("")
    lines.append("The best measurement of the run is used: other processes only ever lower them. "
                 "Floor: encoder once + each step reading every decoder weight once (and its caches) at the "
                 "bandwidth, or doing 2 × weights × rows FLOPs at the matmul rate, whichever is slower "
                 "(transduce/bench/ceilings.py). `floor%` = floor ÷ measured decode time.")
    lines.append("")
    return lines


def _cells_by_pair(cells: list[dict[str, Any]], key: str) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """A cell map {system: other system} (not_timed: the one it repeats; stand_ins: the failed one it stood in
    for), gathered over the cells: (system, other) -> the cells it holds in."""
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in cells:
        for name, other in (c.get(key) or {}).items():
            out.setdefault((name, other), []).append(c)
    return out


def _where(cells: list[dict[str, Any]]) -> str:
    """The cells as "mode batch N, ..."."""
    return ", ".join(f"{c['mode']} batch {c['batch']}" for c in cells)


def _size_section(s: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """One size: its model, the checks and gates, the systems skipped, the table of cells and its notes."""
    mc = s["model"]["config"]
    lines = [f"## {s['size']}: {s['model']['description']}", ""]
    lines.append(f"{mc['encoder_layers']}+{mc['decoder_layers']} layers, d_model {mc['d_model']}, {mc['n_heads']} "
                 f"heads, d_ff {mc['d_ff']}, vocabulary {mc['vocab_size']}.")
    for note in s["model"].get("notes", []):
        lines.append(f"Note: {note}.")
    lines.append("")
    lines += _check_lines(s.get("checks"))
    lines += _ort_threads_lines(s.get("systems", {}).get("onnxruntime", {}).get("info", {}))
    lines += _gate_lines(s.get("quality_gates", {}))
    skipped = {n: x for n, x in s["systems"].items() if x["status"] != "ok"}
    for n, x in skipped.items():
        lines.append(f"- {n} not timed: {x['reason'].splitlines()[0]}")
    if skipped:
        lines.append("")
    if not s["cells"]:
        return lines
    loads = [c["foreign_cpu_share"] for c in s["cells"] if c.get("foreign_cpu_share") is not None]
    if loads:
        lines.append(f"Other processes used {100 * min(loads):.0f}–{100 * max(loads):.0f}% of the machine's CPU time "
                     "while these cells were timed (column `other CPU`; from /proc): the higher, the less these "
                     "timings mean, and multi-threaded runs at small batches suffer most.")
        lines.append("")
    marks = _Marks()
    lines += _cells_table(s["cells"], marks)
    lines += _cell_notes(s["cells"], marks)
    lines += _ct2_settings_table(s["cells"])
    lines += graph_speedup_table(s["cells"])
    lines += _direct_table(s["cells"], cfg)
    return lines


def _check_lines(checks: list[dict[str, Any]] | None) -> list[str]:
    """The CTranslate2 token-equality checks, one line each (none: nothing)."""
    if not checks:
        return []
    lines = ["CTranslate2 token-equality check (before any timing):", ""]
    for ch in checks:
        mark = "PASS" if ch["passed"] else "FAIL"
        t = (f"- {mark} {ch['label']}: {ch['equal']}/{ch['sentences']} greedy outputs identical ({ch['mode']}); "
             f"max |log-prob diff| vs ours: {_num(ch.get('max_abs_logprob_diff'), '{:.1e}')} on our greedy path, "
             f"{_num(ch.get('max_abs_logprob_diff_random'), '{:.1e}')} on random targets")
        if ch.get("logprob_tolerance_exceeded"):
            t += f"; {ch['logprob_tolerance_exceeded']} log-probs outside the tolerance"
        if ch["divergences"]:
            d = ch["divergences"][0]
            t += (f"; first divergence: sentence {d['sentence']}, position {d['position']}: ours {d['ours']}, "
                  f"CTranslate2 {d['theirs']}")
            if d.get("margin") is not None:
                t += f" (our log-prob margin {d['margin']:.1e})"
        lines.append(t)
    lines.append("")
    return lines


def _ort_threads_lines(ort: dict[str, Any]) -> list[str]:
    """How ONNX Runtime's backend used the threads (its load info), if it says."""
    if not (ort.get("step_threads_rule") or ort.get("encoder_threads_rule")):
        return []
    measured = (ort.get("wide_steps") or {}).get("one_row_us")
    how = (f" (chosen when the backend loaded: a one-row step took {measured['narrow']:g} us on one thread, "
           f"{measured['wide']:g} us on the budget's)" if measured else "")
    parts = f"; {ort['parts_rule']}" if ort.get("parts_rule") else ""
    return [f"ONNX Runtime's threads: steps {ort.get('step_threads_rule', '?')}{how}; encoder "
            f"{ort.get('encoder_threads_rule', '?')}{parts}.", ""]


def _gate_lines(gates: dict[str, dict[str, Any]]) -> list[str]:
    """The quantized exports' quality gates, one paragraph each."""
    lines = []
    for q, g in gates.items():
        head = f"{q} quality gate" + (" (the demo size's)" if g.get("from") else "") + ": "
        if "bleu_fp32" in g:
            head += (f"BLEU {g[f'bleu_{q}']:.2f} vs fp32 {g['bleu_fp32']:.2f} on {g['sentences']} held-out demo "
                     f"sentences (beam {g['beam']}; at most {g['max_drop']} below): ")
        lines.append(head + (f"pass, timed as onnxruntime-{q}." if g["passed"] else f"FAIL, not timed: {g['reason']}."))
        lines.append("")
    return lines


class _Marks:
    """What the rows of a size's table called for below it: the footnotes (†, §, ‡) and the notes on systems
    that failed after some rounds (their figures are over those rounds only)."""

    def __init__(self) -> None:
        self.over = self.quantized = self.gpu = self.gpu_floor = False
        self.partial: list[str] = []


_TABLE_HEAD = ["| mode | batch | system | decode ms | tokens/s | sentences/s | step ms | enc≈ ms | first ms | floor% "
               "| ours ÷ CT2 | other CPU |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]


def _cells_table(cells: list[dict[str, Any]], marks: _Marks) -> list[str]:
    """Every cell's rows, one a system, and its floor's."""
    lines = list(_TABLE_HEAD)
    for c in cells:
        floor = c.get("floor", {}).get("decode_ms")
        other = f"{100 * c['foreign_cpu_share']:.0f}%" if c.get("foreign_cpu_share") is not None else "–"
        for name, x in c["systems"].items():
            lines.append(_system_row(c, name, x, floor, other, marks))
        if floor:
            fl = c["floor"]
            lines.append(floor_row(c, "floor", fl, 2, 2))
        lines += gpu_floor_rows(c)
    lines.append("")
    return lines


def _system_row(c: dict[str, Any], name: str, x: dict[str, Any], floor: float | None, other: str,
                marks: _Marks) -> str:
    """One system's row in one cell: its timings, its share of the floor and its ratio to CTranslate2."""
    st = x["stats"]
    if "decode_ms" not in st:
        err = x["raw"].get("error", "no measurement")
        return f"| {c['mode']} | {c['batch']} | {name} | failed: {str(err).splitlines()[0][:80]} ||||||||| "
    d = _digits(st["decode_ms"]["median"])
    tps = st["tokens_per_s"]
    r = c["ratios"].get(name)
    ratio = f"{r['median']:.2f} [{r['min']:.2f}–{r['max']:.2f}] vs {r['vs']}" if r else ""
    if r and quantized_system(name):  # ours quantized against CTranslate2's own int8 (stats.ct2_ratios)
        ratio += " (int8)" if r["vs"] == CT2_INT8 else " (fp32)"
    if r and c["systems"].get(r["vs"], {}).get("raw", {}).get("error"):
        ratio += "*"  # over the rounds that CTranslate2 setting lasted (its note says how many)
    shown = name
    if x["raw"].get("error"):
        shown = f"{name}*"
        marks.partial.append(f"\\* {name} ({c['mode']}, batch {c['batch']}): failed after "
                             f"{len(x['raw'].get('decode', []))} of {c.get('repeats', '?')} rounds "
                             f"({str(x['raw']['error']).splitlines()[0][:120]}); its figures are over those"
                             + ("; no ratio: the cell was timed again without it"
                                if name not in c.get("timed_again", [name]) else " and so is its ratio"))
    if name == c.get("ct2_best") and len(c.get("ct2_settings_ratio") or {}) > 0:
        ratio = "fastest CT2 setting"
    if floor and (quantized_system(name) or name == CT2_INT8):  # the floors are fp32 weights' (int8: a quarter)
        pct = "n/a‡"
        marks.quantized = True
    elif name in GPU_SYSTEMS:
        pct, ratio = "GPU§", "GPU§"
        marks.gpu = True
        gpu_floor = gpu_row_floor(c, name)  # the GPU's floor at the row's precision, never the CPU's
        if gpu_floor:
            pct = _floor_pct(gpu_floor, st["decode_ms"]["median"], marks, fine=True)
            marks.gpu_floor = True
    else:
        pct = _floor_pct(floor, st["decode_ms"]["median"], marks) if floor else "–"
    return (f"| {c['mode']} | {c['batch']} | {shown} | {_ms(st['decode_ms'], d)} | "
            f"{tps['median']:.0f} [{tps['min']:.0f}–{tps['max']:.0f}] | {st['sentences_per_s']['median']:.2f} | "
            f"{_num(st.get('step_ms_derived'), '{:.2f}')} | {_num(st.get('encoder_ms_derived'), '{:.2f}')} | "
            f"{_ms(st.get('first_ms'), 2)} | {pct} | {ratio} | {other} |")


def _floor_pct(floor: float, decode_ms: float, marks: _Marks, fine: bool = False) -> str:
    """floor ÷ measured decode time, daggered (and marked) where the measurement beat the floor; `fine`: one
    decimal below 10% (a GPU's floor is often a small share of eager decoding's time)."""
    share = 100 * floor / decode_ms
    pct = f"{share:.1f}%" if fine and share < 10 else f"{share:.0f}%"
    if floor > decode_ms:
        pct += "†"
        marks.over = True
    return pct


def _cell_notes(cells: list[dict[str, Any]], marks: _Marks) -> list[str]:
    """Below the table: systems that failed part-way, CTranslate2 settings not timed or timed in another's place,
    and the footnotes the rows called for."""
    lines = []
    for note in marks.partial:
        lines.append(note)
        lines.append("")
    for (name, other), where in _cells_by_pair(cells, "not_timed").items():
        lines.append(f"{name} is not timed at {_where(where)}: there it runs as {other} does (one sentence is one "
                     "sub-batch on one thread), and timing one configuration twice would let the faster of two "
                     "identical runs stand as CTranslate2's best.")
        failed = [c for c in where if c["systems"].get(other, {}).get("raw", {}).get("error")]
        if failed:  # the harness times a stand-in only where one of our systems is left to pair it with
            lines[-1] += (f" {other} failed at {_where(failed)}, and none of our systems was left there to time "
                          f"{name} against in its place.")
        lines.append("")
    for (name, other), where in _cells_by_pair(cells, "stand_ins").items():
        lines.append(f"{name} is timed at {_where(where)} in place of {other}, which failed there (the two run "
                     f"as one configuration in those cells); the cell was timed again for it without what had "
                     f"failed, and its ratios are over that second timing (what failed in the first gets none).")
        lines.append("")
    if marks.over:
        lines.append("† measured faster than the floor: the ceilings were under-measured (other processes were "
                     "running while they were taken), so the floors of this run are too high.")
        lines.append("")
    if marks.gpu and marks.gpu_floor:
        lines.append("§ on the GPU: CTranslate2 ran on the CPU, so no ratio to it applies; a GPU row's floor% is "
                     "against the GPU floor of its precision (*GPU floor* rows), and where it has none (TensorRT, "
                     "whose engine's precision the bench does not know) neither floor applies.")
        lines.append("")
    elif marks.gpu:
        lines.append("§ on the GPU: the floors are this CPU's, and CTranslate2 ran on the CPU, so neither applies.")
        lines.append("")
    if marks.quantized:
        lines.append("‡ the floors are for fp32 weights; a quantized export reads fewer bytes per step (int8: a "
                     "quarter of the matmul weights'), so its floor is lower and not derived here.")
        lines.append("")
    return lines


def _ct2_settings_table(cells: list[dict[str, Any]]) -> list[str]:
    """CTranslate2's settings against each other, where a cell timed several."""
    rows = []
    for c in cells:
        for other, r in (c.get("ct2_settings_ratio") or {}).items():
            if r:
                rows.append(f"| {c['mode']} | {c['batch']} | {c['ct2_best']} | {other} | "
                            f"{r['median']:.2f} [{r['min']:.2f}–{r['max']:.2f}] |")
    if not rows:
        return []
    return ["CTranslate2 settings (faster ÷ slower tokens/s, per round):", "",
            "| mode | batch | faster | slower | ratio |", "|---|---|---|---|---|", *rows, ""]


def _direct_table(cells: list[dict[str, Any]], cfg: dict[str, Any]) -> list[str]:
    """Our backends' encoder and step, timed directly."""
    rows = []
    for c in cells:
        for name, x in c["systems"].items():
            st = x["stats"]
            if "step_ms_direct" in st:
                rows.append(f"| {c['mode']} | {c['batch']} | {c['batch'] * c['beam']} | {name} | "
                            f"{_ms(st['encoder_ms_direct'], 2)} | {_ms(st['step_ms_direct'], 2)} |")
    if not rows:
        return []
    return ["Our backends measured directly (backend.encode at the batch; mean of backend.step over "
            f"{cfg['steps']} positions at batch × beam rows), median [min–max] over rounds:", "",
            "| mode | batch | rows | backend | encoder ms | step ms |", "|---|---|---|---|---|---|", *rows, ""]


def write_reports(result: dict[str, Any], out_dir: str) -> dict[str, str]:
    paths = {"json": os.path.join(out_dir, "bench.json"), "md": os.path.join(out_dir, "bench.md"),
             "png": os.path.join(out_dir, "bench.png")}
    written: list[str] = []
    try:
        os.makedirs(out_dir, exist_ok=True)
        text = markdown(result)  # before any file is written; the figures (json) first, the plot last
        write_json_atomic(paths["json"], result)
        written.append(paths["json"])
        write_text_atomic(paths["md"], text)
        written.append(paths["md"])
        plot(result, paths["png"])
        written.append(paths["png"])
    except OSError as e:
        raise TransduceError(f"cannot write the bench report into {out_dir!r}: {e}",
                             hint="free disk space or choose another --out; "
                                  + (f"written before the failure: {', '.join(written)}" if written
                                     else "none of the report files was written")) from None
    return paths


def load_result(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
