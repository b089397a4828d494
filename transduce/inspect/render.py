"""`transduce inspect`'s tables: a report (transduce.inspect.report) printed with rich.

Values from description files are shown as plain text, never read as rich markup. rich is imported by the
functions that draw, not by this module.
"""

from __future__ import annotations

import json
from typing import Any

from transduce.formats.kinds import ENGINE_MANIFEST_FILE
from transduce.inspect.report import RUNTIME_OK_UNHASHED


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


def _compact(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(", ", ": "))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def flatten(doc: dict[str, Any], prefix: str = "", depth: int = 2,
            tables: list | None = None) -> list[tuple[str, str]]:
    """Nested objects -> (dotted key, compact value) rows, objects expanded `depth` levels.

    With `tables` (a list), a list of objects (engine profiles, validation errors) is appended to it as
    (dotted key, list) to be shown as a table of its own, and its row says so.
    """
    rows = []
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and depth > 0:
            rows.extend(flatten(value, name + ".", depth - 1, tables))
        elif tables is not None and isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables.append((name, value))
            rows.append((name, f"{len(value)} entries, below"))
        else:
            rows.append((name, _compact(value)))
    return rows


def _records_table(title: str, records: list[dict[str, Any]]):
    """A list of objects as a table: one row each, one column per key (in order of appearance)."""
    from rich.table import Table

    columns = list(dict.fromkeys(k for r in records for k in r))
    cells = [[_compact(r[c], 60) if c in r else "" for c in columns] for r in records]
    table = Table(box=None, padding=(0, 1))
    for i, col in enumerate(columns):
        short = max(len(col), *(len(row[i]) for row in cells)) <= 16  # names and numbers: never folded
        table.add_column(_plain(col), no_wrap=short, overflow="ellipsis" if short else "fold")
    for row in cells:
        table.add_row(*(_plain(c) for c in row))
    return _titled(title, table)


def _key_value_table(title: str, rows: list[tuple[str, str]]):
    from rich.table import Table

    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="cyan", no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(_plain(key), _plain(value))
    return _titled(title, table)


def _titled(title: str, renderable):
    """A section: its title on a line of its own (never wrapped to the table's width), then the table."""
    from rich.console import Group
    from rich.text import Text

    return Group(Text(title, style="bold italic"), renderable)


def _plain(value: Any):
    """Text shown as is: values from description files are never read as rich markup."""
    from rich.text import Text

    return value if isinstance(value, Text) else Text(str(value))


def _parameters_table(title: str, params: dict[str, Any]):
    from rich.table import Table

    total = params["total"] or 1
    table = Table(box=None, padding=(0, 2))
    table.add_column("group", style="cyan")
    table.add_column("parameters", justify="right")
    table.add_column("share", justify="right")
    for name, component in params["components"].items():
        n = component["parameters"]
        table.add_row(_plain(name), f"{n:,}", f"{100 * n / total:.1f}%", style="bold")
        for kind, k in component["kinds"].items():
            if kind != name:
                table.add_row(_plain(f"  {kind}"), f"{k:,}", f"{100 * k / total:.1f}%")
    for stack, per_layer in params["layers"].items():
        if per_layer:
            table.add_row(f"{stack} per layer", " / ".join(f"{n:,}" for n in per_layer), "")
    table.add_row("total", f"{params['total']:,}", ", ".join(f"{k} {v:,}" for k, v in params["dtypes"].items()),
                  style="bold")
    return _titled(title, table)


def _io_table(title: str, graph: dict[str, Any]):
    from rich.table import Table

    table = Table(box=None, padding=(0, 2))
    for col in ("", "name", "dtype", "shape"):
        table.add_column(col, style="cyan" if col == "name" else None)
    for side in ("inputs", "outputs"):
        for v in graph[side]:
            shape = "?" if v["shape"] is None else "(" + ", ".join(str(d) for d in v["shape"]) + ")"
            table.add_row(side[:-1], _plain(v["name"]), _plain(v["dtype"]), _plain(shape))
    return _titled(title, table)


def _files_table(files: list[dict[str, Any]], title: str = "files"):
    from rich.table import Table

    table = Table(box=None, padding=(0, 2))
    for col in ("name", "bytes", "size", "recorded", "sha256"):
        table.add_column(col, justify="right" if col in ("bytes", "size") else "left")
    for f in files:
        sha = {True: "[green]ok[/]", False: "[red]MISMATCH[/]", None: "not checked" if f["sha256"] else "-"}
        recorded = ("-" if f["recorded_bytes"] is None else "[red]missing[/]" if f["bytes"] is None
                    else "yes" if f["recorded_bytes"] == f["bytes"] else "[red]differs[/]")
        table.add_row(_plain(f["name"]), "-" if f["bytes"] is None else f"{f['bytes']:,}", _human_bytes(f["bytes"]),
                      recorded, sha[f["sha256_ok"]])
    return _titled(title, table)


