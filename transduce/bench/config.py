"""The bench's options (BenchConfig, checked as a whole when made) and the names of its systems and modes."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from transduce.bench.ctranslate2.settings import CT2_SETTINGS, DEFAULT_CT2_SETTINGS
from transduce.bench.models import SIZES
from transduce.errors import TransduceError
from transduce.exporter.quantize import METHODS as QUANTIZE_METHODS
from transduce.runtime.backends.registry import PRECISIONS
from transduce.runtime.spec import MAX_THREADS, BackendSpec

# eager PyTorch on CUDA: "torch-cuda", with CUDA graphs "torch-cuda-graph", each at fp32 or with a precision suffix:
# the names of their BackendSpecs (BackendSpec.name)
TORCH_CUDA_SYSTEMS = tuple(BackendSpec("torch", device="cuda", cuda_graph=g, precision=p).name
                           for g in (False, True) for p in PRECISIONS)
# the eager torch-cuda step handed to torch.compile(mode="reduce-overhead") (Inductor's kernels, replayed from its own
# CUDA graphs): "torch-cuda-compile", "torch-cuda-compile-fp16", measured beside the hand-made graphs
TORCH_COMPILE_SYSTEMS = tuple("-".join(["torch-cuda-compile"] + ([p] if p != "fp32" else [])) for p in PRECISIONS)
OUR_BACKENDS = ("torch", *TORCH_CUDA_SYSTEMS, *TORCH_COMPILE_SYSTEMS, "onnxruntime", "tensorrt")
# on the GPU (skipped with the reason where CUDA is missing): CTranslate2 runs on the CPU here, so these get no
# ratio to it and no CPU floor (the torch-cuda ones get the GPU's floor at their precision)
GPU_SYSTEMS = (*TORCH_CUDA_SYSTEMS, *TORCH_COMPILE_SYSTEMS, "tensorrt")

MAX_BATCH = 4096  # sentences per benchmarked batch: beyond it the inputs alone are of no machine's size
# held-out sentences in the end-to-end cells, at most: there one pass one at a time already takes tens of seconds per
# system on the demo model
MAX_E2E_SENTENCES = 10_000


@dataclass
class BenchConfig:
    """What a run times, as `transduce bench`'s options give it; every problem with them is refused at once."""
    sizes: list[str] = field(default_factory=lambda: ["demo", "base"])
    backends: list[str] = field(default_factory=lambda: ["torch", "onnxruntime", "ctranslate2"])
    batches: list[int] = field(default_factory=lambda: [1, 16])
    modes: list[str] = field(default_factory=lambda: ["greedy", "beam4"])
    repeats: int = 5
    warmup: int = 1
    steps: int = 32  # generated tokens per sentence, forced
    src_len: int = 32  # encoder positions per sentence, EOS included
    threads: int = 2
    out_dir: str = os.path.join("runs", "bench")
    cache_dir: str | None = None  # default: out_dir/models
    model_dir: str | None = None  # the demo size's model (default runs/demo/model, else a random one)
    artifact_dir: str | None = None  # its ONNX export, if one exists elsewhere
    engines: dict[str, str] = field(default_factory=dict)  # size -> TensorRT engine directory
    ct2_settings: list[str] = field(default_factory=lambda: list(DEFAULT_CT2_SETTINGS))
    quantize: list[str] = field(default_factory=list)  # extra ONNX Runtime rows on quantized exports ("int8")
    # one measurement: the median of back-to-back decode calls that fill this many seconds (one call for
    # slower cells): a single call of a few ms after an idle pause measures thread wake-ups and cold caches as
    # much as decoding (docs/design/bench.md, "One measurement")
    min_seconds: float = 0.2
    check_sentences: int = 100  # held-out demo sentences for the natural-stopping check
    check_inputs: int = 4  # random inputs for the forced-length check
    # the end-to-end cells (e2e.py): the demo size's first e2e_sentences held-out sentences as text, translated
    # with each system's defaults (natural stopping), all at once and one at a time
    e2e: bool = True
    e2e_sentences: int = 300
    ceilings: bool = True
    quick: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        # a size, system, batch or mode given twice would be prepared and timed twice
        for name in ("sizes", "backends", "batches", "modes", "ct2_settings"):
            setattr(self, name, list(dict.fromkeys(getattr(self, name))))
        for name, option in (("sizes", "--sizes"), ("backends", "--backends"), ("modes", "--modes")):
            if not getattr(self, name):
                problems.append(f"{option} names nothing")
        if "ctranslate2" in self.backends and not self.ct2_settings:
            problems.append("--ct2-settings names nothing (leave ctranslate2 out of --backends to time it in none)")
        if self.steps < 2:
            problems.append(f"--steps must be >= 2 (per-step latency is derived from 1 and N steps), got {self.steps}")
        if self.src_len < 2:
            problems.append(f"--src-len must be >= 2, got {self.src_len}")
        if not (math.isfinite(self.min_seconds) and self.min_seconds >= 0):
            problems.append(f"--min-seconds must be a number >= 0, got {self.min_seconds}")
        if self.repeats < 1 or self.warmup < 0:
            problems.append("--repeats must be >= 1 and --warmup >= 0")
        if not self.batches or any(not 1 <= b <= MAX_BATCH for b in self.batches):
            given = ",".join(map(str, self.batches)) or "none"
            problems.append(f"--batches must be between 1 and {MAX_BATCH}, got {given}")
        for m in self.modes:
            try:
                beam_of(m)
            except ValueError:
                problems.append(f"unknown mode {m!r} (greedy, or beamN such as beam4)")
        for b in self.backends:
            if b not in OUR_BACKENDS + ("ctranslate2",):
                problems.append(f"unknown backend {b!r} ({', '.join(OUR_BACKENDS + ('ctranslate2',))})")
        for size in self.sizes:
            if size not in SIZES:
                problems.append(f"unknown model size {size!r} ({', '.join(SIZES)}; --model-dir replaces the demo "
                                "model)")
        for s in self.ct2_settings:
            if s not in CT2_SETTINGS:
                problems.append(f"unknown CTranslate2 setting {s!r} ({', '.join(CT2_SETTINGS)})")
        if not 1 <= self.threads <= MAX_THREADS:
            problems.append(f"--threads must be between 1 and {MAX_THREADS}, got {self.threads}")
        if self.seed < 0:
            problems.append(f"--seed must be >= 0, got {self.seed}")
        if self.check_sentences < 1:
            problems.append(f"--check-sentences must be >= 1, got {self.check_sentences}")
        if not 1 <= self.e2e_sentences <= MAX_E2E_SENTENCES:
            problems.append(f"--e2e-sentences must be between 1 and {MAX_E2E_SENTENCES}, got {self.e2e_sentences}")
        if self.check_inputs < 1:
            problems.append(f"check_inputs must be >= 1, got {self.check_inputs}")
        if "tensorrt" in self.backends and not self.engines:
            problems.append("tensorrt times engines: give --engine SIZE=DIR (transduce build) for a size")
        for size, path in self.engines.items():
            if size not in self.sizes:
                problems.append(f"--engine {size}={path}: {size!r} is not among the sizes ({', '.join(self.sizes)})")
            elif not os.path.isdir(path):
                problems.append(f"--engine {size}={path}: no such directory")
        if (self.model_dir or self.artifact_dir) and "demo" not in self.sizes:
            problems.append("--model-dir and --artifact-dir replace the demo size's model: keep demo in --sizes")
        self.quantize = list(dict.fromkeys(self.quantize))
        for q in self.quantize:
            if q not in QUANTIZE_METHODS:
                problems.append(f"unknown quantization {q!r} ({', '.join(QUANTIZE_METHODS)})")
        if self.quantize and "onnxruntime" not in self.backends:
            problems.append("--quantize adds ONNX Runtime rows: keep onnxruntime in --backends")
        if self.quantize and "demo" not in self.sizes:
            problems.append("--quantize needs the demo size: its BLEU on the demo data gates the quantized rows")
        elif self.quantize:  # the gate runs on the demo size, before any other size's quantized row
            self.sizes = ["demo"] + [s for s in self.sizes if s != "demo"]
        if problems:
            raise TransduceError("invalid bench options: " + "; ".join(problems))

    @classmethod
    def quick_preset(cls, **overrides) -> BenchConfig:
        """A smoke run: the demo size, a few steps, two rounds, small ceilings, a few end-to-end sentences."""
        base = dict(sizes=["demo"], batches=[1, 4], modes=["greedy", "beam2"], repeats=2, warmup=1, steps=6,
                    src_len=8, check_sentences=8, check_inputs=2, e2e_sentences=8, quick=True, min_seconds=0.0)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


