"""The server's front end: step messages from the decode thread, incremental stream text, LibreTranslate's routes,
and the deadlines on slow or idle connections (real sockets against a real `transduce serve`)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from tests.serve.conftest import KEY, Server, post_to_app, sent_body, sse_events

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def fr_server(long_artifact_dir, tmp_path_factory):
    """A server that says its model translates en:fr, with 1 s deadlines on reading requests and idle connections."""
    s = Server(long_artifact_dir, tmp_path_factory.mktemp("fr"), "--languages", "en:fr", "--read-timeout", "1",
               "--keep-alive", "1")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def _texts(text, ids) -> list[str]:
    """Each token's text as IncrementalText gives it (its events in order, every token once), then finished."""
    events = [e for t in ids for e in text.add(t)] + text.finish()
    assert [t for t, _ in events] == list(ids)
    return [x for _, x in events]


def test_incremental_text_adds_up_to_the_decode_of_every_token(tiny_tokenizer):
    import numpy as np

    from transduce.serve.stream import IncrementalText

    class Counted:  # the tokenizer, counting the tokens each decode is given
        def __init__(self):
            self.decoded = 0

        def decode(self, ids):
            self.decoded += len(ids)
            return tiny_tokenizer.decode(ids)

    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(3, tiny_tokenizer.vocab_size, size=int(rng.integers(1, 40))).tolist()  # <unk> too
        assert "".join(_texts(IncrementalText(tiny_tokenizer), ids)) == tiny_tokenizer.decode(ids)
    ids = rng.integers(4, tiny_tokenizer.vocab_size, size=2000).tolist()
    counted = Counted()
    assert "".join(_texts(IncrementalText(counted), ids)) == tiny_tokenizer.decode(ids)
    assert counted.decoded < 10 * len(ids)  # a window of a few tokens per token, not the sentence so far


def test_incremental_text_holds_back_a_character_split_over_byte_pieces():
    from transduce.serve.stream import IncrementalText

    class Bytes:  # a byte-level tokenizer: token i is byte i
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    ids = list("né ü €!".encode())
    deltas = _texts(IncrementalText(Bytes()), ids)
    assert "".join(deltas) == "né ü €!" and "\ufffd" not in "".join(deltas)
    assert deltas[list(ids).index(0xE2) + 1] == ""  # "€" is three bytes: nothing until the third


def test_incremental_text_of_moses_detokenized_tokens_waits_a_token_and_adds_up(monkeypatch):
    """Moses' detokenizer writes a straight quote by how many came before and a word's space by the next token:
    decoded in windows, the stream's texts made 'dit "bonjour "et' of 'dit "bonjour" et'. Its tokenizer is not
    prefix_stable: each token's text waits for the next token (or the end) and is what both decodes agree on."""
    sacremoses = pytest.importorskip("sacremoses")
    from transduce.models.pair_tokenizer import _MosesBpeSide, _SentencePieceSide
    from transduce.serve.stream import IncrementalText

    detok = sacremoses.MosesDetokenizer(lang="fr")

    class Moses:  # token i is words[i]; decoded as FSMT's and fairseq's targets are
        prefix_stable = False

        def __init__(self, words):
            self.words = words

        def decode(self, ids):
            return detok.detokenize([self.words[i] for i in ids])

    for sentence in ['il dit " bonjour " et part .', 'deux " trois " quatre " cinq "', "l' homme , qui ( dit ) : oui !",
                     '« oui » , dit -il " non "']:
        tok = Moses(sentence.split())
        ids = list(range(len(tok.words)))
        texts = _texts(IncrementalText(tok), ids)
        assert "".join(texts) == tok.decode(ids), texts
    stream = IncrementalText(Moses(["il", "dit", "oui"]))
    assert stream.add(0) == [] and stream.add(1) == [(0, "il")] and stream.finish() == [(1, " dit")]
    subword = Moses([])  # subword-nmt's pieces of escaped text: "&#124;" is "|", "&quot;" a straight quote
    subword.decode = lambda ids: detok.detokenize((" ".join(subword.words[i] for i in ids) + " ").replace("@@ ", "")
                                                  .split())
    for sentence in ["a &#@@ 124@@ ; b c", "x &am@@ p; y &quot; z &quot; .", "AT&@@ T rocks", "a &#@@ 12@@"]:
        subword.words = sentence.split()
        ids = list(range(len(subword.words)))
        assert "".join(_texts(IncrementalText(subword), ids)) == subword.decode(ids)  # was "a &#", then nothing
    rewrites = Moses([])  # a decoder whose last token rewrites text given out already: its new text still comes
    rewrites.decode = lambda ids: ["", "ab", "abc", "abd", "aZ"][len(ids)]
    assert _texts(IncrementalText(rewrites), [0, 1, 2, 3]) == ["ab", "", "", "Z"]
    spec = {"lang": "fr", "vocab": ["a</w>"], "merges": []}
    assert not _MosesBpeSide(spec, 0).prefix_stable and _MosesBpeSide({**spec, "moses": False}, 0).prefix_stable
    assert _SentencePieceSide.prefix_stable


