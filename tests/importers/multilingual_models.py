"""Tiny multilingual Hugging Face models built locally (no model hub): NLLB-200, M2M100 and mBART-50 directories with
a SentencePiece model trained on the demo corpus, their tokenizers saved as transformers saves them, and tiny
models trained briefly in both directions (English <-> French, the language codes in source and target as the
tokenizers place them), so that their outputs depend on the target language and are not degenerate."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from hf_models import demo_sentences

SHAPE = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
             activation_dropout=0.0)
LANGS = {"nllb": ("eng_Latn", "fra_Latn"), "m2m100": ("en", "fr"), "mbart": ("en_XX", "fr_XX")}


def train_bpe_spm(directory: str, sentences: list[str], vocab_size: int = 120, model_type: str = "bpe") -> str:
    """A SentencePiece model with <unk>=0, <s>=1, </s>=2 as directory/sentencepiece.bpe.model: BPE as NLLB's and
    M2M100's, or unigram as mBART's (XLM-R's model, despite its file name; Hugging Face's MBart50Tokenizer reads
    it as a Unigram model, which segments a BPE model's text otherwise)."""
    import sentencepiece as spm

    text = os.path.join(directory, "spm.txt")
    with open(text, "w", encoding="utf-8") as f:
        f.write("\n".join(sentences) + "\n")
    prefix = os.path.join(directory, "sentencepiece.bpe")
    spm.SentencePieceTrainer.train(input=text, model_prefix=prefix, vocab_size=vocab_size, model_type=model_type,
                                   character_coverage=1.0, pad_id=-1, bos_id=1, eos_id=2, unk_id=0, minloglevel=2)
    os.remove(text)
    return prefix + ".model"


def hf_tokenizer(family: str, directory: str):
    """The family's Hugging Face tokenizer of `directory` (as from_pretrained makes it)."""
    from transformers import M2M100Tokenizer, MBart50Tokenizer, NllbTokenizer

    cls = {"nllb": NllbTokenizer, "m2m100": M2M100Tokenizer, "mbart": MBart50Tokenizer}[family]
    return cls.from_pretrained(directory, src_lang=LANGS[family][0])


def _new_tokenizer(family: str, directory: str):
    """The family's tokenizer built from the SentencePiece model (and M2M100's vocab.json), saved beside it."""
    import sentencepiece as spm
    from transformers import M2M100Tokenizer, MBart50Tokenizer, NllbTokenizer
    from transformers.models.mbart50.tokenization_mbart50 import FAIRSEQ_LANGUAGE_CODES as MBART_CODES
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES as NLLB_CODES

    src = LANGS[family][0]
    if family == "m2m100":
        sp = spm.SentencePieceProcessor(model_file=os.path.join(directory, "sentencepiece.bpe.model"))
        pieces = ["<s>", "<pad>", "</s>", "<unk>"] + [sp.id_to_piece(i) for i in range(3, sp.get_piece_size())]
        with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump({p: i for i, p in enumerate(pieces)}, f, ensure_ascii=False)
        tok = M2M100Tokenizer(vocab_file=os.path.join(directory, "vocab.json"),
                              spm_file=os.path.join(directory, "sentencepiece.bpe.model"), src_lang=src)
    elif family == "nllb":
        tok = NllbTokenizer.from_pretrained(directory, src_lang=src, extra_special_tokens=NLLB_CODES)
    else:
        tok = MBart50Tokenizer.from_pretrained(directory, src_lang=src, extra_special_tokens=MBART_CODES)
    keep = os.path.join(directory, "sentencepiece.bpe.model")
    shutil.copy(keep, keep + ".orig")
    tok.save_pretrained(directory)
    shutil.move(keep + ".orig", keep)  # the hub's directories keep the SentencePiece model as it was
    return hf_tokenizer(family, directory)


def _batches(tok, family: str, pairs: list[tuple[str, str]], size: int, seed: int):
    """(input_ids, attention_mask, labels) batches of both directions, languages tagged as the tokenizer does."""
    en, fr = LANGS[family]
    examples = []
    for s, t in pairs:
        for (a, la), (b, lb) in (((s, en), (t, fr)), ((t, fr), (s, en))):
            tok.src_lang, tok.tgt_lang = la, lb
            enc = tok(a, text_target=b)
            examples.append((enc["input_ids"], enc["labels"]))
    g = torch.Generator().manual_seed(seed)
    while True:
        for _ in range(0, len(examples), size):
            order = torch.randperm(len(examples), generator=g).tolist()
            chunk = [examples[i] for i in order[:size]]
            width = max(len(x) for x, _ in chunk)
            lwidth = max(len(y) for _, y in chunk)
            ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x, _ in chunk])
            labels = torch.tensor([y + [-100] * (lwidth - len(y)) for _, y in chunk])
            yield ids, (ids != tok.pad_token_id).long(), labels


