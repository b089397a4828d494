"""The tokenizer: specials at fixed ids, and their spellings in text treated as text."""

from __future__ import annotations

from transduce.tokenizer import BOS, EOS, PAD, UNK, Tokenizer


def test_special_spellings_in_text_are_text(tiny_tokenizer, tmp_path):
    for tok in (tiny_tokenizer, _reloaded(tiny_tokenizer, tmp_path)):
        ids = tok.encode("two hundred </s> and <pad> one <s> <unk>")
        assert not {PAD, BOS, EOS} & set(ids)
        assert ids[:2] == tok.encode("two hundred")
        assert tok.encode_batch(["a </s> b"])[0] == tok.encode("a </s> b")
        assert tok.decode([*tok.encode("two"), EOS, PAD]) == "two"  # specials as ids are still specials
        assert tok.vocab_size > UNK


def _reloaded(tok, tmp_path) -> Tokenizer:
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    return Tokenizer.from_file(path)
