"""The one error hierarchy of prismlm.

Every mistake a user can make — a bad option, a missing or corrupt file, an artifact that belongs to
another model — raises a ``PrismError``. Its message names the file or option at fault, and ``fix`` (when
known) is the command or change that repairs it. The CLI prints a ``PrismError`` as one line and exits
with code 2; any other exception is a bug in prismlm and keeps its traceback.

Each kind also derives from the built-in exception a caller would expect (``ValueError`` for a bad value,
``KeyError`` for an unknown id), so ``except ValueError`` in user code keeps working; prismlm itself only
ever catches ``PrismError``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path


def named(param: str) -> str:
    """How a message names the parameter ``param`` (``out`` → `` `out` ``); a config field (``train.lr``,
    ``QuerySpec.top``) or a label that is not a parameter name (``OUT``) is written as it is. A front end
    finds the parameters an error names in its ``params``, spelled this way."""
    return f"`{param}`" if param.isidentifier() and param.islower() else param


class PrismError(Exception):
    """A user-facing error: the message says what is wrong and where; ``fix`` says how to repair it;
    ``param``: the parameter (or config field) it is about, with any others its text names — each written
    in the text as ``named(p)`` — so that a front end can spell them its own way (``spelled``)."""

    def __init__(
        self,
        message: str,
        *,
        fix: str | None = None,
        path: str | Path | None = None,
        param: str | tuple[str, ...] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.path = Path(path) if path is not None else None
        self.params: tuple[str, ...] = (param,) if isinstance(param, str) else tuple(param or ())

    @property
    def param(self) -> str | None:
        """The parameter or config field the error is about, as the library names it (``top_tokens``)."""
        return self.params[0] if self.params else None

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message} (fix: {self.fix})"

    def spelled(self, spelling: Mapping[str, str]) -> str:
        """``str(self)`` for a front end that names parameters its own way (``spelling``: parameter → its
        name there; the CLI gives each parameter's flag): each of ``params`` that ``spelling`` has replaces
        the text's ``named(p)``; the one the error is about goes in front ("NAME: …") when the text does not
        name it."""
        text = str(self)
        for p in self.params:
            if p not in spelling:
                continue
            if named(p) in text:
                text = text.replace(named(p), spelling[p])
            elif p == self.param:
                text = f"{spelling[p]}: {text}"
        return text


@contextmanager
def params_renamed(**names: str) -> Iterator[None]:
    """Errors raised inside name a forwarded parameter as the caller calls it: around
    ``train(..., extend_to=steps)``, ``params_renamed(extend_to="steps")`` turns an error about `` `extend_to` ``
    into one about `` `steps` `` (in ``params`` and in the text), which a front end knows."""
    try:
        yield
    except PrismError as e:
        for old, new in names.items():
            if old in e.params:
                e.params = tuple(new if p == old else p for p in e.params)
                e.message = e.message.replace(named(old), named(new))
                e.fix = e.fix.replace(named(old), named(new)) if e.fix else e.fix
        raise


class ConfigError(PrismError, ValueError):
    """A configuration value, option or override (``train.lr=…``) is invalid or unknown; ``param`` names the
    parameter or config field at fault."""


class DataError(PrismError, ValueError):
    """Input data is unusable: a corpus, a tokenizer, token shards, task files, example texts."""


class CorpusError(DataError):
    """A corpus spec or file is unusable; the message names the file (and line)."""


class TokenizerError(DataError):
    """A tokenizer spec or directory is unusable; the message says why."""


class ShardError(DataError):
    """A shard directory is incomplete, corrupt, or does not match its tokenizer."""


class TaskError(DataError):
    """A task name is unknown or its source data is missing."""


class CheckpointError(PrismError, ValueError):
    """A checkpoint is missing, incomplete or does not match what it is used with."""


class RunError(PrismError, RuntimeError):
    """A run folder cannot be written as asked: it already holds a run, another process is writing it,
    a resume has nothing to do, or training diverged (NaN/Inf loss; the last good checkpoint is kept)."""


class ArtifactError(PrismError, ValueError):
    """A derived artifact (prototype index, attribution cache, labels) is missing, incomplete or cannot be
    combined as asked."""


class ArtifactCorrupt(ArtifactError):
    """An artifact's bytes do not match its manifest (truncated, flipped, torn)."""


class ArtifactMismatch(ArtifactError):
    """An artifact was built from another checkpoint or another corpus than the one it is used with."""


class ModelError(PrismError, ValueError):
    """An operation does not apply to this model (e.g. prototypes asked of the dense baseline) or got an
    argument outside the model's range (bad prototype ids, wrong tensor shapes)."""


class ModelSourceError(ModelError):
    """A pretrained model to load cannot be read: a truncated or corrupt GGUF file, an architecture or a
    quantisation transformers does not load from GGUF."""


class UnknownPrototypeError(ModelError, KeyError):
    """A prototype id outside [0, K)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return PrismError.__str__(self)


class SuppressionError(PrismError, ValueError):
    """A suppression set is malformed or does not match the model it is applied to."""


class DependencyError(PrismError, RuntimeError):
    """An optional package needed for this operation is not installed; ``fix`` names the pip extra."""


__all__ = [
    "ArtifactCorrupt",
    "ArtifactError",
    "ArtifactMismatch",
    "CheckpointError",
    "ConfigError",
    "CorpusError",
    "DataError",
    "DependencyError",
    "ModelError",
    "ModelSourceError",
    "PrismError",
    "RunError",
    "ShardError",
    "SuppressionError",
    "TaskError",
    "TokenizerError",
    "UnknownPrototypeError",
    "named",
    "params_renamed",
]
