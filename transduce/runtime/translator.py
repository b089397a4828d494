"""Text in, text out: tokenization, length-sorted batching under a token budget, decoding, input order back.

Input rules (each tested):
- the texts are an iterable of str (a list, a generator): one string, bytes, None or a number is an
  InputError saying what was given, as is a sentence that is not a str;
- an empty or blank line translates to an empty string without running the model (Translation.empty);
- a line longer than the model's maximum positions is an InputError naming the line, unless
  truncate=True, which keeps the first max_positions-1 tokens and warns;
- characters the tokenizer does not know become <unk>; the count is returned in Translation.unknown
  and the CLI warns about it.

Alignments (return_attention): each candidate's `attention`, (output tokens + EOS, source tokens + EOS), and its
`alignment`, the (source, target) token positions (0-based, Pharaoh's i-j) of each output token and the source
token its attention peaks on; a token whose attention peaks on the source's EOS has no pair. Positions count
the model's tokens (subwords), as Marian's and fast_align's do of theirs. replace_unknowns: each <unk> output
token becomes the text of the source token it is aligned with (one aligned with EOS, or with a multilingual
model's source language code, is dropped, as decode drops <unk>). A multilingual model's codes count as tokens:
the source's at source position 0, the forced target code at target position 0 (as in `tokens`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import reprlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from transduce.errors import InputError, TransduceWarning, TruncatedInput
from transduce.runtime import languages
from transduce.runtime.backends.base import missing_members
from transduce.runtime.decoding import DecodeResult, DecodingOptions, decode
from transduce.runtime.decoding.batch import pad_ids
from transduce.runtime.prefixes import check_prefix_list, prefix_ids

# progress(sentences, tokens): called as each batch is done, with its sentences and the tokens of their
# translations (the CLI's progress bar); blank lines count as sentences of no tokens
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Candidate:
    text: str
    tokens: tuple[int, ...]
    score: float  # length-normalised log-prob
    log_prob: float
    finished: bool  # False if cut at the maximum length
    # return_attention: (len(tokens) + 1 where finished, source tokens + 1) cross-attention, and the
    # (source, target) positions of each output token aligned with a source token (the module's docstring)
    attention: np.ndarray | None = field(default=None, compare=False, repr=False)
    alignment: tuple[tuple[int, int], ...] = ()

    def pharaoh(self) -> str:
        """The alignment as fast_align and Marian write it: "0-0 1-2 ..." (source-target)."""
        return " ".join(f"{s}-{t}" for s, t in self.alignment)


@dataclass(frozen=True)
class Translation:
    text: str  # the best candidate's text
    tokens: tuple[int, ...]
    score: float
    nbest: tuple[Candidate, ...]  # best first; nbest[0] is the translation itself
    source_tokens: int  # source length in tokens (EOS excluded)
    unknown: int = 0  # source tokens that became <unk>
    truncated: bool = False  # the source was cut to fit max_positions
    empty: bool = False  # the source was blank: no decoding was run

    @property
    def alignment(self) -> tuple[tuple[int, int], ...]:
        """The best candidate's alignment (return_attention; () without it)."""
        return self.nbest[0].alignment

    @property
    def attention(self) -> np.ndarray | None:
        """The best candidate's attention (return_attention; None without it)."""
        return self.nbest[0].attention


@dataclass(frozen=True)
class Score:
    """A target's teacher-forced score (Translator.score): what decode reports for that output."""
    tokens: tuple[int, ...]  # the target's token ids, EOS excluded
    log_prob: float  # sum of the token log-probs, EOS included (decode's Hypothesis.log_prob)
    score: float  # log_prob / the length penalty at len(tokens) + 1 (decode's Hypothesis.score)
    token_log_probs: tuple[float, ...]  # one per token, EOS's last
    truncated: bool = False  # the source or the target was cut to fit max_positions


