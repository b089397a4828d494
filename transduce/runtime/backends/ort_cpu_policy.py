"""How the ONNX Runtime backend tunes itself on the CPU: threads per session, idle spinning of the thread
pools, which step session serves which row count, and when a batch is decoded in parts.

Each rule is a constant or a function here; why it is what it is, with the measurements it was decided
on, is in docs/design/onnxruntime-cpu.md (one section per rule, named in the comments below).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from transduce.formats.model_config import ModelConfig

# Step threads: below this much arithmetic per decoding row and step (MFLOP), one intra-op thread is faster
# than two, the pool's synchronisation costing more than it saves (design note: "Step threads").
SMALL_STEP_MFLOP = 5.0

# The encoder: a run with less arithmetic than this (MFLOP) runs on a one-thread session, a second core
# saving nothing on its small matrices (design note: "The encoder").
NARROW_ENCODER_MFLOP = 60.0

# Encoder runs by length: a batch whose sentences' lengths differ (a server's admission of several requests, or
# of one request's sentences) is encoded in runs of similar lengths where a run saves more padded tokens than
# this: one more run reads every weight once more, which costs about as much as so many tokens' arithmetic,
# whatever the model's size (design note: "Encoder runs by length").
ENCODER_RUN_TOKENS = 16

# Idle spinning (us) of the encoder's and the steps' pools on an onnxruntime that can bound it: the two pools
# share the cores, so each gets out of the other's way soon after its runs (design note: "Idle spinning").
ENCODER_SPIN_US = 300
SMALL_STEP_SPIN_US = 300  # models below SMALL_STEP_MFLOP
STEP_SPIN_US = 3000
BOUNDED_SPIN_SINCE = (1, 26)  # the onnxruntime version with session.intra_op.spin_duration_us

# ONNX Runtime graph fusions the encoder session, and the step sessions on the CPU, turn off: its CPU
# SkipLayerNormalization is slower than the Add + LayerNormalization it replaces (design note: "Graph fusions").
UNFUSED = ["SkipLayerNormFusion"]

# Wide steps: a small model's step runs on the session with the whole thread budget from this much arithmetic
# per step (rows x MFLOP per row), on the one-thread session below it (design note: "Wide steps").
WIDE_STEP_MFLOP = 14.0
# The backend's `wide_steps` option: "rows" (the rule above), "always" (the budget's session at every row
# count) or "auto" (a one-row step timed on both sessions when the backend loads decides between the two).
WIDE_STEPS = ("auto", "rows", "always")
WIDE_MARGIN = 0.95  # "auto" takes "always" when the budget's one-row step takes at most this share of the other's
# The one-row timing: blocks per session, alternating between the sessions, each of so many timed runs after
# so many untimed ones; a session's time is the lowest of its blocks' medians.
WIDE_CALIBRATION_BLOCKS = 3
WIDE_CALIBRATION_RUNS = 15
WIDE_CALIBRATION_WARMUP = 3

# A batch in parts: a small model's batch of two sentences or more and at least this many rows (sentences x
# beam) is decoded in parts, one per thread, at the same time (design note: "A batch in parts") ...
SHARD_MIN_ROWS = 8
# ... and each part gets at least this many rows: the parts' Python runs under one interpreter lock.
SHARD_MIN_PART_ROWS = 4


def step_mflop_per_row(config: ModelConfig) -> float:
    """Multiply-adds x 2 of one decoder step for one row: the decoder's projections and the logits."""
    d, ff, n = config.d_model, config.d_ff, config.decoder_layers
    return 2.0 * (n * (4 * d * d + 2 * d * ff) + config.vocab_size * d) / 1e6


def small_steps(config: ModelConfig) -> bool:
    """Whether a model's steps are small enough for one intra-op thread (SMALL_STEP_MFLOP)."""
    return step_mflop_per_row(config) < SMALL_STEP_MFLOP


def intra_op_threads(config: ModelConfig, budget: int) -> int:
    """Step threads to use within a budget (0: ONNX Runtime's default): one for small models."""
    if budget != 1 and small_steps(config):
        return 1
    return budget


def encoder_mflop_per_token(config: ModelConfig) -> float:
    """Multiply-adds x 2 of the encoder graph per source token: its layers' projections and FFN, and
    every decoder layer's cross K/V projection."""
    d, ff = config.d_model, config.d_ff
    return 2.0 * (config.encoder_layers * (4 * d * d + 2 * d * ff) + 2 * config.decoder_layers * d * d) / 1e6


