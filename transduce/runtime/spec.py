"""BackendSpec: which backend decodes, where and how. Parsed once, from a command line (transduce.cli.options),
from an HTTP or Ray config (from_mapping) or from a bench system name (from_name), checked when made, and
handed to the registry (runtime.api.open_backend). Callers ask the spec and the backend it opens; nobody
parses names or re-derives a precision.

Messages name the spec's fields as Python spells them (params=...); a command line spells them as its flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from transduce.errors import InputError
from transduce.runtime.backends.registry import PRECISIONS, REGISTRY, entry, options_of
from transduce.runtime.devices import parse_device

# the most framework threads a backend is given: more than any machine has cores (ONNX Runtime makes a thread
# for each, and 100,000 of them took minutes before the first sentence)
MAX_THREADS = 1024


@dataclass(frozen=True)
class BackendSpec:
    backend: str = "onnxruntime"  # a registered backend (registry.BACKENDS)
    device: str = "cpu"  # cpu, cuda or cuda:N (tensorrt runs on a GPU always: cpu means the default one)
    precision: str | None = None  # torch: the eager weights' dtype (None: fp32); an export runs its own
    cuda_graph: bool = False  # replay the encoder and each decoder step from CUDA graphs (torch on a GPU, tensorrt)
    threads: int = 0  # framework threads (0: its default)
    model_dir: str | None = None  # torch: the model directory (None: the one the artifact was exported from)
    verify: bool = True  # check every file's sha256 against its manifest when loading
    options: Any = None  # the backend's own typed options (registry.OnnxRuntimeOptions); None: its defaults

    def __post_init__(self) -> None:
        e = entry(self.backend)
        if isinstance(self.threads, bool) or not isinstance(self.threads, int):
            raise InputError(f"threads must be an integer, got {self.threads!r}", params=("threads",))
        if not 0 <= self.threads <= MAX_THREADS:
            raise InputError(f"threads must be between 0 and {MAX_THREADS}, got {self.threads}",
                             hint="0: the framework's default (the CPUs this process may use)", params=("threads",))
        parse_device(str(self.device), "device", runs=f"the {self.backend} backend runs")
        if self.cuda_graph and not e.cuda_graphs:
            raise InputError(f"cuda_graph: the {self.backend} backend does not capture CUDA graphs",
                             hint="the torch backend on a GPU, or the tensorrt backend", params=("cuda_graph",))
        if self.precision is not None:
            if self.precision not in PRECISIONS:
                raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}",
                                 params=("precision",))
            if self.precision not in e.precisions:
                able = " or ".join(n for n, o in REGISTRY.items() if self.precision in o.precisions)
                raise InputError(f"precision {self.precision}: the {self.backend} backend runs the precision its "
                                 "artifact was exported with",
                                 hint=f"give precision with the {able} backend only, or export at that precision "
                                      "(transduce export --precision)", params=("precision",))
        if self.options is not None and (e.options is None or not isinstance(self.options, e.options)):
            wanted = e.options.__name__ if e.options else "None"
            raise InputError(f"the {self.backend} backend's options must be {wanted}, "
                             f"got {type(self.options).__name__}", params=("options",))

    @classmethod
    def of(cls, backend: str = "onnxruntime", **given: Any) -> BackendSpec:
        """A spec from keywords: its own fields, and the backend's options by name (the Python API's way)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"options"}
        fields = {k: v for k, v in given.items() if k in own}
        options = options_of(backend, {k: v for k, v in given.items() if k not in own})
        return cls(backend=backend, options=options, **fields)

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> BackendSpec:
        """A spec from a config's key/value pairs (a Ray deployment's arguments, `serve run ... key=value`): each
        value as its field's type, strings converted ("true", "2"), "options" the backend's own as a dict; an
        unknown key is an error naming it."""
        values = dict(values)
        given = values.pop("options", None) or {}
        types = {f.name: f.type for f in dataclasses.fields(cls) if f.name != "options"}
        unknown = sorted(set(values) - set(types))
        if unknown:
            raise InputError(f"unknown backend setting {unknown[0]!r}", hint=f"settings: {', '.join(types)}",
                             params=(unknown[0],))
        fields = {k: typed_value(k, types[k], v) for k, v in values.items()}
        return cls(**fields, options=options_of(fields.get("backend", "onnxruntime"), given))

    def to_mapping(self) -> dict[str, Any]:
        """The spec as plain values (from_mapping's inverse; the backend's options as a dict)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "options"}
        if self.options is not None:
            out["options"] = dataclasses.asdict(self.options)
        return out

    @property
    def name(self) -> str:
        """The spec in a word, as the bench names its systems: "onnxruntime", "torch-cuda-graph-fp16" (a device in
        the name for torch only: the other backends' GPU systems are the same code on another device)."""
        parts = [self.backend]
        if self.backend == "torch" and self.device.startswith("cuda"):
            parts.append("cuda")
        if self.cuda_graph:
            parts.append("graph")
        if self.precision not in (None, "fp32"):
            parts.append(self.precision)
        return "-".join(parts)

    @classmethod
    def from_name(cls, name: str, **given: Any) -> BackendSpec:
        """The spec a name of `name`'s form stands for ("torch-cuda-graph-fp16": torch on cuda, CUDA graphs,
        fp16); the other fields from `given`. An InputError for a name no spec has."""
        head, *rest = name.split("-")
        spec: dict[str, Any] = dict(given)
        if rest[:1] == ["cuda"]:
            spec["device"], rest = "cuda", rest[1:]
        if rest[:1] == ["graph"]:
            spec["cuda_graph"], rest = True, rest[1:]
        if rest[:1] and rest[0] in PRECISIONS:
            spec["precision"], rest = rest[0], rest[1:]
        if head not in REGISTRY or rest:
            raise InputError(f"unknown backend name {name!r}",
                             hint="BACKEND[-cuda][-graph][-fp16|-bf16], BACKEND one of " + ", ".join(REGISTRY),
                             params=("backend",))
        made = cls(backend=head, **spec)
        if made.name != name:  # one spelling per spec ("torch-fp32" is "torch")
            raise InputError(f"unknown backend name {name!r}", hint=f"this spec is named {made.name!r}",
                             params=("backend",))
        return made


def typed_value(name: str, kind: str, value: Any) -> Any:
    """A config value as its field's type (the dataclass's annotations are strings here): a string read as a bool,
    int or float (or None where the type allows it); InputError naming `name` for one that is not its type."""
    if not isinstance(value, str) or kind == "str":
        return value
    if value.lower() in ("none", "null", "") and "None" in kind:
        return None
    if kind.startswith("bool"):
        if value.lower() in ("true", "1", "yes"):
            return True
        if value.lower() in ("false", "0", "no"):
            return False
        raise InputError(f"{name} must be true or false, got {value!r}", params=(name,))
    if kind.startswith("int"):
        try:
            return int(value)
        except ValueError:
            raise InputError(f"{name} must be an integer, got {value!r}", params=(name,)) from None
    if kind.startswith("float"):
        try:
            return float(value)
        except ValueError:
            raise InputError(f"{name} must be a number, got {value!r}", params=(name,)) from None
    return value
