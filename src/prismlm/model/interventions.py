"""Interventions as values: suppression, controllers and scaling of prototype slices (spec §4).

Each is a per-prototype multiplier m (K,) on the logit slices, ℓ' = W r + Σ_i m_i a_i W p_i: ``Suppress``
(m_i = 0), ``Control`` (m_i = 1 + c_i), ``Scale`` (m_i given). ``Suppress(ids, residual="project")`` also
edits the residual: r' = r − Q Qᵀ r, Q an orthonormal basis of span{p_i : i ∈ ids} (``ResidualProjection``);
``residual="mean"`` takes out one direction only, Q = u = Σ_{i∈ids} p_i / ‖Σ_{i∈ids} p_i‖;
``residual="contrast"`` the one direction that tells the set from the bank, Q = v = (p̄_ids − p̄_bank) /
‖p̄_ids − p̄_bank‖ (a difference of means). Either way ℓ' = W r' + Σ_i m_i a_i W p_i. Immutable; ``with model.intervene(*ivs):`` combines them and always
restores the model. See docs/architecture.md (interventions).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from prismlm.errors import ModelError, UnknownPrototypeError
from prismlm.model.prototypes import PrototypeOutput

RESIDUAL_MODES = ("keep", "project", "mean", "contrast")
"""What ``Suppress`` does to the residual r: ``keep`` it (only the slices go), ``project`` it off the span
of the suppressed prototypes, off their unit ``mean`` direction u = Σ p_i / ‖Σ p_i‖ (one dimension, not
|ids|: the span of a large set takes too much of a small residual with it), or off their ``contrast``
direction v = unit(p̄_ids − p̄_bank): the mean of the set's prototypes minus the mean of the whole bank's.
Why contrast: every prototype of a retrofitted bank shares the backbone's common direction (the mean of its
hidden states), so u is mostly that common direction and taking it out costs every text alike; the
difference of means keeps only what sets the concept's anchor contexts apart (the prototypes are those
contexts' states), as a difference-of-means steering direction does."""

PROJECTING_MODES = ("project", "mean", "contrast")
"""The residual modes that edit the residual (``ResidualProjection`` computes each one's basis)."""


MODES_HELP = (
    "'project' (also project the residual off the suppressed prototypes' span), 'mean' (off their unit mean "
    "direction) or 'contrast' (off the unit difference between their mean and the bank's mean)"
)
"""The residual-editing modes in words, for error messages and help texts."""


@dataclass(frozen=True)
class Suppress:
    """Switch prototypes off: their slices a_i W p_i are removed from every logit.

    ``Suppress([3, 7])`` (any iterable of ids, or a tensor of them); the ids are checked to be integers
    here and against the bank's size when applied. ``residual="project"`` also takes the prototypes'
    directions out of the residual (r' = r − Q Qᵀ r, see ``ResidualProjection``): the slices alone leave
    whatever of the concept the residual writes. ``residual="mean"`` takes out a single direction,
    u = Σ_{i∈ids} p_i / ‖Σ_{i∈ids} p_i‖ (r' = r − u uᵀ r)."""

    ids: tuple[int, ...]
    """Prototype ids in [0, K)."""
    label: str | None = None
    """What the set stands for (a concept name, a file), for reports."""
    residual: str = "keep"
    """``keep``: the residual is untouched (exact slice removal); ``project``: r is projected off
    span{p_i : i ∈ ids} as well; ``mean``: r is projected off the unit mean u of {p_i : i ∈ ids};
    ``contrast``: off v = unit(mean of {p_i : i ∈ ids} − mean of the bank)."""

    def __post_init__(self) -> None:
        if self.residual not in RESIDUAL_MODES:
            raise ModelError(
                f"Suppress: residual must be one of {', '.join(RESIDUAL_MODES)}, got {self.residual!r}",
                fix=f"use residual='keep' (remove the slices only) or a residual edit: {MODES_HELP}",
            )
        if isinstance(self.ids, Mapping):
            raise ModelError(
                "Suppress takes prototype ids (Suppress([3, 7])), not a mapping; for per-prototype "
                "factors use Scale({id: factor}) (Scale({3: 0.0}) suppresses prototype 3)"
            )
        ids = self.ids.flatten().tolist() if isinstance(self.ids, torch.Tensor) else list(self.ids)
        object.__setattr__(self, "ids", tuple(_proto_id(i, "Suppress") for i in ids))

    @classmethod
    def of(cls, ids: Iterable[int], label: str | None = None, residual: str = "keep") -> Suppress:
        return cls(tuple(int(i) for i in ids), label, residual)

    def multipliers(self, num_prototypes: int) -> torch.Tensor:
        """(K,) float64: 0 at ``ids``, 1 elsewhere."""
        m = torch.ones(num_prototypes, dtype=torch.float64)
        if self.ids:
            m[torch.tensor(check_ids(self.ids, num_prototypes), dtype=torch.long)] = 0.0
        return m


