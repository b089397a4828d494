"""`transduce demo`: the whole pipeline on the embedded corpus (pipeline.run_demo; commands: the click command)."""
