"""Admissions whose sources encode aside (serve/admitting.py): beside a running batch, an arriving group's encoder
runs on a thread of its own while the running rows step, and the group joins once it is done."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from transduce.runtime.api import load
from transduce.serve.service import DecodeService, ServeError, ServiceOptions

LONG = {"beam_size": 1, "min_length": 10}  # runs past the steps taken below


class Gate:
    """backend.encode_aside held until opened (the steps meanwhile run beside it), or failing when told to."""

    def __init__(self, backend, fail: bool = False):
        self.real, self.fail = backend.encode_aside, fail
        self.entered, self.open = threading.Event(), threading.Event()
        self.calls = 0
        backend.encode_aside = self

    def __call__(self, src_ids, src_lengths):
        self.calls += 1
        self.entered.set()
        assert self.open.wait(30)
        if self.fail:
            raise RuntimeError("the encoder broke")
        return self.real(src_ids, src_lengths)


def _service(artifact_dir, **options) -> DecodeService:
    return DecodeService(load(artifact_dir, threads=1), ServiceOptions(**{"join_ratio": 0.0, "encode_aside": True,
                                                                          **options}))


def _run_out(service: DecodeService) -> None:
    while service.batch.cohorts or service._aside is not None:
        service._admit()
        service._step()


def _offline(service, texts, opts):
    return [t.tokens for t in service.translator.translate(texts, **opts)]


def test_an_arrival_encodes_aside_while_the_running_rows_step_then_joins(tiny_artifact_dir):
    """Beside a running batch the group's encoder runs on the encoder thread: the running rows take steps
    meanwhile (none waits for it), the group joins at the first step boundary after it is done, and every
    request gets offline decoding's translations."""
    service = _service(tiny_artifact_dir)
    gate = Gate(service.translator.backend)
    first = service.submit(["one two three", "four"], LONG)
    service._admit()  # an empty batch: encoded here, at once
    assert gate.calls == 0 and service.batch.rows == 2
    later = service.submit(["five six", "seventy-one thousand"], {"beam_size": 2})
    service._admit()
    assert gate.entered.wait(30) and service._aside is not None and not service._queue
    assert service._admitting == [later]
    t0 = service.batch.cohorts[0].t
    for _ in range(3):  # the running rows go on while the arrival encodes
        service._admit()
        service._step()
    assert service.batch.cohorts[0].t == t0 + 3 and service.batch.rows == 2 and service._aside is not None
    gate.open.set()
    service._aside[3].result()
    service._admit()
    assert service._aside is None and service.batch.rows == 2 + 2 and not service._admitting
    _run_out(service)
    assert gate.calls == 1
    assert [t.tokens for t in first.translations] == _offline(service, ["one two three", "four"], LONG)
    assert [t.tokens for t in later.translations] == _offline(service, ["five six", "seventy-one thousand"],
                                                             {"beam_size": 2})


def test_an_aside_encoding_joins_at_once_where_the_batch_ended_meanwhile(tiny_artifact_dir):
    """The running rows finish before the arrival's encoder does: the decode loop waits for it (nothing else to
    step) and the group starts the next batch."""
    service = _service(tiny_artifact_dir)
    gate = Gate(service.translator.backend)
    service.submit(["four"], {"beam_size": 1, "max_len_b": 2, "max_len_a": 0})
    service._admit()
    later = service.submit(["five six"], {"beam_size": 1})
    service._admit()
    assert gate.entered.wait(30)
    while service.batch.cohorts:
        service._step()
    assert service._aside is not None
    threading.Timer(0.05, gate.open.set).start()
    service._admit()  # waits for the encoding: the batch is empty
    assert service._aside is None and service.batch.rows == 1
    _run_out(service)
    assert [t.tokens for t in later.translations] == _offline(service, ["five six"], {"beam_size": 1})