def _shared(name: str, tmp_path_factory, make) -> Path:
    """A directory of the run's shared directory made once per test run by make(directory): the modules and
    pytest-xdist workers that ask for it share it, and only read it."""
    import fcntl

    import background  # tests/background.py (tests/ is on sys.path, as for every conftest here)

    directory = Path(background.run_dir(tmp_path_factory)) / name
    with open(f"{directory}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second asker waits for the first's build
        if not (directory / "built").exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
            make(directory)
            (directory / "built").touch()
    return directory


def shared_build(family: str, tmp_path_factory) -> str:
    """build()'s directory for `family`, made once per test run (it takes ~10 s of a core to train)."""
    return str(_shared(f"multilingual-{family}", tmp_path_factory, lambda d: build(family, str(d / "hf"))) / "hf")


def shared_export(family: str, tmp_path_factory) -> tuple[str, str]:
    """(the imported model directory, its ONNX artifact) of shared_build's `family`, made once per test run (an
    export takes ~20 s of a core)."""
    def make(directory: Path) -> None:
        from transduce.exporter.onnx_export import export_artifact
        from transduce.importers import import_model

        model = import_model(family, shared_build(family, tmp_path_factory), directory / "model")
        export_artifact(model, directory / "artifact")

    directory = _shared(f"multilingual-{family}-onnx", tmp_path_factory, make)
    return str(directory / "model"), str(directory / "artifact")


def build(family: str, directory: str, seed: int = 3, steps: int = 300) -> str:
    """A trained tiny model directory of `family` ("nllb", "m2m100", "mbart") as the hub's look."""
    from transformers import M2M100Config, M2M100ForConditionalGeneration, MBartConfig, MBartForConditionalGeneration

    os.makedirs(directory, exist_ok=True)
    pairs = demo_sentences(300, seed=11)
    if family == "mbart":  # a unigram model of this corpus has at most ~110 pieces
        train_bpe_spm(directory, [s for p in pairs for s in p], vocab_size=100, model_type="unigram")
    else:
        train_bpe_spm(directory, [s for p in pairs for s in p])
    tok = _new_tokenizer(family, directory)
    if family == "m2m100":  # its language codes and 8 "madeupword" rows follow vocab.json, as fairseq's dictionary
        vocab = tok.encoder_size + len(tok.lang_code_to_id) + 8
    else:
        vocab = max(len(tok), max(tok.get_vocab().values()) + 1)
    ids = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    torch.manual_seed(seed)
    if family == "mbart":
        cfg = MBartConfig(vocab_size=vocab, scale_embedding=True, activation_function="gelu", **ids, **SHAPE)
        model = MBartForConditionalGeneration(cfg)
    else:
        cfg = M2M100Config(vocab_size=vocab, scale_embedding=True, activation_function="relu", **ids, **SHAPE)
        model = M2M100ForConditionalGeneration(cfg)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for _, (x, mask, labels) in zip(range(steps), _batches(tok, family, pairs, 16, seed)):
        loss = model(input_ids=x, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().save_pretrained(directory)
    return directory
