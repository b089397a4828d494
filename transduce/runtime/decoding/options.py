"""Decoding options and results, and the maximum length formula (offline.py has the rules).

DecodingOptions is the one list of the options: `Translator.translate`'s keywords, the command line's flags
(transduce.cli.options) and the HTTP API's fields are its fields, each with its help in the field's metadata.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import numpy as np

from transduce.errors import ConfigError, InputError
from transduce.formats.decoding_defaults import DecodingDefaults

LENGTH_PENALTIES = ("gnmt", "plain", "none")
# when beam search stops a sentence (offline.py's docstring has the rules)
EARLY_STOPPING = ("heuristic", "k-finished", "exact")


def documented(default, help: str, **metadata):
    """A dataclass field with its help (and its choices) in its metadata, from which the command line makes its
    flag (transduce.cli.options): the options' one description."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass(frozen=True)
class DecodingOptions:
    beam_size: int = documented(4, "Beam size k (1 = greedy search).")
    length_penalty: float = documented(0.6, "alpha of the length penalty ((5+len)/6)^alpha (gnmt) or len^alpha "
                                            "(plain).")
    length_penalty_form: str = documented("gnmt", "How scores are normalised by length: gnmt ((5+len)/6)^alpha, "
                                                  "plain len^alpha, or none.", choices=LENGTH_PENALTIES)
    max_len_a: float = documented(1.0, "Maximum output length = max_len_a x source length + max_len_b.")
    max_len_b: int = documented(50, "Maximum output length = max_len_a x source length + max_len_b.")
    min_length: int = documented(0, "Fewest output tokens, EOS included: EOS is not taken before (0: no minimum).")
    nbest: int = documented(1, "Hypotheses returned per sentence, best first (at most beam_size).")
    # heuristic by default: as many steps as k-finished plus a few, and none of its losses (on the demo model,
    # k-finished cuts 34 of 300 translations short: BLEU 93.5 against 99.3; docs/performance.md)
    early_stopping: str = documented("heuristic", "When beam search stops a sentence: heuristic once it has "
                                                  "beam_size finished hypotheses and its best live beam, scored at its "
                                                  "current length, cannot beat the k-th of them (Hugging Face's "
                                                  "default); k-finished once beam_size x patience hypotheses have "
                                                  "finished (CTranslate2, fairseq, Hugging Face's "
                                                  "early_stopping=True); exact once no live beam could beat the k-th "
                                                  "even at the maximum length (the provably best k, more steps).",
                                     choices=EARLY_STOPPING)
    patience: float = documented(1.0, "early_stopping k-finished: the finished hypotheses to wait for, as a "
                                      "multiple of beam_size (CTranslate2's patience factor).")
    # random sampling (sampling.py): on when sampling_topk is not 1, as CTranslate2's options
    sampling_topk: int = documented(1, "Sample each token among the k most likely (0: the whole vocabulary); 1: no "
                                       "sampling. With beam_size 1 a random sample; wider, each beam's candidates "
                                       "are drawn instead of taken best first.")
    sampling_topp: float = documented(1.0, "With sampling: only the fewest most likely tokens whose probabilities "
                                           "(at the temperature) add up to at least p, in (0, 1] (1: no cut).")
    sampling_temperature: float = documented(1.0, "With sampling: log-probs are divided by it first (> 0; below 1 "
                                                  "sharper, above 1 flatter).")
    seed: int = documented(0, "With sampling: the seed of the random draws. A sentence's draws depend on the seed and "
                              "its number in the input (or request) only, not on the sentences decoded beside it.")
    # repetition control (repetition.py) and the input's length
    no_repeat_ngram_size: int = documented(0, "No n-gram of this size twice in an output (0: no limit), as Hugging "
                                              "Face's and CTranslate2's option.")
    repetition_penalty: float = documented(1.0, "Log-probs of the tokens already in an output are multiplied by it "
                                                "(> 1 makes them less likely; 1: off), as Hugging Face's beam search "
                                                "applies its repetition_penalty.")
    max_input_length: int = documented(0, "Source tokens taken at most, EOS excluded (0: what the model's positions "
                                          "allow); a longer source is refused, or cut with truncate.")
    forced_eos: bool = documented(False, "End a hypothesis that reaches the maximum length with EOS (its last token "
                                         "forced, counted at log-prob 0) instead of cutting it there unfinished, as "
                                         "Hugging Face's forced_eos_token_id does.")
    # multilingual models (runtime/languages.py): the source's and the translation's language codes
    source_lang: str = documented("", "A multilingual model's source language code (NLLB-200: eng_Latn, M2M100: en, "
                                      "mBART-50: en_XX), the token its input begins with; empty: the model's default.")
    target_lang: str = documented("", "A multilingual model's target language code (NLLB-200: fra_Latn, M2M100: fr, "
                                      "mBART-50: fr_XX): each translation is forced to begin with its token (counted "
                                      "at log-prob 0, not part of the text); required where the model has no default.")
    # texts (tokenized with the target vocabulary by the translator) or token id sequences
    suppress: tuple = documented((), "A token sequence no output may hold (repeat the flag for several): text in the "
                                     "target language, or token ids; one token is never produced, a longer "
                                     "sequence's last token never after the rest (CTranslate2's "
                                     "suppress_sequences).", multiple=True)
    # alignments: each output token's cross-attention over the source, read from one decoder layer's heads averaged
    return_attention: bool = documented(False, "Also return each output token's cross-attention over the source "
                                               "(alignment_layer's, averaged over its heads) and its alignment: the "
                                               "source position it attends most (Pharaoh i-j pairs).")
    # the second-to-last layer by default: Garg et al. (2019, "Jointly Learning to Align and Translate with
    # Transformer Models") found the penultimate layer's head-averaged attention the best aligned of a 6-layer
    # Transformer's (the last layer's attends more to what the next token needs than to what it translates)
    alignment_layer: int = documented(-2, "The decoder layer whose cross-attention gives the alignments, 0-based; "
                                          "negative counts from the last (-2: the second-to-last, the first on a "
                                          "one-layer decoder).")
    replace_unknowns: bool = documented(False, "Replace each <unk> output token by the text of the source token it "
                                               "is aligned with (reads the attention as return_attention does).")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options' names: translate()'s keywords, the HTTP API's fields."""
        return _names(cls)

    @classmethod
    def of(cls, given: dict, call: str, defaults: DecodingOptions | None = None) -> DecodingOptions:
        """The options `given` by name over `defaults` (None: the paper's); a TypeError naming `call` for a name
        that is not one of them, as a misspelt keyword of a function is."""
        unknown = sorted(set(given) - set(cls.names()))
        if unknown:
            raise TypeError(f"{call} got unexpected option(s) {', '.join(unknown)}: it takes {', '.join(cls.names())}")
        for name, v in given.items():  # (a value nested hundreds deep would exhaust the stack: typed, checked, shown)
            if nesting_depth(v, MAX_OPTION_DEPTH + 1) > MAX_OPTION_DEPTH:
                raise InputError(f"{name} is a list nested more than {MAX_OPTION_DEPTH} deep; no option takes that",
                                 params=(name,))
        try:  # made once per distinct options (checking them costs ~10 us cold; translate() asks on every call)
            key = tuple(sorted((name, _typed(v)) for name, v in given.items()))  # the types: True == 1, 4.0 == 4
            items = tuple(given.items())
            hash((key, items))
        except TypeError:  # an unhashable value: made, and refused, without the cache
            return dataclasses.replace(defaults, **given) if defaults is not None else cls(**given)
        return _options_of(cls, defaults, key, items)

    def __post_init__(self) -> None:
        # messages name the parameters as Python spells them (params=: a command line spells its flags)
        for name in ("return_attention", "replace_unknowns"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise InputError(f"{name} must be true or false, got {getattr(self, name)!r}", params=(name,))
        for name in ("beam_size", "nbest", "min_length", "max_len_b", "sampling_topk", "seed", "no_repeat_ngram_size",
                     "max_input_length", "alignment_layer"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise InputError(f"{name} must be an integer, got {v!r}", params=(name,))
        for name in ("length_penalty", "max_len_a", "patience", "sampling_topp", "sampling_temperature",
                     "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(v):
                raise InputError(f"{name} must be a finite number, got {v!r}", params=(name,))
            if isinstance(v, np.floating) and np.finfo(v).precision < 15:
                # the decimal a float32 or float16 stands for (np.float32(1.1) is 1.100000024, whose
                # maximum length for 50 source tokens would be 56, not 55)
                object.__setattr__(self, name, float(str(v)))
        if self.beam_size < 1:
            raise InputError(f"beam_size must be >= 1, got {self.beam_size}", hint="1 is greedy search",
                             params=("beam_size",))
        if not 1 <= self.nbest <= self.beam_size:
            raise InputError(f"nbest must be between 1 and beam_size ({self.beam_size}), got {self.nbest}",
                             hint="a search returns at most as many hypotheses as its beam holds",
                             params=("nbest", "beam_size"))
        if self.length_penalty_form not in LENGTH_PENALTIES:
            raise InputError(f"length_penalty_form must be one of {', '.join(LENGTH_PENALTIES)}, got "
                             f"{self.length_penalty_form!r}", params=("length_penalty_form",))
        for name in ("length_penalty", "min_length", "max_len_a", "max_len_b", "no_repeat_ngram_size",
                     "max_input_length"):
            if getattr(self, name) < 0:
                raise InputError(f"{name} must be >= 0, got {getattr(self, name)}", params=(name,))
        for name in ("source_lang", "target_lang"):
            if not isinstance(getattr(self, name), str):
                raise InputError(f"{name} must be a language code (text), got {getattr(self, name)!r}", params=(name,))
        if not isinstance(self.forced_eos, bool | np.bool_):
            raise InputError(f"forced_eos must be true or false, got {self.forced_eos!r}", params=("forced_eos",))
        object.__setattr__(self, "suppress", _sequences(self.suppress))
        if self.early_stopping not in EARLY_STOPPING:
            raise InputError(f"early_stopping must be one of {', '.join(EARLY_STOPPING)}, got "
                             f"{self.early_stopping!r}", params=("early_stopping",))
        if self.patience <= 0:
            raise InputError(f"patience must be > 0, got {self.patience}",
                             hint="1: stop once beam_size hypotheses have finished", params=("patience",))
        self._check_sampling()

    def _check_sampling(self) -> None:
        if self.sampling_topk < 0:
            raise InputError(f"sampling_topk must be >= 0, got {self.sampling_topk}",
                             hint="0 samples from the whole vocabulary, 1 does not sample", params=("sampling_topk",))
        if not 0 < self.sampling_topp <= 1:
            raise InputError(f"sampling_topp must be in (0, 1], got {self.sampling_topp}", hint="1: no cut",
                             params=("sampling_topp",))
        if self.sampling_temperature <= 0:
            raise InputError(f"sampling_temperature must be > 0, got {self.sampling_temperature}",
                             hint="1 samples from the model's own distribution", params=("sampling_temperature",))
        if self.repetition_penalty <= 0:
            raise InputError(f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                             hint="1 is off; above 1 repeated tokens become less likely",
                             params=("repetition_penalty",))
        if not 0 <= self.seed < 2**63:
            raise InputError(f"seed must be in 0 .. 2**63 - 1, got {self.seed}", params=("seed",))
        if not self.sampling:
            for name, off in (("sampling_topp", 1.0), ("sampling_temperature", 1.0)):
                if getattr(self, name) != off:
                    raise InputError(f"{name} applies to sampling, which is off (sampling_topk 1)",
                                     hint="set sampling_topk: 0 for the whole vocabulary, or k > 1",
                                     params=(name, "sampling_topk"))

    @property
    def adjusts(self) -> bool:
        """Whether each step's log-probs are adjusted by the output so far (repetition.py)."""
        return self.no_repeat_ngram_size > 0 or self.repetition_penalty != 1.0 or bool(self.suppress)

    @property
    def attention(self) -> bool:
        """Whether the search keeps each output token's attention (return_attention, or replace_unknowns)."""
        return self.return_attention or self.replace_unknowns

    @property
    def sampling(self) -> bool:
        """Whether tokens are drawn at random (sampling_topk is not 1)."""
        return self.sampling_topk != 1

    @property
    def finished_needed(self) -> int:
        """early_stopping k-finished: the finished hypotheses a sentence waits for (beam_size x patience,
        rounded, at least 1)."""
        return max(1, round(self.beam_size * self.patience))

    def model_warnings(self, vocab_size: int, max_positions: int) -> list[tuple[str, tuple[str, ...]]]:
        """What these options do on a model of that vocabulary and max_positions that was likely not meant:
        a beam wider than the vocabulary, a min_length past the maximum length of some sentences (those
        end there, unfinished: forced() asks for exactly that). -> (message, parameters it names) each."""
        return list(_model_warnings(self, vocab_size, max_positions))

    def _model_warnings(self, vocab_size: int, max_positions: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
        found = []
        if self.beam_size > vocab_size:
            found.append((f"beam_size {self.beam_size} is wider than the vocabulary ({vocab_size} tokens): each "
                          f"sentence carries up to {self.beam_size} hypotheses a step, {self.beam_size}x the work "
                          "of greedy search", ("beam_size",)))
        # each source length's maximum target length (sources of 1 .. max_positions - 1 tokens, EOS
        # excluded): the shortest sources whose maximum is below min_length are cut there
        sources = np.arange(1, max_positions, dtype=np.int64)
        reach = np.flatnonzero(max_lengths(sources + 1, self, max_positions) >= self.min_length)
        if sources.size and (not reach.size or reach[0] > 0):
            formula = f"{self.max_len_a:g} x source tokens + {self.max_len_b}, at most {max_positions}"
            found.append((f"min_length {self.min_length} is more than any sentence's maximum length ({formula}): "
                          "every translation is cut there, unfinished" if not reach.size else
                          f"min_length {self.min_length} is more than the maximum length of sentences of up to "
                          f"{int(sources[reach[0] - 1])} source tokens ({formula}): they are cut there, unfinished",
                          ("min_length",)))
        return tuple(found)

    @classmethod
    def of_model(cls, defaults: DecodingDefaults | None) -> DecodingOptions:
        """A model's default options: its decoding defaults (an imported model's, formats.decoding_defaults) over
        the paper's; the paper's where it has none. ConfigError where they are not valid options."""
        if defaults is None:
            return cls()
        try:
            return cls(**defaults.overrides())
        except InputError as e:
            raise ConfigError(f"the model's decoding defaults ({defaults.source or 'config.json'}) are not valid "
                              f"options: {e}", hint="import the model again") from None

    @classmethod
    def forced(cls, steps: int, beam_size: int = 1, **options) -> DecodingOptions:
        """Exactly `steps` tokens per sentence, whatever the source (EOS banned until then, and the
        maximum length then; capped by the model's max_positions): every system compared does the same
        work (`transduce bench`, CTranslate2's min = max decoding length)."""
        return cls(beam_size=beam_size, min_length=steps + 1, max_len_a=0.0, max_len_b=steps, **options)

    def penalty(self, length: int | np.ndarray) -> float | np.ndarray:
        if self.length_penalty_form == "none" or self.length_penalty == 0:
            return np.ones_like(length, dtype=np.float64) if isinstance(length, np.ndarray) else 1.0
        if self.length_penalty_form == "gnmt":
            return ((5.0 + length) / 6.0) ** self.length_penalty
        if isinstance(length, np.ndarray):
            return np.maximum(length, 1) ** self.length_penalty
        return max(length, 1) ** self.length_penalty


@dataclass(frozen=True)
class Hypothesis:
    tokens: tuple[int, ...]  # generated ids, without EOS
    score: float  # log_prob / length penalty
    log_prob: float  # sum of token log-probs, EOS included
    token_log_probs: tuple[float, ...]  # one per generated token, EOS included when finished
    finished: bool  # False if cut at the maximum length
    # with return_attention: (len(token_log_probs), source length) fp32, each generated token's (EOS included)
    # cross-attention over the source's real positions (EOS included), the alignment layer's averaged over heads
    attention: np.ndarray | None = field(default=None, compare=False)

    def alignment(self) -> tuple[tuple[int, int], ...]:
        """(source position, target position) of each output token (EOS excluded): the source position its
        attention is highest on (Pharaoh's i-j, 0-based); () without attention."""
        if self.attention is None:
            return ()
        return tuple((int(s), t) for t, s in enumerate(self.attention[: len(self.tokens)].argmax(axis=1).tolist()))


@dataclass(frozen=True)
class DecodeResult:
    hypotheses: tuple[Hypothesis, ...]  # best first, at most nbest

    @property
    def best(self) -> Hypothesis:
        return self.hypotheses[0]


def _sequences(given) -> tuple:
    """suppress as a tuple of texts and of tuples of token ids (an InputError naming it for anything else)."""
    if isinstance(given, str | bytes) or not isinstance(given, list | tuple):
        raise InputError(f"suppress must be a list of sequences (texts or lists of token ids), got {given!r}",
                         hint='suppress=["a phrase", [12, 7]]', params=("suppress",))
    out = []
    for seq in given:
        if isinstance(seq, str) and seq.strip():
            out.append(seq)
        elif (isinstance(seq, list | tuple) and seq
              and all(isinstance(i, int | np.integer) and not isinstance(i, bool) and i >= 0 for i in seq)):
            out.append(tuple(int(i) for i in seq))
        else:
            raise InputError(f"suppress holds {seq!r}: each sequence is a non-blank text or a non-empty list of "
                             "token ids", params=("suppress",))
    return tuple(out)


@functools.cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


MAX_OPTION_DEPTH = 3  # lists in lists an option value may hold (suppress: a list of token-id lists)


def nesting_depth(value, limit: int) -> int:
    """How deep lists, tuples and dicts (their values) nest in `value` (0: none), counted up to `limit`, without
    recursion (a value nested hundreds deep would exhaust the stack of a recursive walk)."""
    level, layer = 0, [value]
    while level < limit:
        nests = [v for v in layer if isinstance(v, list | tuple | dict)]
        if not nests:
            return level
        level += 1
        layer = [item for v in nests for item in (v.values() if isinstance(v, dict) else v)]
    return level


def _typed(value) -> tuple:
    """A value with its type, and its items' types, for a cache key (True == 1 and (1.0,) == (1,) in Python)."""
    if isinstance(value, tuple | list):
        return (type(value), tuple(_typed(v) for v in value))
    return (type(value), value)


@functools.lru_cache(maxsize=256)
def _options_of(cls: type, defaults: DecodingOptions | None, key: tuple, items: tuple) -> DecodingOptions:
    """DecodingOptions.of's options `items` (name, value), made once per `key` (their typed form)."""
    given = dict(items)
    return dataclasses.replace(defaults, **given) if defaults is not None else cls(**given)


@functools.lru_cache(maxsize=256)
def _model_warnings(options: DecodingOptions, vocab_size: int, max_positions: int) -> tuple:
    """DecodingOptions.model_warnings, worked out once per options and model (translate() asks on every call:
    the min_length check spans every source length the model takes)."""
    return options._model_warnings(vocab_size, max_positions)


def max_lengths(src_lengths: np.ndarray, options: DecodingOptions, max_positions: int) -> np.ndarray:
    """Per-sentence maximum target length in tokens (EOS included); src_lengths include the source EOS."""
    # capped at max_positions before the int64 cast: a huge a or b (meaning "as long as the model allows")
    # would otherwise overflow to garbage, then clip to 1; b is capped first, exactly (a * (len - 1) >= 0)
    b = float(min(options.max_len_b, max_positions))
    if len(src_lengths) <= 4:  # a few sentences (one at a time): the same formula on Python floats, 3x faster
        out = []
        for n in np.asarray(src_lengths).tolist():
            x = min(options.max_len_a * (n - 1) + b, float(max_positions))
            out.append(min(max(math.ceil(x - 1e-9 * max(1.0, abs(x))), 1), max_positions))
        return np.array(out, dtype=np.int64)
    x = np.minimum(options.max_len_a * (np.asarray(src_lengths, dtype=np.float64) - 1) + b, float(max_positions))
    # less a relative 1e-9 first: 1.1 * 50 is 55.000000000000007 in floating point, whose ceiling would add a step
    n = np.ceil(x - 1e-9 * np.maximum(1.0, np.abs(x))).astype(np.int64)
    return np.clip(n, 1, max_positions)
