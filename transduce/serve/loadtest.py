"""`transduce loadtest`: open-loop (or closed-loop) load against running servers, one window per (load, server).

Requests arrive as a Poisson process (exponential gaps) at each offered rate for a fixed duration, whatever the
answers (open loop: a slow server is not given time to catch up), each one sentence drawn from held-out data,
streamed (stream: true) so that the time to first token is seen: the first "token" event (greedy) or the first
"translation" (beam). Several servers (e.g. `transduce serve --scheduler continuous|static|single` on the same
model) are measured in one interleaved run: every rate is run on each of them in turn, the order rotated from
one rate to the next, so that drifts of the machine spread over all of them. In the closed-loop mode
(`connections`), each of N connections sends its next request as soon as its last one is answered: the load a
server can sustain, and its latency at that load.

The report: per server and rate, the throughput (sentences and tokens per second answered), latency and time to
first token percentiles (p50, p95, p99 over the answered requests), the rejected (429), timed-out (504) and failed
counts; optionally the offline throughput of `transduce decode` on the same sentences (--artifact) as a ceiling.
Written as JSON, markdown and a plot of p99 latency against offered load.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import numpy as np

PERCENTILES = (50, 95, 99)


def sentences_from(path: str | None, n: int = 400, seed: int = 11) -> list[str]:
    """Held-out sentences: a file's lines (a TSV's first column), or the demo corpus's validation sources."""
    if path:
        with open(path, encoding="utf-8") as f:
            out = [line.split("\t")[0].strip() for line in f if line.strip()]
        if not out:
            from transduce.errors import DataError

            raise DataError(f"{path} holds no sentences")
        return out
    from transduce.models.corpus import demo_corpus

    _, valid = demo_corpus(n_train=1000, n_valid=n, seed=seed)
    return [src for src, _ in valid]


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


async def _window(url: str, rate: float, duration: float, sentences: list[str], options: dict, rng,
                  headers: dict, timeout: float) -> tuple[list[dict], float]:
    """Poisson arrivals at `rate` per second for `duration` s -> every request's outcome, and the wall time
    until the last answer."""
    import httpx

    gaps = rng.exponential(1.0 / rate, size=int(rate * duration * 3) + 10)
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < duration]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for at in arrivals:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            text = sentences[int(rng.integers(len(sentences)))]
            tasks.append(asyncio.create_task(_one(client, {"text": [text], "stream": True, **options})))
        out = await asyncio.gather(*tasks)
        return list(out), time.perf_counter() - t0


async def _closed_window(url: str, connections: int, duration: float, sentences: list[str], options: dict, rng,
                         headers: dict, timeout: float) -> tuple[list[dict], float]:
    """`connections` clients, each sending its next request when its last is answered, for `duration` s -> every
    request's outcome, and the wall time until the last answer."""
    import httpx

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def loop() -> list[dict]:
            out = []
            while time.perf_counter() - t0 < duration:
                text = sentences[int(rng.integers(len(sentences)))]
                out.append(await _one(client, {"text": [text], "stream": True, **options}))
            return out

        done = await asyncio.gather(*(loop() for _ in range(connections)))
        return [r for rs in done for r in rs], time.perf_counter() - t0


def summarize(records: list[dict], rate: float | None, duration: float, wall: float,
              connections: int | None = None) -> dict[str, Any]:
    ok = [r for r in records if r["status"] == 200]
    lat = np.array([r["latency"] for r in ok]) if ok else np.zeros(0)
    ttft = np.array([r["ttft"] for r in ok if r["ttft"] is not None])
    row: dict[str, Any] = {"offered_rate": rate, "connections": connections, "duration_s": duration,
                           "sent": len(records), "answered": len(ok),
                           "rejected": sum(r["status"] == 429 for r in records),
                           "timed_out": sum(r["status"] == 504 for r in records),
                           "failed": sum(r["status"] not in (200, 429, 504) for r in records),
                           "throughput": len(ok) / wall if wall > 0 else 0.0,
                           "tokens_per_s": sum(r["tokens"] for r in ok) / wall if wall > 0 else 0.0}
    for p in PERCENTILES:
        row[f"latency_p{p}"] = float(np.percentile(lat, p)) if lat.size else None
        row[f"ttft_p{p}"] = float(np.percentile(ttft, p)) if ttft.size else None
    return row


