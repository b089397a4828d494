"""`transduce loadtest`: open-loop (or closed-loop) load against running servers, one window per (load, server).

Open loop (`rates`): requests arrive as a Poisson process (exponential gaps) at each offered rate for a fixed
duration, whatever the answers (a slow server is not given time to catch up), streamed (stream: true) so that the
time to first token is seen: the first "token" event (greedy) or the first "translation" (beam). Closed loop
(`connections`, transduce.serve.loadgen): each of N keep-alive connections, spread over several generator
processes, sends its next request as soon as its last one is answered, after a warm-up that is not counted: the
load a server can sustain, and its latency there. Several servers (e.g. `transduce serve --scheduler
continuous|static|single` on the same model) are measured in one interleaved run: every load is run on each of
them in turn, the order rotated from one load to the next, so that drifts of the machine spread over all of them.
Each request holds `sentences_per_request` held-out sentences.

The report: per server and load, requests and sentences per second answered, tokens per second, latency (and in
the open loop time to first token) percentiles over the answered requests, the requests that failed by status,
and the server's CPU seconds per request and per sentence (its process_cpu_seconds_total, read from /metrics at
the window's edges); optionally offline decoding of the same sentences (--artifact, transduce.serve.loadcost) and
each row's ratio to it. Written as JSON, markdown and a plot of p99 latency against load.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from transduce.errors import DataError, InputError
from transduce.serve.loadcost import cpu_cost, scrape_cpu
from transduce.serve.loadgen import ClosedLoop, encode_requests, errors_by_status, in_window, run_closed_loop

PERCENTILES = (50, 95, 99)


def default_processes() -> int:
    """Generator processes of the closed loop when not given: two where there are two cores."""
    return max(1, min(2, os.cpu_count() or 1))


@dataclass(frozen=True)
class LoadPlan:
    """What a load test offers each server: the open loop's `rates` (requests/s), or the closed loop's
    `connections` (each count one window, spread over `processes` generator processes, `warmup` seconds not
    counted first); `duration` seconds measured per window; `sentences_per_request` sentences and `beam_size` per
    request; `timeout` seconds a request may take (client side); `seed` of the arrivals and sentences drawn."""

    rates: tuple[float, ...] = (2.0, 5.0, 10.0, 20.0)
    connections: tuple[int, ...] = ()
    duration: float = 10.0
    warmup: float = 2.0
    processes: int = 2
    sentences_per_request: int = 1
    beam_size: int = 1
    timeout: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.connections and not (self.rates and all(0 < r < math.inf for r in self.rates)):
            raise InputError(f"rates must be finite numbers > 0 (requests per second), got "
                             f"{','.join(f'{r:g}' for r in self.rates)}", params=("rates",))
        if not all(_whole(n) and n >= 1 for n in self.connections):
            raise InputError(f"connections must be at least 1 each, got {list(self.connections)}",
                             params=("connections",))
        for name in ("processes", "sentences_per_request", "beam_size"):
            v = getattr(self, name)
            if not _whole(v) or v < 1:
                raise InputError(f"{name} must be an integer >= 1, got {v!r}", params=(name,))
        for name, low in (("duration", 0.0), ("timeout", 0.0), ("warmup", None)):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not (
                    (0 <= v if low is None else low < v) and v < math.inf):
                raise InputError(f"{name} must be a finite number of seconds {'>= 0' if low is None else '> 0'}, "
                                 f"got {v!r}", params=(name,))


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def sentences_from(path: str | None, n: int = 400, seed: int = 11) -> list[str]:
    """Held-out sentences: a file's lines (a TSV's first column), or the demo corpus's validation sources."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                out = [line.split("\t")[0].strip() for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"cannot read --data {path!r}: {getattr(e, 'strerror', None) or e}",
                            hint="give a UTF-8 text file of sentences, one per line") from None
        if not out:
            raise DataError(f"--data {path!r} holds no sentences", hint="give a file with one sentence per line")
        return out
    from transduce.models.corpus import demo_corpus

    _, valid = demo_corpus(n_train=1000, n_valid=n, seed=seed)
    return [src for src, _ in valid]


