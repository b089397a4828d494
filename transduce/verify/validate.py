"""Numeric validation of exported graphs against the eager fp32 PyTorch model on the same inputs, run on
every export before anything is written in place (the structural checks: graph_checks.py).

Each case encodes a batch of sources, then steps the decoder from past length 0, writing the eager
model's new K/V into a preallocated cache exactly as the runtime does (slots at or beyond a row's
position hold garbage, so broken masking shows), and compares the graph's outputs at the past
lengths in PAST_LENGTHS. decoder_step.ort.onnx runs as the runtime runs it, its present_* outputs
bound onto the past_* buffers, and the whole cache it leaves is compared too (present_*: slot
positions[b] against the eager K/V, every other slot unchanged). The cases:
  batch1    one source, a cache longer than needed, and also past length 0 with cache_len 1
  padded    three sources of lengths 1, n and n/2 (n = min(40, max_positions)), then one step with
            a different position in every row
  longest   two sources of lengths max_positions and 1, cache_len max_positions, past lengths 0
            and max_positions - 1 (the ends of the dynamic ranges); the cache holds random K/V of
            the cross K/V's scale instead of max_positions eager steps
Float inputs are rounded to the graph's precision; the reference always runs in fp32 on the unrounded
ones, so reduced-precision errors include that rounding. An element fails when |graph - eager| > atol +
rtol * |eager| (transduce.verify.tolerances); a non-finite output fails. Per output the manifest records
max_abs = max |graph - eager| and max_rel = max |graph - eager| / |eager| over the elements with
|eager| >= atol.

Evaluators: ONNX Runtime's CPU execution provider, or onnx's ReferenceEvaluator (pure numpy, slow) where
ONNX Runtime cannot run the graph: its CPU provider has no bfloat16 kernels for Add, Mul, MatMul, Gemm or
Relu (session creation fails with NOT_IMPLEMENTED), so bf16 graphs are validated with the
ReferenceEvaluator; the manifest records the evaluator (as "engine") and the reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transduce.errors import ExportError
from transduce.formats.model_config import ModelConfig
from transduce.runtime.backends.topk import ban_bias
from transduce.verify.graph_runners import ArtifactRunner
from transduce.verify.tolerances import POLICIES, output_kind, relative_rms, within

PAST_LENGTHS = (0, 1, 2, 5, 11)
PADDED_SRC_LEN = 40

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass
class Case:
    name: str
    src_lengths: list[int]
    cache_len: int
    past_lengths: list[int]
    min_cache_check: bool = False  # also run past length 0 with cache_len 1
    mixed_positions: bool = False  # finally one step with a different position per row
    stepped: bool = True  # fill the cache by stepping the eager model; else random K/V of the same scale


def validation_cases(config: ModelConfig) -> list[Case]:
    """The cases described in the module docstring, fitted to max_positions."""
    p = config.max_positions
    past = [t for t in PAST_LENGTHS if t < p]
    n = min(PADDED_SRC_LEN, p)
    return [
        Case("batch1", [min(9, p)], min(p, past[-1] + 4), past, min_cache_check=True),
        Case("padded", [1, n, max(1, n // 2)], min(p, past[-1] + 4), past, mixed_positions=True),
        Case("longest", [p, 1], p, sorted({0, p - 1}), stepped=False),
    ]


@dataclass
class ErrorTable:
    """Running max errors per output: elementwise against POLICIES[precision].outputs, or per tensor against
    POLICIES[precision].relative_rms (quantized graphs)."""

    precision: str
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, graph: str, case: str, got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> None:
        per_tensor = POLICIES[self.precision].relative_rms
        for name, r in ref.items():
            kind = output_kind(name)
            g = np.asarray(got[name]).astype(np.float64)
            r = np.asarray(r, dtype=np.float64)
            if g.shape != r.shape:
                raise ExportError(f"{graph} output {name} has shape {g.shape}, eager PyTorch gives {r.shape}")
            diff = np.abs(g - r)
            finite = bool(np.isfinite(g).all())
            max_abs = float(diff.max()) if finite else float("inf")
            if per_tensor is not None:
                limit = per_tensor["topk" if name.startswith("topk_") else kind]
                rel = relative_rms(name, g, r) if finite else float("inf")
                row = self.rows.setdefault(f"{graph}/{name}", {"graph": graph, "output": name, "max_abs": 0.0,
                                                               "rel_rms": 0.0, "rel_rms_limit": limit, "passed": True,
                                                               "worst_case": case})
                if rel > row["rel_rms"]:
                    row["rel_rms"], row["worst_case"] = rel, case
                row["max_abs"] = max(row["max_abs"], max_abs)
                row["passed"] = row["passed"] and finite and rel <= limit
                continue
            tol = POLICIES[self.precision].outputs[kind]
            atol, rtol = tol
            big = np.abs(r) >= atol
            max_rel = (float((diff[big] / np.abs(r[big])).max()) if finite and big.any()
                       else (0.0 if finite else float("inf")))
            passed = finite and bool(within(diff, r, tol).all())
            row = self.rows.setdefault(f"{graph}/{name}", {"graph": graph, "output": name, "max_abs": 0.0,
                                                           "max_rel": 0.0, "atol": atol, "rtol": rtol, "passed": True,
                                                           "worst_case": case})
            if max_abs > row["max_abs"]:
                row["max_abs"], row["worst_case"] = max_abs, case
            row["max_rel"] = max(row["max_rel"], max_rel)
            row["passed"] = row["passed"] and passed

    def failures(self) -> list[dict[str, Any]]:
        return [r for r in self.rows.values() if not r["passed"]]

    def records(self) -> list[dict[str, Any]]:
        return [{k: (_round(v) if isinstance(v, float) else v) for k, v in r.items()} for r in self.rows.values()]


def _round(x: float) -> float | str:
    return float(f"{x:.4g}") if np.isfinite(x) else str(x)


@contextlib.contextmanager
def torch_threads(n: int):
    """Run eager PyTorch on n intra-op threads meanwhile. The validation's tensors are small, and on a
    shared machine torch's OpenMP threads spin against each other: 1 thread was 10x faster there."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _eager_encode(model, src_ids: np.ndarray, src_lengths: np.ndarray) -> dict[str, np.ndarray]:
    import torch

    with torch.inference_mode():
        memory, ck, cv = model.encode(torch.from_numpy(src_ids), torch.from_numpy(src_lengths))
    out = {"memory": memory.float().numpy()}
    for i, (k, v) in enumerate(zip(ck, cv)):
        out[f"cross_key_{i}"], out[f"cross_value_{i}"] = k.float().numpy(), v.float().numpy()
    return out


