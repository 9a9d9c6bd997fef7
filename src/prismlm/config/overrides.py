"""Strings to typed config values: a dotted key's declared type, and a string converted to it."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Literal

from prismlm.config.validation import nested_config
from prismlm.errors import ConfigError


def field_type(root: type, dotted: str) -> object | None:
    """The declared type of a dotted key under the config dataclass ``root`` (``train.lr`` → float), or
    ``None`` if unknown."""
    cls: type | None = root
    hint: object | None = None
    for part in dotted.split("."):
        if cls is None:
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        hint = hints[part]
        cls = nested_config(hint)
    return hint


def convert(key: str, raw: str, hint: object) -> object:
    """Convert the string ``raw`` given for ``key`` to ``hint`` (a field type), or raise ``ConfigError``
    naming ``key=raw`` as one of the ``overrides``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and raw.strip().lower() in ("null", "none"):
            return None
        errors = []
        for a in (a for a in args if a is not type(None)):
            try:
                return convert(key, raw, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}={raw!r} in `overrides`: " + "; ".join(errors), param="overrides")
    if origin is Literal:
        if raw in [str(a) for a in args]:
            return next(a for a in args if str(a) == raw)
        raise ConfigError(f"{key}={raw!r} in `overrides`: expected one of {list(args)}", param="overrides")
    if dataclasses.is_dataclass(hint):
        if raw.strip().lower() in ("null", "none"):
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{key}={raw!r} in `overrides`: expected a JSON object or null", param="overrides") from e
    if hint is bool:
        low = raw.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={raw!r} in `overrides`: expected true or false", param="overrides")
    if hint is int:
        try:
            return int(raw.strip())
        except ValueError:
            raise ConfigError(f"{key}={raw!r} in `overrides`: expected an integer", param="overrides") from None
    if hint is float:
        try:
            value = float(raw.strip())
        except ValueError:
            raise ConfigError(f"{key}={raw!r} in `overrides`: expected a number", param="overrides") from None
        if not math.isfinite(value):
            raise ConfigError(f"{key}={raw!r} in `overrides`: expected a finite number", param="overrides")
        return value
    if hint is str:
        return raw
    try:  # lists, dicts and anything else: JSON
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw
