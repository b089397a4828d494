"""The backends transduce can decode with, by name: where each one's loader lives (imported when it is first
used: its framework stays unimported until then) and what a BackendSpec may ask of it.

To add a backend: a module with `open_backend(path, spec) -> Backend` (the protocol of base.py), and an
entry here. docs/contributing.md walks through it.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any

from transduce.errors import BackendUnavailable, InputError

PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class OnnxRuntimeOptions:
    """The ONNX Runtime backend's own options (every one has a default that suits decoding)."""

    provider: str | None = None  # cpu, cuda or tensorrt (ONNX Runtime's execution providers); None: the device's
    optimization: str = "all"  # graph optimization level: all, extended, basic or none
    provider_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # {provider: {option: value}}
    fused: bool = True  # decode with the artifact's fused ONNX Runtime step graph where it has one (CPU)
    wide_steps: str = "auto"  # which row counts run on the whole thread budget: auto (timed at load), rows, always
    shards: bool = True  # decode a small model's larger batches in parts at the same time (CPU)


@dataclass(frozen=True)
class BackendEntry:
    """One registered backend."""

    name: str
    loader: str  # "module:function": open_backend(path, spec) -> Backend
    opens: str  # the directory it decodes from: "artifact" (transduce export) or "engine" (transduce build)
    summary: str  # one line, for --help
    precisions: tuple[str, ...] = ()  # what spec.precision may ask; empty: the export's own, nothing to choose
    cuda_graphs: bool = False  # whether spec.cuda_graph means something to it
    options: type | None = None  # its own typed options (spec.options), None: it has none
    shares_cores: bool = False  # whether it runs on fewer threads meanwhile on the CPU (base.SharesCores)

    def open(self, path: str, spec: Any):
        module, function = self.loader.split(":")
        return getattr(importlib.import_module(module), function)(path, spec)

    def option_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.options)) if self.options else ()


REGISTRY: dict[str, BackendEntry] = {e.name: e for e in (
    BackendEntry("onnxruntime", "transduce.runtime.backends.onnxruntime_backend:open_backend", "artifact",
                 "an exported artifact on ONNX Runtime (CPU, or CUDA and TensorRT execution providers)",
                 options=OnnxRuntimeOptions, shares_cores=True),
    BackendEntry("torch", "transduce.runtime.backends.torch_backend:open_backend", "artifact",
                 "the eager model the artifact was exported from, in PyTorch (CUDA graphs on a GPU)",
                 precisions=PRECISIONS, cuda_graphs=True),
    BackendEntry("tensorrt", "transduce.runtime.backends.tensorrt_backend:open_backend", "engine",
                 "an engine directory (transduce build) on TensorRT, on a GPU", cuda_graphs=True),
)}
BACKENDS = tuple(REGISTRY)


def entry(name: str) -> BackendEntry:
    if name not in REGISTRY:
        raise BackendUnavailable(f"unknown backend {name!r}", hint=f"choose one of {', '.join(BACKENDS)}",
                                 params=("backend",))
    return REGISTRY[name]


def options_of(name: str, given: dict[str, Any]) -> Any:
    """A backend's typed options from keywords (the Python API's), None where none are given; an error naming
    the ones it does not take."""
    if not given:
        return None
    e = entry(name)
    unknown = sorted(set(given) - set(e.option_names()))
    if unknown:  # another backend's: silently dropped, they would change nothing
        theirs = [n for n, o in REGISTRY.items() if o is not e and set(unknown) <= set(o.option_names())]
        raise BackendUnavailable(f"the {name} backend takes no option {', '.join(unknown)}",
                                 hint=(f"those are the {' or '.join(theirs)} backend's; " if theirs else "")
                                 + (f"{name} takes {', '.join(e.option_names())}" if e.options
                                    else f"{name} takes none"))
    try:
        return e.options(**given)
    except TypeError as err:
        raise InputError(f"the {name} backend's options: {err}") from None
