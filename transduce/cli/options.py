"""The options several commands share, derived once from the library's own types: a BackendSpec (which backend
decodes, where and how) and a frozen options dataclass (DecodingOptions, ServiceOptions), one flag per field,
named after it (`beam_size` is --beam-size), its help from the field's metadata.

Each decorator hands the command one built object (spec=, decoding=, service=) instead of loose values. Put
@cli_errors above them: the objects are built inside it, so their errors name the flags.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import click

from transduce.cli.errors import deprecated
from transduce.errors import TransduceError
from transduce.runtime.backends.registry import BACKENDS, PRECISIONS, REGISTRY

BACKEND_HELP = "; ".join(f"{name}: {e.summary}" for name, e in REGISTRY.items()) + "."
PRECISION_HELP = ("torch only: the eager model's weights in fp32, fp16 or bf16 (softmax, LayerNorm and "
                  "log-softmax stay fp32); other backends run the precision of their export.  [default: fp32]")
CUDA_GRAPH_HELP = ("Replay each decoder step (and the encoder) from a captured CUDA graph: --backend torch "
                   "--device cuda, or tensorrt.")
DEVICE_HELP = ("cpu, cuda or cuda:N (cuda: the first GPU for onnxruntime; tensorrt: always a GPU, cpu meaning the "
               "default one).")


def flag(name: str) -> str:
    """The command line's spelling of a parameter: beam_size -> --beam-size."""
    return "--" + name.replace("_", "-")


def _take(kwargs: dict[str, Any], names, renamed: Mapping[str, str]) -> dict[str, Any]:
    """The values of `names` popped from a command's keyword arguments, a deprecated spelling's value in its
    place (with a warning) where only that one was given."""
    out = {}
    for name in names:
        value = kwargs.pop(name)
        if name in renamed:
            old = kwargs.pop(f"deprecated_{name}")
            if old is not None:
                if value is not None:
                    raise click.UsageError(f"{renamed[name]} is the deprecated spelling of {flag(name)}: give "
                                           f"{flag(name)} alone")
                deprecated(renamed[name], flag(name))
                value = old
        if value is not None and value != ():  # () : a multiple flag not given
            out[name] = value
    return out


def _add(command: Callable, options: list) -> Callable:
    for option in reversed(options):
        command = option(command)
    return command


def dataclass_options(cls: type, into: str, *, only: tuple[str, ...] | None = None,
                      renamed: Mapping[str, str] | None = None, defaults: Mapping[str, Any] | None = None,
                      helps: Mapping[str, str] | None = None, base: Callable[[], Any] | None = None,
                      given_into: str | None = None):
    """A decorator: one option per field of the frozen dataclass `cls` (`only` those), named after it, with its
    metadata's help (or `helps`') and choices, its default shown; the command receives them built into one
    `cls` as the keyword `into` (over `base()` where given: the fields not on the command line keep its values).
    renamed: {field: old flag} kept as a hidden, deprecated spelling. given_into: the command also receives, as
    this keyword, the fields given on the command line alone ({name: value}), to go over defaults only known
    later (a model's); `into` is then None where those fields are valid only over such defaults (an error about
    them and a field not given: --nbest 6 over the paper's beam of 4, where the model's may be 6)."""
    renamed, defaults, helps = dict(renamed or {}), dict(defaults or {}), dict(helps or {})
    fields = [f for f in dataclasses.fields(cls) if only is None or f.name in only]

    def decorate(command):
        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            given = _take(kwargs, [f.name for f in fields], renamed)
            start = base() if base is not None else cls(**{k: v for k, v in defaults.items() if k not in given})
            if given_into is None:
                kwargs[into] = dataclasses.replace(start, **given)
                return command(*args, **kwargs)
            kwargs[given_into] = given
            try:
                kwargs[into] = dataclasses.replace(start, **given)
            except TransduceError as e:  # an error in what was typed alone is said now, before any work
                if not set(e.params) - set(given):
                    raise
                kwargs[into] = None
            return command(*args, **kwargs)

        options = []
        for f in fields:
            default = defaults.get(f.name, f.default)
            choices = f.metadata.get("choices")
            kind = click.Choice(choices) if choices else {"int": int, "float": float, "bool": bool}.get(
                str(f.type).removesuffix(" | None"), str)  # an optional field: None when not given
            shown = f"  [default: {default}]" if default is not None and kind is not bool else ""
            if f.metadata.get("multiple"):  # a list field: the flag given once per item
                options.append(click.option(flag(f.name), f.name, multiple=True, default=None,
                                            help=helps.get(f.name, f.metadata.get("help", ""))))
            elif kind is bool:
                options.append(click.option(flag(f.name), f.name, is_flag=True, default=None,
                                            help=helps.get(f.name, f.metadata.get("help", ""))))
            else:
                options.append(click.option(flag(f.name), f.name, type=kind, default=None,
                                            help=helps.get(f.name, f.metadata.get("help", "")) + shown))
            if f.name in renamed:
                options.append(click.option(renamed[f.name], f"deprecated_{f.name}", type=kind, default=None,
                                            hidden=True, help=f"Deprecated spelling of {flag(f.name)}."))
        return _add(wrapper, options)

    return decorate


def decoding_options(**kw):
    """Every DecodingOptions field as a flag; the command receives `decoding` (a DecodingOptions over the paper's
    defaults; with given_into="NAME", also NAME: the flags given, for the model's defaults). --beam is the
    deprecated spelling of --beam-size."""
    from transduce.runtime.decoding.options import DecodingOptions

    return dataclass_options(DecodingOptions, "decoding", renamed={"beam_size": "--beam"}, **kw)


def backend_options(*, model_help: str | None = None, threads_help: str = "Threads (0: the framework's default)."):
    """--backend, --device, --threads, --precision, --cuda-graph (and --model, where model_help says what it is):
    the command receives `spec`, a BackendSpec, checked (runtime.spec) inside the command's cli_errors."""
    from transduce.runtime.spec import BackendSpec

    names = ("backend", "device", "threads", "precision", "cuda_graph") + (("model_dir",) if model_help else ())

    def decorate(command):
        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            kwargs["spec"] = BackendSpec(**{n: kwargs.pop(n) for n in names})
            return command(*args, **kwargs)

        options = [
            click.option("--backend", default="onnxruntime", show_default=True, type=click.Choice(BACKENDS),
                         help=BACKEND_HELP),
            click.option("--device", default="cpu", show_default=True, help=DEVICE_HELP),
            click.option("--threads", default=0, show_default=True, help=threads_help),
            click.option("--precision", type=click.Choice(PRECISIONS), default=None, help=PRECISION_HELP),
            click.option("--cuda-graph", "cuda_graph", is_flag=True, help=CUDA_GRAPH_HELP),
        ]
        if model_help:
            options.append(click.option("--model", "model_dir", type=click.Path(), default=None, help=model_help))
        return _add(wrapper, options)

    return decorate


def renamed_option(new: str, old: str, param: str, **kw):
    """An option under its new flag and its old one (hidden, deprecated): the pair of click options, the command
    receiving the value as `param` (resolve it with errors.renamed(value, old_value, new, old))."""
    def decorate(command):
        command = click.option(old, f"deprecated_{param}", default=None, hidden=True, type=kw.get("type"),
                               help=f"Deprecated spelling of {new}.")(command)
        return click.option(new, param, **kw)(command)

    return decorate
