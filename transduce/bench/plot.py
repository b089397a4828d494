"""bench.png: throughput by batch size and system, a panel per model size and decoding mode (matplotlib, imported
when drawing)."""

from __future__ import annotations

from typing import Any

from transduce.io.atomic import write_png_atomic


def plot(result: dict[str, Any], path: str) -> None:
    """bench.png: a panel per size and mode, tokens/s by batch size and system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [s for s in result["sizes"] if s["cells"]]
    modes = list(dict.fromkeys(c["mode"] for s in sizes for c in s["cells"]))
    if not sizes or not modes:
        fig, ax = plt.subplots(figsize=(5, 2))
        ax.text(0.5, 0.5, "nothing was timed", ha="center", va="center")
        ax.axis("off")
        write_png_atomic(fig, path, 100)
        return
    fig, axes = plt.subplots(len(sizes), len(modes), figsize=(5.5 * len(modes), 3.8 * len(sizes)), squeeze=False)
    for i, s in enumerate(sizes):
        for j, mode in enumerate(modes):
            _panel(axes[i][j], s, mode)
    threads = result["config"]["threads"]
    fig.suptitle(f"transduce bench: throughput by batch size and system (at most {threads} threads each, "
                 f"{result['config']['steps']} forced steps; median, bars min–max)", fontsize=10)
    handles, labels = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    ncol = min(len(labels), 2 * len(modes) + 1)  # long names (ctranslate2-nomkl-1thread) need ~2 columns a panel
    fig.legend([handles[lab] for lab in labels], labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    rows = -(-len(labels) // ncol)
    fig.tight_layout(rect=(0, (0.1 + 0.2 * rows) / fig.get_figheight(), 1, 1))  # the legend's rows below the panels
    write_png_atomic(fig, path, 110, bbox_inches="tight")  # a one-panel-wide figure: the legend and title wider than it


def _panel(ax, s: dict[str, Any], mode: str) -> None:
    """One size's throughput at one mode: a bar per system and batch, the fp32 ceiling where floors were derived,
    and what an empty slot means."""
    import numpy as np

    cells = [c for c in s["cells"] if c["mode"] == mode]
    batches = [c["batch"] for c in cells]
    systems = list(dict.fromkeys(n for c in cells for n in c["systems"]))
    width = 0.8 / max(len(systems), 1)
    x = np.arange(len(batches))
    for k, name in enumerate(systems):
        med, lo, hi = [], [], []
        for c in cells:
            tps = c["systems"].get(name, {}).get("stats", {}).get("tokens_per_s")
            med.append(tps["median"] if tps else 0.0)
            lo.append(tps["median"] - tps["min"] if tps else 0.0)
            hi.append(tps["max"] - tps["median"] if tps else 0.0)
        slots = x + (k - (len(systems) - 1) / 2) * width
        ax.bar(slots, med, width, yerr=[lo, hi], capsize=2, label=name,
               hatch="//" if name.startswith("ctranslate2") else None, edgecolor="black", linewidth=0.4)
        for slot, c, m in zip(slots, cells, med, strict=True):  # an empty slot says why it is empty
            why = (f"= {c['not_timed'][name].removeprefix('ctranslate2-')}" if name in (c.get("not_timed") or {})
                   else "failed" if name in c["systems"] and not m else None)
            if why:
                ax.annotate(why, (slot, 0.02), xycoords=("data", "axes fraction"), rotation=90, ha="center",
                            va="bottom", fontsize=6)
    floors = [c.get("floor") for c in cells]
    if all(floors):
        ceil_tps = [c["batch"] * c["steps"] / f["seconds"] for c, f in zip(cells, floors, strict=True)]
        ax.scatter(x, ceil_tps, marker="_", s=600, color="red", zorder=5,
                   label="fp32 ceiling (tok/s at the floor; int8 reads less)")
    ax.set_yscale("log")
    ax.set_xticks(x, [f"batch {b}" for b in batches])
    ax.set_ylabel("target tokens / s")
    ax.set_title(f"{s['size']} ({s['model']['config']['d_model']}d, "
                 f"{s['model']['config']['encoder_layers']}+{s['model']['config']['decoder_layers']}), {mode}")
    ax.grid(axis="y", alpha=0.3, which="both")
