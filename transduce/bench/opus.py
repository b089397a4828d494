"""The opus-mt size: an OPUS-MT-shaped MarianMTModel built locally with seeded random weights, saved with
save_pretrained as a Hugging Face directory, imported with transduce's Marian importer, and converted for
CTranslate2 by CTranslate2's own converter (TransformersConverter) from that same Hugging Face directory.

Its tokenizer: a small SentencePiece unigram model learnt on the demo corpus (source.spm = target.spm), its
pieces in vocab.json followed by placeholder pieces up to the vocabulary size (never produced by the
SentencePiece model, so only the timings' random ids reach them), then Marian's <pad> last. Needs the
`import` extra (transformers, sentencepiece).
"""

from __future__ import annotations

import json
import os
from typing import Any

from transduce.errors import TransduceError

# OPUS-MT's shape (opus-mt-en-de: 6+6 layers, d_model 512, 8 heads, d_ff 2048, swish, 58,101 entries)
OPUS_SHAPE = dict(d_model=512, encoder_layers=6, decoder_layers=6, heads=8, d_ff=2048, vocab_size=58101)
SPM_VOCAB = 1000  # the SentencePiece model's own pieces; the rest of the vocabulary is placeholders
MADE_FILE = "transduce_bench.json"  # written last into each cached directory: what the bench made there
HF_CT2_SUPPRESS: list[list[str]] = []  # CTranslate2's converter drops Marian's pad row: nothing left to ban


def _train_spm(directory: str, vocab_size: int) -> str:
    import sentencepiece as spm

    from transduce.models.corpus import demo_corpus

    train, _ = demo_corpus(n_train=3000, n_valid=10, seed=1234)
    text = os.path.join(directory, "spm.txt")
    with open(text, "w", encoding="utf-8") as f:
        f.write("\n".join(s for pair in train for s in pair) + "\n")
    prefix = os.path.join(directory, "spm")
    spm.SentencePieceTrainer.train(input=text, model_prefix=prefix, vocab_size=vocab_size, model_type="unigram",
                                   character_coverage=1.0, pad_id=-1, bos_id=-1, eos_id=1, unk_id=0,
                                   unk_piece="<unk>", eos_piece="</s>", minloglevel=2, hard_vocab_limit=False)
    os.remove(text)
    return prefix + ".model"


def build_marian_dir(directory: str, shape: dict[str, int] | None = None, seed: int = 0,
                     spm_vocab: int = SPM_VOCAB) -> str:
    """A MarianMTModel directory of `shape` (OPUS_SHAPE's keys; OPUS_SHAPE by default) with seeded random weights,
    laid out as OPUS-MT's: config.json, model.safetensors, source.spm, target.spm, vocab.json (</s>=0, <unk>=1,
    the pieces, placeholders, <pad> last), tokenizer_config.json."""
    import shutil

    import sentencepiece as spm
    import torch
    from transformers import MarianConfig, MarianMTModel

    s = {**OPUS_SHAPE, **(shape or {})}
    os.makedirs(directory, exist_ok=True)
    model_file = _train_spm(directory, spm_vocab)
    for name in ("source.spm", "target.spm"):
        shutil.copy(model_file, os.path.join(directory, name))
    for ext in (".model", ".vocab"):
        os.remove(os.path.splitext(model_file)[0] + ext)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(directory, "source.spm"))
    pieces = ["</s>", "<unk>"] + [sp.id_to_piece(i) for i in range(sp.get_piece_size())
                                  if sp.id_to_piece(i) not in ("</s>", "<unk>")]
    if len(pieces) + 1 > s["vocab_size"]:
        raise TransduceError(f"a vocabulary of {s['vocab_size']} cannot hold the {len(pieces)} SentencePiece pieces "
                             "and <pad>", hint="give a larger vocab_size or a smaller spm_vocab")
    pieces += [f"<placeholder_{i}>" for i in range(s["vocab_size"] - 1 - len(pieces))]
    vocab = {p: i for i, p in enumerate(pieces + ["<pad>"])}
    with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    pad = len(vocab) - 1
    cfg = MarianConfig(vocab_size=len(vocab), d_model=s["d_model"], encoder_layers=s["encoder_layers"],
                       decoder_layers=s["decoder_layers"], encoder_attention_heads=s["heads"],
                       decoder_attention_heads=s["heads"], encoder_ffn_dim=s["d_ff"], decoder_ffn_dim=s["d_ff"],
                       activation_function="swish", scale_embedding=True, max_position_embeddings=512,
                       pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=None,
                       bad_words_ids=[[pad]])
    torch.manual_seed(seed)
    model = MarianMTModel(cfg).eval()
    with torch.no_grad():  # HF's N(0, 0.02) gives near-flat logits (ties would make the token check arbitrary)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 2.0 / s["d_model"] ** 0.5)
        model.final_logits_bias.normal_(0.0, 0.5)
        # CTranslate2's converter drops the pad row; with its logit at -1e4 its probability is 0 in fp32, so
        # both normalize over the same tokens and the log-probs can be compared exactly
        model.final_logits_bias[0, pad] = -1e4
        model.model.shared.weight[pad] = 0.0  # Marian's pad row is zeros
    model.save_pretrained(directory)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"separate_vocabs": False, "source_lang": "en", "target_lang": "de"}, f)
    return directory


