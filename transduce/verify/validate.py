"""Checks of exported graphs, run on every export before anything is written in place.

Structure (`check_graph`): onnx.checker with full_check, strict shape inference, the IO contract
(names, order, dtypes, axis names and sizes; transduce/formats/contract.py), the opset, no control
flow and no training or random ops, the reduced-precision islands, and TensorRT's operator list
(transduce/verify/opcheck.py).

Numbers (`validate_graphs`): the graphs against the eager fp32 PyTorch model on the same inputs.
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
Float inputs are rounded to the graph's precision; the reference always runs in fp32 on the
unrounded ones, so reduced-precision errors include that rounding. An element fails when
|graph - eager| > atol + rtol * |eager| (transduce.verify.tolerances); a non-finite output fails. Per output the
manifest records max_abs = max |graph - eager| and max_rel = max |graph - eager| / |eager| over the
elements with |eager| >= atol.

Engines: ONNX Runtime's CPU execution provider, or onnx's ReferenceEvaluator (pure numpy, slow)
where ONNX Runtime cannot run the graph. ONNX Runtime 1.31's CPU provider has no bfloat16 kernels
for Add, Mul, MatMul, Gemm or Relu (session creation fails with NOT_IMPLEMENTED), so bf16 graphs
are validated with the ReferenceEvaluator; the manifest records the engine and the reason.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transduce.errors import ExportError
from transduce.formats import contract
from transduce.formats.artifact import read_manifest
from transduce.formats.dtypes import PRECISION_DTYPES, onnx_type
from transduce.runtime.backends.base import ban_bias
from transduce.verify import opcheck
from transduce.verify.tolerances import POLICIES, output_kind, relative_rms, within

PAST_LENGTHS = (0, 1, 2, 5, 11)
PADDED_SRC_LEN = 40
# No control flow (one straight-line step graph), nothing that only makes sense in training.
FORBIDDEN_OPS = frozenset({"If", "Loop", "Scan", "Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform",
                           "RandomUniformLike", "Bernoulli", "Multinomial"})
# Ops whose first input must stay fp32 in fp16/bf16 graphs (the model computes them in fp32).
FP32_ISLAND_OPS = ("LayerNormalization", "Softmax", "LogSoftmax")
ENGINES = ("onnxruntime", "reference")

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def numpy_float_dtype(precision: str) -> np.dtype:
    """numpy dtype of the graph's float tensors (bfloat16 from ml_dtypes, which onnx depends on)."""
    if precision == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(PRECISION_DTYPES[precision])


# -- structure -----------------------------------------------------------------------------------


def _value_specs(values) -> list[tuple[str, str, tuple]]:
    """[(name, dtype name, dims)] of graph inputs/outputs; dims are ints or axis-name strings."""
    out = []
    for v in values:
        tt = v.type.tensor_type
        dims = tuple(d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else "?")
                     for d in tt.shape.dim)
        out.append((v.name, onnx_type(tt.elem_type), dims))
    return out


def contract_problems(model, inputs: list[contract.TensorSpec], outputs: list[contract.TensorSpec],
                      config: dict[str, Any], precision: str) -> list[str]:
    """Differences between a graph's inputs/outputs and the contract's (empty when it conforms)."""
    return (contract.io_mismatches("input", _value_specs(model.graph.input), inputs, precision, config, exact=True)
            + contract.io_mismatches("output", _value_specs(model.graph.output), outputs, precision, config,
                                     exact=True))


def _value_types(model) -> dict[str, int]:
    """name -> elem_type for every typed value of a shape-inferred graph."""
    types = {init.name: init.data_type for init in model.graph.initializer}
    for v in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        types[v.name] = v.type.tensor_type.elem_type
    for node in model.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    types[node.output[0]] = a.t.data_type
    return types


def precision_problems(inferred_model, precision: str) -> list[str]:
    """In fp16/bf16 graphs, LayerNormalization, Softmax and LogSoftmax must read fp32 (the fp32 islands).

    `inferred_model` must carry shape-inference value_info. Empty list when the islands are intact.
    """
    from onnx import TensorProto

    if precision == "fp32":
        return []
    types = _value_types(inferred_model)
    problems = []
    for node in inferred_model.graph.node:
        if node.op_type in FP32_ISLAND_OPS:
            t = types.get(node.input[0])
            if t != TensorProto.FLOAT:
                name = TensorProto.DataType.Name(t) if t else "unknown"
                problems.append(f"{node.op_type} node {node.name!r} reads {name}, not FLOAT")
    return problems


