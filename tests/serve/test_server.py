"""`transduce serve` as a client sees it: a real uvicorn process on 127.0.0.1, real sockets (httpx)."""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import time

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

from tests.serve.conftest import KEY, SLOW, Server, sse_events
from transduce.cli import main

AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = ["one two three", "four hundred and five", "", "twelve", "seven thousand and one", "nine"]


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


def _metric(url: str, name: str) -> float:
    return _value(httpx.get(url + "/metrics", headers=AUTH).text, name)


async def _until(client: httpx.AsyncClient, name: str, check, pending=(), timeout: float = 60.0) -> None:
    """Poll the server's /metrics until `name`'s value passes `check`; none of the requests `pending` may be
    answered meanwhile."""
    end = time.monotonic() + timeout
    while not check(_value((await client.get("/metrics")).text, name)):
        assert not any(task.done() for task in pending), f"answered before {name} was reached"
        assert time.monotonic() < end, f"timed out waiting for {name}"
        await asyncio.sleep(0.02)


def _wait_for(check, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_concurrent_requests_get_what_offline_decoding_gives(server, long_artifact_dir):
    """Requests of different options at once, sentences of each admitted beside the others': every answer is
    its own sentences' offline translation (tokens identical, scores within 1e-5), blank lines included."""
    from transduce.runtime.api import load

    cases = [dict(beam_size=1), dict(beam_size=3, nbest=2, length_penalty=1.0, early_stopping="k-finished"),
             dict(beam_size=2, min_length=4, early_stopping="k-finished", patience=2.5),
             dict(beam_size=4, nbest=4, max_len_b=7, early_stopping="exact")]
    shifted = [TEXTS[j:] + TEXTS[:j] for j in range(len(cases))]  # different sentences side by side

    async def send_all():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/translate", json={"text": texts, **opts})
                                          for texts, opts in zip(shifted, cases, strict=True)))

    answers = asyncio.run(send_all())
    translator = load(long_artifact_dir, threads=1)
    for texts, opts, answer in zip(shifted, cases, answers, strict=True):
        assert answer.status_code == 200, answer.text
        got = answer.json()["translations"]
        want = translator.translate(texts, **opts)
        assert [[c["tokens"] for c in g["nbest"]] for g in got] == [[list(c.tokens) for c in w.nbest] for w in want]
        assert [g["text"] for g in got] == [w.text for w in want]
        np.testing.assert_allclose([c["score"] for g in got for c in g["nbest"]],
                                   [c.score for w in want for c in w.nbest], atol=1e-5)
        assert [g["empty"] for g in got] == [t == "" for t in texts]


