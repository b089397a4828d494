"""The weight-name layout of a model directory's model.safetensors, versioned (as CTranslate2 versions its
model specs): which tensors a model of a given config has, by name and shape, computed without building it.

Names are the PyTorch module paths of transduce.models.transformer.Transformer (its state_dict); tied weights
are stored once. A change to a name or a shape for the same config is a new WEIGHTS_LAYOUT_VERSION, which
config.json records and loading checks.
"""

from __future__ import annotations

import os
from typing import Any

from transduce.formats.dtypes import safetensors_type
from transduce.formats.model_config import ModelConfig

WEIGHTS_LAYOUT_VERSION = 1
SHOWN = 5  # names listed per kind of mismatch


def _linear(prefix: str, n_in: int, n_out: int, bias: bool = True) -> dict[str, tuple[int, ...]]:
    shapes = {f"{prefix}.weight": (n_out, n_in)}
    if bias:
        shapes[f"{prefix}.bias"] = (n_out,)
    return shapes


def _norm(prefix: str, d: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.weight": (d,), f"{prefix}.bias": (d,)}


def _attention(prefix: str, d: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        shapes.update(_linear(f"{prefix}.{proj}", d, d))
    return shapes


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{weight name: shape} of the model a config describes, in the model's own order."""
    d, ff, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    # the model's own parameters come first in its state_dict, then its modules'
    shapes: dict[str, tuple[int, ...]] = {"final_logits_bias": (v,)} if cfg.final_logits_bias else {}
    shapes["embed.weight"] = (v, d)
    if not cfg.share_embeddings:
        shapes["src_embed.weight"] = (cfg.source_vocab_size, d)
    if not cfg.output_tied:
        shapes["out_proj.weight"] = (v, d)
    if cfg.positions == "learned":
        shapes["encoder_positions.weight"] = shapes["decoder_positions.weight"] = (cfg.max_positions, d)
    if cfg.layernorm_embedding:
        shapes.update(_norm("encoder_embed_norm", d))
        shapes.update(_norm("decoder_embed_norm", d))
    for stack, n, sublayers in (("encoder", cfg.encoder_layers, ("self_attn",)),
                                ("decoder", cfg.decoder_layers, ("self_attn", "cross_attn"))):
        for i in range(n):
            prefix = f"{stack}_layers.{i}"
            for sub in sublayers:
                shapes.update(_attention(f"{prefix}.{sub}", d))
            shapes.update(_linear(f"{prefix}.ffn.w1", d, ff))
            shapes.update(_linear(f"{prefix}.ffn.w2", ff, d))
            for k in range(len(sublayers) + 1):
                shapes.update(_norm(f"{prefix}.norm{k + 1}", d))
    if cfg.norm_first:
        shapes.update(_norm("encoder_norm", d))
        shapes.update(_norm("decoder_norm", d))
    return shapes


def _listing(names: list[str]) -> str:
    return ", ".join(names[:SHOWN]) + (" ..." if len(names) > SHOWN else "")


def layout_mismatches(shapes: dict[str, Any], cfg: ModelConfig) -> list[str]:
    """How weights ({name: shape}) differ from the ones a model of `cfg` has (weight_shapes); empty if they don't."""
    expected = weight_shapes(cfg)
    missing = [k for k in expected if k not in shapes]
    extra = sorted(k for k in shapes if k not in expected)
    wrong = [f"{k} {list(shapes[k])} (config: {list(expected[k])})" for k in expected
             if k in shapes and tuple(shapes[k]) != expected[k]]
    problems = []
    if missing:
        problems.append(f"weights missing for this config: {_listing(missing)}")
    if extra:
        problems.append(f"weights this config's model does not have: {_listing(extra)}")
    if wrong:
        problems.append("weights of other shapes than the config's: " + "; ".join(wrong[:SHOWN])
                        + (" ..." if len(wrong) > SHOWN else ""))
    return problems


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, tuple[str, list[int]]], dict[str, str]]:
    """({tensor name: (dtype, shape)}, the metadata) from a safetensors file's JSON header, without reading
    the tensors; ValueError (or OSError) for a file that is not one."""
    import json

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(f"header length {n} exceeds the file size {size}")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    return ({name: (safetensors_type(meta["dtype"]), list(meta["shape"])) for name, meta in header.items()},
            metadata if isinstance(metadata, dict) else {})
