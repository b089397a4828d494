"""What the TensorRT backend and the engine builder share: importing TensorRT, the GPU that runs a plan, the
process's TensorRT logger, and the check of a deserialized engine against the contract and its profiles."""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from transduce.errors import BackendUnavailable
from transduce.formats.contract import io_mismatches
from transduce.formats.dtypes import tensorrt_type
from transduce.formats.engine import RuntimeInfo
from transduce.formats.engine import read_engine_manifest as read_engine_description
from transduce.formats.model_config import ModelConfig
from transduce.formats.profiles import ProfileSpec, graph_inputs, graph_outputs, profile_shapes

MIN_TENSORRT_MAJOR = 10
GPU_HINT = ("pip install 'transduce[gpu]' (TensorRT >= 10 and onnxruntime-gpu) on a machine with an NVIDIA GPU "
            "and a CUDA build of PyTorch")

Log = Callable[[str], None]
def import_tensorrt():
    """`import tensorrt`, or BackendUnavailable with the reason and the pip hint."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise BackendUnavailable(f"TensorRT is not installed here ({e})", hint=GPU_HINT) from None
    except OSError as e:  # the wheel is there but libnvinfer or CUDA libraries are not loadable
        raise BackendUnavailable(f"TensorRT is installed but cannot be loaded ({e})", hint=GPU_HINT) from None
    version = str(getattr(trt, "__version__", "0"))
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 0
    if major < MIN_TENSORRT_MAJOR:
        raise BackendUnavailable(f"TensorRT {version} is too old: transduce needs TensorRT >= {MIN_TENSORRT_MAJOR} "
                                 "(strongly typed networks, the tensor-address execution API)", hint=GPU_HINT)
    return trt


def device_index(device: int | str | None) -> int:
    """0 for None/"cuda", N for "cuda:N" or N."""
    if device is None:
        return 0
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise BackendUnavailable(f"CUDA device {device} does not exist", hint="use device cuda or cuda:N, N >= 0",
                                     params=("device",))
        return device
    from transduce.runtime.devices import parse_device

    try:  # the one spelling check
        kind, index = parse_device(str(device), error=BackendUnavailable)
    except BackendUnavailable:
        kind = index = None
    if kind != "cuda":
        raise BackendUnavailable(f"TensorRT runs on CUDA devices only, not {device!r}",
                                 hint="use device cuda or cuda:N", params=("device",))
    return index or 0


def gpu_info(device: int | str | None = 0) -> dict[str, Any]:
    """Name, compute capability and memory of a CUDA device (torch.cuda.get_device_properties)."""
    try:
        import torch
    except ImportError:
        raise BackendUnavailable("TensorRT engines need PyTorch with CUDA here (for the GPU and device memory)",
                                 hint=GPU_HINT) from None
    if not torch.cuda.is_available():
        raise BackendUnavailable("no CUDA GPU is available to PyTorch here; TensorRT engines are built and run on one",
                                 hint=GPU_HINT + " (or decode with backend onnxruntime on the CPU)",
                                 params=("backend",))
    idx = device_index(device)
    if idx >= torch.cuda.device_count():  # torch would raise a bare AssertionError
        raise BackendUnavailable(f"there is no CUDA device {idx}: PyTorch sees {torch.cuda.device_count()}",
                                 hint="use device cuda, or cuda:N with N below that count "
                                      "(CUDA_VISIBLE_DEVICES decides which)", params=("device",))
    p = torch.cuda.get_device_properties(idx)
    uuid = getattr(p, "uuid", None)
    return {"name": p.name, "compute_capability": f"{p.major}.{p.minor}", "index": idx,
            "total_memory_gb": round(p.total_memory / 2**30, 1), "uuid": str(uuid) if uuid is not None else None,
            "cuda": torch.version.cuda}


def select_gpu(device: int | str | None = 0) -> dict[str, Any]:
    """Make `device` the current CUDA device (TensorRT builds and runs on the current one); -> gpu_info."""
    info = gpu_info(device)
    import torch

    torch.cuda.set_device(info["index"])
    return info


def current_runtime(device: int | str | None = 0, trt=None) -> RuntimeInfo:
    trt = trt or import_tensorrt()
    gpu = gpu_info(device)
    return RuntimeInfo(str(trt.__version__), gpu["name"], gpu["compute_capability"])


_PROCESS_LOGGERS: dict[int, Any] = {}  # id(tensorrt module) -> (module, the process's one trt.ILogger)


_PROCESS_LOGGERS_LOCK = threading.Lock()


class TrtLog:
    """What one build or one backend sees of TensorRT's log: the errors logged while it lives (for
    EngineError messages) and `log`, where warnings and errors go. TensorRT keeps a single logger for
    the whole process (a second builder or runtime given another one keeps the first and warns), so every
    builder, parser and runtime here gets the same trt.ILogger, `ilogger`, which hands each message to
    every live TrtLog; with two of them alive at once (a build, then a backend, in one process) each also
    sees the other's messages."""

    def __init__(self, ilogger, log: Log):
        self.ilogger = ilogger
        self.log = log
        self.errors: collections.deque[str] = collections.deque(maxlen=64)

    def recent(self, n: int = 8) -> str:
        with self.ilogger.lock:
            return "\n".join(list(self.errors)[-n:])


