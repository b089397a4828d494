"""The Ray Serve deployment on a real local Ray instance: two replicas of the tiny model answer concurrent requests
with offline decoding's translations, and a killed replica is replaced while requests go on being answered."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from tests.serve.conftest import KEY, free_port  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}

TEXTS = ["one two three", "four hundred and five", "twelve", "seven thousand and one", "nine", "eighty"]


@pytest.fixture(scope="module")
def ray_url(tiny_artifact_dir, tmp_path_factory):
    from transduce.runtime.spec import BackendSpec
    from transduce.serve.ray import build_app
    from transduce.serve.service import ServiceOptions

    key = tmp_path_factory.mktemp("ray") / "key"
    key.write_text(KEY)

    import signal

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}  # ray.init sets its own
    with pytest.MonkeyPatch.context() as env:
        # Time a busy machine needs, read by the processes ray.init starts from the environment they inherit. Serve's
        # controller gives its HTTP proxy 5 s to start, then kills it (and serve.start fails); the proxy's router
        # sends a request to the replica that tells its queue length first, within 0.1 s: a replica a busy machine
        # has not run for that long would get none.
        env.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
        env.setenv("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "2")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(tiny_artifact_dir, BackendSpec(threads=1), replicas=2, num_cpus=0.5,
                            options=ServiceOptions(default_beam_size=2), api_key_file=str(key),
                            languages="en:fr", read_timeout=5.0),
                  name="transduce", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait_for_replicas(url, 2)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()
        for sig, handler in handlers.items():  # the tests after these see the process as it was
            signal.signal(sig, handler)


def _wait_for_replicas(url: str, n: int, timeout: float = 120.0) -> None:
    """Until the proxy has routed to `n` replicas: serve.run returns once they run, and the proxy learns of them
    a moment later (seconds on a busy machine)."""
    seen: set[str] = set()
    end = time.monotonic() + timeout
    while len(seen) < n:
        assert time.monotonic() < end, f"the proxy routed to {seen} only"
        try:
            seen.add(httpx.get(url + "/healthz", timeout=30).headers["x-transduce-replica"])
        except (httpx.TransportError, KeyError):
            time.sleep(0.1)


def _send(url: str, bodies: list[dict]) -> list[httpx.Response | Exception]:
    async def run():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/translate", json=b) for b in bodies),
                                        return_exceptions=True)

    return asyncio.run(run())


def _replicas() -> list[str]:
    return [name for name in (a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
            if name.startswith("SERVE_REPLICA::") and "transduce" in name]


def _check(answer: httpx.Response, want) -> None:
    got = answer.json()["translations"]
    assert [g["tokens"] for g in got] == [list(w.tokens) for w in want]
    np.testing.assert_allclose([g["score"] for g in got], [w.score for w in want], atol=1e-5)


def test_two_replicas_answer_concurrent_requests_as_offline_decoding(ray_url, tiny_artifact_dir):
    from transduce.runtime.api import load

    translator = load(tiny_artifact_dir, threads=1)
    bodies = [{"text": TEXTS[i % 6:] + TEXTS[: i % 6], "beam_size": 1 + i % 3} for i in range(24)]
    wants = [translator.translate(b["text"], beam_size=b["beam_size"]) for b in bodies]
    answers = _send(ray_url, bodies)
    for answer, want in zip(answers, wants, strict=True):
        assert not isinstance(answer, Exception) and answer.status_code == 200, answer
        _check(answer, want)
    assert len({a.headers["x-transduce-replica"] for a in answers}) == 2  # both replicas answered
    assert httpx.get(ray_url + "/readyz", headers=AUTH).status_code == 200
    assert httpx.get(ray_url + "/readyz").status_code == 401  # the replicas read the key file themselves
    assert httpx.get(ray_url + "/healthz").status_code == 200
    # the language pair reaches every replica's LibreTranslate routes
    assert httpx.get(ray_url + "/languages", headers=AUTH).json()[0]["code"] == "en"


def test_a_killed_replica_is_replaced_and_no_answer_is_wrong(ray_url, tiny_artifact_dir):
    """Requests sent while a replica is killed either get their own translation or fail visibly (an error
    status or a broken connection), never another request's; Ray starts a replica in its place."""
    from transduce.runtime.api import load

    translator = load(tiny_artifact_dir, threads=1)
    want = {t: translator.translate([t], beam_size=2)[0] for t in TEXTS}
    before = _replicas()
    assert len(before) == 2
    bodies = [{"text": [TEXTS[i % 6]]} for i in range(30)]

    async def run():
        async with httpx.AsyncClient(base_url=ray_url, headers=AUTH, timeout=60) as client:
            tasks = [asyncio.create_task(client.post("/v1/translate", json=b)) for b in bodies[:15]]
            await asyncio.sleep(0.05)
            ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
            tasks += [asyncio.create_task(client.post("/v1/translate", json=b)) for b in bodies[15:]]
            return await asyncio.gather(*tasks, return_exceptions=True)

    answers = asyncio.run(run())
    ok = 0
    for body, answer in zip(bodies, answers, strict=True):
        if isinstance(answer, Exception) or answer.status_code != 200:
            continue  # failed, and the client knows it
        _check(answer, [want[body["text"][0]]])
        ok += 1
    assert ok >= 15  # the surviving replica went on answering
    end = time.monotonic() + 240  # a new replica is a new process that loads the model: a minute on a busy machine
    while not (len(_replicas()) == 2 and before[0] not in _replicas()):
        assert time.monotonic() < end, f"the killed replica was not replaced: {_replicas()}"
        time.sleep(0.5)
    end = time.monotonic() + 240  # the new replica comes up and answers
    while True:
        answers = _send(ray_url, [{"text": [TEXTS[0]]}] * 8)
        if all(not isinstance(a, Exception) and a.status_code == 200 for a in answers):
            for a in answers:
                _check(a, [want[TEXTS[0]]])
            if len({a.headers["x-transduce-replica"] for a in answers}) == 2:
                break
        assert time.monotonic() < end, "the new replica never answered"
        time.sleep(0.5)