@dataclass(frozen=True)
class Control:
    """A sparse linear controller: prototype i's slice is re-weighted by (1 + c_i).

    ``Control(c)`` with c a (K,) tensor, or ``Control({id: c_i})`` for a few prototypes (the others 0) —
    the mapping the web API takes; keys and values are checked here, ids against K when applied."""

    coefficients: torch.Tensor | Mapping[int, float]
    """(K,) c, or {id: c_i}; zero entries leave their prototypes untouched."""
    label: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "coefficients", _per_prototype_values(self.coefficients, "Control"))

    def multipliers(self, num_prototypes: int) -> torch.Tensor:
        return 1.0 + _per_prototype(self.coefficients, num_prototypes, "controller coefficients", default=0.0)


@dataclass(frozen=True)
class Scale:
    """Multiply prototype i's slice by ``factors[i]`` (0 removes it, 2 doubles it).

    ``Scale(m)`` with m a (K,) tensor, or ``Scale({id: factor})`` for a few prototypes (the others 1) —
    the mapping the web API takes; keys and values are checked here, ids against K when applied."""

    factors: torch.Tensor | Mapping[int, float]
    """(K,) m, or {id: m_i}."""
    label: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "factors", _per_prototype_values(self.factors, "Scale"))

    def multipliers(self, num_prototypes: int) -> torch.Tensor:
        return _per_prototype(self.factors, num_prototypes, "scale factors", default=1.0)


Intervention = Suppress | Control | Scale


def check_ids(ids: Sequence[int] | torch.Tensor, num_prototypes: int) -> list[int]:
    """Validate prototype ids against a bank of ``num_prototypes``; ``ModelError`` naming the bad ids."""
    raw = ids.flatten().tolist() if isinstance(ids, torch.Tensor) else list(ids)
    bad_type = [
        i
        for i in raw
        if isinstance(i, bool) or not isinstance(i, int) and not (isinstance(i, float) and i.is_integer())
    ]
    if bad_type:
        raise ModelError(f"prototype ids must be integers, got {bad_type[:5]}")
    out = [int(i) for i in raw]
    unknown = sorted({i for i in out if not 0 <= i < num_prototypes})
    if unknown:
        raise UnknownPrototypeError(
            f"unknown prototype id(s) {unknown[:10]}{' …' if len(unknown) > 10 else ''}: "
            f"this model has {num_prototypes} prototypes (ids 0–{num_prototypes - 1})"
        )
    return out


def combined_multipliers(interventions: Iterable[Intervention], num_prototypes: int) -> torch.Tensor | None:
    """The product of the interventions' multipliers (K,), or ``None`` when there are none."""
    m: torch.Tensor | None = None
    for iv in interventions:
        mi = iv.multipliers(num_prototypes)
        m = mi if m is None else m * mi
    return m


def projected_ids(interventions: Iterable[Intervention]) -> tuple[int, ...]:
    """The sorted union of the ids of every residual-editing ``Suppress`` (``residual="project"`` or
    ``"mean"``) among ``interventions``."""
    ids = {i for iv in interventions if isinstance(iv, Suppress) and iv.residual in PROJECTING_MODES for i in iv.ids}
    return tuple(sorted(ids))


def projection_mode(interventions: Iterable[Intervention]) -> str | None:
    """The residual mode shared by every residual-editing ``Suppress`` among ``interventions`` (``project``
    or ``mean``), or ``None`` when none edits the residual.

    Several suppressions of one mode combine as one over the union of their ids (``project``: the span of
    the union, which is also the span of their spans; ``mean``: the unit mean of the union's prototypes, each
    counted once, i.e. ``Suppress(A ∪ B, residual="mean")``). Mixing the two modes has no such single edit,
    so it is refused (``ModelError``) rather than silently picking one."""
    modes = {iv.residual for iv in interventions if isinstance(iv, Suppress) and iv.residual in PROJECTING_MODES}
    return check_one_mode(modes)


def check_one_mode(modes: Iterable[str]) -> str | None:
    """The one residual mode in ``modes`` (``None`` if empty); ``ModelError`` naming the fix for two."""
    distinct = sorted(set(modes))
    if len(distinct) > 1:
        raise ModelError(
            f"cannot combine residual modes {' and '.join(repr(m) for m in distinct)} in one intervention: "
            "projections off different subspaces have no single combined edit",
            fix="give every Suppress the same residual mode (e.g. all residual='mean'), or suppress the "
            "others with residual='keep'",
        )
    return distinct[0] if distinct else None


