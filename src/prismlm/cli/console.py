"""The consoles every ``prism`` command renders through, and the one way to fail.

Results (tables, generated text) go to stdout; status lines and errors go to stderr, so a command's output
can be piped.
"""

from __future__ import annotations

import time
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from prismlm.progress import Progress, ProgressEvent

console = Console(stderr=True)
"""Status lines, progress and errors (stderr)."""
stdout = Console(highlight=False)
"""Results: tables and text (stdout)."""


class PlainProgress:
    """Progress as plain log lines on stderr, for logs and pipes (no ``\r`` bars): every status message,
    every new training-log record (its loss), the end of each stage, and otherwise at most one line per
    stage every ``every_s`` seconds."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._loss: dict[str, object] = {}

    def __call__(self, e: ProgressEvent) -> None:
        now = time.monotonic()
        if e.message is not None:
            console.print(e.message, markup=False, highlight=False, soft_wrap=True)
            return
        new_loss = "loss" in e.info and e.info["loss"] != self._loss.get(e.stage)
        if not (e.finished or new_loss or now - self._last.get(e.stage, -1e9) >= self.every_s):
            return
        self._last[e.stage], self._loss[e.stage] = now, e.info.get("loss")
        total = f"/{e.total:,}" if e.total is not None else ""
        info = " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}"
                        for k, v in e.info.items())
        console.print(f"[{e.stage}] {e.done:,}{total} {e.unit}" + (" done" if e.finished else "")
                      + (f" | {info}" if info else ""), markup=False, highlight=False, soft_wrap=True)


def progress_for(show: bool) -> Progress:
    """What a long command reports through: bars on a terminal when ``show``, plain lines otherwise."""
    return True if show and console.is_terminal else PlainProgress()


def fail(msg: str) -> NoReturn:
    """Print ``error: msg`` and exit with code 2 (a user mistake: no traceback)."""
    # soft_wrap: the message stays one line whatever the terminal width (greppable, copyable)
    console.print("[bold red]error:[/] " + escape(msg), highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)
