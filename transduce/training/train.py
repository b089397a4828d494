"""Training the reference model the paper's way, with checkpoints and exact resume.

Adam(0.9, 0.98, eps 1e-9); lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5);
label smoothing 0.1 over the non-pad vocabulary, padding ignored; token-count batches from
length-sorted buckets; optional gradient clipping. Validation loss, greedy exact match and BLEU
(sacrebleu) at intervals; a checkpoint every `save_every` steps and at the end. `resume` restores
the model, optimizer, step, epoch position and RNG state, and continues as if uninterrupted.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from transduce.errors import ConfigError, DataError, TrainingDiverged
from transduce.formats.kinds import is_model_dir
from transduce.formats.paths import check_replaceable
from transduce.training.data import Example

MIN_VOCAB = 8  # the 4 specials and a few symbols; the BPE vocabulary never ends smaller than the alphabet


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "tiny"  # model preset (base, big, tiny)
    model_overrides: dict = field(default_factory=dict)  # ModelConfig fields overriding the preset
    vocab_size: int = 8000  # BPE vocabulary to learn (may end smaller on a small corpus)
    max_steps: int = 2000  # optimizer steps
    warmup: int = 4000  # warmup_steps of the schedule
    lr_scale: float = 1.0  # the schedule's constant factor
    max_tokens: int = 4096  # padded tokens per side per batch
    label_smoothing: float = 0.1  # epsilon_ls
    clip_norm: float = 0.0  # gradient clipping by global norm; 0 disables
    eval_every: int = 500  # steps between validations
    save_every: int = 1000  # steps between checkpoints
    eval_sentences: int = 200  # held-out sentences decoded for BLEU and exact match
    seed: int = 1  # model init, dropout and batch order
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    device: str = "cpu"  # torch device to train on: cpu, cuda, cuda:1 (checkpoints are saved for the CPU)

    def __post_init__(self) -> None:
        problems = [f"{name} must be >= {low}, got {getattr(self, name)}" for name, low in
                    (("max_steps", 1), ("warmup", 1), ("max_tokens", 8), ("eval_every", 1), ("save_every", 1),
                     ("eval_sentences", 0), ("threads", 0), ("clip_norm", 0), ("vocab_size", MIN_VOCAB))
                    if getattr(self, name) < low]
        if not -(2**63) <= self.seed < 2**64:  # what torch.manual_seed takes
            problems.append(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.vocab_size >= 2**31:
            problems.append(f"vocab_size must be < 2**31, got {self.vocab_size:,}")
        if not (math.isfinite(self.lr_scale) and self.lr_scale > 0):
            problems.append(f"lr_scale must be a finite number > 0, got {self.lr_scale}")
        if not math.isfinite(self.clip_norm):
            problems.append(f"clip_norm must be finite (0: off), got {self.clip_norm}")
        if not 0.0 <= self.label_smoothing < 1.0:
            problems.append(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if problems:
            raise ConfigError("invalid training options: " + "; ".join(problems), hint="see transduce train --help")

    # What --resume may change: when to stop, evaluate and save, how many threads. Every other field
    # decides the tokenizer, the model, the batches or the schedule the checkpoint was made with.
    RESUMABLE_CHANGES = ("max_steps", "eval_every", "save_every", "eval_sentences", "threads", "device")


def learning_rate(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """The paper's schedule: scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def label_smoothed_loss(logits, target, epsilon: float, pad_id: int):
    """Mean over non-pad targets of (1-eps) * NLL + eps * mean over non-pad classes of -log p.

    logits (B, T, V), target (B, T). Returns (loss, nll) as tensors; nll is the unsmoothed mean.
    """
    import torch

    lprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    mask = target != pad_id
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (B, T)
    smooth = -(lprobs.sum(-1) - lprobs[..., pad_id]) / (lprobs.shape[-1] - 1)  # uniform over non-pad
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    n = mask.sum().clamp(min=1)
    return (loss * mask).sum() / n, (nll * mask).sum() / n


