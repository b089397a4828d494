"""The CLI's error handling, shared by every subcommand module (kept apart from transduce.cli, which
imports those modules to register them): errors and warnings as one line each, parameters spelled as
the command's flags, and the deprecation of an old spelling."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from collections.abc import Mapping

import click

from transduce.errors import TransduceError, TransduceWarning


def report(e: TransduceError, names: Mapping[str, str] | None = None) -> None:
    """Print `e` as 'error: ...' (its parameters spelled as `names` says) and exit with status 2. A copy of another
    process's error (`mirrored`: a training rank repeating rank 0's) exits without a second message."""
    if getattr(e, "mirrored", False):
        sys.exit(2)
    click.secho(f"error: {e.spelled(names or {})}", fg="red", err=True)
    sys.exit(2)


def warn(message: str) -> None:
    """A warning of the command line itself, printed as the package's are ('warning: ...' on stderr)."""
    click.secho(f"warning: {message}", fg="yellow", err=True)


def warning_text(message: Warning | str, names: Mapping[str, str] | None = None) -> str:
    """A warning's message, its parameters spelled as `names` says where it is one of the package's."""
    return message.spelled(names or {}) if isinstance(message, TransduceWarning) else str(message)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # transduce/


def _warning_printer(names: Mapping[str, str]):
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        """A warning this package gives is printed as one 'warning: ...' line, like the CLI's own; anyone
        else's (a library's deprecation) keeps Python's form, which says where it comes from."""
        if os.path.abspath(filename).startswith(_PACKAGE):
            warn(warning_text(message, names))
        else:
            sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    return show


@contextlib.contextmanager
def cli_messages(names: Mapping[str, str] | None = None):
    """A TransduceError becomes one clear message on stderr (no traceback) and exit status 2; the
    package's warnings are printed as 'warning: ...' lines. names: how the command spells the library's
    parameters (see command_names)."""
    names = names or {}
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_printer(names)
            yield
    except TransduceError as e:
        report(e, names)


def command_names(command: click.Command | None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """How `command` spells the library's parameters: each option's name as its long flag ("min_length":
    "--min-length", a flag's "truncate=True": "--truncate"), each argument's as its metavar ("model_dir":
    "MODEL_DIR"), then `extra` for the parameters the command names otherwise ("beam_size": "--beam")."""
    names: dict[str, str] = {}
    for param in command.params if command is not None else ():
        if isinstance(param, click.Argument):
            names[param.name] = (param.metavar or param.name).upper()
        elif isinstance(param, click.Option) and param.name:
            long = next((o for o in param.opts if o.startswith("--")), param.opts[0])
            names[param.name] = long
            if param.is_flag and not param.secondary_opts:
                names[f"{param.name}=True"] = long
    names.update(extra or {})
    return names


def cli_errors(fn=None, *, names: Mapping[str, str] | None = None):
    """Decorator: the command runs under cli_messages(), with its parameters' spellings (command_names of
    the command being run, plus `names`). As @cli_errors or @cli_errors(names={...})."""
    if fn is None:
        return functools.partial(cli_errors, names=names)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ctx = click.get_current_context(silent=True)
        with cli_messages(command_names(ctx.command if ctx else None, names)):
            return fn(*args, **kwargs)

    return wrapper


# every command's --quiet (docs/cli.md, "Conventions")
QUIET_HELP = "No progress and no informational lines on stderr (warnings and errors still print)."


def deprecated(old: str, new: str) -> None:
    """The warning for an old spelling that still works, for one release."""
    warn(f"{old} is deprecated: use {new}")


def renamed(value, old_value, name: str, old_name: str):
    """The value of an option given as `name`, or as its deprecated spelling `old_name` (with a warning;
    both at once is a usage error). None where neither was given."""
    if old_value is None:
        return value
    if value is not None:
        raise click.UsageError(f"{old_name} is the deprecated spelling of {name}: give {name} alone")
    deprecated(old_name, name)
    return old_value


def log_lines(quiet: bool, label: str):
    """A command's informational lines on stderr ('[label] message'), or None under --quiet."""
    return None if quiet else (lambda msg: click.echo(f"[{label}] {msg}", err=True))
