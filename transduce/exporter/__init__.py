"""The exporter: a model directory -> an ONNX artifact (encoder.onnx, decoder_step.onnx, manifest.json).

  onnx_export   export_artifact(): trace, check, validate, write atomically (`transduce export`)
  graphs        the traced modules, example inputs and dynamic shapes (imports torch)
  ort_step      the fused ONNX Runtime step graph (decoder_step.ort.onnx)
  quantize      int8 dynamic quantization of the graphs ONNX Runtime runs on the CPU

The checks and the numeric validation against eager PyTorch are transduce.verify's; the `transduce export`
command is transduce.cli.export.

Importing this package imports no framework; each module imports torch/onnx/onnxruntime where used.
"""
