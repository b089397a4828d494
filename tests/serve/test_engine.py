"""`transduce serve --engine process`: the backend and decode thread in an engine process of their own. The
server tests that matter across the boundary run here again over such servers (the module's `server` and
`wide_server`), beside what only a second process can do: die, and take the server's health with it."""

from __future__ import annotations

import asyncio
import os
import signal
from types import SimpleNamespace

import httpx
import pytest

from tests.serve.conftest import SLOW, Server, _limited_server, warmed
from tests.serve.test_server import (  # noqa: F401 - collected here, over this module's servers
    AUTH,
    _until,
    _wait_for,
    test_a_client_that_leaves_frees_its_rows,
    test_a_full_queue_is_429_with_retry_after_and_a_deadline_504_frees_the_rows,
    test_concurrent_requests_get_what_offline_decoding_gives,
    test_metrics_count_what_happened,
    test_score_requests_get_what_offline_scoring_gives,
    test_streams_tokens_of_greedy_and_sentences_of_beam,
)
from transduce.runtime import devices


@pytest.fixture(scope="module")
def server(long_artifact_dir, tmp_path_factory):
    """Two engine processes behind the front end: the tests above pass across either."""
    with _limited_server(long_artifact_dir, tmp_path_factory, "--engine", "process", "--engines", "2") as s:
        yield s


@pytest.fixture(scope="module")
def wide_server(wide_artifact_dir, tmp_path_factory):
    """One engine: the queue tests count one running batch's rows."""
    with _limited_server(wide_artifact_dir, tmp_path_factory, "--engine", "process", "--engines", "1") as s:
        yield warmed(s)


def _engines(pid: int) -> list[int]:
    """The engine processes whose parent is `pid` (Linux's /proc; multiprocessing's resource tracker is not one)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                out.append(int(name))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_process_cpu_seconds_cover_every_process(server):
    """/metrics gives the decode side's gauges and counters and CPU time of the front end and both engines."""
    engines = _engines(server.proc.pid)
    assert len(engines) == 2
    engine_cpu = sum(_cpu_seconds(pid) for pid in engines)  # read first: CPU time only grows
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    assert "transduce_live_rows " in text and "transduce_queue_depth " in text
    cpu = float(next(line for line in text.splitlines() if line.startswith("process_cpu_seconds_total ")).split()[1])
    assert cpu >= engine_cpu > min(_cpu_seconds(pid) for pid in engines) > 0
    assert httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["engines"] == 2


def test_requests_fill_the_first_engine_to_fill_rows_then_go_to_the_fewest(long_artifact_dir):
    """With two engines and fill_rows 4: requests go to the first engine while it has fewer than 4 rows under way,
    then to the engine with the fewest rows; with fill_rows 0, each to the engine with the fewest. Every answer is
    offline decoding's."""
    from transduce.runtime.api import load
    from transduce.runtime.spec import BackendSpec
    from transduce.serve.engine import EngineClient
    from transduce.serve.service import ServiceOptions

    texts = ["one two three", "four five", "six", "seven eight", "nine"]
    opts = {"beam_size": 1, "min_length": 300, "max_len_a": 0, "max_len_b": 300}  # 300 steps each: under way
    got = {}
    for fill in (4, 0):
        client = EngineClient(long_artifact_dir, BackendSpec.of(threads=1), ServiceOptions(fill_rows=fill), engines=2)
        client.start()
        chosen, route = [], client._route

        def routed(route=route, client=client, chosen=chosen):
            engine = route()
            chosen.append(client.engines.index(engine))
            return engine

        client._route = routed
        try:
            reqs = [client.submit(texts[:3], opts), client.submit(texts[3:4], opts), client.submit(texts[4:], opts)]
            assert all(r.finished.wait(120) for r in reqs)
        finally:
            client.stop()
        assert chosen == ([0, 0, 1] if fill else [0, 1, 1]), (fill, chosen)  # rows 3, then 1, then 1
        got[fill] = [t.tokens for r in reqs for t in r.translations]
    offline = load(long_artifact_dir, threads=1)
    assert got[4] == got[0] == [t.tokens for t in offline.translate(texts, **opts)]


