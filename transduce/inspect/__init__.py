"""Looking inside: attention maps of the eager model, and inspection of model, artifact and engine directories.

  transduce.inspect.attention   attention weights from the model's own forward pass, heatmaps per layer
                                and the paper's Figure 3 line figure for one query token
  transduce.inspect.report      what a model / artifact / engine directory holds, as a JSON-serialisable
                                report: config, files, tokenizer, build figures (inspect_path)
  transduce.inspect.graphs      the ONNX graphs' part of it: inputs and outputs, opsets, op histograms
  transduce.inspect.parameters  parameter counts by component, layer kind and layer, from tensor names
  transduce.inspect.render      the report as rich tables (render_report)
  transduce.cli.inspect    the `transduce attention` and `transduce inspect` subcommands

Importing this package (or its commands) imports no framework (torch, matplotlib, onnx, rich); each function
imports its own.
"""

from transduce.inspect.render import render_report
from transduce.inspect.report import inspect_path

__all__ = ["inspect_path", "render_report"]
