"""The ONNX Runtime backend: sessions over an artifact's two graphs, with IO binding onto buffers it owns.

Every tensor the step graph reads or writes lives in a buffer allocated once per decoding run:
the self-attention cache (rows, heads, capacity, head_dim) per layer, the cross-attention K/V
gathered for the current rows, and the outputs (log_probs, new K/V). Inputs and outputs are bound
by pointer (IOBinding), so a step allocates nothing of cache size; after the run the new K/V are
written into slot `position` of the cache. A beam reorder moves, in place, only the rows whose source
row changed and only their filled slots (the prefix < position): beam search keeps most rows in place
and fills the cache gradually, so this copies a fraction of what a whole-buffer gather would (base
model, 64 rows, 16 of 32 slots filled: 1.47 ms -> ~0.1 ms per layer's K or V).

Two step graphs. Artifacts of fp32 post-norm models (unless exported with --no-ort-step) carry decoder_step.ort.onnx besides the
standard decoder_step.onnx: the same step with ONNX Runtime's fused contrib ops, whose attention
writes the new K/V into the cache itself (its present_* outputs are bound onto the cache buffers),
which picks the top-k itself (no second session run per step), and which reads each source's cross
K/V once for all its beams (gathered per sentence, not per row). On CPU it serves every row count of
such models, of every size (see transduce/exporter/ort_step.py); small models have a one-thread step
session and one with the whole budget, and which serves which row count is measured when the backend
loads (WIDE_STEPS). Demo model, us per step run, fused vs
standard graph: 1 row 154 vs 222, 64 rows (two threads) 1,386 vs 1,717 (before the top-k and the
grouped cross-attention moved into it). `fused=False` keeps to the
standard graph; `only_step_graph` pins one of the two (parity checks each).

Device memory: on CPU the buffers are numpy arrays; with the CUDA or TensorRT execution provider
they are torch CUDA tensors (the only way here to get device memory and small kernels for the slot
write, the gather and the top-k without a host round trip; torch is imported only then).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transduce.errors import ArtifactError, BackendUnavailable, InputError
from transduce.formats import contract
from transduce.formats.artifact import quantization, read_manifest, rebuild_hint
from transduce.formats.dtypes import PRECISION_DTYPES, ort_type
from transduce.runtime.backends.base import ban_bias, banned_ids, move_rows_torch, numpy_topk, usable_cpus
from transduce.runtime.devices import torch_device

PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


def _import_ort():
    try:
        import onnxruntime as ort
    except ImportError:
        raise BackendUnavailable(
            "the onnxruntime backend needs the onnxruntime package",
            hint="pip install 'transduce[cpu]' (or onnxruntime-gpu via 'transduce[gpu]')",
        ) from None
    return ort


# Below this much arithmetic per decoding row and step (MFLOP), one intra-op thread is faster than
# two: ONNX Runtime's thread-pool synchronisation costs more than it saves on small matrices.
# Measured on the 2-core CI machine, demo model (0.9 MFLOP/row/step), ms per step at 1 / 2 threads:
# batch 1 greedy 0.39 / 0.75, batch 1 beam 4 0.69 / 1.51, batch 16 greedy 1.15 / 1.88; the base
# shape (46 MFLOP/row/step) is faster with 2 (batch 1 greedy 7.5 vs 9.2 ms).
SMALL_STEP_MFLOP = 5.0


def step_mflop_per_row(config: dict[str, Any]) -> float:
    """Multiply-adds x 2 of one decoder step for one row: the decoder's projections and the logits."""
    d, ff, n = config["d_model"], config["d_ff"], config["decoder_layers"]
    return 2.0 * (n * (4 * d * d + 2 * d * ff) + config["vocab_size"] * d) / 1e6


def intra_op_threads(config: dict[str, Any], budget: int) -> int:
    """Step threads to use within a budget (0: ONNX Runtime's default): one for small models."""
    if budget != 1 and step_mflop_per_row(config) < SMALL_STEP_MFLOP:
        return 1
    return budget


def encoder_mflop_per_token(config: dict[str, Any]) -> float:
    """Multiply-adds x 2 of the encoder graph per source token: its layers' projections and FFN, and
    every decoder layer's cross K/V projection."""
    d, ff = config["d_model"], config["d_ff"]
    return 2.0 * (config["encoder_layers"] * (4 * d * d + 2 * d * ff) + 2 * config["decoder_layers"] * d * d) / 1e6


# An encoder run with less arithmetic than this (MFLOP) runs on one thread: the second core saves
# nothing on its small matrices. Demo model (0.9 MFLOP per token), 32 tokens per sentence, ms per run on
# 1 / 2 threads not spinning: 1 sentence 0.76 / 1.00, 4 sentences 2.57 / 2.47, 16 sentences 8.95 /
# 7.15; 1 sentence inside decodes, 1 thread / 2 threads spinning at most ENCODER_SPIN_US: 0.90 / 0.88.
NARROW_ENCODER_MFLOP = 60.0


# How long (us) an idle thread of the encoder's and the steps' pools spins before it sleeps, on an
# onnxruntime that can bound it (session.intra_op.spin_duration_us, 1.26 and later; older ones spin ~16
# ms here, and there the encoder does not spin at all, see below). The two sessions' pools share the
# cores: a pool spinning on after its last run takes a core from the other's next runs (the encoder's
# after it from the first steps, the step pool's after a decode's last step from the next batch's
# encoder). Bounded, the encoder's threads spin through its run's kernels instead of sleeping between
# them, and both pools get out of the way soon after. A small model's step pool (only its wide session
# has threads) spins as briefly as the encoder's; a larger model's steps run for milliseconds with
# pauses between them, and its pool spins longer. Decodes back to back, 30 (demo) or 10-12 (base)
# rounds, median of per-round ratios to not spinning the encoder and default step spinning: demo greedy
# batch 16 0.90 and 0.90 (encoder 8.6 -> 6.5 ms), beam 4 batch 16 0.95, batch 1 1.02 (greedy) and 0.98
# (beam 4, both on the one-thread encoder); base with 300 / 3,000 us step spinning: greedy batch 16
# 0.94 / 0.94 (encoder 204 -> 167 ms), beam 4 batch 16 1.01 / 1.01, greedy batch 1 1.01 / 0.94,
# beam 4 batch 1 1.00 / 0.98. A 1-2 ms bound for a small model's steps was worse (demo batch 16:
# 1.01-1.14).
ENCODER_SPIN_US = 300
SMALL_STEP_SPIN_US = 300  # models below SMALL_STEP_MFLOP
STEP_SPIN_US = 3000
BOUNDED_SPIN_SINCE = (1, 26)


def bounded_spin(ort) -> bool:
    """Whether this onnxruntime bounds its pools' idle spinning (session.intra_op.spin_duration_us)."""
    try:
        return tuple(int(x) for x in ort.__version__.split(".")[:2]) >= BOUNDED_SPIN_SINCE
    except ValueError:  # not a release version string: assume a recent one
        return True