def test_a_dead_engine_fails_healthz_and_its_requests_get_503(long_artifact_dir, tmp_path):
    """The engine processes (two, the default on this CPU) killed while a request runs: that request is answered 503
    (no hang), healthz and readyz fail, new requests get 503; SIGTERM still ends the server."""
    s = Server(long_artifact_dir, tmp_path, "--engine", "process")
    try:
        s.wait_ready()
        engines = _engines(s.proc.pid)
        assert len(engines) == (2 if devices.usable_cpus() >= 2 else 1)

        async def run():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
                task = asyncio.create_task(client.post("/v1/translate", json={"text": ["one two"] * 4, **SLOW}))
                await _until(client, "transduce_live_rows", lambda rows: rows > 0, [task])  # under way
                for engine in engines:
                    os.kill(engine, signal.SIGKILL)
                return await task

        answer = asyncio.run(run())
        assert answer.status_code == 503 and "engine process" in answer.json()["error"]["message"], answer.text
        health = httpx.get(s.url + "/healthz")
        assert health.status_code == 503 and health.json()["status"] == "engine process stopped", health.text
        assert httpx.get(s.url + "/readyz").status_code == 503
        r = httpx.post(s.url + "/v1/translate", json={"text": ["one"]}, timeout=30)
        assert r.status_code == 503 and "engine process has stopped" in r.json()["error"]["message"]
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(timeout=30)
    finally:
        s.stop()


def test_the_engine_dies_with_the_front_end(long_artifact_dir, tmp_path):
    """The front end killed outright (no drain): its engine processes do not stay behind."""
    s = Server(long_artifact_dir, tmp_path, "--engine", "process")
    try:
        s.wait_ready()
        engines = _engines(s.proc.pid)
        assert engines
        s.proc.kill()
        s.proc.wait(timeout=30)
        _wait_for(lambda: not any(_alive(engine) for engine in engines))
    finally:
        s.stop()


