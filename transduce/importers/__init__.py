"""Importing pretrained Transformers (Marian / OPUS-MT, FSMT, M2M100, NLLB-200 and mBART-50 in Hugging Face's
format, fairseq checkpoints) into model directories like the ones `transduce train` writes, so that export, build,
decode, parity, bench, inspect and attention work on them unchanged.

    from transduce.importers import import_model
    import_model("marian", "opus-mt-en-de/", "models/en-de")

Each family's module maps its config to a ModelConfig (its deviations from the paper are ModelConfig fields;
anything else is refused naming the field) and its tensors to the reference model's, checked by name and
shape; checkpoints are read without running code (importers.checkpoints). The directory is written atomically.

Decoding as the source projects do: greedy search is token for token Hugging Face's generate(num_beams=1). For
beam search, transduce's GNMT length penalty is not Hugging Face's; length_penalty_form="plain" (score / length^alpha)
is, and gave HF's beam output token for token on the tests' models, but HF ends a sentence's search by its own
early_stopping rule, which can stop earlier than transduce's search (that stops when no live hypothesis can still
beat the k-th finished one): where the two differ, the outputs may too. PAD is never generated (OPUS-MT's
bad_words_ids ban it too).
"""

from __future__ import annotations

import os

from transduce.errors import ImportCheckpointError

FAMILIES = ("marian", "fsmt", "fairseq", "m2m100", "nllb", "mbart")


def import_model(family: str, src: str | os.PathLike, out: str | os.PathLike, force: bool = False) -> str:
    """Import the checkpoint `src` of `family` (one of FAMILIES) into the model directory `out` (replacing a model
    directory there only with force). -> out."""
    src, out = os.fspath(src), os.fspath(out)
    if family not in FAMILIES:
        raise ImportCheckpointError(f"unknown model family {family!r}", hint=f"one of {', '.join(FAMILIES)}")
    if not os.path.isdir(src):
        raise ImportCheckpointError(f"{src!r} is not a directory", hint=f"give the {family} model's directory")
    if os.path.realpath(src) == os.path.realpath(out):
        raise ImportCheckpointError("the output directory is the checkpoint's own directory",
                                    hint="choose another --out")
    if family == "marian":
        from transduce.importers.marian import convert
    elif family == "fsmt":
        from transduce.importers.fsmt import convert
    elif family == "m2m100":
        from transduce.importers.m2m100 import convert_m2m100 as convert
    elif family == "nllb":
        from transduce.importers.m2m100 import convert_nllb as convert
    elif family == "mbart":
        from transduce.importers.mbart import convert
    else:
        from transduce.importers.fairseq import convert
    from transduce.formats.kinds import is_model_dir
    from transduce.importers.common import write_model_dir
    from transduce.io.paths import check_replaceable

    # before any work: an existing output is replaced only with force, and only if it is a model directory
    replaces = check_replaceable(out, force, is_model_dir, "a model directory", "model directories",
                                 ImportCheckpointError, "--out")
    cfg, weights, tokenizer, imported = convert(src)
    return write_model_dir(out, cfg, weights, tokenizer, imported, replaces)