_MOSES_PIECES = ["le", "chat", "l'", "homme", "s", "'", "''", '"', "``", "`", "„", "“", "&quot;", "&#@@", "124@@", ";",
                 "AT&@@", "T", "(", ")", "$", ",", ".", "?", ":", "@-@", "il", "dit", "n't", "EU:", "n", "ssa", "中",
                 "文", "x@@", "z", "12", "«", "»", ""]  # "": a piece that spells no word
_SPLIT_HYPHEN = ["@@@", "-@@", "@"]  # "@-@" in three pieces: it may rewrite the word before it, given out already


def _moses_pair(lang: str, style: str, more: list[str] = ()):
    """A tokenizer pair whose target is Moses-detokenized BPE (fairseq's subword-nmt pieces, or FSMT's "</w>"):
    _MOSES_PIECES, then `more`, as ids from 4 on."""
    from transduce.models.pair_tokenizer import PairTokenizer

    pieces = [*_MOSES_PIECES, *more]
    if style != "subword_nmt":
        pieces = [p[:-2] if p.endswith("@@") else p + "</w>" for p in pieces]
    side = PairTokenizer.side("moses_bpe", ["<pad>", "<s>", "</s>", "<unk>", *pieces], lang=lang, merges=[],
                              style=style)
    return PairTokenizer.build("fsmt", {"pad_id": 0, "bos_id": 1, "eos_id": 2, "unk_id": 3}, side, side)


def test_moses_streams_decode_a_window_from_an_anchor_and_give_what_decoding_whole_gives():
    """A Moses target's stream decodes from the tokenizer's last anchor (where its detokenizer carries nothing over)
    rather than the whole sentence at each token: the same events as decoding whole, for sentences of quotes,
    entities split over pieces, hyphens, brackets, contractions, currency, CJK and Finnish case suffixes, in both
    piece spellings and five languages (Czech's rule reads the sentence's end: it has no anchor)."""
    pytest.importorskip("sacremoses")
    import random

    from transduce.serve.stream import IncrementalText

    class Whole:  # the same tokenizer with no anchor: decoded whole at every token
        prefix_stable = False

        def __init__(self, tok):
            self.decode = tok.decode

    rng = random.Random(0)
    moved = 0
    for lang in ("en", "fr", "fi", "cs", "de"):
        for style in ("subword_nmt", "fsmt"):
            tok = _moses_pair(lang, style, _SPLIT_HYPHEN)
            for n in range(30):
                pieces = len(_MOSES_PIECES) + (len(_SPLIT_HYPHEN) if n % 3 == 0 else 0)
                ids = [rng.randrange(4, 4 + pieces) for _ in range(rng.randint(1, 60))] + [2]
                windowed = IncrementalText(tok)
                texts = _texts(windowed, ids)
                assert texts == _texts(IncrementalText(Whole(tok)), ids), (lang, style, ids)
                assert n % 3 == 0 or "".join(texts) == tok.decode(ids)
                moved += windowed.start > 0
                assert lang != "cs" or windowed.start == 0
    assert moved > 100  # most windows moved on: the comparison is not of two whole decodes
    for style in ("subword_nmt", "fsmt"):  # a piece of no word before the last word: that word may yet grow
        tok = _moses_pair("en", style, ["'@@"])
        quote = 4 + len(_MOSES_PIECES)  # "'" continued by the next piece: "'s" once whole, joined to "chat"
        ids = [4 + _MOSES_PIECES.index(p) for p in ["le"] * 4 + ["chat", ""]] + [quote, 1] + \
            [4 + _MOSES_PIECES.index(p) for p in ("s", "z")]  # (1: BOS, a special decode drops)
        assert _texts(IncrementalText(tok), ids) == _texts(IncrementalText(Whole(tok)), ids)  # (which gives
        # "chat '" before "s" comes, and repeats "'" at the end: a word unfinished over two decodes is rewritten;
        # the anchor is before "chat", not at the piece of no word after it)
        assert tok.stream_anchor(ids[:8]) == 4 and tok.decode(ids) == "le le le le chat's z"


