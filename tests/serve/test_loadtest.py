"""`transduce loadtest`'s closed loop (transduce.serve.loadgen), its cost figures (transduce.serve.loadcost) and
wrk's script: the pieces alone, then against a real `transduce serve` of the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time

import pytest
from click.testing import CliRunner

from tests.serve.conftest import KEY
from transduce.cli import main
from transduce.serve import loadgen
from transduce.serve.loadcost import cpu_cost, cpu_seconds
from transduce.serve.loadtest import markdown, short_warmups, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_server_metrics_report_its_process_cpu_seconds():
    from transduce.serve.metrics import ServeMetrics

    body, _ = ServeMetrics().exposition()
    assert cpu_seconds(body.decode()) > 0  # this test process has used some CPU


def test_cpu_seconds_are_read_from_an_exposition_and_divided_per_request_and_sentence():
    text = "# HELP process_cpu_seconds_total Total\nprocess_cpu_seconds_total 12.5\nprocess_open_fds 9.0\n"
    assert cpu_seconds(text) == 12.5
    assert cpu_seconds("transduce_queue_depth 0.0\n") is None
    assert cpu_seconds('process_cpu_seconds_total{pid="1"} 3.0\n') == 3.0
    cost = cpu_cost((10.0, 2.0), (20.0, 5.0), lambda t0, t1: 60 if (t0, t1) == (10.0, 20.0) else 0, 4)
    assert cost == {"server_cpu_s": 3.0, "cpu_s_per_request": 0.05, "cpu_s_per_sentence": 0.0125}
    assert cpu_cost(None, (20.0, 5.0), lambda *_: 1, 1)["cpu_s_per_request"] is None
    assert cpu_cost((10.0, 2.0), (20.0, 2.0), lambda *_: 0, 1) == {"server_cpu_s": 0.0, "cpu_s_per_request": None,
                                                                    "cpu_s_per_sentence": None}


def test_a_closed_loop_window_whose_requests_outlast_its_warmup_is_told_to_warm_up_longer():
    def row(connections, p50, scheduler="continuous"):
        counted = [{"status": 200, "latency": p50, "ttft": None, "tokens": 3}] * 3
        return {"scheduler": scheduler, "cpu_s_per_request": None, "cpu_s_per_sentence": None,
                **summarize(counted, None if connections else 2.0, 10.0, 10.0, connections)}

    # seconds-long answers at 128 connections after a 2 s warm-up: the window opened on a load still building up
    report = {"plan": {"warmup": 2.0}, "rows": [row(128, 4.5), row(8, 0.4), row(None, 9.0)]}
    [said] = short_warmups(report)
    assert "continuous at 128 conn" in said and "4.5 s" in said and "2 s warm-up" in said
    assert said.endswith("--warmup 9 or more")
    assert markdown(report).count("Warning: ") == 1
    assert short_warmups({"plan": {"warmup": 5.0}, "rows": [row(128, 4.5)]}) == []  # the open loop has no warm-up
    assert "Warning" not in markdown({"plan": {"warmup": 5.0}, "rows": [row(128, 4.5)]})


def test_connections_are_spread_over_the_processes():
    assert loadgen.split_connections(5, 2) == [(0, 3), (3, 2)]
    assert loadgen.split_connections(64, 2) == [(0, 32), (32, 32)]
    assert loadgen.split_connections(1, 4) == [(0, 1)]


def test_the_records_of_every_process_merge_and_only_the_window_counts():
    # two processes' records: (start, end, status, tokens); the window is [10, 20]
    first = [(9.0, 10.5, 200, 5), (10.5, 11.0, 200, 6), (19.5, 20.5, 200, 7)]
    second = [(9.5, 9.9, 200, 4), (9.9, 12.0, 429, 0), (12.0, 13.0, "timeout", 0), (13.0, 14.0, 200, 8)]
    merged = loadgen.merge([first, second])
    assert [r[0] for r in merged] == sorted(r[0] for r in first + second) and len(merged) == 7
    counted = loadgen.in_window(merged, 10.0, 20.0)  # answered inside the window, as wrk counts; the warm-up's left out
    assert sorted(r[1] for r in counted) == [10.5, 11.0, 12.0, 13.0, 14.0]
    assert loadgen.errors_by_status(r[2] for r in counted) == {"429": 1, "timeout": 1}
    row = summarize([{"status": s, "latency": e - b, "ttft": None, "tokens": t} for b, e, s, t in counted],
                    None, 10.0, 10.0, connections=2, per_request=3)
    assert (row["sent"], row["answered"], row["rejected"], row["timed_out"], row["failed"]) == (5, 3, 1, 1, 0)
    assert row["requests_per_s"] == pytest.approx(0.3) and row["sentences_per_s"] == pytest.approx(0.9)
    assert row["tokens_per_s"] == pytest.approx(1.9) and row["latency_p50"] == pytest.approx(1.0)


def _read(data: bytes):
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await loadgen.read_response(reader), await reader.read()

    return asyncio.run(go())


def test_responses_are_read_by_length_in_chunks_or_to_the_end():
    rest = b"HTTP/1.1 200 OK\r\n"  # the next response on the same connection stays unread
    assert _read(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello" + rest) == ((200, b"hello", True, None), rest)
    chunked = (b"HTTP/1.1 429 Too Many\r\nTransfer-Encoding: chunked\r\nRetry-After: 2\r\n\r\n"
               b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n")
    assert _read(chunked + rest) == ((429, b"abcde", True, 2.0), rest)
    assert _read(b"HTTP/1.1 503 Gone\r\nConnection: close\r\nContent-Length: 2\r\n\r\nno")[0] == \
        (503, b"no", False, None)
    assert _read(b"HTTP/1.0 200 OK\r\nRetry-After: soon\r\n\r\nall of it")[0] == (200, b"all of it", False, None)


def test_a_connection_answered_429_waits_for_its_retry_after():
    """A closed-loop connection refused with 429 and Retry-After: 1 sends its next request a second later, not at
    once (a server that refuses everything gets a few requests in 2.5 s, not thousands)."""
    async def refuse(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def run():
        server = await asyncio.start_server(refuse, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        [request] = loadgen.encode_requests(f"http://127.0.0.1:{port}", [{"text": ["a"]}], {})
        part = loadgen.Part("127.0.0.1", port, False, 1, 0, (request,), 10.0)
        try:
            return await loadgen._run_part(part, time.monotonic() + 2.5)
        finally:
            server.close()

    records = asyncio.run(run())
    assert [r[2] for r in records] == [429] * len(records) and 2 <= len(records) <= 4, records


def test_requests_are_encoded_once_as_whole_http_requests():
    [req] = loadgen.encode_requests("http://127.0.0.1:8123/prefix/", [{"text": ["é"]}], {"Authorization": "Bearer k"})
    head, body = req.split(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /prefix/v1/translate HTTP/1.1" and "Host: 127.0.0.1:8123" in lines
    assert "Authorization: Bearer k" in lines and f"Content-Length: {len(body)}" in lines
    assert json.loads(body) == {"text": ["é"]}


@pytest.mark.parametrize("args, says", [
    (["--connections", "2", "--processes", "0"], "--processes must be an integer >= 1, got 0"),
    (["--connections", "0"], "--connections must be at least 1 each"),
    (["--sentences-per-request", "0"], "--sentences-per-request must be an integer >= 1, got 0"),
    (["--connections", "1", "--duration", "nan"], "--duration must be a finite number of seconds > 0"),
    (["--connections", "1", "--warmup", "-1"], "--warmup must be a finite number of seconds >= 0"),
    (["--data", "/nonexistent/sentences.txt"], "cannot read --data '/nonexistent/sentences.txt'"),
    (["--data", "EMPTY"], "holds no sentences"),
    (["--artifact", "/nonexistent/artifact"], "--artifact '/nonexistent/artifact' is not a directory"),
])
def test_bad_closed_loop_input_is_an_error_not_a_traceback(args, says, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    args = [str(empty) if a == "EMPTY" else a for a in args]
    r = CliRunner().invoke(main, ["loadtest", "http://127.0.0.1:9", "--out", str(tmp_path / "r"), *args])
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and says in r.stderr, r.output
    assert "Traceback" not in r.output and not (tmp_path / "r").exists()


def _key(tmp_path) -> str:
    key = tmp_path / "key"
    key.write_text(KEY)
    return str(key)


def test_the_closed_loop_over_two_processes_measures_a_server(server, long_artifact_dir, tmp_path):
    out = tmp_path / "report"
    r = CliRunner().invoke(main, ["loadtest", server.url, "--connections", "1,3", "--processes", "2", "--warmup",
                                  "0.3", "--duration", "1", "--sentences-per-request", "2", "--api-key-file",
                                  _key(tmp_path), "--artifact", long_artifact_dir, "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "loadtest.json").read_text())
    assert [row["connections"] for row in report["rows"]] == [1, 3] and report["plan"]["processes"] == 2
    for row in report["rows"]:
        assert row["answered"] == row["sent"] >= 1 and row["errors"] == {}, row
        assert row["sentences_per_request"] == 2 and row["sentences_per_s"] == pytest.approx(2 * row["requests_per_s"])
        assert row["tokens_per_s"] > 0 and row["latency_p50"] <= row["latency_p99"] and row["ttft_p50"] is None
        # the server worked for its answers: CPU time counted from its /metrics, per request and per sentence
        assert row["server_cpu_s"] > 0 and row["cpu_s_per_request"] == pytest.approx(2 * row["cpu_s_per_sentence"])
        assert row["sentences_per_s_vs_offline"] == pytest.approx(row["sentences_per_s"] /
                                                                  report["offline"]["throughput"])
        assert row["latency_p50_vs_offline"] > 0
    offline = report["offline"]
    assert offline["sentences_per_request"] == 2 and offline["request_latency_p50"] > 0
    assert offline["requests_timed"] >= 1 and offline["beam_size"] == 1
    md = (out / "loadtest.md").read_text()
    assert "| continuous | 3 conn |" in md and "p50 ÷ offline" in md and "one request of 2 sentence(s)" in md
    assert "warning" not in r.output.lower() and "Warning" not in md  # answers well within the 0.3 s warm-up


def test_a_closed_loop_with_no_warmup_warns_that_its_window_undercounts(server, tmp_path):
    out = tmp_path / "report"
    r = CliRunner().invoke(main, ["loadtest", server.url, "--connections", "2", "--processes", "1", "--warmup", "0",
                                  "--duration", "0.5", "--api-key-file", _key(tmp_path), "--out", str(out),
                                  "--quiet"])
    assert r.exit_code == 0, r.output
    assert "warning: continuous at 2 conn: requests took" in r.output and "--warmup 1 or more" in r.output
    assert "Warning: continuous at 2 conn" in (out / "loadtest.md").read_text()


def test_the_closed_loop_counts_errors_by_status(server, tmp_path):
    out = tmp_path / "report"
    # 9 sentences a request: the server takes 8 at most, and answers 400 to each
    r = CliRunner().invoke(main, ["loadtest", server.url, "--connections", "2", "--processes", "1", "--warmup", "0",
                                  "--duration", "0.5", "--sentences-per-request", "9", "--api-key-file",
                                  _key(tmp_path), "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    [row] = json.loads((out / "loadtest.json").read_text())["rows"]
    assert row["answered"] == 0 and row["sent"] >= 1 and row["errors"] == {"400": row["sent"]}
    assert row["failed"] == row["sent"] and row["latency_p50"] is None and row["cpu_s_per_request"] is None
    assert "400: " in (out / "loadtest.md").read_text()


def test_the_open_loop_sends_several_sentences_a_request_and_costs_them(server, tmp_path):
    out = tmp_path / "report"
    r = CliRunner().invoke(main, ["loadtest", server.url, "--rates", "20", "--duration", "1",
                                  "--sentences-per-request", "3", "--api-key-file", _key(tmp_path), "--out", str(out),
                                  "--quiet"])
    assert r.exit_code == 0, r.output
    [row] = json.loads((out / "loadtest.json").read_text())["rows"]
    assert row["answered"] == row["sent"] >= 1 and row["sentences_per_request"] == 3
    assert row["sentences_per_s"] == pytest.approx(3 * row["requests_per_s"]) and row["ttft_p50"] is not None
    assert row["server_cpu_s"] > 0 and row["cpu_s_per_request"] == pytest.approx(3 * row["cpu_s_per_sentence"])


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (apt-get install -y wrk)")
def test_wrk_posts_held_out_sentences_with_the_script(server, tmp_path):
    sentences = tmp_path / "sentences.txt"
    sentences.write_text('one two three\nfour "hundred" and five\\\ntwelve\tignored column\n')
    env = {**os.environ, "WRK_SENTENCES": str(sentences), "WRK_BEAM_SIZE": "1", "WRK_SENTENCES_PER_REQUEST": "2",
           "WRK_API_KEY": KEY}
    r = subprocess.run(["wrk", "-t", "1", "-c", "2", "-d", "1s", "--timeout", "30s", "-s",
                        os.path.join(ROOT, "scripts", "wrk_translate.lua"), server.url], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    [line] = [x for x in r.stdout.splitlines() if x.startswith("wrk-json ")]
    figures = json.loads(line[len("wrk-json "):])
    assert figures["requests"] > 0 and figures["non_2xx"] == 0 and figures["socket_errors"] == 0, r.stdout
    assert figures["sentences_per_request"] == 2 and figures["latency_p50_s"] > 0