def test_score_requests_get_what_offline_scoring_gives(server, long_artifact_dir):
    """POST /v1/score beside translation requests: each target's teacher-forced score is Translator.score's; bad
    score requests are 400s naming the field (and the pair), and the server goes on."""
    from transduce.runtime.api import load

    translator = load(long_artifact_dir, threads=1)
    targets = [t.text for t in translator.translate(TEXTS, beam_size=1)]

    async def send_all():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            return await asyncio.gather(
                client.post("/v1/score", json={"source": TEXTS, "target": targets, "length_penalty": 1.0}),
                client.post("/v1/translate", json={"text": TEXTS, "beam_size": 2}))

    scored, translated = asyncio.run(send_all())
    assert scored.status_code == 200 and translated.status_code == 200, (scored.text, translated.text)
    want = translator.score(TEXTS, targets, length_penalty=1.0)
    got = scored.json()["scores"]
    assert [g["tokens"] for g in got] == [list(w.tokens) for w in want]
    np.testing.assert_allclose([g["log_prob"] for g in got], [w.log_prob for w in want], atol=1e-5)
    np.testing.assert_allclose([g["score"] for g in got], [w.score for w in want], atol=1e-5)
    for body, field, sentence, message in [
        ({"target": ["a"]}, "source", None, "the field 'source' (a list of sentences) is missing"),
        ({"source": ["a", "b"], "target": ["x"]}, "target", None, "source has 2 sentences and target 1"),
        ({"source": ["a"], "target": [3]}, "target", 0, "sentence 0 is an int (3), not a str"),
        ({"source": ["a"], "target": ["x"], "beam_size": 2}, "beam_size", None, "unknown field 'beam_size'"),
        ({"source": "a", "target": ["x"]}, "source", None, "source takes a list of sentences, not one string"),
        ({"source": ["a"], "target": ["x"], "length_penalty": [[[[[1.0]]]]]}, "length_penalty", None,
         "length_penalty is a list nested more than 3 deep"),
        ({"source": ["a"], "target": ["x"], "truncate": "false"}, "truncate", None, "truncate must be true or false"),
    ]:
        r = httpx.post(server.url + "/v1/score", headers=AUTH, json=body, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert message in err["message"] and err.get("field") == field and err.get("sentence") == sentence, err
    assert httpx.get(server.url + "/healthz").status_code == 200


def test_streams_tokens_of_greedy_and_sentences_of_beam(server):
    r = httpx.post(server.url + "/v1/translate", headers=AUTH, timeout=60,
                   json={"text": ["one two", "three"], "beam_size": 1, "max_len_b": 5, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1][0] == "done"
    final = events[-1][1]["translations"]
    for i, t in enumerate(final):  # the tokens streamed for each sentence are its translation's, in order
        assert [d["token"] for k, d in events if k == "token" and d["sentence"] == i] == t["tokens"]
        assert [d["translation"] for k, d in events if k == "translation" and d["sentence"] == i] == [t]
    r = httpx.post(server.url + "/v1/translate", headers=AUTH, timeout=60,
                   json={"text": ["one two", "three"], "beam_size": 3, "stream": True})
    kinds = [k for k, _ in sse_events(r.text)]
    assert kinds.count("translation") == 2 and "token" not in kinds and kinds[-1] == "done"
    # a blank line gets its translation event too (first: it needs no decoding), alone or beside others
    for text in (["", "three", "  "], [""]):
        r = httpx.post(server.url + "/v1/translate", headers=AUTH, timeout=60,
                       json={"text": text, "beam_size": 2, "stream": True})
        events = sse_events(r.text)
        said = sorted(d["sentence"] for k, d in events if k == "translation")
        assert said == list(range(len(text))) and events[-1][0] == "done", events
        blank = [d for k, d in events if k == "translation" and text[d["sentence"]].strip() == ""]
        assert all(d["translation"]["empty"] for d in blank)


@pytest.mark.parametrize("body, status, field, sentence, message", [
    ({"text": ["one", 5]}, 400, "text", 1, "sentence 1 is an int (5), not a str"),
    ({"text": ["one", "two " * 600]}, 400, "text", 1, "input line 1 has 600 tokens; this model takes at most 511"),
    ({"text": "one"}, 400, "text", None, "text takes a list of sentences, not one string"),
    ({"text": {"one": 1}}, 400, "text", None, "text takes a list of sentences, not an object (dict)"),
    ({"text": None}, 400, "text", None, "text takes a list of sentences, got None"),
    ({"text": ["one"], "beam_size": functools.reduce(lambda x, _: [x], range(600), 4)}, 400, "beam_size", None,
     "beam_size nests lists or objects more than 8 deep"),
    ({"text": ["one"], "beam_size": [[[[[4]]]]]}, 400, "beam_size", None, "beam_size is a list nested more than 3"),
    ({"text": []}, 400, "text", None, "text is empty"),
    ({"text": ["a"] * 9}, 400, "text", None, "text has 9 sentences; this server takes at most 8"),
    ({"text": ["one"], "beam_size": 0}, 400, "beam_size", None, "beam_size must be >= 1, got 0"),
    ({"text": ["one"], "beam_size": 2, "nbest": 3}, 400, "nbest", None, "nbest must be between 1 and beam_size"),
    ({"text": ["one"], "max_len_a": "x"}, 400, "max_len_a", None, "max_len_a must be a finite number"),
    ({"text": ["one"], "early_stopping": True}, 400, "early_stopping", None, "early_stopping must be one of"),
    ({"text": ["one"], "patience": 0}, 400, "patience", None, "patience must be > 0, got 0"),
    ({"text": ["one"], "timeout": -1}, 400, "timeout", None, "timeout must be a number of seconds > 0"),
    ({"text": ["one"], "length_penalty": 1e300}, 400, "length_penalty", None, "overflows the length normalisation"),
    ({"text": ["one"], "colour": "red"}, 400, "colour", None, "unknown field 'colour'"),
    ({"txt": ["one"]}, 400, "txt", None, "unknown field 'txt'"),
    ({"text": ["one"], "stream": "yes"}, 400, "stream", None, "stream must be true or false"),
    ({"text": ["x" * 5000]}, 413, None, None, "this server takes at most 4096"),
])
def test_bad_input_is_a_4xx_naming_the_field_and_sentence(server, body, status, field, sentence, message):
    r = httpx.post(server.url + "/v1/translate", headers=AUTH, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] and err.get("field") == field and err.get("sentence") == sentence


def test_a_websocket_upgrade_is_plain_http(server):
    """An Upgrade: websocket request is answered as any HTTP request is (uvicorn took it for a websocket, which the
    app does not speak, and answered a plain-text 500)."""
    ws = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
          "Sec-WebSocket-Version": "13", **AUTH}
    r = httpx.get(server.url + "/v1/translate", headers=ws, timeout=30)
    assert r.status_code == 405 and "GET is not allowed" in r.json()["error"]["message"], r.text
    assert httpx.get(server.url + "/healthz", headers=ws, timeout=30).json() == {"status": "ok"}


def test_a_body_that_is_not_json_and_the_service_after_every_bad_request(server):
    r = httpx.post(server.url + "/v1/translate", headers=AUTH, content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/translate", headers=AUTH, content=b"\xff\xfe", timeout=30)
    assert r.status_code == 400
    assert httpx.get(server.url + "/healthz").status_code == 200  # nothing reached the decode thread
    r = httpx.post(server.url + "/v1/translate", headers=AUTH, json={"text": ["one"], "beam_size": 1}, timeout=30)
    assert r.status_code == 200 and len(r.json()["translations"]) == 1


def test_every_endpoint_but_healthz_needs_the_bearer_token(server):
    assert httpx.get(server.url + "/healthz").status_code == 200
    for method, path in (("GET", "/readyz"), ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/translate"),
                         ("POST", "/v1/score")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, server.url + path, headers=headers, json={"text": ["one"]})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, headers)
    model = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]
    assert model["precision"] == "fp32" and model["backend"] == "onnxruntime" and len(model["manifest_sha256"]) == 64
    assert model["cuda_graph"] is False
    assert model["contract_version"] >= 1
    assert KEY not in server.output()