def test_a_moses_stream_costs_its_length_not_its_square():
    """A 1,000-token Moses stream detokenizes a few dozen words per token (decoding whole at each token: ~500)."""
    pytest.importorskip("sacremoses")
    import random

    from transduce.serve.stream import IncrementalText

    tok = _moses_pair("en", "subword_nmt")
    detok, words = tok.target.detokenizer, [0]
    plain = detok.detokenize

    def counted(w, *args, **kwargs):
        words[0] += len(w)
        return plain(w, *args, **kwargs)

    detok.detokenize = counted
    rng = random.Random(1)
    common = ["le", "chat", "dit", "x@@", "z", ",", "homme", '"', "il", '"', ".", "(", "12", ")", "l'"]
    ids = [4 + _MOSES_PIECES.index(rng.choice(common)) for _ in range(1000)]
    assert "".join(_texts(IncrementalText(tok), ids)) == plain(tok.target.words([tok.id_to_token(i) for i in ids]))
    assert words[0] < 40 * len(ids)
    assert tok.stream_anchor([4 + _MOSES_PIECES.index(w) for w in ["il", '"', "dit", "le", "chat"]]) is None  # open
    closed = [4 + _MOSES_PIECES.index(w) for w in ["il", '"', "dit", '"', "le", "chat", "."]]
    assert tok.stream_anchor(closed) == 5 and _moses_pair("cs", "subword_nmt").stream_anchor(closed) is None


def test_a_czech_moses_target_decodes_dashed_words_as_moses_writes_them():
    """sacremoses' Czech rule for "x' - li" (a word ending in an apostrophe, a dash, "li" or "mail...") raises
    TypeError: a server translating into Czech answered such an output with a 500. The three are one word now."""
    pytest.importorskip("sacremoses")
    tok = _moses_pair("cs", "subword_nmt", ["x'", "-", "li", "mailu", "a", "x&apos;"])
    x, dash, li, mailu, a, escaped = range(4 + len(_MOSES_PIECES), 10 + len(_MOSES_PIECES))
    assert tok.decode([x, dash, li, a]) == "x'-li a" and tok.decode([a, escaped, dash, mailu]) == "a x'-mailu"
    assert tok.decode([a, dash, li]) == "a - li" and _moses_pair("fr", "subword_nmt").decode([]) == ""
    chained = _moses_pair("cs", "subword_nmt", ["x'", "-", "li", "mail'", "@-@", "foo"])
    x, dash, li, mail, hyphen, foo = range(4 + len(_MOSES_PIECES), 10 + len(_MOSES_PIECES))
    assert chained.decode([x, dash, mail, dash, li]) == "x'-mail'-li"  # (each "-li" rule after the last)
    assert chained.decode([x, dash, li, hyphen, foo]) == "x' - li-foo"  # sacremoses' own: "li-foo" is not "li"


