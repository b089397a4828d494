"""Training the reference model (`transduce train`).

  train       the paper's training loop: Adam with the warmup schedule, label smoothing, validation, checkpoints,
              exact resume
  data        token-budget batches from length-sorted buckets, deterministic per (seed, epoch)
  config      the options of a run (TrainConfig), checked when made
  checks      what a run checks before it starts: device, output, resume, schedule, a checkpoint's size
  stopping    Ctrl-C and SIGTERM: finish the step, save it, stop
  progress    the bar on a terminal, periodic lines in a log
  distributed, launch, stream   data-parallel training on several processes, --nproc, a corpus read a window at a time

The `transduce train` command is transduce.cli.train.

Importing this package imports no framework; torch is imported when training runs.
"""