def evaluate(model, tokenizer, examples: list[Example], pairs: list[tuple[str, str]], n_sentences: int,
             max_tokens: int) -> dict[str, float]:
    """Validation loss (smoothed and NLL, per token), greedy exact match and BLEU on held-out pairs."""
    import numpy as np
    import sacrebleu
    import torch

    from transduce.runtime.backends.torch_backend import TorchBackend
    from transduce.runtime.decoding import DecodingOptions, decode
    from transduce.training.data import collate, make_batches

    cfg = model.cfg
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tot_nll, tot_tok = 0.0, 0
    with torch.inference_mode():
        for idx in make_batches(examples, max_tokens):
            src, lens, tin, tout = (t.to(device) for t in collate([examples[i] for i in idx], cfg.pad_id, cfg.bos_id,
                                                                  cfg.eos_id))
            _, nll = label_smoothed_loss(model(src, lens, tin), tout, 0.0, cfg.pad_id)
            n = int((tout != cfg.pad_id).sum())
            tot_nll += float(nll) * n
            tot_tok += n
    sub = examples[:n_sentences]
    refs = [tokenizer.normalize(t) for _, t in pairs[: len(sub)]]  # what a decode can give back at best
    backend = TorchBackend(model, str(device))
    hyps: list[str] = []
    opts = DecodingOptions(beam_size=1)
    for idx in make_batches(sub, max_tokens):
        batch = [sub[i] for i in idx]
        src, lens, _, _ = collate(batch, cfg.pad_id, cfg.bos_id, cfg.eos_id)
        res = decode(backend, src.numpy(), lens.numpy(), opts)
        for i, r in zip(idx, res):
            hyps.append((i, tokenizer.decode(r.best.tokens)))
    hyps_text = [h for _, h in sorted(hyps)]
    if was_training:
        model.train()
    exact = float(np.mean([h == r for h, r in zip(hyps_text, refs)])) if refs else 0.0
    bleu = sacrebleu.corpus_bleu(hyps_text, [refs]).score if refs else 0.0
    nll = tot_nll / max(tot_tok, 1)
    return {"valid_nll": nll, "valid_ppl": math.exp(min(nll, 50.0)), "exact_match": exact, "bleu": bleu}


def prepare(train_pairs, valid_pairs, train_cfg: TrainConfig, tokenizer=None):
    """Train (or reuse) the tokenizer, build the model config, and encode both corpora."""
    from transduce.models.checkpoint import special_id_mismatches
    from transduce.models.config import preset
    from transduce.tokenizer import Tokenizer
    from transduce.training.data import encode_pairs

    if tokenizer is None:
        tokenizer = Tokenizer.train((s for p in train_pairs for s in p), train_cfg.vocab_size)
    mcfg = preset(train_cfg.preset, tokenizer.vocab_size, train_cfg.model_overrides)
    wrong = special_id_mismatches(mcfg, tokenizer)
    if wrong:
        raise ConfigError(f"the model's special ids must be the tokenizer's: {', '.join(wrong)}",
                          hint="drop these --set overrides")
    train_ex, kept = encode_pairs(tokenizer, train_pairs, mcfg.max_positions)
    valid_ex, vkept = encode_pairs(tokenizer, valid_pairs, mcfg.max_positions)
    if not train_ex:
        raise DataError("no training pair fits the model's max_positions")
    if not valid_pairs:
        raise DataError("there are no held-out pairs to validate on", hint="pass --valid FILE or a --valid-size >= 1")
    if not valid_ex:  # its loss would read 0.000 and its BLEU 0, as if measured
        raise DataError(f"none of the {len(valid_pairs)} held-out pairs fits the model's max_positions "
                        f"({mcfg.max_positions} tokens a side, EOS included)",
                        hint="hold out shorter pairs (--valid FILE), or raise max_positions (--set max_positions=N)")
    return tokenizer, mcfg, train_ex, valid_ex, [valid_pairs[i] for i in vkept], len(train_pairs) - len(kept)


def training_device(name: str):
    """The torch device to train on, or a ConfigError saying why it cannot be used."""
    import torch

    from transduce.runtime.devices import torch_device

    return torch.device(torch_device(name, "--device", ConfigError, runs="training runs",
                                     cpu_hint="train with --device cpu, or install a CUDA build of torch on a GPU machine"))


def check_train_output(out_dir: str, force: bool) -> bool:
    """A new run may write `out_dir` if nothing is there, an empty directory, or (with force) a model
    directory; never over other files (replacing a model directory deletes what was in it). -> whether
    it replaces an existing model directory."""
    return check_replaceable(out_dir, force, is_model_dir, "a model directory", "model directories",
                             ConfigError, "--out", force_hint="pass --resume to continue its run, --force to replace it, or choose another --out")