# ONNX Runtime graph fusions the encoder session, and the step sessions on the CPU, turn off.
# SkipLayerNormFusion: ONNX Runtime 1.31's CPU SkipLayerNormalization kernel is 4-6x slower than the Add +
# LayerNormalization it replaces once there are many rows (one thread, us: 64 x 128 72 vs 27, 512 x 128 430 vs
# 98, 512 x 512 1,638 vs 252; the same at one row): base encoder at 16 x 32 tokens 177-189 -> 171-178 ms in
# three A/B runs (the demo's: the same within noise, 6.3-9.0 ms either way). The step graphs: the fused one is
# now exported with Add + LayerNormalization (figures in transduce/exporter/ort_step.py), which this keeps
# from being fused back; the standard one is traced that way. On the AMD EPYC machine the steps' were
# measured with and without the fusion at 0.94-1.01 (demo) and 0.99 (base) of each other, on an Intel Xeon
# without it 0.95-0.99.
UNFUSED = ["SkipLayerNormFusion"]


# A small model's step still gets the whole thread budget once a step has this much arithmetic
# (rows x MFLOP per row): the one-thread session serves small row counts, a second session of the same
# graph with the budget serves large ones. Demo model (0.9 MFLOP/row), us per step run at 1 / 2 threads,
# fused graph (decoder_step.ort.onnx): 4 rows 159 / 242, 8 rows 307 / 381, 12 rows 470 / 536, 16 rows
# 545 / 440, 64 rows 2,530 / 1,386; standard graph: 16 rows 519 / 545, 64 rows 2,693 / 1,717.
WIDE_STEP_MFLOP = 14.0

# Which of a small model's step sessions serves which row count (the backend's `wide_steps` option):
#   "rows"    the one-thread session below WIDE_STEP_MFLOP of arithmetic per step, the budget's from there;
#   "always"  the budget's session at every row count;
#   "auto"    (the default) measured when the backend loads: a one-row step is run on both sessions,
#             interleaved, and "always" is taken if the budget's session is faster by WIDE_MARGIN, else "rows".
# Why measured: the machines disagree. On the 2-core AMD EPYC machine two threads made a one-row step slower
# (demo model, whole decodes on two threads / one: greedy batch 1 1.26, beam 4 batch 1 1.04, greedy batch 4
# 1.03); on a 2-core Intel Xeon (2026-11-24) faster at every row count (us per one-row step run back to back,
# one thread / two: 98 / 84; whole decodes, 10 interleaved rounds, two threads / one: greedy batch 1 0.86,
# beam 4 batch 1 0.91, greedy batch 4 0.92), and the one-row runs back to back rank the two as the decodes do
# on both. The measurement takes ~100 one-row runs (~10 ms for the demo model).
WIDE_STEPS = ("auto", "rows", "always")
WIDE_MARGIN = 0.95  # "auto" takes "always" when the budget's one-row step takes at most this share of the other's
# The measurement: WIDE_CALIBRATION_BLOCKS blocks per session, alternating between the sessions, each of
# WIDE_CALIBRATION_RUNS timed runs after WIDE_CALIBRATION_WARMUP untimed ones; a session's time is the lowest of
# its blocks' medians (interference only adds). Blocks, not single runs alternating: each session holds its own
# packed copy of the weights, and alternating run by run made both read them from further away (demo: 124 and
# 116 us instead of 98 and 84).
WIDE_CALIBRATION_BLOCKS = 3
WIDE_CALIBRATION_RUNS = 15
WIDE_CALIBRATION_WARMUP = 3


# A small model's batch of at least SHARD_MIN_ROWS rows (sentences x beam) and two sentences is decoded (on the
# fused step graph) in parts, one per thread of the budget, at the same time (the `shards` option; shards() and decoding.py): each
# part on one-thread sessions, in a thread of its own (ONNX Runtime lets go of the GIL while it runs). A small
# model's step is mostly per-kernel costs, which a second intra-op thread does not share out: two one-thread
# runs of half the rows each beat one two-thread run of them all. Demo model, forced 32 tokens, Intel Xeon
# (2 cores), ms per decode, two parts on one thread each / the batch whole on two threads: greedy batch 2 5.86 /
# 5.32, 4 6.68 / 6.85, 8 8.19 / 10.14, 16 12.29 / 15.77, 32 18.41 / 24.96; beam 4 batch 2 11.12 / 12.03, 4
# 15.64 / 17.13, 8 20.60 / 27.48, 16 32.27 / 43.81, 32 53.29 / 73.98. Not for larger models, whose steps are
# bound by reading the weights, which two parts read twice (base shape, greedy batch 16: 483 / 360 ms).
SHARD_MIN_ROWS = 8
# ... and each part gets at least this many rows: the parts' Python (the search, ~25-50 us a step) runs under one
# interpreter lock, which many one-row parts on a many-core machine would keep busy all the time (not measured
# here: 2 cores only).
SHARD_MIN_PART_ROWS = 4


_LAST = "last step"  # the key of _State.bindings' entry for the last step's (key, session, binding, fused)


@dataclass
class _State:
    enc: dict[str, Any]  # encoder outputs (B rows)
    rows: int  # current number of decoding rows
    capacity: int
    cross_rows: np.ndarray  # the encoder rows the gathered cross K/V hold (per row, or per source)
    cache: Any  # every layer's self-attention K and V in one buffer: (2L, R_max, H, C, Dh), in the
    # contract's order (key_0, value_0, key_1, ...); cache[i, :rows] is what past_<i> is bound to
    cross: dict[str, Any] = field(default_factory=dict)  # name -> (R, ...) gathered cross K/V + src_lengths
    outputs: dict[str, Any] = field(default_factory=dict)  # name -> preallocated output buffer (R_max, ...)
    tokens: Any = None  # (R_max,) int64 input buffers, rewritten in place each step
    positions: Any = None
    row_src_given: bytes | None = None  # the row_src last given, as bytes (decoding passes it again while unchanged)
    bindings: dict = field(default_factory=dict)  # (rows, session, k, ban_eos) -> IOBinding, bound once;
    # _LAST -> the last step's (key, session, binding, fused graph)
    topk: dict = field(default_factory=dict)  # k -> (values, ids) (R_max, k) buffers of the fused graph's top-k
    owned: list = field(default_factory=list)  # pooled memory of this run, released by end()
    position: int = 0


