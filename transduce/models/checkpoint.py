"""Model directories with torch: save and load the weights, the tokenizer and the training state.

The directory's layout and config.json are transduce.formats.model_dir's; the weight names and shapes
transduce.formats.weights'. Everything is written into a temporary directory and renamed into place.
Loading is strict: every file's size and sha256 must match config.json, every weight name and shape must
match the config. Nothing is ever unpickled.
"""

from __future__ import annotations

import os
from typing import Any

from transduce.errors import CheckpointError, ConfigError
from transduce.formats.decoding_defaults import DecodingDefaults
from transduce.formats.kinds import WEIGHTS_FILE
from transduce.formats.model_config import ModelConfig
from transduce.formats.model_dir import (
    FORMAT,
    OPTIMIZER_FILE,
    STATE_FILE,
    TOKENIZER_FILE,
    TRAINING_DIR,
    WEIGHTS_CONFIG_KEY,
    ModelDir,
    saved_config_json,
    saved_config_mismatch,
    write_config,
)
from transduce.formats.weights import layout_mismatches
from transduce.io.atomic import atomic_directory, write_json
from transduce.io.files import file_entry, read_json
from transduce.models.tokenizer import Tokenizer


def special_id_mismatches(mcfg: ModelConfig, tokenizer: Tokenizer) -> list[str]:
    """The model config's special ids that are not its tokenizer's, as "bos_id 5 (the tokenizer's is 1)":
    a model whose EOS is a text piece of its tokenizer never ends a sentence where it should."""
    if not all(hasattr(tokenizer, k) for k in ("pad_id", "bos_id", "eos_id", "unk_id")):  # a raw tokenizers.Tokenizer
        raise ConfigError(f"the tokenizer is a {type(tokenizer).__module__}.{type(tokenizer).__name__}, "
                          "not transduce's",
                          hint="wrap it: transduce.models.tokenizer.Tokenizer(tok) (it checks the special ids)")
    fixed = {"pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id,
             "unk_id": tokenizer.unk_id}
    return [f"{k} {getattr(mcfg, k)} (the tokenizer's is {v})" for k, v in fixed.items() if getattr(mcfg, k) != v]


def save_model_dir(
    path: str | os.PathLike,
    model,
    tokenizer: Tokenizer,
    training: dict[str, Any] | None = None,
    optimizer_state: dict[str, Any] | None = None,
    train_state: dict[str, Any] | None = None,
    overwrite: bool = True,
    rng_states: dict[str, Any] | None = None,
    decoding_defaults: DecodingDefaults | None = None,
) -> None:
    """Write a model directory atomically (replacing an existing one; callers check that it may be).
    Without `overwrite` only a new or empty directory is written (see io.atomic.atomic_directory).
    With a training state, this process's RNG states are saved, and `rng_states` beside them (the other
    processes' of a run on several: {"torch.1": ..., "cuda.1": ...}). decoding_defaults: the model's own (an
imported model's; formats.decoding_defaults), None for the paper's.

    A write that fails (disk full, permissions) is a CheckpointError and leaves `path` as it was."""
    from safetensors import SafetensorError

    wrong = special_id_mismatches(model.cfg, tokenizer)
    if wrong:
        raise ConfigError(f"the model's special ids must be its tokenizer's: {', '.join(wrong)}")
    try:
        _save_model_dir(path, model, tokenizer, training, optimizer_state, train_state, overwrite, rng_states,
                        decoding_defaults)
    except (OSError, SafetensorError) as e:  # safetensors reports a full disk as its own error class
        raise CheckpointError(f"cannot write the model directory {os.fspath(path)!r}: {e}",
                              hint="free some disk space or choose another output directory; the last "
                                   "complete checkpoint there (if any) is unchanged") from None


def _save_model_dir(path, model, tokenizer, training, optimizer_state, train_state, overwrite, rng_states,
                    decoding_defaults) -> None:
    import torch
    from safetensors.torch import save_file

    with atomic_directory(path, overwrite=overwrite) as tmp:
        weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(weights, os.path.join(tmp, WEIGHTS_FILE),
                  metadata={"format": FORMAT, WEIGHTS_CONFIG_KEY: saved_config_json(model.cfg)})
        tokenizer.save(os.path.join(tmp, TOKENIZER_FILE))
        files = {name: file_entry(os.path.join(tmp, name)) for name in (WEIGHTS_FILE, TOKENIZER_FILE)}
        if optimizer_state is not None or train_state is not None:
            tdir = os.path.join(tmp, TRAINING_DIR)
            os.makedirs(tdir)
            tensors, meta = _flatten_optimizer(optimizer_state or {})
            tensors["rng.torch"] = torch.get_rng_state()
            if torch.cuda.is_available() and torch.cuda.is_initialized():  # dropout masks of a run on the GPU
                tensors["rng.cuda"] = torch.cuda.get_rng_state()
            tensors.update({f"rng.{name}": t.contiguous().cpu() for name, t in (rng_states or {}).items()})
            save_file(tensors, os.path.join(tdir, OPTIMIZER_FILE))
            state = dict(train_state or {})
            state["optimizer"] = meta
            write_json(os.path.join(tdir, STATE_FILE), state)
            for name in (OPTIMIZER_FILE, STATE_FILE):
                files[f"{TRAINING_DIR}/{name}"] = file_entry(os.path.join(tdir, name))
        write_config(tmp, model.cfg, files, training, decoding_defaults)