def _eager_step(model, tokens, positions, src_lengths, past: list[np.ndarray], cross: list[np.ndarray],
                attention: bool = False):
    """The eager step's outputs by contract name (with attention: the attention step graph's, "attention" too)."""
    import torch

    t = torch.from_numpy
    with torch.inference_mode():
        got = model.decode_step(t(tokens), t(positions), t(src_lengths), [t(a) for a in past[0::2]],
                                [t(a) for a in past[1::2]], [t(a) for a in cross[0::2]],
                                [t(a) for a in cross[1::2]], return_attention=attention)
    lp, nk, nv = got[:3]
    out = {"log_probs": lp.float().numpy()}
    if attention:
        out["attention"] = got[3].float().numpy()
    for i, (k, v) in enumerate(zip(nk, nv)):
        out[f"new_key_{i}"], out[f"new_value_{i}"] = k.float().numpy(), v.float().numpy()
    return out


def _run_case(case: Case, model, runner: ArtifactRunner, table: ErrorTable, rng: np.random.Generator) -> dict:
    """Encoder and decoder-step parity for one case (both step graphs, where there are two); errors go
    into `table`."""
    cfg = model.cfg
    step_graphs = ["decoder_step"] + (["decoder_step.ort"] if runner.ort_decoder is not None else [])

    def written(past, positions, ref):
        """The whole cache after the step as the runtime keeps it: `past` with slot positions[b] of row
        b set to the step's new K/V, and every other slot as it was (the ONNX Runtime graph writes its
        slot in place, into the buffers it reads)."""
        rows = np.arange(len(positions))
        out = {}
        for a, name in zip(past, (n for n in ref if n.startswith("new_"))):
            cache = np.array(a, dtype=np.float32)
            cache[rows, :, positions] = ref[name][:, :, 0]
            out["present_" + name[len("new_"):]] = cache
        return out

    def check_step(tok, positions, past, ref):
        for g in step_graphs:
            want = ref if g == "decoder_step" else {**ref, **written(past, positions, ref)}
            table.add(g, case.name, runner.step(tok, positions, src_lengths, past, cross, graph=g), want)
        if runner.attn_decoder is not None:  # the attention step graph: the step's outputs and its attention
            want = _eager_step(model, tok, positions, src_lengths, past, cross, attention=True)
            got = runner.step(tok, positions, src_lengths, past, cross, graph="decoder_step.attn")
            table.add("decoder_step.attn", case.name, got, want)
        if runner.ort_decoder is not None:
            check_beams(tok, positions, past, ref)

    def check_beams(tok, positions, past, ref):
        """The ONNX Runtime graph as beam search runs it: each source's K/V once for 2 rows (beams)
        with different tokens, and the top-k of log_probs + a bias that bans PAD and BOS. Its top-k
        ids are checked by the eager log-probs they point at (near-ties may order them differently)."""
        other = rng.integers(4, cfg.vocab_size, len(tok), dtype=np.int64)
        ref2 = _eager_step(model, other, positions, src_lengths, past, cross)
        both = {k: np.stack([ref[k], ref2[k]], axis=1).reshape((-1,) + ref[k].shape[1:]) for k in ref}
        k = min(4, cfg.vocab_size - 2)
        bias = ban_bias(cfg, ban_eos=False)
        past2, positions2 = [np.repeat(a, 2, axis=0) for a in past], np.repeat(positions, 2)
        out = runner.step(np.stack([tok, other], axis=1).ravel(), positions2, src_lengths, past2, cross,
                          graph="decoder_step.ort", topk=(k, bias))
        both.update(written(past2, positions2, both))
        biased = both["log_probs"] + bias
        both["topk_values"] = -np.sort(-biased, axis=1)[:, :k]
        both["topk_ids"] = both["topk_values"]
        out["topk_ids"] = np.take_along_axis(biased, out["topk_ids"], axis=1)
        table.add("decoder_step.ort", f"{case.name}, 2 beams", out, both)
    b, s = len(case.src_lengths), max(case.src_lengths)
    src_lengths = np.array(case.src_lengths, dtype=np.int64)
    src_ids = rng.integers(4, cfg.source_vocab_size, (b, s), dtype=np.int64)
    src_ids[np.arange(s)[None, :] >= src_lengths[:, None]] = cfg.pad_id
    ref = _eager_encode(model, src_ids, src_lengths)
    table.add("encoder", case.name, runner.encode(src_ids, src_lengths), ref)
    cross = [ref[f"cross_{kv}_{i}"] for i in range(cfg.decoder_layers) for kv in ("key", "value")]

    shape = (b, cfg.n_heads, case.cache_len, cfg.head_dim)
    # garbage until written; unstepped cases keep random K/V of the cross K/V's scale as the cache
    past = [rng.normal(0.0, 4.0 if case.stepped else float(c.std()), shape).astype(np.float32) for c in cross]
    steps = max(case.past_lengths) + 1
    tokens = rng.integers(4, cfg.vocab_size, (b, steps), dtype=np.int64)
    tokens[:, 0] = cfg.bos_id
    checked = []
    for t in range(steps) if case.stepped else case.past_lengths:
        positions = np.full(b, t, dtype=np.int64)
        ref = _eager_step(model, tokens[:, t], positions, src_lengths, past, cross)
        if t in case.past_lengths:
            check_step(tokens[:, t], positions, past, ref)
            checked.append(t)
        for i, name in enumerate(n for n in ref if n != "log_probs"):
            past[i][:, :, t] = ref[name][:, :, 0]  # the runtime's write into slot `position`
    if case.min_cache_check:
        tiny = [a[:, :, :1].copy() for a in past]
        for a in tiny:
            a[:] = rng.normal(0.0, 4.0, a.shape)
        zero = np.zeros(b, dtype=np.int64)
        ref = _eager_step(model, tokens[:, 0], zero, src_lengths, tiny, cross)
        check_step(tokens[:, 0], zero, tiny, ref)
    if case.mixed_positions:
        positions = rng.integers(0, steps + 1, b).astype(np.int64)
        positions[0] = 0
        positions = np.minimum(positions, case.cache_len - 1)
        ref = _eager_step(model, tokens[:, -1], positions, src_lengths, past, cross)
        check_step(tokens[:, -1], positions, past, ref)
    return {"name": case.name, "batch": b, "src_len": s, "src_lengths": case.src_lengths,
            "cache_len": case.cache_len, "past_lengths": checked, "cache_len_1": case.min_cache_check,
            "mixed_positions": case.mixed_positions, "cache": "eager steps" if case.stepped else "random"}


