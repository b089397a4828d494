"""`transduce build`: TensorRT engines from an exported artifact.

  builder     build_engines(): parse, check, build, verify and write an engine directory atomically
  progress    TensorRT's build phases as bars or log lines

The `transduce build` command is transduce.cli.build.

Importing this package imports no framework; TensorRT and torch are imported when a build runs.
"""
