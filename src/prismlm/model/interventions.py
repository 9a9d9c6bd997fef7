"""Interventions as values: suppression, controllers and scaling of prototype slices (spec §4).

Every intervention is a per-prototype multiplier m (K,) on the logit slices, ℓ' = W r + Σ_i m_i a_i W p_i:

    Suppress(ids)          m_i = 0 for the given prototypes, 1 elsewhere (removes their slices exactly)
    Control(coefficients)  m_i = 1 + c_i (a sparse linear controller; c = 0 is the base model)
    Scale(factors)         m_i given directly

They are plain immutable values: a run, a web request or a bench holds a tuple of them and applies it with
``with model.intervene(*interventions):``, which multiplies them together and always restores the model
on exit (also when the body raises). Nothing here changes a model for good.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from prismlm.errors import ModelError, UnknownPrototypeError


@dataclass(frozen=True)
class Suppress:
    """Switch prototypes off: their slices a_i W p_i are removed from every logit."""

    ids: tuple[int, ...]
    """Prototype ids in [0, K)."""
    label: str | None = None
    """What the set stands for (a concept name, a file), for reports."""

    @classmethod
    def of(cls, ids: Iterable[int], label: str | None = None) -> Suppress:
        return cls(tuple(int(i) for i in ids), label)

    def multipliers(self, num_prototypes: int) -> torch.Tensor:
        """(K,) float64: 0 at ``ids``, 1 elsewhere."""
        m = torch.ones(num_prototypes, dtype=torch.float64)
        if self.ids:
            m[torch.tensor(check_ids(self.ids, num_prototypes), dtype=torch.long)] = 0.0
        return m


@dataclass(frozen=True)
class Control:
    """A sparse linear controller: prototype i's slice is re-weighted by (1 + c_i)."""

    coefficients: torch.Tensor
    """(K,) c; zero entries leave their prototypes untouched."""
    label: str | None = None

    def multipliers(self, num_prototypes: int) -> torch.Tensor:
        return 1.0 + _per_prototype(self.coefficients, num_prototypes, "controller coefficients")


@dataclass(frozen=True)
class Scale:
    """Multiply prototype i's slice by ``multipliers[i]`` (0 removes it, 2 doubles it)."""

    factors: torch.Tensor
    """(K,) m."""
    label: str | None = None

    def multipliers(self, num_prototypes: int) -> torch.Tensor:
        return _per_prototype(self.factors, num_prototypes, "scale factors")


Intervention = Suppress | Control | Scale


def check_ids(ids: Sequence[int] | torch.Tensor, num_prototypes: int) -> list[int]:
    """Validate prototype ids against a bank of ``num_prototypes``; ``ModelError`` naming the bad ids."""
    raw = ids.flatten().tolist() if isinstance(ids, torch.Tensor) else list(ids)
    bad_type = [i for i in raw if isinstance(i, bool) or not isinstance(i, int)
                and not (isinstance(i, float) and i.is_integer())]
    if bad_type:
        raise ModelError(f"prototype ids must be integers, got {bad_type[:5]}")
    out = [int(i) for i in raw]
    unknown = sorted({i for i in out if not 0 <= i < num_prototypes})
    if unknown:
        raise UnknownPrototypeError(f"unknown prototype id(s) {unknown[:10]}{' …' if len(unknown) > 10 else ''}: "
                         f"this model has {num_prototypes} prototypes (ids 0–{num_prototypes - 1})")
    return out


def combined_multipliers(interventions: Iterable[Intervention], num_prototypes: int) -> torch.Tensor | None:
    """The product of the interventions' multipliers (K,), or ``None`` when there are none."""
    m: torch.Tensor | None = None
    for iv in interventions:
        mi = iv.multipliers(num_prototypes)
        m = mi if m is None else m * mi
    return m


def _per_prototype(t: torch.Tensor, num_prototypes: int, what: str) -> torch.Tensor:
    """A (K,) tensor as float64 on the CPU, detached (multipliers are combined in float64 and cast to the
    model's dtype once); ``ModelError`` for another shape."""
    if tuple(t.shape) != (num_prototypes,):
        raise ModelError(f"{what} must have shape ({num_prototypes},), got {tuple(t.shape)}")
    return t.detach().to(torch.float64).cpu()
