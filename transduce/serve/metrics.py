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
