"""The decode service in-process: each of its schedulers gives offline decoding's translations."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib

import numpy as np
import pytest

TEXTS = ["one two three", "four hundred and five", "twelve", "", "seven thousand and one", "nine"]


ENGINES = ["thread", "process"]  # the decode thread beside the caller, or in an engine process (serve.engine)


@contextlib.contextmanager
def _started(artifact_dir: str, engine: str = "thread", **options):
    """A started DecodeService over the artifact (ServiceOptions `options`), its decode thread here or in an
    engine process, stopped when the block ends."""
    from transduce.runtime.api import load
    from transduce.runtime.spec import BackendSpec
    from transduce.serve.engine import EngineClient
    from transduce.serve.service import DecodeService, ServiceOptions

    if engine == "process":
        service = EngineClient(artifact_dir, BackendSpec.of(threads=1), ServiceOptions(**options))
    else:
        service = DecodeService(load(artifact_dir, threads=1), ServiceOptions(**options))
    service.start()
    try:
        yield service
    finally:
        service.stop()


def _concurrently(service, cases: list) -> list:
    """Each case's (texts, options) translated by the service at the same time, one client thread each."""
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(lambda c: service.translate(c[0], c[1]), cases))


@pytest.mark.parametrize("scheduler, engine", [("continuous", "thread"), ("static", "thread"), ("single", "thread"),
                                               ("continuous", "process")])
def test_each_scheduler_translates_as_offline_decoding(tiny_artifact_dir, scheduler, engine):
    """Concurrent requests of mixed beams: each gets offline decoding's translations, however the batch around it
    was made, in the decode thread beside the caller or in the engine process."""
    from transduce.runtime.api import load

    with _started(tiny_artifact_dir, engine, scheduler=scheduler, max_rows=16) as service:
        cases = [(TEXTS[j:] + TEXTS[:j], {"beam_size": 1 + j % 3}) for j in range(6)]
        answers = _concurrently(service, cases)
        offline = load(tiny_artifact_dir, threads=1)
        for (texts, opts), got in zip(cases, answers, strict=True):
            want = offline.translate(texts, **opts)
            assert [g.tokens for g in got] == [w.tokens for w in want]
            np.testing.assert_allclose([g.score for g in got], [w.score for w in want], atol=1e-5)
        assert service.queue_depth() == 0
        if engine == "thread":
            assert service.batch.rows == 0
    assert not service.alive()


