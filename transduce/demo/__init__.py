"""`transduce demo`: the whole pipeline on the embedded corpus (pipeline.run_demo; the command: transduce.cli.demo)."""
