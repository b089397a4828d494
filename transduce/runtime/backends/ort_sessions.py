"""The ONNX Runtime backend's sessions: execution providers, session and provider options, and the check of
each graph's inputs and outputs against the artifact's contract when its session is made."""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from transduce.errors import BackendUnavailable
from transduce.formats.artifact import Artifact
from transduce.formats.dtypes import ort_type
from transduce.formats.model_config import ModelConfig
from transduce.runtime.backends.ort_cpu_policy import UNFUSED
from transduce.runtime.checks import check_graph_io

PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}
OPTIMIZATION_LEVELS = {  # the backend's `optimization` option -> onnxruntime.GraphOptimizationLevel
    "all": "ORT_ENABLE_ALL",
    "extended": "ORT_ENABLE_EXTENDED",
    "basic": "ORT_ENABLE_BASIC",
    "none": "ORT_DISABLE_ALL",
}
CPU = PROVIDERS["cpu"]


def check_io(session, graph_file: str, artifact: Artifact) -> None:
    """Refuse a session whose graph's IO, as ONNX Runtime reads it, is not the contract's for this manifest
    (checks.check_graph_io, which check_artifact ran on the graph's header before: this holds a file
    replaced since, when the hashes were not checked)."""

    def triples(args):
        return [(a.name, ort_type(a.type), tuple(a.shape)) for a in args]

    check_graph_io(artifact, graph_file, triples(session.get_inputs()), triples(session.get_outputs()))


class ThreadSessions(NamedTuple):
    """The sessions a backend runs on at a limit of its threads (limit_threads)."""

    encoder: Any
    decoder: Any  # the step session below the wide row count
    decoder_wide: Any  # ... and from it


class SessionMaker:
    """Makes the sessions of one artifact's graphs, at one optimization level, each from the file the artifact
    holds open (the one its checks read) and checked against the contract (check_io) before it is used."""

    def __init__(self, ort, artifact: Artifact, optimization: str):
        self.ort, self.artifact = ort, artifact
        self.level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION_LEVELS[optimization])

    def options(self, n_threads: int, spin_us: int | None):
        """Session options: n_threads intra-op threads (0: onnxruntime's default), and how long idle pool
        threads spin (spin_us: 0 not at all, None onnxruntime's default)."""
        so = self.ort.SessionOptions()
        if n_threads:
            so.intra_op_num_threads = n_threads
            so.inter_op_num_threads = 1
        if spin_us == 0:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        elif spin_us is not None:
            so.add_session_config_entry("session.intra_op.spin_duration_us", str(spin_us))
        so.execution_mode = self.ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = self.level
        return so

    def make(self, graph_file: str, n_threads: int, spin_us: int | None, providers: list = CPU,
             unfused: bool = True):
        """A session of the artifact's `graph_file` (unfused: without the fusions UNFUSED names)."""
        artifact = self.artifact
        path = artifact.graph_file(graph_file)  # the file its checks read, not whatever has its name now
        try:
            session = self.ort.InferenceSession(path, self.options(n_threads, spin_us), providers=providers,
                                                disabled_optimizers=UNFUSED if unfused else [])
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph classes
            raise BackendUnavailable(f"onnxruntime could not load {artifact.files.display(graph_file)}: {e}",
                                     hint=artifact.rebuild_hint()) from None
        check_io(session, graph_file, artifact)
        return session


def gpu_provider_options(provider: str, user: dict, device_index: int, stream_handle: int, precision: str,
                         config: ModelConfig, step_sha256: str) -> tuple[dict, dict]:
    """Per-session provider options for the encoder and the step session on a GPU provider.

    CUDA: TF32 off for fp32 graphs (it breaks fp32 parity on Ampere and newer), and ORT runs on the
    same CUDA stream as the torch ops that write the cache, so they are ordered explicitly.
    TensorRT EP: one explicit optimization profile per graph (without one the EP rebuilds its engine
    whenever cache_len or the row count leaves the shapes it has seen) and an on-disk engine cache.
    Never trt_fp16_enable: the graphs carry their precision, and ORT builds strongly typed networks
    only with it off. `user` ({provider: {option: value}}) overrides all of these.
    """
    cuda = {"device_id": str(device_index), "user_compute_stream": str(stream_handle)}
    if precision == "fp32":
        cuda["use_tf32"] = "0"
    enc = {"CUDAExecutionProvider": dict(cuda)}
    dec = {"CUDAExecutionProvider": dict(cuda)}
    if provider == "tensorrt":
        from transduce.formats.profiles import derive_profiles, ort_tensorrt_profile_options

        plan = derive_profiles(config, profiles="single")
        cache = os.path.join(os.path.expanduser("~"), ".cache", "transduce", "ort-trt", step_sha256[:16])
        base = {"device_id": str(device_index), "trt_engine_cache_enable": "1", "trt_engine_cache_path": cache,
                "trt_timing_cache_enable": "1", "trt_timing_cache_path": cache,
                "user_compute_stream": str(stream_handle)}
        for opts, graph in ((enc, "encoder"), (dec, "decoder_step")):
            profile = ort_tensorrt_profile_options(plan.profiles(graph)[0], graph, config)
            opts["TensorrtExecutionProvider"] = {**base, **profile}
    for p, opts in user.items():
        enc.setdefault(p, {}).update(opts)
        dec.setdefault(p, {}).update(opts)
    return enc, dec
