"""A model's decoding defaults: the options its decoding takes when the user names none, kept in the model
directory's config.json under DEFAULTS_KEY (and so in an export's copy of it, which its manifest hashes).

    "decoding_defaults": {"version": 1, "source": "generation_config.json",
                          "options": {"beam_size": 4, "max_len_a": 0, "max_len_b": 511, ...}}

An imported model carries its source framework's (Hugging Face's generation_config.json, fairseq's generation
defaults), so that it decodes as there by default; a model transduce trained has none (the paper's options, the
defaults of DecodingOptions). Each option is a DecodingOptions field, by the same name; options not listed keep
DecodingOptions' defaults, and every option a user gives overrides them. Read and written here only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from transduce.errors import ConfigError

DEFAULTS_KEY = "decoding_defaults"
DEFAULTS_VERSION = 1


@dataclass(frozen=True)
class DecodingDefaults:
    """Overrides of DecodingOptions' defaults (None: not overridden); `source` says where they came from."""

    source: str = ""
    beam_size: int | None = None
    length_penalty: float | None = None
    length_penalty_form: str | None = None
    early_stopping: str | None = None
    max_len_a: float | None = None
    max_len_b: int | None = None
    min_length: int | None = None
    forced_eos: bool | None = None
    no_repeat_ngram_size: int | None = None
    repetition_penalty: float | None = None
    # token id sequences no output may hold (DecodingOptions.suppress; Hugging Face's bad_words_ids)
    suppress: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.source, str):
            raise ConfigError(f"decoding defaults: source must be a string, got {self.source!r}")
        for f in _option_fields():
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name == "suppress":
                object.__setattr__(self, "suppress", _sequences(value))
            elif not _typed_as(value, _KINDS[f.name]):
                raise ConfigError(f"decoding defaults: {f.name} must be {_KINDS[f.name].__name__}, got {value!r}")

    def overrides(self) -> dict[str, Any]:
        """The options set, by name: DecodingOptions' fields over its defaults."""
        return {f.name: getattr(self, f.name) for f in _option_fields() if getattr(self, f.name) is not None}

    def to_dict(self) -> dict[str, Any]:
        options = self.overrides()
        if "suppress" in options:
            options["suppress"] = [list(s) for s in options["suppress"]]
        return {"version": DEFAULTS_VERSION, "source": self.source, "options": options}

    @classmethod
    def from_dict(cls, data: Any) -> DecodingDefaults:
        """The defaults as to_dict wrote them; ConfigError saying what is wrong otherwise."""
        if not isinstance(data, dict):
            raise ConfigError(f"decoding defaults must be an object, got {type(data).__name__}")
        if data.get("version") != DEFAULTS_VERSION:
            raise ConfigError(f"decoding defaults have version {data.get('version')!r}, this transduce reads "
                              f"{DEFAULTS_VERSION}")
        options = data.get("options", {})
        if not isinstance(options, dict):
            raise ConfigError("decoding defaults: options must be an object")
        known = {f.name for f in _option_fields()}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"decoding defaults: unknown option(s) {', '.join(unknown)}",
                              hint=f"known: {', '.join(sorted(known))}")
        return cls(source=data.get("source", ""), **options)


def read_defaults(description: dict[str, Any]) -> DecodingDefaults | None:
    """The decoding defaults of a config.json (a model directory's, or an export's copy); None where it has none
    (a model transduce trained, or one written before they existed). ConfigError where they are malformed."""
    data = description.get(DEFAULTS_KEY)
    return None if data is None else DecodingDefaults.from_dict(data)


# the type each option must have (an int is a float too; a bool is not an int)
_KINDS = {"beam_size": int, "length_penalty": float, "length_penalty_form": str, "early_stopping": str,
          "max_len_a": float, "max_len_b": int, "min_length": int, "forced_eos": bool, "no_repeat_ngram_size": int,
          "repetition_penalty": float}


def _option_fields() -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(DecodingDefaults) if f.name != "source")


def _typed_as(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, int | float) and math.isfinite(value)
    return isinstance(value, kind)


def _sequences(value: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, list | tuple) or not all(
            isinstance(s, list | tuple) and s and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                      for i in s) for s in value):
        raise ConfigError(f"decoding defaults: suppress must be a list of token id lists, got {value!r}")
    return tuple(tuple(s) for s in value)
