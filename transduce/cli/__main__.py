"""`python -m transduce.cli`: the `transduce` command (torchrun and the tests start it so)."""

from transduce.cli import main

main()
