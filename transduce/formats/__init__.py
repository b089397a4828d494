"""On-disk formats: every file transduce writes or reads is defined, written and read here (the filesystem
work they share, atomic writes, locks and paths, is transduce.io's, one layer below).

  contract      the IO contract of the exported graphs: tensor names, axes, dtypes, contract version
  artifact      an export's manifest.json: read and verify it, the command that rebuilds it
  model_config  ModelConfig, the model's configuration (config.json's "model")
  model_dir     a model directory's config.json: read, verify, write; the files it lists
  weights       the weight-name layout of model.safetensors (versioned), and its header read without loading
  engine        an engine directory's engine.json: read, verify, write; compatibility with this GPU
  profiles      the optimization profiles of a TensorRT build, and how a batch is split over them
  kinds         detect_kind(path): model, artifact or engine directory, recognised one way everywhere
  dtypes        the one table of dtype names (ONNX, ONNX Runtime, TensorRT, safetensors -> numpy's names)

Nothing here imports an ML framework (torch, onnx, onnxruntime, tensorrt, tokenizers); a test enforces it.
"""
