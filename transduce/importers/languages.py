"""What the multilingual families (M2M100, NLLB-200, mBART-50) share: a SentencePiece model whose ids are
fairseq's (<s>=0, <pad>=1, </s>=2, <unk>=3, then SentencePiece's pieces from its id 3 on, one higher), and the
language-code tokens after the pieces, read from the directory's tokenizer files as Hugging Face's tokenizers
place them."""

from __future__ import annotations

import json
import os
from typing import Any

from transduce.errors import ImportCheckpointError
from transduce.importers import common

FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
# added tokens that are not language codes
NOT_CODES = {"<s>", "<pad>", "</s>", "<unk>", "<mask>"}
# M2M100's language lists by its tokenizer_config.json's language_codes (its tokenizer has them built in and
# numbers them from the end of vocab.json; a saved tokenizer need not list them)
M2M100_CODES = {
    "m2m100": ("af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu ha he hi "
               "hr ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr ms my ne nl no ns oc "
               "or pa pl ps pt ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk ur uz vi wo xh yi yo zh "
               "zu").split(),
    "wmt21": "en ha is ja cs ru zh de".split(),
}


def read_spm(src: str, name: str = "sentencepiece.bpe.model") -> tuple[bytes, Any]:
    """(the serialized model, a SentencePieceProcessor) of the directory's SentencePiece model."""
    try:
        import sentencepiece
    except ImportError:
        raise ImportCheckpointError("importing this model needs the sentencepiece package",
                                    hint="pip install 'transduce[import]'") from None
    path = os.path.join(src, name)
    if not os.path.isfile(path):
        raise ImportCheckpointError(f"{path} is missing", hint=f"the model's directory has its tokenizer's {name}")
    with open(path, "rb") as f:
        data = f.read()
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(data)
    except RuntimeError as e:
        raise ImportCheckpointError(f"{path} is not a SentencePiece model ({e})") from None
    return data, sp


def fairseq_vocab(sp) -> list[str]:
    """id -> piece as fairseq (and Hugging Face's NLLB and mBART-50 tokenizers) number a SentencePiece model:
    the four specials, then SentencePiece's piece i at i + 1 for i >= 3 (its own <unk>, <s>, </s> are 0..2)."""
    return list(FAIRSEQ_SPECIALS) + [sp.id_to_piece(i) for i in range(3, sp.get_piece_size())]


def _json_if_any(path: str) -> Any:
    return common.read_json(path) if os.path.isfile(path) else {}


def _content(token: Any) -> str | None:
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    return None


def added_tokens(src: str) -> dict[str, int]:
    """{token: id} of the tokens a Hugging Face tokenizer added to its model's (tokenizer.json's added_tokens,
    tokenizer_config.json's added_tokens_decoder)."""
    found: dict[str, int] = {}
    tok_json = os.path.join(src, "tokenizer.json")
    if os.path.isfile(tok_json):
        try:
            with open(tok_json, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ImportCheckpointError(f"{tok_json} cannot be read as JSON ({e})") from None
        for t in data.get("added_tokens") or []:
            if isinstance(t, dict) and isinstance(t.get("id"), int) and _content(t):
                found[_content(t)] = t["id"]
    decoder = tokenizer_config(src).get("added_tokens_decoder") or {}
    for i, t in decoder.items():
        if _content(t) and str(i).isdigit():
            found.setdefault(_content(t), int(i))
    return found


def code_tokens(src: str) -> list[str]:
    """The language-code tokens the tokenizer files list, in their order (extra or additional special tokens)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg = _json_if_any(os.path.join(src, name))
        if not isinstance(cfg, dict):
            continue
        for key in ("extra_special_tokens", "additional_special_tokens"):
            tokens = [_content(t) for t in cfg.get(key) or []]
            tokens = [t for t in tokens if t and t not in NOT_CODES]
            if tokens:
                return tokens
    return []


def language_ids(src: str, first_id: int, vocab_size: int, code_of=lambda token: token,
                 known: list[str] | None = None, use_added: bool = True) -> dict[str, int]:
    """{language code: token id}: each listed code token's id as the tokenizer files give it (use_added), else
    first_id + its place in the list, as the tokenizers number them; the list is the files' (else `known`, else
    their added tokens); code_of turns a token into the code users name it by."""
    added = added_tokens(src) if use_added else {}
    tokens = code_tokens(src) or known or [t for t in sorted(added, key=added.get)
                                           if t not in NOT_CODES and not t.startswith("madeupword")]
    if not tokens:
        raise ImportCheckpointError(f"{src}: the tokenizer files list no language codes",
                                    hint="a multilingual model's directory has tokenizer_config.json or "
                                         "special_tokens_map.json with its language codes")
    codes = {code_of(t): added.get(t, first_id + i) for i, t in enumerate(tokens)}
    bad = {c: i for c, i in codes.items() if not 0 <= i < vocab_size}
    if bad:
        code, i = next(iter(bad.items()))
        raise ImportCheckpointError(f"{src}: language code {code} has id {i}, outside the model's vocabulary "
                                    f"({vocab_size})")
    return codes


def padded_vocab(vocab: list[str], codes: dict[str, int], tokens_of: dict[str, str], size: int,
                 extra: dict[str, int], source: str) -> list[str]:
    """The id -> piece list of the whole embedding: the pieces, the language codes' tokens at their ids, `extra`
    tokens ({token: id}, e.g. <mask>) and "<unused_N>" rows up to `size` (the model's rows past its tokenizer's)."""
    out = list(vocab) + [None] * max(0, size - len(vocab))
    if len(out) > size:
        raise ImportCheckpointError(f"{source}: the tokenizer has {len(vocab)} pieces, the model only {size} rows")
    for token, i in [(tokens_of[c], i) for c, i in codes.items()] + list(extra.items()):
        if i < len(vocab):
            raise ImportCheckpointError(f"{source}: the token {token} has id {i}, which is the SentencePiece piece "
                                        f"{vocab[i]!r}")
        out[i] = token
    return [p if p is not None else f"<unused_{i}>" for i, p in enumerate(out)]


def defaults(src: str, hf: dict[str, Any], codes: dict[str, int], default_source: str) -> dict[str, Any]:
    """The tokenizer pair's "languages": the codes, the default source (the tokenizer's src_lang, else
    `default_source` as Hugging Face's tokenizer takes it) and target (the language whose code is the
    forced_bos_token_id generate forces, if any)."""
    source = tokenizer_config(src).get("src_lang") or default_source
    by_id = {i: c for c, i in codes.items()}
    forced = forced_bos(src, hf)
    return {"codes": codes, "source": source if source in codes else None,
            "target": by_id.get(forced) if isinstance(forced, int) and not isinstance(forced, bool) else None}


def forced_bos(src: str, hf: dict[str, Any]) -> Any:
    """The forced_bos_token_id Hugging Face's generate takes by default: generation_config.json's where the
    directory has one (config.json's generation keys are then not read), else config.json's."""
    path = os.path.join(src, "generation_config.json")
    if os.path.isfile(path):
        gen = common.read_json(path)
        return gen.get("forced_bos_token_id") if isinstance(gen, dict) else None
    return hf.get("forced_bos_token_id")


def tokenizer_config(src: str) -> dict[str, Any]:
    """The directory's tokenizer_config.json ({} without one)."""
    cfg = _json_if_any(os.path.join(src, "tokenizer_config.json"))
    return cfg if isinstance(cfg, dict) else {}
