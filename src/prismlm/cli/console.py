"""What every ``prism`` command module shares: the stderr console and the one way to fail."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

console = Console(stderr=True)


def fail(msg: str) -> NoReturn:
    """Print ``error: msg`` and exit with code 2 (a user mistake: no traceback)."""
    console.print(f"[bold red]error:[/] {msg}")
    raise typer.Exit(code=2)
