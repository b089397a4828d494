"""Session fixtures built by a process of their own from the start of a test run that needs them.

Training the demo model takes about 45 s of one core and each export a few seconds; the tests before their first
user run mostly on one core of two, so the other builds them meanwhile. Each is built by the same function, with
the same seeds and one thread, as the fixture would call in-process: the same files. A fixture asks `built(request,
name)` for its path, which waits for the build; None where it was not built in the background (a run that did not
need it at its start, or TRANSDUCE_TEST_DEMO_MODEL set), and then the fixture builds it in-process.

Under pytest-xdist every worker collects every test: the first worker to claim the run's shared directory starts
the one builder, the others wait for its files. The builder then outlives its worker's session (another worker may
still wait for it) and ends with the run: it watches the xdist controller, the workers' parent.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO

import pytest

# fixture name -> the function that builds it: function(path, paths), paths holding the names built before it.
# In the order the test files first use them.
BUILDS = {
    "demo_model_dir": "tests.conftest:train_demo_model",
    "demo_artifact_dir": "tests.conftest:export_demo_artifact",
    "long_artifact_dir": "tests.serve.conftest:export_long_artifact",
    "wide_artifact_dir": "tests.serve.conftest:export_wide_artifact",
}
_DEMO = ("demo_model_dir", "demo_artifact_dir")  # left to TRANSDUCE_TEST_DEMO_MODEL where it is set
CLAIM_WAIT_S = 60.0  # how long a worker waits for the pid of the builder another worker claimed to start
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Builds:
    proc: subprocess.Popen | None  # the builder, where this process started it
    paths: dict[str, str]
    parent: str
    log: IO[str] | None  # its log, where this process started it
    shared: bool = False  # the run's workers share it (pytest-xdist): it is left to end with the run
    since: float = 0.0  # when this process found or started the builds

    def done(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.parent, name + ".done"))

    def failed(self) -> str | None:
        """The builder's log where it has ended (or never started) without finishing, else None."""
        if os.path.exists(os.path.join(self.parent, "failed")):  # its own word: an exited child of another
            ended = True  # worker stays a zombie, which os.kill still finds, until that worker reaps it
        elif self.proc is not None:
            ended = self.proc.poll() is not None
        else:
            try:
                with open(os.path.join(self.parent, "pid")) as f:
                    pid = int(f.read())
                os.kill(pid, 0)
                ended = _zombie(pid)  # (killed outright: no word of its own)
            except (FileNotFoundError, ValueError):  # (being written by the worker that claimed the directory)
                ended = time.monotonic() - self.since > CLAIM_WAIT_S
            except (ProcessLookupError, PermissionError):  # (gone; its number reused by another user's process)
                ended = True
        if not ended:
            return None
        try:
            with open(os.path.join(self.parent, "build.log")) as f:
                return f.read()
        except FileNotFoundError:
            return "(the worker that claimed the builds never started them)"


_KEY = pytest.StashKey[Builds]()


def in_worker() -> bool:
    """Whether this process is a pytest-xdist worker."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


def run_dir(tmp_path_factory) -> str:
    """The directory of this test run that all its xdist workers share (a worker's basetemp is the run's /gwN);
    without workers, the run's basetemp."""
    base = tmp_path_factory.getbasetemp()
    return str(base.parent if in_worker() else base)


def start(session) -> None:
    """Start building what the collected tests need, or find the builder another xdist worker started
    (pytest_collection_finish)."""
    config = session.config
    if config.option.collectonly:
        return
    needed = set().union(*(getattr(item, "fixturenames", ()) for item in session.items))
    names = [n for n in BUILDS if n in needed and not (n in _DEMO and os.environ.get("TRANSDUCE_TEST_DEMO_MODEL"))]
    if not names:
        return
    shared = in_worker()
    if shared:
        parent = os.path.join(run_dir(config._tmp_path_factory), "background-builds")
        try:
            os.mkdir(parent)  # the claim: one worker wins it
        except FileExistsError:
            paths = {name: os.path.join(parent, name, "out") for name in names}
            config.stash[_KEY] = Builds(None, paths, parent, None, True, time.monotonic())
            return
    else:
        parent = tempfile.mkdtemp(prefix="transduce-test-builds-")
    paths = {name: os.path.join(parent, name, "out") for name in names}
    log = open(os.path.join(parent, "build.log"), "w+")  # closed by stop()
    code = "import sys; sys.path.insert(0, 'tests'); from background import main; main(sys.argv[1])"
    plan = json.dumps({"parent": parent, "paths": paths, "watch": os.getppid() if shared else None})
    proc = subprocess.Popen([sys.executable, "-c", code, plan], cwd=_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    with open(os.path.join(parent, "pid.tmp"), "w") as f:
        f.write(str(proc.pid))
    os.replace(os.path.join(parent, "pid.tmp"), os.path.join(parent, "pid"))
    config.stash[_KEY] = Builds(proc, paths, parent, log, shared, time.monotonic())


def stop(session) -> None:
    """End the builds (a run stopped early: -x, Ctrl-C) and remove what they wrote (pytest_sessionfinish)."""
    builds = session.config.stash.get(_KEY, None)
    if builds is None or builds.shared:  # (a shared builder ends with the run; pytest removes old basetemps)
        return
    if builds.proc.poll() is None:
        builds.proc.kill()
        builds.proc.wait()
    builds.log.close()
    shutil.rmtree(builds.parent, ignore_errors=True)


def built(request, name: str) -> str | None:
    """The path fixture `name` was built into in the background, once it is there; None if it is not built there."""
    builds = request.config.stash.get(_KEY, None)
    if builds is None or name not in builds.paths:
        return None
    while not builds.done(name):
        log = builds.failed()
        if log is not None and not builds.done(name):
            raise AssertionError(f"building {name} in the background failed:\n{log}")
        time.sleep(0.05)
    return builds.paths[name]


def main(plan_json: str) -> None:
    """The background process: each build in turn, a marker file after each."""
    import torch

    torch.set_num_threads(1)
    plan = json.loads(plan_json)
    paths = plan["paths"]
    if plan.get("watch"):
        _end_with(plan["watch"])
    try:
        for name, path in paths.items():
            module, function = BUILDS[name].split(":")
            os.makedirs(os.path.dirname(path))
            getattr(importlib.import_module(module), function)(path, paths)
            with open(os.path.join(plan["parent"], name + ".done"), "w"):
                pass
    except BaseException:
        with open(os.path.join(plan["parent"], "failed"), "w"):  # read by every waiting worker (Builds.failed)
            pass
        raise


def _end_with(pid: int) -> None:
    """A thread that ends this process once process `pid` (the xdist controller) has gone."""
    import threading

    def watch() -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


def _zombie(pid: int) -> bool:
    """Whether process `pid` has exited and waits to be reaped (Linux; False where /proc cannot say)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False
