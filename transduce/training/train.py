"""Training the reference model the paper's way, with checkpoints and exact resume, on one process or several.

Adam(0.9, 0.98, eps 1e-9); lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5);
label smoothing 0.1 over the non-pad vocabulary, padding ignored; token-count batches from
length-sorted buckets (training.data; from disk, window by window: training.stream); optional gradient
clipping. Validation loss, greedy exact match and BLEU (sacrebleu) at intervals; a checkpoint every `save_every`
steps, at the end, and on Ctrl-C or SIGTERM (stopping). `resume` restores the model, optimizer, step, epoch
position and RNG state, and continues as if uninterrupted. One run at a time writes a model directory
(io.locks).

Under torchrun (or `transduce train --nproc N`) the run is data parallel (training.distributed): every rank takes
its share of each global batch, rank 0 alone validates, logs and writes checkpoints, which hold every rank's RNG.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from transduce.errors import ConfigError, DistributedError, TrainingDiverged
from transduce.training.checks import check_train_output, checkpoint_bytes, training_device, warn_short_schedule
from transduce.training.config import TrainConfig
from transduce.training.corpus import read_corpus
from transduce.training.data import Example
from transduce.training.distributed import World, comm_failure, joined
from transduce.training.metrics import evaluate, label_smoothed_loss, learning_rate
from transduce.training.progress import Progress
from transduce.training.start import Start, prepare
from transduce.training.stopping import SkipValidation, StopAfterTheStep, stop_after_the_step

__all__ = ["train", "train_from_files", "learning_rate", "label_smoothed_loss", "evaluate", "prepare"]


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
    source: Any  # the batches: data.Batches, or stream.StreamBatches
    valid_ex: list[Example]
    valid_pairs: list[tuple[str, str]]
    data_sha256: str
    # a new run's first checkpoint into a new or empty --out writes it only if it is still so: whatever else
    # was written there meanwhile is refused, not deleted; later checkpoints replace our own
    overwrite: bool
    world: World = field(default_factory=World)
    net: Any = None  # what a batch goes through: the model, or its DistributedDataParallel wrapper
    step: int = 0
    epoch: int = 0
    window: int = 0  # the next batch's window in this epoch's order (a streamed corpus's; else 0)
    bpos: int = 0  # the next batch's index in this epoch's (or window's) order
    total_tokens: int = 0
    train_seconds: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    last_metrics: dict[str, Any] = field(default_factory=dict)  # a resumed run's checkpoints keep them
    saved_step: int = 0
    step_seconds: float = 0.0  # the last step's
    shown: Progress | None = None  # the progress bar or lines
    save_bytes: int = 0  # a checkpoint's size (estimated)

    def checkpoint(self) -> None:
        """Save the run, on rank 0 (every rank calls it: it gathers their RNG states first)."""
        from transduce.models.checkpoint import save_model_dir

        self.saved_step = self.step
        others = self.world.rng_states(self.device)

        def save() -> None:
            train_state = {"step": self.step, "epoch": self.epoch, "window": self.window, "batch": self.bpos,
                           "tokens": self.total_tokens, "history": self.history,
                           "train_seconds": self.train_seconds, "train_config": asdict(self.cfg),
                           "data_sha256": self.data_sha256, "world_size": self.world.size}
            # this step's, not the last validation's
            summary = {**self.last_metrics, "step": self.step, "train_seconds": round(self.train_seconds, 1)}
            save_model_dir(self.out_dir, self.model, self.tokenizer, training=summary,
                           optimizer_state=self.opt.state_dict(), train_state=train_state, overwrite=self.overwrite,
                           rng_states=others)

        self.world.from_rank0(save, share=lambda _: None)
        self.overwrite = True

    def train_step(self, batch: list[Example]) -> tuple[float, float]:
        """One optimizer step on a global batch, of which this rank takes its share (distributed.split_batch) in
        --accumulate parts; -> (the batch's loss, the learning rate)."""
        import torch

        from transduce.training.data import collate, target_tokens
        from transduce.training.distributed import part_weight, split_batch

        t0 = time.perf_counter()
        mcfg, cfg, world = self.model.cfg, self.cfg, self.world
        self.step += 1
        self.bpos += 1
        lr = learning_rate(self.step, mcfg.d_model, cfg.warmup, cfg.lr_scale)
        for g in self.opt.param_groups:
            g["lr"] = lr
        ntok = target_tokens(batch)
        k = cfg.accumulate
        parts = split_batch(batch, world.size * k)[world.rank * k:(world.rank + 1) * k]
        self.opt.zero_grad(set_to_none=True)
        summed = 0.0  # this rank's weighted part losses
        for i, part in enumerate(parts):
            # an empty part (a batch of fewer pairs than parts) runs one pair at weight 0: every rank must take part
            # in the gradients' exchange
            weight = part_weight(target_tokens(part), ntok, world.size) if part else 0.0
            src, lens, tin, tout = (t.to(self.device) for t in collate(part or batch[:1], mcfg.pad_id, mcfg.bos_id,
                                                                       mcfg.eos_id))
            with self._exchange(i == len(parts) - 1):
                loss, _ = label_smoothed_loss(self.net(src, lens, tin), tout, cfg.label_smoothing, mcfg.pad_id)
                if weight != 1.0:
                    loss = loss * weight
                loss.backward()
            summed += float(loss.detach())
        loss_value = sum(v for (v,) in world.gather_floats([summed])) / world.size  # the same on every rank
        if not math.isfinite(loss_value):  # before the weights or a checkpoint take it in
            self.diverged(f"the training loss is {loss_value}")
        # the gradients' norm (clipped to --clip-norm if set): a finite loss can still have infinite gradients,
        # which the step would write into the weights
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_norm or math.inf)
        if not torch.isfinite(norm):
            self.diverged(f"the gradients' norm is {float(norm)}")
        self.opt.step()
        self.total_tokens += ntok
        self.step_seconds = time.perf_counter() - t0
        self.train_seconds += self.step_seconds
        if self.shown is not None:
            self.shown.update(self.step, loss_value, lr, ntok, self.step_seconds)
        return loss_value, lr

    def _exchange(self, last_part: bool):
        """The gradients are exchanged between ranks (DistributedDataParallel) in the last part's backward only."""
        return self.net.no_sync() if self.net is not self.model and not last_part else contextlib.nullcontext()

    def validate(self, loss: float, lr: float) -> None:
        t_eval = time.perf_counter()
        cfg = self.cfg
        metrics = evaluate(self.model, self.tokenizer, self.valid_ex, self.valid_pairs, cfg.eval_sentences,
                           cfg.max_tokens)
        self.last_metrics = {"step": self.step, "train_loss": round(loss, 4), "lr": lr,
                             **{k: round(v, 4) for k, v in metrics.items()}}
        self.history.append(self.last_metrics)
        m = self.last_metrics
        msg = (f"step {self.step}: train loss {loss:.3f}, valid nll {m['valid_nll']:.3f}, "
               f"exact match {100 * m['exact_match']:.1f}%, BLEU {m['bleu']:.1f} "
               f"(eval {time.perf_counter() - t_eval:.1f}s)")
        self.shown.write(msg)

    def close_bar(self) -> None:
        if self.shown is not None:
            self.shown.close()

    def diverged(self, what: str) -> None:
        """Stop a run whose loss or gradients are no longer finite, before they reach the weights (every rank sees
        the same loss and gradients, so all stop here together)."""
        self.close_bar()
        error = TrainingDiverged(f"{what} at step {self.step}: training diverged; {self.kept()}",
                                 hint="lower --lr-scale or raise --warmup, and check any --set overrides")
        error.mirrored = self.world.rank != 0  # rank 0's copy is printed
        raise error

    def kept(self) -> str:
        """What a run that stops now leaves on disk."""
        return (f"the checkpoint of step {self.saved_step} in {self.out_dir} is kept" if self.saved_step
                else "nothing was saved")