def render_report(report: dict[str, Any], console=None) -> None:
    """Print a report as rich tables (to `console`, default stdout)."""
    from rich.text import Text

    from transduce._console import console as make_console

    console = console or make_console()  # 140 columns into a file or pipe: names are not cut to fit 80
    console.print(Text.assemble((report["kind"], "bold"), " ", report["path"]))
    sections = []
    if report["kind"] == "engine" and report.get("built_for"):
        sections.append(_key_value_table("built for", [(k, _compact(v)) for k, v in report["built_for"].items()]))
    if report.get("config"):
        sections.append(_key_value_table("model config", flatten(report["config"])))
    if report.get("decoding_defaults"):  # an imported model's: its framework's, not the paper's
        sections.append(_key_value_table("decoding defaults", [(k, _compact(v))
                                                               for k, v in report["decoding_defaults"].items()]))
    if report.get("tokenizer"):
        sections.append(_key_value_table("tokenizer", [("vocab_size", str(report["tokenizer"]["vocab_size"]))]))
    if report.get("parameters"):
        sections.append(_parameters_table("parameters (from model.safetensors)", report["parameters"]))
    if report.get("training"):
        sections.append(_key_value_table("training", flatten(report["training"], depth=1)))
    for name, graph in (report.get("graphs") or {}).items():
        sections.extend(_graph_sections(name, graph))
    for key, title in (("manifest", "manifest"), ("engine", ENGINE_MANIFEST_FILE)):
        if report.get(key):
            sections.extend(_document_sections(title, report[key], report))
    sections.append(_checks_section(report))
    sections.append(_files_table(report["files"]))
    for section in sections:
        console.print()
        console.print(section)
    if report["problems"]:
        console.print()
        console.print("[bold red]problems[/]")
        for problem in report["problems"]:
            console.print(Text.assemble("  ", ("-", "red"), " ", problem), highlight=False)


def _checks_section(report: dict[str, Any]):
    """What was checked: the runtime's verdict (artifacts and engines), and whether the sha256 sums were
    compared. Green only for what was checked whole: a verdict without the sums is yellow."""
    from rich.text import Text

    rows = []
    hashes = report.get("hashes") or {}
    if "runtime_check" in report:
        check = report["runtime_check"]
        style = "green" if check == "ok" else "yellow" if check == RUNTIME_OK_UNHASHED else "red"
        rows.append(("loads", Text(check, style=style)))
        if report["kind"] == "engine":
            rows.append(("checked", "files and formats, not whether this machine has the TensorRT and GPU"))
    step = report.get("step_graph")
    if step:
        rows.append(("step graph (ONNX Runtime, CPU)", f"{step['graph']}: {step['why']}" if step["graph"]
                     else step["why"]))
    if hashes:
        rows.append(("sha256", Text(hashes["note"], style=None if hashes["checked"] else "yellow")))
    return _key_value_table("runtime" if "runtime_check" in report else "checks", rows)


def _document_sections(title: str, doc: dict[str, Any], report: dict[str, Any]) -> list:
    """A manifest or engine.json: its figures as key/value rows, its lists of objects as tables.

    Left out here (they are in the JSON report): the model config and, when the graphs were read from
    their files, the manifest's own per-graph summaries, both shown in their own sections.
    """
    skip = {k for k, v in doc.items() if v == report.get("config")}
    if title == "manifest" and report.get("graphs"):
        skip.add("graphs")
    tables: list = []
    rows = flatten({k: v for k, v in doc.items() if k not in skip}, tables=tables)
    return [_key_value_table(title, rows)] + [_records_table(f"{title}: {name}", records) for name, records in tables]


def _graph_sections(name: str, graph: dict[str, Any]) -> list:
    """The tables of one ONNX graph: summary, inputs/outputs, op histogram, parameters."""
    summary = [
        ("file size", f"{_human_bytes(graph['bytes'])} ({graph['bytes']:,} bytes)"),
        ("opsets", ", ".join(f"{d} {v}" for d, v in graph["opsets"].items())),
        ("ir_version", str(graph["ir_version"])),
        ("producer", graph["producer"] or "-"),
        ("nodes", f"{graph['nodes']:,}"),
        ("ops", ", ".join(f"{op} ×{n}" for op, n in graph["ops"].items())),
    ]
    if graph["functions"]:
        summary.append(("functions", ", ".join(f"{f} ({n} nodes)" for f, n in graph["functions"].items())))
    if graph["external_data"]:
        summary.append(("weights", "external data file"))
    return [
        _key_value_table(f"graph {name}", summary),
        _io_table(f"{name}: inputs and outputs", graph),
        _parameters_table(f"{name}: parameters (initializers)", graph["parameters"]),
    ]
