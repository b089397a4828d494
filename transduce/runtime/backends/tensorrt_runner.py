"""One deserialized TensorRT plan of an engine directory and its execution contexts (one per optimization
profile, each made when first used), as the TensorRT backend runs them: shapes and tensor addresses are set
only when they change, and every refusal by TensorRT is an EngineError naming what it refused."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transduce.errors import EngineError
from transduce.formats.model_config import ModelConfig
from transduce.io.pinned import PinnedDir
from transduce.runtime.backends import tensorrt_support as trt_support

ALIGN = 256  # bytes: every tensor address given to TensorRT is a multiple of this (IExecutionContext.setTensorAddress)


def freeze(d: dict[str, Any]) -> tuple:
    """A dict of shapes or addresses as a hashable key."""
    return tuple(sorted(d.items()))


@dataclass
class ExecContext:
    """One execution context of an engine, bound to one optimization profile, and what was last set on it."""

    ctx: Any  # trt.IExecutionContext bound to one profile
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # input shapes last set (host side)
    addresses: dict[str, int] = field(default_factory=dict)  # tensor addresses last set


class EngineRunner:
    """One deserialized plan: its IO dtypes, its profiles and one execution context per profile."""

    def __init__(self, trt, torch, runtime, logger, files: PinnedDir, plan_file: str, graph: str, profiles,
                 config: ModelConfig, precision: str, rebuild: str):
        """files: the engine directory held open (the plan read is the one its checks hashed)."""
        path = files.display(plan_file)
        self.trt, self.torch, self.graph, self.path, self.profiles = trt, torch, graph, path, tuple(profiles)
        self.logger, self.rebuild = logger, rebuild
        self.engine = runtime.deserialize_cuda_engine(files.read_bytes(plan_file))
        if self.engine is None:
            raise EngineError(f"TensorRT could not deserialize {path}: {logger.recent() or 'no error reported'}",
                              hint=f"rebuild the engines with: {rebuild}")
        problems = trt_support.check_engine(trt, self.engine, graph, config, precision, self.profiles)
        if problems:
            raise EngineError(f"{path} does not match the contract or engine.json: " + "; ".join(problems),
                              hint=f"rebuild the engines with: {rebuild}")
        ins, outs = trt_support.engine_io(trt, self.engine)
        self.dtypes = {name: getattr(torch, dt) for name, dt in {**ins, **outs}.items()}
        self.inputs, self.outputs = list(ins), list(outs)
        self._contexts: list[ExecContext | None] = [None] * len(self.profiles)

    def context(self, index: int, stream_handle: int) -> ExecContext:
        c = self._contexts[index]
        if c is None:
            # each context serves one profile for its whole life: ON_PROFILE_CHANGE sizes its activation
            # memory for that profile (the default, STATIC, sizes every context for the largest profile)
            strategies = getattr(self.trt, "ExecutionContextAllocationStrategy", None)
            strategy = getattr(strategies, "ON_PROFILE_CHANGE", None)
            ctx = (self.engine.create_execution_context(strategy) if strategy is not None
                   else self.engine.create_execution_context())
            if ctx is None:
                raise EngineError(f"TensorRT could not create an execution context for {self.path} "
                                  f"(out of GPU memory?): {self.logger.recent()}")
            try:
                ok = ctx.set_optimization_profile_async(index, stream_handle)
            except RuntimeError as e:  # the Python binding raises where the C++ API returns false
                ok = False
                with self.logger.ilogger.lock:
                    self.logger.errors.append(str(e))
            if not ok:
                raise EngineError(f"{self.path}: cannot select optimization profile {index}: {self.logger.recent()}")
            c = self._contexts[index] = ExecContext(ctx)
        return c

    def set_io(self, c: ExecContext, shapes: dict[str, tuple[int, ...]], addresses: dict[str, int],
               out_shapes: dict[str, tuple[int, ...]]) -> None:
        changed = False
        for name, shape in shapes.items():
            if c.shapes.get(name) != shape:
                if not c.ctx.set_input_shape(name, shape):
                    c.shapes.clear()
                    raise EngineError(f"{self.graph}: TensorRT refused shape {shape} for {name}: "
                                      f"{self.logger.recent() or 'outside the optimization profile'}")
                c.shapes[name] = shape
                changed = True
        if changed:  # the buffers were sized by the contract: check TensorRT agrees before it writes
            for name, want in out_shapes.items():
                have = tuple(int(d) for d in c.ctx.get_tensor_shape(name))
                if have != want:
                    c.shapes.clear()  # so the next call checks again instead of running into the small buffer
                    raise EngineError(f"{self.graph}: TensorRT computes {name} as {have}, the contract says {want}")
        for name, ptr in addresses.items():
            if c.addresses.get(name) != ptr:
                if not c.ctx.set_tensor_address(name, ptr):
                    c.addresses.pop(name, None)
                    raise EngineError(f"{self.graph}: TensorRT refused the address of {name} ({ptr:#x}; it needs "
                                      f"{ALIGN}-byte aligned addresses): {self.logger.recent()}")
                c.addresses[name] = ptr

    def run(self, index: int, shapes, addresses, out_shapes, stream_handle: int) -> ExecContext:
        c = self.context(index, stream_handle)
        self.set_io(c, shapes, addresses, out_shapes)
        if not c.ctx.execute_async_v3(stream_handle):
            raise EngineError(f"{self.graph}: TensorRT execution failed: {self.logger.recent() or 'no error reported'}")
        return c