def test_a_full_queue_is_429_with_retry_after_and_a_deadline_504_frees_the_rows(wide_server):
    """Slow requests of 64 rows: one runs, four wait (the queue holds 4), the sixth is refused. Their deadline
    passes under way: 504, and the batch is empty again."""
    server = wide_server
    # the deadline leaves a busy machine seconds to queue the next five; the wide model's decode takes several
    # times as long, even on a fast machine
    slow = {"text": ["one two three"] * 8, **SLOW, "timeout": 3.0}

    async def flood():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            first = asyncio.create_task(client.post("/v1/translate", json=slow))
            await _until(client, "transduce_live_rows", lambda rows: rows > 0, [first])  # it is running
            waiting = [asyncio.create_task(client.post("/v1/translate", json=slow)) for _ in range(4)]
            # the next four wait for its rows
            await _until(client, "transduce_queue_depth", lambda depth: depth == 4, [first, *waiting])
            refused = await client.post("/v1/translate", json=slow)
            return refused, await first, await asyncio.gather(*waiting)

    timed_out = _metric(server.url, "transduce_requests_timed_out_total")
    refused, first, waiting = asyncio.run(flood())
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert "queue is full" in refused.json()["error"]["message"]
    assert first.status_code == 504 and "deadline" in first.json()["error"]["message"]
    assert {r.status_code for r in waiting} == {504}
    assert _metric(server.url, "transduce_requests_timed_out_total") == timed_out + 5
    _wait_for(lambda: _metric(server.url, "transduce_live_rows") == 0)
    assert _metric(server.url, "transduce_queue_depth") == 0
    assert _metric(server.url, "transduce_requests_rejected_total") >= 1


