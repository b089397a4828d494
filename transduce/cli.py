"""The `transduce` command: one subcommand per job; each parses options and calls one library function."""

from __future__ import annotations

import contextlib
import json
import sys

import click

from transduce.cli_errors import cli_errors, cli_messages
from transduce.errors import TransduceError

__all__ = ["main", "cli_errors"]


class _Group(click.Group):
    """Prints a TransduceError as one clear message (no traceback) and exits with status 2; the
    package's warnings as 'warning: ...' lines (cli_messages). SIGTERM ends a command as Ctrl-C does."""

    def invoke(self, ctx):
        with cli_messages(), _terminate_like_interrupt():
            return super().invoke(ctx)


# seconds a SIGTERM waits for the interpreter: a long native call (a TensorRT build, a big matmul) runs no
# Python signal handler until it returns, so past this the process exits without the cleanup, as SIGTERM's
# default action would (within docker stop's 10 s before its SIGKILL)
TERM_GRACE_S = 5.0


@contextlib.contextmanager
def _terminate_like_interrupt():
    """SIGTERM (docker stop, systemd, Kubernetes, timeout) as an exception in the main thread, so that the
    cleanup Ctrl-C gets runs too: a killed export or checkpoint removes its temporary copy, which the
    default action (death without cleanup) leaves on disk, the size of the artifact. Exit status 143.

    Python runs the handler only between bytecodes of the main thread; a watchdog thread, woken by the
    signal through signal.set_wakeup_fd, ends the process with status 143 if it is still alive TERM_GRACE_S
    later (the main thread stuck in native code), or at once on a second SIGTERM. Native code that keeps the
    GIL keeps the watchdog waiting too; TensorRT's builder, ONNX Runtime and torch's kernels let go of it."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield  # not ours to change: a caller that set its own handler, or a thread (no handler can be set)
        return

    def terminate(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    stop_watchdog = _start_term_watchdog()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        stop_watchdog()


def _start_term_watchdog():
    """The watchdog of _terminate_like_interrupt; -> a function that stops it. None started where a wakeup fd
    is already in use (an event loop's): the handler alone then."""
    import os
    import signal
    import socket
    import threading

    receive, send = socket.socketpair()
    send.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(send.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main thread of the main interpreter
        previous = None
    if previous != -1:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        receive.close()
        send.close()
        return lambda: None

    def watch():
        # one byte per caught signal, its number (SIGINT's too: ignored); 0: stop
        while (byte := receive.recv(1)) and byte[0] != 0:
            if byte[0] != signal.SIGTERM:
                continue
            receive.settimeout(TERM_GRACE_S)
            try:
                while (again := receive.recv(1)) and again[0] not in (0, signal.SIGTERM):
                    pass
                if again and again[0] == 0:
                    return  # stopped: the command ended within the grace period
            except TimeoutError:
                pass
            os._exit(128 + signal.SIGTERM)

    thread = threading.Thread(target=watch, name="transduce-sigterm-watchdog", daemon=True)
    thread.start()

    def stop():
        signal.set_wakeup_fd(-1)
        try:
            send.send(b"\0")
        except OSError:
            pass
        thread.join(timeout=1.0)
        send.close()
        if not thread.is_alive():
            receive.close()

    return stop


@click.group(cls=_Group)
@click.version_option(package_name="transduce")
def main() -> None:
    """transduce: train -> export -> build -> decode -> parity -> bench for encoder-decoder Transformers."""


def _parse_overrides(items: tuple[str, ...]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise TransduceError(f"--set expects FIELD=VALUE, got {item!r}", hint="for example --set d_model=256")
        k, v = item.split("=", 1)
        if v.strip().lower() in ("true", "false"):  # Python's spelling too: --set norm_first=True
            v = v.strip().lower()
        try:
            out[k.strip()] = json.loads(v)
        except ValueError:
            out[k.strip()] = v
    return out


@main.command()
@click.option("--data", type=click.Path(), help="Training corpus: TSV (source<TAB>target). Default: the embedded demo corpus.")
@click.option("--source", "src_file", type=click.Path(), help="Training sources (with --target, two aligned files).")
@click.option("--target", "tgt_file", type=click.Path(), help="Training targets, aligned with --source.")
@click.option("--valid", type=click.Path(), help="Held-out TSV. Default: the last --valid-size pairs of --data or --source/--target (the embedded corpus has its own 400).")
@click.option("--valid-size", default=300, show_default=True, help="Held-out pairs taken from --data or --source/--target if --valid is absent (not for the embedded corpus).")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Model directory to write (and to resume from).")
@click.option("--preset", default="tiny", show_default=True, type=click.Choice(["tiny", "base", "big"]))
@click.option("--set", "overrides", multiple=True, help="Override a model config field, e.g. --set d_model=256 (repeatable).")
@click.option("--vocab-size", default=8000, show_default=True, help="BPE vocabulary to learn.")
@click.option("--max-steps", default=2000, show_default=True)
@click.option("--warmup", default=4000, show_default=True, help="Warmup steps of the learning-rate schedule.")
@click.option("--lr-scale", default=1.0, show_default=True, help="Constant factor of the learning-rate schedule.")
@click.option("--max-tokens", default=4096, show_default=True, help="Padded tokens per side per batch.")
@click.option("--label-smoothing", default=0.1, show_default=True)
@click.option("--clip-norm", default=0.0, show_default=True, help="Clip gradients to this global norm (0: off).")
@click.option("--eval-every", default=500, show_default=True)
@click.option("--save-every", default=1000, show_default=True)
@click.option("--eval-sentences", default=200, show_default=True, help="Held-out sentences decoded for BLEU and exact match.")
@click.option("--seed", default=1, show_default=True)
@click.option("--threads", default=0, show_default=True, help="Torch threads (0: torch's default).")
@click.option("--device", default="cpu", show_default=True, help="Train on cpu, cuda or cuda:N.")
@click.option("--resume", is_flag=True, help="Continue the run saved in --out (model, optimizer, schedule, RNG).")
@click.option("--force", is_flag=True, help="Replace the model directory at --out (never a directory of other files).")
@click.option("--no-progress", is_flag=True, help="No progress bar (log lines only).")
def train(data, src_file, tgt_file, valid, valid_size, out_dir, preset, overrides, vocab_size, max_steps, warmup,
          lr_scale, max_tokens, label_smoothing, clip_norm, eval_every, save_every, eval_sentences, seed, threads, device,
          resume, force, no_progress):
    """Train the reference Transformer on parallel text and write a model directory."""
    from transduce.models.train import TrainConfig, train_from_files

    cfg = TrainConfig(preset=preset, model_overrides=_parse_overrides(overrides), vocab_size=vocab_size,
                      max_steps=max_steps, warmup=warmup, lr_scale=lr_scale, max_tokens=max_tokens,
                      label_smoothing=label_smoothing, clip_norm=clip_norm, eval_every=eval_every,
                      save_every=save_every, eval_sentences=eval_sentences, seed=seed, threads=threads, device=device)
    summary = train_from_files(out_dir, cfg, data=data, source=src_file, target=tgt_file, valid=valid,
                               valid_size=valid_size, resume=resume, progress=not no_progress, force=force,
                               log=lambda m: click.echo(m, err=True))  # stdout: the JSON summary alone
    click.echo(json.dumps(summary, indent=2))


@main.command()
@click.option("--workdir", default="runs/demo", show_default=True, type=click.Path(), help="Where data, model and artifacts go.")
@click.option("--retrain", is_flag=True, help="Train again even if a demo model exists.")
@click.option("--steps", default=None, type=int, help="Training steps (default: the demo's).")
@click.option("--show", default=12, show_default=True, help="Held-out examples to print.")
@click.option("--device", default="cpu", show_default=True,
              help="Train on cpu, cuda or cuda:N (decoding and parity run on the CPU).")
def demo(workdir, retrain, steps, show, device):
    """The whole pipeline on the embedded corpus (English -> French number words)."""
    from transduce.demo import run_demo

    results = run_demo(workdir, retrain=retrain, steps=steps, show=show, device=device)
    sys.exit(0 if results.get("parity", True) else 1)


def _register() -> None:
    """Each component defines its subcommands in its own `commands` module (click only, no heavy imports)."""
    import importlib

    for module in ("transduce.exporter.commands", "transduce.exporter.build_commands", "transduce.runtime.commands",
                   "transduce.inspect.commands", "transduce.bench.commands"):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if not e.name or not module.startswith(e.name):
                raise
            continue
        for cmd in mod.COMMANDS:
            main.add_command(cmd)


_register()

if __name__ == "__main__":
    main()
