"""A test double of the `tensorrt` Python API: the subset transduce calls, with TensorRT's rules.

It lets the engine builder and the TensorRT backend run on a CPU-only machine, so their logic
(profiles, chunking, buffers, cache writes, reorders, top-k, engine.json, refusals) is tested here;
the real API is exercised only by the GPU tests. Names and signatures follow the TensorRT 10/11
Python bindings (python/src/infer/pyCore.cpp, python/src/parsers/pyOnnx.cpp in NVIDIA/TensorRT).
Rules enforced like TensorRT's: a network must be created STRONGLY_TYPED; every input needs a
min/opt/max in every profile with min <= opt <= max and the fixed axes matching; `set_input_shape`
returns False outside the context's profile; `execute_async_v3` returns False unless every input
shape and every tensor address is set.

"Building" does not compile anything: the plan is JSON naming the graph and the source model
directory (read from the artifact's manifest beside the ONNX file); executing a context reads its
inputs from the bound addresses, runs the eager PyTorch model's encode / decode_step, and writes the
outputs to the bound addresses. Two kinds of memory: host memory where the backend runs with
device="cpu" under this double (it then passes stream 0), and on a GPU (the backend on device="cuda",
passing its own stream, never 0) CUDA memory, read and written in place through
`__cuda_array_interface__` by a CUDA copy of the model whose kernels are queued on the given stream,
as an engine's would be, so that they are captured into the backend's CUDA graphs too. That runs the
backend's own CUDA code (streams, pinned staging, device buffers, graph capture and replay) for real.
An ONNX file whose content starts with b"BAD" fails to parse with two errors.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os

import numpy as np

from transduce.formats.kinds import ARTIFACT_KIND, MANIFEST_FILE
from transduce.formats.model_config import ModelConfig
from transduce.io.files import sha256_file

__version__ = "10.99.0"

# every call made through the double, for assertions: (what, details)
CALLS: list[tuple[str, object]] = []


class _Enum:
    def __init__(self, name: str, value: int):
        self.name, self.value = name, value

    def __int__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"<{self.name}>"


class DataType:
    FLOAT = _Enum("FLOAT", 0)
    HALF = _Enum("HALF", 1)
    INT8 = _Enum("INT8", 2)
    INT32 = _Enum("INT32", 3)
    BOOL = _Enum("BOOL", 4)
    BF16 = _Enum("BF16", 7)
    INT64 = _Enum("INT64", 8)


_DT = {"float32": DataType.FLOAT, "float16": DataType.HALF, "bfloat16": DataType.BF16, "int64": DataType.INT64,
       "int32": DataType.INT32, "bool": DataType.BOOL}
_NP = {v.name: k for k, v in _DT.items()}


class NetworkDefinitionCreationFlag:  # TensorRT 10's values (11 drops EXPLICIT_BATCH: STRONGLY_TYPED is 0 there)
    EXPLICIT_BATCH = _Enum("EXPLICIT_BATCH", 0)
    STRONGLY_TYPED = _Enum("STRONGLY_TYPED", 1)


class ExecutionContextAllocationStrategy:
    STATIC = _Enum("STATIC", 0)
    ON_PROFILE_CHANGE = _Enum("ON_PROFILE_CHANGE", 1)
    USER_MANAGED = _Enum("USER_MANAGED", 2)


class MemoryPoolType:
    WORKSPACE = _Enum("WORKSPACE", 0)


class BuilderFlag:
    TF32 = _Enum("TF32", 7)


class TensorIOMode:
    NONE = _Enum("NONE", 0)
    INPUT = _Enum("INPUT", 1)
    OUTPUT = _Enum("OUTPUT", 2)


class ErrorCode:
    UNSUPPORTED_NODE = _Enum("UNSUPPORTED_NODE", 8)
    INVALID_NODE = _Enum("INVALID_NODE", 6)


class ILogger:
    class Severity:
        INTERNAL_ERROR = _Enum("INTERNAL_ERROR", 0)
        ERROR = _Enum("ERROR", 1)
        WARNING = _Enum("WARNING", 2)
        INFO = _Enum("INFO", 3)
        VERBOSE = _Enum("VERBOSE", 4)

    def __init__(self):
        pass

    def log(self, severity, msg):  # pragma: no cover - subclasses implement it
        raise NotImplementedError


class IProgressMonitor:
    def __init__(self):
        pass


class _Tensor:
    def __init__(self, name, dtype, shape):
        self.name, self.dtype, self.shape = name, dtype, shape


class INetworkDefinition:
    def __init__(self, flags):
        self.flags = flags
        self.inputs: list[_Tensor] = []
        self.outputs: list[_Tensor] = []
        self.meta: dict = {}

    @property
    def num_inputs(self):
        return len(self.inputs)

    @property
    def num_outputs(self):
        return len(self.outputs)

    def get_input(self, i):
        return self.inputs[i]

    def get_output(self, i):
        return self.outputs[i]


class _ParserError:
    def __init__(self, node, name, op, desc):
        self._node, self._name, self._op, self._desc = node, name, op, desc

    def code(self):
        return ErrorCode.UNSUPPORTED_NODE

    def desc(self):
        return self._desc

    def node(self):
        return self._node

    def node_name(self):
        return self._name

    def node_operator(self):
        return self._op


class OnnxParser:
    def __init__(self, network, logger):
        self.network, self.logger = network, logger
        self._errors: list[_ParserError] = []

    def parse_from_file(self, model):
        from transduce.formats import contract

        with open(model, "rb") as f:
            content = f.read()
        if content.startswith(b"BAD"):
            self._errors = [_ParserError(7, "/decoder/attn/Where", "Where", "unsupported condition type"),
                            _ParserError(9, "/decoder/Mod", "Mod", "fmod=0 on float inputs is not supported")]
            return False
        directory = os.path.dirname(os.path.abspath(model))
        with open(os.path.join(directory, MANIFEST_FILE), encoding="utf-8") as f:
            manifest = json.load(f)
        cfg, precision = manifest["model"], manifest["precision"]
        graph = "encoder" if os.path.basename(model) == contract.ENCODER_FILE else "decoder_step"
        n = cfg["decoder_layers"]
        ins = contract.encoder_inputs() if graph == "encoder" else contract.step_inputs(n)
        outs = contract.encoder_outputs(n) if graph == "encoder" else contract.step_outputs(n)
        fixed = contract.static_axis_sizes(ModelConfig.from_dict(cfg))
        for specs, dest in ((ins, self.network.inputs), (outs, self.network.outputs)):
            for s in specs:
                shape = tuple(fixed.get(a, -1) for a in s.axes)
                dest.append(_Tensor(s.name, _DT[contract.resolve_dtype(s, precision)], shape))
        self.network.meta = {"graph": graph, "model_dir": manifest["source_model"]["path"], "precision": precision,
                             "config": cfg, "onnx": os.path.abspath(model)}
        CALLS.append(("parse_from_file", model))
        return True

    @property
    def num_errors(self):
        return len(self._errors)

    def get_error(self, index):
        return self._errors[index]


class IOptimizationProfile:
    def __init__(self):
        self.shapes: dict[str, tuple] = {}

    def set_shape(self, input, min, opt, max):  # noqa: A002 - TensorRT's parameter names
        mn, op, mx = tuple(min), tuple(opt), tuple(max)
        if not (len(mn) == len(op) == len(mx)) or any(not a <= b <= c for a, b, c in zip(mn, op, mx)):
            raise RuntimeError("Shape provided for min is inconsistent with other shapes.")
        self.shapes[input] = (mn, op, mx)

    def __bool__(self):
        return bool(self.shapes)


class ITimingCache:
    def __init__(self, data: bytes):
        self.data = bytes(data)

    def serialize(self):
        return self.data


class IBuilderConfig:
    def __init__(self, logger):
        self.logger = logger
        self.pools: dict = {}
        self.flags = {"TF32"}  # on by default, as in TensorRT
        self.timing_cache = None
        self.progress_monitor = None
        self.profiles: list[IOptimizationProfile] = []

    def set_memory_pool_limit(self, pool, pool_size):
        self.pools[pool.name] = int(pool_size)

    def clear_flag(self, flag):
        self.flags.discard(flag.name)

    def set_flag(self, flag):
        self.flags.add(flag.name)

    def create_timing_cache(self, serialized_timing_cache):
        if bytes(serialized_timing_cache).startswith(b"CORRUPT"):  # TensorRT returns None on unreadable bytes
            self.logger.log(ILogger.Severity.ERROR, "Serialization assertion failed: magic tag mismatch")
            return None
        return ITimingCache(serialized_timing_cache)

    def set_timing_cache(self, cache, ignore_mismatch):
        if cache.data.startswith(b"OTHER-GPU") and not ignore_mismatch:
            return False
        self.timing_cache = cache
        return True

    def get_timing_cache(self):
        return self.timing_cache

    def add_optimization_profile(self, profile):
        if not profile:
            return -1
        self.profiles.append(profile)
        return len(self.profiles) - 1


class Builder:
    def __init__(self, logger):
        self.logger = logger

    def create_network(self, flags=0):
        if not flags & (1 << int(NetworkDefinitionCreationFlag.STRONGLY_TYPED)):
            raise AssertionError("transduce must create strongly typed networks")
        return INetworkDefinition(flags)

    def create_builder_config(self):
        return IBuilderConfig(self.logger)

    def create_optimization_profile(self):
        return IOptimizationProfile()

    def build_serialized_network(self, network, config):
        if not config.profiles:
            self.logger.log(ILogger.Severity.ERROR, "Network has dynamic or shape inputs, but no optimization profile")
            return None
        for i, p in enumerate(config.profiles):
            for t in network.inputs:
                if t.name not in p.shapes:
                    self.logger.log(ILogger.Severity.ERROR, f"profile {i} has no shape for {t.name}")
                    return None
                for k in range(3):
                    for fixed, d in zip(t.shape, p.shapes[t.name][k]):
                        if fixed != -1 and fixed != d:
                            self.logger.log(ILogger.Severity.ERROR, f"{t.name}: profile dim {d} != {fixed}")
                            return None
        mon = config.progress_monitor
        if mon is not None:
            mon.phase_start("Building engine", None, 2)
            mon.phase_start("Tactic timing", "Building engine", 3)
            for s in range(3):
                assert mon.step_complete("Tactic timing", s) is True
            mon.phase_finish("Tactic timing")
            assert mon.step_complete("Building engine", 0) is True
            mon.phase_finish("Building engine")
        if config.timing_cache is not None:
            config.timing_cache.data += b"[" + network.meta["graph"].encode() + b"]"
        plan = {
            "fake_tensorrt_plan": 1, **network.meta,
            "inputs": [[t.name, t.dtype.name, list(t.shape)] for t in network.inputs],
            "outputs": [[t.name, t.dtype.name, list(t.shape)] for t in network.outputs],
            "profiles": [{n: [list(s) for s in v] for n, v in p.shapes.items()} for p in config.profiles],
            "flags": sorted(config.flags), "workspace": config.pools.get("WORKSPACE"),
        }
        CALLS.append(("build", {"graph": network.meta["graph"], "flags": sorted(config.flags),
                                "profiles": len(config.profiles), "workspace": config.pools.get("WORKSPACE")}))
        return json.dumps(plan).encode()


class Runtime:
    def __init__(self, logger):
        self.logger = logger

    def deserialize_cuda_engine(self, serialized_engine):
        try:
            plan = json.loads(bytes(serialized_engine).decode())
            assert plan["fake_tensorrt_plan"] == 1
        except Exception:  # noqa: BLE001
            self.logger.log(ILogger.Severity.ERROR, "Serialization assertion failed: magic tag mismatch")
            return None
        return ICudaEngine(plan)


_MODELS: dict[tuple[str, str], object] = {}


def _model(model_dir: str, device: str = "cpu"):
    if (model_dir, device) not in _MODELS:
        from transduce.models.checkpoint import load_model_dir

        _MODELS[model_dir, device] = load_model_dir(model_dir)[0].to(device).eval()
    return _MODELS[model_dir, device]


class ICudaEngine:
    def __init__(self, plan):
        self.plan = plan
        self._io = [(n, TensorIOMode.INPUT, dt, shape) for n, dt, shape in plan["inputs"]]
        self._io += [(n, TensorIOMode.OUTPUT, dt, shape) for n, dt, shape in plan["outputs"]]
        self._by_name = {n: (mode, dt, shape) for n, mode, dt, shape in self._io}
        self.executions: list[tuple[int, dict]] = []  # (profile, input shapes) per execute_async_v3

    @property
    def num_io_tensors(self):
        return len(self._io)

    @property
    def num_optimization_profiles(self):
        return len(self.plan["profiles"])

    def get_tensor_name(self, index):
        return self._io[index][0]

    def get_tensor_mode(self, name):
        return self._by_name[name][0]

    def get_tensor_dtype(self, name):
        return getattr(DataType, self._by_name[name][1])

    def get_tensor_shape(self, name):  # as built: -1 on the dynamic axes
        return tuple(self._by_name[name][2])

    def get_tensor_profile_shape(self, name, profile_index):
        return [tuple(s) for s in self.plan["profiles"][profile_index][name]]

    def create_execution_context(self, strategy=ExecutionContextAllocationStrategy.STATIC):
        ctx = IExecutionContext(self)
        ctx.allocation_strategy = strategy
        return ctx


def _view(ptr: int, shape, dtype_name: str) -> np.ndarray:
    dt = np.dtype(_NP[dtype_name])
    n = int(np.prod(shape)) * dt.itemsize
    buf = (ctypes.c_byte * max(n, 1)).from_address(ptr)
    return np.ctypeslib.as_array(buf)[:n].view(dt).reshape(shape)


class _DeviceArray:
    """CUDA memory at `ptr` as torch sees it (`torch.as_tensor` wraps it in place, no copy, no sync)."""

    def __init__(self, ptr: int, shape, dtype_name: str):
        self.__cuda_array_interface__ = {"shape": tuple(int(d) for d in shape), "data": (int(ptr), False),
                                         "typestr": np.dtype(_NP[dtype_name]).str, "version": 3}


def _device_view(ptr: int, shape, dtype_name: str):
    import torch

    return torch.as_tensor(_DeviceArray(ptr, shape, dtype_name), device="cuda")


class IExecutionContext:
    def __init__(self, engine):
        self.engine = engine
        self.profile = 0
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}

    def set_optimization_profile_async(self, profile_index, stream_handle):
        if not 0 <= profile_index < self.engine.num_optimization_profiles:
            raise RuntimeError("Error in set optimization profile async.")
        self.profile = profile_index
        self.shapes.clear()
        return True

    def set_input_shape(self, name, shape):
        mode, _, fixed = self.engine._by_name[name]
        mn, _, mx = self.engine.plan["profiles"][self.profile][name]
        shape = tuple(int(d) for d in shape)
        if mode is not TensorIOMode.INPUT or len(shape) != len(mn):
            return False
        if any(not lo <= d <= hi for lo, d, hi in zip(mn, shape, mx)):
            return False
        self.shapes[name] = shape
        return True

    def _dims(self):
        p = self.engine.plan
        n_layers = p["config"]["decoder_layers"]
        if p["graph"] == "encoder":
            b, s = self.shapes["src_ids"]
            return {"batch": b, "src_len": s, "n": n_layers}
        b, h, c, dh = self.shapes["past_key_0"]
        return {"batch": b, "heads": h, "cache_len": c, "head_dim": dh, "src_len": self.shapes["cross_key_0"][2],
                "n": n_layers}

    def get_tensor_shape(self, name):
        mode, _, fixed = self.engine._by_name[name]
        if mode is TensorIOMode.INPUT:
            return self.shapes.get(name, tuple(fixed))
        cfg = self.engine.plan["config"]
        d = self._dims()
        h, dh = cfg["n_heads"], cfg["d_model"] // cfg["n_heads"]
        if name == "memory":
            return (d["batch"], d["src_len"], cfg["d_model"])
        if name.startswith("cross_"):
            return (d["batch"], h, d["src_len"], dh)
        if name == "log_probs":
            return (d["batch"], cfg["vocab_size"])
        return (d["batch"], h, 1, dh)

    def set_tensor_address(self, name, memory):
        # TensorRT 10: "The pointer must have at least 256-byte alignment" (what it does with one that has
        # not is undefined; this double refuses it, so a misaligned binding fails the tests)
        if name not in self.engine._by_name or not memory or int(memory) % 256:
            return False
        self.addresses[name] = int(memory)
        return True

    def execute_async_v3(self, stream_handle):
        import torch

        e = self.engine
        ins = [n for n, mode, _, _ in e._io if mode is TensorIOMode.INPUT]
        if any(n not in self.shapes for n in ins) or any(n not in self.addresses for n, *_ in e._io):
            return False
        e.executions.append((self.profile, dict(self.shapes)))
        on_device = stream_handle != 0  # see the module's docstring
        model = _model(e.plan["model_dir"], "cuda" if on_device else "cpu")
        stream = torch.cuda.stream(torch.cuda.ExternalStream(stream_handle)) if on_device else contextlib.nullcontext()

        def read(name):
            if on_device:  # copied, as an engine's kernels would read it: later writes to the buffer do not reach it
                t = _device_view(self.addresses[name], self.shapes[name], e._by_name[name][1]).clone()
            else:
                t = torch.from_numpy(_view(self.addresses[name], self.shapes[name], e._by_name[name][1]).copy())
            return t.float() if t.is_floating_point() else t

        def write(name, t):
            if on_device:
                _device_view(self.addresses[name], self.get_tensor_shape(name), e._by_name[name][1]).copy_(t)
                return
            view = _view(self.addresses[name], self.get_tensor_shape(name), e._by_name[name][1])
            view[...] = t.detach().to(torch.float32 if view.dtype == np.float32 else torch.float16).numpy()

        n = self._dims()["n"]
        with torch.inference_mode(), stream:
            if e.plan["graph"] == "encoder":
                memory, ck, cv = model.encode(read("src_ids"), read("src_lengths"))
                write("memory", memory)
                for i in range(n):
                    write(f"cross_key_{i}", ck[i])
                    write(f"cross_value_{i}", cv[i])
            else:
                lp, nk, nv = model.decode_step(
                    read("tokens"), read("positions"), read("src_lengths"),
                    [read(f"past_key_{i}") for i in range(n)], [read(f"past_value_{i}") for i in range(n)],
                    [read(f"cross_key_{i}") for i in range(n)], [read(f"cross_value_{i}") for i in range(n)])
                write("log_probs", lp)
                for i in range(n):
                    write(f"new_key_{i}", nk[i])
                    write(f"new_value_{i}", nv[i])
        return True


def make_artifact(path: str, model_dir: str, precision: str = "fp32", encoder_bytes: bytes = b"fake encoder graph",
                  step_bytes: bytes = b"fake decoder_step graph") -> str:
    """A hand-made artifact directory for `model_dir` (a saved model): real manifest, config and tokenizer,
    placeholder ONNX files (this double never reads them as ONNX). Passes read_manifest."""
    import shutil

    from transduce.formats import contract
    from transduce.formats.model_dir import read_config

    os.makedirs(path)
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(os.path.join(model_dir, name), os.path.join(path, name))
    for name, data in ((contract.ENCODER_FILE, encoder_bytes), (contract.STEP_FILE, step_bytes)):
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    files = {n: {"sha256": sha256_file(os.path.join(path, n)), "bytes": os.path.getsize(os.path.join(path, n))}
             for n in sorted(os.listdir(path))}
    cfg = read_config(model_dir)
    manifest = {
        "kind": ARTIFACT_KIND, "contract_version": contract.CONTRACT_VERSION, "precision": precision,
        "opset": 18, "model": cfg["model"], "tokenizer": "tokenizer.json",
        "source_model": {"path": os.path.abspath(model_dir),
                         "weights_sha256": cfg["files"]["model.safetensors"]["sha256"]},
        "files": files,
    }
    with open(os.path.join(path, MANIFEST_FILE), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    return path


def runtime_info():
    """The RuntimeInfo matching engines built with this double and FAKE_GPU."""
    from transduce.formats.engine import RuntimeInfo

    return RuntimeInfo(__version__, FAKE_GPU["name"], FAKE_GPU["compute_capability"])


FAKE_GPU = {"name": "NVIDIA Fake H100", "compute_capability": "9.0", "index": 0, "total_memory_gb": 80.0,
            "uuid": None, "cuda": "12.8"}
