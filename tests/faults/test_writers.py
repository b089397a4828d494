"""Faults while writing, each a real `transduce` process: kill -9 in the middle of an export and of a training
run's save, a disk that fills up, two writers of one output, a corrupt artifact. Each asserts what is left on
disk: the previous copy whole, no partial output, the next run cleaning up after the killed one."""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

from transduce.io.reaping import tmp_prefix

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals and rlimits")


def transduce(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "transduce.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def finished(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def digest(path) -> str:
    """The sha256 of every file under `path`, together: equal digests, the same bytes."""
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for name in sorted(files):
            with open(os.path.join(root, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()


def temporary_copies(parent, base: str) -> list[str]:
    return [n for n in os.listdir(parent) if n.startswith(tmp_prefix(base))]


def kill_when(proc: subprocess.Popen, ready, timeout: float = 120) -> None:
    """SIGKILL `proc` as soon as `ready()` holds."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "never got there"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.fixture()
def exported(tiny_model_dir, tiny_artifact_dir, tmp_path):
    """A copy of the tiny model's export, to be written over."""
    out = tmp_path / "artifact"
    shutil.copytree(tiny_artifact_dir, out)
    return out


def test_an_export_killed_mid_write_leaves_the_previous_artifact_and_the_next_cleans_up(tiny_model_dir, exported):
    before = digest(exported)
    proc = transduce("export", tiny_model_dir, "--out", str(exported), "--force", "--quiet")
    kill_when(proc, lambda: temporary_copies(exported.parent, "artifact"))
    assert digest(exported) == before  # the previous artifact, untouched
    assert temporary_copies(exported.parent, "artifact")  # what the kill left
    code, err = finished(transduce("decode", str(exported), "--beam-size", "1", stdin=subprocess.PIPE))
    assert code == 0, err
    code, err = finished(transduce("export", tiny_model_dir, "--out", str(exported), "--force", "--quiet"))
    assert code == 0, err
    assert not temporary_copies(exported.parent, "artifact")  # the next export removed it


def test_an_export_that_fills_the_disk_leaves_nothing_behind(tiny_model_dir, tmp_path):
    """A file-size limit of 16 KiB stands in for a disk that fills up mid-export (the tiny model's graphs are
    larger): a clear error, no partial output, no temporary copy."""
    out = tmp_path / "full"

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, 16 * 1024))

    code, err = finished(transduce("export", tiny_model_dir, "--out", str(out), "--quiet", preexec_fn=small_disk))
    assert code == 2 and err.startswith("error:") and "Traceback" not in err, err
    assert not out.exists() and not temporary_copies(tmp_path, "full"), os.listdir(tmp_path)


def test_a_second_writer_of_one_directory_is_refused_at_once(tiny_model_dir, exported):
    """While another process writes the artifact (this one holds its lock, as an export does), an export into it
    is refused at once, naming that process, and leaves the artifact as it was and nothing of it holding the lock
    (the next writer takes it)."""
    from transduce.io.locks import output_lock

    before = digest(exported)
    with output_lock(exported, "the artifact"):
        code, err = finished(transduce("export", tiny_model_dir, "--out", str(exported), "--force", "--quiet"))
    assert code == 2 and "is being written by" in err and f"PID {os.getpid()}" in err, err
    assert digest(exported) == before and not temporary_copies(exported.parent, "artifact")
    with output_lock(exported, "the artifact"):  # nothing of the refused writer holds it
        pass


def test_a_corrupt_artifact_is_refused_and_nothing_is_written(exported, tmp_path):
    graph = exported / "encoder.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    out = tmp_path / "translations.txt"
    proc = transduce("decode", str(exported), "--out", str(out), stdin=subprocess.PIPE)
    _, err = proc.communicate("one two\n", timeout=120)
    assert proc.returncode == 2 and err.startswith("error:") and "encoder.onnx" in err, err
    assert "Traceback" not in err and not out.exists()


def test_a_training_run_killed_while_saving_keeps_its_previous_checkpoint_and_resumes(tmp_path, small_corpus):
    from transduce.io.parallel import write_tsv
    from transduce.models.checkpoint import load_model_dir

    train_pairs, valid_pairs = small_corpus
    write_tsv(tmp_path / "train.tsv", train_pairs[:200])
    out = tmp_path / "model"
    args = ["train", "--data", str(tmp_path / "train.tsv"), "--out", str(out), "--quiet", "--threads", "1",
            "--valid-size", "10", "--vocab-size", "200", "--max-tokens", "400", "--eval-every", "1000",
            "--save-every", "1", "--set", "d_model=32", "--set", "d_ff=64", "--set", "n_heads=2"]
    proc = transduce(*args, "--max-steps", "1000")
    # the first checkpoint written, then killed while a later one is being written
    kill_when(proc, lambda: (out / "training" / "state.json").exists() and temporary_copies(tmp_path, "model"))
    load_model_dir(str(out))  # the previous checkpoint, whole
    code, err = finished(transduce(*args, "--max-steps", "6", "--resume"))
    assert code == 0, err
    assert not temporary_copies(tmp_path, "model")
    load_model_dir(str(out))
