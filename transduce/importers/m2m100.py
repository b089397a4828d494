"""M2M100 and NLLB-200 in Hugging Face's format (M2M100ForConditionalGeneration, model_type "m2m_100"):
config.json, model.safetensors or pytorch_model.bin, sentencepiece.bpe.model, the tokenizer's files (M2M100 also
vocab.json).

What the reference model takes from them: pre-norm layers with a final LayerNorm per stack (norm_first); ReLU
(activation_function); fairseq's sinusoidal positions ([sin | cos] halves, frequencies exp(-i ln(10000) / (d/2 - 1)),
the first token at padding_idx + 1; computed, not stored); the embedding scale of `scale_embedding`; one embedding
shared by both stacks and the projection; decoding starts from `decoder_start_token_id` (EOS). Tokenizer:
SentencePiece with NLLB's fairseq ids (importers.languages) or M2M100's vocab.json; a source is
[source language code] tokens </s>, and a translation is forced to begin with its target language's code
(forced_bos_token_id), which is not part of its text.
"""

from __future__ import annotations

import os
from typing import Any

from transduce.errors import ImportCheckpointError
from transduce.formats.model_config import ModelConfig
from transduce.importers import common, languages
from transduce.importers.checkpoints import read_tensors, refuse_extra, take

# buffers a checkpoint may hold that are no weights: the positions' computed table, fairseq's dummy tensor
IGNORED = (r"model\.(encoder|decoder)\.embed_positions\._float_tensor",)


def model_config(hf: dict[str, Any], source: str, expected: str = "m2m_100") -> ModelConfig:
    """The ModelConfig of an M2M100Config (config.json as a dict)."""
    pad, eos = hf.get("pad_token_id", 1), hf.get("eos_token_id", 2)
    return pre_norm_config(hf, source, expected, "relu", bos_id=hf.get("decoder_start_token_id", eos),
                           position_layout="halves", position_frequencies="fairseq", position_offset=pad + 1,
                           scale_embedding=bool(hf.get("scale_embedding", True)))


def pre_norm_config(hf: dict[str, Any], source: str, model_type: str, activation: str, bos_id: int,
                    **deviations: Any) -> ModelConfig:
    """The ModelConfig of the pre-norm Hugging Face families (M2M100, NLLB, mBART: one embedding shared by both
    stacks and the projection, unk 3), checked to be `model_type` with equal encoder and decoder widths; the
    family's own deviations (its positions, embedding scale) as ModelConfig fields; `activation`: the default of
    activation_function."""
    if hf.get("model_type") != model_type:
        raise ImportCheckpointError(f"{source}: model_type is {hf.get('model_type')!r}, not {model_type!r}",
                                    hint="import it as its own family (transduce import --help lists them)")
    common.require_equal(hf, source, ("encoder_attention_heads", "decoder_attention_heads"),
                         ("encoder_ffn_dim", "decoder_ffn_dim"))
    return ModelConfig(
        vocab_size=hf["vocab_size"], encoder_layers=hf["encoder_layers"], decoder_layers=hf["decoder_layers"],
        d_model=hf["d_model"], n_heads=hf["encoder_attention_heads"], d_ff=hf["encoder_ffn_dim"],
        dropout=float(hf.get("dropout", 0.1)), max_positions=hf.get("max_position_embeddings", 1024),
        norm_first=True, share_embeddings=True, pad_id=hf.get("pad_token_id", 1), bos_id=bos_id,
        eos_id=hf.get("eos_token_id", 2), unk_id=3,
        activation=common.activation(hf.get("activation_function", activation), "activation_function", source),
        **deviations)


def shared_embedding(tensors: dict, cfg: ModelConfig, source: str):
    """The one embedding matrix, under whichever of its tied names the checkpoint stores (each copy the same)."""
    names = ["model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
             "lm_head.weight"]
    return common.tied_embedding(tensors, names, (cfg.vocab_size, cfg.d_model), source)


def final_norms(tensors: dict, cfg: ModelConfig, source: str) -> dict[str, Any]:
    """The pre-norm stacks' final LayerNorms (model.{encoder,decoder}.layer_norm)."""
    d = cfg.d_model
    return {f"{stack}_norm.{p}": take(tensors, f"model.{stack}.layer_norm.{p}", (d,), source)
            for stack in ("encoder", "decoder") for p in ("weight", "bias")}


