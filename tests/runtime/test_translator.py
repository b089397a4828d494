"""Text-level decoding: batching, input order, and every bad-input rule of the translator."""

from __future__ import annotations

import warnings

import pytest

from transduce.errors import InputError, TruncatedInput
from transduce.io.files import file_entry
from transduce.runtime.translator import Translator


@pytest.fixture(scope="module")
def translator(tiny_model_dir):
    return Translator.from_model_dir(tiny_model_dir, max_batch_tokens=64)


def test_batch_equals_one_at_a_time(translator, small_corpus):
    _, valid = small_corpus
    texts = [s for s, _ in valid[:12]]
    for beam in (1, 4):
        together = translator.translate(texts, beam_size=beam, max_len_b=8)
        alone = [translator.translate([t], beam_size=beam, max_len_b=8)[0] for t in texts]
        assert [r.tokens for r in together] == [r.tokens for r in alone]
        for a, b in zip(together, alone):
            assert a.score == pytest.approx(b.score, abs=1e-4)


def test_batches_sorted_and_under_budget(translator):
    lengths = [5, 30, 2, 2, 17, 9, 30, 1]
    batches = translator.batches(lengths, beam_size=2)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or 2 * len(b) * max(lengths[i] for i in b) <= 64
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat)


def test_empty_lines_translate_to_empty(translator):
    out = translator.translate(["", "   ", "two hundred"], beam_size=2, max_len_b=5)
    assert out[0].text == "" and out[0].empty and out[1].empty
    assert not out[2].empty


def test_whitespace_around_a_line_changes_nothing(translator):
    plain = translator.translate(["two hundred"], beam_size=2, max_len_b=5)[0]
    for text in ("two hundred ", "two hundred\t", " two hundred"):
        got = translator.translate([text], beam_size=2, max_len_b=5)[0]
        assert got.tokens == plain.tokens and got.score == plain.score, repr(text)