class OnnxRuntimeBackend:
    name = "onnxruntime"

    def __init__(self, artifact_dir: str | os.PathLike, provider: str = "cpu", threads: int = 0,
                 verify: bool = True, optimization: str = "all", provider_options: dict | None = None,
                 fused: bool = True, wide_steps: str = "auto", shards: bool = True, device_index: int = 0):
        """device_index: the GPU (CUDA ordinal) the CUDA and TensorRT providers, and the buffers, are on."""
        ort = _import_ort()
        if wide_steps not in WIDE_STEPS:
            raise BackendUnavailable(f"unknown wide_steps {wide_steps!r}", hint=f"choose one of {', '.join(WIDE_STEPS)}")
        self.ort = ort
        self.artifact_dir = os.fspath(artifact_dir)
        self.manifest = read_manifest(self.artifact_dir, verify_hashes=verify)
        self.config = self.manifest["model"]
        self.precision = self.manifest["precision"]
        if provider not in PROVIDERS:
            raise BackendUnavailable(f"unknown onnxruntime provider {provider!r}", hint=f"choose one of {sorted(PROVIDERS)}")
        wanted = PROVIDERS[provider]
        if wanted[0] not in ort.get_available_providers():
            raise BackendUnavailable(
                f"{wanted[0]} is not available in this onnxruntime ({ort.get_available_providers()})",
                hint="install onnxruntime-gpu for CUDA/TensorRT providers, or use --device cpu",
            )
        if provider != "cpu" and quantization(self.manifest):
            raise BackendUnavailable(
                f"{self.artifact_dir} has {quantization(self.manifest)} graphs (transduce export --quantize), "
                f"which run on ONNX Runtime's CPU provider only, not {provider}",
                hint="decode it with --device cpu, or export again without --quantize for the GPU")
        self.provider = provider
        self.on_device = provider != "cpu"
        self.device_index = device_index if self.on_device else 0
        levels = {
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        }
        if optimization not in levels:
            raise BackendUnavailable(f"unknown onnxruntime optimization level {optimization!r}",
                                     hint=f"choose one of {', '.join(levels)}")
        level = levels[optimization]

        self.bounded_spin = bounded_spin(ort)
        small = step_mflop_per_row(self.config) < SMALL_STEP_MFLOP
        # idle spinning per pool, us (0: none, None: onnxruntime's default); the bench reports it
        self.pool_spin_us = {"encoder": ENCODER_SPIN_US if self.bounded_spin else 0,
                             "steps": (SMALL_STEP_SPIN_US if small else STEP_SPIN_US) if self.bounded_spin else None}

        def options(n_threads: int, spin_us: int | None = self.pool_spin_us["steps"]):
            """spin_us: how long idle pool threads spin (0: not at all, None: onnxruntime's default)."""
            so = ort.SessionOptions()
            if n_threads:
                so.intra_op_num_threads = n_threads
                so.inter_op_num_threads = 1
            if spin_us == 0:
                so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            elif spin_us is not None:
                so.add_session_config_entry("session.intra_op.spin_duration_us", str(spin_us))
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            so.graph_optimization_level = level
            return so

        self.threads = intra_op_threads(self.config, threads)  # the step's threads at small row counts
        self._mem = _TorchCudaMemory(self.precision, self.device_index) if self.on_device else _NumpyMemory(self.precision, ort)
        enc_opts, dec_opts = self._provider_options(provider, provider_options or {})
        step_path = os.path.join(self.artifact_dir, contract.STEP_FILE)
        try:
            # the encoder always gets the whole budget: it runs over every source token at once. Its
            # threads spin at most ENCODER_SPIN_US after a run, or not at all where onnxruntime cannot
            # bound that (runs are once per batch; spinning ~16 ms would take the second core from the
            # decoding loop: demo beam 4 batch 16, 181 -> 131 ms without spinning)
            self.encoder = ort.InferenceSession(os.path.join(self.artifact_dir, contract.ENCODER_FILE),
                                                options(threads, self.pool_spin_us["encoder"]), providers=[(p, enc_opts.get(p, {})) for p in wanted],
                                                disabled_optimizers=UNFUSED)
            self.encoder_narrow = self.encoder  # for runs below NARROW_ENCODER_MFLOP (made when first needed)
            self._encoder_threads = threads
            self.fused = fused and self._fused_graph_usable()
            self._step_path = step_path
            self._options = options
            path = os.path.join(self.artifact_dir, contract.ORT_STEP_FILE) if self.fused else step_path
            step_unfused = [] if self.on_device else UNFUSED
            self.decoder = ort.InferenceSession(path, options(self.threads),
                                                providers=[(p, dec_opts.get(p, {})) for p in wanted],
                                                disabled_optimizers=step_unfused)
            self.decoder_wide = self.decoder
            if self.threads != threads and not self.on_device:
                self.decoder_wide = ort.InferenceSession(path, options(threads), providers=["CPUExecutionProvider"],
                                                         disabled_optimizers=UNFUSED)
            self._standard = None if self.fused else self.decoder  # decoder_step.onnx, when pinned to it
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph classes
            raise BackendUnavailable(f"onnxruntime could not load {self.artifact_dir}: {e}",
                                     hint=rebuild_hint(self.artifact_dir, self.manifest)) from None
        self.n_layers = self.config["decoder_layers"]
        self._check_io(self.encoder, contract.ENCODER_FILE)
        self._check_io(self.decoder, contract.ORT_STEP_FILE if self.fused else contract.STEP_FILE)
        self.heads = self.config["n_heads"]
        self.head_dim = self.config["d_model"] // self.heads
        self.float_dtype = np.dtype(PRECISION_DTYPES[self.precision]) if self.precision != "bf16" else None
        self.cache_names = [f"past_{kv}_{i}" for i in range(self.n_layers) for kv in ("key", "value")]
        self.new_names = [f"new_{kv}_{i}" for i in range(self.n_layers) for kv in ("key", "value")]
        self.present_names = [f"present_{kv}_{i}" for i in range(self.n_layers) for kv in ("key", "value")]
        self.cross_names = [f"cross_{kv}_{i}" for i in range(self.n_layers) for kv in ("key", "value")]
        self._topk: _OrtTopK | None = None
        # the fused graph's top-k inputs: k, and the additive bias banning PAD, BOS (and EOS)
        self._topk_k: dict[int, np.ndarray] = {}
        self._ban_bias = {ban: ban_bias(self.config, ban) for ban in (False, True)}
        self._mflop_per_row = step_mflop_per_row(self.config)
        self._pinned: str | None = None  # a step graph every row count runs on (only_step_graph)
        # the row count from which a step runs on decoder_wide, and how that was decided (the bench reports it)
        self._wide_from = max(1, int(np.ceil(WIDE_STEP_MFLOP / self._mflop_per_row)))
        self.wide_steps: dict[str, Any] = {"option": wide_steps, "rule": "rows"}
        if self.decoder_wide is not self.decoder:
            if wide_steps == "auto":
                self.wide_steps.update(self._time_one_row_steps())
                self.wide_steps["rule"] = ("always" if self.wide_steps["one_row_us"]["wide"]
                                           <= WIDE_MARGIN * self.wide_steps["one_row_us"]["narrow"] else "rows")
            else:
                self.wide_steps["rule"] = wide_steps
            if self.wide_steps["rule"] == "always":
                self._wide_from = 1
        # a small model's batch in parts, one per thread of the budget (SHARD_MIN_ROWS); views made when first needed
        # parts a large enough batch is decoded in (1: never; only on the fused graph, see shards())
        # not for quantized graphs: dynamic quantization scales a run's activations by the whole run's range, so a
        # row's results depend on the rows beside it
        self.shard_count = ((threads or usable_cpus()) if shards and self.fused and self.decoder_wide is not self.decoder
                            and not quantization(self.manifest) else 1)
        self._shard_views: list[OnnxRuntimeBackend] | None = None
        self._shard_lock = threading.Lock()

    def _check_io(self, session, graph_file: str) -> None:
        """Refuse a session whose graph's IO is not the contract's for this manifest's precision and model (a
        graph swapped in from another export, a hand-edited manifest)."""
        inputs, outputs = contract.graph_io(graph_file, self.n_layers)
        config = self.manifest["model"]

        def triples(args):
            return [(a.name, ort_type(a.type), tuple(a.shape)) for a in args]

        problems = contract.io_mismatches("input", triples(session.get_inputs()), inputs, self.precision, config)
        problems += contract.io_mismatches("output", triples(session.get_outputs()), outputs, self.precision, config)
        if problems:
            raise ArtifactError(f"{os.path.join(self.artifact_dir, graph_file)} does not match its manifest "
                                f"({self.precision}, {config.get('decoder_layers')} decoder layers): "
                                + "; ".join(problems[:4]), hint=rebuild_hint(self.artifact_dir, self.manifest))

    def _fused_graph_usable(self) -> bool:
        """Whether the step sessions run the artifact's ONNX Runtime step graph (ort_step.py): on the
        CPU provider, when the artifact has one."""
        return not self.on_device and contract.ORT_STEP_FILE in self.manifest["files"]

    def wide_rows_threshold(self) -> int:
        """Row count from which a step runs on the whole thread budget (decoder_wide)."""
        return self._wide_from

    def _time_one_row_steps(self) -> dict[str, Any]:
        """A one-row step run back to back on the one-thread session and on the budget's, interleaved, at
        the middle of a 32-slot cache over a 16-token source of zeros: {"one_row_us": {"narrow": median,
        "wide": median}} (see WIDE_STEPS)."""
        import time

        h, dh, src = self.heads, self.head_dim, 16
        position = min(16, self.config["max_positions"] - 1)  # a slot the positional table has
        enc: dict[str, Any] = {name: self._mem.from_numpy(np.zeros((1, h, src, dh), self.float_dtype))
                               for name in self.cross_names}
        enc["src_lengths"] = np.array([src], np.int64)
        state = self.begin(enc, np.zeros(1, np.int64), 32)
        try:
            self._mem.fill(state.tokens, self.config["bos_id"], 1)
            self._mem.fill(state.positions, position, 1)
            runs = {name: (session, self._binding_for(state, session)) for name, session in
                    (("narrow", self.decoder), ("wide", self.decoder_wide))}
            best = {name: math.inf for name in runs}
            for _ in range(WIDE_CALIBRATION_BLOCKS):
                for name, (session, binding) in runs.items():
                    times = []
                    for _ in range(WIDE_CALIBRATION_WARMUP + WIDE_CALIBRATION_RUNS):
                        t = time.perf_counter()
                        session.run_with_iobinding(binding)
                        times.append(time.perf_counter() - t)
                    best[name] = min(best[name], float(np.median(times[WIDE_CALIBRATION_WARMUP:])))
        finally:
            self.end(state)
        return {"one_row_us": {name: round(t * 1e6, 1) for name, t in best.items()}}

    def step_graphs(self) -> list[str]:
        """The step graph files this backend decodes with (parity checks each one)."""
        return [contract.ORT_STEP_FILE, contract.STEP_FILE] if self.fused else [contract.STEP_FILE]

    @contextlib.contextmanager
    def only_step_graph(self, graph: str):
        """Meanwhile run every step, whatever its row count, on one step graph (one of step_graphs())."""
        if graph not in self.step_graphs():
            raise ValueError(f"{graph!r} is not one of this backend's step graphs {self.step_graphs()}")
        before, self._pinned = self._pinned, graph
        try:
            yield
        finally:
            self._pinned = before

    def _pinned_to_standard(self) -> bool:
        """Whether an artifact with the fused graph is meanwhile run on the standard one only."""
        return self.fused and self._pinned == contract.STEP_FILE

    def _session_for(self, rows: int):
        if self._pinned_to_standard():
            if self._standard is None:
                try:
                    self._standard = self.ort.InferenceSession(self._step_path, self._options(self.threads),
                                                               providers=["CPUExecutionProvider"], disabled_optimizers=UNFUSED)
                except Exception as e:  # onnxruntime's own exception classes
                    raise BackendUnavailable(f"onnxruntime could not load {self._step_path}: {e}",
                                             hint=rebuild_hint(self.artifact_dir, self.manifest)) from None
                self._check_io(self._standard, contract.STEP_FILE)
            return self._standard
        return self.decoder_wide if rows >= self._wide_from else self.decoder

    def _writes_cache(self, session) -> bool:
        """Whether a step session runs the fused graph (it writes the cache slot itself)."""
        return self.fused and session is not self._standard

    def _provider_options(self, provider: str, user: dict) -> tuple[dict, dict]:
        """Per-session provider options for the encoder and the step session.

        CUDA: TF32 off for fp32 graphs (it breaks fp32 parity on Ampere and newer), and ORT runs on the
        same CUDA stream as the torch ops that write the cache, so they are ordered explicitly.
        TensorRT EP: one explicit optimization profile per graph (without one the EP rebuilds its engine
        whenever cache_len or the row count leaves the shapes it has seen) and an on-disk engine cache.
        Never trt_fp16_enable: the graphs carry their precision, and ORT builds strongly typed networks
        only with it off. `user` ({provider: {option: value}}) overrides all of these.
        """
        if provider == "cpu":
            return user, user
        cuda = {"device_id": str(self.device_index), "user_compute_stream": str(self._mem.stream.cuda_stream)}
        if self.precision == "fp32":
            cuda["use_tf32"] = "0"
        enc = {"CUDAExecutionProvider": dict(cuda)}
        dec = {"CUDAExecutionProvider": dict(cuda)}
        if provider == "tensorrt":
            from transduce.formats.profiles import derive_profiles, ort_tensorrt_profile_options

            plan = derive_profiles(self.config, profiles="single")
            cache = os.path.join(os.path.expanduser("~"), ".cache", "transduce", "ort-trt",
                                 self.manifest["files"][contract.STEP_FILE]["sha256"][:16])
            base = {"device_id": str(self.device_index), "trt_engine_cache_enable": "1", "trt_engine_cache_path": cache,
                    "trt_timing_cache_enable": "1", "trt_timing_cache_path": cache,
                    "user_compute_stream": str(self._mem.stream.cuda_stream)}
            enc["TensorrtExecutionProvider"] = {**base, **ort_tensorrt_profile_options(plan.profiles("encoder")[0], "encoder", self.config)}
            dec["TensorrtExecutionProvider"] = {**base, **ort_tensorrt_profile_options(plan.profiles("decoder_step")[0], "decoder_step", self.config)}
        for p, opts in user.items():
            enc.setdefault(p, {}).update(opts)
            dec.setdefault(p, {}).update(opts)
        return enc, dec

    # -- encoder ----------------------------------------------------------------------------------
    def _encoder_for(self, tokens: int):
        """The encoder session for a run over `tokens` source positions: one thread for small runs."""
        if self._encoder_threads == 1 or tokens * encoder_mflop_per_token(self.config) >= NARROW_ENCODER_MFLOP:
            return self.encoder
        return self._one_thread_encoder()

    def _one_thread_encoder(self):
        """The encoder's one-thread session (made once, when first needed; the encoder itself at a budget of 1)."""
        if self.encoder_narrow is self.encoder and self._encoder_threads != 1:
            try:
                self.encoder_narrow = self.ort.InferenceSession(
                    os.path.join(self.artifact_dir, contract.ENCODER_FILE), self._options(1, 0),
                    providers=["CPUExecutionProvider"], disabled_optimizers=UNFUSED)
            except Exception as e:  # onnxruntime's own exception classes
                raise BackendUnavailable(f"onnxruntime could not load {contract.ENCODER_FILE}: {e}",
                                         hint=rebuild_hint(self.artifact_dir, self.manifest)) from None
        return self.encoder_narrow

    # -- a batch in parts (SHARD_MIN_ROWS) ----------------------------------------------------------
    def shards(self, batch: int, beam: int) -> list[OnnxRuntimeBackend] | None:
        """The backends decoding.decode deals a batch out to (one per thread of the budget, each with at least
        SHARD_MIN_PART_ROWS rows), or None to decode it whole: a small model's batch of two sentences or more
        and SHARD_MIN_ROWS rows or more, on the CPU,
        on the fused step graph of an artifact that is not quantized and while no step graph is pinned
        (only_step_graph); as many parts as leave the smallest SHARD_MIN_PART_ROWS rows, at least two. The fused graph gives a
        row the same results whatever rows run beside it, so the parts decode bit for bit as the whole batch
        would; the standard graph's move in the last bits (~1e-6 in a score) with the batch, so it is not
        offered parts."""
        if self.shard_count < 2 or batch < 2 or batch * beam < SHARD_MIN_ROWS or self._pinned is not None:
            return None
        with self._shard_lock:
            if self._shard_views is None:
                self._shard_views = [self._one_thread_view() for _ in range(self.shard_count)]
        n = min(self.shard_count, batch // -(-SHARD_MIN_PART_ROWS // beam))  # every part >= SHARD_MIN_PART_ROWS rows
        return self._shard_views[:n] if n > 1 else None

    def _one_thread_view(self) -> OnnxRuntimeBackend:
        """This backend on its one-thread sessions only: it shares their weights, the memory pool and the top-k
        session with this one and with the other views, and each decodes a part of a batch in its own thread
        (ONNX Runtime runs one session from several threads at once; a one-thread session runs in the caller's)."""
        view = copy.copy(self)
        view.encoder = view.encoder_narrow = self._one_thread_encoder()
        view._encoder_threads = 1
        view.decoder_wide = self.decoder  # the one-thread step session, at every row count
        view._wide_from = sys.maxsize
        view.threads = 1
        view.shard_count, view._shard_views = 1, None
        return view

    def encode(self, src_ids: np.ndarray, src_lengths: np.ndarray) -> dict[str, Any]:
        feeds = {"src_ids": np.ascontiguousarray(src_ids, np.int64), "src_lengths": np.ascontiguousarray(src_lengths, np.int64)}
        if not self.on_device:
            session = self._encoder_for(feeds["src_ids"].size)
            names = [o.name for o in session.get_outputs()]
            outs = dict(zip(names, session.run(names, feeds)))
            outs["src_lengths"] = feeds["src_lengths"]
            return outs
        binding = self.encoder.io_binding()
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)
        for o in self.encoder.get_outputs():
            binding.bind_output(o.name, "cuda", self.device_index)
        self.encoder.run_with_iobinding(binding)
        outs = {o.name: self._mem.from_ortvalue(v) for o, v in zip(self.encoder.get_outputs(), binding.get_outputs())}
        binding.clear_binding_outputs()
        outs["src_lengths"] = self._mem.from_numpy(feeds["src_lengths"])
        return outs

    def encoder_outputs(self, enc: dict[str, Any]) -> dict[str, np.ndarray]:
        return {k: self._mem.to_numpy(v).astype(np.float32) for k, v in enc.items() if k != "src_lengths" and k in
                {o.name for o in self.encoder.get_outputs()}}

    # -- decoding run -----------------------------------------------------------------------------
    def begin(self, enc: dict[str, Any], row_src: np.ndarray, capacity: int) -> _State:
        rows = len(row_src)
        cap = max(int(capacity), 1)
        mem = self._mem
        owned: list = []
        state = _State(enc=enc, rows=rows, capacity=cap, cross_rows=np.array([-1]), owned=owned,
                       cache=mem.zeros((len(self.cache_names), rows, self.heads, cap, self.head_dim), owned))
        self._alloc_step_buffers(state, rows)
        self._gather_cross(state, np.asarray(row_src, np.int64))
        return state

    def _alloc_step_buffers(self, state: _State, rows: int) -> None:
        mem = self._mem
        state.outputs = {"log_probs": mem.empty((rows, self.config["vocab_size"]), np.float32, state.owned),
                         # every layer's new K and V in one buffer, like the cache: (2L, R_max, H, 1, Dh)
                         "new": mem.empty((len(self.new_names), rows, self.heads, 1, self.head_dim), None, state.owned)}
        state.tokens = mem.from_numpy(np.zeros(rows, np.int64))
        state.positions = mem.from_numpy(np.zeros(rows, np.int64))
        state.topk.clear()
        state.bindings.clear()

    def _cross_rows(self, row_src: np.ndarray) -> np.ndarray:
        """The encoder rows the step's cross K/V inputs hold: one per decoding row for the standard
        graph; for the fused graph one per source when the rows come in equal blocks of one source
        each (beam search's beams: the graph attends source r // block for row r)."""
        if not self.fused or self._pinned_to_standard() or len(row_src) < 2:
            return row_src
        block = int(np.argmax(row_src != row_src[0])) or len(row_src)
        if block > 1 and len(row_src) % block == 0:
            sources = row_src[::block]
            if (row_src.reshape(-1, block) == sources[:, None]).all():
                return sources
        return row_src

    def _gather_cross(self, state: _State, row_src: np.ndarray) -> None:
        given = row_src.tobytes()  # a content check as cheap as an identity one (~0.3 us at 64 rows)
        if given == state.row_src_given:
            return  # decoding passes the same rows again while they are unchanged
        n = len(state.enc["src_lengths"])
        if row_src.size and (row_src.min() < 0 or row_src.max() >= n):
            raise InputError(f"row_src names sentences {row_src.min()}..{row_src.max()}; the batch has {n} (0..{n - 1})")
        state.row_src_given = given
        rows = self._cross_rows(row_src)
        if np.array_equal(rows, state.cross_rows):
            return
        enc = state.enc
        mem = self._mem
        for name in self.cross_names:
            old = state.cross.get(name)
            state.cross[name] = mem.take(enc[name], rows, state.owned)
            if old is not None:
                mem.free(old, state.owned)  # its bindings are cleared below
        state.cross["src_lengths"] = mem.take(enc["src_lengths"], rows)
        state.cross_rows = rows.copy()
        state.bindings.clear()

    def _binding_for(self, state: _State, session, k: int = 1, ban_eos: bool = False):
        """The IOBinding of the current row count on `session`; every tensor is bound by pointer once.

        The buffers' contents change in place between runs (tokens, positions, cache slots and rows),
        their addresses do not, so a binding is reused until the row count, the cross K/V or the
        buffers change. The fused graph's also binds its top-k (k, the ban bias and the outputs).
        """
        r = state.rows
        fused = self._writes_cache(session)
        key = (r, id(session), k, ban_eos) if fused else (r, id(session))
        b = state.bindings.get(key)
        if b is None:
            mem = self._mem
            b = session.io_binding()
            mem.bind(b, "tokens", state.tokens[:r], True)
            mem.bind(b, "positions", state.positions[:r], True)
            for name, arr in state.cross.items():
                mem.bind(b, name, arr, True)
            for i, name in enumerate(self.cache_names):
                mem.bind(b, name, state.cache[i, :r], True)
            mem.bind(b, "log_probs", state.outputs["log_probs"][:r], False)
            if fused:  # the fused graph writes slot `position` of the cache itself, and picks the top-k
                for i, name in enumerate(self.present_names):
                    mem.bind(b, name, state.cache[i, :r], False)
                k_arr = self._topk_k.setdefault(k, np.array([k], np.int64))
                mem.bind(b, "topk_k", k_arr, True)
                mem.bind(b, "topk_bias", self._ban_bias[ban_eos], True)
                values, ids = self._topk_buffers(state, k)
                mem.bind(b, "topk_values", values[:r], False)
                mem.bind(b, "topk_ids", ids[:r], False)
            else:
                for i, name in enumerate(self.new_names):
                    mem.bind(b, name, state.outputs["new"][i, :r], False)
            state.bindings[key] = b
        return b

    def _topk_buffers(self, state: _State, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The fused graph's (R_max, k) top-k outputs (host memory: it runs on the CPU provider only)."""
        bufs = state.topk.get(k)
        if bufs is None:
            n = state.outputs["log_probs"].shape[0]
            bufs = state.topk[k] = (np.empty((n, k), np.float32), np.empty((n, k), np.int64))
        return bufs

    def _run(self, state: _State, tokens: np.ndarray, k: int = 1, ban_eos: bool = False) -> bool:
        """One step; True when it ran the fused graph (its top-k outputs hold this step's k best)."""
        p = state.position
        if p >= state.capacity:
            raise IndexError(f"cache capacity {state.capacity} exhausted at position {p}")
        r = state.rows
        mem = self._mem
        mem.fill(state.tokens, tokens, r)
        mem.fill(state.positions, p, r)
        # the previous step's session and binding, while they still apply: a step usually repeats the
        # last one's rows and k, and every Python call costs several microseconds here, right after a
        # run has streamed the weights through the caches (kept in `bindings`, so whatever clears
        # those clears this too)
        key = (r, k, ban_eos, self._pinned)
        last = state.bindings.get(_LAST)
        if last is not None and last[0] == key:
            _, session, binding, fused = last
        else:
            session = self._session_for(r)
            binding = self._binding_for(state, session, k, ban_eos)
            fused = self._writes_cache(session)
            state.bindings[_LAST] = (key, session, binding, fused)
        session.run_with_iobinding(binding)
        if not fused:
            mem.write_slot(state.cache, state.outputs["new"], r, p)
        state.position = p + 1
        return fused

    def step(self, state: _State, tokens: np.ndarray, k: int, ban_eos: bool = False) -> tuple[np.ndarray, np.ndarray]:
        k = min(k, self.config["vocab_size"])
        if self._run(state, tokens, k, ban_eos):
            values, ids = state.topk[k]
            return values[: state.rows].copy(), ids[: state.rows].copy()
        log_probs = state.outputs["log_probs"][: state.rows]
        if k > 1 and not self.on_device:
            if self._topk is None:
                self._topk = _OrtTopK(self.ort, self.config, self._ban_bias)
            return self._topk(state.outputs["log_probs"], state.rows, k, ban_eos)
        return self._mem.topk(log_probs, k, banned_ids(self.config, ban_eos))

    def step_log_probs(self, state: _State, tokens: np.ndarray) -> np.ndarray:
        self._run(state, tokens)
        return self._mem.to_numpy(state.outputs["log_probs"][: state.rows]).copy()

    def reorder(self, state: _State, rows: np.ndarray, row_src: np.ndarray) -> None:
        rows = np.asarray(rows, np.int64)
        if len(rows) > state.cache.shape[1]:
            self._grow(state, len(rows))
        if len(rows) and rows.view(np.uint64).max() >= state.rows:  # one pass: a negative row is huge as uint64
            raise InputError(f"reorder takes rows 0..{state.rows - 1} of the state, got {rows.min()}..{rows.max()}")
        moved = np.flatnonzero(rows != np.arange(len(rows)))  # rows whose content changes
        if moved.size and state.position:
            self._mem.move_rows(state.cache, moved, rows[moved], state.position)
        if len(rows) != state.rows:
            state.bindings.clear()
        state.rows = len(rows)
        self._gather_cross(state, np.asarray(row_src, np.int64))

    def _grow(self, state: _State, rows: int) -> None:
        """More rows than allocated (beam expansion after step 0): reallocate once, keep contents."""
        mem = self._mem
        old, old_outputs = state.cache, list(state.outputs.values())
        state.cache = mem.zeros((old.shape[0], rows) + tuple(old.shape[2:]), state.owned)
        mem.copy_rows(state.cache, old)
        self._alloc_step_buffers(state, rows)  # clears the bindings and the top-k buffers
        if self._topk is not None:
            self._topk.bindings.clear()
        for buf in [old] + old_outputs:
            mem.free(buf, state.owned)

    def end(self, state: _State) -> None:
        """The run is over: its buffers go back to the pool for the next run (the state is dead)."""
        if self._topk is not None:
            self._topk.bindings.clear()  # they point into buffers that are about to be reused
        state.bindings.clear()
        state.cross.clear()
        state.outputs.clear()
        state.topk.clear()
        state.cache = None
        self._mem.release(state.owned)


class _NumpyMemory:
    """Host buffers for the CPU execution provider."""

    def __init__(self, precision: str, ort=None):
        if precision == "bf16":
            raise BackendUnavailable("bf16 artifacts cannot be decoded on the CPU onnxruntime backend (numpy has no bfloat16)",
                                     hint="export with --precision fp32 or fp16 for CPU decoding")
        self.dtype = np.dtype(PRECISION_DTYPES[precision])
        self._free: list[np.ndarray] = []  # flat byte buffers of finished runs, largest first
        self._lock = threading.Lock()  # the pool is shared by the parts of a batch decoded at once (shards)
        # Binding goes straight to the IOBinding's native methods with one host OrtDevice made here:
        # onnxruntime's Python wrapper resolves the device from its name at every call (1.31: 8.8 vs
        # 1.0 us per tensor; a new binding binds ~20 tensors, once or twice per decode). None: the
        # public wrapper (an onnxruntime without these internals, or after a native call refused).
        try:
            self._host = ort.OrtDevice.make("cpu", 0)._get_c_device()
        except Exception:  # noqa: BLE001 - any onnxruntime without this internal keeps the public path
            self._host = None

    # Big buffers come from a pool of the memory of earlier runs: a fresh array is fresh pages, and first
    # touching them cost more than reusing them (base, beam 4 batch 16: a 52 MB cache and 50 MB of
    # gathered cross K/V per decode, ~100 ms of page faults in a 1.5 s decode).
    # Smaller buffers are left to malloc, which mostly reuses them without fresh pages; pooling the demo
    # model's (from 64 KiB) showed no gain (300 sentences greedy, median of 5: 2,124 sentences/s pooled,
    # 2,201-2,245 with this threshold, 2,596 before the pool existed; all within this machine's noise).
    POOL_MIN_BYTES = 1 << 22
    POOL_MAX_BYTES = 1 << 30  # what the pool keeps between runs, at most

    def _pooled(self, shape, dtype, owned):
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if owned is None or nbytes < self.POOL_MIN_BYTES:
            return None
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.nbytes <= 4 * nbytes]
            flat = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes)) if fits else None
        if flat is None:
            flat = np.empty(nbytes, np.uint8)
        owned.append(flat)
        return flat[:nbytes].view(dtype).reshape(shape)

    def free(self, arr, owned):
        """Back to the pool now: a pooled buffer of this run that nothing uses any more."""
        flat = arr.base
        for i, b in enumerate(owned):
            if b is flat:
                with self._lock:
                    self._free.append(owned.pop(i))
                return

    def release(self, owned):
        with self._lock:
            self._free.extend(owned)
            owned.clear()
            self._free.sort(key=lambda b: -b.nbytes)
            total = 0
            for i, b in enumerate(self._free):
                total += b.nbytes
                if total > self.POOL_MAX_BYTES:
                    del self._free[i:]
                    break

    def zeros(self, shape, owned=None):
        a = self._pooled(shape, self.dtype, owned)
        if a is None:
            return np.zeros(shape, self.dtype)
        a.fill(0)
        return a

    def empty(self, shape, dtype=None, owned=None):
        a = self._pooled(shape, dtype or self.dtype, owned)
        return np.empty(shape, dtype or self.dtype) if a is None else a

    def from_numpy(self, a):
        return a

    def to_numpy(self, a):
        return a

    def take(self, a, idx, owned=None):
        out = self.empty((len(idx),) + a.shape[1:], a.dtype, owned)
        # mode="clip": written straight into `out` ("raise" goes through a temporary of its size); the
        # indices are rows of `a` already
        return np.take(a, idx, axis=0, out=out, mode="clip")

    def bind(self, binding, name, arr, is_input):
        assert arr.flags.c_contiguous, name  # bound by pointer
        native = getattr(binding, "_iobinding", None) if self._host is not None else None
        if native is not None:
            try:
                (native.bind_input if is_input else native.bind_output)(name, self._host, arr.dtype, list(arr.shape),
                                                                        arr.ctypes.data)
                return
            except Exception:  # noqa: BLE001 - another signature or internal: the public wrapper from now on
                self._host = None
        (binding.bind_input if is_input else binding.bind_output)(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)

    def fill(self, buf, values, rows):
        buf[:rows] = values

    def write_slot(self, cache, new, rows, p):
        cache[:, :rows, :, p] = new[:, :rows, :, 0]  # (2L, R, H, Dh) into slot p

    # Below this many bytes moved in all, one fancy-indexing assignment over the whole cache is faster
    # than one per layer's K or V (it saves the per-call overhead). us per reorder, per array / whole:
    # demo model, 4 rows, 2 moved, 16 slots 16.5 / 6.8; 3 moved, 30 slots 22.7 / 14.5; base, 4 rows, 2
    # moved, 16 slots (786 KB) 84 / 55; demo, 64 rows, 20 moved (655 KB) 62 / 61; base, 64 rows, 30
    # moved (11.8 MB) 1,693 / 2,116. Whole decodes, median of 20 interleaved rounds: demo beam 4 batch 1
    # 16.1 -> 14.5 ms, batch 16 85.3 -> 82.8 ms; base beam 4 batch 1 231 -> 224 ms (10 rounds).
    MOVE_WHOLE_MAX_BYTES = 1 << 20

    def move_rows(self, cache, dst, src, p):
        if len(dst) * p * cache.strides[3] * cache.shape[0] * cache.shape[2] <= self.MOVE_WHOLE_MAX_BYTES:
            cache[:, dst, :, :p] = cache[:, src, :, :p]
            return
        # one layer's K or V at a time: numpy's fast path for an index array on the first axis (base
        # model, 64 rows, 58 moved, 31 of 33 slots filled: 6.8 ms, against 14.4 ms indexing the second
        # axis of the whole buffer). The right side is gathered into a temporary first.
        for c in cache:
            c[dst, :, :p] = c[src, :, :p]

    def copy_rows(self, dst, src):
        dst[:, : src.shape[1]] = src

    def topk(self, log_probs, k, banned):
        log_probs[:, banned] = -np.inf  # our output buffer: overwritten by the next run anyway
        return numpy_topk(log_probs, k, [])


