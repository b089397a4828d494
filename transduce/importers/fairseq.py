"""fairseq `transformer` checkpoints, read without importing fairseq: a directory with the checkpoint
(checkpoint_best.pt, checkpoint_last.pt or model.pt), dict.SRC.txt and dict.TGT.txt, and the BPE: subword-nmt
codes (bpecodes, code or codes) or a SentencePiece model (*.model).

The checkpoint is a pickle of {"args": argparse.Namespace} or {"cfg": {"model": ...}} and "model" (the state
dict), read with torch.load(weights_only=True) and argparse.Namespace allowed (importers.checkpoints).
What the reference model takes from it (CTranslate2's fairseq converter does the same): post-norm layers, the
activation of activation_fn, fairseq's positions ([sin | cos] halves, frequencies exp(-i ln(10000) / (d/2 - 1)),
from padding_idx + 1; not stored), the embedding scale unless no_scale_embedding, embeddings shared by
share_all_embeddings (one dictionary), the projection tied by share_decoder_input_output_embed, decoding from EOS.
Dictionaries: <s>=0, <pad>=1, </s>=2, <unk>=3, then one "token count" line per entry, padded to the embedding's
rows with fairseq's "madeupwordNNNN" entries.
"""

from __future__ import annotations

import glob
import os
from typing import Any

from transduce.errors import ImportCheckpointError
from transduce.formats.model_config import ModelConfig
from transduce.importers import common
from transduce.importers.checkpoints import read_pickle, refuse_extra, take

CHECKPOINTS = ("checkpoint_best.pt", "checkpoint_last.pt", "model.pt")
SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
# fairseq arguments the reference model cannot honour, and the values it refuses
UNSUPPORTED = {"encoder_normalize_before": True, "decoder_normalize_before": True, "encoder_learned_pos": True,
               "decoder_learned_pos": True, "layernorm_embedding": True, "no_token_positional_embeddings": True,
               "cross_self_attention": True, "no_cross_attention": True}
# fairseq's multilingual arguments: a language token in the source or target, chosen per pair, which the
# tokenizer and the decoding here do not add (refused where set)
MULTILINGUAL = ("lang_tok_style", "encoder_langtok", "decoder_langtok", "langs", "lang_pairs", "lang_dict",
                "lang_tok_replacing_bos_eos")
TASKS = ("translation",)
# buffers of a state dict that hold no weights: the positions' dummy tensor, the modules' version counters
IGNORED = (r"(encoder|decoder)\.embed_positions\._float_tensor", r"(encoder|decoder)\.version")


def read_checkpoint(src: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the model's arguments as a dict, the state dict) of the directory's checkpoint."""
    path = next((os.path.join(src, n) for n in CHECKPOINTS if os.path.isfile(os.path.join(src, n))), None)
    if path is None:
        raise ImportCheckpointError(f"{src} has no fairseq checkpoint ({', '.join(CHECKPOINTS)})")
    ckpt = read_pickle(path)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict):
        raise ImportCheckpointError(f"{path} is not a fairseq checkpoint (a dict with 'model', the state dict)")
    args = ckpt.get("args")
    if args is None and isinstance(ckpt.get("cfg"), dict):
        args = ckpt["cfg"].get("model")
    args = vars(args) if hasattr(args, "__dict__") else args
    if not isinstance(args, dict):
        raise ImportCheckpointError(f"{path} has neither 'args' nor 'cfg' with the model's arguments")
    task = ckpt["cfg"].get("task") if isinstance(ckpt.get("cfg"), dict) else None
    if isinstance(task, dict):  # a newer checkpoint keeps the task's arguments apart from the model's
        args = {**{k: v for k, v in task.items() if k != "_name"}, "task": task.get("_name", "translation"), **args}
    return args, ckpt["model"]


def model_config(args: dict[str, Any], tensors: dict, source: str) -> ModelConfig:
    """The ModelConfig of a fairseq transformer's arguments (sizes of the vocabularies from its embeddings)."""
    arch = str(args.get("arch", args.get("_name", "transformer")))
    if not arch.startswith("transformer"):
        raise ImportCheckpointError(f"{source}: arch {arch!r} is not a fairseq transformer")
    common.refuse(args, source, UNSUPPORTED)
    task = args.get("task", "translation")
    if task not in TASKS:
        raise ImportCheckpointError(f"{source}: task {task!r} is not supported (only fairseq's plain translation "
                                    "task: a multilingual model's language tokens would be missing from its input "
                                    "and output)", hint="import a bilingual fairseq translation model")
    for name in MULTILINGUAL:
        off = (None, False, "", []) + (("multilingual",) if name == "lang_tok_style" else ())  # the style alone: inert
        if args.get(name) not in off:
            raise ImportCheckpointError(f"{source}: {name} = {args[name]!r} is not supported (fairseq's "
                                        "multilingual language tokens, which transduce does not add)",
                                        hint="import a bilingual fairseq translation model")
    if args.get("adaptive_softmax_cutoff"):
        raise ImportCheckpointError(f"{source}: adaptive_softmax_cutoff = {args['adaptive_softmax_cutoff']!r} is "
                                    "not supported (the reference model has one output projection)")
    common.require_equal(args, source, ("encoder_embed_dim", "decoder_embed_dim"),
                         ("encoder_attention_heads", "decoder_attention_heads"),
                         ("encoder_ffn_embed_dim", "decoder_ffn_embed_dim"))
    for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        if name not in tensors:
            raise ImportCheckpointError(f"{source} lacks the tensor {name}")
    src_vocab = tensors["encoder.embed_tokens.weight"].shape[0]
    tgt_vocab = tensors["decoder.embed_tokens.weight"].shape[0]
    f = common.field
    shared = f(args, "share_all_embeddings", source, bool, False)
    pad = 1
    return ModelConfig(
        vocab_size=tgt_vocab, src_vocab_size=0 if shared else src_vocab,
        encoder_layers=f(args, "encoder_layers", source), decoder_layers=f(args, "decoder_layers", source),
        d_model=f(args, "encoder_embed_dim", source), n_heads=f(args, "encoder_attention_heads", source),
        d_ff=f(args, "encoder_ffn_embed_dim", source), dropout=float(f(args, "dropout", source, float, 0.1)),
        max_positions=min(f(args, "max_source_positions", source, int, 1024),
                          f(args, "max_target_positions", source, int, 1024)),
        share_embeddings=shared,
        tie_output=not shared and f(args, "share_decoder_input_output_embed", source, bool, False),
        pad_id=pad, bos_id=2, eos_id=2, unk_id=3,
        activation=common.activation(args.get("activation_fn", "relu"), "activation_fn", source),
        position_layout="halves", position_frequencies="fairseq", position_offset=pad + 1,
        scale_embedding=not args.get("no_scale_embedding", False))


def weights(tensors: dict, cfg: ModelConfig, source: str) -> dict[str, Any]:
    d, v = cfg.d_model, cfg.vocab_size
    out = {}
    if cfg.share_embeddings:
        names = ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "decoder.output_projection.weight"]
        out["embed.weight"] = common.tied_embedding(tensors, names, (v, d), source)
    else:
        out["src_embed.weight"] = take(tensors, "encoder.embed_tokens.weight", (cfg.source_vocab_size, d), source)
        tied = ["decoder.output_projection.weight"] if cfg.tie_output else []
        out["embed.weight"] = common.tied_embedding(tensors, ["decoder.embed_tokens.weight", *tied], (v, d), source)
        if not cfg.tie_output:
            out["out_proj.weight"] = take(tensors, "decoder.output_projection.weight", (v, d), source)
    out.update(common.map_layers(tensors, cfg, {"encoder": "encoder.layers", "decoder": "decoder.layers"}, source))
    refuse_extra(tensors, source, IGNORED)
    return out


