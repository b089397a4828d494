"""Model directories: config.json + model.safetensors + tokenizer.json (+ training/ for resume).

  MODEL_DIR/
    config.json          {"format": "transduce-model", "format_version", "model": ModelConfig,
                          "files": {name: {"sha256", "bytes"}}, "training": summary}
    model.safetensors    the weights (tied weights stored once)
    tokenizer.json       the shared BPE tokenizer
    training/            optional, only what resuming needs
      optimizer.safetensors, state.json (step, epoch, batch index, RNG, train config)

Everything is written into a temporary directory and renamed into place. Loading is strict: every
file's size and sha256 must match config.json, every weight name and shape must match the config.
Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
from typing import Any

from transduce._io import atomic_directory, require_directory, write_json
from transduce.errors import CheckpointError, ConfigError
from transduce.models.config import CONFIG_FORMAT_VERSION, ModelConfig
from transduce.runtime.contract import (
    MANIFEST_FILE,
    MODEL_FORMAT,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    file_entry,
    listed_file_problem,
)
from transduce.runtime.contract import MODEL_CONFIG_FILE as CONFIG_FILE
from transduce.tokenizer import Tokenizer

FORMAT = MODEL_FORMAT
TRAINING_DIR = "training"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
# the model config, as JSON, in the weights file's metadata: config.json is the one file no hash covers, and
# its fields that leave every weight's shape alone (n_heads, norm_first, layer_norm_eps, ...) change what
# the weights compute
WEIGHTS_CONFIG_KEY = "model_config"
# model config fields that do not change what the weights compute (they only change training)
TRAINING_ONLY_FIELDS = ("dropout",)


def special_id_mismatches(mcfg: ModelConfig, tokenizer: Tokenizer) -> list[str]:
    """The model config's special ids that are not its tokenizer's, as "bos_id 5 (the tokenizer's is 1)":
    a model whose EOS is a text piece of its tokenizer never ends a sentence where it should."""
    if not all(hasattr(tokenizer, k) for k in ("pad_id", "bos_id", "eos_id", "unk_id")):  # a raw tokenizers.Tokenizer
        raise ConfigError(f"the tokenizer is a {type(tokenizer).__module__}.{type(tokenizer).__name__}, not transduce's",
                          hint="wrap it: transduce.tokenizer.Tokenizer(tok) (it checks the special ids)")
    fixed = {"pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "unk_id": tokenizer.unk_id}
    return [f"{k} {getattr(mcfg, k)} (the tokenizer's is {v})" for k, v in fixed.items() if getattr(mcfg, k) != v]


def save_model_dir(
    path: str | os.PathLike,
    model,
    tokenizer: Tokenizer,
    training: dict[str, Any] | None = None,
    optimizer_state: dict[str, Any] | None = None,
    train_state: dict[str, Any] | None = None,
    overwrite: bool = True,
) -> None:
    """Write a model directory atomically (replacing an existing one; callers check that it may be).
    Without `overwrite` only a new or empty directory is written (see _io.atomic_directory).

    A write that fails (disk full, permissions) is a CheckpointError and leaves `path` as it was."""
    from safetensors import SafetensorError

    wrong = special_id_mismatches(model.cfg, tokenizer)
    if wrong:
        raise ConfigError(f"the model's special ids must be its tokenizer's: {', '.join(wrong)}")
    try:
        _save_model_dir(path, model, tokenizer, training, optimizer_state, train_state, overwrite)
    except (OSError, SafetensorError) as e:  # safetensors reports a full disk as its own error class
        raise CheckpointError(f"cannot write the model directory {os.fspath(path)!r}: {e}",
                              hint="free some disk space or choose another output directory; the last "
                                   "complete checkpoint there (if any) is unchanged") from None


def _save_model_dir(path, model, tokenizer, training, optimizer_state, train_state, overwrite) -> None:
    import torch
    from safetensors.torch import save_file

    with atomic_directory(path, overwrite=overwrite) as tmp:
        weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(weights, os.path.join(tmp, WEIGHTS_FILE),
                  metadata={"format": FORMAT, WEIGHTS_CONFIG_KEY: json.dumps(model.cfg.to_dict(), sort_keys=True)})
        tokenizer.save(os.path.join(tmp, TOKENIZER_FILE))
        files = {name: file_entry(os.path.join(tmp, name)) for name in (WEIGHTS_FILE, TOKENIZER_FILE)}
        if optimizer_state is not None or train_state is not None:
            tdir = os.path.join(tmp, TRAINING_DIR)
            os.makedirs(tdir)
            tensors, meta = _flatten_optimizer(optimizer_state or {})
            tensors["rng.torch"] = torch.get_rng_state()
            if torch.cuda.is_available() and torch.cuda.is_initialized():  # dropout masks of a run on the GPU
                tensors["rng.cuda"] = torch.cuda.get_rng_state()
            save_file(tensors, os.path.join(tdir, OPTIMIZER_FILE))
            state = dict(train_state or {})
            state["optimizer"] = meta
            write_json(os.path.join(tdir, STATE_FILE), state)
            for name in (OPTIMIZER_FILE, STATE_FILE):
                files[f"{TRAINING_DIR}/{name}"] = file_entry(os.path.join(tdir, name))
        cfg = {
            "format": FORMAT,
            "format_version": CONFIG_FORMAT_VERSION,
            "model": model.cfg.to_dict(),
            "files": files,
            "training": training or {},
        }
        write_json(os.path.join(tmp, CONFIG_FILE), cfg)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    path = os.fspath(path)
    require_directory(path, CheckpointError, "a model directory", "model directory",
                      "give the directory transduce train wrote (config.json, model.safetensors, tokenizer.json)",
                      "train one with: transduce train --out DIR (or transduce demo)")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{cfg_path} is missing: {path!r} is not a transduce model directory")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError as e:
        raise CheckpointError(f"{cfg_path} cannot be read ({e.strerror})") from None
    except ValueError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON ({e}); the file is truncated or corrupt") from None
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        raise CheckpointError(f"{cfg_path} is not a transduce model config")
    if cfg.get("format_version") != CONFIG_FORMAT_VERSION:
        raise CheckpointError(
            f"{cfg_path} has format_version {cfg.get('format_version')}, this transduce reads "
            f"{CONFIG_FORMAT_VERSION}"
        )
    try:
        ModelConfig.from_dict(cfg.get("model", {}))
    except ConfigError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from None
    return cfg


def _verify(path: str, cfg: dict[str, Any], name: str) -> str:
    """The path of file `name` of a model directory, checked against config.json's record of it."""
    fpath = os.path.join(path, name)
    if not os.path.isfile(fpath):
        if os.path.isfile(os.path.join(path, MANIFEST_FILE)):
            raise CheckpointError(f"{path!r} is an ONNX export (transduce export), not a model directory: it has no {name}",
                                  hint="give the model directory it was exported from (its manifest.json names it)")
        raise CheckpointError(f"{fpath} is missing")
    files = cfg.get("files")
    problem = listed_file_problem(path, name, files.get(name) if isinstance(files, dict) else None,
                                  listed_in=os.path.join(path, CONFIG_FILE))
    if problem:
        raise CheckpointError(problem, hint="the config was edited by hand: restore it, or save the model again"
                              if "does not give" in problem else None)
    return fpath