class Translator:
    """defaults: the options a call that names none decodes with, each option it names overriding one; None: the
    model's (the decoding defaults its artifact or model directory carries, formats.decoding_defaults: an
    imported model decodes as its source framework does), else the paper's (DecodingOptions())."""

    def __init__(self, backend, tokenizer, max_batch_tokens: int = 4096, max_batch_size: int = 256,
                 defaults: DecodingOptions | None = None):
        for name, v in (("max_batch_tokens", max_batch_tokens), ("max_batch_size", max_batch_size)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise InputError(f"{name} must be an integer >= 1, got {v!r}")
        missing = missing_members(backend)
        if missing:
            raise InputError(f"the backend ({type(backend).__name__}) lacks {', '.join(missing)} of the backend "
                             "protocol",
                             hint="subclass transduce.runtime.backends.base.Backend: it declares the core members "
                                  "and gives end, cuda_graph and artifact their defaults")
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = backend.config
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        if defaults is None:
            artifact = getattr(backend, "artifact", None)
            defaults = DecodingOptions.of_model(getattr(artifact, "decoding_defaults", None))
        self.defaults = defaults

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike, backend_factory: Callable | None = None, device: str = "cpu",
                       **kwargs) -> Translator:
        from transduce.formats.model_dir import ModelDir
        from transduce.models.checkpoint import load_tokenizer
        from transduce.runtime.backends.torch_backend import TorchBackend

        factory = backend_factory or TorchBackend.from_model_dir
        backend = factory(os.fspath(path), device=device)
        if "defaults" not in kwargs and getattr(backend, "artifact", None) is None:  # the model directory's own
            kwargs["defaults"] = DecodingOptions.of_model(ModelDir.load(path).decoding_defaults)
        return cls(backend, load_tokenizer(path), **kwargs)

    def _encode(self, texts: Sequence[str], truncate: bool, first_line: int = 1, warn: bool = True,
                max_input_length: int = 0, lead: Sequence[int] = ()) -> list[tuple[list[int], int, bool]]:
        model_limit = self.config.max_positions - 1 - len(lead)  # room for EOS and the source language's code
        limit = min(max_input_length, model_limit) if max_input_length else model_limit
        unk = self.config.unk_id
        out = []
        for n, ids in enumerate(self.tokenizer.encode_batch(list(texts)), first_line):
            cut = False
            if len(ids) > limit:
                if not truncate:
                    why = (f"max_input_length is {limit}" if limit < model_limit else
                           f"this model takes at most {limit} (max_positions {self.config.max_positions} including "
                           "EOS)")
                    raise _about(InputError(
                        f"input line {n} has {len(ids)} tokens; {why}",
                        hint="split the line, or pass truncate=True to keep its first tokens",
                        params=("truncate=True",)), n)
                if warn:  # stacklevel: _encode, prepare, _translate, translate (or translate_stream's), its caller
                    warnings.warn(TruncatedInput(f"input line {n}: {len(ids)} tokens truncated to {limit}", n),
                                  stacklevel=5)
                ids, cut = ids[:limit], True
            out.append((list(lead) + ids, sum(1 for i in ids if i == unk), cut))
        return out

    def batches(self, lengths: Sequence[int], beam_size: int) -> list[list[int]]:
        """Indices sorted by length, split so rows * beam * longest source <= max_batch_tokens."""
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        out: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            longest = max(lengths[i], lengths[cur[-1]] if cur else 0)
            full = (len(cur) + 1) * beam_size * longest > self.max_batch_tokens or len(cur) >= self.max_batch_size
            if cur and full:
                out.append(cur)
                cur = []
            cur.append(i)
        if cur:
            out.append(cur)
        return out

    def translate(self, texts: Iterable[str], options: DecodingOptions | None = None, *, truncate: bool = False,
                  first_line: int = 1, progress: Progress | None = None, prefixes: list | None = None,
                  **fields) -> list[Translation]:
        """Translations of `texts`, in their order. options: a DecodingOptions, and/or its fields by name over it
        (beam_size=4, nbest=2, ...; over the model's defaults, self.defaults, where options is None). truncate: cut
        over-long texts (else an InputError). first_line: the number of texts[0] in messages (input line N), for a
        part of a longer input (translate_stream). progress: see Progress. prefixes: one target prefix per text
        (text, token ids, or None), which its translation begins with (runtime.prefixes)."""
        texts = _sentences(texts, "translate()")
        opts = self._options(options, fields, "translate()")
        return self._translate(list(texts), opts, truncate, first_line, progress, prefixes)

    def _options(self, options: DecodingOptions | None, fields: dict, call: str) -> DecodingOptions:
        """The DecodingOptions of translate()'s options, with a warning for each of their model_warnings
        (pointing at the caller of translate or translate_stream)."""
        opts = self.options(fields, call, options)
        for message, params in opts.model_warnings(self.config.vocab_size, self.config.max_positions):
            warnings.warn(TransduceWarning(message, params=params), stacklevel=3)
        return opts

    def options(self, given: dict, call: str = "translate()", base: DecodingOptions | None = None) -> DecodingOptions:
        """The options `given` by name (a command line's flags, a request's fields) over `base` (None: the model's
        defaults), resolved (suppress as token ids)."""
        return self.resolved(DecodingOptions.of(given, call, self.defaults if base is None else base))

    def resolved(self, opts: DecodingOptions) -> DecodingOptions:
        """`opts` with the texts of `suppress` as target token ids, checked against the vocabulary (InputError
        naming suppress for an unknown character or an id out of range), and a multilingual model's source_lang and
        target_lang checked, its defaults filled in (runtime.languages)."""
        opts = languages.resolve(self.tokenizer, opts)
        if not opts.suppress:
            return opts
        out = []
        for seq in opts.suppress:
            ids = tuple(self.tokenizer.encode_target(seq)) if isinstance(seq, str) else seq
            if isinstance(seq, str) and self.config.unk_id in ids:
                raise InputError(f"suppress: {seq!r} has characters the tokenizer does not know (<unk>)",
                                 params=("suppress",))
            if not ids or max(ids) >= self.config.vocab_size:
                raise InputError(f"suppress: {seq!r} is no token sequence of this model's vocabulary (ids 0.."
                                 f"{self.config.vocab_size - 1})", params=("suppress",))
            out.append(ids)
        return dataclasses.replace(opts, suppress=tuple(out))

    def prepare(self, texts: list, truncate: bool, first_line: int = 1, warn: bool = True,
                max_input_length: int = 0, options: DecodingOptions | None = None) -> list[tuple[list[int], int, bool]]:
        """Each text checked and tokenized -> (token ids, unknown tokens, truncated) each; the InputError of the
        first text that cannot be translated carries its number as `sentence`. warn: a TruncatedInput warning
        for each truncated text (a server reports `truncated` in its answer instead). max_input_length: source
        tokens taken at most (0: the model's positions). options: resolved() options, whose source_lang's code
        begins each source of a multilingual model (the ids include it)."""
        self._check_texts(texts, first_line)
        lead = languages.source_lead(self.tokenizer, options) if options is not None else []
        return self._encode(texts, truncate, first_line, warn, max_input_length, lead)

    def target_prefixes(self, prefixes: list | None, prepared: list, opts: DecodingOptions, first_line: int = 1,
                        field: str = "prefixes") -> list[list[int]] | None:
        """Each prepared text's forced target tokens: a multilingual model's target language code (resolved()
        options), then the text's prefix if given (runtime.prefixes, checked); None where there are none."""
        lead = languages.target_lead(self.tokenizer, opts)
        if prefixes is None and not lead:
            return None
        ids = (prefix_ids(self.tokenizer, self.config, prefixes, [len(p[0]) for p in prepared], opts, first_line,
                          field) if prefixes is not None else [[] for _ in prepared])
        return [lead + p for p in ids]

    @staticmethod
    def _check_texts(texts: list, first_line: int) -> None:
        """Each text a str of valid Unicode; else the InputError of the first that is not, with its number."""
        for n, text in enumerate(texts, first_line):
            if not isinstance(text, str):
                raise _about(InputError(f"sentence {n} is {_described(text)}, not a str",
                                        hint="decode bytes first: data.decode('utf-8')"
                                        if isinstance(text, bytes | bytearray) else "pass strings only"), n)
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate: the tokenizer would fail with a TypeError
                hint = "decode bytes with errors='strict' (or 'replace'), not 'surrogateescape'"
                raise _about(InputError(f"sentence {n} is not valid Unicode text: {e.reason} at character {e.start}",
                                        hint=hint), n) from None

    @staticmethod
    def is_blank(text: str, ids: list[int]) -> bool:
        """A text translated to an empty string without running the model."""
        return not text.strip() or not ids

    def translation(self, result: DecodeResult | None, encoded: tuple[list[int], int, bool],
                    source: str | None = None) -> Translation:
        """The Translation of one prepared text from its decoding result (None: a blank text, not decoded).
        source: the text itself, whose tokens replace <unk> outputs where the result has attention and
        replace_unknowns was asked for (None: none replaced)."""
        if result is None:
            return Translation("", (), 0.0, (Candidate("", (), 0.0, 0.0, True),), 0, empty=True)
        pieces = None
        cands = []
        for h in result.hypotheses:
            if h.attention is None:
                cands.append(Candidate(self.tokenizer.decode(h.tokens), h.tokens, h.score, h.log_prob, h.finished))
                continue
            pairs = tuple((s, t) for s, t in h.alignment() if s < len(encoded[0]))  # not EOS
            text = None
            if source is not None and self.config.unk_id in h.tokens:
                pieces = self.tokenizer.source_pieces(source) if pieces is None else pieces
                text = self.replaced_unknowns(h.tokens, dict((t, s) for s, t in pairs), pieces,
                                              languages.lead_length(self.tokenizer, encoded[0]))
            cands.append(Candidate(self.tokenizer.decode(h.tokens) if text is None else text, h.tokens, h.score,
                                   h.log_prob, h.finished, h.attention, pairs))
        cands = tuple(cands)
        ids, unk, cut = encoded
        return Translation(cands[0].text, cands[0].tokens, cands[0].score, cands, len(ids), unk, cut)

    def replaced_unknowns(self, tokens: Sequence[int], source_of: dict[int, int], pieces: Sequence[str],
                          lead: int = 0) -> str:
        """The text of `tokens` with each <unk> at target position t replaced by the text's source piece
        source_of[t] - lead (its aligned source token's text; the source's first `lead` tokens are a language code,
        not text); a <unk> without one, or aligned with the code, is dropped, as decode drops it, and so are
        language codes (never text)."""
        unk = self.config.unk_id
        codes = languages.code_ids(self.tokenizer)
        out = []
        for t, tok in enumerate(tokens):
            if tok in codes:
                continue
            if tok != unk:
                out.append(self.tokenizer.id_to_token(tok))
            elif source_of.get(t, -1) >= lead:
                out.append(pieces[source_of[t] - lead])
        return self.tokenizer.decode_pieces(out)

    def padded(self, prepared: list[tuple[list[int], int, bool]]) -> tuple[np.ndarray, np.ndarray]:
        """Prepared texts as a padded batch: (B, S) source ids with EOS, (B,) lengths (EOS included)."""
        return pad_ids([ids for ids, _, _ in prepared], self.config.pad_id, end=self.config.eos_id)

    def _translate(self, texts: list, opts: DecodingOptions, truncate: bool, first_line: int,
                   progress: Progress | None, prefixes: list | None = None) -> list[Translation]:
        encoded = self.prepare(texts, truncate, first_line, max_input_length=opts.max_input_length, options=opts)
        prefixes = self.target_prefixes(prefixes, encoded, opts, first_line)
        results: list[Translation | None] = [None] * len(texts)
        todo = []
        for i, (text, (ids, _, _)) in enumerate(zip(texts, encoded, strict=True)):
            if self.is_blank(text, ids):
                results[i] = self.translation(None, encoded[i])
            else:
                todo.append(i)
        if progress is not None and len(todo) < len(texts):
            progress(len(texts) - len(todo), 0)
        lengths = [len(encoded[i][0]) + 1 for i in todo]
        for chunk in self.batches(lengths, opts.beam_size):
            idx = [todo[j] for j in chunk]
            src, lens = self.padded([encoded[i] for i in idx])
            keys = np.array(idx) + (first_line - 1)  # the texts' numbers: a sample is the same in any batch
            given = None if prefixes is None else [prefixes[i] for i in idx]
            for i, res in zip(idx, decode(self.backend, src, lens, opts, keys=keys, prefixes=given), strict=True):
                results[i] = self.translation(res, encoded[i], texts[i] if opts.replace_unknowns else None)
            if progress is not None:
                progress(len(idx), sum(len(results[i].tokens) for i in idx))
        return results  # type: ignore[return-value]

    def score(self, sources: Iterable[str], targets: Iterable[str], options: DecodingOptions | None = None, *,
              truncate: bool = False, first_line: int = 1, **fields) -> list[Score]:
        """Each target's teacher-forced Score given its source, in their order (as decode scores what it
        produces). options: a DecodingOptions or its fields by name; only the length penalty's and a multilingual
        model's source_lang and target_lang are read.
        truncate: cut an over-long source or target to the model's positions (else an InputError naming its
        line); first_line: the number of the first pair in messages."""
        opts = self.resolved(DecodingOptions.of(fields, "score()", self.defaults if options is None else options))
        return self.score_prepared(self.prepare_pairs(sources, targets, truncate, first_line, opts), opts)

    def prepare_pairs(self, sources: Iterable[str], targets: Iterable[str], truncate: bool = False,
                      first_line: int = 1, options: DecodingOptions | None = None,
                      warn: bool = True) -> tuple[list, list]:
        """score()'s checks and tokenization: -> (each source's prepare() item, each target's (ids, truncated)),
        an InputError naming the side ("source", "target") and the pair for what is wrong. options: resolved()
        options, whose language codes begin a multilingual model's sources and targets, as decoding places them.
        warn: a warning for each side of a pair that was truncated or has tokens that became <unk> (a server
        reports `truncated` in its answer instead)."""
        sources, targets = list(_sentences(sources, "score()")), list(_sentences(targets, "score() targets"))
        if len(sources) != len(targets):
            raise InputError(f"score() got {len(sources)} sources and {len(targets)} targets",
                             hint="give one target per source")
        encoded = _on_side(lambda: self.prepare(sources, truncate, first_line, warn, options=options), "source")
        lead = languages.target_lead(self.tokenizer, options) if options is not None else []
        wanted = _on_side(lambda: self._targets(targets, truncate, first_line, lead, warn), "target")
        if warn:
            self._warn_unknown(encoded, wanted, first_line, len(lead))
        return encoded, wanted

    def _warn_unknown(self, encoded: list, wanted: list, first_line: int, lead: int) -> None:
        """prepare_pairs' warnings of the tokens of either side that became <unk> (they are scored as <unk>, which
        the text never meant; prepare and _targets warn of truncated sources and targets)."""
        unk = self.config.unk_id
        for n, ((_, src_unknown, _), (ids, _)) in enumerate(zip(encoded, wanted, strict=True), first_line):
            tgt_unknown = sum(1 for i in ids[lead:] if i == unk)
            for side, count in (("source", src_unknown), ("target", tgt_unknown)):
                if count:
                    warnings.warn(TransduceWarning(f"{side} line {n}: {count} token(s) unknown to the tokenizer "
                                                   "became <unk>"), stacklevel=4)

    def score_prepared(self, pairs: tuple[list, list], opts: DecodingOptions) -> list[Score]:
        """The Scores of prepare_pairs()'s pairs (prepared with the same resolved `opts`): the backend's work,
        batched by length under the token budget."""
        from transduce.runtime.decoding.scoring import score_ids

        encoded, wanted = pairs
        lead = len(languages.target_lead(self.tokenizer, opts))  # a forced language code, counted 0 as decoding
        results: list[Score | None] = [None] * len(encoded)
        lengths = [max(len(e[0]), len(t)) + 1 for e, (t, _) in zip(encoded, wanted, strict=True)]
        for chunk in self.batches(lengths, 1):
            src, lens = self.padded([encoded[i] for i in chunk])
            for i, lp in zip(chunk, score_ids(self.backend, src, lens, [wanted[i][0] for i in chunk]), strict=True):
                lp[:lead] = 0
                raw = float(lp.astype(np.float64).sum())
                results[i] = Score(tuple(wanted[i][0]), raw, raw / opts.penalty(len(lp)), tuple(lp.tolist()),
                                   encoded[i][2] or wanted[i][1])
        return results  # type: ignore[return-value]

    def _targets(self, targets: list, truncate: bool, first_line: int, lead: list[int],
                 warn: bool = True) -> list[tuple[list[int], bool]]:
        """Each target text checked and tokenized (the target vocabulary's) after `lead` (a language code) ->
        (ids, truncated) each; warn: a TruncatedInput warning for each one truncated."""
        self._check_texts(targets, first_line)
        out = []
        limit = self.config.max_positions - 1  # BOS and the target's tokens fill the decoder's positions
        for n, text in enumerate(targets, first_line):
            ids = lead + self.tokenizer.encode_target(text)
            if len(ids) > limit and not truncate:  # the text's own tokens counted, the language code apart
                after = " after its language code" if lead else ""
                raise _about(InputError(f"target line {n} has {len(ids) - len(lead)} tokens; this model takes at "
                                        f"most {limit - len(lead)}{after}",
                                        hint="pass truncate=True to score its first tokens",
                                        params=("truncate=True",)), n)
            if len(ids) > limit and warn:  # stacklevel: _targets, its lambda, _on_side, prepare_pairs, score, caller
                warnings.warn(TruncatedInput(f"target line {n}: {len(ids) - len(lead)} tokens truncated to "
                                             f"{limit - len(lead)}", n), stacklevel=6)
            out.append((ids[:limit], len(ids) > limit))
        return out

    def translate_stream(self, texts: Iterable[str], chunk_lines: int, first_line: int = 1,
                         options: DecodingOptions | None = None, *, truncate: bool = False,
                         progress: Progress | None = None, prefixes: list | None = None,
                         **fields) -> Iterator[Translation]:
        """translate(), chunk_lines sentences at a time: each chunk's translations are yielded, in input
        order, as soon as it is decoded, and `texts` is read only as far as the chunk being decoded (a
        pipe can be answered line by line with chunk_lines=1). Memory is bounded by one chunk; batches
        are sorted by length within a chunk, so larger chunks batch better. Options: those of translate(),
        checked here, before anything is read; first_line: the number of the first text in messages; prefixes: one
        per text (the whole list, read chunk by chunk)."""
        it = iter(_sentences(texts, "translate_stream()"))
        if isinstance(chunk_lines, bool) or not isinstance(chunk_lines, int | np.integer) or chunk_lines < 1:
            raise InputError(f"chunk_lines must be an integer >= 1, got {chunk_lines!r}", params=("chunk_lines",))
        opts = self._options(options, fields, "translate_stream()")
        truncate = bool(truncate)
        if prefixes is not None:
            check_prefix_list(prefixes)

        def stream() -> Iterator[Translation]:
            first = first_line
            while chunk := list(itertools.islice(it, chunk_lines)):
                part = None
                if prefixes is not None:
                    part = list(prefixes[first - first_line: first - first_line + len(chunk)])
                    if len(part) < len(chunk):
                        raise InputError(f"prefixes has {len(prefixes)} entries: text {first + len(part)} has none",
                                         hint="give one per text (null or \"\" for none)", params=("prefixes",))
                yield from self._translate(chunk, opts, truncate, first, progress, part)
                first += len(chunk)
            if prefixes is not None and len(prefixes) > first - first_line:
                raise InputError(f"prefixes has {len(prefixes)} entries for {first - first_line} texts",
                                 hint="give one per text", params=("prefixes",))

        return stream()