def check_graph(path: str, graph: str, config: dict[str, Any], precision: str, opset: int) -> dict[str, Any]:
    """Structural checks of one exported graph ('encoder' or 'decoder_step'); ExportError on any failure.

    Returns the manifest's record of the graph (IO, opset, node count, op histogram, weight bytes).
    """
    import onnx

    inputs, outputs = contract.graph_io(contract.ENCODER_FILE if graph == "encoder" else contract.STEP_FILE,
                                        config["decoder_layers"])
    name = os.path.basename(path)
    try:
        onnx.checker.check_model(path, full_check=True)
        proto = onnx.load(path, load_external_data=False)
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    except Exception as e:  # ValidationError, InferenceError, protobuf's DecodeError for an unreadable file
        raise ExportError(f"{name} fails the ONNX checker or shape inference: {type(e).__name__}: {e}") from None
    problems = contract_problems(inferred, inputs, outputs, config, precision)
    opsets = {o.domain or "ai.onnx": o.version for o in proto.opset_import}
    if opsets.get("ai.onnx") != opset:
        problems.append(f"opset is {opsets.get('ai.onnx')}, {opset} was asked for (opsets: {opsets})")
    hist = opcheck.op_histogram(proto)
    bad = sorted(op for op in hist if op in FORBIDDEN_OPS)
    if bad:
        problems.append(f"control-flow or training ops in the graph: {bad}")
    problems += precision_problems(inferred, precision)
    if problems:
        raise ExportError(f"{name} does not conform:\n  " + "\n  ".join(problems),
                          hint="this is a bug in the exporter or the model code; nothing was written")
    opcheck.check_tensorrt_support(proto, name)
    weights = list(proto.graph.initializer)
    return {
        "inputs": [{"name": s.name, "axes": list(s.axes), "dtype": contract.resolve_dtype(s, precision)} for s in inputs],
        "outputs": [{"name": s.name, "axes": list(s.axes), "dtype": contract.resolve_dtype(s, precision)} for s in outputs],
        "opset": opset,
        "ir_version": proto.ir_version,
        "nodes": sum(hist.values()),
        "op_histogram": hist,
        "initializers": len(weights),
        "weight_bytes": sum(_tensor_bytes(t) for t in weights),
    }


def check_ort_step_graph(path: str, config: dict[str, Any]) -> dict[str, Any]:
    """Structural checks of decoder_step.ort.onnx (the IO contract, that ONNX Runtime loads it); its
    record for the manifest. No TensorRT operator check: its contrib ops are ONNX Runtime's own."""
    import onnx

    name = os.path.basename(path)
    proto = onnx.load(path)
    inputs, outputs = contract.graph_io(contract.ORT_STEP_FILE, config["decoder_layers"])
    problems = contract_problems(proto, inputs, outputs, config, "fp32")
    reason = ort_unavailable_reason(path)
    if reason:
        problems.append(reason)
    if problems:
        raise ExportError(f"{name} does not conform:\n  " + "\n  ".join(problems),
                          hint="this is a bug in the exporter (transduce/exporter/ort_step.py); nothing was written")
    hist = opcheck.op_histogram(proto)
    return {
        "inputs": [{"name": s.name, "axes": list(s.axes), "dtype": contract.resolve_dtype(s, "fp32")} for s in inputs],
        "outputs": [{"name": s.name, "axes": list(s.axes), "dtype": contract.resolve_dtype(s, "fp32")} for s in outputs],
        "opsets": {o.domain or "ai.onnx": o.version for o in proto.opset_import},
        "runtime": "onnxruntime only (com.microsoft contrib ops)",
        "nodes": sum(hist.values()),
        "op_histogram": hist,
        "initializers": len(proto.graph.initializer),
        "weight_bytes": sum(_tensor_bytes(t) for t in proto.graph.initializer),
    }


def _tensor_bytes(t) -> int:
    from onnx import helper

    return int(np.prod(t.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


# -- running graphs ------------------------------------------------------------------------------


def ort_unavailable_reason(path: str) -> str | None:
    """None if ONNX Runtime's CPU provider can create a session for the graph, else why not."""
    import onnxruntime as ort

    try:
        ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception classes (NotImplemented, Fail, ...)
        return f"onnxruntime {ort.__version__} CPUExecutionProvider cannot run {os.path.basename(path)}: {e}"
    return None


class GraphRunner:
    """One .onnx file on ONNX Runtime's CPU provider or on onnx's ReferenceEvaluator.

    run(feeds) takes and returns {name: numpy array}; outputs are returned as the graph makes them.
    """

    def __init__(self, path: str, engine: str = "onnxruntime", threads: int = 1):
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.path, self.engine = path, engine
        if engine == "onnxruntime":
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
            so.log_severity_level = 3
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self.session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
            self.output_names = [o.name for o in self.session.get_outputs()]
        else:
            from onnx.reference import ReferenceEvaluator

            self.session = ReferenceEvaluator(path)
            self.output_names = list(self.session.output_names)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(self.output_names, feeds)))


