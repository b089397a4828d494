"""bench.md's GPU parts: the GPU's ceilings, each cell's GPU floors, and CUDA graphs against eager CUDA."""

from __future__ import annotations

import dataclasses
from typing import Any

from transduce.bench.config import TORCH_COMPILE_SYSTEMS, TORCH_CUDA_SYSTEMS, compiled_system, system_spec


def gpu_ceilings_section(g: dict[str, Any]) -> list[str]:
    """The GPU's ceilings measured in the run (or why they could not be), which the GPU floors use."""
    lines = ["## GPU ceilings", ""]
    if "error" in g:
        return lines + [f"Not measured: {g['error']}. The GPU rows get no floor.", ""]
    d = g.get("detail", {})
    lines.append("| GPU | memory bandwidth GB/s (read+write) | " +
                 " | ".join(f"{p} matmul GFLOP/s" for p in g["matmul_gflops"]) + " |")
    lines.append("|---" * (2 + len(g["matmul_gflops"])) + "|")
    lines.append(f"| {g['device']} | {g['bandwidth_gbs']:.0f} | " +
                 " | ".join(f"{x:.0f}" for x in g["matmul_gflops"].values()) + " |")
    lines.append("")
    lines.append(f"Measured once the run's timings were done: the best of {d.get('repeats', '?')} device-to-device "
                 f"copies of {d.get('copy_mib', '?')} MiB (bytes read + written) and of square matmuls of n = "
                 f"{d.get('matmul_n', '?')} per dtype (2 n³ FLOPs; fp32 with TF32 disabled), timed with CUDA events. "
                 "GPU floor at a precision: the same accounting as the CPU's, with weights and caches at that "
                 "precision's bytes per element (fp32 4, fp16/bf16 2) against this bandwidth and that dtype's "
                 "matmul rate (transduce/bench/gpu_ceilings.py). A torch-cuda row's `floor%` is against the GPU "
                 "floor of its precision (rows *GPU floor*), never the CPU's.")
    lines.append("")
    return lines


def precision_of(name: str) -> str | None:
    """The precision of a torch-cuda system ("torch-cuda-graph-fp16" -> "fp16"); None for any other system."""
    torch_cuda = name in TORCH_CUDA_SYSTEMS or name in TORCH_COMPILE_SYSTEMS
    return (system_spec(name).precision or "fp32") if torch_cuda else None


def gpu_row_floor(c: dict[str, Any], name: str) -> float | None:
    """The GPU floor (ms) a GPU row is held against: its precision's, where it was derived (else None)."""
    p = precision_of(name)
    floor = (c.get("gpu_floors") or {}).get(p) if p else None
    return floor["decode_ms"] if floor else None


def floor_row(c: dict[str, Any], label: str, fl: dict[str, Any], decode_digits: int, step_digits: int) -> str:
    """One floor's row in a cell's table (the CPU's, or the GPU's at one precision, finer: it is a few µs)."""
    return (f"| {c['mode']} | {c['batch']} | *{label}* | {fl['decode_ms']:.{decode_digits}f} | "
            f"{c['batch'] * c['steps'] / fl['seconds']:.0f} | | {fl['step_seconds'] * 1e3:.{step_digits}f} "
            f"({fl['step_bound']}) | {fl['encoder_seconds'] * 1e3:.{step_digits}f} | | | | |")


def gpu_floor_rows(c: dict[str, Any]) -> list[str]:
    """A cell's GPU floors as table rows, one per precision."""
    return [floor_row(c, f"GPU floor {p}", fl, 3, 4) for p, fl in (c.get("gpu_floors") or {}).items()]


def _step_ms(x: dict[str, Any]) -> float | None:
    """A system's step time in a cell: the derived one ((decode - first) / (steps - 1)), as every row shows it."""
    step = x.get("stats", {}).get("step_ms_derived")
    return step if step and step > 0 else None


def graph_speedup_table(cells: list[dict[str, Any]]) -> list[str]:
    """Each torch-cuda-graph (and torch.compile) row's step against the eager torch-cuda row of its precision in the
    same cell, and against its GPU floor's step, where both ran."""
    rows = []
    for c in cells:
        for name, x in c["systems"].items():
            compiled = compiled_system(name) is not None
            spec = system_spec(name) if name in TORCH_CUDA_SYSTEMS or compiled else None
            if spec is None or not (spec.cuda_graph or compiled):
                continue
            eager = dataclasses.replace(spec, cuda_graph=False).name
            graph_ms, eager_ms = _step_ms(x), _step_ms(c["systems"].get(eager, {}))
            if graph_ms is None or eager_ms is None:
                continue
            floor = (c.get("gpu_floors") or {}).get(spec.precision or "fp32")
            over = f"{graph_ms / (floor['step_seconds'] * 1e3):.1f}×" if floor else "–"
            rows.append(f"| {c['mode']} | {c['batch']} | {name} | {eager_ms:.3f} | {graph_ms:.3f} | "
                        f"{eager_ms / graph_ms:.1f}× | {over} |")
    if not rows:
        return []
    return ["CUDA graphs against eager CUDA at the same precision (step ms as derived in the table above; "
            "speedup = eager step ÷ graph step; the last column: graph step ÷ the GPU floor's step):", "",
            "| mode | batch | graph system | eager step ms | graph step ms | speedup | ÷ floor step |",
            "|---|---|---|---|---|---|---|", *rows, ""]