# where a run that loses contact before its first step is (lost_contact)
STARTING = "while starting; nothing was saved"


@contextlib.contextmanager
def _collectives(world: World, where: Callable[[], str]):
    """A collective that failed (distributed.comm_failure) inside, as this rank's lost_contact error, saying
    `where()` the run was; other errors pass."""
    try:
        yield
    except RuntimeError as e:
        if world.size > 1 and comm_failure(e):
            raise lost_contact(world, e, where()) from None
        raise


def lost_contact(world: World, e: BaseException, where: str) -> DistributedError:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return DistributedError(f"rank {world.rank} of {world.size} lost contact with the other ranks {where} ({first})",
                            hint="another rank ended (its own messages say why) or did not answer within "
                                 "collective_timeout; once every rank can run, continue with the same command and "
                                 "--resume", params=("collective_timeout",))


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
    Under torchrun (or in a process group the caller made) every rank calls it with the same arguments, and
    the run is data parallel (training.distributed).
    """
    if train_cfg.stream:
        raise ConfigError("stream=True reads the corpus from disk: call train_from_files", params=("stream=True",))
    with joined(train_cfg.device, train_cfg.collective_timeout) as world, _rank0_writes(world, out_dir):
        return _train(train_pairs, valid_pairs, out_dir, train_cfg, resume, progress, log, force, world=world)


def _one_writer(out_dir: str):
    """The lock of `out_dir` (io.locks), held for the whole run: taken before anything else is done (its
    parent checked writable, as every checkpoint is written beside it and renamed into place)."""
    from transduce.io.locks import output_lock

    return output_lock(out_dir, "the model directory", ConfigError)


@contextlib.contextmanager
def _rank0_writes(world: World, out_dir: str):
    """_one_writer, held by rank 0 alone (the only rank that writes `out_dir`); a refusal is every rank's error."""
    with contextlib.ExitStack() as stack:
        with _collectives(world, lambda: STARTING):
            world.from_rank0(lambda: stack.enter_context(_one_writer(out_dir)), share=lambda _: None)
        yield