def test_replicas_this_ray_cannot_place_are_refused_before_serving(tiny_artifact_dir):
    """More replicas than the local Ray has CPUs: an error naming --replicas and what there is, exit 2, and none of
    the Ray processes the command started left behind (the replicas would otherwise wait forever for a CPU, and
    the server never become ready)."""
    import os
    import subprocess
    import sys

    def ray_processes() -> set[int]:
        ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
        return {int(line.split()[0]) for line in ps if "raylet" in line or "gcs_server" in line}

    before = ray_processes()
    n = len(os.sched_getaffinity(0)) + 1
    out = subprocess.run([sys.executable, "-m", "transduce.cli", "serve", tiny_artifact_dir, "--ray", "--replicas",
                          str(n), "--port", str(free_port()), "--quiet"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"error: --replicas {n} need {n} CPUs (one per replica); this machine's Ray has" in out.stderr
    end = time.monotonic() + 30
    while ray_processes() - before:
        assert time.monotonic() < end, f"Ray processes left behind: {ray_processes() - before}"
        time.sleep(0.5)


def test_serve_ray_stops_on_sigterm_with_status_0(tiny_artifact_dir):
    """`transduce serve --ray` answers, then SIGTERM shuts Serve and Ray down and exits 0 (Ray's own SIGTERM
    handler, installed by ray.init, aborted the process: status 134)."""
    import signal
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "transduce.cli", "serve", tiny_artifact_dir, "--ray",
                             "--replicas", "1", "--port", str(port), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 240
        for line in proc.stdout:
            if "replica(s) of" in line:
                break
            assert time.monotonic() < end, "not ready in time"
        assert httpx.post(f"http://127.0.0.1:{port}/v1/translate", json={"text": ["one"], "beam_size": 1},
                          timeout=60).status_code == 200
        proc.send_signal(signal.SIGTERM)
        proc.stdout.read()
        assert proc.wait(timeout=240) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_run_settings_are_read_as_their_fields_types():
    """`serve run transduce.serve.ray:app` key=value strings: optional integers ("none" or a number), floats and
    the application's own settings as their types; a value of the wrong type names its key."""
    from transduce.errors import InputError
    from transduce.serve.ray import app_settings

    artifact, spec, options, settings = app_settings({
        "artifact": "a", "default_beam_size": "2", "join_ratio": "0.25", "max_rows": "64", "threads": "1",
        "replicas": "3", "grace": "5", "read_timeout": "2.5", "languages": "en:fr"})
    assert (artifact, spec.threads) == ("a", 1)
    assert settings == {"replicas": 3, "grace": 5.0, "read_timeout": 2.5, "languages": "en:fr"}
    assert (options.default_beam_size, options.join_ratio, options.max_rows) == (2, 0.25, 64)
    assert app_settings({"artifact": "a", "default_beam_size": "none"})[2].default_beam_size is None
    with pytest.raises(InputError, match="max_rows must be an integer, got 'many'"):
        app_settings({"artifact": "a", "max_rows": "many"})
    assert app_settings({"artifact": "a", "encode_aside": "true"})[2].encode_aside
    assert not app_settings({"artifact": "a", "encode_aside": "0"})[2].encode_aside
    with pytest.raises(InputError, match="encode_aside must be true or false, got 'maybe'"):
        app_settings({"artifact": "a", "encode_aside": "maybe"})
