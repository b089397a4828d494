"""One rich Console for tables: the terminal's width, or 140 columns when output is a file or pipe."""

from __future__ import annotations


def console():
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=140)