def offline_throughput(artifact: str, sentences: list[str], beam: int, threads: int = 0) -> dict[str, Any]:
    """`transduce decode`'s sentences per second on the same sentences (the whole list at once, after one warm-up)."""
    from transduce.runtime.api import load

    translator = load(artifact, threads=threads)
    translator.translate(sentences[:8], beam_size=beam)
    start = time.perf_counter()
    out = translator.translate(sentences, beam_size=beam)
    wall = time.perf_counter() - start
    return {"sentences": len(sentences), "seconds": wall, "throughput": len(sentences) / wall,
            "tokens_per_s": sum(len(t.tokens) + 1 for t in out) / wall}


def run_loadtest(urls: list[str], rates: list[float], duration: float, sentences: list[str], options: dict,
                 api_key: str | None = None, seed: int = 0, timeout: float = 60.0, log=print,
                 connections: list[int] | None = None) -> dict[str, Any]:
    """Every rate (or with `connections`, every connection count: closed loop) on every server, interleaved ->
    the report (see the module's docstring)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    targets = []
    for url in urls:
        model = _served_model(httpx, url.rstrip("/"), headers)
        targets.append({"url": url.rstrip("/"), "scheduler": model.get("scheduler", "?"), "model": model})
    rng = np.random.default_rng(seed)
    rows = []
    loads = [(None, n) for n in connections] if connections else [(r, None) for r in rates]
    for i, (rate, conns) in enumerate(loads):
        for target in targets[i % len(targets):] + targets[: i % len(targets)]:
            if conns:
                records, wall = asyncio.run(_closed_window(target["url"], conns, duration, sentences, options, rng,
                                                           headers, timeout))
            else:
                records, wall = asyncio.run(_window(target["url"], rate, duration, sentences, options, rng, headers,
                                                    timeout))
            row = {"url": target["url"], "scheduler": target["scheduler"],
                   **summarize(records, rate, duration, wall, conns)}
            rows.append(row)
            log(f"{target['scheduler']:>10} {_load(row):>9}: {row['answered']}/{row['sent']} answered, "
                f"p50 {_ms(row['latency_p50'])} p99 {_ms(row['latency_p99'])}, ttft p50 {_ms(row['ttft_p50'])}, "
                f"{row['throughput']:.1f} sentences/s, rejected {row['rejected']}, timed out {row['timed_out']}")
    return {"targets": targets, "options": options, "duration_s": duration, "rates": [] if connections else rates,
            "connections": connections or [], "rows": rows}


def _served_model(httpx, url: str, headers: dict) -> dict[str, Any]:
    """What the server at `url` serves (its /v1/models), before any load: an InputError saying why not."""
    from transduce.errors import InputError

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


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 0.01 else f"{seconds * 1000:.0f} ms"


def _load(row: dict[str, Any]) -> str:
    """A row's load in words: "5/s" (open loop) or "64 conn" (closed loop)."""
    return f"{row['connections']} conn" if row.get("connections") else f"{row['offered_rate']:g}/s"


def _order(row: dict[str, Any]) -> tuple:
    return row["scheduler"], row.get("connections") or 0, row["offered_rate"] or 0

def markdown(report: dict[str, Any]) -> str:
    lines = ["| scheduler | load | answered | sentences/s | tokens/s | p50 | p95 | p99 | ttft p50 | ttft p99 "
             "| rejected | timed out | failed |", "|---" * 13 + "|"]
    for r in sorted(report["rows"], key=_order):
        cells = [r["scheduler"], _load(r), f"{r['answered']}/{r['sent']}", f"{r['throughput']:.1f}",
                 f"{r['tokens_per_s']:.0f}", *(_ms(r[f"latency_p{p}"]) for p in PERCENTILES),
                 _ms(r["ttft_p50"]), _ms(r["ttft_p99"]), str(r["rejected"]), str(r["timed_out"]), str(r["failed"])]
        lines.append("| " + " | ".join(cells) + " |")
    offline = report.get("offline")
    if offline:
        lines.append(f"\nOffline `transduce decode` of the same {offline['sentences']} sentences: "
                     f"{offline['throughput']:.1f} sentences/s ({offline['tokens_per_s']:.0f} tokens/s).")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: str) -> None:
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
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(report: dict[str, Any], out_dir: str) -> list[str]:
    """loadtest.json, loadtest.md and loadtest.png in out_dir -> their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"loadtest.{ext}") for ext in ("json", "md", "png")]
    with open(paths[0], "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(markdown(report))
    plot(report, paths[2])
    return paths