class _OrtTopK:
    """Top-k of the step's log-probs with ONNX Runtime's TopK kernel (a one-node graph built here).

    numpy has no top-k: argpartition + argsort cost 2.5-4x more (measured, 64 rows: 181 vs 58 us at
    vocabulary 372, 1474 vs 583 us at 8,000). Banned ids get -inf through an additive (V,) bias; ties
    go to the lower id (ONNX TopK's rule; numpy_topk's argpartition may order exact ties otherwise).
    """

    def __init__(self, ort, config: dict[str, Any], bias: dict[bool, np.ndarray]):
        import onnx
        from onnx import TensorProto, helper

        v = config["vocab_size"]
        graph = helper.make_graph(
            [helper.make_node("Add", ["log_probs", "bias"], ["biased"]),
             helper.make_node("TopK", ["biased", "k"], ["values", "ids"], axis=-1, largest=1, sorted=1)],
            "topk",
            [helper.make_tensor_value_info("log_probs", TensorProto.FLOAT, ["rows", v]),
             helper.make_tensor_value_info("bias", TensorProto.FLOAT, [v]),
             helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
            [helper.make_tensor_value_info("values", TensorProto.FLOAT, ["rows", "k"]),
             helper.make_tensor_value_info("ids", TensorProto.INT64, ["rows", "k"])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        model.ir_version = 8  # what every supported onnxruntime reads
        onnx.checker.check_model(model)
        so = ort.SessionOptions()
        # one thread, so no pool: a pool's threads spin after each top-k and take a core from the
        # next step's run (base model, 64 rows: 59 ms per step run with a 2-thread top-k, 39 without)
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        self.session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        self.bias = bias  # ban_eos -> (V,) additive bias: -inf at the banned ids
        self.bindings: dict[tuple, tuple] = {}

    def __call__(self, buffer: np.ndarray, rows: int, k: int, ban_eos: bool) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of buffer[:rows], a log-probs buffer whose address is bound once.

        Keyed by the buffer's address, not its id(): a pooled buffer is a view whose id can be reused
        by a later view of other memory (and the backend's end() clears the bindings anyway)."""
        key = (buffer.ctypes.data, buffer.shape, rows, k, ban_eos)
        entry = self.bindings.get(key)
        if entry is None:
            log_probs = buffer[:rows]
            r, v = log_probs.shape
            k_arr = np.array([min(k, v)], np.int64)
            values, ids = np.empty((r, k_arr[0]), np.float32), np.empty((r, k_arr[0]), np.int64)
            b = self.session.io_binding()
            b.bind_input("log_probs", "cpu", 0, np.float32, [r, v], log_probs.ctypes.data)
            b.bind_input("bias", "cpu", 0, np.float32, [v], self.bias[ban_eos].ctypes.data)
            b.bind_input("k", "cpu", 0, np.int64, [1], k_arr.ctypes.data)
            b.bind_output("values", "cpu", 0, np.float32, list(values.shape), values.ctypes.data)
            b.bind_output("ids", "cpu", 0, np.int64, list(ids.shape), ids.ctypes.data)
            if len(self.bindings) > 64:
                self.bindings.clear()
            entry = self.bindings[key] = (b, values, ids, k_arr, log_probs)  # keeps the buffers alive
        b, values, ids = entry[:3]
        self.session.run_with_iobinding(b)
        return values.copy(), ids.copy()


def _on_stream(method):
    """A _TorchCudaMemory method run with the memory's stream current, and only meanwhile: ORT runs on
    that stream (user_compute_stream), so the cache writes, gathers and reads back are ordered with its
    runs, and the caller's own current stream is left as it was (two backends each keep their own)."""

    @functools.wraps(method)
    def on_stream(self, *args, **kwargs):
        with self.torch.cuda.stream(self.stream):
            return method(self, *args, **kwargs)

    return on_stream


class _TorchCudaMemory:
    """CUDA buffers (torch tensors) for the CUDA and TensorRT execution providers; every kernel, copy
    and allocation on the backend's own stream (see _on_stream)."""

    _DT = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

    def __init__(self, precision: str, index: int = 0):
        try:
            import torch
        except ImportError:
            raise BackendUnavailable("device decoding with onnxruntime needs torch for CUDA buffers") from None
        # a GPU this torch sees (ORT numbers them alike: both follow CUDA_VISIBLE_DEVICES), or BackendUnavailable
        torch_device(f"cuda:{index}", error=BackendUnavailable, runs="the onnxruntime backend runs")
        if precision == "bf16":
            raise BackendUnavailable("bf16 artifacts are decoded by the tensorrt backend, not onnxruntime's IO binding",
                                     hint="use --backend tensorrt, or export fp16/fp32 for onnxruntime")
        self.torch = torch
        self.dtype = getattr(torch, self._DT[precision])
        self.index = index
        self.device = torch.device("cuda", index)
        # ORT runs on this stream (user_compute_stream) and so do our cache writes, gathers and top-k,
        # each made current only while it runs (not set for the thread: that would move the caller's
        # own torch work onto it, and a second backend would take it over for both)
        self.stream = torch.cuda.Stream(self.device)
        self._np_of = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}

    # torch's CUDA caching allocator pools device memory already: `owned` is unused
    def release(self, owned):
        owned.clear()

    def free(self, t, owned):
        pass

    @_on_stream
    def zeros(self, shape, owned=None):
        return self.torch.zeros(shape, dtype=self.dtype, device=self.device)

    @_on_stream
    def empty(self, shape, dtype=None, owned=None):
        dt = self.torch.float32 if dtype is np.float32 or dtype == self.torch.float32 else self.dtype
        return self.torch.empty(shape, dtype=dt, device=self.device)

    @_on_stream
    def from_numpy(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)

    @_on_stream
    def from_ortvalue(self, v):
        """A device OrtValue -> a torch tensor on the device (copied once, so ORT can free its buffer)."""
        return self.torch.from_dlpack(v).clone()

    @_on_stream
    def to_numpy(self, t):
        return t.float().cpu().numpy() if t.dtype == self.torch.bfloat16 else t.cpu().numpy()

    @_on_stream
    def take(self, t, idx, owned=None):
        return t.index_select(0, self.from_numpy(np.asarray(idx, np.int64))).contiguous()

    def bind(self, binding, name, t, is_input):
        assert t.is_contiguous(), name  # bound by pointer
        np_dtype = self._np_of[t.dtype]
        (binding.bind_input if is_input else binding.bind_output)(name, "cuda", self.index, np_dtype, list(t.shape), t.data_ptr())

    @_on_stream
    def fill(self, buf, values, rows):
        if isinstance(values, np.ndarray):
            buf[:rows].copy_(self.torch.from_numpy(np.ascontiguousarray(values, np.int64)), non_blocking=True)
        else:
            buf[:rows].fill_(values)

    @_on_stream
    def write_slot(self, cache, new, rows, p):
        cache[:, :rows, :, p : p + 1].copy_(new[:, :rows])

    @_on_stream
    def move_rows(self, cache, dst, src, p):
        move_rows_torch(cache, self.from_numpy(dst), self.from_numpy(src), p)

    @_on_stream
    def copy_rows(self, dst, src):
        dst[:, : src.shape[1]].copy_(src)

    @_on_stream
    def topk(self, log_probs, k, banned):
        log_probs[:, banned] = float("-inf")  # our output buffer: overwritten by the next run anyway
        vals, ids = log_probs.topk(min(k, log_probs.shape[1]), dim=-1)
        return vals.float().cpu().numpy(), ids.cpu().numpy()
