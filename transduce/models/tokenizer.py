"""The shared source/target BPE tokenizer (Hugging Face `tokenizers`), used by training and the runtime.
(An imported model's tokenizer.json holds a source and a target tokenizer instead: Tokenizer.from_file reads
it as a transduce.models.pair_tokenizer.PairTokenizer, which has the same interface.)

Sentences are NFKC-normalised, every run of whitespace inside them becomes one space (older tokenizers,
saved without that rule, keep runs as they are, and a tab there is <unk>), and they are split SentencePiece-style
(Metaspace: a word boundary becomes "▁"), then segmented by BPE. Whitespace around a sentence is not
part of it: encode strips it, as training strips its pairs (a trailing space would otherwise be one
more "▁" token, which a model never saw at the end of a sentence). Characters never seen in training become <unk>.
Specials have fixed ids:
<pad>=0, <s>=1, </s>=2, <unk>=3 (the defaults of ModelConfig); their spellings in input text are
ordinary characters.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from transduce.errors import CheckpointError

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
PAD, BOS, EOS, UNK = range(4)


class Tokenizer:
    # a trained model translates one language pair: no language codes (a multilingual PairTokenizer has them)
    languages: dict[str, int] = {}
    default_source_lang: str | None = None
    default_target_lang: str | None = None

    def __init__(self, tok):  # tok: tokenizers.Tokenizer
        self._tok = tok
        for i, s in enumerate(SPECIALS):
            if tok.token_to_id(s) != i:
                raise CheckpointError(f"tokenizer special {s!r} has id {tok.token_to_id(s)}, expected {i}")
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = PAD, BOS, EOS, UNK
        # Text is text: "</s>" or "<pad>" typed in a sentence (or found in a corpus) is split like any other
        # characters, never matched as the special token (tokenizers' default would end a source early or
        # drop a target token from the loss)
        tok.encode_special_tokens = True

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
        from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer(models.BPE(unk_token="<unk>"))
        # NFKC, then every run of whitespace (a tab, a no-break space, a line separator, two spaces) one space:
        # one word boundary, as SentencePiece's nmt_nfkc has it (a tab was <unk>, and decoded to no space at all)
        tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " ")])
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIALS), show_progress=False
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        path = os.fspath(path)
        if not os.path.isfile(path):
            raise CheckpointError(f"tokenizer file {path} is missing")
        pair = _read_pair(path)
        if pair is not None:  # an imported model's source and target tokenizers (transduce import)
            return pair
        try:
            tok = HFTokenizer.from_file(path)
        except Exception as e:  # tokenizers raises plain Exception on malformed JSON
            raise CheckpointError(f"tokenizer file {path} is corrupt or not a tokenizers JSON file ({e})") from None
        return cls(tok)

    @classmethod
    def from_bytes(cls, data: bytes) -> Tokenizer:
        """A tokenizer file's bytes (as another process read them) -> the tokenizer from_file would give."""
        import tempfile

        fd, path = tempfile.mkstemp(suffix=".json", prefix="transduce-tokenizer-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return cls.from_file(path)
        finally:
            os.unlink(path)

    def save(self, path: str | os.PathLike) -> None:
        self._tok.save(os.fspath(path))

    def to_json(self) -> str:
        """The tokenizer as the JSON text save() writes: what a training run sends its other processes."""
        return self._tok.to_str()

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_str(text))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Text -> token ids, never PAD, BOS or EOS (see _text_ids)."""
        return _text_ids(self._tok.encode(text.strip(), add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # the ids only: encode_batch_fast (tokenizers >= 0.21) skips the offsets, a quarter of the work
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [_text_ids(e.ids) for e in batch([t.strip() for t in texts], add_special_tokens=False)]

    def encode_target(self, text: str) -> list[int]:
        """Target-side text -> token ids: the shared vocabulary's, as encode."""
        return self.encode(text)

    def normalize(self, text: str) -> str:
        """`text` as this tokenizer's normalizer (NFKC, whitespace runs as one space) makes it: the closest
        a decode can come to it, so the form to compare decoded text with (a no-break space or a ligature
        in a reference otherwise counts against a perfect model)."""
        normalizer = self._tok.normalizer
        return normalizer.normalize_str(text) if normalizer is not None else text

    prefix_stable = True  # decoding the first n tokens gives the start of decoding them all (a streamed text's)

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids -> text; specials are dropped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def id_to_token(self, i: int) -> str:
        return self._tok.id_to_token(int(i))

    def tokens(self, text: str) -> list[str]:
        return self._tok.encode(text, add_special_tokens=False).tokens

    def source_pieces(self, text: str) -> list[str]:
        """The piece of each token encode(text) gives, as decode_pieces reads it; an unknown token's is the text
        it stands for, which <unk> would lose (a word's first character comes after a piece of its own, "\u2581")."""
        enc = self._tok.encode(text.strip(), add_special_tokens=False)
        unk = SPECIALS[UNK]
        return [piece if piece != unk else text.strip()[start:end]
                for piece, (start, end) in zip(enc.tokens, enc.offsets, strict=True)]

    def decode_pieces(self, pieces: Sequence[str]) -> str:
        """Token pieces (id_to_token's, source_pieces') -> text, as decode makes it from ids."""
        decoder = self._tok.decoder
        return decoder.decode(list(pieces)) if decoder is not None else "".join(pieces)


def _read_pair(path: str):
    """The PairTokenizer a tokenizer file holds, or None when it is a `tokenizers` file."""
    import json

    from transduce.models import pair_tokenizer

    with open(path, "rb") as f:
        if not pair_tokenizer.is_pair_file(f.read(200)):
            return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"tokenizer file {path} is corrupt ({e})") from None
    return pair_tokenizer.PairTokenizer.from_dict(data, path)


def _text_ids(ids: list[int]) -> list[int]:
    """Ids of text: BPE can still spell a special from its merges when a corpus held "</s>" often enough
    (the trainer gives the piece the special's id); such a piece becomes <unk>, never a control token."""
    return [UNK if i in (PAD, BOS, EOS) else i for i in ids] if min(ids, default=UNK) <= EOS else ids
