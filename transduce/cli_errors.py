"""The CLI's error handling, shared by every subcommand module (kept apart from transduce.cli, which
imports those modules to register them)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

import click

from transduce.errors import TransduceError


def report(e: TransduceError) -> None:
    click.secho(f"error: {e}", fg="red", err=True)
    sys.exit(2)


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning this package gives is printed as one 'warning: ...' line, like the CLI's own; anyone
    else's (a library's deprecation) keeps Python's form, which says where it comes from."""
    if os.path.abspath(filename).startswith(_PACKAGE):
        click.secho(f"warning: {message}", fg="yellow", err=True)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def cli_messages():
    """A TransduceError becomes one clear message on stderr (no traceback) and exit status 2; the
    package's warnings are printed as 'warning: ...' lines."""
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            yield
    except TransduceError as e:
        report(e)


def cli_errors(fn):
    """Decorator: the command runs under cli_messages()."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cli_messages():
            return fn(*args, **kwargs)

    return wrapper
