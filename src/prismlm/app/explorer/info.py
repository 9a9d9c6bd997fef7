"""The explorer's ``/api/info`` view (``RunInfo``): the run, its model's shape, the artifacts found, the
categories, the concept sets a request can name, and the limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

from prismlm.app.explorer.plain import JSONDict, Plain
from prismlm.app.explorer.session import Session
from prismlm.explain.labels import CATEGORIES

__all__ = ["ConceptInfo", "ModelShape", "RunInfo", "run_info"]


class ModelShape(TypedDict):
    backbone: str
    n_layer: int
    n_embd: int
    vocab_size: int
    block_size: int
    num_prototypes: int
    top_k: int | None
    """Active prototypes per position (None: the run's config has no prototype layer settings)."""
    bias: bool
    """Whether the LM head has a bias (a waterfall's ``bias`` part)."""
    parameters: int


class ConceptInfo(TypedDict):
    ids: list[int]
    share: float
    """len(ids) / number of prototypes."""
    concept: str | None


@dataclass
class RunInfo(Plain):
    """What the explorer serves: the run, its model, what artifacts it found, the limits."""

    run: str
    step: int | None
    model: ModelShape
    has_index: bool
    has_cache: bool
    index_tokens: int | None
    coverage: dict[str, float]
    categories: list[str]
    concepts: dict[str, ConceptInfo]
    """name → {ids, share, concept}: the suppression sets a request can name."""
    interventions: list[str]
    """Interventions applied to every request (the checkpoint's suppression set)."""
    limits: JSONDict
    chat: bool = False
    """Whether the run has a chat template (the Explain and Steer views then take a chat message)."""
    notes: list[str] = field(default_factory=list)
    """Problems the server works around (e.g. a corrupt labels.json, served without labels), with their fix."""


def model_shape(s: Session) -> ModelShape:
    cfg = s.model.config
    protos = s.run.config.model.prototypes
    return {
        "backbone": getattr(cfg, "backbone", "gpt"),
        "n_layer": cfg.n_layer,
        "n_embd": cfg.n_embd,
        "vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size,
        "num_prototypes": s.model.require_prototypes().num_prototypes,
        "top_k": protos.top_k if protos else None,
        "bias": s.model.lm_head.bias is not None,
        "parameters": s.model.num_parameters(),
    }


def notes(s: Session) -> list[str]:
    """A corrupt labels.json, with its fix (the run is served without labels)."""
    if s.index is None:
        return []
    s.index.labels()  # re-reads labels.json if it changed; a corrupt one leaves labels_error
    err = s.index.labels_error
    return [f"served without labels: {err.replace('RUN', str(s.run.path))}"] if err else []


def run_info(s: Session) -> RunInfo:
    """The run, model shape, artifacts found, categories, concept sets and limits."""
    return RunInfo(
        run=s.run.folder.name,
        step=s.run.step,
        model=model_shape(s),
        has_index=s.index is not None,
        has_cache=s.has_cache,
        chat=bool(s.run.tokenizer.chat_template),
        index_tokens=s.index.tokens if s.index is not None else None,
        coverage=dict(s.index.coverage()) if s.index is not None else {},
        categories=list(CATEGORIES),
        concepts={k: {"ids": c.ids, "share": c.share, "concept": c.concept} for k, c in s.concepts.items()},
        interventions=[iv.label or type(iv).__name__ for iv in s.run.interventions],
        limits=s.limits.to_dict(),
        notes=notes(s),
    )
