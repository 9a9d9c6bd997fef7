"""Progress of long work (tokenizing, training, indexing, caching) reported through one callback.

Every long-running library function takes ``progress: Progress``:

    True              a tqdm bar on stderr (the default for interactive library use)
    False / None      nothing at all
    a callable        called with a ``ProgressEvent`` at each update, and nothing is printed: the CLI,
                      a web app or a test decides how to show it

so the application layer never prints, and a front end renders progress its own way.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

from tqdm.auto import tqdm


@dataclass(frozen=True)
class ProgressEvent:
    """One update of one stage of work."""

    stage: str
    """What is being done: ``tokenize``, ``train``, ``index``, ``attribution-cache``, …"""
    done: int
    """Units done so far (steps, tokens, documents, sequences)."""
    total: int | None
    """Units in all (None when unknown, e.g. documents of a streamed corpus)."""
    unit: str = "it"
    info: dict[str, float | int | str] = field(default_factory=dict)
    """Latest figures worth showing (loss, tokens/s, …)."""
    message: str | None = None
    """A one-off status line (e.g. the model size at the start, a validation result)."""
    finished: bool = False
    """The last event of the stage."""
    stopped: bool = False
    """With ``finished``: the stage ended early (an exception, e.g. an interrupt, left it)."""


ProgressFn: TypeAlias = Callable[[ProgressEvent], None]
Progress: TypeAlias = bool | ProgressFn | None


class Reporter:
    """What a library function uses to report a stage: ``with Reporter(progress, "train", total) as r:
    r.update(1, loss=…); r.message("…")``. Renders a tqdm bar, calls the callback, or does nothing."""

    def __init__(
        self,
        progress: Progress,
        stage: str,
        total: int | None = None,
        *,
        unit: str = "it",
        initial: int = 0,
        enabled: bool = True,
    ) -> None:
        self.stage, self.total, self.unit, self.done = stage, total, unit, initial
        self.info: dict[str, float | int | str] = {}
        self._fn: ProgressFn | None = progress if callable(progress) and enabled else None
        self._bar = (
            tqdm(total=total, initial=initial, desc=stage, unit=unit, dynamic_ncols=True, file=sys.stderr)
            if progress is True and enabled
            else None
        )

    def update(self, n: int = 1, **info: float | int | str) -> None:
        self.done += n
        self.info.update(info)
        if self._bar is not None:
            self._bar.update(n)
            if info:
                self._bar.set_postfix({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in info.items()})
        if self._fn is not None:
            self._fn(ProgressEvent(self.stage, self.done, self.total, self.unit, dict(self.info)))

    def message(self, text: str) -> None:
        """A status line: printed above the bar (tqdm), or sent as an event with ``message`` set."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        if self._fn is not None:
            self._fn(ProgressEvent(self.stage, self.done, self.total, self.unit, dict(self.info), message=text))

    def close(self, stopped: bool = False) -> None:
        """End the stage (``stopped``: before its end, an exception is leaving it)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._fn is not None:
            self._fn(
                ProgressEvent(
                    self.stage, self.done, self.total, self.unit, dict(self.info), finished=True, stopped=stopped
                )
            )
            self._fn = None

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(stopped=exc_type is not None)


__all__ = ["Progress", "ProgressEvent", "ProgressFn", "Reporter"]
