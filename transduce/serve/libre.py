"""LibreTranslate's API over the same decode service, for the clients (browser extensions, apps) that speak it.

  POST /translate   q (a string, or with a JSON body a list of strings), source, target, format ("text"),
                    alternatives (optional), api_key (optional) as JSON or as a form (application/x-www-form-
                    urlencoded, or multipart/form-data as a browser's FormData sends it) -> {"translatedText":
                    "..."} (a list for a list q), with "detectedLanguage" for source "auto" and "alternatives"
                    when asked; errors {"error": "..."}: 400 bad input, 403 a
                    wrong api_key, 429 "Slowdown: ...", 500, 503, 504
  GET  /languages   [{"code", "name", "targets"}] (no key needed, as LibreTranslate)

A model of one language pair: its codes come from `transduce serve --languages SRC:TGT`, else from the tokenizer
(imported FSMT and fairseq models name theirs); `source` and `target` must be those codes ("auto" is the source's).
A model whose languages are known to no one takes any codes and lists none. A multilingual model (NLLB-200,
M2M100, mBART-50: its tokenizer has language codes) lists its own codes and takes them, or the two-letter ISO
codes LibreTranslate's clients send ("fr" for fra_Latn or fr_XX), as the request's source_lang and target_lang
("auto": the model's default source). Each line of `q` is a sentence of the request (blank lines stay blank); the
lines' translations are joined with newlines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

import orjson

from transduce.errors import InputError, TransduceError
from transduce.serve.asgi import MAX_FIELD_DEPTH, header, read_body, send_json, too_deep, unwatch, watch_disconnect
from transduce.serve.options import ServeError
from transduce.serve.stream import ClientLeft, Waiter

NAMES = {"ar": "Arabic", "cs": "Czech", "de": "German", "en": "English", "es": "Spanish", "fi": "Finnish",
         "fr": "French", "hi": "Hindi", "it": "Italian", "ja": "Japanese", "ko": "Korean", "nl": "Dutch",
         "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "sv": "Swedish", "tr": "Turkish",
         "uk": "Ukrainian", "zh": "Chinese"}
# NLLB-200's codes (ISO 639-3 and script) of the languages above, for clients that send ISO 639-1 codes
NLLB = {"ar": "arb_Arab", "cs": "ces_Latn", "de": "deu_Latn", "en": "eng_Latn", "es": "spa_Latn", "fi": "fin_Latn",
        "fr": "fra_Latn", "hi": "hin_Deva", "it": "ita_Latn", "ja": "jpn_Jpan", "ko": "kor_Hang", "nl": "nld_Latn",
        "pl": "pol_Latn", "pt": "por_Latn", "ro": "ron_Latn", "ru": "rus_Cyrl", "sv": "swe_Latn", "tr": "tur_Latn",
        "uk": "ukr_Cyrl", "zh": "zho_Hans"}


@dataclass(frozen=True)
class Languages:
    """The model's language pair, as codes (None: not known), or a multilingual model's codes (`codes`)."""

    source: str | None = None
    target: str | None = None
    codes: tuple[str, ...] = ()  # a multilingual model's language codes, as its tokenizer spells them

    @classmethod
    def parse(cls, text: str) -> Languages:
        """`SRC:TGT` (serve --languages) -> the pair; InputError otherwise."""
        src, sep, tgt = text.partition(":")
        if not sep or not src.strip() or not tgt.strip() or ":" in tgt:
            raise InputError(f"languages must be SRC:TGT (two codes), got {text!r}", hint="for example en:fr",
                             params=("languages",))
        return cls(src.strip(), tgt.strip())

    @classmethod
    def of(cls, tokenizer) -> Languages:
        """A multilingual tokenizer's codes, the pair the tokenizer names (an imported model's PairTokenizer
        sides), or an unknown pair."""
        codes = getattr(tokenizer, "languages", None)
        if codes:
            return cls(codes=tuple(codes))
        spec = getattr(tokenizer, "spec", None)
        if isinstance(spec, dict):
            src, tgt = (spec.get(side, {}).get("lang") for side in ("source", "target"))
            if isinstance(src, str) and isinstance(tgt, str):
                return cls(src, tgt)
        return cls()

    @property
    def known(self) -> bool:
        return self.source is not None and self.target is not None

    def listing(self) -> list[dict[str, Any]]:
        if self.codes:
            return [{"code": c, "name": _name(c), "targets": [t for t in self.codes if t != c]} for c in self.codes]
        if not self.known:
            return []
        return [{"code": self.source, "name": NAMES.get(self.source, self.source), "targets": [self.target]},
                {"code": self.target, "name": NAMES.get(self.target, self.target), "targets": []}]

    def check(self, source: str, target: str) -> None:
        """A LibreTranslate 400 unless the pair is this model's (a multilingual model's: two of its languages)."""
        if self.codes:
            if source != "auto":
                self._code(source)
            self._code(target)
            return
        if not self.known:
            return
        if source not in ("auto", self.source):
            raise _Refused(f"{source} is not supported")
        if target != self.target:
            raise _Refused(f"{target} is not supported")

    def options(self, source: str, target: str) -> dict[str, Any]:
        """The decoding options translating `source` into `target` takes: a multilingual model's source_lang
        (none for "auto": the model's default) and target_lang; a one-pair model's, none."""
        if not self.codes:
            return {}
        options = {"target_lang": self._code(target)}
        if source != "auto":
            options["source_lang"] = self._code(source)
        return options

    def _code(self, code: str) -> str:
        """The model's spelling of `code` (its own, or the ISO 639-1 code of one: "fr" for fra_Latn, __fr__ or
        fr_XX); a LibreTranslate 400 where it has no such language."""
        if code in self.codes:
            return code
        matches = [c for c in self.codes if c.split("_")[0] == code or c.strip("_") == code or NLLB.get(code) == c]
        if len(matches) != 1:
            raise _Refused(f"{code} is not supported")
        return matches[0]


def _name(code: str) -> str:
    """A language's English name where it is one of NAMES (in any model's spelling of its code), else its code."""
    iso = next((k for k, v in NLLB.items() if v == code), code.strip("_").split("_")[0])
    return NAMES.get(iso, code)


class _Refused(Exception):
    """A request LibreTranslate's API answers {"error": message} with `status`."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


