"""`transduce build`: an exported artifact -> TensorRT engines in an engine directory (its layout and
engine.json: transduce.formats.engine). Needs TensorRT >= 10 and a CUDA GPU.

- the artifact's manifest is read and every file checked against its sha256;
- each graph is parsed with `trt.OnnxParser.parse_from_file`; every parser error is reported with
  its node index, name, operator and description (EngineError naming the file);
- networks are strongly typed (`NetworkDefinitionCreationFlag.STRONGLY_TYPED`): the precision is the
  ONNX graph's own (an fp16 or bf16 export carries Cast nodes around its fp32 islands: LayerNorm,
  softmax, log_softmax), so no precision flag is ever set. TensorRT 10 needs the flag; TensorRT 11
  made strong typing the only mode (the flag is accepted and ignored) and removed BuilderFlag.FP16,
  BF16, INT8 and the precision-constraint flags, which this module therefore never touches.
  EXPLICIT_BATCH is deprecated in 10 and gone from the enum in 11: not used either;
- BuilderFlag.TF32 (on by default in TensorRT) is cleared unless tf32=True: TF32 matmuls round fp32
  inputs to 10-bit mantissas, ~1e-3 relative error, which would break fp32 parity (PyTorch's own
  default is TF32 off for matmuls);
- optimization profiles come from `derive_profiles` (transduce.formats.profiles), one
  `builder.create_optimization_profile()` per profile with `set_shape(name, min, opt, max)` for every
  input, added with `config.add_optimization_profile`;
- `config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_gb * 2**30)`;
- a timing cache (`config.create_timing_cache(bytes)`, `set_timing_cache(cache, ignore_mismatch=False)`)
  is loaded from `timing_cache` if the file exists, shared by both builds, and written back
  atomically after them (`cache.serialize()`). TensorRT rejects a cache from another device or
  version (and bytes it cannot read); the build then starts from an empty cache, says so, and leaves
  that file as it is rather than replace another GPU's cache with this one's;
- a `trt.IProgressMonitor` shows the builder's phases (transduce.build.progress);
- `builder.build_serialized_network(network, config)`; the plans are deserialized again
  (`trt.Runtime.deserialize_cuda_engine`) and their IO names, dtypes and profile shapes checked
  against the contract and the derived profiles before anything is written in place;
- everything is written under `atomic_output`: a failed build leaves no engine directory, and an
  existing one is replaced only with force=True (and only if it is an engine directory);
- one build into an --out at a time: its lock (transduce.io.locks) is taken before the artifact is read,
  and a second build into it is refused at once, naming the process; so is a build the disk has no room for
  (`engine_bytes`). The timing cache is locked only while it is written back: builds of other engines share
  one cache file, and a save that finds another build saving it leaves the file to that one.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transduce.build.progress import make_progress_monitor
from transduce.errors import BackendUnavailable, EngineError, TransduceError
from transduce.formats.artifact import Artifact
from transduce.formats.contract import io_mismatches
from transduce.formats.dtypes import tensorrt_type
from transduce.formats.engine import (
    ENCODER_PLAN,
    ENGINE_MANIFEST_FILE,
    GRAPHS,
    STEP_PLAN,
    engine_manifest,
    write_engine_manifest,
)
from transduce.formats.kinds import MANIFEST_FILE, is_engine_dir
from transduce.formats.profiles import (
    DEFAULT_BEAM,
    DEFAULT_MAX_BATCH,
    EnginePlan,
    derive_profiles,
    graph_inputs,
    graph_outputs,
    profile_shapes,
)
from transduce.io.atomic import atomic_output, write_bytes_atomic
from transduce.io.files import file_entries
from transduce.io.locks import output_lock
from transduce.io.paths import check_creatable, check_free_space, check_replaceable
from transduce.runtime.backends.tensorrt_support import (
    GPU_HINT,
    TrtLog,
    check_engine,
    device_index,
    import_tensorrt,
    make_logger,
    select_gpu,
)

DEFAULT_WORKSPACE_GB = 4.0
# Room for what a build writes besides the plans' weights: their kernels, engine.json
OTHER_ENGINE_BYTES = 16 * 2**20

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def _check_out_path(artifact_dir: str, out_dir: str) -> None:
    """Refuse an --out that cannot take the engines (over or inside the artifact, not creatable), before its lock
    is taken (beside it)."""
    real_out, real_art = os.path.realpath(out_dir), os.path.realpath(artifact_dir)
    out_is_engine = os.path.isfile(os.path.join(out_dir, ENGINE_MANIFEST_FILE))
    if real_out == real_art and not out_is_engine:
        raise EngineError(f"the output directory {out_dir!r} is the artifact directory",
                          hint="choose another --out directory for the engines")
    if real_art.startswith(real_out + os.sep):
        raise EngineError(f"the output directory {out_dir!r} contains the artifact {artifact_dir!r}",
                          hint="choose another --out directory for the engines")
    if real_out.startswith(real_art + os.sep):
        raise EngineError(f"the output directory {out_dir!r} is inside the artifact {artifact_dir!r} (exporting the "
                          "artifact again would delete the engines)",
                          hint="choose an --out directory beside the artifact")
    check_creatable(real_out, EngineError, f"the output directory {out_dir!r}")  # nothing is created yet


def engine_bytes(artifact_dir: str, out_dir: str, manifest: dict[str, Any]) -> int:
    """An estimate of the bytes a build writes: each plan about the size of the graph it is built from (the
    weights, at the graph's precision), OTHER_ENGINE_BYTES, and the artifact's files where they are copied, not
    hard-linked (--out on another file system)."""
    files = manifest["files"]
    need = OTHER_ENGINE_BYTES + sum(entry["bytes"] for name, entry in files.items() for onnx_name, _ in GRAPHS.values()
                                    if name == onnx_name or name.startswith(onnx_name + "."))  # external data too
    try:
        linked = os.stat(artifact_dir).st_dev == os.stat(os.path.dirname(os.path.realpath(out_dir))).st_dev
    except OSError:
        linked = False
    return need if linked else need + sum(entry["bytes"] for entry in files.values())


def _network_flags(trt) -> int:
    """STRONGLY_TYPED: required on TensorRT 10 for graph-defined precision, ignored (always on) in 11."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if flag is None:
        raise BackendUnavailable(f"TensorRT {trt.__version__} has no strongly typed networks", hint=GPU_HINT)
    return 1 << int(flag)


def parser_errors(parser) -> list[str]:
    """Every error of a trt.OnnxParser, with node index, name and operator where this TensorRT has them."""
    out = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        parts = []
        with contextlib.suppress(Exception):
            if e.node() >= 0:  # -1: an error of the whole graph, not of one node
                parts.append(f"node {e.node()}")
        for attr, fmt in (("node_name", "{!r}"), ("node_operator", "op {}")):
            fn = getattr(e, attr, None)
            if fn is not None:
                with contextlib.suppress(Exception):
                    v = fn()
                    if v:
                        parts.append(fmt.format(v))
        code = ""
        with contextlib.suppress(Exception):
            c = e.code()
            code = str(getattr(c, "name", None) or c).split(".")[-1]
        where = ", ".join(parts) if parts else "the graph"
        out.append(f"{where}{f' [{code}]' if code else ''}: {e.desc()}")
    return out


def _network_io(network) -> tuple[list[tuple[str, str, None]], list[tuple[str, str, None]]]:
    """A parsed network's inputs and outputs as (name, dtype, dims) triples (dims not compared: None)."""
    ins = [(network.get_input(i).name, tensorrt_type(network.get_input(i).dtype), None)
           for i in range(network.num_inputs)]
    outs = [(network.get_output(i).name, tensorrt_type(network.get_output(i).dtype), None)
            for i in range(network.num_outputs)]
    return ins, outs


def _read_timing_cache(path: str | None, log: Log) -> bytes:
    if not path or not os.path.isfile(path):
        return b""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        log(f"timing cache {path} is unreadable ({e}); starting from an empty cache")
        return b""
    log(f"timing cache: loaded {len(data):,} bytes from {path}")
    return data


def _link_or_copy(artifact: Artifact, name: str, dst: str) -> str:
    """The artifact's file `name` as it was checked (held open) into the engine directory: hard-linked where it
    can be, else copied."""
    if artifact.files.link(name, dst):
        return "link"
    shutil.copyfile(artifact.file(name), dst)
    return "copy"


def _tool_versions(trt) -> dict[str, str]:
    import platform

    import transduce

    versions = {"transduce": transduce.__version__, "tensorrt": str(trt.__version__),
                "python": platform.python_version()}
    with contextlib.suppress(Exception):
        import torch

        versions["torch"] = torch.__version__
        versions["cuda"] = str(torch.version.cuda)
    return versions




@dataclass
class _TimingCache:
    """The timing cache both builds share: read from `path` if there is one, written back after them."""

    path: str | None
    data: bytes
    loaded: bool
    cache: Any = None  # the trt.ITimingCache, made by the first build's config
    rejected: str = ""  # why TensorRT refused the file's cache: the file is then left as it is

    def attach(self, bconfig, logger: TrtLog, log: Log) -> None:
        """Give a builder config the shared cache (made from the file's bytes by the first config)."""
        if self.cache is None:
            self.cache = bconfig.create_timing_cache(self.data)
            if self.cache is None:  # unreadable bytes (a truncated file, another format): no cache object at all
                log(f"timing cache {self.path} is not one this TensorRT can read "
                    f"({logger.recent(1) or 'no error reported'}); starting from an empty one")
                self.loaded, self.rejected = False, "is not one this TensorRT can read"
                self.cache = bconfig.create_timing_cache(b"")
        if not bconfig.set_timing_cache(self.cache, False):
            log(f"timing cache {self.path} was made on another GPU or TensorRT version; starting from an empty one")
            self.loaded, self.rejected = False, "was made on another GPU or TensorRT version"
            self.cache = bconfig.create_timing_cache(b"")
            bconfig.set_timing_cache(self.cache, False)

    def save(self, log: Log) -> None:
        if self.path and self.rejected:
            log(f"timing cache: not saved; {self.path} {self.rejected} and is left as it is "
                "(give each GPU and TensorRT version its own --timing-cache file, or delete this one)")
        elif self.path and self.cache is not None:
            try:  # a side product: failing to save it must not throw the engines away
                with output_lock(self.path, "the timing cache", EngineError):  # another build saving it: theirs
                    write_bytes_atomic(self.path, self.cache.serialize())
                log(f"timing cache: saved to {self.path}")
            except (OSError, TransduceError) as e:
                log(f"warning: could not save the timing cache to {self.path} ({e}); the engines are kept")


def _check_build_options(workspace_gb: float, timing_cache: str | os.PathLike | None, out_dir: str) -> str | None:
    """The workspace and the timing cache path, checked before any build; -> the cache's absolute path."""
    if not (isinstance(workspace_gb, (int, float)) and math.isfinite(workspace_gb) and workspace_gb > 0):
        raise EngineError(f"--workspace-gb must be a number > 0, got {workspace_gb}",
                          hint="for example --workspace-gb 4")
    if not timing_cache:
        return None
    timing_cache = os.path.abspath(os.fspath(timing_cache))
    if os.path.isdir(timing_cache):
        raise EngineError(f"--timing-cache {timing_cache!r} is a directory",
                          hint="give a file path, e.g. --timing-cache runs/trt.cache")
    check_creatable(timing_cache, EngineError, f"--timing-cache {timing_cache!r}")
    out_real = os.path.realpath(out_dir)
    if os.path.commonpath([os.path.realpath(timing_cache), out_real]) == out_real:
        # written while the new directory is still being built: it would make --out appear during the
        # run (the build then discarded) or land in the engine directory this build replaces
        raise EngineError(f"--timing-cache {timing_cache!r} is inside --out {out_dir!r}",
                          hint="keep it outside the engine directory, e.g. --timing-cache runs/trt.cache")
    return timing_cache


def _build_graph(trt, builder, logger: TrtLog, cache: _TimingCache, artifact: Artifact, graph: str,
                 plan: EnginePlan, out: str, workspace_gb: float, tf32: bool, progress: bool, log: Log,
                 keep_alive: list) -> dict[str, Any]:
    """Parse, check and build one graph of the artifact into its plan file in `out`; -> its engine.json record.
    The network and parser go into `keep_alive`: they own the weights until every build is done."""
    config, precision = artifact.config, artifact.precision
    onnx_name, plan_name = GRAPHS[graph]
    onnx_path = artifact.files.display(onnx_name)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger.ilogger)
    keep_alive += [network, parser]
    log(f"{graph}: parsing {onnx_name}")
    # within the directory the artifact's checks read (held open), where the parser finds external weights too
    if not parser.parse_from_file(os.path.join(artifact.files.directory_path(), onnx_name)):
        errors = parser_errors(parser) or [logger.recent() or "no error reported"]
        raise EngineError(f"TensorRT's ONNX parser rejected {onnx_path} ({len(errors)} error(s)):\n  "
                          + "\n  ".join(errors),
                          hint="re-export the artifact (transduce export ... --force); if it persists, "
                               "the graph uses an operator or type this TensorRT does not support")
    ins, outs = _network_io(network)
    problems = io_mismatches(f"{onnx_name} input", ins, graph_inputs(graph, config), precision, config, ordered=False)
    problems += io_mismatches(f"{onnx_name} output", outs, graph_outputs(graph, config), precision, config,
                              ordered=False)
    if problems:
        raise EngineError(f"{onnx_path} does not follow the IO contract as TensorRT parses it: "
                          + "; ".join(problems), hint=artifact.rebuild_hint())
    bconfig = builder.create_builder_config()
    bconfig.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    if not tf32 and hasattr(trt.BuilderFlag, "TF32"):
        bconfig.clear_flag(trt.BuilderFlag.TF32)
    cache.attach(bconfig, logger, log)
    monitor = None
    if hasattr(trt, "IProgressMonitor"):
        monitor = make_progress_monitor(trt, graph, enabled=progress, log=log)
        bconfig.progress_monitor = monitor
    for spec in plan.profiles(graph):
        profile = builder.create_optimization_profile()
        for name, (mn, opt, mx) in profile_shapes(spec, graph, config).items():
            profile.set_shape(name, mn, opt, mx)
        if bconfig.add_optimization_profile(profile) < 0:
            raise EngineError(f"TensorRT rejected optimization profile {spec.to_dict()} of {graph}: "
                              f"{logger.recent() or 'invalid profile'}")
    log(f"{graph}: building ({precision}, strongly typed, {len(plan.profiles(graph))} profile(s), "
        f"workspace {workspace_gb:g} GB)")
    t0 = time.perf_counter()
    try:
        serialized = builder.build_serialized_network(network, bconfig)
    finally:
        if monitor is not None:
            monitor.close()
    seconds = time.perf_counter() - t0
    if serialized is None:
        raise EngineError(f"TensorRT could not build {onnx_name}:\n{logger.recent() or 'no error reported'}",
                          hint="see the TensorRT errors above; a larger --workspace-gb or narrower "
                               "limits (--max-batch, --max-src-len, --max-tgt-len) may help")
    write_bytes_atomic(os.path.join(out, plan_name), serialized)
    log(f"{graph}: built in {seconds:.1f} s")
    return {"source": onnx_name, "plan": plan_name, "build_seconds": round(seconds, 2),
            "profiles": len(plan.profiles(graph))}