def narrow_encoder_run(config: ModelConfig, tokens: int) -> bool:
    """Whether an encoder run over `tokens` source positions runs on one thread (NARROW_ENCODER_MFLOP)."""
    return tokens * encoder_mflop_per_token(config) < NARROW_ENCODER_MFLOP


def encoder_runs(lengths: np.ndarray) -> list[np.ndarray] | None:
    """The rows of a batch of sources (their lengths, EOS included) to encode in separate runs, each padded to
    its own longest, shortest first -> None where one run over the batch costs least (ENCODER_RUN_TOKENS).

    The batch is cut in two where that saves the most padding, and each part again, while a cut saves more
    padding than a run costs."""
    lengths = np.asarray(lengths, np.int64)
    if len(lengths) < 2:
        return None
    order = np.argsort(lengths, kind="stable")
    cuts: list[int] = []
    spans = [(0, len(order))]
    ordered = lengths[order]
    while spans:
        lo, hi = spans.pop()
        part = ordered[lo:hi]
        k = np.arange(1, len(part))  # a cut after the k shortest: they stop being padded to the part's longest
        if not k.size:
            continue
        saved = k * (part[-1] - part[:-1])
        best = int(np.argmax(saved))
        if saved[best] <= ENCODER_RUN_TOKENS:
            continue
        cut = lo + best + 1
        cuts.append(cut)
        spans += [(lo, cut), (cut, hi)]
    if not cuts:
        return None
    return np.split(order, sorted(cuts))


def narrow_encoder_tokens(config: ModelConfig) -> int:
    """Source tokens per run from which the encoder runs on the whole budget (the bench reports it)."""
    return math.ceil(NARROW_ENCODER_MFLOP / encoder_mflop_per_token(config))


def bounded_spin(ort) -> bool:
    """Whether this onnxruntime bounds its pools' idle spinning (session.intra_op.spin_duration_us)."""
    try:
        return tuple(int(x) for x in ort.__version__.split(".")[:2]) >= BOUNDED_SPIN_SINCE
    except ValueError:  # not a release version string: assume a recent one
        return True


def pool_spin_us(config: ModelConfig, bounded: bool) -> dict[str, int | None]:
    """How long idle threads of each pool spin, us (0: not at all, None: onnxruntime's default). Where the
    spinning cannot be bounded the encoder does not spin: its ~16 ms would take a core from the steps."""
    if not bounded:
        return {"encoder": 0, "steps": None}
    return {"encoder": ENCODER_SPIN_US, "steps": SMALL_STEP_SPIN_US if small_steps(config) else STEP_SPIN_US}


def wide_from_rows(config: ModelConfig) -> int:
    """The row count from which the "rows" rule runs a step on the budget's session (WIDE_STEP_MFLOP)."""
    return max(1, int(np.ceil(WIDE_STEP_MFLOP / step_mflop_per_row(config))))


def wide_rule(one_row_us: dict[str, float]) -> str:
    """The rule "auto" resolves to from the one-row timings {"narrow": us, "wide": us} (WIDE_MARGIN)."""
    return "always" if one_row_us["wide"] <= WIDE_MARGIN * one_row_us["narrow"] else "rows"


def time_one_row(runs: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Time each of `runs` (name -> one run) in blocks alternating between them (WIDE_CALIBRATION_*):
    name -> the lowest block median, us (interference only adds)."""
    best = {name: math.inf for name in runs}
    for _ in range(WIDE_CALIBRATION_BLOCKS):
        for name, run in runs.items():
            times = []
            for _ in range(WIDE_CALIBRATION_WARMUP + WIDE_CALIBRATION_RUNS):
                t = time.perf_counter()
                run()
                times.append(time.perf_counter() - t)
            best[name] = min(best[name], float(np.median(times[WIDE_CALIBRATION_WARMUP:])))
    return {name: round(t * 1e6, 1) for name, t in best.items()}


def shard_parts(count: int, batch: int, beam: int) -> int:
    """How many parts of at most `count` a batch of `batch` sentences x `beam` rows is decoded in: 1 (whole)
    below two sentences or SHARD_MIN_ROWS rows, else as many as leave every part SHARD_MIN_PART_ROWS rows."""
    if count < 2 or batch < 2 or batch * beam < SHARD_MIN_ROWS:
        return 1
    return max(1, min(count, batch // -(-SHARD_MIN_PART_ROWS // beam)))