def request_bodies(sentences: list[str], plan: LoadPlan) -> list[dict]:
    """One request body per sentence: it and the sentences after it (wrapping around), `sentences_per_request`
    in all, with the plan's beam size."""
    k, n = plan.sentences_per_request, len(sentences)
    return [{"text": [sentences[(i + j) % n] for j in range(k)], "beam_size": plan.beam_size} for i in range(n)]


async def _one(client, body: dict) -> dict[str, Any]:
    """One streamed request -> its outcome: status, latency and time to first token (s), tokens answered."""
    start = time.perf_counter()
    first = None
    tokens = 0
    status = None
    try:
        async with client.stream("POST", "/v1/translate", json=body) as r:
            status = r.status_code
            if status == 200:
                event = None
                async for line in r.aiter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                        if first is None and event in ("token", "translation"):
                            first = time.perf_counter() - start
                    elif line.startswith("data: ") and event == "done":
                        tokens = sum(len(t["tokens"]) for t in json.loads(line[6:])["translations"])
                    elif line.startswith("data: ") and event == "error":  # a 504 past the deadline, say
                        status = json.loads(line[6:])["error"]["status"]
    except Exception as e:  # noqa: BLE001 - a broken connection is a failed request, counted as such
        return {"status": f"{type(e).__name__}", "latency": time.perf_counter() - start, "ttft": None, "tokens": 0}
    return {"status": status, "latency": time.perf_counter() - start, "ttft": first, "tokens": tokens}


async def _window(url: str, rate: float, plan: LoadPlan, bodies: list[dict], rng,
                  headers: dict) -> tuple[list[dict], float]:
    """Poisson arrivals at `rate` per second for the plan's duration -> every request's outcome, and the wall time
    until the last answer."""
    import httpx

    gaps = rng.exponential(1.0 / rate, size=int(rate * plan.duration * 3) + 10)
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < plan.duration]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=plan.timeout, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for at in arrivals:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = bodies[int(rng.integers(len(bodies)))]
            tasks.append(asyncio.create_task(_one(client, {**body, "stream": True})))
        out = await asyncio.gather(*tasks)
        return list(out), time.perf_counter() - t0


def _closed_window(url: str, connections: int, plan: LoadPlan, bodies: list[dict],
                   headers: dict) -> tuple[list[dict], float, dict]:
    """The closed loop at `connections` (transduce.serve.loadgen) -> the outcomes of the requests answered inside
    the measured window, its length, and the server's CPU cost over it."""
    requests = encode_requests(url, [{**b, "stream": False} for b in bodies], headers)
    edges = {}

    def during(start: float, end: float) -> None:  # the server's CPU time at the window's edges
        time.sleep(max(0.0, start - time.monotonic()))
        edges["before"] = scrape_cpu(url, headers)
        time.sleep(max(0.0, end - time.monotonic()))
        edges["after"] = scrape_cpu(url, headers)

    load = ClosedLoop(connections, plan.processes, plan.duration, plan.warmup, plan.timeout)
    records, start, end = run_closed_loop(url, requests, load, during)
    counted = [{"status": s, "latency": e - b, "ttft": None, "tokens": t}
               for b, e, s, t in in_window(records, start, end)]

    def answered_between(t0: float, t1: float) -> int:
        return sum(r[2] == 200 and t0 <= r[1] <= t1 for r in records)

    return counted, end - start, cpu_cost(edges.get("before"), edges.get("after"), answered_between,
                                          plan.sentences_per_request)


def summarize(records: list[dict], rate: float | None, duration: float, wall: float,
              connections: int | None = None, per_request: int = 1) -> dict[str, Any]:
    """A window's row: counts, throughputs over `wall` seconds and latency percentiles over the answered
    requests."""
    ok = [r for r in records if r["status"] == 200]
    lat = np.array([r["latency"] for r in ok]) if ok else np.zeros(0)
    ttft = np.array([r["ttft"] for r in ok if r["ttft"] is not None])
    per_s = len(ok) / wall if wall > 0 else 0.0
    row: dict[str, Any] = {"offered_rate": rate, "connections": connections, "duration_s": duration,
                           "sentences_per_request": per_request, "sent": len(records), "answered": len(ok),
                           "rejected": sum(r["status"] == 429 for r in records),
                           "timed_out": sum(r["status"] in (504, "timeout") for r in records),
                           "failed": sum(r["status"] not in (200, 429, 504, "timeout") for r in records),
                           "errors": errors_by_status(r["status"] for r in records),
                           "requests_per_s": per_s, "sentences_per_s": per_s * per_request,
                           "throughput": per_s * per_request,
                           "tokens_per_s": sum(r["tokens"] for r in ok) / wall if wall > 0 else 0.0}
    for p in PERCENTILES:
        row[f"latency_p{p}"] = float(np.percentile(lat, p)) if lat.size else None
        row[f"ttft_p{p}"] = float(np.percentile(ttft, p)) if ttft.size else None
    return row


