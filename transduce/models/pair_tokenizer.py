"""The tokenizer of an imported model: a source side and a target side that may differ, as the source project
tokenizes and detokenizes (written by `transduce import`, read wherever a tokenizer.json is read).

One JSON file, tokenizer.json, with "format": PAIR_FORMAT, the specials' ids and two sides, each one of:
  "sentencepiece"  a SentencePiece model (its serialized proto, base64) whose pieces are mapped to the model's
                   ids by a vocabulary of its own (Marian: vocab.json; its ids are not SentencePiece's). A
                   Marian source (or target) may start with a language code ">>xx<<", kept as one token (as
                   MarianTokenizer does, whether or not the vocabulary has codes: one it lacks is <unk>).
  "moses_bpe"      Moses punctuation normalization and tokenization (sacremoses, aggressive dash splits,
                   escaped), then BPE with "</w>" word ends from its merges (FSMT, XLM-style); decoding joins
                   the pieces and Moses-detokenizes.
A multilingual model's file also has "languages": {"codes": {code: id}, "source": code, "target": code} (the
defaults, null where the model has none): the language-code tokens that begin a source and that decoding is forced
to start a translation with (NLLB-200's "fra_Latn", M2M100's "fr" for "__fr__", mBART-50's "fr_XX"); they are
never text. The file is self-contained, so that an export copying tokenizer.json carries the whole tokenizer.
Unknown pieces become <unk>, as the source projects do. The spellings of the specials in text ("</s>", "<pad>",
"<unk>") are text, segmented as any other (Hugging Face's tokenizers with split_special_tokens): input never
injects an EOS or PAD into a source. Needs `sentencepiece` or `sacremoses` (the
`import` extra) for the side that uses it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import unicodedata
from collections.abc import Sequence
from typing import Any

from transduce.errors import CheckpointError

PAIR_FORMAT = "transduce-tokenizer-pair"
PAIR_VERSION = 1
KINDS = ("sentencepiece", "moses_bpe")
SPECIAL_KEYS = ("pad_id", "bos_id", "eos_id", "unk_id")

# Moses' replace-unicode-punctuation.perl (as FSMT's tokenizer ports it); "。" and "．" take the spaces after them
_UNICODE_PUNCT = {
    "，": ",", "、": ",", "”": '"', "“": '"', "∶": ":", "：": ":", "？": "?", "《": '"', "》": '"', "）": ")",
    "！": "!", "（": "(", "；": ";", "１": "1", "」": '"', "「": '"', "０": "0", "３": "3", "２": "2", "５": "5",
    "６": "6", "９": "9", "７": "7", "８": "8", "４": "4", "～": "~", "’": "'", "…": "...", "━": "-", "〈": "<",
    "〉": ">", "【": "[", "】": "]", "％": "%",
}


def _missing(package: str) -> CheckpointError:
    return CheckpointError(f"this model's tokenizer needs the {package} package, which is not installed",
                           hint="pip install 'transduce[import]'")


def merge_pair(symbols: list[str], pair: tuple[str, str]) -> list[str]:
    """`symbols` with each non-overlapping `pair`, left to right, joined into one symbol (a BPE merge)."""
    merged, i = [], 0
    while i < len(symbols):
        if i < len(symbols) - 1 and (symbols[i], symbols[i + 1]) == pair:
            merged.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged


class _SentencePieceSide:
    """SentencePiece segmentation, pieces mapped to ids by `vocab` (a list: id -> piece)."""

    prefix_stable = True  # the text of the first n pieces is the start of the text of them all

    def __init__(self, spec: dict[str, Any], unk_id: int, family: str = ""):
        try:
            import sentencepiece
        except ImportError:
            raise _missing("sentencepiece") from None
        self.spec = spec
        self.sp = sentencepiece.SentencePieceProcessor()
        self.sp.LoadFromSerializedProto(base64.b64decode(spec["model"]))
        self.vocab: list[str] = spec["vocab"]
        self.ids = {p: i for i, p in enumerate(self.vocab)}
        self.unk_id = unk_id
        # a leading ">>xx<<" is a code: Marian's either side (older imports recorded it only with codes in vocab)
        self.codes = bool(spec.get("language_codes")) or family == "marian"

    def pieces(self, text: str) -> list[str]:
        code = []
        if self.codes and text.startswith(">>") and (end := text.find("<<")) != -1:  # Marian's ">>fr<<"
            code, text = [text[: end + 2]], text[end + 2:]
        return code + self.sp.encode(text, out_type=str)

    def encode(self, text: str) -> list[int]:
        return [self.ids.get(p, self.unk_id) for p in self.pieces(text)]

    def decode(self, pieces: list[str]) -> str:
        if self.spec.get("join"):  # fairseq's sentencepiece decoding: the pieces joined, "▁" a space
            return "".join(pieces).replace(" ", "").replace("\u2581", " ").strip()
        return self.sp.decode_pieces(pieces).replace("\u2581", " ").strip()


class _MosesBpeSide:
    """Moses normalization and tokenization, then BPE with "</w>" word ends (FSMT's tokenizer); with style
    "subword_nmt" (fairseq) the pieces are spelt as subword-nmt writes them ("hel@@ lo"), and "moses": false
    splits on whitespace only (fairseq without --tokenizer moses), "normalize": false leaves out FSMT's
    punctuation normalization (fairseq's Moses tokenizer has none)."""

    def __init__(self, spec: dict[str, Any], unk_id: int, family: str = ""):
        try:
            import sacremoses
        except ImportError:
            raise _missing("sacremoses") from None
        self.spec = spec
        self.lang = spec["lang"]
        self.vocab: list[str] = spec["vocab"]
        self.ids = {p: i for i, p in enumerate(self.vocab)}
        self.ranks = {tuple(m.split(" ")): i for i, m in enumerate(spec["merges"])}
        self.unk_id = unk_id
        self.normalizer = sacremoses.MosesPunctNormalizer(lang=self.lang)
        self.tokenizer = sacremoses.MosesTokenizer(lang=self.lang)
        self.detokenizer = sacremoses.MosesDetokenizer(lang=self.lang)
        self.cache: dict[str, list[str]] = {}
        # Moses' detokenizer writes a token by the ones after it (a straight quote opens or closes by its count, a
        # word's space by the next token): the text of the first n tokens is not the start of the whole text's
        self.prefix_stable = not spec.get("moses", True)

    def _bpe(self, token: str) -> list[str]:
        """The pieces of one Moses token, merges applied lowest rank first."""
        if token in self.cache:
            return self.cache[token]
        word = list(token[:-1]) + [token[-1] + "</w>"]
        while len(word) > 1:
            pairs = {(a, b) for a, b in zip(word, word[1:])}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            word = merge_pair(word, best)
        if self.spec.get("style") == "subword_nmt":  # "lo</w>" -> "lo", a piece inside a word "hel" -> "hel@@"
            word = [w[:-4] if w.endswith("</w>") else w + "@@" for w in word]
        self.cache[token] = word
        return word

    def pieces(self, text: str) -> list[str]:
        if self.spec.get("lower"):
            text = text.lower()
        if not self.spec.get("moses", True):
            return [p for t in text.split() for p in self._bpe(t)]
        if self.spec.get("normalize", True):  # FSMT's punctuation normalization (fairseq's moses has none)
            text = re.sub(r"．\s*", ". ", re.sub(r"。\s*", ". ", text))
            text = "".join(_UNICODE_PUNCT.get(c, c) for c in text)
            text = self.normalizer.normalize(text)
            text = "".join(c for c in text if not unicodedata.category(c).startswith("C"))
        tokens = self.tokenizer.tokenize(text, aggressive_dash_splits=True, return_str=False, escape=True)
        return [p for t in tokens if t for p in self._bpe(t)]

    def encode(self, text: str) -> list[int]:
        return [self.ids.get(p, self.unk_id) for p in self.pieces(text)]

    def words(self, pieces: list[str]) -> list[str]:
        """The words the pieces spell, as the detokenizer reads them."""
        if self.spec.get("style") == "subword_nmt":  # fairseq's: "@@ " joins a word's pieces
            return (" ".join(pieces) + " ").replace("@@ ", "").split()
        return "".join(p.replace(" ", "").replace("</w>", " ") for p in pieces).split()

    def decode(self, pieces: list[str]) -> str:
        words = self.words(pieces)
        if not self.spec.get("moses", True):
            return " ".join(words)
        return self.detokenizer.detokenize(_czech_dashes(self.detokenizer, words) if self.lang == "cs" else words)

    def anchor(self, pieces: list[str]) -> int | None:
        """Where a stream of these pieces may start decoding afresh: a word's first piece k, whole words after it,
        such that decode(pieces[:k]) + " " + decode(pieces[k:]) is decode(pieces) now and whatever pieces follow;
        None where there is no such place near the end. Moses' detokenizer carries over a boundary only its state
        (whether the next word takes a space, each kind of straight quote's count: even opens, odd closes) and
        rules that read the word before or the two after; k is taken where a probe of words after it finds the
        state as at a sentence's start and the words on both sides decode apart as together. Czech's rule reads
        the sentence's last words: no anchor."""
        if not self.spec.get("moses", True) or self.lang == "cs":
            return None
        subword = self.spec.get("style") == "subword_nmt"
        starts = [j for j in range(1, len(pieces))
                  if (not pieces[j - 1].endswith("@@") if subword else pieces[j - 1].endswith("</w>"))]
        detok = self.detokenizer.detokenize
        whole = None
        for i in (len(starts) - 2, len(starts) - 3):  # the last word may not be complete: the two before it
            if i < 0:
                continue
            k = starts[i]
            if len(self.words(pieces[k: starts[i + 1]])) != 1:  # a piece that spells no word ("</w>", "") ends
                continue  # none: the word after k could still be the last, not yet complete
            head, tail = self.words(pieces[:k]), self.words(pieces[k:])
            if not head or not tail or (self.lang == "fi" and self.detokenizer.FINNISH_REGEX.search(tail[0])):
                continue  # (a Finnish case suffix first in a window reads the window's last word)
            quotes = {w for w in map(self.detokenizer.unescape_xml, head) if self.detokenizer.IS_OPEN_QUOTE.search(w)}
            probe = ["x", *(q for quote in sorted(quotes) for q in (quote, "x"))]
            text = detok(head)
            if detok(head + probe) != f"{text} {detok(probe)}":
                continue  # a quote left open, or the next word's space taken (a currency sign, "(", "l'")
            whole = whole if whole is not None else self.decode(pieces)
            if whole == f"{text} {detok(tail)}":
                return k
        return None


_CZECH_DASHED = re.compile(r"^li$|^mail.*", re.IGNORECASE)


def _czech_dashes(detokenizer, words: list[str]) -> list[str]:
    """Czech words with each "x' - li" (a word ending in an apostrophe, a dash, then "li" or "mail...") as one word,
    as Moses' Czech rule writes them: sacremoses' own rule for them raises TypeError (next() on a list). Joined
    against what is joined already (x' - mail' - li is one word), and "li" not where a split hyphen "@-@" follows,
    which Moses joins to it first."""
    out: list[str] = []
    for i, word in enumerate(words):
        if (len(out) >= 2 and out[-1] in ("-", "\u2013") and _CZECH_DASHED.search(word)
                and detokenizer.IS_FRENCH_CONRTACTION.search(detokenizer.unescape_xml(out[-2]))
                and not (word.lower() == "li" and words[i + 1: i + 2] == ["@-@"])):
            out[-2:] = [out[-2] + out[-1] + word]
        else:
            out.append(word)
    return out


_SIDES = {"sentencepiece": _SentencePieceSide, "moses_bpe": _MosesBpeSide}


class PairTokenizer:
    """Source and target tokenizers of an imported model, with the interface of transduce.models.tokenizer.Tokenizer:
    encode/encode_batch take source text, decode/id_to_token read target ids; vocab_size is the target's."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        for k in SPECIAL_KEYS:
            setattr(self, k, int(spec["specials"][k]))
        self.family = spec.get("family", "")
        self.source = _SIDES[spec["source"]["kind"]](spec["source"], self.unk_id, self.family)
        self.target = _SIDES[spec["target"]["kind"]](spec["target"], self.unk_id, self.family)  # (Marian's codes)
        langs = spec.get("languages") or {}
        self.languages: dict[str, int] = {str(k): int(v) for k, v in (langs.get("codes") or {}).items()}
        self.default_source_lang: str | None = langs.get("source")
        self.default_target_lang: str | None = langs.get("target")
        # ids that are never text: skipped by decode, turned into <unk> by encode
        self._specials = ({self.pad_id, self.bos_id, self.eos_id, self.unk_id} | set(spec.get("control_ids", []))
                          | set(self.languages.values()))

    @staticmethod
    def side(kind: str, vocab: list[str], **fields: Any) -> dict[str, Any]:
        """A side's spec: kind, its id -> piece vocabulary and the kind's fields (model bytes as `model`)."""
        assert kind in KINDS, kind
        if "model" in fields:
            fields["model"] = base64.b64encode(fields["model"]).decode("ascii")
        return {"kind": kind, "vocab": list(vocab), **fields}

    @classmethod
    def build(cls, family: str, specials: dict[str, int], source: dict[str, Any], target: dict[str, Any],
              control_ids: Sequence[int] = (), languages: dict[str, Any] | None = None) -> PairTokenizer:
        """languages: a multilingual model's {"codes": {code: id}, "source": default, "target": default}."""
        spec = {"format": PAIR_FORMAT, "version": PAIR_VERSION, "family": family, "specials": dict(specials),
                "control_ids": sorted(set(control_ids)), "source": source, "target": target}
        if languages:
            spec["languages"] = languages
        return cls(spec)

    @classmethod
    def from_dict(cls, d: Any, path: str) -> PairTokenizer:
        ok = (isinstance(d, dict) and d.get("version") == PAIR_VERSION and isinstance(d.get("specials"), dict)
              and all(isinstance(d["specials"].get(k), int) for k in SPECIAL_KEYS)
              and all(isinstance(d.get(s), dict) and d[s].get("kind") in KINDS for s in ("source", "target")))
        if not ok:
            raise CheckpointError(f"tokenizer file {path} is not a version-{PAIR_VERSION} transduce tokenizer pair",
                                  hint="import the model again with this transduce (transduce import)")
        try:
            return cls(d)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:  # sentencepiece: RuntimeError on a bad proto
            raise CheckpointError(f"tokenizer file {path} is damaged ({type(e).__name__}: {e})") from None

    def save(self, path: str | os.PathLike) -> None:
        with open(os.fspath(path), "w", encoding="utf-8") as f:
            json.dump(self.spec, f, ensure_ascii=False)

    @property
    def vocab_size(self) -> int:
        return len(self.target.vocab)

    @property
    def source_vocab_size(self) -> int:
        return len(self.source.vocab)

    def encode(self, text: str) -> list[int]:
        """Source text -> ids, never EOS or PAD (a special's spelling in text is <unk>)."""
        return [self.unk_id if i in self._specials else i for i in self.source.encode(text.strip())]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_target(self, text: str) -> list[int]:
        """Target-side text -> target vocabulary ids, never EOS or PAD (scoring a given translation)."""
        return [self.unk_id if i in self._specials else i for i in self.target.encode(text.strip())]

    def normalize(self, text: str) -> str:
        """What decoded text is compared with: the text itself (the source projects score detokenized text)."""
        return text

    @property
    def prefix_stable(self) -> bool:
        """Whether decoding the first n tokens gives the start of decoding them all (IncrementalText relies on it)."""
        return self.target.prefix_stable

    def decode(self, ids: Sequence[int]) -> str:
        """Target ids -> detokenized text; specials are dropped."""
        vocab = self.target.vocab
        return self.target.decode([vocab[int(i)] for i in ids if int(i) not in self._specials and int(i) < len(vocab)])

    def stream_anchor(self, ids: Sequence[int]) -> int | None:
        """Where a stream decoding these target ids whole (prefix_stable False) may start afresh: k with
        decode(ids[:k]) + " " + decode(ids[k:]) == decode(ids) now and whatever ids follow; None where the target
        has no such place now (see _MosesBpeSide.anchor)."""
        anchor = getattr(self.target, "anchor", None)
        if anchor is None:
            return None
        vocab = self.target.vocab
        kept = [j for j, i in enumerate(ids) if int(i) not in self._specials and int(i) < len(vocab)]
        k = anchor([vocab[int(ids[j])] for j in kept])
        return None if k is None else kept[k]

    def id_to_token(self, i: int) -> str:
        return self.target.vocab[int(i)]

    def tokens(self, text: str) -> list[str]:
        return self.source.pieces(text.strip())

    def source_pieces(self, text: str) -> list[str]:
        """The piece of each source token (SentencePiece keeps an unknown piece's text), as decode_pieces reads it."""
        return self.tokens(text)

    def decode_pieces(self, pieces: Sequence[str]) -> str:
        """Target pieces -> detokenized text."""
        return self.target.decode(list(pieces))


def is_pair_file(head: bytes) -> bool:
    """Whether a tokenizer file's first bytes are a tokenizer pair's JSON (its "format" is written first)."""
    return PAIR_FORMAT.encode() in head[:200]
