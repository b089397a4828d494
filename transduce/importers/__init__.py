"""Importing pretrained Transformers (Marian / OPUS-MT, FSMT, M2M100, NLLB-200 and mBART-50 in Hugging Face's
format, fairseq checkpoints) into model directories like the ones `transduce train` writes, so that export, build,
decode, parity, bench, inspect and attention work on them unchanged.

    from transduce.importers import import_model
    import_model("marian", "opus-mt-en-de/", "models/en-de")

Each family's module maps its config to a ModelConfig (its deviations from the paper are ModelConfig fields;
anything else is refused naming the field) and its tensors to the reference model's, checked by name and
shape; checkpoints are read without running code (importers.checkpoints). The directory is written atomically.

Decoding as the source projects do: the model directory carries the source framework's decoding defaults
(importers.generation: Hugging Face's generation_config.json, fairseq-generate's defaults), so that decoding with
no options gives what the framework's own does (Hugging Face's model.generate(**inputs): its beam size, its
plain length penalty, its early_stopping rule, max_length, forced_eos_token_id and bad_words_ids); every option
given overrides them. PAD is never generated (OPUS-MT's bad_words_ids ban it too).
"""

from __future__ import annotations

import os

from transduce.errors import ConfigError, ImportCheckpointError

FAMILIES = ("marian", "fsmt", "fairseq", "m2m100", "nllb", "mbart")
NAMED = {"marian": "a Marian", "fsmt": "an FSMT", "fairseq": "a fairseq", "m2m100": "an M2M100",
         "nllb": "an NLLB", "mbart": "an mBART"}  # in messages


def import_model(family: str, src: str | os.PathLike, out: str | os.PathLike, force: bool = False,
                 revision: str | None = None) -> str:
    """Import the checkpoint `src` of `family` (one of FAMILIES) into the model directory `out` (replacing a model
    directory there only with force). `src`: a directory, or a Hugging Face Hub name (`org/name`, at `revision`;
    importers.hub) taken from the Hugging Face cache or downloaded into it. -> out."""
    src, out = os.fspath(src), os.fspath(out)
    if family not in FAMILIES:
        raise ImportCheckpointError(f"unknown model family {family!r}", hint=f"one of {', '.join(FAMILIES)}")
    from transduce.importers import hub

    from_hub = {}
    if hub.is_name(src):
        src, from_hub = hub.snapshot(family, src, revision)
    elif revision is not None:
        raise ImportCheckpointError(f"--revision applies to a Hugging Face Hub name, and {src!r} is a local path",
                                    hint="leave out --revision, or give the model's Hub name (org/name)")
    if not os.path.isdir(src):
        raise ImportCheckpointError(f"{src!r} is not a directory",
                                    hint=f"give the {family} model's directory, or its Hugging Face Hub name "
                                         "(org/name)")
    from transduce.importers.common import looks_like

    seen = looks_like(src)
    if seen is not None and seen != family:  # said before a file the other family lacks is looked for
        raise ImportCheckpointError(f"{src!r} looks like {NAMED.get(seen, seen)} checkpoint, not a {family} one",
                                    hint=f"import it with: transduce import {seen} {src} --out {out}")
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
    try:
        cfg, weights, tokenizer, imported = convert(src)
        imported = {**imported, **from_hub}
    except ConfigError as e:  # a ModelConfig check: said of the checkpoint, not of transduce train's --set
        raise ImportCheckpointError(f"{src}: its config describes a model transduce cannot build: {e.args[0]}",
                                    hint="the checkpoint's config is corrupt, or of another architecture") from None
    from transduce.importers import generation

    language_ids = getattr(tokenizer, "languages", {}).values()  # a multilingual model's: its default target
    defaults = generation.FAIRSEQ if family == "fairseq" else generation.hf_defaults(src, cfg, language_ids)
    return write_model_dir(out, cfg, weights, tokenizer, imported, replaces, defaults)
