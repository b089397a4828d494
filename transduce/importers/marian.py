"""Marian / OPUS-MT models in Hugging Face's format (MarianMTModel): config.json, model.safetensors or
pytorch_model.bin, source.spm, target.spm, vocab.json (target_vocab.json with separate vocabularies).

What the reference model takes from them (CTranslate2's transformers converter does the same):
post-norm layers; the activation of config.json (swish for OPUS-MT); sinusoidal positions as [sin | cos]
halves with the paper's frequencies, from position 0 (HF computes them and does not store them); the
embedding scale of `scale_embedding`; `final_logits_bias` as the projection's bias; decoding starts from
`decoder_start_token_id` (pad). Marian's pad is the vocabulary's last row, an ordinary row here (CTranslate2
drops it; keeping it keeps the log-probs HF's): decoding never generates it, as OPUS-MT's bad_words_ids says.
"""

from __future__ import annotations

import os
from typing import Any

from transduce.errors import ImportCheckpointError
from transduce.formats.model_config import ModelConfig
from transduce.importers import common
from transduce.importers.checkpoints import read_tensors, refuse_extra, take

# BART-family config fields the reference model cannot honour, and the values it refuses
UNSUPPORTED = {"normalize_before": True, "add_final_layer_norm": True, "normalize_embedding": True,
               "layernorm_embedding": True, "static_position_embeddings": False, "add_bias_logits": True}


def model_config(hf: dict[str, Any], unk_id: int, source: str) -> ModelConfig:
    """The ModelConfig of a MarianConfig (config.json as a dict)."""
    if hf.get("model_type") != "marian":
        raise ImportCheckpointError(f"{source}: model_type is {hf.get('model_type')!r}, not 'marian'")
    common.refuse(hf, source, UNSUPPORTED)
    common.require_equal(hf, source, ("encoder_attention_heads", "decoder_attention_heads"),
                         ("encoder_ffn_dim", "decoder_ffn_dim"))
    f = common.field
    shared = f(hf, "share_encoder_decoder_embeddings", source, bool, True)
    vocab = f(hf, "vocab_size", source)
    tgt_vocab = vocab if shared else (f(hf, "decoder_vocab_size", source, int, None) or vocab)
    pad = f(hf, "pad_token_id", source)
    tied = f(hf, "tie_word_embeddings", source, bool, True)  # the projection is the (target) embedding
    return ModelConfig(
        vocab_size=tgt_vocab, src_vocab_size=0 if shared else vocab, encoder_layers=f(hf, "encoder_layers", source),
        decoder_layers=f(hf, "decoder_layers", source), d_model=f(hf, "d_model", source),
        n_heads=f(hf, "encoder_attention_heads", source), d_ff=f(hf, "encoder_ffn_dim", source),
        dropout=float(f(hf, "dropout", source, float, 0.1)),
        max_positions=f(hf, "max_position_embeddings", source, int, 1024), share_embeddings=shared,
        tie_output=not shared and tied, untied_output=shared and not tied,
        pad_id=pad, bos_id=f(hf, "decoder_start_token_id", source, int, pad),
        eos_id=f(hf, "eos_token_id", source), unk_id=unk_id,
        activation=common.activation(hf.get("activation_function", "gelu"), "activation_function", source),
        position_layout="halves", scale_embedding=bool(hf.get("scale_embedding", False)), final_logits_bias=True)


