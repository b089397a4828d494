"""The exporter: a model directory -> an ONNX artifact (encoder.onnx, decoder_step.onnx, manifest.json).

  onnx_export   export_artifact(): trace, check, validate, write atomically (`transduce export`)
  graphs        the traced modules, example inputs and dynamic shapes (imports torch)
  validate      structural checks and the numeric validation against eager PyTorch; ArtifactRunner
  opcheck       TensorRT ONNX-parser operator support (tensorrt_onnx_ops.txt)
  commands      the click command

Importing this package imports no framework; each module imports torch/onnx/onnxruntime where used.
"""
