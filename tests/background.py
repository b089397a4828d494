"""Session fixtures built by a process of their own from the start of a test run that needs them.

Training the demo model takes about 45 s of one core and each export a few seconds; the tests before their first
user run mostly on one core of two, so the other builds them meanwhile. Each is built by the same function, with
the same seeds and one thread, as the fixture would call in-process: the same files. A fixture asks `built(request,
name)` for its path, which waits for the build; None where it was not built in the background (a run that did not
need it at its start, or TRANSDUCE_TEST_DEMO_MODEL set), and then the fixture builds it in-process.
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
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Builds:
    proc: subprocess.Popen
    paths: dict[str, str]
    parent: str
    log: IO[str]

    def done(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.parent, name + ".done"))


_KEY = pytest.StashKey[Builds]()


def start(session) -> None:
    """Start building what the collected tests need (pytest_collection_finish)."""
    config = session.config
    if config.option.collectonly:
        return
    needed = set().union(*(getattr(item, "fixturenames", ()) for item in session.items))
    names = [n for n in BUILDS if n in needed and not (n in _DEMO and os.environ.get("TRANSDUCE_TEST_DEMO_MODEL"))]
    if not names:
        return
    parent = tempfile.mkdtemp(prefix="transduce-test-builds-")
    paths = {name: os.path.join(parent, name, "out") for name in names}
    log = open(os.path.join(parent, "build.log"), "w+")  # closed by stop()
    code = "import sys; sys.path.insert(0, 'tests'); from background import main; main(sys.argv[1])"
    plan = json.dumps({"parent": parent, "paths": paths})
    proc = subprocess.Popen([sys.executable, "-c", code, plan], cwd=_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    config.stash[_KEY] = Builds(proc, paths, parent, log)


def stop(session) -> None:
    """End the builds (a run stopped early: -x, Ctrl-C) and remove what they wrote (pytest_sessionfinish)."""
    builds = session.config.stash.get(_KEY, None)
    if builds is None:
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
        if builds.proc.poll() is not None and not builds.done(name):
            builds.log.seek(0)
            raise AssertionError(f"building {name} in the background failed:\n{builds.log.read()}")
        time.sleep(0.05)
    return builds.paths[name]


def main(plan_json: str) -> None:
    """The background process: each build in turn, a marker file after each."""
    import torch

    torch.set_num_threads(1)
    plan = json.loads(plan_json)
    paths = plan["paths"]
    for name, path in paths.items():
        module, function = BUILDS[name].split(":")
        os.makedirs(os.path.dirname(path))
        getattr(importlib.import_module(module), function)(path, paths)
        with open(os.path.join(plan["parent"], name + ".done"), "w"):
            pass
