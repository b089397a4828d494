"""An engine directory's description, engine.json: written, read and checked here (transduce.build writes
the engines; transduce.runtime.backends.tensorrt_backend runs them).

  ENGINE_DIR/
    encoder.plan         serialized TensorRT engine of encoder.onnx
    decoder_step.plan    serialized TensorRT engine of decoder_step.onnx
    engine.json          what was built, for what, and from what: engine format version, TensorRT
                         version, GPU name and compute capability, precision, the optimization
                         profiles and the limits they came from, the artifact's path, contract
                         version and manifest sha256, the sha256 of the source ONNX files, and
                         {name: {sha256, bytes}} of every other file in the directory
    manifest.json        the artifact itself, hard-linked from ARTIFACT_DIR (copied where links are
    config.json          impossible): the engine directory is self-contained, it is also a valid
    tokenizer.json       artifact (the onnxruntime backend and `transduce parity` read it), and an
    encoder.onnx         engine can be rebuilt from it if the original artifact is gone
    decoder_step.onnx    (plus <graph>.onnx.data where the export has external weights)

Reading refuses, with a message naming `transduce build ARTIFACT_DIR --out ENGINE_DIR --force`, an engine
directory built with another TensorRT version or on another GPU (compute capability or name: a plan is
specific to both; `compatibility_problems` compares, with the TensorRT version and GPU given), a plan or
copied file whose sha256 changed, a missing file, or another engine format or contract version.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass
from typing import Any

from transduce.errors import ArtifactError, EngineError
from transduce.formats.artifact import Artifact
from transduce.formats.contract import CONTRACT_VERSION, ENCODER_FILE, STEP_FILE
from transduce.formats.kinds import ENCODER_PLAN, ENGINE_KIND, ENGINE_MANIFEST_FILE, MANIFEST_FILE, is_model_dir
from transduce.formats.profiles import EnginePlan, plan_from_meta
from transduce.io.atomic import write_json
from transduce.io.files import listed_file_problem
from transduce.io.paths import require_directory
from transduce.io.pinned import ATTEMPTS, PinnedDir, Replaced, await_replacement, read_pinned

ENGINE_FORMAT_VERSION = 1
STEP_PLAN = "decoder_step.plan"
# graph name -> (ONNX file, plan file)
GRAPHS: dict[str, tuple[str, str]] = {
    "encoder": (ENCODER_FILE, ENCODER_PLAN),
    "decoder_step": (STEP_FILE, STEP_PLAN),
}
@dataclass(frozen=True)
class RuntimeInfo:
    """What a plan must match to be loaded: the TensorRT version and the GPU."""

    tensorrt_version: str
    gpu_name: str
    compute_capability: str  # "major.minor"


def compatibility_problems(meta: dict[str, Any], runtime: RuntimeInfo) -> list[str]:
    """Why a plan described by engine.json cannot be loaded on `runtime` (empty: it can). Pure.

    A serialized TensorRT plan is specific to the TensorRT version that built it (unless built
    version-compatible, which transduce does not do: the lean runtime is slower) and to the GPU:
    kernels are compiled for one compute capability and tactics timed on one model, so both the
    compute capability and the GPU name must match.
    """
    problems = []
    built = str(meta.get("tensorrt", {}).get("version"))
    if built != runtime.tensorrt_version:
        problems.append(f"it was built with TensorRT {built} and this is TensorRT {runtime.tensorrt_version} "
                        "(a plan loads only in the TensorRT version that built it)")
    gpu = meta.get("gpu", {})
    cc, name = str(gpu.get("compute_capability")), str(gpu.get("name"))
    if cc != runtime.compute_capability:
        problems.append(f"it was built for compute capability {cc} ({name}) and this GPU, {runtime.gpu_name}, "
                        f"has compute capability {runtime.compute_capability}")
    elif name != runtime.gpu_name:
        problems.append(f"it was built on a {name} and this GPU is a {runtime.gpu_name} (TensorRT times and picks "
                        "kernels for one GPU model)")
    return problems


def rebuild_command(engine_dir: str, meta: dict[str, Any] | None = None) -> str:
    """The command that rebuilds `engine_dir`: from the recorded artifact, or from the engine dir itself."""
    artifact = (meta or {}).get("artifact")
    artifact = artifact.get("path") if isinstance(artifact, dict) else None
    if not isinstance(artifact, str) or not artifact or not os.path.isfile(os.path.join(artifact, MANIFEST_FILE)):
        artifact = engine_dir if os.path.isfile(os.path.join(engine_dir, MANIFEST_FILE)) else "ARTIFACT_DIR"
    return f"transduce build {artifact} --out {engine_dir} --force"


def _refuse(engine_dir: str, meta: dict[str, Any] | None, what: str) -> ArtifactError:
    return ArtifactError(f"engine directory {engine_dir!r}: {what}",
                         hint=f"rebuild the engines with: {rebuild_command(engine_dir, meta)}")


@dataclass(frozen=True, eq=False)
class EngineDir:
    """An engine directory, read and checked once (EngineDir.load): engine.json, its profile plan, and the copy
    of the artifact it holds, every file through one handle on the directory (io.pinned)."""

    path: str  # absolute
    meta: dict[str, Any]  # engine.json
    plan: EnginePlan
    artifact: Artifact  # the artifact copied into it, read through the same handle
    files: PinnedDir

    @classmethod
    def load(cls, engine_dir: str | os.PathLike, verify_hashes: bool = True,
             runtime: RuntimeInfo | None = None) -> EngineDir:
        """Read and check ENGINE_DIR (see _read); raise ArtifactError naming the rebuild command."""
        engine_dir = os.path.abspath(os.fspath(engine_dir))
        if not await_replacement(engine_dir):  # a replace under way: between its two renames
            require_directory(engine_dir, ArtifactError, "a TensorRT engine directory", "engine directory",
                              "give the directory transduce build wrote (--out)",
                              f"build one with: transduce build ARTIFACT_DIR --out {engine_dir}")
        try:
            return read_pinned(engine_dir, lambda pinned: _read(pinned, verify_hashes, runtime))
        except Replaced:
            raise ArtifactError(f"{engine_dir!r} was replaced while it was being loaded, {ATTEMPTS} times (another "
                                "process is building into it)", hint="load it again once that build is done") from None

    def file(self, name: str) -> str:
        """A path of file `name` as it was checked, for a library that opens files by name."""
        return self.files.path_of(name)

    def verify_files(self) -> None:
        """Every file engine.json lists against its sha256, through the handles its load opened (a load with
        verify_hashes=False checked their sizes only)."""
        for name, info in self.meta["files"].items():
            problem = listed_file_problem(self.files, name, info, True, listed_in=ENGINE_MANIFEST_FILE,
                                          changed="after the build")
            if problem:
                raise _refuse(self.path, self.meta, problem)

    def check_runtime(self, runtime: RuntimeInfo) -> None:
        """Refuse plans built for another TensorRT version or GPU than `runtime` (compatibility_problems)."""
        problems = compatibility_problems(self.meta, runtime)
        if problems:
            raise _refuse(self.path, self.meta, "cannot be loaded here: " + "; ".join(problems))


def read_engine_manifest(engine_dir: str | os.PathLike, verify_hashes: bool = True,
                         runtime: RuntimeInfo | None = None) -> dict[str, Any]:
    """engine.json, read and checked (EngineDir.load)."""
    return EngineDir.load(engine_dir, verify_hashes, runtime).meta


def _read(pinned: PinnedDir, verify_hashes: bool, runtime: RuntimeInfo | None) -> EngineDir:
    """Checks, in order: engine.json exists and parses; kind and engine format version; the contract version;
    every file engine.json lists exists with its size (and sha256 unless verify_hashes=False), the plans
    included; the copied artifact manifest is a valid artifact of the same contract version whose graphs are
    the ones the plans were built from; then, with given `runtime`, that its TensorRT version and GPU are the
    ones the plans were built for (the runtime layer reads them from tensorrt and torch.cuda:
    transduce.runtime.backends.tensorrt_support)."""
    engine_dir = pinned.path
    path = pinned.display(ENGINE_MANIFEST_FILE)
    if not pinned.is_file(ENGINE_MANIFEST_FILE):
        if pinned.is_file(MANIFEST_FILE):
            raise ArtifactError(f"{engine_dir!r} is an exported artifact, not a TensorRT engine directory",
                                hint=f"build engines from it with: transduce build {engine_dir} --out ENGINE_DIR, "
                                     "then decode with --backend tensorrt ENGINE_DIR")
        if is_model_dir(engine_dir):
            raise ArtifactError(f"{engine_dir!r} is a model directory, not a TensorRT engine directory",
                                hint=f"export it, then build engines: transduce export {engine_dir} --out "
                                     "ARTIFACT_DIR && transduce build ARTIFACT_DIR --out ENGINE_DIR")
        raise ArtifactError(f"{path} is missing: {engine_dir!r} is not a TensorRT engine directory",
                            hint="build one with: transduce build ARTIFACT_DIR --out ENGINE_DIR")
    try:
        meta = pinned.read_json(ENGINE_MANIFEST_FILE)
    except (OSError, ValueError) as e:
        raise _refuse(engine_dir, None, f"{ENGINE_MANIFEST_FILE} is unreadable or not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("kind") != ENGINE_KIND:
        raise _refuse(engine_dir, None, f"{ENGINE_MANIFEST_FILE} is not a transduce engine manifest")
    if meta.get("engine_format_version") != ENGINE_FORMAT_VERSION:
        raise _refuse(engine_dir, meta, f"it has engine format version {meta.get('engine_format_version')}; "
                                        f"this transduce reads version {ENGINE_FORMAT_VERSION}")
    if meta.get("contract_version") != CONTRACT_VERSION:
        raise _refuse(engine_dir, meta, f"it was built for IO contract version {meta.get('contract_version')}; "
                                        f"this transduce uses version {CONTRACT_VERSION}")
    for key in ("artifact", "tensorrt", "gpu", "profiles"):  # what the checks below and the backend read
        if not isinstance(meta.get(key), dict):
            raise _refuse(engine_dir, meta, f"{ENGINE_MANIFEST_FILE} has no {key!r} record (an object), "
                                            "or another kind of value")
    files = meta.get("files")
    required = {ENCODER_PLAN, STEP_PLAN, MANIFEST_FILE, ENCODER_FILE, STEP_FILE}
    if not isinstance(files, dict) or not required <= set(files):
        raise _refuse(engine_dir, meta, f"{ENGINE_MANIFEST_FILE} does not list {sorted(required)}")
    for name, info in files.items():
        problem = listed_file_problem(pinned, name, info, verify_hashes, listed_in=ENGINE_MANIFEST_FILE,
                                      changed="after the build")
        if problem:
            raise _refuse(engine_dir, meta, problem)
    try:  # the backend chooses its profiles from this record
        plan = plan_from_meta(meta)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, EngineError) as e:
        raise _refuse(engine_dir, meta, f"{ENGINE_MANIFEST_FILE} has an unreadable profiles record "
                                        f"({type(e).__name__}: {e})") from None
    if not (plan.encoder and plan.decoder_step) or any(p.cache_len is None for p in plan.decoder_step):
        raise _refuse(engine_dir, meta, f"{ENGINE_MANIFEST_FILE} records no encoder or no decoder step profiles, "
                                        "or a step profile without its cache length")
    sources = meta.get("sources")
    if not isinstance(sources, dict) or not all(isinstance(v, dict) for v in sources.values()):
        raise _refuse(engine_dir, meta, f"{ENGINE_MANIFEST_FILE} does not record the graphs the plans were built from")
    try:
        copy = Artifact.read(pinned, verify_hashes=False)
    except ArtifactError as e:
        raise _refuse(engine_dir, meta, f"its copy of the artifact is not usable ({e.args[0]})") from None
    artifact = copy.manifest
    for graph, (onnx_name, _) in GRAPHS.items():
        want = sources.get(onnx_name, {}).get("sha256")
        have = artifact["files"].get(onnx_name, {}).get("sha256")
        if not want or want != have:
            raise _refuse(engine_dir, meta, f"{MANIFEST_FILE} describes another {onnx_name} than the one "
                                            f"{graph} was built from")
    if artifact.get("precision") != meta.get("precision"):
        raise _refuse(engine_dir, meta, f"engine precision {meta.get('precision')} differs from the artifact's "
                                        f"{artifact.get('precision')}")
    if runtime is not None:
        problems = compatibility_problems(meta, runtime)
        if problems:
            raise _refuse(engine_dir, meta, "cannot be loaded here: " + "; ".join(problems))
    return EngineDir(engine_dir, meta, plan, copy, pinned)




def engine_manifest(precision: str, build_seconds: dict[str, float], tensorrt: dict[str, Any], gpu: dict[str, Any],
                    plan: EnginePlan, graphs: dict[str, Any], artifact: dict[str, Any], files: dict[str, Any],
                    tools: dict[str, str]) -> dict[str, Any]:
    """engine.json's content for a build: what was built (graphs, files), with what (tensorrt, tools), for
    which GPU and limits (gpu, the plan's limits and profiles) and from what (artifact, the source graphs)."""
    return {
        "kind": ENGINE_KIND,
        "engine_format_version": ENGINE_FORMAT_VERSION,
        "contract_version": CONTRACT_VERSION,
        "precision": precision,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": build_seconds,
        "tensorrt": tensorrt,
        "gpu": gpu,
        "limits": plan.limits,
        "profiles": {"encoder": [p.to_dict() for p in plan.encoder],
                     "decoder_step": [p.to_dict() for p in plan.decoder_step]},
        "graphs": graphs,
        "artifact": artifact,
        "sources": {onnx: dict(files[onnx]) for onnx, _ in GRAPHS.values()},
        "tools": tools,
        "files": files,
    }


def write_engine_manifest(directory: str, meta: dict[str, Any]) -> None:
    write_json(os.path.join(directory, ENGINE_MANIFEST_FILE), meta)