def _sentences(texts: object, call: str) -> Iterable:
    """`texts` if it is an iterable of sentences; an InputError saying what it is otherwise (one string or
    bytes would be read character by character, byte by byte). `call`: the function, or the field (a server's
    "text"), the message names; a field is the error's parameter too."""
    params = (call,) if call.isidentifier() else ()
    if isinstance(texts, str):
        raise InputError(f"{call} takes a list of sentences, not one string", hint="wrap it: [text]", params=params)
    if isinstance(texts, Mapping):  # iterating it would translate its keys
        raise InputError(f"{call} takes a list of sentences, not an object ({type(texts).__name__})",
                         hint="pass a list of str: [text, ...]", params=params)
    if isinstance(texts, bytes | bytearray):
        raise InputError(f"{call} takes a list of sentences (str), not bytes ({reprlib.repr(texts)})",
                         hint="decode it first: [data.decode('utf-8')]", params=params)
    try:
        iter(texts)  # type: ignore[call-overload]
    except TypeError:
        raise InputError(f"{call} takes a list of sentences, got {_described(texts)}",
                         hint="pass a list of str: [text]", params=params) from None
    return texts  # type: ignore[return-value]


def _on_side(work: Callable, side: str):
    """work()'s result; an InputError about one of its texts names `side` ("source", "target") as its field."""
    try:
        return work()
    except InputError as e:
        if getattr(e, "sentence", None) is not None:
            e.field = side  # type: ignore[attr-defined]
        raise


def _about(error: InputError, sentence: int) -> InputError:
    """`error`, marked as being about the text numbered `sentence` (a server names it in its answer)."""
    error.sentence = sentence  # type: ignore[attr-defined]
    return error


def _described(value: object) -> str:
    """What a value is, for a message: "None", "an int (5)", "bytes (b'five hundred')"."""
    if value is None:
        return "None"
    name = type(value).__name__
    article = "" if isinstance(value, bytes | bytearray) else "an " if name[0] in "aeiou" else "a "
    return f"{article}{name} ({reprlib.repr(value)})"
