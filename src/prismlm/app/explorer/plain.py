"""Result values → JSON-ready Python: every view's ``to_dict()``.

Invariant: ``to_dict()`` holds only dicts, lists, str, int, float, bool and None (what ``json.dumps`` takes),
with the fields in declaration order — the web API's bytes depend on it.
"""

from __future__ import annotations

from dataclasses import is_dataclass
from typing import TypeAlias, cast

__all__ = ["JSON", "JSONDict", "Plain", "plain"]

JSON: TypeAlias = None | bool | int | float | str | list["JSON"] | dict[str, "JSON"]
"""A value ``json.dumps`` takes as it is."""
JSONDict: TypeAlias = dict[str, JSON]

_SCALARS = (int, float, str, bool, type(None))


def plain(x: object) -> JSON:
    """Dataclasses → dicts, recursively, sharing lists of numbers instead of copying them. Why not
    ``dataclasses.asdict``: it deep-copies every list, which took 3× the explanation itself for 128 tokens."""
    if is_dataclass(x) and not isinstance(x, type):
        return {k: plain(v) for k, v in x.__dict__.items()}
    if isinstance(x, list):
        return cast(JSON, x) if not x or isinstance(x[0], _SCALARS) else [plain(v) for v in x]
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return [plain(v) for v in x]
    return cast(JSON, x)


class Plain:
    """A dataclass whose ``to_dict()`` is its fields as JSON-ready values (see ``plain``)."""

    def to_dict(self) -> JSONDict:
        return {k: plain(v) for k, v in self.__dict__.items()}
