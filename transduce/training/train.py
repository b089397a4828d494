"""Training the reference model the paper's way, with checkpoints and exact resume.

Adam(0.9, 0.98, eps 1e-9); lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5);
label smoothing 0.1 over the non-pad vocabulary, padding ignored; token-count batches from
length-sorted buckets; optional gradient clipping. Validation loss, greedy exact match and BLEU
(sacrebleu) at intervals; a checkpoint every `save_every` steps, at the end, and on Ctrl-C or SIGTERM
(stopping). `resume` restores the model, optimizer, step, epoch position and RNG state, and continues as
if uninterrupted. One run at a time writes a model directory (formats.locks).
"""

from __future__ import annotations

import functools
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from transduce.errors import ConfigError, DataError, TrainingDiverged
from transduce.training.checks import (
    check_resumable,
    check_train_output,
    checkpoint_bytes,
    held_out_overlap,
    pairs_sha256,
    training_device,
    warn_short_schedule,
)
from transduce.training.config import TrainConfig
from transduce.training.data import Example
from transduce.training.progress import Progress
from transduce.training.stopping import SkipValidation, StopAfterTheStep, stop_after_the_step


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


def _keeps_torch_threads(fn):
    """train() sets torch's intra-op threads for its run (TrainConfig.threads); the caller's setting
    comes back after."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch

        before = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)

    return wrapper


@dataclass
class _Run:
    """One training run: its model, optimizer and data, and how far it is (what a checkpoint saves)."""

    cfg: TrainConfig
    out_dir: str
    model: Any
    tokenizer: Any
    opt: Any
    device: Any
    train_ex: list[Example]
    valid_ex: list[Example]
    valid_pairs: list[tuple[str, str]]
    batches: list[list[int]]
    data_sha256: str
    # a new run's first checkpoint into a new or empty --out writes it only if it is still so: whatever else
    # was written there meanwhile is refused, not deleted; later checkpoints replace our own
    overwrite: bool
    step: int = 0
    epoch: int = 0
    bpos: int = 0  # the next batch's index in this epoch's order
    total_tokens: int = 0
    train_seconds: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    last_metrics: dict[str, Any] = field(default_factory=dict)  # a resumed run's checkpoints keep them
    saved_step: int = 0
    step_seconds: float = 0.0  # the last step's
    shown: Progress | None = None  # the progress bar or lines

    def checkpoint(self) -> None:
        from transduce.models.checkpoint import save_model_dir

        self.saved_step = self.step
        train_state = {"step": self.step, "epoch": self.epoch, "batch": self.bpos, "tokens": self.total_tokens,
                       "history": self.history, "train_seconds": self.train_seconds,
                       "train_config": asdict(self.cfg), "data_sha256": self.data_sha256}
        # this step's, not the last validation's
        summary = {**self.last_metrics, "step": self.step, "train_seconds": round(self.train_seconds, 1)}
        save_model_dir(self.out_dir, self.model, self.tokenizer, training=summary,
                       optimizer_state=self.opt.state_dict(), train_state=train_state, overwrite=self.overwrite)
        self.overwrite = True

    def train_step(self, idx: list[int]):
        """One optimizer step on the batch of examples `idx`; -> (loss, learning rate)."""
        import torch

        from transduce.training.data import collate

        t0 = time.perf_counter()
        mcfg, cfg = self.model.cfg, self.cfg
        src, lens, tin, tout = (t.to(self.device) for t in collate([self.train_ex[i] for i in idx], mcfg.pad_id,
                                                                   mcfg.bos_id, mcfg.eos_id))
        self.step += 1
        self.bpos += 1
        lr = learning_rate(self.step, mcfg.d_model, cfg.warmup, cfg.lr_scale)
        for g in self.opt.param_groups:
            g["lr"] = lr
        loss, _ = label_smoothed_loss(self.model(src, lens, tin), tout, cfg.label_smoothing, mcfg.pad_id)
        if not torch.isfinite(loss.detach()):  # before the weights or a checkpoint take it in
            self.diverged(f"the training loss is {float(loss.detach())}")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        # the gradients' norm (clipped to --clip-norm if set): a finite loss can still have infinite gradients,
        # which the step would write into the weights
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_norm or math.inf)
        if not torch.isfinite(norm):
            self.diverged(f"the gradients' norm is {float(norm)}")
        self.opt.step()
        ntok = int((tout != mcfg.pad_id).sum())
        self.total_tokens += ntok
        self.step_seconds = time.perf_counter() - t0
        self.train_seconds += self.step_seconds
        if self.shown is not None:
            self.shown.update(self.step, float(loss.detach()), lr, ntok, self.step_seconds)
        return loss, lr

    def validate(self, loss, lr: float) -> None:
        t_eval = time.perf_counter()
        cfg = self.cfg
        metrics = evaluate(self.model, self.tokenizer, self.valid_ex, self.valid_pairs, cfg.eval_sentences,
                           cfg.max_tokens)
        self.last_metrics = {"step": self.step, "train_loss": round(float(loss.detach()), 4), "lr": lr,
                             **{k: round(v, 4) for k, v in metrics.items()}}
        self.history.append(self.last_metrics)
        m = self.last_metrics
        msg = (f"step {self.step}: train loss {float(loss.detach()):.3f}, valid nll {m['valid_nll']:.3f}, "
               f"exact match {100 * m['exact_match']:.1f}%, BLEU {m['bleu']:.1f} "
               f"(eval {time.perf_counter() - t_eval:.1f}s)")
        self.shown.write(msg)

    def close_bar(self) -> None:
        if self.shown is not None:
            self.shown.close()

    def diverged(self, what: str) -> None:
        """Stop a run whose loss or gradients are no longer finite, before they reach the weights."""
        self.close_bar()
        kept = (f"the checkpoint of step {self.saved_step} in {self.out_dir} is kept" if self.saved_step
                else "nothing was saved")
        raise TrainingDiverged(f"{what} at step {self.step}: training diverged; {kept}",
                               hint="lower --lr-scale or raise --warmup, and check any --set overrides")


def _load_or_start(train_pairs, valid_pairs, train_cfg: TrainConfig, out_dir: str, resume: bool, data_sha256: str,
                   log: Callable[[str], None]):
    """The model to train: the checkpoint in `out_dir` (resume, checked against this run's options and data) or
    a new one seeded from the config. -> (model, tokenizer, prepared data, train state, optimizer state, RNG)."""
    import torch

    from transduce.models.checkpoint import load_model_dir, load_training_state
    from transduce.models.transformer import Transformer

    if not resume:
        tokenizer, mcfg, train_ex, valid_ex, valid_pairs, dropped = prepare(train_pairs, valid_pairs, train_cfg)
        torch.manual_seed(train_cfg.seed)
        model = Transformer(mcfg)
        state = {"step": 0, "epoch": 0, "batch": 0, "tokens": 0, "history": []}
        return model, tokenizer, (train_ex, valid_ex, valid_pairs, dropped), state, None, None
    model, tokenizer, _ = load_model_dir(out_dir)
    state, opt_state, rng = load_training_state(out_dir)
    check_resumable(state, train_cfg, data_sha256, out_dir)
    if state["step"] >= train_cfg.max_steps:
        raise ConfigError(f"--resume: {out_dir} is at step {state['step']} already, and --max-steps is "
                          f"{train_cfg.max_steps}: there is nothing to train",
                          hint=f"pass a --max-steps above {state['step']} to train further")
    before = state.get("train_config", {}).get("max_steps")
    log(f"resuming {out_dir} at step {state['step']} of {train_cfg.max_steps}"
        + (f" (--max-steps was {before})" if before not in (None, train_cfg.max_steps) else ""))
    tokenizer, mcfg, train_ex, valid_ex, valid_pairs, dropped = prepare(train_pairs, valid_pairs, train_cfg,
                                                                        tokenizer=tokenizer)
    if mcfg != model.cfg:
        raise ConfigError(f"--resume: {out_dir} holds a model config that differs from this run's "
                          f"(preset/overrides changed?): {model.cfg} vs {mcfg}")
    return model, tokenizer, (train_ex, valid_ex, valid_pairs, dropped), state, opt_state, rng


def _on_device(model, device, opt_state, rng):
    """The model moved to its device, its Adam optimizer (restored from `opt_state`), and the RNG restored
    (`rng`); -> the optimizer."""
    import torch

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
    return opt


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
    One run at a time writes `out_dir`: a second is refused at once, naming the first's process.
    progress: a bar on a terminal, else a line every progress.LOG_EVERY_S seconds; the validation
    lines print either way. Ctrl-C and SIGTERM save the last whole step and stop (training.stopping).
    """
    with _one_writer(out_dir):
        return _train(train_pairs, valid_pairs, out_dir, train_cfg, resume, progress, log, force)


def _one_writer(out_dir: str):
    """The lock of `out_dir` (formats.locks), held for the whole run: taken before anything else is done (its
    parent checked writable, as every checkpoint is written beside it and renamed into place)."""
    from transduce.formats.locks import output_lock

    return output_lock(out_dir, "the model directory", ConfigError)


@_keeps_torch_threads
def _train(train_pairs, valid_pairs, out_dir: str, train_cfg: TrainConfig, resume: bool, progress: bool, log,
           force: bool) -> dict[str, Any]:
    """train(), its output's lock held."""
    import torch

    from transduce.formats.paths import check_free_space
    from transduce.training.data import make_batches

    replaces = resume or check_train_output(out_dir, force)  # an existing model directory (not an empty one)
    warn_short_schedule(train_cfg)
    data_sha256 = pairs_sha256(train_pairs)
    held_out = len(valid_pairs)
    device = training_device(train_cfg.device)
    if train_cfg.threads:
        torch.set_num_threads(train_cfg.threads)
    model, tokenizer, (train_ex, valid_ex, valid_pairs, dropped), state, opt_state, rng = _load_or_start(
        train_pairs, valid_pairs, train_cfg, out_dir, resume, data_sha256, log)
    model.train()
    mcfg = model.cfg
    save_bytes = checkpoint_bytes(model, tokenizer.vocab_size)
    check_free_space(out_dir, save_bytes, "the checkpoint", ConfigError)
    if dropped:
        log(f"dropped {dropped} training pairs longer than max_positions={mcfg.max_positions}")
    if len(valid_pairs) < held_out:
        log(f"dropped {held_out - len(valid_pairs)} held-out pairs longer than max_positions={mcfg.max_positions}")
    opt = _on_device(model, device, opt_state, rng)
    history = state.get("history", [])
    run = _Run(train_cfg, out_dir, model, tokenizer, opt, device, train_ex, valid_ex, valid_pairs,
               make_batches(train_ex, train_cfg.max_tokens), data_sha256, overwrite=replaces, step=state["step"],
               epoch=state["epoch"], bpos=state["batch"], total_tokens=state.get("tokens", 0),
               train_seconds=state.get("train_seconds", 0.0), history=history,
               last_metrics=history[-1] if history else {}, saved_step=state["step"])
    log(f"model: {mcfg.encoder_layers}+{mcfg.decoder_layers} layers, d_model {mcfg.d_model}, "
        f"{model.num_parameters():,} parameters, vocabulary {mcfg.vocab_size}; "
        f"{len(train_ex)} training pairs in {len(run.batches)} batches, {len(valid_ex)} held out; "
        f"torch threads {torch.get_num_threads()}")
    with stop_after_the_step(save_bytes) as stopper:
        run.shown = Progress(train_cfg.max_steps, run.step, log, enabled=progress)
        try:
            _train_loop(run, stopper, log)
        finally:
            run.close_bar()
    return {"step": run.step, "train_seconds": round(run.train_seconds, 1), "tokens": run.total_tokens,
            "parameters": model.num_parameters(), **run.last_metrics}


def _train_loop(run: _Run, stopper: StopAfterTheStep, log: Callable[[str], None]) -> None:
    """Steps until max_steps, validating and saving on schedule; a signal (stopper) stops it after a whole step,
    its checkpoint saved."""
    from transduce.training.data import epoch_order

    cfg = run.cfg
    while run.step < cfg.max_steps:
        order = epoch_order(len(run.batches), cfg.seed, run.epoch)
        while run.bpos < len(order) and run.step < cfg.max_steps:
            stopper.set_phase("step")
            loss, lr = run.train_step(run.batches[order[run.bpos]])
            stopper.longest_step = max(stopper.longest_step, run.step_seconds)
            last = run.step == cfg.max_steps
            if run.step % cfg.eval_every == 0 or last:
                _validate_unless_stopping(run, stopper, loss, lr, last)
            if run.step % cfg.save_every == 0 or last:
                with stopper.saving():
                    run.checkpoint()
            if stopper.signum is not None and not last:  # the step is whole, so is its checkpoint
                if run.saved_step != run.step:
                    with stopper.saving():
                        run.checkpoint()
                run.close_bar()
                message = (f"interrupted at step {run.step} of {cfg.max_steps} by {stopper.name()}: checkpoint "
                           f"saved in {run.out_dir} (continue with the same command and --resume)")
                log(message)
                stopper.stop(message, run.step, run.out_dir)
        if run.bpos >= len(order):
            run.epoch, run.bpos = run.epoch + 1, 0


def _validate_unless_stopping(run: _Run, stopper: StopAfterTheStep, loss, lr: float, last: bool) -> None:
    """Validate, unless a signal stops the run first: one taken in before or during the validation cuts it short
    (the handler raises SkipValidation inside it). The last step's always runs: the run's summary is its."""
    if last:
        run.validate(loss, lr)
        return
    try:
        stopper.set_phase("validate")  # from here the handler raises; the phase is set back inside the try
        if stopper.signum is None:
            run.validate(loss, lr)
        stopper.set_phase("step")
    except SkipValidation:
        stopper.set_phase("step")


def default_out_dir() -> str:
    return os.path.join("runs", "demo", "model")


def train_from_files(out_dir: str, train_cfg: TrainConfig, data: str | None = None, source: str | None = None,
                     target: str | None = None, valid: str | None = None, valid_size: int = 300,
                     resume: bool = False, progress: bool = True, force: bool = False,
                     log: Callable[[str], None] = print) -> dict[str, Any]:
    """`transduce train`: read the corpus (or make the embedded one), hold out a validation set, train (as train()
    does, the lock of `out_dir` taken before the corpus is read)."""

    if data and (source or target):
        raise ConfigError("give either --data (TSV) or --source/--target (aligned files), not both")
    if bool(source) != bool(target):
        raise ConfigError("--source and --target go together")
    with _one_writer(out_dir):  # before reading the corpus: a second run into out_dir is refused at once
        pairs, valid_pairs = _corpus(data, source, target, valid, valid_size)
        return _train(pairs, valid_pairs, out_dir, train_cfg, resume, progress, log, force)


def _corpus(data, source, target, valid, valid_size) -> tuple[list, list]:
    """train_from_files' training and held-out pairs; the held-out ones that are also training pairs are counted in
    a warning."""
    from transduce.formats.parallel import read_parallel
    from transduce.models.corpus import demo_corpus

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
                      "remove them from the training data, or hold out others", stacklevel=3)
    return pairs, valid_pairs