def _made(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, MADE_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _mark(path: str, record: dict[str, Any]) -> None:
    with open(os.path.join(path, MADE_FILE), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)


def ensure_opus_model(root: str, shape: dict[str, int] | None = None, log=print) -> tuple[str, str]:
    """root/hf (the Hugging Face directory) and root/model (its import), made once and reused while each is
    complete and of this shape -> (hf_dir, model_dir). Under root's lock."""
    import shutil

    from transduce.formats.model_dir import verify_model_dir, weights_sha256
    from transduce.importers import import_model
    from transduce.io.locks import output_lock

    s = {**OPUS_SHAPE, **(shape or {})}
    hf, model = os.path.join(root, "hf"), os.path.join(root, "model")
    os.makedirs(root, exist_ok=True)
    with output_lock(os.path.join(root, "hf-model"), "the bench's opus-mt model"):
        if (_made(hf) or {}).get("shape") != s:
            log(f"building a random MarianMTModel {s} in {hf}")
            shutil.rmtree(hf, ignore_errors=True)
            build_marian_dir(hf, s)
            _mark(hf, {"shape": s, "note": "made by transduce bench"})
        made = _made(model) if os.path.isdir(model) else None
        try:
            current = made is not None and made.get("shape") == s and verify_model_dir(model) is not None \
                and made.get("weights_sha256") == weights_sha256(model)
        except TransduceError:
            current = False
        if not current:
            log(f"importing {hf} into {model} (transduce import marian)")
            if os.path.exists(model) and made is None:
                raise TransduceError(f"{model} holds something the bench did not make; it does not replace it",
                                     hint="choose another --cache-dir, or move that directory away")
            shutil.rmtree(model, ignore_errors=True)
            import_model("marian", hf, model)
            _mark(model, {"shape": s, "weights_sha256": weights_sha256(model)})
    return hf, model


def convert_hf_to_ctranslate2(hf_dir: str, out_dir: str) -> str:
    """CTranslate2's own converter (TransformersConverter, fp32) on the Hugging Face directory, into out_dir
    atomically; reused while the Hugging Face weights are the same. Records what the bench's checks need
    (ctranslate2.convert.SOURCE_FILE): the tokens to suppress (none: the converter drops the pad row).

    One setting of its config.json is changed: add_source_eos true. The converter leaves appending </s> to
    MarianTokenizer; the bench hands CTranslate2 sources without it (as to every conversion), so CTranslate2
    appends it, which gives it the same source the tokenizer would."""
    import hashlib

    from transduce.bench.ctranslate2.convert import SOURCE_FILE, import_ctranslate2
    from transduce.io.atomic import atomic_directory
    from transduce.io.locks import output_lock

    with open(os.path.join(hf_dir, "model.safetensors"), "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    with output_lock(out_dir, "the CTranslate2 conversion"):
        try:
            with open(os.path.join(out_dir, SOURCE_FILE), encoding="utf-8") as f:
                if json.load(f).get("hf_weights_sha256") == sha and os.path.isfile(os.path.join(out_dir,
                                                                                                "model.bin")):
                    return out_dir
        except (OSError, ValueError):
            pass
        ct2 = import_ctranslate2()
        from ctranslate2.converters import TransformersConverter

        with atomic_directory(out_dir) as tmp:
            TransformersConverter(hf_dir).convert(tmp, quantization="float32", force=True)
            with open(os.path.join(tmp, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
            config["add_source_eos"] = True
            with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2)
            with open(os.path.join(tmp, SOURCE_FILE), "w", encoding="utf-8") as f:
                json.dump({"hf_dir": os.path.abspath(hf_dir), "hf_weights_sha256": sha,
                           "converter": "ctranslate2.converters.TransformersConverter",
                           "ctranslate2": ct2.__version__, "suppress": HF_CT2_SUPPRESS,
                           "config_changed": {"add_source_eos": True}}, f, indent=2)
    return out_dir
