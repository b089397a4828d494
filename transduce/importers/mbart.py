"""mBART-50 in Hugging Face's format (MBartForConditionalGeneration, model_type "mbart", with MBart50Tokenizer's
files): config.json, model.safetensors or pytorch_model.bin, sentencepiece.bpe.model, the tokenizer's files.

What the reference model takes from them: pre-norm layers with a final LayerNorm per stack (norm_first); gelu
(activation_function); a learned position table per stack (positions="learned": HF's embed_positions, whose first
two rows mBART never reads (its offset 2), so row p here is HF's row p + 2); a LayerNorm on embeddings + positions
in both stacks (layernorm_embedding); the embedding scale of `scale_embedding`; one embedding shared by both stacks
and the projection; final_logits_bias where it is not all zeros; decoding starts from `decoder_start_token_id`
(</s>). Tokenizer: mBART-50's, SentencePiece with fairseq's ids and the language codes (en_XX, fr_XX, ...) after
the pieces, as NLLB's: a source is [source language code] tokens </s>, and a translation is forced to begin with
its target language's code (forced_bos_token_id), which is not part of its text. mBART-cc25's tokenizer (the code
after </s>, decoding started from the code) is not this one and is refused.
"""

from __future__ import annotations

import os
from typing import Any

from transduce.errors import ImportCheckpointError
from transduce.formats.model_config import ModelConfig
from transduce.importers import common, m2m100
from transduce.importers.checkpoints import read_tensors, refuse_extra, take
from transduce.importers.languages import tokenizer_config

OFFSET = 2  # MBartLearnedPositionalEmbedding's: position p is row p + 2 of HF's table
CC25_TOKENIZERS = ("MBartTokenizer", "MBartTokenizerFast")


def model_config(hf: dict[str, Any], source: str) -> ModelConfig:
    """The ModelConfig of an MBartConfig (config.json as a dict)."""
    cfg = m2m100.pre_norm_config(hf, source, "mbart", "gelu",
                                 bos_id=hf.get("decoder_start_token_id") or hf.get("eos_token_id", 2),
                                 positions="learned", layernorm_embedding=True,
                                 scale_embedding=bool(hf.get("scale_embedding", False)))
    if hf.get("tie_word_embeddings") is False:
        raise ImportCheckpointError(f"{source}: tie_word_embeddings is false, and mBART's embedding is shared by "
                                    "both stacks and the projection", hint="import a checkpoint with tied embeddings")
    return cfg


def weights(tensors: dict, cfg: ModelConfig, source: str) -> tuple[dict[str, Any], ModelConfig]:
    """Our weights from an MBartForConditionalGeneration state dict, every tensor used, checked by name and shape;
    and the config with final_logits_bias set where the checkpoint's is not all zeros."""
    d, v = cfg.d_model, cfg.vocab_size
    out = {"embed.weight": m2m100.shared_embedding(tensors, cfg, source)}
    out.update(common.map_layers(tensors, cfg, {"encoder": "model.encoder.layers", "decoder": "model.decoder.layers"},
                                 source))
    out.update(m2m100.final_norms(tensors, cfg, source))
    for stack in ("encoder", "decoder"):
        table = take(tensors, f"model.{stack}.embed_positions.weight", (cfg.max_positions + OFFSET, d), source)
        out[f"{stack}_positions.weight"] = table[OFFSET:]
        for p in ("weight", "bias"):
            out[f"{stack}_embed_norm.{p}"] = take(tensors, f"model.{stack}.layernorm_embedding.{p}", (d,), source)
    if "final_logits_bias" in tensors:  # a buffer, zeros unless fine-tuning set it; HF adds it to the logits
        bias = take(tensors, "final_logits_bias", (1, v), source)[0]
        if bias.abs().max().item() > 0:
            out["final_logits_bias"] = bias
            cfg = cfg.replace(final_logits_bias=True)
    refuse_extra(tensors, source)
    return out, cfg


def convert(src: str) -> tuple[ModelConfig, dict[str, Any], Any, dict[str, Any]]:
    """(model config, weights, tokenizer, what was imported) of an mBART-50 directory."""
    tok_class = tokenizer_config(src).get("tokenizer_class")
    if tok_class in CC25_TOKENIZERS:
        raise ImportCheckpointError(f"{src}/tokenizer_config.json: tokenizer_class is {tok_class}, mBART-cc25's, "
                                    "which puts the language code after </s> and starts decoding from it",
                                    hint="transduce imports mBART-50 (tokenizer_class MBart50Tokenizer)")
    hf = common.read_json(os.path.join(src, "config.json"))
    cfg = model_config(hf, os.path.join(src, "config.json"))
    w, cfg = weights(read_tensors(src), cfg, src)
    return cfg, w, m2m100.tokenizer(src, cfg, "mbart", hf), {"family": "mbart", "source": os.path.abspath(src)}
