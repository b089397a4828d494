"""How many engine processes a server starts, on how many threads, within the memory it has
(transduce.serve.planning), and what the system says that memory is (devices.available_memory)."""

from __future__ import annotations

import json
import os
import warnings

from transduce.runtime import devices
from transduce.runtime.spec import BackendSpec
from transduce.serve import planning


def test_engines_auto_is_two_on_a_cpu_of_two_cores_and_one_on_a_gpu(monkeypatch):
    """--engines 0 (the default): two engine processes on a CPU of two cores or more, one on one core or a GPU;
    each CPU engine's framework threads are every core while it alone decodes and its share of the cores less
    the front end's while another engine decodes too, where the backend can change them (ONNX Runtime), else
    that share always; threads given are kept."""
    cpu, gpu, torch = BackendSpec(), BackendSpec(device="cuda"), BackendSpec(backend="torch")
    monkeypatch.setattr(devices, "usable_cpus", lambda: 2)
    assert (planning.engine_count(cpu, 0), planning.engine_count(gpu, 0), planning.engine_count(cpu, 3)) == (2, 1, 3)
    assert planning.engine_spec(cpu, 2) == (BackendSpec(threads=2), 1)
    assert planning.engine_spec(gpu, 2) == (gpu, 0)
    assert planning.engine_spec(torch, 2) == (BackendSpec(backend="torch", threads=1), 0)
    assert planning.engine_spec(cpu, 1) == (BackendSpec(threads=1), 0)
    monkeypatch.setattr(devices, "usable_cpus", lambda: 1)
    assert planning.engine_count(cpu, 0) == 1
    monkeypatch.setattr(devices, "usable_cpus", lambda: 16)
    assert planning.engine_spec(cpu, 2) == (BackendSpec(threads=16), 7)
    assert planning.engine_spec(BackendSpec(threads=4), 2) == (BackendSpec(threads=4), 0)


def _graph_bytes(artifact_dir: str) -> int:
    with open(os.path.join(artifact_dir, "manifest.json")) as f:
        files = json.load(f)["files"]
    return sum(files[name]["bytes"] for name in ("encoder.onnx", "decoder_step.ort.onnx"))


def test_engines_that_would_not_fit_in_memory_lend_no_threads_then_are_fewer(tiny_artifact_dir, monkeypatch):
    """Every engine loads the model, and lending its threads (a second set of sessions) loads it twice: where the
    memory available would not hold that, the engines keep to their share of the cores; where it would not hold
    the engines at all, auto starts fewer (one at least); engines given are kept, with a note."""
    monkeypatch.setattr(devices, "usable_cpus", lambda: 4)
    per_set = planning.session_bytes(tiny_artifact_dir, BackendSpec())
    assert per_set == int(_graph_bytes(tiny_artifact_dir) * planning.SESSION_BYTES_PER_GRAPH_BYTE)
    engine = planning.PROCESS_BYTES + per_set  # one engine, one set of sessions

    def plan(available: float, engines: int = 0) -> planning.EnginePlan:
        over = int(available / planning.MEMORY_SHARE) + 64  # a little over the sizes named: no rounding's edge
        return planning.plan_engines(tiny_artifact_dir, BackendSpec(), engines, over)

    assert plan(2 * (engine + per_set)) == planning.EnginePlan(2, BackendSpec(threads=4), 1)  # room for all of it
    lent_none = plan(2 * engine)
    assert (lent_none.count, lent_none.spec.threads, lent_none.crowded) == (2, 1, 0)
    assert "on 1 thread each, not on every core" in lent_none.note and "a second set of sessions" in lent_none.note
    fewer = plan(1.5 * engine)
    assert (fewer.count, fewer.spec.threads, fewer.crowded) == (1, 3, 0)
    assert fewer.note.startswith("1 engine process, not 2: one set of the model's sessions takes ~")
    assert "--engines N overrides" in fewer.note
    assert "may not fit" in plan(0.5 * engine).note and plan(0.5 * engine).count == 1
    given = plan(engine, engines=3)  # as asked, with a note
    assert (given.count, given.spec.threads, given.crowded) == (3, 4, 1)
    assert "3 engine processes may not fit" in given.note
    # no estimate without the artifact's sizes, nor for backends it does not cover: the cores alone decide
    assert planning.session_bytes(os.path.dirname(tiny_artifact_dir), BackendSpec()) is None
    assert planning.session_bytes(tiny_artifact_dir, BackendSpec(backend="torch")) is None
    monkeypatch.setattr(devices, "available_memory", lambda: None)
    assert planning.plan_engines(tiny_artifact_dir, BackendSpec(), 0) == planning.EnginePlan(2, BackendSpec(threads=4),
                                                                                           1)


def test_available_memory_is_the_systems_or_less_where_a_cgroup_limits_it(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n")
    v2, v1 = (tmp_path / "memory.max", tmp_path / "memory.current"), (tmp_path / "limit", tmp_path / "usage")
    none = (tmp_path / "no-limit", tmp_path / "no-usage")
    assert devices.available_memory(str(meminfo), [none]) == 20000000 * 1024
    v2[0].write_text("max\n")
    v2[1].write_text("5000\n")
    assert devices.available_memory(str(meminfo), [v2]) == 20000000 * 1024  # a cgroup with no limit
    v2[0].write_text("1073741824\n")
    assert devices.available_memory(str(meminfo), [v2]) == (1 << 30) - 5000  # a container's limit, less its usage
    v1[0].write_text(str((1 << 63) - 4096))
    v1[1].write_text("10\n")
    assert devices.available_memory(str(meminfo), [none, v1]) == 20000000 * 1024  # v1 writes no limit as huge
    assert devices.available_memory(str(tmp_path / "nothing"), [none]) is None
    assert devices.available_memory() is None or devices.available_memory() > 0  # this machine's, where it says


def test_a_server_short_of_memory_starts_fewer_engines_and_says_why(tiny_artifact_dir, monkeypatch):
    from transduce.serve.server import build_service

    monkeypatch.setattr(devices, "usable_cpus", lambda: 2)
    per_set = planning.session_bytes(tiny_artifact_dir, BackendSpec())
    monkeypatch.setattr(devices, "available_memory",
                        lambda: int(1.5 * (planning.PROCESS_BYTES + per_set) / planning.MEMORY_SHARE))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        client, _ = build_service(tiny_artifact_dir, BackendSpec(), engine="process", engines=0)
    try:
        assert len(client.engines) == 1 and client.translate(["one two"], {"beam_size": 1})[0].tokens
    finally:
        client.stop()
    [said] = [str(w.message) for w in caught if "engine process" in str(w.message)]
    assert said.startswith("1 engine process, not 2: ")