def weights(tensors: dict, cfg: ModelConfig, source: str) -> dict[str, Any]:
    """Our weights from a MarianMTModel state dict; every tensor used, checked by name and shape."""
    d, v = cfg.d_model, cfg.vocab_size
    out = {}
    if cfg.share_embeddings:
        names = ["model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"]
        tied = [] if cfg.untied_output else ["lm_head.weight"]
        why = "share_encoder_decoder_embeddings ties" if cfg.untied_output else \
            "share_encoder_decoder_embeddings and tie_word_embeddings tie"
        out["embed.weight"] = common.tied_embedding(tensors, names + tied, (v, d), source,
                                                    f"config.json's {why} them")
        if cfg.untied_output:
            out["out_proj.weight"] = take(tensors, "lm_head.weight", (v, d), source)
    else:
        out["src_embed.weight"] = take(tensors, "model.encoder.embed_tokens.weight", (cfg.source_vocab_size, d),
                                       source)
        tied = ["lm_head.weight"] if cfg.tie_output else []
        names = ["model.decoder.embed_tokens.weight", *tied]
        out["embed.weight"] = common.tied_embedding(tensors, names, (v, d), source,
                                                    "config.json's tie_word_embeddings ties them")
        if not cfg.tie_output:
            out["out_proj.weight"] = take(tensors, "lm_head.weight", (v, d), source)
    if "final_logits_bias" in tensors:
        out["final_logits_bias"] = take(tensors, "final_logits_bias", (1, v), source)[0]
    else:  # HF leaves it at zeros when a checkpoint lacks it
        import torch

        out["final_logits_bias"] = torch.zeros(v)
    out.update(common.map_layers(tensors, cfg, {"encoder": "model.encoder.layers", "decoder": "model.decoder.layers"},
                                 source))
    for stack in ("encoder", "decoder"):
        common.check_positions(tensors, f"model.{stack}.embed_positions.weight", cfg, 0, source)
    refuse_extra(tensors, source)
    return out


def tokenizer(src: str, cfg: ModelConfig, separate: bool):
    """The PairTokenizer of a Marian directory: SentencePiece segmentation, ids from vocab.json. Target text is
    decoded with source.spm unless the vocabularies are separate (what MarianTokenizer.decode does)."""
    from transduce.models.pair_tokenizer import PairTokenizer

    vpath = os.path.join(src, "vocab.json")
    source_vocab = common.vocab_list(common.read_json(vpath), vpath)
    tpath = os.path.join(src, "target_vocab.json")
    target_vocab = common.vocab_list(common.read_json(tpath), tpath) if separate else source_vocab
    for what, vocab, size in (("source", source_vocab, cfg.source_vocab_size), ("target", target_vocab,
                                                                                  cfg.vocab_size)):
        if len(vocab) != size:
            raise ImportCheckpointError(f"{src}: the {what} vocabulary has {len(vocab)} entries, the model "
                                        f"{size}")
    for name, i in (("</s>", cfg.eos_id), ("<pad>", cfg.pad_id)):
        if target_vocab[i] != name:
            raise ImportCheckpointError(f"{src}: id {i} is {target_vocab[i]!r} in the vocabulary, the config says "
                                        f"{name}")
    models = {}
    for name in ("source.spm", "target.spm"):
        path = os.path.join(src, name)
        if not os.path.isfile(path):
            raise ImportCheckpointError(f"{path} is missing", hint="a Marian directory has source.spm and target.spm")
        with open(path, "rb") as f:
            models[name] = f.read()
    codes = any(p.startswith(">>") and p.endswith("<<") for p in source_vocab)
    specials = {"pad_id": cfg.pad_id, "bos_id": cfg.bos_id, "eos_id": cfg.eos_id, "unk_id": cfg.unk_id}
    return PairTokenizer.build(
        "marian", specials,
        PairTokenizer.side("sentencepiece", source_vocab, model=models["source.spm"], language_codes=codes),
        PairTokenizer.side("sentencepiece", target_vocab, model=models["target.spm" if separate else "source.spm"]))


def convert(src: str) -> tuple[ModelConfig, dict[str, Any], Any, dict[str, Any]]:
    """(model config, weights, tokenizer, what was imported) of a Marian directory."""
    hf = common.read_object(os.path.join(src, "config.json"))
    if hf.get("model_type") != "marian":  # before the files of a Marian directory are looked for
        model_config(hf, 0, os.path.join(src, "config.json"))
    vocab = common.read_object(os.path.join(src, "vocab.json"))
    if not isinstance(vocab.get("<unk>"), int):
        raise ImportCheckpointError(f"{os.path.join(src, 'vocab.json')} has no <unk>")
    cfg = model_config(hf, vocab["<unk>"], os.path.join(src, "config.json"))
    tensors = read_tensors(src)
    w = weights(tensors, cfg, src)
    tok_cfg = os.path.join(src, "tokenizer_config.json")
    if os.path.isfile(tok_cfg):
        separate = bool(common.read_json(tok_cfg).get("separate_vocabs"))
    else:
        separate = not cfg.share_embeddings
    tok = tokenizer(src, cfg, separate)
    return cfg, w, tok, {"family": "marian", "source": os.path.abspath(src)}
