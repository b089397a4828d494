"""transduce: export-and-deploy toolchain for encoder-decoder Transformers.

Packages, lowest layer first (imports point down only; tests/test_layers.py checks it):
  transduce.formats    the on-disk formats: IO contract, manifests, model config and weight layout, engine
                       profiles, atomic writes (no ML framework)
  transduce.models     the reference Transformer, checkpoints, the demo corpus (and transduce.models.tokenizer)
  transduce.runtime    backends (PyTorch, ONNX Runtime, TensorRT), decoding, the Translator
  transduce.verify     tolerances, export validation, parity against eager PyTorch
  transduce.training / transduce.exporter / transduce.build   train, export ONNX, build TensorRT engines
  transduce.inspect / transduce.bench / transduce.demo        look inside, benchmark, the whole pipeline
  transduce.cli        the `transduce` command
"""

__version__ = "0.1.0"
