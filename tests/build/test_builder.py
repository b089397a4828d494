"""The TensorRT engine builder: profiles, engine.json and its refusals, the build command.

Everything here runs without TensorRT or a GPU: the pure parts directly, the build itself against
the test double in tests/tensorrt_fake.py. Building real engines is tested in
tests/runtime/test_tensorrt_backend.py under the gpu marker.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import time

import pytest
import tensorrt_fake as fake
from artifact_edits import edit_json
from click.testing import CliRunner

from tests.io.test_locks import abandoned_copy, lock_held_elsewhere
from transduce.build import builder
from transduce.build.builder import build_engines, parser_errors
from transduce.build.progress import make_progress_monitor
from transduce.cli.build import build as build_cmd
from transduce.errors import ArtifactError, BackendUnavailable, EngineError
from transduce.formats import contract
from transduce.formats.artifact import read_manifest
from transduce.formats.engine import (
    ENGINE_FORMAT_VERSION,
    ENGINE_MANIFEST_FILE,
    STEP_PLAN,
    RuntimeInfo,
    compatibility_problems,
    read_engine_manifest,
)
from transduce.formats.kinds import ENCODER_PLAN, ENGINE_KIND
from transduce.formats.model_config import ModelConfig
from transduce.formats.profiles import (
    SPLIT_MIN_BATCH,
    AxisRange,
    EnginePlan,
    choose_chunks,
    derive_profiles,
    ort_tensorrt_profile_options,
    plan_from_meta,
    profile_shapes,
)
from transduce.io.files import file_entries
from transduce.io.reaping import tmp_prefix
from transduce.runtime.backends.tensorrt_support import (
    check_engine,
    device_index,
    gpu_info,
    import_tensorrt,
    make_logger,
)

CFG = ModelConfig(max_positions=256, decoder_layers=2, n_heads=4, d_model=32, vocab_size=100)


# -- profiles -------------------------------------------------------------------------------------


def test_default_profiles_respect_limits_and_multiply_beams():
    plan = derive_profiles(CFG)  # max_batch 16, beam 4: two profiles
    assert plan.limits["max_src_len"] == 128 and plan.limits["max_tgt_len"] == 178
    assert [p.name for p in plan.encoder] == ["latency", "throughput"]
    assert (plan.encoder[0].batch.min, plan.encoder[-1].batch.max) == (1, 16)
    assert (plan.decoder_step[0].batch.min, plan.decoder_step[-1].batch.max) == (1, 64)
    for enc, step in zip(plan.encoder, plan.decoder_step):
        assert step.batch.max == enc.batch.max * 4 and step.batch.opt == enc.batch.opt * 4
        assert enc.cache_len is None and step.cache_len is not None
        for r in (enc.batch, enc.src_len, step.batch, step.src_len, step.cache_len):
            assert 1 <= r.min <= r.opt <= r.max
        assert step.src_len.max == 128 and step.cache_len.max == 178


@pytest.mark.parametrize("max_batch", range(1, 21))
@pytest.mark.parametrize("beam", [1, 2, 4, 5])
def test_profiles_cover_every_batch_once(max_batch, beam):
    plan = derive_profiles(CFG, max_batch=max_batch, beam=beam)
    for profiles, top in ((plan.encoder, max_batch), (plan.decoder_step, max_batch * beam)):
        covered = [n for p in profiles for n in range(p.batch.min, p.batch.max + 1)]
        assert sorted(covered) == list(range(1, top + 1))  # contiguous, no overlap
    assert len(plan.encoder) == (2 if max_batch >= SPLIT_MIN_BATCH else 1)


def test_small_model_limits_default_to_max_positions():
    plan = derive_profiles(CFG.replace(max_positions=64), max_batch=2, beam=1)
    assert plan.limits["max_src_len"] == 64 and plan.limits["max_tgt_len"] == 64
    assert plan.decoder_step[0].cache_len == AxisRange(1, 32, 64)


@pytest.mark.parametrize("kwargs,needle", [
    ({"max_tgt_len": 300}, "max_positions"),
    ({"max_src_len": 257}, "max_positions"),
    ({"max_batch": 0}, "--max-batch"),
    ({"beam": -1}, "--beam"),
    ({"max_src_len": 0}, "--max-src-len"),
    ({"opt_batch": 32}, "--opt-batch 32 is larger than --max-batch 16"),
    ({"opt_tgt_len": 200}, "--opt-tgt-len"),
    ({"profiles": "many"}, "unknown profiles mode"),
    ({"profiles": "split", "max_batch": 2}, "--profiles split needs"),
])
def test_impossible_limits_are_clear_errors(kwargs, needle):
    with pytest.raises(EngineError) as e:
        derive_profiles(CFG, **kwargs)
    assert needle in str(e.value)


def test_forced_modes_and_opt_placement():
    single = derive_profiles(CFG, max_batch=32, profiles="single", opt_batch=4)
    assert len(single.decoder_step) == 1 and single.decoder_step[0].batch == AxisRange(1, 16, 128)
    split = derive_profiles(CFG, max_batch=4, beam=2, profiles="split", opt_batch=4)
    assert [p.batch.as_list() for p in split.decoder_step] == [[1, 2, 4], [5, 8, 8]]
    assert EnginePlan.from_dict(json.loads(json.dumps(split.to_dict()))) == split


def test_profile_shapes_follow_the_contract():
    plan = derive_profiles(CFG, max_batch=4, beam=2, max_src_len=10, max_tgt_len=12)
    enc = profile_shapes(plan.encoder[0], "encoder", CFG)
    assert enc == {"src_ids": ((1, 1), (2, 5), (4, 10)), "src_lengths": ((1,), (2,), (4,))}
    step = profile_shapes(plan.decoder_step[0], "decoder_step", CFG)
    assert set(step) == {s.name for s in contract.step_inputs(2)}
    assert step["past_key_1"] == ((1, 4, 1, 8), (4, 4, 6, 8), (8, 4, 12, 8))
    assert step["cross_value_0"] == ((1, 4, 1, 8), (4, 4, 5, 8), (8, 4, 10, 8))
    assert step["tokens"] == ((1,), (4,), (8,))
    opts = ort_tensorrt_profile_options(plan.encoder[0], "encoder", CFG)
    assert opts == {"trt_profile_min_shapes": "src_ids:1x1,src_lengths:1",
                    "trt_profile_opt_shapes": "src_ids:2x5,src_lengths:2",
                    "trt_profile_max_shapes": "src_ids:4x10,src_lengths:4"}


def test_chunks_pick_profiles_and_split_wide_batches():
    plan = derive_profiles(CFG, max_batch=8, beam=2, max_src_len=20, max_tgt_len=30)  # rows 1-4 | 5-16
    step = plan.decoder_step
    assert choose_chunks(3, step, 10, 30) == [(0, 3, 0)]
    assert choose_chunks(12, step, 10, 30) == [(0, 12, 1)]
    assert choose_chunks(37, step, 20, 1) == [(0, 16, 1), (16, 32, 1), (32, 37, 1)]
    assert choose_chunks(18, step, 20, 1) == [(0, 16, 1), (16, 18, 0)]
    with pytest.raises(EngineError, match="--max-src-len 21"):
        choose_chunks(1, step, 21, 5)
    with pytest.raises(EngineError, match="--max-tgt-len 31"):
        choose_chunks(1, step, 5, 31)
    assert choose_chunks(9, plan.encoder, 20) == [(0, 8, 1), (8, 9, 0)]
    for profiles, cache in ((plan.encoder, None), (step, 5)):  # below every profile: no rebuild flag to name
        with pytest.raises(EngineError, match="a source of 0 tokens is shorter than every profile takes"):
            choose_chunks(1, profiles, 0, cache)


# -- engine.json and refusals -------------------------------------------------------------------


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_model_dir):
    return fake.make_artifact(str(tmp_path_factory.mktemp("art") / "artifact"), tiny_model_dir)


def _hand_made_engine_dir(path, artifact_dir, runtime=None):
    """An engine directory written by hand: dummy plan bytes, a correct engine.json."""
    runtime = runtime or fake.runtime_info()
    shutil.copytree(artifact_dir, path)
    for name in (ENCODER_PLAN, STEP_PLAN):
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"dummy plan bytes for " + name.encode())
    files = file_entries(path, sorted(os.listdir(path)))
    manifest = read_manifest(artifact_dir)
    meta = {"kind": ENGINE_KIND, "engine_format_version": ENGINE_FORMAT_VERSION,
            "contract_version": contract.CONTRACT_VERSION, "precision": "fp32",
            "tensorrt": {"version": runtime.tensorrt_version},
            "gpu": {"name": runtime.gpu_name, "compute_capability": runtime.compute_capability, "index": 0},
            "profiles": derive_profiles(ModelConfig.from_dict(manifest["model"]), max_batch=2).to_dict(),
            "artifact": {"path": artifact_dir},
            "sources": {n: files[n] for n in (contract.ENCODER_FILE, contract.STEP_FILE)},
            "files": files}
    with open(os.path.join(path, ENGINE_MANIFEST_FILE), "w") as f:
        json.dump(meta, f)
    return str(path)


def _edit_meta(engine_dir, **changes):
    p = os.path.join(engine_dir, ENGINE_MANIFEST_FILE)
    with open(p) as f:
        meta = json.load(f)
    meta.update(changes)
    with open(p, "w") as f:
        json.dump(meta, f)


def test_engine_manifest_accepted_on_matching_runtime(tmp_path, artifact):
    d = _hand_made_engine_dir(tmp_path / "e", artifact)
    meta = read_engine_manifest(d, runtime=fake.runtime_info())
    assert meta["precision"] == "fp32"
    assert read_engine_manifest(d)["kind"] == ENGINE_KIND


def test_compatibility_problems_is_pure():
    meta = {"tensorrt": {"version": "10.13.3.9"}, "gpu": {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}}
    same = RuntimeInfo("10.13.3.9", "NVIDIA H100 80GB HBM3", "9.0")
    assert compatibility_problems(meta, same) == []
    (p,) = compatibility_problems(meta, RuntimeInfo("11.1.0.2", "NVIDIA H100 80GB HBM3", "9.0"))
    assert "TensorRT 10.13.3.9" in p and "TensorRT 11.1.0.2" in p
    (p,) = compatibility_problems(meta, RuntimeInfo("10.13.3.9", "NVIDIA A100-SXM4-80GB", "8.0"))
    assert "compute capability 9.0" in p and "8.0" in p
    (p,) = compatibility_problems(meta, RuntimeInfo("10.13.3.9", "NVIDIA H200", "9.0"))
    assert "NVIDIA H200" in p
    assert len(compatibility_problems(meta, RuntimeInfo("11.0", "NVIDIA L4", "8.9"))) == 2


def _refusal(engine_dir, runtime=None, **kw):
    with pytest.raises(ArtifactError) as e:
        read_engine_manifest(engine_dir, runtime=runtime or fake.runtime_info(), **kw)
    msg = str(e.value)
    assert "transduce build" in msg and "--force" in msg and f"--out {engine_dir}" in msg
    return msg


def test_refuses_other_tensorrt_version(tmp_path, artifact):
    d = _hand_made_engine_dir(tmp_path / "e", artifact, RuntimeInfo("10.0.1.6", "NVIDIA Fake H100", "9.0"))
    msg = _refusal(d)
    assert "TensorRT 10.0.1.6" in msg and f"transduce build {artifact} --out" in msg


def test_refuses_other_gpu(tmp_path, artifact):
    d = _hand_made_engine_dir(tmp_path / "e", artifact, RuntimeInfo(fake.__version__, "NVIDIA A10", "8.6"))
    assert "compute capability 8.6" in _refusal(d)


def test_refuses_tampered_plan(tmp_path, artifact):
    d = _hand_made_engine_dir(tmp_path / "e", artifact)
    with open(os.path.join(d, STEP_PLAN), "r+b") as f:
        f.write(b"X")  # same size, other bytes
    assert "decoder_step.plan does not match its sha256" in _refusal(d)
    read_engine_manifest(d, runtime=fake.runtime_info(), verify_hashes=False)  # sizes only: accepted


def test_refuses_hand_edited_entries(tmp_path, artifact):
    """engine.json edited by hand: each a refusal naming it, never an AttributeError or a file outside."""
    for i, (edit, says) in enumerate([
        (lambda m: m["files"].__setitem__(ENCODER_PLAN, 5), "does not give encoder.plan as"),
        (lambda m: m.__setitem__("sources", ["x"]), "does not record the graphs"),
        (lambda m: m["files"].__setitem__("/etc/hostname", {"sha256": "0" * 64, "bytes": 1}), "not a file name inside"),
        (lambda m: m["files"].__setitem__("../e0/engine.json", {"sha256": "0" * 64, "bytes": 1}),
         "not a file name inside"),
        (lambda m: m.__setitem__("artifact", None), "no 'artifact' record"),
        (lambda m: m.__setitem__("profiles", None), "no 'profiles' record"),
        (lambda m: m.__setitem__("gpu", "H100"), "no 'gpu' record"),
        (lambda m: m.__setitem__("tensorrt", "10"), "no 'tensorrt' record"),
        (lambda m: m.__setitem__("profiles", {}), "unreadable profiles record (KeyError"),
        (lambda m: m.__setitem__("profiles", {"encoder": "x", "decoder_step": "y"}), "unreadable profiles record"),
        (lambda m: m.__setitem__("profiles", {"encoder": [{"name": "all"}], "decoder_step": []}),
         "unreadable profiles"),
        (lambda m: m["profiles"].__setitem__("decoder_step", []), "records no encoder or no decoder step profiles"),
    ]):
        d = _hand_made_engine_dir(tmp_path / f"e{i}", artifact)
        edit_json(d, ENGINE_MANIFEST_FILE, edit)
        assert says in _refusal(d)


def test_a_model_dir_or_a_file_given_as_an_engine_dir_says_so(tmp_path, tiny_model_dir):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ArtifactError, match="is a file, not a TensorRT engine directory"):
        read_engine_manifest(str(tmp_path / "afile"), runtime=fake.runtime_info())
    with pytest.raises(ArtifactError, match="is a model directory, not a TensorRT engine directory") as e:
        read_engine_manifest(tiny_model_dir, runtime=fake.runtime_info())
    assert f"transduce export {os.path.abspath(tiny_model_dir)} --out ARTIFACT_DIR" in str(e.value)


def test_refuses_missing_file(tmp_path, artifact):
    d = _hand_made_engine_dir(tmp_path / "e", artifact)
    os.remove(os.path.join(d, ENCODER_PLAN))
    assert "encoder.plan is missing" in _refusal(d)


def test_refuses_other_contract_and_format_versions(tmp_path, artifact):
    d = _hand_made_engine_dir(tmp_path / "e", artifact)
    _edit_meta(d, contract_version=contract.CONTRACT_VERSION + 1)
    assert "IO contract version" in _refusal(d)
    _edit_meta(d, contract_version=contract.CONTRACT_VERSION, engine_format_version=99)
    assert "engine format version 99" in _refusal(d)


def test_refuses_copied_artifact_from_another_export(tmp_path, artifact):
    d = _hand_made_engine_dir(tmp_path / "e", artifact)
    _edit_meta(d, sources={contract.ENCODER_FILE: {"sha256": "0" * 64}, contract.STEP_FILE: {"sha256": "0" * 64}})
    assert "describes another encoder.onnx" in _refusal(d)


def test_an_artifact_is_not_an_engine_dir(tmp_path, artifact):
    with pytest.raises(ArtifactError, match="is an exported artifact, not a TensorRT engine directory") as e:
        read_engine_manifest(artifact, runtime=fake.runtime_info())
    assert f"transduce build {artifact}" in str(e.value)
    with pytest.raises(ArtifactError, match="does not exist"):
        read_engine_manifest(tmp_path / "nowhere")


def test_rebuild_hint_falls_back_to_the_engine_dir(tmp_path, artifact):
    d = _hand_made_engine_dir(tmp_path / "e", artifact)
    _edit_meta(d, artifact={"path": str(tmp_path / "moved-away")})
    _edit_meta(d, contract_version=0)
    assert f"transduce build {d} --out {d} --force" in _refusal(d)


# -- building against the test double ----------------------------------------------------------


def _build(artifact, out, **kw):
    lines = []
    meta = build_engines(artifact, out, _trt=fake, _gpu=dict(fake.FAKE_GPU), log=lines.append, **kw)
    return meta, lines


def test_build_writes_a_self_contained_engine_dir(tmp_path, artifact):
    fake.CALLS.clear()
    cache = tmp_path / "caches" / "timing.cache"
    out = str(tmp_path / "engines")
    meta, lines = _build(artifact, out, max_batch=8, beam=2, timing_cache=str(cache), workspace_gb=0.5)
    assert sorted(os.listdir(out)) == sorted([ENCODER_PLAN, STEP_PLAN, ENGINE_MANIFEST_FILE] + os.listdir(artifact))
    assert read_engine_manifest(out, runtime=fake.runtime_info()) == meta
    assert read_manifest(out)["precision"] == "fp32"  # also a valid artifact
    assert os.stat(os.path.join(out, "tokenizer.json")).st_ino == os.stat(
        os.path.join(artifact, "tokenizer.json")).st_ino
    assert meta["artifact"]["path"] == artifact and meta["artifact"]["copied_as"] == "hard links"
    assert meta["gpu"]["compute_capability"] == "9.0" and meta["tensorrt"]["version"] == fake.__version__
    assert [p["name"] for p in meta["profiles"]["decoder_step"]] == ["latency", "throughput"]
    assert meta["sources"][contract.STEP_FILE]["sha256"] == (
        read_manifest(artifact)["files"][contract.STEP_FILE]["sha256"])
    builds = [c[1] for c in fake.CALLS if c[0] == "build"]
    assert [b["graph"] for b in builds] == ["encoder", "decoder_step"]
    assert all("TF32" not in b["flags"] and b["workspace"] == 1 << 29 and b["profiles"] == 2 for b in builds)
    assert cache.read_bytes() == b"[encoder][decoder_step]" and meta["tensorrt"]["timing_cache_loaded"] is False
    assert any("Building engine" in line for line in lines)  # progress monitor, non-terminal: one line per phase
    meta2, lines2 = _build(artifact, out, max_batch=8, beam=2, timing_cache=str(cache), force=True)
    assert meta2["tensorrt"]["timing_cache_loaded"] is True
    assert cache.read_bytes() == b"[encoder][decoder_step]" * 2
    assert any("loaded 23 bytes" in line for line in lines2)


def test_an_engine_whose_output_shapes_are_not_the_contracts_is_refused(tmp_path, artifact):
    """The runtime sizes output buffers by the contract: an engine computing another fixed size (a
    vocabulary, d_model) is refused when it loads, before it could write past a buffer."""
    meta, _ = _build(artifact, str(tmp_path / "e"), max_batch=2)
    with open(tmp_path / "e" / ENCODER_PLAN, "rb") as f:
        plan = json.loads(f.read())
    config = ModelConfig.from_dict(read_manifest(artifact)["model"])
    profiles = plan_from_meta(meta).encoder
    assert check_engine(fake, fake.ICudaEngine(plan), "encoder", config, "fp32", profiles) == []
    for out in plan["outputs"]:
        if out[0] == "memory":
            out[2] = out[2][:-1] + [out[2][-1] * 2]
    problems = check_engine(fake, fake.ICudaEngine(plan), "encoder", config, "fp32", profiles)
    assert problems == [f"encoder engine output memory has dims [-1, -1, {2 * config.d_model}], the contract says "
                        f"['batch', 'src_len', {config.d_model}]"]


def test_build_survives_a_foreign_timing_cache(tmp_path, artifact):
    cache = tmp_path / "t.cache"
    cache.write_bytes(b"OTHER-GPU cache")
    meta, lines = _build(artifact, str(tmp_path / "e"), max_batch=2, timing_cache=str(cache), tf32=True)
    assert any("another GPU or TensorRT version" in line for line in lines)
    # another GPU's cache is left as it is: this build's cache is not written over it
    assert cache.read_bytes() == b"OTHER-GPU cache" and meta["tensorrt"]["tf32"] is True
    assert any("timing cache: not saved" in line and "is left as it is" in line for line in lines)
    assert not any("saved to" in line for line in lines)


def test_build_survives_an_unreadable_timing_cache(tmp_path, artifact):
    """TensorRT's create_timing_cache returns None (not an empty cache) for bytes it cannot read."""
    cache = tmp_path / "t.cache"
    cache.write_bytes(b"CORRUPT cache")
    meta, lines = _build(artifact, str(tmp_path / "e"), max_batch=2, timing_cache=str(cache))
    assert any("not one this TensorRT can read (Serialization assertion failed" in line for line in lines)
    assert meta["tensorrt"]["timing_cache_loaded"] is False and cache.read_bytes() == b"CORRUPT cache"
    assert any("not saved" in line and "is not one this TensorRT can read" in line for line in lines)


