"""transduce: export-and-deploy toolchain for encoder-decoder Transformers.

Packages, lowest layer first (imports point down only; tests/test_layers.py checks it):
  transduce.io         filesystem work: atomic writes, locks, paths, file hashes, text and corpus input,
                       directories held open while read (no ML framework)
  transduce.formats    the on-disk formats: IO contract, artifact manifest, model config and directory, weight
                       layout, engine.json and its profiles (no ML framework)
  transduce.models     the reference Transformer, checkpoints, tokenizers, the demo corpus
  transduce.runtime    BackendSpec, the backend registry and backends (PyTorch, ONNX Runtime, TensorRT), the
                       decoding engine, the Translator
  transduce.verify     tolerances, export validation, parity against eager PyTorch
  transduce.training / .exporter / .build / .importers   train, export ONNX, build TensorRT engines, import
  transduce.inspect / .bench / .demo / .serve           look inside, benchmark, the whole pipeline, serve over HTTP
  transduce.cli        the `transduce` command: one module per command
"""

__version__ = "0.1.0"
