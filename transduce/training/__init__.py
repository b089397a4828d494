"""Training the reference model (`transduce train`).

  train       the paper's training loop: Adam with the warmup schedule, label smoothing, validation, checkpoints,
              exact resume
  data        token-budget batches from length-sorted buckets, deterministic per (seed, epoch)
  commands    the click command

Importing this package imports no framework; torch is imported when training runs.
"""
