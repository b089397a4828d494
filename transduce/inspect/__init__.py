"""Looking inside: attention maps of the eager model, and inspection of model, artifact and engine directories.

  transduce.inspect.attention   attention weights from the model's own forward pass, heatmaps per layer
                                and the paper's Figure 3 line figure for one query token
  transduce.inspect.inspect     what a model / artifact / engine directory holds: config, parameter counts,
                                graph inputs and outputs, op histograms, files, build figures
  transduce.inspect.commands    the `transduce attention` and `transduce inspect` subcommands

Importing this package (or its commands) imports no framework (torch, matplotlib, onnx); each function
imports its own.
"""