def test_one_tensorrt_logger_per_process(monkeypatch):
    """TensorRT keeps the first logger it is given: every build and backend shares one trt.ILogger, and
    each TrtLog sees the errors logged while it lives."""
    import gc

    first, second = [], []
    a, b = make_logger(fake, first.append), make_logger(fake, second.append)
    assert a.ilogger is b.ilogger
    a.ilogger.log(fake.ILogger.Severity.ERROR, "out of memory")
    a.ilogger.log(fake.ILogger.Severity.INFO, "chatter")
    assert a.recent() == b.recent() == "out of memory" and first == second == ["[tensorrt] error: out of memory"]
    del b
    gc.collect()
    a.ilogger.log(fake.ILogger.Severity.WARNING, "slow tactic")
    assert first[-1] == "[tensorrt] warning: slow tactic" and len(a.ilogger.views) == 1

    def broken(msg):  # a sink that fails (a closed pipe) keeps the message from no one else
        raise BrokenPipeError

    c = make_logger(fake, broken)
    a.ilogger.log(fake.ILogger.Severity.ERROR, "build failed")
    assert first[-1] == "[tensorrt] error: build failed" and c.recent() == "build failed"


def test_timing_cache_path_is_checked_before_building(tmp_path, artifact, monkeypatch):
    (tmp_path / "afile").write_text("x")
    fake.CALLS.clear()
    for bad in (tmp_path / "afile" / "t.cache", tmp_path, tmp_path / "e" / "trt.cache"):
        with pytest.raises(EngineError, match="--timing-cache"):
            _build(artifact, str(tmp_path / "e"), max_batch=2, timing_cache=str(bad))
    assert not [c for c in fake.CALLS if c[0] == "build"] and not os.path.exists(tmp_path / "e")
    # inside --out, it would make --out appear during the build (which then throws it away) or be deleted
    # with the engine directory it replaces
    _build(artifact, str(tmp_path / "e"), max_batch=2)
    with pytest.raises(EngineError, match="is inside --out"):
        _build(artifact, str(tmp_path / "e"), max_batch=2, timing_cache=str(tmp_path / "e" / "trt.cache"), force=True)
    shutil.rmtree(tmp_path / "e")

    write = builder.write_bytes_atomic
    cache = str(tmp_path / "t.cache")

    def full_disk(path, data):  # for the cache only, which is saved after the builds
        if path == cache:
            raise OSError(28, "No space left on device")
        write(path, data)

    monkeypatch.setattr(builder, "write_bytes_atomic", full_disk)
    meta, lines = _build(artifact, str(tmp_path / "e"), max_batch=2, timing_cache=cache)
    assert any("could not save the timing cache" in line for line in lines)
    assert os.path.isfile(tmp_path / "e" / ENCODER_PLAN)