def _silent(message: str) -> None:
    """The log of ranks other than 0: rank 0 says what the run does."""


@_keeps_torch_threads
def _train(train_pairs, valid_pairs, out_dir: str, train_cfg: TrainConfig, resume: bool, progress: bool, log,
           force: bool, world: World | None = None) -> dict[str, Any]:
    """train(), its output's lock held (by rank 0). `train_pairs`: the pairs, or a stream.StreamedCorpus."""
    world = world or World()
    if world.rank:
        log, progress = _silent, False
    run = None
    with _collectives(world, lambda: f"at step {run.step}; {run.kept()}" if run is not None else STARTING):
        run = _start(train_pairs, valid_pairs, out_dir, train_cfg, resume, log, force, world)
        wait_s = train_cfg.collective_timeout if world.size > 1 else 0.0
        with stop_after_the_step(run.save_bytes, wait_s, notify=world.rank == 0) as stopper:
            run.shown = Progress(train_cfg.max_steps, run.step, log, enabled=progress)
            try:
                _train_loop(run, stopper, log)
            finally:
                run.close_bar()
    return {"step": run.step, "train_seconds": round(run.train_seconds, 1), "tokens": run.total_tokens,
            "parameters": run.model.num_parameters(), **run.last_metrics}


def _start(train_pairs, valid_pairs, out_dir: str, train_cfg: TrainConfig, resume: bool, log, force: bool,
           world: World) -> _Run:
    """The run, ready for its first step: on rank 0 the output checked, the data prepared or the checkpoint loaded,
    the free space checked; on the others the same run built from what rank 0 sends (start.started_elsewhere)."""
    import torch

    from transduce.io.paths import check_free_space
    from transduce.training.distributed import rank_device
    from transduce.training.start import load_or_start, on_device, started_elsewhere

    device = training_device(rank_device(train_cfg.device, world))
    if train_cfg.threads:
        torch.set_num_threads(train_cfg.threads)

    def on_rank0() -> Start:
        replaces = resume or check_train_output(out_dir, force)  # an existing model directory (not an empty one)
        warn_short_schedule(train_cfg)
        held_out = len(valid_pairs)
        start = load_or_start(train_pairs, valid_pairs, train_cfg, out_dir, resume, log, world.size)
        start.replaces, start.save_bytes = replaces, checkpoint_bytes(start.model, start.tokenizer.vocab_size)
        check_free_space(out_dir, start.save_bytes, "the checkpoint", ConfigError)
        mcfg = start.model.cfg
        if start.dropped:
            log(f"dropped {start.dropped} training pairs longer than max_positions={mcfg.max_positions}")
        if len(start.valid_pairs) < held_out:
            log(f"dropped {held_out - len(start.valid_pairs)} held-out pairs longer than "
                f"max_positions={mcfg.max_positions}")
        return start

    start = world.from_rank0(on_rank0, share=Start.shared)
    if world.rank:
        start = started_elsewhere(start, train_pairs, train_cfg, world.rank)
    model, state = start.model, start.state
    model.train()
    opt = on_device(model, device, start.opt_state, start.rng)
    net = model
    if world.size > 1:  # rank 0's weights (a resumed run's included) are sent to the others here
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    history = state.get("history", [])
    run = _Run(train_cfg, out_dir, model, start.tokenizer, opt, device, start.source, start.valid_ex,
               start.valid_pairs, start.data_sha256, overwrite=start.replaces, world=world, net=net,
               step=state["step"], epoch=state["epoch"], window=state.get("window", 0), bpos=state["batch"],
               total_tokens=state.get("tokens", 0), train_seconds=state.get("train_seconds", 0.0), history=history,
               last_metrics=history[-1] if history else {}, saved_step=state["step"], save_bytes=start.save_bytes)
    mcfg = model.cfg
    ranks = f"; {world.size} processes ({world.backend})" if world.size > 1 else ""
    log(f"model: {mcfg.encoder_layers}+{mcfg.decoder_layers} layers, d_model {mcfg.d_model}, "
        f"{model.num_parameters():,} parameters, vocabulary {mcfg.vocab_size}; "
        f"{run.source.describe()}, {len(start.valid_ex)} held out; torch threads {torch.get_num_threads()}{ranks}")
    return run


