"""A model directory's description, config.json: written, read and checked here.

  MODEL_DIR/
    config.json          {"format": "transduce-model", "format_version", "weights_layout_version", "model":
                          ModelConfig, "files": {name: {"sha256", "bytes"}}, "training": summary}
    model.safetensors    the weights (names and shapes: transduce.formats.weights; tied weights stored once),
                         with the model config in their metadata
    tokenizer.json       the shared BPE tokenizer
                         (config.json may also hold "decoding_defaults": formats.decoding_defaults)
    training/            optional, only what resuming needs
      optimizer.safetensors, state.json (step, epoch, batch index, RNG, train config)

Loading is strict: every file's size and sha256 must match config.json, and config.json's model config
must be the one saved with the weights (config.json is the one file no hash covers). Nothing is unpickled.
The weights themselves are read by transduce.models.checkpoint (torch).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from transduce.errors import CheckpointError, ConfigError
from transduce.formats.decoding_defaults import DEFAULTS_KEY, DecodingDefaults, read_defaults
from transduce.formats.kinds import MANIFEST_FILE, MODEL_CONFIG_FILE, MODEL_FORMAT, WEIGHTS_FILE
from transduce.formats.model_config import CONFIG_FORMAT_VERSION, ModelConfig
from transduce.formats.weights import WEIGHTS_LAYOUT_VERSION
from transduce.io.atomic import write_json
from transduce.io.files import listed_file_problem
from transduce.io.paths import require_directory
from transduce.io.pinned import ATTEMPTS, PinnedDir, Replaced, await_replacement, read_pinned

FORMAT = MODEL_FORMAT
TOKENIZER_FILE = "tokenizer.json"
TRAINING_DIR = "training"


OPTIMIZER_FILE = "optimizer.safetensors"


STATE_FILE = "state.json"


# the model config, as JSON, in the weights file's metadata: config.json is the one file no hash covers, and
# its fields that leave every weight's shape alone (n_heads, norm_first, layer_norm_eps, ...) change what
# the weights compute
WEIGHTS_CONFIG_KEY = "model_config"


# model config fields that do not change what the weights compute (they only change training)
TRAINING_ONLY_FIELDS = ("dropout",)


@dataclass(frozen=True, eq=False)
class ModelDir:
    """A model directory, read once (ModelDir.load): config.json and its model config, the directory held open
    (io.pinned) so that the files checked against config.json are the ones loaded, even while `transduce
    train` or `transduce import --force` replaces the directory."""

    path: str  # as given
    description: dict[str, Any]  # config.json
    config: ModelConfig
    files: PinnedDir
    decoding_defaults: DecodingDefaults | None = None  # the model's own (an imported model's), None: the paper's

    @classmethod
    def load(cls, path: str | os.PathLike) -> ModelDir:
        """config.json read and checked (format, versions, a valid model config); CheckpointError otherwise."""
        path = os.fspath(path)
        if not await_replacement(path):  # a replace under way: between its two renames
            require_directory(path, CheckpointError, "a model directory", "model directory",
                              "give the directory transduce train wrote (config.json, model.safetensors, "
                              "tokenizer.json)", "train one with: transduce train --out DIR (or transduce demo)")
        try:
            return read_pinned(path, _read)
        except Replaced:
            raise CheckpointError(f"{path!r} was replaced while it was being loaded, {ATTEMPTS} times (another "
                                  "process is writing it)", hint="load it again once that is done") from None

    def verified(self, name: str) -> str:
        """A path of file `name` checked against config.json's record of it (size and sha256), for a library
        that opens files by name; CheckpointError where it is missing or not what was recorded."""
        if not self.files.is_file(name):
            if self.files.is_file(MANIFEST_FILE):
                raise CheckpointError(f"{self.path!r} is an ONNX export (transduce export), not a model directory: "
                                      f"it has no {name}",
                                      hint="give the model directory it was exported from (its manifest.json names it)")
            raise CheckpointError(f"{self.files.display(name)} is missing")
        files = self.description.get("files")
        problem = listed_file_problem(self.files, name, files.get(name) if isinstance(files, dict) else None,
                                      listed_in=self.files.display(MODEL_CONFIG_FILE))
        if problem:
            raise CheckpointError(problem, hint="the config was edited by hand: restore it, or save the model again"
                                  if "does not give" in problem else None)
        return self.files.path_of(name)

    @property
    def weights_sha256(self) -> str:
        """The sha256 config.json records for the weights (what an export's manifest names as its source:
        source_model.weights_sha256). Read from the config, not hashed."""
        files = self.description.get("files")
        entry = files.get(WEIGHTS_FILE) if isinstance(files, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            raise CheckpointError(f"{self.files.display(MODEL_CONFIG_FILE)} does not record {WEIGHTS_FILE} (its size "
                                  "and sha256): the config was edited",
                                  hint="restore the model directory's config.json, or save the model again")
        return entry["sha256"]


def _read(pinned: PinnedDir) -> ModelDir:
    cfg_path = pinned.display(MODEL_CONFIG_FILE)
    if not pinned.is_file(MODEL_CONFIG_FILE):
        what = "is not a file" if os.path.lexists(os.path.join(pinned.path, MODEL_CONFIG_FILE)) else "is missing"
        raise CheckpointError(f"{cfg_path} {what}: {pinned.path!r} is not a transduce model directory")
    try:
        cfg = pinned.read_json(MODEL_CONFIG_FILE)
    except OSError as e:
        raise CheckpointError(f"{cfg_path} cannot be read ({e.strerror})") from None
    except ValueError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON ({e}); the file is truncated or corrupt") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_path} does not hold a JSON object (found {type(cfg).__name__}); the file is "
                              "corrupt")
    if cfg.get("format") != FORMAT:
        raise CheckpointError(f"{cfg_path} is not a transduce model config")
    if cfg.get("format_version") != CONFIG_FORMAT_VERSION:
        raise CheckpointError(
            f"{cfg_path} has format_version {cfg.get('format_version')}, this transduce reads "
            f"{CONFIG_FORMAT_VERSION}"
        )
    layout = cfg.get("weights_layout_version", 1)  # absent: written before the layout was versioned, at 1
    if layout != WEIGHTS_LAYOUT_VERSION:
        raise CheckpointError(f"{cfg_path} has weights_layout_version {layout!r}, this transduce reads "
                              f"{WEIGHTS_LAYOUT_VERSION}",
                              hint="save the model again with the transduce that wrote it, or train it again with "
                                   "this one")
    try:
        config = ModelConfig.from_dict(cfg.get("model", {}))
    except ConfigError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from None
    try:
        defaults = read_defaults(cfg)
    except ConfigError as e:
        raise CheckpointError(f"{cfg_path}: {e}", hint="restore the model directory's config.json, or import "
                              "the model again") from None
    return ModelDir(pinned.path, cfg, config, pinned, defaults)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """A model directory's config.json, checked (ModelDir.load)."""
    return ModelDir.load(path).description