def test_a_second_build_into_one_out_is_refused_at_once(tmp_path, artifact, monkeypatch):
    """Before the artifact is read (its hashes: seconds at the big preset) or TensorRT builds anything, naming the
    build that runs; its temporary copy is left alone."""
    def must_not_read(*args, **kwargs):
        raise AssertionError("the artifact was read")

    monkeypatch.setattr(builder.Artifact, "load", must_not_read)
    fake.CALLS.clear()
    out = tmp_path / "e"
    with lock_held_elsewhere(out) as pid:
        theirs = abandoned_copy(tmp_path, f"{tmp_prefix('e')}{pid}-building")  # the first build's, being written
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=f"the engine directory '{out}' is being written by PID {pid}"):
            _build(artifact, str(out), max_batch=2, force=True)
        assert time.monotonic() - t0 < 1
        assert sorted(os.listdir(tmp_path)) == sorted([theirs, ".e.lock"]) and fake.CALLS == []


def test_a_build_the_disk_has_no_room_for_is_refused_before_tensorrt(tmp_path, tiny_model_dir, monkeypatch):
    """The plans take about their graphs' bytes (the weights), and the artifact's files are hard-linked beside
    them on the same file system."""
    from transduce.io import paths

    art = fake.make_artifact(str(tmp_path / "art"), tiny_model_dir, encoder_bytes=b"e" * 3_000_000,
                             step_bytes=b"s" * 2_000_000)
    monkeypatch.setattr(paths, "free_bytes", lambda path: 10_000_000)
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # refused before TensorRT is looked for
    out = tmp_path / "e"
    with pytest.raises(EngineError) as e:
        build_engines(art, out, max_batch=2)
    need = (5_000_000 + builder.OTHER_ENGINE_BYTES) / 1e6
    assert f"the build needs about {need:.1f} MB on the disk of '{out}', which has 10.0 MB free" in str(e.value)
    assert "free some disk space" in e.value.hint and not out.exists()