@pytest.mark.parametrize("engine", ENGINES)
def test_sampled_requests_decoded_beside_others_get_their_offline_samples(tiny_artifact_dir, engine):
    """Requests that sample (greedy and beam), decoded at once beside each other and beside requests that do
    not, each get what offline translation of their own sentences gives: a sentence's draws are keyed by its
    number in its request, never by the running batch around it."""
    from transduce.runtime.api import load

    with _started(tiny_artifact_dir, engine, max_rows=32) as service:
        sampled = {"sampling_topk": 0, "sampling_temperature": 1.5, "max_len_b": 8}
        cases = [(TEXTS[j:] + TEXTS[:j], {"beam_size": 1 + 3 * (j % 2), "seed": j // 2, **sampled})
                 for j in range(4)] + [(TEXTS, {"beam_size": 2})]
        answers = _concurrently(service, cases)
        offline = load(tiny_artifact_dir, threads=1)
        for (texts, opts), got in zip(cases, answers, strict=True):
            assert [g.tokens for g in got] == [w.tokens for w in offline.translate(texts, **opts)]


@pytest.mark.parametrize("engine", ENGINES)
def test_prefixed_requests_beside_others_get_their_offline_translations(tiny_artifact_dir, engine):
    """Requests with target prefixes (forced through them in the running batch beside free rows) get what offline
    translation with the same prefixes gives; a bad prefix is an InputError naming the field and sentence."""
    from transduce.errors import InputError
    from transduce.runtime.api import load

    with _started(tiny_artifact_dir, engine, max_rows=32) as service:
        prefixes = ["two", None, "three four", "", "one", [5, 6]]
        cases = [(TEXTS, {"beam_size": 1}, prefixes), (TEXTS, {"beam_size": 3}, prefixes[::-1]), (TEXTS, {}, None)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            reqs = list(pool.map(lambda c: service.submit(c[0], c[1], prefixes=c[2]), cases))
        offline = load(tiny_artifact_dir, threads=1)
        for req, (texts, opts, pre) in zip(reqs, cases, strict=True):
            req.finished.wait()
            assert req.error is None
            want = offline.translate(texts, prefixes=pre, **opts)
            assert [t.tokens for t in req.translations] == [w.tokens for w in want]
        # sentences are numbered as `text` indexes them, from 0, in the message and in `sentence` alike
        with pytest.raises(InputError, match="the prefix of sentence 1 has token id 2") as e:
            service.submit(TEXTS, {}, prefixes=[None, [2], None, None, None, None])
        assert e.value.field == "prefix" and e.value.sentence == 1


@pytest.mark.parametrize("engine", ENGINES)
def test_repetition_options_over_the_service_equal_offline(tiny_artifact_dir, engine):
    """suppress (texts, resolved to token ids by the service), no_repeat_ngram_size and repetition_penalty in a
    request give offline translation's output; a bad suppress is an InputError naming it."""
    from transduce.errors import InputError
    from transduce.runtime.api import load

    with _started(tiny_artifact_dir, engine, max_rows=32) as service:
        opts = {"suppress": ["the", [5, 6]], "no_repeat_ngram_size": 2, "repetition_penalty": 1.3, "beam_size": 2}
        got = service.translate(TEXTS, opts)
        want = load(tiny_artifact_dir, threads=1).translate(TEXTS, **opts)
        assert [g.tokens for g in got] == [w.tokens for w in want]
        with pytest.raises(InputError, match="suppress must be a list") as e:
            service.translate(TEXTS, {"suppress": "the"})
        assert e.value.params == ("suppress",)


def test_the_continuous_scheduler_over_cuda_graph_slabs(tiny_artifact_dir, tiny_model):
    """Concurrent clients on the CUDA-graph backend (its capture double on the CPU): each gets offline
    decoding's translations while the running batch admits and retires rows in its slabs."""
    import os

    from cuda_graph_fake import HostCapturer

    from transduce.models.tokenizer import Tokenizer
    from transduce.runtime.api import load
    from transduce.runtime.backends.torch_graph_backend import TorchGraphBackend
    from transduce.runtime.translator import Translator
    from transduce.serve.service import DecodeService, ServiceOptions

    tokenizer = Tokenizer.from_file(os.path.join(tiny_artifact_dir, "tokenizer.json"))
    backend = TorchGraphBackend(tiny_model, "cpu", _capturer=HostCapturer())
    service = DecodeService(Translator(backend, tokenizer), ServiceOptions(max_rows=32))
    service.start()
    try:
        cases = [(TEXTS[j:] + TEXTS[:j], {"beam_size": 1 + j % 3}) for j in range(6)]
        answers = _concurrently(service, cases)
        offline = load(tiny_artifact_dir, backend="torch")
        for (texts, opts), got in zip(cases, answers, strict=True):
            want = offline.translate(texts, **opts)
            assert [g.tokens for g in got] == [w.tokens for w in want]
            np.testing.assert_allclose([g.score for g in got], [w.score for w in want], atol=1e-4)
    finally:
        service.stop()
    assert backend.stats.replays > backend.stats.captures > 0


def test_the_service_says_which_precision_and_graphs_it_runs(tiny_artifact_dir, monkeypatch):
    """...and tokenizes without the tokenizers library's thread pool (more CPU on the model's cores), unless the
    environment says otherwise."""
    import os

    from transduce.runtime.spec import BackendSpec
    from transduce.serve.server import build_service

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    service, ident = build_service(tiny_artifact_dir, BackendSpec("torch", threads=1, precision="bf16"))
    service.stop()
    assert (ident["backend"], ident["precision"], ident["cuda_graph"]) == ("torch", "bf16", False)
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"


@pytest.mark.parametrize("engine", ENGINES)
def test_a_request_past_its_deadline_is_told_the_timeout_it_asked_for(tiny_artifact_dir, engine):
    """The 504's message gives the request's own timeout (however small), never a negative one."""
    from transduce.serve.service import ServeError

    with _started(tiny_artifact_dir, engine) as service:
        with pytest.raises(ServeError, match=r"passed its deadline of 1e-06 s") as e:
            service.translate(["one two three"] * 4, {"beam_size": 4}, timeout=1e-6)
        assert e.value.status == 504


def test_a_mapping_is_not_a_list_of_sentences(tiny_artifact_dir):
    from transduce.errors import InputError
    from transduce.runtime.api import load

    translator = load(tiny_artifact_dir, threads=1)
    with pytest.raises(InputError, match=r"takes a list of sentences, not an object \(dict\)"):
        translator.translate({"one": 1})


@pytest.mark.parametrize("engine", ENGINES)
def test_alignments_through_the_service_and_the_http_api_are_offline_decodings(tiny_artifact_dir, engine):
    """Requests with return_attention beside one without: the service's alignments and attention are offline
    translation's; POST /v1/translate answers each candidate's "alignment" (and "attention", the matrix, only
    with return_attention; replace_unknowns alone gives the alignment), none without."""
    from starlette.testclient import TestClient

    from transduce.runtime.api import load
    from transduce.serve.app import create_app

    with _started(tiny_artifact_dir, engine, max_rows=32) as service:
        cases = [(TEXTS, {"beam_size": 2, "return_attention": True, "max_len_b": 6}),
                 (TEXTS[::-1], {"beam_size": 1, "max_len_b": 6}),
                 (TEXTS[1:], {"beam_size": 1, "return_attention": True, "alignment_layer": 0, "max_len_b": 6})]
        answers = _concurrently(service, cases)
        offline = load(tiny_artifact_dir, threads=1)
        for (texts, opts), got in zip(cases, answers, strict=True):
            want = offline.translate(texts, **opts)
            assert [g.tokens for g in got] == [w.tokens for w in want]
            assert [g.alignment for g in got] == [w.alignment for w in want]
            for g, w in zip(got, want, strict=True):
                if w.attention is None:
                    assert g.attention is None
                else:
                    np.testing.assert_allclose(g.attention, w.attention, atol=1e-5)
        client = TestClient(create_app(service, {"id": "tiny"}))
        body = client.post("/v1/translate", json={"text": TEXTS[:2], "return_attention": True,
                                                  "max_len_b": 6}).json()
        want = offline.translate(TEXTS[:2], return_attention=True, max_len_b=6)
        for t, w in zip(body["translations"], want, strict=True):
            assert t["alignment"] == [list(p) for p in w.alignment] == t["nbest"][0]["alignment"]
            np.testing.assert_allclose(t["attention"], w.attention, atol=1e-5)
        body = client.post("/v1/translate", json={"text": TEXTS[:1], "replace_unknowns": True}).json()
        assert "alignment" in body["translations"][0] and "attention" not in body["translations"][0]
        body = client.post("/v1/translate", json={"text": TEXTS[:1]}).json()
        assert "alignment" not in body["translations"][0] and "alignment" not in body["translations"][0]["nbest"][0]


def test_alignments_the_model_or_artifact_cannot_give_are_refused_at_submit(tiny_artifact_dir, tmp_path):
    """An alignment_layer past the decoder's layers is an InputError naming it; an artifact without the attention
    step graph is a 400 whose hint re-exports it; both before anything is queued."""
    import json
    import os
    import shutil

    from transduce.errors import InputError
    from transduce.runtime.api import load
    from transduce.serve.service import DecodeService, ServeError

    service = DecodeService(load(tiny_artifact_dir, threads=1))
    with pytest.raises(InputError, match="alignment_layer 9 is past") as info:
        service.submit(["one"], {"return_attention": True, "alignment_layer": 9})
    assert info.value.params == ("alignment_layer",)
    old = tmp_path / "old"
    shutil.copytree(tiny_artifact_dir, old)
    os.remove(old / "decoder_step.attn.onnx")
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["files"]["decoder_step.attn.onnx"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    service = DecodeService(load(str(old), threads=1))
    with pytest.raises(ServeError, match="has no decoder_step.attn.onnx") as info:
        service.submit(["one"], {"replace_unknowns": True})
    assert info.value.status == 400 and "transduce export" in info.value.hint
    assert service.queue_depth() == 0


def test_the_service_asks_the_running_batch_whether_each_request_fits_before_admitting_it(tiny_artifact_dir):
    """A backend with fixed ranges (TensorRT's profiles) takes some sources into a running state and not others:
    the service asks with the queued request's own sources, and one that does not fit waits for an empty batch
    instead of failing (a 503 from admit's refusal)."""
    with _started(tiny_artifact_dir) as service:
        batch = service.batch
        real, asked = batch.can_admit, []

        def can_admit(src_ids=None):
            asked.append(src_ids)
            return real(src_ids) and (src_ids is None or src_ids.shape[1] < 6 or not batch.cohorts)

        batch.can_admit = can_admit
        long_text = "seventy-one thousand, two hundred and five"
        got = _concurrently(service, [([long_text], {"beam_size": 1}), (["one"], {"beam_size": 4})] * 3)
    offline = [service.translator.translate([t], beam_size=b)[0].text
               for t, b in [(long_text, 1), ("one", 4)] * 3]
    assert [g[0].text for g in got] == offline
    assert asked and all(a is not None for a in asked)


def _held(service) -> int:
    """After one admission pass of the (unstarted) service's decode loop: how many requests still wait."""
    service._admit()
    return len(service._queue)


@pytest.mark.parametrize("ratio, steps", [(0.5, 3), (0.0, 3), (0.5, 0)])
def test_queued_requests_join_a_running_batch_by_ratio_or_after_join_steps(tiny_artifact_dir, ratio, steps):
    """Beside a running batch, queued requests whose rows are under join_ratio of its rows wait until the oldest
    has waited join_steps steps (TGI's rule); more rows join at once, and so does anything for an empty batch."""
    from transduce.runtime.api import load
    from transduce.serve.service import DecodeService, ServiceOptions

    service = DecodeService(load(tiny_artifact_dir, threads=1), ServiceOptions(join_ratio=ratio, join_steps=steps))
    long = {"beam_size": 1, "min_length": 12}  # runs past the steps below
    texts = [["one two three", "four", "five six", "seven"], ["eight"], ["nine", "ten", "eleven"]]
    reqs = [service.submit(texts[0], long)]
    assert _held(service) == 0 and service.batch.rows == 4  # an empty batch takes it at once
    reqs.append(service.submit(texts[1], long))  # 1 row < 0.5 x 4
    holds = ratio > 0 and steps > 0
    for _ in range(steps):
        assert _held(service) == (1 if holds else 0)
        service._step()
    assert _held(service) == 0 and service.batch.rows == 5  # waited join_steps steps (or never held)
    reqs.append(service.submit(texts[2], long))  # 3 rows >= 0.5 x 5: at once
    assert _held(service) == 0 and service.batch.rows == 8
    while service.batch.cohorts:
        service._step()
    for req, given in zip(reqs, texts, strict=True):
        assert [t.tokens for t in req.translations] == [t.tokens for t in service.translator.translate(given, **long)]


def test_a_request_s_options_are_made_once_per_distinct_set_and_checked_by_type(tiny_artifact_dir, monkeypatch):
    """Requests naming the same options share one DecodingOptions (made and checked once); a value equal to a
    cached one but of another type (true for 1) is still checked, and refused; a list (unhashable) is made
    each time."""
    from transduce.errors import InputError
    from transduce.runtime.api import load
    from transduce.serve import service as module
    from transduce.serve.service import DecodeService

    made, real = [], module.request_options
    monkeypatch.setattr(module, "request_options", lambda *a: made.append(a[2]) or real(*a))
    service = DecodeService(load(tiny_artifact_dir, threads=1))
    first = service.decoding_options({"beam_size": 1})
    assert service.decoding_options({"beam_size": 1}) is first and first.beam_size == 1 and len(made) == 1
    assert service.decoding_options({"beam_size": 2}).beam_size == 2 and len(made) == 2
    with pytest.raises(InputError, match="beam_size") as info:
        service.decoding_options({"beam_size": True})
    assert info.value.params[0] == "beam_size"
    listed = service.decoding_options({"suppress": [[5]]})
    assert listed.suppress == ((5,),) and service.decoding_options({"suppress": [[5]]}) == listed


def _unstarted(artifact_dir: str, **options):
    from transduce.runtime.api import load
    from transduce.serve.service import DecodeService, ServiceOptions

    return DecodeService(load(artifact_dir, threads=1), ServiceOptions(**options))


def test_beam_requests_admitted_together_with_the_same_options_share_one_cohort(tiny_artifact_dir):
    """One admission of beam requests with equal options makes one cohort (its bookkeeping one numpy pass a step,
    not one per request); a request with other options, and a greedy one, get their own; every request gets
    offline decoding's translations, and its own."""
    service = _unstarted(tiny_artifact_dir)
    beam, other, greedy = {"beam_size": 3}, {"beam_size": 3, "length_penalty": 1.0}, {"beam_size": 1}
    cases = [(["one two three", "four"], beam), (["seven thousand and one"], beam), (["", "twelve"], beam),
             (["nine"], other), (["five six"], beam), (["eight"], greedy), (["ten"], greedy)]
    reqs = [service.submit(texts, opts) for texts, opts in cases]
    service._admit()
    assert len(service.batch.cohorts) == 5  # [3 beam requests] [other] [beam] [greedy] [greedy]
    assert [r.cohort for r in reqs[:3]] == [service.batch.cohorts[0]] * 3 and reqs[4].cohort is not reqs[0].cohort
    while service.batch.cohorts:
        service._step()
    for req, (texts, opts) in zip(reqs, cases, strict=True):
        want = service.translator.translate(texts, **opts)
        assert req.finished.is_set() and req.error is None
        assert [t.tokens for t in req.translations] == [w.tokens for w in want]
        np.testing.assert_allclose([t.score for t in req.translations], [w.score for w in want], atol=1e-5)


def test_a_request_dropped_from_a_shared_cohort_takes_only_its_own_rows(tiny_artifact_dir):
    """A request past its deadline (or whose client left) in a cohort it shares with others: its rows leave the
    batch at once, it gets its error, and the others go on to offline decoding's translations."""
    from transduce.serve.service import ServeError

    service = _unstarted(tiny_artifact_dir)
    beam = {"beam_size": 2, "min_length": 6}  # still decoding after the steps below
    cases = [["one two three", "four"], ["seven thousand and one"], ["five six"]]
    reqs = [service.submit(texts, beam) for texts in cases]
    service._admit()
    assert len(service.batch.cohorts) == 1
    for _ in range(3):
        service._step()
    rows = service.batch.rows
    service._drop(reqs[1], ServeError("gone", 499))
    assert service.batch.rows == rows - 2 and reqs[1].error.status == 499 and reqs[1].finished.is_set()
    while service.batch.cohorts:
        service._step()
    for i in (0, 2):
        want = service.translator.translate(cases[i], **beam)
        assert reqs[i].error is None and [t.tokens for t in reqs[i].translations] == [w.tokens for w in want]
    service._drop(reqs[2], ServeError("late", 504))  # a finished request: nothing to drop
    assert reqs[2].error is None


@pytest.mark.parametrize("engine", ENGINES)
def test_a_full_queue_refuses_only_requests_whose_rows_would_wait(tiny_artifact_dir, engine):
    """A burst of requests beyond max_queue whose rows all fit the batch is taken (the batch takes them at
    once: no overload), in-process and across the engine process's pipe (whose submits are in flight before the
    engine counts them); a request whose rows do not fit beside those taken is refused while the queue is full."""
    from transduce.serve.service import ServeError

    if engine == "thread":  # unstarted: nothing leaves the queue, so it stays full
        service = _unstarted(tiny_artifact_dir, max_queue=2, max_rows=8)
        reqs = [service.submit(["one two"], {"beam_size": 2}) for _ in range(4)]  # 8 rows: they fit
        assert service.queue_depth() == 4
        # a ninth row and a tenth wait (the four join at once: not waiting), an eleventh would be the third
        reqs += [service.submit(["three"], {"beam_size": 1}) for _ in range(2)]
        with pytest.raises(ServeError, match="queue is full") as info:
            service.submit(["three"], {"beam_size": 1})
        assert info.value.status == 429
        while service._queue or service.batch.cohorts:
            service._admit()
            service._step()
        assert all(r.finished.is_set() and r.error is None for r in reqs)
        service.submit(["three"], {"beam_size": 1})  # rows free again: taken
        return
    from transduce.runtime.api import load

    with _started(tiny_artifact_dir, engine, max_queue=1, max_rows=64) as service:
        reqs = [service.submit([text], {"beam_size": 1}) for text in TEXTS * 4]  # sent faster than counted
        assert all(r.finished.wait(60) for r in reqs) and [r.error for r in reqs] == [None] * len(reqs)
    want = load(tiny_artifact_dir, threads=1).translate(TEXTS * 4, beam_size=1)
    assert [r.translations[0].text for r in reqs] == [w.text for w in want]


def test_the_front_end_counts_as_waiting_only_the_submits_that_will_wait():
    """Submits the engine process has not taken yet count as waiting only where they will: behind a queue all of
    them, else those past the rows the batch has free (the first into an empty batch joins whatever its rows)."""
    from transduce.runtime.spec import BackendSpec
    from transduce.serve.engine import EngineClient
    from transduce.serve.service import ServiceOptions

    client = EngineClient("unused", BackendSpec(), ServiceOptions(max_rows=8), engines=1)  # never started
    e = client.engines[0]
    assert client.queue_depth() == 0
    e.rows, e.untaken = 24, collections.deque([8, 8, 8])  # nothing running yet: the first joins, two wait
    assert client.queue_depth() == 2
    e.rows, e.untaken = 16, collections.deque([4, 4, 4, 4])  # 8 rows running: four of 4 rows, two wait
    assert client.queue_depth() == 2
    e.rows = 20  # 4 rows running: one joins
    assert client.queue_depth() == 3
    e.rows, e.untaken = 16, collections.deque([16])  # more than a batch takes, into an empty one: it joins
    assert client.queue_depth() == 0
    e.depth = 1  # a queue: everything not taken waits behind it
    assert client.queue_depth() == 2


def test_the_process_engine_refuses_only_past_max_queue_waiting(tiny_artifact_dir):
    """A burst of requests each as wide as the batch, sent before the engine process counts them: one runs,
    max_queue wait, the next is refused (the front end had counted the one that runs as waiting too)."""
    from transduce.serve.service import ServeError

    with _started(tiny_artifact_dir, "process", max_queue=2, max_rows=8) as service:
        slow = {"beam_size": 8, "min_length": 40, "max_len_b": 45}
        reqs = [service.submit(["one two three"], slow) for _ in range(3)]
        with pytest.raises(ServeError, match="queue is full"):
            service.submit(["one two three"], slow)
        assert all(r.finished.wait(120) for r in reqs) and [r.error for r in reqs] == [None] * 3


class _NoThreads(concurrent.futures.ThreadPoolExecutor):
    """An event loop's default executor that refuses work: what runs under it takes no worker thread."""

    def submit(self, fn, *args, **kwargs):
        raise AssertionError(f"{fn} was sent to a thread")


@pytest.mark.parametrize("engine", ENGINES)
def test_score_requests_are_awaited_on_the_event_loop_without_a_thread_each(tiny_artifact_dir, engine):
    """Score requests from an event loop (POST /v1/score) wait for the decode thread without holding a worker
    thread each (a thread pool of a few workers capped how many could be under way): many at once, none sent to
    the loop's executor, each equal to the blocking call's and offline scoring's."""
    import orjson

    from transduce.runtime.api import load
    from transduce.serve.app import create_app

    targets = [t.text for t in load(tiny_artifact_dir, threads=1).translate(TEXTS, beam_size=1)]
    want = load(tiny_artifact_dir, threads=1).score(TEXTS, targets, length_penalty=1.0)
    with _started(tiny_artifact_dir, engine) as service:
        app = create_app(service, {"id": "tiny"})

        async def posted(body: dict) -> tuple[int, dict]:
            sent: list[dict] = []
            received = [{"type": "http.request", "body": orjson.dumps(body), "more_body": False}]

            async def receive():
                return received.pop(0) if received else await asyncio.Event().wait()

            async def send(message):
                sent.append(message)

            scope = {"type": "http", "method": "POST", "path": "/v1/score", "headers": []}
            await app(scope, receive, send)
            return sent[0]["status"], orjson.loads(sent[1]["body"])

        async def main():
            asyncio.get_running_loop().set_default_executor(_NoThreads())
            direct = await asyncio.gather(*(service.score_async(TEXTS, targets, {"length_penalty": 1.0})
                                            for _ in range(12)))
            routed = await asyncio.gather(*(posted({"source": TEXTS, "target": targets, "length_penalty": 1.0})
                                            for _ in range(12)))
            return direct, routed

        direct, routed = asyncio.run(main())
        blocking = service.score(TEXTS, targets, {"length_penalty": 1.0})
    assert all([s.tokens for s in got] == [s.tokens for s in blocking] for got in direct)
    for got in direct:
        np.testing.assert_allclose([s.log_prob for s in got], [w.log_prob for w in want], atol=1e-5)
    for status, body in routed:
        assert status == 200, body
        np.testing.assert_allclose([s["score"] for s in body["scores"]], [w.score for w in want], atol=1e-5)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_score_request_given_up_before_its_turn_leaves_the_service_running(tiny_artifact_dir, engine):
    """A score request whose caller gave up (its awaiting task cancelled: the job's future cancelled) before the
    decode thread got to it is skipped; the decode thread (and the engine's reader) go on."""
    targets = ["un deux", "douze"]
    with _started(tiny_artifact_dir, engine) as service:
        # in-process, the decode thread cannot take the job before it is cancelled; an engine's reply comes later
        with service._lock if engine == "thread" else contextlib.nullcontext():
            job = service._score_job(*service._score_pairs(TEXTS[:2], targets, {}, False))
            assert job.cancel()
        # the next one is answered: the decode thread is alive (a dead one never answers: bounded here)
        got = service._score_job(*service._score_pairs(TEXTS[:2], targets, {}, False)).result(timeout=60)
        assert service.alive() and len(got) == 2