async def translate(app, scope, receive, send) -> None:
    """POST /translate (`app`: the transduce.serve.app.App)."""
    try:
        fields = _fields(scope, await read_body(scope, receive, app.max_body_bytes, app.read_timeout))
        if scope.get("transduce.auth") is False:  # no bearer token: LibreTranslate's api_key field, then
            key = fields.get("api_key")
            if not key:
                raise _Refused("Please contact the server operator to get an API key (send api_key or "
                               "Authorization: Bearer)", 400)
            if not app.key_matches(key):
                raise _Refused("Invalid API key", 403)
        lines, joined, options = _request(app, fields)
        waiter = Waiter()
        req = app.service.submit(lines, options, False, None, app.sink(), waiter=waiter)
    except _Refused as e:
        return await _error(app, send, str(e), e.status)
    except ServeError as e:
        return await _error(app, send, ("Slowdown: " if e.status == 429 else "") + _message(e), e.status)
    except InputError as e:
        return await _error(app, send, _message(e), 400)
    except ClientLeft:
        return
    gone = watch_disconnect(scope, receive)
    try:
        try:
            await waiter.wait(gone)
        except ClientLeft:
            return app.client_left(req)
        kind, data = waiter.events.popleft()
        if kind == "error":
            return await _error(app, send, _message(data), data.status)
        await send_json(send, 200, _answer(req, joined, fields, app.languages))
    finally:
        unwatch(gone)


def _fields(scope, body: bytes) -> dict[str, Any]:
    """The request's fields: a JSON object, or a form (the last value of each name)."""
    kind = (header(scope, b"content-type") or b"").split(b";")[0].strip().lower()
    if kind == b"application/json":
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise _Refused(f"Invalid request: the body is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise _Refused("Invalid request: the body must be a JSON object")
        deep = too_deep(obj)
        if deep is not None:
            raise _Refused(f"Invalid request: {deep} nests lists or objects more than {MAX_FIELD_DEPTH} deep")
        return obj
    if kind in (b"application/x-www-form-urlencoded", b""):
        try:
            # its %-escapes decoded strictly too: %ff is no character, not U+FFFD translated as one
            form = parse_qs(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False, errors="strict")
        except UnicodeDecodeError:
            raise _Refused("Invalid request: the form is not UTF-8") from None
        return {k: v[-1] for k, v in form.items()}
    if kind == b"multipart/form-data":
        return _multipart(header(scope, b"content-type"), body)
    raise _Refused(f"Invalid request: a body of {kind.decode('latin-1')} is not taken here; send JSON, "
                   "application/x-www-form-urlencoded or multipart/form-data")


def _multipart(content_type: bytes, body: bytes) -> dict[str, Any]:
    """A multipart/form-data body's text fields (the last value of each name), as a browser's FormData sends
    them; a file part is refused (files are not translated here)."""
    import email.parser
    import email.policy

    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type + b"\r\n\r\n" + body)
    if not message.is_multipart() or not message.get_boundary():
        raise _Refused("Invalid request: a multipart/form-data body needs its boundary in the Content-Type")
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            raise _Refused("Invalid request: a part of the form has no name (Content-Disposition: form-data; "
                           'name="q")')
        if part.get_filename() is not None:
            raise _Refused(f"Invalid request: {name} is a file; files are not translated here, send its text as q")
        payload = part.get_payload(decode=True)
        if not isinstance(payload, bytes):  # a part that is itself multipart: not a text field
            raise _Refused(f"Invalid request: the form's {name} is not a text field")
        try:
            fields[str(name)] = payload.decode(part.get_content_charset() or "utf-8")
        except (UnicodeDecodeError, LookupError):
            raise _Refused(f"Invalid request: the form's {name} is not UTF-8 (nor the charset it names)") from None
    return fields


