"""int8 dynamic quantization of an artifact's ONNX Runtime graphs (`transduce export --quantize int8`).

onnxruntime.quantization.quantize_dynamic over encoder.onnx and decoder_step.ort.onnx: the weights of every
MatMul and Gemm become int8 (one scale per tensor), their activations are quantized at run time (ONNX
Runtime's DynamicQuantizeMatMul / MatMulInteger kernels). Attention, LayerNorm, softmax and the log-probs
stay fp32, and so does the graphs' IO: the IO contract is unchanged. decoder_step.onnx stays fp32 (the
portable step graph; parity can pin it). Why, and what it gains: docs/design/exporter.md.

Export validates the quantized graphs against eager PyTorch per tensor (transduce.verify.tolerances);
`transduce bench --quantize int8` times the int8 rows only if BLEU on the demo data is within 0.5 of fp32's.
ONNX Runtime's CPU provider only: TensorRT engines and the CUDA provider need an unquantized export (both
refuse a quantized artifact, naming the command). fp32 post-norm models only (the quantized step graph is
decoder_step.ort.onnx), whose graphs keep their weights inline (an encoder over torch.onnx's 1.5 GiB is
refused before the export runs).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from typing import Any

from transduce.errors import ExportError
from transduce.formats import contract
from transduce.formats.artifact import QUANTIZATION_METHODS as METHODS
from transduce.formats.artifact import QUANTIZED_FILES
from transduce.formats.model_config import ModelConfig

OP_TYPES = ("MatMul", "Gemm")
UNQUANTIZED_HINT = "export again without --quantize: transduce export MODEL_DIR --out OUT_DIR"
# torch.onnx (ONNXProgram.save) keeps a graph's weights in <name>.data above this many bytes
TORCH_EXTERNAL_DATA_BYTES = 1536 * 2**20


def unsupported_reason(method: str, config: ModelConfig, precision: str) -> str | None:
    """Why an artifact of this model and precision cannot be quantized with `method` (None: it can)."""
    from transduce.exporter import ort_step

    if method not in METHODS:
        return f"unknown quantization {method!r} (choose one of {', '.join(METHODS)})"
    reason = ort_step.unsupported_reason(config, precision)
    if reason:
        return f"--quantize {method} quantizes the ONNX Runtime step graph, and {reason}"
    size = encoder_weight_bytes(config)
    if size > TORCH_EXTERNAL_DATA_BYTES:  # told before the export runs; quantize_graphs checks the files too
        return (f"{contract.ENCODER_FILE}'s weights (at least {size / 2**30:.1f} GiB) pass the "
                f"{TORCH_EXTERNAL_DATA_BYTES / 2**30:.1f} GiB above which torch.onnx writes them to an external data "
                f"file, and --quantize {method} handles graphs with inline weights only")
    return None


def encoder_weight_bytes(config: ModelConfig) -> int:
    """A lower bound of encoder.onnx's weight bytes (fp32): the embedding, the encoder layers' matrices and
    the decoder layers' cross-attention K/V projections (biases, LayerNorms and the position table left out)."""
    d, ff = config.d_model, config.d_ff
    return 4 * (config.vocab_size * d + config.encoder_layers * (4 * d * d + 2 * d * ff)
                + config.decoder_layers * 2 * d * d)


def copy_bytes(config: ModelConfig) -> int:
    """About the bytes of the larger int8 copy quantize_graphs writes beside its fp32 graph before it replaces
    it (for the export's disk space check): the MatMul and Gemm weights in one byte each, the embeddings looked
    up and the positional table in four (biases and LayerNorms left out)."""
    from transduce.exporter import ort_step

    d, ff, vocab = config.d_model, config.d_ff, config.vocab_size
    table = config.max_positions * d
    encoder = 4 * (vocab * d + table) + config.encoder_layers * (4 * d * d + 2 * d * ff) + (
        config.decoder_layers * 2 * d * d)
    # the step graph's matrices: its decoder layers' (cross-attention K/V are the encoder's) and the logits'
    step_matrices = config.decoder_layers * (6 * d * d + 2 * d * ff) + vocab * d
    return max(encoder, ort_step.weight_bytes(config) - 3 * step_matrices)


@contextlib.contextmanager
def _quiet_root_logger():
    """quantize_dynamic logs a warning to the root logger for every graph ("consider pre-processing",
    meant for image models): nothing a user of this export can act on."""
    root = logging.getLogger()
    before = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(before)


def quantize_graphs(directory: str, method: str) -> dict[str, Any]:
    """Quantize QUANTIZED_FILES of an export directory in place; -> the manifest's "quantization" record."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    assert method in METHODS, method
    ops: dict[str, dict[str, int]] = {}
    for name in QUANTIZED_FILES:
        path = os.path.join(directory, name)
        tmp = path + ".int8.tmp"
        if any(f.startswith(name + ".") for f in os.listdir(directory)):
            raise ExportError(f"{name} keeps its weights in external data files (a model of more than 2 GB): "
                              "--quantize int8 handles graphs with inline weights only", hint=UNQUANTIZED_HINT)
        try:
            # DefaultTensorType: ONNX shape inference gives no type to contrib ops' outputs
            # (GroupQueryAttention, MultiHeadAttention); every float tensor of these graphs is fp32
            with _quiet_root_logger():
                quantize_dynamic(path, tmp, weight_type=QuantType.QInt8, op_types_to_quantize=list(OP_TYPES),
                                 extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        except Exception as e:  # onnxruntime.quantization raises plain RuntimeError/ValueError/onnx errors
            if os.path.exists(tmp):
                os.remove(tmp)
            raise ExportError(f"onnxruntime could not quantize {name}: {type(e).__name__}: {e}",
                              hint="this is a bug in the exporter; nothing was written") from None
        os.replace(tmp, path)
        ops[name] = dict(Counter(n.op_type for n in onnx.load(path, load_external_data=False).graph.node))
    return {"method": method, "tool": "onnxruntime.quantization.quantize_dynamic",
            "weights": "int8, one scale per tensor",
            "activations": "quantized per run (dynamic)", "op_types": list(OP_TYPES), "graphs": list(QUANTIZED_FILES),
            "unquantized": [contract.STEP_FILE], "ops": ops, "runs_on": "onnxruntime CPUExecutionProvider"}