def _check_plans(trt, logger: TrtLog, out: str, artifact: Artifact, plan: EnginePlan) -> None:
    """The freshly built plans must load and match the contract and profiles before they replace anything."""
    runtime = trt.Runtime(logger.ilogger)
    for graph, (_, plan_name) in GRAPHS.items():
        with open(os.path.join(out, plan_name), "rb") as f:
            engine = runtime.deserialize_cuda_engine(f.read())
        if engine is None:
            raise EngineError(f"the freshly built {plan_name} does not deserialize: "
                              f"{logger.recent() or 'no error reported'}")
        problems = check_engine(trt, engine, graph, artifact.config, artifact.precision, plan.profiles(graph))
        if problems:
            raise EngineError(f"the built {plan_name} does not match the contract: " + "; ".join(problems))
        del engine


def _log_profiles(plan: EnginePlan, log: Log) -> None:
    for graph, specs in (("encoder", plan.encoder), ("decoder_step", plan.decoder_step)):
        log(f"{graph}: " + "; ".join(f"profile {p.name}: " + ", ".join(
            f"{axis} {r.min}/{r.opt}/{r.max}" for axis, r in (("batch", p.batch), ("src_len", p.src_len),
                                                               ("cache_len", p.cache_len)) if r is not None)
            for p in specs))