def test_builds_share_a_timing_cache_and_a_save_finding_another_leaves_it_to_that_one(tmp_path, artifact):
    """The timing cache is locked only while it is written back: a build whose save finds another build saving
    keeps its engines and leaves the file to that one."""
    cache = tmp_path / "t.cache"
    with lock_held_elsewhere(cache) as pid:
        meta, lines = _build(artifact, str(tmp_path / "e"), max_batch=2, timing_cache=str(cache))
        assert any("could not save the timing cache" in line and f"PID {pid}" in line for line in lines), lines
    assert os.path.isfile(tmp_path / "e" / ENCODER_PLAN) and not cache.exists()
    _build(artifact, str(tmp_path / "e2"), max_batch=2, timing_cache=str(cache))
    assert cache.read_bytes() == b"[encoder][decoder_step]" and sorted(os.listdir(tmp_path)) == ["e", "e2", "t.cache"]


def test_a_gpu_index_past_the_last_gpu_is_a_clear_error(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(BackendUnavailable, match="there is no CUDA device 1: PyTorch sees 1"):
        gpu_info("cuda:1")
    with pytest.raises(BackendUnavailable, match="CUDA device -1 does not exist"):
        device_index(-1)


def test_parser_errors_name_file_and_nodes(tmp_path, tiny_model_dir):
    art = fake.make_artifact(str(tmp_path / "bad"), tiny_model_dir, step_bytes=b"BAD graph")
    out = tmp_path / "e"
    with pytest.raises(EngineError) as e:
        _build(art, str(out))
    msg = str(e.value)
    assert os.path.join(art, contract.STEP_FILE) in msg and "2 error(s)" in msg
    assert "node 7, '/decoder/attn/Where', op Where [UNSUPPORTED_NODE]: unsupported condition type" in msg
    assert "node 9" in msg and "fmod=0" in msg
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".e.")]