def test_step_messages_batch_every_request_and_skip_tokens_of_requests_that_do_not_stream(tiny_artifact_dir):
    """One sink call per step with every request's events of that step; a request that does not stream gets only
    its "done"; one that streams its tokens (greedy), its translations and its "done"."""
    from transduce.runtime.api import load
    from transduce.serve.service import DecodeService, ServiceOptions

    service = DecodeService(load(tiny_artifact_dir, threads=1), ServiceOptions(max_rows=64))
    calls: list[list] = []
    lock = threading.Lock()

    def sink(events):
        with lock:
            calls.append(list(events))

    texts = ["one two three", "four hundred and five", "", "twelve"]
    service.start(warmup=False)
    try:
        # queued before the decode thread can admit any: they start in the same step
        with service._lock:
            plain = [service.submit(texts, {"beam_size": b}, sink=sink) for b in (1, 3)]
            streamed = service.submit(texts, {"beam_size": 1}, sink=sink, stream=True)
        for req in (*plain, streamed):
            assert req.finished.wait(60) and req.error is None
        steps = service.batch.steps
    finally:
        service.stop()
    events = [e for call in calls for e in call]
    for req in plain:
        assert [kind for r, kind, _ in events if r is req] == ["done"]
    kinds = [kind for r, kind, _ in events if r is streamed]
    assert kinds[0] == "translation" and kinds[-1] == "done"  # the blank line first, before any step
    assert kinds.count("translation") == 4 and "tokens" in kinds
    assert len(calls) <= steps + 1  # one per step, and the blank line's at submit
    mixed = [call for call in calls if len({id(r) for r, _, _ in call}) > 1]
    assert mixed, "no step message carried more than one request's events"
    tokens = {}
    for r, kind, data in events:
        if r is streamed and kind == "tokens":
            for s, t in zip(*data, strict=True):
                tokens.setdefault(streamed.todo[s], []).append(t)
    for i in streamed.todo:  # every token, EOS included, in order
        assert tokens[i][:len(streamed.translations[i].tokens)] == list(streamed.translations[i].tokens)


def test_a_stream_of_a_tokenizer_decoded_whole_sends_each_token_once_before_its_sentence(tiny_artifact_dir):
    """A tokenizer that is not prefix_stable (Moses' detokenizer) is streamed a token late: every token's event
    still comes once, in order, before its sentence's translation event, and their texts add up to it."""
    from transduce.runtime.api import load
    from transduce.serve.app import create_app
    from transduce.serve.service import DecodeService, ServiceOptions

    service = DecodeService(load(tiny_artifact_dir, threads=1), ServiceOptions())
    service.translator.tokenizer.prefix_stable = False  # decoded whole, as a Moses target would be
    service.start()
    try:
        sent = post_to_app(create_app(service, {"id": "tiny"}), "/v1/translate",
                           {"text": ["one two three", "", "twelve"], "beam_size": 1, "stream": True})
    finally:
        service.stop()
    events = sse_events(sent_body(sent))
    done = events[-1][1]["translations"]
    for i in (0, 2):
        mine = [(k, d) for k, d in events if d.get("sentence") == i]
        assert [k for k, _ in mine][-1] == "translation" and all(k == "token" for k, _ in mine[:-1])
        assert [d["token"] for _, d in mine[:-1]] == done[i]["tokens"]
        assert "".join(d["text"] for _, d in mine[:-1]) == done[i]["text"] == mine[-1][1]["translation"]["text"]


