"""Validation shared by the config dataclasses: field checks and the strict dict → dataclass builder."""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from dataclasses import fields
from typing import TypeVar

from prismlm.errors import ConfigError

T = TypeVar("T")


def check(cond: bool, msg: str, *, param: str | None = None) -> None:
    """Raise ``ConfigError(msg, param=param)`` unless ``cond``: one line per rule in each config's
    ``__post_init__`` (``param``: the field, when ``msg`` names it as `` `field` ``)."""
    if not cond:
        raise ConfigError(msg, param=param)


def valid_device(spec: str) -> bool:
    """``auto`` or a string ``torch.device`` parses (``cpu``, ``cuda:1``, ``mps``); whether that device is
    present is checked when the run starts."""
    if spec == "auto":
        return True
    import torch  # here, not at the top: the config module stays importable without loading torch

    try:
        torch.device(spec)
    except (RuntimeError, ValueError):
        return False
    return True


def nested_config(hint: object) -> type | None:
    """The config dataclass a field's declared type holds (``PrototypeConfig | None`` → ``PrototypeConfig``),
    or ``None`` for a plain value."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return next((a for a in [hint, *args] if isinstance(a, type) and dataclasses.is_dataclass(a)), None)


def from_dict(cls: type[T], data: Mapping[str, object], where: str) -> T:
    """Build a dataclass from a dict, rejecting unknown keys and recursing into nested configs."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys are {sorted(known)}")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, object] = {}
    for name, value in data.items():
        sub = nested_config(hints[name])
        if sub is not None and value is not None:
            value = from_dict(sub, value, f"{where}.{name}")
        elif isinstance(value, list) and name == "betas":
            value = tuple(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as e:  # "batch_size must be >= 1" → "train.batch_size must be >= 1": the key to fix
        section = where.removeprefix("config.") if where.startswith("config.") else None
        head = re.match(r"(\w+) ", e.message)
        if section is None or head is None or head.group(1) not in known:
            raise
        raise ConfigError(f"{section}.{e.message}", fix=e.fix) from None


def replace(cfg: T, **changes: object) -> T:
    """``dataclasses.replace`` re-exported for convenience (re-runs validation)."""
    return dataclasses.replace(cfg, **changes)  # type: ignore[type-var]