def test_an_artifact_the_engine_cannot_load_is_the_command_s_error(tmp_path):
    """The engine process's load error reaches the command as its own message (exit 2), no traceback."""
    from click.testing import CliRunner

    from transduce.cli import main

    r = CliRunner().invoke(main, ["serve", str(tmp_path), "--engine", "process", "--port", "0"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert f"error: {tmp_path}/manifest.json is missing" in r.stderr and "hint: rebuild" in r.stderr, r.output


def test_frames_carry_plain_values_only():
    """What crosses the pipe reads back as it was sent; a frame naming any class or function is refused."""
    import pickle

    import numpy as np

    from transduce.runtime.decoding import DecodingOptions
    from transduce.runtime.decoding.options import DecodeResult, Hypothesis
    from transduce.serve import wire
    from transduce.serve.options import ServeError

    opts = DecodingOptions(beam_size=3, suppress=((5, 6),), return_attention=True)
    assert wire.unoptions(wire.loads(wire.dumps(wire.options(opts)))) == opts
    att = np.arange(6, dtype=np.float32).reshape(2, 3)
    r = DecodeResult((Hypothesis((4, 5), -1.5, -3.0, (-1.0, -2.0), True, att),))
    back = wire.unresult(wire.loads(wire.dumps(wire.result(r))))
    assert back == r and np.array_equal(back.best.attention, att)
    e = wire.unerror(wire.loads(wire.dumps(wire.error(ServeError("queue full", 429, "retry", retry_after=1.0)))))
    assert (e.status, e.args[0], e.hint, e.retry_after) == (429, "queue full", "retry", 1.0)
    assert wire.error(ValueError("bad"))[:2] == (500, "ValueError: bad")
    with pytest.raises(pickle.UnpicklingError, match="only plain values"):
        wire.loads(pickle.dumps(np.zeros(2)))


def test_the_engine_makes_each_distinct_set_of_options_once():
    """Submits with the same option values share one DecodingOptions; different values get their own."""
    from transduce.runtime.decoding import DecodingOptions
    from transduce.serve import wire
    from transduce.serve.engine_core import EngineService
    from transduce.serve.options import Kept

    service = EngineService.__new__(EngineService)
    service._options = Kept()
    greedy, beam = wire.options(DecodingOptions(beam_size=1)), wire.options(DecodingOptions(beam_size=4))
    first = service._options_of(wire.loads(wire.dumps(greedy)))  # as a frame brings them: equal values, new tuples
    assert service._options_of(wire.loads(wire.dumps(greedy))) is first and first == DecodingOptions(beam_size=1)
    assert service._options_of(beam) == DecodingOptions(beam_size=4) and len(service._options) == 2


def test_an_engine_whose_warm_up_waits_in_its_queue_starts(tiny_artifact_dir):
    """A static scheduler holds the engine's own warm-up request in its queue for --max-wait-ms: the front end
    hears nothing of it before the engine says it is ready (a step frame first was read as the ready message)."""
    from transduce.runtime.spec import BackendSpec
    from transduce.serve.engine import EngineClient
    from transduce.serve.service import ServiceOptions

    client = EngineClient(tiny_artifact_dir, BackendSpec.of(threads=1),
                          ServiceOptions(scheduler="static", max_wait_ms=50))
    client.start()
    try:
        assert client.translate(["one two"], {"beam_size": 1})[0].tokens
    finally:
        client.stop()


def test_frames_are_read_on_the_requests_event_loop_and_by_threads_once_it_has_stopped(long_artifact_dir):
    """A request from an event loop moves the reading of every engine's frames onto that loop (the reader threads
    end) while a stream from a thread is under way: none of its token events is lost or repeated, and those after
    the move arrive on the loop's thread. Once that loop has stopped, a caller in a thread of its own is answered
    through reader threads again. Every answer is offline decoding's."""
    import threading
    import time

    import uvloop

    from transduce.runtime.api import load
    from transduce.runtime.spec import BackendSpec
    from transduce.serve.engine import EngineClient

    opts = {"beam_size": 1, "min_length": 300, "max_len_a": 0, "max_len_b": 300}  # 300 steps: under way
    got, threads = [], set()

    def sink(events):
        for _, kind, data in events:
            if kind == "tokens":
                got.extend(t for _, t in zip(*data, strict=True))
                threads.add(threading.current_thread().name)
                if threading.current_thread() is not threading.main_thread():
                    time.sleep(0.002)  # a slow reader thread: frames wait in the pipe when the loop takes over

    client = EngineClient(long_artifact_dir, BackendSpec.of(threads=1), engines=2)
    client.loop_reads = True  # as serve() sets it
    client.start()
    try:
        streamed = client.submit(["one two three"], opts, sink=sink, stream=True)

        async def on_loop():
            while len(got) < 20:
                await asyncio.sleep(0.005)
            req = client.submit(["four five"], opts)
            while not (req.finished.is_set() and streamed.finished.is_set()):
                await asyncio.sleep(0.005)
            loop = asyncio.get_running_loop()
            return req, [e.loop is loop for e in client.engines], [e.reader.is_alive() for e in client.engines], \
                [os.get_blocking(e.conn.fileno()) for e in client.engines]

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # the server's loop
            req, looped, reading, blocking = runner.run(on_loop())
        assert looped == [True, True] and reading == [False, False]
        assert blocking == [True, True]  # its sends and a frame read in parts wait, as they did in the thread
        assert threading.main_thread().name in threads and len(threads) == 2, threads  # a reader thread, then the loop
        after = client.translate(["six seven"], opts)  # the loop has closed: threads read again
        assert [e.loop for e in client.engines] == [None, None] and all(e.reader.is_alive() for e in client.engines)
    finally:
        client.stop()
    translator = load(long_artifact_dir, threads=1)
    offline = translator.translate(["one two three", "four five", "six seven"], **opts)
    assert [t for t in got if t != translator.config.eos_id] == list(offline[0].tokens)
    assert streamed.error is None and streamed.translations[0].tokens == offline[0].tokens
    assert req.translations[0].tokens == offline[1].tokens and after[0].tokens == offline[2].tokens


class _Pipe:
    """A pipe end with nothing to read, recording each poll's timeout."""

    def __init__(self):
        self.polls: list[float] = []

    def poll(self, timeout: float = 0.0) -> bool:
        self.polls.append(timeout)
        return False


def test_an_idle_engine_polls_its_pipe_for_idle_spin_ms_once_after_each_message_then_sleeps_on_it():
    """After a message from the front end, the engine's first idle wait polls the pipe (timeout 0) for idle_spin_ms,
    then sleeps on it; later idle waits only sleep (an engine without work spins no more), and 0 never polls."""
    import threading
    import time

    from transduce.serve.engine_core import EngineService
    from transduce.serve.service import ServiceOptions

    def idle_engine(spin_ms: float) -> EngineService:
        service = EngineService.__new__(EngineService)  # its idle wait only: no model
        service.options, service.conn, service.cores = ServiceOptions(idle_spin_ms=spin_ms), _Pipe(), None
        service._lock, service._spun, service.requests = threading.Lock(), True, {}
        return service

    service = idle_engine(30)
    service._lock.acquire()  # as the decode loop holds it
    service.handle(("cancel", 1, None))  # any message (of a request that has gone)
    start = time.monotonic()
    service._idle()
    assert time.monotonic() - start >= 0.03
    assert service.conn.polls[-1] == 0.05 and service.conn.polls[:-1] and set(service.conn.polls[:-1]) == {0}
    service.conn.polls.clear()
    service._idle()
    assert service.conn.polls == [0.05]  # no new message: no polling
    service = idle_engine(0)
    service._lock.acquire()
    service.handle(("cancel", 1, None))
    service._idle()
    assert service.conn.polls == [0.05]


def test_an_engine_that_ends_fails_only_its_own_requests_and_jobs():
    """With two engines, the one whose pipe closes fails the requests and job replies it had; the other's wait on."""
    import concurrent.futures

    from transduce.runtime.decoding import DecodingOptions
    from transduce.runtime.spec import BackendSpec
    from transduce.serve.engine import EngineClient
    from transduce.serve.service import Request, ServeError

    client = EngineClient("unused", BackendSpec(), engines=2)  # never started: its bookkeeping only
    gone, kept = client.engines
    reqs = [Request(1, DecodingOptions(), 10.0) for _ in range(2)]
    jobs = [concurrent.futures.Future() for _ in range(2)]
    for n, (req, job, engine) in enumerate(zip(reqs, jobs, (gone, kept), strict=True)):
        client._requests[req.id], client._where[req.id], client._replies[n] = req, engine, (engine, job)
    client._fail_all(ServeError("the engine process stopped", 503), gone)
    assert reqs[0].error.status == 503 and isinstance(jobs[0].exception(timeout=0), ServeError)
    assert not reqs[1].finished.is_set() and not jobs[1].done()
    assert list(client._requests) == [reqs[1].id] and list(client._replies) == [1]


class _Backend:
    """A backend that records the thread limits it is given."""

    def __init__(self, threaded_steps: bool):
        self.threaded_steps, self.limits = threaded_steps, []

    def limit_threads(self, n):
        self.limits.append(n)


def test_an_engine_runs_on_its_share_of_the_cores_only_while_another_decodes():
    """Each engine says in shared memory whether it has work; it decodes on every core while no other engine has
    any, on the crowded share while one does, and says it has none before it waits idle."""
    from transduce.serve.engine_core import Cores, EngineService

    busy = bytearray(3)
    engines = []
    for i in range(3):
        e = EngineService.__new__(EngineService)  # its core-sharing alone: no decode thread
        e.translator, e.cores, e._crowded = SimpleNamespace(backend=_Backend(True)), Cores(busy, i, 1), False
        engines.append(e)
    a, b, c = engines
    a._share_cores(True)
    assert busy == bytearray([1, 0, 0]) and a.translator.backend.limits == []  # alone: the whole budget
    b._share_cores(True)
    assert b.translator.backend.limits == [1]  # a decodes too
    a._share_cores(True)
    assert a.translator.backend.limits == [1]
    b._share_cores(False)  # b's batch is done: a has the cores again at its next step
    a._share_cores(True)
    assert busy == bytearray([1, 0, 0]) and a.translator.backend.limits == [1, None]
    c._share_cores(False)  # an idle engine limits nothing
    assert c.translator.backend.limits == []


def test_engines_share_the_cores_only_where_the_backend_gains_from_them(tiny_artifact_dir):
    """Where the backend's steps run on several threads, its sessions for the crowded share are warmed up before
    it is ready and it starts on the whole budget; where they run on one thread anyway, it keeps to the share and
    shares nothing; a backend without the capability shares nothing. The front end hands each engine its byte
    of one shared array."""
    from transduce.runtime.spec import BackendSpec
    from transduce.serve.engine import EngineClient
    from transduce.serve.engine_core import Cores, _sharing

    translated = []

    def translator(backend):
        return SimpleNamespace(backend=backend, translate=lambda texts, **o: translated.append((texts, o)))

    cores = Cores(bytearray(2), 0, 1)
    threaded, single = _Backend(True), _Backend(False)
    assert _sharing(translator(threaded), cores, {"beam_size": 2}) is cores
    assert threaded.limits == [1, None] and translated == [(["warm up"], {"beam_size": 2})]
    assert _sharing(translator(single), cores, {}) is None and single.limits == [1] and len(translated) == 1
    assert _sharing(translator(object()), cores, {}) is None
    assert _sharing(translator(_Backend(True)), None, {}) is None
    client = EngineClient(tiny_artifact_dir, BackendSpec.of(threads=2), engines=2, crowded=1)
    first, second = client.cores(0), client.cores(1)
    assert (first.index, second.index, first.crowded) == (0, 1, 1) and first.busy is second.busy
    assert EngineClient(tiny_artifact_dir, BackendSpec.of(threads=1), engines=2).cores(0) is None


def _readable_bytes(fd: int) -> int:
    import fcntl
    import struct
    import termios

    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def test_the_event_loop_never_waits_on_a_full_pipe_while_the_engine_waits_on_another(long_artifact_dir):
    """The engine blocks sending a step frame larger than the pipe holds (32 sentences' attention) while the event
    loop that reads its frames is busy; the loop then sends submits larger than the pipe holds too. Waiting on
    that write, the loop would read nothing and the engine nothing either: both would wait for ever. Every request
    is answered, as offline decoding answers it."""
    import threading
    import time

    from transduce.runtime.api import load
    from transduce.runtime.spec import BackendSpec
    from transduce.serve.engine import EngineClient
    from transduce.serve.service import ServiceOptions

    long_opts = {"beam_size": 1, "min_length": 200, "max_len_a": 0, "max_len_b": 200, "return_attention": True}
    short_opts = {"beam_size": 1, "max_len_a": 0, "max_len_b": 2}
    words = "one two three four five six seven eight".split()
    first = [" ".join(words[(i + j) % 8] for j in range(40)) for i in range(32)]  # (200 x 40) fp32 each: 32 KB
    big = [[" ".join(words[(i * k + j) % 8] for j in range(120)) for i in range(64)] for k in range(1, 6)]
    path = long_artifact_dir
    client = EngineClient(path, BackendSpec.of(threads=1), ServiceOptions(max_rows=64 * 6))
    client.loop_reads = True
    client.start()
    box: dict = {}

    async def on_loop():
        r1 = client.submit(first, long_opts)
        await asyncio.sleep(0)  # its submit goes out
        fd, seen, since = client.engines[0].conn.fileno(), -1, time.monotonic()
        end = since + 120
        while (time.monotonic() - since < 0.5 or seen < 100_000) and time.monotonic() < end:  # the engine fills
            # the pipe while the loop is busy
            now = _readable_bytes(fd)
            if now != seen:
                seen, since = now, time.monotonic()
            time.sleep(0.05)
        box["waiting"] = seen
        rest = [client.submit(texts, short_opts) for texts in big]  # one frame of ~0.3 MB, this turn's
        while not all(r.finished.is_set() for r in [r1, *rest]):
            await asyncio.sleep(0.01)
        box["reqs"] = [r1, *rest]

    runner = threading.Thread(target=asyncio.run, args=(on_loop(),), daemon=True)
    runner.start()
    runner.join(timeout=120)
    stuck = runner.is_alive()
    if stuck:
        client._kill()  # (what unblocks both)
    client.stop()
    assert not stuck, f"the loop and the engine waited on each other ({box.get('waiting')} bytes unread)"
    translator = load(path, threads=1)
    r1, *rest = box["reqs"]
    assert [t.tokens for t in r1.translations] == [t.tokens for t in translator.translate(first, **long_opts)]
    assert all(t.attention.shape[0] == 200 for t in r1.translations)
    for req, texts in zip(rest, big, strict=True):
        assert req.error is None
        assert [t.tokens for t in req.translations] == [t.tokens for t in translator.translate(texts, **short_opts)]


class _Frames:
    """A pipe end holding frames to read."""

    def __init__(self, frames: list[bytes]):
        self.frames = frames

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self.frames)

    def recv_bytes(self) -> bytes:
        frame = self.frames.pop(0)
        if frame == b"interrupt":
            raise KeyboardInterrupt
        return frame

    def fileno(self) -> int:
        return -1


def test_the_event_loop_reads_a_few_frames_per_wake_up_and_an_interrupt_is_not_an_engine_failure():
    from transduce.runtime.spec import BackendSpec
    from transduce.serve import engine as engine_module
    from transduce.serve import wire
    from transduce.serve.engine import EngineClient

    client = EngineClient("unused", BackendSpec(), engines=1)  # never started: its frame reading only
    e = client.engines[0]
    e.conn = _Frames([wire.dumps(("step", n, 0, [])) for n in range(40)])
    e.loop = SimpleNamespace(remove_reader=lambda fd: None)
    client._readable(e)
    assert len(e.conn.frames) == 40 - engine_module.FRAMES_PER_READ and e.seen == engine_module.FRAMES_PER_READ - 1
    client._readable(e)
    client._readable(e)
    assert e.conn.frames == [] and e.seen == 39 and not e.ended
    e.conn.frames = [b"interrupt"]
    with pytest.raises(KeyboardInterrupt):
        client._readable(e)
    assert not e.ended and client.thread_error is None
