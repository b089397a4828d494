"""Faults of `transduce train --nproc N`'s launcher, each a real run of it: a killed launcher, a launcher whose
SIGINT was ignored when it started (a background job of a script), a rank it has to stop itself, more ranks than
the machine has. Each asserts what is left: processes, the output's lock, the last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from tests.training.test_distributed import (  # noqa: F401 - corpus: the fixture
    CFG,
    _args,
    _children,
    _command,
    _wait_for_checkpoint,
    corpus,
    signalled,
)
from transduce.errors import ConfigError
from transduce.io.locks import output_lock
from transduce.training import launch

pytestmark = pytest.mark.filterwarnings("ignore:warmup .* >= max_steps")

LONG = replace(CFG, max_steps=10_000, save_every=2, eval_every=10_000, collective_timeout=60)


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie nobody reaped yet has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _checkpoint_is_whole(out) -> int:
    """The run's last checkpoint loads: -> its step."""
    from transduce.models.checkpoint import load_model_dir

    load_model_dir(str(out))
    return json.loads((out / "training" / "state.json").read_text())["step"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the ranks from /proc")
def test_a_killed_launcher_takes_its_ranks_and_the_lock_with_it(tmp_path, corpus):  # noqa: F811
    data_dir, _, _ = corpus
    out = tmp_path / "orphaned"
    proc = subprocess.Popen(_command(_args(LONG, data_dir, out), 2), stderr=subprocess.DEVNULL)
    ranks = {}
    try:
        _wait_for_checkpoint(out, proc, 2)
        ranks = _children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in ranks.values()), "ranks outlived their launcher"
    finally:
        for pid in ranks.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    _lock_frees(out, deadline=time.monotonic() + 30)  # no rank holds it
    assert _checkpoint_is_whole(out) >= 2


def _lock_frees(out, deadline: float) -> None:
    """Takes `out`'s lock, once it is free. A killed rank's leader thread shows as a zombie while its other threads
    still exit, and their shared files (the lock's among them) close with the last one: it may take a moment."""
    from transduce.errors import TransduceError

    while True:
        try:
            with output_lock(out, "the model directory"):
                return
        except TransduceError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_sigint_stops_a_launcher_that_started_with_it_ignored(tmp_path, corpus):  # noqa: F811
    """A background job of a script starts with SIGINT ignored; `kill -INT` of its launcher still stops every rank
    after the same step, with a checkpoint, as Ctrl-C does."""
    data_dir, _, _ = corpus
    out = tmp_path / "background"
    code, err = signalled(_args(LONG, data_dir, out), out, signal.SIGINT, timeout=45,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert code == 128 + signal.SIGINT, err
    step = _checkpoint_is_whole(out)
    assert f"interrupted at step {step} of" in err and "Traceback" not in err, err


def test_a_rank_the_launcher_stops_is_said_to_be_stopped_by_it(monkeypatch):
    """Rank 0 failed and rank 1 hangs: past the timeout the launcher kills rank 1 and says so, and why; it does not
    then blame a SIGKILL from outside."""
    monkeypatch.setattr(launch, "KILL_AFTER_S", 0.2)
    procs = [subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"]),
             subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])]
    logged: list[str] = []
    try:
        status = launch._wait(procs, 0.3, [], logged.append)
    finally:
        procs[1].kill()
    text = "\n".join(logged)
    assert status == 3
    assert "killed by SIGKILL" not in text, text
    assert f"rank 1 of 2 (pid {procs[1].pid}) was still running" in text and "the launcher killed it" in text, text
    assert "rank 0 failed" in text, text


def test_more_ranks_than_cpus_is_warned_and_more_than_gpus_refused(tmp_path, monkeypatch):
    logged: list[str] = []
    monkeypatch.setattr(launch, "usable_cpus", lambda: 1)
    # ranks that fail at once (no such data): the warning comes before they start
    args = ["--data", str(tmp_path / "missing.tsv"), "--out", str(tmp_path / "m"), "--quiet"]
    assert launch.launch(args, 2, log=logged.append) == 2
    assert any("2 ranks on 1 CPU" in line for line in logged), logged
    monkeypatch.setattr(launch, "gpu_count", lambda: 1)
    with pytest.raises(ConfigError, match="2 ranks on cuda, but this machine has 1 GPU") as e:
        launch.launch(args, 2, device="cuda", log=logged.append)
    assert e.value.params == ("nproc",)
    assert not (tmp_path / "m").exists()


def test_where_the_os_sends_no_parent_death_signal_a_rank_watches_its_launcher(tmp_path):
    """watch_launcher's thread (macOS and the like): the rank gets SIGTERM once its launcher is gone."""
    rank = ("import os, signal, time, sys; from transduce.training.launch import watch_launcher; "
            "signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], 'w').write('SIGTERM'), os._exit(0))); "
            "watch_launcher(every_s=0.05, anywhere=True); time.sleep(60)")
    launcher = ("import os, subprocess, sys; env = dict(os.environ, TRANSDUCE_LAUNCHER_PID=str(os.getpid())); "
                f"subprocess.Popen([sys.executable, '-c', {rank!r}, sys.argv[1]], env=env)")
    out = tmp_path / "said"
    subprocess.run([sys.executable, "-c", launcher, str(out)], check=True, timeout=60)  # it exits at once
    deadline = time.monotonic() + 30
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.read_text() == "SIGTERM"
    assert launch.watch_launcher() is None  # not a rank of a launcher: nothing to watch