@contextlib.contextmanager
def _interrupt_after_the_step():
    """Yield a list that a first Ctrl-C (SIGINT) makes non-empty instead of stopping the process mid-step
    (a half-applied optimizer step would make an inconsistent checkpoint); a second one stops at once.
    Only in the main thread, where Python delivers signals."""
    flag: list[bool] = []
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) in (
            signal.SIG_IGN, None):  # ignored (a background job) or not Python's to change
        yield flag
        return

    def on_sigint(signum, frame):
        if flag:
            raise KeyboardInterrupt
        flag.append(True)
        # os.write, not print: the handler may run while the main thread is inside a print
        os.write(2, b"\ninterrupt: saving a checkpoint after this step (Ctrl-C again to stop without one)\n")

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def pairs_sha256(pairs: list[tuple[str, str]]) -> str:
    """A fingerprint of the training pairs, in order (the batches and their order derive from them)."""
    h = hashlib.sha256()
    for src, tgt in pairs:
        h.update(src.encode("utf-8", "surrogatepass") + b"\t" + tgt.encode("utf-8", "surrogatepass") + b"\n")
    return h.hexdigest()


def held_out_overlap(pairs: list[tuple[str, str]], valid_pairs: list[tuple[str, str]]) -> int:
    """How many held-out pairs are also training pairs (a corpus with repeated lines, a --valid file cut from
    the training data), compared as training sees them (stripped)."""
    seen = {(s.strip(), t.strip()) for s, t in pairs}
    return sum((s.strip(), t.strip()) in seen for s, t in valid_pairs)


def check_resumable(state: dict[str, Any], train_cfg: TrainConfig, data_sha256: str, out_dir: str) -> None:
    """Refuse to resume with options or data other than the checkpoint's (beyond RESUMABLE_CHANGES)."""
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
    moved = [d for name, d in diffs.items() if name in ("device", "threads")]
    if moved:
        warnings.warn(f"--resume on other hardware settings ({'; '.join(moved)}): training goes on from the saved "
                      "state, but not bit for bit as the uninterrupted run would (sums in another order, and no "
                      "saved random state for a GPU the run did not use)", stacklevel=2)
    if state.get("data_sha256") not in (None, data_sha256):
        raise ConfigError(f"--resume: the training data differ from those {out_dir!r} was trained on "
                          "(another file, other lines, or a different --valid-size split)",
                          hint="pass the same --data/--source/--target and --valid/--valid-size as the first run")