def orthonormal_basis(vectors: torch.Tensor) -> torch.Tensor:
    """(n, d) vectors → (d, q) float64 Q with orthonormal columns spanning them (q = their rank ≤ min(n, d)).

    Why an SVD rather than a plain QR: a bank may hold (near-)parallel prototypes, and QR of a rank-deficient
    matrix returns columns outside the span; singular values below the usual rank tolerance
    (σ_max · max(n, d) · eps, as ``torch.linalg.matrix_rank``) are dropped instead."""
    a = vectors.detach().to("cpu", torch.float64).T  # (d, n): on the CPU, so every device gets the same Q
    if a.shape[1] == 0:
        return a.new_zeros(a.shape[0], 0)
    u, s, _ = torch.linalg.svd(a, full_matrices=False)  # u (d, min(d, n)), s descending
    tol = s[0] * max(a.shape) * torch.finfo(torch.float64).eps
    return u[:, s > tol]  # (d, q)


def contrast_direction(vectors: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
    """(n, d) vectors, (K, d) bank → (d, 1) float64 v = (v̄ − b̄) / ‖v̄ − b̄‖, the unit difference between the
    vectors' mean and the bank's mean, or (d, 0) when the means coincide (below (‖v̄‖ + ‖b̄‖) · K · eps: a set
    that is the whole bank has no contrast, so nothing is taken out)."""
    v = vectors.detach().to("cpu", torch.float64)  # on the CPU, so every device gets the same v
    b = bank.detach().to("cpu", torch.float64)
    if v.shape[0] == 0 or b.shape[0] == 0:
        return v.new_zeros(v.shape[1], 0)
    v_mean, b_mean = v.mean(dim=0), b.mean(dim=0)  # (d,), (d,)
    diff = v_mean - b_mean
    norm = torch.linalg.vector_norm(diff)
    tol = (torch.linalg.vector_norm(v_mean) + torch.linalg.vector_norm(b_mean)) * b.shape[0] * torch.finfo(b.dtype).eps
    if not norm > tol:
        return v.new_zeros(v.shape[1], 0)
    return (diff / norm)[:, None]


def mean_direction(vectors: torch.Tensor) -> torch.Tensor:
    """(n, d) vectors → (d, 1) float64 u = Σ_i v_i / ‖Σ_i v_i‖, or (d, 0) when the sum vanishes (below
    Σ_i ‖v_i‖ · n · eps: cancelling vectors have no mean direction, so nothing is taken out)."""
    v = vectors.detach().to("cpu", torch.float64)  # on the CPU, so every device gets the same u
    total = v.sum(dim=0)  # (d,)
    norm = torch.linalg.vector_norm(total)
    tol = torch.linalg.vector_norm(v, dim=1).sum() * max(v.shape[0], 1) * torch.finfo(torch.float64).eps
    if v.shape[0] == 0 or not norm > tol:
        return v.new_zeros(v.shape[1], 0)
    return (total / norm)[:, None]


@dataclass(frozen=True)
class ResidualProjection:
    """The residual edit of ``Suppress(ids, residual="project"|"mean")``: r' = r − Q Qᵀ r, computed once (in
    float64) when the intervention is entered. ``project``: Q (d, q) an orthonormal basis of
    span{p_i : i ∈ ids}; ``mean``: Q = u (d, 1), u = Σ_{i∈ids} p_i / ‖Σ_{i∈ids} p_i‖; ``contrast``: Q = v
    (d, 1), v = unit(p̄_ids − p̄_bank)."""

    ids: tuple[int, ...]
    """The prototypes the removed direction(s) come from (sorted, unique)."""
    basis: torch.Tensor
    """(d, q) Q, on the bank's device and in its dtype (q = 1 for ``mean`` and ``contrast``, q ≤ |ids| for
    ``project``)."""
    mode: str = "project"
    """``project`` (the span), ``mean`` (the unit mean direction) or ``contrast`` (the unit difference of
    means, set vs bank)."""

    @classmethod
    def of(cls, ids: Sequence[int], prototypes: torch.Tensor, mode: str = "project") -> ResidualProjection:
        """The projection off the span (``project``), the unit mean (``mean``) or the contrast with the bank
        (``contrast``) of ``prototypes[ids]`` (prototypes: the (K, d) bank)."""
        if mode not in PROJECTING_MODES:
            raise ModelError(
                f"ResidualProjection: mode must be one of {', '.join(PROJECTING_MODES)}, got {mode!r}",
                fix=f"use mode={MODES_HELP}",
            )
        ids = tuple(sorted(set(check_ids(ids, prototypes.shape[0]))))
        rows = prototypes[list(ids)]
        if mode == "project":
            q = orthonormal_basis(rows)
        elif mode == "mean":
            q = mean_direction(rows)
        else:
            q = contrast_direction(rows, prototypes)
        return cls(ids, q.to(device=prototypes.device, dtype=prototypes.dtype), mode)

    def removed(self, residual: torch.Tensor) -> torch.Tensor:
        """(N, d) r → (N, d) Q Qᵀ r, the component of r in the span (what the edit takes out)."""
        q = self.basis.to(residual.dtype)
        return (residual @ q) @ q.T  # (N, q) → (N, d)


def edited_hidden(
    z: torch.Tensor,
    po: PrototypeOutput,
    bank: torch.Tensor,
    mult: torch.Tensor | None,
    projection: ResidualProjection | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The hidden states whose logits are the intervened ones, and the part of the residual removed.

    z (N, d), ``po`` the prototype layer's output for z, ``bank`` (K, d) → (z' (N, d), Q Qᵀ r (N, d) or None),
    with z' = z + Σ_i (m_i − 1) a_i p_i − Q Qᵀ r = Σ_i m_i a_i p_i + r', so ``lm_head(z')`` = W r' + Σ_i m_i a_i
    W p_i (+ b) exactly: the slices of prototypes with m_i = 1 untouched, a suppressed one (m_i = 0) removed."""
    z_mod = z
    if mult is not None:
        a = po.activations * (mult[po.indices].to(po.activations.dtype) - 1.0)  # (N, k)
        delta = torch.einsum("nk,nkd->nd", a, bank[po.indices].to(a.dtype))  # (N, d)
        z_mod = (z.to(delta.dtype) + delta).to(z.dtype)
    if projection is None:
        return z_mod, None
    removed = projection.removed(po.residual)  # (N, d)
    return (z_mod.to(removed.dtype) - removed).to(z.dtype), removed


def _proto_id(i: object, what: str) -> int:
    """One prototype id: an integer (or an integral float, or a string of digits, as JSON keys are) ≥ 0."""
    if isinstance(i, str) and i.strip().isdigit():
        return int(i)
    integral = isinstance(i, numbers.Integral) or (isinstance(i, float) and i.is_integer())
    if isinstance(i, bool) or not integral or i < 0:  # type: ignore[operator]
        raise ModelError(f"{what}: prototype ids must be non-negative integers, got {i!r}")
    return int(i)  # type: ignore[call-overload]


def _per_prototype_values(values: object, what: str) -> torch.Tensor | dict[int, float]:
    """A constructor argument of ``Control``/``Scale`` checked at construction: a 1-D tensor (or a
    sequence of K numbers, made a float64 tensor), or a mapping {id: finite number} (ids sorted)."""
    if isinstance(values, Mapping):
        out: dict[int, float] = {}
        for k, v in values.items():
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ModelError(f"{what}: the value of prototype {k!r} must be a finite number, got {v!r}")
            out[_proto_id(k, what)] = float(v)
        return dict(sorted(out.items()))
    if not isinstance(values, torch.Tensor):
        if not isinstance(values, Sequence) or isinstance(values, str):
            raise ModelError(
                f"{what} takes a (K,) tensor or a mapping {{prototype id: value}}, got {type(values).__name__}"
            )
        values = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if values.dim() != 1:
        raise ModelError(f"{what}: a tensor of per-prototype values must be 1-D (K,), got shape {tuple(values.shape)}")
    return values


def _per_prototype(
    t: torch.Tensor | Mapping[int, float], num_prototypes: int, what: str, *, default: float
) -> torch.Tensor:
    """A (K,) tensor as float64 on the CPU, detached (multipliers are combined in float64 and cast to the
    model's dtype once); ``ModelError`` for another shape. A mapping fills ``default`` everywhere else."""
    if isinstance(t, Mapping):
        out = torch.full((num_prototypes,), default, dtype=torch.float64)
        if t:
            ids = torch.tensor(check_ids(list(t), num_prototypes), dtype=torch.long)
            out[ids] = torch.tensor(list(t.values()), dtype=torch.float64)
        return out
    if tuple(t.shape) != (num_prototypes,):
        raise ModelError(f"{what} must have shape ({num_prototypes},), got {tuple(t.shape)}")
    return t.detach().to(torch.float64).cpu()
