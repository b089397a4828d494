"""What a training run checks before it starts: the device, the output directory, and that a resumed run
continues the same options and data."""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import asdict
from typing import Any

from transduce.errors import ConfigError, TransduceWarning
from transduce.formats.kinds import is_model_dir
from transduce.io.paths import check_replaceable
from transduce.training.config import TrainConfig


def training_device(name: str):
    """The torch device to train on, or a ConfigError saying why it cannot be used."""
    import torch

    from transduce.runtime.devices import torch_device

    return torch.device(torch_device(name, "--device", ConfigError, runs="training runs",
                                     cpu_hint="train with --device cpu, or install a CUDA build of torch "
                                              "on a GPU machine"))


def check_train_output(out_dir: str, force: bool) -> bool:
    """A new run may write `out_dir` if nothing is there, an empty directory, or (with force) a model
    directory; never over other files (replacing a model directory deletes what was in it). -> whether
    it replaces an existing model directory."""
    return check_replaceable(out_dir, force, is_model_dir, "a model directory", "model directories",
                             ConfigError, "--out",
                             force_hint="pass --resume to continue its run, --force to replace it, "
                                        "or choose another --out")


def pairs_sha256(pairs: list[tuple[str, str]]) -> str:
    """A fingerprint of the training pairs, in order (the batches and their order derive from them)."""
    h = hashlib.sha256()
    for src, tgt in pairs:
        add_to_fingerprint(h, src, tgt)
    return h.hexdigest()


def add_to_fingerprint(h, src: str, tgt: str) -> None:
    """One pair into pairs_sha256's hash (a streamed corpus's pass computes the same one)."""
    h.update(src.encode("utf-8", "surrogatepass") + b"\t" + tgt.encode("utf-8", "surrogatepass") + b"\n")


def held_out_overlap(pairs: list[tuple[str, str]], valid_pairs: list[tuple[str, str]]) -> int:
    """How many held-out pairs are also training pairs (a corpus with repeated lines, a --valid file cut from
    the training data), compared as training sees them (stripped)."""
    seen = {(s.strip(), t.strip()) for s, t in pairs}
    return sum((s.strip(), t.strip()) in seen for s, t in valid_pairs)


def warn_overlap(overlap: int, held_out: int) -> None:
    """The held-out pairs that are also training pairs (held_out_overlap) make the validation figures look better
    than the model is."""
    if overlap:
        warnings.warn(f"{overlap} of the {held_out} held-out pairs are also training pairs (the same source "
                      "and target): the validation BLEU and exact match over-state how the model does on unseen text; "
                      "remove them from the training data, or hold out others", stacklevel=4)


def check_resumable(state: dict[str, Any], train_cfg: TrainConfig, data_sha256: str, out_dir: str,
                    ranks: int = 1) -> None:
    """Refuse to resume with options or data other than the checkpoint's (beyond RESUMABLE_CHANGES); warn where
    the sums will be ordered otherwise (HARDWARE_CHANGES, another number of processes: `ranks`)."""
    saved = state.get("train_config", {})
    def flag(name: str) -> str:  # the option of a field, as `transduce train` spells it
        return {"model_overrides": "--set", "preset": "--preset"}.get(name, "--" + name.replace("_", "-"))

    diffs = {name: f"{flag(name)} {saved[name]!r} -> {value!r}" for name, value in asdict(train_cfg).items()
             if name in saved and saved[name] != value}
    changed = [d for name, d in diffs.items() if name not in TrainConfig.RESUMABLE_CHANGES]
    if changed:
        raise ConfigError(f"--resume: this run's options differ from those {out_dir!r} was trained with: "
                          + "; ".join(changed),
                          hint="pass the saved values (they are in training/state.json), or train a new model "
                               f"into another --out; --resume may change only "
                               f"{', '.join(flag(n) for n in TrainConfig.RESUMABLE_CHANGES)}")
    moved = [d for name, d in diffs.items() if name in TrainConfig.HARDWARE_CHANGES]
    if state.get("world_size", 1) != ranks:
        moved.append(f"processes {state.get('world_size', 1)} -> {ranks}")
    if moved:
        warnings.warn(f"--resume on other hardware settings ({'; '.join(moved)}): training goes on from the saved "
                      "state, but not bit for bit as the uninterrupted run would (sums in another order, and no "
                      "saved random state for a GPU or a process the run did not have)", stacklevel=2)
    if state.get("data_sha256") not in (None, data_sha256):
        raise ConfigError(f"--resume: the training data differ from those {out_dir!r} was trained on "
                          "(another file, other lines, or a different --valid-size split)",
                          hint="pass the same --data/--source/--target and --valid/--valid-size as the first run")


def warn_short_schedule(train_cfg: TrainConfig) -> None:
    """A run that ends within its warmup never reaches the schedule's peak learning rate, let alone its decay."""
    if train_cfg.warmup >= train_cfg.max_steps:
        warnings.warn(TransduceWarning(
            f"warmup {train_cfg.warmup} >= max_steps {train_cfg.max_steps}: the learning rate rises for the whole run "
            f"and never gets past the schedule's warmup (the peak is at step {train_cfg.warmup}); train for more "
            "steps than warmup, or lower warmup", params=("warmup", "max_steps")), stacklevel=2)


# bytes a checkpoint holds besides the tensors: config.json, training/state.json (the validation history), the
# safetensors headers, the RNG state; and per tokenizer entry (its vocabulary line and its merge, as JSON)
CHECKPOINT_EXTRA_BYTES = 1 << 20
TOKENIZER_BYTES_PER_ENTRY = 100


def checkpoint_bytes(model, vocab_size: int) -> int:
    """An estimate of one checkpoint's bytes: the weights as saved (fp32), Adam's two moments (each the size of the
    parameters), the tokenizer, and what else is written. A new checkpoint is written in full beside the last one
    before it replaces it, so this much must be free."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    moments = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    return weights + moments + TOKENIZER_BYTES_PER_ENTRY * vocab_size + CHECKPOINT_EXTRA_BYTES