def test_under_our_http_protocol_a_request_waits_on_its_disconnect_future_with_no_task_of_its_own(
        tiny_artifact_dir):
    """Where the HTTP protocol holds the arrival deadline and gives a disconnect future (scope extensions), a
    request starts no task of its own (no watcher on the receive channel, no timeout around its body), and the
    future's completion is the client leaving: the request is cancelled, nothing is sent. Without them (another
    ASGI server), the watcher task as before."""
    import asyncio

    import orjson

    from transduce.runtime.api import load
    from transduce.serve.app import create_app
    from transduce.serve.asgi import DEADLINE_HELD, DISCONNECTED
    from transduce.serve.service import DecodeService, ServiceOptions

    service = DecodeService(load(tiny_artifact_dir, threads=1), ServiceOptions())
    service.start()
    try:
        app = create_app(service, {"id": "tiny"})
        long = {"text": ["one two three"], "beam_size": 1, "min_length": 400, "max_len_a": 0, "max_len_b": 400}

        async def request(extensions: bool, leave: bool):
            loop = asyncio.get_running_loop()
            gone, sent, tasks = loop.create_future(), [], []
            factory = loop.get_task_factory()
            loop.set_task_factory(lambda lp, coro, **kw: tasks.append(coro) or asyncio.Task(coro, loop=lp, **kw))
            body = orjson.dumps(long if leave else {"text": ["one two"], "beam_size": 1})
            received = [{"type": "http.request", "more_body": False, "body": body}]

            async def receive():
                if received:
                    return received.pop(0)
                await gone
                return {"type": "http.disconnect"}

            async def send(message):
                sent.append(message)

            scope = {"type": "http", "method": "POST", "path": "/v1/translate", "headers": []}
            if extensions:
                scope["extensions"] = {DEADLINE_HELD: True, DISCONNECTED: gone}
            handling = asyncio.ensure_future(app(scope, receive, send))
            if leave:  # (before it has read its body: it leaves once that has been read)
                gone.set_result(None)
            await asyncio.wait_for(handling, 30)
            loop.set_task_factory(factory)
            return len(tasks) - 1, sent  # (the request's own handler)

        for extensions in (True, False):
            started, sent = asyncio.run(request(extensions, leave=False))
            assert sent[0]["status"] == 200 and started == (0 if extensions else 1)
            started, sent = asyncio.run(request(extensions, leave=True))
            assert sent == [] and started == (0 if extensions else 1)
    finally:
        service.stop()


def test_a_stream_cut_short_sends_the_token_it_held_before_its_error(tiny_artifact_dir, monkeypatch):
    """A stream decoded whole (each token's event a token late) that the server cuts short (an error event) gets the
    event of the token it held first: every token decoded for it is streamed once, in order, then the error."""
    from transduce.runtime.api import load
    from transduce.serve import stream
    from transduce.serve.app import create_app
    from transduce.serve.service import DecodeService, ServeError, ServiceOptions

    decoded: list[int] = []
    push = stream.Waiter.push

    def recording(self, kind, data):
        if kind == "tokens":
            decoded.extend(data[1])
        push(self, kind, data)

    def cut_after_some_tokens(sent):
        if "event: token" in sent_body(sent) and len(sent) == 3:  # some tokens out: the server stops
            service.cut(ServeError("the server is stopping", 503))

    monkeypatch.setattr(stream.Waiter, "push", recording)
    service = DecodeService(load(tiny_artifact_dir, threads=1), ServiceOptions())
    service.translator.tokenizer.prefix_stable = False
    service.start()
    try:
        body = {"text": ["one two three"], "beam_size": 1, "stream": True, "min_length": 400, "max_len_a": 0,
                "max_len_b": 400}
        sent = post_to_app(create_app(service, {"id": "tiny"}), "/v1/translate", body, cut_after_some_tokens)
    finally:
        service.stop()
    events = sse_events(sent_body(sent))
    assert events[-1][0] == "error" and all(k == "token" for k, _ in events[:-1])
    assert [d["token"] for _, d in events[:-1]] == decoded and len(decoded) > 1


def test_a_long_stream_is_linear_in_its_length_and_its_text_adds_up(server):
    """500 forced greedy tokens: each token event carries the text it adds (their concatenation is the final
    text), so the stream grows with the output, not with its square."""
    body = {"text": ["one two three", "four"], "beam_size": 1, "min_length": 501, "max_len_a": 0, "max_len_b": 500,
            "stream": True}
    r = httpx.post(server.url + "/v1/translate", headers=AUTH, json=body, timeout=120)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    final = events[-1][1]["translations"]
    for i, t in enumerate(final):
        streamed = [d for k, d in events if k == "token" and d["sentence"] == i]
        assert len(streamed) == 500 and "".join(d["text"] for d in streamed) == t["text"]
    text_bytes = sum(len(t["text"].encode()) for t in final)
    # a token event is about 60 bytes beside its text; the final answer repeats the tokens and text a few times
    assert len(r.content) < 1000 * 60 + 10 * text_bytes + 20_000, len(r.content)