def _train_loop(run: _Run, stopper: StopAfterTheStep, log: Callable[[str], None]) -> None:
    """Steps until max_steps, validating and saving on schedule; a signal (stopper) stops it after a whole step,
    its checkpoint saved."""
    cfg = run.cfg
    while run.step < cfg.max_steps:
        for window, bpos, batch in run.source.epoch(run.epoch, run.window, run.bpos):
            run.window, run.bpos = window, bpos
            stopper.set_phase("step")
            loss, lr = run.train_step(batch)
            stopper.longest_step = max(stopper.longest_step, run.step_seconds)
            last = run.step == cfg.max_steps
            if run.step % cfg.eval_every == 0 or last:
                _validate_unless_stopping(run, stopper, loss, lr, last)
            if run.step % cfg.save_every == 0 or last:
                with stopper.saving():
                    run.checkpoint()
            if _agreed_signal(run, stopper) is not None and not last:  # the step is whole, so is its checkpoint
                if run.saved_step != run.step:
                    with stopper.saving():
                        run.checkpoint()
                run.close_bar()
                message = (f"interrupted at step {run.step} of {cfg.max_steps} by {stopper.name()}: checkpoint "
                           f"saved in {run.out_dir} (continue with the same command and --resume)")
                log(message)
                stopper.stop(message, run.step, run.out_dir)
            if last:
                return
        run.epoch, run.window, run.bpos = run.epoch + 1, 0, 0


def _agreed_signal(run: _Run, stopper: StopAfterTheStep) -> int | None:
    """The signal that stops the run after this step: this process's; of several, any rank's, so that all stop
    after the same step (a rank no signal reached adopts it)."""
    if run.world.size == 1:
        return stopper.signum
    signum = int(max(v for (v,) in run.world.gather_floats([stopper.signum or 0])))
    if signum:
        stopper.adopt(signum)
        return stopper.signum
    return None


def _validate_unless_stopping(run: _Run, stopper: StopAfterTheStep, loss: float, lr: float, last: bool) -> None:
    """Validate (on rank 0, the others waiting for its figures), unless a signal stops the run first: one taken in
    before or during the validation cuts it short (the handler raises SkipValidation inside it). The last step's
    always runs: the run's summary is its."""
    if run.world.rank == 0:
        if last:
            run.validate(loss, lr)
        else:
            try:
                stopper.set_phase("validate")  # from here the handler raises; the phase is set back inside the try
                if stopper.signum is None:
                    run.validate(loss, lr)
                stopper.set_phase("step")
            except SkipValidation:
                stopper.set_phase("step")
    if run.world.size > 1:
        if run.world.rank:
            stopper.set_phase("wait")
        run.last_metrics = run.world.broadcast(run.last_metrics)
        stopper.set_phase("step")


def default_out_dir() -> str:
    return os.path.join("runs", "demo", "model")


def train_from_files(out_dir: str, train_cfg: TrainConfig, data: str | None = None, source: str | None = None,
                     target: str | None = None, valid: str | None = None, valid_size: int = 300,
                     resume: bool = False, progress: bool = True, force: bool = False,
                     log: Callable[[str], None] = print) -> dict[str, Any]:
    """`transduce train`: read the corpus (or make the embedded one; or index it, to stream it: train_cfg.stream),
    hold out a validation set, train (as train() does, the lock of `out_dir` taken before the corpus is read)."""

    if data and (source or target):
        raise ConfigError("give either --data (TSV) or --source/--target (aligned files), not both")
    if bool(source) != bool(target):
        raise ConfigError("--source and --target go together")
    if resume and force:
        raise ConfigError("resume and force cannot be given together: resume continues the run in out_dir, force "
                          "replaces it", params=("resume", "force"))
    # the lock before reading the corpus: a second run into out_dir is refused at once
    with joined(train_cfg.device, train_cfg.collective_timeout) as world, _rank0_writes(world, out_dir):
        with _collectives(world, lambda: STARTING):
            pairs, valid_pairs = read_corpus(world, train_cfg, data, source, target, valid, valid_size)
        return _train(pairs, valid_pairs, out_dir, train_cfg, resume, progress, log, force, world=world)