def read_dictionary(path: str, size: int) -> list[str]:
    """fairseq's Dictionary as a list id -> token: the specials, the file's tokens, padding to `size` rows."""
    if not os.path.isfile(path):
        raise ImportCheckpointError(f"{path} is missing", hint="a fairseq model directory has dict.SRC.txt and "
                                    "dict.TGT.txt beside its checkpoint")
    tokens = list(SPECIALS)
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            fields = line.rstrip("\n").rsplit(" ", 2 if line.rstrip().endswith("#fairseq:overwrite") else 1)
            if len(fields) < 2 or not fields[1].lstrip("-").isdigit():
                raise ImportCheckpointError(f"{path}:{n}: not a 'token count' line: {line.strip()!r}")
            tokens.append(fields[0])
    if len(tokens) > size:
        raise ImportCheckpointError(f"{path} has {len(tokens)} entries with the specials, the embedding {size} rows")
    tokens += [f"madeupword{i:04d}" for i in range(size - len(tokens))]  # fairseq's padding to a multiple of 8
    return tokens


def _bpe_side(src: str, vocab: list[str], lang: str, args: dict[str, Any]) -> dict[str, Any]:
    from transduce.models.pair_tokenizer import PairTokenizer

    codes = next((os.path.join(src, n) for n in ("bpecodes", "code", "codes")
                  if os.path.isfile(os.path.join(src, n))), None)
    moses = args.get("tokenizer") == "moses"
    if codes is not None:
        with open(codes, encoding="utf-8") as f:
            lines = [ln for ln in f.read().split("\n") if ln and not ln.startswith("#version")]
        return PairTokenizer.side("moses_bpe", vocab, lang=lang, merges=[" ".join(ln.split()[:2]) for ln in lines],
                                  style="subword_nmt", moses=moses, normalize=False)
    models = sorted(glob.glob(os.path.join(src, "*.model")))
    if not models:
        raise ImportCheckpointError(f"{src} has neither subword-nmt codes (bpecodes) nor a SentencePiece model "
                                    "(*.model)")
    with open(models[0], "rb") as f:
        return PairTokenizer.side("sentencepiece", vocab, model=f.read(), join=True)


def convert(src: str) -> tuple[ModelConfig, dict[str, Any], Any, dict[str, Any]]:
    """(model config, weights, tokenizer, what was imported) of a fairseq model directory."""
    from transduce.models.pair_tokenizer import PairTokenizer

    args, tensors = read_checkpoint(src)
    cfg = model_config(args, tensors, src)
    w = weights(dict(tensors), cfg, src)
    langs = (args.get("source_lang"), args.get("target_lang"))
    if not all(isinstance(x, str) for x in langs):
        raise ImportCheckpointError(f"{src}: the checkpoint's arguments name no source_lang and target_lang")
    src_dict = read_dictionary(os.path.join(src, f"dict.{langs[0]}.txt"), cfg.source_vocab_size)
    tgt_dict = read_dictionary(os.path.join(src, f"dict.{langs[1]}.txt"), cfg.vocab_size)
    specials = {"pad_id": cfg.pad_id, "bos_id": cfg.bos_id, "eos_id": cfg.eos_id, "unk_id": cfg.unk_id}
    tok = PairTokenizer.build("fairseq", specials, _bpe_side(src, src_dict, langs[0], args),
                              _bpe_side(src, tgt_dict, langs[1], args), control_ids=[0])
    return cfg, w, tok, {"family": "fairseq", "source": os.path.abspath(src)}