def _process_logger(trt):
    with _PROCESS_LOGGERS_LOCK:
        entry = _PROCESS_LOGGERS.get(id(trt))
        if entry is not None and entry[0] is trt:
            return entry[1]

        class _Logger(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)
                self.views: weakref.WeakSet[TrtLog] = weakref.WeakSet()
                self.lock = threading.Lock()

            def log(self, severity, msg):  # called from TensorRT's threads; must not raise
                try:
                    sev = trt.ILogger.Severity
                    error = severity in (sev.ERROR, sev.INTERNAL_ERROR)
                    if not error and severity != sev.WARNING:
                        return
                    with self.lock:
                        views = list(self.views)
                        for view in views:
                            if error:
                                view.errors.append(str(msg))
                except Exception:  # noqa: BLE001 - an exception here would abort TensorRT
                    return
                for view in views:  # one sink failing (a closed pipe) must not keep it from the others
                    try:
                        view.log(f"[tensorrt] {'error' if error else 'warning'}: {msg}")
                    except Exception:  # noqa: BLE001
                        pass

        logger = _Logger()
        _PROCESS_LOGGERS[id(trt)] = (trt, logger)
        return logger


def make_logger(trt, log: Log) -> TrtLog:
    """A TrtLog on the process's TensorRT logger: pass its `ilogger` to trt.Builder / OnnxParser / Runtime."""
    ilogger = _process_logger(trt)
    view = TrtLog(ilogger, log)
    with ilogger.lock:
        ilogger.views.add(view)
    return view


def engine_io(trt, engine) -> tuple[dict[str, str], dict[str, str]]:
    """({input: dtype}, {output: dtype}) of a deserialized engine (num_io_tensors, get_tensor_name/mode/dtype)."""
    ins, outs = {}, {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        mode = engine.get_tensor_mode(name)
        (ins if mode == trt.TensorIOMode.INPUT else outs)[name] = tensorrt_type(engine.get_tensor_dtype(name))
    return ins, outs


def check_engine(trt, engine, graph: str, config: ModelConfig, precision: str,
                 profiles: Sequence[ProfileSpec]) -> list[str]:
    """Problems of a deserialized engine against the contract and the profiles it should have."""
    ins, outs = engine_io(trt, engine)
    # the runtime sizes its output buffers by the contract: their fixed sizes are checked too (-1: dynamic)
    problems = io_mismatches(f"{graph} engine input", [(n, dt, None) for n, dt in ins.items()],
                             graph_inputs(graph, config), precision, config, ordered=False)
    problems += io_mismatches(f"{graph} engine output",
                              [(n, dt, tuple(int(d) for d in engine.get_tensor_shape(n))) for n, dt in outs.items()],
                              graph_outputs(graph, config), precision, config, ordered=False)
    if engine.num_optimization_profiles != len(profiles):
        problems.append(f"{graph} engine has {engine.num_optimization_profiles} optimization profiles, "
                        f"engine.json describes {len(profiles)}")
        return problems
    for i, spec in enumerate(profiles):
        for name, want in profile_shapes(spec, graph, config).items():
            if name not in ins:
                continue
            have = tuple(tuple(int(d) for d in s) for s in engine.get_tensor_profile_shape(name, i))
            if have != want:
                problems.append(f"{graph} engine profile {i} ({spec.name}) has {name} min/opt/max {have}, "
                                f"engine.json says {want}")
    return problems


def read_engine_manifest(engine_dir: str, verify_hashes: bool = True, runtime: RuntimeInfo | None = None,
                         device: int | str | None = 0) -> dict[str, Any]:
    """engine.json, checked (transduce.formats.engine.read_engine_manifest) and loadable here: built with this
    TensorRT for this GPU (`runtime`, by default read from tensorrt and torch.cuda for `device`)."""
    read_engine_description(engine_dir, verify_hashes=False)  # the directory's own mistakes before this machine's
    return read_engine_description(engine_dir, verify_hashes, runtime or current_runtime(device))