def beam_of(mode: str) -> int:
    """The beam size of a mode: "greedy" -> 1, "beam4" -> 4; ValueError for anything else."""
    if mode == "greedy":
        return 1
    if mode.startswith("beam") and mode[4:].isdigit() and int(mode[4:]) >= 1:
        return int(mode[4:])
    raise ValueError(mode)


def quantized_system(name: str) -> str | None:
    """The quantization of an ONNX Runtime system name ("onnxruntime-int8" -> "int8"), else None."""
    head, _, tail = name.partition("-")
    return tail if head == "onnxruntime" and tail in QUANTIZE_METHODS else None


def compiled_system(name: str) -> str | None:
    """The eager system a torch.compile system compiles ("torch-cuda-compile-fp16" -> "torch-cuda-fp16"), else None."""
    if name not in TORCH_COMPILE_SYSTEMS:
        return None
    return name.replace("-compile", "")


def system_spec(name: str, **given) -> BackendSpec:
    """The BackendSpec one of our systems stands for ("torch-cuda-graph-fp16": torch on CUDA, CUDA graphs, fp16);
    its other fields from `given` (threads, model_dir). A quantized row is the onnxruntime system on its own
    export (quantized_system); a compiled one is the eager system it compiles (compiled_system)."""
    return BackendSpec.from_name("onnxruntime" if quantized_system(name) else compiled_system(name) or name, **given)