def load_tokenizer(path: str | os.PathLike | ModelDir) -> Tokenizer:
    directory = path if isinstance(path, ModelDir) else ModelDir.load(path)
    return Tokenizer.from_file(directory.verified(TOKENIZER_FILE))


def load_model_dir(path: str | os.PathLike | ModelDir, device: str = "cpu"):
    """-> (model in eval mode, tokenizer, config dict). Strict: any mismatch is a CheckpointError. Every file is
    read from the copy of the directory that was in place when it was opened (ModelDir)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from transduce.models.transformer import Transformer

    directory = path if isinstance(path, ModelDir) else ModelDir.load(path)
    path, cfg, mcfg = directory.path, directory.description, directory.config
    wpath = directory.verified(WEIGHTS_FILE)
    tokenizer = Tokenizer.from_file(directory.verified(TOKENIZER_FILE))
    if tokenizer.vocab_size != mcfg.vocab_size:
        raise CheckpointError(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model config says {mcfg.vocab_size}"
        )
    src_vocab = getattr(tokenizer, "source_vocab_size", tokenizer.vocab_size)  # an imported model's may differ
    if src_vocab != mcfg.source_vocab_size:
        raise CheckpointError(f"{path}: the tokenizer's source side has {src_vocab} tokens but the model config says "
                              f"{mcfg.source_vocab_size}")
    wrong = special_id_mismatches(mcfg, tokenizer)
    if wrong:
        raise CheckpointError(f"{path}: the model's special ids are not its tokenizer's: {', '.join(wrong)}",
                              hint="its config.json was edited by hand: restore it, or save the model again")
    try:
        weights = load_file(wpath, device=device)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{directory.files.display(WEIGHTS_FILE)} cannot be read as safetensors ({e})") from None
    problems = layout_mismatches({k: tuple(v.shape) for k, v in weights.items()}, mcfg)
    if problems:
        raise CheckpointError(f"{directory.files.display(WEIGHTS_FILE)} does not match config.json: "
                              + "; ".join(problems))
    _check_config_saved_with_weights(wpath, path, mcfg)
    model = Transformer(mcfg)
    model.load_state_dict(weights, strict=True)
    model.to(device).eval()
    return model, tokenizer, cfg


def _check_config_saved_with_weights(wpath: str, path: str, mcfg: ModelConfig) -> None:
    """config.json's model config must be the one saved in the (hash-checked) weights file's metadata
    (saved_config_mismatch)."""
    from safetensors import safe_open

    with safe_open(wpath, framework="pt") as f:
        saved = (f.metadata() or {}).get(WEIGHTS_CONFIG_KEY)
    problem = saved_config_mismatch(saved, mcfg)
    if problem:
        raise CheckpointError(f"{path}: {problem}",
                              hint="config.json was edited by hand: restore those fields; to change a model's "
                                   "configuration, train a new model")


def load_training_state(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """-> (train_state from state.json, optimizer state_dict, RNG states {"torch": CPU, "cuda": the current
    GPU's if the run used one, and "torch.R", "cuda.R": rank R's of a run on several processes}) for --resume."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = ModelDir.load(path)
    path = directory.path
    if not os.path.isdir(os.path.join(path, TRAINING_DIR)):
        raise CheckpointError(f"{path!r} holds a model but no training state ({TRAINING_DIR}/): it cannot be resumed",
                              hint="train a new model into another --out, or start this one over with --force")
    opath = directory.verified(f"{TRAINING_DIR}/{OPTIMIZER_FILE}")
    spath = directory.verified(f"{TRAINING_DIR}/{STATE_FILE}")
    state = read_json(spath)
    try:
        tensors = load_file(opath)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{directory.files.display(f'{TRAINING_DIR}/{OPTIMIZER_FILE}')} cannot be read as "
                              f"safetensors ({e})") from None
    rng = {name.removeprefix("rng."): tensors.pop(name) for name in list(tensors) if name.startswith("rng.")}
    return state, _unflatten_optimizer(tensors, state.pop("optimizer")), rng


def _flatten_optimizer(sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    tensors = {}
    for idx, st in sd.get("state", {}).items():
        for key, val in st.items():
            tensors[f"state.{idx}.{key}"] = val.detach().contiguous().cpu()
    return tensors, {"param_groups": sd.get("param_groups", [])}


def _unflatten_optimizer(tensors: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = t
    return {"state": state, "param_groups": meta["param_groups"]}
