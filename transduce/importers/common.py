"""What the importers share: the BART-style layer names of Hugging Face's Marian and FSMT (fairseq's differ only
by their prefix), a config's refusals, and writing the model directory."""

from __future__ import annotations

import json
import os
from typing import Any

from transduce.errors import ImportCheckpointError
from transduce.formats.decoding_defaults import DecodingDefaults
from transduce.formats.model_config import ModelConfig
from transduce.importers.checkpoints import take

# Hugging Face (and fairseq) activation names -> ModelConfig.activation; others are refused
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}

# our sublayer -> theirs, per stack (post-norm layers: self_attn_layer_norm after attention, final_layer_norm
# after the FFN)
ENCODER_NAMES = {"self_attn": "self_attn", "norm1": "self_attn_layer_norm", "ffn.w1": "fc1", "ffn.w2": "fc2",
                 "norm2": "final_layer_norm"}
DECODER_NAMES = {"self_attn": "self_attn", "norm1": "self_attn_layer_norm", "cross_attn": "encoder_attn",
                 "norm2": "encoder_attn_layer_norm", "ffn.w1": "fc1", "ffn.w2": "fc2", "norm3": "final_layer_norm"}


# Hugging Face's config.json model_type -> the family that imports it (what a directory given to another
# family's importer is said to look like)
MODEL_TYPES = {"marian": "marian", "fsmt": "fsmt", "mbart": "mbart"}
_MISSING = object()


def read_json(path: str) -> Any:
    if not os.path.isfile(path):
        raise ImportCheckpointError(f"{path} is missing", hint="give the model's whole directory")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ImportCheckpointError(f"{path} cannot be read as JSON ({e})") from None