def test_a_request_cancelled_while_it_encodes_is_answered_at_once_and_its_rows_leave(tiny_artifact_dir):
    """Cancelled (its client left) while its group encodes aside: it gets its error at the next step boundary,
    not after the encoding; when the group joins its rows leave at once and the others decode as offline."""
    service = _service(tiny_artifact_dir)
    gate = Gate(service.translator.backend)
    first = service.submit(["one two three"], LONG)
    service._admit()
    left = service.submit(["five six"], {"beam_size": 1})
    stays = service.submit(["seventy-one thousand", "twelve"], {"beam_size": 1})
    service._admit()
    assert gate.entered.wait(30) and service._admitting == [left, stays]
    service.cancel(left, ServeError("the client went away", 499))
    with service._lock:
        cancelled, service._cancelled = service._cancelled, []
    for req, error in cancelled:
        service._drop(req, error)
    assert left.finished.is_set() and left.error.status == 499
    gate.open.set()
    service._aside[3].result()
    service._admit()
    assert service.batch.rows == 1 + 2 and left not in service._running.requests()
    _run_out(service)
    assert stays.error is None and first.error is None
    assert [t.tokens for t in stays.translations] == _offline(service, ["seventy-one thousand", "twelve"],
                                                             {"beam_size": 1})


def test_an_encoding_that_fails_aside_fails_its_requests_only(tiny_artifact_dir):
    """The encoder thread raising: that group's requests get a 500 naming it, the running rows (whose state the
    encoder never touched) go on to their offline translations, and the next arrival is admitted as usual."""
    service = _service(tiny_artifact_dir)
    gate = Gate(service.translator.backend, fail=True)
    first = service.submit(["one two three"], LONG)
    service._admit()
    broken = service.submit(["five six"], {"beam_size": 1})
    service._admit()
    gate.open.set()
    service._aside[3].exception()
    service._admit()
    assert broken.finished.is_set() and broken.error.status == 500 and "the encoder broke" in broken.error.args[0]
    gate.fail = False
    after = service.submit(["twelve"], {"beam_size": 1})
    _run_out(service)
    assert first.error is None and after.error is None
    assert [t.tokens for t in first.translations] == _offline(service, ["one two three"], LONG)
    assert [t.tokens for t in after.translations] == _offline(service, ["twelve"], {"beam_size": 1})


def test_a_stopping_service_fails_the_requests_encoding_aside(tiny_artifact_dir):
    """The decode thread ending while a group encodes aside: those requests are failed with the others (503),
    none is left waiting."""
    service = _service(tiny_artifact_dir)
    gate = Gate(service.translator.backend)
    service.submit(["one two three"], LONG)
    service._admit()
    waiting = service.submit(["five six"], {"beam_size": 1})
    service._admit()
    assert gate.entered.wait(30)
    service._fail_all(ServeError("the server stopped before this request finished", 503))
    assert waiting.finished.is_set() and waiting.error.status == 503
    gate.open.set()


def test_the_encoder_thread_is_only_made_where_it_can_help(tiny_artifact_dir, tiny_model):
    """An encoder thread only where encode_aside asks for it (by default arrivals encode between two steps), and
    not for a backend that cannot encode aside (the eager model); an engine sharing the cores encodes inline while
    another engine decodes (no core is spare)."""
    from transduce.runtime.translator import Translator
    from transduce.serve.engine_core import EngineService

    assert _service(tiny_artifact_dir)._encoder is not None
    assert _service(tiny_artifact_dir, encode_aside=False)._encoder is None
    assert DecodeService(load(tiny_artifact_dir, threads=1))._encoder is None
    eager = load(tiny_artifact_dir, threads=1)
    from transduce.runtime.backends.torch_backend import TorchBackend

    torch_service = DecodeService(Translator(TorchBackend(tiny_model), eager.tokenizer),
                                  ServiceOptions(encode_aside=True))
    assert torch_service._encoder is None
    engine = EngineService(eager, ServiceOptions(encode_aside=True), None, lambda message: None, None)
    assert engine._may_encode_aside()
    engine._crowded = True
    assert not engine._may_encode_aside()