def _write_engines(trt, gpu: dict[str, Any], logger: TrtLog, tmp: str, artifact: Artifact, plan: EnginePlan,
                   timing_cache: str | None, workspace_gb: float, tf32: bool, progress: bool, log: Log,
                   t_start: float) -> dict[str, Any]:
    """Build both plans into `tmp` (the new engine directory), check them, link the artifact's files beside them
    and write engine.json; -> its content."""
    manifest, artifact_dir = artifact.manifest, artifact.path
    precision = artifact.precision
    builder = trt.Builder(logger.ilogger)
    data = _read_timing_cache(timing_cache, log)
    cache = _TimingCache(timing_cache, data, loaded=bool(data))
    keep_alive: list = []
    graphs_meta = {graph: _build_graph(trt, builder, logger, cache, artifact, graph, plan, tmp, workspace_gb, tf32,
                                       progress, log, keep_alive) for graph in GRAPHS}
    del keep_alive
    cache.save(log)
    _check_plans(trt, logger, tmp, artifact, plan)
    artifact_files = [MANIFEST_FILE] + sorted(manifest["files"])
    # the files the artifact's checks read (held open), not whatever has their names now
    how = {_link_or_copy(artifact, n, os.path.join(tmp, n)) for n in artifact_files}
    files = file_entries(tmp, artifact_files + [ENCODER_PLAN, STEP_PLAN])
    meta = engine_manifest(
        precision=precision,
        build_seconds={"total": round(time.perf_counter() - t_start, 2),
                       **{g: m["build_seconds"] for g, m in graphs_meta.items()}},
        tensorrt={"version": str(trt.__version__), "strongly_typed": True, "tf32": bool(tf32),
                  "workspace_gb": workspace_gb, "timing_cache": timing_cache, "timing_cache_loaded": cache.loaded,
                  "version_compatible": False, "hardware_compatibility": "none"},
        gpu=gpu, plan=plan, graphs=graphs_meta,
        artifact={"path": artifact_dir, "contract_version": manifest["contract_version"],
                  "precision": precision, "opset": manifest.get("opset"),
                  "manifest_sha256": files[MANIFEST_FILE]["sha256"],
                  "copied_as": ("hard links" if how == {"link"} else "copies" if how == {"copy"}
                                else "links and copies")},
        files=files, tools=_tool_versions(trt))
    write_engine_manifest(tmp, meta)
    return meta