def test_overlong_line_is_a_clear_error_or_truncated(translator):
    long = " ".join(["seven hundred"] * 100)
    with pytest.raises(InputError, match="input line 2 has .* tokens; this model takes at most 63") as e:
        translator.translate(["one", long], beam_size=1)
    # in Python's spelling; a command line spells the parameter as its flag
    assert "pass truncate=True to keep" in str(e.value) and "--truncate" not in str(e.value)
    assert "pass --truncate to keep" in e.value.spelled({"truncate=True": "--truncate"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = translator.translate(["one", long], beam_size=1, max_len_b=3, truncate=True)
    assert out[1].truncated and out[1].source_tokens == 63
    [w] = [w for w in caught if issubclass(w.category, TruncatedInput)]
    assert w.message.line == 2 and "input line 2: 200 tokens truncated to 63" in str(w.message)
    assert w.filename == __file__  # the warning points at the caller's line, not transduce's
    with warnings.catch_warnings(record=True) as caught:  # through translate_stream too
        warnings.simplefilter("always")
        out = list(translator.translate_stream(["one", long], 1, first_line=7, beam_size=1, max_len_b=3, truncate=True))
    [w] = [w for w in caught if issubclass(w.category, TruncatedInput)]
    assert out[1].truncated and w.message.line == 8 and w.filename == __file__
    import copy
    import pickle

    for again in (pickle.loads(pickle.dumps(w.message)), copy.deepcopy(w.message)):  # across processes too
        assert again.line == 8 and str(again) == str(w.message)


def test_stream_takes_the_options_of_translate(translator):
    """translate() and translate_stream() take DecodingOptions' fields by name (their one list), over a
    DecodingOptions where one is given; any other name is a TypeError naming the call and the fields."""
    from transduce.runtime.decoding import DecodingOptions

    fields = ", ".join(DecodingOptions.names())
    for call in (lambda **o: translator.translate(["one"], **o),
                 lambda **o: translator.translate_stream(["one"], 1, **o)):
        with pytest.raises(TypeError, match=r"got unexpected option\(s\) beam: it takes " + fields):
            call(beam=2)
    with pytest.raises(TypeError, match=r"translate_stream\(\) got unexpected option\(s\) beam"):
        translator.translate_stream(["one"], 1, beam=2)
    base = DecodingOptions(beam_size=1, max_len_b=3)
    one = translator.translate(["two"], base)[0]
    assert one == translator.translate(["two"], beam_size=1, max_len_b=3)[0]
    assert list(translator.translate_stream(["two"], 1, options=base, max_len_b=3)) == [one]


def test_unknown_characters_are_counted(translator):
    out = translator.translate(["two 日本 three"], beam_size=1, max_len_b=3)
    assert out[0].unknown >= 1


def test_one_long_and_many_short(translator):
    texts = ["one"] * 20 + [" ".join(["nine hundred and ninety"] * 10)]
    together = translator.translate(texts, beam_size=2, max_len_b=4)
    assert len(together) == 21
    alone = translator.translate(texts[-1:], beam_size=2, max_len_b=4)
    assert together[-1].tokens == alone[0].tokens


def test_string_instead_of_list(translator):
    with pytest.raises(InputError, match="list of sentences"):
        translator.translate("one two")


@pytest.mark.parametrize("given, says", [
    (b"five hundred", r"translate\(\) takes a list of sentences \(str\), not bytes \(b'five hundred'\)"),
    (bytearray(b"five"), r"not bytes \(bytearray\(b'five'\)\)"),
    (5, r"translate\(\) takes a list of sentences, got an int \(5\)"),
    (None, r"translate\(\) takes a list of sentences, got None"),
    (2.5, r"got a float \(2.5\)"),
])
def test_what_is_not_a_list_of_sentences_is_named(translator, given, says):
    """Bytes would be read byte by byte ("sentence 1 is a int"), a number or None was a raw TypeError."""
    with pytest.raises(InputError, match=says):
        translator.translate(given)
    with pytest.raises(InputError, match=says.replace("translate", "translate_stream")):
        translator.translate_stream(given, 1)


def test_any_iterable_of_strings(translator):
    texts = ["one", "two hundred"]
    want = [t.tokens for t in translator.translate(texts, beam_size=1, max_len_b=3)]
    assert [t.tokens for t in translator.translate((t for t in texts), beam_size=1, max_len_b=3)] == want
    for bad, says in ((["one", None], "sentence 2 is None, not a str"), (["one", 2], r"sentence 2 is an int \(2\)"),
                      (["one", b"two"], r"sentence 2 is bytes \(b'two'\), not a str")):
        with pytest.raises(InputError, match=says) as e:
            translator.translate(bad)
        assert e.value.hint == ("decode bytes first: data.decode('utf-8')" if isinstance(bad[1], bytes)
                                else "pass strings only")


def test_another_models_tokenizer_is_refused(tmp_path, tiny_artifact_dir):
    """A tokenizer.json of another vocabulary put in the artifact (its manifest entry edited to match)."""
    import json
    import shutil

    from transduce.bench.models import synthetic_tokenizer
    from transduce.errors import ArtifactError
    from transduce.runtime.api import load

    art = tmp_path / "a"
    shutil.copytree(tiny_artifact_dir, art)
    synthetic_tokenizer(300).save(art / "tokenizer.json")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"]["tokenizer.json"] = file_entry(art / "tokenizer.json")
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="has 300 tokens, the model .*: it is not the tokenizer"):
        load(art)


def test_stream_equals_the_whole_and_reads_one_chunk_ahead_at_most(translator):
    texts = ["one", "", "two hundred", "seven", "nine hundred and ninety", "three"]
    want = [t.tokens for t in translator.translate(texts, beam_size=2, max_len_b=4)]
    pulled = []

    def source():
        for t in texts:
            pulled.append(t)
            yield t

    stream = translator.translate_stream(source(), 2, beam_size=2, max_len_b=4)
    got = [next(stream).tokens]
    assert len(pulled) == 2  # the first chunk is answered before the rest is read
    got += [t.tokens for t in stream]
    assert got == want
    assert [t.tokens for t in translator.translate_stream(texts, 4, beam_size=2, max_len_b=4)] == want
    assert list(translator.translate_stream([], 3)) == []


def test_stream_errors_name_the_line_in_the_whole_input(translator):
    long = " ".join(["seven hundred"] * 100)
    stream = translator.translate_stream(["one", "two", "three", "four", long], 2, beam_size=1, max_len_b=3)
    assert len([next(stream) for _ in range(4)]) == 4
    with pytest.raises(InputError, match="input line 5 has"):
        next(stream)
    # argument and option errors come from the call itself, before anything is read
    for bad in (0, 1.5, True):
        with pytest.raises(InputError, match="chunk_lines must be an integer >= 1"):
            translator.translate_stream(["one"], bad)
    with pytest.raises(InputError, match="not one string"):
        translator.translate_stream("one", 1)
    with pytest.raises(InputError, match=r"nbest must be between 1 and beam_size \(2\)"):
        translator.translate_stream([], 1, beam_size=2, nbest=5)
    stream = translator.translate_stream(["one", long], 1, first_line=41, beam_size=1, max_len_b=3)
    next(stream)
    with pytest.raises(InputError, match="input line 42 has"):
        next(stream)


def test_text_that_is_not_unicode_is_a_clear_error(translator):
    """A lone surrogate (bytes decoded with 'surrogateescape') is an InputError naming the sentence, not
    the tokenizer's TypeError."""
    with pytest.raises(InputError,
                       match=r"sentence 2 is not valid Unicode text: surrogates not allowed at character 3"):
        translator.translate(["one", "two\udcff"])


def test_batch_limits_are_checked_by_name(translator):
    for kw, name in ((dict(max_batch_tokens=0), "max_batch_tokens"), (dict(max_batch_size=0), "max_batch_size"),
                     (dict(max_batch_size=2.5), "max_batch_size")):
        with pytest.raises(InputError, match=f"{name} must be an integer >= 1"):
            Translator(translator.backend, translator.tokenizer, **kw)


def test_progress_is_told_of_every_batch(translator):
    """progress(sentences, tokens) after each batch (blank lines at once): the sentences add up to the
    input, the tokens to the translations'."""
    texts = ["one", "", "two hundred", "seven", "nine hundred and ninety", "   ", "three"] * 3
    calls = []
    out = translator.translate(texts, beam_size=2, max_len_b=4, progress=lambda n, t: calls.append((n, t)))
    assert len(calls) > 2 and calls[0] == (6, 0)  # the blank lines first
    assert sum(n for n, _ in calls) == len(texts) and sum(t for _, t in calls) == sum(len(r.tokens) for r in out)
    calls.clear()
    streamed = list(translator.translate_stream(texts, 4, beam_size=2, max_len_b=4,
                                                progress=lambda n, t: calls.append((n, t))))
    assert [r.tokens for r in streamed] == [r.tokens for r in out] and sum(n for n, _ in calls) == len(texts)


def test_options_the_model_cannot_honour_are_warned_of(translator):
    """A beam wider than the vocabulary and a min_length past the maximum length: a TransduceWarning once per
    call, at the caller's line, naming the parameter (a command line spells it as its flag)."""
    from transduce.errors import TransduceWarning

    for call in (lambda: translator.translate(["one"], beam_size=300, max_len_b=2),
                 lambda: list(translator.translate_stream(["one", "two"], 1, beam_size=300, max_len_b=2))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        [w] = [w for w in caught if issubclass(w.category, TransduceWarning)]
        assert str(w.message).startswith("beam_size 300 is wider than the vocabulary (200 tokens)")
        assert w.message.spelled({"beam_size": "--beam"}).startswith("--beam 300 is wider") and w.filename == __file__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = translator.translate(["one"], beam_size=1, min_length=100, max_len_b=3)
    [w] = [w for w in caught if issubclass(w.category, TransduceWarning)]
    assert "min_length 100 is more than any sentence's maximum length" in str(w.message)
    assert not out[0].nbest[0].finished


def test_a_backend_without_the_protocols_members_is_refused_naming_them(tiny_tokenizer):
    """A backend written without subclassing Backend (which gives `end` its default) is refused when the
    Translator is made, not deep inside a decode, naming the core members it lacks."""
    from transduce.errors import InputError
    from transduce.runtime.translator import Translator

    class Bare:
        name, config, device = "bare", {"max_positions": 8}, "cpu"

        def encode(self, src_ids, src_lengths): ...
        def begin(self, encoded, row_src, capacity): ...
        def step(self, state, tokens, k, ban_eos=False): ...
        def step_log_probs(self, state, tokens): ...
        def reorder(self, state, rows, row_src): ...
        def encoder_outputs(self, encoded): ...

    with pytest.raises(InputError, match="lacks end, precision of the backend protocol") as e:
        Translator(Bare(), tiny_tokenizer)
    assert "subclass transduce.runtime.backends.base.Backend" in e.value.hint