@pytest.mark.parametrize("threads", [1, 2])
def test_encode_aside_gives_encode_s_outputs(tiny_artifact_dir, threads):
    """The one-thread encoding aside equals the backend's own encode, bit for bit, in runs by length or not."""
    backend = load(tiny_artifact_dir, threads=threads).backend
    rng = np.random.default_rng(0)
    for lengths in ([3], [4, 9], [2, 30, 31, 5, 17]):
        width = max(lengths)
        src = rng.integers(4, backend.config.vocab_size, (len(lengths), width))
        for i, n in enumerate(lengths):
            src[i, n - 1], src[i, n:] = backend.config.eos_id, backend.config.pad_id
        want, got = (f(src, np.array(lengths)) for f in (backend.encode, backend.encode_aside))
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_concurrent_requests_encoded_aside_get_offline_translations(tiny_artifact_dir, engine):
    """A started service with encode_aside, in-process and in an engine process: concurrent requests of mixed
    beams (some arriving beside a running batch, encoded aside) get offline decoding's translations."""
    import concurrent.futures

    from transduce.runtime.spec import BackendSpec
    from transduce.serve.engine import EngineClient

    texts = ["one two three", "four hundred and five", "twelve", "", "seven thousand and one", "nine"]
    options = ServiceOptions(encode_aside=True, join_ratio=0.0, max_rows=32)
    offline = load(tiny_artifact_dir, threads=1)
    calls = []
    if engine == "process":
        service = EngineClient(tiny_artifact_dir, BackendSpec.of(threads=1), options)
    else:
        service = DecodeService(load(tiny_artifact_dir, threads=1), options)
        real = service.translator.backend.encode_aside
        service.translator.backend.encode_aside = lambda *a: calls.append(1) or real(*a)
    service.start()
    try:
        long = {"beam_size": 1, "min_length": 40}
        first = service.submit(["one two three"], long)  # running while the others arrive
        while engine == "thread" and not service.batch.rows and not first.finished.is_set():
            time.sleep(0.001)
        cases = [(texts[j:] + texts[:j], {"beam_size": 1 + j % 3, "min_length": 3}) for j in range(6)] * 2
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            answers = list(pool.map(lambda c: service.translate(c[0], c[1]), cases))
        for (given, opts), got in zip(cases, answers, strict=True):
            assert [g.tokens for g in got] == [w.tokens for w in offline.translate(given, **opts)]
        assert first.finished.wait(60) and first.error is None
        assert [t.tokens for t in first.translations] == [t.tokens for t in offline.translate(["one two three"],
                                                                                                **long)]
    finally:
        service.stop()
    assert engine == "process" or calls  # some arrived beside a running batch


def test_a_request_past_its_deadline_while_it_encodes_is_told_and_counted_once(tiny_artifact_dir):
    """Past its deadline while its group encodes aside: a 504 at the next step boundary, counted once however many
    steps pass before the group joins; its rows leave as they join."""
    import time as clock

    from transduce.serve.metrics import ServeMetrics

    metrics = ServeMetrics()
    service = DecodeService(load(tiny_artifact_dir, threads=1),
                            ServiceOptions(join_ratio=0.0, encode_aside=True), metrics)
    gate = Gate(service.translator.backend)
    service.submit(["one two three"], LONG)
    service._admit()
    late = service.submit(["five six"], {"beam_size": 1}, timeout=5.0)
    service._admit()
    assert gate.entered.wait(30)
    for _ in range(3):
        service._expire(clock.monotonic() + 10)
        service._step()
    assert late.error.status == 504 and metrics.timed_out._value.get() == 1
    gate.open.set()
    service._aside[3].result()
    service._admit()
    assert service.batch.rows == 1
    _run_out(service)
