"""The torch device a --device flag names: one check for training, the eager backend and parity."""

from __future__ import annotations

from transduce.errors import InputError


def torch_device(name: str, option: str = "--device", error: type[Exception] = InputError,
                 runs: str = "eager PyTorch runs", unavailable: type[Exception] | None = None,
                 cpu_hint: str | None = None) -> str:
    """`name` normalised for torch ("cuda" -> "cuda:N", the current GPU), or an `error` naming `option`
    where it is not a device or not cpu/cuda, and an `unavailable` (default: `error`) where this torch
    sees no such GPU. `runs`: what the message says runs on cpu or cuda; cpu_hint: the no-GPU hint."""
    import torch

    choices = f"{option} cpu, cuda or cuda:N"
    try:
        d = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise error(f"{option} {name!r} is not a torch device", hint=choices) from None
    if d.type == "cpu":
        return "cpu"
    if d.type != "cuda":
        raise error(f"{option} {name}: {runs} on cpu or cuda", hint=choices)
    missing = unavailable or error
    if not torch.cuda.is_available():
        raise missing(f"{option} {name}: this torch sees no usable CUDA GPU (torch {torch.__version__})",
                      hint=cpu_hint or f"{option} cpu")
    index = torch.cuda.current_device() if d.index is None else d.index
    if index >= torch.cuda.device_count():
        raise missing(f"{option} {name}: there are {torch.cuda.device_count()} CUDA GPUs", hint="cuda:0 is the first")
    return f"cuda:{index}"
