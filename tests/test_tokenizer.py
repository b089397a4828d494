"""The tokenizer: specials at fixed ids, and their spellings in text treated as text."""

from __future__ import annotations

from transduce.models.tokenizer import BOS, EOS, PAD, UNK, Tokenizer


def test_special_spellings_in_text_are_text(tiny_tokenizer, tmp_path):
    for tok in (tiny_tokenizer, _reloaded(tiny_tokenizer, tmp_path)):
        ids = tok.encode("two hundred </s> and <pad> one <s> <unk>")
        assert not {PAD, BOS, EOS} & set(ids)
        assert ids[:2] == tok.encode("two hundred")
        assert tok.encode_batch(["a </s> b"])[0] == tok.encode("a </s> b")
        assert tok.decode([*tok.encode("two"), EOS, PAD]) == "two"  # specials as ids are still specials


def test_a_corpus_that_spells_specials_never_yields_control_ids():
    """BPE trained on text full of "</s>" learns merges that spell it, and the trainer maps that piece
    to the special's id: encode turns it into <unk>."""
    import random

    rnd = random.Random(0)
    letters = "abcdefghijklmnop"
    corpus = [f"{rnd.choice(letters)}{rnd.choice(letters)}</s>{rnd.choice(letters)} <pad>x" for _ in range(400)]
    tok = Tokenizer.train(corpus, vocab_size=120)
    raw = tok._tok.encode("k</s> <pad>x", add_special_tokens=False).ids
    assert {EOS, PAD} & set(raw)  # what the bare BPE gives: the premise of this test
    ids = tok.encode("k</s> <pad>x")
    assert not {PAD, BOS, EOS} & set(ids) and UNK in ids
    assert tok.encode_batch(["k</s> <pad>x"]) == [ids]


def _reloaded(tok, tmp_path) -> Tokenizer:
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    return Tokenizer.from_file(path)


def test_normalize_is_what_a_decode_gives_back(tiny_tokenizer):
    """Validation compares decoded text with references in this form: a no-break space, a ligature or a
    decomposed accent in a reference would otherwise count against a perfect model."""
    for text in ("10\xa0000 dix mille", "\ufb01ne", "cafe\u0301", "plain"):
        assert tiny_tokenizer.normalize(text) == tiny_tokenizer.normalize(tiny_tokenizer.normalize(text))
    assert tiny_tokenizer.normalize("10\xa0000") == "10 000" and tiny_tokenizer.normalize("\ufb01ne") == "fine"
    assert tiny_tokenizer.normalize("cafe\u0301") == "caf\u00e9"


def test_whitespace_around_a_sentence_is_not_part_of_it(tiny_tokenizer):
    """Training strips its pairs; encode strips too, or a trailing space would be one more "▁" token and
    a tab <unk>, which the model never saw there."""
    want = tiny_tokenizer.encode("two hundred")
    for text in ("two hundred ", "two hundred\t", "  two hundred", "\u3000two hundred\r\n"):
        assert tiny_tokenizer.encode(text) == want, repr(text)
    assert tiny_tokenizer.encode_batch(["two hundred ", "\ttwo hundred"]) == [want, want]


def test_whitespace_inside_a_sentence_is_one_word_boundary(tiny_tokenizer):
    """A tab, a no-break space, a line separator or two spaces between words are one boundary: a tab was
    <unk>, and the decode then ran the two words together ("twohundred")."""
    want = tiny_tokenizer.encode("two hundred")
    for text in ("two\thundred", "two  hundred", "two\xa0hundred", "two\u2028hundred", "two \t hundred"):
        assert tiny_tokenizer.encode(text) == want, repr(text)
        assert tiny_tokenizer.normalize(text) == "two hundred"
    assert tiny_tokenizer.decode(tiny_tokenizer.encode("two\thundred")) == "two hundred"