def build_engines(artifact_dir: str | os.PathLike, out_dir: str | os.PathLike, max_batch: int = DEFAULT_MAX_BATCH,
                  max_src_len: int | None = None, max_tgt_len: int | None = None, opt_batch: int | None = None,
                  opt_src_len: int | None = None, opt_tgt_len: int | None = None, beam: int = DEFAULT_BEAM,
                  workspace_gb: float = DEFAULT_WORKSPACE_GB, timing_cache: str | os.PathLike | None = None,
                  force: bool = False, profiles: str = "auto", tf32: bool = False, device: int | str = 0,
                  progress: bool = True, log: Log | None = None, *, _trt=None,
                  _gpu: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build encoder.plan and decoder_step.plan for an artifact into OUT_DIR; -> engine.json's content.

    See the module docstring. Raises ArtifactError for a bad artifact, EngineError for bad limits, a
    parser or build failure or an unusable output path, BackendUnavailable without TensorRT or a GPU.
    Limits are checked before TensorRT is imported, so argument errors show on any machine.
    `_trt` and `_gpu` inject a TensorRT module and GPU description (tests only).
    """
    log = log or _quiet
    t_start = time.perf_counter()
    artifact_dir, out_dir = os.path.abspath(os.fspath(artifact_dir)), os.path.abspath(os.fspath(out_dir))
    _check_out_path(artifact_dir, out_dir)
    with output_lock(out_dir, "the engine directory", EngineError):  # before any work: one build per --out
        artifact = Artifact.load(artifact_dir, verify_hashes=True)
        manifest, config, precision = artifact.manifest, artifact.config, artifact.precision
        if artifact.quantization:
            raise EngineError(f"{artifact_dir} has {artifact.quantization} graphs for ONNX Runtime's CPU provider "
                              "(transduce export --quantize); TensorRT engines are built from an unquantized export",
                              hint=f"transduce export MODEL_DIR --out OUT_DIR --precision {precision} (without "
                                   "--quantize), then build from it")
        # an existing engine directory (not an empty one)
        replaces = check_replaceable(out_dir, force, is_engine_dir, "an engine directory", "engine directories",
                                     EngineError, "--out directory")
        plan = derive_profiles(config, max_batch=max_batch, beam=beam, max_src_len=max_src_len, max_tgt_len=max_tgt_len,
                               opt_batch=opt_batch, opt_src_len=opt_src_len, opt_tgt_len=opt_tgt_len, profiles=profiles)
        timing_cache = _check_build_options(workspace_gb, timing_cache, out_dir)
        device_index(device)  # its spelling, before TensorRT is looked for
        check_free_space(out_dir, engine_bytes(artifact_dir, out_dir, manifest), "the build", EngineError)
        trt = _trt or import_tensorrt()
        gpu = _gpu or select_gpu(device)
        logger = make_logger(trt, log)
        _log_profiles(plan, log)
        with atomic_output(out_dir, replaces, EngineError, "the engine directory",
                           hint="choose an --out path you can write to, on a disk with space") as tmp:
            meta = _write_engines(trt, gpu, logger, tmp, artifact, plan, timing_cache, workspace_gb, tf32, progress,
                                  log, t_start)
    log(f"wrote {out_dir} in {time.perf_counter() - t_start:.1f} s")
    return meta


def summary(out_dir: str, meta: dict[str, Any]) -> str:
    """A few lines for the CLI: files and sizes, profiles, versions, time."""
    lines = [f"engines {out_dir} ({meta['precision']}, TensorRT {meta['tensorrt']['version']}, "
             f"{meta['gpu']['name']} sm {meta['gpu']['compute_capability']})"]
    for name in (ENCODER_PLAN, STEP_PLAN):
        lines.append(f"  {name:<20} {meta['files'][name]['bytes']:>12,} bytes")
    for graph in GRAPHS:
        for p in meta["profiles"][graph]:
            axes = ", ".join(f"{a} {v[0]}/{v[1]}/{v[2]}" for a, v in p.items() if a != "name")
            lines.append(f"  {graph:<12} profile {p['name']:<10} {axes}")
    lines.append(f"built in {meta['build_seconds']['total']:.1f} s")
    return "\n".join(lines)
