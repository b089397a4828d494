"""The ONNX Runtime backend's top-k for the standard step graph: a one-node TopK session over the step's
log-probs buffer (the fused step graph picks its top-k itself)."""

from __future__ import annotations

import numpy as np

from transduce.formats.model_config import ModelConfig


class OrtTopK:
    """Top-k of the step's log-probs with ONNX Runtime's TopK kernel (a one-node graph built here).

    numpy has no top-k: argpartition + argsort cost several times more (docs/design/onnxruntime-cpu.md,
    "Top-k"). Banned ids get -inf through an additive (V,) bias; ties go to the lower id (ONNX TopK's
    rule; numpy_topk's argpartition may order exact ties otherwise).
    """

    def __init__(self, ort, config: ModelConfig, bias: dict[bool, np.ndarray]):
        import onnx
        from onnx import TensorProto, helper

        v = config.vocab_size
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
        # one thread, so no pool: a pool's threads would spin after each top-k and take a core from the
        # next step's run
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