def read_object(path: str) -> dict[str, Any]:
    """A JSON file that must hold an object (config.json, a vocabulary): an error saying what it holds otherwise."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise ImportCheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object",
                                    hint="restore the file the model came with")
    return data


def looks_like(src: str) -> str | None:
    """The family a checkpoint directory looks like (by config.json's model_type, or a fairseq checkpoint file);
    None where it cannot tell."""
    path = os.path.join(src, "config.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        return MODEL_TYPES.get(data.get("model_type")) if isinstance(data, dict) else None
    if any(os.path.isfile(os.path.join(src, n)) for n in ("checkpoint_best.pt", "checkpoint_last.pt", "model.pt")):
        return "fairseq"
    return None


def field(config: dict[str, Any], key: str, source: str, kind: type = int, default: Any = _MISSING) -> Any:
    """config[key] (`default` where absent, if given), which must be a `kind` (an int: not a bool, >= 0); an
    error naming the key otherwise."""
    if key not in config or config[key] is None and default is not _MISSING:
        if default is _MISSING:
            raise ImportCheckpointError(f"{source} lacks {key}",
                                        hint="the file is incomplete, or of another architecture: restore the one "
                                             "the model came with")
        return default
    v = config[key]
    ok = (isinstance(v, int) and not isinstance(v, bool) and v >= 0) if kind is int else \
        (isinstance(v, int | float) and not isinstance(v, bool)) if kind is float else isinstance(v, kind)
    if not ok:
        what = {int: "an integer >= 0", float: "a number", bool: "true or false", str: "a string"}.get(kind, kind)
        extra = " (transduce models have one EOS: a list of several is not supported)" if isinstance(v, list) else ""
        raise ImportCheckpointError(f"{source}: {key} must be {what}, got {v!r}{extra}",
                                    hint="edit it in the checkpoint's file, then import again")
    return v


def tied_embedding(tensors: dict, names: list[str], shape: tuple[int, int], source: str,
                   ties: str = "the config ties them"):
    """One matrix stored under one or more of `names` (tied copies): each stored copy must be the same (`ties`
    says why, in the error otherwise)."""
    present = [n for n in names if n in tensors]
    if not present:
        raise ImportCheckpointError(f"{source} lacks the tensor {names[0]} (shape {list(shape)})")
    first = take(tensors, present[0], shape, source)
    for n in present[1:]:
        other = take(tensors, n, shape, source)
        if not (other == first).all():
            raise ImportCheckpointError(f"{source}: {n} differs from {present[0]}, but {ties}",
                                        hint="the checkpoint is corrupt, or was saved by a library that untied them")
    return first


def vocab_list(vocab: dict[str, int], path: str) -> list[str]:
    """A vocabulary JSON file ({piece: id}) as a list id -> piece; the ids must be 0..n-1."""
    pieces = sorted(vocab, key=vocab.get)
    if [vocab[p] for p in pieces] != list(range(len(pieces))):
        raise ImportCheckpointError(f"{path}: the ids are not 0..{len(pieces) - 1}, one each")
    return pieces


def activation(name: Any, field: str, source: str) -> str:
    if name not in ACTIVATIONS:
        raise ImportCheckpointError(f"{source}: {field} {name!r} is not an activation the reference model has",
                                    hint=f"supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


def refuse(config: dict[str, Any], source: str, wrong: dict[str, Any]) -> None:
    """Refuse a checkpoint config whose field is set to what the reference model cannot be: `wrong` maps a
    field to the value(s) it must not have (a tuple: any of them), naming the first such field."""
    for field, bad in wrong.items():
        values = bad if isinstance(bad, tuple) else (bad,)
        if field in config and config[field] in values:
            raise ImportCheckpointError(f"{source}: {field} = {config[field]!r} is not supported (the reference "
                                        "model is post-norm, with sinusoidal positions and no embedding layer norm)",
                                        hint="only Transformers that are the paper's but for the deviations "
                                             "ModelConfig lists can be imported")


def require_equal(config: dict[str, Any], source: str, *pairs: tuple[str, str]) -> None:
    for a, b in pairs:
        if a in config and b in config and config[a] != config[b]:
            raise ImportCheckpointError(f"{source}: {a} ({config[a]}) differs from {b} ({config[b]}); the reference "
                                        "model has one value for both stacks")


def map_layers(tensors: dict, cfg: ModelConfig, prefixes: dict[str, str], source: str) -> dict[str, Any]:
    """The encoder and decoder layers' weights under our names, taken from `tensors` with their prefixes
    ({"encoder": "model.encoder.layers", "decoder": ...}); shapes checked."""
    d, ff = cfg.d_model, cfg.d_ff
    shapes = {"ffn.w1": ((ff, d), (ff,)), "ffn.w2": ((d, ff), (d,))}
    out = {}
    for stack, n, names in (("encoder", cfg.encoder_layers, ENCODER_NAMES),
                            ("decoder", cfg.decoder_layers, DECODER_NAMES)):
        for i in range(n):
            ours, theirs = f"{stack}_layers.{i}", f"{prefixes[stack]}.{i}"
            for sub, their_sub in names.items():
                if sub.startswith("norm"):
                    parts = {"weight": (d,), "bias": (d,)}
                    pairs = [(f"{sub}.{p}", f"{their_sub}.{p}", s) for p, s in parts.items()]
                elif sub.startswith("ffn"):
                    (ws, bs) = shapes[sub]
                    pairs = [(f"{sub}.weight", f"{their_sub}.weight", ws), (f"{sub}.bias", f"{their_sub}.bias", bs)]
                else:
                    pairs = [(f"{sub}.{proj}.{p}", f"{their_sub}.{proj}.{p}", (d, d) if p == "weight" else (d,))
                             for proj in ("q_proj", "k_proj", "v_proj", "out_proj") for p in ("weight", "bias")]
                for mine, their, shape in pairs:
                    out[f"{ours}.{mine}"] = take(tensors, f"{theirs}.{their}", shape, source)
    return out


def check_positions(tensors: dict, name: str, cfg: ModelConfig, rows_before: int, source: str) -> None:
    """A checkpoint's stored positional table (`name`, if stored) must be the one the config computes: rows from
    `rows_before` on are positions 0, 1, ... (fairseq and FSMT keep padding_idx + 1 rows first, pad's zero)."""
    import torch

    from transduce.models.transformer import positional_table

    if name not in tensors:
        return
    stored = tensors.pop(name).float()
    ours = positional_table(cfg)
    n = min(len(ours), stored.shape[0] - rows_before)
    if stored.shape[1] != cfg.d_model or n < 1:
        raise ImportCheckpointError(f"{source}: tensor {name} has shape {list(stored.shape)}, not a positional "
                                    f"table of width {cfg.d_model}")
    diff = (stored[rows_before:rows_before + n] - ours[:n]).abs().max().item()
    if not diff <= 1e-4 or not torch.isfinite(stored).all():  # fp32 sin/cos of positions up to ~1e3: ~1e-5 apart
        raise ImportCheckpointError(f"{source}: the positional table {name} is not the sinusoidal one its config "
                                    f"describes (max difference {diff:.3g}): learned or altered positions are not "
                                    "supported")


def write_model_dir(out: str, cfg: ModelConfig, weights: dict[str, Any], tokenizer, imported: dict[str, Any],
                    replaces: bool, decoding_defaults: DecodingDefaults | None = None) -> str:
    """Build the model from `weights` (all of its tensors, strictly) and write it to `out` as transduce train
    would, atomically (replacing the model directory there if `replaces`, which the caller checked may be);
    config.json's "training" records where it was imported from, its "decoding_defaults" how its source
    framework decodes (importers.generation)."""
    from transduce.models.checkpoint import save_model_dir
    from transduce.models.transformer import Transformer

    model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not missing and not unexpected, (missing, unexpected)  # the importers fill every weight by name
    model.eval()
    save_model_dir(out, model, tokenizer, training={"imported": imported}, overwrite=replaces,
                   decoding_defaults=decoding_defaults)
    return os.fspath(out)