def test_error_bodies_and_stream_events_count_sentences_from_0(server):
    r = httpx.post(server.url + "/v1/translate", headers=AUTH, json={"text": ["", "one", 5]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["sentence"] == 2, r.text
    assert "sentence 2 is an int (5)" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/translate", headers=AUTH, timeout=30,
                   json={"text": ["one", "two"], "beam_size": 1, "stream": True})
    assert {d["sentence"] for k, d in sse_events(r.text) if k in ("token", "translation")} == {0, 1}


def test_libretranslate_clients_get_its_answers(fr_server, long_artifact_dir):
    """LibreTranslate's POST /translate as its clients send it, JSON and form-encoded; GET /languages."""
    from transduce.runtime.api import load

    url = fr_server.url
    want = [t.text for t in load(long_artifact_dir, threads=1).translate(["one two three", "twelve"],
                                                                        beam_size=4)]
    r = httpx.post(url + "/translate", json={"q": "one two three", "source": "en", "target": "fr", "format": "text"})
    assert r.status_code == 200 and r.json() == {"translatedText": want[0]}, r.text
    r = httpx.post(url + "/translate", json={"q": ["one two three", "twelve"], "source": "auto", "target": "fr"})
    assert r.json()["translatedText"] == want and r.json()["detectedLanguage"][0]["language"] == "en", r.text
    r = httpx.post(url + "/translate", data={"q": "one two three\ntwelve", "source": "en", "target": "fr"})
    assert r.status_code == 200 and r.json() == {"translatedText": "\n".join(want)}, r.text
    r = httpx.post(url + "/translate", json={"q": "one two three\r\n\ntwelve\n", "source": "en", "target": "fr"})
    assert r.json() == {"translatedText": f"{want[0]}\n\n{want[1]}\n"}, r.text  # blank lines, the last newline kept
    r = httpx.post(url + "/translate", content=b"q=%ff%fe&source=en&target=fr",
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "the form is not UTF-8" in r.json()["error"], r.text
    r = httpx.post(url + "/translate", json={"q": "twelve\u2028", "source": "en", "target": "fr"})
    assert "\n" not in r.json()["translatedText"], r.text  # one line: only "\n" breaks one
    r = httpx.post(url + "/translate", data={"q": "twelve", "source": "en", "target": "fr", "alternatives": "2"})
    assert r.json()["translatedText"] == want[1] and len(r.json()["alternatives"]) == 2, r.text
    # a browser's FormData: multipart/form-data, a textarea's lines ending in CRLF
    r = httpx.post(url + "/translate", content=_form_data({"q": "one two three\r\ntwelve", "source": "en",
                                                         "target": "fr"}), headers={"content-type": FORM_DATA})
    assert r.status_code == 200 and r.json() == {"translatedText": "\n".join(want)}, r.text
    r = httpx.post(url + "/translate", data={"source": "en", "target": "fr"}, files={"q": ("q.txt", b"twelve")})
    assert r.status_code == 400 and "q is a file" in r.json()["error"], r.text
    nested = (b'------formdata-boundary\r\nContent-Disposition: form-data; name="q"\r\nContent-Type: multipart/mixed; '
              b'boundary=in\r\n\r\n--in\r\n\r\ntwelve\r\n--in--\r\n------formdata-boundary--\r\n')
    r = httpx.post(url + "/translate", content=nested, headers={"content-type": FORM_DATA})
    assert r.status_code == 400 and "q is not a text field" in r.json()["error"], r.text
    r = httpx.post(url + "/translate", content=_form_data({"q": "twelve"}),
                   headers={"content-type": "multipart/form-data"})
    assert r.status_code == 400 and "boundary" in r.json()["error"], r.text
    assert httpx.get(url + "/languages").json() == [{"code": "en", "name": "English", "targets": ["fr"]},
                                                    {"code": "fr", "name": "French", "targets": []}]
    for body, says in [({"source": "en", "target": "fr"}, "Invalid request: missing q parameter"),
                       ({"q": "one", "target": "fr"}, "Invalid request: missing source parameter"),
                       ({"q": "one", "source": "en", "target": "de"}, "de is not supported"),
                       ({"q": "one", "source": "es", "target": "fr"}, "es is not supported"),
                       ({"q": "one", "source": "en", "target": "fr", "format": "html"}, "html format is not supported"),
                       ({"q": ["one", 5], "source": "en", "target": "fr"}, "q must be a string or a list of strings"),
                       ({"q": "one", "source": "en", "target": "fr", "alternatives": [[[[[[[[[[1]]]]]]]]]]},
                        "alternatives nests lists or objects more than 8 deep"),
                       ({"q": "one", "source": "en", "target": "fr", "alternatives": [[1]]},
                        "alternatives must be a whole number >= 0, got [[1]]")]:
        r = httpx.post(url + "/translate", json=body)
        assert r.status_code == 400 and says in r.json()["error"], (body, r.text)


FORM_DATA = "multipart/form-data; boundary=----formdata-boundary"


def _form_data(fields: dict[str, str]) -> bytes:
    """A multipart/form-data body of text fields, as a browser's FormData writes it (FORM_DATA's boundary)."""
    parts = [f'------formdata-boundary\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'
             for k, v in fields.items()]
    return ("".join(parts) + "------formdata-boundary--\r\n").encode()


def test_libretranslate_api_key_in_the_body_or_the_bearer_header(server):
    body = {"q": "one two", "source": "en", "target": "fr"}  # a model of unknown languages takes any codes
    assert httpx.post(server.url + "/translate", json={**body, "api_key": KEY}).status_code == 200
    assert httpx.post(server.url + "/translate", json=body, headers=AUTH).status_code == 200
    assert httpx.post(server.url + "/translate", data={**body, "api_key": KEY}).status_code == 200
    assert httpx.post(server.url + "/translate", content=_form_data({**body, "api_key": KEY}),
                      headers={"content-type": FORM_DATA}).status_code == 200
    r = httpx.post(server.url + "/translate", json={**body, "api_key": "wrong"})
    assert r.status_code == 403 and r.json() == {"error": "Invalid API key"}
    r = httpx.post(server.url + "/translate", json=body)
    assert r.status_code == 400 and "API key" in r.json()["error"]
    assert httpx.get(server.url + "/languages").json() == []  # no key needed; no languages known


def _connect(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_a_stalled_body_is_answered_408_and_the_connection_closed(fr_server):
    with _connect(fr_server) as s:
        s.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"text\": [")
        answer = _read_all(s)  # the server closes it: recv returns b"" rather than waiting forever
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"did not arrive within 1 s" in answer


def test_a_request_answered_before_its_body_came_is_not_also_answered_408(fr_server):
    """A body declared over the limit is answered 413 at once; the arrival deadline ends with that answer, so the
    connection gets nothing more (the keep-alive timeout closes it)."""
    with _connect(fr_server) as s:
        s.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000000\r\n\r\n")
        answer = _read_all(s)
    assert answer.startswith(b"HTTP/1.1 413") and b"408" not in answer, answer


def test_trickled_headers_are_answered_408_and_the_connection_closed(fr_server):
    with _connect(fr_server) as s:
        start = time.monotonic()
        s.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\n")
        for _ in range(3):  # a byte now and then: the deadline is on the whole headers, not between bytes
            time.sleep(0.3)
            try:
                s.sendall(b"X")
            except OSError:
                break
        answer = _read_all(s)
    assert answer.startswith(b"HTTP/1.1 408") and b"headers did not arrive" in answer, answer
    assert time.monotonic() - start < 20


def test_idle_connections_are_closed(fr_server):
    with _connect(fr_server) as s:  # never sends a byte
        assert _read_all(s) == b""
    with _connect(fr_server) as s:  # one request, then idle past the keep-alive timeout
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = _read_all(s)
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1