def _request(app, fields: dict[str, Any]) -> tuple[list[str], list[tuple[int, int]], dict[str, Any]]:
    """The sentences to translate, each q's span of them, and the decoding options; _Refused otherwise."""
    q, source, target = fields.get("q"), fields.get("source"), fields.get("target")
    for name, value in (("q", q), ("source", source), ("target", target)):
        if not value:
            raise _Refused(f"Invalid request: missing {name} parameter")
    fmt = fields.get("format") or "text"
    if fmt == "html":
        raise _Refused("html format is not supported by this server: send format \"text\"")
    if fmt != "text":
        raise _Refused(f"{fmt} format is not supported")
    if not isinstance(source, str) or not isinstance(target, str):
        raise _Refused("Invalid request: source and target must be language codes")
    app.languages.check(source, target)
    texts = q if isinstance(q, list) else [q]
    if not all(isinstance(t, str) for t in texts):
        raise _Refused("Invalid request: q must be a string or a list of strings")
    lines, spans = [], []
    for t in texts:  # its lines at "\n" (and "\r\n") only: blank ones kept, a trailing newline too
        split = [line.removesuffix("\r") for line in t.split("\n")]
        spans.append((len(lines), len(lines) + len(split)))
        lines.extend(split)
    options = dict(app.languages.options(source, target))
    alternatives = fields.get("alternatives", 0)
    if isinstance(alternatives, str) and alternatives.isdigit():
        alternatives = int(alternatives)
    if isinstance(alternatives, bool) or not isinstance(alternatives, int) or alternatives < 0:
        raise _Refused(f"Invalid request: alternatives must be a whole number >= 0, got {alternatives!r}")
    if alternatives:
        beam = max(app.service.defaults.beam_size, alternatives + 1)
        options.update(beam_size=beam, nbest=alternatives + 1)
    return lines, spans, options


def _answer(req, spans: list[tuple[int, int]], fields: dict[str, Any], languages: Languages) -> dict[str, Any]:
    ts = req.translations
    texts = ["\n".join(ts[i].text for i in range(a, b)) for a, b in spans]
    out: dict[str, Any] = {"translatedText": texts if isinstance(fields["q"], list) else texts[0]}
    if req.options.nbest > 1:
        alts = []
        for a, b in spans:  # a q of one line has its n-best; of several, each line's k-th joined
            k = min(len(ts[i].nbest) for i in range(a, b))
            alts.append(["\n".join(ts[i].nbest[j].text for i in range(a, b)) for j in range(1, k)])
        out["alternatives"] = alts if isinstance(fields["q"], list) else alts[0]
    source = languages.source if languages.known else req.options.source_lang  # a multilingual model's default
    if fields.get("source") == "auto" and source:  # no detection: the model's (default) source language
        detected = {"confidence": 100.0, "language": source}
        out["detectedLanguage"] = [detected] * len(spans) if isinstance(fields["q"], list) else detected
    return out


def _message(e: TransduceError) -> str:
    msg = str(e.args[0]) if e.args else type(e).__name__
    return f"{msg} ({e.hint})" if e.hint else msg


async def _error(app, send, message: str, status: int) -> None:
    if app.metrics and 400 <= status < 500 and status != 429:
        app.metrics.bad.inc()
    await send_json(send, status, {"error": message})
