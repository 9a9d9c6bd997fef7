"""Suppression sets: which prototypes to switch off, why, and for which model (spec §4).

A ``SuppressionSet`` is a small JSON artifact (ids, bank size, ``model_sha256``, concept, residual mode,
evidence), applied with ``with model.intervene(set.intervention()):``; next to a checkpoint as
``suppression.json`` it applies by default. Loading one made for another model (hash or bank size) fails
naming both. Format: docs/architecture.md (suppression sets).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict

from prismlm.artifacts import JSON, atomic_write_text
from prismlm.errors import SuppressionError
from prismlm.model.interventions import MODES_HELP, RESIDUAL_MODES, Suppress

if TYPE_CHECKING:
    from prismlm.model import PrismLM

KIND = "prismlm-suppression"
FORMAT_VERSION = 2
"""Version 2 adds ``residual`` (keep/project/mean). A set that keeps the residual is still written as version 1,
byte for byte the old format, so older prismlm reads it; a projecting set (``project`` or ``mean``) is version
2, which older prismlm refuses rather than applying it without the projection (one that knows version 2 but
not ``mean`` refuses the unknown mode by name). Version 1 files load with ``residual="keep"``."""
READABLE_VERSIONS = (1, 2)
CHECKPOINT_FILE = "suppression.json"


class Neighbour(TypedDict, total=False):
    """A training snippet near a prototype (``PrototypeIndex.neighbours``)."""

    doc_id: str | None
    snippet: str
    similarity: float
    """Absent in controller traces."""


class PrototypeEvidence(TypedDict, total=False):
    """Why ``find_concept`` ranked a prototype: its scores (every candidate), then ``purity`` (with an index),
    ``selected``, and for a selected one its signature tokens, label and training neighbours. A set's
    ``evidence`` holds the selected ones without ``selected``; a set read from a file may hold any subset."""

    id: int
    contribution_nats_per_token: float
    target_effect: float
    """Its slice on the concept's target tokens where they are predicted, logits per target position."""
    log2_enrichment: float
    enrichment: float
    concept_rate: float
    neutral_rate: float
    concept_count: int
    neutral_count: int
    purity: float | None
    selected: bool
    signature_top_tokens: list[str]
    label: str | None
    neighbours: list[Neighbour]


class SuppressionRecord(TypedDict):
    """``SuppressionSet.to_dict()``: the ``suppression.json`` file (keys in this order)."""

    kind: str
    format_version: int
    ids: list[int]
    num_prototypes: int
    model_sha256: str | None
    concept: str | None
    share: float
    evidence: dict[str, PrototypeEvidence]
    meta: dict[str, JSON]
    created: str
    residual: NotRequired[str]
    """Version 2 only: ``keep`` or ``project``."""


