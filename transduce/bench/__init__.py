"""`transduce bench`: our backends side by side with CTranslate2 on identical weights.

Modules (heavy imports stay inside functions; the command is transduce.cli.bench; design notes and
measurements: docs/design/bench.md):
  config.py              BenchConfig (the run's options, checked when made) and the system and mode names
  cpu.py                 the CPU (/proc/cpuinfo), processes' CPU time, settle() until a worker is idle, machine facts
  ceilings.py            the machine's memory bandwidth and fp32 matmul rate, and the per-step floor they imply
  models.py              the benchmarked models: the demo model (or a same-shape random one) and a base-sized one
  inputs.py              random source ids, and a batch of sources padded as our encoder takes it
  ctranslate2/           CTranslate2 itself: a model directory converted with its own converter (convert), its
                         settings (environment, threads) and which repeat another on this CPU (settings), and the
                         token-equality check of its greedy output against ours (check)
  gates.py               the gates before timing: quantized exports' BLEU, CTranslate2's token equality
  worker.py              one system (torch, onnxruntime, tensorrt, ctranslate2) in its own process
  workers.py             the client side of a worker process (Worker, WorkerError)
  stats.py               one cell's summaries over rounds and ratios to CTranslate2
  cells.py               one cell (mode x batch): its inputs, its interleaved rounds, its statistics
  e2e.py                 the end-to-end cells: the demo's held-out sentences as text, each system's defaults, all at
                         once and one at a time, both stopping rules, BLEU and outputs identical to CTranslate2's
  harness.py             the run: every size, its gates, its systems loaded, its cells; one JSON-able result
  report.py              bench.json, bench.md (report_e2e.py: its "End to end" section; report_gpu.py: the GPU's)
  plot.py                bench.png
"""
