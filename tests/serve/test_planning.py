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
    monkeypatch.setattr(devices, "usable_cpus", lambda: 1100)  # more than a spec takes: the most it does
    assert planning.engine_spec(cpu, 1) == (BackendSpec(threads=1023), 0)
    assert planning.engine_spec(cpu, 2) == (BackendSpec(threads=1024), 511)


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
    """MemAvailable, or less where a cgroup over the process (its own, as /proc/self/cgroup names it, or an
    ancestor: v2, then v1) is limited: the limit less its usage, less the page cache it would reclaim first."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n")
    root, membership = tmp_path / "cgroup", tmp_path / "self-cgroup"
    system = 20000000 * 1024

    def available():
        return devices.available_memory(str(meminfo), str(root), str(membership))

    def cgroup(directory, limit, usage, stat="", v1=False):
        directory.mkdir(parents=True, exist_ok=True)
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes") if v1 else ("memory.max", "memory.current")
        (directory / names[0]).write_text(f"{limit}\n")
        (directory / names[1]).write_text(f"{usage}\n")
        (directory / "memory.stat").write_text(stat)

    assert available() == system  # no cgroup files, no membership
    membership.write_text("0::/system.slice/serve.service\n")
    cgroup(root, "max", 5000)
    assert available() == system  # a cgroup with no limit
    cgroup(root / "system.slice" / "serve.service", 1 << 30, 5000, "anon 1000\ninactive_file 3000\n")
    assert available() == (1 << 30) - 2000  # the service's own limit (not the root's), less its unreclaimable usage
    cgroup(root / "system.slice", 1 << 29, 1 << 28)
    assert available() == 1 << 28  # its parent's leaves less
    membership.write_text("12:cpu,cpuacct:/\n4:memory:/jobs/one\n")  # v1: the memory controller's line
    (root / "memory.max").unlink()
    cgroup(root / "memory", (1 << 63) - 4096, 10, v1=True)  # v1 writes no limit as a huge number
    assert available() == system
    cgroup(root / "memory" / "jobs" / "one", 1 << 31, 1 << 30, "inactive_file 5\ntotal_inactive_file 1024\n", v1=True)
    assert available() == (1 << 31) - (1 << 30) + 1024
    assert devices.available_memory(str(tmp_path / "nothing"), str(tmp_path / "none"), str(tmp_path / "no")) is None
    assert devices.available_memory() is None or devices.available_memory() > 0  # this machine's, where it says


def test_the_sessions_estimate_counts_a_graph_s_external_data(tiny_artifact_dir, tmp_path):
    """A graph whose weights are in files beside it (an export over 2 GB) counts them: the graph file alone is
    a few kilobytes."""
    import json
    import shutil

    from transduce.formats.contract import ENCODER_FILE

    inline = planning.session_bytes(tiny_artifact_dir, BackendSpec())
    copy = tmp_path / "artifact"
    shutil.copytree(tiny_artifact_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"][ENCODER_FILE + ".data"] = {**manifest["files"][ENCODER_FILE], "bytes": 3 << 30}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with open(copy / (ENCODER_FILE + ".data"), "wb") as f:
        f.truncate(3 << 30)  # (sparse: no disk taken)
    assert abs(planning.session_bytes(str(copy), BackendSpec()) - (inline + (3 << 30) * 1.4)) <= 1


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
