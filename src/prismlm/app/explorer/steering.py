"""What a request changes about the model (``Steering``) and its checked translation into the model's
intervention values. Invariant: ids are in range, factors finite and within ``Limits.max_scale``, a concept
one of the server's suppression sets — else a ``ConfigError`` (4xx) before any model call.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypedDict

import torch

from prismlm.app.explorer.limits import Limits, RequestLimitError, check_limit
from prismlm.control.suppress import SuppressionSet
from prismlm.errors import ConfigError
from prismlm.model import Intervention, Scale, Suppress
from prismlm.model.interventions import check_ids

__all__ = ["Steering", "SteeringDict", "interventions"]


class SteeringDict(TypedDict):
    """A request's steering as the views echo it."""

    suppress: list[int]
    scale: list[list[int | float]]
    """[prototype id, factor] pairs."""
    concept: str | None


@dataclass(frozen=True)
class Steering:
    """What a request changes about the model: prototypes to suppress, factors to scale by, a concept's
    suppression set (by name, from the sets the server was started with)."""

    suppress: tuple[int, ...] = ()
    scale: tuple[tuple[int, float], ...] = ()
    """(prototype id, factor) pairs; 0 removes the slice, 2 doubles it."""
    concept: str | None = None

    @property
    def empty(self) -> bool:
        return not self.suppress and not self.scale and self.concept is None

    def to_dict(self) -> SteeringDict:
        return {"suppress": list(self.suppress), "scale": [[i, f] for i, f in self.scale], "concept": self.concept}


def interventions(
    steering: Steering, num_prototypes: int, limits: Limits, concepts: Mapping[str, SuppressionSet]
) -> tuple[Intervention, ...]:
    """The request's steering as intervention values, checked: ids in range, factors finite and bounded,
    the concept one of ``concepts``."""
    K = num_prototypes
    n = len(steering.suppress) + len(steering.scale)
    check_limit(n <= limits.max_steer_ids, "steered prototypes", limits.max_steer_ids, n)
    out: list[Intervention] = []
    if steering.suppress:
        out.append(Suppress.of(check_ids(list(steering.suppress), K), label="request"))
    if steering.scale:
        ids = check_ids([i for i, _ in steering.scale], K)
        f = torch.ones(K, dtype=torch.float64)  # (K,) multipliers
        for i, v in zip(ids, (v for _, v in steering.scale)):
            if not (math.isfinite(v) and abs(v) <= limits.max_scale):
                raise RequestLimitError(
                    f"scale factor of prototype {i} must be finite and within ±{limits.max_scale}, got {v!r}"
                )
            f[i] = f[i] * float(v)
        out.append(Scale(f, label="request"))
    if steering.concept is not None:
        sset = concepts.get(steering.concept)
        if sset is None:
            raise ConfigError(
                f"unknown concept {steering.concept!r}; the server has "
                f"{sorted(concepts) or 'none'} (start it with prism serve RUN --concept FILE)"
            )
        out.append(Suppress.of(sset.ids, label=steering.concept))
    return tuple(out)
