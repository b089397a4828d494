"""transduce: export-and-deploy toolchain for encoder-decoder Transformers.

Components: transduce.models (the reference model, training, checkpoints), transduce.exporter (ONNX
export, TensorRT engine building), transduce.runtime (backends, decoding, parity).
"""

__version__ = "0.1.0"