class ArtifactRunner:
    """Both graphs of an artifact (or of a directory being exported, given its precision).

    encode(src_ids, src_lengths) and step(tokens, positions, src_lengths, past, cross) take numpy
    arrays (past/cross: lists in the contract's order, any float dtype: they are cast to the
    graph's precision) and return {output name: numpy array}.
    """

    def __init__(self, directory: str | os.PathLike, precision: str | None = None, engine: str | None = None,
                 threads: int = 1):
        self.directory = os.fspath(directory)
        if precision is None:
            precision = read_manifest(self.directory)["precision"]
        self.precision = precision
        self.float_dtype = numpy_float_dtype(precision)
        enc_path = os.path.join(self.directory, contract.ENCODER_FILE)
        step_path = os.path.join(self.directory, contract.STEP_FILE)
        self.engine_reason = None
        if engine is None:
            reason = ort_unavailable_reason(enc_path) or ort_unavailable_reason(step_path)
            engine = "onnxruntime" if reason is None else "reference"
            self.engine_reason = reason
        self.engine = engine
        self.encoder = GraphRunner(enc_path, engine, threads)
        self.decoder = GraphRunner(step_path, engine, threads)
        ort_path = os.path.join(self.directory, contract.ORT_STEP_FILE)
        self.ort_decoder = GraphRunner(ort_path, "onnxruntime", threads) if os.path.exists(ort_path) else None

    def _float(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(a).astype(self.float_dtype))

    def encode(self, src_ids: np.ndarray, src_lengths: np.ndarray) -> dict[str, np.ndarray]:
        return self.encoder.run({"src_ids": np.asarray(src_ids, np.int64),
                                 "src_lengths": np.asarray(src_lengths, np.int64)})

    def step(self, tokens: np.ndarray, positions: np.ndarray, src_lengths: np.ndarray,
             past: list[np.ndarray], cross: list[np.ndarray], graph: str = "decoder_step",
             topk: tuple[int, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """One step of decoder_step.onnx, or with graph="decoder_step.ort" of decoder_step.ort.onnx,
        whose written cache slots are returned as new_key_i/new_value_i like the standard graph's.

        The ONNX Runtime graph runs as the runtime runs it: present_key_i/present_value_i bound onto
        the past_key_i/past_value_i buffers (copies of `past`), so the graph writes slot positions[b]
        in place; those whole buffers are returned too, as present_key_i/present_value_i (every other
        slot must come back as it went in). Its src_lengths and cross may have fewer rows than tokens
        (per source: row b attends source b // beams), topk=(k, bias) sets topk_k/topk_bias (default 1
        and zeros), and topk_values/topk_ids are returned too."""
        n = len(past) // 2
        names = [f"{kv}_{i}" for i in range(n) for kv in ("key", "value")]
        feeds = {"tokens": np.asarray(tokens, np.int64), "positions": np.asarray(positions, np.int64),
                 "src_lengths": np.asarray(src_lengths, np.int64)}
        feeds.update({f"past_{nm}": self._float(a) for nm, a in zip(names, past)})
        feeds.update({f"cross_{nm}": self._float(a) for nm, a in zip(names, cross)})
        if graph == "decoder_step":
            return self.decoder.run(feeds)
        if topk is None:
            vocab = next(i.shape[0] for i in self.ort_decoder.session.get_inputs() if i.name == "topk_bias")
            topk = (1, np.zeros(vocab, np.float32))
        k, bias = topk
        feeds["topk_k"] = np.array([k], np.int64)
        feeds["topk_bias"] = np.asarray(bias, np.float32)
        session = self.ort_decoder.session
        binding = session.io_binding()
        caches = {}
        for name, arr in feeds.items():
            if name.startswith("past_"):  # the runtime's cache buffer: read, and written in place
                caches[name[len("past_"):]] = arr = arr.copy()
                binding.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
            else:
                binding.bind_cpu_input(name, arr)
        fresh = ["log_probs", "topk_values", "topk_ids"]
        for name in fresh:
            binding.bind_output(name, "cpu")
        for nm, buf in caches.items():
            binding.bind_output(f"present_{nm}", "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
        session.run_with_iobinding(binding)
        result = {name: v.numpy() for name, v in zip(fresh, binding.get_outputs())}
        rows = np.arange(len(feeds["positions"]))
        for nm in names:  # the slot each row wrote: (B, H, Dh) -> (B, H, 1, Dh)
            result[f"new_{nm}"] = caches[nm][rows, :, feeds["positions"]][:, :, None].copy()
        result.update({f"present_{nm}": caches[nm] for nm in names})
        return result


# -- numeric validation --------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    src_lengths: list[int]
    cache_len: int
    past_lengths: list[int]
    min_cache_check: bool = False  # also run past length 0 with cache_len 1
    mixed_positions: bool = False  # finally one step with a different position per row
    stepped: bool = True  # fill the cache by stepping the eager model; else random K/V of the same scale


def validation_cases(config: dict[str, Any]) -> list[Case]:
    """The cases described in the module docstring, fitted to max_positions."""
    p = config["max_positions"]
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
            max_rel = float((diff[big] / np.abs(r[big])).max()) if finite and big.any() else (0.0 if finite else float("inf"))
            passed = finite and bool(within(diff, r, tol).all())
            row = self.rows.setdefault(f"{graph}/{name}", {"graph": graph, "output": name, "max_abs": 0.0, "max_rel": 0.0,
                                                           "atol": atol, "rtol": rtol, "passed": True, "worst_case": case})
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


def _eager_step(model, tokens, positions, src_lengths, past: list[np.ndarray], cross: list[np.ndarray]):
    import torch

    t = torch.from_numpy
    with torch.inference_mode():
        lp, nk, nv = model.decode_step(t(tokens), t(positions), t(src_lengths), [t(a) for a in past[0::2]],
                                       [t(a) for a in past[1::2]], [t(a) for a in cross[0::2]], [t(a) for a in cross[1::2]])
    out = {"log_probs": lp.float().numpy()}
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
        bias = ban_bias(cfg.to_dict(), ban_eos=False)
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
    src_ids = rng.integers(4, cfg.vocab_size, (b, s), dtype=np.int64)
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


def validate_graphs(directory: str, model, precision: str, engine: str | None = None, seed: int = 0,
                    log: Log = _quiet, tolerances: str | None = None) -> dict[str, Any]:
    """Numeric validation of the graphs in `directory` against the eager fp32 `model`: elementwise
    with POLICIES[tolerances].outputs (default: the precision's), or per tensor with its relative_rms
    ("int8": quantized graphs).

    Returns the manifest's "validation" record; raises ExportError if an output is out of tolerance.
    """
    tolerances = tolerances or precision
    per_tensor = POLICIES[tolerances].relative_rms is not None
    if engine is None and precision != "bf16":
        engine = "onnxruntime"  # what the runtime will use: it must load the graphs
    try:
        runner = ArtifactRunner(directory, precision=precision, engine=engine)
    except Exception as e:  # onnxruntime's own exception classes
        raise ExportError(f"onnxruntime cannot load the exported {precision} graphs: {e}",
                          hint="this is a bug in the exporter; nothing was written") from None
    if runner.engine_reason:
        log(f"validating on onnx.reference.ReferenceEvaluator: {runner.engine_reason.splitlines()[0]}")
    table = ErrorTable(tolerances)
    rng = np.random.default_rng(seed)
    with torch_threads(1):
        try:
            cases = [_run_case(c, model, runner, table, rng) for c in validation_cases(model.cfg.to_dict())]
        except ExportError:
            raise
        except Exception as e:  # a kernel that loaded but refuses these shapes when it runs (onnxruntime's errors)
            raise ExportError(f"running the exported {precision} graphs failed: {e}",
                              hint="this is a bug in the exporter; nothing was written") from None
    record = {
        "engine": ("onnxruntime CPUExecutionProvider" if runner.engine == "onnxruntime"
                   else "onnx.reference.ReferenceEvaluator"),
        "engine_reason": runner.engine_reason,
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
            f"max abs error {r['max_abs']:.3g} (atol {r['atol']:g}, rtol {r['rtol']:g}, worst in case {r['worst_case']!r})")
            for r in failed]
        raise ExportError(
            f"the exported {tolerances} graphs do not match eager PyTorch ({record['engine']}):\n  " + "\n  ".join(lines),
            hint=("nothing was written; this model loses too much to int8 dynamic quantization: export it without "
                  "--quantize" if per_tensor else
                  "nothing was written; this is a bug in the exporter or the model code (or too tight a tolerance)"),
        )
    return record