def test_build_destination_rules(tmp_path, artifact):
    out = str(tmp_path / "e")
    _build(artifact, out, max_batch=2)
    with pytest.raises(EngineError, match="already exists"):
        _build(artifact, out, max_batch=2)
    with pytest.raises(EngineError, match="is the artifact directory"):
        _build(artifact, artifact, force=True)
    empty = tmp_path / "empty"
    empty.mkdir()  # mkdir -p: nothing to lose, no --force needed
    _build(artifact, str(empty), max_batch=2)
    assert (empty / "engine.json").is_file()
    other = tmp_path / "notes"
    other.mkdir()
    (other / "x.txt").write_text("keep me")
    with pytest.raises(EngineError, match="not an engine directory"):
        _build(artifact, str(other), force=True)
    meta, _ = _build(out, out, max_batch=2, force=True)  # rebuild in place from the engine dir's own artifact copy
    assert meta["artifact"]["path"] == out
    read_engine_manifest(out, runtime=fake.runtime_info())
    with pytest.raises(EngineError, match="inside the artifact"):  # export --force of it would delete them
        _build(artifact, os.path.join(artifact, "engines"), max_batch=2)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(EngineError, match="cannot be created: .*afile' is not a directory"):
        _build(artifact, str(tmp_path / "afile" / "sub" / "e"), max_batch=2)


