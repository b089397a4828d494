"""The options of a training run (TrainConfig), each checked when it is made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from transduce.errors import ConfigError
from transduce.runtime.spec import MAX_THREADS

MIN_VOCAB = 8  # the 4 specials and a few symbols; the BPE vocabulary never ends smaller than the alphabet


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "tiny"  # model preset (base, big, tiny)
    model_overrides: dict = field(default_factory=dict)  # ModelConfig fields overriding the preset
    vocab_size: int = 8000  # BPE vocabulary to learn (may end smaller on a small corpus)
    max_steps: int = 100_000  # optimizer steps (the paper's base model: 100,000 with warmup 4000)
    warmup: int = 4000  # warmup_steps of the schedule
    lr_scale: float = 1.0  # the schedule's constant factor
    max_tokens: int = 4096  # padded tokens per side per batch: the global batch, shared by every rank
    accumulate: int = 1  # parts each rank's share of a batch is run in, one after the other (gradient accumulation)
    label_smoothing: float = 0.1  # epsilon_ls
    clip_norm: float = 0.0  # gradient clipping by global norm; 0 disables
    eval_every: int = 500  # steps between validations
    save_every: int = 1000  # steps between checkpoints
    eval_sentences: int = 200  # held-out sentences decoded for BLEU and exact match
    seed: int = 1  # model init, dropout and batch order
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    device: str = "cpu"  # torch device to train on: cpu, cuda, cuda:1 (checkpoints are saved for the CPU)
    stream: bool = False  # read the corpus from disk window by window instead of whole (training.stream)
    stream_window: int = 100_000  # pairs read, sorted by length and cut into batches together, when streaming
    collective_timeout: float = 1800.0  # seconds a rank waits for the others (several processes) before it fails

    def __post_init__(self) -> None:
        problems: dict[str, str] = {}  # field -> what is wrong with it (named as Python spells it: params)
        for name, low in (("max_steps", 1), ("warmup", 1), ("max_tokens", 8), ("eval_every", 1), ("save_every", 1),
                          ("eval_sentences", 0), ("threads", 0), ("clip_norm", 0), ("vocab_size", MIN_VOCAB),
                          ("accumulate", 1), ("stream_window", 1)):
            if getattr(self, name) < low:
                problems[name] = f"{name} must be >= {low}, got {getattr(self, name)}"
        if self.threads > MAX_THREADS:
            problems["threads"] = f"threads must be at most {MAX_THREADS}, got {self.threads}"
        if not -(2**63) <= self.seed < 2**64:  # what torch.manual_seed takes
            problems["seed"] = f"seed must be in [-2**63, 2**64), got {self.seed}"
        if self.vocab_size >= 2**31:
            problems["vocab_size"] = f"vocab_size must be < 2**31, got {self.vocab_size:,}"
        if not (math.isfinite(self.lr_scale) and self.lr_scale > 0):
            problems["lr_scale"] = f"lr_scale must be a finite number > 0, got {self.lr_scale}"
        if not math.isfinite(self.clip_norm):
            problems["clip_norm"] = f"clip_norm must be finite (0: off), got {self.clip_norm}"
        if not (math.isfinite(self.collective_timeout) and self.collective_timeout > 0):
            problems["collective_timeout"] = ("collective_timeout must be a finite number of seconds > 0, "
                                              f"got {self.collective_timeout}")
        if not 0.0 <= self.label_smoothing < 1.0:
            problems["label_smoothing"] = f"label_smoothing must be in [0, 1), got {self.label_smoothing}"
        if problems:
            raise ConfigError("invalid training options: " + "; ".join(problems.values()),
                              hint="see transduce train --help", params=tuple(problems))

    # What --resume may change: when to stop, evaluate and save, how many threads, the device, how a batch is
    # split into parts, how long ranks wait. Every other field decides the tokenizer, the model, the batches or
    # the schedule the checkpoint was made with.
    RESUMABLE_CHANGES = ("max_steps", "eval_every", "save_every", "eval_sentences", "threads", "device", "accumulate",
                         "collective_timeout")
    # those of them that change how the sums are ordered: a resume that changes them is not bit for bit
    HARDWARE_CHANGES = ("device", "threads", "accumulate")