def verify_model_dir(path: str | os.PathLike) -> dict[str, Any]:
    """read_config, and the weights and tokenizer are there with their recorded sizes and hashes (without
    loading them). -> the config dict."""
    path = os.fspath(path)
    cfg = read_config(path)
    for name in (WEIGHTS_FILE, TOKENIZER_FILE):
        _verify(path, cfg, name)
    return cfg


def weights_sha256(path: str | os.PathLike) -> str:
    """The sha256 a model directory's config.json records for its weights (what an export's manifest
    names as its source: source_model.weights_sha256). Read from the config, not hashed."""
    path = os.fspath(path)
    files = read_config(path).get("files")
    entry = files.get(WEIGHTS_FILE) if isinstance(files, dict) else None
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
        raise CheckpointError(f"{os.path.join(path, CONFIG_FILE)} does not record {WEIGHTS_FILE} (its size and sha256): "
                              "the config was edited", hint="restore the model directory's config.json, or save the model again")
    return entry["sha256"]


def model_config(path: str | os.PathLike) -> ModelConfig:
    return ModelConfig.from_dict(read_config(path)["model"])


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    path = os.fspath(path)
    return Tokenizer.from_file(_verify(path, read_config(path), TOKENIZER_FILE))


def load_model_dir(path: str | os.PathLike, device: str = "cpu"):
    """-> (model in eval mode, tokenizer, config dict). Strict: any mismatch is a CheckpointError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from transduce.models.transformer import Transformer

    path = os.fspath(path)
    cfg = read_config(path)
    mcfg = ModelConfig.from_dict(cfg["model"])
    wpath = _verify(path, cfg, WEIGHTS_FILE)
    tokenizer = Tokenizer.from_file(_verify(path, cfg, TOKENIZER_FILE))
    if tokenizer.vocab_size != mcfg.vocab_size:
        raise CheckpointError(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model config says {mcfg.vocab_size}"
        )
    wrong = special_id_mismatches(mcfg, tokenizer)
    if wrong:
        raise CheckpointError(f"{path}: the model's special ids are not its tokenizer's: {', '.join(wrong)}",
                              hint="its config.json was edited by hand: restore it, or save the model again")
    try:
        weights = load_file(wpath, device=device)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{wpath} cannot be read as safetensors ({e})") from None
    model = Transformer(mcfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(expected) & set(weights) if expected[k].shape != weights[k].shape)
    if missing or unexpected or wrong:
        detail = []
        if missing:
            detail.append(f"missing {missing[:5]}")
        if unexpected:
            detail.append(f"unexpected {unexpected[:5]}")
        if wrong:
            detail.append(
                "wrong shape " + ", ".join(f"{k} {tuple(weights[k].shape)} != {tuple(expected[k].shape)}" for k in wrong[:5])
            )
        raise CheckpointError(f"{wpath} does not match config.json: " + "; ".join(detail))
    _check_config_saved_with_weights(wpath, mcfg)
    model.load_state_dict(weights, strict=True)
    model.to(device).eval()
    return model, tokenizer, cfg


def _check_config_saved_with_weights(wpath: str, mcfg: ModelConfig) -> None:
    """config.json's model config must be the one saved in the (hash-checked) weights file's metadata
    (saved_config_mismatch)."""
    from safetensors import safe_open

    with safe_open(wpath, framework="pt") as f:
        saved = (f.metadata() or {}).get(WEIGHTS_CONFIG_KEY)
    problem = saved_config_mismatch(saved, mcfg)
    if problem:
        raise CheckpointError(f"{os.path.dirname(wpath) or '.'}: {problem}",
                              hint="config.json was edited by hand: restore those fields; to change a model's "
                                   "configuration, train a new model")


def saved_config_mismatch(saved: str | None, mcfg: ModelConfig) -> str | None:
    """Why `mcfg` (config.json's) is not the model config saved with the weights (`saved`: the JSON in their
    metadata), but for TRAINING_ONLY_FIELDS; None when it is. Weights saved before the config went into
    their metadata carry none and are taken as they are."""
    if saved is None:
        return None
    try:
        saved_dict = ModelConfig.from_dict(json.loads(saved)).to_dict()
    except (ValueError, TypeError, ConfigError) as e:
        return f"the model config saved with the weights cannot be read ({e})"
    changed = [f"{k} {v!r} (saved with the weights: {saved_dict[k]!r})" for k, v in mcfg.to_dict().items()
               if k not in TRAINING_ONLY_FIELDS and saved_dict.get(k) != v]
    if changed:
        return f"config.json's model config is not the one the weights were saved with: {', '.join(changed)}"
    return None


def load_training_state(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """-> (train_state from state.json, optimizer state_dict, RNG states {"torch": CPU, "cuda": the current
    GPU's if the run used one}) for --resume."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.fspath(path)
    cfg = read_config(path)
    if not os.path.isdir(os.path.join(path, TRAINING_DIR)):
        raise CheckpointError(f"{path!r} holds a model but no training state ({TRAINING_DIR}/): it cannot be resumed",
                              hint="train a new model into another --out, or start this one over with --force")
    opath = _verify(path, cfg, f"{TRAINING_DIR}/{OPTIMIZER_FILE}")
    spath = _verify(path, cfg, f"{TRAINING_DIR}/{STATE_FILE}")
    with open(spath, encoding="utf-8") as f:
        state = json.load(f)
    try:
        tensors = load_file(opath)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{opath} cannot be read as safetensors ({e})") from None
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
