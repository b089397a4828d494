"""Verification: does a deployed graph or backend still say what the eager PyTorch model says?

  tolerances  the one table of tolerances per precision and output (export validation and parity use it)
  validate    at export: structural checks of the graphs and their numbers against eager PyTorch
  opcheck     TensorRT's ONNX-parser operator support (tensorrt_onnx_ops.txt)
  parity      an artifact's backend against the eager model on real sentences: errors, sequences, verdicts
  graph_checks, graph_runners  an exported graph's structure checked, and run on numpy inputs

The `transduce parity` command is transduce.cli.parity.

Importing this package imports no framework; each module imports torch, onnx or onnxruntime where used.
"""