@dataclass
class SuppressionSet:
    """Prototype ids to switch off, with the evidence for each and the model they belong to."""

    ids: list[int]
    """Prototype ids, sorted, unique."""
    num_prototypes: int
    """K of the model the set was made for."""
    model_sha256: str | None = None
    """sha256 of that model's weights (``manifest.json``); None: not bound to one checkpoint."""
    concept: str | None = None
    """What the set removes (free text)."""
    evidence: dict[int, PrototypeEvidence] = field(default_factory=dict)
    """Per-prototype evidence (enrichment, purity, label, neighbour snippets…)."""
    meta: dict[str, JSON] = field(default_factory=dict)
    """How the set was chosen (method, budget/threshold, text counts…)."""
    residual: str = "keep"
    """``keep``: remove the prototypes' slices only; ``project``: also project the residual off the span of
    their vectors (``Suppress(ids, residual="project")``); ``mean``: off their unit mean direction only
    (``Suppress(ids, residual="mean")``); ``contrast``: off the unit difference between their mean and the
    bank's mean (``Suppress(ids, residual="contrast")``)."""

    def __post_init__(self) -> None:
        if self.residual not in RESIDUAL_MODES:
            raise SuppressionError(
                f"suppression set residual mode must be one of {', '.join(RESIDUAL_MODES)}, got {self.residual!r}",
                fix=f"use 'keep' (remove the slices), {MODES_HELP}",
            )
        if not isinstance(self.ids, (list, tuple)) or any(
            isinstance(i, bool) or not isinstance(i, int) for i in self.ids
        ):
            raise SuppressionError(f"suppression set ids must be a list of integers, got {self.ids!r:.80}")
        if isinstance(self.num_prototypes, bool) or not isinstance(self.num_prototypes, int) or self.num_prototypes < 1:
            raise SuppressionError(
                f"suppression set num_prototypes must be a positive integer, got {self.num_prototypes!r}"
            )
        ids = [int(i) for i in self.ids]
        bad = sorted({i for i in ids if not 0 <= i < self.num_prototypes})
        if bad:
            raise SuppressionError(
                f"suppression set has unknown prototype id(s) {bad[:10]} for a bank of {self.num_prototypes} prototypes"
            )
        self.ids = sorted(set(ids))
        self.evidence = {int(k): v for k, v in self.evidence.items()}

    @property
    def share(self) -> float:
        """Fraction of the bank suppressed (paper: 86 / 16,384 = 0.52%)."""
        return len(self.ids) / self.num_prototypes

    def subset(self, ids: Sequence[int]) -> SuppressionSet:
        """The same set restricted to ``ids`` (evidence kept for those; every id must be in the set)."""
        missing = sorted(set(int(i) for i in ids) - set(self.ids))
        if missing:
            raise SuppressionError(f"prototype id(s) {missing[:10]} are not in this suppression set")
        keep = {int(i) for i in ids}
        return SuppressionSet(
            ids=sorted(keep),
            num_prototypes=self.num_prototypes,
            model_sha256=self.model_sha256,
            concept=self.concept,
            evidence={i: e for i, e in self.evidence.items() if i in keep},
            meta={**self.meta, "subset_of": len(self.ids)},
            residual=self.residual,
        )

    def to_dict(self) -> SuppressionRecord:
        out: SuppressionRecord = {
            "kind": KIND,
            "format_version": FORMAT_VERSION if self.residual != "keep" else 1,
            "ids": self.ids,
            "num_prototypes": self.num_prototypes,
            "model_sha256": self.model_sha256,
            "concept": self.concept,
            "share": self.share,
            "evidence": {str(k): v for k, v in sorted(self.evidence.items())},
            "meta": self.meta,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if self.residual != "keep":
            out["residual"] = self.residual
        return out

    def save(self, path: str | Path) -> Path:
        """Write JSON to ``path`` (a file, or a checkpoint folder → ``suppression.json`` in it)."""
        path = Path(path)
        if path.is_dir():
            path = path / CHECKPOINT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> SuppressionSet:
        path = Path(path)
        if path.is_dir():
            path = path / CHECKPOINT_FILE
        if not path.exists():
            raise SuppressionError(f"no suppression set at {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise SuppressionError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(d, dict) or d.get("kind") != KIND:
            raise SuppressionError(
                f"{path} is not a suppression set (kind {d.get('kind') if isinstance(d, dict) else None!r}, "
                f"expected {KIND!r}); make one with `prism concept`"
            )
        if d.get("format_version") not in READABLE_VERSIONS:
            raise SuppressionError(
                f"{path}: format_version {d.get('format_version')!r}, this prismlm reads {READABLE_VERSIONS}",
                fix="upgrade prismlm, or make the set again with `prism concept`",
            )
        missing = [k for k in ("ids", "num_prototypes") if k not in d]
        if missing:
            raise SuppressionError(f"{path} lacks {', '.join(missing)}; make the set with `prism concept`")
        return cls(
            ids=d["ids"],
            num_prototypes=d["num_prototypes"],
            model_sha256=d.get("model_sha256"),
            concept=d.get("concept"),
            evidence=d.get("evidence", {}),
            meta=d.get("meta", {}),
            residual=d.get("residual", "keep") if d["format_version"] >= 2 else "keep",
        )

    def check(self, model: PrismLM, model_sha256: str | None = None) -> None:
        """Raise ``SuppressionError`` unless the set fits ``model`` (bank size, and weights hash when both known)."""
        if model.prototypes is None:
            raise SuppressionError("the dense baseline has no prototypes to suppress")
        K = model.prototypes.num_prototypes
        if K != self.num_prototypes:
            raise SuppressionError(
                f"suppression set was made for a bank of {self.num_prototypes} prototypes; this model has {K}"
            )
        if model_sha256 and self.model_sha256 and model_sha256 != self.model_sha256:
            raise SuppressionError(
                f"suppression set was made for model {self.model_sha256[:12]}…, "
                f"not this checkpoint ({model_sha256[:12]}…)"
            )

    def intervention(self) -> Suppress:
        """This set as an intervention value: ``with model.intervene(sset.intervention()):``."""
        return Suppress.of(self.ids, self.concept, residual=self.residual)
