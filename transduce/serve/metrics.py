"""The server's Prometheus metrics (prometheus-client), in a registry of their own per service."""

from __future__ import annotations


class ServeMetrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total and memory: what a load test's answers cost
        self.queue_depth = Gauge("transduce_queue_depth", "Requests waiting for admission", registry=r)
        self.live_rows = Gauge("transduce_live_rows", "Decoding rows in the running batch", registry=r)
        self.admitted = Counter("transduce_sentences_admitted", "Sentences admitted into the running batch",
                                registry=r)
        self.admission = Histogram("transduce_admission_sentences", "Sentences per admission (one encoder run each)",
                                   registry=r, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
        self.finished = Counter("transduce_sentences_finished", "Sentences decoded to the end", registry=r)
        self.batch_rows = Histogram("transduce_batch_rows", "Rows stepped per decoder step", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
        self.ttft = Histogram("transduce_time_to_first_token_seconds", "From arrival to the first token (greedy) "
                              "or the first finished sentence (beam)", registry=r)
        self.latency = Histogram("transduce_request_latency_seconds", "From arrival to the last sentence", registry=r)
        self.tokens = Counter("transduce_generated_tokens", "Tokens of finished translations (EOS included); "
                              "rate() gives tokens per second", registry=r)
        self.rejected = Counter("transduce_requests_rejected", "Requests refused with 429 (queue full)", registry=r)
        self.timed_out = Counter("transduce_requests_timed_out", "Requests dropped past their deadline", registry=r)
        self.cancelled = Counter("transduce_requests_cancelled", "Requests whose client left before the answer",
                                 registry=r)
        self.bad = Counter("transduce_requests_invalid", "Requests answered 4xx for their input", registry=r)

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class EngineMetrics(ServeMetrics):
    """The front end's metrics under --engine process, exposed together with the engine process's: samples both
    processes have (the counters either may count, process_cpu_seconds_total, memory) are summed; the process's
    start time and limits are the front end's."""

    KEPT = ("process_start_time_seconds", "process_max_fds")  # the front end's own, not summed

    def __init__(self):
        super().__init__()
        self.engine = None  # the EngineClient, whose engine_metrics() gives the other process's exposition

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        front = generate_latest(self.registry).decode()
        try:
            other = self.engine.engine_metrics().decode() if self.engine is not None else ""
        except Exception:  # noqa: BLE001 - an engine that died: the front end's own figures still go out
            other = ""
        return merged(front, other, self.KEPT), CONTENT_TYPE_LATEST


def merged(first: str, second: str, kept: tuple[str, ...] = ()) -> bytes:
    """Two Prometheus text expositions as one: each sample in both summed (families named in `kept`: the
    first's), the rest as they are."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(first)}
    for f in text_string_to_metric_families(second):
        mine = families.get(f.name)
        if mine is None:
            families[f.name] = f
            continue
        if f.name in kept:
            continue
        index = {(s.name, tuple(sorted(s.labels.items()))): n for n, s in enumerate(mine.samples)}
        for s in f.samples:
            n = index.get((s.name, tuple(sorted(s.labels.items()))))
            if n is None:
                mine.samples.append(s)
            elif not s.name.endswith("_created"):  # a creation time is not summed: the first's stays
                mine.samples[n] = mine.samples[n]._replace(value=mine.samples[n].value + s.value)

    class Collected:
        def collect(self):
            return list(families.values())

    return generate_latest(Collected())
