"""The CLI's error handling, shared by every subcommand module (kept apart from transduce.cli, which
imports those modules to register them)."""

from __future__ import annotations

import functools
import sys

import click

from transduce.errors import TransduceError


def report(e: TransduceError) -> None:
    click.secho(f"error: {e}", fg="red", err=True)
    sys.exit(2)


def cli_errors(fn):
    """Decorator: a TransduceError becomes one clear message on stderr (no traceback) and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TransduceError as e:
            report(e)

    return wrapper