def test_arguments_are_checked_before_tensorrt_is_looked_for(tmp_path, artifact, tiny_model_dir, monkeypatch):
    """On a machine without TensorRT, a bad argument is named, not hidden behind 'TensorRT is not installed'."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    out = str(tmp_path / "e")
    for kw, says in ((dict(workspace_gb=float("nan")), "--workspace-gb must be a number > 0"),
                     (dict(workspace_gb=float("inf")), "--workspace-gb"),
                     (dict(timing_cache=str(tmp_path)), "--timing-cache"),
                     (dict(device="cpu"), "CUDA devices only")):
        with pytest.raises((EngineError, BackendUnavailable), match=says):
            build_engines(artifact, out, max_batch=2, **kw)
    with pytest.raises(ArtifactError, match="is a model directory, not an exported artifact") as e:
        build_engines(tiny_model_dir, out)
    assert f"transduce export {tiny_model_dir} --out ARTIFACT_DIR" in str(e.value)
    assert not os.path.exists(out)


def test_progress_monitor_draws_bars_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    mon = make_progress_monitor(fake, "encoder", enabled=True, stream=out)
    mon.phase_start("Building engine", None, 2)
    mon.phase_start("Tactic timing", "Building engine", 5)
    assert all(mon.step_complete("Tactic timing", s) is True for s in range(5))
    mon.phase_finish("Tactic timing")
    assert mon.step_complete("unknown phase", 0) is True  # never raises, never cancels
    mon.phase_finish("Building engine")
    mon.close()
    assert "encoder: Building engine" in out.getvalue() and "Tactic timing" in out.getvalue()
    assert mon.phases == [(0, "Building engine", 2), (1, "Tactic timing", 5)]


def test_missing_tensorrt_is_backend_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(BackendUnavailable) as e:
        import_tensorrt()
    assert "TensorRT is not installed" in str(e.value) and "pip install 'transduce[gpu]'" in str(e.value)


def test_old_tensorrt_is_refused(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="8.6.1"))
    with pytest.raises(BackendUnavailable, match="TensorRT 8.6.1 is too old"):
        import_tensorrt()


# -- the build command -------------------------------------------------------------------------


@pytest.mark.parametrize("args,needle", [
    (["--max-tgt-len", "1000"], "exceeds the model's max_positions"),
    (["--opt-batch", "32", "--max-batch", "16"], "--opt-batch 32 is larger than --max-batch 16"),
    (["--beam", "0"], "beam must be a positive integer"),
    (["--workspace-gb", "0"], "--workspace-gb must be a number > 0"),
    (["--profiles", "split", "--max-batch", "2"], "--profiles split needs"),
])
def test_build_command_argument_errors(tmp_path, artifact, args, needle):
    res = CliRunner().invoke(build_cmd, [artifact, "--out", str(tmp_path / "e")] + args)
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output
    assert not (tmp_path / "e").exists()


def test_build_command_usage_errors(tmp_path, artifact):
    runner = CliRunner()
    res = runner.invoke(build_cmd, [artifact])
    assert res.exit_code == 2 and "--out" in res.output
    res = runner.invoke(build_cmd, [artifact, "--out", str(tmp_path / "e"), "--profiles", "many"])
    assert res.exit_code == 2 and "many" in res.output
    res = runner.invoke(build_cmd, [artifact, "--out", str(tmp_path / "e"), "--max-batch", "lots"])
    assert res.exit_code == 2 and "lots" in res.output
    res = runner.invoke(build_cmd, [str(tmp_path / "nothing"), "--out", str(tmp_path / "e")])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_build_command_without_tensorrt(tmp_path, artifact, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    res = CliRunner().invoke(build_cmd, [artifact, "--out", str(tmp_path / "e")])
    assert res.exit_code == 2 and "pip install 'transduce[gpu]'" in res.output


def test_build_command_builds(tmp_path, artifact, monkeypatch):
    monkeypatch.setattr(builder, "import_tensorrt", lambda: fake)
    monkeypatch.setattr(builder, "select_gpu", lambda device=0: dict(fake.FAKE_GPU))
    out = tmp_path / "e"
    res = CliRunner().invoke(build_cmd, [artifact, "--out", str(out), "--max-batch", "2", "--beam", "2", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "encoder.plan" in res.output and "profile all" in res.output
    assert (out / ENGINE_MANIFEST_FILE).is_file()


def test_parser_errors_of_the_whole_graph_name_no_node():
    class Err:
        def __init__(self, node):
            self._node = node

        def node(self):
            return self._node

        def code(self):
            return fake.ErrorCode.INVALID_NODE

        def desc(self):
            return "bad"

    class Parser:
        num_errors = 2

        def get_error(self, i):
            return Err([-1, 3][i])

    assert parser_errors(Parser()) == ["the graph [INVALID_NODE]: bad", "node 3 [INVALID_NODE]: bad"]