def run_loadtest(urls: list[str], sentences: list[str], plan: LoadPlan, api_key: str | None = None,
                 log=print) -> dict[str, Any]:
    """Every rate (or every connection count: closed loop) on every server, interleaved -> the report (see the
    module's docstring)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    targets = []
    for url in urls:
        model = _served_model(httpx, url.rstrip("/"), headers)
        targets.append({"url": url.rstrip("/"), "scheduler": model.get("scheduler", "?"), "model": model})
    rng = np.random.default_rng(plan.seed)
    bodies = request_bodies(sentences, plan)
    rows = []
    loads = [(None, n) for n in plan.connections] if plan.connections else [(r, None) for r in plan.rates]
    for i, (rate, conns) in enumerate(loads):
        for target in targets[i % len(targets):] + targets[: i % len(targets)]:
            url = target["url"]
            if conns:
                records, wall, cost = _closed_window(url, conns, plan, bodies, headers)
                window = plan.duration
            else:
                before = scrape_cpu(url, headers)
                records, wall = asyncio.run(_window(url, rate, plan, bodies, rng, headers))
                answered = sum(r["status"] == 200 for r in records)
                cost = cpu_cost(before, scrape_cpu(url, headers), lambda t0, t1, n=answered: n,
                                plan.sentences_per_request)
                window = wall
            row = {"url": url, "scheduler": target["scheduler"],
                   **summarize(records, rate, plan.duration, window, conns, plan.sentences_per_request), **cost}
            rows.append(row)
            log(f"{target['scheduler']:>10} {_load(row):>9}: {row['answered']}/{row['sent']} answered, "
                f"{row['requests_per_s']:.1f} requests/s, {row['sentences_per_s']:.1f} sentences/s, "
                f"p50 {_ms(row['latency_p50'])} p99 {_ms(row['latency_p99'])}, ttft p50 {_ms(row['ttft_p50'])}, "
                f"errors {_errors(row)}, server CPU {_ms(row['cpu_s_per_sentence'])}/sentence")
    if any(r["server_cpu_s"] is None for r in rows):
        log("note: a server's /metrics has no process_cpu_seconds_total: its CPU cost is not reported")
    return {"targets": targets, "plan": asdict(plan), "options": {"beam_size": plan.beam_size},
            "duration_s": plan.duration, "rates": [] if plan.connections else list(plan.rates),
            "connections": list(plan.connections), "rows": rows}


def _served_model(httpx, url: str, headers: dict) -> dict[str, Any]:
    """What the server at `url` serves (its /v1/models), before any load: an InputError saying why not."""
    try:
        r = httpx.get(url + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise InputError(f"cannot reach {url}: {e}", hint="is `transduce serve` running there?",
                         params=("urls",)) from None
    if r.status_code == 401:
        raise InputError(f"{url} needs an API key", hint="pass --api-key-file FILE", params=("api_key_file",))
    try:
        return r.json()["data"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise InputError(f"{url}/v1/models answered {r.status_code}, not a transduce server's model list",
                         hint="give the URL of a `transduce serve`", params=("urls",)) from None


def compare_offline(report: dict[str, Any], offline: dict[str, Any]) -> None:
    """Put offline decoding's figures (loadcost.offline_figures) in the report, and each row's ratio to them:
    sentences/s server ÷ offline, and p50 latency server ÷ offline one request at a time."""
    report["offline"] = offline
    for row in report["rows"]:
        row["sentences_per_s_vs_offline"] = row["sentences_per_s"] / offline["throughput"]
        p50 = row["latency_p50"]
        row["latency_p50_vs_offline"] = None if p50 is None else p50 / offline["request_latency_p50"]


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.2f} ms" if seconds < 0.01 else f"{seconds * 1000:.0f} ms"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _errors(row: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in row["errors"].items()) or "none"


def _load(row: dict[str, Any]) -> str:
    """A row's load in words: "5/s" (open loop) or "64 conn" (closed loop)."""
    return f"{row['connections']} conn" if row.get("connections") else f"{row['offered_rate']:g}/s"


