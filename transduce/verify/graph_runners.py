"""Exported graphs run on numpy inputs, for the checks of export and parity: one .onnx file on ONNX
Runtime's CPU provider or on onnx's ReferenceEvaluator (GraphRunner), and an artifact's graphs as the
runtime runs them (ArtifactRunner: the fused step graph with its cache written in place)."""

from __future__ import annotations

import os

import numpy as np

from transduce.formats import contract
from transduce.formats.artifact import read_manifest
from transduce.formats.dtypes import PRECISION_DTYPES
from transduce.runtime.backends.ort_memory import NumpyMemory
from transduce.runtime.backends.ort_run import bind_step

EVALUATORS = ("onnxruntime", "reference")  # what runs a graph: ONNX Runtime, or onnx's ReferenceEvaluator


def numpy_float_dtype(precision: str) -> np.dtype:
    """numpy dtype of the graph's float tensors (bfloat16 from ml_dtypes, which onnx depends on)."""
    if precision == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(PRECISION_DTYPES[precision])


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

    def __init__(self, path: str, evaluator: str = "onnxruntime", threads: int = 1):
        if evaluator not in EVALUATORS:
            raise ValueError(f"evaluator must be one of {EVALUATORS}, got {evaluator!r}")
        self.path, self.evaluator = path, evaluator
        if evaluator == "onnxruntime":
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

    def __init__(self, directory: str | os.PathLike, precision: str | None = None, evaluator: str | None = None,
                 threads: int = 1):
        self.directory = os.fspath(directory)
        if precision is None:
            precision = read_manifest(self.directory)["precision"]
        self.precision = precision
        self.float_dtype = numpy_float_dtype(precision)
        enc_path = os.path.join(self.directory, contract.ENCODER_FILE)
        step_path = os.path.join(self.directory, contract.STEP_FILE)
        self.evaluator_reason = None  # why not ONNX Runtime, where it cannot run the graphs
        if evaluator is None:
            reason = ort_unavailable_reason(enc_path) or ort_unavailable_reason(step_path)
            evaluator = "onnxruntime" if reason is None else "reference"
            self.evaluator_reason = reason
        self.evaluator = evaluator
        self.encoder = GraphRunner(enc_path, evaluator, threads)
        self.decoder = GraphRunner(step_path, evaluator, threads)
        ort_path = os.path.join(self.directory, contract.ORT_STEP_FILE)
        self.ort_decoder = GraphRunner(ort_path, "onnxruntime", threads) if os.path.exists(ort_path) else None
        attn_path = os.path.join(self.directory, contract.ATTN_STEP_FILE)  # optional (older artifacts lack it)
        self.attn_decoder = GraphRunner(attn_path, evaluator, threads) if os.path.exists(attn_path) else None

    def _float(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(a).astype(self.float_dtype))

    def encode(self, src_ids: np.ndarray, src_lengths: np.ndarray) -> dict[str, np.ndarray]:
        return self.encoder.run({"src_ids": np.asarray(src_ids, np.int64),
                                 "src_lengths": np.asarray(src_lengths, np.int64)})

    def step(self, tokens: np.ndarray, positions: np.ndarray, src_lengths: np.ndarray,
             past: list[np.ndarray], cross: list[np.ndarray], graph: str = "decoder_step",
             topk: tuple[int, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """One step of decoder_step.onnx (graph="decoder_step.attn": of decoder_step.attn.onnx, the same step with
        its attention output), or with graph="decoder_step.ort" of decoder_step.ort.onnx,
        whose written cache slots are returned as new_key_i/new_value_i like the standard graph's.

        The ONNX Runtime graph runs as the runtime runs it: present_key_i/present_value_i bound onto
        the past_key_i/past_value_i buffers (copies of `past`), so the graph writes slot positions[b]
        in place; those whole buffers are returned too, as present_key_i/present_value_i (every other
        slot must come back as it went in). Its src_lengths and cross may have fewer rows than tokens
        (per source: row b attends source b // beams), topk=(k, bias) sets topk_k/topk_bias (default 1
        and zeros), and topk_values/topk_ids are returned too."""
        n = len(past) // 2
        names = [f"{kv}_{i}" for i in range(n) for kv in ("key", "value")]
        tokens, positions = np.ascontiguousarray(tokens, np.int64), np.ascontiguousarray(positions, np.int64)
        cross_in = {"src_lengths": np.ascontiguousarray(src_lengths, np.int64)}
        cross_in.update({f"cross_{nm}": self._float(a) for nm, a in zip(names, cross)})
        if graph in ("decoder_step", "decoder_step.attn"):
            runner = self.decoder if graph == "decoder_step" else self.attn_decoder
            return runner.run({"tokens": tokens, "positions": positions, **cross_in,
                               **{f"past_{nm}": self._float(a) for nm, a in zip(names, past)}})
        if topk is None:
            vocab = next(i.shape[0] for i in self.ort_decoder.session.get_inputs() if i.name == "topk_bias")
            topk = (1, np.zeros(vocab, np.float32))
        k, bias = topk
        bias = np.ascontiguousarray(bias, np.float32)
        # the runtime's own binding (runtime.backends.ort_run.bind_step) onto copies of `past`: the graph writes
        # slot positions[b] of those buffers in place
        caches = [np.ascontiguousarray(self._float(a).copy()) for a in past]
        rows = len(positions)
        out = {"log_probs": np.empty((rows, len(bias)), np.float32), "topk_values": np.empty((rows, k), np.float32),
               "topk_ids": np.empty((rows, k), np.int64)}
        binding = self.ort_decoder.session.io_binding()
        bind_step(binding, NumpyMemory(self.precision), True, tokens=tokens, positions=positions, cross=cross_in,
                  cache=caches, log_probs=out["log_probs"],
                  topk=(np.array([k], np.int64), bias, out["topk_values"], out["topk_ids"]))
        self.ort_decoder.session.run_with_iobinding(binding)
        for nm, buf in zip(names, caches):  # the slot each row wrote: (B, H, Dh) -> (B, H, 1, Dh)
            out[f"new_{nm}"] = buf[np.arange(rows), :, positions][:, :, None].copy()
            out[f"present_{nm}"] = buf
        return out
