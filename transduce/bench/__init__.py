"""`transduce bench`: our backends side by side with CTranslate2 on identical weights.

Modules (heavy imports stay inside functions):
  ceilings.py            the machine's memory bandwidth and fp32 matmul rate, and the per-step floor they imply
  ctranslate2_export.py  a model directory -> a CTranslate2 model; the token-equality check
  models.py              the benchmarked models: the demo model (or a same-shape random one) and a base-sized one
  worker.py              one system (torch, onnxruntime, tensorrt, ctranslate2) in its own process
  harness.py             interleaved timing of all systems, one JSON-able result
  report.py              bench.json, bench.md, bench.png
  commands.py            the `transduce bench` CLI
"""
