"""`transduce train` under signals (a real process: Ctrl-C, SIGTERM as docker stop and timeout send it), and one
writer per model directory."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import TINY

# Python's own SIGINT handler, as in a terminal: a test run started in the background (`cmd &`) passes on an
# ignored SIGINT, which training rightly leaves alone
CLI = ["-c", "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "from transduce.cli import main; main()"]


@pytest.fixture
def corpus(tmp_path, small_corpus):
    train_pairs, valid_pairs = small_corpus
    data, valid = tmp_path / "train.tsv", tmp_path / "valid.tsv"
    data.write_text("".join(f"{s}\t{t}\n" for s, t in train_pairs[:200]))
    valid.write_text("".join(f"{s}\t{t}\n" for s, t in valid_pairs[:4]))
    return str(data), str(valid)


def _train_args(corpus, out, max_steps: int, *more: str) -> list[str]:
    data, valid = corpus
    shape = [a for k, v in TINY.items() for a in ("--set", f"{k}={v}")]
    return [sys.executable, *CLI, "train", "--data", data, "--valid", valid, "--out", str(out), "--vocab-size", "120",
            "--max-steps", str(max_steps), "--warmup", "4", "--max-tokens", "256", "--eval-every", "1",
            "--eval-sentences", "2", "--threads", "1", *shape, *more]


def _start(args) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read_until(proc: subprocess.Popen, prefix: str) -> list[str]:
    """stderr's lines up to the first that starts with `prefix` (the process goes on meanwhile)."""
    lines = []
    deadline = time.monotonic() + 300
    while not lines or not lines[-1].startswith(prefix):
        line = proc.stderr.readline()
        assert line and time.monotonic() < deadline, (lines, proc.communicate())
        lines.append(line)
    return lines


def _step(out) -> int:
    return json.loads((out / "training" / "state.json").read_text())["step"]


@pytest.mark.parametrize("signum, status, name", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")],
                         ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_during_train_saves_the_step_and_resume_continues(tmp_path, corpus, signum, status, name):
    """SIGTERM (docker stop, timeout, a scheduler's preemption) as Ctrl-C: the step finishes, its checkpoint is
    saved and said so (step, directory, how to resume), and the command exits with the signal's status (no
    click "Aborted!"); --resume says where it starts and continues from that step."""
    out = tmp_path / "m"
    proc = _start(_train_args(corpus, out, 100_000))
    before = _read_until(proc, "step ")  # training has logged a step (its validation)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == status, "".join(before) + err
    said = re.search(rf"interrupted at step (\d+) of 100000 by {name}: checkpoint saved in (.*) \(continue with the "
                     r"same command and --resume\)", err)
    assert said and said.group(2) == str(out), err
    assert "Aborted!" not in err and "Traceback" not in err, err
    step = int(said.group(1))
    assert step >= 1 and _step(out) == step

    resumed = subprocess.run(_train_args(corpus, out, step + 2, "--resume"), capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming {out} at step {step} of {step + 2} (--max-steps was 100000)" in resumed.stderr
    assert _step(out) == step + 2 and json.loads(resumed.stdout)["step"] == step + 2


def test_a_second_train_into_the_same_out_is_refused_at_once(tmp_path, corpus):
    """While a run writes --out, another (new or --resume) is refused before it reads anything, naming the first's
    PID; the first is not disturbed and ends normally."""
    out = tmp_path / "m"
    first = _start(_train_args(corpus, out, 6))
    _read_until(first, "model:")  # it holds the lock: stop it there, so that it is still running for sure
    first.send_signal(signal.SIGSTOP)
    try:
        for extra in ((), ("--resume",)):
            second = subprocess.run(_train_args(corpus, out, 6, *extra), capture_output=True, text=True, timeout=300)
            assert second.returncode == 2, second.stderr
            assert second.stderr.startswith(f"error: the model directory '{out}' is being written by PID "
                                             f"{first.pid} "), second.stderr
            assert "model:" not in second.stderr and "warning" not in second.stderr
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert _step(out) == 6


def test_a_signal_during_a_validation_cuts_it_short(tmp_path, small_corpus, monkeypatch):
    """A validation can take minutes and is no part of a checkpoint: a signal during one ends it at once; the step
    is saved without that validation, and the run stops."""
    from dataclasses import replace

    from tests.training.test_train import QUIET, _cfg
    from transduce.training import train as train_module
    from transduce.training.stopping import TrainingStopped

    train_pairs, valid_pairs = small_corpus
    real_evaluate = train_module.evaluate
    calls = []

    def evaluate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # step 2's validation, on its way
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # not reached: the handler raises first
            calls.append("went on")
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(train_module, "evaluate", evaluate)
    out = tmp_path / "m"
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(TrainingStopped) as stopped:
            train_module.train(train_pairs[:100], valid_pairs[:2], str(out), replace(_cfg(6, 1000), eval_every=1),
                               **QUIET)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert calls == [1, 1] and stopped.value.step == 2 and stopped.value.signum == signal.SIGINT
    state = json.loads((out / "training" / "state.json").read_text())
    assert state["step"] == 2 and [h["step"] for h in state["history"]] == [1]


def test_a_second_signal_stops_at_once_and_the_handlers_come_back():
    from transduce.training.stopping import TrainingStopped, stop_after_the_step

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt) as stopped:
            with stop_after_the_step(0) as stopper:
                assert signal.getsignal(signal.SIGINT) is stopper
                assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # its default action: not ours to defer
                os.kill(os.getpid(), signal.SIGINT)
                assert stopper.signum == signal.SIGINT  # taken in: the loop goes on to the end of its step
                os.kill(os.getpid(), signal.SIGINT)
                pytest.fail("a second signal must stop at once")
        assert not isinstance(stopped.value, TrainingStopped)  # nothing was saved
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_watchdogs_deadline_follows_the_work_under_way(monkeypatch):
    """What the SIGTERM watchdog (transduce.cli) is told to wait for: a save is given twice the longest save yet,
    or its size at SAVE_FLOOR_RATE if longer, even before the handler could run; a step twice the longest step;
    a validation nothing (the handler cuts it short); once taken in, at least the time it was taken in."""
    from types import SimpleNamespace

    from transduce.training import stopping

    clock = [1000.0]
    monkeypatch.setattr(stopping, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    stopper = stopping.StopAfterTheStep(save_bytes=int(10 * stopping.SAVE_FLOOR_RATE))
    assert stopper.term_deadline() == 1000.0  # no step timed yet: only the watchdog's own grace
    stopper.longest_step = 3.0
    assert stopper.term_deadline() == 1006.0
    stopper.set_phase("validate")
    assert stopper.term_deadline() == 1000.0
    clock[0] = 1100.0
    with stopper.saving():
        assert stopper.term_deadline() == 1100.0 + 20.0  # 10 s at the floor rate, twice
        clock[0] = 1130.0
    assert stopper.longest_save == 30.0 and stopper.phase == "step"
    with stopper.saving():
        assert stopper.term_deadline() == 1130.0 + 60.0
    stopper.signum, stopper.taken_at = signal.SIGTERM, 1200.0
    assert stopper.term_deadline() == 1200.0
