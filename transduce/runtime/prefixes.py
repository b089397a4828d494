"""Target prefixes: the first tokens of a translation, given (interactive translation, a fixed opening, a tag),
which decoding is forced through before it searches on (decode's `prefixes`).

A prefix is text (tokenized with the target vocabulary) or a list of token ids; None or "" is no prefix. The
hypotheses begin with it, and their log_prob and score count its tokens (token_log_probs has each, so a
caller can leave them out). Rules, each an InputError naming the prefix's line: text whose characters the
tokenizer does not know (<unk>: the model would be forced through a token it never meant), ids outside the
vocabulary or special (PAD, BOS, EOS), and a prefix longer than its sentence's maximum length.
"""

from __future__ import annotations

import numpy as np

from transduce.errors import InputError
from transduce.runtime.decoding.options import DecodingOptions, max_lengths


def prefix_ids(tokenizer, config, prefixes: list, source_lengths: list[int], options: DecodingOptions,
               first_line: int = 1, field: str = "prefixes") -> list[list[int]]:
    """Each prefix as token ids, checked; source_lengths: each sentence's source tokens (EOS excluded)."""
    check_prefix_list(prefixes, field)
    if len(prefixes) != len(source_lengths):
        raise InputError(f"{field} has {len(prefixes)} prefixes for {len(source_lengths)} sentences",
                         hint="give one per sentence (null or \"\" for none)", params=(field,))
    special = {config.pad_id, config.bos_id, config.eos_id}
    limits = max_lengths(np.asarray(source_lengths, np.int64) + 1, options, config.max_positions)
    out = []
    for n, (p, limit) in enumerate(zip(prefixes, limits.tolist(), strict=True), first_line):
        if p is None or (isinstance(p, str) and not p):
            out.append([])
            continue
        if isinstance(p, np.ndarray):
            p = p.tolist()
        if isinstance(p, str):
            ids = tokenizer.encode_target(p)
            if config.unk_id in ids:
                raise _about(InputError(f"the prefix of sentence {n} has characters the tokenizer does not know "
                                        f"({p!r} has <unk>)", hint="give a prefix in the model's target language, "
                                        "or as token ids", params=(field,)), n, field)
        elif isinstance(p, list | tuple) and all(isinstance(i, int | np.integer) and not isinstance(i, bool | np.bool_)
                                                for i in p):
            ids = [int(i) for i in p]
            bad = [i for i in ids if not 0 <= i < config.vocab_size or i in special]
            if bad:
                raise _about(InputError(f"the prefix of sentence {n} has token id {bad[0]}, which is "
                                        + ("special (PAD, BOS or EOS)" if 0 <= bad[0] < config.vocab_size else
                                           f"outside the vocabulary (0..{config.vocab_size - 1})"),
                                        params=(field,)), n, field)
        else:
            raise _about(InputError(f"the prefix of sentence {n} is {type(p).__name__}: give text or a list of "
                                    "token ids", params=(field,)), n, field)
        if len(ids) > limit:
            raise _about(InputError(f"the prefix of sentence {n} has {len(ids)} tokens, more than its maximum "
                                    f"length ({limit})", hint="shorten it, or raise max_len_b", params=(field,)),
                         n, field)
        out.append(ids)
    return out


def check_prefix_list(prefixes, field: str = "prefixes") -> None:
    """An InputError naming `field` unless it is a list (or tuple) of prefixes: a dict's keys, a set's order or a
    generator's items would be taken silently."""
    if not isinstance(prefixes, list | tuple):
        raise InputError(f"{field} must be a list with one prefix per sentence, got {type(prefixes).__name__}",
                         hint="null or \"\" for a sentence without one", params=(field,))


def _about(error: InputError, sentence: int, field: str) -> InputError:
    error.sentence, error.field = sentence, field  # type: ignore[attr-defined]
    return error
