"""Reading a pretrained checkpoint's tensors without running its code.

safetensors files are read as they are. A pickle (Hugging Face's pytorch_model.bin, fairseq's .pt) is read
only with torch.load(weights_only=True), whose unpickler builds tensors and plain containers and nothing else,
plus ALLOWED_GLOBALS: the classes a fairseq checkpoint's arguments are made of. Any other class is refused,
naming it; nothing is ever unpickled with the full unpickler.
"""

from __future__ import annotations

import os
import re
from typing import Any

from transduce.errors import ImportCheckpointError

# The classes a fairseq checkpoint pickles besides tensors and containers: its command-line arguments
ALLOWED_GLOBALS = ("argparse.Namespace",)


def _allowed() -> list[Any]:
    import argparse

    return [argparse.Namespace]


def read_safetensors(path: str) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ImportCheckpointError(f"{path} cannot be read as safetensors ({e})") from None


def read_pickle(path: str) -> Any:
    """A pickled checkpoint, read with torch.load(weights_only=True) and ALLOWED_GLOBALS only."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(_allowed()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)|global ['\"]?([\w.]+)", str(e))
        name = next((g for g in found.groups() if g), None) if found else None
        what = f"the class {name}" if name else "a class"
        raise ImportCheckpointError(
            f"{path} pickles {what}, which transduce does not unpickle (it reads only tensors, containers and "
            f"{', '.join(ALLOWED_GLOBALS)}, never running a checkpoint's code)",
            hint="convert the checkpoint to safetensors with the tool that wrote it, or save only its state "
                 "dict") from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise ImportCheckpointError(f"{path} cannot be read as a PyTorch checkpoint ({e})") from None


def read_tensors(directory: str, names: tuple[str, ...] = ("model.safetensors", "pytorch_model.bin")) -> dict:
    """A Hugging Face model directory's weights: the first of `names` that exists (safetensors first), or, saved
    in shards (save_pretrained's max_shard_size), the shards its NAME.index.json lists."""
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return _state_dict(path)
        index = path + ".index.json"
        if os.path.isfile(index):
            return _sharded(directory, index)
    raise ImportCheckpointError(f"{directory} has no weights ({' or '.join(names)}, or their .index.json with "
                                "shards)", hint="give the model's whole directory")


def _state_dict(path: str) -> dict:
    import torch

    tensors = read_safetensors(path) if path.endswith(".safetensors") else read_pickle(path)
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise ImportCheckpointError(f"{path} is not a state dict of tensors")
    return tensors


def _sharded(directory: str, index: str) -> dict:
    """The tensors of the shards an index lists ({"weight_map": {tensor: shard file}}), each tensor from the shard
    the index names for it."""
    import json

    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        raise ImportCheckpointError(f"{index} cannot be read as a shard index ({e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ImportCheckpointError(f"{index} has no weight_map of tensor names to shard files")
    out: dict = {}
    for shard in sorted(set(weight_map.values())):
        path = os.path.join(directory, shard)
        if os.path.basename(shard) != shard or not os.path.isfile(path):
            raise ImportCheckpointError(f"{index} lists the shard {shard!r}, which is not a file beside it",
                                        hint="download every shard of the model")
        tensors = _state_dict(path)
        for name, file in weight_map.items():
            if file == shard:
                if name not in tensors:
                    raise ImportCheckpointError(f"{path} lacks the tensor {name}, which {index} puts there")
                out[name] = tensors[name]
    return out


def take(tensors: dict[str, Any], name: str, shape: tuple[int, ...], source: str) -> Any:
    """Tensor `name` of a checkpoint, removed from `tensors`, as fp32 of exactly `shape` (an error naming it
    otherwise)."""
    import torch

    if name not in tensors:
        raise ImportCheckpointError(f"{source} lacks the tensor {name} (shape {list(shape)})",
                                    hint="the checkpoint is incomplete, or of another architecture")
    t = tensors.pop(name)
    if tuple(t.shape) != tuple(shape):
        raise ImportCheckpointError(f"{source}: tensor {name} has shape {list(t.shape)}, its config says "
                                    f"{list(shape)}")
    if not t.is_floating_point():
        raise ImportCheckpointError(f"{source}: tensor {name} is {t.dtype}, not floating point")
    t = t.to(torch.float32)
    if not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise ImportCheckpointError(f"{source}: tensor {name} holds {bad} NaN or infinite value(s)",
                                    hint="the checkpoint is corrupt (or its training diverged): use another one")
    return t


def refuse_extra(tensors: dict[str, Any], source: str, ignored: tuple[str, ...] = ()) -> None:
    """Tensors left after import that are not `ignored` (regular expressions) are an error naming them."""
    extra = sorted(k for k in tensors if not any(re.fullmatch(p, k) for p in ignored))
    if extra:
        shown = ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else "")
        raise ImportCheckpointError(f"{source} has tensors the reference model has no place for: {shown}",
                                    hint="the checkpoint is of another architecture (a pre-norm model, learned "
                                         "positions, an embedding layer norm, ...)")
