"""The one table of tolerances: what export validation and `transduce parity` allow, per precision and per
output, and the one elementwise rule both apply. Why each value is what it is: docs/design/tolerances.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class Tolerance(NamedTuple):
    atol: float
    rtol: float


def within(diff: np.ndarray, ref: np.ndarray, tol: Tolerance) -> np.ndarray:
    """Elementwise |graph - reference| <= atol + rtol * |reference| (numpy's allclose rule)."""
    return diff <= tol.atol + tol.rtol * np.abs(ref)


@dataclass(frozen=True)
class PrecisionPolicy:
    outputs: dict[str, Tolerance]  # output kind -> (atol, rtol): memory, cross_kv, log_probs, new_kv (export only)
    score_atol: float  # identical sequences' scores, per token: |log-prob sum difference| / length
    tie_margin: float  # a divergence with a smaller margin of the reference model is a near-tie
    min_agreement: float  # fraction of sentences whose decoded sequences must be identical
    # quantized graphs at export, per tensor: ||graph - eager|| / ||eager|| per output kind (and "topk")
    relative_rms: dict[str, float] | None = None


def _t(atol: float, rtol: float) -> Tolerance:
    return Tolerance(atol, rtol)


POLICIES: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy({"memory": _t(1e-4, 1e-4), "cross_kv": _t(1e-4, 1e-4), "log_probs": _t(1e-4, 0.0),
                             "new_kv": _t(1e-4, 1e-4), "attention": _t(1e-4, 0.0)},
                            score_atol=1e-4, tie_margin=1e-3, min_agreement=1.0),
    "fp16": PrecisionPolicy({"memory": _t(2e-2, 1e-2), "cross_kv": _t(4e-2, 1e-2), "log_probs": _t(2.5e-2, 1e-2),
                             "new_kv": _t(4e-2, 1e-2), "attention": _t(1e-2, 1e-2)},
                            score_atol=2e-2, tie_margin=5e-2, min_agreement=0.99),
    "bf16": PrecisionPolicy({"memory": _t(0.25, 5e-2), "cross_kv": _t(0.5, 5e-2), "log_probs": _t(0.3, 5e-2),
                             "new_kv": _t(0.5, 5e-2), "attention": _t(5e-2, 5e-2)},
                            score_atol=1e-1, tie_margin=3e-1, min_agreement=0.95),
    # int8 weights (transduce export --quantize int8): parity elementwise, export validation per tensor
    "int8": PrecisionPolicy({"memory": _t(5e-1, 2.5e-1), "cross_kv": _t(2.0, 2.5e-1), "log_probs": _t(1.0, 2.5e-1),
                             "new_kv": _t(2.0, 2.5e-1), "attention": _t(1e-1, 1e-1)},
                            score_atol=2.5e-1, tie_margin=5e-1, min_agreement=0.95,
                            relative_rms={"memory": 0.6, "cross_kv": 0.6, "new_kv": 0.6, "log_probs": 0.4,
                                          "topk": 0.3, "attention": 0.4}),
}


def output_kind(name: str) -> str:
    """The tolerance row of a graph output's name."""
    if name in ("memory", "log_probs", "attention"):  # attention: the attention step graph's head-averaged weights
        return name
    if name.startswith("cross_"):
        return "cross_kv"
    if name.startswith("new_") or name.startswith("present_"):  # present_: the whole cache after a step's write
        return "new_kv"
    if name in ("topk_values", "topk_ids"):  # the ONNX Runtime step's top-k: log-probs (of the ids)
        return "log_probs"
    raise ValueError(f"not a contract output: {name}")


def relative_rms(name: str, got: np.ndarray, ref: np.ndarray) -> float:
    """||got - ref|| / ||ref||, for log_probs with each row's mean over the last axis taken out first (they sit
    near -log V, an offset that would hide a wrong distribution)."""
    if name == "log_probs":
        got = got - got.mean(axis=-1, keepdims=True)
        ref = ref - ref.mean(axis=-1, keepdims=True)
    return float(np.linalg.norm(got - ref) / max(float(np.linalg.norm(ref)), 1e-30))
