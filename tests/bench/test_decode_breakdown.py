"""scripts/decode_breakdown.py: it runs over each CPU backend and its parts add up to the whole decode.
No timing assertions."""

from __future__ import annotations

import importlib.util
import os
import re
import threading

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "decode_breakdown.py")


def _script():
    spec = importlib.util.spec_from_file_location("decode_breakdown", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parts(out: str) -> dict[str, float]:
    return {m[1].strip(): float(m[2]) for m in re.finditer(r"^\s+([a-z /:]+?)\s+([\d.]+) ms", out, re.M)}


@pytest.mark.parametrize("backend,beam", [("onnxruntime", 1), ("onnxruntime", 3), ("torch", 2)])
def test_breakdown_parts_add_up(tiny_artifact_dir, tiny_model_dir, capsys, backend, beam):
    _script().main([tiny_artifact_dir, "--backend", backend, "--batch", "2", "--beam", str(beam), "--steps", "4",
                    "--src-len", "5", "--threads", "1", "--repeats", "2", "--device", "cpu:0"])  # no GPU sync
    parts = _parts(capsys.readouterr().out)
    top = ["encoder", "begin / end", "step", "search"] + (["reorder"] if beam > 1 else [])
    assert set(top) <= set(parts), parts
    # with two repeats every median is a mean, so the parts' medians add up to the total's (to the
    # printed 0.001 ms); with more they need not
    assert sum(parts[p] for p in top) == pytest.approx(parts["total"], abs=0.005)
    if backend == "onnxruntime":
        assert parts["run"] > 0 and parts["run"] <= parts["step"]
        if beam > 1:
            assert parts["moves"] <= parts["reorder"]
    else:
        assert "run" not in parts


def test_breakdown_refuses_bad_sizes(tiny_artifact_dir):
    with pytest.raises(SystemExit):
        _script().main([tiny_artifact_dir, "--steps", "0"])


def test_the_timer_waits_for_queued_device_work_at_each_clock():
    """A GPU backend's call only queues its kernels: the sync before each clock reading puts their time
    in the part that queued them, not in the next one that reads a result."""
    events = []

    class Backend:
        def encode(self):
            events.append("encode")

    timer = _script().Timer(sync=lambda: events.append("sync"))
    be = Backend()
    timer.wrap(be, "encode", "encoder")
    be.encode()
    assert events == ["sync", "encode", "sync"] and timer.total[0, "encoder"] > 0  # part 0: outside every part


def _timed_decode_one(timer, encode=lambda: None, pause=lambda: None):
    """A decode_one wrapped to open a part, which calls a timed backend.encode twice, pause() after each."""

    class Backend:
        def encode(self):
            encode()

    be = Backend()
    timer.wrap(be, "encode", "encoder")

    class Decoding:
        @staticmethod
        def decode_one():
            for _ in range(2):
                be.encode()
                pause()

    timer.wrap(Decoding, "decode_one", "decode", opens_part=True)
    return Decoding.decode_one


def test_the_timer_keeps_parts_apart_that_one_thread_ran():
    """Parts are told apart by the call that opens them, not by thread: two parts decoded one after the other
    in one thread (a pool thread that took two parts, or the calling thread) are two parts, and a part's
    calls from its own thread are its own while another thread runs another part."""
    timer = _script().Timer()
    decode_one = _timed_decode_one(timer)
    decode_one()
    decode_one()
    worker = threading.Thread(target=decode_one)
    worker.start()
    worker.join()
    assert sorted(timer.total) == [(p, label) for p in (1, 2, 3) for label in ("decode", "encoder")]


def test_the_timer_keeps_parts_apart_that_run_at_the_same_time():
    """Two parts in two threads, each inside its part while the other calls the backend (a barrier holds
    them there): each call is counted in its own thread's part, and nothing falls to part 0."""
    timer = _script().Timer()
    seen: dict[str, set] = {}
    both_inside = threading.Barrier(2)
    decode_one = _timed_decode_one(
        timer, encode=lambda: seen.setdefault(threading.current_thread().name, set()).add(timer.current.part),
        pause=lambda: both_inside.wait(timeout=10))
    threads = [threading.Thread(target=decode_one, name=f"part-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(len(parts) for parts in seen.values()) == [1, 1]  # one part per thread, kept across its calls
    assert set.union(*seen.values()) == {1, 2}
    assert sorted(timer.total) == [(p, label) for p in (1, 2) for label in ("decode", "encoder")]


def test_breakdown_of_a_batch_decoded_in_parts(tiny_artifact_dir, capsys):
    """Where the backend decodes the batch in parts at the same time, the parts are per part: they add up to a
    part's decode, which is at most the decode's wall time; --whole breaks the batch down whole."""
    args = [tiny_artifact_dir, "--batch", "4", "--beam", "2", "--steps", "4", "--src-len", "5", "--threads", "2",
            "--repeats", "2"]
    _script().main(args)
    out = capsys.readouterr().out
    assert "decoded in 2 parts at the same time" in out
    parts = _parts(out)
    top = ["encoder", "begin / end", "step", "reorder", "search"]
    assert all(parts[p] >= 0 for p in top) and parts["run"] > 0
    assert sum(parts[p] for p in top) <= parts["total"] + 0.005
    _script().main(args + ["--whole"])
    out = capsys.readouterr().out
    parts = _parts(out)
    assert "parts" not in out and sum(parts[p] for p in top) == pytest.approx(parts["total"], abs=0.005)
