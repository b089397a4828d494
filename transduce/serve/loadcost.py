"""What a load test's answers cost: the server's CPU seconds per request and per sentence (its
process_cpu_seconds_total on /metrics, read at a window's edges), and offline decoding of the same sentences in a
process of its own, the ceiling a server is compared with."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

CPU_METRIC = "process_cpu_seconds_total"
OFFLINE_REQUESTS = 100  # requests timed one at a time for offline decoding's latency, at most


def cpu_seconds(exposition: str) -> float | None:
    """The process's CPU seconds (user + system) in a Prometheus text exposition, or None where it has none."""
    for line in exposition.splitlines():
        if line.startswith(CPU_METRIC + " ") or line.startswith(CPU_METRIC + "{"):
            try:
                return float(line.rsplit(" ", 1)[1])
            except ValueError:
                return None
    return None


def scrape_cpu(url: str, headers: dict[str, str]) -> tuple[float, float] | None:
    """(when, the server's CPU seconds) from `url`'s /metrics, `when` on time.monotonic() halfway through the
    request; None where the server does not say (no /metrics, or no process collector in it)."""
    import httpx

    start = time.monotonic()
    try:
        r = httpx.get(url + "/metrics", headers=headers, timeout=30)
    except httpx.HTTPError:
        return None
    seconds = cpu_seconds(r.text) if r.status_code == 200 else None
    return None if seconds is None else ((start + time.monotonic()) / 2, seconds)


def cpu_cost(before: tuple[float, float] | None, after: tuple[float, float] | None,
             answered_between: Callable[[float, float], int], per_request: int) -> dict[str, Any]:
    """The server's CPU seconds between two scrapes, per request and per sentence answered between them
    (`answered_between(t0, t1)`: how many requests were answered with 200 in that time); None where unknown."""
    out: dict[str, Any] = {"server_cpu_s": None, "cpu_s_per_request": None, "cpu_s_per_sentence": None}
    if before is None or after is None:
        return out
    out["server_cpu_s"] = used = after[1] - before[1]
    answered = answered_between(before[0], after[0])
    if answered:
        out["cpu_s_per_request"] = used / answered
        out["cpu_s_per_sentence"] = used / (answered * per_request)
    return out


def offline_figures(artifact: str, sentences: list[str], beam_size: int, per_request: int,
                    threads: int = 0) -> dict[str, Any]:
    """Offline decoding (Translator.translate) of `sentences` with `artifact`, in a process of its own (the load
    generator's imports and threads stay out of it): sentences/s all at once, and the latency of one request's
    worth (`per_request` sentences) at a time."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_offline, artifact, sentences, beam_size, per_request, threads).result()


def _offline(artifact: str, sentences: list[str], beam_size: int, per_request: int, threads: int) -> dict[str, Any]:
    import numpy as np

    from transduce.runtime.api import load

    translator = load(artifact, threads=threads)
    translator.translate(sentences, beam_size=beam_size)  # warm-up: the timed run's buffers already at full size
    start = time.perf_counter()
    out = translator.translate(sentences, beam_size=beam_size)
    wall = time.perf_counter() - start
    latencies = []
    for i in range(min(OFFLINE_REQUESTS, len(sentences))):
        group = [sentences[(i + j) % len(sentences)] for j in range(per_request)]
        t0 = time.perf_counter()
        translator.translate(group, beam_size=beam_size)
        latencies.append(time.perf_counter() - t0)
    return {"sentences": len(sentences), "beam_size": beam_size, "seconds": wall,
            "throughput": len(sentences) / wall, "tokens_per_s": sum(len(t.tokens) + 1 for t in out) / wall,
            "sentences_per_request": per_request, "requests_timed": len(latencies),
            "request_latency_p50": float(np.percentile(latencies, 50)),
            "request_latency_p95": float(np.percentile(latencies, 95))}