def test_a_client_that_leaves_frees_its_rows(wide_server):
    server = wide_server  # its request is still under way when the client leaves, however fast the machine
    cancelled = _metric(server.url, "transduce_requests_cancelled_total")
    for stream in (False, True):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/translate", headers=AUTH, timeout=0.5,
                       json={"text": ["one two three"] * 8, **SLOW, "stream": stream})
        _wait_for(lambda: _metric(server.url, "transduce_live_rows") == 0)
    assert _metric(server.url, "transduce_requests_cancelled_total") == cancelled + 2
    r = httpx.post(server.url + "/v1/translate", headers=AUTH, json={"text": ["one"]}, timeout=30)
    assert r.status_code == 200
    # each one logged, the non-streamed one too (no response reached uvicorn's access log)
    _wait_for(lambda: server.output().count("the client left before its answer") >= 2)


def test_unknown_routes_and_methods_answer_in_the_documented_error_shape(server):
    r = httpx.post(server.url + "/v1/translat", headers=AUTH, json={"text": ["one"]}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["message"] == "no such endpoint: POST /v1/translat"
    assert "POST /v1/translate" in r.json()["error"]["hint"]
    r = httpx.get(server.url + "/v1/translate", headers=AUTH, timeout=30)
    assert r.status_code == 405 and r.json()["error"] == {
        "message": "GET is not allowed on /v1/translate", "status": 405,
        "hint": "POST /v1/translate, /v1/score; GET /v1/models, /healthz, /readyz, /metrics"}


def test_metrics_count_what_happened(server):
    before = _metric(server.url, "transduce_sentences_finished_total")
    runs, admitted = (_metric(server.url, f"transduce_admission_sentences_{k}") for k in ("count", "sum"))
    httpx.post(server.url + "/v1/translate", headers=AUTH, json={"text": ["one", "two"], "beam_size": 1}, timeout=30)
    assert _metric(server.url, "transduce_sentences_finished_total") == before + 2
    assert _metric(server.url, "transduce_admission_sentences_count") == runs + 1  # both in one encoder run
    assert _metric(server.url, "transduce_admission_sentences_sum") == admitted + 2
    for name in ("transduce_batch_rows_count", "transduce_time_to_first_token_seconds_count",
                 "transduce_request_latency_seconds_count", "transduce_generated_tokens_total",
                 "transduce_sentences_admitted_total"):
        assert _metric(server.url, name) > 0, name


@pytest.mark.parametrize("sig, engine", [(signal.SIGTERM, "thread"), (signal.SIGINT, "thread"),
                                         (signal.SIGTERM, "process")])
def test_a_signal_drains_then_exits_0(long_artifact_dir, tmp_path, sig, engine):
    """A request under way when the signal comes is answered in full; new connections are refused; exit 0 (the
    engine process, under --engine process, keeps stepping it meanwhile)."""
    s = Server(long_artifact_dir, tmp_path, "--grace", "30", "--engine", engine)
    try:
        s.wait_ready()

        async def run():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
                task = asyncio.create_task(client.post("/v1/translate", json={"text": ["one two"] * 4, **SLOW}))
                await _until(client, "transduce_live_rows", lambda rows: rows > 0, [task])  # under way
                s.proc.send_signal(sig)
                return await task

        answer = asyncio.run(run())
        assert answer.status_code == 200 and len(answer.json()["translations"]) == 4, (answer.text, s.output())
        assert all(len(t["tokens"]) == 500 for t in answer.json()["translations"])
        assert s.proc.wait(timeout=30) == 0, s.output()
        assert "drained" in s.output()
    finally:
        s.stop()


def _signalled_while_under_way(s: Server, body: dict, signals: list[int]) -> httpx.Response:
    """Send `body`, and once it is under way the signals, each after the server took in the one before."""
    async def run():
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as client:
            task = asyncio.create_task(client.post("/v1/translate", json=body))
            await _until(client, "transduce_live_rows", lambda rows: rows > 0, [task])  # under way
            for i, sig in enumerate(signals):
                if i:
                    _wait_for(lambda: "Shutting down" in s.output())  # uvicorn took in the first
                s.proc.send_signal(sig)
            return await task

    return asyncio.run(run())


@pytest.mark.parametrize("stream, engine", [(False, "thread"), (True, "thread"), (True, "process")])
def test_requests_still_running_when_the_grace_ends_are_answered_503(wide_artifact_dir, tmp_path, stream, engine):
    """--grace 1 and a request that needs longer: it gets the documented 503 (a stream its `error` event), the
    log one line for it, and the exit status says that work was cut."""
    s = Server(wide_artifact_dir, tmp_path, "--grace", "1", "--engine", engine)
    try:
        s.wait_ready()
        answer = _signalled_while_under_way(s, {"text": ["one two three"] * 8, **SLOW, "stream": stream},
                                            [signal.SIGTERM])
        if stream:
            kind, error = sse_events(answer.text)[-1]
            assert kind == "error" and error["error"]["status"] == 503, answer.text
        else:
            assert answer.status_code == 503, answer.text
            error = answer.json()
        assert "stopped before this request finished: its --grace of 1 s ended" in error["error"]["message"]
        assert s.proc.wait(timeout=30) == 1, s.output()
        out = s.output()
        assert out.count("cut short (8 sentence(s))") == 1 and "exiting 1" in out, out
        assert "Traceback" not in out and "Event loop is closed" not in out and "drained" not in out, out
    finally:
        s.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_stops_at_once(wide_artifact_dir, tmp_path, sig):
    s = Server(wide_artifact_dir, tmp_path, "--grace", "300")
    try:
        s.wait_ready()
        start = time.monotonic()
        answer = _signalled_while_under_way(s, {"text": ["one two three"] * 8, **SLOW}, [sig, sig])
        assert answer.status_code == 503 and "a second signal stopped the server" in answer.text, answer.text
        assert s.proc.wait(timeout=60) == 1, s.output()
        assert time.monotonic() - start < 120  # not the 300 s of --grace
        assert "Traceback" not in s.output() and "drained" not in s.output()
    finally:
        s.stop()


def test_loadtest_drives_a_server_and_writes_its_report(server, tmp_path):
    key = tmp_path / "key"
    key.write_text(KEY)
    out = tmp_path / "report"
    r = CliRunner().invoke(main,
                           ["loadtest", server.url, "--rates", "4,8", "--duration", "1", "--api-key-file", str(key),
                            "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "loadtest.json").read_text())
    assert [row["offered_rate"] for row in report["rows"]] == [4.0, 8.0]
    for row in report["rows"]:
        assert row["scheduler"] == "continuous" and row["sent"] >= 1 and row["answered"] == row["sent"]
        assert 0 < row["ttft_p50"] <= row["latency_p50"] <= row["latency_p99"]
    assert (out / "loadtest.png").stat().st_size > 0 and "| continuous | 4/s |" in (out / "loadtest.md").read_text()
    r = CliRunner().invoke(main, ["loadtest", server.url, "--out", str(out)])
    assert r.exit_code == 2 and "--force" in r.stderr


def test_loadtest_closed_loop_keeps_each_connection_busy(server, tmp_path):
    key = tmp_path / "key"
    key.write_text(KEY)
    out = tmp_path / "report"
    r = CliRunner().invoke(main, ["loadtest", server.url, "--connections", "1,3", "--duration", "1",
                                  "--api-key-file", str(key), "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "loadtest.json").read_text())
    assert [row["connections"] for row in report["rows"]] == [1, 3] and report["rates"] == []
    for row in report["rows"]:
        # each connection sends until the window closes: at least one request each, every one answered
        assert row["sent"] >= row["connections"] and row["answered"] == row["sent"] and row["offered_rate"] is None
    assert "| continuous | 3 conn |" in (out / "loadtest.md").read_text()
    for bad in ("0", "two"):
        r = CliRunner().invoke(main, ["loadtest", server.url, "--connections", bad, "--out", str(tmp_path / "x")])
        assert r.exit_code == 2 and "--connections" in r.stderr


@pytest.mark.parametrize("args, says", [
    (["--port", "99999"], "--port must be 0..65535, got 99999"),
    (["--max-body-bytes", "-5"], "--max-body-bytes must be an integer >= 1, got -5"),
    (["--grace", "-1"], "--grace must be a number of seconds >= 0, got -1"),
    (["--request-timeout", "0"], "--request-timeout must be a number of seconds > 0, got 0"),
    (["--default-beam-size", "1000"], "--default-beam-size 1000 takes more rows than --max-rows (256)"),
    (["--read-timeout", "0"], "--read-timeout must be a number of seconds > 0, got 0"),
    (["--keep-alive", "inf"], "--keep-alive must be a number of seconds > 0, got inf"),
    (["--languages", "en"], "--languages must be SRC:TGT (two codes), got 'en'"),
    (["--engine", "process", "--ray"], "--engine process is the single server's"),
    (["--ray", "--keep-alive", "9"], "--keep-alive is the single server's"),
    (["--ray", "--read-timeout", "0"], "--read-timeout must be a number of seconds > 0, got 0"),
    (["--ray", "--languages", "en"], "--languages must be SRC:TGT (two codes), got 'en'"),
    (["--engines", "-1"], "--engines must be an integer 0..64 (0: auto), got -1"),
    (["--engines", "2", "--engine", "thread"], "--engines 2: several engines are processes of their own"),
    (["--join-ratio", "-1"], "--join-ratio must be a number >= 0, got -1"),
    (["--join-steps", "-1"], "--join-steps must be an integer >= 0, got -1"),
    (["--fill-rows", "-1"], "--fill-rows must be an integer >= 0, got -1"),
    (["--idle-spin-ms", "-1"], "--idle-spin-ms must be a number >= 0, got -1"),
])
def test_bad_serve_options_are_refused_before_the_model_loads(tiny_artifact_dir, monkeypatch, args, says):
    from transduce.serve import server

    monkeypatch.setattr(server, "build_service", lambda *a, **k: pytest.fail("the model was loaded"))
    r = CliRunner().invoke(main, ["serve", tiny_artifact_dir, *args])
    assert r.exit_code == 2 and says in r.stderr and "Traceback" not in r.output, r.output


def test_a_port_in_use_is_refused_before_the_model_loads(tiny_artifact_dir, monkeypatch):
    import socket

    from transduce.serve import server

    monkeypatch.setattr(server, "build_service", lambda *a, **k: pytest.fail("the model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = CliRunner().invoke(main, ["serve", tiny_artifact_dir, "--port", str(port)])
    assert r.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.output


@pytest.mark.parametrize("args, says", [
    (["--rates", "nan"], "--rates must be finite numbers > 0"),
    (["--duration", "inf"], "--duration must be a finite number of seconds > 0"),
    (["--api-key-file", "/nonexistent/key"], "cannot read --api-key-file"),
])
def test_bad_loadtest_input_is_an_error_not_a_traceback(args, says, tmp_path):
    r = CliRunner().invoke(main, ["loadtest", "http://127.0.0.1:9", "--out", str(tmp_path / "r"), *args])
    assert r.exit_code == 2 and says in r.stderr and "Traceback" not in r.output, r.output


def test_an_unreachable_server_is_an_error_not_a_traceback(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = CliRunner().invoke(main, ["loadtest", f"http://127.0.0.1:{port}", "--duration", "1", "--out",
                                  str(tmp_path / "r")])
    assert r.exit_code == 2 and f"cannot reach http://127.0.0.1:{port}" in r.stderr, r.output
    assert not (tmp_path / "r").exists()


def test_a_server_that_needs_a_key_the_loadtest_has_not_is_an_error(server, tmp_path):
    r = CliRunner().invoke(main, ["loadtest", server.url, "--duration", "1", "--out", str(tmp_path / "r")])
    assert r.exit_code == 2 and "needs an API key" in r.stderr and "--api-key-file" in r.stderr, r.output