def verify_model_dir(path: str | os.PathLike) -> dict[str, Any]:
    """ModelDir.load, and the weights and tokenizer are there with their recorded sizes and hashes (without
    loading them). -> the config dict."""
    model_dir = ModelDir.load(path)
    for name in (WEIGHTS_FILE, TOKENIZER_FILE):
        model_dir.verified(name)
    return model_dir.description


def weights_sha256(path: str | os.PathLike) -> str:
    """The sha256 a model directory's config.json records for its weights (ModelDir.weights_sha256)."""
    return ModelDir.load(path).weights_sha256


def model_config(path: str | os.PathLike) -> ModelConfig:
    return ModelDir.load(path).config


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


def write_config(directory: str, model_cfg: ModelConfig, files: dict[str, dict[str, Any]],
                 training: dict[str, Any] | None = None, decoding_defaults: DecodingDefaults | None = None) -> None:
    """Write config.json into `directory` (a model directory being written): the model config, the
    {sha256, bytes} of every other file, the training summary, and the model's decoding defaults if it has any."""
    extra = {DEFAULTS_KEY: decoding_defaults.to_dict()} if decoding_defaults is not None else {}
    write_json(os.path.join(directory, MODEL_CONFIG_FILE), {
        "format": FORMAT,
        "format_version": CONFIG_FORMAT_VERSION,
        "weights_layout_version": WEIGHTS_LAYOUT_VERSION,
        "model": model_cfg.to_dict(),
        "files": files,
        "training": training or {},
        **extra,
    })


def saved_config_json(model_cfg: ModelConfig) -> str:
    """The model config as the weights' metadata keeps it (WEIGHTS_CONFIG_KEY)."""
    return json.dumps(model_cfg.to_dict(), sort_keys=True)
