"""An imported model's decoding defaults (formats.decoding_defaults): what its source framework decodes with when
asked nothing, so that `transduce decode`, Translator.translate() and `transduce serve` give by default what
the framework's own decoding gives.

Hugging Face (any family): generation_config.json, else config.json's generation keys (older checkpoints; what
GenerationConfig.from_model_config reads), each key missing at GenerationConfig's default (greedy, max_length
20). The mapping: num_beams -> beam_size; length_penalty -> length_penalty with the plain form (score /
length^alpha, the length counting EOS, as HF's); early_stopping False / True / "never" -> heuristic /
k-finished / exact; max_length (which counts the decoder start token) -> max_len_b = max_length - 1 with
max_len_a 0, or max_new_tokens -> max_len_b; min_length (counting the start token too) and min_new_tokens
-> min_length; forced_eos_token_id -> forced_eos; bad_words_ids -> suppress; no_repeat_ngram_size and
repetition_penalty as they are. A multilingual model's forced_bos_token_id, a language code's id, is its
default target language (importers.languages). Keys set to what transduce cannot do (sampling, group beam
search, another forced first token, ...) are not carried over: each is named in a warning.

fairseq: fairseq-generate's defaults (beam 5, lenpen 1 on len^lenpen, max_len_a 0 and max_len_b 200 tokens
before a forced EOS, min_len 1, a sentence done once beam hypotheses have finished).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Collection
from typing import Any

from transduce.errors import ImportCheckpointError, TransduceWarning
from transduce.formats.decoding_defaults import DecodingDefaults
from transduce.formats.model_config import ModelConfig

GENERATION_FILE = "generation_config.json"
# GenerationConfig's defaults, where a file does not set a key
HF_DEFAULTS = {"num_beams": 1, "max_length": 20, "max_new_tokens": None, "min_length": 0, "min_new_tokens": None,
               "early_stopping": False, "length_penalty": 1.0, "no_repeat_ngram_size": 0, "repetition_penalty": 1.0,
               "bad_words_ids": None, "forced_eos_token_id": None}
# keys whose value, when not the one given here, asks for what transduce's decoding does not do
NOT_CARRIED = {"do_sample": False, "num_beam_groups": 1, "diversity_penalty": 0.0, "forced_bos_token_id": None,
               "suppress_tokens": None, "begin_suppress_tokens": None, "encoder_no_repeat_ngram_size": 0,
               "num_return_sequences": 1, "exponential_decay_length_penalty": None, "force_words_ids": None,
               "constraints": None, "penalty_alpha": None, "renormalize_logits": False}
EARLY_STOPPING = {False: "heuristic", True: "k-finished", "never": "exact"}

FAIRSEQ = DecodingDefaults(source="fairseq generate", beam_size=5, length_penalty=1.0, length_penalty_form="plain",
                           early_stopping="k-finished", max_len_a=0.0, max_len_b=201, min_length=2, forced_eos=True)


def hf_defaults(src: str, cfg: ModelConfig, language_ids: Collection[int] = ()) -> DecodingDefaults:
    """The decoding defaults of a Hugging Face model directory (the module's docstring); a warning naming each
    key not carried over, an ImportCheckpointError naming a key whose value is not valid. language_ids: a
    multilingual model's language-code ids; a forced_bos_token_id among them is carried over elsewhere (the
    tokenizer's default target language, importers.languages), so it is not warned about."""
    path = os.path.join(src, GENERATION_FILE)
    if os.path.isfile(path):
        given, source = _read(path), GENERATION_FILE
    else:  # an older checkpoint: config.json's own generation keys, as HF reads them
        given, source = _read(os.path.join(src, "config.json")), "config.json"
    where = os.path.join(src, source)
    gen = {**HF_DEFAULTS, **{k: v for k, v in given.items() if k in HF_DEFAULTS}}
    carried = {"forced_bos_token_id": given.get("forced_bos_token_id") in set(language_ids)}
    ignored = [f"{k} = {given[k]!r}" for k, off in NOT_CARRIED.items()
               if k in given and given[k] not in (off, []) and not carried.get(k)]
    if ignored:
        warnings.warn(TransduceWarning(f"{where}: {', '.join(ignored)} not carried over into the model's decoding "
                                       "defaults (transduce does not decode that way): give the options you want "
                                       "when decoding"), stacklevel=2)
    out: dict[str, Any] = {"source": source, "length_penalty_form": "plain"}
    out["beam_size"] = _integer(gen, "num_beams", where, 1)
    out["length_penalty"] = _number(gen, "length_penalty", where)
    if out["length_penalty"] < 0:
        raise ImportCheckpointError(f"{where}: length_penalty {out['length_penalty']} is negative, which "
                                    "transduce's length penalty is not", hint="set it to 0 or more in the file")
    if gen["early_stopping"] not in EARLY_STOPPING or isinstance(gen["early_stopping"], int | float) and \
            not isinstance(gen["early_stopping"], bool):
        raise ImportCheckpointError(f"{where}: early_stopping {gen['early_stopping']!r} is not true, false or "
                                    "\"never\"")
    out["early_stopping"] = EARLY_STOPPING[gen["early_stopping"]]
    out["max_len_a"] = 0.0
    if gen["max_new_tokens"] is not None:
        out["max_len_b"] = _integer(gen, "max_new_tokens", where, 1)
    else:  # HF's max_length counts the decoder start token
        out["max_len_b"] = max(_integer(gen, "max_length", where, 1) - 1, 1)
    out["min_length"] = _integer(gen, "min_length", where, 0)
    if gen["min_new_tokens"] is not None:  # EOS allowed once min_new_tokens tokens came before it
        out["min_length"] = max(out["min_length"], _integer(gen, "min_new_tokens", where, 0) + 1)
    out["forced_eos"] = _forced_eos(gen["forced_eos_token_id"], cfg, where)
    out["no_repeat_ngram_size"] = _integer(gen, "no_repeat_ngram_size", where, 0)
    out["repetition_penalty"] = _number(gen, "repetition_penalty", where)
    if not out["repetition_penalty"] > 0:
        raise ImportCheckpointError(f"{where}: repetition_penalty must be > 0, got {out['repetition_penalty']}")
    out["suppress"] = _bad_words(gen["bad_words_ids"], cfg, where)
    return DecodingDefaults(**out)


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ImportCheckpointError(f"{path} cannot be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ImportCheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object",
                                    hint="restore the file the model came with")
    return data


def _integer(gen: dict, key: str, where: str, least: int) -> int:
    v = gen[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise ImportCheckpointError(f"{where}: {key} must be an integer >= {least}, got {v!r}")
    return v


def _number(gen: dict, key: str, where: str) -> float:
    v = gen[key]
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ImportCheckpointError(f"{where}: {key} must be a number, got {v!r}")
    return float(v)


def _forced_eos(value: Any, cfg: ModelConfig, where: str) -> bool:
    if value is None:
        return False
    ids = value if isinstance(value, list) else [value]
    if cfg.eos_id not in ids:
        raise ImportCheckpointError(f"{where}: forced_eos_token_id {value!r} is not the model's EOS ({cfg.eos_id})",
                                    hint="transduce forces the model's EOS only")
    return True


def _bad_words(value: Any, cfg: ModelConfig, where: str) -> tuple[tuple[int, ...], ...]:
    if value is None:
        return ()
    ok = isinstance(value, list) and all(
        isinstance(s, list) and s and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < cfg.vocab_size
                                          for i in s) for s in value)
    if not ok:
        raise ImportCheckpointError(f"{where}: bad_words_ids must be lists of token ids of the vocabulary (0.."
                                    f"{cfg.vocab_size - 1}), got {value!r}")
    return tuple(tuple(s) for s in value)
