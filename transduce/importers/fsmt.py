"""FSMT (fairseq's WMT19 models in Hugging Face's format, FSMTForConditionalGeneration): config.json,
model.safetensors or pytorch_model.bin, vocab-src.json, vocab-tgt.json, merges.txt, tokenizer_config.json.

What the reference model takes from them: post-norm layers; the activation of config.json (relu); fairseq's
positions ([sin | cos] halves, frequencies exp(-i ln(10000) / (d/2 - 1)), the first token at padding_idx + 1;
FSMT stores the table, which is checked against the computed one); the embedding scale of `scale_embedding`;
separate source and target vocabularies and embeddings, the projection tied to the target embedding where
`tie_word_embeddings` says so; decoding starts from `decoder_start_token_id` (EOS). Tokenizer: Moses and BPE
with "</w>" word ends (transduce.models.pair_tokenizer's moses_bpe), as FSMTTokenizer.
"""

from __future__ import annotations

import os
from typing import Any

from transduce.errors import ImportCheckpointError
from transduce.formats.model_config import ModelConfig
from transduce.importers import common
from transduce.importers.checkpoints import read_tensors, refuse_extra, take
from transduce.importers.marian import UNSUPPORTED


def model_config(hf: dict[str, Any], source: str) -> ModelConfig:
    """The ModelConfig of an FSMTConfig (config.json as a dict)."""
    if hf.get("model_type") != "fsmt":
        raise ImportCheckpointError(f"{source}: model_type is {hf.get('model_type')!r}, not 'fsmt'")
    common.refuse(hf, source, UNSUPPORTED)
    common.require_equal(hf, source, ("encoder_attention_heads", "decoder_attention_heads"),
                         ("encoder_ffn_dim", "decoder_ffn_dim"))
    f = common.field
    pad = f(hf, "pad_token_id", source, int, 1)
    src_vocab, tgt_vocab = f(hf, "src_vocab_size", source), f(hf, "tgt_vocab_size", source)
    eos = f(hf, "eos_token_id", source, int, 2)
    return ModelConfig(
        vocab_size=tgt_vocab, src_vocab_size=src_vocab, encoder_layers=f(hf, "encoder_layers", source),
        decoder_layers=f(hf, "decoder_layers", source), d_model=f(hf, "d_model", source),
        n_heads=f(hf, "encoder_attention_heads", source), d_ff=f(hf, "encoder_ffn_dim", source),
        dropout=float(f(hf, "dropout", source, float, 0.1)),
        max_positions=f(hf, "max_position_embeddings", source, int, 1024), share_embeddings=False,
        tie_output=f(hf, "tie_word_embeddings", source, bool, False), pad_id=pad,
        bos_id=f(hf, "decoder_start_token_id", source, int, eos), eos_id=eos,
        unk_id=3, activation=common.activation(hf.get("activation_function", "relu"), "activation_function", source),
        position_layout="halves", position_frequencies="fairseq", position_offset=pad + 1,
        scale_embedding=bool(hf.get("scale_embedding", True)))


def weights(tensors: dict, cfg: ModelConfig, source: str) -> dict[str, Any]:
    """Our weights from an FSMTForConditionalGeneration state dict; every tensor used, checked by name and shape."""
    d, v = cfg.d_model, cfg.vocab_size
    out = {"src_embed.weight": take(tensors, "model.encoder.embed_tokens.weight", (cfg.source_vocab_size, d),
                                    source)}
    tied = ["model.decoder.output_projection.weight"] if cfg.tie_output else []
    out["embed.weight"] = common.tied_embedding(tensors, ["model.decoder.embed_tokens.weight", *tied], (v, d), source)
    if not cfg.tie_output:
        out["out_proj.weight"] = take(tensors, "model.decoder.output_projection.weight", (v, d), source)
    out.update(common.map_layers(tensors, cfg, {"encoder": "model.encoder.layers", "decoder": "model.decoder.layers"},
                                 source))
    for stack in ("encoder", "decoder"):
        common.check_positions(tensors, f"model.{stack}.embed_positions.weight", cfg, cfg.position_offset, source)
    refuse_extra(tensors, source)
    return out


def tokenizer(src: str, cfg: ModelConfig):
    """The PairTokenizer of an FSMT directory: Moses + BPE per language, ids from vocab-src.json and vocab-tgt.json."""
    from transduce.models.pair_tokenizer import PairTokenizer

    tok_cfg = common.read_json(os.path.join(src, "tokenizer_config.json"))
    langs = tok_cfg.get("langs")
    if not (isinstance(langs, list) and len(langs) == 2):
        raise ImportCheckpointError(f"{src}/tokenizer_config.json: langs must name the source and target "
                                    f"languages, got {langs!r}")
    mpath = os.path.join(src, "merges.txt")
    if not os.path.isfile(mpath):
        raise ImportCheckpointError(f"{mpath} is missing", hint="an FSMT directory has merges.txt")
    with open(mpath, encoding="utf-8") as f:
        merges = [" ".join(line.split()[:2]) for line in f.read().split("\n")[:-1]]
    sides, target_vocab = [], []
    for name, lang, size in (("vocab-src.json", langs[0], cfg.source_vocab_size),
                             ("vocab-tgt.json", langs[1], cfg.vocab_size)):
        path = os.path.join(src, name)
        vocab = common.vocab_list(common.read_json(path), path)
        if len(vocab) != size:
            raise ImportCheckpointError(f"{path} has {len(vocab)} entries, the model {size}")
        for token, i in (("<pad>", cfg.pad_id), ("</s>", cfg.eos_id), ("<unk>", cfg.unk_id)):
            if vocab[i] != token:
                raise ImportCheckpointError(f"{path}: id {i} is {vocab[i]!r}, the config says {token}")
        target_vocab = vocab
        sides.append(PairTokenizer.side("moses_bpe", vocab, lang=lang, merges=merges,
                                        lower=bool(tok_cfg.get("do_lower_case", False))))
    specials = {"pad_id": cfg.pad_id, "bos_id": cfg.bos_id, "eos_id": cfg.eos_id, "unk_id": cfg.unk_id}
    control = [i for i, p in enumerate(target_vocab) if p == "<s>"]  # fairseq's <s>: never text
    return PairTokenizer.build("fsmt", specials, *sides, control_ids=control)


def convert(src: str) -> tuple[ModelConfig, dict[str, Any], Any, dict[str, Any]]:
    """(model config, weights, tokenizer, what was imported) of an FSMT directory."""
    cfg = model_config(common.read_object(os.path.join(src, "config.json")), os.path.join(src, "config.json"))
    w = weights(read_tensors(src), cfg, src)
    return cfg, w, tokenizer(src, cfg), {"family": "fsmt", "source": os.path.abspath(src)}
