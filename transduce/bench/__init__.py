"""`transduce bench`: our backends side by side with CTranslate2 on identical weights.

Modules (heavy imports stay inside functions; design notes and measurements: docs/design/bench.md):
  config.py              BenchConfig (the run's options, checked when made) and the system and mode names
  ct2_settings.py        CTranslate2's settings (environment, threads) and which of them repeat another on this CPU
  cpu.py                 the CPU (/proc/cpuinfo), processes' CPU time, settle() until a worker is idle, machine facts
  ceilings.py            the machine's memory bandwidth and fp32 matmul rate, and the per-step floor they imply
  models.py              the benchmarked models: the demo model (or a same-shape random one) and a base-sized one
  inputs.py              random source ids, and a batch of sources padded as our encoder takes it
  ctranslate2_export.py  a model directory -> a CTranslate2 model; decoding our ids with it
  ct2_check.py           the token-equality check of CTranslate2's greedy output against ours
  gates.py               the gates before timing: quantized exports' BLEU, CTranslate2's token equality
  worker.py              one system (torch, onnxruntime, tensorrt, ctranslate2) in its own process
  workers.py             the client side of a worker process (Worker, WorkerError)
  stats.py               one cell's summaries over rounds and ratios to CTranslate2
  cells.py               one cell (mode x batch): its inputs, its interleaved rounds, its statistics
  harness.py             the run: every size, its gates, its systems loaded, its cells; one JSON-able result
  report.py              bench.json, bench.md
  plot.py                bench.png
  commands.py            the `transduce bench` CLI
"""