def weights(tensors: dict, cfg: ModelConfig, source: str) -> dict[str, Any]:
    """Our weights from an M2M100ForConditionalGeneration state dict; every tensor used, checked by name and shape."""
    out = {"embed.weight": shared_embedding(tensors, cfg, source)}
    out.update(common.map_layers(tensors, cfg, {"encoder": "model.encoder.layers", "decoder": "model.decoder.layers"},
                                 source))
    out.update(final_norms(tensors, cfg, source))
    for stack in ("encoder", "decoder"):  # older checkpoints store the computed table
        common.check_positions(tensors, f"model.{stack}.embed_positions.weights", cfg, cfg.position_offset, source)
    refuse_extra(tensors, source, IGNORED)
    return out


def tokenizer(src: str, cfg: ModelConfig, family: str, hf: dict[str, Any]):
    """The PairTokenizer of an NLLB, M2M100 or mBART-50 directory (one SentencePiece side used for both directions)."""
    from transduce.models.pair_tokenizer import PairTokenizer

    model, sp = languages.read_spm(src)
    tok_cfg = languages.tokenizer_config(src)
    if family in ("nllb", "mbart"):  # mBART-50 numbers its pieces and codes as NLLB does
        if family == "nllb" and tok_cfg.get("legacy_behaviour"):
            raise ImportCheckpointError(f"{src}/tokenizer_config.json: legacy_behaviour puts the language code "
                                        "after the source's </s>, which transduce does not",
                                        hint="set legacy_behaviour to false (the tokenizer's default since 2023)")
        vocab = languages.fairseq_vocab(sp)
        codes = languages.language_ids(src, len(vocab), cfg.vocab_size)
        tokens_of = {c: c for c in codes}
        default_source = "eng_Latn" if family == "nllb" else "en_XX"
    else:
        vpath = os.path.join(src, "vocab.json")
        vocab = common.vocab_list(common.read_json(vpath), vpath)
        known = languages.M2M100_CODES.get(tok_cfg.get("language_codes", "m2m100"))
        if known is None:
            raise ImportCheckpointError(f"{src}/tokenizer_config.json: language_codes {tok_cfg['language_codes']!r} "
                                        f"is none of {', '.join(languages.M2M100_CODES)}")
        # M2M100's tokenizer numbers its codes from the end of vocab.json whatever its files say
        codes = languages.language_ids(src, len(vocab), cfg.vocab_size, code_of=lambda t: t.strip("_"),
                                       known=[f"__{c}__" for c in known], use_added=False)
        tokens_of = {c: f"__{c}__" for c in codes}
        default_source = "en"
    for name, i in (("<pad>", cfg.pad_id), ("</s>", cfg.eos_id), ("<unk>", cfg.unk_id)):
        if vocab[i] != name:
            raise ImportCheckpointError(f"{src}: id {i} is {vocab[i]!r} in the vocabulary, the config says {name}")
    added = languages.added_tokens(src)
    extra = {t: i for t, i in added.items() if t == "<mask>" or t.startswith("madeupword")}
    full = languages.padded_vocab(vocab, codes, tokens_of, cfg.vocab_size, extra, src)
    specials = {"pad_id": cfg.pad_id, "bos_id": cfg.bos_id, "eos_id": cfg.eos_id, "unk_id": cfg.unk_id}
    control = [i for i, p in enumerate(full) if i >= len(vocab) or p == "<s>"]  # never text
    side = PairTokenizer.side("sentencepiece", full, model=model)
    return PairTokenizer.build(family, specials, side, side, control_ids=control,
                               languages=languages.defaults(src, hf, codes, default_source))


def convert_family(src: str, family: str) -> tuple[ModelConfig, dict[str, Any], Any, dict[str, Any]]:
    hf = common.read_json(os.path.join(src, "config.json"))
    cfg = model_config(hf, os.path.join(src, "config.json"))
    w = weights(read_tensors(src), cfg, src)
    return cfg, w, tokenizer(src, cfg, family, hf), {"family": family, "source": os.path.abspath(src)}


def convert_m2m100(src: str) -> tuple[ModelConfig, dict[str, Any], Any, dict[str, Any]]:
    """(model config, weights, tokenizer, what was imported) of an M2M100 directory."""
    return convert_family(src, "m2m100")


def convert_nllb(src: str) -> tuple[ModelConfig, dict[str, Any], Any, dict[str, Any]]:
    """(model config, weights, tokenizer, what was imported) of an NLLB-200 directory."""
    return convert_family(src, "nllb")