def _order(row: dict[str, Any]) -> tuple:
    return row["scheduler"], row.get("connections") or 0, row["offered_rate"] or 0


def short_warmups(report: dict[str, Any]) -> list[str]:
    """The closed-loop windows whose requests took longer (median) than the warm-up before them, each in words:
    their connections' first requests were still under way when the window opened, so it counted a load
    building up, not a steady one, and undercounts (a server answering in seconds needs a longer --warmup)."""
    warmup = report["plan"]["warmup"]
    out = []
    for r in sorted(report["rows"], key=_order):
        p50 = r["latency_p50"]
        if r.get("connections") and p50 is not None and p50 > warmup:
            out.append(f"{r['scheduler']} at {_load(r)}: requests took {p50:.3g} s (median), longer than the "
                       f"{warmup:g} s warm-up: its window opened before the load was steady and undercounts; give "
                       f"--warmup {math.ceil(2 * p50)} or more")
    return out


def markdown(report: dict[str, Any]) -> str:
    offline = report.get("offline")
    head = ["scheduler", "load", "answered", "requests/s", "sentences/s", "tokens/s", "p50", "p95", "p99",
            "ttft p50", "ttft p99", "errors", "server CPU/request", "server CPU/sentence"]
    if offline:
        head += ["sentences/s ÷ offline", "p50 ÷ offline"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in sorted(report["rows"], key=_order):
        cells = [r["scheduler"], _load(r), f"{r['answered']}/{r['sent']}", f"{r['requests_per_s']:.1f}",
                 f"{r['sentences_per_s']:.1f}", f"{r['tokens_per_s']:.0f}",
                 *(_ms(r[f"latency_p{p}"]) for p in PERCENTILES), _ms(r["ttft_p50"]), _ms(r["ttft_p99"]),
                 _errors(r), _ms(r["cpu_s_per_request"]), _ms(r["cpu_s_per_sentence"])]
        if offline:
            cells += [_ratio(r["sentences_per_s_vs_offline"]), _ratio(r["latency_p50_vs_offline"])]
        lines.append("| " + " | ".join(cells) + " |")
    if offline:
        lines.append(f"\nOffline decoding of the same {offline['sentences']} sentences (`Translator.translate`, "
                     f"another process, beam {offline['beam_size']}): {offline['throughput']:.1f} sentences/s "
                     f"({offline['tokens_per_s']:.0f} tokens/s) all at once; one request of "
                     f"{offline['sentences_per_request']} sentence(s) at a time: p50 "
                     f"{_ms(offline['request_latency_p50'])}, p95 {_ms(offline['request_latency_p95'])}.")
    lines += [f"\nWarning: {w}." for w in short_warmups(report)]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any]):
    """The figure of p99 latency against load, one line per scheduler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed = bool(report.get("connections"))
    x = "connections" if closed else "offered_rate"
    fig, ax = plt.subplots(figsize=(6, 4))
    for scheduler in sorted({r["scheduler"] for r in report["rows"]}):
        rows = sorted((r for r in report["rows"] if r["scheduler"] == scheduler and r["latency_p99"] is not None),
                      key=_order)
        ax.plot([r[x] for r in rows], [r["latency_p99"] * 1000 for r in rows], marker="o", label=scheduler)
    ax.set_xlabel("connections (closed loop)" if closed else "offered load (requests/s, Poisson)")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def write_report(report: dict[str, Any], out_dir: str) -> list[str]:
    """loadtest.json, loadtest.md and loadtest.png in out_dir, each written whole or not at all -> their paths."""
    from transduce.io.atomic import write_json_atomic, write_png_atomic, write_text_atomic

    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"loadtest.{ext}") for ext in ("json", "md", "png")]
    write_json_atomic(paths[0], report)
    write_text_atomic(paths[1], markdown(report))
    write_png_atomic(plot(report), paths[2], dpi=120)
    return paths