def _keeps_torch_threads(fn):
    """train() sets torch's intra-op threads for its run (TrainConfig.threads); the caller's setting comes back after."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch

        before = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)

    return wrapper


@_keeps_torch_threads
def train(
    train_pairs: list[tuple[str, str]],
    valid_pairs: list[tuple[str, str]],
    out_dir: str,
    train_cfg: TrainConfig,
    resume: bool = False,
    progress: bool = True,
    log=print,
    force: bool = False,
) -> dict[str, Any]:
    """Train and write the model directory `out_dir`. Returns the final summary (metrics, timings).

    Without resume, an existing `out_dir` is an error unless force, and even then only a model
    directory (or an empty one) is replaced; its parent must be writable before training starts.
    """
    import torch

    from transduce.formats.paths import check_parent_writable
    from transduce.models.checkpoint import load_model_dir, load_training_state, save_model_dir
    from transduce.models.transformer import Transformer
    from transduce.training.data import collate, epoch_order, make_batches

    replaces = resume or check_train_output(out_dir, force)  # an existing model directory (not an empty one)
    check_parent_writable(out_dir)  # every checkpoint is written beside it and renamed: before any training
    data_sha256 = pairs_sha256(train_pairs)
    held_out = len(valid_pairs)
    device = training_device(train_cfg.device)
    if train_cfg.threads:
        torch.set_num_threads(train_cfg.threads)
    if resume:
        model, tokenizer, saved = load_model_dir(out_dir)
        state, opt_state, rng = load_training_state(out_dir)
        check_resumable(state, train_cfg, data_sha256, out_dir)
        if state["step"] >= train_cfg.max_steps:
            raise ConfigError(f"--resume: {out_dir} is at step {state['step']} already, and --max-steps is "
                              f"{train_cfg.max_steps}: there is nothing to train",
                              hint=f"pass a --max-steps above {state['step']} to train further")
        if state.get("train_config", {}).get("max_steps") != train_cfg.max_steps:
            log(f"resume: max_steps {state['train_config'].get('max_steps')} -> {train_cfg.max_steps}")
        tokenizer, mcfg, train_ex, valid_ex, valid_pairs, dropped = prepare(
            train_pairs, valid_pairs, train_cfg, tokenizer=tokenizer)
        if mcfg != model.cfg:
            raise ConfigError(f"--resume: {out_dir} holds a model config that differs from this run's "
                              f"(preset/overrides changed?): {model.cfg} vs {mcfg}")
        model.train()
    else:
        tokenizer, mcfg, train_ex, valid_ex, valid_pairs, dropped = prepare(train_pairs, valid_pairs, train_cfg)
        torch.manual_seed(train_cfg.seed)
        model = Transformer(mcfg)
        model.train()
        state, opt_state, rng = {"step": 0, "epoch": 0, "batch": 0, "tokens": 0, "history": []}, None, None
    if dropped:
        log(f"dropped {dropped} training pairs longer than max_positions={mcfg.max_positions}")
    if len(valid_pairs) < held_out:
        log(f"dropped {held_out - len(valid_pairs)} held-out pairs longer than max_positions={mcfg.max_positions}")

    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the RNG state a checkpoint saves is the current GPU's
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
    if opt_state is not None:
        opt.load_state_dict(opt_state)  # onto the parameters' device
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        if device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], device)
    batches = make_batches(train_ex, train_cfg.max_tokens)
    step, epoch, bpos = state["step"], state["epoch"], state["batch"]
    total_tokens = state.get("tokens", 0)
    history: list[dict[str, Any]] = state.get("history", [])
    train_seconds = state.get("train_seconds", 0.0)
    log(f"model: {mcfg.encoder_layers}+{mcfg.decoder_layers} layers, d_model {mcfg.d_model}, "
        f"{model.num_parameters():,} parameters, vocabulary {mcfg.vocab_size}; "
        f"{len(train_ex)} training pairs in {len(batches)} batches, {len(valid_ex)} held out; "
        f"torch threads {torch.get_num_threads()}")

    saved_step = step
    # a new run's first checkpoint into a new or empty --out writes it only if it is still so: whatever
    # else was written there meanwhile is refused, not deleted; later checkpoints replace our own
    overwrite = replaces

    def checkpoint(metrics: dict[str, Any] | None = None) -> None:
        nonlocal saved_step, overwrite
        saved_step = step
        train_state = {"step": step, "epoch": epoch, "batch": bpos, "tokens": total_tokens,
                       "history": history, "train_seconds": train_seconds,
                       "train_config": asdict(train_cfg), "data_sha256": data_sha256}
        summary = {**(metrics or {}), "step": step, "train_seconds": round(train_seconds, 1)}  # this step, not the last eval's
        save_model_dir(out_dir, model, tokenizer, training=summary, optimizer_state=opt.state_dict(),
                       train_state=train_state, overwrite=overwrite)
        overwrite = True

    bar = None
    if progress:
        from tqdm import tqdm

        # disable=None: no bar when stderr is not a terminal (logs, CI); the validation lines still print
        bar = tqdm(total=train_cfg.max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                   mininterval=0.5, disable=None)
    t_window, tok_window = time.perf_counter(), 0
    last_metrics: dict[str, Any] = history[-1] if history else {}  # a resumed run's checkpoints keep them
    with _interrupt_after_the_step() as interrupted:
        while step < train_cfg.max_steps:
            order = epoch_order(len(batches), train_cfg.seed, epoch)
            while bpos < len(order) and step < train_cfg.max_steps:
                t0 = time.perf_counter()
                idx = batches[order[bpos]]
                src, lens, tin, tout = (t.to(device) for t in collate([train_ex[i] for i in idx], mcfg.pad_id,
                                                                        mcfg.bos_id, mcfg.eos_id))
                step += 1
                bpos += 1
                lr = learning_rate(step, mcfg.d_model, train_cfg.warmup, train_cfg.lr_scale)
                for g in opt.param_groups:
                    g["lr"] = lr
                loss, nll = label_smoothed_loss(model(src, lens, tin), tout, train_cfg.label_smoothing, mcfg.pad_id)
                if not torch.isfinite(loss.detach()):  # before the weights or a checkpoint take it in
                    _diverged(f"the training loss is {float(loss.detach())}", step, saved_step, out_dir, bar)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                # the gradients' norm (clipped to --clip-norm if set): a finite loss can still have
                # infinite gradients, which the step would write into the weights
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.clip_norm or math.inf)
                if not torch.isfinite(norm):
                    _diverged(f"the gradients' norm is {float(norm)}", step, saved_step, out_dir, bar)
                opt.step()
                ntok = int((tout != mcfg.pad_id).sum())
                total_tokens += ntok
                tok_window += ntok
                train_seconds += time.perf_counter() - t0
                if bar is not None:
                    now = time.perf_counter()
                    bar.update(1)
                    if step % 10 == 0:
                        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", lr=f"{lr:.2e}",
                                        tok_s=f"{tok_window / max(now - t_window, 1e-9):.0f}")
                        t_window, tok_window = now, 0
                if step % train_cfg.eval_every == 0 or step == train_cfg.max_steps:
                    t_eval = time.perf_counter()
                    last_metrics = evaluate(model, tokenizer, valid_ex, valid_pairs, train_cfg.eval_sentences,
                                            train_cfg.max_tokens)
                    last_metrics = {"step": step, "train_loss": round(float(loss.detach()), 4), "lr": lr,
                                    **{k: round(v, 4) for k, v in last_metrics.items()}}
                    history.append(last_metrics)
                    msg = (f"step {step}: train loss {float(loss.detach()):.3f}, valid nll {last_metrics['valid_nll']:.3f}, "
                           f"exact match {100 * last_metrics['exact_match']:.1f}%, BLEU {last_metrics['bleu']:.1f} "
                           f"(eval {time.perf_counter() - t_eval:.1f}s)")
                    if bar is not None:
                        bar.write(msg, file=sys.stderr)  # beside the bar, off stdout (the CLI's JSON summary)
                    else:
                        log(msg)
                if step % train_cfg.save_every == 0 or step == train_cfg.max_steps:
                    checkpoint(last_metrics)
                if interrupted and step < train_cfg.max_steps:  # Ctrl-C: the step is whole, so is its checkpoint
                    if saved_step != step:
                        checkpoint(last_metrics)
                    if bar is not None:
                        bar.close()
                    log(f"interrupted at step {step}: checkpoint saved in {out_dir} (continue with the same "
                        "command and --resume)")
                    raise KeyboardInterrupt
            if bpos >= len(order):
                epoch, bpos = epoch + 1, 0
    if bar is not None:
        bar.close()
    return {"step": step, "train_seconds": round(train_seconds, 1), "tokens": total_tokens,
            "parameters": model.num_parameters(), **last_metrics}


def _diverged(what: str, step: int, saved_step: int, out_dir: str, bar) -> None:
    """Stop a run whose loss or gradients are no longer finite, before they reach the weights."""
    if bar is not None:
        bar.close()
    kept = f"the checkpoint of step {saved_step} in {out_dir} is kept" if saved_step else "nothing was saved"
    raise TrainingDiverged(f"{what} at step {step}: training diverged; {kept}",
                           hint="lower --lr-scale or raise --warmup, and check any --set overrides")


def default_out_dir() -> str:
    return os.path.join("runs", "demo", "model")


def train_from_files(out_dir: str, train_cfg: TrainConfig, data: str | None = None, source: str | None = None,
                     target: str | None = None, valid: str | None = None, valid_size: int = 300,
                     resume: bool = False, progress: bool = True, force: bool = False,
                     log: Callable[[str], None] = print) -> dict[str, Any]:
    """`transduce train`: read the corpus (or make the embedded one), hold out a validation set, train."""
    from transduce.formats.parallel import read_parallel
    from transduce.models.corpus import demo_corpus

    if data and (source or target):
        raise ConfigError("give either --data (TSV) or --source/--target (aligned files), not both")
    if bool(source) != bool(target):
        raise ConfigError("--source and --target go together")
    if data or source:
        pairs = read_parallel(data) if data else read_parallel(source, target)
        if valid:
            valid_pairs = read_parallel(valid)
        else:
            if valid_size < 1:
                raise ConfigError(f"--valid-size must be >= 1, got {valid_size}", hint="or pass --valid FILE")
            if len(pairs) <= valid_size:
                raise DataError(f"the corpus has {len(pairs)} pairs, too few to hold out {valid_size}",
                                hint="pass --valid FILE or a smaller --valid-size")
            pairs, valid_pairs = pairs[:-valid_size], pairs[-valid_size:]
    else:
        pairs, valid_pairs = demo_corpus()
        if valid:
            valid_pairs = read_parallel(valid)
    overlap = held_out_overlap(pairs, valid_pairs)
    if overlap:
        warnings.warn(f"{overlap} of the {len(valid_pairs)} held-out pairs are also training pairs (the same source "
                      "and target): the validation BLEU and exact match over-state how the model does on unseen text; "
                      "remove them from the training data, or hold out others", stacklevel=2)
    return train(pairs, valid_pairs, out_dir, train_cfg, resume=resume, progress=progress, force=force, log=log)