def validate_graphs(directory: str, model, precision: str, evaluator: str | None = None, seed: int = 0,
                    log: Log = _quiet, tolerances: str | None = None) -> dict[str, Any]:
    """Numeric validation of the graphs in `directory` against the eager fp32 `model`: elementwise
    with POLICIES[tolerances].outputs (default: the precision's), or per tensor with its relative_rms
    ("int8": quantized graphs).

    Returns the manifest's "validation" record; raises ExportError if an output is out of tolerance.
    """
    tolerances = tolerances or precision
    per_tensor = POLICIES[tolerances].relative_rms is not None
    if evaluator is None and precision != "bf16":
        evaluator = "onnxruntime"  # what the runtime will use: it must load the graphs
    try:
        runner = ArtifactRunner(directory, precision=precision, evaluator=evaluator)
    except Exception as e:  # onnxruntime's own exception classes
        raise ExportError(f"onnxruntime cannot load the exported {precision} graphs: {e}",
                          hint="this is a bug in the exporter; nothing was written") from None
    if runner.evaluator_reason:
        log(f"validating on onnx.reference.ReferenceEvaluator: {runner.evaluator_reason.splitlines()[0]}")
    table = ErrorTable(tolerances)
    rng = np.random.default_rng(seed)
    with torch_threads(1):
        try:
            cases = [_run_case(c, model, runner, table, rng) for c in validation_cases(model.cfg)]
        except ExportError:
            raise
        except Exception as e:  # a kernel that loaded but refuses these shapes when it runs (onnxruntime's errors)
            raise ExportError(f"running the exported {precision} graphs failed: {e}",
                              hint="this is a bug in the exporter; nothing was written") from None
    record = {
        # the manifest's record keeps its key names ("engine": what evaluated the graphs)
        "engine": ("onnxruntime CPUExecutionProvider" if runner.evaluator == "onnxruntime"
                   else "onnx.reference.ReferenceEvaluator"),
        "engine_reason": runner.evaluator_reason,
        "reference": "eager PyTorch, fp32 weights",
        **({"criterion": "||graph - eager|| / ||eager|| <= relative_rms per output tensor, outputs finite",
            "tolerances": {k: {"relative_rms": v} for k, v in POLICIES[tolerances].relative_rms.items()}}
           if per_tensor else
           {"criterion": "|graph - eager| <= atol + rtol * |eager| elementwise, outputs finite",
            "tolerances": {k: {"atol": a, "rtol": r} for k, (a, r) in POLICIES[tolerances].outputs.items()}}),
        "cases": cases,
        "errors": table.records(),
    }
    failed = table.failures()
    if failed:
        lines = [f"{r['graph']} {r['output']}: " + (
            f"relative RMS error {r['rel_rms']:.3g} (limit {r['rel_rms_limit']:g})" if per_tensor else
            f"max abs error {r['max_abs']:.3g} (atol {r['atol']:g}, rtol {r['rtol']:g}, "
            f"worst in case {r['worst_case']!r})")
            for r in failed]
        raise ExportError(
            f"the exported {tolerances} graphs do not match eager PyTorch "
            f"({record['engine']}):\n  " + "\n  ".join(lines),
            hint=("nothing was written; this model loses too much to int8 dynamic quantization: export it without "
                  "--quantize" if per_tensor else
                  "nothing was written; this is a bug in the exporter or the model code (or too tight a tolerance)"),
        )
    return record
