"""The consoles every ``prism`` command renders through, and the one way to fail.

Results (tables, generated text) go to stdout; status lines and errors go to stderr, so a command's output
can be piped. Under ``torchrun`` only rank 0 prints results, status and progress (every rank runs the same
command); an error is printed by whichever rank meets it, prefixed with its rank.
"""

from __future__ import annotations

import os
import time
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from prismlm.progress import Progress, ProgressEvent


def rank() -> int | None:
    """This process's rank in a ``torchrun`` job (env ``RANK``), or None outside one."""
    value = os.environ.get("RANK", "").strip()
    try:
        return int(value) if value else None
    except ValueError:
        return None


def is_main_process() -> bool:
    """True outside torchrun and on its rank 0: the one process that prints. Read at each print, so a
    command (or a test) that sets ``RANK`` after import is obeyed."""
    return rank() in (None, 0)


class RankConsole(Console):
    """A rich ``Console`` that is quiet on the other ranks of a torchrun job (rank ≠ 0)."""

    @property
    def quiet(self) -> bool:
        return self._quiet or not is_main_process()

    @quiet.setter
    def quiet(self, value: bool) -> None:
        self._quiet = value


console: Console = RankConsole(stderr=True)
"""Status lines and progress (stderr); rank 0 only under torchrun."""
stdout: Console = RankConsole(highlight=False)
"""Results: tables and text (stdout); rank 0 only under torchrun."""
_errors = Console(stderr=True)
"""Errors (stderr), on every rank: the rank that fails may not be rank 0."""


def echo(text: str) -> None:
    """Print ``text`` exactly as it is (no markup) to stdout, on rank 0 only."""
    if is_main_process():
        print(text, flush=True)


def clock(seconds: float) -> str:
    """``H:MM:SS`` (``M:SS`` under an hour)."""
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class PlainProgress:
    """Progress as plain log lines on stderr, for logs and pipes (no ``\r`` bars): every status message,
    every new training-log record (its ``ce``), the end of each stage, and otherwise at most one line per
    stage every ``every_s`` seconds. Each progress line ends with the time since the stage's first event
    and, when its total is known, the ETA at the rate since then."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._record: dict[str, object] = {}
        self._start: dict[str, tuple[float, int]] = {}  # stage → (time, units done) at its first event

    def _timing(self, e: ProgressEvent, now: float) -> str:
        t0, done0 = self._start[e.stage]
        text = f"{clock(now - t0)} elapsed"
        if e.total is not None and not e.finished and e.done > done0 and now > t0:
            eta = (e.total - e.done) * (now - t0) / (e.done - done0)
            text += f", ETA {clock(eta)}"
        return text

    def __call__(self, e: ProgressEvent) -> None:
        now = time.monotonic()
        self._start.setdefault(e.stage, (now, e.done))
        if e.message is not None:
            console.print(e.message, markup=False, highlight=False, soft_wrap=True)
            return
        new_record = "ce" in e.info and e.info["ce"] != self._record.get(e.stage)
        if not (e.finished or new_record or now - self._last.get(e.stage, -1e9) >= self.every_s):
            return
        self._last[e.stage], self._record[e.stage] = now, e.info.get("ce")
        total = f"/{e.total:,}" if e.total is not None else ""
        info = " ".join(
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}"
            for k, v in e.info.items()
        )
        end = " stopped" if e.stopped else " done" if e.finished else ""
        console.print(
            f"[{e.stage}] {e.done:,}{total} {e.unit}"
            + end
            + (f" | {info}" if info else "")
            + f" | {self._timing(e, now)}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def progress_for(show: bool) -> Progress:
    """What a long command reports through: bars on a terminal when ``show``, plain lines otherwise."""
    if not is_main_process():
        return None  # the other ranks of a torchrun job report nothing (rank 0 reports its own part)
    return True if show and console.is_terminal else PlainProgress()


def interrupted(msg: str) -> NoReturn:
    """Print ``interrupted: msg`` and exit with code 130 (the shell's code for Ctrl-C)."""
    _errors.print("[bold yellow]" + escape(msg) + "[/]", highlight=False, soft_wrap=True)
    raise typer.Exit(code=130)


def fail(msg: str) -> NoReturn:
    """Print ``error: msg`` and exit with code 2 (a user mistake: no traceback)."""
    # soft_wrap: the message stays one line whatever the terminal width (greppable, copyable)
    where = "" if is_main_process() else f"rank {rank()}: "
    _errors.print(f"{where}[bold red]error:[/] " + escape(msg), highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)
