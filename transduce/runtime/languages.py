"""Language codes of multilingual models (NLLB-200, M2M100, mBART-50; their tokenizer has `languages`): the source
language's code token begins the encoder's input, as the model's own tokenizer places it, and decoding is forced to
begin a translation with the target language's (Hugging Face's forced_bos_token_id), counted at log-prob 0 as
there; it is never part of the text. A model of one language pair has no codes and refuses both options."""

from __future__ import annotations

import dataclasses

from transduce.errors import InputError
from transduce.runtime.decoding.options import DecodingOptions

SHOWN = 8  # languages listed in a message


def resolve(tokenizer, opts: DecodingOptions) -> DecodingOptions:
    """`opts` with source_lang and target_lang checked against the model's languages and its defaults filled in
    (InputError naming the option: a code it lacks, one it needs and has no default for, or one given to a model
    without languages)."""
    table = getattr(tokenizer, "languages", None) or {}
    if not table:
        for name in ("source_lang", "target_lang"):
            if getattr(opts, name):
                raise InputError(f"{name} {getattr(opts, name)!r} was given, but this model has no language codes "
                                 "(it translates one language pair)", hint=f"leave {name} out", params=(name,))
        return opts
    source = _code(opts.source_lang or tokenizer.default_source_lang, table, "source_lang")
    target = _code(opts.target_lang or tokenizer.default_target_lang, table, "target_lang")
    if (source, target) == (opts.source_lang, opts.target_lang):
        return opts
    return dataclasses.replace(opts, source_lang=source, target_lang=target)


def _listing(table: dict[str, int]) -> str:
    codes = list(table)
    return ", ".join(codes[:SHOWN]) + (f", ... ({len(codes)} languages)" if len(codes) > SHOWN else "")


def _code(given: str | None, table: dict[str, int], name: str) -> str:
    if not given:
        raise InputError(f"this model translates between {len(table)} languages and has no default: {name} is "
                         "required", hint=f"give {name}, one of {_listing(table)}", params=(name,))
    if given in table:
        return given
    if given.strip("_") in table:  # M2M100's token form, "__fr__"
        return given.strip("_")
    raise InputError(f"{name} {given!r} is not one of this model's languages ({_listing(table)})",
                     hint="language codes are spelt as the model's tokenizer spells them", params=(name,))


def source_lead(tokenizer, opts: DecodingOptions) -> list[int]:
    """The token ids that begin each source: [the source language's code] (none without languages). `opts` as
    resolve() made them."""
    table = getattr(tokenizer, "languages", None) or {}
    return [table[opts.source_lang]] if table and opts.source_lang else []


def target_lead(tokenizer, opts: DecodingOptions) -> list[int]:
    """The tokens every translation is forced to begin with: [the target language's code] (none without
    languages). `opts` as resolve() made them."""
    table = getattr(tokenizer, "languages", None) or {}
    return [table[opts.target_lang]] if table and opts.target_lang else []


def code_ids(tokenizer) -> frozenset[int]:
    """The ids of the model's language codes (none without languages): tokens that are never text."""
    return frozenset((getattr(tokenizer, "languages", None) or {}).values())


def lead_length(tokenizer, ids) -> int:
    """How many of a source's (or a translation's) first token ids are a language code that begins it: 1 or 0
    (text never gives a code, so a code first is the lead)."""
    return int(len(ids) > 0 and int(ids[0]) in code_ids(tokenizer))
