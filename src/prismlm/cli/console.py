"""The consoles every ``prism`` command renders through, and the one way to fail.

Results (tables, generated text) go to stdout; status lines and errors go to stderr, so a command's output
can be piped.
"""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

console = Console(stderr=True)
"""Status lines, progress and errors (stderr)."""
stdout = Console(highlight=False)
"""Results: tables and text (stdout)."""


def fail(msg: str) -> NoReturn:
    """Print ``error: msg`` and exit with code 2 (a user mistake: no traceback)."""
    # soft_wrap: the message stays one line whatever the terminal width (greppable, copyable)
    console.print("[bold red]error:[/] " + escape(msg), highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)
